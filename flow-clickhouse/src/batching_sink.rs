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
//! ([`crate::rebuild`]) before they are sent.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use flow_core::delivery::{
    load_backlog, now_ms, BatchDeliverer, OutboxDelivery, OutboxSink, Sealer, SinkDelivery,
};
use flow_core::registry::{BuildResult, SinkBuildContext};
use flow_core::{Epoch, EpochOutcome, EpochWrite, Sink, SinkContext, SinkError, SinkFactory};
use flow_state::{SealedBatch, SinkPartition, StateStore};
use tokio::sync::watch;

use crate::classify::{is_row_rejection, ClassifiedError};
use crate::compress::is_framed;
use crate::cutter::BatchCutter;
use crate::exactly_once::ExactlyOnce;
use crate::fingerprint::{check_topology, TopologyDecision};
use crate::insert::{insert_part, InsertFailure, InsertRequest};
use crate::params::{OnBadRows, SinkClass};
use crate::rebuild::Requeue;
use crate::session::WriterSession;
use crate::sink_state::{build_shared, SinkShared};
use crate::split::{marker_prefix, refusal_from_marker, SplitOutcome, SplitPart};

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
        exactly_once: Arc::new(ExactlyOnce::new(&shared, ctx)),
        shared,
        delivery,
    }))
}

struct BatchingSinkFactory {
    shared: Arc<SinkShared>,
    delivery: Arc<SinkDelivery>,
    exactly_once: Arc<ExactlyOnce>,
}

impl SinkFactory for BatchingSinkFactory {
    fn create(&self, ctx: SinkContext) -> Result<Box<dyn Sink>, SinkError> {
        self.shared.start_session_early(&ctx.shutdown);
        Ok(Box::new(OutboxSink::new(BatchingSink {
            shared: Arc::clone(&self.shared),
            delivery: Arc::clone(&self.delivery),
            exactly_once: Arc::clone(&self.exactly_once),
            ctx,
            fingerprints_checked: false,
            cutter: BatchCutter::default(),
        })))
    }
}

struct BatchingSink {
    shared: Arc<SinkShared>,
    delivery: Arc<SinkDelivery>,
    exactly_once: Arc<ExactlyOnce>,
    ctx: SinkContext,
    /// Whether the persisted fingerprints were compared with (or replaced by) the current ones.
    fingerprints_checked: bool,
    cutter: BatchCutter,
}

async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, flow_state::StateError> + Send + 'static,
) -> Result<T, SinkError> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|err| SinkError::Delivery {
            reason: format!("state task failed: {err}"),
        })?
        .map_err(SinkError::from)
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
        let current = self.exactly_once.current_fingerprints(&session);
        let store = self.ctx.store.clone();
        let key = self.ctx.state_key();
        let persisted = blocking(move || store.fingerprints(&key)).await?;
        let decision = check_topology(&persisted, &current, undelivered, oldest.as_deref())
            .map_err(|err| SinkError::Refused(err.to_string()))?;
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
        let split = {
            let (store, key) = (self.ctx.store.clone(), key.clone());
            blocking(move || split_seqs(&store, &key)).await?
        };
        let deliverer: Arc<dyn BatchDeliverer> = Arc::new(ClickHouseDeliverer {
            shared: Arc::clone(&self.shared),
            exactly_once: Arc::clone(&self.exactly_once),
            store: self.ctx.store.clone(),
            split: Mutex::new(split),
        });
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
        let stopping = || EpochOutcome::Veto {
            reason: "the pipeline is stopping before the writer session started".to_owned(),
            retry_after: Duration::ZERO,
        };
        let Some(session) = self.shared.session(&self.ctx.shutdown).await? else {
            return Ok(stopping());
        };
        if !self.fingerprints_checked && !self.check_fingerprints(0, None).await? {
            return Ok(stopping());
        }
        let (mut parts, mut dead_letters) = (Vec::new(), Vec::new());
        for batch in epoch.inputs {
            self.cutter
                .cut(&self.shared, &session, batch, &mut parts, &mut dead_letters)
                .await?;
        }
        let target = format!(
            "{}.{}",
            self.shared.params.spec.database, self.shared.params.spec.table
        );
        let columns = session.encoder.column_names();
        let plan = session.encoder.plan_fingerprint();
        let sealed_at_ms = now_ms();
        let partition = self.ctx.partition;
        let batches = parts
            .into_iter()
            .map(|part| {
                let shard = self.shared.sharded.then_some(part.shard.as_str());
                let token = self.exactly_once.token(partition, part.last_offset, shard);
                SealedBatch {
                    target: target.clone(),
                    columns: columns.clone(),
                    format: part.format,
                    token,
                    shard: part.shard,
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
            .collect();
        Ok(EpochOutcome::Commit(EpochWrite {
            batches,
            dead_letters,
            rebuildable: true,
        }))
    }

    fn reconfigure(&mut self, dynamic: &serde_yaml::Value) -> Result<(), SinkError> {
        self.shared.reconfigure(dynamic)?;
        self.delivery.budget.resize(self.shared.in_flight_budget());
        Ok(())
    }
}

/// The pending entries of `key` marked as delivered in pieces ([`crate::split`]).
fn split_seqs(
    store: &StateStore,
    key: &SinkPartition,
) -> Result<BTreeMap<u64, ClassifiedError>, flow_state::StateError> {
    let prefix = marker_prefix(key.partition);
    let marks = store.sink_values_with_prefix(&key.pipeline, &key.sink, &prefix)?;
    Ok(marks
        .iter()
        .filter_map(|(name, value)| {
            let seq = name.strip_prefix(&prefix)?.parse().ok()?;
            Some((seq, refusal_from_marker(value)))
        })
        .collect())
}

/// Sends stored batches, retrying by error class, failing over within the shard.
struct ClickHouseDeliverer {
    shared: Arc<SinkShared>,
    exactly_once: Arc<ExactlyOnce>,
    store: StateStore,
    /// Pending entries that were being delivered in pieces when the worker last stopped.
    split: Mutex<BTreeMap<u64, ClassifiedError>>,
}

impl ClickHouseDeliverer {
    /// Whether a failed part is sent in pieces rather than given up.
    fn splits(&self, error: &ClassifiedError) -> bool {
        self.shared.params.spec.on_bad_rows == OnBadRows::DeadLetter && is_row_rejection(error)
    }

    /// The refusal of a part that was being delivered in pieces when the worker last stopped.
    fn was_split(&self, seq: u64) -> Option<ClassifiedError> {
        self.split
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .get(&seq)
            .cloned()
    }

    /// Delivers the part in pieces ([`SplitPart`]), as the server refused it with `refused`.
    async fn split(
        &self,
        key: &SinkPartition,
        seq: u64,
        batch: &SealedBatch,
        refused: &ClassifiedError,
        session: &WriterSession,
        stop: &watch::Receiver<bool>,
    ) -> Result<(), SinkError> {
        let part = SplitPart {
            shared: &self.shared,
            session,
            store: &self.store,
            key,
            seq,
            batch,
            refused,
        };
        match part.deliver(stop).await? {
            SplitOutcome::Delivered => {
                self.split
                    .lock()
                    .unwrap_or_else(|poisoned| poisoned.into_inner())
                    .remove(&seq);
                Ok(())
            }
            SplitOutcome::Stopped => Ok(()),
            SplitOutcome::GaveUp(reason) => Err(self.exactly_once.give_up(&self.shared, reason)),
        }
    }
}

#[async_trait]
impl BatchDeliverer for ClickHouseDeliverer {
    async fn deliver(
        &self,
        key: &SinkPartition,
        seq: u64,
        batch: &SealedBatch,
        stop: &watch::Receiver<bool>,
    ) -> Result<(), SinkError> {
        self.exactly_once
            .check_gave_up(key.partition, Some(&batch.token))?;
        let Some(session) = self.shared.session(stop).await? else {
            // Stopping: the batch stays in the outbox for the next run.
            return Ok(());
        };
        if let Some(refused) = self.was_split(seq) {
            return self.split(key, seq, batch, &refused, &session, stop).await;
        }
        let mut stop = stop.clone();
        let result = insert_part(
            &self.shared,
            &session,
            InsertRequest {
                shard: &batch.shard,
                token: Some(&batch.token),
                payload: &batch.payload,
                compressed: is_framed(&batch.format),
                sealed_at_ms: Some(batch.sealed_at_ms),
                answered_code: None,
            },
            &mut stop,
        )
        .await;
        match result {
            Ok(_) => {
                self.store.acknowledge(key, seq, Vec::new()).await?;
                Ok(())
            }
            // Stopping leaves the batch in the outbox for the next run.
            Err(InsertFailure::Stopped) => Ok(()),
            Err(InsertFailure::GaveUp(gave_up)) if self.splits(&gave_up.error) => {
                self.split(key, seq, batch, &gave_up.error, &session, &stop)
                    .await
            }
            Err(InsertFailure::GaveUp(gave_up)) => Err(self.exactly_once.give_up(
                &self.shared,
                gave_up.reason(&session, &batch.shard, Some(&batch.token)),
            )),
        }
    }
}
