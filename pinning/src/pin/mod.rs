//! Pinning: an arbitrary array of IOVA page numbers, pinned one call per contiguous run.
//!
//! A call is planned first, under the mapping table's read lock: the array is cut into
//! maximal runs of consecutive entries with consecutive page numbers inside one mapping
//! (`[1,5,6,7,9]` gives `[1] [5,6,7] [9]`), each run checked for access. Then the locks of
//! the mappings involved are taken in id order and held for the whole call, so the call
//! is all-or-nothing even when it repeats pages or spans mappings: every run is pinned with
//! one table step (and, in lock mode, one accounting step and one mlock per sub-run of newly
//! pinned pages), and on any failure the runs already pinned are unwound.

mod error;
mod guard;
mod lock_mode;
mod plan;
#[cfg(test)]
mod tests;
mod track;
mod unpin;

use crate::account::PinMode;
use crate::page::{iova_of_checked, Prot, PAGE_SHIFT, PAGE_SIZE};
use crate::run_scan::run_length;
use crate::space::DmaSpace;
use std::sync::atomic::Ordering;

pub use error::{AccessError, PinError, UnpinError};
pub use guard::PinnedPages;
use plan::{lookup, Entries, Planner};

impl DmaSpace {
    fn check_count(&self, npages: u64) -> Result<(), PinError> {
        let max = self.config().max_pages_per_call;
        match npages {
            0 => Err(PinError::Empty),
            n if n > max => Err(PinError::TooManyPages { requested: n, max }),
            _ => Ok(()),
        }
    }

    /// Pins the pages named by `pfns` (IOVA page numbers, any order, repeats pinned again)
    /// for `prot` access. Consecutive entries with consecutive page numbers in one mapping
    /// are pinned as one run with one step.
    ///
    /// The pins are held until the returned guard drops (or [`PinnedPages::forget`] hands
    /// them to [`DmaSpace::unpin_pages`]). On error nothing stays pinned.
    pub fn pin_pages(&self, pfns: &[u64], prot: Prot) -> Result<PinnedPages, PinError> {
        if self.mode() == PinMode::Track {
            return self.pin_tracked(prot, Entries::Array(pfns));
        }
        if let Err(e) = self.check_count(pfns.len() as u64) {
            self.counters().pin_failures.fetch_add(1, Ordering::Relaxed);
            return Err(e);
        }
        let plan = Planner::boxed(&mut self.read_table(), prot, |p| p.plan_array(pfns));
        self.apply(plan)
    }

    /// Pins the `npages` pages from `iova` (page aligned; rounded down otherwise). The range
    /// may span adjacent mappings; it is pinned one run per mapping.
    pub fn pin_range(&self, iova: u64, npages: u64, prot: Prot) -> Result<PinnedPages, PinError> {
        let pfn = iova >> PAGE_SHIFT;
        if self.mode() == PinMode::Track {
            return self.pin_tracked(prot, Entries::Range(pfn, npages));
        }
        self.check_range(pfn, npages)?;
        let plan = Planner::boxed(&mut self.read_table(), prot, |p| p.plan_range(pfn, npages));
        self.apply(plan)
    }

    /// Checks a range call's count and that its pages have IOVAs; counts a failure.
    fn check_range(&self, pfn: u64, npages: u64) -> Result<(), PinError> {
        let valid = self.check_count(npages).and_then(|()| {
            match pfn.checked_add(npages - 1).and_then(iova_of_checked) {
                Some(_) => Ok(()),
                None => Err(PinError::NotMapped { index: 0, pfn }),
            }
        });
        if valid.is_err() {
            self.counters().pin_failures.fetch_add(1, Ordering::Relaxed);
        }
        valid
    }

    /// Translates `pfns` the way [`DmaSpace::pin_pages`] does (the same table, run splitting
    /// and access checks) but takes no pins and allocates nothing: `f(index, host_addr,
    /// npages)` gets each run in order. Nothing keeps the memory mapped afterwards, so the
    /// addresses are only as good as the caller's own knowledge that no unmap happens: this is
    /// plain translation as an unsafe translator (libvfio-user's `vfu_addr_to_sgl`) does it,
    /// the floor pinbench measures pins against.
    ///
    /// `f` runs under the table's read lock (this thread's shard): it must not call into this
    /// space (pin, unpin, drop a guard of it, map, look up); it should only record the runs.
    pub fn translate_pages(
        &self,
        pfns: &[u64],
        prot: Prot,
        mut f: impl FnMut(usize, usize, u64),
    ) -> Result<(), PinError> {
        self.check_count(pfns.len() as u64)?;
        let mut read = self.read_table();
        let (table, shard) = read.parts();
        // The mapping last resolved: first page, end page, host address of its first page.
        let mut hint: Option<(u64, u64, usize)> = None;
        let mut i = 0;
        while i < pfns.len() {
            let start = pfns[i];
            let (first, end, host) = match hint {
                Some(h @ (first, end, _)) if start >= first && start < end => h,
                _ => {
                    let Some(m) = lookup(table, &mut shard.hint, start) else {
                        return Err(PinError::NotMapped { index: i, pfn: start });
                    };
                    if !m.prot.contains(prot) {
                        return Err(PinError::Permission {
                            index: i,
                            pfn: start,
                            wanted: prot,
                            have: m.prot,
                        });
                    }
                    let Some(host) = m.host_addr(0) else {
                        return Err(PinError::NoHostMemory { index: i, pfn: start });
                    };
                    let h = (m.first_pfn, m.end_pfn(), host);
                    hint = Some(h);
                    h
                }
            };
            let n = run_length(&pfns[i..], end - start);
            f(i, host + ((start - first) * PAGE_SIZE) as usize, n);
            i += n as usize;
        }
        Ok(())
    }
}
