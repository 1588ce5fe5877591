//! `ClickHouseBatchingSink` and `ShardedClickHouseBatchingSink`: exactly-once through the outbox.
//!
//! Per epoch, rows are cut into deterministic batches (`max_rows_per_batch`,
//! `max_bytes_per_batch`), routed to shards by rendezvous hashing and encoded once as RowBinary.
//! Each (batch, shard) part is sealed into the outbox as one entry, in shard-name order, in the same
//! commit as the source position; a logical batch has left the outbox when its last shard entry is
//! acknowledged. Delivery is asynchronous and strictly ordered per partition; every replay sends the
//! stored bytes with the same token `<namespace><max message id>[:<shard>]`.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use flow_core::delivery::{BatchDeliverer, DeliveryQueue};
use flow_core::registry::{BuildResult, SinkBuildContext};
use flow_core::{
    Epoch, EpochOutcome, EpochWrite, MessageBatch, SinkContext, SinkError, SinkFactory,
    StreamSchema, Violation,
};
use flow_state::{SealedBatch, SinkPartition, StateStore};
use tokio::sync::{watch, OnceCell};
use tracing::{error, warn};

use crate::classify::{log_unknown, should_retry, ErrorClass};
use crate::compress::{compress_lz4, LZ4_FORMAT_SUFFIX};
use crate::fingerprint::{check_topology, topology_fingerprint, TopologyDecision, ROUTING_KEY};
use crate::params::{self, ClickHouseDynamicParams, ClickHouseParams, Codec, SinkClass};
use crate::routing::{routing_key, RendezvousRouter};
use crate::session::WriterSession;

/// Builds either batching class from its spec parameters.
pub fn build(
    class: SinkClass,
    ctx: &SinkBuildContext<'_>,
    parameters: &serde_yaml::Value,
    dynamic: &serde_yaml::Value,
) -> BuildResult<Arc<dyn SinkFactory>> {
    let (params, dynamic) = params::parse(class, parameters, dynamic)?;
    let [(_, stream)] = ctx.inputs else {
        return Err(vec![Violation::new(
            "input_stream_ids",
            format!(
                "a ClickHouse sink writes exactly one stream; {} are listed",
                ctx.inputs.len()
            ),
        )]);
    };
    let mut key_columns = Vec::new();
    let mut violations = Vec::new();
    for (i, name) in params.sharding_key_columns.iter().enumerate() {
        match stream.index_of(name) {
            Some(index) => key_columns.push(index),
            None => violations.push(Violation::new(
                format!("parameters.sharding_key_columns[{i}]"),
                format!("`{name}` is not a column of the input stream"),
            )),
        }
    }
    if !violations.is_empty() {
        return Err(violations);
    }
    let shard_names: Vec<String> = params.shards().into_iter().map(|s| s.name).collect();
    let routing_fingerprint = topology_fingerprint(
        &params.sharding_key_columns,
        params.is_sharded().then_some(shard_names.as_slice()),
    );
    Ok(Arc::new(BatchingSinkFactory {
        shared: Arc::new(Shared {
            class,
            token_prefix: params.token_prefix(ctx.pipeline, ctx.sink),
            router: RendezvousRouter::new(&shard_names),
            sharded: params.is_sharded(),
            params,
            stream: Arc::clone(stream),
            key_columns,
            routing_fingerprint,
            session: OnceCell::new(),
            dynamic: RwLock::new(dynamic),
            gave_up: Mutex::new(None),
        }),
    }))
}

/// What every partition of one sink shares: the session, the router and the give-up state.
struct Shared {
    class: SinkClass,
    params: ClickHouseParams,
    stream: Arc<StreamSchema>,
    key_columns: Vec<usize>,
    router: RendezvousRouter,
    sharded: bool,
    token_prefix: String,
    routing_fingerprint: String,
    session: OnceCell<Arc<WriterSession>>,
    /// The dynamic parameters in force (reloaded on SIGHUP).
    dynamic: RwLock<ClickHouseDynamicParams>,
    /// Set once an insert was given up: the sink fails every later write until a restart.
    gave_up: Mutex<Option<String>>,
}

impl Shared {
    fn dynamic(&self) -> ClickHouseDynamicParams {
        self.dynamic
            .read()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .clone()
    }

    fn check_gave_up(&self) -> Result<(), SinkError> {
        let guard = self
            .gave_up
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        match guard.as_ref() {
            Some(reason) => Err(SinkError::Delivery {
                reason: reason.clone(),
            }),
            None => Ok(()),
        }
    }

    /// Records the first give-up reason; every later write fails with it.
    fn give_up(&self, reason: String) -> SinkError {
        error!(database = %self.params.database, table = %self.params.table, reason = %reason, "insert given up; this sink fails every later write until the pipeline is restarted. Fix the table or the configuration, then restart");
        let mut guard = self
            .gave_up
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        SinkError::Delivery {
            reason: guard.get_or_insert(reason).clone(),
        }
    }

    /// The session, started on first use. Unreachable endpoints are waited for (with
    /// `retry_backoff`); a target that cannot be written refuses the start.
    async fn session(&self) -> Result<Arc<WriterSession>, SinkError> {
        self.session
            .get_or_try_init(|| async {
                loop {
                    let dynamic = self.dynamic();
                    match WriterSession::start(self.class, &self.params, &dynamic, &self.stream).await {
                        Ok(session) => return Ok(Arc::new(session)),
                        Err(err) if err.is_retryable() => {
                            warn!(database = %self.params.database, table = %self.params.table, error = %err, "cannot start the ClickHouse writer session yet; retrying. Check that every listed host is up");
                            tokio::time::sleep(dynamic.retry_backoff.max(Duration::from_millis(100))).await;
                        }
                        Err(err) => return Err(SinkError::Refused(err.to_string())),
                    }
                }
            })
            .await
            .cloned()
    }

    fn current_fingerprints(&self, session: &WriterSession) -> BTreeMap<String, String> {
        let mut current = session.target_fingerprints.clone();
        current.insert(ROUTING_KEY.to_owned(), self.routing_fingerprint.clone());
        current
    }
}

struct BatchingSinkFactory {
    shared: Arc<Shared>,
}

impl SinkFactory for BatchingSinkFactory {
    fn create(&self, ctx: SinkContext) -> Result<Box<dyn Sink>, SinkError> {
        let shards = self.shared.router.shards().len().max(1);
        Ok(Box::new(BatchingSink {
            shared: Arc::clone(&self.shared),
            ctx,
            queue: None,
            fingerprints_checked: false,
            buffers: vec![Vec::new(); shards],
            rows: vec![0; shards],
            key: Vec::new(),
        }))
    }
}

use flow_core::Sink;

struct BatchingSink {
    shared: Arc<Shared>,
    ctx: SinkContext,
    queue: Option<DeliveryQueue>,
    /// Whether the persisted fingerprints were compared with (or replaced by) the current ones.
    fingerprints_checked: bool,
    /// Per shard (router order): the encoded rows of the batch being cut, and their count.
    buffers: Vec<Vec<u8>>,
    rows: Vec<u64>,
    key: Vec<u8>,
}

async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, flow_state::StateError> + Send + 'static,
) -> Result<T, SinkError> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|err| SinkError::Delivery {
            reason: format!("state task failed: {err}"),
        })?
        .map_err(SinkError::from)
}

impl BatchingSink {
    /// The topology guard: with undelivered batches, a changed routing or target refuses the
    /// start; a drained partition adopts the current fingerprints.
    async fn check_fingerprints(
        &mut self,
        undelivered: u64,
        oldest: Option<String>,
    ) -> Result<(), SinkError> {
        let session = self.shared.session().await?;
        let current = self.shared.current_fingerprints(&session);
        let store = self.ctx.store.clone();
        let key = self.ctx.state_key();
        let persisted = blocking(move || store.fingerprints(&key)).await?;
        let decision = check_topology(&persisted, &current, undelivered, oldest.as_deref())
            .map_err(|err| SinkError::Refused(err.to_string()))?;
        if decision == TopologyDecision::Adopt && persisted != current {
            self.ctx
                .store
                .set_fingerprints(&self.ctx.state_key(), current)
                .await?;
        }
        self.fingerprints_checked = true;
        Ok(())
    }

    fn seal(&mut self, first_offset: u64, last_offset: u64, write: &mut EpochWrite) {
        let partition = self.ctx.partition;
        let session_columns = self
            .shared
            .session
            .get()
            .map(|s| s.encoder.column_names())
            .unwrap_or_default();
        for (index, buffer) in self.buffers.iter_mut().enumerate() {
            if buffer.is_empty() {
                continue;
            }
            let shard = self
                .shared
                .router
                .shards()
                .get(index)
                .cloned()
                .unwrap_or_default();
            let mut token = format!("{}{partition}-{last_offset}", self.shared.token_prefix);
            if self.shared.sharded {
                token.push(':');
                token.push_str(&shard);
            }
            let rows = std::mem::take(&mut self.rows[index]);
            let (format, payload) = match self.shared.params.codec {
                Codec::Lz4 => {
                    let mut compressed = Vec::with_capacity(buffer.len() / 2);
                    compress_lz4(buffer, &mut compressed);
                    // The encode buffer keeps its capacity for the next batch.
                    buffer.clear();
                    (
                        format!("RowBinary{LZ4_FORMAT_SUFFIX}"),
                        Bytes::from(compressed),
                    )
                }
                Codec::None => {
                    // The next batch is likely as large: reserve that instead of regrowing.
                    let capacity = buffer.len();
                    let raw = std::mem::replace(buffer, Vec::with_capacity(capacity));
                    ("RowBinary".to_owned(), Bytes::from(raw))
                }
            };
            write.batches.push(SealedBatch {
                target: format!(
                    "{}.{}",
                    self.shared.params.database, self.shared.params.table
                ),
                columns: session_columns.clone(),
                format,
                token,
                shard: if self.shared.sharded {
                    shard
                } else {
                    String::new()
                },
                first_offset,
                last_offset,
                rows,
                payload,
            });
        }
    }

    fn cut(
        &mut self,
        batch: &MessageBatch,
        session: &WriterSession,
        write: &mut EpochWrite,
    ) -> Result<(), SinkError> {
        let dynamic = self.shared.dynamic();
        let max_rows = dynamic.max_rows_per_batch;
        let max_bytes = usize::try_from(dynamic.max_bytes_per_batch).unwrap_or(usize::MAX);
        let mut batch_rows = 0u64;
        let mut batch_bytes = 0usize;
        let mut first_offset = None;
        for row in batch.rows() {
            let shard = if self.shared.sharded {
                routing_key(&row, &self.shared.key_columns, &mut self.key);
                self.shared.router.route(&self.key)
            } else {
                0
            };
            let buffer = &mut self.buffers[shard];
            let before = buffer.len();
            session
                .encoder
                .encode_row(&row, buffer)
                .map_err(|err| SinkError::Rejected {
                    message_id: row.id().to_string(),
                    reason: err.to_string(),
                })?;
            batch_bytes += buffer.len() - before;
            self.rows[shard] += 1;
            batch_rows += 1;
            let first = *first_offset.get_or_insert(row.id().offset);
            if batch_rows >= max_rows || batch_bytes >= max_bytes {
                self.seal(first, row.id().offset, write);
                batch_rows = 0;
                batch_bytes = 0;
                first_offset = None;
            }
        }
        if let (Some(first), Some(last)) = (first_offset, batch.ids().last()) {
            self.seal(first, last.offset, write);
        }
        Ok(())
    }

    fn queue(&mut self) -> Result<&mut DeliveryQueue, SinkError> {
        self.queue.as_mut().ok_or_else(|| SinkError::Delivery {
            reason: "the sink was not opened".to_owned(),
        })
    }
}

#[async_trait]
impl Sink for BatchingSink {
    async fn open(&mut self) -> Result<(), SinkError> {
        let store = self.ctx.store.clone();
        let key = self.ctx.state_key();
        let backlog = blocking(move || store.undelivered(&key)).await?;
        if let Some(oldest) = backlog.first() {
            let bound = format!("{}-{}", self.ctx.partition, oldest.batch.last_offset);
            self.check_fingerprints(backlog.len() as u64, Some(bound))
                .await?;
        }
        let deliverer: Arc<dyn BatchDeliverer> = Arc::new(ClickHouseDeliverer {
            shared: Arc::clone(&self.shared),
            store: self.ctx.store.clone(),
        });
        self.queue = Some(DeliveryQueue::start(self.ctx.state_key(), deliverer, backlog).await?);
        Ok(())
    }

    async fn write_epoch(&mut self, epoch: &Epoch<'_>) -> Result<EpochOutcome, SinkError> {
        self.shared.check_gave_up()?;
        let session = self.shared.session().await?;
        if !self.fingerprints_checked {
            self.check_fingerprints(0, None).await?;
        }
        let mut write = EpochWrite::default();
        for batch in epoch.inputs {
            self.cut(batch, &session, &mut write)?;
        }
        Ok(EpochOutcome::Commit(write))
    }

    async fn committed(&mut self, batches: Vec<(u64, SealedBatch)>) -> Result<(), SinkError> {
        let queue = self.queue()?;
        for (seq, batch) in batches {
            queue.push(seq, batch).await?;
        }
        Ok(())
    }

    async fn drain(&mut self) -> Result<(), SinkError> {
        self.queue()?.drain().await
    }

    async fn close(&mut self) -> Result<(), SinkError> {
        match self.queue.as_mut() {
            Some(queue) => queue.close().await,
            None => Ok(()),
        }
    }

    fn reconfigure(&mut self, dynamic: &serde_yaml::Value) -> Result<(), SinkError> {
        let parsed = params::parse_dynamic(self.shared.class, dynamic).map_err(|v| {
            SinkError::Refused(
                v.iter()
                    .map(ToString::to_string)
                    .collect::<Vec<_>>()
                    .join("; "),
            )
        })?;
        *self
            .shared
            .dynamic
            .write()
            .unwrap_or_else(|poisoned| poisoned.into_inner()) = parsed;
        Ok(())
    }
}

/// Sends stored batches, retrying by error class, failing over within the shard.
struct ClickHouseDeliverer {
    shared: Arc<Shared>,
    store: StateStore,
}

#[async_trait]
impl BatchDeliverer for ClickHouseDeliverer {
    async fn deliver(
        &self,
        key: &SinkPartition,
        seq: u64,
        batch: &SealedBatch,
        stop: &watch::Receiver<bool>,
    ) -> Result<(), SinkError> {
        self.shared.check_gave_up()?;
        let session = self.shared.session().await?;
        let Some(shard) = session.shard(&batch.shard) else {
            return Err(self.shared.give_up(format!(
                "Giving up insert into ClickHouse: batch {seq} belongs to shard `{}`, which is not configured any more",
                batch.shard
            )));
        };
        let payload = batch.payload.clone();
        let compressed = batch.format.ends_with(LZ4_FORMAT_SUFFIX);
        let mut attempts = 0u32;
        let mut stop = stop.clone();
        loop {
            let dynamic = self.shared.dynamic();
            let mut settings: Vec<(&'static str, String)> = Vec::new();
            if session.capabilities.insert_deduplication_token {
                settings.push(("insert_deduplication_token", batch.token.clone()));
            }
            if session.capabilities.insert_deduplicate {
                settings.push(("insert_deduplicate", "1".to_owned()));
            }
            if dynamic.async_insert {
                settings.push(("async_insert", "1".to_owned()));
                settings.push(("wait_for_async_insert", "1".to_owned()));
                settings.push(("async_insert_deduplicate", "1".to_owned()));
            }
            let endpoint = shard.current();
            attempts += 1;
            let result = endpoint
                .insert(
                    &session.insert_sql,
                    &settings,
                    payload.clone(),
                    compressed,
                    dynamic.write_timeout,
                )
                .await;
            let err = match result {
                Ok(()) => break,
                Err(err) => err,
            };
            if err.class == ErrorClass::Unknown {
                log_unknown(
                    &err,
                    &session.database,
                    &session.table,
                    &endpoint.endpoint.to_string(),
                );
            }
            if !should_retry(err.class, attempts, dynamic.max_insert_attempts) {
                return Err(self.shared.give_up(format!(
                    "Giving up insert into ClickHouse: {}.{} shard `{}` via {} after {attempts} attempt(s), token {}: {err}",
                    session.database, session.table, batch.shard, endpoint.endpoint, batch.token
                )));
            }
            warn!(
                database = %session.database,
                table = %session.table,
                shard = %batch.shard,
                endpoint = %endpoint.endpoint,
                token = %batch.token,
                attempt = attempts,
                error = %err,
                "insert failed; retrying on the next host of the shard"
            );
            shard.advance();
            tokio::select! {
                _ = tokio::time::sleep(dynamic.retry_backoff) => {}
                // Stopping leaves the batch in the outbox for the next run.
                _ = stop.wait_for(|s| *s) => return Ok(()),
            }
        }
        self.store.acknowledge(key, seq, Vec::new()).await?;
        Ok(())
    }
}
