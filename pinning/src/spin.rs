//! The lock of a mapping's pin state, of the kernel table's slots and of the budget's
//! departed counts: taken by any thread, almost always uncontended. Exported
//! ([`crate::sync::SpinLock`]) for locks of the same kind outside the engine. A lock that one
//! thread takes nearly always is a [`crate::sync::BiasedLock`] instead (a shard's, a device
//! worker's request lane).
//!
//! Taking it is one atomic swap; giving it back is a plain release store, where a futex
//! mutex spends a second atomic read-modify-write to learn whether to wake a waiter. What
//! that buys: about 1-2 ns per take and give, 3-5% of a one-page pin+drop or translation
//! (std's `Mutex` in its place, alternating: docs/benchmarks.md). The price is that
//! waiters cannot sleep on it: they spin a little, then yield, then nap briefly. That suits
//! a mapping's pin state: held for a count update, or in lock mode for the mlock or munlock
//! of a call's fresh pages, which a waiter would otherwise sleep through in a futex for
//! about as long.
//!
//! A holder that panics gives the lock back as it unwinds; there is no poisoning (see
//! [`crate::sync`]: every shard's state stays consistent between its stores).

use std::cell::UnsafeCell;
use std::marker::PhantomData;
use std::ops::{Deref, DerefMut};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

/// A lock around a `T`, as described in the module documentation.
#[derive(Default)]
pub struct SpinLock<T> {
    locked: AtomicBool,
    value: UnsafeCell<T>,
}

// SAFETY: (I11) the value is reached only through a guard, and one guard exists at a time (the
// swap in `lock`/`try_lock` hands out the lock once until the guard's store gives it back),
// so sharing the lock shares exclusive access to a `T` that may move between threads.
unsafe impl<T: Send> Sync for SpinLock<T> {}

/// Exclusive access to a [`SpinLock`]'s value until dropped.
#[must_use = "the lock is given back when the guard drops"]
pub struct SpinGuard<'a, T> {
    lock: &'a SpinLock<T>,
    /// Held on the thread that took it, like a mutex guard.
    _not_send: PhantomData<*mut ()>,
}

/// Spins before a waiter starts yielding its CPU, and yields before it starts napping.
const SPINS: u32 = 64;
const YIELDS: u32 = 64;
const NAP: Duration = Duration::from_micros(20);

impl<T> SpinLock<T> {
    /// An unlocked lock around `value`.
    pub fn new(value: T) -> Self {
        SpinLock { locked: AtomicBool::new(false), value: UnsafeCell::new(value) }
    }

    /// Takes the lock, waiting for its holder if it has one.
    #[inline]
    pub fn lock(&self) -> SpinGuard<'_, T> {
        if self.locked.swap(true, Ordering::Acquire) {
            self.lock_contended();
        }
        SpinGuard { lock: self, _not_send: PhantomData }
    }

    #[cold]
    #[inline(never)]
    fn lock_contended(&self) {
        let mut tries = 0u32;
        loop {
            // Watch with loads (the line stays shared) and swap only once it looks free.
            while self.locked.load(Ordering::Relaxed) {
                if tries < SPINS {
                    std::hint::spin_loop();
                } else if tries < SPINS + YIELDS {
                    std::thread::yield_now();
                } else {
                    std::thread::sleep(NAP);
                }
                tries = tries.saturating_add(1);
            }
            if !self.locked.swap(true, Ordering::Acquire) {
                return;
            }
        }
    }

    /// The value, through exclusive access to the lock itself.
    pub(crate) fn get_mut(&mut self) -> &mut T {
        self.value.get_mut()
    }
}

impl<T> std::fmt::Debug for SpinLock<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SpinLock")
            .field("locked", &self.locked.load(Ordering::Relaxed))
            .finish_non_exhaustive()
    }
}

impl<T> Deref for SpinGuard<'_, T> {
    type Target = T;
    #[inline]
    fn deref(&self) -> &T {
        // SAFETY: (I11) this guard holds the lock: no other reference to the value exists.
        unsafe { &*self.lock.value.get() }
    }
}

impl<T> DerefMut for SpinGuard<'_, T> {
    #[inline]
    fn deref_mut(&mut self) -> &mut T {
        // SAFETY: (I11) as in `deref`, and `&mut self` makes this the only borrow of the guard.
        unsafe { &mut *self.lock.value.get() }
    }
}

impl<T> Drop for SpinGuard<'_, T> {
    #[inline]
    fn drop(&mut self) {
        // Release: everything done under the lock happens before the next holder's swap.
        self.lock.locked.store(false, Ordering::Release);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn one_holder_at_a_time_across_more_threads_than_cpus() {
        // Non-atomic read-modify-writes under the lock: any overlap of two holders loses one.
        // Fewer under Miri, which checks every access of each round.
        const ROUNDS: u64 = if cfg!(miri) { 200 } else { 20_000 };
        let lock = Arc::new(SpinLock::<u64>::default());
        let threads: Vec<_> = (0..8)
            .map(|_| {
                let lock = Arc::clone(&lock);
                std::thread::spawn(move || {
                    for _ in 0..ROUNDS {
                        let mut guard = lock.lock();
                        let seen = *guard;
                        std::hint::black_box(&mut *guard);
                        *guard = seen + 1;
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().expect("no panic");
        }
        assert_eq!(*lock.lock(), 8 * ROUNDS);
    }

    #[test]
    fn a_panicking_holder_lets_go() {
        let lock = Arc::new(SpinLock::<u32>::default());
        let held = Arc::clone(&lock);
        let died = std::thread::spawn(move || {
            let _guard = held.lock();
            panic!("holder dies");
        })
        .join();
        assert!(died.is_err());
        *lock.lock() += 1;
        assert_eq!(*lock.lock(), 1);
    }
}
