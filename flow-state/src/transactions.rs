//! The sled transaction of each request: closures that only read and insert bytes encoded
//! beforehand ([`crate::prepare`]), since sled may run them more than once.

use sled::transaction::abort;
use sled::Transactional;

use crate::codec::{decode_batch_parts, decode_counter, seq_key, show_key, BodyRecord, Bounds};
use crate::error::StateError;
use crate::prepare::{PreparedAck, PreparedCommit, PreparedDeadLetters, PreparedFingerprints};
use crate::trees::{tx_error, Trees, TxResult};
use crate::types::CommitReceipt;

fn read_bounds(tree: &sled::transaction::TransactionalTree, key: &[u8]) -> TxResult<Bounds> {
    match tree.get(key)? {
        Some(v) => Bounds::decode(key, &v).or_else(abort),
        None => Ok(Bounds::default()),
    }
}

fn append_dead_letters(
    dead_letters: &sled::transaction::TransactionalTree,
    counters: &sled::transaction::TransactionalTree,
    prepared: &PreparedDeadLetters,
) -> TxResult<()> {
    if prepared.items.is_empty() {
        return Ok(());
    }
    let key = prepared.counter_key.as_slice();
    let mut next = match counters.get(key)? {
        Some(v) => decode_counter(key, &v).or_else(abort)?,
        None => 0,
    };
    for item in &prepared.items {
        dead_letters.insert(seq_key(key, next), item.as_slice())?;
        next = match next.checked_add(1) {
            Some(n) => n,
            None => {
                return abort(StateError::Overflow {
                    target: show_key(key),
                })
            }
        };
    }
    counters.insert(key, &next.to_be_bytes()[..])?;
    Ok(())
}

pub(crate) fn apply_commit(t: &Trees, c: &PreparedCommit) -> Result<CommitReceipt, StateError> {
    (
        &t.positions,
        &t.batches,
        &t.batch_seq,
        &t.dead_letters,
        &t.dead_letter_seq,
        &t.counters,
    )
        .transaction(
            |(positions, batches, batch_seq, dead_letters, dl_seq, counters)| {
                crate::counters::apply(counters, &c.counters)?;
                if let Some(position) = &c.position {
                    positions.insert(c.position_key.as_slice(), position.as_slice())?;
                }
                for key in &c.removed_dead_letters {
                    dead_letters.remove(key.as_slice())?;
                }
                append_dead_letters(dead_letters, dl_seq, &c.source_dead_letters)?;
                let mut receipt = Vec::with_capacity(c.sinks.len());
                for sink in &c.sinks {
                    let mut seqs = Vec::with_capacity(sink.batches.len());
                    if !sink.values.is_empty() {
                        let mut bounds = read_bounds(batch_seq, &sink.queue_key)?;
                        for value in &sink.values {
                            let seq = bounds.next;
                            batches.insert(seq_key(&sink.queue_key, seq), value.as_slice())?;
                            seqs.push(seq);
                            bounds.next = match seq.checked_add(1) {
                                Some(n) => n,
                                None => {
                                    return abort(StateError::Overflow {
                                        target: show_key(&sink.queue_key),
                                    })
                                }
                            };
                        }
                        batch_seq.insert(sink.queue_key.as_slice(), &bounds.encode()[..])?;
                    }
                    append_dead_letters(dead_letters, dl_seq, &sink.dead_letters)?;
                    receipt.push((sink.sink.clone(), seqs));
                }
                Ok(CommitReceipt {
                    batch_seqs: receipt,
                })
            },
        )
        .map_err(|e| {
            tx_error(
                "commit transaction",
                format!("pipeline {} partition {}", c.pipeline, c.partition),
                e,
            )
        })
}

/// Removes a pending batch; returns the segment its payload was in, if any.
///
/// Any pending batch may go, not only the oldest: the parts of one logical batch bound for
/// different shards are delivered independently, each in order within its shard. `head` stays a
/// lower bound of the pending sequence numbers.
pub(crate) fn apply_ack(t: &Trees, a: &PreparedAck) -> Result<Option<u64>, StateError> {
    (
        &t.batches,
        &t.batch_seq,
        &t.sink_values,
        &t.dead_letters,
        &t.dead_letter_seq,
        &t.counters,
    )
        .transaction(
            |(batches, batch_seq, sink_values, dead_letters, dl_seq, counters)| {
                let mut bounds = read_bounds(batch_seq, &a.queue_key)?;
                let batch_key = seq_key(&a.queue_key, a.seq);
                let removed = if (bounds.head..bounds.next).contains(&a.seq) {
                    batches.remove(batch_key.as_slice())?
                } else {
                    None
                };
                let Some(removed) = removed else {
                    return abort(StateError::NotPending {
                        key: a.key.clone(),
                        seq: a.seq,
                    });
                };
                let segment = match decode_batch_parts(&batch_key, &removed).or_else(abort)?.1 {
                    BodyRecord::Segment { segment, .. } => Some(segment),
                    BodyRecord::Rebuild { .. } => None,
                };
                if a.seq == bounds.head {
                    bounds.head = a.seq + 1;
                    batch_seq.insert(a.queue_key.as_slice(), &bounds.encode()[..])?;
                }
                for (key, value) in &a.sink_values {
                    sink_values.insert(key.as_slice(), value.as_slice())?;
                }
                for key in &a.removed_sink_values {
                    sink_values.remove(key.as_slice())?;
                }
                append_dead_letters(dead_letters, dl_seq, &a.dead_letters)?;
                crate::counters::apply(counters, &a.counters)?;
                Ok(segment)
            },
        )
        .map_err(|e| tx_error("acknowledge transaction", a.key.to_string(), e))
}

pub(crate) fn apply_sink_value(
    t: &Trees,
    key: &[u8],
    value: Option<&[u8]>,
) -> Result<(), StateError> {
    let result = match value {
        Some(value) => t.sink_values.insert(key, value).map(|_| ()),
        None => t.sink_values.remove(key).map(|_| ()),
    };
    result.map_err(|e| StateError::sled("set sink value", show_key(key), e))
}

pub(crate) fn apply_dead_letter_removal(t: &Trees, keys: &[Vec<u8>]) -> Result<u64, StateError> {
    t.dead_letters
        .transaction(|tree| {
            let mut removed = 0;
            for key in keys {
                removed += u64::from(tree.remove(key.as_slice())?.is_some());
            }
            Ok(removed)
        })
        .map_err(|e| tx_error("dead letter removal", format!("{} keys", keys.len()), e))
}

pub(crate) fn apply_fingerprints(t: &Trees, f: &PreparedFingerprints) -> Result<(), StateError> {
    let result = match &f.encoded {
        Some(value) => t
            .fingerprints
            .insert(f.queue_key.as_slice(), value.as_slice()),
        None => t.fingerprints.remove(f.queue_key.as_slice()),
    };
    result
        .map(|_| ())
        .map_err(|e| StateError::sled("fingerprints insert", f.key.to_string(), e))
}
