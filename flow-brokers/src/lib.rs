//! flow-brokers: sources that read a message broker from the positions flow commits.
//!
//! Each source is replayable: its position is the broker's own (a JetStream stream sequence, a
//! Kafka offset), committed in flow's outbox together with the epoch's sealed batches, and never
//! acknowledged to the broker as the source of truth. A restart, or the rebuild of a pending batch, re-reads the
//! broker from there; rows are decoded by flow-core's broker formats
//! ([`flow_core::sources::BrokerFormat`]).
//!
//! - [`nats_jetstream`](NatsJetStreamParams): one subject of a JetStream stream per partition.
//! - [`kafka`](KafkaParams): one partition of a Kafka topic per partition (librdkafka).
//!
//! Both parameter types are also their typed configuration (`config`): builder-style
//! constructors, [`flow_core::SourceConfig`], and `validate` with the registry's own checks.

#![warn(missing_docs)]

mod config;
mod kafka;
mod nats_auth;
mod nats_jetstream;

use std::path::PathBuf;

use flow_core::{Registry, SourceError};

pub use kafka::{KafkaParams, KafkaSourceError};
pub use nats_auth::NatsAuth;
pub use nats_jetstream::NatsJetStreamParams;

/// Registers the broker sources (`nats_jetstream`, `kafka`) into `registry`.
pub fn register(registry: &mut Registry) {
    registry.register_source("nats_jetstream", std::sync::Arc::new(nats_jetstream::build));
    registry.register_source("kafka", std::sync::Arc::new(kafka::build));
}

/// Why the `nats_jetstream` source could not read.
#[derive(Debug, thiserror::Error)]
pub enum NatsSourceError {
    /// The NATS connection could not be made.
    #[error("cannot connect to NATS at {servers}: {source}")]
    Connect {
        /// The `servers` list as given.
        servers: String,
        /// The client's reason.
        #[source]
        source: async_nats::ConnectError,
    },
    /// The `credentials_file` of `auth:` could not be read.
    #[error("cannot load the NATS credentials file `{path}`: {source}")]
    Credentials {
        /// The file.
        path: PathBuf,
        /// The operating system's reason.
        #[source]
        source: std::io::Error,
    },
    /// The stream does not exist or the server did not answer for it.
    #[error("JetStream stream `{stream}` is not available: {source}")]
    Stream {
        /// The stream's name.
        stream: String,
        /// The server's or client's reason.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// A JetStream request failed (stream info, consumer creation, pull, message metadata).
    #[error("JetStream {what} failed: {source}")]
    Request {
        /// Which request.
        what: &'static str,
        /// The server's or client's reason.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// A pull request went unanswered 5 s past its own expiry; the reader gives up on it.
    #[error("a JetStream pull did not end within 5 s of its expiry")]
    PullOverran,
    /// Retention removed messages the partition had not read yet.
    #[error("stream `{stream}` no longer holds sequences {}..={}: its retention removed them before partition {partition} read them (committed position {position}); any message of subject `{subject}` among them is lost. Raise the stream's retention (max_age, max_msgs, max_bytes) above the worker's downtime; to go on without them, start with a new state directory or drain this one first", position + 1, first_sequence - 1)]
    Gap {
        /// The stream's name.
        stream: String,
        /// The partition's subject.
        subject: String,
        /// The flow partition.
        partition: u32,
        /// The last stream sequence the partition read (its committed position).
        position: u64,
        /// The lowest sequence the stream still holds.
        first_sequence: u64,
    },
    /// The stream ends below the committed position: it was deleted and created again.
    #[error("stream `{stream}` ends at sequence {last_sequence}, below partition {partition}'s committed position {position}: the stream was deleted and created again, so its sequences no longer name the messages flow committed. Use a new state directory for the new stream")]
    StreamReset {
        /// The stream's name.
        stream: String,
        /// The flow partition.
        partition: u32,
        /// The committed position.
        position: u64,
        /// The stream's last sequence.
        last_sequence: u64,
    },
    /// A message that does not fit the declared schema, under `on_bad_record: stop`.
    #[error(transparent)]
    Record(Box<SourceError>),
}

impl NatsSourceError {
    /// Waiting cannot cure these: the partition stops.
    fn is_fatal(&self) -> bool {
        matches!(
            self,
            NatsSourceError::Gap { .. }
                | NatsSourceError::StreamReset { .. }
                | NatsSourceError::Credentials { .. }
                | NatsSourceError::Record(_)
        )
    }
}
