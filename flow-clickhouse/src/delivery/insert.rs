//! One INSERT of one part ([`insert_part`]): sent to the shard's current host, failing over to
//! the next host after each failed attempt, retried as the sink's guarantee says for the error
//! class ([`crate::config::guarantee::Guarantee::on_failure`]), ending early on a stop.

use std::borrow::Cow;
use std::fmt;
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use flow_core::delivery::now_ms;
use flow_core::{SinkCount, SinkError, SinkMetrics};
use flow_state::ErrorRecord;
use tokio::sync::watch;
use tracing::{debug, warn};

use crate::config::dynamic::ClickHouseDynamicParams;
use crate::config::guarantee::{GiveUp, OnFailure};
use crate::config::topology::ShardIndex;
use crate::delivery::backlog_age::Expired;
use crate::delivery::cutter::Part;
use crate::delivery::sink_state::SinkShared;
use crate::server::classify::{
    is_replica_local, log_unknown, refused_unstored, ClassifiedError, ErrorClass,
};
use crate::server::client::{EndpointClient, InsertError, ShardClients};
use crate::server::session::{ColumnsPlan, WriterSession};

/// How one INSERT ended without success.
#[derive(Debug)]
pub enum InsertFailure {
    /// The pipeline is stopping; nothing more was tried. The part may be in the table (stored
    /// while the columns changed, the stop came before the hosts agreed on the new ones): its
    /// attempt log, if it has one, says so.
    Stopped,
    /// The guarantee allows no further attempt.
    GaveUp(GaveUp),
    /// Not sent again: it may have landed unanswered and is past the dedup window.
    Expired(Expired),
    /// Recording an unanswered attempt failed.
    State(SinkError),
    /// The table's columns changed compatibly and the session adopted them
    /// ([`WriterSession::refresh_columns`]) before this part was sent, or after it was stored:
    /// its caller decides again how to send it (it may now be in the table under the old
    /// columns, or encoded for a plan the session left), or between two attempts (an earlier
    /// one may have stored it under the old columns). Only parts with an [`AttemptLog`]
    /// end so; the others are sent again (or counted as stored) at once.
    Replanned,
}

impl InsertFailure {
    /// The error of a failure its caller has no handling of its own for.
    pub fn into_sink_error(self) -> SinkError {
        match self {
            InsertFailure::Stopped => SinkError::Delivery {
                reason: "the pipeline stopped during an insert".to_owned(),
            },
            InsertFailure::Replanned => SinkError::Delivery {
                reason: "the table's columns changed during an insert".to_owned(),
            },
            InsertFailure::GaveUp(gave_up) => SinkError::Target {
                context: format!("insert given up after {} attempt(s)", gave_up.attempts),
                source: Box::new(gave_up.error),
            },
            InsertFailure::Expired(expired) => SinkError::Delivery {
                reason: format!(
                    "a part that may have landed unanswered is {} s old, past the deduplication window of {} s",
                    expired.age.as_secs(),
                    expired.window.as_secs()
                ),
            },
            InsertFailure::State(err) => err,
        }
    }
}

/// What an exactly-once sink keeps about the attempts at one pending part.
#[async_trait]
pub trait AttemptLog: Send + Sync {
    /// An attempt sent the whole part and got no verdict; recorded durably before any retry.
    async fn unanswered(&self, error: &ClassifiedError) -> Result<(), SinkError>;
    /// Whether the part must not be sent again ([`crate::delivery::backlog_age::expired`]).
    fn expired(&self) -> Option<Expired>;
    /// The table's columns changed around an attempt: after it stored the part (`landed`), or
    /// before one (nothing sent then, but an earlier unanswered attempt may have landed). Where
    /// the part may be in the table, this is recorded durably so that it is checked against the
    /// table before it is sent again ([`crate::exactly_once::landed`]).
    async fn columns_changed(&self, error: &ClassifiedError, landed: bool)
        -> Result<(), SinkError>;
}

/// Whether a failure of the columns guard's check before an INSERT is the columns' change
/// itself rather than a failure to read them: the guard reports a change as a permanent error
/// without a server code, the one kind of error nothing else builds (a server's answer carries
/// its code; the client's own failures are retryable or unclassified).
fn is_columns_change(error: &ClassifiedError) -> bool {
    error.class == ErrorClass::Permanent && error.code.is_none()
}

/// ClickHouse's NO_SUCH_COLUMN_IN_TABLE.
const NO_SUCH_COLUMN_IN_TABLE: u32 = 16;

/// Whether the server refused an INSERT because a column it names is not in the table: an
/// `ALTER ... DROP COLUMN` landed between the columns guard's check and the INSERT. The server
/// refuses it while reading the query, before any row, so nothing was stored; the columns are
/// read again and the change decided as the refresh decides it, not given up as permanent.
fn is_column_missing_refusal(failure: &InsertError) -> bool {
    !failure.unanswered && failure.error.code == Some(NO_SUCH_COLUMN_IN_TABLE)
}

/// An INSERT the sink's guarantee allows no further attempt for.
#[derive(Debug)]
pub struct GaveUp {
    pub error: ClassifiedError,
    pub attempts: u32,
    pub endpoint: String,
    /// What giving up means for the sink.
    pub give_up: GiveUp,
}

impl GaveUp {
    /// The `Giving up insert into ClickHouse` reason for a part of `shard` (with its token where
    /// the class has one).
    pub fn reason(
        &self,
        session: &WriterSession,
        shard: &str,
        token: Option<&str>,
    ) -> GiveUpReason {
        let GaveUp {
            error,
            attempts,
            endpoint,
            ..
        } = self;
        let token = token.map(|t| format!(", token {t}")).unwrap_or_default();
        GiveUpReason {
            context: format!(
                "Giving up insert into ClickHouse: {}.{} shard `{shard}` via {endpoint} after {attempts} attempt(s){token}",
                session.database, session.table
            ),
            error: error.clone(),
        }
    }
}

/// Why an insert was given up: what was tried, and the error it ended with.
#[derive(Clone, Debug)]
pub struct GiveUpReason {
    pub context: String,
    pub error: ClassifiedError,
}

impl GiveUpReason {
    /// The error the sink fails with (`delivery stopped: Giving up insert into ClickHouse: …`),
    /// keeping the ClickHouse error as its source.
    pub fn to_sink_error(&self) -> SinkError {
        SinkError::Target {
            context: format!("delivery stopped: {}", self.context),
            source: Box::new(self.error.clone()),
        }
    }
}

impl fmt::Display for GiveUpReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.context, self.error)
    }
}

/// What one INSERT sends.
#[derive(Clone, Copy)]
pub struct InsertRequest<'a> {
    pub shard: ShardIndex,
    /// Sent as `insert_deduplication_token` (with `async_insert_deduplicate`) where the server
    /// has it; `None` for the classes without a token.
    pub token: Option<&'a str>,
    pub payload: &'a Bytes,
    /// The fingerprint of the plan the payload was encoded with
    /// ([`crate::encode::rowbinary::RowBinaryEncoder::plan_fingerprint`]): it is sent only
    /// while the session plans the same.
    pub plan: &'a str,
    /// The payload is in ClickHouse's compression framing.
    pub compressed: bool,
    /// When the part was sealed into the outbox (ms since the Unix epoch): while it cannot be
    /// sent, its age is watched against the shard's dedup window ([`crate::delivery::backlog_age`]).
    pub sealed_at_ms: Option<u64>,
    /// The code the server already refused these rows with (a piece of a refused part,
    /// [`crate::delivery::split`]): an attempt failing with it again is final, without a retry.
    pub answered_code: Option<u32>,
    /// Where unanswered attempts are recorded and expiry is decided (exactly-once classes).
    pub attempts: Option<&'a dyn AttemptLog>,
    /// The sink partition's metrics: failed attempts are counted durably, INSERTs timed.
    pub metrics: &'a SinkMetrics,
}

impl<'a> InsertRequest<'a> {
    /// A part sent without token, seal time or attempt log: the classes without an outbox
    /// (at-least-once, at-most-once).
    pub fn unrecorded(part: &'a Part, metrics: &'a SinkMetrics) -> InsertRequest<'a> {
        InsertRequest {
            shard: part.shard,
            token: None,
            payload: &part.payload,
            plan: &part.plan,
            compressed: part.compressed(),
            sealed_at_ms: None,
            answered_code: None,
            attempts: None,
            metrics,
        }
    }
}

/// The failure of a part whose shard (a stored batch's, by name) is not configured any more.
pub fn unconfigured_shard(shared: &SinkShared, shard_name: &str) -> InsertFailure {
    InsertFailure::GaveUp(GaveUp {
        error: ClassifiedError::from_server(
            None,
            format!("shard `{shard_name}` is not configured any more"),
        ),
        attempts: 0,
        endpoint: String::new(),
        give_up: on_failure_of(shared, ErrorClass::Unknown).give_up,
    })
}

/// How often a part for a shard without an admitted host looks again.
const ADMISSION_POLL: Duration = Duration::from_millis(500);

/// How often a part stored while the hosts disagree on the table's columns warns again.
const DISAGREEMENT_WARNING_EVERY: Duration = Duration::from_secs(30);

/// After an INSERT that stored its part while the table's columns changed: whether the session,
/// once the hosts agree on the new columns, still plans as the part was encoded (`fingerprint`).
/// Hosts that disagree (an ALTER reaching the shards one by one) are waited out, not taken for
/// a change the part may have been garbled by; columns that cannot be read for another reason
/// answer `false`. `None`: the pipeline stops meanwhile (the part's attempt log, if any, already
/// says its columns changed, so the next start checks it by its ids).
async fn plan_kept_after_change(
    session: &WriterSession,
    fingerprint: &str,
    timeout: Duration,
    backoff: Duration,
    stop: &mut watch::Receiver<bool>,
) -> Option<bool> {
    let mut warned: Option<std::time::Instant> = None;
    loop {
        match session.refresh_columns(timeout).await {
            Ok(()) => return Some(session.plan().encoder.plan_fingerprint() == fingerprint),
            Err(error) if error.class == ErrorClass::Retryable => {
                if warned.is_none_or(|at| at.elapsed() >= DISAGREEMENT_WARNING_EVERY) {
                    warned = Some(std::time::Instant::now());
                    warn!(
                        database = %session.database,
                        table = %session.table,
                        error = %error,
                        "a part was stored while the table's columns changed, and the hosts do not agree on the new ones yet: the sink waits until they do before it decides whether the part's columns were kept. If this lasts, make the table's columns identical on every host"
                    );
                }
                tokio::select! {
                    _ = tokio::time::sleep(backoff.max(Duration::from_millis(100))) => {}
                    _ = stop.wait_for(|s| *s) => return None,
                }
            }
            Err(_) => return Some(false),
        }
    }
}

/// Whether the server reads each INSERT of this sink as one block, so that a refusal while
/// reading it stored nothing: the sink's batch limits stay under the server's block sizes, unless
/// the user's `settings` change how the server cuts a body into blocks.
fn one_block_per_insert(session: &WriterSession) -> bool {
    !session.settings.iter().any(|(name, _)| {
        matches!(
            name.as_str(),
            "max_insert_block_size" | "min_insert_block_size_rows" | "min_insert_block_size_bytes"
        )
    })
}

/// Sends one part to its shard, failing over to the next host after each failed attempt.
/// Retries follow the sink's guarantee ([`crate::config::guarantee::Guarantee::on_failure`]).
pub async fn insert_part(
    shared: &SinkShared,
    session: &WriterSession,
    request: InsertRequest<'_>,
    stop: &mut watch::Receiver<bool>,
) -> Result<u32, InsertFailure> {
    let Some(shard) = session.shards.get(request.shard.0) else {
        return Err(unconfigured_shard(shared, &format!("#{}", request.shard.0)));
    };
    let mut call = PartInsert {
        shared,
        session,
        shard,
        request,
        attempts: 0,
        refused_here: Vec::new(),
        stored_maybe: None,
        generation: session.plan().generation,
    };
    loop {
        if let Some(expired) = request.attempts.and_then(|log| log.expired()) {
            return Err(InsertFailure::Expired(expired));
        }
        let dynamic = shared.dynamic();
        let Some(endpoint) = next_endpoint(shard, &call.refused_here) else {
            // No host of the shard has answered since the session started: nothing to try yet
            // (`late_hosts` admits one once it answers).
            tokio::select! {
                _ = tokio::time::sleep(ADMISSION_POLL) => continue,
                _ = stop.wait_for(|s| *s) => return Err(InsertFailure::Stopped),
            }
        };
        let plan = session.plan();
        call.check_plan(&plan).await?;
        let failure = match call.attempt(endpoint, &plan, &dynamic).await? {
            Attempt::Stored { started } => {
                return call.stored(endpoint, &plan, &dynamic, started, stop).await
            }
            Attempt::Resend => continue,
            Attempt::Failed(failure) => failure,
        };
        let error = call.note_failure(failure).await?;
        match call.after_failure(endpoint, error, &dynamic).await? {
            Retry::AtOnce => continue,
            Retry::After(pause) => tokio::select! {
                _ = tokio::time::sleep(pause) => {}
                _ = stop.wait_for(|s| *s) => return Err(InsertFailure::Stopped),
            },
        }
    }
}

/// One call of [`insert_part`]: the part, and what its attempts so far tell.
struct PartInsert<'a> {
    shared: &'a SinkShared,
    session: &'a WriterSession,
    shard: &'a ShardClients,
    request: InsertRequest<'a>,
    attempts: u32,
    /// The replicas that refused this part with a replica-local error ([`is_replica_local`]):
    /// skipped for the rest of this insert, whatever the shared cursor says.
    refused_here: Vec<usize>,
    /// Whether an attempt of this call may have stored the part: it went out without an answer,
    /// or the server refused it in a way that does not say nothing was stored
    /// ([`may_have_stored`]).
    stored_maybe: Option<ClassifiedError>,
    /// The session's plan generation when the call started: columns adopted after it mean the
    /// attempts so far were made under others.
    generation: u64,
}

/// How one attempt of a part ended.
enum Attempt {
    /// The server stored the part (the INSERT started at `started`).
    Stored {
        started: std::time::Instant,
    },
    /// Nothing was sent, and the session adopted the table's new columns: the part is looked at
    /// again under them.
    Resend,
    Failed(InsertError),
}

/// When the next attempt after a failed one goes out.
enum Retry {
    /// At once, to the next replica (the failed one refused the part for itself only).
    AtOnce,
    /// After the shard's back-off.
    After(Duration),
}

/// An attempt that failed before anything was sent.
fn unsent(error: ClassifiedError) -> Attempt {
    Attempt::Failed(InsertError {
        error,
        unanswered: false,
    })
}

impl PartInsert<'_> {
    /// Whether the part may still be sent under `plan`; otherwise it goes back to its caller
    /// ([`InsertFailure::Replanned`]) or is given up.
    async fn check_plan(&self, plan: &ColumnsPlan) -> Result<(), InsertFailure> {
        let encoded_for = self.request.plan;
        let attempt_log = self.request.attempts;
        if plan.encoder.plan_fingerprint() != encoded_for {
            // A widening adopted while this part's attempts were refused in ways that store
            // nothing (a body the server could not read, its narrower bytes read as the wider
            // type; a block whose commit the server rolled back, the columns having changed
            // under it; the columns guard's refusal before sending): a part with an attempt log
            // goes back to its caller, which re-encodes it for the wider column. Any other
            // refusal may have stored the part (an unknown outcome), where a re-encoded copy
            // would not be recognised: given up, as below.
            if self.stored_maybe.is_none()
                && one_block_per_insert(self.session)
                && attempt_log.is_some()
                && self.session.plan_before_widening(encoded_for).is_some()
            {
                return Err(InsertFailure::Replanned);
            }
            // RowBinary carries no types: under another plan the bytes would be read as
            // other columns or types.
            return Err(InsertFailure::GaveUp(GaveUp {
                error: ClassifiedError {
                    class: ErrorClass::Permanent,
                    code: None,
                    message: format!(
                        "the part was encoded with plan {encoded_for} and the table's columns now give plan {}: {}",
                        plan.encoder.plan_fingerprint(),
                        self.session.plan_change(encoded_for)
                    ),
                },
                attempts: self.attempts,
                endpoint: String::new(),
                give_up: on_failure_of(self.shared, ErrorClass::Permanent).give_up,
            }));
        }
        if let (Some(log), true) = (attempt_log, plan.generation != self.generation) {
            // Other columns, same bytes: under them a resend is another block than one an
            // earlier attempt (of this call, or of a run that did not acknowledge it) may have
            // stored. The caller marks what may be in the table and looks for it first.
            if let Some(error) = &self.stored_maybe {
                log.columns_changed(error, true)
                    .await
                    .map_err(InsertFailure::State)?;
            }
            return Err(InsertFailure::Replanned);
        }
        Ok(())
    }

    /// One attempt on `endpoint`: the columns guard's check, then the INSERT.
    async fn attempt(
        &mut self,
        endpoint: &EndpointClient,
        plan: &ColumnsPlan,
        dynamic: &ClickHouseDynamicParams,
    ) -> Result<Attempt, InsertFailure> {
        self.attempts += 1;
        let request = &self.request;
        debug!(
            shard = %self.shard.name,
            endpoint = %endpoint.endpoint,
            token = request.token.unwrap_or(""),
            attempt = self.attempts,
            plan = %request.plan,
            generation = plan.generation,
            "sending a part"
        );
        let started = std::time::Instant::now();
        let timeout = dynamic.write_timeout;
        if let Err(error) = plan.columns_guard.before_insert(endpoint, timeout).await {
            return self.refused_before_sending(error, plan, timeout).await;
        }
        let settings = insert_settings(
            self.session,
            request.token,
            dynamic.async_insert,
            plan.encoder.holds_json(),
        );
        let sent = endpoint
            .insert(
                &plan.insert_sql,
                &settings,
                request.payload.clone(),
                request.compressed,
                timeout,
            )
            .await;
        match sent {
            Ok(()) => Ok(Attempt::Stored { started }),
            Err(failure) if is_column_missing_refusal(&failure) => {
                self.refused_before_sending(failure.error, plan, timeout)
                    .await
            }
            Err(failure) => Ok(Attempt::Failed(failure)),
        }
    }

    /// The columns guard's check before an INSERT failed, so nothing was sent, or the server
    /// refused the INSERT for a column the table no longer has ([`is_column_missing_refusal`]),
    /// which stored nothing either. A change of the table's columns is read again and the part
    /// sent under the adopted plan (a part with an attempt log goes back to its caller); an
    /// incompatible change stops the sink ([`WriterSession::refresh_columns`]); a failure to
    /// read them fails the attempt.
    async fn refused_before_sending(
        &self,
        error: ClassifiedError,
        plan: &ColumnsPlan,
        timeout: Duration,
    ) -> Result<Attempt, InsertFailure> {
        if !is_columns_change(&error) && error.code != Some(NO_SUCH_COLUMN_IN_TABLE) {
            return Ok(unsent(error));
        }
        if let Some(log) = self.request.attempts {
            log.columns_changed(&error, false)
                .await
                .map_err(InsertFailure::State)?;
        }
        match self.session.refresh_columns(timeout).await {
            // The shards' current hosts agree with the plan, this one does not (an ALTER
            // reaching the replicas one by one): wait and retry.
            Ok(()) if self.session.plan().generation == plan.generation => {
                Ok(unsent(ClassifiedError {
                    class: ErrorClass::Retryable,
                    code: None,
                    message: format!(
                        "{}; the other hosts still answer the columns the sink plans for, so it waits until they agree",
                        error.message
                    ),
                }))
            }
            Ok(()) if self.request.attempts.is_some() => Err(InsertFailure::Replanned),
            Ok(()) => Ok(Attempt::Resend),
            Err(error) => Ok(unsent(error)),
        }
    }

    /// The INSERT stored the part; the columns guard's check after it tells whether the
    /// table's columns changed meanwhile.
    async fn stored(
        &self,
        endpoint: &EndpointClient,
        plan: &ColumnsPlan,
        dynamic: &ClickHouseDynamicParams,
        started: std::time::Instant,
        stop: &mut watch::Receiver<bool>,
    ) -> Result<u32, InsertFailure> {
        let token = self.request.token;
        let checked = plan
            .columns_guard
            .after_insert(endpoint, dynamic.write_timeout, token, &self.shard.name)
            .await;
        if let Err(error) = checked {
            return self
                .stored_across_a_change(error, endpoint, plan, dynamic, started, stop)
                .await;
        }
        self.succeeded(started);
        debug!(
            token = token.unwrap_or(""),
            attempt = self.attempts,
            "part stored"
        );
        Ok(self.attempts)
    }

    /// The part was stored while the table's columns changed: it is in the table, perhaps under
    /// the new columns, where a resend is no replay.
    async fn stored_across_a_change(
        &self,
        error: ClassifiedError,
        endpoint: &EndpointClient,
        plan: &ColumnsPlan,
        dynamic: &ClickHouseDynamicParams,
        started: std::time::Instant,
        stop: &mut watch::Receiver<bool>,
    ) -> Result<u32, InsertFailure> {
        if let Some(log) = self.request.attempts {
            log.columns_changed(&error, true)
                .await
                .map_err(InsertFailure::State)?;
        }
        // A compatible change that left the columns this INSERT names as they were (a column
        // it does not name added or dropped): the server read the part right under either
        // layout. A part with an attempt log is marked and checked by its ids before it is
        // acknowledged (under other columns a resend is no replay). A widened column the part
        // was encoded for may have been read as the wider type: that stays a permanent error.
        let Some(kept) = plan_kept_after_change(
            self.session,
            plan.encoder.plan_fingerprint(),
            dynamic.write_timeout,
            dynamic.retry_backoff,
            stop,
        )
        .await
        else {
            return Err(InsertFailure::Stopped);
        };
        if !kept {
            return Err(InsertFailure::GaveUp(GaveUp {
                give_up: on_failure_of(self.shared, error.class).give_up,
                error,
                attempts: self.attempts,
                endpoint: endpoint.endpoint.to_string(),
            }));
        }
        if self.request.attempts.is_some() {
            return Err(InsertFailure::Replanned);
        }
        self.succeeded(started);
        Ok(self.attempts)
    }

    /// The shard's back-off decays and the INSERT's duration is observed.
    fn succeeded(&self, started: std::time::Instant) {
        self.shard.backoff.succeeded();
        self.request
            .metrics
            .observe_insert(Some(&self.shard.name), started.elapsed().as_secs_f64());
    }

    /// Notes what a failed attempt tells: an unanswered one is recorded in the part's attempt
    /// log before any retry, and either may have stored the part.
    async fn note_failure(
        &mut self,
        failure: InsertError,
    ) -> Result<ClassifiedError, InsertFailure> {
        let InsertError { error, unanswered } = failure;
        if let (true, Some(log)) = (unanswered, self.request.attempts) {
            log.unanswered(&error).await.map_err(InsertFailure::State)?;
        }
        if unanswered || may_have_stored(&error) {
            self.stored_maybe = Some(error.clone());
        }
        Ok(error)
    }

    /// What follows a failed attempt, as the sink's guarantee says for its error's class: the
    /// next attempt (at once on another replica, or after the shard's back-off), or the end of
    /// the insert.
    async fn after_failure(
        &mut self,
        endpoint: &EndpointClient,
        err: ClassifiedError,
        dynamic: &ClickHouseDynamicParams,
    ) -> Result<Retry, InsertFailure> {
        let (session, shard) = (self.session, self.shard);
        let answered =
            self.request.answered_code.is_some() && err.code == self.request.answered_code;
        if err.class == ErrorClass::Unknown && !answered {
            let host = endpoint.endpoint.to_string();
            log_unknown(&err, &session.database, &session.table, &host);
        }
        if is_replica_local(&err) && !answered && self.skip_replica(endpoint, &err).await? {
            return Ok(Retry::AtOnce);
        }
        let err = if self.refused_here.len() > 1 && is_replica_local(&err) {
            every_replica_refused(shard, err)
        } else {
            err
        };
        let on_failure = on_failure_of(self.shared, err.class);
        // Fail over whether or not this part is retried: where the guarantee allows one attempt,
        // the next part must not go to the host that just failed (at-most-once would lose every
        // later part while a live replica waits).
        shard.advance();
        let retried = !answered
            && on_failure
                .retry
                .again(self.attempts, dynamic.max_insert_attempts);
        count_failure(self.request.metrics, &shard.name, &err, retried)
            .await
            .map_err(InsertFailure::State)?;
        if !retried {
            return Err(InsertFailure::GaveUp(GaveUp {
                error: err,
                attempts: self.attempts,
                endpoint: endpoint.endpoint.to_string(),
                give_up: on_failure.give_up,
            }));
        }
        let pause = shard
            .backoff
            .failed(dynamic.retry_backoff, dynamic.retry_backoff_cap());
        warn!(
            database = %session.database,
            table = %session.table,
            shard = %shard.name,
            endpoint = %endpoint.endpoint,
            token = self.request.token.unwrap_or(""),
            attempt = self.attempts,
            pause_ms = pause.as_millis() as u64,
            shard_errors = shard.backoff.errors(),
            error = %err,
            "insert failed; retrying on the next host of the shard"
        );
        if let Some(sealed_at_ms) = self.request.sealed_at_ms {
            warn_backlog_age(session, shard, sealed_at_ms);
        }
        Ok(Retry::After(pause))
    }

    /// After a replica-local refusal ([`is_replica_local`]): that host is skipped for the rest
    /// of this insert; `true` when another replica is left to send the same bytes (and token)
    /// to at once. It answered, so nothing of the part was stored there: even at-most-once
    /// sends the rows no more than once.
    async fn skip_replica(
        &mut self,
        endpoint: &EndpointClient,
        err: &ClassifiedError,
    ) -> Result<bool, InsertFailure> {
        let (session, shard) = (self.session, self.shard);
        if let Some(index) = shard
            .endpoints
            .iter()
            .position(|e| std::ptr::eq(e, endpoint))
        {
            self.refused_here.push(index);
        }
        if next_endpoint(shard, &self.refused_here).is_none() {
            return Ok(false);
        }
        count_failure(self.request.metrics, &shard.name, err, true)
            .await
            .map_err(InsertFailure::State)?;
        shard.advance();
        warn!(
            database = %session.database,
            table = %session.table,
            shard = %shard.name,
            endpoint = %endpoint.endpoint,
            token = self.request.token.unwrap_or(""),
            attempt = self.attempts,
            error = %err,
            "replica {} refused the insert with an error about that host only (its table or database is missing or detached there, it is read-only, or its users differ); the part goes to the next replica of the shard. Fix that host (e.g. `ATTACH TABLE {}.{}` on it, or its users and grants): later parts try it again",
            endpoint.endpoint, session.database, session.table
        );
        Ok(true)
    }
}

/// Whether a refusal the server answered leaves it open that the part was stored: a code that
/// is not a verdict (unclassified or transient) and not one of those that store nothing
/// ([`refused_unstored`]). A failure without a code (the connection before the body went out,
/// the columns guard) sent nothing, and a permanent code refuses the INSERT as a whole.
fn may_have_stored(error: &ClassifiedError) -> bool {
    error.code.is_some() && error.class != ErrorClass::Permanent && !refused_unstored(error)
}

/// The endpoint for the next attempt: the shard's current one, or the next admitted one that has
/// not refused this part with a replica-local error; `None` when no such host is left (or none
/// is admitted yet).
fn next_endpoint<'s>(shard: &'s ShardClients, refused: &[usize]) -> Option<&'s EndpointClient> {
    let current = shard.current()?;
    let len = shard.endpoints.len();
    let start = shard
        .endpoints
        .iter()
        .position(|e| std::ptr::eq(e, current))
        .unwrap_or(0);
    (0..len)
        .map(|step| (start + step) % len)
        .filter(|index| !refused.contains(index))
        .map(|index| &shard.endpoints[index])
        .find(|endpoint| endpoint.admitted.load(std::sync::atomic::Ordering::Relaxed))
}

/// The last replica-local refusal, reworded once every replica of `shard` refused the part: it
/// is the shard's now, and permanent for the sink.
fn every_replica_refused(shard: &ShardClients, err: ClassifiedError) -> ClassifiedError {
    let hosts: Vec<String> = shard
        .endpoints
        .iter()
        .map(|e| e.endpoint.to_string())
        .collect();
    ClassifiedError {
        message: format!(
            "every replica of the shard refused the insert ({}); the last said: {}",
            hosts.join(", "),
            err.message
        ),
        ..err
    }
}

/// Counts a failed attempt durably (insert errors by class and code, retries) and shows it in
/// `status` as the shard's last error.
async fn count_failure(
    metrics: &SinkMetrics,
    shard: &str,
    error: &ClassifiedError,
    retried: bool,
) -> Result<(), SinkError> {
    let shard = Some(shard);
    let class = error.class.as_str().to_owned();
    let mut adds = vec![metrics.add(
        SinkCount::InsertErrors {
            class: class.clone(),
            code: error.code,
        },
        shard,
        1,
    )];
    if retried {
        adds.push(metrics.add(SinkCount::Retries, shard, 1));
    }
    let record = ErrorRecord {
        code: error.code,
        class,
        text: error.message.clone(),
        at_ms: now_ms(),
    };
    metrics.failed(shard, record, retried);
    metrics.record(&adds).await?;
    Ok(())
}

/// Warns (once a minute per shard) while the part being retried is older than half the shard's
/// dedup window.
fn warn_backlog_age(session: &WriterSession, shard: &ShardClients, sealed_at_ms: u64) {
    let Some(window) = session.dedup_window_time(&shard.name) else {
        return;
    };
    let age = Duration::from_millis(now_ms().saturating_sub(sealed_at_ms));
    if shard.backlog.warn_now(age, window) {
        warn!(
            database = %session.database,
            table = %session.table,
            shard = %shard.name,
            age_s = age.as_secs(),
            window_s = window.as_secs(),
            "the oldest pending batch of this shard is past half of the table's deduplication window; once past the window, a replay of a batch that landed unanswered would be inserted twice. Bring the shard back, or raise replicated_deduplication_window_seconds"
        );
    }
}

/// The sink's guarantee's reaction to a failure of `class`.
fn on_failure_of(shared: &SinkShared, class: ErrorClass) -> OnFailure {
    shared.class.guarantee().on_failure(class)
}

/// The `query_id` of every attempt of the part with `token`: a server refuses a second one while
/// the first still runs there (code 216), and a check of the table for the part waits until none
/// runs on any replica ([`crate::exactly_once::landed`]), since an INSERT whose body the server
/// read goes on after its client died.
pub fn attempt_query_id(token: &str) -> String {
    format!("flow:{token}")
}

/// The INSERT settings: the user's `settings` (validation refused those flow sets below), the
/// attempt's `query_id` and the deduplication token where the part has one (the token where the
/// server knows it), the `async_insert` settings when enabled, and how the RowBinary holds a
/// `JSON` column's values (as their text) when the plan has one.
fn insert_settings(
    session: &WriterSession,
    token: Option<&str>,
    async_insert: bool,
    json_as_text: bool,
) -> Vec<(Cow<'static, str>, String)> {
    let mut settings: Vec<(Cow<'static, str>, String)> = session
        .settings
        .iter()
        .map(|(name, value)| (Cow::Owned(name.clone()), value.clone()))
        .collect();
    if let Some(token) = token {
        settings.push((Cow::Borrowed("query_id"), attempt_query_id(token)));
    }
    if let (Some(token), true) = (token, session.capabilities.insert_deduplication_token) {
        settings.push((
            Cow::Borrowed("insert_deduplication_token"),
            token.to_owned(),
        ));
    }
    if token.is_some() && session.capabilities.insert_deduplicate {
        settings.push((Cow::Borrowed("insert_deduplicate"), "1".to_owned()));
    }
    if json_as_text {
        settings.push((
            Cow::Borrowed("input_format_binary_read_json_as_string"),
            "1".to_owned(),
        ));
    }
    if async_insert {
        settings.push((Cow::Borrowed("async_insert"), "1".to_owned()));
        settings.push((Cow::Borrowed("wait_for_async_insert"), "1".to_owned()));
        if token.is_some() {
            settings.push((Cow::Borrowed("async_insert_deduplicate"), "1".to_owned()));
        }
    }
    settings
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_guards_report_of_a_change_counts_as_a_columns_change() {
        let change = ClassifiedError {
            class: ErrorClass::Permanent,
            code: None,
            message: "the table's columns changed since the writer session started".into(),
        };
        assert!(is_columns_change(&change));
        // Failing to read the columns: the server's answer (a detached table), the network, or
        // an answer the client could not make sense of.
        for failure in [
            ClassifiedError::from_server(Some(60), "Table default.t doesn't exist"),
            ClassifiedError::network("connection refused"),
            ClassifiedError::from_server(None, "502 Bad Gateway"),
        ] {
            assert!(!is_columns_change(&failure), "{failure}");
        }
    }

    /// Code 16 answered by the server means the INSERT named a column the table no longer has
    /// and stored nothing: the columns are read again. Without an answer (the rows may have
    /// landed) or with another code it is an ordinary failure.
    #[test]
    fn only_an_answered_code_16_reads_the_columns_again() {
        let refusal = |code, unanswered| InsertError {
            error: ClassifiedError::from_server(Some(code), "No such column payload in table"),
            unanswered,
        };
        assert!(is_column_missing_refusal(&refusal(16, false)));
        assert!(!is_column_missing_refusal(&refusal(16, true)));
        for code in [60, 53, 27] {
            assert!(!is_column_missing_refusal(&refusal(code, false)), "{code}");
        }
    }
}
