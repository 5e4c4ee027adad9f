//! A client's DMA space: its IOVA mappings, and the map/unmap side of pinning.
//!
//! The mapping table is behind a read-write lock that pins hold only while they look up
//! mappings; pin counts live in each mapping under its own lock. Unmap never removes a
//! mapping that holds pins: it marks it so new pins are refused, asks the device to let go
//! (the unmap notifier, called with no engine lock held), and waits a bounded time.

use std::collections::BTreeMap;
use std::ops::Deref;
use std::os::fd::BorrowedFd;
use std::sync::atomic::AtomicBool;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Condvar, Mutex, RwLock};
use std::time::{Duration, Instant};

use serde::Serialize;
use thiserror::Error;

use crate::lock::{LockAccount, PinMode};
use crate::mapping::{Counters, Mapping, MappingState, PinPolicy};
use crate::mmap::{HostMemory, MmapError};
use crate::page::{is_page_aligned, pfn_of, Prot, PAGE_SIZE};
use crate::slots::{SlotTable, TableRead, TableWrite};

/// The device's `dma_unmap(iova, len)`: told that `[iova, iova + len)` is being unmapped
/// and that it must drop its pins there.
///
/// Called on the thread doing the unmap, with no engine lock held, so it may unpin (or wait
/// for its own threads to unpin). It must not map or unmap in the same space. A device that
/// owns its DMA space should capture it weakly, or the two keep each other alive.
pub type UnmapNotifier = Arc<dyn Fn(u64, u64) + Send + Sync>;

/// How a [`DmaSpace`] behaves; `Default` gives the documented defaults.
#[derive(Clone, Debug)]
pub struct DmaSpaceConfig {
    /// Most mappings at once (default 4096; each is a VMA, counted against the process's
    /// `vm.max_map_count`).
    pub max_mappings: usize,
    /// How pins hold their pages (default [`PinMode::Track`]).
    pub mode: PinMode,
    /// The locked-memory budget lock-mode pins are charged to (default: a fresh account with
    /// this process's limit; share one account between spaces to share the limit).
    pub account: Arc<LockAccount>,
    /// How long an unmap waits for pins to drop before failing busy (default 2 s, under the
    /// 5 s a VMM such as QEMU waits for a reply).
    pub unmap_timeout: Duration,
    /// Most pages one pin or unpin call may name (default 262144, 1 GiB): one call holds a
    /// mapping's lock for its whole duration. At most 2^32 - 1 (larger values are taken as
    /// that): a run records its pages and position in 32 bits.
    pub max_pages_per_call: u64,
    /// Most pins the space holds at once, repeats counted (default 16M: 64 GiB of pages
    /// pinned once). Bounds what a device driven by a client can hold.
    pub max_pins: u64,
}

impl Default for DmaSpaceConfig {
    fn default() -> Self {
        DmaSpaceConfig {
            max_mappings: 4096,
            mode: PinMode::Track,
            account: Arc::new(LockAccount::for_this_process()),
            unmap_timeout: Duration::from_secs(2),
            max_pages_per_call: 1 << 18,
            max_pins: 1 << 24,
        }
    }
}

/// Why a map was refused. The space is unchanged.
#[derive(Debug, Error)]
pub enum MapError {
    /// The size is 0.
    #[error("mapping size is zero")]
    ZeroSize,
    /// IOVA, size or file offset is not a multiple of the page size.
    #[error("iova {iova:#x}, size {size:#x} and offset {offset:#x} must be page aligned")]
    Unaligned {
        /// Requested IOVA.
        iova: u64,
        /// Requested size.
        size: u64,
        /// Requested file offset.
        offset: u64,
    },
    /// Neither read nor write access was asked for.
    #[error("mapping grants neither read nor write access")]
    NoAccess,
    /// `iova + size` does not fit in 64 bits.
    #[error("iova {iova:#x} + size {size:#x} wraps around")]
    IovaWraps {
        /// Requested IOVA.
        iova: u64,
        /// Requested size.
        size: u64,
    },
    /// `offset + size` does not fit in 64 bits.
    #[error("file offset {offset:#x} + size {size:#x} wraps around")]
    OffsetWraps {
        /// Requested file offset.
        offset: u64,
        /// Requested size.
        size: u64,
    },
    /// The range overlaps a mapping already in the space.
    #[error("[{iova:#x}, +{size:#x}) overlaps the mapping at {existing_iova:#x} (+{existing_size:#x})")]
    Overlap {
        /// Requested IOVA.
        iova: u64,
        /// Requested size.
        size: u64,
        /// IOVA of the existing mapping.
        existing_iova: u64,
        /// Size of the existing mapping.
        existing_size: u64,
    },
    /// The space already holds its maximum number of mappings.
    #[error("the space already holds its maximum of {max} mappings")]
    TooManyMappings {
        /// The configured maximum.
        max: usize,
    },
    /// The fd cannot back the mapping: past its end, not a regular file, refused by mmap.
    #[error(transparent)]
    Backing(#[from] MmapError),
}

impl MapError {
    /// The errno a VFIO-style interface reports for this error.
    pub fn errno(&self) -> i32 {
        match self {
            MapError::Overlap { .. } => libc::EEXIST,
            MapError::TooManyMappings { .. } => libc::ENOSPC,
            MapError::Backing(MmapError::ProcessLimit { .. }) => libc::ENOMEM,
            MapError::Backing(MmapError::Inspect(_)) => libc::EBADF,
            MapError::Backing(MmapError::Mmap(e)) => e.raw_os_error().unwrap_or(libc::EINVAL),
            _ => libc::EINVAL,
        }
    }
}

/// Why an unmap failed. The space is unchanged.
#[derive(Debug, Error)]
pub enum UnmapError {
    /// Zero size, unaligned, or wrapping range.
    #[error("invalid unmap range iova {iova:#x} size {size:#x}")]
    InvalidRange {
        /// Requested IOVA.
        iova: u64,
        /// Requested size.
        size: u64,
    },
    /// No mapping lies in the range.
    #[error("nothing is mapped in [{iova:#x}, +{size:#x})")]
    NotMapped {
        /// Requested IOVA.
        iova: u64,
        /// Requested size.
        size: u64,
    },
    /// The range cuts through a mapping; only whole mappings are unmapped.
    #[error("[{iova:#x}, +{size:#x}) splits the mapping at {mapping_iova:#x} (+{mapping_size:#x})")]
    SplitsMapping {
        /// Requested IOVA.
        iova: u64,
        /// Requested size.
        size: u64,
        /// IOVA of the mapping cut through.
        mapping_iova: u64,
        /// Size of that mapping.
        mapping_size: u64,
    },
    /// Pins remained in the mapping at `iova` after the notifier and the wait.
    #[error("{pins} pins still held in the mapping at {iova:#x} after waiting {waited:?}")]
    Busy {
        /// IOVA of the first mapping still pinned.
        iova: u64,
        /// Pins left in it.
        pins: u64,
        /// How long the unmap waited.
        waited: Duration,
    },
    /// Another unmap of an overlapping range is waiting for the same mappings.
    #[error("the mapping at {iova:#x} is already being unmapped")]
    InProgress {
        /// IOVA of the contended mapping.
        iova: u64,
    },
}

impl UnmapError {
    /// The errno a VFIO-style interface reports for this error.
    pub fn errno(&self) -> i32 {
        match self {
            UnmapError::NotMapped { .. } => libc::ENOENT,
            UnmapError::Busy { .. } | UnmapError::InProgress { .. } => libc::EBUSY,
            _ => libc::EINVAL,
        }
    }
}

/// What an unmap removed.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Unmapped {
    /// Mappings removed.
    pub mappings: u64,
    /// Bytes they covered.
    pub bytes: u64,
}

/// What a mapping is, as seen from outside the engine.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct MappingInfo {
    /// First IOVA.
    pub iova: u64,
    /// Size in bytes.
    pub size: u64,
    /// Access the client granted.
    #[serde(serialize_with = "ser_prot")]
    pub prot: Prot,
    /// False for a region mapped without an fd: its contents are reachable only through
    /// the client (vfio-user DMA_READ/DMA_WRITE), never pinned.
    pub has_memory: bool,
    /// Backed by hugetlbfs.
    pub hugetlb: bool,
}

fn ser_prot<S: serde::Serializer>(prot: &Prot, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_u32(prot.bits())
}

/// Counters and current state of a space, for `umdev stats`.
#[derive(Clone, Debug, Default, Serialize)]
pub struct DmaStats {
    /// Mappings in the space.
    pub mappings: u64,
    /// Bytes they cover.
    pub mapped_bytes: u64,
    /// Pin calls that succeeded.
    pub pin_calls: u64,
    /// Pin calls that failed (and were unwound).
    pub pin_failures: u64,
    /// Unpin calls (explicit and guard drops).
    pub unpin_calls: u64,
    /// Unpin calls refused.
    pub unpin_failures: u64,
    /// Runs pinned by successful calls (one run = one pin step).
    pub runs: u64,
    /// Pages pinned by successful calls (a repeated page counts each time).
    pub pages: u64,
    /// Pins held now.
    pub pins_held: u64,
    /// Distinct pages pinned now.
    pub pinned_pages: u64,
    /// Bytes this space has locked now (lock mode; hugetlb included).
    pub locked_bytes: u64,
    /// mlock syscalls made.
    pub mlock_calls: u64,
    /// munlock syscalls made.
    pub munlock_calls: u64,
    /// munlock syscalls that failed (pages left resident until unmap).
    pub munlock_failures: u64,
    /// Unmaps that had to wait for pins.
    pub unmap_waits: u64,
    /// Unmaps that failed busy.
    pub unmap_busy: u64,
    /// Calls to the unmap notifier.
    pub notifier_calls: u64,
    /// Heap bytes of pin-count bookkeeping.
    pub bookkeeping_bytes: u64,
    /// Mappings whose file the client truncated under them (now zero pages, no new pins).
    pub poisoned_mappings: u64,
}

pub(crate) type MappingTable = BTreeMap<u64, Arc<Mapping>>;

pub(crate) struct SpaceInner {
    pub(crate) config: DmaSpaceConfig,
    pub(crate) policy: Arc<PinPolicy>,
    /// Mappings by first page number, and the track-mode pin records, behind one lock per
    /// thread slot (see `slots`).
    pub(crate) slots: SlotTable,
    notifier: RwLock<Option<UnmapNotifier>>,
    /// Set once every `DmaSpace` handle is gone: slots then let go of the space as their
    /// last record retires.
    pub(crate) closed: AtomicBool,
    /// Woken when a track-mode record in an unmapping mapping retires.
    pub(crate) drained: (Mutex<()>, Condvar),
    /// Mappings `abandon_all` took while records still named them: kept until the space goes.
    orphans: Mutex<Vec<Arc<Mapping>>>,
}

impl SpaceInner {
    /// Lets go of abandoned mappings no record names any more (their memory is unmapped).
    /// Called as records naming them retire, and at each map and unmap: a guard that let go
    /// without its slot's lock just as abandon_all looked leaves its mapping here until then.
    pub(crate) fn prune_orphans(&self) {
        let gone: Vec<Arc<Mapping>> = {
            let mut orphans = crate::sync::lock(&self.orphans);
            if orphans.is_empty() {
                return;
            }
            let (keep, gone): (Vec<_>, Vec<_>) = orphans.drain(..).partition(|m| self.slots.pins_in(m) != 0);
            *orphans = keep;
            gone
        };
        drop(gone);
    }

    /// Makes every slot without live records let go of the space; true if some slot still
    /// holds it. The caller holds a reference of its own (a slot's may be the last but it).
    pub(crate) fn release_idle_slots(&self) -> bool {
        let mut holding = false;
        self.slots.for_each_slot(|slot| {
            if slot.is_empty() {
                drop(slot.keepalive.take());
            }
            holding |= slot.keepalive.is_some();
        });
        holding
    }

    /// What the reaper does with a space it watches: lets go of orphans no record names,
    /// and, once the space is closed, makes idle slots let go of it. True if there is more
    /// to wait for (orphans still named, or slots still holding a closed space).
    pub(crate) fn reap(&self) -> bool {
        self.prune_orphans();
        let orphans = !crate::sync::lock(&self.orphans).is_empty();
        let holding = self.closed.load(Ordering::SeqCst) && self.release_idle_slots();
        orphans || holding
    }

    /// Wakes an unmap waiting for records to retire.
    pub(crate) fn wake_unmap(&self) {
        let _guard = crate::sync::lock(&self.drained.0);
        self.drained.1.notify_all();
    }
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
        // From here on a slot's last retiring record lets go of the space; slots without
        // records let go now. (No pin can start: there is no handle to call it on.)
        self.space.closed.store(true, Ordering::SeqCst);
        if self.space.reap() {
            // Guards still hold records: the last to retire under its slot's lock lets go
            // of the space, and the reaper catches one released without the lock.
            crate::reaper::watch(Arc::downgrade(&self.space));
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
    pub fn new(mut config: DmaSpaceConfig) -> Self {
        config.max_pages_per_call = config.max_pages_per_call.min(u64::from(u32::MAX));
        let policy = Arc::new(PinPolicy::new(config.mode, config.account.clone(), config.max_pins));
        let inner = SpaceInner {
            config,
            policy,
            slots: SlotTable::default(),
            notifier: RwLock::default(),
            closed: AtomicBool::new(false),
            drained: (Mutex::new(()), Condvar::new()),
            orphans: Mutex::default(),
        };
        DmaSpace { inner: Arc::new(SpaceHandle { space: Arc::new(inner) }) }
    }

    /// The configuration it was created with (`max_pages_per_call` capped, see there).
    pub fn config(&self) -> &DmaSpaceConfig {
        &self.inner.config
    }

    /// How pins hold pages in this space.
    pub fn mode(&self) -> PinMode {
        self.inner.policy.mode
    }

    /// The lock account lock-mode pins are charged to.
    pub fn account(&self) -> &Arc<LockAccount> {
        &self.inner.policy.account
    }

    pub(crate) fn counters(&self) -> &Counters {
        self.inner.policy.counters()
    }

    /// The table, read under this thread's slot lock.
    pub(crate) fn read_table(&self) -> TableRead<'_> {
        self.inner.slots.read()
    }

    fn write_table(&self) -> TableWrite<'_> {
        self.inner.slots.write()
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
        self.check_new_range(iova, size, offset, prot)?;
        offset.checked_add(size).ok_or(MapError::OffsetWraps { offset, size })?;
        // Check overlap and the count before the (cheap, but not free) mmap, and again under
        // the write lock after it.
        self.check_room(&self.read_table(), iova, size)?;
        let memory = HostMemory::map(fd, offset, size, prot)?;
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
    /// memory under pins taken without a guard is leaked, never unmapped under them.
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
            // Slots first, then the counts, each lock alone (never a mapping's lock while
            // taking slot locks: `remove` holds every slot lock and then takes mappings').
            let recorded = self.inner.slots.pins_in(m);
            let counted = m.lock().table.pins();
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
            // A guard that let go meanwhile (under its slot's lock or without it) may have
            // left nothing to name an orphan: look now, and let the reaper look until none
            // is left (a small record's guard tells nobody when it lets go).
            if self.inner.space.reap() {
                crate::reaper::watch(Arc::downgrade(&self.inner.space));
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
            // Marked first, then the slots looked at: a track-mode pin either saw the mark
            // under its slot's lock or left its record there for this to see.
            // Slots before counts, each lock alone: forget counts first and retires second,
            // so this sees its pins one way or the other.
            let recorded = self.inner.slots.pins_in(m);
            let counted = m.lock().table.pins();
            if recorded + counted != 0 {
                busy.push(m.clone());
            }
        }
        if !busy.is_empty() {
            self.wait_for_pins(&busy).inspect_err(|_| Self::unclaim(&victims))?;
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
        let counters = self.counters();
        counters.unmap_waits.fetch_add(1, Ordering::Relaxed);
        let notifier = crate::sync::read(&self.inner.notifier).clone();
        if let Some(notify) = notifier {
            for m in busy {
                counters.notifier_calls.fetch_add(1, Ordering::Relaxed);
                notify(m.iova(), m.size());
            }
        }
        let start = Instant::now();
        let deadline = start + self.inner.config.unmap_timeout;
        for m in busy {
            let pins = self.wait_drained(m, deadline);
            if pins != 0 {
                counters.unmap_busy.fetch_add(1, Ordering::Relaxed);
                return Err(UnmapError::Busy { iova: m.iova(), pins, waited: start.elapsed() });
            }
        }
        Ok(())
    }

    /// Waits until `m` holds no pins (counted or recorded) or `deadline` passes; returns the
    /// pins left.
    fn wait_drained(&self, m: &Mapping, deadline: Instant) -> u64 {
        if self.mode() == PinMode::Lock {
            return m.wait_drained(deadline);
        }
        // Guards wake `drained` as their records in an unmapping mapping retire; pins kept
        // with forget and released by unpin_pages wake the mapping's own condition instead,
        // so the wait also looks again every millisecond.
        let (lock, cv) = &self.inner.drained;
        let mut guard = crate::sync::lock(lock);
        loop {
            let recorded = self.inner.slots.pins_in(m);
            let left = recorded + m.lock().table.pins();
            let now = Instant::now();
            if left == 0 || now >= deadline {
                return left;
            }
            let wait = (deadline - now).min(Duration::from_millis(1));
            guard = crate::sync::wait_timeout(cv, guard, wait).0;
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
        let mut count = u64::from(mapping.lock().table.count(page));
        self.inner.slots.for_each_slot(|slot| {
            for record in slot.records() {
                for run in record.runs.iter() {
                    let held_in = record.mapping(run.slot());
                    // Runs of other mappings have no page in this one.
                    if std::ptr::eq(held_in, &*mapping) {
                        let first = run.page_in(held_in);
                        count += u64::from((first..first + run.npages()).contains(&page));
                    }
                }
            }
        });
        u32::try_from(count).unwrap_or(u32::MAX)
    }

    /// The space's counters plus its mappings' lock-mode counts, and the mappings. Summed
    /// without holding the table (a mapping's lock may be held for a long mlock), and again if
    /// a mapping left the table meanwhile, moving its counts from one sum to the other.
    fn counter_totals(&self) -> (DmaStats, Vec<Arc<Mapping>>) {
        let sum = |f: fn(&Counters) -> &std::sync::atomic::AtomicU64| -> u64 {
            self.inner.policy.counters.all().map(|c| f(c).load(Ordering::Relaxed)).sum()
        };
        let departures = &self.inner.policy.departures;
        let mut tries = 0;
        loop {
            let before = departures.load(Ordering::Acquire);
            let mappings: Vec<Arc<Mapping>> = self.read_table().values().cloned().collect();
            let mut stats = DmaStats {
                pin_calls: sum(|c| &c.pin_calls),
                pin_failures: sum(|c| &c.pin_failures),
                unpin_calls: sum(|c| &c.unpin_calls),
                unpin_failures: sum(|c| &c.unpin_failures),
                runs: sum(|c| &c.runs),
                pages: sum(|c| &c.pages),
                mlock_calls: sum(|c| &c.mlock_calls),
                munlock_calls: sum(|c| &c.munlock_calls),
                munlock_failures: sum(|c| &c.munlock_failures),
                unmap_waits: sum(|c| &c.unmap_waits),
                unmap_busy: sum(|c| &c.unmap_busy),
                notifier_calls: sum(|c| &c.notifier_calls),
                ..DmaStats::default()
            };
            for m in &mappings {
                let c = m.lock().counts;
                stats.pin_calls += c.pin_calls;
                stats.unpin_calls += c.unpin_calls;
                stats.runs += c.runs;
                stats.pages += c.pages;
                stats.mlock_calls += c.mlock_calls;
                stats.munlock_calls += c.munlock_calls;
                stats.munlock_failures += c.munlock_failures;
            }
            // Unchanged: every mapping summed was in the table throughout, with its counts.
            // Under a storm of unmaps the fourth sum stands, which may miss the counts of a
            // mapping that left while it was taken.
            tries += 1;
            if departures.load(Ordering::Acquire) == before || tries == 4 {
                return (stats, mappings);
            }
        }
    }

    /// Counters and current totals.
    pub fn stats(&self) -> DmaStats {
        let (mut stats, mappings) = self.counter_totals();
        // Abandoned mappings still named by records: their pages are pinned, they are not mapped.
        let orphans: Vec<Arc<Mapping>> = crate::sync::lock(&self.inner.orphans).clone();
        // Track-mode records, as (mapping, first page, pages), for the totals.
        let mut recorded: Vec<(*const Mapping, u64, u64)> = Vec::new();
        self.inner.slots.for_each_slot(|slot| {
            stats.bookkeeping_bytes += slot.bookkeeping_bytes() as u64;
            stats.pins_held += slot.pins();
            let c = slot.counts;
            stats.pin_calls += c.pin_calls;
            stats.pin_failures += c.pin_failures;
            stats.unpin_calls += c.unpin_calls;
            stats.runs += c.runs;
            stats.pages += c.pages;
            for record in slot.records() {
                for run in record.runs.iter() {
                    let mapping = record.mapping(run.slot());
                    recorded.push((mapping, run.page_in(mapping), run.npages()));
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
                stats.pins_held += pins.table.pins();
                stats.pinned_pages += pins.table.pinned_pages();
                stats.bookkeeping_bytes += pins.table.bookkeeping_bytes() as u64;
                stats.poisoned_mappings += u64::from(m.poisoned());
            }
            // Distinct recorded pages that the counts do not already cover (without counts,
            // the merged runs' lengths).
            let counted = pins.table.pins() != 0;
            let ptr: *const Mapping = &**m;
            let from = recorded.partition_point(|r| r.0 < ptr);
            let mut next = 0u64; // first page not yet counted
            for &(_, first, n) in recorded[from..].iter().take_while(|r| r.0 == ptr) {
                let start = first.max(next);
                if counted {
                    for page in start..first + n {
                        stats.pinned_pages += u64::from(pins.table.count(page) == 0);
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

#[cfg(test)]
mod tests {
    use std::os::fd::AsFd;
    use std::sync::atomic::AtomicU64;

    use super::*;
    use crate::testutil::memfd;
    use crate::PinError;

    const RW: Prot = Prot::READ_WRITE;

    #[test]
    fn map_rejects_bad_requests_with_distinct_errors() {
        let space = DmaSpace::new(DmaSpaceConfig { max_mappings: 2, ..Default::default() });
        let file = memfd(16);
        let fd = file.as_fd();
        let p = PAGE_SIZE;
        assert!(matches!(space.map(0, 0, fd, 0, RW), Err(MapError::ZeroSize)));
        assert!(matches!(space.map(1, p, fd, 0, RW), Err(MapError::Unaligned { .. })));
        assert!(matches!(space.map(0, p + 1, fd, 0, RW), Err(MapError::Unaligned { .. })));
        assert!(matches!(space.map(0, p, fd, 1, RW), Err(MapError::Unaligned { .. })));
        assert!(matches!(space.map(0, p, fd, 0, Prot::empty()), Err(MapError::NoAccess)));
        assert!(matches!(space.map(u64::MAX - p + 1, 2 * p, fd, 0, RW), Err(MapError::IovaWraps { .. })));
        assert!(matches!(space.map(0, 2 * p, fd, u64::MAX - p + 1, RW), Err(MapError::OffsetWraps { .. })));
        assert!(matches!(
            space.map(0, 17 * p, fd, 0, RW),
            Err(MapError::Backing(MmapError::PastEndOfFile { .. }))
        ));
        let (pipe, _w) = nix::unistd::pipe().unwrap();
        assert!(matches!(
            space.map(0, p, pipe.as_fd(), 0, RW),
            Err(MapError::Backing(MmapError::NotRegularFile { .. }))
        ));
        space.map(4 * p, 4 * p, fd, 0, RW).unwrap();
        // Overlap at the start, the end, inside and around.
        for (iova, size) in [(2 * p, 3 * p), (7 * p, 2 * p), (5 * p, p), (0, 16 * p)] {
            let err = space.map(iova, size, fd, 0, RW).unwrap_err();
            assert!(
                matches!(err, MapError::Overlap { existing_iova, .. } if existing_iova == 4 * p),
                "{err}"
            );
            assert_eq!(err.errno(), libc::EEXIST);
        }
        // Touching neighbours are fine; then the count limit bites.
        space.map(8 * p, p, fd, 0, RW).unwrap();
        let err = space.map(0, 4 * p, fd, 0, RW).unwrap_err();
        assert!(matches!(err, MapError::TooManyMappings { max: 2 }), "{err}");
        assert_eq!(err.errno(), libc::ENOSPC);
        // The last page of the IOVA space is mappable.
        let space = DmaSpace::default();
        space.map(u64::MAX - p + 1, p, fd, 0, RW).unwrap();
        assert!(space.lookup(u64::MAX).is_some());
    }

    #[test]
    fn pin_counts_look_only_at_runs_of_the_page_s_own_mapping() {
        // Track-mode guards' runs in a lower mapping must not be measured against a higher one.
        let space = DmaSpace::default();
        let file = memfd(8);
        space.map(0, 4 * PAGE_SIZE, file.as_fd(), 0, RW).unwrap();
        space.map(1 << 40, 4 * PAGE_SIZE, file.as_fd(), 4 * PAGE_SIZE, RW).unwrap();
        let low = space.pin_pages(&[1, 2, 3], Prot::READ).unwrap();
        let high = space.pin_range((1 << 40) + PAGE_SIZE, 2, Prot::READ).unwrap();
        let counts: Vec<u32> = (0..4).map(|p| space.pin_count((1 << 40) + p * PAGE_SIZE)).collect();
        assert_eq!(counts, [0, 1, 1, 0]);
        assert_eq!(space.pin_count(0), 0);
        drop((low, high));
    }

    #[test]
    fn pages_per_call_stop_at_what_a_run_records() {
        let space = DmaSpace::new(DmaSpaceConfig { max_pages_per_call: u64::MAX, ..Default::default() });
        assert_eq!(space.config().max_pages_per_call, u64::from(u32::MAX));
        let err = space.pin_range(0, 1 << 32, Prot::READ).unwrap_err();
        assert!(matches!(err, PinError::TooManyPages { requested: 4294967296, max: 4294967295 }), "{err}");
    }

    #[test]
    fn map_is_lazy_whatever_the_size() {
        let huge = memfd(64 << 18); // 64 GiB, sparse
        let space = DmaSpace::default();
        space.map(1 << 40, 64 << 30, huge.as_fd(), 0, RW).unwrap();
        let stats = space.stats();
        assert_eq!(stats.bookkeeping_bytes, 0);
        assert_eq!(stats.mapped_bytes, 64 << 30);
        // Pinning one page allocates one slot's small-record array (19 KiB, a track-mode call) or one
        // chunk of counts, nothing per page of the mapping.
        let last = (1u64 << 40) + (64 << 30) - PAGE_SIZE;
        let pins = space.pin_range(last, 1, Prot::READ).unwrap();
        let bytes = space.stats().bookkeeping_bytes;
        assert!(bytes > 0 && bytes <= 20 << 10, "{bytes}");
        drop(pins);
        space.unmap(1 << 40, 64 << 30).unwrap();
    }

    #[test]
    fn unmap_takes_whole_mappings_only() {
        let space = DmaSpace::default();
        let file = memfd(16);
        let p = PAGE_SIZE;
        space.map(0, 4 * p, file.as_fd(), 0, RW).unwrap();
        space.map(4 * p, 4 * p, file.as_fd(), 0, RW).unwrap();
        space.map_message_only(16 * p, 4 * p, Prot::READ).unwrap();
        assert!(matches!(space.unmap(0, 0), Err(UnmapError::InvalidRange { .. })));
        assert!(matches!(space.unmap(1, p), Err(UnmapError::InvalidRange { .. })));
        assert!(matches!(space.unmap(u64::MAX - p + 1, 2 * p), Err(UnmapError::InvalidRange { .. })));
        let err = space.unmap(32 * p, p).unwrap_err();
        assert!(matches!(err, UnmapError::NotMapped { .. }));
        assert_eq!(err.errno(), libc::ENOENT);
        assert!(matches!(space.unmap(p, 4 * p), Err(UnmapError::SplitsMapping { mapping_iova: 0, .. })));
        assert!(matches!(space.unmap(2 * p, 2 * p), Err(UnmapError::SplitsMapping { mapping_iova: 0, .. })));
        assert_eq!(space.mappings().len(), 3);
        // One range covering two whole mappings.
        assert_eq!(space.unmap(0, 8 * p).unwrap(), Unmapped { mappings: 2, bytes: 8 * p });
        assert_eq!(space.unmap_all().unwrap(), Unmapped { mappings: 1, bytes: 4 * p });
        assert!(space.mappings().is_empty());
        assert_eq!(space.unmap_all().unwrap(), Unmapped::default());
    }

    #[test]
    fn message_only_regions_are_known_but_not_pinnable() {
        let space = DmaSpace::default();
        space.map_message_only(0xc0000, 0x20000, Prot::READ).unwrap();
        let info = space.lookup(0xc1234).unwrap();
        assert!(!info.has_memory);
        assert_eq!(info.iova, 0xc0000);
        let err = space.pin_range(0xc0000, 1, Prot::READ).unwrap_err();
        assert!(matches!(err, PinError::NoHostMemory { index: 0, .. }), "{err}");
        let file = memfd(1);
        assert!(matches!(space.map(0xc8000, PAGE_SIZE, file.as_fd(), 0, RW), Err(MapError::Overlap { .. })));
    }

    #[test]
    fn unmap_notifies_and_waits_for_pins_to_drop() {
        let space = DmaSpace::default();
        let file = memfd(8);
        space.map(0x100000, 8 * PAGE_SIZE, file.as_fd(), 0, RW).unwrap();
        let held = Arc::new(Mutex::new(Some(space.pin_range(0x102000, 2, Prot::READ).unwrap())));
        let calls = Arc::new(Mutex::new(Vec::new()));
        let refused = Arc::new(AtomicU64::new(0));
        let notifier: UnmapNotifier = {
            let (held, calls, refused) = (held.clone(), calls.clone(), refused.clone());
            let weak = Arc::downgrade(&space.inner);
            Arc::new(move |iova, len| {
                calls.lock().unwrap().push((iova, len));
                // While the unmap waits, no new pins are granted in the range.
                let space = DmaSpace { inner: weak.upgrade().unwrap() };
                if let Err(PinError::Unmapping { .. }) = space.pin_range(0x100000, 1, Prot::READ) {
                    refused.fetch_add(1, Ordering::Relaxed);
                }
                // Drop the pins from another thread, a little later, as a device would.
                let held = held.clone();
                std::thread::spawn(move || {
                    std::thread::sleep(Duration::from_millis(20));
                    held.lock().unwrap().take();
                });
            })
        };
        space.set_unmap_notifier(Some(notifier));
        space.unmap(0x100000, 8 * PAGE_SIZE).unwrap();
        assert_eq!(*calls.lock().unwrap(), vec![(0x100000, 8 * PAGE_SIZE)]);
        assert_eq!(refused.load(Ordering::Relaxed), 1);
        assert!(space.lookup(0x100000).is_none());
        let stats = space.stats();
        assert_eq!((stats.unmap_waits, stats.unmap_busy, stats.notifier_calls), (1, 0, 1));
    }

    #[test]
    fn an_unmap_waiting_for_pins_returns_when_they_drop_not_at_its_timeout_in_both_modes() {
        for mode in [PinMode::Track, PinMode::Lock] {
            let space = DmaSpace::new(DmaSpaceConfig {
                mode,
                account: Arc::new(LockAccount::unlimited()),
                unmap_timeout: Duration::from_secs(60),
                ..Default::default()
            });
            let file = memfd(8);
            space.map(0, 8 * PAGE_SIZE, file.as_fd(), 0, RW).unwrap();
            let guard = space.pin_pages(&[1, 2, 5], Prot::READ).unwrap();
            let kept = space.pin_range(3 * PAGE_SIZE, 2, Prot::READ).unwrap();
            kept.forget();
            let start = Instant::now();
            std::thread::scope(|s| {
                s.spawn(|| {
                    std::thread::sleep(Duration::from_millis(20));
                    drop(guard);
                    std::thread::sleep(Duration::from_millis(20));
                    space.unpin_range(3 * PAGE_SIZE, 2).unwrap();
                });
                space.unmap(0, 8 * PAGE_SIZE).unwrap();
            });
            // Woken by the last drop (or its next look, a millisecond on), never the timeout.
            assert!(start.elapsed() < Duration::from_secs(30), "{mode}: {:?}", start.elapsed());
            assert!(space.lookup(0).is_none());
            assert_eq!(space.stats().pins_held, 0);
        }
    }

    #[test]
    fn unmap_fails_busy_and_keeps_the_mapping_when_pins_stay() {
        let space =
            DmaSpace::new(DmaSpaceConfig { unmap_timeout: Duration::from_millis(30), ..Default::default() });
        let file = memfd(8);
        space.map(0, 4 * PAGE_SIZE, file.as_fd(), 0, RW).unwrap();
        space.map(4 * PAGE_SIZE, 4 * PAGE_SIZE, file.as_fd(), 0, RW).unwrap();
        let pins = space.pin_range(PAGE_SIZE, 1, Prot::WRITE).unwrap();
        let err = space.unmap_all().unwrap_err();
        assert!(matches!(err, UnmapError::Busy { iova: 0, pins: 1, .. }), "{err}");
        assert_eq!(err.errno(), libc::EBUSY);
        // Nothing was removed, not even the idle mapping, and pins are granted again.
        assert_eq!(space.mappings().len(), 2);
        pins.write(0, b"still mapped").unwrap();
        space.pin_range(5 * PAGE_SIZE, 1, Prot::READ).unwrap().unpin();
        drop(pins);
        assert_eq!(space.unmap_all().unwrap().mappings, 2);
        assert_eq!(space.stats().unmap_busy, 1);
    }

    #[test]
    fn a_guard_keeps_memory_mapped_after_abandon() {
        let space = DmaSpace::default();
        let file = memfd(2);
        space.map(0, 2 * PAGE_SIZE, file.as_fd(), 0, RW).unwrap();
        let pins = space.pin_range(0, 2, Prot::READ_WRITE).unwrap();
        assert_eq!(space.abandon_all().mappings, 1);
        assert!(space.mappings().is_empty());
        // The guard still reaches its memory, and still unpins cleanly.
        pins.write(PAGE_SIZE, b"x").unwrap();
        drop(pins);
        let mut b = [0u8];
        std::os::unix::fs::FileExt::read_exact_at(&file, &mut b, PAGE_SIZE).unwrap();
        assert_eq!(&b, b"x");
    }
}
