//! What ZooKeeper holds for one owned partition, as far as building its next write needs to
//! know: filled by a load, advanced by every write ZooKeeper took.

use std::collections::{BTreeMap, BTreeSet};

use super::encoding::Counters;
use crate::codec::Bounds;

/// What ZooKeeper holds for one partition, as far as a write needs to know.
#[derive(Clone, Debug, Default)]
pub(crate) struct Model {
    /// Names of the `state` node's children.
    pub nodes: BTreeSet<String>,
    pub bounds: BTreeMap<String, Bounds>,
    /// (sink, seq) of every pending batch.
    pub pending: BTreeSet<(String, u64)>,
    /// Next dead-letter seq per owner.
    pub dl_next: BTreeMap<String, u64>,
    pub counters: Counters,
}
