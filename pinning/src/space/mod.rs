//! A client's DMA space: its IOVA mappings, and the map/unmap side of pinning.
//!
//! The mapping table lives in the shard table (`shard_table`): a pin reads it under its
//! thread's shard lock, a map or unmap changes it under all of them. Track-mode pins are
//! records in the shards; per-page counts (lock mode, kept pins) live in each mapping under
//! its own lock. Unmap never removes a mapping that holds pins: it marks it so new pins are
//! refused, asks the device to let go (the unmap notifier, called with no engine lock held),
//! and waits a bounded time, woken as the pins drop (DESIGN.md I6, I7).
//!
//! A space outlives its handles while guards hold records in it (I8): `SpaceHandle` is the
//! users' share, `SpaceInner` what the shards keep alive.

use std::any::Any;
use std::ops::Deref;
use std::os::fd::BorrowedFd;
use std::sync::atomic::AtomicBool;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, RwLock, Weak};
use std::time::{Duration, Instant};

mod config;
#[cfg(test)]
mod tests;

pub use config::{
    DmaSpaceConfig, DmaStats, MapError, MappingInfo, UnmapError, UnmapNotifier, Unmapped,
    DEFAULT_MAX_MAPPED_BYTES,
};

use crate::account::{LockAccount, PinMode};
use crate::budget::PinPolicy;
use crate::counters::Counts;
use crate::kernel::KernelPinsUnavailable;
use crate::mapping::{Mapping, MappingState};
use crate::mmap::{HostMemory, SpaceCharge};
use crate::page::{is_page_aligned, pfn_of, Prot, PAGE_SIZE};
use crate::reaper::Reap;
use crate::shard_table::{MappingTable, ShardTable, TableRead, TableWrite};

/// How often an unmap waiting for pins looks again while small records it saw live may be
/// let go of without a word (I7). Every other release wakes it.
const RELOOK: Duration = Duration::from_millis(1);

pub(crate) struct SpaceInner {
    pub(crate) config: DmaSpaceConfig,
    pub(crate) policy: Arc<PinPolicy>,
    /// Mappings by first page number, and the track-mode pin records, behind one lock per
    /// thread shard (see `shards`).
    pub(crate) shards: ShardTable,
    notifier: RwLock<Option<UnmapNotifier>>,
    /// Set once every `DmaSpace` handle is gone: shards then let go of the space as their
    /// last record retires.
    pub(crate) closed: AtomicBool,
    /// Mappings `abandon_all` took while records still named them: kept until the space goes.
    orphans: Mutex<Vec<Arc<Mapping>>>,
    /// Bytes of fd-backed mappings whose memory is still mapped, abandoned ones included
    /// (each mapping's memory gives its share back as it is unmapped): bounded by
    /// `config.max_mapped_bytes`.
    mapped_bytes: Arc<std::sync::atomic::AtomicU64>,
}

impl SpaceInner {
    /// Lets go of abandoned mappings no record names any more (their memory is unmapped).
    /// Called as records naming them retire, and at each map and unmap: a guard that let go
    /// without its shard's lock just as abandon_all looked leaves its mapping here until then.
    pub(crate) fn prune_orphans(&self) {
        let gone: Vec<Arc<Mapping>> = {
            let mut orphans = crate::sync::lock(&self.orphans);
            if orphans.is_empty() {
                return;
            }
            let (keep, gone): (Vec<_>, Vec<_>) =
                orphans.drain(..).partition(|m| self.shards.pins_in(m).pins != 0);
            *orphans = keep;
            gone
        };
        drop(gone);
    }

    /// Makes every shard without live records let go of the space; true if some shard still
    /// holds it. The caller holds a reference of its own (a shard's may be the last but it).
    pub(crate) fn release_idle_shards(&self) -> bool {
        let mut holding = false;
        self.shards.for_each_shard(|shard| {
            if shard.is_empty() {
                drop(shard.keepalive.take());
            }
            holding |= shard.keepalive.is_some();
        });
        holding
    }

    /// Counts an event in this thread's shard. The thread must hold no shard lock.
    pub(crate) fn count(&self, event: impl FnOnce(&mut Counts)) {
        event(&mut self.shards.counts_here().counts);
    }

    /// Starts the reaper on this space (I8).
    fn watch(self: &Arc<Self>) {
        let weak: Weak<dyn Reap> = Arc::downgrade(self) as Weak<dyn Reap>;
        crate::reaper::watch(weak);
    }
}

impl Reap for SpaceInner {
    /// Lets go of orphans no record names, and, once the space is closed, makes idle shards
    /// let go of it. True if there is more to wait for (orphans still named, or shards still
    /// holding a closed space).
    fn reap(&self) -> bool {
        self.prune_orphans();
        let orphans = !crate::sync::lock(&self.orphans).is_empty();
        let holding = self.closed.load(Ordering::SeqCst) && self.release_idle_shards();
        orphans || holding
    }
}

/// The space a shard keeps alive, as the shard stores it (I4).
pub(crate) fn keepalive(space: &Arc<SpaceInner>) -> Arc<dyn Any + Send + Sync> {
    Arc::clone(space) as Arc<dyn Any + Send + Sync>
}

/// The users' share of a space: when the last handle goes, the space closes, and lives on
/// only while track-mode guards still hold records in it.
pub(crate) struct SpaceHandle {
    pub(crate) space: Arc<SpaceInner>,
}

impl Deref for SpaceHandle {
    type Target = SpaceInner;
    fn deref(&self) -> &SpaceInner {
        &self.space
    }
}

impl Drop for SpaceHandle {
    fn drop(&mut self) {
        // From here on a shard's last retiring record lets go of the space; shards without
        // records let go now. (No pin can start: there is no handle to call it on.)
        self.space.closed.store(true, Ordering::SeqCst);
        if self.space.reap() {
            // Guards still hold records: the last to retire under its shard's lock lets go
            // of the space, and the reaper catches one released without the lock (I8).
            self.space.watch();
        }
    }
}

/// A client's IOVA space and the pins devices hold in it. Cheap to clone: clones share it.
#[derive(Clone)]
pub struct DmaSpace {
    pub(crate) inner: Arc<SpaceHandle>,
}

impl std::fmt::Debug for DmaSpace {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DmaSpace").field("mode", &self.inner.policy.mode).finish_non_exhaustive()
    }
}

impl Default for DmaSpace {
    fn default() -> Self {
        Self::new(DmaSpaceConfig::default())
    }
}

impl DmaSpace {
    /// An empty space.
    ///
    /// In [`PinMode::Kernel`] the space sets up its io_uring; where that fails (see
    /// [`crate::kernel_pins_available`]) the space is made all the same, logs why, and each of
    /// its pins fails with [`crate::PinError::KernelUnavailable`]. [`DmaSpace::try_new`]
    /// fails instead.
    pub fn new(config: DmaSpaceConfig) -> Self {
        let space = Self::build(config);
        if let Some(Err(why)) = space.inner.policy.kernel() {
            log::error!("a kernel-mode DMA space cannot pin: {why}");
        }
        space
    }

    /// An empty space, or why its pin mode cannot work here: kernel mode without io_uring
    /// buffer registration. The other modes always succeed.
    pub fn try_new(config: DmaSpaceConfig) -> Result<Self, KernelPinsUnavailable> {
        let space = Self::build(config);
        if let Some(Err(why)) = space.inner.policy.kernel() {
            return Err(why.clone());
        }
        Ok(space)
    }

    fn build(mut config: DmaSpaceConfig) -> Self {
        config.max_pages_per_call = config.max_pages_per_call.min(u64::from(u32::MAX));
        let policy = Arc::new(PinPolicy::new(
            config.mode,
            config.account.clone(),
            config.max_pins,
            config.kernel_buffers,
        ));
        let inner = SpaceInner {
            config,
            policy,
            shards: ShardTable::default(),
            notifier: RwLock::default(),
            closed: AtomicBool::new(false),
            orphans: Mutex::default(),
            mapped_bytes: Arc::default(),
        };
        DmaSpace { inner: Arc::new(SpaceHandle { space: Arc::new(inner) }) }
    }

    /// The configuration it was created with (`max_pages_per_call` capped, see there).
    #[inline]
    pub fn config(&self) -> &DmaSpaceConfig {
        &self.inner.config
    }

    /// How pins hold pages in this space.
    #[inline]
    pub fn mode(&self) -> PinMode {
        self.inner.policy.mode
    }

    /// The lock account lock-mode pins are charged to.
    pub fn account(&self) -> &Arc<LockAccount> {
        &self.inner.policy.account
    }

    /// Kernel mode: the io_uring whose table of registered buffers holds this space's
    /// kernel pins (see [`crate::PinnedPages::registered_buffer`]). A caller that wants the
    /// pinned pages as fixed buffers of its own ring (`READ_FIXED`, `WRITE_FIXED`) clones
    /// their slots from it (`IORING_REGISTER_CLONE_BUFFERS`, Linux 6.12 or later). `None` in
    /// the other modes, or where kernel mode could not start.
    pub fn kernel_ring_fd(&self) -> Option<BorrowedFd<'_>> {
        match self.inner.policy.kernel() {
            Some(Ok(table)) => Some(table.ring_fd()),
            _ => None,
        }
    }

    /// The table, read under this thread's shard lock.
    #[inline]
    pub(crate) fn read_table(&self) -> TableRead<'_> {
        self.inner.shards.read()
    }

    fn write_table(&self) -> TableWrite<'_> {
        self.inner.shards.write()
    }

    /// Registers the device's unmap notifier, replacing any earlier one.
    pub fn set_unmap_notifier(&self, notifier: Option<UnmapNotifier>) {
        *crate::sync::write(&self.inner.notifier) = notifier;
    }

    /// Maps `size` bytes of `fd` from `offset` at `iova`, `MAP_SHARED` with `prot`.
    ///
    /// The fd may be closed afterwards: the mapping keeps the memory. Costs the same for any
    /// size; pin bookkeeping is allocated only when pages are pinned.
    pub fn map(
        &self,
        iova: u64,
        size: u64,
        fd: BorrowedFd<'_>,
        offset: u64,
        prot: Prot,
    ) -> Result<(), MapError> {
        self.map_from(iova, size, fd, offset, prot, None)
    }

    /// As [`DmaSpace::map`], for an fd the process `client` sent (its pid, where known): a
    /// file on a mount of the client's mount namespace, which this process's table does not
    /// list (a daemon in a namespace of its own), is known by the client's table.
    pub fn map_from(
        &self,
        iova: u64,
        size: u64,
        fd: BorrowedFd<'_>,
        offset: u64,
        prot: Prot,
        client: Option<i32>,
    ) -> Result<(), MapError> {
        self.check_new_range(iova, size, offset, prot)?;
        offset.checked_add(size).ok_or(MapError::OffsetWraps { offset, size })?;
        // Check overlap and the count before the (cheap, but not free) mmap, and again under
        // the write lock after it.
        self.check_room(&self.read_table(), iova, size)?;
        // Abandoned mappings no pin keeps any more give their share back first.
        self.inner.prune_orphans();
        let max = self.inner.config.max_mapped_bytes;
        let charge = SpaceCharge::take(&self.inner.mapped_bytes, size, max)
            .map_err(|held| MapError::TooManyBytes { size, held, max })?;
        let memory = HostMemory::map_from(fd, offset, size, prot, client)?.charged(charge);
        self.insert(iova, size, prot, Some(memory))
    }

    /// Records a region the client mapped without an fd (vfio-user: reachable only through
    /// DMA_READ/DMA_WRITE messages). It takes part in overlap checks and unmaps; pins of it
    /// fail with [`crate::PinError::NoHostMemory`].
    pub fn map_message_only(&self, iova: u64, size: u64, prot: Prot) -> Result<(), MapError> {
        self.check_new_range(iova, size, 0, prot)?;
        self.insert(iova, size, prot, None)
    }

    fn check_new_range(&self, iova: u64, size: u64, offset: u64, prot: Prot) -> Result<(), MapError> {
        if size == 0 {
            return Err(MapError::ZeroSize);
        }
        if !is_page_aligned(iova) || !is_page_aligned(size) || !is_page_aligned(offset) {
            return Err(MapError::Unaligned { iova, size, offset });
        }
        if iova.checked_add(size - 1).is_none() {
            return Err(MapError::IovaWraps { iova, size });
        }
        if prot.is_empty() || !Prot::READ_WRITE.contains(prot) {
            return Err(MapError::NoAccess);
        }
        Ok(())
    }

    fn check_room(&self, table: &MappingTable, iova: u64, size: u64) -> Result<(), MapError> {
        let first = pfn_of(iova);
        let last = pfn_of(iova + (size - 1));
        // The only candidates: the last mapping starting at or before `last`.
        if let Some((_, m)) = table.range(..=last).next_back() {
            if m.end_pfn() > first {
                return Err(MapError::Overlap {
                    iova,
                    size,
                    existing_iova: m.iova(),
                    existing_size: m.size(),
                });
            }
        }
        if table.len() >= self.inner.config.max_mappings {
            return Err(MapError::TooManyMappings { max: self.inner.config.max_mappings });
        }
        Ok(())
    }

    fn insert(&self, iova: u64, size: u64, prot: Prot, memory: Option<HostMemory>) -> Result<(), MapError> {
        self.inner.prune_orphans();
        let mapping = Mapping::new(pfn_of(iova), size / PAGE_SIZE, prot, memory, self.inner.policy.clone());
        let mut table = self.write_table();
        self.check_room(&table, iova, size)?;
        table.insert(mapping.first_pfn, Arc::new(mapping));
        Ok(())
    }

    /// Removes every mapping inside `[iova, iova + size)`, which must not cut through one.
    ///
    /// Mappings holding pins are marked so that no new pins are granted, the notifier is
    /// called for each of them, and the unmap waits up to `unmap_timeout` for their pins to
    /// drop. If any remain, nothing is removed and the error is [`UnmapError::Busy`].
    pub fn unmap(&self, iova: u64, size: u64) -> Result<Unmapped, UnmapError> {
        let last = size.checked_sub(1).and_then(|s| iova.checked_add(s));
        let last = match last {
            Some(last) if is_page_aligned(iova) && is_page_aligned(size) => last,
            _ => return Err(UnmapError::InvalidRange { iova, size }),
        };
        let victims = {
            let table = self.write_table();
            let victims = Self::mappings_in(&table, pfn_of(iova), pfn_of(last));
            if let Some(m) = victims.iter().find(|m| m.iova() < iova || m.iova() + (m.size() - 1) > last) {
                return Err(UnmapError::SplitsMapping {
                    iova,
                    size,
                    mapping_iova: m.iova(),
                    mapping_size: m.size(),
                });
            }
            victims
        };
        if victims.is_empty() {
            return Err(UnmapError::NotMapped { iova, size });
        }
        self.remove(victims)
    }

    /// Removes every mapping, waiting for pins as [`DmaSpace::unmap`] does.
    pub fn unmap_all(&self) -> Result<Unmapped, UnmapError> {
        let victims: Vec<_> = self.read_table().values().cloned().collect();
        self.remove(victims)
    }

    /// Removes every mapping at once, pins or not: the last resort when a client is gone and
    /// a device failed to drop its pins. Guards keep their mapping's memory until they drop;
    /// memory under pins taken without a guard is leaked, never unmapped under them: pins
    /// kept with [`crate::PinnedPages::forget`] can no longer be unpinned (`NotMapped`), and
    /// their lock-mode charge ([`DmaSpace::account`]) and kernel pins stay until the process
    /// ends. From then on [`DmaSpace::stats`] counts only mappings in the table: the
    /// abandoned mappings' pins are in `DmaStats::pins_held` only while track-mode guards
    /// hold them (the error log says how many each mapping had).
    pub fn abandon_all(&self) -> Unmapped {
        let mut table = self.write_table();
        let taken = std::mem::take(&mut *table);
        for m in taken.values() {
            // A lock-mode pin in progress gives way at its next mlock piece.
            m.leave_table(&mut m.lock_for_unmap());
        }
        drop(table);
        let mut unmapped = Unmapped::default();
        let mut named = Vec::new();
        for m in taken.values() {
            let mut pins = m.lock();
            m.set_state(&mut pins, MappingState::Removed);
            drop(pins);
            // Shards first, then the counts, each lock alone (never a mapping's lock while
            // taking shard locks: `remove` holds every shard lock and then takes mappings').
            let recorded = self.inner.shards.pins_in(m).pins;
            let counted = m.lock().page_counts.pins();
            if counted + recorded != 0 {
                log::error!(
                    "abandoning the mapping at {:#x} with {} pins held",
                    m.iova(),
                    counted + recorded
                );
            }
            if recorded != 0 {
                named.push(m.clone());
            }
            unmapped.mappings += 1;
            unmapped.bytes += m.size();
        }
        // Track-mode guards point at their mappings without counting them: keep the ones
        // still pinned with the space, which outlives its guards.
        if !named.is_empty() {
            crate::sync::lock(&self.inner.orphans).extend(named);
            // A guard that let go meanwhile (under its shard's lock or without it) may have
            // left nothing to name an orphan: look now, and let the reaper look until none
            // is left (a small record's guard tells nobody when it lets go).
            if self.inner.space.reap() {
                self.inner.space.watch();
            }
        }
        unmapped
    }

    fn mappings_in(table: &MappingTable, first: u64, last: u64) -> Vec<Arc<Mapping>> {
        let straddling = table.range(..first).next_back().map(|(_, m)| m).filter(|m| m.end_pfn() > first);
        straddling.into_iter().chain(table.range(first..=last).map(|(_, m)| m)).cloned().collect()
    }

    fn remove(&self, victims: Vec<Arc<Mapping>>) -> Result<Unmapped, UnmapError> {
        self.inner.prune_orphans();
        // Claim every victim: no new pins from here on.
        let mut busy = Vec::new();
        for (claimed, m) in victims.iter().enumerate() {
            let mut pins = m.lock_for_unmap();
            if m.state() != MappingState::Live {
                drop(pins);
                Self::unclaim(&victims[..claimed]);
                return Err(UnmapError::InProgress { iova: m.iova() });
            }
            m.set_state(&mut pins, MappingState::Unmapping);
            drop(pins);
            // Marked first, then the shards looked at: a track-mode pin either saw the mark
            // under its shard's lock or left its record there for this to see.
            // Shards before counts, each lock alone: forget counts first and retires second,
            // so this sees its pins one way or the other.
            let recorded = self.inner.shards.pins_in(m).pins;
            let counted = m.lock().page_counts.pins();
            if recorded + counted != 0 {
                busy.push(m.clone());
            }
        }
        if !busy.is_empty() {
            // A notifier that panics must not leave the victims claimed for good (I7: an
            // unmap that fails removes nothing and its mappings are live again).
            match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| self.wait_for_pins(&busy))) {
                Ok(waited) => waited.inspect_err(|_| Self::unclaim(&victims))?,
                Err(panic) => {
                    Self::unclaim(&victims);
                    std::panic::resume_unwind(panic);
                }
            }
        }
        let mut table = self.write_table();
        let mut unmapped = Unmapped::default();
        for m in &victims {
            // abandon_all may have taken the mapping meanwhile, and a new one may sit at its
            // IOVA now: remove only the victim itself.
            if table.get(&m.first_pfn).is_some_and(|t| Arc::ptr_eq(t, m)) {
                table.remove(&m.first_pfn);
                m.leave_table(&mut m.lock());
            }
            unmapped.mappings += 1;
            unmapped.bytes += m.size();
        }
        drop(table);
        for m in &victims {
            m.set_state(&mut m.lock(), MappingState::Removed);
        }
        Ok(unmapped)
    }

    fn wait_for_pins(&self, busy: &[Arc<Mapping>]) -> Result<(), UnmapError> {
        let notifier = crate::sync::read(&self.inner.notifier).clone();
        let calls = if notifier.is_some() { busy.len() as u64 } else { 0 };
        self.inner.count(|c| {
            c.unmap_waits += 1;
            c.notifier_calls += calls;
        });
        if let Some(notify) = notifier {
            for m in busy {
                notify(m.iova(), m.size());
            }
        }
        let start = Instant::now();
        let deadline = start + self.inner.config.unmap_timeout;
        for m in busy {
            let pins = self.wait_drained(m, deadline);
            if pins != 0 {
                self.inner.count(|c| c.unmap_busy += 1);
                return Err(UnmapError::Busy { iova: m.iova(), pins, waited: start.elapsed() });
            }
        }
        Ok(())
    }

    /// Waits until `m` holds no pins (counted or recorded) or `deadline` passes; returns the
    /// pins left. Woken by whoever lets go of its pins under a lock (I7); while small
    /// records it saw live hold some, it also looks again every [`RELOOK`], since their
    /// guards may let go without the lock and tell nobody (I5).
    fn wait_drained(&self, m: &Mapping, deadline: Instant) -> u64 {
        loop {
            let seen = m.drained.epoch();
            let recorded = self.inner.shards.pins_in(m);
            let left = recorded.pins + m.lock().page_counts.pins();
            let now = Instant::now();
            if left == 0 || now >= deadline {
                return left;
            }
            let until = if recorded.in_small != 0 { deadline.min(now + RELOOK) } else { deadline };
            m.drained.wait(seen, until);
        }
    }

    /// Gives back mappings this unmap claimed: live again, unless abandon_all removed them
    /// meanwhile.
    fn unclaim(mappings: &[Arc<Mapping>]) {
        for m in mappings {
            let mut pins = m.lock();
            if m.state() == MappingState::Unmapping {
                m.set_state(&mut pins, MappingState::Live);
            }
        }
    }

    /// The mapping holding `iova`, if any.
    pub fn lookup(&self, iova: u64) -> Option<MappingInfo> {
        let pfn = pfn_of(iova);
        let table = self.read_table();
        let (_, m) = table.range(..=pfn).next_back()?;
        m.contains(pfn).then(|| Self::info(m))
    }

    /// Every mapping, in IOVA order.
    pub fn mappings(&self) -> Vec<MappingInfo> {
        self.read_table().values().map(|m| Self::info(m)).collect()
    }

    fn info(m: &Mapping) -> MappingInfo {
        MappingInfo {
            id: m.id,
            iova: m.iova(),
            size: m.size(),
            prot: m.prot,
            has_memory: m.memory.is_some(),
            hugetlb: m.memory.as_ref().is_some_and(|mem| mem.backing().hugetlb),
        }
    }

    /// The pin count of the page holding `iova` (0 if unmapped).
    pub fn pin_count(&self, iova: u64) -> u32 {
        let pfn = pfn_of(iova);
        let mapping = match self.read_table().range(..=pfn).next_back() {
            Some((_, m)) if m.contains(pfn) => m.clone(),
            _ => return 0,
        };
        let page = pfn - mapping.first_pfn;
        let mut count = u64::from(mapping.lock().page_counts.count(page));
        self.inner.shards.for_each_shard(|shard| {
            for record in shard.records() {
                for run in record.runs.iter() {
                    let held_in = record.mapping(run.mapping_index());
                    // Runs of other mappings have no page in this one.
                    if std::ptr::eq(held_in, &*mapping) {
                        let first = held_in.run_page(run);
                        count += u64::from((first..first + run.npages()).contains(&page));
                    }
                }
            }
        });
        u32::try_from(count).unwrap_or(u32::MAX)
    }

    /// The counts of the space's shards, of its mappings and of the mappings that left its
    /// table, and the mappings. Summed without holding the table (a mapping's lock may be
    /// held for a long mlock), and again if a mapping left the table meanwhile, moving its
    /// counts from one sum to the other (I9).
    fn counter_totals(&self) -> (Counts, Vec<Arc<Mapping>>) {
        let policy = &self.inner.policy;
        let mut tries = 0;
        loop {
            let before = policy.departures.load(Ordering::Acquire);
            let mappings: Vec<Arc<Mapping>> = self.read_table().values().cloned().collect();
            let mut total = *policy.departed.lock();
            self.inner.shards.for_each_shard(|shard| {
                // Released small records count their unpins as they are taken back.
                shard.reclaim_small();
                total += &shard.counts;
            });
            for m in &mappings {
                total += &m.lock().counts;
            }
            // Unchanged: every mapping summed was in the table throughout, with its counts.
            // Under a storm of unmaps the fourth sum stands, which may miss the counts of a
            // mapping that left while it was taken.
            tries += 1;
            if policy.departures.load(Ordering::Acquire) == before || tries == 4 {
                return (total, mappings);
            }
        }
    }

    /// Counters and current totals.
    pub fn stats(&self) -> DmaStats {
        let (counts, mappings) = self.counter_totals();
        let mut stats = DmaStats {
            pin_calls: counts.pin_calls,
            pin_failures: counts.pin_failures,
            unpin_calls: counts.unpin_calls,
            unpin_failures: counts.unpin_failures,
            runs: counts.runs,
            pages: counts.pages,
            mlock_calls: counts.mlock_calls,
            munlock_calls: counts.munlock_calls,
            munlock_failures: counts.munlock_failures,
            unmap_waits: counts.unmap_waits,
            unmap_busy: counts.unmap_busy,
            notifier_calls: counts.notifier_calls,
            ..DmaStats::default()
        };
        if let Some(Ok(table)) = self.inner.policy.kernel() {
            let kernel = table.counts();
            stats.kernel_pin_calls = kernel.pin_calls;
            stats.kernel_unpin_calls = kernel.unpin_calls;
            stats.kernel_buffers = kernel.buffers;
            stats.kernel_pages = kernel.pages;
            stats.kernel_cut_runs = kernel.cut_runs;
            stats.kernel_buffers_held = kernel.held_buffers;
            stats.kernel_pages_held = kernel.held_pages;
        }
        // Abandoned mappings still named by records: their pages are pinned, they are not mapped.
        let orphans: Vec<Arc<Mapping>> = crate::sync::lock(&self.inner.orphans).clone();
        // Track-mode records, as (mapping, first page, pages), for the totals.
        let mut recorded: Vec<(*const Mapping, u64, u64)> = Vec::new();
        self.inner.shards.for_each_shard(|shard| {
            stats.bookkeeping_bytes += shard.bookkeeping_bytes() as u64;
            stats.pins_held += shard.pins();
            for record in shard.records() {
                for run in record.runs.iter() {
                    let mapping = record.mapping(run.mapping_index());
                    recorded.push((mapping, mapping.run_page(run), run.npages()));
                }
            }
        });
        recorded.sort_unstable();
        let listed = mappings.len();
        for (i, m) in mappings.iter().chain(&orphans).enumerate() {
            let pins = m.lock();
            if i < listed {
                stats.mappings += 1;
                stats.mapped_bytes += m.size();
                stats.pins_held += pins.page_counts.pins();
                stats.pinned_pages += pins.page_counts.pinned_pages();
                stats.bookkeeping_bytes += pins.page_counts.bookkeeping_bytes() as u64;
                stats.bookkeeping_bytes +=
                    pins.kept_counts.as_ref().map_or(0, |k| k.bookkeeping_bytes()) as u64;
                stats.poisoned_mappings += u64::from(m.poisoned());
            }
            // Distinct recorded pages that the counts do not already cover (without counts,
            // the merged runs' lengths).
            let counted = pins.page_counts.pins() != 0;
            let ptr: *const Mapping = &**m;
            let from = recorded.partition_point(|r| r.0 < ptr);
            let mut next = 0u64; // first page not yet counted
            for &(_, first, n) in recorded[from..].iter().take_while(|r| r.0 == ptr) {
                let start = first.max(next);
                if counted {
                    for page in start..first + n {
                        stats.pinned_pages += u64::from(pins.page_counts.count(page) == 0);
                    }
                } else {
                    stats.pinned_pages += (first + n).saturating_sub(start);
                }
                next = next.max(first + n);
            }
        }
        if self.mode() == PinMode::Lock {
            stats.locked_bytes = stats.pinned_pages * PAGE_SIZE;
        }
        stats
    }
}
