//! flow-clickhouse: ClickHouse sinks for flow.
//!
//! Architecture: a sink class ([`SinkClass`]) maps to a delivery [`Guarantee`] and a host-form
//! rule; its spec is validated once into typed parameters (`params`, with the `topology` of
//! parsed endpoints and an optional TLS config). Every class shares one per-sink state
//! (`sink_state`) whose writer session (`session`) starts when the first partition opens, waiting out
//! unreachable endpoints (`session_wait`; a host of a shard whose other hosts answer, or a
//! whole shard once another answered, is admitted later by `late_hosts`), probing every endpoint
//! (engine, schema, replication identity, capabilities, `dedup_window`, the server's type
//! families) and planning the RowBinary encoding (`chtype` checks each stream type against its
//! column type, nested ones included; `rowbinary` walks cell and packed values into the body,
//! checked per value against the oracle of `rowbinary_oracle`, the `clickhouse` crate's
//! serializer). Epochs are cut into encoded per-shard parts (`cutter`, routed by `routing`,
//! compressed by `compress`) and inserted over HTTP (`insert`, `client`, `tls`), retried and given
//! up as the guarantee's table says for the error class of `classify` (`guarantee`).
//!
//! The sinks: `batching_sink` (exactly-once: the outbox, tokens and the topology guard of
//! `fingerprint`, with its per-sink state in `exactly_once`; pending batches stored as bounds
//! are rebuilt from the source by `rebuild`; each partition's batches are sent by `deliverer`; with `on_bad_rows: dead_letter` a part the server
//! refuses is delivered in halves by `split`, which reads rows back with `row_spans`),
//! `at_least_once_sink` and `at_most_once_sink`. [`register`] adds them to a registry; `verify`
//! checks that the replicas of every shard hold the same rows (`flow-worker verify`).
//!
//! Metrics: each sink partition counts through its `flow_core::SinkMetrics` what it delivered
//! (in the acknowledgement's transaction, or with the epoch for the classes without an outbox),
//! and `insert` counts every failed attempt durably and times the successful ones.
//!
//! Typed configuration: [`ClickHouseSink`] (`config`) sets every parameter in code and builds a
//! checked [`ClickHouseSinkConfig`] through the same `params` parsing and validation as a YAML spec.

#![warn(missing_docs)]

mod at_least_once_sink;
mod at_most_once_sink;
mod backlog_age;
mod backoff;
mod batching_sink;
mod chtype;
mod classify;
mod client;
mod columns_guard;
mod compress;
mod config;
mod cutter;
mod dedup_window;
mod deliverer;
mod exactly_once;
mod fingerprint;
mod guarantee;
mod insert;
mod late_hosts;
mod params;
mod protocol;
mod rebuild;
mod routing;
mod row_spans;
mod rowbinary;
#[cfg(test)]
mod rowbinary_oracle;
mod session;
mod session_wait;
mod sink_state;
mod split;
mod tls;
mod topology;
mod verify;

use std::sync::Arc;

use flow_core::Registry;

pub use chtype::{check_mapping, check_mapping_on, ChType, ServerTypes};
pub use classify::{ClassifiedError, ErrorClass};
pub use compress::{seal, unframe};
pub use config::{ClickHouseSink, ClickHouseSinkConfig};
pub use fingerprint::topology_fingerprint;
pub use guarantee::Guarantee;
pub use params::{
    AtMostOnceDynamic, AtMostOnceStrategy, ClickHouseDynamicParams, ClickHouseParams, Codec,
    HostSelectionPolicy, OnBadRows, OnExpiredBacklog, SinkClass,
};
pub use routing::{routing_key, RendezvousRouter};
pub use rowbinary::{EncodedColumn, RowBinaryEncoder};
pub use split::requeued_batch;
pub use tls::{base_client, ConfiguredRootsVerifier, TlsOptions};
pub use verify::{
    verify_replicas, verify_sink, OrphanPart, ReplicaState, Replication, ShardReport, ShardVerdict,
    VerifyError,
};

/// Registers the ClickHouse sink classes (and their `NYT::NFlow::T…` aliases) in `registry`.
pub fn register(registry: &mut Registry) {
    for class in SinkClass::ALL {
        let builder: flow_core::registry::SinkBuilder =
            Arc::new(move |ctx, parameters, dynamic| match class {
                SinkClass::Batching | SinkClass::ShardedBatching => {
                    batching_sink::build(class, ctx, parameters, dynamic)
                }
                SinkClass::AtLeastOnce => at_least_once_sink::build(ctx, parameters, dynamic),
                SinkClass::AtMostOnce => at_most_once_sink::build(ctx, parameters, dynamic),
            });
        registry.register_sink(class.class_name(), Arc::clone(&builder));
        registry.register_sink(&class.reference_name(), builder);
    }
}
