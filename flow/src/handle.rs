//! [`PipelineHandle`]: a pipeline running in-process on the program's tokio runtime, with the
//! controls the worker binary has (graceful stop, reload of dynamic parameters, status, metrics).
//!
//! One task runs the pipeline to its end, then closes the state store; next to it a refresher
//! reads the status every 2 s, which keeps the backlog and lag gauges of the metrics current and
//! writes the status snapshot `flow-worker status` shows while the store is locked (as the worker
//! does). The handle awaits that task in `wait` and `stop`.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use flow_core::{
    Metrics, Pipeline, PipelineControl, PipelineSpec, Progress, Registry, ReloadOutcome, RunReport,
    SpecError,
};
use flow_state::{StateStore, StateSummary};
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tracing::{info, warn};

use crate::error::HandleError;
use crate::live_status::{read_state_dir, snapshot_path, LiveStatus};
use crate::metrics_endpoint::MetricsEndpoint;
use crate::metrics_snapshot::{MetricsParseError, MetricsSnapshot};
use crate::store_lifecycle::{close_state_store, open_state_store, warn_if_no_earlier_state};

/// How often a running pipeline refreshes its status snapshot and the gauges of its metrics.
const REFRESH_INTERVAL: Duration = Duration::from_secs(2);

/// How to start a pipeline: where its state lives, which plugin classes it may use, and whether
/// it serves Prometheus metrics.
#[derive(Clone, Default)]
pub struct StartOptions {
    state_dir: Option<PathBuf>,
    registry: Option<Registry>,
    metrics_listen: Option<SocketAddr>,
}

impl StartOptions {
    /// Options with the state directory `state_dir` (it wins over the spec's `state_dir`; a
    /// relative one is relative to the process's working directory at
    /// [`PipelineHandle::start`], like a relative `state_dir` of a spec parsed from text or built
    /// in code; [`PipelineSpec::from_file`] resolves the spec's against the spec file's
    /// directory), the
    /// built-in plugins of [`crate::registry`] and no metrics endpoint beyond the spec's.
    pub fn new(state_dir: impl Into<PathBuf>) -> StartOptions {
        StartOptions::default().state_dir(state_dir)
    }

    /// The state directory; without one the spec's `state_dir` is used.
    pub fn state_dir(mut self, state_dir: impl Into<PathBuf>) -> StartOptions {
        self.state_dir = Some(state_dir.into());
        self
    }

    /// The registry the spec is built with (default [`crate::registry`]); register a program's
    /// own classes on `crate::registry()` and pass it here.
    pub fn registry(mut self, registry: Registry) -> StartOptions {
        self.registry = Some(registry);
        self
    }

    /// Serve `/metrics` on `addr` (port 0: one the system chooses, see
    /// [`PipelineHandle::metrics_addr`]); it wins over the spec's `metrics.listen`.
    pub fn metrics_listen(mut self, addr: SocketAddr) -> StartOptions {
        self.metrics_listen = Some(addr);
        self
    }
}

/// A pipeline running on the current tokio runtime.
///
/// Dropping the handle of a pipeline that still runs asks it to stop (as [`stop`](Self::stop)
/// does, without waiting): it ends in the background, as long as the runtime lives.
pub struct PipelineHandle {
    name: String,
    state_dir: PathBuf,
    registry: Registry,
    control: PipelineControl,
    metrics: Arc<Metrics>,
    /// The run's task and its status reader, until the run's report is taken: the reader holds
    /// the store, whose directory stays locked until every handle to it is gone.
    run: Option<Running>,
    endpoint: Option<MetricsEndpoint>,
}

/// A run whose report was not taken yet.
struct Running {
    task: JoinHandle<Result<RunReport, HandleError>>,
    status: LiveStatus,
}

impl PipelineHandle {
    /// Validates `spec` with the options' registry (every violation with its path, as
    /// [`HandleError::Spec`]), opens the state store off the runtime threads, starts the metrics
    /// endpoint if one is asked for, and spawns the run on the current tokio runtime. Returns as
    /// soon as the run is spawned; errors of the run itself (such as a state directory of another
    /// pipeline) come from [`wait`](Self::wait) or [`stop`](Self::stop).
    pub async fn start(
        spec: PipelineSpec,
        options: StartOptions,
    ) -> Result<PipelineHandle, HandleError> {
        let registry = options.registry.unwrap_or_else(crate::registry);
        let validated = registry.build(&spec)?;
        let state_dir = options
            .state_dir
            .or_else(|| validated.state_dir.clone())
            .filter(|dir| !dir.as_os_str().is_empty())
            .ok_or(HandleError::NoStateDir)?;
        // A relative directory is relative to the working directory now (the spec's, when it was
        // read with `PipelineSpec::from_file`, is already absolute against the spec file's
        // directory); made absolute once, so that the log names it and a later change of the
        // process's working directory cannot move it.
        let state_dir = std::path::absolute(&state_dir).unwrap_or(state_dir);
        let metrics_listen = options
            .metrics_listen
            .or(validated.metrics.map(|m| m.listen));
        let name = validated.name.clone();
        let store = open_state_store(&state_dir).await?;
        if let Err(err) = warn_if_no_earlier_state(&store, &name, validated.partitions) {
            // The run reads the same positions and stops with the same error.
            warn!(pipeline = %name, state_dir = %state_dir.display(), error = %err, "cannot read the committed positions");
        }
        let pipeline = Pipeline::new(validated, store.clone());
        let control = pipeline.control();
        let metrics = pipeline.metrics();
        let endpoint = match serve_metrics(&pipeline, metrics_listen).await {
            Ok(endpoint) => endpoint,
            Err(err) => {
                // The run never started: nothing but the open store to give back.
                if let Err(closed) = close_state_store(store).await {
                    warn!(error = %closed, "closing the state store after a failed start");
                }
                return Err(err);
            }
        };
        let status = LiveStatus::new(&name, store.clone(), control.clone(), Arc::clone(&metrics));
        let run = tokio::spawn(run_to_end(
            pipeline,
            store,
            status.clone(),
            state_dir.clone(),
        ));
        info!(pipeline = %name, state_dir = %state_dir.display(), "pipeline started");
        Ok(PipelineHandle {
            name,
            state_dir,
            registry,
            control,
            metrics,
            run: Some(Running { task: run, status }),
            endpoint,
        })
    }

    /// Waits for the run to end (a finite source drained and delivered, or a stop) and returns
    /// its report once the state store is closed.
    pub async fn wait(&mut self) -> Result<RunReport, HandleError> {
        let run = self.run.as_mut().ok_or(HandleError::AlreadyEnded)?;
        let joined = (&mut run.task).await;
        self.run = None;
        joined.map_err(HandleError::Task)?
    }

    /// Stops gracefully, as SIGTERM stops the worker: every partition stops after its current
    /// epoch and the sinks deliver what is pending for up to the spec's
    /// `shutdown.drain_timeout_ms`, leaving the rest in the outbox for the next run. Returns the
    /// report (partitions that were still running end [`Stopped`](crate::PartitionEnd::Stopped))
    /// once the store is closed, or [`HandleError::StopTimeout`] if that took longer than
    /// `timeout` (choose it above the drain timeout); the pipeline then goes on stopping and
    /// [`wait`](Self::wait) returns its report.
    pub async fn stop(&mut self, timeout: Duration) -> Result<RunReport, HandleError> {
        self.control.shutdown();
        let run = self.run.as_mut().ok_or(HandleError::AlreadyEnded)?;
        let joined = tokio::time::timeout(timeout, &mut run.task)
            .await
            .map_err(|_| HandleError::StopTimeout(timeout))?;
        self.run = None;
        joined.map_err(HandleError::Task)?
    }

    /// Validates `spec` in full with the handle's registry and applies the changed
    /// `dynamic_parameters` of its sinks at once; a changed static part is reported
    /// ([`ReloadOutcome::static_changes`]) and takes effect only at the next start. Nothing is
    /// applied if the spec has a violation.
    pub fn reload(&self, spec: &PipelineSpec) -> Result<ReloadOutcome, SpecError> {
        self.control.reload(&self.registry, spec)
    }

    /// What `flow-worker status --json` shows for this state directory: until the run's report
    /// is taken, the store's summary with the source lag per partition and what each sink saw
    /// since the start (the handle keeps the store readable after the run closed it); after
    /// that, the summary of the store, opened again for the read.
    pub async fn status(&self) -> Result<StateSummary, HandleError> {
        match &self.run {
            Some(run) => Ok(run.status.summary().await?),
            None => Ok(read_state_dir(&self.state_dir).await?),
        }
    }

    /// The pipeline's metrics, for encoding or serving them yourself
    /// ([`Metrics::encode`] is the text `/metrics` answers).
    pub fn metrics(&self) -> Arc<Metrics> {
        Arc::clone(&self.metrics)
    }

    /// The values `/metrics` shows now, as Rust values. The `_total` counters include every
    /// earlier run of this state directory; the backlog and lag gauges are as of the last status
    /// read (every 2 s, and every [`status`](Self::status)).
    pub fn counters(&self) -> Result<MetricsSnapshot, MetricsParseError> {
        MetricsSnapshot::of(&self.metrics)
    }

    /// What the partitions committed since this start (messages, rows sealed).
    pub fn progress(&self) -> Progress {
        self.control.progress()
    }

    /// The pipeline's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The state directory.
    pub fn state_dir(&self) -> &Path {
        &self.state_dir
    }

    /// Where `/metrics` is served, if it is.
    pub fn metrics_addr(&self) -> Option<SocketAddr> {
        self.endpoint.as_ref().map(MetricsEndpoint::local_addr)
    }

    /// Whether the run has ended (its report may not have been taken yet).
    pub fn is_finished(&self) -> bool {
        self.run.as_ref().is_none_or(|run| run.task.is_finished())
    }
}

impl Drop for PipelineHandle {
    fn drop(&mut self) {
        if !self.is_finished() {
            info!(pipeline = %self.name, "pipeline handle dropped: stopping the pipeline");
            self.control.shutdown();
        }
    }
}

/// The endpoint at `listen`, after loading the persisted totals so that it never shows a counter
/// below them.
async fn serve_metrics(
    pipeline: &Pipeline,
    listen: Option<SocketAddr>,
) -> Result<Option<MetricsEndpoint>, HandleError> {
    let Some(addr) = listen else {
        return Ok(None);
    };
    pipeline.load_counters().await.map_err(HandleError::Run)?;
    Ok(Some(
        MetricsEndpoint::serve(addr, pipeline.metrics()).await?,
    ))
}

/// Runs the pipeline with the status refresher beside it, then removes the status snapshot and
/// closes the store. A failed run is reported before a failed close, which is logged.
async fn run_to_end(
    pipeline: Pipeline,
    store: StateStore,
    status: LiveStatus,
    state_dir: PathBuf,
) -> Result<RunReport, HandleError> {
    let (stop_refresh, stopped) = watch::channel(false);
    let refresher = tokio::spawn(refresh(status, stopped));
    let result = pipeline.run().await;
    // Awaited, not aborted: a snapshot being written must land before it is removed.
    stop_refresh.send_replace(true);
    let _ = refresher.await;
    let _ = tokio::fs::remove_file(snapshot_path(&state_dir)).await;
    let closed = close_state_store(store).await.map_err(HandleError::from);
    match result {
        Ok(report) => {
            info!(messages = report.messages(), "pipeline finished");
            closed.map(|()| report)
        }
        Err(err) => {
            if let Err(closed) = closed {
                warn!(error = %closed, "closing the state store after a failed run");
            }
            Err(HandleError::Run(err))
        }
    }
}

/// Reads the status every [`REFRESH_INTERVAL`] (which sets the gauges of the metrics) and writes
/// it as the snapshot `flow-worker status` shows, until `stop` turns true.
async fn refresh(status: LiveStatus, mut stop: watch::Receiver<bool>) {
    let mut warned = false;
    loop {
        let written = match status.summary().await {
            Ok(summary) => status.write_snapshot(&summary).await,
            Err(err) => Err(err),
        };
        if let (Err(error), false) = (written, warned) {
            warn!(error = %error, "cannot refresh the status snapshot; `flow-worker status` will not show this pipeline's progress while it runs");
            warned = true;
        }
        tokio::select! {
            _ = tokio::time::sleep(REFRESH_INTERVAL) => {}
            _ = stop.wait_for(|stop| *stop) => return,
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use std::collections::BTreeMap;

    use super::*;
    use flow_core::PartitionEnd;

    /// A generator of `count` messages per partition (0: endless) at `rate` per second and
    /// partition (0: unlimited) into a `DebugSink` writing `out`.
    fn spec(count: u64, rate: u64, out: &Path, max_rows_per_batch: u64) -> PipelineSpec {
        PipelineSpec::from_yaml(&format!(
            r#"
pipeline: handle-test
partitions: 2
epoch: {{max_messages: 200, max_duration_ms: 50}}
shutdown: {{drain_timeout_ms: 5000}}
source: {{class: generator, parameters: {{count: {count}, rate_per_second: {rate}}}}}
sinks:
  - name: debug
    sink_class_name: DebugSink
    input_stream_ids: [rows]
    parameters: {{path: "{}"}}
    dynamic_parameters: {{max_rows_per_batch: {max_rows_per_batch}}}
"#,
            out.display()
        ))
        .unwrap()
    }

    /// The offsets in the DebugSink file, per partition, in file order.
    fn offsets(out: &Path) -> BTreeMap<u32, Vec<u64>> {
        let mut offsets: BTreeMap<u32, Vec<u64>> = BTreeMap::new();
        for line in std::fs::read_to_string(out).unwrap().lines() {
            let line: serde_json::Value = serde_json::from_str(line).unwrap();
            let id = line["message_id"].as_str().unwrap();
            let (partition, offset) = id.split_once('-').unwrap();
            offsets
                .entry(partition.parse().unwrap())
                .or_default()
                .push(offset.parse().unwrap());
        }
        offsets
    }

    /// Waits (up to 30 s, for a loaded machine) until both partitions committed an epoch.
    async fn until_both_partitions_committed(handle: &PipelineHandle) {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
        loop {
            let status = handle.status().await.unwrap();
            let committed = status
                .pipelines
                .get("handle-test")
                .map_or(0, |p| p.positions.len());
            if committed == 2 {
                return;
            }
            assert!(tokio::time::Instant::now() < deadline, "{status:?}");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn start_then_wait_reports_every_message_of_a_finite_generator() {
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("out.jsonl");
        let options = StartOptions::new(dir.path().join("state"));
        let mut handle = PipelineHandle::start(spec(1250, 0, &out, 10_000), options)
            .await
            .unwrap();
        let report = handle.wait().await.unwrap();
        assert_eq!(report.messages(), 2500);
        assert!(report
            .partitions
            .iter()
            .all(|p| p.end == PartitionEnd::Drained));
        let offsets = offsets(&out);
        assert_eq!(offsets[&0], (0..1250).collect::<Vec<u64>>());
        assert_eq!(offsets[&1], (0..1250).collect::<Vec<u64>>());
        assert_eq!(handle.progress().messages, 2500);
        let counters = handle.counters().unwrap();
        assert_eq!(counters.source_messages(), 2500);
        assert_eq!(counters.rows_delivered("debug"), 2500);
        assert!(matches!(
            handle.wait().await,
            Err(HandleError::AlreadyEnded)
        ));
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn stop_ends_partitions_stopped_and_a_restart_continues_without_gap_or_duplicate() {
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("out.jsonl");
        let state = dir.path().join("state");
        let mut total = 0;
        for _ in 0..2 {
            let options = StartOptions::new(&state);
            let mut handle = PipelineHandle::start(spec(0, 5000, &out, 100), options)
                .await
                .unwrap();
            until_both_partitions_committed(&handle).await;
            tokio::time::sleep(Duration::from_millis(200)).await;
            let report = handle.stop(Duration::from_secs(20)).await.unwrap();
            assert_eq!(report.partitions.len(), 2);
            assert!(
                report
                    .partitions
                    .iter()
                    .all(|p| p.end == PartitionEnd::Stopped),
                "{report:?}"
            );
            assert!(report.messages() > 0, "{report:?}");
            total += report.messages();
        }
        let offsets = offsets(&out);
        let delivered: usize = offsets.values().map(Vec::len).sum();
        assert_eq!(
            delivered as u64, total,
            "the drain delivered every committed message"
        );
        for (partition, offsets) in &offsets {
            let expected: Vec<u64> = (0..offsets.len() as u64).collect();
            assert_eq!(offsets, &expected, "partition {partition}");
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_stop_that_times_out_leaves_the_pipeline_stopping_and_wait_returns_its_report() {
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("out.jsonl");
        let options = StartOptions::new(dir.path().join("state"));
        let mut handle = PipelineHandle::start(spec(0, 1000, &out, 100), options)
            .await
            .unwrap();
        until_both_partitions_committed(&handle).await;
        let timed_out = handle.stop(Duration::ZERO).await.err();
        assert_eq!(
            timed_out.map(|e| e.to_string()).as_deref(),
            Some("the pipeline did not stop within 0ns; it is still stopping (call wait() for its report)")
        );
        let report = handle.wait().await.unwrap();
        assert!(
            report
                .partitions
                .iter()
                .all(|p| p.end == PartitionEnd::Stopped),
            "{report:?}"
        );
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn reload_applies_a_dynamic_change_and_reports_a_static_one_as_needing_a_restart() {
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("out.jsonl");
        let options = StartOptions::new(dir.path().join("state"));
        let mut handle = PipelineHandle::start(spec(0, 1000, &out, 100), options)
            .await
            .unwrap();
        let dynamic = handle.reload(&spec(0, 1000, &out, 50)).unwrap();
        assert_eq!(
            dynamic,
            ReloadOutcome {
                reconfigured: vec!["debug".to_owned()],
                static_changed: false,
                static_changes: vec![],
            }
        );
        let other = dir.path().join("other.jsonl");
        let changed = handle.reload(&spec(0, 1000, &other, 50)).unwrap();
        assert_eq!(
            changed,
            ReloadOutcome {
                reconfigured: vec![],
                static_changed: true,
                static_changes: vec!["sinks[0].parameters.path".to_owned()],
            }
        );
        let invalid = handle.reload(&spec(0, 1000, &out, 0)).unwrap_err();
        assert_eq!(
            invalid.violations[0].path,
            "sinks[0].dynamic_parameters.max_rows_per_batch"
        );
        handle.stop(Duration::from_secs(20)).await.unwrap();
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn status_shows_committed_positions_while_running_and_nothing_pending_after_a_drain() {
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("out.jsonl");
        let options = StartOptions::new(dir.path().join("state"));
        let mut handle = PipelineHandle::start(spec(0, 2000, &out, 100), options)
            .await
            .unwrap();
        until_both_partitions_committed(&handle).await;
        let running = handle.status().await.unwrap();
        let pipeline = &running.pipelines["handle-test"];
        assert_eq!(pipeline.positions.len(), 2);
        assert!(
            pipeline.sinks.iter().all(|s| s.run.is_some()),
            "{pipeline:?}"
        );
        handle.stop(Duration::from_secs(20)).await.unwrap();

        let options = StartOptions::new(dir.path().join("state"));
        let mut handle = PipelineHandle::start(spec(700, 0, &out, 100), options)
            .await
            .unwrap();
        while !handle.is_finished() {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let ended = handle.status().await.unwrap();
        handle.wait().await.unwrap();
        let drained = handle.status().await.unwrap();
        let run_of = |summary: &StateSummary| {
            let mut pipeline = summary.pipelines["handle-test"].clone();
            pipeline.sinks.iter_mut().for_each(|s| s.run = None);
            pipeline
        };
        assert_eq!(
            run_of(&ended),
            run_of(&drained),
            "live and stored status agree"
        );
        let pipeline = &drained.pipelines["handle-test"];
        let positions: Vec<(u32, String)> = pipeline
            .positions
            .iter()
            .map(|(p, position)| (*p, position.hex.clone()))
            .collect();
        let next = format!("{:016x}", 700);
        assert_eq!(positions, vec![(0, next.clone()), (1, next)]);
        assert_eq!(pipeline.sinks.len(), 2);
        assert!(
            pipeline
                .sinks
                .iter()
                .all(|s| s.undelivered == 0 && s.rows == 0),
            "{pipeline:?}"
        );
        assert!(!snapshot_path(&dir.path().join("state")).exists());
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn start_refuses_an_invalid_spec_with_every_violation_and_its_path() {
        let dir = tempfile::tempdir().unwrap();
        let spec = PipelineSpec::from_yaml(
            r#"
pipeline: p
source: {class: generator, parameters: {count: 1}}
sinks:
  - {name: a, sink_class_name: NoSuchSink, input_stream_ids: [rows]}
  - {name: b, sink_class_name: DebugSink, input_stream_ids: [nothing], parameters: {path: x}}
"#,
        )
        .unwrap();
        let err = PipelineHandle::start(spec, StartOptions::new(dir.path()))
            .await
            .err();
        let Some(HandleError::Spec(err)) = err else {
            panic!("{err:?}");
        };
        let paths: Vec<&str> = err.violations.iter().map(|v| v.path.as_str()).collect();
        assert_eq!(
            paths,
            ["sinks[0].sink_class_name", "sinks[1].input_stream_ids[0]"]
        );
        assert!(!dir.path().join("db").exists(), "nothing was opened");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_metrics_endpoint_serves_what_counters_shows() {
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("out.jsonl");
        let options = StartOptions::new(dir.path().join("state"))
            .metrics_listen(SocketAddr::from(([127, 0, 0, 1], 0)));
        let mut handle = PipelineHandle::start(spec(0, 1000, &out, 100), options)
            .await
            .unwrap();
        let addr = handle.metrics_addr().unwrap();
        until_both_partitions_committed(&handle).await;
        handle.stop(Duration::from_secs(20)).await.unwrap();
        let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        stream
            .write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            .await
            .unwrap();
        let mut answer = String::new();
        stream.read_to_string(&mut answer).await.unwrap();
        let body = answer.split_once("\r\n\r\n").unwrap().1;
        let scraped = MetricsSnapshot::parse(body).unwrap();
        let counters = handle.counters().unwrap();
        assert!(counters.source_messages() > 0);
        assert_eq!(scraped.source_messages(), counters.source_messages());
    }
}
