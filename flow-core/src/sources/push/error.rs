//! [`PushError`]: why a push source refused a send, or what a receipt resolved to instead.

use thiserror::Error;

use crate::error::ValueError;
use crate::message::MessageId;
use crate::types::{StreamSchema, StreamType};

/// Why a send was refused, or what a receipt resolved to instead of success.
#[derive(Error, Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum PushError {
    /// The row lacks a value for `column` and those after it.
    #[error("the row has {got} values but the schema has {expected} columns: column `{column}` has no value")]
    MissingValue {
        /// The first column without a value.
        column: String,
        /// Values given.
        got: usize,
        /// Columns of the schema.
        expected: usize,
    },
    /// The row has more values than the schema has columns.
    #[error("the row has {got} values but the schema has only {expected} columns")]
    ExtraValues {
        /// Values given.
        got: usize,
        /// Columns of the schema.
        expected: usize,
    },
    /// A value does not fit its column: wrong type, out of range, null where not optional, bad
    /// JSON form.
    #[error("column `{column}` ({ty}): {what}")]
    Value {
        /// The column's name.
        column: String,
        /// The column's type.
        ty: StreamType,
        /// What is wrong with the value.
        what: String,
    },
    /// A JSON message has a key that is not a column.
    #[error("`{key}`: not a column of the declared schema")]
    UnknownColumn {
        /// The key.
        key: String,
    },
    /// A JSON message gives a key twice (which value is meant is a guess).
    #[error("key `{key}` appears more than once in the record: give each column once")]
    DuplicateKey {
        /// The key.
        key: String,
    },
    /// A JSON message is not a JSON object.
    #[error("not a JSON object: {reason}")]
    NotJsonObject {
        /// The JSON parser's error.
        reason: String,
    },
    /// [`Route::Partition`](super::Route::Partition) names a partition the pipeline does not have.
    #[error("partition {partition} does not exist: the pipeline has {partitions}")]
    NoSuchPartition {
        /// The partition asked for.
        partition: u32,
        /// The pipeline's partition count.
        partitions: u32,
    },
    /// [`PushHandle::finish`](super::PushHandle::finish) was called: the source takes no more messages.
    #[error("the push source was finished: it takes no more messages")]
    Finished,
    /// The pipeline's partition stopped or failed: nothing was enqueued.
    #[error("partition {partition} of the pipeline has stopped ({reason}): nothing was enqueued")]
    Stopped {
        /// The message's partition.
        partition: u32,
        /// How the partition ended.
        reason: String,
    },
    /// The pipeline stopped or failed before the message was committed: it is lost unless the
    /// application sends it again.
    #[error(
        "partition {partition} stopped before the message was committed ({reason}): send it again"
    )]
    NotCommitted {
        /// The message's partition.
        partition: u32,
        /// How the partition ended.
        reason: String,
    },
    /// The message is committed, but the pipeline stopped before every sink held it: it stays
    /// in the outbox and the next run on the same state directory delivers it.
    #[error("message {id} is committed but was not delivered before the pipeline stopped ({reason}); the next run delivers it from the outbox")]
    NotDelivered {
        /// The message's id.
        id: MessageId,
        /// How the partition ended.
        reason: String,
    },
}

pub(super) fn value_error(err: ValueError, schema: &StreamSchema) -> PushError {
    match err {
        ValueError::Invalid { column, ty, what } => PushError::Value { column, ty, what },
        ValueError::MissingValues { expected, got } => PushError::MissingValue {
            column: schema
                .columns()
                .get(got)
                .map(|column| column.name.clone())
                .unwrap_or_default(),
            got,
            expected,
        },
        ValueError::TooManyValues { expected } => PushError::ExtraValues {
            got: expected + 1,
            expected,
        },
        // Not a row's error; pushing values never returns it.
        ValueError::BadMessageId { text } => PushError::NotJsonObject { reason: text },
    }
}
