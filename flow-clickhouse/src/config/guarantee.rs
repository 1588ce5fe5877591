//! The delivery guarantees and, in one table ([`Guarantee::on_failure`]), what each does with a
//! failed INSERT: whether it is retried (by error class) and what giving it up means. The
//! sink classes ([`SinkClass`]) map to a guarantee and a host-form rule.

use std::fmt;

use crate::server::classify::ErrorClass;

const REFERENCE_PREFIX: &str = "NYT::NFlow::T";

/// The four sink classes; the class selects the delivery guarantee.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum SinkClass {
    /// `ClickHouseBatchingSink`: exactly-once into one unsharded table (`host` or `hosts`).
    Batching,
    /// `ShardedClickHouseBatchingSink`: exactly-once into the shards of `shard_hosts`.
    ShardedBatching,
    /// `AtLeastOnceClickHouseSink`.
    AtLeastOnce,
    /// `AtMostOnceClickHouseSink`.
    AtMostOnce,
}

impl SinkClass {
    /// Every class, in the order of [`SinkClass::ALL_CLASS_NAMES`].
    pub const ALL: [SinkClass; 4] = [
        SinkClass::Batching,
        SinkClass::ShardedBatching,
        SinkClass::AtLeastOnce,
        SinkClass::AtMostOnce,
    ];

    /// Every accepted class name, canonical and reference alias (`NYT::NFlow::T<name>`), for
    /// registration: `[ClickHouseBatchingSink, NYT::NFlow::TClickHouseBatchingSink, ...]`.
    pub const ALL_CLASS_NAMES: [&'static str; 8] = [
        "ClickHouseBatchingSink",
        "NYT::NFlow::TClickHouseBatchingSink",
        "ShardedClickHouseBatchingSink",
        "NYT::NFlow::TShardedClickHouseBatchingSink",
        "AtLeastOnceClickHouseSink",
        "NYT::NFlow::TAtLeastOnceClickHouseSink",
        "AtMostOnceClickHouseSink",
        "NYT::NFlow::TAtMostOnceClickHouseSink",
    ];

    /// Accepts the canonical names and their reference aliases `NYT::NFlow::T<name>`.
    pub fn from_class_name(name: &str) -> Option<SinkClass> {
        let canonical = name.strip_prefix(REFERENCE_PREFIX).unwrap_or(name);
        SinkClass::ALL
            .into_iter()
            .find(|class| class.class_name() == canonical)
    }

    /// The canonical name (no alias).
    pub fn class_name(self) -> &'static str {
        match self {
            SinkClass::Batching => "ClickHouseBatchingSink",
            SinkClass::ShardedBatching => "ShardedClickHouseBatchingSink",
            SinkClass::AtLeastOnce => "AtLeastOnceClickHouseSink",
            SinkClass::AtMostOnce => "AtMostOnceClickHouseSink",
        }
    }

    /// The reference alias, `NYT::NFlow::T<canonical name>`.
    pub fn reference_name(self) -> String {
        format!("{REFERENCE_PREFIX}{}", self.class_name())
    }

    /// Canonical names and aliases, as owned strings.
    pub fn all_names() -> Vec<String> {
        SinkClass::ALL_CLASS_NAMES
            .iter()
            .map(|name| (*name).to_owned())
            .collect()
    }

    /// The delivery guarantee of the class.
    pub fn guarantee(self) -> Guarantee {
        match self {
            SinkClass::Batching | SinkClass::ShardedBatching => Guarantee::ExactlyOnce,
            SinkClass::AtLeastOnce => Guarantee::AtLeastOnce,
            SinkClass::AtMostOnce => Guarantee::AtMostOnce,
        }
    }

    /// The host forms the class accepts.
    pub fn host_forms(self) -> HostForms {
        match self {
            SinkClass::Batching => HostForms::Unsharded,
            SinkClass::ShardedBatching => HostForms::Sharded,
            SinkClass::AtLeastOnce | SinkClass::AtMostOnce => HostForms::Any,
        }
    }

    /// The batching sinks deliver exactly once (deduplication tokens, outbox).
    pub fn is_exactly_once(self) -> bool {
        self.guarantee() == Guarantee::ExactlyOnce
    }
}

impl fmt::Display for SinkClass {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.class_name())
    }
}

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

/// The retry decision by error class (session start; inserts via their guarantee's table, which
/// uses the same [`Retry`]): whether to try again after the `attempt`-th failed attempt (1-based):
/// retryable errors always, unknown ones while `attempt < max_insert_attempts`, permanent never.
pub fn should_retry(class: ErrorClass, attempt: u32, max_insert_attempts: u32) -> bool {
    Retry::by_class(class).again(attempt, max_insert_attempts)
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

    #[test]
    fn should_retry_retryable_always_unknown_until_max_permanent_never() {
        for attempt in [1, 10, 11, 1000, u32::MAX] {
            assert!(should_retry(ErrorClass::Retryable, attempt, 10));
            assert!(!should_retry(ErrorClass::Permanent, attempt, 10));
        }
        assert!(should_retry(ErrorClass::Unknown, 1, 10));
        assert!(should_retry(ErrorClass::Unknown, 9, 10));
        assert!(!should_retry(ErrorClass::Unknown, 10, 10));
        assert!(!should_retry(ErrorClass::Unknown, 11, 10));
        // max_insert_attempts = 1: the first failure is final.
        assert!(!should_retry(ErrorClass::Unknown, 1, 1));
    }
}
