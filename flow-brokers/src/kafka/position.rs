//! The committed position of a `kafka` partition: the offset of the next message to read, and
//! what identifies the topic those offsets count in.
//!
//! A topic deleted and created again under the same name numbers its messages from 0 again, so an
//! offset alone cannot tell the old topic from the new one once the new one holds as many
//! messages. Kafka gives a topic a topic id for this, but the metadata rdkafka 0.38 hands over carries no
//! topic id, so the identity is made of what it does report that a
//! re-creation changes:
//! - the low watermark as last seen: within one life of a topic it only grows (retention and
//!   deletions remove the oldest offsets), and a new topic starts again at 0;
//! - the timestamp of the last message read (its offset is the position − 1): the new topic's
//!   message at that offset was produced later, so its timestamp differs (unless a producer
//!   copies the old messages with their timestamps, and then they are the same messages).
//!
//! Positions committed before identities were kept are one word long: they are still read, and
//! the identity is adopted on the next commit.

use flow_core::sources::{decode_broker_words, encode_broker_words};
use flow_core::SourceError;

use crate::broker_source::utc_text;

const LEGACY_WORDS: usize = 1;
const WORDS: usize = 3;

/// What identifies one life of a topic partition, as far as the metadata flow reads can tell.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct TopicIdentity {
    /// The partition's low watermark, the highest seen.
    pub low: u64,
    /// The timestamp of the message at the position − 1 (ms since the Unix epoch); 0 when not
    /// known (no message read yet in this life of the position, or a message without one).
    pub last_timestamp_ms: u64,
}

impl TopicIdentity {
    /// Why a low watermark of `low` is not this topic's, or `None` when it may be.
    pub(crate) fn low_change(&self, low: u64) -> Option<String> {
        (low < self.low).then(|| {
            format!(
                "its low watermark went back from {} to {low}, which no topic's retention does",
                self.low
            )
        })
    }

    /// Why `timestamp_ms` of the message at the position − 1 is not the one read there, or
    /// `None` when it is (or either is not known).
    pub(crate) fn timestamp_change(&self, offset: u64, timestamp_ms: u64) -> Option<String> {
        (self.last_timestamp_ms != 0 && timestamp_ms != 0 && timestamp_ms != self.last_timestamp_ms)
            .then(|| {
                format!(
                    "its message at offset {offset} was stored at {} when flow read it, and the one there now at {}",
                    utc_text(self.last_timestamp_ms * 1_000_000),
                    utc_text(timestamp_ms * 1_000_000)
                )
            })
    }
}

/// A partition's position as committed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct KafkaPosition {
    /// The offset of the next message to read.
    pub next: u64,
    /// `None` for a position an older flow committed.
    pub identity: Option<TopicIdentity>,
}

impl KafkaPosition {
    /// The position as committed: one word until the identity is known, three after.
    pub(crate) fn encode(&self) -> Vec<u8> {
        match self.identity {
            None => encode_broker_words(&[self.next]),
            Some(identity) => {
                encode_broker_words(&[self.next, identity.low, identity.last_timestamp_ms])
            }
        }
    }

    /// A committed position, in either form (an empty one is handled by the reader: committed
    /// before the partition's first message).
    pub(crate) fn decode(bytes: &[u8]) -> Result<KafkaPosition, SourceError> {
        let words = decode_broker_words(bytes, &[LEGACY_WORDS, WORDS])?;
        Ok(match words.as_slice() {
            &[next, low, last_timestamp_ms] => KafkaPosition {
                next,
                identity: Some(TopicIdentity {
                    low,
                    last_timestamp_ms,
                }),
            },
            _ => KafkaPosition {
                next: words.first().copied().unwrap_or(0),
                identity: None,
            },
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn positions_with_and_without_identity_round_trip_and_the_old_form_is_read() {
        let with = KafkaPosition {
            next: 100,
            identity: Some(TopicIdentity {
                low: 20,
                last_timestamp_ms: 1_764_763_200_000,
            }),
        };
        assert_eq!(with.encode().len(), 24);
        assert_eq!(KafkaPosition::decode(&with.encode()).ok(), Some(with));
        let old = 100u64.to_be_bytes();
        let legacy = KafkaPosition {
            next: 100,
            identity: None,
        };
        assert_eq!(KafkaPosition::decode(&old).ok(), Some(legacy));
        assert_eq!(legacy.encode(), old.to_vec());
        assert!(KafkaPosition::decode(&[0; 16]).is_err());
    }

    #[test]
    fn a_topic_created_again_is_told_by_its_low_watermark_or_the_last_message_read() {
        let known = TopicIdentity {
            low: 20,
            last_timestamp_ms: 1_764_763_200_000,
        };
        // Retention moves the low watermark up: the same topic.
        assert_eq!(known.low_change(20), None);
        assert_eq!(known.low_change(60), None);
        assert_eq!(
            known.low_change(0).as_deref(),
            Some("its low watermark went back from 20 to 0, which no topic's retention does")
        );
        // The message flow read last is still there, unchanged: the same topic.
        assert_eq!(known.timestamp_change(99, 1_764_763_200_000), None);
        assert_eq!(
            known.timestamp_change(99, 1_764_763_260_500).as_deref(),
            Some("its message at offset 99 was stored at 2025-12-03T12:00:00.000000000Z when flow read it, and the one there now at 2025-12-03T12:01:00.500000000Z")
        );
        // Unknown on either side: nothing to tell by.
        let unknown = TopicIdentity {
            low: 0,
            last_timestamp_ms: 0,
        };
        assert_eq!(unknown.timestamp_change(99, 1_764_763_260_500), None);
        assert_eq!(known.timestamp_change(99, 0), None);
    }
}
