//! Unpinning pins kept with `PinnedPages::forget` (the `vfio_unpin_pages` model).

use smallvec::SmallVec;

use super::error::UnpinError;
use super::lock_mode::MappingGuards;
use super::plan::{cut, Entries, PageArray, PageRange, Plan, PlanSink};
use crate::account::PinMode;
use crate::mapping::Released;
use crate::page::PAGE_SHIFT;
use crate::space::DmaSpace;

impl DmaSpace {
    /// Drops one pin from each page named by `pfns`, as taken by [`DmaSpace::pin_pages`] and
    /// kept with [`crate::PinnedPages::forget`]. If any page is not pinned (counting repeats
    /// in `pfns`), nothing changes. Only kept pins are found, in every mode: the pins of a
    /// live guard are its own, released when it drops (`NotPinned` for a page only a live
    /// guard pins).
    pub fn unpin_pages(&self, pfns: &[u64]) -> Result<(), UnpinError> {
        self.unpin(PageArray(pfns))
    }

    /// Drops one pin from each of the `npages` pages from `iova`.
    pub fn unpin_range(&self, iova: u64, npages: u64) -> Result<(), UnpinError> {
        self.unpin(PageRange { pfn: iova >> PAGE_SHIFT, npages })
    }

    fn unpin(&self, entries: impl Entries) -> Result<(), UnpinError> {
        let result = entries.check_unpin(self.config().max_pages_per_call).and_then(|()| {
            let mut plan = Plan::default();
            plan.reserve_for(entries);
            let mut read = self.read_table();
            let (table, shard) = read.parts();
            cut(table, &mut shard.hint, entries, &mut PlanSink::<UnpinError>::new(&mut plan))?;
            drop(read);
            Self::unpin_plan(&plan)
        });
        self.inner.count(|c| match result {
            Ok(()) => c.unpin_calls += 1,
            Err(_) => c.unpin_failures += 1,
        });
        result
    }

    /// Takes one pin per page of the plan's runs, all or nothing: each run is checked as it
    /// is taken (I12), and a run that fails puts back what the call took.
    fn unpin_plan(plan: &Plan) -> Result<(), UnpinError> {
        let mut held = MappingGuards::take(&plan.mappings);
        let mut released: SmallVec<[Released; 2]> = plan.mappings.iter().map(|_| Released::new()).collect();
        // Lock mode counts live guards' pins per page too: a page's kept pins are counted
        // apart, and only those are taken.
        let lock = plan.mappings.first().is_some_and(|m| m.policy.mode == PinMode::Lock);
        for (done, run) in plan.runs.iter().enumerate() {
            let mi = run.mapping_index();
            let mapping = &plan.mappings[mi];
            let first = mapping.run_page(run);
            let pins = held.get(mi);
            let kept = if lock {
                pins.kept_counts.as_mut().map_or(Err(first), |k| k.try_decrement(first, run.npages(), None))
            } else {
                Ok(0)
            };
            let unpinned = kept.and_then(|_| {
                mapping.try_unpin_run(pins, first, run.npages(), &mut released[mi]).inspect_err(|_| {
                    if let Some(k) = pins.kept_counts.as_mut().filter(|_| lock) {
                        debug_assert!(false, "lock mode: every kept pin is counted");
                        k.increment(first, run.npages());
                    }
                })
            });
            if let Err(page) = unpinned {
                // Put back what this call took; nothing was munlocked yet.
                for undo in plan.runs[..done].iter().rev() {
                    let m = &plan.mappings[undo.mapping_index()];
                    let pins = held.get(undo.mapping_index());
                    pins.page_counts.increment(m.run_page(undo), undo.npages());
                    if let Some(k) = pins.kept_counts.as_mut().filter(|_| lock) {
                        k.increment(m.run_page(undo), undo.npages());
                    }
                }
                let index = run.index() + (page - first) as usize;
                return Err(UnpinError::NotPinned {
                    index,
                    pfn: (run.iova() >> PAGE_SHIFT) + (page - first),
                });
            }
        }
        // Kernel mode: each page's pin is taken back from a kept buffer holding it; buffers
        // left holding none are let go below, with no engine lock held (I17).
        let mut emptied: Vec<(u32, u64)> = Vec::new();
        let kernel = plan.mappings.first().is_some_and(|m| m.policy.mode == PinMode::Kernel);
        if kernel {
            for run in &plan.runs {
                let mi = run.mapping_index();
                held.get(mi).take_kept(plan.mappings[mi].run_page(run), run.npages(), &mut emptied);
            }
        }
        for (mi, m) in plan.mappings.iter().enumerate() {
            m.release(held.get(mi), &released[mi]);
        }
        if let Some(m) = plan.mappings.first() {
            // Lock mode reserves from its first mapping's stock; the other modes from their
            // shard's, which this call does not hold: straight back to the space then.
            match m.policy.mode {
                PinMode::Lock => held.get(0).restock(&m.policy, plan.pages),
                PinMode::Track | PinMode::Kernel => m.policy.give(plan.pages),
            }
        }
        drop(held);
        if let Some(m) = plan.mappings.first().filter(|_| !emptied.is_empty()) {
            let table = m.policy.kernel_table();
            for (slot, pages) in emptied {
                table.release(slot, 1, pages);
            }
        }
        Ok(())
    }
}
