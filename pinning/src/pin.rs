//! Pinning: an arbitrary array of IOVA page numbers, pinned one call per contiguous run.
//!
//! A call is planned first, under the mapping table's read lock: the array is cut into
//! maximal runs of consecutive entries with consecutive page numbers inside one mapping
//! (`[1,5,6,7,9]` gives `[1] [5,6,7] [9]`), each run checked for access. Then the locks of
//! the mappings involved are taken in id order and held for the whole call, so the call
//! is all-or-nothing even when it repeats pages or spans mappings: every run is pinned with
//! one table step (and, in lock mode, one accounting step and one mlock per sub-run of newly
//! pinned pages), and on any failure the runs already pinned are unwound.

use std::ptr::NonNull;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use smallvec::SmallVec;
use thiserror::Error;
use vm_memory::VolatileSlice;

use crate::lock::OverLimit;
use crate::lock::PinMode;
use crate::mapping::{Mapping, MappingPins, MappingState, Released, RunFailure};
use crate::mapping::{PinPolicy, PIN_STOCK};
use crate::page::{iova_of, iova_of_checked, Prot, PAGE_SHIFT, PAGE_SIZE};
use crate::slot_lock::SlotGuard;
use crate::slots::{
    Owner, Record, RecordPtr, RecordRef, Slot, SlotHint, SmallRecord, TableRead, SMALL_PINS, SMALL_RUNS,
};
use crate::space::{DmaSpace, MappingTable, SpaceInner};

/// Why a pin call failed. Nothing stays pinned by a failed call.
///
/// `index` is the position in the caller's array of the first page that failed (for range
/// pins, the page's offset in the range) and `pfn` its IOVA page number.
#[derive(Debug, Error)]
pub enum PinError {
    /// The call named no pages.
    #[error("no pages to pin")]
    Empty,
    /// The call named more pages than `max_pages_per_call`.
    #[error("{requested} pages in one call; at most {max} allowed")]
    TooManyPages {
        /// Pages named.
        requested: u64,
        /// The configured maximum.
        max: u64,
    },
    /// The page is not in any mapping.
    #[error("page {index} (pfn {pfn:#x}) is not mapped")]
    NotMapped {
        /// Position in the call.
        index: usize,
        /// IOVA page number.
        pfn: u64,
    },
    /// The mapping does not grant the access asked for.
    #[error("page {index} (pfn {pfn:#x}) is mapped {have:?}, {wanted:?} wanted")]
    Permission {
        /// Position in the call.
        index: usize,
        /// IOVA page number.
        pfn: u64,
        /// Access asked for.
        wanted: Prot,
        /// Access the mapping grants.
        have: Prot,
    },
    /// The page lies in a region mapped without an fd: there is no host memory to pin.
    #[error("page {index} (pfn {pfn:#x}) is in a region with no host memory")]
    NoHostMemory {
        /// Position in the call.
        index: usize,
        /// IOVA page number.
        pfn: u64,
    },
    /// The client shrank the file behind the page's mapping after mapping it; the mapping
    /// now holds zero pages (see `DmaStats::poisoned_mappings`) and grants no pins.
    #[error("page {index} (pfn {pfn:#x}) is in memory whose file the client truncated")]
    Poisoned {
        /// Position in the call.
        index: usize,
        /// IOVA page number.
        pfn: u64,
    },
    /// The page's mapping is being unmapped; no new pins are granted there.
    #[error("page {index} (pfn {pfn:#x}) is being unmapped")]
    Unmapping {
        /// Position in the call.
        index: usize,
        /// IOVA page number.
        pfn: u64,
    },
    /// The call would take the space past its `max_pins`.
    #[error("{requested} more pins would exceed the space's limit of {max} ({held} held)")]
    PinLimit {
        /// Pins the call asked for.
        requested: u64,
        /// Pins held.
        held: u64,
        /// The limit.
        max: u64,
    },
    /// The page already holds the maximum number of pins.
    #[error("page {index} (pfn {pfn:#x}) already holds the maximum of {max} pins", max = crate::MAX_PIN_COUNT)]
    CountOverflow {
        /// Position in the call.
        index: usize,
        /// IOVA page number.
        pfn: u64,
    },
    /// Locking the run starting at this page would exceed the lock limit.
    #[error("page {index} (pfn {pfn:#x}): locking {} more bytes exceeds the limit of {} ({} locked)", over.requested, over.limit, over.locked)]
    LockLimit {
        /// Position in the call.
        index: usize,
        /// IOVA page number.
        pfn: u64,
        /// The refused charge.
        over: OverLimit,
    },
    /// mlock failed for the run starting at this page.
    #[error("page {index} (pfn {pfn:#x}): mlock failed: {source}")]
    Lock {
        /// Position in the call.
        index: usize,
        /// IOVA page number.
        pfn: u64,
        /// The syscall's error.
        source: std::io::Error,
    },
}

impl PinError {
    /// The errno a VFIO-style interface reports for this error.
    pub fn errno(&self) -> i32 {
        match self {
            PinError::Empty | PinError::NotMapped { .. } => libc::EINVAL,
            PinError::TooManyPages { .. } => libc::E2BIG,
            PinError::Permission { .. } => libc::EPERM,
            PinError::NoHostMemory { .. } | PinError::Poisoned { .. } => libc::EFAULT,
            PinError::Unmapping { .. } => libc::EBUSY,
            PinError::CountOverflow { .. } | PinError::PinLimit { .. } => libc::ENOSPC,
            PinError::LockLimit { .. } => libc::ENOMEM,
            PinError::Lock { source, .. } => source.raw_os_error().unwrap_or(libc::ENOMEM),
        }
    }
}

/// Why an unpin call failed. Nothing was unpinned.
#[derive(Debug, Error)]
pub enum UnpinError {
    /// The call named no pages, or too many.
    #[error("invalid unpin of {0} pages")]
    InvalidCount(u64),
    /// The page is not in any mapping.
    #[error("page {index} (pfn {pfn:#x}) is not mapped")]
    NotMapped {
        /// Position in the call.
        index: usize,
        /// IOVA page number.
        pfn: u64,
    },
    /// The page holds no pin (counting earlier entries of the same call).
    #[error("page {index} (pfn {pfn:#x}) is not pinned")]
    NotPinned {
        /// Position in the call.
        index: usize,
        /// IOVA page number.
        pfn: u64,
    },
}

impl UnpinError {
    /// The errno a VFIO-style interface reports for this error.
    pub fn errno(&self) -> i32 {
        libc::EINVAL
    }
}

/// Why a guard could not copy to or from its pages.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum AccessError {
    /// The byte range is not inside the pinned pages.
    #[error("bytes [{offset:#x}, +{len:#x}) are outside the {size:#x} pinned bytes")]
    OutOfRange {
        /// Requested offset.
        offset: u64,
        /// Requested length.
        len: u64,
        /// Bytes pinned.
        size: u64,
    },
    /// The pages were pinned without write access.
    #[error("the pages were pinned read-only")]
    ReadOnly,
    /// The client shrank the file behind the pages while they were pinned: the copy saw
    /// zero pages (a read) or was lost (a write).
    #[error("the client truncated the memory behind the pinned pages")]
    Poisoned,
}

/// Consecutive entries of a pin call with consecutive page numbers in one mapping, pinned as
/// one step. Host memory of a run is contiguous.
// Four words: a call writes one per run, and 8-run small records stay small. Pages and
// position fit 32 bits (`max_pages_per_call` is at most 2^32 - 1); the run's page within its
// mapping is not kept but derived from the IOVA (`PinnedRun::page_in`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PinnedRun {
    iova: u64,
    host: usize,
    npages: u32,
    index: u32,
    /// Which of the guard's mappings holds the run.
    slot: u32,
}

const _: () = assert!(std::mem::size_of::<PinnedRun>() == 32);

impl PinnedRun {
    /// No run (a free entry's contents).
    pub(crate) const EMPTY: PinnedRun = PinnedRun { iova: 0, host: 0, npages: 0, index: 0, slot: 0 };

    /// A run of `npages` pages from page `pfn`, entry `index` of its call, in the guard's
    /// mapping `slot`, at `host`. `npages` and `index` are below the call's length, which
    /// `max_pages_per_call` keeps within 32 bits.
    #[inline(always)]
    pub(crate) fn new(pfn: u64, npages: u64, index: usize, host: usize, slot: usize) -> Self {
        debug_assert!(
            npages <= u64::from(u32::MAX) && index <= u32::MAX as usize && slot <= u32::MAX as usize
        );
        PinnedRun { iova: iova_of(pfn), host, npages: npages as u32, index: index as u32, slot: slot as u32 }
    }

    /// Which of the guard's mappings holds the run.
    #[inline]
    pub(crate) fn slot(&self) -> usize {
        self.slot as usize
    }

    /// The run's first page as an offset within `mapping`, the one that holds it.
    #[inline]
    pub(crate) fn page_in(&self, mapping: &Mapping) -> u64 {
        (self.iova >> PAGE_SHIFT) - mapping.first_pfn
    }

    /// IOVA of the run's first page.
    pub fn iova(&self) -> u64 {
        self.iova
    }
    /// Pages in the run.
    pub fn npages(&self) -> u64 {
        u64::from(self.npages)
    }
    /// Position of the run's first page in the call's array.
    pub fn index(&self) -> usize {
        self.index as usize
    }
    /// Host address of the run's first page. Valid while the pins are held.
    pub fn host_addr(&self) -> usize {
        self.host
    }
    /// Bytes in the run.
    pub fn len(&self) -> u64 {
        self.npages() * PAGE_SIZE
    }
    /// Always false: runs hold at least one page.
    pub fn is_empty(&self) -> bool {
        self.npages == 0
    }
}

/// A scatter-gather element: host-adjacent consecutive runs merged.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Segment {
    /// Host address of the first byte.
    pub host_addr: usize,
    /// Bytes.
    pub len: u64,
    /// Position of the segment's first page in the call's array.
    pub index: usize,
}

/// The runs of a call: most calls have one or two.
pub(crate) type Runs = SmallVec<[PinnedRun; 2]>;
type Mappings = SmallVec<[Arc<Mapping>; 2]>;

/// A pin call, cut into runs and resolved to mappings it holds, not yet applied.
#[derive(Debug, Default)]
struct Plan {
    mappings: Mappings,
    runs: Runs,
    pages: u64,
    /// The access the guard's pages were pinned for.
    prot: Prot,
}

thread_local! {
    /// One emptied lock-mode plan kept by each thread for its next call, so that a guard's
    /// box is not allocated and freed on every pin.
    static SPARE_PLAN: std::cell::Cell<Option<Box<Plan>>> = const { std::cell::Cell::new(None) };
}

impl Plan {
    /// A boxed empty plan: this thread's spare, else a new one.
    fn boxed() -> Box<Plan> {
        SPARE_PLAN.try_with(|spare| spare.take()).ok().flatten().unwrap_or_default()
    }

    /// Lets go of the plan's mappings and keeps its box as this thread's spare (unless its
    /// runs spilled to the heap: a long call's room is not kept).
    fn recycle(mut plan: Box<Plan>) {
        plan.mappings.clear();
        if plan.runs.spilled() {
            return;
        }
        plan.runs.clear();
        plan.pages = 0;
        let _ = SPARE_PLAN.try_with(|spare| spare.set(Some(plan)));
    }
}

/// The mappings a planned call's runs lie in, borrowed from the table read it was planned in.
struct Planned<'a> {
    mappings: SmallVec<[&'a Arc<Mapping>; 2]>,
    pages: u64,
}

/// Resolves page numbers to mappings under a table read, cutting the call into `runs`.
struct Planner<'a, 'r> {
    table: &'a MappingTable,
    /// The slot's hint: the mapping this thread resolved last (its lock is held).
    slot_hint: &'a mut SlotHint,
    wanted: Prot,
    /// Whether the access check applies (unpins need none).
    pinning: bool,
    runs: &'r mut Runs,
    planned: Planned<'a>,
    /// The mapping last resolved: its guard slot, page range and host address of its first
    /// page. The usual next hit.
    hint: Option<(usize, u64, u64, usize)>,
}

impl<'a, 'r> Planner<'a, 'r> {
    fn new(read: &'a mut TableRead<'_>, wanted: Prot, pinning: bool, runs: &'r mut Runs) -> Self {
        let (table, slot) = read.parts();
        Planner {
            table,
            slot_hint: &mut slot.hint,
            wanted,
            pinning,
            runs,
            planned: Planned { mappings: SmallVec::new(), pages: 0 },
            hint: None,
        }
    }

    /// Plans with `plan` into a plan of its own, which holds its mappings.
    fn owned(
        read: &'a mut TableRead<'_>,
        wanted: Prot,
        pinning: bool,
        plan: impl FnOnce(Planner<'a, '_>) -> Result<Planned<'a>, PinError>,
    ) -> Result<Plan, PinError> {
        let mut owned = Plan::default();
        Self::owned_into(read, wanted, pinning, &mut owned, plan)?;
        Ok(owned)
    }

    /// [`Planner::owned`] straight into the box a lock-mode guard keeps (nothing moved after).
    fn boxed(
        read: &'a mut TableRead<'_>,
        wanted: Prot,
        plan: impl FnOnce(Planner<'a, '_>) -> Result<Planned<'a>, PinError>,
    ) -> Result<Box<Plan>, PinError> {
        let mut boxed = Plan::boxed();
        boxed.prot = wanted;
        if let Err(e) = Self::owned_into(read, wanted, true, &mut boxed, plan) {
            Plan::recycle(boxed);
            return Err(e);
        }
        Ok(boxed)
    }

    fn owned_into(
        read: &'a mut TableRead<'_>,
        wanted: Prot,
        pinning: bool,
        into: &mut Plan,
        plan: impl FnOnce(Planner<'a, '_>) -> Result<Planned<'a>, PinError>,
    ) -> Result<(), PinError> {
        let planned = plan(Planner::new(read, wanted, pinning, &mut into.runs))?;
        into.mappings.extend(planned.mappings.iter().map(|m| Arc::clone(m)));
        into.pages = planned.pages;
        Ok(())
    }

    /// The guard slot of the mapping holding `pfn` (entry `index` of the call).
    fn resolve(&mut self, pfn: u64, index: usize) -> Result<(usize, u64, u64, usize), PinError> {
        if let Some(hint @ (_, first, end, _)) = self.hint {
            if pfn >= first && pfn < end {
                return Ok(hint);
            }
        }
        let Some(mapping) = lookup(self.table, self.slot_hint, pfn) else {
            return Err(PinError::NotMapped { index, pfn });
        };
        if self.pinning {
            if !mapping.prot.contains(self.wanted) {
                return Err(PinError::Permission { index, pfn, wanted: self.wanted, have: mapping.prot });
            }
            if mapping.memory.is_none() {
                return Err(PinError::NoHostMemory { index, pfn });
            }
            if mapping.poisoned() {
                return Err(PinError::Poisoned { index, pfn });
            }
        }
        let mappings = &mut self.planned.mappings;
        let slot = match mappings.iter().position(|m| Arc::ptr_eq(m, mapping)) {
            Some(slot) => slot,
            None => {
                mappings.push(mapping);
                mappings.len() - 1
            }
        };
        // Unpins plan message-only regions too: they have no host address (and get none).
        let hint = (slot, mapping.first_pfn, mapping.end_pfn(), mapping.host_addr(0).unwrap_or(0));
        self.hint = Some(hint);
        Ok(hint)
    }

    #[inline]
    fn push_run(
        &mut self,
        (slot, first, _, base): (usize, u64, u64, usize),
        pfn: u64,
        npages: u64,
        index: usize,
    ) {
        let page = pfn - first;
        let host = if base == 0 { 0 } else { base + (page * PAGE_SIZE) as usize };
        self.runs.push(PinnedRun::new(pfn, npages, index, host, slot));
        self.planned.pages += npages;
    }

    /// Cuts an array into maximal runs.
    fn plan_array(mut self, pfns: &[u64]) -> Result<Planned<'a>, PinError> {
        // One allocation for long scattered arrays instead of repeated doubling.
        if pfns.len() > self.runs.inline_size() {
            self.runs.reserve(pfns.len().min(4096));
        }
        let mut i = 0;
        while i < pfns.len() {
            let start = pfns[i];
            let hit = self.resolve(start, i)?;
            // Extend while the next entry is the next page of the same mapping.
            let n = run_length(&pfns[i..], hit.2 - start);
            self.push_run(hit, start, n, i);
            i += n as usize;
        }
        Ok(self.planned)
    }

    /// Cuts `[pfn, pfn + npages)` at mapping boundaries.
    fn plan_range(mut self, pfn: u64, npages: u64) -> Result<Planned<'a>, PinError> {
        let mut done = 0u64;
        while done < npages {
            let here = pfn + done;
            let hit = self.resolve(here, done as usize)?;
            let n = (hit.2 - here).min(npages - done);
            self.push_run(hit, here, n, done as usize);
            done += n;
        }
        Ok(self.planned)
    }
}

/// What a pin call names.
enum Entries<'p> {
    /// An array of page numbers.
    Array(&'p [u64]),
    /// `npages` pages from a page number.
    Range(u64, u64),
}

/// The mapping a track-mode run lies in: its slot in the record, page range and host address
/// of its first page.
type Resolved = (usize, u64, u64, usize);

/// The mapping holding `pfn`: the slot's hint, else the table (which then becomes the hint).
/// The caller holds the slot's lock, which `hint` belongs to.
#[inline]
fn lookup<'t>(table: &'t MappingTable, hint: &mut SlotHint, pfn: u64) -> Option<&'t Arc<Mapping>> {
    match *hint {
        // SAFETY: the hint points into the table, which cannot change while the slot is
        // locked (the caller holds it); `SlotTable::write` clears it.
        Some((first, end, m)) if pfn >= first && pfn < end => Some(unsafe { &*m.as_ptr() }),
        _ => match table.range(..=pfn).next_back() {
            Some((_, m)) if m.contains(pfn) => {
                *hint = Some((m.first_pfn, m.end_pfn(), NonNull::from(m)));
                Some(m)
            }
            _ => None,
        },
    }
}

/// Finds the mapping holding `pfn` (entry `index`) for a track-mode call: the slot's hint,
/// else the table (which then becomes the hint); checks its access and memory; adds it to the
/// record's mappings if new. The caller holds the slot's lock, which `hint` belongs to.
#[inline]
fn resolve_into(
    table: &MappingTable,
    hint: &mut SlotHint,
    wanted: Prot,
    pfn: u64,
    index: usize,
    record: &mut Record,
) -> Result<Resolved, PinError> {
    let Some(mapping) = lookup(table, hint, pfn) else {
        return Err(PinError::NotMapped { index, pfn });
    };
    if !mapping.prot.contains(wanted) {
        return Err(PinError::Permission { index, pfn, wanted, have: mapping.prot });
    }
    let Some(base) = mapping.host_addr(0) else {
        return Err(PinError::NoHostMemory { index, pfn });
    };
    if mapping.poisoned() {
        return Err(PinError::Poisoned { index, pfn });
    }
    let ptr = NonNull::from(&**mapping);
    let slot = match record.mappings.iter().position(|&m| m == ptr) {
        Some(slot) => slot,
        None => {
            record.mappings.push(ptr);
            record.mappings.len() - 1
        }
    };
    Ok((slot, mapping.first_pfn, mapping.end_pfn(), base))
}

#[inline]
fn push_run_into(record: &mut Record, (slot, first, _, base): Resolved, pfn: u64, npages: u64, index: usize) {
    let page = pfn - first;
    let host = base + (page * PAGE_SIZE) as usize;
    record.runs.push(PinnedRun::new(pfn, npages, index, host, slot));
    record.pages += npages;
}

/// Cuts an array into maximal runs, into a track-mode record. Out of line: its loop gets
/// the registers to itself.
#[inline(never)]
fn plan_array_into(
    table: &MappingTable,
    hint: &mut SlotHint,
    wanted: Prot,
    pfns: &[u64],
    record: &mut Record,
) -> Result<(), PinError> {
    let Some(&first) = pfns.first() else { return Ok(()) };
    let mut hit = resolve_into(table, hint, wanted, first, 0, record)?;
    let mut i = 0;
    while i < pfns.len() {
        let start = pfns[i];
        if start < hit.1 || start >= hit.2 {
            hit = resolve_into(table, hint, wanted, start, i, record)?;
        }
        let n = run_length(&pfns[i..], hit.2 - start);
        let page = start - hit.1;
        let host = hit.3 + (page * PAGE_SIZE) as usize;
        let run = PinnedRun::new(start, n, i, host, hit.0);
        if record.runs.len() == record.runs.capacity() {
            // At most one run per entry left; more than 4096 at a time only as needed.
            record.runs.reserve((pfns.len() - i).min(4096));
        }
        let len = record.runs.len();
        // SAFETY: there is room for one more (just ensured), and a PinnedRun needs no drop.
        unsafe {
            record.runs.as_mut_ptr().add(len).write(run);
            record.runs.set_len(len + 1);
        }
        i += n as usize;
    }
    // The runs cover every entry once.
    record.pages += pfns.len() as u64;
    Ok(())
}

/// Cuts `[pfn, pfn + npages)` at mapping boundaries, into a track-mode record.
fn plan_range_into(
    table: &MappingTable,
    hint: &mut SlotHint,
    wanted: Prot,
    pfn: u64,
    npages: u64,
    record: &mut Record,
) -> Result<(), PinError> {
    let mut done = 0u64;
    while done < npages {
        let here = pfn + done;
        let hit = resolve_into(table, hint, wanted, here, done as usize, record)?;
        let n = (hit.2 - here).min(npages - done);
        push_run_into(record, hit, here, n, done as usize);
        done += n;
    }
    Ok(())
}

/// Track mode's fast path: a call whose runs all lie in one mapping and number at most
/// [`SMALL_RUNS`] (every single page, every range inside one mapping, short IDAW and PRP
/// lists) is planned in place into a free entry of the slot's small-record array. `None`
/// when the call is not such a call, or has an error to report, or does not fit the slot's
/// stock and the limit, or the array is full: the general path then does the whole call, as
/// if this had not run (what this may have changed — the slot's hint, released entries taken
/// back, surplus stock returned, the array allocated — leaves nothing counted twice).
#[inline(always)]
fn pin_small(
    space: &Arc<SpaceInner>,
    table: &MappingTable,
    slot: &mut Slot,
    slot_index: usize,
    prot: Prot,
    what: &Entries<'_>,
    max_pages: u64,
) -> Option<PinnedPages> {
    let (pfn, npages) = match *what {
        Entries::Array(pfns) => (*pfns.first()?, pfns.len() as u64),
        Entries::Range(pfn, npages) => (pfn, npages),
    };
    // Bigger calls never fit a slot's share of small-record pins: no look for room.
    if npages == 0 || npages > max_pages || npages > SMALL_PINS {
        return None;
    }
    let mapping = lookup(table, &mut slot.hint, pfn)?;
    let memory = mapping.memory.as_ref()?;
    if !mapping.prot.contains(prot) || memory.poisoned() || mapping.state() != MappingState::Live {
        return None;
    }
    let base = memory.addr_at(0);
    if slot.small_short(npages) && !reclaim_small(&space.policy, slot, npages) {
        return None;
    }
    let entry = slot.free_small()?;
    // SAFETY: a free entry of our locked slot: nobody else reads or writes it until it is
    // published below.
    let record = unsafe { &mut *entry.as_ptr() };
    let (first, end) = (mapping.first_pfn, mapping.end_pfn());
    let run = |pfn: u64, npages: u64, index: usize| {
        PinnedRun::new(pfn, npages, index, base + ((pfn - first) * PAGE_SIZE) as usize, 0)
    };
    let len = match *what {
        Entries::Range(pfn, npages) => {
            if npages > end - pfn {
                return None;
            }
            record.set_run(0, run(pfn, npages, 0));
            1
        }
        // One page, most calls of a channel program: `lookup` found it in the mapping.
        Entries::Array(&[pfn]) => {
            record.set_run(0, run(pfn, 1, 0));
            1
        }
        Entries::Array(pfns) => {
            let (mut i, mut k) = (0, 0);
            while i < pfns.len() {
                let start = pfns[i];
                if start < first || start >= end || k == SMALL_RUNS {
                    return None;
                }
                let n = if i + 1 == pfns.len() { 1 } else { run_length(&pfns[i..], end - start) };
                record.set_run(k, run(start, n, i));
                k += 1;
                i += n as usize;
            }
            k
        }
    };
    if slot.stock < npages && !refill_stock(&space.policy, slot, npages) {
        return None;
    }
    slot.stock -= npages;
    let owner = Owner { space: NonNull::from(&**space), slot: slot_index, prot };
    // SAFETY: `entry` came from `free_small` of this slot under this hold of its lock.
    unsafe { slot.publish_small(entry, len, npages, NonNull::from(&**mapping), owner) };
    if slot.keepalive.is_none() {
        // Once per slot: the slot holds the space while it has records (see SpaceHandle).
        slot.keepalive = Some(Arc::clone(space));
    }
    slot.counts.pin_calls += 1;
    slot.counts.runs += len as u64;
    slot.counts.pages += npages;
    Some(PinnedPages { hold: HoldWord::recorded(RecordPtr::Small(entry)) })
}

/// Takes back a slot's released small records when it is short for a call of `pages`
/// pages (see `Slot::reclaim_short_small`; their pins into its stock, the surplus beyond
/// two stocks back to the space); true if the call fits now.
#[cold]
fn reclaim_small(policy: &PinPolicy, slot: &mut Slot, pages: u64) -> bool {
    let room = slot.reclaim_short_small(pages);
    trim_stock(policy, slot);
    room
}

/// Tops a slot's stock up by `pins` and a stock more from the space; false if that does
/// not fit under the limit (the general path then reserves exactly, or fails).
#[cold]
fn refill_stock(policy: &PinPolicy, slot: &mut Slot, pins: u64) -> bool {
    let more = pins.saturating_add(PIN_STOCK);
    if policy.take(more).is_err() {
        return false;
    }
    slot.stock += more;
    true
}

/// Gives a slot's stock beyond two stocks' worth back to the space.
#[inline]
fn trim_stock(policy: &PinPolicy, slot: &mut Slot) {
    if slot.stock > 2 * PIN_STOCK {
        policy.give(slot.stock - PIN_STOCK);
        slot.stock = PIN_STOCK;
    }
}

/// How many entries from `pfns[0]` go on page by page (at most `limit`, the pages left in
/// its mapping): the length of the run starting there. Inline for the usual answer (the
/// next entry does not continue: 1), out of line for longer runs.
#[inline(always)]
fn run_length(pfns: &[u64], limit: u64) -> u64 {
    // Scattered arrays end their runs at once.
    match pfns {
        [first, second, ..] if limit >= 2 && *second == first.wrapping_add(1) => {
            continued_run_length(pfns, limit)
        }
        _ => 1,
    }
}

/// [`run_length`] of a run known to go on past its first entry.
#[inline(never)]
fn continued_run_length(pfns: &[u64], limit: u64) -> u64 {
    let max = usize::try_from(limit).unwrap_or(usize::MAX).min(pfns.len());
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx512f") {
            // SAFETY: the CPU has AVX-512F, checked just now.
            return unsafe { run_length_avx512(&pfns[..max]) };
        }
        if std::arch::is_x86_feature_detected!("avx2") {
            // SAFETY: the CPU has AVX2, checked just now.
            return unsafe { run_length_avx2(&pfns[..max]) };
        }
    }
    long_run_length(&pfns[..max])
}

/// [`long_run_length`] compiled for AVX-512: a cache line of entries per compare, so a
/// 512-page run reads its array at about the speed of a plain pass over it.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn run_length_avx512(pfns: &[u64]) -> u64 {
    long_run_length(pfns)
}

/// [`long_run_length`] compiled for AVX2: four entries per compare.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn run_length_avx2(pfns: &[u64]) -> u64 {
    long_run_length(pfns)
}

/// The run length of the whole of `pfns` (at least its first two entries continue): entry
/// by entry up to a cache-line boundary (loads that split lines cost twice), then 32
/// entries at a time. Entry `k` of a run is `start + k`, so `p - k` is the same for all.
#[inline(always)]
fn long_run_length(pfns: &[u64]) -> u64 {
    const LINE_ENTRIES: usize = 64 / std::mem::size_of::<u64>();
    let start = pfns[0];
    let continues = |n: usize| pfns[n] == start.wrapping_add(n as u64);
    let misaligned = (pfns.as_ptr() as usize / std::mem::size_of::<u64>()) % LINE_ENTRIES;
    let head = ((LINE_ENTRIES - misaligned) % LINE_ENTRIES).min(pfns.len());
    let mut n = 0;
    while n < head {
        if !continues(n) {
            return n as u64;
        }
        n += 1;
    }
    for chunk in pfns[head..].chunks_exact(32).filter_map(|c| <&[u64; 32]>::try_from(c).ok()) {
        let want = start.wrapping_add(n as u64);
        let diff = chunk.iter().enumerate().fold(0, |acc, (k, &p)| acc | (p.wrapping_sub(k as u64) ^ want));
        if diff != 0 {
            break;
        }
        n += 32;
    }
    while n < pfns.len() && continues(n) {
        n += 1;
    }
    n as u64
}

/// The locks of a plan's mappings, taken in mapping-id order, indexed by slot.
enum Locked<'a> {
    /// The usual plan: one mapping.
    One(SlotGuard<'a, MappingPins>),
    /// Any other number of mappings.
    Many(SmallVec<[Option<SlotGuard<'a, MappingPins>>; 2]>),
}

impl<'a> Locked<'a> {
    fn take(mappings: &'a [Arc<Mapping>]) -> Self {
        if let [only] = mappings {
            return Locked::One(only.lock());
        }
        let mut guards: SmallVec<[Option<SlotGuard<'a, MappingPins>>; 2]> =
            mappings.iter().map(|_| None).collect();
        let mut order: SmallVec<[usize; 4]> = (0..mappings.len()).collect();
        order.sort_unstable_by_key(|&slot| mappings[slot].id);
        for slot in order {
            guards[slot] = Some(mappings[slot].lock());
        }
        Locked::Many(guards)
    }

    fn get(&mut self, slot: usize) -> &mut MappingPins {
        match self {
            Locked::One(guard) => {
                debug_assert_eq!(slot, 0, "a one-mapping plan has slot 0 only");
                guard
            }
            Locked::Many(guards) => guards[slot].as_mut().expect("every slot is locked"),
        }
    }
}

/// Reserves `pins` for a track-mode call from `slot` (index `own`, locked by the caller):
/// from the slot's stock, else from the space's count with a new stock, else exactly. Before
/// failing, every slot that can be reached without waiting takes back its released small
/// records and gives its stock back to the space, so a call fails only if the pins held (and
/// the stocks and not yet reclaimed small records of slots busy at that moment) leave no
/// room.
#[inline]
fn reserve_in_slot(space: &SpaceInner, slot: &mut Slot, own: usize, pins: u64) -> Result<(), u64> {
    if let Some(left) = slot.stock.checked_sub(pins) {
        slot.stock = left;
        return Ok(());
    }
    refill_and_reserve(space, slot, own, pins)
}

/// [`reserve_in_slot`] when the slot's stock is short.
#[inline(never)]
fn refill_and_reserve(space: &SpaceInner, slot: &mut Slot, own: usize, pins: u64) -> Result<(), u64> {
    let policy = &space.policy;
    if pins.checked_add(PIN_STOCK).is_some_and(|more| policy.take(more).is_ok()) {
        slot.stock += PIN_STOCK;
        return Ok(());
    }
    if policy.take(pins).is_ok() {
        return Ok(());
    }
    // Released small records hold their pins until reclaimed: take them back first.
    slot.reclaim_small();
    policy.give(std::mem::take(&mut slot.stock));
    space.slots.try_each_other(own, |other| {
        other.reclaim_small();
        policy.give(std::mem::take(&mut other.stock));
    });
    policy.take(pins)
}

/// Removes one pin per page of `runs` (all known to be pinned), then munlocks and refunds.
/// Returns the pins removed.
fn unpin_runs(mappings: &[Arc<Mapping>], locked: &mut Locked<'_>, runs: &[PinnedRun]) -> u64 {
    if let [mapping] = mappings {
        // The usual plan: one mapping, one list of sub-runs to munlock.
        let pins = locked.get(0);
        let mut released = Released::new();
        let removed = runs.iter().rev().map(|run| unpin_run_of(mapping, pins, run, &mut released)).sum();
        mapping.release(pins, &released);
        return removed;
    }
    let mut released: SmallVec<[Released; 2]> = mappings.iter().map(|_| Released::new()).collect();
    let mut removed = 0u64;
    for run in runs.iter().rev() {
        removed +=
            unpin_run_of(&mappings[run.slot()], locked.get(run.slot()), run, &mut released[run.slot()]);
    }
    for (slot, m) in mappings.iter().enumerate() {
        m.release(locked.get(slot), &released[slot]);
    }
    removed
}

/// [`unpin_runs`] for one run, in its mapping; the pins removed.
fn unpin_run_of(mapping: &Mapping, pins: &mut MappingPins, run: &PinnedRun, released: &mut Released) -> u64 {
    let first = run.page_in(mapping);
    if mapping.try_unpin_run(pins, first, run.npages(), released).is_ok() {
        return run.npages();
    }
    // Someone unpinned pages this guard owns (unpin_pages on pins it did not take).
    // Release what is still pinned, page by page, rather than underflow a count.
    log::error!("pins of the run at IOVA {:#x} were released behind its guard", run.iova);
    let mut removed = 0;
    for page in first..first + run.npages() {
        if pins.table.count(page) > 0 {
            mapping.unpin_run(pins, page, 1, released);
            removed += 1;
        }
    }
    removed
}

/// An unpin call's plan, its planning error as an unpin error.
fn unpin_planned(plan: Result<Plan, PinError>) -> Result<Plan, UnpinError> {
    plan.map_err(|e| match e {
        PinError::NotMapped { index, pfn } => UnpinError::NotMapped { index, pfn },
        other => unreachable!("unpin planning only fails with NotMapped: {other}"),
    })
}

/// The error of `run` (in `mapping`) failing at a page of the mapping.
fn run_error(run: &PinnedRun, mapping: &Mapping, failure: RunFailure) -> PinError {
    let first = run.page_in(mapping);
    let at = |page: u64| (run.index() + (page - first) as usize, (run.iova >> PAGE_SHIFT) + (page - first));
    match failure {
        RunFailure::Overflow { page } => {
            let (index, pfn) = at(page);
            PinError::CountOverflow { index, pfn }
        }
        RunFailure::OverLimit { page, over } => {
            let (index, pfn) = at(page);
            PinError::LockLimit { index, pfn, over }
        }
        RunFailure::Lock { page, error } => {
            let (index, pfn) = at(page);
            PinError::Lock { index, pfn, source: error }
        }
        RunFailure::Unmapping { page } => {
            let (index, pfn) = at(page);
            PinError::Unmapping { index, pfn }
        }
    }
}

impl DmaSpace {
    fn check_count(&self, npages: u64) -> Result<(), PinError> {
        let max = self.config().max_pages_per_call;
        match npages {
            0 => Err(PinError::Empty),
            n if n > max => Err(PinError::TooManyPages { requested: n, max }),
            _ => Ok(()),
        }
    }

    /// Pins the pages named by `pfns` (IOVA page numbers, any order, repeats pinned again)
    /// for `prot` access. Consecutive entries with consecutive page numbers in one mapping
    /// are pinned as one run with one step.
    ///
    /// The pins are held until the returned guard drops (or [`PinnedPages::forget`] hands
    /// them to [`DmaSpace::unpin_pages`]). On error nothing stays pinned.
    pub fn pin_pages(&self, pfns: &[u64], prot: Prot) -> Result<PinnedPages, PinError> {
        if self.mode() == PinMode::Track {
            return self.pin_tracked(prot, Entries::Array(pfns));
        }
        if let Err(e) = self.check_count(pfns.len() as u64) {
            self.counters().pin_failures.fetch_add(1, Ordering::Relaxed);
            return Err(e);
        }
        let plan = Planner::boxed(&mut self.read_table(), prot, |p| p.plan_array(pfns));
        self.apply(plan)
    }

    /// Pins the `npages` pages from `iova` (page aligned; rounded down otherwise). The range
    /// may span adjacent mappings; it is pinned one run per mapping.
    pub fn pin_range(&self, iova: u64, npages: u64, prot: Prot) -> Result<PinnedPages, PinError> {
        let pfn = iova >> PAGE_SHIFT;
        if self.mode() == PinMode::Track {
            return self.pin_tracked(prot, Entries::Range(pfn, npages));
        }
        self.check_range(pfn, npages)?;
        let plan = Planner::boxed(&mut self.read_table(), prot, |p| p.plan_range(pfn, npages));
        self.apply(plan)
    }

    /// Checks a range call's count and that its pages have IOVAs; counts a failure.
    fn check_range(&self, pfn: u64, npages: u64) -> Result<(), PinError> {
        let valid = self.check_count(npages).and_then(|()| {
            match pfn.checked_add(npages - 1).and_then(iova_of_checked) {
                Some(_) => Ok(()),
                None => Err(PinError::NotMapped { index: 0, pfn }),
            }
        });
        if valid.is_err() {
            self.counters().pin_failures.fetch_add(1, Ordering::Relaxed);
        }
        valid
    }

    /// Track mode: the small-record fast path, else [`DmaSpace::pin_recorded`], under one take of
    /// this thread's slot lock.
    #[inline(always)]
    fn pin_tracked(&self, prot: Prot, what: Entries<'_>) -> Result<PinnedPages, PinError> {
        let mut read = self.read_table();
        let slot_index = read.index();
        let (table, slot) = read.parts();
        let max = self.config().max_pages_per_call;
        match pin_small(&self.inner.space, table, slot, slot_index, prot, &what, max) {
            Some(pinned) => Ok(pinned),
            None => self.pin_recorded(read, prot, what),
        }
    }

    /// Track mode: the whole call under this thread's slot lock. The runs are planned into a
    /// record of the slot, the mappings checked live, the pins reserved, and the record
    /// published; the guard points at it. No per-page work, no lock or line shared with
    /// other threads (but the slot's, when more threads than slots pin at once).
    #[inline(never)]
    fn pin_recorded(
        &self,
        mut read: TableRead<'_>,
        prot: Prot,
        what: Entries<'_>,
    ) -> Result<PinnedPages, PinError> {
        let checked = match what {
            Entries::Array(pfns) => self.check_count(pfns.len() as u64).inspect_err(|_| {
                self.counters().pin_failures.fetch_add(1, Ordering::Relaxed);
            }),
            Entries::Range(pfn, npages) => self.check_range(pfn, npages),
        };
        checked?;
        let space = &self.inner.space;
        let slot_index = read.index();
        let (table, slot) = read.parts();
        let mut record = slot.fresh();
        let planned = match what {
            Entries::Array(pfns) => plan_array_into(table, &mut slot.hint, prot, pfns, &mut record),
            Entries::Range(pfn, npages) => {
                plan_range_into(table, &mut slot.hint, prot, pfn, npages, &mut record)
            }
        };
        let reserved =
            planned.and_then(|()| {
                // The limit first, then the mappings' state, in the order lock mode checks them.
                reserve_in_slot(space, slot, slot_index, record.pages).map_err(|held| {
                    PinError::PinLimit { requested: record.pages, held, max: space.policy.max_pins }
                })?;
                // A mapping an unmap has marked grants no new pins; the unmap, which marks first
                // and then looks at the slots, either waits for this record or was seen here.
                for i in 0..record.mappings.len() {
                    let state = record.view().mapping(i).state();
                    if state != MappingState::Live {
                        slot.stock += record.pages;
                        // Report the first entry in that mapping.
                        let run =
                            record.runs.iter().find(|r| r.slot() == i).expect("a planned mapping has a run");
                        let (index, pfn) = (run.index(), run.iova >> PAGE_SHIFT);
                        return Err(match state {
                            MappingState::Unmapping => PinError::Unmapping { index, pfn },
                            _ => PinError::NotMapped { index, pfn },
                        });
                    }
                }
                Ok(())
            });
        if let Err(e) = reserved {
            slot.discard(record);
            slot.counts.pin_failures += 1;
            return Err(e);
        }
        if slot.keepalive.is_none() {
            // Once per slot: the slot holds the space while it has records (see SpaceHandle).
            slot.keepalive = Some(Arc::clone(space));
        }
        slot.counts.pin_calls += 1;
        slot.counts.runs += record.runs.len() as u64;
        slot.counts.pages += record.pages;
        let owner = Owner { space: NonNull::from(&**space), slot: slot_index, prot };
        let record = RecordPtr::Boxed(slot.publish(record, owner));
        drop(read);
        Ok(PinnedPages { hold: HoldWord::recorded(record) })
    }

    /// Lock mode: reserves the plan's pins from its first mapping's stock and pins its runs,
    /// all under its mappings' locks; the counters go there too (no shared atomic per call
    /// but the lock account's).
    fn apply(&self, plan: Result<Box<Plan>, PinError>) -> Result<PinnedPages, PinError> {
        let plan = plan.inspect_err(|_| {
            self.counters().pin_failures.fetch_add(1, Ordering::Relaxed);
        })?;
        let policy = &self.inner.policy;
        let mut locked = Locked::take(&plan.mappings);
        if policy.reserve_in(locked.get(0), plan.pages).is_err() {
            // Short: take back every mapping's unused stock, each lock alone, and try again.
            drop(locked);
            self.reclaim_mapping_stocks();
            locked = Locked::take(&plan.mappings);
            if let Err(held) = policy.reserve_in(locked.get(0), plan.pages) {
                drop(locked);
                self.counters().pin_failures.fetch_add(1, Ordering::Relaxed);
                let requested = plan.pages;
                Plan::recycle(plan);
                return Err(PinError::PinLimit { requested, held, max: policy.max_pins });
            }
        }
        match Self::pin_runs(&plan, &mut locked) {
            Ok(()) => {
                let counts = &mut locked.get(0).counts;
                counts.pin_calls += 1;
                counts.runs += plan.runs.len() as u64;
                counts.pages += plan.pages;
                drop(locked);
                Ok(PinnedPages { hold: HoldWord::counted(plan) })
            }
            Err(e) => {
                policy.restock(locked.get(0), plan.pages);
                drop(locked);
                self.counters().pin_failures.fetch_add(1, Ordering::Relaxed);
                Plan::recycle(plan);
                Err(e)
            }
        }
    }

    /// Gives every mapping's unused lock-mode stock back to the space's count.
    #[cold]
    fn reclaim_mapping_stocks(&self) {
        let mappings: Vec<Arc<Mapping>> = self.read_table().values().cloned().collect();
        for m in mappings {
            let mut pins = m.lock();
            self.inner.policy.give(std::mem::take(&mut pins.stock));
        }
    }

    fn pin_runs(plan: &Plan, locked: &mut Locked<'_>) -> Result<(), PinError> {
        // A mapping may have left the table (or started leaving) between planning and
        // locking; report the first entry affected.
        for run in &plan.runs {
            let pfn = run.iova >> PAGE_SHIFT;
            match plan.mappings[run.slot()].state() {
                MappingState::Live => {}
                MappingState::Unmapping => return Err(PinError::Unmapping { index: run.index(), pfn }),
                MappingState::Removed => return Err(PinError::NotMapped { index: run.index(), pfn }),
            }
        }
        for (done, run) in plan.runs.iter().enumerate() {
            let mapping = &plan.mappings[run.slot()];
            if let Err(failure) = mapping.pin_run(locked.get(run.slot()), run.page_in(mapping), run.npages())
            {
                // The call's reservation is returned whole by the caller.
                unpin_runs(&plan.mappings, locked, &plan.runs[..done]);
                return Err(run_error(run, mapping, failure));
            }
        }
        Ok(())
    }

    /// Drops one pin from each page named by `pfns`, as taken by [`DmaSpace::pin_pages`] and
    /// kept with [`PinnedPages::forget`]. If any page is not pinned (counting repeats in
    /// `pfns`), nothing changes. In track mode only kept pins are found: the pins of a live
    /// guard are its own, released when it drops.
    pub fn unpin_pages(&self, pfns: &[u64]) -> Result<(), UnpinError> {
        let plan = self.check_unpin_count(pfns.len() as u64).and_then(|()| {
            unpin_planned(Planner::owned(&mut self.read_table(), Prot::empty(), false, |p| {
                p.plan_array(pfns)
            }))
        });
        self.unpin_plan(plan)
    }

    /// Drops one pin from each of the `npages` pages from `iova`.
    pub fn unpin_range(&self, iova: u64, npages: u64) -> Result<(), UnpinError> {
        let pfn = iova >> PAGE_SHIFT;
        if npages == 0 || pfn.checked_add(npages - 1).and_then(iova_of_checked).is_none() {
            return Err(UnpinError::InvalidCount(npages));
        }
        let plan = self.check_unpin_count(npages).and_then(|()| {
            unpin_planned(Planner::owned(&mut self.read_table(), Prot::empty(), false, |p| {
                p.plan_range(pfn, npages)
            }))
        });
        self.unpin_plan(plan)
    }

    /// Translates `pfns` the way [`DmaSpace::pin_pages`] does (the same table, run splitting
    /// and access checks) but takes no pins and allocates nothing: `f(index, host_addr,
    /// npages)` gets each run in order. Nothing keeps the memory mapped afterwards, so the
    /// addresses are only as good as the caller's own knowledge that no unmap happens: this is
    /// plain translation as an unsafe translator (libvfio-user's `vfu_addr_to_sgl`) does it,
    /// the floor pinbench measures pins against.
    ///
    /// `f` runs under the table's read lock (this thread's slot): it must not call into this
    /// space (pin, unpin, drop a guard of it, map, look up); it should only record the runs.
    pub fn translate_pages(
        &self,
        pfns: &[u64],
        prot: Prot,
        mut f: impl FnMut(usize, usize, u64),
    ) -> Result<(), PinError> {
        self.check_count(pfns.len() as u64)?;
        let mut read = self.read_table();
        let (table, slot) = read.parts();
        // The mapping last resolved: first page, end page, host address of its first page.
        let mut hint: Option<(u64, u64, usize)> = None;
        let mut i = 0;
        while i < pfns.len() {
            let start = pfns[i];
            let (first, end, host) = match hint {
                Some(h @ (first, end, _)) if start >= first && start < end => h,
                _ => {
                    let Some(m) = lookup(table, &mut slot.hint, start) else {
                        return Err(PinError::NotMapped { index: i, pfn: start });
                    };
                    if !m.prot.contains(prot) {
                        return Err(PinError::Permission {
                            index: i,
                            pfn: start,
                            wanted: prot,
                            have: m.prot,
                        });
                    }
                    let Some(host) = m.host_addr(0) else {
                        return Err(PinError::NoHostMemory { index: i, pfn: start });
                    };
                    let h = (m.first_pfn, m.end_pfn(), host);
                    hint = Some(h);
                    h
                }
            };
            let n = run_length(&pfns[i..], end - start);
            f(i, host + ((start - first) * PAGE_SIZE) as usize, n);
            i += n as usize;
        }
        Ok(())
    }

    fn check_unpin_count(&self, npages: u64) -> Result<(), UnpinError> {
        if npages == 0 || npages > self.config().max_pages_per_call {
            Err(UnpinError::InvalidCount(npages))
        } else {
            Ok(())
        }
    }

    fn unpin_plan(&self, plan: Result<Plan, UnpinError>) -> Result<(), UnpinError> {
        let counters = self.counters();
        let result = plan.and_then(|plan| Self::unpin_checked(&plan));
        let counter = if result.is_ok() { &counters.unpin_calls } else { &counters.unpin_failures };
        counter.fetch_add(1, Ordering::Relaxed);
        result
    }

    fn unpin_checked(plan: &Plan) -> Result<(), UnpinError> {
        let mut locked = Locked::take(&plan.mappings);
        let mut released: SmallVec<[Released; 2]> = plan.mappings.iter().map(|_| Released::new()).collect();
        for (done, run) in plan.runs.iter().enumerate() {
            let mapping = &plan.mappings[run.slot()];
            let pins = locked.get(run.slot());
            let first = run.page_in(mapping);
            if let Err(page) = mapping.try_unpin_run(pins, first, run.npages(), &mut released[run.slot()]) {
                // Put back what this call took; nothing was munlocked yet.
                for undo in plan.runs[..done].iter().rev() {
                    let at = undo.page_in(&plan.mappings[undo.slot()]);
                    locked.get(undo.slot()).table.increment(at, undo.npages());
                }
                let index = run.index() + (page - first) as usize;
                return Err(UnpinError::NotPinned { index, pfn: (run.iova >> PAGE_SHIFT) + (page - first) });
            }
        }
        for (slot, m) in plan.mappings.iter().enumerate() {
            m.release(locked.get(slot), &released[slot]);
        }
        if let Some(m) = plan.mappings.first() {
            // Lock mode reserves from its first mapping's stock; track mode from its slot's,
            // which this call does not hold: straight back to the space then.
            match m.policy.mode {
                PinMode::Lock => m.policy.restock(locked.get(0), plan.pages),
                PinMode::Track => m.policy.give(plan.pages),
            }
        }
        Ok(())
    }
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
    hold: HoldWord,
}

/// A guard's [`Hold`] in one word, so that a guard returned through memory is read back
/// with one load (as a three-word enum it was copied with 16-byte loads of the 8-byte
/// stores that wrote it, which the CPU cannot forward: about 15 ns a call on this VM). The
/// pointer to what holds the pins, its kind in the two low bits (all three pointees are
/// 8-byte aligned); null once released. A record keeps its space, slot and access (its
/// `Owner`), a plan its access.
struct HoldWord(*mut u8);

const HOLD_SMALL: usize = 1;
const HOLD_BOXED: usize = 2;
const HOLD_COUNTED: usize = 3;
const HOLD_KIND: usize = 3;

/// A look at a guard's hold without taking it.
#[derive(Clone, Copy)]
enum HoldView<'a> {
    Recorded(RecordPtr),
    Counted(&'a Plan),
    Released,
}

impl HoldWord {
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
    fn view(&self) -> HoldView<'_> {
        match Self::parts(self.0) {
            None => HoldView::Released,
            Some((ptr, HOLD_SMALL)) => HoldView::Recorded(RecordPtr::Small(ptr.cast())),
            Some((ptr, HOLD_BOXED)) => HoldView::Recorded(RecordPtr::Boxed(ptr.cast())),
            Some((ptr, kind)) => {
                debug_assert_eq!(kind, HOLD_COUNTED, "a hold word's kind is one of three");
                // SAFETY: the word owns the plan's box until `take`; the view borrows the word.
                HoldView::Counted(unsafe { ptr.cast::<Plan>().as_ref() })
            }
        }
    }

    /// The access the pages were pinned for.
    fn prot(&self) -> Prot {
        match self.view() {
            // SAFETY: a guard's record is live until the guard lets go of it.
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
                // SAFETY: the word owned this box (made by `counted`) and has just given it up.
                return Hold::Counted(unsafe { Box::from_raw(ptr.cast::<Plan>().as_ptr()) });
            }
        };
        // SAFETY: a guard's record is live until the guard lets go of it, which the caller
        // does with what this returns.
        let owner = unsafe { record.owner() };
        Hold::Recorded { space: owner.space, slot: owner.slot, record }
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
enum Hold {
    /// Track mode: a live record in slot `slot` of the space, which that slot keeps alive
    /// while the record lives; the record names the runs and their mappings.
    Recorded { space: NonNull<SpaceInner>, slot: usize, record: RecordPtr },
    /// Lock mode: counted per page in the mappings' tables; the guard keeps the mappings.
    /// Boxed so that a guard stays small to move; the box is reused by the thread's next
    /// call (see `SPARE_PLAN`).
    Counted(Box<Plan>),
    /// Handed to the caller by `forget`.
    Released,
}

// SAFETY: a recorded guard's record is immutable while the guard lives and names its space,
// which outlives the record (its slot holds it); reading either from any thread is sound.
// Retiring a record takes the slot's lock; releasing a small record is one atomic store,
// after which the guard touches nothing, from whichever thread drops it. A counted guard's
// word owns a boxed plan that holds only Arcs and plain data.
unsafe impl Send for PinnedPages {}
// SAFETY: as above: shared access only reads the record and the mappings.
unsafe impl Sync for PinnedPages {}

impl PinnedPages {
    fn record(&self) -> Option<RecordRef<'_>> {
        match self.hold.view() {
            // SAFETY: the record is live until this guard retires it (drop or forget), and
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

    fn mapping_list(&self) -> impl Iterator<Item = &Mapping> {
        let record = self.record();
        let counted = match self.hold.view() {
            HoldView::Counted(plan) => Some(&plan.mappings),
            _ => None,
        };
        let recorded = record.into_iter().flat_map(|r| r.mappings());
        recorded.chain(counted.into_iter().flat_map(|m| m.iter().map(|m| &**m)))
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
        self.mapping_list().any(|m| m.poisoned())
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
            // SAFETY: [host, host + n) lies in pinned pages of a mapping this guard keeps
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
            // SAFETY: as in read; the pin asked for WRITE, which the planner checked the
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
            // SAFETY: [host, host + n) lies in pinned, readable pages this guard keeps mapped.
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
            // SAFETY: [host, host + n) lies in pinned pages this guard keeps mapped, writable
            // since the pin asked for WRITE.
            let dst = unsafe { VolatileSlice::new(host as *mut u8, n) };
            src.subslice(at, n).expect("a piece lies inside the checked range").copy_to_volatile_slice(dst);
        });
        self.check_poisoned()
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
                // SAFETY: the previous slice ends where this piece starts: together they are
                // one range of pinned pages this guard keeps mapped.
                *last = unsafe { VolatileSlice::new(last.ptr_guard_mut().as_ptr(), last.len() + n) };
            } else {
                // SAFETY: [host, host + n) lies in pinned pages of a mapping this guard keeps
                // mapped (and writable if WRITE was asked for, checked above) while the
                // slice, which borrows the guard, lives.
                out.push(unsafe { VolatileSlice::new(host as *mut u8, n) });
            }
            next_host = host + n;
        });
        Ok(out)
    }

    /// Unpins now (the same as dropping the guard).
    pub fn unpin(self) {}

    /// Keeps the pins but drops the guard: the caller now owns them and must release them
    /// with [`DmaSpace::unpin_pages`] or [`DmaSpace::unpin_range`] (the `vfio_pin_pages`
    /// model). Memory under pins kept this way is never unmapped while they are held.
    ///
    /// In track mode the pins move from the guard's record to the per-page counts (the
    /// model's bookkeeping), which cost a pass over the pages. A page already holding
    /// [`crate::MAX_PIN_COUNT`] kept pins cannot count more: the guard's pins then stay held
    /// for good (logged; their mappings are never unmapped, as with any pin never returned).
    pub fn forget(mut self) {
        // The guard is released from here on; in lock mode the plan goes, its counts stay.
        if let Hold::Recorded { space, slot, record } = self.hold.take() {
            // SAFETY: the record is live until retired below, after the view's last use.
            let rec = unsafe { record.view() };
            // Counted first, then retired: an unmap sees the pins throughout.
            for (done, run) in rec.runs.iter().enumerate() {
                let mapping = rec.mapping(run.slot());
                // Bound first: the undo below locks mappings again.
                let counted =
                    mapping.lock().table.try_increment(run.page_in(mapping), run.npages()).map(drop);
                if let Err(page) = counted {
                    for undo in rec.runs[..done].iter().rev() {
                        let m = rec.mapping(undo.slot());
                        m.lock().table.decrement(undo.page_in(m), undo.npages(), None);
                    }
                    // Only after 65535 kept pins of one page: these stay held for good.
                    log::error!(
                        "page {:#x} cannot count more kept pins; the {} pins of this guard stay held",
                        mapping.iova() + page * PAGE_SIZE,
                        rec.pages
                    );
                    return;
                }
            }
            // SAFETY: the slot keeps the space alive while the record is live.
            let space = unsafe { space.as_ref() };
            let mut locked = space.slots.lock_slot(slot);
            // SAFETY: the record was published in this slot and is retired once, here.
            unsafe { locked.retire(record) };
            // Its pins stay reserved (now counted); the slot lets go of a closed space.
            let last = if space.closed.load(Ordering::SeqCst) && locked.is_empty() {
                locked.keepalive.take()
            } else {
                None
            };
            drop(locked);
            drop(last);
        }
    }
}

impl Drop for PinnedPages {
    #[inline]
    fn drop(&mut self) {
        if let HoldView::Recorded(RecordPtr::Small(entry)) = self.hold.view() {
            // SAFETY: the entry is live until released or retired here, and the slot keeps
            // the space alive while it is.
            let record = unsafe { entry.as_ref() };
            // SAFETY: as just said.
            let space = unsafe { record.owner().space.as_ref() };
            // Nobody to wake and a space that is not closing: let go without the slot's lock
            // (the slot reclaims the entry). An unmap that marks the mapping just after this
            // look saw the entry live and looks again within a millisecond; a mapping that
            // abandon_all took meanwhile, or a space that closed meanwhile, is left to the
            // reaper.
            if record.mapping().state() == MappingState::Live && !space.closed.load(Ordering::SeqCst) {
                // SAFETY: the entry is live and this guard's; `record` is not used again.
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
        Hold::Counted(plan) => {
            let mut locked = Locked::take(&plan.mappings);
            let removed = unpin_runs(&plan.mappings, &mut locked, &plan.runs);
            if let Some(m) = plan.mappings.first() {
                let first = locked.get(0);
                first.counts.unpin_calls += 1;
                m.policy.restock(first, removed);
            }
            drop(locked);
            Plan::recycle(plan);
        }
        Hold::Recorded { space, slot, record } => {
            // SAFETY: the slot keeps the space alive while the record is live.
            let space = unsafe { space.as_ref() };
            let mut locked = space.slots.lock_slot(slot);
            // SAFETY: the record is live until retired below, after the view's last use.
            let rec = unsafe { record.view() };
            let pages = rec.pages;
            // One look at the mappings' states: an unmap waiting for these pins is
            // woken once they are gone; an abandoned mapping may be free to go.
            let (mut waking, mut orphaned) = (false, false);
            for m in rec.mappings() {
                match m.state() {
                    MappingState::Live => {}
                    MappingState::Unmapping => waking = true,
                    MappingState::Removed => (waking, orphaned) = (true, true),
                }
            }
            // Hold the space across the wake-up: after the slot's lock it may go.
            let keep = if waking { locked.keepalive.clone() } else { None };
            // SAFETY: the record was published in this slot and is retired once, here.
            unsafe { locked.retire(record) };
            locked.counts.unpin_calls += 1;
            locked.stock += pages;
            trim_stock(&space.policy, &mut locked);
            let last = if space.closed.load(Ordering::SeqCst) && locked.is_empty() {
                locked.keepalive.take()
            } else {
                None
            };
            drop(locked);
            if keep.is_some() || last.is_some() {
                retired_late(keep, last, waking, orphaned);
            }
        }
    }
}

/// The rest of a guard's retirement when its mappings are going or its space has closed.
#[cold]
fn retired_late(keep: Option<Arc<SpaceInner>>, last: Option<Arc<SpaceInner>>, waking: bool, orphaned: bool) {
    if let Some(space) = keep.as_ref().or(last.as_ref()) {
        if waking {
            space.wake_unmap();
        }
        if orphaned {
            // An abandoned mapping the record named may be free to go now.
            space.prune_orphans();
        }
    }
}

#[cfg(test)]
mod tests {
    use std::os::fd::AsFd;
    use std::sync::Arc;
    use std::time::{Duration, Instant};

    use super::*;
    use crate::testutil::{locked_bytes_in, memfd};
    use crate::{DmaSpaceConfig, DmaStats, LockAccount, PinMode};

    const P: u64 = PAGE_SIZE;

    /// The run length by its definition, one entry at a time.
    fn model_run_length(pfns: &[u64], limit: u64) -> u64 {
        let n = pfns.iter().enumerate().take_while(|&(k, &p)| p == pfns[0].wrapping_add(k as u64)).count();
        (n as u64).min(limit).max(1)
    }

    #[test]
    fn run_length_agrees_with_its_definition_at_every_alignment_and_break() {
        // A buffer whose start is a cache line, so `offset` sets the array's alignment.
        let mut buf = vec![0u64; 200 + 16];
        let line = (8 - (buf.as_ptr() as usize / 8) % 8) % 8;
        for offset in 0..8 {
            for len in [2usize, 7, 8, 9, 31, 32, 33, 40, 64, 100, 129, 200] {
                for brk in (1..=len).step_by(1 + len / 40) {
                    let pfns = &mut buf[line + offset..line + offset + len];
                    for (k, p) in pfns.iter_mut().enumerate() {
                        *p = (u64::MAX - 50).wrapping_add(k as u64); // wraps past u64::MAX in the run
                    }
                    if brk < len {
                        pfns[brk] ^= 1 << 40;
                    }
                    for limit in [2, brk as u64, len as u64, u64::MAX] {
                        assert_eq!(
                            run_length(pfns, limit),
                            model_run_length(pfns, limit),
                            "offset {offset} len {len} break {brk} limit {limit}"
                        );
                    }
                    // Every variant this CPU can run, whichever the dispatch picks.
                    let whole = model_run_length(pfns, u64::MAX);
                    assert_eq!(long_run_length(pfns), whole);
                    #[cfg(target_arch = "x86_64")]
                    {
                        if std::arch::is_x86_feature_detected!("avx2") {
                            // SAFETY: the CPU has AVX2, checked just now.
                            assert_eq!(unsafe { run_length_avx2(pfns) }, whole);
                        }
                        if std::arch::is_x86_feature_detected!("avx512f") {
                            // SAFETY: the CPU has AVX-512F, checked just now.
                            assert_eq!(unsafe { run_length_avx512(pfns) }, whole);
                        }
                    }
                }
            }
        }
    }

    /// A space with one 64-page mapping at IOVA 0 and the memfd behind it.
    fn space_with(config: DmaSpaceConfig) -> (DmaSpace, std::fs::File) {
        let space = DmaSpace::new(config);
        let file = memfd(64);
        space.map(0, 64 * P, file.as_fd(), 0, Prot::READ_WRITE).unwrap();
        (space, file)
    }

    fn counts(space: &DmaSpace, pfns: impl IntoIterator<Item = u64>) -> Vec<u32> {
        pfns.into_iter().map(|p| space.pin_count(p * P)).collect()
    }

    #[test]
    fn an_idaw_list_pins_as_its_contiguous_runs() {
        let (space, _f) = space_with(Default::default());
        let pins = space.pin_pages(&[1, 5, 6, 7, 9], Prot::READ).unwrap();
        let runs: Vec<_> = pins.runs().iter().map(|r| (r.iova() / P, r.npages(), r.index())).collect();
        assert_eq!(runs, vec![(1, 1, 0), (5, 3, 1), (9, 1, 4)]);
        // Every page's host address follows its run.
        let base = pins.host_addr(0).unwrap() - P as usize;
        for (i, pfn) in [1u64, 5, 6, 7, 9].iter().enumerate() {
            assert_eq!(pins.host_addr(i), Some(base + (*pfn * P) as usize));
            assert_eq!(pins.iova(i), Some(pfn * P));
        }
        assert_eq!(pins.host_addr(5), None);
        assert_eq!(counts(&space, 0..10), vec![0, 1, 0, 0, 0, 1, 1, 1, 0, 1]);
        let stats = space.stats();
        assert_eq!((stats.pin_calls, stats.runs, stats.pages, stats.pins_held), (1, 3, 5, 5));
        drop(pins);
        assert_eq!(counts(&space, 0..10), vec![0; 10]);
        assert_eq!(space.stats().pins_held, 0);
    }

    #[test]
    fn order_and_repeats_are_kept() {
        let (space, _f) = space_with(Default::default());
        let pins = space.pin_pages(&[7, 6, 5, 5, 6, 7], Prot::READ).unwrap();
        // [7] [6] [5] [5,6,7]: runs follow the array, never sorted.
        assert_eq!(pins.runs().len(), 4, "{:?}", pins.runs());
        assert_eq!(counts(&space, 5..8), vec![2, 2, 2]);
        let last = pins.runs().last().unwrap();
        assert_eq!((last.iova() / P, last.npages(), last.index()), (5, 3, 3));
    }

    #[test]
    fn segments_merge_only_host_adjacent_runs() {
        let (space, _f) = space_with(Default::default());
        let pins = space.pin_pages(&[3, 4, 9, 10, 11, 2], Prot::READ).unwrap();
        let segs: Vec<_> = pins.segments().map(|s| (s.len / P, s.index)).collect();
        assert_eq!(segs, vec![(2, 0), (3, 2), (1, 5)]);
    }

    #[test]
    fn a_run_never_crosses_a_mapping_boundary() {
        let space = DmaSpace::default();
        let (a, b) = (memfd(4), memfd(4));
        space.map(0, 4 * P, a.as_fd(), 0, Prot::READ_WRITE).unwrap();
        space.map(4 * P, 4 * P, b.as_fd(), 0, Prot::READ_WRITE).unwrap();
        let pins = space.pin_pages(&[2, 3, 4, 5], Prot::WRITE).unwrap();
        let runs: Vec<_> = pins.runs().iter().map(|r| (r.iova() / P, r.npages())).collect();
        assert_eq!(runs, vec![(2, 2), (4, 2)]);
        // The guard's buffer still reads as one: bytes land in the right files.
        pins.write(2 * P - 2, b"abcd").unwrap();
        let mut buf = [0u8; 2];
        std::os::unix::fs::FileExt::read_exact_at(&a, &mut buf, 4 * P - 2).unwrap();
        assert_eq!(&buf, b"ab");
        std::os::unix::fs::FileExt::read_exact_at(&b, &mut buf, 0).unwrap();
        assert_eq!(&buf, b"cd");
        let range = space.pin_range(P, 6, Prot::READ).unwrap();
        assert_eq!(range.runs().len(), 2);
        let mut back = [0u8; 4];
        range.read(3 * P - 2, &mut back).unwrap();
        assert_eq!(&back, b"abcd");
    }

    #[test]
    fn failures_unwind_everything_and_name_the_first_bad_page() {
        let space = DmaSpace::default();
        let (rw, ro) = (memfd(8), memfd(8));
        space.map(0, 8 * P, rw.as_fd(), 0, Prot::READ_WRITE).unwrap();
        space.map(16 * P, 8 * P, ro.as_fd(), 0, Prot::READ).unwrap();
        let err = space.pin_pages(&[1, 2, 3, 8, 4], Prot::READ).unwrap_err();
        assert!(matches!(err, PinError::NotMapped { index: 3, pfn: 8 }), "{err}");
        assert_eq!(err.errno(), libc::EINVAL);
        let err = space.pin_pages(&[1, 2, 17, 18], Prot::WRITE).unwrap_err();
        assert!(matches!(err, PinError::Permission { index: 2, pfn: 17, .. }), "{err}");
        assert_eq!(err.errno(), libc::EPERM);
        let err = space.pin_range(6 * P, 4, Prot::READ).unwrap_err();
        assert!(matches!(err, PinError::NotMapped { index: 2, pfn: 8 }), "{err}");
        assert_eq!(counts(&space, 0..24), vec![0; 24]);
        assert!(matches!(space.pin_pages(&[], Prot::READ), Err(PinError::Empty)));
        assert!(matches!(space.pin_range(u64::MAX - P + 1, 2, Prot::READ), Err(PinError::NotMapped { .. })));
        assert!(matches!(space.pin_pages(&[u64::MAX], Prot::READ), Err(PinError::NotMapped { .. })));
        assert_eq!(space.stats().pin_failures, 6);
    }

    #[test]
    fn the_count_limit_fails_the_whole_call() {
        // Per-page counts (lock mode; kept pins in track mode) stop at MAX_PIN_COUNT.
        let lock = DmaSpaceConfig {
            mode: PinMode::Lock,
            account: Arc::new(LockAccount::unlimited()),
            ..Default::default()
        };
        let (space, _f) = space_with(lock);
        let held: Vec<_> =
            (0..crate::MAX_PIN_COUNT).map(|_| space.pin_pages(&[4], Prot::READ).unwrap()).collect();
        let err = space.pin_pages(&[1, 2, 3, 4, 5], Prot::READ).unwrap_err();
        assert!(matches!(err, PinError::CountOverflow { index: 3, pfn: 4 }), "{err}");
        assert_eq!(counts(&space, 1..6), vec![0, 0, 0, crate::MAX_PIN_COUNT, 0]);
        drop(held);
        assert_eq!(space.stats().pins_held, 0);
    }

    #[test]
    fn track_mode_guards_count_past_the_per_page_limit_up_to_the_space_limit() {
        let (space, _f) = space_with(DmaSpaceConfig { max_pins: 70_000, ..Default::default() });
        let held: Vec<_> = (0..70_000).map(|_| space.pin_pages(&[4], Prot::READ).unwrap()).collect();
        assert_eq!(space.pin_count(4 * P), 70_000);
        assert!(matches!(space.pin_pages(&[4], Prot::READ), Err(PinError::PinLimit { .. })));
        drop(held);
        assert_eq!((space.pin_count(4 * P), space.stats().pins_held), (0, 0));
    }

    #[test]
    fn the_space_wide_pin_limit_fails_calls_cleanly() {
        let (space, _f) = space_with(DmaSpaceConfig { max_pins: 10, ..Default::default() });
        let a = space.pin_range(0, 6, Prot::READ).unwrap();
        let err = space.pin_pages(&[1, 1, 2, 3, 4], Prot::READ).unwrap_err();
        assert!(matches!(err, PinError::PinLimit { requested: 5, held: 6, max: 10 }), "{err}");
        assert_eq!(err.errno(), libc::ENOSPC);
        let b = space.pin_pages(&[1, 1, 2, 3], Prot::READ).unwrap();
        drop(a);
        // Pins released by a guard, by unpin_pages and by a forgotten guard's unpin all count.
        let c = space.pin_range(0, 6, Prot::READ).unwrap();
        c.forget();
        assert!(space.pin_range(0, 1, Prot::READ).is_err());
        space.unpin_range(0, 6).unwrap();
        drop(b);
        let full = space.pin_range(0, 10, Prot::READ).unwrap();
        drop(full);
        // Track mode: unpin_range finds only kept pins, never a live guard's.
        let d = space.pin_range(0, 4, Prot::READ).unwrap();
        assert!(matches!(space.unpin_range(0, 2), Err(UnpinError::NotPinned { index: 0, pfn: 0 })));
        drop(d);
        space.pin_range(0, 10, Prot::READ).unwrap().unpin();
    }

    #[test]
    fn too_many_pages_in_one_call() {
        let (space, _f) = space_with(DmaSpaceConfig { max_pages_per_call: 4, ..Default::default() });
        let err = space.pin_range(0, 5, Prot::READ).unwrap_err();
        assert!(matches!(err, PinError::TooManyPages { requested: 5, max: 4 }));
        assert_eq!(err.errno(), libc::E2BIG);
        assert!(matches!(space.unpin_range(0, 5), Err(UnpinError::InvalidCount(5))));
    }

    #[test]
    fn unpin_by_array_and_range_after_forget() {
        let (space, _f) = space_with(Default::default());
        space.pin_pages(&[1, 5, 6, 7, 9], Prot::READ).unwrap().forget();
        space.pin_range(5 * P, 3, Prot::READ).unwrap().forget();
        assert_eq!(counts(&space, [1, 5, 6, 7, 9]), vec![1, 2, 2, 2, 1]);
        // [5, 5, 5] needs three pins on page 5; it holds two, so nothing changes.
        let err = space.unpin_pages(&[9, 5, 5, 5]).unwrap_err();
        assert!(matches!(err, UnpinError::NotPinned { index: 3, pfn: 5 }), "{err}");
        assert_eq!(counts(&space, [1, 5, 6, 7, 9]), vec![1, 2, 2, 2, 1]);
        assert!(matches!(space.unpin_pages(&[3]), Err(UnpinError::NotPinned { index: 0, pfn: 3 })));
        assert!(matches!(space.unpin_pages(&[100]), Err(UnpinError::NotMapped { index: 0, pfn: 100 })));
        space.unpin_pages(&[9, 1, 5, 6, 7]).unwrap();
        space.unpin_range(5 * P, 3).unwrap();
        assert_eq!(counts(&space, 0..10), vec![0; 10]);
        let stats = space.stats();
        assert_eq!((stats.unpin_calls, stats.unpin_failures), (2, 3));
    }

    #[test]
    fn the_pin_limit_is_exact_across_threads_whatever_their_stock() {
        // Each thread keeps a stock of reserved pins; the limit must still be the limit.
        let space = DmaSpace::new(DmaSpaceConfig { max_pins: 6000, ..Default::default() });
        let file = memfd(8192);
        space.map(0, 8192 * P, file.as_fd(), 0, Prot::READ_WRITE).unwrap();
        // Thread A pins and unpins: its slot keeps (up to two stocks of) unused reservation.
        std::thread::scope(|s| {
            s.spawn(|| {
                for _ in 0..3 {
                    drop(space.pin_range(0, 3000, Prot::READ).unwrap());
                }
                drop(space.pin_range(0, 1, Prot::READ).unwrap());
            });
        });
        // Thread B (this one) can still take the whole limit, and not one pin more.
        let all = space.pin_range(0, 6000, Prot::READ).unwrap();
        let err = space.pin_range(6000 * P, 1, Prot::READ).unwrap_err();
        assert!(matches!(err, PinError::PinLimit { requested: 1, held: 6000, max: 6000 }), "{err}");
        drop(all);
        let again = space.pin_range(0, 6000, Prot::READ).unwrap();
        assert_eq!(space.stats().pins_held, 6000);
        drop(again);
        assert_eq!(space.stats().pins_held, 0);
    }

    /// An empty lock-mode space (no lock limit) of at most `max_pins` pins.
    fn lock_space_of(max_pins: u64) -> DmaSpace {
        DmaSpace::new(DmaSpaceConfig {
            mode: PinMode::Lock,
            account: Arc::new(LockAccount::unlimited()),
            max_pins,
            ..Default::default()
        })
    }

    #[test]
    fn lock_mode_stocks_in_mappings_keep_the_limit_exact_and_counts_outlive_the_table() {
        // Lock-mode calls reserve from their first mapping's stock and count there: the
        // limit must still be exact across mappings, an unmap must hand both back.
        let space = lock_space_of(6000);
        let (a, b) = (memfd(3000), memfd(8192));
        space.map(0, 3000 * P, a.as_fd(), 0, Prot::READ_WRITE).unwrap();
        space.map(1 << 30, 8192 * P, b.as_fd(), 0, Prot::READ_WRITE).unwrap();
        // Mapping A keeps (up to two stocks of) unused reservation after these.
        for _ in 0..3 {
            drop(space.pin_range(0, 3000, Prot::READ).unwrap());
        }
        drop(space.pin_pages(&[7, 9], Prot::READ).unwrap());
        // Mapping B can still take the whole limit, and not one pin more, in either mapping.
        let all = space.pin_range(1 << 30, 6000, Prot::READ).unwrap();
        let err = space.pin_pages(&[(1 << 18) + 6000], Prot::READ).unwrap_err();
        assert!(matches!(err, PinError::PinLimit { requested: 1, held: 6000, max: 6000 }), "{err}");
        assert!(matches!(space.pin_pages(&[5], Prot::READ), Err(PinError::PinLimit { .. })));
        drop(all);
        // A takes a stock again (from B's, reclaimed), and keeps it.
        drop(space.pin_pages(&[7, 9], Prot::READ).unwrap());
        let before = space.stats();
        assert_eq!((before.pin_calls, before.unpin_calls, before.pin_failures), (6, 6, 2));
        assert_eq!((before.runs, before.pages), (8, 15004));
        // 3000 pages in 256-page pieces, 6000 likewise; one munlock per run let go.
        assert_eq!((before.mlock_calls, before.munlock_calls), (3 * 12 + 2 + 24 + 2, 3 + 2 + 1 + 2));
        // A mapping that leaves the table moves its counts to the space's, even while a guard
        // still holds it: totals do not step back, and its stock is the space's again.
        let kept = space.pin_pages(&[11], Prot::READ).unwrap();
        let before = space.stats();
        space.abandon_all();
        let after = space.stats();
        let totals =
            |s: &DmaStats| (s.pin_calls, s.unpin_calls, s.runs, s.pages, s.mlock_calls, s.munlock_calls);
        assert_eq!(totals(&after), totals(&before));
        space.map(0, 8192 * P, b.as_fd(), 0, Prot::READ_WRITE).unwrap();
        let rest = space.pin_range(0, 5999, Prot::READ).unwrap();
        assert!(matches!(space.pin_pages(&[6000], Prot::READ), Err(PinError::PinLimit { held: 6000, .. })));
        drop((kept, rest));
        assert_eq!(space.stats().pins_held, 0);
        assert_eq!(totals(&space.stats()).0, before.pin_calls + 1);
    }

    #[test]
    fn lock_mode_pins_let_go_after_their_mapping_left_the_table_go_straight_back_to_the_space() {
        // A removed mapping kept alive by a guard keeps no stock: what its guards give back
        // is the space's at once, not when the last of them drops.
        let space = lock_space_of(6000);
        let file = memfd(8192);
        space.map(0, 3000 * P, file.as_fd(), 0, Prot::READ_WRITE).unwrap();
        let stays = space.pin_pages(&[1], Prot::READ).unwrap();
        let goes = space.pin_range(0, 3000, Prot::READ).unwrap();
        space.abandon_all();
        drop(goes);
        space.map(0, 8192 * P, file.as_fd(), 0, Prot::READ_WRITE).unwrap();
        let rest = space.pin_range(0, 5999, Prot::READ).unwrap();
        assert!(matches!(space.pin_pages(&[6000], Prot::READ), Err(PinError::PinLimit { held: 6000, .. })));
        drop((stays, rest));
        assert_eq!(space.stats().pins_held, 0);
        assert_eq!(space.pin_range(0, 6000, Prot::READ).map(drop).err().map(|e| e.to_string()), None);
    }

    #[test]
    fn a_guard_survives_its_pins_being_unpinned_behind_its_back() {
        // Lock mode counts every pin per page, so unpin_pages can take a guard's pins; the
        // guard then releases only what it still holds.
        let lock = DmaSpaceConfig {
            mode: PinMode::Lock,
            account: Arc::new(LockAccount::unlimited()),
            ..Default::default()
        };
        let (space, _f) = space_with(lock);
        let pins = space.pin_pages(&[2, 3, 4], Prot::READ).unwrap();
        space.unpin_pages(&[3]).unwrap();
        drop(pins);
        assert_eq!(counts(&space, 0..8), vec![0; 8]);
        assert_eq!(space.stats().pins_held, 0);
    }

    #[test]
    fn track_mode_unpin_pages_leaves_a_live_guards_pins_alone() {
        let (space, _f) = space_with(Default::default());
        let pins = space.pin_pages(&[2, 3, 4], Prot::READ).unwrap();
        let kept = space.pin_pages(&[3], Prot::READ).unwrap();
        kept.forget();
        // The kept pin of page 3 goes; a second unpin would need the guard's: refused, and
        // nothing changes.
        assert!(matches!(space.unpin_pages(&[3, 3]), Err(UnpinError::NotPinned { index: 1, pfn: 3 })));
        assert_eq!(counts(&space, 2..5), vec![1, 2, 1]);
        space.unpin_pages(&[3]).unwrap();
        assert!(space.unpin_pages(&[2]).is_err());
        assert_eq!(counts(&space, 2..5), vec![1, 1, 1]);
        drop(pins);
        assert_eq!(counts(&space, 0..8), vec![0; 8]);
        assert_eq!(space.stats().pins_held, 0);
    }

    #[test]
    fn a_track_guard_outlives_its_space_and_keeps_its_memory() {
        let (space, f) = space_with(Default::default());
        let pins = space.pin_pages(&[1, 5, 6], Prot::READ_WRITE).unwrap();
        let other = space.pin_pages(&[2], Prot::READ).unwrap();
        drop(space);
        drop(f);
        // The memory is still mapped: the slot keeps the space until its last record goes.
        pins.write(0, b"still here").unwrap();
        let mut buf = [0u8; 10];
        pins.read(0, &mut buf).unwrap();
        assert_eq!(&buf, b"still here");
        drop(other);
        drop(pins);
    }

    #[test]
    fn a_closed_space_is_let_go_after_a_guard_released_without_the_lock() {
        let (space, f) = space_with(Default::default());
        let weak = Arc::downgrade(&space.inner.space);
        let pins = space.pin_pages(&[7], Prot::READ).unwrap();
        let entry = small_entry(&pins);
        // The space closes while the guard is live: its slot keeps the space...
        drop(space);
        drop(f);
        assert!(weak.upgrade().is_some());
        // ...and the guard lets go as one that looked before the close does: without the
        // lock, leaving nobody to retire the record but the reaper.
        release_unlocked(pins, entry);
        wait_gone(&weak, "the reaper never let go of the space");
    }

    /// The entry of a guard holding a small record.
    fn small_entry(pins: &PinnedPages) -> NonNull<SmallRecord> {
        match pins.hold.view() {
            HoldView::Recorded(RecordPtr::Small(entry)) => entry,
            _ => panic!("a single page is a small record"),
        }
    }

    /// Lets go of `pins` (whose entry is `entry`) as a guard that found nothing to do
    /// under the lock does, whatever the space and mapping look like now.
    fn release_unlocked(pins: PinnedPages, entry: NonNull<SmallRecord>) {
        std::mem::forget(pins);
        // SAFETY: the entry is live (its guard was forgotten, not dropped).
        unsafe { SmallRecord::release(entry) };
    }

    /// Waits (5 s at most) for the last strong reference behind `weak` to go.
    fn wait_gone<T>(weak: &std::sync::Weak<T>, failure: &str) {
        let deadline = Instant::now() + Duration::from_secs(5);
        while weak.upgrade().is_some() {
            assert!(Instant::now() < deadline, "{failure}");
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    #[test]
    fn an_orphan_is_unmapped_after_a_guard_released_without_the_lock() {
        let (space, _f) = space_with(Default::default());
        let mapping = Arc::downgrade(space.read_table().values().next().unwrap());
        let pins = space.pin_pages(&[7], Prot::READ).unwrap();
        let entry = small_entry(&pins);
        // abandon_all takes the mapping while the guard is live: it becomes an orphan...
        assert_eq!(space.abandon_all().mappings, 1);
        // ...and the guard lets go as one that looked just before does: without the lock.
        release_unlocked(pins, entry);
        // Nothing else happens in the space: the reaper unmaps the orphan.
        wait_gone(&mapping, "the orphan was never let go");
        assert_eq!(space.stats().pins_held, 0);
    }

    #[test]
    fn small_records_hold_at_most_a_stock_of_pins_per_slot() {
        let (space, _f) = space_with(Default::default());
        let big = memfd(4096);
        space.map(1 << 30, 4096 * P, big.as_fd(), 0, Prot::READ).unwrap();
        let small = |g: &PinnedPages| matches!(g.hold.view(), HoldView::Recorded(RecordPtr::Small(_)));
        // Ranges of 1024 pages: four fill the slot's share, the fifth goes in a box.
        let guards: Vec<PinnedPages> =
            (0..5).map(|_| space.pin_range(1 << 30, 1024, Prot::READ).unwrap()).collect();
        assert_eq!(guards.iter().filter(|g| small(g)).count(), 4);
        drop(guards);
        // Released, they are taken back when the slot next needs the room.
        let again: Vec<PinnedPages> =
            (0..4).map(|_| space.pin_range(1 << 30, 1024, Prot::READ).unwrap()).collect();
        assert!(again.iter().all(small));
        drop(again);
        assert_eq!(space.stats().pins_held, 0);
    }

    #[test]
    fn single_page_guards_beyond_the_small_record_array_are_boxed_and_all_count() {
        let (space, _f) = space_with(Default::default());
        // More live single pages than the array holds, from one thread (one slot).
        drop(space.pin_pages(&[0], Prot::READ).unwrap());
        let guards: Vec<PinnedPages> =
            (0..150u64).map(|i| space.pin_pages(&[i % 64], Prot::READ).unwrap()).collect();
        let boxed =
            guards.iter().filter(|g| matches!(g.hold.view(), HoldView::Recorded(RecordPtr::Boxed(_))));
        assert_eq!(boxed.count(), 150 - crate::slots::SMALL_RECORDS);
        assert_eq!(space.stats().pins_held, 150);
        let expect: Vec<u32> =
            (0..64u64).map(|p| (0..150u64).filter(|i| i % 64 == p).count() as u32).collect();
        assert_eq!(counts(&space, 0..64), expect);
        assert_eq!(guards[3].host_addr(0), space.pin_pages(&[3], Prot::READ).unwrap().host_addr(0));
        drop(guards);
        let stats = space.stats();
        assert_eq!((stats.pins_held, stats.pin_calls, stats.unpin_calls), (0, 152, 152));
        // Released entries are taken back: the array serves single pages again at once.
        let again = space.pin_pages(&[9], Prot::READ).unwrap();
        assert!(matches!(again.hold.view(), HoldView::Recorded(RecordPtr::Small(_))));
        drop(again);
        // Nothing holds the mapping: it unmaps without waiting.
        let unmapped = space.unmap(0, 64 * P).unwrap();
        assert_eq!(unmapped.mappings, 1);
        assert_eq!(space.stats().unmap_waits, 0);
    }

    #[test]
    fn short_lists_in_one_mapping_are_small_records_with_the_same_runs() {
        let (space, f) = space_with(Default::default());
        space.map(64 * P, 8 * P, f.as_fd(), 0, Prot::READ_WRITE).unwrap();
        let small = |g: &PinnedPages| matches!(g.hold.view(), HoldView::Recorded(RecordPtr::Small(_)));
        let runs = |g: &PinnedPages| {
            g.runs().iter().map(|r| (r.iova() / P, r.npages(), r.index())).collect::<Vec<_>>()
        };
        // Eight runs fit, with their entries' positions and host addresses.
        let eight: Vec<u64> = (0..8).map(|i| i * 3).collect();
        let g = space.pin_pages(&eight, Prot::READ).unwrap();
        assert!(small(&g));
        assert_eq!(runs(&g), (0..8).map(|i| (i * 3, 1, i as usize)).collect::<Vec<_>>());
        assert_eq!(g.host_addr(5).unwrap(), g.host_addr(0).unwrap() + 15 * P as usize);
        // An IDAW-like list: runs merged as in a box.
        let idaw = space.pin_pages(&[1, 5, 6, 7, 9, 9], Prot::READ).unwrap();
        assert!(small(&idaw));
        assert_eq!(runs(&idaw), vec![(1, 1, 0), (5, 3, 1), (9, 1, 4), (9, 1, 5)]);
        assert_eq!(counts(&space, [1, 5, 9]), vec![1, 1, 3]); // 9 also in `eight`
                                                              // Nine runs, or runs in two mappings, go in a box, the same to the caller.
        let nine: Vec<u64> = (0..9).map(|i| i * 3).collect();
        let g9 = space.pin_pages(&nine, Prot::READ).unwrap();
        assert!(!small(&g9));
        assert_eq!(runs(&g9).len(), 9);
        let two = space.pin_pages(&[63, 64], Prot::READ).unwrap();
        assert!(!small(&two));
        assert_eq!(runs(&two), vec![(63, 1, 0), (64, 1, 1)]);
        // A range inside one mapping is one small run; one crossing mappings is boxed.
        let r = space.pin_range(2 * P, 40, Prot::READ).unwrap();
        assert!(small(&r));
        assert_eq!(runs(&r), vec![(2, 40, 0)]);
        let across = space.pin_range(60 * P, 8, Prot::READ).unwrap();
        assert!(!small(&across));
        assert_eq!(runs(&across), vec![(60, 4, 0), (64, 4, 4)]);
        assert_eq!(space.stats().pins_held, 8 + 6 + 9 + 2 + 40 + 8);
        drop((g, idaw, g9, two, r, across));
        assert_eq!(space.stats().pins_held, 0);
        assert_eq!(counts(&space, 0..72), vec![0; 72]);
    }

    #[test]
    fn abandoned_mappings_stay_mapped_under_track_guards() {
        let (space, _f) = space_with(Default::default());
        let pins = space.pin_pages(&[3, 4], Prot::READ_WRITE).unwrap();
        assert_eq!(space.abandon_all().mappings, 1);
        assert!(space.pin_pages(&[3], Prot::READ).is_err());
        pins.write(4000, &[7; 300]).unwrap();
        assert_eq!(space.stats().pins_held, 2);
        drop(pins);
        assert_eq!(space.stats().pins_held, 0);
    }

    #[test]
    fn overlapping_runs_from_many_threads_count_per_page_and_hold_an_unmap() {
        // More threads than slots, so slots are shared; every call overlaps the others.
        let (space, _f) = space_with(Default::default());
        let guards: Vec<PinnedPages> = std::thread::scope(|s| {
            let handles: Vec<_> = (0..40u64)
                .map(|t| {
                    let space = &space;
                    s.spawn(move || space.pin_pages(&[t % 8, t % 8 + 1, t % 8 + 2, 20], Prot::READ).unwrap())
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        assert_eq!(space.pin_count(20 * P), 40);
        let expect: Vec<u32> = (0..10u64)
            .map(|p| (0..40u64).filter(|t| (t % 8..t % 8 + 3).contains(&p)).count() as u32)
            .collect();
        assert_eq!(counts(&space, 0..10), expect);
        assert_eq!(space.stats().pins_held, 160);
        assert_eq!(space.stats().pinned_pages, 11);
        // An unmap waits for them, and goes once the last guard drops on another thread.
        let space2 = space.clone();
        let dropper = std::thread::spawn(move || {
            std::thread::sleep(std::time::Duration::from_millis(50));
            drop(guards);
        });
        let started = std::time::Instant::now();
        space2.unmap(0, 64 * P).unwrap();
        assert!(started.elapsed() >= std::time::Duration::from_millis(40));
        dropper.join().unwrap();
        assert_eq!(space.stats().pins_held, 0);
    }

    #[test]
    fn a_kept_run_can_be_unpinned_in_pieces_and_a_guard_on_it_is_untouched() {
        let (space, _f) = space_with(Default::default());
        let kept = space.pin_range(2 * P, 6, Prot::READ).unwrap();
        kept.forget();
        let guard = space.pin_pages(&[4, 5], Prot::READ).unwrap();
        space.unpin_pages(&[4, 5, 6]).unwrap(); // the middle of the kept run
        assert_eq!(counts(&space, 2..8), vec![1, 1, 1, 1, 0, 1]);
        // The guard's pins of 4 and 5 are not the kept ones: refused, nothing changes.
        assert!(matches!(space.unpin_pages(&[2, 4]), Err(UnpinError::NotPinned { index: 1, pfn: 4 })));
        space.unpin_range(2 * P, 2).unwrap();
        space.unpin_pages(&[7]).unwrap();
        assert_eq!(counts(&space, 2..8), vec![0, 0, 1, 1, 0, 0]);
        drop(guard);
        assert_eq!(space.stats().pins_held, 0);
        space.unmap(0, 64 * P).unwrap();
    }

    /// Runs `f` on a thread; false if it has not finished within `secs`.
    fn finishes_within(secs: u64, f: impl FnOnce() + Send + 'static) -> bool {
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            f();
            let _ = tx.send(());
        });
        rx.recv_timeout(std::time::Duration::from_secs(secs)).is_ok()
    }

    fn is_mapped(addr: usize) -> bool {
        // SAFETY: msync only asks the kernel about the range; it fails with ENOMEM if unmapped.
        unsafe { libc::msync(addr as *mut libc::c_void, P as usize, libc::MS_ASYNC) == 0 }
    }

    #[test]
    fn forgetting_onto_a_saturated_page_neither_hangs_nor_frees_the_pins() {
        let space = DmaSpace::new(DmaSpaceConfig {
            max_pins: 1 << 20,
            unmap_timeout: std::time::Duration::from_millis(50),
            ..Default::default()
        });
        let file = memfd(64);
        space.map(0, 64 * P, file.as_fd(), 0, Prot::READ_WRITE).unwrap();
        for _ in 0..crate::MAX_PIN_COUNT {
            space.pin_pages(&[9], Prot::READ).unwrap().forget();
        }
        // Page 5 is counted, then page 9 overflows: the undo relocks page 5's mapping.
        let guard = space.pin_pages(&[5, 9], Prot::READ).unwrap();
        assert!(finishes_within(5, move || guard.forget()), "forget() deadlocked");
        // As documented: those pins stay held, so the memory is never unmapped under them.
        assert_eq!(space.pin_count(5 * P), 1);
        assert!(matches!(space.unmap(0, 64 * P), Err(crate::UnmapError::Busy { .. })));
    }

    #[test]
    fn abandon_all_racing_an_unmap_that_waits_deadlocks_in_neither_mode() {
        for mode in [PinMode::Lock, PinMode::Track] {
            const N: u64 = 2000;
            for attempt in 0..3u64 {
                let space = DmaSpace::new(DmaSpaceConfig {
                    mode,
                    account: Arc::new(LockAccount::unlimited()),
                    max_mappings: N as usize + 1,
                    unmap_timeout: std::time::Duration::from_secs(30),
                    ..Default::default()
                });
                let file = memfd(N);
                for i in 0..N {
                    space.map(i * P, P, file.as_fd(), i * P, Prot::READ_WRITE).unwrap();
                }
                let guard = space.pin_pages(&[N - 1], Prot::READ).unwrap();
                let u = {
                    let s = space.clone();
                    std::thread::spawn(move || s.unmap(0, N * P).map(|u| u.mappings))
                };
                std::thread::sleep(std::time::Duration::from_millis(100)); // the unmap waits for the guard
                let a = {
                    let s = space.clone();
                    std::thread::spawn(move || s.abandon_all().mappings)
                };
                while !space.mappings().is_empty() {
                    std::hint::spin_loop();
                }
                std::thread::sleep(std::time::Duration::from_micros(50 * attempt));
                drop(guard);
                let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
                while !(u.is_finished() && a.is_finished()) {
                    assert!(
                        std::time::Instant::now() < deadline,
                        "{mode:?} #{attempt}: unmap {} abandon {}",
                        u.is_finished(),
                        a.is_finished()
                    );
                    std::thread::sleep(std::time::Duration::from_millis(5));
                }
            }
        }
    }

    #[test]
    fn an_abandoned_mapping_is_unmapped_when_its_last_guard_drops() {
        for mode in [PinMode::Lock, PinMode::Track] {
            let space = DmaSpace::new(DmaSpaceConfig {
                mode,
                account: Arc::new(LockAccount::unlimited()),
                ..Default::default()
            });
            let file = memfd(4);
            space.map(0, 4 * P, file.as_fd(), 0, Prot::READ_WRITE).unwrap();
            let pins = space.pin_pages(&[1], Prot::READ).unwrap();
            let host = pins.host_addr(0).unwrap();
            space.abandon_all();
            assert!(is_mapped(host), "{mode:?}: unmapped under a guard");
            if mode == PinMode::Track {
                // (Lock-mode guards keep abandoned mappings themselves; the space's totals
                // then leave them out.)
                assert_eq!((space.stats().pins_held, space.stats().pinned_pages), (1, 1));
            }
            drop(pins);
            assert!(!is_mapped(host), "{mode:?}: still mapped after its last guard");
            assert_eq!(space.stats().pins_held, 0);
        }
    }

    #[test]
    fn both_modes_report_the_pin_limit_before_an_unmapping_mapping() {
        let mut seen = Vec::new();
        for mode in [PinMode::Lock, PinMode::Track] {
            let space = DmaSpace::new(DmaSpaceConfig {
                mode,
                account: Arc::new(LockAccount::unlimited()),
                max_pins: 2,
                unmap_timeout: std::time::Duration::from_millis(20),
                ..Default::default()
            });
            let file = memfd(8);
            space.map(0, 8 * P, file.as_fd(), 0, Prot::READ_WRITE).unwrap();
            let held = space.pin_range(0, 2, Prot::READ).unwrap();
            let got = Arc::new(std::sync::Mutex::new(String::new()));
            let (weak, g) = (Arc::downgrade(&space.inner), got.clone());
            space.set_unmap_notifier(Some(Arc::new(move |_, _| {
                let space = DmaSpace { inner: weak.upgrade().expect("the space lives") };
                *g.lock().unwrap() = format!("{:?}", space.pin_pages(&[5], Prot::READ).map(|_| ()));
            })));
            let _ = space.unmap(0, 8 * P);
            space.set_unmap_notifier(None);
            seen.push(got.lock().unwrap().clone());
            drop(held);
        }
        assert_eq!(seen[0], seen[1]);
        assert!(seen[0].contains("PinLimit"), "{seen:?}");
    }

    #[test]
    fn volatile_copies_cross_runs() {
        let (space, _f) = space_with(Default::default());
        let pins = space.pin_pages(&[3, 9, 10], Prot::READ_WRITE).unwrap();
        let mut buf = vec![0u8; 3 * P as usize];
        // SAFETY: buf outlives the slice and nothing else touches it meanwhile.
        let store = unsafe { VolatileSlice::new(buf.as_mut_ptr(), buf.len()) };
        store.subslice(100, 8200).unwrap().copy_from(&[7u8; 8200]);
        pins.write_volatile(100, &store.subslice(100, 8200).unwrap()).unwrap();
        let mut back = vec![0u8; 8200];
        pins.read(100, &mut back).unwrap();
        assert_eq!(back, vec![7u8; 8200]);
        // SAFETY: as above.
        let out = unsafe { VolatileSlice::new(buf.as_mut_ptr(), 16) };
        pins.read_volatile(P - 8, &out).unwrap();
        assert_eq!(&buf[..16], &[7u8; 16]);
        assert!(pins.read_volatile(3 * P - 8, &out).is_err(), "past the end");
        let ro = space.pin_pages(&[3], Prot::READ).unwrap();
        assert_eq!(ro.write_volatile(0, &out), Err(AccessError::ReadOnly));
    }

    #[test]
    fn guards_check_bounds_and_access() {
        let (space, file) = space_with(Default::default());
        let ro = space.pin_pages(&[3], Prot::READ).unwrap();
        assert_eq!(ro.write(0, b"x"), Err(AccessError::ReadOnly));
        let rw = space.pin_pages(&[3, 8], Prot::READ_WRITE).unwrap();
        assert_eq!(rw.size(), 2 * P);
        assert!(matches!(rw.write(2 * P - 1, b"xy"), Err(AccessError::OutOfRange { .. })));
        assert!(matches!(rw.read(u64::MAX, &mut [0u8; 2]), Err(AccessError::OutOfRange { .. })));
        rw.write(P - 1, b"xy").unwrap();
        let mut b = [0u8; 1];
        std::os::unix::fs::FileExt::read_exact_at(&file, &mut b, 4 * P - 1).unwrap();
        assert_eq!(&b, b"x");
        std::os::unix::fs::FileExt::read_exact_at(&file, &mut b, 8 * P).unwrap();
        assert_eq!(&b, b"y");
        let mut back = [0u8; 2];
        rw.read(P - 1, &mut back).unwrap();
        assert_eq!(&back, b"xy");
    }

    fn lock_space(limit: u64) -> (DmaSpace, std::fs::File, usize) {
        let account = Arc::new(LockAccount::with_limit(limit));
        let (space, file) = space_with(DmaSpaceConfig { mode: PinMode::Lock, account, ..Default::default() });
        let host = space.pin_range(0, 1, Prot::READ).unwrap().host_addr(0).unwrap();
        (space, file, host)
    }

    #[test]
    fn lock_mode_locks_each_page_once_and_unlocks_at_zero() {
        let (space, _f, host) = lock_space(u64::MAX);
        let locked = || locked_bytes_in(host, 64 * P as usize);
        assert_eq!(locked(), 0);
        let a = space.pin_pages(&[1, 5, 6, 7, 9], Prot::READ).unwrap();
        assert_eq!(locked(), 5 * P);
        assert_eq!(space.account().locked(), 5 * P);
        // Pinning [4..8] again locks only 4 and 8, and charges only them.
        let mlocks = space.stats().mlock_calls;
        let b = space.pin_range(4 * P, 5, Prot::READ).unwrap();
        assert_eq!(space.stats().mlock_calls - mlocks, 2);
        assert_eq!(locked(), 7 * P);
        assert_eq!(space.account().locked(), 7 * P);
        drop(a);
        // 1 and 9 go; 5, 6, 7 stay locked under b.
        assert_eq!(locked(), 5 * P);
        drop(b);
        assert_eq!(locked(), 0);
        assert_eq!(space.account().locked(), 0);
        assert_eq!(space.stats().locked_bytes, 0);
    }

    #[test]
    fn lock_limit_is_checked_per_run_and_unwinds_fully() {
        let (space, _f, host) = lock_space(6 * P);
        let keep = space.pin_pages(&[1, 2], Prot::READ).unwrap();
        // Runs [3,4] then [10,11,12]: the second would bring the total to 7 pages.
        let err = space.pin_pages(&[3, 4, 10, 11, 12], Prot::READ).unwrap_err();
        assert!(matches!(err, PinError::LockLimit { index: 2, pfn: 10, .. }), "{err}");
        assert_eq!(err.errno(), libc::ENOMEM);
        assert_eq!(counts(&space, [3, 4, 10, 11, 12]), vec![0; 5]);
        assert_eq!(space.account().locked(), 2 * P);
        assert_eq!(locked_bytes_in(host, 64 * P as usize), 2 * P);
        // Repeats of locked pages cost nothing against the limit.
        let again = space.pin_pages(&[1, 2, 1, 2, 1, 2, 3, 4, 5, 6], Prot::READ).unwrap();
        assert_eq!(space.account().locked(), 6 * P);
        drop((keep, again));
        assert_eq!(space.account().locked(), 0);
    }

    #[test]
    fn hugetlb_backing_is_locked_by_accounting_alone() {
        use nix::sys::memfd::{memfd_create, MFdFlags};
        let huge = 2u64 << 20;
        let file = match memfd_create(c"umdev-huge", MFdFlags::MFD_HUGETLB | MFdFlags::MFD_HUGE_2MB) {
            Ok(fd) => std::fs::File::from(fd),
            Err(e) => return eprintln!("skipped: no hugetlb memfd ({e})"),
        };
        file.set_len(huge).unwrap();
        let account = Arc::new(LockAccount::with_limit(u64::MAX));
        let space = DmaSpace::new(DmaSpaceConfig { mode: PinMode::Lock, account, ..Default::default() });
        if let Err(e) = space.map(0, huge, file.as_fd(), 0, Prot::READ_WRITE) {
            return eprintln!("skipped: no free 2 MiB huge page (echo 64 > /proc/sys/vm/nr_hugepages): {e}");
        }
        assert!(space.lookup(0).unwrap().hugetlb);
        // A hugetlbfs mapping must be aligned to its page size.
        let err = space.map(huge, P, file.as_fd(), 0, Prot::READ).unwrap_err();
        assert!(matches!(err, crate::MapError::Backing(crate::MmapError::BackingUnaligned { .. })), "{err}");
        let pins = space.pin_pages(&[0, 1, 2, 7, 9], Prot::WRITE).unwrap();
        pins.write(0, b"huge").unwrap();
        let stats = space.stats();
        assert_eq!(stats.mlock_calls, 0, "hugetlb pages need no mlock");
        assert_eq!(space.account().locked(), 5 * P, "but they are accounted");
        drop(pins);
        assert_eq!(space.account().locked(), 0);
        assert_eq!(space.stats().munlock_calls, 0);
    }

    #[test]
    fn unpin_of_a_repeated_page_unlocks_once() {
        let (space, _f, host) = lock_space(u64::MAX);
        space.pin_pages(&[2, 2, 3], Prot::READ).unwrap().forget();
        assert_eq!(space.account().locked(), 2 * P);
        space.unpin_pages(&[2, 3, 2]).unwrap();
        assert_eq!(space.account().locked(), 0);
        assert_eq!(locked_bytes_in(host, 64 * P as usize), 0);
    }
}
