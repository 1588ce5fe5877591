//! The reader of one partition: a pull consumer on the partition's subject, made again at the
//! last sequence read + 1 after any error.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream::consumer::pull::MessagesErrorKind;
use async_nats::jetstream::consumer::{pull, AckPolicy, DeliverPolicy, PullConsumer};
use async_nats::jetstream::context::{GetStreamError, GetStreamErrorKind};
use async_nats::jetstream::{self, Context, ErrorCode};
use async_trait::async_trait;
use flow_core::sources::{BrokerDecoder, BrokerRecord};
use flow_core::{ReadLimits, Source, SourceError, SourceOutput, SourceRead};
use futures_util::{FutureExt, StreamExt};
use tokio::sync::OnceCell;
use tokio::time::Instant;
use tracing::{info, warn};

use super::auth::ConnectSettings;
use super::error::{NatsSourceError, StreamRefusal};
use super::position::{NatsPosition, StreamIdentity};
use super::reply::AckReply;
use crate::broker_source::{utc_text, Broker, TroubleWait};

/// A read whose deadline is this close takes nothing: the epoch could not wait for a message.
const MIN_PULL: Duration = Duration::from_millis(20);
/// How long each request of the long-lived pull lives on the server. async-nats asks again
/// whenever half of what it asked for has come, and at once after a request ends, so this only
/// bounds how long the server holds a request nobody takes from; short, so that async-nats'
/// own accounting, which a lost end of a request (the server's 408) throws off, recovers soon.
const PULL_EXPIRES: Duration = Duration::from_secs(5);
/// The server sends a heartbeat on the pull this often while it has nothing to send, so that a
/// silent pull is told from a quiet subject; at most half of [`PULL_EXPIRES`], as the server
/// requires.
const PULL_HEARTBEAT: Duration = Duration::from_secs(1);
/// How long a pull may receive nothing at all, not even a heartbeat, before the reader drops it
/// and creates the consumer again. async-nats reports the missing heartbeats after two
/// heartbeat intervals of silence (`MissingHeartbeat`), the shortest gap that one late heartbeat
/// does not trip; it is also how far past a read's deadline a request may hold the read.
const STALL_GRACE: Duration = Duration::from_secs(2);
/// Messages the client holds for one partition's pull beyond what async-nats asks for at most
/// (one and a half `max_messages_per_pull`), for heartbeats and ends of requests: a
/// subscription whose buffer is full has the client drop what the server sends.
const BUFFER_SLACK: usize = 1024;
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
    /// Pulls each partition dropped as silent since the start, by partition.
    stalled_pulls: Vec<AtomicU64>,
    /// The client's buffer of each subscription: what one partition's pull may have on the way.
    subscription_capacity: usize,
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

    /// Counts a pull `partition` dropped as silent; the count so far.
    fn stalled(&self, partition: u32) -> u64 {
        self.stalled_pulls
            .get(partition as usize)
            .map_or(0, |count| count.fetch_add(1, Ordering::Relaxed) + 1)
    }

    async fn context(&self) -> Result<&Context, NatsSourceError> {
        self.context
            .get_or_try_init(|| async {
                let client = self
                    .connect
                    .options()
                    .await?
                    .subscription_capacity(self.subscription_capacity)
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
            pull: None,
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
        // async-nats keeps up to one and a half batches asked for on the way; the default
        // buffer (64 Ki messages) holds that for the default 10,000 per pull.
        let subscription_capacity = (max_per_pull + max_per_pull / 2 + BUFFER_SLACK).max(1 << 16);
        JetStream {
            shared: Arc::new(Shared {
                stalled_pulls: subjects.iter().map(|_| AtomicU64::new(0)).collect(),
                servers,
                stream,
                subjects,
                connect,
                context: OnceCell::new(),
                checked: OnceCell::new(),
                missing: AtomicBool::new(false),
                subscription_capacity,
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

    fn subject(&self, subject: &String) -> String {
        subject.clone()
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

    fn stalled_pulls(&self, partition: u32) -> u64 {
        self.shared
            .stalled_pulls
            .get(partition as usize)
            .map_or(0, |count| count.load(Ordering::Relaxed))
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
    /// The long-lived pull and its consumer, kept across reads so that the server keeps
    /// sending while the epoch is sealed and delivered; `None` until made, and after any error.
    pull: Option<LivePull>,
    /// The previous read took nothing: the next one learns the stream's head first.
    idle: bool,
    /// Messages of the subject the server holds beyond `last`: the `pending` count of the last
    /// message read, or 0 after a read that found nothing. `None` before the first read.
    lag: Option<u64>,
    trouble: TroubleWait,
}

/// One consumer and its continuous pull: async-nats asks for `max_messages_per_pull` messages
/// whenever fewer than half of those asked for are still to come, so the server sends ahead of
/// the reads, and the messages not taken by one read wait in the subscription for the next.
struct LivePull {
    consumer: PullConsumer,
    messages: pull::Stream,
    /// Messages this consumer delivered to the reader, redeliveries included: equal to the
    /// consumer's delivered count when none is in flight.
    received: u64,
    /// How long the reads have waited on the pull since its last message (not the time
    /// between reads, when nobody waits).
    silent: Duration,
    /// When the last read stopped taking from the pull.
    left: Instant,
}

/// Why taking messages from the pull ended early.
enum PullEnd {
    /// Nothing at all (no message, no heartbeat) came for [`STALL_GRACE`]: the pull is dead.
    Stalled,
    /// The pull or a message failed; the consumer is dropped.
    Failed(NatsSourceError),
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
        if let (Some(pull), Ok(context)) = (self.pull.take(), self.shared.context().await) {
            let name = pull.consumer.cached_info().name.clone();
            drop(pull.messages);
            if let Ok(stream) = context.get_stream(&self.shared.stream).await {
                let _ = stream.delete_consumer(&name).await;
            }
        }
    }
}

/// `request`, unless it has not answered by `by`: a server that went silent must not hold a
/// read past its deadline by more than [`STALL_GRACE`] (the client's own timeout is 10 s).
async fn answered<T>(
    by: Instant,
    what: &'static str,
    request: impl std::future::Future<Output = Result<T, NatsSourceError>>,
) -> Result<T, NatsSourceError> {
    let started = Instant::now();
    tokio::time::timeout_at(by, request)
        .await
        .map_err(|_| NatsSourceError::Unanswered {
            what,
            waited_ms: u64::try_from(started.elapsed().as_millis()).unwrap_or(u64::MAX),
            grace_ms: STALL_GRACE.as_millis(),
        })?
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

    /// Takes messages from the long-lived pull (making it first if needed) until the limits,
    /// appending them; a stalled pull is replaced at the last sequence read + 1.
    async fn pull(
        &mut self,
        out: &mut SourceOutput<'_>,
        limits: ReadLimits,
    ) -> Result<(), NatsSourceError> {
        let answer_by = limits.deadline + STALL_GRACE;
        if !self.started {
            answered(answer_by, "stream info", self.shared.start_check()).await?;
            self.started = true;
        }
        let mut taken = 0;
        loop {
            let head = if self.idle || self.pull.is_none() {
                Some(answered(answer_by, "stream info", self.stream_head()).await?)
            } else {
                None
            };
            if self.pull.is_none() {
                self.pull =
                    Some(answered(answer_by, "consumer creation", self.start_pull()).await?);
            }
            match self.take(out, limits, &mut taken).await {
                Ok(()) if taken == 0 => {
                    self.lag = Some(0);
                    if let Some(head) = head {
                        self.pass_caught_up(head, answer_by).await?;
                    }
                    self.idle = true;
                    return Ok(());
                }
                Ok(()) => {
                    self.idle = false;
                    return Ok(());
                }
                Err(PullEnd::Stalled) => {
                    self.stalled();
                    if Instant::now() + MIN_PULL >= limits.deadline {
                        return Ok(());
                    }
                    // Made again at once: the rest of the epoch may still read.
                }
                Err(PullEnd::Failed(err)) => {
                    self.pull = None;
                    self.idle = false;
                    return Err(err);
                }
            }
        }
    }

    /// Drops a pull that went silent, says so and counts it; the next turn makes it again.
    fn stalled(&mut self) {
        if let (Some(pull), Some(context)) = (self.pull.take(), self.shared.context.get()) {
            // The server would keep the dead pull's consumer for `CONSUMER_INACTIVE`; removed
            // off the read, which must not wait on a server that may still be silent.
            let (context, stream) = (context.clone(), self.shared.stream.clone());
            let name = pull.consumer.cached_info().name.clone();
            drop(pull.messages);
            tokio::spawn(async move {
                let _ = context.delete_consumer_from_stream(name, stream).await;
            });
        }
        self.idle = false;
        let total = self.shared.stalled(self.partition);
        warn!(
            partition = self.partition,
            subject = %self.subject,
            position = self.last,
            stalled_pulls = total,
            "the JetStream pull of partition {} (subject `{}`) received nothing, not even the server's heartbeat, for {} ms: dropping it and creating the consumer again at sequence {}. Check the network between the worker and the NATS servers and the server's health (`nats server check jetstream`); counted in `flow_source_stalled_pulls_total`",
            self.partition,
            self.subject,
            STALL_GRACE.as_millis(),
            self.last + 1
        );
    }

    /// After a read that took nothing: when the consumer has delivered every message of the
    /// subject (none pending on the server, none in flight to the reader), the position passes
    /// `head`, which was taken before, so that retention of other subjects' messages below it is
    /// never taken for a loss.
    async fn pass_caught_up(
        &mut self,
        head: u64,
        answer_by: Instant,
    ) -> Result<(), NatsSourceError> {
        let Some(pull) = &self.pull else {
            return Ok(());
        };
        let info = answered(answer_by, "consumer info", async {
            pull.consumer
                .get_info()
                .await
                .map_err(|source| NatsSourceError::Request {
                    what: "consumer info",
                    source: Box::new(source),
                })
        })
        .await?;
        if info.num_pending == 0 && info.delivered.consumer_sequence == pull.received {
            self.last = self.last.max(head);
        }
        Ok(())
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

    /// A consumer at the last sequence read + 1 and its long-lived pull.
    async fn start_pull(&self) -> Result<LivePull, NatsSourceError> {
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
        let consumer: PullConsumer = context
            .create_consumer_on_stream(config, self.shared.stream.as_str())
            .await
            .map_err(|source| NatsSourceError::Request {
                what: "consumer creation",
                source: Box::new(source),
            })?;
        let messages = consumer
            .stream()
            .max_messages_per_batch(self.max_per_pull)
            .expires(PULL_EXPIRES)
            .heartbeat(PULL_HEARTBEAT)
            .messages()
            .await
            .map_err(|source| NatsSourceError::Request {
                what: "pull",
                source: Box::new(source),
            })?;
        Ok(LivePull {
            consumer,
            messages,
            received: 0,
            silent: Duration::ZERO,
            left: Instant::now(),
        })
    }

    /// Takes messages until `limits` (`taken` counts those appended in this read), without a
    /// timer while the pull holds messages already received. Ends on the deadline whatever the
    /// server sends: no read waits for the server's end of a pull request.
    async fn take(
        &mut self,
        out: &mut SourceOutput<'_>,
        limits: ReadLimits,
        taken: &mut usize,
    ) -> Result<(), PullEnd> {
        let Some(pull) = self.pull.as_mut() else {
            return Ok(());
        };
        // After a pause in reading long enough for async-nats' timer to run out unpolled, the
        // silence is counted anew: what the reads waited through before it says nothing about
        // a pull that nobody polled since.
        if pull.left.elapsed() >= STALL_GRACE / 2 {
            pull.silent = Duration::ZERO;
        }
        // The last message appended, for its `pending` count: the lag.
        let mut last_message = None;
        let ended = loop {
            if *taken >= limits.max_messages {
                break None;
            }
            let next = match pull.messages.next().now_or_never() {
                Some(next) => next,
                None => {
                    let started = Instant::now();
                    let next = tokio::time::timeout_at(limits.deadline, pull.messages.next());
                    let next = next.await;
                    pull.silent += started.elapsed();
                    match next {
                        Ok(next) => next,
                        Err(_) => break None,
                    }
                }
            };
            let message = match next {
                Some(Ok(message)) => message,
                // async-nats times the heartbeat from the first poll that found nothing, also
                // across the time between two reads (a seal, a wait for the outbox's budget)
                // when nobody polls and no new request goes out: only silence the reads waited
                // through is a stall. Half the grace tells it from a timer that ran out between
                // reads; async-nats starts its timer again at the next poll.
                Some(Err(err)) if err.kind() == MessagesErrorKind::MissingHeartbeat => {
                    if pull.silent >= STALL_GRACE / 2 {
                        break Some(PullEnd::Stalled);
                    }
                    continue;
                }
                Some(Err(source)) => {
                    break Some(PullEnd::Failed(NatsSourceError::Request {
                        what: "pull",
                        source: Box::new(source),
                    }))
                }
                None => {
                    break Some(PullEnd::Failed(NatsSourceError::Request {
                        what: "pull",
                        source: "the client ended the pull (connection closed)".into(),
                    }))
                }
            };
            pull.received += 1;
            pull.silent = Duration::ZERO;
            match append(&mut self.decoder, &mut self.last, &message, out) {
                Ok(true) => {
                    *taken += 1;
                    last_message = Some(message);
                }
                Ok(false) => {}
                Err(err) => break Some(PullEnd::Failed(err)),
            }
        };
        pull.left = Instant::now();
        if let Some(message) = last_message {
            match reply_of(&message).and_then(|reply| Ok(reply.pending()?)) {
                Ok(pending) => self.lag = Some(pending),
                Err(err) if ended.is_none() => return Err(PullEnd::Failed(err)),
                Err(_) => {}
            }
        }
        ended.map_or(Ok(()), Err)
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

/// The parsed reply subject of `message`.
fn reply_of(message: &jetstream::Message) -> Result<AckReply<'_>, NatsSourceError> {
    AckReply::parse(message.reply.as_deref().unwrap_or_default()).map_err(NatsSourceError::Reply)
}

/// Appends one message after `last`, moving `last` to its sequence; `false` for a message at or
/// below `last` (a redelivery).
fn append(
    decoder: &mut BrokerDecoder,
    last: &mut u64,
    message: &jetstream::Message,
    out: &mut SourceOutput<'_>,
) -> Result<bool, NatsSourceError> {
    let reply = reply_of(message)?;
    let sequence = reply.stream_sequence;
    if sequence <= *last {
        return Ok(false);
    }
    // Only the `timestamp` column of `format: raw` needs the time.
    let timestamp_seconds = if decoder.uses_timestamp() {
        reply.timestamp_seconds()?
    } else {
        0
    };
    let record = BrokerRecord {
        position: sequence,
        payload: &message.payload,
        origin: message.subject.as_str(),
        timestamp_seconds,
        key: None,
    };
    decoder
        .append(&record, out)
        .map_err(|source| NatsSourceError::Record(Box::new(source)))?;
    *last = sequence;
    Ok(true)
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

    #[tokio::test(start_paused = true)]
    async fn a_request_unanswered_past_the_grace_ends_the_wait_naming_the_request() {
        let by = Instant::now() + Duration::from_millis(300) + STALL_GRACE;
        let silent = std::future::pending::<Result<(), NatsSourceError>>();
        let err = answered(by, "consumer creation", silent)
            .await
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert_eq!(
            err,
            "the NATS server did not answer the JetStream consumer creation request within 2300 ms (the read's deadline plus 2000 ms); asking again. Check the network between the worker and the servers, and the servers' health (`nats server check jetstream`)"
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
