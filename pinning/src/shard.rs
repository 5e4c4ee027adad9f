//! Per-thread slots: each thread takes a slot once (round robin), so that state every pin
//! call touches can be spread over cache lines, one per slot.

use std::sync::atomic::{AtomicUsize, Ordering};

use crossbeam::utils::CachePadded;

/// Slots per space: enough that the threads of a busy device rarely share one.
pub(crate) const SLOTS: usize = 16;

static NEXT_SLOT: AtomicUsize = AtomicUsize::new(0);

thread_local! {
    /// This thread's slot, `usize::MAX` until first asked (a const initialiser: reading it
    /// is a plain thread-local load).
    static SLOT: std::cell::Cell<usize> = const { std::cell::Cell::new(usize::MAX) };
}

/// This thread's slot.
#[inline]
pub(crate) fn this_slot() -> usize {
    SLOT.with(|s| {
        let slot = s.get();
        if slot != usize::MAX {
            return slot;
        }
        let slot = NEXT_SLOT.fetch_add(1, Ordering::Relaxed) % SLOTS;
        s.set(slot);
        slot
    })
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
