//! The reader of one partition: a consumer with the Kafka partition assigned by hand at the
//! position, the watermarks asked now and then for the lag and for lost offsets.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use flow_core::sources::{BrokerDecoder, BrokerRecord};
use flow_core::{ReadLimits, Source, SourceError, SourceOutput, SourceRead};
use futures_util::FutureExt;
use rdkafka::config::ClientConfig;
use rdkafka::consumer::{CommitMode, Consumer, StreamConsumer};
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::message::{BorrowedMessage, Message};
use rdkafka::{Offset, TopicPartitionList};
use tokio::time::Instant;
use tracing::{info, warn};

use super::error::KafkaSourceError;
use super::position::{KafkaPosition, TopicIdentity};
use crate::broker_source::{Broker, TroubleWait};

/// How long a watermark query may take.
const WATERMARK_TIMEOUT: Duration = Duration::from_secs(10);
/// Between two watermark queries of one partition (they give the lag).
const WATERMARK_EVERY: Duration = Duration::from_secs(1);
/// Between two monitoring commits to `group_id`.
const COMMIT_EVERY: Duration = Duration::from_secs(5);

/// The Kafka side of the source's factory: the consumer configuration every partition's
/// reader uses.
pub(crate) struct KafkaTopic {
    config: Arc<ClientConfig>,
    topic: String,
    monitoring_group: bool,
}

impl KafkaTopic {
    /// Reads `topic` with consumers of `config`; `monitoring_group`: commit the read positions
    /// to the configured group now and then.
    pub(crate) fn new(config: ClientConfig, topic: String, monitoring_group: bool) -> Self {
        KafkaTopic {
            config: Arc::new(config),
            topic,
            monitoring_group,
        }
    }
}

impl Broker for KafkaTopic {
    /// The Kafka partition the flow partition reads.
    type Target = i32;
    const WITH_KEY: bool = true;

    fn no_target(partition: u32) -> String {
        format!("no Kafka partition is configured for flow partition {partition}")
    }

    /// Every partition of a topic has the topic as its subject.
    fn subject(&self, _: &i32) -> String {
        self.topic.clone()
    }

    /// The same offset, whatever identity each position carries: a reader opened at a position
    /// committed without one adopts the topic's, and the low watermark in it is as each reader
    /// last saw it, so a replay must stop at the committed offset however it was written.
    fn same_position(&self, a: &[u8], b: &[u8]) -> bool {
        if a.is_empty() || b.is_empty() {
            return a == b;
        }
        match (KafkaPosition::decode(a), KafkaPosition::decode(b)) {
            (Ok(a), Ok(b)) => a.next == b.next,
            _ => a == b,
        }
    }

    fn open(
        &self,
        partition: u32,
        kafka_partition: i32,
        decoder: BrokerDecoder,
        position: Option<&[u8]>,
    ) -> Result<Box<dyn Source>, SourceError> {
        // An empty position: committed before the partition's first message.
        let position = position
            .filter(|p| !p.is_empty())
            .map(KafkaPosition::decode)
            .transpose()?;
        Ok(Box::new(KafkaPartition {
            config: Arc::clone(&self.config),
            topic: self.topic.clone(),
            kafka_partition,
            partition,
            decoder,
            monitoring_group: self.monitoring_group,
            next: position.map(|p| p.next),
            identity: position.and_then(|p| p.identity),
            without_identity: position.is_some_and(|p| p.identity.is_none()),
            verify: None,
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
    /// The topic `next` counts in, committed with it; `None` until the first watermarks.
    identity: Option<TopicIdentity>,
    /// The committed position came without an identity (an older flow wrote it).
    without_identity: bool,
    /// The offset (the position − 1) whose message the consumer was assigned at to compare its
    /// timestamp with the one read there; the message itself is not appended again.
    verify: Option<u64>,
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
            position: self
                .next
                .map(|next| {
                    KafkaPosition {
                        next,
                        identity: self.identity,
                    }
                    .encode()
                })
                .unwrap_or_default(),
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
                    if self.verified(&message).map_err(ReadError::Broker)? {
                        continue;
                    }
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

    /// A consumer with the partition assigned at the position (the earliest offset before any),
    /// or at the message before it when its timestamp is known, to tell the topic is the same.
    async fn assign(&mut self) -> Result<Arc<StreamConsumer>, KafkaSourceError> {
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
        // Before the first read: the broker must still hold the position, in the same topic.
        let (low, high) = self.watermarks(&consumer).await?;
        self.check_range(low, high)?;
        self.check_low(low)?;
        let known_timestamp = self.identity.is_some_and(|i| i.last_timestamp_ms != 0);
        self.verify = match self.next {
            Some(next) if next > low && known_timestamp => Some(next - 1),
            _ => None,
        };
        let offset = match (self.verify, self.next) {
            (Some(start), _) | (None, Some(start)) => {
                Offset::Offset(i64::try_from(start).unwrap_or(i64::MAX))
            }
            (None, None) => Offset::Beginning,
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
        self.check_range(low, high)?;
        self.check_low(low)
    }

    /// Refuses a low watermark below the one seen (the topic was created again); adopts the
    /// identity when the position has none yet.
    fn check_low(&mut self, low: u64) -> Result<(), KafkaSourceError> {
        match &mut self.identity {
            Some(known) => {
                if let Some(change) = known.low_change(low) {
                    return Err(self.recreated(change));
                }
                known.low = low;
            }
            None => {
                if self.without_identity {
                    info!(
                        partition = self.partition,
                        topic = %self.topic,
                        kafka_partition = self.kafka_partition,
                        position = ?self.next,
                        "the committed position of flow partition {} was written without the topic's identity; adopting low watermark {low} of topic `{}` partition {}, committed with the next epoch: from then on a topic deleted and created again stops the partition. A re-creation before this run cannot be told apart",
                        self.partition,
                        self.topic,
                        self.kafka_partition
                    );
                }
                self.identity = Some(TopicIdentity {
                    low,
                    last_timestamp_ms: 0,
                });
            }
        }
        Ok(())
    }

    /// `true` for the message assigned to be compared with the one read at the position − 1
    /// (not appended again); refuses it when its timestamp differs: another topic.
    fn verified(&mut self, message: &BorrowedMessage<'_>) -> Result<bool, KafkaSourceError> {
        let Some(offset) = self.verify.take() else {
            return Ok(false);
        };
        if u64::try_from(message.offset()) != Ok(offset) {
            // Not there any more (compacted away): nothing to compare with.
            return Ok(false);
        }
        let change = self
            .identity
            .and_then(|known| known.timestamp_change(offset, timestamp_ms(message)));
        match change {
            Some(change) => Err(self.recreated(change)),
            None => Ok(true),
        }
    }

    fn recreated(&self, change: String) -> KafkaSourceError {
        KafkaSourceError::Recreated {
            topic: self.topic.clone(),
            kafka_partition: self.kafka_partition,
            partition: self.partition,
            position: self.next.unwrap_or(0),
            change,
        }
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
        if let Some(identity) = &mut self.identity {
            identity.last_timestamp_ms = timestamp_ms(message);
        }
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

/// A message's timestamp in ms since the Unix epoch; 0 when it has none.
fn timestamp_ms(message: &BorrowedMessage<'_>) -> u64 {
    message
        .timestamp()
        .to_millis()
        .and_then(|ms| u64::try_from(ms).ok())
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use flow_core::sources::{BrokerFormat, OnBadRecord};

    use super::*;

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
            identity: None,
            without_identity: false,
            verify: None,
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

    #[test]
    fn positions_at_one_offset_are_the_same_place_whatever_identity_they_carry() {
        let topic = KafkaTopic::new(ClientConfig::new(), "t".into(), false);
        let at = |next, identity| KafkaPosition { next, identity }.encode();
        let seen = |low| {
            Some(TopicIdentity {
                low,
                last_timestamp_ms: 1_764_763_200_000,
            })
        };
        assert!(topic.same_position(&at(100, None), &at(100, seen(0))));
        assert!(topic.same_position(&at(100, seen(0)), &at(100, seen(20))));
        assert!(!topic.same_position(&at(100, seen(0)), &at(101, seen(0))));
        assert!(!topic.same_position(&[], &at(0, None)));
        assert!(topic.same_position(&[], &[]));
    }

    #[test]
    fn a_low_watermark_below_the_one_seen_stops_the_partition_as_a_topic_created_again() {
        let mut partition = reader(Some(100));
        partition.identity = Some(TopicIdentity {
            low: 20,
            last_timestamp_ms: 0,
        });
        assert!(partition.check_low(60).is_ok());
        let err = partition
            .check_low(0)
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(err.starts_with("topic `t` was deleted and created again: flow partition 1 committed offset 100 of partition 3, but its low watermark went back from 60 to 0, which no topic's retention does; its offsets name other messages, and reading on at 100 would skip the new topic's first 100 message(s)."), "{err}");
        // A position an older flow committed adopts the low watermark it first sees.
        let mut legacy = reader(Some(100));
        legacy.without_identity = true;
        assert!(legacy.check_low(0).is_ok());
        assert_eq!(
            legacy.position().position.len(),
            24,
            "the identity is committed with the next epoch"
        );
    }
}
