use std::os::fd::AsFd;
use std::sync::atomic::AtomicU64;

use super::*;
use crate::mmap::MmapError;
use crate::testutil::memfd;
use crate::PinError;

const RW: Prot = Prot::READ_WRITE;

#[test]
#[cfg_attr(miri, ignore = "Miri: maps no file")]
fn map_rejects_bad_requests_with_distinct_errors() {
    let space = DmaSpace::new(DmaSpaceConfig { max_mappings: 2, ..Default::default() });
    let file = memfd(16);
    let fd = file.as_fd();
    let p = PAGE_SIZE;
    assert!(matches!(space.map(0, 0, fd, 0, RW), Err(MapError::ZeroSize)));
    assert!(matches!(space.map(1, p, fd, 0, RW), Err(MapError::Unaligned { .. })));
    assert!(matches!(space.map(0, p + 1, fd, 0, RW), Err(MapError::Unaligned { .. })));
    assert!(matches!(space.map(0, p, fd, 1, RW), Err(MapError::Unaligned { .. })));
    assert!(matches!(space.map(0, p, fd, 0, Prot::empty()), Err(MapError::NoAccess)));
    assert!(matches!(space.map(u64::MAX - p + 1, 2 * p, fd, 0, RW), Err(MapError::IovaWraps { .. })));
    assert!(matches!(space.map(0, 2 * p, fd, u64::MAX - p + 1, RW), Err(MapError::OffsetWraps { .. })));
    assert!(matches!(
        space.map(0, 17 * p, fd, 0, RW),
        Err(MapError::Backing(MmapError::PastEndOfFile { .. }))
    ));
    let (pipe, _w) = nix::unistd::pipe().unwrap();
    assert!(matches!(
        space.map(0, p, pipe.as_fd(), 0, RW),
        Err(MapError::Backing(MmapError::NotRegularFile { .. }))
    ));
    space.map(4 * p, 4 * p, fd, 0, RW).unwrap();
    // Overlap at the start, the end, inside and around.
    for (iova, size) in [(2 * p, 3 * p), (7 * p, 2 * p), (5 * p, p), (0, 16 * p)] {
        let err = space.map(iova, size, fd, 0, RW).unwrap_err();
        assert!(matches!(err, MapError::Overlap { existing_iova, .. } if existing_iova == 4 * p), "{err}");
        assert_eq!(err.errno(), libc::EEXIST);
    }
    // Touching neighbours are fine; then the count limit bites.
    space.map(8 * p, p, fd, 0, RW).unwrap();
    let err = space.map(0, 4 * p, fd, 0, RW).unwrap_err();
    assert!(matches!(err, MapError::TooManyMappings { max: 2 }), "{err}");
    assert_eq!(err.errno(), libc::ENOSPC);
    // The last page of the IOVA space is mappable.
    let space = DmaSpace::default();
    space.map(u64::MAX - p + 1, p, fd, 0, RW).unwrap();
    assert!(space.lookup(u64::MAX).is_some());
}

#[test]
fn pin_counts_look_only_at_runs_of_the_page_s_own_mapping() {
    // Track-mode guards' runs in a lower mapping must not be measured against a higher one.
    let space = DmaSpace::default();
    let file = memfd(8);
    space.map(0, 4 * PAGE_SIZE, file.as_fd(), 0, RW).unwrap();
    space.map(1 << 40, 4 * PAGE_SIZE, file.as_fd(), 4 * PAGE_SIZE, RW).unwrap();
    let low = space.pin_pages(&[1, 2, 3], Prot::READ).unwrap();
    let high = space.pin_range((1 << 40) + PAGE_SIZE, 2, Prot::READ).unwrap();
    let counts: Vec<u32> = (0..4).map(|p| space.pin_count((1 << 40) + p * PAGE_SIZE)).collect();
    assert_eq!(counts, [0, 1, 1, 0]);
    assert_eq!(space.pin_count(0), 0);
    drop((low, high));
}

#[test]
fn pages_per_call_stop_at_what_a_run_records() {
    let space = DmaSpace::new(DmaSpaceConfig { max_pages_per_call: u64::MAX, ..Default::default() });
    assert_eq!(space.config().max_pages_per_call, u64::from(u32::MAX));
    let err = space.pin_range(0, 1 << 32, Prot::READ).unwrap_err();
    assert!(matches!(err, PinError::TooManyPages { requested: 4294967296, max: 4294967295 }), "{err}");
}

#[test]
#[cfg_attr(miri, ignore = "Miri: 64 GiB")]
fn map_is_lazy_whatever_the_size() {
    let huge = memfd(64 << 18); // 64 GiB, sparse
    let space = DmaSpace::default();
    space.map(1 << 40, 64 << 30, huge.as_fd(), 0, RW).unwrap();
    let stats = space.stats();
    assert_eq!(stats.bookkeeping_bytes, 0);
    assert_eq!(stats.mapped_bytes, 64 << 30);
    // Pinning one page allocates one shard's small-record array (19 KiB, a track-mode call) or one
    // chunk of counts, nothing per page of the mapping.
    let last = (1u64 << 40) + (64 << 30) - PAGE_SIZE;
    let pins = space.pin_range(last, 1, Prot::READ).unwrap();
    let bytes = space.stats().bookkeeping_bytes;
    assert!(bytes > 0 && bytes <= 20 << 10, "{bytes}");
    drop(pins);
    space.unmap(1 << 40, 64 << 30).unwrap();
}

#[test]
fn unmap_takes_whole_mappings_only() {
    let space = DmaSpace::default();
    let file = memfd(16);
    let p = PAGE_SIZE;
    space.map(0, 4 * p, file.as_fd(), 0, RW).unwrap();
    space.map(4 * p, 4 * p, file.as_fd(), 0, RW).unwrap();
    space.map_message_only(16 * p, 4 * p, Prot::READ).unwrap();
    assert!(matches!(space.unmap(0, 0), Err(UnmapError::InvalidRange { .. })));
    assert!(matches!(space.unmap(1, p), Err(UnmapError::InvalidRange { .. })));
    assert!(matches!(space.unmap(u64::MAX - p + 1, 2 * p), Err(UnmapError::InvalidRange { .. })));
    let err = space.unmap(32 * p, p).unwrap_err();
    assert!(matches!(err, UnmapError::NotMapped { .. }));
    assert_eq!(err.errno(), libc::ENOENT);
    assert!(matches!(space.unmap(p, 4 * p), Err(UnmapError::SplitsMapping { mapping_iova: 0, .. })));
    assert!(matches!(space.unmap(2 * p, 2 * p), Err(UnmapError::SplitsMapping { mapping_iova: 0, .. })));
    assert_eq!(space.mappings().len(), 3);
    // One range covering two whole mappings.
    assert_eq!(space.unmap(0, 8 * p).unwrap(), Unmapped { mappings: 2, bytes: 8 * p });
    assert_eq!(space.unmap_all().unwrap(), Unmapped { mappings: 1, bytes: 4 * p });
    assert!(space.mappings().is_empty());
    assert_eq!(space.unmap_all().unwrap(), Unmapped::default());
}

#[test]
fn message_only_regions_are_known_but_not_pinnable() {
    let space = DmaSpace::default();
    space.map_message_only(0xc0000, 0x20000, Prot::READ).unwrap();
    let info = space.lookup(0xc1234).unwrap();
    assert!(!info.has_memory);
    assert_eq!(info.iova, 0xc0000);
    let err = space.pin_range(0xc0000, 1, Prot::READ).unwrap_err();
    assert!(matches!(err, PinError::NoHostMemory { index: 0, .. }), "{err}");
    let file = memfd(1);
    assert!(matches!(space.map(0xc8000, PAGE_SIZE, file.as_fd(), 0, RW), Err(MapError::Overlap { .. })));
}

#[test]
fn unmap_notifies_and_waits_for_pins_to_drop() {
    // The unmap waits as long as the dropping thread takes, however loaded the machine.
    let space =
        DmaSpace::new(DmaSpaceConfig { unmap_timeout: Duration::from_secs(60), ..Default::default() });
    let file = memfd(8);
    space.map(0x100000, 8 * PAGE_SIZE, file.as_fd(), 0, RW).unwrap();
    let held = Arc::new(Mutex::new(Some(space.pin_range(0x102000, 2, Prot::READ).unwrap())));
    let calls = Arc::new(Mutex::new(Vec::new()));
    let refused = Arc::new(AtomicU64::new(0));
    let notifier: UnmapNotifier = {
        let (held, calls, refused) = (held.clone(), calls.clone(), refused.clone());
        let weak = Arc::downgrade(&space.inner);
        Arc::new(move |iova, len| {
            calls.lock().unwrap().push((iova, len));
            // While the unmap waits, no new pins are granted in the range.
            let space = DmaSpace { inner: weak.upgrade().unwrap() };
            if let Err(PinError::Unmapping { .. }) = space.pin_range(0x100000, 1, Prot::READ) {
                refused.fetch_add(1, Ordering::Relaxed);
            }
            // Drop the pins from another thread, a little later, as a device would.
            let held = held.clone();
            std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(20));
                held.lock().unwrap().take();
            });
        })
    };
    space.set_unmap_notifier(Some(notifier));
    space.unmap(0x100000, 8 * PAGE_SIZE).unwrap();
    assert_eq!(*calls.lock().unwrap(), vec![(0x100000, 8 * PAGE_SIZE)]);
    assert_eq!(refused.load(Ordering::Relaxed), 1);
    assert!(space.lookup(0x100000).is_none());
    let stats = space.stats();
    assert_eq!((stats.unmap_waits, stats.unmap_busy, stats.notifier_calls), (1, 0, 1));
}

#[test]
#[cfg_attr(miri, ignore = "Miri: mlock")]
fn an_unmap_waiting_for_pins_returns_when_they_drop_not_at_its_timeout_in_both_modes() {
    for mode in [PinMode::Track, PinMode::Lock] {
        let space = DmaSpace::new(DmaSpaceConfig {
            mode,
            account: Arc::new(LockAccount::unlimited()),
            unmap_timeout: Duration::from_secs(60),
            ..Default::default()
        });
        let file = memfd(8);
        space.map(0, 8 * PAGE_SIZE, file.as_fd(), 0, RW).unwrap();
        let guard = space.pin_pages(&[1, 2, 5], Prot::READ).unwrap();
        let kept = space.pin_range(3 * PAGE_SIZE, 2, Prot::READ).unwrap();
        kept.forget();
        let start = Instant::now();
        std::thread::scope(|s| {
            s.spawn(|| {
                std::thread::sleep(Duration::from_millis(20));
                drop(guard);
                std::thread::sleep(Duration::from_millis(20));
                space.unpin_range(3 * PAGE_SIZE, 2).unwrap();
            });
            space.unmap(0, 8 * PAGE_SIZE).unwrap();
        });
        // Woken by the last drop (or its next look, a millisecond on), never the timeout.
        assert!(start.elapsed() < Duration::from_secs(30), "{mode}: {:?}", start.elapsed());
        assert!(space.lookup(0).is_none());
        assert_eq!(space.stats().pins_held, 0);
    }
}

#[test]
fn unmap_fails_busy_and_keeps_the_mapping_when_pins_stay() {
    let space =
        DmaSpace::new(DmaSpaceConfig { unmap_timeout: Duration::from_millis(30), ..Default::default() });
    let file = memfd(8);
    space.map(0, 4 * PAGE_SIZE, file.as_fd(), 0, RW).unwrap();
    space.map(4 * PAGE_SIZE, 4 * PAGE_SIZE, file.as_fd(), 0, RW).unwrap();
    let pins = space.pin_range(PAGE_SIZE, 1, Prot::WRITE).unwrap();
    let err = space.unmap_all().unwrap_err();
    assert!(matches!(err, UnmapError::Busy { iova: 0, pins: 1, .. }), "{err}");
    assert_eq!(err.errno(), libc::EBUSY);
    // Nothing was removed, not even the idle mapping, and pins are granted again.
    assert_eq!(space.mappings().len(), 2);
    pins.write(0, b"still mapped").unwrap();
    space.pin_range(5 * PAGE_SIZE, 1, Prot::READ).unwrap().unpin();
    drop(pins);
    assert_eq!(space.unmap_all().unwrap().mappings, 2);
    assert_eq!(space.stats().unmap_busy, 1);
}

#[test]
#[cfg_attr(miri, ignore = "Miri: reads the file back")]
fn a_guard_keeps_memory_mapped_after_abandon() {
    let space = DmaSpace::default();
    let file = memfd(2);
    space.map(0, 2 * PAGE_SIZE, file.as_fd(), 0, RW).unwrap();
    let pins = space.pin_range(0, 2, Prot::READ_WRITE).unwrap();
    assert_eq!(space.abandon_all().mappings, 1);
    assert!(space.mappings().is_empty());
    // The guard still reaches its memory, and still unpins cleanly.
    pins.write(PAGE_SIZE, b"x").unwrap();
    drop(pins);
    let mut b = [0u8];
    std::os::unix::fs::FileExt::read_exact_at(&file, &mut b, PAGE_SIZE).unwrap();
    assert_eq!(&b, b"x");
}

#[test]
fn an_unmap_whose_notifier_panics_leaves_the_mapping_live() {
    let space = DmaSpace::new(DmaSpaceConfig::default());
    let file = memfd(4);
    space.map(0x100000, 4 * PAGE_SIZE, file.as_fd(), 0, RW).unwrap();
    let pin = space.pin_range(0x100000, 1, Prot::READ).unwrap();
    space.set_unmap_notifier(Some(Arc::new(|_, _| panic!("a notifier that panics"))));
    let unmap =
        std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| space.unmap(0x100000, 4 * PAGE_SIZE)));
    assert!(unmap.is_err(), "the notifier's panic reaches the caller");
    // Live again: pins are granted, and once the pins drop an unmap goes through.
    drop(space.pin_range(0x101000, 1, Prot::READ).unwrap());
    drop(pin);
    space.set_unmap_notifier(None);
    space.unmap(0x100000, 4 * PAGE_SIZE).unwrap();
}

/// A space holds at most `max_mapped_bytes` of fd-backed mappings; message-only ones take no
/// address space and are not counted; an unmap gives the room back.
#[test]
#[cfg_attr(miri, ignore = "Miri: maps no file")]
fn a_space_maps_at_most_its_bytes_with_an_fd() {
    let p = PAGE_SIZE;
    let space = DmaSpace::new(DmaSpaceConfig { max_mapped_bytes: 4 * p, ..Default::default() });
    let file = memfd(8);
    let fd = file.as_fd();
    space.map(0, 3 * p, fd, 0, RW).unwrap();
    let err = space.map(16 * p, 2 * p, fd, 0, RW).unwrap_err();
    assert!(
        matches!(err, MapError::TooManyBytes { size, held, max } if size == 2 * p && held == 3 * p && max == 4 * p),
        "{err}"
    );
    assert_eq!(err.errno(), libc::ENOMEM);
    space.map(16 * p, p, fd, 0, RW).unwrap();
    space.map_message_only(32 * p, 64 * p, RW).unwrap();
    space.unmap(0, 3 * p).unwrap();
    space.map(16 * p + p, 3 * p, fd, 0, RW).unwrap();
    assert_eq!(space.stats().mapped_bytes, 68 * p);
    // Abandoned while a pin keeps it mapped, a mapping still counts, until the pin goes.
    let guard = space.pin_pages(&[18], RW).unwrap();
    space.abandon_all();
    assert!(
        matches!(space.map(0, 2 * p, fd, 0, RW), Err(MapError::TooManyBytes { held, .. }) if held == 3 * p)
    );
    space.map(0, p, fd, 0, RW).unwrap();
    drop(guard);
    space.map(8 * p, 3 * p, fd, 0, RW).unwrap();
}
