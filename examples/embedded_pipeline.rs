//! Embedding a flow pipeline in a Rust program.
//!
//! This example:
//! - registers its own sink class, `UserCounter` (rows per `user_id`, in memory), next to the
//!   builtin plugins of `Registry::with_builtins()`;
//! - writes the pipeline spec in code (a YAML string) and validates it with `Registry::build`;
//! - opens a `StateStore` (the transactional outbox behind exactly-once delivery) in a temp dir;
//! - runs the builtin `generator` source with 2 partitions into both `UserCounter` and the
//!   builtin `DebugSink`, then prints the `RunReport`.
//!
//! Run it with `cargo run -p flow-examples --example embedded_pipeline`.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, PoisonError};

use anyhow::Context;
use async_trait::async_trait;
use flow_core::registry::{parse_parameters, BuildResult, SinkBuildContext};
use flow_core::{
    Epoch, EpochOutcome, EpochWrite, Pipeline, PipelineSpec, Registry, Sink, SinkContext,
    SinkError, SinkFactory, Value, Violation,
};
use flow_state::{SealedBatch, StateStore};

/// Rows per user, summed over all partitions; shared by the sink instances and `main`.
type Counts = Arc<Mutex<BTreeMap<u64, u64>>>;

#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct UserCounterParams {
    /// How many of the busiest users each partition's summary lists.
    top: usize,
}

/// The builder of class `UserCounter`: checks the spec entry, before anything runs.
fn user_counter_builder(
    totals: Counts,
) -> impl Fn(
    &SinkBuildContext<'_>,
    &serde_yaml::Value,
    &serde_yaml::Value,
) -> BuildResult<Arc<dyn SinkFactory>> {
    move |ctx, parameters, _dynamic| {
        let params: UserCounterParams =
            parse_parameters(parameters, "parameters").map_err(|v| vec![v])?;
        let [(_, schema)] = ctx.inputs else {
            return Err(vec![Violation::new(
                "input_stream_ids",
                "read exactly one stream",
            )]);
        };
        let column = schema.index_of("user_id").ok_or_else(|| {
            vec![Violation::new(
                "input_stream_ids[0]",
                "the stream has no `user_id` column",
            )]
        })?;
        Ok(Arc::new(UserCounterFactory {
            column,
            top: params.top,
            totals: Arc::clone(&totals),
        }))
    }
}

struct UserCounterFactory {
    column: usize,
    top: usize,
    totals: Counts,
}

impl SinkFactory for UserCounterFactory {
    fn create(&self, ctx: SinkContext) -> Result<Box<dyn Sink>, SinkError> {
        Ok(Box::new(UserCounter {
            partition: ctx.partition,
            column: self.column,
            top: self.top,
            totals: Arc::clone(&self.totals),
            pending: BTreeMap::new(),
            counts: BTreeMap::new(),
        }))
    }
}

/// One partition's counter. It has no outbox, so it seals nothing: it stages an epoch's counts in
/// `write_epoch` and applies them only in `committed`, once the epoch's source position is durable
/// (a veto or a failed commit replays the epoch, which must not count twice). Guarantee: within a
/// process every committed message is counted exactly once. The counts die with the process and a
/// restart resumes after the last committed epoch, so across restarts it is at-most-once; a sink
/// that must survive restarts seals its output into the outbox, as `DebugSink` does.
struct UserCounter {
    partition: u32,
    column: usize,
    top: usize,
    totals: Counts,
    pending: BTreeMap<u64, u64>,
    counts: BTreeMap<u64, u64>,
}

#[async_trait]
impl Sink for UserCounter {
    async fn write_epoch(&mut self, epoch: &Epoch<'_>) -> Result<EpochOutcome, SinkError> {
        self.pending.clear();
        for row in epoch.inputs.iter().flat_map(|batch| batch.rows()) {
            if let Value::Uint(user) = row.get(self.column) {
                *self.pending.entry(user).or_default() += 1;
            }
        }
        Ok(EpochOutcome::Commit(EpochWrite::default()))
    }

    async fn committed(&mut self, _batches: Vec<(u64, SealedBatch)>) -> Result<(), SinkError> {
        for (user, n) in std::mem::take(&mut self.pending) {
            *self.counts.entry(user).or_default() += n;
        }
        Ok(())
    }

    async fn drain(&mut self) -> Result<(), SinkError> {
        let mut busiest: Vec<(u64, u64)> = self.counts.iter().map(|(u, n)| (*u, *n)).collect();
        busiest.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
        busiest.truncate(self.top);
        println!(
            "UserCounter partition {}: {} users, busiest (user, rows): {busiest:?}",
            self.partition,
            self.counts.len()
        );
        let mut totals = self.totals.lock().unwrap_or_else(PoisonError::into_inner);
        for (user, n) in &self.counts {
            *totals.entry(*user).or_default() += n;
        }
        Ok(())
    }
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let dir = tempfile::tempdir().context("creating a temp dir")?;
    let debug_out = dir.path().join("debug.jsonl");

    let totals = Counts::default();
    let mut registry = Registry::with_builtins();
    registry.register_sink(
        "UserCounter",
        Arc::new(user_counter_builder(Arc::clone(&totals))),
    );

    let spec = PipelineSpec::from_yaml(&format!(
        r#"
pipeline: embedded
partitions: 2
epoch: {{max_messages: 1000}}
source: {{class: generator, parameters: {{count: 2500}}}}
sinks:
  - {{name: users, sink_class_name: UserCounter, input_stream_ids: [rows], parameters: {{top: 3}}}}
  - {{name: debug, sink_class_name: DebugSink, input_stream_ids: [rows], parameters: {{path: "{}"}}}}
"#,
        debug_out.display()
    ))?;
    let validated = registry.build(&spec)?;

    let store = StateStore::open(&dir.path().join("state")).context("opening the state store")?;
    let report = Pipeline::new(validated, store.clone()).run().await?;
    store.close().context("closing the state store")?;

    for p in &report.partitions {
        println!(
            "partition {}: {:?}, {} messages in {} epochs, {} vetoes, {} dead letters",
            p.partition, p.end, p.messages, p.epochs_committed, p.vetoes, p.dead_letters
        );
    }
    let totals = totals.lock().unwrap_or_else(PoisonError::into_inner);
    println!(
        "UserCounter: {} rows from {} users",
        totals.values().sum::<u64>(),
        totals.len()
    );
    let lines = std::fs::read_to_string(&debug_out)?.lines().count();
    println!("DebugSink: {lines} lines in {}", debug_out.display());
    anyhow::ensure!(
        lines as u64 == report.messages(),
        "the DebugSink output is incomplete"
    );
    Ok(())
}
