//! flow-brokers: sources that read a message broker from the positions flow commits.
//!
//! Layout:
//! - `register`: [`register`] puts both classes into a registry.
//! - `broker_source`: what both sources share (common setters, the generic factory, the paced
//!   wait after broker trouble); `builder`: the typed configuration of both.
//! - `nats/`: the `nats_jetstream` source: `params` (parameters, validation), `reader` (the
//!   long-lived pull of each partition), `reply` (the stream sequence from a message's reply
//!   subject), `position`, `auth` (authentication and TLS), `error` ([`NatsSourceError`]).
//! - `kafka/`: the `kafka` source: `params` (parameters, validation, consumer configuration),
//!   `reader`, `error` ([`KafkaSourceError`]).
//!
//! Each source is replayable: its position is the broker's own (a JetStream stream sequence, a
//! Kafka offset), committed in flow's outbox together with the epoch's sealed batches, and never
//! acknowledged to the broker as the source of truth. A restart, or the rebuild of a pending batch, re-reads the
//! broker from there; rows are decoded by flow-core's broker formats
//! ([`flow_core::sources::BrokerFormat`]).
//!
//! - [`nats_jetstream`](NatsJetStreamParams): one subject of a JetStream stream per partition.
//! - [`kafka`](KafkaParams): one partition of a Kafka topic per partition (librdkafka).
//!
//! Both parameter types are also their typed configuration (`builder`): builder-style
//! constructors (the setters both have come from [`BrokerSourceParams`]),
//! [`flow_core::SourceConfig`], and `validate` with the registry's own checks.

#![warn(missing_docs)]

mod broker_source;
mod builder;
mod kafka;
mod nats;
mod register;

pub use broker_source::BrokerSourceParams;
pub use kafka::{KafkaParams, KafkaSourceError};
pub use nats::{NatsAuth, NatsJetStreamParams, NatsSourceError, ReplyError, StreamRefusal};
pub use register::register;
