//! The static `parameters` of the ClickHouse sinks: their serde type, defaults, the validation
//! that reports every violation with its path in the spec (`parameters.shard_hosts.a[1]`), and
//! the parsing of both sections ([`parse`]; the reloadable ones are in `config::dynamic`).
//!
//! The names, defaults, ranges and rules are those of the reference document, except where the
//! contract overrides them: the transport is ClickHouse's HTTP interface, so `port` defaults to 8123
//! and a host entry may carry its own port (`host:port`, `[v6]:port`); `codec` is `lz4` or `none`;
//! the batch limits are extended (see `MAX_ROWS_PER_BATCH`, `MAX_BYTES_PER_BATCH` in `dynamic`); and
//! `token_namespace` is our addition.

use std::collections::{BTreeMap, HashMap};

use std::path::PathBuf;

use flow_core::registry::parse_parameters;
use flow_core::{SpecPaths, Violation};
use flow_state::OutboxId;
use serde::{Deserialize, Serialize};

use crate::config::dynamic::ClickHouseDynamicParams;
use crate::config::guarantee::{HostForms, SinkClass};
use crate::config::settings::{self, SettingValue};
use crate::config::topology::{Endpoint, Shard, Topology};
use crate::server::tls::TlsConfig;
use crate::tables::template::TableTemplate;

/// The default HTTP port of ClickHouse.
pub const DEFAULT_PORT: u16 = 8123;

// ---------------------------------------------------------------------------------------------
// Static parameters

/// The order of endpoints within a shard.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum HostSelectionPolicy {
    /// Keep the configured order.
    #[default]
    OrderedRoundRobin,
    /// Start at a uniformly random position chosen once per client, then rotate.
    RandomStart,
}

/// HTTP compression of inserted data.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Codec {
    /// LZ4 (the default).
    #[default]
    Lz4,
    /// Uncompressed.
    None,
}

/// What a sink does with a row that fails its checks (static `on_bad_rows`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OnBadRows {
    /// The partition fails with the row's id, column and reason (the reference's behaviour).
    #[default]
    Stop,
    /// The row goes to the sink's dead letters and the rest of the epoch goes on.
    DeadLetter,
}

/// What a sink with a table template does with a message whose table does not exist (static
/// `missing_table`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum MissingTable {
    /// The message goes to the sink's dead letters, naming the table; the epoch goes on.
    #[default]
    DeadLetter,
    /// The epoch is vetoed and read again after a pause, until the table exists.
    Wait,
}

/// What an exactly-once sink does with a pending part that is older than its shard's
/// deduplication window and may already have landed: an earlier attempt got no answer (static
/// `on_expired_backlog`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OnExpiredBacklog {
    /// Its rows go to the dead letters instead of being sent again: past the window the server
    /// would no longer recognise a resend, so a part that landed unanswered would land twice.
    #[default]
    DeadLetter,
    /// It is sent again all the same, accepting a duplicate if the unanswered attempt landed.
    Send,
}

/// Static `at_most_once_strategy`; accepted only by `AtMostOnceClickHouseSink`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct AtMostOnceStrategy {
    /// `true`: every message goes through a bounded lossy in-memory queue without waiting for
    /// delivery; `false` (default): ordered delivery of pending messages.
    pub enabled: bool,
}

/// The static `parameters` of a ClickHouse sink. A change needs a restart.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ClickHouseParams {
    /// The single host of the unsharded form (`host` or `host:port`). An empty string in a
    /// spec reads as unset.
    #[serde(
        deserialize_with = "empty_as_none",
        skip_serializing_if = "Option::is_none"
    )]
    pub host: Option<String>,
    /// HTTP port of every host entry that carries no port of its own.
    pub port: u16,
    /// The hosts of one unsharded table (at least two).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub hosts: Vec<String>,
    /// The order in which a shard's hosts are tried.
    pub host_selection_policy: HostSelectionPolicy,
    /// Shard name => the hosts of that shard.
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub shard_hosts: BTreeMap<String, Vec<String>>,
    /// Columns whose values form the routing key; empty routes by message id. Needs `shard_hosts`.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub sharding_key_columns: Vec<String>,
    /// The ClickHouse user (default `default`).
    pub user: String,
    /// Name of the environment variable holding the password; unset (or `""` in a spec)
    /// connects without one.
    #[serde(
        deserialize_with = "empty_as_none",
        skip_serializing_if = "Option::is_none"
    )]
    pub password_env_var: Option<String>,
    /// A file holding the password (a mounted secret), read when the clients are built; one
    /// trailing line break is not part of it. Not with `password_env_var`.
    #[serde(
        deserialize_with = "empty_as_none",
        skip_serializing_if = "Option::is_none"
    )]
    pub password_file: Option<PathBuf>,
    /// The database of `table` (default `default`).
    pub database: String,
    /// Required unless `tables` is set: a table name, or a template over input columns and
    /// the broker subject (`events_{event_type}`, `{subject[1]}`; every class but the at-most-once queue).
    pub table: String,
    /// Broker subject -> table (`tables: {"orders.created": orders_created}`); instead of
    /// `table`; every class but the at-most-once queue.
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub tables: BTreeMap<String, String>,
    /// With a table template: what a message whose table does not exist does.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub missing_table: Option<MissingTable>,
    /// With a table template: the most distinct tables the sink's rows may name.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_tables: Option<usize>,
    /// HTTP compression of inserted data (default LZ4).
    pub codec: Codec,
    /// Talk HTTPS instead of HTTP; every other TLS option is rejected without it.
    pub enable_tls: bool,
    /// PEM files whose certificates are trusted as roots (with none and no `tls_ca_directory`, the
    /// system roots).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub tls_ca_files: Vec<PathBuf>,
    /// A directory whose `*.pem` / `*.crt` files are trusted as roots.
    #[serde(
        deserialize_with = "empty_as_none",
        skip_serializing_if = "Option::is_none"
    )]
    pub tls_ca_directory: Option<PathBuf>,
    /// Accept any server certificate (insecure; for tests only).
    pub tls_skip_verification: bool,
    /// Our addition: the prefix of deduplication tokens; `None` means
    /// `<pipeline>.<sink>.<outbox id>/`.
    /// Must match `[A-Za-z0-9_./-]*`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub token_namespace: Option<String>,
    /// Static at-most-once settings; only `AtMostOnceClickHouseSink` accepts it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub at_most_once_strategy: Option<AtMostOnceStrategy>,
    /// What a row that fails its checks does (default `stop`).
    pub on_bad_rows: OnBadRows,
    /// Exactly-once classes only.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub on_expired_backlog: Option<OnExpiredBacklog>,
    /// Exactly-once classes only: the input column (an integer type) whose value identifies each
    /// message, so that a part that may have landed under other columns is checked against the
    /// table's replicas instead of being sent again blindly.
    #[serde(
        deserialize_with = "empty_as_none",
        skip_serializing_if = "Option::is_none"
    )]
    pub message_id_column: Option<String>,
    /// ClickHouse settings added to every INSERT (`settings: { max_insert_block_size: 100000 }`);
    /// the ones flow sets itself are refused (see `config::settings`).
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub settings: BTreeMap<String, SettingValue>,
    /// How often the sink re-reads its table's columns to adopt a compatible change
    /// (100 ..= 86,400,000 ms).
    pub schema_refresh_interval_ms: u64,
    /// How long every INSERT into a shard may fail before `/ready` names the shard
    /// (1,000 ..= 86,400,000 ms).
    pub unready_after_ms: u64,
    /// Stream columns missing from the table are added to it when the session starts; refused
    /// for the exactly-once classes (see the validation).
    pub auto_add_columns: bool,
}

/// The bounds of `max_tables`.
pub const MAX_TABLES: std::ops::RangeInclusive<usize> = 1..=10_000;
/// The default `max_tables`: a template over a column with a few values (event kinds, tenants)
/// stays far below it; one over an identifier (a user id) reaches it at once, and its rows become
/// dead letters instead of a writer session (and a probe of every host) each.
pub const DEFAULT_MAX_TABLES: usize = 100;

/// The bounds of `schema_refresh_interval_ms`: at most ten re-reads a second, at least one a day.
pub const SCHEMA_REFRESH_INTERVAL_MS: std::ops::RangeInclusive<u64> = 100..=86_400_000;

/// The default `schema_refresh_interval_ms`: a change is adopted within 10 s when no INSERT
/// meets it first, for one small query per shard.
pub const DEFAULT_SCHEMA_REFRESH_INTERVAL_MS: u64 = 10_000;

/// The bounds of `unready_after_ms`.
pub const UNREADY_AFTER_MS: std::ops::RangeInclusive<u64> = 1_000..=86_400_000;

/// The default `unready_after_ms`: a shard whose every INSERT has failed for 30 s is reported by
/// `/ready`; a restart of one host or a short network cut stays below it.
pub const DEFAULT_UNREADY_AFTER_MS: u64 = 30_000;

impl Default for ClickHouseParams {
    fn default() -> Self {
        ClickHouseParams {
            host: None,
            port: DEFAULT_PORT,
            hosts: Vec::new(),
            host_selection_policy: HostSelectionPolicy::default(),
            shard_hosts: BTreeMap::new(),
            sharding_key_columns: Vec::new(),
            user: "default".to_owned(),
            password_env_var: None,
            password_file: None,
            database: "default".to_owned(),
            table: String::new(),
            tables: BTreeMap::new(),
            missing_table: None,
            max_tables: None,
            codec: Codec::default(),
            enable_tls: false,
            tls_ca_files: Vec::new(),
            tls_ca_directory: None,
            tls_skip_verification: false,
            token_namespace: None,
            at_most_once_strategy: None,
            on_bad_rows: OnBadRows::Stop,
            on_expired_backlog: None,
            message_id_column: None,
            settings: BTreeMap::new(),
            schema_refresh_interval_ms: DEFAULT_SCHEMA_REFRESH_INTERVAL_MS,
            unready_after_ms: DEFAULT_UNREADY_AFTER_MS,
            auto_add_columns: false,
        }
    }
}

/// Why the password could not be read. Neither variant holds any of the password.
#[derive(Debug, thiserror::Error)]
pub enum PasswordError {
    /// From `password_env_var`.
    #[error(transparent)]
    Env(#[from] PasswordEnvError),
    /// From `password_file`.
    #[error(
        "cannot read the password file `{}` named by parameters.password_file; make it readable \
         by the worker, or fix the path",
        path.display()
    )]
    File {
        /// The file.
        path: PathBuf,
        /// Why reading it failed.
        #[source]
        source: std::io::Error,
    },
    /// `password_file` was read but holds no password that can be sent.
    #[error("the password file `{}` named by parameters.password_file {reason}", path.display())]
    Content {
        /// The file.
        path: PathBuf,
        /// What is wrong with it (never any of its text).
        reason: &'static str,
    },
}

/// Why the password named by `password_env_var` could not be read.
#[derive(Debug, thiserror::Error)]
#[error(
    "the environment variable `{var}` named by parameters.password_env_var is {}",
    match source {
        std::env::VarError::NotPresent => "not set; export it with the ClickHouse password, or \
            set password_env_var to \"\" to connect without a password",
        std::env::VarError::NotUnicode(_) => "not valid UTF-8; export the password as UTF-8 text",
    }
)]
pub struct PasswordEnvError {
    /// The variable.
    pub var: String,
    /// Why it could not be read.
    #[source]
    pub source: std::env::VarError,
}

/// The static parameters, validated once into resolved values: the host entries parsed into a
/// [`Topology`], the TLS settings into an optional [`TlsConfig`], the credentials, the table
/// and the policies. Nothing reads the spec after this.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SinkParams {
    /// The database of `table`.
    pub database: String,
    /// The target table (on every host of every shard); with a template, the template's text
    /// until a row resolves it (see [`crate::tables`]).
    pub table: String,
    /// `table` as a template over input columns and the broker subject.
    pub table_template: Option<TableTemplate>,
    /// `tables`: broker subject -> table (then `table` is empty and `table_template` `None`).
    pub tables: BTreeMap<String, String>,
    pub missing_table: MissingTable,
    /// With a table template: the most distinct tables its rows may name ([`MAX_TABLES`]).
    pub max_tables: usize,
    pub topology: Topology,
    /// The port of host entries without one (part of the endpoint target fingerprint).
    pub port: u16,
    pub tls: Option<TlsConfig>,
    pub credentials: Credentials,
    pub host_selection_policy: HostSelectionPolicy,
    /// Columns whose values form the routing key; empty routes by message id.
    pub sharding_key_columns: Vec<String>,
    /// The prefix of deduplication tokens; `None` means the default of
    /// [`SinkParams::token_prefix`].
    pub token_namespace: Option<String>,
    pub codec: Codec,
    pub on_bad_rows: OnBadRows,
    pub on_expired_backlog: Option<OnExpiredBacklog>,
    /// The input column carrying each message's id (exactly-once classes; checked against the
    /// stream when the sink is built).
    pub message_id_column: Option<String>,
    /// `at_most_once_strategy.enabled`: the bounded lossy in-memory queue.
    pub at_most_once_queue: bool,
    /// The user's ClickHouse settings of every INSERT, in name order.
    pub settings: Vec<(String, String)>,
    /// How often the table's columns are re-read.
    pub schema_refresh_interval: std::time::Duration,
    /// `unready_after_ms`: how long a shard's INSERTs may all fail before `/ready` names it.
    pub unready_after: std::time::Duration,
    /// `auto_add_columns`.
    pub auto_add_columns: bool,
}

impl SinkParams {
    /// The prefix of this sink's deduplication tokens: `token_namespace`, or by default
    /// `<pipeline>.<sink>.<outbox id>/` with the identity of the state directory's outbox, so that
    /// two state directories of the same pipeline name never send the same token for different
    /// rows. A store created before outbox identities existed (`outbox` is `None`) keeps the
    /// default it always had, `<pipeline>.<sink>/`. Either way a replay sends the token stored
    /// with its batch, never one derived again.
    pub fn token_prefix(&self, pipeline: &str, sink: &str, outbox: Option<OutboxId>) -> String {
        match (&self.token_namespace, outbox) {
            (Some(namespace), _) => namespace.clone(),
            (None, Some(outbox)) => format!("{pipeline}.{sink}.{outbox}/"),
            (None, None) => format!("{pipeline}.{sink}/"),
        }
    }
}

/// Who the sink connects as: the user, and where the password is (never the password itself,
/// so that no `Debug` print of the parameters can show it).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Credentials {
    pub user: String,
    pub password_env_var: Option<String>,
    pub password_file: Option<PathBuf>,
}

impl Credentials {
    /// The password, read from `password_env_var` (call it when creating a client). `Ok(None)`
    /// when no variable is named; `Err` naming the variable when it is unset or not UTF-8.
    pub fn password(&self) -> Result<Option<String>, PasswordError> {
        if let Some(path) = &self.password_file {
            let text = std::fs::read_to_string(path).map_err(|source| PasswordError::File {
                path: path.clone(),
                source,
            })?;
            // `echo secret > file` and most secret stores end the file with a line break.
            let password = text
                .strip_suffix("\r\n")
                .or_else(|| text.strip_suffix('\n'))
                .unwrap_or(&text);
            let unusable = if password.is_empty() {
                Some(
                    "is empty: a sent empty password is refused as REQUIRED_PASSWORD by a user \
                     that has one; write the password into it, or drop password_file for a user \
                     without one",
                )
            } else if password.chars().any(char::is_control) {
                Some(
                    "holds a line break or another control character besides one final line \
                     break, which an HTTP header cannot carry; write the password alone, ending \
                     with at most one line break",
                )
            } else {
                None
            };
            if let Some(reason) = unusable {
                return Err(PasswordError::Content {
                    path: path.clone(),
                    reason,
                });
            }
            return Ok(Some(password.to_owned()));
        }
        let Some(var) = &self.password_env_var else {
            return Ok(None);
        };
        match std::env::var(var) {
            Ok(password) => Ok(Some(password)),
            Err(source) => Err(PasswordEnvError {
                var: var.clone(),
                source,
            }
            .into()),
        }
    }
}

impl ClickHouseParams {
    /// The `shard_hosts` form is used.
    pub fn is_sharded(&self) -> bool {
        !self.shard_hosts.is_empty()
    }

    /// Every semantic violation of these parameters for `class`, with paths under `parameters`.
    pub fn validate(&self, class: SinkClass) -> Vec<Violation> {
        self.check(class).0
    }

    /// The files it names, as the spec means them ([`SpecPaths::resolve`]).
    fn resolve_paths(&mut self, paths: SpecPaths<'_>) {
        self.password_file = self.password_file.as_deref().map(|p| paths.resolve(p));
        for file in &mut self.tls_ca_files {
            *file = paths.resolve(file);
        }
        self.tls_ca_directory = self.tls_ca_directory.as_deref().map(|p| paths.resolve(p));
    }

    /// Validates these parameters for `class` into the typed model the sinks use.
    pub fn to_sink_params(&self, class: SinkClass) -> Result<SinkParams, Vec<Violation>> {
        match self.check(class) {
            (v, Some(topology)) if v.is_empty() => Ok(SinkParams {
                database: self.database.clone(),
                table: self.table.clone(),
                table_template: TableTemplate::is_template(&self.table)
                    .then(|| TableTemplate::parse(&self.table).ok())
                    .flatten(),
                tables: self.tables.clone(),
                missing_table: self.missing_table.unwrap_or_default(),
                max_tables: self.max_tables.unwrap_or(DEFAULT_MAX_TABLES),
                topology,
                port: self.port,
                tls: self.tls_config(),
                credentials: Credentials {
                    user: self.user.clone(),
                    password_env_var: self.password_env_var.clone(),
                    password_file: self.password_file.clone(),
                },
                host_selection_policy: self.host_selection_policy,
                sharding_key_columns: self.sharding_key_columns.clone(),
                token_namespace: self.token_namespace.clone(),
                codec: self.codec,
                on_bad_rows: self.on_bad_rows,
                on_expired_backlog: self.on_expired_backlog,
                message_id_column: self.message_id_column.clone(),
                at_most_once_queue: self
                    .at_most_once_strategy
                    .as_ref()
                    .is_some_and(|s| s.enabled),
                settings: settings::to_pairs(&self.settings),
                schema_refresh_interval: std::time::Duration::from_millis(
                    self.schema_refresh_interval_ms,
                ),
                unready_after: std::time::Duration::from_millis(self.unready_after_ms),
                auto_add_columns: self.auto_add_columns,
            }),
            (v, _) => Err(v),
        }
    }

    /// The TLS settings, `None` without `enable_tls`.
    fn tls_config(&self) -> Option<TlsConfig> {
        self.enable_tls.then(|| TlsConfig {
            ca_files: self.tls_ca_files.clone(),
            ca_directory: self.tls_ca_directory.clone(),
            skip_verification: self.tls_skip_verification,
        })
    }

    /// Every violation, and the topology when the host form is complete.
    fn check(&self, class: SinkClass) -> (Vec<Violation>, Option<Topology>) {
        let mut v = Vec::new();
        self.validate_host_forms(class, &mut v);
        let topology = self.validate_endpoints(&mut v);
        self.validate_sharding_key(&mut v);
        self.validate_target(class, &mut v);
        self.validate_tls(&mut v);
        self.validate_password_file(&mut v);
        settings::validate(&self.settings, &mut v);
        if let Some(namespace) = &self.token_namespace {
            if !namespace
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '.' | '/' | '-'))
            {
                v.push(Violation::new(
                    "parameters.token_namespace",
                    format!(
                        "`{namespace}` may only contain letters, digits, `_`, `.`, `/` and `-`; \
                         rename it, or remove it to use the default \
                         `<pipeline>.<sink>.<outbox id>/`"
                    ),
                ));
            }
        }
        if self.on_expired_backlog.is_some() && !class.is_exactly_once() {
            v.push(Violation::new(
                "parameters.on_expired_backlog",
                format!(
                    "{class} keeps no backlog of sent batches, so it has nothing to expire; \
                     remove on_expired_backlog, or use an exactly-once class"
                ),
            ));
        }
        if !SCHEMA_REFRESH_INTERVAL_MS.contains(&self.schema_refresh_interval_ms) {
            v.push(Violation::new(
                "parameters.schema_refresh_interval_ms",
                format!(
                    "{} is outside {}..={} (ms); set a value in range, or remove it for the default {}",
                    self.schema_refresh_interval_ms,
                    SCHEMA_REFRESH_INTERVAL_MS.start(),
                    SCHEMA_REFRESH_INTERVAL_MS.end(),
                    DEFAULT_SCHEMA_REFRESH_INTERVAL_MS
                ),
            ));
        }
        if !UNREADY_AFTER_MS.contains(&self.unready_after_ms) {
            v.push(Violation::new(
                "parameters.unready_after_ms",
                format!(
                    "{} is outside {}..={} (ms); set a value in range, or remove it for the default {}",
                    self.unready_after_ms,
                    UNREADY_AFTER_MS.start(),
                    UNREADY_AFTER_MS.end(),
                    DEFAULT_UNREADY_AFTER_MS
                ),
            ));
        }
        if self.auto_add_columns && class.is_exactly_once() {
            v.push(Violation::new(
                "parameters.auto_add_columns",
                format!(
                    "{class} cannot add columns to its table: a column added for a stream field \
                     joins the INSERT's column list, so the batches already sealed (pending in \
                     the outbox, or rebuilt from the source) could not be delivered as sealed, \
                     and on a server without insert_deduplication_token a part stored before the \
                     ADD COLUMN would not be recognised as a replay. Remove auto_add_columns and \
                     add the column by hand (`ALTER TABLE ... ADD COLUMN` on every shard) while \
                     the sink is drained, or use AtLeastOnceClickHouseSink"
                ),
            ));
        }
        if self.message_id_column.is_some() && !class.is_exactly_once() {
            v.push(Violation::new(
                "parameters.message_id_column",
                format!(
                    "{class} keeps no pending parts to check against the table, so it has no use \
                     for message_id_column; remove it, or use an exactly-once class"
                ),
            ));
        }
        if self.at_most_once_strategy.is_some() && class != SinkClass::AtMostOnce {
            v.push(Violation::new(
                "parameters.at_most_once_strategy",
                format!(
                    "{class} does not support at_most_once_strategy; remove it, or use \
                     AtMostOnceClickHouseSink"
                ),
            ));
        }
        (v, topology)
    }

    fn validate_host_forms(&self, class: SinkClass, v: &mut Vec<Violation>) {
        let mut set = Vec::new();
        if self.host.is_some() {
            set.push("`host`");
        }
        if !self.hosts.is_empty() {
            set.push("`hosts`");
        }
        if !self.shard_hosts.is_empty() {
            set.push("`shard_hosts`");
        }
        match set.len() {
            0 => {
                let what = match class.host_forms() {
                    HostForms::Unsharded => "set `host` (one host) or `hosts` (several replicas)",
                    HostForms::Sharded => "set `shard_hosts` (shard name => list of hosts)",
                    HostForms::Any => "set exactly one of `host`, `hosts` or `shard_hosts`",
                };
                v.push(Violation::new(
                    "parameters",
                    format!(
                        "no ClickHouse host is configured: {what} (exactly one of `host`, \
                         `hosts`, `shard_hosts` must be set)"
                    ),
                ));
            }
            1 => {}
            _ => v.push(Violation::new(
                "parameters",
                format!(
                    "{} are all set, but exactly one of `host`, `hosts`, `shard_hosts` must be; \
                     keep one and remove the others",
                    set.join(" and ")
                ),
            )),
        }
        if self.hosts.len() == 1 {
            v.push(Violation::new(
                "parameters.hosts",
                format!(
                    "a single-entry `hosts` list is not allowed: use `host: {}` instead",
                    self.hosts[0]
                ),
            ));
        }
        match class.host_forms() {
            HostForms::Unsharded if self.is_sharded() => v.push(Violation::new(
                "parameters.shard_hosts",
                "ClickHouseBatchingSink writes one unsharded table and rejects `shard_hosts`: use \
                 `host` or `hosts`, or switch sink_class_name to ShardedClickHouseBatchingSink",
            )),
            HostForms::Sharded if !self.is_sharded() => {
                for (field, is_set) in [
                    ("host", self.host.is_some()),
                    ("hosts", !self.hosts.is_empty()),
                ] {
                    if is_set {
                        v.push(Violation::new(
                            format!("parameters.{field}"),
                            format!(
                                "ShardedClickHouseBatchingSink requires `shard_hosts` (shard \
                                 name => list of hosts) instead of `{field}`; or switch \
                                 sink_class_name to ClickHouseBatchingSink"
                            ),
                        ));
                    }
                }
            }
            _ => {}
        }
    }

    /// Parses every host entry (once), reporting bad and duplicate ones; returns the topology
    /// of the host form that is set when all of its entries parse.
    fn validate_endpoints(&self, v: &mut Vec<Violation>) -> Option<Topology> {
        if self.port == 0 {
            v.push(Violation::new(
                "parameters.port",
                "port 0 is not valid: set the ClickHouse HTTP port (8123 by default)",
            ));
        }
        // Endpoints seen so far (host lowercased, port resolved) => the path that named them.
        let mut seen: HashMap<(String, u16), String> = HashMap::new();
        let mut check = |path: String, entry: &str, v: &mut Vec<Violation>| {
            let endpoint = Endpoint::parse(entry, self.port)
                .map_err(|message| v.push(Violation::new(path.clone(), message)))
                .ok()?;
            let key = (endpoint.host.to_ascii_lowercase(), endpoint.port);
            if let Some(first) = seen.get(&key) {
                v.push(Violation::new(
                    path,
                    format!(
                        "`{entry}` is endpoint {endpoint}, which is already listed at \
                         {first}; every endpoint may appear only once across all hosts \
                         and shards, remove the duplicate"
                    ),
                ));
            } else {
                seen.insert(key, path);
            }
            Some(endpoint)
        };
        // An unset `host` is reported by the host-form check.
        let single = self
            .host
            .as_ref()
            .and_then(|host| check("parameters.host".to_owned(), host, v));
        // Every entry is checked: collect all of them before giving up on the form.
        let replicas: Vec<Option<Endpoint>> = self
            .hosts
            .iter()
            .enumerate()
            .map(|(i, entry)| check(format!("parameters.hosts[{i}]"), entry, v))
            .collect();
        let replicas: Option<Vec<Endpoint>> = replicas.into_iter().collect();
        let mut shards = Some(Vec::new());
        for (name, hosts) in &self.shard_hosts {
            let path = if name.is_empty() {
                "parameters.shard_hosts".to_owned()
            } else {
                format!("parameters.shard_hosts.{name}")
            };
            check_shard(name, hosts, &path, v);
            let replicas: Vec<Option<Endpoint>> = hosts
                .iter()
                .enumerate()
                .map(|(i, entry)| check(format!("{path}[{i}]"), entry, v))
                .collect();
            let replicas: Option<Vec<Endpoint>> = replicas.into_iter().collect();
            match (&mut shards, replicas) {
                (Some(shards), Some(replicas)) => shards.push(Shard {
                    name: name.clone(),
                    replicas,
                }),
                _ => shards = None,
            }
        }
        if self.is_sharded() {
            shards.map(Topology::Shards)
        } else if !self.hosts.is_empty() {
            replicas.map(Topology::Replicas)
        } else {
            single.map(Topology::SingleHost)
        }
    }

    fn validate_sharding_key(&self, v: &mut Vec<Violation>) {
        if self.sharding_key_columns.is_empty() {
            return;
        }
        if !self.is_sharded() {
            v.push(Violation::new(
                "parameters.sharding_key_columns",
                "sharding_key_columns only applies to the `shard_hosts` form; remove it, or \
                 configure `shard_hosts`",
            ));
        }
        let mut seen = HashMap::new();
        for (i, column) in self.sharding_key_columns.iter().enumerate() {
            let path = format!("parameters.sharding_key_columns[{i}]");
            if column.is_empty() {
                v.push(Violation::new(
                    path,
                    "the column name is empty: name a column of the input stream, or remove the \
                     entry",
                ));
            } else if let Some(first) = seen.get(column.as_str()) {
                v.push(Violation::new(
                    path,
                    format!(
                        "column `{column}` is already listed at \
                         parameters.sharding_key_columns[{first}]; remove the duplicate"
                    ),
                ));
            } else {
                seen.insert(column.as_str(), i);
            }
        }
    }

    /// Whether the sink writes many tables: `table` is a template, or `tables` is set.
    pub fn names_many_tables(&self) -> bool {
        TableTemplate::is_template(&self.table) || !self.tables.is_empty()
    }

    fn validate_target(&self, class: SinkClass, v: &mut Vec<Violation>) {
        if !self.tables.is_empty() {
            self.validate_tables(class, v);
        } else if TableTemplate::is_template(&self.table) {
            self.validate_template(class, v);
        } else if self.table.is_empty() {
            v.push(Violation::new(
                "parameters.table",
                "the target table is required: set `table` to its name (letters, digits, `_`)",
            ));
        } else if !is_identifier(&self.table) {
            v.push(Violation::new(
                "parameters.table",
                format!(
                    "table name `{}` may only contain letters, digits and `_`; give the bare \
                     table name (the database goes to `database`)",
                    self.table
                ),
            ));
        }
        match self.max_tables {
            Some(_) if !self.names_many_tables() => v.push(Violation::new(
                "parameters.max_tables",
                "max_tables applies to a table template (`table: \"events_{event_type}\"`); \
                 remove it, or make `table` a template",
            )),
            Some(n) if !MAX_TABLES.contains(&n) => v.push(Violation::new(
                "parameters.max_tables",
                format!(
                    "{n} is outside {}..={}: every table keeps a writer session whose columns are \
                     re-read every schema_refresh_interval_ms",
                    MAX_TABLES.start(),
                    MAX_TABLES.end()
                ),
            )),
            _ => {}
        }
        if self.missing_table.is_some() && !self.names_many_tables() {
            v.push(Violation::new(
                "parameters.missing_table",
                "missing_table applies to a table template (`table: \"events_{event_type}\"`); \
                 remove it, or make `table` a template",
            ));
        }
        if self.database.is_empty() {
            v.push(Violation::new(
                "parameters.database",
                "the database is empty: set `database` (letters, digits, `_`), or remove it to \
                 use `default`",
            ));
        } else if !is_identifier(&self.database) {
            v.push(Violation::new(
                "parameters.database",
                format!(
                    "database name `{}` may only contain letters, digits and `_`; fix the name",
                    self.database
                ),
            ));
        }
        if self.user.is_empty() {
            v.push(Violation::new(
                "parameters.user",
                "the user is empty: set the ClickHouse user, or remove `user` to use `default`",
            ));
        }
        if let Some(var) = self
            .password_env_var
            .as_ref()
            .filter(|v| !is_env_var_name(v))
        {
            v.push(Violation::new(
                "parameters.password_env_var",
                format!(
                    "`{var}` is not an environment variable name: name the variable that holds \
                     the password (letters, digits and `_`, not starting with a digit), not the \
                     password itself"
                ),
            ));
        }
    }

    fn validate_password_file(&self, v: &mut Vec<Violation>) {
        if self.password_file.is_some() && self.password_env_var.is_some() {
            v.push(Violation::new(
                "parameters.password_file",
                "password_file and password_env_var both name where the password is; keep one \
                 of them",
            ));
        }
    }

    /// `table` as a template: its syntax (its columns are checked against the input stream when
    /// the sink is built), and a class that can write many tables.
    fn validate_template(&self, class: SinkClass, v: &mut Vec<Violation>) {
        if let Err(violation) = TableTemplate::parse(&self.table) {
            v.push(violation);
        }
        self.validate_many_tables_class(class, &format!("a table template (`{}`)", self.table), v);
    }

    /// Every class writes many tables except the at-most-once queue (`at_most_once_strategy:
    /// {enabled: true}`): it is one buffer per shard for the whole sink, encoded for one table's
    /// columns under one plan, and sent by one task under one `total_queue_bytes_limit`.
    fn validate_many_tables_class(&self, class: SinkClass, what: &str, v: &mut Vec<Violation>) {
        let queued = self
            .at_most_once_strategy
            .as_ref()
            .is_some_and(|s| s.enabled);
        if class == SinkClass::AtMostOnce && queued {
            v.push(Violation::new(
                "parameters.at_most_once_strategy.enabled",
                format!(
                    "the at-most-once queue holds the rows of one table (one buffer per shard, encoded for that table's columns); {what} needs the ordered mode (`enabled: false`), or one sink per table with a filter before each"
                ),
            ));
        }
    }

    /// `tables` (subject -> table): instead of `table`, names for values, and a class that can
    /// write many tables. Whether every partition's subject is a key is checked when the sink
    /// is built, against the source's subjects.
    fn validate_tables(&self, class: SinkClass, v: &mut Vec<Violation>) {
        if !self.table.is_empty() {
            v.push(Violation::new(
                "parameters.tables",
                format!(
                    "parameters.table (`{}`) and parameters.tables both name the target tables; keep one: `table` for one table or a template, `tables` for a table per broker subject",
                    self.table
                ),
            ));
        }
        for (subject, table) in &self.tables {
            if !is_identifier(table) {
                v.push(Violation::new(
                    format!("parameters.tables.{subject}"),
                    format!(
                        "table name `{table}` may only contain letters, digits and `_`; give the bare table name (the database goes to `database`)"
                    ),
                ));
            }
        }
        self.validate_many_tables_class(class, "a `tables` map", v);
    }

    fn validate_tls(&self, v: &mut Vec<Violation>) {
        if !self.enable_tls {
            let needs_tls = |option: &str| {
                format!("{option} requires `enable_tls: true`; enable TLS, or remove {option}")
            };
            if !self.tls_ca_files.is_empty() {
                v.push(Violation::new(
                    "parameters.tls_ca_files",
                    needs_tls("tls_ca_files"),
                ));
            }
            if self.tls_ca_directory.is_some() {
                v.push(Violation::new(
                    "parameters.tls_ca_directory",
                    needs_tls("tls_ca_directory"),
                ));
            }
            if self.tls_skip_verification {
                v.push(Violation::new(
                    "parameters.tls_skip_verification",
                    needs_tls("tls_skip_verification"),
                ));
            }
        }
        for (i, file) in self.tls_ca_files.iter().enumerate() {
            if file.as_os_str().is_empty() {
                v.push(Violation::new(
                    format!("parameters.tls_ca_files[{i}]"),
                    "the CA file path is empty: give the path of a CA certificate file, or remove \
                     the entry",
                ));
            }
        }
        if self.tls_skip_verification
            && (!self.tls_ca_files.is_empty() || self.tls_ca_directory.is_some())
        {
            v.push(Violation::new(
                "parameters.tls_skip_verification",
                "tls_skip_verification contradicts tls_ca_files / tls_ca_directory (CAs are only \
                 used to verify the server); remove tls_skip_verification, or the CA settings",
            ));
        }
    }
}

/// Reports a bad shard name and a shard without hosts.
fn check_shard(name: &str, hosts: &[String], path: &str, v: &mut Vec<Violation>) {
    if name.is_empty() {
        v.push(Violation::new(
            path,
            "a shard name is empty: name every shard with letters, digits, `_` and `-` \
             (the name is part of the deduplication token, choose it for good)",
        ));
    } else if !is_shard_name(name) {
        v.push(Violation::new(
            path,
            format!(
                "shard name `{name}` may only contain letters, digits, `_` and `-`; \
                 rename the shard (the name is part of the deduplication token, choose \
                 it for good)"
            ),
        ));
    }
    if hosts.is_empty() {
        v.push(Violation::new(
            path,
            format!("shard `{name}` has no hosts: list at least one host, or remove the shard"),
        ));
    }
}

fn is_shard_name(name: &str) -> bool {
    !name.is_empty()
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '-'))
}

fn is_identifier(name: &str) -> bool {
    !name.is_empty() && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
}

/// Reads an optional text parameter, an empty string standing for unset (specs written for the
/// reference spell "no value" that way).
fn empty_as_none<'de, D, T>(deserializer: D) -> Result<Option<T>, D::Error>
where
    D: serde::Deserializer<'de>,
    T: From<String>,
{
    let text = Option::<String>::deserialize(deserializer)?;
    Ok(text.filter(|t| !t.is_empty()).map(T::from))
}

fn is_env_var_name(name: &str) -> bool {
    let mut chars = name.chars();
    matches!(chars.next(), Some(c) if c.is_ascii_alphabetic() || c == '_')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_')
}

// ---------------------------------------------------------------------------------------------
// Parsing

/// Deserializes and validates both sections, the relative paths they name (`password_file`,
/// `tls_ca_files`, `tls_ca_directory`) resolved against `paths`. Reports the structural errors
/// of both sections first (the first one of each: an unknown field, a wrong type), then every
/// semantic violation of each section that parsed. Paths are relative to the sink's spec entry
/// (`parameters.shard_hosts.a`, `dynamic_parameters.max_rows_per_batch`).
pub fn parse(
    class: SinkClass,
    parameters: &serde_yaml::Value,
    dynamic: &serde_yaml::Value,
    paths: SpecPaths<'_>,
) -> Result<(SinkParams, ClickHouseDynamicParams), Vec<Violation>> {
    parse_spec_in(class, parameters, dynamic, paths).map(|(_, params, dynamic)| (params, dynamic))
}

/// [`parse`], also returning the static parameters as the spec gives them (for the typed
/// builder, which hands them back).
pub fn parse_spec(
    class: SinkClass,
    parameters: &serde_yaml::Value,
    dynamic: &serde_yaml::Value,
) -> Result<(ClickHouseParams, SinkParams, ClickHouseDynamicParams), Vec<Violation>> {
    parse_spec_in(class, parameters, dynamic, SpecPaths::working_directory())
}

fn parse_spec_in(
    class: SinkClass,
    parameters: &serde_yaml::Value,
    dynamic: &serde_yaml::Value,
    paths: SpecPaths<'_>,
) -> Result<(ClickHouseParams, SinkParams, ClickHouseDynamicParams), Vec<Violation>> {
    let params: Result<ClickHouseParams, _> =
        parse_parameters(parameters, "parameters").map(|mut params: ClickHouseParams| {
            params.resolve_paths(paths);
            params
        });
    let dynamic: Result<ClickHouseDynamicParams, _> =
        parse_parameters(dynamic, "dynamic_parameters");
    let mut violations = Vec::new();
    violations.extend(params.as_ref().err().into_iter().flatten().cloned());
    violations.extend(dynamic.as_ref().err().into_iter().flatten().cloned());
    let params = params.ok().map(|spec| (spec.to_sink_params(class), spec));
    if let Some((Err(v), _)) = &params {
        violations.extend(v.iter().cloned());
    }
    if let Ok(dynamic) = &dynamic {
        violations.extend(dynamic.validate(class));
    }
    match (params, dynamic) {
        (Some((Ok(params), spec)), Ok(dynamic)) if violations.is_empty() => {
            Ok((spec, params, dynamic))
        }
        _ => Err(violations),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    use crate::config::dynamic::{AtMostOnceDynamic, MAX_ROWS_PER_BATCH};

    fn yaml(text: &str) -> serde_yaml::Value {
        serde_yaml::from_str(text).unwrap()
    }

    /// [`super::parse`] of a spec given as text (relative paths stay as written).
    fn parse(
        class: SinkClass,
        parameters: &serde_yaml::Value,
        dynamic: &serde_yaml::Value,
    ) -> Result<(SinkParams, ClickHouseDynamicParams), Vec<Violation>> {
        super::parse(class, parameters, dynamic, SpecPaths::working_directory())
    }

    fn violations(class: SinkClass, parameters: &str, dynamic: &str) -> Vec<Violation> {
        parse(class, &yaml(parameters), &yaml(dynamic)).unwrap_err()
    }

    fn paths(violations: &[Violation]) -> Vec<&str> {
        violations.iter().map(|v| v.path.as_str()).collect()
    }

    /// A minimal host form `class` accepts (`shard_hosts` for the sharded class, `host` else).
    fn host_form(class: SinkClass) -> &'static str {
        if class == SinkClass::ShardedBatching {
            "shard_hosts: {a: [h]}"
        } else {
            "host: h"
        }
    }

    /// Parses `parameters` for `class` with default dynamic parameters, expecting success.
    fn ok(class: SinkClass, parameters: &str) -> ClickHouseParams {
        parse_spec(class, &yaml(parameters), &serde_yaml::Value::Null)
            .unwrap()
            .0
    }

    /// The resolved parameters of valid `parameters` for `class`.
    fn resolved(class: SinkClass, parameters: &str) -> SinkParams {
        parse(class, &yaml(parameters), &serde_yaml::Value::Null)
            .unwrap()
            .0
    }

    /// The topology of valid `parameters` for `class`.
    fn topology(class: SinkClass, parameters: &str) -> Topology {
        parse(class, &yaml(parameters), &serde_yaml::Value::Null)
            .unwrap()
            .0
            .topology
    }

    fn ok_dynamic(dynamic: &str) -> ClickHouseDynamicParams {
        parse(
            SinkClass::Batching,
            &yaml("{host: h, table: t}"),
            &yaml(dynamic),
        )
        .unwrap()
        .1
    }

    fn single(class: SinkClass, parameters: &str, dynamic: &str) -> Violation {
        let mut v = violations(class, parameters, dynamic);
        assert_eq!(v.len(), 1, "{v:?}");
        v.remove(0)
    }

    #[test]
    fn defaults_are_the_documented_ones() {
        let (p, _, d) = parse_spec(
            SinkClass::Batching,
            &yaml("{host: ch, table: events}"),
            &serde_yaml::Value::Null,
        )
        .unwrap();
        assert_eq!(
            p,
            ClickHouseParams {
                host: Some("ch".into()),
                table: "events".into(),
                ..ClickHouseParams::default()
            }
        );
        assert_eq!(p.port, 8123);
        assert_eq!(p.user, "default");
        assert_eq!(p.database, "default");
        assert_eq!(p.password_env_var, None);
        assert_eq!(p.codec, Codec::Lz4);
        assert_eq!(
            p.host_selection_policy,
            HostSelectionPolicy::OrderedRoundRobin
        );
        assert!(!p.enable_tls && !p.tls_skip_verification);
        assert!(p.tls_ca_files.is_empty() && p.tls_ca_directory.is_none());
        assert_eq!(p.token_namespace, None);
        assert_eq!(p.at_most_once_strategy, None);
        assert_eq!(d.write_timeout, Duration::from_secs(60));
        assert_eq!(d.retry_backoff, Duration::from_secs(1));
        assert_eq!(d.max_insert_attempts, 10);
        assert!(!d.async_insert);
        assert_eq!(d.replay_horizon, Duration::from_secs(86_400));
        assert_eq!(d.max_rows_per_batch, 1000);
        assert_eq!(d.max_bytes_per_batch, 5 * 1024 * 1024);
        assert_eq!(d.at_most_once_strategy, None);
        assert_eq!(
            AtMostOnceDynamic::default().total_queue_bytes_limit,
            64 * 1024 * 1024
        );
        assert!(!AtMostOnceStrategy::default().enabled);
    }

    #[test]
    fn enums_parse_from_snake_case() {
        let p = ok(
            SinkClass::Batching,
            "{host: h, table: t, codec: none, host_selection_policy: random_start}",
        );
        assert_eq!(p.codec, Codec::None);
        assert_eq!(p.host_selection_policy, HostSelectionPolicy::RandomStart);
        let v = single(SinkClass::Batching, "{host: h, table: t, codec: zstd}", "");
        assert_eq!(v.path, "parameters.codec");
    }

    #[test]
    fn class_names_and_aliases_are_accepted() {
        for (name, class) in [
            ("ClickHouseBatchingSink", SinkClass::Batching),
            ("NYT::NFlow::TClickHouseBatchingSink", SinkClass::Batching),
            ("ShardedClickHouseBatchingSink", SinkClass::ShardedBatching),
            (
                "NYT::NFlow::TShardedClickHouseBatchingSink",
                SinkClass::ShardedBatching,
            ),
            ("AtLeastOnceClickHouseSink", SinkClass::AtLeastOnce),
            (
                "NYT::NFlow::TAtLeastOnceClickHouseSink",
                SinkClass::AtLeastOnce,
            ),
            ("AtMostOnceClickHouseSink", SinkClass::AtMostOnce),
            (
                "NYT::NFlow::TAtMostOnceClickHouseSink",
                SinkClass::AtMostOnce,
            ),
        ] {
            assert_eq!(SinkClass::from_class_name(name), Some(class), "{name}");
        }
        for name in [
            "TClickHouseBatchingSink",
            "NYT::NFlow::ClickHouseBatchingSink",
            "",
        ] {
            assert_eq!(SinkClass::from_class_name(name), None, "{name}");
        }
        assert_eq!(SinkClass::all_names().len(), 8);
        for name in SinkClass::all_names() {
            assert!(SinkClass::from_class_name(&name).is_some());
        }
        for class in SinkClass::ALL {
            assert_eq!(SinkClass::from_class_name(class.class_name()), Some(class));
            assert_eq!(
                SinkClass::from_class_name(&class.reference_name()),
                Some(class)
            );
        }
        assert!(SinkClass::Batching.is_exactly_once());
        assert!(SinkClass::ShardedBatching.is_exactly_once());
        assert!(!SinkClass::AtLeastOnce.is_exactly_once());
        assert!(!SinkClass::AtMostOnce.is_exactly_once());
    }

    #[test]
    fn durations_parse_from_humantime_or_milliseconds() {
        let d = ok_dynamic("{write_timeout: 1m, retry_backoff: 250ms, replay_horizon: 1d}");
        assert_eq!(d.write_timeout, Duration::from_secs(60));
        assert_eq!(d.retry_backoff, Duration::from_millis(250));
        assert_eq!(d.replay_horizon, Duration::from_secs(86_400));
        let d = ok_dynamic("{write_timeout: 1500, retry_backoff: 0, replay_horizon: '1h 30m'}");
        assert_eq!(d.write_timeout, Duration::from_millis(1500));
        assert_eq!(d.retry_backoff, Duration::ZERO);
        assert_eq!(d.replay_horizon, Duration::from_secs(5400));
    }

    #[test]
    fn durations_serialize_as_humantime_and_round_trip() {
        let d = ok_dynamic("{write_timeout: 1500, replay_horizon: 1d}");
        let text = serde_yaml::to_string(&d).unwrap();
        assert!(text.contains("write_timeout: 1s 500ms"), "{text}");
        assert!(text.contains("replay_horizon: 1day"), "{text}");
        let back: ClickHouseDynamicParams = serde_yaml::from_str(&text).unwrap();
        assert_eq!(back, d);
    }

    #[test]
    fn bad_durations_are_reported_with_their_path() {
        let v = violations(
            SinkClass::Batching,
            "{host: h, table: t}",
            "{write_timeout: 5 parsecs}",
        );
        assert_eq!(paths(&v), ["dynamic_parameters.write_timeout"]);
        assert!(
            v[0].message.contains("`5 parsecs` is not a duration"),
            "{}",
            v[0].message
        );
        let v = violations(
            SinkClass::Batching,
            "{host: h, table: t}",
            "{retry_backoff: -5}",
        );
        assert_eq!(paths(&v), ["dynamic_parameters.retry_backoff"]);
        assert!(v[0].message.contains("-5 is negative"), "{}", v[0].message);
    }

    #[test]
    fn unknown_fields_are_rejected_in_both_sections() {
        let v = violations(
            SinkClass::Batching,
            "{host: h, table: t, hots: [a]}",
            "{max_rows: 5}",
        );
        assert_eq!(
            paths(&v),
            ["parameters.hots", "dynamic_parameters.max_rows"]
        );
        assert!(
            v[0].message.contains("unknown field `hots`"),
            "{}",
            v[0].message
        );
        let v = violations(
            SinkClass::AtMostOnce,
            "{host: h, table: t, at_most_once_strategy: {enable: true}}",
            "",
        );
        assert_eq!(paths(&v), ["parameters.at_most_once_strategy.enable"]);
    }

    #[test]
    fn every_unknown_field_of_a_section_is_reported_at_its_own_path() {
        let v = violations(
            SinkClass::Batching,
            "{host: h, tabel: t, databse: d}",
            "{max_rows: 5, max_byte_per_batch: 7}",
        );
        assert_eq!(
            paths(&v),
            [
                "parameters.tabel",
                "parameters.databse",
                "dynamic_parameters.max_rows",
                "dynamic_parameters.max_byte_per_batch"
            ]
        );
        for violation in &v {
            assert!(
                violation.message.starts_with("unknown field `"),
                "{}",
                violation.message
            );
        }
    }

    #[test]
    fn structural_error_in_one_section_still_validates_the_other() {
        let v = violations(
            SinkClass::Batching,
            "{host: h, table: t, port: many}",
            "{max_rows_per_batch: 0}",
        );
        assert_eq!(
            paths(&v),
            ["parameters.port", "dynamic_parameters.max_rows_per_batch"]
        );
    }

    #[test]
    fn missing_host_form_is_a_violation_at_parameters_naming_the_three() {
        let v = single(SinkClass::AtLeastOnce, "{table: t}", "");
        assert_eq!(v.path, "parameters");
        assert_eq!(
            v.message,
            "no ClickHouse host is configured: set exactly one of `host`, `hosts` or \
             `shard_hosts` (exactly one of `host`, `hosts`, `shard_hosts` must be set)"
        );
        let v = single(SinkClass::ShardedBatching, "{table: t}", "");
        assert_eq!(v.path, "parameters");
        assert!(v.message.contains("set `shard_hosts`"), "{}", v.message);
    }

    #[test]
    fn several_host_forms_name_the_ones_set() {
        let v = single(
            SinkClass::AtLeastOnce,
            "{host: h, hosts: [a, b], shard_hosts: {s: [c]}, table: t}",
            "",
        );
        assert_eq!(v.path, "parameters");
        assert_eq!(
            v.message,
            "`host` and `hosts` and `shard_hosts` are all set, but exactly one of `host`, \
             `hosts`, `shard_hosts` must be; keep one and remove the others"
        );
        let v = single(
            SinkClass::AtMostOnce,
            "{host: h, hosts: [a, b], table: t}",
            "",
        );
        assert!(
            v.message.starts_with("`host` and `hosts` are all set"),
            "{}",
            v.message
        );
    }

    #[test]
    fn max_tables_defaults_to_100_is_bounded_and_needs_a_template() {
        let template = "{host: h, table: 'e_{kind}'";
        assert_eq!(
            resolved(SinkClass::Batching, &format!("{template}}}")).max_tables,
            DEFAULT_MAX_TABLES
        );
        assert_eq!(
            resolved(SinkClass::Batching, &format!("{template}, max_tables: 3}}")).max_tables,
            3
        );
        for bad in [0, 10_001] {
            let v = single(
                SinkClass::Batching,
                &format!("{template}, max_tables: {bad}}}"),
                "",
            );
            assert_eq!(v.path, "parameters.max_tables");
            assert_eq!(
                v.message,
                format!("{bad} is outside 1..=10000: every table keeps a writer session whose columns are re-read every schema_refresh_interval_ms")
            );
        }
        let v = single(
            SinkClass::Batching,
            "{host: h, table: t, max_tables: 5}",
            "",
        );
        assert_eq!(v.path, "parameters.max_tables");
        assert_eq!(
            v.message,
            "max_tables applies to a table template (`table: \"events_{event_type}\"`); remove it, or make `table` a template"
        );
    }

    #[test]
    fn a_table_template_is_refused_only_with_the_at_most_once_queue_and_missing_table_needs_a_template(
    ) {
        let p = resolved(
            SinkClass::ShardedBatching,
            "{shard_hosts: {a: [h]}, table: 'events_{kind}', missing_table: wait}",
        );
        assert_eq!(p.missing_table, MissingTable::Wait);
        assert_eq!(
            p.table_template.map(|t| t.text),
            Some("events_{kind}".to_owned())
        );
        assert_eq!(
            resolved(SinkClass::Batching, "{host: h, table: 'e_{kind}'}").missing_table,
            MissingTable::DeadLetter
        );
        for class in [SinkClass::AtLeastOnce, SinkClass::AtMostOnce] {
            let p = resolved(class, "{host: h, table: 'e_{kind}', missing_table: wait}");
            assert_eq!(p.missing_table, MissingTable::Wait);
            assert_eq!(
                p.table_template.map(|t| t.text),
                Some("e_{kind}".to_owned())
            );
        }
        let v = single(
            SinkClass::AtMostOnce,
            "{host: h, table: 'e_{kind}', at_most_once_strategy: {enabled: true}}",
            "",
        );
        assert_eq!(v.path, "parameters.at_most_once_strategy.enabled");
        assert_eq!(
            v.message,
            "the at-most-once queue holds the rows of one table (one buffer per shard, encoded for that table's columns); a table template (`e_{kind}`) needs the ordered mode (`enabled: false`), or one sink per table with a filter before each"
        );
        let v = single(SinkClass::Batching, "{host: h, table: 'e_{kind'}", "");
        assert_eq!(v.path, "parameters.table");
        assert!(
            v.message
                .starts_with("table template `e_{kind`: the `{` at character 3 is not closed"),
            "{}",
            v.message
        );
        let v = single(
            SinkClass::Batching,
            "{host: h, table: t, missing_table: dead_letter}",
            "",
        );
        assert_eq!(v.path, "parameters.missing_table");
        assert_eq!(
            v.message,
            "missing_table applies to a table template (`table: \"events_{event_type}\"`); remove it, or make `table` a template"
        );
    }

    #[test]
    fn a_tables_map_is_instead_of_table_names_tables_and_is_refused_only_with_the_at_most_once_queue(
    ) {
        let p = resolved(
            SinkClass::ShardedBatching,
            "{shard_hosts: {a: [h]}, tables: {orders.created: created}, max_tables: 5, missing_table: wait}",
        );
        assert_eq!(
            p.tables.into_iter().collect::<Vec<_>>(),
            [("orders.created".to_owned(), "created".to_owned())]
        );
        assert_eq!((p.max_tables, p.table_template), (5, None));
        let v = violations(
            SinkClass::Batching,
            "{host: h, table: t, tables: {a.b: 'x-y', c: ok}}",
            "",
        );
        let found: Vec<(&str, &str)> = v
            .iter()
            .map(|v| (v.path.as_str(), v.message.as_str()))
            .collect();
        assert_eq!(
            found,
            [
                ("parameters.tables", "parameters.table (`t`) and parameters.tables both name the target tables; keep one: `table` for one table or a template, `tables` for a table per broker subject"),
                ("parameters.tables.a.b", "table name `x-y` may only contain letters, digits and `_`; give the bare table name (the database goes to `database`)"),
            ]
        );
        for class in [SinkClass::AtLeastOnce, SinkClass::AtMostOnce] {
            let p = resolved(class, "{host: h, tables: {a: b}}");
            assert_eq!(p.tables.len(), 1);
        }
        let v = single(
            SinkClass::AtMostOnce,
            "{host: h, tables: {a: b}, at_most_once_strategy: {enabled: true}}",
            "",
        );
        assert_eq!(v.path, "parameters.at_most_once_strategy.enabled");
        assert_eq!(
            v.message,
            "the at-most-once queue holds the rows of one table (one buffer per shard, encoded for that table's columns); a `tables` map needs the ordered mode (`enabled: false`), or one sink per table with a filter before each"
        );
    }

    #[test]
    fn single_entry_hosts_is_rejected_use_host() {
        let v = single(SinkClass::Batching, "{hosts: [ch1], table: t}", "");
        assert_eq!(v.path, "parameters.hosts");
        assert_eq!(
            v.message,
            "a single-entry `hosts` list is not allowed: use `host: ch1` instead"
        );
    }

    #[test]
    fn empty_host_entries_are_rejected_with_their_index() {
        let v = violations(SinkClass::AtLeastOnce, "{hosts: [a, '', b], table: t}", "");
        assert_eq!(paths(&v), ["parameters.hosts[1]"]);
        assert!(
            v[0].message.starts_with("the host is empty"),
            "{}",
            v[0].message
        );
        let v = violations(
            SinkClass::ShardedBatching,
            "{shard_hosts: {a: [x, ''], b: [y]}, table: t}",
            "",
        );
        assert_eq!(paths(&v), ["parameters.shard_hosts.a[1]"]);
    }

    #[test]
    fn duplicate_endpoints_are_rejected_within_hosts_and_across_shards() {
        let v = single(SinkClass::Batching, "{hosts: [a, b, A], table: t}", "");
        assert_eq!(v.path, "parameters.hosts[2]");
        assert_eq!(
            v.message,
            "`A` is endpoint A:8123, which is already listed at parameters.hosts[0]; every \
             endpoint may appear only once across all hosts and shards, remove the duplicate"
        );
        // The same endpoint with the default port spelled out.
        let v = single(SinkClass::Batching, "{hosts: [a, 'a:8123'], table: t}", "");
        assert_eq!(v.path, "parameters.hosts[1]");
        // Different ports are different endpoints.
        ok(SinkClass::Batching, "{hosts: ['a:1', 'a:2'], table: t}");
        let v = single(
            SinkClass::ShardedBatching,
            "{shard_hosts: {a: [x, y], b: [z, 'y:8123']}, table: t}",
            "",
        );
        assert_eq!(v.path, "parameters.shard_hosts.b[1]");
        assert!(v
            .message
            .contains("already listed at parameters.shard_hosts.a[1]"));
    }

    #[test]
    fn shard_names_and_lists_are_checked() {
        let v = violations(
            SinkClass::ShardedBatching,
            "{shard_hosts: {'a b': [x], ok-1_: [y], c: [], '': [z]}, table: t}",
            "",
        );
        assert_eq!(
            paths(&v),
            [
                "parameters.shard_hosts",
                "parameters.shard_hosts.a b",
                "parameters.shard_hosts.c",
            ]
        );
        assert!(
            v[0].message.starts_with("a shard name is empty"),
            "{}",
            v[0].message
        );
        assert!(
            v[1].message
                .starts_with("shard name `a b` may only contain letters, digits, `_` and `-`"),
            "{}",
            v[1].message
        );
        assert_eq!(
            v[2].message,
            "shard `c` has no hosts: list at least one host, or remove the shard"
        );
    }

    #[test]
    fn batching_sink_rejects_shard_hosts() {
        let v = single(SinkClass::Batching, "{shard_hosts: {a: [x]}, table: t}", "");
        assert_eq!(v.path, "parameters.shard_hosts");
        assert!(v
            .message
            .starts_with("ClickHouseBatchingSink writes one unsharded table"));
        ok(SinkClass::Batching, "{host: x, table: t}");
        ok(SinkClass::Batching, "{hosts: [x, y], table: t}");
    }

    #[test]
    fn sharded_sink_requires_shard_hosts() {
        let v = single(SinkClass::ShardedBatching, "{host: x, table: t}", "");
        assert_eq!(v.path, "parameters.host");
        assert!(v
            .message
            .starts_with("ShardedClickHouseBatchingSink requires `shard_hosts`"));
        let v = single(SinkClass::ShardedBatching, "{hosts: [x, y], table: t}", "");
        assert_eq!(v.path, "parameters.hosts");
        ok(
            SinkClass::ShardedBatching,
            "{shard_hosts: {a: [x], b: [y]}, table: t}",
        );
    }

    #[test]
    fn at_least_once_and_at_most_once_accept_every_host_form() {
        for class in [SinkClass::AtLeastOnce, SinkClass::AtMostOnce] {
            ok(class, "{host: x, table: t}");
            ok(class, "{hosts: [x, y], table: t}");
            ok(class, "{shard_hosts: {a: [x]}, table: t}");
        }
    }

    #[test]
    fn sharding_key_columns_need_shard_hosts_and_unique_nonempty_names() {
        let v = single(
            SinkClass::Batching,
            "{host: x, table: t, sharding_key_columns: [user_id]}",
            "",
        );
        assert_eq!(v.path, "parameters.sharding_key_columns");
        assert_eq!(
            v.message,
            "sharding_key_columns only applies to the `shard_hosts` form; remove it, or \
             configure `shard_hosts`"
        );
        let v = violations(
            SinkClass::ShardedBatching,
            "{shard_hosts: {a: [x]}, table: t, sharding_key_columns: [u, '', v, u]}",
            "",
        );
        assert_eq!(
            paths(&v),
            [
                "parameters.sharding_key_columns[1]",
                "parameters.sharding_key_columns[3]"
            ]
        );
        assert_eq!(
            v[1].message,
            "column `u` is already listed at parameters.sharding_key_columns[0]; remove the \
             duplicate"
        );
        let p = ok(
            SinkClass::ShardedBatching,
            "{shard_hosts: {a: [x]}, table: t, sharding_key_columns: [u, v]}",
        );
        assert_eq!(p.sharding_key_columns, ["u", "v"]);
    }

    #[test]
    fn host_entries_may_carry_a_port_including_ipv6() {
        let topology = topology(
            SinkClass::AtLeastOnce,
            "{hosts: ['ch1', 'ch2:18124', '[::1]:9', '[fe80::2]', '::3'], port: 7, table: t}",
        );
        let Topology::Replicas(endpoints) = topology else {
            panic!("{topology:?}");
        };
        let shown: Vec<String> = endpoints.iter().map(|e| e.to_string()).collect();
        assert_eq!(
            shown,
            ["ch1:7", "ch2:18124", "[::1]:9", "[fe80::2]:7", "[::3]:7"]
        );
        assert_eq!(
            endpoints[2],
            Endpoint {
                host: "::1".into(),
                port: 9
            }
        );
    }

    #[test]
    fn bad_host_entries_and_ports_are_rejected() {
        let v = violations(
            SinkClass::AtLeastOnce,
            "{hosts: ['a:0', 'b:70000', 'c:x', 'http://d', 'e f', ':5', '[zz]:1', '[::1]x'], table: t}",
            "",
        );
        assert_eq!(
            paths(&v),
            (0..8)
                .map(|i| format!("parameters.hosts[{i}]"))
                .collect::<Vec<_>>()
        );
        assert_eq!(
            v[0].message,
            "`a:0` has port `0`, which is not a number in 1..=65535; fix the port or drop it to \
             use `port`"
        );
        assert!(v[1].message.contains("port `70000`"));
        assert!(v[2].message.contains("port `x`"));
        assert!(v[3].message.contains("has a URL scheme"));
        assert!(v[4].message.contains("is not a valid host"));
        assert!(v[5].message.contains("has no host before the port"));
        assert!(v[6].message.contains("is not an IPv6 address"));
        assert!(v[7].message.contains("unexpected `x` after `]`"));
        let v = single(SinkClass::Batching, "{host: h, port: 0, table: t}", "");
        assert_eq!(v.path, "parameters.port");
        let v = single(SinkClass::Batching, "{host: 'h:99999', table: t}", "");
        assert_eq!(v.path, "parameters.host");
        assert!(v.message.contains("port `99999`"), "{}", v.message);
    }

    #[test]
    fn tls_options_require_enable_tls_one_violation_each() {
        let v = violations(
            SinkClass::Batching,
            "{host: h, table: t, tls_ca_files: [/ca.pem], tls_ca_directory: /cas, \
             tls_skip_verification: true}",
            "",
        );
        assert_eq!(
            paths(&v),
            [
                "parameters.tls_ca_files",
                "parameters.tls_ca_directory",
                "parameters.tls_skip_verification",
                "parameters.tls_skip_verification",
            ]
        );
        assert_eq!(
            v[0].message,
            "tls_ca_files requires `enable_tls: true`; enable TLS, or remove tls_ca_files"
        );
        ok(
            SinkClass::Batching,
            "{host: h, table: t, enable_tls: true, tls_ca_files: [/ca.pem], tls_ca_directory: /cas}",
        );
        ok(
            SinkClass::Batching,
            "{host: h, table: t, enable_tls: true, tls_skip_verification: true}",
        );
    }

    #[test]
    fn tls_skip_verification_with_ca_files_is_contradictory() {
        let v = single(
            SinkClass::Batching,
            "{host: h, table: t, enable_tls: true, tls_ca_files: [/ca.pem], \
             tls_skip_verification: true}",
            "",
        );
        assert_eq!(v.path, "parameters.tls_skip_verification");
        assert!(v
            .message
            .starts_with("tls_skip_verification contradicts tls_ca_files"));
        let v = single(
            SinkClass::Batching,
            "{host: h, table: t, enable_tls: true, tls_ca_files: ['']}",
            "",
        );
        assert_eq!(v.path, "parameters.tls_ca_files[0]");
    }

    #[test]
    fn table_is_required_and_names_are_identifiers() {
        let v = single(SinkClass::Batching, "{host: h}", "");
        assert_eq!(v.path, "parameters.table");
        assert_eq!(
            v.message,
            "the target table is required: set `table` to its name (letters, digits, `_`)"
        );
        let v = violations(
            SinkClass::Batching,
            "{host: h, table: 'db.t', database: '', user: ''}",
            "",
        );
        assert_eq!(
            paths(&v),
            ["parameters.table", "parameters.database", "parameters.user"]
        );
        assert!(v[0]
            .message
            .starts_with("table name `db.t` may only contain"));
        let v = single(
            SinkClass::Batching,
            "{host: h, table: t, database: 'my-db'}",
            "",
        );
        assert_eq!(v.path, "parameters.database");
        ok(
            SinkClass::Batching,
            "{host: h, table: Events_2, database: analytics}",
        );
    }

    #[test]
    fn password_env_var_must_be_a_variable_name() {
        for bad in ["1ABC", "MY-PASS", "hunter2!"] {
            let v = single(
                SinkClass::Batching,
                &format!("{{host: h, table: t, password_env_var: '{bad}'}}"),
                "",
            );
            assert_eq!(v.path, "parameters.password_env_var");
        }
        ok(
            SinkClass::Batching,
            "{host: h, table: t, password_env_var: CH_PASSWORD_2}",
        );
    }

    #[test]
    fn empty_optional_texts_read_as_unset() {
        let p = ok(
            SinkClass::Batching,
            "{host: '', hosts: [a1, a2], table: t, password_env_var: '', tls_ca_directory: ''}",
        );
        assert_eq!(
            (p.host, p.password_env_var, p.tls_ca_directory),
            (None, None, None)
        );
        let p = ok(
            SinkClass::Batching,
            "{host: h, table: t, password_env_var: CH_PASS, enable_tls: true, tls_ca_directory: /cas}",
        );
        assert_eq!(p.host.as_deref(), Some("h"));
        assert_eq!(p.password_env_var.as_deref(), Some("CH_PASS"));
        assert_eq!(p.tls_ca_directory, Some(PathBuf::from("/cas")));
    }

    #[test]
    fn password_is_read_from_the_named_variable() {
        let mut p = Credentials {
            user: "default".to_owned(),
            password_env_var: None,
            password_file: None,
        };
        assert_eq!(p.password().unwrap(), None);
        p.password_env_var = Some("FLOW_CLICKHOUSE_PARAMS_TEST_SURELY_UNSET_VAR".into());
        let err = p.password().unwrap_err();
        assert_eq!(
            err.to_string(),
            "the environment variable `FLOW_CLICKHOUSE_PARAMS_TEST_SURELY_UNSET_VAR` named by \
             parameters.password_env_var is not set; export it with the ClickHouse password, or \
             set password_env_var to \"\" to connect without a password"
        );
        assert!(
            matches!(&err, PasswordError::Env(e) if e.source == std::env::VarError::NotPresent),
            "{err:?}"
        );
        // PATH is set in every test environment.
        p.password_env_var = Some("PATH".into());
        assert_eq!(p.password().unwrap(), std::env::var("PATH").ok());
    }

    #[test]
    fn at_most_once_strategy_only_for_at_most_once_sink() {
        let (p, resolved, d) = parse_spec(
            SinkClass::AtMostOnce,
            &yaml("{host: h, table: t, at_most_once_strategy: {enabled: true}}"),
            &yaml("{at_most_once_strategy: {total_queue_bytes_limit: 1024}}"),
        )
        .unwrap();
        assert_eq!(
            p.at_most_once_strategy,
            Some(AtMostOnceStrategy { enabled: true })
        );
        assert!(resolved.at_most_once_queue);
        assert_eq!(
            d.at_most_once_strategy,
            Some(AtMostOnceDynamic {
                total_queue_bytes_limit: 1024
            })
        );
        let d = parse(
            SinkClass::AtMostOnce,
            &yaml("{host: h, table: t}"),
            &yaml("{at_most_once_strategy: {}}"),
        )
        .unwrap()
        .1;
        assert_eq!(d.at_most_once_strategy, Some(AtMostOnceDynamic::default()));
        for class in [
            SinkClass::Batching,
            SinkClass::ShardedBatching,
            SinkClass::AtLeastOnce,
        ] {
            let hosts = host_form(class);
            let v = violations(
                class,
                &format!("{{{hosts}, table: t, at_most_once_strategy: {{enabled: false}}}}"),
                "{at_most_once_strategy: {total_queue_bytes_limit: 5}}",
            );
            assert_eq!(
                paths(&v),
                [
                    "parameters.at_most_once_strategy",
                    "dynamic_parameters.at_most_once_strategy"
                ]
            );
            assert_eq!(
                v[0].message,
                format!(
                    "{class} does not support at_most_once_strategy; remove it, or use \
                     AtMostOnceClickHouseSink"
                )
            );
        }
        let v = single(
            SinkClass::AtMostOnce,
            "{host: h, table: t}",
            "{at_most_once_strategy: {total_queue_bytes_limit: 0}}",
        );
        assert_eq!(
            v.path,
            "dynamic_parameters.at_most_once_strategy.total_queue_bytes_limit"
        );
    }

    #[test]
    fn async_insert_is_accepted_statically() {
        assert!(ok_dynamic("{async_insert: true}").async_insert);
    }

    #[test]
    fn dynamic_ranges_are_enforced_at_both_ends() {
        let host = "{host: h, table: t}";
        for (dynamic, path, message) in [
            (
                "{write_timeout: 0}",
                "dynamic_parameters.write_timeout",
                "0s is out of range (1ms..=1h); set a duration in that range",
            ),
            (
                "{write_timeout: 61m}",
                "dynamic_parameters.write_timeout",
                "1h 1m is out of range (1ms..=1h); set a duration in that range",
            ),
            (
                "{retry_backoff: 11m}",
                "dynamic_parameters.retry_backoff",
                "11m is out of range (0s..=10m); set a duration in that range",
            ),
            (
                "{max_retry_backoff: 61m}",
                "dynamic_parameters.max_retry_backoff",
                "1h 1m is out of range (0s..=1h); set a duration in that range",
            ),
            (
                "{retry_backoff: 10s, max_retry_backoff: 5s}",
                "dynamic_parameters.max_retry_backoff",
                "5s is below retry_backoff (10s): the pause grows from retry_backoff up to max_retry_backoff; raise max_retry_backoff or lower retry_backoff",
            ),
            (
                "{replay_horizon: 999ms}",
                "dynamic_parameters.replay_horizon",
                "999ms is out of range (at least 1s); set a duration in that range",
            ),
            (
                "{max_insert_attempts: 0}",
                "dynamic_parameters.max_insert_attempts",
                "0 is out of range (1..=1000); set a value in that range",
            ),
            (
                "{max_insert_attempts: 1001}",
                "dynamic_parameters.max_insert_attempts",
                "1001 is out of range (1..=1000); set a value in that range",
            ),
            (
                "{max_rows_per_batch: 0}",
                "dynamic_parameters.max_rows_per_batch",
                "0 is out of range (1..=1000000); set a value in that range",
            ),
            (
                "{max_rows_per_batch: 1000001}",
                "dynamic_parameters.max_rows_per_batch",
                "1000001 is out of range (1..=1000000); set a value in that range",
            ),
            (
                "{max_bytes_per_batch: 0}",
                "dynamic_parameters.max_bytes_per_batch",
                "0 is out of range (1..=268435456); set a value in that range",
            ),
            (
                "{max_bytes_per_batch: 268435457}",
                "dynamic_parameters.max_bytes_per_batch",
                "268435457 is out of range (1..=268435456); set a value in that range",
            ),
        ] {
            let v = single(SinkClass::Batching, host, dynamic);
            assert_eq!(
                (v.path.as_str(), v.message.as_str()),
                (path, message),
                "{dynamic}"
            );
        }
        // The extended upper bounds and the lower bounds themselves are accepted.
        let d = ok_dynamic(
            "{write_timeout: 1ms, retry_backoff: 10m, max_insert_attempts: 1000, \
             replay_horizon: 1s, max_rows_per_batch: 1000000, max_bytes_per_batch: 268435456}",
        );
        assert_eq!(d.max_rows_per_batch, MAX_ROWS_PER_BATCH);
        ok_dynamic("{write_timeout: 1h, retry_backoff: 0s, max_insert_attempts: 1, max_rows_per_batch: 1, max_bytes_per_batch: 1}");
    }

    #[test]
    fn token_namespace_is_checked_and_defaults_to_pipeline_sink_and_outbox() {
        let p = resolved(SinkClass::Batching, "{host: h, table: t}");
        let (a, b) = (Some(OutboxId(0xa1)), Some(OutboxId(0xb2)));
        // Two state directories of one pipeline name: two namespaces.
        assert_eq!(
            p.token_prefix("quickstart", "events", a),
            "quickstart.events.00000000000000a1/"
        );
        assert_eq!(
            p.token_prefix("quickstart", "events", b),
            "quickstart.events.00000000000000b2/"
        );
        // A store without an identity (created before them) keeps the old default.
        assert_eq!(
            p.token_prefix("quickstart", "events", None),
            "quickstart.events/"
        );
        let p = resolved(
            SinkClass::Batching,
            "{host: h, table: t, token_namespace: 'team-a/v2.'}",
        );
        for outbox in [a, b, None] {
            assert_eq!(p.token_prefix("quickstart", "events", outbox), "team-a/v2.");
        }
        let v = single(
            SinkClass::Batching,
            "{host: h, table: t, token_namespace: 'a:b'}",
            "",
        );
        assert_eq!(v.path, "parameters.token_namespace");
    }

    #[test]
    fn shards_are_sorted_by_name_and_get_the_shared_port() {
        let parameters = "{shard_hosts: {b: [b1, 'b2:9'], a: [a1]}, port: 18123, table: t}";
        assert!(ok(SinkClass::ShardedBatching, parameters).is_sharded());
        assert_eq!(
            topology(SinkClass::ShardedBatching, parameters),
            Topology::Shards(vec![
                Shard {
                    name: "a".into(),
                    replicas: vec![Endpoint {
                        host: "a1".into(),
                        port: 18123
                    }],
                },
                Shard {
                    name: "b".into(),
                    replicas: vec![
                        Endpoint {
                            host: "b1".into(),
                            port: 18123
                        },
                        Endpoint {
                            host: "b2".into(),
                            port: 9
                        },
                    ],
                },
            ])
        );
        let parameters = "{host: 'ch:18124', table: t}";
        assert!(!ok(SinkClass::Batching, parameters).is_sharded());
        assert_eq!(
            topology(SinkClass::Batching, parameters),
            Topology::SingleHost(Endpoint {
                host: "ch".into(),
                port: 18124
            })
        );
    }

    #[test]
    fn contract_example_spec_is_valid() {
        let p = topology(
            SinkClass::ShardedBatching,
            r#"
shard_hosts: { a: ["127.0.0.1:18123", "127.0.0.1:18124"], b: ["127.0.0.1:18125", "127.0.0.1:18126"] }
database: default
table: events
sharding_key_columns: [user_id]
"#,
        );
        let shards = p.shards();
        assert_eq!(shards.len(), 2);
        assert_eq!(shards[1].1[1].to_string(), "127.0.0.1:18126");
    }

    #[test]
    fn a_spec_with_many_mistakes_reports_all_of_them() {
        let v = violations(
            SinkClass::Batching,
            r#"
host: h
hosts: [x]
shard_hosts: {"bad name": [], ok: ["", "y:0"]}
sharding_key_columns: [u, u]
port: 0
database: "a.b"
user: ""
password_env_var: "not a var"
tls_ca_directory: /cas
token_namespace: "sp ace"
at_most_once_strategy: {enabled: true}
"#,
            "{write_timeout: 2h, max_rows_per_batch: 0, max_insert_attempts: 0, \
             at_most_once_strategy: {total_queue_bytes_limit: 0}}",
        );
        assert_eq!(
            paths(&v),
            [
                "parameters",
                "parameters.hosts",
                "parameters.shard_hosts",
                "parameters.port",
                "parameters.shard_hosts.bad name",
                "parameters.shard_hosts.bad name",
                "parameters.shard_hosts.ok[0]",
                "parameters.shard_hosts.ok[1]",
                "parameters.sharding_key_columns[1]",
                "parameters.table",
                "parameters.database",
                "parameters.user",
                "parameters.password_env_var",
                "parameters.tls_ca_directory",
                "parameters.token_namespace",
                "parameters.at_most_once_strategy",
                "dynamic_parameters.write_timeout",
                "dynamic_parameters.max_insert_attempts",
                "dynamic_parameters.max_rows_per_batch",
                "dynamic_parameters.at_most_once_strategy.total_queue_bytes_limit",
                "dynamic_parameters.at_most_once_strategy",
            ]
        );
    }

    #[test]
    fn null_sections_mean_defaults_and_non_mappings_are_rejected() {
        let v = violations(SinkClass::Batching, "[a, b]", "5");
        assert_eq!(paths(&v), ["parameters", "dynamic_parameters"]);
    }

    #[test]
    fn message_id_column_is_read_for_exactly_once_and_refused_elsewhere() {
        let (params, _) = parse(
            SinkClass::Batching,
            &yaml("{host: h, table: t, message_id_column: id}"),
            &yaml("{}"),
        )
        .unwrap();
        assert_eq!(params.message_id_column.as_deref(), Some("id"));
        let v = parse(
            SinkClass::AtMostOnce,
            &yaml("{host: h, table: t, message_id_column: id}"),
            &yaml("{}"),
        )
        .unwrap_err();
        assert_eq!(v.len(), 1, "{v:?}");
        assert_eq!(v[0].path, "parameters.message_id_column");
        assert_eq!(
            v[0].message,
            "AtMostOnceClickHouseSink keeps no pending parts to check against the table, so it \
             has no use for message_id_column; remove it, or use an exactly-once class"
        );
    }

    #[test]
    fn on_expired_backlog_outside_exactly_once_is_one_sentence() {
        let v = parse(
            SinkClass::AtLeastOnce,
            &yaml("{host: h, table: t, on_expired_backlog: send}"),
            &yaml("{}"),
        )
        .unwrap_err();
        assert_eq!(v.len(), 1, "{v:?}");
        assert_eq!(v[0].path, "parameters.on_expired_backlog");
        assert_eq!(
            v[0].message,
            "AtLeastOnceClickHouseSink keeps no backlog of sent batches, so it has nothing to \
             expire; remove on_expired_backlog, or use an exactly-once class"
        );
    }

    #[test]
    fn auto_add_columns_is_refused_for_the_exactly_once_classes_with_why() {
        for class in [SinkClass::Batching, SinkClass::ShardedBatching] {
            let hosts = if class == SinkClass::Batching {
                "host: h"
            } else {
                "shard_hosts: {a: [h]}"
            };
            let v = parse(
                class,
                &yaml(&format!("{{{hosts}, table: t, auto_add_columns: true}}")),
                &yaml("{}"),
            )
            .unwrap_err();
            assert_eq!(v.len(), 1, "{v:?}");
            assert_eq!(v[0].path, "parameters.auto_add_columns");
            assert!(
                v[0].message.ends_with(
                    "cannot add columns to its table: a column added for a stream field joins \
                     the INSERT's column list, so the batches already sealed (pending in the \
                     outbox, or rebuilt from the source) could not be delivered as sealed, and \
                     on a server without insert_deduplication_token a part stored before the \
                     ADD COLUMN would not be recognised as a replay. Remove auto_add_columns and \
                     add the column by hand (`ALTER TABLE ... ADD COLUMN` on every shard) while \
                     the sink is drained, or use AtLeastOnceClickHouseSink"
                ),
                "{}",
                v[0].message
            );
        }
        for class in [SinkClass::AtLeastOnce, SinkClass::AtMostOnce] {
            let (params, _) = parse(
                class,
                &yaml("{host: h, table: t, auto_add_columns: true}"),
                &yaml("{}"),
            )
            .unwrap();
            assert!(params.auto_add_columns);
        }
    }

    #[test]
    fn schema_refresh_interval_is_bounded() {
        let v = parse(
            SinkClass::AtLeastOnce,
            &yaml("{host: h, table: t, schema_refresh_interval_ms: 99}"),
            &yaml("{}"),
        )
        .unwrap_err();
        assert_eq!(v[0].path, "parameters.schema_refresh_interval_ms");
        assert_eq!(
            v[0].message,
            "99 is outside 100..=86400000 (ms); set a value in range, or remove it for the default 10000"
        );
        let (params, _) = parse(
            SinkClass::AtLeastOnce,
            &yaml("{host: h, table: t}"),
            &yaml("{}"),
        )
        .unwrap();
        assert_eq!(
            params.schema_refresh_interval,
            std::time::Duration::from_secs(10)
        );
    }

    /// `settings` reach the resolved parameters as ClickHouse text (true is 1), in name order;
    /// a bad name, a setting flow owns, an HTTP parameter and a non-scalar are each refused at
    /// their path with the reason.
    #[test]
    fn settings_are_resolved_as_text_and_owned_ones_are_refused_with_why() {
        let params = resolved(
            SinkClass::ShardedBatching,
            "{shard_hosts: {a: [h1, h2]}, table: t, settings: \
             {max_insert_block_size: 1000, insert_quorum: 2, fsync_after_insert: true, \
              insert_quorum_timeout: '60000'}}",
        );
        assert_eq!(
            params.settings,
            vec![
                ("fsync_after_insert".to_owned(), "1".to_owned()),
                ("insert_quorum".to_owned(), "2".to_owned()),
                ("insert_quorum_timeout".to_owned(), "60000".to_owned()),
                ("max_insert_block_size".to_owned(), "1000".to_owned()),
            ]
        );
        for class in SinkClass::ALL {
            let hosts = host_form(class);
            let v = violations(
                class,
                &format!(
                    "{{{hosts}, table: t, settings: {{insert_deduplicate: 0, \
                 insert_deduplication_token: x, async_insert: 1, async_insert_busy_timeout_ms: 5, \
                 wait_for_async_insert: 0, decompress: 0, compress: 1, \
                 input_format_binary_read_json_as_string: 1, database: other, '1bad': 1, \
                 'max-threads': 2}}}}"
                ),
                "",
            );
            let mut found: Vec<(&str, &str)> = v
                .iter()
                .map(|v| (v.path.as_str(), v.message.as_str()))
                .filter(|(path, _)| path.starts_with("parameters.settings."))
                .collect();
            found.sort();
            let expect = [
                ("1bad", "`1bad` is not a ClickHouse setting name (letters, digits and `_`, not starting with a digit); fix the name"),
                ("async_insert", "flow sets `async_insert` itself (it is flow's dynamic parameter `async_insert`"),
                ("async_insert_busy_timeout_ms", "flow sets `async_insert_busy_timeout_ms` itself (the async insert knobs follow"),
                ("compress", "flow sets `compress` itself (flow reads the server's answers uncompressed); remove it from `settings`"),
                ("database", "`database` is a parameter of ClickHouse's HTTP interface, not a setting"),
                ("decompress", "flow sets `decompress` itself (flow sets it from `codec`"),
                ("input_format_binary_read_json_as_string", "flow sets `input_format_binary_read_json_as_string` itself (it changes how the server reads the RowBinary"),
                ("insert_deduplicate", "flow sets `insert_deduplicate` itself (flow turns deduplication on"),
                ("insert_deduplication_token", "flow sets `insert_deduplication_token` itself (flow sends each batch's own token"),
                ("max-threads", "`max-threads` is not a ClickHouse setting name"),
                ("wait_for_async_insert", "flow sets `wait_for_async_insert` itself (flow waits for every async insert"),
            ];
            assert_eq!(found.len(), expect.len(), "{class}: {found:#?}");
            for ((path, message), (name, start)) in found.iter().zip(expect) {
                assert_eq!(*path, format!("parameters.settings.{name}"), "{class}");
                assert!(message.starts_with(start), "{class}: {message}");
            }
            assert_eq!(v.len(), expect.len(), "{class}: {v:#?}");
        }
        let v = violations(
            SinkClass::AtLeastOnce,
            "{host: h, table: t, settings: {max_threads: [1, 2]}}",
            "",
        );
        assert_eq!(paths(&v), ["parameters.settings.max_threads"]);
        assert!(
            v[0].message.contains(
                "expected a scalar ClickHouse setting value (a number, a text or true/false)"
            ),
            "{}",
            v[0].message
        );
    }

    /// `password_file` is read when the clients are built, without its one trailing line break;
    /// an unreadable file names the file and never a password; it excludes `password_env_var`.
    #[test]
    fn password_is_read_from_the_file_without_its_line_break() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("pw");
        let p = |path: &std::path::Path| Credentials {
            user: "default".to_owned(),
            password_env_var: None,
            password_file: Some(path.to_path_buf()),
        };
        for (text, password) in [
            ("s3cr3t\n", "s3cr3t"),
            ("s3cr3t\r\n", "s3cr3t"),
            ("s 3", "s 3"),
        ] {
            std::fs::write(&file, text).unwrap();
            assert_eq!(p(&file).password().unwrap().as_deref(), Some(password));
        }
        // Issue 46 item 15: an empty file sent no password (the server's REQUIRED_PASSWORD was
        // all one saw), a second line break failed as "failed to parse header value".
        let named = |what: &str| {
            format!(
                "the password file `{}` named by parameters.password_file {what}",
                file.display()
            )
        };
        for (text, what) in [
            ("", "is empty"),
            ("\n", "is empty"),
            ("s3cr3t\n\n", "holds a line break"),
            (
                "s3\tcr3t",
                "holds a line break or another control character",
            ),
        ] {
            std::fs::write(&file, text).unwrap();
            let err = p(&file).password().unwrap_err().to_string();
            assert!(err.starts_with(&named(what)), "{text:?}: {err}");
            assert!(!err.contains("s3cr3t"), "{err}");
        }
        let missing = dir.path().join("absent");
        let err = p(&missing).password().unwrap_err();
        assert_eq!(
            err.to_string(),
            format!(
                "cannot read the password file `{}` named by parameters.password_file; make it \
                 readable by the worker, or fix the path",
                missing.display()
            )
        );
        let resolved = resolved(
            SinkClass::AtLeastOnce,
            "{host: h, table: t, password_file: /run/secrets/ch}",
        );
        assert_eq!(
            resolved.credentials.password_file,
            Some(PathBuf::from("/run/secrets/ch"))
        );
        let v = violations(
            SinkClass::AtLeastOnce,
            "{host: h, table: t, password_file: /run/secrets/ch, password_env_var: CH_PASSWORD}",
            "",
        );
        assert_eq!(paths(&v), ["parameters.password_file"]);
        assert_eq!(
            v[0].message,
            "password_file and password_env_var both name where the password is; keep one of them"
        );
    }
}
