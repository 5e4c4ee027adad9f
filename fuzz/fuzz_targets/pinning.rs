//! The pinning engine driven by arbitrary op sequences and checked against its per-page
//! model (`umdev_pinning::fuzzing::ops_alone`: a fuzzer's process pins nothing else, so in
//! kernel mode its `VmPin` is checked too).

#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| umdev_pinning::fuzzing::ops_alone(data));
