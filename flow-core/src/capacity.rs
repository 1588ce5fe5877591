//! How reused buffers size themselves: room for an epoch at its bound ([`Headroom`]), pages
//! written once ([`FaultedIn`]), and a burst's capacity given back ([`CapacityDecay`]).
//!
//! Epoch and encode buffers are cleared and reused. Trimmed to what each epoch used, a buffer
//! grows a little whenever an epoch is larger than every one before it; below full speed (epochs
//! cut by time, and larger after each stall) that happens for minutes, and resident memory climbs
//! with it: 98 MiB in the first minute and 119 MiB after six in a 10-minute run at half speed. So
//! a buffer is sized for what an epoch at its bound (`epoch.max_messages`, `max_rows_per_batch`)
//! would put in it, scaled from its use and at most twice that: the footprint is reached in the
//! first epochs and stays, and a memory limit that is too small bites at start, not hours later.
//! A buffer that needed less than half of its capacity for [`SHRINK_AFTER_USES`] uses in a row
//! shrinks, so a long quiet spell gives memory back.

/// Uses in a row below half the capacity before a buffer shrinks.
pub const SHRINK_AFTER_USES: u8 = 8;

/// Capacity (bytes) a buffer keeps whatever its use: below it shrinking is not worth a
/// reallocation.
pub const MIN_RETAINED_BYTES: usize = 256 * 1024;

/// How much room a reused buffer keeps beyond its last use: what an epoch at its bound would
/// need, scaled from this one, at least an eighth more than the use and at most twice it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Headroom {
    scale: f64,
}

impl Headroom {
    /// No room beyond the use and an eighth (no bound known).
    pub const NONE: Headroom = Headroom { scale: 1.0 };

    /// The room for a use of `load` units (messages, rows) out of at most `bound`.
    pub fn for_load(load: usize, bound: Option<usize>) -> Headroom {
        match bound {
            Some(bound) if load > 0 && bound > load => Headroom {
                scale: (bound as f64 / load as f64).min(2.0),
            },
            _ => Headroom::NONE,
        }
    }

    /// The smaller room of two bounds that both hold.
    pub fn min(self, other: Headroom) -> Headroom {
        Headroom {
            scale: self.scale.min(other.scale),
        }
    }

    /// Gives `buffer` the capacity its length needs with this room, growing or shrinking it.
    pub fn fit<T>(self, buffer: &mut Vec<T>) {
        let target = self.target(buffer.len());
        if target > buffer.capacity() {
            buffer.reserve_exact(target - buffer.len());
        } else {
            buffer.shrink_to(target);
        }
    }

    /// Empties `buffer` and gives it the capacity its length needed with this room. Growing takes
    /// a fresh allocation: a reallocation would copy contents about to be dropped.
    pub fn fit_cleared<T>(self, buffer: &mut Vec<T>) {
        let target = self.target(buffer.len());
        buffer.clear();
        if target > buffer.capacity() {
            *buffer = Vec::with_capacity(target);
        } else {
            buffer.shrink_to(target);
        }
    }

    /// The capacity a buffer that held `len` elements should keep.
    pub fn target(self, len: usize) -> usize {
        let scaled = (len as f64 * self.scale) as usize;
        scaled.max(len + len / 8)
    }
}

/// Units (messages, rows) a growing buffer takes before its room for the rest is projected from
/// their size ([`reserve_projected`]).
pub const PROJECT_AFTER: usize = 1024;

/// Gives `buffer`, which holds what `so_far` units put in it, room for `expected` units (at most
/// `cap` elements) and an eighth more, unless it has that room. Grown by doubling instead, a
/// buffer's first epoch copied it over and over (9 % of a worker's CPU in a 2 M-row run). The
/// room is only reserved, so pages nobody writes stay out of resident memory, and a refused
/// reservation (an `expected` that could never be filled) leaves the buffer to grow step by step.
pub fn reserve_projected<T>(buffer: &mut Vec<T>, so_far: usize, expected: usize, cap: usize) {
    if so_far == 0 {
        return;
    }
    let projected = buffer.len().saturating_mul(expected) / so_far;
    let room = Headroom::NONE.target(projected.min(cap));
    if room > buffer.capacity() {
        let _ = buffer.try_reserve_exact(room - buffer.len());
    }
}

/// Tracks how long a reused buffer has been oversized.
#[derive(Clone, Copy, Debug, Default)]
pub struct CapacityDecay {
    quiet: u8,
}

impl CapacityDecay {
    /// Records one use that needs `needed` bytes (its use with its [`Headroom`]) out of
    /// `capacity`; `true` when the buffer should now shrink to what it needs.
    pub fn should_shrink(&mut self, needed: usize, capacity: usize) -> bool {
        if capacity <= MIN_RETAINED_BYTES || needed.saturating_mul(2) >= capacity {
            self.quiet = 0;
            return false;
        }
        self.quiet += 1;
        if self.quiet < SHRINK_AFTER_USES {
            return false;
        }
        self.quiet = 0;
        true
    }
}

/// Remembers the capacity of a reused buffer at the time all of it was last written.
///
/// A buffer grown by doubling holds up to half of its capacity in pages nobody has written yet,
/// which are not resident. Later epochs that happen to be a little larger fault them in one by
/// one, so resident memory creeps up for minutes although nothing more is allocated: in a
/// 10-minute endless run the allocator's live bytes stayed at 166-178 MiB from the first minute
/// while resident memory rose from 103 to 147 MiB, which looks like a leak and makes a memory
/// limit bite long after the start. So a buffer whose capacity changed is first sized to its
/// [`Headroom`] (doubling would otherwise leave up to half of it idle at full speed, and writing
/// that half raised the full-speed peak from 220 to 275 MiB), then written over once while empty:
/// its pages are resident from the epoch that sized it, and only as many as it keeps.
#[derive(Clone, Copy, Debug, Default)]
pub struct FaultedIn {
    capacity: usize,
}

impl FaultedIn {
    /// Empties `buffer` for its next use. When its capacity changed since the last call, it is
    /// first sized to `headroom` of its length, then `fill` is written over all of it. Costs
    /// one pass over the buffer per change of size, nothing otherwise.
    pub fn settle<T: Copy>(&mut self, buffer: &mut Vec<T>, fill: T, headroom: Headroom) {
        if buffer.capacity() == self.capacity {
            buffer.clear();
            return;
        }
        headroom.fit_cleared(buffer);
        buffer.resize(buffer.capacity(), fill);
        buffer.clear();
        self.capacity = buffer.capacity();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_grown_buffer_is_trimmed_to_its_use_plus_an_eighth_written_once_and_left_empty() {
        let mut buffer: Vec<u8> = Vec::with_capacity(4096);
        buffer.extend_from_slice(&[1; 800]);
        let mut faulted = FaultedIn::default();
        faulted.settle(&mut buffer, 7, Headroom::NONE);
        assert!(buffer.is_empty());
        assert!(
            (900..4096).contains(&buffer.capacity()),
            "{}",
            buffer.capacity()
        );
        assert_eq!(faulted.capacity, buffer.capacity());
        // The same capacity again: only emptied.
        let kept = buffer.capacity();
        buffer.extend_from_slice(&[1; 850]);
        faulted.settle(&mut buffer, 7, Headroom::NONE);
        assert_eq!((buffer.len(), buffer.capacity()), (0, kept));
        // Grown past it: trimmed again.
        buffer.extend_from_slice(&[1; 3000]);
        faulted.settle(&mut buffer, 7, Headroom::NONE);
        assert!(
            (3000..6000).contains(&buffer.capacity()),
            "{}",
            buffer.capacity()
        );
        assert_eq!((buffer.len(), faulted.capacity), (0, buffer.capacity()));
    }

    #[test]
    fn headroom_scales_a_use_to_its_bound_between_an_eighth_and_twice() {
        // Half of the bound: room for the bound.
        assert_eq!(Headroom::for_load(50, Some(100)).target(4000), 8000);
        // A tenth of it: twice the use at most.
        assert_eq!(Headroom::for_load(10, Some(100)).target(4000), 8000);
        // Near or at the bound, or no bound: an eighth more.
        assert_eq!(Headroom::for_load(95, Some(100)).target(4000), 4500);
        assert_eq!(Headroom::for_load(100, Some(100)).target(4000), 4500);
        assert_eq!(Headroom::for_load(300, Some(100)).target(4000), 4500);
        assert_eq!(Headroom::for_load(50, None).target(4000), 4500);
        assert_eq!(Headroom::for_load(0, Some(100)).target(0), 0);
        // The tighter of two bounds.
        let both = Headroom::for_load(50, Some(100)).min(Headroom::for_load(80, Some(100)));
        assert_eq!(both.target(4000), 5000);
    }

    #[test]
    fn a_buffer_that_grew_is_sized_for_its_bound_at_once_and_kept_there() {
        let mut buffer: Vec<u8> = Vec::new();
        let mut faulted = FaultedIn::default();
        let mut decay = CapacityDecay::default();
        // An epoch of half the bound: room for the bound right away.
        buffer.extend_from_slice(&[1; 500_000]);
        let headroom = Headroom::for_load(500, Some(1000));
        faulted.settle(&mut buffer, 0, headroom);
        assert_eq!((buffer.len(), buffer.capacity()), (0, 1_000_000));
        // Epochs between half and all of the bound neither grow nor shrink it.
        for load in [500, 1000, 620, 500, 999] {
            buffer.extend(std::iter::repeat_n(2, load * 1000));
            let headroom = Headroom::for_load(load, Some(1000));
            assert!(!decay.should_shrink(headroom.target(buffer.len()), buffer.capacity()));
            faulted.settle(&mut buffer, 0, headroom);
            assert_eq!((buffer.len(), buffer.capacity()), (0, 1_000_000));
        }
    }

    #[test]
    fn a_buffer_shrinks_only_after_enough_uses_in_a_row_below_half_its_capacity() {
        let mut decay = CapacityDecay::default();
        let cap = 4 * MIN_RETAINED_BYTES;
        for _ in 0..SHRINK_AFTER_USES - 1 {
            assert!(!decay.should_shrink(cap / 4, cap));
        }
        // One busy use starts the count again.
        assert!(!decay.should_shrink(cap / 2, cap));
        for _ in 0..SHRINK_AFTER_USES - 1 {
            assert!(!decay.should_shrink(cap / 4, cap));
        }
        assert!(decay.should_shrink(cap / 4, cap));
        // Small buffers are kept whatever their use.
        for _ in 0..2 * SHRINK_AFTER_USES {
            assert!(!decay.should_shrink(0, MIN_RETAINED_BYTES));
        }
    }

    #[test]
    fn fitting_a_cleared_buffer_grows_into_a_fresh_allocation_and_shrinks_in_place() {
        // 1000 used in a 1000-capacity buffer: it needs 1125, so it gets a new allocation of
        // exactly that and is left empty.
        let mut buffer: Vec<u8> = Vec::with_capacity(1000);
        buffer.resize(1000, 1);
        Headroom::NONE.fit_cleared(&mut buffer);
        assert_eq!((buffer.len(), buffer.capacity()), (0, 1125));
        // 100 used out of 1125: shrunk to 112, and empty.
        buffer.resize(100, 1);
        Headroom::NONE.fit_cleared(&mut buffer);
        assert_eq!((buffer.len(), buffer.capacity()), (0, 112));
    }

    #[test]
    fn a_projection_reserves_once_within_its_cap_and_nothing_without_units() {
        // 100 bytes for 4 units, 40 expected: 1000, and an eighth more.
        let mut buffer: Vec<u8> = vec![1; 100];
        reserve_projected(&mut buffer, 4, 40, usize::MAX);
        assert_eq!(buffer.capacity(), 1125);
        let at = buffer.as_ptr();
        reserve_projected(&mut buffer, 4, 40, usize::MAX);
        assert_eq!(buffer.as_ptr(), at, "the room is there already");
        let mut capped: Vec<u8> = vec![1; 100];
        reserve_projected(&mut capped, 4, 40, 800);
        assert_eq!(capped.capacity(), 900);
        let mut empty: Vec<u8> = Vec::new();
        reserve_projected(&mut empty, 0, 40, usize::MAX);
        assert_eq!(empty.capacity(), 0);
    }
}
