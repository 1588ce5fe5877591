//! Partition ownership: a worker owns a partition while its session holds the ephemeral lease
//! `<root>/<pipeline>/partitions/<p>/lease`; taking it bumps the version of the persistent owner
//! node `.../owner` (data = worker id), and that version is the owner's generation. The lease
//! creation and the bump are one multi-op, so a lease is never held without its bump. Every
//! commit of the partition's state checks the owner node's version against the generation, so a
//! worker whose lease went with its session (a zombie) is refused as soon as another took over.

use std::collections::BTreeMap;
use std::future::Future;

use zookeeper_client as zk;

use super::error::ClusterError;
use super::paths;
use super::session::Cluster;

/// A partition this worker owns, as [`Cluster::acquire`] returned it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Ownership {
    /// The pipeline.
    pub pipeline: String,
    /// The partition.
    pub partition: u32,
    /// The owner node, whose version every commit of the partition checks.
    pub owner_path: String,
    /// The lease node this worker's session holds.
    pub lease_path: String,
    /// The owner node's version when this worker took the partition.
    pub generation: i32,
}

/// A partition's owner as ZooKeeper has it (`flow-worker status`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OwnerStatus {
    /// The worker that took the partition last (the owner node's data).
    pub worker_id: String,
    /// Its generation (the owner node's version).
    pub generation: i32,
    /// The worker whose live session holds the lease; `None` when no one does (the last owner
    /// released it or its session ended).
    pub lease_holder: Option<String>,
}

impl Cluster {
    /// Takes `partition` of `pipeline`: creates the ephemeral lease and bumps the owner node in
    /// one multi-op, and returns the new generation. While another live session holds the lease
    /// it waits (a ZooKeeper watch on the lease) until that owner releases it or its session
    /// ends. `cancel` ends any wait (that one, or one for a lost connection) with `Ok(None)`, and
    /// nothing is taken: the take itself, once sent, is not cancelled, so that a lease is never
    /// held by a caller that was told it got nothing. A lease this session already holds is
    /// returned as it is (same generation).
    pub async fn acquire(
        &self,
        pipeline: &str,
        partition: u32,
        cancel: impl Future<Output = ()>,
    ) -> Result<Option<Ownership>, ClusterError> {
        paths::check_name("pipeline name", pipeline)?;
        let dir = paths::partition_dir(self.url().root(), pipeline, partition);
        let (owner_path, lease_path) = (paths::owner(&dir), paths::lease(&dir));
        tokio::pin!(cancel);
        let prepare = async {
            self.make_dir(&dir).await?;
            self.create_owner_node(&owner_path).await
        };
        tokio::select! {
            prepared = prepare => prepared?,
            () = &mut cancel => return Ok(None),
        }
        let ownership = |generation| Ownership {
            pipeline: pipeline.to_owned(),
            partition,
            owner_path: owner_path.clone(),
            lease_path: lease_path.clone(),
            generation,
        };
        let worker_id = self.worker_id().as_bytes();
        loop {
            let mut take = self.client.new_multi_writer();
            let ephemeral = zk::CreateMode::Ephemeral.with_acls(zk::Acls::anyone_all());
            take.add_create(&lease_path, worker_id, &ephemeral)
                .and_then(|()| take.add_set_data(&owner_path, worker_id, None))
                .map_err(|source| ClusterError::ZooKeeper {
                    op: "prepare take of",
                    path: lease_path.clone(),
                    source,
                })?;
            let error = match take.commit().await {
                Ok(results) => match results.get(1) {
                    Some(zk::MultiWriteResult::SetData { stat }) => {
                        tracing::info!(
                            pipeline,
                            partition,
                            generation = stat.version,
                            "took the partition"
                        );
                        return Ok(Some(ownership(stat.version)));
                    }
                    _ => zk::Error::UnexpectedError(format!(
                        "the take multi-op answered {results:?} instead of a create and a set"
                    )),
                },
                // The lease is held: by this session (a take whose answer was lost with the
                // connection, or a second acquire), or by another.
                Err(zk::MultiWriteError::OperationFailed {
                    index: 0,
                    source: zk::Error::NodeExists,
                }) => {
                    let (holder, watcher) = tokio::select! {
                        found = self.watch_lease(&lease_path) => found?,
                        () = &mut cancel => return Ok(None),
                    };
                    match holder {
                        None => continue,
                        Some(stat) if stat.ephemeral_owner == self.client.session_id().0 => {
                            let generation = self.generation(&owner_path).await?;
                            return Ok(Some(ownership(generation)));
                        }
                        Some(_) => {}
                    }
                    tracing::debug!(
                        pipeline,
                        partition,
                        "the partition's lease is held by another worker; waiting for it"
                    );
                    let event = tokio::select! {
                        event = watcher.changed() => event,
                        () = &mut cancel => return Ok(None),
                    };
                    match event.session_state {
                        zk::SessionState::Closed => zk::Error::ClientClosed,
                        state if state.is_terminated() => zk::Error::SessionExpired,
                        // The lease was deleted (or changed): try again.
                        _ => continue,
                    }
                }
                // The owner node was deleted under us (by hand): make it again.
                Err(zk::MultiWriteError::OperationFailed {
                    index: 1,
                    source: zk::Error::NoNode,
                }) => {
                    self.create_owner_node(&owner_path).await?;
                    continue;
                }
                Err(error) => error.into(),
            };
            tokio::select! {
                recovered = self.recover("take", &lease_path, error) => recovered?,
                () = &mut cancel => return Ok(None),
            }
        }
    }

    /// Lets `ownership` go: deletes the lease if this session still holds it (`true`); `false`
    /// when it is gone already (the session ended) or another's. The owner node keeps its
    /// version, so the next taker's generation is higher.
    pub async fn release(&self, ownership: &Ownership) -> Result<bool, ClusterError> {
        let released = self.delete_if_ours(&ownership.lease_path).await?;
        tracing::info!(
            pipeline = %ownership.pipeline,
            partition = ownership.partition,
            generation = ownership.generation,
            released,
            "let the partition go"
        );
        Ok(released)
    }

    /// Every partition of `pipeline` that was ever taken: its last owner, generation and the
    /// current lease holder.
    pub async fn owners(&self, pipeline: &str) -> Result<BTreeMap<u32, OwnerStatus>, ClusterError> {
        paths::check_name("pipeline name", pipeline)?;
        let parent = paths::partitions_dir(self.url().root(), pipeline);
        let children = loop {
            match self.client.list_children(&parent).await {
                Ok(children) => break children,
                Err(zk::Error::NoNode) => return Ok(BTreeMap::new()),
                Err(error) => self.recover("list children", &parent, error).await?,
            }
        };
        let mut owners = BTreeMap::new();
        for child in children {
            let partition = child
                .parse::<u32>()
                .map_err(|_| ClusterError::UnexpectedNode {
                    path: format!("{parent}/{child}"),
                    parent: parent.clone(),
                })?;
            let dir = format!("{parent}/{child}");
            let Some((worker_id, generation)) = self.read_owner(&paths::owner(&dir)).await? else {
                continue;
            };
            let lease_holder = self.read_lease(&paths::lease(&dir)).await?;
            owners.insert(
                partition,
                OwnerStatus {
                    worker_id,
                    generation,
                    lease_holder,
                },
            );
        }
        Ok(owners)
    }

    /// Creates the owner node at version 0 with no data, so that the first take makes
    /// generation 1.
    async fn create_owner_node(&self, owner_path: &str) -> Result<(), ClusterError> {
        let options = zk::CreateMode::Persistent.with_acls(zk::Acls::anyone_all());
        loop {
            match self.client.create(owner_path, &[], &options).await {
                Ok(_) | Err(zk::Error::NodeExists) => return Ok(()),
                Err(error) => self.recover("create", owner_path, error).await?,
            }
        }
    }

    /// The lease's stat (`None`: no one holds it), with a watch of its deletion.
    async fn watch_lease(
        &self,
        lease_path: &str,
    ) -> Result<(Option<zk::Stat>, zk::OneshotWatcher), ClusterError> {
        loop {
            match self.client.check_and_watch_stat(lease_path).await {
                Ok(found) => return Ok(found),
                Err(error) => self.recover("watch", lease_path, error).await?,
            }
        }
    }

    /// The owner node's version, for a lease this session holds: only a lease holder bumps the
    /// owner node, so it is still this session's generation.
    async fn generation(&self, owner_path: &str) -> Result<i32, ClusterError> {
        loop {
            match self.client.get_data(owner_path).await {
                Ok((_, stat)) => return Ok(stat.version),
                Err(error) => self.recover("read", owner_path, error).await?,
            }
        }
    }

    /// The owner node's worker id and version; `None` if it is missing or was never taken.
    async fn read_owner(&self, owner_path: &str) -> Result<Option<(String, i32)>, ClusterError> {
        loop {
            match self.client.get_data(owner_path).await {
                Ok((_, stat)) if stat.version == 0 => return Ok(None),
                Ok((data, stat)) => {
                    return Ok(Some((
                        String::from_utf8_lossy(&data).into_owned(),
                        stat.version,
                    )))
                }
                Err(zk::Error::NoNode) => return Ok(None),
                Err(error) => self.recover("read", owner_path, error).await?,
            }
        }
    }

    /// The worker id in the lease, if a live session holds it.
    async fn read_lease(&self, lease_path: &str) -> Result<Option<String>, ClusterError> {
        loop {
            match self.client.get_data(lease_path).await {
                Ok((data, _)) => return Ok(Some(String::from_utf8_lossy(&data).into_owned())),
                Err(zk::Error::NoNode) => return Ok(None),
                Err(error) => self.recover("read", lease_path, error).await?,
            }
        }
    }
}

impl Cluster {
    /// Lets `partition` of `pipeline` go without its [`Ownership`] (a request for it abandoned
    /// while it may just have been granted): deletes the lease if this session holds it.
    pub async fn release_partition(
        &self,
        pipeline: &str,
        partition: u32,
    ) -> Result<bool, ClusterError> {
        paths::check_name("pipeline name", pipeline)?;
        let dir = paths::partition_dir(self.url().root(), pipeline, partition);
        self.delete_if_ours(&paths::lease(&dir)).await
    }
}
