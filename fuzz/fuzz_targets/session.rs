//! The real connection code (`serve`) over a socket pair, fds sent as SCM_RIGHTS, against a
//! fresh testdev or ccw device (`umdev_testkit::server_fuzz::session::run`, which also checks the
//! process's fd count).

#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| umdev_testkit::server_fuzz::session::run(data));
