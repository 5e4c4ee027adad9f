//! A space's configuration, errors and reports.

use std::sync::Arc;
use std::time::Duration;

use serde::Serialize;
use thiserror::Error;

use crate::account::{LockAccount, PinMode};
use crate::mmap::MmapError;
use crate::page::Prot;

/// The device's `dma_unmap(iova, len)`: told that `[iova, iova + len)` is being unmapped
/// and that it must drop its pins there.
///
/// Called on the thread doing the unmap, with no engine lock held, so it may unpin (or wait
/// for its own threads to unpin). It must not map or unmap in the same space. Called once
/// per mapping that holds pins in the unmapped range, with that whole mapping's IOVA range
/// (a mapping leaves whole; an unmap never splits one). A device that owns its DMA space
/// should capture it weakly, or the two keep each other alive (or clear the notifier with
/// `set_unmap_notifier(None)` when it is done).
pub type UnmapNotifier = Arc<dyn Fn(u64, u64) + Send + Sync>;

/// [`DmaSpaceConfig::max_mapped_bytes`] by default: 16 TiB.
pub const DEFAULT_MAX_MAPPED_BYTES: u64 = 16 << 40;

/// How a [`crate::DmaSpace`] behaves; `Default` gives the documented defaults.
#[derive(Clone, Debug)]
pub struct DmaSpaceConfig {
    /// Most mappings at once (default 4096; each is a VMA, counted against the process's
    /// `vm.max_map_count`).
    pub max_mappings: usize,
    /// Most bytes of fd-backed mappings at once (default 16 TiB, a quarter of the process's
    /// budget for all spaces, [`crate::process_mapped_bytes_limit`]): one client cannot
    /// take the whole budget and leave the process's other clients none.
    pub max_mapped_bytes: u64,
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
    /// Kernel mode: slots in the space's table of registered buffers, the most buffers its
    /// pins hold at once (a buffer per run, per GiB of a longer run). Default 4096, at most
    /// [`crate::MAX_KERNEL_BUFFERS`] (the kernel's limit). A call whose runs find no room
    /// fails with [`crate::PinError::KernelBuffers`]. A bigger table costs on huge pages:
    /// registering a buffer of them, the kernel looks at every slot (about 0.6 ns each here:
    /// a 1-page register and clear takes 3.3 us with 4096 slots, 9.9 us with 16384).
    pub kernel_buffers: u32,
}

impl Default for DmaSpaceConfig {
    fn default() -> Self {
        DmaSpaceConfig {
            max_mappings: 4096,
            max_mapped_bytes: DEFAULT_MAX_MAPPED_BYTES,
            mode: PinMode::Track,
            account: Arc::new(LockAccount::for_this_process()),
            unmap_timeout: Duration::from_secs(2),
            max_pages_per_call: 1 << 18,
            max_pins: 1 << 24,
            kernel_buffers: 4096,
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
    /// The mapping would take the space's fd-backed mappings past
    /// [`DmaSpaceConfig::max_mapped_bytes`].
    #[error(
        "{size:#x} more bytes of mappings would pass the space's limit of {max:#x} (it holds {held:#x})"
    )]
    TooManyBytes {
        /// The mapping's size.
        size: u64,
        /// Bytes of fd-backed mappings the space holds.
        held: u64,
        /// The configured maximum.
        max: u64,
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
            MapError::TooManyBytes { .. }
            | MapError::Backing(MmapError::ProcessLimit { .. } | MmapError::ProcessBytes { .. }) => {
                libc::ENOMEM
            }
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
    /// Unique within the process for the mapping's life and after it: a mapping made later
    /// at the same IOVA has another.
    #[serde(skip)]
    pub id: u64,
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
    /// Heap bytes of pin bookkeeping: per-page count chunks and the shards' small-record
    /// arrays (19 KiB per shard that has pinned, allocated at its first small call).
    pub bookkeeping_bytes: u64,
    /// Mappings whose file the client truncated under them (now zero pages, no new pins).
    pub poisoned_mappings: u64,
    /// Kernel mode: kernel pin calls (registrations: one per pin call, one buffer per run).
    pub kernel_pin_calls: u64,
    /// Kernel mode: kernel unpin calls (one per guard or kept buffer let go).
    pub kernel_unpin_calls: u64,
    /// Kernel mode: buffers registered (runs, and the further GiB pieces of cut runs).
    pub kernel_buffers: u64,
    /// Kernel mode: pages registered (a page pinned by two calls counts twice).
    pub kernel_pages: u64,
    /// Kernel mode: runs longer than a buffer may be (1 GiB), cut into several.
    pub kernel_cut_runs: u64,
    /// Kernel mode: buffers registered now (slots of the space's table in use).
    pub kernel_buffers_held: u64,
    /// Kernel mode: pages registered now (what the kernel holds pinned for the space, each
    /// page once per buffer).
    pub kernel_pages_held: u64,
}
