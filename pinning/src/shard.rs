//! Per-thread shards: each thread takes a shard once (round robin), so that state every pin
//! call touches can be spread over cache lines, one per shard.

use std::sync::atomic::{AtomicUsize, Ordering};

/// Shards per space: enough that the threads of a busy device rarely share one.
pub(crate) const SHARDS: usize = 16;

static NEXT_SHARD: AtomicUsize = AtomicUsize::new(0);

thread_local! {
    /// This thread's shard, `usize::MAX` until first asked (a const initialiser: reading it
    /// is a plain thread-local load).
    static SHARD: std::cell::Cell<usize> = const { std::cell::Cell::new(usize::MAX) };
}

/// This thread's shard.
#[inline]
pub(crate) fn this_shard() -> usize {
    SHARD.with(|s| {
        let shard = s.get();
        if shard != usize::MAX {
            return shard;
        }
        let shard = NEXT_SHARD.fetch_add(1, Ordering::Relaxed) % SHARDS;
        s.set(shard);
        shard
    })
}
