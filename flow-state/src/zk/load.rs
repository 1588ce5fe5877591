//! Loading a partition: reading its state nodes from ZooKeeper, and replacing the partition's
//! local sled entries with them (on the committer thread, in one transaction).

use std::collections::BTreeMap;

use sled::Transactional;
use zookeeper_client as zk;

use super::encoding;
use super::layout::Child;
use super::model::Model;
use crate::codec::{self, BodyRecord, Bounds};
use crate::error::StateError;
use crate::trees::{tx_error, Trees};

/// Reads of one multi-read: a partition holds at most its pending bound of batches plus a few
/// nodes per sink, and each reply stays far below ZooKeeper's 1 MiB.
const READ_CHUNK: usize = 64;

/// Every sled entry of one partition, as read from ZooKeeper, per tree.
#[derive(Default)]
pub(crate) struct PreparedLoad {
    pub pipeline: String,
    pub partition: u32,
    pub positions: Vec<(Vec<u8>, Vec<u8>)>,
    pub batches: Vec<(Vec<u8>, Vec<u8>)>,
    pub batch_seq: Vec<(Vec<u8>, Vec<u8>)>,
    pub fingerprints: Vec<(Vec<u8>, Vec<u8>)>,
    pub dead_letters: Vec<(Vec<u8>, Vec<u8>)>,
    pub dead_letter_seq: Vec<(Vec<u8>, Vec<u8>)>,
    pub counters: Vec<(Vec<u8>, Vec<u8>)>,
    pub sink_values: Vec<(Vec<u8>, Vec<u8>)>,
}

fn zk_error<'p>(op: &'static str, path: &'p str) -> impl FnOnce(zk::Error) -> StateError + 'p {
    move |source| StateError::ZooKeeper {
        op,
        path: path.to_owned(),
        source,
    }
}

/// Checks a value against the sled decoder of its kind, naming the node when it fails.
fn checked<T>(path: &str, decoded: Result<T, StateError>) -> Result<T, StateError> {
    decoded.map_err(|e| StateError::BadNode {
        path: path.to_owned(),
        detail: e.to_string(),
    })
}

/// Reads `partition`'s state from its `state` node. With `create`, the node is created empty the
/// first time (a load, before writes create children); without, a missing node reads as an
/// empty state and a child deleted after the listing as absent (`status`, which changes nothing
/// and may run beside the partition's owner).
pub(crate) async fn read(
    client: &zk::Client,
    state: &str,
    pipeline: &str,
    partition: u32,
    create: bool,
) -> Result<(PreparedLoad, Model), StateError> {
    let mut load = PreparedLoad {
        pipeline: pipeline.to_owned(),
        partition,
        ..PreparedLoad::default()
    };
    if create {
        let options = zk::CreateMode::Persistent.with_acls(zk::Acls::anyone_all());
        client
            .mkdir(state, &options)
            .await
            .map_err(zk_error("create", state))?;
    }
    let mut names = match client.list_children(state).await {
        Ok(names) => names,
        Err(zk::Error::NoNode) if !create => return Ok((load, Model::default())),
        Err(e) => return Err(zk_error("list children", state)(e)),
    };
    names.sort();
    let mut model = Model::default();
    for chunk in names.chunks(READ_CHUNK) {
        let mut reader = client.new_multi_reader();
        for name in chunk {
            let path = format!("{state}/{name}");
            reader
                .add_get_data(&path)
                .map_err(zk_error("read", &path))?;
        }
        let results = reader
            .commit()
            .await
            .map_err(zk_error("multi-read of the children", state))?;
        for (name, result) in chunk.iter().zip(results) {
            let path = format!("{state}/{name}");
            let data = match result {
                zk::MultiReadResult::Data { data, .. } => data,
                // A read-only look at a partition another worker owns races its writes: a batch
                // delivered between the listing and this read is gone, and so no longer pending.
                zk::MultiReadResult::Error {
                    err: zk::Error::NoNode,
                } if !create => continue,
                zk::MultiReadResult::Error { err } => return Err(zk_error("read", &path)(err)),
                _ => {
                    return Err(StateError::BadNode {
                        path,
                        detail: "ZooKeeper answered a read of its data with something else"
                            .to_owned(),
                    })
                }
            };
            let child = Child::parse(name).ok_or_else(|| StateError::BadNode {
                path: path.clone(),
                detail: "a child name this flow version does not write".to_owned(),
            })?;
            add(&mut load, &mut model, &child, data, &path)?;
            model.nodes.insert(name.clone());
        }
    }
    Ok((load, model))
}

/// Adds one node to the sled entries and to the model.
fn add(
    load: &mut PreparedLoad,
    model: &mut Model,
    child: &Child,
    data: Vec<u8>,
    path: &str,
) -> Result<(), StateError> {
    let (pipeline, partition) = (load.pipeline.as_str(), load.partition);
    match child {
        Child::Position => load
            .positions
            .push((codec::position_key(pipeline, partition), data)),
        Child::Counters => {
            for ((owner, name), value) in encoding::decode_counters(&data, path)? {
                let key = codec::counter_key(pipeline, &owner, partition, &name);
                load.counters.push((key, value.to_be_bytes().to_vec()));
                model.counters.insert((owner, name), value);
            }
        }
        Child::Queue { sink } => {
            let key = codec::queue_key(pipeline, sink, partition);
            model
                .bounds
                .insert(sink.clone(), checked(path, Bounds::decode(&key, &data))?);
            load.batch_seq.push((key, data));
        }
        Child::Batch { sink, seq } => {
            let key = codec::seq_key(&codec::queue_key(pipeline, sink, partition), *seq);
            checked(path, codec::decode_batch_parts(&key, &data))?;
            model.pending.insert((sink.clone(), *seq));
            load.batches.push((key, data));
        }
        Child::Fingerprints { sink } => {
            let key = codec::queue_key(pipeline, sink, partition);
            checked(path, codec::decode_fingerprints(&key, &data))?;
            load.fingerprints.push((key, data));
        }
        Child::DeadLetterSeq { owner } => {
            model
                .dl_next
                .insert(owner.clone(), encoding::decode_u64(&data, path)?);
            load.dead_letter_seq
                .push((codec::queue_key(pipeline, owner, partition), data));
        }
        Child::DeadLetter { owner, seq } => {
            let key = codec::seq_key(&codec::queue_key(pipeline, owner, partition), *seq);
            checked(path, codec::decode_dead_letter(&key, &data))?;
            load.dead_letters.push((key, data));
        }
        Child::Value { sink, name } => load
            .sink_values
            .push((codec::sink_value_key(pipeline, sink, name), data)),
    }
    Ok(())
}

/// Keys of `tree` under `pipeline` whose partition (told by `partition_of`) is `partition`.
fn partition_keys(
    tree: &sled::Tree,
    what: &'static str,
    pipeline: &str,
    partition: u32,
    partition_of: impl Fn(&[u8]) -> Option<u32>,
) -> Result<Vec<(sled::IVec, sled::IVec)>, StateError> {
    let mut prefix = pipeline.as_bytes().to_vec();
    prefix.push(codec::SEP);
    let mut out = Vec::new();
    for item in tree.scan_prefix(&prefix) {
        let (k, v) = item.map_err(|e| StateError::sled("scan", what, e))?;
        if partition_of(&k) == Some(partition) {
            out.push((k, v));
        }
    }
    Ok(out)
}

fn queue_partition(key: &[u8]) -> Option<u32> {
    codec::parse_queue_key("key", key).ok().map(|(_, _, p)| p)
}

fn seq_partition(key: &[u8]) -> Option<u32> {
    queue_partition(key.get(..key.len().checked_sub(8)?)?)
}

/// Replaces every local entry of the load's partition with the loaded ones, in one transaction.
/// Returns (queue key, segment) of each removed batch whose payload was in a segment file. A
/// loaded dead letter (a reference without payload) keeps the local payload when this store
/// holds the same dead letter.
pub(crate) fn apply(t: &Trees, load: &PreparedLoad) -> Result<Vec<(Vec<u8>, u64)>, StateError> {
    let (pipeline, partition) = (load.pipeline.as_str(), load.partition);
    let position_key = codec::position_key(pipeline, partition);
    let positions = partition_keys(&t.positions, "positions", pipeline, partition, |k| {
        (k == position_key.as_slice()).then_some(partition)
    })?;
    let batches = partition_keys(&t.batches, "batches", pipeline, partition, seq_partition)?;
    let batch_seq = partition_keys(
        &t.batch_seq,
        "batch_seq",
        pipeline,
        partition,
        queue_partition,
    )?;
    let fingerprints = partition_keys(
        &t.fingerprints,
        "fingerprints",
        pipeline,
        partition,
        queue_partition,
    )?;
    let dead_letters = partition_keys(
        &t.dead_letters,
        "dead_letters",
        pipeline,
        partition,
        seq_partition,
    )?;
    let dead_letter_seq = partition_keys(
        &t.dead_letter_seq,
        "dead_letter_seq",
        pipeline,
        partition,
        queue_partition,
    )?;
    let counters = partition_keys(&t.counters, "counters", pipeline, partition, |k| {
        codec::parse_counter_key(k).ok().map(|(_, _, p, _)| p)
    })?;
    let sink_values = partition_keys(&t.sink_values, "sink_values", pipeline, partition, |k| {
        let (_, _, name) = codec::split_sink_value_key(k)?;
        super::layout::value_partition(std::str::from_utf8(name).ok()?)
    })?;

    let released: Vec<(Vec<u8>, u64)> = batches
        .iter()
        .filter_map(|(k, v)| match codec::decode_batch_parts(k, v) {
            Ok((_, BodyRecord::Segment { segment, .. })) => {
                Some((k[..k.len().saturating_sub(8)].to_vec(), segment))
            }
            _ => None,
        })
        .collect();
    let local_letters: BTreeMap<&[u8], &[u8]> = dead_letters
        .iter()
        .map(|(k, v)| (k.as_ref(), v.as_ref()))
        .collect();
    let mut letters = Vec::with_capacity(load.dead_letters.len());
    for (key, value) in &load.dead_letters {
        let kept = local_letters.get(key.as_slice()).and_then(|local| {
            let local_letter = codec::decode_dead_letter(key, local).ok()?;
            let loaded = codec::decode_dead_letter(key, value).ok()?;
            (local_letter.offset == loaded.offset && local_letter.partition == loaded.partition)
                .then(|| local.to_vec())
        });
        letters.push((key.clone(), kept.unwrap_or_else(|| value.clone())));
    }

    let replace = |tree: &sled::transaction::TransactionalTree,
                   old: &[(sled::IVec, sled::IVec)],
                   new: &[(Vec<u8>, Vec<u8>)]|
     -> Result<(), sled::transaction::UnabortableTransactionError> {
        for (k, _) in old {
            tree.remove(k)?;
        }
        for (k, v) in new {
            tree.insert(k.as_slice(), v.as_slice())?;
        }
        Ok(())
    };
    (
        &t.positions,
        &t.batches,
        &t.batch_seq,
        &t.fingerprints,
        &t.dead_letters,
        &t.dead_letter_seq,
        &t.counters,
        &t.sink_values,
    )
        .transaction(|(tp, tb, tq, tf, td, tds, tc, tv)| {
            replace(tp, &positions, &load.positions)?;
            replace(tb, &batches, &load.batches)?;
            replace(tq, &batch_seq, &load.batch_seq)?;
            replace(tf, &fingerprints, &load.fingerprints)?;
            replace(td, &dead_letters, &letters)?;
            replace(tds, &dead_letter_seq, &load.dead_letter_seq)?;
            replace(tc, &counters, &load.counters)?;
            replace(tv, &sink_values, &load.sink_values)?;
            Ok::<_, sled::transaction::ConflictableTransactionError<StateError>>(())
        })
        .map_err(|e| {
            tx_error(
                "load transaction",
                format!("pipeline {pipeline} partition {partition}"),
                e,
            )
        })?;
    Ok(released)
}
