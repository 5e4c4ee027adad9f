//! The pinning engine driven by arbitrary op sequences and checked against its per-page
//! model (`umdev_pinning::fuzzing::ops`).

#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| umdev_pinning::fuzzing::ops(data));
