//! Running a validated pipeline: the [`Pipeline`] an embedding program starts and the
//! [`PipelineControl`] that stops or reloads it while it runs. Each partition is a task of its
//! own that repeats one epoch (`partition`):
//!
//! 1. read from the source until `epoch.max_messages` or `epoch.max_duration`;
//! 2. run the processors, stream by stream;
//! 3. hand each sink its input streams; a sink seals batches or vetoes the commit;
//! 4. commit the new source position with every sink's batches and dead letters in ONE state
//!    transaction (durable before it is reported), then tell the sinks, which deliver
//!    asynchronously.
//!
//! A veto rewinds the source to the committed position and replays the epoch. Partitions run
//! concurrently and fail alone: a failed partition is reported, the others go on.
//!
//! Layout:
//! - `partition`: the epoch loop of one partition (`PartitionRunner`) and its [`PartitionReport`];
//! - `answers`: the sinks' answers to an epoch, gathered into one commit or a veto;
//! - `graph`: the partition's streams, read from the source and run through the processors;
//! - `replay`: the source reopened and the processors run again for a sink rebuilding a batch;
//! - `delivery_tracker`: what each sink acknowledged, told to the source's observer;
//! - `outbox_report`: what [`Pipeline::drain`] found pending and left;
//! - `sink_guard`: the sinks with undelivered batches kept in the spec, each of its class;
//! - `owned`: only the partitions a cluster grants this worker, started and handed over as
//!   ownership moves ([`Pipeline::run_owned`]);
//! - `lag`, `progress`: the per-partition source lag and the run's progress counters.

mod answers;
mod delivery_tracker;
mod graph;
mod lag;
mod outbox_report;
mod owned;
mod partition;
mod progress;
mod replay;
mod sink_guard;

use std::sync::Arc;

use flow_state::StateStore;
use tokio::sync::watch;
use tracing::{error, info, warn};

use crate::error::{RuntimeError, SpecError};
use crate::metrics::Metrics;
use crate::plugin::{SinkFactory, SourceFactory};
use crate::registry::Registry;
use crate::spec::{PipelineSpec, ValidatedPipeline};

pub use outbox_report::{DrainReport, OutboxBacklog, PendingOutbox};
pub use owned::{LeaseError, PartitionLeases};
pub use partition::PartitionReport;
pub use progress::Progress;

use lag::SourceLags;
use partition::PartitionRunner;
use progress::ProgressCounters;

/// What [`Pipeline::run`] did, per partition.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RunReport {
    /// One report per partition, in partition order.
    pub partitions: Vec<PartitionReport>,
}

impl RunReport {
    /// Source messages committed over every partition.
    pub fn messages(&self) -> u64 {
        self.partitions.iter().map(|p| p.messages).sum()
    }
}

/// Controls a running pipeline from outside (signal handlers, embedding programs).
#[derive(Clone)]
pub struct PipelineControl {
    shutdown: Arc<watch::Sender<bool>>,
    dynamic: Arc<Vec<(String, watch::Sender<serde_yaml::Value>)>>,
    running_spec: Arc<std::sync::Mutex<PipelineSpec>>,
    /// Each sink's factory, by sink name, to apply a reload at once (see `SinkFactory::reconfigure`).
    factories: Arc<Vec<(String, Arc<dyn SinkFactory>)>>,
    lags: SourceLags,
    progress: ProgressCounters,
    /// The source's factory, which knows what keeps a partition from reading.
    source: Arc<dyn SourceFactory>,
}

/// What a reload changed.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct ReloadOutcome {
    /// Sinks whose dynamic parameters were swapped.
    pub reconfigured: Vec<String>,
    /// The static part differs from the running spec; it takes effect only after a restart.
    pub static_changed: bool,
    /// The spec paths of the static values that differ (`sinks[0].parameters.table`).
    pub static_changes: Vec<String>,
}

/// The paths at which two spec values differ, in document order: a whole list or map when its
/// length or keys changed only at the level they changed.
fn differing_paths(
    running: &serde_yaml::Value,
    new: &serde_yaml::Value,
    path: &str,
    out: &mut Vec<String>,
) {
    use serde_yaml::Value;
    if running == new {
        return;
    }
    let join = |key: &str| {
        if path.is_empty() {
            key.to_owned()
        } else {
            format!("{path}.{key}")
        }
    };
    match (running, new) {
        (Value::Mapping(a), Value::Mapping(b)) => {
            let mut keys: Vec<&Value> = a.keys().collect();
            keys.extend(b.keys().filter(|k| !a.contains_key(*k)));
            for key in keys {
                let name = key
                    .as_str()
                    .map(str::to_owned)
                    .unwrap_or_else(|| format!("{key:?}"));
                match (a.get(key), b.get(key)) {
                    (Some(x), Some(y)) => differing_paths(x, y, &join(&name), out),
                    _ => out.push(join(&name)),
                }
            }
        }
        (Value::Sequence(a), Value::Sequence(b)) if a.len() == b.len() => {
            for (i, (x, y)) in a.iter().zip(b).enumerate() {
                differing_paths(x, y, &format!("{path}[{i}]"), out);
            }
        }
        _ => out.push(if path.is_empty() {
            "(the whole spec)".to_owned()
        } else {
            path.to_owned()
        }),
    }
}

impl PipelineControl {
    /// Asks every partition to stop after its current epoch.
    pub fn shutdown(&self) {
        // `send_replace`, not `send`: `send` drops the value when no receiver exists yet (before
        // `run`) or any more, which would lose the request.
        self.shutdown.send_replace(true);
    }

    /// How many messages the broker holds beyond what `partition` has read, as its last read
    /// reported; `None` for a source that does not report lag or before its first read.
    pub fn source_lag(&self, partition: u32) -> Option<u64> {
        self.lags.get(partition)
    }

    /// What keeps `partition`'s source from reading right now while it waits (a broker stream
    /// that disappeared, see [`SourceFactory::unavailable`]); `None` while nothing does.
    pub fn source_unavailable(&self, partition: u32) -> Option<String> {
        self.source.unavailable(partition)
    }

    /// Pulls of `partition`'s source dropped as silent since the start
    /// ([`SourceFactory::stalled_pulls`]).
    pub fn source_stalled_pulls(&self, partition: u32) -> u64 {
        self.source.stalled_pulls(partition)
    }

    /// What the partitions have committed since the pipeline started.
    pub fn progress(&self) -> Progress {
        self.progress.get()
    }

    /// Whether a shutdown was asked for.
    pub fn is_shutting_down(&self) -> bool {
        *self.shutdown.borrow()
    }

    /// Validates `spec` in full and swaps the dynamic parameters of every sink whose
    /// `dynamic_parameters` changed. Nothing is applied if the spec has a violation.
    pub fn reload(
        &self,
        registry: &Registry,
        spec: &PipelineSpec,
    ) -> Result<ReloadOutcome, SpecError> {
        registry.build(spec)?;
        let mut outcome = ReloadOutcome::default();
        let mut running = self
            .running_spec
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        outcome.static_changed = running.static_part() != spec.static_part();
        if outcome.static_changed {
            let as_value = |s: &PipelineSpec| {
                serde_yaml::to_value(s.static_part()).unwrap_or(serde_yaml::Value::Null)
            };
            differing_paths(
                &as_value(&running),
                &as_value(spec),
                "",
                &mut outcome.static_changes,
            );
        }
        for sink in &spec.sinks {
            let Some((_, sender)) = self.dynamic.iter().find(|(name, _)| name == &sink.name) else {
                continue;
            };
            // A sink whose class changed runs on with its old class until a restart; the new
            // dynamic parameters were validated for the new class and mean nothing to it.
            let same_class = running
                .sinks
                .iter()
                .any(|r| r.name == sink.name && r.sink_class_name == sink.sink_class_name);
            if !same_class {
                continue;
            }
            if *sender.borrow() != sink.dynamic_parameters {
                // Stored even with no receiver (before `run`): partitions created later read it.
                sender.send_replace(sink.dynamic_parameters.clone());
                self.reconfigure_factory(&sink.name, &sink.dynamic_parameters);
                outcome.reconfigured.push(sink.name.clone());
            }
        }
        if !outcome.static_changed {
            *running = spec.clone();
        } else {
            for (running_sink, sink) in running.sinks.iter_mut().zip(&spec.sinks) {
                if running_sink.name == sink.name
                    && running_sink.sink_class_name == sink.sink_class_name
                {
                    running_sink.dynamic_parameters = sink.dynamic_parameters.clone();
                }
            }
        }
        Ok(outcome)
    }

    /// Applies `dynamic` to the state `sink`'s factory shares with its partitions, at once.
    fn reconfigure_factory(&self, sink: &str, dynamic: &serde_yaml::Value) {
        let Some((_, factory)) = self.factories.iter().find(|(name, _)| name == sink) else {
            return;
        };
        if let Err(err) = factory.reconfigure(dynamic) {
            // The partitions still apply them at their next epoch, and fail there if they must.
            warn!(sink, error = %err, "the sink refused the reloaded dynamic parameters; its partitions try them again at their next epoch");
        }
    }
}

/// A validated pipeline bound to its state store, ready to run.
pub struct Pipeline {
    validated: Arc<ValidatedPipeline>,
    store: StateStore,
    control: PipelineControl,
    metrics: Arc<Metrics>,
    counters_loaded: std::sync::atomic::AtomicBool,
}

impl Pipeline {
    /// Binds a validated pipeline to its state store; nothing runs until [`Pipeline::run`] (or
    /// [`Pipeline::drain`]).
    pub fn new(validated: ValidatedPipeline, store: StateStore) -> Pipeline {
        let (shutdown, _) = watch::channel(false);
        let dynamic = validated
            .sinks
            .iter()
            .map(|s| {
                (
                    s.name.clone(),
                    watch::channel(s.dynamic_parameters.clone()).0,
                )
            })
            .collect();
        let control = PipelineControl {
            shutdown: Arc::new(shutdown),
            dynamic: Arc::new(dynamic),
            running_spec: Arc::new(std::sync::Mutex::new(validated.spec.clone())),
            factories: Arc::new(
                validated
                    .sinks
                    .iter()
                    .map(|s| (s.name.clone(), Arc::clone(&s.factory)))
                    .collect(),
            ),
            lags: SourceLags::new(validated.spec.partitions),
            progress: ProgressCounters::default(),
            source: Arc::clone(&validated.source),
        };
        Pipeline {
            validated: Arc::new(validated),
            store,
            control,
            metrics: Metrics::new(),
            counters_loaded: std::sync::atomic::AtomicBool::new(false),
        }
    }

    /// A handle to stop or reload the pipeline while it runs (take it before `run`).
    pub fn control(&self) -> PipelineControl {
        self.control.clone()
    }

    /// The pipeline's metrics (their counters start at the persisted totals once `run` starts).
    pub fn metrics(&self) -> Arc<Metrics> {
        Arc::clone(&self.metrics)
    }

    /// Starts the live counters at the totals the store holds (once; `run` does it if the
    /// embedding program did not). Call it before serving the metrics, so that a restarted worker
    /// never shows a counter below its total.
    pub async fn load_counters(&self) -> Result<(), RuntimeError> {
        if self
            .counters_loaded
            .swap(true, std::sync::atomic::Ordering::SeqCst)
        {
            return Ok(());
        }
        let store = self.store.clone();
        let stored = tokio::task::spawn_blocking(move || store.counters())
            .await
            .map_err(|source| RuntimeError::Join {
                partition: 0,
                source,
            })?
            .map_err(|source| RuntimeError::State {
                partition: 0,
                source,
            })?;
        self.metrics.load(&self.validated.name, &stored);
        Ok(())
    }

    /// Records this pipeline's name and partition count in the store, or refuses to start on a
    /// store of another pipeline or partition count (see [`StateStore::claim`]), or with a sink
    /// whose undelivered batches the spec would leave unsent ([`sink_guard`]).
    async fn claim_store(&self) -> Result<(), RuntimeError> {
        let store = self.store.clone();
        let name = self.validated.name.clone();
        let partitions = self.validated.partitions;
        tokio::task::spawn_blocking(move || store.claim(&name, partitions))
            .await
            .map_err(|source| RuntimeError::Join {
                partition: 0,
                source,
            })?
            .map_err(|err| match err {
                err @ flow_state::StateError::OtherPipeline { .. } => {
                    RuntimeError::OtherPipeline(err)
                }
                source => RuntimeError::OpenState {
                    dir: self.store.dir().to_path_buf(),
                    source,
                },
            })?;
        let store = self.store.clone();
        let pipeline = Arc::clone(&self.validated);
        tokio::task::spawn_blocking(move || sink_guard::check(&store, &pipeline))
            .await
            .map_err(|source| RuntimeError::Join {
                partition: 0,
                source,
            })?
    }

    fn runner(&self, partition: u32) -> PartitionRunner {
        self.runner_stopped_by(partition, self.control.shutdown.subscribe())
    }

    /// A runner that stops when `stop` turns true (in a cluster: the pipeline's shutdown or the
    /// partition assigned to another worker).
    fn runner_stopped_by(&self, partition: u32, stop: watch::Receiver<bool>) -> PartitionRunner {
        PartitionRunner {
            pipeline: Arc::clone(&self.validated),
            store: self.store.clone(),
            partition,
            lags: self.control.lags.clone(),
            progress: self.control.progress.clone(),
            metrics: Arc::clone(&self.metrics),
            shutdown: stop,
            dynamic: self
                .control
                .dynamic
                .iter()
                .map(|(_, sender)| sender.subscribe())
                .collect(),
            observed: None,
        }
    }

    /// Tells every partition's observer that the run failed before the partitions started.
    fn end_observers(&self, err: &RuntimeError) {
        for partition in 0..self.validated.partitions {
            if let Some(observer) = self.validated.source.observer(partition) {
                observer.ended(Err(err));
            }
        }
    }

    /// Runs every partition to its end. Fails if any partition failed, after the others ended.
    ///
    /// A partition ends when its source is exhausted and its sinks delivered everything
    /// ([`PartitionEnd::Drained`](crate::PartitionEnd::Drained)), or after a shutdown ([`PartitionEnd::Stopped`](crate::PartitionEnd::Stopped)). A store
    /// claimed by another pipeline or partition count fails with [`RuntimeError::OtherPipeline`].
    ///
    /// ```
    /// use flow_core::{PartitionEnd, Pipeline, PipelineSpec, Registry};
    /// use flow_state::StateStore;
    ///
    /// # #[tokio::main]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let dir = tempfile::tempdir()?;
    /// let out = dir.path().join("out.jsonl");
    /// let spec = PipelineSpec::from_yaml(&format!(
    ///     r#"
    /// pipeline: example
    /// partitions: 2
    /// source: {{class: generator, parameters: {{count: 100}}}}
    /// sinks:
    ///   - {{name: out, sink_class_name: DebugSink, input_stream_ids: [rows], parameters: {{path: "{}"}}}}
    /// "#,
    ///     out.display()
    /// ))?;
    /// let validated = Registry::with_builtins().build(&spec)?;
    /// let store = StateStore::open(&dir.path().join("state"))?;
    /// let report = Pipeline::new(validated, store.clone()).run().await?;
    /// store.close()?;
    ///
    /// assert!(report.partitions.iter().all(|p| p.end == PartitionEnd::Drained));
    /// assert_eq!(report.messages(), 200); // `count` messages per partition
    /// assert_eq!(std::fs::read_to_string(&out)?.lines().count(), 200);
    /// # Ok(())
    /// # }
    /// ```
    pub async fn run(self) -> Result<RunReport, RuntimeError> {
        let started = match self.claim_store().await {
            Ok(()) => self.load_counters().await,
            Err(err) => Err(err),
        };
        if let Err(err) = started {
            self.end_observers(&err);
            return Err(err);
        }
        let runners = (0..self.validated.partitions).map(|p| (p, self.runner(p)));
        let mut reports =
            join_partitions(&self.validated.name, &self.metrics, runners, |r| r.run()).await?;
        reports.sort_by_key(|r| r.partition);
        Ok(RunReport {
            partitions: reports,
        })
    }

    /// Runs the partitions `leases` grants this worker until a shutdown: a partition starts once
    /// its lease is held and stops (ending its epoch, delivering what it committed within the
    /// drain bound) when it is assigned elsewhere; its lease is given back after its runner
    /// ended. Fails, after the shutdown, if a partition failed while its lease was held.
    pub async fn run_owned(
        self,
        leases: Arc<dyn PartitionLeases>,
    ) -> Result<RunReport, RuntimeError> {
        self.claim_store().await?;
        self.load_counters().await?;
        let shutdown = self.control.shutdown.subscribe();
        let host = owned::Host {
            name: self.validated.name.clone(),
            partitions: self.validated.partitions,
            metrics: Arc::clone(&self.metrics),
            runner: Box::new(move |partition, stop| self.runner_stopped_by(partition, stop)),
        };
        let partitions = owned::run(host, shutdown, leases).await?;
        Ok(RunReport { partitions })
    }

    /// Delivers every batch pending in the outbox of this pipeline's sinks, then returns what
    /// was pending before and what still is (nothing, unless a stop interrupted it). No source
    /// is read. The sinks open as for `run`, so their guards (the topology guard of the
    /// exactly-once ClickHouse sinks) refuse a spec that no longer matches the pending batches.
    pub async fn drain(self) -> Result<DrainReport, RuntimeError> {
        self.claim_store().await?;
        let before = self.backlog().await?;
        if !before.is_empty() {
            info!(pipeline = %self.validated.name, batches = before.batches(), rows = before.rows(), "draining the outbox");
        }
        let mut partitions: Vec<u32> = before.entries.iter().map(|e| e.partition).collect();
        partitions.dedup();
        let runners = partitions.into_iter().map(|p| (p, self.runner(p)));
        let drains = runners.map(|(p, runner)| (p, (runner, before.sinks_of(p))));
        let drain = |(runner, sinks): (PartitionRunner, Vec<String>)| runner.drain_outbox(sinks);
        join_partitions(&self.validated.name, &self.metrics, drains, drain).await?;
        let after = self.backlog().await?;
        Ok(DrainReport { before, after })
    }

    async fn backlog(&self) -> Result<OutboxBacklog, RuntimeError> {
        let store = self.store.clone();
        let pipeline = Arc::clone(&self.validated);
        tokio::task::spawn_blocking(move || OutboxBacklog::read(&store, &pipeline))
            .await
            .map_err(|source| RuntimeError::Join {
                partition: 0,
                source,
            })?
    }
}

/// Runs `work` on every partition's input (its runner) concurrently; fails, after all ended, if
/// any failed. A failure is told to `metrics` at once, for `/ready`: the other partitions may
/// run on for long.
async fn join_partitions<I, T, F, Fut>(
    pipeline: &str,
    metrics: &Metrics,
    runners: impl Iterator<Item = (u32, I)>,
    work: F,
) -> Result<Vec<T>, RuntimeError>
where
    T: Send + 'static,
    F: Fn(I) -> Fut,
    Fut: std::future::Future<Output = Result<T, RuntimeError>> + Send + 'static,
{
    let mut tasks = tokio::task::JoinSet::new();
    // A panicking task returns no value, only its id.
    let mut partition_of_task = std::collections::HashMap::new();
    for (partition, runner) in runners {
        let future = work(runner);
        let handle = tasks.spawn(async move { (partition, future.await) });
        partition_of_task.insert(handle.id(), partition);
    }
    let mut done = Vec::new();
    let mut failures = Vec::new();
    while let Some(joined) = tasks.join_next().await {
        match joined {
            Ok((_, Ok(value))) => done.push(value),
            Ok((partition, Err(err))) => {
                error!(pipeline = %pipeline, partition, error = %err, "partition failed");
                metrics.partition_failed(pipeline, partition, err.to_string());
                failures.push(err);
            }
            Err(err) => {
                let partition = partition_of_task
                    .get(&err.id())
                    .copied()
                    .unwrap_or(u32::MAX);
                error!(pipeline = %pipeline, partition, error = %err, "partition task panicked");
                metrics.partition_failed(pipeline, partition, format!("its task panicked: {err}"));
                failures.push(RuntimeError::Join {
                    partition,
                    source: err,
                });
            }
        }
    }
    if !failures.is_empty() {
        return Err(RuntimeError::PartitionsFailed(failures));
    }
    Ok(done)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_static_change_is_named_by_its_spec_path() {
        let spec = |table: &str, partitions: u32| {
            let text = format!(
                "pipeline: p\npartitions: {partitions}\nsource: {{class: generator, parameters: {{count: 1}}}}\nsinks:\n  - {{name: s, sink_class_name: DebugSink, input_stream_ids: [rows], parameters: {{path: {table}, extra: [1, 2]}}}}\n"
            );
            serde_yaml::to_value(PipelineSpec::from_yaml(&text).unwrap_or_else(|e| panic!("{e}")))
                .unwrap_or(serde_yaml::Value::Null)
        };
        let mut changes = Vec::new();
        differing_paths(&spec("a", 1), &spec("b", 2), "", &mut changes);
        assert_eq!(changes, vec!["partitions", "sinks[0].parameters.path"]);
    }
}
