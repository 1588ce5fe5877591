//! The plugin registry: builds sources, processors and sinks by class name from spec parameters.
//! Third-party crates add their classes with `register_*` before the spec is built.
//!
//! Layout:
//! - `classes`: the [`Registry`] of builders by class name and what a builder is handed;
//! - `build`: [`Registry::build`], a spec validated and its plugins built;
//! - `parameters`: [`parse_parameters`], a plugin's typed parameters with every structural
//!   violation reported.

mod build;
mod classes;
mod parameters;

pub use classes::{
    BuildResult, ProcessorBuildContext, ProcessorBuilder, Registry, SinkBuildContext, SinkBuilder,
    SourceBuildContext, SourceBuilder, SourceSubjects,
};
pub use parameters::parse_parameters;
