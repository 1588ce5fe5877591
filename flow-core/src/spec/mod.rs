//! The pipeline spec: what a YAML file (or code, through [`PipelineSpec::builder`]) says a
//! pipeline is, before validation, and the [`ValidatedPipeline`] that `Registry::build` makes of
//! it — the only form the runtime accepts.
//!
//! Layout:
//! - `pipeline_spec`: the serde types of the spec and its YAML reading, every structural mistake
//!   reported with its path;
//! - `text`: the checks on the raw text before the YAML parser sees it;
//! - `interpolate`: `${VAR}` / `${VAR:-default}` in the parsed values, from the environment;
//! - `spec_paths`: [`SpecPaths`], what a spec's relative paths are resolved against;
//! - `builder`: [`PipelineSpecBuilder`], a spec assembled in code;
//! - `plugin_config`: the typed plugin configs ([`SourceConfig`], [`ProcessorConfig`],
//!   [`SinkConfig`]) the builder takes;
//! - `validated`: the spec after validation, with its plugins built.

mod builder;
mod interpolate;
mod pipeline_spec;
mod plugin_config;
mod spec_paths;
mod text;
mod validated;

pub use builder::{NoSource, PipelineSpecBuilder};
pub use pipeline_spec::{
    is_valid_name, ClusterSettings, ClusterSpec, EpochSpec, MetricsSettings, MetricsSpec,
    OutboxSpec, PayloadPolicy, PipelineSpec, ProcessorSpec, ShutdownSpec, SinkSpec, SourceSpec,
    MAX_DRAIN_TIMEOUT_MS, MAX_EPOCH_DURATION_MS, MAX_EPOCH_MESSAGES, MAX_PARTITIONS,
    MAX_SESSION_TIMEOUT_MS,
};
pub use plugin_config::{to_section, ConfigError, ProcessorConfig, SinkConfig, SourceConfig};
pub use spec_paths::SpecPaths;
pub use text::MAX_SPEC_NESTING;
pub use validated::{EpochSettings, ValidatedPipeline, ValidatedProcessor, ValidatedSink};
