//! The pause before a retry ([`RetryBackoff`]): it grows while errors repeat and decays after
//! successes, as ClickHouse's own Distributed queue does (reference 000), so a shard that is down
//! is not hammered every `retry_backoff`, and one that has recovered is soon retried briskly.
//!
//! The pause after the n-th error in a row is `retry_backoff * 2^(n-1)`, capped at
//! `max_retry_backoff`, with +-20% jitter so that partitions and workers do not retry in lockstep.
//! A success halves the error count (instead of clearing it), so a flapping endpoint keeps
//! part of its penalty.

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::Duration;

/// Doublings at most: beyond this the cap always applies.
const MAX_DOUBLINGS: u32 = 20;

/// Jitter: the pause is scaled by a factor in `[1 - JITTER, 1 + JITTER]`.
const JITTER: f64 = 0.2;

/// A decaying error count and the pause it gives, shared by everything that retries against
/// one target (one per shard).
#[derive(Debug, Default)]
pub struct RetryBackoff {
    errors: AtomicU32,
    /// Since when every attempt has failed (ms since the Unix epoch; 0: the last one succeeded,
    /// or none failed yet), for `/ready`.
    failing_since_ms: AtomicU64,
}

impl RetryBackoff {
    /// Records a failure; returns the pause before the next attempt.
    pub fn failed(&self, base: Duration, max: Duration) -> Duration {
        let now = flow_core::delivery::now_ms().max(1);
        let _ =
            self.failing_since_ms
                .compare_exchange(0, now, Ordering::Relaxed, Ordering::Relaxed);
        let errors = self
            .errors
            .fetch_add(1, Ordering::Relaxed)
            .saturating_add(1);
        pause(errors, base, max, jitter_unit())
    }

    /// Records a success: the error count decays by half.
    pub fn succeeded(&self) {
        self.failing_since_ms.store(0, Ordering::Relaxed);
        let _ = self
            .errors
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |e| {
                (e > 0).then_some(e / 2)
            });
    }

    /// How long every attempt has failed at `now_ms`; `None` when the last one succeeded or
    /// none failed.
    pub fn failing_for(&self, now_ms: u64) -> Option<Duration> {
        match self.failing_since_ms.load(Ordering::Relaxed) {
            0 => None,
            since => Some(Duration::from_millis(now_ms.saturating_sub(since))),
        }
    }

    /// Errors in the decayed count (for logs).
    pub fn errors(&self) -> u32 {
        self.errors.load(Ordering::Relaxed)
    }
}

/// The pause after `errors` errors: `base * 2^(errors-1)` capped at `max`, scaled by the jitter
/// `unit` in `[0, 1)` mapped onto `[1 - JITTER, 1 + JITTER]`, and never above `max`.
pub fn pause(errors: u32, base: Duration, max: Duration, unit: f64) -> Duration {
    let doublings = errors.saturating_sub(1).min(MAX_DOUBLINGS);
    let grown = base.saturating_mul(1 << doublings).min(max);
    let factor = 1.0 - JITTER + 2.0 * JITTER * unit.clamp(0.0, 1.0);
    grown.mul_f64(factor).min(max)
}

/// A number in `[0, 1)` that differs between calls and threads (jitter needs no strong
/// randomness, only decorrelation).
fn jitter_unit() -> f64 {
    use std::hash::{BuildHasher, Hasher};
    let mut hasher = std::collections::hash_map::RandomState::new().build_hasher();
    hasher.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos()),
    );
    (hasher.finish() >> 11) as f64 / (1u64 << 53) as f64
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: Duration = Duration::from_secs(1);

    #[test]
    fn failing_time_runs_from_the_first_failure_in_a_row_until_a_success() {
        let backoff = RetryBackoff::default();
        assert_eq!(backoff.failing_for(u64::MAX), None);
        backoff.failed(S, S);
        let since = backoff.failing_since_ms.load(Ordering::Relaxed);
        backoff.failed(S, S);
        assert_eq!(
            backoff.failing_since_ms.load(Ordering::Relaxed),
            since,
            "the first one counts"
        );
        assert_eq!(
            backoff.failing_for(since + 31_000),
            Some(Duration::from_secs(31))
        );
        backoff.succeeded();
        assert_eq!(backoff.failing_for(since + 31_000), None);
    }

    #[test]
    fn the_pause_doubles_per_error_in_a_row_up_to_the_cap() {
        let pauses: Vec<u64> = (1..=7)
            .map(|n| pause(n, S, Duration::from_secs(30), 0.5).as_secs())
            .collect();
        assert_eq!(pauses, [1, 2, 4, 8, 16, 30, 30]);
        // A huge error count neither overflows nor passes the cap.
        assert_eq!(pause(u32::MAX, S, Duration::from_secs(30), 0.5), 30 * S);
        assert_eq!(pause(1, Duration::ZERO, 30 * S, 0.9), Duration::ZERO);
    }

    #[test]
    fn jitter_stays_within_twenty_percent_and_under_the_cap() {
        assert_eq!(pause(3, S, 30 * S, 0.0), Duration::from_millis(3200));
        assert_eq!(pause(3, S, 30 * S, 1.0), Duration::from_millis(4800));
        assert_eq!(pause(9, S, 30 * S, 1.0), 30 * S);
        for _ in 0..1000 {
            let unit = jitter_unit();
            assert!((0.0..1.0).contains(&unit), "{unit}");
        }
    }

    #[test]
    fn successes_decay_the_error_count_by_half() {
        let backoff = RetryBackoff::default();
        for _ in 0..5 {
            backoff.failed(S, 30 * S);
        }
        assert_eq!(backoff.errors(), 5);
        backoff.succeeded();
        assert_eq!(backoff.errors(), 2);
        // The next failure starts from the decayed count: 3 errors, 4 s +-20%.
        let next = backoff.failed(S, 30 * S);
        assert!(next >= Duration::from_millis(3200) && next <= Duration::from_millis(4800));
        backoff.succeeded();
        backoff.succeeded();
        assert_eq!(backoff.errors(), 0);
        backoff.succeeded();
        assert_eq!(backoff.errors(), 0);
    }

    #[tokio::test(start_paused = true)]
    async fn retries_against_a_target_that_stays_down_wait_ever_longer_with_a_paused_clock() {
        let backoff = RetryBackoff::default();
        let start = tokio::time::Instant::now();
        let mut waited = Vec::new();
        for _ in 0..8 {
            let pause = backoff.failed(S, 10 * S);
            let before = tokio::time::Instant::now();
            tokio::time::sleep(pause).await;
            waited.push(before.elapsed());
        }
        for pair in waited.windows(2).take(3) {
            // Doubling with +-20% jitter: the next pause is at least 2 * 0.8 / 1.2 of this one.
            assert!(
                pair[1].as_secs_f64() >= pair[0].as_secs_f64() * 1.33,
                "{waited:?}"
            );
        }
        assert!(waited.iter().all(|w| *w <= 10 * S), "{waited:?}");
        assert!(waited[4..].iter().all(|w| *w >= 8 * S), "{waited:?}");
        assert!(start.elapsed() >= Duration::from_secs(40));
    }
}
