//! The streams of one partition: the source's batch, then one batch per processor output, and
//! the processor instances that fill them. Used by the partition runner for every epoch and by
//! the replay reader to rebuild pending batches from a committed position.

use flow_state::DeadLetter;
use tokio::sync::watch;
use tokio::time::Instant;

use crate::error::{ProcessorError, SourceError};
use crate::message::MessageBatch;
use crate::plugin::{Processor, ReadLimits, Source, SourceOutput, SourceRead};
use crate::spec::{EpochSettings, ValidatedPipeline};

/// The most messages one `Source::read` call is asked for; the slice goes on until the
/// epoch's limits.
pub(crate) const READ_CHUNK_MESSAGES: usize = 8192;

/// How much one slice may read: at most `max_messages`, until `deadline`.
#[derive(Clone, Copy, Debug)]
pub(crate) struct SliceLimits {
    pub max_messages: usize,
    pub deadline: Instant,
}

impl SliceLimits {
    /// A whole epoch, starting now.
    pub(crate) fn epoch(epoch: &EpochSettings) -> SliceLimits {
        SliceLimits {
            max_messages: epoch.max_messages,
            deadline: Instant::now() + epoch.max_duration,
        }
    }

    /// The same limits, reading at most `messages`.
    pub(crate) fn at_most(self, messages: usize) -> SliceLimits {
        SliceLimits {
            max_messages: self.max_messages.min(messages),
            ..self
        }
    }
}

/// The most messages of one slice of an epoch handed to sinks that take slices
/// ([`crate::Sink::takes_slices`]), and of one slice re-read to rebuild batches: what the
/// partition's batches then hold at a time, in place of a whole epoch (an epoch of 200k rows of
/// the benchmark's six columns held 40 MB).
const SLICE_MESSAGES: usize = 2 * READ_CHUNK_MESSAGES;

/// The messages of one slice of an epoch under `epoch` ([`SLICE_MESSAGES`], or a whole smaller
/// epoch).
pub(crate) fn slice_messages(epoch: &EpochSettings) -> usize {
    SLICE_MESSAGES.min(epoch.max_messages)
}

/// Where one slice of reading ended.
pub(crate) struct SliceEnd {
    /// The position after the last read (`None` if nothing was read: still where it started).
    pub position: Option<Vec<u8>>,
    pub exhausted: bool,
    /// The lag the last read that knew it reported.
    pub lag: Option<u64>,
}

struct ProcessorSlot {
    name: String,
    input: usize,
    output: usize,
    processor: Box<dyn Processor>,
}

/// Whether a position read is where [`StreamGraph::read_slice`] stops (a replay at the committed
/// position, as the source compares positions).
pub(crate) type StopAt<'a> = dyn Fn(&[u8]) -> bool + Sync + 'a;

pub(crate) struct StreamGraph {
    stream_ids: Vec<String>,
    batches: Vec<MessageBatch>,
    processors: Vec<ProcessorSlot>,
}

impl StreamGraph {
    /// Builds the batches and processor instances of `partition`; fails with the name of a
    /// processor that refers to an unknown stream.
    pub(crate) fn new(pipeline: &ValidatedPipeline, partition: u32) -> Result<StreamGraph, String> {
        let stream_ids: Vec<String> = std::iter::once(pipeline.source.stream_id().to_owned())
            .chain(
                pipeline
                    .processors
                    .iter()
                    .map(|p| p.output_stream_id.clone()),
            )
            .collect();
        let batches = stream_ids
            .iter()
            .map(|id| {
                MessageBatch::new(
                    pipeline
                        .streams
                        .get(id)
                        .cloned()
                        .unwrap_or_else(|| pipeline.source.schema()),
                )
                .bounded(pipeline.epoch.max_messages)
            })
            .collect();
        let mut graph = StreamGraph {
            stream_ids,
            batches,
            processors: Vec::new(),
        };
        for p in &pipeline.processors {
            let (Some(input), Some(output)) = (
                graph.index_of(&p.input_stream_id),
                graph.index_of(&p.output_stream_id),
            ) else {
                return Err(format!(
                    "processor `{}` refers to an unknown stream",
                    p.name
                ));
            };
            graph.processors.push(ProcessorSlot {
                name: p.name.clone(),
                input,
                output,
                processor: p.factory.create(partition),
            });
        }
        Ok(graph)
    }

    pub(crate) fn index_of(&self, id: &str) -> Option<usize> {
        self.stream_ids.iter().position(|s| s == id)
    }

    /// Bounds every batch to `messages` per use: a partition that reads its epochs in slices
    /// keeps room for a slice, not an epoch.
    pub(crate) fn bound_batches(&mut self, messages: usize) {
        for batch in &mut self.batches {
            batch.set_bound(messages);
        }
    }

    pub(crate) fn clear(&mut self) {
        for batch in &mut self.batches {
            batch.clear();
        }
    }

    pub(crate) fn source_len(&self) -> usize {
        self.batches.first().map_or(0, MessageBatch::len)
    }

    /// Reads one slice into the source batch, in reads of at most [`READ_CHUNK_MESSAGES`]: until
    /// the limits, the source's end, a stop request, or a position `until` says is where to stop.
    pub(crate) async fn read_slice(
        &mut self,
        source: &mut dyn Source,
        dead_letters: &mut Vec<DeadLetter>,
        limits: SliceLimits,
        stop: Option<&watch::Receiver<bool>>,
        until: Option<&StopAt<'_>>,
    ) -> Result<SliceEnd, SourceError> {
        let SliceLimits {
            max_messages,
            deadline,
        } = limits;
        let mut end = SliceEnd {
            position: None,
            exhausted: false,
            lag: None,
        };
        while let Some(batch) = self.batches.first_mut() {
            let remaining = max_messages.saturating_sub(batch.len());
            let stopping = stop.is_some_and(|s| *s.borrow());
            if remaining == 0 || Instant::now() >= deadline || stopping {
                break;
            }
            let limits = ReadLimits {
                max_messages: remaining.min(READ_CHUNK_MESSAGES),
                deadline,
            };
            let Some(read) = read_unless_stopped(source, batch, dead_letters, limits, stop).await
            else {
                break;
            };
            let read = read?;
            // A source that never waits (the generator, a file in the page cache) would hold
            // the thread for the whole epoch; between chunks the delivery lanes get their turn.
            tokio::task::yield_now().await;
            let reached = until.is_some_and(|reached| reached(read.position.as_slice()));
            end.position = Some(read.position);
            end.lag = read.lag.or(end.lag);
            if read.exhausted {
                end.exhausted = true;
                break;
            }
            if reached {
                break;
            }
        }
        Ok(end)
    }

    /// Runs every processor in order; on failure, the processor's name and error.
    pub(crate) async fn process(&mut self) -> Result<(), (String, ProcessorError)> {
        for slot in &mut self.processors {
            let (input, output) = pair_mut(&mut self.batches, slot.input, slot.output);
            output.clear();
            if let Err(err) = slot.processor.process(input, output).await {
                return Err((slot.name.clone(), err));
            }
        }
        Ok(())
    }

    /// The batches at `indices` (a sink's inputs).
    pub(crate) fn inputs(&self, indices: &[usize]) -> Vec<&MessageBatch> {
        inputs_of(&self.batches, indices)
    }

    /// Every stream's batch, in stream order (what [`inputs_of`] indexes).
    pub(crate) fn batches(&self) -> &[MessageBatch] {
        &self.batches
    }
}

/// One read of `source`, raced against a stop: a source waiting on its broker (a pull that runs
/// to the epoch's deadline) must not hold a stop up. A read cut off by the stop leaves nothing:
/// what it appended is dropped, so the batch ends at the position of the last whole read, which
/// is what the epoch commits; the source is not read again in this run. `None`: stopped.
async fn read_unless_stopped(
    source: &mut dyn Source,
    batch: &mut MessageBatch,
    dead_letters: &mut Vec<DeadLetter>,
    limits: ReadLimits,
    stop: Option<&watch::Receiver<bool>>,
) -> Option<Result<SourceRead, SourceError>> {
    let Some(stop) = stop else {
        let mut out = SourceOutput {
            batch,
            dead_letters,
        };
        return Some(source.read(&mut out, limits).await);
    };
    let (mark, letters) = (batch.mark(), dead_letters.len());
    let mut stop = stop.clone();
    // A stop sender that is gone never asks for a stop.
    let stopped = async move {
        if stop.wait_for(|stopping| *stopping).await.is_err() {
            std::future::pending::<()>().await;
        }
    };
    let read = {
        let mut out = SourceOutput {
            batch: &mut *batch,
            dead_letters: &mut *dead_letters,
        };
        tokio::select! {
            read = source.read(&mut out, limits) => Some(read),
            () = stopped => None,
        }
    };
    if read.is_none() {
        batch.truncate_to(mark);
        dead_letters.truncate(letters);
    }
    read
}

/// The batches at `indices` of `batches` (a sink's inputs). A free function so that a caller
/// holding the batches across an await needs no borrow of the (not `Sync`) processors.
pub(crate) fn inputs_of<'a>(
    batches: &'a [MessageBatch],
    indices: &[usize],
) -> Vec<&'a MessageBatch> {
    indices.iter().map(|&i| &batches[i]).collect()
}

/// Borrows batch `input` shared and batch `output` mutably; processors never read their output.
fn pair_mut(
    batches: &mut [MessageBatch],
    input: usize,
    output: usize,
) -> (&MessageBatch, &mut MessageBatch) {
    if input < output {
        let (left, right) = batches.split_at_mut(output);
        (&left[input], &mut right[0])
    } else {
        let (left, right) = batches.split_at_mut(input);
        (&right[0], &mut left[output])
    }
}
