//! The exactly-once classes with a table template (`table: "events_{event_type}"`) or a
//! `tables:` map: each partition's template has its broker subject resolved when the sink is
//! built ([`crate::tables::subjects`]); each epoch's rows are resolved to their tables in
//! message order, and each table's rows are cut, routed
//! and encoded as one table's sink would ([`BatchCutter::cut_epoch_rows`]), under tokens of the
//! table's own namespace `<prefix><table>/<partition>-<max id>[:<shard>]`.
//!
//! Deterministic replays: the outbox keeps these batches' payloads (the writes are not marked
//! rebuildable), so a replay after a crash sends the stored bytes under the stored token, and the
//! decision that a table is missing, taken once at seal time, is committed with the epoch as the
//! row's dead letter: a replay never sends that row to a table that exists by then. See
//! docs/clickhouse.md "Many tables from one stream".

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use async_trait::async_trait;
use flow_core::delivery::{
    blocking, load_backlog, BatchDeliverer, OutboxDelivery, OutboxSink, Sealer, SinkDelivery,
};
use flow_core::registry::{BuildResult, SinkBuildContext};
use flow_core::{Epoch, EpochOutcome, EpochWrite, Sink, SinkContext, SinkError, SinkFactory};
use flow_state::StoredBatch;

use crate::config::guarantee::SinkClass;
use crate::delivery::cutter::{BatchCutter, EpochCut};
use crate::delivery::sink_state::build_shared;
use crate::exactly_once::fingerprint::{check_topology, TopologyDecision};
use crate::exactly_once::rebuild::Requeue;
use crate::exactly_once::sink::sealed_batches;
use crate::exactly_once::state::ExactlyOnce;
use crate::server::session::WriterSession;
use crate::tables::deliverers::TableDeliverers;
use crate::tables::requeued::UNENCODED_FORMAT;
use crate::tables::resolver::{Resolver, TableTurn};
use crate::tables::subjects::{partition_templates, PartitionTemplates};
use crate::tables::targets::{TableState, TableTarget, Targets};

/// Builds either batching class with a table template.
pub fn build(
    class: SinkClass,
    ctx: &SinkBuildContext<'_>,
    parameters: &serde_yaml::Value,
    dynamic: &serde_yaml::Value,
) -> BuildResult<Arc<dyn SinkFactory>> {
    let base = build_shared(class, ctx, parameters, dynamic)?;
    let templates = partition_templates(&base.params, ctx.subjects, &base.stream)?;
    let delivery = SinkDelivery::new(ctx.sink, base.in_flight_budget());
    Ok(Arc::new(TemplatedFactory {
        targets: Arc::new(Targets::new(base)),
        templates,
        delivery,
    }))
}

struct TemplatedFactory {
    targets: Arc<Targets>,
    /// Each partition's template, its subject resolved.
    templates: PartitionTemplates,
    delivery: Arc<SinkDelivery>,
}

impl SinkFactory for TemplatedFactory {
    fn create(&self, ctx: SinkContext) -> Result<Box<dyn Sink>, SinkError> {
        let token_prefix = ExactlyOnce::token_prefix(&self.targets.base, &ctx)?;
        let template = self.templates.for_sink(&ctx)?;
        self.targets.base.note_cluster(&ctx);
        self.targets.register_readiness(&ctx.metrics);
        Ok(Box::new(OutboxSink::new(TemplatedSink {
            targets: Arc::clone(&self.targets),
            resolver: Resolver::new(Arc::clone(&self.targets), template),
            delivery: Arc::clone(&self.delivery),
            token_prefix,
            ctx,
            checked: BTreeSet::new(),
            cutter: BatchCutter::default(),
            deliverers: None,
        })))
    }

    fn reconfigure(&self, dynamic: &serde_yaml::Value) -> Result<(), SinkError> {
        self.targets.reconfigure(dynamic)?;
        self.delivery
            .budget
            .resize(self.targets.base.in_flight_budget());
        Ok(())
    }
}

struct TemplatedSink {
    targets: Arc<Targets>,
    /// Each row's table.
    resolver: Resolver,
    delivery: Arc<SinkDelivery>,
    /// The sink's token prefix; a table's tokens add `<table>/`.
    token_prefix: String,
    ctx: SinkContext,
    /// Tables whose fingerprints this partition compared with (or stored as) the current ones.
    checked: BTreeSet<String>,
    /// Cuts one table's rows at a time (its buffers are reused across tables and epochs).
    cutter: BatchCutter,
    /// The partition's per-table deliverers once opened.
    deliverers: Option<Arc<TableDeliverers>>,
}

impl TemplatedSink {
    /// The topology guard of one table (see [`crate::exactly_once::sink`]): its fingerprints are
    /// stored under `<table>/` in the partition's map, next to the other tables'.
    async fn check_fingerprints(
        &mut self,
        table: &str,
        target: &TableTarget,
        session: &WriterSession,
        undelivered: u64,
        oldest: Option<String>,
    ) -> Result<(), SinkError> {
        let store = self.ctx.store.clone();
        let key = self.ctx.state_key();
        let all = blocking(move || store.fingerprints(&key)).await?;
        let prefix = format!("{table}/");
        let persisted: BTreeMap<String, String> = all
            .iter()
            .filter_map(|(k, v)| Some((k.strip_prefix(&prefix)?.to_owned(), v.clone())))
            .collect();
        let mut current = target.exactly_once.current_fingerprints(session);
        session.late_targets.fill(&mut current, &persisted);
        let decision = check_topology(&persisted, &current, undelivered, oldest.as_deref())
            .map_err(|err| SinkError::Plugin(Box::new(err)))?;
        if decision == TopologyDecision::Adopt && persisted != current {
            let mut merged: BTreeMap<String, String> = all
                .into_iter()
                .filter(|(k, _)| !k.starts_with(&prefix))
                .collect();
            merged.extend(
                current
                    .into_iter()
                    .map(|(k, v)| (format!("{prefix}{k}"), v)),
            );
            self.ctx
                .store
                .set_fingerprints(&self.ctx.state_key(), merged)
                .await?;
        }
        self.checked.insert(table.to_owned());
        Ok(())
    }

    /// Fails once any table of this sink gave an insert up.
    fn check_gave_up(&self) -> Result<(), SinkError> {
        for target in self.targets.all() {
            target
                .exactly_once
                .check_gave_up(self.ctx.partition, None)?;
        }
        Ok(())
    }

    /// Queues the backlog found at open, one run of consecutive entries of one table at a
    /// time, each through its table's [`Requeue`] (stored payloads as they are, bounds rebuilt).
    async fn requeue(
        &mut self,
        backlog: Vec<StoredBatch>,
        deliverers: &TableDeliverers,
        delivery: &mut OutboxDelivery,
    ) -> Result<(), SinkError> {
        // Each table's pending entries, for its start-time columns check.
        let mut seqs_of: BTreeMap<String, Vec<u64>> = BTreeMap::new();
        for stored in &backlog {
            let seqs = seqs_of.entry(stored.batch.target.clone()).or_default();
            seqs.push(stored.seq);
        }
        let mut runs: Vec<Vec<StoredBatch>> = Vec::new();
        for stored in backlog {
            match runs.last_mut() {
                Some(run) if run[0].batch.target == stored.batch.target => run.push(stored),
                _ => runs.push(vec![stored]),
            }
        }
        for run in runs {
            let target = self.targets.of_stored(&run[0].batch.target)?;
            let table = target.shared.params.table.clone();
            let session = match target.state(&self.ctx.shutdown).await? {
                TableState::Up(session) => session,
                TableState::Stopping => return Ok(()),
                // Requeued rows whose table is still missing: their delivery applies the
                // sink's `missing_table` ([`TableDeliverers`]).
                TableState::Missing(_) if run.iter().all(|s| s.batch.format == UNENCODED_FORMAT) => {
                    let key = self.ctx.state_key();
                    for stored in run {
                        if !delivery.push_stored(&self.ctx.store, &key, stored).await? {
                            return Ok(());
                        }
                    }
                    continue;
                }
                TableState::Missing(reason) => {
                    return Err(SinkError::Refused(format!(
                        "{}: {} pending batch(es) are for table `{}`, which is gone: {reason}. Create it again as it was, or start on a new state directory to give these rows up",
                        self.ctx.state_key(),
                        run.len(),
                        run[0].batch.target
                    )))
                }
            };
            if !self.checked.contains(&table) {
                let pending = run.len() as u64;
                let bound = format!("{}-{}", self.ctx.partition, run[0].batch.last_offset);
                self.check_fingerprints(&table, &target, &session, pending, Some(bound))
                    .await?;
            }
            if let Some(seqs) = seqs_of.remove(&run[0].batch.target) {
                // As for one table: the run before may have stored any of the table's pending
                // entries without acknowledging it, under the columns it last sent with.
                let deliverer = deliverers.of(&run[0].batch.target).await?;
                let key = self.ctx.state_key();
                deliverer.note_columns(&key, &session, Some(seqs)).await?;
            }
            let requeue = Requeue {
                shared: &target.shared,
                session: &session,
                ctx: &self.ctx,
            };
            // Requeued rows for a table that was missing are queued as stored (they are
            // encoded when delivered), in outbox order with the rest.
            let key = self.ctx.state_key();
            let mut encoded = Vec::new();
            for stored in run {
                if stored.batch.format != UNENCODED_FORMAT {
                    encoded.push(stored);
                    continue;
                }
                requeue.run(std::mem::take(&mut encoded), delivery).await?;
                if !delivery.push_stored(&self.ctx.store, &key, stored).await? {
                    return Ok(());
                }
            }
            requeue.run(encoded, delivery).await?;
        }
        Ok(())
    }
}

#[async_trait]
impl Sealer for TemplatedSink {
    async fn open(&mut self, delivery: &mut OutboxDelivery) -> Result<(), SinkError> {
        self.ctx.metrics.clear_gave_up().await?;
        let key = self.ctx.state_key();
        let backlog = load_backlog(&self.ctx.store, &key).await?;
        let deliverers = Arc::new(TableDeliverers::new(
            Arc::clone(&self.targets),
            self.ctx.clone(),
        ));
        self.deliverers = Some(Arc::clone(&deliverers));
        let deliverer: Arc<dyn BatchDeliverer> = Arc::clone(&deliverers) as _;
        delivery.open(
            key,
            deliverer,
            Arc::clone(&self.delivery),
            self.ctx.shutdown.clone(),
        );
        self.requeue(backlog, &deliverers, delivery).await
    }

    async fn seal(&mut self, epoch: &Epoch<'_>) -> Result<EpochOutcome, SinkError> {
        self.check_gave_up()?;
        let mut resolved = self.resolver.resolve(epoch)?;
        let mut batches = Vec::new();
        for t in 0..resolved.tables.len() {
            let table = resolved.tables[t].clone();
            let stop = &self.ctx.shutdown;
            let prefix = &self.token_prefix;
            let (target, session) = match self
                .resolver
                .table(epoch, &mut resolved, t, stop, prefix)
                .await?
            {
                TableTurn::Up(target, session) => (target, session),
                TableTurn::Skip => continue,
                TableTurn::Outcome(outcome) => return Ok(outcome),
            };
            if !self.checked.contains(&table) {
                self.check_fingerprints(&table, &target, &session, 0, None)
                    .await?;
            }
            let cutter = &mut self.cutter;
            let EpochCut { parts, plan, .. } = resolved
                .cut_table(cutter, (&target, &session), epoch, t)
                .await?;
            let prefix = format!("{}{table}/", self.token_prefix);
            let partition = self.ctx.partition;
            // The plan the table's rows were encoded with (see the exactly-once sink).
            let plan = plan.unwrap_or_else(|| session.plan());
            batches.extend(sealed_batches(
                &target.shared,
                &plan,
                parts,
                &prefix,
                partition,
            ));
        }
        // Dead letters in message order, whichever table (or none) each row named.
        let mut dead_letters = resolved.dead_letters;
        dead_letters.sort_by_key(|d| d.offset);
        Ok(EpochOutcome::Commit(EpochWrite {
            batches,
            dead_letters,
            // Payloads are kept: see the module doc.
            rebuildable: false,
            counters: Vec::new(),
        }))
    }

    fn reconfigure(&mut self, dynamic: &serde_yaml::Value) -> Result<(), SinkError> {
        self.targets.reconfigure(dynamic)?;
        self.delivery
            .budget
            .resize(self.targets.base.in_flight_budget());
        Ok(())
    }

    /// Each table's deliverer records the partition drained (as for one table).
    async fn drained(&mut self) -> Result<(), SinkError> {
        match &self.deliverers {
            Some(deliverers) => deliverers.drained(&self.ctx.state_key()).await,
            None => Ok(()),
        }
    }
}
