//! Base address registers: what a device declares, and how the register answers sizing.
//!
//! A BAR's address bits are writable down to its size and its type bits are read-only, so
//! writing all-ones and reading back yields `!(size - 1) | type` — the sizing protocol
//! falls out of the per-byte write masks with no special case.

use super::config::ConfigError;
use super::regs::{BAR_IO, BAR_MEM_64, BAR_PREFETCH};

/// Largest I/O BAR: PCI 3.0 §6.2.5.1 limits an I/O BAR to 256 bytes.
pub const MAX_IO_BAR_SIZE: u64 = 256;
/// Smallest I/O BAR.
pub const MIN_IO_BAR_SIZE: u64 = 4;
/// Smallest memory BAR (the 4 type bits leave 16-byte granularity).
pub const MIN_MEM_BAR_SIZE: u64 = 16;
/// Largest 32-bit memory BAR.
pub const MAX_MEM32_BAR_SIZE: u64 = 1 << 31;
/// Largest 64-bit memory BAR.
pub const MAX_MEM64_BAR_SIZE: u64 = 1 << 63;

/// Which address space a BAR decodes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BarKind {
    /// I/O space.
    Io,
    /// 32-bit memory space.
    Mem32,
    /// 64-bit memory space; occupies its slot and the next.
    Mem64,
}

/// A BAR a device declares: kind, size (a power of two) and prefetchability.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Bar {
    kind: BarKind,
    size: u64,
    prefetchable: bool,
}

impl Bar {
    /// An I/O BAR of `size` bytes (a power of two in 4..=256).
    pub fn io(size: u64) -> Bar {
        Bar { kind: BarKind::Io, size, prefetchable: false }
    }

    /// A 32-bit memory BAR of `size` bytes (a power of two in 16..=2 GiB).
    pub fn mem32(size: u64) -> Bar {
        Bar { kind: BarKind::Mem32, size, prefetchable: false }
    }

    /// A 64-bit memory BAR of `size` bytes (a power of two, at least 16); takes two slots.
    pub fn mem64(size: u64) -> Bar {
        Bar { kind: BarKind::Mem64, size, prefetchable: false }
    }

    /// The same BAR marked prefetchable (memory BARs only; checked at build).
    pub fn prefetchable(self) -> Bar {
        Bar { prefetchable: true, ..self }
    }

    /// The address space it decodes.
    pub fn kind(&self) -> BarKind {
        self.kind
    }

    /// Size in bytes.
    pub fn size(&self) -> u64 {
        self.size
    }

    /// Whether it decodes I/O space.
    pub fn is_io(&self) -> bool {
        self.kind == BarKind::Io
    }

    /// BAR slots it occupies (2 for a 64-bit BAR).
    pub fn slots(&self) -> usize {
        if self.kind == BarKind::Mem64 {
            2
        } else {
            1
        }
    }

    /// Checks the size and flags for slot `index`.
    pub(crate) fn validate(&self, index: usize) -> Result<(), ConfigError> {
        let (min, max) = match self.kind {
            BarKind::Io => (MIN_IO_BAR_SIZE, MAX_IO_BAR_SIZE),
            BarKind::Mem32 => (MIN_MEM_BAR_SIZE, MAX_MEM32_BAR_SIZE),
            BarKind::Mem64 => (MIN_MEM_BAR_SIZE, MAX_MEM64_BAR_SIZE),
        };
        // QEMU asserts is_power_of_2(size) when it registers the BAR.
        if !self.size.is_power_of_two() || self.size < min || self.size > max {
            return Err(ConfigError::BarSize { index, size: self.size, min, max });
        }
        if self.prefetchable && self.is_io() {
            return Err(ConfigError::PrefetchableIo { index });
        }
        Ok(())
    }

    /// The read-only type bits of the low register.
    pub(crate) fn type_bits(&self) -> u32 {
        let prefetch = if self.prefetchable { BAR_PREFETCH } else { 0 };
        match self.kind {
            BarKind::Io => BAR_IO,
            BarKind::Mem32 => prefetch,
            BarKind::Mem64 => BAR_MEM_64 | prefetch,
        }
    }

    /// Writable bits of the low register: address bits at or above the size.
    pub(crate) fn write_mask_low(&self) -> u32 {
        let type_mask: u32 = if self.is_io() { 0b11 } else { 0b1111 };
        (!(self.size - 1) as u32) & !type_mask
    }

    /// Writable bits of the high register of a 64-bit BAR.
    pub(crate) fn write_mask_high(&self) -> u32 {
        (!(self.size - 1) >> 32) as u32
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_are_checked() {
        assert!(Bar::io(4).validate(0).is_ok());
        assert!(Bar::io(256).validate(0).is_ok());
        assert!(Bar::io(2).validate(0).is_err());
        assert!(Bar::io(512).validate(0).is_err());
        assert!(Bar::mem32(16).validate(0).is_ok());
        assert!(Bar::mem32(8).validate(0).is_err());
        assert!(Bar::mem32(0x3000).validate(0).is_err(), "not a power of two");
        assert!(Bar::mem32(1 << 32).validate(0).is_err());
        assert!(Bar::mem64(1 << 40).validate(0).is_ok());
        assert!(Bar::mem64(0).validate(0).is_err());
        assert!(matches!(
            Bar::io(16).prefetchable().validate(3),
            Err(ConfigError::PrefetchableIo { index: 3 })
        ));
    }

    #[test]
    fn masks_keep_type_bits() {
        assert_eq!(Bar::io(16).write_mask_low(), 0xffff_fff0);
        assert_eq!(Bar::mem32(4096).write_mask_low(), 0xffff_f000);
        assert_eq!(Bar::mem64(1 << 33).write_mask_low(), 0);
        assert_eq!(Bar::mem64(1 << 33).write_mask_high(), 0xffff_fffe);
        assert_eq!(Bar::mem64(4096).prefetchable().type_bits(), 0b1100);
    }
}
