//! Tells a source partition's [`PartitionObserver`] how far every sink holds its messages.
//!
//! The outbox numbers each sink partition's batches in commit order and acknowledges them in
//! any order (shards), so an epoch is delivered for a sink once the oldest batch still pending
//! in that sink's queue is newer than every batch committed up to the epoch. A
//! [`DeliveryTracker`] task keeps the committed epochs not yet delivered with, per sink, the
//! newest seq committed up to them, and re-reads the oldest pending seq of each queue whenever
//! the store acknowledges a batch ([`StateStore::acknowledgements`]): work per batch, never per
//! message.

use std::collections::VecDeque;
use std::sync::Arc;

use flow_state::{SinkPartition, StateStore};
use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;
use tracing::warn;

use crate::plugin::PartitionObserver;

/// A committed epoch: its position, and per sink the newest seq committed up to it.
struct Committed {
    position: Vec<u8>,
    through: Vec<Option<u64>>,
}

/// The tracking task of one partition; see the module documentation.
pub(crate) struct DeliveryTracker {
    tx: mpsc::UnboundedSender<(Vec<u8>, Vec<Option<u64>>)>,
    task: JoinHandle<()>,
    sinks: Vec<String>,
}

impl DeliveryTracker {
    /// Starts tracking the queues of `sinks` (in this order) of `partition`.
    pub(crate) fn start(
        store: StateStore,
        pipeline: &str,
        partition: u32,
        sinks: Vec<String>,
        observer: Arc<dyn PartitionObserver>,
    ) -> DeliveryTracker {
        let (tx, rx) = mpsc::unbounded_channel();
        let keys = sinks
            .iter()
            .map(|sink| SinkPartition::new(pipeline, sink.as_str(), partition))
            .collect();
        let acks = store.acknowledgements();
        let task = tokio::spawn(track(store, keys, observer, rx, acks));
        DeliveryTracker { tx, task, sinks }
    }

    /// An epoch committed at `position` with the batch seqs the outbox assigned per sink.
    pub(crate) fn committed(&self, position: &[u8], batch_seqs: &[(String, Vec<u64>)]) {
        let newest = self
            .sinks
            .iter()
            .map(|sink| {
                batch_seqs
                    .iter()
                    .find(|(name, _)| name == sink)
                    .and_then(|(_, seqs)| seqs.iter().copied().max())
            })
            .collect();
        // The task ends only after `finish`, which consumes the tracker.
        let _ = self.tx.send((position.to_vec(), newest));
    }

    /// Ends the task without a last report (the partition task is going away).
    pub(crate) fn abort(self) {
        self.task.abort();
    }

    /// Reports what the sinks delivered by now and ends the task (after the sinks closed).
    pub(crate) async fn finish(self) {
        drop(self.tx);
        if let Err(err) = self.task.await {
            warn!(error = %err, "the delivery tracker of a partition failed");
        }
    }
}

async fn track(
    store: StateStore,
    keys: Vec<SinkPartition>,
    observer: Arc<dyn PartitionObserver>,
    mut rx: mpsc::UnboundedReceiver<(Vec<u8>, Vec<Option<u64>>)>,
    mut acks: watch::Receiver<u64>,
) {
    // Batches left pending by an earlier run hold older messages: count them in.
    let mut newest = match read_queues(&store, &keys, true).await {
        Some(seqs) => seqs.into_iter().map(|(_, newest)| newest).collect(),
        None => vec![None; keys.len()],
    };
    let mut pending: VecDeque<Committed> = VecDeque::new();
    let mut open = true;
    while open {
        tokio::select! {
            received = rx.recv() => match received {
                Some(epoch) => add(&mut pending, &mut newest, epoch),
                None => open = false,
            },
            changed = acks.changed(), if !pending.is_empty() => {
                if changed.is_err() {
                    // The store is gone: nothing will be acknowledged any more.
                    open = false;
                }
            }
        }
        while let Ok(epoch) = rx.try_recv() {
            add(&mut pending, &mut newest, epoch);
        }
        if !pending.is_empty() {
            acks.borrow_and_update();
            resolve(&store, &keys, &mut pending, observer.as_ref()).await;
        }
    }
}

fn add(
    pending: &mut VecDeque<Committed>,
    newest: &mut [Option<u64>],
    (position, seqs): (Vec<u8>, Vec<Option<u64>>),
) {
    for (newest, seq) in newest.iter_mut().zip(seqs) {
        *newest = (*newest).max(seq);
    }
    pending.push_back(Committed {
        position,
        through: newest.to_vec(),
    });
}

/// Pops every epoch all sinks hold and tells the observer the newest one.
async fn resolve(
    store: &StateStore,
    keys: &[SinkPartition],
    pending: &mut VecDeque<Committed>,
    observer: &dyn PartitionObserver,
) {
    let needs_store = pending
        .back()
        .is_some_and(|epoch| epoch.through.iter().any(Option::is_some));
    let oldest: Vec<Option<u64>> = if needs_store {
        match read_queues(store, keys, false).await {
            Some(seqs) => seqs.into_iter().map(|(oldest, _)| oldest).collect(),
            None => return,
        }
    } else {
        vec![None; keys.len()]
    };
    let mut delivered = None;
    while let Some(epoch) = pending.front() {
        let held =
            epoch
                .through
                .iter()
                .zip(&oldest)
                .all(|(through, oldest)| match (through, oldest) {
                    (Some(through), Some(oldest)) => oldest > through,
                    _ => true,
                });
        if !held {
            break;
        }
        delivered = pending.pop_front();
    }
    if let Some(epoch) = delivered {
        observer.delivered(&epoch.position);
    }
}

/// Per queue, the oldest and (if `newest`, which reads the whole queue) the newest pending seq;
/// `None` if the store cannot be read (logged; the next acknowledgement tries again).
async fn read_queues(
    store: &StateStore,
    keys: &[SinkPartition],
    newest: bool,
) -> Option<Vec<(Option<u64>, Option<u64>)>> {
    let store = store.clone();
    let keys = keys.to_vec();
    let read = tokio::task::spawn_blocking(move || {
        keys.iter()
            .map(|key| {
                let oldest = store.oldest_undelivered(key)?.map(|b| b.seq);
                let newest = match oldest {
                    Some(_) if newest => store.undelivered(key)?.last().map(|b| b.seq),
                    _ => None,
                };
                Ok((oldest, newest))
            })
            .collect::<Result<Vec<_>, flow_state::StateError>>()
    })
    .await;
    match read {
        Ok(Ok(seqs)) => Some(seqs),
        Ok(Err(err)) => {
            warn!(error = %err, "cannot read the outbox to tell what was delivered");
            None
        }
        Err(err) => {
            warn!(error = %err, "cannot read the outbox to tell what was delivered");
            None
        }
    }
}
