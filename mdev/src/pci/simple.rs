//! The second flavour of PCI function: plain state behind `&mut self`, serialized by the
//! framework, so a device author writes no locking code.
//!
//! [`PciFunction`] takes `&self` because the server calls in while a device's own threads
//! run; a device without threads (or whose threads reach it only through [`Shared`])
//! implements [`SimpleFunction`] instead and is served wrapped in a `Mutex`, an `RwLock`
//! or a [`Shared`], through the blanket implementations here. A [`Shared`] also hands the
//! device's threads [`SharedRef`]s: the same state, a condition variable to sleep on, and a
//! `closed` flag that tells them to exit when the device goes.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, RwLock};
use std::time::{Duration, Instant};

use umdev_pinning::sync;

use super::device::PciFunction;
use crate::device::{DeviceContext, DeviceError, RegionMmap};

/// A PCI function whose every call gets `&mut self`: the framework serializes them.
pub trait SimpleFunction: Send + 'static {
    /// Reads `data.len()` bytes at `offset` in BAR `bar` (inside the BAR; width and
    /// alignment are the function's to check).
    fn bar_read(&mut self, bar: u8, offset: u64, data: &mut [u8]) -> Result<(), DeviceError>;

    /// Writes `data` at `offset` in BAR `bar`.
    fn bar_write(&mut self, bar: u8, offset: u64, data: &[u8]) -> Result<(), DeviceError>;

    /// How the client may mmap BAR `bar` (asked once, at construction).
    fn bar_mmap(&self, bar: u8) -> Option<RegionMmap> {
        let _ = bar;
        None
    }

    /// DEVICE_RESET (also run on detach): back to the power-on state.
    fn reset(&mut self) {}

    /// A client connected.
    fn attach(&mut self, ctx: &DeviceContext) {
        let _ = ctx;
    }

    /// The client is gone: drop every pin and the context. A reset follows.
    fn detach(&mut self) {}

    /// `[iova, iova + len)` is being unmapped: drop its pins.
    fn dma_unmap(&mut self, iova: u64, len: u64) {
        let _ = (iova, len);
    }

    /// What `umdev list --json` shows of the device.
    fn describe(&self) -> serde_json::Value {
        serde_json::Value::Null
    }

    /// The guest turned bus mastering on or off (see [`PciFunction::bus_master_changed`]).
    fn bus_master_changed(&mut self, on: bool) {
        let _ = on;
    }

    /// The device is going (its [`Shared`] is dropping): tell threads that sleep elsewhere
    /// than on the state's condition variable (in `poll`, say) to look at
    /// [`SharedRef::closed`]. Threads waiting on the state are woken anyway.
    fn close(&mut self) {}
}

/// Forwards every [`PciFunction`] call to `$target` (an expression of `$self` giving a
/// guard that derefs to the [`SimpleFunction`]).
macro_rules! forward_simple {
    ($self:ident => $read:expr, $write:expr) => {
        fn bar_read(&$self, bar: u8, offset: u64, data: &mut [u8]) -> Result<(), DeviceError> {
            $write.bar_read(bar, offset, data)
        }
        fn bar_write(&$self, bar: u8, offset: u64, data: &[u8]) -> Result<(), DeviceError> {
            $write.bar_write(bar, offset, data)
        }
        fn bar_mmap(&$self, bar: u8) -> Option<RegionMmap> {
            $read.bar_mmap(bar)
        }
        fn reset(&$self) {
            $write.reset()
        }
        fn attach(&$self, ctx: &DeviceContext) {
            $write.attach(ctx)
        }
        fn detach(&$self) {
            $write.detach()
        }
        fn dma_unmap(&$self, iova: u64, len: u64) {
            $write.dma_unmap(iova, len)
        }
        fn describe(&$self) -> serde_json::Value {
            $read.describe()
        }
        fn bus_master_changed(&$self, on: bool) {
            $write.bus_master_changed(on)
        }
    };
}

impl<T: SimpleFunction> PciFunction for Mutex<T> {
    forward_simple!(self => sync::lock(self), sync::lock(self));
}

impl<T: SimpleFunction + Sync> PciFunction for RwLock<T> {
    forward_simple!(self => sync::read(self), sync::write(self));
}

impl<T: SimpleFunction> PciFunction for Shared<T> {
    forward_simple!(self => self.lock(), self.lock());
}

impl<T: PciFunction + ?Sized> PciFunction for Arc<T> {
    fn bar_read(&self, bar: u8, offset: u64, data: &mut [u8]) -> Result<(), DeviceError> {
        (**self).bar_read(bar, offset, data)
    }
    fn bar_write(&self, bar: u8, offset: u64, data: &[u8]) -> Result<(), DeviceError> {
        (**self).bar_write(bar, offset, data)
    }
    fn bar_mmap(&self, bar: u8) -> Option<RegionMmap> {
        (**self).bar_mmap(bar)
    }
    fn reset(&self) {
        (**self).reset()
    }
    fn attach(&self, ctx: &DeviceContext) {
        (**self).attach(ctx)
    }
    fn detach(&self) {
        (**self).detach()
    }
    fn dma_unmap(&self, iova: u64, len: u64) {
        (**self).dma_unmap(iova, len)
    }
    fn describe(&self) -> serde_json::Value {
        (**self).describe()
    }
    fn bus_master_changed(&self, on: bool) {
        (**self).bus_master_changed(on)
    }
}

struct Inner<T> {
    state: Mutex<T>,
    changed: Arc<Condvar>,
    closed: AtomicBool,
}

/// A [`SimpleFunction`]'s state shared with the device's own threads. The server calls
/// in through it (as a [`PciFunction`]); the threads get [`SharedRef`]s. When the `Shared`
/// drops (the device goes), the threads are told to exit (`closed`) and woken, and the drop
/// waits (at most [`Shared::CLOSE_WAIT`]) for them to let go, so the state is dropped on
/// the dropping thread.
pub struct Shared<T: SimpleFunction> {
    inner: Arc<Inner<T>>,
}

/// A device thread's handle on a [`Shared`] state.
pub struct SharedRef<T> {
    inner: Arc<Inner<T>>,
}

/// Wakes the threads sleeping on a [`Shared`] state: held by the state itself (it does not
/// keep the state alive).
#[derive(Clone, Debug)]
pub struct Waker(Arc<Condvar>);

impl Waker {
    /// Wakes every thread waiting on the state.
    pub fn wake(&self) {
        self.0.notify_all();
    }
}

impl<T: SimpleFunction> Shared<T> {
    /// How long dropping waits for the device's threads to let go.
    pub const CLOSE_WAIT: Duration = Duration::from_secs(5);

    /// Shares the state `make` builds; it gets the [`Waker`] for its threads.
    pub fn new(make: impl FnOnce(Waker) -> T) -> Shared<T> {
        let changed = Arc::new(Condvar::new());
        let state = Mutex::new(make(Waker(changed.clone())));
        Shared { inner: Arc::new(Inner { state, changed, closed: AtomicBool::new(false) }) }
    }

    /// Locks the state.
    pub fn lock(&self) -> MutexGuard<'_, T> {
        sync::lock(&self.inner.state)
    }

    /// A handle for one of the device's threads.
    pub fn share(&self) -> SharedRef<T> {
        SharedRef { inner: self.inner.clone() }
    }

    /// A handle that does not keep the state alive (for handles given out to users, who
    /// may keep them past the device).
    pub fn weak(&self) -> WeakShared<T> {
        WeakShared { inner: Arc::downgrade(&self.inner) }
    }
}

/// A [`Shared`] state's handle that does not keep it alive.
pub struct WeakShared<T> {
    inner: std::sync::Weak<Inner<T>>,
}

impl<T> WeakShared<T> {
    /// Runs `f` on the state, if the device still exists.
    pub fn with<R>(&self, f: impl FnOnce(&mut T) -> R) -> Option<R> {
        let inner = self.inner.upgrade()?;
        let mut state = sync::lock(&inner.state);
        Some(f(&mut state))
    }
}

impl<T> Clone for WeakShared<T> {
    fn clone(&self) -> Self {
        WeakShared { inner: self.inner.clone() }
    }
}

impl<T> std::fmt::Debug for WeakShared<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WeakShared").finish_non_exhaustive()
    }
}

impl<T: SimpleFunction> Drop for Shared<T> {
    fn drop(&mut self) {
        self.inner.closed.store(true, Ordering::Release);
        sync::lock(&self.inner.state).close();
        let deadline = Instant::now() + Self::CLOSE_WAIT;
        while Arc::strong_count(&self.inner) > 1 {
            // Under the lock, so a thread between its `closed` check and its wait sees it.
            drop(sync::lock(&self.inner.state));
            self.inner.changed.notify_all();
            if Instant::now() >= deadline {
                log::error!("a device thread did not let go of its state in {:?}", Self::CLOSE_WAIT);
                return;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
    }
}

impl<T> SharedRef<T> {
    /// Locks the state.
    pub fn lock(&self) -> MutexGuard<'_, T> {
        sync::lock(&self.inner.state)
    }

    /// True once the device is going: the thread should return (dropping this handle).
    pub fn closed(&self) -> bool {
        self.inner.closed.load(Ordering::Acquire)
    }

    /// Sleeps until woken (a [`Waker`], or the device closing), with `guard` released
    /// meanwhile.
    pub fn wait<'a>(&'a self, guard: MutexGuard<'a, T>) -> MutexGuard<'a, T> {
        sync::wait(&self.inner.changed, guard)
    }

    /// As [`SharedRef::wait`], for at most `timeout`.
    pub fn wait_timeout<'a>(&'a self, guard: MutexGuard<'a, T>, timeout: Duration) -> MutexGuard<'a, T> {
        sync::wait_timeout(&self.inner.changed, guard, timeout).0
    }
}

impl<T> Clone for SharedRef<T> {
    fn clone(&self) -> Self {
        SharedRef { inner: self.inner.clone() }
    }
}

impl<T: SimpleFunction> std::fmt::Debug for Shared<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Shared").finish_non_exhaustive()
    }
}

impl<T> std::fmt::Debug for SharedRef<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SharedRef").field("closed", &self.closed()).finish_non_exhaustive()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A function that counts its calls, with a thread that bumps it on its own.
    struct Counter {
        reads: u32,
        ticks: u32,
        waker: Waker,
    }

    impl SimpleFunction for Counter {
        fn bar_read(&mut self, _bar: u8, _offset: u64, data: &mut [u8]) -> Result<(), DeviceError> {
            self.reads += 1;
            data.fill(self.reads as u8);
            self.waker.wake();
            Ok(())
        }
        fn bar_write(&mut self, _bar: u8, _offset: u64, _data: &[u8]) -> Result<(), DeviceError> {
            Ok(())
        }
        fn reset(&mut self) {
            self.reads = 0;
        }
    }

    #[test]
    fn every_lock_flavour_serves_a_simple_function() {
        fn read(f: &dyn PciFunction) -> u8 {
            let mut b = [0u8];
            f.bar_read(0, 0, &mut b).unwrap();
            b[0]
        }
        let waker = Waker(Arc::new(Condvar::new()));
        let mutex = Mutex::new(Counter { reads: 0, ticks: 0, waker: waker.clone() });
        let rw = RwLock::new(Counter { reads: 0, ticks: 0, waker: waker.clone() });
        let arc = Arc::new(Mutex::new(Counter { reads: 0, ticks: 0, waker }));
        for f in [&mutex as &dyn PciFunction, &rw, &arc] {
            assert_eq!((read(f), read(f)), (1, 2));
            f.reset();
            assert_eq!(read(f), 1);
        }
    }

    #[test]
    fn a_shared_state_is_reached_by_the_devices_thread_and_released_on_drop() {
        let shared = Shared::new(|waker| Counter { reads: 0, ticks: 0, waker });
        let r = shared.share();
        let thread = std::thread::spawn(move || {
            let mut g = r.lock();
            while !r.closed() {
                g.ticks += 1;
                g = r.wait(g);
            }
        });
        let mut b = [0u8];
        for _ in 0..10 {
            shared.bar_read(0, 0, &mut b).unwrap(); // wakes the thread each time
        }
        std::thread::sleep(Duration::from_millis(20));
        assert!(shared.lock().ticks >= 1);
        let started = Instant::now();
        drop(shared);
        thread.join().unwrap();
        assert!(started.elapsed() < Duration::from_secs(1), "the thread was told to go");
    }
}
