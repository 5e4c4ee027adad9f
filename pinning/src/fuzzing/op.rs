//! The ops a model-checked sequence is made of, and the limits of the space they run in.

use crate::PAGE_SHIFT;
use crate::PAGE_SIZE;

pub(super) const P: u64 = PAGE_SIZE;
/// Pages of the low window that mappings may start in; pins also name the 4 pages past it.
pub const LOW_PAGES: u64 = 64;
/// Pages of the high window, which ends at the last page with a byte address.
pub const HIGH_PAGES: u64 = 16;
/// First page of the high window.
pub const HIGH_BASE: u64 = (1 << (64 - PAGE_SHIFT)) - HIGH_PAGES;
/// Page numbers without a byte address (at or above `2^52`), which pin arrays may name.
pub const SPECIAL_PFNS: [u64; 4] =
    [1 << (64 - PAGE_SHIFT), (1 << (64 - PAGE_SHIFT)) + 1, u64::MAX - 1, u64::MAX];
/// The space's mapping limit.
pub const MAX_MAPPINGS: usize = 4;
/// The lock account's limit, in pages (lock mode).
pub const LOCK_LIMIT_PAGES: u64 = 12;
/// The space's `max_pages_per_call`.
pub const MAX_PAGES_PER_CALL: u64 = 16;
/// The space's `max_pins`.
pub const MAX_PINS: u64 = 24;
/// Most ops one input runs.
pub const MAX_OPS: usize = 256;

/// One step of a model-checked sequence. Pages are IOVA page numbers.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Op {
    /// Map `pages` pages at `page` with `prot` bits (0 is refused), from a memfd at
    /// `offset_pages` pages in, or without an fd.
    Map {
        /// First page.
        page: u64,
        /// Pages (0 is refused).
        pages: u64,
        /// `Prot` bits, 0 to 3.
        prot: u32,
        /// Without an fd (a message-only region).
        message_only: bool,
        /// File offset of the mapping, in pages.
        offset_pages: u64,
    },
    /// Unmap `[page, page + pages)`.
    Unmap {
        /// First page.
        page: u64,
        /// Pages.
        pages: u64,
    },
    /// Unmap everything.
    UnmapAll,
    /// Pin an array of pages; the guard is kept.
    Pin {
        /// The array.
        pfns: Vec<u64>,
        /// The access asked for: `Prot` bits, 0 to 3 (0, no access, is refused).
        prot: u32,
    },
    /// Pin a range of pages; the guard is kept.
    PinRange {
        /// First page.
        page: u64,
        /// Pages.
        pages: u64,
        /// The access asked for: `Prot` bits, 0 to 3 (0, no access, is refused).
        prot: u32,
    },
    /// Drop a kept guard (`which` modulo their number).
    Drop {
        /// Which guard.
        which: usize,
    },
    /// Forget a kept guard: its pins are released later by [`Op::UnpinKept`].
    Forget {
        /// Which guard.
        which: usize,
    },
    /// Unpin the pages of a forgotten guard with `unpin_pages`: all of them, or (`part`
    /// non-zero) only its first `1 + part % len` entries, which can cut through one of its
    /// runs; the rest stay kept.
    UnpinKept {
        /// Which forgotten guard.
        which: usize,
        /// 0: every page; else how many leading entries (modulo the guard's length, plus 1).
        part: u8,
    },
    /// `unpin_pages` of an arbitrary array, run only when the model says it must fail (a
    /// successful one would take pins a guard owns).
    UnpinAny {
        /// The array.
        pfns: Vec<u64>,
    },
    /// `unpin_range` of an arbitrary range, run only when the model says it must fail.
    UnpinAnyRange {
        /// First page.
        page: u64,
        /// Pages.
        pages: u64,
    },
    /// Write (optionally) then read `len` bytes at `offset` of a kept guard's buffer.
    Access {
        /// Which guard.
        which: usize,
        /// Byte offset in the guard's buffer.
        offset: u64,
        /// Bytes.
        len: u64,
        /// Write a pattern first.
        write: bool,
    },
}

/// The one-past-the-end page of `[page, page + pages)`, if it has a byte address.
pub(super) fn range_end(page: u64, pages: u64) -> Option<u64> {
    page.checked_add(pages).filter(|&end| end <= 1 << (64 - PAGE_SHIFT))
}
