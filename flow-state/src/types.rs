//! Public data types exchanged with the state store.

use std::fmt;
use std::time::Duration;

use serde::{Deserialize, Serialize};

/// One queue of sealed batches: a sink of a pipeline, for one source partition.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct SinkPartition {
    /// The pipeline's name.
    pub pipeline: String,
    /// The sink's name.
    pub sink: String,
    /// The source partition.
    pub partition: u32,
}

impl SinkPartition {
    /// The queue of `sink` of `pipeline` for `partition`.
    pub fn new(pipeline: impl Into<String>, sink: impl Into<String>, partition: u32) -> Self {
        SinkPartition {
            pipeline: pipeline.into(),
            sink: sink.into(),
            partition,
        }
    }
}

impl fmt::Display for SinkPartition {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}/{}", self.pipeline, self.sink, self.partition)
    }
}

/// Everything one partition produced during one epoch, committed atomically.
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub struct EpochCommit {
    /// The pipeline's name.
    pub pipeline: String,
    /// The source partition the epoch read.
    pub partition: u32,
    /// Opaque source position after the epoch.
    pub position: Vec<u8>,
    /// Stored under owner `"source"`.
    pub source_dead_letters: Vec<DeadLetter>,
    /// What each sink appends to its queue of this partition.
    pub sinks: Vec<SinkEpochCommit>,
    /// Additions to this partition's persisted counters, made in the same transaction.
    pub counters: Vec<CounterAdd>,
}

/// An addition to one persisted counter of a pipeline partition: `owner` is a sink name or
/// [`crate::SOURCE_OWNER`], `name` says what is counted (the store does not interpret it).
/// Counters only grow; an addition of 0 writes nothing.
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub struct CounterAdd {
    /// A sink's name, or [`crate::SOURCE_OWNER`].
    pub owner: String,
    /// What is counted.
    pub name: String,
    /// The amount to add.
    pub by: u64,
}

/// A persisted counter's value.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StoredCounter {
    /// The pipeline's name.
    pub pipeline: String,
    /// A sink's name, or [`crate::SOURCE_OWNER`].
    pub owner: String,
    /// The source partition.
    pub partition: u32,
    /// What is counted.
    pub name: String,
    /// The total over every run.
    pub value: u64,
}

/// The part of an epoch commit that belongs to one sink.
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub struct SinkEpochCommit {
    /// The sink's name.
    pub sink: String,
    /// How the outbox keeps this commit's batches.
    pub storage: BatchStorage,
    /// Appended in order to the (sink, partition) queue; sequence numbers are assigned inside the
    /// transaction and returned in the [`CommitReceipt`].
    pub batches: Vec<SealedBatch>,
    /// Stored under owner = sink name.
    pub dead_letters: Vec<DeadLetter>,
}

/// How the outbox keeps a batch until it is acknowledged.
///
/// A source that can re-read a committed range deterministically lets the outbox keep only a
/// batch's bounds: after a restart the sink re-reads from `epoch_start`, re-cuts at the stored
/// offsets and checks `rows` and `content_hash` before sending. Other sources need the payload.
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub enum BatchStorage {
    /// The payload is written to the store's payload segments (bounded disk: a segment is
    /// deleted once every batch in it is acknowledged).
    #[default]
    Payload,
    /// Only metadata is stored; the batch is rebuilt by re-reading the source from the position
    /// the epoch started at (`None`: from the start of the partition).
    Bounds {
        /// Source position the epoch started at.
        epoch_start: Option<Vec<u8>>,
    },
}

/// A batch ready to send: the exact bytes plus everything needed to resend them identically.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SealedBatch {
    /// e.g. `default.events` or a file path.
    pub target: String,
    /// Column list the bytes are encoded for.
    pub columns: Vec<String>,
    /// e.g. `RowBinary`, `JSONEachRow`.
    pub format: String,
    /// Deduplication token.
    pub token: String,
    /// Shard name (`""` when unsharded).
    pub shard: String,
    /// Message-id bounds within the partition.
    pub first_offset: u64,
    /// Message id of the last row (inclusive).
    pub last_offset: u64,
    /// Rows in the batch.
    pub rows: u64,
    /// Bytes of the encoded rows before framing (what `content_hash` covers).
    pub encoded_bytes: u64,
    /// Fingerprint of the encoding plan (columns and their types) the rows were encoded with.
    pub plan: String,
    /// When the batch was sealed, in milliseconds since the Unix epoch.
    pub sealed_at_ms: u64,
    /// xxh64 of the encoded rows before framing: a rebuilt batch must hash equal.
    pub content_hash: u64,
    /// The exact bytes to send (shared, so handing a batch to delivery copies nothing). Kept in
    /// memory while in flight; persisted only with [`BatchStorage::Payload`].
    pub payload: bytes::Bytes,
}

/// A batch as stored in a queue, with its sequence number. `batch.payload` is empty: load it
/// with [`crate::StateStore::load_payload`] (stored payloads) or rebuild it from the source
/// ([`StoredBody::Rebuild`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StoredBatch {
    /// Its sequence number in the queue.
    pub seq: u64,
    /// The batch, with an empty payload.
    pub batch: SealedBatch,
    /// Where its payload comes from.
    pub body: StoredBody,
}

/// Where a stored batch's payload comes from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum StoredBody {
    /// In the store; see [`crate::StateStore::load_payload`].
    Payload(PayloadRef),
    /// Not stored: re-read the source from `epoch_start` and re-cut at the batch's bounds.
    Rebuild {
        /// Source position the batch's epoch started at (`None`: the start of the partition).
        epoch_start: Option<Vec<u8>>,
    },
}

/// Where a stored payload lives (opaque outside the store).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PayloadRef {
    pub(crate) segment: u64,
    pub(crate) offset: u64,
    pub(crate) len: u64,
    /// xxh64 of the stored bytes, checked on load.
    pub(crate) checksum: u64,
}

impl PayloadRef {
    /// Stored length in bytes.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Whether the stored payload is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

/// Sequence numbers assigned by a commit, per sink (in the order of [`EpochCommit::sinks`]).
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub struct CommitReceipt {
    /// Per sink name, the sequence numbers of its batches in commit order.
    pub batch_seqs: Vec<(String, Vec<u64>)>,
}

impl CommitReceipt {
    /// The sequence numbers assigned to the batches of `sink` (empty if the sink was not part of
    /// the commit).
    pub fn seqs(&self, sink: &str) -> &[u64] {
        self.batch_seqs
            .iter()
            .find(|(name, _)| name == sink)
            .map(|(_, seqs)| seqs.as_slice())
            .unwrap_or(&[])
    }
}

/// A message (or row) that could not be processed, with the reason.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeadLetter {
    /// The source partition the message came from.
    pub partition: u32,
    /// The message id within the partition, when known.
    pub offset: Option<u64>,
    /// Why it was set aside.
    pub reason: String,
    /// The message's (or row's) bytes.
    pub payload: Vec<u8>,
}

/// What [`crate::StateStore::acknowledge_with`] records with an acknowledgement.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct AckExtras {
    /// Sink-wide values to set.
    pub sink_values: Vec<(String, Vec<u8>)>,
    /// Sink-wide values to remove.
    pub removed_sink_values: Vec<String>,
    /// Rows of the batch set aside; they join the sink's dead letters of the partition.
    pub dead_letters: Vec<DeadLetter>,
    /// Additions to the partition's persisted counters (what the delivery counts).
    pub counters: Vec<CounterAdd>,
}

/// A dead letter as stored: its owner (a sink name, or [`crate::SOURCE_OWNER`]) and its place in
/// the owner's per-partition sequence.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StoredDeadLetter {
    /// The pipeline's name.
    pub pipeline: String,
    /// A sink's name, or [`crate::SOURCE_OWNER`].
    pub owner: String,
    /// Its sequence number among the owner's dead letters of the partition.
    pub seq: u64,
    /// The dead letter.
    pub letter: DeadLetter,
}

/// Options of [`crate::StateStore::open_with`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StoreOptions {
    /// fsync sled's data file (and new blob files / directories) once per commit group after
    /// `db.flush()`. Without it a commit survives a killed process but not a power cut.
    pub fsync: bool,
    /// Maximum number of requests applied in one commit group.
    pub max_group: usize,
    /// sled's page cache in bytes. The outbox is written once and read back only after a
    /// restart, so a small cache keeps memory flat (sled's own default is 1 GiB).
    pub cache_capacity: u64,
    /// How long an open waits while another process holds the store's lock before it fails with
    /// `StateError::Locked`. A worker restarted at once after a crash (`kill -9`, a supervisor
    /// with no restart delay) was seen to find the lock of the process it replaces still held for
    /// a moment after that process was reaped; a worker that really runs on the directory holds
    /// it for longer. Zero (the default) for readers such as `status`, which answer at once.
    pub lock_wait: Duration,
}

impl Default for StoreOptions {
    fn default() -> Self {
        StoreOptions {
            fsync: true,
            max_group: 1024,
            cache_capacity: 8 << 20,
            lock_wait: Duration::ZERO,
        }
    }
}

/// Counters of the committer thread.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct StoreStats {
    /// Commit groups that wrote something (each one flush + one data-file fsync).
    pub groups: u64,
    /// fsyncs of sled's data file (`db`): one per group when `fsync` is on.
    pub fsyncs: u64,
    /// fsyncs of sled blob files (values larger than sled's blob threshold).
    pub blob_fsyncs: u64,
    /// fsyncs of directories (blob directory after new blobs, store directory after new files).
    pub dir_fsyncs: u64,
    /// `db.flush()` calls.
    pub flushes: u64,
    /// fsyncs of payload segment files.
    pub segment_fsyncs: u64,
    /// Payload segment files deleted once every batch in them was acknowledged.
    pub segments_deleted: u64,
    /// Requests handled (commits + acknowledgements + fingerprint updates).
    pub requests: u64,
    /// Successful epoch commits.
    pub commits: u64,
    /// Successful acknowledgements.
    pub acknowledgements: u64,
    /// Requests answered with an error.
    pub failed_requests: u64,
    /// Cluster mode: multi-ops sent to ZooKeeper (one per commit group, plus one per resend
    /// after a refused partition).
    pub zk_multis: u64,
    /// Cluster mode: requests refused with [`crate::StateError::Fenced`] (counted in
    /// `failed_requests` too).
    pub fenced: u64,
}

/// The identity of one outbox (one state directory): 64 random bits drawn when the store is
/// first created and never changed. Two state directories of the same pipeline name have
/// different ones, so what derives a name from it (the default deduplication-token namespace of
/// the ClickHouse sinks) is never shared between them. A store created before outbox identities
/// existed has none ([`crate::StateStore::outbox_id`] is `None`) and never gets one: the tokens
/// it already used must stay what they were.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct OutboxId(pub u64);

impl std::fmt::Display for OutboxId {
    /// 16 lowercase hex digits.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:016x}", self.0)
    }
}

/// The pipeline a state directory belongs to.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PipelineIdentity {
    /// The pipeline's name (`name` in the spec).
    pub pipeline: String,
    /// The pipeline's partition count.
    pub partitions: u32,
}

impl std::fmt::Display for PipelineIdentity {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "pipeline `{}` with {} partition(s)",
            self.pipeline, self.partitions
        )
    }
}
