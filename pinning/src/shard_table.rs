//! The shard table: a space's mapping table behind one lock per shard, and each shard's
//! track-mode records, stock of pins and counts.
//!
//! Reading the table takes the calling thread's shard lock only (a [`BiasedLock`]: for the
//! thread that owns the shard, plain stores and loads to take and give back); changing it takes all of them, in order, and
//! clears every shard's hint (DESIGN.md I2). A track-mode pin call does its whole work (look
//! up its pages, check their mappings are live, record its runs) under its own shard's lock:
//! one uncontended lock per call, shared with no other thread. An unmap marks its mappings
//! first and then looks at every shard, so either it sees a call's record or the call sees
//! the mark (I6).

use std::any::Any;
use std::cell::UnsafeCell;
use std::collections::BTreeMap;
use std::ops::{Deref, DerefMut};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use crossbeam_utils::CachePadded;
use smallvec::SmallVec;

use crate::biased::{BiasedGuard, BiasedLock};
use crate::counters::Counts;
use crate::mapping::Mapping;
use crate::record::{
    Owner, Record, RecordPtr, RecordRef, SmallRecord, SmallRecords, SMALL_PINS, SMALL_RECORDS, SMALL_RUNS,
};
use crate::run::PinnedRun;
use crate::shard::{this_shard, SHARDS};

/// Emptied records a shard keeps for reuse.
const FREE_RECORDS: usize = 64;

/// Most runs a kept record has room for (a 512-entry scattered list): bigger ones are freed.
const KEEP_RUNS: usize = 512;

/// One shard: its live records and what keeps them valid.
pub(crate) struct Shard {
    /// Records of live track-mode guards pinned from this shard (boxes owned by the shard).
    live: Vec<NonNull<Record>>,
    /// Retired records kept for reuse: their run lists keep their capacity. Boxed because a
    /// published record must not move (its guard points at it) and a reused box costs no
    /// allocation.
    #[allow(clippy::vec_box)]
    free: Vec<Box<Record>>,
    /// The small-record array, allocated at the shard's first such call. Held by pointer,
    /// not by value or Box, so that `&mut Shard` does not cover entries that guards read.
    small: Option<NonNull<SmallRecords>>,
    /// Entries of `small` the shard may hand out (bit `i`: entry `i`); all until it exists.
    /// A clear bit is a live entry or one its guard released that is not reclaimed yet.
    small_free: u64,
    /// Small calls left before a full array is looked at again, after a look found it full
    /// (see `Shard::reclaim_short_small`).
    small_backoff: u32,
    /// Pins in small records, live or released and not yet reclaimed: at most
    /// [`SMALL_PINS`], so that pins released without the lock and not yet taken back can
    /// deny other shards' calls at most that many pins below the space's limit.
    small_pins: u64,
    /// Pins the live records hold.
    pins: u64,
    /// The space, held from the shard's first record on and let go once the space is
    /// closed and the shard holds no live record (I4, I8). Its type erased: the shard table
    /// sits below the space in the module order.
    pub(crate) keepalive: Option<Arc<dyn Any + Send + Sync>>,
    /// Pins this shard reserved from the space's limit and has not used: track-mode calls
    /// take from it under the shard's lock, touching the shared count once per stock.
    pub(crate) stock: u64,
    /// Counts of the track-mode calls made from this shard, and of the space's other events
    /// on its threads (summed by `stats`).
    pub(crate) counts: Counts,
    /// The mapping this shard's calls last resolved: the usual next hit, without a tree walk.
    pub(crate) hint: Option<ShardHint>,
}

/// The mappings of a space by first page number.
pub(crate) type MappingTable = BTreeMap<u64, Arc<Mapping>>;

/// A shard's last resolved mapping. Its pointer into the table is valid while the shard's
/// lock is held: every table change clears every hint first (I2).
#[derive(Clone, Copy, Debug)]
pub(crate) struct ShardHint {
    pub(crate) first_pfn: u64,
    pub(crate) end_pfn: u64,
    /// The table's entry for the mapping.
    pub(crate) entry: NonNull<Arc<Mapping>>,
}

/// Pins that live records hold in one mapping.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct RecordedPins {
    pub(crate) pins: u64,
    /// Of those, pins in small records: their guards may let go without the shard's lock
    /// and then tell nobody (I5, I7).
    pub(crate) in_small: u64,
}

impl Default for Shard {
    fn default() -> Self {
        Shard {
            live: Vec::new(),
            free: Vec::new(),
            small: None,
            small_free: !0,
            small_backoff: 0,
            small_pins: 0,
            pins: 0,
            keepalive: None,
            stock: 0,
            counts: Counts::default(),
            hint: None,
        }
    }
}

impl std::fmt::Debug for Shard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Shard")
            .field("live", &self.live.len())
            .field("small", &(!self.small_free).count_ones())
            .field("pins", &self.pins)
            .finish_non_exhaustive()
    }
}

// SAFETY: (I1, I3) a shard owns its record boxes and its small-record array (moved between threads
// with it, like Boxes), and the mapping pointers in them are only dereferenced under the
// invariants of `Record::mappings`, by whichever thread holds the shard's lock or the
// record's guard.
unsafe impl Send for Shard {}

impl Shard {
    /// An empty record to fill, reused if one is free.
    #[inline]
    pub(crate) fn fresh(&mut self) -> Box<Record> {
        self.free.pop().unwrap_or_default()
    }

    /// Gives back a record that was never published.
    pub(crate) fn discard(&mut self, mut record: Box<Record>) {
        record.runs.clear();
        record.mappings.clear();
        record.pages = 0;
        record.kernel = None;
        // A record grown by a huge scattered call is not worth keeping.
        if self.free.len() < FREE_RECORDS && record.runs.capacity() <= KEEP_RUNS {
            self.free.push(record);
        }
    }

    /// Makes `record` live; the pointer stays valid until [`Shard::retire`].
    #[inline]
    pub(crate) fn publish(&mut self, mut record: Box<Record>, owner: Owner) -> NonNull<Record> {
        record.owner = owner;
        record.at.store(self.live.len(), Ordering::Relaxed);
        self.pins += record.pages;
        let ptr = NonNull::from(Box::leak(record));
        self.live.push(ptr);
        ptr
    }

    /// A free entry of the shard's small-record array to fill, `None` if every entry is
    /// taken (the caller reclaims released ones, or records the call in a box). Nothing
    /// reads the entry until [`Shard::publish_small`].
    #[inline(always)]
    pub(crate) fn free_small(&mut self) -> Option<NonNull<SmallRecord>> {
        if self.small_free == 0 {
            return None;
        }
        let small = match self.small {
            Some(small) => small,
            None => self.allocate_small(),
        };
        let at = self.small_free.trailing_zeros() as usize;
        // SAFETY: (I3) `small` is this shard's array (allocated, freed only with the shard); entry
        // `at` is free (its last guard released it and the release was seen), so no guard
        // reads it, and we hold the shard's lock (`&mut self`), the only way to write entries.
        Some(NonNull::from(unsafe { &mut *(*small.as_ptr())[at].get() }))
    }

    /// Makes a filled entry of [`Shard::free_small`] live with `len` runs of `pages` pages
    /// in `mapping`; the pointer stays valid until released or retired.
    ///
    /// # Safety
    /// `entry` came from `free_small` of this shard, under the same hold of its lock.
    #[inline(always)]
    pub(crate) unsafe fn publish_small(
        &mut self,
        entry: NonNull<SmallRecord>,
        len: usize,
        pages: u64,
        mapping: NonNull<Mapping>,
        owner: Owner,
    ) {
        // SAFETY: (I3) per the contract, a free entry we hold the only reference to.
        let e = unsafe { &mut *entry.as_ptr() };
        e.owner = owner;
        e.len = len as u8;
        e.pages = pages;
        e.mapping = mapping;
        *e.live.get_mut() = true;
        self.small_free &= !(1 << e.at);
        self.pins += pages;
        self.small_pins += pages;
    }

    /// Takes back the entries whose guards released them without the lock: their pins go
    /// back to the shard's stock and their calls are counted as unpins.
    pub(crate) fn reclaim_small(&mut self) {
        let Some(small) = self.small else { return };
        let (mut freed, mut pages) = (0u64, 0u64);
        let mut taken = !self.small_free;
        while taken != 0 {
            let at = taken.trailing_zeros() as usize;
            taken &= taken - 1;
            // SAFETY: (I3) an entry of this shard's array; we only read it (its guard may be
            // reading it too) and hold the shard's lock.
            let entry = unsafe { &*(*small.as_ptr())[at].get() };
            if !entry.is_live() {
                freed |= 1 << at;
                pages += entry.pages;
            }
        }
        self.small_free |= freed;
        self.pins -= pages;
        self.small_pins -= pages;
        self.stock += pages;
        self.counts.unpin_calls += u64::from(freed.count_ones());
    }

    #[cold]
    fn allocate_small(&mut self) -> NonNull<SmallRecords> {
        let small: Box<SmallRecords> = Box::new(std::array::from_fn(|at| {
            UnsafeCell::new(SmallRecord {
                mapping: NonNull::dangling(),
                pages: 0,
                live: AtomicBool::new(false),
                len: 0,
                at: at as u32,
                owner: Owner::default(),
                runs: [PinnedRun::EMPTY; SMALL_RUNS],
            })
        }));
        let small = NonNull::from(Box::leak(small));
        self.small = Some(small);
        small
    }

    /// Retires a live record of this shard.
    ///
    /// # Safety
    /// `record` was published by this shard and not retired since, and no reference to it
    /// outlives this call.
    #[inline]
    pub(crate) unsafe fn retire(&mut self, record: RecordPtr) {
        match record {
            RecordPtr::Small(entry) => {
                // SAFETY: (I3) per the contract, a live entry of this shard's array.
                let entry = unsafe { entry.as_ref() };
                entry.live.store(false, Ordering::Relaxed);
                self.small_free |= 1 << entry.at;
                self.pins -= entry.pages;
                self.small_pins -= entry.pages;
            }
            // SAFETY: (I3) per the contract.
            RecordPtr::Boxed(record) => unsafe { self.retire_boxed(record) },
        }
    }

    /// Retires a live boxed record of this shard.
    ///
    /// # Safety
    /// As [`Shard::retire`]'s: `record` is a live boxed record of this shard, whose guard has
    /// let go of it and touches it no more.
    unsafe fn retire_boxed(&mut self, record: NonNull<Record>) {
        // SAFETY: (I3) per the contract, the record is live in this shard: a box it owns.
        let record = unsafe { Box::from_raw(record.as_ptr()) };
        let at = record.at.load(Ordering::Relaxed);
        self.live.swap_remove(at);
        if let Some(moved) = self.live.get_mut(at) {
            // SAFETY: (I3) live records are valid boxes owned by this shard; only shared references
            // to them exist (their guards'), and `at` is atomic.
            unsafe { moved.as_ref() }.at.store(at, Ordering::Relaxed);
        }
        self.pins -= record.pages;
        self.discard(record);
    }

    /// The live records.
    pub(crate) fn records(&self) -> impl Iterator<Item = RecordRef<'_>> {
        self.boxed_records().chain(self.small_records())
    }

    /// The live boxed records.
    fn boxed_records(&self) -> impl Iterator<Item = RecordRef<'_>> {
        // SAFETY: (I3) live records are valid boxes owned by this shard, borrowed with it.
        self.live.iter().map(|r| unsafe { r.as_ref() }.view())
    }

    /// The live small records.
    fn small_records(&self) -> impl Iterator<Item = RecordRef<'_>> {
        self.small.into_iter().flat_map(move |small| {
            let live = !self.small_free;
            (0..SMALL_RECORDS).filter(move |i| live & (1 << i) != 0).filter_map(move |i| {
                // SAFETY: (I3) an entry of this shard's array, rewritten only under the shard's lock
                // we are borrowed under; read only if still live (then its guard holds it).
                let entry = unsafe { &*(*small.as_ptr())[i].get() };
                entry.is_live().then(|| entry.view())
            })
        })
    }

    /// Pins this shard's live records hold in `m`.
    fn pins_in(&self, m: &Mapping) -> RecordedPins {
        let boxed: u64 = self.boxed_records().map(|r| r.pins_in(m)).sum();
        let in_small: u64 = self.small_records().map(|r| r.pins_in(m)).sum();
        RecordedPins { pins: boxed + in_small, in_small }
    }

    /// True unless a free entry and room under [`SMALL_PINS`] take a call of `pages` pages
    /// (counting released entries not yet reclaimed as taken).
    #[inline(always)]
    pub(crate) fn small_short(&self, pages: u64) -> bool {
        self.small_free == 0 || self.small_pins + pages > SMALL_PINS
    }

    /// Reclaims released entries when the array is short for `pages` pages, unless it is
    /// full and a recent look found nothing released (a device holding more than 64 guards
    /// would scan all 64 on every call); true if it takes the call now. Short of pins with
    /// entries free, it always looks: the look is over the taken entries only, and costs
    /// less than the boxed call that follows when nothing was released.
    pub(crate) fn reclaim_short_small(&mut self, pages: u64) -> bool {
        let full = self.small_free == 0;
        if full && self.small_backoff > 0 {
            self.small_backoff -= 1;
            return false;
        }
        self.reclaim_small();
        if self.small_free == 0 {
            self.small_backoff = SMALL_RECORDS as u32;
        }
        !self.small_short(pages)
    }

    /// True if no record is live (every live record holds at least one pin), after taking
    /// back released entries.
    pub(crate) fn is_empty(&mut self) -> bool {
        if self.pins != 0 {
            self.reclaim_small();
        }
        self.pins == 0
    }

    /// Pins the live records hold (after taking back released entries).
    pub(crate) fn pins(&mut self) -> u64 {
        self.reclaim_small();
        self.pins
    }

    /// Heap bytes of the shard's records.
    pub(crate) fn bookkeeping_bytes(&self) -> usize {
        let each = |r: &Record| {
            std::mem::size_of::<Record>()
                + r.runs.capacity() * std::mem::size_of::<PinnedRun>()
                + r.mappings.capacity() * std::mem::size_of::<NonNull<Mapping>>()
        };
        let small = if self.small.is_some() { std::mem::size_of::<SmallRecords>() } else { 0 };
        self.live.iter().map(|r| each(unsafe_ref(r))).sum::<usize>()
            + self.free.iter().map(|r| each(r)).sum::<usize>()
            + small
    }
}

/// A live boxed record of a shard, borrowed with the shard.
fn unsafe_ref(record: &NonNull<Record>) -> &Record {
    // SAFETY: (I3) live records are valid boxes owned by their shard, which the caller borrows.
    unsafe { record.as_ref() }
}

impl Drop for Shard {
    fn drop(&mut self) {
        if !self.is_empty() {
            // Cannot happen (live records keep their space, which owns the shard); if it
            // did, their guards still point at them: leak rather than free under them.
            log::error!("a pin shard dropped with {} pins in live records; leaking them", self.pins);
            return;
        }
        if let Some(small) = self.small.take() {
            // SAFETY: (I3, I4) allocated by `allocate_small` as a leaked Box; no entry is live, so
            // no guard points into it.
            drop(unsafe { Box::from_raw(small.as_ptr()) });
        }
    }
}

// A shard and its lock in two cache lines (of the 128-byte pairs `CachePadded` aligns to):
// a pin touches them and nothing else of the table.
const _: () = assert!(std::mem::size_of::<CachePadded<BiasedLock<Shard>>>() <= 256);

/// The mapping table and the shards, as described in the module documentation.
#[derive(Default)]
pub(crate) struct ShardTable {
    shards: [CachePadded<BiasedLock<Shard>>; SHARDS],
    table: UnsafeCell<MappingTable>,
}

// SAFETY: (I2, I19) the table is reached only through `TableRead` (holding one shard lock: shared) and
// `TableWrite` (holding every shard lock: exclusive), so its accesses are serialised by the
// shard locks exactly as an RwLock's would be; its contents (Arc<Mapping>) are Send + Sync.
unsafe impl Sync for ShardTable {}
// SAFETY: (I2, I19) as above; moving the table between threads moves owned Arcs and shards (Send).
unsafe impl Send for ShardTable {}

impl std::fmt::Debug for ShardTable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ShardTable").finish_non_exhaustive()
    }
}

/// The table read under the calling thread's shard lock, and that shard.
pub(crate) struct TableRead<'a> {
    shard: BiasedGuard<'a, Shard>,
    index: usize,
    table: &'a MappingTable,
}

impl<'a> TableRead<'a> {
    /// The table and the locked shard, apart (both borrowed from this read: the table is
    /// safe to read only while the shard's lock is held).
    #[inline]
    pub(crate) fn parts(&mut self) -> (&MappingTable, &mut Shard) {
        (self.table, &mut self.shard)
    }

    /// Which shard is locked.
    #[inline]
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

/// The table under every shard lock.
pub(crate) struct TableWrite<'a> {
    _shards: SmallVec<[BiasedGuard<'a, Shard>; SHARDS]>,
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

impl ShardTable {
    /// Reads the table under this thread's shard lock. The thread must not hold a
    /// `TableRead` or `TableWrite` of this table already.
    #[inline]
    pub(crate) fn read(&self) -> TableRead<'_> {
        let index = this_shard();
        // Claiming: the first thread to pin through a shard owns its lock, and takes it from
        // then on with plain stores (I19); a guard dropped elsewhere, an unmap's look or a
        // table write pays for both sides.
        let shard = self.shards[index].lock_claiming();
        // SAFETY: (I2, I19) we hold a shard lock, which has one holder at a time, so no
        // TableWrite (which holds them all) exists; other readers only read.
        let table = unsafe { &*self.table.get() };
        TableRead { shard, index, table }
    }

    /// Locks every shard, in order, and gives the table for changing. The thread must not
    /// hold a shard lock of this table already.
    pub(crate) fn write(&self) -> TableWrite<'_> {
        let mut shards: SmallVec<[BiasedGuard<'_, Shard>; SHARDS]> =
            self.shards.iter().map(|s| s.lock()).collect();
        // The table may change: every shard's hint may point at an entry about to go.
        for shard in &mut shards {
            shard.hint = None;
        }
        // SAFETY: (I2, I19) we hold every shard lock, each of which has one holder at a time:
        // no TableRead or other TableWrite exists.
        let table = unsafe { &mut *self.table.get() };
        TableWrite { _shards: shards, table }
    }

    /// Shard `index` alone (for a guard's retirement; the table is not read).
    #[inline]
    pub(crate) fn lock_shard(&self, index: usize) -> BiasedGuard<'_, Shard> {
        self.shards[index].lock()
    }

    /// Calls `f` with every shard but `own` that is not locked at the moment (for a thread
    /// that holds `own`: it cannot wait for the others without risking a deadlock).
    pub(crate) fn try_each_other(&self, own: usize, mut f: impl FnMut(&mut Shard)) {
        for (i, s) in self.shards.iter().enumerate() {
            if i == own {
                continue;
            }
            if let Some(mut shard) = s.try_lock() {
                f(&mut shard);
            }
        }
    }

    /// Calls `f` with each shard in turn, each locked. The thread must hold no shard lock.
    pub(crate) fn for_each_shard(&self, mut f: impl FnMut(&mut Shard)) {
        for s in &self.shards {
            f(&mut s.lock());
        }
    }

    /// Pins live records hold in `m`, over every shard. The thread must hold no shard lock.
    pub(crate) fn pins_in(&self, m: &Mapping) -> RecordedPins {
        let mut total = RecordedPins::default();
        self.for_each_shard(|s| {
            let here = s.pins_in(m);
            total.pins += here.pins;
            total.in_small += here.in_small;
        });
        total
    }

    /// This thread's shard alone, for counting an event (the thread must hold no shard lock).
    pub(crate) fn counts_here(&self) -> BiasedGuard<'_, Shard> {
        self.lock_shard(this_shard())
    }
}
