//! The `nats_jetstream` source: flow partition `i` reads the messages of one subject of a JetStream
//! stream, in stream order. The position is the stream sequence of the last message read, committed
//! in the outbox with the epoch; nothing is acknowledged to the server (the consumer is ephemeral,
//! `AckPolicy::None`), so the outbox alone says where to resume. Each reader creates its consumer
//! at `position + 1` filtered by its subject and keeps one long-lived pull on it (heartbeats,
//! continuous prefetch) across reads; a read takes messages until the epoch's limits and never
//! waits for the server to end a pull request. After any error, or a pull that went silent (no
//! message and no heartbeat for the stall grace), it drops the consumer and creates it again at
//! the last sequence read + 1: a server restart or a dropped connection costs neither a gap nor a
//! duplicate.
//!
//! `params`: the parameters and their validation; `reader`: one partition's reader; `auth`:
//! authentication and TLS; `position`: the committed position and the stream's identity in it;
//! `reply`: the stream sequence (and, when needed, the pending count and timestamp) from a
//! message's reply subject; `error`: [`NatsSourceError`].

mod auth;
mod error;
mod params;
mod position;
mod reader;
mod reply;

pub use auth::NatsAuth;
pub use error::{NatsSourceError, StreamRefusal};
pub use params::NatsJetStreamParams;
pub(crate) use params::{build, default_max_messages_per_pull};
pub use reply::ReplyError;
