//! Requests that cannot be forgotten: a [`Permit`] per request a device's worker takes on.
//!
//! A device that runs requests on its own threads (a channel program, a DMA command, an
//! NVMe command) gets a permit for each from its [`Requests`]. The permit carries the
//! request's [`Completion`]: completing it reports the outcome; dropping it without
//! completing (an early return, a forgotten path, a panic unwinding through the worker)
//! reports the completion's documented failure instead. Either way the permit counts down
//! the requests a detach waits for ([`Requests::wait_idle`]), and whatever the request held
//! (pins, the client's context) is dropped with it. [`serve`] runs a request's handling so
//! that a panic fails that request and the worker goes on.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use umdev_pinning::sync;

/// How a request ends, for the device to report.
pub trait Completion: Send + 'static {
    /// What the request produced.
    type Outcome;
    /// The request finished with `outcome`.
    fn complete(self, outcome: Self::Outcome);
    /// The request was dropped unfinished (or its handling panicked): report the device's
    /// documented failure.
    fn fail(self);
}

#[derive(Debug, Default)]
struct Inner {
    open: Mutex<Count>,
    done: Condvar,
}

/// Requests in flight, and the threads waiting for none (so a request that ends wakes
/// nobody, without a syscall, when no one waits: the common case).
#[derive(Debug, Default)]
struct Count {
    open: usize,
    waiters: usize,
}

/// The requests a device has in flight.
#[derive(Clone, Debug, Default)]
pub struct Requests {
    inner: Arc<Inner>,
}

impl Requests {
    /// No requests.
    pub fn new() -> Requests {
        Requests::default()
    }

    /// Takes on a request that ends through `completion`.
    pub fn begin<C: Completion>(&self, completion: C) -> Permit<C> {
        sync::lock(&self.inner.open).open += 1;
        Permit { completion: Some(completion), inner: self.inner.clone() }
    }

    /// Requests in flight now.
    pub fn in_flight(&self) -> usize {
        sync::lock(&self.inner.open).open
    }

    /// Waits until no request is in flight, at most `bound`; false if some still are.
    pub fn wait_idle(&self, bound: Duration) -> bool {
        let mut count = sync::lock(&self.inner.open);
        count.waiters += 1;
        let (mut count, _) = sync::wait_timeout_while(&self.inner.done, count, bound, |c| c.open > 0);
        count.waiters -= 1;
        count.open == 0
    }
}

/// One request in flight: complete it, or drop it to fail it.
#[derive(Debug)]
pub struct Permit<C: Completion> {
    completion: Option<C>,
    inner: Arc<Inner>,
}

impl<C: Completion> Permit<C> {
    /// The request's completion (and whatever request data it carries).
    pub fn get(&self) -> &C {
        self.completion.as_ref().expect("present until the permit is consumed")
    }

    /// Ends the request without reporting through its completion (the caller reports in
    /// its own way); the request is counted down all the same.
    pub fn into_inner(mut self) -> C {
        self.completion.take().expect("present until the permit is consumed")
    }

    /// Ends the request with `outcome`.
    pub fn complete(mut self, outcome: C::Outcome) {
        if let Some(completion) = self.completion.take() {
            completion.complete(outcome);
        }
    }
}

impl<C: Completion> Drop for Permit<C> {
    fn drop(&mut self) {
        if let Some(completion) = self.completion.take() {
            completion.fail();
        }
        let mut count = sync::lock(&self.inner.open);
        count.open = count.open.saturating_sub(1);
        if count.open == 0 && count.waiters > 0 {
            self.inner.done.notify_all();
        }
    }
}

/// Runs one request's handling, `what` naming it in the log (formatted only then). A panic
/// in it is caught: the request's permit, dropped during the unwind, fails it, and the
/// caller goes on.
pub fn serve<R>(what: impl std::fmt::Display, handle: impl FnOnce() -> R) -> Option<R> {
    match catch_unwind(AssertUnwindSafe(handle)) {
        Ok(r) => Some(r),
        Err(panic) => {
            let why = panic
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| panic.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "a panic".into());
            log::error!("{what} panicked ({why}); the request fails, the device goes on");
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Report(std::sync::mpsc::Sender<Result<u32, ()>>);

    impl Completion for Report {
        type Outcome = u32;
        fn complete(self, outcome: u32) {
            let _ = self.0.send(Ok(outcome));
        }
        fn fail(self) {
            let _ = self.0.send(Err(()));
        }
    }

    #[test]
    fn completed_forgotten_and_panicking_requests_all_end_and_count_down() {
        let requests = Requests::new();
        let (tx, rx) = std::sync::mpsc::channel();
        requests.begin(Report(tx.clone())).complete(7);
        assert_eq!(rx.recv().unwrap(), Ok(7));
        drop(requests.begin(Report(tx.clone())));
        assert_eq!(rx.recv().unwrap(), Err(()), "forgotten: failed");
        let permit = requests.begin(Report(tx.clone()));
        assert_eq!(requests.in_flight(), 1);
        let served = serve("a test request", move || {
            let _permit = permit;
            panic!("on purpose");
        });
        assert!(served.is_none());
        assert_eq!(rx.recv().unwrap(), Err(()), "panicked: failed");
        assert!(requests.wait_idle(Duration::ZERO));
        // A request in flight holds a detach up to its bound.
        let held = requests.begin(Report(tx));
        assert!(!requests.wait_idle(Duration::from_millis(10)));
        let waiter = {
            let requests = requests.clone();
            std::thread::spawn(move || requests.wait_idle(Duration::from_secs(5)))
        };
        held.complete(1);
        assert!(waiter.join().unwrap());
    }
}
