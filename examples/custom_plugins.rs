//! A program's own source and sink classes, registered next to every built-in plugin of
//! `flow::registry()`:
//!
//! - `lines` (source): text lines the program holds in memory, line `i` in partition
//!   `i % partitions`, as stream `lines` (`id` = `i`, `line`, `words`). It is **replayable**: the
//!   lines never change, so reopened at a committed position (the next index within the
//!   partition) it reads the same messages with the same ids, and the exactly-once ClickHouse sink
//!   keeps only the bounds of its pending batches in the outbox, rebuilding them on replay.
//! - `WordTotals` (sink): words per partition, in memory, applied only once an epoch's commit is
//!   durable (see its guarantee below).
//!
//! Each class's parameter type is its typed config too (`SourceConfig`, `SinkConfig`), so the
//! spec is built in code as for the built-ins (`flow::config`). The lines go to both `WordTotals`
//! and the built-in `ClickHouseBatchingSink`; `flow::PipelineHandle` runs the pipeline and the
//! program checks every figure.
//!
//! `cargo run -p flow-examples --example custom_plugins -- [TABLE] [HOST,HOST...]` (or
//! `FLOW_EXAMPLE_TABLE`, `FLOW_EXAMPLE_HOSTS`; default `custom_plugins_example` on the replicas of
//! shard `a` of the local cluster). The table is created if missing.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, PoisonError};

use anyhow::{ensure, Context};
use async_trait::async_trait;
use flow::config::{to_section, ClickHouseSink, EpochSpec, SinkConfig, SourceConfig};
use flow::core::registry::{parse_parameters, BuildResult, SinkBuildContext, SourceBuildContext};
use flow::state::SealedBatch;
use flow::{
    Column, Epoch, EpochOutcome, EpochWrite, MessageId, ReadLimits, Sink, SinkContext, SinkError,
    SinkFactory, Source, SourceError, SourceFactory, SourceOutput, SourceRead, StreamSchema,
    StreamType, Value, Violation,
};
use flow_examples::ExampleTable;

const PARTITIONS: u32 = 3;
const LINES: u64 = 3000;

// ---------------------------------------------------------------------------------------------
// The source

/// `lines` takes no parameters. The registry's builder reads them from the spec entry, which
/// the program writes with this type (or a YAML spec with `source: {class: lines}`).
#[derive(serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct LinesParams {}

impl SourceConfig for LinesParams {
    fn class_name(&self) -> &str {
        "lines"
    }

    fn parameters(&self) -> serde_yaml::Value {
        to_section(self)
    }
}

/// The builder of class `lines`: checks the spec entry before anything runs.
fn lines_builder(
    lines: Arc<Vec<String>>,
) -> impl Fn(&SourceBuildContext<'_>, &serde_yaml::Value) -> BuildResult<Arc<dyn SourceFactory>> {
    move |ctx, parameters| {
        let LinesParams {} = parse_parameters(parameters, "parameters")?;
        let schema = StreamSchema::new(vec![
            Column::new("id", StreamType::Uint64),
            Column::new("line", StreamType::String),
            Column::new("words", StreamType::Uint64),
        ])
        .map_err(|err| vec![Violation::new("parameters", err.to_string())])?;
        Ok(Arc::new(LinesFactory {
            lines: Arc::clone(&lines),
            partitions: u64::from(ctx.partitions),
            schema,
        }))
    }
}

struct LinesFactory {
    lines: Arc<Vec<String>>,
    partitions: u64,
    schema: Arc<StreamSchema>,
}

impl SourceFactory for LinesFactory {
    fn stream_id(&self) -> &str {
        "lines"
    }

    fn schema(&self) -> Arc<StreamSchema> {
        Arc::clone(&self.schema)
    }

    /// The lines never change: a position reads the same messages again.
    fn replayable(&self) -> bool {
        true
    }

    fn open_partition(
        &self,
        partition: u32,
        position: Option<&[u8]>,
    ) -> Result<Box<dyn Source>, SourceError> {
        let next = match position {
            None => 0,
            Some(bytes) => {
                u64::from_be_bytes(bytes.try_into().map_err(|_| SourceError::BadPosition {
                    position: bytes.to_vec(),
                    what: "a `lines` position is one big-endian u64".to_owned(),
                })?)
            }
        };
        Ok(Box::new(LinesSource {
            lines: Arc::clone(&self.lines),
            partition,
            partitions: self.partitions,
            next,
        }))
    }
}

/// One partition: the lines `partition`, `partition + partitions`, ...; `next` counts them.
struct LinesSource {
    lines: Arc<Vec<String>>,
    partition: u32,
    partitions: u64,
    next: u64,
}

impl LinesSource {
    fn line_index(&self, offset: u64) -> u64 {
        offset * self.partitions + u64::from(self.partition)
    }
}

#[async_trait]
impl Source for LinesSource {
    async fn read(
        &mut self,
        out: &mut SourceOutput<'_>,
        limits: ReadLimits,
    ) -> Result<SourceRead, SourceError> {
        let plugin = |err| SourceError::Plugin(Box::new(err));
        for _ in 0..limits.max_messages {
            let id = self.line_index(self.next);
            let Some(line) = usize::try_from(id).ok().and_then(|i| self.lines.get(i)) else {
                break;
            };
            let words = line.split_whitespace().count() as u64;
            let mut row = out
                .batch
                .start_row(MessageId::new(self.partition, self.next));
            row.push(Value::Uint(id))
                .and_then(|r| r.push(Value::Bytes(line.as_bytes())))
                .and_then(|r| r.push(Value::Uint(words)))
                .map_err(plugin)?;
            row.finish().map_err(plugin)?;
            self.next += 1;
        }
        Ok(SourceRead {
            position: self.next.to_be_bytes().to_vec(),
            exhausted: self.line_index(self.next) >= self.lines.len() as u64,
            lag: None,
        })
    }
}

// ---------------------------------------------------------------------------------------------
// The sink

/// Words per partition, filled by the sink instances when they drain.
type Totals = Arc<Mutex<BTreeMap<u32, u64>>>;

/// `WordTotals` takes no parameters, static or dynamic.
#[derive(serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct WordTotalsParams {}

impl SinkConfig for WordTotalsParams {
    fn class_name(&self) -> &str {
        "WordTotals"
    }

    fn parameters(&self) -> serde_yaml::Value {
        to_section(self)
    }

    fn dynamic_parameters(&self) -> serde_yaml::Value {
        serde_yaml::Value::Null
    }
}

/// The builder of class `WordTotals`: its input must have a `words` column.
fn word_totals_builder(
    totals: Totals,
) -> impl Fn(
    &SinkBuildContext<'_>,
    &serde_yaml::Value,
    &serde_yaml::Value,
) -> BuildResult<Arc<dyn SinkFactory>> {
    move |ctx, parameters, _dynamic| {
        let WordTotalsParams {} = parse_parameters(parameters, "parameters")?;
        let [(_, schema)] = ctx.inputs else {
            return Err(vec![Violation::new(
                "input_stream_ids",
                "read exactly one stream",
            )]);
        };
        let column = schema.index_of("words").ok_or_else(|| {
            vec![Violation::new(
                "input_stream_ids[0]",
                "the stream has no `words` column",
            )]
        })?;
        Ok(Arc::new(WordTotalsFactory {
            column,
            totals: Arc::clone(&totals),
        }))
    }
}

struct WordTotalsFactory {
    column: usize,
    totals: Totals,
}

impl SinkFactory for WordTotalsFactory {
    fn create(&self, ctx: SinkContext) -> Result<Box<dyn Sink>, SinkError> {
        Ok(Box::new(WordTotals {
            partition: ctx.partition,
            column: self.column,
            totals: Arc::clone(&self.totals),
            pending: 0,
            words: 0,
        }))
    }
}

/// One partition's word count. It has no outbox, so it seals nothing: it stages an epoch's
/// count in `write_epoch` and applies it only in `committed`, once the epoch's source position is
/// durable (a veto or a failed commit replays the epoch, which must not count twice). Guarantee:
/// within a process every committed message is counted exactly once. The count dies with the
/// process and a restart resumes after the last committed epoch, so across restarts it is
/// at-most-once; a sink that must survive restarts seals its output into the outbox, as
/// `DebugSink` and the ClickHouse sinks do.
struct WordTotals {
    partition: u32,
    column: usize,
    totals: Totals,
    pending: u64,
    words: u64,
}

#[async_trait]
impl Sink for WordTotals {
    async fn write_epoch(&mut self, epoch: &Epoch<'_>) -> Result<EpochOutcome, SinkError> {
        self.pending = 0;
        for row in epoch.inputs.iter().flat_map(|batch| batch.rows()) {
            if let Value::Uint(words) = row.get(self.column) {
                self.pending += words;
            }
        }
        Ok(EpochOutcome::Commit(EpochWrite::default()))
    }

    async fn committed(&mut self, _batches: Vec<(u64, SealedBatch)>) -> Result<(), SinkError> {
        self.words += std::mem::take(&mut self.pending);
        Ok(())
    }

    async fn drain(&mut self) -> Result<(), SinkError> {
        let mut totals = self.totals.lock().unwrap_or_else(PoisonError::into_inner);
        *totals.entry(self.partition).or_default() += self.words;
        Ok(())
    }
}

// ---------------------------------------------------------------------------------------------
// The program

#[tokio::main]
pub async fn main() -> anyhow::Result<()> {
    let target = ExampleTable::from_args("custom_plugins_example");
    target
        .create("id UInt64, line String, words UInt64")
        .await?;

    let lines: Vec<String> = (0..LINES)
        .map(|i| format!("line {i}{}", " word".repeat((i % 7) as usize)))
        .collect();
    let expected_words: u64 = lines
        .iter()
        .map(|l| l.split_whitespace().count() as u64)
        .sum();
    let totals = Totals::default();
    let mut registry = flow::registry();
    registry.register_source("lines", Arc::new(lines_builder(Arc::new(lines))));
    registry.register_sink(
        "WordTotals",
        Arc::new(word_totals_builder(Arc::clone(&totals))),
    );

    let clickhouse = ClickHouseSink::exactly_once()
        .hosts(&target.hosts)
        .table(&target.table)
        .build()?;
    let spec = flow::PipelineSpec::builder("custom-plugins")
        .partitions(PARTITIONS)
        .epoch(EpochSpec {
            max_messages: 400,
            ..EpochSpec::default()
        })
        .source(LinesParams {})
        .sink("words", ["lines"], WordTotalsParams {})
        .sink("clickhouse", ["lines"], clickhouse)
        .build();
    let state = tempfile::tempdir().context("creating the state directory")?;
    let options = flow::StartOptions::new(state.path()).registry(registry);
    let mut pipeline = flow::PipelineHandle::start(spec, options).await?;
    let report = pipeline.wait().await?;

    ensure!(report.messages() == LINES, "{report:?}");
    let totals = totals
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .clone();
    println!("WordTotals per partition: {totals:?}");
    let words: u64 = totals.values().sum();
    ensure!(
        words == expected_words,
        "WordTotals counted {words} words, expected {expected_words}"
    );
    target.check_rows(LINES).await
}
