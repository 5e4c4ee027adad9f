//! Taking a sparse RAM disk's memory ahead of its writes: a thread that faults in each 2 MiB
//! of a disk once, right after the disk is made, so that the kernel zeroes its pages then
//! rather than at the guest's first write to them.
//!
//! Zeroing a fresh page is a second pass over its memory: a first write to a sparse disk on
//! transparent huge pages moves its data at 38-45% of a memcpy, a disk whose pages are
//! already there at a memcpy's speed or more (its writes stream; docs/benchmarks.md). The
//! pass is work the guest's first writes would otherwise do, done earlier, at the daemon's
//! own priority (0.2 s of a CPU per GiB here): a lower one would let a busy host leave it
//! waiting in the middle of a step, with the process's memory map held for reading, and
//! whatever needs it for writing (a mapping the client adds, `--pin-mode lock`'s `mlock`)
//! waiting behind it.
//!
//! What it is not: a reservation. The memory is taken 64 MiB at a time, each time only
//! while what every pass of the process has left to take is at most half of the memory
//! available beyond a reserve of 256 MiB ([`available`]): a disk larger than that stays
//! sparse, and one that stops being affordable on the way stays sparse from there. It makes
//! one pass from the disk's start to its end; what is given back behind it (a Deallocate, a
//! Write Zeroes) is not taken again.

use std::io;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Instant;

use umdev_mdev::sync::AtomicUpdate;

/// Bytes faulted in per call: one huge page, so that a stop is seen within one.
const STEP: usize = 2 << 20;

/// Bytes between two looks at the host's memory.
const CHUNK: usize = 64 << 20;

/// Memory left to the host whatever the disks' sizes.
const RESERVE: u64 = 256 << 20;

/// What a pass may take: while what the passes sharing `pending` have left to take is at
/// most half of what `available` says beyond [`RESERVE`].
#[derive(Clone, Debug)]
pub struct Budget {
    /// Bytes every pass of this budget has still to take: each pass counts the others', so
    /// that two disks that each fit do not together take what is there.
    pending: Arc<AtomicU64>,
    available: fn() -> Option<u64>,
}

impl Budget {
    /// The process's: every pass of the process, against [`available`].
    pub fn process() -> Budget {
        static PENDING: std::sync::OnceLock<Arc<AtomicU64>> = std::sync::OnceLock::new();
        Budget { pending: PENDING.get_or_init(Default::default).clone(), available }
    }

    /// Its own, against `available` (tests).
    #[cfg(test)]
    fn with(available: fn() -> Option<u64>) -> Budget {
        Budget { pending: Arc::default(), available }
    }

    fn affordable(&self) -> bool {
        affordable(self.pending.load(Ordering::Relaxed), (self.available)())
    }
}

/// Memory the process may still take: the host's `MemAvailable`, or less where the
/// process's cgroup (v2) or one above it has a limit ([`cgroup_room`]). `None` where neither
/// can be read.
pub fn available() -> Option<u64> {
    least(meminfo_available(), cgroup_room())
}

fn least(a: Option<u64>, b: Option<u64>) -> Option<u64> {
    match (a, b) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    }
}

fn meminfo_available() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find_map(|l| l.strip_prefix("MemAvailable:"))?;
    let kib = line.trim().strip_suffix("kB")?.trim().parse::<u64>().ok()?;
    Some(kib.saturating_mul(1024))
}

/// The least room under the limits of the process's cgroup v2 and its ancestors
/// ([`group_room`]). `None` where no cgroup has a limit, or under cgroup v1, which this does
/// not read.
fn cgroup_room() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/self/cgroup").ok()?;
    let path = text.lines().find_map(|l| l.strip_prefix("0::"))?;
    let root = std::path::Path::new("/sys/fs/cgroup");
    let mut dir = root.join(path.trim_start_matches('/'));
    let mut room: Option<u64> = None;
    loop {
        room = least(room, group_room(&dir));
        if dir == root || !dir.pop() {
            return room;
        }
    }
}

/// A cgroup's room: the lower of its `memory.max` and `memory.high`, less what it holds
/// other than page cache (`memory.current` less `memory.stat`'s `file` that is not `shmem`,
/// which the kernel reclaims first). `None` without a limit.
fn group_room(dir: &std::path::Path) -> Option<u64> {
    let read = |name: &str| std::fs::read_to_string(dir.join(name)).ok();
    let number = |name: &str| read(name)?.trim().parse::<u64>().ok(); // "max": none
    let limit = least(number("memory.max"), number("memory.high"))?;
    let current = number("memory.current")?;
    // Page cache the kernel can drop: `file` counts shared memory too (tmpfs, memfds: a `4k`
    // RAM disk's), which only swap could take.
    let stat = read("memory.stat").unwrap_or_default();
    let field = |name: &str| {
        stat.lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.trim().parse::<u64>().ok())
            .unwrap_or(0)
    };
    let cache = field("file").saturating_sub(field("shmem"));
    Some(limit.saturating_sub(current.saturating_sub(cache)))
}

/// Whether `pending` bytes (every pass's) may still be taken with `available` bytes
/// available.
fn affordable(pending: u64, available: Option<u64>) -> bool {
    available.is_some_and(|a| pending <= a.saturating_sub(RESERVE) / 2)
}

/// Where a pass is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PassState {
    /// Taking pages.
    Taking,
    /// All of the disk is in memory.
    Done,
    /// Stopped before the end: the rest was more than the host could afford.
    Unaffordable,
    /// Stopped before the end: the kernel refused (a kernel before Linux 5.14 has no
    /// `MADV_POPULATE_WRITE`), or the disk was dropped.
    Stopped,
}

impl PassState {
    /// Its name in the statistics.
    pub fn name(self) -> &'static str {
        match self {
            PassState::Taking => "taking",
            PassState::Done => "done",
            PassState::Unaffordable => "unaffordable",
            PassState::Stopped => "stopped",
        }
    }

    fn from_u8(v: u8) -> PassState {
        match v {
            0 => PassState::Taking,
            1 => PassState::Done,
            2 => PassState::Unaffordable,
            _ => PassState::Stopped,
        }
    }
}

/// What a pass shares with its owner.
#[derive(Debug, Default)]
struct Progress {
    stop: AtomicBool,
    /// Bytes faulted in so far.
    done: AtomicU64,
    /// A [`PassState`], stored with Release once the pass ends: what `done` and the pass's
    /// callbacks did before is seen by whoever loads it with Acquire and finds it ended.
    state: AtomicU8,
}

/// A running pass over a disk's memory; dropping it stops the pass and waits for its thread
/// (at most one 2 MiB step).
#[derive(Debug)]
pub struct Populater {
    progress: Arc<Progress>,
    thread: Option<JoinHandle<()>>,
}

impl Populater {
    /// Starts a pass over `[addr, addr + len)` within `budget` ([`Budget::process`] but in
    /// tests), calling `taken(i)` after the `i`th 2 MiB of it is in memory.
    ///
    /// # Safety
    ///
    /// `[addr, addr + len)` must be a private anonymous or shared memfd mapping, of the
    /// caller's, that stays mapped until the returned `Populater` is dropped (its drop waits
    /// for the thread).
    pub unsafe fn start(
        addr: usize,
        len: usize,
        taken: impl Fn(usize) + Send + 'static,
        budget: Budget,
    ) -> io::Result<Populater> {
        let progress = Arc::new(Progress::default());
        // Admitted here, all of it at once, or not at all: a disk too large must not count
        // against the others while its own thread has yet to find it so.
        let available = (budget.available)();
        let admitted = budget.pending.update_with(Ordering::Relaxed, Ordering::Relaxed, |pending| {
            let with = pending.saturating_add(len as u64);
            affordable(with, available).then_some(with)
        });
        if admitted.is_err() {
            log::debug!("RAM disk: {} MiB left sparse: more than the host can afford", len >> 20);
            progress.state.store(PassState::Unaffordable as u8, Ordering::Release);
            return Ok(Populater { progress, thread: None });
        }
        let (p, pending) = (progress.clone(), budget.pending.clone());
        let thread = std::thread::Builder::new()
            .name("umdev-populate".into())
            .spawn(move || {
                // Unwinding (a panic in `taken`): stopped, the rest given back.
                let mut end = Ending { progress: &p, budget: &budget, len, state: PassState::Stopped };
                end.state = run(addr, len, &p, taken, &budget);
            })
            .inspect_err(|_| {
                pending.fetch_sub(len as u64, Ordering::Relaxed);
            })?;
        Ok(Populater { progress, thread: Some(thread) })
    }

    /// Bytes faulted in so far.
    pub fn done(&self) -> u64 {
        self.progress.done.load(Ordering::Relaxed)
    }

    /// Where the pass is.
    pub fn state(&self) -> PassState {
        PassState::from_u8(self.progress.state.load(Ordering::Acquire))
    }

    /// Stops the pass and waits for its thread; its state says where it stopped.
    pub fn stop(&mut self) {
        self.progress.stop.store(true, Ordering::Relaxed);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

impl Drop for Populater {
    fn drop(&mut self) {
        self.stop();
    }
}

/// How a pass's thread ends, however it does: the bytes it did not take given back to its
/// budget, then its state published.
struct Ending<'a> {
    progress: &'a Progress,
    budget: &'a Budget,
    len: usize,
    state: PassState,
}

impl Drop for Ending<'_> {
    fn drop(&mut self) {
        let left = (self.len as u64).saturating_sub(self.progress.done.load(Ordering::Relaxed));
        self.budget.pending.fetch_sub(left, Ordering::Relaxed);
        self.progress.state.store(self.state as u8, Ordering::Release);
    }
}

/// The pass, admitted: returns where it ended (each step's bytes taken off its budget as it
/// goes, the rest by [`Ending`]).
fn run(addr: usize, len: usize, progress: &Progress, taken: impl Fn(usize), budget: &Budget) -> PassState {
    let started = Instant::now();
    let mut at = 0usize;
    let state = loop {
        if at >= len {
            break PassState::Done;
        }
        if at > 0 && at.is_multiple_of(CHUNK) && !budget.affordable() {
            break PassState::Unaffordable;
        }
        if progress.stop.load(Ordering::Relaxed) {
            break PassState::Stopped;
        }
        let n = STEP.min(len - at);
        // SAFETY: `[addr + at, addr + at + n)` is inside the range `start`'s caller keeps
        // mapped until the `Populater` is dropped, which waits for this thread. A populating
        // fault allocates a zeroed page where there is none and gives a private page still
        // shared (the zero page) a copy of its own: no byte of the range changes, so a copy
        // racing with it on another thread sees the same bytes either way.
        let rc = unsafe { libc::madvise((addr + at) as *mut libc::c_void, n, libc::MADV_POPULATE_WRITE) };
        if rc != 0 {
            let e = io::Error::last_os_error();
            log::info!("RAM disk: left sparse from {} MiB on: taking its pages failed: {e}", at >> 20);
            break PassState::Stopped;
        }
        taken(at / STEP);
        at += n;
        budget.pending.fetch_sub(n as u64, Ordering::Relaxed);
        progress.done.store(at as u64, Ordering::Relaxed);
    };
    log::debug!(
        "RAM disk: {} MiB of {} taken ahead of its writes in {:.0?} ({})",
        at >> 20,
        len >> 20,
        started.elapsed(),
        state.name()
    );
    state
}

/// Whether this kernel has `MADV_POPULATE_WRITE` (Linux 5.14).
#[cfg(test)]
pub(crate) fn populating_faults() -> bool {
    let mem = vm_memory::mmap::MmapRegion::<()>::new(4096).expect("an anonymous page");
    // SAFETY: the page `mem` maps.
    unsafe { libc::madvise(mem.as_ptr().cast(), 4096, libc::MADV_POPULATE_WRITE) == 0 }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;

    #[test]
    fn a_disk_is_taken_only_while_the_rest_is_at_most_half_what_is_available_beyond_the_reserve() {
        assert!(affordable(1 << 30, Some((2 << 30) + RESERVE)));
        assert!(!affordable(1 << 30, Some((2 << 30) + RESERVE - 1)));
        assert!(!affordable(1, Some(RESERVE)));
        assert!(!affordable(0, None), "nothing taken where memory cannot be read");
    }

    #[test]
    fn what_is_available_is_the_least_of_what_can_be_read() {
        assert_eq!(least(Some(5), Some(3)), Some(3));
        assert_eq!(least(Some(5), None), Some(5));
        assert_eq!(least(None, Some(3)), Some(3));
        assert_eq!(least(None, None), None);
        assert!(available().is_some(), "/proc/meminfo");
    }

    #[test]
    fn a_cgroup_has_room_under_its_lower_limit_its_page_cache_counted_free() {
        let dir = tempfile::tempdir().unwrap();
        let put = |name: &str, text: &str| std::fs::write(dir.path().join(name), text).unwrap();
        put("memory.current", "1000\n");
        // 300 of file, 100 of it shared memory: 200 the kernel can drop.
        put("memory.stat", "anon 500\nfile 300\nkernel 100\nshmem 100\nfile_mapped 50\n");
        put("memory.max", "max\n");
        assert_eq!(group_room(dir.path()), None, "no limit");
        put("memory.high", "5000\n");
        assert_eq!(group_room(dir.path()), Some(5000 - 800));
        put("memory.max", "2000\n");
        assert_eq!(group_room(dir.path()), Some(2000 - 800));
        put("memory.current", "9000\n");
        assert_eq!(group_room(dir.path()), Some(0), "over its limit: none");
    }

    /// A private anonymous mapping of `len` bytes (not reserved), unmapped on drop.
    fn anon(len: usize) -> vm_memory::mmap::MmapRegion {
        vm_memory::mmap::MmapRegion::new(len).expect("an anonymous mapping")
    }

    fn wait(p: &Populater) -> PassState {
        // Counts events, not time.
        loop {
            match p.state() {
                PassState::Taking => std::thread::sleep(std::time::Duration::from_millis(1)),
                ended => return ended,
            }
        }
    }

    #[test]
    fn a_pass_takes_each_step_and_says_so_or_takes_nothing_it_cannot_afford() {
        if !populating_faults() {
            return eprintln!("SKIPPED: no MADV_POPULATE_WRITE here");
        }
        let len = 3 * STEP + 4096;
        let mem = anon(len);
        let taken = Arc::new(std::sync::Mutex::new(Vec::new()));
        let t = taken.clone();
        let budget = Budget::with(|| Some(u64::MAX));
        // SAFETY: `mem` outlives the populater (dropped at the end of the test, after it).
        let p = unsafe {
            Populater::start(mem.as_ptr() as usize, len, move |i| t.lock().unwrap().push(i), budget.clone())
        }
        .unwrap();
        assert_eq!(wait(&p), PassState::Done);
        assert_eq!(p.done(), len as u64);
        assert_eq!(*taken.lock().unwrap(), [0, 1, 2, 3]);
        assert_eq!(budget.pending.load(Ordering::Relaxed), 0, "nothing left to take");
        drop(p);

        let none = Arc::new(std::sync::Mutex::new(Vec::new()));
        let n = none.clone();
        let budget = Budget::with(|| None);
        // SAFETY: as above.
        let p = unsafe {
            Populater::start(mem.as_ptr() as usize, len, move |i| n.lock().unwrap().push(i), budget.clone())
        }
        .unwrap();
        assert_eq!(wait(&p), PassState::Unaffordable, "memory that cannot be read is not taken");
        assert_eq!(p.done(), 0);
        assert!(none.lock().unwrap().is_empty());
        assert_eq!(budget.pending.load(Ordering::Relaxed), 0, "what it did not take given back");
    }

    /// Two disks that each fit the memory available but not together: the second pass,
    /// counting what the first has left, takes nothing. And a stopped pass stops after the
    /// step it is in.
    #[test]
    fn passes_share_their_budget_and_a_stopped_pass_ends_after_its_step() {
        if !populating_faults() {
            return eprintln!("SKIPPED: no MADV_POPULATE_WRITE here");
        }
        let len = 8 * STEP;
        let (a, b) = (anon(len), anon(len));
        // Room for one disk and a half.
        let budget = Budget::with(|| Some(3 * (8 * STEP as u64) + RESERVE));
        // The first pass holds in its first step's callback until the test lets it go on.
        let (reached, hold) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicBool::new(true)));
        let (r, h) = (reached.clone(), hold.clone());
        let held = move |_| {
            r.fetch_add(1, Ordering::SeqCst);
            while h.load(Ordering::SeqCst) {
                std::thread::sleep(std::time::Duration::from_millis(1));
            }
        };
        // SAFETY: `a` and `b` outlive the populaters (dropped before them, below).
        let mut first = unsafe { Populater::start(a.as_ptr() as usize, len, held, budget.clone()) }.unwrap();
        while reached.load(Ordering::SeqCst) == 0 {
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        // SAFETY: as above.
        let second = unsafe { Populater::start(b.as_ptr() as usize, len, |_| {}, budget.clone()) }.unwrap();
        assert_eq!(
            wait(&second),
            PassState::Unaffordable,
            "8 pieces of the first still counted, 8 of the second"
        );
        assert_eq!(second.done(), 0);
        // Stopped in its first step: it ends after it, one step taken.
        first.progress.stop.store(true, Ordering::Relaxed);
        hold.store(false, Ordering::SeqCst);
        first.stop();
        assert_eq!(first.state(), PassState::Stopped);
        assert_eq!(first.done(), STEP as u64);
        assert_eq!(reached.load(Ordering::SeqCst), 1);
        assert_eq!(budget.pending.load(Ordering::Relaxed), 0, "both gave back what they did not take");
        drop((first, second));
    }

    /// What is available is looked at again every 64 MiB: a pass that finds it gone stops
    /// there, the rest given back.
    #[test]
    fn a_pass_stops_where_the_memory_stops_being_affordable() {
        if !populating_faults() {
            return eprintln!("SKIPPED: no MADV_POPULATE_WRITE here");
        }
        static LOOKS: AtomicUsize = AtomicUsize::new(0);
        // Plenty when the pass is admitted, nothing at its first look after that.
        fn shrinking() -> Option<u64> {
            (LOOKS.fetch_add(1, Ordering::SeqCst) == 0).then_some(u64::MAX)
        }
        let len = CHUNK + 2 * STEP;
        let mem = anon(len);
        let budget = Budget::with(shrinking);
        // SAFETY: `mem` outlives the populater (dropped before it, below).
        let p = unsafe { Populater::start(mem.as_ptr() as usize, len, |_| {}, budget.clone()) }.unwrap();
        assert_eq!(wait(&p), PassState::Unaffordable);
        assert_eq!(p.done(), CHUNK as u64, "stopped at its first look");
        assert_eq!(LOOKS.load(Ordering::SeqCst), 2);
        assert_eq!(budget.pending.load(Ordering::Relaxed), 0, "the rest given back");
        drop(p);
    }

    /// A pass whose callback panics ends stopped, what it did not take given back.
    #[test]
    fn a_pass_that_panics_ends_stopped_and_gives_back_the_rest() {
        if !populating_faults() {
            return eprintln!("SKIPPED: no MADV_POPULATE_WRITE here");
        }
        let len = 4 * STEP;
        let mem = anon(len);
        let budget = Budget::with(|| Some(u64::MAX));
        let panicking = |i| assert!(i < 1, "on purpose, at piece {i}");
        // SAFETY: `mem` outlives the populater (dropped before it, below).
        let p = unsafe { Populater::start(mem.as_ptr() as usize, len, panicking, budget.clone()) }.unwrap();
        assert_eq!(wait(&p), PassState::Stopped);
        assert_eq!(p.done(), STEP as u64);
        assert_eq!(budget.pending.load(Ordering::Relaxed), 0);
        drop(p);
    }
}
