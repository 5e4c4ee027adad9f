//! Counters of calls and syscalls.

use std::sync::atomic::AtomicU64;

/// Counters of lock-mode calls whose first run lies in one mapping, and of its syscalls.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct LockCounts {
    pub(crate) pin_calls: u64,
    pub(crate) unpin_calls: u64,
    pub(crate) runs: u64,
    pub(crate) pages: u64,
    pub(crate) mlock_calls: u64,
    pub(crate) munlock_calls: u64,
    pub(crate) munlock_failures: u64,
}

/// Counters of one space, bumped once per call or syscall, never per page.
#[derive(Debug, Default)]
pub(crate) struct Counters {
    pub(crate) pin_calls: AtomicU64,
    pub(crate) pin_failures: AtomicU64,
    pub(crate) unpin_calls: AtomicU64,
    pub(crate) unpin_failures: AtomicU64,
    pub(crate) runs: AtomicU64,
    pub(crate) pages: AtomicU64,
    pub(crate) mlock_calls: AtomicU64,
    pub(crate) munlock_calls: AtomicU64,
    pub(crate) munlock_failures: AtomicU64,
    pub(crate) unmap_waits: AtomicU64,
    pub(crate) unmap_busy: AtomicU64,
    pub(crate) notifier_calls: AtomicU64,
}
