//! The plugin registry: builds sources, processors and sinks by class name from spec parameters.
//! Third-party crates add their classes with `register_*` before the spec is built.

use std::collections::BTreeMap;
use std::sync::Arc;

use serde::de::DeserializeOwned;

use crate::error::Violation;
use crate::plugin::{ProcessorFactory, SinkFactory, SourceFactory};
use crate::types::StreamSchema;

/// What a source builder knows about the pipeline.
pub struct SourceBuildContext<'a> {
    pub pipeline: &'a str,
    pub partitions: u32,
}

/// What a processor builder knows about the pipeline.
pub struct ProcessorBuildContext<'a> {
    pub pipeline: &'a str,
    pub name: &'a str,
    pub input_schema: &'a Arc<StreamSchema>,
}

/// What a sink builder knows about the pipeline.
pub struct SinkBuildContext<'a> {
    pub pipeline: &'a str,
    pub sink: &'a str,
    /// The class name as written in the spec (an alias resolves to the same builder).
    pub class: &'a str,
    pub partitions: u32,
    /// `(stream id, schema)` per input stream, in `input_stream_ids` order.
    pub inputs: &'a [(String, Arc<StreamSchema>)],
}

/// Builder results carry violations with paths relative to the plugin's spec entry
/// (`parameters.count`, `dynamic_parameters.max_rows_per_batch`).
pub type BuildResult<T> = Result<T, Vec<Violation>>;

pub type SourceBuilder = Arc<
    dyn Fn(&SourceBuildContext<'_>, &serde_yaml::Value) -> BuildResult<Arc<dyn SourceFactory>>
        + Send
        + Sync,
>;
pub type ProcessorBuilder = Arc<
    dyn Fn(&ProcessorBuildContext<'_>, &serde_yaml::Value) -> BuildResult<Arc<dyn ProcessorFactory>>
        + Send
        + Sync,
>;
pub type SinkBuilder = Arc<
    dyn Fn(
            &SinkBuildContext<'_>,
            &serde_yaml::Value,
            &serde_yaml::Value,
        ) -> BuildResult<Arc<dyn SinkFactory>>
        + Send
        + Sync,
>;

/// Builders by class name.
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

    pub fn register_source(&mut self, class: &str, builder: SourceBuilder) {
        self.sources.insert(class.to_owned(), builder);
    }

    pub fn register_processor(&mut self, class: &str, builder: ProcessorBuilder) {
        self.processors.insert(class.to_owned(), builder);
    }

    pub fn register_sink(&mut self, class: &str, builder: SinkBuilder) {
        self.sinks.insert(class.to_owned(), builder);
    }

    pub fn source(&self, class: &str) -> Option<&SourceBuilder> {
        self.sources.get(class)
    }

    pub fn processor(&self, class: &str) -> Option<&ProcessorBuilder> {
        self.processors.get(class)
    }

    pub fn sink(&self, class: &str) -> Option<&SinkBuilder> {
        self.sinks.get(class)
    }

    pub fn source_classes(&self) -> Vec<&str> {
        self.sources.keys().map(String::as_str).collect()
    }

    pub fn processor_classes(&self) -> Vec<&str> {
        self.processors.keys().map(String::as_str).collect()
    }

    pub fn sink_classes(&self) -> Vec<&str> {
        self.sinks.keys().map(String::as_str).collect()
    }
}

/// Deserializes plugin parameters (a missing section is an empty mapping), reporting the error's
/// path under `section` (`parameters.payload_bytes: invalid type ...`).
pub fn parse_parameters<T: DeserializeOwned>(
    value: &serde_yaml::Value,
    section: &str,
) -> Result<T, Violation> {
    let value = match value {
        serde_yaml::Value::Null => serde_yaml::Value::Mapping(serde_yaml::Mapping::new()),
        other => other.clone(),
    };
    serde_path_to_error::deserialize(value).map_err(|err| {
        let inner = err.path().to_string();
        let path = if inner == "." || inner.is_empty() {
            section.to_owned()
        } else {
            format!("{section}.{inner}")
        };
        Violation::new(path, err.into_inner().to_string())
    })
}
