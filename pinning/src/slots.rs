//! Per-thread slots: state that every pin call updates, spread over cache lines so that
//! threads pinning at the same time do not pass one line back and forth. Each thread takes
//! a slot once (round robin); readers sum over all of them.

use std::sync::atomic::{AtomicUsize, Ordering};

use crossbeam::utils::CachePadded;

/// Slots per space: enough that the threads of a busy device rarely share one.
pub(crate) const SLOTS: usize = 16;

static NEXT_SLOT: AtomicUsize = AtomicUsize::new(0);

thread_local! {
    static SLOT: usize = NEXT_SLOT.fetch_add(1, Ordering::Relaxed) % SLOTS;
}

/// This thread's slot.
#[inline]
pub(crate) fn this_slot() -> usize {
    SLOT.with(|s| *s)
}

/// One `T` per slot, each on its own cache line.
#[derive(Debug, Default)]
pub(crate) struct PerSlot<T> {
    slots: [CachePadded<T>; SLOTS],
}

impl<T> PerSlot<T> {
    /// This thread's `T`.
    #[inline]
    pub(crate) fn here(&self) -> &T {
        &self.slots[this_slot()]
    }

    /// Every slot's `T`.
    pub(crate) fn all(&self) -> impl Iterator<Item = &T> {
        self.slots.iter().map(|s| &**s)
    }
}
