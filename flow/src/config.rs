//! Typed configuration: a pipeline spec written in Rust instead of YAML, with everything it needs
//! in this one module.
//!
//! [`PipelineSpec::builder`](crate::PipelineSpec::builder) returns a [`PipelineSpecBuilder`]
//! that has a setter for every key of the YAML spec ([`EpochSpec`], [`OutboxSpec`],
//! [`ShutdownSpec`], [`MetricsSpec`]; unset keys get the YAML defaults) and takes each plugin as a
//! typed config: a [`SourceConfig`], [`ProcessorConfig`] or [`SinkConfig`]. Every built-in class
//! has one:
//!
//! | class | config |
//! | --- | --- |
//! | `generator`, `jsonl_file` | [`GeneratorParams`], [`JsonlFileParams`] |
//! | `nats_jetstream`, `kafka` | [`NatsJetStreamParams`], [`KafkaParams`] (their common setters: [`BrokerSourceParams`]) |
//! | `project` | [`ProjectParams`] |
//! | `DebugSink` | [`DebugSinkConfig`] |
//! | the four ClickHouse sinks | [`ClickHouseSink`] builds a checked [`ClickHouseSinkConfig`] |
//!
//! YAML and the builders are two front-ends of one model: a typed config serializes into the
//! spec entry the YAML path reads, so both meet the same registry builders and give the same
//! validated pipeline (`flow::registry().build(&spec)`, or
//! [`PipelineHandle::start`](crate::PipelineHandle::start)), with the same violations at the
//! same paths. A config also checks itself where it is written: [`ClickHouseSink::build`]
//! returns a [`ConfigError`] listing every violation with its path relative to the sink's entry,
//! and the other configs have `validate()` (turned into a `ConfigError` by
//! [`ConfigError::check`]). What depends on the rest of the pipeline (a sink's input stream, its
//! sharding key columns) is checked when the spec is built.
//!
//! A program's own plugin classes get typed configs by implementing the traits, usually on
//! their serde parameter type with [`to_section`].
//!
//! ```
//! use flow::config::{ClickHouseSink, EpochSpec, GeneratorParams};
//!
//! let sink = ClickHouseSink::sharded_exactly_once()
//!     .shard("a", ["127.0.0.1:18123", "127.0.0.1:18124"])
//!     .shard("b", ["127.0.0.1:18125", "127.0.0.1:18126"])
//!     .table("events")
//!     .sharding_key_columns(["user_id"])
//!     .max_rows_per_batch(50_000)
//!     .build()?;
//! let spec = flow::PipelineSpec::builder("events")
//!     .partitions(4)
//!     .epoch(EpochSpec { max_messages: 10_000, max_duration_ms: 500 })
//!     .source(GeneratorParams::new(100_000))
//!     .sink("events", ["rows"], sink)
//!     .build();
//! // Validating needs no server: the sinks connect when the pipeline starts.
//! let pipeline = flow::registry().build(&spec)?;
//! assert_eq!(pipeline.partitions, 4);
//!
//! let err = ClickHouseSink::exactly_once().hosts(["127.0.0.1:18123"]).table("events").build();
//! assert_eq!(
//!     err.unwrap_err().to_string(),
//!     "the ClickHouseBatchingSink configuration has 1 violation(s):\n  \
//!      parameters.hosts: a single-entry `hosts` list is not allowed: use `host: 127.0.0.1:18123` instead"
//! );
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

pub use flow_core::processors::project::ProjectParams;
pub use flow_core::sinks::debug::{DebugSinkDynamicParams, DebugSinkParams};
pub use flow_core::sinks::DebugSinkConfig;
pub use flow_core::sources::{BrokerFormat, GeneratorParams, JsonlFileParams, OnBadRecord};
pub use flow_core::{
    to_section, ConfigError, EpochSpec, MetricsSpec, NoSource, OutboxSpec, PayloadPolicy,
    PipelineSpecBuilder, ProcessorConfig, ShutdownSpec, SinkConfig, SourceConfig,
};

pub use flow_clickhouse::{
    AtMostOnceDynamic, AtMostOnceStrategy, ClickHouseDynamicParams, ClickHouseParams,
    ClickHouseSink, ClickHouseSinkConfig, Codec, HostSelectionPolicy, OnBadRows, OnExpiredBacklog,
    SinkClass,
};

pub use flow_brokers::{BrokerSourceParams, KafkaParams, NatsAuth, NatsJetStreamParams};

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use super::*;
    use crate::{Column, StreamType};

    /// The typed sink's violation is the YAML sink's, under the sink's entry in the spec.
    #[test]
    fn a_single_host_list_is_the_same_violation_typed_and_in_yaml() {
        let typed = ClickHouseSink::exactly_once()
            .hosts(["127.0.0.1:18123"])
            .table("events")
            .build()
            .unwrap_err();
        assert_eq!(typed.class, "ClickHouseBatchingSink");
        assert_eq!(typed.violations.len(), 1);

        let yaml = crate::PipelineSpec::from_yaml(
            r#"
pipeline: p
source: {class: generator, parameters: {count: 1}}
sinks:
  - name: events
    sink_class_name: ClickHouseBatchingSink
    input_stream_ids: [rows]
    parameters: {hosts: ["127.0.0.1:18123"], table: events}
"#,
        )
        .unwrap();
        let err = crate::registry().build(&yaml).err().unwrap();
        assert_eq!(err.violations.len(), 1);
        assert_eq!(err.violations[0].path, "sinks[0].parameters.hosts");
        assert_eq!(err.violations[0].message, typed.violations[0].message);
        assert_eq!(typed.violations[0].path, "parameters.hosts");
    }

    /// Every built-in class's typed config goes through the builder into a spec the facade's
    /// registry builds.
    #[test]
    fn typed_configs_of_every_builtin_class_build_through_the_facade_registry() {
        let clickhouse = ClickHouseSink::at_least_once()
            .host("127.0.0.1:18123")
            .table("events")
            .build()
            .unwrap();
        let spec = crate::PipelineSpec::builder("typed")
            .partitions(2)
            .epoch(EpochSpec {
                max_messages: 100,
                max_duration_ms: 50,
            })
            .outbox(OutboxSpec {
                payloads: PayloadPolicy::Always,
            })
            .shutdown(ShutdownSpec {
                drain_timeout_ms: 0,
            })
            .metrics(MetricsSpec {
                listen: "127.0.0.1:0".to_owned(),
            })
            .source(
                NatsJetStreamParams::new(["nats://127.0.0.1:14222"], "S")
                    .subjects(["a", "b"])
                    .schema(vec![
                        Column::new("id", StreamType::Uint64),
                        Column::new("name", StreamType::Utf8),
                    ]),
            )
            .processor("keep", "rows", "kept", ProjectParams::new(["id"]))
            .sink("debug", ["kept"], DebugSinkConfig::new("-"))
            .sink("clickhouse", ["rows"], clickhouse)
            .build();
        let built = crate::registry().build(&spec);
        assert!(built.is_ok(), "{:?}", built.err());
        assert_eq!(built.unwrap().partitions, 2);
    }
}
