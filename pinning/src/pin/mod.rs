//! Pinning: an arbitrary array of IOVA page numbers, pinned one call per contiguous run.
//!
//! Every call is cut into maximal runs of consecutive entries with consecutive page numbers
//! inside one mapping (`[1,5,6,7,9]` gives `[1] [5,6,7] [9]`) by one loop (`plan`), under
//! the mapping table's read (the thread's shard lock), and is all-or-nothing.
//!
//! - Track mode (the default, `track`): the runs go into a record of the thread's shard,
//!   which the guard points at; no per-page work.
//! - Lock mode (`lock_mode`): the runs go into a plan that holds its mappings; then the
//!   mappings' locks are taken in id order, each run is counted per page and its newly
//!   pinned pages mlocked, and on any failure the runs already pinned are unwound.
//! - Kernel mode (`kernel_mode`): track mode's record, and the kernel's own long-term pin
//!   of each run (a registered io_uring buffer), one kernel call per pin call.
//!
//! The guard (`guard`) lets go of the pins as it drops; `unpin` takes back pins kept with
//! `forget`; `error` says why a call failed.

mod error;
mod guard;
mod kernel_mode;
mod lock_mode;
mod plan;
#[cfg(test)]
mod tests;
#[cfg(test)]
mod tests_kernel_mode;
#[cfg(test)]
mod tests_lock_mode;
mod track;
mod unpin;

pub use error::{AccessError, PinError, UnpinError};
pub use guard::{PinnedPages, RegisteredBuffer};

use crate::account::PinMode;
use crate::page::{Prot, PAGE_SHIFT, PAGE_SIZE};
use crate::space::DmaSpace;
use plan::{cut, Entries, PageArray, PageRange, Plan, PlanSink, TranslateSink};

impl DmaSpace {
    /// Pins the pages named by `pfns` (IOVA page numbers, any order, repeats pinned again)
    /// for `prot` access. Consecutive entries with consecutive page numbers in one mapping
    /// are pinned as one run with one step.
    ///
    /// The pins are held until the returned guard drops (or [`PinnedPages::forget`] hands
    /// them to [`DmaSpace::unpin_pages`]). On error nothing stays pinned.
    ///
    /// `prot` must ask for some access: [`Prot::READ`], [`Prot::WRITE`] or both. A pin is the
    /// device's leave to read or write the pages, so one for neither ([`Prot::empty()`]) is
    /// refused with [`PinError::NoAccess`] (`EINVAL`), in every mode, before the pages are
    /// looked at.
    ///
    /// Units: `pin_pages` and `unpin_pages` take page numbers; `pin_range`, `unpin_range`
    /// and `pin_count` take byte addresses (IOVAs). In [`PinMode::Kernel`] every pin is taken
    /// for writing (io_uring registers buffers so), so a mapping granted read-only refuses
    /// even a [`Prot::READ`] pin (`PinError::Permission` naming READ|WRITE).
    pub fn pin_pages(&self, pfns: &[u64], prot: Prot) -> Result<PinnedPages, PinError> {
        self.pin(prot, PageArray(pfns))
    }

    /// Pins the `npages` pages from `iova` (page aligned; rounded down otherwise). The range
    /// may span adjacent mappings; it is pinned one run per mapping. `prot` and the errors
    /// are [`DmaSpace::pin_pages`]'s ([`Prot::empty()`] is refused with [`PinError::NoAccess`]).
    pub fn pin_range(&self, iova: u64, npages: u64, prot: Prot) -> Result<PinnedPages, PinError> {
        self.pin(prot, PageRange { pfn: iova >> PAGE_SHIFT, npages })
    }

    /// Pins the page of `iova` for `prot` if track mode's fast path can: a live mapping with
    /// host memory that permits `prot`, and room in the shard's small records and stock.
    /// `None` otherwise, with nothing counted (no pin failure, no pin): for a caller that then
    /// takes its general path, which reports the exact refusal (a copy of guest bytes within
    /// one page, say). Always `None` in lock and kernel mode.
    pub fn try_pin_page(&self, iova: u64, prot: Prot) -> Option<PinnedPages> {
        if self.mode() != PinMode::Track {
            return None;
        }
        let mut read = self.read_table();
        track::pin_fast(self, &mut read, prot, PageRange { pfn: iova >> PAGE_SHIFT, npages: 1 })
            .map(PinnedPages::recorded)
    }

    #[inline(always)]
    fn pin(&self, prot: Prot, entries: impl Entries) -> Result<PinnedPages, PinError> {
        if self.mode() == PinMode::Track {
            // The small-record fast path, else the general one, under one take of this
            // thread's shard lock.
            let mut read = self.read_table();
            if let Some(record) = track::pin_fast(self, &mut read, prot, entries) {
                return Ok(PinnedPages::recorded(record));
            }
            return track::pin_recorded(self, read, prot, entries, None).map(PinnedPages::recorded);
        }
        self.pin_counted_or_kernel(prot, entries)
    }

    /// Lock and kernel mode's pins: out of line, so that track mode's path makes one test of
    /// the mode (the three-way test cost a one-page pin 3 instructions more).
    #[inline(never)]
    fn pin_counted_or_kernel(&self, prot: Prot, entries: impl Entries) -> Result<PinnedPages, PinError> {
        if self.mode() == PinMode::Kernel {
            return kernel_mode::pin(self, prot, entries).map(PinnedPages::recorded);
        }
        let planned = entries.check(self.config().max_pages_per_call, prot).and_then(|()| {
            let mut plan = Plan::boxed(prot);
            plan.reserve_for(entries);
            let mut read = self.read_table();
            let (table, shard) = read.parts();
            match cut(table, &mut shard.hint, entries, &mut PlanSink::<PinError>::new(&mut plan)) {
                Ok(()) => Ok(plan),
                Err(e) => {
                    drop(read);
                    Plan::recycle(plan);
                    Err(e)
                }
            }
        });
        lock_mode::apply(self, planned).map(PinnedPages::counted)
    }

    /// Translates `pfns` the way [`DmaSpace::pin_pages`] does (the same table, run splitting
    /// and access checks, [`Prot::empty()`] refused with [`PinError::NoAccess`], but for
    /// poisoning, which only a pin refuses) but takes no pins and
    /// allocates nothing: `f(index, host_addr, npages)` gets each run in order. Nothing keeps
    /// the memory mapped afterwards, so the addresses are only as good as the caller's own
    /// knowledge that no unmap happens: this is plain translation as an unsafe translator
    /// (libvfio-user's `vfu_addr_to_sgl`) does it, the floor pinbench measures pins against.
    ///
    /// `f` runs under the table's read lock (this thread's shard): it should only record the
    /// runs. A call into this space that takes the shard's lock (a pin, an unpin, a map, the
    /// drop of a guard that retires its record there) panics: the lock refuses the thread that holds it (I19).
    pub fn translate_pages(
        &self,
        pfns: &[u64],
        prot: Prot,
        f: impl FnMut(usize, usize, u64),
    ) -> Result<(), PinError> {
        let entries = PageArray(pfns);
        entries.check(self.config().max_pages_per_call, prot)?;
        let mut read = self.read_table();
        let (table, shard) = read.parts();
        cut(table, &mut shard.hint, entries, &mut TranslateSink { prot, report: f })
    }

    /// Asks the CPU to start loading `[iova, iova + len)` of guest memory into its caches,
    /// up to the end of `iova`'s page: for a device that knows what it will read next (the
    /// next command's PRP list, say) and has other work to do first. A hint only: it takes no
    /// pin, reads and writes nothing, and does nothing where no host memory is mapped.
    pub fn prefetch(&self, iova: u64, len: usize) {
        let in_page = (PAGE_SIZE - iova % PAGE_SIZE) as usize;
        let len = len.min(in_page);
        if len == 0 {
            return;
        }
        let pfn = iova >> PAGE_SHIFT;
        let mut read = self.read_table();
        let (table, shard) = read.parts();
        let Some(mapping) = plan::lookup(table, &mut shard.hint, pfn) else {
            return;
        };
        let Some(page) = mapping.host_addr(pfn - mapping.first_pfn) else {
            return;
        };
        let start = page + (iova % PAGE_SIZE) as usize;
        #[cfg(target_arch = "x86_64")]
        for line in (start & !63..start + len).step_by(64) {
            // SAFETY: (I2, I13) while this thread's shard lock is held the mapping stays in
            // the table and its memory mapped, and `line` lies in one of its pages; a
            // prefetch reads nothing and cannot fault.
            unsafe {
                std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(line as *const i8)
            };
        }
        #[cfg(not(target_arch = "x86_64"))]
        let _ = start;
    }
}
