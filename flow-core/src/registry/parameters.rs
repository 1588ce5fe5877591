//! Plugin parameters deserialized from a spec section with every structural violation reported.

use serde::de::DeserializeOwned;

use super::classes::BuildResult;
use crate::structural::deserialize_all;

/// Deserializes plugin parameters (a missing section is an empty mapping), reporting each
/// violation's path under `section` (`parameters.payload_bytes: invalid type ...`): every
/// unknown field (`unknown field `x`, expected one of `a`, `b`, ...`), each with its own path,
/// then the first other mistake, if any (serde stops at it).
pub fn parse_parameters<T: DeserializeOwned>(
    value: &serde_yaml::Value,
    section: &str,
) -> BuildResult<T> {
    match value {
        serde_yaml::Value::Null => deserialize_all(
            &serde_yaml::Value::Mapping(serde_yaml::Mapping::new()),
            section,
        ),
        other => deserialize_all(other, section),
    }
}
