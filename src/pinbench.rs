//! `umdev pinbench`: pin+unpin of an array in one call ("runs") against the same public
//! API called once per page ("per-page", what Linux type1 does for external pins), for
//! each backing, pattern, size and mode, alternating in one process. Lock-mode rows are
//! followed by the kernel's floor, timed in the same alternating rounds: bare
//! mlock+munlock of the same runs, and page by page. Kernel-mode rows likewise by bare
//! io_uring buffer registration: register and clear the same runs in one call each (as the
//! engine does, on a ring of the benchmark's own), and a page per call. Kernel mode also
//! runs on a memfd of transparent huge pages (folios of 2 MiB), where the kernel pins a
//! run of one folio as one piece.

use crate::output::out;
use std::fs::File;
use std::hint::black_box;
use std::os::fd::AsFd;
use std::sync::Arc;
use std::time::{Duration, Instant};

use nix::sys::memfd::{memfd_create, MFdFlags};
use serde::Serialize;
use umdev_pinning::{DmaSpace, DmaSpaceConfig, LockAccount, PinMode, PinnedPages, Prot, PAGE_SIZE};

mod plot;

/// Pages in each benchmark mapping: room for 512 scattered pages and their gaps.
const MAPPING_PAGES: u64 = 4096; // 16 MiB, 8 huge pages
const IOVA_BASE: u64 = 1 << 32;
const SIZES: [usize; 4] = [1, 8, 64, 512];
const PATTERNS: [Pattern; 5] =
    [Pattern::Contiguous, Pattern::Range, Pattern::Scattered, Pattern::IdawMixed, Pattern::Single];

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Pattern {
    /// `[b, b+1, ..., b+n-1]`.
    Contiguous,
    /// The same pages as one range (`pin_range`, no array to read; per-page: one-page
    /// ranges). Its translate floor is the contiguous array's.
    Range,
    /// Every other page in random order: no two entries adjacent.
    Scattered,
    /// Runs of random length 1-16 with gaps between them, in random order.
    IdawMixed,
    /// One page repeated n times (n = 1: the single-page pin upstream made slower).
    Single,
}

impl Pattern {
    pub fn name(self) -> &'static str {
        match self {
            Pattern::Contiguous => "contiguous",
            Pattern::Range => "range",
            Pattern::Scattered => "scattered",
            Pattern::IdawMixed => "idaw-mixed",
            Pattern::Single => "single",
        }
    }

    /// Page offsets (within the mapping) of an `n`-entry array.
    pub fn offsets(self, n: usize, rng: &mut Rng) -> Vec<u64> {
        match self {
            Pattern::Contiguous | Pattern::Range => (0..n as u64).collect(),
            Pattern::Scattered => {
                let mut v: Vec<u64> = (0..n as u64).map(|k| 2 * k).collect();
                rng.shuffle(&mut v);
                v
            }
            Pattern::IdawMixed => {
                let mut runs: Vec<Vec<u64>> = Vec::new();
                let (mut at, mut left) = (0u64, n as u64);
                while left > 0 {
                    let len = (1 + rng.below(16)).min(left);
                    runs.push((at..at + len).collect());
                    at += len + 1 + rng.below(3);
                    left -= len;
                }
                rng.shuffle(&mut runs);
                runs.concat()
            }
            Pattern::Single => vec![0; n],
        }
    }
}

/// xorshift64: reproducible patterns with no RNG dependency.
pub struct Rng(u64);
impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng(seed | 1)
    }
    pub fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n
    }
    pub fn shuffle<T>(&mut self, v: &mut [T]) {
        for i in (1..v.len()).rev() {
            v.swap(i, self.below(i as u64 + 1) as usize);
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum BackingKind {
    Small,
    Huge,
    /// A memfd whose pages are 2 MiB folios (transparent huge pages of shmem).
    Thp,
}

impl BackingKind {
    fn name(self) -> &'static str {
        match self {
            BackingKind::Small => "4k-memfd",
            BackingKind::Huge => "2m-hugetlb",
            BackingKind::Thp => "2m-thp-memfd",
        }
    }

    /// The modes measured on this backing: kernel mode only on THP (what folio batching
    /// changes), all three elsewhere.
    fn modes(self) -> &'static [PinMode] {
        match self {
            BackingKind::Thp => &[PinMode::Kernel],
            _ => &[PinMode::Track, PinMode::Lock, PinMode::Kernel],
        }
    }

    fn memfd(self) -> std::io::Result<File> {
        let flags = match self {
            BackingKind::Small | BackingKind::Thp => MFdFlags::empty(),
            BackingKind::Huge => MFdFlags::MFD_HUGETLB | MFdFlags::MFD_HUGE_2MB,
        };
        let file = File::from(memfd_create(c"umdev-pinbench", flags)?);
        file.set_len(MAPPING_PAGES * PAGE_SIZE)?;
        if self == BackingKind::Thp {
            thp::fill_with_huge_folios(&file, MAPPING_PAGES * PAGE_SIZE)?;
        }
        Ok(file)
    }
}

/// One line of results (medians over the rounds).
#[derive(Clone, Debug, Serialize)]
pub struct Row {
    pub backing: &'static str,
    pub pattern: &'static str,
    pub npages: usize,
    pub mode: String,
    pub runs_ns: f64,
    pub per_page_ns: f64,
    pub ratio: f64,
    /// The same array through [`DmaSpace::translate_pages`]: the same lookups and address
    /// arithmetic, no pins (what an unsafe translator costs here), alternated with the pin rows.
    pub translate_ns: f64,
    /// Reading the array and nothing else (a XOR over its entries), alternated with the rest:
    /// what any translator or pinner spends at least to learn what the call names. What a
    /// call costs beyond it is its per-run work.
    pub read_ns: f64,
    /// Lock and kernel rows: `runs_ns` over the bare kernel floor's (the next row), and the
    /// same per page. The targets: lock mode at most 1.5x, kernel mode at most 1.2x.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub vs_floor: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub per_page_vs_floor: Option<f64>,
    /// Runs in the array (not in the JSON line contract, but useful in the table).
    #[serde(skip)]
    pub runs: usize,
}

/// How long to measure.
#[derive(Clone, Copy, Debug)]
pub struct Effort {
    /// Alternating rounds per row; medians are taken over them.
    pub rounds: usize,
    /// Target duration of one timed batch.
    pub batch: Duration,
}

/// The median of `v` (sorts it).
pub fn median(v: &mut [f64]) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

/// Times `f` run `iters` times; ns per run.
fn time(iters: u64, mut f: impl FnMut()) -> f64 {
    let start = Instant::now();
    for _ in 0..iters {
        f();
    }
    start.elapsed().as_nanos() as f64 / iters as f64
}

/// Iterations that make one batch of `f` last about `target`.
fn calibrate(target: Duration, mut f: impl FnMut()) -> u64 {
    let mut iters = 1u64;
    loop {
        let start = Instant::now();
        for _ in 0..iters {
            f();
        }
        let took = start.elapsed();
        if took >= target / 4 || iters >= 1 << 24 {
            let per = took.as_nanos().max(1) as f64 / iters as f64;
            return ((target.as_nanos() as f64 / per) as u64).max(1);
        }
        iters *= 4;
    }
}

/// Measures the closures in turn, round after round; returns each one's median ns per call.
fn alternate<const N: usize>(effort: Effort, mut fs: [&mut dyn FnMut(); N]) -> [f64; N] {
    let iters: Vec<u64> = fs.iter_mut().map(|f| calibrate(effort.batch, f)).collect();
    let mut samples: Vec<Vec<f64>> = vec![Vec::with_capacity(effort.rounds); N];
    for _ in 0..effort.rounds {
        for (k, f) in fs.iter_mut().enumerate() {
            samples[k].push(time(iters[k], f));
        }
    }
    std::array::from_fn(|k| median(&mut samples[k]))
}

struct Bench {
    space: DmaSpace,
    _file: File,
}

impl Bench {
    fn new(kind: BackingKind, mode: PinMode) -> std::io::Result<Self> {
        let file = kind.memfd()?;
        let space = DmaSpace::new(DmaSpaceConfig {
            mode,
            account: Arc::new(LockAccount::unlimited()),
            ..Default::default()
        });
        space
            .map(IOVA_BASE, MAPPING_PAGES * PAGE_SIZE, file.as_fd(), 0, Prot::READ_WRITE)
            .map_err(|e| std::io::Error::other(e.to_string()))?;
        // Fault the memory in once, so the first rounds do not pay page allocation.
        let all = space
            .pin_range(IOVA_BASE, MAPPING_PAGES, Prot::WRITE)
            .map_err(|e| std::io::Error::other(e.to_string()))?;
        for i in 0..MAPPING_PAGES {
            all.write(i * PAGE_SIZE, &[1]).map_err(|e| std::io::Error::other(e.to_string()))?;
        }
        drop(all);
        Ok(Bench { space, _file: file })
    }
}

/// Why the hugetlb backing is unavailable, if it is.
pub fn hugetlb_unavailable() -> Option<String> {
    match BackingKind::Huge.memfd().and_then(|f| {
        let space = DmaSpace::default();
        space
            .map(0, MAPPING_PAGES * PAGE_SIZE, f.as_fd(), 0, Prot::READ_WRITE)
            .map_err(|e| std::io::Error::other(e.to_string()))
    }) {
        Ok(()) => None,
        Err(e) => {
            let reserved = std::fs::read_to_string("/proc/sys/vm/nr_hugepages").unwrap_or_default();
            Some(format!(
                "2 MiB hugetlb backing skipped: {e} (nr_hugepages = {}; it needs {} free 2 MiB pages: \
                 as root, echo 64 > /proc/sys/vm/nr_hugepages)",
                reserved.trim(),
                MAPPING_PAGES * PAGE_SIZE / (2 << 20)
            ))
        }
    }
}

/// Why the THP backing is unavailable, if it is.
pub fn thp_unavailable() -> Option<String> {
    match BackingKind::Thp.memfd() {
        Ok(_) => None,
        Err(e) => Some(format!("2 MiB THP memfd backing skipped: {e}")),
    }
}

/// Runs the whole grid, calling `emit` for each row as it completes.
pub fn run(
    effort: Effort,
    only: Option<PinMode>,
    mut emit: impl FnMut(&Row) -> Result<(), String>,
) -> Result<Vec<Row>, String> {
    let mut rows = Vec::new();
    let mut kinds = vec![BackingKind::Small];
    match hugetlb_unavailable() {
        None => kinds.push(BackingKind::Huge),
        Some(why) => eprintln!("pinbench: {why}"),
    }
    let wanted = |mode: PinMode| only.is_none_or(|o| o == mode);
    let kernel = wanted(PinMode::Kernel)
        && match umdev_pinning::kernel_pins_available() {
            Ok(()) => true,
            Err(why) => {
                eprintln!("pinbench: kernel-mode rows skipped: {why}");
                false
            }
        };
    if kernel {
        match thp_unavailable() {
            None => kinds.push(BackingKind::Thp),
            Some(why) => eprintln!("pinbench: {why}"),
        }
    }
    let modes = move |kind: BackingKind| {
        kind.modes().iter().copied().filter(move |&m| wanted(m) && (kernel || m != PinMode::Kernel))
    };
    let steps = kinds.iter().map(|&k| modes(k).count()).sum::<usize>() * PATTERNS.len() * SIZES.len();
    let mut progress = crate::progress::Progress::new("pinbench", steps);
    for &kind in &kinds {
        for mode in modes(kind) {
            let bench = Bench::new(kind, mode).map_err(|e| format!("{}: {e}", kind.name()))?;
            for pattern in PATTERNS {
                for n in SIZES {
                    progress.step(format_args!("{} {mode} {} {n} pages", kind.name(), pattern.name()));
                    let mut rng = Rng::new(0x5eed ^ (n as u64) << 8 ^ pattern as u64);
                    let pfns = LineAligned::new(
                        pattern.offsets(n, &mut rng).into_iter().map(|o| IOVA_BASE / PAGE_SIZE + o),
                    );
                    for row in measure(&bench.space, kind, mode, pattern, pfns.get(), effort)? {
                        emit(&row)?;
                        rows.push(row);
                    }
                }
            }
        }
    }
    Ok(rows)
}

fn measure(
    space: &DmaSpace,
    kind: BackingKind,
    mode: PinMode,
    pattern: Pattern,
    pfns: &[u64],
    effort: Effort,
) -> Result<Vec<Row>, String> {
    let prot = Prot::READ;
    let probe = space.pin_pages(pfns, prot).map_err(|e| e.to_string())?;
    let runs: Vec<(usize, usize)> = probe.runs().iter().map(|r| (r.host_addr(), r.len() as usize)).collect();
    let pages: Vec<usize> = (0..pfns.len()).map(|i| probe.host_addr(i).expect("entry is pinned")).collect();
    drop(probe);

    // Both sides hold their guards the same way (in a Vec, dropped together), so that for a
    // one-page array they run the very same code and differ only by noise.
    let mut one_call: Vec<PinnedPages> = Vec::with_capacity(1);
    let mut per_page: Vec<PinnedPages> = Vec::with_capacity(pfns.len());
    let mut translated: Vec<(usize, u64)> = Vec::with_capacity(pfns.len());
    let mut pin_whole = || {
        let pinned = match pattern {
            Pattern::Range => space.pin_range(black_box(pfns[0] * PAGE_SIZE), pfns.len() as u64, prot),
            _ => space.pin_pages(black_box(pfns), prot),
        };
        one_call.push(pinned.expect("pin"));
        one_call.clear();
    };
    let mut pin_each = || {
        for pfn in pfns.chunks(1) {
            let pinned = match pattern {
                Pattern::Range => space.pin_range(black_box(pfn[0] * PAGE_SIZE), 1, prot),
                _ => space.pin_pages(black_box(pfn), prot),
            };
            per_page.push(pinned.expect("pin"));
        }
        per_page.clear();
    };
    let mut translate = || {
        translated.clear();
        space
            .translate_pages(black_box(pfns), prot, |_, host, n| translated.push((host, n)))
            .expect("translate");
        black_box(&translated);
    };
    // Range rows read the same array: as with translation, their floor is the array's.
    let mut read = || {
        black_box(read_entries(black_box(pfns)));
    };
    let row = |mode: String, runs_ns: f64, per_page_ns: f64, translate_ns: f64, read_ns: f64| Row {
        backing: kind.name(),
        pattern: pattern.name(),
        npages: pfns.len(),
        mode,
        runs_ns,
        per_page_ns,
        ratio: per_page_ns / runs_ns,
        translate_ns,
        read_ns,
        vs_floor: None,
        per_page_vs_floor: None,
        runs: runs.len(),
    };
    // Beside its floor: the ratios of the mode's row to the floor's.
    let against = |mut row: Row, floor: &Row| {
        row.vs_floor = Some(row.runs_ns / floor.runs_ns);
        row.per_page_vs_floor = Some(row.per_page_ns / floor.per_page_ns);
        vec![row, floor.clone()]
    };
    if mode == PinMode::Kernel {
        // Kernel mode against bare io_uring registration of the same memory, all six
        // alternating in the same rounds: the runs in one call and cleared in one (what the
        // engine does for a call and its guard), and a page per call each way.
        let floor = UringFloor::new().map_err(|e| format!("io_uring floor: {e}"))?;
        let run_bufs: Vec<libc::iovec> = runs.iter().map(|&(addr, len)| iovec(addr, len)).collect();
        let page_bufs: Vec<libc::iovec> = pages.iter().map(|&addr| iovec(addr, PAGE_SIZE as usize)).collect();
        let mut register_runs = || {
            floor.update(0, &run_bufs);
            floor.clear(0, run_bufs.len());
        };
        let mut register_pages = || {
            for (slot, buf) in page_bufs.iter().enumerate() {
                floor.update(slot as u32, std::slice::from_ref(buf));
            }
            for slot in 0..page_bufs.len() {
                floor.clear(slot as u32, 1);
            }
        };
        let [runs_ns, per_page_ns, translate_ns, read_ns, floor_runs, floor_pages] = alternate(
            effort,
            [
                &mut pin_whole,
                &mut pin_each,
                &mut translate,
                &mut read,
                &mut register_runs,
                &mut register_pages,
            ],
        );
        return Ok(against(
            row(mode.to_string(), runs_ns, per_page_ns, translate_ns, read_ns),
            &row("uring-floor".into(), floor_runs, floor_pages, translate_ns, read_ns),
        ));
    }
    if mode == PinMode::Track {
        let [runs_ns, per_page_ns, translate_ns, read_ns] =
            alternate(effort, [&mut pin_whole, &mut pin_each, &mut translate, &mut read]);
        return Ok(vec![row(mode.to_string(), runs_ns, per_page_ns, translate_ns, read_ns)]);
    }
    // Lock mode against the kernel's floor, all five alternating in the same rounds: the
    // ratio to bare mlock+munlock is what lock mode is held to.
    let mut lock_runs = || {
        for &(addr, len) in &runs {
            mlock(addr, len, true);
        }
        for &(addr, len) in &runs {
            mlock(addr, len, false);
        }
    };
    let mut lock_pages = || {
        for &addr in &pages {
            mlock(addr, PAGE_SIZE as usize, true);
        }
        for &addr in &pages {
            mlock(addr, PAGE_SIZE as usize, false);
        }
    };
    let [runs_ns, per_page_ns, translate_ns, read_ns, floor_runs, floor_pages] = alternate(
        effort,
        [&mut pin_whole, &mut pin_each, &mut translate, &mut read, &mut lock_runs, &mut lock_pages],
    );
    Ok(against(
        row(mode.to_string(), runs_ns, per_page_ns, translate_ns, read_ns),
        &row("mlock-floor".into(), floor_runs, floor_pages, translate_ns, read_ns),
    ))
}

fn iovec(addr: usize, len: usize) -> libc::iovec {
    libc::iovec { iov_base: addr as *mut libc::c_void, iov_len: len }
}

/// Bare io_uring buffer registration, the kernel-mode rows' floor: a ring of its own with a
/// sparse table as large as a space's (its size matters on huge pages: the kernel looks at
/// every slot), updated with the `io-uring` crate, from slot 0 as the engine's lowest-first
/// slots are.
struct UringFloor {
    ring: io_uring::IoUring,
    nulls: Vec<libc::iovec>,
}

impl UringFloor {
    fn new() -> std::io::Result<Self> {
        let ring = io_uring::IoUring::new(1)?;
        ring.submitter().register_buffers_sparse(DmaSpaceConfig::default().kernel_buffers)?;
        Ok(UringFloor { ring, nulls: vec![iovec(0, 0); MAPPING_PAGES as usize] })
    }

    /// Registers `bufs` into slots from `slot`: the kernel pins their pages.
    fn update(&self, slot: u32, bufs: &[libc::iovec]) {
        // SAFETY: the buffers lie in memory the benchmark's space keeps mapped (the engine's
        // own mapping, taken from a probe pin) until after the floor clears them.
        unsafe { self.ring.submitter().register_buffers_update(slot, bufs, None) }.expect("io_uring floor");
    }

    /// Clears `n` slots from `slot`: the kernel lets go of their pages.
    fn clear(&self, slot: u32, n: usize) {
        // SAFETY: null buffers clear slots; nothing is pinned.
        unsafe { self.ring.submitter().register_buffers_update(slot, &self.nulls[..n], None) }
            .expect("io_uring floor clear");
    }
}

mod thp {
    //! The THP backing: a memfd whose page cache holds 2 MiB folios.

    use std::fs::File;
    use std::num::NonZeroUsize;
    use std::os::fd::AsFd;

    use nix::sys::mman::{mmap, mmap_anonymous, munmap, MapFlags, ProtFlags};

    const HUGE: usize = 2 << 20;
    /// `MADV_COLLAPSE` (Linux 6.1; neither libc nor nix names it yet).
    const MADV_COLLAPSE: libc::c_int = 25;

    /// Faults `len` bytes of `file` in and collapses them into 2 MiB folios (`MADV_COLLAPSE`,
    /// which needs a mapping aligned to 2 MiB and works whatever shmem's THP setting), through a
    /// view of the benchmark's own that goes again; the folios stay in the file.
    pub(super) fn fill_with_huge_folios(file: &File, len: u64) -> std::io::Result<()> {
        let len = usize::try_from(len).map_err(std::io::Error::other)?;
        let size = NonZeroUsize::new(len + HUGE).ok_or_else(|| std::io::Error::other("empty"))?;
        // SAFETY: a fresh reservation of address space, nothing else uses it.
        let reserved = unsafe { mmap_anonymous(None, size, ProtFlags::PROT_NONE, MapFlags::MAP_PRIVATE) }?;
        let aligned = (reserved.as_ptr() as usize).next_multiple_of(HUGE);
        let result = (|| {
            let at = NonZeroUsize::new(aligned).expect("a mapped address");
            let length = NonZeroUsize::new(len).expect("a benchmark mapping has pages");
            // SAFETY: MAP_FIXED over the reservation made just above, which we own.
            let view = unsafe {
                mmap(
                    Some(at),
                    length,
                    ProtFlags::PROT_READ | ProtFlags::PROT_WRITE,
                    MapFlags::MAP_SHARED | MapFlags::MAP_FIXED,
                    file.as_fd(),
                    0,
                )
            }?;
            // SAFETY: the view is ours, `len` bytes of a memfd that long.
            unsafe { std::ptr::write_bytes(view.as_ptr().cast::<u8>(), 1, len) };
            // SAFETY: advice on our own view.
            if unsafe { libc::madvise(view.as_ptr(), len, MADV_COLLAPSE) } != 0 {
                let e = std::io::Error::last_os_error();
                return Err(std::io::Error::other(format!("MADV_COLLAPSE into 2 MiB folios: {e}")));
            }
            Ok(())
        })();
        // SAFETY: the reservation (and the view inside it) is ours and used no more.
        unsafe { munmap(reserved, size.get()) }?;
        result
    }
}

/// A page array starting at a cache-line boundary. The run scan reads an array in blocks, so
/// where the array starts within its line moves its cost (a 512-entry scan 16.1 ns from a
/// line's start, 18.2 ns from 48 bytes in, on an AMD EPYC); the heap would pick that start
/// differently in each build and each row, and builds compared would not do the same work.
struct LineAligned {
    buf: Vec<u64>,
    at: usize,
    len: usize,
}

impl LineAligned {
    fn new(entries: impl ExactSizeIterator<Item = u64>) -> Self {
        const LINE_ENTRIES: usize = 64 / std::mem::size_of::<u64>();
        let len = entries.len();
        let mut buf = Vec::with_capacity(len + LINE_ENTRIES);
        let at = (LINE_ENTRIES - (buf.as_ptr() as usize / std::mem::size_of::<u64>()) % LINE_ENTRIES)
            % LINE_ENTRIES;
        buf.resize(at, 0);
        buf.extend(entries);
        LineAligned { buf, at, len }
    }

    fn get(&self) -> &[u64] {
        &self.buf[self.at..self.at + self.len]
    }
}

/// Reads every entry (their XOR) with the widest vectors the CPU has, as the engine's run
/// scan does: the `read` floor.
fn read_entries(pfns: &[u64]) -> u64 {
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx512f") {
            // SAFETY: the CPU has AVX-512F, checked just now.
            return unsafe { xor_avx512(pfns) };
        }
        if std::arch::is_x86_feature_detected!("avx2") {
            // SAFETY: the CPU has AVX2, checked just now.
            return unsafe { xor_avx2(pfns) };
        }
    }
    xor_entries(pfns)
}

#[inline(always)]
fn xor_entries(pfns: &[u64]) -> u64 {
    pfns.iter().fold(0, |acc, &p| acc ^ p)
}

/// [`xor_entries`] compiled for AVX-512.
///
/// # Safety
/// The CPU has AVX-512F.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn xor_avx512(pfns: &[u64]) -> u64 {
    xor_entries(pfns)
}

/// [`xor_entries`] compiled for AVX2.
///
/// # Safety
/// The CPU has AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn xor_avx2(pfns: &[u64]) -> u64 {
    xor_entries(pfns)
}

/// Bare mlock (`lock`) or munlock of memory mapped by the space, for the floor rows.
fn mlock(addr: usize, len: usize, lock: bool) {
    let ptr = std::ptr::NonNull::new(addr as *mut libc::c_void).expect("mapped address");
    // SAFETY: [addr, addr + len) is inside a mapping the benchmark's space keeps alive; mlock
    // and munlock change only residency.
    let result = unsafe {
        if lock {
            nix::sys::mman::mlock(ptr, len)
        } else {
            nix::sys::mman::munlock(ptr, len)
        }
    };
    result.expect("mlock floor");
}

/// Prints the human table.
pub fn print_table(rows: &[Row]) -> crate::output::Out {
    out!(
        "{:<12} {:<11} {:>6} {:<12} {:>5} {:>12} {:>10} {:>14} {:>7} {:>13} {:>9} {:>8} {:>8}",
        "backing",
        "pattern",
        "pages",
        "mode",
        "runs",
        "runs ns/call",
        "ns/page",
        "per-page ns",
        "ratio",
        "translate ns",
        "runs/tr",
        "read ns",
        "vs floor"
    )?;
    for r in rows {
        let floor = r.vs_floor.map_or(String::new(), |f| format!("{f:.2}"));
        out!(
            "{:<12} {:<11} {:>6} {:<12} {:>5} {:>12.0} {:>10.1} {:>14.0} {:>7.2} {:>13.0} {:>9.2} {:>8.0} {:>8}",
            r.backing,
            r.pattern,
            r.npages,
            r.mode,
            r.runs,
            r.runs_ns,
            r.runs_ns / r.npages as f64,
            r.per_page_ns,
            r.ratio,
            r.translate_ns,
            r.runs_ns / r.translate_ns,
            r.read_ns,
            floor
        )?;
    }
    // Kernel mode: what a call per run gains over a call per page, per backing (512
    // contiguous pages), against what bare registration gains; and the worst row against
    // its floor.
    let kernel: Vec<&Row> = rows.iter().filter(|r| r.mode == "kernel").collect();
    if !kernel.is_empty() {
        out!("")?;
        out!("kernel mode, 512 contiguous pages, a call per run against a call per page:")?;
        for backing in ["4k-memfd", "2m-hugetlb", "2m-thp-memfd"] {
            let find = |mode: &str| {
                rows.iter().find(|r| {
                    r.backing == backing && r.mode == mode && r.pattern == "contiguous" && r.npages == 512
                })
            };
            if let (Some(k), Some(f)) = (find("kernel"), find("uring-floor")) {
                out!(
                    "  {backing:<13} {:>10.0} ns against {:>10.0} ns: {:>6.1}x (bare io_uring: {:.1}x)",
                    k.runs_ns,
                    k.per_page_ns,
                    k.ratio,
                    f.ratio
                )?;
            }
        }
        if let Some(worst) =
            kernel.iter().max_by(|a, b| a.vs_floor.unwrap_or(0.0).total_cmp(&b.vs_floor.unwrap_or(0.0)))
        {
            out!(
                "  worst row against bare io_uring: {} {} {} pages, {:.2}x",
                worst.backing,
                worst.pattern,
                worst.npages,
                worst.vs_floor.unwrap_or(0.0)
            )?;
        }
    }
    Ok(())
}

/// Heap bytes in use, per glibc.
fn heap_in_use() -> u64 {
    // SAFETY: mallinfo2 only reads allocator statistics.
    let info = unsafe { libc::mallinfo2() };
    (info.uordblks + info.hblkhd) as u64
}

/// Bookkeeping and map-cost figures, measured rather than computed.
#[derive(Debug, Serialize)]
pub struct MemoryReport {
    /// Heap bytes added by pinning every page of a 1 GiB mapping.
    pub heap_per_gib_pinned: u64,
    /// The same, as a percentage of the pinned memory.
    pub percent_of_pinned: f64,
    /// Heap bytes one more mapping costs, averaged over 1000 mappings of 1 GiB each.
    pub heap_per_mapping: u64,
    /// Median ns to map and unmap a sparse 1 GiB memfd.
    pub map_unmap_1g_ns: f64,
    /// Median ns to map and unmap a sparse 64 GiB memfd.
    pub map_unmap_64g_ns: f64,
}

pub fn memory_report() -> Result<MemoryReport, String> {
    let err = |e: &dyn std::fmt::Display| e.to_string();
    let gib = 1u64 << 30;
    let sparse = |size: u64| -> Result<File, String> {
        let f = File::from(memfd_create(c"umdev-pinbench-sparse", MFdFlags::empty()).map_err(|e| err(&e))?);
        f.set_len(size).map_err(|e| err(&e))?;
        Ok(f)
    };
    let space = DmaSpace::default();
    let one = sparse(gib)?;
    space.map(0, gib, one.as_fd(), 0, Prot::READ).map_err(|e| err(&e))?;
    let before = heap_in_use();
    let pins = space.pin_range(0, gib / PAGE_SIZE, Prot::READ).map_err(|e| err(&e))?;
    let heap_per_gib_pinned = heap_in_use().saturating_sub(before);
    drop(pins);
    space.unmap_all().map_err(|e| err(&e))?;

    let before = heap_in_use();
    for i in 0..1000u64 {
        space.map(i * gib, gib, one.as_fd(), 0, Prot::READ).map_err(|e| err(&e))?;
    }
    let heap_per_mapping = heap_in_use().saturating_sub(before) / 1000;
    space.unmap_all().map_err(|e| err(&e))?;

    let big = sparse(64 * gib)?;
    let cost = |file: &File, size: u64| -> Result<f64, String> {
        let mut samples = Vec::new();
        for _ in 0..201 {
            let t = Instant::now();
            space.map(0, size, file.as_fd(), 0, Prot::READ_WRITE).map_err(|e| err(&e))?;
            space.unmap(0, size).map_err(|e| err(&e))?;
            samples.push(t.elapsed().as_nanos() as f64);
        }
        Ok(median(&mut samples))
    };
    let (small, large) = (cost(&one, gib)?, cost(&big, 64 * gib)?);
    Ok(MemoryReport {
        heap_per_gib_pinned,
        percent_of_pinned: heap_per_gib_pinned as f64 * 100.0 / gib as f64,
        heap_per_mapping,
        map_unmap_1g_ns: small,
        map_unmap_64g_ns: large,
    })
}

/// One line of the many-threads table: aggregate pin+unpin calls of `threads` threads.
#[derive(Clone, Debug, Serialize)]
pub struct ThreadRow {
    /// `single` (one-page arrays) or `idaw-64` (64-entry IDAW-style lists).
    pub workload: &'static str,
    /// `one-mapping` (every thread pins in the same mapping), `own-mapping` (one each), or
    /// `translate`: the same arrays in one mapping through `translate_pages`, no pins (how
    /// this machine scales plain translation: the floor for the others).
    pub placement: &'static str,
    pub threads: usize,
    /// Aggregate pin+unpin calls per second (median over rounds).
    pub calls_per_sec: f64,
    /// The same, in pages.
    pub pages_per_sec: f64,
    /// `calls_per_sec` over the one-thread figure of the same workload and placement.
    pub speedup: f64,
}

/// `threads` threads pin+unpin their arrays for `duration`; aggregate calls per second.
fn pin_threads(space: &DmaSpace, arrays: &[Vec<u64>], duration: Duration, translate: bool) -> f64 {
    let barrier = std::sync::Barrier::new(arrays.len());
    let calls: Vec<u64> = std::thread::scope(|s| {
        let handles: Vec<_> = arrays
            .iter()
            .map(|pfns| {
                let barrier = &barrier;
                s.spawn(move || {
                    barrier.wait();
                    let start = Instant::now();
                    let mut n = 0u64;
                    while start.elapsed() < duration {
                        for _ in 0..64 {
                            if translate {
                                let mut sum = 0usize;
                                space
                                    .translate_pages(black_box(pfns), Prot::READ, |_, host, n| {
                                        sum += host + n as usize
                                    })
                                    .expect("translate");
                                black_box(sum);
                            } else {
                                drop(black_box(space.pin_pages(black_box(pfns), Prot::READ).expect("pin")));
                            }
                        }
                        n += 64;
                    }
                    (n, start.elapsed())
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| {
                let (n, took) = h.join().expect("pinning thread");
                // Calls per second of this thread, scaled back to `duration` for summing.
                (n as f64 * duration.as_secs_f64() / took.as_secs_f64()) as u64
            })
            .collect()
    });
    calls.iter().sum::<u64>() as f64 / duration.as_secs_f64()
}

/// The many-threads mode: T threads (each of `threads`) pinning single pages and 64-entry
/// IDAW lists, all in one mapping or each in its own, track mode. Rounds alternate every
/// configuration; figures are medians.
pub fn run_threads(threads: &[usize], rounds: usize, duration: Duration) -> Result<Vec<ThreadRow>, String> {
    let max_t = threads.iter().copied().max().unwrap_or(1).max(1);
    let file = BackingKind::Small.memfd().map_err(|e| e.to_string())?;
    let space =
        DmaSpace::new(DmaSpaceConfig { account: Arc::new(LockAccount::unlimited()), ..Default::default() });
    // Mapping k at IOVA_BASE + k * 16 MiB, all on the same (sparse) memfd: track-mode pins
    // never touch the memory.
    let span = MAPPING_PAGES * PAGE_SIZE;
    for k in 0..max_t as u64 {
        space
            .map(IOVA_BASE + k * span, span, file.as_fd(), 0, Prot::READ_WRITE)
            .map_err(|e| e.to_string())?;
    }
    // Each thread works in its own 256-page window (of the shared mapping, or of its own).
    let window = MAPPING_PAGES / max_t as u64;
    let arrays = |workload: &str, own: bool, t: usize| -> Vec<Vec<u64>> {
        (0..t as u64)
            .map(|k| {
                let base =
                    if own { (IOVA_BASE + k * span) / PAGE_SIZE } else { IOVA_BASE / PAGE_SIZE + k * window };
                // The same shape for every thread (only the window differs): T threads do
                // T times the work of one, whether a list fits a small record or not.
                let mut rng = Rng::new(0x7ead);
                match workload {
                    "single" => vec![base + rng.below(window)],
                    _ => Pattern::IdawMixed
                        .offsets(64, &mut rng)
                        .into_iter()
                        .map(|o| base + o % window)
                        .collect(),
                }
            })
            .collect()
    };
    let configs: Vec<(&'static str, &'static str, usize)> = ["single", "idaw-64"]
        .into_iter()
        .flat_map(|w| ["one-mapping", "own-mapping", "translate"].into_iter().map(move |p| (w, p)))
        .flat_map(|(w, p)| threads.iter().map(move |&t| (w, p, t.max(1))))
        .collect();
    let mut samples = vec![Vec::with_capacity(rounds); configs.len()];
    for _ in 0..rounds.max(1) {
        for (k, &(w, p, t)) in configs.iter().enumerate() {
            let translate = p == "translate";
            samples[k].push(pin_threads(&space, &arrays(w, p == "own-mapping", t), duration, translate));
        }
    }
    let medians: Vec<f64> = samples.iter_mut().map(|s| median(s)).collect();
    let rows = configs
        .iter()
        .zip(&medians)
        .map(|(&(w, p, t), &calls)| {
            let one = configs
                .iter()
                .position(|&(w1, p1, t1)| w1 == w && p1 == p && t1 == 1)
                .map(|i| medians[i])
                .unwrap_or(f64::NAN);
            let pages = if w == "single" { 1.0 } else { 64.0 };
            ThreadRow {
                workload: w,
                placement: p,
                threads: t,
                calls_per_sec: calls,
                pages_per_sec: calls * pages,
                speedup: calls / one,
            }
        })
        .collect();
    Ok(rows)
}

/// Prints the many-threads table.
pub fn print_threads(rows: &[ThreadRow]) -> crate::output::Out {
    out!(
        "{:<9} {:<12} {:>7} {:>14} {:>14} {:>8}",
        "workload",
        "placement",
        "threads",
        "calls/s",
        "pages/s",
        "vs T=1"
    )?;
    for r in rows {
        out!(
            "{:<9} {:<12} {:>7} {:>14.0} {:>14.0} {:>8.2}",
            r.workload,
            r.placement,
            r.threads,
            r.calls_per_sec,
            r.pages_per_sec,
            r.speedup
        )?;
    }
    Ok(())
}

/// The picture's caption: this machine (host, kernel, CPU, cores), today's date, the rounds.
fn caption(rounds: usize) -> plot::Caption {
    let read = |path: &str| std::fs::read_to_string(path).unwrap_or_default().trim().to_string();
    let cpu = read("/proc/cpuinfo")
        .lines()
        .find_map(|l| {
            l.strip_prefix("model name").and_then(|v| v.split_once(':')).map(|(_, v)| v.trim().to_string())
        })
        .unwrap_or_else(|| "unknown CPU".into());
    let cores = std::thread::available_parallelism().map_or(0, |n| n.get());
    let host = format!(
        "{}: Linux {}, {cpu}, {cores} cores",
        read("/proc/sys/kernel/hostname"),
        read("/proc/sys/kernel/osrelease")
    );
    plot::Caption { host, date: today(), rounds }
}

/// Today's date (UTC), as YYYY-MM-DD.
fn today() -> String {
    let secs = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs());
    // Days since 1970-01-01 to a civil date (the proleptic Gregorian calendar).
    let z = (secs / 86_400) as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!("{year:04}-{month:02}-{day:02}")
}

/// What `umdev pinbench` was asked for.
#[derive(Clone, Debug, Default)]
pub struct Options {
    /// One JSON object per line instead of tables.
    pub json: bool,
    /// Rounds per row.
    pub rounds: usize,
    /// Target microseconds per timed batch.
    pub batch_us: u64,
    /// Run the many-threads mode with these thread counts instead of the grid.
    pub threads: Option<Vec<usize>>,
    /// Also draw the grid's figures into this SVG file.
    pub svg: Option<std::path::PathBuf>,
    /// Only this mode's rows.
    pub only: Option<PinMode>,
}

/// `umdev pinbench`.
pub fn command(o: &Options) -> Result<(), String> {
    if let Some(threads) = &o.threads {
        let rows = run_threads(threads, o.rounds.clamp(1, 15), Duration::from_millis(100))?;
        if o.json {
            for row in &rows {
                out!("{}", serde_json::to_string(row).expect("rows serialize"))?;
            }
        } else {
            print_threads(&rows)?;
        }
        return Ok(());
    }
    // The picture's file is checked first: a path it cannot have fails before minutes of
    // measuring, not after.
    let picture = o.svg.as_deref().map(Picture::create).transpose()?;
    let effort = Effort { rounds: o.rounds, batch: Duration::from_micros(o.batch_us) };
    let rows = run(effort, o.only, |row| {
        if o.json {
            out!("{}", serde_json::to_string(row).expect("rows serialize"))?;
        }
        Ok(())
    })?;
    let memory = memory_report()?;
    if o.json {
        out!("{}", serde_json::to_string(&memory).expect("report serializes"))?;
    } else {
        print_table(&rows)?;
        out!("")?;
        out!(
            "bookkeeping: {} bytes of heap for 1 GiB pinned ({:.4}% of pinned memory); {} bytes per mapping",
            memory.heap_per_gib_pinned,
            memory.percent_of_pinned,
            memory.heap_per_mapping
        )?;
        out!(
            "map+unmap (engine, no socket): 1 GiB sparse memfd {:.1} us, 64 GiB sparse memfd {:.1} us (medians)",
            memory.map_unmap_1g_ns / 1000.0,
            memory.map_unmap_64g_ns / 1000.0
        )?;
    }
    // Drawn after the table is printed: a picture that fails loses no figure.
    if let Some(picture) = picture {
        picture
            .write(&rows, o.rounds)
            .map_err(|e| format!("{e} (the figures above are complete; only the picture is missing)"))?;
    }
    Ok(())
}

/// `--svg`'s file, checked before the benchmark runs and written once it has: a picture
/// that was there stays whole until a new one replaces it.
struct Picture(crate::output::PendingFile);

impl Picture {
    fn create(path: &std::path::Path) -> Result<Picture, String> {
        crate::output::PendingFile::open(path).map(Picture)
    }

    fn write(self, rows: &[Row], rounds: usize) -> Result<(), String> {
        let svg = plot::draw(rows, &caption(rounds), self.0.path())?;
        self.0.finish(svg.as_bytes())
    }
}

#[cfg(test)]
mod tests {
    use super::LineAligned;

    #[test]
    fn a_line_aligned_array_starts_a_line_and_keeps_its_entries() {
        for len in [1usize, 7, 8, 9, 512] {
            let a = LineAligned::new((0..len).map(|k| 1000 + k as u64));
            assert_eq!(a.get().as_ptr() as usize % 64, 0, "len {len}");
            assert_eq!(a.get(), (0..len as u64).map(|k| 1000 + k).collect::<Vec<_>>().as_slice());
        }
    }
}
