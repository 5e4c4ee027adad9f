//! The raw client lives in the server crate (shared with the benchmarks).
#[allow(unused_imports)]
pub use umdev_testkit::client::*;
