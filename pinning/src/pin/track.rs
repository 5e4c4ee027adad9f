//! Track mode: a call recorded in its thread's shard.

use std::ptr::NonNull;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use super::guard::{HoldWord, PinnedPages};
use super::plan::{lookup, Entries};
use super::PinError;
use crate::budget::{PinPolicy, PIN_STOCK};
use crate::mapping::MappingState;
use crate::page::{Prot, PAGE_SHIFT, PAGE_SIZE};
use crate::record::{Owner, Record, RecordPtr, SMALL_PINS, SMALL_RUNS};
use crate::run::PinnedRun;
use crate::run_scan::run_length;
use crate::shard_table::{Shard, ShardHint, TableRead};
use crate::space::{DmaSpace, MappingTable, SpaceInner};

/// The mapping a track-mode run lies in: its index in the record's mappings, page range and host address
/// of its first page.
type Resolved = (usize, u64, u64, usize);

/// Finds the mapping holding `pfn` (entry `index`) for a track-mode call: the shard's hint,
/// else the table (which then becomes the hint); checks its access and memory; adds it to the
/// record's mappings if new. The caller holds the shard's lock, which `hint` belongs to.
#[inline]
fn resolve_into(
    table: &MappingTable,
    hint: &mut ShardHint,
    wanted: Prot,
    pfn: u64,
    index: usize,
    record: &mut Record,
) -> Result<Resolved, PinError> {
    let Some(mapping) = lookup(table, hint, pfn) else {
        return Err(PinError::NotMapped { index, pfn });
    };
    if !mapping.prot.contains(wanted) {
        return Err(PinError::Permission { index, pfn, wanted, have: mapping.prot });
    }
    let Some(base) = mapping.host_addr(0) else {
        return Err(PinError::NoHostMemory { index, pfn });
    };
    if mapping.poisoned() {
        return Err(PinError::Poisoned { index, pfn });
    }
    let ptr = NonNull::from(&**mapping);
    let mi = match record.mappings.iter().position(|&m| m == ptr) {
        Some(mi) => mi,
        None => {
            record.mappings.push(ptr);
            record.mappings.len() - 1
        }
    };
    Ok((mi, mapping.first_pfn, mapping.end_pfn(), base))
}

#[inline]
fn push_run_into(record: &mut Record, (mi, first, _, base): Resolved, pfn: u64, npages: u64, index: usize) {
    let page = pfn - first;
    let host = base + (page * PAGE_SIZE) as usize;
    record.runs.push(PinnedRun::new(pfn, npages, index, host, mi));
    record.pages += npages;
}

/// Cuts an array into maximal runs, into a track-mode record. Out of line: its loop gets
/// the registers to itself.
#[inline(never)]
fn plan_array_into(
    table: &MappingTable,
    hint: &mut ShardHint,
    wanted: Prot,
    pfns: &[u64],
    record: &mut Record,
) -> Result<(), PinError> {
    let Some(&first) = pfns.first() else { return Ok(()) };
    let mut hit = resolve_into(table, hint, wanted, first, 0, record)?;
    let mut i = 0;
    while i < pfns.len() {
        let start = pfns[i];
        if start < hit.1 || start >= hit.2 {
            hit = resolve_into(table, hint, wanted, start, i, record)?;
        }
        let n = run_length(&pfns[i..], hit.2 - start);
        let page = start - hit.1;
        let host = hit.3 + (page * PAGE_SIZE) as usize;
        let run = PinnedRun::new(start, n, i, host, hit.0);
        if record.runs.len() == record.runs.capacity() {
            // At most one run per entry left; more than 4096 at a time only as needed.
            record.runs.reserve((pfns.len() - i).min(4096));
        }
        let len = record.runs.len();
        // SAFETY: there is room for one more (just ensured), and a PinnedRun needs no drop.
        unsafe {
            record.runs.as_mut_ptr().add(len).write(run);
            record.runs.set_len(len + 1);
        }
        i += n as usize;
    }
    // The runs cover every entry once.
    record.pages += pfns.len() as u64;
    Ok(())
}

/// Cuts `[pfn, pfn + npages)` at mapping boundaries, into a track-mode record.
fn plan_range_into(
    table: &MappingTable,
    hint: &mut ShardHint,
    wanted: Prot,
    pfn: u64,
    npages: u64,
    record: &mut Record,
) -> Result<(), PinError> {
    let mut done = 0u64;
    while done < npages {
        let here = pfn + done;
        let hit = resolve_into(table, hint, wanted, here, done as usize, record)?;
        let n = (hit.2 - here).min(npages - done);
        push_run_into(record, hit, here, n, done as usize);
        done += n;
    }
    Ok(())
}

/// Track mode's fast path: a call whose runs all lie in one mapping and number at most
/// [`SMALL_RUNS`] (every single page, every range inside one mapping, short IDAW and PRP
/// lists) is planned in place into a free entry of the shard's small-record array. `None`
/// when the call is not such a call, or has an error to report, or does not fit the shard's
/// stock and the limit, or the array is full: the general path then does the whole call, as
/// if this had not run (what this may have changed — the shard's hint, released entries taken
/// back, surplus stock returned, the array allocated — leaves nothing counted twice).
#[inline(always)]
fn pin_small(
    space: &Arc<SpaceInner>,
    table: &MappingTable,
    shard: &mut Shard,
    shard_index: usize,
    prot: Prot,
    what: &Entries<'_>,
    max_pages: u64,
) -> Option<PinnedPages> {
    let (pfn, npages) = match *what {
        Entries::Array(pfns) => (*pfns.first()?, pfns.len() as u64),
        Entries::Range(pfn, npages) => (pfn, npages),
    };
    // Bigger calls never fit a shard's share of small-record pins: no look for room.
    if npages == 0 || npages > max_pages || npages > SMALL_PINS {
        return None;
    }
    let mapping = lookup(table, &mut shard.hint, pfn)?;
    let memory = mapping.memory.as_ref()?;
    if !mapping.prot.contains(prot) || memory.poisoned() || mapping.state() != MappingState::Live {
        return None;
    }
    let base = memory.addr_at(0);
    if shard.small_short(npages) && !reclaim_small(&space.policy, shard, npages) {
        return None;
    }
    let entry = shard.free_small()?;
    // SAFETY: a free entry of our locked shard: nobody else reads or writes it until it is
    // published below.
    let record = unsafe { &mut *entry.as_ptr() };
    let (first, end) = (mapping.first_pfn, mapping.end_pfn());
    let run = |pfn: u64, npages: u64, index: usize| {
        PinnedRun::new(pfn, npages, index, base + ((pfn - first) * PAGE_SIZE) as usize, 0)
    };
    let len = match *what {
        Entries::Range(pfn, npages) => {
            if npages > end - pfn {
                return None;
            }
            record.set_run(0, run(pfn, npages, 0));
            1
        }
        // One page, most calls of a channel program: `lookup` found it in the mapping.
        Entries::Array(&[pfn]) => {
            record.set_run(0, run(pfn, 1, 0));
            1
        }
        Entries::Array(pfns) => {
            let (mut i, mut k) = (0, 0);
            while i < pfns.len() {
                let start = pfns[i];
                if start < first || start >= end || k == SMALL_RUNS {
                    return None;
                }
                let n = if i + 1 == pfns.len() { 1 } else { run_length(&pfns[i..], end - start) };
                record.set_run(k, run(start, n, i));
                k += 1;
                i += n as usize;
            }
            k
        }
    };
    if shard.stock < npages && !refill_stock(&space.policy, shard, npages) {
        return None;
    }
    shard.stock -= npages;
    let owner = Owner { space: NonNull::from(&**space), shard: shard_index, prot };
    // SAFETY: `entry` came from `free_small` of this shard under this hold of its lock.
    unsafe { shard.publish_small(entry, len, npages, NonNull::from(&**mapping), owner) };
    if shard.keepalive.is_none() {
        // Once per shard: the shard holds the space while it has records (see SpaceHandle).
        shard.keepalive = Some(Arc::clone(space));
    }
    shard.counts.pin_calls += 1;
    shard.counts.runs += len as u64;
    shard.counts.pages += npages;
    Some(PinnedPages { hold: HoldWord::recorded(RecordPtr::Small(entry)) })
}

/// Takes back a shard's released small records when it is short for a call of `pages`
/// pages (see `Shard::reclaim_short_small`; their pins into its stock, the surplus beyond
/// two stocks back to the space); true if the call fits now.
#[cold]
fn reclaim_small(policy: &PinPolicy, shard: &mut Shard, pages: u64) -> bool {
    let room = shard.reclaim_short_small(pages);
    trim_stock(policy, shard);
    room
}

/// Tops a shard's stock up by `pins` and a stock more from the space; false if that does
/// not fit under the limit (the general path then reserves exactly, or fails).
#[cold]
fn refill_stock(policy: &PinPolicy, shard: &mut Shard, pins: u64) -> bool {
    let more = pins.saturating_add(PIN_STOCK);
    if policy.take(more).is_err() {
        return false;
    }
    shard.stock += more;
    true
}

/// Gives a shard's stock beyond two stocks' worth back to the space.
#[inline]
pub(crate) fn trim_stock(policy: &PinPolicy, shard: &mut Shard) {
    if shard.stock > 2 * PIN_STOCK {
        policy.give(shard.stock - PIN_STOCK);
        shard.stock = PIN_STOCK;
    }
}

/// Reserves `pins` for a track-mode call from `shard` (index `own`, locked by the caller):
/// from the shard's stock, else from the space's count with a new stock, else exactly. Before
/// failing, every shard that can be reached without waiting takes back its released small
/// records and gives its stock back to the space, so a call fails only if the pins held (and
/// the stocks and not yet reclaimed small records of shards busy at that moment) leave no
/// room.
#[inline]
fn reserve_in_shard(space: &SpaceInner, shard: &mut Shard, own: usize, pins: u64) -> Result<(), u64> {
    if let Some(left) = shard.stock.checked_sub(pins) {
        shard.stock = left;
        return Ok(());
    }
    refill_and_reserve(space, shard, own, pins)
}

/// [`reserve_in_shard`] when the shard's stock is short.
#[inline(never)]
fn refill_and_reserve(space: &SpaceInner, shard: &mut Shard, own: usize, pins: u64) -> Result<(), u64> {
    let policy = &space.policy;
    if pins.checked_add(PIN_STOCK).is_some_and(|more| policy.take(more).is_ok()) {
        shard.stock += PIN_STOCK;
        return Ok(());
    }
    if policy.take(pins).is_ok() {
        return Ok(());
    }
    // Released small records hold their pins until reclaimed: take them back first.
    shard.reclaim_small();
    policy.give(std::mem::take(&mut shard.stock));
    space.shards.try_each_other(own, |other| {
        other.reclaim_small();
        policy.give(std::mem::take(&mut other.stock));
    });
    policy.take(pins)
}

impl DmaSpace {
    /// Track mode: the small-record fast path, else [`DmaSpace::pin_recorded`], under one take of
    /// this thread's shard lock.
    #[inline(always)]
    pub(super) fn pin_tracked(&self, prot: Prot, what: Entries<'_>) -> Result<PinnedPages, PinError> {
        let mut read = self.read_table();
        let shard_index = read.index();
        let (table, shard) = read.parts();
        let max = self.config().max_pages_per_call;
        match pin_small(&self.inner.space, table, shard, shard_index, prot, &what, max) {
            Some(pinned) => Ok(pinned),
            None => self.pin_recorded(read, prot, what),
        }
    }

    /// Track mode: the whole call under this thread's shard lock. The runs are planned into a
    /// record of the shard, the mappings checked live, the pins reserved, and the record
    /// published; the guard points at it. No per-page work, no lock or line shared with
    /// other threads (but the shard's, when more threads than shards pin at once).
    #[inline(never)]
    fn pin_recorded(
        &self,
        mut read: TableRead<'_>,
        prot: Prot,
        what: Entries<'_>,
    ) -> Result<PinnedPages, PinError> {
        let checked = match what {
            Entries::Array(pfns) => self.check_count(pfns.len() as u64).inspect_err(|_| {
                self.counters().pin_failures.fetch_add(1, Ordering::Relaxed);
            }),
            Entries::Range(pfn, npages) => self.check_range(pfn, npages),
        };
        checked?;
        let space = &self.inner.space;
        let shard_index = read.index();
        let (table, shard) = read.parts();
        let mut record = shard.fresh();
        let planned = match what {
            Entries::Array(pfns) => plan_array_into(table, &mut shard.hint, prot, pfns, &mut record),
            Entries::Range(pfn, npages) => {
                plan_range_into(table, &mut shard.hint, prot, pfn, npages, &mut record)
            }
        };
        let reserved =
            planned.and_then(|()| {
                // The limit first, then the mappings' state, in the order lock mode checks them.
                reserve_in_shard(space, shard, shard_index, record.pages).map_err(|held| {
                    PinError::PinLimit { requested: record.pages, held, max: space.policy.max_pins }
                })?;
                // A mapping an unmap has marked grants no new pins; the unmap, which marks first
                // and then looks at the shards, either waits for this record or was seen here.
                for i in 0..record.mappings.len() {
                    let state = record.view().mapping(i).state();
                    if state != MappingState::Live {
                        shard.stock += record.pages;
                        // Report the first entry in that mapping.
                        let run = record
                            .runs
                            .iter()
                            .find(|r| r.mapping_index() == i)
                            .expect("a planned mapping has a run");
                        let (index, pfn) = (run.index(), run.iova >> PAGE_SHIFT);
                        return Err(match state {
                            MappingState::Unmapping => PinError::Unmapping { index, pfn },
                            _ => PinError::NotMapped { index, pfn },
                        });
                    }
                }
                Ok(())
            });
        if let Err(e) = reserved {
            shard.discard(record);
            shard.counts.pin_failures += 1;
            return Err(e);
        }
        if shard.keepalive.is_none() {
            // Once per shard: the shard holds the space while it has records (see SpaceHandle).
            shard.keepalive = Some(Arc::clone(space));
        }
        shard.counts.pin_calls += 1;
        shard.counts.runs += record.runs.len() as u64;
        shard.counts.pages += record.pages;
        let owner = Owner { space: NonNull::from(&**space), shard: shard_index, prot };
        let record = RecordPtr::Boxed(shard.publish(record, owner));
        drop(read);
        Ok(PinnedPages { hold: HoldWord::recorded(record) })
    }
}
