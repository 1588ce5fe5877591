//! The parameters of the `kafka` source, their validation into its factory, and the consumer
//! configuration flow owns.

use std::collections::BTreeMap;
use std::sync::Arc;

use flow_core::registry::{parse_parameters, BuildResult, SourceBuildContext};
use flow_core::sources::{BrokerDecoder, BrokerFormat, OnBadRecord};
use flow_core::{Column, SourceFactory, Violation};
use rdkafka::config::ClientConfig;
use serde::{Deserialize, Serialize};

use super::reader::KafkaTopic;
use crate::broker_source::{default_stream_id, stream_id_violation, Broker, BrokerFactory};

/// The librdkafka properties flow sets itself, and why a spec may not.
const OWNED_PROPERTIES: &[(&str, &str)] = &[
    ("bootstrap.servers", "set `brokers`"),
    ("metadata.broker.list", "set `brokers`"),
    ("group.id", "set `group_id`"),
    (
        "enable.auto.commit",
        "flow keeps positions in its own outbox; a group only receives them for monitoring",
    ),
    (
        "enable.auto.offset.store",
        "flow keeps positions in its own outbox",
    ),
    (
        "auto.offset.reset",
        "flow must stop, not skip, when a position it needs is gone",
    ),
    (
        "enable.partition.eof",
        "flow reads endlessly and asks the watermarks for the lag",
    ),
];

/// Parameters of the `kafka` source, as a spec's `parameters:` map gives them.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KafkaParams {
    /// `host:port` of the bootstrap brokers.
    pub brokers: Vec<String>,
    /// The topic read.
    pub topic: String,
    /// The Kafka partition of each flow partition, in flow partition order; by default flow
    /// partition `i` reads Kafka partition `i`.
    #[serde(default)]
    pub topic_partitions: Option<Vec<i32>>,
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
    /// A consumer group that receives the read positions, for monitoring only.
    #[serde(default)]
    pub group_id: Option<String>,
    /// Any other librdkafka property (security, fetch sizes, ...), passed through as given.
    #[serde(default)]
    pub properties: BTreeMap<String, String>,
}

pub(crate) fn build(
    ctx: &SourceBuildContext<'_>,
    parameters: &serde_yaml::Value,
) -> BuildResult<Arc<dyn SourceFactory>> {
    let params: KafkaParams = parse_parameters(parameters, "parameters")?;
    let mut violations = Vec::new();
    if params.brokers.is_empty() || params.brokers.iter().any(|b| b.trim().is_empty()) {
        violations.push(Violation::new(
            "parameters.brokers",
            "name at least one broker as `host:port`, for example `127.0.0.1:9092`",
        ));
    }
    if !is_valid_topic(&params.topic) {
        violations.push(Violation::new(
            "parameters.topic",
            format!(
                "`{}` is not a Kafka topic name (1..=249 characters of [A-Za-z0-9._-])",
                params.topic
            ),
        ));
    }
    let topic_partitions =
        topic_partitions(&params, ctx.partitions).map_err(|v| violations.push(v));
    violations.extend(stream_id_violation(&params.stream_id));
    if params.group_id.as_deref().is_some_and(str::is_empty) {
        violations.push(Violation::new(
            "parameters.group_id",
            "an empty group id: name a group, or leave `group_id` out",
        ));
    }
    violations.extend(property_violations(&params));
    let schema = BrokerDecoder::schema_of(
        params.format,
        params.schema.as_deref(),
        "topic",
        KafkaTopic::WITH_KEY,
    )
    .map_err(|v| violations.push(v));
    match (topic_partitions, schema) {
        (Ok(topic_partitions), Ok(schema)) if violations.is_empty() => {
            Ok(Arc::new(BrokerFactory {
                broker: KafkaTopic::new(
                    client_config(&params),
                    params.topic,
                    params.group_id.is_some(),
                ),
                stream_id: params.stream_id,
                schema,
                format: params.format,
                on_bad_record: params.on_bad_record,
                targets: topic_partitions,
            }))
        }
        _ => Err(violations),
    }
}

fn is_valid_topic(topic: &str) -> bool {
    (1..=249).contains(&topic.len())
        && topic != "."
        && topic != ".."
        && topic
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-'))
}

/// The Kafka partition of every flow partition.
fn topic_partitions(params: &KafkaParams, partitions: u32) -> Result<Vec<i32>, Violation> {
    let Some(list) = &params.topic_partitions else {
        return (0..partitions)
            .map(|p| {
                i32::try_from(p)
                    .map_err(|_| Violation::new("partitions", "too many partitions for Kafka"))
            })
            .collect();
    };
    let path = "parameters.topic_partitions";
    if list.len() != partitions as usize {
        return Err(Violation::new(
            path,
            format!(
                "{} Kafka partition(s) for {partitions} flow partition(s): each flow partition reads one Kafka partition, so set `partitions: {}`",
                list.len(),
                list.len().max(1)
            ),
        ));
    }
    if let Some(negative) = list.iter().find(|p| **p < 0) {
        return Err(Violation::new(
            path,
            format!("{negative} is not a partition number"),
        ));
    }
    let mut sorted = list.clone();
    sorted.sort_unstable();
    if let Some(pair) = sorted.windows(2).find(|pair| pair[0] == pair[1]) {
        return Err(Violation::new(
            path,
            format!(
                "Kafka partition {} is read by two flow partitions: each message would be delivered twice",
                pair[0]
            ),
        ));
    }
    Ok(list.clone())
}

/// A property flow owns, or one librdkafka does not accept, each with its path.
fn property_violations(params: &KafkaParams) -> Vec<Violation> {
    let mut violations = Vec::new();
    for (name, value) in &params.properties {
        let path = format!("parameters.properties.{name}");
        if let Some((_, why)) = OWNED_PROPERTIES.iter().find(|(owned, _)| owned == name) {
            violations.push(Violation::new(
                path,
                format!("flow sets `{name}` itself: {why}"),
            ));
            continue;
        }
        let mut one = ClientConfig::new();
        one.set(name, value);
        if let Err(err) = one.create_native_config() {
            violations.push(Violation::new(
                path,
                format!("librdkafka refuses it: {err}"),
            ));
        }
    }
    violations
}

/// The consumer configuration every partition's reader uses.
fn client_config(params: &KafkaParams) -> ClientConfig {
    let mut config = ClientConfig::new();
    for (name, value) in &params.properties {
        config.set(name, value);
    }
    config
        .set("bootstrap.servers", params.brokers.join(","))
        .set("enable.auto.commit", "false")
        .set("enable.auto.offset.store", "false")
        .set("auto.offset.reset", "error")
        .set("enable.partition.eof", "false");
    // librdkafka's consumer needs a group id to exist even when its partitions are assigned by
    // hand; without `group_id` it names a group nothing is ever committed to.
    let group = params.group_id.as_deref().unwrap_or("flow-unused");
    config.set("group.id", group);
    config
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(yaml: &str) -> KafkaParams {
        serde_yaml::from_str(yaml).unwrap_or_else(|e| panic!("{e}"))
    }

    #[test]
    fn flow_partition_i_reads_kafka_partition_i_unless_listed() {
        let p = params("{brokers: [b:9092], topic: t}");
        assert_eq!(topic_partitions(&p, 3).ok(), Some(vec![0, 1, 2]));
        let listed = params("{brokers: [b:9092], topic: t, topic_partitions: [5, 2]}");
        assert_eq!(topic_partitions(&listed, 2).ok(), Some(vec![5, 2]));
        let twice = params("{brokers: [b:9092], topic: t, topic_partitions: [1, 1]}");
        let err = topic_partitions(&twice, 2).err().map(|v| v.to_string());
        assert!(err.is_some_and(|e| e.contains("read by two flow partitions")));
        let short = topic_partitions(&listed, 3).err().map(|v| v.to_string());
        assert!(short.is_some_and(|e| e.contains("set `partitions: 2`")));
    }

    #[test]
    fn owned_and_unknown_properties_are_refused_with_their_paths() {
        let p = params(
            "{brokers: [b:9092], topic: t, properties: {auto.offset.reset: latest, no.such.property: x, fetch.min.bytes: '1'}}",
        );
        let violations: Vec<String> = property_violations(&p)
            .iter()
            .map(ToString::to_string)
            .collect();
        assert_eq!(violations.len(), 2, "{violations:?}");
        assert!(
            violations[0].starts_with("parameters.properties.auto.offset.reset: flow sets"),
            "{violations:?}"
        );
        assert!(
            violations[1]
                .starts_with("parameters.properties.no.such.property: librdkafka refuses it"),
            "{violations:?}"
        );
    }

    #[test]
    fn topic_names_follow_kafka_rules() {
        assert!(is_valid_topic("events.v1_a-b"));
        assert!(!is_valid_topic(""));
        assert!(!is_valid_topic(".."));
        assert!(!is_valid_topic("a b"));
        assert!(!is_valid_topic(&"x".repeat(250)));
    }
}
