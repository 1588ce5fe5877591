//! What the sinks of a partition answered for one epoch, gathered in sink order: a write to
//! commit, a veto, or a write still going on ([`EpochOutcome::Pending`]) that the runtime
//! finishes while it reads the next epoch.

use std::time::Duration;

use flow_state::{BatchStorage, CounterAdd, SinkEpochCommit};
use futures_util::future::join_all;

use crate::error::SinkError;
use crate::metrics::{SinkCount, SinkCounter, SourceCount};
use crate::plugin::{EpochOutcome, EpochWrite, PendingWrite};

/// A sink refused the epoch's commit.
pub(crate) struct Vetoed {
    pub sink: String,
    pub reason: String,
    pub retry_after: Duration,
}

/// A sink's part of the epoch's commit, known or still being written.
enum Answer {
    Done(SinkEpochCommit),
    Pending { sink: String, write: PendingWrite },
}

/// The answers of the sinks so far, with the counters the epoch commits.
pub(crate) struct EpochAnswers {
    answers: Vec<Answer>,
    counters: Vec<CounterAdd>,
    /// Where the epoch started: the bounds of rebuildable batches.
    epoch_start: Option<Vec<u8>>,
    /// Whether the pipeline keeps rebuildable batches as bounds.
    stores_bounds: bool,
}

/// Every sink's commit and the epoch's counters, in sink order.
pub(crate) struct EpochCommits {
    pub sinks: Vec<SinkEpochCommit>,
    pub counters: Vec<CounterAdd>,
}

impl EpochAnswers {
    pub(crate) fn new(
        source_counters: [CounterAdd; 3],
        epoch_start: Option<Vec<u8>>,
        stores_bounds: bool,
    ) -> EpochAnswers {
        EpochAnswers {
            answers: Vec::new(),
            counters: source_counters.into(),
            epoch_start,
            stores_bounds,
        }
    }

    /// The source counters of an epoch of `messages` messages and `dead_letters` dead ones.
    pub(crate) fn source_counters(messages: usize, dead_letters: usize) -> [CounterAdd; 3] {
        [
            SourceCount::Messages.addition(messages as u64),
            SourceCount::EpochsCommitted.addition(1),
            SourceCount::DeadLetters.addition(dead_letters as u64),
        ]
    }

    /// Records `sink`'s outcome; a veto is handed back.
    pub(crate) fn record(&mut self, sink: &str, outcome: EpochOutcome) -> Result<(), Vetoed> {
        match outcome {
            EpochOutcome::Commit(write) => {
                let commit = self.commit_of(sink, write);
                self.answers.push(Answer::Done(commit));
            }
            EpochOutcome::Pending(write) => self.answers.push(Answer::Pending {
                sink: sink.to_owned(),
                write,
            }),
            EpochOutcome::Veto {
                reason,
                retry_after,
            } => {
                return Err(Vetoed {
                    sink: sink.to_owned(),
                    reason,
                    retry_after,
                })
            }
        }
        Ok(())
    }

    /// Whether a sink's write is still going on.
    pub(crate) fn has_pending(&self) -> bool {
        self.answers
            .iter()
            .any(|answer| matches!(answer, Answer::Pending { .. }))
    }

    /// Finishes the pending writes (all at once) and returns the epoch's commits; the first veto
    /// in sink order, or the first error, wins.
    pub(crate) async fn finish(
        mut self,
    ) -> Result<Result<EpochCommits, Vetoed>, (String, SinkError)> {
        let mut done = Vec::with_capacity(self.answers.len());
        let mut names = Vec::new();
        let mut pending = Vec::new();
        for answer in std::mem::take(&mut self.answers) {
            match answer {
                Answer::Done(commit) => done.push(Some(commit)),
                Answer::Pending { sink, write } => {
                    done.push(None);
                    names.push(sink);
                    pending.push(write.finish());
                }
            }
        }
        let mut finished = names.into_iter().zip(join_all(pending).await);
        let mut sinks = Vec::with_capacity(done.len());
        for slot in done {
            let commit = match slot {
                Some(commit) => commit,
                None => {
                    let Some((sink, outcome)) = finished.next() else {
                        unreachable!("one finished write per pending answer");
                    };
                    match outcome.map_err(|err| (sink.clone(), err))? {
                        EpochOutcome::Commit(write) => self.commit_of(&sink, write),
                        EpochOutcome::Veto {
                            reason,
                            retry_after,
                        } => {
                            return Ok(Err(Vetoed {
                                sink,
                                reason,
                                retry_after,
                            }))
                        }
                        EpochOutcome::Pending(_) => {
                            let reason = "a pending write resolved to another pending write";
                            return Err((
                                sink,
                                SinkError::Delivery {
                                    reason: reason.into(),
                                },
                            ));
                        }
                    }
                }
            };
            sinks.push(commit);
        }
        Ok(Ok(EpochCommits {
            sinks,
            counters: self.counters,
        }))
    }

    fn commit_of(&mut self, sink: &str, mut write: EpochWrite) -> SinkEpochCommit {
        self.counters
            .push(sink_dead_letters(sink, write.dead_letters.len()));
        self.counters.append(&mut write.counters);
        SinkEpochCommit {
            sink: sink.to_owned(),
            storage: if write.rebuildable && self.stores_bounds {
                BatchStorage::Bounds {
                    epoch_start: self.epoch_start.clone(),
                }
            } else {
                BatchStorage::Payload
            },
            batches: write.batches,
            dead_letters: write.dead_letters,
        }
    }
}

/// The dead letters a sink set aside while sealing an epoch, as a counter addition.
fn sink_dead_letters(sink: &str, rows: usize) -> CounterAdd {
    CounterAdd {
        owner: sink.to_owned(),
        name: SinkCounter::new(SinkCount::DeadLetterRows, None).name(),
        by: rows as u64,
    }
}
