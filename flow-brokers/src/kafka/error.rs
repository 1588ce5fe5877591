//! Why the `kafka` source could not read, and which of its errors waiting cannot cure.

use rdkafka::error::KafkaError;

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
    #[error("topic `{topic}` partition {kafka_partition} ends at offset {high}, below flow partition {partition}'s committed position {position}: the topic was deleted and created again, so its offsets no longer name the messages flow committed. {RESET_REMEDY}")]
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
    /// The topic under the source's name is not the one the committed position counts in.
    #[error("topic `{topic}` was deleted and created again: flow partition {partition} committed offset {position} of partition {kafka_partition}, but {change}; its offsets name other messages, and reading on at {position} would skip the new topic's first {position} message(s). {RESET_REMEDY}")]
    Recreated {
        /// The topic.
        topic: String,
        /// The Kafka partition.
        kafka_partition: i32,
        /// The flow partition reading it.
        partition: u32,
        /// The committed position (the next offset to read).
        position: u64,
        /// What differs: the low watermark, or the timestamp of the last message read.
        change: String,
    },
}

/// What a partition whose topic was created again is told to do.
const RESET_REMEDY: &str = "To read the new topic from its beginning, start the pipeline with a new state directory (batches this one holds undelivered, which `flow-worker status` lists, cannot be rebuilt from the new topic)";

impl KafkaSourceError {
    /// Waiting cannot cure these: the partition stops.
    pub(crate) fn is_fatal(&self) -> bool {
        matches!(
            self,
            KafkaSourceError::Gap { .. }
                | KafkaSourceError::Reset { .. }
                | KafkaSourceError::Recreated { .. }
                | KafkaSourceError::Client { .. }
        )
    }
}
