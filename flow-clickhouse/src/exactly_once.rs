//! What only the exactly-once classes keep per sink ([`ExactlyOnce`]): the token prefix, the
//! routing fingerprint of the topology guard, and the give-up latch that fails every later write
//! once an insert was given up.

use std::collections::BTreeMap;
use std::sync::Mutex;

use flow_core::registry::SinkBuildContext;
use flow_core::SinkError;
use tracing::error;

use crate::fingerprint::{topology_fingerprint, ROUTING_KEY};
use crate::insert::GiveUpReason;
use crate::session::WriterSession;
use crate::sink_state::SinkShared;

/// Exactly-once state shared by every partition of one sink.
pub struct ExactlyOnce {
    token_prefix: String,
    routing_fingerprint: String,
    gave_up: Mutex<Option<GiveUpReason>>,
}

impl ExactlyOnce {
    pub fn new(shared: &SinkShared, ctx: &SinkBuildContext<'_>) -> ExactlyOnce {
        let params = &shared.params.spec;
        let routing_fingerprint = topology_fingerprint(
            &params.sharding_key_columns,
            shared.sharded.then_some(shared.router.shards()),
        );
        ExactlyOnce {
            token_prefix: params.token_prefix(ctx.pipeline, ctx.sink),
            routing_fingerprint,
            gave_up: Mutex::new(None),
        }
    }

    /// The token of the part of `partition` ending at `last_offset`:
    /// `<namespace><partition>-<last offset>[:<shard>]`.
    pub fn token(&self, partition: u32, last_offset: u64, shard: Option<&str>) -> String {
        let mut token = format!("{}{partition}-{last_offset}", self.token_prefix);
        if let Some(shard) = shard {
            token.push(':');
            token.push_str(shard);
        }
        token
    }

    /// `routing` and every `target:<shard>` fingerprint of the current spec and tables.
    pub fn current_fingerprints(&self, session: &WriterSession) -> BTreeMap<String, String> {
        let mut current = session.target_fingerprints.clone();
        current.insert(ROUTING_KEY.to_owned(), self.routing_fingerprint.clone());
        current
    }

    /// Fails once an insert of this sink was given up.
    pub fn check_gave_up(&self) -> Result<(), SinkError> {
        let guard = self
            .gave_up
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        match guard.as_ref() {
            Some(reason) => Err(reason.to_sink_error()),
            None => Ok(()),
        }
    }

    /// Records the first give-up reason; every later write of this sink fails with it.
    pub fn give_up(&self, shared: &SinkShared, reason: GiveUpReason) -> SinkError {
        let params = &shared.params.spec;
        error!(database = %params.database, table = %params.table, reason = %reason, "insert given up; this sink fails every later write until the pipeline is restarted. Fix the table or the configuration, then restart");
        let mut guard = self
            .gave_up
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        guard.get_or_insert(reason).to_sink_error()
    }
}
