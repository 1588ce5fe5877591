//! The pipeline spec: serde types (`PipelineSpec`), parsed so that every structural mistake is
//! reported with its path, then validated and built into a `ValidatedPipeline`
//! (`Registry::build`) — the only form the runtime accepts. Static parameters need a restart to change; `dynamic_parameters` of a sink can
//! be swapped while the pipeline runs.

use std::path::{Path, PathBuf};
use std::time::Duration;

use flow_state::cluster::{ClusterUrl, DEFAULT_SESSION_TIMEOUT};

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

use super::interpolate::FromEnvironment;
use super::spec_paths::SpecPaths;
use crate::error::{SpecError, Violation};
use crate::structural::deserialize_all;

/// The most partitions a pipeline may have.
pub const MAX_PARTITIONS: u32 = 1024;
/// The largest `epoch.max_messages`.
pub const MAX_EPOCH_MESSAGES: u64 = 10_000_000;
/// The largest `epoch.max_duration_ms` (1 h).
pub const MAX_EPOCH_DURATION_MS: u64 = 3_600_000;
/// The largest `shutdown.drain_timeout_ms` (1 h).
pub const MAX_DRAIN_TIMEOUT_MS: u64 = 3_600_000;

/// A pipeline spec as written (YAML), before validation: [`PipelineSpec::from_yaml`] parses it,
/// [`Registry::build`](crate::Registry::build) validates it into a [`ValidatedPipeline`](crate::ValidatedPipeline).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PipelineSpec {
    /// `[A-Za-z0-9_-]+`; namespaces the pipeline's state.
    pub pipeline: String,
    /// Independent partitions the source is read in, 1..=[`MAX_PARTITIONS`] (default 1).
    #[serde(default = "default_partitions")]
    pub partitions: u32,
    /// Where the outbox lives (`--state-dir` wins). A relative path read by
    /// [`PipelineSpec::from_file`] is made absolute against the spec file's directory, so a run
    /// from another working directory finds the same outbox; in a spec parsed from text or built
    /// in code it stays relative to the process's working directory.
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
    /// Run as one of several workers coordinated through ZooKeeper; none when absent
    /// (`--cluster` wins).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cluster: Option<ClusterSpec>,
    /// Where the messages come from: the source class and its parameters.
    pub source: SourceSpec,
    /// Processors, each turning one stream into another.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub processors: Vec<ProcessorSpec>,
    /// The sinks; at least one.
    pub sinks: Vec<SinkSpec>,
    /// Which values came from environment variables, so that violations name the variable.
    #[serde(skip)]
    pub(crate) from_environment: FromEnvironment,
    /// The canonical directory of the spec file it was read from ([`PipelineSpec::from_file`]):
    /// the base of its relative paths ([`PipelineSpec::paths`]).
    #[serde(skip)]
    pub(crate) spec_dir: Option<PathBuf>,
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
    pub(crate) fn validate(&self, violations: &mut Vec<Violation>) -> Option<MetricsSettings> {
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

/// `cluster: { url: zk://HOST:PORT[,HOST:PORT]/PATH, session_timeout_ms: MS }`: the pipeline
/// runs on every worker started with it, its partitions spread over them.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ClusterSpec {
    /// The ZooKeeper servers and the path under which the pipeline's workers meet.
    pub url: String,
    /// The ZooKeeper session timeout asked for (default 10 000; the server bounds it to 2..20
    /// of its ticks): a worker cut off longer loses its partitions to the others.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub session_timeout_ms: Option<u64>,
}

/// The validated `cluster` section.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ClusterSettings {
    /// The parsed URL.
    pub url: ClusterUrl,
    /// The session timeout asked for.
    pub session_timeout: Duration,
}

/// The longest `cluster.session_timeout_ms`: ZooKeeper grants at most 20 ticks, and a longer
/// timeout only delays the handover of a dead worker's partitions.
pub const MAX_SESSION_TIMEOUT_MS: u64 = 120_000;

impl ClusterSpec {
    pub(crate) fn validate(&self, violations: &mut Vec<Violation>) -> Option<ClusterSettings> {
        let url = match self.url.parse::<ClusterUrl>() {
            Ok(url) => Some(url),
            Err(err) => {
                violations.push(Violation::new("cluster.url", err.to_string()));
                None
            }
        };
        let session_timeout = match self.session_timeout_ms {
            None => Some(DEFAULT_SESSION_TIMEOUT),
            Some(ms @ 1..=MAX_SESSION_TIMEOUT_MS) => Some(Duration::from_millis(ms)),
            Some(ms) => {
                violations.push(Violation::new(
                    "cluster.session_timeout_ms",
                    format!("{ms} is out of range 1..={MAX_SESSION_TIMEOUT_MS}; remove it for the default 10000"),
                ));
                None
            }
        };
        Some(ClusterSettings {
            url: url?,
            session_timeout: session_timeout?,
        })
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
    "cluster",
    "source",
    "processors",
    "sinks",
];

impl PipelineSpec {
    /// Parses YAML, reporting every structural mistake (unknown field, wrong type, missing
    /// field) of each section with its path, not just the first one.
    ///
    /// Only the structure is checked here; [`Registry::build`](crate::Registry::build) checks the values and each
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
        let text = super::text::prepare(text).map_err(|violation| SpecError {
            violations: vec![violation],
        })?;
        let mut value: serde_yaml::Value = serde_yaml::from_str(text).map_err(|err| SpecError {
            violations: vec![yaml_violation(text, &err)],
        })?;
        // References are resolved before anything reads the values, so that a wrong type
        // is reported for what the variable holds; an unresolved one is reported alone.
        let mut unresolved = Vec::new();
        let mut from_environment = FromEnvironment::default();
        super::interpolate::interpolate(
            &mut value,
            "",
            &super::interpolate::Environment,
            &mut unresolved,
            &mut from_environment,
        );
        if !unresolved.is_empty() {
            return Err(SpecError {
                violations: unresolved,
            });
        }
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
        let cluster = optional::<ClusterSpec>(get("cluster"), "cluster", &mut violations).flatten();
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
            return Err(SpecError {
                violations: from_environment.redacted(violations),
            });
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
                cluster,
                source,
                processors,
                sinks,
                from_environment,
                spec_dir: None,
            }),
            // Every `None` above pushed a violation, so this arm is only reached with some.
            _ => Err(SpecError {
                violations: vec![Violation::new("", "the spec is incomplete")],
            }),
        }
    }

    /// Reads and parses a spec file. A relative `state_dir` is resolved against the directory
    /// holding the file (its canonical path: a symbolic link to the file itself is not
    /// followed), which makes it absolute: the outbox belongs to the spec, not to the directory
    /// the worker happens to be started from.
    pub fn from_file(path: &Path) -> Result<PipelineSpec, SpecError> {
        let text = std::fs::read_to_string(path).map_err(|err| SpecError {
            violations: vec![Violation::new(
                "",
                format!("cannot read the spec file `{}`: {err}", path.display()),
            )],
        })?;
        let mut spec = PipelineSpec::from_yaml(&text)?;
        let dir = super::spec_paths::spec_file_dir(path);
        spec.state_dir = spec
            .state_dir
            .map(|state_dir| SpecPaths::under(&dir).resolve(&state_dir));
        spec.spec_dir = Some(dir);
        Ok(spec)
    }

    /// What the spec's relative paths are resolved against: the spec file's directory for a
    /// spec read by [`PipelineSpec::from_file`], else the working directory.
    pub fn paths(&self) -> SpecPaths<'_> {
        match &self.spec_dir {
            Some(dir) => SpecPaths::under(dir),
            None => SpecPaths::working_directory(),
        }
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
        return Violation::new(
            "",
            format!(
                "not valid YAML: {message}{}",
                unquoted_reference_hint(text, err)
            ),
        );
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

/// A hint for the YAML error a `${VAR}` reference causes unquoted inside a flow mapping or
/// sequence (`{count: ${N}}`): YAML reads its `{` as the start of another mapping.
fn unquoted_reference_hint(text: &str, err: &serde_yaml::Error) -> &'static str {
    let in_flow = err.to_string().contains("while parsing a flow");
    let line = err
        .location()
        .and_then(|location| text.lines().nth(location.line().saturating_sub(1)));
    if in_flow && line.is_some_and(|line| line.contains("${")) {
        "; a `${VAR}` reference inside `{...}` or `[...]` must be quoted (`'${VAR}'`), or YAML \
         reads its braces as a mapping"
    } else {
        ""
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
    match deserialize_all(value, path) {
        Ok(parsed) => Some(parsed),
        Err(found) => {
            violations.extend(found);
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

/// `[A-Za-z0-9_-]+`, the alphabet of names that end up in state keys and tokens.
pub fn is_valid_name(name: &str) -> bool {
    !name.is_empty()
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
}

#[cfg(test)]
mod tests {
    use super::*;

    const SPEC: &str = "pipeline: p\nsource: {class: generator, parameters: {count: 1}}\nsinks: [{name: out, sink_class_name: DebugSink, input_stream_ids: [rows], parameters: {path: out.jsonl}}]\n";

    /// Issue 46 item 17: YAML's own message for an unquoted reference in a flow mapping says
    /// nothing of quoting; the violation adds it, and only there.
    #[test]
    fn an_unquoted_reference_in_a_flow_mapping_says_to_quote_it() {
        let message = |text: &str| match PipelineSpec::from_yaml(text) {
            Err(err) => err.violations[0].message.clone(),
            Ok(_) => panic!("accepted: {text}"),
        };
        let unquoted = "pipeline: p\nsource: {class: generator, parameters: {count: ${N}}}\n";
        let text = message(unquoted);
        assert!(
            text.starts_with("not valid YAML: did not find expected ',' or '}'"),
            "{text}"
        );
        assert!(
            text.ends_with(
                "; a `${VAR}` reference inside `{...}` or `[...]` must be quoted (`'${VAR}'`), \
                 or YAML reads its braces as a mapping"
            ),
            "{text}"
        );
        let other = message("pipeline: p\nsource: {class: generator, parameters: {count: 1}\n");
        assert!(!other.contains("${VAR}"), "{other}");
    }

    /// Issue 24 item 3: the outbox belongs to the spec file, not to the working directory.
    #[test]
    fn a_relative_state_dir_of_a_spec_file_is_the_spec_files_directorys() {
        let dir = std::env::temp_dir().join(format!("flow-spec-{}", std::process::id()));
        std::fs::create_dir_all(dir.join("specs")).unwrap_or_else(|e| panic!("{e}"));
        let write = |name: &str, state_dir: &str| {
            let path = dir.join("specs").join(name);
            std::fs::write(&path, format!("state_dir: {state_dir}\n{SPEC}"))
                .unwrap_or_else(|e| panic!("{e}"));
            PipelineSpec::from_file(&path)
                .unwrap_or_else(|e| panic!("{e}"))
                .state_dir
        };
        let specs = std::fs::canonicalize(dir.join("specs")).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(write("rel.yaml", "./state"), Some(specs.join("state")));
        assert_eq!(write("up.yaml", "../state"), Some(specs.join("../state")));
        assert_eq!(
            write("abs.yaml", "/srv/state"),
            Some(PathBuf::from("/srv/state"))
        );
        let _ = std::fs::remove_dir_all(&dir);
        // Parsed from text, no file is known: it stays relative (to the working directory).
        let text = PipelineSpec::from_yaml(&format!("state_dir: ./state\n{SPEC}"));
        assert_eq!(
            text.map(|s| s.state_dir).ok().flatten(),
            Some(PathBuf::from("./state"))
        );
    }
}
