//! Asynchronous, strictly ordered delivery of a sink partition's sealed batches.
//!
//! A `DeliveryQueue` owns one task per sink partition. Batches enter in outbox order (first the
//! undelivered ones found at open, then each newly committed epoch's) through a bounded channel,
//! so a slow target applies back-pressure to the epoch loop instead of growing memory. The
//! [`BatchDeliverer`] sends one batch and acknowledges it in the outbox; the queue never skips a
//! batch: the first error stops the task and is reported by the next `push` or `drain`.

use std::sync::Arc;

use async_trait::async_trait;
use flow_state::{SealedBatch, SinkPartition, StoredBatch};
use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;
use tracing::{debug, warn};

use crate::error::SinkError;

/// Batches that may wait in memory for delivery, per sink partition.
pub const DELIVERY_QUEUE_CAPACITY: usize = 8;

/// Sends one sealed batch to its target and removes it from the outbox
/// (`StateStore::acknowledge`) once the target holds it.
#[async_trait]
pub trait BatchDeliverer: Send + Sync + 'static {
    async fn deliver(
        &self,
        key: &SinkPartition,
        seq: u64,
        batch: &SealedBatch,
        stop: &watch::Receiver<bool>,
    ) -> Result<(), SinkError>;
}

pub struct DeliveryQueue {
    key: SinkPartition,
    tx: Option<mpsc::Sender<(u64, SealedBatch)>>,
    task: Option<JoinHandle<Result<(), SinkError>>>,
    stop: watch::Sender<bool>,
}

impl DeliveryQueue {
    /// Starts the delivery task; `backlog` are the undelivered batches found in the outbox.
    pub async fn start(
        key: SinkPartition,
        deliverer: Arc<dyn BatchDeliverer>,
        backlog: Vec<StoredBatch>,
    ) -> Result<DeliveryQueue, SinkError> {
        let (tx, mut rx) = mpsc::channel::<(u64, SealedBatch)>(DELIVERY_QUEUE_CAPACITY);
        let (stop, stop_rx) = watch::channel(false);
        let task_key = key.clone();
        let task = tokio::spawn(async move {
            while let Some((seq, batch)) = rx.recv().await {
                if *stop_rx.borrow() {
                    break;
                }
                deliverer.deliver(&task_key, seq, &batch, &stop_rx).await?;
                debug!(
                    pipeline = %task_key.pipeline,
                    sink = %task_key.sink,
                    partition = task_key.partition,
                    seq,
                    rows = batch.rows,
                    "batch delivered"
                );
            }
            Ok(())
        });
        let mut queue = DeliveryQueue {
            key,
            tx: Some(tx),
            task: Some(task),
            stop,
        };
        for stored in backlog {
            queue.push(stored.seq, stored.batch).await?;
        }
        Ok(queue)
    }

    /// Queues a committed batch; waits while the queue is full.
    pub async fn push(&mut self, seq: u64, batch: SealedBatch) -> Result<(), SinkError> {
        let Some(tx) = &self.tx else {
            return Err(SinkError::Delivery {
                reason: "the delivery queue is closed".to_owned(),
            });
        };
        if tx.send((seq, batch)).await.is_err() {
            // The task ended early: it failed, and its error explains why.
            return Err(self.finish().await.err().unwrap_or(SinkError::Delivery {
                reason: "the delivery task stopped".to_owned(),
            }));
        }
        Ok(())
    }

    /// Waits until every queued batch is delivered.
    pub async fn drain(&mut self) -> Result<(), SinkError> {
        self.tx = None;
        self.finish().await
    }

    /// Stops after the batch being delivered (if any); the rest stays in the outbox.
    pub async fn close(&mut self) -> Result<(), SinkError> {
        let _ = self.stop.send(true);
        self.tx = None;
        self.finish().await
    }

    async fn finish(&mut self) -> Result<(), SinkError> {
        self.tx = None;
        let Some(task) = self.task.take() else {
            return Ok(());
        };
        match task.await {
            Ok(result) => result,
            Err(err) => {
                warn!(pipeline = %self.key.pipeline, sink = %self.key.sink, partition = self.key.partition, error = %err, "delivery task panicked");
                Err(SinkError::Delivery {
                    reason: format!("the delivery task failed: {err}"),
                })
            }
        }
    }
}

impl Drop for DeliveryQueue {
    fn drop(&mut self) {
        let _ = self.stop.send(true);
        if let Some(task) = self.task.take() {
            task.abort();
        }
    }
}

/// The delivery side of an outbox sink partition: the [`DeliveryQueue`] once opened, with the
/// `Sink` lifecycle calls every outbox sink makes.
#[derive(Default)]
pub struct OutboxDelivery {
    queue: Option<DeliveryQueue>,
    shutdown: Option<watch::Receiver<bool>>,
}

impl OutboxDelivery {
    /// Starts delivering, first the undelivered `backlog` (see [`load_backlog`]). While the
    /// pipeline's `shutdown` is set, `committed` stops waiting for room in the queue: the batches
    /// are durable in the outbox and the next run delivers them.
    pub async fn open(
        &mut self,
        key: SinkPartition,
        deliverer: Arc<dyn BatchDeliverer>,
        backlog: Vec<StoredBatch>,
        shutdown: watch::Receiver<bool>,
    ) -> Result<(), SinkError> {
        self.shutdown = Some(shutdown.clone());
        let start = DeliveryQueue::start(key, deliverer, backlog);
        let mut shutdown = shutdown;
        tokio::select! {
            queue = start => self.queue = Some(queue?),
            _ = shutdown.wait_for(|stop| *stop) => {}
        }
        Ok(())
    }

    fn queue(&mut self) -> Result<&mut DeliveryQueue, SinkError> {
        self.queue.as_mut().ok_or_else(|| SinkError::Delivery {
            reason: "the sink was not opened".to_owned(),
        })
    }

    /// Queues the batches of a durable commit (`Sink::committed`).
    pub async fn committed(&mut self, batches: Vec<(u64, SealedBatch)>) -> Result<(), SinkError> {
        let mut shutdown = self.shutdown.clone();
        let queue = self.queue()?;
        for (seq, batch) in batches {
            let Some(shutdown) = shutdown.as_mut() else {
                queue.push(seq, batch).await?;
                continue;
            };
            tokio::select! {
                pushed = queue.push(seq, batch) => pushed?,
                _ = shutdown.wait_for(|stop| *stop) => return Ok(()),
            }
        }
        Ok(())
    }

    /// Delivers everything queued (`Sink::drain`).
    pub async fn drain(&mut self) -> Result<(), SinkError> {
        self.queue()?.drain().await
    }

    /// Stops after the batch in flight (`Sink::close`).
    pub async fn close(&mut self) -> Result<(), SinkError> {
        match self.queue.as_mut() {
            Some(queue) => queue.close().await,
            None => Ok(()),
        }
    }
}

/// The undelivered batches of a sink partition, read off the runtime threads.
pub async fn load_backlog(
    store: &flow_state::StateStore,
    key: &SinkPartition,
) -> Result<Vec<StoredBatch>, SinkError> {
    let store = store.clone();
    let key = key.clone();
    tokio::task::spawn_blocking(move || store.undelivered(&key))
        .await
        .map_err(|err| SinkError::Delivery {
            reason: format!("loading undelivered batches: {err}"),
        })?
        .map_err(SinkError::from)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    /// A target that never answers.
    struct Stuck;

    #[async_trait]
    impl BatchDeliverer for Stuck {
        async fn deliver(
            &self,
            _key: &SinkPartition,
            _seq: u64,
            _batch: &SealedBatch,
            stop: &watch::Receiver<bool>,
        ) -> Result<(), SinkError> {
            let mut stop = stop.clone();
            let _ = stop.wait_for(|s| *s).await;
            Ok(())
        }
    }

    fn batch() -> SealedBatch {
        SealedBatch {
            target: "t".to_owned(),
            columns: Vec::new(),
            format: "raw".to_owned(),
            token: "0-0".to_owned(),
            shard: String::new(),
            first_offset: 0,
            last_offset: 0,
            rows: 1,
            payload: bytes::Bytes::from_static(b"x"),
        }
    }

    #[tokio::test]
    async fn a_stuck_target_applies_back_pressure_until_shutdown_releases_it() {
        let key = SinkPartition {
            pipeline: "p".to_owned(),
            sink: "s".to_owned(),
            partition: 0,
        };
        let (stop, shutdown) = watch::channel(false);
        let mut delivery = OutboxDelivery::default();
        delivery
            .open(key, Arc::new(Stuck), Vec::new(), shutdown)
            .await
            .unwrap();
        // One batch in delivery plus a full queue: the next commit has to wait.
        let batches: Vec<_> = (0..=DELIVERY_QUEUE_CAPACITY as u64)
            .map(|seq| (seq, batch()))
            .collect();
        delivery.committed(batches).await.unwrap();
        let blocked = tokio::time::timeout(
            Duration::from_millis(200),
            delivery.committed(vec![(100, batch()), (101, batch())]),
        )
        .await;
        assert!(blocked.is_err(), "a full queue must make the epoch wait");

        let _ = stop.send(true);
        let released = tokio::time::timeout(
            Duration::from_secs(5),
            delivery.committed(vec![(102, batch())]),
        )
        .await;
        assert!(
            matches!(released, Ok(Ok(()))),
            "shutdown must release the wait"
        );
        delivery.close().await.unwrap();
    }
}
