//! What a writer session's start learns from the probes of every endpoint, shard by shard
//! ([`Survey`]): the table every host must match, the capabilities and readable dates they all
//! share, each shard's target fingerprint and dedup window, and the hosts (or whole shards) that
//! `late_hosts` admits later. Every refusal names the hosts it compares and the remedy.

use std::collections::BTreeMap;

use tracing::warn;

use crate::config::dynamic::ClickHouseDynamicParams;
use crate::config::guarantee::SinkClass;
use crate::config::params::SinkParams;
use crate::config::topology::Endpoint;
use crate::encode::readable::ReadableRanges;
use crate::exactly_once::fingerprint::{
    endpoint_target_fingerprint, replicated_target_fingerprint, target_key,
};
use crate::server::classify::{ClassifiedError, ErrorClass};
use crate::server::client::{describe_host, EndpointClient, ShardClients};
use crate::server::dedup_window::{ReplayExposure, ShardDedupWindow};
use crate::server::late_hosts::{LateHost, ShardReference};
use crate::server::probe::{
    min_capabilities, schema_difference, Capabilities, EndpointMetadata, EngineKind, SessionError,
};

/// One endpoint's probe at the start.
pub(crate) type Probed = Result<EndpointMetadata, SessionError>;

/// The probes taken in so far ([`Survey::shard`]); [`Survey::finish`] gives what the session
/// starts from.
pub(crate) struct Survey<'p> {
    class: SinkClass,
    params: &'p SinkParams,
    dynamic: &'p ClickHouseDynamicParams,
    exposure: &'p ReplayExposure,
    /// More than one shard: one down as a whole is waited out once another answered.
    sharded: bool,
    /// The first host that answered, and its table: every other host's must be the same.
    first: Option<(String, EndpointMetadata)>,
    /// What every host that answered can do (the least of them).
    capabilities: Capabilities,
    target_fingerprints: BTreeMap<String, String>,
    dedup_windows: Vec<ShardDedupWindow>,
    /// What every host that answered reads back of Date and DateTime (the oldest server's).
    ranges: Option<ReadableRanges>,
    late: Vec<LateHost>,
    late_shards: Vec<String>,
    /// What the start fails with when no shard answered: a host of a shard down as a whole.
    unreachable: Option<SessionError>,
}

/// What the session starts from once every shard's probes were taken in.
pub(crate) struct Surveyed {
    /// The table as the first host that answered has it.
    pub(crate) reference: EndpointMetadata,
    pub(crate) capabilities: Capabilities,
    /// `target:<shard>` → logical target fingerprint, for the shards that answered.
    pub(crate) target_fingerprints: BTreeMap<String, String>,
    pub(crate) dedup_windows: Vec<ShardDedupWindow>,
    pub(crate) ranges: ReadableRanges,
    /// Hosts to admit once they answer with the same table.
    pub(crate) late: Vec<LateHost>,
    /// Shards none of whose hosts answered.
    pub(crate) late_shards: Vec<String>,
}

impl<'p> Survey<'p> {
    pub(crate) fn new(
        class: SinkClass,
        params: &'p SinkParams,
        dynamic: &'p ClickHouseDynamicParams,
        exposure: &'p ReplayExposure,
        shards: usize,
    ) -> Survey<'p> {
        Survey {
            class,
            params,
            dynamic,
            exposure,
            sharded: shards > 1,
            first: None,
            capabilities: Capabilities {
                insert_deduplication_token: true,
                async_insert: true,
                async_insert_deduplicate: true,
                insert_deduplicate: true,
                replicas_zookeeper_name: true,
            },
            target_fingerprints: BTreeMap::new(),
            dedup_windows: Vec::new(),
            ranges: None,
            late: Vec::new(),
            late_shards: Vec::new(),
            unreachable: None,
        }
    }

    /// Takes in one shard's probes, given in the order the spec lists its hosts. A host down
    /// (or refusing the table) while another of its shard answers is admitted later; so is a
    /// whole shard down, where there are others.
    pub(crate) fn shard(
        &mut self,
        shard: &ShardClients,
        probes: Vec<Probed>,
    ) -> Result<(), SessionError> {
        let answered = probes.iter().any(Result::is_ok);
        let all_unreachable = probes
            .iter()
            .all(|p| matches!(p, Err(SessionError::Unreachable { .. })));
        if self.sharded && all_unreachable {
            self.shard_down(shard, probes);
            return Ok(());
        }
        let mut shard_first: Option<(String, EndpointMetadata)> = None;
        let mut late_here = Vec::new();
        for (endpoint, probed) in shard.endpoints.iter().zip(probes) {
            match probed {
                Ok(meta) => self.host(shard, endpoint, meta, &mut shard_first)?,
                Err(SessionError::Unreachable { cause, .. }) if answered => {
                    late_here.push((endpoint.clone(), cause));
                }
                // One replica refusing what another host of its shard accepts (its table
                // detached or missing there, say) is that host's failure, as it is for an
                // insert (`crate::delivery::insert`): the session starts on the others and
                // `late_hosts` admits this one once it answers with the same table.
                Err(err @ (SessionError::Refused { .. } | SessionError::NoTable { .. }))
                    if answered =>
                {
                    late_here.push((endpoint.clone(), self.refused_here(shard, endpoint, err)));
                }
                Err(err) => return Err(err),
            }
        }
        let Some((_, meta)) = shard_first else {
            return Err(SessionError::refused(
                self.params,
                format!("shard `{}` has no host", shard.name),
            ));
        };
        self.late
            .extend(late_here.into_iter().map(|(endpoint, cause)| LateHost {
                shard: shard.name.clone(),
                endpoint,
                cause,
                reference: Some(ShardReference::of(&meta)),
            }));
        self.settle_shard(shard, &meta)
    }

    /// A shard none of whose hosts answered, where other shards may: every host is late.
    fn shard_down(&mut self, shard: &ShardClients, probes: Vec<Probed>) {
        for (endpoint, probed) in shard.endpoints.iter().zip(probes) {
            if let Err(SessionError::Unreachable { cause, .. }) = probed {
                self.late.push(LateHost {
                    shard: shard.name.clone(),
                    endpoint: endpoint.clone(),
                    cause: cause.clone(),
                    reference: None,
                });
                self.unreachable.get_or_insert(SessionError::Unreachable {
                    endpoint: endpoint.endpoint.to_string(),
                    cause,
                });
            }
        }
        self.late_shards.push(shard.name.clone());
    }

    /// A host that refuses the table its shard's other hosts answer with: warned, and kept as
    /// the cause it is late for.
    fn refused_here(
        &self,
        shard: &ShardClients,
        endpoint: &EndpointClient,
        err: SessionError,
    ) -> ClassifiedError {
        let reason = err.to_string();
        warn!(
            database = %self.params.database,
            table = %self.params.table,
            shard = %shard.name,
            host = %endpoint.endpoint,
            reason = %reason,
            "a host refuses the table that its shard's other hosts answer with: the sink writes to those and admits this one once it answers with the same table. Fix that host (e.g. ATTACH or create the table there)"
        );
        ClassifiedError {
            class: ErrorClass::Permanent,
            code: None,
            message: reason,
        }
    }

    /// Takes in one host that answered: its capabilities and dates join the others', and its
    /// table must be its shard's (engine, replication identity) and every host's (schema).
    fn host(
        &mut self,
        shard: &ShardClients,
        endpoint: &EndpointClient,
        meta: EndpointMetadata,
        shard_first: &mut Option<(String, EndpointMetadata)>,
    ) -> Result<(), SessionError> {
        let here = describe_host(&shard.name, endpoint);
        self.capabilities = min_capabilities(self.capabilities, meta.capabilities);
        let of_host = ReadableRanges::of_version(&meta.server_types.version);
        self.ranges = Some(match self.ranges.take() {
            Some(so_far) => so_far.intersect(of_host),
            None => of_host,
        });
        match shard_first {
            Some((there, reference)) => self.same_shard_table(&here, &meta, there, reference)?,
            None => *shard_first = Some((here.clone(), meta.clone())),
        }
        match &self.first {
            Some((there, reference)) => {
                if let Some(diff) =
                    schema_difference(&reference.columns, there, &meta.columns, &here)
                {
                    return Err(SessionError::refused(self.params, format!(
                        "the table's schema differs between hosts: {diff}. Make the tables identical (name, type, default kind and expression, in order)"
                    )));
                }
            }
            None => self.first = Some((here, meta)),
        }
        Ok(())
    }

    /// Whether host `here` exposes the same table as `there`, the first of its shard that
    /// answered: the same engine, and for a replicated one the same ZooKeeper path.
    fn same_shard_table(
        &self,
        here: &str,
        meta: &EndpointMetadata,
        there: &str,
        reference: &EndpointMetadata,
    ) -> Result<(), SessionError> {
        if reference.engine != meta.engine {
            return Err(SessionError::refused(self.params, format!(
                "{here} has engine {} but {there} has {}; every host of a shard must expose the same table",
                meta.engine, reference.engine
            )));
        }
        if meta.kind == EngineKind::Replicated
            && (reference.zookeeper_path != meta.zookeeper_path
                || reference.zookeeper_name != meta.zookeeper_name)
        {
            return Err(SessionError::refused(self.params, format!(
                "{here} replicates through ZooKeeper path {:?} but {there} through {:?}: they are different tables, not replicas of one. Point every host of the shard at replicas sharing one zookeeper_path",
                meta.zookeeper_path.as_deref().unwrap_or(""),
                reference.zookeeper_path.as_deref().unwrap_or("")
            )));
        }
        Ok(())
    }

    /// What a shard that answered (its table as `meta`) gives the session: its target
    /// fingerprint and, where it deduplicates for an exactly-once class, its dedup window
    /// (checked against what a replay can need).
    fn settle_shard(
        &mut self,
        shard: &ShardClients,
        meta: &EndpointMetadata,
    ) -> Result<(), SessionError> {
        let params = self.params;
        if meta.kind != EngineKind::Replicated && shard.endpoints.len() > 1 {
            return Err(SessionError::refused(self.params, format!(
                "{} is a {} table, which does not replicate: the sink cannot prove that the {} hosts{} expose one logical table. Use ReplicatedMergeTree, or list one host",
                params.table,
                meta.engine,
                shard.endpoints.len(),
                if shard.name.is_empty() { String::new() } else { format!(" of shard `{}`", shard.name) }
            )));
        }
        let dedups = match meta.kind {
            EngineKind::Replicated | EngineKind::Shared => true,
            EngineKind::Plain => meta.dedup_windows.non_replicated_dedup_enabled(),
        };
        if !dedups && self.class.is_exactly_once() {
            warn!(
                database = %params.database,
                table = %params.table,
                shard = %shard.name,
                engine = %meta.engine,
                "the target is a non-replicated {} without block deduplication by default: exactly-once degrades to at-least-once. Set the table setting non_replicated_deduplication_window (e.g. 1000) to enable deduplication",
                meta.engine
            );
        }
        let fingerprint = match meta.kind {
            EngineKind::Replicated => replicated_target_fingerprint(
                meta.zookeeper_name.as_deref().unwrap_or("default"),
                meta.zookeeper_path.as_deref().unwrap_or(""),
            ),
            EngineKind::Shared | EngineKind::Plain => {
                let hosts: Vec<Endpoint> =
                    shard.endpoints.iter().map(|e| e.endpoint.clone()).collect();
                endpoint_target_fingerprint(&params.database, &params.table, params.port, &hosts)
            }
        };
        self.target_fingerprints
            .insert(target_key(&shard.name), fingerprint);
        if dedups && self.class.is_exactly_once() {
            let window = ShardDedupWindow {
                shard: shard.name.clone(),
                replicated: meta.kind != EngineKind::Plain,
                windows: meta.dedup_windows.clone(),
            };
            window.warn_if_short(params, self.dynamic, self.exposure);
            self.dedup_windows.push(window);
        }
        Ok(())
    }

    /// What the session starts from; an error when no shard answered (there is no table to
    /// plan the encoding from: the start is tried again).
    pub(crate) fn finish(self) -> Result<Surveyed, SessionError> {
        let Some((_, reference)) = self.first else {
            return Err(self.unreachable.unwrap_or_else(|| {
                SessionError::refused(self.params, "no endpoint is configured".to_owned())
            }));
        };
        Ok(Surveyed {
            reference,
            capabilities: self.capabilities,
            target_fingerprints: self.target_fingerprints,
            dedup_windows: self.dedup_windows,
            ranges: self
                .ranges
                .unwrap_or_else(|| ReadableRanges::of_version("")),
            late: self.late,
            late_shards: self.late_shards,
        })
    }
}
