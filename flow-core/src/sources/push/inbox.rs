//! The machinery of a push source: one inbox per partition holding the rows sent until their
//! commit, the [`PartitionObserver`] calls that resolve receipts, and the source the pipeline
//! reads an inbox through.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};

use async_trait::async_trait;
use tokio::sync::{watch, Notify};

use super::error::{value_error, PushError};
use crate::error::{RuntimeError, SourceError, Violation};
use crate::message::{MessageBatch, MessageId, Row, RowWriter, Value};
use crate::plugin::{
    PartitionEnd, PartitionObserver, ReadLimits, Source, SourceFactory, SourceOutput, SourceRead,
};
use crate::registry::BuildResult;
use crate::spec::is_valid_name;
use crate::types::StreamSchema;

/// Rows per inbox chunk: chunks are dropped (and reused) whole once committed.
const CHUNK_ROWS: usize = 1024;
/// Emptied chunks an inbox keeps for reuse.
const SPARE_CHUNKS: usize = 4;
/// What a message counts besides its values: its id.
const ID_BYTES: u64 = 16;
/// What each value counts besides its string or packed bytes (a batch cell).
const CELL_BYTES: u64 = 16;

pub(super) struct Shared {
    pub(super) stream_id: String,
    pub(super) schema: Arc<StreamSchema>,
    pub(super) max_buffered_bytes: u64,
    /// The inboxes, made when the spec is built (the partition count is known then).
    pub(super) inboxes: OnceLock<Vec<Arc<Inbox>>>,
    pub(super) bound: Notify,
    pub(super) finished: AtomicBool,
}

impl Shared {
    pub(super) fn bind(&self, partitions: u32) -> BuildResult<()> {
        let mut violations = Vec::new();
        if !is_valid_name(&self.stream_id) {
            violations.push(Violation::new(
                "source",
                format!(
                    "the push source's stream id `{}` must be letters, digits, `_` or `-`",
                    self.stream_id
                ),
            ));
        }
        let inboxes = self.inboxes.get_or_init(|| {
            let finished = self.finished.load(Ordering::SeqCst);
            (0..partitions)
                .map(|partition| Arc::new(Inbox::new(partition, self, finished)))
                .collect()
        });
        if self.finished.load(Ordering::SeqCst) {
            // `finish` may have run while the inboxes were being made, and found none.
            for inbox in inboxes {
                inbox.finish();
            }
        }
        self.bound.notify_waiters();
        if inboxes.len() != partitions as usize {
            violations.push(Violation::new(
                "partitions",
                format!(
                    "this push source was built for {} partitions; a new partition count needs a new PushSource",
                    inboxes.len()
                ),
            ));
        }
        if violations.is_empty() {
            Ok(())
        } else {
            Err(violations)
        }
    }
}

/// What receipts compare their ticket against. Tickets count the sends of a partition in this
/// process from 0; the message of ticket `t` has seq `first_seq + t`.
#[derive(Clone, Debug, Default)]
pub(super) struct Progress {
    first_seq: u64,
    /// Tickets below are committed.
    pub(super) committed: u64,
    /// Tickets below are held by every sink.
    pub(super) delivered: u64,
    /// Why the partition ended, once it did.
    pub(super) ended: Option<String>,
}

impl Progress {
    pub(super) fn id(&self, partition: u32, ticket: u64) -> MessageId {
        MessageId::new(partition, self.first_seq + ticket)
    }
}

/// One partition's messages, from their send until their commit.
pub(super) struct Inbox {
    pub(super) partition: u32,
    schema: Arc<StreamSchema>,
    max_bytes: u64,
    state: Mutex<InboxState>,
    /// Wakes the reader when a row arrives or the input ends.
    readable: Notify,
    /// Wakes waiting senders when the reader took rows, or the partition ended.
    space: Notify,
    pub(super) progress: watch::Sender<Progress>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
enum Phase {
    Open,
    Finished,
    Ended(String),
}

struct Chunk {
    /// Ticket of the first row.
    first: u64,
    rows: MessageBatch,
}

impl Chunk {
    fn end(&self) -> u64 {
        self.first + self.rows.len() as u64
    }
}

struct InboxState {
    /// Rows from the oldest uncommitted ticket to the newest sent, in ticket order.
    chunks: VecDeque<Chunk>,
    spare: Vec<MessageBatch>,
    next_ticket: u64,
    /// The next ticket to hand to the pipeline (moved back by a reopen after a veto).
    read: u64,
    /// Tickets below were read at least once: their bytes no longer count.
    fresh: u64,
    /// Tickets below are committed: a reopen never goes back before it.
    committed: u64,
    unread_bytes: u64,
    /// The seq of ticket 0, set when the pipeline first opens the partition.
    first_seq: Option<u64>,
    phase: Phase,
}

impl Inbox {
    fn new(partition: u32, shared: &Shared, finished: bool) -> Inbox {
        Inbox {
            partition,
            schema: Arc::clone(&shared.schema),
            max_bytes: shared.max_buffered_bytes.max(1),
            state: Mutex::new(InboxState {
                chunks: VecDeque::new(),
                spare: Vec::new(),
                next_ticket: 0,
                read: 0,
                fresh: 0,
                committed: 0,
                unread_bytes: 0,
                first_seq: None,
                phase: if finished {
                    Phase::Finished
                } else {
                    Phase::Open
                },
            }),
            readable: Notify::new(),
            space: Notify::new(),
            progress: watch::Sender::new(Progress::default()),
        }
    }

    fn lock(&self) -> MutexGuard<'_, InboxState> {
        self.state
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    pub(super) async fn enqueue(
        &self,
        mut write: impl FnMut(&mut RowWriter<'_>) -> Result<(), PushError>,
    ) -> Result<u64, PushError> {
        loop {
            // Registering for a wake-up takes the Notify's lock: only once the inbox is full.
            if let Some(ticket) = self.try_enqueue(&mut write)? {
                return Ok(ticket);
            }
            let space = self.space.notified();
            tokio::pin!(space);
            space.as_mut().enable();
            if let Some(ticket) = self.try_enqueue(&mut write)? {
                return Ok(ticket);
            }
            space.await;
        }
    }

    /// Appends the row if the inbox has room (`None`: it has not; nothing was appended).
    fn try_enqueue(
        &self,
        write: &mut impl FnMut(&mut RowWriter<'_>) -> Result<(), PushError>,
    ) -> Result<Option<u64>, PushError> {
        let mut guard = self.lock();
        let state = &mut *guard;
        match &state.phase {
            Phase::Open => {}
            Phase::Finished => return Err(PushError::Finished),
            Phase::Ended(reason) => {
                return Err(PushError::Stopped {
                    partition: self.partition,
                    reason: reason.clone(),
                })
            }
        }
        let ticket = state.next_ticket;
        let unread = state.unread_bytes;
        let chunk = writable_chunk(state, &self.schema);
        let mut row = chunk.rows.start_row(MessageId::new(self.partition, ticket));
        write(&mut row)?;
        let bytes = row.written_bytes() as u64 + ID_BYTES;
        if unread > 0 && unread + bytes > self.max_bytes {
            // Dropping the writer takes the row back out.
            return Ok(None);
        }
        row.finish().map_err(|err| value_error(err, &self.schema))?;
        state.next_ticket += 1;
        state.unread_bytes += bytes;
        // The reader waits only after finding nothing unread: wake it for the first row only.
        let first_unread = state.read == ticket;
        drop(guard);
        if first_unread {
            self.readable.notify_one();
        }
        Ok(Some(ticket))
    }

    pub(super) fn finish(&self) {
        let mut state = self.lock();
        if state.phase == Phase::Open {
            state.phase = Phase::Finished;
        }
        drop(state);
        self.readable.notify_one();
    }

    /// Appends up to `max` unread rows to `out`; how many, and the position after them.
    fn take(&self, out: &mut MessageBatch, max: usize) -> Result<TakeEnd, SourceError> {
        let mut guard = self.lock();
        let state = &mut *guard;
        let first_seq = state.first_seq.unwrap_or(0);
        let mut read = state.read;
        let mut released = 0u64;
        for chunk in &state.chunks {
            if read >= chunk.end() {
                continue;
            }
            for index in (read - chunk.first) as usize..chunk.rows.len() {
                if read - state.read >= max as u64 {
                    break;
                }
                let row = chunk.rows.row(index);
                copy_row(out, row, MessageId::new(self.partition, first_seq + read))?;
                if read >= state.fresh {
                    released += row_bytes(&row);
                }
                read += 1;
            }
        }
        let taken = read - state.read;
        state.read = read;
        state.fresh = state.fresh.max(read);
        state.unread_bytes -= released.min(state.unread_bytes);
        let end = TakeEnd {
            taken,
            position: first_seq + read,
            exhausted: state.phase != Phase::Open && read == state.next_ticket,
        };
        drop(guard);
        if released > 0 {
            self.space.notify_waiters();
        }
        Ok(end)
    }

    /// The ticket of a committed position (the next seq).
    fn ticket_of(&self, position: &[u8]) -> Option<u64> {
        let seq = super::super::position::decode_words::<1>(position)?[0];
        let first_seq = self.lock().first_seq?;
        seq.checked_sub(first_seq)
    }
}

struct TakeEnd {
    taken: u64,
    position: u64,
    exhausted: bool,
}

/// The chunk a new row goes into: the last one, or a new one when it is full.
fn writable_chunk<'a>(state: &'a mut InboxState, schema: &Arc<StreamSchema>) -> &'a mut Chunk {
    let full = state
        .chunks
        .back()
        .is_none_or(|chunk| chunk.rows.len() >= CHUNK_ROWS);
    if full {
        let rows = state
            .spare
            .pop()
            .unwrap_or_else(|| MessageBatch::new(Arc::clone(schema)));
        state.chunks.push_back(Chunk {
            first: state.next_ticket,
            rows,
        });
    }
    let last = state.chunks.len() - 1;
    &mut state.chunks[last]
}

fn copy_row(out: &mut MessageBatch, row: Row<'_>, id: MessageId) -> Result<(), SourceError> {
    let mut writer = out.start_row(id);
    for value in row.values() {
        writer
            .push(value)
            .map_err(|err| SourceError::Plugin(Box::new(err)))?;
    }
    writer
        .finish()
        .map_err(|err| SourceError::Plugin(Box::new(err)))
}

/// What a row counted in the inbox (as `RowWriter::written_bytes` plus the id).
fn row_bytes(row: &Row<'_>) -> u64 {
    let variable: usize = row
        .values()
        .map(|value| match value {
            Value::Bytes(bytes) | Value::Packed(bytes) => bytes.len(),
            _ => 0,
        })
        .sum();
    ID_BYTES + CELL_BYTES * row.len() as u64 + variable as u64
}

impl PartitionObserver for Inbox {
    fn committed(&self, position: &[u8]) {
        let Some(ticket) = self.ticket_of(position) else {
            return;
        };
        let mut state = self.lock();
        state.committed = state.committed.max(ticket);
        while state
            .chunks
            .front()
            .is_some_and(|chunk| chunk.end() <= ticket && chunk.end() <= state.read)
        {
            if let Some(mut chunk) = state.chunks.pop_front() {
                if state.spare.len() < SPARE_CHUNKS {
                    chunk.rows.clear();
                    state.spare.push(chunk.rows);
                }
            }
        }
        drop(state);
        self.progress
            .send_modify(|p| p.committed = p.committed.max(ticket));
    }

    fn delivered(&self, position: &[u8]) {
        if let Some(ticket) = self.ticket_of(position) {
            self.progress
                .send_modify(|p| p.delivered = p.delivered.max(ticket));
        }
    }

    fn ended(&self, end: Result<PartitionEnd, &RuntimeError>) {
        let reason = match end {
            Ok(PartitionEnd::Drained) => "the pipeline read all of its input".to_owned(),
            Ok(PartitionEnd::Stopped) => "the pipeline was stopped".to_owned(),
            Err(err) => format!("the pipeline failed: {err}"),
        };
        let mut state = self.lock();
        state.phase = Phase::Ended(reason.clone());
        // Nothing reads them any more; their receipts resolve as not committed.
        state.chunks.clear();
        state.unread_bytes = 0;
        drop(state);
        self.progress.send_modify(|p| p.ended = Some(reason));
        self.space.notify_waiters();
    }
}

pub(super) struct PushFactory {
    pub(super) shared: Arc<Shared>,
}

impl PushFactory {
    fn inbox(&self, partition: u32) -> Option<&Arc<Inbox>> {
        self.shared.inboxes.get()?.get(partition as usize)
    }
}

impl SourceFactory for PushFactory {
    fn stream_id(&self) -> &str {
        &self.shared.stream_id
    }

    fn schema(&self) -> Arc<StreamSchema> {
        Arc::clone(&self.shared.schema)
    }

    fn open_partition(
        &self,
        partition: u32,
        position: Option<&[u8]>,
    ) -> Result<Box<dyn Source>, SourceError> {
        let inbox = self.inbox(partition).ok_or_else(|| {
            SourceError::Plugin(format!("the push source has no partition {partition}").into())
        })?;
        let seq = match position {
            None => 0,
            Some(bytes) => super::super::position::decode_words::<1>(bytes).ok_or_else(|| {
                SourceError::BadPosition {
                    position: bytes.to_vec(),
                    what: "a push source position is one big-endian u64".to_owned(),
                }
            })?[0],
        };
        let mut state = inbox.lock();
        if let Phase::Ended(reason) = &state.phase {
            return Err(SourceError::Plugin(
                format!(
                    "this push source's run has ended ({reason}); a new run needs a new PushSource"
                )
                .into(),
            ));
        }
        match state.first_seq {
            None => {
                state.first_seq = Some(seq);
                inbox.progress.send_modify(|p| p.first_seq = seq);
            }
            Some(first_seq) => {
                // A reopen after a veto: read again from the committed position.
                let oldest = state.committed;
                let ticket = seq
                    .checked_sub(first_seq)
                    .filter(|t| (oldest..=state.read).contains(t))
                    .ok_or_else(|| SourceError::BadPosition {
                        position: seq.to_be_bytes().to_vec(),
                        what: format!(
                            "the push source holds seqs {}..{} of this run",
                            first_seq + oldest,
                            first_seq + state.read
                        ),
                    })?;
                state.read = ticket;
            }
        }
        drop(state);
        Ok(Box::new(PushReader {
            inbox: Arc::clone(inbox),
        }))
    }

    fn observer(&self, partition: u32) -> Option<Arc<dyn PartitionObserver>> {
        self.inbox(partition)
            .map(|inbox| Arc::clone(inbox) as Arc<dyn PartitionObserver>)
    }
}

/// The pipeline's reader of one partition's inbox.
struct PushReader {
    inbox: Arc<Inbox>,
}

#[async_trait]
impl Source for PushReader {
    async fn read(
        &mut self,
        out: &mut SourceOutput<'_>,
        limits: ReadLimits,
    ) -> Result<SourceRead, SourceError> {
        loop {
            let end = self.inbox.take(out.batch, limits.max_messages)?;
            let waited_enough = tokio::time::Instant::now() >= limits.deadline;
            if end.taken > 0 || end.exhausted || waited_enough {
                return Ok(SourceRead {
                    position: super::super::position::encode_words(&[end.position]),
                    exhausted: end.exhausted,
                    lag: None,
                });
            }
            let _ = tokio::time::timeout_at(limits.deadline, self.inbox.readable.notified()).await;
        }
    }
}
