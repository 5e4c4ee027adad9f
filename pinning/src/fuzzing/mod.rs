//! The pinning engine checked against a per-page model: the oracle shared by the proptest
//! (`pinning/tests/model.rs`) and the fuzzer (`fuzz/fuzz_targets/pinning.rs`).
//!
//! For fuzzers and their corpus replay; not API. Compiled only with the `fuzzing` feature.
//!
//! A sequence of [`Op`]s (map, unmap, pin arrays and ranges, drop, forget, unpin, access
//! through a guard) runs against a [`DmaSpace`] with small limits, and every step is
//! compared with a simple model: which mappings exist, a pin count per page, what each
//! page holds. [`run`] panics at the first disagreement: the exact error (variant, entry
//! index and page) of every failing call, the runs of every pin, the bytes read through
//! every guard, every page's count, the totals and the lock accounting.
//!
//! The IOVA space the ops use has two windows: pages `0..LOW_PAGES + 4` and the last
//! [`HIGH_PAGES`] pages below `2^52` (the top of the 64-bit IOVA space), where arithmetic
//! on addresses is closest to overflowing. Pin arrays may also name page numbers that have
//! no byte address at all ([`SPECIAL_PFNS`]).
//!
//! [`ops`] decodes arbitrary bytes into ops (every byte string is a valid program; see
//! [`decode`] for the format) and runs them; [`encode`] is its inverse, for writing seeds.

use std::cell::RefCell;
use std::os::fd::AsFd;
use std::rc::Rc;
use std::sync::Arc;
use std::time::Duration;

use crate::{
    AccessError, DmaSpace, DmaSpaceConfig, LockAccount, MapError, PinMode, PinnedPages, Prot, UnmapError,
    UnpinError, MAX_KERNEL_BUFFERS,
};

mod codec;
mod model;
mod op;
mod seccomp;
mod seeds;

pub use codec::{byte_of, decode, encode, page_of};
use model::{new_memfd, same_error, Expect, Model, ModelMapping};
use op::{range_end, P};
pub use op::{
    Op, HIGH_BASE, HIGH_PAGES, LOCK_LIMIT_PAGES, LOW_PAGES, MAX_MAPPINGS, MAX_OPS, MAX_PAGES_PER_CALL,
    MAX_PINS, SPECIAL_PFNS,
};
pub use seccomp::deny_io_uring_setup;
pub use seeds::seeds;

/// Decodes `data` ([`decode`]) and runs it against the model ([`run`]). Panics on any
/// disagreement.
pub fn ops(data: &[u8]) {
    let (mode, ops) = decode(data);
    run(&ops, mode);
}

/// [`ops`], and in kernel mode also the process's `VmPin` (the kernel's own count of the
/// pages it holds pinned for the process) checked against the engine's kernel pins after
/// every step, and back to where it started at the end: only for a process in which
/// nothing else pins meanwhile (the fuzzer, a test binary of its own).
pub fn ops_alone(data: &[u8]) {
    let (mode, ops) = decode(data);
    run_alone(&ops, mode);
}

/// [`run`] with the `VmPin` checks of [`ops_alone`].
pub fn run_alone(ops: &[Op], mode: PinMode) {
    check(ops, mode, true);
}

/// Pages the kernel holds pinned for this process (`VmPin` of `/proc/self/status`).
pub fn vm_pin_pages() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let kb = status
        .lines()
        .find_map(|l| l.strip_prefix("VmPin:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .unwrap_or(0);
    kb * 1024 / P
}

/// A kept guard: its array and the model's view of each entry's page.
struct Guard {
    pfns: Vec<u64>,
    pins: PinnedPages,
    pages: Vec<(Rc<RefCell<Vec<u8>>>, usize)>,
    write: bool,
}

/// Every page the model tracks counts for.
fn tracked_pages() -> impl Iterator<Item = u64> {
    (0..LOW_PAGES + 4).chain(HIGH_BASE..HIGH_BASE + HIGH_PAGES)
}

/// Runs `ops` against a fresh [`DmaSpace`] in `mode` and the model. Panics on any
/// disagreement.
pub fn run(ops: &[Op], mode: PinMode) {
    check(ops, mode, false);
}

fn check(ops: &[Op], mode: PinMode, alone: bool) {
    let lock = mode == PinMode::Lock;
    let vm_pin_before = vm_pin_pages();
    let account = Arc::new(LockAccount::with_limit(LOCK_LIMIT_PAGES * P));
    let space = DmaSpace::try_new(DmaSpaceConfig {
        max_mappings: MAX_MAPPINGS,
        max_mapped_bytes: crate::DEFAULT_MAX_MAPPED_BYTES,
        mode,
        account: account.clone(),
        unmap_timeout: Duration::ZERO,
        max_pages_per_call: MAX_PAGES_PER_CALL,
        max_pins: MAX_PINS,
        kernel_buffers: MAX_KERNEL_BUFFERS,
    })
    .unwrap_or_else(|e| panic!("the model checks {mode} mode, which cannot start here: {e}"));
    let mut model = Model::default();
    let mut guards: Vec<Guard> = Vec::new();
    let mut kept: Vec<Vec<u64>> = Vec::new();

    for (step, op) in ops.iter().enumerate() {
        let ctx = |what: &str| format!("step {step} ({op:?}): {what}");
        match op {
            &Op::Map { page, pages, prot, message_only, offset_pages } => {
                let prot = Prot::from_bits_truncate(prot);
                let result = if message_only {
                    space.map_message_only(page * P, pages * P, prot).map(|()| None)
                } else {
                    let (file, bytes) = new_memfd(pages, offset_pages, page);
                    space.map(page * P, pages * P, file.as_fd(), offset_pages * P, prot).map(|()| Some(bytes))
                };
                let last = page + pages.max(1) - 1;
                let neighbour = model.mappings.range(..=last).next_back().map(|(&f, m)| (f, m.pages));
                match result {
                    Err(MapError::ZeroSize) => assert_eq!(pages, 0, "{}", ctx("zero size")),
                    Err(MapError::IovaWraps { .. }) => {
                        assert!(pages > 0 && range_end(page, pages).is_none(), "{}", ctx("wraps"))
                    }
                    Err(MapError::NoAccess) => {
                        assert!(
                            pages > 0 && range_end(page, pages).is_some() && prot.is_empty(),
                            "{}",
                            ctx("prot")
                        )
                    }
                    Err(MapError::Overlap { existing_iova, existing_size, .. }) => {
                        assert_eq!(
                            neighbour.filter(|&(f, n)| f + n > page),
                            Some((existing_iova / P, existing_size / P)),
                            "{}",
                            ctx("overlap")
                        );
                    }
                    Err(MapError::TooManyMappings { max }) => {
                        assert_eq!(max, MAX_MAPPINGS, "{}", ctx("max"));
                        assert!(model.mappings.len() >= MAX_MAPPINGS, "{}", ctx("not full"));
                        assert!(neighbour.is_none_or(|(f, n)| f + n <= page), "{}", ctx("overlap first"));
                    }
                    Err(e) => panic!("{}", ctx(&format!("unexpected map error {e}"))),
                    Ok(bytes) => {
                        assert!(
                            pages > 0 && range_end(page, pages).is_some() && !prot.is_empty(),
                            "{}",
                            ctx("ok")
                        );
                        assert!(neighbour.is_none_or(|(f, n)| f + n <= page), "{}", ctx("mapped over"));
                        assert!(model.mappings.len() < MAX_MAPPINGS, "{}", ctx("over the limit"));
                        let memory = bytes.map(|b| Rc::new(RefCell::new(b)));
                        model.mappings.insert(page, ModelMapping { pages, prot, memory });
                    }
                }
            }
            &Op::Unmap { page, pages } => {
                let result = space.unmap(page * P, pages * P);
                let Some(end) = range_end(page, pages).filter(|_| pages > 0) else {
                    assert!(
                        matches!(result, Err(UnmapError::InvalidRange { .. })),
                        "{}",
                        ctx(&format!("{result:?}"))
                    );
                    continue;
                };
                let victims: Vec<u64> = model
                    .mappings
                    .iter()
                    .filter(|(&f, m)| f < end && page < f + m.pages)
                    .map(|(&f, _)| f)
                    .collect();
                let split = victims.iter().copied().find(|&f| f < page || f + model.mappings[&f].pages > end);
                let busy = victims
                    .iter()
                    .copied()
                    .find(|&f| (f..f + model.mappings[&f].pages).any(|p| model.count(p) > 0));
                match result {
                    Err(UnmapError::NotMapped { .. }) => assert!(victims.is_empty(), "{}", ctx("not mapped")),
                    Err(UnmapError::SplitsMapping { mapping_iova, .. }) => {
                        assert_eq!(split, Some(mapping_iova / P), "{}", ctx("split"))
                    }
                    Err(UnmapError::Busy { iova, .. }) => {
                        assert!(split.is_none(), "{}", ctx("split before busy"));
                        assert_eq!(busy, Some(iova / P), "{}", ctx("busy"));
                    }
                    Err(e) => panic!("{}", ctx(&format!("unexpected unmap error {e}"))),
                    Ok(unmapped) => {
                        assert!(split.is_none() && busy.is_none() && !victims.is_empty(), "{}", ctx("ok"));
                        assert_eq!(unmapped.mappings as usize, victims.len(), "{}", ctx("count"));
                        for f in victims {
                            model.mappings.remove(&f);
                        }
                    }
                }
            }
            Op::UnmapAll => {
                let busy = model
                    .mappings
                    .iter()
                    .find(|(&f, m)| (f..f + m.pages).any(|p| model.count(p) > 0))
                    .map(|(&f, _)| f);
                match space.unmap_all() {
                    Ok(unmapped) => {
                        assert!(busy.is_none(), "{}", ctx("unmapped pinned memory"));
                        assert_eq!(unmapped.mappings as usize, model.mappings.len(), "{}", ctx("count"));
                        model.mappings.clear();
                    }
                    Err(UnmapError::Busy { iova, .. }) => assert_eq!(busy, Some(iova / P), "{}", ctx("busy")),
                    Err(e) => panic!("{}", ctx(&format!("unexpected unmap error {e}"))),
                }
            }
            Op::Pin { .. } | Op::PinRange { .. } => {
                let (pfns, wanted, result) = match *op {
                    Op::Pin { ref pfns, prot } => {
                        let prot = Prot::from_bits_truncate(prot);
                        (pfns.clone(), prot, space.pin_pages(pfns, prot))
                    }
                    Op::PinRange { page, pages, prot } => {
                        let prot = Prot::from_bits_truncate(prot);
                        (
                            (0..pages).map(|k| page.wrapping_add(k)).collect(),
                            prot,
                            space.pin_range(page * P, pages, prot),
                        )
                    }
                    _ => unreachable!("matched above"),
                };
                let write = wanted.contains(Prot::WRITE);
                let expected = match *op {
                    // A range running past the last page with a byte address is refused as
                    // a whole, at its first page (unless it asks for no access, refused
                    // before anything is looked at).
                    Op::PinRange { page, pages, .. }
                        if !wanted.is_empty()
                            && pages > 0
                            && pages <= MAX_PAGES_PER_CALL
                            && range_end(page, pages).is_none() =>
                    {
                        Err(Expect::NotMapped(0, page))
                    }
                    _ => model.pin(&pfns, wanted, mode),
                };
                match (result, expected) {
                    (Ok(pins), Ok(runs)) => {
                        let got: Vec<_> =
                            pins.runs().iter().map(|r| (r.index(), r.npages() as usize)).collect();
                        assert_eq!(got, runs, "{}", ctx("runs"));
                        let pages: Vec<_> = pfns.iter().map(|&pfn| model.page_memory(pfn)).collect();
                        for (i, &pfn) in pfns.iter().enumerate() {
                            assert_eq!(pins.iova(i), Some(pfn * P), "{}", ctx("iova"));
                        }
                        guards.push(Guard { pfns, pins, pages, write });
                    }
                    (Err(e), Err(expected)) => {
                        assert!(same_error(&e, &expected), "{}", ctx(&format!("{e} vs {expected:?}")))
                    }
                    (actual, expected) => {
                        panic!(
                            "{}",
                            ctx(&format!("space {:?} vs model {expected:?}", actual.map(|p| p.runs().len())))
                        )
                    }
                }
            }
            &Op::Drop { which } => {
                if !guards.is_empty() {
                    let guard = guards.swap_remove(which % guards.len());
                    drop(guard.pins);
                    model.release(&guard.pfns);
                }
            }
            &Op::Forget { which } => {
                if !guards.is_empty() {
                    let guard = guards.swap_remove(which % guards.len());
                    guard.pins.forget();
                    for &pfn in &guard.pfns {
                        *model.kept.entry(pfn).or_default() += 1;
                    }
                    kept.push(guard.pfns);
                }
            }
            &Op::UnpinKept { which, part } => {
                if !kept.is_empty() {
                    let mut pfns = kept.swap_remove(which % kept.len());
                    let rest = match usize::from(part) {
                        0 => Vec::new(),
                        p => pfns.split_off((1 + p % pfns.len()).min(pfns.len())),
                    };
                    if let Err(e) = space.unpin_pages(&pfns) {
                        panic!("{}", ctx(&format!("unpinning kept pins: {e}")));
                    }
                    model.release_kept(&pfns);
                    if !rest.is_empty() {
                        kept.push(rest);
                    }
                }
            }
            Op::UnpinAny { pfns } => {
                if let Some(expected) = model.unpin_error(pfns) {
                    match space.unpin_pages(pfns) {
                        Ok(()) => panic!("{}", ctx(&format!("unpinned; the model says {expected}"))),
                        Err(actual) => {
                            assert_eq!(format!("{actual:?}"), format!("{expected:?}"), "{}", ctx("unpin"))
                        }
                    }
                }
            }
            &Op::UnpinAnyRange { page, pages } => {
                let expected = match range_end(page, pages) {
                    Some(_) if pages > 0 => model.unpin_error(&(page..page + pages).collect::<Vec<_>>()),
                    _ => Some(UnpinError::InvalidCount(pages)),
                };
                if let Some(expected) = expected {
                    match space.unpin_range(page * P, pages) {
                        Ok(()) => panic!("{}", ctx(&format!("unpinned; the model says {expected}"))),
                        Err(actual) => {
                            assert_eq!(format!("{actual:?}"), format!("{expected:?}"), "{}", ctx("unpin"))
                        }
                    }
                }
            }
            &Op::Access { which, offset, len, write } => {
                if !guards.is_empty() {
                    access(&guards[which % guards.len()], offset, len as usize, write, &ctx(""));
                }
            }
        }
        check_totals(&space, &model, &account, lock, &ctx("after the step"));
        if mode == PinMode::Kernel {
            check_kernel_pins(&space, &model, &guards, &ctx("after the step"));
            if alone {
                let pinned = vm_pin_pages().saturating_sub(vm_pin_before);
                assert_eq!(pinned, space.stats().kernel_pages_held, "{}", ctx("VmPin"));
            }
        }
    }
    drop(guards);
    for pfns in kept {
        let _ = space.unpin_pages(&pfns);
    }
    let stats = space.stats();
    assert_eq!((stats.kernel_buffers_held, stats.kernel_pages_held), (0, 0), "kernel pins left at the end");
    // Disconnect: whatever the client left mapped goes at once.
    space.abandon_all();
    drop(space);
    if alone {
        assert_eq!(vm_pin_pages(), vm_pin_before, "VmPin at the end");
    }
}

/// Kernel mode: the kernel holds each live guard's pages (a buffer per run), and each kept
/// buffer whole until its last page is unpinned: so at least the kept pins, and none once
/// none is kept.
fn check_kernel_pins(space: &DmaSpace, model: &Model, guards: &[Guard], ctx: &str) {
    let stats = space.stats();
    let live: u64 = guards.iter().map(|g| g.pfns.len() as u64).sum();
    let kept: u64 = model.kept.values().map(|&c| u64::from(c)).sum();
    let in_kept =
        stats.kernel_pages_held.checked_sub(live).unwrap_or_else(|| panic!("{ctx}: guards' kernel pins"));
    assert!(in_kept >= kept, "{ctx}: kept pins {kept}, kernel pins of kept buffers {in_kept}");
    assert_eq!(in_kept == 0, kept == 0, "{ctx}: kept buffers let go with their last pin");
}

/// Writes (optionally) then reads `[offset, offset + len)` of a guard's buffer and checks
/// the bytes, or the refusal, against the model.
fn access(guard: &Guard, offset: u64, len: usize, write: bool, ctx: &str) {
    let size = guard.pfns.len() as u64 * P;
    let in_range = offset + len as u64 <= size;
    if write {
        let data: Vec<u8> = (0..len).map(|i| (offset as usize + i).wrapping_mul(31) as u8 ^ 0x5a).collect();
        match guard.pins.write(offset, &data) {
            Ok(()) => {
                assert!(in_range && guard.write, "{ctx}: wrote out of range or read-only");
                for (i, &byte) in data.iter().enumerate() {
                    let at = offset as usize + i;
                    let (memory, base) = &guard.pages[at / P as usize];
                    memory.borrow_mut()[base + at % P as usize] = byte;
                }
            }
            Err(AccessError::ReadOnly) => assert!(!guard.write, "{ctx}: refused as read-only"),
            Err(AccessError::OutOfRange { .. }) => {
                assert!(guard.write && !in_range, "{ctx}: refused as out of range")
            }
            Err(AccessError::Poisoned) => panic!("{ctx}: nothing truncates the model's memory"),
            Err(e @ AccessError::NotContiguous { .. }) => panic!("{ctx}: a copy is not refused as {e}"),
        }
    }
    let mut buf = vec![0u8; len];
    match guard.pins.read(offset, &mut buf) {
        Ok(()) => {
            assert!(in_range, "{ctx}: read out of range");
            for (i, &byte) in buf.iter().enumerate() {
                let at = offset as usize + i;
                let (memory, base) = &guard.pages[at / P as usize];
                let want = memory.borrow()[base + at % P as usize];
                assert_eq!(byte, want, "{ctx}: byte {at} of the guard's buffer");
            }
        }
        Err(AccessError::OutOfRange { .. }) => assert!(!in_range, "{ctx}: refused in range"),
        Err(AccessError::ReadOnly) => panic!("{ctx}: a read refused as read-only"),
        Err(AccessError::Poisoned) => panic!("{ctx}: nothing truncates the model's memory"),
        Err(e @ AccessError::NotContiguous { .. }) => panic!("{ctx}: a copy is not refused as {e}"),
    }
    // The same range as one slice: the same bytes where host memory holds it in one piece.
    match guard.pins.slice(offset, len, Prot::READ) {
        Ok(slice) => {
            assert!(in_range, "{ctx}: a slice out of range");
            let mut got = vec![0u8; len];
            slice.copy_to(&mut got[..]);
            assert_eq!(got, buf, "{ctx}: a slice's bytes");
        }
        Err(AccessError::OutOfRange { .. }) => assert!(!in_range, "{ctx}: a slice refused in range"),
        Err(AccessError::NotContiguous { .. }) => {
            assert!(
                in_range && offset / P != (offset + len as u64 - 1) / P,
                "{ctx}: a slice inside a page refused"
            )
        }
        Err(e) => panic!("{ctx}: a slice for reading refused as {e}"),
    }
}

/// Every tracked page's count, the totals and the lock accounting agree with the model.
fn check_totals(space: &DmaSpace, model: &Model, account: &LockAccount, lock: bool, ctx: &str) {
    for pfn in tracked_pages() {
        assert_eq!(space.pin_count(pfn * P), model.count(pfn), "{ctx}: count of page {pfn:#x}");
    }
    let stats = space.stats();
    assert_eq!(stats.pins_held, model.pins_held(), "{ctx}: pins held");
    assert_eq!(stats.pinned_pages, model.locked_pages(), "{ctx}: pinned pages");
    assert_eq!(stats.mappings as usize, model.mappings.len(), "{ctx}: mappings");
    let locked = if lock { model.locked_pages() * P } else { 0 };
    assert_eq!(account.locked(), locked, "{ctx}: locked bytes");
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    #[cfg_attr(miri, ignore = "Miri: memfd")]
    fn encode_and_decode_round_trip() {
        let ops = vec![
            Op::Map { page: 4, pages: 8, prot: 3, message_only: false, offset_pages: 2 },
            Op::Map { page: HIGH_BASE + 8, pages: 8, prot: 1, message_only: false, offset_pages: 0 },
            Op::Pin { pfns: vec![5, 6, 7, 1, HIGH_BASE + 9, u64::MAX], prot: 2 },
            Op::PinRange { page: 4, pages: 3, prot: 1 },
            Op::Pin { pfns: vec![5, 6], prot: 3 },
            Op::Pin { pfns: vec![5], prot: 0 },
            Op::PinRange { page: 4, pages: 2, prot: 0 },
            Op::PinRange { page: 6, pages: 1, prot: 3 },
            Op::Access { which: 1, offset: 4000, len: 300, write: true },
            Op::Forget { which: 0 },
            Op::UnpinKept { which: 0, part: 0 },
            Op::UnpinAny { pfns: vec![9] },
            Op::UnpinAnyRange { page: 66, pages: 40 },
            Op::Unmap { page: 4, pages: 8 },
            Op::Drop { which: 3 },
            Op::UnmapAll,
        ];
        assert_eq!(decode(&encode(PinMode::Lock, &ops)), (PinMode::Lock, ops.clone()));
        assert_eq!(decode(&encode(PinMode::Kernel, &ops)), (PinMode::Kernel, ops.clone()));
        run(&ops, PinMode::Track);
        run(&ops, PinMode::Lock);
        run(&ops, PinMode::Kernel);
    }

    #[test]
    #[cfg_attr(miri, ignore = "Miri: memfd")]
    fn seeds_round_trip_and_run() {
        for (name, seed) in seeds() {
            let (mode, ops) = decode(&seed);
            assert_eq!(encode(mode, &ops), seed, "{name}");
            run(&ops, mode);
        }
    }

    #[test]
    #[cfg_attr(miri, ignore = "Miri: memfd")]
    fn every_byte_string_decodes() {
        for len in 0..64 {
            let data: Vec<u8> = (0..len).map(|i| (i * 37 + len) as u8).collect();
            ops(&data);
        }
    }
}
