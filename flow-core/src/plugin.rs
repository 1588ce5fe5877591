//! The plugin traits. Each plugin kind is built once per pipeline by a factory (from its spec
//! parameters, see [`crate::registry`]) and instantiated once per partition. Every trait has one
//! required method; lifecycle hooks have defaults.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use flow_state::{DeadLetter, SealedBatch, SinkPartition, StateStore};
use tokio::time::Instant;

use crate::error::{ProcessorError, ReplayError, RuntimeError, SinkError, SourceError};
use crate::message::MessageBatch;
use crate::types::StreamSchema;

/// Builds the per-partition readers of a source.
pub trait SourceFactory: Send + Sync {
    /// The id of the stream the source emits (`rows` for the generator).
    fn stream_id(&self) -> &str;
    /// The columns of the stream it emits.
    fn schema(&self) -> Arc<StreamSchema>;
    /// Opens `partition` at a committed `position` (`None`: from the beginning).
    fn open_partition(
        &self,
        partition: u32,
        position: Option<&[u8]>,
    ) -> Result<Box<dyn Source>, SourceError>;

    /// Whether reopening at a committed position reads the same messages again, with the same
    /// ids, in the same order. Sinks of a replayable source keep only the bounds of their
    /// batches in the outbox and rebuild them on replay ([`SinkContext::replay`]).
    fn replayable(&self) -> bool {
        false
    }

    /// What learns the fate of `partition`'s messages in this run: when an epoch is durable, when
    /// every sink holds it, when the partition ends. `None` (the default): nothing is tracked.
    /// Called once per run of the partition, before its sinks open.
    fn observer(&self, partition: u32) -> Option<Arc<dyn PartitionObserver>> {
        let _ = partition;
        None
    }

    /// The shortest `epoch.max_duration_ms` under which the source still reads, and why, as
    /// `(duration, reason)`: an epoch shorter than a source's least wait for messages would end
    /// every time before anything is read, so the pipeline refuses it at validation.
    /// `None` (the default): any duration.
    fn min_epoch_duration(&self) -> Option<(Duration, String)> {
        None
    }

    /// What keeps `partition` from reading right now while the source waits for it to pass (a
    /// broker stream that disappeared), for `status` and the metrics; `None` (the default) while
    /// nothing does. A failure waiting cannot cure stops the partition instead.
    fn unavailable(&self, partition: u32) -> Option<String> {
        let _ = partition;
        None
    }

    /// Whether positions `a` and `b` stand at the same place of the source, where a replay
    /// stops at the committed position. The default compares the bytes; a source whose
    /// positions also carry what it learned on the way (a broker stream's identity, which one
    /// reader adopts for a position an older version committed and another reader does not)
    /// compares only where they stand.
    fn same_position(&self, a: &[u8], b: &[u8]) -> bool {
        a == b
    }

    /// How many times `partition`'s reader found its broker subscription silent (no message, no
    /// heartbeat) and made it again since the process started, for the metrics; 0 (the default)
    /// for a source that has no such subscription.
    fn stalled_pulls(&self, partition: u32) -> u64 {
        let _ = partition;
        0
    }

    /// The broker subject `partition` reads (a JetStream subject, a Kafka topic), which a sink
    /// may name its tables after; `None` (the default) for a source without subjects. Known
    /// from the spec, so that the registry hands it to the sinks at validation
    /// ([`crate::registry::SourceSubjects`]).
    fn subject(&self, partition: u32) -> Option<String> {
        let _ = partition;
        None
    }
}

/// How a partition ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PartitionEnd {
    /// The source is exhausted and every sink delivered everything.
    Drained,
    /// A shutdown was requested; undelivered batches stay in the outbox.
    Stopped,
}

/// Told by the partition runner what became of the messages of one source partition, in order:
/// `committed` and `delivered` positions only move forward, and `delivered` never passes
/// `committed`. The calls come from runtime tasks: keep them short and never block.
pub trait PartitionObserver: Send + Sync {
    /// The epoch that ended at `position` is durable in the outbox (its batches and the position
    /// are committed): a crash after this loses none of its messages.
    fn committed(&self, position: &[u8]);

    /// Every message up to `position` is held by every sink: each sink acknowledged every batch
    /// committed up to that epoch (rows a sink set aside as dead letters included). An epoch
    /// for which a sink sealed nothing (a sink without an outbox delivers within its epoch)
    /// counts as delivered for that sink once committed.
    fn delivered(&self, position: &[u8]);

    /// The partition stopped for this run (`Drained`, `Stopped` or its failure); no further call
    /// follows. What was committed and not delivered stays in the outbox for the next run.
    fn ended(&self, end: Result<PartitionEnd, &RuntimeError>);
}

/// How much one `read` may return and until when it may wait for data.
#[derive(Clone, Copy, Debug)]
pub struct ReadLimits {
    /// The most messages to append.
    pub max_messages: usize,
    /// When to return, with whatever was read.
    pub deadline: Instant,
}

/// Where a read ended.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SourceRead {
    /// The position just after the last message appended (or skipped as a dead letter). Committed
    /// with the epoch; the partition restarts from it.
    pub position: Vec<u8>,
    /// The partition has no more messages and never will.
    pub exhausted: bool,
    /// How many messages the source's broker holds beyond `position` for this partition, when
    /// the source knows (broker sources); `None` otherwise. Shown by `status` as the lag.
    pub lag: Option<u64>,
}

/// Where a source appends what it read.
pub struct SourceOutput<'a> {
    /// The epoch's batch of the source's stream, to append messages to.
    pub batch: &'a mut MessageBatch,
    /// Records that could not be turned into messages, committed with the epoch.
    pub dead_letters: &'a mut Vec<DeadLetter>,
}

/// Reads one partition.
#[async_trait]
pub trait Source: Send {
    /// Appends up to `limits.max_messages` messages, returning no later than `limits.deadline`
    /// (fewer messages is fine). Must not lose or repeat messages between calls.
    async fn read(
        &mut self,
        out: &mut SourceOutput<'_>,
        limits: ReadLimits,
    ) -> Result<SourceRead, SourceError>;

    /// Called once when the partition stops reading.
    async fn close(&mut self) {}
}

/// Builds the per-partition instances of a processor.
pub trait ProcessorFactory: Send + Sync {
    /// The columns of the stream the processor emits.
    fn output_schema(&self) -> Arc<StreamSchema>;
    /// The processor of `partition`.
    fn create(&self, partition: u32) -> Box<dyn Processor>;
}

/// Turns an epoch's messages of one stream into messages of another stream.
#[async_trait]
pub trait Processor: Send {
    /// Appends the outputs for `input` to `output` (which is empty and has the output schema).
    async fn process(
        &mut self,
        input: &MessageBatch,
        output: &mut MessageBatch,
    ) -> Result<(), ProcessorError>;
}

/// What a sink instance knows about where it runs.
#[derive(Clone)]
pub struct SinkContext {
    /// The pipeline's name.
    pub pipeline: String,
    /// The sink's name in the spec.
    pub sink: String,
    /// The partition this instance writes.
    pub partition: u32,
    /// The pipeline's partition count.
    pub partitions: u32,
    /// The pipeline's state store: the sink's outbox queue, fingerprints and sink values.
    pub store: StateStore,
    /// The dynamic parameters in force when the instance is created.
    pub dynamic_parameters: serde_yaml::Value,
    /// Becomes `true` when the pipeline is asked to stop: a sink waiting inside `write_epoch`
    /// (retrying a target, say) should give up waiting and veto the epoch.
    pub shutdown: tokio::sync::watch::Receiver<bool>,
    /// Re-reads this sink's input streams from a committed source position: present when the
    /// source is replayable. A sink that can rebuild its batches from it marks its writes
    /// [`EpochWrite::rebuildable`]; the outbox then keeps only their bounds, unless the spec
    /// asks for payloads (`outbox.payloads: always`).
    pub replay: Option<Arc<dyn Replay>>,
    /// This sink partition's metrics: persisted counters ride in its acknowledgements.
    pub metrics: crate::SinkMetrics,
}

/// Opens readers of a sink's input streams at a committed source position.
#[async_trait]
pub trait Replay: Send + Sync {
    /// A reader from `from` (`None`: the start of the partition) up to the partition's
    /// committed position.
    async fn open(&self, from: Option<&[u8]>) -> Result<Box<dyn ReplayReader>, ReplayError>;
}

/// Reads a committed range again, slice by slice, through the pipeline's processors.
#[async_trait]
pub trait ReplayReader: Send {
    /// The sink's input batches (in `input_stream_ids` order) of the next slice; `None` once
    /// the committed position is reached or the source is exhausted.
    async fn next(&mut self) -> Result<Option<Vec<&MessageBatch>>, ReplayError>;
}

impl SinkContext {
    /// The key of this sink partition's outbox queue, fingerprints and dead letters.
    pub fn state_key(&self) -> SinkPartition {
        SinkPartition {
            pipeline: self.pipeline.clone(),
            sink: self.sink.clone(),
            partition: self.partition,
        }
    }
}

/// Builds the per-partition instances of a sink.
pub trait SinkFactory: Send + Sync {
    /// The sink of the partition in `ctx`; an error stops the partition before it reads.
    fn create(&self, ctx: SinkContext) -> Result<Box<dyn Sink>, SinkError>;

    /// New dynamic parameters (already validated by the sink's builder), applied on SIGHUP at
    /// once to what the factory shares with every partition's instance. The instances get them
    /// through [`Sink::reconfigure`] only at their next epoch, and a partition whose epoch waits
    /// on delivery (a target down, its delivery queue full) would see them only after the outage
    /// they were meant to shorten (`max_retry_backoff`).
    fn reconfigure(&self, dynamic: &serde_yaml::Value) -> Result<(), SinkError> {
        let _ = dynamic;
        Ok(())
    }
}

/// The input of one epoch for one sink: a batch per input stream, in `input_stream_ids` order.
/// For a sink that takes epochs in slices ([`Sink::takes_slices`]), the input of one slice.
pub struct Epoch<'a> {
    /// Counts epochs within this run of the partition, from 0; not persisted.
    pub number: u64,
    /// When the epoch began reading (ms since the Unix epoch): no message of it was read
    /// earlier.
    pub started_ms: u64,
    /// The most source messages an epoch holds (`epoch.max_messages`): what buffers sized for
    /// a whole epoch plan for, even when the batches hold only a slice of it.
    pub max_messages: usize,
    /// The epoch's messages (or the slice's), a batch per input stream.
    pub inputs: &'a [&'a MessageBatch],
}

/// What a sink wants committed with the epoch's source position.
#[derive(Debug, Default)]
pub struct EpochWrite {
    /// Sealed batches, appended to the sink partition's outbox in this order.
    pub batches: Vec<SealedBatch>,
    /// Rows set aside, committed as the sink's dead letters.
    pub dead_letters: Vec<DeadLetter>,
    /// The sink can rebuild these batches through [`SinkContext::replay`], so the outbox keeps
    /// only their bounds (when the context has a replay).
    pub rebuildable: bool,
    /// Additions to the sink's persisted counters, committed with the epoch (what the sink
    /// counted since its last epoch, e.g. an at-most-once sink's lost rows).
    pub counters: Vec<flow_state::CounterAdd>,
}

/// What a sink answers for an epoch ([`Sink::write_epoch`]).
#[derive(Debug)]
pub enum EpochOutcome {
    /// Commit the epoch with this write.
    Commit(EpochWrite),
    /// The sink is done with the epoch's messages but its write goes on: the runtime reads the
    /// next epoch meanwhile, and commits this one (or replays it) once the write resolves to
    /// [`EpochOutcome::Commit`] or [`EpochOutcome::Veto`].
    Pending(PendingWrite),
    /// The epoch must not be committed: the runtime rewinds the source to the last committed
    /// position and replays the epoch after `retry_after`.
    Veto {
        /// Why, for the log.
        reason: String,
        /// How long to wait before reading the epoch again.
        retry_after: Duration,
    },
}

/// A sink's write that outlives [`Sink::write_epoch`] ([`EpochOutcome::Pending`]): it owns what
/// it writes, so the epoch's batches can be refilled while it runs.
pub struct PendingWrite(Pin<Box<dyn Future<Output = Result<EpochOutcome, SinkError>> + Send>>);

impl PendingWrite {
    /// Wraps the write; it must resolve to a commit or a veto, not to another pending write.
    pub fn new(
        write: impl Future<Output = Result<EpochOutcome, SinkError>> + Send + 'static,
    ) -> PendingWrite {
        PendingWrite(Box::pin(write))
    }

    /// Runs the write to its outcome.
    pub async fn finish(self) -> Result<EpochOutcome, SinkError> {
        self.0.await
    }
}

impl std::fmt::Debug for PendingWrite {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("PendingWrite")
    }
}

/// One sink instance, owned by one partition.
#[async_trait]
pub trait Sink: Send {
    /// Prepares for the epoch's commit: seals what must be delivered, or vetoes the commit.
    /// A sink that takes slices gets here the epoch's last slice (possibly empty), after
    /// [`Sink::write_slice`] got the others.
    async fn write_epoch(&mut self, epoch: &Epoch<'_>) -> Result<EpochOutcome, SinkError>;

    /// Whether the sink takes an epoch in slices: [`Sink::write_slice`] for every slice but the
    /// last, then [`Sink::write_epoch`] for the last. The partition then holds a slice of
    /// messages at a time instead of a whole epoch, and the sink encodes each slice while it is
    /// still in the cache. The runtime slices an epoch only when every sink of the partition
    /// takes slices and reads one input stream; otherwise the sink gets whole epochs.
    fn takes_slices(&self) -> bool {
        false
    }

    /// Takes one slice of the epoch that a later [`Sink::write_epoch`] with the same
    /// [`Epoch::number`] ends; only called when [`Sink::takes_slices`]. The sink must not seal
    /// across that end, whatever it answers. A slice or epoch with another number means that
    /// the sink's earlier slices will never be ended (a sink asked before it vetoed the epoch,
    /// and the epoch is read again under a new number): the sink drops what they left.
    async fn write_slice(&mut self, slice: &Epoch<'_>) -> Result<(), SinkError> {
        let _ = slice;
        Err(slices_not_taken())
    }

    /// Called once before the first epoch: load persisted state, check guards, start delivery.
    async fn open(&mut self) -> Result<(), SinkError> {
        Ok(())
    }

    /// The epoch's commit is durable; `batches` are the batches the sink returned from
    /// `write_epoch`, with the outbox sequence numbers they were stored under.
    async fn committed(&mut self, batches: Vec<(u64, SealedBatch)>) -> Result<(), SinkError> {
        let _ = batches;
        Ok(())
    }

    /// The source is exhausted: deliver everything accepted, then return.
    async fn drain(&mut self) -> Result<(), SinkError> {
        Ok(())
    }

    /// The partition stops without draining; undelivered batches stay in the outbox.
    async fn close(&mut self) -> Result<(), SinkError> {
        Ok(())
    }

    /// New dynamic parameters (already validated by the sink's builder).
    fn reconfigure(&mut self, dynamic: &serde_yaml::Value) -> Result<(), SinkError> {
        let _ = dynamic;
        Ok(())
    }
}

/// What a sink that does not take slices answers a slice: the runtime handed it one against
/// [`Sink::takes_slices`].
pub(crate) fn slices_not_taken() -> SinkError {
    SinkError::Delivery {
        reason: "the sink was handed a slice of an epoch but does not take slices".to_owned(),
    }
}
