//! The ZooKeeper mirror of a store: the fences of the partitions this worker owns, what
//! ZooKeeper holds for each (as of this worker's last write), and the write-ahead of a commit
//! group as fenced multi-ops.

use std::collections::btree_map::Entry;
use std::collections::{BTreeMap, BTreeSet};
use std::sync::mpsc::RecvTimeoutError;
use std::sync::{Mutex, MutexGuard};
use std::time::Duration;

use zookeeper_client as zk;

use super::encoding;
use super::layout::{self, Child, NODE_LIMIT};
use super::model::Model;
use crate::codec;
use crate::counters::PreparedCounter;
use crate::error::StateError;
use crate::prepare::{PreparedAck, PreparedBody, PreparedCommit, PreparedDeadLetters};
use crate::request::Op;

/// Batches pending in ZooKeeper per partition (every sink together) above which a commit waits.
pub const DEFAULT_PENDING_BOUND: usize = 256;

/// The most bytes of nodes sent in one multi-op (ZooKeeper's request limit is 1 MiB); a commit
/// group above it is written as several multi-ops, each with the fence checks of its partitions.
const MULTI_LIMIT: usize = 768 * 1024;

/// A store's link to ZooKeeper in cluster mode: the client, where the pipeline's state lives, and
/// the fence of every partition this worker owns. Attach it with
/// [`crate::StateStore::attach_mirror`]; register ownership with [`ZkMirror::own`].
pub struct ZkMirror {
    /// Replaced when the session expired ([`ZkMirror::replace_client`]).
    client: Mutex<zk::Client>,
    root: String,
    pipeline: String,
    /// The runtime the client's session runs on; the committer thread blocks on it.
    handle: tokio::runtime::Handle,
    pending_bound: usize,
    partitions: Mutex<BTreeMap<u32, Owned>>,
}

struct Owned {
    owner_path: String,
    generation: i32,
    /// What ZooKeeper holds for the partition after this worker's last write; `None` until
    /// [`crate::StateStore::load_partition`] read it (writes are refused until then).
    model: Option<Model>,
}

/// One operation of a multi.
#[derive(Clone)]
enum ZkOp {
    Check { path: String, version: i32 },
    Create { path: String, data: Vec<u8> },
    Set { path: String, data: Vec<u8> },
    Delete { path: String },
}

impl ZkOp {
    fn path(&self) -> &str {
        match self {
            ZkOp::Check { path, .. }
            | ZkOp::Create { path, .. }
            | ZkOp::Set { path, .. }
            | ZkOp::Delete { path } => path,
        }
    }

    fn bytes(&self) -> usize {
        let data = match self {
            ZkOp::Create { data, .. } | ZkOp::Set { data, .. } => data.len(),
            ZkOp::Check { .. } | ZkOp::Delete { .. } => 0,
        };
        self.path().len() + data + 32
    }
}

/// The partition a request writes under, its fence, and the model its ops are built on.
struct Target {
    owner_path: String,
    generation: i32,
    model: Model,
    /// Set once a multi was refused for it: later requests of the group fail the same way.
    refused: Option<StateError>,
}

/// Builds the ops of one request against a partition's model.
struct Writer<'a> {
    state: String,
    model: &'a mut Model,
    ops: Vec<ZkOp>,
}

impl Writer<'_> {
    fn put(&mut self, child: &Child, data: Vec<u8>) -> Result<(), StateError> {
        let name = child.name();
        let path = format!("{}/{name}", self.state);
        if data.len() > NODE_LIMIT {
            return Err(StateError::NodeTooLarge {
                path,
                bytes: data.len(),
                limit: NODE_LIMIT,
            });
        }
        self.ops.push(if self.model.nodes.insert(name) {
            ZkOp::Create { path, data }
        } else {
            ZkOp::Set { path, data }
        });
        Ok(())
    }

    fn remove(&mut self, child: &Child) {
        let name = child.name();
        if self.model.nodes.remove(&name) {
            self.ops.push(ZkOp::Delete {
                path: format!("{}/{name}", self.state),
            });
        }
    }

    fn counters(&mut self, partition: u32, adds: &[PreparedCounter]) -> Result<(), StateError> {
        if adds.is_empty() {
            return Ok(());
        }
        for add in adds {
            let (_, owner, at, name) = codec::parse_counter_key(&add.key)?;
            debug_assert_eq!(at, partition);
            let value = self.model.counters.entry((owner, name)).or_default();
            // Saturating, as in sled (`counters::apply`).
            *value = value.saturating_add(add.by);
        }
        let path = format!("{}/counters", self.state);
        let data = encoding::encode_counters(&self.model.counters, &path)?;
        self.put(&Child::Counters, data)
    }

    fn dead_letters(&mut self, prepared: &PreparedDeadLetters) -> Result<(), StateError> {
        if prepared.items.is_empty() {
            return Ok(());
        }
        let (_, owner, _) = codec::parse_queue_key("dead letter owner", &prepared.counter_key)?;
        let mut next = self.model.dl_next.get(&owner).copied().unwrap_or(0);
        for item in &prepared.items {
            let child = Child::DeadLetter {
                owner: owner.clone(),
                seq: next,
            };
            let path = format!("{}/{}", self.state, child.name());
            self.put(&child, encoding::dead_letter_reference(item, &path)?)?;
            next = next.checked_add(1).ok_or_else(|| StateError::Overflow {
                target: path.clone(),
            })?;
        }
        self.model.dl_next.insert(owner.clone(), next);
        self.put(&Child::DeadLetterSeq { owner }, next.to_be_bytes().to_vec())
    }

    fn commit(&mut self, c: &PreparedCommit, bound: usize) -> Result<(), StateError> {
        let Some(position) = &c.position else {
            return Err(StateError::ClusterRefused {
                what: "requeueing dead letters",
                reason: "a dead letter's payload is kept only by the worker that set it aside; requeue them with the pipeline stopped and run in single-process mode".to_owned(),
            });
        };
        let adding: usize = c.sinks.iter().map(|s| s.batches.len()).sum();
        let pending = self.model.pending.len();
        // A commit alone above the bound still goes through an empty queue: it would wait forever.
        if adding > 0 && pending > 0 && pending + adding > bound {
            return Err(StateError::PendingBound {
                pipeline: c.pipeline.clone(),
                partition: c.partition,
                pending,
                adding,
                bound,
            });
        }
        self.counters(c.partition, &c.counters)?;
        self.put(&Child::Position, position.clone())?;
        self.dead_letters(&c.source_dead_letters)?;
        for sink in &c.sinks {
            let context = codec::show_key(&sink.queue_key);
            if !sink.batches.is_empty() {
                let mut bounds = self
                    .model
                    .bounds
                    .get(&sink.sink)
                    .copied()
                    .unwrap_or_default();
                for batch in &sink.batches {
                    let PreparedBody::Record(record) = &batch.body else {
                        return Err(StateError::ClusterRefused {
                            what: "a commit of stored payloads",
                            reason: format!("sink `{}` stores batch payloads, and only sources that can re-read a committed range (whose batches are stored as bounds) run in cluster mode; the push source cannot", sink.sink),
                        });
                    };
                    let seq = bounds.next;
                    let value = codec::encode_batch(&batch.header, record, &context)?;
                    self.put(
                        &Child::Batch {
                            sink: sink.sink.clone(),
                            seq,
                        },
                        value,
                    )?;
                    self.model.pending.insert((sink.sink.clone(), seq));
                    bounds.next = seq.checked_add(1).ok_or_else(|| StateError::Overflow {
                        target: context.clone(),
                    })?;
                }
                self.model.bounds.insert(sink.sink.clone(), bounds);
                self.put(
                    &Child::Queue {
                        sink: sink.sink.clone(),
                    },
                    bounds.encode().to_vec(),
                )?;
            }
            self.dead_letters(&sink.dead_letters)?;
        }
        Ok(())
    }

    fn ack(&mut self, a: &PreparedAck) -> Result<(), StateError> {
        let sink = &a.key.sink;
        let mut bounds = self.model.bounds.get(sink).copied().unwrap_or_default();
        // The same test as sled's (`transactions::apply_ack`).
        if !(bounds.head..bounds.next).contains(&a.seq)
            || !self.model.pending.remove(&(sink.clone(), a.seq))
        {
            return Err(StateError::NotPending {
                key: a.key.clone(),
                seq: a.seq,
            });
        }
        self.remove(&Child::Batch {
            sink: sink.clone(),
            seq: a.seq,
        });
        if a.seq == bounds.head {
            bounds.head = a.seq + 1;
            self.model.bounds.insert(sink.clone(), bounds);
            self.put(
                &Child::Queue { sink: sink.clone() },
                bounds.encode().to_vec(),
            )?;
        }
        for (key, value) in &a.sink_values {
            if let Some(child) = scoped_value(key, a.key.partition)? {
                self.put(&child, value.clone())?;
            }
        }
        for key in &a.removed_sink_values {
            if let Some(child) = scoped_value(key, a.key.partition)? {
                self.remove(&child);
            }
        }
        self.dead_letters(&a.dead_letters)?;
        self.counters(a.key.partition, &a.counters)
    }
}

/// The node of a sink value written with an acknowledgement of `partition`: `None` for a
/// sink-wide value (local-only); an error for a value scoped to another partition, which the
/// fence of this one does not cover.
fn scoped_value(key: &[u8], partition: u32) -> Result<Option<Child>, StateError> {
    let Some((_, sink, name)) = split_value_key(key) else {
        return Ok(None);
    };
    match layout::value_partition(&name) {
        None => Ok(None),
        Some(p) if p == partition => Ok(Some(Child::Value { sink, name })),
        Some(p) => Err(StateError::ClusterRefused {
            what: "a sink value of another partition",
            reason: format!("sink value `{name}` belongs to partition {p}, but it was written with an acknowledgement of partition {partition}, whose fence does not cover it"),
        }),
    }
}

fn split_value_key(key: &[u8]) -> Option<(String, String, String)> {
    let (pipeline, sink, name) = codec::split_sink_value_key(key)?;
    let text = |b: &[u8]| String::from_utf8(b.to_vec()).ok();
    Some((text(pipeline)?, text(sink)?, text(name)?))
}

impl ZkMirror {
    /// A mirror of `pipeline`'s partition state under `root` (the path of `--cluster
    /// zk://HOST:PORT/PATH`). `handle` must be the multi-threaded runtime, with I/O and time
    /// enabled, that `client` was connected on: the committer thread blocks on it for each commit
    /// group, so the store's `*_blocking` calls must not run on that runtime's worker threads
    /// (they would wait for the committer, which waits for the runtime).
    pub fn new(
        client: zk::Client,
        root: &str,
        pipeline: &str,
        handle: tokio::runtime::Handle,
    ) -> Result<ZkMirror, StateError> {
        codec::check_name("pipeline", pipeline)?;
        Ok(ZkMirror {
            client: Mutex::new(client),
            root: root.trim_end_matches('/').to_owned(),
            pipeline: pipeline.to_owned(),
            handle,
            pending_bound: DEFAULT_PENDING_BOUND,
            partitions: Mutex::new(BTreeMap::new()),
        })
    }

    /// Sets the bound on pending batches per partition (at least 1; default
    /// [`DEFAULT_PENDING_BOUND`]).
    pub fn with_pending_bound(mut self, bound: usize) -> ZkMirror {
        self.pending_bound = bound.max(1);
        self
    }

    /// The pipeline mirrored.
    pub fn pipeline(&self) -> &str {
        &self.pipeline
    }

    /// The node holding `partition`'s state (`<root>/<pipeline>/partitions/<p>/state`).
    pub fn state_path(&self, partition: u32) -> String {
        layout::state_path(&self.root, &self.pipeline, partition)
    }

    /// Registers that this worker owns `partition`: every write for it is checked against
    /// `owner_path` being at version `generation`. Writes stay refused until
    /// [`crate::StateStore::load_partition`] has read the partition.
    pub fn own(&self, partition: u32, owner_path: impl Into<String>, generation: i32) {
        let owner_path = owner_path.into();
        let mut partitions = self.lock();
        if let Some(owned) = partitions.get(&partition) {
            if owned.owner_path == owner_path && owned.generation == generation {
                return;
            }
        }
        partitions.insert(
            partition,
            Owned {
                owner_path,
                generation,
                model: None,
            },
        );
    }

    /// Forgets `partition`: every later write for it is refused with [`StateError::Fenced`].
    pub fn disown(&self, partition: u32) {
        self.lock().remove(&partition);
    }

    /// The generation this worker owns `partition` at, if it does.
    pub fn generation(&self, partition: u32) -> Option<i32> {
        self.lock().get(&partition).map(|o| o.generation)
    }

    fn lock(&self) -> MutexGuard<'_, BTreeMap<u32, Owned>> {
        // The map stays consistent at every await-free step: a panic elsewhere cannot tear it.
        match self.partitions.lock() {
            Ok(guard) => guard,
            Err(poisoned) => poisoned.into_inner(),
        }
    }

    /// The timeout ZooKeeper granted this worker's session: how long a frozen worker keeps its
    /// partitions before another may take them.
    pub fn session_timeout(&self) -> Duration {
        self.client().session_timeout()
    }

    /// The client (a cheap clone of a shared session).
    pub(crate) fn client(&self) -> zk::Client {
        match self.client.lock() {
            Ok(client) => client.clone(),
            Err(poisoned) => poisoned.into_inner().clone(),
        }
    }

    /// Writes through `client` from now on, after the session of the previous one expired. Every
    /// partition is forgotten (writes refused with [`StateError::Fenced`]): its lease went with
    /// the old session, so it must be taken again ([`ZkMirror::own`]) and loaded.
    pub fn replace_client(&self, client: zk::Client) {
        match self.client.lock() {
            Ok(mut current) => *current = client,
            Err(poisoned) => *poisoned.into_inner() = client,
        }
        self.lock().clear();
    }

    fn fenced(&self, partition: u32, why: String, source: Option<zk::Error>) -> StateError {
        StateError::Fenced {
            pipeline: self.pipeline.clone(),
            partition,
            why,
            source,
        }
    }

    /// The fence of `partition` for a load: its generation. The model is dropped, so that its
    /// writes are refused until the load is done.
    pub(crate) fn begin_load(&self, pipeline: &str, partition: u32) -> Result<i32, StateError> {
        self.check_pipeline(pipeline, "loading a partition")?;
        match self.lock().get_mut(&partition) {
            Some(owned) => {
                owned.model = None;
                Ok(owned.generation)
            }
            None => Err(self.fenced(partition, "this worker does not own it".to_owned(), None)),
        }
    }

    /// Installs what a load read, unless ownership changed meanwhile.
    pub(crate) fn finish_load(&self, partition: u32, generation: i32, model: Model) {
        if let Some(owned) = self.lock().get_mut(&partition) {
            if owned.generation == generation {
                owned.model = Some(model);
            }
        }
    }

    /// Called when sled failed to apply (or make durable) a write ZooKeeper took: ZooKeeper is
    /// ahead of sled, so the partition is forgotten until it is owned and loaded again.
    pub(crate) fn lost(&self, partition: u32, error: &StateError) {
        tracing::error!(pipeline = %self.pipeline, partition, %error, "the local state of a partition failed to apply a write ZooKeeper already holds; the partition is fenced until it is owned and loaded from ZooKeeper again");
        self.disown(partition);
    }

    fn check_pipeline(&self, pipeline: &str, what: &'static str) -> Result<(), StateError> {
        if pipeline == self.pipeline {
            return Ok(());
        }
        Err(StateError::ClusterRefused {
            what,
            reason: format!(
                "the request is for pipeline `{pipeline}`, and this store mirrors pipeline `{}`",
                self.pipeline
            ),
        })
    }

    /// The partition a request writes in ZooKeeper; `None` for a local-only one.
    fn partition_of(&self, op: &Op) -> Result<Option<u32>, StateError> {
        match op {
            Op::Commit(c) => {
                self.check_pipeline(&c.pipeline, "a commit")?;
                Ok(Some(c.partition))
            }
            Op::Ack(a) => {
                self.check_pipeline(&a.key.pipeline, "an acknowledgement")?;
                Ok(Some(a.key.partition))
            }
            Op::SetFingerprints(f) => {
                self.check_pipeline(&f.key.pipeline, "setting fingerprints")?;
                Ok(Some(f.key.partition))
            }
            Op::SetSinkValue(key, _) => match split_value_key(key) {
                Some((pipeline, _, name)) => {
                    self.check_pipeline(&pipeline, "setting a sink value")?;
                    Ok(layout::value_partition(&name))
                }
                None => Ok(None),
            },
            Op::AddCounters(adds) => match adds.first() {
                Some(add) => {
                    let (pipeline, _, partition, _) = codec::parse_counter_key(&add.key)?;
                    self.check_pipeline(&pipeline, "adding to counters")?;
                    Ok(Some(partition))
                }
                None => Ok(None),
            },
            Op::RemoveDeadLetters(_) => Err(StateError::ClusterRefused {
                what: "removing dead letters",
                reason: "the dead letters of a partition live in ZooKeeper with its other state; purge them with the pipeline stopped and run in single-process mode".to_owned(),
            }),
            Op::Replace(_) | Op::Shutdown => Ok(None),
        }
    }

    fn build(&self, op: &Op, writer: &mut Writer<'_>) -> Result<(), StateError> {
        match op {
            Op::Commit(c) => writer.commit(c, self.pending_bound),
            Op::Ack(a) => writer.ack(a),
            Op::SetFingerprints(f) => {
                let child = Child::Fingerprints {
                    sink: f.key.sink.clone(),
                };
                match &f.encoded {
                    Some(value) => writer.put(&child, value.clone()),
                    None => {
                        writer.remove(&child);
                        Ok(())
                    }
                }
            }
            Op::SetSinkValue(key, value) => {
                let Some((_, sink, name)) = split_value_key(key) else {
                    return Ok(());
                };
                let child = Child::Value { sink, name };
                match value {
                    Some(value) => writer.put(&child, value.clone()),
                    None => {
                        writer.remove(&child);
                        Ok(())
                    }
                }
            }
            Op::AddCounters(adds) => match adds.first() {
                Some(add) => {
                    let (_, _, partition, _) = codec::parse_counter_key(&add.key)?;
                    writer.counters(partition, adds)
                }
                None => Ok(()),
            },
            Op::RemoveDeadLetters(_) | Op::Replace(_) | Op::Shutdown => Ok(()),
        }
    }

    /// Writes the requests of a commit group to ZooKeeper before sled applies them. The answer
    /// per request is the partition it wrote (`None`: local-only) or why it must fail without
    /// being applied; with it, how many multi-ops were sent.
    pub(crate) fn write_ahead(&self, ops: &[&Op]) -> (Vec<Result<Option<u32>, StateError>>, u64) {
        let mut results: Vec<Result<Option<u32>, StateError>> =
            ops.iter().map(|_| Ok(None)).collect();
        let mut targets: BTreeMap<u32, Target> = BTreeMap::new();
        let built = self.build_requests(ops, &mut targets, &mut results);
        let multis = self.send_in_chunks(&built, &mut targets);
        let refusals: BTreeMap<u32, StateError> = targets
            .iter()
            .filter_map(|(p, t)| t.refused.as_ref().map(|e| (*p, e.duplicate())))
            .collect();
        for (result, request) in results.iter_mut().zip(&built) {
            if let (Ok(Some(partition)), Some(_)) = (&*result, request) {
                if let Some(e) = refusals.get(partition) {
                    *result = Err(e.duplicate());
                }
            }
        }
        self.keep_models(targets);
        (results, multis)
    }

    /// Each request's partition and ZooKeeper ops (`None`: nothing to write, or refused, its
    /// error then in `results`), built against the partitions' models in `targets`.
    fn build_requests(
        &self,
        ops: &[&Op],
        targets: &mut BTreeMap<u32, Target>,
        results: &mut [Result<Option<u32>, StateError>],
    ) -> Vec<Option<(u32, Vec<ZkOp>)>> {
        let partitions = self.lock();
        let mut built: Vec<Option<(u32, Vec<ZkOp>)>> = ops.iter().map(|_| None).collect();
        for (i, op) in ops.iter().enumerate() {
            let partition = match self.partition_of(op) {
                Ok(Some(p)) => p,
                Ok(None) => continue,
                Err(e) => {
                    results[i] = Err(e);
                    continue;
                }
            };
            let target = match self.target(partition, &partitions, targets) {
                Ok(target) => target,
                Err(e) => {
                    results[i] = Err(e);
                    continue;
                }
            };
            match self.build_request(op, partition, target) {
                Ok(request_ops) => {
                    built[i] = Some((partition, request_ops));
                    results[i] = Ok(Some(partition));
                }
                Err(e) => results[i] = Err(e),
            }
        }
        built
    }

    /// The model of `partition` the requests of this group write against: taken from what this
    /// worker owns at the group's first request for it.
    fn target<'t>(
        &self,
        partition: u32,
        partitions: &BTreeMap<u32, Owned>,
        targets: &'t mut BTreeMap<u32, Target>,
    ) -> Result<&'t mut Target, StateError> {
        match targets.entry(partition) {
            Entry::Occupied(entry) => Ok(entry.into_mut()),
            Entry::Vacant(entry) => match partitions.get(&partition) {
                Some(Owned {
                    owner_path,
                    generation,
                    model: Some(model),
                }) => Ok(entry.insert(Target {
                    owner_path: owner_path.clone(),
                    generation: *generation,
                    model: model.clone(),
                    refused: None,
                })),
                Some(Owned { model: None, .. }) => Err(self.fenced(partition, "it was not loaded from ZooKeeper since this worker took it (`StateStore::load_partition` comes first)".to_owned(), None)),
                None => Err(self.fenced(
                    partition,
                    "this worker does not own it".to_owned(),
                    None,
                )),
            },
        }
    }

    /// One request's ZooKeeper ops, applied to `target`'s model; on an error the model is left
    /// as it was.
    fn build_request(
        &self,
        op: &Op,
        partition: u32,
        target: &mut Target,
    ) -> Result<Vec<ZkOp>, StateError> {
        let saved = target.model.clone();
        let mut writer = Writer {
            state: self.state_path(partition),
            model: &mut target.model,
            ops: Vec::new(),
        };
        let outcome = self.build(op, &mut writer).and_then(|()| {
            // A request is never split: above the limit ZooKeeper would drop the
            // connection, and with it every partition's write.
            let bytes: usize = writer.ops.iter().map(ZkOp::bytes).sum();
            if bytes > MULTI_LIMIT {
                return Err(StateError::MultiTooLarge {
                    pipeline: self.pipeline.clone(),
                    partition,
                    bytes,
                    limit: MULTI_LIMIT,
                });
            }
            Ok(())
        });
        match outcome {
            Ok(()) => Ok(writer.ops),
            Err(e) => {
                target.model = saved;
                Err(e)
            }
        }
    }

    /// Sends consecutive requests as one multi-op each while it stays under the request limit;
    /// returns how many multi-ops went out.
    fn send_in_chunks(
        &self,
        built: &[Option<(u32, Vec<ZkOp>)>],
        targets: &mut BTreeMap<u32, Target>,
    ) -> u64 {
        let mut chunk: Vec<usize> = Vec::new();
        let mut chunk_bytes = 0;
        let mut multis = 0;
        for (i, request) in built.iter().enumerate() {
            let Some((_, request_ops)) = request else {
                continue;
            };
            let bytes: usize = request_ops.iter().map(ZkOp::bytes).sum();
            if !chunk.is_empty() && chunk_bytes + bytes > MULTI_LIMIT {
                multis += self.run_multi(&chunk, built, targets);
                chunk.clear();
                chunk_bytes = 0;
            }
            chunk.push(i);
            chunk_bytes += bytes;
        }
        if !chunk.is_empty() {
            multis += self.run_multi(&chunk, built, targets);
        }
        multis
    }

    /// Keeps the models the group's writes left, for the partitions this worker still owns
    /// under the same lease; a refused partition (or one whose outcome is unknown) is read from
    /// ZooKeeper again.
    fn keep_models(&self, targets: BTreeMap<u32, Target>) {
        let mut partitions = self.lock();
        for (partition, target) in targets {
            let current = partitions
                .get_mut(&partition)
                .filter(|o| o.generation == target.generation && o.owner_path == target.owner_path);
            match (target.refused, current) {
                (None, Some(owned)) => owned.model = Some(target.model),
                (Some(_), Some(_)) => {
                    partitions.remove(&partition);
                }
                (_, None) => {}
            }
        }
    }

    /// Sends the requests of `chunk` as one multi-op that starts with the fence check of each
    /// of their partitions. A refused partition (its check, or one of its writes) is marked in
    /// `targets` and the multi is sent again without it; a multi ZooKeeper did not answer
    /// refuses every partition in it (its outcome is unknown until they are loaded again).
    /// Returns how many multi-ops it sent.
    fn run_multi(
        &self,
        chunk: &[usize],
        built: &[Option<(u32, Vec<ZkOp>)>],
        targets: &mut BTreeMap<u32, Target>,
    ) -> u64 {
        let mut sent = 0;
        loop {
            let live: BTreeSet<u32> = chunk
                .iter()
                .filter_map(|i| built[*i].as_ref().map(|(p, _)| *p))
                .filter(|p| targets.get(p).is_some_and(|t| t.refused.is_none()))
                .collect();
            if live.is_empty() {
                return sent;
            }
            let checks: Vec<(u32, ZkOp)> = live
                .iter()
                .filter_map(|p| {
                    let target = targets.get(p)?;
                    Some((
                        *p,
                        ZkOp::Check {
                            path: target.owner_path.clone(),
                            version: target.generation,
                        },
                    ))
                })
                .collect();
            let mut all: Vec<(u32, &ZkOp)> = checks.iter().map(|(p, op)| (*p, op)).collect();
            for i in chunk {
                if let Some((p, ops)) = &built[*i] {
                    if live.contains(p) {
                        all.extend(ops.iter().map(|op| (*p, op)));
                    }
                }
            }
            sent += 1;
            match self.commit_multi(&all) {
                Ok(()) => return sent,
                Err((Some(index), source)) => {
                    let (partition, op) = all[index];
                    let why = match (op, &source) {
                        (ZkOp::Check { path, version }, zk::Error::BadVersion) => format!("its owner node {path} is no longer at generation {version}: another worker took the partition"),
                        (ZkOp::Check { path, .. }, zk::Error::NoNode) => format!("its owner node {path} does not exist"),
                        (ZkOp::Check { path, .. }, _) => format!("the check of its owner node {path} failed"),
                        (op, _) => format!("ZooKeeper refused the write of {}: what it holds differs from what this worker loaded", op.path()),
                    };
                    let refusal = self.fenced(partition, why, Some(source));
                    if let Some(target) = targets.get_mut(&partition) {
                        target.refused = Some(refusal);
                    }
                }
                Err((None, source)) => {
                    for partition in live {
                        let why = "ZooKeeper did not confirm the write (the session may be lost); whether it was applied is known only after the partition is loaded again".to_owned();
                        let refusal = self.fenced(partition, why, Some(source.clone()));
                        if let Some(target) = targets.get_mut(&partition) {
                            target.refused = Some(refusal);
                        }
                    }
                    return sent;
                }
            }
        }
    }

    /// One multi-op, sent from the client's runtime while the committer thread waits (it is not
    /// one of the runtime's threads). The error carries the index of the refused op, if
    /// ZooKeeper named one. The wait is bounded by a std timeout, which needs nothing from the
    /// runtime: a runtime that is shutting down or has no free thread fails the write instead of
    /// hanging the committer.
    fn commit_multi(&self, all: &[(u32, &ZkOp)]) -> Result<(), (Option<usize>, zk::Error)> {
        let client = self.client();
        let ops: Vec<ZkOp> = all.iter().map(|(_, op)| (*op).clone()).collect();
        // The client fails a request once its connection stops answering; this bounds the rest.
        let timeout = client
            .session_timeout()
            .saturating_mul(2)
            .max(Duration::from_secs(1));
        let (tx, rx) = std::sync::mpsc::sync_channel(1);
        self.handle.spawn(async move {
            let _ = tx.send(send_multi(&client, &ops).await);
        });
        match rx.recv_timeout(timeout) {
            Ok(result) => result,
            Err(RecvTimeoutError::Timeout) => Err((None, zk::Error::Timeout)),
            // The task was dropped unfinished: the runtime is shutting down.
            Err(RecvTimeoutError::Disconnected) => Err((None, zk::Error::ClientClosed)),
        }
    }
}

async fn send_multi(client: &zk::Client, ops: &[ZkOp]) -> Result<(), (Option<usize>, zk::Error)> {
    let options = zk::CreateMode::Persistent.with_acls(zk::Acls::anyone_all());
    let mut writer = client.new_multi_writer();
    for (index, op) in ops.iter().enumerate() {
        let added = match op {
            ZkOp::Check { path, version } => writer.add_check_version(path, *version),
            ZkOp::Create { path, data } => writer.add_create(path, data, &options),
            ZkOp::Set { path, data } => writer.add_set_data(path, data, None),
            ZkOp::Delete { path } => writer.add_delete(path, None),
        };
        added.map_err(|e| (Some(index), e))?;
    }
    match writer.commit().await {
        Ok(_) => Ok(()),
        Err(zk::MultiWriteError::OperationFailed { index, source }) => Err((Some(index), source)),
        Err(zk::MultiWriteError::RequestFailed { source }) => Err((None, source)),
    }
}
