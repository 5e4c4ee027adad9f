//! Lock mode's tests: per-page counts, mlock and its accounting, stocks in mappings.

use std::os::fd::AsFd;
use std::sync::Arc;

use super::tests::{counts, space_with};
use super::*;
use crate::page::PAGE_SIZE;
use crate::testutil::{locked_bytes_in, memfd};
use crate::{DmaSpaceConfig, DmaStats, LockAccount, PinMode};

const P: u64 = PAGE_SIZE;

#[test]
#[cfg_attr(miri, ignore = "Miri: mlock")]
fn the_count_limit_fails_the_whole_call() {
    // Per-page counts (lock mode; kept pins in track mode) stop at MAX_PIN_COUNT.
    let lock = DmaSpaceConfig {
        mode: PinMode::Lock,
        account: Arc::new(LockAccount::unlimited()),
        ..Default::default()
    };
    let (space, _f) = space_with(lock);
    let held: Vec<_> =
        (0..crate::MAX_PIN_COUNT).map(|_| space.pin_pages(&[4], Prot::READ).unwrap()).collect();
    let err = space.pin_pages(&[1, 2, 3, 4, 5], Prot::READ).unwrap_err();
    assert!(matches!(err, PinError::CountOverflow { index: 3, pfn: 4 }), "{err}");
    assert_eq!(counts(&space, 1..6), vec![0, 0, 0, crate::MAX_PIN_COUNT, 0]);
    drop(held);
    assert_eq!(space.stats().pins_held, 0);
}

/// An empty lock-mode space (no lock limit) of at most `max_pins` pins.
fn lock_space_of(max_pins: u64) -> DmaSpace {
    DmaSpace::new(DmaSpaceConfig {
        mode: PinMode::Lock,
        account: Arc::new(LockAccount::unlimited()),
        max_pins,
        ..Default::default()
    })
}

#[test]
#[cfg_attr(miri, ignore = "Miri: mlock")]
fn lock_mode_stocks_in_mappings_keep_the_limit_exact_and_counts_outlive_the_table() {
    // Lock-mode calls reserve from their first mapping's stock and count there: the
    // limit must still be exact across mappings, an unmap must hand both back.
    let space = lock_space_of(6000);
    let (a, b) = (memfd(3000), memfd(8192));
    space.map(0, 3000 * P, a.as_fd(), 0, Prot::READ_WRITE).unwrap();
    space.map(1 << 30, 8192 * P, b.as_fd(), 0, Prot::READ_WRITE).unwrap();
    // Mapping A keeps (up to two stocks of) unused reservation after these.
    for _ in 0..3 {
        drop(space.pin_range(0, 3000, Prot::READ).unwrap());
    }
    drop(space.pin_pages(&[7, 9], Prot::READ).unwrap());
    // Mapping B can still take the whole limit, and not one pin more, in either mapping.
    let all = space.pin_range(1 << 30, 6000, Prot::READ).unwrap();
    let err = space.pin_pages(&[(1 << 18) + 6000], Prot::READ).unwrap_err();
    assert!(matches!(err, PinError::PinLimit { requested: 1, held: 6000, max: 6000 }), "{err}");
    assert!(matches!(space.pin_pages(&[5], Prot::READ), Err(PinError::PinLimit { .. })));
    drop(all);
    // A takes a stock again (from B's, reclaimed), and keeps it.
    drop(space.pin_pages(&[7, 9], Prot::READ).unwrap());
    let before = space.stats();
    assert_eq!((before.pin_calls, before.unpin_calls, before.pin_failures), (6, 6, 2));
    assert_eq!((before.runs, before.pages), (8, 15004));
    // 3000 pages in 256-page pieces, 6000 likewise; one munlock per run let go.
    assert_eq!((before.mlock_calls, before.munlock_calls), (3 * 12 + 2 + 24 + 2, 3 + 2 + 1 + 2));
    // A mapping that leaves the table moves its counts to the space's, even while a guard
    // still holds it: totals do not step back, and its stock is the space's again.
    let kept = space.pin_pages(&[11], Prot::READ).unwrap();
    let before = space.stats();
    space.abandon_all();
    let after = space.stats();
    let totals = |s: &DmaStats| (s.pin_calls, s.unpin_calls, s.runs, s.pages, s.mlock_calls, s.munlock_calls);
    assert_eq!(totals(&after), totals(&before));
    space.map(0, 8192 * P, b.as_fd(), 0, Prot::READ_WRITE).unwrap();
    let rest = space.pin_range(0, 5999, Prot::READ).unwrap();
    assert!(matches!(space.pin_pages(&[6000], Prot::READ), Err(PinError::PinLimit { held: 6000, .. })));
    drop((kept, rest));
    assert_eq!(space.stats().pins_held, 0);
    assert_eq!(totals(&space.stats()).0, before.pin_calls + 1);
}

#[test]
#[cfg_attr(miri, ignore = "Miri: mlock")]
fn lock_mode_pins_let_go_after_their_mapping_left_the_table_go_straight_back_to_the_space() {
    // A removed mapping kept alive by a guard keeps no stock: what its guards give back
    // is the space's at once, not when the last of them drops.
    let space = lock_space_of(6000);
    let file = memfd(8192);
    space.map(0, 3000 * P, file.as_fd(), 0, Prot::READ_WRITE).unwrap();
    let stays = space.pin_pages(&[1], Prot::READ).unwrap();
    let goes = space.pin_range(0, 3000, Prot::READ).unwrap();
    space.abandon_all();
    drop(goes);
    space.map(0, 8192 * P, file.as_fd(), 0, Prot::READ_WRITE).unwrap();
    let rest = space.pin_range(0, 5999, Prot::READ).unwrap();
    assert!(matches!(space.pin_pages(&[6000], Prot::READ), Err(PinError::PinLimit { held: 6000, .. })));
    drop((stays, rest));
    assert_eq!(space.stats().pins_held, 0);
    assert_eq!(space.pin_range(0, 6000, Prot::READ).map(drop).err().map(|e| e.to_string()), None);
}

#[test]
#[cfg_attr(miri, ignore = "Miri: mlock")]
fn unpin_pages_takes_kept_pins_only_never_a_live_guards() {
    // Lock mode counts a live guard's pins per page as it counts kept ones. Were unpin_pages
    // to take a guard's pin, that guard's drop would take the next guard's, and an unmap
    // would then go ahead under a live guard.
    let lock = DmaSpaceConfig {
        mode: PinMode::Lock,
        account: Arc::new(LockAccount::unlimited()),
        unmap_timeout: std::time::Duration::ZERO,
        ..Default::default()
    };
    let (space, _f) = space_with(lock);
    let first = space.pin_pages(&[2, 3, 4], Prot::READ).unwrap();
    let err = space.unpin_pages(&[3]).unwrap_err();
    assert!(matches!(err, UnpinError::NotPinned { index: 0, pfn: 3 }), "{err}");
    assert_eq!(counts(&space, 2..5), vec![1, 1, 1]);
    let second = space.pin_pages(&[3], Prot::READ).unwrap();
    drop(first);
    assert_eq!(counts(&space, 2..5), vec![0, 1, 0]);
    assert!(matches!(space.unmap(0, 64 * P), Err(crate::UnmapError::Busy { .. })));
    drop(second);

    // Kept and live pins on one page: only the kept one is taken, and a call naming the
    // page more often than it has kept pins changes nothing.
    space.pin_pages(&[5], Prot::READ).unwrap().forget();
    let live = space.pin_pages(&[5, 6], Prot::READ).unwrap();
    let err = space.unpin_pages(&[6]).unwrap_err();
    assert!(matches!(err, UnpinError::NotPinned { index: 0, pfn: 6 }), "{err}");
    let err = space.unpin_pages(&[5, 5]).unwrap_err();
    assert!(matches!(err, UnpinError::NotPinned { index: 1, pfn: 5 }), "{err}");
    assert_eq!(counts(&space, 5..7), vec![2, 1]);
    space.unpin_pages(&[5]).unwrap();
    assert_eq!(counts(&space, 5..7), vec![1, 1]);
    assert!(space.unpin_pages(&[5]).is_err());
    drop(live);
    assert_eq!(counts(&space, 0..8), vec![0; 8]);
    assert_eq!(space.stats().pins_held, 0);
    assert_eq!(space.account().locked(), 0);
}

fn lock_space(limit: u64) -> (DmaSpace, std::fs::File, usize) {
    let account = Arc::new(LockAccount::with_limit(limit));
    let (space, file) = space_with(DmaSpaceConfig { mode: PinMode::Lock, account, ..Default::default() });
    let host = space.pin_range(0, 1, Prot::READ).unwrap().host_addr(0).unwrap();
    (space, file, host)
}

#[test]
#[cfg_attr(miri, ignore = "Miri: mlock")]
fn lock_mode_locks_each_page_once_and_unlocks_at_zero() {
    let (space, _f, host) = lock_space(u64::MAX);
    let locked = || locked_bytes_in(host, 64 * P as usize);
    assert_eq!(locked(), 0);
    let a = space.pin_pages(&[1, 5, 6, 7, 9], Prot::READ).unwrap();
    assert_eq!(locked(), 5 * P);
    assert_eq!(space.account().locked(), 5 * P);
    // Pinning [4..8] again locks only 4 and 8, and charges only them.
    let mlocks = space.stats().mlock_calls;
    let b = space.pin_range(4 * P, 5, Prot::READ).unwrap();
    assert_eq!(space.stats().mlock_calls - mlocks, 2);
    assert_eq!(locked(), 7 * P);
    assert_eq!(space.account().locked(), 7 * P);
    drop(a);
    // 1 and 9 go; 5, 6, 7 stay locked under b.
    assert_eq!(locked(), 5 * P);
    drop(b);
    assert_eq!(locked(), 0);
    assert_eq!(space.account().locked(), 0);
    assert_eq!(space.stats().locked_bytes, 0);
}

#[test]
#[cfg_attr(miri, ignore = "Miri: mlock")]
fn lock_limit_is_checked_per_run_and_unwinds_fully() {
    let (space, _f, host) = lock_space(6 * P);
    let keep = space.pin_pages(&[1, 2], Prot::READ).unwrap();
    // Runs [3,4] then [10,11,12]: the second would bring the total to 7 pages.
    let err = space.pin_pages(&[3, 4, 10, 11, 12], Prot::READ).unwrap_err();
    assert!(matches!(err, PinError::LockLimit { index: 2, pfn: 10, .. }), "{err}");
    assert_eq!(err.errno(), libc::ENOMEM);
    assert_eq!(counts(&space, [3, 4, 10, 11, 12]), vec![0; 5]);
    assert_eq!(space.account().locked(), 2 * P);
    assert_eq!(locked_bytes_in(host, 64 * P as usize), 2 * P);
    // Repeats of locked pages cost nothing against the limit.
    let again = space.pin_pages(&[1, 2, 1, 2, 1, 2, 3, 4, 5, 6], Prot::READ).unwrap();
    assert_eq!(space.account().locked(), 6 * P);
    drop((keep, again));
    assert_eq!(space.account().locked(), 0);
}

#[test]
#[cfg_attr(miri, ignore = "Miri: hugetlbfs")]
fn hugetlb_backing_is_locked_by_accounting_alone() {
    use nix::sys::memfd::{memfd_create, MFdFlags};
    let huge = 2u64 << 20;
    let file = match memfd_create(c"umdev-huge", MFdFlags::MFD_HUGETLB | MFdFlags::MFD_HUGE_2MB) {
        Ok(fd) => std::fs::File::from(fd),
        Err(e) => return eprintln!("skipped: no hugetlb memfd ({e})"),
    };
    file.set_len(huge).unwrap();
    let account = Arc::new(LockAccount::with_limit(u64::MAX));
    let space = DmaSpace::new(DmaSpaceConfig { mode: PinMode::Lock, account, ..Default::default() });
    if let Err(e) = space.map(0, huge, file.as_fd(), 0, Prot::READ_WRITE) {
        return eprintln!("skipped: no free 2 MiB huge page (echo 64 > /proc/sys/vm/nr_hugepages): {e}");
    }
    assert!(space.lookup(0).unwrap().hugetlb);
    // A hugetlbfs mapping must be aligned to its page size.
    let err = space.map(huge, P, file.as_fd(), 0, Prot::READ).unwrap_err();
    assert!(matches!(err, crate::MapError::Backing(crate::MmapError::BackingUnaligned { .. })), "{err}");
    let pins = space.pin_pages(&[0, 1, 2, 7, 9], Prot::WRITE).unwrap();
    pins.write(0, b"huge").unwrap();
    let stats = space.stats();
    assert_eq!(stats.mlock_calls, 0, "hugetlb pages need no mlock");
    assert_eq!(space.account().locked(), 5 * P, "but they are accounted");
    drop(pins);
    assert_eq!(space.account().locked(), 0);
    assert_eq!(space.stats().munlock_calls, 0);
}

#[test]
#[cfg_attr(miri, ignore = "Miri: mlock")]
fn unpin_of_a_repeated_page_unlocks_once() {
    let (space, _f, host) = lock_space(u64::MAX);
    space.pin_pages(&[2, 2, 3], Prot::READ).unwrap().forget();
    assert_eq!(space.account().locked(), 2 * P);
    space.unpin_pages(&[2, 3, 2]).unwrap();
    assert_eq!(space.account().locked(), 0);
    assert_eq!(locked_bytes_in(host, 64 * P as usize), 0);
}

/// A lock-mode call whose runs lie in two mappings gives way at its next mlock piece to an
/// unmap claiming either of them, not only the one it is locking (I6): with the mapping of
/// its last run claimed, its long first run in the other is not locked at all.
#[test]
#[cfg_attr(miri, ignore = "Miri: mlock")]
fn a_long_run_gives_way_to_an_unmap_of_another_mapping_of_the_call() {
    let space = DmaSpace::new(DmaSpaceConfig { mode: PinMode::Lock, ..Default::default() });
    let (a, b) = (memfd(1), memfd(512));
    space.map(0, P, a.as_fd(), 0, Prot::READ_WRITE).unwrap();
    space.map(P, 512 * P, b.as_fd(), 0, Prot::READ_WRITE).unwrap();
    // An unmap of A, waiting for its lock, as the call holds it.
    let claimed = space.read_table().values().find(|m| m.iova() == 0).unwrap().clone();
    claimed.claim_for_test();
    // B's 512 pages first (two 256-page pieces), then A's page.
    let pfns: Vec<u64> = (1..=512).chain([0]).collect();
    let mlocks = space.stats().mlock_calls;
    let err = space.pin_pages(&pfns, Prot::READ).unwrap_err();
    assert!(matches!(err, PinError::Unmapping { index: 0, .. }), "{err}");
    assert_eq!(space.stats().mlock_calls - mlocks, 0, "nothing of B's run was locked");
    assert_eq!(space.account().locked(), 0);
}

/// An mlock that fails part-way (the client truncated the file under the run: the pages past
/// its end cannot be faulted in) leaves nothing locked: the kernel marks the whole piece
/// locked before it faults the pages in, and keeps what it faulted locked when it fails.
#[test]
#[cfg_attr(miri, ignore = "Miri: mlock")]
fn a_failed_mlock_leaves_nothing_locked() {
    let (space, file, host) = lock_space(u64::MAX);
    file.set_len(8 * P).unwrap();
    let err = space.pin_range(4 * P, 8, Prot::READ).unwrap_err();
    assert_eq!(locked_bytes_in(host, 64 * P as usize), 0, "{err}");
    assert_eq!(space.account().locked(), 0);
    // The pages within the file pin and unpin as before.
    drop(space.pin_range(4 * P, 4, Prot::READ).unwrap());
    assert_eq!(locked_bytes_in(host, 64 * P as usize), 0);
}
