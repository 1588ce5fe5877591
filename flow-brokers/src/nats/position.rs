//! The committed position of a `nats_jetstream` partition: the stream sequence of the last message
//! read, and the identity of the stream those sequences count in.
//!
//! A stream deleted and created again under the same name numbers its messages from 1 again, so a
//! sequence alone cannot tell the old stream from the new one once the new one holds as many
//! messages as the position: reading on at the position + 1 would skip the new stream's first
//! messages. The stream's creation time (from stream info) tells them apart; it is committed with
//! the sequence. Positions committed before identities were kept are one word long: they are
//! still read, and the stream's identity is adopted on the next commit.

use flow_core::sources::{decode_broker_words, encode_broker_words};
use flow_core::SourceError;

use crate::broker_source::utc_text;

/// Words of a position: the sequence alone (older flow versions), or with the identity.
const LEGACY_WORDS: usize = 1;
const WORDS: usize = 3;

/// What identifies one life of a stream under its name.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct StreamIdentity {
    /// The stream's `created` time from stream info, in nanoseconds since the Unix epoch; 0 when
    /// the server gave none.
    pub created_ns: u64,
    /// The lowest sequence the stream held when the partition last asked (it only grows in
    /// one life of a stream, as retention removes messages).
    pub first_sequence: u64,
}

impl StreamIdentity {
    /// Why `now` is not the stream this identity was taken from, or `None` when it is.
    pub(crate) fn change_to(&self, now: &StreamIdentity) -> Option<String> {
        if self.created_ns != 0 && now.created_ns != 0 {
            return (self.created_ns != now.created_ns).then(|| {
                format!(
                    "it was created at {}, and the stream of that name now was created at {}",
                    utc_text(self.created_ns),
                    utc_text(now.created_ns)
                )
            });
        }
        // Without creation times (a server that gives none), only the first sequence tells: it
        // never goes back within one life of a stream.
        (now.first_sequence < self.first_sequence).then(|| {
            format!(
                "its first sequence was {} and is now {}, which no stream's retention does",
                self.first_sequence, now.first_sequence
            )
        })
    }
}

/// A partition's position as committed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct NatsPosition {
    /// The stream sequence of the last message read (or passed as caught up); 0 before any.
    pub last: u64,
    /// The stream the sequence counts in; `None` before the partition first asked for stream
    /// info, and for a position an older flow committed.
    pub identity: Option<StreamIdentity>,
}

impl NatsPosition {
    /// The position as committed: one word until the identity is known, three after.
    pub(crate) fn encode(&self) -> Vec<u8> {
        match self.identity {
            None => encode_broker_words(&[self.last]),
            Some(identity) => {
                encode_broker_words(&[self.last, identity.created_ns, identity.first_sequence])
            }
        }
    }

    /// A committed position, in either form.
    pub(crate) fn decode(bytes: &[u8]) -> Result<NatsPosition, SourceError> {
        let words = decode_broker_words(bytes, &[LEGACY_WORDS, WORDS])?;
        Ok(match words.as_slice() {
            &[last, created_ns, first_sequence] => NatsPosition {
                last,
                identity: Some(StreamIdentity {
                    created_ns,
                    first_sequence,
                }),
            },
            _ => NatsPosition {
                last: words.first().copied().unwrap_or(0),
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
        let with = NatsPosition {
            last: 150,
            identity: Some(StreamIdentity {
                created_ns: 1_764_763_200_123_456_789,
                first_sequence: 1,
            }),
        };
        assert_eq!(with.encode().len(), 24);
        assert_eq!(NatsPosition::decode(&with.encode()).ok(), Some(with));
        // What flow committed before identities: the big-endian sequence alone.
        let old = 150u64.to_be_bytes();
        assert_eq!(
            NatsPosition::decode(&old).ok(),
            Some(NatsPosition {
                last: 150,
                identity: None
            })
        );
        assert_eq!(
            NatsPosition {
                last: 150,
                identity: None
            }
            .encode(),
            old.to_vec()
        );
        let err = NatsPosition::decode(&[0; 16])
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(err.contains("is 8 or 24 bytes, not 16"), "{err}");
    }

    #[test]
    fn a_new_creation_time_is_a_new_stream_and_a_later_first_sequence_is_not() {
        let old = StreamIdentity {
            created_ns: 1_764_763_200_000_000_000,
            first_sequence: 1,
        };
        let purged = StreamIdentity {
            first_sequence: 90,
            ..old
        };
        assert_eq!(old.change_to(&purged), None);
        let recreated = StreamIdentity {
            created_ns: 1_764_763_260_500_000_000,
            first_sequence: 1,
        };
        assert_eq!(
            old.change_to(&recreated).as_deref(),
            Some("it was created at 2025-12-03T12:00:00.000000000Z, and the stream of that name now was created at 2025-12-03T12:01:00.500000000Z")
        );
        let unknown = |first_sequence| StreamIdentity {
            created_ns: 0,
            first_sequence,
        };
        assert_eq!(unknown(40).change_to(&unknown(41)), None);
        assert_eq!(
            unknown(40).change_to(&unknown(1)).as_deref(),
            Some("its first sequence was 40 and is now 1, which no stream's retention does")
        );
    }
}
