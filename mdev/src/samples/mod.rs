//! Sample devices built on [`crate::pci`]: small, complete, and used by the server's tests.
//!
//! - [`testdev`] (type `"testdev"`): registers, DMA, INTx/MSI/MSI-X, a sparse-mmap BAR and
//!   an I/O BAR; the ABI is in `docs/testdev.md`.

pub mod testdev;
