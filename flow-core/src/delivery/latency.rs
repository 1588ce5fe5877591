//! [`DeliveryLatency`]: the time from an epoch's reading to its batches' acknowledgement, per
//! sink, logged in windows.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use tracing::info;

use crate::clock::now_ms;

/// How often a sink logs its delivery latency.
pub const LATENCY_REPORT_INTERVAL: Duration = Duration::from_secs(60);

/// Time from the start of reading an epoch to the acknowledgement of its batches, per sink,
/// logged every [`LATENCY_REPORT_INTERVAL`] as `delivery latency` (`p50_ms`, `p99_ms`).
pub struct DeliveryLatency {
    sink: String,
    window: Mutex<LatencyWindow>,
}

struct LatencyWindow {
    started: std::time::Instant,
    samples: Vec<u64>,
}

/// Samples kept per window; more batches than this in one window are not sampled.
const MAX_LATENCY_SAMPLES: usize = 100_000;

impl DeliveryLatency {
    /// The latency record of `sink`.
    pub fn new(sink: &str) -> Arc<DeliveryLatency> {
        Arc::new(DeliveryLatency {
            sink: sink.to_owned(),
            window: Mutex::new(LatencyWindow {
                started: std::time::Instant::now(),
                samples: Vec::new(),
            }),
        })
    }

    pub(super) fn record(&self, origin_ms: u64) {
        let mut window = self.window.lock().unwrap_or_else(|p| p.into_inner());
        if window.samples.len() < MAX_LATENCY_SAMPLES {
            window.samples.push(now_ms().saturating_sub(origin_ms));
        }
        if window.started.elapsed() >= LATENCY_REPORT_INTERVAL {
            self.report(&mut window);
        }
    }

    /// Logs what the current window holds (at the end of a run, when the sink's last partition
    /// lets go of it).
    pub fn flush(&self) {
        let mut window = self.window.lock().unwrap_or_else(|p| p.into_inner());
        self.report(&mut window);
    }

    fn report(&self, window: &mut LatencyWindow) {
        let window_s = window.started.elapsed().as_secs();
        window.started = std::time::Instant::now();
        let samples = &mut window.samples;
        if samples.is_empty() {
            return;
        }
        samples.sort_unstable();
        let at = |q: usize| samples[(samples.len() - 1) * q / 100];
        info!(
            sink = %self.sink,
            batches = samples.len(),
            p50_ms = at(50),
            p99_ms = at(99),
            max_ms = at(100),
            window_s,
            "delivery latency"
        );
        samples.clear();
    }
}

impl Drop for DeliveryLatency {
    fn drop(&mut self) {
        self.flush();
    }
}
