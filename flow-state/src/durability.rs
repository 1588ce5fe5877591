//! Making a commit group durable: sled's flush, then the fsyncs sled leaves out.

use std::collections::{BTreeSet, HashMap};
use std::ffi::OsString;
use std::fs::File;
use std::path::{Path, PathBuf};

use crate::error::StateError;
use crate::stats::{bump, StatCounters};

fn fsync_path(what: &'static str, path: &Path) -> Result<bool, StateError> {
    match File::open(path) {
        Ok(f) => f
            .sync_all()
            .map(|()| true)
            .map_err(StateError::io(what, path)),
        // Removed in the meantime (sled garbage-collected the blob): nothing to make durable.
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(false),
        Err(e) => Err(StateError::io(what, path)(e)),
    }
}

/// Makes everything sled has written durable.
///
/// sled 0.34's `flush()` ends with `sync_file_range` on its data file `db`, which does not flush
/// the disk cache nor file metadata (survives `kill -9`, not a power cut; sled issue 1452). Values
/// larger than sled's blob threshold (`segment_size / 4`, i.e. ~128 KiB by default; a consolidated
/// node counts as one item) are written by sled into `blobs/<lsn>` files with plain `write_all` and
/// no sync at all. So after the flush this fsyncs new blob files and the blob directory, then
/// sled's data file, then the store directory if its entries changed (e.g. a new snapshot file).
pub(crate) struct Durability {
    fsync: bool,
    dir: PathBuf,
    db_path: PathBuf,
    db_file: File,
    blob_dir: PathBuf,
    /// Blob files already fsynced, with the length they had when they were.
    synced_blobs: HashMap<OsString, u64>,
    dir_entries: BTreeSet<OsString>,
}

impl Durability {
    pub(crate) fn new(dir: &Path, fsync: bool) -> Result<Durability, StateError> {
        let db_path = dir.join("db");
        let db_file =
            File::open(&db_path).map_err(StateError::io("open of sled data file", &db_path))?;
        let durability = Durability {
            fsync,
            dir: dir.to_path_buf(),
            db_path,
            db_file,
            blob_dir: dir.join("blobs"),
            synced_blobs: HashMap::new(),
            dir_entries: BTreeSet::new(),
        };
        if fsync {
            // The store directory may have just been created: make its entry durable too.
            if let Some(parent) = dir.parent().filter(|p| !p.as_os_str().is_empty()) {
                fsync_path("fsync of store parent directory", parent)?;
            }
        }
        durability.with_initial_sync()
    }

    fn with_initial_sync(mut self) -> Result<Durability, StateError> {
        if self.fsync {
            self.sync_files(&StatCounters::default())?;
        }
        Ok(self)
    }

    pub(crate) fn sync(&mut self, db: &sled::Db, stats: &StatCounters) -> Result<(), StateError> {
        db.flush()
            .map_err(|e| StateError::sled("flush", self.dir.display().to_string(), e))?;
        bump(&stats.flushes, 1);
        if self.fsync {
            self.sync_files(stats)?;
        }
        Ok(())
    }

    fn sync_files(&mut self, stats: &StatCounters) -> Result<(), StateError> {
        self.sync_blobs(stats)?;
        self.db_file
            .sync_all()
            .map_err(StateError::io("fsync of sled data file", &self.db_path))?;
        bump(&stats.fsyncs, 1);
        self.sync_dir_if_changed(stats)
    }

    fn sync_blobs(&mut self, stats: &StatCounters) -> Result<(), StateError> {
        let entries = match std::fs::read_dir(&self.blob_dir) {
            Ok(entries) => entries,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
            Err(e) => {
                return Err(StateError::io(
                    "listing of sled blob directory",
                    &self.blob_dir,
                )(e))
            }
        };
        let mut present = BTreeSet::new();
        let mut synced_any = false;
        for entry in entries {
            let entry = entry.map_err(StateError::io(
                "listing of sled blob directory",
                &self.blob_dir,
            ))?;
            let name = entry.file_name();
            let path = entry.path();
            // The length is read before the fsync: if sled is still writing the file, a later
            // group sees a different length and fsyncs it again.
            let len = match entry.metadata() {
                Ok(meta) => meta.len(),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
                Err(e) => return Err(StateError::io("stat of sled blob file", &path)(e)),
            };
            present.insert(name.clone());
            if self.synced_blobs.get(&name) == Some(&len) {
                continue;
            }
            if fsync_path("fsync of sled blob file", &path)? {
                bump(&stats.blob_fsyncs, 1);
                synced_any = true;
                self.synced_blobs.insert(name, len);
            }
        }
        self.synced_blobs.retain(|name, _| present.contains(name));
        if synced_any {
            fsync_path("fsync of sled blob directory", &self.blob_dir)?;
            bump(&stats.dir_fsyncs, 1);
        }
        Ok(())
    }

    fn sync_dir_if_changed(&mut self, stats: &StatCounters) -> Result<(), StateError> {
        let mut names = BTreeSet::new();
        let entries = std::fs::read_dir(&self.dir)
            .map_err(StateError::io("listing of store directory", &self.dir))?;
        for entry in entries {
            let entry = entry.map_err(StateError::io("listing of store directory", &self.dir))?;
            names.insert(entry.file_name());
        }
        if names != self.dir_entries {
            fsync_path("fsync of store directory", &self.dir)?;
            bump(&stats.dir_fsyncs, 1);
            self.dir_entries = names;
        }
        Ok(())
    }
}
