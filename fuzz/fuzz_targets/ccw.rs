//! The ccw channel-program interpreter over arbitrary guest memory, checked against a
//! reference interpreter and its invariants (`umdev_testkit::ccw_fuzz::ccw`).

#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| umdev_testkit::ccw_fuzz::ccw(data));
