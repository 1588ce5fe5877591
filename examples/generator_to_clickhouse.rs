//! The generator into ClickHouse, exactly once, from a Rust program: `flow::registry()` knows
//! every built-in plugin, `flow::PipelineHandle` runs the pipeline on this program's runtime.
//!
//! `cargo run -p flow-examples --example generator_to_clickhouse -- [TABLE] [HOST,HOST...]`
//! (or `FLOW_EXAMPLE_TABLE`, `FLOW_EXAMPLE_HOSTS`; default `generator_example` on the replicas
//! of shard `a` of the local cluster, `scripts/cluster.sh up`). The table is created if missing.

use anyhow::{ensure, Context};
use flow_examples::ExampleTable;

const PARTITIONS: u64 = 4;
const PER_PARTITION: u64 = 2500;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let target = ExampleTable::from_args("generator_example");
    target
        .create("id UInt64, partition UInt32, offset UInt64, user_id UInt64, ts DateTime, payload String")
        .await?;

    // The spec is the YAML a worker runs (`flow-worker run`), here written in code.
    let spec = flow::PipelineSpec::from_yaml(&format!(
        r#"
pipeline: generator-example
partitions: {PARTITIONS}
epoch: {{max_messages: 1000, max_duration_ms: 500}}
source: {{class: generator, parameters: {{count: {PER_PARTITION}}}}}
sinks:
  - name: events
    sink_class_name: ClickHouseBatchingSink
    input_stream_ids: [rows]
    parameters: {{hosts: {hosts}, table: {table}}}
    dynamic_parameters: {{max_rows_per_batch: 1000}}
"#,
        hosts = target.hosts_yaml(),
        table = target.table,
    ))?;
    // The outbox: what is committed but not yet in ClickHouse survives a crash here.
    let state = tempfile::tempdir().context("creating the state directory")?;
    let options = flow::StartOptions::new(state.path()).registry(flow::registry());
    let mut pipeline = flow::PipelineHandle::start(spec, options).await?;
    // A finite source: `wait` returns once every message is delivered. An endless one would
    // run until `pipeline.stop(timeout)`, which stops it as SIGTERM stops the worker.
    let report = pipeline.wait().await?;

    let expected = PARTITIONS * PER_PARTITION;
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
