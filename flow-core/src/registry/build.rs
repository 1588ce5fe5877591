//! [`Registry::build`]: a parsed spec validated and its plugins built by class name, every
//! violation reported with its path.

use std::collections::{BTreeMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use super::classes::{
    ProcessorBuildContext, Registry, SinkBuildContext, SourceBuildContext, SourceSubjects,
};
use crate::error::{SpecError, Violation};
use crate::plugin::SourceFactory;
use crate::spec::{
    is_valid_name, EpochSettings, PayloadPolicy, PipelineSpec, ProcessorSpec, SinkSpec,
    ValidatedPipeline, ValidatedProcessor, ValidatedSink, MAX_DRAIN_TIMEOUT_MS,
    MAX_EPOCH_DURATION_MS, MAX_EPOCH_MESSAGES, MAX_PARTITIONS,
};
use crate::types::StreamSchema;

impl Registry {
    /// Validates a parsed spec and builds its plugins, reporting every violation with its path.
    pub fn build(&self, spec: &PipelineSpec) -> Result<ValidatedPipeline, SpecError> {
        let mut build = Build {
            registry: self,
            spec,
            partitions: spec.partitions.clamp(1, MAX_PARTITIONS),
            violations: Vec::new(),
            streams: BTreeMap::new(),
        };
        build.check_settings();
        let metrics = spec
            .metrics
            .as_ref()
            .and_then(|m| m.validate(&mut build.violations));
        let cluster = spec
            .cluster
            .as_ref()
            .and_then(|c| c.validate(&mut build.violations));
        let source = build.source();
        let processors = build.processors();
        let sinks = build.sinks(source.as_deref());
        if let (Some(_), Some(source)) = (&cluster, &source) {
            build.check_cluster_outbox(source.as_ref());
        }
        let Build {
            partitions,
            violations,
            streams,
            ..
        } = build;
        match source {
            Some(source) if violations.is_empty() => Ok(ValidatedPipeline {
                name: spec.pipeline.clone(),
                partitions,
                state_dir: spec.state_dir.clone(),
                epoch: EpochSettings::of(&spec.epoch),
                payloads: spec.outbox.payloads,
                drain_timeout: Duration::from_millis(spec.shutdown.drain_timeout_ms),
                metrics,
                cluster,
                source,
                processors,
                sinks,
                streams,
                spec: spec.clone(),
            }),
            _ => Err(SpecError {
                violations: spec.from_environment.redacted(violations),
            }),
        }
    }

    /// Parses and builds a spec from YAML text.
    pub fn build_yaml(&self, text: &str) -> Result<ValidatedPipeline, SpecError> {
        self.build(&PipelineSpec::from_yaml(text)?)
    }
}

/// One [`Registry::build`] of `spec`: the violations found so far, and the streams its source
/// and processors defined so far (a processor or sink may name only those).
struct Build<'a> {
    registry: &'a Registry,
    spec: &'a PipelineSpec,
    /// `partitions`, clamped to its range so that plugins build even when it is out of range.
    partitions: u32,
    violations: Vec<Violation>,
    streams: BTreeMap<String, Arc<StreamSchema>>,
}

impl Build<'_> {
    fn violation(&mut self, path: impl Into<String>, message: impl Into<String>) {
        self.violations.push(Violation::new(path, message));
    }

    /// A `kind` class the registry does not know, at `path`, with the classes it knows.
    fn unknown_class(&mut self, path: impl Into<String>, kind: &str, class: &str, known: &[&str]) {
        let known = known.join(", ");
        self.violation(
            path,
            format!("unknown {kind} class `{class}`; known classes: {known}"),
        );
    }

    /// The spec's own settings: its name, partitions, epoch, state directory and drain bound.
    fn check_settings(&mut self) {
        let spec = self.spec;
        if !is_valid_name(&spec.pipeline) {
            self.violation(
                "pipeline",
                format!(
                    "`{}` is not a valid pipeline name: use letters, digits, `_` and `-`",
                    spec.pipeline
                ),
            );
        }
        if spec.partitions == 0 || spec.partitions > MAX_PARTITIONS {
            self.violation(
                "partitions",
                format!("{} is out of range 1..={MAX_PARTITIONS}", spec.partitions),
            );
        }
        if spec.epoch.max_messages == 0 || spec.epoch.max_messages > MAX_EPOCH_MESSAGES {
            self.violation(
                "epoch.max_messages",
                format!(
                    "{} is out of range 1..={MAX_EPOCH_MESSAGES}",
                    spec.epoch.max_messages
                ),
            );
        }
        if spec.epoch.max_duration_ms == 0 || spec.epoch.max_duration_ms > MAX_EPOCH_DURATION_MS {
            self.violation(
                "epoch.max_duration_ms",
                format!(
                    "{} is out of range 1..={MAX_EPOCH_DURATION_MS}",
                    spec.epoch.max_duration_ms
                ),
            );
        }
        if spec
            .state_dir
            .as_ref()
            .is_some_and(|dir| dir.as_os_str().is_empty())
        {
            self.violation(
                "state_dir",
                "an empty path; name a directory (for example `./flow-state`), or remove the key and pass --state-dir",
            );
        }
        if spec.shutdown.drain_timeout_ms > MAX_DRAIN_TIMEOUT_MS {
            self.violation(
                "shutdown.drain_timeout_ms",
                format!(
                    "{} is out of range 0..={MAX_DRAIN_TIMEOUT_MS}",
                    spec.shutdown.drain_timeout_ms
                ),
            );
        }
    }

    /// The source's factory, built by its class; its stream is the first one defined.
    fn source(&mut self) -> Option<Arc<dyn SourceFactory>> {
        let spec = self.spec;
        let Some(builder) = self.registry.source(&spec.source.class) else {
            let known = self.registry.source_classes();
            self.unknown_class("source.class", "source", &spec.source.class, &known);
            return None;
        };
        let ctx = SourceBuildContext {
            pipeline: &spec.pipeline,
            partitions: self.partitions,
            paths: spec.paths(),
        };
        match builder(&ctx, &spec.source.parameters) {
            Ok(factory) => {
                self.violations.extend(epoch_too_short(
                    factory.as_ref(),
                    spec.epoch.max_duration_ms,
                ));
                self.streams
                    .insert(factory.stream_id().to_owned(), factory.schema());
                Some(factory)
            }
            Err(errs) => {
                self.violations
                    .extend(errs.into_iter().map(|v| v.under("source")));
                None
            }
        }
    }

    /// The processors, in the spec's order: each reads a stream defined before it and defines
    /// its output stream.
    fn processors(&mut self) -> Vec<ValidatedProcessor> {
        let spec = self.spec;
        let mut processors = Vec::new();
        let mut names = HashSet::new();
        for (i, p) in spec.processors.iter().enumerate() {
            let path = format!("processors[{i}]");
            if !is_valid_name(&p.name) {
                self.violation(
                    format!("{path}.name"),
                    format!(
                        "`{}` is not a valid name: use letters, digits, `_` and `-`",
                        p.name
                    ),
                );
            } else if !names.insert(p.name.as_str()) {
                self.violation(
                    format!("{path}.name"),
                    format!("processor name `{}` is used twice", p.name),
                );
            }
            processors.extend(self.processor(p, &path));
        }
        processors
    }

    /// One processor at `path`, built by its class once its input and output streams check out.
    fn processor(&mut self, p: &ProcessorSpec, path: &str) -> Option<ValidatedProcessor> {
        let Some(input_schema) = self.streams.get(&p.input_stream_id).cloned() else {
            let known = known(&self.streams);
            self.violation(
                format!("{path}.input_stream_id"),
                format!(
                    "unknown stream `{}`; streams defined before this processor: {known}",
                    p.input_stream_id
                ),
            );
            return None;
        };
        if self.streams.contains_key(&p.output_stream_id) {
            self.violation(
                format!("{path}.output_stream_id"),
                format!("stream `{}` is already defined", p.output_stream_id),
            );
            return None;
        }
        let Some(builder) = self.registry.processor(&p.class) else {
            let known = self.registry.processor_classes();
            self.unknown_class(format!("{path}.class"), "processor", &p.class, &known);
            return None;
        };
        let ctx = ProcessorBuildContext {
            pipeline: &self.spec.pipeline,
            name: &p.name,
            input_schema: &input_schema,
        };
        match builder(&ctx, &p.parameters) {
            Ok(factory) => {
                self.streams
                    .insert(p.output_stream_id.clone(), factory.output_schema());
                Some(ValidatedProcessor {
                    name: p.name.clone(),
                    factory,
                    input_stream_id: p.input_stream_id.clone(),
                    output_stream_id: p.output_stream_id.clone(),
                })
            }
            Err(errs) => {
                self.violations
                    .extend(errs.into_iter().map(|v| v.under(path)));
                None
            }
        }
    }

    /// The sinks, each built by its class on the streams it names (`source`: the source's
    /// factory, when it built).
    fn sinks(&mut self, source: Option<&dyn SourceFactory>) -> Vec<ValidatedSink> {
        let spec = self.spec;
        if spec.sinks.is_empty() {
            self.violation("sinks", "a pipeline needs at least one sink");
        }
        // Every partition's subject, or none when the source has none (all or nothing: a
        // source reports a subject for each of its partitions or for none).
        let subjects: Option<Vec<String>> =
            source.and_then(|source| (0..self.partitions).map(|p| source.subject(p)).collect());
        let subjects = match (source, &subjects) {
            (Some(_), Some(subjects)) => SourceSubjects::Known(subjects),
            (Some(_), None) => SourceSubjects::None {
                source_class: &spec.source.class,
            },
            (None, _) => SourceSubjects::Unknown,
        };
        let mut sinks = Vec::new();
        let mut names = HashSet::new();
        for (i, s) in spec.sinks.iter().enumerate() {
            let path = format!("sinks[{i}]");
            if !is_valid_name(&s.name) {
                self.violation(
                    format!("{path}.name"),
                    format!(
                        "`{}` is not a valid sink name: use letters, digits, `_` and `-`",
                        s.name
                    ),
                );
            } else if !names.insert(s.name.as_str()) {
                self.violation(
                    format!("{path}.name"),
                    format!(
                        "sink name `{}` is used twice; each sink names its own state",
                        s.name
                    ),
                );
            }
            sinks.extend(self.sink(s, &path, source.is_some(), subjects));
        }
        sinks
    }

    /// One sink at `path`, built by its class even when an input is unresolved, so that its
    /// parameters' mistakes are reported too.
    fn sink(
        &mut self,
        s: &SinkSpec,
        path: &str,
        source_built: bool,
        subjects: SourceSubjects<'_>,
    ) -> Option<ValidatedSink> {
        let (inputs, resolved) = self.sink_inputs(s, path, source_built);
        let Some(builder) = self.registry.sink(&s.sink_class_name) else {
            let known = self.registry.sink_classes();
            let path = format!("{path}.sink_class_name");
            self.unknown_class(path, "sink", &s.sink_class_name, &known);
            return None;
        };
        let ctx = SinkBuildContext {
            pipeline: &self.spec.pipeline,
            sink: &s.name,
            class: &s.sink_class_name,
            partitions: self.partitions,
            epoch: EpochSettings::of(&self.spec.epoch),
            inputs: &inputs,
            subjects,
            paths: self.spec.paths(),
        };
        match builder(&ctx, &s.parameters, &s.dynamic_parameters) {
            Ok(_) if !resolved => None,
            Ok(factory) => Some(ValidatedSink {
                name: s.name.clone(),
                class: s.sink_class_name.clone(),
                factory,
                input_stream_ids: s.input_stream_ids.clone(),
                dynamic_parameters: s.dynamic_parameters.clone(),
            }),
            // An unresolved input is already explained (an unknown stream, or a source that
            // failed to build); the sink's view of its empty input list would only mislead.
            Err(errs) => {
                self.violations.extend(
                    errs.into_iter()
                        .filter(|v| resolved || !v.path.starts_with("input_stream_ids"))
                        .map(|v| v.under(path)),
                );
                None
            }
        }
    }

    /// The streams sink `s` names, and whether every one of them is defined.
    fn sink_inputs(
        &mut self,
        s: &SinkSpec,
        path: &str,
        source_built: bool,
    ) -> (Vec<(String, Arc<StreamSchema>)>, bool) {
        if s.input_stream_ids.is_empty() {
            self.violation(
                format!("{path}.input_stream_ids"),
                "a sink needs at least one input stream",
            );
        }
        let mut inputs = Vec::new();
        let mut resolved = true;
        for (j, id) in s.input_stream_ids.iter().enumerate() {
            if let Some(schema) = self.streams.get(id) {
                inputs.push((id.clone(), Arc::clone(schema)));
                continue;
            }
            resolved = false;
            // An unknown source class already explains a missing stream.
            if source_built {
                let known = known(&self.streams);
                self.violation(
                    format!("{path}.input_stream_ids[{j}]"),
                    format!("unknown stream `{id}`; known streams: {known}"),
                );
            }
        }
        (inputs, resolved)
    }

    /// A cluster keeps only batch bounds in ZooKeeper: the source must re-read a committed
    /// range, and the outbox keep bounds.
    fn check_cluster_outbox(&mut self, source: &dyn SourceFactory) {
        let spec = self.spec;
        if spec.outbox.payloads != PayloadPolicy::Auto || !source.replayable() {
            self.violation(
                "cluster",
                format!(
                    "a cluster keeps only batch bounds in ZooKeeper, but this outbox would keep batch payloads (the source `{}` cannot re-read a committed range, or `outbox.payloads` is not `auto`); remove `cluster` to run in one process",
                    spec.source.class
                ),
            );
        }
    }
}

/// The violation of an `epoch.max_duration_ms` shorter than the source reads under
/// ([`SourceFactory::min_epoch_duration`]); a 0 is already out of range.
fn epoch_too_short(source: &dyn SourceFactory, max_duration_ms: u64) -> Option<Violation> {
    let (min, reason) = source.min_epoch_duration()?;
    let min_ms = u64::try_from(min.as_millis()).unwrap_or(u64::MAX);
    (max_duration_ms != 0 && max_duration_ms < min_ms).then(|| {
        Violation::new(
            "epoch.max_duration_ms",
            format!(
                "{max_duration_ms} is too short for this source: {reason}; set at least {min_ms}"
            ),
        )
    })
}

fn known(streams: &BTreeMap<String, Arc<StreamSchema>>) -> String {
    if streams.is_empty() {
        "none".to_owned()
    } else {
        streams.keys().cloned().collect::<Vec<_>>().join(", ")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::registry::SinkBuildContext;
    use crate::spec::EpochSpec;

    fn paths(err: &SpecError) -> Vec<&str> {
        err.violations.iter().map(|v| v.path.as_str()).collect()
    }

    #[test]
    fn minimal_spec_gets_documented_defaults() {
        let spec = PipelineSpec::from_yaml(
            "pipeline: p\nsource: {class: generator}\nsinks:\n  - {name: out, sink_class_name: DebugSink, input_stream_ids: [rows]}\n",
        )
        .unwrap();
        assert_eq!(spec.partitions, 1);
        assert_eq!(
            spec.epoch,
            EpochSpec {
                max_messages: 10_000,
                max_duration_ms: 500
            }
        );
        assert_eq!(spec.state_dir, None);
    }

    #[test]
    fn structural_mistakes_in_separate_sections_are_all_reported() {
        let err = PipelineSpec::from_yaml(
            "pipeline: p\npartitions: many\nbogus: 1\nsource: {class: generator, params: {}}\nsinks:\n  - {name: a, sink_class_name: DebugSink, input_stream_ids: rows}\n  - {name: b, sink_class_name: DebugSink, input_stream_ids: [rows], extra: 1}\n",
        )
        .unwrap_err();
        assert_eq!(
            paths(&err),
            vec![
                "bogus",
                "partitions",
                "source.params",
                "sinks[0].input_stream_ids",
                "sinks[1].extra"
            ]
        );
        assert!(
            err.violations[2].message.contains("unknown field `params`"),
            "{err}"
        );
    }

    #[test]
    fn every_unknown_parameter_of_a_plugin_is_reported_at_its_path() {
        let spec = PipelineSpec::from_yaml(
            "pipeline: p\nsource: {class: generator, parameters: {count: 1, cuont: 2}}\nsinks:\n  - {name: a, sink_class_name: DebugSink, input_stream_ids: [rows], parameters: {path: x, pth: y, tabel: z}, dynamic_parameters: {max_rows: 1, max_rows_per_btch: 2}}\n",
        )
        .unwrap();
        let err = Registry::with_builtins().build(&spec).err().unwrap();
        assert_eq!(
            paths(&err),
            vec![
                "source.parameters.cuont",
                "sinks[0].parameters.pth",
                "sinks[0].parameters.tabel",
                "sinks[0].dynamic_parameters.max_rows",
                "sinks[0].dynamic_parameters.max_rows_per_btch"
            ]
        );
        assert!(
            err.violations[2]
                .message
                .starts_with("unknown field `tabel`, expected `path`"),
            "{err}"
        );
    }

    #[test]
    fn every_unknown_key_of_a_spec_entry_is_reported() {
        let err = PipelineSpec::from_yaml(
            "pipeline: p\nsource: {class: generator}\nsinks:\n  - {name: a, sink_class_name: DebugSink, input_stream_ids: [rows], parameter: {}, extra: 1}\n",
        )
        .unwrap_err();
        assert_eq!(paths(&err), vec!["sinks[0].parameter", "sinks[0].extra"]);
    }

    #[test]
    fn semantic_mistakes_are_all_reported_with_paths() {
        let registry = Registry::with_builtins();
        let spec = PipelineSpec::from_yaml(
            "pipeline: 'bad name'\npartitions: 0\nepoch: {max_messages: 0}\nsource: {class: generator, parameters: {count: 5}}\nsinks:\n  - {name: a, sink_class_name: Nope, input_stream_ids: [rows]}\n  - {name: a, sink_class_name: DebugSink, input_stream_ids: [nope]}\n",
        )
        .unwrap();
        let err = registry.build(&spec).err().unwrap();
        assert_eq!(
            paths(&err),
            vec![
                "pipeline",
                "partitions",
                "epoch.max_messages",
                "sinks[0].sink_class_name",
                "sinks[1].name",
                "sinks[1].input_stream_ids[0]",
                // Built despite the unknown input, so its missing `path` is reported too.
                "sinks[1].parameters"
            ]
        );
    }

    const DEBUG_SINK: &str = "sinks:\n  - {name: out, sink_class_name: DebugSink, input_stream_ids: [rows], parameters: {path: x}}\n";

    #[test]
    fn a_utf8_byte_order_mark_before_the_spec_is_accepted() {
        let text = format!("\u{feff}pipeline: p\nsource: {{class: generator}}\n{DEBUG_SINK}");
        let spec = PipelineSpec::from_yaml(&text).unwrap();
        assert_eq!(spec.pipeline, "p");
    }

    #[test]
    fn a_deeply_nested_spec_is_refused_before_parsing_and_fast() {
        let text = format!(
            "pipeline: p\nsource: {{class: generator, parameters: {}}}\n{DEBUG_SINK}",
            "[".repeat(200_000)
        );
        let started = std::time::Instant::now();
        let err = PipelineSpec::from_yaml(&text).unwrap_err();
        assert!(
            started.elapsed() < Duration::from_secs(2),
            "{:?}",
            started.elapsed()
        );
        assert_eq!(
            err.violations,
            vec![Violation::new(
                "",
                "the spec is nested more than 64 levels deep (line 2); a pipeline spec never needs that many"
            )]
        );
    }

    #[test]
    fn partitions_beyond_64_bits_are_out_of_range_not_invalid_yaml() {
        let text = format!(
            "pipeline: p\npartitions: 1000000000000000000000000000000\nsource: {{class: generator}}\n{DEBUG_SINK}"
        );
        let err = PipelineSpec::from_yaml(&text).unwrap_err();
        assert_eq!(
            err.violations,
            vec![Violation::new(
                "partitions",
                "1000000000000000000000000000000 is out of range 1..=1024"
            )]
        );
        let nested = format!(
            "pipeline: p\nsource:\n  class: generator\n  parameters:\n    count: 99999999999999999999999\n{DEBUG_SINK}"
        );
        let err = PipelineSpec::from_yaml(&nested).unwrap_err();
        assert_eq!(
            err.violations[0].message,
            "`count` at line 5 column 12: 99999999999999999999999 is out of range of any parameter (it does not fit in 64 bits)"
        );
    }

    #[test]
    fn an_empty_state_dir_is_a_violation() {
        let text =
            format!("pipeline: p\nstate_dir: \"\"\nsource: {{class: generator, parameters: {{count: 1}}}}\n{DEBUG_SINK}");
        let spec = PipelineSpec::from_yaml(&text).unwrap();
        let err = Registry::with_builtins().build(&spec).err().unwrap();
        assert_eq!(paths(&err), vec!["state_dir"]);
        assert!(
            err.violations[0].message.starts_with("an empty path"),
            "{err}"
        );
    }

    #[test]
    fn a_failed_source_does_not_also_make_the_sinks_input_list_wrong() {
        let mut registry = Registry::with_builtins();
        // Like the ClickHouse sinks: exactly one input stream.
        registry.register_sink(
            "OneInput",
            Arc::new(
                |ctx: &SinkBuildContext<'_>, _: &serde_yaml::Value, _: &serde_yaml::Value| {
                    Err(vec![Violation::new(
                        "input_stream_ids",
                        format!("exactly one stream; {} are listed", ctx.inputs.len()),
                    )])
                },
            ),
        );
        let spec = PipelineSpec::from_yaml(
            "pipeline: p\nsource: {class: generator, parameters: {count: -1}}\nsinks:\n  - {name: out, sink_class_name: OneInput, input_stream_ids: [rows]}\n",
        )
        .unwrap();
        let err = registry.build(&spec).err().unwrap();
        assert_eq!(paths(&err), vec!["source.parameters.count"]);
    }

    #[test]
    fn sinks_are_told_whether_the_source_has_subjects() {
        let mut registry = Registry::with_builtins();
        // Says what it was told, as a violation.
        registry.register_sink(
            "Told",
            Arc::new(
                |ctx: &SinkBuildContext<'_>, _: &serde_yaml::Value, _: &serde_yaml::Value| {
                    Err(vec![Violation::new(
                        "parameters",
                        format!("{:?}", ctx.subjects),
                    )])
                },
            ),
        );
        let told = |source: &str| {
            let spec = format!("pipeline: p\nsource: {source}\nsinks:\n  - {{name: out, sink_class_name: Told, input_stream_ids: [rows]}}\n");
            let err = registry.build_yaml(&spec).err().unwrap();
            err.violations
                .iter()
                .map(|v| format!("{}: {}", v.path, v.message))
                .collect::<Vec<_>>()
        };
        assert_eq!(
            told("{class: generator, parameters: {count: 1}}"),
            ["sinks[0].parameters: None { source_class: \"generator\" }"]
        );
        assert_eq!(
            told("{class: generator, parameters: {count: -1}}")[1],
            "sinks[0].parameters: Unknown"
        );
    }

    #[test]
    fn the_metrics_listen_address_is_validated_and_its_mistakes_name_their_path() {
        let spec = |metrics: &str| {
            format!("pipeline: p\nmetrics: {metrics}\nsource: {{class: generator, parameters: {{count: 1}}}}\n{DEBUG_SINK}")
        };
        let registry = Registry::with_builtins();
        let built = registry
            .build_yaml(&spec("{listen: '127.0.0.1:9464'}"))
            .unwrap();
        assert_eq!(
            built.metrics.map(|m| m.listen.to_string()).as_deref(),
            Some("127.0.0.1:9464")
        );
        let err = registry
            .build_yaml(&spec("{listen: 'localhost'}"))
            .err()
            .unwrap();
        assert_eq!(paths(&err), vec!["metrics.listen"]);
        let err = PipelineSpec::from_yaml(&spec("{listen: '127.0.0.1:1', port: 2}")).unwrap_err();
        assert_eq!(paths(&err), vec!["metrics.port"]);
        let none = registry.build_yaml(&spec("null")).unwrap();
        assert_eq!(none.metrics, None);
    }

    #[test]
    fn the_cluster_section_is_parsed_once_and_its_mistakes_name_their_path() {
        let spec = |cluster: &str, outbox: &str| {
            format!(
                "pipeline: p
cluster: {cluster}
{outbox}source: {{class: generator, parameters: {{count: 1}}}}
{DEBUG_SINK}"
            )
        };
        let registry = Registry::with_builtins();
        let built = registry
            .build_yaml(&spec("{url: 'zk://127.0.0.1:2181,10.0.0.2:2181/flow'}", ""))
            .unwrap();
        let cluster = built.cluster.unwrap();
        assert_eq!(
            cluster.url.to_string(),
            "zk://127.0.0.1:2181,10.0.0.2:2181/flow"
        );
        assert_eq!(cluster.session_timeout, Duration::from_secs(10));
        let built = registry
            .build_yaml(&spec("{url: 'zk://h:1/x', session_timeout_ms: 4000}", ""))
            .unwrap();
        assert_eq!(
            built.cluster.unwrap().session_timeout,
            Duration::from_millis(4000)
        );

        let err = registry
            .build_yaml(&spec("{url: 'http://h:1/x', session_timeout_ms: 0}", ""))
            .err()
            .unwrap();
        assert_eq!(
            paths(&err),
            vec!["cluster.url", "cluster.session_timeout_ms"]
        );
        assert!(
            err.violations[1]
                .message
                .contains("0 is out of range 1..=120000"),
            "{err}"
        );
        let err =
            PipelineSpec::from_yaml(&spec("{url: 'zk://h:1/x', timeout: 1}", "")).unwrap_err();
        assert_eq!(paths(&err), vec!["cluster.timeout"]);
        // Payloads cannot live in ZooKeeper: a cluster needs an outbox of bounds.
        let err = registry
            .build_yaml(&spec("{url: 'zk://h:1/x'}", "outbox: {payloads: always}\n"))
            .err()
            .unwrap();
        assert_eq!(paths(&err), vec!["cluster"]);
        assert!(
            err.violations[0]
                .message
                .contains("remove `cluster` to run in one process"),
            "{err}"
        );
        assert_eq!(
            registry.build_yaml(&spec("null", "")).unwrap().cluster,
            None
        );
    }
}
