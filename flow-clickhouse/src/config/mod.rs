//! Configuration: the spec's parameters, validated once into resolved values.

pub(crate) mod builder;
pub(crate) mod dynamic;
pub(crate) mod guarantee;
pub(crate) mod params;
pub(crate) mod settings;
pub(crate) mod topology;
