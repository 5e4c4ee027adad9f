//! Queues (NVMe 1.3 §4.1): doorbells, rings in guest memory, and the completion side.
//!
//! A doorbell is written by the connection thread (a posted REGION_WRITE) or, with the
//! doorbell page mapped, by the guest itself; the queue's worker watches it. Rings are
//! reached through the pinning engine: pinned on first use and kept pinned (one pin per
//! ring, not per entry), released when the client unmaps them and pinned again on next use.
//! A ring's pins are kept under the lock its users already take: the SQ's own (its worker
//! and an Abort read it), the CQ's state (its posters).

use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use smallvec::SmallVec;
use umdev_pinning::sync::{asymmetric_heavy_fence, asymmetric_light_fence, BiasedLock};
use umdev_pinning::{PinnedPages, Prot};
use vm_memory::mmap::MmapRegion;
use vm_memory::{Bytes, FileOffset, VolatileMemory};

use super::spec::{Cqe, Sqe, Status, CQE_SIZE, PAGE, SQE_SIZE};
use crossbeam::utils::CachePadded;
use umdev_mdev::guest::{BusMaster, GuestError};
use umdev_mdev::worker::Bell;
use umdev_mdev::DeviceContext;

/// A doorbell register's value (NVMe 1.3 §3.1: SQyTDBL, CQyHDBL), written by the connection
/// thread and watched by a worker, and the bell that wakes that worker. Each has a cache line
/// of its own: the doorbells of different queues are watched by different threads.
#[repr(align(64))]
#[derive(Debug, Default)]
pub struct Doorbell {
    /// Entries of the queue it belongs to; 0 while no queue has its ID.
    size: AtomicU32,
    value: AtomicU32,
    /// Wakes the queue's worker; successive workers of the queue ID take it over.
    bell: Bell,
    /// A CQ head doorbell: set by a worker that found the CQ full, taken by the next write.
    room_wanted: AtomicBool,
    /// ...and the bells of the workers waiting for that room.
    room: Mutex<SmallVec<[Bell; 2]>>,
}

impl Doorbell {
    /// Entries of the queue, 0 if none.
    pub fn size(&self) -> u32 {
        self.size.load(Ordering::Acquire)
    }

    /// A queue of `size` entries now owns the doorbell (0: none); the value restarts at 0.
    pub fn open(&self, size: u32) {
        self.value.store(0, Ordering::Release);
        self.size.store(size, Ordering::Release);
        if size == 0 {
            umdev_mdev::sync::lock(&self.room).clear();
        }
    }

    /// The last value written.
    pub fn value(&self) -> u32 {
        self.value.load(Ordering::Acquire)
    }

    /// The doorbell was written: store and wake the worker (and, for a CQ head doorbell, the
    /// workers waiting for room).
    pub fn ring(&self, value: u32) {
        self.value.store(value, Ordering::SeqCst);
        self.bell.ring();
        if self.room_wanted.load(Ordering::SeqCst) && self.room_wanted.swap(false, Ordering::SeqCst) {
            for bell in umdev_mdev::sync::lock(&self.room).drain(..) {
                bell.ring();
            }
        }
    }

    /// (A CQ head doorbell.) The worker of `bell` found the queue full: the next write of
    /// this doorbell rings it. The caller looks at the head again after this, so a write
    /// that came meanwhile is not missed.
    pub fn want_room(&self, bell: &Bell) {
        let mut room = umdev_mdev::sync::lock(&self.room);
        if !room.iter().any(|b| b.same(bell)) {
            room.push(bell.clone());
        }
        self.room_wanted.store(true, Ordering::SeqCst);
    }

    /// Sets the value without waking anyone (shadow doorbells turned off: the last shadow
    /// value becomes the register's).
    pub fn set(&self, value: u32) {
        self.value.store(value, Ordering::SeqCst);
    }

    /// Wakes the worker (bus mastering back on).
    pub fn wake(&self) {
        self.bell.ring();
    }

    /// The bell a queue's worker is started on.
    pub fn bell(&self) -> &Bell {
        &self.bell
    }
}

/// The doorbell page a client may map (`doorbells=mmap`): the guest writes it directly and
/// the workers poll it.
#[derive(Debug)]
pub struct DoorbellPage {
    region: MmapRegion,
    /// The page's offset in its file.
    offset: u64,
    /// The file mapped at the page now (the region keeps the first one open, mapped or not);
    /// `None` while an anonymous page of this process's own stands there ([`Self::isolate`]).
    current: std::sync::Mutex<Option<std::fs::File>>,
    /// Tests: how many of the next maps of a file at the page fail as a failed `MAP_FIXED`
    /// may on kernels before 6.12, with the old mapping gone (an anonymous page stands in for
    /// the hole, so that a look at it reads zeros rather than faulting).
    #[cfg(test)]
    failing_maps: AtomicU32,
}

impl DoorbellPage {
    /// A page of the shared `file` at `offset`.
    pub fn new(file: std::fs::File, offset: u64) -> std::io::Result<DoorbellPage> {
        let current = std::sync::Mutex::new(Some(file.try_clone()?));
        let region = MmapRegion::from_file(FileOffset::new(file, offset), PAGE as usize)
            .map_err(std::io::Error::other)?;
        Ok(DoorbellPage {
            region,
            offset,
            current,
            #[cfg(test)]
            failing_maps: AtomicU32::new(0),
        })
    }

    /// Maps the same page of `file` in place of this one's, at the same address: from then
    /// on the page is `file`'s (the old file is no longer read or written here). If that
    /// fails the page stays the old file's.
    pub fn replace(&self, file: &std::fs::File) -> std::io::Result<()> {
        let mut current = umdev_mdev::sync::lock(&self.current);
        let kept = file.try_clone()?;
        if let Err(e) = self.map_at_page(file) {
            self.restore(&current, &e);
            return Err(e);
        }
        *current = Some(kept);
        Ok(())
    }

    /// Maps an anonymous page of this process's own in place of this one's file, at the same
    /// address: for a detach that could not make the next client a file, so that the client
    /// that left, which may still map the old file, cannot ring the next one's queues. The
    /// page reads zeros; messages and the workers use it as before.
    pub fn isolate(&self) -> std::io::Result<()> {
        let mut current = umdev_mdev::sync::lock(&self.current);
        if let Err(e) = self.mmap_over_page(libc::MAP_PRIVATE | libc::MAP_ANONYMOUS, -1, 0) {
            self.restore(&current, &e);
            return Err(e);
        }
        *current = None;
        Ok(())
    }

    /// After a failed `MAP_FIXED`, which may have unmapped the range first (kernels before
    /// 6.12): what was there goes back, or the process cannot go on (a worker would fault on
    /// the hole).
    fn restore(&self, current: &Option<std::fs::File>, e: &std::io::Error) {
        let again = match current {
            Some(file) => self.map_at_page(file),
            None => self.mmap_over_page(libc::MAP_PRIVATE | libc::MAP_ANONYMOUS, -1, 0),
        };
        if let Err(again) = again {
            log::error!("nvme: the doorbell page could not be mapped ({e}), nor the old one again ({again})");
            std::process::abort();
        }
    }

    /// Maps this page's page of `file` at the page's address.
    fn map_at_page(&self, file: &std::fs::File) -> std::io::Result<()> {
        use std::os::fd::AsRawFd;
        #[cfg(test)]
        if umdev_mdev::sync::AtomicUpdate::update_with(
            &self.failing_maps,
            Ordering::AcqRel,
            Ordering::Acquire,
            |n| n.checked_sub(1),
        )
        .is_ok()
        {
            self.mmap_over_page(libc::MAP_PRIVATE | libc::MAP_ANONYMOUS, -1, 0)?;
            return Err(std::io::Error::from_raw_os_error(libc::ENOMEM));
        }
        let offset = libc::off_t::try_from(self.offset).map_err(std::io::Error::other)?;
        self.mmap_over_page(libc::MAP_SHARED, file.as_raw_fd(), offset)
    }

    /// The page's one `mmap`: `MAP_FIXED | flags` of `fd` at `offset`, read-write, over the
    /// page's own mapping.
    fn mmap_over_page(
        &self,
        flags: libc::c_int,
        fd: std::os::fd::RawFd,
        offset: libc::off_t,
    ) -> std::io::Result<()> {
        // SAFETY: MAP_FIXED over this page's own mapping, read-write, the page's length: on
        // success the range is mapped throughout (the kernel replaces the mapping in one step),
        // so the atomics other threads may hold references into stay valid, and nothing else
        // of the process lies there; on failure the caller (`replace`) maps the old file there
        // again or aborts. The region's drop unmaps the range, whatever is mapped there then.
        let at = unsafe {
            libc::mmap(
                self.region.as_ptr().cast(),
                PAGE as usize,
                libc::PROT_READ | libc::PROT_WRITE,
                flags | libc::MAP_FIXED,
                fd,
                offset,
            )
        };
        if at == libc::MAP_FAILED {
            return Err(std::io::Error::last_os_error());
        }
        Ok(())
    }

    fn slot(&self, index: usize) -> Option<&AtomicU32> {
        self.region.get_atomic_ref::<AtomicU32>(index * 4).ok()
    }

    /// Doorbell `index` (queue y's SQ tail is 2y, its CQ head 2y + 1). Acquire: the guest
    /// wrote its queue entries before the doorbell.
    pub fn load(&self, index: usize) -> u32 {
        self.slot(index).map_or(0, |s| u32::from_le(s.load(Ordering::Acquire)))
    }

    /// Sets doorbell `index` (a doorbell message arrived anyway, or a queue restarts).
    pub fn store(&self, index: usize, value: u32) {
        if let Some(s) = self.slot(index) {
            s.store(value.to_le(), Ordering::Release);
        }
    }

    /// Zeroes every doorbell (a reset).
    pub fn clear(&self) {
        for i in 0..(PAGE as usize / 4) {
            self.store(i, 0);
        }
    }
}

/// Why a ring could not be reached.
#[derive(Debug, thiserror::Error)]
pub enum RingError {
    /// Pinning or copying failed (the memory is gone, or bus mastering is off).
    #[error(transparent)]
    Guest(GuestError),
}

/// A ring of `entries` entries of `entry_size` bytes at `base`, pinned while in use. Its pins
/// (`None` until first use and after an unmap of them) are kept by its queue, which passes
/// them to each access.
#[derive(Debug)]
pub struct Ring {
    base: u64,
    entries: u32,
    entry_size: u64,
    prot: Prot,
}

impl Ring {
    fn new(base: u64, entries: u32, entry_size: u64, prot: Prot) -> Ring {
        Ring { base, entries, entry_size, prot }
    }

    /// Bytes of the ring.
    fn bytes(&self) -> u64 {
        u64::from(self.entries) * self.entry_size
    }

    fn pinned<'p>(
        &self,
        pins: &'p mut Option<PinnedPages>,
        ctx: &DeviceContext,
    ) -> Result<&'p PinnedPages, RingError> {
        if pins.is_none() {
            let pages = self.bytes().div_ceil(PAGE);
            *pins = Some(ctx.pin_range(self.base, pages, self.prot).map_err(RingError::Guest)?);
        }
        Ok(pins.as_ref().expect("pinned above"))
    }

    /// Reads entry `index`.
    fn read<T: vm_memory::ByteValued>(
        &self,
        pins: &mut Option<PinnedPages>,
        ctx: &DeviceContext,
        index: u32,
    ) -> Result<T, RingError> {
        if !ctx.bus_master() {
            return Err(RingError::Guest(GuestError::BusMasterOff));
        }
        let pins = self.pinned(pins, ctx)?;
        pins.read_obj(u64::from(index) * self.entry_size).map_err(|_| RingError::Guest(truncated(self.base)))
    }

    /// Writes a completion entry at `index`: its first 12 bytes, then the dword holding the
    /// command identifier and the status with the phase tag, so a driver that sees the new
    /// phase sees the whole entry.
    fn write_cqe(
        &self,
        pins: &mut Option<PinnedPages>,
        ctx: &DeviceContext,
        index: u32,
        cqe: &Cqe,
    ) -> Result<(), RingError> {
        if !ctx.bus_master() {
            return Err(RingError::Guest(GuestError::BusMasterOff));
        }
        let pins = self.pinned(pins, ctx)?;
        // What the entry reports is visible before it: a RAM namespace's writes are made
        // unfenced (`Store::write_vectored_unfenced`), and this is where they are published.
        crate::store::fence_writes();
        let at = u64::from(index) * self.entry_size;
        let bytes = vm_memory::ByteValued::as_slice(cqe);
        let fail = || RingError::Guest(truncated(self.base));
        // An entry never crosses a page: one slice holds it, looked up once for both writes.
        let entry = pins.slice(at, bytes.len(), Prot::WRITE).map_err(|_| fail())?;
        entry.write_slice(&bytes[..12], 0).map_err(|_| fail())?;
        std::sync::atomic::fence(Ordering::Release);
        entry.write_slice(&bytes[12..], 12).map_err(|_| fail())?;
        if pins.poisoned() {
            return Err(fail());
        }
        Ok(())
    }

    /// Whether the ring overlaps `[iova, iova + len)`.
    fn overlaps(&self, iova: u64, len: u64) -> bool {
        self.base < iova.saturating_add(len) && iova < self.base.saturating_add(self.bytes())
    }
}

fn truncated(iova: u64) -> GuestError {
    GuestError::Truncated { iova }
}

/// A submission queue (§4.1.1).
#[derive(Debug)]
pub struct Sq {
    /// Queue identifier.
    pub id: u16,
    /// Entries.
    pub entries: u32,
    ring: Ring,
    /// The ring's pins. Its worker fetches under this lock (biased to it: plain stores), an
    /// Abort looks under it, and an unmap takes the pins away under it.
    ring_pins: BiasedLock<Option<PinnedPages>>,
    /// The completion queue its commands complete on.
    pub cq: Arc<Cq>,
    /// Head as the worker last published it (the next entry it fetches).
    pub head: AtomicU32,
    /// The tail doorbell as the worker last read it: entries up to it are fetched before it
    /// reads the doorbell again (a cache line the host writes), and completions count what
    /// still waits from it.
    pub known_tail: AtomicU32,
    /// Command identifiers an Abort named while they waited in the queue.
    aborts: Mutex<SmallVec<[u16; 4]>>,
    has_aborts: AtomicBool,
    /// Set once the queue is deleted (by its worker as it ends, or by the deletion if the
    /// worker did not end in time): nothing more of it is posted.
    retired: AtomicBool,
}

impl Sq {
    /// A queue of `entries` 64-byte entries at `base`, completing on `cq`.
    pub fn new(id: u16, base: u64, entries: u32, cq: Arc<Cq>) -> Sq {
        Sq {
            id,
            entries,
            ring: Ring::new(base, entries, SQE_SIZE, Prot::READ),
            ring_pins: BiasedLock::new(None),
            cq,
            head: AtomicU32::new(0),
            known_tail: AtomicU32::new(0),
            aborts: Mutex::new(SmallVec::new()),
            has_aborts: AtomicBool::new(false),
            retired: AtomicBool::new(false),
        }
    }

    /// The queue is deleted: nothing more of it is posted or counted (see
    /// [`super::completion::Completer::retire`]). Once this returns no entry of it is being
    /// posted either: [`Cq::post`] looks at the flag under the CQ's lock, which this takes
    /// once after setting it.
    pub fn retire(&self) {
        self.retired.store(true, Ordering::Release);
        drop(self.cq.state.lock());
    }

    /// Whether the queue was deleted.
    pub fn retired(&self) -> bool {
        self.retired.load(Ordering::Acquire)
    }

    /// Asks the CPU to start loading entry `index` (see [`DeviceContext::prefetch`]).
    pub fn prefetch(&self, ctx: &DeviceContext, index: u32) {
        // The guest chose the base, and nothing checked that the ring ends below 2^64.
        if let Some(at) = self.ring.base.checked_add(u64::from(index) * self.ring.entry_size) {
            ctx.prefetch(at, SQE_SIZE as usize);
        }
    }

    /// Reads entry `index`.
    pub fn fetch(&self, ctx: &DeviceContext, index: u32) -> Result<Sqe, RingError> {
        self.ring.read(&mut self.ring_pins.lock_claiming(), ctx, index)
    }

    /// Publishes the head after a fetch; true if the fetched command `cid` was aborted
    /// while it waited (an Abort found it between the old head and the tail).
    pub fn advance(&self, head: u32, cid: u16) -> bool {
        // Dekker's handshake with `abort`: it raises `has_aborts`, fences, reads `head`; we
        // store `head`, fence, read `has_aborts`. One of us sees the other. Our fence is the
        // light half: no locked instruction per command.
        self.head.store(head, Ordering::Release);
        asymmetric_light_fence();
        if !self.has_aborts.load(Ordering::Acquire) {
            return false;
        }
        let mut aborts = umdev_mdev::sync::lock(&self.aborts);
        let found = aborts.iter().position(|&c| c == cid).map(|i| aborts.swap_remove(i)).is_some();
        self.has_aborts.store(!aborts.is_empty(), Ordering::SeqCst);
        found
    }

    /// Abort: looks for `cid` among the entries not yet fetched (from the published head to
    /// `tail`); if there, it will complete with Command Abort Requested when fetched.
    /// `Err` if too many aborts are already pending. A `tail` past the queue's end (a shadow
    /// or mapped doorbell holds what the host wrote, unchecked) queues nothing.
    pub fn abort(&self, ctx: &DeviceContext, cid: u16, tail: u32) -> Result<bool, Status> {
        if tail >= self.entries {
            return Ok(false);
        }
        let mut aborts = umdev_mdev::sync::lock(&self.aborts);
        if aborts.len() >= 4 {
            return Err(Status::ABORT_LIMIT);
        }
        self.has_aborts.store(true, Ordering::Relaxed);
        asymmetric_heavy_fence();
        let mut at = self.head.load(Ordering::Acquire);
        let mut found = false;
        // `at` and `tail` are both below `entries`: at most `entries - 1` steps.
        while at != tail && at < self.entries {
            if self.fetch(ctx, at).is_ok_and(|e| e.cid() == cid) {
                found = true;
                break;
            }
            at = (at + 1) % self.entries;
        }
        if found {
            aborts.push(cid);
        }
        self.has_aborts.store(!aborts.is_empty(), Ordering::SeqCst);
        Ok(found)
    }

    /// Lets go of ring pins in an unmapped range (the next fetch pins again).
    pub fn unmapping(&self, iova: u64, len: u64) {
        if self.ring.overlaps(iova, len) {
            // Dropped after the lock is given back.
            let pins = self.ring_pins.lock().take();
            drop(pins);
        }
    }
}

/// Interrupt coalescing of an I/O completion queue (Set Features 08h and 09h, §5.21.1.8-9).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Coalescing {
    /// Aggregation threshold: interrupt after this many + 1 entries.
    pub threshold: u8,
    /// Aggregation time, in 100 µs: at most this long after the first unsignalled entry.
    pub time: u8,
}

/// Completions a burst may post before its interrupt, without coalescing configured...
pub const BATCH: u32 = 8;
/// ...and how long the first of them may wait for the others.
pub const BATCH_TIME: Duration = Duration::from_micros(10);

/// What a completion queue did about interrupts for an entry.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Signal {
    /// Raise the queue's vector now.
    Now,
    /// Held (a burst, or coalescing): raised by [`Cq::due`].
    Held,
    /// The queue has interrupts disabled.
    None,
}

#[derive(Debug)]
struct CqState {
    /// The ring's pins: posting takes this lock anyway.
    pins: Option<PinnedPages>,
    tail: u32,
    phase: bool,
    /// The host's head as last read: the doorbell (a cache line the host writes) is read
    /// again only when this one says the queue is full. The head only moves forward, so an
    /// old value only understates the room.
    known_head: u32,
    /// Entries posted since the last interrupt (coalescing).
    unsignalled: u32,
    /// When the first of them was posted.
    first_held: Option<Instant>,
    deadline: Option<Instant>,
}

/// A completion queue (§4.1.2).
#[derive(Debug)]
pub struct Cq {
    /// Queue identifier.
    pub id: u16,
    /// Entries.
    pub entries: u32,
    /// Interrupt vector.
    pub vector: u16,
    /// Interrupts enabled.
    pub interrupts: bool,
    ring: Ring,
    /// Biased to the first thread that posts (its SQ's worker): a post takes it with plain
    /// stores; another SQ's worker sharing the CQ, or an unmap, pays for both sides.
    state: BiasedLock<CqState>,
    /// Coalescing as configured when the queue was created, or later: threshold in the low
    /// byte, time in the next (read by every post: one load, not a lock).
    coalescing: AtomicU32,
    /// Posted entries the host has not consumed (tail != head), for the INTx level.
    pub tail_seen: AtomicU32,
}

/// Why a completion could not be posted.
#[derive(Debug)]
pub enum PostError {
    /// The entry's SQ was deleted ([`Sq::retire`]): it is not posted.
    Retired,
    /// The queue is full: the host has not consumed the entries before.
    Full,
    /// The ring cannot be reached.
    Ring(RingError),
}

impl Cq {
    /// A queue of `entries` 16-byte entries at `base`, interrupting on `vector` if
    /// `interrupts`.
    pub fn new(id: u16, base: u64, entries: u32, vector: u16, interrupts: bool) -> Cq {
        Cq {
            id,
            entries,
            vector,
            interrupts,
            ring: Ring::new(base, entries, CQE_SIZE, Prot::READ_WRITE),
            state: BiasedLock::new(CqState {
                pins: None,
                tail: 0,
                phase: true,
                known_head: 0,
                unsignalled: 0,
                first_held: None,
                deadline: None,
            }),
            coalescing: AtomicU32::new(0),
            tail_seen: AtomicU32::new(0),
        }
    }

    /// Sets interrupt coalescing.
    pub fn set_coalescing(&self, c: Coalescing) {
        self.coalescing.store(u32::from(c.threshold) | u32::from(c.time) << 8, Ordering::Relaxed);
    }

    /// Posts `cqe` (its phase tag set here) if the queue has room given the host's head, read
    /// with `head` only when the last one read leaves no room (NVMe 1.3 §4.6: a queue is full
    /// when the tail is one below the head), else
    /// [`PostError::Full`]. `queued` is how many more commands the poster has waiting in its
    /// SQ. Without coalescing configured, the interrupt of a burst may wait while more
    /// commands wait than completions are held (so the host always has completions to reap
    /// before the queue runs dry), for at most [`BATCH`] entries and [`BATCH_TIME`], or until
    /// the poster runs out of work ([`Cq::due`]): a burst costs one interrupt, not one per
    /// entry.
    pub fn post(
        &self,
        ctx: &DeviceContext,
        sq: &Sq,
        mut cqe: Cqe,
        head: impl FnOnce() -> u32,
        queued: u32,
    ) -> Result<Signal, PostError> {
        let mut st = self.state.lock_claiming();
        if sq.retired() {
            return Err(PostError::Retired);
        }
        let next = (st.tail + 1) % self.entries;
        if next == st.known_head {
            // A head past the queue's end (a mapped or shadow doorbell can hold one; a written
            // register is checked) frees nothing: what the host has not consumed stays.
            let head = head();
            if head < self.entries {
                st.known_head = head;
            }
            if next == st.known_head {
                return Err(PostError::Full);
            }
        }
        cqe.status = (u16::from(cqe.status) & !1 | u16::from(st.phase)).into();
        let at = st.tail;
        self.ring.write_cqe(&mut st.pins, ctx, at, &cqe).map_err(PostError::Ring)?;
        st.tail = next;
        if next == 0 {
            st.phase = !st.phase;
        }
        self.tail_seen.store(next, Ordering::Release);
        Ok(self.signal(&mut st, queued))
    }

    /// Whether an entry fits given the host's `head`.
    pub fn has_room(&self, head: u32) -> bool {
        let st = self.state.lock();
        let head = if head < self.entries { head } else { st.known_head };
        (st.tail + 1) % self.entries != head
    }

    fn signal(&self, st: &mut CqState, queued: u32) -> Signal {
        if !self.interrupts {
            return Signal::None;
        }
        let packed = self.coalescing.load(Ordering::Relaxed);
        let c = Coalescing { threshold: packed as u8, time: (packed >> 8) as u8 };
        st.unsignalled += 1;
        let hold = match (c.threshold, c.time) {
            // No coalescing: a burst of cheap commands shares an interrupt, briefly. The clock
            // is read only when a burst is there to hold (never at queue depth 1).
            (0, 0) => {
                queued > st.unsignalled && st.unsignalled < BATCH && {
                    let now = Instant::now();
                    now.duration_since(*st.first_held.get_or_insert(now)) < BATCH_TIME
                }
            }
            (t, _) => st.unsignalled <= u32::from(t),
        };
        if !hold {
            st.unsignalled = 0;
            st.first_held = None;
            st.deadline = None;
            return Signal::Now;
        }
        if c.time > 0 && st.deadline.is_none() {
            st.deadline = Some(Instant::now() + Duration::from_micros(100 * u64::from(c.time)));
        }
        Signal::Held
    }

    /// Whether held entries should interrupt now: their aggregation time is up, or the
    /// poster has nothing left to do (`idle`) and no aggregation time is set. Resets the
    /// count if so.
    pub fn due(&self, idle: bool) -> bool {
        // Nothing is ever held on a CQ without interrupts (see `signal`): no lock per command.
        if !self.interrupts {
            return false;
        }
        let mut st = self.state.lock();
        let time_up = st.deadline.is_some_and(|d| Instant::now() >= d);
        let due = st.unsignalled > 0 && (time_up || (idle && st.deadline.is_none()));
        if due {
            st.unsignalled = 0;
            st.first_held = None;
            st.deadline = None;
        }
        due
    }

    /// Whether entries are held for their interrupt; the count reset if so, for the caller
    /// to raise it now: a poster that finds the queue full (the host makes room only for
    /// entries it is told of) or that posts no more.
    pub fn take_held(&self) -> bool {
        if !self.interrupts {
            return false;
        }
        let mut st = self.state.lock();
        let held = st.unsignalled > 0;
        st.unsignalled = 0;
        st.first_held = None;
        st.deadline = None;
        held
    }

    /// When held entries must interrupt by, if an aggregation time holds them.
    pub fn deadline(&self) -> Option<Instant> {
        self.state.lock().deadline
    }

    /// Lets go of ring pins in an unmapped range (the next post pins again).
    pub fn unmapping(&self, iova: u64, len: u64) {
        if self.ring.overlaps(iova, len) {
            let pins = self.state.lock().pins.take();
            drop(pins);
        }
    }
}

/// A completion entry to post (§4.6): the command's result.
pub fn completion(sq: &Sq, cid: u16, status: Status, dw0: u32) -> Cqe {
    Cqe {
        dw0: dw0.into(),
        dw1: 0.into(),
        sqhd: (sq.head.load(Ordering::Acquire) as u16).into(),
        sqid: sq.id.into(),
        cid: cid.into(),
        status: (status.0 << 1).into(),
    }
}

/// The shadow doorbell and event index buffers of Doorbell Buffer Config (§5.10, §7.13):
/// two guest pages the controller keeps pinned. The host writes each I/O queue's SQ tail and
/// CQ head into the shadow page, and writes the doorbell register too only when the value
/// passes the queue's event index, which the controller sets; entries are laid out as the
/// doorbell registers (CAP.DSTRD 0): queue y's SQ at dword 2y, its CQ at 2y + 1.
#[derive(Debug)]
pub struct ShadowDoorbells {
    /// Keep the pages pinned (and mapped) while the pointers below are used.
    _pins: [PinnedPages; 2],
    shadow: *const AtomicU32,
    eventidx: *const AtomicU32,
    /// The guest addresses of the pages.
    iova: [u64; 2],
    /// The pages are guest memory: read and written only while bus mastering is on.
    bus_master: BusMaster,
    /// By queue: its SQ tail and CQ head as last read or written here, which is what the
    /// controller knows of them while it may not read the page (a line of its own per queue:
    /// its SQ tail is written by its worker, its CQ head by the workers of the SQs completing
    /// on it, one with Linux's driver; each only when the value changed).
    last: Box<[CachePadded<[AtomicU32; 2]>]>,
}

// SAFETY: the pointers address pinned guest pages that stay mapped while `_pins` lives, and
// are only used as atomics (the guest writes them concurrently, as a device's DMA would).
unsafe impl Send for ShadowDoorbells {}
// SAFETY: as for Send: shared access is through atomics only.
unsafe impl Sync for ShadowDoorbells {}

/// An event index no doorbell value reaches (queues have fewer than 65536 entries): the
/// host never writes the doorbell register for it.
pub const EVENT_NEVER: u32 = u32::MAX;

impl ShadowDoorbells {
    /// Pins the shadow page at `shadow` and the event index page at `eventidx` (both page
    /// aligned) for reading and writing.
    /// `queues` is how many queue identifiers the controller has (the admin queue's
    /// included).
    pub fn new(
        ctx: &DeviceContext,
        shadow: u64,
        eventidx: u64,
        queues: usize,
    ) -> Result<ShadowDoorbells, GuestError> {
        let pin = |iova| ctx.pin_range(iova, 1, Prot::READ_WRITE);
        let pins = [pin(shadow)?, pin(eventidx)?];
        let addr = |p: &PinnedPages| p.host_addr(0).ok_or(GuestError::NotMapped { iova: 0, len: PAGE });
        let (s, e) = (addr(&pins[0])?, addr(&pins[1])?);
        let queues = queues.min((PAGE / 8) as usize);
        Ok(ShadowDoorbells {
            _pins: pins,
            shadow: s as *const AtomicU32,
            eventidx: e as *const AtomicU32,
            iova: [shadow, eventidx],
            bus_master: ctx.bus_master_switch(),
            last: (0..queues).map(|_| CachePadded::new([AtomicU32::new(0), AtomicU32::new(0)])).collect(),
        })
    }

    /// Where doorbell `index`'s last value is kept, if its queue is the controller's.
    fn last(&self, index: usize) -> Option<&AtomicU32> {
        self.last.get(index / 2).map(|pair| &pair[index % 2])
    }

    /// Dword `index` of the page at `base` (one of `self`'s).
    fn slot(&self, base: *const AtomicU32, index: usize) -> &AtomicU32 {
        assert!(index < (PAGE / 4) as usize, "doorbell index {index} outside the page");
        // SAFETY: `base` is one of this struct's page pointers and `index` is inside the page
        // (checked above); the page is pinned and mapped while `self` lives, which the
        // returned borrow cannot outlive; 4-byte aligned since the page is.
        unsafe { &*base.add(index) }
    }

    /// The value the host last wrote for doorbell `index` (Acquire: its queue entries are
    /// visible). While bus mastering is off the page is not read: the value is the last one
    /// read or written here.
    pub fn load(&self, index: usize) -> u32 {
        let last = self.last(index);
        if !self.bus_master.enabled() {
            if let Some(last) = last {
                return last.load(Ordering::Relaxed);
            }
        }
        let value = u32::from_le(self.slot(self.shadow, index).load(Ordering::Acquire));
        if let Some(last) = last.filter(|l| l.load(Ordering::Relaxed) != value) {
            last.store(value, Ordering::Relaxed);
        }
        value
    }

    /// Sets doorbell `index`'s shadow value (at Doorbell Buffer Config, or a queue's
    /// creation); only remembered while bus mastering is off.
    pub fn store(&self, index: usize, value: u32) {
        if let Some(last) = self.last(index) {
            last.store(value, Ordering::Relaxed);
        }
        if self.bus_master.enabled() {
            self.slot(self.shadow, index).store(value.to_le(), Ordering::Release);
        }
    }

    /// Sets doorbell `index`'s event index, then a full fence: a value the host writes after
    /// this is either seen by the caller's next [`ShadowDoorbells::load`] or rings the
    /// doorbell register (the host writes the shadow, fences, then reads the event index).
    /// Nothing while bus mastering is off: the workers look again when it comes back.
    pub fn arm(&self, index: usize, value: u32) {
        if !self.bus_master.enabled() {
            return;
        }
        self.slot(self.eventidx, index).store(value.to_le(), Ordering::Release);
        std::sync::atomic::fence(Ordering::SeqCst);
    }

    /// Whether `[iova, iova + len)` covers either page.
    pub fn overlaps(&self, iova: u64, len: u64) -> bool {
        let end = iova.saturating_add(len);
        self.iova.iter().any(|&p| p < end && iova < p + PAGE)
    }
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::FileExt;
    use std::sync::atomic::Ordering;

    use super::{DoorbellPage, PAGE};

    /// A file like BAR0's: the doorbell page at offset `PAGE`.
    fn bar0() -> std::fs::File {
        umdev_mdev::region_memfd(c"umdev-test-doorbells", 2 * PAGE).unwrap()
    }

    /// Doorbell `index` as `file` holds it.
    fn in_file(file: &std::fs::File, index: u64) -> u32 {
        let mut bytes = [0u8; 4];
        file.read_exact_at(&mut bytes, PAGE + 4 * index).unwrap();
        u32::from_le_bytes(bytes)
    }

    #[test]
    fn a_replaced_page_is_the_new_files() {
        let (old, new) = (bar0(), bar0());
        let page = DoorbellPage::new(old.try_clone().unwrap(), PAGE).unwrap();
        page.store(0, 7);
        page.replace(&new).unwrap();
        assert_eq!(page.load(0), 0, "the new file's doorbell");
        page.store(1, 9);
        assert_eq!((in_file(&new, 1), in_file(&old, 1)), (9, 0));
        assert_eq!(in_file(&old, 0), 7, "the old file keeps what was written to it");
    }

    /// A MAP_FIXED that fails and takes the old mapping with it (kernels before 6.12): the
    /// old file is mapped back, and the page reads and writes it as before.
    #[test]
    fn a_failed_replace_maps_the_old_file_back() {
        let (old, new) = (bar0(), bar0());
        let page = DoorbellPage::new(old.try_clone().unwrap(), PAGE).unwrap();
        page.store(0, 7);
        page.failing_maps.store(1, Ordering::Release);
        let e = page.replace(&new).unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::ENOMEM), "the map's own error");
        assert_eq!(page.failing_maps.load(Ordering::Acquire), 0, "the map back was not failed");
        assert_eq!(page.load(0), 7, "the old file's doorbell, read through the page");
        page.store(1, 9);
        assert_eq!((in_file(&old, 1), in_file(&new, 1)), (9, 0), "a write reaches the old file");
        // The page is still the old file's: a later replace moves it to the new one.
        page.replace(&new).unwrap();
        page.store(2, 5);
        assert_eq!((in_file(&new, 2), in_file(&old, 2)), (5, 0));
    }

    /// An isolated page is no file's: what the old client writes to its file is not seen,
    /// and what the page holds is not in the file; a later replace makes it a file's again.
    #[test]
    fn an_isolated_page_is_no_clients() {
        let (old, new) = (bar0(), bar0());
        let page = DoorbellPage::new(old.try_clone().unwrap(), PAGE).unwrap();
        page.store(0, 7);
        page.isolate().unwrap();
        assert_eq!(page.load(0), 0, "a page of its own, zeroed");
        old.write_all_at(&3u32.to_le_bytes(), PAGE + 4).unwrap();
        assert_eq!(page.load(1), 0, "the old client's write is not seen");
        page.store(2, 5);
        assert_eq!(in_file(&old, 2), 0, "nor does the page reach the old file");
        page.replace(&new).unwrap();
        page.store(3, 4);
        assert_eq!((in_file(&new, 3), in_file(&old, 3)), (4, 0));
    }
}
