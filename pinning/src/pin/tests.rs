use std::os::fd::AsFd;
use std::sync::Arc;
use std::time::{Duration, Instant};

use std::ptr::NonNull;

use vm_memory::VolatileSlice;

use super::guard::HoldView;
use super::*;
use crate::page::PAGE_SIZE;
use crate::record::{RecordPtr, SmallRecord};
use crate::testutil::memfd;
use crate::{DmaSpaceConfig, LockAccount, PinMode};

const P: u64 = PAGE_SIZE;

/// A space with one 64-page mapping at IOVA 0 and the memfd behind it.
pub(super) fn space_with(config: DmaSpaceConfig) -> (DmaSpace, std::fs::File) {
    let space = DmaSpace::new(config);
    let file = memfd(64);
    space.map(0, 64 * P, file.as_fd(), 0, Prot::READ_WRITE).unwrap();
    (space, file)
}

pub(super) fn counts(space: &DmaSpace, pfns: impl IntoIterator<Item = u64>) -> Vec<u32> {
    pfns.into_iter().map(|p| space.pin_count(p * P)).collect()
}

#[test]
fn an_idaw_list_pins_as_its_contiguous_runs() {
    let (space, _f) = space_with(Default::default());
    let pins = space.pin_pages(&[1, 5, 6, 7, 9], Prot::READ).unwrap();
    let runs: Vec<_> = pins.runs().iter().map(|r| (r.iova() / P, r.npages(), r.index())).collect();
    assert_eq!(runs, vec![(1, 1, 0), (5, 3, 1), (9, 1, 4)]);
    // Every page's host address follows its run.
    let base = pins.host_addr(0).unwrap() - P as usize;
    for (i, pfn) in [1u64, 5, 6, 7, 9].iter().enumerate() {
        assert_eq!(pins.host_addr(i), Some(base + (*pfn * P) as usize));
        assert_eq!(pins.iova(i), Some(pfn * P));
    }
    assert_eq!(pins.host_addr(5), None);
    assert_eq!(counts(&space, 0..10), vec![0, 1, 0, 0, 0, 1, 1, 1, 0, 1]);
    let stats = space.stats();
    assert_eq!((stats.pin_calls, stats.runs, stats.pages, stats.pins_held), (1, 3, 5, 5));
    drop(pins);
    assert_eq!(counts(&space, 0..10), vec![0; 10]);
    assert_eq!(space.stats().pins_held, 0);
}

#[test]
fn a_page_tried_pins_as_a_pin_would_and_a_refusal_counts_nothing() {
    let (space, _f) = space_with(Default::default());
    space.map_message_only(128 * P, 4 * P, Prot::READ_WRITE).unwrap();
    space.map(256 * P, P, memfd(1).as_fd(), 0, Prot::READ).unwrap();
    let pins = space.try_pin_page(5 * P + 100, Prot::WRITE).expect("a mapped page");
    assert_eq!((pins.iova(0), counts(&space, 4..7)), (Some(5 * P), vec![0, 1, 0]));
    let stats = space.stats();
    assert_eq!((stats.pin_calls, stats.pins_held), (1, 1));
    // Unmapped, fd-less, read-only for a write: nothing, and nothing counted as failed.
    for (iova, prot) in [(100 * P, Prot::READ), (129 * P, Prot::READ), (256 * P, Prot::WRITE)] {
        assert!(space.try_pin_page(iova, prot).is_none(), "{iova:#x}");
    }
    let stats = space.stats();
    assert_eq!((stats.pin_calls, stats.pin_failures, stats.pins_held), (1, 0, 1));
    drop(pins);
    assert_eq!(space.stats().pins_held, 0);
    // Lock mode has no such path: always nothing.
    let lock = DmaSpaceConfig {
        mode: PinMode::Lock,
        account: Arc::new(LockAccount::unlimited()),
        ..Default::default()
    };
    let (space, _f) = space_with(lock);
    assert!(space.try_pin_page(5 * P, Prot::READ).is_none());
    assert_eq!(space.stats().pin_failures, 0);
}

#[test]
fn a_prefetch_pins_nothing_and_is_quiet_wherever_it_points() {
    let (space, _f) = space_with(Default::default());
    space.map_message_only(128 * P, 4 * P, Prot::READ).unwrap();
    // Inside a page, running past its end (cut at the end), empty, unmapped, fd-less,
    // and at the top of the IOVA space.
    for (iova, len) in
        [(P + 8, 248), (2 * P - 8, 4096), (3 * P, 0), (100 * P, 64), (129 * P, 64), (u64::MAX - 8, 64)]
    {
        space.prefetch(iova, len);
    }
    let stats = space.stats();
    assert_eq!((stats.pin_calls, stats.pins_held), (0, 0));
    assert_eq!(counts(&space, 0..4), vec![0; 4]);
    // The shard's lock is free again: a pin and an unmap go on.
    drop(space.pin_pages(&[1], Prot::READ).unwrap());
    space.unmap(0, 64 * P).unwrap();
    space.prefetch(P, 64);
}

#[test]
fn order_and_repeats_are_kept() {
    let (space, _f) = space_with(Default::default());
    let pins = space.pin_pages(&[7, 6, 5, 5, 6, 7], Prot::READ).unwrap();
    // [7] [6] [5] [5,6,7]: runs follow the array, never sorted.
    assert_eq!(pins.runs().len(), 4, "{:?}", pins.runs());
    assert_eq!(counts(&space, 5..8), vec![2, 2, 2]);
    let last = pins.runs().last().unwrap();
    assert_eq!((last.iova() / P, last.npages(), last.index()), (5, 3, 3));
}

#[test]
fn segments_merge_only_host_adjacent_runs() {
    let (space, _f) = space_with(Default::default());
    let pins = space.pin_pages(&[3, 4, 9, 10, 11, 2], Prot::READ).unwrap();
    let segs: Vec<_> = pins.segments().map(|s| (s.len / P, s.index)).collect();
    assert_eq!(segs, vec![(2, 0), (3, 2), (1, 5)]);
}

#[test]
#[cfg_attr(miri, ignore = "Miri: reads the file back")]
fn a_run_never_crosses_a_mapping_boundary() {
    let space = DmaSpace::default();
    let (a, b) = (memfd(4), memfd(4));
    space.map(0, 4 * P, a.as_fd(), 0, Prot::READ_WRITE).unwrap();
    space.map(4 * P, 4 * P, b.as_fd(), 0, Prot::READ_WRITE).unwrap();
    let pins = space.pin_pages(&[2, 3, 4, 5], Prot::WRITE).unwrap();
    let runs: Vec<_> = pins.runs().iter().map(|r| (r.iova() / P, r.npages())).collect();
    assert_eq!(runs, vec![(2, 2), (4, 2)]);
    // The guard's buffer still reads as one: bytes land in the right files.
    pins.write(2 * P - 2, b"abcd").unwrap();
    let mut buf = [0u8; 2];
    std::os::unix::fs::FileExt::read_exact_at(&a, &mut buf, 4 * P - 2).unwrap();
    assert_eq!(&buf, b"ab");
    std::os::unix::fs::FileExt::read_exact_at(&b, &mut buf, 0).unwrap();
    assert_eq!(&buf, b"cd");
    let range = space.pin_range(P, 6, Prot::READ).unwrap();
    assert_eq!(range.runs().len(), 2);
    let mut back = [0u8; 4];
    range.read(3 * P - 2, &mut back).unwrap();
    assert_eq!(&back, b"abcd");
}

#[test]
fn failures_unwind_everything_and_name_the_first_bad_page() {
    let space = DmaSpace::default();
    let (rw, ro) = (memfd(8), memfd(8));
    space.map(0, 8 * P, rw.as_fd(), 0, Prot::READ_WRITE).unwrap();
    space.map(16 * P, 8 * P, ro.as_fd(), 0, Prot::READ).unwrap();
    let err = space.pin_pages(&[1, 2, 3, 8, 4], Prot::READ).unwrap_err();
    assert!(matches!(err, PinError::NotMapped { index: 3, pfn: 8 }), "{err}");
    assert_eq!(err.errno(), libc::EINVAL);
    let err = space.pin_pages(&[1, 2, 17, 18], Prot::WRITE).unwrap_err();
    assert!(matches!(err, PinError::Permission { index: 2, pfn: 17, .. }), "{err}");
    assert_eq!(err.errno(), libc::EPERM);
    let err = space.pin_range(6 * P, 4, Prot::READ).unwrap_err();
    assert!(matches!(err, PinError::NotMapped { index: 2, pfn: 8 }), "{err}");
    assert_eq!(counts(&space, 0..24), vec![0; 24]);
    assert!(matches!(space.pin_pages(&[], Prot::READ), Err(PinError::Empty)));
    assert!(matches!(space.pin_range(u64::MAX - P + 1, 2, Prot::READ), Err(PinError::NotMapped { .. })));
    assert!(matches!(space.pin_pages(&[u64::MAX], Prot::READ), Err(PinError::NotMapped { .. })));
    assert_eq!(space.stats().pin_failures, 6);
}

/// A pin asking for no access means nothing: it is refused (EINVAL) before anything else is
/// looked at, on track mode's small-record path as on its general one and in lock mode, and
/// takes nothing; so is such a translation.
#[test]
#[cfg_attr(miri, ignore = "Miri: mlock")]
fn a_pin_asking_for_no_access_is_refused_in_every_path() {
    for mode in [PinMode::Track, PinMode::Lock] {
        let (space, _f) = space_with(DmaSpaceConfig { mode, ..Default::default() });
        let none = Prot::empty();
        let refused = [
            space.pin_pages(&[1], none),
            space.pin_pages(&[1, 5, 6, 7, 9], none),
            space.pin_pages(&(0..40).map(|p| p * 3 % 64).collect::<Vec<_>>(), none),
            space.pin_range(0, 64, none),
            // Calls that would fail anyway fail for this first.
            space.pin_pages(&[], none),
            space.pin_pages(&[100], none),
        ];
        for result in refused {
            let err = result.unwrap_err();
            assert!(matches!(err, PinError::NoAccess), "{mode}: {err}");
            assert_eq!(err.errno(), libc::EINVAL);
        }
        let stats = space.stats();
        assert_eq!((stats.pins_held, stats.pin_failures), (0, 6), "{mode}");
        assert_eq!(counts(&space, 0..64), vec![0; 64], "{mode}");
        let translated = space.translate_pages(&[1, 2], none, |_, _, _| panic!("{mode}: translated"));
        assert!(matches!(translated, Err(PinError::NoAccess)), "{mode}");
        // The same call asking for access is pinned.
        let pins = space.pin_pages(&[1, 5, 6, 7, 9], Prot::READ).unwrap();
        assert_eq!(pins.runs().len(), 3);
    }
}

/// `translate_pages` runs its callback under this thread's shard lock, which a pin of the
/// same space takes too: a callback that pins is refused with a panic (a second guard of
/// the shard would alias the first), and the space works on afterwards.
#[test]
fn a_translation_callback_that_pins_its_space_is_refused() {
    // Lock mode mlocks, which Miri cannot.
    let modes: &[PinMode] = if cfg!(miri) { &[PinMode::Track] } else { &[PinMode::Track, PinMode::Lock] };
    for &mode in modes {
        let (space, _f) = space_with(DmaSpaceConfig { mode, ..Default::default() });
        // Twice: a refusal leaves the shard's lock as it was. (Every way a thread can hold a
        // biased lock is refused in `biased/tests.rs`; here the shard is this thread's.)
        for take in ["once", "again"] {
            let reentered = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                let _ = space.translate_pages(&[1, 2], Prot::READ, |_, _, _| {
                    drop(space.pin_pages(&[3], Prot::READ));
                });
            }));
            assert!(reentered.is_err(), "{mode}, {take}: a pin inside the callback went in");
        }
        let pins = space.pin_pages(&[1, 5, 6, 7, 9], Prot::READ).unwrap();
        assert_eq!(counts(&space, [1, 3, 5]), vec![1, 0, 1], "{mode}");
        drop(pins);
        assert_eq!(space.stats().pins_held, 0, "{mode}");
    }
}

#[test]
#[cfg_attr(miri, ignore = "Miri: 70000 calls: too slow")]
fn track_mode_guards_count_past_the_per_page_limit_up_to_the_space_limit() {
    let (space, _f) = space_with(DmaSpaceConfig { max_pins: 70_000, ..Default::default() });
    let held: Vec<_> = (0..70_000).map(|_| space.pin_pages(&[4], Prot::READ).unwrap()).collect();
    assert_eq!(space.pin_count(4 * P), 70_000);
    assert!(matches!(space.pin_pages(&[4], Prot::READ), Err(PinError::PinLimit { .. })));
    drop(held);
    assert_eq!((space.pin_count(4 * P), space.stats().pins_held), (0, 0));
}

#[test]
fn the_space_wide_pin_limit_fails_calls_cleanly() {
    let (space, _f) = space_with(DmaSpaceConfig { max_pins: 10, ..Default::default() });
    let a = space.pin_range(0, 6, Prot::READ).unwrap();
    let err = space.pin_pages(&[1, 1, 2, 3, 4], Prot::READ).unwrap_err();
    assert!(matches!(err, PinError::PinLimit { requested: 5, held: 6, max: 10 }), "{err}");
    assert_eq!(err.errno(), libc::ENOSPC);
    let b = space.pin_pages(&[1, 1, 2, 3], Prot::READ).unwrap();
    drop(a);
    // Pins released by a guard, by unpin_pages and by a forgotten guard's unpin all count.
    let c = space.pin_range(0, 6, Prot::READ).unwrap();
    c.forget();
    assert!(space.pin_range(0, 1, Prot::READ).is_err());
    space.unpin_range(0, 6).unwrap();
    drop(b);
    let full = space.pin_range(0, 10, Prot::READ).unwrap();
    drop(full);
    // Track mode: unpin_range finds only kept pins, never a live guard's.
    let d = space.pin_range(0, 4, Prot::READ).unwrap();
    assert!(matches!(space.unpin_range(0, 2), Err(UnpinError::NotPinned { index: 0, pfn: 0 })));
    drop(d);
    space.pin_range(0, 10, Prot::READ).unwrap().unpin();
}

#[test]
fn too_many_pages_in_one_call() {
    let (space, _f) = space_with(DmaSpaceConfig { max_pages_per_call: 4, ..Default::default() });
    let err = space.pin_range(0, 5, Prot::READ).unwrap_err();
    assert!(matches!(err, PinError::TooManyPages { requested: 5, max: 4 }));
    assert_eq!(err.errno(), libc::E2BIG);
    assert!(matches!(space.unpin_range(0, 5), Err(UnpinError::InvalidCount(5))));
}

#[test]
fn unpin_by_array_and_range_after_forget() {
    let (space, _f) = space_with(Default::default());
    space.pin_pages(&[1, 5, 6, 7, 9], Prot::READ).unwrap().forget();
    space.pin_range(5 * P, 3, Prot::READ).unwrap().forget();
    assert_eq!(counts(&space, [1, 5, 6, 7, 9]), vec![1, 2, 2, 2, 1]);
    // [5, 5, 5] needs three pins on page 5; it holds two, so nothing changes.
    let err = space.unpin_pages(&[9, 5, 5, 5]).unwrap_err();
    assert!(matches!(err, UnpinError::NotPinned { index: 3, pfn: 5 }), "{err}");
    assert_eq!(counts(&space, [1, 5, 6, 7, 9]), vec![1, 2, 2, 2, 1]);
    assert!(matches!(space.unpin_pages(&[3]), Err(UnpinError::NotPinned { index: 0, pfn: 3 })));
    assert!(matches!(space.unpin_pages(&[100]), Err(UnpinError::NotMapped { index: 0, pfn: 100 })));
    space.unpin_pages(&[9, 1, 5, 6, 7]).unwrap();
    space.unpin_range(5 * P, 3).unwrap();
    assert_eq!(counts(&space, 0..10), vec![0; 10]);
    let stats = space.stats();
    assert_eq!((stats.unpin_calls, stats.unpin_failures), (2, 3));
}

#[test]
fn the_pin_limit_is_exact_across_threads_whatever_their_stock() {
    // Each thread keeps a stock of reserved pins; the limit must still be the limit.
    let space = DmaSpace::new(DmaSpaceConfig { max_pins: 6000, ..Default::default() });
    let file = memfd(8192);
    space.map(0, 8192 * P, file.as_fd(), 0, Prot::READ_WRITE).unwrap();
    // Thread A pins and unpins: its shard keeps (up to two stocks of) unused reservation.
    std::thread::scope(|s| {
        s.spawn(|| {
            for _ in 0..3 {
                drop(space.pin_range(0, 3000, Prot::READ).unwrap());
            }
            drop(space.pin_range(0, 1, Prot::READ).unwrap());
        });
    });
    // Thread B (this one) can still take the whole limit, and not one pin more.
    let all = space.pin_range(0, 6000, Prot::READ).unwrap();
    let err = space.pin_range(6000 * P, 1, Prot::READ).unwrap_err();
    assert!(matches!(err, PinError::PinLimit { requested: 1, held: 6000, max: 6000 }), "{err}");
    drop(all);
    let again = space.pin_range(0, 6000, Prot::READ).unwrap();
    assert_eq!(space.stats().pins_held, 6000);
    drop(again);
    assert_eq!(space.stats().pins_held, 0);
}

#[test]
fn track_mode_unpin_pages_leaves_a_live_guards_pins_alone() {
    let (space, _f) = space_with(Default::default());
    let pins = space.pin_pages(&[2, 3, 4], Prot::READ).unwrap();
    let kept = space.pin_pages(&[3], Prot::READ).unwrap();
    kept.forget();
    // The kept pin of page 3 goes; a second unpin would need the guard's: refused, and
    // nothing changes.
    assert!(matches!(space.unpin_pages(&[3, 3]), Err(UnpinError::NotPinned { index: 1, pfn: 3 })));
    assert_eq!(counts(&space, 2..5), vec![1, 2, 1]);
    space.unpin_pages(&[3]).unwrap();
    assert!(space.unpin_pages(&[2]).is_err());
    assert_eq!(counts(&space, 2..5), vec![1, 1, 1]);
    drop(pins);
    assert_eq!(counts(&space, 0..8), vec![0; 8]);
    assert_eq!(space.stats().pins_held, 0);
}

#[test]
fn a_track_guard_outlives_its_space_and_keeps_its_memory() {
    let (space, f) = space_with(Default::default());
    let pins = space.pin_pages(&[1, 5, 6], Prot::READ_WRITE).unwrap();
    let other = space.pin_pages(&[2], Prot::READ).unwrap();
    drop(space);
    drop(f);
    // The memory is still mapped: the shard keeps the space until its last record goes.
    pins.write(0, b"still here").unwrap();
    let mut buf = [0u8; 10];
    pins.read(0, &mut buf).unwrap();
    assert_eq!(&buf, b"still here");
    drop(other);
    drop(pins);
}

#[test]
fn a_closed_space_is_let_go_after_a_guard_released_without_the_lock() {
    let (space, f) = space_with(Default::default());
    let weak = Arc::downgrade(&space.inner.space);
    let pins = space.pin_pages(&[7], Prot::READ).unwrap();
    let entry = small_entry(&pins);
    // The space closes while the guard is live: its shard keeps the space...
    drop(space);
    drop(f);
    assert!(weak.upgrade().is_some());
    // ...and the guard lets go as one that looked before the close does: without the
    // lock, leaving nobody to retire the record but the reaper.
    release_unlocked(pins, entry);
    wait_gone(&weak, "the reaper never let go of the space");
}

/// The entry of a guard holding a small record.
fn small_entry(pins: &PinnedPages) -> NonNull<SmallRecord> {
    match pins.hold.view() {
        HoldView::Recorded(RecordPtr::Small(entry)) => entry,
        _ => panic!("a single page is a small record"),
    }
}

/// Lets go of `pins` (whose entry is `entry`) as a guard that found nothing to do
/// under the lock does, whatever the space and mapping look like now.
fn release_unlocked(pins: PinnedPages, entry: NonNull<SmallRecord>) {
    std::mem::forget(pins);
    // SAFETY: (I5) the entry is live (its guard was forgotten, not dropped).
    unsafe { SmallRecord::release(entry) };
}

/// Waits (5 s at most) for the last strong reference behind `weak` to go.
fn wait_gone<T>(weak: &std::sync::Weak<T>, failure: &str) {
    let deadline = Instant::now() + Duration::from_secs(5);
    while weak.upgrade().is_some() {
        assert!(Instant::now() < deadline, "{failure}");
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[test]
fn an_orphan_is_unmapped_after_a_guard_released_without_the_lock() {
    let (space, _f) = space_with(Default::default());
    let mapping = Arc::downgrade(space.read_table().values().next().unwrap());
    let pins = space.pin_pages(&[7], Prot::READ).unwrap();
    let entry = small_entry(&pins);
    // abandon_all takes the mapping while the guard is live: it becomes an orphan...
    assert_eq!(space.abandon_all().mappings, 1);
    // ...and the guard lets go as one that looked just before does: without the lock.
    release_unlocked(pins, entry);
    // Nothing else happens in the space: the reaper unmaps the orphan.
    wait_gone(&mapping, "the orphan was never let go");
    assert_eq!(space.stats().pins_held, 0);
}

#[test]
fn small_records_hold_at_most_a_stock_of_pins_per_shard() {
    let (space, _f) = space_with(Default::default());
    let big = memfd(4096);
    space.map(1 << 30, 4096 * P, big.as_fd(), 0, Prot::READ).unwrap();
    let small = |g: &PinnedPages| matches!(g.hold.view(), HoldView::Recorded(RecordPtr::Small(_)));
    // Ranges of 1024 pages: four fill the shard's share, the fifth goes in a box.
    let guards: Vec<PinnedPages> =
        (0..5).map(|_| space.pin_range(1 << 30, 1024, Prot::READ).unwrap()).collect();
    assert_eq!(guards.iter().filter(|g| small(g)).count(), 4);
    drop(guards);
    // Released, they are taken back when the shard next needs the room.
    let again: Vec<PinnedPages> =
        (0..4).map(|_| space.pin_range(1 << 30, 1024, Prot::READ).unwrap()).collect();
    assert!(again.iter().all(small));
    drop(again);
    assert_eq!(space.stats().pins_held, 0);
}

#[test]
fn single_page_guards_beyond_the_small_record_array_are_boxed_and_all_count() {
    let (space, _f) = space_with(Default::default());
    // More live single pages than the array holds, from one thread (one shard).
    drop(space.pin_pages(&[0], Prot::READ).unwrap());
    let guards: Vec<PinnedPages> =
        (0..150u64).map(|i| space.pin_pages(&[i % 64], Prot::READ).unwrap()).collect();
    let boxed = guards.iter().filter(|g| matches!(g.hold.view(), HoldView::Recorded(RecordPtr::Boxed(_))));
    assert_eq!(boxed.count(), 150 - crate::record::SMALL_RECORDS);
    assert_eq!(space.stats().pins_held, 150);
    let expect: Vec<u32> = (0..64u64).map(|p| (0..150u64).filter(|i| i % 64 == p).count() as u32).collect();
    assert_eq!(counts(&space, 0..64), expect);
    assert_eq!(guards[3].host_addr(0), space.pin_pages(&[3], Prot::READ).unwrap().host_addr(0));
    drop(guards);
    let stats = space.stats();
    assert_eq!((stats.pins_held, stats.pin_calls, stats.unpin_calls), (0, 152, 152));
    // Released entries are taken back: the array serves single pages again at once.
    let again = space.pin_pages(&[9], Prot::READ).unwrap();
    assert!(matches!(again.hold.view(), HoldView::Recorded(RecordPtr::Small(_))));
    drop(again);
    // Nothing holds the mapping: it unmaps without waiting.
    let unmapped = space.unmap(0, 64 * P).unwrap();
    assert_eq!(unmapped.mappings, 1);
    assert_eq!(space.stats().unmap_waits, 0);
}

#[test]
fn short_lists_in_one_mapping_are_small_records_with_the_same_runs() {
    let (space, f) = space_with(Default::default());
    space.map(64 * P, 8 * P, f.as_fd(), 0, Prot::READ_WRITE).unwrap();
    let small = |g: &PinnedPages| matches!(g.hold.view(), HoldView::Recorded(RecordPtr::Small(_)));
    let runs =
        |g: &PinnedPages| g.runs().iter().map(|r| (r.iova() / P, r.npages(), r.index())).collect::<Vec<_>>();
    // Eight runs fit, with their entries' positions and host addresses.
    let eight: Vec<u64> = (0..8).map(|i| i * 3).collect();
    let g = space.pin_pages(&eight, Prot::READ).unwrap();
    assert!(small(&g));
    assert_eq!(runs(&g), (0..8).map(|i| (i * 3, 1, i as usize)).collect::<Vec<_>>());
    assert_eq!(g.host_addr(5).unwrap(), g.host_addr(0).unwrap() + 15 * P as usize);
    // An IDAW-like list: runs merged as in a box.
    let idaw = space.pin_pages(&[1, 5, 6, 7, 9, 9], Prot::READ).unwrap();
    assert!(small(&idaw));
    assert_eq!(runs(&idaw), vec![(1, 1, 0), (5, 3, 1), (9, 1, 4), (9, 1, 5)]);
    assert_eq!(counts(&space, [1, 5, 9]), vec![1, 1, 3]); // 9 also in `eight`
                                                          // Nine runs, or runs in two mappings, go in a box, the same to the caller.
    let nine: Vec<u64> = (0..9).map(|i| i * 3).collect();
    let g9 = space.pin_pages(&nine, Prot::READ).unwrap();
    assert!(!small(&g9));
    assert_eq!(runs(&g9).len(), 9);
    let two = space.pin_pages(&[63, 64], Prot::READ).unwrap();
    assert!(!small(&two));
    assert_eq!(runs(&two), vec![(63, 1, 0), (64, 1, 1)]);
    // A range inside one mapping is one small run; one crossing mappings is boxed.
    let r = space.pin_range(2 * P, 40, Prot::READ).unwrap();
    assert!(small(&r));
    assert_eq!(runs(&r), vec![(2, 40, 0)]);
    let across = space.pin_range(60 * P, 8, Prot::READ).unwrap();
    assert!(!small(&across));
    assert_eq!(runs(&across), vec![(60, 4, 0), (64, 4, 4)]);
    assert_eq!(space.stats().pins_held, 8 + 6 + 9 + 2 + 40 + 8);
    drop((g, idaw, g9, two, r, across));
    assert_eq!(space.stats().pins_held, 0);
    assert_eq!(counts(&space, 0..72), vec![0; 72]);
}

#[test]
fn abandoned_mappings_stay_mapped_under_track_guards() {
    let (space, _f) = space_with(Default::default());
    let pins = space.pin_pages(&[3, 4], Prot::READ_WRITE).unwrap();
    assert_eq!(space.abandon_all().mappings, 1);
    assert!(space.pin_pages(&[3], Prot::READ).is_err());
    pins.write(4000, &[7; 300]).unwrap();
    assert_eq!(space.stats().pins_held, 2);
    drop(pins);
    assert_eq!(space.stats().pins_held, 0);
}

#[test]
fn overlapping_runs_from_many_threads_count_per_page_and_hold_an_unmap() {
    // More threads than shards, so shards are shared; every call overlaps the others. The
    // unmap below waits as long as the dropping thread takes, however loaded the machine.
    let (space, _f) =
        space_with(DmaSpaceConfig { unmap_timeout: Duration::from_secs(60), ..Default::default() });
    let guards: Vec<PinnedPages> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..40u64)
            .map(|t| {
                let space = &space;
                s.spawn(move || space.pin_pages(&[t % 8, t % 8 + 1, t % 8 + 2, 20], Prot::READ).unwrap())
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert_eq!(space.pin_count(20 * P), 40);
    let expect: Vec<u32> =
        (0..10u64).map(|p| (0..40u64).filter(|t| (t % 8..t % 8 + 3).contains(&p)).count() as u32).collect();
    assert_eq!(counts(&space, 0..10), expect);
    assert_eq!(space.stats().pins_held, 160);
    assert_eq!(space.stats().pinned_pages, 11);
    // An unmap waits for them, and goes once the last guard drops on another thread.
    let space2 = space.clone();
    let dropper = std::thread::spawn(move || {
        std::thread::sleep(std::time::Duration::from_millis(50));
        drop(guards);
    });
    let started = std::time::Instant::now();
    space2.unmap(0, 64 * P).unwrap();
    assert!(started.elapsed() >= std::time::Duration::from_millis(40));
    dropper.join().unwrap();
    assert_eq!(space.stats().pins_held, 0);
}

#[test]
fn a_kept_run_can_be_unpinned_in_pieces_and_a_guard_on_it_is_untouched() {
    let (space, _f) = space_with(Default::default());
    let kept = space.pin_range(2 * P, 6, Prot::READ).unwrap();
    kept.forget();
    let guard = space.pin_pages(&[4, 5], Prot::READ).unwrap();
    space.unpin_pages(&[4, 5, 6]).unwrap(); // the middle of the kept run
    assert_eq!(counts(&space, 2..8), vec![1, 1, 1, 1, 0, 1]);
    // The guard's pins of 4 and 5 are not the kept ones: refused, nothing changes.
    assert!(matches!(space.unpin_pages(&[2, 4]), Err(UnpinError::NotPinned { index: 1, pfn: 4 })));
    space.unpin_range(2 * P, 2).unwrap();
    space.unpin_pages(&[7]).unwrap();
    assert_eq!(counts(&space, 2..8), vec![0, 0, 1, 1, 0, 0]);
    drop(guard);
    assert_eq!(space.stats().pins_held, 0);
    space.unmap(0, 64 * P).unwrap();
}

/// Runs `f` on a thread; false if it has not finished within `secs`.
fn finishes_within(secs: u64, f: impl FnOnce() + Send + 'static) -> bool {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        f();
        let _ = tx.send(());
    });
    rx.recv_timeout(std::time::Duration::from_secs(secs)).is_ok()
}

fn is_mapped(addr: usize) -> bool {
    // SAFETY: (local) msync only asks the kernel about the range; it fails with ENOMEM if unmapped.
    unsafe { libc::msync(addr as *mut libc::c_void, P as usize, libc::MS_ASYNC) == 0 }
}

#[test]
#[cfg_attr(miri, ignore = "Miri: 65535 calls: too slow")]
fn forgetting_onto_a_saturated_page_neither_hangs_nor_frees_the_pins() {
    let space = DmaSpace::new(DmaSpaceConfig {
        max_pins: 1 << 20,
        unmap_timeout: std::time::Duration::from_millis(50),
        ..Default::default()
    });
    let file = memfd(64);
    space.map(0, 64 * P, file.as_fd(), 0, Prot::READ_WRITE).unwrap();
    for _ in 0..crate::MAX_PIN_COUNT {
        space.pin_pages(&[9], Prot::READ).unwrap().forget();
    }
    // Page 5 is counted, then page 9 overflows: the undo relocks page 5's mapping.
    let guard = space.pin_pages(&[5, 9], Prot::READ).unwrap();
    assert!(finishes_within(5, move || guard.forget()), "forget() deadlocked");
    // As documented: those pins stay held, so the memory is never unmapped under them.
    assert_eq!(space.pin_count(5 * P), 1);
    assert!(matches!(space.unmap(0, 64 * P), Err(crate::UnmapError::Busy { .. })));
}

#[test]
#[cfg_attr(miri, ignore = "Miri: mlock, 2000 mappings")]
fn abandon_all_racing_an_unmap_that_waits_deadlocks_in_neither_mode() {
    for mode in [PinMode::Lock, PinMode::Track] {
        const N: u64 = 2000;
        for attempt in 0..3u64 {
            let space = DmaSpace::new(DmaSpaceConfig {
                mode,
                account: Arc::new(LockAccount::unlimited()),
                max_mappings: N as usize + 1,
                unmap_timeout: std::time::Duration::from_secs(30),
                ..Default::default()
            });
            let file = memfd(N);
            for i in 0..N {
                space.map(i * P, P, file.as_fd(), i * P, Prot::READ_WRITE).unwrap();
            }
            let guard = space.pin_pages(&[N - 1], Prot::READ).unwrap();
            let u = {
                let s = space.clone();
                std::thread::spawn(move || s.unmap(0, N * P).map(|u| u.mappings))
            };
            std::thread::sleep(std::time::Duration::from_millis(100)); // the unmap waits for the guard
            let a = {
                let s = space.clone();
                std::thread::spawn(move || s.abandon_all().mappings)
            };
            while !space.mappings().is_empty() {
                std::hint::spin_loop();
            }
            std::thread::sleep(std::time::Duration::from_micros(50 * attempt));
            drop(guard);
            let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
            while !(u.is_finished() && a.is_finished()) {
                assert!(
                    std::time::Instant::now() < deadline,
                    "{mode:?} #{attempt}: unmap {} abandon {}",
                    u.is_finished(),
                    a.is_finished()
                );
                std::thread::sleep(std::time::Duration::from_millis(5));
            }
        }
    }
}

#[test]
#[cfg_attr(miri, ignore = "Miri: mlock, msync")]
fn an_abandoned_mapping_is_unmapped_when_its_last_guard_drops() {
    for mode in [PinMode::Lock, PinMode::Track] {
        let space = DmaSpace::new(DmaSpaceConfig {
            mode,
            account: Arc::new(LockAccount::unlimited()),
            ..Default::default()
        });
        let file = memfd(4);
        space.map(0, 4 * P, file.as_fd(), 0, Prot::READ_WRITE).unwrap();
        let pins = space.pin_pages(&[1], Prot::READ).unwrap();
        let host = pins.host_addr(0).unwrap();
        space.abandon_all();
        assert!(is_mapped(host), "{mode:?}: unmapped under a guard");
        if mode == PinMode::Track {
            // (Lock-mode guards keep abandoned mappings themselves; the space's totals
            // then leave them out.)
            assert_eq!((space.stats().pins_held, space.stats().pinned_pages), (1, 1));
        }
        drop(pins);
        assert!(!is_mapped(host), "{mode:?}: still mapped after its last guard");
        assert_eq!(space.stats().pins_held, 0);
    }
}

#[test]
#[cfg_attr(miri, ignore = "Miri: mlock")]
fn both_modes_report_the_pin_limit_before_an_unmapping_mapping() {
    let mut seen = Vec::new();
    for mode in [PinMode::Lock, PinMode::Track] {
        let space = DmaSpace::new(DmaSpaceConfig {
            mode,
            account: Arc::new(LockAccount::unlimited()),
            max_pins: 2,
            unmap_timeout: std::time::Duration::from_millis(20),
            ..Default::default()
        });
        let file = memfd(8);
        space.map(0, 8 * P, file.as_fd(), 0, Prot::READ_WRITE).unwrap();
        let held = space.pin_range(0, 2, Prot::READ).unwrap();
        let got = Arc::new(std::sync::Mutex::new(String::new()));
        let (weak, g) = (Arc::downgrade(&space.inner), got.clone());
        space.set_unmap_notifier(Some(Arc::new(move |_, _| {
            let space = DmaSpace { inner: weak.upgrade().expect("the space lives") };
            *g.lock().unwrap() = format!("{:?}", space.pin_pages(&[5], Prot::READ).map(|_| ()));
        })));
        let _ = space.unmap(0, 8 * P);
        space.set_unmap_notifier(None);
        seen.push(got.lock().unwrap().clone());
        drop(held);
    }
    assert_eq!(seen[0], seen[1]);
    assert!(seen[0].contains("PinLimit"), "{seen:?}");
}

#[test]
fn volatile_copies_cross_runs() {
    let (space, _f) = space_with(Default::default());
    let pins = space.pin_pages(&[3, 9, 10], Prot::READ_WRITE).unwrap();
    let mut buf = vec![0u8; 3 * P as usize];
    // SAFETY: (local) buf outlives the slice and nothing else touches it meanwhile.
    let store = unsafe { VolatileSlice::new(buf.as_mut_ptr(), buf.len()) };
    store.subslice(100, 8200).unwrap().copy_from(&[7u8; 8200]);
    pins.write_volatile(100, &store.subslice(100, 8200).unwrap()).unwrap();
    let mut back = vec![0u8; 8200];
    pins.read(100, &mut back).unwrap();
    assert_eq!(back, vec![7u8; 8200]);
    // SAFETY: (local) as above.
    let out = unsafe { VolatileSlice::new(buf.as_mut_ptr(), 16) };
    pins.read_volatile(P - 8, &out).unwrap();
    assert_eq!(&buf[..16], &[7u8; 16]);
    assert!(pins.read_volatile(3 * P - 8, &out).is_err(), "past the end");
    let ro = space.pin_pages(&[3], Prot::READ).unwrap();
    assert_eq!(ro.write_volatile(0, &out), Err(AccessError::ReadOnly));
}

#[test]
#[cfg_attr(miri, ignore = "Miri: reads the file back")]
fn a_slice_is_one_host_range_inside_a_run_or_host_adjacent_runs() {
    use vm_memory::Bytes;
    let (space, file) = space_with(Default::default());
    // Pages 3 and 4 are one run; page 8 is another, not next to 4 in host memory.
    let rw = space.pin_pages(&[3, 4, 8], Prot::READ_WRITE).unwrap();
    let s = rw.slice(P - 8, 16, Prot::WRITE).unwrap();
    s.write_slice(b"0123456789abcdef", 0).unwrap();
    let mut b = [0u8; 16];
    std::os::unix::fs::FileExt::read_exact_at(&file, &mut b, 4 * P - 8).unwrap();
    assert_eq!(&b, b"0123456789abcdef", "one slice across a page boundary inside a run");
    assert_eq!(
        rw.slice(P - 8, 16, Prot::READ).unwrap().read_obj::<u64>(8).unwrap(),
        u64::from_le_bytes(*b"89abcdef")
    );
    assert_eq!(
        rw.slice(2 * P - 8, 16, Prot::READ).unwrap_err(),
        AccessError::NotContiguous { offset: 2 * P - 8, len: 16 },
        "pages 4 and 8 are apart in host memory"
    );
    assert!(matches!(rw.slice(3 * P - 8, 16, Prot::READ), Err(AccessError::OutOfRange { .. })));
    assert_eq!(rw.slice(5, 0, Prot::READ).unwrap().len(), 0);
    let ro = space.pin_pages(&[3], Prot::READ).unwrap();
    assert_eq!(ro.slice(0, 8, Prot::WRITE).unwrap_err(), AccessError::ReadOnly);
    assert_eq!(ro.slice(0, 8, Prot::READ).unwrap().len(), 8);
}

#[test]
#[cfg_attr(miri, ignore = "Miri: reads the file back")]
fn guards_check_bounds_and_access() {
    let (space, file) = space_with(Default::default());
    let ro = space.pin_pages(&[3], Prot::READ).unwrap();
    assert_eq!(ro.write(0, b"x"), Err(AccessError::ReadOnly));
    let rw = space.pin_pages(&[3, 8], Prot::READ_WRITE).unwrap();
    assert_eq!(rw.size(), 2 * P);
    assert!(matches!(rw.write(2 * P - 1, b"xy"), Err(AccessError::OutOfRange { .. })));
    assert!(matches!(rw.read(u64::MAX, &mut [0u8; 2]), Err(AccessError::OutOfRange { .. })));
    rw.write(P - 1, b"xy").unwrap();
    let mut b = [0u8; 1];
    std::os::unix::fs::FileExt::read_exact_at(&file, &mut b, 4 * P - 1).unwrap();
    assert_eq!(&b, b"x");
    std::os::unix::fs::FileExt::read_exact_at(&file, &mut b, 8 * P).unwrap();
    assert_eq!(&b, b"y");
    let mut back = [0u8; 2];
    rw.read(P - 1, &mut back).unwrap();
    assert_eq!(&back, b"xy");
}
