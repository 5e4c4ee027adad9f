//! The planner: the one loop that cuts a call into runs.
//!
//! A call names an array of page numbers ([`PageArray`]) or a range ([`PageRange`]). [`cut`]
//! walks it once, under the mapping table's read (the calling thread's shard lock): it finds
//! each entry's mapping (the shard's hint, else the table), extends a run while the next
//! entry is the next page of the same mapping ([`run_length`]), and hands every mapping it
//! enters and every run it cuts to a [`RunSink`]. The sinks decide what is checked and where
//! the runs go:
//!
//! - [`PlanSink`]: a lock-mode pin (access checked) or an unpin (nothing checked) into a
//!   [`Plan`] that holds its mappings;
//! - track mode's record and small-record sinks (`track`);
//! - translation's sink (`DmaSpace::translate_pages`), which only reports the runs.
//!
//! The loop is generic over the entries' kind and the sink, and inlined into each caller:
//! each (kind, sink) pair gets its own loop with the sink's work in it and the loop's state
//! in registers. What that buys over one loop taking an enum and calling its sink: about 28
//! instructions of a multi-entry track-mode call and 2 per run (docs/benchmarks.md).

use std::marker::PhantomData;
use std::sync::Arc;

use smallvec::SmallVec;

use super::error::{PinError, UnpinError};
use crate::mapping::Mapping;
use crate::page::{iova_of_checked, Prot, PAGE_SIZE};
use crate::run::{PinnedRun, Runs};
use crate::run_scan::run_length;
use crate::shard_table::{MappingTable, ShardHint};

/// What a pin or unpin call names: an array of page numbers or a range.
pub(crate) trait Entries: Copy {
    /// Pages named.
    fn len(&self) -> u64;

    /// The range's first page and pages; `None` for an array.
    fn range(&self) -> Option<(u64, u64)>;

    /// Most runs the call can be cut into, if that is known before the cut: an array's
    /// length (a range's runs are one per mapping it spans).
    fn runs_at_most(&self) -> Option<usize>;

    /// The run-cutting loop for this kind of entries (see [`cut`]).
    fn cut<S: RunSink>(
        self,
        table: &MappingTable,
        hint: &mut Option<ShardHint>,
        sink: &mut S,
    ) -> Result<(), S::Stop>;

    /// Checks that the call asks for some access (`prot`), its size against `max` pages, and
    /// that a range's pages have IOVAs.
    fn check(&self, max: u64, prot: Prot) -> Result<(), PinError> {
        if prot.is_empty() {
            return Err(PinError::NoAccess);
        }
        match self.len() {
            0 => return Err(PinError::Empty),
            n if n > max => return Err(PinError::TooManyPages { requested: n, max }),
            _ => {}
        }
        if let Some((pfn, npages)) = self.range() {
            if pfn.checked_add(npages - 1).and_then(iova_of_checked).is_none() {
                return Err(PinError::NotMapped { index: 0, pfn });
            }
        }
        Ok(())
    }

    /// Checks an unpin call's size against `max` pages, and that a range's pages have IOVAs.
    fn check_unpin(&self, max: u64) -> Result<(), UnpinError> {
        let n = self.len();
        let valid_range = match self.range() {
            Some((pfn, npages)) => {
                npages != 0 && pfn.checked_add(npages - 1).and_then(iova_of_checked).is_some()
            }
            None => true,
        };
        if n == 0 || n > max || !valid_range {
            return Err(UnpinError::InvalidCount(n));
        }
        Ok(())
    }
}

/// An array of page numbers, in call order (repeats allowed).
#[derive(Clone, Copy, Debug)]
pub(crate) struct PageArray<'p>(pub(crate) &'p [u64]);

/// `npages` pages from page `pfn`.
#[derive(Clone, Copy, Debug)]
pub(crate) struct PageRange {
    pub(crate) pfn: u64,
    pub(crate) npages: u64,
}

impl Entries for PageArray<'_> {
    #[inline(always)]
    fn len(&self) -> u64 {
        self.0.len() as u64
    }

    #[inline(always)]
    fn range(&self) -> Option<(u64, u64)> {
        None
    }

    #[inline(always)]
    fn runs_at_most(&self) -> Option<usize> {
        Some(self.0.len())
    }

    /// A run goes on while each entry is the page after the last, in the same mapping.
    #[inline(always)]
    fn cut<S: RunSink>(
        self,
        table: &MappingTable,
        hint: &mut Option<ShardHint>,
        sink: &mut S,
    ) -> Result<(), S::Stop> {
        let pfns = self.0;
        let Some(&first) = pfns.first() else {
            return Ok(());
        };
        // The first entry's mapping is entered unconditionally; later ones only when an
        // entry leaves the mapping of the run before it.
        let mut window = enter(table, hint, sink, first, 0)?;
        let (mut i, mut pfn) = (0, first);
        let mut page = pfn - window.first_pfn;
        loop {
            let n = run_length(&pfns[i..], window.npages - page);
            sink.run(&window, pfn, page, n, i)?;
            i += n as usize;
            let Some(&next) = pfns.get(i) else {
                return Ok(());
            };
            pfn = next;
            page = match window.page_of(next) {
                Some(page) => page,
                None => {
                    window = enter(table, hint, sink, next, i)?;
                    next - window.first_pfn
                }
            };
        }
    }
}

impl Entries for PageRange {
    #[inline(always)]
    fn len(&self) -> u64 {
        self.npages
    }

    #[inline(always)]
    fn range(&self) -> Option<(u64, u64)> {
        Some((self.pfn, self.npages))
    }

    #[inline(always)]
    fn runs_at_most(&self) -> Option<usize> {
        None
    }

    /// One run per mapping the range spans: every run but the first starts where the last
    /// mapping ended.
    #[inline(always)]
    fn cut<S: RunSink>(
        self,
        table: &MappingTable,
        hint: &mut Option<ShardHint>,
        sink: &mut S,
    ) -> Result<(), S::Stop> {
        let mut done = 0u64;
        while done < self.npages {
            let here = self.pfn + done;
            let window = enter(table, hint, sink, here, done as usize)?;
            let page = here - window.first_pfn;
            let n = (window.npages - page).min(self.npages - done);
            sink.run(&window, here, page, n, done as usize)?;
            done += n;
        }
        Ok(())
    }
}

/// The mapping a call's runs are being cut in.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Window {
    /// Its first page number, and its pages.
    first_pfn: u64,
    npages: u64,
    /// Host address of its first page (0 where the sink has none: an unpin's plan).
    host_base: usize,
    /// Its index among the call's mappings (`PinnedRun::mapping_index`).
    pub(crate) mapping_index: usize,
}

impl Window {
    /// The window of `mapping`, whose first page is at `host_base`, as the call's mapping
    /// `mapping_index`.
    #[inline(always)]
    pub(crate) fn new(mapping: &Mapping, host_base: usize, mapping_index: usize) -> Self {
        Window { first_pfn: mapping.first_pfn, npages: mapping.npages, host_base, mapping_index }
    }

    /// Page `pfn` as an offset within the window's mapping, if the mapping holds it.
    #[inline(always)]
    fn page_of(&self, pfn: u64) -> Option<u64> {
        let page = pfn.wrapping_sub(self.first_pfn);
        (page < self.npages).then_some(page)
    }

    /// Host address of page offset `page` of the window's mapping.
    #[inline(always)]
    pub(crate) fn host_at(&self, page: u64) -> usize {
        self.host_base + (page * PAGE_SIZE) as usize
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
    /// A run of `npages` pages from `pfn` (page offset `page` of the window's mapping),
    /// starting at entry `index`.
    fn run(
        &mut self,
        window: &Window,
        pfn: u64,
        page: u64,
        npages: u64,
        index: usize,
    ) -> Result<(), Self::Stop>;
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

/// Enters the mapping of `pfn` (entry `index`) into `sink`.
#[inline(always)]
fn enter<S: RunSink>(
    table: &MappingTable,
    hint: &mut Option<ShardHint>,
    sink: &mut S,
    pfn: u64,
    index: usize,
) -> Result<Window, S::Stop> {
    match lookup(table, hint, pfn) {
        Some(mapping) => sink.enter(mapping, pfn, index),
        None => Err(sink.unmapped(pfn, index)),
    }
}

/// Cuts `entries` into maximal runs, in order, into `sink`: the one run-cutting loop (one
/// per kind of entries). A run never crosses a mapping boundary.
#[inline(always)]
pub(crate) fn cut<E: Entries, S: RunSink>(
    table: &MappingTable,
    hint: &mut Option<ShardHint>,
    entries: E,
    sink: &mut S,
) -> Result<(), S::Stop> {
    entries.cut(table, hint, sink)
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
    pub(crate) fn reserve_for(&mut self, entries: impl Entries) {
        if let Some(runs) = entries.runs_at_most().filter(|&n| n > self.runs.inline_size()) {
            self.runs.reserve(runs.min(4096));
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
        Window::new(mapping, host_base, mapping_index)
    }

    #[inline(always)]
    fn push(&mut self, window: &Window, pfn: u64, page: u64, npages: u64, index: usize) {
        let host = if window.host_base == 0 { 0 } else { window.host_at(page) };
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

    #[inline(always)]
    fn run(
        &mut self,
        window: &Window,
        pfn: u64,
        page: u64,
        npages: u64,
        index: usize,
    ) -> Result<(), PinError> {
        self.push(window, pfn, page, npages, index);
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

    #[inline(always)]
    fn run(
        &mut self,
        window: &Window,
        pfn: u64,
        page: u64,
        npages: u64,
        index: usize,
    ) -> Result<(), UnpinError> {
        self.push(window, pfn, page, npages, index);
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
        Ok(Window::new(mapping, host_base, 0))
    }

    #[inline(always)]
    fn run(&mut self, window: &Window, _: u64, page: u64, npages: u64, index: usize) -> Result<(), PinError> {
        (self.report)(index, window.host_at(page), npages);
        Ok(())
    }
}
