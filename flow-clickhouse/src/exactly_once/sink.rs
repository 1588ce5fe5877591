//! `ClickHouseBatchingSink` and `ShardedClickHouseBatchingSink`: exactly-once through the outbox.
//!
//! Per epoch, rows are cut into deterministic batches (`max_rows_per_batch`,
//! `max_bytes_per_batch`), routed to shards by rendezvous hashing and encoded once
//! ([`BatchCutter`]). Each (batch, shard) part is sealed into the outbox as one entry, in
//! shard-name order, in the same commit as the source position; a logical batch has left the
//! outbox when its last shard entry is acknowledged. Delivery is asynchronous and ordered per
//! partition and shard (the shards of a partition are written side by side); every replay sends the stored bytes with the same token
//! `<namespace><max message id>[:<shard>]`. With a replayable source the outbox keeps only each
//! batch's bounds and hash; after a restart the batches are rebuilt from the source and checked
//! ([`crate::exactly_once::rebuild`]) before they are sent. Each partition's batches are sent by a
//! [`ClickHouseDeliverer`].

use std::sync::Arc;

use async_trait::async_trait;
use flow_core::delivery::{
    blocking, load_backlog, now_ms, BatchDeliverer, OutboxDelivery, OutboxSink, Sealer,
    SinkDelivery,
};
use flow_core::registry::{BuildResult, SinkBuildContext};
use flow_core::{Epoch, EpochOutcome, EpochWrite, Sink, SinkContext, SinkError, SinkFactory};
use flow_state::SealedBatch;

use crate::config::guarantee::SinkClass;
use crate::delivery::cutter::{BatchCutter, EpochCut, Part};
use crate::delivery::sink_state::{build_shared, SinkShared};
use crate::exactly_once::deliverer::{ClickHouseDeliverer, PartitionMarks};
use crate::exactly_once::fingerprint::{check_topology, TopologyDecision};
use crate::exactly_once::rebuild::Requeue;
use crate::exactly_once::state::ExactlyOnce;
use crate::server::session::ColumnsPlan;

/// Builds either batching class from its spec parameters.
pub fn build(
    class: SinkClass,
    ctx: &SinkBuildContext<'_>,
    parameters: &serde_yaml::Value,
    dynamic: &serde_yaml::Value,
) -> BuildResult<Arc<dyn SinkFactory>> {
    let shared = build_shared(class, ctx, parameters, dynamic)?;
    let delivery = SinkDelivery::new(ctx.sink, shared.in_flight_budget());
    Ok(Arc::new(BatchingSinkFactory {
        exactly_once: Arc::new(ExactlyOnce::new(&shared)),
        shared,
        delivery,
    }))
}

/// The outbox entries of an epoch's `parts` for the table of `shared`, under the tokens
/// `<token_prefix><partition>-<last id>[:<shard>]` ([`ExactlyOnce::token`]).
pub fn sealed_batches(
    shared: &SinkShared,
    plan: &ColumnsPlan,
    parts: Vec<Part>,
    token_prefix: &str,
    partition: u32,
) -> Vec<SealedBatch> {
    let target = format!("{}.{}", shared.params.database, shared.params.table);
    let columns = plan.encoder.column_names();
    let plan = plan.encoder.plan_fingerprint();
    let sealed_at_ms = now_ms();
    parts
        .into_iter()
        .map(|part| {
            let name = shared.shard_name(part.shard);
            let shard = shared.sharded.then_some(name);
            SealedBatch {
                target: target.clone(),
                columns: columns.clone(),
                format: part.format.as_str().to_owned(),
                token: ExactlyOnce::token(token_prefix, partition, part.last_offset, shard),
                shard: name.to_owned(),
                first_offset: part.first_offset,
                last_offset: part.last_offset,
                rows: part.rows,
                encoded_bytes: part.encoded_bytes,
                plan: plan.to_owned(),
                sealed_at_ms,
                content_hash: part.content_hash,
                payload: part.payload,
            }
        })
        .collect()
}

struct BatchingSinkFactory {
    shared: Arc<SinkShared>,
    delivery: Arc<SinkDelivery>,
    exactly_once: Arc<ExactlyOnce>,
}

impl SinkFactory for BatchingSinkFactory {
    fn create(&self, ctx: SinkContext) -> Result<Box<dyn Sink>, SinkError> {
        let token_prefix = ExactlyOnce::token_prefix(&self.shared, &ctx)?;
        self.shared.note_cluster(&ctx);
        self.shared.start_session_early(&ctx.shutdown, &ctx.metrics);
        Ok(Box::new(OutboxSink::new(BatchingSink {
            shared: Arc::clone(&self.shared),
            delivery: Arc::clone(&self.delivery),
            exactly_once: Arc::clone(&self.exactly_once),
            token_prefix,
            ctx,
            fingerprints_checked: false,
            cutter: BatchCutter::default(),
            deliverer: None,
        })))
    }

    fn reconfigure(&self, dynamic: &serde_yaml::Value) -> Result<(), SinkError> {
        self.shared.reconfigure(dynamic)?;
        self.delivery.budget.resize(self.shared.in_flight_budget());
        Ok(())
    }
}

struct BatchingSink {
    shared: Arc<SinkShared>,
    delivery: Arc<SinkDelivery>,
    exactly_once: Arc<ExactlyOnce>,
    /// The prefix of the tokens of newly sealed batches (pending ones keep their stored token).
    token_prefix: String,
    ctx: SinkContext,
    /// Whether the persisted fingerprints were compared with (or replaced by) the current ones.
    fingerprints_checked: bool,
    cutter: BatchCutter,
    /// The partition's deliverer once opened: told when the delivery drained.
    deliverer: Option<Arc<ClickHouseDeliverer>>,
}

impl BatchingSink {
    /// The topology guard: with undelivered batches, a changed routing or target refuses the
    /// start; a drained partition adopts the current fingerprints.
    async fn check_fingerprints(
        &mut self,
        undelivered: u64,
        oldest: Option<String>,
    ) -> Result<bool, SinkError> {
        let Some(session) = self.shared.session(&self.ctx.shutdown).await? else {
            return Ok(false);
        };
        let store = self.ctx.store.clone();
        let key = self.ctx.state_key();
        let persisted = blocking(move || store.fingerprints(&key)).await?;
        let mut current = self.exactly_once.current_fingerprints(&session);
        session.late_targets.fill(&mut current, &persisted);
        let decision = check_topology(&persisted, &current, undelivered, oldest.as_deref())
            .map_err(|err| SinkError::Plugin(Box::new(err)))?;
        if decision == TopologyDecision::Adopt && persisted != current {
            self.ctx
                .store
                .set_fingerprints(&self.ctx.state_key(), current)
                .await?;
        }
        self.fingerprints_checked = true;
        Ok(true)
    }
}

#[async_trait]
impl Sealer for BatchingSink {
    async fn open(&mut self, delivery: &mut OutboxDelivery) -> Result<(), SinkError> {
        self.ctx.metrics.clear_gave_up().await?;
        let key = self.ctx.state_key();
        let backlog = load_backlog(&self.ctx.store, &key).await?;
        if let Some(oldest) = backlog.first() {
            let bound = format!("{}-{}", self.ctx.partition, oldest.batch.last_offset);
            if !self
                .check_fingerprints(backlog.len() as u64, Some(bound))
                .await?
            {
                // Stopping before the target could be checked: deliver nothing; the backlog
                // stays in the outbox for the next run.
                return Ok(());
            }
        }
        let marks = {
            let (store, key) = (self.ctx.store.clone(), key.clone());
            blocking(move || PartitionMarks::load(&store, &key, None)).await?
        };
        let deliverer = Arc::new(ClickHouseDeliverer::new(
            Arc::clone(&self.shared),
            Arc::clone(&self.exactly_once),
            self.ctx.clone(),
            marks,
            self.ctx.metrics.clone(),
        ));
        if !backlog.is_empty() {
            if let Some(session) = self.shared.session(&self.ctx.shutdown).await? {
                // The run before may have stored any pending entry without acknowledging it,
                // under the columns it last sent with.
                let seqs = backlog.iter().map(|stored| stored.seq).collect();
                deliverer.note_columns(&key, &session, Some(seqs)).await?;
            }
        }
        self.deliverer = Some(Arc::clone(&deliverer));
        let deliverer: Arc<dyn BatchDeliverer> = deliverer;
        delivery.open(
            key,
            deliverer,
            Arc::clone(&self.delivery),
            self.ctx.shutdown.clone(),
        );
        if backlog.is_empty() {
            return Ok(());
        }
        let Some(session) = self.shared.session(&self.ctx.shutdown).await? else {
            return Ok(());
        };
        let requeue = Requeue {
            shared: &self.shared,
            session: &session,
            ctx: &self.ctx,
        };
        requeue.run(backlog, delivery).await
    }

    async fn seal(&mut self, epoch: &Epoch<'_>) -> Result<EpochOutcome, SinkError> {
        self.exactly_once.check_gave_up(self.ctx.partition, None)?;
        let Some(session) = self.shared.session(&self.ctx.shutdown).await? else {
            return Ok(SinkShared::not_started());
        };
        if !self.fingerprints_checked && !self.check_fingerprints(0, None).await? {
            return Ok(SinkShared::not_started());
        }
        if self.cutter.incomplete(epoch.number) {
            return Ok(SinkShared::not_started());
        }
        let EpochCut {
            parts,
            dead_letters,
            plan,
        } = self.cutter.cut_epoch(&self.shared, &session, epoch).await?;
        // The plan the epoch was encoded with: a change adopted meanwhile applies from the
        // next epoch on.
        let plan = plan.unwrap_or_else(|| session.plan());
        let batches = sealed_batches(
            &self.shared,
            &plan,
            parts,
            &self.token_prefix,
            self.ctx.partition,
        );
        Ok(EpochOutcome::Commit(EpochWrite {
            batches,
            dead_letters,
            rebuildable: true,
            counters: Vec::new(),
        }))
    }

    fn takes_slices(&self) -> bool {
        true
    }

    async fn seal_slice(&mut self, slice: &Epoch<'_>) -> Result<(), SinkError> {
        self.exactly_once.check_gave_up(self.ctx.partition, None)?;
        self.cutter
            .cut_slice(&self.shared, &self.ctx.shutdown, slice)
            .await
    }

    fn reconfigure(&mut self, dynamic: &serde_yaml::Value) -> Result<(), SinkError> {
        self.shared.reconfigure(dynamic)?;
        self.delivery.budget.resize(self.shared.in_flight_budget());
        Ok(())
    }

    /// A sink stopped by an incompatible change of its table's columns kept its batches: the
    /// run ends with the reason instead of as delivered.
    async fn drained(&mut self) -> Result<(), SinkError> {
        let Some(session) = self.shared.started_session() else {
            return Ok(());
        };
        match session.stopped() {
            None => match &self.deliverer {
                Some(deliverer) => deliverer.drained(&self.ctx.state_key()).await,
                None => Ok(()),
            },
            Some(reason) => Err(SinkError::Refused(format!(
                "{}: not delivered: this sink stopped on a change of `{}`.`{}`'s columns and keeps every batch since in the outbox: {reason}",
                self.ctx.state_key(),
                self.shared.params.database,
                self.shared.params.table
            ))),
        }
    }
}
