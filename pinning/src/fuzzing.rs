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
use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::os::fd::AsFd;
use std::os::unix::fs::FileExt;
use std::rc::Rc;
use std::sync::Arc;
use std::time::Duration;

use crate::{
    AccessError, DmaSpace, DmaSpaceConfig, LockAccount, MapError, PinError, PinMode, PinnedPages, Prot,
    UnmapError, UnpinError, PAGE_SHIFT, PAGE_SIZE,
};

const P: u64 = PAGE_SIZE;
/// Pages of the low window that mappings may start in; pins also name the 4 pages past it.
pub const LOW_PAGES: u64 = 64;
/// Pages of the high window, which ends at the last page with a byte address.
pub const HIGH_PAGES: u64 = 16;
/// First page of the high window.
pub const HIGH_BASE: u64 = (1 << (64 - PAGE_SHIFT)) - HIGH_PAGES;
/// Page numbers without a byte address (at or above `2^52`), which pin arrays may name.
pub const SPECIAL_PFNS: [u64; 4] =
    [1 << (64 - PAGE_SHIFT), (1 << (64 - PAGE_SHIFT)) + 1, u64::MAX - 1, u64::MAX];
/// The space's mapping limit.
pub const MAX_MAPPINGS: usize = 4;
/// The lock account's limit, in pages (lock mode).
pub const LOCK_LIMIT_PAGES: u64 = 12;
/// The space's `max_pages_per_call`.
pub const MAX_PAGES_PER_CALL: u64 = 16;
/// The space's `max_pins`.
pub const MAX_PINS: u64 = 24;
/// Most ops one input runs.
pub const MAX_OPS: usize = 256;

/// One step of a model-checked sequence. Pages are IOVA page numbers.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Op {
    /// Map `pages` pages at `page` with `prot` bits (0 is refused), from a memfd at
    /// `offset_pages` pages in, or without an fd.
    Map {
        /// First page.
        page: u64,
        /// Pages (0 is refused).
        pages: u64,
        /// `Prot` bits, 0 to 3.
        prot: u32,
        /// Without an fd (a message-only region).
        message_only: bool,
        /// File offset of the mapping, in pages.
        offset_pages: u64,
    },
    /// Unmap `[page, page + pages)`.
    Unmap {
        /// First page.
        page: u64,
        /// Pages.
        pages: u64,
    },
    /// Unmap everything.
    UnmapAll,
    /// Pin an array of pages; the guard is kept.
    Pin {
        /// The array.
        pfns: Vec<u64>,
        /// For write (else read).
        write: bool,
    },
    /// Pin a range of pages; the guard is kept.
    PinRange {
        /// First page.
        page: u64,
        /// Pages.
        pages: u64,
        /// For write (else read).
        write: bool,
    },
    /// Drop a kept guard (`which` modulo their number).
    Drop {
        /// Which guard.
        which: usize,
    },
    /// Forget a kept guard: its pins are released later by [`Op::UnpinKept`].
    Forget {
        /// Which guard.
        which: usize,
    },
    /// Unpin the pages of a forgotten guard with `unpin_pages`: all of them, or (`part`
    /// non-zero) only its first `1 + part % len` entries, which can cut through one of its
    /// runs; the rest stay kept.
    UnpinKept {
        /// Which forgotten guard.
        which: usize,
        /// 0: every page; else how many leading entries (modulo the guard's length, plus 1).
        part: u8,
    },
    /// `unpin_pages` of an arbitrary array, run only when the model says it must fail (a
    /// successful one would take pins a guard owns).
    UnpinAny {
        /// The array.
        pfns: Vec<u64>,
    },
    /// `unpin_range` of an arbitrary range, run only when the model says it must fail.
    UnpinAnyRange {
        /// First page.
        page: u64,
        /// Pages.
        pages: u64,
    },
    /// Write (optionally) then read `len` bytes at `offset` of a kept guard's buffer.
    Access {
        /// Which guard.
        which: usize,
        /// Byte offset in the guard's buffer.
        offset: u64,
        /// Bytes.
        len: u64,
        /// Write a pattern first.
        write: bool,
    },
}

/// The page a byte names: the low window, the high window or a page without an address.
pub fn page_of(b: u8) -> u64 {
    match b {
        0..=0xbf => u64::from(b) % (LOW_PAGES + 4),
        0xc0..=0xef => HIGH_BASE + u64::from(b - 0xc0) % HIGH_PAGES,
        _ => SPECIAL_PFNS[usize::from(b - 0xf0) % SPECIAL_PFNS.len()],
    }
}

/// The byte [`page_of`] maps to `page`; pages outside the windows come out as page 0.
pub fn byte_of(page: u64) -> u8 {
    if page < LOW_PAGES + 4 {
        page as u8
    } else if (HIGH_BASE..HIGH_BASE + HIGH_PAGES).contains(&page) {
        0xc0 + (page - HIGH_BASE) as u8
    } else {
        SPECIAL_PFNS.iter().position(|&s| s == page).map_or(0, |i| 0xf0 + i as u8)
    }
}

/// Maps `page` (a mapping's first page) into the windows.
fn map_page_of(b: u8) -> u64 {
    let page = page_of(b);
    if page >= HIGH_BASE + HIGH_PAGES {
        HIGH_BASE
    } else {
        page
    }
}

struct Bytes<'a> {
    data: &'a [u8],
}

impl Bytes<'_> {
    fn byte(&mut self) -> Option<u8> {
        let (&b, rest) = self.data.split_first()?;
        self.data = rest;
        Some(b)
    }

    fn u16(&mut self) -> Option<u16> {
        Some(u16::from_le_bytes([self.byte()?, self.byte()?]))
    }

    fn pages(&mut self) -> Option<Vec<u64>> {
        let n = self.byte()? & 0x3f;
        (0..n).map(|_| self.byte().map(page_of)).collect()
    }
}

/// Decodes bytes into a pin mode and ops; every byte string decodes (a truncated op is
/// dropped).
///
/// Byte 0: bit 0 selects [`PinMode::Lock`]. Then ops, each an opcode byte (modulo 12) and
/// its arguments: pages are one byte each ([`page_of`]), arrays a length byte (low 6 bits,
/// so up to 63 entries, bit 7 = write for pins) then the pages.
///
/// | opcode | op | arguments |
/// |---|---|---|
/// | 0 | Map | page, pages (mod 17), flags: prot = bits 0-1, message-only = bit 2, offset = bits 3-4 |
/// | 1 | Unmap | page, pages (mod 25) |
/// | 2 | UnmapAll | |
/// | 3 | Pin | length/write byte, pages |
/// | 4 | Pin (IDAW style) | byte: runs = 1 + bits 0-1, write = bit 7; per run: page, length (mod 8) |
/// | 5 | PinRange | page, pages (mod 41), write (bit 0) |
/// | 6, 7, 8 | Drop, Forget, UnpinKept | which |
/// | 9 | UnpinAny | length byte, pages |
/// | 10 | UnpinAnyRange | page, pages (mod 41) |
/// | 11 | Access | which, offset (u16), length (u16 mod 12289), write (bit 0) |
pub fn decode(data: &[u8]) -> (PinMode, Vec<Op>) {
    let mut b = Bytes { data };
    let mode = match b.byte() {
        Some(m) if m & 1 != 0 => PinMode::Lock,
        _ => PinMode::Track,
    };
    let mut ops = Vec::new();
    while ops.len() < MAX_OPS {
        let Some(op) = decode_op(&mut b) else { break };
        ops.push(op);
    }
    (mode, ops)
}

fn decode_op(b: &mut Bytes<'_>) -> Option<Op> {
    Some(match b.byte()? % 12 {
        0 => {
            let (page, pages, flags) = (map_page_of(b.byte()?), u64::from(b.byte()? % 17), b.byte()?);
            Op::Map {
                page,
                pages,
                prot: u32::from(flags & 3),
                message_only: flags & 4 != 0,
                offset_pages: u64::from((flags >> 3) & 3),
            }
        }
        1 => Op::Unmap { page: map_page_of(b.byte()?), pages: u64::from(b.byte()? % 25) },
        2 => Op::UnmapAll,
        3 => {
            let head = *b.data.first()?;
            Op::Pin { pfns: b.pages()?, write: head & 0x80 != 0 }
        }
        4 => {
            let head = b.byte()?;
            let mut pfns = Vec::new();
            for _ in 0..1 + (head & 3) {
                let (start, len) = (page_of(b.byte()?), b.byte()? % 8);
                pfns.extend((0..u64::from(len)).map(|k| start.wrapping_add(k)));
            }
            Op::Pin { pfns, write: head & 0x80 != 0 }
        }
        5 => Op::PinRange {
            page: map_page_of(b.byte()?),
            pages: u64::from(b.byte()? % 41),
            write: b.byte()? & 1 != 0,
        },
        6 => Op::Drop { which: usize::from(b.byte()?) },
        7 => Op::Forget { which: usize::from(b.byte()?) },
        8 => Op::UnpinKept { which: usize::from(b.byte()?), part: 0 },
        9 => Op::UnpinAny { pfns: b.pages()? },
        10 => Op::UnpinAnyRange { page: map_page_of(b.byte()?), pages: u64::from(b.byte()? % 41) },
        _ => Op::Access {
            which: usize::from(b.byte()?),
            offset: u64::from(b.u16()?),
            len: u64::from(b.u16()? % 12289),
            write: b.byte()? & 1 != 0,
        },
    })
}

/// Encodes ops so that [`decode`] gives them back (for seeds). Values outside what the
/// format can say are clamped: pages outside the windows become page 0, arrays are cut to
/// 63 entries, counts are taken modulo the format's range, `which` modulo 256.
pub fn encode(mode: PinMode, ops: &[Op]) -> Vec<u8> {
    let mut out = vec![u8::from(mode == PinMode::Lock)];
    let array = |out: &mut Vec<u8>, pfns: &[u64], write: bool| {
        let n = pfns.len().min(63);
        out.push(n as u8 | if write { 0x80 } else { 0 });
        out.extend(pfns[..n].iter().map(|&p| byte_of(p)));
    };
    for op in ops {
        match op {
            Op::Map { page, pages, prot, message_only, offset_pages } => {
                let flags =
                    (*prot as u8 & 3) | if *message_only { 4 } else { 0 } | ((*offset_pages as u8 & 3) << 3);
                out.extend([0, byte_of(*page), *pages as u8, flags]);
            }
            Op::Unmap { page, pages } => out.extend([1, byte_of(*page), *pages as u8]),
            Op::UnmapAll => out.push(2),
            Op::Pin { pfns, write } => {
                out.push(3);
                array(&mut out, pfns, *write);
            }
            Op::PinRange { page, pages, write } => {
                out.extend([5, byte_of(*page), *pages as u8, u8::from(*write)])
            }
            Op::Drop { which } => out.extend([6, *which as u8]),
            Op::Forget { which } => out.extend([7, *which as u8]),
            Op::UnpinKept { which, .. } => out.extend([8, *which as u8]),
            Op::UnpinAny { pfns } => {
                out.push(9);
                array(&mut out, pfns, false);
            }
            Op::UnpinAnyRange { page, pages } => out.extend([10, byte_of(*page), *pages as u8]),
            Op::Access { which, offset, len, write } => {
                out.extend([11, *which as u8]);
                out.extend_from_slice(&(*offset as u16).to_le_bytes());
                out.extend_from_slice(&(*len as u16).to_le_bytes());
                out.push(u8::from(*write));
            }
        }
    }
    out
}

/// Decodes `data` ([`decode`]) and runs it against the model ([`run`]). Panics on any
/// disagreement.
pub fn ops(data: &[u8]) {
    let (mode, ops) = decode(data);
    run(&ops, mode);
}

/// A mapping in the model: its pages and, for fd-backed ones, what they hold.
struct ModelMapping {
    pages: u64,
    prot: Prot,
    /// The bytes of the mapping (shared with guards' views); `None` without an fd.
    memory: Option<Rc<RefCell<Vec<u8>>>>,
}

/// The model: mappings by first page, and a pin count per page.
#[derive(Default)]
struct Model {
    mappings: BTreeMap<u64, ModelMapping>,
    counts: HashMap<u64, u32>,
    /// The part of `counts` kept with `forget`: all that track mode's unpin_pages sees (a
    /// live guard's pins are its own there).
    kept: HashMap<u64, u32>,
}

/// A failing pin call as the model predicts it.
#[derive(Debug, PartialEq)]
enum Expect {
    Empty,
    TooManyPages(u64),
    NotMapped(usize, u64),
    Permission(usize, u64),
    NoHostMemory(usize, u64),
    PinLimit(u64, u64),
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

    fn pins_held(&self) -> u64 {
        self.counts.values().map(|&c| u64::from(c)).sum()
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

    /// What pinning `pfns` should do; on success the model is updated and the runs
    /// returned.
    fn pin(&mut self, pfns: &[u64], wanted: Prot, lock: bool) -> Result<Vec<(usize, usize)>, Expect> {
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
    fn unpin(&mut self, pfns: &[u64]) -> Result<(), UnpinError> {
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

    /// What unpin_pages of `pfns` should refuse, without changing the model: in track mode
    /// only kept pins count, in lock mode every pin.
    fn unpin_error(&self, pfns: &[u64], lock: bool) -> Option<UnpinError> {
        if pfns.is_empty() || pfns.len() as u64 > MAX_PAGES_PER_CALL {
            return Some(UnpinError::InvalidCount(pfns.len() as u64));
        }
        if let Some((index, &pfn)) = pfns.iter().enumerate().find(|(_, &p)| self.mapping_of(p).is_none()) {
            return Some(UnpinError::NotMapped { index, pfn });
        }
        let mut trial = if lock { self.counts.clone() } else { self.kept.clone() };
        for (index, &pfn) in pfns.iter().enumerate() {
            match trial.get_mut(&pfn) {
                Some(c) if *c > 0 => *c -= 1,
                _ => return Some(UnpinError::NotPinned { index, pfn }),
            }
        }
        None
    }

    /// Kept pins of `pfns` (a forgotten guard's) released.
    fn release_kept(&mut self, pfns: &[u64]) {
        for pfn in pfns {
            if let Some(c) = self.kept.get_mut(pfn) {
                *c -= 1;
            }
        }
        self.kept.retain(|_, c| *c > 0);
        self.release(pfns);
    }

    fn release(&mut self, pfns: &[u64]) {
        if let Err(e) = self.unpin(pfns) {
            panic!("model: a guard's pages must be pinned: {e}");
        }
    }

    /// The model's bytes of page `pfn` (a mapped, fd-backed page).
    fn page_memory(&self, pfn: u64) -> (Rc<RefCell<Vec<u8>>>, usize) {
        let (first, m) = self.mapping_of(pfn).expect("a pinned page is mapped");
        let memory = m.memory.clone().expect("a pinned page has memory");
        (memory, ((pfn - first) * P) as usize)
    }
}

fn same_error(actual: &PinError, expected: &Expect) -> bool {
    match (actual, expected) {
        (PinError::Empty, Expect::Empty) => true,
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
fn new_memfd(pages: u64, offset_pages: u64, first_pfn: u64) -> (File, Vec<u8>) {
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

/// A kept guard: its array and the model's view of each entry's page.
struct Guard {
    pfns: Vec<u64>,
    pins: PinnedPages,
    pages: Vec<(Rc<RefCell<Vec<u8>>>, usize)>,
    write: bool,
}

/// The one-past-the-end page of `[page, page + pages)`, if it has a byte address.
fn range_end(page: u64, pages: u64) -> Option<u64> {
    page.checked_add(pages).filter(|&end| end <= 1 << (64 - PAGE_SHIFT))
}

/// Every page the model tracks counts for.
fn tracked_pages() -> impl Iterator<Item = u64> {
    (0..LOW_PAGES + 4).chain(HIGH_BASE..HIGH_BASE + HIGH_PAGES)
}

/// Runs `ops` against a fresh [`DmaSpace`] in `mode` and the model. Panics on any
/// disagreement.
pub fn run(ops: &[Op], mode: PinMode) {
    let lock = mode == PinMode::Lock;
    let account = Arc::new(LockAccount::with_limit(LOCK_LIMIT_PAGES * P));
    let space = DmaSpace::new(DmaSpaceConfig {
        max_mappings: MAX_MAPPINGS,
        mode,
        account: account.clone(),
        unmap_timeout: Duration::ZERO,
        max_pages_per_call: MAX_PAGES_PER_CALL,
        max_pins: MAX_PINS,
    });
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
                let (pfns, write, result) = match *op {
                    Op::Pin { ref pfns, write } => {
                        let prot = if write { Prot::WRITE } else { Prot::READ };
                        (pfns.clone(), write, space.pin_pages(pfns, prot))
                    }
                    Op::PinRange { page, pages, write } => {
                        let prot = if write { Prot::WRITE } else { Prot::READ };
                        (
                            (0..pages).map(|k| page.wrapping_add(k)).collect(),
                            write,
                            space.pin_range(page * P, pages, prot),
                        )
                    }
                    _ => unreachable!("matched above"),
                };
                let wanted = if write { Prot::WRITE } else { Prot::READ };
                let expected = match *op {
                    // A range running past the last page with a byte address is refused as
                    // a whole, at its first page.
                    Op::PinRange { page, pages, .. }
                        if pages > 0 && pages <= MAX_PAGES_PER_CALL && range_end(page, pages).is_none() =>
                    {
                        Err(Expect::NotMapped(0, page))
                    }
                    _ => model.pin(&pfns, wanted, lock),
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
                if let Some(expected) = model.unpin_error(pfns, lock) {
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
                    Some(_) if pages > 0 => {
                        model.unpin_error(&(page..page + pages).collect::<Vec<_>>(), lock)
                    }
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
    }
    drop(guards);
    for pfns in kept {
        let _ = space.unpin_pages(&pfns);
    }
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

/// Hand-made seeds, as `(name, input)`: the README's IDAW example, guards and forgotten pins,
/// each limit, busy and splitting unmaps, the top of the IOVA space. The corpus replay runs
/// them besides the corpus files; `tests/fuzz_corpus.rs` can write them into
/// `fuzz/corpus/pinning/`.
pub fn seeds() -> Vec<(&'static str, Vec<u8>)> {
    let map = |page, pages, prot| Op::Map { page, pages, prot, message_only: false, offset_pages: 0 };
    let idaw = Op::Pin { pfns: vec![1, 5, 6, 7, 9], write: true };
    let top = HIGH_BASE + HIGH_PAGES;
    let sets: Vec<(&'static str, PinMode, Vec<Op>)> = vec![
        (
            "idaw-runs",
            PinMode::Track,
            vec![
                map(0, 16, 3),
                idaw.clone(),
                Op::Access { which: 0, offset: 4000, len: 9000, write: true },
                Op::PinRange { page: 4, pages: 8, write: false },
                Op::Access { which: 1, offset: 20000, len: 12288, write: false },
                Op::Drop { which: 0 },
                Op::Unmap { page: 0, pages: 16 },
                Op::Drop { which: 0 },
                Op::Unmap { page: 0, pages: 16 },
            ],
        ),
        (
            "forget-and-unpin",
            PinMode::Track,
            vec![
                map(0, 8, 3),
                Op::Map { page: 8, pages: 8, prot: 1, message_only: false, offset_pages: 3 },
                Op::Pin { pfns: vec![6, 7, 8, 9, 7], write: false },
                Op::Forget { which: 0 },
                Op::UnpinAny { pfns: vec![7, 7, 7] },
                Op::UnpinAnyRange { page: 6, pages: 5 },
                Op::UnmapAll,
                Op::UnpinKept { which: 0, part: 0 },
                Op::UnmapAll,
            ],
        ),
        (
            "lock-limit",
            PinMode::Lock,
            vec![
                map(0, 16, 3),
                Op::PinRange { page: 0, pages: 10, write: true },
                Op::Pin { pfns: vec![0, 1, 10, 11, 12], write: false },
                Op::Pin { pfns: vec![0, 1, 10, 11, 12, 13], write: false },
                Op::Drop { which: 0 },
                Op::PinRange { page: 5, pages: 11, write: true },
            ],
        ),
        (
            "pin-and-call-limits",
            PinMode::Track,
            vec![
                map(0, 16, 3),
                Op::PinRange { page: 0, pages: MAX_PAGES_PER_CALL, write: false },
                Op::PinRange { page: 0, pages: MAX_PAGES_PER_CALL + 1, write: false },
                Op::PinRange { page: 0, pages: 16, write: false },
                Op::Pin { pfns: vec![], write: false },
            ],
        ),
        (
            "mixed-mappings",
            PinMode::Track,
            vec![
                map(2, 4, 3),
                Op::Map { page: 6, pages: 4, prot: 1, message_only: false, offset_pages: 1 },
                Op::Map { page: 10, pages: 4, prot: 3, message_only: true, offset_pages: 0 },
                Op::Map { page: 14, pages: 4, prot: 0, message_only: false, offset_pages: 0 },
                map(0, 0, 3),
                map(4, 4, 3),
                Op::PinRange { page: 2, pages: 8, write: false },
                Op::PinRange { page: 2, pages: 8, write: true },
                Op::Pin { pfns: vec![9, 10], write: false },
                Op::Unmap { page: 3, pages: 4 },
                Op::Unmap { page: 2, pages: 8 },
                Op::Unmap { page: 20, pages: 2 },
                Op::Drop { which: 0 },
                Op::Unmap { page: 2, pages: 12 },
                map(20, 1, 3),
                map(30, 1, 3),
                map(40, 1, 3),
                map(50, 1, 3),
                map(60, 1, 3),
            ],
        ),
        (
            "top-of-iova-space",
            PinMode::Lock,
            vec![
                Op::Map { page: top - 4, pages: 4, prot: 3, message_only: false, offset_pages: 2 },
                Op::Map { page: top - 8, pages: 8, prot: 3, message_only: false, offset_pages: 0 },
                Op::Map { page: top - 8, pages: 4, prot: 3, message_only: false, offset_pages: 0 },
                Op::PinRange { page: top - 6, pages: 6, write: true },
                Op::PinRange { page: top - 6, pages: 7, write: true },
                Op::Pin { pfns: vec![top - 1, top, u64::MAX, top - 2], write: false },
                Op::Pin { pfns: vec![top - 2, top - 1], write: false },
                Op::Access { which: 1, offset: 4090, len: 12, write: true },
                Op::UnpinAnyRange { page: top - 2, pages: 3 },
                Op::Unmap { page: top - 4, pages: 5 },
                Op::UnmapAll,
            ],
        ),
    ];
    sets.into_iter().map(|(name, mode, ops)| (name, encode(mode, &ops))).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn encode_and_decode_round_trip() {
        let ops = vec![
            Op::Map { page: 4, pages: 8, prot: 3, message_only: false, offset_pages: 2 },
            Op::Map { page: HIGH_BASE + 8, pages: 8, prot: 1, message_only: false, offset_pages: 0 },
            Op::Pin { pfns: vec![5, 6, 7, 1, HIGH_BASE + 9, u64::MAX], write: true },
            Op::PinRange { page: 4, pages: 3, write: false },
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
        run(&ops, PinMode::Track);
        run(&ops, PinMode::Lock);
    }

    #[test]
    fn seeds_round_trip_and_run() {
        for (name, seed) in seeds() {
            let (mode, ops) = decode(&seed);
            assert_eq!(encode(mode, &ops), seed, "{name}");
            run(&ops, mode);
        }
    }

    #[test]
    fn every_byte_string_decodes() {
        for len in 0..64 {
            let data: Vec<u8> = (0..len).map(|i| (i * 37 + len) as u8).collect();
            ops(&data);
        }
    }
}
