//! The classes without an outbox (`AtLeastOnceClickHouseSink`, `AtMostOnceClickHouseSink`) with
//! a table template or a `tables:` map ([`ManyTables`]): each epoch's rows are resolved to their
//! tables ([`Resolver`]) and each table's rows cut and encoded as that table's sink would, into
//! parts for its own session ([`TableParts`]), in message order within the table. The class
//! inserts them as it does one table's.
//!
//! Rows whose table does not exist are dead letters committed with the epoch (or the epoch waits
//! under `missing_table: wait`), as for the exactly-once classes; `dead-letters requeue` puts them
//! into the sink partition's outbox, which these classes otherwise leave empty, and the partition
//! sends them when it opens ([`PartitionTables::send_requeued`]): after the INSERT is
//! acknowledged for at-least-once, removed before it for at-most-once.

use std::sync::Arc;

use flow_core::delivery::{blocking, load_backlog};
use flow_core::registry::SinkBuildContext;
use flow_core::{Epoch, EpochOutcome, SinkContext, SinkError, Violation};
use flow_state::{AckExtras, DeadLetter, SealedBatch, StoredBatch, StoredBody};
use tokio::sync::watch;
use tracing::warn;

use crate::delivery::cutter::{batch_limits, BatchCutter, EpochCut, Part};
use crate::delivery::insert::{insert_part, InsertRequest};
use crate::delivery::sink_state::SinkShared;
use crate::exactly_once::state::ExactlyOnce;
use crate::server::session::WriterSession;
use crate::tables::requeued::{encode_requeued_part, encode_requeued_rows, UNENCODED_FORMAT};
use crate::tables::resolver::{Resolver, TableTurn};
use crate::tables::subjects::{partition_templates, PartitionTemplates};
use crate::tables::targets::{TableState, Targets};

/// The tables of one sink: every table its rows named, and each partition's template.
pub struct ManyTables {
    pub targets: Arc<Targets>,
    templates: PartitionTemplates,
}

impl ManyTables {
    /// The tables of `base`'s sink, if its `table` is a template or it has a `tables` map.
    pub fn of(
        base: &Arc<SinkShared>,
        ctx: &SinkBuildContext<'_>,
    ) -> Result<Option<ManyTables>, Vec<Violation>> {
        if base.params.table_template.is_none() && base.params.tables.is_empty() {
            return Ok(None);
        }
        let templates = partition_templates(&base.params, ctx.subjects, &base.stream)?;
        Ok(Some(ManyTables {
            targets: Arc::new(Targets::new(Arc::clone(base))),
            templates,
        }))
    }

    /// The tables of sink partition `ctx` when the sink writes many (`tables`), registered for
    /// `/ready`; else `None`, with the single table's session started early.
    pub fn for_partition(
        tables: Option<&ManyTables>,
        shared: &Arc<SinkShared>,
        ctx: &SinkContext,
    ) -> Result<Option<PartitionTables>, SinkError> {
        match tables {
            Some(many) => {
                many.targets.register_readiness(&ctx.metrics);
                many.partition(ctx).map(Some)
            }
            None => {
                shared.start_session_early(&ctx.shutdown, &ctx.metrics);
                Ok(None)
            }
        }
    }

    /// The per-partition part of sink partition `ctx`.
    pub fn partition(&self, ctx: &SinkContext) -> Result<PartitionTables, SinkError> {
        let template = self.templates.for_sink(ctx)?;
        Ok(PartitionTables {
            resolver: Resolver::new(Arc::clone(&self.targets), template),
            cutter: BatchCutter::default(),
            token_prefix: ExactlyOnce::token_prefix(&self.targets.base, ctx)?,
            stop: ctx.shutdown.clone(),
        })
    }
}

/// One table's parts of an epoch.
pub struct TableParts {
    pub shared: Arc<SinkShared>,
    pub session: Arc<WriterSession>,
    pub parts: Vec<Part>,
}

/// What an epoch's rows became.
pub enum EpochTables {
    /// Each table's parts, in table name order, and the rows set aside (in message order).
    Cut {
        tables: Vec<TableParts>,
        dead_letters: Vec<DeadLetter>,
    },
    /// The epoch is not committed: a table is waited for, or the pipeline is stopping.
    Outcome(EpochOutcome),
}

/// When a requeued row leaves the outbox, as the class's guarantee says.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RemoveRequeued {
    /// After its INSERT was acknowledged: a crash before sends it again (at least once).
    AfterInsert,
    /// Before its INSERT starts: a crash or a failed INSERT loses it (at most once).
    BeforeInsert,
}

/// What [`PartitionTables::send_requeued`] did with the requeued rows.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct RequeuedSent {
    pub delivered: u64,
    /// Removed before an INSERT that then failed ([`RemoveRequeued::BeforeInsert`]).
    pub lost: u64,
}

/// Consecutive requeued rows of one table, sent together ([`PartitionTables::send_requeued`]).
#[derive(Default)]
struct RequeuedGroup {
    /// Their outbox entries (sequence numbers and batches), in outbox order.
    seqs: Vec<u64>,
    batches: Vec<SealedBatch>,
    /// Their stored bytes (a measure against the sink's `max_bytes_per_batch`).
    bytes: usize,
}

impl RequeuedGroup {
    /// Whether `batch` may join: same table, and the group stays within the sink's batch limits.
    fn takes(&self, batch: &SealedBatch, (max_rows, max_bytes): (usize, usize)) -> bool {
        self.batches.first().is_none_or(|first| {
            first.target == batch.target
                && self.batches.len() < max_rows
                && self.bytes + batch.payload.len() <= max_bytes
        })
    }

    fn push(&mut self, seq: u64, batch: SealedBatch) {
        self.bytes += batch.payload.len();
        self.seqs.push(seq);
        self.batches.push(batch);
    }
}

/// Requeued rows encoded for their table, on their way into it.
struct RequeuedParts<'a> {
    /// Their outbox entries, in outbox order.
    seqs: Vec<u64>,
    /// The first entry: its token and table name the rows in the log.
    first: &'a SealedBatch,
    parts: Vec<Part>,
    shared: &'a SinkShared,
    session: &'a WriterSession,
}

/// The tables of one sink partition.
pub struct PartitionTables {
    resolver: Resolver,
    /// Cuts one table's rows at a time (its buffers are reused across tables and epochs).
    cutter: BatchCutter,
    /// The namespace of the tokens a requeued row's dead letter keeps.
    token_prefix: String,
    stop: watch::Receiver<bool>,
}

impl PartitionTables {
    /// New dynamic parameters for the sink and every table.
    pub fn reconfigure(&self, dynamic: &serde_yaml::Value) -> Result<(), SinkError> {
        self.resolver.targets.reconfigure(dynamic)
    }

    /// Resolves the epoch's rows to their tables and cuts each table's rows into parts.
    pub async fn cut(&mut self, epoch: &Epoch<'_>) -> Result<EpochTables, SinkError> {
        let mut resolved = self.resolver.resolve(epoch)?;
        let mut tables = Vec::with_capacity(resolved.tables.len());
        for t in 0..resolved.tables.len() {
            let stop = &self.stop;
            let prefix = &self.token_prefix;
            let (target, session) = match self
                .resolver
                .table(epoch, &mut resolved, t, stop, prefix)
                .await?
            {
                TableTurn::Up(target, session) => (target, session),
                TableTurn::Skip => continue,
                TableTurn::Outcome(outcome) => return Ok(EpochTables::Outcome(outcome)),
            };
            let cutter = &mut self.cutter;
            let EpochCut { parts, .. } = resolved
                .cut_table(cutter, (&target, &session), epoch, t)
                .await?;
            tables.push(TableParts {
                shared: Arc::clone(&target.shared),
                session,
                parts,
            });
        }
        let mut dead_letters = resolved.dead_letters;
        dead_letters.sort_by_key(|d| d.offset);
        Ok(EpochTables::Cut {
            tables,
            dead_letters,
        })
    }

    /// Sends the rows `dead-letters requeue` put into this partition's outbox, in outbox order
    /// (the sink calls it when it opens, so `run` and `drain` both send them): consecutive rows
    /// of one table go together, within the sink's batch limits. A row whose table still does not
    /// exist stays, with the rows after it, for a later run (logged).
    pub async fn send_requeued(
        &self,
        ctx: &SinkContext,
        remove: RemoveRequeued,
    ) -> Result<RequeuedSent, SinkError> {
        let mut sent = RequeuedSent::default();
        let mut group = RequeuedGroup::default();
        for stored in load_backlog(&ctx.store, &ctx.state_key()).await? {
            let seq = stored.seq;
            let Some(batch) = self.requeued_row(ctx, stored).await? else {
                break;
            };
            let limits = batch_limits(&self.resolver.targets.of_stored(&batch.target)?.shared);
            if !group.takes(&batch, limits) {
                let full = std::mem::take(&mut group);
                if !self.send_group(ctx, full, remove, &mut sent).await? {
                    return Ok(sent);
                }
            }
            group.push(seq, batch);
        }
        self.send_group(ctx, group, remove, &mut sent).await?;
        Ok(sent)
    }

    /// Sends a group of requeued rows as one batch (one INSERT per shard), or row by row when
    /// one of them cannot be encoded (the failing row then names itself). `false` when their
    /// table is still missing or the pipeline is stopping: the rows stay in the outbox.
    async fn send_group(
        &self,
        ctx: &SinkContext,
        group: RequeuedGroup,
        remove: RemoveRequeued,
        sent: &mut RequeuedSent,
    ) -> Result<bool, SinkError> {
        let Some(first) = group.batches.first() else {
            return Ok(true);
        };
        let target = self.resolver.targets.of_stored(&first.target)?;
        let session = match target.state(&self.stop).await? {
            TableState::Up(session) => session,
            TableState::Stopping => return Ok(false),
            TableState::Missing(reason) => {
                warn!(sink = %ctx.state_key(), table = %first.target, reason = %reason, "requeued rows for a table that still does not exist stay in the outbox; create the table and start the pipeline again");
                return Ok(false);
            }
        };
        let shared = &target.shared;
        let together = (group.batches.len() > 1)
            .then(|| encode_requeued_rows(shared, &session, &group.batches))
            .flatten();
        if let Some(parts) = together {
            let requeued = RequeuedParts {
                seqs: group.seqs.clone(),
                first,
                parts,
                shared,
                session: &session,
            };
            self.send_parts(ctx, requeued, remove, sent).await?;
            return Ok(true);
        }
        // One at a time, each encoded as it is sent: the rows before one that fails go first.
        for (seq, batch) in group.seqs.iter().zip(&group.batches) {
            let requeued = RequeuedParts {
                seqs: vec![*seq],
                first: batch,
                parts: vec![encode_requeued_part(shared, &session, batch)?.0],
                shared,
                session: &session,
            };
            self.send_parts(ctx, requeued, remove, sent).await?;
        }
        Ok(true)
    }

    /// Inserts requeued rows, removing their entries from the outbox before or after as `remove`
    /// says (in one commit group: the acknowledgements are submitted together).
    async fn send_parts(
        &self,
        ctx: &SinkContext,
        requeued: RequeuedParts<'_>,
        remove: RemoveRequeued,
        sent: &mut RequeuedSent,
    ) -> Result<(), SinkError> {
        let RequeuedParts {
            seqs,
            first,
            parts,
            shared,
            session,
        } = requeued;
        let key = ctx.state_key();
        let metrics = ctx.metrics.for_table(&shared.params.table);
        if remove == RemoveRequeued::BeforeInsert {
            acknowledge_all(ctx, &seqs, Vec::new()).await?;
        }
        let mut counters = Vec::with_capacity(parts.len() * 2);
        for part in &parts {
            let request = InsertRequest::unrecorded(part, &metrics);
            let mut stop = self.stop.clone();
            match (
                insert_part(shared, session, request, &mut stop).await,
                remove,
            ) {
                (Ok(_), _) => {
                    let shard = Some(shared.shard_name(part.shard));
                    counters.extend(metrics.delivered(shard, part.rows));
                    sent.delivered += part.rows;
                }
                (Err(failure), RemoveRequeued::AfterInsert) => {
                    return Err(failure.into_sink_error())
                }
                (Err(failure), RemoveRequeued::BeforeInsert) => {
                    let error = failure.into_sink_error();
                    warn!(sink = %key, table = %first.target, token = %first.token, rows = part.rows, error = %error, "requeued at-most-once rows were lost: their insert failed after they left the outbox");
                    sent.lost += part.rows;
                }
            }
        }
        if remove == RemoveRequeued::AfterInsert {
            acknowledge_all(ctx, &seqs, counters.clone()).await?;
            metrics.applied(&counters);
        }
        Ok(())
    }

    /// The requeued row of an outbox entry with its payload; `None` (logged) for an entry these
    /// classes cannot send, which stays with the entries after it.
    async fn requeued_row(
        &self,
        ctx: &SinkContext,
        stored: StoredBatch,
    ) -> Result<Option<SealedBatch>, SinkError> {
        let key = ctx.state_key();
        let payload = match (&stored.body, stored.batch.format == UNENCODED_FORMAT) {
            (StoredBody::Payload(payload), true) => payload.clone(),
            _ => {
                warn!(sink = %key, token = %stored.batch.token, format = %stored.batch.format, "an outbox entry that is not a requeued row for a table stays in the outbox: this class sends only those; drain it with the spec of the sink that sealed it");
                return Ok(None);
            }
        };
        let store = ctx.store.clone();
        let task_key = key.clone();
        let bytes = blocking(move || store.load_payload(&task_key, &payload)).await?;
        let mut batch = stored.batch;
        batch.payload = bytes;
        Ok(Some(batch))
    }
}

/// Removes the outbox entries `seqs` (oldest first), the last one with `counters`: submitted
/// together, so that the store makes them durable in one commit group.
async fn acknowledge_all(
    ctx: &SinkContext,
    seqs: &[u64],
    counters: Vec<flow_state::CounterAdd>,
) -> Result<(), SinkError> {
    let key = ctx.state_key();
    let Some((last, rest)) = seqs.split_last() else {
        return Ok(());
    };
    let extras = AckExtras {
        counters,
        ..AckExtras::default()
    };
    let earlier = rest
        .iter()
        .map(|&seq| ctx.store.acknowledge(&key, seq, Vec::new()));
    let (earlier, last) = futures_util::future::join(
        futures_util::future::try_join_all(earlier),
        ctx.store.acknowledge_with(&key, *last, extras),
    )
    .await;
    earlier?;
    last?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn requeued(target: &str, payload: &'static [u8]) -> SealedBatch {
        SealedBatch {
            target: target.to_owned(),
            columns: Vec::new(),
            format: UNENCODED_FORMAT.to_owned(),
            token: format!("p.s/{target}/requeued/0-1"),
            shard: String::new(),
            first_offset: 1,
            last_offset: 1,
            rows: 1,
            encoded_bytes: payload.len() as u64,
            plan: String::new(),
            sealed_at_ms: 0,
            content_hash: 0,
            payload: bytes::Bytes::from_static(payload),
        }
    }

    #[test]
    fn a_requeued_group_takes_rows_of_its_table_up_to_the_batch_row_and_byte_limits() {
        let mut group = RequeuedGroup::default();
        let row = requeued("default.t_1", b"0123456789");
        assert!(group.takes(&row, (2, 25)), "an empty group takes any row");
        group.push(1, row.clone());
        assert!(
            !group.takes(&requeued("default.t_2", b"0123456789"), (2, 25)),
            "another table's row starts a group of its own"
        );
        assert!(group.takes(&row, (2, 25)));
        assert!(!group.takes(&row, (2, 19)), "20 bytes would pass 19");
        group.push(2, row.clone());
        assert!(!group.takes(&row, (2, 1_000)), "2 rows reach max_rows 2");
        assert_eq!((group.seqs, group.bytes), (vec![1, 2], 20));
    }
}
