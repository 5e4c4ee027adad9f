//! A run: consecutive entries of a call with consecutive pages in one mapping.

use smallvec::SmallVec;

use crate::page::{iova_of, PAGE_SHIFT, PAGE_SIZE};

/// Consecutive entries of a pin call with consecutive page numbers in one mapping, pinned as
/// one step. Host memory of a run is contiguous.
// Four words: a call writes one per run, and 8-run small records stay small. Pages and
// position fit 32 bits (`max_pages_per_call` is at most 2^32 - 1); the run's page within its
// mapping is not kept but derived from the IOVA (`PinnedRun::page_in`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PinnedRun {
    pub(crate) iova: u64,
    pub(crate) host: usize,
    npages: u32,
    index: u32,
    /// Which of the guard's mappings holds the run.
    mapping_index: u32,
}

const _: () = assert!(std::mem::size_of::<PinnedRun>() == 32);

impl PinnedRun {
    /// No run (a free entry's contents).
    pub(crate) const EMPTY: PinnedRun = PinnedRun { iova: 0, host: 0, npages: 0, index: 0, mapping_index: 0 };

    /// A run of `npages` pages from page `pfn`, entry `index` of its call, in the guard's
    /// mapping `mapping_index`, at `host`. `npages` and `index` are below the call's length, which
    /// `max_pages_per_call` keeps within 32 bits.
    #[inline(always)]
    pub(crate) fn new(pfn: u64, npages: u64, index: usize, host: usize, mapping_index: usize) -> Self {
        debug_assert!(
            npages <= u64::from(u32::MAX) && index <= u32::MAX as usize && mapping_index <= u32::MAX as usize
        );
        PinnedRun {
            iova: iova_of(pfn),
            host,
            npages: npages as u32,
            index: index as u32,
            mapping_index: mapping_index as u32,
        }
    }

    /// Which of the guard's mappings holds the run.
    #[inline]
    pub(crate) fn mapping_index(&self) -> usize {
        self.mapping_index as usize
    }

    /// The run's first page as an offset within the mapping that holds it, whose first
    /// page is `mapping_first_pfn`.
    #[inline]
    pub(crate) fn page_in(&self, mapping_first_pfn: u64) -> u64 {
        (self.iova >> PAGE_SHIFT) - mapping_first_pfn
    }

    /// IOVA of the run's first page.
    #[inline]
    pub fn iova(&self) -> u64 {
        self.iova
    }
    /// Pages in the run.
    #[inline]
    pub fn npages(&self) -> u64 {
        u64::from(self.npages)
    }
    /// Position of the run's first page in the call's array.
    #[inline]
    pub fn index(&self) -> usize {
        self.index as usize
    }
    /// Host address of the run's first page. Valid while the pins are held.
    #[inline]
    pub fn host_addr(&self) -> usize {
        self.host
    }
    /// Bytes in the run.
    #[inline]
    pub fn len(&self) -> u64 {
        self.npages() * PAGE_SIZE
    }
    /// Always false: runs hold at least one page.
    pub fn is_empty(&self) -> bool {
        self.npages == 0
    }
}

/// A scatter-gather element: host-adjacent consecutive runs merged.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Segment {
    /// Host address of the first byte.
    pub host_addr: usize,
    /// Bytes.
    pub len: u64,
    /// Position of the segment's first page in the call's array.
    pub index: usize,
}

/// The runs of a call: most calls have one or two.
pub(crate) type Runs = SmallVec<[PinnedRun; 2]>;
