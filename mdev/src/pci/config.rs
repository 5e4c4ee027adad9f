//! PCI configuration space: the builder a device author declares a function with, and the
//! emulation that answers the client's config-space accesses.
//!
//! The space is a byte image with two per-byte masks: `wmask` (bits a write may change)
//! and `w1c` (bits a written 1 clears). Every header field and capability is described by
//! these masks, so one write path serves every access size and alignment; only the two
//! rules a mask cannot express (MSI Multiple Message Enable is clamped to what is capable,
//! PMCSR ignores unsupported power states) are applied after it. A write returns the
//! [`ConfigChanges`] the interrupt layer and the device care about, and
//! [`ConfigSpace::irq_control`] gives the interrupt-relevant state in one snapshot.

use bitflags::bitflags;
use thiserror::Error;

use super::bar::Bar;
use super::caps::{CapImage, MsiCap, MsixCap, PcieCap, PmCap};
use super::regs::*;
use crate::irq::IrqControl;

/// Identity of a function: the read-only ID registers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PciIds {
    /// Vendor ID.
    pub vendor_id: u16,
    /// Device ID.
    pub device_id: u16,
    /// Subsystem vendor ID.
    pub subsystem_vendor_id: u16,
    /// Subsystem ID.
    pub subsystem_id: u16,
    /// Revision ID.
    pub revision: u8,
    /// Class code.
    pub class: ClassCode,
}

/// The three-byte class code.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ClassCode {
    /// Base class (0xff: unclassified).
    pub base: u8,
    /// Subclass.
    pub sub: u8,
    /// Programming interface.
    pub prog_if: u8,
}

/// Why a configuration cannot be built, or an access was refused.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum ConfigError {
    /// A BAR index at or above 6.
    #[error("BAR index {index} is out of range (0-5)")]
    BarIndex {
        /// The index given.
        index: usize,
    },
    /// Two BARs claim a slot (a 64-bit BAR also claims the next one).
    #[error("BAR slot {index} is declared twice")]
    BarSlotTaken {
        /// The slot.
        index: usize,
    },
    /// A 64-bit BAR in slot 5 has no slot for its upper half.
    #[error("64-bit BAR {index} needs slot {} for its upper half", index + 1)]
    Mem64NoUpperSlot {
        /// The slot.
        index: usize,
    },
    /// A BAR size is not a power of two within its kind's limits.
    #[error("BAR {index}: size {size:#x} is not a power of two in [{min:#x}, {max:#x}]")]
    BarSize {
        /// The slot.
        index: usize,
        /// The size given.
        size: u64,
        /// Smallest size of this kind.
        min: u64,
        /// Largest size of this kind.
        max: u64,
    },
    /// An I/O BAR marked prefetchable.
    #[error("BAR {index}: an I/O BAR cannot be prefetchable")]
    PrefetchableIo {
        /// The slot.
        index: usize,
    },
    /// An interrupt pin other than 0 (none) or 1-4 (INTA#-INTD#).
    #[error("interrupt pin {0} is not 0-4")]
    InterruptPin(u8),
    /// A capability declared twice.
    #[error("capability {0} is declared twice")]
    DuplicateCapability(&'static str),
    /// An MSI vector count that is not a power of two in 1..=32.
    #[error("MSI vector count {0} is not a power of two in 1..=32")]
    MsiVectors(u32),
    /// An MSI-X table size outside 1..=2048.
    #[error("MSI-X vector count {0} is not in 1..=2048")]
    MsixVectors(u16),
    /// The MSI-X table or PBA names a BAR that is not a declared memory BAR.
    #[error("MSI-X {what} is in BAR {bar}, which is not a declared memory BAR")]
    MsixBar {
        /// "table" or "PBA".
        what: &'static str,
        /// The BAR named.
        bar: u8,
    },
    /// The MSI-X table or PBA offset is not 8-byte aligned.
    #[error("MSI-X {what} offset {offset:#x} is not 8-byte aligned")]
    MsixMisaligned {
        /// "table" or "PBA".
        what: &'static str,
        /// The offset given.
        offset: u32,
    },
    /// The MSI-X table or PBA does not fit in its BAR.
    #[error("MSI-X {what} [{offset:#x}, +{size:#x}) does not fit in BAR {bar} of {bar_size:#x} bytes")]
    MsixOutsideBar {
        /// "table" or "PBA".
        what: &'static str,
        /// The BAR.
        bar: u8,
        /// Offset of the structure.
        offset: u32,
        /// Its size.
        size: u64,
        /// The BAR's size.
        bar_size: u64,
    },
    /// The MSI-X table and PBA overlap.
    #[error("MSI-X table and PBA overlap in BAR {bar}")]
    MsixOverlap {
        /// The BAR holding both.
        bar: u8,
    },
    /// The capabilities do not fit in `[0x40, 0x100)`.
    #[error("capabilities need {needed} bytes; only 192 are available")]
    CapabilitySpaceFull {
        /// Bytes the declared capabilities need.
        needed: usize,
    },
    /// A config-space access outside the space.
    #[error("config access of {len} bytes at {offset:#x} is outside the {size}-byte space")]
    OutOfRange {
        /// Offset of the access.
        offset: u64,
        /// Length of the access.
        len: usize,
        /// Size of the space.
        size: usize,
    },
}

/// A capability the builder will place.
#[derive(Clone, Copy, Debug)]
enum Capability {
    Pm(PmCap),
    Msi(MsiCap),
    Msix(MsixCap),
    Pcie(PcieCap),
}

impl Capability {
    fn name(&self) -> &'static str {
        match self {
            Capability::Pm(_) => "power management",
            Capability::Msi(_) => "MSI",
            Capability::Msix(_) => "MSI-X",
            Capability::Pcie(_) => "PCI Express",
        }
    }

    fn image(&self) -> CapImage {
        match self {
            Capability::Pm(c) => c.image(),
            Capability::Msi(c) => c.image(),
            Capability::Msix(c) => c.image(),
            Capability::Pcie(c) => c.image(),
        }
    }
}

/// Declares a type-0 function; [`ConfigSpaceBuilder::build`] checks it all and yields the
/// [`ConfigSpace`]. Capabilities are laid out from 0x40 in the order they are declared.
///
/// ```
/// use umdev_mdev::pci::{Bar, ClassCode, ConfigSpaceBuilder, MsixCap, PciIds};
///
/// let ids = PciIds {
///     vendor_id: 0x1234,
///     device_id: 0x5678,
///     subsystem_vendor_id: 0x1234,
///     subsystem_id: 0,
///     revision: 1,
///     class: ClassCode { base: 0xff, sub: 0, prog_if: 0 },
/// };
/// let config = ConfigSpaceBuilder::new(ids)
///     .bar(0, Bar::mem32(4096))
///     .bar(2, Bar::mem64(1 << 20).prefetchable())
///     .interrupt_pin(1)
///     .msix(MsixCap { vectors: 4, table_bar: 0, table_offset: 0x800, pba_bar: 0, pba_offset: 0xc00 })
///     .build()
///     .unwrap();
/// assert_eq!(config.size(), 256);
/// ```
#[derive(Clone, Debug)]
pub struct ConfigSpaceBuilder {
    ids: PciIds,
    bars: Vec<(usize, Bar)>,
    pin: u8,
    caps: Vec<Capability>,
}

impl ConfigSpaceBuilder {
    /// A function with these IDs, no BARs, no interrupt pin, no capabilities.
    pub fn new(ids: PciIds) -> Self {
        ConfigSpaceBuilder { ids, bars: Vec::new(), pin: 0, caps: Vec::new() }
    }

    /// Declares BAR `index` (a 64-bit BAR also takes `index + 1`).
    pub fn bar(mut self, index: usize, bar: Bar) -> Self {
        self.bars.push((index, bar));
        self
    }

    /// The INTx pin: 0 none, 1-4 INTA#-INTD#.
    pub fn interrupt_pin(mut self, pin: u8) -> Self {
        self.pin = pin;
        self
    }

    /// An MSI capability of `cap.vectors` (a power of two, 1..=32) vectors, with per-vector
    /// masking and a 64-bit address if it says so.
    pub fn msi(mut self, cap: MsiCap) -> Self {
        self.caps.push(Capability::Msi(cap));
        self
    }

    /// An MSI-X capability: a table of `layout.vectors` entries at `layout.table_offset` in
    /// BAR `layout.table_bar`, its PBA at `layout.pba_offset` in BAR `layout.pba_bar`. Both
    /// must be 8-byte aligned, fit in their (memory) BAR and not overlap.
    ///
    /// The framework answers every access to the table's and the PBA's bytes. The rest of
    /// their BAR is the function's: an access elsewhere in it (registers beside the table,
    /// or the unused part of a BAR that holds only the MSI-X structures) reaches its
    /// `bar_read`/`bar_write` like any other, so a function answers those too (a
    /// [`RegMap`](super::RegMap) over the whole BAR reads 0 and ignores writes where it has
    /// no register). An access that straddles the table or the PBA and other bytes is
    /// refused (EINVAL).
    pub fn msix(mut self, layout: MsixCap) -> Self {
        self.caps.push(Capability::Msix(layout));
        self
    }

    /// A PCI Express endpoint capability; the space becomes 4096 bytes, with an empty
    /// extended capability list at 0x100.
    pub fn pcie(mut self) -> Self {
        self.caps.push(Capability::Pcie(PcieCap));
        self
    }

    /// A power management capability (D0 and D3hot).
    pub fn power_management(mut self) -> Self {
        self.caps.push(Capability::Pm(PmCap));
        self
    }

    /// Checks the declaration and renders the power-on config space.
    pub fn build(self) -> Result<ConfigSpace, ConfigError> {
        let bars = self.check_bars()?;
        if self.pin > 4 {
            return Err(ConfigError::InterruptPin(self.pin));
        }
        self.check_caps(&bars)?;

        let pcie = self.caps.iter().any(|c| matches!(c, Capability::Pcie(_)));
        let size = if pcie { PCIE_CONFIG_SPACE_SIZE } else { CONFIG_SPACE_SIZE };
        let mut space = ConfigSpace {
            data: vec![0; size],
            wmask: vec![0; size],
            w1c: vec![0; size],
            reset_data: Vec::new(),
            bars,
            pin: self.pin,
            msi: None,
            msix: None,
            pm: None,
            pcie: None,
        };
        space.render_header(&self.ids);
        space.place_caps(&self.caps);
        space.reset_data = space.data.clone();
        Ok(space)
    }

    fn check_bars(&self) -> Result<[Option<Bar>; NUM_BARS], ConfigError> {
        let mut bars = [None; NUM_BARS];
        let mut taken = [false; NUM_BARS];
        for &(index, bar) in &self.bars {
            if index >= NUM_BARS {
                return Err(ConfigError::BarIndex { index });
            }
            bar.validate(index)?;
            if bar.slots() == 2 && index + 1 >= NUM_BARS {
                return Err(ConfigError::Mem64NoUpperSlot { index });
            }
            for (slot, taken) in taken.iter_mut().enumerate().skip(index).take(bar.slots()) {
                if std::mem::replace(taken, true) {
                    return Err(ConfigError::BarSlotTaken { index: slot });
                }
            }
            bars[index] = Some(bar);
        }
        Ok(bars)
    }

    fn check_caps(&self, bars: &[Option<Bar>; NUM_BARS]) -> Result<(), ConfigError> {
        for (i, cap) in self.caps.iter().enumerate() {
            if self.caps[..i].iter().any(|c| std::mem::discriminant(c) == std::mem::discriminant(cap)) {
                return Err(ConfigError::DuplicateCapability(cap.name()));
            }
            match cap {
                Capability::Msi(msi) => {
                    if !msi.vectors.is_power_of_two() || msi.vectors > 32 {
                        return Err(ConfigError::MsiVectors(msi.vectors));
                    }
                }
                Capability::Msix(msix) => check_msix(msix, bars)?,
                Capability::Pm(_) | Capability::Pcie(_) => {}
            }
        }
        let needed: usize = self.caps.iter().map(|c| c.image().data.len().next_multiple_of(4)).sum();
        if HEADER_END + needed > CONFIG_SPACE_SIZE {
            return Err(ConfigError::CapabilitySpaceFull { needed });
        }
        Ok(())
    }
}

fn check_msix(msix: &MsixCap, bars: &[Option<Bar>; NUM_BARS]) -> Result<(), ConfigError> {
    if msix.vectors == 0 || msix.vectors > 2048 {
        return Err(ConfigError::MsixVectors(msix.vectors));
    }
    let check = |what, bar: u8, offset: u32, size: u64| {
        let bar_size = match bars.get(usize::from(bar)).copied().flatten() {
            Some(b) if !b.is_io() => b.size(),
            _ => return Err(ConfigError::MsixBar { what, bar }),
        };
        // The low 3 bits of the offset register hold the BIR: the spec requires qword
        // alignment.
        if !offset.is_multiple_of(8) {
            return Err(ConfigError::MsixMisaligned { what, offset });
        }
        if u64::from(offset) + size > bar_size {
            return Err(ConfigError::MsixOutsideBar { what, bar, offset, size, bar_size });
        }
        Ok(())
    };
    check("table", msix.table_bar, msix.table_offset, msix.table_size())?;
    check("PBA", msix.pba_bar, msix.pba_offset, msix.pba_size())?;
    if msix.table_bar == msix.pba_bar {
        let table = u64::from(msix.table_offset)..u64::from(msix.table_offset) + msix.table_size();
        let pba = u64::from(msix.pba_offset)..u64::from(msix.pba_offset) + msix.pba_size();
        if table.start < pba.end && pba.start < table.end {
            return Err(ConfigError::MsixOverlap { bar: msix.table_bar });
        }
    }
    Ok(())
}

bitflags! {
    /// What a config write changed that the interrupt layer or the device cares about.
    #[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
    pub struct ConfigChanges: u32 {
        /// Any bit of COMMAND.
        const COMMAND = 1 << 0;
        /// COMMAND.INTX_DISABLE.
        const INTX_DISABLE = 1 << 1;
        /// MSI enable or Multiple Message Enable.
        const MSI = 1 << 2;
        /// MSI-X enable or function mask.
        const MSIX = 1 << 3;
        /// The PMCSR power state.
        const POWER_STATE = 1 << 4;
        /// A BAR address.
        const BAR = 1 << 5;
        /// INTERRUPT_LINE.
        const INTERRUPT_LINE = 1 << 6;
        /// COMMAND.BME (bus master enable).
        const BUS_MASTER = 1 << 7;
    }
}

impl ConfigChanges {
    /// Whether the interrupt layer must see the new [`IrqControl`].
    pub fn affects_interrupts(&self) -> bool {
        self.intersects(
            ConfigChanges::INTX_DISABLE
                | ConfigChanges::BUS_MASTER
                | ConfigChanges::MSI
                | ConfigChanges::MSIX,
        )
    }
}

/// Where config space shows registers the interrupt layer owns ([`crate::irq`]): the
/// adapter answers reads of them from there and forwards writes, config space stores none
/// of their bits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct IrqRegisters {
    /// The MSI Mask Bits register (with per-vector masking).
    pub msi_mask: Option<usize>,
    /// The MSI Pending Bits register (with per-vector masking).
    pub msi_pending: Option<usize>,
    /// The bits of implemented MSI vectors.
    pub msi_vector_bits: u32,
}

/// The emulated configuration space of one function.
#[derive(Clone, Debug)]
pub struct ConfigSpace {
    data: Vec<u8>,
    wmask: Vec<u8>,
    w1c: Vec<u8>,
    reset_data: Vec<u8>,
    bars: [Option<Bar>; NUM_BARS],
    pin: u8,
    msi: Option<(usize, MsiCap)>,
    msix: Option<(usize, MsixCap)>,
    pm: Option<usize>,
    pcie: Option<usize>,
}

impl ConfigSpace {
    /// Size in bytes: 256, or 4096 with a PCI Express capability.
    pub fn size(&self) -> usize {
        self.data.len()
    }

    /// BAR `index` as declared; `None` for an empty slot, the upper half of a 64-bit BAR
    /// or an index above 5.
    pub fn bar(&self, index: usize) -> Option<Bar> {
        self.bars.get(index).copied().flatten()
    }

    /// The interrupt pin (0: none).
    pub fn interrupt_pin(&self) -> u8 {
        self.pin
    }

    /// The MSI capability and its offset.
    pub fn msi(&self) -> Option<(usize, MsiCap)> {
        self.msi
    }

    /// The MSI-X capability and its offset.
    pub fn msix(&self) -> Option<(usize, MsixCap)> {
        self.msix
    }

    /// Offset of the power management capability.
    pub fn power_management(&self) -> Option<usize> {
        self.pm
    }

    /// Offset of the PCI Express capability.
    pub fn pcie(&self) -> Option<usize> {
        self.pcie
    }

    /// The COMMAND register.
    pub fn command(&self) -> u16 {
        self.u16_at(COMMAND)
    }

    /// The power state from PMCSR (0 = D0, 3 = D3hot); D0 without the capability.
    pub fn power_state(&self) -> u8 {
        self.pm.map_or(0, |pm| (self.u16_at(pm + PmCap::PMCSR) & PM_CTRL_STATE_MASK) as u8)
    }

    /// Reads `data.len()` bytes at `offset`; any size and alignment within the space.
    pub fn read(&self, offset: u64, data: &mut [u8]) -> Result<(), ConfigError> {
        let range = self.range(offset, data.len())?;
        data.copy_from_slice(&self.data[range]);
        Ok(())
    }

    /// Writes `data` at `offset` through the write masks; returns what changed.
    pub fn write(&mut self, offset: u64, data: &[u8]) -> Result<ConfigChanges, ConfigError> {
        let range = self.range(offset, data.len())?;
        let before = self.watched();
        for (at, &byte) in range.zip(data) {
            let kept = self.data[at] & !self.wmask[at];
            self.data[at] = (kept | (byte & self.wmask[at])) & !(byte & self.w1c[at]);
        }
        self.apply_write_rules(&before);
        Ok(before.changes(&self.watched()))
    }

    /// Back to the state [`ConfigSpaceBuilder::build`] produced.
    pub fn reset(&mut self) {
        self.data.copy_from_slice(&self.reset_data);
    }

    /// The STATUS register as config space holds it (the INTERRUPT bit is the interrupt
    /// layer's: see [`IrqRegisters`]).
    pub fn status(&self) -> u16 {
        self.u16_at(STATUS)
    }

    /// Whether COMMAND.BME (bus master enable) is set.
    pub fn bus_master(&self) -> bool {
        self.command() & COMMAND_MASTER != 0
    }

    /// The interrupt-relevant state the guest has written.
    pub fn irq_control(&self) -> IrqControl {
        let mut control = IrqControl {
            intx_disabled: self.command() & COMMAND_INTX_DISABLE != 0,
            bus_master: self.bus_master(),
            ..IrqControl::default()
        };
        if let Some((at, _)) = self.msi {
            let ctrl = self.u16_at(at + MsiCap::CONTROL);
            control.msi_enabled = ctrl & MSI_CTRL_ENABLE != 0;
            control.msi_vectors = 1 << ((ctrl & MSI_CTRL_MME_MASK) >> MSI_CTRL_MME_SHIFT);
        }
        if let Some((at, _)) = self.msix {
            let ctrl = self.u16_at(at + MsixCap::CONTROL);
            control.msix_enabled = ctrl & MSIX_CTRL_ENABLE != 0;
            control.msix_function_mask = ctrl & MSIX_CTRL_FUNCTION_MASK != 0;
        }
        control
    }

    /// The registers the interrupt layer owns, for the adapter to answer.
    pub fn irq_registers(&self) -> IrqRegisters {
        let msi = self.msi;
        IrqRegisters {
            msi_mask: msi.and_then(|(at, m)| m.mask_offset().map(|o| at + o)),
            msi_pending: msi.and_then(|(at, m)| m.pending_offset().map(|o| at + o)),
            msi_vector_bits: msi.map_or(0, |(_, m)| m.vector_bits()),
        }
    }

    /// Records error conditions in STATUS (any of the [`STATUS_W1C`] bits; others are
    /// ignored). The guest clears them by writing 1s.
    pub fn set_status_errors(&mut self, bits: u16) {
        let sts = self.u16_at(STATUS) | (bits & STATUS_W1C);
        self.set_u16(STATUS, sts);
    }

    fn range(&self, offset: u64, len: usize) -> Result<std::ops::Range<usize>, ConfigError> {
        let size = self.size();
        let out = || ConfigError::OutOfRange { offset, len, size };
        let start = usize::try_from(offset).map_err(|_| out())?;
        let end = start.checked_add(len).filter(|&end| end <= size).ok_or_else(out)?;
        Ok(start..end)
    }

    fn render_header(&mut self, ids: &PciIds) {
        self.set_u16(VENDOR_ID, ids.vendor_id);
        self.set_u16(DEVICE_ID, ids.device_id);
        self.data[REVISION_ID] = ids.revision;
        self.data[CLASS_PROG_IF] = ids.class.prog_if;
        self.data[CLASS_PROG_IF + 1] = ids.class.sub;
        self.data[CLASS_PROG_IF + 2] = ids.class.base;
        self.data[HEADER_TYPE] = 0; // type 0, single function
        self.set_u16(SUBSYSTEM_VENDOR_ID, ids.subsystem_vendor_id);
        self.set_u16(SUBSYSTEM_ID, ids.subsystem_id);
        self.data[INTERRUPT_PIN] = self.pin;

        self.set_wmask_u16(COMMAND, COMMAND_IO | COMMAND_MEMORY | COMMAND_MASTER | COMMAND_INTX_DISABLE);
        self.w1c[STATUS..STATUS + 2].copy_from_slice(&STATUS_W1C.to_le_bytes());
        self.wmask[CACHE_LINE_SIZE] = 0xff;
        self.wmask[INTERRUPT_LINE] = 0xff;
        // The expansion ROM BAR (0x30) stays all-zero and read-only: no ROM.

        for (index, bar) in self.bars.into_iter().enumerate() {
            let Some(bar) = bar else { continue };
            let at = BAR0 + 4 * index;
            self.set_u32(at, bar.type_bits());
            self.set_wmask_u32(at, bar.write_mask_low());
            if bar.slots() == 2 {
                self.set_wmask_u32(at + 4, bar.write_mask_high());
            }
        }
    }

    /// Lays the capabilities out from 0x40 and links them (their total size was checked).
    fn place_caps(&mut self, caps: &[Capability]) {
        let mut at = HEADER_END;
        let mut link = CAPABILITY_LIST;
        for cap in caps {
            let image = cap.image();
            let len = image.data.len();
            let end = at + len;
            self.data[at..end].copy_from_slice(&image.data);
            self.wmask[at..end].copy_from_slice(&image.wmask);
            self.w1c[at..end].copy_from_slice(&image.w1c);
            self.data[link] = at as u8;
            link = at + 1;
            match cap {
                Capability::Pm(_) => self.pm = Some(at),
                Capability::Msi(c) => self.msi = Some((at, *c)),
                Capability::Msix(c) => self.msix = Some((at, *c)),
                Capability::Pcie(_) => self.pcie = Some(at),
            }
            at = end.next_multiple_of(4);
        }
        if !caps.is_empty() {
            let sts = self.u16_at(STATUS) | STATUS_CAP_LIST;
            self.set_u16(STATUS, sts);
        }
        // With PCI Express, the extended list at 0x100 starts with an all-zero header:
        // "no extended capabilities".
    }

    /// The registers whose changes [`ConfigSpace::write`] reports.
    fn watched(&self) -> Watched {
        let mut bars = [0; 4 * NUM_BARS];
        bars.copy_from_slice(&self.data[BAR0..BAR0 + 4 * NUM_BARS]);
        Watched {
            command: self.command(),
            irq: self.irq_control(),
            power_state: self.power_state(),
            bars,
            interrupt_line: self.data[INTERRUPT_LINE],
        }
    }

    fn apply_write_rules(&mut self, before: &Watched) {
        if let Some((at, msi)) = self.msi {
            // Clamp Multiple Message Enable to Multiple Message Capable (as QEMU does).
            let ctrl = self.u16_at(at + MsiCap::CONTROL);
            let mme = (ctrl & MSI_CTRL_MME_MASK) >> MSI_CTRL_MME_SHIFT;
            let mmc = msi.vectors.trailing_zeros() as u16;
            if mme > mmc {
                self.set_u16(at + MsiCap::CONTROL, (ctrl & !MSI_CTRL_MME_MASK) | (mmc << MSI_CTRL_MME_SHIFT));
            }
        }
        if let Some(pm) = self.pm {
            // D1 and D2 are not supported: such a write completes but changes nothing.
            let pmcsr = self.u16_at(pm + PmCap::PMCSR);
            if matches!(pmcsr & PM_CTRL_STATE_MASK, 1 | 2) {
                let old = u16::from(before.power_state);
                self.set_u16(pm + PmCap::PMCSR, (pmcsr & !PM_CTRL_STATE_MASK) | old);
            }
        }
    }

    fn u16_at(&self, at: usize) -> u16 {
        u16::from_le_bytes([self.data[at], self.data[at + 1]])
    }

    fn set_u16(&mut self, at: usize, value: u16) {
        self.data[at..at + 2].copy_from_slice(&value.to_le_bytes());
    }

    fn set_u32(&mut self, at: usize, value: u32) {
        self.data[at..at + 4].copy_from_slice(&value.to_le_bytes());
    }

    fn set_wmask_u16(&mut self, at: usize, mask: u16) {
        self.wmask[at..at + 2].copy_from_slice(&mask.to_le_bytes());
    }

    fn set_wmask_u32(&mut self, at: usize, mask: u32) {
        self.wmask[at..at + 4].copy_from_slice(&mask.to_le_bytes());
    }
}

/// A snapshot of the registers a write may report changes of.
struct Watched {
    command: u16,
    irq: IrqControl,
    power_state: u8,
    bars: [u8; 4 * NUM_BARS],
    interrupt_line: u8,
}

impl Watched {
    fn changes(&self, after: &Watched) -> ConfigChanges {
        let mut changes = ConfigChanges::empty();
        changes.set(ConfigChanges::COMMAND, self.command != after.command);
        changes.set(ConfigChanges::INTX_DISABLE, self.irq.intx_disabled != after.irq.intx_disabled);
        changes.set(ConfigChanges::BUS_MASTER, self.irq.bus_master != after.irq.bus_master);
        changes.set(
            ConfigChanges::MSI,
            (self.irq.msi_enabled, self.irq.msi_vectors) != (after.irq.msi_enabled, after.irq.msi_vectors),
        );
        changes.set(
            ConfigChanges::MSIX,
            (self.irq.msix_enabled, self.irq.msix_function_mask)
                != (after.irq.msix_enabled, after.irq.msix_function_mask),
        );
        changes.set(ConfigChanges::POWER_STATE, self.power_state != after.power_state);
        changes.set(ConfigChanges::BAR, self.bars != after.bars);
        changes.set(ConfigChanges::INTERRUPT_LINE, self.interrupt_line != after.interrupt_line);
        changes
    }
}

#[cfg(test)]
mod tests;
