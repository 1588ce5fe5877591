//! [`ByteBudget`]: the payload bytes a sink may hold in memory for delivery, across its
//! partitions.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// Bytes of payload a sink may hold in memory for delivery, across its partitions.
pub struct ByteBudget {
    semaphore: Arc<Semaphore>,
    limit: AtomicU64,
    /// Permits still to take out of circulation after the limit shrank while they were in use.
    debt: AtomicU64,
}

/// A share of a [`ByteBudget`], returned when dropped.
pub struct BudgetPermit {
    permit: Option<OwnedSemaphorePermit>,
    budget: Arc<ByteBudget>,
}

/// The largest budget (tokio counts a single acquisition in `u32` permits).
pub const MAX_BYTE_BUDGET: u64 = u32::MAX as u64;

impl ByteBudget {
    /// A budget of `limit` bytes, clamped to 1..=[`MAX_BYTE_BUDGET`].
    pub fn new(limit: u64) -> Arc<ByteBudget> {
        let limit = limit.clamp(1, MAX_BYTE_BUDGET);
        Arc::new(ByteBudget {
            semaphore: Arc::new(Semaphore::new(limit as usize)),
            limit: AtomicU64::new(limit),
            debt: AtomicU64::new(0),
        })
    }

    /// The budget in bytes.
    pub fn limit(&self) -> u64 {
        self.limit.load(Ordering::Relaxed)
    }

    /// Changes the limit (a reload); a smaller limit takes effect as batches in flight finish.
    pub fn resize(&self, limit: u64) {
        let limit = limit.clamp(1, MAX_BYTE_BUDGET);
        let old = self.limit.swap(limit, Ordering::Relaxed);
        if limit > old {
            let mut grow = limit - old;
            let paid = self.take_debt(grow);
            grow -= paid;
            self.semaphore.add_permits(grow as usize);
        } else if limit < old {
            let shrink = (old - limit) as usize;
            let forgotten = self.semaphore.forget_permits(shrink);
            self.debt
                .fetch_add((shrink - forgotten) as u64, Ordering::Relaxed);
        }
    }

    fn take_debt(&self, at_most: u64) -> u64 {
        let mut taken = 0;
        let _ = self
            .debt
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |debt| {
                taken = debt.min(at_most);
                Some(debt - taken)
            });
        taken
    }

    /// Waits for room for `bytes` (at most the whole budget, so a batch larger than the limit
    /// still goes, alone).
    pub async fn acquire(self: &Arc<Self>, bytes: usize) -> BudgetPermit {
        let wanted = (bytes as u64).clamp(1, self.limit()) as u32;
        let permit = Arc::clone(&self.semaphore)
            .acquire_many_owned(wanted)
            .await
            .ok();
        BudgetPermit {
            permit,
            budget: Arc::clone(self),
        }
    }
}

#[cfg(test)]
impl ByteBudget {
    /// The permits free now, for the tests of what holds them.
    pub(super) fn available_permits(&self) -> usize {
        self.semaphore.available_permits()
    }
}

impl Drop for BudgetPermit {
    fn drop(&mut self) {
        let Some(mut permit) = self.permit.take() else {
            return;
        };
        let owed = self.budget.take_debt(permit.num_permits() as u64);
        if owed > 0 {
            if let Some(part) = permit.split(owed as usize) {
                part.forget();
            }
        }
    }
}
