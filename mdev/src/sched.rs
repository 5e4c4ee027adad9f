//! Short scheduler slices for the threads that wait for a client (the framework's workers and
//! the server's connection threads), asked for when they are seen to wait for a CPU.
//!
//! These threads sleep most of the time and run briefly when woken (a doorbell, a finished
//! transfer, a message), and the client waits on them while they run. On a host whose CPUs
//! are busy (a VMM's vCPU threads beside them, 2 CPUs for 2 vCPUs), the kernel's fair
//! scheduler (EEVDF, Linux 6.6 and later) lets a woken thread run at once only if its virtual
//! deadline is earlier than the running thread's; with the default slice (0.7-3 ms, by
//! CPUs) a woken worker often waits for the running vCPU thread's slice to end. Linux 6.12
//! and later take a slice per thread (`sched_setattr`'s `sched_runtime` for SCHED_OTHER):
//! with a short one a woken worker's deadline comes first and it preempts at once. Its share
//! of the CPU is unchanged (that is its weight, its nice value, which stays).
//!
//! A short slice cuts both ways (docs/benchmarks.md): two fio jobs at QD1 in a TCG guest, one
//! per vCPU, went from 0.77-0.83x QEMU's own nvme to 0.94-0.97x with a 100 µs slice, but a
//! client that sleeps on its interrupt between commands beside the server on the same CPUs
//! (`umdev nvmebench`) lost a fifth of its QD1 rate: there the woken worker preempts the
//! thread that has just rung it, which the scheduler cannot tell from any other. What tells
//! them apart is how long a woken thread waits for a CPU: behind a vCPU thread that does not
//! sleep, the rest of its slice (72 µs a wake-up on average here, workers of a TCG guest's
//! two QD1 jobs); behind a client that is about to sleep, the few microseconds until it does
//! (17 µs, nvmebench's workers, on the same machine). So by default ([`Mode::Auto`]) each such
//! thread reads what the kernel counts of its own waits (`/proc/thread-self/schedstat`: the
//! time it was runnable but not running, and the times it was put on a CPU) every
//! [`WINDOW_WAKES`] wake-ups and at least [`WINDOW_MIN`] apart, and when the mean wait per turn
//! on a CPU exceeds [`HIGH_WAIT`] every such thread of the process asks for the short slice.
//! After [`FIRST_HOLD`] they go back to the kernel's slice to see whether the waits are still
//! there; each time they come back within [`RELAPSE`], the slice is held twice as long, up to
//! [`MAX_HOLD`]. Each such thread asks for the process's choice as it starts: the kernel copies
//! a thread's slice to the threads it spawns, so a thread that does not choose (a device's
//! helper spawned by a worker, say) keeps what its parent had then. `UMDEV_SLICE_US`: unset or
//! `auto`, this; `0` or `off`, always the kernel's slice; N, always N microseconds (the kernel
//! takes 100 to 100000). Older kernels accept the call and ignore the slice. Where the call is
//! refused (a seccomp filter) the thread keeps the kernel's slice, said once at debug; where
//! its counts cannot be read, it follows the others' choice without weighing in.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

/// `struct sched_attr` (include/uapi/linux/sched/types.h), its first version's fields
/// (`SCHED_ATTR_SIZE_VER0`, 48 bytes): the kernel reads `size` bytes.
#[repr(C)]
#[derive(Default)]
struct SchedAttr {
    size: u32,
    policy: u32,
    flags: u64,
    nice: i32,
    priority: u32,
    runtime: u64,
    deadline: u64,
    period: u64,
}

/// The slice [`Mode::Auto`] asks for.
const AUTO_SLICE: Duration = Duration::from_micros(100);
/// Wake-ups a thread counts between two readings of its waits...
pub const WINDOW_WAKES: u32 = 64;
/// ...and at least this long between them (a bound on the readings: an open, a read and a
/// close each).
const WINDOW_MIN: Duration = Duration::from_millis(20);
/// The mean wait for a CPU per turn on one above which the short slice is asked for.
pub const HIGH_WAIT: Duration = Duration::from_micros(40);
/// How long the short slice is first kept before the threads try the kernel's again...
pub const FIRST_HOLD: Duration = Duration::from_millis(100);
/// ...twice as long each time the waits come back within [`RELAPSE`] of a try, up to this:
/// a host that keeps its CPUs busy is tried seldom, a passing burst costs little.
pub const MAX_HOLD: Duration = Duration::from_secs(2);
/// See [`MAX_HOLD`].
const RELAPSE: Duration = Duration::from_millis(250);

/// How the threads that wait for a client choose their scheduler slice.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// The kernel's slice, always.
    Kernel,
    /// This slice, always.
    Fixed(Duration),
    /// This slice while such threads are seen waiting for a CPU, else the kernel's.
    Auto(Duration),
}

/// The mode `UMDEV_SLICE_US` asks for.
pub fn mode() -> Mode {
    static MODE: OnceLock<Mode> = OnceLock::new();
    *MODE.get_or_init(|| from_env(std::env::var("UMDEV_SLICE_US").ok().as_deref()))
}

fn from_env(value: Option<&str>) -> Mode {
    let Some(value) = value.map(str::trim) else { return Mode::Auto(AUTO_SLICE) };
    match value {
        "" | "auto" => Mode::Auto(AUTO_SLICE),
        "off" => Mode::Kernel,
        _ => match value.parse::<u64>() {
            Ok(0) => Mode::Kernel,
            Ok(us) => Mode::Fixed(Duration::from_micros(us)),
            Err(_) => {
                log::warn!("UMDEV_SLICE_US={value:?} is not auto, off or a number of microseconds: auto");
                Mode::Auto(AUTO_SLICE)
            }
        },
    }
}

/// The choice in [`Mode::Auto`] that a process's threads share, which each reads after
/// each wake-up and changes only by a compare-and-swap from what it read, so that a thread
/// acting on a stale view changes nothing.
struct Shared {
    /// While the short slice is on: when it was asked for (µs since [`epoch`], at least 1)
    /// above [`HOLD_BITS`], and how long it is held (ms) in them; 0 while it is off.
    held: AtomicU64,
    /// When it was last given up, and the hold it had then (packed as `held`; 0: never).
    given_up: AtomicU64,
}

/// Bits of [`Shared::held`] that hold the hold, in ms ([`MAX_HOLD`] fits).
const HOLD_BITS: u32 = 12;

/// The short slice on since a time, for a hold.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Held {
    since: Instant,
    hold: Duration,
}

impl Held {
    fn pack(&self) -> u64 {
        let hold_ms = u64::try_from(self.hold.as_millis()).unwrap_or(u64::MAX).min((1 << HOLD_BITS) - 1);
        (micros_since_epoch(self.since) << HOLD_BITS) | hold_ms
    }

    fn unpack(word: u64) -> Option<Held> {
        (word != 0).then(|| Held {
            since: epoch() + Duration::from_micros(word >> HOLD_BITS),
            hold: Duration::from_millis(word & ((1 << HOLD_BITS) - 1)),
        })
    }
}

impl Shared {
    const fn new() -> Shared {
        Shared { held: AtomicU64::new(0), given_up: AtomicU64::new(0) }
    }
}

/// The process's.
static SHARED: Shared = Shared::new();

fn epoch() -> Instant {
    static EPOCH: OnceLock<Instant> = OnceLock::new();
    *EPOCH.get_or_init(Instant::now)
}

/// Microseconds from [`epoch`] to `t`, at least 1 (0 means none); 2^51 of them are 71 years.
fn micros_since_epoch(t: Instant) -> u64 {
    let us = u64::try_from(t.saturating_duration_since(epoch()).as_micros()).unwrap_or(u64::MAX);
    us.clamp(1, u64::MAX >> HOLD_BITS)
}

/// What one window's mean wait makes of the process's choice: `Some(new)` to change it.
fn decide(held: Option<Held>, now: Instant, mean_wait: Duration) -> Option<bool> {
    match held {
        None => (mean_wait > HIGH_WAIT).then_some(true),
        // While it is on the waits are short by its doing: only time tells when to try again.
        Some(held) => (now.saturating_duration_since(held.since) >= held.hold).then_some(false),
    }
}

/// How long to hold the short slice asked for now, `since_given_up` after it was last given
/// up, held `last` then.
fn next_hold(last: Duration, since_given_up: Option<Duration>) -> Duration {
    match since_given_up {
        Some(ago) if ago <= RELAPSE => (last * 2).clamp(FIRST_HOLD, MAX_HOLD),
        _ => FIRST_HOLD,
    }
}

/// What the kernel counts of a thread's turns on a CPU (`/proc/PID/task/TID/schedstat`):
/// the time it waited, runnable, for one, and how many it had.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct Waits {
    waited_ns: u64,
    turns: u64,
}

impl Waits {
    /// Parses "CPU_NS WAIT_NS TURNS".
    fn parse(text: &str) -> Option<Waits> {
        let mut fields = text.split_ascii_whitespace().skip(1).map(str::parse::<u64>);
        Some(Waits { waited_ns: fields.next()?.ok()?, turns: fields.next()?.ok()? })
    }

    /// The mean wait per turn since `before`, if there were turns.
    fn mean_since(&self, before: &Waits) -> Option<Duration> {
        let turns = self.turns.checked_sub(before.turns).filter(|&t| t > 0)?;
        let waited = self.waited_ns.saturating_sub(before.waited_ns);
        Some(Duration::from_nanos(waited / turns))
    }
}

/// A thread's part in choosing its slice: made on the thread (it reads that thread's own
/// counts), told of each wake-up with [`SliceChoice::woke`].
pub struct SliceChoice {
    mode: Mode,
    shared: &'static Shared,
    /// The slice this thread last had granted (`None`: the kernel's).
    granted: Option<Duration>,
    /// With [`Mode::Auto`], where the thread's counts can be read: what they said at the
    /// window's start, and when.
    window: Option<(Waits, Instant)>,
    wakes: u32,
}

impl SliceChoice {
    /// The calling thread's, in the process's [`mode`].
    pub fn for_this_thread() -> SliceChoice {
        Self::in_mode(mode(), &SHARED)
    }

    fn in_mode(mode: Mode, shared: &'static Shared) -> SliceChoice {
        let mut choice = SliceChoice { mode, shared, granted: None, window: None, wakes: 0 };
        match mode {
            Mode::Kernel => {}
            Mode::Fixed(slice) => choice.set(Some(slice)),
            Mode::Auto(_) => {
                choice.window = own_waits().map(|waits| (waits, Instant::now()));
                // Asked whatever it was: the thread may have its spawner's slice.
                choice.set(choice.wanted());
            }
        }
        choice
    }

    /// After the thread woke from a sleep: follows the process's choice, and every window
    /// weighs in on it.
    #[inline]
    pub fn woke(&mut self) {
        let Mode::Auto(_) = self.mode else { return };
        self.follow();
        self.wakes += 1;
        if self.wakes >= WINDOW_WAKES {
            self.wakes = 0;
            self.weigh();
        }
    }

    #[inline(never)]
    fn weigh(&mut self) {
        let Some((_, start)) = self.window else { return };
        let now = Instant::now();
        if now.saturating_duration_since(start) < WINDOW_MIN {
            return;
        }
        match own_waits() {
            Some(waits) => self.judge(waits, now),
            None => self.window = None,
        }
    }

    /// Weighs the window that ends `now` with `waits` in on the shared choice, and follows it.
    fn judge(&mut self, waits: Waits, now: Instant) {
        let Some((before, _)) = self.window.replace((waits, now)) else { return };
        let Some(mean) = waits.mean_since(&before) else { return };
        let word = self.shared.held.load(Ordering::Relaxed);
        let held = Held::unpack(word);
        let new = match decide(held, now, mean) {
            None => return,
            Some(true) => {
                let last = Held::unpack(self.shared.given_up.load(Ordering::Relaxed));
                let since_given_up = last.map(|last| now.saturating_duration_since(last.since));
                let hold = next_hold(last.map_or(Duration::ZERO, |last| last.hold), since_given_up);
                Held { since: now, hold }.pack()
            }
            Some(false) => 0,
        };
        // Another thread's change since the load wins: this window's view of it is stale.
        if self.shared.held.compare_exchange(word, new, Ordering::Relaxed, Ordering::Relaxed).is_ok() {
            match (held, Held::unpack(new)) {
                (Some(held), None) => {
                    self.shared.given_up.store(Held { since: now, hold: held.hold }.pack(), Ordering::Relaxed)
                }
                (_, Some(on)) => {
                    log::debug!(
                        "threads waiting {mean:?} for a CPU per turn: short scheduler slices for {:?}",
                        on.hold
                    )
                }
                (None, None) => {}
            }
        }
        self.follow();
    }

    /// The slice the process's choice wants for this thread.
    #[inline]
    fn wanted(&self) -> Option<Duration> {
        let Mode::Auto(slice) = self.mode else { return self.granted };
        (self.shared.held.load(Ordering::Relaxed) != 0).then_some(slice)
    }

    /// Asks for what the process chose, if this thread does not have it.
    #[inline]
    fn follow(&mut self) {
        let wanted = self.wanted();
        if wanted != self.granted {
            self.set(wanted);
        }
    }

    fn set(&mut self, slice: Option<Duration>) {
        match set_own_slice(slice.unwrap_or(Duration::ZERO)) {
            Ok(()) => self.granted = slice,
            Err(e) => {
                static SAID: OnceLock<()> = OnceLock::new();
                SAID.get_or_init(|| {
                    log::debug!("the kernel's default scheduler slice kept: sched_setattr: {e}")
                });
                // Not asked again: each call would fail the same way.
                self.mode = Mode::Kernel;
            }
        }
    }
}

/// What the calling thread's counts say now; `None` where the kernel does not count (or
/// shows zeroes: no scheduler statistics). Opened for each reading: a thread that outlives its
/// device's client holds no descriptor for it.
fn own_waits() -> Option<Waits> {
    let mut buf = [0u8; 96];
    let mut file = std::fs::File::open("/proc/thread-self/schedstat").ok()?;
    let n = std::io::Read::read(&mut file, &mut buf).ok()?;
    Waits::parse(std::str::from_utf8(&buf[..n]).ok()?).filter(|w| w.turns > 0)
}

/// Asks the kernel for `slice` for the calling thread (zero: the kernel's), if its policy is
/// a fair one (SCHED_OTHER or SCHED_BATCH: a slice means nothing to the others, and a thread
/// the administrator made real-time or idle stays so), its policy, nice value and
/// reset-on-fork flag kept.
fn set_own_slice(slice: Duration) -> std::io::Result<()> {
    const SCHED_FLAG_RESET_ON_FORK: u64 = 0x01;
    let size = std::mem::size_of::<SchedAttr>() as u32;
    let mut attr = SchedAttr::default();
    // SAFETY: sched_getattr(0, &mut attr, size, 0) writes at most `size` bytes (the struct's
    // own size) into a live local, about the calling thread.
    let rc = unsafe { libc::syscall(libc::SYS_sched_getattr, 0, &mut attr as *mut SchedAttr, size, 0) };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    if attr.policy != libc::SCHED_OTHER as u32 && attr.policy != libc::SCHED_BATCH as u32 {
        return Ok(());
    }
    attr.size = size;
    attr.flags &= SCHED_FLAG_RESET_ON_FORK;
    attr.runtime = u64::try_from(slice.as_nanos()).unwrap_or(u64::MAX);
    // SAFETY: sched_setattr(0, &mut attr, 0) reads `attr.size` bytes of a live local of that
    // size (and, were the size refused with E2BIG, writes the kernel's size into it, which
    // is why it is passed mutable) and changes only the calling thread's scheduling.
    let rc = unsafe { libc::syscall(libc::SYS_sched_setattr, 0, &mut attr as *mut SchedAttr, 0) };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_environment_picks_the_mode() {
        let auto = Mode::Auto(AUTO_SLICE);
        assert_eq!(from_env(None), auto);
        assert_eq!(from_env(Some("auto")), auto);
        assert_eq!(from_env(Some("0")), Mode::Kernel);
        assert_eq!(from_env(Some("off")), Mode::Kernel);
        assert_eq!(from_env(Some("250")), Mode::Fixed(Duration::from_micros(250)));
        assert_eq!(from_env(Some(" 100 ")), Mode::Fixed(Duration::from_micros(100)));
        assert_eq!(from_env(Some("soon")), auto);
    }

    #[test]
    fn long_waits_ask_for_the_short_slice_and_time_takes_it_back() {
        let t0 = Instant::now();
        let wait = |us| Duration::from_micros(us);
        assert_eq!(decide(None, t0, wait(17)), None, "short waits: the kernel's slice stays");
        assert_eq!(decide(None, t0, HIGH_WAIT), None);
        assert_eq!(decide(None, t0, wait(72)), Some(true));
        // On, it stays on whatever the waits (they are short by its doing) until its hold ends.
        let hold = FIRST_HOLD;
        let held = Some(Held { since: t0, hold });
        assert_eq!(decide(held, t0 + hold / 2, wait(1)), None);
        assert_eq!(decide(held, t0 + hold / 2, wait(500)), None);
        assert_eq!(decide(held, t0 + hold, wait(1)), Some(false));
    }

    #[test]
    fn the_hold_doubles_while_the_waits_come_back_at_each_try() {
        assert_eq!(next_hold(Duration::ZERO, None), FIRST_HOLD, "the first time");
        let mut hold = FIRST_HOLD;
        for want in [2, 4, 8, 16] {
            hold = next_hold(hold, Some(Duration::from_millis(30)));
            assert_eq!(hold, FIRST_HOLD * want);
        }
        assert_eq!(next_hold(MAX_HOLD, Some(Duration::ZERO)), MAX_HOLD, "bounded");
        assert_eq!(next_hold(MAX_HOLD, Some(RELAPSE * 2)), FIRST_HOLD, "a passing burst starts over");
    }

    /// Each window a thread weighs in with turns their mean wait long: a long one makes
    /// every thread of the choice ask for the short slice, kept for its hold whatever the
    /// windows say, given up after it, and held twice as long when the waits come back at
    /// once; a thread that only wakes follows.
    #[test]
    fn the_threads_ask_for_the_short_slice_while_their_waits_are_long() {
        let shared: &'static Shared = Box::leak(Box::new(Shared::new()));
        let short = Duration::from_micros(300);
        let (tell, told) = std::sync::mpsc::channel::<Option<Duration>>();
        let (heard, hear) = std::sync::mpsc::channel::<(Option<Duration>, Option<u64>)>();
        // The other thread wakes when told to and says what it then asked for.
        let follower = std::thread::spawn(move || {
            let mut choice = SliceChoice::in_mode(Mode::Auto(short), shared);
            choice.window = None;
            while told.recv().is_ok() {
                choice.woke();
                heard.send((choice.granted, slice_of_this_thread())).unwrap();
            }
        });
        std::thread::spawn(move || {
            let mut choice = SliceChoice::in_mode(Mode::Auto(short), shared);
            let t0 = Instant::now();
            let mut waits = Waits { waited_ns: 0, turns: 1 };
            choice.window = Some((waits, t0));
            let mut window = |choice: &mut SliceChoice, mean_us: u64, at: Duration| {
                waits.turns += 64;
                waits.waited_ns += 64 * mean_us * 1000;
                choice.judge(waits, t0 + at);
                choice.granted
            };
            let kernels = slice_of_this_thread();
            let ms = Duration::from_millis;
            assert_eq!(window(&mut choice, 17, ms(20)), None, "short waits: the kernel's slice");
            assert_eq!(window(&mut choice, 72, ms(40)), Some(short), "long waits: the short slice");
            if slices_shown(kernels) {
                assert_eq!(slice_of_this_thread(), Some(300_000));
            }
            tell.send(None).unwrap();
            let (asked, theirs) = hear.recv().unwrap();
            assert_eq!(asked, Some(short), "the other thread follows at its wake-up");
            if slices_shown(theirs) {
                assert_eq!(theirs, Some(300_000));
            }
            assert_eq!(window(&mut choice, 1, ms(60)), Some(short), "kept while held");
            let given_up = ms(40) + FIRST_HOLD;
            assert_eq!(window(&mut choice, 1, given_up), None, "given up when the hold ends");
            assert_eq!(slice_of_this_thread(), kernels);
            tell.send(None).unwrap();
            assert_eq!(hear.recv().unwrap().0, None, "the other thread follows");
            let back = given_up + ms(20);
            assert_eq!(window(&mut choice, 72, back), Some(short), "the waits came back");
            assert_eq!(window(&mut choice, 1, back + FIRST_HOLD), Some(short), "held twice as long");
            assert_eq!(window(&mut choice, 1, back + 2 * FIRST_HOLD), None);
        })
        .join()
        .unwrap();
        follower.join().unwrap();
    }

    /// The kernel copies a thread's slice to the threads it spawns: a choosing thread asks
    /// for the process's choice as it starts, whatever its spawner had.
    #[test]
    fn a_new_thread_does_not_keep_its_spawners_slice() {
        std::thread::spawn(|| {
            let kernels = slice_of_this_thread();
            set_own_slice(Duration::from_micros(300)).unwrap();
            let shared: &'static Shared = Box::leak(Box::new(Shared::new()));
            let (inherited, chosen) = std::thread::spawn(move || {
                let inherited = slice_of_this_thread();
                let _choice = SliceChoice::in_mode(Mode::Auto(Duration::from_micros(300)), shared);
                (inherited, slice_of_this_thread())
            })
            .join()
            .unwrap();
            if slices_shown(kernels) {
                assert_eq!(inherited, Some(300_000), "the kernel copies the slice");
                assert_eq!(chosen, kernels, "the choice (off) asked for the kernel's");
            }
        })
        .join()
        .unwrap();
    }

    #[test]
    fn a_hold_packs_with_its_start_to_the_millisecond() {
        let since = epoch() + Duration::from_micros(123_456_789);
        for hold in [FIRST_HOLD, MAX_HOLD, Duration::from_millis(1)] {
            let word = Held { since, hold }.pack();
            assert_ne!(word, 0);
            assert_eq!(Held::unpack(word), Some(Held { since, hold }));
        }
        assert_eq!(Held::unpack(0), None);
        let at_epoch = Held { since: epoch(), hold: FIRST_HOLD }.pack();
        assert_eq!(
            Held::unpack(at_epoch).map(|h| h.since),
            Some(epoch() + Duration::from_micros(1)),
            "never 0"
        );
    }

    #[test]
    fn the_counts_parse_and_give_the_mean_wait_per_turn() {
        let before = Waits::parse("1258150 115822 2\n").unwrap();
        assert_eq!(before, Waits { waited_ns: 115_822, turns: 2 });
        let after = Waits::parse("9999999 1115822 12").unwrap();
        assert_eq!(after.mean_since(&before), Some(Duration::from_micros(100)));
        assert_eq!(before.mean_since(&before), None, "no turns: no mean");
        assert_eq!(Waits::parse("12 34"), None);
        assert_eq!(Waits::parse("a b c"), None);
    }

    #[test]
    fn a_thread_reads_its_own_counts_as_they_grow() {
        std::thread::spawn(|| {
            let Some(first) = own_waits() else {
                return eprintln!("this kernel shows no scheduler counts");
            };
            for _ in 0..3 {
                std::thread::sleep(Duration::from_millis(1));
            }
            let later = own_waits().unwrap();
            assert!(later.turns >= first.turns + 3, "{first:?} -> {later:?}: each sleep ends in a turn");
            assert!(later.waited_ns >= first.waited_ns);
        })
        .join()
        .unwrap();
    }

    /// The slice the kernel holds for thread `tid` of this process, if it says (Linux 6.6
    /// and later show `se.slice` in /proc/self/task/TID/sched when built with scheduler
    /// debugging, as distribution kernels are).
    fn slice_of_this_thread() -> Option<u64> {
        // SAFETY: gettid has no preconditions.
        let tid = unsafe { libc::gettid() };
        let sched = std::fs::read_to_string(format!("/proc/self/task/{tid}/sched")).ok()?;
        let line = sched.lines().find(|l| l.trim_start().starts_with("se.slice"))?;
        line.split(':').nth(1)?.trim().parse().ok()
    }

    /// Whether slices can be checked here: this kernel takes them and showed `seen`; says
    /// so when not.
    fn slices_shown(seen: Option<u64>) -> bool {
        let shown = takes_slices() && seen.is_some();
        if !shown {
            eprintln!("this kernel takes no slices or does not show them ({seen:?})");
        }
        shown
    }

    /// Linux 6.12 or later: `sched_runtime` sets a SCHED_OTHER thread's slice.
    fn takes_slices() -> bool {
        let release = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
        let mut parts = release.trim().split(['.', '-']).map(|p| p.parse::<u32>().unwrap_or(0));
        (parts.next().unwrap_or(0), parts.next().unwrap_or(0)) >= (6, 12)
    }

    #[test]
    fn a_thread_of_another_policy_keeps_it() {
        for policy in [libc::SCHED_BATCH, libc::SCHED_IDLE] {
            std::thread::spawn(move || {
                let param = libc::sched_param { sched_priority: 0 };
                // SAFETY: sets the calling thread's policy (both are open to any thread).
                assert_eq!(unsafe { libc::sched_setscheduler(0, policy, &param) }, 0);
                set_own_slice(Duration::from_micros(300)).unwrap();
                // SAFETY: reads the calling thread's policy.
                assert_eq!(unsafe { libc::sched_getscheduler(0) }, policy);
                let after = slice_of_this_thread();
                if policy == libc::SCHED_BATCH && takes_slices() && after.is_some() {
                    assert_eq!(after, Some(300_000), "a batch thread is a fair one: it takes the slice");
                }
            })
            .join()
            .unwrap();
        }
    }

    #[test]
    fn asking_for_zero_gives_the_kernels_slice_back() {
        std::thread::spawn(|| {
            let before = slice_of_this_thread();
            set_own_slice(Duration::from_micros(300)).unwrap();
            let short = slice_of_this_thread();
            set_own_slice(Duration::ZERO).unwrap();
            let after = slice_of_this_thread();
            if slices_shown(before) {
                assert_eq!(short, Some(300_000));
                assert_eq!(after, before, "the kernel's slice is back");
            }
        })
        .join()
        .unwrap();
    }

    #[test]
    fn a_thread_gets_the_slice_and_keeps_its_nice_value() {
        std::thread::spawn(|| {
            // SAFETY: setpriority/getpriority on the calling thread only.
            let nice = unsafe {
                libc::setpriority(libc::PRIO_PROCESS, 0, 3);
                libc::getpriority(libc::PRIO_PROCESS, 0)
            };
            let before = slice_of_this_thread();
            set_own_slice(Duration::from_micros(300)).unwrap();
            // SAFETY: as above.
            assert_eq!(unsafe { libc::getpriority(libc::PRIO_PROCESS, 0) }, nice, "nice kept");
            // SAFETY: sched_getscheduler on the calling thread only.
            assert_eq!(unsafe { libc::sched_getscheduler(0) }, libc::SCHED_OTHER, "policy kept");
            let after = slice_of_this_thread();
            if slices_shown(after) {
                assert_eq!(after, Some(300_000), "from {before:?}");
            }
        })
        .join()
        .unwrap();
    }
}
