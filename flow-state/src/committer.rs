//! The committer thread: applies requests in sled transactions and makes each group durable with
//! one `db.flush()` + one fsync of sled's data file.

use std::sync::mpsc::{Receiver, TryRecvError};
use std::sync::{Arc, OnceLock};
use std::time::Instant;

use crate::codec::{encode_batch, show_key, BodyRecord};
use crate::durability::Durability;
use crate::error::StateError;
use crate::prepare::{PreparedBody, PreparedCommit};
use crate::request::{Op, Outcome, Reply, Request};
use crate::segments::Segments;
use crate::stats::{bump, StatCounters};
use crate::transactions::{
    apply_ack, apply_commit, apply_dead_letter_removal, apply_fingerprints, apply_sink_value,
};
use crate::trees::{tx_error, Trees};
use crate::zk::load;
use crate::zk::ZkMirror;

pub(crate) struct Committer {
    pub trees: Trees,
    pub durability: Durability,
    pub segments: Segments,
    pub stats: Arc<StatCounters>,
    pub max_group: usize,
    /// Cluster mode's ZooKeeper mirror, once attached; writes go to it before sled.
    pub mirror: Arc<OnceLock<ZkMirror>>,
}

impl Committer {
    /// Writes the payloads of a commit to their segments and encodes its batch values.
    fn stage(&mut self, commit: &mut PreparedCommit) -> Result<(), StateError> {
        for sink in &mut commit.sinks {
            let context = show_key(&sink.queue_key);
            for batch in &sink.batches {
                let record = match &batch.body {
                    PreparedBody::Record(record) => record.clone(),
                    PreparedBody::Payload { bytes, checksum } => {
                        let at = self.segments.append(&sink.queue_key, bytes, *checksum)?;
                        sink.segments.push(at.segment);
                        BodyRecord::Segment {
                            segment: at.segment,
                            offset: at.offset,
                            len: at.len,
                            checksum: at.checksum,
                        }
                    }
                };
                sink.values
                    .push(encode_batch(&batch.header, &record, &context)?);
            }
        }
        Ok(())
    }

    /// Stages every commit of the group and makes the payloads durable before any sled
    /// transaction can reference them; a commit whose staging failed is answered with its error.
    /// `refused` (empty without a mirror) holds the requests the ZooKeeper mirror refused:
    /// they are answered with that and not staged.
    fn stage_group(
        &mut self,
        group: &mut [Request],
        refused: Vec<Option<StateError>>,
    ) -> Vec<Option<StateError>> {
        let mut refused = refused.into_iter();
        let mut failures: Vec<Option<StateError>> = group
            .iter_mut()
            .map(|req| match (&mut req.op, refused.next().flatten()) {
                (_, Some(refusal)) => Some(refusal),
                (Op::Commit(c), None) => self.stage(c).err(),
                _ => None,
            })
            .collect();
        match self.segments.sync() {
            Ok(fsyncs) => bump(&self.stats.segment_fsyncs, fsyncs),
            Err(e) => {
                tracing::error!(error = %e, "payload segments are not durable");
                for (failure, req) in failures.iter_mut().zip(group.iter()) {
                    if matches!(req.op, Op::Commit(_)) && failure.is_none() {
                        *failure = Some(e.duplicate());
                    }
                }
            }
        }
        failures
    }

    fn apply(&mut self, op: &Op) -> Result<Outcome, StateError> {
        match op {
            Op::Shutdown => Ok(Outcome::Done),
            Op::Commit(c) => {
                let receipt = apply_commit(&self.trees, c)?;
                for sink in &c.sinks {
                    for segment in &sink.segments {
                        self.segments.referenced(&sink.queue_key, *segment);
                    }
                }
                Ok(Outcome::Commit(receipt))
            }
            Op::Ack(a) => {
                if let Some(segment) = apply_ack(&self.trees, a)? {
                    self.segments.released(&a.queue_key, segment);
                }
                Ok(Outcome::Done)
            }
            Op::SetFingerprints(f) => apply_fingerprints(&self.trees, f).map(|()| Outcome::Done),
            Op::SetSinkValue(key, value) => {
                apply_sink_value(&self.trees, key, value.as_deref()).map(|()| Outcome::Done)
            }
            Op::RemoveDeadLetters(keys) => {
                apply_dead_letter_removal(&self.trees, keys).map(Outcome::Removed)
            }
            Op::Replace(prepared) => {
                for (queue, segment) in load::apply(&self.trees, prepared)? {
                    self.segments.released(&queue, segment);
                }
                Ok(Outcome::Done)
            }
            Op::AddCounters(adds) => self
                .trees
                .counters
                .transaction(|tree| crate::counters::apply(tree, adds))
                .map(|()| Outcome::Done)
                .map_err(|e| tx_error("counter addition", format!("{} counters", adds.len()), e)),
        }
    }

    /// Runs until a `Shutdown` request arrives or every sender is gone; ends with a final sync.
    pub(crate) fn run(mut self, rx: Receiver<Request>) -> Result<(), StateError> {
        let mut shutdown_replies: Vec<Reply> = Vec::new();
        while shutdown_replies.is_empty() {
            let Some(mut group) = self.next_group(&rx) else {
                break;
            };
            let started = Instant::now();
            // Cluster mode: ZooKeeper first. `mirrored`: the partition each request wrote there.
            let (refused, mirrored) = match self.mirror.get() {
                Some(mirror) => write_ahead(mirror, &group, &self.stats),
                None => (Vec::new(), Vec::new()),
            };
            let staged = self.stage_group(&mut group, refused);
            let (answered, wrote) =
                self.apply_group(group, staged, &mirrored, &mut shutdown_replies);
            let durable = self.make_durable(wrote, &mirrored, answered.len());
            tracing::trace!(
                requests = answered.len(),
                micros = started.elapsed().as_micros() as u64,
                "state commit group done"
            );
            for (reply, result) in answered {
                match &durable {
                    Ok(()) => reply(result),
                    Err(e) => reply(Err(e.duplicate())),
                }
            }
        }
        let result = self.durability.sync(&self.trees.db, &self.stats);
        if result.is_ok() {
            count_deleted(&self.stats, self.segments.delete_idle());
        }
        for reply in shutdown_replies {
            reply(match &result {
                Ok(()) => Ok(Outcome::Done),
                Err(e) => Err(e.duplicate()),
            });
        }
        tracing::debug!("state committer stopped");
        result
    }

    /// The next commit group: the first request waited for, then those already queued, up to
    /// the group's size. `None` once every sender is gone.
    fn next_group(&self, rx: &Receiver<Request>) -> Option<Vec<Request>> {
        let first = rx.recv().ok()?;
        let mut group = vec![first];
        while group.len() < self.max_group.max(1) {
            match rx.try_recv() {
                Ok(req) => group.push(req),
                Err(TryRecvError::Empty | TryRecvError::Disconnected) => break,
            }
        }
        Some(group)
    }

    /// Applies the group's requests in order (a staging failure answers its request instead),
    /// returning each reply with its result and whether anything was written. A shutdown
    /// request is answered only after the committer's last sync (`shutdown_replies`).
    fn apply_group(
        &mut self,
        group: Vec<Request>,
        staged: Vec<Option<StateError>>,
        mirrored: &[Option<u32>],
        shutdown_replies: &mut Vec<Reply>,
    ) -> (Vec<Answer>, bool) {
        let mut answered = Vec::with_capacity(group.len());
        let mut wrote = false;
        for (i, (req, staging)) in group.into_iter().zip(staged).enumerate() {
            if matches!(req.op, Op::Shutdown) {
                shutdown_replies.push(req.reply);
                continue;
            }
            let result = match staging {
                Some(e) => Err(e),
                None => self.apply(&req.op),
            };
            if let (Err(e), Some(Some(partition)), Some(mirror)) =
                (&result, mirrored.get(i), self.mirror.get())
            {
                mirror.lost(*partition, e);
            }
            bump(&self.stats.requests, 1);
            match (&req.op, &result) {
                (_, Err(e)) => {
                    bump(&self.stats.failed_requests, 1);
                    tracing::debug!(error = %e, "state request failed");
                }
                (Op::Commit(_), Ok(_)) => bump(&self.stats.commits, 1),
                (Op::Ack(_), Ok(_)) => bump(&self.stats.acknowledgements, 1),
                _ => {}
            }
            wrote |= result.is_ok();
            answered.push((req.reply, result));
        }
        (answered, wrote)
    }

    /// One sync for the whole group when it wrote anything; only once it is durable may the
    /// payload segments freed by acknowledgements go. A failed sync loses what the group
    /// wrote to ZooKeeper for its partitions (`mirrored`), which are read from there again.
    fn make_durable(
        &mut self,
        wrote: bool,
        mirrored: &[Option<u32>],
        requests: usize,
    ) -> Result<(), StateError> {
        let durable = if wrote {
            bump(&self.stats.groups, 1);
            self.durability.sync(&self.trees.db, &self.stats)
        } else {
            Ok(())
        };
        match &durable {
            Ok(()) => count_deleted(&self.stats, self.segments.delete_freed()),
            Err(e) => {
                if let Some(mirror) = self.mirror.get() {
                    for partition in mirrored.iter().flatten() {
                        mirror.lost(*partition, e);
                    }
                }
                tracing::error!(error = %e, requests, "state commit group is not durable");
            }
        }
        durable
    }
}

/// A request's reply with its result, sent once the group is durable (or is not).
type Answer = (Reply, Result<Outcome, StateError>);

/// Counts the payload segments deleted once fully acknowledged; a segment that could not be
/// deleted is left for the next open.
fn count_deleted(stats: &StatCounters, deleted: Result<u64, StateError>) {
    match deleted {
        Ok(deleted) => bump(&stats.segments_deleted, deleted),
        Err(e) => {
            tracing::warn!(error = %e, "a fully acknowledged payload segment could not be deleted; it is retried at the next open. Check the state directory's permissions")
        }
    }
}

/// Writes the requests of a group to ZooKeeper. Returns, per request, why the mirror refused it
/// (it is then answered with that, not applied) and the partition it wrote, if any.
fn write_ahead(
    mirror: &ZkMirror,
    group: &[Request],
    stats: &StatCounters,
) -> (Vec<Option<StateError>>, Vec<Option<u32>>) {
    let ops: Vec<&Op> = group.iter().map(|req| &req.op).collect();
    let (results, multis) = mirror.write_ahead(&ops);
    bump(&stats.zk_multis, multis);
    let mut refused = Vec::with_capacity(results.len());
    let mut mirrored = Vec::with_capacity(results.len());
    for result in results {
        match result {
            Ok(partition) => {
                refused.push(None);
                mirrored.push(partition);
            }
            Err(e) => {
                if matches!(e, StateError::Fenced { .. }) {
                    bump(&stats.fenced, 1);
                }
                refused.push(Some(e));
                mirrored.push(None);
            }
        }
    }
    (refused, mirrored)
}
