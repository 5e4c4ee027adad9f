//! What a space counts: calls, runs, pages and syscalls (mlock's, and kernel mode's
//! registrations), never per page.
//!
//! One [`Counts`] lives wherever a lock is held anyway when the event happens, and `stats`
//! sums them: each shard's (track-mode calls and the space's other events, under the shard's
//! lock), each mapping's (lock-mode calls and their syscalls, under the mapping's lock), and
//! the space's for mappings that left its table (see `PinPolicy::departed`), and the kernel
//! table's (kernel-mode registrations, under its slot lock). No counter is an atomic shared
//! between threads.

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
    /// Kernel mode: registrations (one per pin call), clears (one per guard), buffers and
    /// pages registered, and runs cut into more than one buffer (longer than 1 GiB).
    pub(crate) kernel_pin_calls: u64,
    pub(crate) kernel_unpin_calls: u64,
    pub(crate) kernel_buffers: u64,
    pub(crate) kernel_pages: u64,
    pub(crate) kernel_cut_runs: u64,
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
        self.kernel_pin_calls += other.kernel_pin_calls;
        self.kernel_unpin_calls += other.kernel_unpin_calls;
        self.kernel_buffers += other.kernel_buffers;
        self.kernel_pages += other.kernel_pages;
        self.kernel_cut_runs += other.kernel_cut_runs;
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
            kernel_pin_calls: 13,
            kernel_unpin_calls: 14,
            kernel_buffers: 15,
            kernel_pages: 16,
            kernel_cut_runs: 17,
        };
        let mut sum = one;
        sum += &one;
        assert_eq!(sum.pin_calls + sum.notifier_calls + sum.kernel_cut_runs, 60);
        assert_eq!(sum, Counts { runs: 10, ..sum });
        let mut total = Counts::default();
        total.pinned(3, 7);
        assert_eq!((total.pin_calls, total.runs, total.pages), (1, 3, 7));
    }
}
