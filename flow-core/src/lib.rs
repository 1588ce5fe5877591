//! flow-core: the dataflow runtime of flow.
//!
//! A pipeline reads typed messages from a **source** (one reader per partition), passes them
//! through **processors** and hands them to **sinks**; all three are plugins built by class name
//! from a YAML **spec** ([`spec`], [`registry`]). Each partition runs **epochs**
//! ([`runtime`]): read a bounded slice of messages, let every sink seal what it will deliver,
//! then commit the new source position together with the sealed batches in one atomic transaction
//! of the `flow-state` outbox. Sinks deliver committed batches asynchronously and in order
//! ([`delivery`]), and remove a batch from the outbox only once its target holds it, so a crash at
//! any point loses nothing and replays the stored bytes unchanged.
//!
//! Messages travel in [`MessageBatch`]es, row-major arenas reused across epochs: no allocation per
//! message on the hot path.

mod builtins;
pub mod delivery;
pub mod error;
mod graph;
pub mod message;
pub mod plugin;
pub mod processors;
pub mod registry;
mod replay;
pub mod runtime;
pub mod sinks;
pub mod sources;
pub mod spec;
pub mod types;

pub use error::{
    BoxError, ProcessorError, ReplayError, RuntimeError, SinkError, SourceError, SpecError,
    ValueError, Violation,
};
pub use message::{MessageBatch, MessageId, Row, RowWriter, Value};
pub use plugin::{
    Epoch, EpochOutcome, EpochWrite, Processor, ProcessorFactory, ReadLimits, Replay, ReplayReader,
    Sink, SinkContext, SinkFactory, Source, SourceFactory, SourceOutput, SourceRead,
};
pub use registry::Registry;
pub use runtime::{
    PartitionEnd, PartitionReport, Pipeline, PipelineControl, ReloadOutcome, RunReport,
};
pub use spec::{PayloadPolicy, PipelineSpec, ValidatedPipeline};
pub use types::{Column, SchemaError, StreamSchema, StreamType};
