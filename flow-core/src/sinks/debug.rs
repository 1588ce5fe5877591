//! `DebugSink`: writes every message as a JSON line, exactly once, through the outbox. It makes the
//! runtime testable without ClickHouse and shows the shape every outbox sink follows.
//!
//! Exactly-once into a file: the sink-wide state value `file_len:<path>` is the length of the file
//! that acknowledged batches account for. Before its first write a process truncates the file to
//! that length (dropping bytes of a batch written but not acknowledged before a crash); each
//! delivery appends a batch, fsyncs the file and acknowledges the batch together with the new length
//! in one state transaction. One writer at a time per file, across partitions. With `path: "-"` the
//! lines go to stdout, which cannot be truncated: a crash between a write and its acknowledgement
//! repeats that batch there.

use std::io::Write;
use std::path::PathBuf;
use std::sync::Arc;

use async_trait::async_trait;
use flow_state::{AckExtras, SealedBatch, SinkPartition, StateStore};
use serde::{Deserialize, Serialize};
use tokio::sync::{watch, Mutex};

use crate::clock::now_ms;
use crate::delivery::{
    load_backlog, BatchDeliverer, OutboxDelivery, OutboxSink, Sealer, SinkDelivery,
};
use crate::error::{SinkError, Violation};
use crate::json_form::{write_json_string, write_row_object};
use crate::message::MessageBatch;
use crate::metrics::{SinkCount, SinkMetrics};
use crate::plugin::{Epoch, EpochOutcome, EpochWrite, Sink, SinkContext, SinkFactory};

/// Payload bytes the debug sink holds in memory for delivery.
const IN_FLIGHT_BYTES: u64 = 64 << 20;
use crate::registry::{parse_parameters, BuildResult, SinkBuildContext};

/// The largest `max_rows_per_batch`.
pub const MAX_ROWS_PER_BATCH: u64 = 1_000_000;

/// Parameters of the `DebugSink`, as a spec's `parameters:` map gives them.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DebugSinkParams {
    /// Output file, or `-` for stdout.
    pub path: PathBuf,
}

/// The reloadable `dynamic_parameters` of the `DebugSink`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DebugSinkDynamicParams {
    /// A batch is sealed at this many messages, 1..=[`MAX_ROWS_PER_BATCH`] (default 10000).
    #[serde(default = "default_max_rows_per_batch")]
    pub max_rows_per_batch: u64,
}

pub(crate) fn default_max_rows_per_batch() -> u64 {
    10_000
}

impl DebugSinkDynamicParams {
    fn parse(value: &serde_yaml::Value) -> Result<Self, Vec<Violation>> {
        let params: DebugSinkDynamicParams = parse_parameters(value, "dynamic_parameters")?;
        if params.max_rows_per_batch == 0 || params.max_rows_per_batch > MAX_ROWS_PER_BATCH {
            return Err(vec![Violation::new(
                "dynamic_parameters.max_rows_per_batch",
                format!(
                    "{} is out of range 1..={MAX_ROWS_PER_BATCH}",
                    params.max_rows_per_batch
                ),
            )]);
        }
        Ok(params)
    }
}

pub(crate) fn build(
    ctx: &SinkBuildContext<'_>,
    parameters: &serde_yaml::Value,
    dynamic: &serde_yaml::Value,
) -> BuildResult<Arc<dyn SinkFactory>> {
    let params: Result<DebugSinkParams, _> = parse_parameters(parameters, "parameters");
    let dynamic = DebugSinkDynamicParams::parse(dynamic);
    let (params, dynamic) = match (params, dynamic) {
        (Ok(params), Ok(dynamic)) => (params, dynamic),
        (params, dynamic) => {
            let mut violations: Vec<Violation> = params.err().unwrap_or_default();
            violations.extend(dynamic.err().unwrap_or_default());
            return Err(violations);
        }
    };
    if params.path.as_os_str().is_empty() {
        return Err(vec![Violation::new(
            "parameters.path",
            "set a file path, or `-` for stdout",
        )]);
    }
    let _ = dynamic;
    let stdout = params.path.as_os_str() == "-";
    let path = if stdout {
        params.path.clone()
    } else {
        ctx.paths.resolve(&params.path)
    };
    Ok(Arc::new(DebugSinkFactory {
        target: Arc::new(FileTarget {
            path,
            stdout,
            // The path as the spec writes it, so that the record of the acknowledged length
            // stays the same whichever directory the spec's relative paths are taken from.
            state_name: format!("file_len:{}", params.path.display()),
            pipeline: ctx.pipeline.to_owned(),
            sink: ctx.sink.to_owned(),
            file: Mutex::new(None),
        }),
        stream_ids: ctx.inputs.iter().map(|(id, _)| id.clone()).collect(),
        delivery: SinkDelivery::new(ctx.sink, IN_FLIGHT_BYTES),
    }))
}

struct DebugSinkFactory {
    target: Arc<FileTarget>,
    stream_ids: Vec<String>,
    delivery: Arc<SinkDelivery>,
}

impl SinkFactory for DebugSinkFactory {
    fn create(&self, ctx: SinkContext) -> Result<Box<dyn Sink>, SinkError> {
        let dynamic = DebugSinkDynamicParams::parse(&ctx.dynamic_parameters)
            .map_err(|v| SinkError::Refused(Violation::list(&v)))?;
        Ok(Box::new(OutboxSink::new(DebugSink {
            target: Arc::clone(&self.target),
            stream_ids: self.stream_ids.clone(),
            dynamic,
            ctx,
            delivery: Arc::clone(&self.delivery),
        })))
    }
}

/// The debug sink stores payloads even for a replayable source: it is a tool for looking at
/// what a pipeline produces, not for volume.
struct DebugSink {
    target: Arc<FileTarget>,
    stream_ids: Vec<String>,
    dynamic: DebugSinkDynamicParams,
    ctx: SinkContext,
    delivery: Arc<SinkDelivery>,
}

#[async_trait]
impl Sealer for DebugSink {
    async fn open(&mut self, delivery: &mut OutboxDelivery) -> Result<(), SinkError> {
        let key = self.ctx.state_key();
        let backlog = load_backlog(&self.ctx.store, &key).await?;
        let deliverer: Arc<dyn BatchDeliverer> = Arc::new(FileDeliverer {
            target: Arc::clone(&self.target),
            store: self.ctx.store.clone(),
            metrics: self.ctx.metrics.clone(),
        });
        delivery.open(
            key.clone(),
            deliverer,
            Arc::clone(&self.delivery),
            self.ctx.shutdown.clone(),
        );
        for stored in backlog {
            if !delivery.push_stored(&self.ctx.store, &key, stored).await? {
                break;
            }
        }
        Ok(())
    }

    async fn seal(&mut self, epoch: &Epoch<'_>) -> Result<EpochOutcome, SinkError> {
        let mut write = EpochWrite::default();
        let max_rows = usize::try_from(self.dynamic.max_rows_per_batch).unwrap_or(usize::MAX);
        for (batch, stream) in epoch.inputs.iter().zip(&self.stream_ids) {
            let columns: Vec<String> = batch
                .schema()
                .columns()
                .iter()
                .map(|c| c.name.clone())
                .collect();
            let mut start = 0;
            while start < batch.len() {
                let end = (start + max_rows).min(batch.len());
                write.batches.push(encode_batch(
                    batch,
                    start..end,
                    stream,
                    &columns,
                    &self.target.path,
                ));
                start = end;
            }
        }
        Ok(EpochOutcome::Commit(write))
    }

    fn reconfigure(&mut self, dynamic: &serde_yaml::Value) -> Result<(), SinkError> {
        self.dynamic = DebugSinkDynamicParams::parse(dynamic)
            .map_err(|v| SinkError::Refused(Violation::list(&v)))?;
        Ok(())
    }
}

/// Encodes rows `range` as JSON lines `{"message_id":"0-5","stream":"rows","row":{...}}`.
fn encode_batch(
    batch: &MessageBatch,
    range: std::ops::Range<usize>,
    stream: &str,
    columns: &[String],
    path: &std::path::Path,
) -> SealedBatch {
    let mut payload =
        Vec::with_capacity((range.len()) * (64 + batch.arena_bytes() / batch.len().max(1)));
    let first = batch.row(range.start).id();
    let last = batch.row(range.end - 1).id();
    for index in range.clone() {
        let row = batch.row(index);
        payload.extend_from_slice(b"{\"message_id\":\"");
        // Writing into a Vec cannot fail.
        let _ = write!(payload, "{}", row.id());
        payload.extend_from_slice(b"\",\"stream\":");
        write_json_string(&mut payload, stream.as_bytes());
        payload.extend_from_slice(b",\"row\":");
        write_row_object(&mut payload, columns, &row);
        payload.extend_from_slice(b"}\n");
    }
    SealedBatch {
        target: path.display().to_string(),
        columns: columns.to_vec(),
        format: "JSONEachRow".to_owned(),
        token: last.to_string(),
        shard: String::new(),
        first_offset: first.offset,
        last_offset: last.offset,
        rows: range.len() as u64,
        encoded_bytes: payload.len() as u64,
        plan: format!("JSONEachRow({})", columns.join(",")),
        sealed_at_ms: now_ms(),
        content_hash: xxhash_rust::xxh64::xxh64(&payload, 0),
        payload: payload.into(),
    }
}

/// The shared output of one sink: every partition's delivery goes through its lock.
struct FileTarget {
    path: PathBuf,
    stdout: bool,
    state_name: String,
    pipeline: String,
    sink: String,
    /// `(file, acknowledged length)`, opened and truncated by the first delivery of the process.
    file: Mutex<Option<(std::fs::File, u64)>>,
}

impl FileTarget {
    fn io(&self, what: &'static str, source: std::io::Error) -> SinkError {
        SinkError::Io {
            what,
            path: self.path.clone(),
            source,
        }
    }

    /// Opens the file and cuts what no acknowledged batch accounts for.
    fn open(&self, store: &StateStore) -> Result<(std::fs::File, u64), SinkError> {
        let acknowledged = match store.sink_value(&self.pipeline, &self.sink, &self.state_name)? {
            None => 0,
            Some(bytes) => {
                let array: [u8; 8] =
                    bytes
                        .as_slice()
                        .try_into()
                        .map_err(|_| SinkError::Delivery {
                            reason: format!("state value `{}` is not a u64", self.state_name),
                        })?;
                u64::from_be_bytes(array)
            }
        };
        let file = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .read(true)
            .write(true)
            .open(&self.path)
            .map_err(|e| self.io("cannot open the debug sink output", e))?;
        let len = file
            .metadata()
            .map_err(|e| self.io("cannot stat the debug sink output", e))?
            .len();
        if len < acknowledged {
            return Err(SinkError::Refused(format!(
                "`{}` holds {len} bytes but delivered batches account for {acknowledged}: the file was truncated or replaced. Restore it, or start with a new state directory",
                self.path.display()
            )));
        }
        if len > acknowledged {
            tracing::info!(path = %self.path.display(), cut = len - acknowledged, "dropping the unacknowledged tail of the debug sink output; its batches are delivered again");
            file.set_len(acknowledged)
                .map_err(|e| self.io("cannot truncate the debug sink output", e))?;
        }
        Ok((file, acknowledged))
    }
}

struct FileDeliverer {
    target: Arc<FileTarget>,
    store: StateStore,
    metrics: SinkMetrics,
}

impl FileDeliverer {
    /// Acknowledges `batch` with its delivery counters and the sink values given.
    async fn acknowledge(
        &self,
        key: &SinkPartition,
        seq: u64,
        batch: &SealedBatch,
        sink_values: Vec<(String, Vec<u8>)>,
    ) -> Result<(), SinkError> {
        let counters = vec![
            self.metrics.add(SinkCount::RowsDelivered, None, batch.rows),
            self.metrics.add(SinkCount::BatchesDelivered, None, 1),
        ];
        let extras = AckExtras {
            sink_values,
            counters: counters.clone(),
            ..AckExtras::default()
        };
        self.store.acknowledge_with(key, seq, extras).await?;
        self.metrics.applied(&counters);
        Ok(())
    }
}

#[async_trait]
impl BatchDeliverer for FileDeliverer {
    async fn deliver(
        &self,
        key: &SinkPartition,
        seq: u64,
        batch: &SealedBatch,
        _stop: &watch::Receiver<bool>,
    ) -> Result<(), SinkError> {
        if self.target.stdout {
            let payload = batch.payload.clone();
            tokio::task::spawn_blocking(move || {
                let mut out = std::io::stdout().lock();
                out.write_all(&payload).and_then(|()| out.flush())
            })
            .await
            .map_err(|err| SinkError::DeliveryFailed {
                context: "the stdout write task failed".to_owned(),
                source: Box::new(err),
            })?
            .map_err(|e| self.target.io("cannot write to stdout", e))?;
            return self.acknowledge(key, seq, batch, Vec::new()).await;
        }
        // The lock is held until the acknowledgement is durable, so the length in state always
        // matches a prefix of the file.
        let mut guard = self.target.file.lock().await;
        let state = guard.take();
        let target = Arc::clone(&self.target);
        let store = self.store.clone();
        let payload = batch.payload.clone();
        let (file, len) = tokio::task::spawn_blocking(move || -> Result<_, SinkError> {
            let (mut file, len) = match state {
                Some(state) => state,
                None => target.open(&store)?,
            };
            use std::io::Seek;
            file.seek(std::io::SeekFrom::Start(len))
                .and_then(|_| file.write_all(&payload))
                .and_then(|()| file.sync_data())
                .map_err(|e| target.io("cannot append to the debug sink output", e))?;
            Ok((file, len + payload.len() as u64))
        })
        .await
        .map_err(|err| SinkError::DeliveryFailed {
            context: "the file append task failed".to_owned(),
            source: Box::new(err),
        })??;
        let length = (self.target.state_name.clone(), len.to_be_bytes().to_vec());
        self.acknowledge(key, seq, batch, vec![length]).await?;
        *guard = Some((file, len));
        Ok(())
    }
}
