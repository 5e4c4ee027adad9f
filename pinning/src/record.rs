//! Track-mode records: the runs of a call, owned by a shard while its guard lives.

use std::cell::UnsafeCell;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

use crate::mapping::Mapping;
use crate::page::Prot;
use crate::run::PinnedRun;

/// The runs of one track-mode pin call, owned by the shard it was pinned from while its
/// guard lives. Immutable from publication to retirement, so the guard reads it unlocked.
#[derive(Debug, Default)]
pub(crate) struct Record {
    /// The runs, in call order (`PinnedRun::mapping_index` indexes `mappings`). A plain Vec: records
    /// are reused, so it keeps its capacity and a push is a store.
    pub(crate) runs: Vec<PinnedRun>,
    /// The mappings the runs lie in. Valid while the record is live: an unmap does not
    /// remove a mapping a live record names, and `abandon_all` keeps such mappings with the
    /// space, which outlives its records.
    pub(crate) mappings: Vec<NonNull<Mapping>>,
    /// Pages pinned (entries of the call).
    pub(crate) pages: u64,
    /// Kernel mode: the slots of the space's kernel table holding the runs' buffers (set
    /// before publication; registered with the kernel just after it).
    pub(crate) kernel: Option<KernelSlots>,
    /// The guard's space, shard and access (set at publication).
    pub(crate) owner: Owner,
    /// Position in the shard's `live` list. Changed (under the shard's lock) when another
    /// record retires, while this record's guard may be reading the record on another
    /// thread: hence through a shared reference, as an atomic.
    pub(crate) at: AtomicUsize,
}

impl Record {
    /// The record as its guard and the shard's readers see it.
    #[inline]
    pub(crate) fn view(&self) -> RecordRef<'_> {
        RecordRef { runs: &self.runs, mappings: &self.mappings, pages: self.pages, kernel: self.kernel }
    }
}

/// A kernel-mode record's consecutive slots in its space's kernel table: one buffer per run
/// in call order, a run longer than a buffer may be (1 GiB) taking one per GiB.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct KernelSlots {
    pub(crate) first: u32,
    pub(crate) count: u32,
}

/// What a guard keeps in its record rather than in itself, so that the guard is one word:
/// the space and shard that published the record, and the access the pages were pinned for.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Owner {
    /// The space whose shard published the record, its type erased: records sit below the
    /// space in the module order. Only `pin::track` makes and reads it, as a `SpaceInner`
    /// (I4 keeps it allocated while the record is live).
    pub(crate) space: NonNull<()>,
    pub(crate) shard: usize,
    pub(crate) prot: Prot,
}

impl Default for Owner {
    /// No owner yet: a record before its first publication.
    fn default() -> Self {
        Owner { space: NonNull::dangling(), shard: 0, prot: Prot::empty() }
    }
}

/// A record of a call whose runs all lie in one mapping and number at most [`SMALL_RUNS`]
/// (every single page, every range inside one mapping, short IDAW and PRP lists): written in
/// place in a shard's fixed array, no list to grow or clear.
///
/// Its guard usually lets go of it without the shard's lock: it clears `live` (after which
/// it touches nothing of the space), and the shard reclaims the entry, its pins and its
/// counts the next time it looks under its lock (when its free set runs out, when it is
/// read, or near the pin limit). Readers of a shard's records skip entries no longer live.
#[derive(Debug)]
pub(crate) struct SmallRecord {
    /// The mapping of every run, kept valid as `Record::mappings` is while `live`.
    pub(crate) mapping: NonNull<Mapping>,
    /// Pages pinned (entries of the call).
    pub(crate) pages: u64,
    /// True from publication until the guard lets go (release order: everything the guard
    /// did with the pages happens before a reader sees it false).
    pub(crate) live: AtomicBool,
    /// Runs used.
    pub(crate) len: u8,
    /// The entry's position in the shard's array (fixed).
    pub(crate) at: u32,
    /// The guard's space, shard and access (set at publication).
    pub(crate) owner: Owner,
    /// The runs, in call order (mapping index 0: `mapping`).
    pub(crate) runs: [PinnedRun; SMALL_RUNS],
}

/// Most pins a shard keeps in small records (see `Shard::small_pins`).
pub(crate) const SMALL_PINS: u64 = crate::budget::PIN_STOCK;

/// Most runs a [`SmallRecord`] holds.
pub(crate) const SMALL_RUNS: usize = 8;

impl SmallRecord {
    /// The mapping of the runs (valid while the entry is live).
    #[inline]
    pub(crate) fn mapping(&self) -> &Mapping {
        // SAFETY: (I1) a live entry's mapping stays allocated (see `Record::mappings`).
        unsafe { self.mapping.as_ref() }
    }

    /// True until the guard lets go.
    #[inline]
    pub(crate) fn is_live(&self) -> bool {
        self.live.load(Ordering::Acquire)
    }

    /// The guard lets go of the entry without its shard's lock; the shard reclaims it later.
    /// Through a pointer, borrowing only the flag: from the store on, the shard may rewrite
    /// the entry, or the space and the array may go.
    ///
    /// # Safety
    /// `entry` is a live entry of its shard, whose guard calls this once, holds no reference
    /// to it across the call and touches neither it nor its space afterwards.
    #[inline]
    pub(crate) unsafe fn release(entry: NonNull<SmallRecord>) {
        // SAFETY: (I4, I5) the entry is allocated until this store (it is live, per the
        // contract, and a shard frees its array only with no entry live);
        // only the atomic flag is borrowed, and only for the store.
        unsafe { (*std::ptr::addr_of!((*entry.as_ptr()).live)).store(false, Ordering::Release) };
    }

    /// The record as its guard and the shard's readers see it.
    pub(crate) fn view(&self) -> RecordRef<'_> {
        RecordRef {
            runs: &self.runs[..usize::from(self.len)],
            mappings: std::slice::from_ref(&self.mapping),
            pages: self.pages,
            kernel: None,
        }
    }

    /// Fills run `k` (the caller planned the call in `mapping`).
    #[inline(always)]
    pub(crate) fn set_run(&mut self, k: usize, run: PinnedRun) {
        self.runs[k] = run;
    }
}

/// Entries of a shard's small-record array (its free set is one word).
pub(crate) const SMALL_RECORDS: usize = 64;

/// A shard's small records, apart from the shard so that a guard reading its entry never
/// aliases the `&mut Shard` of a thread pinning into another entry.
pub(crate) type SmallRecords = [UnsafeCell<SmallRecord>; SMALL_RECORDS];

/// A live record of either kind, as a guard holds it.
#[derive(Clone, Copy, Debug)]
pub(crate) enum RecordPtr {
    /// A boxed record of any runs.
    Boxed(NonNull<Record>),
    /// An entry of the shard's small-record array.
    Small(NonNull<SmallRecord>),
}

impl RecordPtr {
    /// The record's owner (see [`Owner`]).
    ///
    /// # Safety
    /// The record is live (published and not retired).
    #[inline]
    pub(crate) unsafe fn owner(self) -> Owner {
        match self {
            // SAFETY: (I3, I4) per the contract.
            RecordPtr::Boxed(r) => unsafe { r.as_ref() }.owner,
            // SAFETY: (I3, I4) per the contract.
            RecordPtr::Small(r) => unsafe { r.as_ref() }.owner,
        }
    }

    /// The record.
    ///
    /// # Safety
    /// The record is live (published and not retired) for all of `'a`, which the caller
    /// chooses: it ends the view's use before it retires the record (I3, I4).
    #[inline]
    pub(crate) unsafe fn view<'a>(self) -> RecordRef<'a> {
        match self {
            // SAFETY: (I3, I4) live records are allocated, valid and immutable until retired (the
            // contract).
            RecordPtr::Boxed(r) => unsafe { r.as_ref() }.view(),
            // SAFETY: (I3) as above; a live entry is written only before it is published.
            RecordPtr::Small(r) => unsafe { r.as_ref() }.view(),
        }
    }
}

/// What a live record holds, of either kind.
#[derive(Clone, Copy, Debug)]
pub(crate) struct RecordRef<'a> {
    /// The runs, in call order (`PinnedRun::mapping_index` indexes `mappings`).
    pub(crate) runs: &'a [PinnedRun],
    /// The mappings the runs lie in (see `Record::mappings`).
    mappings: &'a [NonNull<Mapping>],
    /// Pages pinned (entries of the call).
    pub(crate) pages: u64,
    /// Kernel mode: the slots of the runs' buffers (boxed records only).
    pub(crate) kernel: Option<KernelSlots>,
}

impl<'a> RecordRef<'a> {
    /// The mapping of mapping index `i`.
    #[inline]
    pub(crate) fn mapping(&self, i: usize) -> &'a Mapping {
        // SAFETY: (I1) a live record's mappings stay allocated (see `Record::mappings`): for the
        // guard, until it retires or releases the record; for a reader of the shard's records,
        // while it holds the shard's lock (a small record seen live may be released meanwhile,
        // but whatever frees a mapping first marks it and then scans this shard under that
        // lock). A record being filled is asked only by the pin call filling it, under its
        // shard's lock, with pointers it just took from the table, which cannot change.
        unsafe { self.mappings[i].as_ref() }
    }

    /// The mappings the runs lie in.
    #[inline]
    pub(crate) fn mappings(&self) -> impl Iterator<Item = &'a Mapping> + 'a {
        // SAFETY: (I1) as in `mapping`.
        self.mappings.iter().map(|m| unsafe { m.as_ref() })
    }

    /// Pins this record holds in `m`.
    pub(crate) fn pins_in(&self, m: &Mapping) -> u64 {
        let Some(mi) = self.mappings.iter().position(|p| std::ptr::eq(p.as_ptr(), m)) else {
            return 0;
        };
        self.runs.iter().filter(|r| r.mapping_index() == mi).map(|r| r.npages()).sum()
    }
}
