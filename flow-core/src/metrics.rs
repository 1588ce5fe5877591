//! The pipeline's Prometheus metrics ([`Metrics`]) and the counters behind them.
//!
//! Every `_total` counter is persisted in the state store ([`flow_state::CounterAdd`]): its
//! addition rides in the transaction of what it counts (an epoch's commit, a batch's
//! acknowledgement) or, for failures, goes alone; the live counter moves only once that addition
//! is durable, and a start loads the stored totals first ([`Metrics::load`]). So a counter never
//! goes backwards, across restarts and kill -9 alike. Gauges (backlog, lag) are refreshed from the
//! store's summary by the embedding program ([`Metrics::observe_summary`]).
//!
//! Cost: counters move per epoch or per batch, never per row; a sink partition holds a
//! [`SinkMetrics`] handle, and a label set is looked up (one hash, one read lock) per batch.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex, MutexGuard, Weak};

use flow_state::{
    CounterAdd, ErrorRecord, PipelineSummary, SinkRunStatus, StateError, StateStore, StoredCounter,
    SOURCE_OWNER,
};
use prometheus_client::encoding::{EncodeLabelSet, LabelSetEncoder};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;

/// What a persisted source counter counts (owner [`SOURCE_OWNER`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SourceCount {
    /// Source messages in committed epochs.
    Messages,
    /// Epochs committed.
    EpochsCommitted,
    /// Dead letters committed with the epochs.
    DeadLetters,
}

impl SourceCount {
    /// The name it is persisted under.
    pub fn name(self) -> &'static str {
        match self {
            SourceCount::Messages => "messages",
            SourceCount::EpochsCommitted => "epochs_committed",
            SourceCount::DeadLetters => "dead_letters",
        }
    }

    fn parse(name: &str) -> Option<SourceCount> {
        [
            SourceCount::Messages,
            SourceCount::EpochsCommitted,
            SourceCount::DeadLetters,
        ]
        .into_iter()
        .find(|c| c.name() == name)
    }

    /// The addition of `by` to this counter, for an [`flow_state::EpochCommit`].
    pub fn addition(self, by: u64) -> CounterAdd {
        CounterAdd {
            owner: SOURCE_OWNER.to_owned(),
            name: self.name().to_owned(),
            by,
        }
    }
}

/// What a persisted sink counter counts.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum SinkCount {
    /// Rows delivered to the target (rows set aside as dead letters excluded).
    RowsDelivered,
    /// Batches delivered to the target.
    BatchesDelivered,
    /// Failed INSERT attempts that were tried again.
    Retries,
    /// Failed INSERT attempts, by error class and server code.
    InsertErrors {
        /// The error class (`retryable`, `permanent`, `unclassified`).
        class: String,
        /// The server's error code, when it gave one.
        code: Option<u32>,
    },
    /// At-most-once: rows that did not fit the lossy queue.
    DroppedRows,
    /// At-most-once: rows whose INSERT failed and was not retried.
    LostRows,
    /// Rows of delivered batches set aside as dead letters.
    DeadLetterRows,
    /// Inserts given up (the sink then fails every later write until a restart).
    GaveUp,
    /// INSERT attempts that sent the whole body and got no verdict (they may have landed).
    UnansweredInserts,
}

/// A sink counter of one shard (`None`: the sink is not sharded, or the count is not a shard's).
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SinkCounter {
    /// What is counted.
    pub count: SinkCount,
    /// The shard (`None` when the sink is not sharded or the count is not a shard's).
    pub shard: Option<String>,
    /// The table, for a sink that writes many (a table template); `None` for one table.
    pub table: Option<String>,
}

impl SinkCounter {
    /// The counter of `count` for `shard`; an empty shard name means no shard.
    pub fn new(count: SinkCount, shard: Option<&str>) -> SinkCounter {
        SinkCounter {
            count,
            shard: shard.filter(|s| !s.is_empty()).map(str::to_owned),
            table: None,
        }
    }

    /// The same counter of table `table` (`None`: the sink writes one table).
    pub fn in_table(mut self, table: Option<&str>) -> SinkCounter {
        self.table = table.filter(|t| !t.is_empty()).map(str::to_owned);
        self
    }

    /// The name it is persisted under: `rows_delivered`, `rows_delivered;shard=a`,
    /// `rows_delivered;shard=a;table=events_buy`, `insert_errors;shard=a;class=retryable;code=210`.
    pub fn name(&self) -> String {
        let base = match &self.count {
            SinkCount::RowsDelivered => "rows_delivered",
            SinkCount::BatchesDelivered => "batches_delivered",
            SinkCount::Retries => "retries",
            SinkCount::InsertErrors { .. } => "insert_errors",
            SinkCount::DroppedRows => "dropped_rows",
            SinkCount::LostRows => "lost_rows",
            SinkCount::DeadLetterRows => "dead_letter_rows",
            SinkCount::GaveUp => "gave_up",
            SinkCount::UnansweredInserts => "unanswered_inserts",
        };
        let mut name = base.to_owned();
        if let Some(shard) = &self.shard {
            name.push_str(";shard=");
            name.push_str(shard);
        }
        if let Some(table) = &self.table {
            name.push_str(";table=");
            name.push_str(table);
        }
        if let SinkCount::InsertErrors { class, code } = &self.count {
            name.push_str(";class=");
            name.push_str(class);
            if let Some(code) = code {
                name.push_str(&format!(";code={code}"));
            }
        }
        name
    }

    /// The counter a persisted name stands for (`None`: a name this version does not know).
    pub fn parse(name: &str) -> Option<SinkCounter> {
        let mut parts = name.split(';');
        let base = parts.next()?;
        let mut labels: BTreeMap<&str, &str> = BTreeMap::new();
        for part in parts {
            let (key, value) = part.split_once('=')?;
            labels.insert(key, value);
        }
        let count = match base {
            "rows_delivered" => SinkCount::RowsDelivered,
            "batches_delivered" => SinkCount::BatchesDelivered,
            "retries" => SinkCount::Retries,
            "insert_errors" => SinkCount::InsertErrors {
                class: (*labels.get("class")?).to_owned(),
                code: match labels.get("code") {
                    Some(code) => Some(code.parse().ok()?),
                    None => None,
                },
            },
            "dropped_rows" => SinkCount::DroppedRows,
            "lost_rows" => SinkCount::LostRows,
            "dead_letter_rows" => SinkCount::DeadLetterRows,
            "gave_up" => SinkCount::GaveUp,
            "unanswered_inserts" => SinkCount::UnansweredInserts,
            _ => return None,
        };
        Some(
            SinkCounter::new(count, labels.get("shard").copied())
                .in_table(labels.get("table").copied()),
        )
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct PartitionLabels {
    pipeline: String,
    partition: u32,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, PartialOrd, Ord, EncodeLabelSet)]
struct ShardLabels {
    pipeline: String,
    sink: String,
    partition: u32,
    shard: Option<String>,
    #[prometheus(flatten)]
    table: TableLabel,
}

/// The `table` label of a sink that writes many tables; absent (not empty) for one table, so
/// that a single table's series keep their labels.
#[derive(Clone, Debug, Default, Hash, PartialEq, Eq, PartialOrd, Ord)]
struct TableLabel(Option<String>);

impl EncodeLabelSet for TableLabel {
    fn encode(&self, encoder: &mut LabelSetEncoder) -> Result<(), std::fmt::Error> {
        match &self.0 {
            Some(table) => [("table", table.as_str())].encode(encoder),
            None => Ok(()),
        }
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ErrorLabels {
    pipeline: String,
    sink: String,
    partition: u32,
    shard: Option<String>,
    #[prometheus(flatten)]
    table: TableLabel,
    class: String,
    code: Option<u32>,
}

type HistogramFamily<L> = Family<L, Histogram, fn() -> Histogram>;

/// Seconds from 1 ms to about 33 s.
fn latency_histogram() -> Histogram {
    Histogram::new(exponential_buckets(0.001, 2.0, 16))
}

/// The counter families of the source side.
struct SourceFamilies {
    messages: Family<PartitionLabels, Counter>,
    epochs: Family<PartitionLabels, Counter>,
    dead_letters: Family<PartitionLabels, Counter>,
    commit_seconds: HistogramFamily<PartitionLabels>,
    lag: Family<PartitionLabels, Gauge>,
    unavailable: Family<PartitionLabels, Gauge>,
    stalled_pulls: Family<PartitionLabels, Counter>,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct OwnershipLabels {
    pipeline: String,
    partition: u32,
    change: &'static str,
}

/// The families of a worker in a cluster (`flow-worker run --cluster`).
struct ClusterFamilies {
    ownership_changes: Family<OwnershipLabels, Counter>,
    fencing_refusals: Family<PartitionLabels, Counter>,
}

/// The families of the sink side.
struct SinkFamilies {
    rows_delivered: Family<ShardLabels, Counter>,
    batches_delivered: Family<ShardLabels, Counter>,
    retries: Family<ShardLabels, Counter>,
    insert_errors: Family<ErrorLabels, Counter>,
    dropped_rows: Family<ShardLabels, Counter>,
    lost_rows: Family<ShardLabels, Counter>,
    dead_letter_rows: Family<ShardLabels, Counter>,
    gave_up: Family<ShardLabels, Counter>,
    unanswered: Family<ShardLabels, Counter>,
    insert_seconds: HistogramFamily<ShardLabels>,
    pending_batches: Family<ShardLabels, Gauge>,
    pending_rows: Family<ShardLabels, Gauge>,
    oldest_pending_age: Family<ShardLabels, Gauge<f64, std::sync::atomic::AtomicU64>>,
}

/// Every metric of a worker, and what its sinks saw since it started (for `status`).
pub struct Metrics {
    registry: Registry,
    source: SourceFamilies,
    sink: SinkFamilies,
    cluster: ClusterFamilies,
    /// The label sets the backlog gauges were ever set for (0 while their backlog is empty).
    backlog_labels: Mutex<BTreeSet<ShardLabels>>,
    runs: Mutex<BTreeMap<(String, String, u32), SinkRunStatus>>,
    started_ms: u64,
    /// What `/ready` asks, by component (`<pipeline>/<sink>`); a component dropped is gone.
    readiness: Mutex<BTreeMap<String, Weak<dyn Readiness>>>,
    /// The partitions that failed, with why: the worker is not ready again until it restarts.
    failed: Mutex<BTreeMap<(String, u32), String>>,
}

/// A component whose readiness the metrics listener's `/ready` asks for (a sink's connections
/// to its targets). Asked on every request, so it must answer from memory.
pub trait Readiness: Send + Sync {
    /// Each thing not ready, with why (``shard `b` of `default`.`events`: none of its hosts
    /// ... has answered since the session started``); empty when ready.
    fn not_ready(&self) -> Vec<String>;
}

/// One thing `/ready` reports as not ready.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct NotReady {
    /// The component: `pipeline/sink` or `pipeline/partition N`.
    pub component: String,
    /// Why, and what is awaited.
    pub reason: String,
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

impl Metrics {
    /// An empty set of metrics, every family registered.
    pub fn new() -> Arc<Metrics> {
        let mut registry = Registry::default();
        let source = SourceFamilies::register(&mut registry);
        let sink = SinkFamilies::register(&mut registry);
        let cluster = ClusterFamilies::register(&mut registry);
        Arc::new(Metrics {
            registry,
            source,
            sink,
            cluster,
            backlog_labels: Mutex::new(BTreeSet::new()),
            runs: Mutex::new(BTreeMap::new()),
            started_ms: crate::clock::now_ms(),
            readiness: Mutex::new(BTreeMap::new()),
            failed: Mutex::new(BTreeMap::new()),
        })
    }

    /// Has `/ready` ask `probe` for `component` (a later registration under the same name
    /// replaces it: every partition of a sink registers the sink's one probe).
    pub fn register_readiness(&self, component: String, probe: Weak<dyn Readiness>) {
        lock(&self.readiness).insert(component, probe);
    }

    /// Counts a change of a partition's ownership in a cluster: `acquired`, `released` (handed
    /// over or stopped) or `lost` (a commit refused by the fence: another worker holds it).
    pub fn ownership_changed(&self, pipeline: &str, partition: u32, change: &'static str) {
        let labels = OwnershipLabels {
            pipeline: pipeline.to_owned(),
            partition,
            change,
        };
        self.cluster.ownership_changes.get_or_create(&labels).inc();
        if change == "lost" {
            let labels = PartitionLabels {
                pipeline: pipeline.to_owned(),
                partition,
            };
            self.cluster.fencing_refusals.get_or_create(&labels).inc();
        }
    }

    /// Records that a partition failed: `/ready` reports it until the worker restarts.
    pub fn partition_failed(&self, pipeline: &str, partition: u32, reason: String) {
        lock(&self.failed).insert((pipeline.to_owned(), partition), reason);
    }

    /// Everything not ready now: failed partitions first, then the sinks that gave up (at once:
    /// their partition fails only at its next write), then each registered component's answer.
    /// Empty when the worker is ready.
    pub fn not_ready(&self) -> Vec<NotReady> {
        let mut out: Vec<NotReady> = lock(&self.failed)
            .iter()
            .map(|((pipeline, partition), reason)| NotReady {
                component: format!("{pipeline}/partition {partition}"),
                reason: format!("the partition failed: {reason}"),
            })
            .collect();
        out.extend(lock(&self.runs).iter().filter_map(|((pipeline, sink, partition), run)| {
            let gave_up = run.gave_up.as_ref()?;
            let code = gave_up.code.map_or_else(String::new, |c| format!(", code {c}"));
            Some(NotReady {
                component: format!("{pipeline}/{sink}"),
                reason: format!(
                    "partition {partition}: the sink gave up ({}{code}): {}; it fails every later write until the worker restarts",
                    gave_up.class, gave_up.text
                ),
            })
        }));
        let probes: Vec<(String, Arc<dyn Readiness>)> = {
            let mut readiness = lock(&self.readiness);
            readiness.retain(|_, probe| probe.strong_count() > 0);
            readiness
                .iter()
                .filter_map(|(name, probe)| Some((name.clone(), probe.upgrade()?)))
                .collect()
        };
        // Asked outside the lock: a probe may take locks of its own.
        for (component, probe) in probes {
            out.extend(probe.not_ready().into_iter().map(|reason| NotReady {
                component: component.clone(),
                reason,
            }));
        }
        out
    }

    /// The Prometheus text exposition (format 0.0.4) of every metric.
    pub fn encode(&self) -> Result<String, std::fmt::Error> {
        let mut text = String::new();
        prometheus_client::encoding::prometheus_text::encode(&mut text, &self.registry)?;
        Ok(text)
    }

    /// Starts the counters of `pipeline` at their persisted totals (once, before the run).
    pub fn load(&self, pipeline: &str, stored: &[StoredCounter]) {
        for counter in stored.iter().filter(|c| c.pipeline == pipeline) {
            self.add_one(
                pipeline,
                counter.partition,
                &counter.owner,
                &counter.name,
                counter.value,
            );
        }
    }

    /// Moves the live counters by additions that are now durable. An addition of 0 creates no
    /// series, as the store writes nothing for it: a series never vanishes at a restart.
    pub fn applied(&self, pipeline: &str, partition: u32, adds: &[CounterAdd]) {
        for add in adds.iter().filter(|add| add.by > 0) {
            self.add_one(pipeline, partition, &add.owner, &add.name, add.by);
        }
    }

    fn add_one(&self, pipeline: &str, partition: u32, owner: &str, name: &str, by: u64) {
        if owner == SOURCE_OWNER {
            let labels = PartitionLabels {
                pipeline: pipeline.to_owned(),
                partition,
            };
            let family = match SourceCount::parse(name) {
                Some(SourceCount::Messages) => &self.source.messages,
                Some(SourceCount::EpochsCommitted) => &self.source.epochs,
                Some(SourceCount::DeadLetters) => &self.source.dead_letters,
                None => return,
            };
            family.get_or_create(&labels).inc_by(by);
            return;
        }
        if let Some(counter) = SinkCounter::parse(name) {
            self.sink.add(pipeline, owner, partition, &counter, by);
        }
    }

    /// How long an epoch's commit took.
    pub fn observe_commit(&self, pipeline: &str, partition: u32, seconds: f64) {
        let labels = PartitionLabels {
            pipeline: pipeline.to_owned(),
            partition,
        };
        self.source
            .commit_seconds
            .get_or_create(&labels)
            .observe(seconds);
    }

    /// Sets `flow_source_unavailable` of `partition`: whether its source cannot read and waits.
    pub fn observe_source_unavailable(&self, pipeline: &str, partition: u32, unavailable: bool) {
        let labels = PartitionLabels {
            pipeline: pipeline.to_owned(),
            partition,
        };
        self.source
            .unavailable
            .get_or_create(&labels)
            .set(i64::from(unavailable));
    }

    /// Raises `flow_source_stalled_pulls_total` of `partition` to `total`, the count its source
    /// keeps (a counter never goes down: a lower `total` is ignored).
    pub fn observe_source_stalled_pulls(&self, pipeline: &str, partition: u32, total: u64) {
        let labels = PartitionLabels {
            pipeline: pipeline.to_owned(),
            partition,
        };
        let counter = self.source.stalled_pulls.get_or_create(&labels);
        let seen = counter.get();
        if total > seen {
            counter.inc_by(total - seen);
        }
    }

    /// Sets the backlog gauges from the store's summary of `pipeline` (ages at `now_ms`), and the
    /// lag of each partition that reports one.
    pub fn observe_summary(&self, pipeline: &str, summary: &PipelineSummary, now_ms: u64) {
        for (&partition, position) in &summary.positions {
            if let Some(lag) = position.lag {
                let labels = PartitionLabels {
                    pipeline: pipeline.to_owned(),
                    partition,
                };
                let lag = i64::try_from(lag).unwrap_or(i64::MAX);
                self.source.lag.get_or_create(&labels).set(lag);
            }
        }
        let mut known = lock(&self.backlog_labels);
        let mut set = BTreeSet::new();
        for sink in &summary.sinks {
            let labels = |shard: Option<String>| ShardLabels {
                pipeline: pipeline.to_owned(),
                sink: sink.sink.clone(),
                partition: sink.partition,
                shard: shard.filter(|s| !s.is_empty()),
                table: TableLabel::default(),
            };
            for (shard, backlog) in &sink.shards {
                let labels = labels(Some(shard.clone()));
                let age_ms = now_ms.saturating_sub(backlog.oldest_sealed_at_ms);
                self.sink
                    .set_backlog(&labels, backlog.undelivered, backlog.rows, age_ms);
                set.insert(labels);
            }
            // A sink partition with nothing pending still shows 0 for each shard it delivered
            // to (or for the sink, unsharded), so that a dashboard has a series to draw.
            let delivered_to = sink
                .counters
                .keys()
                .filter_map(|name| SinkCounter::parse(name))
                .map(|counter| counter.shard);
            known.extend(delivered_to.map(labels));
            if sink.shards.is_empty() && sink.counters.is_empty() {
                known.insert(labels(None));
            }
        }
        for idle in known.difference(&set) {
            self.sink.set_backlog(idle, 0, 0, 0);
        }
        known.extend(set);
    }

    /// Fills in what the sinks of `pipeline` saw since the worker started.
    pub fn fill_run_status(&self, pipeline: &str, summary: &mut PipelineSummary) {
        let runs = lock(&self.runs);
        for sink in &mut summary.sinks {
            let key = (pipeline.to_owned(), sink.sink.clone(), sink.partition);
            let mut run = runs.get(&key).cloned().unwrap_or_default();
            run.since_ms = self.started_ms;
            sink.run = Some(run);
        }
    }

    fn update_run(&self, key: (String, String, u32), update: impl FnOnce(&mut SinkRunStatus)) {
        let mut runs = lock(&self.runs);
        update(runs.entry(key).or_default());
    }
}

impl SourceFamilies {
    fn register(registry: &mut Registry) -> SourceFamilies {
        let families = SourceFamilies {
            messages: Family::default(),
            epochs: Family::default(),
            dead_letters: Family::default(),
            commit_seconds: Family::new_with_constructor(latency_histogram),
            lag: Family::default(),
            unavailable: Family::default(),
            stalled_pulls: Family::default(),
        };
        registry.register(
            "flow_source_messages",
            "Messages read and committed, per partition",
            families.messages.clone(),
        );
        registry.register(
            "flow_source_dead_letters",
            "Source records set aside as dead letters, per partition",
            families.dead_letters.clone(),
        );
        registry.register(
            "flow_epochs_committed",
            "Epochs committed to the state store, per partition",
            families.epochs.clone(),
        );
        registry.register(
            "flow_commit_seconds",
            "Time an epoch's commit took to be durable (group commit, one fsync per group)",
            families.commit_seconds.clone(),
        );
        registry.register(
            "flow_source_lag_messages",
            "Messages the broker holds beyond the partition's position (broker sources)",
            families.lag.clone(),
        );
        registry.register(
            "flow_source_unavailable",
            "1 while the partition's source cannot read and waits (a broker stream that disappeared), 0 otherwise",
            families.unavailable.clone(),
        );
        registry.register(
            "flow_source_stalled_pulls",
            "Broker pulls the partition's source found silent (no message, no heartbeat) and made again",
            families.stalled_pulls.clone(),
        );
        families
    }
}

impl ClusterFamilies {
    fn register(registry: &mut Registry) -> ClusterFamilies {
        let families = ClusterFamilies {
            ownership_changes: Family::default(),
            fencing_refusals: Family::default(),
        };
        registry.register(
            "flow_partition_ownership_changes",
            "Partitions this worker took (acquired), gave back (released) or lost to a fence (lost), in cluster mode",
            families.ownership_changes.clone(),
        );
        registry.register(
            "flow_fencing_refusals",
            "Commits of a partition the cluster refused because another worker owns it now (cluster mode)",
            families.fencing_refusals.clone(),
        );
        families
    }
}

impl SinkFamilies {
    fn register(registry: &mut Registry) -> SinkFamilies {
        let f = SinkFamilies {
            rows_delivered: Family::default(),
            batches_delivered: Family::default(),
            retries: Family::default(),
            insert_errors: Family::default(),
            dropped_rows: Family::default(),
            lost_rows: Family::default(),
            dead_letter_rows: Family::default(),
            gave_up: Family::default(),
            unanswered: Family::default(),
            insert_seconds: Family::new_with_constructor(latency_histogram),
            pending_batches: Family::default(),
            pending_rows: Family::default(),
            oldest_pending_age: Family::default(),
        };
        let counters: [(&str, &str, &Family<ShardLabels, Counter>); 8] = [
            (
                "flow_sink_rows_delivered",
                "Rows the target holds, acknowledged in the outbox",
                &f.rows_delivered,
            ),
            (
                "flow_sink_batches_delivered",
                "Batches (shard parts) the target holds",
                &f.batches_delivered,
            ),
            (
                "flow_sink_retries",
                "Failed INSERT attempts that were tried again",
                &f.retries,
            ),
            (
                "flow_sink_dropped_rows",
                "At-most-once rows dropped because the queue was full",
                &f.dropped_rows,
            ),
            (
                "flow_sink_lost_rows",
                "At-most-once rows whose INSERT failed and was not retried",
                &f.lost_rows,
            ),
            (
                "flow_sink_dead_letter_rows",
                "Rows set aside as dead letters by the sink",
                &f.dead_letter_rows,
            ),
            (
                "flow_sink_gave_up",
                "Inserts given up; the sink then fails until a restart",
                &f.gave_up,
            ),
            (
                "flow_sink_unanswered_inserts",
                "INSERTs sent whole without a verdict (timeout, broken connection, 319): they may have landed",
                &f.unanswered,
            ),
        ];
        for (name, help, family) in counters {
            registry.register(name, help, family.clone());
        }
        registry.register(
            "flow_sink_insert_errors",
            "Failed INSERT attempts, by error class and server code",
            f.insert_errors.clone(),
        );
        registry.register(
            "flow_sink_insert_seconds",
            "Duration of successful INSERTs",
            f.insert_seconds.clone(),
        );
        let gauges: [(&str, &str, &Family<ShardLabels, Gauge>); 2] = [
            (
                "flow_sink_pending_batches",
                "Batches in the outbox not yet delivered",
                &f.pending_batches,
            ),
            (
                "flow_sink_pending_rows",
                "Rows in the outbox not yet delivered",
                &f.pending_rows,
            ),
        ];
        for (name, help, family) in gauges {
            registry.register(name, help, family.clone());
        }
        registry.register(
            "flow_sink_oldest_pending_age_seconds",
            "Age of the oldest undelivered batch (compare with the shard's deduplication window)",
            f.oldest_pending_age.clone(),
        );
        f
    }

    fn add(&self, pipeline: &str, sink: &str, partition: u32, counter: &SinkCounter, by: u64) {
        let labels = ShardLabels {
            pipeline: pipeline.to_owned(),
            sink: sink.to_owned(),
            partition,
            shard: counter.shard.clone(),
            table: TableLabel(counter.table.clone()),
        };
        let family = match &counter.count {
            SinkCount::RowsDelivered => &self.rows_delivered,
            SinkCount::BatchesDelivered => &self.batches_delivered,
            SinkCount::Retries => &self.retries,
            SinkCount::DroppedRows => &self.dropped_rows,
            SinkCount::LostRows => &self.lost_rows,
            SinkCount::DeadLetterRows => &self.dead_letter_rows,
            SinkCount::GaveUp => &self.gave_up,
            SinkCount::UnansweredInserts => &self.unanswered,
            SinkCount::InsertErrors { class, code } => {
                let labels = ErrorLabels {
                    pipeline: labels.pipeline,
                    sink: labels.sink,
                    table: labels.table,
                    partition,
                    shard: labels.shard,
                    class: class.clone(),
                    code: *code,
                };
                self.insert_errors.get_or_create(&labels).inc_by(by);
                return;
            }
        };
        family.get_or_create(&labels).inc_by(by);
    }

    fn set_backlog(&self, labels: &ShardLabels, batches: u64, rows: u64, age_ms: u64) {
        let gauge = |v: u64| i64::try_from(v).unwrap_or(i64::MAX);
        self.pending_batches
            .get_or_create(labels)
            .set(gauge(batches));
        self.pending_rows.get_or_create(labels).set(gauge(rows));
        self.oldest_pending_age
            .get_or_create(labels)
            .set(age_ms as f64 / 1000.0);
    }
}

/// One sink partition's handle on the metrics (in [`crate::SinkContext`]).
#[derive(Clone)]
pub struct SinkMetrics {
    metrics: Arc<Metrics>,
    store: StateStore,
    pipeline: String,
    sink: String,
    partition: u32,
    /// The table of a sink that writes many; `None` for one table.
    table: Option<String>,
}

impl SinkMetrics {
    /// The handle of partition `partition` of `sink`: counts persist through `store`.
    pub fn new(
        metrics: Arc<Metrics>,
        store: StateStore,
        pipeline: &str,
        sink: &str,
        partition: u32,
    ) -> SinkMetrics {
        SinkMetrics {
            metrics,
            store,
            pipeline: pipeline.to_owned(),
            sink: sink.to_owned(),
            partition,
            table: None,
        }
    }

    /// The handle of one table of a sink that writes many (a table template): its counts and
    /// INSERT timings carry a `table` label.
    pub fn for_table(&self, table: &str) -> SinkMetrics {
        SinkMetrics {
            table: Some(table.to_owned()),
            ..self.clone()
        }
    }

    /// The table of this handle ([`SinkMetrics::for_table`]); `None` for a sink's own.
    pub fn table(&self) -> Option<&str> {
        self.table.as_deref()
    }

    /// Has `/ready` ask `probe` about this sink (one probe per sink: each partition's call
    /// replaces the last).
    pub fn register_readiness(&self, probe: Weak<dyn Readiness>) {
        self.metrics
            .register_readiness(format!("{}/{}", self.pipeline, self.sink), probe);
    }

    /// The addition of `by` to `count` of `shard`, to ride in a commit or an acknowledgement
    /// ([`flow_state::AckExtras::counters`]); call [`SinkMetrics::applied`] once it is durable.
    pub fn add(&self, count: SinkCount, shard: Option<&str>, by: u64) -> CounterAdd {
        CounterAdd {
            owner: self.sink.clone(),
            name: SinkCounter::new(count, shard)
                .in_table(self.table.as_deref())
                .name(),
            by,
        }
    }

    /// The additions of a batch of `rows` delivered to `shard`: its rows and one batch.
    pub fn delivered(&self, shard: Option<&str>, rows: u64) -> [CounterAdd; 2] {
        [
            self.add(SinkCount::RowsDelivered, shard, rows),
            self.add(SinkCount::BatchesDelivered, shard, 1),
        ]
    }

    /// Moves the live counters by additions that are now durable.
    pub fn applied(&self, adds: &[CounterAdd]) {
        self.metrics.applied(&self.pipeline, self.partition, adds);
    }

    /// Makes additions durable on their own, then moves the live counters.
    pub async fn record(&self, adds: &[CounterAdd]) -> Result<(), StateError> {
        self.store
            .add_counters(&self.pipeline, self.partition, adds)
            .await?;
        self.applied(adds);
        Ok(())
    }

    /// How long a successful INSERT into `shard` took.
    pub fn observe_insert(&self, shard: Option<&str>, seconds: f64) {
        let labels = ShardLabels {
            pipeline: self.pipeline.clone(),
            sink: self.sink.clone(),
            partition: self.partition,
            shard: shard.filter(|s| !s.is_empty()).map(str::to_owned),
            table: TableLabel(self.table.clone()),
        };
        self.metrics
            .sink
            .insert_seconds
            .get_or_create(&labels)
            .observe(seconds);
    }

    /// A failed INSERT attempt into `shard` (`retried`: it will be tried again), for `status`;
    /// the persisted counters go through [`SinkMetrics::record`].
    pub fn failed(&self, shard: Option<&str>, error: ErrorRecord, retried: bool) {
        let shard = shard.unwrap_or_default().to_owned();
        self.metrics.update_run(self.key(), |run| {
            let shard = run.shards.entry(shard).or_default();
            shard.errors += 1;
            shard.retries += u64::from(retried);
            shard.last_error = Some(error);
        });
    }

    /// The sink gave up an insert into `shard`: counted, recorded in the store for `status`
    /// (a worker that then fails leaves the reason behind) and shown live (the first reason).
    pub async fn gave_up(
        &self,
        shard: Option<&str>,
        reason: ErrorRecord,
    ) -> Result<(), StateError> {
        let value = Some(reason.encode());
        self.metrics.update_run(self.key(), |run| {
            run.gave_up.get_or_insert(reason);
        });
        let name = flow_state::gave_up_value_name(self.partition);
        self.store
            .set_sink_value(&self.pipeline, &self.sink, &name, value)
            .await?;
        self.record(&[self.add(SinkCount::GaveUp, shard, 1)]).await
    }

    /// A new run of the sink partition: the last run's give-up record no longer holds.
    pub async fn clear_gave_up(&self) -> Result<(), StateError> {
        let name = flow_state::gave_up_value_name(self.partition);
        let (store, pipeline, sink) =
            (self.store.clone(), self.pipeline.clone(), self.sink.clone());
        let read = name.clone();
        // A sled read may touch the disk: off the runtime's threads.
        let recorded =
            tokio::task::spawn_blocking(move || store.sink_value(&pipeline, &sink, &read))
                .await
                // The blocking task ends unfinished only when the runtime shuts down.
                .map_err(|_| StateError::Closed)??;
        if recorded.is_none() {
            return Ok(());
        }
        self.store
            .set_sink_value(&self.pipeline, &self.sink, &name, None)
            .await
    }

    fn key(&self) -> (String, String, u32) {
        (self.pipeline.clone(), self.sink.clone(), self.partition)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sink_counter_names_round_trip_with_shard_class_and_code() {
        let counters = [
            SinkCounter::new(SinkCount::RowsDelivered, None),
            SinkCounter::new(SinkCount::RowsDelivered, Some("a")),
            SinkCounter::new(
                SinkCount::InsertErrors {
                    class: "retryable".to_owned(),
                    code: Some(210),
                },
                Some("b"),
            ),
            SinkCounter::new(
                SinkCount::InsertErrors {
                    class: "unclassified".to_owned(),
                    code: None,
                },
                None,
            ),
        ];
        let names: Vec<String> = counters.iter().map(SinkCounter::name).collect();
        assert_eq!(
            names,
            [
                "rows_delivered",
                "rows_delivered;shard=a",
                "insert_errors;shard=b;class=retryable;code=210",
                "insert_errors;class=unclassified",
            ]
        );
        let parsed: Vec<Option<SinkCounter>> =
            names.iter().map(|n| SinkCounter::parse(n)).collect();
        assert_eq!(parsed, counters.map(Some));
        assert_eq!(SinkCounter::parse("from_a_later_version"), None);
        // An unsharded sink's shard is `""` in the outbox: no shard label.
        assert_eq!(SinkCounter::new(SinkCount::Retries, Some("")).shard, None);
    }

    #[test]
    fn loaded_and_applied_counters_show_in_the_exposition_with_their_labels() {
        let metrics = Metrics::new();
        let stored = StoredCounter {
            pipeline: "p".to_owned(),
            owner: "ch".to_owned(),
            partition: 1,
            name: "rows_delivered;shard=a".to_owned(),
            value: 40,
        };
        let other = StoredCounter {
            pipeline: "other".to_owned(),
            ..stored.clone()
        };
        metrics.load("p", &[stored, other]);
        metrics.applied(
            "p",
            1,
            &[
                SourceCount::Messages.addition(7),
                CounterAdd {
                    owner: "ch".to_owned(),
                    name: "rows_delivered;shard=a".to_owned(),
                    by: 2,
                },
            ],
        );
        let text = metrics.encode().unwrap_or_default();
        assert!(
            text.contains(
                "flow_sink_rows_delivered_total{pipeline=\"p\",sink=\"ch\",partition=\"1\",shard=\"a\"} 42\n"
            ),
            "{text}"
        );
        assert!(
            text.contains("flow_source_messages_total{pipeline=\"p\",partition=\"1\"} 7\n"),
            "{text}"
        );
        assert!(!text.contains("other"), "{text}");
    }

    #[test]
    fn a_table_of_a_sink_writing_many_gets_a_table_label_and_one_table_none() {
        let metrics = Metrics::new();
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let store = StateStore::open(dir.path()).unwrap_or_else(|e| panic!("{e}"));
        let sink = SinkMetrics::new(Arc::clone(&metrics), store, "p", "ch", 1);
        let in_table = sink
            .for_table("events_buy")
            .add(SinkCount::RowsDelivered, Some("a"), 5);
        assert_eq!(in_table.name, "rows_delivered;shard=a;table=events_buy");
        assert_eq!(
            SinkCounter::parse(&in_table.name),
            Some(
                SinkCounter::new(SinkCount::RowsDelivered, Some("a")).in_table(Some("events_buy"))
            )
        );
        let one_table = sink.add(SinkCount::RowsDelivered, Some("a"), 3);
        assert_eq!(one_table.name, "rows_delivered;shard=a");
        sink.applied(&[in_table, one_table]);
        sink.for_table("events_buy").observe_insert(Some("a"), 0.01);
        let text = metrics.encode().unwrap_or_default();
        let labels = "pipeline=\"p\",sink=\"ch\",partition=\"1\",shard=\"a\"";
        for line in [
            format!("flow_sink_rows_delivered_total{{{labels},table=\"events_buy\"}} 5\n"),
            format!("flow_sink_rows_delivered_total{{{labels}}} 3\n"),
            format!("flow_sink_insert_seconds_count{{{labels},table=\"events_buy\"}} 1\n"),
        ] {
            assert!(text.contains(&line), "{line} in {text}");
        }
    }

    /// Issue 46 item 12: a sink that gave up is not ready at once, named as the component
    /// (it was listed only when its partition failed at its next epoch, 30 s later).
    #[tokio::test]
    async fn a_sink_that_gave_up_is_not_ready_at_once_named_as_the_component() {
        let metrics = Metrics::new();
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let store = StateStore::open(dir.path()).unwrap_or_else(|e| panic!("{e}"));
        let sink = SinkMetrics::new(Arc::clone(&metrics), store, "p", "ch", 1);
        assert_eq!(metrics.not_ready(), []);
        let reason = ErrorRecord {
            code: Some(60),
            class: "permanent".to_owned(),
            text: "Table default.t doesn't exist".to_owned(),
            at_ms: 1,
        };
        sink.gave_up(Some("a"), reason)
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(
            metrics.not_ready(),
            [NotReady {
                component: "p/ch".to_owned(),
                reason: "partition 1: the sink gave up (permanent, code 60): Table default.t \
                         doesn't exist; it fails every later write until the worker restarts"
                    .to_owned(),
            }]
        );
    }

    #[test]
    fn stalled_pulls_follow_the_source_count_and_never_go_down() {
        let metrics = Metrics::new();
        let series = "flow_source_stalled_pulls_total{pipeline=\"p\",partition=\"2\"}";
        metrics.observe_source_stalled_pulls("p", 2, 0);
        let text = metrics.encode().unwrap_or_default();
        assert!(text.contains(&format!("{series} 0\n")), "{text}");
        metrics.observe_source_stalled_pulls("p", 2, 3);
        // A lower count (never given by a source, which only counts up) leaves the counter.
        metrics.observe_source_stalled_pulls("p", 2, 1);
        let text = metrics.encode().unwrap_or_default();
        assert!(text.contains(&format!("{series} 3\n")), "{text}");
        metrics.observe_source_stalled_pulls("p", 2, 5);
        let text = metrics.encode().unwrap_or_default();
        assert!(text.contains(&format!("{series} 5\n")), "{text}");
    }

    #[test]
    fn backlog_and_lag_gauges_follow_the_summary_and_the_backlog_falls_to_zero_once_delivered() {
        let metrics = Metrics::new();
        let mut summary = PipelineSummary::default();
        let backlog = flow_state::ShardBacklog {
            undelivered: 2,
            rows: 2000,
            oldest_sealed_at_ms: 10_000,
        };
        summary.sinks.push(flow_state::SinkPartitionSummary {
            sink: "ch".to_owned(),
            partition: 0,
            shards: [("a".to_owned(), backlog)].into_iter().collect(),
            ..Default::default()
        });
        let mut position = flow_state::PositionInfo::of(&7u64.to_be_bytes());
        position.lag = Some(1234);
        summary.positions.insert(0, position);
        metrics.observe_summary("p", &summary, 25_500);
        let series = |text: &str, name: &str| {
            text.lines()
                .find(|l| {
                    l.starts_with(&format!(
                        "{name}{{pipeline=\"p\",sink=\"ch\",partition=\"0\",shard=\"a\"}}"
                    ))
                })
                .and_then(|l| l.rsplit_once(' '))
                .map(|(_, v)| v.to_owned())
        };
        let text = metrics.encode().unwrap_or_default();
        assert_eq!(
            series(&text, "flow_sink_pending_batches").as_deref(),
            Some("2"),
            "{text}"
        );
        assert_eq!(
            series(&text, "flow_sink_pending_rows").as_deref(),
            Some("2000")
        );
        assert!(
            text.contains("\nflow_source_lag_messages{pipeline=\"p\",partition=\"0\"} 1234\n"),
            "{text}"
        );
        assert_eq!(
            series(&text, "flow_sink_oldest_pending_age_seconds").as_deref(),
            Some("15.5")
        );
        summary.sinks[0].shards.clear();
        metrics.observe_summary("p", &summary, 30_000);
        let text = metrics.encode().unwrap_or_default();
        assert_eq!(
            series(&text, "flow_sink_pending_batches").as_deref(),
            Some("0")
        );
        assert_eq!(
            series(&text, "flow_sink_oldest_pending_age_seconds").as_deref(),
            Some("0.0")
        );
    }
}
