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
//! ([`SourceConfig`], [`ProcessorConfig`], [`SinkConfig`]), which turn into the same spec entries
//! the YAML path reads; the built-in classes' parameter types implement them (`builtin_config`)
//! and check themselves with the registry's own validation.
//!
//! # Layout
//!
//! Public modules (API):
//! - [`registry`]: the classes by name, [`Registry::build`] and [`registry::parse_parameters`];
//! - [`delivery`]: the toolkit of a sink with an outbox (sealer, lanes, byte budget, `blocking`);
//! - [`sources`], [`processors`], [`sinks`]: the built-in plugins and their parameter types
//!   (`sources/push/`: the push source an application feeds from its own code).
//!
//! Private modules, their API re-exported at the crate root:
//! - `runtime/`: [`Pipeline`] and [`PipelineControl`]; the partition epoch loop and its parts;
//! - `spec/`: the [`PipelineSpec`] (YAML, with `${VAR}` from the environment, or built in code)
//!   and the [`ValidatedPipeline`];
//! - `plugin`: the plugin traits ([`SourceFactory`], [`Sink`], [`PartitionObserver`], ...);
//! - `message`, `packed`, `wide_int`, `types`, `json_form`: values, their packed and JSON forms,
//!   stream types and schemas; `json_scan`: the one-pass reader of flat JSON records;
//! - `type_expr`: the lexer of type expressions (`Name(arg, ...)`), shared by stream types and
//!   the ClickHouse sinks' column types;
//! - `error`, `metrics`, `capacity`, `dead_row`, `clock`: errors, Prometheus metrics and readiness, batch
//!   capacity planning, rows a sink sets aside, wall-clock time;
//! - `builtins`, `builtin_config`: the built-in classes' registration and typed configs;
//! - `structural`: spec sections deserialized with every structural mistake reported.
//!
//! The `testing` feature adds a hidden `testing` module of internals for this crate's own tests.

#![warn(missing_docs)]

pub mod delivery;
pub mod processors;
pub mod registry;
pub mod sinks;
pub mod sources;
#[cfg(feature = "testing")]
#[doc(hidden)]
pub mod testing;

mod builtin_config;
mod builtins;
mod capacity;
mod clock;
mod dead_row;
mod error;
mod json_form;
mod json_scan;
mod message;
mod metrics;
mod packed;
mod plugin;
mod runtime;
mod spec;
mod structural;
mod type_expr;
mod types;
mod wide_int;

pub use capacity::{reserve_projected, CapacityDecay, FaultedIn, Headroom, PROJECT_AFTER};
pub use dead_row::{base64_of, DeadRow, ExactBytes, ResendRow, TableRow};
pub use error::{
    BoxError, ProcessorError, ReplayError, RuntimeError, SinkError, SourceError, SpecError,
    ValueError, Violation,
};
pub use json_form::{push_json_text, JsonValueError};
pub use message::{MessageBatch, MessageId, Row, RowWriter, Value};
pub use metrics::{Metrics, NotReady, Readiness, SinkCount, SinkCounter, SinkMetrics, SourceCount};
pub use packed::{
    check_date32, decimal_width, parse_uuid, write_leb128, write_uuid, PackedError, PackedReader,
};
pub use plugin::{
    Epoch, EpochOutcome, EpochWrite, PartitionEnd, PartitionObserver, PendingWrite, Processor,
    ProcessorFactory, ReadLimits, Replay, ReplayReader, Sink, SinkContext, SinkFactory, Source,
    SourceFactory, SourceOutput, SourceRead,
};
pub use registry::Registry;
pub use runtime::{
    DrainReport, LeaseError, OutboxBacklog, PartitionLeases, PartitionReport, PendingOutbox,
    Pipeline, PipelineControl, Progress, ReloadOutcome, RunReport,
};
pub use sources::{PushError, PushHandle, PushOptions, PushSource, Receipt, Route};
pub use spec::{
    is_valid_name, to_section, ClusterSettings, ClusterSpec, ConfigError, EpochSettings, EpochSpec,
    MetricsSettings, MetricsSpec, NoSource, OutboxSpec, PayloadPolicy, PipelineSpec,
    PipelineSpecBuilder, ProcessorConfig, ProcessorSpec, ShutdownSpec, SinkConfig, SinkSpec,
    SourceConfig, SourceSpec, SpecPaths, ValidatedPipeline, ValidatedProcessor, ValidatedSink,
    MAX_EPOCH_DURATION_MS, MAX_EPOCH_MESSAGES, MAX_PARTITIONS, MAX_SESSION_TIMEOUT_MS,
    MAX_SPEC_NESTING,
};
pub use type_expr::TypeExprCursor;
pub use types::{Column, SchemaError, StreamSchema, StreamType, MAX_DECIMAL_PRECISION};
pub use wide_int::WideInt;
