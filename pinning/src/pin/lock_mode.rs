//! Lock mode: per-page counts under the mappings' locks, and an mlock for every page
//! that gets its first pin.
//!
//! A call is planned into a [`Plan`] (which holds its mappings), then the locks of its
//! mappings are taken in mapping-id order and held for the whole call, so that the call is
//! all-or-nothing even when it repeats pages or spans mappings. Its bookkeeping happens
//! under its first mapping's lock, which it holds anyway: its pins are reserved from that
//! mapping's stock and it is counted there.

use std::sync::Arc;

use smallvec::SmallVec;

use super::error::PinError;
use super::plan::Plan;
use crate::mapping::{Mapping, MappingPins, MappingState, Released, RunFailure};
use crate::page::PAGE_SHIFT;
use crate::run::PinnedRun;
use crate::space::DmaSpace;
use crate::spin::SpinGuard;

/// The locks of a plan's mappings, taken in mapping-id order, indexed by mapping index.
pub(crate) enum MappingGuards<'a> {
    /// The usual plan: one mapping.
    One(SpinGuard<'a, MappingPins>),
    /// Any other number of mappings.
    Many(SmallVec<[Option<SpinGuard<'a, MappingPins>>; 2]>),
}

impl<'a> MappingGuards<'a> {
    pub(crate) fn take(mappings: &'a [Arc<Mapping>]) -> Self {
        if let [only] = mappings {
            return MappingGuards::One(only.lock());
        }
        let mut guards: SmallVec<[Option<SpinGuard<'a, MappingPins>>; 2]> =
            mappings.iter().map(|_| None).collect();
        let mut order: SmallVec<[usize; 4]> = (0..mappings.len()).collect();
        order.sort_unstable_by_key(|&mi| mappings[mi].id);
        for mi in order {
            guards[mi] = Some(mappings[mi].lock());
        }
        MappingGuards::Many(guards)
    }

    pub(crate) fn get(&mut self, mi: usize) -> &mut MappingPins {
        match self {
            MappingGuards::One(guard) => {
                debug_assert_eq!(mi, 0, "a one-mapping plan has mapping index 0 only");
                guard
            }
            MappingGuards::Many(guards) => guards[mi].as_mut().expect("every mapping is locked"),
        }
    }
}

/// Removes one pin per page of `runs`, then munlocks and refunds. Returns the pins removed.
/// Runs go in the order they were locked: munlocking scattered pages in reverse made the
/// kernel's merging of their VMAs slower in a process registered for membarriers, as every
/// process using the engine is (8 scattered pages 1.05-1.13x bare mlock+munlock in that
/// order, 1.02-1.03x in this one: docs/benchmarks.md).
pub(crate) fn unpin_runs(mappings: &[Arc<Mapping>], held: &mut MappingGuards<'_>, runs: &[PinnedRun]) -> u64 {
    if let [mapping] = mappings {
        // The usual plan: one mapping, one list of sub-runs to munlock.
        let pins = held.get(0);
        let mut released = Released::new();
        let removed = runs.iter().map(|run| unpin_run_of(mapping, pins, run, &mut released)).sum();
        mapping.release(pins, &released);
        return removed;
    }
    let mut released: SmallVec<[Released; 2]> = mappings.iter().map(|_| Released::new()).collect();
    let mut removed = 0u64;
    for run in runs {
        let mi = run.mapping_index();
        removed += unpin_run_of(&mappings[mi], held.get(mi), run, &mut released[mi]);
    }
    for (mi, m) in mappings.iter().enumerate() {
        m.release(held.get(mi), &released[mi]);
    }
    removed
}

/// [`unpin_runs`] for one run, in its mapping; the pins removed.
#[inline]
fn unpin_run_of(mapping: &Mapping, pins: &mut MappingPins, run: &PinnedRun, released: &mut Released) -> u64 {
    let first = mapping.run_page(run);
    if mapping.try_unpin_run(pins, first, run.npages(), released).is_ok() {
        return run.npages();
    }
    // Someone unpinned pages this guard owns (unpin_pages on pins it did not take).
    // Release what is still pinned, page by page, rather than underflow a count.
    log::error!("pins of the run at IOVA {:#x} were released behind its guard", run.iova());
    (first..first + run.npages())
        .filter(|&page| mapping.try_unpin_run(pins, page, 1, released).is_ok())
        .count() as u64
}

/// The error of `run` (in `mapping`) failing at a page of the mapping.
fn run_error(run: &PinnedRun, mapping: &Mapping, failure: RunFailure) -> PinError {
    let first = mapping.run_page(run);
    let at = |page: u64| (run.index() + (page - first) as usize, (run.iova() >> PAGE_SHIFT) + (page - first));
    match failure {
        RunFailure::Overflow { page } => {
            let (index, pfn) = at(page);
            PinError::CountOverflow { index, pfn }
        }
        RunFailure::OverLimit { page, over } => {
            let (index, pfn) = at(page);
            PinError::LockLimit { index, pfn, over }
        }
        RunFailure::Lock { page, error } => {
            let (index, pfn) = at(page);
            PinError::Lock { index, pfn, source: error }
        }
        RunFailure::Unmapping { page } => {
            let (index, pfn) = at(page);
            PinError::Unmapping { index, pfn }
        }
    }
}

/// Lets go of a lock-mode guard's pins, under its mappings' locks.
pub(crate) fn release(plan: Box<Plan>) {
    let mut held = MappingGuards::take(&plan.mappings);
    let removed = unpin_runs(&plan.mappings, &mut held, &plan.runs);
    if let Some(m) = plan.mappings.first() {
        let first = held.get(0);
        first.counts.unpin_calls += 1;
        first.restock(&m.policy, removed);
    }
    drop(held);
    Plan::recycle(plan);
}

/// Keeps a lock-mode guard's pins for `unpin_pages` (`PinnedPages::forget`): they stay
/// counted, and are counted as kept too, under the mappings' locks.
pub(crate) fn keep(plan: Box<Plan>) {
    let mut held = MappingGuards::take(&plan.mappings);
    for run in &plan.runs {
        let mi = run.mapping_index();
        let page = plan.mappings[mi].run_page(run);
        let pins = held.get(mi);
        // Every kept pin is counted in `page_counts`, which no page holds more than
        // MAX_PIN_COUNT of, this guard's included: the kept count cannot overflow.
        debug_assert!(pins
            .kept_counts
            .as_ref()
            .is_none_or(|k| (page..page + run.npages()).all(|p| k.count(p) < pins.page_counts.count(p))));
        pins.kept_counts.get_or_insert_default().increment(page, run.npages());
    }
    drop(held);
    Plan::recycle(plan);
}

/// Lock mode: reserves the plan's pins from its first mapping's stock and pins its runs,
/// all under its mappings' locks; the counts go there too (no shared atomic per call but
/// the lock account's). A failure is counted in this thread's shard.
pub(super) fn apply(space: &DmaSpace, plan: Result<Box<Plan>, PinError>) -> Result<Box<Plan>, PinError> {
    let applied = plan.and_then(|plan| space.apply_plan(plan));
    if applied.is_err() {
        space.inner.count(|c| c.pin_failures += 1);
    }
    applied
}

impl DmaSpace {
    fn apply_plan(&self, plan: Box<Plan>) -> Result<Box<Plan>, PinError> {
        let policy = &self.inner.policy;
        let mut held = MappingGuards::take(&plan.mappings);
        if held.get(0).reserve(policy, plan.pages).is_err() {
            // Short: take back every mapping's unused stock, each lock alone, and try again.
            drop(held);
            self.reclaim_mapping_stocks();
            held = MappingGuards::take(&plan.mappings);
            if let Err(in_use) = held.get(0).reserve(policy, plan.pages) {
                drop(held);
                let requested = plan.pages;
                Plan::recycle(plan);
                return Err(PinError::PinLimit { requested, held: in_use, max: policy.max_pins });
            }
        }
        match Self::pin_runs(&plan, &mut held) {
            Ok(()) => {
                held.get(0).counts.pinned(plan.runs.len() as u64, plan.pages);
                drop(held);
                Ok(plan)
            }
            Err(e) => {
                held.get(0).restock(policy, plan.pages);
                drop(held);
                Plan::recycle(plan);
                Err(e)
            }
        }
    }

    /// Gives every mapping's unused lock-mode stock back to the space's count.
    #[cold]
    fn reclaim_mapping_stocks(&self) {
        let mappings: Vec<Arc<Mapping>> = self.read_table().values().cloned().collect();
        for m in mappings {
            let mut pins = m.lock();
            self.inner.policy.give(std::mem::take(&mut pins.stock));
        }
    }

    fn pin_runs(plan: &Plan, held: &mut MappingGuards<'_>) -> Result<(), PinError> {
        // A mapping may have left the table (or started leaving) between planning and
        // locking; report the first entry affected.
        for run in &plan.runs {
            let pfn = run.iova() >> PAGE_SHIFT;
            match plan.mappings[run.mapping_index()].state() {
                MappingState::Live => {}
                MappingState::Unmapping => return Err(PinError::Unmapping { index: run.index(), pfn }),
                MappingState::Removed => return Err(PinError::NotMapped { index: run.index(), pfn }),
            }
        }
        // An unmap of any of the call's mappings waits for all their locks: a long run gives
        // way to it wherever it is (I6), not only to one of its own mapping.
        let claimed = || plan.mappings.iter().any(|m| m.claimed());
        for (done, run) in plan.runs.iter().enumerate() {
            let mapping = &plan.mappings[run.mapping_index()];
            if let Err(failure) =
                mapping.pin_run(held.get(run.mapping_index()), mapping.run_page(run), run.npages(), &claimed)
            {
                // The call's reservation is returned whole by the caller.
                unpin_runs(&plan.mappings, held, &plan.runs[..done]);
                return Err(run_error(run, mapping, failure));
            }
        }
        Ok(())
    }
}
