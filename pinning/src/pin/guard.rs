//! The guard: pins held until it drops.

use std::ptr::NonNull;

use smallvec::SmallVec;
use vm_memory::VolatileSlice;

use super::error::AccessError;
use super::plan::Plan;
use super::{lock_mode, track};
use crate::kernel::{buffers_of, KERNEL_BUFFER_BYTES};
use crate::mapping::MappingState;
use crate::page::{Prot, PAGE_SIZE};
use crate::record::{Owner, Record, RecordPtr, RecordRef, SmallRecord};
use crate::run::{PinnedRun, Segment};

/// Where a byte of a kernel-mode guard's pages lies among its space's registered io_uring
/// buffers ([`PinnedPages::registered_buffer`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RegisteredBuffer {
    /// The buffer's index in the space's table: `buf_index` of `READ_FIXED`/`WRITE_FIXED`.
    pub index: u32,
    /// Host address of the byte: the I/O's `addr`.
    pub addr: usize,
    /// The byte's offset within the buffer.
    pub offset: u64,
    /// Bytes from the byte to the buffer's end.
    pub len: u64,
}

/// Pins held on behalf of a device: the host address of every page and the runs they were
/// pinned in. Dropping the guard unpins them.
///
/// The guard keeps its mappings' memory mapped, and an unmap of a range holding pins waits
/// for them (after notifying the device), so the memory stays valid while the guard lives.
#[must_use = "dropping the guard unpins the pages at once"]
#[derive(Debug)]
pub struct PinnedPages {
    /// Let go of by hand in `Drop` (which handles every kind), so that dropping a guard
    /// adds no drop glue to the release of a small record.
    pub(crate) hold: HoldWord,
}

/// A guard's [`Hold`] in one word: the pointer to what holds the pins, its kind in the two
/// low bits (all three pointees are 8-byte aligned); null once released. A record keeps its
/// space, shard and access (its `Owner`), a plan its access. What it buys: a guard returned
/// through memory is read back with one load, where a wider guard is copied with wide loads
/// of the narrow stores that wrote it, which the CPU cannot forward from its store buffer:
/// a one-page pin+drop takes about 22 ns against 28 ns with a two-word enum (the `hotpath`
/// example, alternating; docs/benchmarks.md).
pub(crate) struct HoldWord(*mut u8);

const HOLD_SMALL: usize = 1;
const HOLD_BOXED: usize = 2;
const HOLD_COUNTED: usize = 3;
const HOLD_KIND: usize = 3;

/// A look at a guard's hold without taking it.
#[derive(Clone, Copy)]
pub(crate) enum HoldView<'a> {
    Recorded(RecordPtr),
    Counted(&'a Plan),
    Released,
}

impl HoldWord {
    #[inline(always)]
    fn recorded(record: RecordPtr) -> Self {
        match record {
            RecordPtr::Small(p) => HoldWord(p.as_ptr().cast::<u8>().map_addr(|a| a | HOLD_SMALL)),
            RecordPtr::Boxed(p) => HoldWord(p.as_ptr().cast::<u8>().map_addr(|a| a | HOLD_BOXED)),
        }
    }

    fn counted(plan: Box<Plan>) -> Self {
        HoldWord(Box::into_raw(plan).cast::<u8>().map_addr(|a| a | HOLD_COUNTED))
    }

    /// The pointer and its kind; `None` when released.
    #[inline(always)]
    fn parts(word: *mut u8) -> Option<(NonNull<u8>, usize)> {
        NonNull::new(word.map_addr(|a| a & !HOLD_KIND)).map(|ptr| (ptr, word.addr() & HOLD_KIND))
    }

    #[inline(always)]
    pub(crate) fn view(&self) -> HoldView<'_> {
        match Self::parts(self.0) {
            None => HoldView::Released,
            Some((ptr, HOLD_SMALL)) => HoldView::Recorded(RecordPtr::Small(ptr.cast())),
            Some((ptr, HOLD_BOXED)) => HoldView::Recorded(RecordPtr::Boxed(ptr.cast())),
            Some((ptr, kind)) => {
                debug_assert_eq!(kind, HOLD_COUNTED, "a hold word's kind is one of three");
                // SAFETY: (I15) the word owns the plan's box until `take`; the view borrows the word.
                HoldView::Counted(unsafe { ptr.cast::<Plan>().as_ref() })
            }
        }
    }

    /// The access the pages were pinned for.
    fn prot(&self) -> Prot {
        match self.view() {
            // SAFETY: (I3, I15) a guard's record is live until the guard lets go of it.
            HoldView::Recorded(record) => unsafe { record.owner() }.prot,
            HoldView::Counted(plan) => plan.prot,
            HoldView::Released => Prot::empty(),
        }
    }

    /// Takes the hold out, leaving the word released.
    fn take(&mut self) -> Hold {
        let word = std::mem::replace(&mut self.0, std::ptr::null_mut());
        let record = match Self::parts(word) {
            None => return Hold::Released,
            Some((ptr, HOLD_SMALL)) => RecordPtr::Small(ptr.cast()),
            Some((ptr, HOLD_BOXED)) => RecordPtr::Boxed(ptr.cast()),
            Some((ptr, kind)) => {
                debug_assert_eq!(kind, HOLD_COUNTED, "a hold word's kind is one of three");
                // SAFETY: (I15) the word owned this box (made by `counted`) and has just given it up.
                return Hold::Counted(unsafe { Box::from_raw(ptr.cast::<Plan>().as_ptr()) });
            }
        };
        // SAFETY: (I3) a guard's record is live until the guard lets go of it, which the
        // caller does with what this returns.
        let owner = unsafe { record.owner() };
        Hold::Recorded { owner, record }
    }
}

// The hold's kind lives in the low two bits of the pointers.
const _: () = assert!(
    std::mem::align_of::<SmallRecord>() > HOLD_KIND
        && std::mem::align_of::<Record>() > HOLD_KIND
        && std::mem::align_of::<Plan>() > HOLD_KIND
);
// A guard is one word (see `HoldWord`).
const _: () = assert!(std::mem::size_of::<PinnedPages>() == std::mem::size_of::<usize>());

impl std::fmt::Debug for HoldWord {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.view() {
            HoldView::Recorded(record) => f.debug_tuple("Recorded").field(&record).finish(),
            HoldView::Counted(plan) => f.debug_tuple("Counted").field(plan).finish(),
            HoldView::Released => f.write_str("Released"),
        }
    }
}

/// How a guard holds its pins, taken out of its [`HoldWord`].
#[derive(Debug)]
pub(crate) enum Hold {
    /// Track mode: a live record in shard `shard` of the space, which that shard keeps alive
    /// while the record lives; the record names the runs and their mappings.
    Recorded { owner: Owner, record: RecordPtr },
    /// Lock mode: counted per page in the mappings' tables; the guard keeps the mappings.
    /// Boxed so that a guard stays small to move; the box is reused by the thread's next
    /// call (see `SPARE_PLAN`).
    Counted(Box<Plan>),
    /// Handed to the caller by `forget`.
    Released,
}

// SAFETY: (I3, I4, I5) a recorded guard's record is immutable while the guard lives and
// names its space, which outlives the record (its shard holds it); reading either from any
// thread is sound. Retiring a record takes the shard's lock; releasing a small record is one
// atomic store, after which the guard touches nothing, from whichever thread drops it. A
// counted guard's word owns a boxed plan that holds only Arcs and plain data.
unsafe impl Send for PinnedPages {}
// SAFETY: (I3, I4) as above: shared access only reads the record and the mappings.
unsafe impl Sync for PinnedPages {}

impl PinnedPages {
    /// The guard of a track-mode record.
    #[inline(always)]
    pub(super) fn recorded(record: RecordPtr) -> Self {
        PinnedPages { hold: HoldWord::recorded(record) }
    }

    /// The guard of a lock-mode plan.
    #[inline(always)]
    pub(super) fn counted(plan: Box<Plan>) -> Self {
        PinnedPages { hold: HoldWord::counted(plan) }
    }

    fn record(&self) -> Option<RecordRef<'_>> {
        match self.hold.view() {
            // SAFETY: (I3, I15) the record is live until this guard retires it (drop or forget), and
            // the view is borrowed with the guard.
            HoldView::Recorded(record) => Some(unsafe { record.view() }),
            _ => None,
        }
    }

    fn runs_slice(&self) -> &[PinnedRun] {
        match self.hold.view() {
            HoldView::Recorded(_) => self.record().map_or(&[], |r| r.runs),
            HoldView::Counted(plan) => &plan.runs,
            HoldView::Released => &[],
        }
    }

    fn pages(&self) -> u64 {
        match self.hold.view() {
            HoldView::Recorded(_) => self.record().map_or(0, |r| r.pages),
            HoldView::Counted(plan) => plan.pages,
            HoldView::Released => 0,
        }
    }

    /// Pages pinned (entries of the call).
    pub fn len(&self) -> usize {
        self.pages() as usize
    }

    /// Always false: a pin call pins at least one page.
    pub fn is_empty(&self) -> bool {
        self.pages() == 0
    }

    /// Access the pages were pinned for.
    pub fn prot(&self) -> Prot {
        self.hold.prot()
    }

    /// The runs, in the order of the call's entries.
    pub fn runs(&self) -> &[PinnedRun] {
        self.runs_slice()
    }

    /// The scatter-gather list: runs in call order, host-adjacent neighbours merged.
    pub fn segments(&self) -> impl Iterator<Item = Segment> + '_ {
        let mut runs = self.runs_slice().iter().peekable();
        std::iter::from_fn(move || {
            let first = runs.next()?;
            let mut seg = Segment { host_addr: first.host, len: first.len(), index: first.index() };
            while let Some(next) = runs.next_if(|r| r.host == seg.host_addr + seg.len as usize) {
                seg.len += next.len();
            }
            Some(seg)
        })
    }

    fn run_of(&self, index: usize) -> Option<&PinnedRun> {
        let runs = self.runs_slice();
        let at = runs.partition_point(|r| r.index() <= index).checked_sub(1)?;
        let run = &runs[at];
        (index < run.index() + run.npages() as usize).then_some(run)
    }

    /// IOVA of entry `index`.
    pub fn iova(&self, index: usize) -> Option<u64> {
        self.run_of(index).map(|r| r.iova + (index - r.index()) as u64 * PAGE_SIZE)
    }

    /// Host address of entry `index`'s page. Valid while the pins are held; prefer
    /// [`PinnedPages::read`] and [`PinnedPages::write`], which check bounds and access.
    pub fn host_addr(&self, index: usize) -> Option<usize> {
        self.run_of(index).map(|r| r.host + (index - r.index()) * PAGE_SIZE as usize)
    }

    /// Bytes pinned: the pages taken as one buffer, entry 0 first.
    pub fn size(&self) -> u64 {
        self.pages() * PAGE_SIZE
    }

    fn check(&self, offset: u64, len: usize) -> Result<(), AccessError> {
        match offset.checked_add(len as u64) {
            Some(end) if end <= self.size() => Ok(()),
            _ => Err(AccessError::OutOfRange { offset, len: len as u64, size: self.size() }),
        }
    }

    /// True if the client truncated the memory behind any of the pages since they were
    /// mapped: accesses to them see zeros and lose writes. Devices that use the host
    /// addresses directly check this after an access, as the copy helpers do.
    pub fn poisoned(&self) -> bool {
        // This runs after every copy. While no mapping of the process was ever poisoned (the
        // usual life) it is one load of a flag nobody writes, not a walk to each mapping.
        if !crate::sigbus::ever_poisoned() {
            return false;
        }
        // Two plain loops, not one chained iterator.
        match self.hold.view() {
            HoldView::Recorded(_) => self.record().is_some_and(|r| r.mappings().any(|m| m.poisoned())),
            HoldView::Counted(plan) => plan.mappings.iter().any(|m| m.poisoned()),
            HoldView::Released => false,
        }
    }

    fn check_poisoned(&self) -> Result<(), AccessError> {
        if self.poisoned() {
            Err(AccessError::Poisoned)
        } else {
            Ok(())
        }
    }

    /// Calls `f(host_addr, buf_offset, len)` for each contiguous piece of
    /// `[offset, offset + len)` of the pinned buffer. The caller has checked the range
    /// ([`PinnedPages::check`]), so the pieces cover `[0, len)` of the caller's buffer.
    fn for_each_piece(&self, offset: u64, len: usize, mut f: impl FnMut(usize, usize, usize)) {
        let mut done = 0usize;
        let runs = self.runs_slice();
        let start = runs.partition_point(|r| ((r.index() as u64 + r.npages()) * PAGE_SIZE) <= offset);
        for run in &runs[start..] {
            if done == len {
                break;
            }
            let run_start = run.index() as u64 * PAGE_SIZE;
            let at = offset + done as u64 - run_start;
            let n = ((run.len() - at) as usize).min(len - done);
            f(run.host + at as usize, done, n);
            done += n;
        }
    }

    /// Reads a `T` (a `#[repr(C)]` guest structure) at byte `offset` of the pinned pages.
    pub fn read_obj<T: vm_memory::ByteValued>(&self, offset: u64) -> Result<T, AccessError> {
        let mut value = T::zeroed();
        self.read(offset, value.as_mut_slice())?;
        Ok(value)
    }

    /// Writes a `T` at byte `offset` of the pinned pages (which must be pinned for write).
    pub fn write_obj<T: vm_memory::ByteValued>(&self, offset: u64, value: &T) -> Result<(), AccessError> {
        self.write(offset, value.as_slice())
    }

    /// Copies `buf.len()` bytes at `offset` of the pinned buffer (entry 0's page first) out.
    ///
    /// The pages are shared with the client, which may write them meanwhile: the bytes
    /// copied are then some mix of old and new, and nothing tells which.
    pub fn read(&self, offset: u64, buf: &mut [u8]) -> Result<(), AccessError> {
        self.check(offset, buf.len())?;
        self.for_each_piece(offset, buf.len(), |host, at, n| {
            // SAFETY: (I13) [host, host + n) lies in pinned pages of a mapping this guard keeps
            // mapped while the slice lives, readable (every mapping grants read). The client
            // may write them during the copy, so no Rust reference to them is made: the copy
            // goes through VolatileSlice, vm-memory's accessor for memory another party
            // writes (as a VMM reads guest RAM). Bytes written meanwhile may be torn.
            let src = unsafe { VolatileSlice::new(host as *mut u8, n) };
            src.copy_to(&mut buf[at..at + n]);
        });
        self.check_poisoned()
    }

    /// Copies `buf` into the pinned buffer at `offset`. The pages must have been pinned
    /// with [`Prot::WRITE`].
    pub fn write(&self, offset: u64, buf: &[u8]) -> Result<(), AccessError> {
        if !self.prot().contains(Prot::WRITE) {
            return Err(AccessError::ReadOnly);
        }
        self.check(offset, buf.len())?;
        self.for_each_piece(offset, buf.len(), |host, at, n| {
            // SAFETY: (I13) as in read; the pin asked for WRITE, which the planner checked the
            // mapping grants, so the pages are mapped writable.
            let dst = unsafe { VolatileSlice::new(host as *mut u8, n) };
            dst.copy_from(&buf[at..at + n]);
        });
        self.check_poisoned()
    }

    /// Copies `dst.len()` bytes at `offset` of the pinned buffer into `dst`: memory shared
    /// with others (a device's mmapped store, say), copied with memcpy semantics.
    pub fn read_volatile(&self, offset: u64, dst: &VolatileSlice<'_>) -> Result<(), AccessError> {
        self.check(offset, dst.len())?;
        self.for_each_piece(offset, dst.len(), |host, at, n| {
            // SAFETY: (I13) [host, host + n) lies in pinned, readable pages this guard keeps mapped.
            let src = unsafe { VolatileSlice::new(host as *mut u8, n) };
            src.copy_to_volatile_slice(dst.subslice(at, n).expect("a piece lies inside the checked range"));
        });
        self.check_poisoned()
    }

    /// Copies `src` into the pinned buffer at `offset`. The pages must have been pinned
    /// with [`Prot::WRITE`].
    pub fn write_volatile(&self, offset: u64, src: &VolatileSlice<'_>) -> Result<(), AccessError> {
        if !self.prot().contains(Prot::WRITE) {
            return Err(AccessError::ReadOnly);
        }
        self.check(offset, src.len())?;
        self.for_each_piece(offset, src.len(), |host, at, n| {
            // SAFETY: (I13) [host, host + n) lies in pinned pages this guard keeps mapped, writable
            // since the pin asked for WRITE.
            let dst = unsafe { VolatileSlice::new(host as *mut u8, n) };
            src.subslice(at, n).expect("a piece lies inside the checked range").copy_to_volatile_slice(dst);
        });
        self.check_poisoned()
    }

    /// `[offset, offset + len)` of the pinned buffer as one slice of host memory, for a
    /// small structure read or written in place (a queue entry, say) without a copy's
    /// per-call range and piece lookups. The range must lie in one run (or in runs that are
    /// next to each other in host memory): a structure that does not cross a page boundary
    /// always does. `prot` is what the caller will do to the memory. The slice borrows the
    /// guard, so the pages stay pinned while it lives; a caller checks
    /// [`PinnedPages::poisoned`] after its accesses, as the copy helpers do.
    pub fn slice(&self, offset: u64, len: usize, prot: Prot) -> Result<VolatileSlice<'_>, AccessError> {
        if prot.contains(Prot::WRITE) && !self.prot().contains(Prot::WRITE) {
            return Err(AccessError::ReadOnly);
        }
        self.check(offset, len)?;
        // Most ranges lie in one run: found by one search.
        let runs = self.runs_slice();
        let i = runs.partition_point(|r| ((r.index() as u64 + r.npages()) * PAGE_SIZE) <= offset);
        if let Some(run) = runs.get(i) {
            let at = offset - run.index() as u64 * PAGE_SIZE;
            if at + len as u64 <= run.len() {
                // SAFETY: (I13) [host + at, + len) lies in this run's pinned pages, of a mapping this
                // guard keeps mapped, writable if WRITE was asked for (checked above), while the
                // slice, which borrows the guard, lives.
                return Ok(unsafe { VolatileSlice::new((run.host + at as usize) as *mut u8, len) });
            }
        }
        // Across runs: one slice if they are next to each other in host memory, which
        // `io_slices` merges.
        match self.io_slices(offset, len, prot)?.as_slice() {
            // An empty range: an empty slice at no particular place.
            [] => Ok(VolatileSlice::from(&mut [][..])),
            [one] => Ok(*one),
            _ => Err(AccessError::NotContiguous { offset, len: len as u64 }),
        }
    }

    /// `[offset, offset + len)` of the pinned buffer as host memory, one slice per
    /// contiguous piece (a run, host-adjacent runs merged), for I/O straight to or from the
    /// pages (`preadv` into them, say). `prot` is what the caller will do to the memory:
    /// asking for [`Prot::WRITE`] on pages pinned read-only fails. The slices borrow the
    /// guard, so the pages stay pinned while they live; a caller that wrote through them
    /// checks [`PinnedPages::poisoned`] after.
    pub fn io_slices(
        &self,
        offset: u64,
        len: usize,
        prot: Prot,
    ) -> Result<SmallVec<[VolatileSlice<'_>; 8]>, AccessError> {
        if prot.contains(Prot::WRITE) && !self.prot().contains(Prot::WRITE) {
            return Err(AccessError::ReadOnly);
        }
        self.check(offset, len)?;
        let mut out: SmallVec<[VolatileSlice<'_>; 8]> = SmallVec::new();
        let mut next_host = 0usize;
        self.for_each_piece(offset, len, |host, _, n| {
            if let Some(last) = out.last_mut().filter(|_| host == next_host) {
                // SAFETY: (I13) the previous slice ends where this piece starts: together they are
                // one range of pinned pages this guard keeps mapped.
                *last = unsafe { VolatileSlice::new(last.ptr_guard_mut().as_ptr(), last.len() + n) };
            } else {
                // SAFETY: (I13) [host, host + n) lies in pinned pages of a mapping this guard keeps
                // mapped (and writable if WRITE was asked for, checked above) while the
                // slice, which borrows the guard, lives.
                out.push(unsafe { VolatileSlice::new(host as *mut u8, n) });
            }
            next_host = host + n;
        });
        Ok(out)
    }

    /// Kernel mode: where byte `offset` of the pinned buffer (entry 0's page first) lies
    /// among the space's registered io_uring buffers, for `READ_FIXED` and `WRITE_FIXED`:
    /// the buffer's index in the space's table (`buf_index`), the byte's host address (the
    /// I/O's `addr`: the kernel finds the byte's place in the buffer from it) and its offset
    /// in the buffer, and the bytes from it to the buffer's end (an I/O at `addr` may be at
    /// most that long). Each run is one buffer, or one per GiB of a longer run. The table is
    /// the ring of [`crate::DmaSpace::kernel_ring_fd`]: an I/O on another ring uses a clone
    /// of the slot. Valid while the guard lives (its drop clears the slots). `None` outside
    /// the buffer, and in the other modes.
    pub fn registered_buffer(&self, offset: u64) -> Option<RegisteredBuffer> {
        let record = self.record()?;
        let slots = record.kernel?;
        let entry = usize::try_from(offset / PAGE_SIZE).ok()?;
        let at = record.runs.partition_point(|r| r.index() <= entry).checked_sub(1)?;
        let run = &record.runs[at];
        let within = offset - run.index() as u64 * PAGE_SIZE;
        if within >= run.len() {
            return None;
        }
        let before: u64 = record.runs[..at].iter().map(|r| buffers_of(r.npages())).sum();
        let piece = within / KERNEL_BUFFER_BYTES;
        let offset_in_buffer = within % KERNEL_BUFFER_BYTES;
        let buffer_len = (run.len() - piece * KERNEL_BUFFER_BYTES).min(KERNEL_BUFFER_BYTES);
        Some(RegisteredBuffer {
            index: slots.first + (before + piece) as u32,
            addr: run.host + within as usize,
            offset: offset_in_buffer,
            len: buffer_len - offset_in_buffer,
        })
    }

    /// Unpins now (the same as dropping the guard).
    pub fn unpin(self) {}

    /// Keeps the pins but drops the guard: the caller now owns them and must release them
    /// with [`crate::DmaSpace::unpin_pages`] or [`crate::DmaSpace::unpin_range`] (the `vfio_pin_pages`
    /// model). Memory under pins kept this way is never unmapped while they are held.
    ///
    /// In track mode the pins move from the guard's record to the per-page counts (the
    /// model's bookkeeping), which cost a pass over the pages. A page already holding
    /// [`crate::MAX_PIN_COUNT`] kept pins cannot count more: the guard's pins then stay held
    /// for good (logged; their mappings are never unmapped, as with any pin never returned).
    pub fn forget(mut self) {
        // The guard is released from here on; in lock mode the plan goes, its counts stay
        // (marked kept, for unpin_pages).
        match self.hold.take() {
            // SAFETY: (I3) the record is live and this guard's; it is retired once, there.
            Hold::Recorded { owner, record } => unsafe { track::forget(owner, record) },
            Hold::Counted(plan) => lock_mode::keep(plan),
            Hold::Released => {}
        }
    }
}

impl Drop for PinnedPages {
    #[inline]
    fn drop(&mut self) {
        if let HoldView::Recorded(RecordPtr::Small(entry)) = self.hold.view() {
            // SAFETY: (I3, I4) the entry is live until released or retired here, and its shard
            // keeps the space alive while it is.
            let record = unsafe { entry.as_ref() };
            // Nobody to wake and a space that is not closing: let go without the shard's lock
            // (the shard reclaims the entry). An unmap that marks the mapping just after this
            // look, or a close or abandon_all just after it, learns of the release by looking
            // again (I7, I8).
            // SAFETY: (I4) the record is live.
            let closing = unsafe { track::space_closed(&record.owner) };
            if record.mapping().state() == MappingState::Live && !closing {
                // SAFETY: (I5) the entry is live and this guard's; `record` is not used again.
                unsafe { SmallRecord::release(entry) };
                return;
            }
        }
        retire(self.hold.take());
    }
}

/// Lets go of a guard's pins under the locks: lock mode, boxed records, and small records
/// whose mappings are going or whose space is closing.
#[inline(never)]
fn retire(hold: Hold) {
    match hold {
        Hold::Released => {}
        Hold::Counted(plan) => lock_mode::release(plan),
        // SAFETY: (I3) the record is live and this guard's; it is retired once, there.
        Hold::Recorded { owner, record } => unsafe { track::retire(owner, record) },
    }
}
