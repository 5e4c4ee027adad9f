//! Poison-tolerant locking, the one way umdev takes a std lock (the engine's hot locks are
//! `spin`'s, which have no poisoning).
//!
//! Every lock in umdev guards state that stays consistent across a panic of a holder (plain
//! stores, counters, queues: no multi-step invariant is left half done), so a poisoned lock
//! is still the best record there is. These helpers take the guard either way instead of
//! spreading `.lock().unwrap_or_else(|p| p.into_inner())` through the code.

pub use crate::biased::{asymmetric_heavy_fence, asymmetric_light_fence, BiasedGuard, BiasedLock};
pub use crate::spin::{SpinGuard, SpinLock};

use std::sync::atomic::{AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Condvar, Mutex, MutexGuard, RwLock, RwLockReadGuard, RwLockWriteGuard, WaitTimeoutResult};
use std::time::Duration;

/// Locks `m`, poisoned or not.
pub fn lock<T: ?Sized>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Read-locks `l`, poisoned or not.
pub fn read<T: ?Sized>(l: &RwLock<T>) -> RwLockReadGuard<'_, T> {
    l.read().unwrap_or_else(|p| p.into_inner())
}

/// Write-locks `l`, poisoned or not.
pub fn write<T: ?Sized>(l: &RwLock<T>) -> RwLockWriteGuard<'_, T> {
    l.write().unwrap_or_else(|p| p.into_inner())
}

/// Waits on `cv` with `guard`, poisoned or not.
pub fn wait<'a, T>(cv: &Condvar, guard: MutexGuard<'a, T>) -> MutexGuard<'a, T> {
    cv.wait(guard).unwrap_or_else(|p| p.into_inner())
}

/// Waits on `cv` with `guard` for at most `timeout`, poisoned or not.
pub fn wait_timeout<'a, T>(
    cv: &Condvar,
    guard: MutexGuard<'a, T>,
    timeout: Duration,
) -> (MutexGuard<'a, T>, WaitTimeoutResult) {
    cv.wait_timeout(guard, timeout).unwrap_or_else(|p| p.into_inner())
}

/// Waits on `cv` while `condition` holds, for at most `timeout`, poisoned or not.
pub fn wait_timeout_while<'a, T>(
    cv: &Condvar,
    guard: MutexGuard<'a, T>,
    timeout: Duration,
    condition: impl FnMut(&mut T) -> bool,
) -> (MutexGuard<'a, T>, WaitTimeoutResult) {
    cv.wait_timeout_while(guard, timeout, condition).unwrap_or_else(|p| p.into_inner())
}

/// `fetch_update` under a name of umdev's: the standard library renames it (`try_update`,
/// not yet stable) and deprecates the old name, which `clippy -D warnings` would then refuse.
/// The same loop: `f` on the current value until it returns `None` (`Err` with that value)
/// or a compare-exchange stores its result (`Ok` with the value before).
pub trait AtomicUpdate {
    /// The atomic's value type.
    type Value: Copy;
    /// See the trait.
    fn update_with(
        &self,
        set: Ordering,
        fetch: Ordering,
        f: impl FnMut(Self::Value) -> Option<Self::Value>,
    ) -> Result<Self::Value, Self::Value>;
}

macro_rules! atomic_update {
    ($($atomic:ty => $value:ty),*) => {$(
        impl AtomicUpdate for $atomic {
            type Value = $value;
            #[inline]
            fn update_with(
                &self,
                set: Ordering,
                fetch: Ordering,
                mut f: impl FnMut($value) -> Option<$value>,
            ) -> Result<$value, $value> {
                let mut prev = self.load(fetch);
                while let Some(next) = f(prev) {
                    match self.compare_exchange_weak(prev, next, set, fetch) {
                        Ok(x) => return Ok(x),
                        Err(now) => prev = now,
                    }
                }
                Err(prev)
            }
        }
    )*};
}
atomic_update!(AtomicU32 => u32, AtomicU64 => u64, AtomicUsize => usize);
