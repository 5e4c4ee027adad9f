//! Kernel mode: track mode's records, each run also pinned by the kernel itself.
//!
//! A call is recorded as in track mode (`track::pin_recorded`, under its shard's lock), with
//! consecutive slots of the space's kernel table reserved for its runs' buffers before the
//! record is published. Then, with no engine lock held, one kernel call registers every
//! buffer (`KernelTable::register`): the kernel pins the pages (`FOLL_LONGTERM`) and charges
//! them. If it refuses any, the call fails whole: what it registered is cleared and the
//! record taken back. The guard clears its buffers (one kernel call) before its record
//! retires (`track::retire`), so an unmap that finds no record finds no kernel pin either.
//!
//! Registering after publication lets the call hold no lock across the kernel's work
//! (pinning a GiB takes milliseconds): the published record keeps its mappings and their
//! memory (DESIGN.md I1, I13), and an unmap that comes meanwhile sees the record and waits
//! for it (I6), so the kernel only ever pins memory the space keeps mapped (I17).

use super::error::PinError;
use super::plan::Entries;
use super::track;
use crate::kernel::{buffers_of, push_buffers, Buffers, KERNEL_BUFFER_PAGES};
use crate::page::{Prot, PAGE_SHIFT};
use crate::record::RecordPtr;
use crate::run::PinnedRun;
use crate::space::DmaSpace;

/// Kernel mode's pin: the record, then the kernel's pins of its runs.
#[inline(never)]
pub(super) fn pin(dma: &DmaSpace, prot: Prot, entries: impl Entries) -> Result<RecordPtr, PinError> {
    let table = match dma.inner.policy.kernel() {
        Some(Ok(table)) => table,
        Some(Err(why)) => {
            dma.inner.count(|c| c.pin_failures += 1);
            return Err(why.clone().into());
        }
        None => unreachable!("a kernel-mode space has a kernel table or the reason it has none"),
    };
    let record = track::pin_recorded(dma, dma.read_table(), prot, entries, Some(table))?;
    // SAFETY: (I3) the record is live: published just now, and no guard holds it yet.
    let view = unsafe { record.view() };
    let slots = view.kernel.expect("a kernel-mode record has its slots");
    let mut buffers = Buffers::new();
    let mut cut = 0;
    for run in view.runs {
        cut += u64::from(push_buffers(&mut buffers, run.host_addr(), run.npages()));
    }
    // SAFETY: (I1, I13, I17) the buffers are the runs' host memory, which stays mapped while the
    // live record names its mappings: until this call's guard retires it, after clearing the
    // slots, or the failure below does (the slots cleared by `register` already).
    let registered = unsafe { table.register(slots.first, &buffers, view.pages, cut) };
    match registered {
        Ok(()) => Ok(record),
        Err(failure) => {
            let (index, pfn) = entry_of_buffer(view.runs, failure.buffer);
            // SAFETY: (I3) the record is live and no guard holds it.
            let owner = unsafe { record.owner() };
            // SAFETY: (I3, I4) published by `pin_recorded` for this call and held by no guard;
            // the caller's handle keeps the space open.
            unsafe { track::unpublish(owner, record) };
            Err(PinError::Kernel { index, pfn, source: failure.error })
        }
    }
}

/// The entry (position and page number) where buffer `buffer` of a call's runs starts.
fn entry_of_buffer(runs: &[PinnedRun], buffer: usize) -> (usize, u64) {
    let mut left = buffer as u64;
    for run in runs {
        let n = buffers_of(run.npages());
        if left < n {
            let page = left * KERNEL_BUFFER_PAGES;
            return (run.index() + page as usize, (run.iova() >> PAGE_SHIFT) + page);
        }
        left -= n;
    }
    let first = runs.first().expect("a pin call has a run");
    (first.index(), first.iova() >> PAGE_SHIFT)
}
