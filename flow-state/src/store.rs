//! The store handle: opening a directory, the requests sent to the committer thread, and the
//! reads made from sled directly.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::sync::{Arc, Mutex, OnceLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::codec::{self, check_name, show_key, BodyRecord};
use crate::committer::Committer;
use crate::counters;
use crate::durability::Durability;
use crate::error::{is_not_writable, StateError};
use crate::identity;
use crate::prepare::{
    dead_letter_key, prepare_ack, prepare_commit, prepare_dead_letters, prepare_fingerprints,
    prepare_requeue,
};
use crate::request::{Op, Outcome, Reply, Request};
use crate::segments::{self, Segments};
use crate::stats::StatCounters;
use crate::summary::{self, StateSummary};
use crate::trees::Trees;
use crate::types::{
    AckExtras, CommitReceipt, CounterAdd, DeadLetter, EpochCommit, OutboxId, PayloadRef,
    PipelineIdentity, SealedBatch, SinkPartition, StoreOptions, StoreStats, StoredBatch,
    StoredCounter, StoredDeadLetter,
};
use crate::unfinished_snapshot;
use crate::zk::{self, ZkMirror};

/// How long a commit refused at the pending bound waits at most before it is tried again.
const PENDING_RETRY: Duration = Duration::from_millis(500);

/// Handle to an open store. Cheap to clone; the committer thread stops (after pending requests,
/// with a final flush + fsync) on [`StateStore::close`] or when the last clone is dropped.
#[derive(Clone)]
pub struct StateStore {
    inner: Arc<Inner>,
}

struct Inner {
    dir: PathBuf,
    trees: Trees,
    tx: mpsc::Sender<Request>,
    thread: Mutex<Option<JoinHandle<Result<(), StateError>>>>,
    stats: Arc<StatCounters>,
    /// Durable acknowledgements since the store opened (see [`StateStore::acknowledgements`]).
    acks: tokio::sync::watch::Sender<u64>,
    /// Cluster mode's ZooKeeper mirror, shared with the committer thread.
    mirror: Arc<OnceLock<ZkMirror>>,
}

impl Inner {
    fn send(&self, op: Op, reply: Reply) -> Result<(), StateError> {
        self.tx
            .send(Request { op, reply })
            .map_err(|_| StateError::Closed)
    }

    fn submit_blocking(&self, op: Op) -> Result<Outcome, StateError> {
        let (tx, rx) = mpsc::sync_channel(1);
        self.send(
            op,
            Box::new(move |result| {
                let _ = tx.send(result);
            }),
        )?;
        rx.recv().map_err(|_| StateError::Closed)?
    }

    async fn submit(&self, op: Op) -> Result<Outcome, StateError> {
        let (tx, rx) = tokio::sync::oneshot::channel();
        self.send(
            op,
            Box::new(move |result| {
                let _ = tx.send(result);
            }),
        )?;
        rx.await.map_err(|_| StateError::Closed)?
    }

    fn shutdown(&self) -> Result<(), StateError> {
        let handle = match self.thread.lock() {
            Ok(mut guard) => guard.take(),
            Err(poisoned) => poisoned.into_inner().take(),
        };
        let Some(handle) = handle else {
            return Ok(());
        };
        // Errors if the thread already stopped; joining reports why.
        let _ = self.send(Op::Shutdown, Box::new(|_| {}));
        match handle.join() {
            Ok(result) => result,
            Err(_) => Err(StateError::CommitterPanicked),
        }
    }
}

impl Drop for Inner {
    fn drop(&mut self) {
        if let Err(e) = self.shutdown() {
            tracing::error!(dir = %self.dir.display(), error = %e, "closing state store failed");
        }
    }
}

fn receipt(outcome: Outcome) -> CommitReceipt {
    match outcome {
        Outcome::Commit(receipt) => receipt,
        Outcome::Done | Outcome::Removed(_) => CommitReceipt::default(),
    }
}

impl StateStore {
    /// Opens or creates the store in `dir` (blocking), with fsync on. Starts the committer thread.
    ///
    /// Fails with [`StateError::Locked`] when another process (a running worker) has the
    /// directory open, [`StateError::NotWritable`] when the directory cannot be written (sled
    /// opens only for writing; [`StateStore::open_to_read`] reads such a directory), and
    /// [`StateError::Open`] when sled cannot open or create it for another reason.
    ///
    /// ```
    /// use flow_state::{EpochCommit, StateStore};
    ///
    /// # fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let dir = tempfile::tempdir()?;
    /// let store = StateStore::open(dir.path())?;
    /// store.claim("events", 1)?;
    /// // Record that partition 0 was read up to source position "42", durably.
    /// store.commit_blocking(EpochCommit {
    ///     pipeline: "events".to_owned(),
    ///     partition: 0,
    ///     position: b"42".to_vec(),
    ///     ..EpochCommit::default()
    /// })?;
    /// assert_eq!(store.position("events", 0)?, Some(b"42".to_vec()));
    /// store.close()?;
    /// # Ok(())
    /// # }
    /// ```
    pub fn open(dir: &Path) -> Result<StateStore, StateError> {
        StateStore::open_with(dir, StoreOptions::default())
    }

    /// Opens or creates the store in `dir` with explicit options.
    pub fn open_with(dir: &Path, options: StoreOptions) -> Result<StateStore, StateError> {
        let db = open_sled(dir, &options)?;
        // Only a store sled creates now gets an identity: one it recovered was created before
        // identities existed, and tokens derived without one may be pending in it.
        let created = !db.was_recovered();
        let trees = Trees::open(db)?;
        if created {
            identity::create_outbox_id(&trees)?;
        }
        let segments = Segments::open(dir, options.fsync, &referenced_segments(&trees)?)?;
        let durability = Durability::new(dir, options.fsync)?;
        let stats = Arc::new(StatCounters::default());
        let mirror = Arc::new(OnceLock::new());
        let (tx, rx) = mpsc::channel();
        let committer = Committer {
            trees: trees.clone(),
            durability,
            segments,
            stats: stats.clone(),
            max_group: options.max_group,
            mirror: mirror.clone(),
        };
        let thread = std::thread::Builder::new()
            .name("flow-state-committer".to_owned())
            .spawn(move || committer.run(rx))
            .map_err(|source| StateError::Io {
                what: "spawn of committer thread",
                path: dir.to_path_buf(),
                source,
            })?;
        tracing::info!(dir = %dir.display(), fsync = options.fsync, "state store opened");
        Ok(StateStore {
            inner: Arc::new(Inner {
                dir: dir.to_path_buf(),
                trees,
                tx,
                thread: Mutex::new(Some(thread)),
                stats,
                acks: tokio::sync::watch::Sender::new(0),
                mirror,
            }),
        })
    }

    /// The directory the store lives in.
    pub fn dir(&self) -> &Path {
        &self.inner.dir
    }

    /// Durable atomic commit of one partition's epoch; resolves after the data is durable.
    ///
    /// In cluster mode a commit that would take the partition past its bound of pending batches
    /// ([`StateError::PendingBound`]) waits for acknowledgements and is tried again
    /// (back-pressure); every other refusal is returned.
    pub async fn commit(&self, commit: EpochCommit) -> Result<CommitReceipt, StateError> {
        if self.inner.mirror.get().is_none() {
            let op = Op::Commit(prepare_commit(&commit)?);
            return self.inner.submit(op).await.map(receipt);
        }
        loop {
            // Subscribed before the attempt: an acknowledgement made while it is refused wakes it.
            let mut acks = self.inner.acks.subscribe();
            let op = Op::Commit(prepare_commit(&commit)?);
            match self.inner.submit(op).await {
                Err(StateError::PendingBound { .. }) => {
                    // Also wakes now and then: a partition fenced meanwhile acknowledges nothing
                    // more, and the next attempt reports the refusal.
                    let _ = tokio::time::timeout(PENDING_RETRY, acks.changed()).await;
                }
                result => return result.map(receipt),
            }
        }
    }

    /// Attaches cluster mode's ZooKeeper mirror: from now on every write of a partition goes to
    /// ZooKeeper first, fenced (see [`crate::zk`]). Refused when one is attached already.
    /// The directory is marked as a cluster worker's cache: its dead letters can no longer be
    /// requeued or purged by a process without the mirror ([`StateStore::cluster_cache`]).
    pub fn attach_mirror(&self, mirror: ZkMirror) -> Result<(), StateError> {
        let pipeline = mirror.pipeline().to_owned();
        identity::mark_cluster_cache(&self.inner.trees, &pipeline)?;
        self.inner
            .mirror
            .set(mirror)
            .map_err(|_| StateError::ClusterRefused {
                what: "attaching a second ZooKeeper mirror",
                reason: format!("this store already mirrors pipeline `{pipeline}` or another; one store has one mirror"),
            })
    }

    /// The ZooKeeper mirror, when the store runs in cluster mode.
    pub fn mirror(&self) -> Option<&ZkMirror> {
        self.inner.mirror.get()
    }

    /// Cluster mode: reads `partition`'s state from ZooKeeper and replaces the partition's local
    /// entries with it (positions, batch queues and their bounds, fingerprints, counters, dead
    /// letters, partition-scoped sink values), so that `position`, `undelivered`, ... answer from
    /// it. The partition must be owned ([`ZkMirror::own`]); its writes are refused from the start
    /// of the load until it is done.
    pub async fn load_partition(&self, pipeline: &str, partition: u32) -> Result<(), StateError> {
        let mirror = self.mirror().ok_or(StateError::NoMirror {
            what: "loading a partition",
        })?;
        let generation = mirror.begin_load(pipeline, partition)?;
        let state = mirror.state_path(partition);
        let (prepared, model) =
            zk::load::read(&mirror.client(), &state, pipeline, partition, true).await?;
        self.inner.submit(Op::Replace(prepared)).await?;
        mirror.finish_load(partition, generation, model);
        Ok(())
    }

    /// Blocking form of [`StateStore::commit`] (not from inside an async task). In cluster mode
    /// it returns [`StateError::PendingBound`] at the bound instead of waiting.
    pub fn commit_blocking(&self, commit: EpochCommit) -> Result<CommitReceipt, StateError> {
        let op = Op::Commit(prepare_commit(&commit)?);
        self.inner.submit_blocking(op).map(receipt)
    }

    /// Removes the oldest batch of the queue (which must have sequence `seq`) and sets the given
    /// sink-wide values, in one transaction, durably.
    pub async fn acknowledge(
        &self,
        key: &SinkPartition,
        seq: u64,
        sink_values: Vec<(String, Vec<u8>)>,
    ) -> Result<(), StateError> {
        let op = Op::Ack(prepare_ack(key, seq, sink_values)?);
        self.inner.submit(op).await?;
        self.acknowledged();
        Ok(())
    }

    /// Removes a pending batch, as [`StateStore::acknowledge`] does, together with what its
    /// delivery left behind, in one transaction: the rows set aside (`dead_letters`, which
    /// join the sink's dead letters of `key.partition`) and the sink values it no longer needs.
    pub async fn acknowledge_with(
        &self,
        key: &SinkPartition,
        seq: u64,
        extras: AckExtras,
    ) -> Result<(), StateError> {
        let mut ack = prepare_ack(key, seq, extras.sink_values)?;
        for name in &extras.removed_sink_values {
            check_name("sink value", name)?;
            ack.removed_sink_values
                .push(codec::sink_value_key(&key.pipeline, &key.sink, name));
        }
        ack.dead_letters = prepare_dead_letters(
            &key.pipeline,
            &key.sink,
            key.partition,
            &extras.dead_letters,
        )?;
        ack.counters = counters::prepare(&key.pipeline, key.partition, &extras.counters)?;
        self.inner.submit(Op::Ack(ack)).await?;
        self.acknowledged();
        Ok(())
    }

    /// Counts the acknowledgements made durable through this store since it opened; a receiver
    /// wakes after each one. A watcher of delivery (a source that reports when its messages
    /// reached every sink) re-reads the oldest pending batch of its queues when it moves, instead
    /// of polling them.
    pub fn acknowledgements(&self) -> tokio::sync::watch::Receiver<u64> {
        self.inner.acks.subscribe()
    }

    fn acknowledged(&self) {
        self.inner.acks.send_modify(|count| *count += 1);
    }

    /// Durably sets (`Some`) or removes (`None`) one sink-wide value (see
    /// [`StateStore::sink_value`]).
    pub async fn set_sink_value(
        &self,
        pipeline: &str,
        sink: &str,
        name: &str,
        value: Option<Vec<u8>>,
    ) -> Result<(), StateError> {
        check_name("pipeline", pipeline)?;
        check_name("sink", sink)?;
        check_name("sink value", name)?;
        let key = codec::sink_value_key(pipeline, sink, name);
        let op = Op::SetSinkValue(key, value);
        self.inner.submit(op).await.map(|_| ())
    }

    /// Blocking form of [`StateStore::set_sink_value`].
    pub fn set_sink_value_blocking(
        &self,
        pipeline: &str,
        sink: &str,
        name: &str,
        value: Option<Vec<u8>>,
    ) -> Result<(), StateError> {
        check_name("pipeline", pipeline)?;
        check_name("sink", sink)?;
        check_name("sink value", name)?;
        let key = codec::sink_value_key(pipeline, sink, name);
        self.inner
            .submit_blocking(Op::SetSinkValue(key, value))
            .map(|_| ())
    }

    /// Durably adds to counters of `pipeline`/`partition` on their own, for what no commit or
    /// acknowledgement carries (a failed attempt). Joins the commit group in progress, if any.
    pub async fn add_counters(
        &self,
        pipeline: &str,
        partition: u32,
        adds: &[CounterAdd],
    ) -> Result<(), StateError> {
        check_name("pipeline", pipeline)?;
        let prepared = counters::prepare(pipeline, partition, adds)?;
        if prepared.is_empty() {
            return Ok(());
        }
        self.inner
            .submit(Op::AddCounters(prepared))
            .await
            .map(|_| ())
    }

    /// Every persisted counter, in (pipeline, owner, partition, name) order.
    pub fn counters(&self) -> Result<Vec<StoredCounter>, StateError> {
        counters::read_all(&self.inner.trees)
    }

    /// Blocking form of [`StateStore::acknowledge`].
    pub fn acknowledge_blocking(
        &self,
        key: &SinkPartition,
        seq: u64,
        sink_values: Vec<(String, Vec<u8>)>,
    ) -> Result<(), StateError> {
        let op = Op::Ack(prepare_ack(key, seq, sink_values)?);
        self.inner.submit_blocking(op)?;
        self.acknowledged();
        Ok(())
    }

    /// Durably replaces the fingerprints of a sink partition (an empty map removes them).
    pub async fn set_fingerprints(
        &self,
        key: &SinkPartition,
        fingerprints: BTreeMap<String, String>,
    ) -> Result<(), StateError> {
        let op = Op::SetFingerprints(prepare_fingerprints(key, &fingerprints)?);
        self.inner.submit(op).await.map(|_| ())
    }

    /// Blocking form of [`StateStore::set_fingerprints`].
    pub fn set_fingerprints_blocking(
        &self,
        key: &SinkPartition,
        fingerprints: BTreeMap<String, String>,
    ) -> Result<(), StateError> {
        let op = Op::SetFingerprints(prepare_fingerprints(key, &fingerprints)?);
        self.inner.submit_blocking(op).map(|_| ())
    }

    /// Committed source position of a partition.
    pub fn position(&self, pipeline: &str, partition: u32) -> Result<Option<Vec<u8>>, StateError> {
        let key = codec::position_key(pipeline, partition);
        self.inner
            .trees
            .positions
            .get(&key)
            .map(|v| v.map(|v| v.to_vec()))
            .map_err(|e| StateError::sled("get position", show_key(&key), e))
    }

    /// Undelivered batches of a queue, ascending seq, without their payloads (see
    /// [`StateStore::load_payload`]).
    pub fn undelivered(&self, key: &SinkPartition) -> Result<Vec<StoredBatch>, StateError> {
        let prefix = codec::sink_queue_key(key);
        let mut out = Vec::new();
        for item in self.inner.trees.batches.scan_prefix(&prefix) {
            let (k, v) = item.map_err(|e| StateError::sled("scan batches", key.to_string(), e))?;
            out.push(stored_batch(&k, &v)?);
        }
        Ok(out)
    }

    /// Reads a stored payload (blocking), checked against the checksum recorded at commit.
    pub fn load_payload(
        &self,
        key: &SinkPartition,
        payload: &PayloadRef,
    ) -> Result<bytes::Bytes, StateError> {
        segments::read(&self.inner.dir, &codec::sink_queue_key(key), payload)
    }

    /// The oldest undelivered batch of a queue (the only one `acknowledge` accepts).
    pub fn oldest_undelivered(
        &self,
        key: &SinkPartition,
    ) -> Result<Option<StoredBatch>, StateError> {
        let prefix = codec::sink_queue_key(key);
        match self.inner.trees.batches.scan_prefix(&prefix).next() {
            None => Ok(None),
            Some(Err(e)) => Err(StateError::sled("scan batches", key.to_string(), e)),
            Some(Ok((k, v))) => Ok(Some(stored_batch(&k, &v)?)),
        }
    }

    /// The first undelivered batch of a queue for `shard` whose seq is above `after` (every seq
    /// when `None`): how a delivery lane that set batches aside reads them back in order.
    pub fn next_undelivered(
        &self,
        key: &SinkPartition,
        shard: &str,
        after: Option<u64>,
    ) -> Result<Option<StoredBatch>, StateError> {
        let prefix = codec::sink_queue_key(key);
        let start = match after {
            Some(seq) if seq == u64::MAX => return Ok(None),
            Some(seq) => codec::seq_key(&prefix, seq + 1),
            None => prefix.clone(),
        };
        for item in self.inner.trees.batches.range(start..) {
            let (k, v) = item.map_err(|e| StateError::sled("scan batches", key.to_string(), e))?;
            if !k.starts_with(&prefix) {
                break;
            }
            let stored = stored_batch(&k, &v)?;
            if stored.batch.shard == shard {
                return Ok(Some(stored));
            }
        }
        Ok(None)
    }

    /// Fingerprints of a sink partition (empty when none were set).
    pub fn fingerprints(
        &self,
        key: &SinkPartition,
    ) -> Result<BTreeMap<String, String>, StateError> {
        let k = codec::sink_queue_key(key);
        match self.inner.trees.fingerprints.get(&k) {
            Ok(Some(v)) => codec::decode_fingerprints(&k, &v),
            Ok(None) => Ok(BTreeMap::new()),
            Err(e) => Err(StateError::sled("get fingerprints", key.to_string(), e)),
        }
    }

    /// Dead letters of an owner (a sink name, or [`SOURCE_OWNER`](crate::SOURCE_OWNER)) for a partition, oldest first.
    pub fn dead_letters(
        &self,
        pipeline: &str,
        owner: &str,
        partition: u32,
    ) -> Result<Vec<DeadLetter>, StateError> {
        let prefix = codec::queue_key(pipeline, owner, partition);
        let mut out = Vec::new();
        for item in self.inner.trees.dead_letters.scan_prefix(&prefix) {
            let (k, v) =
                item.map_err(|e| StateError::sled("scan dead letters", show_key(&prefix), e))?;
            out.push(codec::decode_dead_letter(&k, &v)?);
        }
        Ok(out)
    }

    /// Every stored dead letter of every pipeline and owner, in key order (owner, partition,
    /// seq), optionally only those of one owner.
    pub fn all_dead_letters(
        &self,
        owner: Option<&str>,
    ) -> Result<Vec<StoredDeadLetter>, StateError> {
        let mut out = Vec::new();
        for item in self.inner.trees.dead_letters.iter() {
            let (k, v) = item.map_err(|e| StateError::sled("scan dead letters", "all", e))?;
            let prefix = &k[..k.len().saturating_sub(8)];
            let (pipeline, name, _) = codec::parse_queue_key("dead letter key", prefix)?;
            if owner.is_some_and(|owner| owner != name) {
                continue;
            }
            out.push(StoredDeadLetter {
                seq: codec::parse_seq_suffix("dead letter key", &k)?,
                letter: codec::decode_dead_letter(&k, &v)?,
                pipeline,
                owner: name,
            });
        }
        Ok(out)
    }

    /// The pipeline whose worker ran on this directory in cluster mode, if one did: the
    /// directory is then that worker's cache, and ZooKeeper holds the partitions' state.
    pub fn cluster_cache(&self) -> Result<Option<String>, StateError> {
        identity::cluster_cache(&self.inner.trees)
    }

    /// A dead-letter change on a cluster worker's cache would not reach ZooKeeper, and the
    /// next load of the partition would undo it: refused.
    fn refuse_on_cluster_cache(&self, what: &'static str) -> Result<(), StateError> {
        match self.cluster_cache()? {
            Some(pipeline) => Err(StateError::ClusterRefused {
                what,
                reason: format!(
                    "this directory is the local cache of a cluster worker of pipeline `{pipeline}`: the partitions' dead-letter references live in ZooKeeper, which a change here would not update, and the next worker to load a partition would undo it; export the dead letters (`dead-letters export`) and publish the fixed records to the source again"
                ),
            }),
            None => Ok(()),
        }
    }

    /// Durably removes these dead letters (blocking); returns how many were still there. The
    /// owners' counters stay, so later dead letters never reuse a seq. Refused on a cluster
    /// worker's directory.
    pub fn remove_dead_letters_blocking(
        &self,
        letters: &[StoredDeadLetter],
    ) -> Result<u64, StateError> {
        self.refuse_on_cluster_cache("removing dead letters")?;
        let keys = letters.iter().map(dead_letter_key).collect();
        match self.inner.submit_blocking(Op::RemoveDeadLetters(keys))? {
            Outcome::Removed(removed) => Ok(removed),
            Outcome::Commit(_) | Outcome::Done => Ok(0),
        }
    }

    /// Moves sink dead letters back into their sinks' outboxes (blocking): each becomes the
    /// given batch, appended to the queue of its sink and partition with its payload stored, and
    /// the dead letter is removed in the same transaction (one per partition). Source positions
    /// stay as they are. Returns how many were moved.
    pub fn requeue_dead_letters_blocking(
        &self,
        requeued: Vec<(StoredDeadLetter, SealedBatch)>,
    ) -> Result<u64, StateError> {
        self.refuse_on_cluster_cache("requeueing dead letters")?;
        let mut by_partition: BTreeMap<(String, u32), Vec<(StoredDeadLetter, SealedBatch)>> =
            BTreeMap::new();
        for (letter, batch) in requeued {
            check_name("sink", &letter.owner)?;
            let place = (letter.pipeline.clone(), letter.letter.partition);
            by_partition.entry(place).or_default().push((letter, batch));
        }
        let mut moved = 0;
        for ((pipeline, partition), items) in by_partition {
            let commit = prepare_requeue(&pipeline, partition, &items)?;
            self.inner.submit_blocking(Op::Commit(commit))?;
            moved += items.len() as u64;
        }
        Ok(moved)
    }

    /// A sink-wide value set by [`StateStore::acknowledge`], [`StateStore::acknowledge_with`] or
    /// [`StateStore::set_sink_value`].
    pub fn sink_value(
        &self,
        pipeline: &str,
        sink: &str,
        name: &str,
    ) -> Result<Option<Vec<u8>>, StateError> {
        let key = codec::sink_value_key(pipeline, sink, name);
        self.inner
            .trees
            .sink_values
            .get(&key)
            .map(|v| v.map(|v| v.to_vec()))
            .map_err(|e| StateError::sled("get sink value", show_key(&key), e))
    }

    /// The sink-wide values of `sink` whose names start with `prefix`, by name.
    pub fn sink_values_with_prefix(
        &self,
        pipeline: &str,
        sink: &str,
        prefix: &str,
    ) -> Result<Vec<(String, Vec<u8>)>, StateError> {
        let key_prefix = codec::sink_value_key(pipeline, sink, prefix);
        let names_from = key_prefix.len() - prefix.len();
        let mut out = Vec::new();
        for item in self.inner.trees.sink_values.scan_prefix(&key_prefix) {
            let (key, value) =
                item.map_err(|e| StateError::sled("scan sink values", show_key(&key_prefix), e))?;
            let name = String::from_utf8_lossy(&key[names_from..]).into_owned();
            out.push((name, value.to_vec()));
        }
        Ok(out)
    }

    /// Records that this store belongs to `pipeline` with `partitions` partitions, or refuses
    /// ([`StateError::OtherPipeline`]) when it belongs to another name or partition count.
    pub fn claim(&self, pipeline: &str, partitions: u32) -> Result<(), StateError> {
        check_name("pipeline", pipeline)?;
        let wanted = PipelineIdentity {
            pipeline: pipeline.to_owned(),
            partitions,
        };
        identity::claim(&self.inner.trees, &self.inner.dir, &wanted)
    }

    /// The identity of this outbox, drawn when the store was created; `None` for a store
    /// created before outbox identities existed (see [`OutboxId`]).
    pub fn outbox_id(&self) -> Result<Option<OutboxId>, StateError> {
        identity::outbox_id(&self.inner.trees)
    }

    /// The pipeline this store was claimed by, if any.
    pub fn identity(&self) -> Result<Option<PipelineIdentity>, StateError> {
        identity::recorded(&self.inner.trees)
    }

    /// Everything, for `flow-worker status`.
    pub fn summary(&self) -> Result<StateSummary, StateError> {
        summary::build(&self.inner.trees)
    }

    /// The names of the sinks this store knows, over every pipeline: those with batches,
    /// fingerprints, dead letters, counters or sink-wide values (for `dead-letters --sink`, which
    /// refuses a name that is none of them).
    pub fn sink_names(&self) -> Result<std::collections::BTreeSet<String>, StateError> {
        summary::sink_names(&self.inner.trees)
    }

    /// Stops the committer thread after the requests already sent (for every clone of this
    /// handle: later requests fail with [`StateError::Closed`]) and makes everything durable.
    ///
    /// When this was the last handle, it returns once sled has let go of the directory's lock,
    /// so the directory can be opened again at once (by this process or another).
    pub fn close(self) -> Result<(), StateError> {
        self.inner.shutdown()?;
        let dir = self.inner.dir.clone();
        let last = Arc::strong_count(&self.inner) == 1;
        drop(self);
        if last {
            wait_for_lock_release(&dir);
        }
        Ok(())
    }

    /// Committer statistics.
    pub fn stats(&self) -> StoreStats {
        self.inner.stats.snapshot()
    }
}

/// How long [`StateStore::close`] waits at most for sled to release the directory's lock.
const LOCK_RELEASE_WAIT: Duration = Duration::from_secs(5);

/// Waits until the lock sled holds on `dir/db` is free. sled's last handle returns while its
/// I/O pool threads may still hold the locked file for a moment; an open right after a close
/// (a test, an embedding program reopening its store) then failed with `Locked` (seen in CI).
/// The probe takes and drops the same `flock` sled takes; gives up quietly after
/// [`LOCK_RELEASE_WAIT`], leaving the next open to report a lock that is really held.
fn wait_for_lock_release(dir: &Path) {
    let Ok(file) = std::fs::File::open(dir.join("db")) else {
        return;
    };
    let started = Instant::now();
    while started.elapsed() < LOCK_RELEASE_WAIT {
        match file.try_lock() {
            Ok(()) => {
                let _ = file.unlock();
                return;
            }
            Err(std::fs::TryLockError::WouldBlock) => std::thread::sleep(Duration::from_millis(5)),
            Err(std::fs::TryLockError::Error(_)) => return,
        }
    }
}

/// Opens sled in `dir`, waiting up to `options.lock_wait` while another process holds its lock.
/// Each attempt first removes the snapshots a killed open left unfinished (`unfinished_snapshot`).
fn open_sled(dir: &Path, options: &StoreOptions) -> Result<sled::Db, StateError> {
    let started = Instant::now();
    loop {
        unfinished_snapshot::remove_unfinished_snapshots(dir)?;
        match sled::Config::new()
            .path(dir)
            .cache_capacity(options.cache_capacity)
            .open()
        {
            Err(err) if is_lock_refusal(&err) && started.elapsed() < options.lock_wait => {
                std::thread::sleep(Duration::from_millis(50));
            }
            result => return result.map_err(|source| open_error(dir, source)),
        }
    }
}

/// The error of a failed sled open: the lock held by another process, a directory that cannot be
/// written, or sled's own reason.
fn open_error(dir: &Path, source: sled::Error) -> StateError {
    let dir = dir.to_path_buf();
    if is_lock_refusal(&source) {
        return StateError::Locked { dir };
    }
    match source {
        sled::Error::Io(io) if is_not_writable(&io) => StateError::NotWritable { dir, source: io },
        source => StateError::Open { dir, source },
    }
}

/// Whether sled refused to open because another process holds the lock it takes on the store's
/// `db` file. Told by sled's own error rather than by probing the lock afterwards: sled may fail
/// later in its open (recovering a store) with its own handle on `db` still locked, and a probe
/// from this process would then report a worker that does not exist and hide the real cause.
fn is_lock_refusal(err: &sled::Error) -> bool {
    match err {
        sled::Error::Io(io) => {
            io.kind() == std::io::ErrorKind::Other
                && io.to_string().starts_with("could not acquire lock on ")
        }
        _ => false,
    }
}

fn stored_batch(key: &[u8], value: &[u8]) -> Result<StoredBatch, StateError> {
    let seq = codec::parse_seq_suffix("batch key", key)?;
    let (batch, body) = codec::decode_batch(key, value)?;
    Ok(StoredBatch { seq, batch, body })
}

/// (queue key, segment) of every stored payload, one entry per batch.
fn referenced_segments(trees: &Trees) -> Result<Vec<(Vec<u8>, u64)>, StateError> {
    let mut out = Vec::new();
    for item in trees.batches.iter() {
        let (k, v) = item.map_err(|e| StateError::sled("scan", "batches", e))?;
        // A value this version cannot decode references no segment; reading that batch reports
        // why (`undelivered`, `status`).
        if let Ok((_, BodyRecord::Segment { segment, .. })) = codec::decode_batch_parts(&k, &v) {
            let queue = k[..k.len().saturating_sub(8)].to_vec();
            out.push((queue, segment));
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests;
