//! What a space counts: calls, runs, pages and syscalls, never per page.
//!
//! One [`Counts`] lives wherever a lock is held anyway when the event happens, and `stats`
//! sums them: each shard's (track-mode calls and the space's other events, under the shard's
//! lock), each mapping's (lock-mode calls and their syscalls, under the mapping's lock), and
//! the space's for mappings that left its table (see `PinPolicy::departed`). Kernel mode's
//! kernel calls are counted by its table, under the table's lock (`kernel::KernelCounts`:
//! other events, and kept apart so that a shard's counts stay within its two cache lines).
//! No counter is an atomic shared between threads.

use std::ops::AddAssign;

/// Counts of a space's events, in plain integers under the lock of whoever holds them.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Counts {
    pub(crate) pin_calls: u64,
    pub(crate) pin_failures: u64,
    pub(crate) unpin_calls: u64,
    pub(crate) unpin_failures: u64,
    pub(crate) runs: u64,
    pub(crate) pages: u64,
    pub(crate) mlock_calls: u64,
    pub(crate) munlock_calls: u64,
    pub(crate) munlock_failures: u64,
    pub(crate) unmap_waits: u64,
    pub(crate) unmap_busy: u64,
    pub(crate) notifier_calls: u64,
}

impl AddAssign<&Counts> for Counts {
    fn add_assign(&mut self, other: &Counts) {
        self.pin_calls += other.pin_calls;
        self.pin_failures += other.pin_failures;
        self.unpin_calls += other.unpin_calls;
        self.unpin_failures += other.unpin_failures;
        self.runs += other.runs;
        self.pages += other.pages;
        self.mlock_calls += other.mlock_calls;
        self.munlock_calls += other.munlock_calls;
        self.munlock_failures += other.munlock_failures;
        self.unmap_waits += other.unmap_waits;
        self.unmap_busy += other.unmap_busy;
        self.notifier_calls += other.notifier_calls;
    }
}

impl Counts {
    /// A successful pin call of `runs` runs and `pages` pages.
    #[inline(always)]
    pub(crate) fn pinned(&mut self, runs: u64, pages: u64) {
        self.pin_calls += 1;
        self.runs += runs;
        self.pages += pages;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn adding_adds_every_field() {
        let one = Counts {
            pin_calls: 1,
            pin_failures: 2,
            unpin_calls: 3,
            unpin_failures: 4,
            runs: 5,
            pages: 6,
            mlock_calls: 7,
            munlock_calls: 8,
            munlock_failures: 9,
            unmap_waits: 10,
            unmap_busy: 11,
            notifier_calls: 12,
        };
        let mut sum = one;
        sum += &one;
        assert_eq!(sum.pin_calls + sum.notifier_calls, 26);
        assert_eq!(sum, Counts { runs: 10, ..sum });
        let mut total = Counts::default();
        total.pinned(3, 7);
        assert_eq!((total.pin_calls, total.runs, total.pages), (1, 3, 7));
    }
}
