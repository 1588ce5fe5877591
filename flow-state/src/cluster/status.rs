//! [`SessionStatus`]: what the runtime needs to know of the worker's ZooKeeper session.

use zookeeper_client as zk;

/// The state of the worker's ZooKeeper session, as [`Cluster::session_status`](super::Cluster::session_status) reports it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SessionStatus {
    /// Connected: requests are served, and the member node and leases are held.
    Connected,
    /// The connection was lost. The session (and its ephemeral nodes) lives on for up to its
    /// timeout while the client reconnects; what it owns may be taken over meanwhile, so the
    /// runtime stops sending until the status is `Connected` again.
    Disconnected,
    /// The session is gone for good: expired on the server (or refused its authentication). Its
    /// member node and leases are deleted; connect a new [`Cluster`](super::Cluster) and join again.
    Expired,
    /// The session was closed by this process ([`Cluster::close`](super::Cluster::close)).
    Closed,
}

impl SessionStatus {
    /// Whether the session can never be used again.
    pub fn is_terminal(self) -> bool {
        matches!(self, SessionStatus::Expired | SessionStatus::Closed)
    }

    pub(super) fn from_zookeeper(state: zk::SessionState) -> SessionStatus {
        match state {
            // Read-only sessions are not asked for (`with_readonly` stays off), so a connected
            // session is a read-write one.
            zk::SessionState::SyncConnected | zk::SessionState::ConnectedReadOnly => {
                SessionStatus::Connected
            }
            zk::SessionState::Disconnected => SessionStatus::Disconnected,
            zk::SessionState::Closed => SessionStatus::Closed,
            zk::SessionState::Expired | zk::SessionState::AuthFailed => SessionStatus::Expired,
        }
    }
}
