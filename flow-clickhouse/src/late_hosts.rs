//! Hosts that did not answer when the writer session started: the session starts on the hosts
//! of each shard that did (a shard none of whose hosts answers is still waited for), and leaves
//! the others out of failover ([`EndpointClient::admitted`]). A background task asks each of
//! them again, with a growing pause, and admits it once it answers with the table the session
//! planned for: the same engine and replication identity as its shard's other hosts, the same
//! columns, and every server capability the session uses. A host that answers with something
//! else stays out, with a warning naming the difference, and is asked again later.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use tokio::task::JoinHandle;
use tracing::{info, warn};

use crate::classify::ClassifiedError;
use crate::client::EndpointClient;
use crate::params::SinkParams;
use crate::session::{
    min_capabilities, probe_speaking_its_protocol, schema_difference, Capabilities, ColumnMeta,
    EndpointMetadata, EngineKind, SessionError,
};

/// The first pause before a late host is asked again, and the longest.
const FIRST_PAUSE: Duration = Duration::from_secs(1);
const LONGEST_PAUSE: Duration = Duration::from_secs(30);
/// Between two warnings about the same host answering with a different table.
const MISMATCH_WARNING_EVERY: Duration = Duration::from_secs(300);

/// What a late host of a shard must match: its shard's table as the session found it.
#[derive(Clone, Debug)]
pub(crate) struct ShardReference {
    engine: String,
    kind: EngineKind,
    zookeeper_path: Option<String>,
    zookeeper_name: Option<String>,
}

impl ShardReference {
    pub(crate) fn of(meta: &EndpointMetadata) -> ShardReference {
        ShardReference {
            engine: meta.engine.clone(),
            kind: meta.kind,
            zookeeper_path: meta.zookeeper_path.clone(),
            zookeeper_name: meta.zookeeper_name.clone(),
        }
    }
}

/// A host that did not answer at the start.
pub(crate) struct LateHost {
    pub(crate) shard: String,
    pub(crate) endpoint: EndpointClient,
    /// Why it did not answer.
    pub(crate) cause: ClassifiedError,
    pub(crate) reference: ShardReference,
}

/// What every late host is checked against.
pub(crate) struct LateCheck {
    pub(crate) sink_params: SinkParams,
    /// The columns the encoder was planned for.
    pub(crate) columns: Vec<ColumnMeta>,
    /// What the session relies on.
    pub(crate) capabilities: Capabilities,
    pub(crate) timeout: Duration,
}

/// The task asking the late hosts again; stops with the session.
pub(crate) struct LateHosts {
    task: JoinHandle<()>,
}

impl Drop for LateHosts {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Why a late host is not admitted yet.
enum NotYet {
    Unreachable,
    Mismatch(String),
}

impl LateHosts {
    /// Leaves `late` out of failover and starts asking them again; `None` when there are none.
    pub(crate) fn watch(late: Vec<LateHost>, check: LateCheck) -> Option<LateHosts> {
        if late.is_empty() {
            return None;
        }
        for host in &late {
            host.endpoint.admitted.store(false, Ordering::Relaxed);
            warn!(
                database = %check.sink_params.spec.database,
                table = %check.sink_params.spec.table,
                shard = %host.shard,
                host = %host.endpoint.endpoint,
                error = %host.cause,
                "a host did not answer at the session start: the sink writes to the shard's other hosts, and admits this one once it answers with the same table. Check that host"
            );
        }
        Some(LateHosts {
            task: tokio::spawn(ask_again(late, check)),
        })
    }
}

async fn ask_again(mut late: Vec<LateHost>, check: LateCheck) {
    let mut pause = FIRST_PAUSE;
    let mut warned: Vec<(String, Instant)> = Vec::new();
    while !late.is_empty() {
        tokio::time::sleep(pause).await;
        pause = (pause * 2).min(LONGEST_PAUSE);
        let mut still = Vec::new();
        for host in late {
            match admit(&host, &check).await {
                Ok(()) => {
                    host.endpoint.admitted.store(true, Ordering::Relaxed);
                    info!(
                        shard = %host.shard,
                        host = %host.endpoint.endpoint,
                        "a host that was unreachable at the session start answers with the same table: it takes inserts again"
                    );
                }
                Err(NotYet::Unreachable) => still.push(host),
                Err(NotYet::Mismatch(reason)) => {
                    let name = host.endpoint.endpoint.to_string();
                    let due = warned
                        .iter()
                        .find(|(n, _)| *n == name)
                        .is_none_or(|(_, at)| at.elapsed() >= MISMATCH_WARNING_EVERY);
                    if due {
                        warned.retain(|(n, _)| *n != name);
                        warned.push((name, Instant::now()));
                        warn!(
                            shard = %host.shard,
                            host = %host.endpoint.endpoint,
                            reason = %reason,
                            "a host that was unreachable at the session start answers with another table: it stays out of the sink's failover (its shard's other hosts take the inserts). Make it a replica of the same table, or remove it from the spec"
                        );
                    }
                    still.push(host);
                }
            }
        }
        late = still;
    }
}

/// Asks `host` once and checks what it answers against the session.
async fn admit(host: &LateHost, check: &LateCheck) -> Result<(), NotYet> {
    let meta = match probe_speaking_its_protocol(&host.endpoint, &check.sink_params, check.timeout)
        .await
    {
        Ok(meta) => meta,
        Err(SessionError::Unreachable { .. }) => return Err(NotYet::Unreachable),
        Err(SessionError::Refused { reason, .. }) => return Err(NotYet::Mismatch(reason)),
    };
    let reference = &host.reference;
    if meta.engine != reference.engine {
        return Err(NotYet::Mismatch(format!(
            "its table has engine {} where the shard's other hosts have {}",
            meta.engine, reference.engine
        )));
    }
    if reference.kind == EngineKind::Replicated
        && (meta.zookeeper_path != reference.zookeeper_path
            || meta.zookeeper_name != reference.zookeeper_name)
    {
        return Err(NotYet::Mismatch(format!(
            "its table replicates through ZooKeeper path {:?}, the shard's other hosts through {:?}: it is another table, not a replica",
            meta.zookeeper_path.as_deref().unwrap_or(""),
            reference.zookeeper_path.as_deref().unwrap_or("")
        )));
    }
    if let Some(diff) = schema_difference(&check.columns, &meta.columns) {
        return Err(NotYet::Mismatch(format!(
            "its schema differs from the one the sink writes: {diff}"
        )));
    }
    if check.columns.len() != meta.columns.len() {
        return Err(NotYet::Mismatch(format!(
            "its table has {} columns where the sink writes {}",
            meta.columns.len(),
            check.columns.len()
        )));
    }
    if min_capabilities(check.capabilities, meta.capabilities) != check.capabilities {
        return Err(NotYet::Mismatch(
            "its server lacks a capability the session uses (insert_deduplication_token or async_insert): restart the worker so that the session plans for it".to_owned(),
        ));
    }
    Ok(())
}
