//! Cluster mode: one pipeline on several workers, coordinated through ZooKeeper.
//!
//! **Layout.**
//! - `url`: [`ClusterUrl`], `zk://HOST:PORT[,HOST:PORT]/PATH`.
//! - `session`: [`Cluster`], the worker's session (connect, root node, requests brought through a
//!   lost connection); `status`: [`SessionStatus`].
//! - `members`: the ephemeral member nodes and the watch of the member set.
//! - `assignment`: which member should own which partition ([`assigned`], [`assignment`]:
//!   rendezvous hashing with even loads).
//! - `ownership`: leases, owner nodes and generations ([`Ownership`], [`OwnerStatus`]).
//! - `topology`: the partition count every worker must share ([`Cluster::agree_on_partitions`]).
//! - `paths`: the node layout under the root; `error`: [`ClusterError`].
//!
//! **Nodes** (under the URL's root): `<pipeline>/topology` (persistent; data =
//! `partitions=<N>`), `<pipeline>/members/<worker id>` (ephemeral),
//! `<pipeline>/partitions/<p>/owner` (persistent; data = worker id, version = generation) and
//! `<pipeline>/partitions/<p>/lease` (ephemeral; data = worker id).

mod assignment;
mod error;
mod members;
mod ownership;
mod paths;
mod session;
mod status;
mod topology;
mod url;

pub use assignment::{assigned, assignment};
pub use error::ClusterError;
pub use ownership::{OwnerStatus, Ownership};
pub use session::{Cluster, DEFAULT_SESSION_TIMEOUT};
pub use status::SessionStatus;
pub use url::{ClusterHost, ClusterUrl, ClusterUrlError};
