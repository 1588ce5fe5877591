//! Typed errors of the runtime and its plugins. Each variant says what failed and with what input.

use std::fmt;
use std::path::PathBuf;

use thiserror::Error;

use crate::types::StreamType;

/// A boxed error of a third-party plugin.
pub type BoxError = Box<dyn std::error::Error + Send + Sync + 'static>;

#[derive(Error, Debug, Clone, PartialEq)]
pub enum ValueError {
    #[error("`{text}` is not a message id (expected `<partition>-<offset>`)")]
    BadMessageId { text: String },
    #[error("row has more values than the {expected} columns of its schema")]
    TooManyValues { expected: usize },
    #[error("row has {got} of {expected} values")]
    MissingValues { expected: usize, got: usize },
    #[error("column `{column}` ({ty}): {what}")]
    Invalid {
        column: String,
        ty: StreamType,
        what: String,
    },
}

/// One problem found in a pipeline spec, with its path (`sinks[0].parameters.path`).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Violation {
    pub path: String,
    pub message: String,
}

impl Violation {
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

#[derive(Error, Debug)]
pub enum SourceError {
    #[error("{what} `{path}`: {source}")]
    Io {
        what: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// A record that does not match the declared schema: `file:line: column: what is wrong`.
    #[error("{location}: {what}")]
    BadRecord { location: String, what: String },
    /// An input file cannot be read as the source needs (not a regular file, or no longer the
    /// file the committed position was taken in); `what` says why and how to go on.
    #[error("input file `{path}`: {what}")]
    InputFile { path: PathBuf, what: String },
    #[error("source position `{position:?}` cannot be decoded: {what}")]
    BadPosition { position: Vec<u8>, what: String },
    #[error(transparent)]
    Plugin(BoxError),
}

/// Why re-reading the source for pending batches failed.
#[derive(Error, Debug)]
pub enum ReplayError {
    #[error("source: {0}")]
    Source(#[source] SourceError),
    #[error("processor `{processor}`: {source}")]
    Processor {
        processor: String,
        #[source]
        source: ProcessorError,
    },
}

#[derive(Error, Debug)]
pub enum SinkError {
    #[error("re-reading the source to rebuild pending batches: {0}")]
    Replay(#[source] Box<ReplayError>),
    #[error("{what} `{path}`: {source}")]
    Io {
        what: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("sink state: {0}")]
    State(#[from] flow_state::StateError),
    #[error("message {message_id} rejected: {reason}")]
    Rejected { message_id: String, reason: String },
    #[error("delivery stopped: {reason}")]
    Delivery { reason: String },
    #[error("{0}")]
    Refused(String),
    /// The target system failed or refused: `context` says what was being done, `source` is the
    /// target's own (classified) error.
    #[error("{context}: {source}")]
    Target {
        context: String,
        #[source]
        source: BoxError,
    },
    #[error(transparent)]
    Plugin(BoxError),
}

impl From<ReplayError> for SinkError {
    fn from(err: ReplayError) -> Self {
        SinkError::Replay(Box::new(err))
    }
}

#[derive(Error, Debug)]
pub enum ProcessorError {
    #[error("message {message_id}: {source}")]
    Value {
        message_id: String,
        #[source]
        source: ValueError,
    },
    #[error(transparent)]
    Plugin(BoxError),
}

/// Why a partition or the whole pipeline stopped.
#[derive(Error, Debug)]
pub enum RuntimeError {
    #[error("partition {partition}: state store: {source}")]
    State {
        partition: u32,
        #[source]
        source: flow_state::StateError,
    },
    #[error("partition {partition}: source: {source}")]
    Source {
        partition: u32,
        #[source]
        source: SourceError,
    },
    #[error("partition {partition}: processor `{processor}`: {source}")]
    Processor {
        partition: u32,
        processor: String,
        #[source]
        source: ProcessorError,
    },
    #[error("partition {partition}: sink `{sink}`: {source}")]
    Sink {
        partition: u32,
        sink: String,
        #[source]
        source: SinkError,
    },
    #[error("partition {partition}: task failed: {reason}")]
    Task { partition: u32, reason: String },
    #[error("opening the state store in `{dir}`: {source}")]
    OpenState {
        dir: PathBuf,
        #[source]
        source: flow_state::StateError,
    },
    /// The state directory belongs to another pipeline or partition count.
    #[error("{0}")]
    OtherPipeline(#[source] flow_state::StateError),
    #[error("{} partition(s) failed:{}", .0.len(), list(.0))]
    PartitionsFailed(Vec<RuntimeError>),
}

fn list(errors: &[RuntimeError]) -> String {
    errors.iter().map(|e| format!("\n  {e}")).collect()
}
