//! A space's pin budget: how its mappings pin, and how many pins it may hold.
//!
//! `max_pins` bounds what a device driven by a client can hold. The count of pins held (plus
//! reserved) is one atomic, so that every call does not touch it: track-mode calls reserve
//! from their shard's stock and lock-mode calls from their first mapping's, each refilled
//! [`PIN_STOCK`] pins at a time.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use crossbeam_utils::CachePadded;

use crate::account::{LockAccount, PinMode};
use crate::counters::Counts;
use crate::kernel::{KernelPinsUnavailable, KernelTable};
use crate::spin::SpinLock;
use crate::sync::AtomicUpdate;

/// How the mappings of one space pin, and what they may hold: shared by all of them.
#[derive(Debug)]
pub(crate) struct PinPolicy {
    pub(crate) mode: PinMode,
    /// The locked-memory budget lock-mode pins are charged to.
    pub(crate) account: Arc<LockAccount>,
    /// Pins held across the space plus the unused stock of its shards (track mode) and of
    /// its mappings (lock mode), against `max_pins`.
    held: CachePadded<AtomicU64>,
    pub(crate) max_pins: u64,
    /// Mappings that have left the table (moving their counts to `departed`). `stats` sums
    /// the counts without holding the table, and sums again if this changed meanwhile (I9).
    pub(crate) departures: AtomicU64,
    /// Counts of mappings that left the table, including what their guards counted there
    /// afterwards (added as the mapping is dropped). A leaf lock: nothing else is taken
    /// while it is held.
    pub(crate) departed: SpinLock<Counts>,
    /// Kernel mode: the space's ring and table of registered buffers, or why there is none
    /// (then every pin fails with that). Kept here, with the mappings' shared state, so that
    /// a guard or a mapping that outlives the space's handles still reaches it.
    kernel: Option<Result<KernelTable, KernelPinsUnavailable>>,
}

/// Pins a shard (track mode) or a mapping (lock mode) reserves from the space's count at a time.
pub(crate) const PIN_STOCK: u64 = 4096;

impl PinPolicy {
    /// The policy of a space in `mode`; in kernel mode with a table of `kernel_buffers`
    /// slots, or the reason io_uring could not give one.
    pub(crate) fn new(mode: PinMode, account: Arc<LockAccount>, max_pins: u64, kernel_buffers: u32) -> Self {
        let kernel = (mode == PinMode::Kernel).then(|| KernelTable::new(kernel_buffers));
        PinPolicy {
            mode,
            account,
            held: CachePadded::default(),
            max_pins,
            departures: AtomicU64::new(0),
            departed: SpinLock::default(),
            kernel,
        }
    }

    /// The kernel table (kernel mode), or why there is none. `None` in the other modes.
    #[inline]
    pub(crate) fn kernel(&self) -> Option<Result<&KernelTable, &KernelPinsUnavailable>> {
        self.kernel.as_ref().map(Result::as_ref)
    }

    /// The kernel table of a space whose pins hold kernel buffers (there is one: they were
    /// registered in it).
    #[inline]
    pub(crate) fn kernel_table(&self) -> &KernelTable {
        match self.kernel() {
            Some(Ok(table)) => table,
            _ => unreachable!("kernel buffers are only registered in a kernel-mode space's table"),
        }
    }

    /// Takes `pins` from the space's count; `Err(held)` if they do not fit.
    pub(crate) fn take(&self, pins: u64) -> Result<(), u64> {
        self.held
            .update_with(Ordering::AcqRel, Ordering::Acquire, |held| {
                held.checked_add(pins).filter(|&total| total <= self.max_pins)
            })
            .map(drop)
    }

    /// Gives `pins` back to the space's count.
    pub(crate) fn give(&self, pins: u64) {
        if pins != 0 {
            let before = self.held.fetch_sub(pins, Ordering::AcqRel);
            debug_assert!(before >= pins, "gave back {pins} pins with {before} held");
        }
    }

    /// Adds a departed mapping's counts to the space's.
    pub(crate) fn add_departed(&self, counts: &Counts) {
        if *counts != Counts::default() {
            *self.departed.lock() += counts;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_count_never_passes_the_limit() {
        let policy = PinPolicy::new(PinMode::Track, Arc::new(LockAccount::unlimited()), 10, 0);
        policy.take(6).unwrap();
        assert_eq!(policy.take(5), Err(6));
        policy.take(4).unwrap();
        policy.give(10);
        assert_eq!(policy.take(u64::MAX), Err(0));
        policy.take(10).unwrap();
    }
}
