//! Key layout and value encodings.
//!
//! Names are separated by a NUL byte (names may not contain NUL); integers are big-endian so that
//! sled's lexicographic order is numeric order.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::error::StateError;
use crate::types::{DeadLetter, SealedBatch, SinkPartition};

pub(crate) const SEP: u8 = 0;
/// Owner under which source dead letters are stored.
pub const SOURCE_OWNER: &str = "source";

const BATCH_FORMAT_V1: u8 = 1;

pub(crate) fn check_name(what: &'static str, name: &str) -> Result<(), StateError> {
    if name.is_empty() {
        return Err(StateError::InvalidName {
            what,
            name: name.to_owned(),
            reason: "must not be empty",
        });
    }
    if name.as_bytes().contains(&SEP) {
        return Err(StateError::InvalidName {
            what,
            name: name.to_owned(),
            reason: "must not contain a NUL byte",
        });
    }
    Ok(())
}

fn push_name(key: &mut Vec<u8>, name: &str) {
    key.extend_from_slice(name.as_bytes());
    key.push(SEP);
}

/// `pipeline \0 partition(be32)`: key of `positions`.
pub(crate) fn position_key(pipeline: &str, partition: u32) -> Vec<u8> {
    let mut key = Vec::with_capacity(pipeline.len() + 5);
    push_name(&mut key, pipeline);
    key.extend_from_slice(&partition.to_be_bytes());
    key
}

/// `pipeline \0 name \0 partition(be32)`: key of `batch_seq`, `fingerprints`, `dead_letter_seq`,
/// and the prefix of `batches` / `dead_letters` keys (followed by `seq(be64)`).
pub(crate) fn queue_key(pipeline: &str, name: &str, partition: u32) -> Vec<u8> {
    let mut key = Vec::with_capacity(pipeline.len() + name.len() + 14);
    push_name(&mut key, pipeline);
    push_name(&mut key, name);
    key.extend_from_slice(&partition.to_be_bytes());
    key
}

pub(crate) fn sink_queue_key(key: &SinkPartition) -> Vec<u8> {
    queue_key(&key.pipeline, &key.sink, key.partition)
}

pub(crate) fn seq_key(prefix: &[u8], seq: u64) -> Vec<u8> {
    let mut key = Vec::with_capacity(prefix.len() + 8);
    key.extend_from_slice(prefix);
    key.extend_from_slice(&seq.to_be_bytes());
    key
}

/// `pipeline \0 sink \0 name`: key of `sink_values`.
pub(crate) fn sink_value_key(pipeline: &str, sink: &str, name: &str) -> Vec<u8> {
    let mut key = Vec::with_capacity(pipeline.len() + sink.len() + name.len() + 2);
    push_name(&mut key, pipeline);
    push_name(&mut key, sink);
    key.extend_from_slice(name.as_bytes());
    key
}

/// Printable form of a key for error messages.
pub(crate) fn show_key(key: &[u8]) -> String {
    let mut out = String::new();
    for &b in key {
        if b == SEP {
            out.push('/');
        } else if b.is_ascii_graphic() {
            out.push(char::from(b));
        } else {
            out.push_str(&format!("\\x{b:02x}"));
        }
    }
    out
}

fn split_name(bytes: &[u8]) -> Option<(&str, &[u8])> {
    let end = bytes.iter().position(|&b| b == SEP)?;
    let name = std::str::from_utf8(&bytes[..end]).ok()?;
    Some((name, &bytes[end + 1..]))
}

fn be_u32(bytes: &[u8]) -> Option<u32> {
    Some(u32::from_be_bytes(bytes.try_into().ok()?))
}

fn be_u64(bytes: &[u8]) -> Option<u64> {
    Some(u64::from_be_bytes(bytes.try_into().ok()?))
}

fn bad_key(what: &'static str, key: &[u8]) -> StateError {
    StateError::Decode {
        what,
        key: show_key(key),
        detail: "malformed key".to_owned(),
    }
}

pub(crate) fn parse_position_key(key: &[u8]) -> Result<(String, u32), StateError> {
    let (pipeline, rest) = split_name(key).ok_or_else(|| bad_key("position key", key))?;
    let partition = be_u32(rest).ok_or_else(|| bad_key("position key", key))?;
    Ok((pipeline.to_owned(), partition))
}

pub(crate) fn parse_queue_key(
    what: &'static str,
    key: &[u8],
) -> Result<(String, String, u32), StateError> {
    let (pipeline, rest) = split_name(key).ok_or_else(|| bad_key(what, key))?;
    let (name, rest) = split_name(rest).ok_or_else(|| bad_key(what, key))?;
    let partition = be_u32(rest).ok_or_else(|| bad_key(what, key))?;
    Ok((pipeline.to_owned(), name.to_owned(), partition))
}

/// Sequence number at the end of a `batches` / `dead_letters` key.
pub(crate) fn parse_seq_suffix(what: &'static str, key: &[u8]) -> Result<u64, StateError> {
    let start = key.len().checked_sub(8).ok_or_else(|| bad_key(what, key))?;
    be_u64(&key[start..]).ok_or_else(|| bad_key(what, key))
}

/// A queue's bounds: batches `head..next` are present.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Bounds {
    pub head: u64,
    pub next: u64,
}

impl Bounds {
    pub(crate) fn encode(self) -> [u8; 16] {
        let mut out = [0u8; 16];
        out[..8].copy_from_slice(&self.head.to_be_bytes());
        out[8..].copy_from_slice(&self.next.to_be_bytes());
        out
    }

    pub(crate) fn decode(key: &[u8], value: &[u8]) -> Result<Bounds, StateError> {
        let bad = || StateError::Decode {
            what: "queue bounds",
            key: show_key(key),
            detail: format!("expected 16 bytes, found {}", value.len()),
        };
        if value.len() != 16 {
            return Err(bad());
        }
        let head = be_u64(&value[..8]).ok_or_else(bad)?;
        let next = be_u64(&value[8..]).ok_or_else(bad)?;
        Ok(Bounds { head, next })
    }
}

pub(crate) fn decode_counter(key: &[u8], value: &[u8]) -> Result<u64, StateError> {
    be_u64(value).ok_or_else(|| StateError::Decode {
        what: "counter",
        key: show_key(key),
        detail: format!("expected 8 bytes, found {}", value.len()),
    })
}

#[derive(Serialize)]
struct BatchHeaderRef<'a> {
    target: &'a str,
    columns: &'a [String],
    format: &'a str,
    token: &'a str,
    shard: &'a str,
    first_offset: u64,
    last_offset: u64,
    rows: u64,
    payload_len: u64,
}

/// Batch metadata without the payload (what `summary` needs).
#[derive(Deserialize, Debug, Clone)]
pub(crate) struct BatchHeader {
    pub target: String,
    pub columns: Vec<String>,
    pub format: String,
    pub token: String,
    pub shard: String,
    pub first_offset: u64,
    pub last_offset: u64,
    pub rows: u64,
    pub payload_len: u64,
}

/// Stored batch: `[version=1][header_len: be32][bincode header][payload bytes verbatim]`.
pub(crate) fn encode_batch(batch: &SealedBatch, context: &str) -> Result<Vec<u8>, StateError> {
    let header = BatchHeaderRef {
        target: &batch.target,
        columns: &batch.columns,
        format: &batch.format,
        token: &batch.token,
        shard: &batch.shard,
        first_offset: batch.first_offset,
        last_offset: batch.last_offset,
        rows: batch.rows,
        payload_len: batch.payload.len() as u64,
    };
    let header = bincode::serialize(&header).map_err(|e| StateError::Encode {
        what: "batch header",
        context: context.to_owned(),
        detail: e.to_string(),
    })?;
    let header_len = u32::try_from(header.len()).map_err(|_| StateError::Encode {
        what: "batch header",
        context: context.to_owned(),
        detail: format!("header of {} bytes is too large", header.len()),
    })?;
    let mut out = Vec::with_capacity(5 + header.len() + batch.payload.len());
    out.push(BATCH_FORMAT_V1);
    out.extend_from_slice(&header_len.to_be_bytes());
    out.extend_from_slice(&header);
    out.extend_from_slice(&batch.payload);
    Ok(out)
}

/// Decodes the header and returns it with the payload slice.
pub(crate) fn decode_batch_parts<'v>(
    key: &[u8],
    value: &'v [u8],
) -> Result<(BatchHeader, &'v [u8]), StateError> {
    let bad = |detail: String| StateError::Decode {
        what: "batch",
        key: show_key(key),
        detail,
    };
    if value.len() < 5 {
        return Err(bad(format!("value of {} bytes is too short", value.len())));
    }
    if value[0] != BATCH_FORMAT_V1 {
        return Err(bad(format!("unknown batch format version {}", value[0])));
    }
    let header_len = be_u32(&value[1..5]).ok_or_else(|| bad("bad header length".to_owned()))?;
    let header_end = 5usize.saturating_add(header_len as usize);
    if header_end > value.len() {
        return Err(bad(format!(
            "header length {header_len} exceeds value length {}",
            value.len()
        )));
    }
    let header: BatchHeader =
        bincode::deserialize(&value[5..header_end]).map_err(|e| bad(format!("bad header: {e}")))?;
    let payload = &value[header_end..];
    if payload.len() as u64 != header.payload_len {
        return Err(bad(format!(
            "payload has {} bytes, header says {}",
            payload.len(),
            header.payload_len
        )));
    }
    Ok((header, payload))
}

pub(crate) fn decode_batch(key: &[u8], value: &[u8]) -> Result<SealedBatch, StateError> {
    let (h, payload) = decode_batch_parts(key, value)?;
    Ok(SealedBatch {
        target: h.target,
        columns: h.columns,
        format: h.format,
        token: h.token,
        shard: h.shard,
        first_offset: h.first_offset,
        last_offset: h.last_offset,
        rows: h.rows,
        payload: bytes::Bytes::copy_from_slice(payload),
    })
}

pub(crate) fn encode_dead_letter(dl: &DeadLetter, context: &str) -> Result<Vec<u8>, StateError> {
    bincode::serialize(dl).map_err(|e| StateError::Encode {
        what: "dead letter",
        context: context.to_owned(),
        detail: e.to_string(),
    })
}

pub(crate) fn decode_dead_letter(key: &[u8], value: &[u8]) -> Result<DeadLetter, StateError> {
    bincode::deserialize(value).map_err(|e| StateError::Decode {
        what: "dead letter",
        key: show_key(key),
        detail: e.to_string(),
    })
}

pub(crate) fn encode_fingerprints(
    fingerprints: &BTreeMap<String, String>,
    context: &str,
) -> Result<Vec<u8>, StateError> {
    bincode::serialize(fingerprints).map_err(|e| StateError::Encode {
        what: "fingerprints",
        context: context.to_owned(),
        detail: e.to_string(),
    })
}

pub(crate) fn decode_fingerprints(
    key: &[u8],
    value: &[u8],
) -> Result<BTreeMap<String, String>, StateError> {
    bincode::deserialize(value).map_err(|e| StateError::Decode {
        what: "fingerprints",
        key: show_key(key),
        detail: e.to_string(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn batch(payload: Vec<u8>) -> SealedBatch {
        SealedBatch {
            target: "default.events".into(),
            columns: vec!["a".into(), "b".into()],
            format: "RowBinary".into(),
            token: "tok-1".into(),
            shard: String::new(),
            first_offset: 7,
            last_offset: 9,
            rows: 3,
            payload: payload.into(),
        }
    }

    #[test]
    fn batch_encoding_round_trips_payload_bit_for_bit() {
        let payload: Vec<u8> = (0..=255u8).cycle().take(70_000).collect();
        let b = batch(payload);
        let encoded = encode_batch(&b, "t").unwrap();
        assert_eq!(decode_batch(b"k", &encoded).unwrap(), b);
    }

    #[test]
    fn batch_decoding_rejects_truncated_payload() {
        let encoded = encode_batch(&batch(vec![1, 2, 3]), "t").unwrap();
        let err = decode_batch(b"k", &encoded[..encoded.len() - 1]).unwrap_err();
        assert!(
            matches!(err, StateError::Decode { what: "batch", .. }),
            "{err}"
        );
    }

    #[test]
    fn keys_sort_by_partition_then_seq_and_parse_back() {
        let a = seq_key(&queue_key("p", "s", 1), 255);
        let b = seq_key(&queue_key("p", "s", 1), 256);
        let c = seq_key(&queue_key("p", "s", 2), 0);
        assert!(a < b && b < c);
        assert_eq!(parse_seq_suffix("batch key", &b).unwrap(), 256);
        assert_eq!(
            parse_queue_key("q", &queue_key("p", "s", 3)).unwrap(),
            ("p".to_owned(), "s".to_owned(), 3)
        );
        assert_eq!(
            parse_position_key(&position_key("pp", 9)).unwrap(),
            ("pp".to_owned(), 9)
        );
        // A pipeline name that is a prefix of another does not share its key prefix.
        assert!(!position_key("ab", 0).starts_with(b"a\0"));
    }

    #[test]
    fn names_with_nul_or_empty_are_rejected() {
        assert!(check_name("sink", "ok_name-1.x").is_ok());
        assert!(matches!(
            check_name("sink", ""),
            Err(StateError::InvalidName { .. })
        ));
        assert!(matches!(
            check_name("sink", "a\0b"),
            Err(StateError::InvalidName { .. })
        ));
    }
}
