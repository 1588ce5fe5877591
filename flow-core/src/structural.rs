//! A YAML value deserialized into a typed section with every structural mistake reported: serde
//! stops at the first error, so the entry it names is taken out of a copy of the value and the
//! value deserialized again, until it parses or the error names no entry. Every unknown field is
//! reported, and the first other mistake (a wrong type, a value out of range); what follows from
//! taking an entry out (the field it leaves missing) is not.

use serde::de::DeserializeOwned;
use serde_path_to_error::Segment;

use crate::error::Violation;

/// What serde's `deny_unknown_fields` error says first (`unknown field `x`, expected ...`).
const UNKNOWN_FIELD: &str = "unknown field `";

/// Deserializes `value` into `T`, naming each violation's path under `path` (`parameters.table`):
/// every unknown field and the first other mistake, in the order serde meets them.
pub(crate) fn deserialize_all<T: DeserializeOwned>(
    value: &serde_yaml::Value,
    path: &str,
) -> Result<T, Vec<Violation>> {
    let mut violations = Vec::new();
    let mut other_seen = false;
    // A copy to take unknown fields out of, made at the first one.
    let mut trimmed: Option<serde_yaml::Value> = None;
    loop {
        let attempt = trimmed.as_ref().unwrap_or(value).clone();
        let err = match serde_path_to_error::deserialize::<_, T>(attempt) {
            Ok(parsed) if violations.is_empty() => return Ok(parsed),
            Ok(_) => return Err(violations),
            Err(err) => err,
        };
        let inner = err.path().to_string();
        let full = if inner == "." || inner.is_empty() {
            path.to_owned()
        } else {
            format!("{path}.{inner}")
        };
        let segments: Vec<Segment> = err.path().iter().cloned().collect();
        let message = err.into_inner().to_string();
        let unknown = message.starts_with(UNKNOWN_FIELD);
        if unknown || !other_seen {
            violations.push(Violation::new(full, message));
        }
        other_seen |= !unknown;
        // Taking the entry out always shrinks the value, so the loop ends.
        if !remove_at(trimmed.get_or_insert_with(|| value.clone()), &segments) {
            return Err(violations);
        }
    }
}

/// Removes the mapping entry the path leads to; `false` if there is none.
fn remove_at(value: &mut serde_yaml::Value, path: &[Segment]) -> bool {
    let Some((Segment::Map { key }, parents)) = path.split_last() else {
        return false;
    };
    let mut at = value;
    for segment in parents {
        let next = match (segment, at) {
            (Segment::Map { key }, serde_yaml::Value::Mapping(map)) => map.get_mut(key.as_str()),
            (Segment::Seq { index }, serde_yaml::Value::Sequence(items)) => items.get_mut(*index),
            _ => None,
        };
        let Some(next) = next else {
            return false;
        };
        at = next;
    }
    match at {
        serde_yaml::Value::Mapping(map) => map.remove(key.as_str()).is_some(),
        _ => false,
    }
}
