//! flow-brokers: sources that read a message broker from the positions flow commits.
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
//! Both parameter types are also their typed configuration (`config`): builder-style
//! constructors (the setters both have come from [`BrokerSourceParams`]),
//! [`flow_core::SourceConfig`], and `validate` with the registry's own checks.
//!
//! Layout:
//! - `register`: [`register`] puts both classes into a registry.
//! - `broker_source`: what both sources share (common setters, the generic factory, the paced
//!   wait after broker trouble); `config`: the typed configuration of both.
//! - NATS JetStream: `nats_jetstream` (parameters, validation, reader), `nats_auth`
//!   (authentication and TLS), `nats_error` ([`NatsSourceError`]).
//! - Kafka: `kafka` (parameters, validation, reader, [`KafkaSourceError`]).

#![warn(missing_docs)]

mod broker_source;
mod config;
mod kafka;
mod nats_auth;
mod nats_error;
mod nats_jetstream;
mod register;

pub use broker_source::BrokerSourceParams;
pub use kafka::{KafkaParams, KafkaSourceError};
pub use nats_auth::NatsAuth;
pub use nats_error::NatsSourceError;
pub use nats_jetstream::NatsJetStreamParams;
pub use register::register;
