//! The guest-side ccw driver lives in the umdev library (shared with the demo and benches).
#[allow(unused_imports)]
pub use umdev_testkit::ccw_guest::*;
