//! `flow-state`: a persisted transactional outbox for flow pipelines, stored in sled 0.34.
//!
//! **Layout.**
//! - `store`: the [`StateStore`] handle (open, requests, reads); `prepare`: requests encoded on
//!   the caller's thread.
//! - `request`: the requests sent to the committer thread; `committer`: the committer thread; `transactions`: the sled transaction of each request;
//!   `durability`: flush and fsync of a commit group; `stats`: its counters; `trees`: the sled
//!   trees.
//! - `codec`: keys and values; `segments`: payload segment files; `counters`: persisted counters;
//!   `identity`: which pipeline a directory belongs to, and the outbox's own identity;
//!   `read_copy`: reading a directory this process cannot write, through a temporary copy;
//!   `unfinished_snapshot`: what a process killed while sled opened the store leaves behind.
//! - `zk`: cluster mode, the partition state mirrored in ZooKeeper with fencing ([`zk::ZkMirror`]).
//! - `types`: the data exchanged with the store; `summary`: what `flow-worker status` shows;
//!   `error`: [`StateError`].
//! - `cluster`: cluster mode's ZooKeeper session, membership, partition assignment and ownership
//!   ([`cluster::Cluster`]).
//!
//! **Key layout.** One sled tree per kind of data; names are joined with a NUL byte and integers
//! are big-endian so iteration order is numeric order:
//! `positions` (`pipeline\0 partition` -> opaque source position),
//! `batches` (`pipeline\0 sink\0 partition seq` -> `[2][header_len][bincode header][body]`, the
//! body being either the location of the payload in a segment file (`segments`) or the source
//! position to rebuild the batch from),
//! `batch_seq` (`pipeline\0 sink\0 partition` -> queue bounds `head..next`: every pending seq is in
//! that range, `head` is at most the oldest, and seqs are never reused),
//! `fingerprints` (`pipeline\0 sink\0 partition` -> bincode map), `dead_letters`
//! (`pipeline\0 owner\0 partition seq`, owner = sink name or `"source"`), `dead_letter_seq`
//! (next dead-letter seq per owner/partition), `sink_values` (`pipeline\0 sink\0 name`) and
//! `counters` (`pipeline\0 owner\0 partition name` -> u64: monotonic counters whose additions
//! ride in the transaction of the commit or acknowledgement they count, `counters`).
//!
//! **Commit protocol.** Callers encode everything (batches, dead letters, fingerprints) on their
//! own thread and send the request to a dedicated committer thread. Each request is applied in
//! its own multi-tree sled transaction whose closure only reads and inserts pre-encoded bytes (sled
//! may rerun it). A batch leaves its queue only through `acknowledge`, which accepts any pending
//! batch (`NotPending` otherwise): the shard parts of one logical batch are delivered
//! independently, so the queue may hold gaps above its oldest entry.
//!
//! **Group commit + fsync.** The committer drains every queued request, applies each, then makes
//! the whole group durable at once: one `db.flush()` (sled's `sync_file_range`, which survives a
//! killed process but not a power cut, sled issue 1452), then an fsync of new sled blob files
//! (`blobs/<lsn>`, written by sled without any sync) and their directory, ONE fsync of sled's data
//! file `db` through our own file handle, and an fsync of the store directory if its entries
//! changed. Only then is every request of the group answered. In cluster mode (`zk`) the group
//! is first written to ZooKeeper as one multi-op fenced by each partition's owner node; what
//! ZooKeeper refuses is answered with the refusal and never applied to sled. Reads (`position`, `undelivered`,
//! ...) read sled directly and may observe a commit that is still being made durable.

#![warn(missing_docs)]

pub mod cluster;
mod codec;
mod committer;
mod counters;
mod durability;
mod error;
mod identity;
mod prepare;
mod read_copy;
mod request;
mod segments;
mod stats;
mod store;
mod summary;
mod transactions;
mod trees;
mod types;
mod unfinished_snapshot;
pub mod zk;

pub use codec::SOURCE_OWNER;
pub use error::StateError;
pub use read_copy::ReadStore;
pub use store::StateStore;
pub use summary::{
    gave_up_value_name, BatchBody, BatchInfo, DeadLetterGroupSummary, DeadLetterInfo, ErrorRecord,
    PipelineSummary, PositionEncoding, PositionInfo, ShardBacklog, ShardRunStatus,
    SinkPartitionSummary, SinkRunStatus, StateSummary, RECENT_DEAD_LETTERS,
};
pub use types::{
    AckExtras, BatchStorage, CommitReceipt, CounterAdd, DeadLetter, EpochCommit, OutboxId,
    PayloadRef, PipelineIdentity, SealedBatch, SinkEpochCommit, SinkPartition, StoreOptions,
    StoreStats, StoredBatch, StoredBody, StoredCounter, StoredDeadLetter,
};

/// Internals that tests and benches outside this crate check against (feature `testing`).
#[cfg(feature = "testing")]
#[doc(hidden)]
pub mod testing {
    pub use crate::segments::SEGMENT_ROLL_BYTES;
}
