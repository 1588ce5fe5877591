//! `Pipeline::run_owned`: only the partitions a cluster grants run, a partition assigned elsewhere
//! stops and gives its lease back, and a partition granted later starts from what was committed.
//! The cluster here is an in-memory set of leases; the ZooKeeper one is tested in `integration/`.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use flow_core::{LeaseError, PartitionEnd, PartitionLeases, Pipeline, PipelineSpec, Registry};
use flow_state::StateStore;
use tokio::sync::watch;

/// Leases granted at once, with a log of what the coordinator asked for.
struct MemoryLeases {
    assigned: watch::Sender<BTreeSet<u32>>,
    held: Mutex<BTreeSet<u32>>,
    log: Mutex<Vec<String>>,
}

impl MemoryLeases {
    fn new(assigned: &[u32]) -> Arc<MemoryLeases> {
        Arc::new(MemoryLeases {
            assigned: watch::channel(assigned.iter().copied().collect()).0,
            held: Mutex::new(BTreeSet::new()),
            log: Mutex::new(Vec::new()),
        })
    }

    fn log(&self) -> Vec<String> {
        self.log.lock().unwrap().clone()
    }
}

#[async_trait]
impl PartitionLeases for MemoryLeases {
    fn assigned(&self) -> watch::Receiver<BTreeSet<u32>> {
        self.assigned.subscribe()
    }

    async fn acquire(
        &self,
        partition: u32,
        _cancel: watch::Receiver<bool>,
    ) -> Result<(), LeaseError> {
        self.held.lock().unwrap().insert(partition);
        self.log
            .lock()
            .unwrap()
            .push(format!("acquire {partition}"));
        Ok(())
    }

    async fn holds(&self, partition: u32) -> bool {
        self.held.lock().unwrap().contains(&partition)
    }

    async fn release(&self, partition: u32) {
        if self.held.lock().unwrap().remove(&partition) {
            self.log
                .lock()
                .unwrap()
                .push(format!("release {partition}"));
        }
    }
}

fn spec(partitions: u32, count: u64, rate: u64, out: &Path) -> PipelineSpec {
    PipelineSpec::from_yaml(&format!(
        r#"
pipeline: owned
partitions: {partitions}
epoch: {{max_messages: 50, max_duration_ms: 20}}
source: {{class: generator, parameters: {{count: {count}, rate_per_second: {rate}}}}}
sinks:
  - {{name: out, sink_class_name: DebugSink, input_stream_ids: [rows], parameters: {{path: "{}"}}}}
"#,
        out.display()
    ))
    .unwrap()
}

/// How many times each message id is in the DebugSink's file, by partition.
fn ids_by_partition(out: &Path) -> BTreeMap<u32, BTreeMap<String, u32>> {
    let text = std::fs::read_to_string(out).unwrap_or_default();
    let mut found: BTreeMap<u32, BTreeMap<String, u32>> = BTreeMap::new();
    for line in text.lines() {
        let value: serde_json::Value = serde_json::from_str(line).unwrap();
        let id = value["message_id"].as_str().unwrap().to_owned();
        let partition: u32 = id.split('-').next().unwrap().parse().unwrap();
        *found.entry(partition).or_default().entry(id).or_default() += 1;
    }
    found
}

async fn wait_for(what: &str, mut done: impl FnMut() -> bool) {
    let started = std::time::Instant::now();
    while !done() {
        assert!(
            started.elapsed() < Duration::from_secs(20),
            "timed out waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_the_granted_partitions_run_and_each_lease_is_given_back_after_its_runner_ended() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("out.jsonl");
    let store = StateStore::open(&tmp.path().join("state")).unwrap();
    let registry = Registry::with_builtins();
    let pipeline = Pipeline::new(
        registry.build(&spec(4, 100, 0, &out)).unwrap(),
        store.clone(),
    );
    let control = pipeline.control();
    let leases = MemoryLeases::new(&[1, 3]);
    let running = tokio::spawn(pipeline.run_owned(leases.clone()));

    let delivered = || {
        ids_by_partition(&out)
            .values()
            .map(|ids| ids.len())
            .sum::<usize>()
    };
    wait_for("200 rows", || delivered() == 200).await;
    control.shutdown();
    let report = running.await.unwrap().unwrap();

    let ran: Vec<(u32, PartitionEnd, u64)> = report
        .partitions
        .iter()
        .map(|p| (p.partition, p.end, p.messages))
        .collect();
    assert_eq!(
        ran,
        vec![
            (1, PartitionEnd::Drained, 100),
            (3, PartitionEnd::Drained, 100)
        ]
    );
    let found = ids_by_partition(&out);
    assert_eq!(found.keys().copied().collect::<Vec<_>>(), vec![1, 3]);
    assert!(found
        .values()
        .all(|ids| ids.len() == 100 && ids.values().all(|n| *n == 1)));
    let mut log = leases.log();
    log.sort();
    assert_eq!(
        log,
        vec!["acquire 1", "acquire 3", "release 1", "release 3"]
    );
    store.close().unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_partition_assigned_elsewhere_stops_gives_its_lease_back_and_resumes_where_it_committed()
{
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("out.jsonl");
    let store = StateStore::open(&tmp.path().join("state")).unwrap();
    let registry = Registry::with_builtins();
    // 2,000 rows/s: partition 0 is still running when it is taken away.
    let pipeline = Pipeline::new(
        registry.build(&spec(2, 1000, 2000, &out)).unwrap(),
        store.clone(),
    );
    let control = pipeline.control();
    let leases = MemoryLeases::new(&[0]);
    let running = tokio::spawn(pipeline.run_owned(leases.clone()));

    let rows_of = |p: u32| ids_by_partition(&out).get(&p).map_or(0, |ids| ids.len());
    wait_for("partition 0 under way", || rows_of(0) >= 100).await;
    leases.assigned.send_replace([1].into());
    wait_for("partition 0 given back", || {
        leases.log().contains(&"release 0".to_owned())
    })
    .await;
    let stopped_at = rows_of(0);
    assert!(
        stopped_at < 1000,
        "partition 0 ran to its end ({stopped_at} rows) instead of stopping"
    );
    wait_for("partition 1 done", || rows_of(1) == 1000).await;
    // Granted again, partition 0 goes on from its committed position: every id once.
    leases.assigned.send_replace([0, 1].into());
    wait_for("partition 0 done", || rows_of(0) == 1000).await;
    control.shutdown();
    let report = running.await.unwrap().unwrap();

    let found = ids_by_partition(&out);
    assert!(found
        .values()
        .all(|ids| ids.len() == 1000 && ids.values().all(|n| *n == 1)));
    let ends: Vec<(u32, PartitionEnd)> = report
        .partitions
        .iter()
        .map(|p| (p.partition, p.end))
        .collect();
    assert_eq!(
        ends,
        vec![
            (0, PartitionEnd::Stopped),
            (0, PartitionEnd::Drained),
            (1, PartitionEnd::Drained)
        ]
    );
    let log = leases.log();
    let mut sorted = log.clone();
    sorted.sort();
    assert_eq!(
        sorted,
        [
            "acquire 0",
            "acquire 0",
            "acquire 1",
            "release 0",
            "release 0",
            "release 1"
        ]
    );
    // The lease of partition 0 was given back before it was asked for again.
    let at = |entry: &str, nth: usize| {
        log.iter()
            .enumerate()
            .filter(|(_, e)| *e == entry)
            .nth(nth)
            .unwrap()
            .0
    };
    assert!(at("acquire 0", 0) < at("release 0", 0) && at("release 0", 0) < at("acquire 0", 1));
    store.close().unwrap();
}
