//! The plugin classes that ship with flow-core. Kept apart from [`crate::registry`] so that the
//! registry does not depend on the plugins that register into it.

use crate::registry::Registry;

impl Registry {
    /// The classes that ship with flow-core: sources `generator` and `jsonl_file`, processor
    /// `project`, sink `DebugSink`.
    pub fn with_builtins() -> Self {
        let mut registry = Registry::new();
        crate::sources::register(&mut registry);
        crate::processors::register(&mut registry);
        crate::sinks::register(&mut registry);
        registry
    }
}
