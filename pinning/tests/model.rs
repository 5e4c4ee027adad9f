//! Random sequences of map / unmap / pin / unpin checked against a simple per-page model:
//! translation of every entry, per-page counts, run splitting, lock accounting, and the
//! exact error (and unwind) of every failing call.

use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::os::fd::AsFd;
use std::os::unix::fs::FileExt;
use std::sync::Arc;
use std::time::Duration;

use proptest::prelude::*;
use umdev_pinning::{
    DmaSpace, DmaSpaceConfig, LockAccount, MapError, PinError, PinMode, PinnedPages, Prot, UnmapError,
    UnpinError, PAGE_SIZE,
};

const P: u64 = PAGE_SIZE;
const SPACE_PAGES: u64 = 64;
const MAX_MAPPINGS: usize = 4;
const LOCK_LIMIT_PAGES: u64 = 24;

#[derive(Clone, Debug)]
enum Op {
    Map { page: u64, pages: u64, prot: u32, message_only: bool },
    Unmap { page: u64, pages: u64 },
    UnmapAll,
    Pin { pfns: Vec<u64>, write: bool },
    PinRange { page: u64, pages: u64, write: bool },
    Drop { which: usize },
    Forget { which: usize },
    UnpinKept { which: usize },
    UnpinAny { pfns: Vec<u64> },
}

fn op() -> impl Strategy<Value = Op> {
    let page = 0..SPACE_PAGES + 4;
    prop_oneof![
        3 => (0..SPACE_PAGES, 1..16u64, 1..=3u32, prop::bool::weighted(0.15))
            .prop_map(|(page, pages, prot, message_only)| Op::Map { page, pages, prot, message_only }),
        1 => (0..SPACE_PAGES, 0..24u64).prop_map(|(page, pages)| Op::Unmap { page, pages }),
        1 => Just(Op::UnmapAll),
        6 => (prop::collection::vec(page.clone(), 1..12), any::<bool>())
            .prop_map(|(pfns, write)| Op::Pin { pfns, write }),
        // Arrays made of short ascending runs, IDAW style.
        3 => (prop::collection::vec((page.clone(), 1..5u64), 1..5), any::<bool>()).prop_map(|(runs, write)| {
            Op::Pin { pfns: runs.into_iter().flat_map(|(s, n)| s..s + n).collect(), write }
        }),
        2 => (page.clone(), 1..20u64, any::<bool>()).prop_map(|(page, pages, write)| Op::PinRange { page, pages, write }),
        3 => any::<usize>().prop_map(|which| Op::Drop { which }),
        1 => any::<usize>().prop_map(|which| Op::Forget { which }),
        1 => any::<usize>().prop_map(|which| Op::UnpinKept { which }),
        1 => prop::collection::vec(page, 1..6).prop_map(|pfns| Op::UnpinAny { pfns }),
    ]
}

struct ModelMapping {
    pages: u64,
    prot: Prot,
    file: Option<File>,
}

/// The model: mappings by first page, and a count per page.
#[derive(Default)]
struct Model {
    mappings: BTreeMap<u64, ModelMapping>,
    counts: HashMap<u64, u32>,
}

#[derive(Debug, PartialEq)]
enum Expect {
    NotMapped(usize, u64),
    Permission(usize, u64),
    NoHostMemory(usize, u64),
    LockLimit(usize, u64),
}

impl Model {
    fn mapping_of(&self, pfn: u64) -> Option<(u64, &ModelMapping)> {
        let (&first, m) = self.mappings.range(..=pfn).next_back()?;
        (pfn < first + m.pages).then_some((first, m))
    }

    fn count(&self, pfn: u64) -> u32 {
        self.counts.get(&pfn).copied().unwrap_or(0)
    }

    fn locked_pages(&self) -> u64 {
        self.counts.values().filter(|&&c| c > 0).count() as u64
    }

    /// Maximal runs: consecutive entries with consecutive pages in one mapping.
    fn runs(&self, pfns: &[u64]) -> Vec<(usize, usize)> {
        let mut runs = Vec::new();
        let mut i = 0;
        while i < pfns.len() {
            let (first, m) = self.mapping_of(pfns[i]).expect("planned entries are mapped");
            let end = first + m.pages;
            let mut n = 1;
            while i + n < pfns.len() && pfns[i + n] == pfns[i] + n as u64 && pfns[i + n] < end {
                n += 1;
            }
            runs.push((i, n));
            i += n;
        }
        runs
    }

    /// What pinning `pfns` should do; on success the model is updated.
    fn pin(&mut self, pfns: &[u64], wanted: Prot, lock: bool) -> Result<Vec<(usize, usize)>, Expect> {
        for (i, &pfn) in pfns.iter().enumerate() {
            match self.mapping_of(pfn) {
                None => return Err(Expect::NotMapped(i, pfn)),
                Some((_, m)) if !m.prot.contains(wanted) => return Err(Expect::Permission(i, pfn)),
                Some((_, m)) if m.file.is_none() => return Err(Expect::NoHostMemory(i, pfn)),
                Some(_) => {}
            }
        }
        let runs = self.runs(pfns);
        let mut trial = self.counts.clone();
        let mut locked = self.locked_pages();
        for &(start, n) in &runs {
            let fresh: Vec<usize> =
                (start..start + n).filter(|&i| trial.get(&pfns[i]).copied().unwrap_or(0) == 0).collect();
            if lock && locked + fresh.len() as u64 > LOCK_LIMIT_PAGES {
                return Err(Expect::LockLimit(fresh[0], pfns[fresh[0]]));
            }
            locked += fresh.len() as u64;
            for &pfn in &pfns[start..start + n] {
                *trial.entry(pfn).or_default() += 1;
            }
        }
        self.counts = trial;
        Ok(runs)
    }

    /// What unpinning `pfns` should do: `Err(index)` for the first entry not pinned.
    fn unpin(&mut self, pfns: &[u64]) -> Result<(), UnpinError> {
        if let Some((i, &pfn)) = pfns.iter().enumerate().find(|(_, &p)| self.mapping_of(p).is_none()) {
            return Err(UnpinError::NotMapped { index: i, pfn });
        }
        let mut trial = self.counts.clone();
        for (i, &pfn) in pfns.iter().enumerate() {
            match trial.get_mut(&pfn) {
                Some(c) if *c > 0 => *c -= 1,
                _ => return Err(UnpinError::NotPinned { index: i, pfn }),
            }
        }
        trial.retain(|_, c| *c > 0);
        self.counts = trial;
        Ok(())
    }

    fn release(&mut self, pfns: &[u64]) {
        self.unpin(pfns).expect("a guard's pages are pinned");
    }
}

fn same_error(actual: &PinError, expected: &Expect) -> bool {
    match (actual, expected) {
        (PinError::NotMapped { index, pfn }, Expect::NotMapped(i, p))
        | (PinError::Permission { index, pfn, .. }, Expect::Permission(i, p))
        | (PinError::NoHostMemory { index, pfn }, Expect::NoHostMemory(i, p))
        | (PinError::LockLimit { index, pfn, .. }, Expect::LockLimit(i, p)) => index == i && pfn == p,
        _ => false,
    }
}

fn new_memfd(pages: u64, first_pfn: u64) -> File {
    let fd = nix::sys::memfd::memfd_create(c"model", nix::sys::memfd::MFdFlags::empty()).unwrap();
    let file = File::from(fd);
    file.set_len(pages * P).unwrap();
    // Tag every page with its IOVA page number, to check translation through the pins.
    for k in 0..pages {
        file.write_all_at(&(first_pfn + k).to_le_bytes(), k * P).unwrap();
    }
    file
}

fn run(ops: Vec<Op>, mode: PinMode) -> Result<(), TestCaseError> {
    let lock = mode == PinMode::Lock;
    let account = Arc::new(LockAccount::with_limit(LOCK_LIMIT_PAGES * P));
    let space = DmaSpace::new(DmaSpaceConfig {
        max_mappings: MAX_MAPPINGS,
        mode,
        account: account.clone(),
        unmap_timeout: Duration::ZERO,
        ..Default::default()
    });
    let mut model = Model::default();
    let mut guards: Vec<(Vec<u64>, PinnedPages)> = Vec::new();
    let mut kept: Vec<Vec<u64>> = Vec::new();

    for op in ops {
        match op {
            Op::Map { page, pages, prot, message_only } => {
                let prot = Prot::from_bits_truncate(prot);
                let overlaps = model.mappings.iter().any(|(&f, m)| f < page + pages && page < f + m.pages);
                let full = model.mappings.len() >= MAX_MAPPINGS;
                let result = if message_only {
                    space.map_message_only(page * P, pages * P, prot).map(|()| None)
                } else {
                    let file = new_memfd(pages, page);
                    space.map(page * P, pages * P, file.as_fd(), 0, prot).map(|()| Some(file))
                };
                match result {
                    Ok(file) => {
                        prop_assert!(!overlaps && !full);
                        model.mappings.insert(page, ModelMapping { pages, prot, file });
                    }
                    Err(MapError::Overlap { .. }) => prop_assert!(overlaps),
                    Err(MapError::TooManyMappings { .. }) => prop_assert!(full && !overlaps),
                    Err(e) => prop_assert!(false, "unexpected map error {e}"),
                }
            }
            Op::Unmap { page, pages } => {
                let result = space.unmap(page * P, pages * P);
                let last = page + pages.max(1) - 1;
                let victims: Vec<u64> = model
                    .mappings
                    .iter()
                    .filter(|(&f, m)| f <= last && page < f + m.pages)
                    .map(|(&f, _)| f)
                    .collect();
                match result {
                    Err(UnmapError::InvalidRange { .. }) => prop_assert_eq!(pages, 0),
                    Err(UnmapError::NotMapped { .. }) => prop_assert!(victims.is_empty()),
                    Err(UnmapError::SplitsMapping { mapping_iova, .. }) => {
                        let f = mapping_iova / P;
                        prop_assert!(f < page || f + model.mappings[&f].pages - 1 > last);
                    }
                    Err(UnmapError::Busy { iova, .. }) => {
                        let f = iova / P;
                        prop_assert!((f..f + model.mappings[&f].pages).any(|p| model.count(p) > 0));
                    }
                    Err(e) => prop_assert!(false, "unexpected unmap error {e}"),
                    Ok(unmapped) => {
                        prop_assert_eq!(unmapped.mappings as usize, victims.len());
                        for f in victims {
                            let m = model.mappings.remove(&f).unwrap();
                            prop_assert!((f..f + m.pages).all(|p| model.count(p) == 0));
                        }
                    }
                }
            }
            Op::UnmapAll => {
                let busy = model.counts.values().any(|&c| c > 0);
                match space.unmap_all() {
                    Ok(_) => {
                        prop_assert!(!busy);
                        model.mappings.clear();
                    }
                    Err(UnmapError::Busy { .. }) => prop_assert!(busy),
                    Err(e) => prop_assert!(false, "unexpected unmap error {e}"),
                }
            }
            Op::Pin { .. } | Op::PinRange { .. } => {
                let (pfns, write, result) = match op {
                    Op::Pin { pfns, write } => {
                        let prot = if write { Prot::WRITE } else { Prot::READ };
                        let r = space.pin_pages(&pfns, prot);
                        (pfns, write, r)
                    }
                    Op::PinRange { page, pages, write } => {
                        let prot = if write { Prot::WRITE } else { Prot::READ };
                        let r = space.pin_range(page * P, pages, prot);
                        ((page..page + pages).collect(), write, r)
                    }
                    _ => unreachable!(),
                };
                let wanted = if write { Prot::WRITE } else { Prot::READ };
                match (result, model.pin(&pfns, wanted, lock)) {
                    (Ok(pins), Ok(runs)) => {
                        let got: Vec<_> =
                            pins.runs().iter().map(|r| (r.index(), r.npages() as usize)).collect();
                        prop_assert_eq!(got, runs);
                        for (i, &pfn) in pfns.iter().enumerate() {
                            let mut tag = [0u8; 8];
                            pins.read(i as u64 * P, &mut tag).unwrap();
                            prop_assert_eq!(u64::from_le_bytes(tag), pfn, "entry {} translated wrong", i);
                        }
                        guards.push((pfns, pins));
                    }
                    (Err(e), Err(expected)) => prop_assert!(same_error(&e, &expected), "{e} vs {expected:?}"),
                    (actual, expected) => {
                        prop_assert!(
                            false,
                            "space {:?} vs model {:?}",
                            actual.map(|p| p.runs().len()),
                            expected
                        )
                    }
                }
            }
            Op::Drop { which } if !guards.is_empty() => {
                let (pfns, pins) = guards.swap_remove(which % guards.len());
                drop(pins);
                model.release(&pfns);
            }
            Op::Forget { which } if !guards.is_empty() => {
                let (pfns, pins) = guards.swap_remove(which % guards.len());
                pins.forget();
                kept.push(pfns);
            }
            Op::UnpinKept { which } if !kept.is_empty() => {
                let pfns = kept.swap_remove(which % kept.len());
                space.unpin_pages(&pfns).map_err(|e| TestCaseError::fail(format!("{e}")))?;
                model.release(&pfns);
            }
            Op::UnpinAny { pfns } => {
                // Only calls that must fail: a successful one would take pins a guard owns.
                let before = model.counts.clone();
                if let Err(expected) = model.unpin(&pfns) {
                    let actual = space.unpin_pages(&pfns).expect_err("the model says this fails");
                    prop_assert_eq!(format!("{actual:?}"), format!("{expected:?}"));
                    prop_assert_eq!(&model.counts, &before);
                } else {
                    model.counts = before;
                }
            }
            Op::Drop { .. } | Op::Forget { .. } | Op::UnpinKept { .. } => {}
        }
        // After every step: counts, totals and lock accounting agree with the model.
        for pfn in 0..SPACE_PAGES + 4 {
            prop_assert_eq!(space.pin_count(pfn * P), model.count(pfn), "count of page {}", pfn);
        }
        let stats = space.stats();
        prop_assert_eq!(stats.pins_held, model.counts.values().map(|&c| u64::from(c)).sum::<u64>());
        prop_assert_eq!(stats.pinned_pages, model.locked_pages());
        let locked = if lock { model.locked_pages() * P } else { 0 };
        prop_assert_eq!(account.locked(), locked);
    }
    drop(guards);
    for pfns in kept {
        let _ = space.unpin_pages(&pfns);
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn track_mode_matches_the_model(ops in prop::collection::vec(op(), 1..60)) {
        run(ops, PinMode::Track)?;
    }

    #[test]
    fn lock_mode_matches_the_model(ops in prop::collection::vec(op(), 1..60)) {
        run(ops, PinMode::Lock)?;
    }
}
