//! The pipeline spec: serde types (`PipelineSpec`), parsed so that every structural mistake is
//! reported with its path, then validated and built into a [`ValidatedPipeline`] — the only form the
//! runtime accepts. Static parameters need a restart to change; `dynamic_parameters` of a sink can
//! be swapped while the pipeline runs.

use std::collections::{BTreeMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

use crate::error::{SpecError, Violation};
use crate::plugin::{ProcessorFactory, SinkFactory, SourceFactory};
use crate::registry::{ProcessorBuildContext, Registry, SinkBuildContext, SourceBuildContext};
use crate::types::StreamSchema;

/// The most partitions a pipeline may have.
pub const MAX_PARTITIONS: u32 = 1024;
/// The largest `epoch.max_messages`.
pub const MAX_EPOCH_MESSAGES: u64 = 10_000_000;
/// The largest `epoch.max_duration_ms` (1 h).
pub const MAX_EPOCH_DURATION_MS: u64 = 3_600_000;
/// The largest `shutdown.drain_timeout_ms` (1 h).
pub const MAX_DRAIN_TIMEOUT_MS: u64 = 3_600_000;

/// A pipeline spec as written (YAML), before validation: [`PipelineSpec::from_yaml`] parses it,
/// [`Registry::build`] validates it into a [`ValidatedPipeline`].
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PipelineSpec {
    /// `[A-Za-z0-9_-]+`; namespaces the pipeline's state.
    pub pipeline: String,
    /// Independent partitions the source is read in, 1..=[`MAX_PARTITIONS`] (default 1).
    #[serde(default = "default_partitions")]
    pub partitions: u32,
    /// Where the outbox lives, relative to the working directory (`--state-dir` wins).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub state_dir: Option<PathBuf>,
    /// When an epoch (one atomic commit per partition) ends.
    #[serde(default)]
    pub epoch: EpochSpec,
    /// What the outbox keeps of sealed batches.
    #[serde(default, skip_serializing_if = "OutboxSpec::is_default")]
    pub outbox: OutboxSpec,
    /// What a graceful stop does.
    #[serde(default, skip_serializing_if = "ShutdownSpec::is_default")]
    pub shutdown: ShutdownSpec,
    /// The Prometheus endpoint; none when absent (`--metrics-addr` wins).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub metrics: Option<MetricsSpec>,
    /// Where the messages come from: the source class and its parameters.
    pub source: SourceSpec,
    /// Processors, each turning one stream into another.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub processors: Vec<ProcessorSpec>,
    /// The sinks; at least one.
    pub sinks: Vec<SinkSpec>,
}

fn default_partitions() -> u32 {
    1
}

/// `epoch:`: when an epoch ends (one atomic commit of a partition's position and sealed batches).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EpochSpec {
    /// An epoch ends after this many source messages...
    #[serde(default = "default_max_messages")]
    pub max_messages: u64,
    /// ...or after this long, whichever comes first.
    #[serde(default = "default_max_duration_ms")]
    pub max_duration_ms: u64,
}

fn default_max_messages() -> u64 {
    10_000
}

fn default_max_duration_ms() -> u64 {
    500
}

impl Default for EpochSpec {
    fn default() -> Self {
        EpochSpec {
            max_messages: default_max_messages(),
            max_duration_ms: default_max_duration_ms(),
        }
    }
}

/// What a graceful stop (SIGINT/SIGTERM) does.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ShutdownSpec {
    /// How long sinks may go on delivering pending batches after a stop was asked for; what is
    /// still pending then stays in the outbox for the next run (and is logged). 0: stop at once.
    #[serde(default = "default_drain_timeout_ms")]
    pub drain_timeout_ms: u64,
}

fn default_drain_timeout_ms() -> u64 {
    10_000
}

impl Default for ShutdownSpec {
    fn default() -> Self {
        ShutdownSpec {
            drain_timeout_ms: default_drain_timeout_ms(),
        }
    }
}

impl ShutdownSpec {
    fn is_default(&self) -> bool {
        *self == ShutdownSpec::default()
    }
}

/// `metrics: { listen: HOST:PORT }`: where the worker serves Prometheus text at `/metrics`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MetricsSpec {
    /// An IP address and port, e.g. `127.0.0.1:9464` (`0.0.0.0:9464` for every interface).
    pub listen: String,
}

/// The validated `metrics` section.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MetricsSettings {
    /// The address to listen on.
    pub listen: std::net::SocketAddr,
}

impl MetricsSpec {
    fn validate(&self, violations: &mut Vec<Violation>) -> Option<MetricsSettings> {
        match self.listen.parse() {
            Ok(listen) => Some(MetricsSettings { listen }),
            Err(_) => {
                violations.push(Violation::new(
                    "metrics.listen",
                    format!(
                        "`{}` is not an IP address and port; write for example 127.0.0.1:9464, or 0.0.0.0:9464 for every interface",
                        self.listen
                    ),
                ));
                None
            }
        }
    }
}

/// What the outbox keeps of a sealed batch.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OutboxSpec {
    /// Whether sealed batches keep their payloads (default `auto`).
    #[serde(default)]
    pub payloads: PayloadPolicy,
}

impl OutboxSpec {
    fn is_default(&self) -> bool {
        *self == OutboxSpec::default()
    }
}

/// Whether sealed batches keep their payloads in the outbox.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PayloadPolicy {
    /// Bounds only when the source can re-read a committed range and the sink can rebuild its
    /// batches from it; payloads otherwise.
    #[default]
    Auto,
    /// Always store payloads: for a replayable source whose data may change under a pending
    /// batch (a file edited or rotated in place), at the cost of writing every payload to disk.
    Always,
}

/// `source:`: the source's class and its parameters.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SourceSpec {
    /// A registered source class, e.g. `generator`, `jsonl_file`, `nats_jetstream`.
    pub class: String,
    /// The class's parameters, checked by its factory.
    #[serde(default)]
    pub parameters: serde_yaml::Value,
}

/// One entry of `processors:`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ProcessorSpec {
    /// Unique within the pipeline.
    pub name: String,
    /// A registered processor class, e.g. `project`.
    pub class: String,
    /// The stream it reads.
    pub input_stream_id: String,
    /// The stream it emits, which later processors and sinks name.
    pub output_stream_id: String,
    /// The class's parameters, checked by its factory.
    #[serde(default)]
    pub parameters: serde_yaml::Value,
}

/// One entry of `sinks:`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SinkSpec {
    /// Unique within the pipeline; names the sink's state.
    pub name: String,
    /// A registered sink class, e.g. `ClickHouseBatchingSink`.
    pub sink_class_name: String,
    /// The streams it writes (the source's `stream_id` or processors' output).
    pub input_stream_ids: Vec<String>,
    /// Static: a change needs a restart.
    #[serde(default)]
    pub parameters: serde_yaml::Value,
    /// Reloadable while the pipeline runs.
    #[serde(default)]
    pub dynamic_parameters: serde_yaml::Value,
}

const TOP_LEVEL_FIELDS: &[&str] = &[
    "pipeline",
    "partitions",
    "state_dir",
    "epoch",
    "outbox",
    "shutdown",
    "metrics",
    "source",
    "processors",
    "sinks",
];

impl PipelineSpec {
    /// Parses YAML, reporting every structural mistake (unknown field, wrong type, missing
    /// field) of each section with its path, not just the first one.
    ///
    /// Only the structure is checked here; [`Registry::build`] checks the values and each
    /// plugin's parameters.
    ///
    /// ```
    /// use flow_core::PipelineSpec;
    ///
    /// # fn main() -> Result<(), flow_core::SpecError> {
    /// let spec = PipelineSpec::from_yaml(
    ///     r#"
    /// pipeline: events
    /// partitions: 4
    /// source: {class: generator, parameters: {count: 1000}}
    /// sinks:
    ///   - {name: out, sink_class_name: DebugSink, input_stream_ids: [rows], parameters: {path: out.jsonl}}
    /// "#,
    /// )?;
    /// assert_eq!(spec.partitions, 4);
    ///
    /// // Every mistake is reported, each with its path.
    /// let Err(error) = PipelineSpec::from_yaml("pipeline: events\npartitions: four\nsinks: []\n")
    /// else {
    ///     panic!("a spec without a source was accepted");
    /// };
    /// let paths: Vec<&str> = error.violations.iter().map(|v| v.path.as_str()).collect();
    /// assert_eq!(paths, ["partitions", "source"]);
    /// # Ok(())
    /// # }
    /// ```
    pub fn from_yaml(text: &str) -> Result<PipelineSpec, SpecError> {
        let text = crate::spec_text::prepare(text).map_err(|violation| SpecError {
            violations: vec![violation],
        })?;
        let value: serde_yaml::Value = serde_yaml::from_str(text).map_err(|err| SpecError {
            violations: vec![yaml_violation(text, &err)],
        })?;
        let serde_yaml::Value::Mapping(map) = value else {
            return Err(SpecError {
                violations: vec![Violation::new("", "the spec must be a YAML mapping")],
            });
        };
        let mut violations = Vec::new();
        for key in map.keys() {
            match key.as_str() {
                Some(name) if TOP_LEVEL_FIELDS.contains(&name) => {}
                _ => violations.push(Violation::new(
                    yaml_key(key),
                    format!(
                        "unknown field; expected one of {}",
                        TOP_LEVEL_FIELDS.join(", ")
                    ),
                )),
            }
        }
        let get = |name: &str| map.get(serde_yaml::Value::String(name.to_owned()));
        let pipeline = required::<String>(get("pipeline"), "pipeline", &mut violations);
        let partitions = optional::<u32>(get("partitions"), "partitions", &mut violations)
            .map(|p| p.unwrap_or(1));
        let state_dir = optional::<PathBuf>(get("state_dir"), "state_dir", &mut violations);
        let epoch = optional::<EpochSpec>(get("epoch"), "epoch", &mut violations);
        let outbox = optional::<OutboxSpec>(get("outbox"), "outbox", &mut violations);
        let shutdown = optional::<ShutdownSpec>(get("shutdown"), "shutdown", &mut violations);
        let metrics = optional::<MetricsSpec>(get("metrics"), "metrics", &mut violations).flatten();
        let source = required::<SourceSpec>(get("source"), "source", &mut violations);
        let processors = list::<ProcessorSpec>(get("processors"), "processors", &mut violations);
        let sinks = match get("sinks") {
            None => {
                violations.push(Violation::new("sinks", "required field is missing"));
                None
            }
            some => list::<SinkSpec>(some, "sinks", &mut violations),
        };
        if !violations.is_empty() {
            return Err(SpecError { violations });
        }
        match (
            pipeline, partitions, state_dir, epoch, outbox, shutdown, source, processors, sinks,
        ) {
            (
                Some(pipeline),
                Some(partitions),
                Some(state_dir),
                Some(epoch),
                Some(outbox),
                Some(shutdown),
                Some(source),
                Some(processors),
                Some(sinks),
            ) => Ok(PipelineSpec {
                pipeline,
                partitions,
                state_dir,
                epoch: epoch.unwrap_or_default(),
                outbox: outbox.unwrap_or_default(),
                shutdown: shutdown.unwrap_or_default(),
                metrics,
                source,
                processors,
                sinks,
            }),
            // Every `None` above pushed a violation, so this arm is only reached with some.
            _ => Err(SpecError {
                violations: vec![Violation::new("", "the spec is incomplete")],
            }),
        }
    }

    /// Reads and parses a spec file.
    pub fn from_file(path: &Path) -> Result<PipelineSpec, SpecError> {
        let text = std::fs::read_to_string(path).map_err(|err| SpecError {
            violations: vec![Violation::new(
                "",
                format!("cannot read the spec file `{}`: {err}", path.display()),
            )],
        })?;
        PipelineSpec::from_yaml(&text)
    }

    /// The spec with every `dynamic_parameters` section blanked: two specs with the same static
    /// part may be swapped at runtime.
    pub fn static_part(&self) -> PipelineSpec {
        let mut copy = self.clone();
        for sink in &mut copy.sinks {
            sink.dynamic_parameters = serde_yaml::Value::Null;
        }
        copy
    }
}

/// The violation for text the YAML parser refused. An integer beyond 64 bits is valid YAML that
/// the parser cannot hold: it is reported as out of range at its key, not as broken YAML.
fn yaml_violation(text: &str, err: &serde_yaml::Error) -> Violation {
    let message = err.to_string();
    const HUGE: &str = "invalid type: integer `";
    let huge = message
        .find(HUGE)
        .and_then(|at| message[at + HUGE.len()..].split_once('`'))
        .filter(|(_, rest)| rest.starts_with(" as u128") || rest.starts_with(" as i128"))
        .map(|(number, _)| number.to_owned());
    let (Some(number), Some(location)) = (huge, err.location()) else {
        return Violation::new("", format!("not valid YAML: {message}"));
    };
    let key = text
        .lines()
        .nth(location.line().saturating_sub(1))
        .and_then(|line| line.split_once(':'))
        .map(|(key, _)| key.trim().trim_start_matches("- ").to_owned())
        .filter(|key| is_valid_name(key));
    let range = match key.as_deref() {
        Some("partitions") => format!("1..={MAX_PARTITIONS}"),
        _ => "of any parameter (it does not fit in 64 bits)".to_owned(),
    };
    let at = format!("line {} column {}", location.line(), location.column());
    match key {
        // A top-level key names its path; a nested one is named by its line.
        Some(key) if TOP_LEVEL_FIELDS.contains(&key.as_str()) => {
            Violation::new(key, format!("{number} is out of range {range}"))
        }
        Some(key) => Violation::new(
            "",
            format!("`{key}` at {at}: {number} is out of range {range}"),
        ),
        None => Violation::new("", format!("{at}: {number} is out of range {range}")),
    }
}

fn yaml_key(key: &serde_yaml::Value) -> String {
    match key {
        serde_yaml::Value::String(s) => s.clone(),
        other => serde_yaml::to_string(other)
            .map(|s| s.trim().to_owned())
            .unwrap_or_else(|_| "?".to_owned()),
    }
}

fn parse_at<T: DeserializeOwned>(
    value: &serde_yaml::Value,
    path: &str,
    violations: &mut Vec<Violation>,
) -> Option<T> {
    match serde_path_to_error::deserialize::<_, T>(value.clone()) {
        Ok(parsed) => Some(parsed),
        Err(err) => {
            let inner = err.path().to_string();
            let full = if inner == "." || inner.is_empty() {
                path.to_owned()
            } else {
                format!("{path}.{inner}")
            };
            violations.push(Violation::new(full, err.into_inner().to_string()));
            None
        }
    }
}

fn required<T: DeserializeOwned>(
    value: Option<&serde_yaml::Value>,
    path: &str,
    violations: &mut Vec<Violation>,
) -> Option<T> {
    match value {
        Some(value) => parse_at(value, path, violations),
        None => {
            violations.push(Violation::new(path, "required field is missing"));
            None
        }
    }
}

/// `Some(None)` when absent, `Some(Some(v))` when valid, `None` after a violation.
fn optional<T: DeserializeOwned>(
    value: Option<&serde_yaml::Value>,
    path: &str,
    violations: &mut Vec<Violation>,
) -> Option<Option<T>> {
    match value {
        None | Some(serde_yaml::Value::Null) => Some(None),
        Some(value) => parse_at(value, path, violations).map(Some),
    }
}

/// Parses each element on its own, so a mistake in `sinks[0]` does not hide one in `sinks[1]`.
fn list<T: DeserializeOwned>(
    value: Option<&serde_yaml::Value>,
    path: &str,
    violations: &mut Vec<Violation>,
) -> Option<Vec<T>> {
    match value {
        None | Some(serde_yaml::Value::Null) => Some(Vec::new()),
        Some(serde_yaml::Value::Sequence(items)) => {
            let before = violations.len();
            let parsed: Vec<T> = items
                .iter()
                .enumerate()
                .filter_map(|(i, item)| parse_at(item, &format!("{path}[{i}]"), violations))
                .collect();
            (violations.len() == before).then_some(parsed)
        }
        Some(_) => {
            violations.push(Violation::new(path, "expected a list"));
            None
        }
    }
}

/// Epoch bounds after validation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EpochSettings {
    /// Messages per partition after which an epoch ends.
    pub max_messages: usize,
    /// Time after which an epoch ends.
    pub max_duration: Duration,
}

/// A processor of a validated spec, built by its factory.
pub struct ValidatedProcessor {
    /// Its name in the spec.
    pub name: String,
    /// Builds the processor of each partition.
    pub factory: Arc<dyn ProcessorFactory>,
    /// The stream it reads.
    pub input_stream_id: String,
    /// The stream it emits.
    pub output_stream_id: String,
}

/// A sink of a validated spec, built by its factory.
pub struct ValidatedSink {
    /// Its name in the spec.
    pub name: String,
    /// Its `sink_class_name`.
    pub class: String,
    /// Opens the sink of each partition.
    pub factory: Arc<dyn SinkFactory>,
    /// The streams it writes.
    pub input_stream_ids: Vec<String>,
    /// The `dynamic_parameters` it starts with.
    pub dynamic_parameters: serde_yaml::Value,
}

/// A spec that passed validation, with every plugin built (none has connected anywhere yet).
pub struct ValidatedPipeline {
    /// The pipeline's name.
    pub name: String,
    /// Its partition count.
    pub partitions: u32,
    /// The spec's `state_dir`, if any.
    pub state_dir: Option<PathBuf>,
    /// When an epoch ends.
    pub epoch: EpochSettings,
    /// Whether sealed batches keep their payloads.
    pub payloads: PayloadPolicy,
    /// How long a graceful stop lets sinks deliver what is pending.
    pub drain_timeout: Duration,
    /// The Prometheus endpoint of the spec, if any.
    pub metrics: Option<MetricsSettings>,
    /// Builds the source of each partition.
    pub source: Arc<dyn SourceFactory>,
    /// The processors, in spec order.
    pub processors: Vec<ValidatedProcessor>,
    /// The sinks, in spec order.
    pub sinks: Vec<ValidatedSink>,
    /// The schema of every stream, by stream id.
    pub streams: BTreeMap<String, Arc<StreamSchema>>,
    /// The spec it was built from.
    pub spec: PipelineSpec,
}

impl ValidatedPipeline {
    /// Whether the outbox keeps only the bounds of rebuildable batches: the source can re-read
    /// a committed range and the spec does not ask for payloads.
    pub fn stores_bounds(&self) -> bool {
        self.payloads == PayloadPolicy::Auto && self.source.replayable()
    }
}

/// `[A-Za-z0-9_-]+`, the alphabet of names that end up in state keys and tokens.
pub fn is_valid_name(name: &str) -> bool {
    !name.is_empty()
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
}

impl Registry {
    /// Validates a parsed spec and builds its plugins, reporting every violation with its path.
    pub fn build(&self, spec: &PipelineSpec) -> Result<ValidatedPipeline, SpecError> {
        let mut violations = Vec::new();
        if !is_valid_name(&spec.pipeline) {
            violations.push(Violation::new(
                "pipeline",
                format!(
                    "`{}` is not a valid pipeline name: use letters, digits, `_` and `-`",
                    spec.pipeline
                ),
            ));
        }
        if spec.partitions == 0 || spec.partitions > MAX_PARTITIONS {
            violations.push(Violation::new(
                "partitions",
                format!("{} is out of range 1..={MAX_PARTITIONS}", spec.partitions),
            ));
        }
        if spec.epoch.max_messages == 0 || spec.epoch.max_messages > MAX_EPOCH_MESSAGES {
            violations.push(Violation::new(
                "epoch.max_messages",
                format!(
                    "{} is out of range 1..={MAX_EPOCH_MESSAGES}",
                    spec.epoch.max_messages
                ),
            ));
        }
        if spec.epoch.max_duration_ms == 0 || spec.epoch.max_duration_ms > MAX_EPOCH_DURATION_MS {
            violations.push(Violation::new(
                "epoch.max_duration_ms",
                format!(
                    "{} is out of range 1..={MAX_EPOCH_DURATION_MS}",
                    spec.epoch.max_duration_ms
                ),
            ));
        }
        if spec
            .state_dir
            .as_ref()
            .is_some_and(|dir| dir.as_os_str().is_empty())
        {
            violations.push(Violation::new(
                "state_dir",
                "an empty path; name a directory (for example `./flow-state`), or remove the key and pass --state-dir",
            ));
        }
        if spec.shutdown.drain_timeout_ms > MAX_DRAIN_TIMEOUT_MS {
            violations.push(Violation::new(
                "shutdown.drain_timeout_ms",
                format!(
                    "{} is out of range 0..={MAX_DRAIN_TIMEOUT_MS}",
                    spec.shutdown.drain_timeout_ms
                ),
            ));
        }
        let metrics = spec
            .metrics
            .as_ref()
            .and_then(|m| m.validate(&mut violations));
        let partitions = spec.partitions.clamp(1, MAX_PARTITIONS);

        let mut streams: BTreeMap<String, Arc<StreamSchema>> = BTreeMap::new();
        let source = match self.source(&spec.source.class) {
            None => {
                violations.push(Violation::new(
                    "source.class",
                    format!(
                        "unknown source class `{}`; known classes: {}",
                        spec.source.class,
                        self.source_classes().join(", ")
                    ),
                ));
                None
            }
            Some(builder) => {
                let ctx = SourceBuildContext {
                    pipeline: &spec.pipeline,
                    partitions,
                };
                match builder(&ctx, &spec.source.parameters) {
                    Ok(factory) => {
                        streams.insert(factory.stream_id().to_owned(), factory.schema());
                        Some(factory)
                    }
                    Err(errs) => {
                        violations.extend(errs.into_iter().map(|v| v.under("source")));
                        None
                    }
                }
            }
        };

        let mut processors = Vec::new();
        let mut processor_names = HashSet::new();
        for (i, p) in spec.processors.iter().enumerate() {
            let path = format!("processors[{i}]");
            if !is_valid_name(&p.name) {
                violations.push(Violation::new(
                    format!("{path}.name"),
                    format!(
                        "`{}` is not a valid name: use letters, digits, `_` and `-`",
                        p.name
                    ),
                ));
            } else if !processor_names.insert(p.name.as_str()) {
                violations.push(Violation::new(
                    format!("{path}.name"),
                    format!("processor name `{}` is used twice", p.name),
                ));
            }
            let Some(input_schema) = streams.get(&p.input_stream_id).cloned() else {
                violations.push(Violation::new(
                    format!("{path}.input_stream_id"),
                    format!(
                        "unknown stream `{}`; streams defined before this processor: {}",
                        p.input_stream_id,
                        known(&streams)
                    ),
                ));
                continue;
            };
            if streams.contains_key(&p.output_stream_id) {
                violations.push(Violation::new(
                    format!("{path}.output_stream_id"),
                    format!("stream `{}` is already defined", p.output_stream_id),
                ));
                continue;
            }
            let Some(builder) = self.processor(&p.class) else {
                violations.push(Violation::new(
                    format!("{path}.class"),
                    format!(
                        "unknown processor class `{}`; known classes: {}",
                        p.class,
                        self.processor_classes().join(", ")
                    ),
                ));
                continue;
            };
            let ctx = ProcessorBuildContext {
                pipeline: &spec.pipeline,
                name: &p.name,
                input_schema: &input_schema,
            };
            match builder(&ctx, &p.parameters) {
                Ok(factory) => {
                    streams.insert(p.output_stream_id.clone(), factory.output_schema());
                    processors.push(ValidatedProcessor {
                        name: p.name.clone(),
                        factory,
                        input_stream_id: p.input_stream_id.clone(),
                        output_stream_id: p.output_stream_id.clone(),
                    });
                }
                Err(errs) => violations.extend(errs.into_iter().map(|v| v.under(&path))),
            }
        }

        if spec.sinks.is_empty() {
            violations.push(Violation::new(
                "sinks",
                "a pipeline needs at least one sink",
            ));
        }
        let mut sinks = Vec::new();
        let mut sink_names = HashSet::new();
        for (i, s) in spec.sinks.iter().enumerate() {
            let path = format!("sinks[{i}]");
            if !is_valid_name(&s.name) {
                violations.push(Violation::new(
                    format!("{path}.name"),
                    format!(
                        "`{}` is not a valid sink name: use letters, digits, `_` and `-`",
                        s.name
                    ),
                ));
            } else if !sink_names.insert(s.name.as_str()) {
                violations.push(Violation::new(
                    format!("{path}.name"),
                    format!(
                        "sink name `{}` is used twice; each sink names its own state",
                        s.name
                    ),
                ));
            }
            let mut inputs = Vec::new();
            if s.input_stream_ids.is_empty() {
                violations.push(Violation::new(
                    format!("{path}.input_stream_ids"),
                    "a sink needs at least one input stream",
                ));
            }
            let mut resolved = true;
            for (j, id) in s.input_stream_ids.iter().enumerate() {
                match streams.get(id) {
                    Some(schema) => inputs.push((id.clone(), Arc::clone(schema))),
                    None => {
                        resolved = false;
                        // An unknown source class already explains a missing stream.
                        if source.is_some() {
                            violations.push(Violation::new(
                                format!("{path}.input_stream_ids[{j}]"),
                                format!(
                                    "unknown stream `{id}`; known streams: {}",
                                    known(&streams)
                                ),
                            ));
                        }
                    }
                }
            }
            let Some(builder) = self.sink(&s.sink_class_name) else {
                violations.push(Violation::new(
                    format!("{path}.sink_class_name"),
                    format!(
                        "unknown sink class `{}`; known classes: {}",
                        s.sink_class_name,
                        self.sink_classes().join(", ")
                    ),
                ));
                continue;
            };
            // Build even with an unresolved input, so parameter mistakes are reported too.
            let ctx = SinkBuildContext {
                pipeline: &spec.pipeline,
                sink: &s.name,
                class: &s.sink_class_name,
                partitions,
                inputs: &inputs,
            };
            match builder(&ctx, &s.parameters, &s.dynamic_parameters) {
                Ok(_) if !resolved => {}
                Ok(factory) => sinks.push(ValidatedSink {
                    name: s.name.clone(),
                    class: s.sink_class_name.clone(),
                    factory,
                    input_stream_ids: s.input_stream_ids.clone(),
                    dynamic_parameters: s.dynamic_parameters.clone(),
                }),
                // An unresolved input is already explained (an unknown stream, or a source that
                // failed to build); the sink's view of its empty input list would only mislead.
                Err(errs) => violations.extend(
                    errs.into_iter()
                        .filter(|v| resolved || !v.path.starts_with("input_stream_ids"))
                        .map(|v| v.under(&path)),
                ),
            }
        }

        match source {
            Some(source) if violations.is_empty() => Ok(ValidatedPipeline {
                name: spec.pipeline.clone(),
                partitions,
                state_dir: spec.state_dir.clone(),
                epoch: EpochSettings {
                    max_messages: usize::try_from(spec.epoch.max_messages).unwrap_or(usize::MAX),
                    max_duration: Duration::from_millis(spec.epoch.max_duration_ms),
                },
                payloads: spec.outbox.payloads,
                drain_timeout: Duration::from_millis(spec.shutdown.drain_timeout_ms),
                metrics,
                source,
                processors,
                sinks,
                streams,
                spec: spec.clone(),
            }),
            _ => Err(SpecError { violations }),
        }
    }

    /// Parses and builds a spec from YAML text.
    pub fn build_yaml(&self, text: &str) -> Result<ValidatedPipeline, SpecError> {
        self.build(&PipelineSpec::from_yaml(text)?)
    }
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
}
