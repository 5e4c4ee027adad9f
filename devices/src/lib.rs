//! # umdev-devices
//!
//! The devices umdev serves, each a PCI function built on the framework in `umdev-mdev`:
//!
//! - [`ccw`] (type `"ccw"`): channel programs (CCW chains, IDAW scatter lists) pinned one call
//!   per data CCW; the ABI is in `docs/ccw.md`.
//! - [`mtty`] (types `"mtty-1"` and `"mtty-2"`): a PCI serial card with one or two 16550A
//!   UARTs, after the kernel's mtty sample; the ABI is in `docs/mtty.md`.
//! - [`nvme`] (type `"nvme"`): an NVMe 1.3 controller; the ABI is in `docs/nvme.md`.
//! - [`testdev`] (type `"testdev"`): registers, DMA, INTx/MSI/MSI-X, a sparse-mmap BAR and
//!   an I/O BAR; the ABI is in `docs/testdev.md`.
//! - [`store`]: the RAM or file block store behind ccw and nvme, [`aio`], asynchronous
//!   transfers to its files through io_uring, and [`populate`], a RAM disk's memory taken
//!   ahead of its writes.
//!
//! What it is not: it speaks no protocol and holds no plumbing of its own; the framework owns
//! threads, request tracking and guest access, and a binary chooses which types to serve.

#![deny(unsafe_op_in_unsafe_fn)]
#![deny(missing_docs)]

pub mod aio;
pub mod ccw;
pub mod mtty;
pub mod nvme;
pub mod populate;
pub mod store;
pub mod testdev;

/// What the devices' unit tests share.
#[cfg(test)]
mod testutil {
    /// The tests' guest memory is all shared with fds.
    pub(crate) use umdev_mdev::NoClient;
}
