//! The ZooKeeper node layout of a pipeline under the cluster root:
//! `<root>/<pipeline>/topology` (persistent; data = `partitions=<N>`),
//! `<root>/<pipeline>/members/<worker id>` (ephemeral),
//! `<root>/<pipeline>/partitions/<p>/owner` (persistent; data = owner's worker id, version =
//! generation) and `<root>/<pipeline>/partitions/<p>/lease` (ephemeral, held by the owner's
//! session; data = its worker id).

use super::error::ClusterError;
use super::url::refused_by_zookeeper;

/// `<root>/<pipeline>`.
pub(crate) fn pipeline_dir(root: &str, pipeline: &str) -> String {
    format!("{root}/{pipeline}")
}

/// `<root>/<pipeline>/topology`: the pipeline's partition count, recorded by its first worker.
pub(crate) fn topology(root: &str, pipeline: &str) -> String {
    format!("{root}/{pipeline}/topology")
}

/// `<root>/<pipeline>/members`.
pub(crate) fn members_dir(root: &str, pipeline: &str) -> String {
    format!("{root}/{pipeline}/members")
}

/// `<root>/<pipeline>/members/<worker id>`.
pub(crate) fn member(root: &str, pipeline: &str, worker_id: &str) -> String {
    format!("{root}/{pipeline}/members/{worker_id}")
}

/// `<root>/<pipeline>/partitions`.
pub(crate) fn partitions_dir(root: &str, pipeline: &str) -> String {
    format!("{root}/{pipeline}/partitions")
}

/// `<root>/<pipeline>/partitions/<p>`.
pub(crate) fn partition_dir(root: &str, pipeline: &str, partition: u32) -> String {
    format!("{root}/{pipeline}/partitions/{partition}")
}

/// The owner node under a partition's node.
pub(crate) fn owner(partition_dir: &str) -> String {
    format!("{partition_dir}/owner")
}

/// The lease node under a partition's node.
pub(crate) fn lease(partition_dir: &str) -> String {
    format!("{partition_dir}/lease")
}

/// A worker id or pipeline name must be one node name: ZooKeeper refuses `/` inside it, `.` and
/// `..`, and control characters.
pub(crate) fn check_name(what: &'static str, name: &str) -> Result<(), ClusterError> {
    let reason = if name.is_empty() {
        Some("it is empty")
    } else if name.contains('/') {
        Some("it contains \"/\", which would make it a path of several ZooKeeper nodes")
    } else if name == "." || name == ".." {
        Some("ZooKeeper refuses \".\" and \"..\" as node names")
    } else if name.chars().any(refused_by_zookeeper) {
        Some("it contains a control character, which ZooKeeper refuses in a node name")
    } else {
        None
    };
    match reason {
        Some(reason) => Err(ClusterError::InvalidName {
            what,
            name: name.to_owned(),
            reason,
        }),
        None => Ok(()),
    }
}
