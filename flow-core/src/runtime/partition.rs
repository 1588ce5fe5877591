//! The epoch loop of one partition ([`PartitionRunner`]): read an epoch, process it, hand it to
//! the sinks, commit it with their batches in one state transaction, and at the end drain or
//! close the sinks.

use std::sync::Arc;
use std::time::Duration;

use flow_state::{DeadLetter, EpochCommit, StateStore};
use tokio::sync::watch;
use tracing::{error, info, warn};

use super::answers::{EpochAnswers, EpochCommits, Vetoed};
use super::delivery_tracker::DeliveryTracker;
use super::graph::{inputs_of, slice_messages, SliceLimits, StreamGraph};
use super::lag::SourceLags;
use super::progress::ProgressCounters;
use super::replay::PipelineReplay;
use crate::error::{RuntimeError, SinkError};
use crate::message::MessageBatch;
use crate::metrics::{Metrics, SinkMetrics};
use crate::plugin::{Epoch, PartitionEnd, PartitionObserver, Replay, Sink, SinkContext, Source};
use crate::spec::ValidatedPipeline;

/// What one partition did in a run.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PartitionReport {
    /// The partition.
    pub partition: u32,
    /// How it ended.
    pub end: PartitionEnd,
    /// Epochs committed.
    pub epochs_committed: u64,
    /// Source messages in the committed epochs.
    pub messages: u64,
    /// Dead letters committed with those epochs.
    pub dead_letters: u64,
    /// Epochs a sink vetoed (each read again).
    pub vetoes: u64,
}

pub(super) struct PartitionRunner {
    pub(super) pipeline: Arc<ValidatedPipeline>,
    pub(super) store: StateStore,
    pub(super) partition: u32,
    pub(super) shutdown: watch::Receiver<bool>,
    pub(super) dynamic: Vec<watch::Receiver<serde_yaml::Value>>,
    pub(super) lags: SourceLags,
    pub(super) progress: ProgressCounters,
    pub(super) metrics: Arc<Metrics>,
    /// The source's observer of this partition and the task telling it what was delivered.
    pub(super) observed: Option<(Arc<dyn PartitionObserver>, DeliveryTracker)>,
}

impl Drop for PartitionRunner {
    /// A partition task that panicked or was cancelled still ends its observer's run, so that
    /// nothing waits on it for ever.
    fn drop(&mut self) {
        if let Some((observer, tracker)) = self.observed.take() {
            tracker.abort();
            observer.ended(Err(&RuntimeError::Task {
                partition: self.partition,
                reason: "the partition task ended without a report (it panicked or was cancelled)"
                    .to_owned(),
            }));
        }
    }
}

/// One epoch as read (and processed) into the partition's batches.
struct ReadEpoch {
    /// The source's position after it; the committed one when nothing was read.
    position: Option<Vec<u8>>,
    exhausted: bool,
    messages: usize,
    /// What the source set aside while reading it.
    source_dead: Vec<DeadLetter>,
    /// When its reading began (ms since the Unix epoch).
    started_ms: u64,
}

/// How an epoch's writes ended.
enum Settled {
    /// Committed, with this many dead letters.
    Committed { dead_letters: usize },
    /// A sink refused the commit; the epoch is replayed.
    Vetoed(Vetoed),
}

struct SinkSlot {
    name: String,
    sink: Box<dyn Sink>,
    /// Indexes into the partition's stream batches, in `input_stream_ids` order.
    inputs: Vec<usize>,
}

impl PartitionRunner {
    async fn committed_position(&self) -> Result<Option<Vec<u8>>, RuntimeError> {
        let store = self.store.clone();
        let pipeline = self.pipeline.name.clone();
        let partition = self.partition;
        tokio::task::spawn_blocking(move || store.position(&pipeline, partition))
            .await
            .map_err(|source| RuntimeError::Join { partition, source })?
            .map_err(|source| RuntimeError::State { partition, source })
    }

    fn open_source(&self, position: Option<&[u8]>) -> Result<Box<dyn Source>, RuntimeError> {
        self.pipeline
            .source
            .open_partition(self.partition, position)
            .map_err(|source| RuntimeError::Source {
                partition: self.partition,
                source,
            })
    }

    fn sink_error(&self, sink: &str, source: SinkError) -> RuntimeError {
        RuntimeError::Sink {
            partition: self.partition,
            sink: sink.to_owned(),
            source,
        }
    }

    /// Creates and opens every sink of the partition (each loads its outbox, checks its guards
    /// and starts delivering what it found pending).
    async fn open_sinks(
        &mut self,
        // `&mut`: a shared reference is not `Send` (processors are not `Sync`).
        graph: &mut StreamGraph,
        // `None`: every sink of the pipeline.
        only: Option<&[String]>,
    ) -> Result<Vec<SinkSlot>, RuntimeError> {
        let partition = self.partition;
        let pipeline = Arc::clone(&self.pipeline);
        // A replayable source lets sinks rebuild what they stored as bounds, even when this
        // run stores payloads (`outbox.payloads: always` set on a state directory with bounds).
        let source_replayable = pipeline.source.replayable();
        let mut sinks: Vec<SinkSlot> = Vec::new();
        for (s, dynamic) in pipeline.sinks.iter().zip(&self.dynamic) {
            if only.is_some_and(|names| !names.contains(&s.name)) {
                continue;
            }
            let ctx = SinkContext {
                pipeline: pipeline.name.clone(),
                sink: s.name.clone(),
                partition,
                partitions: pipeline.partitions,
                store: self.store.clone(),
                dynamic_parameters: dynamic.borrow().clone(),
                shutdown: self.shutdown.clone(),
                replay: source_replayable.then(|| {
                    Arc::new(PipelineReplay {
                        pipeline: Arc::clone(&pipeline),
                        store: self.store.clone(),
                        partition,
                        inputs: s.input_stream_ids.clone(),
                    }) as Arc<dyn Replay>
                }),
                metrics: SinkMetrics::new(
                    Arc::clone(&self.metrics),
                    self.store.clone(),
                    &pipeline.name,
                    &s.name,
                    partition,
                ),
            };
            let sink = s
                .factory
                .create(ctx)
                .map_err(|err| self.sink_error(&s.name, err))?;
            let inputs = s
                .input_stream_ids
                .iter()
                .filter_map(|id| graph.index_of(id))
                .collect();
            sinks.push(SinkSlot {
                name: s.name.clone(),
                sink,
                inputs,
            });
        }
        for slot in &mut sinks {
            if let Err(err) = slot.sink.open().await {
                let name = slot.name.clone();
                close_all(&mut sinks).await;
                return Err(self.sink_error(&name, err));
            }
        }
        for receiver in &mut self.dynamic {
            receiver.mark_unchanged();
        }
        Ok(sinks)
    }

    /// `flow-worker drain`: opens the sinks named in `pending`, which start delivering their
    /// outbox, and waits until each has delivered everything; no source is opened, so nothing
    /// new is read, and a sink with nothing pending is not even connected.
    pub(super) async fn drain_outbox(mut self, pending: Vec<String>) -> Result<(), RuntimeError> {
        let partition = self.partition;
        let mut graph = StreamGraph::new(&self.pipeline, partition)
            .map_err(|reason| RuntimeError::Task { partition, reason })?;
        let mut sinks = self.open_sinks(&mut graph, Some(&pending)).await?;
        for index in 0..sinks.len() {
            if let Err(err) = sinks[index].sink.drain().await {
                close_all(&mut sinks[index + 1..]).await;
                return Err(self.sink_error(&sinks[index].name, err));
            }
        }
        Ok(())
    }

    /// Runs the partition, keeping the source's observer (if any) informed until it ended.
    pub(super) async fn run(mut self) -> Result<PartitionReport, RuntimeError> {
        let observer = self.pipeline.source.observer(self.partition);
        if let Some(observer) = &observer {
            let sinks = self.pipeline.sinks.iter().map(|s| s.name.clone()).collect();
            let tracker = DeliveryTracker::start(
                self.store.clone(),
                &self.pipeline.name,
                self.partition,
                sinks,
                Arc::clone(observer),
            );
            self.observed = Some((Arc::clone(observer), tracker));
        }
        let result = self.run_observed().await;
        if let Some((observer, tracker)) = self.observed.take() {
            tracker.finish().await;
            observer.ended(result.as_ref().map(|report| report.end));
        }
        result
    }

    async fn run_observed(&mut self) -> Result<PartitionReport, RuntimeError> {
        let partition = self.partition;
        let pipeline = Arc::clone(&self.pipeline);
        let mut graph = StreamGraph::new(&pipeline, partition)
            .map_err(|reason| RuntimeError::Task { partition, reason })?;
        let mut sinks = self.open_sinks(&mut graph, None).await?;

        let mut result = self.epochs(&mut graph, &mut sinks).await;
        if let Ok(report) = &mut result {
            if report.end == PartitionEnd::Drained && !self.deliver_all(&mut sinks).await? {
                // A stop came while the sinks delivered the last epochs: it ends as any stop.
                report.end = PartitionEnd::Stopped;
            }
        }
        match &result {
            Ok(report) if report.end == PartitionEnd::Drained => {}
            Ok(report) if report.end == PartitionEnd::Stopped => {
                drain_for(&mut sinks, pipeline.drain_timeout, partition).await;
                close_all(&mut sinks).await;
                let names: Vec<String> = sinks.iter().map(|slot| slot.name.clone()).collect();
                log_outbox(&self.store, &pipeline.name, &names, partition).await;
            }
            _ => close_all(&mut sinks).await,
        }
        if let Ok(report) = &result {
            info!(
                pipeline = %pipeline.name,
                partition,
                end = ?report.end,
                epochs = report.epochs_committed,
                messages = report.messages,
                "partition finished"
            );
        }
        result
    }

    /// After the source is used up: lets every sink deliver everything, for as long as that
    /// takes, unless a stop comes first; then `false`, and the stop's drain bound applies to
    /// what is left (a target refusing for good would otherwise hold the stop for ever). A sink
    /// that ends with an error (one stopped on its table's columns) does not keep the sinks
    /// after it from delivering: each is drained, and the first error is the partition's.
    async fn deliver_all(&self, sinks: &mut [SinkSlot]) -> Result<bool, RuntimeError> {
        let mut shutdown = self.shutdown.clone();
        let mut failed: Option<RuntimeError> = None;
        for index in 0..sinks.len() {
            let drained = tokio::select! {
                drained = sinks[index].sink.drain() => Some(drained),
                _ = shutdown.wait_for(|stop| *stop) => None,
            };
            let Some(drained) = drained else {
                info!(
                    pipeline = %self.pipeline.name,
                    partition = self.partition,
                    sink = %sinks[index].name,
                    "stop signal while the sinks deliver the last epochs: stopping within shutdown.drain_timeout_ms; what is not delivered by then stays in the outbox for the next run"
                );
                if let Some(err) = failed {
                    // The partition fails as a sink before failed; the rest stop cleanly,
                    // their undelivered batches staying in the outbox.
                    close_all(&mut sinks[index..]).await;
                    return Err(err);
                }
                return Ok(false);
            };
            if let Err(err) = drained {
                let err = RuntimeError::Sink {
                    partition: self.partition,
                    sink: sinks[index].name.clone(),
                    source: err,
                };
                match &failed {
                    None => failed = Some(err),
                    Some(_) => error!(error = %err, "another sink of the partition failed too"),
                }
            }
        }
        match failed {
            None => Ok(true),
            Some(err) => Err(err),
        }
    }

    async fn epochs(
        &mut self,
        graph: &mut StreamGraph,
        sinks: &mut [SinkSlot],
    ) -> Result<PartitionReport, RuntimeError> {
        let partition = self.partition;
        let mut report = PartitionReport {
            partition,
            end: PartitionEnd::Stopped,
            epochs_committed: 0,
            messages: 0,
            dead_letters: 0,
            vetoes: 0,
        };
        let sliced = takes_slices(sinks);
        if sliced {
            graph.bound_batches(slice_messages(&self.pipeline.epoch));
        }
        let mut committed = self.committed_position().await?;
        let mut source = self.open_source(committed.as_deref())?;
        // The next epoch, read while a sink's write of this one was still going on.
        let mut ahead: Option<Result<ReadEpoch, RuntimeError>> = None;
        let mut epoch_number = 0u64;

        loop {
            if *self.shutdown.borrow() {
                source.close().await;
                return Ok(report);
            }
            self.apply_dynamic(sinks)?;

            let mut read = match ahead.take() {
                Some(read) => read?,
                None => {
                    let slices = sliced.then_some((&mut *sinks, epoch_number));
                    self.read_epoch(graph, source.as_mut(), &committed, slices)
                        .await?
                }
            };
            if read.messages == 0 && read.source_dead.is_empty() && read.position == committed {
                if read.exhausted {
                    source.close().await;
                    report.end = PartitionEnd::Drained;
                    return Ok(report);
                }
                continue;
            }

            let asked = self
                .ask_sinks(sinks, graph.batches(), &read, epoch_number, &committed)
                .await?;
            epoch_number += 1;
            let source_dead = std::mem::take(&mut read.source_dead);
            let settled = match asked {
                Err(vetoed) => Settled::Vetoed(vetoed),
                // Every sink is done with the epoch's messages: the next epoch is read into the
                // same batches (and handed to the sinks slice by slice) while the pending writes
                // go on, and this one commits as soon as they end.
                Ok(answers) if answers.has_pending() && !read.exhausted => {
                    let slices = sliced.then_some((&mut *sinks, epoch_number));
                    let (written, next) = tokio::join!(
                        answers.finish(),
                        self.read_epoch(graph, source.as_mut(), &read.position, slices)
                    );
                    ahead = Some(next);
                    self.settle_written(sinks, written, &read, source_dead)
                        .await?
                }
                Ok(answers) => {
                    self.settle_epoch(sinks, answers, &read, source_dead)
                        .await?
                }
            };
            match settled {
                Settled::Committed { dead_letters } => {
                    committed = read.position.clone();
                    report.epochs_committed += 1;
                    report.messages += read.messages as u64;
                    report.dead_letters += dead_letters as u64;
                }
                Settled::Vetoed(vetoed) => {
                    // The epoch read ahead is dropped; the slices it handed the sinks carry
                    // its number, which the replay must not reuse (the sinks drop them on
                    // seeing another number).
                    if ahead.take().is_some() {
                        epoch_number += 1;
                    }
                    report.vetoes += 1;
                    self.log_veto(&vetoed);
                    source = self.replay_after(source, &vetoed, &committed).await?;
                    continue;
                }
            }

            if read.exhausted {
                source.close().await;
                report.end = PartitionEnd::Drained;
                return Ok(report);
            }
        }
    }

    /// Reads one epoch into `graph` from where `from` left the source and runs the processors
    /// over it. With `slices` (the sinks and the epoch's number) it reads [`slice_messages`] at a
    /// time and hands every slice but the last to the sinks ([`Sink::write_slice`]) as soon as it
    /// is processed; the last (or, without `slices`, the whole epoch) stays in `graph` for
    /// [`PartitionRunner::ask_sinks`].
    async fn read_epoch(
        &self,
        graph: &mut StreamGraph,
        source: &mut dyn Source,
        from: &Option<Vec<u8>>,
        mut slices: Option<(&mut [SinkSlot], u64)>,
    ) -> Result<ReadEpoch, RuntimeError> {
        let partition = self.partition;
        let epoch = &self.pipeline.epoch;
        let slice = match slices {
            Some(_) => slice_messages(epoch),
            None => epoch.max_messages,
        };
        let mut read = ReadEpoch {
            position: from.clone(),
            exhausted: false,
            messages: 0,
            source_dead: Vec::new(),
            started_ms: crate::clock::now_ms(),
        };
        let whole = SliceLimits::epoch(epoch);
        loop {
            graph.clear();
            let limits = whole.at_most((epoch.max_messages - read.messages).min(slice));
            let stop = Some(&self.shutdown);
            let end = graph
                .read_slice(source, &mut read.source_dead, limits, stop, None)
                .await
                .map_err(|source| RuntimeError::Source { partition, source })?;
            self.lags.report(partition, end.lag);
            read.position = end.position.or(read.position);
            read.exhausted = end.exhausted;
            let messages = graph.source_len();
            read.messages += messages;
            if messages > 0 || !read.source_dead.is_empty() {
                self.process(graph).await?;
            }
            // Without slices, one read goes to the epoch's end (its count, time, the source's
            // end or a stop): what it read must stay in `graph`.
            let last = slices.is_none()
                || read.exhausted
                || read.messages >= epoch.max_messages
                || tokio::time::Instant::now() >= whole.deadline
                || *self.shutdown.borrow();
            if last {
                return Ok(read);
            }
            if let Some((sinks, number)) = slices.as_mut().filter(|_| messages > 0) {
                self.hand_slice(sinks, graph.batches(), &read, *number)
                    .await?;
            }
        }
    }

    /// Hands one slice of epoch `number` to every sink ([`Sink::write_slice`]).
    async fn hand_slice(
        &self,
        sinks: &mut [SinkSlot],
        batches: &[MessageBatch],
        read: &ReadEpoch,
        number: u64,
    ) -> Result<(), RuntimeError> {
        for slot in sinks.iter_mut() {
            let inputs = inputs_of(batches, &slot.inputs);
            slot.sink
                .write_slice(&self.epoch(&inputs, read, number))
                .await
                .map_err(|err| self.sink_error(&slot.name, err))?;
        }
        Ok(())
    }

    /// What a sink is handed of epoch `number` (or of one of its slices).
    fn epoch<'a>(
        &self,
        inputs: &'a [&'a MessageBatch],
        read: &ReadEpoch,
        number: u64,
    ) -> Epoch<'a> {
        Epoch {
            number,
            started_ms: read.started_ms,
            max_messages: self.pipeline.epoch.max_messages,
            inputs,
        }
    }

    /// Runs the processors over what `graph` holds.
    async fn process(&self, graph: &mut StreamGraph) -> Result<(), RuntimeError> {
        graph
            .process()
            .await
            .map_err(|(processor, source)| RuntimeError::Processor {
                partition: self.partition,
                processor,
                source,
            })
    }

    /// Hands the epoch in `graph` to every sink; a veto stops at its sink.
    async fn ask_sinks(
        &self,
        sinks: &mut [SinkSlot],
        batches: &[MessageBatch],
        read: &ReadEpoch,
        number: u64,
        committed: &Option<Vec<u8>>,
    ) -> Result<Result<EpochAnswers, Vetoed>, RuntimeError> {
        let stores_bounds = self.pipeline.stores_bounds();
        let dead_letters = read.source_dead.len();
        let mut answers = EpochAnswers::new(
            read.messages,
            dead_letters,
            committed.clone(),
            stores_bounds,
        );
        for slot in sinks.iter_mut() {
            let inputs = inputs_of(batches, &slot.inputs);
            let outcome = slot
                .sink
                .write_epoch(&self.epoch(&inputs, read, number))
                .await
                .map_err(|err| self.sink_error(&slot.name, err))?;
            if let Err(vetoed) = answers.record(&slot.name, outcome) {
                return Ok(Err(vetoed));
            }
        }
        Ok(Ok(answers))
    }

    /// Waits for the sinks' pending writes, then commits the epoch, unless one vetoed it.
    async fn settle_epoch(
        &self,
        sinks: &mut [SinkSlot],
        answers: EpochAnswers,
        read: &ReadEpoch,
        source_dead: Vec<DeadLetter>,
    ) -> Result<Settled, RuntimeError> {
        let written = answers.finish().await;
        self.settle_written(sinks, written, read, source_dead).await
    }

    /// Commits the epoch whose pending writes ended with `written`, unless one vetoed it.
    async fn settle_written(
        &self,
        sinks: &mut [SinkSlot],
        written: Result<Result<EpochCommits, Vetoed>, (String, SinkError)>,
        read: &ReadEpoch,
        source_dead: Vec<DeadLetter>,
    ) -> Result<Settled, RuntimeError> {
        let written = written.map_err(|(sink, err)| self.sink_error(&sink, err))?;
        let commits = match written {
            Ok(commits) => commits,
            Err(vetoed) => return Ok(Settled::Vetoed(vetoed)),
        };
        let sink_dead: usize = commits.sinks.iter().map(|c| c.dead_letters.len()).sum();
        let dead_letters = source_dead.len() + sink_dead;
        let position = read.position.clone();
        self.commit_epoch(sinks, commits, position, source_dead, read.messages)
            .await?;
        Ok(Settled::Committed { dead_letters })
    }

    /// After a veto: closes `source`, waits `retry_after` (or for a stop), and opens it again at
    /// the committed position.
    async fn replay_after(
        &self,
        mut source: Box<dyn Source>,
        vetoed: &Vetoed,
        committed: &Option<Vec<u8>>,
    ) -> Result<Box<dyn Source>, RuntimeError> {
        source.close().await;
        let mut shutdown = self.shutdown.clone();
        tokio::select! {
            _ = tokio::time::sleep(vetoed.retry_after) => {}
            _ = shutdown.wait_for(|stop| *stop) => {}
        }
        self.open_source(committed.as_deref())
    }

    fn log_veto(&self, vetoed: &Vetoed) {
        let pipeline = &self.pipeline.name;
        let partition = self.partition;
        if *self.shutdown.borrow() {
            // Nothing to act on: a stop leaves the epoch uncommitted, the next run reads it.
            info!(
                pipeline = %pipeline,
                partition,
                sink = %vetoed.sink,
                reason = %vetoed.reason,
                "epoch not committed: the pipeline is stopping"
            );
        } else {
            warn!(
                pipeline = %pipeline,
                partition,
                sink = %vetoed.sink,
                reason = %vetoed.reason,
                retry_after_ms = vetoed.retry_after.as_millis() as u64,
                "epoch vetoed; replaying it from the committed position"
            );
        }
    }

    /// Commits the epoch (position, sinks' batches and dead letters, counters), then tells the
    /// sinks, the observer and the progress counters.
    async fn commit_epoch(
        &self,
        sinks: &mut [SinkSlot],
        commits: EpochCommits,
        position: Option<Vec<u8>>,
        source_dead: Vec<DeadLetter>,
        messages: usize,
    ) -> Result<(), RuntimeError> {
        let partition = self.partition;
        let pipeline = Arc::clone(&self.pipeline);
        let EpochCommits {
            sinks: sink_commits,
            counters,
        } = commits;
        let kept: Vec<Vec<flow_state::SealedBatch>> =
            sink_commits.iter().map(|c| c.batches.clone()).collect();
        let new_position = position.unwrap_or_default();
        let observed_position = self.observed.as_ref().map(|_| new_position.clone());
        let commit_started = std::time::Instant::now();
        let receipt = self
            .store
            .commit(EpochCommit {
                pipeline: pipeline.name.clone(),
                partition,
                position: new_position,
                source_dead_letters: source_dead,
                sinks: sink_commits,
                counters: counters.clone(),
            })
            .await
            .map_err(|source| RuntimeError::State { partition, source })?;
        self.metrics.observe_commit(
            &pipeline.name,
            partition,
            commit_started.elapsed().as_secs_f64(),
        );
        self.metrics.applied(&pipeline.name, partition, &counters);
        if let (Some((observer, tracker)), Some(position)) = (&self.observed, observed_position) {
            observer.committed(&position);
            tracker.committed(&position, &receipt.batch_seqs);
        }
        let rows_sealed = kept.iter().flatten().map(|b| b.rows).sum();
        self.progress.committed(messages as u64, rows_sealed);

        for (slot, batches_of_sink) in sinks.iter_mut().zip(kept) {
            let seqs = receipt
                .batch_seqs
                .iter()
                .find(|(sink, _)| sink == &slot.name)
                .map(|(_, seqs)| seqs.clone())
                .unwrap_or_default();
            if seqs.len() != batches_of_sink.len() {
                return Err(self.sink_error(
                    &slot.name,
                    SinkError::Delivery {
                        reason: format!(
                            "the outbox stored {} batch(es) but the sink sealed {}",
                            seqs.len(),
                            batches_of_sink.len()
                        ),
                    },
                ));
            }
            slot.sink
                .committed(seqs.into_iter().zip(batches_of_sink).collect())
                .await
                .map_err(|err| RuntimeError::Sink {
                    partition,
                    sink: slot.name.clone(),
                    source: err,
                })?;
        }
        Ok(())
    }

    fn apply_dynamic(&mut self, sinks: &mut [SinkSlot]) -> Result<(), RuntimeError> {
        let partition = self.partition;
        for (receiver, slot) in self.dynamic.iter_mut().zip(sinks.iter_mut()) {
            if receiver.has_changed().unwrap_or(false) {
                let value = receiver.borrow_and_update().clone();
                slot.sink
                    .reconfigure(&value)
                    .map_err(|source| RuntimeError::Sink {
                        partition,
                        sink: slot.name.clone(),
                        source,
                    })?;
                info!(pipeline = %self.pipeline.name, partition, sink = %slot.name, "dynamic parameters applied");
            }
        }
        Ok(())
    }
}

/// Whether the partition reads its epochs in slices: every sink takes slices and reads one
/// input stream (a sink's slices of two streams would interleave its batches).
fn takes_slices(sinks: &[SinkSlot]) -> bool {
    !sinks.is_empty()
        && sinks
            .iter()
            .all(|slot| slot.sink.takes_slices() && slot.inputs.len() == 1)
}

/// A graceful stop lets the sinks deliver what is pending for at most `limit`; `close` then
/// stops what is still in flight and the rest stays in the outbox.
async fn drain_for(sinks: &mut [SinkSlot], limit: Duration, partition: u32) {
    if limit.is_zero() {
        return;
    }
    let drain = async {
        for slot in sinks.iter_mut() {
            if let Err(err) = slot.sink.drain().await {
                // Not a failure of the stop: what was not delivered stays in the outbox.
                info!(partition, sink = %slot.name, error = %err, "delivery ended early while stopping");
            }
        }
    };
    if tokio::time::timeout(limit, drain).await.is_err() {
        info!(
            partition,
            drain_timeout_ms = limit.as_millis() as u64,
            "the drain time of the stop ran out"
        );
    }
}

/// After a stop: how many batches and rows each sink leaves in the outbox for the next run.
async fn log_outbox(store: &StateStore, pipeline: &str, sinks: &[String], partition: u32) {
    for sink in sinks {
        let key = flow_state::SinkPartition {
            pipeline: pipeline.to_owned(),
            sink: sink.clone(),
            partition,
        };
        let reader = store.clone();
        let pending = tokio::task::spawn_blocking(move || reader.undelivered(&key)).await;
        match pending {
            Ok(Ok(batches)) if batches.is_empty() => {
                info!(partition, sink = %sink, "stopped with nothing left in the outbox");
            }
            Ok(Ok(batches)) => {
                let rows: u64 = batches.iter().map(|b| b.batch.rows).sum();
                warn!(
                    partition,
                    sink = %sink,
                    batches = batches.len(),
                    rows,
                    "stopped with {} batch(es), {rows} row(s) undelivered; they stay in the outbox and the next run delivers them",
                    batches.len()
                );
            }
            Ok(Err(err)) => {
                warn!(partition, sink = %sink, error = %err, "cannot count the undelivered batches");
            }
            Err(err) => {
                warn!(partition, sink = %sink, error = %err, "cannot count the undelivered batches");
            }
        }
    }
}

async fn close_all(sinks: &mut [SinkSlot]) {
    for slot in sinks {
        if let Err(err) = slot.sink.close().await {
            warn!(sink = %slot.name, error = %err, "sink close failed; its undelivered batches stay in the outbox");
        }
    }
}
