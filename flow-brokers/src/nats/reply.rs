//! What the reader takes from a JetStream message's reply subject: the stream sequence of every
//! message, and the pending count and the timestamp only when it uses them (the lag after a read;
//! the `timestamp` column of `format: raw`). `async_nats::jetstream::Message::info` parses every
//! field (two 64-bit and one 128-bit number, a date) for each message, which cost 6.7% of a
//! profiled run.
//!
//! The two forms of ADR-15, after the `$JS.ACK.` prefix:
//! `<stream>.<consumer>.<delivered>.<stream seq>.<consumer seq>.<timestamp ns>.<pending>` (7
//! tokens), and `<domain>.<account hash>.<stream>.<consumer>.<delivered>.<stream seq>.<consumer
//! seq>.<timestamp ns>.<pending>[.<token>...]` (9 or more). Stream and consumer names hold no `.`,
//! so the position of each field follows from the token count.

const PREFIX: &str = "$JS.ACK.";

/// The fields of one reply subject the reader may use; only the stream sequence is parsed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct AckReply<'a> {
    /// The message's stream sequence.
    pub stream_sequence: u64,
    timestamp_ns: &'a str,
    pending: &'a str,
    subject: &'a str,
}

/// Why a reply subject is not one of a JetStream message.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("the reply subject `{subject}` of a JetStream message is not `$JS.ACK.<stream>.<consumer>.<delivered>.<stream seq>.<consumer seq>.<timestamp>.<pending>` (with `<domain>.<account hash>.` before the stream on newer servers): {what}. Is the server a NATS JetStream server (2.2 or later), and does anything between it and the worker rewrite subjects?")]
pub struct ReplyError {
    /// The reply subject as received (empty when the message had none).
    pub subject: String,
    /// What is wrong with it.
    pub what: String,
}

impl<'a> AckReply<'a> {
    /// The stream sequence of `subject`, keeping the other fields' text for later.
    pub(crate) fn parse(subject: &'a str) -> Result<AckReply<'a>, ReplyError> {
        let fail = |what: String| ReplyError {
            subject: subject.to_owned(),
            what,
        };
        let rest = subject
            .strip_prefix(PREFIX)
            .ok_or_else(|| fail(format!("it does not start with `{PREFIX}`")))?;
        // One pass over the bytes notes where the first tokens end: a `split('.')` searched
        // for each dot anew, 5 % of a profiled JetStream run.
        let mut ends = [rest.len(); 10];
        let mut count = 1;
        for (at, byte) in rest.bytes().enumerate() {
            if byte == b'.' {
                if let Some(end) = ends.get_mut(count - 1) {
                    *end = at;
                }
                count += 1;
            }
        }
        // The index of the stream sequence: the 4th token of the old form, the 6th of the new.
        let at = match count {
            7 => 3,
            9.. => 5,
            n => {
                return Err(fail(format!(
                    "it has {n} token(s) after `{PREFIX}`, where 7 or at least 9 are expected"
                )))
            }
        };
        let token = |k: usize| {
            let start = if k == 0 { 0 } else { ends[k - 1] + 1 };
            &rest[start..ends[k]]
        };
        let sequence = token(at);
        let stream_sequence = sequence.parse().map_err(|_| {
            fail(format!(
                "its stream sequence `{sequence}` is not an unsigned number"
            ))
        })?;
        Ok(AckReply {
            stream_sequence,
            timestamp_ns: token(at + 2),
            pending: token(at + 3),
            subject,
        })
    }

    /// The messages of the consumer's subject the server held beyond this one when it sent it.
    pub(crate) fn pending(&self) -> Result<u64, ReplyError> {
        self.pending.parse().map_err(|_| ReplyError {
            subject: self.subject.to_owned(),
            what: format!(
                "its pending count `{}` is not an unsigned number",
                self.pending
            ),
        })
    }

    /// When the server stored the message, in whole seconds since the Unix epoch.
    pub(crate) fn timestamp_seconds(&self) -> Result<u64, ReplyError> {
        self.timestamp_ns
            .parse::<u64>()
            .map(|ns| ns / 1_000_000_000)
            .map_err(|_| ReplyError {
                subject: self.subject.to_owned(),
                what: format!(
                    "its timestamp `{}` is not a count of nanoseconds",
                    self.timestamp_ns
                ),
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_old_form_gives_the_stream_sequence_pending_and_timestamp() {
        let reply = AckReply::parse("$JS.ACK.EVENTS.c1.1.4711.12.1764763200123456789.99")
            .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(reply.stream_sequence, 4711);
        assert_eq!(reply.pending(), Ok(99));
        assert_eq!(reply.timestamp_seconds(), Ok(1_764_763_200));
    }

    #[test]
    fn the_new_form_with_domain_hash_and_trailing_tokens_gives_the_same_fields() {
        for subject in [
            "$JS.ACK.hub.ACCHASH.EVENTS.c1.1.4711.12.1764763200123456789.99",
            "$JS.ACK._.ACCHASH.EVENTS.c1.1.4711.12.1764763200123456789.99.rnd",
            "$JS.ACK._.ACCHASH.EVENTS.c1.1.4711.12.1764763200123456789.99.rnd.more.tokens",
        ] {
            let reply = AckReply::parse(subject).unwrap_or_else(|e| panic!("{e}"));
            assert_eq!(reply.stream_sequence, 4711, "{subject}");
            assert_eq!(reply.pending(), Ok(99), "{subject}");
            assert_eq!(reply.timestamp_seconds(), Ok(1_764_763_200), "{subject}");
        }
    }

    #[test]
    fn a_malformed_reply_subject_is_named_with_what_is_wrong() {
        let err = |subject| {
            AckReply::parse(subject)
                .err()
                .map(|e| e.to_string())
                .unwrap_or_default()
        };
        assert_eq!(
            err("$JS.ACK.EVENTS.c1.1.x47.12.1764763200123456789.99"),
            "the reply subject `$JS.ACK.EVENTS.c1.1.x47.12.1764763200123456789.99` of a JetStream message is not `$JS.ACK.<stream>.<consumer>.<delivered>.<stream seq>.<consumer seq>.<timestamp>.<pending>` (with `<domain>.<account hash>.` before the stream on newer servers): its stream sequence `x47` is not an unsigned number. Is the server a NATS JetStream server (2.2 or later), and does anything between it and the worker rewrite subjects?"
        );
        assert!(err("$JS.ACK.EVENTS.c1.1.2.3.4").contains(
            "`$JS.ACK.EVENTS.c1.1.2.3.4` of a JetStream message is not `$JS.ACK.<stream>.<consumer>"
        ));
        assert!(err("$JS.ACK.EVENTS.c1.1.2.3.4")
            .contains(": it has 6 token(s) after `$JS.ACK.`, where 7 or at least 9 are expected."));
        assert!(err("_INBOX.abc.1")
            .contains("`_INBOX.abc.1` of a JetStream message is not `$JS.ACK.<stream>"));
        assert!(err("_INBOX.abc.1").contains(": it does not start with `$JS.ACK.`."));
        let reply =
            AckReply::parse("$JS.ACK.EVENTS.c1.1.5.12.-3.many").unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(reply.stream_sequence, 5);
        assert_eq!(
            reply.pending().err().map(|e| e.what),
            Some("its pending count `many` is not an unsigned number".to_owned())
        );
        assert_eq!(
            reply.timestamp_seconds().err().map(|e| e.what),
            Some("its timestamp `-3` is not a count of nanoseconds".to_owned())
        );
    }
}
