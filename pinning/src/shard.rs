//! Per-thread shards: each thread has a shard, so that state every pin call touches can be
//! spread over cache lines, one per shard. A thread's shard follows its biased-lock token
//! (`biased::token`): round robin as threads start, and a thread that starts after another
//! ended takes the ended one's token, so its shard, and the bias of that shard's lock in
//! every space.

/// Shards per space: enough that the threads of a busy device rarely share one.
pub(crate) const SHARDS: usize = 16;

/// This thread's shard.
#[inline]
pub(crate) fn this_shard() -> usize {
    (crate::biased::token() % SHARDS as u64) as usize
}
