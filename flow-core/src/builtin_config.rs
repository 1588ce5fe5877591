//! Typed configuration of flow-core's built-in plugins: builder-style constructors on their
//! parameter types, the [`SourceConfig`] / [`ProcessorConfig`] / [`SinkConfig`] impls, and
//! `validate`, which runs the registry's own builder of the class on the serialized parameters so
//! that its violations are those of the YAML path by construction. What depends on the rest of
//! the pipeline (one file per partition, the columns of a processor's input) is left to
//! [`Registry::build`](crate::Registry::build): `validate` builds with a context in which those
//! checks hold.

use std::path::PathBuf;

use crate::error::Violation;
use crate::plugin_config::{to_section, ProcessorConfig, SinkConfig, SourceConfig};
use crate::processors::project::{self, ProjectParams};
use crate::registry::{BuildResult, SinkBuildContext, SourceBuildContext};
use crate::sinks::debug::{self, DebugSinkDynamicParams, DebugSinkParams};
use crate::sources::generator::{self, GeneratorParams};
use crate::sources::jsonl::{self, JsonlFileParams, OnBadRecord};
use crate::types::{Column, SchemaError};

/// The violations of a builder's result (none when it built).
fn violations<T>(built: BuildResult<T>) -> Vec<Violation> {
    built.err().unwrap_or_default()
}

impl GeneratorParams {
    /// `count` messages per partition (0: endless), unthrottled, with the default 16-byte
    /// payload.
    pub fn new(count: u64) -> Self {
        GeneratorParams {
            count,
            rate_per_second: 0,
            payload_bytes: generator::default_payload_bytes(),
        }
    }

    /// Messages per second per partition; 0 means unlimited.
    pub fn rate_per_second(mut self, rate: u64) -> Self {
        self.rate_per_second = rate;
        self
    }

    /// Bytes of each message's `payload` column.
    pub fn payload_bytes(mut self, bytes: usize) -> Self {
        self.payload_bytes = bytes;
        self
    }
}

impl SourceConfig for GeneratorParams {
    fn class_name(&self) -> &str {
        "generator"
    }

    fn parameters(&self) -> serde_yaml::Value {
        to_section(self)
    }
}

impl JsonlFileParams {
    /// Reads `files` (one per partition, in partition order) against the declared `schema`,
    /// into stream `rows`, stopping at a bad record.
    pub fn new<I>(files: I, schema: Vec<Column>) -> Self
    where
        I: IntoIterator,
        I::Item: Into<PathBuf>,
    {
        JsonlFileParams {
            files: files.into_iter().map(Into::into).collect(),
            stream_id: jsonl::default_stream_id(),
            schema,
            on_bad_record: OnBadRecord::default(),
            max_record_bytes: jsonl::default_max_record_bytes(),
        }
    }

    /// The id of the stream the source defines.
    pub fn stream_id(mut self, stream_id: impl Into<String>) -> Self {
        self.stream_id = stream_id.into();
        self
    }

    /// What a line that does not fit the schema does.
    pub fn on_bad_record(mut self, on_bad_record: OnBadRecord) -> Self {
        self.on_bad_record = on_bad_record;
        self
    }

    /// The longest line read as a record.
    pub fn max_record_bytes(mut self, bytes: u64) -> Self {
        self.max_record_bytes = bytes;
        self
    }

    /// Every violation the registry reports for these parameters, with its path
    /// (`parameters.schema`), except that the number of files must equal the pipeline's
    /// partitions, which [`Registry::build`](crate::Registry::build) checks.
    pub fn validate(&self) -> Vec<Violation> {
        // As many partitions as files: the one check that needs the pipeline holds.
        let partitions = u32::try_from(self.files.len().max(1)).unwrap_or(u32::MAX);
        let ctx = SourceBuildContext {
            pipeline: "",
            partitions,
        };
        violations(jsonl::build(&ctx, &self.parameters()))
    }
}

impl SourceConfig for JsonlFileParams {
    fn class_name(&self) -> &str {
        "jsonl_file"
    }

    fn parameters(&self) -> serde_yaml::Value {
        to_section(self)
    }
}

impl ProjectParams {
    /// Keeps `columns` of the input stream, in this order.
    pub fn new<I>(columns: I) -> Self
    where
        I: IntoIterator,
        I::Item: Into<String>,
    {
        ProjectParams {
            columns: columns.into_iter().map(Into::into).collect(),
        }
    }

    /// The violations the registry reports whatever the input stream: no column listed, a column
    /// listed twice. That each column is one of the input's is checked by
    /// [`Registry::build`](crate::Registry::build).
    pub fn validate(&self) -> Vec<Violation> {
        let mut v = Vec::new();
        if self.columns.is_empty() {
            v.push(Violation::new(
                "parameters.columns",
                project::NO_COLUMNS,
            ));
        }
        let mut seen = std::collections::HashSet::new();
        if let Some(twice) = self.columns.iter().find(|c| !seen.insert(c.as_str())) {
            let err = SchemaError::DuplicateColumn {
                name: twice.clone(),
            };
            v.push(Violation::new("parameters.columns", err.to_string()));
        }
        v
    }
}

impl ProcessorConfig for ProjectParams {
    fn class_name(&self) -> &str {
        "project"
    }

    fn parameters(&self) -> serde_yaml::Value {
        to_section(self)
    }
}

impl Default for DebugSinkDynamicParams {
    fn default() -> Self {
        DebugSinkDynamicParams {
            max_rows_per_batch: debug::default_max_rows_per_batch(),
        }
    }
}

/// The typed configuration of a `DebugSink`: its static and dynamic parameters.
///
/// ```
/// use flow_core::sinks::DebugSinkConfig;
///
/// let sink = DebugSinkConfig::new("out.jsonl").max_rows_per_batch(0);
/// let violations = sink.validate();
/// assert_eq!(violations[0].path, "dynamic_parameters.max_rows_per_batch");
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DebugSinkConfig {
    /// The static `parameters`.
    pub parameters: DebugSinkParams,
    /// The reloadable `dynamic_parameters`.
    pub dynamic_parameters: DebugSinkDynamicParams,
}

impl DebugSinkConfig {
    /// Writes to the file at `path` (`-` for stdout), with the default dynamic parameters.
    pub fn new(path: impl Into<PathBuf>) -> Self {
        DebugSinkConfig {
            parameters: DebugSinkParams { path: path.into() },
            dynamic_parameters: DebugSinkDynamicParams::default(),
        }
    }

    /// A batch is sealed at this many messages.
    pub fn max_rows_per_batch(mut self, rows: u64) -> Self {
        self.dynamic_parameters.max_rows_per_batch = rows;
        self
    }

    /// Every violation the registry reports for this sink, with its path
    /// (`dynamic_parameters.max_rows_per_batch`).
    pub fn validate(&self) -> Vec<Violation> {
        // The debug sink's builder reads nothing of the pipeline but names.
        let ctx = SinkBuildContext {
            pipeline: "",
            sink: "",
            class: "DebugSink",
            partitions: 1,
            inputs: &[],
        };
        let built = debug::build(&ctx, &self.parameters(), &self.dynamic_parameters());
        violations(built)
    }
}

impl SinkConfig for DebugSinkConfig {
    fn class_name(&self) -> &str {
        "DebugSink"
    }

    fn parameters(&self) -> serde_yaml::Value {
        to_section(&self.parameters)
    }

    fn dynamic_parameters(&self) -> serde_yaml::Value {
        to_section(&self.dynamic_parameters)
    }
}
