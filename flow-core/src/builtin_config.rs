//! Typed configuration of flow-core's built-in plugins: builder-style constructors on their
//! parameter types, the [`SourceConfig`] / [`ProcessorConfig`] / [`SinkConfig`] impls, and the
//! registry's own checks as `validate`. `jsonl_file` and `DebugSink` run their registry builder on
//! the serialized parameters, so their violations are those of the YAML path by construction;
//! `generator`'s `validate` is the one its builder calls; `project`'s makes the two checks of its
//! builder that do not need the input stream. What depends on the rest of the pipeline (one file
//! per partition, the columns of a processor's input) is left to
//! [`Registry::build`](crate::Registry::build): `validate` builds with a context in which those
//! checks hold.

use std::path::PathBuf;

use crate::error::Violation;
use crate::processors::project::{self, ProjectParams};
use crate::registry::{BuildResult, SinkBuildContext, SourceBuildContext, SourceSubjects};
use crate::sinks::debug::{self, DebugSinkDynamicParams, DebugSinkParams};
use crate::sources::generator::{self, GeneratorParams};
use crate::sources::jsonl::{self, JsonlFileParams, OnBadRecord};
use crate::spec::{to_section, ProcessorConfig, SinkConfig, SourceConfig};
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
            paths: crate::SpecPaths::working_directory(),
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
            v.push(Violation::new("parameters.columns", project::NO_COLUMNS));
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
            epoch: crate::spec::EpochSettings::default(),
            inputs: &[],
            subjects: SourceSubjects::Unknown,
            paths: crate::SpecPaths::working_directory(),
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

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;
    use crate::registry::parse_parameters;
    use crate::spec::{
        EpochSpec, MetricsSpec, OutboxSpec, PayloadPolicy, PipelineSpec, ShutdownSpec,
    };
    use crate::types::StreamType;
    use crate::Registry;

    const DEBUG_SINK: &str =
        "sinks:\n  - {name: out, sink_class_name: DebugSink, input_stream_ids: [rows], parameters: {path: out.jsonl}}\n";

    /// The registry's violations for `spec`, with `prefix` (`source.`) stripped from their paths.
    fn registry_violations(spec: &PipelineSpec, prefix: &str) -> Vec<Violation> {
        let err = Registry::with_builtins().build(spec).err().unwrap();
        err.violations
            .into_iter()
            .map(|v| {
                let path = v.path.strip_prefix(prefix).unwrap_or(&v.path).to_owned();
                Violation::new(path, v.message)
            })
            .collect()
    }

    fn generator_spec(source: impl SourceConfig) -> PipelineSpec {
        PipelineSpec::builder("p")
            .source(source)
            .sink("out", ["rows"], DebugSinkConfig::new("out.jsonl"))
            .build()
    }

    #[test]
    fn a_generator_config_and_its_yaml_give_the_same_parameters() {
        let yaml = PipelineSpec::from_yaml(&format!(
            "pipeline: p\nsource: {{class: generator, parameters: {{count: 5, payload_bytes: 8}}}}\n{DEBUG_SINK}"
        ))
        .unwrap();
        let config = GeneratorParams::new(5).payload_bytes(8);
        let code = generator_spec(&config);
        assert_eq!(code.source.class, yaml.source.class);
        let from_yaml: GeneratorParams =
            parse_parameters(&yaml.source.parameters, "parameters").unwrap();
        let from_code: GeneratorParams =
            parse_parameters(&code.source.parameters, "parameters").unwrap();
        assert_eq!(from_yaml, config);
        assert_eq!(from_code, config);
        assert!(config.validate().is_empty());
        assert!(Registry::with_builtins().build(&code).is_ok());
    }

    #[test]
    fn a_generator_mistake_in_code_is_the_violation_of_the_same_mistake_in_yaml() {
        let yaml = PipelineSpec::from_yaml(&format!(
            "pipeline: p\nsource: {{class: generator, parameters: {{count: 5, payload_bytes: 2000000}}}}\n{DEBUG_SINK}"
        ))
        .unwrap();
        let config = GeneratorParams::new(5).payload_bytes(2_000_000);
        let expected = vec![Violation::new(
            "parameters.payload_bytes",
            "2000000 is out of range 0..=1048576",
        )];
        assert_eq!(config.validate(), expected);
        assert_eq!(registry_violations(&yaml, "source."), expected);
        assert_eq!(
            registry_violations(&generator_spec(config), "source."),
            expected
        );
    }

    fn jsonl_schema() -> Vec<Column> {
        vec![
            Column::new("id", StreamType::Uint64),
            Column::new("name", StreamType::Optional(Box::new(StreamType::Utf8))),
        ]
    }

    #[test]
    fn a_jsonl_file_config_and_its_yaml_give_the_same_parameters() {
        let yaml = PipelineSpec::from_yaml(
            "pipeline: p\npartitions: 2\nsource:\n  class: jsonl_file\n  parameters:\n    files: [a.jsonl, b.jsonl]\n    schema: [{name: id, type: uint64}, {name: name, type: optional<utf8>}]\n    stream_id: events\n    on_bad_record: dead_letter\nsinks:\n  - {name: out, sink_class_name: DebugSink, input_stream_ids: [events], parameters: {path: out.jsonl}}\n",
        )
        .unwrap();
        let config = JsonlFileParams::new(["a.jsonl", "b.jsonl"], jsonl_schema())
            .stream_id("events")
            .on_bad_record(OnBadRecord::DeadLetter);
        let code = PipelineSpec::builder("p")
            .partitions(2)
            .source(config.clone())
            .sink("out", ["events"], DebugSinkConfig::new("out.jsonl"))
            .build();
        let from_yaml: JsonlFileParams =
            parse_parameters(&yaml.source.parameters, "parameters").unwrap();
        let from_code: JsonlFileParams =
            parse_parameters(&code.source.parameters, "parameters").unwrap();
        assert_eq!(from_yaml, config);
        assert_eq!(from_code, config);
        assert_eq!(code.source.class, "jsonl_file");
        assert!(config.validate().is_empty());
        assert!(Registry::with_builtins().build(&code).is_ok());
    }

    #[test]
    fn jsonl_file_mistakes_in_code_are_the_violations_of_the_same_mistakes_in_yaml() {
        let yaml = PipelineSpec::from_yaml(
            "pipeline: p\nsource:\n  class: jsonl_file\n  parameters: {files: [a.jsonl], schema: [{name: id, type: uint64}, {name: name, type: optional<utf8>}], stream_id: 'bad id', max_record_bytes: 0}\nsinks:\n  - {name: out, sink_class_name: DebugSink, input_stream_ids: [rows], parameters: {path: out.jsonl}}\n",
        )
        .unwrap();
        let config = JsonlFileParams::new(["a.jsonl"], jsonl_schema())
            .stream_id("bad id")
            .max_record_bytes(0);
        let expected = vec![
            Violation::new(
                "parameters.max_record_bytes",
                "0 is out of range 1..=1073741824",
            ),
            Violation::new("parameters.stream_id", "`bad id` is not a valid stream id"),
        ];
        assert_eq!(config.validate(), expected);
        // The unknown stream `bad id` is the sink's violation, not the source's.
        assert_eq!(registry_violations(&yaml, "source."), expected);
        let code = PipelineSpec::builder("p")
            .source(config)
            .sink("out", ["rows"], DebugSinkConfig::new("out.jsonl"))
            .build();
        assert_eq!(registry_violations(&code, "source."), expected);
    }

    #[test]
    fn the_file_count_of_jsonl_file_is_checked_against_the_partitions_by_the_registry() {
        let config = JsonlFileParams::new(["a.jsonl"], jsonl_schema());
        assert!(config.validate().is_empty());
        let code = PipelineSpec::builder("p")
            .partitions(2)
            .source(config)
            .sink("out", ["rows"], DebugSinkConfig::new("out.jsonl"))
            .build();
        assert_eq!(
            registry_violations(&code, "source."),
            vec![Violation::new(
                "parameters.files",
                "1 file(s) for 2 partition(s): jsonl_file reads one file per partition, so set `partitions: 1`"
            )]
        );
    }

    #[test]
    fn a_project_config_gives_the_yaml_parameters_and_its_violations() {
        let spec = |columns: &str| {
            PipelineSpec::from_yaml(&format!(
                "pipeline: p\nsource: {{class: generator, parameters: {{count: 1}}}}\nprocessors:\n  - {{name: keep, class: project, input_stream_id: rows, output_stream_id: kept, parameters: {{columns: {columns}}}}}\nsinks:\n  - {{name: out, sink_class_name: DebugSink, input_stream_ids: [rows], parameters: {{path: out.jsonl}}}}\n"
            ))
            .unwrap()
        };
        let code = |config: ProjectParams| {
            PipelineSpec::builder("p")
                .source(GeneratorParams::new(1))
                .processor("keep", "rows", "kept", config)
                // Reading `rows`, the sink does not depend on the processor being valid.
                .sink("out", ["rows"], DebugSinkConfig::new("out.jsonl"))
                .build()
        };
        let good = ProjectParams::new(["user_id", "ts"]);
        assert_eq!(
            code(good.clone()).processors,
            spec("[user_id, ts]").processors
        );
        assert!(good.validate().is_empty());
        for (columns, config) in [
            ("[]", ProjectParams::new(Vec::<String>::new())),
            ("[ts, ts]", ProjectParams::new(["ts", "ts"])),
        ] {
            let expected = registry_violations(&spec(columns), "processors[0].");
            assert_eq!(config.validate(), expected, "{columns}");
            assert_eq!(
                registry_violations(&code(config), "processors[0]."),
                expected
            );
        }
        assert_eq!(
            ProjectParams::new(["ts", "ts"]).validate(),
            vec![Violation::new(
                "parameters.columns",
                "column `ts` is declared twice"
            )]
        );
    }

    #[test]
    fn a_debug_sink_config_and_its_yaml_give_the_same_parameters_and_violations() {
        let yaml = |dynamic: &str| {
            PipelineSpec::from_yaml(&format!(
                "pipeline: p\nsource: {{class: generator, parameters: {{count: 1}}}}\nsinks:\n  - {{name: out, sink_class_name: DebugSink, input_stream_ids: [rows], parameters: {{path: out.jsonl}}, dynamic_parameters: {dynamic}}}\n"
            ))
            .unwrap()
        };
        let config = DebugSinkConfig::new("out.jsonl").max_rows_per_batch(500);
        let code = generator_spec(GeneratorParams::new(1));
        let code = PipelineSpec {
            sinks: vec![config.sink_spec("out", vec!["rows".to_owned()])],
            ..code
        };
        let from_yaml = yaml("{max_rows_per_batch: 500}");
        assert_eq!(code.sinks[0].parameters, from_yaml.sinks[0].parameters);
        let parsed: DebugSinkDynamicParams =
            parse_parameters(&from_yaml.sinks[0].dynamic_parameters, "dynamic_parameters").unwrap();
        assert_eq!(parsed, config.dynamic_parameters);
        assert_eq!(code.sinks, from_yaml.sinks);
        assert!(config.validate().is_empty());

        let wrong = config.max_rows_per_batch(0);
        let expected = vec![Violation::new(
            "dynamic_parameters.max_rows_per_batch",
            "0 is out of range 1..=1000000",
        )];
        assert_eq!(wrong.validate(), expected);
        assert_eq!(
            registry_violations(&yaml("{max_rows_per_batch: 0}"), "sinks[0]."),
            expected
        );
        let empty = DebugSinkConfig::new("");
        assert_eq!(
            empty.validate(),
            vec![Violation::new(
                "parameters.path",
                "set a file path, or `-` for stdout"
            )]
        );
    }

    #[test]
    fn every_spec_key_set_in_code_gives_the_spec_of_the_same_yaml() {
        let yaml = PipelineSpec::from_yaml(
            "pipeline: full\npartitions: 3\nstate_dir: /var/lib/flow\nepoch: {max_messages: 500, max_duration_ms: 250}\noutbox: {payloads: always}\nshutdown: {drain_timeout_ms: 0}\nmetrics: {listen: '127.0.0.1:9464'}\nsource: {class: generator, parameters: {count: 10, rate_per_second: 100, payload_bytes: 4}}\nprocessors:\n  - {name: keep, class: project, input_stream_id: rows, output_stream_id: kept, parameters: {columns: [id, payload]}}\nsinks:\n  - {name: a, sink_class_name: DebugSink, input_stream_ids: [kept], parameters: {path: a.jsonl}, dynamic_parameters: {max_rows_per_batch: 10000}}\n  - {name: b, sink_class_name: DebugSink, input_stream_ids: [rows, kept], parameters: {path: '-'}, dynamic_parameters: {max_rows_per_batch: 7}}\n",
        )
        .unwrap();
        let code = PipelineSpec::builder("full")
            .partitions(3)
            .state_dir("/var/lib/flow")
            .epoch(EpochSpec {
                max_messages: 500,
                max_duration_ms: 250,
            })
            .outbox(OutboxSpec {
                payloads: PayloadPolicy::Always,
            })
            .shutdown(ShutdownSpec {
                drain_timeout_ms: 0,
            })
            .metrics(MetricsSpec {
                listen: "127.0.0.1:9464".to_owned(),
            })
            .source(
                GeneratorParams::new(10)
                    .rate_per_second(100)
                    .payload_bytes(4),
            )
            .processor(
                "keep",
                "rows",
                "kept",
                ProjectParams::new(["id", "payload"]),
            )
            .sink("a", ["kept"], DebugSinkConfig::new("a.jsonl"))
            .sink(
                "b",
                ["rows", "kept"],
                DebugSinkConfig::new("-").max_rows_per_batch(7),
            )
            .build();
        assert_eq!(code, yaml);
        assert!(Registry::with_builtins().build(&code).is_ok());
    }

    #[test]
    fn a_spec_built_in_code_has_the_yaml_defaults() {
        let yaml = PipelineSpec::from_yaml(
            "pipeline: p\nsource: {class: generator, parameters: {count: 1, rate_per_second: 0, payload_bytes: 16}}\nsinks:\n  - {name: out, sink_class_name: DebugSink, input_stream_ids: [rows], parameters: {path: out.jsonl}, dynamic_parameters: {max_rows_per_batch: 10000}}\n"
        )
        .unwrap();
        assert_eq!(generator_spec(GeneratorParams::new(1)), yaml);
    }
}
