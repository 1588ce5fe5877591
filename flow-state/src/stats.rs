//! Committer statistics ([`crate::StateStore::stats`]), counted with relaxed atomics: they are
//! read for reports only, never to decide anything.

use std::sync::atomic::{AtomicU64, Ordering};

use crate::types::StoreStats;

#[derive(Default)]
pub(crate) struct StatCounters {
    pub(crate) groups: AtomicU64,
    pub(crate) fsyncs: AtomicU64,
    pub(crate) blob_fsyncs: AtomicU64,
    pub(crate) segment_fsyncs: AtomicU64,
    pub(crate) segments_deleted: AtomicU64,
    pub(crate) dir_fsyncs: AtomicU64,
    pub(crate) flushes: AtomicU64,
    pub(crate) requests: AtomicU64,
    pub(crate) commits: AtomicU64,
    pub(crate) acknowledgements: AtomicU64,
    pub(crate) failed_requests: AtomicU64,
    pub(crate) zk_multis: AtomicU64,
    pub(crate) fenced: AtomicU64,
}

pub(crate) fn bump(counter: &AtomicU64, by: u64) {
    counter.fetch_add(by, Ordering::Relaxed);
}

impl StatCounters {
    pub(crate) fn snapshot(&self) -> StoreStats {
        StoreStats {
            groups: self.groups.load(Ordering::Relaxed),
            fsyncs: self.fsyncs.load(Ordering::Relaxed),
            blob_fsyncs: self.blob_fsyncs.load(Ordering::Relaxed),
            segment_fsyncs: self.segment_fsyncs.load(Ordering::Relaxed),
            segments_deleted: self.segments_deleted.load(Ordering::Relaxed),
            dir_fsyncs: self.dir_fsyncs.load(Ordering::Relaxed),
            flushes: self.flushes.load(Ordering::Relaxed),
            requests: self.requests.load(Ordering::Relaxed),
            commits: self.commits.load(Ordering::Relaxed),
            acknowledgements: self.acknowledgements.load(Ordering::Relaxed),
            failed_requests: self.failed_requests.load(Ordering::Relaxed),
            zk_multis: self.zk_multis.load(Ordering::Relaxed),
            fenced: self.fenced.load(Ordering::Relaxed),
        }
    }
}
