//! Persisted monotonic counters (`counters` tree): additions ride in the transaction of the
//! commit or acknowledgement they count, so a counter is exactly as durable as what it counts and
//! never goes backwards across a restart or a crash.

use sled::transaction::{abort, TransactionalTree};

use crate::codec::{self, check_name, decode_counter};
use crate::error::StateError;
use crate::trees::{Trees, TxResult};
use crate::types::{CounterAdd, StoredCounter};

/// A [`CounterAdd`] with its key encoded.
pub(crate) struct PreparedCounter {
    pub key: Vec<u8>,
    pub by: u64,
}

/// Encodes the additions of `pipeline`/`partition` (names checked like every other name).
pub(crate) fn prepare(
    pipeline: &str,
    partition: u32,
    adds: &[CounterAdd],
) -> Result<Vec<PreparedCounter>, StateError> {
    adds.iter()
        .filter(|add| add.by > 0)
        .map(|add| {
            check_name("counter owner", &add.owner)?;
            check_name("counter", &add.name)?;
            Ok(PreparedCounter {
                key: codec::counter_key(pipeline, &add.owner, partition, &add.name),
                by: add.by,
            })
        })
        .collect()
}

/// Adds inside a transaction (sled may rerun the closure: the read is part of it).
pub(crate) fn apply(tree: &TransactionalTree, counters: &[PreparedCounter]) -> TxResult<()> {
    for counter in counters {
        let key = counter.key.as_slice();
        let current = match tree.get(key)? {
            Some(v) => decode_counter(key, &v).or_else(abort)?,
            None => 0,
        };
        // Saturating: a counter stuck at u64::MAX is wrong, but a failed commit would be worse.
        let next = current.saturating_add(counter.by);
        tree.insert(key, &next.to_be_bytes()[..])?;
    }
    Ok(())
}

/// Every counter of the store, in key order.
pub(crate) fn read_all(trees: &Trees) -> Result<Vec<StoredCounter>, StateError> {
    let mut out = Vec::new();
    for item in trees.counters.iter() {
        let (k, v) = item.map_err(|e| StateError::sled("scan", "counters", e))?;
        let (pipeline, owner, partition, name) = codec::parse_counter_key(&k)?;
        out.push(StoredCounter {
            pipeline,
            owner,
            partition,
            name,
            value: decode_counter(&k, &v)?,
        });
    }
    Ok(out)
}
