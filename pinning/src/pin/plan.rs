//! Planning: a call cut into runs and resolved to its mappings.

use std::ptr::NonNull;
use std::sync::Arc;

use smallvec::SmallVec;

use super::PinError;
use crate::mapping::Mapping;
use crate::page::{Prot, PAGE_SIZE};
use crate::run::{PinnedRun, Runs};
use crate::run_scan::run_length;
use crate::shard_table::{ShardHint, TableRead};
use crate::space::MappingTable;

pub(crate) type Mappings = SmallVec<[Arc<Mapping>; 2]>;

/// A pin call, cut into runs and resolved to mappings it holds, not yet applied.
#[derive(Debug, Default)]
pub(crate) struct Plan {
    pub(crate) mappings: Mappings,
    pub(crate) runs: Runs,
    pub(crate) pages: u64,
    /// The access the guard's pages were pinned for.
    pub(crate) prot: Prot,
}

thread_local! {
    /// One emptied lock-mode plan kept by each thread for its next call, so that a guard's
    /// box is not allocated and freed on every pin.
    static SPARE_PLAN: std::cell::Cell<Option<Box<Plan>>> = const { std::cell::Cell::new(None) };
}

impl Plan {
    /// A boxed empty plan: this thread's spare, else a new one.
    pub(crate) fn boxed() -> Box<Plan> {
        SPARE_PLAN.try_with(|spare| spare.take()).ok().flatten().unwrap_or_default()
    }

    /// Lets go of the plan's mappings and keeps its box as this thread's spare (unless its
    /// runs spilled to the heap: a long call's room is not kept).
    pub(crate) fn recycle(mut plan: Box<Plan>) {
        plan.mappings.clear();
        if plan.runs.spilled() {
            return;
        }
        plan.runs.clear();
        plan.pages = 0;
        let _ = SPARE_PLAN.try_with(|spare| spare.set(Some(plan)));
    }
}

/// The mappings a planned call's runs lie in, borrowed from the table read it was planned in.
pub(crate) struct Planned<'a> {
    mappings: SmallVec<[&'a Arc<Mapping>; 2]>,
    pages: u64,
}

/// Resolves page numbers to mappings under a table read, cutting the call into `runs`.
pub(crate) struct Planner<'a, 'r> {
    table: &'a MappingTable,
    /// The shard's hint: the mapping this thread resolved last (its lock is held).
    shard_hint: &'a mut ShardHint,
    wanted: Prot,
    /// Whether the access check applies (unpins need none).
    pinning: bool,
    runs: &'r mut Runs,
    planned: Planned<'a>,
    /// The mapping last resolved: its mapping index, page range and host address of its first
    /// page. The usual next hit.
    hint: Option<(usize, u64, u64, usize)>,
}

impl<'a, 'r> Planner<'a, 'r> {
    fn new(read: &'a mut TableRead<'_>, wanted: Prot, pinning: bool, runs: &'r mut Runs) -> Self {
        let (table, shard) = read.parts();
        Planner {
            table,
            shard_hint: &mut shard.hint,
            wanted,
            pinning,
            runs,
            planned: Planned { mappings: SmallVec::new(), pages: 0 },
            hint: None,
        }
    }

    /// Plans with `plan` into a plan of its own, which holds its mappings.
    pub(crate) fn owned(
        read: &'a mut TableRead<'_>,
        wanted: Prot,
        pinning: bool,
        plan: impl FnOnce(Planner<'a, '_>) -> Result<Planned<'a>, PinError>,
    ) -> Result<Plan, PinError> {
        let mut owned = Plan::default();
        Self::owned_into(read, wanted, pinning, &mut owned, plan)?;
        Ok(owned)
    }

    /// [`Planner::owned`] straight into the box a lock-mode guard keeps (nothing moved after).
    pub(crate) fn boxed(
        read: &'a mut TableRead<'_>,
        wanted: Prot,
        plan: impl FnOnce(Planner<'a, '_>) -> Result<Planned<'a>, PinError>,
    ) -> Result<Box<Plan>, PinError> {
        let mut boxed = Plan::boxed();
        boxed.prot = wanted;
        if let Err(e) = Self::owned_into(read, wanted, true, &mut boxed, plan) {
            Plan::recycle(boxed);
            return Err(e);
        }
        Ok(boxed)
    }

    fn owned_into(
        read: &'a mut TableRead<'_>,
        wanted: Prot,
        pinning: bool,
        into: &mut Plan,
        plan: impl FnOnce(Planner<'a, '_>) -> Result<Planned<'a>, PinError>,
    ) -> Result<(), PinError> {
        let planned = plan(Planner::new(read, wanted, pinning, &mut into.runs))?;
        into.mappings.extend(planned.mappings.iter().map(|m| Arc::clone(m)));
        into.pages = planned.pages;
        Ok(())
    }

    /// The mapping index of the mapping holding `pfn` (entry `index` of the call).
    fn resolve(&mut self, pfn: u64, index: usize) -> Result<(usize, u64, u64, usize), PinError> {
        if let Some(hint @ (_, first, end, _)) = self.hint {
            if pfn >= first && pfn < end {
                return Ok(hint);
            }
        }
        let Some(mapping) = lookup(self.table, self.shard_hint, pfn) else {
            return Err(PinError::NotMapped { index, pfn });
        };
        if self.pinning {
            if !mapping.prot.contains(self.wanted) {
                return Err(PinError::Permission { index, pfn, wanted: self.wanted, have: mapping.prot });
            }
            if mapping.memory.is_none() {
                return Err(PinError::NoHostMemory { index, pfn });
            }
            if mapping.poisoned() {
                return Err(PinError::Poisoned { index, pfn });
            }
        }
        let mappings = &mut self.planned.mappings;
        let mi = match mappings.iter().position(|m| Arc::ptr_eq(m, mapping)) {
            Some(mi) => mi,
            None => {
                mappings.push(mapping);
                mappings.len() - 1
            }
        };
        // Unpins plan message-only regions too: they have no host address (and get none).
        let hint = (mi, mapping.first_pfn, mapping.end_pfn(), mapping.host_addr(0).unwrap_or(0));
        self.hint = Some(hint);
        Ok(hint)
    }

    #[inline]
    fn push_run(
        &mut self,
        (mi, first, _, base): (usize, u64, u64, usize),
        pfn: u64,
        npages: u64,
        index: usize,
    ) {
        let page = pfn - first;
        let host = if base == 0 { 0 } else { base + (page * PAGE_SIZE) as usize };
        self.runs.push(PinnedRun::new(pfn, npages, index, host, mi));
        self.planned.pages += npages;
    }

    /// Cuts an array into maximal runs.
    pub(crate) fn plan_array(mut self, pfns: &[u64]) -> Result<Planned<'a>, PinError> {
        // One allocation for long scattered arrays instead of repeated doubling.
        if pfns.len() > self.runs.inline_size() {
            self.runs.reserve(pfns.len().min(4096));
        }
        let mut i = 0;
        while i < pfns.len() {
            let start = pfns[i];
            let hit = self.resolve(start, i)?;
            // Extend while the next entry is the next page of the same mapping.
            let n = run_length(&pfns[i..], hit.2 - start);
            self.push_run(hit, start, n, i);
            i += n as usize;
        }
        Ok(self.planned)
    }

    /// Cuts `[pfn, pfn + npages)` at mapping boundaries.
    pub(crate) fn plan_range(mut self, pfn: u64, npages: u64) -> Result<Planned<'a>, PinError> {
        let mut done = 0u64;
        while done < npages {
            let here = pfn + done;
            let hit = self.resolve(here, done as usize)?;
            let n = (hit.2 - here).min(npages - done);
            self.push_run(hit, here, n, done as usize);
            done += n;
        }
        Ok(self.planned)
    }
}

/// What a pin call names.
pub(crate) enum Entries<'p> {
    /// An array of page numbers.
    Array(&'p [u64]),
    /// `npages` pages from a page number.
    Range(u64, u64),
}

/// The mapping holding `pfn`: the shard's hint, else the table (which then becomes the hint).
/// The caller holds the shard's lock, which `hint` belongs to.
#[inline]
pub(crate) fn lookup<'t>(
    table: &'t MappingTable,
    hint: &mut ShardHint,
    pfn: u64,
) -> Option<&'t Arc<Mapping>> {
    match *hint {
        // SAFETY: the hint points into the table, which cannot change while the shard is
        // locked (the caller holds it); `ShardTable::write` clears it.
        Some((first, end, m)) if pfn >= first && pfn < end => Some(unsafe { &*m.as_ptr() }),
        _ => match table.range(..=pfn).next_back() {
            Some((_, m)) if m.contains(pfn) => {
                *hint = Some((m.first_pfn, m.end_pfn(), NonNull::from(m)));
                Some(m)
            }
            _ => None,
        },
    }
}
