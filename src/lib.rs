//! Support code of the `umdev` binary that tests and tools share: the device types it
//! serves, the instance lifecycle and its definitions, the daemon's control socket (and the
//! warnings its answers carry), and mdevctl's JSON shapes.

#![deny(missing_docs)]

pub mod control;
pub mod lifecycle;
pub mod mdevctl;
pub mod warnings;

use std::sync::Arc;

/// The log target of status lines: what `umdev` tells its user, shown whatever RUST_LOG says
/// (as `umdev: ...` in a terminal; the binary's logger formats them).
pub const STATUS: &str = "umdev::status";

use umdev_devices::{ccw, mtty, nvme, testdev};
use umdev_mdev::types::{Pool, Registry};

/// The device types `umdev` serves: testdev, mtty-1 and mtty-2 (one pool of 24 ports, as
/// the kernel's mtty sample), ccw, nvme. The framework knows no device; this list is the
/// binary's.
pub fn builtin_registry() -> Registry {
    let mtty_ports = Pool::new(mtty::MAX_PORTS);
    Registry::with_types(vec![
        Arc::new(testdev::TestDevType::new(64)),
        Arc::new(mtty::MttyType::single(mtty_ports.clone())),
        Arc::new(mtty::MttyType::dual(mtty_ports)),
        Arc::new(ccw::CcwType::new(64)),
        Arc::new(nvme::NvmeType::new(64)),
    ])
}
