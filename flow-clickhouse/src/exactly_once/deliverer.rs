//! Sending one sink partition's pending batches (exactly-once classes): [`ClickHouseDeliverer`].
//!
//! Each batch goes to its shard with its token, retried and given up as the guarantee's table
//! says. Two kinds of pending entries are remembered in the state store as sink values, so that
//! a restart treats them as the run before did ([`PartitionMarks`]):
//! - entries being delivered in pieces because the server refused them ([`crate::delivery::split`]);
//! - entries an attempt sent without getting a verdict back, which may have landed: once such an
//!   entry is older than its shard's deduplication window it is not sent again (the server would
//!   no longer recognise it) but set aside as dead letters, unless `on_expired_backlog: send`
//!   ([`crate::delivery::backlog_age::expired`]);
//! - entries sent while the table's columns changed, which may be in the table under other
//!   columns: before such an entry is sent again, the replicas of its shard are asked whether its
//!   message ids are there ([`crate::exactly_once::landed`]).

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};

use async_trait::async_trait;
use flow_core::delivery::{blocking, now_ms, BatchDeliverer};
use flow_core::{SinkContext, SinkCount, SinkError, SinkMetrics};
use flow_state::{
    AckExtras, CounterAdd, ErrorRecord, SealedBatch, SinkPartition, StateError, StateStore,
    StoredBody,
};
use futures_util::future::join_all;
use tokio::sync::watch;
use tracing::{debug, warn};

use crate::config::params::{OnBadRows, OnExpiredBacklog};
use crate::delivery::backlog_age::{expired, unanswered_marker, unanswered_prefix, Expired};
use crate::delivery::insert::{
    attempt_query_id, insert_part, unconfigured_shard, AttemptLog, GiveUpReason, InsertFailure,
    InsertRequest,
};
use crate::delivery::sink_state::SinkShared;
use crate::delivery::split::{
    marker_name, marker_prefix, refusal_from_marker, RefusedPart, SplitOutcome, SplitPart,
};
use crate::encode::compress::{is_framed, seal, unframe};
use crate::encode::widen::widen_rows;
use crate::exactly_once::fingerprint::target_key;
use crate::exactly_once::landed::{
    changed_marker, changed_prefix, decide, no_id_column, part_ids, partly_present,
    presence_queries, running_attempts_query, Presence, ReplicaAnswer, Verdict,
};
use crate::exactly_once::rebuild::Requeue;
use crate::exactly_once::state::ExactlyOnce;
use crate::server::classify::{is_row_rejection, ClassifiedError, ErrorClass};
use crate::server::client::{json_u64, ShardClients};
use crate::server::columns_guard::columns_text;
use crate::server::late_hosts::LateTarget;
use crate::server::session::WriterSession;

/// What the state store remembers about a partition's pending entries, by sequence number.
#[derive(Debug)]
pub struct PartitionMarks {
    /// Entries being delivered in pieces, with the refusal that started it.
    split: BTreeMap<u64, ClassifiedError>,
    /// Entries an attempt sent without an answer, with that attempt's error.
    unanswered: BTreeMap<u64, String>,
    /// Entries sent while the table's columns changed, with the guard's report.
    changed: BTreeMap<u64, String>,
    /// The table's columns the partition's attempts were last made under; `None` before the
    /// first (or in a state directory of an older version).
    columns: Option<AttemptedUnder>,
    /// Entries pending at this run's start after a run that did not end drained: any of them
    /// may be in the table under the columns that run recorded (a kill between its INSERT and
    /// its acknowledgement), until this run acknowledges it or the replicas show it absent.
    inherited: BTreeSet<u64>,
    /// Entries with an attempt out now, with the columns ([`columns_text`]) it was made under.
    in_flight: BTreeMap<u64, String>,
    /// The sink value [`PartitionMarks::columns`] is kept in ([`columns_record`]).
    columns_record: String,
}

/// The table's columns ([`columns_text`]) a partition's attempts were last made under, and
/// whether its last run ended drained, so that no pending entry of it can be in the table
/// without a mark (an entry that landed was acknowledged; one without an answer is marked
/// `unanswered`). Stored as the sink value [`columns_record`]: `clean` or `sent`, a newline,
/// the columns.
#[derive(Clone, Debug, PartialEq, Eq)]
struct AttemptedUnder {
    clean: bool,
    columns: String,
}

impl AttemptedUnder {
    fn parse(value: &[u8]) -> Option<AttemptedUnder> {
        let text = String::from_utf8_lossy(value);
        let (state, columns) = text.split_once('\n')?;
        Some(AttemptedUnder {
            clean: state == "clean",
            columns: columns.to_owned(),
        })
    }

    fn value(&self) -> Vec<u8> {
        let state = if self.clean { "clean" } else { "sent" };
        format!("{state}\n{}", self.columns).into_bytes()
    }
}

/// The sink value holding [`PartitionMarks::columns`] of `partition`: `columns/<partition>` for
/// a sink of one table, `columns/<partition>/<table>` for each table of a template, whose tables
/// may have different columns (one record shared by them made each table's attempts look as
/// if made under another table's columns).
fn columns_record(partition: u32, table: Option<&str>) -> String {
    match table {
        None => format!("columns/{partition}"),
        Some(table) => format!("columns/{partition}/{table}"),
    }
}

impl PartitionMarks {
    /// Reads the marks of `key` (blocking: sled reads); `table` names the template's table the
    /// deliverer is for (`None` for a sink of one table).
    pub fn load(
        store: &StateStore,
        key: &SinkPartition,
        table: Option<&str>,
    ) -> Result<PartitionMarks, StateError> {
        let by_seq = |prefix: &str| -> Result<Vec<(u64, Vec<u8>)>, StateError> {
            let values = store.sink_values_with_prefix(&key.pipeline, &key.sink, prefix)?;
            Ok(values
                .into_iter()
                .filter_map(|(name, value)| Some((name.strip_prefix(prefix)?.parse().ok()?, value)))
                .collect())
        };
        let split = by_seq(&marker_prefix(key.partition))?
            .into_iter()
            .map(|(seq, value)| (seq, refusal_from_marker(&value)))
            .collect();
        let unanswered = by_seq(&unanswered_prefix(key.partition))?
            .into_iter()
            .map(|(seq, value)| (seq, String::from_utf8_lossy(&value).into_owned()))
            .collect();
        let changed = by_seq(&changed_prefix(key.partition))?
            .into_iter()
            .map(|(seq, value)| (seq, String::from_utf8_lossy(&value).into_owned()))
            .collect();
        let columns_record = columns_record(key.partition, table);
        let columns = store
            .sink_values_with_prefix(&key.pipeline, &key.sink, &columns_record)?
            .into_iter()
            .find(|(name, _)| *name == columns_record)
            .and_then(|(_, value)| AttemptedUnder::parse(&value));
        Ok(PartitionMarks {
            split,
            unanswered,
            changed,
            columns,
            inherited: BTreeSet::new(),
            in_flight: BTreeMap::new(),
            columns_record,
        })
    }
}

/// Sends stored batches, retrying by error class, failing over within the shard.
pub struct ClickHouseDeliverer {
    shared: Arc<SinkShared>,
    exactly_once: Arc<ExactlyOnce>,
    store: StateStore,
    /// The partition's context, for rebuilding a batch a stalled lane reads back.
    ctx: SinkContext,
    marks: Mutex<PartitionMarks>,
    /// Late shards whose target this partition checked ([`ClickHouseDeliverer::late_target_fits`]).
    late_checked: Mutex<Vec<String>>,
    metrics: SinkMetrics,
}

/// Between two warnings about a late shard answering with another table (or a replica not
/// answering the check of a part sent while the columns changed).
const LATE_MISMATCH_WARNING_EVERY: std::time::Duration = std::time::Duration::from_secs(60);

/// The shortest pause between two checks of a part's ids on replicas that do not all answer.
const MIN_CHECK_PAUSE: std::time::Duration = std::time::Duration::from_millis(200);

impl ClickHouseDeliverer {
    pub fn new(
        shared: Arc<SinkShared>,
        exactly_once: Arc<ExactlyOnce>,
        ctx: SinkContext,
        marks: PartitionMarks,
        metrics: SinkMetrics,
    ) -> ClickHouseDeliverer {
        ClickHouseDeliverer {
            shared,
            exactly_once,
            store: ctx.store.clone(),
            ctx,
            marks: Mutex::new(marks),
            late_checked: Mutex::new(Vec::new()),
            metrics,
        }
    }

    /// The counter additions of a delivered batch: `rows` landed, the rest are dead letters.
    fn delivered(&self, batch: &SealedBatch, dead_rows: u64) -> Vec<CounterAdd> {
        let shard = Some(batch.shard.as_str());
        let landed = batch.rows.saturating_sub(dead_rows);
        let mut adds = self.metrics.delivered(shard, landed).to_vec();
        if dead_rows > 0 {
            adds.push(
                self.metrics
                    .add(SinkCount::DeadLetterRows, shard, dead_rows),
            );
        }
        adds
    }

    /// Latches the sink's give-up, counted durably and shown in `status`.
    async fn give_up(&self, shard: &str, reason: GiveUpReason) -> SinkError {
        let record = ErrorRecord {
            code: reason.error.code,
            class: reason.error.class.as_str().to_owned(),
            text: reason.to_string(),
            at_ms: now_ms(),
        };
        if let Err(error) = self.metrics.gave_up(Some(shard), record).await {
            warn!(error = %error, "the give-up could not be recorded in the state store; `status` will not show it");
        }
        self.exactly_once.give_up(&self.shared, reason)
    }

    fn marks(&self) -> std::sync::MutexGuard<'_, PartitionMarks> {
        self.marks
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Whether a failed part is sent in pieces rather than given up.
    fn splits(&self, error: &ClassifiedError) -> bool {
        self.shared.params.on_bad_rows == OnBadRows::DeadLetter && is_row_rejection(error)
    }

    /// Acknowledges entry `seq` with its delivery counters, dropping its unanswered-attempt and
    /// changed-columns records in the same step.
    async fn acknowledge(
        &self,
        key: &SinkPartition,
        seq: u64,
        batch: &SealedBatch,
    ) -> Result<(), SinkError> {
        let mut removed = Vec::new();
        {
            let mut marks = self.marks();
            marks.inherited.remove(&seq);
            if marks.unanswered.remove(&seq).is_some() {
                removed.push(unanswered_marker(key.partition, seq));
            }
            if marks.changed.remove(&seq).is_some() {
                removed.push(changed_marker(key.partition, seq));
            }
            // A part found in the table whole by the changed-columns check may have been
            // marked for splitting by an earlier run.
            if marks.split.remove(&seq).is_some() {
                removed.push(marker_name(key.partition, seq));
            }
        }
        let counters = self.delivered(batch, 0);
        let extras = AckExtras {
            removed_sink_values: removed,
            counters: counters.clone(),
            ..AckExtras::default()
        };
        self.store.acknowledge_with(key, seq, extras).await?;
        self.metrics.applied(&counters);
        debug!(partition = key.partition, seq, token = %batch.token, "batch acknowledged");
        Ok(())
    }

    /// Waits until a shard that did not answer at the session start ([`crate::server::late_hosts`]) has
    /// a known target, and checks it against the fingerprint this partition's pending batches
    /// were sealed under (recording it where none was); `false` once stopping. A shard whose
    /// table is another one gets nothing: its batches stay in the outbox, and the lanes of the
    /// other shards go on.
    async fn late_target_fits(
        &self,
        key: &SinkPartition,
        shard: &str,
        session: &WriterSession,
        stop: &watch::Receiver<bool>,
    ) -> Result<bool, SinkError> {
        let mut warned: Option<std::time::Instant> = None;
        let mut stop = stop.clone();
        loop {
            let known = match session.late_targets.state(shard) {
                LateTarget::NotLate => return Ok(true),
                LateTarget::Pending => None,
                LateTarget::Known(fingerprint) => Some(fingerprint),
            };
            if let Some(fingerprint) = known {
                if self.late_checked().iter().any(|checked| checked == shard) {
                    return Ok(true);
                }
                let (store, task_key) = (self.store.clone(), key.clone());
                let mut persisted = blocking(move || store.fingerprints(&task_key)).await?;
                let target = target_key(shard);
                match persisted.get(&target) {
                    Some(old) if *old != fingerprint => {
                        if warned.is_none_or(|at| at.elapsed() >= LATE_MISMATCH_WARNING_EVERY) {
                            warned = Some(std::time::Instant::now());
                            warn!(
                                pipeline = %key.pipeline,
                                sink = %key.sink,
                                partition = key.partition,
                                shard = %shard,
                                persisted = %old,
                                current = %fingerprint,
                                "a shard that did not answer at the start answers with another table than the one its pending batches were sealed for: nothing is sent to it and its batches stay in the outbox, while the other shards go on. Point the shard's hosts at the former table, or stop the worker and deliver the batches there first"
                            );
                        }
                    }
                    Some(_) => {
                        self.late_checked().push(shard.to_owned());
                        return Ok(true);
                    }
                    None => {
                        persisted.insert(target, fingerprint);
                        self.store.set_fingerprints(key, persisted).await?;
                        self.late_checked().push(shard.to_owned());
                        return Ok(true);
                    }
                }
            }
            tokio::select! {
                _ = tokio::time::sleep(std::time::Duration::from_millis(500)) => {}
                _ = stop.wait_for(|s| *s) => return Ok(false),
            }
        }
    }

    /// Whether entry `seq`, sent while the table's columns changed, is sent again: its shard's
    /// replicas are asked for its message ids ([`crate::exactly_once::landed`]). All there: it
    /// is acknowledged without a resend (`Ok(false)`); none: its marks are dropped and it is
    /// sent (`Ok(true)`); some, or no `message_id_column` to ask with: the sink gives up with
    /// the check to run. A replica that cannot answer while none shows the part is asked again.
    async fn send_after_columns_changed(
        &self,
        key: &SinkPartition,
        seq: u64,
        batch: &SealedBatch,
        session: &WriterSession,
        stop: &watch::Receiver<bool>,
    ) -> Result<bool, SinkError> {
        let stopped_by = |reason: String| GiveUpReason {
            context: format!(
                "Not sending a part again into ClickHouse: {}.{} shard `{}`, token {}",
                session.database, session.table, batch.shard, batch.token
            ),
            error: ClassifiedError {
                class: ErrorClass::Permanent,
                code: None,
                message: reason,
            },
        };
        let Some(column) = self.shared.params.message_id_column.as_deref() else {
            let reason = no_id_column(session, batch, key.partition);
            return Err(self.give_up(&batch.shard, stopped_by(reason)).await);
        };
        let Some(shard) = session
            .shard_index(&batch.shard)
            .and_then(|index| session.shards.get(index.0))
        else {
            // Not configured any more: the send reports it.
            return Ok(true);
        };
        let ids = match part_ids(session, batch, column) {
            Ok(ids) => ids,
            Err(reason) => {
                let reason = format!(
                    "the part was sent while the table's columns changed and must be checked against the table before it is sent again, but its `{column}` values cannot be read back ({reason}). Check the state directory's integrity (flow-worker status)"
                );
                return Err(self.give_up(&batch.shard, stopped_by(reason)).await);
            }
        };
        let queries = presence_queries(&session.database, &session.table, column, &ids);
        let part = Presence::of_part(&ids);
        let mut stop = stop.clone();
        let mut warned: Option<std::time::Instant> = None;
        loop {
            let timeout = self.shared.dynamic().write_timeout;
            let pause = match attempt_running(shard, &batch.token, timeout).await {
                Some(host) => CheckPause::Running { host },
                None => match decide(part, &replica_answers(shard, &queries, timeout).await) {
                    Verdict::Landed { host } => {
                        warn!(
                            pipeline = %key.pipeline,
                            sink = %key.sink,
                            partition = key.partition,
                            shard = %batch.shard,
                            token = %batch.token,
                            rows = batch.rows,
                            host = %host,
                            "a part sent while the table's columns changed is in the table already (every one of its `{column}` ids, once): acknowledged without sending it again"
                        );
                        self.acknowledge(key, seq, batch).await?;
                        return Ok(false);
                    }
                    Verdict::Absent => {
                        self.drop_columns_changed(key, seq).await?;
                        return Ok(true);
                    }
                    Verdict::Partly { host, presence } => {
                        let reason = partly_present(session, batch, column, &ids, &host, presence);
                        return Err(self.give_up(&batch.shard, stopped_by(reason)).await);
                    }
                    Verdict::Unanswered { host, error } => CheckPause::Unanswered { host, error },
                },
            };
            if self
                .pause_check(key, batch, pause, &mut warned, &mut stop)
                .await
            {
                return Ok(false);
            }
        }
    }

    /// Waits before the replicas are asked again for a part sent while the table's columns
    /// changed, warning at most once a minute why; `true` once stopping.
    async fn pause_check(
        &self,
        key: &SinkPartition,
        batch: &SealedBatch,
        why: CheckPause,
        warned: &mut Option<std::time::Instant>,
        stop: &mut watch::Receiver<bool>,
    ) -> bool {
        if warned.is_none_or(|at| at.elapsed() >= LATE_MISMATCH_WARNING_EVERY) {
            *warned = Some(std::time::Instant::now());
            let (host, detail, what) = match &why {
                CheckPause::Running { host } => (
                    host,
                    attempt_query_id(&batch.token),
                    "an earlier attempt of a part sent while the table's columns changed is still running on a replica (an INSERT goes on after its client died): its ids are looked for once it ended. If it hangs, end it with `KILL QUERY WHERE query_id = '<detail>'` on that host",
                ),
                CheckPause::Unanswered { host, error } => (
                    host,
                    error.clone(),
                    "a part sent while the table's columns changed must be checked on every replica of its shard before it is sent again, and this one does not answer (it may hold the part not yet replicated); asking again. Bring the host back",
                ),
            };
            warn!(
                pipeline = %key.pipeline,
                sink = %key.sink,
                partition = key.partition,
                shard = %batch.shard,
                token = %batch.token,
                host = %host,
                detail = %detail,
                "{what}"
            );
        }
        let pause = self.shared.dynamic().retry_backoff.max(MIN_CHECK_PAUSE);
        tokio::select! {
            _ = tokio::time::sleep(pause) => false,
            _ = stop.wait_for(|s| *s) => true,
        }
    }

    /// When the session's columns differ from those the partition's attempts were last made
    /// under, marks every entry that may have landed under the old ones as sent while the
    /// columns changed, so that its ids are looked for before it is sent again: on a server
    /// without `insert_deduplication_token` a part stored under other columns is another block,
    /// and a resend would not be recognised as a replay ([`crate::exactly_once::landed`]).
    /// The entries in doubt: at a start (`backlog`: the pending entries) every pending one
    /// unless the run before ended drained, since it may have stored one without acknowledging
    /// it (a kill between the INSERT and its acknowledgement); later, those with an unanswered
    /// attempt and those still [`PartitionMarks::inherited`] from such a run. Before an attempt
    /// (`backlog` `None`) the columns are then recorded, after the marks, so that a crash in
    /// between marks again rather than not at all; not while another lane's attempt made under
    /// other columns is out, which may land under them: a crash then finds the old record and
    /// marks every pending entry.
    pub async fn note_columns(
        &self,
        key: &SinkPartition,
        session: &WriterSession,
        backlog: Option<Vec<u64>>,
    ) -> Result<(), SinkError> {
        let now = AttemptedUnder {
            clean: false,
            columns: columns_text(session.plan().columns_guard.expected()),
        };
        let recorded = self.marks().columns.clone();
        let clean = recorded.as_ref().is_some_and(|r| r.clean);
        if let (Some(backlog), false) = (&backlog, clean) {
            self.marks().inherited = backlog.iter().copied().collect();
        }
        if recorded.as_ref() == Some(&now) {
            return Ok(());
        }
        let changed = recorded.as_ref().is_some_and(|r| r.columns != now.columns);
        if changed && !session.capabilities.insert_deduplication_token {
            let seqs: BTreeSet<u64> = match backlog.clone() {
                Some(backlog) if !clean => backlog.into_iter().collect(),
                _ => {
                    let marks = self.marks();
                    marks
                        .unanswered
                        .keys()
                        .chain(&marks.inherited)
                        .copied()
                        .collect()
                }
            };
            self.mark_changed(key, seqs).await?;
        }
        if backlog.is_some() {
            return Ok(());
        }
        let older_attempt_out = self
            .marks()
            .in_flight
            .values()
            .any(|columns| *columns != now.columns);
        if older_attempt_out {
            return Ok(());
        }
        self.record_columns(key, now).await
    }

    /// Marks `seqs` (those not marked yet) as sent while the table's columns changed.
    async fn mark_changed(
        &self,
        key: &SinkPartition,
        seqs: BTreeSet<u64>,
    ) -> Result<(), SinkError> {
        let (pipeline, sink) = (&key.pipeline, &key.sink);
        let text = "the table's columns changed since the part was last sent, which may have stored it under the old ones".to_owned();
        for seq in seqs {
            if self.marks().changed.contains_key(&seq) {
                continue;
            }
            let value = Some(text.clone().into_bytes());
            self.store
                .set_sink_value(pipeline, sink, &changed_marker(key.partition, seq), value)
                .await?;
            self.marks().changed.insert(seq, text.clone());
        }
        Ok(())
    }

    /// After the partition's delivery drained: no pending entry can be in the table without a
    /// mark, which the next start relies on ([`ClickHouseDeliverer::note_columns`]).
    pub async fn drained(&self, key: &SinkPartition) -> Result<(), SinkError> {
        let Some(recorded) = self.marks().columns.clone() else {
            return Ok(());
        };
        self.record_columns(
            key,
            AttemptedUnder {
                clean: true,
                ..recorded
            },
        )
        .await
    }

    async fn record_columns(
        &self,
        key: &SinkPartition,
        under: AttemptedUnder,
    ) -> Result<(), SinkError> {
        let value = Some(under.value());
        let record = self.marks().columns_record.clone();
        self.store
            .set_sink_value(&key.pipeline, &key.sink, &record, value)
            .await?;
        self.marks().columns = Some(under);
        Ok(())
    }

    /// Entry `seq` re-encoded for the session's plan when it was encoded before a widening the
    /// session adopted ([`WriterSession::plan_before_widening`]); `None` when it needs no
    /// re-encoding (or cannot have one: sending it is then refused with the way through).
    /// Called once the entry is known not to be in the table under other columns: a mark of
    /// [`ClickHouseDeliverer::note_columns`] was cleared by the replicas' answer, or there was
    /// none, so no attempt of it can have landed since the columns changed, and on a server
    /// with `insert_deduplication_token` the token recognises a replay whatever its bytes.
    fn widened(
        &self,
        key: &SinkPartition,
        seq: u64,
        batch: &SealedBatch,
        session: &WriterSession,
    ) -> Result<Option<SealedBatch>, SinkError> {
        let plan = session.plan();
        if batch.plan == plan.encoder.plan_fingerprint() {
            return Ok(None);
        }
        let Some(before) = session.plan_before_widening(&batch.plan) else {
            return Ok(None);
        };
        let unreadable = |reason: String| {
            SinkError::Refused(format!(
                "{key}: pending batch {seq} (token {}) was encoded before a column was widened and cannot be re-encoded for the wider column: {reason}. It stays in the outbox; narrow the column back on every host and restart to deliver it as it is",
                batch.token
            ))
        };
        let rows =
            unframe(&batch.format, &batch.payload).map_err(|err| unreadable(err.to_string()))?;
        let rows = widen_rows(before.encoder.columns(), plan.encoder.columns(), &rows)
            .map_err(|err| unreadable(err.to_string()))?;
        let (format, payload) = seal(self.shared.params.codec, &rows);
        tracing::info!(
            partition = key.partition,
            seq,
            token = %batch.token,
            plan = %plan.encoder.plan_fingerprint(),
            "a pending batch encoded before a column was widened is re-encoded for the wider column: no attempt of it can be in the table under the old columns"
        );
        Ok(Some(SealedBatch {
            format: format.as_str().to_owned(),
            content_hash: xxhash_rust::xxh64::xxh64(&rows, 0),
            encoded_bytes: rows.len() as u64,
            plan: plan.encoder.plan_fingerprint().to_owned(),
            payload,
            ..batch.clone()
        }))
    }

    /// Drops entry `seq`'s changed-columns and unanswered-attempt records: the replicas showed
    /// that no attempt landed.
    async fn drop_columns_changed(&self, key: &SinkPartition, seq: u64) -> Result<(), SinkError> {
        let (pipeline, sink) = (&key.pipeline, &key.sink);
        for name in [
            changed_marker(key.partition, seq),
            unanswered_marker(key.partition, seq),
        ] {
            self.store
                .set_sink_value(pipeline, sink, &name, None)
                .await?;
        }
        let mut marks = self.marks();
        marks.changed.remove(&seq);
        marks.unanswered.remove(&seq);
        marks.inherited.remove(&seq);
        Ok(())
    }

    fn late_checked(&self) -> std::sync::MutexGuard<'_, Vec<String>> {
        self.late_checked
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Delivers the part in pieces ([`SplitPart`]), as the server refused it with `refused`.
    async fn split(
        &self,
        key: &SinkPartition,
        seq: u64,
        batch: &SealedBatch,
        refused: &ClassifiedError,
        session: &WriterSession,
        stop: &watch::Receiver<bool>,
    ) -> Result<(), SinkError> {
        let part = SplitPart {
            shared: &self.shared,
            session,
            store: &self.store,
            key,
            seq,
            batch,
            refused,
            metrics: &self.metrics,
        };
        match part.deliver(stop).await? {
            SplitOutcome::Delivered => {
                let mut marks = self.marks();
                marks.split.remove(&seq);
                marks.unanswered.remove(&seq);
                marks.inherited.remove(&seq);
                Ok(())
            }
            SplitOutcome::Stopped => Ok(()),
            SplitOutcome::GaveUp(reason) => Err(self.give_up(&batch.shard, reason).await),
        }
    }

    /// Sets the rows of an expired part aside as dead letters and acknowledges it.
    async fn expire(
        &self,
        key: &SinkPartition,
        seq: u64,
        batch: &SealedBatch,
        session: &WriterSession,
        expiry: Expired,
    ) -> Result<(), SinkError> {
        let error = self
            .marks()
            .unanswered
            .get(&seq)
            .cloned()
            .unwrap_or_default();
        let reason = format!(
            "not sent again: an earlier attempt got no answer ({error}) and the batch is {} s old, past the shard's deduplication window of {} s, so a resend could land it twice. Check whether its rows are in the table and requeue them if not",
            expiry.age.as_secs(),
            expiry.window.as_secs()
        );
        let refused = ClassifiedError::from_server(None, error);
        let shard = session.shard_index(&batch.shard);
        let part = RefusedPart::of_batch(batch, shard, &refused);
        let dead = part.set_aside(session, key.partition, &reason)?;
        warn!(
            pipeline = %key.pipeline,
            sink = %key.sink,
            partition = key.partition,
            token = %batch.token,
            rows = batch.rows,
            age_s = expiry.age.as_secs(),
            window_s = expiry.window.as_secs(),
            "a batch that may have landed unanswered is past the deduplication window; its rows are dead letters instead of a possible duplicate (on_expired_backlog: dead_letter). Check the table, then requeue or purge them"
        );
        let counters = self.delivered(batch, batch.rows);
        let extras = AckExtras {
            removed_sink_values: vec![unanswered_marker(key.partition, seq)],
            dead_letters: dead,
            counters: counters.clone(),
            ..AckExtras::default()
        };
        self.store.acknowledge_with(key, seq, extras).await?;
        self.metrics.applied(&counters);
        let mut marks = self.marks();
        marks.unanswered.remove(&seq);
        marks.inherited.remove(&seq);
        Ok(())
    }
}

/// Why the replicas are asked again for a part sent while the table's columns changed (its
/// warning's `detail`: the attempt's `query_id`, or the replica's error).
enum CheckPause {
    /// `host` still runs an earlier attempt of the part, which may yet land.
    Running { host: String },
    /// `host` did not answer while no replica shows the part.
    Unanswered { host: String, error: String },
}

/// What each replica of `shard` answers to the presence `queries` of one part.
async fn replica_answers(
    shard: &ShardClients,
    queries: &[String],
    timeout: std::time::Duration,
) -> Vec<ReplicaAnswer> {
    join_all(shard.endpoints.iter().map(|endpoint| async move {
        let mut presence = Presence::default();
        for query in queries {
            let rows = endpoint
                .query_json(query, timeout)
                .await
                .map_err(|err| err.to_string())?;
            rows.first()
                .and_then(|row| presence.add(row))
                .ok_or_else(|| format!("no count in the answer to `{query}`"))?;
        }
        Ok(presence)
    }))
    .await
    .into_iter()
    .zip(&shard.endpoints)
    .map(|(answer, endpoint)| (endpoint.endpoint.to_string(), answer))
    .collect()
}

/// The first replica of `shard` still running an attempt of the part with `token`
/// ([`running_attempts_query`]). A replica that cannot tell is not waited for: the check of
/// the part's ids asks it again, and one that never answers holds no INSERT that can land.
async fn attempt_running(
    shard: &ShardClients,
    token: &str,
    timeout: std::time::Duration,
) -> Option<String> {
    let query = running_attempts_query(token);
    let answers = join_all(shard.endpoints.iter().map(|endpoint| {
        let query = &query;
        async move {
            let rows = endpoint.query_json(query, timeout).await.ok()?;
            let running = rows.first().and_then(|row| json_u64(row, "running"))?;
            (running > 0).then(|| endpoint.endpoint.to_string())
        }
    }))
    .await;
    answers.into_iter().flatten().next()
}

/// An entry's attempts out, in [`PartitionMarks::in_flight`] until dropped: while they may land
/// under the columns they were made under, the partition's record of its columns stays as it
/// was ([`ClickHouseDeliverer::note_columns`]).
struct AttemptOut<'a> {
    deliverer: &'a ClickHouseDeliverer,
    seq: u64,
}

impl<'a> AttemptOut<'a> {
    fn new(deliverer: &'a ClickHouseDeliverer, seq: u64, session: &WriterSession) -> Self {
        let columns = columns_text(session.plan().columns_guard.expected());
        deliverer.marks().in_flight.insert(seq, columns);
        AttemptOut { deliverer, seq }
    }
}

impl Drop for AttemptOut<'_> {
    fn drop(&mut self) {
        self.deliverer.marks().in_flight.remove(&self.seq);
    }
}

/// The attempt log of one pending entry ([`AttemptLog`]).
struct EntryAttempts<'a> {
    deliverer: &'a ClickHouseDeliverer,
    key: &'a SinkPartition,
    seq: u64,
    shard: &'a str,
    sealed_at_ms: u64,
    window: Option<std::time::Duration>,
}

#[async_trait]
impl AttemptLog for EntryAttempts<'_> {
    async fn unanswered(&self, error: &ClassifiedError) -> Result<(), SinkError> {
        let metrics = &self.deliverer.metrics;
        let shard = Some(self.shard);
        metrics
            .record(&[metrics.add(SinkCount::UnansweredInserts, shard, 1)])
            .await?;
        if self.deliverer.marks().unanswered.contains_key(&self.seq) {
            return Ok(());
        }
        let text = error.to_string();
        let name = unanswered_marker(self.key.partition, self.seq);
        let (pipeline, sink) = (&self.key.pipeline, &self.key.sink);
        let value = Some(text.clone().into_bytes());
        self.deliverer
            .store
            .set_sink_value(pipeline, sink, &name, value)
            .await?;
        self.deliverer.marks().unanswered.insert(self.seq, text);
        Ok(())
    }

    async fn columns_changed(
        &self,
        error: &ClassifiedError,
        landed: bool,
    ) -> Result<(), SinkError> {
        let deliverer = self.deliverer;
        let may_be_there = landed || deliverer.marks().unanswered.contains_key(&self.seq);
        if !may_be_there || deliverer.marks().changed.contains_key(&self.seq) {
            return Ok(());
        }
        let text = error.message.clone();
        let name = changed_marker(self.key.partition, self.seq);
        let (pipeline, sink) = (&self.key.pipeline, &self.key.sink);
        let value = Some(text.clone().into_bytes());
        deliverer
            .store
            .set_sink_value(pipeline, sink, &name, value)
            .await?;
        deliverer.marks().changed.insert(self.seq, text);
        Ok(())
    }

    fn expired(&self) -> Option<Expired> {
        let policy = self.deliverer.shared.params.on_expired_backlog;
        if policy.unwrap_or_default() == OnExpiredBacklog::Send {
            return None;
        }
        let unanswered = self.deliverer.marks().unanswered.contains_key(&self.seq);
        expired(self.sealed_at_ms, now_ms(), self.window, unanswered)
    }
}

#[async_trait]
impl BatchDeliverer for ClickHouseDeliverer {
    /// A sharded sink's lanes may set a stalled shard's batches aside: the outbox keeps them.
    fn reloads(&self) -> bool {
        self.shared.sharded
    }

    async fn reload(
        &self,
        key: &SinkPartition,
        shard: &str,
        after: Option<u64>,
    ) -> Result<Option<(u64, SealedBatch)>, SinkError> {
        let (store, task_key, task_shard) = (self.store.clone(), key.clone(), shard.to_owned());
        let next = blocking(move || store.next_undelivered(&task_key, &task_shard, after)).await?;
        let Some(stored) = next else {
            return Ok(None);
        };
        let seq = stored.seq;
        let batch = match &stored.body {
            StoredBody::Payload(location) => {
                let (store, task_key, location) =
                    (self.store.clone(), key.clone(), location.clone());
                let payload = blocking(move || store.load_payload(&task_key, &location)).await?;
                SealedBatch {
                    payload,
                    ..stored.batch
                }
            }
            StoredBody::Rebuild { .. } => {
                let Some(session) = self.shared.session(&self.ctx.shutdown).await? else {
                    return Ok(None);
                };
                let requeue = Requeue {
                    shared: &self.shared,
                    session: &session,
                    ctx: &self.ctx,
                };
                requeue.rebuild_one(stored).await?
            }
        };
        Ok(Some((seq, batch)))
    }

    async fn deliver(
        &self,
        key: &SinkPartition,
        seq: u64,
        batch: &SealedBatch,
        stop: &watch::Receiver<bool>,
    ) -> Result<(), SinkError> {
        // A change of the columns adopted around an attempt: decide again how to send it.
        while !self.deliver_once(key, seq, batch, stop).await? {}
        Ok(())
    }
}

impl ClickHouseDeliverer {
    /// One go at delivering entry `seq`; `false` when the session adopted a change of the
    /// table's columns meanwhile and the entry is to be looked at again.
    async fn deliver_once(
        &self,
        key: &SinkPartition,
        seq: u64,
        batch: &SealedBatch,
        stop: &watch::Receiver<bool>,
    ) -> Result<bool, SinkError> {
        self.exactly_once
            .check_gave_up(key.partition, Some(&batch.token))?;
        let Some(session) = self.session_to_send(key, batch, stop).await? else {
            return Ok(true);
        };
        // With `insert_deduplication_token` the token, not the content, identifies a replay:
        // a resend under other columns is still dropped, so there is nothing to check.
        let changed = self.marks().changed.contains_key(&seq)
            && !session.capabilities.insert_deduplication_token;
        if changed
            && !self
                .send_after_columns_changed(key, seq, batch, &session, stop)
                .await?
        {
            return Ok(true);
        }
        let split = self.marks().split.get(&seq).cloned();
        if let Some(refused) = split {
            self.split(key, seq, batch, &refused, &session, stop)
                .await?;
            return Ok(true);
        }
        let widened = self.widened(key, seq, batch, &session)?;
        let sent = widened.as_ref().unwrap_or(batch);
        let attempts = EntryAttempts {
            deliverer: self,
            key,
            seq,
            shard: &batch.shard,
            sealed_at_ms: batch.sealed_at_ms,
            window: session.dedup_window_time(&batch.shard),
        };
        let mut stop = stop.clone();
        let out = AttemptOut::new(self, seq, &session);
        // The stored batch names its shard; the name is resolved to the session's index once.
        let inserted = match session.shard_index(&batch.shard) {
            Some(shard) => {
                let request = InsertRequest {
                    shard,
                    token: Some(&batch.token),
                    payload: &sent.payload,
                    plan: &sent.plan,
                    compressed: is_framed(&sent.format),
                    sealed_at_ms: Some(batch.sealed_at_ms),
                    answered_code: None,
                    attempts: Some(&attempts),
                    metrics: &self.metrics,
                };
                insert_part(&self.shared, &session, request, &mut stop).await
            }
            None => Err(unconfigured_shard(&self.shared, &batch.shard)),
        };
        drop(out);
        self.settle(key, seq, batch, &session, inserted, &stop)
            .await
    }

    /// The session a batch is sent under, once the sink may send it now: `None` while stopping,
    /// after an incompatible change of the table's columns stopped the sink (the session logged
    /// why; the batch stays in the outbox, and the partition, with the pipeline's other sinks,
    /// goes on), or while its shard's late target does not fit.
    async fn session_to_send(
        &self,
        key: &SinkPartition,
        batch: &SealedBatch,
        stop: &watch::Receiver<bool>,
    ) -> Result<Option<Arc<WriterSession>>, SinkError> {
        let Some(session) = self.shared.session(stop).await? else {
            return Ok(None);
        };
        if session.stopped().is_some()
            || !self
                .late_target_fits(key, &batch.shard, &session, stop)
                .await?
        {
            return Ok(None);
        }
        self.note_columns(key, &session, None).await?;
        Ok(Some(session))
    }

    /// What an INSERT's outcome does to its stored batch: acknowledged, kept (stopping, or the
    /// sink stopped on its table's columns), expired, sent in pieces, or given up. `Ok(false)`:
    /// it goes back to the lane to be sent again ([`InsertFailure::Replanned`]).
    async fn settle(
        &self,
        key: &SinkPartition,
        seq: u64,
        batch: &SealedBatch,
        session: &WriterSession,
        inserted: Result<u32, InsertFailure>,
        stop: &watch::Receiver<bool>,
    ) -> Result<bool, SinkError> {
        let done = match inserted {
            Err(InsertFailure::Replanned) => return Ok(false),
            Ok(_) => self.acknowledge(key, seq, batch).await,
            // Stopping leaves the batch in the outbox for the next run.
            Err(InsertFailure::Stopped) => Ok(()),
            Err(InsertFailure::Expired(expiry)) => {
                self.expire(key, seq, batch, session, expiry).await
            }
            Err(InsertFailure::State(err)) => Err(err),
            Err(InsertFailure::GaveUp(gave_up)) if self.splits(&gave_up.error) => {
                self.split(key, seq, batch, &gave_up.error, session, stop)
                    .await
            }
            Err(InsertFailure::GaveUp(gave_up)) if session.stopped().is_some() => {
                // Kept in the outbox with the stopped sink's others; what this attempt found
                // (an INSERT that succeeded as the columns changed) is for the operator.
                warn!(
                    partition = key.partition,
                    seq,
                    token = %batch.token,
                    error = %gave_up.error,
                    "a pending batch is kept in the outbox: this sink stopped on an incompatible change of its table's columns"
                );
                Ok(())
            }
            Err(InsertFailure::GaveUp(gave_up)) => {
                let reason = gave_up.reason(session, &batch.shard, Some(&batch.token));
                Err(self.give_up(&batch.shard, reason).await)
            }
        };
        done.map(|()| true)
    }
}
