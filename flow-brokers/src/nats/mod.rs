//! The `nats_jetstream` source: flow partition `i` reads the messages of one subject of a JetStream
//! stream, in stream order. The position is the stream sequence of the last message read, committed
//! in the outbox with the epoch; nothing is acknowledged to the server (the consumer is ephemeral,
//! `AckPolicy::None`), so the outbox alone says where to resume. Each reader creates its consumer
//! at `position + 1` filtered by its subject, pulls in requests that expire by the epoch's
//! deadline, and after any error drops the consumer and creates it again at the last sequence
//! read + 1: a server restart or a dropped connection costs neither a gap nor a duplicate.
//!
//! `params`: the parameters and their validation; `reader`: one partition's reader; `auth`:
//! authentication and TLS; `position`: the committed position and the stream's identity in it;
//! `error`: [`NatsSourceError`].

mod auth;
mod error;
mod params;
mod position;
mod reader;

pub use auth::NatsAuth;
pub use error::{NatsSourceError, StreamRefusal};
pub use params::NatsJetStreamParams;
pub(crate) use params::{build, default_max_messages_per_pull};
