//! Watching the age of a shard's oldest pending batch against the table's deduplication window
//! ([`BacklogAge`]).
//!
//! ClickHouse forgets a block's hash (or token) once it leaves the window
//! (`replicated_deduplication_window_seconds` for replicated tables). A batch that is replayed
//! after that may land twice if an earlier attempt landed without an answer. So while a shard's
//! batches wait (the shard is down, or rejects them) the sink warns, once a minute per shard,
//! when the batch it is trying to deliver has passed half of that window: there is still time to
//! bring the shard back or widen the window.
//!
//! Once a batch that an earlier attempt sent without an answer is past the window, sending it
//! again could land it twice: [`expired`] is the one decision, and the exactly-once sinks set
//! such a batch's rows aside (`on_expired_backlog: dead_letter`, the default) or send it all the
//! same (`send`).

use std::sync::Mutex;
use std::time::Duration;

use tokio::time::Instant;

/// At most one backlog warning per shard in this interval.
pub const BACKLOG_WARNING_INTERVAL: Duration = Duration::from_secs(60);

/// Whether a batch of this age is past half of the window.
pub fn past_half_window(age: Duration, window: Duration) -> bool {
    age.saturating_mul(2) > window
}

/// The sink value that records an unanswered attempt at pending entry `seq` of `partition`.
pub fn unanswered_marker(partition: u32, seq: u64) -> String {
    format!("unanswered/{partition}/{seq}")
}

/// The prefix of every unanswered-attempt record of `partition`.
pub fn unanswered_prefix(partition: u32) -> String {
    format!("unanswered/{partition}/")
}

/// A pending part that may have landed unanswered and is older than the dedup window.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Expired {
    pub age: Duration,
    pub window: Duration,
}

/// Whether a part sealed at `sealed_at_ms` must not be sent again at `now_ms`: an earlier attempt
/// got no answer (`unanswered`) and the part is older than the shard's dedup `window` (none
/// known: never expired).
pub fn expired(
    sealed_at_ms: u64,
    now_ms: u64,
    window: Option<Duration>,
    unanswered: bool,
) -> Option<Expired> {
    let window = window.filter(|_| unanswered)?;
    let age = Duration::from_millis(now_ms.saturating_sub(sealed_at_ms));
    (age > window).then_some(Expired { age, window })
}

/// The backlog-warning state of one shard.
#[derive(Debug, Default)]
pub struct BacklogAge {
    last_warning: Mutex<Option<Instant>>,
}

impl BacklogAge {
    /// Whether to warn now about a pending batch of `age` against `window`; records the warning.
    pub fn warn_now(&self, age: Duration, window: Duration) -> bool {
        if !past_half_window(age, window) {
            return false;
        }
        let mut last = self
            .last_warning
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        let now = Instant::now();
        if last.is_some_and(|at| now.duration_since(at) < BACKLOG_WARNING_INTERVAL) {
            return false;
        }
        *last = Some(now);
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const WINDOW: Duration = Duration::from_secs(600);

    #[test]
    fn only_a_batch_older_than_half_the_window_is_a_concern() {
        assert!(!past_half_window(Duration::from_secs(300), WINDOW));
        assert!(past_half_window(Duration::from_secs(301), WINDOW));
        assert!(!past_half_window(Duration::MAX, Duration::MAX));
    }

    #[test]
    fn only_an_unanswered_part_older_than_the_window_expires() {
        let sealed = 1_000_000;
        let at = |s: u64| sealed + s * 1000;
        assert_eq!(expired(sealed, at(601), Some(WINDOW), false), None);
        assert_eq!(expired(sealed, at(600), Some(WINDOW), true), None);
        assert_eq!(
            expired(sealed, at(601), Some(WINDOW), true),
            Some(Expired {
                age: Duration::from_secs(601),
                window: WINDOW
            })
        );
        assert_eq!(expired(sealed, at(100_000), None, true), None);
        // A clock that went back never expires anything.
        assert_eq!(
            expired(sealed, sealed - 5, Some(Duration::ZERO), true),
            None
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_shard_past_half_its_window_is_warned_about_once_a_minute_with_a_paused_clock() {
        let backlog = BacklogAge::default();
        assert!(!backlog.warn_now(Duration::from_secs(100), WINDOW));
        assert!(backlog.warn_now(Duration::from_secs(400), WINDOW));
        tokio::time::advance(Duration::from_secs(30)).await;
        assert!(!backlog.warn_now(Duration::from_secs(430), WINDOW));
        tokio::time::advance(Duration::from_secs(31)).await;
        assert!(backlog.warn_now(Duration::from_secs(461), WINDOW));
        assert!(!backlog.warn_now(Duration::from_secs(461), WINDOW));
    }
}
