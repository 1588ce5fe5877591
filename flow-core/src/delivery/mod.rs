//! Asynchronous delivery of a sink partition's sealed batches, in order per shard: the toolkit of
//! a sink with an outbox.
//!
//! An [`OutboxDelivery`] owns one delivery task per sink partition. Batches enter in outbox order (first the
//! undelivered ones found at open, then each newly committed epoch's) through a bounded channel;
//! the task keeps one lane per shard, each sending one batch at a time in that order, so the parts
//! of a logical batch go to their shards side by side.
//! Memory is bounded twice: the channel holds at most [`DELIVERY_QUEUE_CAPACITY`] batches, and
//! every batch holds a permit of its sink's [`ByteBudget`] from the moment it is queued until its
//! target holds it, so a sink's payloads in memory never exceed the budget whatever the run's
//! length. The [`BatchDeliverer`] sends one batch and acknowledges it in the outbox; the queue
//! never skips a batch: the first error stops the task and is reported by the next `push` or
//! `drain`. [`OutboxSink`] wraps a [`Sealer`] into a [`Sink`](crate::Sink) that owns this
//! lifecycle.
//!
//! Layout:
//! - `batch_deliverer`: [`BatchDeliverer`], what a sink supplies to send one batch;
//! - `budget`: [`ByteBudget`], the payload bytes a sink may hold for delivery;
//! - `latency`: [`DeliveryLatency`], epoch-to-acknowledgement latency logged per sink;
//! - `lanes`: `DeliveryQueue`, the delivery task of a sink partition and its lanes per shard;
//! - `outbox_sink`: [`Sealer`] + [`OutboxSink`] + [`OutboxDelivery`], the two-phase sink, and
//!   [`blocking`] for state-store calls.

mod batch_deliverer;
mod budget;
mod lanes;
mod latency;
mod outbox_sink;

/// The clock of `SealedBatch::sealed_at_ms` and of delivery latency.
#[doc(no_inline)]
pub use crate::clock::now_ms;
pub use batch_deliverer::BatchDeliverer;
pub use budget::{BudgetPermit, ByteBudget, MAX_BYTE_BUDGET};
pub use lanes::{SinkDelivery, DELIVERY_QUEUE_CAPACITY, LANE_STALL};
pub use latency::{DeliveryLatency, LATENCY_REPORT_INTERVAL};
pub use outbox_sink::{blocking, load_backlog, OutboxDelivery, OutboxSink, Sealer};
