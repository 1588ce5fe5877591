//! The registry of every built-in plugin class.

use flow_core::Registry;

/// A registry of every built-in plugin class: flow-core's (`generator`, `jsonl_file`,
/// `project`, `DebugSink`), the broker sources (`nats_jetstream`, `kafka`) and the ClickHouse
/// sinks (`ClickHouseBatchingSink`, `ShardedClickHouseBatchingSink`,
/// `AtLeastOnceClickHouseSink`, `AtMostOnceClickHouseSink`). Register a program's own classes
/// on it before building a spec.
pub fn registry() -> Registry {
    let mut registry = Registry::with_builtins();
    flow_brokers::register(&mut registry);
    flow_clickhouse::register(&mut registry);
    registry
}
