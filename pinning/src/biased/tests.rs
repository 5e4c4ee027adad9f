use super::*;
use std::sync::{Arc, Barrier};

/// Non-atomic read-modify-writes under the lock, from an owner and from foreign threads:
/// any overlap of two holders loses an increment. Whether the bias is revoked on the way
/// depends on the machine's speed; the count must come out right either way.
#[test]
fn one_holder_at_a_time_between_the_owner_and_other_threads() {
    const ROUNDS: u64 = if cfg!(miri) { 100 } else { 20_000 };
    const FOREIGN: u64 = if cfg!(miri) { 20 } else { 2_000 };
    let lock = Arc::new(BiasedLock::<u64>::default());
    let start = Arc::new(Barrier::new(4));
    let owner = {
        let (lock, start) = (lock.clone(), start.clone());
        std::thread::spawn(move || {
            drop(lock.lock_claiming());
            let owned = lock.owned_here();
            start.wait();
            for _ in 0..ROUNDS {
                let mut guard = lock.lock();
                let seen = *guard;
                std::hint::black_box(&mut *guard);
                *guard = seen + 1;
            }
            owned
        })
    };
    let others: Vec<_> = (0..3)
        .map(|_| {
            let (lock, start) = (lock.clone(), start.clone());
            std::thread::spawn(move || {
                start.wait();
                for _ in 0..FOREIGN {
                    let mut guard = lock.lock_claiming();
                    let seen = *guard;
                    std::hint::black_box(&mut *guard);
                    *guard = seen + 1;
                }
            })
        })
        .collect();
    assert!(owner.join().expect("no panic"), "the first claiming thread owns the lock");
    for t in others {
        t.join().expect("no panic");
    }
    assert_eq!(*lock.lock(), ROUNDS + 3 * FOREIGN);
}

#[test]
fn only_a_claiming_take_of_an_unowned_lock_sets_the_owner() {
    let lock = Arc::new(BiasedLock::new(0u32));
    drop(lock.lock());
    assert!(!lock.owned_here(), "a plain take does not claim");
    drop(lock.lock_claiming());
    assert!(lock.owned_here());
    let other = lock.clone();
    let stolen = std::thread::spawn(move || {
        drop(other.lock_claiming());
        other.owned_here()
    })
    .join()
    .unwrap();
    assert!(!stolen, "an owned lock stays its owner's");
    assert!(lock.owned_here());
    lock.revoke();
    assert!(lock.revoked() && !lock.owned_here());
    drop(lock.lock_claiming());
    assert!(lock.revoked(), "a revoked lock is never claimed again");
}

#[test]
fn try_lock_fails_on_either_side_while_the_other_holds() {
    let lock = Arc::new(BiasedLock::new(0u32));
    let owner_hold = lock.lock_claiming();
    drop(owner_hold);
    let held = lock.lock();
    assert_eq!(held.hold, Hold::Owner);
    let other = lock.clone();
    assert!(std::thread::spawn(move || other.try_lock().is_none()).join().unwrap());
    drop(held);
    // A foreign holder keeps the owner out of its own fast path.
    let (tx, rx) = std::sync::mpsc::channel();
    let (done_tx, done_rx) = std::sync::mpsc::channel::<()>();
    let other = lock.clone();
    let t = std::thread::spawn(move || {
        let guard = other.lock();
        tx.send(guard.hold).unwrap();
        done_rx.recv().unwrap();
        drop(guard);
    });
    assert_eq!(rx.recv().unwrap(), if asymmetric() { Hold::Fenced } else { Hold::Gate });
    assert!(lock.try_lock().is_none());
    done_tx.send(()).unwrap();
    t.join().unwrap();
    assert!(lock.try_lock().is_some());
}

#[test]
fn a_panicking_holder_lets_go_on_either_side() {
    let lock = Arc::new(BiasedLock::new(0u32));
    drop(lock.lock_claiming());
    let died = {
        let lock = lock.clone();
        std::thread::spawn(move || {
            let _guard = lock.lock();
            panic!("a foreign holder dies");
        })
        .join()
    };
    assert!(died.is_err());
    let caught = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        let _guard = lock.lock();
        panic!("the owner's holder dies");
    }));
    assert!(caught.is_err());
    *lock.lock() += 1;
    let other = lock.clone();
    std::thread::spawn(move || *other.lock() += 1).join().unwrap();
    assert_eq!(*lock.lock(), 2);
}

#[test]
fn many_foreign_takes_in_a_short_time_end_the_bias() {
    assert!(too_often(REVOKE_TAKES, REVOKE_WINDOW / 2));
    assert!(!too_often(REVOKE_TAKES, REVOKE_WINDOW));
    assert!(!too_often(REVOKE_TAKES - 1, Duration::ZERO));
}

#[test]
fn live_threads_have_distinct_tokens_never_the_reserved_values() {
    let here = token();
    assert_eq!(token(), here);
    // Four threads, all alive once each has its token (ended threads' tokens are reused:
    // tests/biased_handoff.rs).
    let all_in = Arc::new(Barrier::new(4));
    let threads: Vec<_> = (0..4)
        .map(|_| {
            let all_in = all_in.clone();
            std::thread::spawn(move || {
                let mine = token();
                all_in.wait();
                assert_eq!(token(), mine);
                mine
            })
        })
        .collect();
    let mut all: Vec<u64> = threads.into_iter().map(|t| t.join().unwrap()).collect();
    all.push(here);
    all.sort_unstable();
    all.dedup();
    assert_eq!(all.len(), 5);
    assert!(all.iter().all(|&t| t != UNOWNED && t != REVOKED));
}

/// A thread that takes a lock it holds is refused, however it holds it (as the owner,
/// through the gate with another thread's bias fenced out, through the gate of a revoked
/// lock) and however it takes it again (a take, a claiming take, a revocation, a try): a
/// second guard would alias the first's `&mut`. The first hold stays good, and others get
/// the lock once it is given back.
#[test]
fn a_holder_taking_its_lock_again_is_refused() {
    fn refused(lock: &BiasedLock<u32>, how: &str) {
        let panics = |take: &dyn Fn()| std::panic::catch_unwind(std::panic::AssertUnwindSafe(take)).is_err();
        assert!(panics(&|| drop(lock.lock())), "{how}: a take went in");
        assert!(panics(&|| drop(lock.lock_claiming())), "{how}: a claiming take went in");
        assert!(panics(&|| lock.revoke()), "{how}: a revocation went in");
        assert!(lock.try_lock().is_none(), "{how}: a try went in");
    }
    // The first, claiming take goes through the gate and makes this thread the owner.
    let fresh = BiasedLock::new(0u32);
    {
        let guard = fresh.lock_claiming();
        assert_eq!(guard.hold, Hold::Gate);
        refused(&fresh, "the claiming first holder");
    }
    assert_eq!(fresh.owned_here(), asymmetric());
    let mine = Arc::new(BiasedLock::new(0u32));
    drop(mine.lock_claiming());
    {
        let mut guard = mine.lock();
        assert_eq!(guard.hold, if asymmetric() { Hold::Owner } else { Hold::Gate });
        refused(&mine, "the owner");
        *guard += 1;
    }
    let theirs = Arc::new(BiasedLock::new(0u32));
    let claimer = theirs.clone();
    std::thread::spawn(move || drop(claimer.lock_claiming())).join().unwrap();
    {
        let mut guard = theirs.lock();
        assert_eq!(guard.hold, if asymmetric() { Hold::Fenced } else { Hold::Gate });
        refused(&theirs, "a gate holder");
        *guard += 1;
    }
    mine.revoke();
    {
        let mut guard = mine.lock();
        assert_eq!(guard.hold, Hold::Gate);
        refused(&mine, "the holder of a revoked lock");
        *guard += 1;
    }
    for lock in [&mine, &theirs] {
        let other = lock.clone();
        std::thread::spawn(move || *other.lock() += 1).join().unwrap();
    }
    assert_eq!((*mine.lock(), *theirs.lock()), (3, 2));
}
