//! What only the exactly-once classes keep per sink ([`ExactlyOnce`]): the token prefix, the
//! routing fingerprint of the topology guard, and the give-up latch that fails every later write
//! once an insert was given up.

use std::collections::BTreeMap;
use std::sync::Mutex;

use flow_core::{SinkContext, SinkError};
use tracing::error;

use crate::delivery::insert::GiveUpReason;
use crate::delivery::sink_state::SinkShared;
use crate::exactly_once::fingerprint::{topology_fingerprint, ROUTING_KEY};
use crate::server::session::WriterSession;

/// Exactly-once state shared by every partition of one sink.
pub struct ExactlyOnce {
    routing_fingerprint: String,
    gave_up: Mutex<Option<GiveUpReason>>,
}

impl ExactlyOnce {
    pub fn new(shared: &SinkShared) -> ExactlyOnce {
        let params = &shared.params;
        let routing_fingerprint = topology_fingerprint(
            &params.sharding_key_columns,
            shared.sharded.then_some(shared.router.shards()),
        );
        ExactlyOnce {
            routing_fingerprint,
            gave_up: Mutex::new(None),
        }
    }

    /// The token prefix of the sink partition in `ctx`: the default namespace names the outbox
    /// of `ctx.store` (known only once the store is open, after the sink was built).
    pub fn token_prefix(shared: &SinkShared, ctx: &SinkContext) -> Result<String, SinkError> {
        let outbox = ctx.store.outbox_id()?;
        Ok(shared.params.token_prefix(&ctx.pipeline, &ctx.sink, outbox))
    }

    /// The token of the part of `partition` ending at `last_offset`:
    /// `<namespace><partition>-<last offset>[:<shard>]`.
    pub fn token(prefix: &str, partition: u32, last_offset: u64, shard: Option<&str>) -> String {
        let mut token = format!("{prefix}{partition}-{last_offset}");
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

    /// Fails once an insert of this sink was given up. The error is about `partition` and, when
    /// a batch was about to be sent, its own `token`; it quotes the given-up insert (which may be
    /// another partition's, with its token) as the cause.
    pub fn check_gave_up(&self, partition: u32, token: Option<&str>) -> Result<(), SinkError> {
        let guard = self
            .gave_up
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        match guard.as_ref() {
            Some(reason) => Err(blocked_by(reason, partition, token)),
            None => Ok(()),
        }
    }

    /// Records the first give-up reason; every later write of this sink fails with it.
    pub fn give_up(&self, shared: &SinkShared, reason: GiveUpReason) -> SinkError {
        let params = &shared.params;
        error!(database = %params.database, table = %params.table, reason = %reason, "insert given up; this sink fails every later write until the pipeline is restarted. Fix the table or the configuration, then restart");
        self.latch(reason)
    }

    /// Keeps the first reason and returns the error of this one.
    fn latch(&self, reason: GiveUpReason) -> SinkError {
        let mut guard = self
            .gave_up
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        // This partition fails with its own reason (its own token); later writes quote the first.
        let error = reason.to_sink_error();
        guard.get_or_insert(reason);
        error
    }
}

/// The error of a partition whose write is refused because the sink gave up an insert before.
fn blocked_by(reason: &GiveUpReason, partition: u32, token: Option<&str>) -> SinkError {
    let what = match token {
        Some(token) => format!("batch (token {token}) of partition {partition} not sent"),
        None => format!("epoch of partition {partition} not sealed"),
    };
    SinkError::Target {
        context: format!(
            "delivery stopped: {what}, because this sink gave up an earlier insert: {}",
            reason.context
        ),
        source: Box::new(reason.error.clone()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::server::classify::ClassifiedError;

    #[test]
    fn a_partition_blocked_by_another_partitions_give_up_quotes_its_own_token() {
        let reason = GiveUpReason {
            context: "Giving up insert into ClickHouse: default.t shard `a` via 127.0.0.1:1 after 1 attempt(s), token p/s/0-99".to_owned(),
            error: ClassifiedError::from_server(Some(60), "no table"),
        };
        let err = blocked_by(&reason, 1, Some("p/s/1-99")).to_string();
        assert!(
            err.starts_with("delivery stopped: batch (token p/s/1-99) of partition 1 not sent, because this sink gave up an earlier insert: Giving up insert into ClickHouse: default.t shard `a` via 127.0.0.1:1 after 1 attempt(s), token p/s/0-99"),
            "{err}"
        );
        // Two partitions giving up at once: each fails with its own token; later writes quote
        // the first.
        let latch = ExactlyOnce {
            routing_fingerprint: String::new(),
            gave_up: Mutex::new(None),
        };
        let second = GiveUpReason {
            context: reason.context.replace("token p/s/0-99", "token p/s/1-99"),
            error: reason.error.clone(),
        };
        assert!(latch
            .latch(reason.clone())
            .to_string()
            .contains("token p/s/0-99"));
        let own = latch.latch(second).to_string();
        assert!(
            own.contains("token p/s/1-99") && !own.contains("p/s/0-99"),
            "{own}"
        );
        let later = latch
            .check_gave_up(1, Some("p/s/1-199"))
            .err()
            .map(|e| e.to_string());
        assert!(
            later
                .as_deref()
                .is_some_and(|e| e.contains("token p/s/1-199") && e.contains("token p/s/0-99")),
            "{later:?}"
        );
        let sealing = blocked_by(&reason, 2, None).to_string();
        assert!(
            sealing.starts_with("delivery stopped: epoch of partition 2 not sealed, because"),
            "{sealing}"
        );
    }
}
