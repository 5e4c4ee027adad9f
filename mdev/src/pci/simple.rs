//! The second flavour of PCI function: plain state behind `&mut self`, serialized by the
//! framework, so a device author writes no locking code.
//!
//! [`PciFunction`] takes `&self` because the server calls in while a device's own threads
//! run; a device without threads (or whose threads reach it only through [`Shared`])
//! implements [`SimpleFunction`] instead and is served wrapped in a `Mutex` or a [`Shared`].
//! A [`Shared`] also hands the device's threads [`SharedRef`]s: the same state, a condition
//! variable to sleep on, and a `closed` flag that tells them to exit when the device goes.
//!
//! A thread that takes the device's lock cannot be joined from a call that holds it (every
//! call here does, `reset` included), and must not hold it across client DMA (the connection
//! thread, which serves that DMA, would wait for the lock). So a device whose worker does
//! DMA, and whose reset stops and joins that worker, serves itself as a `Mutex` and keeps
//! what the worker and the registers share apart: a small mutex or atomics of their own,
//! each hold a few loads and stores, never across a wait, a DMA or a join. Its reset bumps a
//! generation number there (completions of requests begun before compare theirs and report
//! nothing), then stops the worker and joins it, boundedly. The `checksum_device` example is
//! that pattern; [`Shared`] suits threads that need the whole state and sleep only on its
//! condition variable.
//!
//! A panic in a call leaves the lock poisoned; the framework takes it anyway and the device
//! keeps serving, so a function's state must be consistent after any call that panics (plain
//! fields and counters are; a multi-step update must be ordered so that stopping halfway
//! leaves something valid).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use umdev_pinning::sync;

use super::device::PciFunction;
use crate::device::{DeviceError, RegionMmap};
use crate::guest::DeviceContext;

/// A PCI function whose every call gets `&mut self`: the framework serializes them.
///
/// Every method runs on the instance's connection thread, the one that reads the client's
/// messages: none may reach memory the client mapped without an fd (its reply would come
/// through this thread; the copy fails with `ClientDmaError::WouldDeadlock`), and a device
/// thread must not hold the device's lock while it does client DMA.
pub trait SimpleFunction: Send + 'static {
    /// Reads `data.len()` bytes at `offset` in BAR `bar` (inside the BAR; width and
    /// alignment are the function's to check). Never for the bytes of the MSI-X table or
    /// PBA, which the framework answers; the rest of their BAR does come here
    /// ([`ConfigSpaceBuilder::msix`](super::ConfigSpaceBuilder::msix)).
    fn bar_read(&mut self, bar: u8, offset: u64, data: &mut [u8]) -> Result<(), DeviceError>;

    /// Writes `data` at `offset` in BAR `bar` (as [`SimpleFunction::bar_read`]: never to the
    /// MSI-X table or PBA).
    fn bar_write(&mut self, bar: u8, offset: u64, data: &[u8]) -> Result<(), DeviceError>;

    /// How the client may mmap BAR `bar` (asked once, at construction).
    fn bar_mmap(&self, bar: u8) -> Option<RegionMmap> {
        let _ = bar;
        None
    }

    /// DEVICE_RESET (also run on detach): back to the power-on state. The framework has
    /// cancelled every request in flight ([`crate::request::Cancel::Reset`]) before this
    /// runs; the device stops its own workers here, and ignores what requests begun before
    /// the reset still report: they report nothing ([`crate::request`], "What a request
    /// cancelled by a reset reports"). This runs under the device's lock, so it may join a
    /// worker only if that worker never waits for the lock (its state apart, as the
    /// `checksum_device` example keeps it).
    fn reset(&mut self) {}

    /// A client connected.
    fn attach(&mut self, ctx: &DeviceContext) {
        let _ = ctx;
    }

    /// The client is gone: drop every pin and the context the device keeps outside its
    /// requests (a request's pins are the framework's: it cancels the requests and waits,
    /// boundedly, for them to end). A reset follows.
    fn detach(&mut self) {}

    /// The mapping `[iova, iova + len)` is being unmapped while pins are held in it (called
    /// only then, and with the whole mapping, which may be larger than the range the client
    /// unmapped): drop the pins the device keeps in it outside its requests (the framework
    /// has cancelled the requests holding pins or claims there, and the unmap waits for their
    /// pins). Runs on the connection thread.
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
}

/// Forwards every [`PciFunction`] call of a lock type to the [`SimpleFunction`] its
/// `$lock(self)` guard derefs to: the one forwarding the two serving types share.
macro_rules! serve_simple {
    ($ty:ident, $lock:expr) => {
        impl<T: SimpleFunction> PciFunction for $ty<T> {
            fn bar_read(&self, bar: u8, offset: u64, data: &mut [u8]) -> Result<(), DeviceError> {
                $lock(self).bar_read(bar, offset, data)
            }
            fn bar_write(&self, bar: u8, offset: u64, data: &[u8]) -> Result<(), DeviceError> {
                $lock(self).bar_write(bar, offset, data)
            }
            fn bar_mmap(&self, bar: u8) -> Option<RegionMmap> {
                $lock(self).bar_mmap(bar)
            }
            fn reset(&self) {
                $lock(self).reset()
            }
            fn attach(&self, ctx: &DeviceContext) {
                $lock(self).attach(ctx)
            }
            fn detach(&self) {
                $lock(self).detach()
            }
            fn dma_unmap(&self, iova: u64, len: u64) {
                $lock(self).dma_unmap(iova, len)
            }
            fn describe(&self) -> serde_json::Value {
                $lock(self).describe()
            }
            fn bus_master_changed(&self, on: bool) {
                $lock(self).bus_master_changed(on)
            }
        }
    };
}

serve_simple!(Mutex, sync::lock);
serve_simple!(Shared, Shared::lock);

struct Inner<T> {
    state: Mutex<T>,
    changed: Arc<Condvar>,
    closed: AtomicBool,
    /// Tells threads that sleep elsewhere than on `changed` that the device is going.
    on_close: Option<fn(&mut T)>,
    /// Threads' handles alive ([`SharedRef`]s), and their drops' signal.
    refs: Mutex<usize>,
    released: Condvar,
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
        Self::with_close(make, None)
    }

    /// As [`Shared::new`], for a device whose threads sleep elsewhere than on the state's
    /// condition variable (in `poll`, say): `close` runs on the state when the device goes,
    /// to tell them to look at [`SharedRef::closed`].
    pub fn closing(make: impl FnOnce(Waker) -> T, close: fn(&mut T)) -> Shared<T> {
        Self::with_close(make, Some(close))
    }

    fn with_close(make: impl FnOnce(Waker) -> T, on_close: Option<fn(&mut T)>) -> Shared<T> {
        let changed = Arc::new(Condvar::new());
        let state = Mutex::new(make(Waker(changed.clone())));
        let inner = Inner {
            state,
            changed,
            closed: AtomicBool::new(false),
            on_close,
            refs: Mutex::new(0),
            released: Condvar::new(),
        };
        Shared { inner: Arc::new(inner) }
    }

    /// Locks the state.
    pub fn lock(&self) -> MutexGuard<'_, T> {
        sync::lock(&self.inner.state)
    }

    /// A handle for one of the device's threads.
    pub fn share(&self) -> SharedRef<T> {
        SharedRef::new(self.inner.clone())
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
        {
            let mut state = sync::lock(&self.inner.state);
            if let Some(close) = self.inner.on_close {
                close(&mut state);
            }
            // Under the lock, so a thread between its `closed` check and its wait sees it.
            self.inner.changed.notify_all();
        }
        let refs = sync::lock(&self.inner.refs);
        let (refs, _) = sync::wait_timeout_while(&self.inner.released, refs, Self::CLOSE_WAIT, |n| *n > 0);
        if *refs > 0 {
            log::error!("a device thread did not let go of its state in {:?}", Self::CLOSE_WAIT);
            return;
        }
        drop(refs);
        // The last handle's count is down; its `Arc` goes a moment later, as its drop
        // returns. Waiting for that keeps the state's own drop on this thread.
        let deadline = Instant::now() + Self::CLOSE_WAIT;
        while Arc::strong_count(&self.inner) > 1 && Instant::now() < deadline {
            std::thread::yield_now();
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

impl<T> SharedRef<T> {
    fn new(inner: Arc<Inner<T>>) -> SharedRef<T> {
        *sync::lock(&inner.refs) += 1;
        SharedRef { inner }
    }
}

impl<T> Clone for SharedRef<T> {
    fn clone(&self) -> Self {
        SharedRef::new(self.inner.clone())
    }
}

impl<T> Drop for SharedRef<T> {
    fn drop(&mut self) {
        let mut refs = sync::lock(&self.inner.refs);
        *refs -= 1;
        if *refs == 0 {
            self.inner.released.notify_all();
        }
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
    fn both_serving_types_serve_a_simple_function() {
        fn read(f: &dyn PciFunction) -> u8 {
            let mut b = [0u8];
            f.bar_read(0, 0, &mut b).unwrap();
            b[0]
        }
        let waker = Waker(Arc::new(Condvar::new()));
        let mutex = Mutex::new(Counter { reads: 0, ticks: 0, waker });
        let shared = Shared::new(|waker| Counter { reads: 0, ticks: 0, waker });
        for f in [&mutex as &dyn PciFunction, &shared] {
            assert_eq!((read(f), read(f)), (1, 2));
            f.reset();
            assert_eq!(read(f), 1);
        }
    }

    #[test]
    fn a_shared_state_is_reached_by_the_devices_thread_and_released_on_drop() {
        let shared = Shared::new(|waker| Counter { reads: 0, ticks: 0, waker });
        let r = shared.share();
        let (tx, rx) = std::sync::mpsc::channel();
        let thread = std::thread::spawn(move || {
            let mut g = r.lock();
            while !r.closed() {
                g.ticks += 1;
                g = r.wait(g);
            }
            drop(g);
            tx.send(()).unwrap();
            // `r` goes last: the drop below waits for it.
        });
        let mut b = [0u8];
        while shared.lock().ticks < 2 {
            shared.bar_read(0, 0, &mut b).unwrap(); // wakes the thread
            std::thread::yield_now();
        }
        // Returns once the thread let go of its handle, which it does after it was told to
        // go (CLOSE_WAIT would log an error instead and return early).
        drop(shared);
        assert!(rx.try_recv().is_ok(), "the thread was told to go and let go");
        thread.join().unwrap();
    }
}
