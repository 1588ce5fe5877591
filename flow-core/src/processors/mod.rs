//! Built-in processors.

pub mod project;

use crate::registry::Registry;

pub(crate) fn register(registry: &mut Registry) {
    registry.register_processor("project", std::sync::Arc::new(project::build));
}
