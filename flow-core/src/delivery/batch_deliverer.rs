//! [`BatchDeliverer`]: what a sink with an outbox supplies to send one sealed batch to its
//! target; the delivery lanes call it.

use async_trait::async_trait;
use flow_state::{SealedBatch, SinkPartition};
use tokio::sync::watch;

use crate::error::SinkError;

/// Sends one sealed batch to its target and removes it from the outbox
/// (`StateStore::acknowledge`) once the target holds it.
#[async_trait]
pub trait BatchDeliverer: Send + Sync + 'static {
    /// Sends batch `seq` of queue `key` to its target and acknowledges it in the outbox; returns
    /// once both are done. An error stops the partition's delivery (no batch is skipped). `stop`
    /// turns `true` when the pipeline stops: a deliverer waiting on its target should then return.
    async fn deliver(
        &self,
        key: &SinkPartition,
        seq: u64,
        batch: &SealedBatch,
        stop: &watch::Receiver<bool>,
    ) -> Result<(), SinkError>;

    /// Whether [`BatchDeliverer::reload`] works, so that a stalled lane's batches may be set
    /// aside: left in the outbox and read back when the lane moves again, instead of holding
    /// every other lane of the partition up once the queue is full.
    fn reloads(&self) -> bool {
        false
    }

    /// The first undelivered batch for `shard` whose seq is above `after`, read back from the
    /// outbox with its payload (rebuilt, for a batch stored as bounds); `None` when the outbox
    /// holds no more for that shard.
    async fn reload(
        &self,
        _key: &SinkPartition,
        _shard: &str,
        _after: Option<u64>,
    ) -> Result<Option<(u64, SealedBatch)>, SinkError> {
        Ok(None)
    }
}
