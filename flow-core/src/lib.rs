//! flow-core: the dataflow runtime of flow.
//!
//! A pipeline reads typed messages from a **source** (one reader per partition), passes them
//! through **processors** and hands them to **sinks**; all three are plugins built by class name
//! from a YAML **spec** ([`PipelineSpec`], [`registry`]). Each partition runs **epochs**
//! ([`Pipeline`]): read a bounded slice of messages, let every sink seal what it will deliver,
//! then commit the new source position together with the sealed batches in one atomic transaction
//! of the `flow-state` outbox. Sinks deliver committed batches asynchronously and in order
//! ([`delivery`]), and remove a batch from the outbox only once its target holds it, so a crash at
//! any point loses nothing. A replayable source lets the outbox keep only a batch's bounds: the
//! sink rebuilds it on replay through a [`Replay`] reader (the source reopened at the epoch's start
//! and the processors run again) and checks it against the stored hash.
//!
//! Every `_total` counter of the Prometheus [`Metrics`] is persisted with what it counts (the
//! epoch's commit, the batch's acknowledgement), so it continues across restarts and crashes.
//!
//! Messages travel in [`MessageBatch`]es, row-major arenas reused across epochs: no allocation per
//! message on the hot path. A value is a 64-bit cell, or for wide and nested types (decimals,
//! UUIDs, lists, dicts, tuples, ...) a byte string in the arena in its packed form
//! ([`PackedReader`]), ClickHouse's RowBinary layout of the type, which sinks walk without
//! decoding into objects. Sources read values from their JSON forms (`json_form`).
//!
//! A spec can also be assembled in code ([`PipelineSpec::builder`]) from typed plugin configs
//! ([`SourceConfig`], [`ProcessorConfig`], [`SinkConfig`]; `plugin_config`), which turn into the
//! same spec entries the YAML path reads; the built-in classes' parameter types implement them
//! (`builtin_config`) and check themselves with the registry's own validation.

#![warn(missing_docs)]

// API modules: what plugin authors build on (`delivery` for outbox sinks, `registry` for
// builders) and the built-in plugins' parameter types. The rest is re-exported below.
pub mod delivery;
pub mod processors;
pub mod registry;
pub mod sinks;
pub mod sources;

mod answers;
mod builtin_config;
mod builtins;
mod capacity;
mod dead_row;
mod delivered;
mod drain;
mod error;
mod graph;
mod json_form;
mod lag;
mod message;
mod metrics;
mod packed;
mod plugin;
mod plugin_config;
mod progress;
mod replay;
mod row_json;
mod runtime;
mod spec;
mod spec_builder;
mod spec_text;
mod type_expr;
mod types;
mod wide_int;

pub use capacity::{reserve_projected, CapacityDecay, FaultedIn, Headroom, PROJECT_AFTER};
pub use dead_row::{DeadRow, ResendRow};
pub use drain::{DrainReport, OutboxBacklog, PendingOutbox};
pub use error::{
    BoxError, ProcessorError, ReplayError, RuntimeError, SinkError, SourceError, SpecError,
    ValueError, Violation,
};
pub use json_form::{push_json_text, write_json_value};
pub use message::{MessageBatch, MessageId, Row, RowWriter, Value};
pub use metrics::{Metrics, SinkCount, SinkCounter, SinkMetrics, SourceCount};
pub use packed::{
    check_date32, decimal_width, parse_uuid, validate as validate_packed, write_leb128, write_uuid,
    PackedError, PackedReader, DATE32_RANGE,
};
pub use plugin::{
    Epoch, EpochOutcome, EpochWrite, PartitionObserver, PendingWrite, Processor, ProcessorFactory,
    ReadLimits, Replay, ReplayReader, Sink, SinkContext, SinkFactory, Source, SourceFactory,
    SourceOutput, SourceRead,
};
pub use plugin_config::{to_section, ConfigError, ProcessorConfig, SinkConfig, SourceConfig};
pub use progress::Progress;
pub use registry::Registry;
pub use row_json::{write_json_string, write_row_object};
pub use runtime::{
    PartitionEnd, PartitionReport, Pipeline, PipelineControl, ReloadOutcome, RunReport,
};
pub use sources::push::{PushError, PushHandle, PushOptions, PushSource, Receipt, Route};
pub use spec::{
    is_valid_name, EpochSettings, EpochSpec, MetricsSettings, MetricsSpec, OutboxSpec,
    PayloadPolicy, PipelineSpec, ProcessorSpec, ShutdownSpec, SinkSpec, SourceSpec,
    ValidatedPipeline, ValidatedProcessor, ValidatedSink, MAX_EPOCH_DURATION_MS,
    MAX_EPOCH_MESSAGES, MAX_PARTITIONS,
};
pub use spec_builder::{NoSource, PipelineSpecBuilder};
pub use spec_text::MAX_SPEC_NESTING;
pub use type_expr::TypeExprCursor;
pub use types::{Column, SchemaError, StreamSchema, StreamType, MAX_DECIMAL_PRECISION};
pub use wide_int::WideInt;
