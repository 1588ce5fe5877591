//! Running only the partitions this worker owns, as a cluster hands them out and takes them back.
//!
//! A cluster ([`PartitionLeases`]) says which partitions this worker should run (they change as
//! workers join and leave) and grants each through a lease that also fences the store's commits
//! for it. The coordinator here starts a partition's runner once its lease is granted, stops it
//! when the partition is assigned elsewhere (the runner ends its epoch and delivers what it
//! committed within the drain bound, as at a shutdown), and only then gives the lease back, so
//! the next owner replays what is still pending. A runner that fails because the lease was lost
//! (a refused commit: another worker took the partition) is not a failure of the pipeline: the
//! partition is left to its new owner, or taken again if the cluster assigns it here again.

use std::collections::{BTreeSet, HashMap};
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use tokio::sync::watch;
use tokio::task::JoinSet;
use tracing::{error, info, warn};

use super::partition::PartitionReport;
use super::partition::PartitionRunner;
use crate::error::RuntimeError;
use crate::metrics::Metrics;
use crate::plugin::PartitionEnd;

/// How long a partition whose lease could not be taken, or was lost, waits before it is asked
/// for again (while it is still assigned here).
const RETRY_AFTER: Duration = Duration::from_secs(1);

/// The right to run partitions, as a cluster grants it.
#[async_trait]
pub trait PartitionLeases: Send + Sync + 'static {
    /// The partitions this worker should run now; the value changes as workers join and leave.
    fn assigned(&self) -> watch::Receiver<BTreeSet<u32>>;

    /// Waits until this worker holds `partition`'s lease, then fences the store's commits for it
    /// with that lease and loads the partition's committed state into the store. Once `cancel`
    /// turns true it stops waiting and answers an error, unless it took the lease already: it
    /// then answers `Ok`, and the caller gives the lease back. (Dropping the future instead
    /// could leave a lease taken by a request in flight that nobody gives back.)
    async fn acquire(
        &self,
        partition: u32,
        cancel: watch::Receiver<bool>,
    ) -> Result<(), LeaseError>;

    /// Whether this worker still holds `partition`'s lease (asked after its runner failed for
    /// another reason than a refused commit).
    async fn holds(&self, partition: u32) -> bool;

    /// Stops fencing the store's commits for `partition` and gives its lease back (if still
    /// held). Called once its runner ended.
    async fn release(&self, partition: u32);

    /// This worker stops: the others may plan to take its partitions now, each as soon as its
    /// lease is given back, instead of after this worker's session ends. Called once, when the
    /// stop begins; the default does nothing.
    async fn leave(&self) {}
}

/// Why a lease could not be taken now (asked again while the partition stays assigned here).
#[derive(Debug, thiserror::Error)]
#[error("partition {partition}: {reason}")]
pub struct LeaseError {
    /// The partition.
    pub partition: u32,
    /// What went wrong, for the log.
    pub reason: String,
    /// The underlying error, if any.
    #[source]
    pub source: Option<Box<dyn std::error::Error + Send + Sync>>,
}

/// What a task of the coordinator reports back.
enum Event {
    Acquired(u32, Result<(), LeaseError>),
    Ended(u32, Result<PartitionReport, RuntimeError>),
    RetryDue(u32),
    Abandoned,
}

/// The coordinator's view of every partition it touches.
struct Owned {
    /// Lease requests in flight, each with its cancel: a request stays here until its answer
    /// came back, so that a lease it took is always given back or used.
    acquiring: HashMap<u32, watch::Sender<bool>>,
    /// Runners, each with its own stop.
    running: HashMap<u32, watch::Sender<bool>>,
    /// Partitions whose source is exhausted and delivered: not run again by this worker.
    drained: BTreeSet<u32>,
    /// Partitions that failed while their lease was held: not run again by this worker.
    failed: Vec<RuntimeError>,
    reports: Vec<PartitionReport>,
    tasks: JoinSet<Event>,
    stopping: bool,
}

/// What the coordinator needs of the pipeline whose partitions it runs.
pub(super) struct Host {
    pub(super) name: String,
    pub(super) partitions: u32,
    pub(super) metrics: Arc<Metrics>,
    /// A partition's runner that stops when its receiver turns true.
    pub(super) runner: Box<dyn Fn(u32, watch::Receiver<bool>) -> PartitionRunner + Send + Sync>,
}

/// Runs the partitions `leases` grants until `shutdown` (see the module doc); the reports of
/// every runner that ended, in partition order. Fails, after the shutdown, if a partition
/// failed while its lease was held.
pub(super) async fn run(
    host: Host,
    mut shutdown: watch::Receiver<bool>,
    leases: Arc<dyn PartitionLeases>,
) -> Result<Vec<PartitionReport>, RuntimeError> {
    let mut assigned = leases.assigned();
    let mut owned = Owned::new();
    let current = assigned.borrow_and_update().clone();
    owned.reconcile(&host, &leases, &current);
    // A worker with nothing to run waits for partitions or a shutdown; it ends only once
    // stopping and every task of its own ended.
    loop {
        tokio::select! {
            changed = assigned.changed(), if !owned.stopping => {
                if changed.is_err() {
                    owned.stop_all(&leases);
                    continue;
                }
                let current = assigned.borrow_and_update().clone();
                owned.reconcile(&host, &leases, &current);
            }
            () = stop_requested(&mut shutdown), if !owned.stopping => owned.stop_all(&leases),
            joined = owned.tasks.join_next(), if !owned.tasks.is_empty() => {
                let Some(joined) = joined else { break };
                match joined {
                    Ok(event) => {
                        let current = assigned.borrow().clone();
                        owned.on_event(&host, &leases, event, &current).await;
                    }
                    Err(err) if err.is_cancelled() => {}
                    Err(source) => owned.failed.push(RuntimeError::Join { partition: u32::MAX, source }),
                }
            }
        }
        if owned.stopping && owned.tasks.is_empty() {
            break;
        }
    }
    owned.finish()
}

/// Resolves once a shutdown was asked for (or the pipeline's control is gone).
async fn stop_requested(shutdown: &mut watch::Receiver<bool>) {
    // The guard `wait_for` returns is not `Send`: drop it inside.
    let _ = shutdown.wait_for(|stop| *stop).await.map(|_| ());
}

impl Owned {
    fn new() -> Owned {
        Owned {
            acquiring: HashMap::new(),
            running: HashMap::new(),
            drained: BTreeSet::new(),
            failed: Vec::new(),
            reports: Vec::new(),
            tasks: JoinSet::new(),
            stopping: false,
        }
    }

    /// Asks for the lease of every partition newly assigned here; stops the runners and lease
    /// requests of those assigned elsewhere.
    fn reconcile(
        &mut self,
        pipeline: &Host,
        leases: &Arc<dyn PartitionLeases>,
        assigned: &BTreeSet<u32>,
    ) {
        for &partition in assigned {
            let busy =
                self.acquiring.contains_key(&partition) || self.running.contains_key(&partition);
            if !busy && !self.drained.contains(&partition) && partition < pipeline.partitions {
                self.acquire(leases, partition);
            }
        }
        let dropped: Vec<u32> = self
            .acquiring
            .keys()
            .filter(|p| !assigned.contains(p))
            .copied()
            .collect();
        for partition in dropped {
            self.abandon(partition);
        }
        for (partition, stop) in &self.running {
            if !assigned.contains(partition) {
                info!(pipeline = %pipeline.name, partition, "partition assigned to another worker; stopping it and handing it over");
                stop.send_replace(true);
            }
        }
    }

    fn acquire(&mut self, leases: &Arc<dyn PartitionLeases>, partition: u32) {
        let leases = Arc::clone(leases);
        let (cancel, cancelled) = watch::channel(false);
        self.tasks.spawn(async move {
            Event::Acquired(partition, leases.acquire(partition, cancelled).await)
        });
        self.acquiring.insert(partition, cancel);
    }

    fn start(&mut self, pipeline: &Host, partition: u32) {
        let (stop, stopped) = watch::channel(false);
        let runner = (pipeline.runner)(partition, stopped);
        self.tasks
            .spawn(async move { Event::Ended(partition, runner.run().await) });
        self.running.insert(partition, stop);
        pipeline
            .metrics
            .ownership_changed(&pipeline.name, partition, "acquired");
        info!(pipeline = %pipeline.name, partition, "partition owned; running it");
    }

    async fn on_event(
        &mut self,
        pipeline: &Host,
        leases: &Arc<dyn PartitionLeases>,
        event: Event,
        assigned: &BTreeSet<u32>,
    ) {
        match event {
            Event::Acquired(partition, Ok(())) => {
                self.acquiring.remove(&partition);
                if self.stopping || !assigned.contains(&partition) {
                    leases.release(partition).await;
                } else {
                    self.start(pipeline, partition);
                }
            }
            Event::Acquired(partition, Err(err)) => {
                self.acquiring.remove(&partition);
                if self.stopping || !assigned.contains(&partition) {
                    // Cancelled (or failed) after the partition went elsewhere: nothing to do.
                    return;
                }
                warn!(pipeline = %pipeline.name, partition, error = %err, "could not take the partition's lease; asking again in 1 s");
                self.retry_later(partition);
            }
            Event::RetryDue(partition) => {
                let busy = self.acquiring.contains_key(&partition)
                    || self.running.contains_key(&partition);
                if !self.stopping && !busy && assigned.contains(&partition) {
                    self.acquire(leases, partition);
                }
            }
            Event::Abandoned => {}
            Event::Ended(partition, result) => {
                self.running.remove(&partition);
                self.ended(pipeline, leases, partition, result).await;
            }
        }
    }

    fn retry_later(&mut self, partition: u32) {
        self.tasks.spawn(async move {
            tokio::time::sleep(RETRY_AFTER).await;
            Event::RetryDue(partition)
        });
    }

    async fn ended(
        &mut self,
        pipeline: &Host,
        leases: &Arc<dyn PartitionLeases>,
        partition: u32,
        result: Result<PartitionReport, RuntimeError>,
    ) {
        let name = &pipeline.name;
        match result {
            Ok(report) => {
                if report.end == PartitionEnd::Drained {
                    self.drained.insert(partition);
                }
                self.reports.push(report);
                leases.release(partition).await;
                pipeline
                    .metrics
                    .ownership_changed(name, partition, "released");
            }
            Err(err) if err.is_fenced() || !leases.holds(partition).await => {
                warn!(pipeline = %name, partition, error = %err, "lost ownership of the partition (fenced: another worker holds it now, or ZooKeeper did not confirm a commit); stopped it, nothing more is sent for it; it is taken and loaded again if it stays assigned here");
                pipeline.metrics.ownership_changed(name, partition, "lost");
                leases.release(partition).await;
                if !self.stopping {
                    self.retry_later(partition);
                }
            }
            Err(err) => {
                error!(pipeline = %name, partition, error = %err, "partition failed");
                pipeline
                    .metrics
                    .partition_failed(name, partition, err.to_string());
                leases.release(partition).await;
                pipeline
                    .metrics
                    .ownership_changed(name, partition, "released");
                self.failed.push(err);
            }
        }
    }

    /// Cancels the lease request of `partition`; its answer still comes back as an event, which
    /// gives back a lease it took meanwhile.
    fn abandon(&mut self, partition: u32) {
        if let Some(cancel) = self.acquiring.get(&partition) {
            cancel.send_replace(true);
        }
    }

    fn stop_all(&mut self, leases: &Arc<dyn PartitionLeases>) {
        self.stopping = true;
        let leaving = Arc::clone(leases);
        self.tasks.spawn(async move {
            leaving.leave().await;
            Event::Abandoned
        });
        let acquiring: Vec<u32> = self.acquiring.keys().copied().collect();
        for partition in acquiring {
            self.abandon(partition);
        }
        for stop in self.running.values() {
            stop.send_replace(true);
        }
    }

    fn finish(mut self) -> Result<Vec<PartitionReport>, RuntimeError> {
        if !self.failed.is_empty() {
            return Err(RuntimeError::PartitionsFailed(self.failed));
        }
        self.reports.sort_by_key(|r| r.partition);
        Ok(self.reports)
    }
}
