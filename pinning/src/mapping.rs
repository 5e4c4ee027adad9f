//! One DMA mapping: an IOVA range, its host memory, and the pins held on it.
//!
//! Each mapping has its own lock, so pins on different mappings never contend. The per-run
//! operations here are called by the pin layer with that lock held; they keep the table,
//! the mlock state and the lock account consistent with one another.

use std::io;
use std::sync::atomic::{AtomicU32, AtomicU64, AtomicU8, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::Instant;

use smallvec::SmallVec;

use crate::lock::{LockAccount, OverLimit, PinMode};
use crate::mmap::HostMemory;
use crate::page::{iova_of, Prot, PAGE_SIZE};
use crate::slots::PerSlot;
use crate::table::PinTable;

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
/// track mode, pins kept with `PinnedPages::forget`).
#[derive(Debug)]
pub(crate) struct MappingPins {
    pub(crate) table: PinTable,
}

/// Counters of one space, bumped once per call or syscall, never per page.
#[derive(Debug, Default)]
pub(crate) struct Counters {
    pub(crate) pin_calls: AtomicU64,
    pub(crate) pin_failures: AtomicU64,
    pub(crate) unpin_calls: AtomicU64,
    pub(crate) unpin_failures: AtomicU64,
    pub(crate) runs: AtomicU64,
    pub(crate) pages: AtomicU64,
    pub(crate) mlock_calls: AtomicU64,
    pub(crate) munlock_calls: AtomicU64,
    pub(crate) munlock_failures: AtomicU64,
    pub(crate) unmap_waits: AtomicU64,
    pub(crate) unmap_busy: AtomicU64,
    pub(crate) notifier_calls: AtomicU64,
}

/// How the mappings of one space pin, and what they count: shared by all of them.
#[derive(Debug)]
pub(crate) struct PinPolicy {
    pub(crate) mode: PinMode,
    pub(crate) account: Arc<LockAccount>,
    /// Counters, one set per thread slot, summed when read.
    pub(crate) counters: PerSlot<Counters>,
    /// Pins held across the space plus the slots' unused stock, against `max_pins`.
    pub(crate) held: crossbeam::utils::CachePadded<AtomicU64>,
    /// Pins each thread slot has reserved from `held` and not used yet: a call takes from
    /// its slot's stock and touches the shared count only once per [`PIN_STOCK`] pins.
    pub(crate) stock: PerSlot<AtomicU64>,
    pub(crate) max_pins: u64,
}

/// Pins a slot reserves from the space's count at a time.
pub(crate) const PIN_STOCK: u64 = 4096;

impl PinPolicy {
    pub(crate) fn new(mode: PinMode, account: Arc<LockAccount>, max_pins: u64) -> Self {
        PinPolicy {
            mode,
            account,
            counters: PerSlot::default(),
            held: Default::default(),
            stock: PerSlot::default(),
            max_pins,
        }
    }

    /// This thread's counters.
    #[inline]
    pub(crate) fn counters(&self) -> &Counters {
        self.counters.here()
    }

    /// Reserves `pins` under the space's limit; `Err(held)` if they do not fit.
    ///
    /// A call fails only if the pins held plus `pins` exceed `max_pins` (every slot's unused
    /// stock is returned first), counting as held the stock of track-mode slots that are
    /// locked by other calls at that moment, and the pins of small records such a slot has
    /// not taken back yet: near the limit, concurrent calls may be refused up to 16384 pins
    /// per busy slot early (a stock of at most 3 x [`PIN_STOCK`], and
    /// [`crate::slots::SMALL_PINS`]).
    pub(crate) fn reserve(&self, pins: u64) -> Result<(), u64> {
        let stock = self.stock.here();
        if stock.fetch_update(Ordering::AcqRel, Ordering::Acquire, |s| s.checked_sub(pins)).is_ok() {
            return Ok(());
        }
        // Refill the slot with a stock beyond this call, else take just the call's pins.
        if pins.checked_add(PIN_STOCK).is_some_and(|more| self.take(more).is_ok()) {
            stock.fetch_add(PIN_STOCK, Ordering::AcqRel);
            return Ok(());
        }
        if self.take(pins).is_ok() {
            return Ok(());
        }
        self.reclaim_stock();
        self.take(pins)
    }

    /// Takes `pins` from the space's count; `Err(held)` if they do not fit.
    pub(crate) fn take(&self, pins: u64) -> Result<(), u64> {
        self.held
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |held| {
                held.checked_add(pins).filter(|&total| total <= self.max_pins)
            })
            .map(drop)
    }

    /// Gives `pins` back to the space's count.
    pub(crate) fn give(&self, pins: u64) {
        if pins != 0 {
            self.held.fetch_sub(pins, Ordering::AcqRel);
        }
    }

    /// Returns every thread slot's unused stock (of [`PinPolicy::reserve`]) to the space.
    pub(crate) fn reclaim_stock(&self) {
        for s in self.stock.all() {
            self.give(s.swap(0, Ordering::AcqRel));
        }
    }

    /// Returns pins reserved earlier, to this thread's stock (the surplus beyond two
    /// stocks' worth back to the space).
    pub(crate) fn release(&self, pins: u64) {
        let stock = self.stock.here();
        if stock.fetch_add(pins, Ordering::AcqRel) + pins > 2 * PIN_STOCK {
            if let Ok(had) = stock
                .fetch_update(Ordering::AcqRel, Ordering::Acquire, |s| (s > PIN_STOCK).then_some(PIN_STOCK))
            {
                self.held.fetch_sub(had - PIN_STOCK, Ordering::AcqRel);
            }
        }
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
    pins: Mutex<MappingPins>,
    /// A [`MappingState`]. Changed under the lock; read without it by track-mode pins, which
    /// check it under their slot's lock (see `slots`).
    state: AtomicU8,
    /// Signalled when an unmapping mapping's last pin drops.
    drained: Condvar,
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
            pins: Mutex::new(MappingPins { table: PinTable::default() }),
            state: AtomicU8::new(MappingState::Live as u8),
            drained: Condvar::new(),
            claims: AtomicU32::new(0),
        }
    }

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

    /// One past the last page number.
    pub(crate) fn end_pfn(&self) -> u64 {
        self.first_pfn + self.npages
    }

    pub(crate) fn contains(&self, pfn: u64) -> bool {
        pfn >= self.first_pfn && pfn < self.end_pfn()
    }

    /// Host address of page offset `page`, for fd-backed mappings.
    pub(crate) fn host_addr(&self, page: u64) -> Option<usize> {
        self.memory.as_ref().map(|m| m.addr_at(page * PAGE_SIZE))
    }

    /// True once the client truncated the file behind the mapping (see `sigbus`).
    pub(crate) fn poisoned(&self) -> bool {
        self.memory.as_ref().is_some_and(|m| m.poisoned())
    }

    fn hugetlb(&self) -> bool {
        self.memory.as_ref().is_some_and(|m| m.backing().hugetlb)
    }

    /// Takes the pin state for an unmap: a lock-mode pin call holding it gives way at its
    /// next mlock piece instead of finishing a long run first.
    pub(crate) fn lock_for_unmap(&self) -> MutexGuard<'_, MappingPins> {
        self.claims.fetch_add(1, Ordering::AcqRel);
        let pins = self.lock();
        self.claims.fetch_sub(1, Ordering::AcqRel);
        pins
    }

    /// Locks the pin state. A poisoned lock means a panic mid-update elsewhere; the
    /// table is still the best record of what is pinned, so keep using it.
    pub(crate) fn lock(&self) -> MutexGuard<'_, MappingPins> {
        crate::sync::lock(&self.pins)
    }

    /// Adds a pin to pages `[page, page + npages)`; in lock mode, locks and charges the
    /// pages going from 0 to 1 first. On failure nothing has changed.
    pub(crate) fn pin_run(&self, pins: &mut MappingPins, page: u64, npages: u64) -> Result<(), RunFailure> {
        if self.policy.mode == PinMode::Track {
            // The hot path: one pass over the counts.
            return pins
                .table
                .try_increment(page, npages)
                .map(drop)
                .map_err(|page| RunFailure::Overflow { page });
        }
        if npages == 1 {
            // One page, the usual lock-mode call: one look at its count.
            let count = pins.table.count(page);
            if count == crate::table::MAX_PIN_COUNT {
                return Err(RunFailure::Overflow { page });
            }
            if count == 0 {
                self.lock_fresh(&[(page, 1)])?;
            }
            pins.table.increment_one(page);
            return Ok(());
        }
        if let Some(page) = pins.table.find_saturated(page, npages) {
            return Err(RunFailure::Overflow { page });
        }
        let mut fresh: Released = SmallVec::new();
        pins.table.for_each_unpinned(page, npages, |s, l| fresh.push((s, l)));
        self.lock_fresh(&fresh)?;
        pins.table.increment(page, npages);
        Ok(())
    }

    /// Charges and mlocks sub-runs that are about to get their first pin.
    fn lock_fresh(&self, fresh: &[(u64, u64)]) -> Result<(), RunFailure> {
        let Some(&(first, _)) = fresh.first() else {
            return Ok(());
        };
        let bytes = fresh.iter().map(|&(_, l)| l).sum::<u64>() * PAGE_SIZE;
        let account = &self.policy.account;
        account.charge(bytes).map_err(|over| RunFailure::OverLimit { page: first, over })?;
        let Some(memory) = self.memory.as_ref().filter(|_| !self.hugetlb()) else {
            return Ok(()); // hugetlb: never swapped, accounted only.
        };
        let counters = self.policy.counters();
        for (k, &(start, len)) in fresh.iter().enumerate() {
            let mut page = start;
            while page < start + len {
                let failure = if self.claims.load(Ordering::Acquire) != 0 {
                    Some(RunFailure::Unmapping { page })
                } else {
                    let n = MLOCK_PIECE.min(start + len - page);
                    counters.mlock_calls.fetch_add(1, Ordering::Relaxed);
                    match memory.mlock(page * PAGE_SIZE, n * PAGE_SIZE) {
                        Ok(()) => {
                            page += n;
                            None
                        }
                        Err(error) => Some(RunFailure::Lock { page, error }),
                    }
                };
                if let Some(failure) = failure {
                    // Undo what is locked: the sub-runs before this one, and this one up to
                    // `page`.
                    for &(s, l) in &fresh[..k] {
                        self.munlock(memory, s, l);
                    }
                    if page > start {
                        self.munlock(memory, start, page - start);
                    }
                    account.refund(bytes);
                    return Err(failure);
                }
            }
        }
        Ok(())
    }

    /// Removes a pin from pages `[page, page + npages)` unless one of them is not pinned;
    /// then returns that page and changes nothing. Sub-runs that reach 0 are appended to
    /// `released` (lock mode only) for [`Mapping::release`].
    pub(crate) fn try_unpin_run(
        &self,
        pins: &mut MappingPins,
        page: u64,
        npages: u64,
        released: &mut Released,
    ) -> Result<(), u64> {
        if self.policy.mode == PinMode::Track {
            // The hot path: one checked pass over the counts.
            return pins.table.try_decrement(page, npages).map(drop);
        }
        if npages == 1 {
            // One page: one checked pass, and it goes to munlock if that was its last pin.
            if pins.table.try_decrement_one(page)? {
                released.push((page, 1));
            }
            return Ok(());
        }
        if let Some(page) = pins.table.find_unpinned(page, npages) {
            return Err(page);
        }
        pins.table.decrement(page, npages, Some(&mut |s, l| released.push((s, l))));
        Ok(())
    }

    /// Removes a pin from pages `[page, page + npages)`, which the caller has checked are
    /// all pinned. Sub-runs that reach 0 are appended to `released` (lock mode only) for
    /// [`Mapping::release`].
    pub(crate) fn unpin_run(&self, pins: &mut MappingPins, page: u64, npages: u64, released: &mut Released) {
        if self.policy.mode == PinMode::Lock {
            pins.table.decrement(page, npages, Some(&mut |s, l| released.push((s, l))));
        } else {
            pins.table.decrement(page, npages, None);
        }
    }

    /// munlocks and refunds sub-runs collected by [`Mapping::unpin_run`], then wakes an
    /// unmap waiting for this mapping to drain.
    pub(crate) fn release(&self, pins: &MappingPins, released: &[(u64, u64)]) {
        if !released.is_empty() {
            let pages: u64 = released.iter().map(|&(_, l)| l).sum();
            if let Some(memory) = self.memory.as_ref().filter(|_| !self.hugetlb()) {
                for &(s, l) in released {
                    self.munlock(memory, s, l);
                }
            }
            self.policy.account.refund(pages * PAGE_SIZE);
        }
        // Unmapping, or taken by abandon_all while an unmap waited: wake the waiter.
        if self.state() != MappingState::Live && pins.table.pins() == 0 {
            self.drained.notify_all();
        }
    }

    fn munlock(&self, memory: &HostMemory, page: u64, npages: u64) {
        let counters = self.policy.counters();
        counters.munlock_calls.fetch_add(1, Ordering::Relaxed);
        if let Err(e) = memory.munlock(page * PAGE_SIZE, npages * PAGE_SIZE) {
            // The pages stay resident until the mapping goes; nothing else is wrong.
            counters.munlock_failures.fetch_add(1, Ordering::Relaxed);
            log::warn!("munlock of {npages} pages at IOVA {:#x} failed: {e}", iova_of(self.first_pfn + page));
        }
    }

    /// Waits until no pins are held or `deadline` passes; returns the pins left.
    pub(crate) fn wait_drained(&self, deadline: Instant) -> u64 {
        let mut pins = self.lock();
        loop {
            let left = pins.table.pins();
            let now = Instant::now();
            if left == 0 || now >= deadline {
                return left;
            }
            pins = crate::sync::wait_timeout(&self.drained, pins, deadline - now).0;
        }
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        let pins =
            self.pins.get_mut().map(|p| p.table.pins()).unwrap_or_else(|p| p.into_inner().table.pins());
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
