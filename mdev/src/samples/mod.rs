//! Sample devices built on [`crate::pci`]: small, complete, and used by the server's tests.
//!
//! - [`testdev`] (type `"testdev"`): registers, DMA, INTx/MSI/MSI-X, a sparse-mmap BAR and
//!   an I/O BAR; the ABI is in `docs/testdev.md`.
//! - [`mtty`] (types `"mtty-1"` and `"mtty-2"`): a PCI serial card with one or two 16550A
//!   UARTs, after the kernel's mtty sample; the ABI is in `docs/mtty.md`.

pub mod ccw;
pub mod mtty;
pub mod nvme;
pub mod testdev;
