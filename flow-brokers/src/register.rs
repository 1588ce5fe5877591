//! The broker source classes of a registry.

use std::sync::Arc;

use flow_core::Registry;

use crate::{kafka, nats};

/// Registers the broker sources (`nats_jetstream`, `kafka`) into `registry`.
pub fn register(registry: &mut Registry) {
    registry.register_source("nats_jetstream", Arc::new(nats::build));
    registry.register_source("kafka", Arc::new(kafka::build));
}
