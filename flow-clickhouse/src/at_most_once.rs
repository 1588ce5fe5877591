//! `AtMostOnceClickHouseSink`: the epoch commits without waiting for ClickHouse, so a crash or a
//! failed INSERT loses rows but never duplicates them. No outbox, no token, no topology guard.
//!
//! * `at_most_once_strategy.enabled: false` (default): each partition keeps its epochs' parts and
//!   delivers them in order after the commit. A failure before an INSERT starts (the session
//!   cannot start yet) is waited out; once an INSERT has started, its failure is logged, counted
//!   in `lost_rows` and never retried.
//! * `enabled: true`: every message goes into one bounded in-memory queue per sink and the epoch
//!   does not wait for delivery. `total_queue_bytes_limit` (dynamic) bounds the queued plus
//!   in-flight encoded bytes; a message that does not fit is dropped, counted in `dropped_rows`,
//!   with a rate-limited warning.
//!
//! The counters are logged (`at-most-once sink counters`) when a partition drains or stops; on a
//! stop the queue gets one `write_timeout` to empty and the rows still queued are logged as
//! `queued_rows`. The queue's delivery task ends once the sink's factory is dropped (the pipeline
//! has ended) and the queue is empty, so a program that runs pipelines one after another does not
//! accumulate tasks.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use flow_core::delivery::{BudgetPermit, ByteBudget};
use flow_core::registry::{BuildResult, SinkBuildContext};
use flow_core::{
    Epoch, EpochOutcome, EpochWrite, Sink, SinkContext, SinkCount, SinkError, SinkFactory,
    SinkMetrics,
};
use flow_state::{CounterAdd, DeadLetter, SealedBatch};
use tokio::sync::{mpsc, watch, Notify};
use tokio::task::JoinHandle;
use tracing::{info, warn};

use crate::config::dynamic::DEFAULT_TOTAL_QUEUE_BYTES_LIMIT;
use crate::config::guarantee::SinkClass;
use crate::config::topology::ShardIndex;
use crate::delivery::cutter::{encode_routed, reject_row, BadRows, BatchCutter, Part};
use crate::delivery::insert::{insert_part, GaveUp, InsertFailure, InsertRequest};
use crate::delivery::sink_state::{build_shared, SinkShared};
use crate::encode::compress::seal;
use crate::tables::direct::{EpochTables, ManyTables, PartitionTables, RemoveRequeued};

/// Parts a partition may keep waiting for ordered delivery before its epochs wait.
const PENDING_PARTS: usize = 8;
/// At most one overflow warning per this interval.
const DROP_WARNING_INTERVAL: Duration = Duration::from_secs(10);

pub fn build(
    ctx: &SinkBuildContext<'_>,
    parameters: &serde_yaml::Value,
    dynamic: &serde_yaml::Value,
) -> BuildResult<Arc<dyn SinkFactory>> {
    let shared = build_shared(SinkClass::AtMostOnce, ctx, parameters, dynamic)?;
    let queued = shared.params.at_most_once_queue;
    Ok(Arc::new(AtMostOnceFactory {
        tables: ManyTables::of(&shared, ctx)?,
        counters: Arc::new(Counters::default()),
        budget: ByteBudget::new(shared.in_flight_budget()),
        queue: queued.then(|| Arc::new(SharedQueue::default())),
        shared,
    }))
}

/// Rows by fate, for the whole sink: totals of this run, and what the persisted counters do not
/// hold yet (committed with the next epoch of any partition, or at a drain or stop); with a
/// table template, what is not recorded yet is kept by table, for the counters' `table` label.
#[derive(Default)]
pub struct Counters {
    pub delivered_rows: AtomicU64,
    pub dropped_rows: AtomicU64,
    pub lost_rows: AtomicU64,
    unrecorded: [AtomicU64; 3],
    unrecorded_by_table: Mutex<BTreeMap<String, [u64; 3]>>,
}

/// The persisted counts of [`Counters::unrecorded`], in its order.
const RECORDED: [SinkCount; 3] = [
    SinkCount::RowsDelivered,
    SinkCount::DroppedRows,
    SinkCount::LostRows,
];

impl Counters {
    /// `rows` delivered, into `table` when the sink writes many (`None`: its one table).
    fn delivered(&self, table: Option<&str>, rows: u64) {
        self.delivered_rows.fetch_add(rows, Ordering::Relaxed);
        self.unrecorded(0, table, rows);
    }

    fn dropped(&self, rows: u64) {
        self.dropped_rows.fetch_add(rows, Ordering::Relaxed);
        self.unrecorded(1, None, rows);
    }

    /// `rows` lost, of `table` when the sink writes many.
    fn lost(&self, table: Option<&str>, rows: u64) {
        self.lost_rows.fetch_add(rows, Ordering::Relaxed);
        self.unrecorded(2, table, rows);
    }

    /// Adds `rows` to the unrecorded count at `index` (of [`RECORDED`]), by table if any.
    fn unrecorded(&self, index: usize, table: Option<&str>, rows: u64) {
        let Some(table) = table else {
            self.unrecorded[index].fetch_add(rows, Ordering::Relaxed);
            return;
        };
        let mut by_table = self
            .unrecorded_by_table
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        by_table.entry(table.to_owned()).or_default()[index] += rows;
    }

    /// What was counted since the last call, as additions to the persisted counters. Rows
    /// counted and not yet committed when the process dies are missing from the persisted
    /// totals: an at-most-once sink's counters are at most once too.
    fn take(&self, metrics: &SinkMetrics) -> Vec<CounterAdd> {
        let mut adds: Vec<CounterAdd> = RECORDED
            .iter()
            .zip(&self.unrecorded)
            .map(|(count, pending)| (count, pending.swap(0, Ordering::Relaxed)))
            .filter(|(_, by)| *by > 0)
            .map(|(count, by)| metrics.add(count.clone(), None, by))
            .collect();
        let by_table = std::mem::take(
            &mut *self
                .unrecorded_by_table
                .lock()
                .unwrap_or_else(|poisoned| poisoned.into_inner()),
        );
        for (table, pending) in by_table {
            let metrics = metrics.for_table(&table);
            let counts = RECORDED.iter().zip(pending).filter(|(_, by)| *by > 0);
            adds.extend(counts.map(|(count, by)| metrics.add(count.clone(), None, by)));
        }
        adds
    }

    /// Persists what was counted since the last commit, at a drain or a stop.
    async fn record(&self, metrics: &SinkMetrics) {
        if let Err(error) = metrics.record(&self.take(metrics)).await {
            warn!(error = %error, "the at-most-once counters of the last epoch could not be persisted; flow_sink_*_total of this sink will be short by them");
        }
    }

    /// `queued_rows`: rows still in the lossy queue, lost if the process ends now.
    fn log(&self, shared: &SinkShared, partition: u32, queued_rows: u64) {
        info!(
            database = %shared.params.database,
            table = %shared.params.table,
            partition,
            delivered_rows = self.delivered_rows.load(Ordering::Relaxed),
            dropped_rows = self.dropped_rows.load(Ordering::Relaxed),
            lost_rows = self.lost_rows.load(Ordering::Relaxed),
            queued_rows,
            "at-most-once sink counters"
        );
    }
}

struct AtMostOnceFactory {
    shared: Arc<SinkShared>,
    counters: Arc<Counters>,
    /// Bounds the ordered mode's parts in memory (`max_in_flight_bytes`), across partitions.
    budget: Arc<ByteBudget>,
    /// The bounded lossy queue (`enabled: true`), shared by every partition.
    queue: Option<Arc<SharedQueue>>,
    /// With a table template (ordered mode only: validation refuses it with the queue).
    tables: Option<ManyTables>,
}

impl Drop for AtMostOnceFactory {
    fn drop(&mut self) {
        // No partition can create a sink any more: the queue task delivers what is left, then ends.
        if let Some(queue) = &self.queue {
            queue.close();
        }
    }
}

impl SinkFactory for AtMostOnceFactory {
    fn create(&self, ctx: SinkContext) -> Result<Box<dyn Sink>, SinkError> {
        let tables = ManyTables::for_partition(self.tables.as_ref(), &self.shared, &ctx)?;
        if let Some(queue) = &self.queue {
            queue.ensure_task(&self.shared, &self.counters, &ctx.metrics);
        }
        Ok(Box::new(AtMostOnceSink {
            shared: Arc::clone(&self.shared),
            counters: Arc::clone(&self.counters),
            budget: Arc::clone(&self.budget),
            queue: self.queue.clone(),
            ctx,
            cutter: BatchCutter::default(),
            pending: Vec::new(),
            tables,
            ordered: None,
            key: Vec::new(),
        }))
    }

    fn reconfigure(&self, dynamic: &serde_yaml::Value) -> Result<(), SinkError> {
        match &self.tables {
            Some(many) => many.targets.reconfigure(dynamic)?,
            None => self.shared.reconfigure(dynamic)?,
        }
        self.budget.resize(self.shared.in_flight_budget());
        Ok(())
    }
}

struct AtMostOnceSink {
    shared: Arc<SinkShared>,
    counters: Arc<Counters>,
    budget: Arc<ByteBudget>,
    queue: Option<Arc<SharedQueue>>,
    ctx: SinkContext,
    cutter: BatchCutter,
    /// Parts of the epoch being committed, each with its table's state (ordered mode).
    pending: Vec<OrderedPart>,
    /// With a table template: this partition's tables.
    tables: Option<PartitionTables>,
    ordered: Option<OrderedDelivery>,
    key: Vec<u8>,
}

/// The ordered mode's delivery task of one partition.
struct OrderedDelivery {
    tx: Option<mpsc::Sender<(OrderedPart, BudgetPermit)>>,
    task: JoinHandle<()>,
    stop: watch::Sender<bool>,
}

#[async_trait]
impl Sink for AtMostOnceSink {
    /// With a table template, sends the rows requeued for a table that was missing, each
    /// removed from the outbox before its INSERT.
    async fn open(&mut self) -> Result<(), SinkError> {
        if let Some(tables) = &self.tables {
            let remove = RemoveRequeued::BeforeInsert;
            let sent = tables.send_requeued(&self.ctx, remove).await?;
            // Requeued rows are counted for the sink as a whole.
            self.counters.delivered(None, sent.delivered);
            self.counters.lost(None, sent.lost);
        }
        Ok(())
    }

    async fn write_epoch(&mut self, epoch: &Epoch<'_>) -> Result<EpochOutcome, SinkError> {
        if self.tables.is_some() {
            return self.write_tables(epoch).await;
        }
        let Some(session) = self.shared.session(&self.ctx.shutdown).await? else {
            return Ok(SinkShared::not_started());
        };
        let mut dead_letters = Vec::new();
        match &self.queue {
            Some(queue) => {
                let limit = self
                    .shared
                    .dynamic()
                    .at_most_once_strategy
                    .map_or(DEFAULT_TOTAL_QUEUE_BYTES_LIMIT, |d| {
                        d.total_queue_bytes_limit
                    });
                for batch in epoch.inputs {
                    let mut rejected = queue.enqueue(
                        &self.shared,
                        &session,
                        batch,
                        limit,
                        &self.counters,
                        &mut self.key,
                    )?;
                    dead_letters.append(&mut rejected);
                }
            }
            None => {
                if self.cutter.incomplete(epoch.number) {
                    return Ok(SinkShared::not_started());
                }
                let cut = self.cutter.cut_epoch(&self.shared, &session, epoch).await?;
                let (shared, metrics) = (&self.shared, &self.ctx.metrics);
                self.pending = cut
                    .parts
                    .into_iter()
                    .map(|part| OrderedPart {
                        shared: Arc::clone(shared),
                        metrics: metrics.clone(),
                        part,
                    })
                    .collect();
                dead_letters = cut.dead_letters;
            }
        }
        Ok(EpochOutcome::Commit(EpochWrite {
            dead_letters,
            counters: self.counters.take(&self.ctx.metrics),
            ..EpochWrite::default()
        }))
    }

    /// The ordered mode takes slices; the queue mode takes whole epochs, since it enqueues
    /// rows as they are encoded and could not take back a slice of a vetoed epoch.
    fn takes_slices(&self) -> bool {
        self.queue.is_none() && self.tables.is_none()
    }

    async fn write_slice(&mut self, slice: &Epoch<'_>) -> Result<(), SinkError> {
        self.cutter
            .cut_slice(&self.shared, &self.ctx.shutdown, slice)
            .await
    }

    async fn committed(&mut self, _batches: Vec<(u64, SealedBatch)>) -> Result<(), SinkError> {
        if self.pending.is_empty() {
            return Ok(());
        }
        let ordered = self
            .ordered
            .get_or_insert_with(|| start_ordered(Arc::clone(&self.counters), self.ctx.partition));
        for ordered_part in self.pending.drain(..) {
            let rows = ordered_part.part.rows;
            let table = ordered_part.metrics.table().map(str::to_owned);
            let permit = self.budget.acquire(ordered_part.part.payload.len()).await;
            let sent = match &ordered.tx {
                Some(tx) => tx.send((ordered_part, permit)).await.is_ok(),
                None => false,
            };
            if !sent {
                self.counters.lost(table.as_deref(), rows);
            }
        }
        Ok(())
    }

    async fn drain(&mut self) -> Result<(), SinkError> {
        if let Some(mut ordered) = self.ordered.take() {
            ordered.tx = None;
            let _ = (&mut ordered.task).await;
        }
        if let Some(queue) = &self.queue {
            queue.wait_empty().await;
        }
        self.counters.record(&self.ctx.metrics).await;
        self.counters.log(&self.shared, self.ctx.partition, 0);
        Ok(())
    }

    async fn close(&mut self) -> Result<(), SinkError> {
        if let Some(mut ordered) = self.ordered.take() {
            let _ = ordered.stop.send(true);
            ordered.tx = None;
            let _ = (&mut ordered.task).await;
        }
        let mut queued_rows = 0;
        if let Some(queue) = &self.queue {
            // A graceful stop gives the queue one write timeout to empty; whatever is left is
            // reported, and lost if the process ends.
            let grace = self.shared.dynamic().write_timeout;
            let _ = tokio::time::timeout(grace, queue.wait_empty()).await;
            queued_rows = queue.queued_rows();
        }
        self.counters.record(&self.ctx.metrics).await;
        self.counters
            .log(&self.shared, self.ctx.partition, queued_rows);
        Ok(())
    }

    fn reconfigure(&mut self, dynamic: &serde_yaml::Value) -> Result<(), SinkError> {
        match &self.tables {
            Some(tables) => tables.reconfigure(dynamic)?,
            None => self.shared.reconfigure(dynamic)?,
        }
        self.budget.resize(self.shared.in_flight_budget());
        Ok(())
    }
}

impl AtMostOnceSink {
    /// [`Sink::write_epoch`] with a table template: each table's parts wait for the commit, as
    /// one table's do.
    async fn write_tables(&mut self, epoch: &Epoch<'_>) -> Result<EpochOutcome, SinkError> {
        let Some(tables) = &mut self.tables else {
            return Err(SinkError::Refused(
                "an at-most-once sink without a table template was asked for its tables; this is a bug, please report it".to_owned(),
            ));
        };
        let (tables, dead_letters) = match tables.cut(epoch).await? {
            EpochTables::Cut {
                tables,
                dead_letters,
            } => (tables, dead_letters),
            EpochTables::Outcome(outcome) => return Ok(outcome),
        };
        let metrics = &self.ctx.metrics;
        self.pending = tables
            .into_iter()
            .flat_map(|table| {
                // Its INSERTs' timings and errors carry the table's label.
                let metrics = metrics.for_table(&table.shared.params.table);
                let shared = table.shared;
                table.parts.into_iter().map(move |part| OrderedPart {
                    shared: Arc::clone(&shared),
                    metrics: metrics.clone(),
                    part,
                })
            })
            .collect();
        Ok(EpochOutcome::Commit(EpochWrite {
            dead_letters,
            counters: self.counters.take(&self.ctx.metrics),
            ..EpochWrite::default()
        }))
    }
}

/// A part waiting for ordered delivery, with its table's state and metrics handle.
struct OrderedPart {
    shared: Arc<SinkShared>,
    metrics: SinkMetrics,
    part: Part,
}

fn start_ordered(counters: Arc<Counters>, partition: u32) -> OrderedDelivery {
    let (tx, mut rx) = mpsc::channel::<(OrderedPart, BudgetPermit)>(PENDING_PARTS);
    let (stop, mut stop_rx) = watch::channel(false);
    let task = tokio::spawn(async move {
        // The permit goes back to the budget once the part is delivered or lost.
        while let Some((ordered, _permit)) = rx.recv().await {
            let OrderedPart {
                shared,
                metrics,
                part,
            } = ordered;
            if *stop_rx.borrow() {
                counters.lost(metrics.table(), part.rows);
                continue;
            }
            let target = Target {
                shared: &shared,
                counters: &counters,
                metrics: &metrics,
            };
            deliver_once(&target, &part, partition, &mut stop_rx).await;
        }
    });
    OrderedDelivery {
        tx: Some(tx),
        task,
        stop,
    }
}

/// Where a delivery task sends its parts and counts their fate.
struct Target<'a> {
    shared: &'a SinkShared,
    counters: &'a Counters,
    metrics: &'a SinkMetrics,
}

/// One INSERT attempt; a failure loses the part's rows.
async fn deliver_once(
    target: &Target<'_>,
    part: &Part,
    partition: u32,
    stop: &mut watch::Receiver<bool>,
) {
    let Target {
        shared,
        counters,
        metrics,
    } = *target;
    let session = match shared.session(stop).await {
        Ok(Some(session)) => session,
        Ok(None) => {
            counters.lost(metrics.table(), part.rows);
            return;
        }
        Err(err) => {
            counters.lost(metrics.table(), part.rows);
            warn!(partition, rows = part.rows, error = %err, "at-most-once rows lost: the session cannot start");
            return;
        }
    };
    let request = InsertRequest::unrecorded(part, metrics);
    match insert_part(shared, &session, request, stop).await {
        Ok(_) => {
            counters.delivered(metrics.table(), part.rows);
        }
        // Without an attempt log nothing expires, nothing is recorded and nothing is replanned.
        Err(
            InsertFailure::Stopped
            | InsertFailure::Expired(_)
            | InsertFailure::State(_)
            | InsertFailure::Replanned,
        ) => {
            counters.lost(metrics.table(), part.rows);
        }
        Err(InsertFailure::GaveUp(GaveUp {
            error, endpoint, ..
        })) => {
            counters.lost(metrics.table(), part.rows);
            warn!(
                database = %session.database,
                table = %session.table,
                shard = %shared.shard_name(part.shard),
                endpoint = %endpoint,
                partition,
                rows = part.rows,
                error = %error,
                "at-most-once insert failed after it started; its rows are lost and not retried"
            );
        }
    }
}

/// The bounded lossy queue of `enabled: true`: encoded rows per shard, plus the bytes queued
/// or in flight.
#[derive(Default)]
struct SharedQueue {
    state: Mutex<QueueState>,
    /// Wakes the delivery task when rows arrive, and drains when the queue empties.
    changed: Notify,
    task_started: std::sync::OnceLock<()>,
    /// Set when no more rows can arrive; the task ends once the queue is empty.
    closed: std::sync::atomic::AtomicBool,
}

/// One shard's queued rows as the sending task takes them: index, encoded rows, row count.
type Taken = (usize, Vec<u8>, u64);

#[derive(Default)]
struct QueueState {
    buffers: Vec<Vec<u8>>,
    rows: Vec<u64>,
    /// Queued plus in-flight encoded bytes.
    bytes: u64,
    last_drop_warning: Option<Instant>,
    dropped_since_warning: u64,
    /// The plan the queued rows were encoded with, taken when the queue was empty: rows
    /// encoded after a change the session adopted meanwhile go out with the part, which
    /// `insert_part` then refuses (lost, as at-most-once allows, never written garbled).
    plan: Arc<str>,
}

impl SharedQueue {
    fn lock(&self) -> std::sync::MutexGuard<'_, QueueState> {
        self.state
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    fn close(&self) {
        self.closed.store(true, Ordering::SeqCst);
        self.changed.notify_waiters();
        self.changed.notify_one();
    }

    /// Starts the sink's queue task once; its failures count under the metrics of the partition
    /// that started it.
    fn ensure_task(
        self: &Arc<Self>,
        shared: &Arc<SinkShared>,
        counters: &Arc<Counters>,
        metrics: &SinkMetrics,
    ) {
        let queue = Arc::clone(self);
        let shared = Arc::clone(shared);
        let counters = Arc::clone(counters);
        let metrics = metrics.clone();
        self.task_started.get_or_init(move || {
            tokio::spawn(async move { queue.run(shared, counters, metrics).await });
        });
    }

    /// Encodes every row of `batch` into the queue, dropping rows that do not fit; returns the
    /// rows rejected under `on_bad_rows: dead_letter`.
    fn enqueue(
        &self,
        shared: &SinkShared,
        session: &crate::server::session::WriterSession,
        batch: &flow_core::MessageBatch,
        limit: u64,
        counters: &Counters,
        key: &mut Vec<u8>,
    ) -> Result<Vec<DeadLetter>, SinkError> {
        let mut dead_letters = Vec::new();
        let shards = shared.router.shards().len().max(1);
        let mut state = self.lock();
        let state = &mut *state;
        state.buffers.resize_with(shards, Vec::new);
        state.rows.resize(shards, 0);
        let mut queued = 0u64;
        let mut dropped = 0u64;
        let plan = session.plan();
        if state.buffers.iter().all(Vec::is_empty) {
            state.plan = Arc::from(plan.encoder.plan_fingerprint());
        }
        for row in batch.rows() {
            let encoded = encode_routed(shared, &plan.encoder, &row, &mut state.buffers, key);
            let (shard, size) = match encoded {
                Ok(routed) => routed,
                Err(rejected) => {
                    reject_row(shared, &row, rejected, BadRows::Record(&mut dead_letters))?;
                    continue;
                }
            };
            if state.bytes + size as u64 > limit {
                let buffer = &mut state.buffers[shard];
                buffer.truncate(buffer.len() - size);
                dropped += 1;
                continue;
            }
            state.bytes += size as u64;
            state.rows[shard] += 1;
            queued += 1;
        }
        if dropped > 0 {
            counters.dropped(dropped);
            state.dropped_since_warning += dropped;
            let due = state
                .last_drop_warning
                .is_none_or(|at| at.elapsed() >= DROP_WARNING_INTERVAL);
            if due {
                warn!(
                    database = %shared.params.database,
                    table = %shared.params.table,
                    dropped_rows = state.dropped_since_warning,
                    total_queue_bytes_limit = limit,
                    "at-most-once queue full: messages dropped. Raise at_most_once_strategy.total_queue_bytes_limit or slow the source"
                );
                state.last_drop_warning = Some(Instant::now());
                state.dropped_since_warning = 0;
            }
        }
        if queued > 0 {
            self.changed.notify_waiters();
            self.changed.notify_one();
        }
        Ok(dead_letters)
    }

    async fn run(&self, shared: Arc<SinkShared>, counters: Arc<Counters>, metrics: SinkMetrics) {
        let (_never, mut stop) = watch::channel(false);
        loop {
            // The queued rows by shard (index, encoded rows, row count), and their plan.
            let (plan, taken): (Arc<str>, Vec<Taken>) = {
                let mut state = self.lock();
                let state = &mut *state;
                let plan = Arc::clone(&state.plan);
                let taken = state
                    .buffers
                    .iter_mut()
                    .zip(state.rows.iter_mut())
                    .enumerate()
                    .filter(|(_, (buffer, _))| !buffer.is_empty())
                    .map(|(index, (buffer, rows))| {
                        (index, std::mem::take(buffer), std::mem::take(rows))
                    })
                    .collect();
                (plan, taken)
            };
            if taken.is_empty() {
                self.changed.notify_waiters();
                if self.closed.load(Ordering::SeqCst) {
                    return;
                }
                // Register before re-checking: rows enqueued between the take above and this
                // point would otherwise only `notify_one`, which a waiting `wait_empty` can
                // consume instead of this task, leaving the rows (and the drain) stuck.
                let notified = self.changed.notified();
                tokio::pin!(notified);
                notified.as_mut().enable();
                if self.lock().buffers.iter().all(Vec::is_empty)
                    && !self.closed.load(Ordering::SeqCst)
                {
                    notified.await;
                }
                continue;
            }
            for (index, raw, rows) in taken {
                let size = raw.len() as u64;
                let (format, payload) = seal(shared.params.codec, &raw);
                let part = Part {
                    shard: ShardIndex(index),
                    first_offset: 0,
                    last_offset: 0,
                    rows,
                    encoded_bytes: size,
                    // Never replayed, so never checked.
                    content_hash: 0,
                    format,
                    payload,
                    plan: Arc::clone(&plan),
                };
                let target = Target {
                    shared: &shared,
                    counters: &counters,
                    metrics: &metrics,
                };
                deliver_once(&target, &part, u32::MAX, &mut stop).await;
                self.lock().bytes -= size;
            }
        }
    }

    /// Rows waiting in the queue (not in flight).
    fn queued_rows(&self) -> u64 {
        self.lock().rows.iter().sum()
    }

    /// Waits until nothing is queued or in flight.
    async fn wait_empty(&self) {
        loop {
            let notified = self.changed.notified();
            if self.lock().bytes == 0 {
                return;
            }
            notified.await;
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use super::*;

    fn shared() -> Arc<SinkShared> {
        let inputs = [("rows".to_owned(), flow_core::sources::generator::schema())];
        let ctx = SinkBuildContext {
            pipeline: "p",
            sink: "s",
            class: SinkClass::AtMostOnce.class_name(),
            partitions: 1,
            epoch: flow_core::EpochSettings::default(),
            inputs: &inputs,
            subjects: flow_core::registry::SourceSubjects::Unknown,
            paths: flow_core::SpecPaths::working_directory(),
        };
        let parameters: serde_yaml::Value = serde_yaml::from_str(
            "{host: '127.0.0.1:1', table: t, at_most_once_strategy: {enabled: true}}",
        )
        .unwrap();
        build_shared(
            SinkClass::AtMostOnce,
            &ctx,
            &parameters,
            &serde_yaml::Value::Null,
        )
        .unwrap()
    }

    #[test]
    fn counts_of_a_table_of_a_sink_writing_many_are_recorded_with_its_table() {
        let counters = Counters::default();
        counters.delivered(None, 2);
        counters.delivered(Some("t_a"), 5);
        counters.lost(Some("t_a"), 1);
        counters.delivered(Some("t_b"), 3);
        let dir = tempfile::tempdir().unwrap();
        let store = flow_state::StateStore::open(dir.path()).unwrap();
        let metrics = SinkMetrics::new(flow_core::Metrics::new(), store, "p", "s", 0);
        let adds: Vec<(String, u64)> = counters
            .take(&metrics)
            .into_iter()
            .map(|add| (add.name, add.by))
            .collect();
        let expected = [
            ("rows_delivered", 2),
            ("rows_delivered;table=t_a", 5),
            ("lost_rows;table=t_a", 1),
            ("rows_delivered;table=t_b", 3),
        ]
        .map(|(name, by)| (name.to_owned(), by));
        assert_eq!(adds, expected);
        assert_eq!(counters.delivered_rows.load(Ordering::Relaxed), 10);
        assert!(counters.take(&metrics).is_empty(), "taken once");
    }

    #[tokio::test]
    async fn queue_task_ends_once_the_factory_is_dropped_and_the_queue_is_empty() {
        let shared = shared();
        let factory = AtMostOnceFactory {
            counters: Arc::new(Counters::default()),
            budget: ByteBudget::new(1 << 20),
            queue: Some(Arc::new(SharedQueue::default())),
            tables: None,
            shared: Arc::clone(&shared),
        };
        let queue = factory.queue.clone().unwrap();
        let dir = tempfile::tempdir().unwrap();
        let store = flow_state::StateStore::open(dir.path()).unwrap();
        let metrics = SinkMetrics::new(flow_core::Metrics::new(), store, "p", "s", 0);
        queue.ensure_task(&factory.shared, &factory.counters, &metrics);
        // Give the task time to start waiting for rows.
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert_eq!(Arc::strong_count(&queue), 3, "test, factory and task");

        drop(factory);
        let deadline = Instant::now() + Duration::from_secs(5);
        while Arc::strong_count(&queue) > 1 {
            assert!(Instant::now() < deadline, "the queue task did not end");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        // The task also released the sink's shared state.
        assert_eq!(Arc::strong_count(&shared), 1);
    }
}
