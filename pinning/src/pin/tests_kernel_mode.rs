//! Kernel mode's tests: one kernel registration per call, a buffer per run, the guard's
//! accessor into the registered buffers (used for a real `READ_FIXED`), the limits, kept
//! buffers, unmaps. All need io_uring: none runs under Miri. The process's `VmPin`, which
//! other tests of this binary move too, is checked in `tests/kernel_pins.rs`.

use std::os::fd::{AsFd, AsRawFd};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use crate::testutil::memfd;
use crate::{DmaSpace, DmaSpaceConfig, PinError, PinMode, Prot, UnmapError, PAGE_SIZE};

const P: u64 = PAGE_SIZE;

fn kernel_space(buffers: u32) -> DmaSpace {
    DmaSpace::try_new(DmaSpaceConfig {
        mode: PinMode::Kernel,
        kernel_buffers: buffers,
        unmap_timeout: Duration::from_millis(50),
        ..Default::default()
    })
    .expect("kernel mode starts here (io_uring buffer registration)")
}

fn held(space: &DmaSpace) -> (u64, u64) {
    let s = space.stats();
    (s.kernel_buffers_held, s.kernel_pages_held)
}

#[test]
#[cfg_attr(miri, ignore = "Miri: io_uring")]
fn a_call_is_one_kernel_registration_with_a_buffer_per_run() {
    let space = kernel_space(64);
    let file = memfd(16);
    space.map(0x10000, 16 * P, file.as_fd(), 0, Prot::READ_WRITE).unwrap();
    let base = 0x10;
    let pins = space.pin_pages(&[base + 1, base + 5, base + 6, base + 7, base + 9], Prot::READ).unwrap();
    assert_eq!(pins.runs().len(), 3);
    let s = space.stats();
    assert_eq!((s.kernel_pin_calls, s.kernel_buffers, s.kernel_pages, s.kernel_cut_runs), (1, 3, 5, 0));
    assert_eq!(held(&space), (3, 5));
    assert_eq!((s.pin_calls, s.runs, s.pages, s.pins_held), (1, 3, 5, 5));
    assert_eq!(space.pin_count(0x16000), 1);

    // Entry k's byte: the buffer of its run, at its place in it.
    let first = pins.registered_buffer(0).unwrap();
    let second = pins.registered_buffer(P + 100).unwrap();
    let last = pins.registered_buffer(4 * P + 5).unwrap();
    assert_eq!((first.offset, first.len), (0, P));
    assert_eq!((second.index, second.offset, second.len), (first.index + 1, 100, 3 * P - 100));
    assert_eq!(second.addr, pins.host_addr(1).unwrap() + 100);
    assert_eq!((last.index, last.offset, last.len), (first.index + 2, 5, P - 5));
    assert_eq!(pins.registered_buffer(5 * P), None, "past the pinned bytes");

    // A page pinned again is pinned again by the kernel (a buffer each).
    let again = space.pin_range(0x11000, 2, Prot::WRITE).unwrap();
    assert_eq!(held(&space), (4, 7));
    drop(pins);
    assert_eq!(held(&space), (1, 2));
    drop(again);
    let s = space.stats();
    assert_eq!((s.kernel_buffers_held, s.kernel_pages_held, s.kernel_unpin_calls), (0, 0, 2));
    assert_eq!((s.unpin_calls, s.pins_held), (2, 0));
}

#[test]
#[cfg_attr(miri, ignore = "Miri: io_uring")]
fn a_fixed_buffer_read_lands_in_the_pinned_pages() {
    use io_uring::{opcode, types, IoUring};

    let space = kernel_space(16);
    let guest = memfd(8);
    space.map(0, 8 * P, guest.as_fd(), 0, Prot::READ_WRITE).unwrap();
    // The pin asks only to be written by a device: the kernel pinned the pages for writing.
    let pins = space.pin_pages(&[2, 3, 6], Prot::WRITE).unwrap();
    let source = memfd(4);
    let data: Vec<u8> = (0..3 * P as usize).map(|i| (i % 251) as u8).collect();
    std::os::unix::fs::FileExt::write_all_at(&source, &data, 0).unwrap();

    // The device's own ring gets the guard's buffers as its slots 0 and 1.
    let mut ring = IoUring::new(4).unwrap();
    let first = pins.registered_buffer(0).unwrap();
    let src = space.kernel_ring_fd().unwrap().as_raw_fd();
    ring.submitter()
        .register_buffers_clone_offset(src, first.index, 0, 2, types::CloneBuffersFlags::empty())
        .unwrap();
    // Read the file's 3 pages into the guard's buffer: 2 pages into its first run's buffer,
    // then 1 page into the second's.
    let mut done = 0u64;
    for (slot, k) in [(0u16, 0u64), (1, 2 * P)] {
        let at = pins.registered_buffer(k).unwrap();
        assert_eq!(at.index - first.index, u32::from(slot));
        let read =
            opcode::ReadFixed::new(types::Fd(source.as_raw_fd()), at.addr as *mut u8, at.len as u32, slot)
                .offset(k)
                .build()
                .user_data(u64::from(slot));
        // SAFETY: (I13, I17) the buffer is the guard's pinned memory, which lives until after the
        // completion is reaped below.
        unsafe { ring.submission().push(&read).unwrap() };
        ring.submit_and_wait(1).unwrap();
        let cqe = ring.completion().next().unwrap();
        assert_eq!(cqe.result(), at.len as i32, "READ_FIXED into slot {slot}");
        done += at.len;
    }
    assert_eq!(done, 3 * P);
    let mut back = vec![0u8; 3 * P as usize];
    pins.read(0, &mut back).unwrap();
    assert!(back == data, "the device read landed in the pinned pages");
    drop(ring);
    drop(pins);
    assert_eq!(held(&space), (0, 0));
}

#[test]
#[cfg_attr(miri, ignore = "Miri: io_uring")]
fn a_read_only_mapping_takes_no_kernel_pins() {
    let space = kernel_space(16);
    let file = memfd(4);
    space.map(0, 4 * P, file.as_fd(), 0, Prot::READ).unwrap();
    match space.pin_pages(&[1], Prot::READ) {
        Err(PinError::Permission { index: 0, pfn: 1, wanted, have }) => {
            assert_eq!((wanted, have), (Prot::READ_WRITE, Prot::READ));
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(space.stats().pin_failures, 1);
    assert_eq!(held(&space), (0, 0));
}

#[test]
#[cfg_attr(miri, ignore = "Miri: io_uring")]
fn a_full_table_refuses_a_call_whole() {
    let space = kernel_space(4);
    let file = memfd(32);
    space.map(0, 32 * P, file.as_fd(), 0, Prot::READ_WRITE).unwrap();
    let three = space.pin_pages(&[0, 2, 4], Prot::READ).unwrap();
    match space.pin_pages(&[10, 12], Prot::READ) {
        Err(PinError::KernelBuffers { requested: 2, free: 1, size: 4 }) => {}
        other => panic!("{other:?}"),
    }
    assert_eq!(space.pin_count(10 * P), 0, "nothing of the refused call is held");
    let one = space.pin_range(16 * P, 8, Prot::READ).unwrap();
    assert_eq!(held(&space), (4, 11));
    drop(three);
    let again = space.pin_pages(&[1, 3, 5], Prot::READ).unwrap();
    assert_eq!(held(&space), (4, 11), "slots come back as guards drop");
    drop((one, again));
    let four = space.pin_pages(&[0, 2, 4, 6], Prot::READ).unwrap();
    assert_eq!(held(&space), (4, 4));
    drop(four);
    let s = space.stats();
    assert_eq!((s.kernel_buffers_held, s.pin_failures, s.pin_calls), (0, 1, 4));
}

#[test]
#[cfg_attr(miri, ignore = "Miri: io_uring")]
fn a_forgotten_buffer_goes_with_its_last_unpinned_page() {
    let space = kernel_space(16);
    let file = memfd(8);
    space.map(0, 8 * P, file.as_fd(), 0, Prot::READ_WRITE).unwrap();
    space.pin_range(0, 4, Prot::READ).unwrap().forget();
    space.pin_pages(&[2, 3], Prot::READ).unwrap().forget();
    assert_eq!(held(&space), (2, 6));
    assert_eq!(space.pin_count(2 * P), 2);
    // Page 2's pins: the first buffer holding it gives one, then the second.
    space.unpin_pages(&[0, 1, 2]).unwrap();
    assert_eq!(held(&space), (2, 6), "both buffers still hold a page");
    // Page 2 from the second buffer (the first no longer holds it), page 3 from the first,
    // which then holds nothing and goes; the second still holds page 3, so both its pages
    // stay pinned.
    space.unpin_pages(&[2, 3]).unwrap();
    assert_eq!(held(&space), (1, 2));
    assert!(space.unpin_pages(&[3, 3]).is_err(), "page 3 holds one kept pin");
    assert_eq!(held(&space), (1, 2), "a refused unpin changes nothing");
    space.unpin_range(3 * P, 1).unwrap();
    assert_eq!(held(&space), (0, 0));
    assert_eq!(space.stats().pins_held, 0);
    space.unmap(0, 8 * P).unwrap();
}

#[test]
#[cfg_attr(miri, ignore = "Miri: io_uring")]
fn an_unmap_waits_for_kernel_pins_and_fails_busy_if_they_stay() {
    let space = kernel_space(16);
    let file = memfd(8);
    space.map(0, 8 * P, file.as_fd(), 0, Prot::READ_WRITE).unwrap();
    let told = Arc::new(AtomicU64::new(0));
    let seen = told.clone();
    space.set_unmap_notifier(Some(Arc::new(move |iova, _| {
        seen.fetch_add(1 + iova, Ordering::SeqCst);
    })));
    let pins = space.pin_pages(&[1, 2, 5], Prot::READ).unwrap();
    match space.unmap(0, 8 * P) {
        Err(UnmapError::Busy { iova: 0, pins: 3, .. }) => {}
        other => panic!("{other:?}"),
    }
    assert_eq!(told.load(Ordering::SeqCst), 1, "the device was told");
    assert!(space.pin_pages(&[1], Prot::READ).is_ok(), "the mapping is live again");
    assert_eq!(held(&space), (2, 3), "the failed unmap left the pins, the second pin let go");
    drop(pins);
    space.unmap(0, 8 * P).unwrap();
    assert_eq!(held(&space), (0, 0));
}

#[test]
#[cfg_attr(miri, ignore = "Miri: io_uring")]
fn an_abandoned_mapping_keeps_its_kernel_pins_until_the_guard_drops() {
    let space = kernel_space(16);
    let file = memfd(8);
    space.map(0, 8 * P, file.as_fd(), 0, Prot::READ_WRITE).unwrap();
    let pins = space.pin_pages(&[1, 3], Prot::READ_WRITE).unwrap();
    // The client disconnects: its mappings are taken at once.
    space.abandon_all();
    pins.write(P, b"still pinned").unwrap();
    assert_eq!(held(&space), (2, 2));
    drop(pins);
    assert_eq!(held(&space), (0, 0));
}

#[test]
#[cfg_attr(miri, ignore = "Miri: io_uring")]
fn a_pin_asking_for_no_access_is_refused_before_the_kernel_is_asked() {
    let space = kernel_space(64);
    let file = memfd(16);
    space.map(0, 16 * P, file.as_fd(), 0, Prot::READ_WRITE).unwrap();
    for result in [space.pin_pages(&[1, 5, 6], Prot::empty()), space.pin_range(0, 16, Prot::empty())] {
        let err = result.unwrap_err();
        assert!(matches!(err, PinError::NoAccess), "{err}");
        assert_eq!(err.errno(), libc::EINVAL);
    }
    assert_eq!(held(&space), (0, 0), "no buffer registered");
    assert_eq!((space.stats().pins_held, space.stats().pin_failures), (0, 2));
}

/// A space's ring is set up on a thread of its own: closing a ring makes the thread that set
/// it up fail its next timed socket read with EINTR (see `kernel::ring_of_its_own_thread`),
/// and a space is made and dropped on its caller's thread.
#[test]
#[cfg_attr(miri, ignore = "Miri: io_uring")]
fn a_space_made_and_dropped_leaves_the_threads_timed_waits_alone() {
    use std::io::Read;
    drop(kernel_space(4));
    let (mut a, _b) = std::os::unix::net::UnixStream::pair().unwrap();
    a.set_read_timeout(Some(Duration::from_millis(200))).unwrap();
    let err = a.read(&mut [0u8; 1]).unwrap_err();
    assert_ne!(err.kind(), std::io::ErrorKind::Interrupted, "the read timed out as asked");
}
