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

use crate::config::dynamic::{self, AtMostOnceDynamic, ClickHouseDynamicParams};
use crate::config::guarantee::SinkClass;
use crate::config::params::{
    self, AtMostOnceStrategy, ClickHouseParams, Codec, HostSelectionPolicy, MissingTable,
    OnBadRows, OnExpiredBacklog,
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
        match params::parse_spec(self.class, &parameters, &dynamic) {
            Ok((parameters, _, dynamic_parameters)) => Ok(ClickHouseSinkConfig {
                class: self.class,
                parameters,
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

    /// `password_file`: a file holding the password (a mounted secret).
    pub fn password_file(mut self, path: impl Into<std::path::PathBuf>) -> Self {
        self.parameters.password_file = Some(path.into());
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

    /// `table`: the target table (required unless `tables`), or a template over input columns
    /// and the broker subject (`events_{event_type}`, `{subject[1]}`; every class but the at-most-once queue).
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

    /// `token_namespace`: the prefix of deduplication tokens (default
    /// `<pipeline>.<sink>.<outbox id>/`).
    pub fn token_namespace(mut self, namespace: impl Into<String>) -> Self {
        self.parameters.token_namespace = Some(namespace.into());
        self
    }

    /// Static `at_most_once_strategy` (`AtMostOnceClickHouseSink` only).
    pub fn at_most_once_strategy(mut self, strategy: AtMostOnceStrategy) -> Self {
        self.parameters.at_most_once_strategy = Some(strategy);
        self
    }

    /// `tables`: the table of each broker subject (instead of `table`); every partition's
    /// subject must be one of them, which the registry checks against the source.
    pub fn tables<S: Into<String>, T: Into<String>>(
        mut self,
        tables: impl IntoIterator<Item = (S, T)>,
    ) -> Self {
        self.parameters.tables = tables
            .into_iter()
            .map(|(subject, table)| (subject.into(), table.into()))
            .collect();
        self
    }

    /// `missing_table` (with a table template): what a message whose table does not exist does.
    pub fn missing_table(mut self, missing_table: MissingTable) -> Self {
        self.parameters.missing_table = Some(missing_table);
        self
    }

    /// `max_tables` (with a table template): the most distinct tables the sink's rows may name.
    pub fn max_tables(mut self, max_tables: usize) -> Self {
        self.parameters.max_tables = Some(max_tables);
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

    /// `message_id_column` (exactly-once classes only): the input column (an integer type) whose
    /// value identifies each message, with which a part sent while the table's columns changed is
    /// looked up on the replicas before it is sent again.
    pub fn message_id_column(mut self, column: impl Into<String>) -> Self {
        self.parameters.message_id_column = Some(column.into());
        self
    }

    /// One entry of `settings`: a ClickHouse setting added to every INSERT (`max_insert_block_size`,
    /// `insert_quorum`, ...). The settings flow sets itself are refused by `build`.
    pub fn setting(
        mut self,
        name: impl Into<String>,
        value: impl Into<crate::config::settings::SettingValue>,
    ) -> Self {
        self.parameters.settings.insert(name.into(), value.into());
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
        match dynamic::parse_dynamic(self.class, &to_section(&dynamic_parameters)) {
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

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use flow_core::registry::parse_parameters;
    use flow_core::sources::GeneratorParams;
    use flow_core::{EpochSpec, PipelineSpec, Registry, SinkSpec, SourceConfig, Violation};

    use super::*;

    fn registry() -> Registry {
        let mut registry = Registry::with_builtins();
        crate::register(&mut registry);
        registry
    }

    fn yaml_spec(class: SinkClass, parameters: &str, dynamic: &str) -> PipelineSpec {
        PipelineSpec::from_yaml(&format!(
            "pipeline: p\nsource: {{class: generator, parameters: {{count: 1}}}}\nsinks:\n  - name: events\n    sink_class_name: {class}\n    input_stream_ids: [rows]\n    parameters: {parameters}\n    dynamic_parameters: {dynamic}\n"
        ))
        .unwrap()
    }

    fn code_spec(sink: ClickHouseSinkConfig) -> PipelineSpec {
        PipelineSpec::builder("p")
            .source(GeneratorParams::new(1))
            .sink("events", ["rows"], sink)
            .build()
    }

    /// The registry's violations of the spec's sink, paths relative to its entry.
    fn sink_violations(spec: &PipelineSpec) -> Vec<Violation> {
        let err = registry().build(spec).err().unwrap();
        err.violations
            .into_iter()
            .map(|v| {
                let path = v.path.strip_prefix("sinks[0].").unwrap().to_owned();
                Violation::new(path, v.message)
            })
            .collect()
    }

    /// The sections of the spec's sink as the registry parses them.
    fn parsed(spec: &PipelineSpec) -> (ClickHouseParams, ClickHouseDynamicParams) {
        parsed_sink(&spec.sinks[0])
    }

    fn parsed_sink(sink: &SinkSpec) -> (ClickHouseParams, ClickHouseDynamicParams) {
        (
            parse_parameters(&sink.parameters, "parameters").unwrap(),
            parse_parameters(&sink.dynamic_parameters, "dynamic_parameters").unwrap(),
        )
    }

    /// Each class, configured in code and in YAML.
    fn valid_configs() -> Vec<(ClickHouseSink, &'static str, &'static str)> {
        vec![
            (
                ClickHouseSink::sharded_exactly_once()
                    .shard("a", ["127.0.0.1:18123", "127.0.0.1:18124"])
                    .shard("b", ["127.0.0.1:18125", "127.0.0.1:18126"])
                    .table("events")
                    .sharding_key_columns(["user_id"])
                    .on_expired_backlog(OnExpiredBacklog::Send)
                    .message_id_column("id")
                    .max_rows_per_batch(50_000),
                "{shard_hosts: {a: ['127.0.0.1:18123', '127.0.0.1:18124'], b: ['127.0.0.1:18125', '127.0.0.1:18126']}, table: events, sharding_key_columns: [user_id], on_expired_backlog: send, message_id_column: id}",
                "{max_rows_per_batch: 50000}",
            ),
            (
                ClickHouseSink::exactly_once()
                    .hosts(["ch1", "ch2:8124"])
                    .port(18123)
                    .host_selection_policy(HostSelectionPolicy::RandomStart)
                    .user("writer")
                    .password_env_var("CH_PASSWORD")
                    .database("analytics")
                    .table("events")
                    .codec(Codec::None)
                    .enable_tls(true)
                    .tls_ca_files(["/etc/ssl/ch.pem"])
                    .tls_ca_directory("/etc/ssl/ch")
                    .token_namespace("prod/events/")
                    .on_bad_rows(OnBadRows::DeadLetter)
                    .write_timeout(Duration::from_millis(1500))
                    .retry_backoff(Duration::from_millis(200))
                    .max_retry_backoff(Duration::from_secs(90))
                    .max_insert_attempts(3)
                    .async_insert(true)
                    .replay_horizon(Duration::from_secs(7200))
                    .max_bytes_per_batch(1 << 20)
                    .max_in_flight_bytes(8 << 20),
                "{hosts: [ch1, 'ch2:8124'], port: 18123, host_selection_policy: random_start, user: writer, password_env_var: CH_PASSWORD, database: analytics, table: events, codec: none, enable_tls: true, tls_ca_files: [/etc/ssl/ch.pem], tls_ca_directory: /etc/ssl/ch, token_namespace: prod/events/, on_bad_rows: dead_letter}",
                "{write_timeout: 1500ms, retry_backoff: 200, max_retry_backoff: 90s, max_insert_attempts: 3, async_insert: true, replay_horizon: 2h, max_bytes_per_batch: 1048576, max_in_flight_bytes: 8388608}",
            ),
            (
                ClickHouseSink::at_least_once()
                    .host("127.0.0.1:18123")
                    .table("events")
                    .enable_tls(true)
                    .tls_skip_verification(true),
                "{host: '127.0.0.1:18123', table: events, enable_tls: true, tls_skip_verification: true}",
                "null",
            ),
            (
                ClickHouseSink::at_most_once()
                    .host("127.0.0.1:18123")
                    .table("events")
                    .at_most_once_strategy(AtMostOnceStrategy { enabled: true })
                    .total_queue_bytes_limit(1 << 20),
                "{host: '127.0.0.1:18123', table: events, at_most_once_strategy: {enabled: true}}",
                "{at_most_once_strategy: {total_queue_bytes_limit: 1048576}}",
            ),
        ]
    }

    #[test]
    fn each_class_configured_in_code_gives_the_parameters_of_its_yaml() {
        for (builder, parameters, dynamic) in valid_configs() {
            let class = builder.class();
            let config = builder.clone().build().unwrap();
            let yaml = yaml_spec(class, parameters, dynamic);
            let code = code_spec(config.clone());
            assert_eq!(code.sinks[0].sink_class_name, class.class_name());
            let expected = parsed(&yaml);
            assert_eq!(parsed(&code), expected, "{class}");
            assert_eq!(
                (config.params().clone(), config.dynamic_params().clone()),
                expected,
                "{class}"
            );
            // And the same as the builder was given: nothing was lost in serialization.
            assert_eq!(config.clone().into_builder(), builder, "{class}");
            assert!(registry().build(&code).is_ok(), "{class}");
        }
    }

    /// The same mistake, in code and in YAML.
    fn mistakes() -> Vec<(ClickHouseSink, SinkClass, &'static str, &'static str)> {
        let sharded = || {
            ClickHouseSink::sharded_exactly_once()
                .shard("a", ["127.0.0.1:18123", "127.0.0.1:18124"])
                .table("events")
        };
        vec![
            (
                sharded().shard("b c", ["127.0.0.1:18125"]),
                SinkClass::ShardedBatching,
                "{shard_hosts: {a: ['127.0.0.1:18123', '127.0.0.1:18124'], 'b c': ['127.0.0.1:18125']}, table: events}",
                "null",
            ),
            (
                sharded().max_rows_per_batch(0),
                SinkClass::ShardedBatching,
                "{shard_hosts: {a: ['127.0.0.1:18123', '127.0.0.1:18124']}, table: events}",
                "{max_rows_per_batch: 0}",
            ),
            (
                ClickHouseSink::exactly_once()
                    .hosts(["127.0.0.1:18123"])
                    .table("events"),
                SinkClass::Batching,
                "{hosts: ['127.0.0.1:18123'], table: events}",
                "null",
            ),
            (
                ClickHouseSink::exactly_once()
                    .host("127.0.0.1:18123")
                    .hosts(["127.0.0.1:18124", "127.0.0.1:18125"])
                    .table("events"),
                SinkClass::Batching,
                "{host: '127.0.0.1:18123', hosts: ['127.0.0.1:18124', '127.0.0.1:18125'], table: events}",
                "null",
            ),
            (
                ClickHouseSink::at_least_once()
                    .host("127.0.0.1:18123")
                    .table("events")
                    .max_rows_per_batch(0)
                    .total_queue_bytes_limit(5),
                SinkClass::AtLeastOnce,
                "{host: '127.0.0.1:18123', table: events}",
                "{max_rows_per_batch: 0, at_most_once_strategy: {total_queue_bytes_limit: 5}}",
            ),
            (
                ClickHouseSink::at_most_once()
                    .host("127.0.0.1:18123")
                    .hosts(["127.0.0.1:18124", "127.0.0.1:18125"])
                    .table("events")
                    .on_expired_backlog(OnExpiredBacklog::DeadLetter)
                    .write_timeout(Duration::ZERO),
                SinkClass::AtMostOnce,
                "{host: '127.0.0.1:18123', hosts: ['127.0.0.1:18124', '127.0.0.1:18125'], table: events, on_expired_backlog: dead_letter}",
                "{write_timeout: 0}",
            ),
            (
                // An empty host reads as unset in YAML, and so it does in code.
                ClickHouseSink::at_most_once().host("").table("events"),
                SinkClass::AtMostOnce,
                "{host: '', table: events}",
                "null",
            ),
        ]
    }

    #[test]
    fn a_mistake_in_code_is_the_violation_of_the_same_mistake_in_yaml() {
        for (builder, class, parameters, dynamic) in mistakes() {
            let yaml = sink_violations(&yaml_spec(class, parameters, dynamic));
            let err = builder.build().unwrap_err();
            assert_eq!(err.class, class.class_name());
            assert_eq!(err.violations, yaml, "{class} {parameters} {dynamic}");
        }
    }

    #[test]
    fn the_documented_mistakes_have_their_paths_and_messages() {
        let [shard_name, zero_rows, single_hosts, host_and_hosts, ..] =
            <[_; 7]>::try_from(mistakes()).unwrap();
        assert_eq!(
            shard_name.0.build().unwrap_err().violations,
            vec![Violation::new(
                "parameters.shard_hosts.b c",
                "shard name `b c` may only contain letters, digits, `_` and `-`; rename the shard (the name is part of the deduplication token, choose it for good)"
            )]
        );
        assert_eq!(
            zero_rows.0.build().unwrap_err().violations,
            vec![Violation::new(
                "dynamic_parameters.max_rows_per_batch",
                "0 is out of range (1..=1000000); set a value in that range"
            )]
        );
        assert_eq!(
            single_hosts.0.build().unwrap_err().violations,
            vec![Violation::new(
                "parameters.hosts",
                "a single-entry `hosts` list is not allowed: use `host: 127.0.0.1:18123` instead"
            )]
        );
        assert_eq!(
            host_and_hosts.0.build().unwrap_err().violations,
            vec![Violation::new(
                "parameters",
                "`host` and `hosts` are all set, but exactly one of `host`, `hosts`, `shard_hosts` must be; keep one and remove the others"
            )]
        );
    }

    #[test]
    fn a_sharding_key_column_missing_from_the_input_is_left_to_the_registry() {
        let sink = ClickHouseSink::sharded_exactly_once()
            .shard("a", ["127.0.0.1:18123"])
            .table("events")
            .sharding_key_columns(["nope"])
            .build()
            .unwrap();
        assert_eq!(
            sink_violations(&code_spec(sink)),
            vec![Violation::new(
                "parameters.sharding_key_columns[0]",
                "`nope` is not a column of the input stream"
            )]
        );
    }

    #[test]
    fn new_dynamic_parameters_are_checked_as_a_reload_checks_them() {
        let sink = ClickHouseSink::exactly_once()
            .host("127.0.0.1:18123")
            .table("events")
            .build()
            .unwrap();
        let faster = ClickHouseDynamicParams {
            max_rows_per_batch: 10,
            ..ClickHouseDynamicParams::default()
        };
        let changed = sink.clone().with_dynamic_params(faster.clone()).unwrap();
        assert_eq!(changed.dynamic_params(), &faster);
        assert_eq!(changed.params(), sink.params());
        let err = sink
            .with_dynamic_params(ClickHouseDynamicParams {
                max_rows_per_batch: 0,
                ..faster
            })
            .unwrap_err();
        assert_eq!(
            err.violations,
            vec![Violation::new(
                "dynamic_parameters.max_rows_per_batch",
                "0 is out of range (1..=1000000); set a value in that range"
            )]
        );
    }

    /// The spec with every plugin section rewritten as its typed parameters serialize: two specs
    /// that mean the same thing become equal.
    fn normalized(mut spec: PipelineSpec) -> PipelineSpec {
        let source: GeneratorParams =
            parse_parameters(&spec.source.parameters, "parameters").unwrap();
        spec.source = source.source_spec();
        for sink in &mut spec.sinks {
            let (parameters, dynamic) = parsed_sink(sink);
            sink.parameters = to_section(&parameters);
            sink.dynamic_parameters = to_section(&dynamic);
        }
        spec
    }

    #[test]
    fn the_readme_quickstart_built_in_code_is_the_readme_spec() {
        let readme = include_str!("../../../README.md");
        let start = readme.find("# spec.yaml\n").unwrap();
        let text = &readme[start..];
        let text = &text[..text.find("```").unwrap()];
        let yaml = PipelineSpec::from_yaml(text).unwrap();
        let sink = ClickHouseSink::sharded_exactly_once()
            .shard("a", ["127.0.0.1:18123", "127.0.0.1:18124"])
            .shard("b", ["127.0.0.1:18125", "127.0.0.1:18126"])
            .database("default")
            .table("events")
            .sharding_key_columns(["user_id"])
            .max_rows_per_batch(50_000)
            .build()
            .unwrap();
        let code = PipelineSpec::builder("quickstart")
            .partitions(4)
            .state_dir("./flow-state")
            .epoch(EpochSpec {
                max_messages: 10_000,
                max_duration_ms: 500,
            })
            .source(
                GeneratorParams::new(100_000)
                    .rate_per_second(0)
                    .payload_bytes(16),
            )
            .sink("events", ["rows"], sink)
            .build();
        assert_eq!(normalized(code.clone()), normalized(yaml.clone()));
        // The code's sections are already in that form.
        assert_eq!(normalized(code.clone()), code);
        assert!(registry().build(&code).is_ok());
    }
}
