//! A partition's state as ZooKeeper holds it, read without a store (what `flow-worker status`
//! shows in cluster mode: every partition, whichever worker owns it).

use zookeeper_client as zk;

use super::layout;
use super::load;
use crate::codec;
use crate::error::StateError;
use crate::types::{StoredBatch, StoredCounter};

/// One partition's state in ZooKeeper.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ZkPartitionState {
    /// The committed source position, if any.
    pub position: Option<Vec<u8>>,
    /// The pending batches, by sink then seq, without payloads (every one is rebuilt from the
    /// source: [`crate::StoredBody::Rebuild`]).
    pub pending: Vec<(String, StoredBatch)>,
    /// The partition's counters, in (owner, name) order.
    pub counters: Vec<StoredCounter>,
    /// How many dead-letter references the partition holds.
    pub dead_letters: usize,
}

/// Reads `partition` of `pipeline` under `root` (the path of `--cluster`). Changes nothing: a
/// partition never written reads as the default (empty) state.
pub async fn read_partition(
    client: &zk::Client,
    root: &str,
    pipeline: &str,
    partition: u32,
) -> Result<ZkPartitionState, StateError> {
    let state = layout::state_path(root, pipeline, partition);
    let (loaded, model) = load::read(client, &state, pipeline, partition, false).await?;
    let mut pending = Vec::with_capacity(loaded.batches.len());
    for (key, value) in &loaded.batches {
        let queue = &key[..key.len().saturating_sub(8)];
        let (_, sink, _) = codec::parse_queue_key("batch key", queue)?;
        let seq = codec::parse_seq_suffix("batch key", key)?;
        let (batch, body) = codec::decode_batch(key, value)?;
        pending.push((sink, StoredBatch { seq, batch, body }));
    }
    Ok(ZkPartitionState {
        position: loaded.positions.into_iter().next().map(|(_, v)| v),
        pending,
        counters: model
            .counters
            .into_iter()
            .map(|((owner, name), value)| StoredCounter {
                pipeline: pipeline.to_owned(),
                owner,
                partition,
                name,
                value,
            })
            .collect(),
        dead_letters: loaded.dead_letters.len(),
    })
}
