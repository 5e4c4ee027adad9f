//! Requests a device's workers take on, tracked by the framework: each ends exactly once, and
//! each is cancelled when the guest memory it holds pins in is unmapped, the device is reset,
//! or the client leaves.
//!
//! The framework ([`crate::pci::PciDevice`]) owns a device's [`Requests`] and the client's
//! [`DeviceContext`]; a device hands each of its workers a [`Lane`] and takes a [`Permit`] per
//! request from it ([`Lane::begin`]). A permit carries:
//!
//! - the request's [`Completion`]: completing the permit reports the outcome; dropping it
//!   unfinished (an early return, a forgotten path, a panic unwinding through the worker)
//!   reports the completion's documented failure instead;
//! - the client's context, for the request's guest accesses ([`Permit::ctx`]);
//! - the request's pins, taken through the permit ([`Permit::pin_pages`] for page numbers,
//!   [`Permit::pin_bytes`] for a byte range), so the framework knows which IOVA ranges each
//!   request holds.
//!
//! A DMA_UNMAP over a range some requests hold pins in cancels them ([`Cancel::Unmapped`]);
//! a reset or a detach cancels every request ([`Cancel::Reset`]). The device sees it at its
//! next look ([`Permit::cancelled`]: between blocks of a transfer, before a wait) and ends
//! the request with its documented status; its pins go with the permit, and the engine's
//! unmap, which waits for them, returns. A detach also waits, boundedly, for every request
//! to end, so nothing of the client's connection outlives it.
//!
//! **Looking while holding pins.** [`Permit::pin_pages`] returns a reference that borrows the
//! permit mutably, so `permit.cancelled()` cannot be called while it lives: let it go and
//! reach the pins through [`Permit::pins`] instead (a shared borrow, as `cancelled` is).
//! [`Permit::pin_bytes`] returns a guard, [`PinnedBytes`], that answers
//! [`PinnedBytes::cancelled`] itself and reaches the rest of the permit through
//! [`PinnedBytes::permit`], so a transfer loop keeps it and looks between blocks:
//!
//! ```ignore
//! let buf = permit.pin_bytes(iova, len, Prot::READ)?;
//! for at in (0..len).step_by(BLOCK) {
//!     if buf.cancelled().is_some() {
//!         return Err(Stopped); // the documented status of a cancelled request
//!     }
//!     buf.read(at, &mut block[..n])?;
//! }
//! ```
//!
//! **A worker that waits learns of a cancellation from its lane's wake.** A look between
//! blocks finds a cancellation, but a worker asleep with a request in hand (paused, waiting
//! for more work or for the guest) finds nothing until it is woken. The `wake` given to
//! [`Requests::lane`] is called for that whenever a request of the lane is cancelled: it
//! rings the worker's [`Bell`](crate::worker::Bell), the worker's wait returns, and the
//! worker looks at its permits. A device whose workers never sleep holding a permit still
//! gives one (a ring costs nothing while the worker is awake).
//!
//! **What a request cancelled by a reset reports: nothing.** A reset (DEVICE_RESET, or the
//! one that ends a detach) cancels every request with [`Cancel::Reset`] before it turns the
//! device's bus mastering off (so a guest access that fails for that is a cancelled
//! request's) and before the device's own reset runs (a request that begins before that reset
//! has returned begins cancelled: [`Requests::resetting`]), and holds the device's interrupts
//! until the framework's reset of them that follows. The request still ends through its
//! worker, exactly once: dropped, its completion's [`Completion::fail`] runs; completed,
//! [`Completion::complete`]. By then the device's registers are back at their power-on
//! values, and the guest that reset the device expects no status and no interrupt from what
//! it asked before, so that completion must write no status, no result and raise nothing.
//! Two things make sure, and a device does both: its worker ends a request it finds
//! cancelled by a reset with [`Permit::into_inner`] (no report); and since a request may end
//! just before its worker looks, each request carries the device's generation number as it
//! began, which the device's reset bumps, and its completion reports only if the number is
//! still current, comparing under the lock the reset bumps it under (testdev, ccw, nvme and
//! the `checksum_device` example do so). A request cancelled by an unmap ([`Cancel::Unmapped`])
//! does report, with the status the device documents for it.
//!
//! Each lane has its own lock, and workers of different queues share no lock or counter. A
//! worker that both begins and ends its lane's requests on its own thread (nvme's queue
//! workers) claims the lane ([`Lane::claim`]): the lock is then biased to it
//! ([`BiasedLock`]: it takes it a few times per request with plain stores; an unmap, a reset
//! or a count looks at the lane from elsewhere and pays for both sides). A lane whose requests
//! begin on one thread and end on another (ccw's and testdev's: the connection thread starts
//! them) stays unclaimed, a spin lock. A permit holds no reference count of its own: the lane keeps itself, the client's
//! context and what its requests share ([`Completion::Shared`]) while any permit is open, so
//! a request at queue depth 32 does no locked instruction in the framework (each would wait
//! for the stores of the transfer before it).
//!
//! The rule that keeps a permit's pointers sound (cited by its SAFETY comments as (R1)):
//! **a lane, and each context a permit of it was given, stay allocated while the lane counts
//! a permit open.** `LaneState::open` counts permits from [`Lane::begin`] to the end of their
//! drop. While it is above zero the lane's handles keep it, and a handle dropped meanwhile
//! first leaves an `Arc` of it in `LaneState::keep`; so does a waiter for idleness (which
//! the last permit notifies after its hold) while `LaneState::waiters` counts it. So a lane
//! whose permits open and close one at a time counts no reference per request. A context
//! the lane replaces goes to `LaneState::retired` instead of being dropped. The permit that
//! counts the last one down lets go of both after its hold and its notification (of `keep`
//! only if no one waits: it notifies holding a clone, and the last waiter to leave an idle
//! lane lets go), after which it touches nothing of the lane.
//! [`serve`] runs a request's handling so that a panic fails that request and the worker
//! goes on.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, Weak};
use std::time::{Duration, Instant};

use smallvec::SmallVec;
use umdev_pinning::sync::{self, BiasedGuard, BiasedLock};
use umdev_pinning::{AccessError, PinError, PinnedPages, Prot, PAGE_SIZE};

use crate::guest::{DeviceContext, GuestError};

/// How a request ends, for the device to report (in guest memory through `ctx`, the
/// request's context, or in the device's registers).
pub trait Completion: Send + 'static {
    /// What the request produced.
    type Outcome;
    /// What every request of a lane shares (its queue, say): given to the lane once
    /// ([`Requests::lane_with`]) and to each completion by reference, so that a request
    /// carries no reference count of it. `()` for nothing.
    type Shared: Send + Sync + 'static;
    /// The request finished with `outcome`.
    fn complete(self, outcome: Self::Outcome, ctx: &DeviceContext, shared: &Self::Shared);
    /// The request was dropped unfinished (or its handling panicked): report the device's
    /// documented failure.
    fn fail(self, ctx: &DeviceContext, shared: &Self::Shared);
}

/// Why the framework cancelled a request.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Cancel {
    /// Guest memory the request holds pins in is being unmapped: stop using it. Once the
    /// request lets go of those pins ([`Permit::release_pins`]) the unmap is satisfied and
    /// the cancellation withdrawn.
    Unmapped,
    /// The device was reset, or the client left: the request's result no longer matters.
    Reset,
}

/// No client is attached: the request could not start. Its completion comes back
/// unreported.
pub struct Detached<C>(pub C);

impl<C> std::fmt::Debug for Detached<C> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Detached")
    }
}

impl<C> std::fmt::Display for Detached<C> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("no client is attached")
    }
}

impl<C> std::error::Error for Detached<C> {}

/// A device's requests, across its lanes, and the client's context. Cheap to clone.
#[derive(Clone, Default)]
pub struct Requests {
    inner: Arc<Tracker>,
}

#[derive(Default)]
struct Tracker {
    /// The client's context while one is attached.
    context: Mutex<Option<Arc<DeviceContext>>>,
    /// Bumped by every attach and detach: a lane refreshes its copy of the context when it
    /// has moved.
    attachment: AtomicU64,
    /// Resets under way ([`Requests::resetting`]): while above zero a request begins
    /// cancelled. Next to `attachment`, which every begin reads too, and written only by
    /// resets.
    resetting: AtomicUsize,
    lanes: Mutex<Vec<Weak<dyn AsCore>>>,
}

impl Requests {
    /// No requests, no client.
    pub fn new() -> Requests {
        Requests::default()
    }

    /// A lane for one worker; `wake` wakes that worker when one of its requests is cancelled.
    ///
    /// This is how a worker asleep with a request in hand learns of the cancellation: a look
    /// ([`Permit::cancelled`]) between blocks finds it, but a worker waiting (paused, or for
    /// the guest) only looks once woken. So `wake` rings the worker's
    /// [`Bell`](crate::worker::Bell), and the worker looks at its permits whenever its wait
    /// returns.
    ///
    /// It is called on the thread that cancels (the connection thread, in a DMA_UNMAP, a
    /// reset or a detach), with no lock of the lane's held but with whatever that thread
    /// holds (a reset may hold the device's lock): it should only ring the worker (a
    /// [`crate::worker::Bell`]), not begin or end requests or take the device's lock.
    pub fn lane(&self, wake: impl Fn() + Send + Sync + 'static) -> Lane {
        self.lane_with((), wake)
    }

    /// A lane whose requests share `shared` ([`Completion::Shared`]).
    pub fn lane_with<S: Send + Sync + 'static>(
        &self,
        shared: S,
        wake: impl Fn() + Send + Sync + 'static,
    ) -> Lane<S> {
        let inner = Arc::new(LaneInner {
            core: LaneCore {
                tracker: self.inner.clone(),
                state: BiasedLock::new(LaneState::default()),
                cancelled: AtomicUsize::new(0),
                idle: Mutex::new(()),
                idled: Condvar::new(),
                wake: Box::new(wake),
            },
            shared,
        });
        let mut lanes = sync::lock(&self.inner.lanes);
        lanes.retain(|l| l.strong_count() > 0);
        let weak: Weak<dyn AsCore> = Arc::downgrade(&inner) as Weak<LaneInner<S>>;
        lanes.push(weak);
        Lane { inner }
    }

    /// The client's context, if one is attached.
    pub fn context(&self) -> Option<DeviceContext> {
        sync::lock(&self.inner.context).as_deref().cloned()
    }

    /// A client connected (the framework's call).
    pub fn attach(&self, ctx: DeviceContext) {
        *sync::lock(&self.inner.context) = Some(Arc::new(ctx));
        self.inner.attachment.fetch_add(1, Ordering::AcqRel);
    }

    /// The client left (the framework's call): no request starts from here on, and every
    /// request in flight is cancelled ([`Cancel::Reset`]).
    pub fn detach(&self) {
        *sync::lock(&self.inner.context) = None;
        let attachment = self.inner.attachment.fetch_add(1, Ordering::AcqRel) + 1;
        // The lanes' copies go too: a context holds the client's connection.
        self.each_lane(|lane| {
            let mut st = lane.state();
            st.replace_ctx(None);
            st.attachment = attachment;
        });
        self.cancel_all();
    }

    /// A reset begins: cancels every request in flight ([`Cancel::Reset`]), and every request
    /// that begins until the [`Resetting`] returned is dropped begins cancelled too.
    ///
    /// A worker may begin a request after the cancellation, before the device's own reset
    /// makes its work stale (nvme's worker fetching the next command of a burst): without
    /// this, that request would meet the bus mastering the reset turns off, fail, and report
    /// the failure (a Data Transfer Error in nvme's error log) for a command the guest reset
    /// away.
    pub fn resetting(&self) -> Resetting<'_> {
        // Release, before the lanes' locks `cancel_all` takes: a begin that takes a lane's
        // lock after it finds the count raised (its Acquire load is made under that lock), and
        // one that took it before is in flight and cancelled.
        self.inner.resetting.fetch_add(1, Ordering::Release);
        self.cancel_all();
        Resetting { requests: self }
    }

    /// Cancels every request in flight ([`Cancel::Reset`]): a reset.
    pub fn cancel_all(&self) {
        self.each_lane(|lane| {
            let mut st = lane.state();
            let mut any = false;
            for slot in st.slots.iter_mut().filter(|s| s.live) {
                if slot.cancel.replace(Cancel::Reset).is_none() {
                    lane.cancelled.fetch_add(1, Ordering::Release);
                }
                any = true;
            }
            drop(st);
            if any {
                (lane.wake)();
            }
        });
    }

    /// `[iova, iova + len)` is being unmapped: cancels ([`Cancel::Unmapped`]) the requests
    /// holding pins (or about to take them) in it, and wakes their workers.
    pub fn cancel_overlapping(&self, iova: u64, len: u64) {
        let end = iova.saturating_add(len);
        self.each_lane(|lane| {
            let mut st = lane.state();
            let mut any = false;
            for slot in st.slots.iter_mut().filter(|s| s.live) {
                if slot.ranges.iter().any(|&(s, e)| s < end && iova < e) {
                    if slot.cancel.is_none() {
                        slot.cancel = Some(Cancel::Unmapped);
                        lane.cancelled.fetch_add(1, Ordering::Release);
                    }
                    any = true;
                }
            }
            drop(st);
            if any {
                log::debug!("an unmap of {iova:#x}+{len:#x} cancels requests holding pins in it");
                (lane.wake)();
            }
        });
    }

    /// Requests in flight now.
    pub fn in_flight(&self) -> usize {
        let mut n = 0;
        self.each_lane(|lane| n += lane.state().open);
        n
    }

    /// Waits until no request is in flight, at most `bound`; false if some still are.
    pub fn wait_idle(&self, bound: Duration) -> bool {
        let deadline = Instant::now() + bound;
        let mut idle = true;
        for held in self.lanes() {
            let lane = held.core();
            // Held from the first look at `open` until the wait: the permit that closes the
            // last request notifies under it, so the notification cannot fall between the two.
            let mut waiting = sync::lock(&lane.idle);
            {
                let mut st = lane.state();
                st.waiters += 1;
                // The permit that closes the last request notifies after its hold, when this
                // waiter (its bound passed) and the lane's handles may be gone: the lane is
                // kept while anyone waits (R1).
                if st.keep.is_none() {
                    st.keep = Some(held.clone());
                }
            }
            while lane.state().open > 0 {
                let left = deadline.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    idle = false;
                    break;
                }
                waiting = sync::wait_timeout(&lane.idled, waiting, left).0;
            }
            let left = {
                let mut st = lane.state();
                st.waiters -= 1;
                // The last waiter of an idle lane lets go of what kept it (R1); with permits
                // open, the one that closes the last lets go.
                if st.waiters == 0 && st.open == 0 {
                    st.keep.take()
                } else {
                    None
                }
            };
            drop(waiting);
            drop(left);
        }
        idle
    }

    /// The lanes alive now.
    fn lanes(&self) -> Vec<Arc<dyn AsCore>> {
        sync::lock(&self.inner.lanes).iter().filter_map(Weak::upgrade).collect()
    }

    fn each_lane(&self, mut f: impl FnMut(&LaneCore)) {
        for lane in &self.lanes() {
            f(lane.core());
        }
    }
}

impl std::fmt::Debug for Requests {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Requests").field("in_flight", &self.in_flight()).finish_non_exhaustive()
    }
}

/// A reset under way ([`Requests::resetting`]): requests begin cancelled until it is dropped,
/// once the device's own reset has made the old work stale.
#[must_use = "requests begin cancelled only while it is held"]
pub struct Resetting<'a> {
    requests: &'a Requests,
}

impl Drop for Resetting<'_> {
    fn drop(&mut self) {
        self.requests.inner.resetting.fetch_sub(1, Ordering::Release);
    }
}

impl std::fmt::Debug for Resetting<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Resetting").finish_non_exhaustive()
    }
}

/// One worker's requests: permits are taken here, under the lane's own lock. Clones share
/// the lane.
///
/// A cancellation of one of its requests calls the lane's `wake` ([`Requests::lane`]): that
/// is how its worker, if it sleeps with a request in hand, learns of it.
pub struct Lane<S: Send + Sync + 'static = ()> {
    inner: Arc<LaneInner<S>>,
}

struct LaneInner<S> {
    core: LaneCore,
    shared: S,
}

/// A lane as the tracker sees it, whatever its requests share.
trait AsCore: Send + Sync {
    fn core(&self) -> &LaneCore;
}

impl<S: Send + Sync> AsCore for LaneInner<S> {
    fn core(&self) -> &LaneCore {
        &self.core
    }
}

struct LaneCore {
    tracker: Arc<Tracker>,
    state: BiasedLock<LaneState>,
    /// Requests of the lane whose slot holds a cancellation: until there is one, a permit's
    /// look ([`Permit::cancelled`]) is this one load.
    cancelled: AtomicUsize,
    /// Held by a waiter for the lane to idle while it looks and waits (see `wait_idle`)...
    idle: Mutex<()>,
    /// ...and notified when `open` drops to 0 with waiters.
    idled: Condvar,
    wake: Box<dyn Fn() + Send + Sync>,
}

#[derive(Default)]
struct LaneState {
    /// The context as of `attachment`: the lane's own copy.
    ctx: Option<Arc<DeviceContext>>,
    /// Contexts replaced while permits given them were open (R1).
    retired: Vec<Arc<DeviceContext>>,
    /// The lane itself, left by a handle dropped while a permit is open or by a waiter (R1).
    keep: Option<Arc<dyn AsCore>>,
    attachment: u64,
    slots: Vec<Slot>,
    free: Vec<u32>,
    open: usize,
    waiters: usize,
}

/// A request's record in its lane: reused by the next request.
struct Slot {
    live: bool,
    /// The IOVA ranges its pins cover (or are about to).
    ranges: SmallVec<[(u64, u64); 4]>,
    /// Why it was cancelled; counted in the lane's `cancelled` while set.
    cancel: Option<Cancel>,
}

impl LaneState {
    /// Sets the lane's context, keeping the old one while permits may use it (R1).
    fn replace_ctx(&mut self, ctx: Option<Arc<DeviceContext>>) {
        if let Some(old) = std::mem::replace(&mut self.ctx, ctx) {
            if self.open > 0 {
                self.retired.push(old);
            }
        }
    }
}

impl LaneCore {
    /// The lane's state, from anywhere (the worker's own takes are cheap).
    #[inline]
    fn state(&self) -> BiasedGuard<'_, LaneState> {
        self.state.lock()
    }
}

impl<S: Send + Sync + 'static> Clone for Lane<S> {
    fn clone(&self) -> Self {
        Lane { inner: self.inner.clone() }
    }
}

impl<S: Send + Sync + 'static> Drop for Lane<S> {
    fn drop(&mut self) {
        let mut st = self.inner.core.state();
        if st.open > 0 && st.keep.is_none() {
            // Permits are open and this may be the last handle: they keep the lane now (R1).
            st.keep = Some(self.inner.clone());
        }
    }
}

impl<S: Send + Sync + 'static> Lane<S> {
    /// The calling thread begins and ends (nearly) all of this lane's requests: the lane's
    /// lock becomes its, taken with plain stores (see the module documentation). Only the
    /// first claim counts.
    pub fn claim(&self) {
        drop(self.inner.core.state.lock_claiming());
    }

    /// Takes on a request that ends through `completion`; [`Detached`] (with `completion`
    /// back, unreported) if no client is attached.
    pub fn begin<C: Completion<Shared = S>>(&self, completion: C) -> Result<Permit<C>, Detached<C>> {
        let lane = &self.inner.core;
        let mut st = lane.state();
        let attachment = lane.tracker.attachment.load(Ordering::Acquire);
        if st.attachment != attachment {
            // A copy of the lane's own: an `Arc` shared by every lane would have the workers
            // of different queues touch one line.
            let ctx = sync::lock(&lane.tracker.context).as_deref().cloned().map(Arc::new);
            st.replace_ctx(ctx);
            st.attachment = attachment;
        }
        let Some(ctx) = st.ctx.as_deref().map(NonNull::from) else { return Err(Detached(completion)) };
        let index = match st.free.pop() {
            Some(i) => i,
            None => {
                st.slots.push(Slot { live: false, ranges: SmallVec::new(), cancel: None });
                st.slots.len() as u32 - 1
            }
        };
        // A slot is freed with no ranges and no cancellation (`Permit::drop`).
        let slot = &mut st.slots[index as usize];
        slot.live = true;
        // Acquire, under the lane's lock: pairs with `Requests::resetting`.
        if lane.tracker.resetting.load(Ordering::Acquire) > 0 {
            slot.cancel = Some(Cancel::Reset);
            lane.cancelled.fetch_add(1, Ordering::Release);
        }
        st.open += 1;
        drop(st);
        let lane = NonNull::from(&*self.inner);
        Ok(Permit { completion: Some(completion), lane, index, ctx, pins: SmallVec::new(), released: 0 })
    }

    /// The client's context, if one is attached.
    pub fn context(&self) -> Option<DeviceContext> {
        sync::lock(&self.inner.core.tracker.context).as_deref().cloned()
    }

    /// Requests of this lane in flight now.
    pub fn in_flight(&self) -> usize {
        self.inner.core.state().open
    }

    /// What the lane's requests share.
    pub fn shared(&self) -> &S {
        &self.inner.shared
    }
}

impl<S: Send + Sync + 'static> std::fmt::Debug for Lane<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Lane").field("in_flight", &self.in_flight()).finish_non_exhaustive()
    }
}

/// One request in flight: complete it, or drop it to fail it.
pub struct Permit<C: Completion> {
    completion: Option<C>,
    /// Its lane, kept while the permit is open (R1).
    lane: NonNull<LaneInner<C::Shared>>,
    index: u32,
    /// The context it was given, kept while the permit is open (R1).
    ctx: NonNull<DeviceContext>,
    /// The request's pins, released with the permit (or by [`Permit::release_pins`]).
    pins: SmallVec<[PinnedPages; 1]>,
    /// How many times [`Permit::release_pins`] ran: a [`BytesHandle`] of before names pins
    /// that are gone.
    released: u32,
}

// SAFETY: (R1) the pointers are shared references to a lane and a context that outlive the
// permit; both are `Sync` (a lane's parts are, and `C::Shared` is by its bound), so the
// permit may move to another thread like a pair of `Arc`s. What else it holds is `Send`.
unsafe impl<C: Completion> Send for Permit<C> {}

impl<C: Completion> Permit<C> {
    #[inline]
    fn lane(&self) -> &LaneInner<C::Shared> {
        // SAFETY: (R1) the lane stays allocated while this permit is open.
        unsafe { self.lane.as_ref() }
    }

    /// What the lane's requests share.
    pub fn shared(&self) -> &C::Shared {
        &self.lane().shared
    }

    /// The request's completion (and whatever request data it carries).
    pub fn get(&self) -> &C {
        self.completion.as_ref().expect("present until the permit is consumed")
    }

    /// The request's completion, mutably.
    pub fn get_mut(&mut self) -> &mut C {
        self.completion.as_mut().expect("present until the permit is consumed")
    }

    /// The client's context the request runs in.
    pub fn ctx(&self) -> &DeviceContext {
        // SAFETY: (R1) the context stays allocated while this permit is open.
        unsafe { self.ctx.as_ref() }
    }

    /// Why the request was cancelled, if it was: it should stop at its next block.
    pub fn cancelled(&self) -> Option<Cancel> {
        // Acquire: pairs with the canceller's increment, made under the lock after it set the
        // slot's cancellation, so the lock below finds it.
        let lane = &self.lane().core;
        if lane.cancelled.load(Ordering::Acquire) == 0 {
            return None;
        }
        lane.state().slots[self.index as usize].cancel
    }

    /// Pins the guest pages `pfns` for `prot` with one call to the engine (see
    /// [`DeviceContext::pin_pages`]), as this request's: an unmap of any of them cancels the
    /// request. The pins are kept until [`Permit::release_pins`] or the permit's end.
    ///
    /// The reference returned borrows the permit mutably: to look at [`Permit::cancelled`]
    /// while using the pins, let it go and reach them through [`Permit::pins`] (the last
    /// entry), a shared borrow as `cancelled` is. [`Permit::pin_bytes`] gives a guard that
    /// looks itself.
    pub fn pin_pages(&mut self, pfns: &[u64], prot: Prot) -> Result<&PinnedPages, GuestError> {
        let index = self.pin_announced(
            |ranges| {
                // One range per stretch of consecutive page numbers (a PRP list's 32 pages of
                // a 128 KiB transfer are usually one), found by a compare per page.
                let mut rest = pfns;
                while let Some((&first, tail)) = rest.split_first() {
                    let stretch = tail
                        .iter()
                        .zip(rest)
                        .take_while(|&(&next, &prev)| prev.checked_add(1) == Some(next))
                        .count();
                    let last = rest[stretch];
                    ranges.push(page_span(first, last));
                    rest = &rest[stretch + 1..];
                }
            },
            |ctx| ctx.pin_pages(pfns, prot),
        )?;
        Ok(&self.pins[index])
    }

    /// Pins the pages that hold the guest bytes `[iova, iova + len)` for `prot` with one call
    /// to the engine, as this request's (as [`Permit::pin_pages`]: an unmap of any of those
    /// pages cancels the request, and the pins are kept until [`Permit::release_pins`] or the
    /// permit's end). The range may end exactly at 2^64.
    ///
    /// Refused with [`PinError::Empty`] for `len` 0, and with [`GuestError::NotMapped`] for a
    /// range that runs past 2^64; otherwise the errors are [`DeviceContext::pin_range`]'s.
    ///
    /// The guard returned addresses the bytes from `iova` (its offset 0), and looks at the
    /// request's cancellation itself ([`PinnedBytes::cancelled`]), so a transfer keeps it
    /// while it checks between blocks. Several ranges held at once: pin each, keep its
    /// [`PinnedBytes::handle`], and take the guards back together with [`Permit::bytes`].
    pub fn pin_bytes(&mut self, iova: u64, len: u64, prot: Prot) -> Result<PinnedBytes<'_, C>, GuestError> {
        // The last byte, not the end: a range may end exactly at 2^64.
        let Some(to_last) = len.checked_sub(1) else { return Err(GuestError::Pin(PinError::Empty)) };
        let last_byte = iova.checked_add(to_last).ok_or(GuestError::NotMapped { iova, len })?;
        let (first, last) = (iova / PAGE_SIZE, last_byte / PAGE_SIZE);
        let index = self.pin_announced(
            |ranges| ranges.push(page_span(first, last)),
            |ctx| ctx.pin_range(first * PAGE_SIZE, last - first + 1, prot),
        )?;
        Ok(PinnedBytes { permit: self, index, offset: iova % PAGE_SIZE, size: len })
    }

    /// Announces the ranges `announce` pushes as this request's, then pins with `pin`; the
    /// pins' index in `self.pins`. The ranges go before the engine pins: an unmap that starts
    /// meanwhile (a long lock-mode call) or right after finds them and cancels the request.
    /// On failure they are withdrawn.
    #[inline]
    fn pin_announced(
        &mut self,
        announce: impl FnOnce(&mut SmallVec<[(u64, u64); 4]>),
        pin: impl FnOnce(&DeviceContext) -> Result<PinnedPages, GuestError>,
    ) -> Result<usize, GuestError> {
        let before = {
            let mut st = self.lane().core.state();
            let ranges = &mut st.slots[self.index as usize].ranges;
            let before = ranges.len();
            announce(ranges);
            before
        };
        match pin(self.ctx()) {
            Ok(pins) => {
                self.pins.push(pins);
                Ok(self.pins.len() - 1)
            }
            Err(e) => {
                self.lane().core.state().slots[self.index as usize].ranges.truncate(before);
                Err(e)
            }
        }
    }

    /// The request will reach `[iova, iova + len)` through byte copies
    /// ([`DeviceContext::read_either`] and the like, which pin briefly): a DMA_UNMAP of any of
    /// it cancels the request, as for its own pins, before the client hears that it is done
    /// ([`VfioDevice::dma_unmapped`](crate::VfioDevice::dma_unmapped)). Until
    /// [`Permit::release_pins`] or the end.
    pub fn claim(&mut self, iova: u64, len: u64) {
        let end = iova.saturating_add(len);
        self.lane().core.state().slots[self.index as usize].ranges.push((iova, end));
    }

    /// The request's pins, in the order they were taken.
    pub fn pins(&self) -> &[PinnedPages] {
        &self.pins
    }

    /// A range [`Permit::pin_bytes`] pinned, again, by its [`PinnedBytes::handle`]: a job
    /// that pins two ranges (a source and a destination) holds both guards at once this way,
    /// since each `pin_bytes` borrows the permit. `None` once [`Permit::release_pins`] let go
    /// of the pins the handle names.
    pub fn bytes(&self, handle: BytesHandle) -> Option<PinnedBytes<'_, C>> {
        (handle.released == self.released && handle.index < self.pins.len()).then_some(PinnedBytes {
            permit: self,
            index: handle.index,
            offset: handle.offset,
            size: handle.size,
        })
    }

    /// Lets go of the request's pins (and claims). True if an unmap hit them meanwhile (the request was
    /// cancelled as [`Cancel::Unmapped`]); that cancellation is withdrawn, since the pins the
    /// unmap waits for are gone. A [`Cancel::Reset`] stays.
    pub fn release_pins(&mut self) -> bool {
        self.pins.clear();
        self.released = self.released.wrapping_add(1);
        let lane = &self.lane().core;
        let mut st = lane.state();
        let slot = &mut st.slots[self.index as usize];
        slot.ranges.clear();
        if slot.cancel != Some(Cancel::Unmapped) {
            return false;
        }
        slot.cancel = None;
        lane.cancelled.fetch_sub(1, Ordering::Relaxed);
        true
    }

    /// Ends the request with `outcome` (its pins are released after the completion reports).
    ///
    /// Inline so that the permit is read where the caller keeps it. A call passes it as a
    /// fresh copy, stored just before the completion reads it back with loads of another
    /// width, which the CPU cannot forward from those stores: the loads wait until the
    /// stores reach the cache, and so for every store ahead of them (after a store fence,
    /// the whole of a device's streaming data copy: docs/benchmarks.md).
    #[inline]
    pub fn complete(mut self, outcome: C::Outcome) {
        if let Some(completion) = self.completion.take() {
            completion.complete(outcome, self.ctx(), self.shared());
        }
    }

    /// Ends the request without reporting through its completion (the caller reports in its
    /// own way); the request is counted down all the same.
    pub fn into_inner(mut self) -> C {
        self.completion.take().expect("present until the permit is consumed")
    }
}

impl<C: Completion> Drop for Permit<C> {
    fn drop(&mut self) {
        if let Some(completion) = self.completion.take() {
            completion.fail(self.ctx(), self.shared());
        }
        self.pins.clear();
        let lane = &self.lane().core;
        let mut st = lane.state();
        let slot = &mut st.slots[self.index as usize];
        slot.live = false;
        slot.ranges.clear();
        if slot.cancel.take().is_some() {
            lane.cancelled.fetch_sub(1, Ordering::Relaxed);
        }
        st.free.push(self.index);
        st.open -= 1;
        if st.open > 0 {
            // The usual end: nothing to let go of or to wake. Returning here, not building an
            // empty `kept` to drop below, spares the common path a copy of it through the
            // stack (see `complete` for what such a copy can cost).
            return;
        }
        let notify = st.waiters > 0;
        // The last open permit lets go of the old contexts and of what kept the lane (R1),
        // after the hold and the notification: nothing of the lane is touched after this
        // drop. With waiters the lane stays kept for them (they let go of it) and the
        // notification holds a reference of its own.
        let lane_ref = if notify { st.keep.clone() } else { st.keep.take() };
        let kept = (lane_ref, std::mem::take(&mut st.retired));
        drop(st);
        if notify {
            let _waiting = sync::lock(&lane.idle);
            lane.idled.notify_all();
        }
        drop(kept);
    }
}

impl<C: Completion> std::fmt::Debug for Permit<C> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Permit").field("cancelled", &self.cancelled()).finish_non_exhaustive()
    }
}

/// The IOVA range `[start, end)` of the pages `first..=last`. Saturating: a guest names any
/// page number, and the last page ends at 2^64.
fn page_span(first: u64, last: u64) -> (u64, u64) {
    (first.saturating_mul(PAGE_SIZE), last.saturating_mul(PAGE_SIZE).saturating_add(PAGE_SIZE))
}

/// Guest bytes pinned for a request ([`Permit::pin_bytes`]), addressed from the range's first
/// byte. It borrows the permit, and answers what a transfer asks between blocks itself:
/// whether the request was cancelled ([`PinnedBytes::cancelled`]), and the rest of the permit
/// ([`PinnedBytes::permit`]: its context, its data). The pins stay the permit's: they go
/// with it (or [`Permit::release_pins`]), not with this guard.
pub struct PinnedBytes<'p, C: Completion> {
    permit: &'p Permit<C>,
    /// The pins' index in the permit's.
    index: usize,
    /// Where the range's first byte lies in them.
    offset: u64,
    size: u64,
}

impl<'p, C: Completion> PinnedBytes<'p, C> {
    /// Copies `buf.len()` bytes at `at` of the range out (see [`PinnedPages::read`]: bytes
    /// the client writes meanwhile may be torn). Refused beyond the range.
    pub fn read(&self, at: u64, buf: &mut [u8]) -> Result<(), AccessError> {
        self.within(at, buf.len())?;
        self.pages().read(self.offset + at, buf)
    }

    /// Copies `data` into the range at `at` (pinned with [`Prot::WRITE`]). Refused beyond the
    /// range.
    pub fn write(&self, at: u64, data: &[u8]) -> Result<(), AccessError> {
        self.within(at, data.len())?;
        self.pages().write(self.offset + at, data)
    }

    /// Why the request was cancelled, if it was ([`Permit::cancelled`]).
    pub fn cancelled(&self) -> Option<Cancel> {
        self.permit.cancelled()
    }

    /// The request's permit, for the rest of what it holds ([`Permit::ctx`], [`Permit::get`]).
    pub fn permit(&self) -> &'p Permit<C> {
        self.permit
    }

    /// The pinned pages that hold the range, for what [`PinnedPages`] offers beyond copies
    /// (slices, I/O vectors): the range starts at [`PinnedBytes::offset`] in them.
    pub fn pages(&self) -> &'p PinnedPages {
        &self.permit.pins[self.index]
    }

    /// Where the range's first byte lies in [`PinnedBytes::pages`]: `iova % PAGE_SIZE`.
    pub fn offset(&self) -> u64 {
        self.offset
    }

    /// A handle to this range, for [`Permit::bytes`] once this guard is gone.
    pub fn handle(&self) -> BytesHandle {
        BytesHandle {
            index: self.index,
            offset: self.offset,
            size: self.size,
            released: self.permit.released,
        }
    }

    /// The range's length in bytes (never 0).
    pub fn size(&self) -> u64 {
        self.size
    }

    fn within(&self, at: u64, len: usize) -> Result<(), AccessError> {
        let len = len as u64;
        match at.checked_add(len) {
            Some(end) if end <= self.size => Ok(()),
            _ => Err(AccessError::OutOfRange { offset: at, len, size: self.size }),
        }
    }
}

/// A range [`Permit::pin_bytes`] pinned, named without borrowing the permit
/// ([`PinnedBytes::handle`], [`Permit::bytes`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BytesHandle {
    index: usize,
    offset: u64,
    size: u64,
    released: u32,
}

impl<C: Completion> std::fmt::Debug for PinnedBytes<'_, C> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PinnedBytes")
            .field("offset", &self.offset)
            .field("size", &self.size)
            .field("cancelled", &self.cancelled())
            .finish()
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
    use std::os::fd::AsFd;
    use std::os::unix::fs::FileExt;
    use std::sync::atomic::AtomicUsize;

    use umdev_pinning::DmaSpace;

    use super::*;
    use crate::device::NoClient;

    struct Report(std::sync::mpsc::Sender<Result<u32, ()>>);

    impl Completion for Report {
        type Outcome = u32;
        type Shared = ();
        fn complete(self, outcome: u32, _ctx: &DeviceContext, (): &()) {
            let _ = self.0.send(Ok(outcome));
        }
        fn fail(self, _ctx: &DeviceContext, (): &()) {
            let _ = self.0.send(Err(()));
        }
    }

    /// 16 pages of guest RAM at IOVA 0, and requests attached to it.
    fn attached() -> (Requests, DmaSpace, std::fs::File) {
        let ram = std::fs::File::from(
            nix::sys::memfd::memfd_create(c"request-test", nix::sys::memfd::MFdFlags::MFD_CLOEXEC).unwrap(),
        );
        ram.set_len(16 * PAGE_SIZE).unwrap();
        let dma = DmaSpace::default();
        dma.map(0, 16 * PAGE_SIZE, ram.as_fd(), 0, Prot::READ_WRITE).unwrap();
        let requests = Requests::new();
        requests.attach(DeviceContext::new(dma.clone(), Arc::new(NoClient)));
        (requests, dma, ram)
    }

    #[test]
    fn completed_forgotten_and_panicking_requests_all_end_and_count_down() {
        let (requests, _dma, _ram) = attached();
        let lane = requests.lane(|| {});
        let (tx, rx) = std::sync::mpsc::channel();
        lane.begin(Report(tx.clone())).unwrap().complete(7);
        assert_eq!(rx.recv().unwrap(), Ok(7));
        drop(lane.begin(Report(tx.clone())).unwrap());
        assert_eq!(rx.recv().unwrap(), Err(()), "forgotten: failed");
        let permit = lane.begin(Report(tx.clone())).unwrap();
        assert_eq!(requests.in_flight(), 1);
        let served = serve("a test request", move || {
            let _permit = permit;
            panic!("on purpose");
        });
        assert!(served.is_none());
        assert_eq!(rx.recv().unwrap(), Err(()), "panicked: failed");
        assert!(requests.wait_idle(Duration::ZERO));
        // A request in flight holds a detach up to its bound.
        let held = lane.begin(Report(tx)).unwrap();
        assert!(!requests.wait_idle(Duration::from_millis(10)));
        let waiter = {
            let requests = requests.clone();
            std::thread::spawn(move || requests.wait_idle(Duration::from_secs(60)))
        };
        held.complete(1);
        assert!(waiter.join().unwrap());
    }

    #[test]
    fn an_unmap_cancels_exactly_the_requests_holding_pins_in_it() {
        let (requests, dma, _ram) = attached();
        let woken = Arc::new(AtomicUsize::new(0));
        let w = woken.clone();
        let lane = requests.lane(move || {
            w.fetch_add(1, Ordering::Relaxed);
        });
        let (tx, _rx) = std::sync::mpsc::channel();
        let mut a = lane.begin(Report(tx.clone())).unwrap();
        let mut b = lane.begin(Report(tx.clone())).unwrap();
        let c = lane.begin(Report(tx)).unwrap();
        a.pin_pages(&[1, 2, 3], Prot::READ).unwrap();
        b.pin_pages(&[8], Prot::WRITE).unwrap();
        assert_eq!(dma.pin_count(2 * PAGE_SIZE), 1);
        requests.cancel_overlapping(3 * PAGE_SIZE, PAGE_SIZE);
        assert_eq!((a.cancelled(), b.cancelled(), c.cancelled()), (Some(Cancel::Unmapped), None, None));
        assert_eq!(woken.load(Ordering::Relaxed), 1);
        // Letting go satisfies the unmap: the cancellation is withdrawn, the pins are gone.
        assert!(a.release_pins());
        assert_eq!((a.cancelled(), dma.pin_count(2 * PAGE_SIZE)), (None, 0));
        // An unmap after the release finds nothing of `a` to cancel.
        requests.cancel_overlapping(0, 4 * PAGE_SIZE);
        assert_eq!(a.cancelled(), None);
        // A reset cancels everything and is not withdrawn by a release.
        requests.cancel_all();
        assert!(!b.release_pins());
        assert_eq!(
            (a.cancelled(), b.cancelled(), c.cancelled()),
            (Some(Cancel::Reset), Some(Cancel::Reset), Some(Cancel::Reset))
        );
        drop((a, b, c));
        assert_eq!(dma.stats().pinned_pages, 0);
    }

    /// A request a worker begins between a reset's cancellation and the end of the device's
    /// own reset is cancelled as those in flight were; one begun after is not.
    #[test]
    fn a_request_begun_while_a_reset_runs_begins_cancelled() {
        let (requests, _dma, _ram) = attached();
        let lane = requests.lane(|| {});
        let (tx, _rx) = std::sync::mpsc::channel();
        let before = lane.begin(Report(tx.clone())).unwrap();
        let resetting = requests.resetting();
        let during = lane.begin(Report(tx.clone())).unwrap();
        assert_eq!((before.cancelled(), during.cancelled()), (Some(Cancel::Reset), Some(Cancel::Reset)));
        // Its cancellation is counted like any other: the slot it leaves is clean.
        drop(during);
        let again = lane.begin(Report(tx.clone())).unwrap();
        assert_eq!(again.cancelled(), Some(Cancel::Reset));
        drop(resetting);
        let after = lane.begin(Report(tx)).unwrap();
        assert_eq!((after.cancelled(), before.cancelled()), (None, Some(Cancel::Reset)));
        drop((before, again));
        // The slots the cancelled requests left are reused clean.
        let (tx, _rx) = std::sync::mpsc::channel();
        let reused = lane.begin(Report(tx)).unwrap();
        assert_eq!((reused.cancelled(), after.cancelled()), (None, None));
    }

    #[test]
    fn a_claimed_lane_is_cancelled_and_counted_from_other_threads() {
        let (requests, dma, _ram) = attached();
        let lane = requests.lane(|| {});
        lane.claim();
        let (tx, rx) = std::sync::mpsc::channel();
        let mut p = lane.begin(Report(tx.clone())).unwrap();
        p.pin_pages(&[2, 3], Prot::READ).unwrap();
        // An unmap and a count from another thread take the owner's lock from outside.
        let other = requests.clone();
        let seen = std::thread::spawn(move || {
            other.cancel_overlapping(3 * PAGE_SIZE, PAGE_SIZE);
            other.in_flight()
        })
        .join()
        .unwrap();
        assert_eq!((seen, p.cancelled()), (1, Some(Cancel::Unmapped)));
        assert!(p.release_pins());
        // A permit ended on another thread counts down all the same.
        std::thread::spawn(move || p.complete(5)).join().unwrap();
        assert_eq!(rx.recv().unwrap(), Ok(5));
        assert_eq!((requests.in_flight(), dma.stats().pinned_pages), (0, 0));
        // The lane outlives its handle while a permit is open (R1), and the permit ends it.
        let p = lane.begin(Report(tx)).unwrap();
        drop(lane);
        requests.detach();
        assert_eq!(p.cancelled(), Some(Cancel::Reset));
        drop(p);
        assert_eq!(rx.recv().unwrap(), Err(()));
        assert_eq!(requests.in_flight(), 0);
    }

    #[test]
    fn a_permit_counts_no_reference_and_a_dropped_handle_leaves_the_lane_to_its_permits() {
        let (requests, _dma, _ram) = attached();
        let lane = requests.lane(|| {});
        let (tx, rx) = std::sync::mpsc::channel();
        let refs = Arc::strong_count(&lane.inner);
        // One at a time (a RAM namespace's commands) and several at once: no count moves.
        for _ in 0..3 {
            let p = lane.begin(Report(tx.clone())).unwrap();
            assert_eq!(Arc::strong_count(&lane.inner), refs);
            p.complete(1);
        }
        let open: Vec<_> = (0..4).map(|_| lane.begin(Report(tx.clone())).unwrap()).collect();
        assert_eq!(Arc::strong_count(&lane.inner), refs);
        // The handles go while permits are open: the lane stays, held by `keep` (R1), until
        // the last permit's drop lets go of it.
        let weak = Arc::downgrade(&lane.inner);
        let other = lane.clone();
        drop(lane);
        drop(other);
        assert!(weak.upgrade().is_some(), "kept for its open permits");
        for (k, p) in open.into_iter().enumerate() {
            p.complete(k as u32);
            assert_eq!(weak.upgrade().is_some(), k < 3, "let go with the last permit only");
        }
        assert_eq!(rx.try_iter().count(), 7);
        assert_eq!(requests.in_flight(), 0);
    }

    #[test]
    fn a_waiter_keeps_the_lane_it_waits_for_and_the_last_to_leave_lets_go() {
        let (requests, _dma, _ram) = attached();
        let lane = requests.lane(|| {});
        let weak = Arc::downgrade(&lane.inner);
        // A waiter of an idle lane keeps nothing once it leaves.
        assert!(requests.wait_idle(Duration::from_secs(600)));
        let (tx, rx) = std::sync::mpsc::channel();
        let p = lane.begin(Report(tx.clone())).unwrap();
        drop(lane);
        // A waiter whose bound passes while the permit is open: the lane stays for the permit.
        assert!(!requests.wait_idle(Duration::from_millis(1)));
        assert!(weak.upgrade().is_some());
        // A waiter that the last permit wakes: the permit notifies holding the lane, the
        // waiter leaves last and lets go of it.
        let other = requests.clone();
        let waiter = std::thread::spawn(move || other.wait_idle(Duration::from_secs(600)));
        while weak.upgrade().is_some_and(|l| l.core.state().waiters == 0) {
            std::thread::yield_now();
        }
        p.complete(3);
        assert!(waiter.join().unwrap());
        assert_eq!(rx.recv().unwrap(), Ok(3));
        assert!(weak.upgrade().is_none(), "let go once idle and unwaited");
        // And a lane with a handle, waited for while idle, goes with its handle.
        let lane = requests.lane(|| {});
        let weak = Arc::downgrade(&lane.inner);
        assert!(requests.wait_idle(Duration::from_secs(600)));
        drop(lane);
        assert!(weak.upgrade().is_none(), "no reference left behind by the waiter");
    }

    #[test]
    fn a_request_is_cancelled_by_an_unmap_of_its_own_pages_only() {
        let (requests, _dma, _ram) = attached();
        let lane = requests.lane(|| {});
        let pages = [1u64, 2, 3, 6, 9, 10, 5];
        for probe in 0..12u64 {
            let (tx, _rx) = std::sync::mpsc::channel();
            let mut p = lane.begin(Report(tx)).unwrap();
            p.pin_pages(&pages, Prot::READ).unwrap();
            requests.cancel_overlapping(probe * PAGE_SIZE, PAGE_SIZE);
            let want = pages.contains(&probe).then_some(Cancel::Unmapped);
            assert_eq!(p.cancelled(), want, "an unmap of page {probe}");
        }
    }

    #[test]
    fn a_failed_pin_announces_nothing_and_the_pins_go_with_the_permit() {
        let (requests, dma, _ram) = attached();
        let lane = requests.lane(|| {});
        let (tx, _rx) = std::sync::mpsc::channel();
        let mut p = lane.begin(Report(tx)).unwrap();
        assert!(p.pin_pages(&[100], Prot::READ).is_err(), "not mapped");
        requests.cancel_overlapping(100 * PAGE_SIZE, PAGE_SIZE);
        assert_eq!(p.cancelled(), None);
        p.pin_pages(&[4, 5], Prot::READ).unwrap();
        p.pin_pages(&[5], Prot::READ).unwrap();
        assert_eq!(dma.pin_count(5 * PAGE_SIZE), 2);
        drop(p);
        assert_eq!(dma.pin_count(5 * PAGE_SIZE), 0);
    }

    #[test]
    fn a_byte_range_pins_the_pages_that_hold_it_and_reads_from_its_first_byte() {
        let (requests, dma, ram) = attached();
        let lane = requests.lane(|| {});
        let (tx, _rx) = std::sync::mpsc::channel();
        let mut p = lane.begin(Report(tx)).unwrap();
        // From 2 bytes before page 3 ends to the first byte of page 5: pages 3, 4 and 5.
        let iova = 4 * PAGE_SIZE - 2;
        let len = PAGE_SIZE + 3;
        let bytes: Vec<u8> = (0..len).map(|i| i as u8 ^ 0x5a).collect();
        ram.write_all_at(&bytes, iova).unwrap();
        let pinned = p.pin_bytes(iova, len, Prot::READ_WRITE).unwrap();
        assert_eq!((pinned.offset(), pinned.size(), pinned.pages().len()), (PAGE_SIZE - 2, len, 3));
        let pins = |page: u64| dma.pin_count(page * PAGE_SIZE);
        assert_eq!((pins(2), pins(3), pins(4), pins(5), pins(6)), (0, 1, 1, 1, 0));
        let mut back = vec![0u8; len as usize];
        pinned.read(0, &mut back).unwrap();
        assert_eq!(back, bytes);
        pinned.write(len - 1, &[0xee]).unwrap();
        let mut last = [0u8];
        ram.read_exact_at(&mut last, iova + len - 1).unwrap();
        assert_eq!(last, [0xee]);
        // Nothing outside the range, whatever the pages around it hold.
        assert!(matches!(pinned.read(len, &mut [0u8; 1]), Err(AccessError::OutOfRange { .. })));
        assert!(matches!(pinned.read(1, &mut back), Err(AccessError::OutOfRange { .. })));
        assert!(matches!(pinned.write(u64::MAX, &[0u8; 2]), Err(AccessError::OutOfRange { .. })));
        // Its pages are the request's: an unmap of the last one cancels it, and the guard,
        // still held, says so.
        assert_eq!(pinned.cancelled(), None);
        requests.cancel_overlapping(5 * PAGE_SIZE, PAGE_SIZE);
        assert_eq!(pinned.cancelled(), Some(Cancel::Unmapped));
        assert_eq!(pinned.permit().pins().len(), 1);
        drop(p);
        assert_eq!(dma.stats().pins_held, 0, "the pins went with the permit");
    }

    /// Two ranges pinned one after the other are held together through their handles, each
    /// bounded by its own range; a handle of before a release names nothing.
    #[test]
    fn byte_ranges_are_held_together_by_their_handles() {
        let (requests, _dma, ram) = attached();
        let lane = requests.lane(|| {});
        let (tx, _rx) = std::sync::mpsc::channel();
        let mut p = lane.begin(Report(tx)).unwrap();
        ram.write_all_at(b"source", PAGE_SIZE + 10).unwrap();
        let src = p.pin_bytes(PAGE_SIZE + 10, 6, Prot::READ).unwrap().handle();
        let dst = p.pin_bytes(3 * PAGE_SIZE + 100, 6, Prot::WRITE).unwrap().handle();
        let (from, to) = (p.bytes(src).unwrap(), p.bytes(dst).unwrap());
        let mut buf = [0u8; 6];
        from.read(0, &mut buf).unwrap();
        to.write(0, &buf).unwrap();
        assert!(matches!(to.write(1, &buf), Err(AccessError::OutOfRange { .. })), "the range's own bound");
        let mut back = [0u8; 6];
        ram.read_exact_at(&mut back, 3 * PAGE_SIZE + 100).unwrap();
        assert_eq!(&back, b"source");
        p.release_pins();
        assert!(p.bytes(src).is_none() && p.bytes(dst).is_none());
        let again = p.pin_bytes(PAGE_SIZE, 1, Prot::READ).unwrap().handle();
        assert!(p.bytes(src).is_none(), "a handle of before names nothing, though index 0 is taken again");
        assert!(p.bytes(again).is_some());
    }

    #[test]
    fn a_byte_range_that_is_empty_wraps_or_is_unmapped_pins_and_announces_nothing() {
        let (requests, dma, _ram) = attached();
        let lane = requests.lane(|| {});
        let (tx, _rx) = std::sync::mpsc::channel();
        let mut p = lane.begin(Report(tx)).unwrap();
        assert!(matches!(p.pin_bytes(PAGE_SIZE, 0, Prot::READ), Err(GuestError::Pin(PinError::Empty))));
        assert!(matches!(
            p.pin_bytes(u64::MAX - 1, 3, Prot::READ),
            Err(GuestError::NotMapped { iova, len: 3 }) if iova == u64::MAX - 1
        ));
        // Up to 2^64 exactly is a range (not mapped here), its last page computed without
        // overflowing.
        assert!(matches!(
            p.pin_bytes(u64::MAX - 1, 2, Prot::READ),
            Err(GuestError::Pin(PinError::NotMapped { .. }))
        ));
        assert!(
            matches!(p.pin_bytes(15 * PAGE_SIZE, PAGE_SIZE + 1, Prot::READ), Err(GuestError::Pin(_))),
            "past RAM"
        );
        // None of them left a range behind for an unmap to find.
        requests.cancel_overlapping(0, u64::MAX);
        assert_eq!(p.cancelled(), None);
        assert_eq!((p.pins().len(), dma.stats().pins_held), (0, 0));
        // With bus mastering off the engine is not asked.
        let calls = dma.stats().pin_calls;
        let off = DeviceContext::new(dma.clone(), Arc::new(NoClient))
            .with_bus_master(crate::guest::BusMaster::new(false));
        requests.attach(off);
        let (tx, _rx) = std::sync::mpsc::channel();
        let mut q = lane.begin(Report(tx)).unwrap();
        assert!(matches!(q.pin_bytes(0, 1, Prot::READ), Err(GuestError::BusMasterOff)));
        assert_eq!(dma.stats().pin_calls, calls);
        requests.cancel_overlapping(0, PAGE_SIZE);
        assert_eq!(q.cancelled(), None);
    }

    #[test]
    fn no_request_starts_without_a_client_and_a_detach_cancels_the_rest() {
        let (requests, _dma, _ram) = attached();
        let lane = requests.lane(|| {});
        let (tx, _rx) = std::sync::mpsc::channel();
        let p = lane.begin(Report(tx.clone())).unwrap();
        requests.detach();
        assert_eq!(p.cancelled(), Some(Cancel::Reset));
        assert!(lane.begin(Report(tx.clone())).is_err());
        assert!(requests.context().is_none());
        drop(p);
        let (_r, dma, _ram) = attached();
        requests.attach(DeviceContext::new(dma, Arc::new(NoClient)));
        let p = lane.begin(Report(tx)).unwrap();
        assert_eq!(p.cancelled(), None, "a new attachment starts clean");
    }
}
