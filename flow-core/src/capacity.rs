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

/// Remembers the capacity of a reused buffer at the time all of it was last written.
///
/// A buffer grown by doubling holds up to half of its capacity in pages nobody has written yet,
/// which are not resident. Later epochs that happen to be a little larger fault them in one by
/// one, so resident memory creeps up for minutes although nothing more is allocated: in a
/// 10-minute endless run the allocator's live bytes stayed at 166-178 MiB from the first minute
/// while resident memory rose from 103 to 147 MiB, which looks like a leak and makes a memory
/// limit bite long after the start. So a buffer whose capacity changed is first trimmed to what
/// it held plus an eighth (doubling would otherwise leave up to half of it idle, and writing that
/// half raised the full-speed peak from 220 to 275 MiB), then written over once while empty: its
/// pages are resident from the epoch that grew it, and only as many as it uses.
#[derive(Clone, Copy, Debug, Default)]
pub struct FaultedIn {
    capacity: usize,
}

impl FaultedIn {
    /// Empties `buffer` for its next use. When its capacity changed since the last call, it is
    /// first trimmed to its length plus an eighth, then `fill` is written over all of it. Costs
    /// one pass over the buffer per growth or shrink, nothing otherwise.
    pub fn settle<T: Copy>(&mut self, buffer: &mut Vec<T>, fill: T) {
        if buffer.capacity() == self.capacity {
            buffer.clear();
            return;
        }
        let fitted = buffer.len() + buffer.len() / 8;
        buffer.shrink_to(fitted);
        buffer.clear();
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
        faulted.settle(&mut buffer, 7);
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
        faulted.settle(&mut buffer, 7);
        assert_eq!((buffer.len(), buffer.capacity()), (0, kept));
        // Grown past it: trimmed again.
        buffer.extend_from_slice(&[1; 3000]);
        faulted.settle(&mut buffer, 7);
        assert!(
            (3000..6000).contains(&buffer.capacity()),
            "{}",
            buffer.capacity()
        );
        assert_eq!((buffer.len(), faulted.capacity), (0, buffer.capacity()));
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
}
