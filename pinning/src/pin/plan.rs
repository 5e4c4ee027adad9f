//! The planner: the one loop that cuts a call into runs.
//!
//! A call names an array of page numbers or a range. [`cut`] walks it once, under the
//! mapping table's read (the calling thread's shard lock): it finds each entry's mapping
//! (the shard's hint, else the table), extends a run while the next entry is the next page
//! of the same mapping ([`run_length`]), and hands every mapping it enters and every run it
//! cuts to a [`RunSink`]. The sinks decide what is checked and where the runs go:
//!
//! - [`PlanSink`]: a lock-mode pin (access checked) or an unpin (nothing checked) into a
//!   [`Plan`] that holds its mappings;
//! - track mode's record and small-record sinks (`track`);
//! - translation's sink (`DmaSpace::translate_pages`), which only reports the runs.

use std::marker::PhantomData;
use std::sync::Arc;

use smallvec::SmallVec;

use super::error::{PinError, UnpinError};
use crate::mapping::Mapping;
use crate::page::{iova_of_checked, Prot, PAGE_SIZE};
use crate::run::{PinnedRun, Runs};
use crate::run_scan::run_length;
use crate::shard_table::{MappingTable, ShardHint};

/// What a pin or unpin call names.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Entries<'p> {
    /// An array of page numbers.
    Array(&'p [u64]),
    /// `npages` pages from page `pfn`.
    Range { pfn: u64, npages: u64 },
}

impl Entries<'_> {
    /// Pages named.
    #[inline(always)]
    pub(crate) fn len(&self) -> u64 {
        match *self {
            Entries::Array(pfns) => pfns.len() as u64,
            Entries::Range { npages, .. } => npages,
        }
    }

    /// Checks the call's size against `max` pages, and that a range's pages have IOVAs.
    pub(crate) fn check(&self, max: u64) -> Result<(), PinError> {
        match self.len() {
            0 => return Err(PinError::Empty),
            n if n > max => return Err(PinError::TooManyPages { requested: n, max }),
            _ => {}
        }
        if let Entries::Range { pfn, npages } = *self {
            if pfn.checked_add(npages - 1).and_then(iova_of_checked).is_none() {
                return Err(PinError::NotMapped { index: 0, pfn });
            }
        }
        Ok(())
    }

    /// Checks an unpin call's size against `max` pages, and that a range's pages have IOVAs.
    pub(crate) fn check_unpin(&self, max: u64) -> Result<(), UnpinError> {
        let n = self.len();
        let valid_range = match *self {
            Entries::Range { pfn, npages } => {
                npages != 0 && pfn.checked_add(npages - 1).and_then(iova_of_checked).is_some()
            }
            Entries::Array(_) => true,
        };
        if n == 0 || n > max || !valid_range {
            return Err(UnpinError::InvalidCount(n));
        }
        Ok(())
    }
}

/// The mapping a call's runs are being cut in.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Window {
    /// Its first page number, and one past its last.
    pub(crate) first_pfn: u64,
    pub(crate) end_pfn: u64,
    /// Host address of its first page (0 where the sink has none: an unpin's plan).
    pub(crate) host_base: usize,
    /// Its index among the call's mappings (`PinnedRun::mapping_index`).
    pub(crate) mapping_index: usize,
}

impl Window {
    /// No mapping yet: holds no page.
    const NONE: Window = Window { first_pfn: 1, end_pfn: 0, host_base: 0, mapping_index: 0 };

    #[inline(always)]
    fn holds(&self, pfn: u64) -> bool {
        pfn >= self.first_pfn && pfn < self.end_pfn
    }

    /// Host address of page `pfn` of the window's mapping.
    #[inline(always)]
    pub(crate) fn host_of(&self, pfn: u64) -> usize {
        self.host_base + ((pfn - self.first_pfn) * PAGE_SIZE) as usize
    }
}

/// Where the planner puts what it finds.
pub(crate) trait RunSink {
    /// Why the cut stops early: the call's error, or a fast path's "not here".
    type Stop;
    /// Entry `index` names `pfn`, which no mapping holds.
    fn unmapped(&mut self, pfn: u64, index: usize) -> Self::Stop;
    /// Entry `index` names `pfn` in `mapping`, which the cut has just entered: check what
    /// the sink needs and give the window its runs are cut in.
    fn enter(&mut self, mapping: &Arc<Mapping>, pfn: u64, index: usize) -> Result<Window, Self::Stop>;
    /// A run of `npages` pages from `pfn`, starting at entry `index`, in `window`.
    fn run(&mut self, window: &Window, pfn: u64, npages: u64, index: usize) -> Result<(), Self::Stop>;
}

/// The mapping holding `pfn`: the shard's hint, else the table (which then becomes the hint).
/// The caller holds the shard's lock, which `hint` belongs to.
#[inline]
pub(crate) fn lookup<'t>(
    table: &'t MappingTable,
    hint: &mut Option<ShardHint>,
    pfn: u64,
) -> Option<&'t Arc<Mapping>> {
    match *hint {
        // SAFETY: (I2) the hint points into the table, which does not change while the shard
        // lock is held (the caller holds it), and every change clears the hint first.
        Some(h) if pfn >= h.first_pfn && pfn < h.end_pfn => Some(unsafe { &*h.entry.as_ptr() }),
        _ => match table.range(..=pfn).next_back() {
            Some((_, m)) if m.contains(pfn) => {
                *hint = Some(ShardHint { first_pfn: m.first_pfn, end_pfn: m.end_pfn(), entry: m.into() });
                Some(m)
            }
            _ => None,
        },
    }
}

/// Cuts `entries` into maximal runs, in order, into `sink`: the one run-cutting loop. A run
/// never crosses a mapping boundary; an array's run goes on while each entry is the page
/// after the last.
#[inline(always)]
pub(crate) fn cut<S: RunSink>(
    table: &MappingTable,
    hint: &mut Option<ShardHint>,
    entries: Entries<'_>,
    sink: &mut S,
) -> Result<(), S::Stop> {
    let mut window = Window::NONE;
    let mut enter = |sink: &mut S, pfn: u64, index: usize| match lookup(table, hint, pfn) {
        Some(mapping) => sink.enter(mapping, pfn, index),
        None => Err(sink.unmapped(pfn, index)),
    };
    match entries {
        // One entry, most calls of a channel program: one run, no scan (what this saves is
        // about a sixth of a one-page pin's instructions).
        Entries::Array(&[pfn]) => {
            let window = enter(sink, pfn, 0)?;
            sink.run(&window, pfn, 1, 0)?;
        }
        Entries::Array(pfns) => {
            let mut i = 0;
            while i < pfns.len() {
                let start = pfns[i];
                if !window.holds(start) {
                    window = enter(sink, start, i)?;
                }
                let n = run_length(&pfns[i..], window.end_pfn - start);
                sink.run(&window, start, n, i)?;
                i += n as usize;
            }
        }
        Entries::Range { pfn, npages } => {
            let mut done = 0u64;
            while done < npages {
                let here = pfn + done;
                // Every run but the first starts where the last mapping ended.
                window = enter(sink, here, done as usize)?;
                let n = (window.end_pfn - here).min(npages - done);
                sink.run(&window, here, n, done as usize)?;
                done += n;
            }
        }
    }
    Ok(())
}

/// Checks that `mapping` grants a pin for `wanted` at `pfn` (entry `index`): its access,
/// its host memory, its file not truncated. Returns the host address of its first page.
#[inline]
pub(crate) fn check_pin(mapping: &Mapping, wanted: Prot, pfn: u64, index: usize) -> Result<usize, PinError> {
    if !mapping.prot.contains(wanted) {
        return Err(PinError::Permission { index, pfn, wanted, have: mapping.prot });
    }
    let Some(base) = mapping.host_addr(0) else {
        return Err(PinError::NoHostMemory { index, pfn });
    };
    if mapping.poisoned() {
        return Err(PinError::Poisoned { index, pfn });
    }
    Ok(base)
}

type Mappings = SmallVec<[Arc<Mapping>; 2]>;

/// A call cut into runs and resolved to mappings it holds: a lock-mode guard's hold, or an
/// unpin call before it is applied.
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
    /// box is not allocated and freed on every pin. What that buys: about 5-12% of lock
    /// mode's bookkeeping (the hugetlb rows, which make no syscall; docs/benchmarks.md).
    static SPARE_PLAN: std::cell::Cell<Option<Box<Plan>>> = const { std::cell::Cell::new(None) };
}

impl Plan {
    /// A boxed empty plan for `prot`: this thread's spare, else a new one.
    pub(crate) fn boxed(prot: Prot) -> Box<Plan> {
        let mut plan: Box<Plan> =
            SPARE_PLAN.try_with(|spare| spare.take()).ok().flatten().unwrap_or_default();
        plan.prot = prot;
        plan
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

    /// Room for the runs of `entries` (one allocation for a long scattered array, not
    /// repeated doubling).
    pub(crate) fn reserve_for(&mut self, entries: Entries<'_>) {
        if let Entries::Array(pfns) = entries {
            if pfns.len() > self.runs.inline_size() {
                self.runs.reserve(pfns.len().min(4096));
            }
        }
    }

    /// The index of `mapping` among the plan's, added if new.
    fn mapping_index(&mut self, mapping: &Arc<Mapping>) -> usize {
        match self.mappings.iter().position(|m| Arc::ptr_eq(m, mapping)) {
            Some(mi) => mi,
            None => {
                self.mappings.push(Arc::clone(mapping));
                self.mappings.len() - 1
            }
        }
    }
}

/// Plans a lock-mode pin (`E` = [`PinError`]: access checked) or an unpin (`E` =
/// [`UnpinError`]: nothing checked, message-only regions included) into a [`Plan`].
pub(crate) struct PlanSink<'p, E> {
    pub(crate) plan: &'p mut Plan,
    _error: PhantomData<E>,
}

impl<'p, E> PlanSink<'p, E> {
    pub(crate) fn new(plan: &'p mut Plan) -> Self {
        PlanSink { plan, _error: PhantomData }
    }

    fn window(&mut self, mapping: &Arc<Mapping>, host_base: usize) -> Window {
        let mapping_index = self.plan.mapping_index(mapping);
        Window { first_pfn: mapping.first_pfn, end_pfn: mapping.end_pfn(), host_base, mapping_index }
    }

    fn push(&mut self, window: &Window, pfn: u64, npages: u64, index: usize) {
        let host = if window.host_base == 0 { 0 } else { window.host_of(pfn) };
        self.plan.runs.push(PinnedRun::new(pfn, npages, index, host, window.mapping_index));
        self.plan.pages += npages;
    }
}

impl RunSink for PlanSink<'_, PinError> {
    type Stop = PinError;

    fn unmapped(&mut self, pfn: u64, index: usize) -> PinError {
        PinError::NotMapped { index, pfn }
    }

    fn enter(&mut self, mapping: &Arc<Mapping>, pfn: u64, index: usize) -> Result<Window, PinError> {
        let base = check_pin(mapping, self.plan.prot, pfn, index)?;
        Ok(self.window(mapping, base))
    }

    fn run(&mut self, window: &Window, pfn: u64, npages: u64, index: usize) -> Result<(), PinError> {
        self.push(window, pfn, npages, index);
        Ok(())
    }
}

impl RunSink for PlanSink<'_, UnpinError> {
    type Stop = UnpinError;

    fn unmapped(&mut self, pfn: u64, index: usize) -> UnpinError {
        UnpinError::NotMapped { index, pfn }
    }

    fn enter(&mut self, mapping: &Arc<Mapping>, _: u64, _: usize) -> Result<Window, UnpinError> {
        Ok(self.window(mapping, 0))
    }

    fn run(&mut self, window: &Window, pfn: u64, npages: u64, index: usize) -> Result<(), UnpinError> {
        self.push(window, pfn, npages, index);
        Ok(())
    }
}

/// Translation: checks access as a pin does (but for poisoning, which only a pin refuses)
/// and reports each run as `(index, host_addr, npages)`.
pub(crate) struct TranslateSink<F> {
    pub(crate) prot: Prot,
    pub(crate) report: F,
}

impl<F: FnMut(usize, usize, u64)> RunSink for TranslateSink<F> {
    type Stop = PinError;

    fn unmapped(&mut self, pfn: u64, index: usize) -> PinError {
        PinError::NotMapped { index, pfn }
    }

    #[inline]
    fn enter(&mut self, mapping: &Arc<Mapping>, pfn: u64, index: usize) -> Result<Window, PinError> {
        if !mapping.prot.contains(self.prot) {
            return Err(PinError::Permission { index, pfn, wanted: self.prot, have: mapping.prot });
        }
        let Some(host_base) = mapping.host_addr(0) else {
            return Err(PinError::NoHostMemory { index, pfn });
        };
        Ok(Window { first_pfn: mapping.first_pfn, end_pfn: mapping.end_pfn(), host_base, mapping_index: 0 })
    }

    #[inline(always)]
    fn run(&mut self, window: &Window, pfn: u64, npages: u64, index: usize) -> Result<(), PinError> {
        (self.report)(index, window.host_of(pfn), npages);
        Ok(())
    }
}
