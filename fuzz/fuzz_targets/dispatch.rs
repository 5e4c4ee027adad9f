//! The vfio-user message decoder and dispatcher fed arbitrary byte streams, with fds, against
//! a real testdev and DMA space (`umdev_testkit::server_fuzz::dispatch`). Also checks that a run
//! leaves the process's fd count as it found it.

#![no_main]

use libfuzzer_sys::fuzz_target;
use umdev_testkit::server_fuzz::{dispatch, open_fds};

fuzz_target!(|data: &[u8]| {
    let before = open_fds();
    dispatch(data);
    assert_eq!(open_fds(), before, "fds leaked");
});
