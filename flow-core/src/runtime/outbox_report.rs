//! What `Pipeline::drain` reports: the batches pending in a pipeline's outbox before and after
//! it delivered them ([`OutboxBacklog`], [`DrainReport`]).

use flow_state::{SinkPartition, StateStore};

use crate::error::RuntimeError;
use crate::spec::ValidatedPipeline;

/// The undelivered batches of one sink partition.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PendingOutbox {
    /// The sink's name.
    pub sink: String,
    /// The partition.
    pub partition: u32,
    /// Undelivered batches (shard parts count one each).
    pub batches: u64,
    /// Rows of those batches.
    pub rows: u64,
}

/// Every sink partition of a pipeline with undelivered batches, by partition, then sink.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct OutboxBacklog {
    /// The sink partitions, by partition, then sink.
    pub entries: Vec<PendingOutbox>,
}

impl OutboxBacklog {
    /// Reads the outbox of every sink and partition of `pipeline` (blocking: sled reads).
    pub(crate) fn read(
        store: &StateStore,
        pipeline: &ValidatedPipeline,
    ) -> Result<OutboxBacklog, RuntimeError> {
        let mut entries = Vec::new();
        for partition in 0..pipeline.partitions {
            for sink in &pipeline.sinks {
                let key = SinkPartition {
                    pipeline: pipeline.name.clone(),
                    sink: sink.name.clone(),
                    partition,
                };
                let batches = store
                    .undelivered(&key)
                    .map_err(|source| RuntimeError::State { partition, source })?;
                if batches.is_empty() {
                    continue;
                }
                entries.push(PendingOutbox {
                    sink: sink.name.clone(),
                    partition,
                    batches: batches.len() as u64,
                    rows: batches.iter().map(|b| b.batch.rows).sum(),
                });
            }
        }
        Ok(OutboxBacklog { entries })
    }

    /// The sinks with pending batches in `partition`.
    pub(crate) fn sinks_of(&self, partition: u32) -> Vec<String> {
        let entries = self.entries.iter().filter(|e| e.partition == partition);
        entries.map(|e| e.sink.clone()).collect()
    }

    /// Whether nothing is pending.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Pending batches over every sink partition.
    pub fn batches(&self) -> u64 {
        self.entries.iter().map(|e| e.batches).sum()
    }

    /// Pending rows over every sink partition.
    pub fn rows(&self) -> u64 {
        self.entries.iter().map(|e| e.rows).sum()
    }
}

/// The outbox before and after a drain; `after` is empty unless a stop interrupted it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DrainReport {
    /// What was pending when the drain started.
    pub before: OutboxBacklog,
    /// What is still pending.
    pub after: OutboxBacklog,
}
