//! Cutting an epoch into encoded per-shard parts: each row is routed to its shard
//! ([`encode_routed`]) and encoded once; [`BatchCutter`] seals the buffers into [`Part`]s at the
//! batch limits.

use std::sync::Arc;

use bytes::Bytes;
use flow_core::{
    reserve_projected, CapacityDecay, DeadRow, Epoch, FaultedIn, Headroom, MessageBatch, Row,
    SinkError, PROJECT_AFTER,
};
use flow_state::DeadLetter;
use tokio::sync::watch;
use xxhash_rust::xxh64::Xxh64;

use crate::config::params::OnBadRows;
use crate::config::topology::ShardIndex;
use crate::delivery::sink_state::SinkShared;
use crate::encode::compress::{is_framed, seal, PartFormat};
use crate::encode::routing::routing_key;
use crate::encode::rowbinary::{EncodeError, RowBinaryEncoder};
use crate::server::session::{ColumnsPlan, WriterSession};

/// Rows encoded between two yields to the runtime: encoding an epoch takes tens of
/// milliseconds, during which the thread would otherwise not serve the delivery lanes' HTTP
/// exchanges (a worker measured its first connections taking 100 ms to complete on loopback
/// while the partitions encoded and generated).
const YIELD_EVERY_ROWS: usize = 8192;

/// One encoded part of a batch for one shard.
#[derive(Debug)]
pub struct Part {
    pub shard: ShardIndex,
    pub first_offset: u64,
    pub last_offset: u64,
    pub rows: u64,
    /// Bytes of the encoded rows before framing.
    pub encoded_bytes: u64,
    /// xxh64 of the encoded rows before framing (what a rebuilt batch is checked against).
    pub content_hash: u64,
    pub format: PartFormat,
    pub payload: Bytes,
    /// The fingerprint of the plan the rows were encoded with
    /// ([`RowBinaryEncoder::plan_fingerprint`]).
    pub plan: Arc<str>,
}

impl Part {
    pub fn compressed(&self) -> bool {
        is_framed(self.format.as_str())
    }
}

/// Cuts an epoch's rows into batches (`max_rows_per_batch`, `max_bytes_per_batch`, in message
/// order), routes each row to its shard and encodes it once. An epoch may come in slices
/// ([`flow_core::Sink::write_slice`]): the batch being cut spans them, and only
/// [`BatchCutter::seal_open`] at the epoch's end seals what is left, so the batches are the same
/// however the epoch was sliced. Buffers are reused across epochs and give back a burst's
/// capacity after a run of smaller batches.
#[derive(Default)]
pub struct BatchCutter {
    buffers: Vec<Vec<u8>>,
    /// The content hash of each buffer, kept up with its rows ([`RunningHash`]).
    hashes: Vec<RunningHash>,
    decay: Vec<CapacityDecay>,
    faulted: Vec<FaultedIn>,
    rows: Vec<u64>,
    key: Vec<u8>,
    open: OpenBatch,
    cut: EpochCut,
    /// The plan the open epoch is encoded with: taken from the session at its first row, so
    /// that a change adopted meanwhile applies from the next epoch (every batch of an epoch is
    /// sealed under one plan, which its outbox entry names).
    plan: Option<Arc<ColumnsPlan>>,
}

/// The xxh64 of one encode buffer, taken a stretch of rows at a time ([`YIELD_EVERY_ROWS`]) while
/// they are still in the cache they were encoded in: hashed whole at the seal, the buffer (10 MB
/// for 100k rows of the benchmark's table) was read back from memory, and the hash cost 5 % of a
/// worker's CPU. Streaming xxh64 gives the one-shot value, so stored hashes stay comparable.
struct RunningHash {
    state: Xxh64,
    /// Bytes of the buffer hashed so far.
    hashed: usize,
}

impl Default for RunningHash {
    fn default() -> Self {
        RunningHash {
            state: Xxh64::new(0),
            hashed: 0,
        }
    }
}

impl RunningHash {
    /// Hashes what `buffer` gained since the last call.
    fn catch_up(&mut self, buffer: &[u8]) {
        if let Some(fresh) = buffer.get(self.hashed..) {
            self.state.update(fresh);
            self.hashed = buffer.len();
        }
    }

    /// The hash of all of `buffer`, starting over for the next batch.
    fn finish(&mut self, buffer: &[u8]) -> u64 {
        self.catch_up(buffer);
        let hash = self.state.digest();
        *self = RunningHash::default();
        hash
    }
}

/// What the cutting of one epoch produced so far.
#[derive(Debug, Default)]
pub struct EpochCut {
    /// Sealed parts, batch by batch, shards in name order.
    pub parts: Vec<Part>,
    /// Rows set aside under `on_bad_rows: dead_letter`.
    pub dead_letters: Vec<DeadLetter>,
    /// The plan the parts were encoded with (`None` when no row was cut).
    pub plan: Option<Arc<ColumnsPlan>>,
}

/// The batch being cut, and where its epoch stands.
#[derive(Debug, Default)]
struct OpenBatch {
    /// The epoch's number ([`flow_core::Epoch::number`]); `None` between epochs.
    epoch: Option<u64>,
    /// The most messages of the epoch (`epoch.max_messages`).
    epoch_bound: usize,
    /// Rows of the epoch taken so far, in this batch and the ones sealed before it.
    epoch_rows: usize,
    rows: usize,
    bytes: usize,
    /// Bounds of the batch, rejected rows included.
    first_offset: Option<u64>,
    last_offset: u64,
    /// A slice of the epoch went uncut ([`BatchCutter::cut_slice`]).
    incomplete: bool,
}

impl BatchCutter {
    /// Cuts one slice of an epoch ([`flow_core::Sink::write_slice`]): its batches stay open. If
    /// the pipeline began stopping before the writer session started, the slice is not cut and
    /// its epoch is [`BatchCutter::incomplete`].
    pub async fn cut_slice(
        &mut self,
        shared: &SinkShared,
        stop: &watch::Receiver<bool>,
        slice: &Epoch<'_>,
    ) -> Result<(), SinkError> {
        let at = (slice.number, slice.max_messages);
        let Some(session) = shared.session(stop).await? else {
            self.join_epoch(at);
            self.open.incomplete = true;
            return Ok(());
        };
        for batch in slice.inputs {
            self.cut(shared, &session, at, batch, &|_| true).await?;
        }
        Ok(())
    }

    /// Whether a slice of epoch `number` went uncut ([`BatchCutter::cut_slice`]): the epoch must
    /// not commit.
    pub fn incomplete(&self, number: u64) -> bool {
        self.open.incomplete && self.open.epoch == Some(number)
    }

    /// Cuts the epoch's last slice (or the whole epoch), sealing what each input stream left
    /// open, and returns everything the epoch's cutting produced.
    pub async fn cut_epoch(
        &mut self,
        shared: &SinkShared,
        session: &WriterSession,
        epoch: &Epoch<'_>,
    ) -> Result<EpochCut, SinkError> {
        self.cut_epoch_rows(shared, session, epoch, |_| true).await
    }

    /// [`BatchCutter::cut_epoch`] over the rows whose index `keep` accepts (the rows of one
    /// table of a table template, see [`crate::tables`]). The batches' bounds are the kept rows'
    /// ids, so a batch spans the other tables' rows between them.
    pub async fn cut_epoch_rows(
        &mut self,
        shared: &SinkShared,
        session: &WriterSession,
        epoch: &Epoch<'_>,
        keep: impl Fn(usize) -> bool,
    ) -> Result<EpochCut, SinkError> {
        let at = (epoch.number, epoch.max_messages);
        for batch in epoch.inputs {
            self.cut(shared, session, at, batch, &keep).await?;
            self.seal_open(shared, batch_limits(shared));
        }
        Ok(self.take_epoch())
    }

    /// Encodes the rows of `batch`, a slice (or all) of epoch `number` holding at most
    /// `epoch_bound` messages, sealing a batch whenever one reaches a limit; rows that fail the
    /// checks become dead letters or fail the epoch, as `on_bad_rows` says ([`reject_row`]). A
    /// batch's bounds cover its rejected rows too, so a rebuild cuts it at the same places.
    /// Rows of another epoch left open (that epoch was vetoed before its end) are dropped.
    async fn cut(
        &mut self,
        shared: &SinkShared,
        session: &WriterSession,
        (number, epoch_bound): (u64, usize),
        batch: &MessageBatch,
        keep: &impl Fn(usize) -> bool,
    ) -> Result<(), SinkError> {
        self.join_epoch((number, epoch_bound));
        let shards = shared.router.shards().len().max(1);
        self.buffers.resize_with(shards, Vec::new);
        self.hashes.resize_with(shards, RunningHash::default);
        self.decay.resize(shards, CapacityDecay::default());
        self.rows.resize(shards, 0);
        let (max_rows, max_bytes) = batch_limits(shared);
        let plan = Arc::clone(self.plan.get_or_insert_with(|| session.plan()));
        for (index, row) in batch.rows().enumerate() {
            if index % YIELD_EVERY_ROWS == YIELD_EVERY_ROWS - 1 {
                self.hash_encoded();
                tokio::task::yield_now().await;
            }
            if !keep(index) {
                continue;
            }
            self.open.first_offset.get_or_insert(row.id().offset);
            self.open.last_offset = row.id().offset;
            self.open.epoch_rows += 1;
            match encode_routed(
                shared,
                &plan.encoder,
                &row,
                &mut self.buffers,
                &mut self.key,
            ) {
                Ok((shard, size)) => {
                    self.open.bytes += size;
                    self.open.rows += 1;
                    self.rows[shard] += 1;
                }
                Err(rejected) => {
                    reject_row(
                        shared,
                        &row,
                        rejected,
                        BadRows::Record(&mut self.cut.dead_letters),
                    )?;
                    continue;
                }
            }
            if self.open.rows == PROJECT_AFTER {
                // The rest of the epoch from this batch's first row on, at most a batch's worth.
                let before = self.open.epoch_rows - self.open.rows;
                let remaining = self.open.epoch_bound.saturating_sub(before);
                self.reserve_projected(self.open.rows, remaining.min(max_rows), max_bytes);
            }
            if self.open.rows >= max_rows || self.open.bytes >= max_bytes {
                self.seal_open(shared, (max_rows, max_bytes));
            }
        }
        // The next slice's rows are read before they are cut: hash these while they are cached.
        self.hash_encoded();
        Ok(())
    }

    /// Hashes the rows encoded since the last call ([`RunningHash`]).
    fn hash_encoded(&mut self) {
        for (hash, buffer) in self.hashes.iter_mut().zip(&self.buffers) {
            hash.catch_up(buffer);
        }
    }

    /// Everything the epoch's cutting produced; the next `cut` starts a new epoch.
    fn take_epoch(&mut self) -> EpochCut {
        self.abandon();
        let mut cut = std::mem::take(&mut self.cut);
        cut.plan = self.plan.take();
        cut
    }

    /// Starts epoch `number` unless it is the one being cut: what another epoch left (its
    /// batch, parts and dead letters) is dropped, since that epoch was never committed.
    fn join_epoch(&mut self, (number, epoch_bound): (u64, usize)) {
        if self.open.epoch == Some(number) {
            return;
        }
        self.abandon();
        self.cut = EpochCut::default();
        self.plan = None;
        self.open.epoch = Some(number);
        self.open.epoch_bound = epoch_bound;
    }

    /// Drops the open batch's rows, keeping the buffers' room.
    fn abandon(&mut self) {
        for buffer in &mut self.buffers {
            buffer.clear();
        }
        self.hashes
            .iter_mut()
            .for_each(|hash| *hash = RunningHash::default());
        self.rows.iter_mut().for_each(|rows| *rows = 0);
        self.open = OpenBatch::default();
    }

    /// Seals what the open batch holds (at a batch limit, or at the end of an epoch or of one of
    /// its input streams); `limits`: rows and bytes per batch ([`batch_limits`]).
    fn seal_open(&mut self, shared: &SinkShared, (max_rows, max_bytes): (usize, usize)) {
        let open = &self.open;
        let Some(first) = open.first_offset else {
            return;
        };
        let epoch = Headroom::for_load(open.epoch_rows, Some(open.epoch_bound));
        let room = batch_room(epoch, (open.rows, max_rows), (open.bytes, max_bytes));
        let last = open.last_offset;
        let mut parts = std::mem::take(&mut self.cut.parts);
        self.seal(shared, first, last, &mut parts, room);
        self.cut.parts = parts;
        self.open.rows = 0;
        self.open.bytes = 0;
        self.open.first_offset = None;
    }

    /// Gives each encode buffer that was never sealed room for `expected_rows` rows of the batch
    /// (at most `max_bytes`), projected from its bytes after `rows_so_far` ([`reserve_projected`]).
    /// A sealed buffer keeps the room its seal gave it: a shard's share of the first rows varies
    /// from batch to batch, and following it would reallocate and rewrite the buffer every few
    /// batches.
    fn reserve_projected(&mut self, rows_so_far: usize, expected_rows: usize, max_bytes: usize) {
        let sealed = self.faulted.len();
        for buffer in self.buffers.iter_mut().skip(sealed) {
            reserve_projected(buffer, rows_so_far, expected_rows, max_bytes);
        }
    }

    /// Encodes one row into its shard's buffer with `plan` (rebuilding a batch row by row).
    pub fn push_row(
        &mut self,
        shared: &SinkShared,
        plan: &Arc<ColumnsPlan>,
        row: &Row<'_>,
    ) -> Result<(), SinkError> {
        self.plan.get_or_insert_with(|| Arc::clone(plan));
        let shards = shared.router.shards().len().max(1);
        self.buffers.resize_with(shards, Vec::new);
        self.hashes.resize_with(shards, RunningHash::default);
        self.decay.resize(shards, CapacityDecay::default());
        self.rows.resize(shards, 0);
        match encode_routed(shared, &plan.encoder, row, &mut self.buffers, &mut self.key) {
            Ok((shard, _)) => {
                self.rows[shard] += 1;
                Ok(())
            }
            // Its dead letter was committed with the batch's epoch.
            Err(rejected) => reject_row(shared, row, rejected, BadRows::Recorded),
        }
    }

    /// Seals what the buffers hold as one batch with the given bounds: one part per shard that
    /// received rows, in shard order. The buffers then keep `headroom` for the next batch.
    pub fn seal(
        &mut self,
        shared: &SinkShared,
        first_offset: u64,
        last_offset: u64,
        parts: &mut Vec<Part>,
        headroom: Headroom,
    ) {
        self.faulted
            .resize(self.buffers.len(), FaultedIn::default());
        self.hashes
            .resize_with(self.buffers.len(), RunningHash::default);
        let plan: Arc<str> = self
            .plan
            .as_ref()
            .map(|plan| Arc::from(plan.encoder.plan_fingerprint()))
            .unwrap_or_else(|| Arc::from(""));
        let buffers = self.buffers.iter_mut().zip(&mut self.decay);
        let buffers = buffers.zip(&mut self.faulted).zip(&mut self.hashes);
        for (index, (((buffer, decay), faulted), hash)) in buffers.enumerate() {
            if buffer.is_empty() {
                continue;
            }
            let rows = std::mem::take(&mut self.rows[index]);
            let content_hash = hash.finish(buffer);
            let (format, payload) = seal(shared.params.codec, buffer);
            parts.push(Part {
                shard: ShardIndex(index),
                first_offset,
                last_offset,
                rows,
                encoded_bytes: buffer.len() as u64,
                content_hash,
                format,
                payload,
                plan: Arc::clone(&plan),
            });
            // The encode buffer keeps its capacity for the next batch, unless it is oversized.
            if decay.should_shrink(headroom.target(buffer.len()), buffer.capacity()) {
                headroom.fit(buffer);
            }
            faulted.settle(buffer, 0, headroom);
        }
    }
}

/// `max_rows_per_batch` and `max_bytes_per_batch` in force.
pub(crate) fn batch_limits(shared: &SinkShared) -> (usize, usize) {
    let dynamic = shared.dynamic();
    (
        usize::try_from(dynamic.max_rows_per_batch).unwrap_or(usize::MAX),
        usize::try_from(dynamic.max_bytes_per_batch).unwrap_or(usize::MAX),
    )
}

/// The room encode buffers keep after a batch of `rows` and `bytes` (each with its limit): what an
/// epoch at its bound would put in a batch, which neither batch limit lets grow further.
fn batch_room(epoch: Headroom, rows: (usize, usize), bytes: (usize, usize)) -> Headroom {
    epoch
        .min(Headroom::for_load(rows.0, Some(rows.1)))
        .min(Headroom::for_load(bytes.0, Some(bytes.1)))
}

/// A row that failed the checks before sealing, with the shard it was routed to.
#[derive(Debug)]
pub struct RowRejected {
    pub shard: usize,
    pub error: EncodeError,
}

/// Where a rejected row goes under `on_bad_rows: dead_letter`.
pub enum BadRows<'a> {
    /// Into these dead letters (sealing an epoch).
    Record(&'a mut Vec<DeadLetter>),
    /// Nowhere: it was recorded when its epoch was sealed (rebuilding a batch).
    Recorded,
}

/// The one decision for a rejected row: with `on_bad_rows: stop` the epoch fails with the row's
/// id, column and reason; with `dead_letter` the row becomes a dead letter ([`DeadRow`]).
pub fn reject_row(
    shared: &SinkShared,
    row: &Row<'_>,
    rejected: RowRejected,
    bad_rows: BadRows<'_>,
) -> Result<(), SinkError> {
    if shared.params.on_bad_rows == OnBadRows::Stop {
        return Err(SinkError::Rejected {
            message_id: row.id().to_string(),
            source: Box::new(rejected.error),
        });
    }
    if let BadRows::Record(dead) = bad_rows {
        let shard = shared
            .sharded
            .then(|| shared.shard_name(ShardIndex(rejected.shard)).to_owned());
        // The row's values are in its stream's column order.
        let columns: Vec<String> = shared
            .stream
            .columns()
            .iter()
            .map(|c| c.name.clone())
            .collect();
        dead.push(DeadLetter {
            partition: row.id().partition,
            offset: Some(row.id().offset),
            reason: rejected.error.to_string(),
            payload: DeadRow::encode(
                row,
                &columns,
                shard.as_deref(),
                Some(&rejected.error.column),
                None,
            ),
        });
    }
    Ok(())
}

/// Routes `row` to its shard (always shard 0 unless sharded) and appends its RowBinary
/// encoding to that shard's buffer; returns the shard index and the encoded size. A row that
/// fails leaves the buffer as it was.
#[inline]
pub fn encode_routed(
    shared: &SinkShared,
    encoder: &RowBinaryEncoder,
    row: &Row<'_>,
    buffers: &mut [Vec<u8>],
    key: &mut Vec<u8>,
) -> Result<(usize, usize), RowRejected> {
    let shard = if shared.sharded {
        routing_key(row, &shared.key_columns, key);
        shared.router.route(key)
    } else {
        0
    };
    let buffer = &mut buffers[shard];
    let before = buffer.len();
    if let Err(error) = encoder.encode_row(row, buffer) {
        buffer.truncate(before);
        return Err(RowRejected { shard, error });
    }
    Ok((shard, buffer.len() - before))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_hash_kept_up_while_rows_are_encoded_equals_the_one_shot_xxh64_of_the_batch() {
        let rows: Vec<u8> = (0..100_000u32).map(|i| (i * 7 % 251) as u8).collect();
        let mut buffer = Vec::new();
        let mut hash = RunningHash::default();
        // Caught up at uneven points, twice at one of them, as slices and yields fall.
        for end in [0, 1, 31, 32, 33, 33, 4_096, 65_537, 99_999] {
            buffer.extend_from_slice(&rows[buffer.len()..end]);
            hash.catch_up(&buffer);
        }
        buffer.extend_from_slice(&rows[buffer.len()..]);
        assert_eq!(hash.finish(&buffer), xxhash_rust::xxh64::xxh64(&rows, 0));
        // The next batch starts over in the cleared buffer.
        buffer.clear();
        buffer.extend_from_slice(&rows[..1_000]);
        hash.catch_up(&buffer);
        assert_eq!(
            hash.finish(&buffer),
            xxhash_rust::xxh64::xxh64(&rows[..1_000], 0)
        );
    }

    #[test]
    fn encode_buffers_reserve_the_projected_batch_once_within_the_byte_limit() {
        let mut cutter = BatchCutter {
            buffers: vec![vec![1; 100 * 1024], vec![2; 50 * 1024]],
            ..BatchCutter::default()
        };
        // 1024 rows so far: 100 and 50 bytes a row of them, 100k rows expected.
        cutter.reserve_projected(1024, 100_000, usize::MAX);
        let capacities: Vec<usize> = cutter.buffers.iter().map(Vec::capacity).collect();
        assert_eq!(capacities, vec![11_250_000, 5_625_000]);
        let at = cutter.buffers[0].as_ptr();
        cutter.reserve_projected(1024, 100_000, usize::MAX);
        assert_eq!(cutter.buffers[0].as_ptr(), at, "room already there");
        // Sealed buffers keep their room, even where a projection would ask for more.
        cutter.faulted.resize(2, FaultedIn::default());
        cutter.buffers[1].resize(100 * 1024, 3);
        cutter.reserve_projected(1024, 100_000, usize::MAX);
        assert_eq!(cutter.buffers[1].capacity(), 5_625_000);
        // The byte limit caps the projection.
        let mut capped = BatchCutter {
            buffers: vec![vec![1; 100 * 1024]],
            ..BatchCutter::default()
        };
        capped.reserve_projected(1024, 100_000, 1 << 20);
        assert_eq!(capped.buffers[0].capacity(), (1 << 20) + (1 << 17));
    }

    /// A sink of an unreachable host (nothing listens on port 1).
    fn unreachable_sink() -> std::sync::Arc<SinkShared> {
        let inputs = [("rows".to_owned(), flow_core::sources::generator::schema())];
        let ctx = flow_core::registry::SinkBuildContext {
            pipeline: "p",
            sink: "s",
            class: crate::config::guarantee::SinkClass::Batching.class_name(),
            partitions: 1,
            epoch: flow_core::EpochSettings::default(),
            inputs: &inputs,
            subjects: flow_core::registry::SourceSubjects::Unknown,
            paths: flow_core::SpecPaths::working_directory(),
        };
        let parameters: serde_yaml::Value =
            serde_yaml::from_str("{host: '127.0.0.1:1', table: t}").expect("parameters parse");
        crate::delivery::sink_state::build_shared(
            crate::config::guarantee::SinkClass::Batching,
            &ctx,
            &parameters,
            &serde_yaml::Value::Null,
        )
        .expect("parameters validate")
    }

    #[tokio::test]
    async fn a_slice_left_uncut_by_a_stop_marks_its_epoch_incomplete_until_another_epoch_begins() {
        let shared = unreachable_sink();
        let (_stop, stopped) = watch::channel(true);
        let batch = MessageBatch::new(flow_core::sources::generator::schema());
        let inputs = [&batch];
        let slice = |number| Epoch {
            number,
            started_ms: 0,
            max_messages: 10,
            inputs: &inputs,
        };
        let mut cutter = BatchCutter::default();
        assert!(!cutter.incomplete(3));
        cutter
            .cut_slice(&shared, &stopped, &slice(3))
            .await
            .unwrap();
        assert!(cutter.incomplete(3));
        assert!(!cutter.incomplete(4));
        // A later epoch starts clean, and only its own uncut slice marks it.
        cutter
            .cut_slice(&shared, &stopped, &slice(4))
            .await
            .unwrap();
        assert!(cutter.incomplete(4));
        assert!(!cutter.incomplete(3));
    }

    #[test]
    fn a_batch_cut_by_either_limit_keeps_only_an_eighth_of_room() {
        let half_epoch = Headroom::for_load(50, Some(100));
        // Below both limits in a half-full epoch: room for the full epoch.
        let room = batch_room(half_epoch, (500, 1000), (5_000, 10_000));
        assert_eq!(room.target(8000), 16_000);
        // Cut by bytes at half its rows, or by rows at half its bytes: no room to grow.
        assert_eq!(
            batch_room(half_epoch, (500, 1000), (10_000, 10_000)).target(8000),
            9000
        );
        assert_eq!(
            batch_room(half_epoch, (1000, 1000), (5_000, 10_000)).target(8000),
            9000
        );
        // A full epoch: an eighth whatever the batch.
        let full_epoch = Headroom::for_load(100, Some(100));
        assert_eq!(
            batch_room(full_epoch, (500, 1000), (5_000, 10_000)).target(8000),
            9000
        );
    }
}
