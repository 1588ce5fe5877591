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

/// A sink's answer once its write (if pending) ended.
enum Finished {
    Done(SinkEpochCommit),
    Written {
        sink: String,
        outcome: Result<EpochOutcome, SinkError>,
    },
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
    /// No answer yet, for an epoch of `messages` read from the source, which set
    /// `dead_letters` aside.
    pub(crate) fn new(
        messages: usize,
        dead_letters: usize,
        epoch_start: Option<Vec<u8>>,
        stores_bounds: bool,
    ) -> EpochAnswers {
        EpochAnswers {
            answers: Vec::new(),
            counters: vec![
                SourceCount::Messages.addition(messages as u64),
                SourceCount::EpochsCommitted.addition(1),
                SourceCount::DeadLetters.addition(dead_letters as u64),
            ],
            epoch_start,
            stores_bounds,
        }
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
        let answers = std::mem::take(&mut self.answers);
        let finished = join_all(answers.into_iter().map(|answer| async move {
            match answer {
                Answer::Done(commit) => Finished::Done(commit),
                Answer::Pending { sink, write } => Finished::Written {
                    sink,
                    outcome: write.finish().await,
                },
            }
        }))
        .await;
        let mut sinks = Vec::with_capacity(finished.len());
        for finished in finished {
            let (sink, outcome) = match finished {
                Finished::Done(commit) => {
                    sinks.push(commit);
                    continue;
                }
                Finished::Written { sink, outcome } => (sink, outcome),
            };
            match outcome.map_err(|err| (sink.clone(), err))? {
                EpochOutcome::Commit(write) => sinks.push(self.commit_of(&sink, write)),
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
                    let reason = "a pending write resolved to another pending write".to_owned();
                    return Err((sink, SinkError::Delivery { reason }));
                }
            }
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

#[cfg(test)]
mod tests {
    use super::*;

    fn pending(outcome: Result<EpochOutcome, SinkError>, delay_ms: u64) -> EpochOutcome {
        EpochOutcome::Pending(PendingWrite::new(async move {
            tokio::time::sleep(Duration::from_millis(delay_ms)).await;
            outcome
        }))
    }

    fn veto(reason: &str) -> Result<EpochOutcome, SinkError> {
        Ok(EpochOutcome::Veto {
            reason: reason.to_owned(),
            retry_after: Duration::ZERO,
        })
    }

    fn answers() -> EpochAnswers {
        EpochAnswers::new(10, 0, None, true)
    }

    #[tokio::test]
    async fn pending_writes_resolve_in_sink_order_and_the_first_veto_in_that_order_wins() {
        let mut answers = answers();
        let commit = Ok(EpochOutcome::Commit(EpochWrite::default()));
        assert!(answers.record("a", pending(commit, 0)).is_ok());
        assert!(answers.record("b", pending(veto("b refused"), 20)).is_ok());
        assert!(answers.record("c", pending(veto("c refused"), 0)).is_ok());
        assert!(answers.has_pending());
        let Ok(Err(vetoed)) = answers.finish().await else {
            panic!("expected a veto");
        };
        assert_eq!(
            (vetoed.sink.as_str(), vetoed.reason.as_str()),
            ("b", "b refused")
        );
    }

    #[tokio::test]
    async fn commits_keep_sink_order_with_each_sinks_dead_letter_counter() {
        let mut answers = answers();
        let commit = || Ok(EpochOutcome::Commit(EpochWrite::default()));
        assert!(answers.record("a", pending(commit(), 20)).is_ok());
        assert!(answers
            .record("b", commit().unwrap_or_else(|_| unreachable!()))
            .is_ok());
        let Ok(Ok(commits)) = answers.finish().await else {
            panic!("expected commits");
        };
        let names: Vec<&str> = commits.sinks.iter().map(|c| c.sink.as_str()).collect();
        assert_eq!(names, ["a", "b"]);
        // Three source counters, then one dead-letter counter per sink, in the order written.
        let owners: Vec<&str> = commits.counters[3..]
            .iter()
            .map(|c| c.owner.as_str())
            .collect();
        assert_eq!(owners, ["b", "a"]);
    }

    #[tokio::test]
    async fn a_pending_write_that_answers_pending_again_fails_naming_its_sink() {
        let mut answers = answers();
        let again = pending(Ok(EpochOutcome::Commit(EpochWrite::default())), 0);
        assert!(answers.record("ch", pending(Ok(again), 0)).is_ok());
        match answers.finish().await {
            Err((sink, SinkError::Delivery { reason })) => {
                assert_eq!(sink, "ch");
                assert!(reason.contains("another pending write"), "{reason}");
            }
            Err((sink, other)) => panic!("unexpected error from {sink}: {other:?}"),
            Ok(_) => panic!("expected an error"),
        }
    }
}
