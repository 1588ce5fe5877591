//! Re-reading a committed range of a replayable source, for sinks that keep only the bounds of
//! their pending batches: the reader opens a fresh source reader at the position an epoch started
//! from, runs the pipeline's processors (fresh instances) and hands the sink its input streams
//! slice by slice, until the partition's committed position.

use std::sync::Arc;

use async_trait::async_trait;
use flow_state::{DeadLetter, StateStore};

use super::graph::{slice_messages, SliceLimits, StreamGraph};
use crate::error::{ReplayError, SourceError};
use crate::message::MessageBatch;
use crate::plugin::{Replay, ReplayReader, Source};
use crate::spec::ValidatedPipeline;

/// [`Replay`] of one sink partition of a validated pipeline.
pub(crate) struct PipelineReplay {
    pub pipeline: Arc<ValidatedPipeline>,
    pub store: StateStore,
    pub partition: u32,
    /// The sink's input streams, by id.
    pub inputs: Vec<String>,
}

struct PipelineReplayReader {
    pipeline: Arc<ValidatedPipeline>,
    graph: StreamGraph,
    inputs: Vec<usize>,
    source: Box<dyn Source>,
    committed: Option<Vec<u8>>,
    /// Records the source turns into dead letters again: already committed the first time.
    dead_letters: Vec<DeadLetter>,
    done: bool,
}

#[async_trait]
impl Replay for PipelineReplay {
    async fn open(&self, from: Option<&[u8]>) -> Result<Box<dyn ReplayReader>, ReplayError> {
        let store = self.store.clone();
        let name = self.pipeline.name.clone();
        let partition = self.partition;
        let committed = tokio::task::spawn_blocking(move || store.position(&name, partition))
            .await
            .map_err(|err| {
                ReplayError::Source(SourceError::Plugin(
                    format!("reading the committed position: {err}").into(),
                ))
            })?
            .map_err(|err| ReplayError::Source(SourceError::Plugin(Box::new(err))))?;
        let mut graph = StreamGraph::new(&self.pipeline, partition)
            .map_err(|reason| ReplayError::Source(SourceError::Plugin(reason.into())))?;
        graph.bound_batches(slice_messages(&self.pipeline.epoch));
        let inputs = self
            .inputs
            .iter()
            .filter_map(|id| graph.index_of(id))
            .collect();
        let source = self
            .pipeline
            .source
            .open_partition(partition, from)
            .map_err(ReplayError::Source)?;
        // Nothing was ever committed past `from`: there is nothing to re-read.
        let done = match (committed.as_deref(), from) {
            (Some(committed), Some(from)) => self.pipeline.source.same_position(committed, from),
            (committed, from) => committed == from,
        };
        Ok(Box::new(PipelineReplayReader {
            pipeline: Arc::clone(&self.pipeline),
            graph,
            inputs,
            source,
            committed,
            dead_letters: Vec::new(),
            done,
        }))
    }
}

#[async_trait]
impl ReplayReader for PipelineReplayReader {
    async fn next(&mut self) -> Result<Option<Vec<&MessageBatch>>, ReplayError> {
        if self.done {
            self.source.close().await;
            return Ok(None);
        }
        self.graph.clear();
        self.dead_letters.clear();
        let (source, committed) = (&self.pipeline.source, self.committed.as_deref());
        let at_committed =
            |position: &[u8]| committed.is_some_and(|c| source.same_position(position, c));
        let end = self
            .graph
            .read_slice(
                self.source.as_mut(),
                &mut self.dead_letters,
                SliceLimits::epoch(&self.pipeline.epoch)
                    .at_most(slice_messages(&self.pipeline.epoch)),
                None,
                Some(&at_committed),
            )
            .await
            .map_err(ReplayError::Source)?;
        let reached = end.position.as_deref().is_some_and(at_committed);
        self.done = end.exhausted || reached;
        if self.graph.source_len() == 0 && self.done {
            self.source.close().await;
            return Ok(None);
        }
        self.graph
            .process()
            .await
            .map_err(|(processor, source)| ReplayError::Processor { processor, source })?;
        Ok(Some(self.graph.inputs(&self.inputs)))
    }
}
