//! flow-clickhouse: ClickHouse sinks for flow.
//!
//! Layout:
//! - `config/`: the spec's parameters validated into resolved values (`params`, `dynamic`,
//!   the INSERT `settings`),
//!   the `topology` of endpoints, the `guarantee` of each [`SinkClass`] with its retry decision,
//!   and the typed code `builder` ([`ClickHouseSink`]).
//! - `encode/`: ClickHouse types (`chtype`), the dates a server reads back (`readable`), the
//!   RowBinary body (`rowbinary`), reading rows back (`row_spans`), rows re-encoded for a
//!   widened column (`widen`), compression (`compress`) and shard routing (`routing`).
//! - `server/`: HTTP clients (`client`, `tls`, `protocol`), error classes (`classify`), the
//!   writer session (`probe`, the start's `survey` of every host, `session`, `late_hosts`,
//!   `columns_guard`, `dedup_window`) and what a change of the table's columns under it means (`schema_change`), and the stream
//!   columns `auto_add_columns` adds to the table (`auto_add`).
//! - `delivery/`: what every class shares: the per-sink state and its session wait
//!   (`sink_state`), epochs cut into parts (`cutter`), the INSERT (`insert`, `backoff`), the
//!   backlog age (`backlog_age`) and refused parts delivered in halves (`split`).
//! - `exactly_once/`: the exactly-once classes: the sink, its state, the per-partition
//!   `deliverer`, batches `rebuild`-t from the source, topology `fingerprint`s, and the check
//!   whether a part sent while the table's columns changed `landed` (by message id).
//! - `tables/`: many tables from one stream (`table: "events_{event_type}"`, `{subject[1]}`,
//!   a `tables:` map; every class): the `template`, the broker `subjects` resolved
//!   per partition, the per-table `targets` (each its own session, schema check,
//!   fingerprints, tokens), the `resolver` of each row's table (and of a missing table's dead
//!   letter or wait), the exactly-once `sink` that splits an epoch by table and the
//!   `deliverers` that send each stored batch through its table's deliverer, and `direct`: the
//!   same split into parts for the classes without an outbox.
//! - `at_least_once.rs`, `at_most_once.rs`: the other two classes.
//! - `verify.rs`: checks that the replicas of every shard hold the same rows.
//!
//! Architecture: a sink class ([`SinkClass`]) maps to a delivery [`Guarantee`] and a host-form
//! rule; its spec is validated once into resolved parameters (`params`, with the `topology` of
//! parsed endpoints and an optional TLS config). Every class shares one per-sink state
//! (`sink_state`) whose writer session (`session`) starts when the first partition opens, waiting
//! out unreachable endpoints (a host of a shard whose other hosts answer, or a whole shard once
//! another answered, is admitted later by `late_hosts`), probing every endpoint (`probe`: engine,
//! schema, replication identity, capabilities, `dedup_window`, the server's type families) and
//! planning the RowBinary encoding (`chtype` checks each stream type against its column type,
//! nested ones included; `rowbinary` walks cell and packed values into the body, checked per
//! value against the `clickhouse` crate's serializer in its oracle tests). Epochs are cut into
//! encoded per-shard parts (`cutter`, routed by `routing`, compressed by `compress`) and inserted
//! over HTTP (`insert`, `client`, `tls`), retried and given up as the guarantee's table says for
//! the error class of `classify` (`guarantee`).
//!
//! The sinks: `exactly_once::sink` (the outbox, tokens and the topology guard of `fingerprint`,
//! with its per-sink state in `exactly_once::state`; pending batches stored as bounds are rebuilt
//! from the source by `rebuild`; each partition's batches are sent by `deliverer`; with
//! `on_bad_rows: dead_letter` a part the server refuses is delivered in halves by `split`, which
//! reads rows back with `row_spans`), `at_least_once` and `at_most_once`. [`register`] adds them
//! to a registry; `verify` checks that the replicas of every shard hold the same rows
//! (`flow-worker verify`).
//!
//! Metrics: each sink partition counts through its `flow_core::SinkMetrics` what it delivered
//! (in the acknowledgement's transaction, or with the epoch for the classes without an outbox),
//! and `insert` counts every failed attempt durably and times the successful ones.
//!
//! Typed configuration: [`ClickHouseSink`] (`config::builder`) sets every parameter in code and
//! builds a checked [`ClickHouseSinkConfig`] through the same `params` parsing and validation as a
//! YAML spec.

#![warn(missing_docs)]

mod at_least_once;
mod at_most_once;
mod config;
mod delivery;
mod encode;
mod exactly_once;
mod server;
mod tables;
mod verify;

use std::sync::Arc;

use flow_core::Registry;

pub use config::builder::{ClickHouseSink, ClickHouseSinkConfig};
pub use config::dynamic::{AtMostOnceDynamic, ClickHouseDynamicParams};
pub use config::guarantee::{Guarantee, SinkClass};
pub use config::params::{
    AtMostOnceStrategy, ClickHouseParams, Codec, HostSelectionPolicy, MissingTable, OnBadRows,
    OnExpiredBacklog, PasswordEnvError, PasswordError,
};
pub use config::settings::SettingValue;
pub use delivery::split::requeued_batch;
pub use server::classify::{ClassifiedError, ErrorClass};
pub use server::client::ClientsError;
pub use server::tls::TlsError;
pub use verify::{
    verify_replicas, verify_sink, OrphanPart, ReplicaState, Replication, ShardReport, ShardVerdict,
    VerifyError,
};

/// Internals that the crate's benches and the integration tests drive directly: the encoder and
/// its type checks, framing, routing, fingerprints and the TLS client. Not a stable API.
#[cfg(feature = "testing")]
#[doc(hidden)]
pub mod testing {
    pub use crate::encode::chtype::{check_mapping, check_mapping_on, ChType, ServerTypes};
    pub use crate::encode::compress::{seal, unframe, PartFormat, UnframeError};
    pub use crate::encode::routing::{routing_key, RendezvousRouter};
    pub use crate::encode::rowbinary::{EncodedColumn, RowBinaryEncoder};
    pub use crate::exactly_once::fingerprint::topology_fingerprint;
    pub use crate::server::tls::{base_client, ConfiguredRootsVerifier, TlsOptions};
}

/// Registers the ClickHouse sink classes (and their `NYT::NFlow::T…` aliases) in `registry`.
pub fn register(registry: &mut Registry) {
    for class in SinkClass::ALL {
        let builder: flow_core::registry::SinkBuilder =
            Arc::new(move |ctx, parameters, dynamic| match class {
                SinkClass::Batching | SinkClass::ShardedBatching if has_template(parameters) => {
                    tables::sink::build(class, ctx, parameters, dynamic)
                }
                SinkClass::Batching | SinkClass::ShardedBatching => {
                    exactly_once::sink::build(class, ctx, parameters, dynamic)
                }
                SinkClass::AtLeastOnce => at_least_once::build(ctx, parameters, dynamic),
                SinkClass::AtMostOnce => at_most_once::build(ctx, parameters, dynamic),
            });
        registry.register_sink(class.class_name(), Arc::clone(&builder));
        registry.register_sink(&class.reference_name(), builder);
    }
}

/// Whether the spec's `table` is a template or it has a `tables` map (many tables from one
/// stream, see `tables/`).
fn has_template(parameters: &serde_yaml::Value) -> bool {
    let template = parameters
        .get("table")
        .and_then(serde_yaml::Value::as_str)
        .is_some_and(tables::template::TableTemplate::is_template);
    template || parameters.get("tables").is_some()
}
