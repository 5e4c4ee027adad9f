//! # umdev-mdev
//!
//! Mediated devices emulated in user space: the boundary between a device and the vfio-user
//! server ([`VfioDevice`], [`DeviceContext`]), and the shared machinery devices are built
//! from: PCI config space and register maps ([`pci`]), interrupts ([`irq`]), typed guest
//! access ([`guest`]), request permits ([`request`]), device threads ([`worker`]) and their
//! scheduling ([`sched`]), device types ([`types`]), host files and block devices as
//! backings ([`backing`]), listening Unix sockets only their owner can reach
//! ([`unix_socket`]) and, with the `contract` feature, the device contract as a test
//! ([`contract`]). The devices themselves are
//! in `umdev-devices`; which of them a binary serves is the binary's choice.
//!
//! What it is not: it speaks no protocol (the server crate turns vfio-user messages into
//! calls on [`VfioDevice`]) and manages no memory (devices reach guest memory through the
//! pinning engine's [`DmaSpace`]).
//!
//! The engine's types that this crate's API takes or gives ([`DmaSpace`], [`PinMode`],
//! [`PinnedPages`], [`Prot`], ...) are re-exported here, so a device needs no dependency on
//! `umdev-pinning` of its own.

#![deny(unsafe_op_in_unsafe_fn)]
#![deny(missing_docs)]

pub mod backing;
// Documented without the feature too, so that `cargo doc` shows what the feature gives; a
// build uses it only with the feature.
#[cfg(any(feature = "contract", doc))]
pub mod contract;
mod device;
pub mod guest;
pub mod irq;
pub mod log_budget;
pub mod pci;
pub mod request;
pub mod sched;
pub mod types;
pub mod unix_socket;
pub mod worker;

pub use device::region_memfd;
pub use device::{
    ClientDma, ClientDmaError, ClientHello, DeviceError, DeviceFlags, DeviceInfo, IrqAction, IrqData,
    IrqFlags, IrqInfo, NoClient, RegionFlags, RegionInfo, RegionMmap, SetIrqs, SparseArea, VfioDevice,
};
pub use device::{
    VFIO_IRQ_SET_ACTION_MASK, VFIO_IRQ_SET_ACTION_TRIGGER, VFIO_IRQ_SET_ACTION_UNMASK,
    VFIO_IRQ_SET_DATA_BOOL, VFIO_IRQ_SET_DATA_EVENTFD, VFIO_IRQ_SET_DATA_NONE,
};
pub use device::{
    VFIO_PCI_BAR0_REGION_INDEX, VFIO_PCI_CONFIG_REGION_INDEX, VFIO_PCI_ERR_IRQ_INDEX,
    VFIO_PCI_INTX_IRQ_INDEX, VFIO_PCI_MSIX_IRQ_INDEX, VFIO_PCI_MSI_IRQ_INDEX, VFIO_PCI_NUM_IRQS,
    VFIO_PCI_NUM_REGIONS, VFIO_PCI_REQ_IRQ_INDEX, VFIO_PCI_ROM_REGION_INDEX, VFIO_PCI_VGA_REGION_INDEX,
};
pub use guest::{BusMaster, DeviceContext, GuestError};
pub use umdev_pinning::sync;
/// The engine's types in this crate's API: what [`request::Permit::pin_pages`] takes and
/// gives, a pinned buffer's errors ([`AccessError`]), the client's DMA space a
/// [`DeviceContext`] is made over ([`DmaSpace`], with its [`DmaSpaceConfig`] and
/// [`DmaStats`]; [`contract::Probe::dma`]) and how it pins ([`PinMode`],
/// [`DeviceContext::pin_mode`]). Re-exported so that a device needs no dependency on the
/// engine of its own.
pub use umdev_pinning::{
    AccessError, DmaSpace, DmaSpaceConfig, DmaStats, PinError, PinMode, PinnedPages, Prot, UnmapNotifier,
    PAGE_SIZE,
};
pub use vmm_sys_util::eventfd::EventFd;
