//! Throughput of the exactly-once path against a hand-written `clickhouse::Inserter` loop on the
//! same rows, on the local cluster (`scripts/cluster.sh up`).
//!
//! `cargo bench -p flow-clickhouse --bench exactly_once_vs_inserter`. Both write the generator's
//! rows to node a1 of a fresh ReplicatedMergeTree table with lz4; flow goes through epochs, the
//! sled outbox (fsync per commit group) and ordered delivery. Each timed run starts on a quiet
//! server (no merge or replication pending on a1 and a2). Prints rows/s of each, their ratio and
//! the process's peak resident memory.
//!
//! Environment: `FLOW_BENCH_ROWS` (default 2,000,000), `FLOW_BENCH_PARTITIONS` (2),
//! `FLOW_BENCH_BATCH` (100,000), `FLOW_BENCH_REPETITIONS` (5, alternating, medians reported);
//! `FLOW_BENCH_ONLY=flow|inserter` runs one side alone (for profiling); `FLOW_BENCH_NO_FSYNC=1`
//! opens the outbox without fsync, to show what durability costs.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Instant;

use flow_core::sources::generator::{fill_payload, row_values};
use flow_core::{Pipeline, PipelineSpec, Registry};
use flow_state::StateStore;

#[derive(clickhouse::Row, serde::Serialize)]
struct GeneratorRow<'a> {
    id: u64,
    partition: u32,
    offset: u64,
    user_id: u64,
    ts: u32,
    payload: &'a [u8],
}

const A1: &str = "http://127.0.0.1:18123";
const A2: &str = "http://127.0.0.1:18124";

async fn exec(url: &str, sql: &str) {
    clickhouse::Client::default()
        .with_url(url)
        .with_validation(false)
        .query(sql)
        .execute()
        .await
        .unwrap_or_else(|e| {
            panic!("`{sql}` on {url}: {e} (is the cluster up? scripts/cluster.sh up)")
        });
}

async fn fetch_u64(url: &str, sql: &str) -> u64 {
    clickhouse::Client::default()
        .with_url(url)
        .with_validation(false)
        .query(sql)
        .fetch_one::<u64>()
        .await
        .unwrap_or_else(|e| panic!("`{sql}` on {url}: {e}"))
}

/// Drops both benchmark tables and waits (up to 60 s) until neither replica merges or fetches
/// anything: each timed run starts on a quiet server, not while the previous run's parts are
/// still being merged and replicated on the same two cores.
async fn settle() {
    for name in ["bench_inserter", "bench_flow"] {
        for url in [A1, A2] {
            exec(url, &format!("DROP TABLE IF EXISTS default.{name}")).await;
        }
    }
    let deadline = Instant::now() + std::time::Duration::from_secs(60);
    while Instant::now() < deadline {
        let mut busy = 0;
        for url in [A1, A2] {
            busy += fetch_u64(url, "SELECT count() FROM system.merges").await;
            busy += fetch_u64(url, "SELECT count() FROM system.replication_queue").await;
        }
        if busy == 0 {
            return;
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
}

async fn fresh_table(name: &str) {
    settle().await;
    for url in [A1, A2] {
        exec(url, &format!("CREATE TABLE default.{name} (id UInt64, partition UInt32, offset UInt64, user_id UInt64, ts DateTime, payload String) ENGINE = ReplicatedMergeTree('/clickhouse/tables/{{shard}}/default.{name}', '{{replica}}') ORDER BY id")).await;
    }
}

async fn count(name: &str) -> u64 {
    fetch_u64(A1, &format!("SELECT count() FROM default.{name}")).await
}

async fn inserter_loop(rows: u64, partitions: u32, batch: u64) -> f64 {
    fresh_table("bench_inserter").await;
    let client = clickhouse::Client::default()
        .with_url(A1)
        .with_validation(false)
        .with_compression(clickhouse::Compression::Lz4);
    let mut inserter = client
        .inserter::<GeneratorRow<'_>>("bench_inserter")
        .with_max_rows(batch);
    let per_partition = rows / u64::from(partitions);
    let mut payload = Vec::with_capacity(16);
    let started = Instant::now();
    for offset in 0..per_partition {
        for partition in 0..partitions {
            let (id, user_id, ts) = row_values(partition, offset, partitions);
            fill_payload(id, 16, &mut payload);
            inserter
                .write(&GeneratorRow {
                    id,
                    partition,
                    offset,
                    user_id,
                    ts: ts as u32,
                    payload: &payload,
                })
                .await
                .unwrap();
            inserter.commit().await.unwrap();
        }
    }
    inserter.end().await.unwrap();
    let seconds = started.elapsed().as_secs_f64();
    assert_eq!(
        count("bench_inserter").await,
        per_partition * u64::from(partitions)
    );
    seconds
}

async fn flow_pipeline(rows: u64, partitions: u32, batch: u64) -> f64 {
    fresh_table("bench_flow").await;
    let state = tempfile::tempdir().unwrap();
    let spec = format!(
        "pipeline: bench\npartitions: {partitions}\nepoch: {{max_messages: {batch}, max_duration_ms: 2000}}\nsource:\n  class: generator\n  parameters: {{count: {}, payload_bytes: 16}}\nsinks:\n  - name: ch\n    sink_class_name: ClickHouseBatchingSink\n    input_stream_ids: [rows]\n    parameters: {{host: '127.0.0.1:18123', table: bench_flow}}\n    dynamic_parameters: {{max_rows_per_batch: {batch}, max_bytes_per_batch: 268435456}}\n",
        rows / u64::from(partitions)
    );
    let mut registry = Registry::with_builtins();
    flow_clickhouse::register(&mut registry);
    let pipeline = registry
        .build(&PipelineSpec::from_yaml(&spec).unwrap())
        .unwrap();
    let store = if std::env::var_os("FLOW_BENCH_NO_FSYNC").is_some() {
        StateStore::open_with(
            state.path(),
            flow_state::StoreOptions {
                fsync: false,
                ..Default::default()
            },
        )
        .unwrap()
    } else {
        StateStore::open(state.path()).unwrap()
    };
    let started = Instant::now();
    let report = Pipeline::new(pipeline, store.clone()).run().await.unwrap();
    let seconds = started.elapsed().as_secs_f64();
    assert_eq!(report.messages(), rows);
    assert_eq!(count("bench_flow").await, rows);
    seconds
}

fn peak_rss_mib() -> f64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmHWM:"))
                .and_then(|l| l.split_whitespace().nth(1)?.parse::<f64>().ok())
        })
        .map_or(0.0, |kib| kib / 1024.0)
}

fn main() {
    let env = |name: &str, default: u64| {
        std::env::var(name)
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or(default)
    };
    let partitions = env("FLOW_BENCH_PARTITIONS", 2) as u32;
    let batch = env("FLOW_BENCH_BATCH", 100_000);
    let rows = env("FLOW_BENCH_ROWS", 2_000_000);
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    let repetitions = env("FLOW_BENCH_REPETITIONS", 5);
    runtime.block_on(async {
        // Alternate the two so that drift on a shared machine hits both alike; report medians.
        let (mut flow_times, mut baseline_times) = (Vec::new(), Vec::new());
        // FLOW_BENCH_ONLY=flow|inserter runs one side alone (for profiling); no ratio then.
        let only = std::env::var("FLOW_BENCH_ONLY").unwrap_or_default();
        for _ in 0..repetitions {
            if only != "inserter" {
                flow_times.push(flow_pipeline(rows, partitions, batch).await);
            }
            if only != "flow" {
                baseline_times.push(inserter_loop(rows, partitions, batch).await);
            }
        }
        if !only.is_empty() {
            println!("{only} only: {flow_times:.2?} {baseline_times:.2?} s");
            return;
        }
        let median = |times: &mut Vec<f64>| {
            times.sort_by(f64::total_cmp);
            times[times.len() / 2]
        };
        let flow = median(&mut flow_times);
        let baseline = median(&mut baseline_times);
        let flow_rate = rows as f64 / flow;
        let baseline_rate = rows as f64 / baseline;
        println!("rows: {rows}, batch: {batch}, partitions: {partitions}, repetitions: {repetitions} (medians)");
        println!("clickhouse::Inserter loop: {baseline:.2} s, {baseline_rate:.0} rows/s  {baseline_times:.2?}");
        println!("flow exactly-once:         {flow:.2} s, {flow_rate:.0} rows/s  {flow_times:.2?}");
        println!("ratio flow / inserter:     {:.2}", flow_rate / baseline_rate);
        println!("peak RSS of the process:   {:.0} MiB", peak_rss_mib());
        for name in ["bench_inserter", "bench_flow"] {
            for url in [A1, A2] {
                exec(url, &format!("DROP TABLE IF EXISTS default.{name}")).await;
            }
        }
    });
}
