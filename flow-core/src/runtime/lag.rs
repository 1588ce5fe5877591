//! How far each partition's source is behind its broker, as the last read reported it.
//!
//! Lag is a live figure about the broker, not state: it is kept in memory, shared between the
//! partitions that report it and whoever shows it (`status` through the worker's snapshot, an
//! embedding program through [`PipelineControl::source_lag`](crate::PipelineControl::source_lag)),
//! and means nothing once the worker has stopped.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// What "not known" is stored as: a source that does not report lag, or has not read yet.
const UNKNOWN: u64 = u64::MAX;

/// One slot per partition.
#[derive(Clone, Debug)]
pub(crate) struct SourceLags {
    slots: Arc<[AtomicU64]>,
}

impl SourceLags {
    pub(crate) fn new(partitions: u32) -> SourceLags {
        SourceLags {
            slots: (0..partitions).map(|_| AtomicU64::new(UNKNOWN)).collect(),
        }
    }

    /// Records what a read reported; `None` leaves the last known figure.
    pub(crate) fn report(&self, partition: u32, lag: Option<u64>) {
        if let (Some(lag), Some(slot)) = (lag, self.slots.get(partition as usize)) {
            slot.store(lag.min(UNKNOWN - 1), Ordering::Relaxed);
        }
    }

    pub(crate) fn get(&self, partition: u32) -> Option<u64> {
        let lag = self.slots.get(partition as usize)?.load(Ordering::Relaxed);
        (lag != UNKNOWN).then_some(lag)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_partition_shows_the_last_lag_reported_and_none_before_any_or_out_of_range() {
        let lags = SourceLags::new(2);
        assert_eq!(lags.get(0), None);
        lags.report(0, Some(40));
        lags.report(0, None);
        assert_eq!(
            (lags.get(0), lags.get(1), lags.get(2)),
            (Some(40), None, None)
        );
        lags.report(0, Some(0));
        lags.report(5, Some(1));
        assert_eq!(lags.get(0), Some(0));
    }
}
