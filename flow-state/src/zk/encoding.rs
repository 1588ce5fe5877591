//! Values of the ZooKeeper state nodes that sled does not hold in the same form: the partition's
//! counters in one node, and dead letters as references (without their payloads).

use std::collections::BTreeMap;
use std::sync::Arc;

use crate::error::StateError;
use crate::types::DeadLetter;

/// The counters of one partition, by (owner, name).
pub(crate) type Counters = BTreeMap<(String, String), u64>;

fn bad(path: &str, detail: String) -> StateError {
    StateError::BadNode {
        path: path.to_owned(),
        detail,
    }
}

fn serialize(
    what: &'static str,
    path: &str,
    value: &impl serde::Serialize,
) -> Result<Vec<u8>, StateError> {
    bincode::serialize(value).map_err(|source| StateError::Serialize {
        what,
        context: path.to_owned(),
        source: Arc::from(source),
    })
}

pub(crate) fn encode_counters(counters: &Counters, path: &str) -> Result<Vec<u8>, StateError> {
    serialize("counters", path, counters)
}

pub(crate) fn decode_counters(value: &[u8], path: &str) -> Result<Counters, StateError> {
    bincode::deserialize(value).map_err(|e| bad(path, format!("counters: {e}")))
}

/// A dead letter as ZooKeeper keeps it: a reference to the message (partition, offset) and the
/// reason, without the payload, which can be as large as a message and would make nodes grow
/// without bound. The reason says so, for whoever reads it on another worker.
pub(crate) fn dead_letter_reference(encoded: &[u8], path: &str) -> Result<Vec<u8>, StateError> {
    let letter: DeadLetter = bincode::deserialize(encoded)
        .map_err(|e| bad(path, format!("dead letter to mirror: {e}")))?;
    let reference = DeadLetter {
        reason: format!(
            "{} (payload of {} bytes kept only in the state directory of the worker that set it aside)",
            letter.reason,
            letter.payload.len()
        ),
        payload: Vec::new(),
        ..letter
    };
    serialize("dead letter reference", path, &reference)
}

pub(crate) fn decode_u64(value: &[u8], path: &str) -> Result<u64, StateError> {
    let bytes: [u8; 8] = value
        .try_into()
        .map_err(|_| bad(path, format!("expected 8 bytes, found {}", value.len())))?;
    Ok(u64::from_be_bytes(bytes))
}
