//! Why a pin, unpin or guard access failed.

use thiserror::Error;

use crate::account::OverLimit;
use crate::kernel::KernelPinsUnavailable;
use crate::page::Prot;

/// Why a pin call failed. Nothing stays pinned by a failed call.
///
/// `index` is the position in the caller's array of the first page that failed (for range
/// pins, the page's offset in the range) and `pfn` its IOVA page number.
#[derive(Debug, Error)]
pub enum PinError {
    /// The call asked for no access ([`Prot::empty()`]). A pin is the device's leave to read
    /// or write the pages (its guard's copies and slices, its host addresses): one for
    /// neither means nothing, so it is refused (`EINVAL`), as a mapping that grants neither
    /// is (`MapError::NoAccess`).
    #[error("a pin must ask for read or write access (or both); it asked for neither")]
    NoAccess,
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
    /// Kernel mode: the kernel refused to pin the run (or 1 GiB piece of it) starting at
    /// this page: `ENOMEM` over `RLIMIT_MEMLOCK` as the kernel accounts it (without
    /// `CAP_IPC_LOCK`), `EFAULT` where the memory cannot be pinned (past the end of a file
    /// the client truncated, say).
    #[error("page {index} (pfn {pfn:#x}): the kernel refused to pin it: {source}")]
    Kernel {
        /// Position in the call.
        index: usize,
        /// IOVA page number.
        pfn: u64,
        /// The kernel's error.
        source: std::io::Error,
    },
    /// Kernel mode: the space's table of registered buffers has no `requested` consecutive
    /// free slots (`DmaSpaceConfig::kernel_buffers`).
    #[error("{requested} kernel buffers wanted, the space's table of {size} has {free} free")]
    KernelBuffers {
        /// Buffers the call needs (one per run, per GiB of a longer run).
        requested: u64,
        /// Slots free (not necessarily consecutive).
        free: u32,
        /// Slots in the table.
        size: u32,
    },
    /// Kernel mode could not start in this process (no io_uring buffer registration).
    #[error(transparent)]
    KernelUnavailable(#[from] KernelPinsUnavailable),
}

impl PinError {
    /// The errno a VFIO-style interface reports for this error.
    pub fn errno(&self) -> i32 {
        match self {
            PinError::NoAccess | PinError::Empty | PinError::NotMapped { .. } => libc::EINVAL,
            PinError::TooManyPages { .. } => libc::E2BIG,
            PinError::Permission { .. } => libc::EPERM,
            PinError::NoHostMemory { .. } | PinError::Poisoned { .. } => libc::EFAULT,
            PinError::Unmapping { .. } => libc::EBUSY,
            PinError::CountOverflow { .. } | PinError::PinLimit { .. } => libc::ENOSPC,
            PinError::LockLimit { .. } => libc::ENOMEM,
            PinError::Lock { source, .. } | PinError::Kernel { source, .. } => {
                source.raw_os_error().unwrap_or(libc::ENOMEM)
            }
            PinError::KernelBuffers { .. } => libc::ENOSPC,
            PinError::KernelUnavailable(why) => why.errno,
        }
    }
}

/// Why an unpin call failed. Nothing was unpinned.
#[derive(Debug, Error)]
pub enum UnpinError {
    /// The call named no pages, or too many, or a range that wraps past the end of the
    /// address space.
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
    /// The byte range crosses from one run to another that is not next to it in host
    /// memory, so no one slice holds it ([`crate::PinnedPages::slice`]).
    #[error("bytes [{offset:#x}, +{len:#x}) are not contiguous in host memory")]
    NotContiguous {
        /// Requested offset.
        offset: u64,
        /// Requested length.
        len: u64,
    },
    /// The pages were pinned without write access.
    #[error("the pages were pinned read-only")]
    ReadOnly,
    /// The client shrank the file behind the pages while they were pinned: the copy saw
    /// zero pages (a read) or was lost (a write).
    #[error("the client truncated the memory behind the pinned pages")]
    Poisoned,
}
