//! A lock biased to a thread that ended stays biased, to the next thread that starts: the
//! ended thread's token goes back to a pool and the new thread takes it (I19 in DESIGN.md).
//! Alone in its test binary, so that no other test's threads take tokens from the pool.

use std::sync::Arc;

use umdev_pinning::sync::BiasedLock;

#[test]
fn a_lock_biased_to_an_ended_thread_is_biased_to_the_next_one() {
    let lock = Arc::new(BiasedLock::new(0u64));
    let first = lock.clone();
    let owned = std::thread::spawn(move || {
        *first.lock_claiming() += 1;
        first.owned_here()
    })
    .join()
    .unwrap();
    if !owned {
        eprintln!("skipped: no private expedited membarrier here, so no lock gets an owner");
        return;
    }
    // Twenty threads one after another (a queue worker replaced at each controller reset):
    // each finds the lock its own and takes it as the owner, and the bias lasts.
    for i in 0..20 {
        let next = lock.clone();
        let owned = std::thread::spawn(move || {
            let owned = next.owned_here();
            *next.lock() += 1;
            owned
        })
        .join()
        .unwrap();
        assert!(owned, "thread {i} after the first does not own the lock");
    }
    assert!(!lock.revoked());
    assert_eq!(*lock.lock(), 21);
}
