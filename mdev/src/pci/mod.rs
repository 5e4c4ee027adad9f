//! PCI functions: config space, BARs and capabilities, and the adapter that serves a
//! [`PciFunction`] as a [`crate::VfioDevice`]. The interrupt state a function's config space
//! shows (INTx status, MSI mask and pending bits, the MSI-X table) is owned by
//! [`crate::irq`]; this module depends on it, never the other way round.
//!
//! - [`config`]: [`ConfigSpaceBuilder`] to declare a function, [`ConfigSpace`] to emulate it;
//! - [`bar`] and [`caps`]: what can be declared, and how each register behaves;
//! - [`device`]: [`PciFunction`] (`&self`, for devices with threads of their own) and
//!   [`PciDevice`];
//! - [`simple`]: [`SimpleFunction`] (`&mut self`, served through `Mutex` or [`Shared`]: no
//!   locking code in the device);
//! - [`regmap`]: [`RegMap`], a BAR's registers declared once and every access checked
//!   and cut the same way;
//! - [`regs`]: register offsets and bits.

pub mod bar;
pub mod caps;
pub mod config;
pub mod device;
pub mod regmap;
pub mod regs;
pub mod simple;

pub use bar::{Bar, BarKind};
pub use caps::{MsiCap, MsixCap, PcieCap, PmCap};
pub use config::{
    ClassCode, ConfigChanges, ConfigError, ConfigSpace, ConfigSpaceBuilder, IrqRegisters, PciIds,
};
pub use device::{Host, PciDevice, PciDeviceError, PciFunction};
pub use regmap::{Access, Hit, Placement, Reg, RegMap, RegMapBuilder, RegMapError};
pub use simple::{Shared, SharedRef, SimpleFunction, Waker, WeakShared};
