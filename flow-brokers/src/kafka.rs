//! `kafka`: flow partition `i` reads one partition of a Kafka topic (partition `i`, or the
//! `i`-th entry of `topic_partitions`), in offset order. The position is the offset of the next
//! message to read, committed in the outbox with the epoch. Each reader assigns its partition to
//! its own consumer at that offset (manual assignment: no consumer group, no rebalancing), so a
//! restart or the rebuild of a pending batch re-reads exactly what was read before.
//!
//! `auto.offset.reset` is `error`: when the broker no longer holds the position (retention
//! deleted it), librdkafka reports it instead of jumping elsewhere, and the partition stops
//! naming the offsets lost. A `group_id`, when given, receives the read position now and then,
//! for monitoring tools only; flow never reads it back.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use flow_core::registry::{parse_parameters, BuildResult, SourceBuildContext};
use flow_core::sources::{
    decode_broker_position, encode_broker_position, BrokerDecoder, BrokerFormat, BrokerRecord,
    OnBadRecord,
};
use flow_core::{
    is_valid_name, Column, ReadLimits, Source, SourceError, SourceFactory, SourceOutput,
    SourceRead, Violation,
};
use futures_util::FutureExt;
use rdkafka::config::ClientConfig;
use rdkafka::consumer::{CommitMode, Consumer, StreamConsumer};
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::message::{BorrowedMessage, Message};
use rdkafka::{Offset, TopicPartitionList};
use serde::{Deserialize, Serialize};
use tokio::time::Instant;
use tracing::warn;

use crate::broker_source::{Broker, BrokerFactory, TroubleWait};

/// How long a watermark query may take.
const WATERMARK_TIMEOUT: Duration = Duration::from_secs(10);
/// Between two watermark queries of one partition (they give the lag).
const WATERMARK_EVERY: Duration = Duration::from_secs(1);
/// Between two monitoring commits to `group_id`.
const COMMIT_EVERY: Duration = Duration::from_secs(5);

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

pub(crate) fn default_stream_id() -> String {
    "rows".to_owned()
}

/// Why the Kafka source could not read.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum KafkaSourceError {
    /// The Kafka consumer could not be created (bad brokers list or librdkafka property).
    #[error("cannot create the Kafka consumer for {brokers}: {source}")]
    Client {
        /// The `brokers` list as given.
        brokers: String,
        /// librdkafka's reason.
        #[source]
        source: KafkaError,
    },
    /// A request to the brokers failed (partition assignment, watermark query, fetch).
    #[error("Kafka {what} failed: {source}")]
    Request {
        /// Which request.
        what: &'static str,
        /// librdkafka's reason.
        #[source]
        source: KafkaError,
    },
    /// Retention removed messages the partition had not read yet.
    #[error("topic `{topic}` partition {kafka_partition} no longer holds offsets {position}..{}: its retention removed them before flow partition {partition} read them, so they are lost. Raise the topic's retention (retention.ms, retention.bytes) above the worker's downtime; to go on without them, start with a new state directory or drain this one first", low - 1)]
    Gap {
        /// The topic.
        topic: String,
        /// The Kafka partition.
        kafka_partition: i32,
        /// The flow partition reading it.
        partition: u32,
        /// The next offset the partition would read (its committed position).
        position: u64,
        /// The lowest offset the partition still holds.
        low: u64,
    },
    /// The partition ends below the committed position: the topic was deleted and created again.
    #[error("topic `{topic}` partition {kafka_partition} ends at offset {high}, below flow partition {partition}'s committed position {position}: the topic was deleted and created again, so its offsets no longer name the messages flow committed. Use a new state directory for the new topic")]
    Reset {
        /// The topic.
        topic: String,
        /// The Kafka partition.
        kafka_partition: i32,
        /// The flow partition reading it.
        partition: u32,
        /// The committed position.
        position: u64,
        /// The partition's high watermark (the offset after its last message).
        high: u64,
    },
}

impl KafkaSourceError {
    /// Waiting cannot cure these: the partition stops.
    fn is_fatal(&self) -> bool {
        matches!(
            self,
            KafkaSourceError::Gap { .. }
                | KafkaSourceError::Reset { .. }
                | KafkaSourceError::Client { .. }
        )
    }
}

pub(crate) fn build(
    ctx: &SourceBuildContext<'_>,
    parameters: &serde_yaml::Value,
) -> BuildResult<Arc<dyn SourceFactory>> {
    let params: KafkaParams = parse_parameters(parameters, "parameters").map_err(|v| vec![v])?;
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
    if !is_valid_name(&params.stream_id) {
        violations.push(Violation::new(
            "parameters.stream_id",
            format!("`{}` is not a valid stream id", params.stream_id),
        ));
    }
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
                broker: KafkaTopic {
                    config: Arc::new(client_config(&params)),
                    monitoring_group: params.group_id.is_some(),
                    topic: params.topic,
                },
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

/// The Kafka side of the source's factory: the consumer configuration every partition's
/// reader uses.
struct KafkaTopic {
    config: Arc<ClientConfig>,
    topic: String,
    monitoring_group: bool,
}

impl Broker for KafkaTopic {
    /// The Kafka partition the flow partition reads.
    type Target = i32;
    const WITH_KEY: bool = true;

    fn no_target(partition: u32) -> String {
        format!("no Kafka partition is configured for flow partition {partition}")
    }

    fn open(
        &self,
        partition: u32,
        kafka_partition: i32,
        decoder: BrokerDecoder,
        position: Option<&[u8]>,
    ) -> Result<Box<dyn Source>, SourceError> {
        // An empty position: committed before the partition's first message.
        let next = position
            .filter(|p| !p.is_empty())
            .map(decode_broker_position)
            .transpose()?;
        Ok(Box::new(KafkaPartition {
            config: Arc::clone(&self.config),
            topic: self.topic.clone(),
            kafka_partition,
            partition,
            decoder,
            monitoring_group: self.monitoring_group,
            next,
            consumer: None,
            high: None,
            watermarks_at: None,
            committed_at: None,
            trouble: TroubleWait::default(),
        }))
    }
}

struct KafkaPartition {
    config: Arc<ClientConfig>,
    topic: String,
    kafka_partition: i32,
    partition: u32,
    decoder: BrokerDecoder,
    monitoring_group: bool,
    /// The offset of the next message to read: the position. `None` before the first message
    /// of a partition never read: reading starts at the earliest offset the broker holds.
    next: Option<u64>,
    consumer: Option<Arc<StreamConsumer>>,
    /// The partition's high watermark (the offset the next produced message gets), last asked.
    high: Option<u64>,
    watermarks_at: Option<Instant>,
    committed_at: Option<Instant>,
    trouble: TroubleWait,
}

#[async_trait]
impl Source for KafkaPartition {
    async fn read(
        &mut self,
        out: &mut SourceOutput<'_>,
        limits: ReadLimits,
    ) -> Result<SourceRead, SourceError> {
        if limits.max_messages == 0 || limits.deadline <= Instant::now() {
            return Ok(self.position());
        }
        match self.read_until(out, limits).await {
            Ok(()) => {
                self.commit_for_monitoring();
                Ok(self.position())
            }
            Err(ReadError::Record(err)) => Err(err),
            Err(ReadError::Broker(err)) if err.is_fatal() => {
                Err(SourceError::Plugin(Box::new(err)))
            }
            Err(ReadError::Broker(err)) => {
                self.broker_trouble(err, limits.deadline).await;
                Ok(self.position())
            }
        }
    }
}

/// What ended a read early.
enum ReadError {
    Record(SourceError),
    Broker(KafkaSourceError),
}

impl KafkaPartition {
    fn position(&self) -> SourceRead {
        SourceRead {
            position: self.next.map(encode_broker_position).unwrap_or_default(),
            exhausted: false,
            lag: self
                .high
                .map(|high| high.saturating_sub(self.next.unwrap_or(0))),
        }
    }

    /// Appends messages until `limits` or the deadline, creating the consumer first if needed.
    async fn read_until(
        &mut self,
        out: &mut SourceOutput<'_>,
        limits: ReadLimits,
    ) -> Result<(), ReadError> {
        let consumer = match &self.consumer {
            Some(consumer) => Arc::clone(consumer),
            None => {
                let consumer = self.assign().await.map_err(ReadError::Broker)?;
                self.consumer = Some(Arc::clone(&consumer));
                consumer
            }
        };
        if self
            .watermarks_at
            .is_none_or(|at| at.elapsed() >= WATERMARK_EVERY)
        {
            self.check_watermarks(&consumer)
                .await
                .map_err(ReadError::Broker)?;
        }
        let mut appended = 0;
        while appended < limits.max_messages {
            // Messages already fetched are taken without a timer; only an empty queue waits.
            let received = match consumer.recv().now_or_never() {
                Some(received) => received,
                None => match tokio::time::timeout_at(limits.deadline, consumer.recv()).await {
                    Ok(received) => received,
                    Err(_) => break,
                },
            };
            match received {
                Ok(message) => {
                    if self.append(&message, out).map_err(ReadError::Record)? {
                        appended += 1;
                    }
                }
                Err(err) => {
                    return Err(ReadError::Broker(self.consume_error(&consumer, err).await))
                }
            }
        }
        Ok(())
    }

    /// A consumer with the partition assigned at the position (the earliest offset before any).
    async fn assign(&self) -> Result<Arc<StreamConsumer>, KafkaSourceError> {
        let consumer: StreamConsumer =
            self.config
                .create()
                .map_err(|source| KafkaSourceError::Client {
                    brokers: self
                        .config
                        .get("bootstrap.servers")
                        .unwrap_or("")
                        .to_owned(),
                    source,
                })?;
        let consumer = Arc::new(consumer);
        // Before the first read: the broker must still hold the position.
        self.watermarks(&consumer)
            .await
            .and_then(|(low, high)| self.check_range(low, high))?;
        let offset = match self.next {
            Some(next) => Offset::Offset(i64::try_from(next).unwrap_or(i64::MAX)),
            None => Offset::Beginning,
        };
        let mut assignment = TopicPartitionList::with_capacity(1);
        assignment
            .add_partition_offset(&self.topic, self.kafka_partition, offset)
            .and_then(|()| consumer.assign(&assignment))
            .map_err(|source| KafkaSourceError::Request {
                what: "partition assignment",
                source,
            })?;
        Ok(consumer)
    }

    /// Asks the watermarks (for the lag), refusing a position the broker no longer holds.
    async fn check_watermarks(
        &mut self,
        consumer: &Arc<StreamConsumer>,
    ) -> Result<(), KafkaSourceError> {
        let (low, high) = self.watermarks(consumer).await?;
        self.watermarks_at = Some(Instant::now());
        self.high = Some(high);
        self.check_range(low, high)
    }

    fn check_range(&self, low: u64, high: u64) -> Result<(), KafkaSourceError> {
        let Some(position) = self.next else {
            return Ok(());
        };
        if position > high {
            return Err(KafkaSourceError::Reset {
                topic: self.topic.clone(),
                kafka_partition: self.kafka_partition,
                partition: self.partition,
                position,
                high,
            });
        }
        if position < low {
            return Err(KafkaSourceError::Gap {
                topic: self.topic.clone(),
                kafka_partition: self.kafka_partition,
                partition: self.partition,
                position,
                low,
            });
        }
        Ok(())
    }

    /// The partition's (low, high) watermarks; librdkafka's call blocks, so it runs off the
    /// runtime threads.
    async fn watermarks(
        &self,
        consumer: &Arc<StreamConsumer>,
    ) -> Result<(u64, u64), KafkaSourceError> {
        let (consumer, topic, partition) = (
            Arc::clone(consumer),
            self.topic.clone(),
            self.kafka_partition,
        );
        let asked = tokio::task::spawn_blocking(move || {
            consumer.fetch_watermarks(&topic, partition, WATERMARK_TIMEOUT)
        })
        .await
        .map_err(|_| KafkaSourceError::Request {
            what: "watermark query",
            source: KafkaError::Canceled,
        })?;
        let (low, high) = asked.map_err(|source| KafkaSourceError::Request {
            what: "watermark query",
            source,
        })?;
        Ok((
            u64::try_from(low).unwrap_or(0),
            u64::try_from(high).unwrap_or(0),
        ))
    }

    /// An error from the consumer: an offset out of range becomes the gap (or reset) it is;
    /// anything else is broker trouble to wait out, read again from the position.
    async fn consume_error(
        &mut self,
        consumer: &Arc<StreamConsumer>,
        err: KafkaError,
    ) -> KafkaSourceError {
        let out_of_range = matches!(
            err.rdkafka_error_code(),
            Some(RDKafkaErrorCode::AutoOffsetReset | RDKafkaErrorCode::OffsetOutOfRange)
        );
        if out_of_range {
            if let Err(fatal) = self.check_watermarks(consumer).await {
                return fatal;
            }
        }
        // The next read starts over from the position with a fresh consumer.
        self.consumer = None;
        KafkaSourceError::Request {
            what: "fetch",
            source: err,
        }
    }

    /// Appends one message; `false` for one below the position (fetched before a re-assignment).
    fn append(
        &mut self,
        message: &BorrowedMessage<'_>,
        out: &mut SourceOutput<'_>,
    ) -> Result<bool, SourceError> {
        let Ok(offset) = u64::try_from(message.offset()) else {
            return Ok(false);
        };
        if self.next.is_some_and(|next| offset < next) {
            return Ok(false);
        }
        let millis = message.timestamp().to_millis().unwrap_or(0);
        let record = BrokerRecord {
            position: offset,
            payload: message.payload().unwrap_or_default(),
            origin: message.topic(),
            timestamp_seconds: u64::try_from(millis / 1000).unwrap_or(0),
            key: message.key(),
        };
        self.decoder.append(&record, out)?;
        self.next = Some(offset + 1);
        Ok(true)
    }

    /// Hands the read position to the monitoring group, now and then, without waiting.
    fn commit_for_monitoring(&mut self) {
        let (Some(consumer), Some(next), true) = (&self.consumer, self.next, self.monitoring_group)
        else {
            return;
        };
        if self
            .committed_at
            .is_some_and(|at| at.elapsed() < COMMIT_EVERY)
        {
            return;
        }
        self.committed_at = Some(Instant::now());
        let mut offsets = TopicPartitionList::with_capacity(1);
        let offset = Offset::Offset(i64::try_from(next).unwrap_or(i64::MAX));
        if offsets
            .add_partition_offset(&self.topic, self.kafka_partition, offset)
            .is_ok()
        {
            // Monitoring only: a failed commit changes nothing flow relies on.
            let _ = consumer.commit(&offsets, CommitMode::Async);
        }
    }

    /// A broker error that waiting can cure: warn now and then, wait a little, read on later.
    async fn broker_trouble(&mut self, err: KafkaSourceError, deadline: Instant) {
        let (partition, topic, kafka_partition, position) =
            (self.partition, &self.topic, self.kafka_partition, self.next);
        self.trouble
            .wait(deadline, || {
                warn!(
                    partition,
                    topic = %topic,
                    kafka_partition,
                    position = ?position,
                    error = %err,
                    "cannot read from Kafka; retrying from the position. Check that the brokers are up and the topic exists"
                );
            })
            .await;
    }
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

    fn reader(next: Option<u64>) -> KafkaPartition {
        KafkaPartition {
            config: Arc::new(ClientConfig::new()),
            topic: "t".into(),
            kafka_partition: 3,
            partition: 1,
            decoder: BrokerDecoder::new(
                1,
                BrokerDecoder::schema_of(BrokerFormat::Raw, None, "topic", true)
                    .unwrap_or_else(|v| panic!("{v}")),
                BrokerFormat::Raw,
                OnBadRecord::Stop,
                true,
            ),
            monitoring_group: false,
            next,
            consumer: None,
            high: None,
            watermarks_at: None,
            committed_at: None,
            trouble: TroubleWait::default(),
        }
    }

    #[test]
    fn a_position_below_the_low_watermark_is_a_gap_naming_the_lost_offsets() {
        let err = reader(Some(40))
            .check_range(100, 500)
            .err()
            .map(|e| e.to_string());
        let err = err.unwrap_or_default();
        assert!(err.contains("no longer holds offsets 40..99"), "{err}");
        assert!(reader(Some(600))
            .check_range(0, 500)
            .is_err_and(|e| matches!(e, KafkaSourceError::Reset { high: 500, .. })));
        assert!(reader(Some(100)).check_range(100, 500).is_ok());
        assert!(reader(None).check_range(100, 500).is_ok());
    }
}
