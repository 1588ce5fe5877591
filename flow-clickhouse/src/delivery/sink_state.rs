//! The state one ClickHouse sink shares across its partitions ([`SinkShared`]): the validated
//! parameters, the input stream, the shard router, the dynamic parameters in force and the
//! writer session, started when the first partition opens.
//!
//! Starting the writer session while endpoints may be unreachable ([`wait_for_session`]):
//! unreachable endpoints are waited for (with the growing pause of [`crate::delivery::backoff`]),
//! warning on the first failure and then every [`SESSION_WAIT_WARNING_INTERVAL`]; a target that
//! cannot be written refuses the start; a stop ends the wait. Whether to wait again is the retry
//! decision inserts use ([`should_retry`]).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock, RwLock};
use std::time::{Duration, Instant};

use flow_core::registry::{BuildResult, SinkBuildContext};
use flow_core::{EpochOutcome, Readiness, SinkContext, SinkError, StreamSchema, Violation};
use tokio::sync::{watch, OnceCell};
use tracing::{info, warn};

use crate::config::dynamic::{self, ClickHouseDynamicParams};
use crate::config::guarantee::should_retry;
use crate::config::guarantee::SinkClass;
use crate::config::params::{self, SinkParams};
use crate::config::topology::ShardIndex;
use crate::delivery::backoff::RetryBackoff;
use crate::encode::routing::RendezvousRouter;
use crate::server::dedup_window::ReplayExposure;
use crate::server::probe::SessionError;
use crate::server::session::WriterSession;

/// State shared by every partition of one sink.
pub struct SinkShared {
    pub class: SinkClass,
    pub params: SinkParams,
    pub stream: Arc<StreamSchema>,
    pub key_columns: Vec<usize>,
    pub router: RendezvousRouter,
    pub sharded: bool,
    /// Partitions of the pipeline (bounds the batches in delivery at once).
    pub partitions: u32,
    /// How long the pipeline's epochs last at most (with the partitions, what a shard can be
    /// given while a late copy of a batch is on its way).
    pub epoch: Duration,
    /// The ZooKeeper session timeout of the cluster this worker joined, once a partition of
    /// the sink opened in cluster mode (see [`SinkShared::note_cluster`]).
    cluster_session: OnceLock<Duration>,
    session: OnceCell<Arc<WriterSession>>,
    /// Whether a partition already started the session in the background.
    session_started_early: AtomicBool,
    dynamic: RwLock<ClickHouseDynamicParams>,
}

/// Validates a sink's parameters and input, and builds its shared state.
pub fn build_shared(
    class: SinkClass,
    ctx: &SinkBuildContext<'_>,
    parameters: &serde_yaml::Value,
    dynamic: &serde_yaml::Value,
) -> BuildResult<Arc<SinkShared>> {
    let (params, dynamic) = params::parse(class, parameters, dynamic, ctx.paths)?;
    let [(_, stream)] = ctx.inputs else {
        return Err(vec![Violation::new(
            "input_stream_ids",
            format!(
                "a ClickHouse sink writes exactly one stream; {} are listed",
                ctx.inputs.len()
            ),
        )]);
    };
    let key_columns = key_columns(&params, stream)?;
    check_message_id_column(&params, stream)?;
    Ok(Arc::new(SinkShared {
        class,
        router: RendezvousRouter::new(&params.topology.shard_names()),
        sharded: params.topology.is_sharded(),
        params,
        stream: Arc::clone(stream),
        key_columns,
        partitions: ctx.partitions,
        epoch: ctx.epoch.max_duration,
        cluster_session: OnceLock::new(),
        session: OnceCell::new(),
        session_started_early: AtomicBool::new(false),
        dynamic: RwLock::new(dynamic),
    }))
}

/// The input columns of `sharding_key_columns`, in their order.
fn key_columns(params: &SinkParams, stream: &StreamSchema) -> BuildResult<Vec<usize>> {
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
    Ok(key_columns)
}

/// `message_id_column` must name an input column of an integer type: its values bound a part's
/// ids in the checks of [`crate::exactly_once::landed`].
fn check_message_id_column(params: &SinkParams, stream: &StreamSchema) -> BuildResult<()> {
    use flow_core::StreamType as T;
    let Some(name) = &params.message_id_column else {
        return Ok(());
    };
    let path = "parameters.message_id_column";
    let Some(index) = stream.index_of(name) else {
        let names: Vec<&str> = stream.columns().iter().map(|c| c.name.as_str()).collect();
        return Err(vec![Violation::new(
            path,
            format!(
                "`{name}` is not a column of the input stream (its columns: {}); name the column that carries the message id",
                names.join(", ")
            ),
        )]);
    };
    let ty = &stream.columns()[index].ty;
    match ty {
        T::Int8 | T::Int16 | T::Int32 | T::Int64 | T::Uint8 | T::Uint16 | T::Uint32 | T::Uint64 => {
            Ok(())
        }
        other => Err(vec![Violation::new(
            path,
            format!(
                "`{name}` is of type {other}, but a message id column must be an integer (int8..int64, uint8..uint64); name an integer column that identifies each message, or remove message_id_column"
            ),
        )]),
    }
}

impl SinkShared {
    /// The dynamic parameters in force.
    /// The in-flight byte budget: `max_in_flight_bytes` per shard. Each shard has its own
    /// delivery lane in every partition, so a budget that does not grow with the shards starves
    /// them: two shards under one 32 MiB budget delivered at 0.72-0.78 of a loop writing to both,
    /// with 64 MiB at 0.97 (docs/performance.md).
    pub fn in_flight_budget(&self) -> u64 {
        let shards = self.router.shards().len().max(1) as u64;
        self.dynamic().max_in_flight_bytes.saturating_mul(shards)
    }

    pub fn dynamic(&self) -> ClickHouseDynamicParams {
        self.dynamic
            .read()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .clone()
    }

    /// Validates and swaps the dynamic parameters (SIGHUP).
    pub fn reconfigure(&self, dynamic: &serde_yaml::Value) -> Result<(), SinkError> {
        let parsed = dynamic::parse_dynamic(self.class, dynamic)
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

    /// Starts the session in the background, once per sink, so that its checks run while the
    /// partitions read their first epoch instead of after it. A refusal is left to the call
    /// that needs the session ([`SinkShared::session`]), which starts it again and fails with it.
    /// Also has `/ready` ask this sink whether its session is up (see [`Readiness`]).
    pub fn start_session_early(
        self: &Arc<Self>,
        stop: &watch::Receiver<bool>,
        metrics: &flow_core::SinkMetrics,
    ) {
        let probe: Arc<dyn Readiness> = Arc::clone(self) as Arc<dyn Readiness>;
        metrics.register_readiness(Arc::downgrade(&probe));
        if self.session_started_early.swap(true, Ordering::Relaxed) {
            return;
        }
        let shared = Arc::clone(self);
        let stop = stop.clone();
        tokio::spawn(async move {
            // The outcome is the session cell's: a started session is kept there.
            let _ = shared.session(&stop).await;
        });
    }

    /// The session, started on first use; `None` if the pipeline began stopping while an
    /// endpoint was unreachable. See [`wait_for_session`].
    pub async fn session(
        &self,
        stop: &watch::Receiver<bool>,
    ) -> Result<Option<Arc<WriterSession>>, SinkError> {
        match self.table_session(stop).await? {
            TableSession::Up(session) => Ok(Some(session)),
            TableSession::Stopping => Ok(None),
            TableSession::Missing(err) => Err(err.into_sink_error()),
        }
    }

    /// [`SinkShared::session`] for one table of a table template: a table that does not exist
    /// is an answer, not an error, and is looked up again at the next call (a failed start is
    /// not kept), so a table created while the pipeline runs is found.
    pub async fn table_session(
        &self,
        stop: &watch::Receiver<bool>,
    ) -> Result<TableSession, SinkError> {
        let mut stop = stop.clone();
        let started = self
            .session
            .get_or_try_init(|| wait_for_session(self, &mut stop))
            .await;
        match started {
            Ok(session) => Ok(TableSession::Up(Arc::clone(session))),
            Err(SessionWait::Stopped) => Ok(TableSession::Stopping),
            Err(SessionWait::NoTable(err)) => Ok(TableSession::Missing(err)),
            Err(SessionWait::Refused(err)) => Err(err),
        }
    }

    /// The session if it started, without waiting for it.
    pub fn started_session(&self) -> Option<Arc<WriterSession>> {
        self.session.get().cloned()
    }

    /// Notes whether the partition of `ctx` runs in a cluster (its store mirrors to ZooKeeper):
    /// the dedup window is then checked against a takeover too. Called before the partition
    /// starts the session.
    pub fn note_cluster(&self, ctx: &SinkContext) {
        if let Some(mirror) = ctx.store.mirror() {
            let _ = self.cluster_session.set(mirror.session_timeout());
        }
    }

    /// What a copy of a batch can follow into a shard of this sink.
    pub(crate) fn exposure(&self) -> ReplayExposure {
        ReplayExposure::new(
            self.partitions,
            flow_core::delivery::DELIVERY_QUEUE_CAPACITY,
            self.epoch,
            self.cluster_session.get().copied(),
        )
    }

    /// The shared state of table `table` of a sink with a table template: these parameters
    /// with `table` resolved, a session of its own, the dynamic parameters in force.
    pub fn for_table(&self, table: &str) -> Arc<SinkShared> {
        let mut params = self.params.clone();
        params.table = table.to_owned();
        params.table_template = None;
        Arc::new(SinkShared {
            class: self.class,
            params,
            stream: Arc::clone(&self.stream),
            key_columns: self.key_columns.clone(),
            router: RendezvousRouter::new(&self.params.topology.shard_names()),
            sharded: self.sharded,
            partitions: self.partitions,
            epoch: self.epoch,
            cluster_session: self.cluster_session.clone(),
            session: OnceCell::new(),
            session_started_early: AtomicBool::new(false),
            dynamic: RwLock::new(self.dynamic()),
        })
    }

    /// The answer for an epoch when [`SinkShared::session`] found the pipeline stopping before
    /// the session started: not committed, and read again by the next run.
    pub fn not_started() -> EpochOutcome {
        EpochOutcome::Veto {
            reason: "the pipeline is stopping before the writer session started".to_owned(),
            retry_after: Duration::ZERO,
        }
    }

    /// The name of the shard at `index`, as logs, dead letters and stored batches show it
    /// (`""` for the unsharded forms).
    pub fn shard_name(&self, index: ShardIndex) -> &str {
        if self.sharded {
            self.router.shards().get(index.0).map_or("", String::as_str)
        } else {
            ""
        }
    }
}

/// Ready once the session started and every shard has a host that answered: before that, the
/// sink's INSERTs into the shard wait.
impl Readiness for SinkShared {
    fn not_ready(&self) -> Vec<String> {
        let Some(session) = self.session.get() else {
            return vec![format!(
                "the ClickHouse writer session for `{}`.`{}` has not started: waiting for its hosts to answer (the log says which do not)",
                self.params.database, self.params.table
            )];
        };
        let now = flow_core::delivery::now_ms();
        let target = |shard: &str| {
            let table = format!("`{}`.`{}`", self.params.database, self.params.table);
            if shard.is_empty() {
                table
            } else {
                format!("shard `{shard}` of {table}")
            }
        };
        // A shard none of whose hosts ever answered is named below instead.
        let answered = |shard: &&crate::server::client::ShardClients| {
            shard
                .endpoints
                .iter()
                .any(|endpoint| endpoint.admitted.load(Ordering::Relaxed))
        };
        let failing = session.shards.iter().filter(answered).filter_map(|shard| {
            let failing = shard.backoff.failing_for(now)?;
            (failing >= self.params.unready_after).then(|| {
                format!(
                    "{}: every INSERT has failed for {} s (unready_after_ms {}); its batches wait in the outbox",
                    target(&shard.name),
                    failing.as_secs(),
                    self.params.unready_after.as_millis()
                )
            })
        });
        let failing: Vec<String> = failing.collect();
        session
            .shards
            .iter()
            .filter(|shard| {
                !shard
                    .endpoints
                    .iter()
                    .any(|endpoint| endpoint.admitted.load(Ordering::Relaxed))
            })
            .map(|shard| {
                let hosts: Vec<String> = shard
                    .endpoints
                    .iter()
                    .map(|endpoint| endpoint.endpoint.to_string())
                    .collect();
                let target = format!("`{}`.`{}`", self.params.database, self.params.table);
                let target = if shard.name.is_empty() {
                    target
                } else {
                    format!("shard `{}` of {target}", shard.name)
                };
                format!(
                    "{target}: none of its hosts ({}) has answered since the session started; its batches wait",
                    hosts.join(", ")
                )
            })
            .chain(failing)
            .collect()
    }
}

/// A table's session, or why there is none ([`SinkShared::table_session`]).
pub enum TableSession {
    Up(Arc<WriterSession>),
    /// The table does not exist on a shard ([`SessionError::NoTable`]).
    Missing(SessionError),
    /// The pipeline began stopping while an endpoint was unreachable.
    Stopping,
}

/// How often a session start that keeps failing on unreachable endpoints warns again.
pub const SESSION_WAIT_WARNING_INTERVAL: Duration = Duration::from_secs(30);

/// Why a session start ended without a session.
pub(crate) enum SessionWait {
    /// The pipeline began stopping while an endpoint was unreachable.
    Stopped,
    /// The table does not exist on a shard.
    NoTable(SessionError),
    Refused(SinkError),
}

/// Starts the session of `shared`, waiting out unreachable endpoints; see the module doc.
pub(crate) async fn wait_for_session(
    shared: &SinkShared,
    stop: &mut watch::Receiver<bool>,
) -> Result<Arc<WriterSession>, SessionWait> {
    let params = &shared.params;
    let waiting_since = Instant::now();
    let mut attempts = 0u32;
    let mut last_warning: Option<Instant> = None;
    let backoff = RetryBackoff::default();
    loop {
        let dynamic = shared.dynamic();
        attempts = attempts.saturating_add(1);
        let result = WriterSession::start(
            shared.class,
            &shared.params,
            &dynamic,
            &shared.stream,
            shared.exposure(),
        )
        .await;
        match result {
            Ok(session) => {
                if attempts > 1 {
                    info!(
                        database = %params.database,
                        table = %params.table,
                        attempts,
                        waited_s = waiting_since.elapsed().as_secs(),
                        "ClickHouse writer session started after waiting for unreachable endpoints"
                    );
                }
                let session = Arc::new(session);
                WriterSession::watch_columns(
                    &session,
                    params.schema_refresh_interval,
                    dynamic.write_timeout,
                    stop.clone(),
                );
                return Ok(session);
            }
            Err(err) if should_retry(err.class(), attempts, dynamic.max_insert_attempts) => {
                let due =
                    last_warning.is_none_or(|at| at.elapsed() >= SESSION_WAIT_WARNING_INTERVAL);
                if due {
                    warn!(
                        database = %params.database,
                        table = %params.table,
                        attempts,
                        waited_s = waiting_since.elapsed().as_secs(),
                        error = %err,
                        "cannot start the ClickHouse writer session yet; retrying with a pause growing from retry_backoff to max_retry_backoff. Check that every listed host is up and reachable from this worker"
                    );
                    last_warning = Some(Instant::now());
                }
                let pause = backoff
                    .failed(dynamic.retry_backoff, dynamic.retry_backoff_cap())
                    .max(Duration::from_millis(100));
                // As in `insert_part`: a stop (or a pipeline gone) ends the wait.
                tokio::select! {
                    _ = tokio::time::sleep(pause) => {}
                    _ = stop.wait_for(|s| *s) => return Err(SessionWait::Stopped),
                }
            }
            Err(err @ SessionError::NoTable { .. }) => return Err(SessionWait::NoTable(err)),
            Err(err) => return Err(SessionWait::Refused(err.into_sink_error())),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use flow_core::{Column, StreamType};

    fn params(column: &str) -> SinkParams {
        let parameters: serde_yaml::Value = serde_yaml::from_str(&format!(
            "{{host: h, table: t, message_id_column: {column}}}"
        ))
        .unwrap();
        params::parse(
            SinkClass::Batching,
            &parameters,
            &serde_yaml::Value::Null,
            flow_core::SpecPaths::working_directory(),
        )
        .unwrap()
        .0
    }

    #[test]
    fn message_id_column_must_be_an_integer_column_of_the_stream() {
        let stream = StreamSchema::new(vec![
            Column::new("id", StreamType::Uint64),
            Column::new("name", StreamType::String),
        ])
        .unwrap();
        assert!(check_message_id_column(&params("id"), &stream).is_ok());
        let v = check_message_id_column(&params("nosuch"), &stream).unwrap_err();
        assert_eq!(v[0].path, "parameters.message_id_column");
        assert_eq!(
            v[0].message,
            "`nosuch` is not a column of the input stream (its columns: id, name); name the column that carries the message id"
        );
        let v = check_message_id_column(&params("name"), &stream).unwrap_err();
        assert!(
            v[0].message.starts_with(
                "`name` is of type string, but a message id column must be an integer"
            ),
            "{}",
            v[0].message
        );
    }
}
