//! Capability structures: what a device declares, and each structure's layout, reset
//! values and write masks.
//!
//! A capability is rendered into a `CapImage` that knows nothing of where it lands; the
//! config-space builder places it, links the `next` pointers and copies it in.

use super::regs::*;

/// MSI as declared: vector count, per-vector masking, address width.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MsiCap {
    /// Vectors the function can use (Multiple Message Capable): 1, 2, 4, 8, 16 or 32.
    pub vectors: u32,
    /// Per-vector mask and pending registers are present.
    pub per_vector_mask: bool,
    /// 64-bit message address.
    pub addr64: bool,
}

impl MsiCap {
    /// Offset of Message Control within the capability.
    pub const CONTROL: usize = 2;

    fn data_offset(&self) -> usize {
        if self.addr64 {
            0x0c
        } else {
            0x08
        }
    }

    /// Offset of the Mask Bits register within the capability, if present.
    pub fn mask_offset(&self) -> Option<usize> {
        self.per_vector_mask.then(|| self.data_offset() + 4)
    }

    /// Offset of the Pending Bits register within the capability, if present.
    pub fn pending_offset(&self) -> Option<usize> {
        self.per_vector_mask.then(|| self.data_offset() + 8)
    }

    /// Bytes the capability takes (rounded up to whole dwords).
    pub fn size(&self) -> usize {
        match self.pending_offset() {
            Some(pending) => pending + 4,
            None => self.data_offset() + 4,
        }
    }

    /// Bits of the mask register that name implemented vectors.
    pub fn vector_bits(&self) -> u32 {
        if self.vectors >= 32 {
            u32::MAX
        } else {
            (1u32 << self.vectors) - 1
        }
    }

    pub(crate) fn image(&self) -> CapImage {
        let mut cap = CapImage::new(CAP_ID_MSI, self.size());
        let mmc = self.vectors.trailing_zeros() as u16;
        let mut control = mmc << MSI_CTRL_MMC_SHIFT;
        if self.addr64 {
            control |= MSI_CTRL_64BIT;
        }
        if self.per_vector_mask {
            control |= MSI_CTRL_PER_VECTOR_MASK;
        }
        cap.set16(Self::CONTROL, control, MSI_CTRL_ENABLE | MSI_CTRL_MME_MASK);
        cap.set32(4, 0, 0xffff_fffc); // message address, dword aligned
        if self.addr64 {
            cap.set32(8, 0, u32::MAX);
        }
        cap.set16(self.data_offset(), 0, u16::MAX);
        // The Mask Bits and Pending Bits registers are the interrupt layer's (the adapter
        // answers and forwards them): nothing here is writable.
        cap
    }
}

/// MSI-X as declared: table size and where the table and PBA live (what
/// [`ConfigSpaceBuilder::msix`](super::ConfigSpaceBuilder::msix) takes, each number named).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MsixCap {
    /// Table entries (1..=2048).
    pub vectors: u16,
    /// BAR holding the table.
    pub table_bar: u8,
    /// Offset of the table in its BAR (8-byte aligned).
    pub table_offset: u32,
    /// BAR holding the Pending Bit Array.
    pub pba_bar: u8,
    /// Offset of the PBA in its BAR (8-byte aligned).
    pub pba_offset: u32,
}

impl MsixCap {
    /// Offset of Message Control within the capability.
    pub const CONTROL: usize = 2;
    /// Bytes the capability takes.
    pub const LEN: usize = 12;
    /// Bytes per table entry.
    pub const ENTRY_SIZE: u64 = 16;

    /// Bytes of the table.
    pub fn table_size(&self) -> u64 {
        u64::from(self.vectors) * Self::ENTRY_SIZE
    }

    /// Bytes of the PBA: one bit per vector, in whole qwords.
    pub fn pba_size(&self) -> u64 {
        u64::from(self.vectors).div_ceil(64) * 8
    }

    pub(crate) fn image(&self) -> CapImage {
        let mut cap = CapImage::new(CAP_ID_MSIX, Self::LEN);
        let control = (self.vectors - 1) & MSIX_CTRL_TABLE_SIZE_MASK;
        cap.set16(Self::CONTROL, control, MSIX_CTRL_ENABLE | MSIX_CTRL_FUNCTION_MASK);
        cap.set32(4, self.table_offset | u32::from(self.table_bar), 0);
        cap.set32(8, self.pba_offset | u32::from(self.pba_bar), 0);
        cap
    }
}

/// Power management, version 3: D0 and D3hot only, no PME.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PmCap;

impl PmCap {
    /// Offset of PMCSR (control/status) within the capability.
    pub const PMCSR: usize = 4;
    /// Bytes the capability takes.
    pub const LEN: usize = 8;

    pub(crate) fn image(&self) -> CapImage {
        let mut cap = CapImage::new(CAP_ID_PM, Self::LEN);
        cap.set16(2, 3, 0); // PMC: version 3, no D1/D2, no PME
                            // No_Soft_Reset: a D3hot -> D0 transition keeps the function's state, so the
                            // emulation needs no reset on it.
        cap.set16(Self::PMCSR, PM_CTRL_NO_SOFT_RESET, PM_CTRL_STATE_MASK);
        cap
    }
}

/// PCI Express capability (version 2) of an endpoint: 128-byte payloads, 2.5 GT/s x1,
/// no slot, no FLR, no ASPM.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PcieCap;

impl PcieCap {
    /// Offset of Device Control within the capability.
    pub const DEVICE_CONTROL: usize = 0x08;
    /// Offset of Device Status within the capability.
    pub const DEVICE_STATUS: usize = 0x0a;
    /// Offset of Link Control within the capability.
    pub const LINK_CONTROL: usize = 0x10;
    /// Bytes the capability takes.
    pub const LEN: usize = 0x3c;

    pub(crate) fn image(&self) -> CapImage {
        let mut cap = CapImage::new(CAP_ID_EXP, Self::LEN);
        cap.set16(0x02, 0x0002, 0); // version 2, device/port type 0: PCI Express endpoint
        cap.set32(0x04, 1 << 15, 0); // DevCap: 128B MPS, role-based error reporting
                                     // DevCtl: error reporting enables, relaxed ordering, no snoop and max read request
                                     // size are writable; reset value: relaxed ordering, no snoop, 512-byte MRRS.
        cap.set16(Self::DEVICE_CONTROL, 0x2810, 0x781f);
        cap.set16(Self::DEVICE_STATUS, 0, 0);
        cap.w1c16(Self::DEVICE_STATUS, 0x000f); // error detected bits
        cap.set32(0x0c, 0x0000_0011, 0); // LinkCap: 2.5 GT/s, x1, port 0
        cap.set16(Self::LINK_CONTROL, 0, 0x00c3); // ASPM control, common clock, ext. synch
        cap.set16(0x12, 0x0011, 0); // LinkSta: 2.5 GT/s, x1
        cap.set32(0x2c, 0x0000_0002, 0); // LinkCap2: 2.5 GT/s supported
        cap.set16(0x30, 0x0001, 0); // LinkCtl2: target 2.5 GT/s
        cap
    }
}

/// A capability's bytes and write semantics, before placement. Byte 0 is the ID and byte 1
/// the `next` pointer (filled in by the builder).
#[derive(Clone, Debug)]
pub(crate) struct CapImage {
    pub(crate) data: Vec<u8>,
    pub(crate) wmask: Vec<u8>,
    pub(crate) w1c: Vec<u8>,
}

impl CapImage {
    fn new(id: u8, len: usize) -> Self {
        let mut data = vec![0; len];
        data[0] = id;
        CapImage { data, wmask: vec![0; len], w1c: vec![0; len] }
    }

    fn set16(&mut self, offset: usize, value: u16, wmask: u16) {
        self.data[offset..offset + 2].copy_from_slice(&value.to_le_bytes());
        self.wmask[offset..offset + 2].copy_from_slice(&wmask.to_le_bytes());
    }

    fn set32(&mut self, offset: usize, value: u32, wmask: u32) {
        self.data[offset..offset + 4].copy_from_slice(&value.to_le_bytes());
        self.wmask[offset..offset + 4].copy_from_slice(&wmask.to_le_bytes());
    }

    fn w1c16(&mut self, offset: usize, bits: u16) {
        self.w1c[offset..offset + 2].copy_from_slice(&bits.to_le_bytes());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn msi_layouts_match_the_spec() {
        let cap = |addr64, per_vector_mask| MsiCap { vectors: 4, per_vector_mask, addr64 };
        assert_eq!(cap(false, false).size(), 0x0c);
        assert_eq!(cap(true, false).size(), 0x10);
        assert_eq!(cap(false, true).size(), 0x14);
        assert_eq!(cap(true, true).size(), 0x18);
        assert_eq!(cap(true, true).mask_offset(), Some(0x10));
        assert_eq!(cap(true, true).pending_offset(), Some(0x14));
        assert_eq!(cap(false, true).mask_offset(), Some(0x0c));
        assert_eq!(cap(true, false).mask_offset(), None);
        let image = cap(true, true).image();
        // MMC = log2(4) = 2, 64-bit, per-vector mask.
        assert_eq!(u16::from_le_bytes([image.data[2], image.data[3]]), (2 << 1) | (1 << 7) | (1 << 8));
        assert_eq!(MsiCap { vectors: 32, per_vector_mask: true, addr64: false }.vector_bits(), u32::MAX);
    }

    #[test]
    fn msix_sizes() {
        let cap = MsixCap { vectors: 65, table_bar: 0, table_offset: 0, pba_bar: 0, pba_offset: 0x1000 };
        assert_eq!(cap.table_size(), 65 * 16);
        assert_eq!(cap.pba_size(), 16);
        let image = cap.image();
        assert_eq!(u16::from_le_bytes([image.data[2], image.data[3]]), 64);
    }
}
