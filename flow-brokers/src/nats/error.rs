//! Why the `nats_jetstream` source could not read, and which of its errors waiting cannot cure.

use std::path::PathBuf;

use flow_core::SourceError;

use super::reply::ReplyError;

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
    /// A request the read waits for (stream info, consumer creation or info) was not answered
    /// within the read's deadline plus the stall grace; the reader gives up on it and asks again.
    #[error("the NATS server did not answer the JetStream {what} request within {waited_ms} ms (the read's deadline plus {grace_ms} ms); asking again. Check the network between the worker and the servers, and the servers' health (`nats server check jetstream`)")]
    Unanswered {
        /// Which request.
        what: &'static str,
        /// How long the read waited for the answer.
        waited_ms: u64,
        /// How long past its deadline a read may wait for an answer.
        grace_ms: u128,
    },
    /// A message's reply subject, where JetStream puts its stream sequence, is not one.
    #[error(transparent)]
    Reply(#[from] ReplyError),
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
    #[error("stream `{stream}` ends at sequence {last_sequence}, below partition {partition}'s committed position {position}: the stream was deleted and created again, so its sequences no longer name the messages flow committed. {RESET_REMEDY}")]
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
    /// The stream under the source's name is not the one the committed position counts in.
    #[error("stream `{stream}` was deleted and created again: partition {partition} committed sequence {position} of the stream, but {change}; its sequences name other messages, and reading on at {} would skip the new stream's first {position} message(s). {RESET_REMEDY}", position + 1)]
    StreamRecreated {
        /// The stream's name.
        stream: String,
        /// The flow partition.
        partition: u32,
        /// The committed position (a sequence of the old stream).
        position: u64,
        /// What differs: the creation times, or the first sequence.
        change: String,
    },
    /// The stream was there and is gone: the partition waits for it.
    #[error("stream `{stream}` no longer exists on {servers}")]
    StreamMissing {
        /// The stream's name.
        stream: String,
        /// The `servers` list as given.
        servers: String,
    },
    /// What the source needs of the stream is not there; refused before anything is read.
    #[error(transparent)]
    Refused(#[from] StreamRefusal),
    /// A message that does not fit the declared schema, under `on_bad_record: stop`.
    #[error(transparent)]
    Record(Box<SourceError>),
}

/// What a partition whose stream was created again is told to do.
const RESET_REMEDY: &str = "To read the new stream from its beginning, start the pipeline with a new state directory (batches this one holds undelivered, which `flow-worker status` lists, cannot be rebuilt from the new stream); to keep this state directory, restore the old stream";

/// Why the source refuses to start on a stream: answers of the server that waiting cannot change.
#[derive(Clone, Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StreamRefusal {
    /// The server has no stream of that name.
    #[error("no stream named `{stream}` on {servers}; create it with `nats --server {first_server} stream add {stream} --subjects '{subjects}' --defaults`, or name an existing stream in `parameters.stream`")]
    NoStream {
        /// The stream's name.
        stream: String,
        /// The `servers` list as given.
        servers: String,
        /// The first server, for the command.
        first_server: String,
        /// The partitions' subjects, comma-separated, for the command.
        subjects: String,
    },
    /// Subjects the source reads are not subjects of the stream: nothing published to them is
    /// stored there.
    #[error("stream `{stream}` does not take subject(s) {outside}: its subjects are {stream_subjects}. Fix `parameters.subjects` / `subject_template`, or add the subjects to the stream (`nats stream edit {stream} --subjects ...`)")]
    SubjectOutside {
        /// The stream's name.
        stream: String,
        /// The partitions' subjects the stream does not take, quoted and comma-separated.
        outside: String,
        /// The stream's subjects, quoted and comma-separated.
        stream_subjects: String,
    },
}

impl NatsSourceError {
    /// Waiting cannot cure these: the partition stops.
    pub(crate) fn is_fatal(&self) -> bool {
        matches!(
            self,
            NatsSourceError::Gap { .. }
                | NatsSourceError::StreamReset { .. }
                | NatsSourceError::StreamRecreated { .. }
                | NatsSourceError::Refused(_)
                | NatsSourceError::Credentials { .. }
                | NatsSourceError::Record(_)
        )
    }
}
