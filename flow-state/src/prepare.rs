//! Requests encoded on the caller's thread: every key and value of a commit, acknowledgement or
//! fingerprint update is built here, so that the committer's transaction closures (which sled may
//! rerun) only read and insert bytes.

use std::collections::BTreeMap;

use crate::codec::{self, check_name, show_key, BodyRecord, SOURCE_OWNER};
use crate::counters::{self, PreparedCounter};
use crate::error::StateError;
use crate::types::{
    BatchStorage, DeadLetter, EpochCommit, SealedBatch, SinkPartition, StoredDeadLetter,
};

/// Dead letters of one owner, already encoded.
pub(crate) struct PreparedDeadLetters {
    /// `pipeline\0 owner\0 partition`.
    pub counter_key: Vec<u8>,
    pub items: Vec<Vec<u8>>,
}

/// A batch whose metadata is encoded; its body record is written by the committer (a payload
/// must be appended to a segment first).
pub(crate) struct PreparedBatch {
    pub header: Vec<u8>,
    pub body: PreparedBody,
}

pub(crate) enum PreparedBody {
    Payload { bytes: bytes::Bytes, checksum: u64 },
    Record(BodyRecord),
}

pub(crate) struct PreparedSink {
    pub sink: String,
    /// `pipeline\0 sink\0 partition`.
    pub queue_key: Vec<u8>,
    pub batches: Vec<PreparedBatch>,
    /// The encoded values of `batches`, filled in by [`Committer::stage`].
    pub values: Vec<Vec<u8>>,
    /// Segments referenced by `values`.
    pub segments: Vec<u64>,
    pub dead_letters: PreparedDeadLetters,
}

/// An [`crate::EpochCommit`] with every value encoded (transaction closures only insert bytes).
pub(crate) struct PreparedCommit {
    pub pipeline: String,
    pub partition: u32,
    pub position_key: Vec<u8>,
    /// `None` leaves the position as it is (dead letters requeued into the outbox).
    pub position: Option<Vec<u8>>,
    pub source_dead_letters: PreparedDeadLetters,
    pub sinks: Vec<PreparedSink>,
    /// `dead_letters` keys removed in the same transaction.
    pub removed_dead_letters: Vec<Vec<u8>>,
    /// Counter additions made with the commit.
    pub counters: Vec<PreparedCounter>,
}

pub(crate) struct PreparedAck {
    pub key: SinkPartition,
    pub queue_key: Vec<u8>,
    pub seq: u64,
    pub sink_values: Vec<(Vec<u8>, Vec<u8>)>,
    /// `sink_values` keys removed with the acknowledgement.
    pub removed_sink_values: Vec<Vec<u8>>,
    /// Rows of the batch set aside, recorded in the same transaction.
    pub dead_letters: PreparedDeadLetters,
    /// Counter additions made with the acknowledgement.
    pub counters: Vec<PreparedCounter>,
}

pub(crate) struct PreparedFingerprints {
    pub key: SinkPartition,
    pub queue_key: Vec<u8>,
    /// `None` removes the entry (empty map).
    pub encoded: Option<Vec<u8>>,
}

pub(crate) fn prepare_batch(
    batch: &SealedBatch,
    storage: &BatchStorage,
    context: &str,
) -> Result<PreparedBatch, StateError> {
    let body = match storage {
        BatchStorage::Payload => PreparedBody::Payload {
            checksum: xxhash_rust::xxh64::xxh64(&batch.payload, 0),
            bytes: batch.payload.clone(),
        },
        BatchStorage::Bounds { epoch_start } => PreparedBody::Record(BodyRecord::Rebuild {
            epoch_start: epoch_start.clone(),
        }),
    };
    Ok(PreparedBatch {
        header: codec::encode_batch_header(batch, context)?,
        body,
    })
}

pub(crate) fn prepare_dead_letters(
    pipeline: &str,
    owner: &str,
    partition: u32,
    items: &[DeadLetter],
) -> Result<PreparedDeadLetters, StateError> {
    let counter_key = codec::queue_key(pipeline, owner, partition);
    let context = show_key(&counter_key);
    let items = items
        .iter()
        .map(|dl| codec::encode_dead_letter(dl, &context))
        .collect::<Result<_, _>>()?;
    Ok(PreparedDeadLetters { counter_key, items })
}

pub(crate) fn prepare_commit(c: &EpochCommit) -> Result<PreparedCommit, StateError> {
    check_name("pipeline", &c.pipeline)?;
    let mut sinks = Vec::with_capacity(c.sinks.len());
    for sink in &c.sinks {
        check_name("sink", &sink.sink)?;
        let queue_key = codec::queue_key(&c.pipeline, &sink.sink, c.partition);
        let context = show_key(&queue_key);
        let batches = sink
            .batches
            .iter()
            .map(|b| prepare_batch(b, &sink.storage, &context))
            .collect::<Result<Vec<_>, _>>()?;
        sinks.push(PreparedSink {
            sink: sink.sink.clone(),
            queue_key,
            values: Vec::with_capacity(batches.len()),
            segments: Vec::new(),
            batches,
            dead_letters: prepare_dead_letters(
                &c.pipeline,
                &sink.sink,
                c.partition,
                &sink.dead_letters,
            )?,
        });
    }
    Ok(PreparedCommit {
        pipeline: c.pipeline.clone(),
        partition: c.partition,
        position_key: codec::position_key(&c.pipeline, c.partition),
        position: Some(c.position.clone()),
        source_dead_letters: prepare_dead_letters(
            &c.pipeline,
            SOURCE_OWNER,
            c.partition,
            &c.source_dead_letters,
        )?,
        sinks,
        removed_dead_letters: Vec::new(),
        counters: counters::prepare(&c.pipeline, c.partition, &c.counters)?,
    })
}

/// The commit of [`StateStore::requeue_dead_letters_blocking`] for one partition.
pub(crate) fn prepare_requeue(
    pipeline: &str,
    partition: u32,
    items: &[(StoredDeadLetter, SealedBatch)],
) -> Result<PreparedCommit, StateError> {
    check_name("pipeline", pipeline)?;
    let mut sinks: BTreeMap<&str, Vec<&SealedBatch>> = BTreeMap::new();
    for (letter, batch) in items {
        sinks.entry(letter.owner.as_str()).or_default().push(batch);
    }
    let none = |owner: &str| prepare_dead_letters(pipeline, owner, partition, &[]);
    let mut prepared = Vec::with_capacity(sinks.len());
    for (sink, batches) in sinks {
        let queue_key = codec::queue_key(pipeline, sink, partition);
        let context = show_key(&queue_key);
        let batches = batches
            .into_iter()
            .map(|b| prepare_batch(b, &BatchStorage::Payload, &context))
            .collect::<Result<Vec<_>, _>>()?;
        prepared.push(PreparedSink {
            sink: sink.to_owned(),
            queue_key,
            values: Vec::with_capacity(batches.len()),
            segments: Vec::new(),
            batches,
            dead_letters: none(sink)?,
        });
    }
    Ok(PreparedCommit {
        pipeline: pipeline.to_owned(),
        partition,
        position_key: codec::position_key(pipeline, partition),
        position: None,
        source_dead_letters: none(SOURCE_OWNER)?,
        sinks: prepared,
        removed_dead_letters: items.iter().map(|(l, _)| dead_letter_key(l)).collect(),
        counters: Vec::new(),
    })
}

pub(crate) fn dead_letter_key(letter: &StoredDeadLetter) -> Vec<u8> {
    let prefix = codec::queue_key(&letter.pipeline, &letter.owner, letter.letter.partition);
    codec::seq_key(&prefix, letter.seq)
}

pub(crate) fn check_key(key: &SinkPartition) -> Result<(), StateError> {
    check_name("pipeline", &key.pipeline)?;
    check_name("sink", &key.sink)
}

pub(crate) fn prepare_ack(
    key: &SinkPartition,
    seq: u64,
    sink_values: Vec<(String, Vec<u8>)>,
) -> Result<PreparedAck, StateError> {
    check_key(key)?;
    let mut values = Vec::with_capacity(sink_values.len());
    for (name, value) in sink_values {
        check_name("sink value", &name)?;
        values.push((
            codec::sink_value_key(&key.pipeline, &key.sink, &name),
            value,
        ));
    }
    Ok(PreparedAck {
        key: key.clone(),
        queue_key: codec::sink_queue_key(key),
        seq,
        sink_values: values,
        removed_sink_values: Vec::new(),
        dead_letters: PreparedDeadLetters {
            counter_key: Vec::new(),
            items: Vec::new(),
        },
        counters: Vec::new(),
    })
}

pub(crate) fn prepare_fingerprints(
    key: &SinkPartition,
    fingerprints: &BTreeMap<String, String>,
) -> Result<PreparedFingerprints, StateError> {
    check_key(key)?;
    let encoded = if fingerprints.is_empty() {
        None
    } else {
        Some(codec::encode_fingerprints(fingerprints, &key.to_string())?)
    };
    Ok(PreparedFingerprints {
        key: key.clone(),
        queue_key: codec::sink_queue_key(key),
        encoded,
    })
}
