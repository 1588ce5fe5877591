//! The sled trees of one store, and how a failed transaction over them becomes a [`StateError`].

use sled::transaction::{ConflictableTransactionError, TransactionError};

use crate::error::StateError;

/// The sled trees of one store (cheap to clone: `Arc`s inside).
#[derive(Clone)]
pub(crate) struct Trees {
    pub db: sled::Db,
    /// `pipeline\0 partition` -> opaque position.
    pub positions: sled::Tree,
    /// `pipeline\0 sink\0 partition seq` -> encoded batch.
    pub batches: sled::Tree,
    /// `pipeline\0 sink\0 partition` -> queue bounds `head, next`.
    pub batch_seq: sled::Tree,
    /// `pipeline\0 sink\0 partition` -> bincode map.
    pub fingerprints: sled::Tree,
    /// `pipeline\0 owner\0 partition seq` -> bincode dead letter.
    pub dead_letters: sled::Tree,
    /// `pipeline\0 owner\0 partition` -> next dead-letter seq.
    pub dead_letter_seq: sled::Tree,
    /// `pipeline\0 sink\0 name` -> bytes.
    pub sink_values: sled::Tree,
    /// `pipeline\0 owner\0 partition name` -> u64 ([`crate::counters`]).
    pub counters: sled::Tree,
}

impl Trees {
    pub(crate) fn open(db: sled::Db) -> Result<Trees, StateError> {
        let tree = |name: &'static str| {
            db.open_tree(name)
                .map_err(|e| StateError::sled("open_tree", name, e))
        };
        Ok(Trees {
            positions: tree("positions")?,
            batches: tree("batches")?,
            batch_seq: tree("batch_seq")?,
            fingerprints: tree("fingerprints")?,
            dead_letters: tree("dead_letters")?,
            dead_letter_seq: tree("dead_letter_seq")?,
            sink_values: tree("sink_values")?,
            counters: tree("counters")?,
            db,
        })
    }
}

pub(crate) type TxResult<T> = Result<T, ConflictableTransactionError<StateError>>;

pub(crate) fn tx_error(
    op: &'static str,
    target: String,
    e: TransactionError<StateError>,
) -> StateError {
    match e {
        TransactionError::Abort(e) => e,
        TransactionError::Storage(e) => StateError::sled(op, target, e),
    }
}
