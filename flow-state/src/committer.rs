//! The committer thread: applies requests in sled transactions and makes each group durable with
//! one `db.flush()` + one fsync of sled's data file.

use std::sync::mpsc::{Receiver, TryRecvError};
use std::sync::Arc;
use std::time::Instant;

use crate::codec::{encode_batch, show_key, BodyRecord};
use crate::counters::PreparedCounter;
use crate::durability::Durability;
use crate::error::StateError;
use crate::prepare::{PreparedAck, PreparedBody, PreparedCommit, PreparedFingerprints};
use crate::segments::Segments;
use crate::stats::{bump, StatCounters};
use crate::transactions::{
    apply_ack, apply_commit, apply_dead_letter_removal, apply_fingerprints, apply_sink_value,
};
use crate::trees::{tx_error, Trees};
use crate::types::CommitReceipt;

pub(crate) enum Op {
    Commit(PreparedCommit),
    Ack(PreparedAck),
    SetFingerprints(PreparedFingerprints),
    /// Sets (`Some`) or removes (`None`) one `sink_values` key.
    SetSinkValue(Vec<u8>, Option<Vec<u8>>),
    /// Removes these `dead_letters` keys (their owners' counters stay: seqs are never reused).
    RemoveDeadLetters(Vec<Vec<u8>>),
    /// Adds to counters on their own (what no commit or acknowledgement carries: failures).
    AddCounters(Vec<PreparedCounter>),
    Shutdown,
}

pub(crate) enum Outcome {
    Commit(CommitReceipt),
    Done,
    /// How many of the requested entries existed and were removed.
    Removed(u64),
}

pub(crate) type Reply = Box<dyn FnOnce(Result<Outcome, StateError>) + Send>;

pub(crate) struct Request {
    pub op: Op,
    pub reply: Reply,
}

pub(crate) struct Committer {
    pub trees: Trees,
    pub durability: Durability,
    pub segments: Segments,
    pub stats: Arc<StatCounters>,
    pub max_group: usize,
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
    fn stage_group(&mut self, group: &mut [Request]) -> Vec<Option<StateError>> {
        let mut failures: Vec<Option<StateError>> = group
            .iter_mut()
            .map(|req| match &mut req.op {
                Op::Commit(c) => self.stage(c).err(),
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
        let mut running = true;
        while running {
            let Ok(first) = rx.recv() else { break };
            let mut group = vec![first];
            while group.len() < self.max_group.max(1) {
                match rx.try_recv() {
                    Ok(req) => group.push(req),
                    Err(TryRecvError::Empty | TryRecvError::Disconnected) => break,
                }
            }
            let started = Instant::now();
            let staged = self.stage_group(&mut group);
            let mut answered = Vec::with_capacity(group.len());
            let mut wrote = false;
            for (req, staging) in group.into_iter().zip(staged) {
                if matches!(req.op, Op::Shutdown) {
                    running = false;
                    shutdown_replies.push(req.reply);
                    continue;
                }
                let result = match staging {
                    Some(e) => Err(e),
                    None => self.apply(&req.op),
                };
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
            let durable = if wrote {
                bump(&self.stats.groups, 1);
                self.durability.sync(&self.trees.db, &self.stats)
            } else {
                Ok(())
            };
            match &durable {
                // Only now may segments freed by this group's acknowledgements go.
                Ok(()) => match self.segments.delete_freed() {
                    Ok(deleted) => bump(&self.stats.segments_deleted, deleted),
                    Err(e) => {
                        tracing::warn!(error = %e, "a fully acknowledged payload segment could not be deleted; it is retried at the next open. Check the state directory's permissions")
                    }
                },
                Err(e) => {
                    tracing::error!(error = %e, requests = answered.len(), "state commit group is not durable")
                }
            }
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
            match self.segments.delete_idle() {
                Ok(deleted) => bump(&self.stats.segments_deleted, deleted),
                Err(e) => {
                    tracing::warn!(error = %e, "a fully acknowledged payload segment could not be deleted; it is retried at the next open. Check the state directory's permissions")
                }
            }
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
}
