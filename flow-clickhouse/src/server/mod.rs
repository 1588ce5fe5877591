//! The server: HTTP clients and TLS, error classification, the writer session and its checks.

pub(crate) mod auto_add;
pub(crate) mod classify;
pub(crate) mod client;
pub(crate) mod columns_guard;
pub(crate) mod dedup_window;
pub(crate) mod late_hosts;
pub(crate) mod probe;
pub(crate) mod protocol;
pub(crate) mod schema_change;
pub(crate) mod session;
pub(crate) mod survey;
pub(crate) mod tls;
