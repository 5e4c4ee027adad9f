//! The nvme controller under arbitrary submission entries and guest memory
//! (`umdev_testkit::nvme_fuzz::run`: no Internal Error, no completion twice, the controller
//! still works after a reset, read-only memory never written).

#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| umdev_testkit::nvme_fuzz::run(data));
