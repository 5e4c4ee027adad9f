//! A global allocator that counts the allocations of every thread but the test's own: in a
//! test binary whose server runs in-process, those of the server (its acceptor, connection
//! thread and device workers). Included by the allocation tests with `#[path]`, each a binary
//! of its own without libtest's harness (Cargo.toml), so that no other test's thread and no
//! thread of the runner allocates meanwhile.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::sync::atomic::{AtomicU64, Ordering};

/// Allocations (and reallocations) made by threads other than the test's.
static SERVER_ALLOCATIONS: AtomicU64 = AtomicU64::new(0);

thread_local! {
    /// Set on the test's thread, whose driver builds commands as it likes.
    pub static TEST_THREAD: Cell<bool> = const { Cell::new(false) };
}

struct Counting;

fn count() {
    // `try_with`: a thread being torn down has no thread-locals left, and is not the test's.
    if !TEST_THREAD.try_with(Cell::get).unwrap_or(false) {
        SERVER_ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
    }
}

// SAFETY: every call is passed to `System` unchanged, which upholds `GlobalAlloc`'s contract;
// counting touches no memory the allocator hands out.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        count();
        // SAFETY: the caller's guarantees for `alloc`, passed on.
        unsafe { System.alloc(layout) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        count();
        // SAFETY: as for `alloc`.
        unsafe { System.alloc_zeroed(layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        count();
        // SAFETY: `ptr` came from this allocator, that is from `System`, with `layout`.
        unsafe { System.realloc(ptr, layout, new_size) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: as for `realloc`.
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

/// The allocations the server's threads make while `f` runs.
pub fn server_allocations_during(f: impl FnOnce()) -> u64 {
    let before = SERVER_ALLOCATIONS.load(Ordering::Relaxed);
    f();
    SERVER_ALLOCATIONS.load(Ordering::Relaxed) - before
}
