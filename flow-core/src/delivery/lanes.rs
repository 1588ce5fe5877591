//! The delivery task of a sink partition ([`DeliveryQueue`]): committed batches in outbox
//! order through a bounded channel into one lane per shard, each delivering one batch at a
//! time, lanes side by side.

use std::collections::{BTreeMap, VecDeque};
use std::sync::Arc;
use std::time::Duration;

use flow_state::{SealedBatch, SinkPartition};
use tokio::sync::{mpsc, watch};
use tokio::task::{JoinHandle, JoinSet};
use tracing::{debug, info, warn};

use super::batch_deliverer::BatchDeliverer;
use super::budget::{BudgetPermit, ByteBudget};
use super::latency::DeliveryLatency;
use crate::error::SinkError;

/// Batches that may wait in memory for delivery, per sink partition, twice: in the channel to
/// the delivery task and in its lanes (besides one in flight per lane).
pub const DELIVERY_QUEUE_CAPACITY: usize = 8;

/// How long a lane's delivery may run while its later batches fill the queue before they are
/// set aside (left in the outbox, dropped from memory) so that the other lanes go on.
pub const LANE_STALL: Duration = Duration::from_secs(10);

/// Batches a stalled lane may keep waiting in memory before the next one is set aside.
const STALLED_LANE_DEPTH: usize = 2;

/// What the delivery of one sink shares across its partitions.
pub struct SinkDelivery {
    /// The payload bytes the sink may hold in memory.
    pub budget: Arc<ByteBudget>,
    /// Epoch-to-acknowledgement latency of the sink.
    pub latency: Arc<DeliveryLatency>,
}

impl SinkDelivery {
    /// Shared delivery state of `sink`, with a budget of `budget_bytes`.
    pub fn new(sink: &str, budget_bytes: u64) -> Arc<SinkDelivery> {
        Arc::new(SinkDelivery {
            budget: ByteBudget::new(budget_bytes),
            latency: DeliveryLatency::new(sink),
        })
    }
}

/// A batch on its way to the delivery task.
pub(super) struct Queued {
    pub(super) seq: u64,
    pub(super) batch: SealedBatch,
    /// When its messages started to be read (ms since the Unix epoch).
    pub(super) origin_ms: u64,
    pub(super) _permit: BudgetPermit,
}

/// The delivery task of one sink partition and the bounded channel into it.
pub(crate) struct DeliveryQueue {
    key: SinkPartition,
    tx: Option<mpsc::Sender<Queued>>,
    task: Option<JoinHandle<Result<(), SinkError>>>,
    stop: watch::Sender<bool>,
}

impl DeliveryQueue {
    /// Starts the delivery task.
    pub fn start(
        key: SinkPartition,
        deliverer: Arc<dyn BatchDeliverer>,
        shared: &SinkDelivery,
    ) -> DeliveryQueue {
        let (tx, rx) = mpsc::channel::<Queued>(DELIVERY_QUEUE_CAPACITY);
        let (stop, stop_rx) = watch::channel(false);
        let lanes = Lanes {
            key: key.clone(),
            deliverer,
            latency: Arc::clone(&shared.latency),
            budget: Arc::clone(&shared.budget),
            stop: stop_rx,
            lanes: BTreeMap::new(),
            waiting_count: 0,
            in_flight: JoinSet::new(),
        };
        let task = tokio::spawn(lanes.run(rx));
        DeliveryQueue {
            key,
            tx: Some(tx),
            task: Some(task),
            stop,
        }
    }

    /// Queues a committed batch; waits while the queue is full.
    pub(super) async fn push(&mut self, queued: Queued) -> Result<(), SinkError> {
        let Some(tx) = &self.tx else {
            return Err(SinkError::Delivery {
                reason: "the delivery queue is closed".to_owned(),
            });
        };
        if tx.send(queued).await.is_err() {
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
        // The handle stays until the task ended, so a drain given up part-way (a stop's bounded
        // drain time) leaves `close` a task to stop and wait for.
        let Some(task) = self.task.as_mut() else {
            return Ok(());
        };
        let joined = task.await;
        self.task = None;
        match joined {
            Ok(result) => result,
            Err(err) => {
                warn!(pipeline = %self.key.pipeline, sink = %self.key.sink, partition = self.key.partition, error = %err, "delivery task panicked");
                Err(SinkError::DeliveryFailed {
                    context: "the delivery task failed".to_owned(),
                    source: Box::new(err),
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

/// What one job of a lane reports back.
struct LaneDone {
    shard: String,
    /// The batch delivered; `None` for a read-back that found the outbox empty for the lane.
    seq: Option<u64>,
    rows: u64,
    origin_ms: u64,
    result: Result<(), SinkError>,
}

/// One shard's lane of a delivery task.
#[derive(Default)]
struct Lane {
    waiting: VecDeque<Queued>,
    /// When the delivery in flight started; `None` while idle.
    busy_since: Option<tokio::time::Instant>,
    /// The last seq delivered or in flight: a batch at or below it that arrives later was
    /// already read back from the outbox.
    last_seq: Option<u64>,
    /// Batches were set aside: until the outbox holds none for this shard, arrivals are dropped
    /// and the lane reads its batches back from the outbox one by one.
    set_aside: bool,
}

impl Lane {
    fn stalled(&self) -> bool {
        self.busy_since.is_some_and(|at| at.elapsed() >= LANE_STALL)
    }
}

/// The delivery task of a sink partition: one lane per shard (`SealedBatch::shard`), each
/// delivering its batches one at a time in outbox order, lanes side by side. A slow shard thus
/// delays only its own parts until the queue ahead of it is full; then, if the deliverer can read
/// batches back ([`BatchDeliverer::reloads`]), a lane stalled for [`LANE_STALL`] has its later
/// batches set aside (they stay in the outbox) and reads them back once it moves again, so the
/// other lanes go on. An unsharded sink has one lane and delivers strictly in order.
struct Lanes {
    key: SinkPartition,
    deliverer: Arc<dyn BatchDeliverer>,
    latency: Arc<DeliveryLatency>,
    budget: Arc<ByteBudget>,
    stop: watch::Receiver<bool>,
    lanes: BTreeMap<String, Lane>,
    waiting_count: usize,
    in_flight: JoinSet<LaneDone>,
}

impl Lanes {
    async fn run(mut self, mut rx: mpsc::Receiver<Queued>) -> Result<(), SinkError> {
        let mut open = true;
        let reloads = self.deliverer.reloads();
        loop {
            let stopping = *self.stop.borrow();
            if !stopping {
                self.start_idle_lanes();
            }
            if (stopping || !open) && self.in_flight.is_empty() {
                // Closed: every lane ran dry; stopping: what is not delivered stays in the outbox.
                return Ok(());
            }
            let room = open && !stopping && self.waiting_count < DELIVERY_QUEUE_CAPACITY;
            let full = open && !stopping && reloads && !room;
            tokio::select! {
                queued = rx.recv(), if room => match queued {
                    Some(queued) => self.arrived(queued, reloads),
                    None => open = false,
                },
                Some(done) = self.in_flight.join_next() => self.finished(done)?,
                changed = self.stop.changed(), if !stopping => {
                    if changed.is_err() {
                        // The queue is gone: nobody waits for this task any more.
                        return Ok(());
                    }
                }
                () = tokio::time::sleep(Duration::from_secs(1)), if full => self.set_aside_stalled(),
            }
        }
    }

    fn arrived(&mut self, queued: Queued, reloads: bool) {
        let lane = self.lanes.entry(queued.batch.shard.clone()).or_default();
        if lane.set_aside || lane.last_seq.is_some_and(|last| queued.seq <= last) {
            // In the outbox: the lane reads it back (or already did).
            return;
        }
        if reloads && lane.stalled() && lane.waiting.len() >= STALLED_LANE_DEPTH {
            lane.set_aside = true;
            Self::warn_set_aside(&self.key, &queued.batch.shard);
            return;
        }
        self.waiting_count += 1;
        lane.waiting.push_back(queued);
    }

    /// The queue is full: a stalled lane's waiting batches go back to the outbox alone.
    fn set_aside_stalled(&mut self) {
        for (shard, lane) in &mut self.lanes {
            if lane.stalled() && !lane.waiting.is_empty() {
                self.waiting_count -= lane.waiting.len();
                lane.waiting.clear();
                lane.set_aside = true;
                Self::warn_set_aside(&self.key, shard);
            }
        }
    }

    fn warn_set_aside(key: &SinkPartition, shard: &str) {
        warn!(
            pipeline = %key.pipeline,
            sink = %key.sink,
            partition = key.partition,
            shard = %shard,
            stalled_s = LANE_STALL.as_secs(),
            "a shard's delivery is stalled; its later batches wait in the outbox while the other shards go on, and are read back once it moves again. Check that shard's hosts"
        );
    }

    fn start_idle_lanes(&mut self) {
        for (shard, lane) in &mut self.lanes {
            if lane.busy_since.is_some() {
                continue;
            }
            if let Some(queued) = lane.waiting.pop_front() {
                self.waiting_count -= 1;
                lane.busy_since = Some(tokio::time::Instant::now());
                lane.last_seq = Some(queued.seq);
                let (deliverer, key, stop) = (
                    Arc::clone(&self.deliverer),
                    self.key.clone(),
                    self.stop.clone(),
                );
                self.in_flight.spawn(async move {
                    // Bound whole, so the budget permit is held until the delivery ends.
                    let Queued {
                        seq,
                        batch,
                        origin_ms,
                        _permit: permit,
                    } = queued;
                    let result = deliverer.deliver(&key, seq, &batch, &stop).await;
                    drop(permit);
                    LaneDone {
                        shard: batch.shard,
                        seq: Some(seq),
                        rows: batch.rows,
                        origin_ms,
                        result,
                    }
                });
            } else if lane.set_aside {
                lane.busy_since = Some(tokio::time::Instant::now());
                self.in_flight.spawn(read_back(
                    Arc::clone(&self.deliverer),
                    Arc::clone(&self.budget),
                    self.key.clone(),
                    shard.clone(),
                    lane.last_seq,
                    self.stop.clone(),
                ));
            }
        }
    }

    fn finished(
        &mut self,
        done: Result<LaneDone, tokio::task::JoinError>,
    ) -> Result<(), SinkError> {
        let done = done.map_err(|err| {
            warn!(pipeline = %self.key.pipeline, sink = %self.key.sink, partition = self.key.partition, error = %err, "delivery task panicked");
            SinkError::DeliveryFailed {
                context: "the delivery task failed".to_owned(),
                source: Box::new(err),
            }
        })?;
        let lane = self.lanes.entry(done.shard.clone()).or_default();
        lane.busy_since = None;
        done.result?;
        let Some(seq) = done.seq else {
            // The outbox holds nothing more for the lane: it takes arrivals again.
            lane.set_aside = false;
            info!(pipeline = %self.key.pipeline, sink = %self.key.sink, partition = self.key.partition, shard = %done.shard, "a stalled shard caught up with the outbox");
            return Ok(());
        };
        lane.last_seq = lane.last_seq.max(Some(seq));
        if !*self.stop.borrow() {
            self.latency.record(done.origin_ms);
        }
        debug!(
            pipeline = %self.key.pipeline,
            sink = %self.key.sink,
            partition = self.key.partition,
            shard = %done.shard,
            seq,
            rows = done.rows,
            "batch delivered"
        );
        Ok(())
    }
}

/// Reads the next set-aside batch of `shard` back from the outbox and delivers it.
async fn read_back(
    deliverer: Arc<dyn BatchDeliverer>,
    budget: Arc<ByteBudget>,
    key: SinkPartition,
    shard: String,
    after: Option<u64>,
    stop: watch::Receiver<bool>,
) -> LaneDone {
    let mut done = LaneDone {
        shard,
        seq: None,
        rows: 0,
        origin_ms: 0,
        result: Ok(()),
    };
    let (seq, batch) = match deliverer.reload(&key, &done.shard, after).await {
        Ok(Some(found)) => found,
        Ok(None) => return done,
        Err(err) => {
            done.result = Err(err);
            return done;
        }
    };
    let permit = budget.acquire(batch.payload.len()).await;
    done.result = deliverer.deliver(&key, seq, &batch, &stop).await;
    drop(permit);
    done.seq = Some(seq);
    done.rows = batch.rows;
    done.origin_ms = batch.sealed_at_ms;
    done
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Mutex;

    use async_trait::async_trait;

    use crate::delivery::OutboxDelivery;
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

    fn batch(len: usize) -> SealedBatch {
        SealedBatch {
            target: "t".to_owned(),
            columns: Vec::new(),
            format: "raw".to_owned(),
            token: "0-0".to_owned(),
            shard: String::new(),
            first_offset: 0,
            last_offset: 0,
            rows: 1,
            encoded_bytes: len as u64,
            plan: String::new(),
            sealed_at_ms: 0,
            content_hash: 0,
            payload: bytes::Bytes::from(vec![b'x'; len]),
        }
    }

    fn key() -> SinkPartition {
        SinkPartition {
            pipeline: "p".to_owned(),
            sink: "s".to_owned(),
            partition: 0,
        }
    }

    #[tokio::test]
    async fn a_stuck_target_applies_back_pressure_until_shutdown_releases_it() {
        let (stop, shutdown) = watch::channel(false);
        let mut delivery = OutboxDelivery::default();
        delivery.open(
            key(),
            Arc::new(Stuck),
            SinkDelivery::new("s", 1 << 20),
            shutdown,
        );
        // One batch in delivery plus a full channel and a full lane: the next commit has to wait.
        let batches: Vec<_> = (0..=2 * DELIVERY_QUEUE_CAPACITY as u64)
            .map(|seq| (seq, batch(1)))
            .collect();
        delivery.committed(batches, 0).await.unwrap();
        let blocked = tokio::time::timeout(
            Duration::from_millis(200),
            delivery.committed(vec![(100, batch(1)), (101, batch(1))], 0),
        )
        .await;
        assert!(blocked.is_err(), "a full queue must make the epoch wait");

        let _ = stop.send(true);
        let released = tokio::time::timeout(
            Duration::from_secs(5),
            delivery.committed(vec![(102, batch(1))], 0),
        )
        .await;
        assert!(
            matches!(released, Ok(Ok(()))),
            "shutdown must release the wait"
        );
        delivery.close().await.unwrap();
    }

    /// Records deliveries; shard `b` waits for shutdown, the others take 5 ms.
    struct ShardBStuck {
        delivered: Mutex<Vec<(String, u64)>>,
    }

    #[async_trait]
    impl BatchDeliverer for ShardBStuck {
        async fn deliver(
            &self,
            _key: &SinkPartition,
            seq: u64,
            batch: &SealedBatch,
            stop: &watch::Receiver<bool>,
        ) -> Result<(), SinkError> {
            if batch.shard == "b" {
                let mut stop = stop.clone();
                let _ = stop.wait_for(|s| *s).await;
                return Ok(());
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
            let mut delivered = self.delivered.lock().unwrap();
            delivered.push((batch.shard.clone(), seq));
            Ok(())
        }
    }

    #[tokio::test]
    async fn a_stuck_shard_delays_only_its_own_parts_and_each_shard_keeps_outbox_order() {
        let (stop, shutdown) = watch::channel(false);
        let deliverer = Arc::new(ShardBStuck {
            delivered: Mutex::new(Vec::new()),
        });
        let mut delivery = OutboxDelivery::default();
        let shared = SinkDelivery::new("s", 1 << 20);
        let as_dyn: Arc<dyn BatchDeliverer> = deliverer.clone();
        delivery.open(key(), as_dyn, shared, shutdown);
        // Parts alternate a, c, b as one logical batch per three seqs.
        let shards = ["a", "c", "b"];
        let batches: Vec<_> = (0..9u64)
            .map(|seq| {
                let mut b = batch(1);
                b.shard = shards[seq as usize % 3].to_owned();
                (seq, b)
            })
            .collect();
        delivery.committed(batches, 0).await.unwrap();
        let want: Vec<(String, u64)> = vec![
            ("a".into(), 0),
            ("a".into(), 3),
            ("a".into(), 6),
            ("c".into(), 1),
            ("c".into(), 4),
            ("c".into(), 7),
        ];
        for _ in 0..200 {
            if deliverer.delivered.lock().unwrap().len() == want.len() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let mut got = deliverer.delivered.lock().unwrap().clone();
        let in_order: Vec<_> = ["a", "c"]
            .iter()
            .map(|s| {
                got.iter()
                    .filter(|(g, _)| g == s)
                    .map(|(_, q)| *q)
                    .collect::<Vec<_>>()
            })
            .collect();
        assert_eq!(in_order, vec![vec![0, 3, 6], vec![1, 4, 7]]);
        got.sort();
        assert_eq!(got, want);
        let _ = stop.send(true);
        delivery.close().await.unwrap();
        assert_eq!(deliverer.delivered.lock().unwrap().len(), 6);
    }

    /// An outbox in memory: shard `b` blocks until released, the others deliver at once; every
    /// delivery removes its batch, and `reload` reads the outbox as the state store would.
    struct Outbox {
        pending: Mutex<BTreeMap<u64, SealedBatch>>,
        delivered: Mutex<Vec<(String, u64)>>,
        release_b: watch::Receiver<bool>,
    }

    #[async_trait]
    impl BatchDeliverer for Outbox {
        async fn deliver(
            &self,
            _key: &SinkPartition,
            seq: u64,
            batch: &SealedBatch,
            stop: &watch::Receiver<bool>,
        ) -> Result<(), SinkError> {
            if batch.shard == "b" {
                let (mut release, mut stop) = (self.release_b.clone(), stop.clone());
                tokio::select! {
                    _ = release.wait_for(|r| *r) => {}
                    _ = stop.wait_for(|s| *s) => return Ok(()),
                }
            }
            let removed = self.pending.lock().unwrap().remove(&seq);
            assert!(removed.is_some(), "batch {seq} delivered twice");
            self.delivered
                .lock()
                .unwrap()
                .push((batch.shard.clone(), seq));
            Ok(())
        }

        fn reloads(&self) -> bool {
            true
        }

        async fn reload(
            &self,
            _key: &SinkPartition,
            shard: &str,
            after: Option<u64>,
        ) -> Result<Option<(u64, SealedBatch)>, SinkError> {
            let pending = self.pending.lock().unwrap();
            Ok(pending
                .iter()
                .find(|(seq, b)| b.shard == shard && after.is_none_or(|a| **seq > a))
                .map(|(seq, b)| (*seq, b.clone())))
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_stalled_shard_sets_its_batches_aside_so_the_others_go_on_and_reads_them_back_in_order(
    ) {
        let (release, release_b) = watch::channel(false);
        let (_stop, shutdown) = watch::channel(false);
        let outbox = Arc::new(Outbox {
            pending: Mutex::new(BTreeMap::new()),
            delivered: Mutex::new(Vec::new()),
            release_b,
        });
        let mut delivery = OutboxDelivery::default();
        let as_dyn: Arc<dyn BatchDeliverer> = outbox.clone();
        delivery.open(key(), as_dyn, SinkDelivery::new("s", 1 << 20), shutdown);
        // Far more batches than the queue holds: without setting b's aside, a would starve.
        for seq in 0..60u64 {
            let mut b = batch(1);
            b.shard = if seq % 2 == 0 { "a" } else { "b" }.to_owned();
            outbox.pending.lock().unwrap().insert(seq, b.clone());
            delivery.committed(vec![(seq, b)], 0).await.unwrap();
        }
        let delivered_of = |shard: &str| -> Vec<u64> {
            let delivered = outbox.delivered.lock().unwrap();
            delivered
                .iter()
                .filter(|(s, _)| s == shard)
                .map(|(_, q)| *q)
                .collect()
        };
        for _ in 0..100 {
            if delivered_of("a").len() == 30 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        assert_eq!(delivered_of("a"), (0..60).step_by(2).collect::<Vec<_>>());
        assert!(delivered_of("b").is_empty());
        let _ = release.send(true);
        delivery.drain().await.unwrap();
        assert_eq!(delivered_of("b"), (1..60).step_by(2).collect::<Vec<_>>());
        assert!(outbox.pending.lock().unwrap().is_empty());
    }

    #[tokio::test]
    async fn payload_bytes_held_for_delivery_never_exceed_the_sink_budget() {
        let (_stop, shutdown) = watch::channel(false);
        let shared = SinkDelivery::new("s", 1000);
        let mut delivery = OutboxDelivery::default();
        delivery.open(key(), Arc::new(Stuck), Arc::clone(&shared), shutdown);
        // 3 x 300 bytes fit in 1000; the fourth must wait although the queue has room.
        delivery
            .committed((0..3).map(|seq| (seq, batch(300))).collect(), 0)
            .await
            .unwrap();
        let blocked = tokio::time::timeout(
            Duration::from_millis(200),
            delivery.committed(vec![(3, batch(300))], 0),
        )
        .await;
        assert!(
            blocked.is_err(),
            "the fourth batch must wait for budget: {blocked:?}"
        );
        assert_eq!(shared.budget.available_permits(), 100);
        // A batch larger than the whole budget still goes once everything else is done.
        shared.budget.resize(2000);
        assert_eq!(shared.budget.available_permits(), 1100);
        let fits = tokio::time::timeout(
            Duration::from_millis(500),
            delivery.committed(vec![(4, batch(300))], 0),
        )
        .await;
        assert!(matches!(fits, Ok(Ok(()))), "a larger budget must admit it");
        delivery.close().await.unwrap();
        assert_eq!(shared.budget.available_permits(), 2000);
    }

    #[tokio::test]
    async fn a_budget_shrunk_while_in_use_settles_at_the_new_limit() {
        let budget = ByteBudget::new(1000);
        let held = budget.acquire(800).await;
        budget.resize(300);
        // 200 were free and are forgotten at once; 500 more are owed by the holder.
        assert_eq!(budget.available_permits(), 0);
        drop(held);
        assert_eq!(budget.available_permits(), 300);
        let oversized = budget.acquire(5000).await;
        assert_eq!(budget.available_permits(), 0);
        drop(oversized);
        assert_eq!(budget.available_permits(), 300);
    }
}
