//! One DMA mapping: an IOVA range, its host memory, and the pins held on it.
//!
//! Each mapping has its own lock, so pins on different mappings never contend. The per-run
//! operations here are called by the pin layer with that lock held; they keep the table,
//! the mlock state and the lock account consistent with one another.

use std::io;
use std::sync::atomic::{AtomicU32, AtomicU64, AtomicU8, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Instant;

use smallvec::SmallVec;

use crate::account::{OverLimit, PinMode};
use crate::budget::PinPolicy;
use crate::budget::PIN_STOCK;
use crate::counters::Counts;
use crate::mmap::HostMemory;
use crate::page::{iova_of, Prot, PAGE_SIZE};
use crate::page_counts::PageCounts;
use crate::run::PinnedRun;
use crate::spin::{SpinGuard, SpinLock};

/// Where a mapping is in its life.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum MappingState {
    /// In the DMA space; pins are granted.
    Live,
    /// An unmap is waiting for its pins to drop; no new pins are granted.
    Unmapping,
    /// Gone from the DMA space; it lives on only while guards reference it.
    Removed,
}

impl MappingState {
    fn from_u8(v: u8) -> Self {
        match v {
            0 => MappingState::Live,
            1 => MappingState::Unmapping,
            _ => MappingState::Removed,
        }
    }
}

/// The part of a mapping guarded by its lock: per-page counts (every pin in lock mode; in
/// track mode, pins kept with `PinnedPages::forget`), and what lock-mode calls keep here
/// because they hold this lock anyway.
#[derive(Debug, Default)]
pub(crate) struct MappingPins {
    pub(crate) page_counts: PageCounts,
    /// Pins reserved from the space's limit and not used yet, for lock-mode calls whose first
    /// run lies here: such a call takes its pins from here and gives them back here, touching
    /// the space's shared count once per [`PIN_STOCK`] pins.
    pub(crate) stock: u64,
    /// Lock-mode calls' counts, plain under the lock (a shared atomic costs as much as a
    /// lock); summed by `stats`, moved to the space's when the mapping leaves the table.
    pub(crate) counts: Counts,
    /// Set as the mapping leaves the table: from then on pins given back go straight to the
    /// space's count (a guard may keep a removed mapping alive for long).
    pub(crate) left: bool,
    /// Kernel mode: registered buffers of forgotten guards whose runs lie here. Their pins
    /// are counted in `page_counts`, one per page per buffer, and nothing else is (kernel
    /// mode counts no other pin per page): a page's count is the number of kept buffers
    /// holding it. Boxed: one word in every mapping, which most never use.
    #[expect(clippy::box_collection, reason = "one word here instead of a Vec's three")]
    pub(crate) kept: Option<Box<Vec<KeptBuffer>>>,
    /// Lock mode: the pins of forgotten guards, per page, a part of `page_counts` (which
    /// also counts live guards' pins). `unpin_pages` takes only these, so that it cannot
    /// take a live guard's pin (which that guard's drop would then take from someone else's).
    /// Boxed, as `kept`.
    pub(crate) kept_counts: Option<Box<PageCounts>>,
}

/// Kernel mode: a registered buffer whose guard was forgotten (`PinnedPages::forget`). It is
/// let go once `unpin_pages` has taken back the pin of each of its pages; until then the
/// kernel keeps all of them pinned.
#[derive(Debug)]
pub(crate) struct KeptBuffer {
    /// Its slot in the space's kernel table.
    pub(crate) slot: u32,
    /// Its first page (offset within the mapping) and pages.
    first: u64,
    npages: u64,
    /// Bit `k`: the pin of page `first + k` is still held by this buffer.
    held: Vec<u64>,
    /// Pages still held.
    left: u64,
}

impl KeptBuffer {
    fn new(slot: u32, first: u64, npages: u64) -> Self {
        let mut held = vec![!0u64; npages.div_ceil(64) as usize];
        if !npages.is_multiple_of(64) {
            *held.last_mut().expect("a buffer holds a page") = (1 << (npages % 64)) - 1;
        }
        KeptBuffer { slot, first, npages, held, left: npages }
    }

    /// Takes back the pin of `page` if this buffer still holds it.
    fn take(&mut self, page: u64) -> bool {
        let Some(k) = page.checked_sub(self.first).filter(|&k| k < self.npages) else {
            return false;
        };
        let (word, bit) = ((k / 64) as usize, k % 64);
        if self.held[word] & (1 << bit) == 0 {
            return false;
        }
        self.held[word] &= !(1 << bit);
        self.left -= 1;
        true
    }
}

impl MappingPins {
    /// Kernel mode: keeps the buffers of a forgotten guard's run of `npages` pages from
    /// `page`, registered in slots from `slot`; the slots it took (a buffer per GiB).
    pub(crate) fn keep_buffers(&mut self, slot: u32, page: u64, npages: u64) -> u32 {
        let mut taken = 0;
        let mut done = 0;
        while done < npages {
            let n = (npages - done).min(crate::kernel::KERNEL_BUFFER_PAGES);
            self.kept.get_or_insert_default().push(KeptBuffer::new(slot + taken, page + done, n));
            taken += 1;
            done += n;
        }
        taken
    }

    /// Forgets the kept buffers in slots `slots` again (a forget that failed part-way).
    pub(crate) fn unkeep_slots(&mut self, slots: std::ops::Range<u32>) {
        if let Some(kept) = self.kept.as_mut() {
            kept.retain(|k| !slots.contains(&k.slot));
        }
    }

    /// Kernel mode: takes back one kept pin of each page of `[page, page + npages)` (whose
    /// counts the caller has just taken one from), from the first kept buffer holding it;
    /// buffers left holding nothing are removed and their `(slot, pages)` appended to
    /// `done`, for the caller to let go of.
    pub(crate) fn take_kept(&mut self, page: u64, npages: u64, done: &mut Vec<(u32, u64)>) {
        let Some(kept) = self.kept.as_mut() else {
            debug_assert!(false, "kernel mode: counted pages have kept buffers");
            return;
        };
        for p in page..page + npages {
            let at = kept.iter_mut().position(|k| k.take(p));
            debug_assert!(at.is_some(), "kernel mode: a counted page {p} has a kept buffer");
            if let Some(at) = at.filter(|&at| kept[at].left == 0) {
                let gone = kept.swap_remove(at);
                done.push((gone.slot, gone.npages));
            }
        }
    }

    /// Reserves `pins` for a lock-mode call whose first run lies in this mapping (locked by
    /// the caller): from the stock, refilled from the space's count when short; `Err(held)`
    /// if the space's count cannot give them. A mapping that has left the table keeps no
    /// stock: its calls take exactly their pins.
    ///
    /// The caller, refused, takes back every mapping's unused stock and tries once more, so
    /// a call fails only if the pins held, plus stock taken by other calls meanwhile, leave
    /// no room.
    pub(crate) fn reserve(&mut self, policy: &PinPolicy, pins: u64) -> Result<(), u64> {
        if let Some(left) = self.stock.checked_sub(pins) {
            self.stock = left;
            return Ok(());
        }
        // The stock goes into the call; the count gives the rest, and a new stock if it can.
        let short = pins - self.stock;
        let refill = if self.left { None } else { short.checked_add(PIN_STOCK) };
        if refill.is_some_and(|more| policy.take(more).is_ok()) {
            self.stock = PIN_STOCK;
            return Ok(());
        }
        policy.take(short)?;
        self.stock = 0;
        Ok(())
    }

    /// Returns pins reserved with [`MappingPins::reserve`] to the stock (the surplus beyond
    /// two stocks' worth, or all of it once the mapping has left the table, to the space).
    pub(crate) fn restock(&mut self, policy: &PinPolicy, pins: u64) {
        if self.left {
            policy.give(pins);
            return;
        }
        self.stock += pins;
        if self.stock > 2 * PIN_STOCK {
            policy.give(self.stock - PIN_STOCK);
            self.stock = PIN_STOCK;
        }
    }
}

/// Wakes an unmap waiting for a mapping's pins to drop (DESIGN.md I7). An event count: the
/// waiter reads the epoch before it looks at the pins and sleeps only if no signal came
/// since, so a signal between its look and its sleep is never lost. The mutex is a leaf
/// lock (held for nothing but the check and the notify), so a signal may be sent under
/// any other lock.
#[derive(Debug, Default)]
pub(crate) struct Drained {
    epoch: AtomicU64,
    lock: Mutex<()>,
    cv: Condvar,
}

impl Drained {
    /// The epoch to pass to [`Drained::wait`]; read before looking at the pins.
    pub(crate) fn epoch(&self) -> u64 {
        self.epoch.load(Ordering::SeqCst)
    }

    /// Wakes every waiter: pins of the mapping went (the caller changed them first).
    pub(crate) fn signal(&self) {
        self.epoch.fetch_add(1, Ordering::SeqCst);
        let _held = crate::sync::lock(&self.lock);
        self.cv.notify_all();
    }

    /// Sleeps until a signal after epoch `seen`, or `until`.
    pub(crate) fn wait(&self, seen: u64, until: Instant) {
        let held = crate::sync::lock(&self.lock);
        let now = Instant::now();
        if self.epoch.load(Ordering::SeqCst) != seen || now >= until {
            return;
        }
        drop(crate::sync::wait_timeout(&self.cv, held, until - now));
    }
}

/// Why pinning one run failed; `page` is the page offset within the mapping.
#[derive(Debug)]
pub(crate) enum RunFailure {
    Overflow {
        page: u64,
    },
    OverLimit {
        page: u64,
        over: OverLimit,
    },
    Lock {
        page: u64,
        error: io::Error,
    },
    /// An unmap wants the mapping: a long lock-mode pin gives way (all-or-nothing).
    Unmapping {
        page: u64,
    },
}

/// Lock mode mlocks a fresh run in pieces of at most this many pages (1 MiB), checking
/// between pieces whether an unmap is waiting for the mapping: an unmap never waits longer
/// than one piece for a pin call, however long the run.
pub(crate) const MLOCK_PIECE: u64 = 256;

/// Sub-runs `(page offset, pages)` whose last pin was dropped, awaiting munlock.
pub(crate) type Released = SmallVec<[(u64, u64); 2]>;

#[derive(Debug)]
pub(crate) struct Mapping {
    /// Unique within the process; orders lock acquisition when a call spans mappings.
    pub(crate) id: u64,
    pub(crate) first_pfn: u64,
    pub(crate) npages: u64,
    pub(crate) prot: Prot,
    /// `None` for a region the client mapped without an fd: known, but not pinnable.
    pub(crate) memory: Option<HostMemory>,
    pub(crate) policy: Arc<PinPolicy>,
    /// A swap lock, not a futex mutex: every lock-mode pin and drop takes it, and its release
    /// is a plain store (see `spin`). Lock-mode holds include mlock and munlock calls
    /// (a page's take microseconds, a piece's at most a millisecond or so): waiters spin,
    /// yield, then nap.
    pins: SpinLock<MappingPins>,
    /// A [`MappingState`]. Changed under the lock; read without it by track-mode pins, which
    /// check it under their shard's lock (see `shards`).
    state: AtomicU8,
    /// Signalled when pins of a mapping that is no longer live drop (I7).
    pub(crate) drained: Drained,
    /// Unmaps waiting to claim the mapping (set before they take its lock): a lock-mode pin
    /// in progress stops at its next piece and fails `Unmapping`.
    claims: AtomicU32,
}

static NEXT_MAPPING_ID: AtomicU64 = AtomicU64::new(1);

impl Mapping {
    pub(crate) fn new(
        first_pfn: u64,
        npages: u64,
        prot: Prot,
        memory: Option<HostMemory>,
        policy: Arc<PinPolicy>,
    ) -> Self {
        Mapping {
            id: NEXT_MAPPING_ID.fetch_add(1, Ordering::Relaxed),
            first_pfn,
            npages,
            prot,
            memory,
            policy,
            pins: SpinLock::default(),
            state: AtomicU8::new(MappingState::Live as u8),
            drained: Drained::default(),
            claims: AtomicU32::new(0),
        }
    }

    #[inline]
    pub(crate) fn iova(&self) -> u64 {
        iova_of(self.first_pfn)
    }

    /// Where the mapping is in its life.
    #[inline]
    pub(crate) fn state(&self) -> MappingState {
        MappingState::from_u8(self.state.load(Ordering::SeqCst))
    }

    /// Moves the mapping to `state`; the caller holds its lock.
    pub(crate) fn set_state(&self, _locked: &mut MappingPins, state: MappingState) {
        self.state.store(state as u8, Ordering::SeqCst);
    }

    pub(crate) fn size(&self) -> u64 {
        self.npages * PAGE_SIZE
    }

    /// The first page of `run` (which lies in this mapping) as an offset within it.
    #[inline]
    pub(crate) fn run_page(&self, run: &PinnedRun) -> u64 {
        run.page_in(self.first_pfn)
    }

    /// One past the last page number.
    #[inline]
    pub(crate) fn end_pfn(&self) -> u64 {
        self.first_pfn + self.npages
    }

    #[inline]
    pub(crate) fn contains(&self, pfn: u64) -> bool {
        pfn >= self.first_pfn && pfn < self.end_pfn()
    }

    /// Host address of page offset `page`, for fd-backed mappings.
    #[inline]
    pub(crate) fn host_addr(&self, page: u64) -> Option<usize> {
        self.memory.as_ref().map(|m| m.addr_at(page * PAGE_SIZE))
    }

    /// True once the client truncated the file behind the mapping (see `sigbus`).
    #[inline]
    pub(crate) fn poisoned(&self) -> bool {
        self.memory.as_ref().is_some_and(|m| m.poisoned())
    }

    fn hugetlb(&self) -> bool {
        self.memory.as_ref().is_some_and(|m| m.backing().hugetlb)
    }

    /// Whether an unmap is waiting for this mapping's lock ([`Mapping::lock_for_unmap`]).
    pub(crate) fn claimed(&self) -> bool {
        self.claims.load(Ordering::Acquire) != 0
    }

    /// Raises the claim an unmap waiting for the lock raises, for a test to stand in for one.
    #[cfg(test)]
    pub(crate) fn claim_for_test(&self) {
        self.claims.fetch_add(1, Ordering::AcqRel);
    }

    /// Takes the pin state for an unmap: a lock-mode pin call holding it gives way at its
    /// next mlock piece instead of finishing a long run first (in this mapping or in any
    /// other whose lock the call holds).
    pub(crate) fn lock_for_unmap(&self) -> SpinGuard<'_, MappingPins> {
        self.claims.fetch_add(1, Ordering::AcqRel);
        let pins = self.lock();
        self.claims.fetch_sub(1, Ordering::AcqRel);
        pins
    }

    /// Locks the pin state. A holder that panicked let go as it unwound; the table is still
    /// the best record of what is pinned, so keep using it.
    #[inline]
    pub(crate) fn lock(&self) -> SpinGuard<'_, MappingPins> {
        self.pins.lock()
    }

    /// Adds a pin to pages `[page, page + npages)`; in lock mode, locks and charges the
    /// pages going from 0 to 1 first. On failure nothing has changed.
    #[inline]
    /// `claimed`: whether an unmap claims any mapping whose lock the call holds (not only
    /// this one), at which a long lock-mode run gives way.
    pub(crate) fn pin_run(
        &self,
        pins: &mut MappingPins,
        page: u64,
        npages: u64,
        claimed: &dyn Fn() -> bool,
    ) -> Result<(), RunFailure> {
        if self.policy.mode != PinMode::Lock {
            // The hot path: one pass over the counts.
            return pins
                .page_counts
                .try_increment(page, npages)
                .map(drop)
                .map_err(|page| RunFailure::Overflow { page });
        }
        if npages == 1 {
            // One page, the usual lock-mode call: one look at its count.
            let count = pins.page_counts.count(page);
            if count == crate::page_counts::MAX_PIN_COUNT {
                return Err(RunFailure::Overflow { page });
            }
            if count == 0 {
                self.lock_fresh(&mut pins.counts, &[(page, 1)], claimed)?;
            }
            pins.page_counts.increment_one(page);
            return Ok(());
        }
        if let Some(page) = pins.page_counts.find_saturated(page, npages) {
            return Err(RunFailure::Overflow { page });
        }
        let mut fresh: Released = SmallVec::new();
        pins.page_counts.for_each_unpinned(page, npages, |s, l| fresh.push((s, l)));
        self.lock_fresh(&mut pins.counts, &fresh, claimed)?;
        pins.page_counts.increment(page, npages);
        Ok(())
    }

    /// Charges and mlocks sub-runs that are about to get their first pin.
    fn lock_fresh(
        &self,
        counts: &mut Counts,
        fresh: &[(u64, u64)],
        claimed: &dyn Fn() -> bool,
    ) -> Result<(), RunFailure> {
        let Some(&(first, _)) = fresh.first() else {
            return Ok(());
        };
        let bytes = fresh.iter().map(|&(_, l)| l).sum::<u64>() * PAGE_SIZE;
        let account = &self.policy.account;
        account.charge(bytes).map_err(|over| RunFailure::OverLimit { page: first, over })?;
        let Some(memory) = self.memory.as_ref().filter(|_| !self.hugetlb()) else {
            return Ok(()); // hugetlb: never swapped, accounted only.
        };
        for (k, &(start, len)) in fresh.iter().enumerate() {
            let mut page = start;
            while page < start + len {
                // On failure: the failure, and the pages from `page` to unlock too.
                let failure = if claimed() {
                    Some((RunFailure::Unmapping { page }, 0))
                } else {
                    let n = MLOCK_PIECE.min(start + len - page);
                    counts.mlock_calls += 1;
                    match memory.mlock(page * PAGE_SIZE, n * PAGE_SIZE) {
                        Ok(()) => {
                            page += n;
                            None
                        }
                        // mlock marks the whole piece locked before it faults the pages in,
                        // and keeps what it faulted locked when it fails (a page past the
                        // end of a file the client truncated): the piece is undone too.
                        Err(error) => Some((RunFailure::Lock { page, error }, n)),
                    }
                };
                if let Some((failure, tried)) = failure {
                    // Undo what is locked: the sub-runs before this one, and this one up to
                    // `page` and through the piece that failed.
                    for &(s, l) in &fresh[..k] {
                        self.munlock(counts, memory, s, l);
                    }
                    if page + tried > start {
                        self.munlock(counts, memory, start, page + tried - start);
                    }
                    account.refund(bytes);
                    return Err(failure);
                }
            }
        }
        Ok(())
    }

    /// Removes a pin from pages `[page, page + npages)` unless one of them is not pinned;
    /// then returns that page and changes nothing. The one check of every unpin (I12).
    /// Sub-runs that reach 0 are appended to `released` (lock mode only) for
    /// [`Mapping::release`].
    #[inline]
    pub(crate) fn try_unpin_run(
        &self,
        pins: &mut MappingPins,
        page: u64,
        npages: u64,
        released: &mut Released,
    ) -> Result<(), u64> {
        let mut munlock = |start, len| released.push((start, len));
        let report: Option<&mut dyn FnMut(u64, u64)> =
            if self.policy.mode == PinMode::Lock { Some(&mut munlock) } else { None };
        pins.page_counts.try_decrement(page, npages, report).map(drop)
    }

    /// munlocks and refunds sub-runs collected by [`Mapping::try_unpin_run`], then wakes an
    /// unmap waiting for this mapping to drain.
    pub(crate) fn release(&self, pins: &mut MappingPins, released: &[(u64, u64)]) {
        if !released.is_empty() {
            let pages: u64 = released.iter().map(|&(_, l)| l).sum();
            if let Some(memory) = self.memory.as_ref().filter(|_| !self.hugetlb()) {
                for &(s, l) in released {
                    self.munlock(&mut pins.counts, memory, s, l);
                }
            }
            self.policy.account.refund(pages * PAGE_SIZE);
        }
        // Unmapping, or taken by abandon_all while an unmap waited: wake the waiter (I7).
        if self.state() != MappingState::Live {
            self.drained.signal();
        }
    }

    fn munlock(&self, counts: &mut Counts, memory: &HostMemory, page: u64, npages: u64) {
        counts.munlock_calls += 1;
        if let Err(e) = memory.munlock(page * PAGE_SIZE, npages * PAGE_SIZE) {
            // The pages stay resident until the mapping goes; nothing else is wrong.
            counts.munlock_failures += 1;
            log::warn!("munlock of {npages} pages at IOVA {:#x} failed: {e}", iova_of(self.first_pfn + page));
        }
    }

    /// Called as the mapping leaves the space's table (with the table's write lock held, so
    /// that `stats` sees its counts either here or in the space's): gives its lock-mode
    /// stock back to the space and moves its counts to the space's (I9).
    pub(crate) fn leave_table(&self, pins: &mut MappingPins) {
        pins.left = true;
        self.policy.give(std::mem::take(&mut pins.stock));
        self.policy.add_departed(&std::mem::take(&mut pins.counts));
        // After the move and under the mapping's lock: see `PinPolicy::departures`.
        self.policy.departures.fetch_add(1, Ordering::Release);
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        let state = self.pins.get_mut();
        let pins = state.page_counts.pins();
        // What guards dropped after the mapping left the table gave back and counted.
        let (stock, counts) = (std::mem::take(&mut state.stock), std::mem::take(&mut state.counts));
        self.policy.give(stock);
        self.policy.add_departed(&counts);
        if pins != 0 {
            if let Some(memory) = self.memory.take() {
                // Pins taken without a guard were never returned: their holder may still use
                // the memory, so it is leaked rather than unmapped under them.
                log::error!(
                    "mapping at IOVA {:#x} dropped with {pins} pins held; leaking its memory",
                    self.iova()
                );
                std::mem::forget(memory);
            }
        }
    }
}
