//! flow-clickhouse: ClickHouse sinks for flow.
//!
//! A sink class ([`params::SinkClass`]) is built from its spec parameters ([`params`]); nothing
//! connects until the first write, when the shared [`session::WriterSession`] probes every
//! endpoint (engine, schema, replication identity, capabilities, [`dedup_window`]) and plans the
//! RowBinary encoding ([`chtype`], [`rowbinary`]). The exactly-once classes
//! ([`batching_sink`]) route rows with a [`routing::RendezvousRouter`], seal per-shard batches into
//! the flow-state outbox with the epoch's commit, guard restarts with the persisted
//! [`fingerprint`]s, and deliver in order over HTTP ([`client`], [`tls`]), retrying by the error
//! class of [`classify`].

pub mod at_least_once_sink;
pub mod at_most_once_sink;
pub mod batching_sink;
pub mod chtype;
pub mod classify;
pub mod client;
pub mod compress;
pub mod cutter;
pub mod dedup_window;
pub mod exactly_once;
pub mod fingerprint;
pub mod guarantee;
pub mod insert;
pub mod params;
pub mod routing;
pub mod rowbinary;
pub mod session;
pub mod session_wait;
pub mod sink_state;
pub mod tls;
pub mod topology;

use std::sync::Arc;

use flow_core::Registry;
use params::SinkClass;

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
