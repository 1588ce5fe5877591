//! Typed errors of the state store.

use std::path::PathBuf;
use std::sync::Arc;

use crate::types::{PipelineIdentity, SinkPartition};

/// Everything that can go wrong in the state store. Every variant names the operation and the
/// input (directory, key, sequence number) it failed on.
#[derive(thiserror::Error, Debug)]
#[non_exhaustive]
pub enum StateError {
    /// sled could not open (or create) the database directory.
    #[error("cannot open state store in {dir}: {source}")]
    Open {
        /// The store's directory.
        dir: PathBuf,
        /// sled's reason.
        #[source]
        source: sled::Error,
    },
    /// The store's directory cannot be written (a read-only file system, or this user may not
    /// write it), and sled opens only for writing.
    #[error("the state directory {dir} cannot be opened for writing ({source}): it is on a read-only file system, or this user may not write it. `flow-worker status` and `flow-worker dead-letters list|export` read a copy of it; what changes it (run, drain, dead-letters requeue|purge) needs it writable: run as a user that may write it, or on a read-write mount")]
    NotWritable {
        /// The store's directory.
        dir: PathBuf,
        /// The operating system's refusal.
        #[source]
        source: std::io::Error,
    },
    /// Another process holds the store's lock: a worker runs on this directory.
    #[error(
        "the state directory {dir} is in use by another process (is another worker running on it?)"
    )]
    Locked {
        /// The store's directory.
        dir: PathBuf,
    },
    /// The directory belongs to another pipeline, or to this one with another partition count.
    #[error("the state directory {dir} belongs to {found}, but the spec says {wanted}. Starting would send everything again under a new name, or strand the undelivered batches of dropped partitions. To go on, either restore the pipeline name and partition count in the spec, or deliver what is pending with the old spec (`flow-worker drain`) and start the new spec with a new state directory")]
    OtherPipeline {
        /// The store's directory.
        dir: PathBuf,
        /// The pipeline the directory was claimed by.
        found: Box<PipelineIdentity>,
        /// The pipeline the spec asks for.
        wanted: Box<PipelineIdentity>,
    },
    /// A sled operation (read, transaction, flush, open tree) failed.
    #[error("sled {op} failed for {target}: {source}")]
    Sled {
        /// The operation, e.g. `get position` or `scan batches`.
        op: &'static str,
        /// The key, queue or tree it was done on.
        target: String,
        /// sled's reason.
        #[source]
        source: sled::Error,
    },
    /// A file-system operation done by the store itself (fsync of the data file, a blob, a directory).
    #[error("{what} failed for {path}: {source}")]
    Io {
        /// The operation, e.g. `fsync of data file`.
        what: &'static str,
        /// The file or directory it was done on.
        path: PathBuf,
        /// The operating system's reason.
        #[source]
        source: std::io::Error,
    },
    /// A stored value fails a check of its own layout (length, format version, checksum):
    /// corruption or an incompatible format. What bincode refuses is [`StateError::Deserialize`].
    #[error("cannot decode {what} stored at key {key}: {detail}")]
    Decode {
        /// What kind of value was stored (batch header, dead letter, counter, ...).
        what: &'static str,
        /// The key it is stored at, printable.
        key: String,
        /// Why decoding failed.
        detail: String,
    },
    /// bincode could not decode a stored value (corruption or incompatible format).
    #[error("cannot decode {what} stored at key {key}: {part}{source}")]
    Deserialize {
        /// What kind of value was stored (batch, dead letter, fingerprints).
        what: &'static str,
        /// The key it is stored at, printable.
        key: String,
        /// Which part of the value failed, as the start of the reason (`bad header: `), or
        /// empty for the whole value.
        part: &'static str,
        /// bincode's reason (shared: a commit group's failure is handed to every request).
        #[source]
        source: Arc<bincode::ErrorKind>,
    },
    /// A value does not fit the stored layout (a header too large). What bincode refuses is
    /// [`StateError::Serialize`].
    #[error("cannot encode {what} for {context}: {detail}")]
    Encode {
        /// What kind of value was being encoded.
        what: &'static str,
        /// The queue or key it was meant for.
        context: String,
        /// Why encoding failed.
        detail: String,
    },
    /// bincode could not encode a value before the transaction.
    #[error("cannot encode {what} for {context}: {source}")]
    Serialize {
        /// What kind of value was being encoded.
        what: &'static str,
        /// The queue or key it was meant for.
        context: String,
        /// bincode's reason.
        #[source]
        source: Arc<bincode::ErrorKind>,
    },
    /// `acknowledge` was called for a batch that is not pending in its queue (never committed,
    /// or already acknowledged).
    #[error("cannot acknowledge batch {seq} of {key}: it is not pending (never committed, or already acknowledged)")]
    NotPending {
        /// The queue.
        key: SinkPartition,
        /// The sequence number asked for.
        seq: u64,
    },
    /// A pipeline, sink or value name cannot be used as part of a key.
    #[error("invalid {what} name {name:?}: {reason}")]
    InvalidName {
        /// Which kind of name: `pipeline`, `sink` or `sink value`.
        what: &'static str,
        /// The name as given.
        name: String,
        /// Why it cannot be used.
        reason: &'static str,
    },
    /// A request was made after `close` (or the committer thread stopped).
    #[error("state store is closed; the committer thread no longer accepts requests")]
    Closed,
    /// The committer thread panicked (reported by `close`).
    #[error("state store committer thread panicked")]
    CommitterPanicked,
    /// A sequence counter would overflow.
    #[error("sequence counter overflow for {target}")]
    Overflow {
        /// The queue (or dead-letter owner and partition) whose sequence counter is exhausted.
        target: String,
    },
    /// Cluster mode: this worker may not write the partition (it does not own it, the owner
    /// node moved past its generation, or ZooKeeper did not confirm the write). Nothing was
    /// applied locally.
    #[error("partition {partition} of pipeline `{pipeline}` is fenced: {why}. Nothing of this request was applied locally; this worker must stop the partition and send nothing more for it (another worker owns it now, or will after loading it from ZooKeeper)")]
    Fenced {
        /// The pipeline's name.
        pipeline: String,
        /// The partition refused.
        partition: u32,
        /// Why, in words (not owned, the owner node's version, the session).
        why: String,
        /// ZooKeeper's answer, when it gave one.
        #[source]
        source: Option<zookeeper_client::Error>,
    },
    /// Cluster mode: the partition has `pending` batches in ZooKeeper, and this commit would take
    /// it past `bound`. Nothing was applied; retry after acknowledgements (back-pressure, not
    /// loss: [`crate::StateStore::commit`] waits and retries by itself).
    #[error("partition {partition} of pipeline `{pipeline}` has {pending} pending batch(es) in ZooKeeper and this commit adds {adding}, above the bound of {bound}: the commit waits until deliveries acknowledge some")]
    PendingBound {
        /// The pipeline's name.
        pipeline: String,
        /// The partition.
        partition: u32,
        /// Batches pending in ZooKeeper now.
        pending: usize,
        /// Batches the commit would add.
        adding: usize,
        /// The bound ([`crate::zk::ZkMirror::with_pending_bound`]).
        bound: usize,
    },
    /// Cluster mode: a ZooKeeper node would hold more than flow lets one hold.
    #[error("ZooKeeper node {path} would hold {bytes} bytes, above the {limit}-byte limit flow keeps every node under (ZooKeeper refuses about 1 MiB): the partition cannot commit this in cluster mode; make what the node holds smaller (a shorter source position, fewer tables per sink)")]
    NodeTooLarge {
        /// The node's path.
        path: String,
        /// The bytes it would hold.
        bytes: usize,
        /// The limit.
        limit: usize,
    },
    /// Cluster mode: one request would write more to ZooKeeper than one multi-op may carry.
    #[error("the write of partition {partition} of pipeline `{pipeline}` would send {bytes} bytes to ZooKeeper in one multi-op, above the {limit}-byte limit flow keeps requests under (ZooKeeper drops a connection whose request passes about 1 MiB): commit smaller epochs (fewer batches, fewer columns per batch)")]
    MultiTooLarge {
        /// The pipeline's name.
        pipeline: String,
        /// The partition.
        partition: u32,
        /// The bytes the request would send.
        bytes: usize,
        /// The limit.
        limit: usize,
    },
    /// Cluster mode: a request that is not allowed while the store is mirrored in ZooKeeper.
    #[error("{what} is not allowed in cluster mode: {reason}")]
    ClusterRefused {
        /// The request.
        what: &'static str,
        /// Why, and what to do instead.
        reason: String,
    },
    /// A cluster-mode request on a store without a ZooKeeper mirror.
    #[error("{what} needs the ZooKeeper mirror of cluster mode, and this store has none: attach one (`StateStore::attach_mirror`) first")]
    NoMirror {
        /// The request.
        what: &'static str,
    },
    /// A ZooKeeper read or write failed outside a fenced write (loading a partition).
    #[error("ZooKeeper {op} of {path} failed: {source}; check that ZooKeeper answers and that this worker still owns the partition, then load it again")]
    ZooKeeper {
        /// The operation, e.g. `list children`.
        op: &'static str,
        /// The node.
        path: String,
        /// ZooKeeper's reason.
        #[source]
        source: zookeeper_client::Error,
    },
    /// A value read from ZooKeeper does not fit the state layout.
    #[error("cannot decode ZooKeeper node {path}: {detail}; the partition's state in ZooKeeper was not written by this flow version, or was changed by hand")]
    BadNode {
        /// The node's path.
        path: String,
        /// Why.
        detail: String,
    },
}

impl StateError {
    /// For `map_err`: the I/O error of operation `what` on `path`.
    pub(crate) fn io<'p>(
        what: &'static str,
        path: &'p std::path::Path,
    ) -> impl FnOnce(std::io::Error) -> StateError + 'p {
        move |source| StateError::Io {
            what,
            path: path.to_path_buf(),
            source,
        }
    }

    pub(crate) fn sled(op: &'static str, target: impl Into<String>, source: sled::Error) -> Self {
        StateError::Sled {
            op,
            target: target.into(),
            source,
        }
    }

    /// A copy of the error to hand to every request of a commit group whose flush/fsync failed.
    pub(crate) fn duplicate(&self) -> StateError {
        match self {
            StateError::Sled { op, target, source } => StateError::Sled {
                op,
                target: target.clone(),
                source: source.clone(),
            },
            StateError::Io { what, path, source } => StateError::Io {
                what,
                path: path.clone(),
                source: std::io::Error::new(source.kind(), source.to_string()),
            },
            StateError::Open { dir, source } => StateError::Open {
                dir: dir.clone(),
                source: source.clone(),
            },
            StateError::Decode { what, key, detail } => StateError::Decode {
                what,
                key: key.clone(),
                detail: detail.clone(),
            },
            StateError::Deserialize {
                what,
                key,
                part,
                source,
            } => StateError::Deserialize {
                what,
                key: key.clone(),
                part,
                source: Arc::clone(source),
            },
            StateError::Serialize {
                what,
                context,
                source,
            } => StateError::Serialize {
                what,
                context: context.clone(),
                source: Arc::clone(source),
            },
            StateError::Encode {
                what,
                context,
                detail,
            } => StateError::Encode {
                what,
                context: context.clone(),
                detail: detail.clone(),
            },
            StateError::NotPending { key, seq } => StateError::NotPending {
                key: key.clone(),
                seq: *seq,
            },
            StateError::InvalidName { what, name, reason } => StateError::InvalidName {
                what,
                name: name.clone(),
                reason,
            },
            StateError::Locked { dir } => StateError::Locked { dir: dir.clone() },
            StateError::NotWritable { dir, source } => StateError::NotWritable {
                dir: dir.clone(),
                source: std::io::Error::new(source.kind(), source.to_string()),
            },
            StateError::OtherPipeline { dir, found, wanted } => StateError::OtherPipeline {
                dir: dir.clone(),
                found: found.clone(),
                wanted: wanted.clone(),
            },
            StateError::Closed => StateError::Closed,
            StateError::CommitterPanicked => StateError::CommitterPanicked,
            StateError::Overflow { target } => StateError::Overflow {
                target: target.clone(),
            },
            StateError::Fenced {
                pipeline,
                partition,
                why,
                source,
            } => StateError::Fenced {
                pipeline: pipeline.clone(),
                partition: *partition,
                why: why.clone(),
                source: source.clone(),
            },
            StateError::PendingBound {
                pipeline,
                partition,
                pending,
                adding,
                bound,
            } => StateError::PendingBound {
                pipeline: pipeline.clone(),
                partition: *partition,
                pending: *pending,
                adding: *adding,
                bound: *bound,
            },
            StateError::NodeTooLarge { path, bytes, limit } => StateError::NodeTooLarge {
                path: path.clone(),
                bytes: *bytes,
                limit: *limit,
            },
            StateError::MultiTooLarge {
                pipeline,
                partition,
                bytes,
                limit,
            } => StateError::MultiTooLarge {
                pipeline: pipeline.clone(),
                partition: *partition,
                bytes: *bytes,
                limit: *limit,
            },
            StateError::ClusterRefused { what, reason } => StateError::ClusterRefused {
                what,
                reason: reason.clone(),
            },
            StateError::NoMirror { what } => StateError::NoMirror { what },
            StateError::ZooKeeper { op, path, source } => StateError::ZooKeeper {
                op,
                path: path.clone(),
                source: source.clone(),
            },
            StateError::BadNode { path, detail } => StateError::BadNode {
                path: path.clone(),
                detail: detail.clone(),
            },
        }
    }
}

/// Whether an I/O error says that the state directory cannot be written (a read-only file
/// system, or no write permission) rather than something about what it holds.
pub(crate) fn is_not_writable(error: &std::io::Error) -> bool {
    matches!(
        error.kind(),
        std::io::ErrorKind::PermissionDenied | std::io::ErrorKind::ReadOnlyFilesystem
    )
}
