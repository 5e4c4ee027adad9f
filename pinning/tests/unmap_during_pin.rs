//! An unmap arriving while a long lock-mode pin call is still mlocking its run: the pin
//! gives way at its next piece and fails `Unmapping` (all or nothing: nothing stays pinned
//! or locked), and the unmap completes without waiting for the whole run to be locked.

use std::fs::File;
use std::os::fd::AsFd;
use std::sync::Arc;
use std::time::{Duration, Instant};

use umdev_pinning::{DmaSpace, DmaSpaceConfig, LockAccount, PinError, PinMode, Prot, PAGE_SIZE};

#[test]
fn an_unmap_stops_a_long_lock_mode_pin_at_its_next_piece() {
    // 256 MiB: 65536 pages in one run, 256 mlock pieces.
    const PAGES: u64 = 65536;
    let account = Arc::new(LockAccount::unlimited());
    let space = DmaSpace::new(DmaSpaceConfig {
        mode: PinMode::Lock,
        account: account.clone(),
        max_pages_per_call: PAGES,
        unmap_timeout: Duration::from_secs(10),
        ..Default::default()
    });
    let file =
        File::from(nix::sys::memfd::memfd_create(c"long-pin", nix::sys::memfd::MFdFlags::empty()).unwrap());
    file.set_len(PAGES * PAGE_SIZE).unwrap();
    space.map(0, PAGES * PAGE_SIZE, file.as_fd(), 0, Prot::READ_WRITE).unwrap();

    let pinner = {
        let space = space.clone();
        std::thread::spawn(move || {
            let started = Instant::now();
            let result = space.pin_range(0, PAGES, Prot::WRITE).map(drop);
            (result, started.elapsed())
        })
    };
    // Once the pin call has charged the run (it is about to mlock it), unmap. (Not through
    // `stats()`: that takes the mapping's lock, which the pin call holds.)
    let deadline = Instant::now() + Duration::from_secs(10);
    while account.locked() == 0 {
        assert!(Instant::now() < deadline, "the pin never started locking");
        std::hint::spin_loop();
    }
    let unmap_started = Instant::now();
    let unmapped = space.unmap(0, PAGES * PAGE_SIZE);
    let unmap_took = unmap_started.elapsed();
    let (pinned, pin_took) = pinner.join().unwrap();
    let mlock_calls = space.stats().mlock_calls;
    match pinned {
        Err(PinError::Unmapping { .. }) => {
            assert!(unmapped.is_ok(), "{unmapped:?}");
            assert!(
                mlock_calls < PAGES / 256,
                "the pin stopped early: {mlock_calls} of {} pieces",
                PAGES / 256
            );
            eprintln!("unmap during a 256 MiB lock-mode pin: returned in {unmap_took:?} (pin gave way after {pin_took:?}, {mlock_calls} pieces)");
        }
        other => panic!("the pin should have given way to the unmap: {other:?} after {pin_took:?}"),
    }
    assert_eq!(account.locked(), 0, "nothing stays locked");
    assert_eq!(space.stats().pins_held, 0);
}
