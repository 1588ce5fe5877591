//! `PushSource`: a source an application feeds from its own code (an HTTP handler, a queue
//! consumer), through a cloneable [`PushHandle`].
//!
//! Each partition has an inbox: rows checked against the schema when sent, kept in a few
//! reused [`MessageBatch`] chunks. `send` waits while the rows sent but not yet read by the
//! pipeline hold more than [`PushOptions::max_buffered_bytes`] (per partition); a row read but
//! not yet committed stays in the inbox, unbounded by that limit but by the epoch's size, since
//! a veto makes the runtime read the epoch again. The source is not replayable: the outbox keeps
//! its batches' payloads. Message ids are `<partition>-<seq>`, the position is the next seq, and
//! a new run continues after the committed position, so ids stay unique across restarts.
//!
//! A [`Receipt`] learns what became of its message through the inbox's [`PartitionObserver`]
//! calls, published on one `watch` per partition that receipts compare their ticket against: no
//! lock or allocation per message to resolve them.

use std::collections::{BTreeMap, VecDeque};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};

use async_trait::async_trait;
use serde::Deserialize;
use serde_json::value::RawValue;
use thiserror::Error;
use tokio::sync::{watch, Notify};

use crate::error::{RuntimeError, SourceError, ValueError, Violation};
use crate::json_form::push_json;
use crate::message::{MessageBatch, MessageId, Row, RowWriter, Value};
use crate::plugin::{
    PartitionEnd, PartitionObserver, ReadLimits, Source, SourceFactory, SourceOutput, SourceRead,
};
use crate::registry::{parse_parameters, BuildResult, Registry, SourceBuildContext, SourceBuilder};
use crate::spec::is_valid_name;
use crate::types::{StreamSchema, StreamType};

/// Rows per inbox chunk: chunks are dropped (and reused) whole once committed.
const CHUNK_ROWS: usize = 1024;
/// Emptied chunks an inbox keeps for reuse.
const SPARE_CHUNKS: usize = 4;
/// What a message counts besides its values: its id.
const ID_BYTES: u64 = 16;
/// What each value counts besides its string or packed bytes (a batch cell).
const CELL_BYTES: u64 = 16;

/// How a [`PushSource`] buffers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PushOptions {
    /// Per partition: `send` waits while the rows not yet read by the pipeline hold more (a row
    /// counts 16 bytes for its id, 16 per value and the bytes of its strings and packed values).
    /// A row larger than the limit is accepted alone.
    pub max_buffered_bytes: u64,
}

impl Default for PushOptions {
    /// 16 MiB per partition.
    fn default() -> Self {
        PushOptions {
            max_buffered_bytes: 16 << 20,
        }
    }
}

/// Which partition a message goes to. Keys are hashed with xxh64 (seed 0) modulo the pipeline's
/// partition count: the same key always reaches the same partition, so its messages keep their
/// order.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Route<'a> {
    /// The hash of these bytes.
    Key(&'a [u8]),
    /// The hash of the number's 8 little-endian bytes.
    KeyU64(u64),
    /// This partition (below the partition count).
    Partition(u32),
}

/// Why a send was refused, or what a receipt resolved to instead of success.
#[derive(Error, Debug, Clone, PartialEq, Eq)]
pub enum PushError {
    /// The row lacks a value for `column` and those after it.
    #[error("the row has {got} values but the schema has {expected} columns: column `{column}` has no value")]
    MissingValue {
        /// The first column without a value.
        column: String,
        /// Values given.
        got: usize,
        /// Columns of the schema.
        expected: usize,
    },
    /// The row has more values than the schema has columns.
    #[error("the row has {got} values but the schema has only {expected} columns")]
    ExtraValues {
        /// Values given.
        got: usize,
        /// Columns of the schema.
        expected: usize,
    },
    /// A value does not fit its column: wrong type, out of range, null where not optional, bad
    /// JSON form.
    #[error("column `{column}` ({ty}): {what}")]
    Value {
        /// The column's name.
        column: String,
        /// The column's type.
        ty: StreamType,
        /// What is wrong with the value.
        what: String,
    },
    /// A JSON message has a key that is not a column.
    #[error("`{key}`: not a column of the declared schema")]
    UnknownColumn {
        /// The key.
        key: String,
    },
    /// A JSON message is not a JSON object.
    #[error("not a JSON object: {reason}")]
    NotJsonObject {
        /// The JSON parser's error.
        reason: String,
    },
    /// [`Route::Partition`] names a partition the pipeline does not have.
    #[error("partition {partition} does not exist: the pipeline has {partitions}")]
    NoSuchPartition {
        /// The partition asked for.
        partition: u32,
        /// The pipeline's partition count.
        partitions: u32,
    },
    /// [`PushHandle::finish`] was called: the source takes no more messages.
    #[error("the push source was finished: it takes no more messages")]
    Finished,
    /// The pipeline's partition stopped or failed: nothing was enqueued.
    #[error("partition {partition} of the pipeline has stopped ({reason}): nothing was enqueued")]
    Stopped {
        /// The message's partition.
        partition: u32,
        /// How the partition ended.
        reason: String,
    },
    /// The pipeline stopped or failed before the message was committed: it is lost unless the
    /// application sends it again.
    #[error(
        "partition {partition} stopped before the message was committed ({reason}): send it again"
    )]
    NotCommitted {
        /// The message's partition.
        partition: u32,
        /// How the partition ended.
        reason: String,
    },
    /// The message is committed, but the pipeline stopped before every sink held it: it stays
    /// in the outbox and the next run on the same state directory delivers it.
    #[error("message {id} is committed but was not delivered before the pipeline stopped ({reason}); the next run delivers it from the outbox")]
    NotDelivered {
        /// The message's id.
        id: MessageId,
        /// How the partition ended.
        reason: String,
    },
}

/// The source half of a push source: register it under a class name, then build the spec that
/// names that class (`source: {class: app_events}`; no `parameters`).
///
/// ```
/// use flow_core::sources::{PushOptions, PushSource, Route};
/// use flow_core::{Column, Registry, StreamSchema, StreamType, Value};
///
/// # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
/// let schema = StreamSchema::new(vec![
///     Column::new("id", StreamType::Uint64),
///     Column::new("name", StreamType::Utf8),
/// ])?;
/// let (source, handle) = PushSource::new("events", schema, PushOptions::default());
/// let mut registry = Registry::with_builtins();
/// source.register(&mut registry, "app_events");
/// // ... build the spec with `registry`, run the pipeline, then from any task:
/// let receipt = handle.send(Route::KeyU64(7), &[Value::Uint(7), Value::Bytes(b"ann")]).await?;
/// let id = receipt.committed().await?; // durable from here on
/// receipt.delivered().await?; // every sink holds it
/// # let _ = id;
/// # Ok(())
/// # }
/// ```
pub struct PushSource {
    shared: Arc<Shared>,
}

/// Sends messages into the pipeline of its [`PushSource`]; cheap to clone.
#[derive(Clone)]
pub struct PushHandle {
    shared: Arc<Shared>,
}

/// What became of one sent message; both outcomes can be awaited, each any number of times.
#[derive(Clone)]
pub struct Receipt {
    inbox: Arc<Inbox>,
    ticket: u64,
}

impl std::fmt::Debug for Receipt {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Receipt")
            .field("partition", &self.inbox.partition)
            .field("ticket", &self.ticket)
            .finish()
    }
}

impl std::fmt::Debug for PushHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PushHandle")
            .field("stream_id", &self.shared.stream_id)
            .field("partitions", &self.partitions())
            .finish()
    }
}

struct Shared {
    stream_id: String,
    schema: Arc<StreamSchema>,
    options: PushOptions,
    /// The inboxes, made when the spec is built (the partition count is known then).
    inboxes: OnceLock<Vec<Arc<Inbox>>>,
    bound: Notify,
    finished: AtomicBool,
}

impl PushSource {
    /// A push source emitting stream `stream_id` with `schema`, and the handle that feeds it.
    pub fn new(
        stream_id: &str,
        schema: Arc<StreamSchema>,
        options: PushOptions,
    ) -> (PushSource, PushHandle) {
        let shared = Arc::new(Shared {
            stream_id: stream_id.to_owned(),
            schema,
            options,
            inboxes: OnceLock::new(),
            bound: Notify::new(),
            finished: AtomicBool::new(false),
        });
        let handle = PushHandle {
            shared: Arc::clone(&shared),
        };
        (PushSource { shared }, handle)
    }

    /// Registers this source as class `class`.
    pub fn register(self, registry: &mut Registry, class: &str) {
        registry.register_source(class, self.builder());
    }

    /// The builder to register (what [`PushSource::register`] does). Building a spec binds the
    /// source to the spec's partition count; a later build (a reload's validation) must have the
    /// same count.
    pub fn builder(self) -> SourceBuilder {
        let shared = self.shared;
        Arc::new(
            move |ctx: &SourceBuildContext<'_>, parameters: &serde_yaml::Value| {
                parse_parameters::<PushParams>(parameters, "parameters")?;
                shared.bind(ctx.partitions)?;
                let factory: Arc<dyn SourceFactory> = Arc::new(PushFactory {
                    shared: Arc::clone(&shared),
                });
                Ok(factory)
            },
        )
    }
}

/// A push source takes no parameters: its stream and schema come from [`PushSource::new`].
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct PushParams {}

impl Shared {
    fn bind(&self, partitions: u32) -> BuildResult<()> {
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

impl PushHandle {
    /// Sends one row, values in schema order. Waits while the partition's inbox is full;
    /// refuses a row that does not match the schema (nothing is enqueued).
    pub async fn send(&self, route: Route<'_>, values: &[Value<'_>]) -> Result<Receipt, PushError> {
        let columns = self.shared.schema.columns();
        if values.len() > columns.len() {
            return Err(PushError::ExtraValues {
                got: values.len(),
                expected: columns.len(),
            });
        }
        if let Some(column) = columns.get(values.len()) {
            return Err(PushError::MissingValue {
                column: column.name.clone(),
                got: values.len(),
                expected: columns.len(),
            });
        }
        let inbox = self.inbox(route).await?;
        inbox
            .enqueue(|row| {
                for value in values {
                    row.push(*value)
                        .map_err(|err| value_error(err, &self.shared.schema))?;
                }
                Ok(())
            })
            .await
    }

    /// Sends one row given as a JSON object text, read as `jsonl_file` reads a line: each
    /// column's value in its JSON form, a missing key is null, an unknown key is refused.
    pub async fn send_json_text(&self, route: Route<'_>, json: &str) -> Result<Receipt, PushError> {
        let object: BTreeMap<String, &RawValue> =
            serde_json::from_str(json).map_err(|err| PushError::NotJsonObject {
                reason: err.to_string(),
            })?;
        let schema = &self.shared.schema;
        if let Some(key) = object.keys().find(|key| schema.index_of(key).is_none()) {
            return Err(PushError::UnknownColumn { key: key.clone() });
        }
        let raws: Vec<Option<&RawValue>> = schema
            .columns()
            .iter()
            .map(|column| object.get(&column.name).copied())
            .collect();
        let inbox = self.inbox(route).await?;
        inbox
            .enqueue(|row| {
                let mut scratch = Vec::new();
                for (column, raw) in schema.columns().iter().zip(&raws) {
                    push_json(row, &column.name, &column.ty, *raw, &mut scratch).map_err(
                        |what| {
                            let prefix = format!("column `{}` ({}): ", column.name, column.ty);
                            PushError::Value {
                                column: column.name.clone(),
                                ty: column.ty.clone(),
                                what: what.strip_prefix(&prefix).unwrap_or(&what).to_owned(),
                            }
                        },
                    )?;
                }
                Ok(())
            })
            .await
    }

    /// [`PushHandle::send_json_text`] for a parsed JSON value. Numbers that `serde_json::Value`
    /// holds as `f64` have lost digits already: send wide decimals and integers as text.
    pub async fn send_json(
        &self,
        route: Route<'_>,
        json: &serde_json::Value,
    ) -> Result<Receipt, PushError> {
        self.send_json_text(route, &json.to_string()).await
    }

    /// Ends the input: later sends fail with [`PushError::Finished`]; once the pipeline has read
    /// every message sent before, its partitions are exhausted, so the sinks deliver everything
    /// and `Pipeline::run` returns.
    pub fn finish(&self) {
        self.shared.finished.store(true, Ordering::SeqCst);
        if let Some(inboxes) = self.shared.inboxes.get() {
            for inbox in inboxes {
                inbox.finish();
            }
        }
    }

    /// The pipeline's partition count, once a spec naming the source was built.
    pub fn partitions(&self) -> Option<u32> {
        self.shared
            .inboxes
            .get()
            .map(|inboxes| inboxes.len() as u32)
    }

    /// The partition `route` leads to, once a spec naming the source was built.
    pub fn partition_of(&self, route: Route<'_>) -> Option<Result<u32, PushError>> {
        self.partitions().map(|n| partition_of(route, n))
    }

    /// The inbox of `route`, waiting until a spec naming the source is built.
    async fn inbox(&self, route: Route<'_>) -> Result<&Arc<Inbox>, PushError> {
        loop {
            if let Some(inboxes) = self.shared.inboxes.get() {
                let partition = partition_of(route, inboxes.len() as u32)?;
                return Ok(&inboxes[partition as usize]);
            }
            let bound = self.shared.bound.notified();
            tokio::pin!(bound);
            bound.as_mut().enable();
            if self.shared.inboxes.get().is_none() {
                bound.await;
            }
        }
    }
}

fn partition_of(route: Route<'_>, partitions: u32) -> Result<u32, PushError> {
    let hash = match route {
        Route::Key(bytes) => xxhash_rust::xxh64::xxh64(bytes, 0),
        Route::KeyU64(key) => xxhash_rust::xxh64::xxh64(&key.to_le_bytes(), 0),
        Route::Partition(partition) if partition < partitions => return Ok(partition),
        Route::Partition(partition) => {
            return Err(PushError::NoSuchPartition {
                partition,
                partitions,
            })
        }
    };
    Ok((hash % u64::from(partitions.max(1))) as u32)
}

fn value_error(err: ValueError, schema: &StreamSchema) -> PushError {
    match err {
        ValueError::Invalid { column, ty, what } => PushError::Value { column, ty, what },
        ValueError::MissingValues { expected, got } => PushError::MissingValue {
            column: schema
                .columns()
                .get(got)
                .map(|column| column.name.clone())
                .unwrap_or_default(),
            got,
            expected,
        },
        ValueError::TooManyValues { expected } => PushError::ExtraValues {
            got: expected + 1,
            expected,
        },
        // Not a row's error; pushing values never returns it.
        ValueError::BadMessageId { text } => PushError::NotJsonObject { reason: text },
    }
}

impl Receipt {
    /// The partition the message went to.
    pub fn partition(&self) -> u32 {
        self.inbox.partition
    }

    /// Resolves once the epoch holding the message is durable in the outbox (a crash after
    /// that loses nothing), with the message's id; [`PushError::NotCommitted`] if the pipeline
    /// stopped or failed before: the application must send it again.
    pub async fn committed(&self) -> Result<MessageId, PushError> {
        let ticket = self.ticket;
        let mut progress = self.inbox.progress.subscribe();
        let state = progress
            .wait_for(|p| p.committed > ticket || p.ended.is_some())
            .await;
        match state {
            Ok(p) if p.committed > ticket => Ok(p.id(self.inbox.partition, ticket)),
            Ok(p) => Err(self.not_committed(p.ended.clone())),
            Err(_) => Err(self.not_committed(None)),
        }
    }

    /// Resolves once every sink holds the message (for ClickHouse: the INSERT of its batch
    /// succeeded), with its id; [`PushError::NotDelivered`] if the pipeline stopped before
    /// (the next run delivers it), [`PushError::NotCommitted`] if it stopped before the commit.
    /// A sink without an outbox (the at-least-once and at-most-once ClickHouse classes, or any
    /// sink that seals no batch for the message's epoch) delivers within the epoch: for it the
    /// message counts as delivered once committed.
    pub async fn delivered(&self) -> Result<MessageId, PushError> {
        let ticket = self.ticket;
        let mut progress = self.inbox.progress.subscribe();
        let state = progress
            .wait_for(|p| p.delivered > ticket || p.ended.is_some())
            .await;
        match state {
            Ok(p) if p.delivered > ticket => Ok(p.id(self.inbox.partition, ticket)),
            Ok(p) if p.committed > ticket => Err(PushError::NotDelivered {
                id: p.id(self.inbox.partition, ticket),
                reason: p.ended.clone().unwrap_or_default(),
            }),
            Ok(p) => Err(self.not_committed(p.ended.clone())),
            Err(_) => Err(self.not_committed(None)),
        }
    }

    fn not_committed(&self, reason: Option<String>) -> PushError {
        PushError::NotCommitted {
            partition: self.inbox.partition,
            reason: reason.unwrap_or_else(|| "the push source is gone".to_owned()),
        }
    }
}

/// What receipts compare their ticket against. Tickets count the sends of a partition in this
/// process from 0; the message of ticket `t` has seq `first_seq + t`.
#[derive(Clone, Debug, Default)]
struct Progress {
    first_seq: u64,
    /// Tickets below are committed.
    committed: u64,
    /// Tickets below are held by every sink.
    delivered: u64,
    /// Why the partition ended, once it did.
    ended: Option<String>,
}

impl Progress {
    fn id(&self, partition: u32, ticket: u64) -> MessageId {
        MessageId::new(partition, self.first_seq + ticket)
    }
}

/// One partition's messages, from their send until their commit.
struct Inbox {
    partition: u32,
    schema: Arc<StreamSchema>,
    max_bytes: u64,
    state: Mutex<InboxState>,
    /// Wakes the reader when a row arrives or the input ends.
    readable: Notify,
    /// Wakes waiting senders when the reader took rows, or the partition ended.
    space: Notify,
    progress: watch::Sender<Progress>,
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
            max_bytes: shared.options.max_buffered_bytes.max(1),
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

    async fn enqueue(
        self: &Arc<Self>,
        mut write: impl FnMut(&mut RowWriter<'_>) -> Result<(), PushError>,
    ) -> Result<Receipt, PushError> {
        loop {
            // Registering for a wake-up takes the Notify's lock: only once the inbox is full.
            if let Some(ticket) = self.try_enqueue(&mut write)? {
                return Ok(self.receipt(ticket));
            }
            let space = self.space.notified();
            tokio::pin!(space);
            space.as_mut().enable();
            if let Some(ticket) = self.try_enqueue(&mut write)? {
                return Ok(self.receipt(ticket));
            }
            space.await;
        }
    }

    fn receipt(self: &Arc<Self>, ticket: u64) -> Receipt {
        Receipt {
            inbox: Arc::clone(self),
            ticket,
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

    fn finish(&self) {
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
        let seq = super::position::decode_words::<1>(position)?[0];
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

struct PushFactory {
    shared: Arc<Shared>,
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
            Some(bytes) => super::position::decode_words::<1>(bytes).ok_or_else(|| {
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
                    position: super::position::encode_words(&[end.position]),
                    exhausted: end.exhausted,
                    lag: None,
                });
            }
            let _ = tokio::time::timeout_at(limits.deadline, self.inbox.readable.notified()).await;
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use std::sync::atomic::AtomicUsize;
    use std::time::Duration;

    use super::*;
    use crate::types::Column;

    fn schema() -> Arc<StreamSchema> {
        StreamSchema::new(vec![
            Column::new("id", StreamType::Uint64),
            Column::new("small", StreamType::Uint8),
            Column::new("name", StreamType::Utf8),
        ])
        .unwrap()
    }

    /// A push source bound to `partitions`, its handle, and its factory.
    fn bound(partitions: u32, max_buffered_bytes: u64) -> (PushHandle, Arc<dyn SourceFactory>) {
        let (source, handle) =
            PushSource::new("events", schema(), PushOptions { max_buffered_bytes });
        let ctx = SourceBuildContext {
            pipeline: "p",
            partitions,
        };
        let factory =
            (source.builder())(&ctx, &serde_yaml::Value::Null).unwrap_or_else(|v| panic!("{v:?}"));
        (handle, factory)
    }

    /// Reads what one `read` returns within 10 ms: the ids read and the position.
    async fn read(source: &mut dyn Source, max_messages: usize) -> (Vec<String>, u64) {
        let mut batch = MessageBatch::new(schema());
        let mut dead = Vec::new();
        let mut out = SourceOutput {
            batch: &mut batch,
            dead_letters: &mut dead,
        };
        let limits = ReadLimits {
            max_messages,
            deadline: tokio::time::Instant::now() + Duration::from_millis(10),
        };
        let end = source.read(&mut out, limits).await.unwrap();
        let ids = batch.ids().iter().map(ToString::to_string).collect();
        let position = super::super::position::decode_words::<1>(&end.position).unwrap()[0];
        (ids, position)
    }

    fn row(id: u64) -> [Value<'static>; 3] {
        [Value::Uint(id), Value::Uint(1), Value::Bytes(b"abcd")]
    }

    /// 16 (id) + 3 x 16 (cells) + 4 (`abcd`).
    const ROW_BYTES: u64 = 68;

    #[tokio::test(start_paused = true)]
    async fn send_waits_once_the_unread_bytes_reach_the_bound_and_goes_on_as_the_pipeline_reads() {
        let (handle, factory) = bound(1, 2 * ROW_BYTES + 10);
        let mut source = factory.open_partition(0, None).unwrap();
        let sent = Arc::new(AtomicUsize::new(0));
        let sender = {
            let (handle, sent) = (handle.clone(), Arc::clone(&sent));
            tokio::spawn(async move {
                for id in 0..5 {
                    handle.send(Route::Partition(0), &row(id)).await.unwrap();
                    sent.fetch_add(1, Ordering::SeqCst);
                }
            })
        };
        tokio::time::sleep(Duration::from_secs(5)).await;
        assert_eq!(sent.load(Ordering::SeqCst), 2, "two rows fit the bound");

        assert_eq!(read(source.as_mut(), 1).await, (vec!["0-0".to_owned()], 1));
        tokio::time::sleep(Duration::from_secs(5)).await;
        assert_eq!(
            sent.load(Ordering::SeqCst),
            3,
            "one row read, one more sent"
        );

        let (ids, position) = read(source.as_mut(), 10).await;
        assert_eq!(
            (ids, position),
            (vec!["0-1".to_owned(), "0-2".to_owned()], 3)
        );
        tokio::time::sleep(Duration::from_secs(5)).await;
        assert_eq!(sent.load(Ordering::SeqCst), 5);
        sender.await.unwrap();
        let (ids, position) = read(source.as_mut(), 10).await;
        assert_eq!(
            (ids, position),
            (vec!["0-3".to_owned(), "0-4".to_owned()], 5)
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_row_larger_than_the_bound_is_accepted_alone() {
        let (handle, factory) = bound(1, 10);
        let mut source = factory.open_partition(0, None).unwrap();
        handle.send(Route::Partition(0), &row(0)).await.unwrap();
        let second = tokio::time::timeout(
            Duration::from_secs(1),
            handle.send(Route::Partition(0), &row(1)),
        )
        .await;
        assert!(
            second.is_err(),
            "the second row waits for the first to be read"
        );
        assert_eq!(read(source.as_mut(), 10).await.0, vec!["0-0".to_owned()]);
        handle.send(Route::Partition(0), &row(1)).await.unwrap();
    }

    #[tokio::test]
    async fn every_kind_of_bad_row_is_refused_naming_its_column_and_nothing_is_enqueued() {
        let (handle, factory) = bound(1, 1 << 20);
        let mut source = factory.open_partition(0, None).unwrap();
        let at = Route::Partition(0);
        let refused = |ty: StreamType, column: &str, what: &str| PushError::Value {
            column: column.to_owned(),
            ty,
            what: what.to_owned(),
        };
        let cases: Vec<(Result<Receipt, PushError>, PushError)> = vec![
            (
                handle.send(at, &[Value::Uint(1)]).await,
                PushError::MissingValue {
                    column: "small".to_owned(),
                    got: 1,
                    expected: 3,
                },
            ),
            (
                handle
                    .send(
                        at,
                        &[
                            Value::Uint(1),
                            Value::Uint(1),
                            Value::Bytes(b"a"),
                            Value::Null,
                        ],
                    )
                    .await,
                PushError::ExtraValues {
                    got: 4,
                    expected: 3,
                },
            ),
            (
                handle
                    .send(
                        at,
                        &[Value::Bytes(b"1"), Value::Uint(1), Value::Bytes(b"a")],
                    )
                    .await,
                refused(StreamType::Uint64, "id", "expected uint64, got a string"),
            ),
            (
                handle
                    .send(at, &[Value::Uint(1), Value::Uint(300), Value::Bytes(b"a")])
                    .await,
                refused(StreamType::Uint8, "small", "300 is out of range for uint8"),
            ),
            (
                handle
                    .send(at, &[Value::Uint(1), Value::Uint(1), Value::Null])
                    .await,
                refused(
                    StreamType::Utf8,
                    "name",
                    "null in a column that is not optional",
                ),
            ),
            (
                handle
                    .send(at, &[Value::Uint(1), Value::Uint(1), Value::Bytes(&[0xff])])
                    .await,
                refused(
                    StreamType::Utf8,
                    "name",
                    "not valid UTF-8 (invalid utf-8 sequence of 1 bytes from index 0)",
                ),
            ),
            (
                handle
                    .send_json_text(at, r#"{"id": 1, "small": 256, "name": "a"}"#)
                    .await,
                refused(StreamType::Uint8, "small", "256 is out of range for uint8"),
            ),
            (
                handle
                    .send_json_text(at, r#"{"id": "x", "small": 1, "name": "a"}"#)
                    .await,
                refused(StreamType::Uint64, "id", "expected uint64, got a string"),
            ),
            (
                handle.send_json_text(at, r#"{"id": 1, "small": 1}"#).await,
                refused(
                    StreamType::Utf8,
                    "name",
                    "null in a column that is not optional",
                ),
            ),
            (
                handle
                    .send_json_text(at, r#"{"id": 1, "small": 1, "name": "a", "extra": 2}"#)
                    .await,
                PushError::UnknownColumn {
                    key: "extra".to_owned(),
                },
            ),
            (
                handle.send(Route::Partition(1), &row(1)).await,
                PushError::NoSuchPartition {
                    partition: 1,
                    partitions: 1,
                },
            ),
        ];
        for (index, (got, expected)) in cases.into_iter().enumerate() {
            assert_eq!(got.err(), Some(expected), "case {index}");
        }
        let not_object = handle.send_json_text(at, "[1, 2]").await.err();
        assert!(
            matches!(&not_object, Some(PushError::NotJsonObject { reason }) if reason.starts_with("invalid type: sequence")),
            "{not_object:?}"
        );
        assert_eq!(read(source.as_mut(), 10).await, (Vec::new(), 0));

        let receipt = handle
            .send_json(at, &serde_json::json!({"id": 9, "small": 2, "name": "ok"}))
            .await
            .unwrap();
        assert_eq!(receipt.partition(), 0);
        assert_eq!(read(source.as_mut(), 10).await, (vec!["0-0".to_owned()], 1));
    }

    #[tokio::test(start_paused = true)]
    async fn a_send_before_the_spec_is_built_waits_for_the_partition_count() {
        let (source, handle) = PushSource::new("events", schema(), PushOptions::default());
        let early = tokio::spawn({
            let handle = handle.clone();
            async move {
                handle
                    .send(Route::KeyU64(3), &row(3))
                    .await
                    .map(|r| r.partition())
            }
        });
        tokio::time::sleep(Duration::from_secs(5)).await;
        assert!(!early.is_finished());
        assert_eq!(handle.partitions(), None);
        let ctx = SourceBuildContext {
            pipeline: "p",
            partitions: 4,
        };
        let builder = source.builder();
        assert!(builder(&ctx, &serde_yaml::Value::Null).is_ok());
        let expected = partition_of(Route::KeyU64(3), 4).unwrap();
        assert_eq!(early.await.unwrap(), Ok(expected));
        assert_eq!(handle.partitions(), Some(4));
        let again = SourceBuildContext {
            pipeline: "p",
            partitions: 2,
        };
        let violations = builder(&again, &serde_yaml::Value::Null).err().unwrap();
        assert_eq!(violations[0].path, "partitions");
        let parameters: serde_yaml::Value = serde_yaml::from_str("{count: 1}").unwrap();
        let violations = builder(&ctx, &parameters).err().unwrap();
        assert_eq!(violations[0].path, "parameters.count");
    }

    #[test]
    fn keys_route_to_the_same_partition_every_time() {
        let first = partition_of(Route::Key(b"user-1"), 8).unwrap();
        assert_eq!(partition_of(Route::Key(b"user-1"), 8).unwrap(), first);
        assert_eq!(
            partition_of(Route::Key(b"user-1"), 8).unwrap() as u64,
            xxhash_rust::xxh64::xxh64(b"user-1", 0) % 8
        );
        assert_eq!(
            partition_of(Route::KeyU64(42), 8).unwrap() as u64,
            xxhash_rust::xxh64::xxh64(&42u64.to_le_bytes(), 0) % 8
        );
        let spread: std::collections::BTreeSet<u32> = (0..64)
            .map(|k| partition_of(Route::KeyU64(k), 8).unwrap())
            .collect();
        assert_eq!(spread.len(), 8, "64 keys reach every one of 8 partitions");
    }

    #[tokio::test(start_paused = true)]
    async fn a_reopen_after_a_veto_reads_the_uncommitted_rows_again_and_commits_drop_them() {
        let (handle, factory) = bound(1, 1 << 20);
        let observer = factory.observer(0).unwrap();
        let mut source = factory
            .open_partition(0, Some(&7u64.to_be_bytes()))
            .unwrap();
        for id in 0..3 {
            handle.send(Route::Partition(0), &row(id)).await.unwrap();
        }
        assert_eq!(
            read(source.as_mut(), 2).await,
            (vec!["0-7".to_owned(), "0-8".to_owned()], 9)
        );
        observer.committed(&8u64.to_be_bytes());
        let mut source = factory
            .open_partition(0, Some(&8u64.to_be_bytes()))
            .unwrap();
        let (ids, position) = read(source.as_mut(), 10).await;
        assert_eq!(
            (ids, position),
            (vec!["0-8".to_owned(), "0-9".to_owned()], 10)
        );
        let early = factory.open_partition(0, Some(&7u64.to_be_bytes()));
        assert!(matches!(early, Err(SourceError::BadPosition { .. })));
    }

    #[tokio::test(start_paused = true)]
    async fn receipts_follow_the_observer_and_fail_when_the_partition_ends() {
        let (handle, factory) = bound(1, 1 << 20);
        let observer = factory.observer(0).unwrap();
        let mut source = factory.open_partition(0, None).unwrap();
        let receipts: Vec<Receipt> = futures_receipts(&handle, 3).await;
        read(source.as_mut(), 10).await;
        observer.committed(&2u64.to_be_bytes());
        observer.delivered(&1u64.to_be_bytes());
        assert_eq!(receipts[0].delivered().await, Ok(MessageId::new(0, 0)));
        assert_eq!(receipts[1].committed().await, Ok(MessageId::new(0, 1)));
        observer.ended(Ok(PartitionEnd::Stopped));
        let stopped = "the pipeline was stopped".to_owned();
        assert_eq!(
            receipts[1].delivered().await,
            Err(PushError::NotDelivered {
                id: MessageId::new(0, 1),
                reason: stopped.clone()
            })
        );
        assert_eq!(
            receipts[2].committed().await,
            Err(PushError::NotCommitted {
                partition: 0,
                reason: stopped.clone()
            })
        );
        assert_eq!(
            handle.send(Route::Partition(0), &row(3)).await.err(),
            Some(PushError::Stopped {
                partition: 0,
                reason: stopped
            })
        );
    }

    async fn futures_receipts(handle: &PushHandle, n: u64) -> Vec<Receipt> {
        let mut receipts = Vec::new();
        for id in 0..n {
            receipts.push(handle.send(Route::Partition(0), &row(id)).await.unwrap());
        }
        receipts
    }

    #[tokio::test(start_paused = true)]
    async fn finish_refuses_later_sends_and_exhausts_the_partition_once_read() {
        let (handle, factory) = bound(1, 1 << 20);
        let mut source = factory.open_partition(0, None).unwrap();
        handle.send(Route::Partition(0), &row(0)).await.unwrap();
        handle.finish();
        assert_eq!(
            handle.send(Route::Partition(0), &row(1)).await.err(),
            Some(PushError::Finished)
        );
        let mut batch = MessageBatch::new(schema());
        let mut dead = Vec::new();
        let mut out = SourceOutput {
            batch: &mut batch,
            dead_letters: &mut dead,
        };
        let limits = ReadLimits {
            max_messages: 10,
            deadline: tokio::time::Instant::now() + Duration::from_secs(1),
        };
        let end = source.read(&mut out, limits).await.unwrap();
        assert_eq!((batch.len(), end.exhausted), (1, true));
    }
}
