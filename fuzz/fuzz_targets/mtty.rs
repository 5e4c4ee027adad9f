//! The mtty card under arbitrary register traffic, host traffic, interrupt wiring and resets
//! (`umdev_testkit::mtty_fuzz::run`: accesses accepted and refused as documented, IIR always
//! a documented value, no host byte invented, repeated or reordered either way, reset values).

#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| umdev_testkit::mtty_fuzz::run(data));
