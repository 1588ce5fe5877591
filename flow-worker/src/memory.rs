//! The worker's allocator (jemalloc): how fast it gives freed memory back, and what it holds.
//!
//! A worker allocates and frees multi-MiB buffers for every batch. With jemalloc's defaults a
//! freed page stays resident for about ten seconds (`dirty_decay_ms`), and only an allocation
//! call ages it, so one slow insert that makes batches wait lifts resident memory by the whole
//! burst for tens of seconds: in a 3-minute endless run resident memory stepped from 110 to
//! 203 MiB and back. Pages freed here go back within a fifth of a second, purged by jemalloc's
//! own background thread rather than by whichever tokio task allocates next. At full speed the
//! payloads freed in the last second are tens of MiB: with a one-second decay the sharded class
//! peaked at 259-263 MiB over 8 M rows, with 200 ms at 217-245 MiB, and with an immediate purge
//! (0, done by the freeing thread) at 237-242 MiB for more CPU (docs/performance.md).

use std::time::Duration;

use tikv_jemalloc_ctl::{background_thread, epoch, stats, Access, AsName};
use tracing::{info, warn};

/// How long freed (dirty) pages stay resident before they are purged.
const DIRTY_DECAY_MS: isize = 200;
/// How often the allocator's figures are logged.
const REPORT_EVERY: Duration = Duration::from_secs(60);

/// Applies the decay settings to every arena (the ones that exist and those created later) and
/// starts jemalloc's background purging thread. Called before the runtime's threads exist.
pub fn configure_allocator() {
    let settings: [(&[u8], isize); 4] = [
        (b"arenas.dirty_decay_ms\0", DIRTY_DECAY_MS),
        (b"arenas.muzzy_decay_ms\0", 0),
        (b"arena.0.dirty_decay_ms\0", DIRTY_DECAY_MS),
        (b"arena.0.muzzy_decay_ms\0", 0),
    ];
    for (name, value) in settings {
        if let Err(err) = name.name().write(value) {
            warn!(setting = %String::from_utf8_lossy(&name[..name.len() - 1]), error = %err, "cannot tune the allocator; freed memory may stay resident longer");
        }
    }
    if let Err(err) = background_thread::write(true) {
        warn!(error = %err, "cannot start jemalloc's background purging thread; freed memory may stay resident longer");
    }
}

/// What the allocator holds now, in bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AllocatorFigures {
    /// Bytes the program has allocated and not freed.
    pub allocated: usize,
    /// Bytes of the pages those allocations occupy.
    pub active: usize,
    /// Bytes physically resident in the allocator's mappings (its share of RSS).
    pub resident: usize,
}

/// The allocator's current figures (refreshing its cached statistics first).
pub fn allocator_figures() -> Result<AllocatorFigures, tikv_jemalloc_ctl::Error> {
    epoch::advance()?;
    Ok(AllocatorFigures {
        allocated: stats::allocated::read()?,
        active: stats::active::read()?,
        resident: stats::resident::read()?,
    })
}

/// Logs the allocator's figures once a minute (`memory`, in MiB), so that a growth of live data
/// can be told apart from memory the allocator keeps.
pub async fn report_memory() {
    let mut ticks = tokio::time::interval(REPORT_EVERY);
    ticks.tick().await;
    loop {
        ticks.tick().await;
        match allocator_figures() {
            Ok(figures) => info!(
                allocated_mib = mib(figures.allocated),
                active_mib = mib(figures.active),
                resident_mib = mib(figures.resident),
                "memory"
            ),
            Err(err) => {
                warn!(error = %err, "cannot read the allocator's statistics; no more memory reports");
                return;
            }
        }
    }
}

fn mib(bytes: usize) -> f64 {
    (bytes as f64 / 1_048_576.0 * 10.0).round() / 10.0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_live_allocation_shows_in_the_allocated_bytes() {
        configure_allocator();
        let before = allocator_figures().map_or(0, |f| f.allocated);
        let held = vec![1u8; 8 << 20];
        let during = allocator_figures().map_or(0, |f| f.allocated);
        assert!(
            during >= before + (8 << 20) - (1 << 20),
            "{before} -> {during}"
        );
        drop(held);
    }

    #[test]
    fn the_decay_settings_are_in_force_for_new_arenas() {
        configure_allocator();
        let dirty: isize = b"arenas.dirty_decay_ms\0".name().read().unwrap_or(-2);
        let muzzy: isize = b"arenas.muzzy_decay_ms\0".name().read().unwrap_or(-2);
        assert_eq!((dirty, muzzy), (DIRTY_DECAY_MS, 0));
    }
}
