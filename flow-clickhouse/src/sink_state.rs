//! The state one ClickHouse sink shares across its partitions ([`SinkShared`]): the validated
//! parameters, the input stream, the shard router, the dynamic parameters in force and the
//! writer session, started when the first partition opens (see [`crate::session_wait`]).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, RwLock};

use flow_core::registry::{BuildResult, SinkBuildContext};
use flow_core::{EpochOutcome, SinkError, StreamSchema, Violation};
use tokio::sync::{watch, OnceCell};
use tracing::warn;

use crate::params::{self, ClickHouseDynamicParams, ClickHouseParams, SinkClass, SinkParams};
use crate::routing::RendezvousRouter;
use crate::session::WriterSession;
use crate::session_wait::{wait_for_session, SessionWait};

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
    let key_columns = key_columns(&params.spec, stream)?;
    Ok(Arc::new(SinkShared {
        class,
        router: RendezvousRouter::new(&params.topology.shard_names()),
        sharded: params.topology.is_sharded(),
        params,
        stream: Arc::clone(stream),
        key_columns,
        partitions: ctx.partitions,
        session: OnceCell::new(),
        session_started_early: AtomicBool::new(false),
        dynamic: RwLock::new(dynamic),
    }))
}

/// The input columns of `sharding_key_columns`, in their order.
fn key_columns(params: &ClickHouseParams, stream: &StreamSchema) -> BuildResult<Vec<usize>> {
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
        let parsed = params::parse_dynamic(self.class, dynamic)
            .map_err(|v| SinkError::Refused(Violation::list(&v)))?;
        if let Some(session) = self.session.get() {
            if let Err(reason) = session.check_dynamic(&self.params.spec, &parsed) {
                // A reload must not stop a running pipeline: keep the parameters in force.
                warn!(database = %self.params.spec.database, table = %self.params.spec.table, reason = %reason, "dynamic parameters rejected by the running session; the previous ones stay in force. Fix the spec and send SIGHUP again");
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
    pub fn start_session_early(self: &Arc<Self>, stop: &watch::Receiver<bool>) {
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
        let mut stop = stop.clone();
        let started = self
            .session
            .get_or_try_init(|| wait_for_session(self, &mut stop))
            .await;
        match started {
            Ok(session) => Ok(Some(Arc::clone(session))),
            Err(SessionWait::Stopped) => Ok(None),
            Err(SessionWait::Refused(err)) => Err(err),
        }
    }

    /// The answer for an epoch when [`SinkShared::session`] found the pipeline stopping before
    /// the session started: not committed, and read again by the next run.
    pub fn not_started() -> EpochOutcome {
        EpochOutcome::Veto {
            reason: "the pipeline is stopping before the writer session started".to_owned(),
            retry_after: std::time::Duration::ZERO,
        }
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
