//! Typed errors of cluster mode (membership, ownership, the ZooKeeper session).

use std::time::Duration;

use super::status::SessionStatus;

/// Everything that can go wrong talking to the cluster's ZooKeeper. Every variant names the
/// worker, pipeline or node it failed on.
#[derive(thiserror::Error, Debug)]
#[non_exhaustive]
pub enum ClusterError {
    /// No session could be opened with any server of the URL.
    #[error("cannot open a ZooKeeper session with {url} within {timeout:?}: {source}. Check that ZooKeeper runs there and that this machine reaches it")]
    Connect {
        /// The cluster URL.
        url: String,
        /// The session timeout asked for (the time allowed to connect).
        timeout: Duration,
        /// The client's reason.
        #[source]
        source: zookeeper_client::Error,
    },
    /// A session timeout of zero was asked for.
    #[error("the ZooKeeper session timeout must be more than zero (the default is {default:?}); the server bounds it to 2 to 20 of its ticks")]
    ZeroSessionTimeout {
        /// The default timeout.
        default: Duration,
    },
    /// A worker id or pipeline name cannot name a ZooKeeper node.
    #[error("invalid {what} {name:?} for cluster mode: {reason}")]
    InvalidName {
        /// `worker id` or `pipeline name`.
        what: &'static str,
        /// The name as given.
        name: String,
        /// Why it cannot be used.
        reason: &'static str,
    },
    /// Another live session is registered as this worker id in the pipeline.
    #[error("worker id {worker_id:?} is already a live member of pipeline {pipeline:?} ({path} is held by another ZooKeeper session): give each worker its own id; if that worker was just stopped, its session ends within its timeout ({session_timeout:?} for this worker's session) and the id is free again")]
    DuplicateMember {
        /// The refused worker id.
        worker_id: String,
        /// The pipeline.
        pipeline: String,
        /// The member node.
        path: String,
        /// This worker's negotiated session timeout.
        session_timeout: Duration,
    },
    /// The pipeline runs in the cluster with another partition count than this worker's spec.
    #[error("pipeline {pipeline:?} runs with {recorded} in this cluster ({path}) but this worker's spec says partitions: {partitions}; a worker with another partition count would read what the others have already written. Give every worker the same `partitions`; to change it, stop every worker, deliver what is pending (`flow-worker drain --cluster`), and use a new cluster path or pipeline name")]
    PartitionsDiffer {
        /// The pipeline.
        pipeline: String,
        /// The topology node.
        path: String,
        /// What the node holds (`partitions=<N>`).
        recorded: String,
        /// This worker's partition count.
        partitions: u32,
    },
    /// A ZooKeeper request failed.
    #[error("ZooKeeper {op} of {path} failed: {source}")]
    ZooKeeper {
        /// The request, e.g. `create`, `list children`.
        op: &'static str,
        /// The node it was made on.
        path: String,
        /// The client's reason.
        #[source]
        source: zookeeper_client::Error,
    },
    /// The session ended (expired or closed) while a request needed it. Its ephemeral nodes (member
    /// node, leases) are gone: connect again and join again.
    #[error("the ZooKeeper session of worker {worker_id:?} ended ({status:?}) during {op} of {path}: its member node and leases are gone; connect and join again")]
    SessionEnded {
        /// The worker whose session it was.
        worker_id: String,
        /// How it ended.
        status: SessionStatus,
        /// The request that needed it.
        op: &'static str,
        /// The node it was made on.
        path: String,
    },
    /// A node under `<root>/<pipeline>/partitions` is not named by a partition number.
    #[error("unexpected node {path} in the cluster state: the children of {parent} are partition numbers. It was not made by flow; delete it")]
    UnexpectedNode {
        /// The node.
        path: String,
        /// Its parent.
        parent: String,
    },
}
