//! The live progress line of `run` on a terminal: one line on stderr, redrawn every second, with
//! the rates in (messages committed) and out (rows delivered from the outbox), what is pending in
//! the outbox and the source lag. It is shown only when stderr is a terminal and the logs are
//! text: a redirected stderr (a file, a supervisor, `--log-format json`) gets log lines only.
//!
//! Logs share the terminal with it: [`log_writer`] erases the line before a log line is written,
//! and the next redraw puts it back under the log.

use std::io::{IsTerminal, Write};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use flow_core::PipelineControl;
use flow_state::StateSummary;
use tokio::sync::watch;

/// How often the line is redrawn.
const REDRAW_INTERVAL: Duration = Duration::from_secs(1);
/// Erases the current terminal line and returns to its start.
const ERASE_LINE: &[u8] = b"\r\x1b[2K";

/// Whether the progress line is on the terminal now (so that a log line erases it first).
static SHOWN: AtomicBool = AtomicBool::new(false);

/// Whether `run` shows the line: stderr is a terminal and the logs are text.
pub(crate) fn wanted(json_logs: bool) -> bool {
    !json_logs && std::io::stderr().is_terminal()
}

/// The writer of the log lines: stderr, with the progress line erased first if it is shown.
pub(crate) fn log_writer() -> std::io::StderrLock<'static> {
    let mut stderr = std::io::stderr().lock();
    if SHOWN.swap(false, Ordering::Relaxed) {
        // A failed erase only leaves the old line before the log text.
        let _ = stderr.write_all(ERASE_LINE);
    }
    stderr
}

/// The outbox as one status snapshot saw it, with the rows sealed by then.
#[derive(Clone, Copy, Debug)]
pub(crate) struct OutboxSample {
    pub at: Instant,
    pub pending_batches: u64,
    pub pending_rows: u64,
    pub rows_sealed: u64,
}

impl OutboxSample {
    /// `pipeline`'s outbox in `summary`; `rows_sealed` read just before the summary was.
    pub(crate) fn of(summary: &StateSummary, pipeline: &str, rows_sealed: u64) -> OutboxSample {
        let sinks = summary.pipelines.get(pipeline).map(|p| p.sinks.as_slice());
        let sinks = sinks.unwrap_or_default();
        OutboxSample {
            at: Instant::now(),
            pending_batches: sinks.iter().map(|s| s.undelivered).sum(),
            pending_rows: sinks.iter().map(|s| s.rows).sum(),
            rows_sealed,
        }
    }

    /// Rows delivered per second between `earlier` and this sample: what was sealed in between,
    /// less what the outbox grew by.
    fn out_rate(&self, earlier: &OutboxSample) -> f64 {
        let seconds = self.at.duration_since(earlier.at).as_secs_f64();
        let left = |s: &OutboxSample| s.rows_sealed as i128 - s.pending_rows as i128;
        let delivered = (left(self) - left(earlier)).max(0);
        if seconds > 0.0 {
            delivered as f64 / seconds
        } else {
            0.0
        }
    }
}

/// The thread that redraws the line; [`ProgressLine::stop`] erases it.
pub(crate) struct ProgressLine {
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl ProgressLine {
    /// Starts redrawing. A plain thread, not a task: writing to a terminal blocks.
    pub(crate) fn start(
        pipeline: String,
        partitions: u32,
        control: PipelineControl,
        outbox: watch::Receiver<Option<OutboxSample>>,
    ) -> ProgressLine {
        let stop = Arc::new(AtomicBool::new(false));
        let redraw = Redraw {
            pipeline,
            partitions,
            control,
            outbox,
        };
        let flag = Arc::clone(&stop);
        let thread = std::thread::Builder::new()
            .name("flow-progress".to_owned())
            .spawn(move || redraw.run(&flag))
            .ok();
        ProgressLine { stop, thread }
    }

    pub(crate) fn stop(mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(thread) = self.thread.take() {
            // Wakes it from its wait between redraws, so that the exit does not wait for it.
            thread.thread().unpark();
            let _ = thread.join();
        }
        drop(log_writer());
    }
}

struct Redraw {
    pipeline: String,
    partitions: u32,
    control: PipelineControl,
    outbox: watch::Receiver<Option<OutboxSample>>,
}

impl Redraw {
    fn run(self, stop: &AtomicBool) {
        let mut last = (Instant::now(), self.control.progress().messages);
        let (mut earlier, mut out_rate): (Option<OutboxSample>, Option<f64>) = (None, None);
        while !stop.load(Ordering::Relaxed) {
            std::thread::park_timeout(REDRAW_INTERVAL);
            if stop.load(Ordering::Relaxed) {
                break;
            }
            let (now, messages) = (Instant::now(), self.control.progress().messages);
            let seconds = now.duration_since(last.0).as_secs_f64().max(f64::EPSILON);
            let in_rate = messages.saturating_sub(last.1) as f64 / seconds;
            last = (now, messages);
            let sample = *self.outbox.borrow();
            if let Some(sample) = sample {
                if let Some(before) = earlier.filter(|e| e.at < sample.at) {
                    out_rate = Some(sample.out_rate(&before));
                }
                if earlier.is_none_or(|e| e.at < sample.at) {
                    earlier = Some(sample);
                }
            }
            let line = self.line(in_rate, out_rate, sample);
            let mut stderr = std::io::stderr().lock();
            if stderr.write_all(line.as_bytes()).is_ok() && stderr.flush().is_ok() {
                SHOWN.store(true, Ordering::Relaxed);
            }
        }
    }

    fn line(&self, in_rate: f64, out_rate: Option<f64>, outbox: Option<OutboxSample>) -> String {
        let out = out_rate.map_or_else(|| "-".to_owned(), compact);
        let pending = outbox.map_or_else(
            || "-".to_owned(),
            |o| {
                let rows = compact(o.pending_rows as f64);
                format!("{} batches / {rows} rows", o.pending_batches)
            },
        );
        let lags: Vec<u64> = (0..self.partitions)
            .filter_map(|p| self.control.source_lag(p))
            .collect();
        let lag = if lags.is_empty() {
            "-".to_owned()
        } else {
            compact(lags.iter().sum::<u64>() as f64)
        };
        let line = format!(
            "{}: in {} msg/s | out {out} rows/s | pending {pending} | lag {lag}",
            self.pipeline,
            compact(in_rate)
        );
        format!("{}{line}", String::from_utf8_lossy(ERASE_LINE))
    }
}

/// `950`, `12.3k`, `4.1M`: short enough for one terminal line.
fn compact(value: f64) -> String {
    match value {
        v if v >= 1e6 => format!("{:.1}M", v / 1e6),
        v if v >= 1e4 => format!("{:.1}k", v / 1e3),
        v => format!("{v:.0}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn out_rate_is_what_was_sealed_less_what_the_outbox_grew_by_per_second() {
        let at = Instant::now();
        let earlier = OutboxSample {
            at,
            pending_batches: 1,
            pending_rows: 100,
            rows_sealed: 1_000,
        };
        let later = OutboxSample {
            at: at + Duration::from_secs(2),
            pending_batches: 3,
            pending_rows: 300,
            rows_sealed: 3_000,
        };
        // 2 000 sealed, the outbox grew by 200: 1 800 delivered in 2 s.
        assert_eq!(later.out_rate(&earlier), 900.0);
        assert_eq!(
            (compact(950.4), compact(12_345.0), compact(4_100_000.0)),
            ("950".to_owned(), "12.3k".to_owned(), "4.1M".to_owned())
        );
    }
}
