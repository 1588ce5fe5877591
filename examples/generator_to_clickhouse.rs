//! The generator into ClickHouse, exactly once, from a Rust program: `flow::config` builds the
//! spec, `flow::registry()` knows every built-in plugin, `flow::PipelineHandle` runs the pipeline
//! on this program's runtime.
//!
//! `cargo run -p flow-examples --example generator_to_clickhouse -- [TABLE] [HOST,HOST...]`
//! (or `FLOW_EXAMPLE_TABLE`, `FLOW_EXAMPLE_HOSTS`; default `generator_example` on the replicas
//! of shard `a` of the local cluster, `scripts/cluster.sh up`). The table is created if missing.

use anyhow::{ensure, Context};
use flow::config::{ClickHouseSink, EpochSpec, GeneratorParams};
use flow_examples::ExampleTable;

const PARTITIONS: u32 = 4;
const PER_PARTITION: u64 = 2500;

#[tokio::main]
pub async fn main() -> anyhow::Result<()> {
    let target = ExampleTable::from_args("generator_example");
    target
        .create("id UInt64, partition UInt32, offset UInt64, user_id UInt64, ts DateTime, payload String")
        .await?;

    // The spec a worker reads from YAML (`flow-worker run`), here built in code: the same
    // validated model, and a mistake in the sink is a `ConfigError` with its path right here.
    let sink = ClickHouseSink::exactly_once()
        .hosts(&target.hosts)
        .table(&target.table)
        .max_rows_per_batch(1000)
        .build()?;
    let spec = flow::PipelineSpec::builder("generator-example")
        .partitions(PARTITIONS)
        .epoch(EpochSpec {
            max_messages: 1000,
            max_duration_ms: 500,
        })
        .source(GeneratorParams::new(PER_PARTITION))
        .sink("events", ["rows"], sink)
        .build();
    // The outbox: what is committed but not yet in ClickHouse survives a crash here.
    let state = tempfile::tempdir().context("creating the state directory")?;
    let options = flow::StartOptions::new(state.path()).registry(flow::registry());
    let mut pipeline = flow::PipelineHandle::start(spec, options).await?;
    // A finite source: `wait` returns once every message is delivered. An endless one would
    // run until `pipeline.stop(timeout)`, which stops it as SIGTERM stops the worker.
    let report = pipeline.wait().await?;

    let expected = u64::from(PARTITIONS) * PER_PARTITION;
    ensure!(report.messages() == expected, "{report:?}");
    let delivered = pipeline.counters()?.rows_delivered("events");
    ensure!(delivered == expected, "the sink delivered {delivered} rows");
    let status = pipeline.status().await?;
    let pending: u64 = status.pipelines["generator-example"]
        .sinks
        .iter()
        .map(|s| s.undelivered)
        .sum();
    ensure!(pending == 0, "{pending} batches still pending");
    target.check_rows(expected).await
}
