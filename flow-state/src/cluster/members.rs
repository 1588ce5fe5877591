//! Membership: each worker of a pipeline holds the ephemeral `<root>/<pipeline>/members/<id>`
//! node for as long as its session lives, and every worker watches the set of members.

use std::collections::BTreeSet;

use tokio::sync::watch;
use zookeeper_client as zk;

use super::error::ClusterError;
use super::paths;
use super::session::{recover, Cluster};
use super::status::SessionStatus;

impl Cluster {
    /// Registers this worker as a member of `pipeline` (its ephemeral member node). Joining again
    /// in the same session is a no-op; a worker id held by another live session is refused
    /// ([`ClusterError::DuplicateMember`]).
    pub async fn join(&self, pipeline: &str) -> Result<(), ClusterError> {
        paths::check_name("pipeline name", pipeline)?;
        let root = self.url().root();
        self.make_dir(&paths::members_dir(root, pipeline)).await?;
        let path = paths::member(root, pipeline, self.worker_id());
        let options = zk::CreateMode::Ephemeral.with_acls(zk::Acls::anyone_all());
        loop {
            match self.client.create(&path, &[], &options).await {
                Ok(_) => break,
                Err(zk::Error::NodeExists) => match self.client.check_stat(&path).await {
                    // Ours: a create whose answer was lost with the connection, or a second join.
                    Ok(Some(stat)) if stat.ephemeral_owner == self.client.session_id().0 => break,
                    Ok(Some(_)) => {
                        return Err(ClusterError::DuplicateMember {
                            worker_id: self.worker_id().to_owned(),
                            pipeline: pipeline.to_owned(),
                            path,
                            session_timeout: self.session_timeout(),
                        })
                    }
                    // Gone since (that session ended): create it again.
                    Ok(None) => {}
                    Err(error) => self.recover("stat", &path, error).await?,
                },
                Err(error) => self.recover("create", &path, error).await?,
            }
        }
        tracing::info!(
            pipeline,
            worker = self.worker_id(),
            "joined the pipeline's members"
        );
        Ok(())
    }

    /// Deletes this worker's member node of `pipeline`, if this session holds it: the other
    /// workers see it leave at once instead of after the session timeout.
    pub async fn leave(&self, pipeline: &str) -> Result<(), ClusterError> {
        paths::check_name("pipeline name", pipeline)?;
        let path = paths::member(self.url().root(), pipeline, self.worker_id());
        self.delete_if_ours(&path).await?;
        Ok(())
    }

    /// The live members of `pipeline` (worker ids), kept current through a ZooKeeper watch that
    /// is armed again after every change and lives through lost connections. The sender is
    /// dropped (`changed()` fails) when the session ends, when this cluster is dropped, or when
    /// the watch fails otherwise (logged).
    pub async fn members(
        &self,
        pipeline: &str,
    ) -> Result<watch::Receiver<BTreeSet<String>>, ClusterError> {
        paths::check_name("pipeline name", pipeline)?;
        let dir = paths::members_dir(self.url().root(), pipeline);
        self.make_dir(&dir).await?;
        let watcher = MembersWatch {
            client: self.client.clone(),
            status: self.session_status(),
            worker_id: self.worker_id().to_owned(),
            dir,
        };
        let (first, armed) = loop {
            match watcher.list().await {
                Ok(listed) => break listed,
                Err(error) => self.recover("list children", &watcher.dir, error).await?,
            }
        };
        let (sender, receiver) = watch::channel(first);
        self.spawn(watcher.run(sender, armed));
        Ok(receiver)
    }

    /// The live members of `pipeline` now, read once (what `flow-worker status` shows); empty
    /// when no worker ever joined. Creates nothing.
    pub async fn member_list(&self, pipeline: &str) -> Result<BTreeSet<String>, ClusterError> {
        paths::check_name("pipeline name", pipeline)?;
        let dir = paths::members_dir(self.url().root(), pipeline);
        loop {
            match self.client.list_children(&dir).await {
                Ok(children) => return Ok(children.into_iter().collect()),
                Err(zk::Error::NoNode) => return Ok(BTreeSet::new()),
                Err(error) => self.recover("list children", &dir, error).await?,
            }
        }
    }

    /// Deletes an ephemeral node if this session holds it; `false` if it is gone or another
    /// session's.
    pub(super) async fn delete_if_ours(&self, path: &str) -> Result<bool, ClusterError> {
        loop {
            let stat = match self.client.check_stat(path).await {
                Ok(stat) => stat,
                Err(error) => {
                    self.recover("stat", path, error).await?;
                    continue;
                }
            };
            match stat {
                Some(stat) if stat.ephemeral_owner == self.client.session_id().0 => {}
                _ => return Ok(false),
            }
            // Only this session deletes its ephemeral node (or its end does), so it is still ours.
            match self.client.delete(path, None).await {
                Ok(()) => return Ok(true),
                Err(zk::Error::NoNode) => return Ok(false),
                Err(error) => self.recover("delete", path, error).await?,
            }
        }
    }
}

/// What the members watch task holds: its own clone of the client (the task is aborted with
/// the cluster).
struct MembersWatch {
    client: zk::Client,
    status: watch::Receiver<SessionStatus>,
    worker_id: String,
    dir: String,
}

impl MembersWatch {
    /// The members now, and the watch armed by the same read (so no change falls between them):
    /// of the members node's children, or of its creation after it was deleted (by hand, or a
    /// test's clean-up).
    async fn list(&self) -> Result<(BTreeSet<String>, zk::OneshotWatcher), zk::Error> {
        match self.client.list_and_watch_children(&self.dir).await {
            Ok((children, watcher)) => Ok((children.into_iter().collect(), watcher)),
            Err(zk::Error::NoNode) => match self.client.check_and_watch_stat(&self.dir).await? {
                // Created between the two reads: list again.
                (Some(_), _) => Box::pin(self.list()).await,
                (None, watcher) => Ok((BTreeSet::new(), watcher)),
            },
            Err(error) => Err(error),
        }
    }

    async fn run(self, sender: watch::Sender<BTreeSet<String>>, mut armed: zk::OneshotWatcher) {
        loop {
            let event = armed.changed().await;
            // A oneshot watch sees no lost connection (the client arms it again on reconnecting,
            // and the server fires it if the node changed meanwhile); it sees the session's end.
            if event.event_type == zk::EventType::Session && event.session_state.is_terminated() {
                tracing::info!(dir = %self.dir, state = %event.session_state, "members watch ends with the session");
                return;
            }
            armed = loop {
                match self.list().await {
                    Ok((members, armed)) => {
                        sender.send_if_modified(|current| {
                            let changed = *current != members;
                            *current = members;
                            changed
                        });
                        break armed;
                    }
                    Err(error) => {
                        if let Err(error) = recover(
                            &self.status,
                            &self.worker_id,
                            "list children",
                            &self.dir,
                            error,
                        )
                        .await
                        {
                            if !matches!(error, ClusterError::SessionEnded { .. }) {
                                tracing::warn!(error = %error, "the members watch stopped: this worker no longer follows joins and leaves; restart it");
                            }
                            return;
                        }
                    }
                }
            };
        }
    }
}
