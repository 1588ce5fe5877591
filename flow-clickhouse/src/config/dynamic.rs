//! The reloadable `dynamic_parameters` of a ClickHouse sink: their serde type, defaults and
//! ranges, and the validation that reports every violation with its path in the spec
//! (`dynamic_parameters.max_rows_per_batch`). A SIGHUP swaps them without a restart.

use std::time::Duration;

use flow_core::registry::parse_parameters;
use flow_core::Violation;
use serde::{Deserialize, Serialize};

use crate::config::guarantee::SinkClass;

pub const DEFAULT_WRITE_TIMEOUT: Duration = Duration::from_secs(60);
pub const MIN_WRITE_TIMEOUT: Duration = Duration::from_millis(1);
pub const MAX_WRITE_TIMEOUT: Duration = Duration::from_secs(3600);
pub const DEFAULT_RETRY_BACKOFF: Duration = Duration::from_secs(1);
pub const MAX_RETRY_BACKOFF: Duration = Duration::from_secs(600);
/// Default cap of the growing pause between retries (`max_retry_backoff`).
pub const DEFAULT_MAX_RETRY_BACKOFF: Duration = Duration::from_secs(30);
/// Largest `max_retry_backoff`.
pub const MAX_MAX_RETRY_BACKOFF: Duration = Duration::from_secs(3600);
pub const DEFAULT_MAX_INSERT_ATTEMPTS: u32 = 10;
pub const MAX_INSERT_ATTEMPTS: u32 = 1000;
pub const DEFAULT_REPLAY_HORIZON: Duration = Duration::from_secs(86_400);
pub const MIN_REPLAY_HORIZON: Duration = Duration::from_secs(1);
pub const DEFAULT_MAX_ROWS_PER_BATCH: u64 = 1000;
/// Extended from the reference's 2000; stays below ClickHouse's `max_insert_block_size`
/// (1,048,576) so that one insert is one block, which block deduplication relies on.
pub const MAX_ROWS_PER_BATCH: u64 = 1_000_000;
pub const DEFAULT_MAX_BYTES_PER_BATCH: u64 = 5 * 1024 * 1024;
/// Extended from the reference's 10 MiB.
pub const MAX_BYTES_PER_BATCH: u64 = 256 * 1024 * 1024;
/// Default of `max_in_flight_bytes` (per shard): about two framed 100k-row batches of the
/// benchmark's rows per partition of a 4-partition pipeline; 64 MiB for one shard added 20 MiB of
/// resident memory and no measurable throughput (see docs/performance.md).
pub const DEFAULT_MAX_IN_FLIGHT_BYTES: u64 = 32 * 1024 * 1024;
pub const MIN_IN_FLIGHT_BYTES: u64 = 1024 * 1024;
pub const DEFAULT_TOTAL_QUEUE_BYTES_LIMIT: u64 = 64 * 1024 * 1024;

/// Dynamic `at_most_once_strategy`; accepted only by `AtMostOnceClickHouseSink`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct AtMostOnceDynamic {
    /// Bytes the bounded queue may hold; messages beyond it are dropped with a warning. >= 1.
    pub total_queue_bytes_limit: u64,
}

impl Default for AtMostOnceDynamic {
    fn default() -> Self {
        AtMostOnceDynamic {
            total_queue_bytes_limit: DEFAULT_TOTAL_QUEUE_BYTES_LIMIT,
        }
    }
}

/// The reloadable `dynamic_parameters` of a ClickHouse sink.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ClickHouseDynamicParams {
    /// Timeout of one HTTP request (send and receive). 1ms..=1h.
    #[serde(with = "duration")]
    pub write_timeout: Duration,
    /// Pause after the first failed attempt; it doubles while errors repeat. 0..=10m.
    #[serde(with = "duration")]
    pub retry_backoff: Duration,
    /// Cap of the growing pause. retry_backoff..=1h; unset, the larger of
    /// 30 s and `retry_backoff` (see [`ClickHouseDynamicParams::retry_backoff_cap`]).
    #[serde(with = "optional_duration", skip_serializing_if = "Option::is_none")]
    pub max_retry_backoff: Option<Duration>,
    /// Attempts for unclassified errors (known transient ones retry without limit). 1..=1000.
    pub max_insert_attempts: u32,
    /// Server-side asynchronous inserts (`async_insert=1`, `wait_for_async_insert=1`).
    pub async_insert: bool,
    /// Upper bound of replay lag, compared with the server's deduplication window. >= 1s.
    #[serde(with = "duration")]
    pub replay_horizon: Duration,
    /// A batch is sealed at this many messages. 1..=1,000,000.
    pub max_rows_per_batch: u64,
    /// A batch is sealed at this many bytes of messages. 1..=256 MiB.
    pub max_bytes_per_batch: u64,
    /// Payload bytes (as sent, after framing) the sink holds in memory for delivery, per shard,
    /// across its partitions. 1 MiB..=4 GiB.
    pub max_in_flight_bytes: u64,
    /// Dynamic at-most-once settings; only `AtMostOnceClickHouseSink` accepts it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub at_most_once_strategy: Option<AtMostOnceDynamic>,
}

impl Default for ClickHouseDynamicParams {
    fn default() -> Self {
        ClickHouseDynamicParams {
            write_timeout: DEFAULT_WRITE_TIMEOUT,
            retry_backoff: DEFAULT_RETRY_BACKOFF,
            max_retry_backoff: None,
            max_insert_attempts: DEFAULT_MAX_INSERT_ATTEMPTS,
            async_insert: false,
            replay_horizon: DEFAULT_REPLAY_HORIZON,
            max_rows_per_batch: DEFAULT_MAX_ROWS_PER_BATCH,
            max_bytes_per_batch: DEFAULT_MAX_BYTES_PER_BATCH,
            max_in_flight_bytes: DEFAULT_MAX_IN_FLIGHT_BYTES,
            at_most_once_strategy: None,
        }
    }
}

impl ClickHouseDynamicParams {
    /// The cap of the growing retry pause: `max_retry_backoff`, or unset the larger of
    /// 30 s (`DEFAULT_MAX_RETRY_BACKOFF`) and `retry_backoff`.
    pub fn retry_backoff_cap(&self) -> Duration {
        self.max_retry_backoff
            .unwrap_or(DEFAULT_MAX_RETRY_BACKOFF.max(self.retry_backoff))
    }

    /// Every semantic violation of these parameters for `class`, with paths under
    /// `dynamic_parameters`.
    pub fn validate(&self, class: SinkClass) -> Vec<Violation> {
        let mut v = Vec::new();
        let show = |d: Duration| humantime::format_duration(d).to_string();
        let mut duration_range =
            |field: &str, value: Duration, min: Duration, max: Option<Duration>| {
                if value < min || max.is_some_and(|max| value > max) {
                    let range = match max {
                        Some(max) => format!("{}..={}", show(min), show(max)),
                        None => format!("at least {}", show(min)),
                    };
                    v.push(Violation::new(
                        format!("dynamic_parameters.{field}"),
                        format!(
                            "{} is out of range ({range}); set a duration in that range",
                            show(value)
                        ),
                    ));
                }
            };
        duration_range(
            "write_timeout",
            self.write_timeout,
            MIN_WRITE_TIMEOUT,
            Some(MAX_WRITE_TIMEOUT),
        );
        duration_range(
            "retry_backoff",
            self.retry_backoff,
            Duration::ZERO,
            Some(MAX_RETRY_BACKOFF),
        );
        if let Some(max_retry_backoff) = self.max_retry_backoff {
            duration_range(
                "max_retry_backoff",
                max_retry_backoff,
                Duration::ZERO,
                Some(MAX_MAX_RETRY_BACKOFF),
            );
        }
        duration_range(
            "replay_horizon",
            self.replay_horizon,
            MIN_REPLAY_HORIZON,
            None,
        );
        let below = self
            .max_retry_backoff
            .filter(|max| *max < self.retry_backoff && self.retry_backoff <= MAX_RETRY_BACKOFF);
        if let Some(max_retry_backoff) = below {
            v.push(Violation::new(
                "dynamic_parameters.max_retry_backoff",
                format!(
                    "{} is below retry_backoff ({}): the pause grows from retry_backoff up to \
                     max_retry_backoff; raise max_retry_backoff or lower retry_backoff",
                    show(max_retry_backoff),
                    show(self.retry_backoff)
                ),
            ));
        }
        let mut int_range = |field: &str, value: u64, min: u64, max: Option<u64>| {
            if value < min || max.is_some_and(|max| value > max) {
                let range = match max {
                    Some(max) => format!("{min}..={max}"),
                    None => format!("at least {min}"),
                };
                v.push(Violation::new(
                    format!("dynamic_parameters.{field}"),
                    format!("{value} is out of range ({range}); set a value in that range"),
                ));
            }
        };
        int_range(
            "max_insert_attempts",
            u64::from(self.max_insert_attempts),
            1,
            Some(u64::from(MAX_INSERT_ATTEMPTS)),
        );
        int_range(
            "max_rows_per_batch",
            self.max_rows_per_batch,
            1,
            Some(MAX_ROWS_PER_BATCH),
        );
        int_range(
            "max_bytes_per_batch",
            self.max_bytes_per_batch,
            1,
            Some(MAX_BYTES_PER_BATCH),
        );
        int_range(
            "max_in_flight_bytes",
            self.max_in_flight_bytes,
            MIN_IN_FLIGHT_BYTES,
            Some(flow_core::delivery::MAX_BYTE_BUDGET),
        );
        if let Some(strategy) = &self.at_most_once_strategy {
            int_range(
                "at_most_once_strategy.total_queue_bytes_limit",
                strategy.total_queue_bytes_limit,
                1,
                None,
            );
            if class != SinkClass::AtMostOnce {
                v.push(Violation::new(
                    "dynamic_parameters.at_most_once_strategy",
                    format!(
                        "{class} does not support at_most_once_strategy; remove it, or use \
                         AtMostOnceClickHouseSink"
                    ),
                ));
            }
        }
        v
    }
}

/// Deserializes and validates the `dynamic_parameters` alone (on a reload).
pub fn parse_dynamic(
    class: SinkClass,
    dynamic: &serde_yaml::Value,
) -> Result<ClickHouseDynamicParams, Vec<Violation>> {
    let params: ClickHouseDynamicParams = parse_parameters(dynamic, "dynamic_parameters")?;
    let violations = params.validate(class);
    if violations.is_empty() {
        Ok(params)
    } else {
        Err(violations)
    }
}

/// Serde for `Duration`: a humantime string (`1m`, `500ms`, `1d`, `1h 30m`) or an integer
/// number of milliseconds; serialized as a humantime string.
/// An optional [`duration`]: absent means `None`.
pub mod optional_duration {
    use std::time::Duration;

    use serde::{Deserializer, Serializer};

    pub fn serialize<S: Serializer>(
        value: &Option<Duration>,
        serializer: S,
    ) -> Result<S::Ok, S::Error> {
        match value {
            Some(value) => super::duration::serialize(value, serializer),
            None => serializer.serialize_none(),
        }
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(
        deserializer: D,
    ) -> Result<Option<Duration>, D::Error> {
        super::duration::deserialize(deserializer).map(Some)
    }
}

pub mod duration {
    use std::fmt;
    use std::time::Duration;

    use serde::de::{self, Visitor};
    use serde::{Deserializer, Serializer};

    pub fn serialize<S: Serializer>(value: &Duration, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_str(&humantime::format_duration(*value))
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(deserializer: D) -> Result<Duration, D::Error> {
        deserializer.deserialize_any(DurationVisitor)
    }

    struct DurationVisitor;

    const EXPECTED: &str = "a duration such as `1m`, `500ms`, `1d`, or an integer number of \
                            milliseconds";

    impl Visitor<'_> for DurationVisitor {
        type Value = Duration;

        fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str(EXPECTED)
        }

        fn visit_u64<E: de::Error>(self, ms: u64) -> Result<Duration, E> {
            Ok(Duration::from_millis(ms))
        }

        fn visit_i64<E: de::Error>(self, ms: i64) -> Result<Duration, E> {
            u64::try_from(ms)
                .map(Duration::from_millis)
                .map_err(|_| E::custom(format!("{ms} is negative; expected {EXPECTED}")))
        }

        fn visit_str<E: de::Error>(self, text: &str) -> Result<Duration, E> {
            humantime::parse_duration(text.trim()).map_err(|err| {
                E::custom(format!(
                    "`{text}` is not a duration ({err}); expected {EXPECTED}"
                ))
            })
        }
    }
}
