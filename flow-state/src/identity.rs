//! Which pipeline a state directory belongs to. The store records the pipeline's name and
//! partition count on first use and refuses a different one: a renamed pipeline would send
//! everything again under its new name, and fewer partitions would strand the committed but
//! undelivered batches of the partitions dropped.
//!
//! The outbox identity ([`OutboxId`]) is drawn when sled creates the store and recorded at once;
//! a store that sled recovered without one was created before identities existed and keeps none.

use std::collections::BTreeSet;

use crate::codec;
use crate::error::StateError;
use crate::trees::Trees;
use crate::types::{OutboxId, PipelineIdentity};

/// Key of the record in sled's default tree: `partitions (be32) ++ pipeline name`.
const IDENTITY_KEY: &[u8] = b"flow/pipeline-identity";

/// Key of the outbox identity in sled's default tree: 8 bytes, big-endian.
const OUTBOX_ID_KEY: &[u8] = b"flow/outbox-id";

/// Key of the cluster-cache mark in sled's default tree: the name of the pipeline whose worker
/// ran on this directory in cluster mode.
const CLUSTER_CACHE_KEY: &[u8] = b"flow/cluster-cache";

/// Marks the directory as a cluster worker's cache of `pipeline` (durably: a kill -9 right after
/// must not leave a directory that looks like a single process's outbox).
pub(crate) fn mark_cluster_cache(trees: &Trees, pipeline: &str) -> Result<(), StateError> {
    trees
        .db
        .insert(CLUSTER_CACHE_KEY, pipeline.as_bytes())
        .map_err(|e| StateError::sled("insert", "cluster-cache mark", e))?;
    trees
        .db
        .flush()
        .map_err(|e| StateError::sled("flush", "cluster-cache mark", e))?;
    Ok(())
}

/// The pipeline whose cluster worker used this directory, if one did.
pub(crate) fn cluster_cache(trees: &Trees) -> Result<Option<String>, StateError> {
    let value = trees
        .db
        .get(CLUSTER_CACHE_KEY)
        .map_err(|e| StateError::sled("get", "cluster-cache mark", e))?;
    Ok(value.map(|v| String::from_utf8_lossy(&v).into_owned()))
}

/// The outbox identity, if the store has one.
pub(crate) fn outbox_id(trees: &Trees) -> Result<Option<OutboxId>, StateError> {
    let value = trees
        .db
        .get(OUTBOX_ID_KEY)
        .map_err(|e| StateError::sled("get", "outbox identity", e))?;
    let Some(value) = value else {
        return Ok(None);
    };
    let bytes: [u8; 8] = value.as_ref().try_into().map_err(|_| StateError::Decode {
        what: "outbox identity",
        key: String::from_utf8_lossy(OUTBOX_ID_KEY).into_owned(),
        detail: format!("{} bytes, expected 8", value.len()),
    })?;
    Ok(Some(OutboxId(u64::from_be_bytes(bytes))))
}

/// Draws and durably records the identity of a store sled has just created (nothing in it yet,
/// so no token was ever derived from its absence).
pub(crate) fn create_outbox_id(trees: &Trees) -> Result<OutboxId, StateError> {
    let id = OutboxId(rand::random());
    trees
        .db
        .insert(OUTBOX_ID_KEY, &id.0.to_be_bytes())
        .map_err(|e| StateError::sled("insert", "outbox identity", e))?;
    trees
        .db
        .flush()
        .map_err(|e| StateError::sled("flush", "outbox identity", e))?;
    Ok(id)
}

/// The recorded identity, if any.
pub(crate) fn recorded(trees: &Trees) -> Result<Option<PipelineIdentity>, StateError> {
    let value = trees
        .db
        .get(IDENTITY_KEY)
        .map_err(|e| StateError::sled("get", "pipeline identity", e))?;
    let Some(value) = value else {
        return Ok(None);
    };
    let decoded = value
        .get(..4)
        .zip(value.get(4..))
        .and_then(|(count, name)| {
            let partitions = u32::from_be_bytes(count.try_into().ok()?);
            let pipeline = std::str::from_utf8(name).ok()?.to_owned();
            Some(PipelineIdentity {
                pipeline,
                partitions,
            })
        });
    decoded.map(Some).ok_or_else(|| StateError::Decode {
        what: "pipeline identity",
        key: String::from_utf8_lossy(IDENTITY_KEY).into_owned(),
        detail: format!(
            "{} bytes, expected a partition count and a name",
            value.len()
        ),
    })
}

/// What a store written before identities were recorded says about itself: the pipelines with a
/// committed position or a sink queue, and the highest partition among them.
fn inferred(trees: &Trees) -> Result<(BTreeSet<String>, Option<u32>), StateError> {
    let mut names = BTreeSet::new();
    let mut highest: Option<u32> = None;
    for item in trees.positions.iter() {
        let (k, _) = item.map_err(|e| StateError::sled("scan", "positions", e))?;
        let (pipeline, partition) = codec::parse_position_key(&k)?;
        names.insert(pipeline);
        highest = highest.max(Some(partition));
    }
    for item in trees.batch_seq.iter() {
        let (k, _) = item.map_err(|e| StateError::sled("scan", "batch_seq", e))?;
        let (pipeline, _, partition) = codec::parse_queue_key("queue key", &k)?;
        names.insert(pipeline);
        highest = highest.max(Some(partition));
    }
    Ok((names, highest))
}

/// Records `wanted` on first use, or checks it against what was recorded (or, for an older
/// store, what its keys show).
pub(crate) fn claim(
    trees: &Trees,
    dir: &std::path::Path,
    wanted: &PipelineIdentity,
) -> Result<(), StateError> {
    let mismatch = |found: PipelineIdentity| StateError::OtherPipeline {
        dir: dir.to_path_buf(),
        found: Box::new(found),
        wanted: Box::new(wanted.clone()),
    };
    if let Some(found) = recorded(trees)? {
        return if &found == wanted {
            Ok(())
        } else {
            Err(mismatch(found))
        };
    }
    let (names, highest) = inferred(trees)?;
    if let Some(other) = names.iter().find(|name| **name != wanted.pipeline) {
        return Err(mismatch(PipelineIdentity {
            pipeline: other.clone(),
            partitions: highest.map_or(0, |p| p.saturating_add(1)),
        }));
    }
    if let Some(highest) = highest.filter(|&p| p >= wanted.partitions) {
        return Err(mismatch(PipelineIdentity {
            pipeline: wanted.pipeline.clone(),
            partitions: highest.saturating_add(1),
        }));
    }
    let mut value = wanted.partitions.to_be_bytes().to_vec();
    value.extend_from_slice(wanted.pipeline.as_bytes());
    trees
        .db
        .insert(IDENTITY_KEY, value)
        .map_err(|e| StateError::sled("insert", "pipeline identity", e))?;
    trees
        .db
        .flush()
        .map_err(|e| StateError::sled("flush", "pipeline identity", e))?;
    Ok(())
}
