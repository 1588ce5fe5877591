//! The two-phase toolkit of a sink with an outbox: a [`Sealer`] (what differs between sinks:
//! checking guards, sealing an epoch's batches) made into a [`Sink`] by [`OutboxSink`], whose
//! [`OutboxDelivery`] queues the durable batches for delivery; [`blocking`] runs a state-store
//! call off the runtime threads.

use std::sync::Arc;

use async_trait::async_trait;
use flow_state::{SealedBatch, SinkPartition, StateStore, StoredBatch, StoredBody};
use tokio::sync::watch;

use super::batch_deliverer::BatchDeliverer;
use super::lanes::{DeliveryQueue, Queued, SinkDelivery};
use crate::error::SinkError;
use crate::plugin::{Epoch, EpochOutcome, Sink};

/// The delivery side of an outbox sink partition: its delivery task once opened, with the
/// `Sink` lifecycle calls every outbox sink makes.
#[derive(Default)]
pub struct OutboxDelivery {
    queue: Option<DeliveryQueue>,
    shared: Option<Arc<SinkDelivery>>,
    shutdown: Option<watch::Receiver<bool>>,
}

impl OutboxDelivery {
    /// Starts delivering. While the pipeline's `shutdown` is set, [`OutboxDelivery::push`]
    /// stops waiting for room: the batches are durable in the outbox and the next run delivers
    /// them.
    pub fn open(
        &mut self,
        key: SinkPartition,
        deliverer: Arc<dyn BatchDeliverer>,
        shared: Arc<SinkDelivery>,
        shutdown: watch::Receiver<bool>,
    ) {
        self.queue = Some(DeliveryQueue::start(key, deliverer, &shared));
        self.shared = Some(shared);
        self.shutdown = Some(shutdown);
    }

    /// Whether the delivery was started (a sink stopping before it could check its target
    /// never starts it).
    pub fn is_open(&self) -> bool {
        self.queue.is_some()
    }

    /// Queues a durable batch, waiting for room in the sink's byte budget and in the queue.
    /// Returns `false` (without queueing) once the pipeline is stopping.
    pub async fn push(
        &mut self,
        seq: u64,
        batch: SealedBatch,
        origin_ms: u64,
    ) -> Result<bool, SinkError> {
        let (Some(queue), Some(shared)) = (self.queue.as_mut(), self.shared.as_ref()) else {
            return Err(SinkError::Delivery {
                reason: "the sink was not opened".to_owned(),
            });
        };
        let mut shutdown = self.shutdown.clone();
        let stopping = async {
            match shutdown.as_mut() {
                Some(shutdown) => {
                    let _ = shutdown.wait_for(|stop| *stop).await;
                }
                None => std::future::pending::<()>().await,
            }
        };
        let budget = Arc::clone(&shared.budget);
        let enqueue = async {
            let permit = budget.acquire(batch.payload.len()).await;
            queue
                .push(Queued {
                    seq,
                    batch,
                    origin_ms,
                    _permit: permit,
                })
                .await
        };
        // Biased: a batch with room is queued even while stopping, so a stop's drain delivers
        // it; only waiting for room ends with the stop.
        tokio::select! {
            biased;
            pushed = enqueue => pushed.map(|()| true),
            () = stopping => Ok(false),
        }
    }

    /// Queues an undelivered batch found in the outbox whose payload is stored, read back (and
    /// checked) off the runtime threads; `false` (nothing queued) once the pipeline is stopping.
    /// A batch stored as bounds must be rebuilt by its sink: it is refused here.
    pub async fn push_stored(
        &mut self,
        store: &StateStore,
        key: &SinkPartition,
        stored: StoredBatch,
    ) -> Result<bool, SinkError> {
        let StoredBody::Payload(location) = stored.body else {
            return Err(SinkError::Refused(format!(
                "{key}: batch {} was stored without its payload, and this sink cannot rebuild it from the source; start with a new state directory",
                stored.seq
            )));
        };
        let (store, task_key) = (store.clone(), key.clone());
        let payload = blocking(move || store.load_payload(&task_key, &location)).await?;
        let sealed_at_ms = stored.batch.sealed_at_ms;
        let batch = SealedBatch {
            payload,
            ..stored.batch
        };
        self.push(stored.seq, batch, sealed_at_ms).await
    }

    /// Queues the batches of a durable commit (`Sink::committed`).
    pub async fn committed(
        &mut self,
        batches: Vec<(u64, SealedBatch)>,
        origin_ms: u64,
    ) -> Result<(), SinkError> {
        for (seq, batch) in batches {
            if !self.push(seq, batch, origin_ms).await? {
                return Ok(());
            }
        }
        Ok(())
    }

    /// Delivers everything queued (`Sink::drain`).
    pub async fn drain(&mut self) -> Result<(), SinkError> {
        match self.queue.as_mut() {
            Some(queue) => queue.drain().await,
            None => Err(SinkError::Delivery {
                reason: "the sink was not opened".to_owned(),
            }),
        }
    }

    /// Stops after the batch in flight (`Sink::close`).
    pub async fn close(&mut self) -> Result<(), SinkError> {
        match self.queue.as_mut() {
            Some(queue) => queue.close().await,
            None => Ok(()),
        }
    }
}

/// The undelivered batches of a sink partition (metadata only), read off the runtime threads.
pub async fn load_backlog(
    store: &StateStore,
    key: &SinkPartition,
) -> Result<Vec<StoredBatch>, SinkError> {
    let store = store.clone();
    let key = key.clone();
    blocking(move || store.undelivered(&key)).await
}

/// Runs a state-store call (`f`) on the blocking thread pool, so that its disk I/O never holds a
/// runtime thread, and turns its error into the sink's: a [`flow_state::StateError`] into
/// [`SinkError::State`], a task that panicked or was cancelled into [`SinkError::DeliveryFailed`].
/// What sinks with an outbox use for every store call they make from async code.
pub async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, flow_state::StateError> + Send + 'static,
) -> Result<T, SinkError> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|err| SinkError::DeliveryFailed {
            context: "state task failed".to_owned(),
            source: Box::new(err),
        })?
        .map_err(SinkError::from)
}

/// The sealing half of an outbox sink: what differs between sinks. [`OutboxSink`] adds the
/// delivery half.
#[async_trait]
pub trait Sealer: Send {
    /// Checks guards and starts `delivery` (with [`OutboxDelivery::open`]), then queues the
    /// undelivered batches found in the outbox. Leaving `delivery` closed means the pipeline
    /// began stopping first.
    async fn open(&mut self, delivery: &mut OutboxDelivery) -> Result<(), SinkError>;

    /// Seals what the epoch will deliver, or vetoes it.
    async fn seal(&mut self, epoch: &Epoch<'_>) -> Result<EpochOutcome, SinkError>;

    /// Whether the sealer takes epochs in slices ([`Sink::takes_slices`]).
    fn takes_slices(&self) -> bool {
        false
    }

    /// Takes one slice of the epoch that a later [`Sealer::seal`] ends ([`Sink::write_slice`]).
    async fn seal_slice(&mut self, slice: &Epoch<'_>) -> Result<(), SinkError> {
        let _ = slice;
        Err(crate::plugin::slices_not_taken())
    }

    /// New dynamic parameters.
    fn reconfigure(&mut self, dynamic: &serde_yaml::Value) -> Result<(), SinkError>;

    /// After the delivery drained: an error when batches were kept instead of delivered (a
    /// sink whose target it can no longer write keeps sealing into the outbox, so that the
    /// pipeline's other sinks go on, and says so here, at the end of the run).
    async fn drained(&mut self) -> Result<(), SinkError> {
        Ok(())
    }
}

/// A [`Sink`] made of a [`Sealer`] and an [`OutboxDelivery`].
pub struct OutboxSink<S> {
    sealer: S,
    delivery: OutboxDelivery,
    /// Start of the epoch being committed (ms since the Unix epoch), for latency.
    epoch_started_ms: u64,
}

impl<S: Sealer> OutboxSink<S> {
    /// A sink made of `sealer`; its delivery opens in [`Sealer::open`].
    pub fn new(sealer: S) -> OutboxSink<S> {
        OutboxSink {
            sealer,
            delivery: OutboxDelivery::default(),
            epoch_started_ms: 0,
        }
    }
}

#[async_trait]
impl<S: Sealer> Sink for OutboxSink<S> {
    async fn open(&mut self) -> Result<(), SinkError> {
        self.sealer.open(&mut self.delivery).await
    }

    async fn write_epoch(&mut self, epoch: &Epoch<'_>) -> Result<EpochOutcome, SinkError> {
        self.epoch_started_ms = epoch.started_ms;
        self.sealer.seal(epoch).await
    }

    fn takes_slices(&self) -> bool {
        self.sealer.takes_slices()
    }

    async fn write_slice(&mut self, slice: &Epoch<'_>) -> Result<(), SinkError> {
        self.sealer.seal_slice(slice).await
    }

    async fn committed(&mut self, batches: Vec<(u64, SealedBatch)>) -> Result<(), SinkError> {
        self.delivery
            .committed(batches, self.epoch_started_ms)
            .await
    }

    async fn drain(&mut self) -> Result<(), SinkError> {
        self.delivery.drain().await?;
        self.sealer.drained().await
    }

    async fn close(&mut self) -> Result<(), SinkError> {
        self.delivery.close().await
    }

    fn reconfigure(&mut self, dynamic: &serde_yaml::Value) -> Result<(), SinkError> {
        self.sealer.reconfigure(dynamic)
    }
}
