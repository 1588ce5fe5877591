//! Cluster mode: the state of the partitions a worker owns, mirrored in ZooKeeper, which is the
//! state of truth; the sled store stays the local cache every read answers from.
//!
//! **Fencing.** A [`ZkMirror`] attached to a store ([`crate::StateStore::attach_mirror`]) holds
//! the fence of every partition this worker owns ([`ZkMirror::own`]: the `owner` node's path and
//! the version this worker set it to, its generation). The committer thread writes each commit
//! group to ZooKeeper first, as one multi-op that begins with `check(owner, generation)` of every
//! partition in it (several multi-ops only when a group exceeds 768 KiB), then applies it to sled
//! as without a mirror. When a partition's check or write is refused, only its requests fail
//! (with [`crate::StateError::Fenced`]) and the multi-op is sent again without them; when
//! ZooKeeper does not answer (session lost, timeout), every request of the multi-op fails the
//! same way, since whether it was applied is unknown. A refused partition is forgotten (as if
//! disowned): nothing is applied locally, and later writes are refused until it is owned and
//! loaded again. A partition is writable only after [`crate::StateStore::load_partition`] has
//! replaced its local entries with what ZooKeeper holds.
//!
//! **The writes of the store in cluster mode.**
//!
//! | write                                   | in cluster mode                                        |
//! |-----------------------------------------|--------------------------------------------------------|
//! | `commit`, `commit_blocking`             | mirrored: position, batches (bounds + hash), queue bounds, dead-letter references, counters. A commit of stored payloads is refused (`ClusterRefused`): only replayable sources |
//! | `acknowledge`, `acknowledge_blocking`, `acknowledge_with` | mirrored: the batch node removed, queue bounds, dead-letter references, counters, partition-scoped sink values; sink-wide values local-only |
//! | `set_fingerprints(_blocking)`           | mirrored                                               |
//! | `add_counters`                          | mirrored                                               |
//! | `set_sink_value`                        | mirrored when the name is partition-scoped (`<kind>/<partition>[/...]`: `gave_up/3`, `changed/3/17`); a sink-wide name (`file_len:...`) is local-only |
//! | dead letters of a commit or an ack      | mirrored as references: partition, offset, reason, without the payload, which only the worker that set them aside keeps |
//! | `remove_dead_letters_blocking`          | refused (`ClusterRefused`): purge with the pipeline stopped, single-process |
//! | `requeue_dead_letters_blocking`         | refused (`ClusterRefused`): the payloads are not in ZooKeeper |
//! | `claim`                                 | local-only: the identity of this worker's own directory |
//! | `load_partition`                        | reads ZooKeeper, replaces the partition's local entries |
//!
//! **The pending bound.** A partition holds at most [`ZkMirror::with_pending_bound`] (default
//! [`DEFAULT_PENDING_BOUND`]) pending batches in ZooKeeper, every sink together. A commit that
//! would go past it is refused with [`crate::StateError::PendingBound`] before anything is
//! written; [`crate::StateStore::commit`] waits for acknowledgements and retries it
//! (back-pressure: the partition stops reading, nothing is lost), `commit_blocking` returns it. A
//! commit into an empty queue always goes through, whatever its size. Every node stays under 512
//! KiB ([`crate::StateError::NodeTooLarge`] names one that would not), and every request's
//! writes under 768 KiB ([`crate::StateError::MultiTooLarge`]): a request is never split, and
//! ZooKeeper drops a connection whose request passes about 1 MiB.
//!
//! **Layout.** `layout`: node paths and names; `encoding`: the node values sled holds otherwise;
//! `mirror`: [`ZkMirror`] and the write-ahead of a commit group; `model`: what ZooKeeper holds for an owned partition; `load`: reading a partition and
//! replacing its local entries; `status`: a partition's state read without a store ([`read_partition`]).

mod encoding;
mod layout;
pub(crate) mod load;
mod mirror;
mod model;
mod status;

pub use mirror::{ZkMirror, DEFAULT_PENDING_BOUND};
pub use status::{read_partition, ZkPartitionState};
