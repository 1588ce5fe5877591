//! Letting reused buffers give back what a burst made them grow to ([`CapacityDecay`]).
//!
//! Epoch and encode buffers are cleared and reused, so they keep the capacity of the largest
//! epoch they ever held: one catch-up burst after a stall would pin its memory for the rest of an
//! endless run. A buffer that has used less than half of its capacity for
//! [`SHRINK_AFTER_USES`] uses in a row shrinks to what it used last, so memory follows the recent
//! load at the cost of a few reallocations after each burst.

/// Uses in a row below half the capacity before a buffer shrinks.
pub const SHRINK_AFTER_USES: u8 = 8;

/// Capacity (bytes) a buffer keeps whatever its use: below it shrinking is not worth a
/// reallocation.
pub const MIN_RETAINED_BYTES: usize = 256 * 1024;

/// Tracks how long a reused buffer has been oversized.
#[derive(Clone, Copy, Debug, Default)]
pub struct CapacityDecay {
    quiet: u8,
}

impl CapacityDecay {
    /// Records one use of `used` bytes out of `capacity`; `true` when the buffer should now
    /// shrink to `used`.
    pub fn should_shrink(&mut self, used: usize, capacity: usize) -> bool {
        if capacity <= MIN_RETAINED_BYTES || used.saturating_mul(2) >= capacity {
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

#[cfg(test)]
mod tests {
    use super::*;

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
}
