//! PCI functions: config space, BARs, capabilities and the MSI-X table, and the adapter
//! that serves a [`PciFunction`] as a [`crate::VfioDevice`].
//!
//! - [`config`]: [`ConfigSpaceBuilder`] to declare a function, [`ConfigSpace`] to emulate it;
//! - [`bar`] and [`caps`]: what can be declared, and how each register behaves;
//! - [`msix`]: the MSI-X table and Pending Bit Array;
//! - [`device`]: [`PciFunction`] and [`PciDevice`];
//! - [`regs`]: register offsets and bits.

pub mod bar;
pub mod caps;
pub mod config;
pub mod device;
pub mod msix;
pub mod regs;

pub use bar::{Bar, BarKind};
pub use caps::{MsiCap, MsixCap, PcieCap, PmCap};
pub use config::{
    ClassCode, ConfigChanges, ConfigError, ConfigSpace, ConfigSpaceBuilder, IrqControl, IrqStatus, PciIds,
};
pub use device::{PciDevice, PciDeviceError, PciFunction};
pub use msix::{MsixEntry, MsixError, MsixTable};
