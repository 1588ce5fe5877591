//! End-to-end tests of the partition runner: builtin plugins from YAML specs, a real state store
//! in a temp dir and the `DebugSink` writing to a temp file. Custom sink classes registered here
//! simulate crashes, vetoes and failures.

// Tests may unwrap; clippy's `allow-*-in-tests` does not cover helper functions.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use flow_core::registry::{BuildResult, SinkBuildContext};
use flow_core::sources::generator::fill_payload;
use flow_core::testing::TS_BASE;
use flow_core::ReloadOutcome;
use flow_core::{
    Epoch, EpochOutcome, EpochWrite, PartitionEnd, PendingWrite, Pipeline, PipelineSpec, Registry,
    RunReport, RuntimeError, Sink, SinkContext, SinkError, SinkFactory, SourceError, Violation,
};
use flow_state::{SealedBatch, SinkPartition, StateStore, SOURCE_OWNER};
use tokio::sync::Notify;

const PIPELINE: &str = "rt";

/// A generator pipeline into one sink `out` of class `class` writing to `out_path`.
fn generator_yaml(
    partitions: u32,
    count: u64,
    max_messages: u64,
    class: &str,
    out_path: &Path,
) -> String {
    format!(
        r#"
pipeline: {PIPELINE}
partitions: {partitions}
epoch: {{max_messages: {max_messages}, max_duration_ms: 60000}}
source:
  class: generator
  parameters: {{count: {count}}}
sinks:
  - name: out
    sink_class_name: {class}
    input_stream_ids: [rows]
    parameters: {{path: "{}"}}
"#,
        out_path.display()
    )
}

/// Opens the store, waiting a little if a store on `dir` closed a moment ago: sled 0.34 may still
/// hold its file lock from a background write of the previous handle (its own test builds block
/// on the lock for this reason). A new process, as in production, never meets this.
fn open_store(dir: &Path) -> StateStore {
    let started = std::time::Instant::now();
    loop {
        match StateStore::open(dir) {
            Ok(store) => return store,
            Err(err)
                if matches!(err, flow_state::StateError::Locked { .. })
                    && started.elapsed() < Duration::from_secs(5) =>
            {
                std::thread::sleep(Duration::from_millis(20));
            }
            Err(err) => panic!("open state store `{}`: {err:?}", dir.display()),
        }
    }
}

async fn run_yaml(
    registry: &Registry,
    yaml: &str,
    store: &StateStore,
) -> Result<RunReport, RuntimeError> {
    let spec = PipelineSpec::from_yaml(yaml).expect("spec parses");
    let validated = registry.build(&spec).expect("spec validates");
    Pipeline::new(validated, store.clone()).run().await
}

fn read_lines(path: &Path) -> Vec<String> {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    text.lines().map(str::to_owned).collect()
}

/// Parses every line as a DebugSink record and returns the generator ids, sorted.
fn sorted_ids(lines: &[String]) -> Vec<u64> {
    let mut ids: Vec<u64> = lines
        .iter()
        .map(|line| {
            let json: serde_json::Value =
                serde_json::from_str(line).unwrap_or_else(|e| panic!("{line:?}: {e}"));
            json["row"]["id"].as_u64().expect("row.id is a u64")
        })
        .collect();
    ids.sort_unstable();
    ids
}

fn assert_each_id_once(path: &Path, total: u64) {
    let lines = read_lines(path);
    assert_eq!(
        lines.len() as u64,
        total,
        "line count of {}",
        path.display()
    );
    assert_eq!(sorted_ids(&lines), (0..total).collect::<Vec<_>>());
}

fn position(store: &StateStore, partition: u32) -> Option<u64> {
    store
        .position(PIPELINE, partition)
        .expect("read position")
        .map(|bytes| u64::from_be_bytes(bytes.as_slice().try_into().expect("8-byte position")))
}

fn undelivered_rows(store: &StateStore, sink: &str, partition: u32) -> Vec<(u64, u64)> {
    store
        .undelivered(&SinkPartition::new(PIPELINE, sink, partition))
        .expect("read outbox")
        .into_iter()
        .map(|b| (b.batch.first_offset, b.batch.last_offset))
        .collect()
}

// ---------------------------------------------------------------------------------------------
// Test sink classes.

type WrapFn = dyn Fn(Box<dyn Sink>, &SinkContext) -> Box<dyn Sink> + Send + Sync;

/// Registers `class`: a `DebugSink` whose per-partition instances are wrapped by `wrap`.
fn register_wrapped_debug_sink(registry: &mut Registry, class: &str, wrap: Arc<WrapFn>) {
    let inner = registry
        .sink("DebugSink")
        .cloned()
        .expect("DebugSink is a builtin");
    registry.register_sink(
        class,
        Arc::new(
            move |ctx: &SinkBuildContext<'_>,
                  parameters: &serde_yaml::Value,
                  dynamic: &serde_yaml::Value|
                  -> BuildResult<Arc<dyn SinkFactory>> {
                let factory = inner(ctx, parameters, dynamic)?;
                Ok(Arc::new(WrappedFactory {
                    inner: factory,
                    wrap: Arc::clone(&wrap),
                }))
            },
        ),
    );
}

struct WrappedFactory {
    inner: Arc<dyn SinkFactory>,
    wrap: Arc<WrapFn>,
}

impl SinkFactory for WrappedFactory {
    fn create(&self, ctx: SinkContext) -> Result<Box<dyn Sink>, SinkError> {
        let sink = self.inner.create(ctx.clone())?;
        Ok((self.wrap)(sink, &ctx))
    }
}

/// The builtins and `CrashingDebugSink` as a plain `DebugSink`: the class of a run that lost
/// deliveries, in the run after it.
fn delivering_registry() -> Registry {
    let mut registry = Registry::with_builtins();
    register_wrapped_debug_sink(
        &mut registry,
        "CrashingDebugSink",
        Arc::new(|inner, _| inner),
    );
    registry
}

/// Forwards everything, except that after `deliver_epochs` committed epochs it stops handing
/// committed batches to the inner sink: they are durable in the outbox but never delivered, as if
/// the process died right after the commit.
struct LosesDeliveries {
    inner: Box<dyn Sink>,
    deliver_epochs: u64,
    committed: u64,
}

#[async_trait]
impl Sink for LosesDeliveries {
    async fn write_epoch(&mut self, epoch: &Epoch<'_>) -> Result<EpochOutcome, SinkError> {
        self.inner.write_epoch(epoch).await
    }
    async fn open(&mut self) -> Result<(), SinkError> {
        self.inner.open().await
    }
    async fn committed(&mut self, batches: Vec<(u64, SealedBatch)>) -> Result<(), SinkError> {
        self.committed += 1;
        if self.committed <= self.deliver_epochs {
            self.inner.committed(batches).await
        } else {
            Ok(())
        }
    }
    async fn drain(&mut self) -> Result<(), SinkError> {
        self.inner.drain().await
    }
    async fn close(&mut self) -> Result<(), SinkError> {
        self.inner.close().await
    }
}

/// Seals through the inner sink, then vetoes the first `vetoes` epochs of each partition, so the
/// sealed batches of those epochs must be discarded.
struct Vetoes {
    inner: Box<dyn Sink>,
    vetoes: u64,
}

#[async_trait]
impl Sink for Vetoes {
    async fn write_epoch(&mut self, epoch: &Epoch<'_>) -> Result<EpochOutcome, SinkError> {
        let outcome = self.inner.write_epoch(epoch).await?;
        if epoch.number < self.vetoes {
            return Ok(EpochOutcome::Veto {
                reason: format!("target busy (epoch {})", epoch.number),
                retry_after: Duration::from_millis(1),
            });
        }
        Ok(outcome)
    }
    async fn open(&mut self) -> Result<(), SinkError> {
        self.inner.open().await
    }
    async fn committed(&mut self, batches: Vec<(u64, SealedBatch)>) -> Result<(), SinkError> {
        self.inner.committed(batches).await
    }
    async fn drain(&mut self) -> Result<(), SinkError> {
        self.inner.drain().await
    }
    async fn close(&mut self) -> Result<(), SinkError> {
        self.inner.close().await
    }
}

/// A sink class `FailsInPartition` that commits nothing and fails in partition
/// `parameters.partition` at epoch `parameters.at_epoch`.
fn register_failing_sink(registry: &mut Registry) {
    #[derive(serde::Deserialize)]
    struct Params {
        partition: u32,
        at_epoch: u64,
    }
    struct Factory {
        partition: u32,
        at_epoch: u64,
    }
    struct Failing {
        fail: bool,
        at_epoch: u64,
    }
    impl SinkFactory for Factory {
        fn create(&self, ctx: SinkContext) -> Result<Box<dyn Sink>, SinkError> {
            Ok(Box::new(Failing {
                fail: ctx.partition == self.partition,
                at_epoch: self.at_epoch,
            }))
        }
    }
    #[async_trait]
    impl Sink for Failing {
        async fn write_epoch(&mut self, epoch: &Epoch<'_>) -> Result<EpochOutcome, SinkError> {
            if self.fail && epoch.number == self.at_epoch {
                return Err(SinkError::Refused("the target rejected the epoch".into()));
            }
            Ok(EpochOutcome::Commit(EpochWrite::default()))
        }
    }
    registry.register_sink(
        "FailsInPartition",
        Arc::new(
            |_ctx: &SinkBuildContext<'_>,
             parameters: &serde_yaml::Value,
             _dynamic: &serde_yaml::Value|
             -> BuildResult<Arc<dyn SinkFactory>> {
                let params: Params =
                    flow_core::registry::parse_parameters(parameters, "parameters")?;
                Ok(Arc::new(Factory {
                    partition: params.partition,
                    at_epoch: params.at_epoch,
                }))
            },
        ),
    );
}

// ---------------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn generator_3x1000_into_debug_sink_writes_each_message_once_with_contract_values() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("out.jsonl");
    let store = open_store(&tmp.path().join("state"));
    let registry = Registry::with_builtins();

    let report = run_yaml(
        &registry,
        &generator_yaml(3, 1000, 256, "DebugSink", &out),
        &store,
    )
    .await
    .unwrap();

    assert_eq!(report.messages(), 3000);
    assert_eq!(report.partitions.len(), 3);
    for (p, part) in report.partitions.iter().enumerate() {
        assert_eq!(part.partition, p as u32);
        assert_eq!(part.end, PartitionEnd::Drained);
        assert_eq!(part.messages, 1000);
        // 1000 messages in epochs of at most 256: 4 epochs.
        assert_eq!(part.epochs_committed, 4);
        assert_eq!(part.dead_letters, 0);
        assert_eq!(part.vetoes, 0);
    }

    let lines = read_lines(&out);
    assert_eq!(lines.len(), 3000);
    let mut seen = vec![false; 3000];
    let mut payload = Vec::new();
    for line in &lines {
        let json: serde_json::Value = serde_json::from_str(line).unwrap();
        let object = json.as_object().unwrap();
        assert_eq!(
            object.keys().collect::<Vec<_>>(),
            vec!["message_id", "row", "stream"],
            "{line}"
        );
        assert_eq!(json["stream"], "rows");
        let row = &json["row"];
        assert_eq!(row.as_object().unwrap().len(), 6, "{line}");
        let id = row["id"].as_u64().unwrap();
        let partition = row["partition"].as_u64().unwrap();
        let offset = row["offset"].as_u64().unwrap();
        assert_eq!(json["message_id"], format!("{partition}-{offset}"));
        assert_eq!(id, offset * 3 + partition);
        assert_eq!(row["user_id"].as_u64().unwrap(), id % 1000);
        assert_eq!(row["ts"].as_u64().unwrap(), TS_BASE + id / 1000);
        fill_payload(id, 16, &mut payload);
        assert_eq!(
            row["payload"].as_str().unwrap().as_bytes(),
            payload.as_slice()
        );
        assert!(!seen[id as usize], "id {id} written twice");
        seen[id as usize] = true;
    }
    assert!(seen.iter().all(|s| *s));

    for p in 0..3 {
        assert!(undelivered_rows(&store, "out", p).is_empty());
        assert_eq!(position(&store, p), Some(1000));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn rerun_after_completion_on_the_same_state_dir_adds_nothing() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("out.jsonl");
    let state = tmp.path().join("state");
    let registry = Registry::with_builtins();
    let yaml = generator_yaml(2, 500, 100, "DebugSink", &out);

    let store = open_store(&state);
    run_yaml(&registry, &yaml, &store).await.unwrap();
    store.close().unwrap();
    let first = std::fs::read(&out).unwrap();

    let store = open_store(&state);
    let report = run_yaml(&registry, &yaml, &store).await.unwrap();
    assert_eq!(report.messages(), 0);
    assert!(report
        .partitions
        .iter()
        .all(|p| p.end == PartitionEnd::Drained && p.epochs_committed == 0));
    assert_eq!(std::fs::read(&out).unwrap(), first);
    assert_each_id_once(&out, 1000);
}

/// The persisted counters of the store: (owner, partition, name) -> value.
fn counters(store: &StateStore) -> BTreeMap<(String, u32, String), u64> {
    store
        .counters()
        .unwrap()
        .into_iter()
        .map(|c| ((c.owner, c.partition, c.name), c.value))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn counters_persist_with_commits_and_acknowledgements_and_a_rerun_serves_them_at_start() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("out.jsonl");
    let state = tmp.path().join("state");
    let registry = Registry::with_builtins();
    let yaml = generator_yaml(2, 500, 100, "DebugSink", &out);
    let store = open_store(&state);
    run_yaml(&registry, &yaml, &store).await.unwrap();
    store.close().unwrap();

    let store = open_store(&state);
    let mut expected = BTreeMap::new();
    for p in 0..2 {
        let mut put = |owner: &str, name: &str, value| {
            expected.insert((owner.to_owned(), p, name.to_owned()), value);
        };
        put(SOURCE_OWNER, "messages", 500);
        put(SOURCE_OWNER, "epochs_committed", 5);
        put("out", "rows_delivered", 500);
        put("out", "batches_delivered", 5);
    }
    assert_eq!(counters(&store), expected);
    // A rerun with nothing to do serves the totals from its start and adds nothing.
    let spec = PipelineSpec::from_yaml(&yaml).unwrap();
    let pipeline = Pipeline::new(registry.build(&spec).unwrap(), store.clone());
    let metrics = pipeline.metrics();
    pipeline.load_counters().await.unwrap();
    let text = metrics.encode().unwrap();
    assert!(
        text.contains("flow_sink_rows_delivered_total{pipeline=\"rt\",sink=\"out\",partition=\"1\",shard=\"\"} 500\n"),
        "{text}"
    );
    pipeline.run().await.unwrap();
    assert_eq!(counters(&store), expected);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn committed_but_undelivered_batches_are_delivered_after_a_crash_and_the_torn_tail_is_cut() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("out.jsonl");
    let state = tmp.path().join("state");
    let mut registry = Registry::with_builtins();
    register_wrapped_debug_sink(
        &mut registry,
        "CrashingDebugSink",
        Arc::new(|inner, _ctx| {
            Box::new(LosesDeliveries {
                inner,
                deliver_epochs: 2,
                committed: 0,
            })
        }),
    );

    // Run 1: 10 epochs of 100 per partition are committed; only the first 2 are delivered.
    let store = open_store(&state);
    run_yaml(
        &registry,
        &generator_yaml(3, 1000, 100, "CrashingDebugSink", &out),
        &store,
    )
    .await
    .unwrap();
    assert_eq!(read_lines(&out).len(), 3 * 200);
    for p in 0..3 {
        assert_eq!(position(&store, p), Some(1000));
        let pending = undelivered_rows(&store, "out", p);
        assert_eq!(pending.first(), Some(&(200, 299)));
        assert_eq!(pending.last(), Some(&(900, 999)));
        assert_eq!(pending.len(), 8);
    }
    store.close().unwrap();

    // The crash tore a write that was never acknowledged.
    let mut file = std::fs::OpenOptions::new().append(true).open(&out).unwrap();
    file.write_all(b"{\"message_id\":\"1-200\",\"stream\":\"ro")
        .unwrap();
    drop(file);

    // Run 2: the same class, no longer losing deliveries (another class is refused while the
    // batches are pending: see the sink guard's test).
    let store = open_store(&state);
    let report = run_yaml(
        &delivering_registry(),
        &generator_yaml(3, 1000, 100, "CrashingDebugSink", &out),
        &store,
    )
    .await
    .unwrap();
    assert_eq!(report.messages(), 0);
    assert_each_id_once(&out, 3000);
    for p in 0..3 {
        assert!(undelivered_rows(&store, "out", p).is_empty());
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn shutdown_mid_run_then_restart_delivers_each_message_once() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("out.jsonl");
    let state = tmp.path().join("state");
    let registry = Registry::with_builtins();
    // The generator's rows do not depend on its rate, so the restart may drop the rate limit.
    let yaml = |rate: u64| {
        format!(
            r#"
pipeline: {PIPELINE}
partitions: 2
epoch: {{max_messages: 50, max_duration_ms: 20}}
source: {{class: generator, parameters: {{count: 2000, rate_per_second: {rate}}}}}
sinks:
  - {{name: out, sink_class_name: DebugSink, input_stream_ids: [rows], parameters: {{path: "{}"}}}}
"#,
            out.display()
        )
    };

    let store = open_store(&state);
    let spec = PipelineSpec::from_yaml(&yaml(2000)).unwrap();
    let pipeline = Pipeline::new(registry.build(&spec).unwrap(), store.clone());
    let control = pipeline.control();
    let running = tokio::spawn(pipeline.run());
    tokio::time::sleep(Duration::from_millis(100)).await;
    control.shutdown();
    assert!(control.is_shutting_down());
    let report = running.await.unwrap().unwrap();
    for part in &report.partitions {
        assert_eq!(part.end, PartitionEnd::Stopped);
        let committed = position(&store, part.partition).unwrap_or(0);
        assert_eq!(committed, part.messages);
        assert!(
            committed < 2000,
            "partition {} finished early",
            part.partition
        );
    }
    store.close().unwrap();

    let store = open_store(&state);
    let report = run_yaml(&registry, &yaml(0), &store).await.unwrap();
    assert!(report
        .partitions
        .iter()
        .all(|p| p.end == PartitionEnd::Drained));
    assert_each_id_once(&out, 4000);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn vetoed_epochs_are_replayed_from_the_committed_position_and_counted() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("out.jsonl");
    let mut registry = Registry::with_builtins();
    register_wrapped_debug_sink(
        &mut registry,
        "VetoingDebugSink",
        Arc::new(|inner, _ctx| Box::new(Vetoes { inner, vetoes: 3 })),
    );
    let store = open_store(&tmp.path().join("state"));

    let report = run_yaml(
        &registry,
        &generator_yaml(2, 300, 100, "VetoingDebugSink", &out),
        &store,
    )
    .await
    .unwrap();

    for part in &report.partitions {
        assert_eq!(part.vetoes, 3);
        assert_eq!(part.epochs_committed, 3);
        assert_eq!(part.messages, 300);
        assert_eq!(part.end, PartitionEnd::Drained);
        assert_eq!(position(&store, part.partition), Some(300));
    }
    assert_each_id_once(&out, 600);
}

/// Delivers through the inner sink, then fails its final drain, as a sink stopped on its
/// target (an incompatible change of its table's columns) ends the run.
struct FailsAtDrain {
    inner: Box<dyn Sink>,
}

#[async_trait]
impl Sink for FailsAtDrain {
    async fn write_epoch(&mut self, epoch: &Epoch<'_>) -> Result<EpochOutcome, SinkError> {
        self.inner.write_epoch(epoch).await
    }
    async fn open(&mut self) -> Result<(), SinkError> {
        self.inner.open().await
    }
    async fn committed(&mut self, batches: Vec<(u64, SealedBatch)>) -> Result<(), SinkError> {
        self.inner.committed(batches).await
    }
    async fn drain(&mut self) -> Result<(), SinkError> {
        self.inner.drain().await?;
        Err(SinkError::Refused(
            "not delivered: this sink stopped".into(),
        ))
    }
    async fn close(&mut self) -> Result<(), SinkError> {
        self.inner.close().await
    }
}

/// Counts the final drains of the inner sink's instances.
struct CountsDrains {
    inner: Box<dyn Sink>,
    drains: Arc<std::sync::atomic::AtomicUsize>,
}

#[async_trait]
impl Sink for CountsDrains {
    async fn write_epoch(&mut self, epoch: &Epoch<'_>) -> Result<EpochOutcome, SinkError> {
        self.inner.write_epoch(epoch).await
    }
    async fn open(&mut self) -> Result<(), SinkError> {
        self.inner.open().await
    }
    async fn committed(&mut self, batches: Vec<(u64, SealedBatch)>) -> Result<(), SinkError> {
        self.inner.committed(batches).await
    }
    async fn drain(&mut self) -> Result<(), SinkError> {
        self.inner.drain().await?;
        self.drains
            .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        Ok(())
    }
    async fn close(&mut self) -> Result<(), SinkError> {
        self.inner.close().await
    }
}

/// A sink whose final drain fails does not keep the sinks after it in the spec from
/// delivering every committed batch: the partition fails with that sink's error only after
/// each sink was drained (issue 46 item 10: the second of two sinks stopped short).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_sink_failing_its_final_drain_leaves_the_later_sinks_to_deliver_everything() {
    let tmp = tempfile::tempdir().unwrap();
    let (stopped, healthy) = (
        tmp.path().join("stopped.jsonl"),
        tmp.path().join("healthy.jsonl"),
    );
    let mut registry = Registry::with_builtins();
    register_wrapped_debug_sink(
        &mut registry,
        "FailsAtDrain",
        Arc::new(|inner, _| Box::new(FailsAtDrain { inner })),
    );
    let drains = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let counted = Arc::clone(&drains);
    register_wrapped_debug_sink(
        &mut registry,
        "CountsDrains",
        Arc::new(move |inner, _| {
            Box::new(CountsDrains {
                inner,
                drains: Arc::clone(&counted),
            })
        }),
    );
    let store = open_store(&tmp.path().join("state"));
    let yaml = format!(
        r#"
pipeline: {PIPELINE}
partitions: 2
epoch: {{max_messages: 100, max_duration_ms: 60000}}
source: {{class: generator, parameters: {{count: 500}}}}
sinks:
  - {{name: stopped, sink_class_name: FailsAtDrain, input_stream_ids: [rows], parameters: {{path: "{}"}}}}
  - {{name: healthy, sink_class_name: CountsDrains, input_stream_ids: [rows], parameters: {{path: "{}"}}}}
"#,
        stopped.display(),
        healthy.display()
    );
    let err = run_yaml(&registry, &yaml, &store).await.unwrap_err();
    let RuntimeError::PartitionsFailed(failures) = &err else {
        panic!("unexpected error: {err}");
    };
    assert_eq!(failures.len(), 2, "{err}");
    for failure in failures {
        assert!(
            matches!(failure, RuntimeError::Sink { sink, .. } if sink == "stopped"),
            "{failure}"
        );
    }
    assert_eq!(
        drains.load(std::sync::atomic::Ordering::SeqCst),
        2,
        "each partition's later sink drained to the end"
    );
    assert_each_id_once(&healthy, 1000);
    for partition in 0..2 {
        assert!(undelivered_rows(&store, "healthy", partition).is_empty());
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_failing_partition_fails_alone_and_keeps_what_it_committed() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("out.jsonl");
    let mut registry = Registry::with_builtins();
    register_failing_sink(&mut registry);
    let store = open_store(&tmp.path().join("state"));
    let yaml = format!(
        r#"
pipeline: {PIPELINE}
partitions: 3
epoch: {{max_messages: 100, max_duration_ms: 60000}}
source: {{class: generator, parameters: {{count: 1000}}}}
sinks:
  - {{name: out, sink_class_name: DebugSink, input_stream_ids: [rows], parameters: {{path: "{}"}}}}
  - {{name: flaky, sink_class_name: FailsInPartition, input_stream_ids: [rows], parameters: {{partition: 1, at_epoch: 2}}}}
"#,
        out.display()
    );

    let err = run_yaml(&registry, &yaml, &store).await.unwrap_err();
    let RuntimeError::PartitionsFailed(failures) = &err else {
        panic!("unexpected error: {err}");
    };
    assert_eq!(failures.len(), 1, "{err}");
    match &failures[0] {
        RuntimeError::Sink {
            partition, sink, ..
        } => {
            assert_eq!(*partition, 1);
            assert_eq!(sink, "flaky");
        }
        other => panic!("unexpected failure: {other}"),
    }
    assert_eq!(
        err.to_string(),
        "1 partition(s) failed:\n  partition 1: sink `flaky`: the target rejected the epoch"
    );

    assert_eq!(position(&store, 0), Some(1000));
    assert_eq!(position(&store, 2), Some(1000));
    // Partition 1 committed epochs 0 and 1, failed in epoch 2.
    assert_eq!(position(&store, 1), Some(200));
    assert!(undelivered_rows(&store, "out", 0).is_empty());
    assert!(undelivered_rows(&store, "out", 2).is_empty());

    // Partition 1's committed messages are in the file or still in its outbox, never both.
    let lines = read_lines(&out);
    let ids = sorted_ids(&lines);
    let mut delivered_1: Vec<u64> = ids
        .iter()
        .filter(|id| *id % 3 == 1)
        .map(|id| id / 3)
        .collect();
    delivered_1.sort_unstable();
    let mut pending_1: Vec<u64> = undelivered_rows(&store, "out", 1)
        .into_iter()
        .flat_map(|(first, last)| first..=last)
        .collect();
    let mut all_1 = delivered_1.clone();
    all_1.append(&mut pending_1);
    assert_eq!(all_1, (0..200).collect::<Vec<_>>());
    let others: Vec<u64> = ids.iter().copied().filter(|id| id % 3 != 1).collect();
    assert_eq!(
        others,
        (0..3000).filter(|id| id % 3 != 1).collect::<Vec<_>>()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn reload_swaps_dynamic_parameters_reports_static_changes_and_rejects_invalid_values() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("out.jsonl");
    let registry = Registry::with_builtins();
    let store = open_store(&tmp.path().join("state"));
    let yaml = |path: &Path, max_rows: u64| {
        format!(
            r#"
pipeline: {PIPELINE}
epoch: {{max_messages: 100, max_duration_ms: 60000}}
source: {{class: generator, parameters: {{count: 20}}}}
sinks:
  - name: out
    sink_class_name: DebugSink
    input_stream_ids: [rows]
    parameters: {{path: "{}"}}
    dynamic_parameters: {{max_rows_per_batch: {max_rows}}}
"#,
            path.display()
        )
    };
    let spec = |path: &Path, max_rows: u64| PipelineSpec::from_yaml(&yaml(path, max_rows)).unwrap();

    let pipeline = Pipeline::new(registry.build(&spec(&out, 1000)).unwrap(), store.clone());
    let control = pipeline.control();

    assert_eq!(
        control.reload(&registry, &spec(&out, 1)).unwrap(),
        ReloadOutcome {
            reconfigured: vec!["out".to_owned()],
            static_changed: false,
            static_changes: vec![],
        }
    );
    // Same parameters again: nothing to do.
    assert_eq!(
        control.reload(&registry, &spec(&out, 1)).unwrap(),
        ReloadOutcome::default()
    );
    assert_eq!(
        control
            .reload(&registry, &spec(&tmp.path().join("other.jsonl"), 1))
            .unwrap(),
        ReloadOutcome {
            reconfigured: vec![],
            static_changed: true,
            // The SIGHUP warning names it.
            static_changes: vec!["sinks[0].parameters.path".to_owned()],
        }
    );
    let err = control.reload(&registry, &spec(&out, 0)).unwrap_err();
    assert_eq!(
        err.violations,
        vec![Violation::new(
            "sinks[0].dynamic_parameters.max_rows_per_batch",
            "0 is out of range 1..=1000000"
        )]
    );
    // Nothing of the rejected spec was applied.
    assert_eq!(
        control.reload(&registry, &spec(&out, 1)).unwrap(),
        ReloadOutcome::default()
    );

    // The reloaded `max_rows_per_batch: 1` is in force: one batch (one acknowledgement) per row.
    let report = pipeline.run().await.unwrap();
    assert_eq!(report.messages(), 20);
    assert_eq!(store.stats().acknowledgements, 20);
    assert_each_id_once(&out, 20);
    assert!(!tmp.path().join("other.jsonl").exists());
}

/// A sink class `Recording` with dynamic parameter `tag` that records the tag in force at each
/// epoch, and blocks epoch 0 until `go` is notified.
struct Recorder {
    seen: Arc<Mutex<Vec<(u64, String)>>>,
    started: Arc<Notify>,
    go: Arc<Notify>,
}

fn register_recording_sink(registry: &mut Registry, recorder: Arc<Recorder>) {
    #[derive(serde::Deserialize)]
    #[serde(deny_unknown_fields)]
    struct Dynamic {
        tag: String,
    }
    fn parse(value: &serde_yaml::Value) -> Result<String, Vec<Violation>> {
        let d: Dynamic = flow_core::registry::parse_parameters(value, "dynamic_parameters")?;
        if d.tag.is_empty() {
            return Err(vec![Violation::new(
                "dynamic_parameters.tag",
                "must not be empty",
            )]);
        }
        Ok(d.tag)
    }
    struct Factory(Arc<Recorder>);
    impl SinkFactory for Factory {
        fn create(&self, ctx: SinkContext) -> Result<Box<dyn Sink>, SinkError> {
            let tag = parse(&ctx.dynamic_parameters)
                .map_err(|v| SinkError::Refused(Violation::list(&v)))?;
            Ok(Box::new(Recording {
                recorder: Arc::clone(&self.0),
                tag,
            }))
        }
    }
    struct Recording {
        recorder: Arc<Recorder>,
        tag: String,
    }
    #[async_trait]
    impl Sink for Recording {
        async fn write_epoch(&mut self, epoch: &Epoch<'_>) -> Result<EpochOutcome, SinkError> {
            self.recorder
                .seen
                .lock()
                .unwrap()
                .push((epoch.number, self.tag.clone()));
            if epoch.number == 0 {
                self.recorder.started.notify_one();
                self.recorder.go.notified().await;
            }
            Ok(EpochOutcome::Commit(EpochWrite::default()))
        }
        fn reconfigure(&mut self, dynamic: &serde_yaml::Value) -> Result<(), SinkError> {
            self.tag = parse(dynamic).map_err(|v| SinkError::Refused(Violation::list(&v)))?;
            Ok(())
        }
    }
    registry.register_sink(
        "Recording",
        Arc::new(
            move |_ctx: &SinkBuildContext<'_>,
                  _parameters: &serde_yaml::Value,
                  dynamic: &serde_yaml::Value|
                  -> BuildResult<Arc<dyn SinkFactory>> {
                parse(dynamic)?;
                Ok(Arc::new(Factory(Arc::clone(&recorder))))
            },
        ),
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn reload_while_running_reconfigures_the_sink_before_the_next_epoch() {
    let tmp = tempfile::tempdir().unwrap();
    let recorder = Arc::new(Recorder {
        seen: Arc::default(),
        started: Arc::default(),
        go: Arc::default(),
    });
    let mut registry = Registry::with_builtins();
    register_recording_sink(&mut registry, Arc::clone(&recorder));
    let store = open_store(&tmp.path().join("state"));
    let yaml = |tag: &str| {
        format!(
            r#"
pipeline: {PIPELINE}
epoch: {{max_messages: 100, max_duration_ms: 60000}}
source: {{class: generator, parameters: {{count: 300}}}}
sinks:
  - {{name: rec, sink_class_name: Recording, input_stream_ids: [rows], dynamic_parameters: {{tag: "{tag}"}}}}
"#
        )
    };
    let spec = PipelineSpec::from_yaml(&yaml("a")).unwrap();
    let pipeline = Pipeline::new(registry.build(&spec).unwrap(), store.clone());
    let control = pipeline.control();
    let running = tokio::spawn(pipeline.run());

    recorder.started.notified().await;
    let err = control
        .reload(&registry, &PipelineSpec::from_yaml(&yaml("")).unwrap())
        .unwrap_err();
    assert_eq!(err.violations[0].path, "sinks[0].dynamic_parameters.tag");
    let outcome = control
        .reload(&registry, &PipelineSpec::from_yaml(&yaml("b")).unwrap())
        .unwrap();
    assert_eq!(outcome.reconfigured, vec!["rec".to_owned()]);
    assert!(!outcome.static_changed);
    recorder.go.notify_one();

    let report = running.await.unwrap().unwrap();
    assert_eq!(report.messages(), 300);
    assert_eq!(
        *recorder.seen.lock().unwrap(),
        vec![
            (0, "a".to_owned()),
            (1, "b".to_owned()),
            (2, "b".to_owned())
        ]
    );
}

fn jsonl_yaml(files: &[PathBuf], out: &Path, on_bad_record: Option<&str>) -> String {
    let files: Vec<String> = files
        .iter()
        .map(|f| format!("\"{}\"", f.display()))
        .collect();
    let on_bad = on_bad_record
        .map(|v| format!(", on_bad_record: {v}"))
        .unwrap_or_default();
    format!(
        r#"
pipeline: {PIPELINE}
partitions: {}
source:
  class: jsonl_file
  parameters: {{files: [{}], schema: [{{name: id, type: uint64}}, {{name: name, type: utf8}}]{on_bad}}}
sinks:
  - {{name: out, sink_class_name: DebugSink, input_stream_ids: [rows], parameters: {{path: "{}"}}}}
"#,
        files.len(),
        files.join(", "),
        out.display()
    )
}

fn write_jsonl_inputs(dir: &Path) -> Vec<PathBuf> {
    let a = dir.join("a.jsonl");
    let b = dir.join("b.jsonl");
    std::fs::write(
        &a,
        "{\"id\":1,\"name\":\"one\"}\n{\"id\":-2,\"name\":\"two\"}\n{\"id\":3,\"name\":\"three\"}\n",
    )
    .unwrap();
    std::fs::write(
        &b,
        "{\"id\":10,\"name\":\"ten\"}\n{\"id\":11,\"name\":\"eleven\"}\n",
    )
    .unwrap();
    vec![a, b]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn jsonl_bad_line_becomes_a_source_dead_letter_and_good_lines_are_written() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("out.jsonl");
    let files = write_jsonl_inputs(tmp.path());
    let store = open_store(&tmp.path().join("state"));
    let registry = Registry::with_builtins();

    let report = run_yaml(
        &registry,
        &jsonl_yaml(&files, &out, Some("dead_letter")),
        &store,
    )
    .await
    .unwrap();
    assert_eq!(report.messages(), 4);
    assert_eq!(report.partitions[0].dead_letters, 1);
    assert_eq!(report.partitions[1].dead_letters, 0);

    let mut lines = read_lines(&out);
    lines.sort();
    assert_eq!(
        lines,
        vec![
            r#"{"message_id":"0-0","stream":"rows","row":{"id":1,"name":"one"}}"#,
            r#"{"message_id":"0-2","stream":"rows","row":{"id":3,"name":"three"}}"#,
            r#"{"message_id":"1-0","stream":"rows","row":{"id":10,"name":"ten"}}"#,
            r#"{"message_id":"1-1","stream":"rows","row":{"id":11,"name":"eleven"}}"#,
        ]
    );

    let dead = store.dead_letters(PIPELINE, SOURCE_OWNER, 0).unwrap();
    assert_eq!(dead.len(), 1);
    assert_eq!(dead[0].partition, 0);
    assert_eq!(dead[0].offset, Some(1));
    assert_eq!(dead[0].payload, br#"{"id":-2,"name":"two"}"#);
    assert_eq!(
        dead[0].reason,
        format!(
            "{}:2: column `id` (uint64): -2 is out of range for uint64 (0 to 18446744073709551615)",
            files[0].display()
        )
    );
    assert!(store
        .dead_letters(PIPELINE, SOURCE_OWNER, 1)
        .unwrap()
        .is_empty());
    // Lines are messages 0..3 of partition 0: the position starts with (bytes of the file,
    // 3 lines), then the file's identity (device, inode, hash of the bytes before the offset).
    let len = std::fs::metadata(&files[0]).unwrap().len();
    let mut expected = len.to_be_bytes().to_vec();
    expected.extend_from_slice(&3u64.to_be_bytes());
    let position = store.position(PIPELINE, 0).unwrap().unwrap();
    assert_eq!(position.len(), 40);
    assert_eq!(position[..16], expected[..]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn jsonl_bad_line_stops_its_partition_with_file_line_and_column_by_default() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("out.jsonl");
    let files = write_jsonl_inputs(tmp.path());
    let store = open_store(&tmp.path().join("state"));
    let registry = Registry::with_builtins();

    let err = run_yaml(&registry, &jsonl_yaml(&files, &out, None), &store)
        .await
        .unwrap_err();
    let RuntimeError::PartitionsFailed(failures) = &err else {
        panic!("unexpected error: {err}");
    };
    assert_eq!(failures.len(), 1);
    let RuntimeError::Source {
        partition: 0,
        source: SourceError::BadRecord { location, what },
    } = &failures[0]
    else {
        panic!("unexpected failure: {}", failures[0]);
    };
    assert_eq!(location, &format!("{}:2", files[0].display()));
    assert_eq!(
        what,
        "column `id` (uint64): -2 is out of range for uint64 (0 to 18446744073709551615)"
    );
    assert_eq!(
        failures[0].to_string(),
        format!(
            "partition 0: source: {}:2: column `id` (uint64): -2 is out of range for uint64 (0 to 18446744073709551615)",
            files[0].display()
        )
    );
    // Partition 1 is unaffected; partition 0 committed nothing.
    assert_eq!(store.position(PIPELINE, 0).unwrap(), None);
    assert!(store.position(PIPELINE, 1).unwrap().is_some());
    let lines = read_lines(&out);
    assert_eq!(lines.len(), 2);
    assert!(lines.iter().all(|l| l.starts_with(r#"{"message_id":"1-"#)));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn project_processor_keeps_only_the_listed_columns_in_order() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("out.jsonl");
    let store = open_store(&tmp.path().join("state"));
    let registry = Registry::with_builtins();
    let yaml = format!(
        r#"
pipeline: {PIPELINE}
partitions: 2
source: {{class: generator, parameters: {{count: 50}}}}
processors:
  - {{name: slim, class: project, input_stream_id: rows, output_stream_id: slim_rows, parameters: {{columns: [user_id, id]}}}}
sinks:
  - {{name: out, sink_class_name: DebugSink, input_stream_ids: [slim_rows], parameters: {{path: "{}"}}}}
"#,
        out.display()
    );

    let report = run_yaml(&registry, &yaml, &store).await.unwrap();
    assert_eq!(report.messages(), 100);

    let mut lines = read_lines(&out);
    lines.sort();
    let mut expected: Vec<String> = (0..2u64)
        .flat_map(|p| (0..50u64).map(move |o| (p, o)))
        .map(|(p, o)| {
            let id = o * 2 + p;
            format!(
                r#"{{"message_id":"{p}-{o}","stream":"slim_rows","row":{{"user_id":{},"id":{id}}}}}"#,
                id % 1000
            )
        })
        .collect();
    expected.sort();
    assert_eq!(lines, expected);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn one_sink_can_read_the_source_stream_and_a_processor_stream() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("out.jsonl");
    let store = open_store(&tmp.path().join("state"));
    let registry = Registry::with_builtins();
    let yaml = format!(
        r#"
pipeline: {PIPELINE}
source: {{class: generator, parameters: {{count: 10, payload_bytes: 0}}}}
processors:
  - {{name: ids, class: project, input_stream_id: rows, output_stream_id: ids, parameters: {{columns: [id]}}}}
sinks:
  - {{name: out, sink_class_name: DebugSink, input_stream_ids: [rows, ids], parameters: {{path: "{}"}}}}
"#,
        out.display()
    );
    run_yaml(&registry, &yaml, &store).await.unwrap();
    let mut per_stream: BTreeMap<String, usize> = BTreeMap::new();
    for line in read_lines(&out) {
        let json: serde_json::Value = serde_json::from_str(&line).unwrap();
        *per_stream
            .entry(json["stream"].as_str().unwrap().to_owned())
            .or_default() += 1;
    }
    assert_eq!(
        per_stream,
        BTreeMap::from([("ids".to_owned(), 10), ("rows".to_owned(), 10)])
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn shutdown_requested_before_run_stops_every_partition_before_its_first_epoch() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("out.jsonl");
    let store = open_store(&tmp.path().join("state"));
    let registry = Registry::with_builtins();
    // An endless source: only the shutdown can end this run.
    let yaml = format!(
        r#"
pipeline: {PIPELINE}
partitions: 2
source: {{class: generator, parameters: {{count: 0}}}}
sinks:
  - {{name: out, sink_class_name: DebugSink, input_stream_ids: [rows], parameters: {{path: "{}"}}}}
"#,
        out.display()
    );
    let spec = PipelineSpec::from_yaml(&yaml).unwrap();
    let pipeline = Pipeline::new(registry.build(&spec).unwrap(), store.clone());
    let control = pipeline.control();
    control.shutdown();
    assert!(control.is_shutting_down());
    let report = tokio::time::timeout(Duration::from_secs(10), pipeline.run())
        .await
        .expect("the shutdown requested before run() was lost")
        .unwrap();
    assert_eq!(report.messages(), 0);
    assert!(report
        .partitions
        .iter()
        .all(|p| p.end == PartitionEnd::Stopped && p.epochs_committed == 0));
    assert_eq!(position(&store, 0), None);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn reload_that_changes_a_sink_class_leaves_the_running_sink_alone() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("out.jsonl");
    let recorder = Arc::new(Recorder {
        seen: Arc::default(),
        started: Arc::default(),
        go: Arc::default(),
    });
    let mut registry = Registry::with_builtins();
    register_recording_sink(&mut registry, Arc::clone(&recorder));
    let store = open_store(&tmp.path().join("state"));
    let yaml = |sink: &str| {
        format!(
            r#"
pipeline: {PIPELINE}
epoch: {{max_messages: 100, max_duration_ms: 60000}}
source: {{class: generator, parameters: {{count: 300}}}}
sinks:
  - {{name: rec, sink_class_name: Recording, input_stream_ids: [rows], dynamic_parameters: {{tag: "a"}}}}
  - {sink}
"#
        )
    };
    let debug = format!(
        r#"{{name: out, sink_class_name: DebugSink, input_stream_ids: [rows], parameters: {{path: "{}"}}}}"#,
        out.display()
    );
    let spec = PipelineSpec::from_yaml(&yaml(&debug)).unwrap();
    let pipeline = Pipeline::new(registry.build(&spec).unwrap(), store.clone());
    let control = pipeline.control();
    let running = tokio::spawn(pipeline.run());

    recorder.started.notified().await;
    // `out` becomes a `Recording` sink: valid, but only after a restart. Its new dynamic
    // parameters mean nothing to the running DebugSink.
    let outcome = control
        .reload(
            &registry,
            &PipelineSpec::from_yaml(&yaml(
                "{name: out, sink_class_name: Recording, input_stream_ids: [rows], dynamic_parameters: {tag: x}}",
            ))
            .unwrap(),
        )
        .unwrap();
    assert!(outcome.static_changed);
    assert_eq!(
        outcome.static_changes,
        vec!["sinks[1].sink_class_name", "sinks[1].parameters"]
    );
    assert!(outcome.reconfigured.is_empty(), "{outcome:?}");
    recorder.go.notify_one();

    let report = running.await.unwrap().unwrap();
    assert_eq!(report.messages(), 300);
    assert_each_id_once(&out, 300);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_renamed_pipeline_or_fewer_partitions_on_a_state_directory_refuses_to_start() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("out.jsonl");
    let store = open_store(&tmp.path().join("state"));
    let registry = Registry::with_builtins();
    run_yaml(
        &registry,
        &generator_yaml(4, 10, 5, "DebugSink", &out),
        &store,
    )
    .await
    .unwrap();
    let delivered = read_lines(&out).len();

    let renamed =
        generator_yaml(4, 10, 5, "DebugSink", &out).replace("pipeline: rt", "pipeline: rt2");
    let err = run_yaml(&registry, &renamed, &store).await.unwrap_err();
    assert!(matches!(err, RuntimeError::OtherPipeline(_)), "{err:?}");
    assert!(
        err.to_string().contains("belongs to pipeline `rt` with 4 partition(s), but the spec says pipeline `rt2` with 4 partition(s)"),
        "{err}"
    );
    let fewer = run_yaml(
        &registry,
        &generator_yaml(2, 10, 5, "DebugSink", &out),
        &store,
    )
    .await
    .unwrap_err();
    assert!(
        fewer
            .to_string()
            .contains("but the spec says pipeline `rt` with 2 partition(s)"),
        "{fewer}"
    );
    // Nothing was sent again.
    assert_eq!(read_lines(&out).len(), delivered);
    store.close().unwrap();
}

/// A target that answers slowly (`drain` takes a while before delivering what is queued), or,
/// with `stuck`, not at all (`drain` never ends).
struct SlowTarget {
    inner: Box<dyn Sink>,
    stuck: bool,
}

#[async_trait]
impl Sink for SlowTarget {
    async fn write_epoch(&mut self, epoch: &Epoch<'_>) -> Result<EpochOutcome, SinkError> {
        self.inner.write_epoch(epoch).await
    }
    async fn open(&mut self) -> Result<(), SinkError> {
        self.inner.open().await
    }
    async fn committed(&mut self, batches: Vec<(u64, SealedBatch)>) -> Result<(), SinkError> {
        self.inner.committed(batches).await
    }
    async fn drain(&mut self) -> Result<(), SinkError> {
        if self.stuck {
            std::future::pending::<()>().await;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
        self.inner.drain().await
    }
    async fn close(&mut self) -> Result<(), SinkError> {
        self.inner.close().await
    }
}

async fn stop_after(
    registry: &Registry,
    yaml: &str,
    store: &StateStore,
    after: Duration,
) -> (RunReport, Duration) {
    let spec = PipelineSpec::from_yaml(yaml).unwrap();
    let pipeline = Pipeline::new(registry.build(&spec).unwrap(), store.clone());
    let control = pipeline.control();
    let running = tokio::spawn(pipeline.run());
    tokio::time::sleep(after).await;
    control.shutdown();
    let stopped = std::time::Instant::now();
    let report = running.await.unwrap().unwrap();
    (report, stopped.elapsed())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_graceful_stop_delivers_what_is_pending_within_the_drain_time_and_no_longer() {
    let tmp = tempfile::tempdir().unwrap();
    let mut registry = Registry::with_builtins();
    for (class, stuck) in [("HeldDebugSink", false), ("StuckDebugSink", true)] {
        register_wrapped_debug_sink(
            &mut registry,
            class,
            Arc::new(move |inner, _ctx| Box::new(SlowTarget { inner, stuck })),
        );
    }
    let yaml = |class: &str, out: &Path, drain_ms: u64| {
        format!(
            "pipeline: {PIPELINE}\npartitions: 2\nepoch: {{max_messages: 50, max_duration_ms: 20}}\nshutdown: {{drain_timeout_ms: {drain_ms}}}\nsource: {{class: generator, parameters: {{count: 100000, rate_per_second: 2000}}}}\nsinks:\n  - {{name: out, sink_class_name: {class}, input_stream_ids: [rows], parameters: {{path: \"{}\"}}}}\n",
            out.display()
        )
    };

    // A slow target: the stop waits for it, everything committed is delivered.
    let out = tmp.path().join("held.jsonl");
    let store = open_store(&tmp.path().join("held"));
    let (report, _) = stop_after(
        &registry,
        &yaml("HeldDebugSink", &out, 10_000),
        &store,
        Duration::from_millis(300),
    )
    .await;
    assert!(report.messages() > 0);
    assert_eq!(read_lines(&out).len() as u64, report.messages());
    for p in 0..2 {
        assert!(undelivered_rows(&store, "out", p).is_empty());
    }
    store.close().unwrap();

    // A target that stopped answering: the stop ends after the drain time; what was not
    // delivered stays in the outbox.
    let out = tmp.path().join("stuck.jsonl");
    let store = open_store(&tmp.path().join("stuck"));
    let (report, took) = stop_after(
        &registry,
        &yaml("StuckDebugSink", &out, 300),
        &store,
        Duration::from_millis(300),
    )
    .await;
    assert!(took < Duration::from_secs(3), "{took:?}");
    assert!(report.messages() > 0);
    let pending: u64 = (0..2)
        .map(|p| {
            undelivered_rows(&store, "out", p)
                .iter()
                .map(|(first, last)| last - first + 1)
                .sum::<u64>()
        })
        .sum();
    assert_eq!(pending + read_lines(&out).len() as u64, report.messages());
    store.close().unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn drain_delivers_every_pending_batch_without_reading_the_source() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("out.jsonl");
    let state = tmp.path().join("state");
    let mut registry = Registry::with_builtins();
    register_wrapped_debug_sink(
        &mut registry,
        "CrashingDebugSink",
        Arc::new(|inner, _ctx| {
            Box::new(LosesDeliveries {
                inner,
                deliver_epochs: 2,
                committed: 0,
            })
        }),
    );
    // 10 epochs of 100 per partition committed, the first 2 delivered.
    let store = open_store(&state);
    let crashing = generator_yaml(3, 1000, 100, "CrashingDebugSink", &out);
    run_yaml(&registry, &crashing, &store).await.unwrap();

    // The drain's source could read 1000 more per partition; it must not.
    let spec =
        PipelineSpec::from_yaml(&generator_yaml(3, 2000, 100, "CrashingDebugSink", &out)).unwrap();
    let delivering = delivering_registry();
    let drain = |store: &StateStore| {
        let validated = delivering.build(&spec).unwrap();
        Pipeline::new(validated, store.clone()).drain()
    };
    let report = drain(&store).await.unwrap();
    let pending: Vec<(u32, u64, u64)> = report
        .before
        .entries
        .iter()
        .map(|e| (e.partition, e.batches, e.rows))
        .collect();
    assert_eq!(pending, vec![(0, 8, 800), (1, 8, 800), (2, 8, 800)]);
    assert!(report.after.is_empty(), "{:?}", report.after);
    assert_each_id_once(&out, 3000);
    for p in 0..3 {
        assert_eq!(position(&store, p), Some(1000));
    }
    let again = drain(&store).await.unwrap();
    assert!(again.before.is_empty() && again.after.is_empty());
}

// ---------------------------------------------------------------------------------------------
// Pending writes: the next epoch is read while a sink's write of this one goes on.

/// What the `PendingRecorder` sink saw: per epoch attempt its number, when its reading began and
/// when its pending write finished (ms since the Unix epoch); and the offsets of committed writes.
#[derive(Default)]
struct PendingLog {
    attempts: Mutex<Vec<(u64, u64, u64)>>,
    written: Mutex<Vec<u64>>,
}

fn now_ms() -> u64 {
    let since = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH);
    since.map_or(0, |d| d.as_millis() as u64)
}

/// Registers sink class `class`, whose factory `make` gives whatever the spec's parameters.
fn register_fixed_sink(
    registry: &mut Registry,
    class: &str,
    make: impl Fn() -> Arc<dyn SinkFactory> + Send + Sync + 'static,
) {
    registry.register_sink(
        class,
        Arc::new(
            move |_ctx: &SinkBuildContext<'_>,
                  _parameters: &serde_yaml::Value,
                  _dynamic: &serde_yaml::Value|
                  -> BuildResult<Arc<dyn SinkFactory>> { Ok(make()) },
        ),
    );
}

/// A sink class `PendingRecorder` whose writes outlive `write_epoch`: each takes `write_ms`, then
/// vetoes the epoch attempts listed in `vetoes` and commits the others, recording their offsets.
fn register_pending_sink(registry: &mut Registry, log: Arc<PendingLog>, vetoes: Vec<u64>) {
    struct Factory(Arc<PendingLog>, Vec<u64>);
    impl SinkFactory for Factory {
        fn create(&self, _ctx: SinkContext) -> Result<Box<dyn Sink>, SinkError> {
            Ok(Box::new(PendingRecorder {
                log: Arc::clone(&self.0),
                vetoes: self.1.clone(),
            }))
        }
    }
    struct PendingRecorder {
        log: Arc<PendingLog>,
        vetoes: Vec<u64>,
    }
    #[async_trait]
    impl Sink for PendingRecorder {
        async fn write_epoch(&mut self, epoch: &Epoch<'_>) -> Result<EpochOutcome, SinkError> {
            let offsets: Vec<u64> = epoch.inputs[0].rows().map(|r| r.id().offset).collect();
            let (number, started_ms) = (epoch.number, epoch.started_ms);
            let veto = self.vetoes.contains(&number);
            let log = Arc::clone(&self.log);
            Ok(EpochOutcome::Pending(PendingWrite::new(async move {
                tokio::time::sleep(Duration::from_millis(300)).await;
                let finished = now_ms();
                log.attempts
                    .lock()
                    .unwrap()
                    .push((number, started_ms, finished));
                if veto {
                    return Ok(EpochOutcome::Veto {
                        reason: format!("attempt {number} refused"),
                        retry_after: Duration::from_millis(1),
                    });
                }
                log.written.lock().unwrap().extend(offsets);
                Ok(EpochOutcome::Commit(EpochWrite::default()))
            })))
        }
    }
    register_fixed_sink(registry, "PendingRecorder", move || {
        Arc::new(Factory(Arc::clone(&log), vetoes.clone()))
    });
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_next_epoch_is_read_while_a_pending_write_goes_on_and_commits_after_it() {
    let tmp = tempfile::tempdir().unwrap();
    let log = Arc::new(PendingLog::default());
    let mut registry = Registry::with_builtins();
    register_pending_sink(&mut registry, Arc::clone(&log), Vec::new());
    let store = open_store(&tmp.path().join("state"));
    let yaml = generator_yaml(1, 300, 100, "PendingRecorder", &tmp.path().join("unused"));

    let report = run_yaml(&registry, &yaml, &store).await.unwrap();

    let part = &report.partitions[0];
    assert_eq!((part.epochs_committed, part.messages), (3, 300));
    assert_eq!(position(&store, 0), Some(300));
    assert_eq!(*log.written.lock().unwrap(), (0..300).collect::<Vec<_>>());
    let attempts = log.attempts.lock().unwrap().clone();
    assert_eq!(attempts.len(), 3, "{attempts:?}");
    // Epochs 1 and 2 began reading before the write of the epoch before them finished.
    for pair in attempts.windows(2) {
        let ((_, _, finished), (number, started, _)) = (pair[0], pair[1]);
        assert!(started < finished, "epoch {number}: {attempts:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_vetoed_pending_write_drops_the_epoch_read_ahead_and_replays_from_the_commit() {
    let tmp = tempfile::tempdir().unwrap();
    let log = Arc::new(PendingLog::default());
    let mut registry = Registry::with_builtins();
    // Attempts 0 and 3 are refused: the epochs of offsets 0-99 and 100-199 are each read twice
    // (numbers 1 and 4 went to the epochs read ahead during the refused writes, then dropped).
    register_pending_sink(&mut registry, Arc::clone(&log), vec![0, 3]);
    let store = open_store(&tmp.path().join("state"));
    let yaml = generator_yaml(1, 300, 100, "PendingRecorder", &tmp.path().join("unused"));

    let report = run_yaml(&registry, &yaml, &store).await.unwrap();

    let part = &report.partitions[0];
    assert_eq!(
        (part.epochs_committed, part.vetoes, part.messages),
        (3, 2, 300)
    );
    assert_eq!(position(&store, 0), Some(300));
    assert_eq!(*log.written.lock().unwrap(), (0..300).collect::<Vec<_>>());
    assert_eq!(log.attempts.lock().unwrap().len(), 5);
}

/// A sink class `SlicedPending` that takes slices, keeps the offsets of the open epoch's slices
/// as a cutter does (dropping them when a slice or epoch of another number comes), and answers
/// each epoch with a 300 ms pending write that vetoes the attempts in `vetoes` and commits the
/// others' offsets. `log.attempts` holds, per attempt, its number, when its first slice was
/// handed and when its write finished.
fn register_sliced_pending_sink(registry: &mut Registry, log: Arc<PendingLog>, vetoes: Vec<u64>) {
    struct Factory(Arc<PendingLog>, Vec<u64>);
    impl SinkFactory for Factory {
        fn create(&self, _ctx: SinkContext) -> Result<Box<dyn Sink>, SinkError> {
            Ok(Box::new(SlicedPending {
                log: Arc::clone(&self.0),
                vetoes: self.1.clone(),
                open: None,
            }))
        }
    }
    struct SlicedPending {
        log: Arc<PendingLog>,
        vetoes: Vec<u64>,
        /// The open epoch's number, when its first slice came, and its offsets so far.
        open: Option<(u64, u64, Vec<u64>)>,
    }
    impl SlicedPending {
        fn take(&mut self, epoch: &Epoch<'_>) {
            if self
                .open
                .as_ref()
                .is_some_and(|open| open.0 != epoch.number)
            {
                self.open = None;
            }
            let open = self
                .open
                .get_or_insert_with(|| (epoch.number, now_ms(), Vec::new()));
            open.2.extend(epoch.inputs[0].rows().map(|r| r.id().offset));
        }
    }
    #[async_trait]
    impl Sink for SlicedPending {
        async fn write_epoch(&mut self, epoch: &Epoch<'_>) -> Result<EpochOutcome, SinkError> {
            self.take(epoch);
            let (number, first_slice_ms, offsets) = self.open.take().expect("take opened it");
            let veto = self.vetoes.contains(&number);
            let log = Arc::clone(&self.log);
            Ok(EpochOutcome::Pending(PendingWrite::new(async move {
                tokio::time::sleep(Duration::from_millis(300)).await;
                let finished = now_ms();
                let attempt = (number, first_slice_ms, finished);
                log.attempts.lock().unwrap().push(attempt);
                if veto {
                    return Ok(EpochOutcome::Veto {
                        reason: format!("attempt {number} refused"),
                        retry_after: Duration::from_millis(1),
                    });
                }
                log.written.lock().unwrap().extend(offsets);
                Ok(EpochOutcome::Commit(EpochWrite::default()))
            })))
        }
        fn takes_slices(&self) -> bool {
            true
        }
        async fn write_slice(&mut self, slice: &Epoch<'_>) -> Result<(), SinkError> {
            self.take(slice);
            Ok(())
        }
    }
    register_fixed_sink(registry, "SlicedPending", move || {
        Arc::new(Factory(Arc::clone(&log), vetoes.clone()))
    });
}

/// Epochs of 40,000 messages are read in slices (the last one partial); each epoch's slices
/// are handed while the write of the epoch before is still pending, and a veto of that write
/// must leave none of them in the replay: every offset is committed exactly once, in order.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn slices_read_ahead_during_a_pending_write_are_dropped_when_it_is_vetoed() {
    let tmp = tempfile::tempdir().unwrap();
    let log = Arc::new(PendingLog::default());
    let mut registry = Registry::with_builtins();
    // Attempts 0 and 2 are refused, both of the first epoch: number 1 went to the slices read
    // ahead during attempt 0's write, dropped with its veto.
    register_sliced_pending_sink(&mut registry, Arc::clone(&log), vec![0, 2]);
    let store = open_store(&tmp.path().join("state"));
    let count = 120_000;
    let yaml = generator_yaml(
        1,
        count,
        40_000,
        "SlicedPending",
        &tmp.path().join("unused"),
    );

    let report = run_yaml(&registry, &yaml, &store).await.unwrap();

    let part = &report.partitions[0];
    assert_eq!(
        (part.epochs_committed, part.vetoes, part.messages),
        (3, 2, count)
    );
    assert_eq!(position(&store, 0), Some(count));
    assert_eq!(*log.written.lock().unwrap(), (0..count).collect::<Vec<_>>());
    let attempts = log.attempts.lock().unwrap().clone();
    let numbers: Vec<u64> = attempts.iter().map(|a| a.0).collect();
    assert_eq!(numbers.len(), 5, "{attempts:?}");
    assert!(numbers.windows(2).all(|w| w[0] < w[1]), "{attempts:?}");
    // The attempt after a committed one was sliced while that one's write was pending.
    let committed = attempts.iter().filter(|a| ![0, 2].contains(&a.0));
    for (number, _, finished) in committed {
        if let Some(next) = attempts.iter().find(|a| a.0 > *number) {
            assert!(next.1 < *finished, "attempt {}: {attempts:?}", next.0);
        }
    }
}

/// What a [`SliceLog`] sink was handed: `(epoch number, "slice" | "epoch", first offset, messages)`.
type Handed = Arc<Mutex<Vec<(u64, &'static str, Option<u64>, usize)>>>;

/// A sink class that records every slice and epoch it is handed. Parameters: `slices` (whether
/// it takes slices) and `veto_first` (vetoes epoch 0 of each partition at its end).
fn register_slice_log(registry: &mut Registry, class: &str, handed: Handed) {
    #[derive(serde::Deserialize)]
    #[serde(deny_unknown_fields)]
    struct Params {
        slices: bool,
        #[serde(default)]
        veto_first: bool,
    }
    struct Factory(Handed, bool, bool);
    impl SinkFactory for Factory {
        fn create(&self, _ctx: SinkContext) -> Result<Box<dyn Sink>, SinkError> {
            Ok(Box::new(SliceLog {
                handed: Arc::clone(&self.0),
                slices: self.1,
                veto_first: self.2,
            }))
        }
    }
    struct SliceLog {
        handed: Handed,
        slices: bool,
        veto_first: bool,
    }
    impl SliceLog {
        fn record(&self, epoch: &Epoch<'_>, kind: &'static str) {
            let batch = epoch.inputs[0];
            let first = batch.ids().first().map(|id| id.offset);
            let entry = (epoch.number, kind, first, batch.len());
            self.handed.lock().unwrap().push(entry);
        }
    }
    #[async_trait]
    impl Sink for SliceLog {
        async fn write_epoch(&mut self, epoch: &Epoch<'_>) -> Result<EpochOutcome, SinkError> {
            self.record(epoch, "epoch");
            if self.veto_first && epoch.number == 0 {
                return Ok(EpochOutcome::Veto {
                    reason: "first epoch".to_owned(),
                    retry_after: Duration::ZERO,
                });
            }
            Ok(EpochOutcome::Commit(EpochWrite::default()))
        }
        fn takes_slices(&self) -> bool {
            self.slices
        }
        async fn write_slice(&mut self, slice: &Epoch<'_>) -> Result<(), SinkError> {
            self.record(slice, "slice");
            Ok(())
        }
    }
    registry.register_sink(
        class,
        Arc::new(
            move |_ctx: &SinkBuildContext<'_>,
                  parameters: &serde_yaml::Value,
                  _dynamic: &serde_yaml::Value|
                  -> BuildResult<Arc<dyn SinkFactory>> {
                let p: Params = flow_core::registry::parse_parameters(parameters, "parameters")?;
                Ok(Arc::new(Factory(
                    Arc::clone(&handed),
                    p.slices,
                    p.veto_first,
                )))
            },
        ),
    );
}

/// A finished run of [`run_slice_logs`].
struct SliceLogRun {
    report: RunReport,
    /// What each sink was handed, in the order the sinks were given.
    handed: Vec<Handed>,
    store: StateStore,
    _dir: tempfile::TempDir,
}

/// Runs a one-partition generator of `count` rows, epochs of 40k, into one [`register_slice_log`]
/// sink per `(name, parameters)`, each of its own class.
async fn run_slice_logs(count: u64, sinks: &[(&str, &str)]) -> SliceLogRun {
    let dir = tempfile::tempdir().unwrap();
    let mut registry = Registry::with_builtins();
    let mut handed = Vec::new();
    let mut entries = String::new();
    for (name, parameters) in sinks {
        let log: Handed = Arc::default();
        register_slice_log(&mut registry, &format!("Log_{name}"), Arc::clone(&log));
        handed.push(log);
        entries.push_str(&format!(
            "  - {{name: {name}, sink_class_name: Log_{name}, input_stream_ids: [rows], parameters: {parameters}}}\n"
        ));
    }
    let yaml = format!(
        "pipeline: {PIPELINE}\nepoch: {{max_messages: 40000, max_duration_ms: 60000}}\n\
         source: {{class: generator, parameters: {{count: {count}}}}}\nsinks:\n{entries}"
    );
    let store = open_store(&dir.path().join("state"));
    let report = run_yaml(&registry, &yaml, &store).await.unwrap();
    SliceLogRun {
        report,
        handed,
        store,
        _dir: dir,
    }
}

/// Per epoch number: the offsets handed (slices then the epoch's end, in order), and whether
/// the epoch was ended by `write_epoch`.
fn epochs_handed(handed: &Handed) -> BTreeMap<u64, (Vec<(u64, usize)>, bool)> {
    let mut epochs: BTreeMap<u64, (Vec<(u64, usize)>, bool)> = BTreeMap::new();
    for &(number, kind, first, len) in handed.lock().unwrap().iter() {
        let entry = epochs.entry(number).or_default();
        assert!(
            !entry.1,
            "epoch {number} was handed something after its end"
        );
        if let Some(first) = first {
            entry.0.push((first, len));
        }
        entry.1 = kind == "epoch";
    }
    epochs
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sink_that_takes_slices_gets_each_epoch_in_order_in_slices_of_at_most_16384() {
    let run = run_slice_logs(100_000, &[("s", "{slices: true}")]).await;
    assert_eq!(run.report.messages(), 100_000);
    let handed = &run.handed[0];

    let log = handed.lock().unwrap().clone();
    // Epoch 0, far from the end of the source: two full slices, then its last 7232 messages.
    assert_eq!(
        log[..3],
        [
            (0, "slice", Some(0), 16_384),
            (0, "slice", Some(16_384), 16_384),
            (0, "epoch", Some(32_768), 7_232)
        ]
    );
    let epochs = epochs_handed(handed);
    let mut next = 0;
    for (number, (pieces, ended)) in &epochs {
        assert!(ended, "epoch {number} never ended");
        let before = next;
        for &(first, len) in pieces {
            assert_eq!(first, next, "epoch {number}: a gap or a repeat");
            assert!(
                (1..=16_384).contains(&len),
                "epoch {number}: a slice of {len}"
            );
            next += len as u64;
        }
        assert!(
            next - before <= 40_000,
            "epoch {number} holds {}",
            next - before
        );
    }
    assert_eq!(next, 100_000);
    assert_eq!(epochs.len(), 3);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_sink_that_takes_whole_epochs_makes_every_sink_of_the_partition_take_whole_epochs() {
    let run = run_slice_logs(
        100_000,
        &[("s", "{slices: true}"), ("w", "{slices: false}")],
    )
    .await;
    for log in &run.handed {
        let got: Vec<_> = log.lock().unwrap().clone();
        assert_eq!(
            got,
            vec![
                (0, "epoch", Some(0), 40_000),
                (1, "epoch", Some(40_000), 40_000),
                (2, "epoch", Some(80_000), 20_000)
            ]
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slices_of_an_epoch_vetoed_before_a_sink_ended_it_are_never_ended_and_read_again_under_a_new_number(
) {
    let run = run_slice_logs(
        50_000,
        &[
            ("v", "{slices: true, veto_first: true}"),
            ("s", "{slices: true}"),
        ],
    )
    .await;
    assert_eq!(run.report.partitions[0].vetoes, 1);
    assert_eq!(run.report.messages(), 50_000);

    let epochs = epochs_handed(&run.handed[1]);
    // Epoch 0's slices reached the second sink, but the first sink vetoed before it was asked.
    assert_eq!(epochs[&0], (vec![(0, 16_384), (16_384, 16_384)], false));
    // The same messages again as epoch 1, this time ended.
    let (pieces, ended) = &epochs[&1];
    assert!(ended);
    assert_eq!(pieces.first(), Some(&(0, 16_384)));
    assert_eq!(pieces.iter().map(|p| p.1).sum::<usize>(), 40_000);
    assert_eq!(position(&run.store, 0), Some(50_000));
}

// ---------------------------------------------------------------------------------------------
// A replay stops at the committed position as the source compares positions.

/// A replayable source class `Stamped` (parameters `{count}`): one message per read, ids 1..=count,
/// then nothing (never exhausted before `count`, exhausted at it). Its positions are
/// `[sequence, stamp]`, the stamp different for every reader opened (as a broker position
/// carries what each reader saw of its stream); `same_position` compares the sequence alone.
fn register_stamped_source(registry: &mut Registry) {
    use flow_core::registry::SourceBuildContext;
    use flow_core::{
        Column, MessageId, ReadLimits, Source, SourceFactory, SourceOutput, SourceRead,
        StreamSchema, StreamType, Value,
    };
    use std::sync::atomic::{AtomicU64, Ordering};

    /// Readers opened in this process, over every run: each reader's stamp.
    static OPENED: AtomicU64 = AtomicU64::new(1000);
    struct Factory {
        count: u64,
        schema: Arc<StreamSchema>,
    }
    struct Reader {
        count: u64,
        sequence: u64,
        stamp: u64,
    }
    fn encode(sequence: u64, stamp: u64) -> Vec<u8> {
        [sequence.to_be_bytes(), stamp.to_be_bytes()].concat()
    }
    impl SourceFactory for Factory {
        fn stream_id(&self) -> &str {
            "rows"
        }
        fn schema(&self) -> Arc<StreamSchema> {
            Arc::clone(&self.schema)
        }
        fn replayable(&self) -> bool {
            true
        }
        fn same_position(&self, a: &[u8], b: &[u8]) -> bool {
            a.get(..8) == b.get(..8)
        }
        fn open_partition(
            &self,
            _partition: u32,
            position: Option<&[u8]>,
        ) -> Result<Box<dyn Source>, SourceError> {
            let sequence = position
                .and_then(|p| p.get(..8))
                .map_or(0, |w| u64::from_be_bytes(w.try_into().unwrap()));
            Ok(Box::new(Reader {
                count: self.count,
                sequence,
                stamp: OPENED.fetch_add(1, Ordering::Relaxed),
            }))
        }
    }
    #[async_trait]
    impl Source for Reader {
        async fn read(
            &mut self,
            out: &mut SourceOutput<'_>,
            limits: ReadLimits,
        ) -> Result<SourceRead, SourceError> {
            if self.sequence < self.count && limits.max_messages > 0 {
                self.sequence += 1;
                let mut row = out.batch.start_row(MessageId::new(0, self.sequence));
                row.push(Value::Uint(self.sequence)).unwrap();
                row.finish().unwrap();
            }
            Ok(SourceRead {
                position: encode(self.sequence, self.stamp),
                exhausted: self.sequence >= self.count,
                lag: None,
            })
        }
    }
    registry.register_source(
        "Stamped",
        Arc::new(
            |_ctx: &SourceBuildContext<'_>,
             parameters: &serde_yaml::Value|
             -> BuildResult<Arc<dyn SourceFactory>> {
                let count = parameters["count"].as_u64().unwrap();
                let schema =
                    StreamSchema::new(vec![Column::new("id", StreamType::Uint64)]).unwrap();
                Ok(Arc::new(Factory { count, schema }))
            },
        ),
    );
}

/// A sink class `ReplaysOnOpen`: when opened with `parameters.replay_from` set, replays from
/// `[replay_from, 99]` to the committed position and records the ids it got in `seen`.
fn register_replaying_sink(registry: &mut Registry, seen: Arc<Mutex<Option<Vec<u64>>>>) {
    struct Factory {
        from: Option<u64>,
        seen: Arc<Mutex<Option<Vec<u64>>>>,
    }
    struct Replaying {
        ctx: SinkContext,
        from: Option<u64>,
        seen: Arc<Mutex<Option<Vec<u64>>>>,
    }
    impl SinkFactory for Factory {
        fn create(&self, ctx: SinkContext) -> Result<Box<dyn Sink>, SinkError> {
            Ok(Box::new(Replaying {
                ctx,
                from: self.from,
                seen: Arc::clone(&self.seen),
            }))
        }
    }
    #[async_trait]
    impl Sink for Replaying {
        async fn open(&mut self) -> Result<(), SinkError> {
            let (Some(from), Some(replay)) = (self.from, self.ctx.replay.clone()) else {
                return Ok(());
            };
            let from = [from.to_be_bytes(), 99u64.to_be_bytes()].concat();
            let replay_error = |e| SinkError::Replay(Box::new(e));
            let mut reader = replay.open(Some(&from)).await.map_err(replay_error)?;
            let mut ids = Vec::new();
            let read = tokio::time::timeout(Duration::from_secs(5), async {
                while let Some(inputs) = reader.next().await.map_err(replay_error)? {
                    ids.extend(inputs[0].ids().iter().map(|id| id.offset));
                }
                Ok::<(), SinkError>(())
            });
            read.await.expect("the replay ends")?;
            *self.seen.lock().unwrap() = Some(ids);
            Ok(())
        }
        async fn write_epoch(&mut self, _epoch: &Epoch<'_>) -> Result<EpochOutcome, SinkError> {
            Ok(EpochOutcome::Commit(EpochWrite::default()))
        }
    }
    registry.register_sink(
        "ReplaysOnOpen",
        Arc::new(
            move |_ctx: &SinkBuildContext<'_>,
                  parameters: &serde_yaml::Value,
                  _dynamic: &serde_yaml::Value|
                  -> BuildResult<Arc<dyn SinkFactory>> {
                Ok(Arc::new(Factory {
                    from: parameters["replay_from"].as_u64(),
                    seen: Arc::clone(&seen),
                }))
            },
        ),
    );
}

#[tokio::test]
async fn a_replay_stops_at_the_committed_position_that_the_source_calls_the_same_place() {
    let dir = tempfile::tempdir().unwrap();
    let seen = Arc::new(Mutex::new(None));
    let mut registry = Registry::new();
    register_stamped_source(&mut registry);
    register_replaying_sink(&mut registry, Arc::clone(&seen));
    let yaml = |count: u64, replay_from: &str| {
        format!(
            "pipeline: {PIPELINE}\npartitions: 1\nepoch: {{max_messages: 2, max_duration_ms: 60000}}\n\
             source: {{class: Stamped, parameters: {{count: {count}}}}}\n\
             sinks:\n  - {{name: out, sink_class_name: ReplaysOnOpen, input_stream_ids: [rows], parameters: {{{replay_from}}}}}\n"
        )
    };
    let store = open_store(dir.path());
    // Committed: sequence 5, stamped by the reader of this run.
    run_yaml(&registry, &yaml(5, ""), &store).await.unwrap();
    store.close().unwrap();
    // The next run (the stream grew to 10) replays from sequence 2 with a reader of its own
    // stamp: it must stop at sequence 5, not read on to the end.
    let store = open_store(dir.path());
    run_yaml(&registry, &yaml(10, "replay_from: 2"), &store)
        .await
        .unwrap();
    assert_eq!(seen.lock().unwrap().clone(), Some(vec![3, 4, 5]));
    store.close().unwrap();
}

// ---------------------------------------------------------------------------------------------
// A stop does not wait for a read that waits on its broker.

/// A source class `Stalls` (parameters `{whole}`): `whole` reads of one message each (ids
/// 1..=whole), then a read that appends one more message and waits forever, as a pull waits for
/// its broker until the epoch's deadline. Positions are the sequence read, one word.
fn register_stalling_source(registry: &mut Registry) {
    use flow_core::registry::SourceBuildContext;
    use flow_core::{
        Column, MessageId, ReadLimits, Source, SourceFactory, SourceOutput, SourceRead,
        StreamSchema, StreamType, Value,
    };
    struct Factory {
        whole: u64,
        schema: Arc<StreamSchema>,
    }
    struct Reader {
        whole: u64,
        sequence: u64,
    }
    impl SourceFactory for Factory {
        fn stream_id(&self) -> &str {
            "rows"
        }
        fn schema(&self) -> Arc<StreamSchema> {
            Arc::clone(&self.schema)
        }
        fn open_partition(
            &self,
            _partition: u32,
            position: Option<&[u8]>,
        ) -> Result<Box<dyn Source>, SourceError> {
            let sequence = position.map_or(0, |p| u64::from_be_bytes(p.try_into().unwrap()));
            Ok(Box::new(Reader {
                whole: self.whole,
                sequence,
            }))
        }
    }
    #[async_trait]
    impl Source for Reader {
        async fn read(
            &mut self,
            out: &mut SourceOutput<'_>,
            _limits: ReadLimits,
        ) -> Result<SourceRead, SourceError> {
            let stalls = self.sequence >= self.whole;
            self.sequence += 1;
            let mut row = out.batch.start_row(MessageId::new(0, self.sequence));
            row.push(Value::Uint(self.sequence)).unwrap();
            row.finish().unwrap();
            if stalls {
                std::future::pending::<()>().await;
            }
            Ok(SourceRead {
                position: self.sequence.to_be_bytes().to_vec(),
                exhausted: false,
                lag: None,
            })
        }
    }
    registry.register_source(
        "Stalls",
        Arc::new(
            |_ctx: &SourceBuildContext<'_>,
             parameters: &serde_yaml::Value|
             -> BuildResult<Arc<dyn SourceFactory>> {
                let whole = parameters["whole"].as_u64().unwrap();
                let schema =
                    StreamSchema::new(vec![Column::new("id", StreamType::Uint64)]).unwrap();
                Ok(Arc::new(Factory { whole, schema }))
            },
        ),
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stop_cuts_a_read_waiting_on_its_broker_and_commits_the_whole_reads_before_it() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("out.jsonl");
    let mut registry = Registry::with_builtins();
    register_stalling_source(&mut registry);
    // The epoch would wait a minute for the stalled read; the stop must not.
    let yaml = format!(
        "pipeline: {PIPELINE}\npartitions: 1\nepoch: {{max_messages: 1000, max_duration_ms: 60000}}\n\
         source: {{class: Stalls, parameters: {{whole: 7}}}}\n\
         sinks:\n  - {{name: out, sink_class_name: DebugSink, input_stream_ids: [rows], parameters: {{path: \"{}\"}}}}\n",
        out.display()
    );
    let store = open_store(&tmp.path().join("state"));
    let spec = PipelineSpec::from_yaml(&yaml).unwrap();
    let pipeline = Pipeline::new(registry.build(&spec).unwrap(), store.clone());
    let control = pipeline.control();
    let running = tokio::spawn(pipeline.run());
    tokio::time::sleep(Duration::from_millis(300)).await;
    let stopped_at = std::time::Instant::now();
    control.shutdown();
    let report = tokio::time::timeout(Duration::from_secs(5), running)
        .await
        .expect("the stop waited for the stalled read")
        .unwrap()
        .unwrap();
    assert!(
        stopped_at.elapsed() < Duration::from_secs(2),
        "{:?}",
        stopped_at.elapsed()
    );
    assert_eq!(report.partitions[0].end, PartitionEnd::Stopped);
    // The seven whole reads are committed and delivered; the message of the cut read is not.
    assert_eq!(position(&store, 0), Some(7));
    assert_eq!(sorted_ids(&read_lines(&out)), (1..=7).collect::<Vec<u64>>());
    store.close().unwrap();
}

/// A run that left batches pending (delivered 2 epochs of 10), then a spec that renames the sink
/// or changes its class: each is refused naming the sink, its pending batches and rows, and
/// nothing is read or delivered; the unchanged spec then delivers every id once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sink_renamed_or_of_another_class_with_pending_batches_refuses_the_start() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("out.jsonl");
    let state = tmp.path().join("state");
    let mut registry = Registry::with_builtins();
    register_wrapped_debug_sink(
        &mut registry,
        "CrashingDebugSink",
        Arc::new(|inner, _ctx| {
            Box::new(LosesDeliveries {
                inner,
                deliver_epochs: 2,
                committed: 0,
            })
        }),
    );
    let store = open_store(&state);
    let crashing = generator_yaml(2, 1000, 100, "CrashingDebugSink", &out);
    run_yaml(&registry, &crashing, &store).await.unwrap();
    assert_eq!(read_lines(&out).len(), 2 * 200);

    let renamed = crashing.replace("- name: out", "- name: events");
    let err = run_yaml(&delivering_registry(), &renamed, &store)
        .await
        .unwrap_err();
    assert_eq!(
        err.to_string(),
        "Refusing to start: sink `out` has 16 undelivered batch(es) (1600 rows) in the state \
         directory but is not in the spec (renamed or removed?); the source goes on from its \
         committed position, so they would never be sent. Run the previous spec, with the sink, \
         until `flow-worker status` shows nothing pending, or deliver them with `flow-worker \
         drain PREVIOUS_SPEC`; then start this spec"
    );
    let spec = PipelineSpec::from_yaml(&renamed).unwrap();
    let validated = delivering_registry().build(&spec).unwrap();
    let drain = Pipeline::new(validated, store.clone()).drain().await;
    assert!(
        matches!(drain, Err(RuntimeError::SinkRemoved { .. })),
        "{drain:?}"
    );

    let other_class = generator_yaml(2, 1000, 100, "DebugSink", &out);
    let err = run_yaml(&registry, &other_class, &store).await.unwrap_err();
    assert_eq!(
        err.to_string(),
        "Refusing to start: sink `out` is `DebugSink` in the spec, but its 16 undelivered \
         batch(es) (1600 rows) were sealed by `CrashingDebugSink`, the only class that delivers \
         them. Run the previous spec, with `CrashingDebugSink`, until `flow-worker status` shows \
         nothing pending, or deliver them with `flow-worker drain PREVIOUS_SPEC`; then change \
         the class"
    );
    assert_eq!(
        read_lines(&out).len(),
        2 * 200,
        "nothing delivered by a refused start"
    );
    for p in 0..2 {
        assert_eq!(undelivered_rows(&store, "out", p).len(), 8);
    }

    // The unchanged spec delivers them; then the class may change.
    let report = run_yaml(&delivering_registry(), &crashing, &store)
        .await
        .unwrap();
    assert_eq!(report.messages(), 0);
    assert_each_id_once(&out, 2000);
    run_yaml(&registry, &other_class, &store).await.unwrap();
    store.close().unwrap();
}

/// Forwards everything but never finishes a drain: a sink whose target refuses every INSERT
/// for as long as the run lasts.
struct NeverDrains {
    inner: Box<dyn Sink>,
}

#[async_trait]
impl Sink for NeverDrains {
    async fn write_epoch(&mut self, epoch: &Epoch<'_>) -> Result<EpochOutcome, SinkError> {
        self.inner.write_epoch(epoch).await
    }
    async fn open(&mut self) -> Result<(), SinkError> {
        self.inner.open().await
    }
    async fn committed(&mut self, _batches: Vec<(u64, SealedBatch)>) -> Result<(), SinkError> {
        Ok(())
    }
    async fn drain(&mut self) -> Result<(), SinkError> {
        std::future::pending().await
    }
    async fn close(&mut self) -> Result<(), SinkError> {
        self.inner.close().await
    }
}

/// Issue 46 item 8: a stop while the sinks deliver the last epochs of a used-up source ends
/// within `shutdown.drain_timeout_ms`, as a stop, with the batches kept (on `acbb5bf` the run
/// waited for the delivery for ever; only a second signal ended it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stop_while_the_last_epochs_are_delivered_ends_within_the_drain_timeout() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("out.jsonl");
    let mut registry = Registry::with_builtins();
    register_wrapped_debug_sink(
        &mut registry,
        "NeverDrainingSink",
        Arc::new(|inner, _ctx| Box::new(NeverDrains { inner })),
    );
    let yaml = format!(
        "pipeline: {PIPELINE}\npartitions: 1\nepoch: {{max_messages: 100, max_duration_ms: 1000}}\n\
         shutdown: {{drain_timeout_ms: 300}}\n\
         source: {{class: generator, parameters: {{count: 500}}}}\n\
         sinks:\n  - {{name: out, sink_class_name: NeverDrainingSink, input_stream_ids: [rows], parameters: {{path: \"{}\"}}}}\n",
        out.display()
    );
    let store = open_store(&tmp.path().join("state"));
    let spec = PipelineSpec::from_yaml(&yaml).unwrap();
    let pipeline = Pipeline::new(registry.build(&spec).unwrap(), store.clone());
    let control = pipeline.control();
    let running = tokio::spawn(pipeline.run());
    // The source is used up at once; the partition then waits in the sink's drain.
    while position(&store, 0) != Some(500) {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(
        !running.is_finished(),
        "the drain never ends, so neither may the run"
    );
    control.shutdown();
    let report = tokio::time::timeout(Duration::from_secs(5), running)
        .await
        .expect("the stop ended the run within its drain timeout")
        .unwrap()
        .unwrap();
    assert_eq!(report.partitions[0].end, PartitionEnd::Stopped);
    assert_eq!(
        undelivered_rows(&store, "out", 0).len(),
        5,
        "every batch kept"
    );
    store.close().unwrap();
}
