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

//!
//! Layout: this module holds the public push API; `inbox` the per-partition inboxes and the
//! source the pipeline reads from them; `error` what a send or a receipt can fail with.

mod error;
mod inbox;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};

use serde::Deserialize;
use tokio::sync::Notify;

use crate::json_form::{RecordDecoder, RecordError};
use crate::message::{MessageId, Value};
use crate::plugin::SourceFactory;
use crate::registry::{parse_parameters, Registry, SourceBuildContext, SourceBuilder};
use crate::types::StreamSchema;

pub use error::PushError;

use error::value_error;
use inbox::{Inbox, PushFactory, Shared};

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
            max_buffered_bytes: options.max_buffered_bytes,
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
        let ticket = inbox
            .enqueue(|row| {
                for value in values {
                    row.push(*value)
                        .map_err(|err| value_error(err, &self.shared.schema))?;
                }
                Ok(())
            })
            .await?;
        Ok(Receipt::new(inbox, ticket))
    }

    /// Sends one row given as a JSON object text, read as `jsonl_file` reads a line: each
    /// column's value in its JSON form, a missing key is null, an unknown or repeated key is
    /// refused.
    pub async fn send_json_text(&self, route: Route<'_>, json: &str) -> Result<Receipt, PushError> {
        let schema = &self.shared.schema;
        let mut decoder = RecordDecoder::default();
        let text = decoder
            .read(json.as_bytes(), schema)
            .map_err(|err| match err {
                RecordError::NotObject(reason) => PushError::NotJsonObject { reason },
                RecordError::UnknownKey(key) => PushError::UnknownColumn { key },
                RecordError::DuplicateKey(key) => PushError::DuplicateKey { key },
            })?;
        let inbox = self.inbox(route).await?;
        let ticket = inbox
            .enqueue(|row| {
                decoder.push_values(text, schema, row).map_err(|err| {
                    let column = &schema.columns()[err.column];
                    let prefix = format!("column `{}` ({}): ", column.name, column.ty);
                    PushError::Value {
                        column: column.name.clone(),
                        ty: column.ty.clone(),
                        what: err
                            .what
                            .strip_prefix(&prefix)
                            .unwrap_or(&err.what)
                            .to_owned(),
                    }
                })
            })
            .await?;
        Ok(Receipt::new(inbox, ticket))
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

impl Receipt {
    fn new(inbox: &Arc<Inbox>, ticket: u64) -> Receipt {
        Receipt {
            inbox: Arc::clone(inbox),
            ticket,
        }
    }

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

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use std::sync::atomic::AtomicUsize;
    use std::time::Duration;

    use super::*;
    use crate::error::SourceError;
    use crate::message::MessageBatch;
    use crate::plugin::{PartitionEnd, ReadLimits, Source, SourceOutput};
    use crate::types::{Column, StreamType};

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
            paths: crate::SpecPaths::working_directory(),
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
        let position = crate::sources::position::decode_words::<1>(&end.position).unwrap()[0];
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
                refused(
                    StreamType::Uint8,
                    "small",
                    "300 is out of range for uint8 (0 to 255)",
                ),
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
                refused(
                    StreamType::Uint8,
                    "small",
                    "256 is out of range for uint8 (0 to 255)",
                ),
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
                handle
                    .send_json_text(at, r#"{"id": 1, "small": 1, "name": "a", "id": 2}"#)
                    .await,
                PushError::DuplicateKey {
                    key: "id".to_owned(),
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
            paths: crate::SpecPaths::working_directory(),
        };
        let builder = source.builder();
        assert!(builder(&ctx, &serde_yaml::Value::Null).is_ok());
        let expected = partition_of(Route::KeyU64(3), 4).unwrap();
        assert_eq!(early.await.unwrap(), Ok(expected));
        assert_eq!(handle.partitions(), Some(4));
        let again = SourceBuildContext {
            pipeline: "p",
            partitions: 2,
            paths: crate::SpecPaths::working_directory(),
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
