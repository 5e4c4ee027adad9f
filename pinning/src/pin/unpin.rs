//! Unpinning pins kept with `forget`.

use std::sync::atomic::Ordering;

use smallvec::SmallVec;

use super::lock_mode::MappingGuards;
use super::plan::{Plan, Planner};
use super::{PinError, UnpinError};
use crate::account::PinMode;
use crate::mapping::Released;
use crate::page::{iova_of_checked, Prot, PAGE_SHIFT};
use crate::space::DmaSpace;

/// An unpin call's plan, its planning error as an unpin error.
fn unpin_planned(plan: Result<Plan, PinError>) -> Result<Plan, UnpinError> {
    plan.map_err(|e| match e {
        PinError::NotMapped { index, pfn } => UnpinError::NotMapped { index, pfn },
        other => unreachable!("unpin planning only fails with NotMapped: {other}"),
    })
}

impl DmaSpace {
    /// Drops one pin from each page named by `pfns`, as taken by [`DmaSpace::pin_pages`] and
    /// kept with [`PinnedPages::forget`]. If any page is not pinned (counting repeats in
    /// `pfns`), nothing changes. In track mode only kept pins are found: the pins of a live
    /// guard are its own, released when it drops.
    pub fn unpin_pages(&self, pfns: &[u64]) -> Result<(), UnpinError> {
        let plan = self.check_unpin_count(pfns.len() as u64).and_then(|()| {
            unpin_planned(Planner::owned(&mut self.read_table(), Prot::empty(), false, |p| {
                p.plan_array(pfns)
            }))
        });
        self.unpin_plan(plan)
    }

    /// Drops one pin from each of the `npages` pages from `iova`.
    pub fn unpin_range(&self, iova: u64, npages: u64) -> Result<(), UnpinError> {
        let pfn = iova >> PAGE_SHIFT;
        if npages == 0 || pfn.checked_add(npages - 1).and_then(iova_of_checked).is_none() {
            return Err(UnpinError::InvalidCount(npages));
        }
        let plan = self.check_unpin_count(npages).and_then(|()| {
            unpin_planned(Planner::owned(&mut self.read_table(), Prot::empty(), false, |p| {
                p.plan_range(pfn, npages)
            }))
        });
        self.unpin_plan(plan)
    }

    fn check_unpin_count(&self, npages: u64) -> Result<(), UnpinError> {
        if npages == 0 || npages > self.config().max_pages_per_call {
            Err(UnpinError::InvalidCount(npages))
        } else {
            Ok(())
        }
    }

    fn unpin_plan(&self, plan: Result<Plan, UnpinError>) -> Result<(), UnpinError> {
        let counters = self.counters();
        let result = plan.and_then(|plan| Self::unpin_checked(&plan));
        let counter = if result.is_ok() { &counters.unpin_calls } else { &counters.unpin_failures };
        counter.fetch_add(1, Ordering::Relaxed);
        result
    }

    fn unpin_checked(plan: &Plan) -> Result<(), UnpinError> {
        let mut locked = MappingGuards::take(&plan.mappings);
        let mut released: SmallVec<[Released; 2]> = plan.mappings.iter().map(|_| Released::new()).collect();
        for (done, run) in plan.runs.iter().enumerate() {
            let mapping = &plan.mappings[run.mapping_index()];
            let pins = locked.get(run.mapping_index());
            let first = run.page_in(mapping);
            if let Err(page) =
                mapping.try_unpin_run(pins, first, run.npages(), &mut released[run.mapping_index()])
            {
                // Put back what this call took; nothing was munlocked yet.
                for undo in plan.runs[..done].iter().rev() {
                    let at = undo.page_in(&plan.mappings[undo.mapping_index()]);
                    locked.get(undo.mapping_index()).page_counts.increment(at, undo.npages());
                }
                let index = run.index() + (page - first) as usize;
                return Err(UnpinError::NotPinned { index, pfn: (run.iova >> PAGE_SHIFT) + (page - first) });
            }
        }
        for (mi, m) in plan.mappings.iter().enumerate() {
            m.release(locked.get(mi), &released[mi]);
        }
        if let Some(m) = plan.mappings.first() {
            // Lock mode reserves from its first mapping's stock; track mode from its shard's,
            // which this call does not hold: straight back to the space then.
            match m.policy.mode {
                PinMode::Lock => m.policy.restock(locked.get(0), plan.pages),
                PinMode::Track => m.policy.give(plan.pages),
            }
        }
        Ok(())
    }
}
