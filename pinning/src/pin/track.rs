//! Track mode: a pin call recorded in its thread's shard, never counted per page.
//!
//! The whole call runs under one lock, its thread's shard's (the mapping table is read
//! under it): its runs are cut into a record of the shard, its pins reserved from the
//! shard's stock, its mappings checked live, and the record published. A call whose runs lie
//! in one mapping and number at most [`SMALL_RUNS`] goes into an entry of the shard's
//! small-record array, whose guard usually lets go with one release store and no lock
//! (DESIGN.md I5); other calls go into a reused boxed record that the guard retires under
//! the shard's lock.

use std::ptr::NonNull;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use smallvec::SmallVec;

use super::error::PinError;
use super::plan::{check_pin, cut, Entries, RunSink, Window};
use crate::budget::{PinPolicy, PIN_STOCK};
use crate::kernel::{buffers_of, KernelTable};
use crate::mapping::{Mapping, MappingState};
use crate::page::{Prot, PAGE_SHIFT, PAGE_SIZE};
use crate::record::{KernelSlots, Owner, Record, RecordPtr, SmallRecord, SMALL_PINS, SMALL_RUNS};
use crate::run::PinnedRun;
use crate::shard_table::{MappingTable, Shard, ShardHint, TableRead};
use crate::space::{keepalive, DmaSpace, SpaceInner};

/// The space a record's owner names.
///
/// # Safety
/// The record is live (I4: its shard keeps the space allocated until it retires) for all of
/// `'a`, which the caller chooses: it ends the borrow before it retires the record or lets
/// go of a keepalive (a shard guard is dropped before the `Arc` it took out of the shard).
/// The owner was made by [`owner`] (its pointer is a `SpaceInner`).
#[inline(always)]
unsafe fn space_of<'a>(owner: &Owner) -> &'a SpaceInner {
    // SAFETY: (I4) per the contract.
    unsafe { owner.space.cast::<SpaceInner>().as_ref() }
}

/// True once the space of a live record has closed (its handles are gone).
///
/// # Safety
/// As for [`space_of`].
#[inline(always)]
pub(crate) unsafe fn space_closed(owner: &Owner) -> bool {
    // SAFETY: (I4) per the contract.
    unsafe { space_of(owner) }.closed.load(Ordering::SeqCst)
}

/// The owner of a record published by shard `shard` of `space`.
#[inline(always)]
fn owner(space: &SpaceInner, shard: usize, prot: Prot) -> Owner {
    Owner { space: NonNull::from(space).cast(), shard, prot }
}

/// Cuts a call into an entry of the shard's small-record array: stops (with `()`) at a
/// second mapping, a ninth run, or anything the general path must report.
struct SmallSink<'r> {
    entry: &'r mut SmallRecord,
    prot: Prot,
    mapping: Option<NonNull<Mapping>>,
    len: usize,
}

impl RunSink for SmallSink<'_> {
    type Stop = ();

    #[inline(always)]
    fn unmapped(&mut self, _: u64, _: usize) {}

    #[inline(always)]
    fn enter(&mut self, mapping: &Arc<Mapping>, _: u64, _: usize) -> Result<Window, ()> {
        let memory = mapping.memory.as_ref().ok_or(())?;
        if self.mapping.is_some()
            || !mapping.prot.contains(self.prot)
            || memory.poisoned()
            || mapping.state() != MappingState::Live
        {
            return Err(());
        }
        self.mapping = Some(NonNull::from(&**mapping));
        Ok(Window::new(mapping, memory.addr_at(0), 0))
    }

    #[inline(always)]
    fn run(&mut self, window: &Window, pfn: u64, page: u64, npages: u64, index: usize) -> Result<(), ()> {
        if self.len == SMALL_RUNS {
            return Err(());
        }
        self.entry.set_run(self.len, PinnedRun::new(pfn, npages, index, window.host_at(page), 0));
        self.len += 1;
        Ok(())
    }
}

/// Cuts a call into a boxed record: every error reported, any number of runs and mappings.
/// Its runs are written through a pointer to the next free place and the end of the room:
/// the loop's state, kept in registers, and the list's length set once, after the cut (what
/// that saves against a push, which reads and writes the list's length and room in memory
/// for every run: about 3 instructions per run of a scattered list).
struct RecordSink<'r> {
    runs: &'r mut Vec<PinnedRun>,
    mappings: &'r mut Vec<NonNull<Mapping>>,
    /// Where the next run goes, and the end of the room for runs (`runs`' buffer).
    next: *mut PinnedRun,
    room_end: *mut PinnedRun,
    prot: Prot,
    /// Most runs the call can have (an array's entries; `None` for a range, whose runs are
    /// one per mapping it spans): room for the runs is reserved from it.
    runs_at_most: Option<usize>,
}

impl<'r> RecordSink<'r> {
    fn new(record: &'r mut Record, prot: Prot, runs_at_most: Option<usize>) -> Self {
        let Record { runs, mappings, .. } = record;
        let (next, room_end) = Self::room(runs);
        RecordSink { runs, mappings, next, room_end, prot, runs_at_most }
    }

    /// The end of `runs` and of its room.
    fn room(runs: &mut Vec<PinnedRun>) -> (*mut PinnedRun, *mut PinnedRun) {
        let (len, capacity) = (runs.len(), runs.capacity());
        let base = runs.as_mut_ptr();
        // SAFETY: (local) both lie within (or one past) the list's buffer.
        unsafe { (base.add(len), base.add(capacity)) }
    }

    /// Sets the list's length to the runs written.
    fn finish(&mut self) {
        // SAFETY: (local) `next` lies in the list's buffer, at or after its start, and every run
        // before it was written (a run needs no drop).
        unsafe {
            let written = self.next.offset_from(self.runs.as_ptr()) as usize;
            self.runs.set_len(written);
        }
    }

    /// More room, from entry `index` on: at most one run per array entry left, more than
    /// 4096 at a time only as needed; a range's runs as they come.
    #[cold]
    #[inline(never)]
    fn grow(&mut self, index: usize) {
        self.finish();
        let more = match self.runs_at_most {
            Some(entries) => (entries - index).min(4096),
            None => self.runs.capacity().max(2),
        };
        self.runs.reserve(more);
        (self.next, self.room_end) = Self::room(self.runs);
    }
}

/// Enters `mapping` into a record's mappings (checked for a pin of `prot`): its window.
#[inline(never)]
fn enter_record(
    mappings: &mut Vec<NonNull<Mapping>>,
    prot: Prot,
    mapping: &Arc<Mapping>,
    pfn: u64,
    index: usize,
) -> Result<Window, PinError> {
    let host_base = check_pin(mapping, prot, pfn, index)?;
    let ptr = NonNull::from(&**mapping);
    let mapping_index = match mappings.iter().position(|&m| m == ptr) {
        Some(mi) => mi,
        None => {
            mappings.push(ptr);
            mappings.len() - 1
        }
    };
    Ok(Window::new(mapping, host_base, mapping_index))
}

impl RunSink for RecordSink<'_> {
    type Stop = PinError;

    fn unmapped(&mut self, pfn: u64, index: usize) -> PinError {
        PinError::NotMapped { index, pfn }
    }

    /// Out of line (see `enter_record`), so that the loop's state stays in registers.
    #[inline(always)]
    fn enter(&mut self, mapping: &Arc<Mapping>, pfn: u64, index: usize) -> Result<Window, PinError> {
        enter_record(self.mappings, self.prot, mapping, pfn, index)
    }

    #[inline(always)]
    fn run(
        &mut self,
        window: &Window,
        pfn: u64,
        page: u64,
        npages: u64,
        index: usize,
    ) -> Result<(), PinError> {
        if self.next == self.room_end {
            self.grow(index);
        }
        let run = PinnedRun::new(pfn, npages, index, window.host_at(page), window.mapping_index);
        // SAFETY: (local) `next` is in the list's room (grown just now if it was full); the
        // length is set after the cut (`finish`).
        unsafe {
            self.next.write(run);
            self.next = self.next.add(1);
        }
        Ok(())
    }
}

/// Cuts a call into `record`. Out of line: its loop gets the registers to itself.
#[inline(never)]
fn cut_into_record(
    table: &MappingTable,
    hint: &mut Option<ShardHint>,
    prot: Prot,
    entries: impl Entries,
    record: &mut Record,
) -> Result<(), PinError> {
    let mut sink = RecordSink::new(record, prot, entries.runs_at_most());
    let cut = cut(table, hint, entries, &mut sink);
    sink.finish();
    cut?;
    // The runs cover every entry once.
    record.pages += entries.len();
    Ok(())
}

/// Track mode's fast path: a call whose runs all lie in one mapping and number at most
/// [`SMALL_RUNS`] (every single page, every range inside one mapping, short IDAW and PRP
/// lists) is cut in place into a free entry of the shard's small-record array. `None` when
/// the call is not such a call, or has an error to report, or does not fit the shard's
/// stock and the limit, or the array is full: the general path then does the whole call, as
/// if this had not run (what this may have changed — the shard's hint, released entries taken
/// back, surplus stock returned, the array allocated, an entry written but not published —
/// leaves nothing counted twice).
#[inline(always)]
fn pin_small(
    space: &Arc<SpaceInner>,
    table: &MappingTable,
    shard: &mut Shard,
    shard_index: usize,
    prot: Prot,
    entries: impl Entries,
    max_pages: u64,
) -> Option<RecordPtr> {
    let npages = entries.len();
    // Bigger calls never fit a shard's share of small-record pins: no look for room. A call
    // asking for no access is refused by the general path.
    if npages == 0 || npages > max_pages || npages > SMALL_PINS || prot.is_empty() {
        return None;
    }
    if shard.small_short(npages) && !reclaim_small(&space.policy, shard, npages) {
        return None;
    }
    let entry = shard.free_small()?;
    // SAFETY: (I3) a free entry of our locked shard: nobody else reads or writes it until it
    // is published below.
    let record = unsafe { &mut *entry.as_ptr() };
    let mut sink = SmallSink { entry: record, prot, mapping: None, len: 0 };
    cut(table, &mut shard.hint, entries, &mut sink).ok()?;
    let (mapping, len) = (sink.mapping?, sink.len);
    if shard.stock < npages && !refill_stock(&space.policy, shard, npages) {
        return None;
    }
    shard.stock -= npages;
    // SAFETY: (I3) `entry` came from `free_small` of this shard under this hold of its lock.
    unsafe { shard.publish_small(entry, len, npages, mapping, owner(space, shard_index, prot)) };
    if shard.keepalive.is_none() {
        // Once per shard: the shard holds the space while it has records (I4).
        shard.keepalive = Some(keepalive(space));
    }
    shard.counts.pinned(len as u64, npages);
    Some(RecordPtr::Small(entry))
}

/// Takes back a shard's released small records when it is short for a call of `pages`
/// pages (see `Shard::reclaim_short_small`; their pins into its stock, the surplus beyond
/// two stocks back to the space); true if the call fits now.
#[cold]
fn reclaim_small(policy: &PinPolicy, shard: &mut Shard, pages: u64) -> bool {
    let room = shard.reclaim_short_small(pages);
    trim_stock(policy, shard);
    room
}

/// Tops a shard's stock up by `pins` and a stock more from the space; false if that does
/// not fit under the limit (the general path then reserves exactly, or fails).
#[cold]
fn refill_stock(policy: &PinPolicy, shard: &mut Shard, pins: u64) -> bool {
    let more = pins.saturating_add(PIN_STOCK);
    if policy.take(more).is_err() {
        return false;
    }
    shard.stock += more;
    true
}

/// Gives a shard's stock beyond two stocks' worth back to the space.
#[inline]
fn trim_stock(policy: &PinPolicy, shard: &mut Shard) {
    if shard.stock > 2 * PIN_STOCK {
        policy.give(shard.stock - PIN_STOCK);
        shard.stock = PIN_STOCK;
    }
}

/// Reserves `pins` for a track-mode call from `shard` (index `own`, locked by the caller):
/// from the shard's stock, else from the space's count with a new stock, else exactly. Before
/// failing, every shard that can be reached without waiting takes back its released small
/// records and gives its stock back to the space, so a call fails only if the pins held (and
/// the stocks and not yet reclaimed small records of shards busy at that moment) leave no
/// room.
#[inline]
fn reserve_in_shard(space: &SpaceInner, shard: &mut Shard, own: usize, pins: u64) -> Result<(), u64> {
    if let Some(left) = shard.stock.checked_sub(pins) {
        shard.stock = left;
        return Ok(());
    }
    refill_and_reserve(space, shard, own, pins)
}

/// [`reserve_in_shard`] when the shard's stock is short.
#[inline(never)]
fn refill_and_reserve(space: &SpaceInner, shard: &mut Shard, own: usize, pins: u64) -> Result<(), u64> {
    let policy = &space.policy;
    if pins.checked_add(PIN_STOCK).is_some_and(|more| policy.take(more).is_ok()) {
        shard.stock += PIN_STOCK;
        return Ok(());
    }
    if policy.take(pins).is_ok() {
        return Ok(());
    }
    // Released small records hold their pins until reclaimed: take them back first.
    shard.reclaim_small();
    policy.give(std::mem::take(&mut shard.stock));
    space.shards.try_each_other(own, |other| {
        other.reclaim_small();
        policy.give(std::mem::take(&mut other.stock));
    });
    policy.take(pins)
}

/// Track mode's fast path (see [`pin_small`]) under this thread's shard lock, held in `read`.
#[inline(always)]
pub(super) fn pin_fast(
    space: &DmaSpace,
    read: &mut TableRead<'_>,
    prot: Prot,
    entries: impl Entries,
) -> Option<RecordPtr> {
    let shard_index = read.index();
    let (table, shard) = read.parts();
    let max = space.config().max_pages_per_call;
    pin_small(&space.inner.space, table, shard, shard_index, prot, entries, max)
}

/// Track mode: the whole call under this thread's shard lock. The runs are cut into a
/// record of the shard, the pins reserved, the mappings checked live, and the record
/// published; the guard points at it. No per-page work, no lock or line shared with other
/// threads (but the shard's, when more threads than shards pin at once).
#[inline(never)]
///
/// In kernel mode (`kernel` given) the mappings must grant write access too (the kernel pins
/// for writing), and the record gets consecutive slots of the kernel table for its runs'
/// buffers before it is published; the caller then registers them.
pub(super) fn pin_recorded(
    dma: &DmaSpace,
    mut read: TableRead<'_>,
    prot: Prot,
    entries: impl Entries,
    kernel: Option<&KernelTable>,
) -> Result<RecordPtr, PinError> {
    let space = &dma.inner.space;
    let shard_index = read.index();
    let (table, shard) = read.parts();
    if let Err(e) = entries.check(dma.config().max_pages_per_call, prot) {
        shard.counts.pin_failures += 1;
        return Err(e);
    }
    let mut record = shard.fresh();
    let needs = if kernel.is_some() { prot | Prot::WRITE } else { prot };
    let recorded = cut_into_record(table, &mut shard.hint, needs, entries, &mut record)
        .and_then(|()| reserve_and_check_live(space, shard, shard_index, &record))
        .and_then(|()| match kernel {
            None => Ok(()),
            Some(kernel) => reserve_slots(kernel, &mut record).inspect_err(|_| shard.stock += record.pages),
        });
    if let Err(e) = recorded {
        shard.discard(record);
        shard.counts.pin_failures += 1;
        return Err(e);
    }
    if shard.keepalive.is_none() {
        // Once per shard: the shard holds the space while it has records (I4).
        shard.keepalive = Some(keepalive(space));
    }
    shard.counts.pinned(record.runs.len() as u64, record.pages);
    let record = RecordPtr::Boxed(shard.publish(record, owner(space, shard_index, prot)));
    drop(read);
    Ok(record)
}

/// Kernel mode: reserves consecutive slots of the kernel table for a cut record's buffers.
#[cold]
fn reserve_slots(kernel: &KernelTable, record: &mut Record) -> Result<(), PinError> {
    let requested: u64 = record.runs.iter().map(|r| buffers_of(r.npages())).sum();
    let reserved = kernel.reserve(u32::try_from(requested).unwrap_or(u32::MAX));
    match reserved {
        Ok(first) => {
            record.kernel = Some(KernelSlots { first, count: requested as u32 });
            Ok(())
        }
        Err(free) => Err(PinError::KernelBuffers { requested, free, size: kernel.size() }),
    }
}

/// Reserves a cut record's pins, then checks its mappings are live (the order lock mode
/// checks them in). A mapping an unmap has marked grants no new pins; the unmap, which marks
/// first and then looks at the shards, either waits for this record or was seen here (I6).
fn reserve_and_check_live(
    space: &SpaceInner,
    shard: &mut Shard,
    own: usize,
    record: &Record,
) -> Result<(), PinError> {
    reserve_in_shard(space, shard, own, record.pages).map_err(|held| PinError::PinLimit {
        requested: record.pages,
        held,
        max: space.policy.max_pins,
    })?;
    let view = record.view();
    for (i, mapping) in view.mappings().enumerate() {
        let state = mapping.state();
        if state != MappingState::Live {
            shard.stock += record.pages;
            // Report the first entry in that mapping.
            let run =
                record.runs.iter().find(|r| r.mapping_index() == i).expect("a planned mapping has a run");
            let (index, pfn) = (run.index(), run.iova() >> PAGE_SHIFT);
            return Err(match state {
                MappingState::Unmapping => PinError::Unmapping { index, pfn },
                _ => PinError::NotMapped { index, pfn },
            });
        }
    }
    Ok(())
}

/// Retires a guard's record under its shard's lock: a boxed record, or a small one whose
/// mapping is going or whose space is closing. Wakes an unmap waiting for its pins (I7) and
/// lets go of a closed space with its last record (I8).
///
/// # Safety
/// `record` is live, published with `owner`, and retired once, here.
pub(crate) unsafe fn retire(owner: Owner, record: RecordPtr) {
    // SAFETY: (I4) the record is live, so its shard keeps the space.
    let space = unsafe { space_of(&owner) };
    // SAFETY: (I3) the record is live until retired below, after the view's last use.
    let view = unsafe { record.view() };
    if let Some(slots) = view.kernel {
        // The kernel's pins go first, with no engine lock held (I17): an unmap that sees
        // the record gone sees them gone.
        space.policy.kernel_table().release(slots.first, slots.count, view.pages);
    }
    // SAFETY: (I3) per the contract.
    unsafe { retire_record(owner, record, false) };
}

/// [`retire`] but for the kernel's pins: the record leaves its shard, counted as an unpin,
/// or (`failed`) as a pin call that failed after all.
///
/// The space is looked up here rather than passed in: the record may be its last, and a
/// reference argument would have to outlive the call, past the drop that lets the space go.
///
/// # Safety
/// As for [`retire`].
unsafe fn retire_record(owner: Owner, record: RecordPtr, failed: bool) {
    // SAFETY: (I4) the record is live, so its shard keeps the space; `space` is not used
    // after the shard's keepalive is dropped below.
    let space = unsafe { space_of(&owner) };
    // SAFETY: (I3) the record is live until retired below, after the view's last use.
    let view = unsafe { record.view() };
    let mut shard = space.shards.lock_shard(owner.shard);
    let (pages, runs) = (view.pages, view.runs.len() as u64);
    // One look at the mappings' states: an unmap waiting for these pins is woken once they
    // are gone (under this lock, while the mappings are still allocated: I1); an abandoned
    // mapping may be free to go.
    let (mut waking, mut orphaned) = (false, false);
    for m in view.mappings() {
        match m.state() {
            MappingState::Live => {}
            MappingState::Unmapping => waking = true,
            MappingState::Removed => (waking, orphaned) = (true, true),
        }
    }
    // Hold the space across the prune: after the shard's lock it may go.
    let keep = if orphaned { shard.keepalive.clone() } else { None };
    let mut departing: SmallVec<[NonNull<Mapping>; 2]> = SmallVec::new();
    if waking {
        departing.extend(view.mappings().filter(|m| m.state() != MappingState::Live).map(NonNull::from));
    }
    // SAFETY: (I3) the record was published in this shard and is retired once, here.
    unsafe { shard.retire(record) };
    for m in &departing {
        // SAFETY: (I1) the shard's lock is still held: whatever frees the mapping looks at
        // this shard first, and the record named it until just now.
        unsafe { m.as_ref() }.drained.signal();
    }
    if failed {
        shard.counts.pin_calls -= 1;
        shard.counts.runs -= runs;
        shard.counts.pages -= pages;
        shard.counts.pin_failures += 1;
    } else {
        shard.counts.unpin_calls += 1;
    }
    shard.stock += pages;
    trim_stock(&space.policy, &mut shard);
    let last =
        if space.closed.load(Ordering::SeqCst) && shard.is_empty() { shard.keepalive.take() } else { None };
    drop(shard);
    drop(last);
    if let Some(space) = keep.and_then(|keep| keep.downcast::<SpaceInner>().ok()) {
        // An abandoned mapping the record named may be free to go now.
        space.prune_orphans();
    }
}

/// Takes back a published kernel-mode record whose buffers the kernel refused (their
/// slots given back already): retired as if its guard had dropped, and its call counted as
/// failed instead of pinned.
///
/// # Safety
/// As for [`retire`]; the record was returned by [`pin_recorded`] and no guard holds it.
pub(super) unsafe fn unpublish(owner: Owner, record: RecordPtr) {
    // SAFETY: (I3) per the contract; the record's kernel slots are not released again.
    unsafe { retire_record(owner, record, true) };
}

/// Moves a guard's pins from its record to the per-page counts (`PinnedPages::forget`),
/// then retires the record. A page that cannot count more keeps the guard's pins held for
/// good (logged). A kernel-mode record's buffers stay registered, each kept by its mapping
/// until `unpin_pages` has taken back each of its pages (`KeptBuffer`).
///
/// # Safety
/// As for [`retire`].
pub(crate) unsafe fn forget(owner: Owner, record: RecordPtr) {
    // SAFETY: (I3) the record is live until retired below, after the view's last use.
    let view = unsafe { record.view() };
    // The slot of each run's first buffer (kernel mode).
    let mut slot = view.kernel.map(|k| k.first);
    // Counted first, then retired: an unmap sees the pins throughout.
    for (done, run) in view.runs.iter().enumerate() {
        let mapping = view.mapping(run.mapping_index());
        let page = mapping.run_page(run);
        // Bound first: the undo below locks mappings again.
        let counted = {
            let mut pins = mapping.lock();
            let counted = pins.page_counts.try_increment(page, run.npages()).map(drop);
            if let (Ok(()), Some(first)) = (counted, slot.as_mut()) {
                *first += pins.keep_buffers(*first, page, run.npages());
            }
            counted
        };
        if let Err(page) = counted {
            for undo in view.runs[..done].iter().rev() {
                let m = view.mapping(undo.mapping_index());
                let mut pins = m.lock();
                pins.page_counts.decrement(m.run_page(undo), undo.npages(), None);
                if let Some(k) = view.kernel {
                    pins.unkeep_slots(k.first..k.first + k.count);
                }
            }
            // Only after 65535 kept pins of one page: these stay held for good.
            log::error!(
                "page {:#x} cannot count more kept pins; the {} pins of this guard stay held",
                mapping.iova() + page * PAGE_SIZE,
                view.pages
            );
            return;
        }
    }
    // SAFETY: (I4) the record is live, so its shard keeps the space.
    let space = unsafe { space_of(&owner) };
    let mut shard = space.shards.lock_shard(owner.shard);
    // SAFETY: (I3) the record was published in this shard and is retired once, here.
    unsafe { shard.retire(record) };
    // Its pins stay reserved (now counted); the shard lets go of a closed space (I8).
    let last =
        if space.closed.load(Ordering::SeqCst) && shard.is_empty() { shard.keepalive.take() } else { None };
    drop(shard);
    drop(last);
}
