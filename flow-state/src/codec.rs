//! Key layout and value encodings.
//!
//! Names are separated by a NUL byte (names may not contain NUL); integers are big-endian so that
//! sled's lexicographic order is numeric order.

use std::collections::BTreeMap;
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use crate::error::StateError;
use crate::types::{DeadLetter, PayloadRef, SealedBatch, SinkPartition, StoredBody};

pub(crate) const SEP: u8 = 0;
/// Owner under which source dead letters are stored.
pub const SOURCE_OWNER: &str = "source";

/// Version 2: the payload is in a segment file or rebuilt, never inside the sled value.
const BATCH_FORMAT_V2: u8 = 2;

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

/// The `(pipeline, sink, name)` parts of a `sink_values` key ([`sink_value_key`]); `None` for a
/// key without them.
pub(crate) fn split_sink_value_key(key: &[u8]) -> Option<(&[u8], &[u8], &[u8])> {
    let mut parts = key.splitn(3, |b| *b == SEP);
    Some((parts.next()?, parts.next()?, parts.next()?))
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

/// A `counters` key: `pipeline\0 owner\0 partition(be32) name`.
pub(crate) fn counter_key(pipeline: &str, owner: &str, partition: u32, name: &str) -> Vec<u8> {
    let mut key = queue_key(pipeline, owner, partition);
    key.extend_from_slice(name.as_bytes());
    key
}

/// (pipeline, owner, partition, name) of a `counters` key.
pub(crate) fn parse_counter_key(key: &[u8]) -> Result<(String, String, u32, String), StateError> {
    let what = "counter key";
    let (pipeline, rest) = split_name(key).ok_or_else(|| bad_key(what, key))?;
    let (owner, rest) = split_name(rest).ok_or_else(|| bad_key(what, key))?;
    let (partition, name) = (rest.get(..4), rest.get(4..));
    let partition = partition
        .and_then(be_u32)
        .ok_or_else(|| bad_key(what, key))?;
    let name = name
        .and_then(|n| std::str::from_utf8(n).ok())
        .ok_or_else(|| bad_key(what, key))?;
    Ok((
        pipeline.to_owned(),
        owner.to_owned(),
        partition,
        name.to_owned(),
    ))
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
    encoded_bytes: u64,
    plan: &'a str,
    sealed_at_ms: u64,
    content_hash: u64,
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
    pub encoded_bytes: u64,
    pub plan: String,
    pub sealed_at_ms: u64,
    pub content_hash: u64,
    /// Length of the payload that is sent (framed), whether stored or rebuilt.
    pub payload_len: u64,
}

/// Where the payload of a stored batch is (the part of the value written by the committer).
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq, Eq)]
pub(crate) enum BodyRecord {
    Segment {
        segment: u64,
        offset: u64,
        len: u64,
        checksum: u64,
    },
    Rebuild {
        epoch_start: Option<Vec<u8>>,
    },
}

impl BodyRecord {
    #[cfg(test)]
    pub(crate) fn from_body(body: &StoredBody) -> BodyRecord {
        match body {
            StoredBody::Payload(r) => BodyRecord::Segment {
                segment: r.segment,
                offset: r.offset,
                len: r.len,
                checksum: r.checksum,
            },
            StoredBody::Rebuild { epoch_start } => BodyRecord::Rebuild {
                epoch_start: epoch_start.clone(),
            },
        }
    }

    pub(crate) fn into_body(self) -> StoredBody {
        match self {
            BodyRecord::Segment {
                segment,
                offset,
                len,
                checksum,
            } => StoredBody::Payload(PayloadRef {
                segment,
                offset,
                len,
                checksum,
            }),
            BodyRecord::Rebuild { epoch_start } => StoredBody::Rebuild { epoch_start },
        }
    }
}

fn encode_error(what: &'static str, context: &str, detail: String) -> StateError {
    StateError::Encode {
        what,
        context: context.to_owned(),
        detail,
    }
}

fn serialize_error<'c>(
    what: &'static str,
    context: &'c str,
) -> impl FnOnce(bincode::Error) -> StateError + 'c {
    move |source| StateError::Serialize {
        what,
        context: context.to_owned(),
        source: Arc::from(source),
    }
}

fn deserialize_error(
    what: &'static str,
    key: &[u8],
    part: &'static str,
) -> impl FnOnce(bincode::Error) -> StateError {
    let key = show_key(key);
    move |source| StateError::Deserialize {
        what,
        key,
        part,
        source: Arc::from(source),
    }
}

/// The metadata part of a stored batch, encoded on the caller's thread.
pub(crate) fn encode_batch_header(
    batch: &SealedBatch,
    context: &str,
) -> Result<Vec<u8>, StateError> {
    let header = BatchHeaderRef {
        target: &batch.target,
        columns: &batch.columns,
        format: &batch.format,
        token: &batch.token,
        shard: &batch.shard,
        first_offset: batch.first_offset,
        last_offset: batch.last_offset,
        rows: batch.rows,
        encoded_bytes: batch.encoded_bytes,
        plan: &batch.plan,
        sealed_at_ms: batch.sealed_at_ms,
        content_hash: batch.content_hash,
        payload_len: batch.payload.len() as u64,
    };
    bincode::serialize(&header).map_err(serialize_error("batch header", context))
}

/// Stored batch: `[version=2][header_len: be32][bincode header][bincode body record]`.
pub(crate) fn encode_batch(
    header: &[u8],
    body: &BodyRecord,
    context: &str,
) -> Result<Vec<u8>, StateError> {
    let header_len = u32::try_from(header.len()).map_err(|_| {
        encode_error(
            "batch header",
            context,
            format!("header of {} bytes is too large", header.len()),
        )
    })?;
    let body = bincode::serialize(body).map_err(serialize_error("batch body", context))?;
    let mut out = Vec::with_capacity(5 + header.len() + body.len());
    out.push(BATCH_FORMAT_V2);
    out.extend_from_slice(&header_len.to_be_bytes());
    out.extend_from_slice(header);
    out.extend_from_slice(&body);
    Ok(out)
}

/// Decodes a stored batch's header and body record.
pub(crate) fn decode_batch_parts(
    key: &[u8],
    value: &[u8],
) -> Result<(BatchHeader, BodyRecord), StateError> {
    let bad = |detail: String| StateError::Decode {
        what: "batch",
        key: show_key(key),
        detail,
    };
    if value.len() < 5 {
        return Err(bad(format!("value of {} bytes is too short", value.len())));
    }
    if value[0] != BATCH_FORMAT_V2 {
        return Err(bad(format!(
            "batch format version {} (this flow reads version {BATCH_FORMAT_V2}): deliver the \
             backlog with the flow version that wrote it, or start on a new state directory",
            value[0]
        )));
    }
    let header_len = be_u32(&value[1..5]).ok_or_else(|| bad("bad header length".to_owned()))?;
    let header_end = 5usize.saturating_add(header_len as usize);
    if header_end > value.len() {
        return Err(bad(format!(
            "header length {header_len} exceeds value length {}",
            value.len()
        )));
    }
    let header: BatchHeader = bincode::deserialize(&value[5..header_end])
        .map_err(deserialize_error("batch", key, "bad header: "))?;
    let body: BodyRecord = bincode::deserialize(&value[header_end..])
        .map_err(deserialize_error("batch", key, "bad body record: "))?;
    Ok((header, body))
}

/// A stored batch's metadata (payload empty) and where its payload comes from.
pub(crate) fn decode_batch(
    key: &[u8],
    value: &[u8],
) -> Result<(SealedBatch, StoredBody), StateError> {
    let (h, body) = decode_batch_parts(key, value)?;
    let batch = SealedBatch {
        target: h.target,
        columns: h.columns,
        format: h.format,
        token: h.token,
        shard: h.shard,
        first_offset: h.first_offset,
        last_offset: h.last_offset,
        rows: h.rows,
        encoded_bytes: h.encoded_bytes,
        plan: h.plan,
        sealed_at_ms: h.sealed_at_ms,
        content_hash: h.content_hash,
        payload: bytes::Bytes::new(),
    };
    Ok((batch, body.into_body()))
}

pub(crate) fn encode_dead_letter(dl: &DeadLetter, context: &str) -> Result<Vec<u8>, StateError> {
    bincode::serialize(dl).map_err(serialize_error("dead letter", context))
}

pub(crate) fn decode_dead_letter(key: &[u8], value: &[u8]) -> Result<DeadLetter, StateError> {
    bincode::deserialize(value).map_err(deserialize_error("dead letter", key, ""))
}

pub(crate) fn encode_fingerprints(
    fingerprints: &BTreeMap<String, String>,
    context: &str,
) -> Result<Vec<u8>, StateError> {
    bincode::serialize(fingerprints).map_err(serialize_error("fingerprints", context))
}

pub(crate) fn decode_fingerprints(
    key: &[u8],
    value: &[u8],
) -> Result<BTreeMap<String, String>, StateError> {
    bincode::deserialize(value).map_err(deserialize_error("fingerprints", key, ""))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn batch() -> SealedBatch {
        SealedBatch {
            target: "default.events".into(),
            columns: vec!["a".into(), "b".into()],
            format: "RowBinary".into(),
            token: "tok-1".into(),
            shard: String::new(),
            first_offset: 7,
            last_offset: 9,
            rows: 3,
            encoded_bytes: 30,
            plan: "plan".into(),
            sealed_at_ms: 1_700_000_000_000,
            content_hash: 0xfeed,
            payload: bytes::Bytes::new(),
        }
    }

    #[test]
    fn batch_metadata_and_both_bodies_round_trip() {
        let b = batch();
        let header = encode_batch_header(&b, "t").unwrap();
        let bodies = [
            BodyRecord::Segment {
                segment: 3,
                offset: 4096,
                len: 70_000,
                checksum: 9,
            },
            BodyRecord::Rebuild {
                epoch_start: Some(vec![0, 0, 0, 5]),
            },
            BodyRecord::Rebuild { epoch_start: None },
        ];
        for body in bodies {
            let encoded = encode_batch(&header, &body, "t").unwrap();
            let (decoded, stored) = decode_batch(b"k", &encoded).unwrap();
            assert_eq!(decoded, b);
            assert_eq!(BodyRecord::from_body(&stored), body);
        }
    }

    #[test]
    fn batch_decoding_rejects_a_truncated_value_and_an_old_format() {
        let header = encode_batch_header(&batch(), "t").unwrap();
        let encoded =
            encode_batch(&header, &BodyRecord::Rebuild { epoch_start: None }, "t").unwrap();
        let err = decode_batch(b"k", &encoded[..encoded.len() - 1]).unwrap_err();
        assert!(
            matches!(
                err,
                StateError::Decode { what: "batch", .. }
                    | StateError::Deserialize { what: "batch", .. }
            ),
            "{err}"
        );
        let mut old = encoded.clone();
        old[0] = 1;
        let err = decode_batch(b"k", &old).unwrap_err().to_string();
        assert!(err.contains("batch format version 1"), "{err}");
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
