//! Typed errors of the runtime and its plugins. Each variant says what failed and with what input.

use std::fmt;
use std::path::PathBuf;

use thiserror::Error;

use crate::types::StreamType;

/// A boxed error of a third-party plugin.
pub type BoxError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// Why a value, row or message id does not fit what it is checked against.
#[derive(Error, Debug, Clone, PartialEq)]
#[non_exhaustive]
pub enum ValueError {
    /// A text meant as a message id is not `<partition>-<offset>`.
    #[error("`{text}` is not a message id (expected `<partition>-<offset>`)")]
    BadMessageId {
        /// The text as given.
        text: String,
    },
    /// A row has more values than its schema has columns.
    #[error("row has more values than the {expected} columns of its schema")]
    TooManyValues {
        /// The schema's column count.
        expected: usize,
    },
    /// A row has fewer values than its schema has columns.
    #[error("row has {got} of {expected} values")]
    MissingValues {
        /// The schema's column count.
        expected: usize,
        /// The values the row has.
        got: usize,
    },
    /// A value does not fit its column's type (range, precision, form).
    #[error("column `{column}` ({ty}): {what}")]
    Invalid {
        /// The column's name.
        column: String,
        /// The column's declared type.
        ty: StreamType,
        /// What is wrong with the value.
        what: String,
    },
}

/// One problem found in a pipeline spec, with its path (`sinks[0].parameters.path`).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Violation {
    /// Where in the spec, e.g. `sinks[0].parameters.path`; empty for the spec as a whole.
    pub path: String,
    /// What is wrong there.
    pub message: String,
}

impl Violation {
    /// A violation at `path` (relative to whatever [`Violation::under`] later prefixes).
    pub fn new(path: impl Into<String>, message: impl Into<String>) -> Self {
        Violation {
            path: path.into(),
            message: message.into(),
        }
    }

    /// The same violation under a parent path.
    pub fn under(self, parent: &str) -> Self {
        let path = if self.path.is_empty() {
            parent.to_owned()
        } else if self.path.starts_with('[') {
            format!("{parent}{}", self.path)
        } else {
            format!("{parent}.{}", self.path)
        };
        Violation { path, ..self }
    }
}

impl Violation {
    /// One line for several violations: `path: message; path: message`.
    pub fn list(violations: &[Violation]) -> String {
        violations
            .iter()
            .map(ToString::to_string)
            .collect::<Vec<_>>()
            .join("; ")
    }
}

impl fmt::Display for Violation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.path.is_empty() {
            write!(f, "{}", self.message)
        } else {
            write!(f, "{}: {}", self.path, self.message)
        }
    }
}

/// Every violation found in a spec.
#[derive(Error, Debug, Clone, PartialEq, Eq)]
pub struct SpecError {
    /// Every violation, in the order they were found.
    pub violations: Vec<Violation>,
}

impl fmt::Display for SpecError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "the pipeline spec has {} violation(s):",
            self.violations.len()
        )?;
        for violation in &self.violations {
            write!(f, "\n  {violation}")?;
        }
        Ok(())
    }
}

/// Why a source could not read.
#[derive(Error, Debug)]
#[non_exhaustive]
pub enum SourceError {
    /// A file operation failed.
    #[error("{what} `{path}`: {source}")]
    Io {
        /// The operation, e.g. `cannot open input file`.
        what: &'static str,
        /// The file.
        path: PathBuf,
        /// The operating system's reason.
        #[source]
        source: std::io::Error,
    },
    /// A record that does not match the declared schema: `file:line: column: what is wrong`.
    #[error("{location}: {what}")]
    BadRecord {
        /// Where the record is, e.g. `file:line`.
        location: String,
        /// What is wrong with it.
        what: String,
    },
    /// An input file cannot be read as the source needs (not a regular file, or no longer the
    /// file the committed position was taken in); `what` says why and how to go on.
    #[error("input file `{path}`: {what}")]
    InputFile {
        /// The file.
        path: PathBuf,
        /// Why it cannot be read, and how to go on.
        what: String,
    },
    /// A committed position is not one this source writes (another source's, or corrupt).
    #[error("source position `{position:?}` cannot be decoded: {what}")]
    BadPosition {
        /// The position's bytes.
        position: Vec<u8>,
        /// Why they cannot be decoded.
        what: String,
    },
    /// The error of a source outside flow-core, as it reported it.
    #[error(transparent)]
    Plugin(BoxError),
}

/// Why re-reading the source for pending batches failed.
#[derive(Error, Debug)]
#[non_exhaustive]
pub enum ReplayError {
    /// The source could not re-read the range.
    #[error("source: {0}")]
    Source(#[source] SourceError),
    /// A processor failed on a re-read message.
    #[error("processor `{processor}`: {source}")]
    Processor {
        /// The processor's name.
        processor: String,
        /// Its error.
        #[source]
        source: ProcessorError,
    },
}

/// Why a sink could not take, seal or deliver a batch.
#[derive(Error, Debug)]
#[non_exhaustive]
pub enum SinkError {
    /// A pending batch stored as bounds could not be rebuilt from the source.
    #[error("re-reading the source to rebuild pending batches: {0}")]
    Replay(#[source] Box<ReplayError>),
    /// A file operation failed.
    #[error("{what} `{path}`: {source}")]
    Io {
        /// The operation.
        what: &'static str,
        /// The file.
        path: PathBuf,
        /// The operating system's reason.
        #[source]
        source: std::io::Error,
    },
    /// The state store (outbox) failed.
    #[error("sink state: {0}")]
    State(#[from] flow_state::StateError),
    /// A row failed the sink's checks under `on_bad_rows: stop`.
    #[error("message {message_id} rejected: {source}")]
    Rejected {
        /// The message id, `<partition>-<offset>`.
        message_id: String,
        /// Why the row was rejected.
        #[source]
        source: BoxError,
    },
    /// Delivery stopped, e.g. the outbox and the sink disagree or the delivery task ended.
    #[error("delivery stopped: {reason}")]
    Delivery {
        /// Why.
        reason: String,
    },
    /// Delivery stopped on an error: `context` says what was being done, `source` is the error
    /// (displayed as [`SinkError::Delivery`] with `reason` `<context>: <source>`).
    #[error("delivery stopped: {context}: {source}")]
    DeliveryFailed {
        /// What was being done.
        context: String,
        /// The error.
        #[source]
        source: BoxError,
    },
    /// The sink will not go on with what it found (its output file truncated, a batch stored
    /// without the payload it needs); the text says why and how to go on.
    #[error("{0}")]
    Refused(String),
    /// The target system failed or refused: `context` says what was being done, `source` is the
    /// target's own (classified) error.
    #[error("{context}: {source}")]
    Target {
        /// What was being done.
        context: String,
        /// The target's own error.
        #[source]
        source: BoxError,
    },
    /// The error of a sink outside flow-core, as it reported it.
    #[error(transparent)]
    Plugin(BoxError),
}

impl From<ReplayError> for SinkError {
    fn from(err: ReplayError) -> Self {
        SinkError::Replay(Box::new(err))
    }
}

/// Why a processor failed on a message.
#[derive(Error, Debug)]
#[non_exhaustive]
pub enum ProcessorError {
    /// A value of the message does not fit the processor's output schema.
    #[error("message {message_id}: {source}")]
    Value {
        /// The message id, `<partition>-<offset>`.
        message_id: String,
        /// What is wrong with the value.
        #[source]
        source: ValueError,
    },
    /// The error of a processor outside flow-core, as it reported it.
    #[error(transparent)]
    Plugin(BoxError),
}

/// Why a partition or the whole pipeline stopped.
#[derive(Error, Debug)]
#[non_exhaustive]
pub enum RuntimeError {
    /// The state store failed for a partition.
    #[error("partition {partition}: state store: {source}")]
    State {
        /// The partition.
        partition: u32,
        /// The store's error.
        #[source]
        source: flow_state::StateError,
    },
    /// The source failed for a partition.
    #[error("partition {partition}: source: {source}")]
    Source {
        /// The partition.
        partition: u32,
        /// The source's error.
        #[source]
        source: SourceError,
    },
    /// A processor failed in a partition.
    #[error("partition {partition}: processor `{processor}`: {source}")]
    Processor {
        /// The partition.
        partition: u32,
        /// The processor's name.
        processor: String,
        /// Its error.
        #[source]
        source: ProcessorError,
    },
    /// A sink failed in a partition.
    #[error("partition {partition}: sink `{sink}`: {source}")]
    Sink {
        /// The partition.
        partition: u32,
        /// The sink's name.
        sink: String,
        /// Its error.
        #[source]
        source: SinkError,
    },
    /// A task of the runtime ended without a report, or a partition's stream graph could not be
    /// built.
    #[error("partition {partition}: task failed: {reason}")]
    Task {
        /// The partition (0 for pipeline-wide tasks, `u32::MAX` when unknown).
        partition: u32,
        /// What went wrong.
        reason: String,
    },
    /// A task of the runtime panicked or was cancelled.
    #[error("partition {partition}: task failed: {source}")]
    Join {
        /// The partition (0 for pipeline-wide tasks, `u32::MAX` when unknown).
        partition: u32,
        /// How the task ended.
        #[source]
        source: tokio::task::JoinError,
    },
    /// The state store could not be opened.
    #[error("opening the state store in `{dir}`: {source}")]
    OpenState {
        /// The state directory.
        dir: PathBuf,
        /// The store's error.
        #[source]
        source: flow_state::StateError,
    },
    /// The state directory belongs to another pipeline or partition count.
    #[error("{0}")]
    OtherPipeline(#[source] flow_state::StateError),
    /// A sink with undelivered batches is not in the spec (renamed or removed).
    #[error(
        "Refusing to start: sink `{sink}` has {batches} undelivered batch(es) ({rows} rows) in the \
         state directory but is not in the spec (renamed or removed?); the source goes on from \
         its committed position, so they would never be sent. Run the previous spec, with the \
         sink, until `flow-worker status` shows nothing pending, or deliver them with \
         `flow-worker drain PREVIOUS_SPEC`; then start this spec"
    )]
    SinkRemoved {
        /// The sink's name in the state directory.
        sink: String,
        /// Its undelivered batches over every partition.
        batches: u64,
        /// Their rows.
        rows: u64,
    },
    /// A sink with undelivered batches has another class in the spec than the one that sealed
    /// them.
    #[error(
        "Refusing to start: sink `{sink}` is `{spec}` in the spec, but its {batches} undelivered \
         batch(es) ({rows} rows) were sealed by `{stored}`, the only class that delivers them. \
         Run the previous spec, with `{stored}`, until `flow-worker status` shows nothing \
         pending, or deliver them with `flow-worker drain PREVIOUS_SPEC`; then change the class"
    )]
    SinkClassChanged {
        /// The sink's name.
        sink: String,
        /// The class that sealed the pending batches.
        stored: String,
        /// The class the spec names.
        spec: String,
        /// Its undelivered batches over every partition.
        batches: u64,
        /// Their rows.
        rows: u64,
    },
    /// Several partitions failed; each error says which.
    #[error("{} partition(s) failed:{}", .0.len(), list(.0))]
    PartitionsFailed(Vec<RuntimeError>),
}

impl RuntimeError {
    /// Whether the state store refused a commit of the partition because this worker may no
    /// longer own it (cluster mode: [`flow_state::StateError::Fenced`], anywhere in the causes).
    pub fn is_fenced(&self) -> bool {
        let mut next: Option<&(dyn std::error::Error + 'static)> = Some(self);
        while let Some(err) = next {
            if let Some(flow_state::StateError::Fenced { .. }) = err.downcast_ref() {
                return true;
            }
            next = err.source();
        }
        false
    }
}

fn list(errors: &[RuntimeError]) -> String {
    errors.iter().map(|e| format!("\n  {e}")).collect()
}

#[cfg(test)]
mod fenced_tests {
    use super::*;

    fn fenced() -> flow_state::StateError {
        flow_state::StateError::Fenced {
            pipeline: "p".to_owned(),
            partition: 3,
            why: "the owner node moved on".to_owned(),
            source: None,
        }
    }

    #[test]
    fn a_fenced_commit_is_recognised_through_a_sink_error_and_nothing_else_is() {
        let direct = RuntimeError::State {
            partition: 3,
            source: fenced(),
        };
        let through_sink = RuntimeError::Sink {
            partition: 3,
            sink: "out".to_owned(),
            source: SinkError::State(fenced()),
        };
        let other = RuntimeError::State {
            partition: 3,
            source: flow_state::StateError::NoMirror { what: "load" },
        };
        let task = RuntimeError::Task {
            partition: 3,
            reason: "fenced".to_owned(),
        };
        assert_eq!(
            [&direct, &through_sink, &other, &task].map(RuntimeError::is_fenced),
            [true, true, false, false]
        );
    }
}
