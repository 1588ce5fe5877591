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
use flow_core::{Epoch, EpochOutcome, SinkContext, SinkCount, SinkError, Violation};
use flow_state::{AckExtras, DeadLetter, SealedBatch, StoredBatch, StoredBody};
use tokio::sync::watch;
use tracing::warn;

use crate::delivery::cutter::{BatchCutter, EpochCut, Part};
use crate::delivery::insert::{insert_part, InsertRequest};
use crate::delivery::sink_state::SinkShared;
use crate::exactly_once::state::ExactlyOnce;
use crate::server::session::WriterSession;
use crate::tables::requeued::{encode_requeued_part, UNENCODED_FORMAT};
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

/// One requeued row on its way into its table.
struct RequeuedRow<'a> {
    /// Its entry in the outbox.
    seq: u64,
    batch: &'a SealedBatch,
    /// Encoded for the table as it is now.
    part: &'a Part,
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
    /// (the sink calls it when it opens, so `run` and `drain` both send them). A row whose table still does not exist stays,
    /// with the rows after it, for a later run (logged).
    pub async fn send_requeued(
        &self,
        ctx: &SinkContext,
        remove: RemoveRequeued,
    ) -> Result<RequeuedSent, SinkError> {
        let mut sent = RequeuedSent::default();
        let key = ctx.state_key();
        for stored in load_backlog(&ctx.store, &key).await? {
            let seq = stored.seq;
            let Some(batch) = self.requeued_row(ctx, stored).await? else {
                return Ok(sent);
            };
            let target = self.resolver.targets.of_stored(&batch.target)?;
            let session = match target.state(&self.stop).await? {
                TableState::Up(session) => session,
                TableState::Stopping => return Ok(sent),
                TableState::Missing(reason) => {
                    warn!(sink = %key, table = %batch.target, reason = %reason, "requeued rows for a table that still does not exist stay in the outbox; create the table and start the pipeline again");
                    return Ok(sent);
                }
            };
            let (part, _) = encode_requeued_part(&target.shared, &session, &batch)?;
            let row = RequeuedRow {
                seq,
                batch: &batch,
                part: &part,
                shared: &target.shared,
                session: &session,
            };
            self.send_one(ctx, row, remove, &mut sent).await?;
        }
        Ok(sent)
    }

    /// Inserts one requeued row, removing it from the outbox before or after as `remove` says.
    async fn send_one(
        &self,
        ctx: &SinkContext,
        row: RequeuedRow<'_>,
        remove: RemoveRequeued,
        sent: &mut RequeuedSent,
    ) -> Result<(), SinkError> {
        let key = ctx.state_key();
        let RequeuedRow {
            seq,
            batch,
            part,
            shared,
            session,
        } = row;
        if remove == RemoveRequeued::BeforeInsert {
            ctx.store.acknowledge(&key, seq, Vec::new()).await?;
        }
        let metrics = ctx.metrics.for_table(&shared.params.table);
        let request = InsertRequest::unrecorded(part, &metrics);
        let mut stop = self.stop.clone();
        let inserted = insert_part(shared, session, request, &mut stop).await;
        match (inserted, remove) {
            (Ok(_), RemoveRequeued::AfterInsert) => {
                let shard = Some(shared.shard_name(part.shard));
                let counters = vec![
                    metrics.add(SinkCount::RowsDelivered, shard, part.rows),
                    metrics.add(SinkCount::BatchesDelivered, shard, 1),
                ];
                let extras = AckExtras {
                    counters: counters.clone(),
                    ..AckExtras::default()
                };
                ctx.store.acknowledge_with(&key, seq, extras).await?;
                metrics.applied(&counters);
                sent.delivered += part.rows;
            }
            (Ok(_), RemoveRequeued::BeforeInsert) => sent.delivered += part.rows,
            (Err(failure), RemoveRequeued::AfterInsert) => return Err(failure.into_sink_error()),
            (Err(failure), RemoveRequeued::BeforeInsert) => {
                let error = failure.into_sink_error();
                warn!(sink = %key, table = %batch.target, token = %batch.token, error = %error, "a requeued at-most-once row was lost: its insert failed after it left the outbox");
                sent.lost += part.rows;
            }
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
