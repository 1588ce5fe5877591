//! Payload segments: where the outbox keeps the payloads of batches that cannot be rebuilt.
//!
//! sled 0.34 writes every value above its blob threshold to a file of its own and, in an endless
//! run, does not remove those files after their keys are deleted. So payloads live outside sled,
//! in append-only segment files, one series per queue (`payloads/<hex queue key>/<id>`), and sled
//! keeps only their location. A queue is acknowledged strictly in order, so the dead bytes of a
//! series are only ever at the head of its oldest segment; once a segment is full
//! ([`SEGMENT_ROLL_BYTES`]) the next payload opens a new one, and a segment is deleted as soon as
//! its last batch is acknowledged. The disk a queue holds is therefore its undelivered payloads
//! plus less than one segment.
//!
//! Ordering within a commit group: payloads are appended and fsynced before the sled transactions
//! that reference them are applied, and segments are deleted only after the acknowledgements that
//! freed them are durable. A crash can leave unreferenced bytes (a payload appended for a commit
//! that did not happen): they share their segment's fate, and a segment no batch references is
//! deleted at the next open.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::fs::{File, OpenOptions};
use std::io::Write;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use crate::error::StateError;
use crate::types::PayloadRef;

/// A segment takes no more payloads once it holds this many bytes.
pub const SEGMENT_ROLL_BYTES: u64 = 4 << 20;

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

struct Active {
    id: u64,
    file: File,
    len: u64,
}

#[derive(Default)]
struct Series {
    active: Option<Active>,
    /// Segment id -> batches that reference it.
    live: BTreeMap<u64, u64>,
    next_id: u64,
}

pub(crate) struct Segments {
    root: PathBuf,
    fsync: bool,
    series: HashMap<Vec<u8>, Series>,
    /// Segments (queue, id) and directories written since the last [`Segments::sync`].
    dirty_files: HashSet<(Vec<u8>, u64)>,
    dirty_dirs: HashSet<PathBuf>,
    /// Segments freed by acknowledgements not yet durable.
    freed: Vec<PathBuf>,
}

impl Segments {
    /// Opens the segment directory of a store; `referenced` are the locations of every stored
    /// payload (from sled). Segments that nothing references are deleted.
    pub(crate) fn open(
        store_dir: &Path,
        fsync: bool,
        referenced: &[(Vec<u8>, u64)],
    ) -> Result<Segments, StateError> {
        let root = store_dir.join("payloads");
        std::fs::create_dir_all(&root)
            .map_err(StateError::io("creation of payload directory", &root))?;
        let mut segments = Segments {
            root,
            fsync,
            series: HashMap::new(),
            dirty_files: HashSet::new(),
            dirty_dirs: HashSet::new(),
            freed: Vec::new(),
        };
        for (queue, segment) in referenced {
            *segments
                .series
                .entry(queue.clone())
                .or_default()
                .live
                .entry(*segment)
                .or_default() += 1;
        }
        segments.remove_unreferenced()?;
        Ok(segments)
    }

    fn series_dir(&self, queue: &[u8]) -> PathBuf {
        self.root.join(hex(queue))
    }

    fn segment_path(&self, queue: &[u8], id: u64) -> PathBuf {
        self.series_dir(queue).join(format!("{id:016x}"))
    }

    fn remove_unreferenced(&mut self) -> Result<(), StateError> {
        let root = self.root.clone();
        let dirs = std::fs::read_dir(&root)
            .map_err(StateError::io("listing of payload directory", &root))?;
        let by_hex: HashMap<String, Vec<u8>> = self
            .series
            .keys()
            .map(|queue| (hex(queue), queue.clone()))
            .collect();
        for dir in dirs {
            let dir = dir.map_err(StateError::io("listing of payload directory", &root))?;
            let name = dir.file_name().to_string_lossy().into_owned();
            let path = dir.path();
            let queue = by_hex.get(&name);
            let files =
                std::fs::read_dir(&path).map_err(StateError::io("listing of segments", &path))?;
            for file in files {
                let file = file.map_err(StateError::io("listing of segments", &path))?;
                let id = u64::from_str_radix(&file.file_name().to_string_lossy(), 16).ok();
                let series = queue.and_then(|q| self.series.get_mut(q));
                match (id, series) {
                    (Some(id), Some(series)) if series.live.contains_key(&id) => {
                        series.next_id = series.next_id.max(id + 1);
                    }
                    _ => {
                        let file = file.path();
                        std::fs::remove_file(&file)
                            .map_err(StateError::io("removal of segment", &file))?;
                        self.dirty_dirs.insert(path.clone());
                    }
                }
            }
        }
        Ok(())
    }

    /// Appends a payload to its queue's active segment (not yet durable: see [`Segments::sync`]).
    pub(crate) fn append(
        &mut self,
        queue: &[u8],
        payload: &[u8],
        checksum: u64,
    ) -> Result<PayloadRef, StateError> {
        let dir = self.series_dir(queue);
        let series = self.series.entry(queue.to_vec()).or_default();
        let needs_new = series
            .active
            .as_ref()
            .is_none_or(|a| a.len >= SEGMENT_ROLL_BYTES);
        if needs_new {
            if let Some(old) = series.active.take() {
                if !series.live.contains_key(&old.id) {
                    self.freed.push(dir.join(format!("{:016x}", old.id)));
                }
            }
            if !dir.exists() {
                std::fs::create_dir_all(&dir)
                    .map_err(StateError::io("creation of segment directory", &dir))?;
                self.dirty_dirs.insert(self.root.clone());
            }
            let id = series.next_id;
            series.next_id += 1;
            let path = dir.join(format!("{id:016x}"));
            let file = OpenOptions::new()
                .create_new(true)
                .append(true)
                .read(true)
                .open(&path)
                .map_err(StateError::io("creation of segment", &path))?;
            self.dirty_dirs.insert(dir.clone());
            series.active = Some(Active { id, file, len: 0 });
        }
        let Some(active) = series.active.as_mut() else {
            return Err(StateError::Closed);
        };
        let path = dir.join(format!("{:016x}", active.id));
        if let Err(e) = active.file.write_all(payload) {
            // Part of the payload may be in the file: later payloads go to a new segment so
            // that every recorded offset stays right.
            series.active = None;
            return Err(StateError::io("write of segment", &path)(e));
        }
        let location = PayloadRef {
            segment: active.id,
            offset: active.len,
            len: payload.len() as u64,
            checksum,
        };
        active.len += payload.len() as u64;
        self.dirty_files.insert((queue.to_vec(), location.segment));
        Ok(location)
    }

    /// A batch referencing `segment` was committed.
    pub(crate) fn referenced(&mut self, queue: &[u8], segment: u64) {
        // The segment may have rolled (or lost its last batch to an acknowledgement) in this
        // group before this commit was counted: it is in use again.
        let path = self.segment_path(queue, segment);
        self.freed.retain(|freed| *freed != path);
        *self
            .series
            .entry(queue.to_vec())
            .or_default()
            .live
            .entry(segment)
            .or_default() += 1;
    }

    /// A batch referencing `segment` was acknowledged; the segment is deleted (after the next
    /// durable group) once nothing references it and it takes no more payloads.
    pub(crate) fn released(&mut self, queue: &[u8], segment: u64) {
        let path = self.segment_path(queue, segment);
        let Some(series) = self.series.get_mut(queue) else {
            return;
        };
        let Some(count) = series.live.get_mut(&segment) else {
            return;
        };
        *count = count.saturating_sub(1);
        if *count == 0 {
            series.live.remove(&segment);
            let active = series.active.as_ref().is_some_and(|a| a.id == segment);
            if !active {
                self.freed.push(path);
            }
        }
    }

    /// Deletes the active segments whose batches are all acknowledged (at close: nothing will
    /// be appended to them in this process).
    pub(crate) fn delete_idle(&mut self) -> Result<u64, StateError> {
        let mut idle = Vec::new();
        for (queue, series) in &mut self.series {
            let Some(active) = series.active.as_ref() else {
                continue;
            };
            if !series.live.contains_key(&active.id) {
                idle.push(
                    self.root
                        .join(hex(queue))
                        .join(format!("{:016x}", active.id)),
                );
                series.active = None;
            }
        }
        self.freed.extend(idle);
        self.delete_freed()
    }

    /// Makes every append since the last call durable; returns the number of fsyncs.
    pub(crate) fn sync(&mut self) -> Result<u64, StateError> {
        let mut fsyncs = 0;
        for (queue, id) in std::mem::take(&mut self.dirty_files) {
            if !self.fsync {
                continue;
            }
            let path = self.segment_path(&queue, id);
            let active = self
                .series
                .get(&queue)
                .and_then(|s| s.active.as_ref())
                .filter(|a| a.id == id);
            match active {
                Some(active) => active.file.sync_data(),
                // Rolled over since it was written: sync through a fresh handle.
                None => File::open(&path).and_then(|f| f.sync_data()),
            }
            .map_err(StateError::io("fsync of segment", &path))?;
            fsyncs += 1;
        }
        for dir in self.dirty_dirs.drain() {
            if self.fsync {
                File::open(&dir)
                    .and_then(|f| f.sync_all())
                    .map_err(StateError::io("fsync of segment directory", &dir))?;
            }
        }
        Ok(fsyncs)
    }

    /// Deletes the segments freed by acknowledgements that are now durable.
    pub(crate) fn delete_freed(&mut self) -> Result<u64, StateError> {
        let mut deleted = 0;
        for path in std::mem::take(&mut self.freed) {
            match std::fs::remove_file(&path) {
                Ok(()) => deleted += 1,
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => return Err(StateError::io("removal of segment", &path)(e)),
            }
        }
        Ok(deleted)
    }
}

/// Reads a stored payload and checks it against its checksum.
pub(crate) fn read(
    store_dir: &Path,
    queue: &[u8],
    location: &PayloadRef,
) -> Result<bytes::Bytes, StateError> {
    let path = store_dir
        .join("payloads")
        .join(hex(queue))
        .join(format!("{:016x}", location.segment));
    let file = File::open(&path).map_err(StateError::io("open of segment", &path))?;
    let len = usize::try_from(location.len).map_err(|_| StateError::Decode {
        what: "payload location",
        key: path.display().to_string(),
        detail: format!("length {} does not fit in memory", location.len),
    })?;
    let mut buffer = vec![0u8; len];
    file.read_exact_at(&mut buffer, location.offset)
        .map_err(StateError::io("read of segment", &path))?;
    let checksum = xxhash_rust::xxh64::xxh64(&buffer, 0);
    if checksum != location.checksum {
        return Err(StateError::Decode {
            what: "stored payload",
            key: path.display().to_string(),
            detail: format!(
                "{} bytes at offset {} hash {checksum:016x}, the outbox recorded {:016x}",
                location.len, location.offset, location.checksum
            ),
        });
    }
    Ok(bytes::Bytes::from(buffer))
}
