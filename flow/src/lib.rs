//! flow: the entry point for Rust programs that run flow pipelines in-process.
//!
//! Layout:
//! - `config`: typed configuration of every built-in plugin (public module); `registry`: the
//!   registry of every built-in class.
//! - `handle`: [`PipelineHandle`] and [`StartOptions`]; `store_lifecycle`: opening and closing
//!   its state store; `error`: [`HandleError`].
//! - `cluster_leases`: cluster mode, this worker's membership and partition leases in the
//!   pipeline's ZooKeeper cluster ([`ClusterLeases`]); `cluster_drain`: every partition of a
//!   stopped pipeline held by one process for `drain` ([`DrainLeases`]).
//! - `live_status`: the status snapshot of a running pipeline; `metrics_snapshot`: metrics read
//!   back; `metrics_endpoint`: the Prometheus `/metrics` server and the `/health` and `/ready`
//!   probes.
//!
//! Architecture: flow is four crates behind this one. `flow-core` ([`core`]) is the runtime
//! (messages, plugins, specs, the partition runner, metrics); `flow-state` ([`state`]) is the
//! transactional outbox a pipeline commits into; `flow-clickhouse` ([`clickhouse`]) holds the
//! ClickHouse sinks and `flow-brokers` ([`brokers`]) the NATS JetStream and Kafka sources.
//! This crate puts them together: [`config`] holds the typed configuration of every built-in
//! plugin (a spec written in Rust: the same validated model a YAML spec gives), [`registry`]
//! knows every built-in plugin class, and a [`PipelineHandle`] (`handle`) validates a spec, opens
//! its state store and runs the pipeline on the current tokio runtime, then stops it gracefully,
//! reloads its dynamic parameters and reads the same status (`live_status`) and metrics
//! (`metrics_snapshot`, `metrics_endpoint`) as the `flow-worker` binary, which is built on this
//! crate too.
//!
//! ```no_run
//! use flow::config::{DebugSinkConfig, GeneratorParams};
//!
//! # async fn run() -> Result<(), Box<dyn std::error::Error>> {
//! // Validates into the same pipeline as this YAML spec (`PipelineSpec::from_yaml`):
//! // pipeline: demo
//! // source: {class: generator, parameters: {count: 1000}}
//! // sinks: [{name: out, sink_class_name: DebugSink, input_stream_ids: [rows], parameters: {path: out.jsonl}}]
//! let spec = flow::PipelineSpec::builder("demo")
//!     .source(GeneratorParams::new(1000))
//!     .sink("out", ["rows"], DebugSinkConfig::new("out.jsonl"))
//!     .build();
//! let mut handle = flow::PipelineHandle::start(spec, flow::StartOptions::new("./state")).await?;
//! let report = handle.wait().await?;
//! assert_eq!(report.messages(), 1000);
//! # Ok(())
//! # }
//! ```
#![warn(missing_docs)]

pub mod config;

mod cluster_drain;
mod cluster_leases;
mod error;
mod handle;
mod live_status;
mod metrics_endpoint;
mod metrics_snapshot;
mod registry;
mod store_lifecycle;

pub use cluster_drain::{DrainLeaseError, DrainLeases};
pub use cluster_leases::{ClusterLeases, JoinError};
pub use config::ConfigError;
pub use error::HandleError;
pub use handle::{PipelineHandle, StartOptions};
pub use live_status::{read_state_dir, snapshot_path, LiveStatus, StatusError, SOURCE_UNAVAILABLE};
pub use metrics_endpoint::{MetricsEndpoint, MetricsEndpointError};
pub use metrics_snapshot::{MetricSample, MetricsParseError, MetricsSnapshot};
pub use registry::registry;
pub use store_lifecycle::{
    close_state_store, open_state_store, warn_if_no_earlier_state, StoreError, STORE_CLOSE_TIMEOUT,
};

pub use flow_core::{
    Column, Epoch, EpochOutcome, EpochWrite, MessageBatch, MessageId, Metrics, PartitionEnd,
    PartitionReport, Pipeline, PipelineControl, PipelineSpec, Progress, ReadLimits, Registry,
    ReloadOutcome, Row, RowWriter, RunReport, RuntimeError, Sink, SinkContext, SinkError,
    SinkFactory, Source, SourceError, SourceFactory, SourceOutput, SourceRead, SpecError,
    StreamSchema, StreamType, ValidatedPipeline, Value, Violation,
};
pub use flow_state::{StateError, StateStore, StateSummary};

/// The runtime: messages, plugin traits, the registry and its builders (`core::registry`),
/// specs, the partition runner, metrics.
pub use flow_core as core;

/// The transactional outbox: positions, sealed batches, dead letters, counters, the summary.
pub use flow_state as state;

/// The ClickHouse sink classes, their parameters and `verify`.
pub use flow_clickhouse as clickhouse;

/// The broker sources: NATS JetStream and Kafka.
pub use flow_brokers as brokers;

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    #[test]
    fn the_registry_builds_a_spec_with_a_clickhouse_sink_and_a_broker_source() {
        let spec = crate::PipelineSpec::from_yaml(
            r#"
pipeline: p
source:
  class: nats_jetstream
  parameters: {servers: ["nats://127.0.0.1:14222"], stream: S, subjects: [s], format: raw}
sinks:
  - name: ch
    sink_class_name: ClickHouseBatchingSink
    input_stream_ids: [rows]
    parameters: {host: "127.0.0.1:18123", table: t}
"#,
        )
        .unwrap();
        let built = crate::registry().build(&spec);
        assert!(built.is_ok(), "{:?}", built.err());
    }
}
