//! The delivery guarantees and, in one table ([`Guarantee::on_failure`]), what each does with a
//! failed INSERT: whether it is retried (by error class) and what giving it up means. The
//! classes map to a guarantee and a host-form rule in [`crate::params::SinkClass`].

use crate::classify::ErrorClass;

/// What a sink class promises about each message.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Guarantee {
    /// Outbox and deduplication tokens: every message once, across crashes and replays.
    ExactlyOnce,
    /// Inserts before the commit; a failure vetoes the commit and the epoch is replayed.
    AtLeastOnce,
    /// The commit first; one INSERT attempt per part, a failure loses its rows.
    AtMostOnce,
}

/// Whether a failed attempt is tried again.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Retry {
    /// Always (the error is transient).
    Unlimited,
    /// While fewer than `max_insert_attempts` attempts were made.
    UpToMaxAttempts,
    /// Never.
    No,
}

impl Retry {
    /// How an error of `class` is retried where nothing forbids a retry: retryable errors
    /// without limit, unknown ones up to `max_insert_attempts`, permanent ones never.
    pub fn by_class(class: ErrorClass) -> Retry {
        match class {
            ErrorClass::Retryable => Retry::Unlimited,
            ErrorClass::Unknown => Retry::UpToMaxAttempts,
            ErrorClass::Permanent => Retry::No,
        }
    }

    /// The one retry decision: whether to try again after the `attempt`-th failed attempt
    /// (1-based).
    pub fn again(self, attempt: u32, max_insert_attempts: u32) -> bool {
        match self {
            Retry::Unlimited => true,
            Retry::UpToMaxAttempts => attempt < max_insert_attempts,
            Retry::No => false,
        }
    }
}

/// What giving up an INSERT means for the sink.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GiveUp {
    /// `Giving up insert into ClickHouse`: the sink fails every later write until a restart.
    StopSink,
    /// The partition fails with the error.
    FailPartition,
    /// The epoch is not committed and will be replayed.
    VetoEpoch,
    /// The part's rows are counted as lost.
    LoseRows,
}

/// What a guarantee does with a failed INSERT of a given error class.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct OnFailure {
    pub retry: Retry,
    pub give_up: GiveUp,
}

impl Guarantee {
    /// The table: per guarantee and error class, the retry rule and what giving up means.
    pub fn on_failure(self, class: ErrorClass) -> OnFailure {
        let (retry, give_up) = match (self, class) {
            (Guarantee::ExactlyOnce, class) => (Retry::by_class(class), GiveUp::StopSink),
            // As the reference: an unknown error fails the write after `max_insert_attempts`
            // instead of vetoing and replaying the epoch forever.
            (Guarantee::AtLeastOnce, ErrorClass::Retryable) => {
                (Retry::Unlimited, GiveUp::VetoEpoch)
            }
            (Guarantee::AtLeastOnce, class) => (Retry::by_class(class), GiveUp::FailPartition),
            // Once an INSERT has started, its failure is final.
            (Guarantee::AtMostOnce, _) => (Retry::No, GiveUp::LoseRows),
        };
        OnFailure { retry, give_up }
    }
}

/// Which host forms a class accepts.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum HostForms {
    /// `host` or `hosts`: one unsharded table.
    Unsharded,
    /// `shard_hosts` only.
    Sharded,
    /// Any one of `host`, `hosts` and `shard_hosts`.
    Any,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_table_matches_the_guarantees_document() {
        use ErrorClass::{Permanent, Retryable, Unknown};
        let row = |g: Guarantee| {
            [Retryable, Unknown, Permanent].map(|class| {
                let f = g.on_failure(class);
                (f.retry, f.give_up)
            })
        };
        assert_eq!(
            row(Guarantee::ExactlyOnce),
            [
                (Retry::Unlimited, GiveUp::StopSink),
                (Retry::UpToMaxAttempts, GiveUp::StopSink),
                (Retry::No, GiveUp::StopSink),
            ]
        );
        assert_eq!(
            row(Guarantee::AtLeastOnce),
            [
                (Retry::Unlimited, GiveUp::VetoEpoch),
                (Retry::UpToMaxAttempts, GiveUp::FailPartition),
                (Retry::No, GiveUp::FailPartition),
            ]
        );
        assert_eq!(
            row(Guarantee::AtMostOnce),
            [(Retry::No, GiveUp::LoseRows); 3]
        );
    }
}
