//! Hosts that did not answer when the writer session started: the session starts on the hosts
//! of each shard that did (a shard none of whose hosts answers is still waited for), and leaves
//! the others out of failover ([`EndpointClient::admitted`]). A background task asks each of
//! them again, with a growing pause, and admits it once it answers with the table the session
//! planned for: the same engine and replication identity as its shard's other hosts, the same
//! columns, and every server capability the session uses. A host that answers with something
//! else stays out, with a warning naming the difference, and is asked again later.
//!
//! A shard none of whose hosts answered at the start (a *late shard*, possible once another
//! shard answered, whose table the encoding is planned from) takes its reference from the first
//! of its hosts that answers with a fitting table; its target fingerprint is then published in
//! [`LateTargets`], for each partition's deliverer to compare with the one its pending batches
//! were sealed under before it sends the shard anything.

use std::collections::BTreeMap;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::task::JoinHandle;
use tracing::{info, warn};

use crate::config::params::SinkParams;
use crate::config::topology::Endpoint;
use crate::exactly_once::fingerprint::{
    endpoint_target_fingerprint, replicated_target_fingerprint, target_key,
};
use crate::server::classify::ClassifiedError;
use crate::server::client::EndpointClient;
use crate::server::columns_guard::ColumnMeta;
use crate::server::probe::{
    min_capabilities, probe_speaking_its_protocol, schema_difference, Capabilities,
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
    /// Its shard's table as the session found it; `None` for a late shard.
    pub(crate) reference: Option<ShardReference>,
}

/// The state of a shard's target for a deliverer about to send to it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum LateTarget {
    /// The shard answered at the start: its fingerprint is the session's.
    NotLate,
    /// No host of the shard has answered with a fitting table yet.
    Pending,
    /// A host was admitted; this is the shard's target fingerprint.
    Known(String),
}

/// The target fingerprints of the late shards, as their first hosts are admitted.
#[derive(Debug, Default)]
pub struct LateTargets {
    shards: Mutex<BTreeMap<String, Option<String>>>,
}

impl LateTargets {
    pub(crate) fn new(late_shards: &[String]) -> LateTargets {
        LateTargets {
            shards: Mutex::new(late_shards.iter().map(|s| (s.clone(), None)).collect()),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeMap<String, Option<String>>> {
        self.shards.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub fn state(&self, shard: &str) -> LateTarget {
        match self.lock().get(shard) {
            None => LateTarget::NotLate,
            Some(None) => LateTarget::Pending,
            Some(Some(fingerprint)) => LateTarget::Known(fingerprint.clone()),
        }
    }

    /// Completes the fingerprints a start compares with the persisted ones: a late shard's as
    /// far as it is known, else the persisted one (its deliverer compares it once it is known).
    pub fn fill(
        &self,
        current: &mut BTreeMap<String, String>,
        persisted: &BTreeMap<String, String>,
    ) {
        for (shard, fingerprint) in self.lock().iter() {
            let key = target_key(shard);
            match fingerprint {
                Some(fingerprint) => {
                    current.insert(key, fingerprint.clone());
                }
                None => {
                    if let Some(old) = persisted.get(&key) {
                        current.insert(key, old.clone());
                    }
                }
            }
        }
    }

    fn publish(&self, shard: &str, fingerprint: String) {
        self.lock().insert(shard.to_owned(), Some(fingerprint));
    }
}

/// What every late host is checked against.
pub(crate) struct LateCheck {
    pub(crate) sink_params: SinkParams,
    /// The columns the encoder was planned for.
    pub(crate) columns: Vec<ColumnMeta>,
    /// What the session relies on.
    pub(crate) capabilities: Capabilities,
    pub(crate) timeout: Duration,
    pub(crate) targets: Arc<LateTargets>,
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
                database = %check.sink_params.database,
                table = %check.sink_params.table,
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
    // The references of late shards, once their first host is admitted.
    let mut found: BTreeMap<String, ShardReference> = BTreeMap::new();
    let mut pause = FIRST_PAUSE;
    let mut warned: Vec<(String, Instant)> = Vec::new();
    while !late.is_empty() {
        tokio::time::sleep(pause).await;
        pause = (pause * 2).min(LONGEST_PAUSE);
        let mut still = Vec::new();
        for mut host in late {
            if host.reference.is_none() {
                host.reference = found.get(&host.shard).cloned();
            }
            match admit(&host, &check).await {
                Ok(meta) => {
                    if host.reference.is_none() {
                        let target = shard_target(&host.shard, &meta, &check);
                        found.insert(host.shard.clone(), ShardReference::of(&meta));
                        check.targets.publish(&host.shard, target);
                    }
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

/// The target fingerprint of a late shard, from the table its first admitted host answered with.
fn shard_target(shard: &str, meta: &EndpointMetadata, check: &LateCheck) -> String {
    let spec = &check.sink_params;
    if meta.kind == EngineKind::Replicated {
        return replicated_target_fingerprint(
            meta.zookeeper_name.as_deref().unwrap_or("default"),
            meta.zookeeper_path.as_deref().unwrap_or(""),
        );
    }
    endpoint_target_fingerprint(
        &spec.database,
        &spec.table,
        spec.port,
        &shard_hosts(shard, check),
    )
}

fn shard_hosts(shard: &str, check: &LateCheck) -> Vec<Endpoint> {
    check
        .sink_params
        .topology
        .shards()
        .into_iter()
        .find(|(name, _)| name.unwrap_or("") == shard)
        .map(|(_, endpoints)| endpoints.to_vec())
        .unwrap_or_default()
}

/// Asks `host` once and checks what it answers against the session and its shard.
async fn admit(host: &LateHost, check: &LateCheck) -> Result<EndpointMetadata, NotYet> {
    let meta = match probe_speaking_its_protocol(&host.endpoint, &check.sink_params, check.timeout)
        .await
    {
        Ok(meta) => meta,
        Err(SessionError::Unreachable { .. }) => return Err(NotYet::Unreachable),
        Err(SessionError::Refused { reason, .. }) => return Err(NotYet::Mismatch(reason)),
        Err(err @ (SessionError::Clients { .. } | SessionError::NoTable { .. })) => {
            return Err(NotYet::Mismatch(err.to_string()))
        }
    };
    check_table(&meta, check)?;
    let Some(reference) = &host.reference else {
        // The first host of a late shard: its table becomes the shard's reference.
        if meta.kind != EngineKind::Replicated && shard_hosts(&host.shard, check).len() > 1 {
            return Err(NotYet::Mismatch(format!(
                "its table is a {} table, which does not replicate, and the shard lists several hosts",
                meta.engine
            )));
        }
        return Ok(meta);
    };
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
    Ok(meta)
}

/// What every admitted host must have: the columns and capabilities the session planned for.
fn check_table(meta: &EndpointMetadata, check: &LateCheck) -> Result<(), NotYet> {
    if let Some(diff) = schema_difference(
        &check.columns,
        "the hosts the session started with",
        &meta.columns,
        "this host",
    ) {
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
