//! The writer session: started in the background when the sink's first partition opens, it connects to every endpoint and proves
//! that they expose one logical table the stream can be written to — engine, complete ordered
//! schema, replication identity, server capabilities, dedup window — before anything is sent.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use flow_core::{SinkError, StreamSchema};
use futures_util::future::join_all;
use thiserror::Error;
use tracing::{debug, info, warn};

use crate::chtype::{check_mapping_on, ChType, ServerTypes};
use crate::classify::{ClassifiedError, ErrorClass};
use crate::client::{
    build_shards, json_text, json_u64, quote_ident, quote_literal, quote_table, EndpointClient,
    ShardClients,
};
use crate::columns_guard::{read_columns, ColumnsGuard};
use crate::dedup_window::{engine_clause, DedupWindows, DEDUP_WINDOW_SETTINGS};
use crate::fingerprint::{endpoint_target_fingerprint, replicated_target_fingerprint, target_key};
use crate::late_hosts::{LateCheck, LateHost, LateHosts, LateTargets, ShardReference};
use crate::params::{ClickHouseDynamicParams, ClickHouseParams, SinkClass, SinkParams};
use crate::rowbinary::{EncodedColumn, RowBinaryEncoder};

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

#[derive(Error, Debug)]
pub enum SessionError {
    /// An endpoint did not answer; the session start is retried.
    #[error("endpoint {endpoint} is not reachable: {cause}")]
    Unreachable {
        endpoint: String,
        cause: ClassifiedError,
    },
    /// The target cannot be written as configured; the message says why and what to do.
    #[error("{reason}")]
    Refused {
        database: String,
        table: String,
        reason: String,
    },
}

impl SessionError {
    /// An unreachable endpoint is transient; a refusal is permanent.
    pub fn class(&self) -> ErrorClass {
        match self {
            SessionError::Unreachable { .. } => ErrorClass::Retryable,
            SessionError::Refused { .. } => ErrorClass::Permanent,
        }
    }

    /// The error the sink fails with:
    /// `Refusing to start the ClickHouse sink for <database>.<table>: <reason>`.
    pub fn into_sink_error(self) -> SinkError {
        let context = match &self {
            SessionError::Refused {
                database, table, ..
            } => format!("Refusing to start the ClickHouse sink for {database}.{table}"),
            SessionError::Unreachable { .. } => "Cannot start the ClickHouse sink".to_owned(),
        };
        SinkError::Target {
            context,
            source: Box::new(self),
        }
    }
}

/// What the servers can do, probed from `system.settings` and `system.columns` (the minimum over
/// every endpoint).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Capabilities {
    pub insert_deduplication_token: bool,
    pub async_insert: bool,
    pub async_insert_deduplicate: bool,
    pub insert_deduplicate: bool,
    pub replicas_zookeeper_name: bool,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ColumnMeta {
    pub name: String,
    pub type_text: String,
    pub default_kind: String,
    pub default_expression: String,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum EngineKind {
    Replicated,
    Shared,
    Plain,
}

#[derive(Clone, Debug)]
pub(crate) struct EndpointMetadata {
    pub(crate) engine: String,
    pub(crate) kind: EngineKind,
    pub(crate) columns: Vec<ColumnMeta>,
    pub(crate) zookeeper_name: Option<String>,
    pub(crate) zookeeper_path: Option<String>,
    pub(crate) capabilities: Capabilities,
    dedup_windows: DedupWindows,
    server_types: ServerTypes,
}

/// The dedup window of one shard's table, kept for the re-checks on reload.
#[derive(Clone, Debug)]
struct ShardDedupWindow {
    shard: String,
    replicated: bool,
    windows: DedupWindows,
}

/// A started session, shared by every partition of one sink.
pub struct WriterSession {
    /// Sorted by shard name; one entry named `""` for the unsharded forms.
    pub shards: Vec<ShardClients>,
    pub encoder: RowBinaryEncoder,
    pub insert_sql: String,
    pub capabilities: Capabilities,
    /// `target:<shard>` → logical target fingerprint.
    pub target_fingerprints: BTreeMap<String, String>,
    pub database: String,
    pub table: String,
    /// The dedup window of each shard that deduplicates, for re-checks on reload.
    dedup_windows: Vec<ShardDedupWindow>,
    partitions: u32,
    /// The columns every INSERT is checked against (those the encoder was planned for).
    pub columns_guard: ColumnsGuard,
    /// Checks the hosts that were unreachable at the start, until each is admitted.
    _late_hosts: Option<LateHosts>,
    /// The target fingerprints of the shards none of whose hosts answered at the start, as
    /// they become known (not in `target_fingerprints`).
    pub late_targets: Arc<LateTargets>,
}

impl WriterSession {
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
        params: &ClickHouseParams,
        dynamic: &ClickHouseDynamicParams,
    ) -> Result<(), String> {
        if dynamic.async_insert && !self.capabilities.async_insert {
            return Err(ASYNC_INSERT_UNSUPPORTED.to_owned());
        }
        for window in &self.dedup_windows {
            check_dedup_window(params, dynamic, window, self.partitions);
        }
        Ok(())
    }

    pub fn shard(&self, name: &str) -> Option<&ShardClients> {
        self.shards.iter().find(|s| s.name == name)
    }

    /// Connects to every endpoint and validates the target; see the module doc.
    pub async fn start(
        class: SinkClass,
        sink_params: &SinkParams,
        dynamic: &ClickHouseDynamicParams,
        stream: &Arc<StreamSchema>,
        partitions: u32,
    ) -> Result<WriterSession, SessionError> {
        let params = &sink_params.spec;
        let refused = |reason: String| SessionError::Refused {
            database: params.database.clone(),
            table: params.table.clone(),
            reason,
        };
        let shards = build_shards(sink_params).map_err(refused)?;
        let timeout = dynamic.write_timeout;

        let mut first: Option<(String, EndpointMetadata)> = None;
        let mut capabilities = Capabilities {
            insert_deduplication_token: true,
            async_insert: true,
            async_insert_deduplicate: true,
            insert_deduplicate: true,
            replicas_zookeeper_name: true,
        };
        let mut target_fingerprints = BTreeMap::new();
        let mut dedup_windows = Vec::new();
        // Every endpoint is probed at once (a start costs one round of queries, not one per
        // host); the answers are then checked in the order the spec lists the hosts.
        let probes = join_all(shards.iter().map(|shard| {
            join_all(
                shard
                    .endpoints
                    .iter()
                    .map(|endpoint| probe_speaking_its_protocol(endpoint, sink_params, timeout)),
            )
        }))
        .await;
        let mut late = Vec::new();
        let mut late_shards = Vec::new();
        let mut unreachable = None;
        let sharded = shards.len() > 1;
        for (shard, probes) in shards.iter().zip(probes) {
            let mut shard_first: Option<(String, EndpointMetadata)> = None;
            // A host down while its shard's others answer is checked later; so is a whole shard
            // down, once another shard answered (see the end of the loop).
            let answered = probes.iter().any(Result::is_ok);
            let all_unreachable = probes
                .iter()
                .all(|p| matches!(p, Err(SessionError::Unreachable { .. })));
            if sharded && all_unreachable {
                for (endpoint, probed) in shard.endpoints.iter().zip(probes) {
                    if let Err(SessionError::Unreachable { cause, .. }) = probed {
                        late.push(LateHost {
                            shard: shard.name.clone(),
                            endpoint: endpoint.clone(),
                            cause: cause.clone(),
                            reference: None,
                        });
                        unreachable.get_or_insert(SessionError::Unreachable {
                            endpoint: endpoint.endpoint.to_string(),
                            cause,
                        });
                    }
                }
                late_shards.push(shard.name.clone());
                continue;
            }
            let mut late_here = Vec::new();
            for (endpoint, probed) in shard.endpoints.iter().zip(probes) {
                let meta = match probed {
                    Ok(meta) => meta,
                    Err(SessionError::Unreachable { cause, .. }) if answered => {
                        late_here.push((endpoint.clone(), cause));
                        continue;
                    }
                    Err(err) => return Err(err),
                };
                let here = describe(&shard.name, endpoint);
                capabilities = min_capabilities(capabilities, meta.capabilities);
                if let Some((there, reference)) = &shard_first {
                    if reference.engine != meta.engine {
                        return Err(refused(format!(
                            "{here} has engine {} but {there} has {}; every host of a shard must expose the same table",
                            meta.engine, reference.engine
                        )));
                    }
                    if meta.kind == EngineKind::Replicated
                        && (reference.zookeeper_path != meta.zookeeper_path
                            || reference.zookeeper_name != meta.zookeeper_name)
                    {
                        return Err(refused(format!(
                            "{here} replicates through ZooKeeper path {:?} but {there} through {:?}: they are different tables, not replicas of one. Point every host of the shard at replicas sharing one zookeeper_path",
                            meta.zookeeper_path.as_deref().unwrap_or(""),
                            reference.zookeeper_path.as_deref().unwrap_or("")
                        )));
                    }
                } else {
                    shard_first = Some((here.clone(), meta.clone()));
                }
                if let Some((there, reference)) = &first {
                    if let Some(diff) = schema_difference(&reference.columns, &meta.columns) {
                        return Err(refused(format!(
                            "the schema on {here} differs from the one on {there}: {diff}. Make the tables identical (name, type, default kind and expression, in order)"
                        )));
                    }
                } else {
                    first = Some((here, meta));
                }
            }
            let Some((_, meta)) = shard_first else {
                return Err(refused(format!("shard `{}` has no host", shard.name)));
            };
            late.extend(late_here.into_iter().map(|(endpoint, cause)| LateHost {
                shard: shard.name.clone(),
                endpoint,
                cause,
                reference: Some(ShardReference::of(&meta)),
            }));
            if meta.kind != EngineKind::Replicated && shard.endpoints.len() > 1 {
                return Err(refused(format!(
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
            if !dedups && class.is_exactly_once() {
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
                    let hosts: Vec<String> = shard
                        .endpoints
                        .iter()
                        .map(|e| e.endpoint.to_string())
                        .collect();
                    endpoint_target_fingerprint(
                        &params.database,
                        &params.table,
                        params.port,
                        &hosts,
                    )
                }
            };
            target_fingerprints.insert(target_key(&shard.name), fingerprint);
            if dedups && class.is_exactly_once() {
                let window = ShardDedupWindow {
                    shard: shard.name.clone(),
                    replicated: meta.kind != EngineKind::Plain,
                    windows: meta.dedup_windows.clone(),
                };
                check_dedup_window(params, dynamic, &window, partitions);
                dedup_windows.push(window);
            }
        }
        let Some((_, reference)) = first else {
            // No shard answered: wait, as there is no table to plan the encoding from.
            return Err(
                unreachable.unwrap_or_else(|| refused("no endpoint is configured".to_owned()))
            );
        };

        if dynamic.async_insert && !capabilities.async_insert {
            return Err(refused(ASYNC_INSERT_UNSUPPORTED.to_owned()));
        }
        let encoder = plan_columns(
            class,
            params,
            stream,
            &reference.columns,
            capabilities,
            &reference.server_types,
        )
        .map_err(refused)?;
        let columns_guard = ColumnsGuard::new(
            ColumnsGuard::query(&params.database, &params.table),
            reference.columns.clone(),
        );
        if class.is_exactly_once() && !capabilities.insert_deduplication_token {
            warn!(
                database = %params.database,
                table = %params.table,
                "the server has no `insert_deduplication_token`: exactly-once rests on ClickHouse's content-hash deduplication of bit-identical replays. Two distinct batches with identical rows would collapse into one; make rows unique (e.g. include the message id) or upgrade ClickHouse"
            );
        }
        let columns: Vec<String> = encoder.column_names();
        let insert_sql = format!(
            "INSERT INTO {} ({}) FORMAT RowBinary",
            quote_table(&params.database, &params.table),
            columns
                .iter()
                .map(|c| quote_ident(c))
                .collect::<Vec<_>>()
                .join(", ")
        );
        info!(
            database = %params.database,
            table = %params.table,
            shards = shards.len(),
            columns = columns.len(),
            tokens = capabilities.insert_deduplication_token,
            "ClickHouse writer session started"
        );
        let late_targets = Arc::new(LateTargets::new(&late_shards));
        let late_hosts = LateHosts::watch(
            late,
            LateCheck {
                sink_params: sink_params.clone(),
                columns: reference.columns.clone(),
                capabilities,
                timeout,
                targets: Arc::clone(&late_targets),
            },
        );
        Ok(WriterSession {
            _late_hosts: late_hosts,
            late_targets,
            shards,
            encoder,
            insert_sql,
            capabilities,
            target_fingerprints,
            database: params.database.clone(),
            table: params.table.clone(),
            dedup_windows,
            partitions,
            columns_guard,
        })
    }
}

fn describe(shard: &str, endpoint: &EndpointClient) -> String {
    if shard.is_empty() {
        format!("host {}", endpoint.endpoint)
    } else {
        format!("host {} of shard `{shard}`", endpoint.endpoint)
    }
}

pub(crate) fn min_capabilities(a: Capabilities, b: Capabilities) -> Capabilities {
    Capabilities {
        insert_deduplication_token: a.insert_deduplication_token && b.insert_deduplication_token,
        async_insert: a.async_insert && b.async_insert,
        async_insert_deduplicate: a.async_insert_deduplicate && b.async_insert_deduplicate,
        insert_deduplicate: a.insert_deduplicate && b.insert_deduplicate,
        replicas_zookeeper_name: a.replicas_zookeeper_name && b.replicas_zookeeper_name,
    }
}

/// [`probe`], refusing at once a port that speaks the other protocol than the sink, which would
/// otherwise look unreachable and be waited for forever:
/// - a plain HTTP sink whose request got no answer asks whether the port answers TLS;
/// - a TLS sink asks, alongside its probe, whether the port answers plain HTTP. A plain HTTP
///   server may answer a ClientHello, or may wait for the end of a request line that the hello's
///   random bytes never bring, so the answer to the hello alone cannot tell.
pub(crate) async fn probe_speaking_its_protocol(
    endpoint: &EndpointClient,
    sink_params: &SinkParams,
    timeout: Duration,
) -> Result<EndpointMetadata, SessionError> {
    let params = &sink_params.spec;
    let (host, port) = (&endpoint.endpoint.host, endpoint.endpoint.port);
    // A port that does not answer at all is neither.
    let check_timeout = timeout.min(crate::protocol::PROBE_TIMEOUT);
    let mismatch = |message: &str| SessionError::Refused {
        database: params.database.clone(),
        table: params.table.clone(),
        reason: format!("{}: {message}", endpoint.endpoint),
    };
    if sink_params.tls.is_some() {
        let plain_port = async {
            if crate::protocol::speaks_plain_http(host, port, check_timeout).await {
                return;
            }
            std::future::pending::<()>().await
        };
        return tokio::select! {
            probed = probe(endpoint, params, timeout) => probed,
            () = plain_port => Err(mismatch(crate::protocol::TLS_TO_PLAIN)),
        };
    }
    match probe(endpoint, params, timeout).await {
        Err(SessionError::Unreachable { .. })
            if crate::protocol::speaks_tls(host, port, check_timeout).await =>
        {
            Err(mismatch(crate::protocol::PLAIN_TO_TLS))
        }
        probed => probed,
    }
}

type Answer = Result<Vec<serde_json::Map<String, serde_json::Value>>, ClassifiedError>;

/// An endpoint's answers to the queries of a probe that depend on no other answer.
struct Answers {
    /// `engine` of the target in `system.tables`.
    tables: Answer,
    columns: Result<Vec<ColumnMeta>, ClassifiedError>,
    /// Which of the settings the sink may use the server knows.
    settings: Answer,
    /// Whether `system.replicas` has a `zookeeper_name` column.
    zookeeper_name_column: Answer,
    /// The server's defaults of the deduplication window settings.
    merge_tree_defaults: Answer,
    /// `SHOW CREATE TABLE` of the target.
    create: Answer,
    /// The server's version and type families.
    types: Answer,
}

/// Sends every query of [`Answers`] at once: a start costs two round trips per endpoint (these,
/// then the replication identity), not eight.
async fn ask(endpoint: &EndpointClient, params: &ClickHouseParams, timeout: Duration) -> Answers {
    let (db, table) = (
        quote_literal(&params.database),
        quote_literal(&params.table),
    );
    let windows: Vec<String> = DEDUP_WINDOW_SETTINGS
        .iter()
        .map(|n| quote_literal(n))
        .collect();
    // Only `engine`: the columns that read table metadata (`engine_full`) read every table's,
    // and old servers fail the query when another table of the database is dropped meanwhile.
    let tables =
        format!("SELECT engine FROM system.tables WHERE database = {db} AND name = {table}");
    let defaults = format!(
        "SELECT name, value FROM system.merge_tree_settings WHERE name IN ({})",
        windows.join(", ")
    );
    let create = format!(
        "SHOW CREATE TABLE {}",
        quote_table(&params.database, &params.table)
    );
    let columns_sql = ColumnsGuard::query(&params.database, &params.table);
    let (tables, columns, settings, zookeeper_name_column, merge_tree_defaults, create, types) = tokio::join!(
        endpoint.query_json(&tables, timeout),
        read_columns(endpoint, &columns_sql, timeout),
        endpoint.query_json(
            "SELECT name FROM system.settings WHERE name IN ('insert_deduplication_token', 'async_insert', 'async_insert_deduplicate', 'insert_deduplicate')",
            timeout,
        ),
        endpoint.query_json(
            "SELECT name FROM system.columns WHERE database = 'system' AND table = 'replicas' AND name = 'zookeeper_name'",
            timeout,
        ),
        endpoint.query_json(&defaults, timeout),
        endpoint.query_json(&create, timeout),
        endpoint.query_json(
            "SELECT version() AS version, groupArray(name) AS families FROM system.data_type_families",
            timeout,
        ),
    );
    Answers {
        tables,
        columns,
        settings,
        zookeeper_name_column,
        merge_tree_defaults,
        create,
        types,
    }
}

/// Reads everything the session checks from one endpoint. The answers are checked in a fixed
/// order, so a missing table is reported as such whatever the other queries said about it.
async fn probe(
    endpoint: &EndpointClient,
    params: &ClickHouseParams,
    timeout: Duration,
) -> Result<EndpointMetadata, SessionError> {
    let fail = |cause: ClassifiedError| -> SessionError {
        if cause.class == ErrorClass::Retryable {
            SessionError::Unreachable {
                endpoint: endpoint.endpoint.to_string(),
                cause,
            }
        } else {
            SessionError::Refused {
                database: params.database.clone(),
                table: params.table.clone(),
                reason: format!("{} answered: {cause}", endpoint.endpoint),
            }
        }
    };
    let refused = |reason: String| SessionError::Refused {
        database: params.database.clone(),
        table: params.table.clone(),
        reason,
    };
    let answers = ask(endpoint, params, timeout).await;
    let tables = answers.tables.map_err(fail)?;
    let Some(row) = tables.first() else {
        return Err(refused(format!(
            "the table does not exist on {}. Create `{}`.`{}` on every host of every shard",
            endpoint.endpoint, params.database, params.table
        )));
    };
    let engine = json_text(row, "engine");
    let kind = engine_kind(&engine, endpoint, params).map_err(refused)?;
    let columns = answers.columns.map_err(fail)?;
    let settings: Vec<String> = answers
        .settings
        .map_err(fail)?
        .iter()
        .map(|row| json_text(row, "name"))
        .collect();
    let has = |name: &str| settings.iter().any(|s| s == name);
    let capabilities = Capabilities {
        insert_deduplication_token: has("insert_deduplication_token"),
        async_insert: has("async_insert"),
        async_insert_deduplicate: has("async_insert_deduplicate"),
        insert_deduplicate: has("insert_deduplicate"),
        replicas_zookeeper_name: !answers.zookeeper_name_column.map_err(fail)?.is_empty(),
    };
    let (zookeeper_name, zookeeper_path) = if kind == EngineKind::Replicated {
        let replica = replication_identity(endpoint, params, &capabilities, timeout)
            .await
            .map_err(fail)?
            .ok_or_else(|| {
                refused(format!(
                    "{} is {engine} on {} but system.replicas has no entry for it",
                    params.table, endpoint.endpoint
                ))
            })?;
        (Some(replica.0), Some(replica.1))
    } else {
        (None, None)
    };
    let server_defaults = answers
        .merge_tree_defaults
        .map_err(fail)?
        .iter()
        .filter_map(|row| Some((json_text(row, "name"), json_u64(row, "value")?)))
        .collect();
    let statement = answers
        .create
        .map_err(fail)?
        .first()
        .map(|row| json_text(row, "statement"));
    let dedup_windows = DedupWindows::new(
        server_defaults,
        engine_clause(statement.as_deref().unwrap_or("")),
    );
    // What the server knows of types, so that a refused column can say which type it lacks. Only
    // messages use it, so a server (or a user) that cannot answer leaves it unknown.
    let server_types = match answers.types {
        Ok(rows) => rows.first().map(server_types_of).unwrap_or_default(),
        Err(err) => {
            debug!(endpoint = %endpoint.endpoint, error = %err, "server type families unknown");
            ServerTypes::default()
        }
    };
    Ok(EndpointMetadata {
        engine,
        kind,
        columns,
        zookeeper_name,
        zookeeper_path,
        capabilities,
        dedup_windows,
        server_types,
    })
}

/// The ZooKeeper name and path a replicated target replicates through, if `system.replicas`
/// lists it (servers without `zookeeper_name` have only the default ZooKeeper).
async fn replication_identity(
    endpoint: &EndpointClient,
    params: &ClickHouseParams,
    capabilities: &Capabilities,
    timeout: Duration,
) -> Result<Option<(String, String)>, ClassifiedError> {
    let name_column = if capabilities.replicas_zookeeper_name {
        ", zookeeper_name"
    } else {
        ""
    };
    let replicas = endpoint
        .query_json(
            &format!(
                "SELECT zookeeper_path, replica_name{name_column} FROM system.replicas WHERE database = {} AND table = {}",
                quote_literal(&params.database),
                quote_literal(&params.table)
            ),
            timeout,
        )
        .await?;
    Ok(replicas.first().map(|replica| {
        let name = if capabilities.replicas_zookeeper_name {
            json_text(replica, "zookeeper_name")
        } else {
            "default".to_owned()
        };
        (name, json_text(replica, "zookeeper_path"))
    }))
}

/// The engine family a target table of `engine` belongs to, or why the sink refuses it.
fn engine_kind(
    engine: &str,
    endpoint: &EndpointClient,
    params: &ClickHouseParams,
) -> Result<EngineKind, String> {
    if engine == "Distributed" {
        Err(format!(
            "{} is a Distributed table on {}. The sink routes rows to shards itself and needs each shard's local table; a Distributed target would forward blocks on its own and break the link between deduplication token and shard. Set `table` to the local table and list the shards in `shard_hosts`",
            params.table, endpoint.endpoint
        ))
    } else if engine.starts_with("Replicated") && engine.ends_with("MergeTree") {
        Ok(EngineKind::Replicated)
    } else if engine.starts_with("Shared") && engine.ends_with("MergeTree") {
        Ok(EngineKind::Shared)
    } else if engine.ends_with("MergeTree") {
        Ok(EngineKind::Plain)
    } else {
        Err(format!(
            "{} has engine {engine} on {}; only the MergeTree family is supported (ReplicatedMergeTree recommended), since exactly-once needs its block deduplication",
            params.table, endpoint.endpoint
        ))
    }
}

pub(crate) fn schema_difference(a: &[ColumnMeta], b: &[ColumnMeta]) -> Option<String> {
    for (i, (x, y)) in a.iter().zip(b).enumerate() {
        if x != y {
            return Some(format!(
                "column {} is `{}` {} {} {:?} there but `{}` {} {} {:?} here",
                i + 1,
                x.name,
                x.type_text,
                x.default_kind,
                x.default_expression,
                y.name,
                y.type_text,
                y.default_kind,
                y.default_expression
            ));
        }
    }
    (a.len() != b.len()).then(|| format!("{} columns there, {} here", a.len(), b.len()))
}

fn server_types_of(row: &serde_json::Map<String, serde_json::Value>) -> ServerTypes {
    ServerTypes {
        version: json_text(row, "version"),
        families: row
            .get("families")
            .and_then(|f| f.as_array())
            .map(|names| {
                names
                    .iter()
                    .filter_map(|n| n.as_str().map(str::to_owned))
                    .collect()
            })
            .unwrap_or_default(),
    }
}

/// Maps stream columns to table columns and builds the encoder.
fn plan_columns(
    class: SinkClass,
    params: &ClickHouseParams,
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
            problems.push(reason);
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

/// Warns when a shard's dedup window cannot cover a replay: shorter in time than
/// `replay_horizon`, or shorter in blocks than what this sink can insert into a shard between a
/// batch's first attempt and its replay (every partition's batches in delivery and queued).
fn check_dedup_window(
    params: &ClickHouseParams,
    dynamic: &ClickHouseDynamicParams,
    window: &ShardDedupWindow,
    partitions: u32,
) {
    let in_flight =
        u64::from(partitions) * (flow_core::delivery::DELIVERY_QUEUE_CAPACITY as u64 + 1);
    let warnings = window.windows.check(
        window.replicated,
        dynamic.async_insert,
        in_flight,
        dynamic.replay_horizon.as_secs(),
    );
    for warning in warnings {
        warning.log(&params.database, &params.table, &window.shard);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn non_deterministic_defaults_are_recognised() {
        assert!(is_non_deterministic("now()"));
        assert!(is_non_deterministic("toDate(NOW ())"));
        assert!(is_non_deterministic("generateUUIDv4()"));
        assert!(is_non_deterministic("rand() % 10"));
        assert!(!is_non_deterministic("toDate(ts)"));
        assert!(!is_non_deterministic("''"));
    }

    #[test]
    fn schema_difference_names_the_first_differing_column() {
        let col = |name: &str, ty: &str| ColumnMeta {
            name: name.to_owned(),
            type_text: ty.to_owned(),
            default_kind: String::new(),
            default_expression: String::new(),
        };
        let a = vec![col("id", "UInt64"), col("x", "String")];
        let b = vec![col("id", "UInt64"), col("x", "UInt8")];
        assert_eq!(
            schema_difference(&a, &b).unwrap(),
            "column 2 is `x` String  \"\" there but `x` UInt8  \"\" here"
        );
        assert_eq!(schema_difference(&a, &a), None);
        assert_eq!(
            schema_difference(&a, &a[..1]).unwrap(),
            "2 columns there, 1 here"
        );
    }
}
