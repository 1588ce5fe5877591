//! Delivering the batches of a sink partition with a table template ([`TableDeliverers`]): each
//! stored batch names its table (`target`), and goes to that table's
//! [`ClickHouseDeliverer`], made on first use with the table's session and give-up latch. The
//! partition keeps one queue (its lanes are per shard, in outbox order), so the tables of an
//! epoch are delivered in the order they were sealed. A requeued row set aside for a missing
//! table is encoded for its table here ([`encode_requeued`]); when its table is still missing,
//! the sink's `missing_table` decides: a dead letter again, or the partition waits.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use flow_core::delivery::{blocking, BatchDeliverer};
use flow_core::{SinkContext, SinkCount, SinkError};
use flow_state::{AckExtras, DeadLetter, SealedBatch, SinkPartition};
use tokio::sync::watch;
use tracing::warn;

use crate::config::params::MissingTable;
use crate::exactly_once::deliverer::{ClickHouseDeliverer, PartitionMarks};
use crate::tables::requeued::{encode_requeued, UNENCODED_FORMAT};
use crate::tables::resolver::missing_table_reason;
use crate::tables::targets::{TableState, TableTarget, Targets, MISSING_RECHECK};

/// The per-table deliverers of one sink partition.
pub struct TableDeliverers {
    targets: Arc<Targets>,
    ctx: SinkContext,
    by_target: Mutex<BTreeMap<String, Arc<ClickHouseDeliverer>>>,
}

impl TableDeliverers {
    pub fn new(targets: Arc<Targets>, ctx: SinkContext) -> TableDeliverers {
        TableDeliverers {
            targets,
            ctx,
            by_target: Mutex::new(BTreeMap::new()),
        }
    }

    /// The deliverer of a stored batch's `target`.
    pub async fn of(&self, target: &str) -> Result<Arc<ClickHouseDeliverer>, SinkError> {
        if let Some(found) = self.by_target().get(target) {
            return Ok(Arc::clone(found));
        }
        let table = self.targets.of_stored(target)?;
        // Each table's deliverer reads the partition's marks; it only consults those of the
        // entries it delivers, which are its table's, and keeps its own record of the columns
        // its attempts were made under.
        let (store, key) = (self.ctx.store.clone(), self.ctx.state_key());
        let name = table.shared.params.table.clone();
        let marks = blocking(move || PartitionMarks::load(&store, &key, Some(&name))).await?;
        let made = Arc::new(ClickHouseDeliverer::new(
            Arc::clone(&table.shared),
            Arc::clone(&table.exactly_once),
            self.ctx.clone(),
            marks,
            // Its counts and timings carry the table's label.
            self.ctx.metrics.for_table(&table.shared.params.table),
        ));
        Ok(Arc::clone(
            self.by_target().entry(target.to_owned()).or_insert(made),
        ))
    }

    /// After the partition's delivery drained: each table's deliverer records that none of
    /// its pending entries can be in its table without a mark.
    pub async fn drained(&self, key: &SinkPartition) -> Result<(), SinkError> {
        let deliverers: Vec<_> = self.by_target().values().cloned().collect();
        for deliverer in deliverers {
            deliverer.drained(key).await?;
        }
        Ok(())
    }

    fn by_target(&self) -> std::sync::MutexGuard<'_, BTreeMap<String, Arc<ClickHouseDeliverer>>> {
        self.by_target
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

#[async_trait]
impl BatchDeliverer for TableDeliverers {
    /// As for one table: a sharded sink's lanes may set a stalled shard's batches aside.
    fn reloads(&self) -> bool {
        self.targets.base.sharded
    }

    async fn reload(
        &self,
        key: &SinkPartition,
        shard: &str,
        after: Option<u64>,
    ) -> Result<Option<(u64, SealedBatch)>, SinkError> {
        let (store, task_key, task_shard) = (self.ctx.store.clone(), key.clone(), shard.to_owned());
        let next = blocking(move || store.next_undelivered(&task_key, &task_shard, after)).await?;
        let Some(stored) = next else {
            return Ok(None);
        };
        // The table's own deliverer reads it back (its payload, or rebuilt from its bounds).
        self.of(&stored.batch.target)
            .await?
            .reload(key, shard, after)
            .await
    }

    async fn deliver(
        &self,
        key: &SinkPartition,
        seq: u64,
        batch: &SealedBatch,
        stop: &watch::Receiver<bool>,
    ) -> Result<(), SinkError> {
        let deliverer = self.of(&batch.target).await?;
        if batch.format != UNENCODED_FORMAT {
            return deliverer.deliver(key, seq, batch, stop).await;
        }
        let target = self.targets.of_stored(&batch.target)?;
        let mut warned: Option<Instant> = None;
        loop {
            match target.state(stop).await? {
                TableState::Up(session) => {
                    let encoded = encode_requeued(&target.shared, &session, batch)?;
                    return deliverer.deliver(key, seq, &encoded, stop).await;
                }
                // Stopping: the row stays in the outbox for the next run.
                TableState::Stopping => return Ok(()),
                TableState::Missing(reason) => match target.shared.params.missing_table {
                    MissingTable::DeadLetter => {
                        return self
                            .set_aside_again(key, seq, batch, &target, &reason)
                            .await
                    }
                    MissingTable::Wait => {
                        if warned.is_none_or(|at| at.elapsed() >= STILL_MISSING_WARNING_EVERY) {
                            warned = Some(Instant::now());
                            warn!(sink = %key, table = %batch.target, reason = %reason, "a requeued row's table still does not exist; the partition waits for it (missing_table: wait). Create the table");
                        }
                        let mut stop = stop.clone();
                        tokio::select! {
                            _ = tokio::time::sleep(MISSING_RECHECK) => {}
                            _ = stop.wait_for(|s| *s) => return Ok(()),
                        }
                    }
                },
            }
        }
    }
}

/// Between two warnings that a requeued row waits for its table.
const STILL_MISSING_WARNING_EVERY: Duration = Duration::from_secs(60);

impl TableDeliverers {
    /// A requeued row whose table still does not exist becomes a dead letter again, as the
    /// sink's rows naming a missing table do (`missing_table: dead_letter`): its outbox entry
    /// is acknowledged with the dead letter in one step, which keeps the table and token a
    /// later requeue sends it under, so the partition's other entries go on.
    async fn set_aside_again(
        &self,
        key: &SinkPartition,
        seq: u64,
        batch: &SealedBatch,
        target: &TableTarget,
        reason: &str,
    ) -> Result<(), SinkError> {
        let params = &target.shared.params;
        let letter = DeadLetter {
            partition: key.partition,
            offset: Some(batch.first_offset),
            reason: missing_table_reason(&params.database, &params.table, reason),
            payload: batch.payload.to_vec(),
        };
        let metrics = self.ctx.metrics.for_table(&params.table);
        let counters = vec![metrics.add(SinkCount::DeadLetterRows, None, batch.rows)];
        let extras = AckExtras {
            dead_letters: vec![letter],
            counters: counters.clone(),
            ..AckExtras::default()
        };
        self.ctx.store.acknowledge_with(key, seq, extras).await?;
        metrics.applied(&counters);
        warn!(sink = %key, table = %batch.target, reason = %reason, "a requeued row's table still does not exist: the row is a dead letter again. Create the table, then `flow-worker dead-letters requeue` sends it there");
        Ok(())
    }
}
