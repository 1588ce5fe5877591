//! The push source in real pipelines: a state store in a temp dir and the `DebugSink` (an
//! outbox sink) writing to a temp file. Receipts resolve committed, then delivered; a stop
//! resolves the others with the error that tells the application what to do; a restart on the
//! same state directory delivers what was committed exactly once and continues the ids.

// Tests may unwrap; clippy's `allow-*-in-tests` does not cover helper functions.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use flow_core::registry::{BuildResult, SinkBuildContext};
use flow_core::{
    Column, Epoch, EpochOutcome, EpochWrite, MessageId, PartitionEnd, Pipeline, PushError,
    PushHandle, PushOptions, PushSource, Receipt, Registry, Route, RunReport, RuntimeError, Sink,
    SinkContext, SinkError, SinkFactory, StreamSchema, StreamType, Value,
};
use flow_state::{SinkPartition, StateStore};
use tokio::task::JoinHandle;

const PIPELINE: &str = "push";

fn schema() -> Arc<StreamSchema> {
    StreamSchema::new(vec![
        Column::new("event_id", StreamType::Uint64),
        Column::new("name", StreamType::Utf8),
    ])
    .unwrap()
}

fn spec(partitions: u32, sink_class: &str, out: &Path) -> String {
    format!(
        r#"
pipeline: {PIPELINE}
partitions: {partitions}
epoch: {{max_messages: 10000, max_duration_ms: 50}}
shutdown: {{drain_timeout_ms: 2000}}
source:
  class: app_events
sinks:
  - name: out
    sink_class_name: {sink_class}
    input_stream_ids: [events]
    parameters: {{path: "{}"}}
"#,
        out.display()
    )
}

/// A registry with the builtins, a vetoing sink class and a new push source as `app_events`.
fn registry_with_push() -> (Registry, PushHandle) {
    let (source, handle) = PushSource::new("events", schema(), PushOptions::default());
    let mut registry = Registry::with_builtins();
    source.register(&mut registry, "app_events");
    registry.register_sink("VetoSink", Arc::new(build_veto_sink));
    registry.register_sink("PanicSink", Arc::new(build_panic_sink));
    registry.register_sink("NullSink", Arc::new(build_null_sink));
    (registry, handle)
}

struct Running {
    control: flow_core::PipelineControl,
    task: JoinHandle<Result<RunReport, RuntimeError>>,
}

fn start(registry: &Registry, yaml: &str, store: &StateStore) -> Running {
    let validated = registry.build_yaml(yaml).unwrap_or_else(|e| panic!("{e}"));
    let pipeline = Pipeline::new(validated, store.clone());
    let control = pipeline.control();
    Running {
        control,
        task: tokio::spawn(pipeline.run()),
    }
}

impl Running {
    async fn stop(self) -> Result<RunReport, RuntimeError> {
        self.control.shutdown();
        tokio::time::timeout(Duration::from_secs(30), self.task)
            .await
            .expect("the pipeline stops within 30 s")
            .expect("the run task does not panic")
    }
}

async fn send_events(handle: &PushHandle, ids: std::ops::Range<u64>) -> Vec<Receipt> {
    let mut receipts = Vec::new();
    for id in ids {
        let name = format!("event-{id}");
        let receipt = handle
            .send(
                Route::KeyU64(id),
                &[Value::Uint(id), Value::Bytes(name.as_bytes())],
            )
            .await
            .unwrap_or_else(|e| panic!("send {id}: {e}"));
        receipts.push(receipt);
    }
    receipts
}

async fn within<T>(what: &str, future: impl std::future::Future<Output = T>) -> T {
    tokio::time::timeout(Duration::from_secs(30), future)
        .await
        .unwrap_or_else(|_| panic!("{what} within 30 s"))
}

/// `(message_id, event_id)` of every line the DebugSink wrote, in file order.
fn lines(path: &Path) -> Vec<(String, u64)> {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    text.lines()
        .map(|line| {
            let json: serde_json::Value = serde_json::from_str(line).unwrap();
            (
                json["message_id"].as_str().unwrap().to_owned(),
                json["row"]["event_id"].as_u64().unwrap(),
            )
        })
        .collect()
}

fn sorted_event_ids(path: &Path) -> Vec<u64> {
    let mut ids: Vec<u64> = lines(path).into_iter().map(|(_, id)| id).collect();
    ids.sort_unstable();
    ids
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn receipts_resolve_committed_then_delivered_and_the_file_holds_each_row_once() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out.jsonl");
    let store = StateStore::open(&dir.path().join("state")).unwrap();
    let (registry, handle) = registry_with_push();
    let running = start(&registry, &spec(2, "DebugSink", &out), &store);

    const N: u64 = 500;
    let receipts = send_events(&handle, 0..N).await;
    let mut ids = Vec::new();
    for receipt in &receipts {
        ids.push(within("committed", receipt.committed()).await.unwrap());
    }
    for (receipt, id) in receipts.iter().zip(&ids) {
        assert_eq!(within("delivered", receipt.delivered()).await, Ok(*id));
        assert_eq!(id.partition, receipt.partition());
    }
    // Delivered means the sink holds it: every row is in the file before the stop.
    assert_eq!(sorted_event_ids(&out), (0..N).collect::<Vec<_>>());
    let mut unique: Vec<MessageId> = ids.clone();
    unique.sort_unstable();
    unique.dedup();
    assert_eq!(unique.len() as u64, N, "message ids are unique");
    let written: std::collections::BTreeSet<String> =
        lines(&out).into_iter().map(|(id, _)| id).collect();
    let expected: std::collections::BTreeSet<String> =
        ids.iter().map(ToString::to_string).collect();
    assert_eq!(written, expected, "the file has the ids the receipts gave");

    let report = running.stop().await.unwrap();
    assert!(report
        .partitions
        .iter()
        .all(|p| p.end == PartitionEnd::Stopped));
    assert_eq!(report.messages(), N);
    for partition in 0..2 {
        let refused = handle
            .send(
                Route::Partition(partition),
                &[Value::Uint(0), Value::Bytes(b"x")],
            )
            .await;
        assert_eq!(
            refused.err(),
            Some(PushError::Stopped {
                partition,
                reason: "the pipeline was stopped".to_owned()
            })
        );
    }
    assert_eq!(lines(&out).len() as u64, N);
    store.close().unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_read_but_never_committed_resolves_not_committed_at_the_stop() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out.jsonl");
    let store = StateStore::open(&dir.path().join("state")).unwrap();
    let (registry, handle) = registry_with_push();
    let running = start(&registry, &spec(1, "VetoSink", &out), &store);

    let receipts = send_events(&handle, 0..3).await;
    // Several epochs read the messages and are vetoed.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let report = running.stop().await.unwrap();
    assert_eq!(report.partitions[0].epochs_committed, 0);
    assert!(report.partitions[0].vetoes >= 2, "{report:?}");
    let stopped = "the pipeline was stopped".to_owned();
    for receipt in &receipts {
        let expected = PushError::NotCommitted {
            partition: 0,
            reason: stopped.clone(),
        };
        assert_eq!(receipt.committed().await, Err(expected.clone()));
        assert_eq!(receipt.delivered().await, Err(expected));
    }
    assert_eq!(
        handle
            .send(Route::Partition(0), &[Value::Uint(9), Value::Bytes(b"x")])
            .await
            .err(),
        Some(PushError::Stopped {
            partition: 0,
            reason: stopped
        })
    );
    assert_eq!(store.position(PIPELINE, 0).unwrap(), None);
    store.close().unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restart_delivers_the_committed_messages_once_and_continues_the_ids() {
    let dir = tempfile::tempdir().unwrap();
    let out_dir = dir.path().join("out");
    let out = out_dir.join("out.jsonl");
    let state = dir.path().join("state");
    const N: u64 = 40;
    const M: u64 = 25;

    // Run 1: the output directory is missing, so the sink delivers nothing; the messages are
    // committed (stored with their payloads) and their delivery fails at the stop.
    let store = StateStore::open(&state).unwrap();
    let (registry, handle) = registry_with_push();
    let yaml = spec(1, "DebugSink", &out);
    let validated = registry.build_yaml(&yaml).unwrap();
    // Sent before the run: one epoch reads all of them.
    let receipts = send_events(&handle, 0..N).await;
    let pipeline = Pipeline::new(validated, store.clone());
    let running = Running {
        control: pipeline.control(),
        task: tokio::spawn(pipeline.run()),
    };
    for (seq, receipt) in receipts.iter().enumerate() {
        let id = within("committed", receipt.committed()).await.unwrap();
        assert_eq!(id, MessageId::new(0, seq as u64));
    }
    // Committed is not delivered: the sink acknowledges nothing, so the receipt waits.
    let waiting = tokio::time::timeout(Duration::from_millis(500), receipts[0].delivered()).await;
    assert!(waiting.is_err(), "{waiting:?}");
    let _ = running.stop().await;
    for receipt in &receipts {
        let delivered = receipt.delivered().await;
        assert!(
            matches!(delivered, Err(PushError::NotDelivered { .. })),
            "{delivered:?}"
        );
    }
    let key = SinkPartition::new(PIPELINE, "out", 0);
    let pending: u64 = store
        .undelivered(&key)
        .unwrap()
        .iter()
        .map(|b| b.batch.rows)
        .sum();
    assert_eq!(pending, N);
    assert_eq!(
        store.position(PIPELINE, 0).unwrap(),
        Some(N.to_be_bytes().to_vec())
    );
    store.close().unwrap();

    // Run 2 on the same state directory, with a new push source.
    std::fs::create_dir(&out_dir).unwrap();
    let store = open_store(&state);
    let (registry, handle) = registry_with_push();
    let running = start(&registry, &yaml, &store);
    let receipts = send_events(&handle, N..N + M).await;
    for (index, receipt) in receipts.iter().enumerate() {
        let id = within("delivered", receipt.delivered()).await.unwrap();
        assert_eq!(
            id,
            MessageId::new(0, N + index as u64),
            "ids continue after the committed seq"
        );
    }
    handle.finish();
    let report = within("drained", running.task).await.unwrap().unwrap();
    assert_eq!(report.partitions[0].end, PartitionEnd::Drained);
    assert_eq!(sorted_event_ids(&out), (0..N + M).collect::<Vec<_>>());
    let mut ids: Vec<String> = lines(&out).into_iter().map(|(id, _)| id).collect();
    ids.sort_by_key(|id| id.parse::<MessageId>().unwrap());
    let expected: Vec<String> = (0..N + M).map(|seq| format!("0-{seq}")).collect();
    assert_eq!(ids, expected);
    assert!(store.undelivered(&key).unwrap().is_empty());
    store.close().unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_that_cannot_start_fails_the_receipts_it_holds() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out.jsonl");
    let store = StateStore::open(&dir.path().join("state")).unwrap();
    store.claim("another", 1).unwrap();
    let (registry, handle) = registry_with_push();
    let validated = registry.build_yaml(&spec(1, "DebugSink", &out)).unwrap();
    let receipt = send_events(&handle, 0..1).await.remove(0);
    let run = Pipeline::new(validated, store.clone()).run().await;
    assert!(
        matches!(run, Err(RuntimeError::OtherPipeline(_))),
        "{run:?}"
    );
    let committed = receipt.committed().await;
    assert!(
        matches!(&committed, Err(PushError::NotCommitted { partition: 0, reason }) if reason.starts_with("the pipeline failed: ")),
        "{committed:?}"
    );
    store.close().unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sink_without_an_outbox_counts_as_delivered_once_the_epoch_commits() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out.jsonl");
    let store = StateStore::open(&dir.path().join("state")).unwrap();
    let (registry, handle) = registry_with_push();
    let running = start(&registry, &spec(2, "NullSink", &out), &store);
    let receipts = send_events(&handle, 0..50).await;
    for receipt in &receipts {
        let committed = within("committed", receipt.committed()).await.unwrap();
        assert_eq!(
            within("delivered", receipt.delivered()).await,
            Ok(committed)
        );
    }
    let report = running.stop().await.unwrap();
    assert_eq!(report.messages(), 50);
    store.close().unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_partition_task_that_panics_still_fails_the_receipts_it_holds() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out.jsonl");
    let store = StateStore::open(&dir.path().join("state")).unwrap();
    let (registry, handle) = registry_with_push();
    let running = start(&registry, &spec(1, "PanicSink", &out), &store);
    let receipt = send_events(&handle, 0..1).await.remove(0);
    let committed = within("not committed", receipt.committed()).await;
    assert_eq!(
        committed,
        Err(PushError::NotCommitted {
            partition: 0,
            reason: "the pipeline failed: partition 0: task failed: the partition task ended without a report (it panicked or was cancelled)".to_owned()
        })
    );
    let run = within("run", running.task).await.unwrap();
    assert!(
        matches!(run, Err(RuntimeError::PartitionsFailed(_))),
        "{run:?}"
    );
    store.close().unwrap();
}

/// Opens the store, waiting a little if a store on `dir` closed a moment ago (sled may still
/// hold its file lock from a background write of the previous handle).
fn open_store(dir: &Path) -> StateStore {
    let started = std::time::Instant::now();
    loop {
        match StateStore::open(dir) {
            Ok(store) => return store,
            Err(flow_state::StateError::Locked { .. })
                if started.elapsed() < Duration::from_secs(5) =>
            {
                std::thread::sleep(Duration::from_millis(20));
            }
            Err(err) => panic!("open state store `{}`: {err:?}", dir.display()),
        }
    }
}

/// A sink that vetoes every epoch.
fn build_veto_sink(
    _: &SinkBuildContext<'_>,
    _: &serde_yaml::Value,
    _: &serde_yaml::Value,
) -> BuildResult<Arc<dyn SinkFactory>> {
    Ok(Arc::new(VetoFactory))
}

struct VetoFactory;

impl SinkFactory for VetoFactory {
    fn create(&self, _: SinkContext) -> Result<Box<dyn Sink>, SinkError> {
        Ok(Box::new(VetoSink))
    }
}

struct VetoSink;

#[async_trait]
impl Sink for VetoSink {
    async fn write_epoch(&mut self, _: &Epoch<'_>) -> Result<EpochOutcome, SinkError> {
        Ok(EpochOutcome::Veto {
            reason: "always".to_owned(),
            retry_after: Duration::from_millis(20),
        })
    }
}

/// A sink that panics in its first epoch.
fn build_panic_sink(
    _: &SinkBuildContext<'_>,
    _: &serde_yaml::Value,
    _: &serde_yaml::Value,
) -> BuildResult<Arc<dyn SinkFactory>> {
    Ok(Arc::new(PanicFactory))
}

struct PanicFactory;

impl SinkFactory for PanicFactory {
    fn create(&self, _: SinkContext) -> Result<Box<dyn Sink>, SinkError> {
        Ok(Box::new(PanicSink))
    }
}

struct PanicSink;

#[async_trait]
impl Sink for PanicSink {
    async fn write_epoch(&mut self, epoch: &Epoch<'_>) -> Result<EpochOutcome, SinkError> {
        assert!(epoch.inputs[0].is_empty(), "a message: this sink panics");
        Ok(EpochOutcome::Commit(EpochWrite::default()))
    }
}

/// A sink that seals nothing (as one that delivers within its epoch).
fn build_null_sink(
    _: &SinkBuildContext<'_>,
    _: &serde_yaml::Value,
    _: &serde_yaml::Value,
) -> BuildResult<Arc<dyn SinkFactory>> {
    Ok(Arc::new(NullFactory))
}

struct NullFactory;

impl SinkFactory for NullFactory {
    fn create(&self, _: SinkContext) -> Result<Box<dyn Sink>, SinkError> {
        Ok(Box::new(NullSink))
    }
}

struct NullSink;

#[async_trait]
impl Sink for NullSink {
    async fn write_epoch(&mut self, _: &Epoch<'_>) -> Result<EpochOutcome, SinkError> {
        Ok(EpochOutcome::Commit(EpochWrite::default()))
    }
}
