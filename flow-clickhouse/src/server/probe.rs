//! Probing one endpoint: what the session checks of every host (engine, columns, replication
//! identity, capabilities, dedup window defaults, the server's type families), asked in one
//! round of queries, and the errors a probe or a session start end with ([`SessionError`]).

use std::time::Duration;

use flow_core::SinkError;
use thiserror::Error;
use tracing::debug;

use crate::config::params::SinkParams;
use crate::encode::chtype::{ChType, ServerTypes};
use crate::server::classify::{ClassifiedError, ErrorClass};
use crate::server::client::{
    json_text, json_u64, quote_literal, quote_table, ClientsError, EndpointClient,
};
use crate::server::columns_guard::{read_columns, ColumnMeta, ColumnsGuard};
use crate::server::dedup_window::{engine_clause, DedupWindows, DEDUP_WINDOW_SETTINGS};

/// Why a session did not start.
#[derive(Error, Debug)]
pub enum SessionError {
    /// An endpoint did not answer; the session start is retried.
    #[error("endpoint {endpoint} is not reachable: {cause}")]
    Unreachable {
        endpoint: String,
        cause: ClassifiedError,
    },
    /// The clients of the target's endpoints cannot be built (TLS files, the password).
    #[error("{source}")]
    Clients {
        database: String,
        table: String,
        #[source]
        source: ClientsError,
    },
    /// The table does not exist on an endpoint (a sink with a table template dead-letters or
    /// waits on it; any other sink refuses to start, as for [`SessionError::Refused`]).
    #[error("the table does not exist on {endpoint}. Create `{database}`.`{table}` on every host of every shard")]
    NoTable {
        database: String,
        table: String,
        endpoint: String,
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
    /// The start's refusal of the table `params` names, saying why and what to do.
    pub(crate) fn refused(params: &SinkParams, reason: String) -> SessionError {
        SessionError::Refused {
            database: params.database.clone(),
            table: params.table.clone(),
            reason,
        }
    }

    /// An unreachable endpoint is transient; a refusal is permanent.
    pub fn class(&self) -> ErrorClass {
        match self {
            SessionError::Unreachable { .. } => ErrorClass::Retryable,
            SessionError::Refused { .. }
            | SessionError::NoTable { .. }
            | SessionError::Clients { .. } => ErrorClass::Permanent,
        }
    }

    /// The error the sink fails with:
    /// `Refusing to start the ClickHouse sink for <database>.<table>: <reason>`.
    pub fn into_sink_error(self) -> SinkError {
        let context = match &self {
            SessionError::Refused {
                database, table, ..
            }
            | SessionError::NoTable {
                database, table, ..
            }
            | SessionError::Clients {
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

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum EngineKind {
    Replicated,
    Shared,
    Plain,
}

impl EngineKind {
    /// The MergeTree family member `engine` (as `system.tables.engine` names it) is, or `None`
    /// outside the family.
    pub(crate) fn of(engine: &str) -> Option<EngineKind> {
        if !engine.ends_with("MergeTree") {
            None
        } else if engine.starts_with("Replicated") {
            Some(EngineKind::Replicated)
        } else if engine.starts_with("Shared") {
            Some(EngineKind::Shared)
        } else {
            Some(EngineKind::Plain)
        }
    }
}

#[derive(Clone, Debug)]
pub(crate) struct EndpointMetadata {
    pub(crate) engine: String,
    pub(crate) kind: EngineKind,
    pub(crate) columns: Vec<ColumnMeta>,
    pub(crate) zookeeper_name: Option<String>,
    pub(crate) zookeeper_path: Option<String>,
    pub(crate) capabilities: Capabilities,
    pub(crate) dedup_windows: DedupWindows,
    pub(crate) server_types: ServerTypes,
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
    let params = sink_params;
    let (host, port) = (&endpoint.endpoint.host, endpoint.endpoint.port);
    // A port that does not answer at all is neither.
    let check_timeout = timeout.min(crate::server::protocol::PROBE_TIMEOUT);
    let mismatch =
        |message: &str| SessionError::refused(params, format!("{}: {message}", endpoint.endpoint));
    if sink_params.tls.is_some() {
        let plain_port = async {
            if crate::server::protocol::speaks_plain_http(host, port, check_timeout).await {
                return;
            }
            std::future::pending::<()>().await
        };
        return tokio::select! {
            probed = probe(endpoint, params, timeout) => probed,
            () = plain_port => Err(mismatch(crate::server::protocol::TLS_TO_PLAIN)),
        };
    }
    match probe(endpoint, params, timeout).await {
        Err(SessionError::Unreachable { .. })
            if crate::server::protocol::speaks_tls(host, port, check_timeout).await =>
        {
            Err(mismatch(crate::server::protocol::PLAIN_TO_TLS))
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
    /// Which of the settings the sink may use (its capabilities and the user's `settings`) the
    /// server knows.
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

/// The settings whose presence tells what the server can do ([`Capabilities`]).
const CAPABILITY_SETTINGS: [&str; 5] = [
    "insert_deduplication_token",
    "async_insert",
    "async_insert_deduplicate",
    "insert_deduplicate",
    JSON_AS_TEXT,
];

/// The setting under which a `JSON` column's RowBinary value is the object's text, the form
/// flow sends (the server's own binary form of JSON depends on the column's dynamic paths).
const JSON_AS_TEXT: &str = "input_format_binary_read_json_as_string";

/// The refusal of a table with a `JSON` column on a server that cannot read it as text (one
/// with the type before the setting): every INSERT would fail with code 115.
fn json_unreadable(columns: &[ColumnMeta], known: &[String], endpoint: &str) -> Option<String> {
    if known.iter().any(|name| name == JSON_AS_TEXT) {
        return None;
    }
    let column = columns
        .iter()
        .find(|c| ChType::parse(&c.type_text).holds_json())?;
    Some(format!(
        "column `{}` is {}, whose values flow sends as JSON text, but the server on {endpoint} \
         has no setting {JSON_AS_TEXT} to read them so (it is not in system.settings there); \
         upgrade the server or make the column a String",
        column.name, column.type_text
    ))
}

/// The first of the user's `settings` the server does not know, as the refusal's reason. Sent
/// with every INSERT, it would fail each with code 115 after its batch was sealed; at the start it
/// stops the sink before anything is sealed, naming the setting, the host and its version (when
/// the host told it).
fn unknown_setting(
    params: &SinkParams,
    known: &[String],
    endpoint: &str,
    version: Option<&str>,
) -> Option<String> {
    let (name, _) = params
        .settings
        .iter()
        .find(|(name, _)| !known.iter().any(|k| k == name))?;
    let server = version.map_or_else(
        || "the server".to_owned(),
        |version| format!("ClickHouse {version}"),
    );
    Some(format!(
        "the setting `{name}` of the sink's `settings` is not a setting of {server} on \
         {endpoint} (it is not in system.settings there); remove it, or check its name against \
         that server's version"
    ))
}

/// Sends every query of [`Answers`] at once: a start costs two round trips per endpoint (these,
/// then the replication identity), not eight.
async fn ask(endpoint: &EndpointClient, params: &SinkParams, timeout: Duration) -> Answers {
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
    let columns_sql = ColumnsGuard::system_columns_query(&params.database, &params.table);
    let settings_sql = format!(
        "SELECT name FROM system.settings WHERE name IN ({})",
        CAPABILITY_SETTINGS
            .iter()
            .copied()
            .chain(params.settings.iter().map(|(name, _)| name.as_str()))
            .map(quote_literal)
            .collect::<Vec<_>>()
            .join(", ")
    );
    let (tables, columns, settings, zookeeper_name_column, merge_tree_defaults, create, types) = tokio::join!(
        endpoint.query_json(&tables, timeout),
        read_columns(endpoint, &columns_sql, timeout),
        endpoint.query_json(&settings_sql, timeout),
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
    params: &SinkParams,
    timeout: Duration,
) -> Result<EndpointMetadata, SessionError> {
    let fail = |cause: ClassifiedError| -> SessionError {
        if cause.class == ErrorClass::Retryable {
            SessionError::Unreachable {
                endpoint: endpoint.endpoint.to_string(),
                cause,
            }
        } else {
            SessionError::refused(params, format!("{} answered: {cause}", endpoint.endpoint))
        }
    };
    let refused = |reason: String| SessionError::refused(params, reason);
    let answers = ask(endpoint, params, timeout).await;
    let tables = answers.tables.map_err(fail)?;
    let Some(row) = tables.first() else {
        return Err(SessionError::NoTable {
            database: params.database.clone(),
            table: params.table.clone(),
            endpoint: endpoint.endpoint.to_string(),
        });
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
    let version = answers.types.as_ref().ok().and_then(|rows| rows.first());
    let version = version.map(|row| json_text(row, "version"));
    let endpoint_text = endpoint.endpoint.to_string();
    if let Some(reason) = unknown_setting(params, &settings, &endpoint_text, version.as_deref()) {
        return Err(refused(reason));
    }
    if let Some(reason) = json_unreadable(&columns, &settings, &endpoint.endpoint.to_string()) {
        return Err(refused(reason));
    }
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
    params: &SinkParams,
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
    params: &SinkParams,
) -> Result<EngineKind, String> {
    if engine == "Distributed" {
        Err(format!(
            "{} is a Distributed table on {}. The sink routes rows to shards itself and needs each shard's local table; a Distributed target would forward blocks on its own and break the link between deduplication token and shard. Set `table` to the local table and list the shards in `shard_hosts`",
            params.table, endpoint.endpoint
        ))
    } else if let Some(kind) = EngineKind::of(engine) {
        Ok(kind)
    } else {
        Err(format!(
            "{} has engine {engine} on {}; only the MergeTree family is supported (ReplicatedMergeTree recommended), since exactly-once needs its block deduplication",
            params.table, endpoint.endpoint
        ))
    }
}

/// The first difference between the columns `a` on `a_where` and `b` on `b_where` (each a host
/// and its shard, as [`crate::server::session`] describes them), naming both sides: `` column 2
/// is `x` String on host A of shard `a` but `x` UInt8 on host B of shard `b` ``. A column's
/// default is shown only when it has one.
pub(crate) fn schema_difference(
    a: &[ColumnMeta],
    a_where: &str,
    b: &[ColumnMeta],
    b_where: &str,
) -> Option<String> {
    for (i, (x, y)) in a.iter().zip(b).enumerate() {
        if x != y {
            return Some(format!(
                "column {} is {} on {a_where} but {} on {b_where}",
                i + 1,
                show_column(x),
                show_column(y)
            ));
        }
    }
    (a.len() != b.len())
        .then(|| format!("{} columns on {a_where}, {} on {b_where}", a.len(), b.len()))
}

/// `` `name` Type ``, then ` DEFAULT expr` (or MATERIALIZED, ALIAS) when the column has one.
pub(crate) fn show_column(c: &ColumnMeta) -> String {
    if c.default_kind.is_empty() {
        format!("`{}` {}", c.name, c.type_text)
    } else {
        format!(
            "`{}` {} {} {}",
            c.name, c.type_text, c.default_kind, c.default_expression
        )
    }
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

#[cfg(test)]
mod tests {
    use super::*;

    fn params_with_settings(settings: &str) -> SinkParams {
        let yaml =
            serde_yaml::from_str(&format!("{{host: h, table: t, settings: {settings}}}")).unwrap();
        crate::config::params::parse(
            crate::config::guarantee::SinkClass::Batching,
            &yaml,
            &serde_yaml::Value::Null,
            flow_core::SpecPaths::working_directory(),
        )
        .unwrap()
        .0
    }

    #[test]
    fn a_setting_the_server_does_not_list_refuses_the_start_naming_it_and_the_host() {
        let params = params_with_settings("{max_insert_block_size: 10, flow_typo: 1}");
        let known = [
            "max_insert_block_size".to_owned(),
            "async_insert".to_owned(),
        ];
        assert_eq!(
            unknown_setting(&params, &known, "127.0.0.1:18127", Some("26.9.2.1")).as_deref(),
            Some(
                "the setting `flow_typo` of the sink's `settings` is not a setting of ClickHouse \
                 26.9.2.1 on 127.0.0.1:18127 (it is not in system.settings there); remove it, or \
                 check its name against that server's version"
            )
        );
        assert!(unknown_setting(&params, &known, "h", None)
            .unwrap()
            .contains("is not a setting of the server on h"));
        let all = ["flow_typo".to_owned(), "max_insert_block_size".to_owned()];
        assert_eq!(unknown_setting(&params, &all, "h", None), None);
        assert_eq!(
            unknown_setting(&params_with_settings("{}"), &[], "h", None),
            None
        );
    }

    #[test]
    fn a_json_column_on_a_server_without_json_as_text_refuses_the_start_naming_it() {
        let col = |name: &str, ty: &str| ColumnMeta {
            name: name.to_owned(),
            type_text: ty.to_owned(),
            default_kind: String::new(),
            default_expression: String::new(),
        };
        let columns = [
            col("id", "UInt64"),
            col("tags", "Array(JSON(max_dynamic_paths=8))"),
        ];
        assert_eq!(
            json_unreadable(&columns, &["async_insert".to_owned()], "h:1").as_deref(),
            Some(
                "column `tags` is Array(JSON(max_dynamic_paths=8)), whose values flow sends as \
                 JSON text, but the server on h:1 has no setting \
                 input_format_binary_read_json_as_string to read them so (it is not in \
                 system.settings there); upgrade the server or make the column a String"
            )
        );
        assert_eq!(
            json_unreadable(&columns, &[JSON_AS_TEXT.to_owned()], "h:1"),
            None
        );
        assert_eq!(json_unreadable(&columns[..1], &[], "h:1"), None);
    }

    #[test]
    fn schema_difference_names_both_sides_and_shows_a_default_only_when_there_is_one() {
        let col = |name: &str, ty: &str, kind: &str, expr: &str| ColumnMeta {
            name: name.to_owned(),
            type_text: ty.to_owned(),
            default_kind: kind.to_owned(),
            default_expression: expr.to_owned(),
        };
        let (on_a, on_b) = (
            "host 127.0.0.1:18123 of shard `a`",
            "host 127.0.0.1:18125 of shard `b`",
        );
        let a = vec![
            col("id", "UInt64", "", ""),
            col("user_id", "UInt64", "", ""),
        ];
        let b = vec![
            col("id", "UInt64", "", ""),
            col("user_id", "UInt32", "", ""),
        ];
        assert_eq!(
            schema_difference(&a, on_a, &b, on_b).unwrap(),
            "column 2 is `user_id` UInt64 on host 127.0.0.1:18123 of shard `a` but `user_id` \
             UInt32 on host 127.0.0.1:18125 of shard `b`"
        );
        let defaulted = vec![
            col("id", "UInt64", "", ""),
            col("user_id", "UInt64", "DEFAULT", "0"),
        ];
        assert_eq!(
            schema_difference(&a, on_a, &defaulted, on_b).unwrap(),
            "column 2 is `user_id` UInt64 on host 127.0.0.1:18123 of shard `a` but `user_id` \
             UInt64 DEFAULT 0 on host 127.0.0.1:18125 of shard `b`"
        );
        assert_eq!(schema_difference(&a, on_a, &a, on_b), None);
        assert_eq!(
            schema_difference(&a, on_a, &a[..1], on_b).unwrap(),
            "2 columns on host 127.0.0.1:18123 of shard `a`, 1 on host 127.0.0.1:18125 of shard `b`"
        );
    }
}
