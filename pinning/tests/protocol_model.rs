//! A shuttle model of the engine's lifetime protocol (DESIGN.md): a guard's drop, an unmap,
//! the space's close and a racing pin, on one shard and one mapping, under every schedule
//! shuttle tries. Each step mirrors the engine's code and names the invariant it keeps;
//! "freed" memory is a flag that every access asserts is clear.
//!
//! The protocol passes. Each `#[should_panic]` test breaks one invariant on purpose (a
//! [`Fault`]) and the model must catch it: a use after free, a leak, or a hang (shuttle
//! fails an execution in which every thread waits).

use shuttle::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, AtomicUsize, Ordering::SeqCst};
use shuttle::sync::{Arc, Condvar, Mutex};
use shuttle::thread;

/// An invariant broken on purpose.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Fault {
    None,
    /// I5: a guard touches its space after its lock-free release.
    TouchAfterRelease,
    /// I6: a pin checks the mapping's state before it takes its shard's lock.
    CheckBeforeLock,
    /// I7: an unmap that saw small records live waits for a signal instead of looking again.
    NoRelook,
    /// I7: an unmap reads the event count after its look instead of before.
    EpochAfterLook,
    /// I4, I8: closing lets go of the space though a shard holds live records.
    CloseIgnoresRecords,
}

const LIVE: u8 = 0;
const UNMAPPING: u8 = 1;
const REMOVED: u8 = 2;

/// A mapping: its state, its drained event (`mapping::Drained`), and whether its memory went.
struct Mapping {
    state: AtomicU8,
    freed: AtomicBool,
    epoch: AtomicU64,
    lock: Mutex<()>,
    cv: Condvar,
}

impl Mapping {
    fn touch(&self) {
        assert!(!self.freed.load(SeqCst), "a mapping was freed under a live record (I1)");
    }

    /// `Drained::signal`: bump, then notify under the leaf mutex.
    fn signal(&self) {
        self.epoch.fetch_add(1, SeqCst);
        let _held = self.lock.lock().unwrap();
        self.cv.notify_all();
    }
}

/// The shard: its live records, and whether it keeps the space (`Shard::keepalive`).
#[derive(Default)]
struct Shard {
    /// Small entries not yet reclaimed; each flag is the entry's `live`.
    small: Vec<Arc<AtomicBool>>,
    /// Live boxed records.
    boxed: usize,
    keepalive: bool,
}

impl Shard {
    /// `Shard::reclaim_small`: entries their guards released go back.
    fn reclaim(&mut self) {
        self.small.retain(|live| live.load(SeqCst));
    }

    fn is_empty(&mut self) -> bool {
        self.reclaim();
        self.small.is_empty() && self.boxed == 0
    }
}

/// `SpaceInner` with its reference count made explicit: the handles' share and the shard's
/// keepalive each hold one; the memory goes when the count reaches 0.
struct Space {
    refs: AtomicUsize,
    freed: AtomicBool,
    closed: AtomicBool,
    /// `DmaSpace` handles (the space closes when the last goes).
    handles: AtomicUsize,
    shard: Mutex<Shard>,
    mapping: Mapping,
    fault: Fault,
}

impl Space {
    fn touch(&self) {
        assert!(!self.freed.load(SeqCst), "a space was freed under a live record (I4)");
    }

    fn release_ref(&self) {
        if self.refs.fetch_sub(1, SeqCst) == 1 {
            self.freed.store(true, SeqCst);
        }
    }

    /// `Weak::upgrade`, as the reaper does.
    fn upgrade(&self) -> bool {
        let mut refs = self.refs.load(SeqCst);
        loop {
            if refs == 0 {
                return false;
            }
            match self.refs.compare_exchange(refs, refs + 1, SeqCst, SeqCst) {
                Ok(_) => return true,
                Err(now) => refs = now,
            }
        }
    }

    /// A shard's last record retiring in a closed space lets go of it (I8). Under the lock.
    fn let_go_if_idle(&self, shard: &mut Shard) -> bool {
        if self.closed.load(SeqCst) && shard.keepalive && shard.is_empty() {
            shard.keepalive = false;
            return true;
        }
        false
    }

    /// `track::retire`: under the shard's lock, wake an unmap and let go of a closed space.
    fn retire(&self, small: Option<&Arc<AtomicBool>>) {
        let mut shard = self.shard.lock().unwrap();
        self.touch();
        self.mapping.touch();
        let waking = self.mapping.state.load(SeqCst) != LIVE;
        match small {
            Some(entry) => {
                entry.store(false, SeqCst);
                shard.reclaim();
            }
            None => shard.boxed -= 1,
        }
        if waking {
            self.mapping.signal();
        }
        let last = self.let_go_if_idle(&mut shard);
        drop(shard);
        if last {
            self.release_ref();
        }
    }

    /// `PinnedPages::drop` of a small record.
    fn drop_small_guard(&self, entry: &Arc<AtomicBool>) {
        self.touch();
        self.mapping.touch();
        if self.mapping.state.load(SeqCst) == LIVE && !self.closed.load(SeqCst) {
            // I5: the release store is the guard's last access.
            entry.store(false, SeqCst);
            if self.fault == Fault::TouchAfterRelease {
                self.touch();
            }
            return;
        }
        self.retire(Some(entry));
    }

    /// A track-mode pin of one page (a boxed record): true if published.
    fn pin(&self) -> bool {
        self.touch();
        let early = self.mapping.state.load(SeqCst) == LIVE;
        let mut shard = self.shard.lock().unwrap();
        // I6: the state is checked under the shard's lock, in the hold that publishes.
        let live = if self.fault == Fault::CheckBeforeLock {
            early
        } else {
            self.mapping.state.load(SeqCst) == LIVE
        };
        if !live {
            return false;
        }
        shard.boxed += 1;
        if !shard.keepalive {
            shard.keepalive = true;
            self.refs.fetch_add(1, SeqCst);
        }
        true
    }

    /// `DmaSpace::unmap` of the mapping: mark, look at the shard, wait, remove.
    fn unmap(&self) {
        self.mapping.state.store(UNMAPPING, SeqCst);
        loop {
            let seen = self.mapping.epoch.load(SeqCst);
            let (pins, in_small) = {
                let shard = self.shard.lock().unwrap();
                let small = shard.small.iter().filter(|live| live.load(SeqCst)).count();
                (small + shard.boxed, small)
            };
            if pins == 0 {
                break;
            }
            if in_small != 0 && self.fault != Fault::NoRelook {
                // I7: small records may be released without a word: look again (RELOOK).
                thread::yield_now();
                continue;
            }
            let held = self.mapping.lock.lock().unwrap();
            let seen =
                if self.fault == Fault::EpochAfterLook { self.mapping.epoch.load(SeqCst) } else { seen };
            if self.mapping.epoch.load(SeqCst) != seen {
                continue;
            }
            drop(self.mapping.cv.wait(held).unwrap());
        }
        self.mapping.state.store(REMOVED, SeqCst);
        // The table's reference was the last: the memory goes.
        self.mapping.freed.store(true, SeqCst);
    }

    /// `SpaceHandle::drop` of the last handle: close, let idle shards go, watch the rest.
    fn drop_handle(self: &Arc<Self>) {
        if self.handles.fetch_sub(1, SeqCst) != 1 {
            return;
        }
        self.closed.store(true, SeqCst);
        let mut shard = self.shard.lock().unwrap();
        let idle = self.fault == Fault::CloseIgnoresRecords || shard.is_empty();
        let let_go = shard.keepalive && idle;
        if let_go {
            shard.keepalive = false;
        }
        let holding = shard.keepalive;
        drop(shard);
        if let_go {
            self.release_ref();
        }
        if holding {
            let space = Arc::clone(self);
            thread::spawn(move || space.reap());
        }
        // The handles' own share.
        self.release_ref();
    }

    /// The reaper: looks again and again (REAP_EVERY) until the space is gone or let go.
    fn reap(&self) {
        loop {
            if !self.upgrade() {
                return;
            }
            let mut shard = self.shard.lock().unwrap();
            let let_go = self.let_go_if_idle(&mut shard);
            let holding = shard.keepalive;
            drop(shard);
            if let_go {
                self.release_ref();
            }
            self.release_ref();
            if !holding {
                return;
            }
            thread::yield_now();
        }
    }
}

/// One execution: a small-record guard pinned beforehand, then its drop, an unmap, a racing
/// pin (whose guard drops after its handle), and the close, all at once.
fn model(fault: Fault) {
    let entry = Arc::new(AtomicBool::new(true));
    let space = Arc::new(Space {
        // The handles' share and the shard's keepalive (the guard's record is live).
        refs: AtomicUsize::new(2),
        freed: AtomicBool::new(false),
        closed: AtomicBool::new(false),
        handles: AtomicUsize::new(2),
        shard: Mutex::new(Shard { small: vec![Arc::clone(&entry)], boxed: 0, keepalive: true }),
        mapping: Mapping {
            state: AtomicU8::new(LIVE),
            freed: AtomicBool::new(false),
            epoch: AtomicU64::new(0),
            lock: Mutex::new(()),
            cv: Condvar::new(),
        },
        fault,
    });
    let guard = {
        let space = Arc::clone(&space);
        thread::spawn(move || space.drop_small_guard(&entry))
    };
    let unmap = {
        let space = Arc::clone(&space);
        thread::spawn(move || space.unmap())
    };
    let pinner = {
        let space = Arc::clone(&space);
        thread::spawn(move || {
            let pinned = space.pin();
            space.drop_handle();
            if pinned {
                space.retire(None);
            }
        })
    };
    space.drop_handle();
    for t in [guard, unmap, pinner] {
        t.join().unwrap();
    }
    // The reaper may still run: wait for it to let go (it yields between looks; with every
    // other thread done, it finds the shard idle at its next look).
    for _ in 0..1000 {
        if space.freed.load(SeqCst) {
            break;
        }
        thread::yield_now();
    }
    assert!(space.freed.load(SeqCst), "the space outlived its last record (I8)");
    assert!(space.mapping.freed.load(SeqCst), "the unmap removed the mapping");
}

const RANDOM: usize = 2000;
const PCT: usize = 2000;
/// The schedules a broken protocol is tried under: fixed, so the test that expects the model
/// to catch it does on every run (random ones missed the narrowest fault, a lost wake-up,
/// about once in a few hundred runs).
const SEED: u64 = 0x756d_6465_7600_0001;

fn check(fault: Fault) {
    if fault == Fault::None {
        // The protocol itself: new random schedules every run, any failure a real one.
        shuttle::check_random(move || model(fault), RANDOM);
        shuttle::check_pct(move || model(fault), PCT, 3);
        return;
    }
    shuttle::check_random_with_seed(move || model(fault), SEED, RANDOM);
    let pct = shuttle::scheduler::PctScheduler::new_from_seed(SEED, 3, PCT);
    shuttle::Runner::new(pct, shuttle::Config::default()).run(move || model(fault));
}

#[test]
fn the_protocol_holds_under_every_schedule_tried() {
    check(Fault::None);
}

#[test]
#[should_panic(expected = "a space was freed under a live record (I4)")]
fn a_guard_that_touches_its_space_after_letting_go_is_caught() {
    check(Fault::TouchAfterRelease);
}

#[test]
#[should_panic(expected = "a mapping was freed under a live record (I1)")]
fn a_pin_that_checks_the_mapping_before_its_shard_lock_is_caught() {
    check(Fault::CheckBeforeLock);
}

#[test]
#[should_panic(expected = "deadlock")]
fn an_unmap_that_does_not_look_again_for_small_records_hangs() {
    check(Fault::NoRelook);
}

#[test]
#[should_panic(expected = "deadlock")]
fn an_unmap_that_reads_the_event_count_after_its_look_loses_a_wakeup() {
    check(Fault::EpochAfterLook);
}

#[test]
#[should_panic(expected = "a space was freed under a live record (I4)")]
fn a_close_that_lets_go_under_live_records_is_caught() {
    check(Fault::CloseIgnoresRecords);
}
