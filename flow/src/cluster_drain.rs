//! Cluster mode for `drain`: one process takes the lease of every partition of a stopped
//! pipeline, loads each partition's state from ZooKeeper, and so can deliver what the workers
//! left pending, with every acknowledgement fenced like a worker's.

use std::collections::BTreeSet;
use std::time::Duration;

use flow_state::cluster::{Cluster, ClusterError, ClusterUrl, Ownership};
use flow_state::zk::ZkMirror;
use flow_state::{StateError, StateStore};
use tracing::{info, warn};

/// Why the partitions of a pipeline could not all be taken for a drain.
#[derive(Debug, thiserror::Error)]
pub enum DrainLeaseError {
    /// ZooKeeper refused or could not be reached.
    #[error("taking the partitions of pipeline `{pipeline}` at {url}")]
    Cluster {
        /// The cluster URL.
        url: String,
        /// The pipeline.
        pipeline: String,
        /// The cause.
        #[source]
        source: ClusterError,
    },
    /// Workers still run the pipeline: they deliver what is pending themselves, and a drain
    /// would fight them for the leases.
    #[error("workers still run pipeline `{pipeline}` at {url}: {}; stop every worker of the pipeline (SIGTERM) before a drain", members.iter().cloned().collect::<Vec<_>>().join(", "))]
    WorkersRunning {
        /// The cluster URL.
        url: String,
        /// The pipeline.
        pipeline: String,
        /// The live members.
        members: BTreeSet<String>,
    },
    /// A lease stayed held by another session (a worker killed less than a session timeout ago
    /// keeps it until its session expires).
    #[error("partition {partition} of pipeline `{pipeline}` stayed leased by another session for {waited:?}; a worker killed just now keeps its leases for its session timeout: run the drain again, or check that no worker of the pipeline runs")]
    StillLeased {
        /// The pipeline.
        pipeline: String,
        /// The partition.
        partition: u32,
        /// How long the drain waited.
        waited: Duration,
    },
    /// The store refused the ZooKeeper mirror or a partition's state.
    #[error("loading the state of pipeline `{pipeline}` from ZooKeeper")]
    State {
        /// The pipeline.
        pipeline: String,
        /// The cause.
        #[source]
        source: StateError,
    },
}

/// Every partition of a pipeline, held by this process for a drain.
pub struct DrainLeases {
    cluster: Cluster,
    owned: Vec<Ownership>,
}

impl DrainLeases {
    /// Connects to `url`, checks that no worker runs `pipeline`, and takes the lease of each of
    /// its `partitions` (waiting at most `wait` for each: a killed worker's session holds its
    /// leases until it expires), fencing `store`'s commits with them and loading each
    /// partition's state from ZooKeeper into `store`.
    pub async fn take_all(
        url: &ClusterUrl,
        session_timeout: Duration,
        store: &StateStore,
        pipeline: &str,
        partitions: u32,
        wait: Duration,
    ) -> Result<DrainLeases, DrainLeaseError> {
        let cluster_error = |source| DrainLeaseError::Cluster {
            url: url.to_string(),
            pipeline: pipeline.to_owned(),
            source,
        };
        let id = format!("drain-{}", std::process::id());
        let cluster = Cluster::connect(url, &id, session_timeout)
            .await
            .map_err(cluster_error)?;
        let members = cluster.member_list(pipeline).await.map_err(cluster_error)?;
        if !members.is_empty() {
            cluster.close().await;
            return Err(DrainLeaseError::WorkersRunning {
                url: url.to_string(),
                pipeline: pipeline.to_owned(),
                members,
            });
        }
        let state_error = |source| DrainLeaseError::State {
            pipeline: pipeline.to_owned(),
            source,
        };
        let mirror = ZkMirror::new(
            cluster.client().clone(),
            url.root(),
            pipeline,
            tokio::runtime::Handle::current(),
        )
        .map_err(state_error)?;
        store.attach_mirror(mirror).map_err(state_error)?;
        let mut held = DrainLeases {
            cluster,
            owned: Vec::new(),
        };
        for partition in 0..partitions {
            if let Err(err) = held.take(store, pipeline, partition, wait).await {
                held.release_all(store).await;
                return Err(err);
            }
        }
        info!(
            pipeline,
            partitions, "took every partition's lease for the drain"
        );
        Ok(held)
    }

    async fn take(
        &mut self,
        store: &StateStore,
        pipeline: &str,
        partition: u32,
        wait: Duration,
    ) -> Result<(), DrainLeaseError> {
        let taken = self
            .cluster
            .acquire(pipeline, partition, tokio::time::sleep(wait))
            .await
            .map_err(|source| DrainLeaseError::Cluster {
                url: self.cluster.url().to_string(),
                pipeline: pipeline.to_owned(),
                source,
            })?;
        let Some(ownership) = taken else {
            return Err(DrainLeaseError::StillLeased {
                pipeline: pipeline.to_owned(),
                partition,
                waited: wait,
            });
        };
        if let Some(mirror) = store.mirror() {
            mirror.own(
                partition,
                ownership.owner_path.clone(),
                ownership.generation,
            );
        }
        self.owned.push(ownership);
        store
            .load_partition(pipeline, partition)
            .await
            .map_err(|source| DrainLeaseError::State {
                pipeline: pipeline.to_owned(),
                source,
            })
    }

    /// Gives every lease back and closes the session.
    pub async fn release_all(mut self, store: &StateStore) {
        for ownership in std::mem::take(&mut self.owned) {
            if let Some(mirror) = store.mirror() {
                mirror.disown(ownership.partition);
            }
            if let Err(err) = self.cluster.release(&ownership).await {
                warn!(partition = ownership.partition, error = %err, "could not give the partition's lease back; it is freed when the drain's ZooKeeper session ends");
            }
        }
        self.cluster.close().await;
    }
}
