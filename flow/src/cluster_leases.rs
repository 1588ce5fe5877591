//! Cluster mode: this worker as a member of a pipeline's ZooKeeper cluster, granting the runtime
//! ([`PartitionLeases`]) the partitions rendezvous hashing assigns it over the live members.
//!
//! A lease taken here also fences the store: the partition's owner node and generation are
//! registered with the store's ZooKeeper mirror, whose every commit for the partition checks
//! them, and the partition's state is loaded from ZooKeeper before its runner starts, so the
//! runner replays what the previous owner left pending.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex, MutexGuard, RwLock, Weak};
use std::time::Duration;

use async_trait::async_trait;
use flow_core::{LeaseError, PartitionLeases};
use flow_state::cluster::{assigned, Cluster, ClusterError, ClusterUrl, Ownership, SessionStatus};
use flow_state::zk::ZkMirror;
use flow_state::{StateError, StateStore};
use tokio::sync::watch;
use tracing::{info, warn};

/// Why a worker could not join its pipeline's cluster.
#[derive(Debug, thiserror::Error)]
pub enum JoinError {
    /// ZooKeeper refused or could not be reached.
    #[error("joining the cluster at {url}")]
    Cluster {
        /// The cluster URL.
        url: String,
        /// The cause.
        #[source]
        source: ClusterError,
    },
    /// The store refused the ZooKeeper mirror.
    #[error("linking the state store to the cluster at {url}")]
    Mirror {
        /// The cluster URL.
        url: String,
        /// The cause.
        #[source]
        source: StateError,
    },
}

/// This worker's membership and leases in one pipeline's cluster.
pub struct ClusterLeases {
    /// The current session; replaced when the previous one expired.
    cluster: RwLock<Arc<Cluster>>,
    join: JoinArgs,
    store: StateStore,
    assigned: watch::Receiver<BTreeSet<u32>>,
    owned: Mutex<BTreeMap<u32, Ownership>>,
}

/// What joining (again) needs.
#[derive(Clone)]
struct JoinArgs {
    url: ClusterUrl,
    worker_id: String,
    session_timeout: Duration,
    pipeline: String,
    partitions: u32,
}

/// A joined session and its view of the members.
struct Joined {
    cluster: Cluster,
    members: watch::Receiver<BTreeSet<String>>,
}

/// How long a worker whose session expired waits between attempts to join again.
const REJOIN_PAUSE: Duration = Duration::from_secs(1);

impl ClusterLeases {
    /// Connects to the cluster at `url` as `worker_id`, links `store` to the pipeline's state in
    /// ZooKeeper and registers this worker as a live member of `pipeline`. When the session
    /// expires later (the worker was frozen or cut off past the session timeout, or ZooKeeper
    /// was away that long), every partition is given up and the worker joins again.
    pub async fn join(
        url: &ClusterUrl,
        worker_id: &str,
        session_timeout: Duration,
        store: &StateStore,
        pipeline: &str,
        partitions: u32,
    ) -> Result<Arc<ClusterLeases>, JoinError> {
        let args = JoinArgs {
            url: url.clone(),
            worker_id: worker_id.to_owned(),
            session_timeout,
            pipeline: pipeline.to_owned(),
            partitions,
        };
        let joined = args.connect().await?;
        let mirror = ZkMirror::new(
            joined.cluster.client().clone(),
            url.root(),
            pipeline,
            tokio::runtime::Handle::current(),
        )
        .and_then(|mirror| store.attach_mirror(mirror));
        mirror.map_err(|source| JoinError::Mirror {
            url: url.to_string(),
            source,
        })?;
        let (sender, receiver) = watch::channel(BTreeSet::new());
        let leases = Arc::new(ClusterLeases {
            cluster: RwLock::new(Arc::new(joined.cluster)),
            join: args,
            store: store.clone(),
            assigned: receiver,
            owned: Mutex::new(BTreeMap::new()),
        });
        tokio::spawn(follow(Arc::downgrade(&leases), joined.members, sender));
        info!(pipeline, worker = worker_id, cluster = %url, "joined the cluster");
        Ok(leases)
    }

    /// The state of this worker's current ZooKeeper session.
    pub fn session_status(&self) -> watch::Receiver<SessionStatus> {
        self.cluster().session_status()
    }

    fn cluster(&self) -> Arc<Cluster> {
        let current = self.cluster.read().unwrap_or_else(|p| p.into_inner());
        Arc::clone(&current)
    }

    fn owned(&self) -> MutexGuard<'_, BTreeMap<u32, Ownership>> {
        self.owned
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    fn lease_error(
        &self,
        partition: u32,
        reason: &str,
        source: impl std::error::Error + Send + Sync + 'static,
    ) -> LeaseError {
        LeaseError {
            partition,
            reason: format!(
                "{reason} ({} of pipeline `{}`)",
                self.join.url, self.join.pipeline
            ),
            source: Some(Box::new(source)),
        }
    }

    /// The members of the pipeline, watched anew on the current session, until it succeeds.
    async fn watch_members_again(&self) -> watch::Receiver<BTreeSet<String>> {
        loop {
            match self.cluster().members(&self.join.pipeline).await {
                Ok(members) => return members,
                Err(err) => {
                    warn!(pipeline = %self.join.pipeline, error = %err, "could not watch the cluster's members; trying again in 1 s");
                    tokio::time::sleep(REJOIN_PAUSE).await;
                }
            }
        }
    }

    /// Joins again with a new session after the previous one expired, until it succeeds.
    async fn rejoin(&self) -> watch::Receiver<BTreeSet<String>> {
        loop {
            match self.join.connect().await {
                Ok(joined) => {
                    if let Some(mirror) = self.store.mirror() {
                        mirror.replace_client(joined.cluster.client().clone());
                    }
                    let cluster = Arc::new(joined.cluster);
                    *self.cluster.write().unwrap_or_else(|p| p.into_inner()) = cluster;
                    info!(pipeline = %self.join.pipeline, worker = %self.join.worker_id, "joined the cluster again with a new session");
                    return joined.members;
                }
                Err(err) => {
                    warn!(pipeline = %self.join.pipeline, error = %err, "could not join the cluster again; trying again in 1 s (check that ZooKeeper answers)");
                    tokio::time::sleep(REJOIN_PAUSE).await;
                }
            }
        }
    }
}

impl JoinArgs {
    async fn connect(&self) -> Result<Joined, JoinError> {
        let cluster_error = |source| JoinError::Cluster {
            url: self.url.to_string(),
            source,
        };
        let cluster = Cluster::connect(&self.url, &self.worker_id, self.session_timeout)
            .await
            .map_err(cluster_error)?;
        cluster
            .agree_on_partitions(&self.pipeline, self.partitions)
            .await
            .map_err(cluster_error)?;
        cluster.join(&self.pipeline).await.map_err(cluster_error)?;
        let members = cluster
            .members(&self.pipeline)
            .await
            .map_err(cluster_error)?;
        Ok(Joined { cluster, members })
    }
}

/// Keeps `sender` at the partitions assigned to this worker among the live members. When the
/// session expires, the set empties (every runner stops; their commits are refused anyway) and
/// the worker joins again with a new session; it ends when the session was closed or the
/// leases are dropped.
async fn follow(
    leases: Weak<ClusterLeases>,
    mut members: watch::Receiver<BTreeSet<String>>,
    sender: watch::Sender<BTreeSet<u32>>,
) {
    loop {
        let Some(current) = leases.upgrade() else {
            return;
        };
        let mut status = current.session_status();
        let join = current.join.clone();
        drop(current);
        follow_members(
            &mut members,
            &mut status,
            join.partitions,
            &join.worker_id,
            &sender,
        )
        .await;
        // The members watch ends with the session, which the status may report a moment later.
        let ended = tokio::time::timeout(join.session_timeout * 2, async {
            // The guard `wait_for` returns is not `Send`: copy the state out.
            status.wait_for(|s| s.is_terminal()).await.map(|s| *s).ok()
        })
        .await;
        let Some(current) = leases.upgrade() else {
            return;
        };
        members = match ended {
            Ok(Some(SessionStatus::Closed)) => return,
            Ok(_) => {
                sender.send_replace(BTreeSet::new());
                warn!(pipeline = %join.pipeline, worker = %join.worker_id, "this worker's ZooKeeper session expired (frozen or cut off past the session timeout, or ZooKeeper away that long): its partitions were given up (their commits are refused); joining again");
                current.rejoin().await
            }
            // The session lives on: only the watch failed (logged); watch the members again.
            Err(_) => current.watch_members_again().await,
        };
    }
}

/// Keeps `sender` at the partitions rendezvous hashing gives `me` among the live members, until
/// the session ends (the members watch ends with it).
async fn follow_members(
    members: &mut watch::Receiver<BTreeSet<String>>,
    status: &mut watch::Receiver<SessionStatus>,
    partitions: u32,
    me: &str,
    sender: &watch::Sender<BTreeSet<u32>>,
) {
    loop {
        let mine = assigned(&members.borrow_and_update(), partitions, me);
        sender.send_if_modified(|current| {
            let changed = *current != mine;
            *current = mine;
            changed
        });
        tokio::select! {
            changed = members.changed() => if changed.is_err() { break },
            changed = status.changed() => {
                if changed.is_err() || status.borrow_and_update().is_terminal() {
                    break;
                }
            }
        }
    }
}

#[async_trait]
impl PartitionLeases for ClusterLeases {
    fn assigned(&self) -> watch::Receiver<BTreeSet<u32>> {
        self.assigned.clone()
    }

    async fn acquire(
        &self,
        partition: u32,
        mut cancel: watch::Receiver<bool>,
    ) -> Result<(), LeaseError> {
        let cancelled = async move {
            let _ = cancel.wait_for(|c| *c).await;
        };
        let taken = self
            .cluster()
            .acquire(&self.join.pipeline, partition, cancelled)
            .await
            .map_err(|e| self.lease_error(partition, "taking the lease", e))?;
        let Some(ownership) = taken else {
            return Err(LeaseError {
                partition,
                reason: "the lease request was cancelled".to_owned(),
                source: None,
            });
        };
        if let Some(mirror) = self.store.mirror() {
            mirror.own(
                partition,
                ownership.owner_path.clone(),
                ownership.generation,
            );
        }
        let generation = ownership.generation;
        self.owned().insert(partition, ownership);
        if let Err(err) = self
            .store
            .load_partition(&self.join.pipeline, partition)
            .await
        {
            self.release(partition).await;
            return Err(self.lease_error(
                partition,
                "loading the partition's state from ZooKeeper",
                err,
            ));
        }
        info!(pipeline = %self.join.pipeline, partition, generation, "took the partition's lease and loaded its state");
        Ok(())
    }

    async fn holds(&self, partition: u32) -> bool {
        let Some(generation) = self.owned().get(&partition).map(|o| o.generation) else {
            return false;
        };
        let cluster = self.cluster();
        match cluster.owners(&self.join.pipeline).await {
            Ok(owners) => owners.get(&partition).is_some_and(|owner| {
                owner.generation == generation
                    && owner.lease_holder.as_deref() == Some(cluster.worker_id())
            }),
            Err(err) => {
                warn!(pipeline = %self.join.pipeline, partition, error = %err, "could not read the partition's owner from ZooKeeper; taking it as lost");
                false
            }
        }
    }

    async fn leave(&self) {
        let cluster = self.cluster();
        // Bounded: with ZooKeeper away, the session's end does the same later, and the stop must
        // not wait for it.
        let left = tokio::time::timeout(
            self.join.session_timeout,
            cluster.leave(&self.join.pipeline),
        );
        let failure = match left.await {
            Ok(Ok(())) => {
                info!(pipeline = %self.join.pipeline, worker = %self.join.worker_id, "left the cluster's members: the other workers take this worker's partitions as it hands them over");
                return;
            }
            Ok(Err(err)) => err.to_string(),
            Err(_) => format!(
                "ZooKeeper did not answer within {:?}",
                self.join.session_timeout
            ),
        };
        warn!(pipeline = %self.join.pipeline, error = %failure, "could not leave the cluster's members; the other workers take this worker's partitions once its ZooKeeper session ends");
    }

    async fn release(&self, partition: u32) {
        if let Some(mirror) = self.store.mirror() {
            mirror.disown(partition);
        }
        let ownership = self.owned().remove(&partition);
        let cluster = self.cluster();
        let released = match &ownership {
            Some(ownership) => cluster.release(ownership).await,
            None => {
                cluster
                    .release_partition(&self.join.pipeline, partition)
                    .await
            }
        };
        if let Err(err) = released {
            warn!(pipeline = %self.join.pipeline, partition, error = %err, "could not give the partition's lease back; it is freed when this worker's ZooKeeper session ends");
        }
    }
}
