//! Running totals of a pipeline since its start, for live displays (the worker's progress line):
//! messages committed and rows sealed into the outbox. Like the source lag, they are figures of
//! this process, kept in memory and never persisted.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// What the partitions have committed since the pipeline started.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Progress {
    /// Source messages whose epoch was committed.
    pub messages: u64,
    /// Rows of the batches committed into the outbox, over every sink.
    pub rows_sealed: u64,
}

/// The counters every partition adds to, shared with [`crate::PipelineControl`].
#[derive(Clone, Debug, Default)]
pub(crate) struct ProgressCounters {
    messages: Arc<AtomicU64>,
    rows_sealed: Arc<AtomicU64>,
}

impl ProgressCounters {
    /// One committed epoch.
    pub(crate) fn committed(&self, messages: u64, rows_sealed: u64) {
        self.messages.fetch_add(messages, Ordering::Relaxed);
        self.rows_sealed.fetch_add(rows_sealed, Ordering::Relaxed);
    }

    pub(crate) fn get(&self) -> Progress {
        Progress {
            messages: self.messages.load(Ordering::Relaxed),
            rows_sealed: self.rows_sealed.load(Ordering::Relaxed),
        }
    }
}
