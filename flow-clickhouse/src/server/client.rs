//! HTTP clients of one sink: one `clickhouse::Client` per endpoint, grouped by shard, with
//! metadata queries (JSONEachRow) and raw RowBinary inserts. Every failure comes back classified.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use bytes::Bytes;
use serde_json::{Map, Value as Json};

use crate::config::params::{HostSelectionPolicy, PasswordError, SinkParams};
use crate::config::topology::Endpoint;
use crate::delivery::backlog_age::BacklogAge;
use crate::delivery::backoff::RetryBackoff;
use crate::server::classify::{ClassifiedError, ErrorClass};
use crate::server::tls::{self, TlsError, TlsOptions};

/// Connect timeout of every endpoint; the per-operation timeout is `write_timeout`.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// One server of a shard.
#[derive(Clone)]
pub struct EndpointClient {
    pub endpoint: Endpoint,
    client: clickhouse::Client,
    /// When the table's columns were last found unchanged here (ms since the Unix epoch; 0:
    /// never), so that an INSERT right after a verified one needs no check of its own
    /// ([`crate::server::columns_guard`]).
    pub columns_checked_ms: std::sync::Arc<std::sync::atomic::AtomicU64>,
    /// Whether inserts may go here: an endpoint unreachable when the session started is left
    /// out of failover until it answers and passes the session's checks
    /// ([`crate::server::late_hosts`]).
    pub admitted: std::sync::Arc<std::sync::atomic::AtomicBool>,
}

/// The endpoints of one shard, in failover order.
pub struct ShardClients {
    /// `""` for the unsharded forms.
    pub name: String,
    pub endpoints: Vec<EndpointClient>,
    /// The endpoint to try first; moves on after a failure so the next attempt fails over.
    cursor: AtomicUsize,
    /// The shard's error count and retry pause, shared by the sink's partitions.
    pub backoff: RetryBackoff,
    /// When the shard's backlog was last warned about.
    pub backlog: BacklogAge,
}

impl ShardClients {
    /// The endpoint to use for the next attempt: the cursor's, or the next admitted one after it;
    /// `None` while no host of the shard is admitted (none answered since the session started).
    pub fn current(&self) -> Option<&EndpointClient> {
        let len = self.endpoints.len();
        let start = self.cursor.load(Ordering::Relaxed) % len.max(1);
        (0..len)
            .map(|step| &self.endpoints[(start + step) % len])
            .find(|endpoint| endpoint.admitted.load(Ordering::Relaxed))
    }

    /// Fails over to the next endpoint (round robin).
    pub fn advance(&self) {
        self.cursor.fetch_add(1, Ordering::Relaxed);
    }
}

/// Why the clients of a sink could not be built.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ClientsError {
    /// The TLS configuration (CA files, verifier) failed.
    #[error(transparent)]
    Tls(#[from] TlsError),
    /// The password could not be read.
    #[error(transparent)]
    Password(#[from] PasswordError),
}

/// Builds the clients of every shard. The password is read from its variable or file now.
pub fn build_shards(params: &SinkParams) -> Result<Vec<ShardClients>, ClientsError> {
    let options = TlsOptions::from_config(params.tls.as_ref());
    let base = tls::base_client(&options, CONNECT_TIMEOUT)?;
    let spec = params;
    let password = spec.credentials.password()?;
    let scheme = tls::scheme(&options);
    // Batches are compressed once when sealed (see `compress`), so the client never compresses.
    let mut base = base
        .with_validation(false)
        .with_user(spec.credentials.user.clone())
        .with_compression(clickhouse::Compression::None);
    if let Some(password) = password {
        base = base.with_password(password);
    }
    let shards = params
        .topology
        .shards()
        .into_iter()
        .map(|(name, endpoints)| {
            let endpoints: Vec<EndpointClient> = endpoints
                .iter()
                .map(|endpoint| EndpointClient {
                    columns_checked_ms: std::sync::Arc::default(),
                    admitted: std::sync::Arc::new(std::sync::atomic::AtomicBool::new(true)),
                    // `Endpoint` displays as a URL authority (`host:port`, `[v6]:port`).
                    client: base.clone().with_url(format!("{scheme}://{endpoint}")),
                    endpoint: endpoint.clone(),
                })
                .collect();
            let start = match spec.host_selection_policy {
                HostSelectionPolicy::OrderedRoundRobin => 0,
                HostSelectionPolicy::RandomStart => {
                    rand::random::<usize>() % endpoints.len().max(1)
                }
            };
            ShardClients {
                // The unsharded forms' one shard is stored as `""` (see `SealedBatch::shard`).
                name: name.unwrap_or_default().to_owned(),
                endpoints,
                cursor: AtomicUsize::new(start),
                backoff: RetryBackoff::default(),
                backlog: BacklogAge::default(),
            }
        })
        .collect();
    Ok(shards)
}

/// Quotes a string literal for SQL.
pub fn quote_literal(text: &str) -> String {
    let mut out = String::with_capacity(text.len() + 2);
    out.push('\'');
    for c in text.chars() {
        match c {
            '\'' => out.push_str("\\'"),
            '\\' => out.push_str("\\\\"),
            c => out.push(c),
        }
    }
    out.push('\'');
    out
}

/// Quotes an identifier for SQL.
pub fn quote_ident(name: &str) -> String {
    format!("`{}`", name.replace('\\', "\\\\").replace('`', "\\`"))
}

/// `database.table`, both quoted as identifiers.
pub fn quote_table(database: &str, table: &str) -> String {
    format!("{}.{}", quote_ident(database), quote_ident(table))
}

/// A host as messages name it: `host H`, or `host H of shard `S`` where the sink is sharded.
pub fn describe_host(shard: &str, endpoint: &EndpointClient) -> String {
    if shard.is_empty() {
        format!("host {}", endpoint.endpoint)
    } else {
        format!("host {} of shard `{shard}`", endpoint.endpoint)
    }
}

impl EndpointClient {
    /// Runs a query and returns its rows as JSON objects.
    pub async fn query_json(
        &self,
        sql: &str,
        timeout: Duration,
    ) -> Result<Vec<Map<String, Json>>, ClassifiedError> {
        let run = async {
            let mut cursor = self
                .client
                .query(sql)
                .fetch_bytes("JSONEachRow")
                .map_err(|err| ClassifiedError::from_clickhouse(&err))?;
            let mut body = Vec::new();
            while let Some(chunk) = cursor
                .next()
                .await
                .map_err(|err| ClassifiedError::from_clickhouse(&err))?
            {
                body.extend_from_slice(&chunk);
            }
            let mut rows = Vec::new();
            for line in body.split(|&b| b == b'\n').filter(|l| !l.is_empty()) {
                let row: Map<String, Json> = serde_json::from_slice(line).map_err(|err| {
                    ClassifiedError::from_server(
                        None,
                        format!("unexpected response to `{sql}`: {err}"),
                    )
                })?;
                rows.push(row);
            }
            Ok(rows)
        };
        match tokio::time::timeout(timeout, run).await {
            Ok(result) => result,
            Err(_) => Err(ClassifiedError::network(format!(
                "no answer from {} within {}",
                self.endpoint,
                humantime::format_duration(timeout)
            ))),
        }
    }

    /// Runs a statement without a result (an `ALTER`).
    pub async fn execute(&self, sql: &str, timeout: Duration) -> Result<(), ClassifiedError> {
        let run = self.client.query(sql).execute();
        match tokio::time::timeout(timeout, run).await {
            Ok(result) => result.map_err(|err| ClassifiedError::from_clickhouse(&err)),
            Err(_) => Err(ClassifiedError::network(format!(
                "no answer from {} within {}",
                self.endpoint,
                humantime::format_duration(timeout)
            ))),
        }
    }

    /// Sends one INSERT with `payload` as its data (in ClickHouse's compression framing when
    /// `compressed`). Succeeds only when the server acknowledged it.
    pub async fn insert(
        &self,
        sql: &str,
        settings: &[(std::borrow::Cow<'static, str>, String)],
        payload: Bytes,
        compressed: bool,
        timeout: Duration,
    ) -> Result<(), InsertError> {
        let mut insert = self
            .client
            .insert_formatted_with(sql.to_owned())
            .with_timeouts(Some(timeout), Some(timeout));
        if compressed {
            insert = insert.with_setting("decompress", "1");
        }
        for (name, value) in settings {
            insert = insert.with_setting(name.clone(), value.clone());
        }
        // A body cut while it is sent is one incomplete frame, which the server drops.
        insert.send(payload).await.map_err(|err| InsertError {
            error: ClassifiedError::from_clickhouse(&err),
            unanswered: false,
        })?;
        insert.end().await.map_err(|err| {
            let error = ClassifiedError::from_clickhouse(&err);
            let unanswered = match error.code {
                Some(code) => code == UNKNOWN_STATUS_OF_INSERT,
                None => error.class == ErrorClass::Retryable && !never_connected(&err),
            };
            InsertError { error, unanswered }
        })
    }
}

/// A failed INSERT request.
#[derive(Debug)]
pub struct InsertError {
    pub error: ClassifiedError,
    /// The whole body went out and no verdict came back (the connection broke or timed out while
    /// waiting, or the server answered 319): the rows may have landed.
    pub unanswered: bool,
}

/// The server's own "the insert may or may not have landed".
const UNKNOWN_STATUS_OF_INSERT: u32 = 319;

/// Whether the request failed before a connection to the server existed.
fn never_connected(err: &clickhouse::error::Error) -> bool {
    let mut current: Option<&(dyn std::error::Error + 'static)> = Some(err);
    while let Some(err) = current {
        if let Some(client) = err.downcast_ref::<hyper_util::client::legacy::Error>() {
            if client.is_connect() {
                return true;
            }
        }
        if let Some(io) = err.downcast_ref::<std::io::Error>() {
            if io.kind() == std::io::ErrorKind::ConnectionRefused {
                return true;
            }
        }
        current = err.source();
    }
    false
}

/// Reads a JSON field as text (18.16 quotes 64-bit integers in JSON output).
pub fn json_text(row: &Map<String, Json>, field: &str) -> String {
    match row.get(field) {
        Some(Json::String(s)) => s.clone(),
        Some(Json::Null) | None => String::new(),
        Some(other) => other.to_string(),
    }
}

/// Reads a JSON field as an unsigned integer (quoted or not).
pub fn json_u64(row: &Map<String, Json>, field: &str) -> Option<u64> {
    match row.get(field) {
        Some(Json::String(s)) => s.parse().ok(),
        Some(Json::Number(n)) => n.as_u64(),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn literals_and_identifiers_are_quoted() {
        assert_eq!(quote_literal("it's"), "'it\\'s'");
        assert_eq!(quote_literal("a\\b"), "'a\\\\b'");
        assert_eq!(quote_ident("we`ird"), "`we\\`ird`");
        assert_eq!(quote_table("db", "we`ird"), "`db`.`we\\`ird`");
    }

    #[test]
    fn ipv6_hosts_are_bracketed_in_urls() {
        let url = |entry| format!("http://{}", Endpoint::parse(entry, 8123).unwrap());
        assert_eq!(url("::1"), "http://[::1]:8123");
        assert_eq!(url("[::1]:9000"), "http://[::1]:9000");
        assert_eq!(url("127.0.0.1"), "http://127.0.0.1:8123");
    }
}
