//! `nats_jetstream`: flow partition `i` reads the messages of one subject of a JetStream stream,
//! in stream order. The position is the stream sequence of the last message read, committed in
//! the outbox with the epoch; nothing is acknowledged to the server (the consumer is ephemeral,
//! `AckPolicy::None`), so the outbox alone says where to resume. Each reader creates its consumer
//! at `position + 1` filtered by its subject, pulls in requests that expire by the epoch's deadline,
//! and after any error drops the consumer and creates it again at the last sequence read + 1:
//! a server restart or a dropped connection costs neither a gap nor a duplicate.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream::consumer::{pull, AckPolicy, DeliverPolicy, PullConsumer};
use async_nats::jetstream::{self, Context};
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
use futures_util::StreamExt;
use serde::{Deserialize, Serialize};
use tokio::sync::OnceCell;
use tokio::time::Instant;
use tracing::warn;

use crate::broker_source::{Broker, BrokerFactory, TroubleWait};
use crate::nats_auth::NatsAuth;
use crate::nats_error::NatsSourceError;

/// The default of `max_messages_per_pull`.
const DEFAULT_MAX_MESSAGES_PER_PULL: usize = 10_000;
/// A pull shorter than this is not worth a round trip: the read returns what it has.
const MIN_PULL: Duration = Duration::from_millis(20);
/// How long past its own expiry a pull may take before the reader gives up on it.
const PULL_GRACE: Duration = Duration::from_secs(5);
/// The server removes a consumer nobody pulled from for this long (a reader that crashed).
const CONSUMER_INACTIVE: Duration = Duration::from_secs(120);

/// Parameters of the `nats_jetstream` source, as a spec's `parameters:` map gives them.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NatsJetStreamParams {
    /// `nats://host:port` URLs of the cluster's servers.
    pub servers: Vec<String>,
    /// The JetStream stream.
    pub stream: String,
    /// One subject per partition, in partition order.
    #[serde(default)]
    pub subjects: Option<Vec<String>>,
    /// Or a template whose `{partition}` is replaced by the partition number.
    #[serde(default)]
    pub subject_template: Option<String>,
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
    /// How to authenticate; credentials come from the environment or files, never the spec.
    #[serde(default)]
    pub auth: Option<NatsAuth>,
    /// PEM files of the certificate authorities that sign the servers' certificates; TLS is
    /// required when any is given.
    #[serde(default)]
    pub tls_ca_files: Vec<PathBuf>,
    /// The most messages one pull request asks for.
    #[serde(default = "default_max_messages_per_pull")]
    pub max_messages_per_pull: usize,
}

pub(crate) fn default_stream_id() -> String {
    "rows".to_owned()
}

pub(crate) fn default_max_messages_per_pull() -> usize {
    DEFAULT_MAX_MESSAGES_PER_PULL
}

pub(crate) fn build(
    ctx: &SourceBuildContext<'_>,
    parameters: &serde_yaml::Value,
) -> BuildResult<Arc<dyn SourceFactory>> {
    let params: NatsJetStreamParams =
        parse_parameters(parameters, "parameters").map_err(|v| vec![v])?;
    let mut violations = Vec::new();
    if params.servers.is_empty() {
        violations.push(Violation::new(
            "parameters.servers",
            "name at least one server, for example `nats://127.0.0.1:4222`",
        ));
    }
    if !is_valid_stream_name(&params.stream) {
        violations.push(Violation::new(
            "parameters.stream",
            format!(
                "`{}` is not a JetStream stream name (non-empty, no whitespace, `.`, `*`, `>`)",
                params.stream
            ),
        ));
    }
    let subjects = partition_subjects(&params, ctx.partitions).map_err(|v| violations.push(v));
    if params.max_messages_per_pull == 0 || params.max_messages_per_pull > 1_000_000 {
        violations.push(Violation::new(
            "parameters.max_messages_per_pull",
            format!(
                "{} is out of range 1..=1000000",
                params.max_messages_per_pull
            ),
        ));
    }
    if !is_valid_name(&params.stream_id) {
        violations.push(Violation::new(
            "parameters.stream_id",
            format!("`{}` is not a valid stream id", params.stream_id),
        ));
    }
    let schema = BrokerDecoder::schema_of(
        params.format,
        params.schema.as_deref(),
        "subject",
        JetStream::WITH_KEY,
    )
    .map_err(|v| violations.push(v));
    let connect = crate::nats_auth::connect_options(params.auth.as_ref(), &params.tls_ca_files)
        .map_err(|mut v| violations.append(&mut v));
    match (subjects, schema, connect) {
        (Ok(subjects), Ok(schema), Ok(connect)) if violations.is_empty() => {
            Ok(Arc::new(BrokerFactory {
                broker: JetStream {
                    shared: Arc::new(Shared {
                        servers: params.servers,
                        stream: params.stream,
                        connect,
                        context: OnceCell::new(),
                    }),
                    max_per_pull: params.max_messages_per_pull,
                },
                stream_id: params.stream_id,
                schema,
                format: params.format,
                on_bad_record: params.on_bad_record,
                targets: subjects,
            }))
        }
        _ => Err(violations),
    }
}

fn is_valid_stream_name(name: &str) -> bool {
    !name.is_empty()
        && !name
            .chars()
            .any(|c| c.is_whitespace() || matches!(c, '.' | '*' | '>' | '/' | '\\'))
}

fn is_valid_subject(subject: &str) -> bool {
    !subject.is_empty()
        && !subject.chars().any(char::is_whitespace)
        && subject.split('.').all(|token| !token.is_empty())
}

/// The subject of every partition, from `subjects` or `subject_template`.
fn partition_subjects(
    params: &NatsJetStreamParams,
    partitions: u32,
) -> Result<Vec<String>, Violation> {
    let subjects: Vec<String> = match (&params.subjects, &params.subject_template) {
        (Some(_), Some(_)) => {
            return Err(Violation::new(
                "parameters.subjects",
                "set `subjects` or `subject_template`, not both",
            ))
        }
        (None, None) => {
            return Err(Violation::new(
                "parameters.subjects",
                "name each partition's subject: `subjects: [...]` or `subject_template: \"events.{partition}\"`",
            ))
        }
        (Some(list), None) => {
            if list.len() != partitions as usize {
                return Err(Violation::new(
                    "parameters.subjects",
                    format!(
                        "{} subject(s) for {partitions} partition(s): nats_jetstream reads one subject per partition, so set `partitions: {}`",
                        list.len(),
                        list.len().max(1)
                    ),
                ));
            }
            list.clone()
        }
        (None, Some(template)) => {
            if !template.contains("{partition}") {
                return Err(Violation::new(
                    "parameters.subject_template",
                    format!("`{template}` has no `{{partition}}`: every partition would read the same subject"),
                ));
            }
            (0..partitions)
                .map(|p| template.replace("{partition}", &p.to_string()))
                .collect()
        }
    };
    let path = if params.subjects.is_some() {
        "parameters.subjects"
    } else {
        "parameters.subject_template"
    };
    if let Some(bad) = subjects.iter().find(|s| !is_valid_subject(s)) {
        return Err(Violation::new(
            path,
            format!(
                "`{bad}` is not a NATS subject (dot-separated non-empty tokens, no whitespace)"
            ),
        ));
    }
    let mut sorted = subjects.clone();
    sorted.sort();
    if let Some(pair) = sorted.windows(2).find(|pair| pair[0] == pair[1]) {
        return Err(Violation::new(
            path,
            format!(
                "subject `{}` is read by two partitions: each message would be delivered twice",
                pair[0]
            ),
        ));
    }
    if let Some(wild) = subjects
        .iter()
        .find(|s| s.split('.').any(|t| t == "*" || t == ">"))
    {
        return Err(Violation::new(
            path,
            format!("`{wild}` has a wildcard: a partition reads exactly one subject, so that its messages have one order"),
        ));
    }
    Ok(subjects)
}

/// What every partition of one source shares: one connection.
pub(crate) struct Shared {
    servers: Vec<String>,
    stream: String,
    connect: crate::nats_auth::ConnectSettings,
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
struct JetStream {
    shared: Arc<Shared>,
    max_per_pull: usize,
}

impl Broker for JetStream {
    /// The partition's subject.
    type Target = String;
    const WITH_KEY: bool = false;

    fn no_target(partition: u32) -> String {
        format!("no subject is configured for partition {partition}")
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
