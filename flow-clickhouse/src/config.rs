//! Typed configuration of the ClickHouse sinks: [`ClickHouseSink`] sets every static and dynamic
//! parameter in code and [`build`](ClickHouseSink::build)s a [`ClickHouseSinkConfig`], checked
//! by the registry's own parsing and validation (`params::parse`) of the serialized sections, so
//! a mistake is the violation, with the same path and message, that the same mistake in YAML
//! gives. What depends on the pipeline (one input stream, the sharding key columns being
//! columns of it) is checked by [`Registry::build`](flow_core::Registry::build).
//!
//! ```
//! use flow_clickhouse::ClickHouseSink;
//!
//! let sink = ClickHouseSink::sharded_exactly_once()
//!     .shard("a", ["127.0.0.1:18123", "127.0.0.1:18124"])
//!     .shard("b", ["127.0.0.1:18125", "127.0.0.1:18126"])
//!     .database("default")
//!     .table("events")
//!     .sharding_key_columns(["user_id"])
//!     .max_rows_per_batch(50_000)
//!     .build()?;
//! assert_eq!(sink.dynamic_params().max_rows_per_batch, 50_000);
//!
//! let err = ClickHouseSink::exactly_once().hosts(["127.0.0.1:18123"]).table("events").build();
//! assert_eq!(err.unwrap_err().violations[0].path, "parameters.hosts");
//! # Ok::<(), flow_core::ConfigError>(())
//! ```

use std::path::PathBuf;
use std::time::Duration;

use flow_core::{to_section, ConfigError, SinkConfig};

use crate::params::{
    self, AtMostOnceDynamic, AtMostOnceStrategy, ClickHouseDynamicParams, ClickHouseParams,
    Codec, HostSelectionPolicy, OnBadRows, OnExpiredBacklog, SinkClass,
};

/// Builds the configuration of a ClickHouse sink of one class; unset parameters keep the
/// defaults of the YAML path. [`build`](Self::build) checks it.
#[derive(Clone, Debug, PartialEq, Eq)]
#[must_use]
pub struct ClickHouseSink {
    class: SinkClass,
    parameters: ClickHouseParams,
    dynamic_parameters: ClickHouseDynamicParams,
}

impl ClickHouseSink {
    /// A sink of `class` with default parameters (no host or table yet).
    pub fn new(class: SinkClass) -> Self {
        ClickHouseSink::from_params(
            class,
            ClickHouseParams::default(),
            ClickHouseDynamicParams::default(),
        )
    }

    /// A sink of `class` with the given sections.
    pub fn from_params(
        class: SinkClass,
        parameters: ClickHouseParams,
        dynamic_parameters: ClickHouseDynamicParams,
    ) -> Self {
        ClickHouseSink {
            class,
            parameters,
            dynamic_parameters,
        }
    }

    /// `ClickHouseBatchingSink`: exactly once into one unsharded table ([`host`](Self::host) or
    /// [`hosts`](Self::hosts)).
    pub fn exactly_once() -> Self {
        ClickHouseSink::new(SinkClass::Batching)
    }

    /// `ShardedClickHouseBatchingSink`: exactly once into the shards set by
    /// [`shard`](Self::shard).
    pub fn sharded_exactly_once() -> Self {
        ClickHouseSink::new(SinkClass::ShardedBatching)
    }

    /// `AtLeastOnceClickHouseSink`.
    pub fn at_least_once() -> Self {
        ClickHouseSink::new(SinkClass::AtLeastOnce)
    }

    /// `AtMostOnceClickHouseSink`.
    pub fn at_most_once() -> Self {
        ClickHouseSink::new(SinkClass::AtMostOnce)
    }

    /// The class being configured.
    pub fn class(&self) -> SinkClass {
        self.class
    }

    /// Checks the configuration as the registry does and returns it, or every violation with
    /// its path (`parameters.shard_hosts.a`, `dynamic_parameters.max_rows_per_batch`).
    pub fn build(self) -> Result<ClickHouseSinkConfig, ConfigError> {
        // Through the serialized sections, as the registry reads them: `host: ""` is unset
        // there, and must be here.
        let parameters = to_section(&self.parameters);
        let dynamic = to_section(&self.dynamic_parameters);
        match params::parse(self.class, &parameters, &dynamic) {
            Ok((parameters, dynamic_parameters)) => Ok(ClickHouseSinkConfig {
                class: self.class,
                parameters: parameters.spec,
                dynamic_parameters,
            }),
            Err(violations) => Err(ConfigError {
                class: self.class.class_name().to_owned(),
                violations,
            }),
        }
    }

    // Static parameters.

    /// `host`: the single host of the unsharded form (`host` or `host:port`).
    pub fn host(mut self, host: impl Into<String>) -> Self {
        self.parameters.host = Some(host.into());
        self
    }

    /// `hosts`: the replicas of one unsharded table (at least two).
    pub fn hosts<I>(mut self, hosts: I) -> Self
    where
        I: IntoIterator,
        I::Item: Into<String>,
    {
        self.parameters.hosts = hosts.into_iter().map(Into::into).collect();
        self
    }

    /// Adds shard `name` of `shard_hosts` with its hosts (replacing a shard of that name).
    pub fn shard<I>(mut self, name: impl Into<String>, hosts: I) -> Self
    where
        I: IntoIterator,
        I::Item: Into<String>,
    {
        let hosts = hosts.into_iter().map(Into::into).collect();
        self.parameters.shard_hosts.insert(name.into(), hosts);
        self
    }

    /// `port`: the HTTP port of every host entry that carries none.
    pub fn port(mut self, port: u16) -> Self {
        self.parameters.port = port;
        self
    }

    /// `host_selection_policy`: the order of endpoints within a shard.
    pub fn host_selection_policy(mut self, policy: HostSelectionPolicy) -> Self {
        self.parameters.host_selection_policy = policy;
        self
    }

    /// `sharding_key_columns`: the columns whose values route a row to its shard.
    pub fn sharding_key_columns<I>(mut self, columns: I) -> Self
    where
        I: IntoIterator,
        I::Item: Into<String>,
    {
        self.parameters.sharding_key_columns = columns.into_iter().map(Into::into).collect();
        self
    }

    /// `user`: the ClickHouse user.
    pub fn user(mut self, user: impl Into<String>) -> Self {
        self.parameters.user = user.into();
        self
    }

    /// `password_env_var`: the environment variable holding the password.
    pub fn password_env_var(mut self, var: impl Into<String>) -> Self {
        self.parameters.password_env_var = Some(var.into());
        self
    }

    /// `database`: the target table's database.
    pub fn database(mut self, database: impl Into<String>) -> Self {
        self.parameters.database = database.into();
        self
    }

    /// `table`: the target table (required).
    pub fn table(mut self, table: impl Into<String>) -> Self {
        self.parameters.table = table.into();
        self
    }

    /// `codec`: HTTP compression of inserted data.
    pub fn codec(mut self, codec: Codec) -> Self {
        self.parameters.codec = codec;
        self
    }

    /// `enable_tls`: HTTPS to every host.
    pub fn enable_tls(mut self, enable: bool) -> Self {
        self.parameters.enable_tls = enable;
        self
    }

    /// `tls_ca_files`: PEM files of the certificate authorities to trust.
    pub fn tls_ca_files<I>(mut self, files: I) -> Self
    where
        I: IntoIterator,
        I::Item: Into<PathBuf>,
    {
        self.parameters.tls_ca_files = files.into_iter().map(Into::into).collect();
        self
    }

    /// `tls_ca_directory`: a directory of certificate authorities to trust.
    pub fn tls_ca_directory(mut self, directory: impl Into<PathBuf>) -> Self {
        self.parameters.tls_ca_directory = Some(directory.into());
        self
    }

    /// `tls_skip_verification`: accept any server certificate.
    pub fn tls_skip_verification(mut self, skip: bool) -> Self {
        self.parameters.tls_skip_verification = skip;
        self
    }

    /// `token_namespace`: the prefix of deduplication tokens (default `<pipeline>.<sink>/`).
    pub fn token_namespace(mut self, namespace: impl Into<String>) -> Self {
        self.parameters.token_namespace = Some(namespace.into());
        self
    }

    /// Static `at_most_once_strategy` (`AtMostOnceClickHouseSink` only).
    pub fn at_most_once_strategy(mut self, strategy: AtMostOnceStrategy) -> Self {
        self.parameters.at_most_once_strategy = Some(strategy);
        self
    }

    /// `on_bad_rows`: what a row that fails its checks does.
    pub fn on_bad_rows(mut self, on_bad_rows: OnBadRows) -> Self {
        self.parameters.on_bad_rows = on_bad_rows;
        self
    }

    /// `on_expired_backlog` (exactly-once classes only): what a pending part older than the
    /// deduplication window does.
    pub fn on_expired_backlog(mut self, on_expired_backlog: OnExpiredBacklog) -> Self {
        self.parameters.on_expired_backlog = Some(on_expired_backlog);
        self
    }

    // Dynamic parameters.

    /// `write_timeout`: timeout of one HTTP request.
    pub fn write_timeout(mut self, timeout: Duration) -> Self {
        self.dynamic_parameters.write_timeout = timeout;
        self
    }

    /// `retry_backoff`: the pause after the first failed attempt.
    pub fn retry_backoff(mut self, backoff: Duration) -> Self {
        self.dynamic_parameters.retry_backoff = backoff;
        self
    }

    /// `max_retry_backoff`: the cap of the growing pause.
    pub fn max_retry_backoff(mut self, cap: Duration) -> Self {
        self.dynamic_parameters.max_retry_backoff = Some(cap);
        self
    }

    /// `max_insert_attempts`: attempts for unclassified errors.
    pub fn max_insert_attempts(mut self, attempts: u32) -> Self {
        self.dynamic_parameters.max_insert_attempts = attempts;
        self
    }

    /// `async_insert`: server-side asynchronous inserts.
    pub fn async_insert(mut self, enable: bool) -> Self {
        self.dynamic_parameters.async_insert = enable;
        self
    }

    /// `replay_horizon`: the upper bound of replay lag.
    pub fn replay_horizon(mut self, horizon: Duration) -> Self {
        self.dynamic_parameters.replay_horizon = horizon;
        self
    }

    /// `max_rows_per_batch`: a batch is sealed at this many messages.
    pub fn max_rows_per_batch(mut self, rows: u64) -> Self {
        self.dynamic_parameters.max_rows_per_batch = rows;
        self
    }

    /// `max_bytes_per_batch`: a batch is sealed at this many bytes of messages.
    pub fn max_bytes_per_batch(mut self, bytes: u64) -> Self {
        self.dynamic_parameters.max_bytes_per_batch = bytes;
        self
    }

    /// `max_in_flight_bytes`: payload bytes held in memory for delivery, per shard.
    pub fn max_in_flight_bytes(mut self, bytes: u64) -> Self {
        self.dynamic_parameters.max_in_flight_bytes = bytes;
        self
    }

    /// Dynamic `at_most_once_strategy.total_queue_bytes_limit` (`AtMostOnceClickHouseSink`
    /// only): the bytes its lossy queue may hold.
    pub fn total_queue_bytes_limit(mut self, bytes: u64) -> Self {
        self.dynamic_parameters.at_most_once_strategy = Some(AtMostOnceDynamic {
            total_queue_bytes_limit: bytes,
        });
        self
    }
}

/// A checked ClickHouse sink configuration: its class, and both sections as the registry parsed
/// them. A [`SinkConfig`], so it goes into
/// [`PipelineSpecBuilder::sink`](flow_core::PipelineSpecBuilder::sink); its
/// `dynamic_parameters()` is what a reload takes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ClickHouseSinkConfig {
    class: SinkClass,
    parameters: ClickHouseParams,
    dynamic_parameters: ClickHouseDynamicParams,
}

impl ClickHouseSinkConfig {
    /// The sink class.
    pub fn class(&self) -> SinkClass {
        self.class
    }

    /// The static parameters.
    pub fn params(&self) -> &ClickHouseParams {
        &self.parameters
    }

    /// The dynamic parameters.
    pub fn dynamic_params(&self) -> &ClickHouseDynamicParams {
        &self.dynamic_parameters
    }

    /// The same sink with other dynamic parameters, checked as a reload checks them.
    pub fn with_dynamic_params(
        self,
        dynamic_parameters: ClickHouseDynamicParams,
    ) -> Result<ClickHouseSinkConfig, ConfigError> {
        match params::parse_dynamic(self.class, &to_section(&dynamic_parameters)) {
            Ok(dynamic_parameters) => Ok(ClickHouseSinkConfig {
                dynamic_parameters,
                ..self
            }),
            Err(violations) => Err(ConfigError {
                class: self.class.class_name().to_owned(),
                violations,
            }),
        }
    }

    /// A builder holding this configuration, to change it.
    pub fn into_builder(self) -> ClickHouseSink {
        ClickHouseSink::from_params(self.class, self.parameters, self.dynamic_parameters)
    }
}

impl SinkConfig for ClickHouseSinkConfig {
    fn class_name(&self) -> &str {
        self.class.class_name()
    }

    fn parameters(&self) -> serde_yaml::Value {
        to_section(&self.parameters)
    }

    fn dynamic_parameters(&self) -> serde_yaml::Value {
        to_section(&self.dynamic_parameters)
    }
}
