//! `StateStore::summary`: everything in the store, for `flow-worker status`.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::codec::{self, Bounds, SOURCE_OWNER};
use crate::error::StateError;
use crate::trees::Trees;

/// How many of the newest dead letters are shown per owner and partition.
pub const RECENT_DEAD_LETTERS: usize = 5;
const PREVIEW_BYTES: usize = 200;

/// Everything a store holds, as `flow-worker status` shows it ([`crate::StateStore::summary`]).
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct StateSummary {
    /// Per pipeline name.
    pub pipelines: BTreeMap<String, PipelineSummary>,
}

/// What a store holds for one pipeline.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct PipelineSummary {
    /// Committed source position per partition.
    pub positions: BTreeMap<u32, PositionInfo>,
    /// Per sink and partition, ordered by (sink, partition).
    pub sinks: Vec<SinkPartitionSummary>,
    /// Dead letters of the source (owner `"source"`), per partition.
    pub source_dead_letters: Vec<DeadLetterGroupSummary>,
    /// Persisted counters of the source (owner `"source"`), per partition and name.
    #[serde(default)]
    pub source_counters: BTreeMap<u32, BTreeMap<String, u64>>,
}

/// A committed source position. Positions are opaque bytes: `value` holds them in the encoding
/// `encoding` names, text only when they are printable UTF-8, so a binary position never shows up
/// as garbage text.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct PositionInfo {
    /// The position as text when it is printable UTF-8 (no control characters).
    pub text: Option<String>,
    /// The position bytes in hex.
    pub hex: String,
    /// How [`PositionInfo::value`] is encoded.
    #[serde(default)]
    pub encoding: PositionEncoding,
    /// The position in `encoding`.
    #[serde(default)]
    pub value: String,
    /// Messages the source's broker holds beyond the position, as a running worker last saw
    /// them; the store does not keep it (a worker's status snapshot fills it in).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lag: Option<u64>,
}

/// How [`PositionInfo::value`] encodes a position.
#[derive(Clone, Copy, Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum PositionEncoding {
    /// Printable UTF-8 text, as is.
    Utf8,
    /// Lowercase hex, two digits per byte.
    #[default]
    Hex,
}

impl PositionInfo {
    /// Describes a stored position: as text when it is printable UTF-8, in hex otherwise.
    pub fn of(bytes: &[u8]) -> PositionInfo {
        let text = std::str::from_utf8(bytes)
            .ok()
            .filter(|t| !t.chars().any(char::is_control))
            .map(str::to_owned);
        let hex = hex(bytes);
        let (encoding, value) = match &text {
            Some(text) => (PositionEncoding::Utf8, text.clone()),
            None => (PositionEncoding::Hex, hex.clone()),
        };
        PositionInfo {
            text,
            hex,
            encoding,
            value,
            lag: None,
        }
    }
}

/// The outbox queue of one sink partition: its backlog, fingerprints, dead letters and counters.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct SinkPartitionSummary {
    /// The sink's name.
    pub sink: String,
    /// The source partition.
    pub partition: u32,
    /// Sequence number the next batch will get.
    pub next_seq: u64,
    /// Batches not yet acknowledged (shard parts count one each).
    pub undelivered: u64,
    /// Rows of the undelivered batches.
    pub rows: u64,
    /// Payload bytes of the undelivered batches.
    pub bytes: u64,
    /// The oldest undelivered batch, if any.
    pub oldest: Option<BatchInfo>,
    /// The newest undelivered batch, if any.
    pub newest: Option<BatchInfo>,
    /// The undelivered entries per shard (`""` when unsharded).
    #[serde(default)]
    pub shards: BTreeMap<String, ShardBacklog>,
    /// The sink's fingerprints (see [`crate::StateStore::fingerprints`]).
    pub fingerprints: BTreeMap<String, String>,
    /// Pending entries an attempt sent without getting an answer (they may have landed).
    #[serde(default)]
    pub unanswered: u64,
    /// Dead letters ever recorded for this sink partition, removed ones included (the next
    /// dead-letter sequence number).
    pub dead_letter_count: u64,
    /// The newest stored dead letters (at most [`RECENT_DEAD_LETTERS`]), newest first.
    pub recent_dead_letters: Vec<DeadLetterInfo>,
    /// Persisted counters of this sink partition, by name (totals over every run).
    #[serde(default)]
    pub counters: BTreeMap<String, u64>,
    /// Why the sink gave up in its last run, if it did (recorded when it happened; a new run of
    /// the sink clears it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gave_up: Option<ErrorRecord>,
    /// What the running worker saw since it started; the store does not keep it (a worker's
    /// status snapshot fills it in).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub run: Option<SinkRunStatus>,
}

/// A sink partition as the running worker saw it since it started.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct SinkRunStatus {
    /// When the worker started (ms since the Unix epoch).
    pub since_ms: u64,
    /// Per shard (`""` when unsharded), failed INSERT attempts and their retries.
    pub shards: BTreeMap<String, ShardRunStatus>,
    /// The sink gave up: it fails every later write until the worker restarts.
    pub gave_up: Option<ErrorRecord>,
}

/// One shard's failures since the worker started.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct ShardRunStatus {
    /// Failed INSERT attempts.
    pub errors: u64,
    /// Failed attempts that were tried again.
    pub retries: u64,
    /// The newest failure, if any.
    pub last_error: Option<ErrorRecord>,
}

/// An error as shown to an operator.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct ErrorRecord {
    /// The server's error code, when the server answered with one.
    pub code: Option<u32>,
    /// The error class (`transient`, `permanent`, ...).
    pub class: String,
    /// The error message.
    pub text: String,
    /// When it happened (ms since the Unix epoch).
    pub at_ms: u64,
}

/// One shard's part of a sink partition's backlog.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct ShardBacklog {
    /// Entries not yet acknowledged.
    pub undelivered: u64,
    /// Rows of those entries.
    pub rows: u64,
    /// When its oldest undelivered entry was sealed (ms since the Unix epoch).
    pub oldest_sealed_at_ms: u64,
}

/// One undelivered batch as `status` shows it (the header of a [`crate::SealedBatch`]).
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct BatchInfo {
    /// Its sequence number in the queue.
    pub seq: u64,
    /// Where it is written, e.g. `default.events`.
    pub target: String,
    /// Its encoding, e.g. `RowBinary`.
    pub format: String,
    /// The shard it is for (`""` when unsharded).
    pub shard: String,
    /// Its deduplication token.
    pub token: String,
    /// Message id of its first row within the partition.
    pub first_offset: u64,
    /// Message id of its last row within the partition.
    pub last_offset: u64,
    /// Rows in the batch.
    pub rows: u64,
    /// Bytes sent for the batch (framed payload), whether stored or rebuilt.
    pub bytes: u64,
    /// When the batch was sealed (ms since the Unix epoch).
    pub sealed_at_ms: u64,
    /// Whether the outbox keeps its payload or only its bounds.
    pub stored: BatchBody,
}

/// What the outbox keeps of a batch.
#[derive(Clone, Copy, Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum BatchBody {
    /// The payload, in a segment file.
    #[default]
    Payload,
    /// Bounds only: rebuilt from the source on replay.
    Bounds,
}

/// The dead letters of one owner in one partition.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct DeadLetterGroupSummary {
    /// The source partition.
    pub partition: u32,
    /// Dead letters ever recorded, removed ones included.
    pub count: u64,
    /// The newest stored ones (at most [`RECENT_DEAD_LETTERS`]), newest first.
    pub recent: Vec<DeadLetterInfo>,
}

/// One stored dead letter as `status` shows it.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct DeadLetterInfo {
    /// Its sequence number among its owner's dead letters of the partition.
    pub seq: u64,
    /// The source partition.
    pub partition: u32,
    /// The message id within the partition, when known.
    pub offset: Option<u64>,
    /// Why it was set aside.
    pub reason: String,
    /// Length of the payload in bytes.
    pub payload_len: u64,
    /// The first bytes of the payload, lossily decoded as UTF-8.
    pub payload_preview: String,
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn sled_err(op: &'static str, tree: &'static str) -> impl FnOnce(sled::Error) -> StateError {
    move |e| StateError::sled(op, tree, e)
}

fn sink_entry(
    map: &mut BTreeMap<(String, String, u32), SinkPartitionSummary>,
    pipeline: String,
    sink: String,
    partition: u32,
) -> &mut SinkPartitionSummary {
    map.entry((pipeline, sink.clone(), partition))
        .or_insert_with(|| SinkPartitionSummary {
            sink,
            partition,
            ..SinkPartitionSummary::default()
        })
}

fn recent_dead_letters(trees: &Trees, prefix: &[u8]) -> Result<Vec<DeadLetterInfo>, StateError> {
    let mut out = Vec::new();
    for item in trees
        .dead_letters
        .scan_prefix(prefix)
        .rev()
        .take(RECENT_DEAD_LETTERS)
    {
        let (k, v) = item.map_err(sled_err("scan", "dead_letters"))?;
        let dl = codec::decode_dead_letter(&k, &v)?;
        let shown = &dl.payload[..dl.payload.len().min(PREVIEW_BYTES)];
        out.push(DeadLetterInfo {
            seq: codec::parse_seq_suffix("dead letter key", &k)?,
            partition: dl.partition,
            offset: dl.offset,
            reason: dl.reason,
            payload_len: dl.payload.len() as u64,
            payload_preview: String::from_utf8_lossy(shown).into_owned(),
        });
    }
    out.reverse();
    Ok(out)
}

/// The prefix of the sink values a sink keeps per pending entry whose attempt got no answer:
/// `unanswered/<partition>/<seq>` (written by the ClickHouse sinks).
const UNANSWERED_PREFIX: &str = "unanswered/";

impl ErrorRecord {
    /// The bytes of the record as a sink value keeps it.
    pub fn encode(&self) -> Vec<u8> {
        // Serializing a struct of strings and numbers into a Vec cannot fail.
        bincode::serialize(self).unwrap_or_default()
    }

    /// A record from [`ErrorRecord::encode`]; `None` for bytes of another format.
    pub fn decode(bytes: &[u8]) -> Option<ErrorRecord> {
        bincode::deserialize(bytes).ok()
    }
}

/// The sink value a sink partition's give-up is recorded under (an [`ErrorRecord`] in JSON).
pub fn gave_up_value_name(partition: u32) -> String {
    format!("{GAVE_UP_PREFIX}{partition}")
}

const GAVE_UP_PREFIX: &str = "gave_up/";

/// Counts the unanswered-attempt records of each sink partition and reads their give-ups.
fn count_unanswered(
    trees: &Trees,
    sinks: &mut BTreeMap<(String, String, u32), SinkPartitionSummary>,
) -> Result<(), StateError> {
    for item in trees.sink_values.iter() {
        let (k, _) = item.map_err(sled_err("scan", "sink_values"))?;
        let Some((pipeline, sink, name)) = codec::split_sink_value_key(&k) else {
            continue;
        };
        let name = String::from_utf8_lossy(name);
        if let Some(partition) = name
            .strip_prefix(GAVE_UP_PREFIX)
            .and_then(|p| p.parse().ok())
        {
            let pipeline = String::from_utf8_lossy(pipeline).into_owned();
            let sink = String::from_utf8_lossy(sink).into_owned();
            // A record this version cannot read is not shown rather than failing `status`.
            let record = trees
                .sink_values
                .get(&k)
                .ok()
                .flatten()
                .and_then(|v| ErrorRecord::decode(&v));
            sink_entry(sinks, pipeline, sink, partition).gave_up = record;
            continue;
        }
        let Some(partition) = name
            .strip_prefix(UNANSWERED_PREFIX)
            .and_then(|rest| rest.split('/').next())
            .and_then(|p| p.parse().ok())
        else {
            continue;
        };
        let pipeline = String::from_utf8_lossy(pipeline).into_owned();
        let sink = String::from_utf8_lossy(sink).into_owned();
        sink_entry(sinks, pipeline, sink, partition).unanswered += 1;
    }
    Ok(())
}

pub(crate) fn build(trees: &Trees) -> Result<StateSummary, StateError> {
    let mut summary = StateSummary::default();
    for item in trees.positions.iter() {
        let (k, v) = item.map_err(sled_err("scan", "positions"))?;
        let (pipeline, partition) = codec::parse_position_key(&k)?;
        summary
            .pipelines
            .entry(pipeline)
            .or_default()
            .positions
            .insert(partition, PositionInfo::of(&v));
    }

    let mut sinks: BTreeMap<(String, String, u32), SinkPartitionSummary> = BTreeMap::new();
    for item in trees.batch_seq.iter() {
        let (k, v) = item.map_err(sled_err("scan", "batch_seq"))?;
        let (pipeline, sink, partition) = codec::parse_queue_key("queue key", &k)?;
        let bounds = Bounds::decode(&k, &v)?;
        let entry = sink_entry(&mut sinks, pipeline, sink, partition);
        entry.next_seq = bounds.next;
        for item in trees.batches.scan_prefix(&k) {
            let (bk, bv) = item.map_err(sled_err("scan", "batches"))?;
            let (header, body) = codec::decode_batch_parts(&bk, &bv)?;
            let info = BatchInfo {
                seq: codec::parse_seq_suffix("batch key", &bk)?,
                target: header.target,
                format: header.format,
                shard: header.shard,
                token: header.token,
                first_offset: header.first_offset,
                last_offset: header.last_offset,
                rows: header.rows,
                bytes: header.payload_len,
                sealed_at_ms: header.sealed_at_ms,
                stored: match body {
                    codec::BodyRecord::Segment { .. } => BatchBody::Payload,
                    codec::BodyRecord::Rebuild { .. } => BatchBody::Bounds,
                },
            };
            entry.undelivered += 1;
            entry.rows += info.rows;
            entry.bytes += info.bytes;
            let shard = entry.shards.entry(info.shard.clone()).or_default();
            if shard.undelivered == 0 || info.sealed_at_ms < shard.oldest_sealed_at_ms {
                shard.oldest_sealed_at_ms = info.sealed_at_ms;
            }
            shard.undelivered += 1;
            shard.rows += info.rows;
            if entry.oldest.is_none() {
                entry.oldest = Some(info.clone());
            }
            entry.newest = Some(info);
        }
    }
    for item in trees.fingerprints.iter() {
        let (k, v) = item.map_err(sled_err("scan", "fingerprints"))?;
        let (pipeline, sink, partition) = codec::parse_queue_key("fingerprints key", &k)?;
        sink_entry(&mut sinks, pipeline, sink, partition).fingerprints =
            codec::decode_fingerprints(&k, &v)?;
    }
    for item in trees.dead_letter_seq.iter() {
        let (k, v) = item.map_err(sled_err("scan", "dead_letter_seq"))?;
        let (pipeline, owner, partition) = codec::parse_queue_key("dead letter counter key", &k)?;
        let count = codec::decode_counter(&k, &v)?;
        let recent = recent_dead_letters(trees, &k)?;
        if owner == SOURCE_OWNER {
            summary
                .pipelines
                .entry(pipeline)
                .or_default()
                .source_dead_letters
                .push(DeadLetterGroupSummary {
                    partition,
                    count,
                    recent,
                });
        } else {
            let entry = sink_entry(&mut sinks, pipeline, owner, partition);
            entry.dead_letter_count = count;
            entry.recent_dead_letters = recent;
        }
    }
    count_unanswered(trees, &mut sinks)?;
    for counter in crate::counters::read_all(trees)? {
        let pipeline = counter.pipeline;
        if counter.owner == SOURCE_OWNER {
            summary
                .pipelines
                .entry(pipeline)
                .or_default()
                .source_counters
                .entry(counter.partition)
                .or_default()
                .insert(counter.name, counter.value);
        } else {
            sink_entry(&mut sinks, pipeline, counter.owner, counter.partition)
                .counters
                .insert(counter.name, counter.value);
        }
    }
    for ((pipeline, _, _), entry) in sinks {
        summary
            .pipelines
            .entry(pipeline)
            .or_default()
            .sinks
            .push(entry);
    }
    tracing::trace!(pipelines = summary.pipelines.len(), "state summary built");
    Ok(summary)
}

/// The names of the sinks the store knows (every pipeline): those with batches, fingerprints, dead
/// letters, counters or sink-wide values. The source's owner name is not among them.
pub(crate) fn sink_names(trees: &Trees) -> Result<std::collections::BTreeSet<String>, StateError> {
    let mut names: std::collections::BTreeSet<String> = build(trees)?
        .pipelines
        .into_values()
        .flat_map(|p| p.sinks.into_iter().map(|s| s.sink))
        .collect();
    // `build` sees only the values it reads (give-ups, unanswered attempts); a sink may hold
    // nothing but other values (a recorded schema, a token namespace).
    for item in trees.sink_values.iter() {
        let (k, _) = item.map_err(sled_err("scan", "sink_values"))?;
        if let Some((_, sink, _)) = codec::split_sink_value_key(&k) {
            names.insert(String::from_utf8_lossy(sink).into_owned());
        }
    }
    names.remove(SOURCE_OWNER);
    Ok(names)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn binary_positions_are_hex_and_never_text() {
        // Valid UTF-8, but control characters: a big-endian word, not text.
        let word = PositionInfo::of(&16u64.to_be_bytes());
        assert_eq!(
            (word.text, word.encoding, word.value.as_str()),
            (None, PositionEncoding::Hex, "0000000000000010")
        );
        let invalid = PositionInfo::of(&[0xff, 0xfe]);
        assert_eq!(
            (invalid.encoding, invalid.value.as_str()),
            (PositionEncoding::Hex, "fffe")
        );
        let text = PositionInfo::of(b"pos-2");
        assert_eq!(
            (text.text.as_deref(), text.encoding, text.value.as_str()),
            (Some("pos-2"), PositionEncoding::Utf8, "pos-2")
        );
        let json = serde_json::to_value(PositionInfo::of(&[0x00, 0x80])).unwrap_or_default();
        assert_eq!(json["encoding"], "hex");
        assert_eq!(json["value"], "0080");
    }
}
