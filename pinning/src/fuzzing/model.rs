//! The per-page model the engine is checked against.

use std::cell::RefCell;
use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::rc::Rc;

use super::op::*;
use crate::{PinError, PinMode, Prot, UnpinError};

/// A mapping in the model: its pages and, for fd-backed ones, what they hold.
pub(super) struct ModelMapping {
    pub(super) pages: u64,
    pub(super) prot: Prot,
    /// The bytes of the mapping (shared with guards' views); `None` without an fd.
    pub(super) memory: Option<Rc<RefCell<Vec<u8>>>>,
}

/// The model: mappings by first page, and a pin count per page.
#[derive(Default)]
pub(super) struct Model {
    pub(super) mappings: BTreeMap<u64, ModelMapping>,
    counts: HashMap<u64, u32>,
    /// The part of `counts` kept with `forget`: all that unpin_pages sees (a live guard's
    /// pins are its own).
    pub(super) kept: HashMap<u64, u32>,
}

/// A failing pin call as the model predicts it.
#[derive(Debug, PartialEq)]
pub(super) enum Expect {
    NoAccess,
    Empty,
    TooManyPages(u64),
    NotMapped(usize, u64),
    Permission(usize, u64),
    NoHostMemory(usize, u64),
    PinLimit(u64, u64),
    LockLimit(usize, u64),
}

impl Model {
    pub(super) fn mapping_of(&self, pfn: u64) -> Option<(u64, &ModelMapping)> {
        let (&first, m) = self.mappings.range(..=pfn).next_back()?;
        (pfn < first + m.pages).then_some((first, m))
    }

    pub(super) fn count(&self, pfn: u64) -> u32 {
        self.counts.get(&pfn).copied().unwrap_or(0)
    }

    pub(super) fn pins_held(&self) -> u64 {
        self.counts.values().map(|&c| u64::from(c)).sum()
    }

    pub(super) fn locked_pages(&self) -> u64 {
        self.counts.values().filter(|&&c| c > 0).count() as u64
    }

    /// Maximal runs: consecutive entries with consecutive pages in one mapping.
    pub(super) fn runs(&self, pfns: &[u64]) -> Vec<(usize, usize)> {
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

    /// What pinning `pfns` should do; on success the model is updated and the runs
    /// returned.
    ///
    /// `mode`: lock mode charges the lock limit; kernel mode needs write access to the
    /// mapping whatever the pin asks for (the kernel pins for writing). A pin asking for no
    /// access is refused first, in every mode.
    pub(super) fn pin(
        &mut self,
        pfns: &[u64],
        wanted: Prot,
        mode: PinMode,
    ) -> Result<Vec<(usize, usize)>, Expect> {
        let lock = mode == PinMode::Lock;
        // A pin asks for some access, whatever it names.
        if wanted.is_empty() {
            return Err(Expect::NoAccess);
        }
        let wanted = if mode == PinMode::Kernel { wanted | Prot::WRITE } else { wanted };
        if pfns.is_empty() {
            return Err(Expect::Empty);
        }
        if pfns.len() as u64 > MAX_PAGES_PER_CALL {
            return Err(Expect::TooManyPages(pfns.len() as u64));
        }
        for (i, &pfn) in pfns.iter().enumerate() {
            match self.mapping_of(pfn) {
                None => return Err(Expect::NotMapped(i, pfn)),
                Some((_, m)) if !m.prot.contains(wanted) => return Err(Expect::Permission(i, pfn)),
                Some((_, m)) if m.memory.is_none() => return Err(Expect::NoHostMemory(i, pfn)),
                Some(_) => {}
            }
        }
        let held = self.pins_held();
        if held + pfns.len() as u64 > MAX_PINS {
            return Err(Expect::PinLimit(pfns.len() as u64, held));
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

    /// What unpinning `pfns` should do; on success the model is updated.
    pub(super) fn unpin(&mut self, pfns: &[u64]) -> Result<(), UnpinError> {
        if pfns.is_empty() || pfns.len() as u64 > MAX_PAGES_PER_CALL {
            return Err(UnpinError::InvalidCount(pfns.len() as u64));
        }
        if let Some((index, &pfn)) = pfns.iter().enumerate().find(|(_, &p)| self.mapping_of(p).is_none()) {
            return Err(UnpinError::NotMapped { index, pfn });
        }
        let mut trial = self.counts.clone();
        for (index, &pfn) in pfns.iter().enumerate() {
            match trial.get_mut(&pfn) {
                Some(c) if *c > 0 => *c -= 1,
                _ => return Err(UnpinError::NotPinned { index, pfn }),
            }
        }
        trial.retain(|_, c| *c > 0);
        self.counts = trial;
        Ok(())
    }

    /// What unpin_pages of `pfns` should refuse, without changing the model: only kept pins
    /// count, in every mode.
    pub(super) fn unpin_error(&self, pfns: &[u64]) -> Option<UnpinError> {
        if pfns.is_empty() || pfns.len() as u64 > MAX_PAGES_PER_CALL {
            return Some(UnpinError::InvalidCount(pfns.len() as u64));
        }
        if let Some((index, &pfn)) = pfns.iter().enumerate().find(|(_, &p)| self.mapping_of(p).is_none()) {
            return Some(UnpinError::NotMapped { index, pfn });
        }
        let mut trial = self.kept.clone();
        for (index, &pfn) in pfns.iter().enumerate() {
            match trial.get_mut(&pfn) {
                Some(c) if *c > 0 => *c -= 1,
                _ => return Some(UnpinError::NotPinned { index, pfn }),
            }
        }
        None
    }

    /// Kept pins of `pfns` (a forgotten guard's) released.
    pub(super) fn release_kept(&mut self, pfns: &[u64]) {
        for pfn in pfns {
            if let Some(c) = self.kept.get_mut(pfn) {
                *c -= 1;
            }
        }
        self.kept.retain(|_, c| *c > 0);
        self.release(pfns);
    }

    pub(super) fn release(&mut self, pfns: &[u64]) {
        if let Err(e) = self.unpin(pfns) {
            panic!("model: a guard's pages must be pinned: {e}");
        }
    }

    /// The model's bytes of page `pfn` (a mapped, fd-backed page).
    pub(super) fn page_memory(&self, pfn: u64) -> (Rc<RefCell<Vec<u8>>>, usize) {
        let (first, m) = self.mapping_of(pfn).expect("a pinned page is mapped");
        let memory = m.memory.clone().expect("a pinned page has memory");
        (memory, ((pfn - first) * P) as usize)
    }
}

pub(super) fn same_error(actual: &PinError, expected: &Expect) -> bool {
    match (actual, expected) {
        (PinError::NoAccess, Expect::NoAccess) | (PinError::Empty, Expect::Empty) => true,
        (PinError::TooManyPages { requested, max }, Expect::TooManyPages(n)) => {
            requested == n && *max == MAX_PAGES_PER_CALL
        }
        (PinError::PinLimit { requested, held, max }, Expect::PinLimit(r, h)) => {
            requested == r && held == h && *max == MAX_PINS
        }
        (PinError::NotMapped { index, pfn }, Expect::NotMapped(i, p))
        | (PinError::Permission { index, pfn, .. }, Expect::Permission(i, p))
        | (PinError::NoHostMemory { index, pfn }, Expect::NoHostMemory(i, p))
        | (PinError::LockLimit { index, pfn, .. }, Expect::LockLimit(i, p)) => index == i && pfn == p,
        _ => false,
    }
}

/// A memfd for a mapping of `pages` pages at file offset `offset_pages` pages, and the
/// model's copy of the mapped part. Every page starts with its IOVA page number.
pub(super) fn new_memfd(pages: u64, offset_pages: u64, first_pfn: u64) -> (File, Vec<u8>) {
    let fd =
        match nix::sys::memfd::memfd_create(c"umdev-fuzz-pinning", nix::sys::memfd::MFdFlags::MFD_CLOEXEC) {
            Ok(fd) => fd,
            Err(e) => panic!("memfd_create: {e}"),
        };
    let file = File::from(fd);
    let mut model = vec![0u8; (pages * P) as usize];
    let tagged = file.set_len((offset_pages + pages) * P).and_then(|()| {
        (0..pages).try_for_each(|k| {
            let tag = first_pfn.wrapping_add(k).to_le_bytes();
            model[(k * P) as usize..(k * P) as usize + 8].copy_from_slice(&tag);
            file.write_all_at(&tag, (offset_pages + k) * P)
        })
    });
    if let Err(e) = tagged {
        panic!("sizing the memfd: {e}");
    }
    (file, model)
}
