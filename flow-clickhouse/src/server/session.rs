//! The writer session: started in the background when the sink's first partition opens, it connects to every endpoint and proves
//! that they expose one logical table the stream can be written to — engine, complete ordered
//! schema, replication identity, server capabilities, dedup window — before anything is sent.

use std::collections::BTreeMap;
use std::sync::atomic::Ordering;
use std::sync::{Arc, RwLock, Weak};
use std::time::Duration;

use flow_core::StreamSchema;
use futures_util::future::join_all;
use tokio::sync::watch;
use tracing::{error, info, warn};

use crate::config::dynamic::ClickHouseDynamicParams;
use crate::config::guarantee::SinkClass;
use crate::config::params::SinkParams;
use crate::config::topology::ShardIndex;
use crate::encode::chtype::{check_mapping_on, narrowed, type_to_alter_to, ChType, ServerTypes};
use crate::encode::readable::ReadableRanges;
use crate::encode::rowbinary::{EncodedColumn, RowBinaryEncoder};
use crate::server::auto_add::add_missing_columns;
use crate::server::classify::{ClassifiedError, ErrorClass};
use crate::server::client::{build_shards, describe_host, quote_ident, quote_table, ShardClients};
use crate::server::columns_guard::{read_columns, ColumnMeta, ColumnsGuard};
use crate::server::dedup_window::{ReplayExposure, ShardDedupWindow};
use crate::server::late_hosts::{LateCheck, LateHosts, LateTargets};
use crate::server::probe::{probe_speaking_its_protocol, Capabilities, SessionError};
use crate::server::schema_change::{decide, ChangeDecision};
use crate::server::survey::{Survey, Surveyed};

/// Functions whose value differs between two executions of the same INSERT. A DEFAULT or
/// MATERIALIZED expression using one makes two replays of a batch different blocks.
const NON_DETERMINISTIC_FUNCTIONS: &[&str] = &[
    "now(",
    "now64(",
    "nowinblock(",
    "today(",
    "yesterday(",
    "rand(",
    "rand32(",
    "rand64(",
    "randconstant(",
    "randcanonical(",
    "randomstring(",
    "randomfixedstring(",
    "randomprintableascii(",
    "randomstringutf8(",
    "fuzzbits(",
    "generateuuidv4(",
    "generateuuidv7(",
    "generateulid(",
    "generatesnowflakeid(",
    "rownumberinblock(",
    "rownumberinallblocks(",
    "blocknumber(",
    "hostname(",
    "uptime(",
    "serveruuid(",
    "currentuser(",
    "querythreadid(",
    "queryid(",
    "initialqueryid(",
];

const ASYNC_INSERT_UNSUPPORTED: &str = "`async_insert: true` is set but the server does not know the setting `async_insert` (ClickHouse before 21.11). Set `async_insert: false`";

/// A started session, shared by every partition of one sink.
pub struct WriterSession {
    /// Sorted by shard name; one entry named `""` for the unsharded forms.
    pub shards: Vec<ShardClients>,
    /// The columns the sink encodes for and checks every INSERT against: replaced when a
    /// compatible change of the table is adopted ([`WriterSession::refresh_columns`]).
    plan: RwLock<Arc<ColumnsPlan>>,
    /// What planning the stream onto re-read columns needs.
    replan: Replan,
    /// Why the sink stopped on an incompatible change of the table's columns.
    stopped: RwLock<Option<String>>,
    /// One refresh of the columns at a time: a refusal waits for the one under way.
    refreshing: tokio::sync::Mutex<()>,
    pub capabilities: Capabilities,
    /// `target:<shard>` → logical target fingerprint.
    pub target_fingerprints: BTreeMap<String, String>,
    pub database: String,
    pub table: String,
    /// The dedup window of each shard that deduplicates, for re-checks on reload.
    dedup_windows: Vec<ShardDedupWindow>,
    /// What a copy of a batch can follow into a shard, compared with each window.
    exposure: ReplayExposure,
    /// Checks the hosts that were unreachable at the start, until each is admitted.
    _late_hosts: Option<LateHosts>,
    /// The target fingerprints of the shards none of whose hosts answered at the start, as
    /// they become known (not in `target_fingerprints`).
    pub late_targets: Arc<LateTargets>,
    /// The user's `settings`, sent with every INSERT before flow's own.
    pub settings: Vec<(String, String)>,
}

/// The plan the session encodes and checks by; see [`WriterSession::plan`].
#[derive(Debug)]
pub struct ColumnsPlan {
    pub encoder: RowBinaryEncoder,
    pub insert_sql: String,
    /// The columns every INSERT is checked against (those the encoder was planned for).
    pub columns_guard: ColumnsGuard,
    /// The table columns wider than their stream column's own type (see
    /// [`crate::encode::chtype::is_widening`]), for [`WriterSession::plan_change`].
    widened: Vec<Widened>,
    /// 0 at the session start, one more at each adopted change.
    pub generation: u64,
}

impl ColumnsPlan {
    fn new(
        encoder: RowBinaryEncoder,
        stream: &StreamSchema,
        table: &[ColumnMeta],
        params: &SinkParams,
        generation: u64,
    ) -> ColumnsPlan {
        let insert_sql = format!(
            "INSERT INTO {} ({}) FORMAT RowBinary",
            quote_table(&params.database, &params.table),
            encoder
                .column_names()
                .iter()
                .map(|c| quote_ident(c))
                .collect::<Vec<_>>()
                .join(", ")
        );
        ColumnsPlan {
            widened: widened_columns(&encoder, stream),
            encoder,
            insert_sql,
            columns_guard: ColumnsGuard::new(
                ColumnsGuard::query(&params.database, &params.table),
                table.to_vec(),
            ),
            generation,
        }
    }
}

/// What planning the stream onto the table's columns needs, kept for a re-plan.
struct Replan {
    class: SinkClass,
    params: SinkParams,
    stream: Arc<StreamSchema>,
    server_types: ServerTypes,
    ranges: ReadableRanges,
}

impl WriterSession {
    /// The plan new batches are encoded with and INSERTs are checked against. A caller holds
    /// it for what must be encoded under one plan (an epoch's batches).
    pub fn plan(&self) -> Arc<ColumnsPlan> {
        match self.plan.read() {
            Ok(plan) => Arc::clone(&plan),
            Err(poisoned) => Arc::clone(&poisoned.into_inner()),
        }
    }

    /// The reason the sink stopped on an incompatible change of its table's columns.
    pub fn stopped(&self) -> Option<String> {
        match self.stopped.read() {
            Ok(stopped) => stopped.clone(),
            Err(poisoned) => poisoned.into_inner().clone(),
        }
    }

    /// Re-reads the table's columns (`system.columns`, with default kinds, as the start does)
    /// on the current host of every shard and adopts a compatible change
    /// ([`crate::server::schema_change::decide`]). `Ok` when the plan now fits what the
    /// hosts answer; a permanent error naming the reason and the remedy on an incompatible
    /// change (the sink stops, and stays stopped: [`WriterSession::stopped`]); a retryable one
    /// while the hosts disagree (an `ALTER` reaching them one by one) or cannot be read.
    pub async fn refresh_columns(&self, timeout: Duration) -> Result<(), ClassifiedError> {
        let _one = self.refreshing.lock().await;
        if let Some(reason) = self.stopped() {
            return Err(permanent(reason));
        }
        let Some(now) = self.agreed_columns(timeout).await? else {
            return Ok(());
        };
        let plan = self.plan();
        let replan = &self.replan;
        let decision = decide(
            &quote_table(&self.database, &self.table),
            plan.columns_guard.expected(),
            &now,
            &plan.encoder,
            |table| {
                plan_columns(
                    replan.class,
                    &replan.params,
                    &replan.stream,
                    table,
                    self.capabilities,
                    &replan.server_types,
                )
                .map(|encoder| encoder.with_ranges(replan.ranges.clone()))
            },
        );
        match decision {
            ChangeDecision::Unchanged => Ok(()),
            ChangeDecision::Adopt { encoder, changes } => {
                self.adopt(&plan, encoder, &changes, &now);
                Ok(())
            }
            ChangeDecision::Stop { reason } => Err(self.stop_on(reason)),
        }
    }

    /// The columns the current host of every shard answers, when they all agree (`None`: no
    /// shard has a current host); a retryable error while they differ.
    async fn agreed_columns(
        &self,
        timeout: Duration,
    ) -> Result<Option<Vec<ColumnMeta>>, ClassifiedError> {
        let sql = ColumnsGuard::system_columns_query(&self.database, &self.table);
        let mut seen: Option<(String, Vec<ColumnMeta>)> = None;
        for shard in &self.shards {
            let Some(endpoint) = shard.current() else {
                continue;
            };
            let columns = read_columns(endpoint, &sql, timeout).await?;
            let here = describe_host(&shard.name, endpoint);
            match &seen {
                Some((there, first)) if *first != columns => {
                    return Err(ClassifiedError {
                        class: ErrorClass::Retryable,
                        code: None,
                        message: format!(
                            "the table's columns differ between {there} and {here} (an ALTER reaching the hosts one by one?); the sink waits until they agree. If they stay different, make the tables identical on every host"
                        ),
                    });
                }
                Some(_) => {}
                None => seen = Some((here, columns)),
            }
        }
        Ok(seen.map(|(_, columns)| columns))
    }

    /// Adopts a compatible change of the table's columns (`now`): the next plan, one generation
    /// on, encodes the batches sealed from here.
    fn adopt(
        &self,
        plan: &ColumnsPlan,
        encoder: RowBinaryEncoder,
        changes: &[String],
        now: &[ColumnMeta],
    ) {
        let replan = &self.replan;
        let next = ColumnsPlan::new(
            encoder,
            &replan.stream,
            now,
            &replan.params,
            plan.generation + 1,
        );
        let replanned = next.encoder.plan_fingerprint() != plan.encoder.plan_fingerprint();
        info!(
            database = %self.database,
            table = %self.table,
            changes = %changes.join("; "),
            plan = %next.encoder.plan_fingerprint(),
            replanned,
            generation = next.generation,
            "the table's columns changed compatibly: adopted without a restart; batches from the next one on are encoded for them"
        );
        match self.plan.write() {
            Ok(mut current) => *current = Arc::new(next),
            Err(poisoned) => *poisoned.into_inner() = Arc::new(next),
        }
        // A verification of the old columns covers no INSERT under the new ones.
        for endpoint in self.shards.iter().flat_map(|s| &s.endpoints) {
            endpoint.columns_checked_ms.store(0, Ordering::Relaxed);
        }
    }

    /// Stops the sink on an incompatible change of the table's columns, for good: the error
    /// every later refresh answers.
    fn stop_on(&self, reason: String) -> ClassifiedError {
        error!(
            database = %self.database,
            table = %self.table,
            reason = %reason,
            "the table's columns changed incompatibly: this sink stops; the pipeline's other sinks go on"
        );
        match self.stopped.write() {
            Ok(mut stopped) => *stopped = Some(reason.clone()),
            Err(poisoned) => *poisoned.into_inner() = Some(reason.clone()),
        }
        permanent(reason)
    }

    /// Re-reads the table's columns every `interval` until the session is dropped or the
    /// pipeline stops, so that a compatible change is adopted before an INSERT meets it.
    pub fn watch_columns(
        session: &Arc<WriterSession>,
        interval: Duration,
        timeout: Duration,
        mut stop: watch::Receiver<bool>,
    ) {
        let weak: Weak<WriterSession> = Arc::downgrade(session);
        tokio::spawn(async move {
            loop {
                tokio::select! {
                    _ = tokio::time::sleep(interval) => {}
                    _ = stop.wait_for(|s| *s) => return,
                }
                let Some(session) = weak.upgrade() else {
                    return;
                };
                if session.stopped().is_some() {
                    return;
                }
                if let Err(err) = session.refresh_columns(timeout).await {
                    if err.class != ErrorClass::Permanent {
                        warn!(
                            database = %session.database,
                            table = %session.table,
                            error = %err,
                            "cannot re-read the table's columns; trying again at the next refresh"
                        );
                    }
                }
            }
        });
    }

    /// The time bound of `shard`'s deduplication window (`replicated_deduplication_window_seconds`
    /// of a replicated table); `None` where only a block count bounds it.
    pub fn dedup_window_time(&self, shard: &str) -> Option<std::time::Duration> {
        let window = self.dedup_windows.iter().find(|w| w.shard == shard)?;
        if !window.replicated {
            return None;
        }
        let seconds = window
            .windows
            .get("replicated_deduplication_window_seconds")?;
        (seconds.value > 0).then(|| std::time::Duration::from_secs(seconds.value))
    }

    /// Re-checks what depends on dynamic parameters after a reload: `async_insert` needs the
    /// server's support, and the dedup window is compared with the new `replay_horizon`.
    pub fn check_dynamic(
        &self,
        params: &SinkParams,
        dynamic: &ClickHouseDynamicParams,
    ) -> Result<(), String> {
        if dynamic.async_insert && !self.capabilities.async_insert {
            return Err(ASYNC_INSERT_UNSUPPORTED.to_owned());
        }
        for window in &self.dedup_windows {
            window.warn_if_short(params, dynamic, &self.exposure);
        }
        Ok(())
    }

    /// The index of the shard a stored batch names (the shards are sorted by name).
    pub fn shard_index(&self, name: &str) -> Option<ShardIndex> {
        self.shards
            .binary_search_by(|s| s.name.as_str().cmp(name))
            .ok()
            .map(ShardIndex)
    }

    /// Connects to every endpoint and validates the target; see the module doc.
    pub async fn start(
        class: SinkClass,
        params: &SinkParams,
        dynamic: &ClickHouseDynamicParams,
        stream: &Arc<StreamSchema>,
        exposure: ReplayExposure,
    ) -> Result<WriterSession, SessionError> {
        let shards = build_shards(params).map_err(|source| SessionError::Clients {
            database: params.database.clone(),
            table: params.table.clone(),
            source,
        })?;
        let timeout = dynamic.write_timeout;
        if params.auto_add_columns {
            add_missing_columns(&shards, params, stream, timeout)
                .await
                .map_err(|cause| match cause.class {
                    ErrorClass::Permanent => SessionError::refused(params, format!(
                        "auto_add_columns could not add the stream's columns missing from the table: {cause}. Grant the user ALTER on the table, or add the columns by hand"
                    )),
                    _ => SessionError::Unreachable {
                        endpoint: format!("{}.{}", params.database, params.table),
                        cause,
                    },
                })?;
        }
        // Every endpoint is probed at once (a start costs one round of queries, not one per
        // host); the answers are then taken in the order the spec lists the hosts.
        let probes = join_all(shards.iter().map(|shard| {
            join_all(
                shard
                    .endpoints
                    .iter()
                    .map(|endpoint| probe_speaking_its_protocol(endpoint, params, timeout)),
            )
        }))
        .await;
        let mut survey = Survey::new(class, params, dynamic, &exposure, shards.len());
        for (shard, probes) in shards.iter().zip(probes) {
            survey.shard(shard, probes)?;
        }
        let surveyed = survey.finish()?;
        WriterSession::open(class, params, dynamic, stream, exposure, shards, surveyed)
    }

    /// The session on the table the start's survey found: the stream planned onto its columns,
    /// the late hosts watched until they answer.
    fn open(
        class: SinkClass,
        params: &SinkParams,
        dynamic: &ClickHouseDynamicParams,
        stream: &Arc<StreamSchema>,
        exposure: ReplayExposure,
        shards: Vec<ShardClients>,
        surveyed: Surveyed,
    ) -> Result<WriterSession, SessionError> {
        let Surveyed {
            reference,
            capabilities,
            target_fingerprints,
            dedup_windows,
            ranges,
            late,
            late_shards,
        } = surveyed;
        if dynamic.async_insert && !capabilities.async_insert {
            return Err(SessionError::refused(
                params,
                ASYNC_INSERT_UNSUPPORTED.to_owned(),
            ));
        }
        let encoder = plan_columns(
            class,
            params,
            stream,
            &reference.columns,
            capabilities,
            &reference.server_types,
        )
        .map_err(|reason| SessionError::refused(params, reason))?
        .with_ranges(ranges.clone());
        let plan = ColumnsPlan::new(encoder, stream, &reference.columns, params, 0);
        log_started(class, params, &plan, capabilities, shards.len());
        let late_targets = Arc::new(LateTargets::new(&late_shards));
        let late_hosts = LateHosts::watch(
            late,
            LateCheck {
                sink_params: params.clone(),
                columns: reference.columns.clone(),
                capabilities,
                timeout: dynamic.write_timeout,
                targets: Arc::clone(&late_targets),
            },
        );
        Ok(WriterSession {
            _late_hosts: late_hosts,
            late_targets,
            shards,
            plan: RwLock::new(Arc::new(plan)),
            replan: Replan {
                class,
                params: params.clone(),
                stream: Arc::clone(stream),
                server_types: reference.server_types.clone(),
                ranges,
            },
            stopped: RwLock::new(None),
            refreshing: tokio::sync::Mutex::new(()),
            capabilities,
            target_fingerprints,
            database: params.database.clone(),
            table: params.table.clone(),
            dedup_windows,
            exposure,
            settings: params.settings.clone(),
        })
    }

    /// Why a pending batch encoded with plan `stored` cannot be sent under this session's plan,
    /// and how to proceed. RowBinary carries no types: the batch's bytes would be read as the
    /// table's types now. A batch encoded before a column was widened is not re-encoded either:
    /// a server without `insert_deduplication_token` (18.16) deduplicates by the stored block's
    /// content, which differs between the two types, so a re-encoded replay of a part that
    /// already landed would land twice. It is delivered after the column is narrowed back.
    pub fn plan_change(&self, stored: &str) -> String {
        let plan = self.plan();
        plan_change(
            &plan.encoder,
            &plan.widened,
            &quote_table(&self.database, &self.table),
            stored,
        )
    }

    /// The plan a pending batch with plan fingerprint `stored` was encoded with when it is
    /// this session's plan before one or more of its widenings: its rows can be re-encoded for
    /// the wider columns ([`crate::encode::widen`]) where that is safe, or rebuilt with it.
    /// `None` for the current plan or any other.
    pub fn plan_before_widening(&self, stored: &str) -> Option<Arc<ColumnsPlan>> {
        let plan = self.plan();
        let (_, encoder) = widening_candidates(&plan.encoder, &plan.widened)
            .into_iter()
            .find(|(_, encoder)| encoder.plan_fingerprint() == stored)?;
        let table = plan.columns_guard.expected();
        Some(Arc::new(ColumnsPlan::new(
            encoder.with_ranges(self.replan.ranges.clone()),
            &self.replan.stream,
            table,
            &self.replan.params,
            plan.generation,
        )))
    }
}

/// [`WriterSession::plan_change`] of a session with `encoder` and `widened` columns writing to
/// `table` (quoted).
fn plan_change(
    encoder: &RowBinaryEncoder,
    widened: &[Widened],
    table: &str,
    stored: &str,
) -> String {
    for (undone, before) in widening_candidates(encoder, widened) {
        if before.plan_fingerprint() != stored {
            continue;
        }
        let what = undone
            .iter()
            .map(|w| format!("`{}` from {} to {}", w.name, w.was, w.now))
            .collect::<Vec<_>>()
            .join(", ");
        let back = undone
            .iter()
            .map(|w| {
                format!(
                    "ALTER TABLE {table} MODIFY COLUMN {} {}",
                    quote_ident(&w.name),
                    w.was
                )
            })
            .collect::<Vec<_>>()
            .join("; ");
        return format!(
            "the table widened {what} after the batch was encoded; its bytes would be read as the wider type, and a re-encoded replay could not be recognised by the server as the part it may already hold. To deliver it: `{back}` on every host, run the worker until `flow-worker status` shows no pending batch, then widen the column again (the sink writes the stream's values into the wider column)"
        );
    }
    "a column was added, removed or changed type since the batch was encoded; restore the table's columns it was encoded for, run the worker until `flow-worker status` shows no pending batch, then change the table".to_owned()
}

/// The plans a batch may have been encoded with before the widenings of `encoder`'s columns
/// (`widened`): each widening undone alone, then all of them, with the widenings undone.
fn widening_candidates<'w>(
    encoder: &RowBinaryEncoder,
    widened: &'w [Widened],
) -> Vec<(Vec<&'w Widened>, RowBinaryEncoder)> {
    let mut candidates: Vec<Vec<&Widened>> = widened.iter().map(|w| vec![w]).collect();
    if widened.len() > 1 {
        candidates.push(widened.iter().collect());
    }
    candidates
        .into_iter()
        .map(|undone| {
            let columns = encoder
                .columns()
                .iter()
                .map(|c| {
                    let mut c = c.clone();
                    if let Some(w) = undone.iter().find(|w| w.name == c.name) {
                        c.ty = w.was.clone();
                    }
                    c
                })
                .collect();
            (undone, RowBinaryEncoder::new(columns))
        })
        .collect()
}

/// A table column wider than its stream column's type.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Widened {
    name: String,
    /// The column type the stream's type is written to without a widening.
    was: ChType,
    /// The table's type.
    now: ChType,
}

fn widened_columns(encoder: &RowBinaryEncoder, stream: &StreamSchema) -> Vec<Widened> {
    encoder
        .columns()
        .iter()
        .filter_map(|c| {
            let column = stream.columns().get(c.stream_index)?;
            Some(Widened {
                name: c.name.clone(),
                was: narrowed(&column.ty, &c.ty)?,
                now: c.ty.clone(),
            })
        })
        .collect()
}

fn permanent(message: String) -> ClassifiedError {
    ClassifiedError {
        class: ErrorClass::Permanent,
        code: None,
        message,
    }
}

/// What a started session tells the user: the columns written as a wider type, a server without
/// tokens under an exactly-once class, and the start itself.
fn log_started(
    class: SinkClass,
    params: &SinkParams,
    plan: &ColumnsPlan,
    capabilities: Capabilities,
    shards: usize,
) {
    for column in &plan.widened {
        info!(
            database = %params.database,
            table = %params.table,
            column = %column.name,
            stream_type = %column.was,
            table_type = %column.now,
            "the table column is wider than the stream's type: every value is written as the table's type"
        );
    }
    if class.is_exactly_once() && !capabilities.insert_deduplication_token {
        warn!(
            database = %params.database,
            table = %params.table,
            "the server has no `insert_deduplication_token`: exactly-once rests on ClickHouse's content-hash deduplication of bit-identical replays. Two distinct batches with identical rows would collapse into one; make rows unique (e.g. include the message id) or upgrade ClickHouse"
        );
    }
    info!(
        database = %params.database,
        table = %params.table,
        shards,
        columns = plan.encoder.columns().len(),
        tokens = capabilities.insert_deduplication_token,
        "ClickHouse writer session started"
    );
}

/// Maps stream columns to table columns and builds the encoder.
fn plan_columns(
    class: SinkClass,
    params: &SinkParams,
    stream: &Arc<StreamSchema>,
    table: &[ColumnMeta],
    capabilities: Capabilities,
    server_types: &ServerTypes,
) -> Result<RowBinaryEncoder, String> {
    let mut problems = Vec::new();
    let mut plan = Vec::new();
    for (stream_index, column) in stream.columns().iter().enumerate() {
        let Some(target) = table.iter().find(|c| c.name == column.name) else {
            problems.push(format!(
                "the stream column `{}` is not a column of {}.{}; add it to the table or drop it from the stream (e.g. with a `project` processor)",
                column.name, params.database, params.table
            ));
            continue;
        };
        if target.default_kind == "MATERIALIZED" || target.default_kind == "ALIAS" {
            problems.push(format!(
                "the stream column `{}` is a {} column of the table, which ClickHouse computes itself; drop it from the stream",
                column.name, target.default_kind
            ));
            continue;
        }
        let ty = ChType::parse(&target.type_text);
        if let Err(reason) = check_mapping_on(&column.name, &column.ty, &ty, server_types) {
            // A generator's types (or a source schema others rely on) cannot change: say how
            // to change the table instead.
            problems.push(match type_to_alter_to(&column.ty, &ty, server_types) {
                Some(fix) => format!(
                    "{reason}. Where the stream's types are fixed by its source (a generator), change the table: `ALTER TABLE {} MODIFY COLUMN {} {fix}` on every host, then restart",
                    quote_table(&params.database, &params.table),
                    quote_ident(&column.name),
                ),
                None => reason,
            });
            continue;
        }
        plan.push(EncodedColumn {
            name: column.name.clone(),
            stream_index,
            ty,
        });
    }
    if class.is_exactly_once() && !capabilities.insert_deduplication_token {
        for column in table {
            let sent = stream.index_of(&column.name).is_some();
            let computed_on_insert = (!sent && column.default_kind == "DEFAULT")
                || column.default_kind == "MATERIALIZED";
            if computed_on_insert && is_non_deterministic(&column.default_expression) {
                problems.push(format!(
                    "the column `{}` is filled by {} {} on every insert, so a replayed batch would not be bit-identical and this server (no insert_deduplication_token) could not recognise it as a replay; exactly-once is impossible. Send the column from the stream, make its default deterministic, or use AtLeastOnceClickHouseSink",
                    column.name, column.default_kind, column.default_expression
                ));
            }
        }
    }
    if plan.is_empty() && problems.is_empty() {
        problems.push("the stream has no column to send".to_owned());
    }
    if problems.is_empty() {
        Ok(RowBinaryEncoder::new(plan))
    } else {
        Err(problems.join("; "))
    }
}

fn is_non_deterministic(expression: &str) -> bool {
    let compact: String = expression
        .chars()
        .filter(|c| !c.is_whitespace())
        .flat_map(char::to_lowercase)
        .collect();
    NON_DETERMINISTIC_FUNCTIONS
        .iter()
        .any(|f| compact.contains(f))
}

#[cfg(test)]
mod tests {
    use flow_core::StreamType;

    use super::*;

    fn column(name: &str, stream_index: usize, ty: &str) -> EncodedColumn {
        EncodedColumn {
            name: name.to_owned(),
            stream_index,
            ty: ChType::parse(ty),
        }
    }

    #[test]
    fn a_batch_encoded_before_a_widening_is_named_with_the_alter_that_delivers_it() {
        let before = RowBinaryEncoder::new(vec![
            column("id", 0, "UInt64"),
            column("partition", 1, "UInt32"),
            column("user_id", 3, "UInt32"),
        ]);
        let now = RowBinaryEncoder::new(vec![
            column("id", 0, "UInt64"),
            column("partition", 1, "UInt64"),
            column("user_id", 3, "UInt64"),
        ]);
        let stream = StreamSchema::new(vec![
            flow_core::Column::new("id", StreamType::Uint64),
            flow_core::Column::new("partition", StreamType::Uint32),
            flow_core::Column::new("offset", StreamType::Uint64),
            flow_core::Column::new("user_id", StreamType::Uint32),
        ])
        .unwrap();
        let widened = widened_columns(&now, &stream);
        assert_eq!(widened.len(), 2);
        let table = "`default`.`t`";
        // Both widened since the batch was encoded.
        assert_eq!(
            plan_change(&now, &widened, table, before.plan_fingerprint()),
            "the table widened `partition` from UInt32 to UInt64, `user_id` from UInt32 to \
             UInt64 after the batch was encoded; its bytes would be read as the wider type, and \
             a re-encoded replay could not be recognised by the server as the part it may \
             already hold. To deliver it: `ALTER TABLE `default`.`t` MODIFY COLUMN `partition` \
             UInt32; ALTER TABLE `default`.`t` MODIFY COLUMN `user_id` UInt32` on every host, \
             run the worker until `flow-worker status` shows no pending batch, then widen the \
             column again (the sink writes the stream's values into the wider column)"
        );
        // Only one of them.
        let one = RowBinaryEncoder::new(vec![
            column("id", 0, "UInt64"),
            column("partition", 1, "UInt32"),
            column("user_id", 3, "UInt64"),
        ]);
        assert!(
            plan_change(&now, &widened, table, one.plan_fingerprint()).starts_with(
                "the table widened `partition` from UInt32 to UInt64 after the batch was encoded"
            )
        );
        // Any other change.
        assert_eq!(
            plan_change(&now, &widened, table, "0123456789abcdef"),
            "a column was added, removed or changed type since the batch was encoded; restore \
             the table's columns it was encoded for, run the worker until `flow-worker status` \
             shows no pending batch, then change the table"
        );
    }

    fn meta(name: &str, ty: &str, kind: &str, expr: &str) -> ColumnMeta {
        ColumnMeta {
            name: name.to_owned(),
            type_text: ty.to_owned(),
            default_kind: kind.to_owned(),
            default_expression: expr.to_owned(),
        }
    }

    /// The decision about `now` for a stream (`id` uint64, `user_id` uint32) planned onto
    /// `id UInt64, user_id UInt32, note String` by an exactly-once sink on a server without
    /// tokens: `Ok(changes)` adopted, `Err(reason)` stopped.
    fn decision(now: &[ColumnMeta]) -> Result<Vec<String>, String> {
        let stream = Arc::new(
            StreamSchema::new(vec![
                flow_core::Column::new("id", StreamType::Uint64),
                flow_core::Column::new("user_id", StreamType::Uint32),
            ])
            .unwrap(),
        );
        let parameters: serde_yaml::Value = serde_yaml::from_str("{host: h, table: t}").unwrap();
        let params = crate::config::params::parse(
            SinkClass::Batching,
            &parameters,
            &serde_yaml::Value::Null,
            flow_core::SpecPaths::working_directory(),
        )
        .unwrap()
        .0;
        let capabilities = Capabilities {
            insert_deduplication_token: false,
            async_insert: false,
            async_insert_deduplicate: false,
            insert_deduplicate: true,
            replicas_zookeeper_name: false,
        };
        let types = ServerTypes::default();
        let plan = |table: &[ColumnMeta]| {
            plan_columns(
                SinkClass::Batching,
                &params,
                &stream,
                table,
                capabilities,
                &types,
            )
        };
        let was = vec![
            meta("id", "UInt64", "", ""),
            meta("user_id", "UInt32", "", ""),
            meta("note", "String", "", ""),
        ];
        let fed = plan(&was).unwrap();
        match decide("`default`.`t`", &was, now, &fed, plan) {
            ChangeDecision::Unchanged => Ok(Vec::new()),
            ChangeDecision::Adopt { changes, .. } => Ok(changes),
            ChangeDecision::Stop { reason } => Err(reason),
        }
    }

    #[test]
    fn compatible_changes_are_adopted_and_incompatible_ones_stop_with_the_reason() {
        let id = meta("id", "UInt64", "", "");
        let user = meta("user_id", "UInt32", "", "");
        let note = meta("note", "String", "", "");
        let with = |extra: &[ColumnMeta]| {
            let mut columns = vec![id.clone(), user.clone(), note.clone()];
            columns.extend(extra.iter().cloned());
            columns
        };
        assert_eq!(decision(&with(&[])), Ok(Vec::new()));
        // Adopted.
        assert_eq!(
            decision(&with(&[meta("region", "String", "DEFAULT", "'eu'")])),
            Ok(vec!["column `region` String DEFAULT 'eu' added".to_owned()])
        );
        assert_eq!(
            decision(&with(&[meta("flag", "UInt8", "", "")])),
            Ok(vec!["column `flag` UInt8 added".to_owned()])
        );
        assert_eq!(
            decision(&with(&[meta("day", "Date", "MATERIALIZED", "toDate(id)")])),
            Ok(vec![
                "column `day` Date MATERIALIZED toDate(id) added".to_owned()
            ])
        );
        assert_eq!(
            decision(&[id.clone(), user.clone()]),
            Ok(vec!["column `note` String dropped".to_owned()])
        );
        assert_eq!(
            decision(&[id.clone(), meta("user_id", "UInt64", "", ""), note.clone()]),
            Ok(vec![
                "column `user_id` UInt32 is now `user_id` UInt64".to_owned()
            ])
        );
        assert_eq!(
            decision(&[
                id.clone(),
                meta("user_id", "Nullable(Int64)", "", ""),
                note.clone()
            ]),
            Ok(vec![
                "column `user_id` UInt32 is now `user_id` Nullable(Int64)".to_owned()
            ])
        );
        assert_eq!(
            decision(&[id.clone(), user.clone(), meta("note", "UInt8", "", "")]),
            Ok(vec!["column `note` String is now `note` UInt8".to_owned()])
        );
        // Stopped.
        assert_eq!(
            decision(&[id.clone(), note.clone()]),
            Err("the column `user_id` the stream writes was dropped from `default`.`t`: its values have no column to go to. The sink's pending batches stay in the outbox; add the column back (`ALTER TABLE `default`.`t` ADD COLUMN `user_id` UInt32` on every host) or remove it from the stream (e.g. with a `project` processor), then restart".to_owned())
        );
        assert_eq!(
            decision(&[]),
            Err("the table `default`.`t` is gone (system.columns lists no column of it: dropped, renamed or detached; an INSERT into it fails with code 60 UNKNOWN_TABLE). The sink's pending batches stay in the outbox; create the table again with its columns (or rename or attach it back) on every host, then restart".to_owned())
        );
        let narrowing = "the column `user_id` the stream writes changed type from UInt32 to UInt16, which does not hold every value of UInt32 (only a widening is adopted while the sink runs): batches sealed for UInt32 cannot be written to it as they are. The sink's pending batches stay in the outbox; change the column back (`ALTER TABLE `default`.`t` MODIFY COLUMN `user_id` UInt32` on every host) and restart, or drain the sink before changing the type";
        assert_eq!(
            decision(&[id.clone(), meta("user_id", "UInt16", "", ""), note.clone()]),
            Err(narrowing.to_owned())
        );
        assert!(
            decision(&[id.clone(), meta("user_id", "Int32", "", ""), note.clone()])
                .unwrap_err()
                .starts_with("the column `user_id` the stream writes changed type from UInt32 to Int32, which does not hold every value of UInt32")
        );
        assert!(
            decision(&[id.clone(), meta("user_id", "String", "", ""), note.clone()])
                .unwrap_err()
                .starts_with(
                    "the column `user_id` the stream writes changed type from UInt32 to String"
                )
        );
        assert_eq!(
            decision(&with(&[meta("at", "DateTime", "DEFAULT", "now()")])),
            Err("the table's columns changed (column `at` DateTime DEFAULT now() added) and the stream no longer fits them: the column `at` is filled by DEFAULT now() on every insert, so a replayed batch would not be bit-identical and this server (no insert_deduplication_token) could not recognise it as a replay; exactly-once is impossible. Send the column from the stream, make its default deterministic, or use AtLeastOnceClickHouseSink. The sink's pending batches stay in the outbox; undo the change on every host, or change the stream, then restart".to_owned())
        );
        assert!(decision(&[
            id.clone(),
            meta("user_id", "UInt32", "MATERIALIZED", "1"),
            note.clone()
        ])
        .unwrap_err()
        .contains("the stream column `user_id` is a MATERIALIZED column of the table, which ClickHouse computes itself; drop it from the stream"));
    }

    #[test]
    fn non_deterministic_defaults_are_recognised() {
        assert!(is_non_deterministic("now()"));
        assert!(is_non_deterministic("toDate(NOW ())"));
        assert!(is_non_deterministic("generateUUIDv4()"));
        assert!(is_non_deterministic("rand() % 10"));
        assert!(!is_non_deterministic("toDate(ts)"));
        assert!(!is_non_deterministic("''"));
    }
}
