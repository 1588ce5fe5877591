//! Built-in sinks.

pub mod debug;

pub use crate::builtin_config::DebugSinkConfig;

use crate::registry::Registry;

pub(crate) fn register(registry: &mut Registry) {
    registry.register_sink("DebugSink", std::sync::Arc::new(debug::build));
}
