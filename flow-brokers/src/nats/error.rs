//! Why the `nats_jetstream` source could not read, and which of its errors waiting cannot cure.

use std::path::PathBuf;

use flow_core::SourceError;

/// Why the `nats_jetstream` source could not read.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
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
    pub(crate) fn is_fatal(&self) -> bool {
        matches!(
            self,
            NatsSourceError::Gap { .. }
                | NatsSourceError::StreamReset { .. }
                | NatsSourceError::Credentials { .. }
                | NatsSourceError::Record(_)
        )
    }
}
