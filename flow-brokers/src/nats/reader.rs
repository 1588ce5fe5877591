//! The reader of one partition: a pull consumer on the partition's subject, made again at the
//! last sequence read + 1 after any error.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream::consumer::{pull, AckPolicy, DeliverPolicy, PullConsumer};
use async_nats::jetstream::context::{GetStreamError, GetStreamErrorKind};
use async_nats::jetstream::{self, Context, ErrorCode};
use async_trait::async_trait;
use flow_core::sources::{BrokerDecoder, BrokerRecord};
use flow_core::{ReadLimits, Source, SourceError, SourceOutput, SourceRead};
use futures_util::StreamExt;
use tokio::sync::OnceCell;
use tokio::time::Instant;
use tracing::{info, warn};

use super::auth::ConnectSettings;
use super::error::{NatsSourceError, StreamRefusal};
use super::position::{NatsPosition, StreamIdentity};
use crate::broker_source::{utc_text, Broker, TroubleWait};

/// A pull shorter than this is not worth a round trip: the read returns what it has.
const MIN_PULL: Duration = Duration::from_millis(20);
/// How long past its own expiry a pull may take before the reader gives up on it.
const PULL_GRACE: Duration = Duration::from_secs(5);
/// The server removes a consumer nobody pulled from for this long (a reader that crashed).
const CONSUMER_INACTIVE: Duration = Duration::from_secs(120);

/// What every partition of one source shares: one connection, the check at start, whether the
/// stream was last seen.
struct Shared {
    servers: Vec<String>,
    stream: String,
    /// Every partition's subject.
    subjects: Vec<String>,
    connect: ConnectSettings,
    context: OnceCell<Context>,
    /// The server's answer at start about the stream and the subjects, once it gave one.
    checked: OnceCell<Result<(), StreamRefusal>>,
    /// The stream was found missing at the last look of any partition (after the start).
    missing: AtomicBool,
}

impl Shared {
    /// Before any partition reads: the stream exists and takes every partition's subject.
    /// A definite answer (the stream or a subject is not there) is kept and refuses every
    /// partition; an unreachable server is trouble to wait out, and asked again.
    async fn start_check(&self) -> Result<(), NatsSourceError> {
        let outcome = self
            .checked
            .get_or_try_init(|| async {
                let context = self.context().await?;
                match context.get_stream(&self.stream).await {
                    Ok(stream) => Ok(self
                        .subject_refusal(&stream.cached_info().config.subjects, &self.subjects)
                        .map_or(Ok(()), Err)),
                    Err(err) if is_stream_not_found(&err) => Ok(Err(StreamRefusal::NoStream {
                        stream: self.stream.clone(),
                        servers: self.servers.join(","),
                        first_server: self.servers.first().cloned().unwrap_or_default(),
                        subjects: self.subjects.join(","),
                    })),
                    Err(source) => Err(NatsSourceError::Stream {
                        stream: self.stream.clone(),
                        source: Box::new(source),
                    }),
                }
            })
            .await?;
        outcome.clone().map_err(NatsSourceError::Refused)
    }

    /// The refusal of `subjects` that none of the stream's `stream_subjects` takes. A stream
    /// without subjects of its own (a mirror, or one fed by sources) is not checked: what it
    /// holds is not told by its configuration.
    fn subject_refusal(
        &self,
        stream_subjects: &[String],
        subjects: &[String],
    ) -> Option<StreamRefusal> {
        if stream_subjects.is_empty() {
            return None;
        }
        let outside: Vec<String> = subjects
            .iter()
            .filter(|subject| {
                !stream_subjects
                    .iter()
                    .any(|pattern| subject_matches(pattern, subject))
            })
            .map(|subject| format!("`{subject}`"))
            .collect();
        (!outside.is_empty()).then(|| StreamRefusal::SubjectOutside {
            stream: self.stream.clone(),
            outside: outside.join(", "),
            stream_subjects: stream_subjects
                .iter()
                .map(|subject| format!("`{subject}`"))
                .collect::<Vec<_>>()
                .join(", "),
        })
    }

    /// Records whether the stream was there at a partition's look; warns once per change.
    fn stream_seen(&self, present: bool) {
        let was_missing = self.missing.swap(!present, Ordering::Relaxed);
        match (was_missing, present) {
            (false, false) => warn!(
                stream = %self.stream,
                servers = %self.servers.join(","),
                "JetStream stream `{}` no longer exists: every partition of this source waits for it, reading nothing. If it was deleted by mistake, restore it from a backup (`nats stream restore`); a stream created anew under that name stops the partitions, since its sequences name other messages",
                self.stream
            ),
            (true, true) => warn!(
                stream = %self.stream,
                "JetStream stream `{}` exists again: a partition reads on if it is the stream its position counts in (restored), and stops if it was created anew",
                self.stream
            ),
            _ => {}
        }
    }

    async fn context(&self) -> Result<&Context, NatsSourceError> {
        self.context
            .get_or_try_init(|| async {
                let client = self
                    .connect
                    .options()
                    .await?
                    .connect(self.servers.as_slice())
                    .await
                    .map_err(|source| NatsSourceError::Connect {
                        servers: self.servers.join(","),
                        source,
                    })?;
                Ok(jetstream::new(client))
            })
            .await
    }
}

/// The JetStream side of the source's factory: one connection for every partition.
pub(crate) struct JetStream {
    shared: Arc<Shared>,
    max_per_pull: usize,
}

impl JetStream {
    /// The reader of `partition` from `position`, before it has asked the server anything.
    fn reader(
        &self,
        partition: u32,
        subject: String,
        decoder: BrokerDecoder,
        position: Option<NatsPosition>,
    ) -> NatsPartition {
        NatsPartition {
            shared: Arc::clone(&self.shared),
            subject,
            decoder,
            partition,
            max_per_pull: self.max_per_pull,
            last: position.map_or(0, |p| p.last),
            identity: position.and_then(|p| p.identity),
            without_identity: position.is_some_and(|p| p.identity.is_none() && p.last > 0),
            started: false,
            consumer: None,
            idle: false,
            lag: None,
            trouble: TroubleWait::default(),
        }
    }

    /// Reads `subjects` (one per partition) of `stream` from `servers`, connecting on the first
    /// read of any partition.
    pub(crate) fn new(
        servers: Vec<String>,
        stream: String,
        subjects: Vec<String>,
        connect: ConnectSettings,
        max_per_pull: usize,
    ) -> Self {
        JetStream {
            shared: Arc::new(Shared {
                servers,
                stream,
                subjects,
                connect,
                context: OnceCell::new(),
                checked: OnceCell::new(),
                missing: AtomicBool::new(false),
            }),
            max_per_pull,
        }
    }
}

impl Broker for JetStream {
    /// The partition's subject.
    type Target = String;
    const WITH_KEY: bool = false;

    fn no_target(partition: u32) -> String {
        format!("no subject is configured for partition {partition}")
    }

    /// `read` pulls only when the epoch's deadline is more than [`MIN_PULL`] away: an epoch of
    /// `MIN_PULL` or less would end every time without a pull and read nothing, silently.
    fn min_epoch_duration(&self) -> Option<(Duration, String)> {
        Some((
            MIN_PULL + Duration::from_millis(1),
            format!(
                "a NATS JetStream pull waits at least {} ms, and an epoch that ends within that never pulls a message",
                MIN_PULL.as_millis()
            ),
        ))
    }

    /// The same sequence, whatever identity each position carries: a reader opened at a position
    /// committed without one adopts the stream's, and the first sequence in it is as each reader
    /// last saw it, so a replay must stop at the committed sequence however it was written.
    fn same_position(&self, a: &[u8], b: &[u8]) -> bool {
        match (NatsPosition::decode(a), NatsPosition::decode(b)) {
            (Ok(a), Ok(b)) => a.last == b.last,
            _ => a == b,
        }
    }

    /// Every partition of the source waits while its stream is missing.
    fn unavailable(&self, _partition: u32) -> Option<String> {
        let shared = &self.shared;
        shared.missing.load(Ordering::Relaxed).then(|| {
            format!(
                "stream `{}` no longer exists on {}: the partition waits for it, reading nothing. Restore it; a stream created anew under that name stops the partition",
                shared.stream,
                shared.servers.join(",")
            )
        })
    }

    fn open(
        &self,
        partition: u32,
        subject: String,
        decoder: BrokerDecoder,
        position: Option<&[u8]>,
    ) -> Result<Box<dyn Source>, SourceError> {
        let position = position.map(NatsPosition::decode).transpose()?;
        Ok(Box::new(self.reader(partition, subject, decoder, position)))
    }
}

struct NatsPartition {
    shared: Arc<Shared>,
    partition: u32,
    subject: String,
    decoder: BrokerDecoder,
    max_per_pull: usize,
    /// The stream sequence of the last message read (or skipped as caught up): the position.
    last: u64,
    /// The stream `last` counts in, committed with it; `None` until the first stream info.
    identity: Option<StreamIdentity>,
    /// The committed position came without an identity (an older flow wrote it): the first
    /// stream info is adopted, and said so.
    without_identity: bool,
    /// The source's check at start passed for this partition.
    started: bool,
    consumer: Option<PullConsumer>,
    /// The previous pull returned nothing: the next one learns the stream's head first.
    idle: bool,
    /// Messages of the subject the server holds beyond `last`: the `pending` count of the last
    /// message read, or 0 after a pull that found nothing. `None` before the first pull.
    lag: Option<u64>,
    trouble: TroubleWait,
}

/// How one pull ended.
enum Pulled {
    /// The request ran to its end (count reached or expired); `messages` were appended.
    Complete { messages: usize },
    /// The request failed or overran its time; the consumer is dropped.
    Broken(NatsSourceError),
}

#[async_trait]
impl Source for NatsPartition {
    async fn read(
        &mut self,
        out: &mut SourceOutput<'_>,
        limits: ReadLimits,
    ) -> Result<SourceRead, SourceError> {
        let now = Instant::now();
        if limits.deadline <= now + MIN_PULL || limits.max_messages == 0 {
            return Ok(self.position());
        }
        match self.pull(out, limits).await {
            Ok(()) => Ok(self.position()),
            Err(NatsSourceError::Record(err)) => Err(*err),
            Err(err) if err.is_fatal() => Err(SourceError::Plugin(Box::new(err))),
            Err(err) => {
                self.broker_trouble(err, limits.deadline).await;
                Ok(self.position())
            }
        }
    }

    async fn close(&mut self) {
        if let (Some(consumer), Ok(context)) = (self.consumer.take(), self.shared.context().await) {
            let name = consumer.cached_info().name.clone();
            if let Ok(stream) = context.get_stream(&self.shared.stream).await {
                let _ = stream.delete_consumer(&name).await;
            }
        }
    }
}

impl NatsPartition {
    fn position(&self) -> SourceRead {
        let position = NatsPosition {
            last: self.last,
            identity: self.identity,
        };
        SourceRead {
            position: position.encode(),
            exhausted: false,
            lag: self.lag,
        }
    }

    /// Pulls once (creating the consumer first if needed), appending what arrives.
    async fn pull(
        &mut self,
        out: &mut SourceOutput<'_>,
        limits: ReadLimits,
    ) -> Result<(), NatsSourceError> {
        if !self.started {
            self.shared.start_check().await?;
            self.started = true;
        }
        let head = if self.idle || self.consumer.is_none() {
            Some(self.stream_head().await?)
        } else {
            None
        };
        if self.consumer.is_none() {
            self.consumer = Some(self.create_consumer().await?);
        }
        let Some(consumer) = self.consumer.clone() else {
            return Ok(());
        };
        match self.pull_batch(&consumer, out, limits).await {
            Pulled::Complete { messages } => {
                self.idle = messages == 0;
                if messages == 0 {
                    self.lag = Some(0);
                }
                // Nothing of this subject arrived up to `head`, which was taken before the pull:
                // the position may pass it, so that retention of other subjects' messages below
                // it is never taken for a loss.
                if let (0, Some(head)) = (messages, head) {
                    self.last = self.last.max(head);
                }
                Ok(())
            }
            Pulled::Broken(err) => {
                self.consumer = None;
                self.idle = false;
                Err(err)
            }
        }
    }

    /// The stream's last sequence; refuses a stream that is not the one the position counts in,
    /// or no longer holds what the position needs.
    async fn stream_head(&mut self) -> Result<u64, NatsSourceError> {
        let context = self.shared.context().await?;
        let stream = match context.get_stream(&self.shared.stream).await {
            Ok(stream) => stream,
            Err(err) if is_stream_not_found(&err) => {
                self.shared.stream_seen(false);
                return Err(NatsSourceError::StreamMissing {
                    stream: self.shared.stream.clone(),
                    servers: self.shared.servers.join(","),
                });
            }
            Err(source) => {
                return Err(NatsSourceError::Stream {
                    stream: self.shared.stream.clone(),
                    source: Box::new(source),
                })
            }
        };
        self.shared.stream_seen(true);
        let info = stream.cached_info();
        if let Some(refusal) = self
            .shared
            .subject_refusal(&info.config.subjects, std::slice::from_ref(&self.subject))
        {
            return Err(refusal.into());
        }
        let state = &info.state;
        self.check_identity(StreamIdentity {
            created_ns: u64::try_from(info.created.unix_timestamp_nanos()).unwrap_or(0),
            first_sequence: state.first_sequence,
        })?;
        if self.last > state.last_sequence {
            return Err(NatsSourceError::StreamReset {
                stream: self.shared.stream.clone(),
                partition: self.partition,
                position: self.last,
                last_sequence: state.last_sequence,
            });
        }
        if self.last > 0 && state.first_sequence > self.last + 1 {
            return Err(NatsSourceError::Gap {
                stream: self.shared.stream.clone(),
                subject: self.subject.clone(),
                partition: self.partition,
                position: self.last,
                first_sequence: state.first_sequence,
            });
        }
        Ok(state.last_sequence)
    }

    /// Refuses a stream other than the one the position counts in; adopts the stream's identity
    /// when the position has none yet, and keeps its first sequence as seen.
    fn check_identity(&mut self, now: StreamIdentity) -> Result<(), NatsSourceError> {
        match self.identity {
            Some(known) => {
                if let Some(change) = known.change_to(&now) {
                    return Err(NatsSourceError::StreamRecreated {
                        stream: self.shared.stream.clone(),
                        partition: self.partition,
                        position: self.last,
                        change,
                    });
                }
            }
            None if self.without_identity => info!(
                partition = self.partition,
                stream = %self.shared.stream,
                position = self.last,
                "the committed position of partition {} (sequence {}) was written without the stream's identity; adopting stream `{}` created at {} (first sequence {}), committed with the next epoch: from then on a stream deleted and created again stops the partition. A re-creation before this run cannot be told apart",
                self.partition,
                self.last,
                self.shared.stream,
                utc_text(now.created_ns),
                now.first_sequence
            ),
            None => {}
        }
        self.identity = Some(StreamIdentity {
            first_sequence: now
                .first_sequence
                .max(self.identity.map_or(0, |known| known.first_sequence)),
            ..now
        });
        Ok(())
    }

    async fn create_consumer(&self) -> Result<PullConsumer, NatsSourceError> {
        let context = self.shared.context().await?;
        let config = pull::Config {
            deliver_policy: DeliverPolicy::ByStartSequence {
                start_sequence: self.last + 1,
            },
            ack_policy: AckPolicy::None,
            filter_subject: self.subject.clone(),
            inactive_threshold: CONSUMER_INACTIVE,
            memory_storage: true,
            num_replicas: 1,
            ..Default::default()
        };
        context
            .create_consumer_on_stream(config, self.shared.stream.as_str())
            .await
            .map_err(|source| NatsSourceError::Request {
                what: "consumer creation",
                source: Box::new(source),
            })
    }

    /// One pull request that expires by the deadline, drained to its end.
    async fn pull_batch(
        &mut self,
        consumer: &PullConsumer,
        out: &mut SourceOutput<'_>,
        limits: ReadLimits,
    ) -> Pulled {
        let expires = limits.deadline.saturating_duration_since(Instant::now());
        let count = limits.max_messages.min(self.max_per_pull);
        let batch = consumer
            .batch()
            .max_messages(count)
            .expires(expires.max(MIN_PULL))
            .messages()
            .await;
        let mut batch = match batch {
            Ok(batch) => batch,
            Err(source) => {
                return Pulled::Broken(NatsSourceError::Request {
                    what: "pull",
                    source: Box::new(source),
                })
            }
        };
        let give_up = limits.deadline + PULL_GRACE;
        let mut messages = 0;
        loop {
            let next = match tokio::time::timeout_at(give_up, batch.next()).await {
                Ok(next) => next,
                Err(_) => return Pulled::Broken(NatsSourceError::PullOverran),
            };
            let message = match next {
                None => return Pulled::Complete { messages },
                Some(Ok(message)) => message,
                Some(Err(source)) => {
                    return Pulled::Broken(NatsSourceError::Request {
                        what: "pull",
                        source,
                    })
                }
            };
            match self.append(&message, out) {
                Ok(true) => messages += 1,
                Ok(false) => {}
                Err(err) => return Pulled::Broken(err),
            }
        }
    }

    /// Appends one message; `false` for a message at or below the position (a redelivery).
    fn append(
        &mut self,
        message: &jetstream::Message,
        out: &mut SourceOutput<'_>,
    ) -> Result<bool, NatsSourceError> {
        let info = message.info().map_err(|source| NatsSourceError::Request {
            what: "message metadata",
            source,
        })?;
        let sequence = info.stream_sequence;
        if sequence <= self.last {
            return Ok(false);
        }
        let record = BrokerRecord {
            position: sequence,
            payload: &message.payload,
            origin: message.subject.as_str(),
            timestamp_seconds: u64::try_from(info.published.unix_timestamp()).unwrap_or(0),
            key: None,
        };
        self.decoder
            .append(&record, out)
            .map_err(|source| NatsSourceError::Record(Box::new(source)))?;
        self.last = sequence;
        self.lag = Some(info.pending);
        Ok(true)
    }

    /// A broker error that waiting can cure: warn now and then, wait a little, read on later.
    async fn broker_trouble(&mut self, err: NatsSourceError, deadline: Instant) {
        if matches!(err, NatsSourceError::StreamMissing { .. }) {
            // Warned once per change by `Shared::stream_seen`; just wait.
            tokio::time::sleep_until(deadline.min(Instant::now() + Duration::from_secs(1))).await;
            return;
        }
        let (partition, subject, position) = (self.partition, &self.subject, self.last);
        self.trouble
            .wait(deadline, || {
                warn!(
                    partition,
                    subject = %subject,
                    position,
                    error = %err,
                    "cannot read from NATS JetStream; retrying from the last message read. Check that the servers are up and the stream exists"
                );
            })
            .await;
    }
}

/// The server's answer "no stream of that name" (JetStream error 10059).
fn is_stream_not_found(err: &GetStreamError) -> bool {
    matches!(err.kind(), GetStreamErrorKind::JetStream(e) if e.error_code() == ErrorCode::STREAM_NOT_FOUND)
}

/// Whether NATS subject pattern `pattern` (`*` one token, a final `>` one or more) takes the
/// literal `subject`.
fn subject_matches(pattern: &str, subject: &str) -> bool {
    let mut tokens = subject.split('.');
    for (i, want) in pattern.split('.').enumerate() {
        match (want, tokens.next()) {
            (">", Some(_)) => return pattern.split('.').count() == i + 1,
            ("*", Some(_)) => {}
            (want, Some(got)) if want == got => {}
            _ => return false,
        }
    }
    tokens.next().is_none()
}

#[cfg(test)]
mod tests {
    use flow_core::sources::{BrokerFormat, OnBadRecord};

    use super::super::auth::connect_options;
    use super::*;

    fn partition(position: Option<&[u8]>) -> NatsPartition {
        let decoder = BrokerDecoder::new(
            0,
            BrokerDecoder::schema_of(BrokerFormat::Raw, None, "subject", false)
                .unwrap_or_else(|v| panic!("{v}")),
            BrokerFormat::Raw,
            OnBadRecord::Stop,
            false,
        );
        let connect = connect_options(None, &[]).unwrap_or_else(|v| panic!("{v:?}"));
        let jetstream = JetStream::new(
            vec!["nats://127.0.0.1:1".into()],
            "EVENTS".into(),
            vec!["events.0".into()],
            connect,
            10,
        );
        let position = position.map(NatsPosition::decode).transpose();
        let position = position.unwrap_or_else(|e| panic!("{e}"));
        jetstream.reader(0, "events.0".into(), decoder, position)
    }

    #[test]
    fn positions_at_one_sequence_are_the_same_place_whatever_identity_they_carry() {
        let reader = partition(None);
        let jetstream = JetStream {
            shared: Arc::clone(&reader.shared),
            max_per_pull: 10,
        };
        let at = |last, identity| NatsPosition { last, identity }.encode();
        let later = StreamIdentity {
            first_sequence: 40,
            ..OLD
        };
        // A replay from a position an older flow committed stops at the committed sequence
        // whichever form each side has, and whatever first sequence each reader saw.
        assert!(jetstream.same_position(&at(100, None), &at(100, Some(OLD))));
        assert!(jetstream.same_position(&at(100, Some(OLD)), &at(100, Some(later))));
        assert!(!jetstream.same_position(&at(100, Some(OLD)), &at(101, Some(OLD))));
        assert!(!jetstream.same_position(&at(100, None), &[0; 16]));
    }

    const OLD: StreamIdentity = StreamIdentity {
        created_ns: 1_764_763_200_000_000_000,
        first_sequence: 1,
    };

    #[test]
    fn an_old_position_adopts_the_stream_identity_and_a_later_re_creation_stops_the_partition() {
        // Committed by an older flow: the sequence alone.
        let mut reader = partition(Some(&100u64.to_be_bytes()));
        assert!(reader.check_identity(OLD).is_ok());
        let committed = reader.position().position;
        assert_eq!(
            NatsPosition::decode(&committed).ok(),
            Some(NatsPosition {
                last: 100,
                identity: Some(OLD)
            }),
            "the identity is committed with the next epoch"
        );
        // Retention moved the first sequence: the same stream.
        assert!(reader
            .check_identity(StreamIdentity {
                first_sequence: 40,
                ..OLD
            })
            .is_ok());
        // The next run, on a stream created again.
        let mut reader = partition(Some(&committed));
        let err = reader
            .check_identity(StreamIdentity {
                created_ns: 1_764_763_260_500_000_000,
                first_sequence: 1,
            })
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert_eq!(
            err,
            "stream `EVENTS` was deleted and created again: partition 0 committed sequence 100 of the stream, but it was created at 2025-12-03T12:00:00.000000000Z, and the stream of that name now was created at 2025-12-03T12:01:00.500000000Z; its sequences name other messages, and reading on at 101 would skip the new stream's first 100 message(s). To read the new stream from its beginning, start the pipeline with a new state directory (batches this one holds undelivered, which `flow-worker status` lists, cannot be rebuilt from the new stream); to keep this state directory, restore the old stream"
        );
    }

    #[test]
    fn subject_patterns_take_exactly_their_subjects() {
        assert!(subject_matches("events.*", "events.0"));
        assert!(!subject_matches("events.*", "events.0.x"));
        assert!(!subject_matches("events.*", "events"));
        assert!(subject_matches("events.>", "events.0.x"));
        assert!(!subject_matches("events.>", "events"));
        assert!(subject_matches(">", "a.b"));
        assert!(subject_matches("a.b", "a.b"));
        assert!(!subject_matches("a.b", "a.c"));
        assert!(!subject_matches("other.*", "events.0"));
    }
}
