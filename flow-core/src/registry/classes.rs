//! The class table of the registry: a builder per class name, and what a builder is handed.

use std::collections::BTreeMap;
use std::sync::Arc;

use crate::error::Violation;
use crate::plugin::{ProcessorFactory, SinkFactory, SourceFactory};
use crate::spec::{EpochSettings, SpecPaths};
use crate::types::StreamSchema;

/// What a source builder knows about the pipeline.
pub struct SourceBuildContext<'a> {
    /// The pipeline's name.
    pub pipeline: &'a str,
    /// The pipeline's partition count.
    pub partitions: u32,
    /// What the spec's relative paths are resolved against.
    pub paths: SpecPaths<'a>,
}

/// What a processor builder knows about the pipeline.
pub struct ProcessorBuildContext<'a> {
    /// The pipeline's name.
    pub pipeline: &'a str,
    /// The processor's name in the spec.
    pub name: &'a str,
    /// The schema of the stream it reads.
    pub input_schema: &'a Arc<StreamSchema>,
}

/// What a sink builder knows about the pipeline.
pub struct SinkBuildContext<'a> {
    /// The pipeline's name.
    pub pipeline: &'a str,
    /// The sink's name in the spec.
    pub sink: &'a str,
    /// The class name as written in the spec (an alias resolves to the same builder).
    pub class: &'a str,
    /// The pipeline's partition count.
    pub partitions: u32,
    /// When the pipeline's epochs end.
    pub epoch: EpochSettings,
    /// `(stream id, schema)` per input stream, in `input_stream_ids` order.
    pub inputs: &'a [(String, Arc<StreamSchema>)],
    /// The broker subject of each partition, as the pipeline's source reports it.
    pub subjects: SourceSubjects<'a>,
    /// What the spec's relative paths are resolved against.
    pub paths: SpecPaths<'a>,
}

/// The broker subject each partition reads ([`SourceFactory::subject`]), for a sink that names
/// its targets after it; it is the same for every message of a partition, so a sink resolves
/// it once per partition and a replay resolves it the same way.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SourceSubjects<'a> {
    /// The subject of every partition, in partition order.
    Known(&'a [String]),
    /// The source has no subjects.
    None {
        /// The source's class, as the spec names it.
        source_class: &'a str,
    },
    /// The source did not build (its violations say why) or is not known here.
    Unknown,
}

/// Builder results carry violations with paths relative to the plugin's spec entry
/// (`parameters.count`, `dynamic_parameters.max_rows_per_batch`).
pub type BuildResult<T> = Result<T, Vec<Violation>>;

/// Builds a source's factory from its context and `parameters`; a violation's path is relative
/// to the source's spec entry.
pub type SourceBuilder = Arc<
    dyn Fn(&SourceBuildContext<'_>, &serde_yaml::Value) -> BuildResult<Arc<dyn SourceFactory>>
        + Send
        + Sync,
>;
/// Builds a processor's factory from its context and `parameters`; a violation's path is
/// relative to the processor's spec entry.
pub type ProcessorBuilder = Arc<
    dyn Fn(&ProcessorBuildContext<'_>, &serde_yaml::Value) -> BuildResult<Arc<dyn ProcessorFactory>>
        + Send
        + Sync,
>;
/// Builds a sink's factory from its context, `parameters` and `dynamic_parameters`; a
/// violation's path is relative to the sink's spec entry.
pub type SinkBuilder = Arc<
    dyn Fn(
            &SinkBuildContext<'_>,
            &serde_yaml::Value,
            &serde_yaml::Value,
        ) -> BuildResult<Arc<dyn SinkFactory>>
        + Send
        + Sync,
>;

/// Builders by class name: what [`Registry::build`] turns a spec's `class` and
/// `sink_class_name` entries into.
///
/// Start from [`Registry::with_builtins`] and add the classes of other crates (their `register`
/// functions) or your own with `register_*`:
///
/// ```
/// use std::sync::Arc;
///
/// use flow_core::registry::{BuildResult, SinkBuildContext};
/// use flow_core::{Registry, SinkFactory};
///
/// fn my_sink(
///     _ctx: &SinkBuildContext<'_>,
///     _parameters: &serde_yaml::Value,
///     _dynamic_parameters: &serde_yaml::Value,
/// ) -> BuildResult<Arc<dyn SinkFactory>> {
///     // Parse the parameters (`flow_core::registry::parse_parameters`) and return the
///     // factory of the sink; here every entry is refused, with the path of the problem.
///     Err(vec![flow_core::Violation::new("parameters", "not implemented")])
/// }
///
/// let mut registry = Registry::with_builtins();
/// registry.register_sink("MySink", Arc::new(my_sink));
/// assert!(registry.source_classes().contains(&"generator"));
/// assert!(registry.sink_classes().contains(&"MySink"));
/// ```
#[derive(Clone, Default)]
pub struct Registry {
    sources: BTreeMap<String, SourceBuilder>,
    processors: BTreeMap<String, ProcessorBuilder>,
    sinks: BTreeMap<String, SinkBuilder>,
}

impl Registry {
    /// An empty registry.
    pub fn new() -> Self {
        Registry::default()
    }

    /// Adds (or replaces) the source class `class`.
    pub fn register_source(&mut self, class: &str, builder: SourceBuilder) {
        self.sources.insert(class.to_owned(), builder);
    }

    /// Adds (or replaces) the processor class `class`.
    pub fn register_processor(&mut self, class: &str, builder: ProcessorBuilder) {
        self.processors.insert(class.to_owned(), builder);
    }

    /// Adds (or replaces) the sink class `class`; register each alias of a class under its own name.
    pub fn register_sink(&mut self, class: &str, builder: SinkBuilder) {
        self.sinks.insert(class.to_owned(), builder);
    }

    /// The builder of source class `class`, if registered.
    pub fn source(&self, class: &str) -> Option<&SourceBuilder> {
        self.sources.get(class)
    }

    /// The builder of processor class `class`, if registered.
    pub fn processor(&self, class: &str) -> Option<&ProcessorBuilder> {
        self.processors.get(class)
    }

    /// The builder of sink class `class`, if registered.
    pub fn sink(&self, class: &str) -> Option<&SinkBuilder> {
        self.sinks.get(class)
    }

    /// Every registered source class, sorted.
    pub fn source_classes(&self) -> Vec<&str> {
        self.sources.keys().map(String::as_str).collect()
    }

    /// Every registered processor class, sorted.
    pub fn processor_classes(&self) -> Vec<&str> {
        self.processors.keys().map(String::as_str).collect()
    }

    /// Every registered sink class (aliases included), sorted.
    pub fn sink_classes(&self) -> Vec<&str> {
        self.sinks.keys().map(String::as_str).collect()
    }
}
