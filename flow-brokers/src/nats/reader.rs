//! The reader of one partition: a pull consumer on the partition's subject, made again at the
//! last sequence read + 1 after any error.

use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream::consumer::{pull, AckPolicy, DeliverPolicy, PullConsumer};
use async_nats::jetstream::{self, Context};
use async_trait::async_trait;
use flow_core::sources::{
    decode_broker_position, encode_broker_position, BrokerDecoder, BrokerRecord,
};
use flow_core::{ReadLimits, Source, SourceError, SourceOutput, SourceRead};
use futures_util::StreamExt;
use tokio::sync::OnceCell;
use tokio::time::Instant;
use tracing::warn;

use super::auth::ConnectSettings;
use super::error::NatsSourceError;
use crate::broker_source::{Broker, TroubleWait};

/// A pull shorter than this is not worth a round trip: the read returns what it has.
const MIN_PULL: Duration = Duration::from_millis(20);
/// How long past its own expiry a pull may take before the reader gives up on it.
const PULL_GRACE: Duration = Duration::from_secs(5);
/// The server removes a consumer nobody pulled from for this long (a reader that crashed).
const CONSUMER_INACTIVE: Duration = Duration::from_secs(120);

/// What every partition of one source shares: one connection.
struct Shared {
    servers: Vec<String>,
    stream: String,
    connect: ConnectSettings,
    context: OnceCell<Context>,
}

impl Shared {
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
    /// Reads `stream` from `servers`, connecting on the first read of any partition.
    pub(crate) fn new(
        servers: Vec<String>,
        stream: String,
        connect: ConnectSettings,
        max_per_pull: usize,
    ) -> Self {
        JetStream {
            shared: Arc::new(Shared {
                servers,
                stream,
                connect,
                context: OnceCell::new(),
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

    fn open(
        &self,
        partition: u32,
        subject: String,
        decoder: BrokerDecoder,
        position: Option<&[u8]>,
    ) -> Result<Box<dyn Source>, SourceError> {
        let last = position
            .map(decode_broker_position)
            .transpose()?
            .unwrap_or(0);
        Ok(Box::new(NatsPartition {
            shared: Arc::clone(&self.shared),
            subject,
            decoder,
            partition,
            max_per_pull: self.max_per_pull,
            last,
            consumer: None,
            idle: false,
            lag: None,
            trouble: TroubleWait::default(),
        }))
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
        SourceRead {
            position: encode_broker_position(self.last),
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

    /// The stream's last sequence; refuses a stream that no longer holds what the position needs.
    async fn stream_head(&self) -> Result<u64, NatsSourceError> {
        let context = self.shared.context().await?;
        let stream = context
            .get_stream(&self.shared.stream)
            .await
            .map_err(|source| NatsSourceError::Stream {
                stream: self.shared.stream.clone(),
                source: Box::new(source),
            })?;
        let info = stream
            .get_info()
            .await
            .map_err(|source| NatsSourceError::Request {
                what: "stream info",
                source: Box::new(source),
            })?;
        let state = &info.state;
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
