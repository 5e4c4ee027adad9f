//! PCI functions: config space, BARs and capabilities, and the adapter that serves a
//! [`PciFunction`] as a [`crate::VfioDevice`]. The interrupt state a function's config space
//! shows (INTx status, MSI mask and pending bits, the MSI-X table) is owned by
//! [`crate::irq`]; this module depends on it, never the other way round.
//!
//! - [`config`]: [`ConfigSpaceBuilder`] to declare a function, [`ConfigSpace`] to emulate it;
//! - [`bar`] and [`caps`]: what can be declared, and how each register behaves;
//! - [`device`]: [`PciFunction`] and [`PciDevice`];
//! - [`regs`]: register offsets and bits.

pub mod bar;
pub mod caps;
pub mod config;
pub mod device;
pub mod regs;

pub use bar::{Bar, BarKind};
pub use caps::{MsiCap, MsixCap, PcieCap, PmCap};
pub use config::{
    ClassCode, ConfigChanges, ConfigError, ConfigSpace, ConfigSpaceBuilder, IrqRegisters, PciIds,
};
pub use device::{PciDevice, PciDeviceError, PciFunction};
