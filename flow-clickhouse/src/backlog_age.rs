//! Watching the age of a shard's oldest pending batch against the table's deduplication window
//! ([`BacklogAge`]).
//!
//! ClickHouse forgets a block's hash (or token) once it leaves the window
//! (`replicated_deduplication_window_seconds` for replicated tables). A batch that is replayed
//! after that may land twice if an earlier attempt landed without an answer. So while a shard's
//! batches wait (the shard is down, or rejects them) the sink warns, once a minute per shard,
//! when the batch it is trying to deliver has passed half of that window: there is still time to
//! bring the shard back or widen the window.

use std::sync::Mutex;
use std::time::Duration;

use tokio::time::Instant;

/// At most one backlog warning per shard in this interval.
pub const BACKLOG_WARNING_INTERVAL: Duration = Duration::from_secs(60);

/// Whether a batch of this age is past half of the window.
pub fn past_half_window(age: Duration, window: Duration) -> bool {
    age.saturating_mul(2) > window
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
