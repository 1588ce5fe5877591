//! Typed configuration of the broker sources: builder-style constructors on their parameter
//! types, [`SourceConfig`], and `validate`, which runs the registry's own builder of the class on
//! the serialized parameters, so that its violations are those of the YAML path by construction
//! (credentials and CA files are checked as the registry checks them: read once, now). That the
//! subjects or Kafka partitions match the pipeline's partitions is left to
//! [`Registry::build`](flow_core::Registry::build): `validate` builds for as many partitions as
//! are listed.

use std::path::PathBuf;
use std::sync::Arc;

use flow_core::registry::{BuildResult, SourceBuildContext};
use flow_core::sources::{BrokerFormat, OnBadRecord};
use flow_core::{to_section, SourceConfig, SourceFactory, Violation};

use crate::broker_source::default_stream_id;
use crate::broker_source::sealed::{Common, Sealed};
use crate::kafka::{self, KafkaParams};
use crate::nats::{self, NatsAuth, NatsJetStreamParams};

/// The registry builder of a source class.
type Build = fn(&SourceBuildContext<'_>, &serde_yaml::Value) -> BuildResult<Arc<dyn SourceFactory>>;

/// Builds a source from `parameters` for `partitions` partitions, returning its violations.
fn violations_for(
    partitions: Option<usize>,
    parameters: &serde_yaml::Value,
    build: Build,
) -> Vec<Violation> {
    let partitions = u32::try_from(partitions.unwrap_or(1).max(1)).unwrap_or(u32::MAX);
    let ctx = SourceBuildContext {
        pipeline: "",
        partitions,
        paths: flow_core::SpecPaths::working_directory(),
    };
    build(&ctx, parameters).err().unwrap_or_default()
}

/// What makes a broker parameter type a typed source configuration: its class name and where
/// its common fields are (the same for both, field by field).
macro_rules! broker_source_config {
    ($params:ty, $class:literal) => {
        impl Sealed for $params {
            fn common(&mut self) -> Common<'_> {
                Common {
                    format: &mut self.format,
                    schema: &mut self.schema,
                    on_bad_record: &mut self.on_bad_record,
                    stream_id: &mut self.stream_id,
                }
            }
        }

        impl SourceConfig for $params {
            fn class_name(&self) -> &str {
                $class
            }

            fn parameters(&self) -> serde_yaml::Value {
                to_section(self)
            }
        }
    };
}

broker_source_config!(NatsJetStreamParams, "nats_jetstream");
broker_source_config!(KafkaParams, "kafka");

impl NatsJetStreamParams {
    /// Reads JetStream stream `stream` from `servers` (`nats://host:port`), JSON messages into
    /// stream `rows`; name each partition's subject with [`subjects`](Self::subjects) or
    /// [`subject_template`](Self::subject_template).
    pub fn new<I>(servers: I, stream: impl Into<String>) -> Self
    where
        I: IntoIterator,
        I::Item: Into<String>,
    {
        NatsJetStreamParams {
            servers: servers.into_iter().map(Into::into).collect(),
            stream: stream.into(),
            subjects: None,
            subject_template: None,
            format: BrokerFormat::default(),
            schema: None,
            on_bad_record: OnBadRecord::default(),
            stream_id: default_stream_id(),
            auth: None,
            tls_ca_files: Vec::new(),
            max_messages_per_pull: nats::default_max_messages_per_pull(),
        }
    }

    /// One subject per partition, in partition order.
    pub fn subjects<I>(mut self, subjects: I) -> Self
    where
        I: IntoIterator,
        I::Item: Into<String>,
    {
        self.subjects = Some(subjects.into_iter().map(Into::into).collect());
        self
    }

    /// A subject whose `{partition}` is replaced by the partition number.
    pub fn subject_template(mut self, template: impl Into<String>) -> Self {
        self.subject_template = Some(template.into());
        self
    }

    /// How to authenticate.
    pub fn auth(mut self, auth: NatsAuth) -> Self {
        self.auth = Some(auth);
        self
    }

    /// PEM files of the certificate authorities of the servers; TLS is then required.
    pub fn tls_ca_files<I>(mut self, files: I) -> Self
    where
        I: IntoIterator,
        I::Item: Into<PathBuf>,
    {
        self.tls_ca_files = files.into_iter().map(Into::into).collect();
        self
    }

    /// The most messages one pull request asks for.
    pub fn max_messages_per_pull(mut self, messages: usize) -> Self {
        self.max_messages_per_pull = messages;
        self
    }

    /// Every violation the registry reports for these parameters, with its path
    /// (`parameters.stream`), for as many partitions as `subjects` lists (one with a template).
    pub fn validate(&self) -> Vec<Violation> {
        let listed = self.subjects.as_ref().map(Vec::len);
        violations_for(listed, &self.parameters(), nats::build)
    }
}

impl KafkaParams {
    /// Reads `topic` from the bootstrap `brokers` (`host:port`), JSON messages into stream
    /// `rows`; flow partition `i` reads Kafka partition `i` unless
    /// [`topic_partitions`](Self::topic_partitions) says otherwise.
    pub fn new<I>(brokers: I, topic: impl Into<String>) -> Self
    where
        I: IntoIterator,
        I::Item: Into<String>,
    {
        KafkaParams {
            brokers: brokers.into_iter().map(Into::into).collect(),
            topic: topic.into(),
            topic_partitions: None,
            format: BrokerFormat::default(),
            schema: None,
            on_bad_record: OnBadRecord::default(),
            stream_id: default_stream_id(),
            group_id: None,
            properties: Default::default(),
        }
    }

    /// The Kafka partition of each flow partition, in flow partition order.
    pub fn topic_partitions(mut self, partitions: impl IntoIterator<Item = i32>) -> Self {
        self.topic_partitions = Some(partitions.into_iter().collect());
        self
    }

    /// A consumer group that receives the read positions, for monitoring only.
    pub fn group_id(mut self, group_id: impl Into<String>) -> Self {
        self.group_id = Some(group_id.into());
        self
    }

    /// Sets librdkafka property `name` (security, fetch sizes, ...).
    pub fn property(mut self, name: impl Into<String>, value: impl Into<String>) -> Self {
        self.properties.insert(name.into(), value.into());
        self
    }

    /// Every violation the registry reports for these parameters, with its path
    /// (`parameters.topic`), for as many partitions as `topic_partitions` lists (one without).
    pub fn validate(&self) -> Vec<Violation> {
        let listed = self.topic_partitions.as_ref().map(Vec::len);
        violations_for(listed, &self.parameters(), kafka::build)
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use flow_core::registry::parse_parameters;
    use flow_core::sinks::DebugSinkConfig;
    use flow_core::{Column, PipelineSpec, Registry, StreamType};
    use serde::de::DeserializeOwned;

    use super::*;
    use crate::BrokerSourceParams;

    fn registry() -> Registry {
        let mut registry = Registry::with_builtins();
        crate::register(&mut registry);
        registry
    }

    /// The registry's violations of the spec's source, paths relative to the source's entry.
    fn source_violations(spec: &PipelineSpec) -> Vec<Violation> {
        let err = registry().build(spec).err().unwrap();
        err.violations
            .into_iter()
            .filter_map(|v| {
                let path = v.path.strip_prefix("source.")?.to_owned();
                Some(Violation::new(path, v.message))
            })
            .collect()
    }

    fn yaml_spec(partitions: u32, source: &str) -> PipelineSpec {
        PipelineSpec::from_yaml(&format!(
            "pipeline: p\npartitions: {partitions}\nsource:\n{source}\nsinks:\n  - {{name: out, sink_class_name: DebugSink, input_stream_ids: [rows], parameters: {{path: out.jsonl}}}}\n"
        ))
        .unwrap()
    }

    fn code_spec(partitions: u32, source: impl SourceConfig) -> PipelineSpec {
        PipelineSpec::builder("p")
            .partitions(partitions)
            .source(source)
            .sink("out", ["rows"], DebugSinkConfig::new("out.jsonl"))
            .build()
    }

    /// The spec built in code from `config` names the YAML spec's class and builds; both give back
    /// `config` as their parameters.
    fn assert_same_parameters<P>(yaml: &PipelineSpec, config: P)
    where
        P: SourceConfig + DeserializeOwned + PartialEq + std::fmt::Debug + Clone + 'static,
    {
        let code = code_spec(2, config.clone());
        assert_eq!(code.source.class, yaml.source.class);
        let from_yaml: P = parse_parameters(&yaml.source.parameters, "parameters").unwrap();
        let from_code: P = parse_parameters(&code.source.parameters, "parameters").unwrap();
        assert_eq!(from_yaml, config);
        assert_eq!(from_code, config);
        assert!(registry().build(&code).is_ok());
    }

    fn columns() -> Vec<Column> {
        vec![
            Column::new("user_id", StreamType::Uint64),
            Column::new("event", StreamType::Utf8),
        ]
    }

    /// A file that exists, standing for a `.creds` file (only its existence is checked).
    fn existing_file() -> PathBuf {
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("Cargo.toml")
    }

    #[test]
    fn a_nats_jetstream_config_and_its_yaml_give_the_same_parameters() {
        let creds = existing_file();
        let yaml = yaml_spec(
            2,
            &format!(
                "  class: nats_jetstream\n  parameters:\n    servers: ['nats://127.0.0.1:14222']\n    stream: EVENTS\n    subjects: [events.0, events.1]\n    schema: [{{name: user_id, type: uint64}}, {{name: event, type: utf8}}]\n    on_bad_record: dead_letter\n    auth: {{credentials_file: '{}'}}\n    max_messages_per_pull: 500",
                creds.display()
            ),
        );
        let config = NatsJetStreamParams::new(["nats://127.0.0.1:14222"], "EVENTS")
            .subjects(["events.0", "events.1"])
            .schema(columns())
            .on_bad_record(OnBadRecord::DeadLetter)
            .auth(NatsAuth::CredentialsFile(creds))
            .max_messages_per_pull(500);
        assert_eq!(config.validate(), Vec::new());
        assert_same_parameters(&yaml, config);
    }

    #[test]
    fn nats_jetstream_mistakes_in_code_are_the_violations_of_the_same_mistakes_in_yaml() {
        let yaml = yaml_spec(
            1,
            "  class: nats_jetstream\n  parameters:\n    servers: ['nats://127.0.0.1:14222']\n    stream: bad.stream\n    subjects: [events.0]\n    subject_template: 'events.{partition}'\n    schema: [{name: user_id, type: uint64}, {name: event, type: utf8}]\n    auth: {token: {env_var: FLOW_TEST_SURELY_UNSET_NATS_TOKEN}}\n    max_messages_per_pull: 0",
        );
        let config = NatsJetStreamParams::new(["nats://127.0.0.1:14222"], "bad.stream")
            .subjects(["events.0"])
            .subject_template("events.{partition}")
            .schema(columns())
            .auth(NatsAuth::Token {
                env_var: "FLOW_TEST_SURELY_UNSET_NATS_TOKEN".to_owned(),
            })
            .max_messages_per_pull(0);
        let expected = source_violations(&yaml);
        assert_eq!(
            expected.iter().map(|v| v.path.as_str()).collect::<Vec<_>>(),
            vec![
                "parameters.stream",
                "parameters.subjects",
                "parameters.max_messages_per_pull",
                "parameters.auth.token.env_var"
            ]
        );
        assert_eq!(config.validate(), expected);
        assert_eq!(source_violations(&code_spec(1, config)), expected);
    }

    #[test]
    fn a_kafka_config_and_its_yaml_give_the_same_parameters() {
        let yaml = yaml_spec(
            2,
            "  class: kafka\n  parameters:\n    brokers: ['127.0.0.1:9092']\n    topic: events\n    topic_partitions: [1, 0]\n    format: raw\n    group_id: flow-monitor\n    properties: {fetch.min.bytes: '1024'}",
        );
        let config = KafkaParams::new(["127.0.0.1:9092"], "events")
            .topic_partitions([1, 0])
            .format(BrokerFormat::Raw)
            .group_id("flow-monitor")
            .property("fetch.min.bytes", "1024");
        assert_eq!(config.validate(), Vec::new());
        assert_same_parameters(&yaml, config);
    }

    #[test]
    fn kafka_mistakes_in_code_are_the_violations_of_the_same_mistakes_in_yaml() {
        let yaml = yaml_spec(
            2,
            "  class: kafka\n  parameters:\n    brokers: ['127.0.0.1:9092']\n    topic: 'bad topic'\n    topic_partitions: [0, 0]\n    schema: [{name: user_id, type: uint64}, {name: event, type: utf8}]\n    group_id: ''\n    properties: {group.id: other}",
        );
        let config = KafkaParams::new(["127.0.0.1:9092"], "bad topic")
            .topic_partitions([0, 0])
            .schema(columns())
            .group_id("")
            .property("group.id", "other");
        let expected = source_violations(&yaml);
        assert_eq!(
            expected.iter().map(|v| v.path.as_str()).collect::<Vec<_>>(),
            vec![
                "parameters.topic",
                "parameters.topic_partitions",
                "parameters.group_id",
                "parameters.properties.group.id"
            ]
        );
        assert_eq!(config.validate(), expected);
        assert_eq!(source_violations(&code_spec(2, config)), expected);
    }

    #[test]
    fn every_nats_auth_form_reads_back_as_written() {
        for auth in [
            NatsAuth::UserPassword {
                user: "flow".to_owned(),
                password_env_var: "NATS_PASSWORD".to_owned(),
            },
            NatsAuth::Token {
                env_var: "NATS_TOKEN".to_owned(),
            },
            NatsAuth::NkeySeedFile("/etc/flow/seed".into()),
            NatsAuth::CredentialsFile("/etc/flow/user.creds".into()),
        ] {
            let value = to_section(&auth);
            assert_eq!(
                serde_yaml::from_value::<NatsAuth>(value.clone()).unwrap(),
                auth,
                "{value:?}"
            );
        }
        assert_eq!(
            to_section(&NatsAuth::Token {
                env_var: "NATS_TOKEN".to_owned()
            }),
            serde_yaml::from_str::<serde_yaml::Value>("{token: {env_var: NATS_TOKEN}}").unwrap()
        );
    }
}
