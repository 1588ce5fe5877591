//! What every ClickHouse sink class shares: the per-sink state behind all partitions
//! ([`SinkShared`]: parameters, router, lazily started session, dynamic parameters, give-up
//! state), cutting an epoch into encoded per-shard parts ([`BatchCutter`]), and one INSERT with
//! retries by error class ([`insert_part`]).

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use bytes::Bytes;
use flow_core::registry::{BuildResult, SinkBuildContext};
use flow_core::{MessageBatch, Row, SinkError, StreamSchema, Violation};
use tokio::sync::{watch, OnceCell};
use tracing::{error, info, warn};

use crate::classify::{log_unknown, should_retry, ClassifiedError, ErrorClass};
use crate::compress::{is_framed, seal};
use crate::fingerprint::{topology_fingerprint, ROUTING_KEY};
use crate::params::{self, ClickHouseDynamicParams, ClickHouseParams, SinkClass};
use crate::routing::{routing_key, RendezvousRouter};
use crate::session::WriterSession;

/// How often a session start that keeps failing on unreachable endpoints warns again.
pub const SESSION_WAIT_WARNING_INTERVAL: Duration = Duration::from_secs(30);

/// Why a session start ended without a session.
enum SessionWait {
    /// The pipeline began stopping while an endpoint was unreachable.
    Stopped,
    Refused(SinkError),
}

/// State shared by every partition of one sink.
pub struct SinkShared {
    pub class: SinkClass,
    pub params: ClickHouseParams,
    pub stream: Arc<StreamSchema>,
    pub key_columns: Vec<usize>,
    pub router: RendezvousRouter,
    pub sharded: bool,
    pub token_prefix: String,
    pub routing_fingerprint: String,
    /// Partitions of the pipeline (bounds the batches in delivery at once).
    pub partitions: u32,
    session: OnceCell<Arc<WriterSession>>,
    dynamic: RwLock<ClickHouseDynamicParams>,
    gave_up: Mutex<Option<String>>,
}

/// Validates a sink's parameters and input, and builds its shared state.
pub fn build_shared(
    class: SinkClass,
    ctx: &SinkBuildContext<'_>,
    parameters: &serde_yaml::Value,
    dynamic: &serde_yaml::Value,
) -> BuildResult<Arc<SinkShared>> {
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
    Ok(Arc::new(SinkShared {
        class,
        token_prefix: params.token_prefix(ctx.pipeline, ctx.sink),
        router: RendezvousRouter::new(&shard_names),
        sharded: params.is_sharded(),
        params,
        stream: Arc::clone(stream),
        key_columns,
        routing_fingerprint,
        partitions: ctx.partitions,
        session: OnceCell::new(),
        dynamic: RwLock::new(dynamic),
        gave_up: Mutex::new(None),
    }))
}

impl SinkShared {
    /// The dynamic parameters in force.
    pub fn dynamic(&self) -> ClickHouseDynamicParams {
        self.dynamic
            .read()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .clone()
    }

    /// Validates and swaps the dynamic parameters (SIGHUP).
    pub fn reconfigure(&self, dynamic: &serde_yaml::Value) -> Result<(), SinkError> {
        let parsed = params::parse_dynamic(self.class, dynamic)
            .map_err(|v| SinkError::Refused(Violation::list(&v)))?;
        if let Some(session) = self.session.get() {
            if let Err(reason) = session.check_dynamic(&self.params, &parsed) {
                // A reload must not stop a running pipeline: keep the parameters in force.
                warn!(database = %self.params.database, table = %self.params.table, reason = %reason, "dynamic parameters rejected by the running session; the previous ones stay in force. Fix the spec and send SIGHUP again");
                return Ok(());
            }
        }
        *self
            .dynamic
            .write()
            .unwrap_or_else(|poisoned| poisoned.into_inner()) = parsed;
        Ok(())
    }

    pub fn check_gave_up(&self) -> Result<(), SinkError> {
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

    /// Records the first give-up reason; every later write of this sink fails with it.
    pub fn give_up(&self, reason: String) -> SinkError {
        error!(database = %self.params.database, table = %self.params.table, reason = %reason, "insert given up; this sink fails every later write until the pipeline is restarted. Fix the table or the configuration, then restart");
        let mut guard = self
            .gave_up
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        SinkError::Delivery {
            reason: guard.get_or_insert(reason).clone(),
        }
    }

    /// The session, started on first use; `None` if the pipeline began stopping while an
    /// endpoint was unreachable. Unreachable endpoints are waited for (with `retry_backoff`),
    /// warning on the first failure and then every [`SESSION_WAIT_WARNING_INTERVAL`]; a target
    /// that cannot be written refuses the start.
    pub async fn session(
        &self,
        stop: &watch::Receiver<bool>,
    ) -> Result<Option<Arc<WriterSession>>, SinkError> {
        let mut stop = stop.clone();
        let started = self
            .session
            .get_or_try_init(|| self.start_session(&mut stop))
            .await;
        match started {
            Ok(session) => Ok(Some(Arc::clone(session))),
            Err(SessionWait::Stopped) => Ok(None),
            Err(SessionWait::Refused(err)) => Err(err),
        }
    }

    async fn start_session(
        &self,
        stop: &mut watch::Receiver<bool>,
    ) -> Result<Arc<WriterSession>, SessionWait> {
        let waiting_since = std::time::Instant::now();
        let mut attempts = 0u64;
        let mut last_warning: Option<std::time::Instant> = None;
        loop {
            let dynamic = self.dynamic();
            attempts += 1;
            let result = WriterSession::start(
                self.class,
                &self.params,
                &dynamic,
                &self.stream,
                self.partitions,
            )
            .await;
            match result {
                Ok(session) => {
                    if attempts > 1 {
                        info!(
                            database = %self.params.database,
                            table = %self.params.table,
                            attempts,
                            waited_s = waiting_since.elapsed().as_secs(),
                            "ClickHouse writer session started after waiting for unreachable endpoints"
                        );
                    }
                    return Ok(Arc::new(session));
                }
                Err(err) if err.is_retryable() => {
                    let due =
                        last_warning.is_none_or(|at| at.elapsed() >= SESSION_WAIT_WARNING_INTERVAL);
                    if due {
                        warn!(
                            database = %self.params.database,
                            table = %self.params.table,
                            attempts,
                            waited_s = waiting_since.elapsed().as_secs(),
                            error = %err,
                            "cannot start the ClickHouse writer session yet; retrying every retry_backoff. Check that every listed host is up and reachable from this worker"
                        );
                        last_warning = Some(std::time::Instant::now());
                    }
                    let pause = dynamic.retry_backoff.max(Duration::from_millis(100));
                    // As in `insert_part`: a stop (or a pipeline gone) ends the wait.
                    tokio::select! {
                        _ = tokio::time::sleep(pause) => {}
                        _ = stop.wait_for(|s| *s) => return Err(SessionWait::Stopped),
                    }
                }
                Err(err) => return Err(SessionWait::Refused(SinkError::Refused(err.to_string()))),
            }
        }
    }

    /// Routes `row` to its shard (always shard 0 unless sharded) and appends its RowBinary
    /// encoding to that shard's buffer; returns the shard index and the encoded size.
    #[inline]
    pub fn encode_routed(
        &self,
        session: &WriterSession,
        row: &Row<'_>,
        buffers: &mut [Vec<u8>],
        key: &mut Vec<u8>,
    ) -> Result<(usize, usize), SinkError> {
        let shard = if self.sharded {
            routing_key(row, &self.key_columns, key);
            self.router.route(key)
        } else {
            0
        };
        let buffer = &mut buffers[shard];
        let before = buffer.len();
        session
            .encoder
            .encode_row(row, buffer)
            .map_err(|err| SinkError::Rejected {
                message_id: row.id().to_string(),
                reason: err.to_string(),
            })?;
        Ok((shard, buffer.len() - before))
    }

    /// The session if it has started.
    pub fn started_session(&self) -> Option<&Arc<WriterSession>> {
        self.session.get()
    }

    /// `routing` and every `target:<shard>` fingerprint of the current spec and tables.
    pub fn current_fingerprints(&self, session: &WriterSession) -> BTreeMap<String, String> {
        let mut current = session.target_fingerprints.clone();
        current.insert(ROUTING_KEY.to_owned(), self.routing_fingerprint.clone());
        current
    }

    /// The shard names in router order (`""` for the unsharded forms).
    pub fn shard_name(&self, index: usize) -> String {
        if self.sharded {
            self.router.shards().get(index).cloned().unwrap_or_default()
        } else {
            String::new()
        }
    }
}

/// One encoded part of a batch for one shard.
#[derive(Debug)]
pub struct Part {
    pub shard: String,
    pub first_offset: u64,
    pub last_offset: u64,
    pub rows: u64,
    /// Bytes of the encoded rows before framing.
    pub encoded_bytes: u64,
    /// xxh64 of the encoded rows before framing (what a rebuilt batch is checked against).
    pub content_hash: u64,
    /// `RowBinary`, or `RowBinary;lz4` for ClickHouse's compression framing.
    pub format: String,
    pub payload: Bytes,
}

impl Part {
    pub fn compressed(&self) -> bool {
        is_framed(&self.format)
    }
}

/// Cuts an epoch's rows into batches (`max_rows_per_batch`, `max_bytes_per_batch`, in message
/// order), routes each row to its shard and encodes it once. Buffers are reused across epochs.
#[derive(Default)]
pub struct BatchCutter {
    buffers: Vec<Vec<u8>>,
    rows: Vec<u64>,
    key: Vec<u8>,
}

impl BatchCutter {
    /// Appends the parts of `batch` to `parts`, batch by batch, shards in name order.
    pub fn cut(
        &mut self,
        shared: &SinkShared,
        session: &WriterSession,
        batch: &MessageBatch,
        parts: &mut Vec<Part>,
    ) -> Result<(), SinkError> {
        let shards = shared.router.shards().len().max(1);
        self.buffers.resize_with(shards, Vec::new);
        self.rows.resize(shards, 0);
        let dynamic = shared.dynamic();
        let max_rows = dynamic.max_rows_per_batch;
        let max_bytes = usize::try_from(dynamic.max_bytes_per_batch).unwrap_or(usize::MAX);
        let mut batch_rows = 0u64;
        let mut batch_bytes = 0usize;
        let mut first_offset = None;
        for row in batch.rows() {
            let (shard, size) =
                shared.encode_routed(session, &row, &mut self.buffers, &mut self.key)?;
            batch_bytes += size;
            self.rows[shard] += 1;
            batch_rows += 1;
            let first = *first_offset.get_or_insert(row.id().offset);
            if batch_rows >= max_rows || batch_bytes >= max_bytes {
                self.seal(shared, first, row.id().offset, parts);
                batch_rows = 0;
                batch_bytes = 0;
                first_offset = None;
            }
        }
        if let (Some(first), Some(last)) = (first_offset, batch.ids().last()) {
            self.seal(shared, first, last.offset, parts);
        }
        Ok(())
    }

    /// Encodes one row into its shard's buffer (rebuilding a batch row by row).
    pub fn push_row(
        &mut self,
        shared: &SinkShared,
        session: &WriterSession,
        row: &Row<'_>,
    ) -> Result<(), SinkError> {
        let shards = shared.router.shards().len().max(1);
        self.buffers.resize_with(shards, Vec::new);
        self.rows.resize(shards, 0);
        let (shard, _) = shared.encode_routed(session, row, &mut self.buffers, &mut self.key)?;
        self.rows[shard] += 1;
        Ok(())
    }

    /// Seals what the buffers hold as one batch with the given bounds: one part per shard that
    /// received rows, in shard order.
    pub fn seal(
        &mut self,
        shared: &SinkShared,
        first_offset: u64,
        last_offset: u64,
        parts: &mut Vec<Part>,
    ) {
        for (index, buffer) in self.buffers.iter_mut().enumerate() {
            if buffer.is_empty() {
                continue;
            }
            let rows = std::mem::take(&mut self.rows[index]);
            let content_hash = xxhash_rust::xxh64::xxh64(buffer, 0);
            let (format, payload) = seal(shared.params.codec, buffer);
            parts.push(Part {
                shard: shared.shard_name(index),
                first_offset,
                last_offset,
                rows,
                encoded_bytes: buffer.len() as u64,
                content_hash,
                format,
                payload,
            });
            // The encode buffer keeps its capacity for the next batch.
            buffer.clear();
        }
    }
}

/// How one INSERT ended without success.
#[derive(Debug)]
pub enum InsertFailure {
    /// The pipeline is stopping; nothing more was tried.
    Stopped,
    /// A permanent error, or unknown errors until `max_insert_attempts`.
    GaveUp {
        error: ClassifiedError,
        attempts: u32,
        endpoint: String,
    },
}

impl InsertFailure {
    /// The `Giving up insert into ClickHouse` reason for a part of `shard` (with its token where
    /// the class has one).
    pub fn give_up_reason(
        &self,
        session: &WriterSession,
        shard: &str,
        token: Option<&str>,
    ) -> String {
        match self {
            InsertFailure::Stopped => "the pipeline is stopping".to_owned(),
            InsertFailure::GaveUp {
                error,
                attempts,
                endpoint,
            } => {
                let token = token.map(|t| format!(", token {t}")).unwrap_or_default();
                format!(
                    "Giving up insert into ClickHouse: {}.{} shard `{shard}` via {endpoint} after {attempts} attempt(s){token}: {error}",
                    session.database, session.table
                )
            }
        }
    }
}

/// Whether failed attempts are retried.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RetryPolicy {
    /// Retryable errors without limit, unknown ones up to `max_insert_attempts`, permanent never.
    ByClass,
    /// One attempt: once an INSERT has started, its failure is final (at-most-once).
    Never,
}

/// What one INSERT sends.
#[derive(Clone, Copy)]
pub struct InsertRequest<'a> {
    pub shard: &'a str,
    /// Sent as `insert_deduplication_token` (with `async_insert_deduplicate`) where the server
    /// has it; `None` for the classes without a token.
    pub token: Option<&'a str>,
    pub payload: &'a Bytes,
    /// The payload is in ClickHouse's compression framing.
    pub compressed: bool,
}

/// Sends one part to its shard, failing over to the next host after each failed attempt.
pub async fn insert_part(
    shared: &SinkShared,
    session: &WriterSession,
    request: InsertRequest<'_>,
    policy: RetryPolicy,
    stop: &mut watch::Receiver<bool>,
) -> Result<u32, InsertFailure> {
    let InsertRequest {
        shard: shard_name,
        token,
        payload,
        compressed,
    } = request;
    let Some(shard) = session.shard(shard_name) else {
        return Err(InsertFailure::GaveUp {
            error: ClassifiedError::from_server(
                None,
                format!("shard `{shard_name}` is not configured any more"),
            ),
            attempts: 0,
            endpoint: String::new(),
        });
    };
    let mut attempts = 0u32;
    loop {
        let dynamic = shared.dynamic();
        let mut settings: Vec<(&'static str, String)> = Vec::new();
        if let (Some(token), true) = (token, session.capabilities.insert_deduplication_token) {
            settings.push(("insert_deduplication_token", token.to_owned()));
        }
        if token.is_some() && session.capabilities.insert_deduplicate {
            settings.push(("insert_deduplicate", "1".to_owned()));
        }
        if dynamic.async_insert {
            settings.push(("async_insert", "1".to_owned()));
            settings.push(("wait_for_async_insert", "1".to_owned()));
            if token.is_some() {
                settings.push(("async_insert_deduplicate", "1".to_owned()));
            }
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
            Ok(()) => return Ok(attempts),
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
        let retry = policy == RetryPolicy::ByClass
            && should_retry(err.class, attempts, dynamic.max_insert_attempts);
        // Fail over whether or not this part is retried: with `RetryPolicy::Never` the next
        // part must not go to the host that just failed (at-most-once would lose every later
        // part while a live replica waits).
        shard.advance();
        if !retry {
            return Err(InsertFailure::GaveUp {
                error: err,
                attempts,
                endpoint: endpoint.endpoint.to_string(),
            });
        }
        warn!(
            database = %session.database,
            table = %session.table,
            shard = %shard_name,
            endpoint = %endpoint.endpoint,
            token = token.unwrap_or(""),
            attempt = attempts,
            error = %err,
            "insert failed; retrying on the next host of the shard"
        );
        tokio::select! {
            _ = tokio::time::sleep(dynamic.retry_backoff) => {}
            _ = stop.wait_for(|s| *s) => return Err(InsertFailure::Stopped),
        }
    }
}
