//! `AtLeastOnceClickHouseSink`: writes each epoch before the epoch commits, with no outbox and
//! no token. With one table the epoch's rows are encoded slice by slice as the partition reads
//! them ([`Sink::write_slice`]) and cut at `write_epoch`; their inserts then run as a pending
//! write ([`flow_core::PendingWrite`]) while the partition reads (and encodes) the next epoch,
//! and the epoch commits only after every part was inserted. Nothing is lost, and a part
//! inserted before a failure may be inserted again when the epoch is replayed (a duplicate).
//! Retryable errors are retried without limit; as in the reference, unknown ones fail the write
//! (and the partition) after `max_insert_attempts` attempts and permanent ones at once. With
//! `on_bad_rows: dead_letter` a part the server refuses for its rows is sent in halves
//! ([`crate::delivery::split`]) and the rows it still refuses are committed as dead letters with
//! the epoch. A stop in the middle of an epoch vetoes its commit, so the next run replays it.
//! Accepts all three host forms; `shard_hosts` routes like the sharded exactly-once sink. It
//! takes no part in the topology guard.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use flow_core::registry::{BuildResult, SinkBuildContext};
use flow_core::{
    Epoch, EpochOutcome, EpochWrite, PendingWrite, Sink, SinkContext, SinkError, SinkFactory,
    SinkMetrics,
};
use flow_state::{CounterAdd, DeadLetter};
use tokio::sync::watch;
use tracing::warn;

use crate::config::guarantee::GiveUp;
use crate::config::guarantee::SinkClass;
use crate::config::params::OnBadRows;
use crate::delivery::cutter::{BatchCutter, EpochCut, Part};
use crate::delivery::insert::{insert_part, GaveUp, InsertFailure, InsertRequest};
use crate::delivery::sink_state::{build_shared, SinkShared};
use crate::delivery::split::{Isolated, RefusedPart};
use crate::server::classify::{is_row_rejection, ClassifiedError};
use crate::server::session::WriterSession;
use crate::tables::direct::{EpochTables, ManyTables, PartitionTables, RemoveRequeued, TableParts};

pub fn build(
    ctx: &SinkBuildContext<'_>,
    parameters: &serde_yaml::Value,
    dynamic: &serde_yaml::Value,
) -> BuildResult<Arc<dyn SinkFactory>> {
    let shared = build_shared(SinkClass::AtLeastOnce, ctx, parameters, dynamic)?;
    Ok(Arc::new(AtLeastOnceFactory {
        tables: ManyTables::of(&shared, ctx)?,
        shared,
    }))
}

struct AtLeastOnceFactory {
    /// The sink's state; with many tables, its parameters hold the template (each table has
    /// its own in `tables`).
    shared: Arc<SinkShared>,
    tables: Option<ManyTables>,
}

impl SinkFactory for AtLeastOnceFactory {
    fn create(&self, ctx: SinkContext) -> Result<Box<dyn Sink>, SinkError> {
        let tables = ManyTables::for_partition(self.tables.as_ref(), &self.shared, &ctx)?;
        Ok(Box::new(AtLeastOnceSink {
            shared: Arc::clone(&self.shared),
            ctx,
            cutter: BatchCutter::default(),
            tables,
        }))
    }

    fn reconfigure(&self, dynamic: &serde_yaml::Value) -> Result<(), SinkError> {
        match &self.tables {
            Some(many) => many.targets.reconfigure(dynamic),
            None => self.shared.reconfigure(dynamic),
        }
    }
}

struct AtLeastOnceSink {
    shared: Arc<SinkShared>,
    ctx: SinkContext,
    cutter: BatchCutter,
    /// With a table template: this partition's tables.
    tables: Option<PartitionTables>,
}

impl AtLeastOnceSink {
    /// The epoch's parts by table, and the rows set aside; or what the epoch is answered
    /// without inserting (a wait, or a stop before the session started).
    async fn cut(
        &mut self,
        epoch: &Epoch<'_>,
    ) -> Result<Result<(Vec<TableParts>, Vec<DeadLetter>), EpochOutcome>, SinkError> {
        if let Some(tables) = &mut self.tables {
            return Ok(match tables.cut(epoch).await? {
                EpochTables::Cut {
                    tables,
                    dead_letters,
                } => Ok((tables, dead_letters)),
                EpochTables::Outcome(outcome) => Err(outcome),
            });
        }
        let Some(session) = self.shared.session(&self.ctx.shutdown).await? else {
            return Ok(Err(SinkShared::not_started()));
        };
        if self.cutter.incomplete(epoch.number) {
            return Ok(Err(SinkShared::not_started()));
        }
        let EpochCut {
            parts,
            dead_letters,
            ..
        } = self.cutter.cut_epoch(&self.shared, &session, epoch).await?;
        let table = TableParts {
            shared: Arc::clone(&self.shared),
            session,
            parts,
        };
        Ok(Ok((vec![table], dead_letters)))
    }
}

/// Inserts each table's parts in turn; the epoch commits once every one is in, with the rows
/// set aside (`dead_letters`, then those each table's inserts set aside) and what was delivered.
async fn insert_tables(
    tables: Vec<EpochInserts>,
    mut dead_letters: Vec<DeadLetter>,
) -> Result<EpochOutcome, SinkError> {
    let mut counters = Vec::new();
    for inserts in tables {
        match inserts.run().await? {
            EpochOutcome::Commit(write) => {
                dead_letters.extend(write.dead_letters);
                counters.extend(write.counters);
            }
            other => return Ok(other),
        }
    }
    Ok(EpochOutcome::Commit(EpochWrite {
        dead_letters,
        counters,
        ..EpochWrite::default()
    }))
}

/// One epoch's parts on their way into ClickHouse. It owns the encoded parts, so the sink
/// answers [`EpochOutcome::Pending`] once they are cut and the runtime reads the next epoch while
/// they are inserted: the epoch still commits only after every part is in.
struct EpochInserts {
    shared: Arc<SinkShared>,
    session: Arc<WriterSession>,
    metrics: SinkMetrics,
    partition: u32,
    stop: watch::Receiver<bool>,
    parts: Vec<Part>,
    dead_letters: Vec<DeadLetter>,
}

impl EpochInserts {
    async fn run(mut self) -> Result<EpochOutcome, SinkError> {
        let parts = std::mem::take(&mut self.parts);
        let mut delivered = Vec::with_capacity(parts.len() * 2);
        for part in &parts {
            let request = InsertRequest::unrecorded(part, &self.metrics);
            let result = insert_part(&self.shared, &self.session, request, &mut self.stop).await;
            let retry_after = self.shared.dynamic().retry_backoff;
            match result {
                Ok(_) => delivered.extend(self.delivered(part, part.rows)),
                Err(InsertFailure::Stopped) => return Ok(stopping(retry_after)),
                Err(InsertFailure::GaveUp(gave_up)) if self.splits(&gave_up.error) => {
                    match self.isolate(part, &gave_up.error).await? {
                        Isolated::Done(dead) => {
                            let landed = part.rows.saturating_sub(dead.len() as u64);
                            delivered.extend(self.delivered(part, landed));
                            self.dead_letters.extend(dead);
                        }
                        Isolated::Stopped => return Ok(stopping(retry_after)),
                        Isolated::GaveUp(reason) => return Err(reason.to_sink_error()),
                    }
                }
                Err(InsertFailure::GaveUp(gave_up)) => {
                    return self.given_up(self.shared.shard_name(part.shard), &gave_up, retry_after)
                }
                Err(other) => return Err(other.into_sink_error()),
            }
        }
        // Rows inserted by an epoch that is then not committed are inserted again by its replay,
        // and counted again: the counter follows what the table holds.
        Ok(EpochOutcome::Commit(EpochWrite {
            dead_letters: self.dead_letters,
            counters: delivered,
            ..EpochWrite::default()
        }))
    }

    /// Sends a part the server refused for its rows in pieces (`on_bad_rows: dead_letter`).
    async fn isolate(&self, part: &Part, refused: &ClassifiedError) -> Result<Isolated, SinkError> {
        let refused = RefusedPart {
            shard: self.shared.shard_name(part.shard),
            shard_index: Some(part.shard),
            token: None,
            format: part.format.as_str(),
            payload: &part.payload,
            plan: &part.plan,
            first_offset: part.first_offset,
            last_offset: part.last_offset,
            rows: part.rows,
            sealed_at_ms: None,
            refused,
        };
        let (shared, session, metrics) = (&self.shared, &self.session, &self.metrics);
        refused
            .isolate(shared, session, self.partition, metrics, &self.stop)
            .await
    }

    /// What a given-up insert means for the epoch, as the guarantee says: an unknown or
    /// permanent error fails the partition; any other vetoes the commit so the epoch is replayed.
    fn given_up(
        &self,
        shard: &str,
        gave_up: &GaveUp,
        retry_after: Duration,
    ) -> Result<EpochOutcome, SinkError> {
        let session = &self.session;
        if gave_up.give_up == GiveUp::FailPartition {
            return Err(gave_up.reason(session, shard, None).to_sink_error());
        }
        let GaveUp {
            error, attempts, ..
        } = gave_up;
        warn!(
            database = %session.database,
            table = %session.table,
            shard = %shard,
            partition = self.partition,
            attempts,
            error = %error,
            "insert failed {attempts} time(s); the epoch is not committed and will be replayed, so rows already inserted in it may be duplicated"
        );
        Ok(EpochOutcome::Veto {
            reason: format!("insert into shard `{shard}` failed: {error}"),
            retry_after,
        })
    }

    /// `rows` of a delivered part, and the part as a batch, as additions to the persisted
    /// counters.
    fn delivered(&self, part: &Part, rows: u64) -> [CounterAdd; 2] {
        let shard = Some(self.shared.shard_name(part.shard));
        self.metrics.delivered(shard, rows)
    }

    /// Whether a refused part is sent in pieces (`on_bad_rows: dead_letter`) rather than failing
    /// the partition.
    fn splits(&self, error: &ClassifiedError) -> bool {
        self.shared.params.on_bad_rows == OnBadRows::DeadLetter && is_row_rejection(error)
    }
}

/// The metrics handle of a table's inserts: labelled with the table when the sink writes many.
fn table_metrics(metrics: &SinkMetrics, shared: &SinkShared, many: bool) -> SinkMetrics {
    match many {
        true => metrics.for_table(&shared.params.table),
        false => metrics.clone(),
    }
}

fn stopping(retry_after: Duration) -> EpochOutcome {
    EpochOutcome::Veto {
        reason: "the pipeline is stopping before the epoch was written".to_owned(),
        retry_after,
    }
}

#[async_trait]
impl Sink for AtLeastOnceSink {
    /// With a table template, sends the rows requeued for a table that was missing.
    async fn open(&mut self) -> Result<(), SinkError> {
        if let Some(tables) = &self.tables {
            let remove = RemoveRequeued::AfterInsert;
            tables.send_requeued(&self.ctx, remove).await?;
        }
        Ok(())
    }

    async fn write_epoch(&mut self, epoch: &Epoch<'_>) -> Result<EpochOutcome, SinkError> {
        let (tables, dead_letters) = match self.cut(epoch).await? {
            Ok(cut) => cut,
            Err(outcome) => return Ok(outcome),
        };
        let many = self.tables.is_some();
        let inserts = tables
            .into_iter()
            .map(|table| EpochInserts {
                metrics: table_metrics(&self.ctx.metrics, &table.shared, many),
                shared: table.shared,
                session: table.session,
                partition: self.ctx.partition,
                stop: self.ctx.shutdown.clone(),
                parts: table.parts,
                dead_letters: Vec::new(),
            })
            .collect();
        let pending = insert_tables(inserts, dead_letters);
        Ok(EpochOutcome::Pending(PendingWrite::new(pending)))
    }

    /// One table takes slices, encoded while the partition reads the rest of the epoch (and,
    /// read ahead, while the epoch before is still being inserted); a table template takes
    /// whole epochs ([`PartitionTables::cut`] resolves and cuts a whole epoch's rows at once).
    fn takes_slices(&self) -> bool {
        self.tables.is_none()
    }

    async fn write_slice(&mut self, slice: &Epoch<'_>) -> Result<(), SinkError> {
        self.cutter
            .cut_slice(&self.shared, &self.ctx.shutdown, slice)
            .await
    }

    fn reconfigure(&mut self, dynamic: &serde_yaml::Value) -> Result<(), SinkError> {
        match &self.tables {
            Some(tables) => tables.reconfigure(dynamic),
            None => self.shared.reconfigure(dynamic),
        }
    }
}
