//! Rebuilding the pending batches that the outbox keeps as bounds.
//!
//! With a replayable source the outbox stores, per (batch, shard), only the batch's message-id
//! bounds, its token, row count, encoded size, content hash and encoding plan. After a restart
//! the sink re-reads the source from the position the oldest pending batch's epoch started at,
//! re-cuts exactly at the stored bounds, re-encodes and re-routes every row, and sends a part only
//! if its rows hash equal to what was committed: a replay never sends different rows under an
//! old token. Anything that differs stops the sink with the batch named and its rows kept.

use std::sync::Arc;

use async_trait::async_trait;
use flow_core::delivery::OutboxDelivery;
use flow_core::{Headroom, MessageBatch, Replay, SinkContext, SinkError};
use flow_state::{SealedBatch, StoredBatch, StoredBody};

use crate::delivery::cutter::{BatchCutter, Part};
use crate::delivery::sink_state::SinkShared;
use crate::server::session::{ColumnsPlan, WriterSession};

/// The stored entries (one per shard still pending) of one logical batch, in seq order.
struct Pending {
    first: u64,
    last: u64,
    entries: Vec<StoredBatch>,
}

/// Where rebuilt batches go: the delivery queue at open, or the one batch a lane reads back.
#[async_trait]
pub trait Rebuilt: Send {
    /// Takes a rebuilt batch; `false` once the pipeline is stopping.
    async fn push(&mut self, seq: u64, batch: SealedBatch) -> Result<bool, SinkError>;
}

#[async_trait]
impl Rebuilt for OutboxDelivery {
    async fn push(&mut self, seq: u64, batch: SealedBatch) -> Result<bool, SinkError> {
        let sealed_at = batch.sealed_at_ms;
        OutboxDelivery::push(self, seq, batch, sealed_at).await
    }
}

/// The one batch [`Requeue::rebuild_one`] rebuilds.
#[async_trait]
impl Rebuilt for Option<(u64, SealedBatch)> {
    async fn push(&mut self, seq: u64, batch: SealedBatch) -> Result<bool, SinkError> {
        *self = Some((seq, batch));
        Ok(true)
    }
}

/// What a sink partition needs to rebuild and requeue its backlog.
pub struct Requeue<'a> {
    pub shared: &'a SinkShared,
    pub session: &'a WriterSession,
    pub ctx: &'a SinkContext,
}

impl Requeue<'_> {
    /// Queues every undelivered batch for delivery in outbox order: stored payloads as read
    /// back, bounds rebuilt from the source. Returns early (queueing nothing more) once the
    /// pipeline is stopping.
    pub async fn run(
        &self,
        backlog: Vec<StoredBatch>,
        delivery: &mut OutboxDelivery,
    ) -> Result<(), SinkError> {
        let mut run: Vec<StoredBatch> = Vec::new();
        for stored in backlog {
            let bounds = matches!(stored.body, StoredBody::Rebuild { .. });
            // A run is rebuilt with one plan: a batch sealed under another starts a new one.
            let other_plan = run
                .first()
                .is_some_and(|first| first.batch.plan != stored.batch.plan);
            if bounds && other_plan && !self.rebuild(std::mem::take(&mut run), delivery).await? {
                return Ok(());
            }
            if bounds {
                run.push(stored);
                continue;
            }
            if !self.rebuild(std::mem::take(&mut run), delivery).await? {
                return Ok(());
            }
            let current = self.session.plan();
            let plan = current.encoder.plan_fingerprint();
            // One encoded before a widening is re-encoded as it is delivered, where safe.
            let widened = self
                .session
                .plan_before_widening(&stored.batch.plan)
                .is_some();
            if stored.batch.plan != plan && !widened {
                // Stored bytes are sent as they are: under another plan they would land in the
                // wrong columns or types.
                return Err(self.mismatch(
                    &stored,
                    &format!(
                        "its stored rows were encoded with plan {} and the table's columns now give plan {plan}: {}",
                        stored.batch.plan,
                        self.session.plan_change(&stored.batch.plan)
                    ),
                ));
            }
            let key = self.ctx.state_key();
            if !delivery.push_stored(&self.ctx.store, &key, stored).await? {
                return Ok(());
            }
        }
        self.rebuild(run, delivery).await.map(|_| ())
    }

    /// Rebuilds one entry stored as bounds (a lane reading its set-aside batches back).
    pub async fn rebuild_one(&self, stored: StoredBatch) -> Result<SealedBatch, SinkError> {
        let seq = stored.seq;
        let mut rebuilt: Option<(u64, SealedBatch)> = None;
        self.rebuild(vec![stored], &mut rebuilt).await?;
        match rebuilt {
            Some((found, batch)) if found == seq => Ok(batch),
            _ => Err(SinkError::Delivery {
                reason: format!(
                    "{}: pending batch {seq} was not rebuilt",
                    self.ctx.state_key()
                ),
            }),
        }
    }

    /// Rebuilds a run of bounds-only batches; `false` once the pipeline is stopping.
    async fn rebuild(
        &self,
        run: Vec<StoredBatch>,
        delivery: &mut impl Rebuilt,
    ) -> Result<bool, SinkError> {
        let Some(first) = run.first() else {
            return Ok(true);
        };
        let StoredBody::Rebuild { epoch_start } = &first.body else {
            return Ok(true);
        };
        let epoch_start = epoch_start.clone();
        let Some(replay) = &self.ctx.replay else {
            return Err(self.mismatch(
                first,
                "it was stored as bounds, but the source can no longer re-read its range (its class changed)",
            ));
        };
        // Rebuilt with the plan it was sealed under, so that its hash can be checked: one
        // encoded before a widening is re-encoded as it is delivered, where safe.
        let plan = self
            .session
            .plan_before_widening(&first.batch.plan)
            .unwrap_or_else(|| self.session.plan());
        for stored in &run {
            if stored.batch.plan != plan.encoder.plan_fingerprint() {
                return Err(self.mismatch(
                    stored,
                    &format!(
                        "it was encoded with plan {} and the table's columns now give plan {}: {}",
                        stored.batch.plan,
                        plan.encoder.plan_fingerprint(),
                        self.session.plan_change(&stored.batch.plan)
                    ),
                ));
            }
        }
        let pending = group(run);
        tracing::info!(
            pipeline = %self.ctx.pipeline,
            sink = %self.ctx.sink,
            partition = self.ctx.partition,
            batches = pending.len(),
            "rebuilding pending batches from the source"
        );
        self.replay(replay, &plan, epoch_start, pending, delivery)
            .await
    }

    async fn replay(
        &self,
        replay: &Arc<dyn Replay>,
        plan: &Arc<ColumnsPlan>,
        from: Option<Vec<u8>>,
        pending: Vec<Pending>,
        delivery: &mut impl Rebuilt,
    ) -> Result<bool, SinkError> {
        let mut reader = replay
            .open(from.as_deref())
            .await
            .map_err(SinkError::from)?;
        let mut cutter = BatchCutter::default();
        let mut pending = pending.into_iter().peekable();
        while pending.peek().is_some() {
            let Some(inputs) = reader.next().await.map_err(SinkError::from)? else {
                break;
            };
            let [batch] = inputs.as_slice() else {
                return Err(SinkError::Refused(
                    "a ClickHouse sink reads exactly one stream".to_owned(),
                ));
            };
            for (current, parts) in self.batch_rows(batch, plan, &mut pending, &mut cutter)? {
                if !self.requeue(current, parts, delivery).await? {
                    return Ok(false);
                }
            }
        }
        match pending.next() {
            None => Ok(true),
            Some(missing) => Err(self.mismatch(
                &missing.entries[0],
                &format!(
                    "the source ended before message {}-{}",
                    self.ctx.partition, missing.last
                ),
            )),
        }
    }

    /// Encodes the rows of `batch` that fall within pending bounds; returns the batches whose
    /// last message it reached, sealed, in order.
    fn batch_rows(
        &self,
        batch: &MessageBatch,
        plan: &Arc<ColumnsPlan>,
        pending: &mut std::iter::Peekable<std::vec::IntoIter<Pending>>,
        cutter: &mut BatchCutter,
    ) -> Result<Vec<(Pending, Vec<Part>)>, SinkError> {
        let mut complete = Vec::new();
        for row in batch.rows() {
            let offset = row.id().offset;
            let Some(current) = pending.peek() else {
                break;
            };
            if offset < current.first {
                continue;
            }
            if offset > current.last {
                return Err(self.mismatch(
                    &current.entries[0],
                    &format!(
                        "the source has no message {}-{} any more (the next one is {})",
                        self.ctx.partition,
                        current.last,
                        row.id()
                    ),
                ));
            }
            cutter.push_row(self.shared, plan, &row)?;
            if offset == current.last {
                if let Some(done) = pending.next() {
                    let mut parts = Vec::new();
                    cutter.seal(
                        self.shared,
                        done.first,
                        done.last,
                        &mut parts,
                        Headroom::NONE,
                    );
                    complete.push((done, parts));
                }
            }
        }
        Ok(complete)
    }

    /// Checks the rebuilt parts of one batch against its stored entries and queues them.
    async fn requeue(
        &self,
        current: Pending,
        mut rebuilt: Vec<Part>,
        delivery: &mut impl Rebuilt,
    ) -> Result<bool, SinkError> {
        for entry in current.entries {
            let index = rebuilt
                .iter()
                .position(|p| self.shared.shard_name(p.shard) == entry.batch.shard);
            let Some(part) = index.map(|i| rebuilt.swap_remove(i)) else {
                return Err(self.mismatch(&entry, "no row of it routes to its shard any more"));
            };
            self.check(&entry, &part)?;
            let batch = SealedBatch {
                format: part.format.as_str().to_owned(),
                payload: part.payload,
                ..entry.batch
            };
            if !delivery.push(entry.seq, batch).await? {
                return Ok(false);
            }
        }
        // Parts of shards whose entries were already acknowledged are not sent again.
        Ok(true)
    }

    fn check(&self, entry: &StoredBatch, part: &Part) -> Result<(), SinkError> {
        let stored = &entry.batch;
        if part.rows != stored.rows {
            return Err(self.mismatch(
                entry,
                &format!(
                    "it had {} rows, the source now gives {}",
                    stored.rows, part.rows
                ),
            ));
        }
        if part.content_hash != stored.content_hash || part.encoded_bytes != stored.encoded_bytes {
            return Err(self.mismatch(
                entry,
                &format!(
                    "its {} rows hashed {:016x} ({} encoded bytes) when committed and hash {:016x} ({} encoded bytes) now: the messages in its range changed",
                    stored.rows,
                    stored.content_hash,
                    stored.encoded_bytes,
                    part.content_hash,
                    part.encoded_bytes
                ),
            ));
        }
        Ok(())
    }

    fn mismatch(&self, entry: &StoredBatch, what: &str) -> SinkError {
        let b = &entry.batch;
        let shard = if b.shard.is_empty() {
            String::new()
        } else {
            format!(", shard `{}`", b.shard)
        };
        SinkError::Refused(format!(
            "{}: pending batch {} (messages {p}-{}..{p}-{}{shard}, token {}) cannot be rebuilt identically: {what}. Nothing was sent for it and it stays in the outbox. Restore the source data (or the table's columns) it was read from and restart; to give up these rows instead, stop the worker and start on a new state directory",
            self.ctx.state_key(),
            entry.seq,
            b.first_offset,
            b.last_offset,
            b.token,
            p = self.ctx.partition,
        ))
    }
}

/// Groups consecutive entries with the same bounds (the shards of one logical batch).
fn group(run: Vec<StoredBatch>) -> Vec<Pending> {
    let mut out: Vec<Pending> = Vec::new();
    for stored in run {
        let (first, last) = (stored.batch.first_offset, stored.batch.last_offset);
        match out.last_mut() {
            Some(p) if p.first == first && p.last == last => p.entries.push(stored),
            _ => out.push(Pending {
                first,
                last,
                entries: vec![stored],
            }),
        }
    }
    out
}
