//! Taking a sparse RAM disk's memory ahead of its writes: a thread at idle priority that
//! faults in each 2 MiB of a disk once, right after the disk is made, so that the kernel
//! zeroes its pages then rather than at the guest's first write to them.
//!
//! Zeroing a fresh page is a second pass over its memory: a first write to a sparse disk on
//! transparent huge pages moves its data at 40-45% of a memcpy, a disk whose pages are
//! already there at a memcpy's speed or more (its writes stream; docs/benchmarks.md). The
//! thread asks for nothing but idle time (`SCHED_IDLE`): it runs when the host's CPUs have
//! nothing else to do, and a guest that writes first simply takes its pages as before.
//!
//! What it is not: a reservation. The memory is taken 64 MiB at a time, each time only
//! while what is left to take is at most half of the memory available beyond a reserve of
//! 256 MiB, the host's (`MemAvailable`) or the daemon's cgroup's (`memory.max`), whichever
//! is less: a disk larger than that stays sparse, and one that stops being affordable on the
//! way is left sparse from there. It makes one pass; memory given back later (a Deallocate,
//! a Write Zeroes) is not taken again.

use std::io;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Instant;

/// Bytes faulted in per call: one huge page, so that a stop is seen within one.
const STEP: usize = 2 << 20;

/// Bytes between two looks at the host's memory.
const CHUNK: usize = 64 << 20;

/// Memory left to the host whatever the disk's size.
const RESERVE: u64 = 256 << 20;

/// Memory the process may still take: the host's `MemAvailable`, or less where the daemon's
/// cgroup (or one above it) has a `memory.max`. `None` where neither can be read.
pub fn available() -> Option<u64> {
    let host = meminfo_available();
    let group = cgroup_headroom();
    match (host, group) {
        (Some(h), Some(g)) => Some(h.min(g)),
        (h, g) => h.or(g),
    }
}

fn meminfo_available() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find_map(|l| l.strip_prefix("MemAvailable:"))?;
    let kib = line.trim().strip_suffix("kB")?.trim().parse::<u64>().ok()?;
    Some(kib.saturating_mul(1024))
}

/// The least room left under the `memory.max` of the process's cgroup v2 and its ancestors.
fn cgroup_headroom() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/self/cgroup").ok()?;
    let path = text.lines().find_map(|l| l.strip_prefix("0::"))?;
    let mut dir = std::path::PathBuf::from("/sys/fs/cgroup");
    dir.push(path.trim_start_matches('/'));
    let read = |d: &std::path::Path, name: &str| std::fs::read_to_string(d.join(name)).ok();
    let mut least: Option<u64> = None;
    loop {
        if let (Some(max), Some(current)) = (read(&dir, "memory.max"), read(&dir, "memory.current")) {
            if let (Ok(max), Ok(current)) = (max.trim().parse::<u64>(), current.trim().parse::<u64>()) {
                let room = max.saturating_sub(current);
                least = Some(least.map_or(room, |l| l.min(room)));
            }
        }
        if dir == std::path::Path::new("/sys/fs/cgroup") || !dir.pop() {
            return least;
        }
    }
}

/// Whether `remaining` bytes may still be taken with `available` bytes available.
fn affordable(remaining: u64, available: Option<u64>) -> bool {
    available.is_some_and(|a| remaining <= a.saturating_sub(RESERVE) / 2)
}

/// A running pass over a disk's memory; dropping it stops the pass and waits for its thread
/// (at most one 2 MiB step).
#[derive(Debug)]
pub struct Populater {
    stop: Arc<AtomicBool>,
    done: Arc<AtomicU64>,
    thread: Option<JoinHandle<()>>,
}

impl Populater {
    /// Starts a pass over `[addr, addr + len)`, calling `taken(i)` after the `i`th 2 MiB of it
    /// is in memory; `available` says how much memory may still be taken ([`available`] but
    /// in tests).
    ///
    /// # Safety
    ///
    /// `[addr, addr + len)` must be a private anonymous or shared memfd mapping, of the
    /// caller's, that stays mapped until the returned `Populater` is dropped (its drop waits
    /// for the thread). Faulting its pages in changes no byte of it.
    pub unsafe fn start(
        addr: usize,
        len: usize,
        taken: impl Fn(usize) + Send + 'static,
        available: fn() -> Option<u64>,
    ) -> io::Result<Populater> {
        let stop = Arc::new(AtomicBool::new(false));
        let done = Arc::new(AtomicU64::new(0));
        let (s, d) = (stop.clone(), done.clone());
        let thread = std::thread::Builder::new()
            .name("umdev-populate".into())
            .spawn(move || run(addr, len, &s, &d, taken, available))?;
        Ok(Populater { stop, done, thread: Some(thread) })
    }

    /// Bytes faulted in so far.
    pub fn done(&self) -> u64 {
        self.done.load(Ordering::Relaxed)
    }

    /// Whether the pass has ended (the whole range in memory, or stopped).
    pub fn finished(&self) -> bool {
        self.thread.as_ref().is_none_or(|t| t.is_finished())
    }
}

impl Drop for Populater {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

fn run(
    addr: usize,
    len: usize,
    stop: &AtomicBool,
    done: &AtomicU64,
    taken: impl Fn(usize),
    available: fn() -> Option<u64>,
) {
    if let Err(e) = idle_priority() {
        log::debug!("RAM disk left sparse: its pages cannot be taken at idle priority: {e}");
        return;
    }
    let started = Instant::now();
    let mut at = 0usize;
    let why = loop {
        if at >= len {
            break "all of it";
        }
        if at.is_multiple_of(CHUNK) && !affordable((len - at) as u64, available()) {
            break "the rest is more than half the memory available";
        }
        if stop.load(Ordering::Relaxed) {
            break "stopped";
        }
        let n = STEP.min(len - at);
        // SAFETY: `[addr + at, addr + at + n)` is inside the range `start`'s caller keeps
        // mapped until the `Populater` is dropped, which waits for this thread. A populating
        // fault allocates a (zeroed) page where there is none and leaves present pages as
        // they are: a copy racing with it on another thread sees the same bytes either way.
        let rc = unsafe { libc::madvise((addr + at) as *mut libc::c_void, n, libc::MADV_POPULATE_WRITE) };
        if rc != 0 {
            let e = io::Error::last_os_error();
            log::debug!("RAM disk: taking its pages stopped at {} MiB: {e}", at >> 20);
            return;
        }
        taken(at / STEP);
        at += n;
        done.store(at as u64, Ordering::Relaxed);
    };
    log::debug!(
        "RAM disk: {} MiB of {} taken ahead of its writes in {:.0?} ({why})",
        at >> 20,
        len >> 20,
        started.elapsed()
    );
}

/// Moves the calling thread to `SCHED_IDLE`, where it runs only when nothing else would.
fn idle_priority() -> io::Result<()> {
    let param = libc::sched_param { sched_priority: 0 };
    // SAFETY: sched_setscheduler(0, ...) only reads `param`, a live local, and changes the
    // calling thread's policy.
    if unsafe { libc::sched_setscheduler(0, libc::SCHED_IDLE, &param) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_disk_is_taken_only_while_the_rest_is_at_most_half_what_is_available_beyond_the_reserve() {
        assert!(affordable(1 << 30, Some((2 << 30) + RESERVE)));
        assert!(!affordable(1 << 30, Some((2 << 30) + RESERVE - 1)));
        assert!(!affordable(1, Some(RESERVE)));
        assert!(!affordable(0, None), "nothing taken where memory cannot be read");
    }

    /// A private anonymous mapping of `len` bytes, unmapped on drop.
    struct Anon(usize, usize);

    impl Anon {
        fn new(len: usize) -> Anon {
            // SAFETY: a fresh private anonymous mapping, no address asked for.
            let p = unsafe {
                libc::mmap(
                    std::ptr::null_mut(),
                    len,
                    libc::PROT_READ | libc::PROT_WRITE,
                    libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                    -1,
                    0,
                )
            };
            assert_ne!(p, libc::MAP_FAILED);
            Anon(p as usize, len)
        }
    }

    impl Drop for Anon {
        fn drop(&mut self) {
            // SAFETY: the mapping `new` made, no longer used (the populaters are dropped first).
            unsafe { libc::munmap(self.0 as *mut libc::c_void, self.1) };
        }
    }

    fn wait(p: &Populater) {
        // Counts events, not time: an idle-priority thread runs when the CPUs are idle.
        while !p.finished() {
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
    }

    #[test]
    fn a_pass_takes_each_step_and_says_so_or_takes_nothing_it_cannot_afford() {
        let len = 3 * STEP + 4096;
        let mem = Anon::new(len);
        let taken = Arc::new(std::sync::Mutex::new(Vec::new()));
        let t = taken.clone();
        // SAFETY: `mem` outlives the populater (dropped at the end of the test, after it).
        let p =
            unsafe { Populater::start(mem.0, len, move |i| t.lock().unwrap().push(i), || Some(u64::MAX)) }
                .unwrap();
        wait(&p);
        assert_eq!(p.done(), len as u64);
        assert_eq!(*taken.lock().unwrap(), [0, 1, 2, 3]);
        drop(p);

        let none = Arc::new(std::sync::Mutex::new(Vec::new()));
        let n = none.clone();
        // SAFETY: as above.
        let p = unsafe { Populater::start(mem.0, len, move |i| n.lock().unwrap().push(i), || None) }.unwrap();
        wait(&p);
        assert_eq!(p.done(), 0, "memory that cannot be read is not taken");
        assert!(none.lock().unwrap().is_empty());
    }

    #[test]
    fn this_host_says_how_much_memory_is_available() {
        let a = available().expect("/proc/meminfo");
        assert!(a > 0 && a <= meminfo_available().unwrap());
    }
}
