//! Per-thread slots: state that every pin call touches, spread over cache lines so that
//! threads pinning at the same time do not pass one line back and forth. Each thread takes
//! a slot once (round robin); readers of totals sum over all of them.
//!
//! [`SlotTable`] is the space's mapping table behind one lock per slot, with the records of
//! track-mode pins. Reading the table takes the calling thread's slot lock only; changing it
//! takes all of them, in order. A track-mode pin call does its whole work (look up its pages,
//! check their mappings are live, record its runs) under its own slot's lock: one
//! uncontended lock per call, shared with no other thread. An unmap marks its mappings first
//! and then looks at every slot, so either it sees a call's record or the call sees the mark.

use std::cell::UnsafeCell;
use std::ops::{Deref, DerefMut};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use crossbeam::utils::CachePadded;
use smallvec::SmallVec;

use crate::mapping::Mapping;
use crate::pin::Runs;
use crate::space::{MappingTable, SpaceInner};

/// Slots per space: enough that the threads of a busy device rarely share one.
pub(crate) const SLOTS: usize = 16;

/// Emptied records a slot keeps for reuse.
const FREE_RECORDS: usize = 64;

/// Most runs a kept record has room for (a 512-entry scattered list): bigger ones are freed.
const KEEP_RUNS: usize = 512;

static NEXT_SLOT: AtomicUsize = AtomicUsize::new(0);

thread_local! {
    /// This thread's slot, `usize::MAX` until first asked (a const initialiser: reading it
    /// is a plain thread-local load).
    static SLOT: std::cell::Cell<usize> = const { std::cell::Cell::new(usize::MAX) };
}

/// This thread's slot.
#[inline]
pub(crate) fn this_slot() -> usize {
    SLOT.with(|s| {
        let slot = s.get();
        if slot != usize::MAX {
            return slot;
        }
        let slot = NEXT_SLOT.fetch_add(1, Ordering::Relaxed) % SLOTS;
        s.set(slot);
        slot
    })
}

/// One `T` per slot, each on its own cache line.
#[derive(Debug, Default)]
pub(crate) struct PerSlot<T> {
    slots: [CachePadded<T>; SLOTS],
}

impl<T> PerSlot<T> {
    /// This thread's `T`.
    #[inline]
    pub(crate) fn here(&self) -> &T {
        &self.slots[this_slot()]
    }

    /// Every slot's `T`.
    pub(crate) fn all(&self) -> impl Iterator<Item = &T> {
        self.slots.iter().map(|s| &**s)
    }
}

/// The runs of one track-mode pin call, owned by the slot it was pinned from while its
/// guard lives. Immutable from publication to retirement, so the guard reads it unlocked.
#[derive(Debug, Default)]
pub(crate) struct Record {
    /// The runs, in call order (`PinnedRun::slot` indexes `mappings`).
    pub(crate) runs: Runs,
    /// The mappings the runs lie in. Valid while the record is live: an unmap does not
    /// remove a mapping a live record names, and `abandon_all` keeps such mappings with the
    /// space, which outlives its records.
    pub(crate) mappings: SmallVec<[NonNull<Mapping>; 2]>,
    /// Pages pinned (entries of the call).
    pub(crate) pages: u64,
    /// Position in the slot's `live` list. Changed (under the slot's lock) when another
    /// record retires, while this record's guard may be reading the record on another
    /// thread: hence through a shared reference, as an atomic.
    at: AtomicUsize,
}

impl Record {
    /// The mapping of run slot `i`.
    pub(crate) fn mapping(&self, i: usize) -> &Mapping {
        // SAFETY: a live record's mappings stay allocated (see the field). A record being
        // filled is asked only by the pin call filling it, under its slot's lock, with
        // pointers it just took from the table, which cannot change meanwhile. Retired
        // records have no mappings.
        unsafe { self.mappings[i].as_ref() }
    }

    /// Pins this record holds in `m`.
    pub(crate) fn pins_in(&self, m: &Mapping) -> u64 {
        let Some(slot) = self.mappings.iter().position(|p| std::ptr::eq(p.as_ptr(), m)) else {
            return 0;
        };
        self.runs.iter().filter(|r| r.slot == slot).map(|r| r.npages()).sum()
    }
}

/// One slot: its live records and what keeps them valid.
#[derive(Default)]
pub(crate) struct Slot {
    /// Records of live track-mode guards pinned from this slot (boxes owned by the slot).
    live: Vec<NonNull<Record>>,
    /// Retired records kept for reuse: their run lists keep their capacity. Boxed because a
    /// published record must not move (its guard points at it) and a reused box costs no
    /// allocation.
    #[allow(clippy::vec_box)]
    free: Vec<Box<Record>>,
    /// Pins the live records hold.
    pins: u64,
    /// The space, held while the slot has live records once the space's handles are gone
    /// (see `SpaceHandle`).
    pub(crate) keepalive: Option<Arc<SpaceInner>>,
    /// Pins this slot reserved from the space's limit and has not used: track-mode calls
    /// take from it under the slot's lock, touching the shared count once per stock.
    pub(crate) stock: u64,
    /// Track-mode counters of the calls made from this slot (summed by `stats`).
    pub(crate) counts: SlotCounts,
    /// The mapping this slot's calls last resolved, as (first page, end page, the table's
    /// Arc): the usual next hit, without a tree walk. Cleared whenever the table changes
    /// (which takes every slot's lock).
    pub(crate) hint: SlotHint,
}

/// A slot's last resolved mapping: (first page, end page, the table's entry).
pub(crate) type SlotHint = Option<(u64, u64, NonNull<Arc<Mapping>>)>;

/// Counters of one slot's track-mode calls.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct SlotCounts {
    pub(crate) pin_calls: u64,
    pub(crate) pin_failures: u64,
    pub(crate) unpin_calls: u64,
    pub(crate) runs: u64,
    pub(crate) pages: u64,
}

impl std::fmt::Debug for Slot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Slot")
            .field("live", &self.live.len())
            .field("pins", &self.pins)
            .finish_non_exhaustive()
    }
}

// SAFETY: a slot owns its record boxes (moved between threads with it, like a Box), and the
// mapping pointers in them are only dereferenced under the invariants of `Record::mappings`,
// by whichever thread holds the slot's lock or the record's guard.
unsafe impl Send for Slot {}

impl Slot {
    /// An empty record to fill, reused if one is free.
    pub(crate) fn fresh(&mut self) -> Box<Record> {
        self.free.pop().unwrap_or_default()
    }

    /// Gives back a record that was never published.
    pub(crate) fn discard(&mut self, mut record: Box<Record>) {
        record.runs.clear();
        record.mappings.clear();
        record.pages = 0;
        // A record grown by a huge scattered call is not worth keeping.
        if self.free.len() < FREE_RECORDS && record.runs.capacity() <= KEEP_RUNS {
            self.free.push(record);
        }
    }

    /// Makes `record` live; the pointer stays valid until [`Slot::retire`].
    pub(crate) fn publish(&mut self, record: Box<Record>) -> NonNull<Record> {
        record.at.store(self.live.len(), Ordering::Relaxed);
        self.pins += record.pages;
        let ptr = NonNull::from(Box::leak(record));
        self.live.push(ptr);
        ptr
    }

    /// Retires a live record of this slot.
    ///
    /// # Safety
    /// `record` was returned by [`Slot::publish`] of this slot and not retired since, and no
    /// reference to it outlives this call.
    pub(crate) unsafe fn retire(&mut self, record: NonNull<Record>) {
        // SAFETY: per the contract, the record is live in this slot: a box it owns.
        let record = unsafe { Box::from_raw(record.as_ptr()) };
        let at = record.at.load(Ordering::Relaxed);
        self.live.swap_remove(at);
        if let Some(moved) = self.live.get_mut(at) {
            // SAFETY: live records are valid boxes owned by this slot; only shared references
            // to them exist (their guards'), and `at` is atomic.
            unsafe { moved.as_ref() }.at.store(at, Ordering::Relaxed);
        }
        self.pins -= record.pages;
        self.discard(record);
    }

    /// The live records.
    pub(crate) fn records(&self) -> impl Iterator<Item = &Record> {
        // SAFETY: live records are valid boxes owned by this slot, borrowed with it.
        self.live.iter().map(|r| unsafe { r.as_ref() })
    }

    /// True if no record is live.
    pub(crate) fn is_empty(&self) -> bool {
        self.live.is_empty()
    }

    /// Pins the live records hold.
    pub(crate) fn pins(&self) -> u64 {
        self.pins
    }

    /// Heap bytes of the slot's records.
    pub(crate) fn bookkeeping_bytes(&self) -> usize {
        let each = |r: &Record| {
            std::mem::size_of::<Record>()
                + if r.runs.spilled() {
                    r.runs.capacity() * std::mem::size_of::<crate::PinnedRun>()
                } else {
                    0
                }
        };
        self.records().map(each).sum::<usize>() + self.free.iter().map(|r| each(r)).sum::<usize>()
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        if !self.live.is_empty() {
            // Cannot happen (live records keep their space, which owns the slot); if it
            // did, their guards still point at them: leak rather than free under them.
            log::error!("a pin slot dropped with {} live records; leaking them", self.live.len());
        }
    }
}

/// The mapping table and the slots, as described in the module documentation.
#[derive(Default)]
pub(crate) struct SlotTable {
    slots: [CachePadded<Mutex<Slot>>; SLOTS],
    table: UnsafeCell<MappingTable>,
}

// SAFETY: the table is reached only through `TableRead` (holding one slot lock: shared) and
// `TableWrite` (holding every slot lock: exclusive), so its accesses are serialised by the
// slot mutexes exactly as an RwLock's would be; its contents (Arc<Mapping>) are Send + Sync.
unsafe impl Sync for SlotTable {}
// SAFETY: as above; moving the table between threads moves owned Arcs and slots (Send).
unsafe impl Send for SlotTable {}

impl std::fmt::Debug for SlotTable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SlotTable").finish_non_exhaustive()
    }
}

/// The table read under the calling thread's slot lock, and that slot.
pub(crate) struct TableRead<'a> {
    slot: MutexGuard<'a, Slot>,
    index: usize,
    table: &'a MappingTable,
}

impl<'a> TableRead<'a> {
    /// The table and the locked slot, apart (both borrowed from this read: the table is
    /// safe to read only while the slot's lock is held).
    pub(crate) fn parts(&mut self) -> (&MappingTable, &mut Slot) {
        (self.table, &mut self.slot)
    }

    /// Which slot is locked.
    pub(crate) fn index(&self) -> usize {
        self.index
    }
}

impl Deref for TableRead<'_> {
    type Target = MappingTable;
    fn deref(&self) -> &MappingTable {
        self.table
    }
}

/// The table under every slot lock.
pub(crate) struct TableWrite<'a> {
    _slots: SmallVec<[MutexGuard<'a, Slot>; SLOTS]>,
    table: &'a mut MappingTable,
}

impl Deref for TableWrite<'_> {
    type Target = MappingTable;
    fn deref(&self) -> &MappingTable {
        self.table
    }
}

impl DerefMut for TableWrite<'_> {
    fn deref_mut(&mut self) -> &mut MappingTable {
        self.table
    }
}

impl SlotTable {
    /// Reads the table under this thread's slot lock. The thread must not hold a
    /// `TableRead` or `TableWrite` of this table already.
    #[inline]
    pub(crate) fn read(&self) -> TableRead<'_> {
        let index = this_slot();
        let slot = crate::sync::lock(&self.slots[index]);
        // SAFETY: we hold a slot lock, so no TableWrite (which holds them all) exists; other
        // readers only read.
        let table = unsafe { &*self.table.get() };
        TableRead { slot, index, table }
    }

    /// Locks every slot, in order, and gives the table for changing. The thread must not
    /// hold a slot lock of this table already.
    pub(crate) fn write(&self) -> TableWrite<'_> {
        let mut slots: SmallVec<[MutexGuard<'_, Slot>; SLOTS]> =
            self.slots.iter().map(|s| crate::sync::lock(s)).collect();
        // The table may change: every slot's hint may point at an entry about to go.
        for slot in &mut slots {
            slot.hint = None;
        }
        // SAFETY: we hold every slot lock: no TableRead or other TableWrite exists.
        let table = unsafe { &mut *self.table.get() };
        TableWrite { _slots: slots, table }
    }

    /// Slot `index` alone (for a guard's retirement; the table is not read).
    pub(crate) fn lock_slot(&self, index: usize) -> MutexGuard<'_, Slot> {
        crate::sync::lock(&self.slots[index])
    }

    /// Calls `f` with every slot but `own` that is not locked at the moment (for a thread
    /// that holds `own`: it cannot wait for the others without risking a deadlock).
    pub(crate) fn try_each_other(&self, own: usize, mut f: impl FnMut(&mut Slot)) {
        for (i, s) in self.slots.iter().enumerate() {
            if i == own {
                continue;
            }
            match s.try_lock() {
                Ok(mut slot) => f(&mut slot),
                Err(std::sync::TryLockError::Poisoned(p)) => f(&mut p.into_inner()),
                Err(std::sync::TryLockError::WouldBlock) => {}
            }
        }
    }

    /// Calls `f` with each slot in turn, each locked. The thread must hold no slot lock.
    pub(crate) fn for_each_slot(&self, mut f: impl FnMut(&mut Slot)) {
        for s in &self.slots {
            f(&mut crate::sync::lock(s));
        }
    }

    /// Pins live records hold in `m`, over every slot. The thread must hold no slot lock.
    pub(crate) fn pins_in(&self, m: &Mapping) -> u64 {
        let mut pins = 0;
        self.for_each_slot(|s| pins += s.records().map(|r| r.pins_in(m)).sum::<u64>());
        pins
    }
}
