//! The parameters of the `nats_jetstream` source and their validation into its factory.

use std::path::PathBuf;
use std::sync::Arc;

use flow_core::registry::{parse_parameters, BuildResult, SourceBuildContext};
use flow_core::sources::{BrokerDecoder, BrokerFormat, OnBadRecord};
use flow_core::{Column, SourceFactory, Violation};
use serde::{Deserialize, Serialize};

use super::auth::{connect_options, NatsAuth};
use super::reader::JetStream;
use crate::broker_source::{default_stream_id, stream_id_violation, Broker, BrokerFactory};

/// The default of `max_messages_per_pull`.
const DEFAULT_MAX_MESSAGES_PER_PULL: usize = 10_000;
/// Parameters of the `nats_jetstream` source, as a spec's `parameters:` map gives them.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NatsJetStreamParams {
    /// `nats://host:port` URLs of the cluster's servers.
    pub servers: Vec<String>,
    /// The JetStream stream.
    pub stream: String,
    /// One subject per partition, in partition order.
    #[serde(default)]
    pub subjects: Option<Vec<String>>,
    /// Or a template whose `{partition}` is replaced by the partition number.
    #[serde(default)]
    pub subject_template: Option<String>,
    /// How a message's payload becomes a row.
    #[serde(default)]
    pub format: BrokerFormat,
    /// The declared columns, with `format: json`.
    #[serde(default)]
    pub schema: Option<Vec<Column>>,
    /// What a message that does not fit the schema does: stop the partition, or become a dead letter.
    #[serde(default)]
    pub on_bad_record: OnBadRecord,
    /// The id of the stream the source emits, which processors and sinks name as their input
    /// (default `rows`).
    #[serde(default = "default_stream_id")]
    pub stream_id: String,
    /// How to authenticate; credentials come from the environment or files, never the spec.
    #[serde(default)]
    pub auth: Option<NatsAuth>,
    /// PEM files of the certificate authorities that sign the servers' certificates; TLS is
    /// required when any is given.
    #[serde(default)]
    pub tls_ca_files: Vec<PathBuf>,
    /// The most messages one pull request asks for.
    #[serde(default = "default_max_messages_per_pull")]
    pub max_messages_per_pull: usize,
}

pub(crate) fn default_max_messages_per_pull() -> usize {
    DEFAULT_MAX_MESSAGES_PER_PULL
}

pub(crate) fn build(
    ctx: &SourceBuildContext<'_>,
    parameters: &serde_yaml::Value,
) -> BuildResult<Arc<dyn SourceFactory>> {
    let mut params: NatsJetStreamParams = parse_parameters(parameters, "parameters")?;
    if let Some(auth) = &mut params.auth {
        auth.resolve_paths(ctx.paths);
    }
    for file in &mut params.tls_ca_files {
        *file = ctx.paths.resolve(file);
    }
    let mut violations = Vec::new();
    if params.servers.is_empty() {
        violations.push(Violation::new(
            "parameters.servers",
            "name at least one server, for example `nats://127.0.0.1:4222`",
        ));
    }
    if !is_valid_stream_name(&params.stream) {
        violations.push(Violation::new(
            "parameters.stream",
            format!(
                "`{}` is not a JetStream stream name (non-empty, no whitespace, `.`, `*`, `>`)",
                params.stream
            ),
        ));
    }
    let subjects = partition_subjects(&params, ctx.partitions).map_err(|v| violations.push(v));
    if params.max_messages_per_pull == 0 || params.max_messages_per_pull > 1_000_000 {
        violations.push(Violation::new(
            "parameters.max_messages_per_pull",
            format!(
                "{} is out of range 1..=1000000",
                params.max_messages_per_pull
            ),
        ));
    }
    violations.extend(stream_id_violation(&params.stream_id));
    let schema = BrokerDecoder::schema_of(
        params.format,
        params.schema.as_deref(),
        "subject",
        JetStream::WITH_KEY,
    )
    .map_err(|v| violations.push(v));
    let connect = connect_options(params.auth.as_ref(), &params.tls_ca_files)
        .map_err(|mut v| violations.append(&mut v));
    match (subjects, schema, connect) {
        (Ok(subjects), Ok(schema), Ok(connect)) if violations.is_empty() => {
            Ok(Arc::new(BrokerFactory {
                broker: JetStream::new(
                    params.servers,
                    params.stream,
                    subjects.clone(),
                    connect,
                    params.max_messages_per_pull,
                ),
                stream_id: params.stream_id,
                schema,
                format: params.format,
                on_bad_record: params.on_bad_record,
                targets: subjects,
            }))
        }
        _ => Err(violations),
    }
}

fn is_valid_stream_name(name: &str) -> bool {
    !name.is_empty()
        && !name
            .chars()
            .any(|c| c.is_whitespace() || matches!(c, '.' | '*' | '>' | '/' | '\\'))
}

fn is_valid_subject(subject: &str) -> bool {
    !subject.is_empty()
        && !subject.chars().any(char::is_whitespace)
        && subject.split('.').all(|token| !token.is_empty())
}

/// The subject of every partition, from `subjects` or `subject_template`.
fn partition_subjects(
    params: &NatsJetStreamParams,
    partitions: u32,
) -> Result<Vec<String>, Violation> {
    let subjects: Vec<String> = match (&params.subjects, &params.subject_template) {
        (Some(_), Some(_)) => {
            return Err(Violation::new(
                "parameters.subjects",
                "set `subjects` or `subject_template`, not both",
            ))
        }
        (None, None) => {
            return Err(Violation::new(
                "parameters.subjects",
                "name each partition's subject: `subjects: [...]` or `subject_template: \"events.{partition}\"`",
            ))
        }
        (Some(list), None) => {
            if list.len() != partitions as usize {
                return Err(Violation::new(
                    "parameters.subjects",
                    format!(
                        "{} subject(s) for {partitions} partition(s): nats_jetstream reads one subject per partition, so set `partitions: {}`",
                        list.len(),
                        list.len().max(1)
                    ),
                ));
            }
            list.clone()
        }
        (None, Some(template)) => {
            if !template.contains("{partition}") {
                return Err(Violation::new(
                    "parameters.subject_template",
                    format!("`{template}` has no `{{partition}}`: every partition would read the same subject"),
                ));
            }
            (0..partitions)
                .map(|p| template.replace("{partition}", &p.to_string()))
                .collect()
        }
    };
    let path = if params.subjects.is_some() {
        "parameters.subjects"
    } else {
        "parameters.subject_template"
    };
    if let Some(bad) = subjects.iter().find(|s| !is_valid_subject(s)) {
        return Err(Violation::new(
            path,
            format!(
                "`{bad}` is not a NATS subject (dot-separated non-empty tokens, no whitespace)"
            ),
        ));
    }
    let mut sorted = subjects.clone();
    sorted.sort();
    if let Some(pair) = sorted.windows(2).find(|pair| pair[0] == pair[1]) {
        return Err(Violation::new(
            path,
            format!(
                "subject `{}` is read by two partitions: each message would be delivered twice",
                pair[0]
            ),
        ));
    }
    if let Some(wild) = subjects
        .iter()
        .find(|s| s.split('.').any(|t| t == "*" || t == ">"))
    {
        return Err(Violation::new(
            path,
            format!("`{wild}` has a wildcard: a partition reads exactly one subject, so that its messages have one order"),
        ));
    }
    Ok(subjects)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use super::*;
    use flow_core::SpecPaths;

    /// The nkey seed and CA files a spec names relatively are read from the spec's directory, as
    /// every relative path of a spec is; from another base they are violations naming them.
    #[test]
    fn relative_auth_and_ca_files_are_read_from_the_spec_directory() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir(dir.path().join("nats")).unwrap();
        std::fs::write(dir.path().join("nats/user.nk"), "SUAEXAMPLESEED\n").unwrap();
        std::fs::write(dir.path().join("nats/ca.pem"), "pem").unwrap();
        let parameters: serde_yaml::Value = serde_yaml::from_str(
            "{servers: ['nats://h:4222'], stream: s, subject_template: 'o.{partition}', format: raw, \
             auth: {nkey_seed_file: nats/user.nk}, tls_ca_files: [nats/ca.pem]}",
        )
        .unwrap();
        let ctx = |paths| SourceBuildContext {
            pipeline: "p",
            partitions: 1,
            paths,
        };
        assert!(build(&ctx(SpecPaths::under(dir.path())), &parameters).is_ok());
        let elsewhere = tempfile::tempdir().unwrap();
        let violations = build(&ctx(SpecPaths::under(elsewhere.path())), &parameters)
            .err()
            .unwrap();
        let paths: Vec<&str> = violations.iter().map(|v| v.path.as_str()).collect();
        assert_eq!(
            paths,
            [
                "parameters.auth.nkey_seed_file",
                "parameters.tls_ca_files[0]"
            ]
        );
        let missing = elsewhere.path().join("nats/ca.pem");
        assert!(
            violations[1]
                .message
                .contains(&missing.display().to_string()),
            "{violations:?}"
        );
    }
}
