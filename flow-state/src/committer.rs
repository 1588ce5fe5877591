//! The committer thread: applies requests in sled transactions and makes each group durable with
//! one `db.flush()` + one fsync of sled's data file.

use std::collections::{BTreeSet, HashMap};
use std::ffi::OsString;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, TryRecvError};
use std::sync::Arc;
use std::time::Instant;

use sled::transaction::{abort, ConflictableTransactionError, TransactionError};
use sled::Transactional;

use crate::codec::{
    decode_batch_parts, decode_counter, encode_batch, seq_key, show_key, BodyRecord, Bounds,
};
use crate::counters::PreparedCounter;
use crate::error::StateError;
use crate::segments::Segments;
use crate::types::{CommitReceipt, SinkPartition, StoreStats};

/// The sled trees of one store (cheap to clone: `Arc`s inside).
#[derive(Clone)]
pub(crate) struct Trees {
    pub db: sled::Db,
    /// `pipeline\0 partition` -> opaque position.
    pub positions: sled::Tree,
    /// `pipeline\0 sink\0 partition seq` -> encoded batch.
    pub batches: sled::Tree,
    /// `pipeline\0 sink\0 partition` -> queue bounds `head, next`.
    pub batch_seq: sled::Tree,
    /// `pipeline\0 sink\0 partition` -> bincode map.
    pub fingerprints: sled::Tree,
    /// `pipeline\0 owner\0 partition seq` -> bincode dead letter.
    pub dead_letters: sled::Tree,
    /// `pipeline\0 owner\0 partition` -> next dead-letter seq.
    pub dead_letter_seq: sled::Tree,
    /// `pipeline\0 sink\0 name` -> bytes.
    pub sink_values: sled::Tree,
    /// `pipeline\0 owner\0 partition name` -> u64 ([`crate::counters`]).
    pub counters: sled::Tree,
}

impl Trees {
    pub(crate) fn open(db: sled::Db) -> Result<Trees, StateError> {
        let tree = |name: &'static str| {
            db.open_tree(name)
                .map_err(|e| StateError::sled("open_tree", name, e))
        };
        Ok(Trees {
            positions: tree("positions")?,
            batches: tree("batches")?,
            batch_seq: tree("batch_seq")?,
            fingerprints: tree("fingerprints")?,
            dead_letters: tree("dead_letters")?,
            dead_letter_seq: tree("dead_letter_seq")?,
            sink_values: tree("sink_values")?,
            counters: tree("counters")?,
            db,
        })
    }
}

/// Dead letters of one owner, already encoded.
pub(crate) struct PreparedDeadLetters {
    /// `pipeline\0 owner\0 partition`.
    pub counter_key: Vec<u8>,
    pub items: Vec<Vec<u8>>,
}

/// A batch whose metadata is encoded; its body record is written by the committer (a payload
/// must be appended to a segment first).
pub(crate) struct PreparedBatch {
    pub header: Vec<u8>,
    pub body: PreparedBody,
}

pub(crate) enum PreparedBody {
    Payload { bytes: bytes::Bytes, checksum: u64 },
    Record(BodyRecord),
}

pub(crate) struct PreparedSink {
    pub sink: String,
    /// `pipeline\0 sink\0 partition`.
    pub queue_key: Vec<u8>,
    pub batches: Vec<PreparedBatch>,
    /// The encoded values of `batches`, filled in by [`Committer::stage`].
    pub values: Vec<Vec<u8>>,
    /// Segments referenced by `values`.
    pub segments: Vec<u64>,
    pub dead_letters: PreparedDeadLetters,
}

/// An [`crate::EpochCommit`] with every value encoded (transaction closures only insert bytes).
pub(crate) struct PreparedCommit {
    pub pipeline: String,
    pub partition: u32,
    pub position_key: Vec<u8>,
    /// `None` leaves the position as it is (dead letters requeued into the outbox).
    pub position: Option<Vec<u8>>,
    pub source_dead_letters: PreparedDeadLetters,
    pub sinks: Vec<PreparedSink>,
    /// `dead_letters` keys removed in the same transaction.
    pub removed_dead_letters: Vec<Vec<u8>>,
    /// Counter additions made with the commit.
    pub counters: Vec<PreparedCounter>,
}

pub(crate) struct PreparedAck {
    pub key: SinkPartition,
    pub queue_key: Vec<u8>,
    pub seq: u64,
    pub sink_values: Vec<(Vec<u8>, Vec<u8>)>,
    /// `sink_values` keys removed with the acknowledgement.
    pub removed_sink_values: Vec<Vec<u8>>,
    /// Rows of the batch set aside, recorded in the same transaction.
    pub dead_letters: PreparedDeadLetters,
    /// Counter additions made with the acknowledgement.
    pub counters: Vec<PreparedCounter>,
}

pub(crate) struct PreparedFingerprints {
    pub key: SinkPartition,
    pub queue_key: Vec<u8>,
    /// `None` removes the entry (empty map).
    pub encoded: Option<Vec<u8>>,
}

pub(crate) enum Op {
    Commit(PreparedCommit),
    Ack(PreparedAck),
    SetFingerprints(PreparedFingerprints),
    /// Sets (`Some`) or removes (`None`) one `sink_values` key.
    SetSinkValue(Vec<u8>, Option<Vec<u8>>),
    /// Removes these `dead_letters` keys (their owners' counters stay: seqs are never reused).
    RemoveDeadLetters(Vec<Vec<u8>>),
    /// Adds to counters on their own (what no commit or acknowledgement carries: failures).
    AddCounters(Vec<PreparedCounter>),
    Shutdown,
}

pub(crate) enum Outcome {
    Commit(CommitReceipt),
    Done,
    /// How many of the requested entries existed and were removed.
    Removed(u64),
}

pub(crate) type Reply = Box<dyn FnOnce(Result<Outcome, StateError>) + Send>;

pub(crate) struct Request {
    pub op: Op,
    pub reply: Reply,
}

#[derive(Default)]
pub(crate) struct StatCounters {
    groups: AtomicU64,
    fsyncs: AtomicU64,
    blob_fsyncs: AtomicU64,
    segment_fsyncs: AtomicU64,
    segments_deleted: AtomicU64,
    dir_fsyncs: AtomicU64,
    flushes: AtomicU64,
    requests: AtomicU64,
    commits: AtomicU64,
    acknowledgements: AtomicU64,
    failed_requests: AtomicU64,
}

fn bump(counter: &AtomicU64, by: u64) {
    counter.fetch_add(by, Ordering::Relaxed);
}

impl StatCounters {
    pub(crate) fn snapshot(&self) -> StoreStats {
        StoreStats {
            groups: self.groups.load(Ordering::Relaxed),
            fsyncs: self.fsyncs.load(Ordering::Relaxed),
            blob_fsyncs: self.blob_fsyncs.load(Ordering::Relaxed),
            segment_fsyncs: self.segment_fsyncs.load(Ordering::Relaxed),
            segments_deleted: self.segments_deleted.load(Ordering::Relaxed),
            dir_fsyncs: self.dir_fsyncs.load(Ordering::Relaxed),
            flushes: self.flushes.load(Ordering::Relaxed),
            requests: self.requests.load(Ordering::Relaxed),
            commits: self.commits.load(Ordering::Relaxed),
            acknowledgements: self.acknowledgements.load(Ordering::Relaxed),
            failed_requests: self.failed_requests.load(Ordering::Relaxed),
        }
    }
}

fn io_err<'p>(
    what: &'static str,
    path: &'p Path,
) -> impl FnOnce(std::io::Error) -> StateError + 'p {
    move |source| StateError::Io {
        what,
        path: path.to_path_buf(),
        source,
    }
}

fn fsync_path(what: &'static str, path: &Path) -> Result<bool, StateError> {
    match File::open(path) {
        Ok(f) => f.sync_all().map(|()| true).map_err(io_err(what, path)),
        // Removed in the meantime (sled garbage-collected the blob): nothing to make durable.
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(false),
        Err(e) => Err(io_err(what, path)(e)),
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
        let db_file = File::open(&db_path).map_err(io_err("open of sled data file", &db_path))?;
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
            .map_err(io_err("fsync of sled data file", &self.db_path))?;
        bump(&stats.fsyncs, 1);
        self.sync_dir_if_changed(stats)
    }

    fn sync_blobs(&mut self, stats: &StatCounters) -> Result<(), StateError> {
        let entries = match std::fs::read_dir(&self.blob_dir) {
            Ok(entries) => entries,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
            Err(e) => return Err(io_err("listing of sled blob directory", &self.blob_dir)(e)),
        };
        let mut present = BTreeSet::new();
        let mut synced_any = false;
        for entry in entries {
            let entry = entry.map_err(io_err("listing of sled blob directory", &self.blob_dir))?;
            let name = entry.file_name();
            let path = entry.path();
            // The length is read before the fsync: if sled is still writing the file, a later
            // group sees a different length and fsyncs it again.
            let len = match entry.metadata() {
                Ok(meta) => meta.len(),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
                Err(e) => return Err(io_err("stat of sled blob file", &path)(e)),
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
            .map_err(io_err("listing of store directory", &self.dir))?;
        for entry in entries {
            let entry = entry.map_err(io_err("listing of store directory", &self.dir))?;
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

pub(crate) type TxResult<T> = Result<T, ConflictableTransactionError<StateError>>;

fn tx_error(op: &'static str, target: String, e: TransactionError<StateError>) -> StateError {
    match e {
        TransactionError::Abort(e) => e,
        TransactionError::Storage(e) => StateError::sled(op, target, e),
    }
}

fn read_bounds(tree: &sled::transaction::TransactionalTree, key: &[u8]) -> TxResult<Bounds> {
    match tree.get(key)? {
        Some(v) => Bounds::decode(key, &v).or_else(abort),
        None => Ok(Bounds::default()),
    }
}

fn append_dead_letters(
    dead_letters: &sled::transaction::TransactionalTree,
    counters: &sled::transaction::TransactionalTree,
    prepared: &PreparedDeadLetters,
) -> TxResult<()> {
    if prepared.items.is_empty() {
        return Ok(());
    }
    let key = prepared.counter_key.as_slice();
    let mut next = match counters.get(key)? {
        Some(v) => decode_counter(key, &v).or_else(abort)?,
        None => 0,
    };
    for item in &prepared.items {
        dead_letters.insert(seq_key(key, next), item.as_slice())?;
        next = match next.checked_add(1) {
            Some(n) => n,
            None => {
                return abort(StateError::Overflow {
                    target: show_key(key),
                })
            }
        };
    }
    counters.insert(key, &next.to_be_bytes()[..])?;
    Ok(())
}

pub(crate) fn apply_commit(t: &Trees, c: &PreparedCommit) -> Result<CommitReceipt, StateError> {
    (
        &t.positions,
        &t.batches,
        &t.batch_seq,
        &t.dead_letters,
        &t.dead_letter_seq,
        &t.counters,
    )
        .transaction(
            |(positions, batches, batch_seq, dead_letters, dl_seq, counters)| {
                crate::counters::apply(counters, &c.counters)?;
                if let Some(position) = &c.position {
                    positions.insert(c.position_key.as_slice(), position.as_slice())?;
                }
                for key in &c.removed_dead_letters {
                    dead_letters.remove(key.as_slice())?;
                }
                append_dead_letters(dead_letters, dl_seq, &c.source_dead_letters)?;
                let mut receipt = Vec::with_capacity(c.sinks.len());
                for sink in &c.sinks {
                    let mut seqs = Vec::with_capacity(sink.batches.len());
                    if !sink.values.is_empty() {
                        let mut bounds = read_bounds(batch_seq, &sink.queue_key)?;
                        for value in &sink.values {
                            let seq = bounds.next;
                            batches.insert(seq_key(&sink.queue_key, seq), value.as_slice())?;
                            seqs.push(seq);
                            bounds.next = match seq.checked_add(1) {
                                Some(n) => n,
                                None => {
                                    return abort(StateError::Overflow {
                                        target: show_key(&sink.queue_key),
                                    })
                                }
                            };
                        }
                        batch_seq.insert(sink.queue_key.as_slice(), &bounds.encode()[..])?;
                    }
                    append_dead_letters(dead_letters, dl_seq, &sink.dead_letters)?;
                    receipt.push((sink.sink.clone(), seqs));
                }
                Ok(CommitReceipt {
                    batch_seqs: receipt,
                })
            },
        )
        .map_err(|e| {
            tx_error(
                "commit transaction",
                format!("pipeline {} partition {}", c.pipeline, c.partition),
                e,
            )
        })
}

/// Removes a pending batch; returns the segment its payload was in, if any.
///
/// Any pending batch may go, not only the oldest: the parts of one logical batch bound for
/// different shards are delivered independently, each in order within its shard. `head` stays a
/// lower bound of the pending sequence numbers.
pub(crate) fn apply_ack(t: &Trees, a: &PreparedAck) -> Result<Option<u64>, StateError> {
    (
        &t.batches,
        &t.batch_seq,
        &t.sink_values,
        &t.dead_letters,
        &t.dead_letter_seq,
        &t.counters,
    )
        .transaction(
            |(batches, batch_seq, sink_values, dead_letters, dl_seq, counters)| {
                let mut bounds = read_bounds(batch_seq, &a.queue_key)?;
                let batch_key = seq_key(&a.queue_key, a.seq);
                let removed = if (bounds.head..bounds.next).contains(&a.seq) {
                    batches.remove(batch_key.as_slice())?
                } else {
                    None
                };
                let Some(removed) = removed else {
                    return abort(StateError::NotPending {
                        key: a.key.clone(),
                        seq: a.seq,
                    });
                };
                let segment = match decode_batch_parts(&batch_key, &removed).or_else(abort)?.1 {
                    BodyRecord::Segment { segment, .. } => Some(segment),
                    BodyRecord::Rebuild { .. } => None,
                };
                if a.seq == bounds.head {
                    bounds.head = a.seq + 1;
                    batch_seq.insert(a.queue_key.as_slice(), &bounds.encode()[..])?;
                }
                for (key, value) in &a.sink_values {
                    sink_values.insert(key.as_slice(), value.as_slice())?;
                }
                for key in &a.removed_sink_values {
                    sink_values.remove(key.as_slice())?;
                }
                append_dead_letters(dead_letters, dl_seq, &a.dead_letters)?;
                crate::counters::apply(counters, &a.counters)?;
                Ok(segment)
            },
        )
        .map_err(|e| tx_error("acknowledge transaction", a.key.to_string(), e))
}

pub(crate) fn apply_sink_value(
    t: &Trees,
    key: &[u8],
    value: Option<&[u8]>,
) -> Result<(), StateError> {
    let result = match value {
        Some(value) => t.sink_values.insert(key, value).map(|_| ()),
        None => t.sink_values.remove(key).map(|_| ()),
    };
    result.map_err(|e| StateError::sled("set sink value", show_key(key), e))
}

pub(crate) fn apply_dead_letter_removal(t: &Trees, keys: &[Vec<u8>]) -> Result<u64, StateError> {
    t.dead_letters
        .transaction(|tree| {
            let mut removed = 0;
            for key in keys {
                removed += u64::from(tree.remove(key.as_slice())?.is_some());
            }
            Ok(removed)
        })
        .map_err(|e| tx_error("dead letter removal", format!("{} keys", keys.len()), e))
}

pub(crate) fn apply_fingerprints(t: &Trees, f: &PreparedFingerprints) -> Result<(), StateError> {
    let result = match &f.encoded {
        Some(value) => t
            .fingerprints
            .insert(f.queue_key.as_slice(), value.as_slice()),
        None => t.fingerprints.remove(f.queue_key.as_slice()),
    };
    result
        .map(|_| ())
        .map_err(|e| StateError::sled("fingerprints insert", f.key.to_string(), e))
}

pub(crate) struct Committer {
    pub trees: Trees,
    pub durability: Durability,
    pub segments: Segments,
    pub stats: Arc<StatCounters>,
    pub max_group: usize,
}

impl Committer {
    /// Writes the payloads of a commit to their segments and encodes its batch values.
    fn stage(&mut self, commit: &mut PreparedCommit) -> Result<(), StateError> {
        for sink in &mut commit.sinks {
            let context = show_key(&sink.queue_key);
            for batch in &sink.batches {
                let record = match &batch.body {
                    PreparedBody::Record(record) => record.clone(),
                    PreparedBody::Payload { bytes, checksum } => {
                        let at = self.segments.append(&sink.queue_key, bytes, *checksum)?;
                        sink.segments.push(at.segment);
                        BodyRecord::Segment {
                            segment: at.segment,
                            offset: at.offset,
                            len: at.len,
                            checksum: at.checksum,
                        }
                    }
                };
                sink.values
                    .push(encode_batch(&batch.header, &record, &context)?);
            }
        }
        Ok(())
    }

    /// Stages every commit of the group and makes the payloads durable before any sled
    /// transaction can reference them; a commit whose staging failed is answered with its error.
    fn stage_group(&mut self, group: &mut [Request]) -> Vec<Option<StateError>> {
        let mut failures: Vec<Option<StateError>> = group
            .iter_mut()
            .map(|req| match &mut req.op {
                Op::Commit(c) => self.stage(c).err(),
                _ => None,
            })
            .collect();
        match self.segments.sync() {
            Ok(fsyncs) => bump(&self.stats.segment_fsyncs, fsyncs),
            Err(e) => {
                tracing::error!(error = %e, "payload segments are not durable");
                for (failure, req) in failures.iter_mut().zip(group.iter()) {
                    if matches!(req.op, Op::Commit(_)) && failure.is_none() {
                        *failure = Some(e.duplicate());
                    }
                }
            }
        }
        failures
    }

    fn apply(&mut self, op: &Op) -> Result<Outcome, StateError> {
        match op {
            Op::Shutdown => Ok(Outcome::Done),
            Op::Commit(c) => {
                let receipt = apply_commit(&self.trees, c)?;
                for sink in &c.sinks {
                    for segment in &sink.segments {
                        self.segments.referenced(&sink.queue_key, *segment);
                    }
                }
                Ok(Outcome::Commit(receipt))
            }
            Op::Ack(a) => {
                if let Some(segment) = apply_ack(&self.trees, a)? {
                    self.segments.released(&a.queue_key, segment);
                }
                Ok(Outcome::Done)
            }
            Op::SetFingerprints(f) => apply_fingerprints(&self.trees, f).map(|()| Outcome::Done),
            Op::SetSinkValue(key, value) => {
                apply_sink_value(&self.trees, key, value.as_deref()).map(|()| Outcome::Done)
            }
            Op::RemoveDeadLetters(keys) => {
                apply_dead_letter_removal(&self.trees, keys).map(Outcome::Removed)
            }
            Op::AddCounters(adds) => self
                .trees
                .counters
                .transaction(|tree| crate::counters::apply(tree, adds))
                .map(|()| Outcome::Done)
                .map_err(|e| tx_error("counter addition", format!("{} counters", adds.len()), e)),
        }
    }

    /// Runs until a `Shutdown` request arrives or every sender is gone; ends with a final sync.
    pub(crate) fn run(mut self, rx: Receiver<Request>) -> Result<(), StateError> {
        let mut shutdown_replies: Vec<Reply> = Vec::new();
        let mut running = true;
        while running {
            let Ok(first) = rx.recv() else { break };
            let mut group = vec![first];
            while group.len() < self.max_group.max(1) {
                match rx.try_recv() {
                    Ok(req) => group.push(req),
                    Err(TryRecvError::Empty | TryRecvError::Disconnected) => break,
                }
            }
            let started = Instant::now();
            let staged = self.stage_group(&mut group);
            let mut answered = Vec::with_capacity(group.len());
            let mut wrote = false;
            for (req, staging) in group.into_iter().zip(staged) {
                if matches!(req.op, Op::Shutdown) {
                    running = false;
                    shutdown_replies.push(req.reply);
                    continue;
                }
                let result = match staging {
                    Some(e) => Err(e),
                    None => self.apply(&req.op),
                };
                bump(&self.stats.requests, 1);
                match (&req.op, &result) {
                    (_, Err(e)) => {
                        bump(&self.stats.failed_requests, 1);
                        tracing::debug!(error = %e, "state request failed");
                    }
                    (Op::Commit(_), Ok(_)) => bump(&self.stats.commits, 1),
                    (Op::Ack(_), Ok(_)) => bump(&self.stats.acknowledgements, 1),
                    _ => {}
                }
                wrote |= result.is_ok();
                answered.push((req.reply, result));
            }
            let durable = if wrote {
                bump(&self.stats.groups, 1);
                self.durability.sync(&self.trees.db, &self.stats)
            } else {
                Ok(())
            };
            match &durable {
                // Only now may segments freed by this group's acknowledgements go.
                Ok(()) => match self.segments.delete_freed() {
                    Ok(deleted) => bump(&self.stats.segments_deleted, deleted),
                    Err(e) => {
                        tracing::warn!(error = %e, "a fully acknowledged payload segment could not be deleted; it is retried at the next open. Check the state directory's permissions")
                    }
                },
                Err(e) => {
                    tracing::error!(error = %e, requests = answered.len(), "state commit group is not durable")
                }
            }
            tracing::trace!(
                requests = answered.len(),
                micros = started.elapsed().as_micros() as u64,
                "state commit group done"
            );
            for (reply, result) in answered {
                match &durable {
                    Ok(()) => reply(result),
                    Err(e) => reply(Err(e.duplicate())),
                }
            }
        }
        let result = self.durability.sync(&self.trees.db, &self.stats);
        if result.is_ok() {
            match self.segments.delete_idle() {
                Ok(deleted) => bump(&self.stats.segments_deleted, deleted),
                Err(e) => {
                    tracing::warn!(error = %e, "a fully acknowledged payload segment could not be deleted; it is retried at the next open. Check the state directory's permissions")
                }
            }
        }
        for reply in shutdown_replies {
            reply(match &result {
                Ok(()) => Ok(Outcome::Done),
                Err(e) => Err(e.duplicate()),
            });
        }
        tracing::debug!("state committer stopped");
        result
    }
}
