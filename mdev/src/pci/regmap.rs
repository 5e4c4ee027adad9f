//! Register maps: a BAR's registers declared once (offset, width, access, arrays of them),
//! and every access checked and cut into register accesses the same way for every device.
//!
//! A map has a register *unit* (1 byte for a UART, 4 for most devices): registers are
//! `unit` bytes wide and unit-aligned. An access of an accepted width (and, if the map says
//! so, aligned to it) is cut at unit boundaries, lowest address first; each piece reaches
//! the device's handler as one register access, a partial one carrying the byte mask it
//! covers. Reads of write-only registers return 0 and writes to read-only ones are ignored
//! without reaching the handler; offsets no register covers read 0 and ignore writes. Any
//! other width, a misaligned access where alignment is required, or an access outside the
//! map is refused ([`DeviceError::BadAccess`], EINVAL to the client).

use crate::device::DeviceError;

/// How the guest may access a register.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Access {
    /// Reads see the register; writes are ignored.
    ReadOnly,
    /// Writes reach the register; reads return 0.
    WriteOnly,
    /// Reads see the register and writes reach it.
    ReadWrite,
}

/// One register, or an array of `count` registers `stride` bytes apart (a block per
/// channel, say).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Reg<K> {
    /// What the handler is told.
    pub key: K,
    /// Offset of the first register.
    pub offset: u64,
    /// What the guest may do with it.
    pub access: Access,
    /// Registers in the array (1 for a plain register).
    pub count: u32,
    /// Bytes between the array's registers.
    pub stride: u64,
}

impl<K: Copy> Reg<K> {
    /// A read-only register.
    pub const fn ro(key: K, offset: u64) -> Reg<K> {
        Reg { key, offset, access: Access::ReadOnly, count: 1, stride: 0 }
    }

    /// A write-only register.
    pub const fn wo(key: K, offset: u64) -> Reg<K> {
        Reg { key, offset, access: Access::WriteOnly, count: 1, stride: 0 }
    }

    /// A read-write register.
    pub const fn rw(key: K, offset: u64) -> Reg<K> {
        Reg { key, offset, access: Access::ReadWrite, count: 1, stride: 0 }
    }

    /// This register repeated `count` times, `stride` bytes apart.
    pub const fn array(self, count: u32, stride: u64) -> Reg<K> {
        Reg { key: self.key, offset: self.offset, access: self.access, count, stride }
    }
}

/// Which register an access reached.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Hit<K> {
    /// The register's key.
    pub key: K,
    /// Its index in its array (0 for a plain register).
    pub index: u32,
}

/// A BAR's register map.
#[derive(Clone, Debug)]
pub struct RegMap<K: Copy> {
    region: u32,
    size: u64,
    unit: u64,
    widths: &'static [usize],
    aligned: bool,
    regs: Vec<Reg<K>>,
    /// Per unit of the map: 1 + the index into `regs` and the array index, or 0 for a hole.
    lookup: Vec<(u16, u32)>,
}

/// Why a register map cannot be built.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum RegMapError {
    /// The unit is not 1, 2, 4 or 8, or the size is not a multiple of it.
    #[error("a register unit of {unit} bytes cannot map {size} bytes")]
    Unit {
        /// The unit.
        unit: u64,
        /// The size.
        size: u64,
    },
    /// An access width of 0 or over 8 bytes, or none at all: no access of it could be
    /// taken (an access's value is at most a `u64`).
    #[error("access widths {widths:?}: each must be 1 to 8 bytes, and at least one given")]
    Width {
        /// The widths given.
        widths: &'static [usize],
    },
    /// A register's element is not aligned to the unit, lies outside the map, or lies where
    /// another is.
    #[error("register at {offset:#x} (element {index}, at {at:#x}) {why}")]
    Placement {
        /// The register's offset.
        offset: u64,
        /// The array element.
        index: u32,
        /// Where the element lies (`u64::MAX` where that overflows).
        at: u64,
        /// What is wrong with it.
        why: Placement,
    },
}

/// What is wrong with a register's place ([`RegMapError::Placement`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Placement {
    /// Not a multiple of the unit.
    Misaligned {
        /// The unit.
        unit: u64,
    },
    /// At or past the map's end (or past `u64::MAX`).
    Outside {
        /// The map's size.
        size: u64,
    },
    /// Where an earlier register (of the list, by its offset) already is.
    Overlaps {
        /// The earlier register's offset.
        other: u64,
    },
}

impl std::fmt::Display for Placement {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Placement::Misaligned { unit } => write!(f, "is not aligned to the {unit}-byte unit"),
            Placement::Outside { size } => write!(f, "lies outside the map of {size:#x} bytes"),
            Placement::Overlaps { other } => write!(f, "lies where the register at {other:#x} already is"),
        }
    }
}

/// How a [`RegMap`] is declared: by default 4-byte registers taking aligned 4-byte accesses.
#[derive(Clone, Copy, Debug)]
pub struct RegMapBuilder<K> {
    region: u32,
    size: u64,
    unit: u64,
    widths: &'static [usize],
    aligned: bool,
    keys: std::marker::PhantomData<K>,
}

impl<K: Copy> RegMapBuilder<K> {
    /// Registers are `bytes` wide (1, 2, 4 or 8) and aligned to it.
    pub fn unit(mut self, bytes: u64) -> Self {
        self.unit = bytes;
        self
    }

    /// The access widths accepted, in bytes, each 1 to 8 ([`RegMap::builder`]'s `build`
    /// refuses others; an access wider than the unit covers several registers, lowest first).
    pub fn widths(mut self, widths: &'static [usize]) -> Self {
        self.widths = widths;
        self
    }

    /// Accesses may start at any offset (by default an access is aligned to its width).
    pub fn unaligned(mut self) -> Self {
        self.aligned = false;
        self
    }

    /// The map of `regs`.
    pub fn build(self, regs: &[Reg<K>]) -> Result<RegMap<K>, RegMapError> {
        RegMap::new(self.region, self.size, self.unit, self.widths, self.aligned, regs)
    }
}

impl<K: Copy> RegMap<K> {
    /// Declares the map of BAR `region`, `size` bytes.
    pub fn builder(region: u32, size: u64) -> RegMapBuilder<K> {
        RegMapBuilder { region, size, unit: 4, widths: &[4], aligned: true, keys: std::marker::PhantomData }
    }

    fn new(
        region: u32,
        size: u64,
        unit: u64,
        widths: &'static [usize],
        aligned: bool,
        regs: &[Reg<K>],
    ) -> Result<RegMap<K>, RegMapError> {
        if !matches!(unit, 1 | 2 | 4 | 8) || !size.is_multiple_of(unit) || size / unit > u64::from(u32::MAX) {
            return Err(RegMapError::Unit { unit, size });
        }
        if widths.is_empty() || !widths.iter().all(|w| (1..=8).contains(w)) {
            return Err(RegMapError::Width { widths });
        }
        let mut lookup = vec![(0u16, 0u32); (size / unit) as usize];
        for (i, reg) in regs.iter().enumerate() {
            for index in 0..reg.count {
                let at = u64::from(index).checked_mul(reg.stride).and_then(|o| o.checked_add(reg.offset));
                let bad = |at: Option<u64>, why| RegMapError::Placement {
                    offset: reg.offset,
                    index,
                    at: at.unwrap_or(u64::MAX),
                    why,
                };
                let offset = match at.filter(|&o| o < size) {
                    None => return Err(bad(at, Placement::Outside { size })),
                    Some(o) if o % unit != 0 => return Err(bad(at, Placement::Misaligned { unit })),
                    Some(o) => o,
                };
                let slot = &mut lookup[(offset / unit) as usize];
                if slot.0 != 0 {
                    let other = regs[usize::from(slot.0 - 1)].offset;
                    return Err(bad(at, Placement::Overlaps { other }));
                }
                *slot = (i as u16 + 1, index);
            }
        }
        Ok(RegMap { region, size, unit, widths, aligned, regs: regs.to_vec(), lookup })
    }

    /// Bytes the map covers.
    pub fn size(&self) -> u64 {
        self.size
    }

    /// The pieces of an access: `(unit offset, byte range in the register, byte range in
    /// the access)`, after checking width, alignment and bounds.
    fn pieces(
        &self,
        offset: u64,
        len: usize,
    ) -> Result<impl Iterator<Item = (u64, std::ops::Range<usize>, std::ops::Range<usize>)>, DeviceError>
    {
        let bad = || DeviceError::BadAccess { region: self.region, offset, len: len as u64 };
        if !self.widths.contains(&len) || (self.aligned && !offset.is_multiple_of(len as u64)) {
            return Err(bad());
        }
        let end = offset.checked_add(len as u64).filter(|&e| e <= self.size).ok_or_else(bad)?;
        let unit = self.unit;
        let mut at = offset;
        Ok(std::iter::from_fn(move || {
            if at >= end {
                return None;
            }
            let reg = at - at % unit;
            let within = (at - reg) as usize;
            let n = (unit - (at - reg)).min(end - at) as usize;
            let piece = (reg, within..within + n, (at - offset) as usize..(at - offset) as usize + n);
            at += n as u64;
            Some(piece)
        }))
    }

    /// `offset` if the access is exactly one whole register the map accepts.
    #[inline]
    fn whole_register(&self, offset: u64, len: usize) -> Option<u64> {
        let whole = len as u64 == self.unit
            && offset.is_multiple_of(self.unit)
            && offset < self.size
            && self.widths.contains(&len);
        whole.then_some(offset)
    }

    #[inline]
    fn hit(&self, reg_offset: u64) -> Option<(Hit<K>, Access)> {
        let (slot, index) = self.lookup[(reg_offset / self.unit) as usize];
        let reg = self.regs.get(usize::from(slot).checked_sub(1)?)?;
        Some((Hit { key: reg.key, index }, reg.access))
    }

    /// A read of `data.len()` bytes at `offset`: `read(hit)` gives each register's value
    /// (little-endian, `unit` bytes).
    #[inline]
    pub fn read(
        &self,
        offset: u64,
        data: &mut [u8],
        mut read: impl FnMut(Hit<K>) -> u64,
    ) -> Result<(), DeviceError> {
        if let Some(reg) = self.whole_register(offset, data.len()) {
            // The common case, one aligned register: no cutting.
            let value = match self.hit(reg) {
                Some((hit, Access::ReadOnly | Access::ReadWrite)) => read(hit),
                _ => 0,
            };
            data.copy_from_slice(&value.to_le_bytes()[..data.len()]);
            return Ok(());
        }
        for (reg, in_reg, in_data) in self.pieces(offset, data.len())? {
            let value = match self.hit(reg) {
                Some((hit, Access::ReadOnly | Access::ReadWrite)) => read(hit),
                _ => 0, // write-only, or no register here
            };
            data[in_data].copy_from_slice(&value.to_le_bytes()[in_reg]);
        }
        Ok(())
    }

    /// A write of `data` at `offset`: `write(hit, value, mask)` is called per register,
    /// `mask` having ones where the access covered the register (a partial write merges:
    /// `old & !mask | value & mask`).
    #[inline]
    pub fn write(
        &self,
        offset: u64,
        data: &[u8],
        mut write: impl FnMut(Hit<K>, u64, u64),
    ) -> Result<(), DeviceError> {
        if let Some(reg) = self.whole_register(offset, data.len()) {
            // The common case, one aligned register (a doorbell): no cutting.
            if let Some((hit, Access::WriteOnly | Access::ReadWrite)) = self.hit(reg) {
                let mut value = [0u8; 8];
                value[..data.len()].copy_from_slice(data);
                write(hit, u64::from_le_bytes(value), u64::MAX >> (64 - 8 * data.len()));
                return Ok(());
            }
        }
        for (reg, in_reg, in_data) in self.pieces(offset, data.len())? {
            match self.hit(reg) {
                Some((hit, Access::WriteOnly | Access::ReadWrite)) => {
                    let (mut value, mut mask) = ([0u8; 8], [0u8; 8]);
                    value[in_reg.clone()].copy_from_slice(&data[in_data]);
                    mask[in_reg].fill(0xff);
                    write(hit, u64::from_le_bytes(value), u64::from_le_bytes(mask));
                }
                Some((hit, Access::ReadOnly)) => {
                    log::debug!("write to read-only register {:#x} (element {}) ignored", reg, hit.index);
                }
                None => log::debug!("write to {reg:#x}, where no register is, ignored"),
            }
        }
        Ok(())
    }
}

/// Merges a (possibly partial) register write into `old`.
pub fn merge(old: u64, value: u64, mask: u64) -> u64 {
    (old & !mask) | (value & mask)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    enum K {
        Id,
        Scratch,
        Door,
        Chan,
    }

    fn map(widths: &'static [usize], aligned: bool) -> RegMap<K> {
        RegMap::new(
            0,
            0x100,
            4,
            widths,
            aligned,
            &[
                Reg::ro(K::Id, 0),
                Reg::rw(K::Scratch, 4),
                Reg::wo(K::Door, 8),
                Reg::rw(K::Chan, 0x40).array(4, 0x10),
            ],
        )
        .unwrap()
    }

    #[test]
    fn accesses_are_cut_into_register_accesses() {
        let m = map(&[1, 2, 4, 8], false);
        let mut scratch = 0u64;
        let mut b = [0u8; 8];
        // An 8-byte read at 0 covers ID and SCRATCH.
        m.read(0, &mut b, |h| if h.key == K::Id { 0x1122_3344 } else { 0xaabb_ccdd }).unwrap();
        assert_eq!(b, [0x44, 0x33, 0x22, 0x11, 0xdd, 0xcc, 0xbb, 0xaa]);
        // A 2-byte write straddling SCRATCH's top and DOORBELL's bottom: two partial writes.
        let mut writes = Vec::new();
        m.write(7, &[1, 2], |h, v, mask| writes.push((h.key, v, mask))).unwrap();
        assert_eq!(writes, [(K::Scratch, 0x0100_0000, 0xff00_0000), (K::Door, 0x02, 0xff)]);
        m.write(4, &[5, 0, 0, 0], |_, v, mask| scratch = merge(scratch, v, mask)).unwrap();
        assert_eq!(scratch, 5);
        // Write-only reads 0, read-only ignores writes, holes read 0.
        let mut b = [0xffu8; 4];
        m.read(8, &mut b, |_| unreachable!("write-only")).unwrap();
        assert_eq!(b, [0; 4]);
        m.write(0, &[1; 4], |_, _, _| unreachable!("read-only")).unwrap();
        m.read(0x20, &mut b, |_| unreachable!("hole")).unwrap();
        assert_eq!(b, [0; 4]);
        // Arrays know their element.
        let mut hits = Vec::new();
        m.read(0x60, &mut b, |h| {
            hits.push(h);
            0
        })
        .unwrap();
        assert_eq!(hits, [Hit { key: K::Chan, index: 2 }]);
    }

    #[test]
    fn widths_alignment_and_bounds_are_refused_as_declared() {
        let m = map(&[4], true);
        let refused = |r: Result<(), DeviceError>| matches!(r, Err(DeviceError::BadAccess { .. }));
        assert!(refused(m.read(2, &mut [0; 4], |_| 0)), "misaligned");
        assert!(refused(m.read(0, &mut [0; 2], |_| 0)), "width");
        assert!(refused(m.read(0x100, &mut [0; 4], |_| 0)), "outside");
        assert!(refused(m.write(u64::MAX - 1, &[0; 4], |_, _, _| ())), "wraps");
        assert!(m.read(0xfc, &mut [0; 4], |_| 0).is_ok());
        // Bad declarations.
        assert!(RegMap::new(0, 0x10, 3, &[4], true, &[Reg::ro(K::Id, 0)]).is_err());
        assert!(RegMap::new(0, 0x10, 4, &[4], true, &[Reg::ro(K::Id, 2)]).is_err());
        assert!(RegMap::new(0, 0x10, 4, &[4], true, &[Reg::ro(K::Id, 0), Reg::rw(K::Scratch, 0)]).is_err());
        assert!(RegMap::new(0, 0x10, 4, &[4], true, &[Reg::ro(K::Chan, 0).array(8, 4)]).is_err());
    }

    /// A map that no access could reach, or whose registers collide, is refused when it is
    /// built, saying which register and why.
    #[test]
    fn a_bad_map_is_refused_at_build_saying_why() {
        let build = |widths: &'static [usize], regs: &[Reg<K>]| {
            RegMap::builder(0, 0x100).widths(widths).build(regs).map(|_| ()).unwrap_err().to_string()
        };
        for widths in [&[0][..], &[16], &[4, 9], &[]] {
            assert!(build(widths, &[]).contains("each must be 1 to 8 bytes"), "{widths:?}");
        }
        let e = build(&[4], &[Reg::rw(K::Id, 2)]);
        assert_eq!(e, "register at 0x2 (element 0, at 0x2) is not aligned to the 4-byte unit");
        let e = build(&[4], &[Reg::rw(K::Chan, 0x40).array(4, 0x40)]);
        assert_eq!(e, "register at 0x40 (element 3, at 0x100) lies outside the map of 0x100 bytes");
        let e =
            build(&[4], &[Reg::rw(K::Id, 0), Reg::rw(K::Chan, 0x40).array(4, 0x10), Reg::rw(K::Door, 0x60)]);
        assert_eq!(e, "register at 0x60 (element 0, at 0x60) lies where the register at 0x40 already is");
    }
}
