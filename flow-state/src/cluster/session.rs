//! The worker's ZooKeeper session: [`Cluster`] opens it, creates the root node, reports its
//! status ([`SessionStatus`]), and brings a request through a lost connection.

use std::sync::Mutex;
use std::time::Duration;

use tokio::sync::watch;
use tokio::task::JoinHandle;
use zookeeper_client as zk;

use super::error::ClusterError;
use super::paths::check_name;
use super::status::SessionStatus;
use super::url::ClusterUrl;

/// The session timeout asked for when the caller has no other: a worker that dies (or stops)
/// loses its partitions within this time.
pub const DEFAULT_SESSION_TIMEOUT: Duration = Duration::from_secs(10);

/// How long a request waits before it is retried after a lost connection: the client may report
/// the loss a moment after the failed request, and without a pause the retry would spin on it.
const RETRY_PAUSE: Duration = Duration::from_millis(50);

/// One worker's session with the cluster's ZooKeeper: membership ([`join`](Cluster::join),
/// [`members`](Cluster::members)) and partition ownership ([`acquire`](Cluster::acquire),
/// [`release`](Cluster::release), [`owners`](Cluster::owners)).
///
/// Dropping it (or [`close`](Cluster::close)) stops its watches and closes the session, which
/// deletes its member node and leases at once, unless a clone of [`client`](Cluster::client) is
/// still alive.
#[derive(Debug)]
pub struct Cluster {
    pub(super) client: zk::Client,
    url: ClusterUrl,
    worker_id: String,
    status: watch::Receiver<SessionStatus>,
    /// The watch tasks (members): each holds a clone of the client, so they are aborted when the
    /// cluster is dropped, or the session would outlive it. The task that forwards the session
    /// status holds no client and ends by itself after the terminal status, which lets
    /// [`close`](Cluster::close) wait for it.
    tasks: Mutex<Vec<JoinHandle<()>>>,
}

impl Cluster {
    /// Opens a session (`session_timeout`: asked for; [`DEFAULT_SESSION_TIMEOUT`] unless the
    /// operator chose another, and the server bounds it to 2 to 20 of its ticks) with the servers
    /// of `url`, as worker `worker_id`, and creates the root node (persistent) if missing.
    /// Connecting is given `session_timeout` to succeed.
    pub async fn connect(
        url: &ClusterUrl,
        worker_id: &str,
        session_timeout: Duration,
    ) -> Result<Cluster, ClusterError> {
        check_name("worker id", worker_id)?;
        if session_timeout.is_zero() {
            return Err(ClusterError::ZeroSessionTimeout {
                default: DEFAULT_SESSION_TIMEOUT,
            });
        }
        let client = zk::Client::connector()
            .with_session_timeout(session_timeout)
            .connect(&url.connect_string())
            .await
            .map_err(|source| ClusterError::Connect {
                url: url.to_string(),
                timeout: session_timeout,
                source,
            })?;
        // The state now (the session may have been lost already), then every change after it.
        let mut states = client.state_watcher();
        let now = SessionStatus::from_zookeeper(states.peek_state());
        let (sender, status) = watch::channel(now);
        if !now.is_terminal() {
            tokio::spawn(async move {
                loop {
                    let status = SessionStatus::from_zookeeper(states.changed().await);
                    sender.send_replace(status);
                    // The client reports nothing after a terminal state.
                    if status.is_terminal() {
                        break;
                    }
                }
            });
        }
        let cluster = Cluster {
            client,
            url: url.clone(),
            worker_id: worker_id.to_owned(),
            status,
            tasks: Mutex::new(Vec::new()),
        };
        cluster.make_dir(url.root()).await?;
        tracing::info!(
            url = %url,
            worker = worker_id,
            session = %cluster.client.session_id(),
            session_timeout = ?cluster.client.session_timeout(),
            "ZooKeeper session opened"
        );
        Ok(cluster)
    }

    /// The cluster URL.
    pub fn url(&self) -> &ClusterUrl {
        &self.url
    }

    /// This worker's id.
    pub fn worker_id(&self) -> &str {
        &self.worker_id
    }

    /// The session timeout the server granted.
    pub fn session_timeout(&self) -> Duration {
        self.client.session_timeout()
    }

    /// The session's status, kept current. Its sender is dropped after a terminal status
    /// (`Expired`, `Closed`): `changed()` then fails and `borrow()` keeps the terminal status.
    pub fn session_status(&self) -> watch::Receiver<SessionStatus> {
        self.status.clone()
    }

    /// The session's client, for the partition state kept in the same session (fencing checks
    /// ride in its multi-ops). A clone kept alive keeps the session open after the cluster is
    /// dropped.
    pub fn client(&self) -> &zk::Client {
        &self.client
    }

    /// Stops the watches and closes the session, and waits (at most the session timeout) until
    /// the server confirmed it: then the member node and leases are deleted.
    pub async fn close(self) {
        let mut status = self.status.clone();
        let session_timeout = self.session_timeout();
        drop(self);
        // A close that the server does not confirm in time ends in expiry at the server anyway.
        let _ = tokio::time::timeout(
            session_timeout,
            status.wait_for(|status| status.is_terminal()),
        )
        .await;
    }

    /// Spawns a task that lives as long as this cluster.
    pub(super) fn spawn(&self, task: impl std::future::Future<Output = ()> + Send + 'static) {
        let handle = tokio::spawn(task);
        match self.tasks.lock() {
            Ok(mut tasks) => {
                tasks.retain(|task| !task.is_finished());
                tasks.push(handle);
            }
            // A panic while the list was held cannot leave it inconsistent (push and retain
            // only); the task is still ended with the cluster.
            Err(poisoned) => poisoned.into_inner().push(handle),
        }
    }

    /// Creates `path` and its missing parents as persistent nodes.
    pub(super) async fn make_dir(&self, path: &str) -> Result<(), ClusterError> {
        let options = zk::CreateMode::Persistent.with_acls(zk::Acls::anyone_all());
        loop {
            match self.client.mkdir(path, &options).await {
                Ok(()) => return Ok(()),
                Err(error) => self.recover("create", path, error).await?,
            }
        }
    }

    /// After a failed request: for a lost connection, waits until the session is connected again
    /// (the caller then retries); every other error is returned as the caller's.
    pub(super) async fn recover(
        &self,
        op: &'static str,
        path: &str,
        error: zk::Error,
    ) -> Result<(), ClusterError> {
        recover(&self.status, &self.worker_id, op, path, error).await
    }
}

/// [`Cluster::recover`] for a watch task, which has no `Cluster`.
pub(super) async fn recover(
    status: &watch::Receiver<SessionStatus>,
    worker_id: &str,
    op: &'static str,
    path: &str,
    error: zk::Error,
) -> Result<(), ClusterError> {
    let ended = |status: SessionStatus| ClusterError::SessionEnded {
        worker_id: worker_id.to_owned(),
        status,
        op,
        path: path.to_owned(),
    };
    match error {
        zk::Error::ConnectionLoss => {
            tokio::time::sleep(RETRY_PAUSE).await;
            let mut status = status.clone();
            // The status sender is dropped only after a terminal status, which the predicate
            // accepts, so the wait cannot fail for want of a sender.
            let now = status
                .wait_for(|status| *status != SessionStatus::Disconnected)
                .await
                .map(|status| *status)
                .unwrap_or(SessionStatus::Expired);
            if now.is_terminal() {
                Err(ended(now))
            } else {
                Ok(())
            }
        }
        zk::Error::SessionExpired | zk::Error::AuthFailed => Err(ended(SessionStatus::Expired)),
        zk::Error::ClientClosed => Err(ended(SessionStatus::Closed)),
        source => Err(ClusterError::ZooKeeper {
            op,
            path: path.to_owned(),
            source,
        }),
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        let tasks = match self.tasks.get_mut() {
            Ok(tasks) => tasks,
            Err(poisoned) => poisoned.into_inner(),
        };
        for task in tasks.drain(..) {
            task.abort();
        }
    }
}
