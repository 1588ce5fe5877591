//! The requests sent to the committer thread and their answers.

use crate::counters::PreparedCounter;
use crate::error::StateError;
use crate::prepare::{PreparedAck, PreparedCommit, PreparedFingerprints};
use crate::types::CommitReceipt;
use crate::zk::load::PreparedLoad;

pub(crate) enum Op {
    Commit(PreparedCommit),
    Ack(PreparedAck),
    SetFingerprints(PreparedFingerprints),
    /// Sets (`Some`) or removes (`None`) one `sink_values` key.
    SetSinkValue(Vec<u8>, Option<Vec<u8>>),
    /// Removes these `dead_letters` keys (their owners' counters stay: seqs are never reused).
    RemoveDeadLetters(Vec<Vec<u8>>),
    /// Adds to counters on their own (what no commit or acknowledgement carries: failures).
    AddCounters(Vec<PreparedCounter>),
    /// Replaces a partition's entries with what was read from ZooKeeper (cluster mode).
    Replace(PreparedLoad),
    Shutdown,
}

pub(crate) enum Outcome {
    Commit(CommitReceipt),
    Done,
    /// How many of the requested entries existed and were removed.
    Removed(u64),
}

pub(crate) type Reply = Box<dyn FnOnce(Result<Outcome, StateError>) + Send>;

pub(crate) struct Request {
    pub op: Op,
    pub reply: Reply,
}
