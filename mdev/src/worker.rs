//! Worker threads, the one way a device runs work of its own: a named thread per queue or
//! channel that sleeps until it is woken (a doorbell) or told to stop, with an optional
//! bounded poll before it sleeps.
//!
//! A device owns a [`Worker`] and rings it with [`Worker::wake`] (or its [`Bell`]);
//! the thread's body gets a [`Waiter`] and calls [`Waiter::wait`] whenever it has nothing to
//! do. [`Worker::stop`] hands the thread a typed reason (`S`) and wakes it; the body returns
//! when it sees one. [`Worker::join`] waits for the body to return for at most a bound, on an
//! event the thread signals as it ends (a panic included), never by sleeping in a loop.
//!
//! **When to start one.**
//!
//! - *With the device, or when the guest sets up what the worker serves* (testdev and ccw at
//!   creation; nvme a queue's worker when the guest creates the queue): a doorbell is then
//!   only a ring, and a thread that cannot be spawned is found at the creation or the setup
//!   command, where the device can report it. The thread sleeps while the device idles, and
//!   a reset need not stop it: the worker compares each job's generation number with the
//!   device's, which the reset bumps.
//! - *At the first doorbell, again after each reset* (the `checksum_device` example): no
//!   thread until the guest uses the device, and a reset that stops and joins the worker
//!   leaves none, as at power-on. The price: the doorbell after each reset spawns a thread
//!   on the connection thread (tens of microseconds), and a spawn that fails must be
//!   reported through the device's status register. Keep the [`Bell`] in the device and
//!   start each worker on it ([`Worker::spawn_on`]), so the lane's wake
//!   ([`crate::request::Requests::lane`]) reaches whichever worker runs.
//!
//! Either way the device stops and joins its workers in its drop.
//!
//! **Polling.** A wake-up costs the waker a syscall and the worker a few microseconds, which at
//! queue depth 1 is the whole latency. A worker given a [`Poll`] budget watches for work for
//! up to that long before it sleeps, if a CPU is free for it: at most one worker per spare CPU
//! of the process polls at a time (the turns are shared by every device), and a turn is given
//! back before sleeping. A ring while the worker polls costs the ringer no syscall. A poll
//! that finds it lost its CPU for a scheduler slice (a busy neighbour's) ends, and the worker
//! does not poll for a while: a polling worker that does not run only delays what comes.
//!
//! **Sleeping in the kernel.** A worker that also waits for events the kernel delivers to it
//! (an io_uring's completions) sleeps where those arrive instead of in the thread's park:
//! [`Waiter::wait_in`] with a [`KernelSleep`]. A ring then writes the bell's eventfd
//! ([`Bell::eventfd`]), which the sleeper watches (an io_uring read of it, say), so one
//! blocking call ends on a ring, a stop or the kernel's event, whichever comes first.

use std::os::fd::{AsRawFd, BorrowedFd};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU8, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::thread::{JoinHandle, Thread};
use std::time::{Duration, Instant};

use umdev_pinning::sync::{self, AtomicUpdate};
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

/// How long a worker watches for work before it sleeps.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Poll(pub Duration);

impl Poll {
    /// Never poll: sleep at once.
    pub const NONE: Poll = Poll(Duration::ZERO);
}

/// How long a poll spins before each look also offers the CPU to whatever else is runnable
/// on it. The thread a worker just woke (a VMM's main loop, told of a completion through an
/// interrupt eventfd) is often placed on the worker's own CPU, and the scheduler does not
/// preempt a spinning thread for it: without the offer it would wait out the poll budget,
/// and the interrupt with it. A client that answers within this time finds the worker still
/// spinning, at no syscall's cost.
const POLL_SPIN_ONLY: Duration = Duration::from_micros(2);

/// A look that comes this long after the one before finds that the worker lost its CPU
/// meanwhile for a whole scheduler slice: to a thread that keeps the CPU busy (another
/// program), not to one that its yield let run briefly (a VMM's main loop runs for about 100
/// µs)...
const POLL_LOST: Duration = Duration::from_millis(1);
/// ...and the worker then does not poll for this long. While such a thread shares its CPU, a
/// polling worker is runnable without running, and work that arrives meanwhile waits out the
/// other thread's slice (a host that shadows its doorbells does not even ring while the
/// worker polls); a sleeping worker is woken by the ring at once.
const POLL_PAUSE: Duration = Duration::from_millis(100);

/// Workers polling now, across the process.
static POLLERS: AtomicUsize = AtomicUsize::new(0);

/// A worker's turn to poll; given back on drop. [`Waiter`]'s polls take one for each wait;
/// a device whose worker spins in a loop of its own (watching memory the client writes, which
/// rings nothing) takes one with [`PollTurn::take`] and spins only while it holds it, so that
/// the process never spins on more CPUs than it has spare, however many workers a client
/// keeps busy.
#[must_use = "the turn is given back when dropped"]
pub struct PollTurn(());

impl PollTurn {
    /// A turn, if fewer workers poll than the process has spare CPUs.
    pub fn take() -> Option<PollTurn> {
        static SPARE: OnceLock<usize> = OnceLock::new();
        let spare = *SPARE.get_or_init(|| {
            std::thread::available_parallelism().map_or(1, |n| n.get()).saturating_sub(1).max(1)
        });
        POLLERS
            .update_with(Ordering::AcqRel, Ordering::Acquire, |n| (n < spare).then_some(n + 1))
            .ok()
            .map(|_| PollTurn(()))
    }
}

impl Drop for PollTurn {
    fn drop(&mut self) {
        POLLERS.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Why a [`Waiter::wait`] returned.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Wake<S> {
    /// Rung, or the caller's condition held: look for work.
    Work,
    /// Nothing new: the timeout passed (or the thread woke spuriously).
    Timeout,
    /// Told to stop, with this reason: return.
    Stop(S),
}

/// A worker's wake point: what wakes it ("rings"). A device may keep one for good (a queue's
/// doorbell) and start successive workers on it ([`Worker::spawn_on`]). Cheap to clone.
#[derive(Clone, Default)]
pub struct Bell(Arc<BellInner>);

#[derive(Default)]
struct BellInner {
    /// Bumped by every ring: a waiter that saw the same value has missed nothing.
    rings: AtomicU32,
    /// [`AWAKE`], or how the worker sleeps (or is about to): a ring must wake it there.
    sleeping: AtomicU8,
    /// Written by a ring while the worker sleeps in the kernel ([`Waiter::wait_in`]); made by
    /// the first [`Bell::eventfd`].
    kick: OnceLock<EventFd>,
    /// The worker ringing wakes (taken only when it sleeps).
    thread: Mutex<Option<Thread>>,
}

impl Bell {
    /// A bell no worker listens to yet.
    pub fn new() -> Bell {
        Bell::default()
    }

    /// Whether `other` is this bell (a clone of it), not just one like it.
    pub fn same(&self, other: &Bell) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }

    /// Wakes the worker: its next (or current) [`Waiter::wait`] returns [`Wake::Work`]. Costs
    /// no syscall while the worker is awake or polling.
    pub fn ring(&self) {
        self.0.rings.fetch_add(1, Ordering::SeqCst);
        match self.0.sleeping.load(Ordering::SeqCst) {
            PARKED => {
                if let Some(t) = sync::lock(&self.0.thread).as_ref() {
                    t.unpark();
                }
            }
            IN_KERNEL => self.0.kick(),
            _ => {}
        }
    }

    /// The eventfd a ring writes while the worker sleeps in the kernel ([`Waiter::wait_in`]):
    /// the sleeper watches it. Made on first call; the same for the bell's life.
    pub fn eventfd(&self) -> std::io::Result<BorrowedFd<'_>> {
        if self.0.kick.get().is_none() {
            let efd = EventFd::new(EFD_NONBLOCK)?;
            // Another thread may have made one meanwhile: then ours is dropped.
            let _ = self.0.kick.set(efd);
        }
        let efd = self.0.kick.get().expect("set above");
        // SAFETY: the fd is the bell's eventfd, which lives as long as the bell, and the
        // borrow cannot outlive `self`.
        Ok(unsafe { BorrowedFd::borrow_raw(efd.as_raw_fd()) })
    }
}

impl std::fmt::Debug for Bell {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Bell").field("rings", &self.0.rings.load(Ordering::Relaxed)).finish()
    }
}

/// How long a worker sleeping in the kernel without the bell's eventfd (it could not be
/// made: out of file descriptors) sleeps before it looks again.
const KICKLESS_LOOK: Duration = Duration::from_millis(1);

/// A bell's worker is awake (a ring only counts)...
const AWAKE: u8 = 0;
/// ...parked (a ring unparks it)...
const PARKED: u8 = 1;
/// ...or sleeping in the kernel (a ring writes the bell's eventfd).
const IN_KERNEL: u8 = 2;

impl BellInner {
    /// Wakes a worker sleeping in the kernel. A full counter (never, in practice) still
    /// reads as readable: nothing is lost by ignoring the error.
    fn kick(&self) {
        if let Some(efd) = self.kick.get() {
            let _ = efd.write(1);
        }
    }
}

/// Where a worker sleeps when it sleeps in the kernel ([`Waiter::wait_in`]).
pub trait KernelSleep {
    /// Whether events of its own have arrived (completions to reap): the wait ends.
    fn pending(&mut self) -> bool;
    /// Blocks until one of its own events arrives, the bell's eventfd ([`Bell::eventfd`]) is
    /// written, or `timeout` passes (`None`: no limit). May return early.
    fn block(&mut self, timeout: Option<Duration>);
}

/// What a worker and its device share besides the bell.
struct Control<S> {
    /// Set once a stop reason is stored: the waiter's fast check.
    stopping: AtomicBool,
    stop: Mutex<Option<S>>,
    /// Set, and `ended` notified, when the body returns or unwinds.
    done: Mutex<bool>,
    ended: Condvar,
}

impl<S: Copy> Control<S> {
    fn stop_reason(&self) -> Option<S> {
        if !self.stopping.load(Ordering::Acquire) {
            return None;
        }
        *sync::lock(&self.stop)
    }
}

/// The worker thread's side: waits for work or a stop.
pub struct Waiter<S> {
    bell: Bell,
    control: Arc<Control<S>>,
    poll: Poll,
    /// The bell's rings as this waiter last returned.
    seen: u32,
    /// In [`Waiter::linger`]: a stop does not end the wait.
    lingering: bool,
    /// No polling before this ([`POLL_PAUSE`]).
    poll_paused_until: Option<Instant>,
    /// The thread's scheduler slice, told of each sleep's end (set on the worker's thread).
    slice: Option<crate::sched::SliceChoice>,
}

impl<S: Copy> Waiter<S> {
    /// A waiter on `bell`, with a control of its own, that has seen the rings so far.
    fn new(bell: &Bell, poll: Poll) -> Waiter<S> {
        let control = Arc::new(Control {
            stopping: AtomicBool::new(false),
            stop: Mutex::new(None),
            done: Mutex::new(false),
            ended: Condvar::new(),
        });
        let seen = bell.0.rings.load(Ordering::SeqCst);
        Waiter {
            bell: bell.clone(),
            control,
            poll,
            seen,
            lingering: false,
            poll_paused_until: None,
            slice: None,
        }
    }

    /// The stop reason, once the device asked the thread to stop.
    pub fn stopped(&self) -> Option<S> {
        self.control.stop_reason()
    }

    /// The worker's bell (to hand to whoever rings it).
    pub fn bell(&self) -> Bell {
        self.bell.clone()
    }

    /// Waits until rung since the last return, `ready` holds, the device stops the worker,
    /// or `timeout` passes (`None`: no limit). With a [`Poll`] budget and a turn free, first
    /// watches for up to the budget without sleeping. `ready` is the worker's own look for
    /// work that arrives without a ring (a doorbell in shared memory); it is called while
    /// polling and once more before sleeping.
    pub fn wait(&mut self, ready: impl FnMut() -> bool, timeout: Option<Duration>) -> Wake<S> {
        self.wait_with(ready, &mut || {}, timeout, self.poll)
    }

    /// As [`Waiter::wait`], calling `arm` once polling is over and before the last look that
    /// precedes sleeping: for a device whose host rings only when asked (an NVMe event index).
    /// While the worker polls, the host is not asked, so it writes its doorbell in shared
    /// memory only and the worker sees it there, at no message's cost; from `arm` on, a
    /// write either rings or is seen by the last look.
    pub fn wait_armed(
        &mut self,
        ready: impl FnMut() -> bool,
        mut arm: impl FnMut(),
        timeout: Option<Duration>,
    ) -> Wake<S> {
        self.wait_with(ready, &mut arm, timeout, self.poll)
    }

    /// As [`Waiter::wait`], without polling first (the work just done says none is near).
    pub fn sleep(&mut self, ready: impl FnMut() -> bool, timeout: Option<Duration>) -> Wake<S> {
        self.wait_with(ready, &mut || {}, timeout, Poll::NONE)
    }

    /// As [`Waiter::wait`] (`poll`: with the waiter's polling budget first), but sleeping in
    /// `kernel` instead of the thread's park, and ending too when `kernel` has events of its
    /// own ([`KernelSleep::pending`]). A ring or a stop meanwhile writes the bell's eventfd,
    /// which `kernel` must watch.
    pub fn wait_in(
        &mut self,
        ready: impl FnMut() -> bool,
        timeout: Option<Duration>,
        poll: bool,
        kernel: &mut impl KernelSleep,
    ) -> Wake<S> {
        self.wait_in_armed(ready, || {}, timeout, poll, kernel)
    }

    /// [`Waiter::wait_in`] with [`Waiter::wait_armed`]'s `arm`.
    pub fn wait_in_armed(
        &mut self,
        mut ready: impl FnMut() -> bool,
        mut arm: impl FnMut(),
        timeout: Option<Duration>,
        poll: bool,
        kernel: &mut impl KernelSleep,
    ) -> Wake<S> {
        let budget = if poll { self.poll } else { Poll::NONE };
        // The eventfd exists before the waiter announces itself in the kernel: a ring that
        // sees it there writes it (a ring before it existed would be lost). If it cannot be
        // made, the sleep below is bounded by a look instead.
        let timeout = match self.bell.eventfd() {
            Ok(_) => timeout,
            Err(_) => Some(timeout.map_or(KICKLESS_LOOK, |t| t.min(KICKLESS_LOOK))),
        };
        let kernel = std::cell::RefCell::new(kernel);
        let mut look = || ready() || kernel.borrow_mut().pending();
        let mut sleep = |left| kernel.borrow_mut().block(left);
        self.wait_on(&mut look, &mut arm, timeout, budget, &mut sleep, IN_KERNEL)
    }

    /// As [`Waiter::sleep`], but a stop does not end the wait: for a body that was told to
    /// stop and still owes something it must finish, boundedly (a device completing what was
    /// queued before a deletion, say), while waiting for a ring. Returns [`Wake::Work`] or
    /// [`Wake::Timeout`], never [`Wake::Stop`].
    pub fn linger(&mut self, ready: impl FnMut() -> bool, timeout: Duration) -> Wake<S> {
        self.lingering = true;
        let wake = self.wait_with(ready, &mut || {}, Some(timeout), Poll::NONE);
        self.lingering = false;
        wake
    }

    fn wait_with(
        &mut self,
        mut ready: impl FnMut() -> bool,
        arm: &mut dyn FnMut(),
        timeout: Option<Duration>,
        poll: Poll,
    ) -> Wake<S> {
        let mut park = |left: Option<Duration>| match left {
            Some(left) => std::thread::park_timeout(left),
            None => std::thread::park(),
        };
        self.wait_on(&mut ready, arm, timeout, poll, &mut park, PARKED)
    }

    /// Looks, polls for up to `poll`'s budget (with a turn free), arms, then announces itself
    /// sleeping as `how` and sleeps in `sleep` (after one more look).
    fn wait_on(
        &mut self,
        ready: &mut dyn FnMut() -> bool,
        arm: &mut dyn FnMut(),
        timeout: Option<Duration>,
        poll: Poll,
        sleep: &mut dyn FnMut(Option<Duration>),
        how: u8,
    ) -> Wake<S> {
        let start = Instant::now();
        if let Some(wake) = self.look(ready) {
            return wake;
        }
        let budget = match timeout {
            Some(t) => poll.0.min(t),
            None => poll.0,
        };
        let paused = self.poll_paused_until.is_some_and(|until| start < until);
        if !budget.is_zero() && !paused {
            if let Some(_turn) = PollTurn::take() {
                let mut looked = Duration::ZERO;
                loop {
                    let spun = start.elapsed();
                    if spun - looked >= POLL_LOST {
                        self.poll_paused_until = Some(start + spun + POLL_PAUSE);
                        break;
                    }
                    if spun >= budget {
                        break;
                    }
                    looked = spun;
                    if spun < POLL_SPIN_ONLY {
                        std::hint::spin_loop();
                    } else {
                        std::thread::yield_now();
                    }
                    if let Some(wake) = self.look(ready) {
                        return wake;
                    }
                }
            }
        }
        arm();
        let left = timeout.map(|t| t.saturating_sub(start.elapsed()));
        if left == Some(Duration::ZERO) {
            return Wake::Timeout;
        }
        let bell = &self.bell.0;
        bell.sleeping.store(how, Ordering::SeqCst);
        // Looked at again after `sleeping` is visible: a ring from here on wakes us, and
        // one before it is seen now.
        let wake = self.look(ready);
        if wake.is_none() {
            sleep(left);
            if let Some(slice) = &mut self.slice {
                slice.woke();
            }
        }
        self.bell.0.sleeping.store(AWAKE, Ordering::SeqCst);
        wake.or_else(|| self.look(ready)).unwrap_or(Wake::Timeout)
    }

    /// A stop, a ring since the last return, or `ready`.
    fn look(&mut self, ready: &mut dyn FnMut() -> bool) -> Option<Wake<S>> {
        if let Some(s) = self.control.stop_reason().filter(|_| !self.lingering) {
            return Some(Wake::Stop(s));
        }
        let rings = self.bell.0.rings.load(Ordering::SeqCst);
        if rings != self.seen {
            self.seen = rings;
            return Some(Wake::Work);
        }
        ready().then_some(Wake::Work)
    }
}

/// The thread did not end within the bound of [`Worker::join`]; it was left to end on its own.
#[derive(Debug, thiserror::Error)]
#[error("worker thread {0} did not stop in time; left to end on its own")]
pub struct Stuck(pub String);

/// A device's handle on one worker thread. Dropping it stops nothing by itself: the device
/// calls [`Worker::stop`] and [`Worker::join`] in its reset and its drop (the framework does
/// not know a device's workers).
pub struct Worker<S> {
    bell: Bell,
    control: Arc<Control<S>>,
    thread: Option<JoinHandle<()>>,
    name: String,
}

impl<S: Copy + Send + 'static> Worker<S> {
    /// Starts the thread `name` on a bell of its own, running `body` with its [`Waiter`];
    /// `poll` is how long the waiter watches for work before it sleeps.
    pub fn spawn(
        name: impl Into<String>,
        poll: Poll,
        body: impl FnOnce(Waiter<S>) + Send + 'static,
    ) -> std::io::Result<Worker<S>> {
        Self::spawn_on(&Bell::new(), name, poll, body)
    }

    /// As [`Worker::spawn`], on `bell`: the worker takes over the bell from any worker before.
    pub fn spawn_on(
        bell: &Bell,
        name: impl Into<String>,
        poll: Poll,
        body: impl FnOnce(Waiter<S>) + Send + 'static,
    ) -> std::io::Result<Worker<S>> {
        let name = name.into();
        let mut waiter = Waiter::new(bell, poll);
        let control = waiter.control.clone();
        let thread = std::thread::Builder::new().name(name.clone()).spawn(move || {
            let _ended = Ended(waiter.control.clone());
            // Registered by the thread itself before its first wait, so a ring that finds it
            // parked unparks it (registered by the spawner after the spawn, a thread that
            // parked first missed the rings before). Rung before this: seen at its first
            // look, since `seen` was read before the spawn.
            *sync::lock(&waiter.bell.0.thread) = Some(std::thread::current());
            waiter.slice = Some(crate::sched::SliceChoice::for_this_thread());
            body(waiter);
        })?;
        Ok(Worker { bell: bell.clone(), control, thread: Some(thread), name })
    }

    /// Wakes the thread (rings its bell).
    pub fn wake(&self) {
        self.bell.ring();
    }

    /// The worker's bell.
    pub fn bell(&self) -> Bell {
        self.bell.clone()
    }

    /// Asks the thread to stop for `why` and wakes it; the first reason given is kept.
    pub fn stop(&self, why: S) {
        {
            let mut stop = sync::lock(&self.control.stop);
            if stop.is_none() {
                *stop = Some(why);
            }
        }
        self.control.stopping.store(true, Ordering::Release);
        // This thread itself, not the bell's: a successor may hold the bell already. One
        // sleeping in the kernel is woken through the bell's eventfd (a successor woken too
        // looks, finds nothing, and sleeps again).
        if let Some(t) = &self.thread {
            t.thread().unpark();
        }
        self.bell.0.kick();
    }

    /// Waits for the thread's body to end, at most `bound`; a thread still running then is
    /// left to end on its own ([`Stuck`]). A body that panicked counts as ended (the panic
    /// was reported on its thread). The thread itself is not joined: once its body has
    /// returned, what is left of its exit can wait on the kernel for as long as a transfer
    /// takes (a thread's io_uring workers end with it, and one may be blocked in a
    /// filesystem), and a reset or a disconnect must not wait for that.
    pub fn join(mut self, bound: Duration) -> Result<(), Stuck> {
        let done = sync::lock(&self.control.done);
        let (done, _) = sync::wait_timeout_while(&self.control.ended, done, bound, |d| !*d);
        let ended = *done;
        drop(done);
        // Dropping the handle detaches the thread, ended or not.
        self.thread.take();
        if ended {
            Ok(())
        } else {
            Err(Stuck(std::mem::take(&mut self.name)))
        }
    }

    /// Whether the thread has ended.
    pub fn ended(&self) -> bool {
        *sync::lock(&self.control.done)
    }
}

impl<S> std::fmt::Debug for Worker<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Worker").field("name", &self.name).finish_non_exhaustive()
    }
}

/// Marks the worker ended when its body returns or unwinds.
struct Ended<S>(Arc<Control<S>>);

impl<S> Drop for Ended<S> {
    fn drop(&mut self) {
        *sync::lock(&self.0.done) = true;
        self.0.ended.notify_all();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    enum Why {
        Reset,
        Delete,
    }

    /// A worker that counts the wakes it sees until it is stopped, then reports the reason.
    fn counter(poll: Poll) -> (Worker<Why>, std::sync::mpsc::Receiver<Result<u32, Why>>) {
        let (tx, rx) = std::sync::mpsc::channel();
        let worker = Worker::spawn("umdev-test-worker", poll, move |mut w: Waiter<Why>| {
            let mut seen = 0;
            loop {
                match w.wait(|| false, None) {
                    Wake::Work => {
                        seen += 1;
                        let _ = tx.send(Ok(seen));
                    }
                    Wake::Timeout => {}
                    Wake::Stop(why) => {
                        let _ = tx.send(Err(why));
                        return;
                    }
                }
            }
        })
        .unwrap();
        (worker, rx)
    }

    #[test]
    fn every_wake_is_seen_and_a_stop_carries_its_reason() {
        for poll in [Poll::NONE, Poll(Duration::from_millis(1))] {
            let (worker, rx) = counter(poll);
            for n in 1..=100 {
                worker.wake();
                // The worker may fold wakes that come before it looks into one; wait for each.
                assert_eq!(rx.recv().unwrap(), Ok(n));
            }
            worker.stop(Why::Delete);
            worker.stop(Why::Reset); // the first reason stays
            assert_eq!(rx.recv().unwrap(), Err(Why::Delete));
            worker.join(Duration::from_secs(60)).unwrap();
        }
    }

    #[test]
    fn a_ready_condition_and_a_timeout_end_a_wait() {
        let (tx, rx) = std::sync::mpsc::channel();
        let flag = Arc::new(AtomicBool::new(false));
        let seen = flag.clone();
        let worker = Worker::spawn("umdev-test-ready", Poll::NONE, move |mut w: Waiter<Why>| {
            assert_eq!(w.wait(|| false, Some(Duration::from_millis(1))), Wake::Timeout);
            tx.send(()).unwrap();
            // Woken by the condition alone (a doorbell in shared memory): the timeout is the
            // worker's periodic look, as a mapped doorbell page needs.
            while w.wait(|| seen.load(Ordering::Acquire), Some(Duration::from_millis(1))) != Wake::Work {}
            tx.send(()).unwrap();
            assert!(matches!(w.wait(|| false, None), Wake::Stop(Why::Reset)));
        })
        .unwrap();
        rx.recv().unwrap();
        flag.store(true, Ordering::Release);
        rx.recv().unwrap();
        worker.stop(Why::Reset);
        worker.join(Duration::from_secs(60)).unwrap();
    }

    #[test]
    fn join_waits_for_the_end_and_gives_up_on_a_stuck_thread() {
        let (release, hold) = std::sync::mpsc::channel::<()>();
        let worker = Worker::spawn("umdev-test-stuck", Poll::NONE, move |_w: Waiter<Why>| {
            let _ = hold.recv();
        })
        .unwrap();
        worker.stop(Why::Reset);
        assert!(!worker.ended());
        assert!(worker.join(Duration::from_millis(10)).is_err(), "still blocked");
        drop(release);
        // A panicking body counts as ended.
        let worker =
            Worker::spawn("umdev-test-panic", Poll::NONE, |_w: Waiter<Why>| panic!("on purpose")).unwrap();
        worker.join(Duration::from_secs(60)).unwrap();
    }

    #[test]
    fn a_stopped_worker_lingers_until_rung_or_its_bound() {
        let (tx, rx) = std::sync::mpsc::channel();
        let worker = Worker::spawn("umdev-test-linger", Poll::NONE, move |mut w: Waiter<Why>| {
            assert!(matches!(w.wait(|| false, None), Wake::Stop(Why::Delete)));
            tx.send(()).unwrap();
            // Still stopped: a ring ends the linger, then the bound does.
            assert_eq!(w.linger(|| false, Duration::from_secs(60)), Wake::Work);
            assert_eq!(w.linger(|| false, Duration::from_millis(1)), Wake::Timeout);
            assert_eq!(w.stopped(), Some(Why::Delete));
        })
        .unwrap();
        worker.stop(Why::Delete);
        rx.recv().unwrap();
        worker.wake();
        worker.join(Duration::from_secs(60)).unwrap();
    }

    /// Sleeps in poll(2) on the bell's eventfd and an eventfd of its own (as an io_uring
    /// would on its completions).
    struct PollSleep {
        bell: Bell,
        own: Arc<EventFd>,
        blocks: Arc<AtomicUsize>,
    }

    impl KernelSleep for PollSleep {
        fn pending(&mut self) -> bool {
            // A readable own eventfd: consumed here, as a reaped completion would be.
            self.own.read().is_ok()
        }
        fn block(&mut self, timeout: Option<Duration>) {
            use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
            self.blocks.fetch_add(1, Ordering::SeqCst);
            let kick = self.bell.eventfd().unwrap();
            // SAFETY: the eventfd outlives the borrow.
            let own = unsafe { BorrowedFd::borrow_raw(self.own.as_raw_fd()) };
            let mut fds = [PollFd::new(kick, PollFlags::POLLIN), PollFd::new(own, PollFlags::POLLIN)];
            let t =
                timeout.map_or(PollTimeout::NONE, |t| PollTimeout::try_from(t).unwrap_or(PollTimeout::MAX));
            let _ = poll(&mut fds, t);
            // Drain the kick: the next sleep blocks again.
            let mut b = [0u8; 8];
            let _ = nix::unistd::read(kick, &mut b);
        }
    }

    #[test]
    fn a_worker_sleeping_in_the_kernel_wakes_on_a_ring_its_own_event_and_a_stop() {
        let (tx, rx) = std::sync::mpsc::channel();
        let own = Arc::new(EventFd::new(EFD_NONBLOCK).unwrap());
        let blocks = Arc::new(AtomicUsize::new(0));
        let bell = Bell::new();
        let mut sleeper = PollSleep { bell: bell.clone(), own: own.clone(), blocks: blocks.clone() };
        let worker =
            Worker::spawn_on(&bell, "umdev-test-kernel", Poll::NONE, move |mut w: Waiter<Why>| loop {
                let wake = w.wait_in(|| false, None, false, &mut sleeper);
                let _ = tx.send(wake);
                if matches!(wake, Wake::Stop(_)) {
                    return;
                }
            })
            .unwrap();
        // Each wake is waited for after the worker is known to block (its count moved), so
        // each one comes through the eventfd, not a look before sleeping.
        let blocked = |n: usize| {
            while blocks.load(Ordering::SeqCst) < n {
                std::thread::yield_now();
            }
        };
        blocked(1);
        worker.wake();
        assert_eq!(rx.recv().unwrap(), Wake::Work, "a ring");
        blocked(2);
        own.write(1).unwrap();
        assert_eq!(rx.recv().unwrap(), Wake::Work, "its own event");
        blocked(3);
        worker.stop(Why::Reset);
        assert_eq!(rx.recv().unwrap(), Wake::Stop(Why::Reset), "a stop");
        worker.join(Duration::from_secs(60)).unwrap();
    }

    #[test]
    fn an_armed_wait_arms_once_before_its_last_look_and_never_while_work_is_seen() {
        // Work that shows only once armed (a host that writes the shadow doorbell and rings
        // only when asked): the look after arming finds it, so the wait returns without a
        // ring, whether or not it polled first.
        let bell = Bell::new();
        let (tx, rx) = std::sync::mpsc::channel();
        let worker =
            Worker::spawn_on(&bell, "umdev-test-armed", Poll(Duration::from_millis(1)), move |mut w| {
                let armed = std::cell::Cell::new(0u32);
                let wake = w.wait_armed(
                    || armed.get() > 0,
                    || armed.set(armed.get() + 1),
                    Some(Duration::from_secs(60)),
                );
                let _ = tx.send((wake, armed.get()));
                // Work already there: found by the first look, nothing armed.
                let armed = std::cell::Cell::new(0u32);
                let wake = w.wait_armed(|| true, || armed.set(armed.get() + 1), None);
                let _ = tx.send((wake, armed.get()));
                let _ = w.wait(|| false, None);
            })
            .unwrap();
        assert_eq!(rx.recv().unwrap(), (Wake::Work, 1), "armed once, then seen");
        assert_eq!(rx.recv().unwrap(), (Wake::Work, 0), "seen at once, not armed");
        worker.stop(Why::Reset);
        worker.join(Duration::from_secs(60)).unwrap();
    }

    #[test]
    fn a_bell_is_the_same_as_its_clones_only() {
        let (a, b) = (Bell::new(), Bell::new());
        assert!(a.same(&a.clone()) && !a.same(&b));
    }

    #[test]
    fn polling_turns_are_bounded_by_spare_cpus() {
        let turns: Vec<_> = std::iter::from_fn(PollTurn::take).take(1024).collect();
        let spare = std::thread::available_parallelism().map_or(1, |n| n.get()).saturating_sub(1).max(1);
        // Other tests may hold turns meanwhile: never more than the spare CPUs.
        assert!(turns.len() <= spare);
        drop(turns);
    }

    /// A waiter of its own, on this thread, polling up to `poll`.
    fn waiter(poll: Poll) -> Waiter<Why> {
        Waiter::new(&Bell::new(), poll)
    }

    #[test]
    fn a_poll_that_loses_its_cpu_for_a_slice_pauses_polling() {
        let mut w = waiter(Poll(Duration::from_millis(50)));
        let t0 = Instant::now();
        // The second look stands for a CPU lost for 2 ms. It is a poll's look only if a turn
        // was free (other tests may hold them): try until one was.
        for _ in 0..1000 {
            let mut looks = 0;
            let ready = || {
                looks += 1;
                if looks == 2 {
                    std::thread::sleep(2 * POLL_LOST);
                }
                false
            };
            assert_eq!(w.wait(ready, Some(Duration::from_millis(5))), Wake::Timeout);
            if w.poll_paused_until.is_some() {
                break;
            }
        }
        let until = w.poll_paused_until.expect("a poll lost its CPU and paused");
        assert!(until >= t0 + POLL_PAUSE);
    }

    #[test]
    fn a_paused_waiter_does_not_poll() {
        let mut w = waiter(Poll(Duration::from_millis(50)));
        w.poll_paused_until = Some(Instant::now() + Duration::from_secs(3600));
        let mut looks = 0;
        assert_eq!(
            w.wait(
                || {
                    looks += 1;
                    false
                },
                Some(Duration::from_millis(20))
            ),
            Wake::Timeout
        );
        // The first look, the one after announcing the sleep, the one after it: no poll's.
        assert!(looks <= 3, "{looks} looks");
    }
}
