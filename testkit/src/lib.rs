//! # umdev-testkit
//!
//! What umdev's tests, benchmarks and fuzz targets share, kept out of the daemon:
//!
//! - [`client`]: a raw vfio-user client that sends any message, well-formed or not;
//! - [`ccw_driver`] and [`ccw_guest`]: channel programs laid out in guest memory, and a guest
//!   driving the ccw device through rust-vmm's `vfio_user::Client`;
//! - [`nvme_driver`] and [`nvme_guest`]: an NVMe host driver over any register transport, and
//!   a guest driving the nvme device over a raw client;
//! - [`nvme_rig`]: the nvme device in-process (no socket), on a real DMA space, for that
//!   driver;
//! - [`fuse`]: a one-file FUSE filesystem whose reads and writes the test answers (held,
//!   failed or served), a backing file for a device under test;
//! - [`loop_device`]: a loop device over a sparse file, a block-device backing;
//! - [`ccw_fuzz`]: the channel-program interpreter's fuzz harness and model;
//! - [`nvme_fuzz`]: the nvme controller's fuzz harness and seeds;
//! - [`mtty_fuzz`]: the mtty card's fuzz harness and seeds;
//! - [`server_fuzz`]: the vfio-user server's fuzz harnesses (the dispatcher and a real
//!   connection), their input format and seeds.
//!
//! What it is not: a VMM, or anything the `umdev` daemon links.

#![deny(unsafe_op_in_unsafe_fn)]
#![deny(missing_docs)]

pub mod ccw_driver;
pub mod ccw_fuzz;
pub mod ccw_guest;
pub mod client;
pub mod fuse;
pub mod loop_device;
pub mod mtty_fuzz;
pub mod nvme_driver;
pub mod nvme_fuzz;
pub mod nvme_guest;
pub mod nvme_rig;
pub mod server_fuzz;

pub use umdev_mdev::NoClient;
