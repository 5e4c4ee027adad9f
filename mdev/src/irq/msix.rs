//! The MSI-X table and Pending Bit Array as the function presents them in its BARs.
//!
//! Pure register state: entries (address, data, mask bit) and pending bits. Delivery is
//! the interrupt layer's job ([`crate::irq`]), which owns the table and consults it. Many
//! clients (QEMU among them) emulate the table themselves and never access this one; it
//! is here for those that pass table accesses through, and for the PBA, which QEMU does
//! read from the device.

use thiserror::Error;

/// Bytes of one MSI-X table entry.
pub const ENTRY_SIZE: usize = 16;

/// Why an MSI-X table or PBA access was refused.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum MsixError {
    /// Outside the structure, or a table write that is not an aligned dword or qword.
    #[error("MSI-X {what} access of {len} bytes at {offset:#x} is out of range or misaligned")]
    BadAccess {
        /// "table" or "PBA".
        what: &'static str,
        /// Offset within the structure.
        offset: u64,
        /// Length of the access.
        len: usize,
    },
}

/// One table entry.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MsixEntry {
    /// Message address.
    pub addr: u64,
    /// Message data.
    pub data: u32,
    /// Vector Control mask bit.
    pub masked: bool,
}

impl MsixEntry {
    /// The reset state: zero address and data, masked (PCI 3.0 §6.8.2.9).
    pub const RESET: MsixEntry = MsixEntry { addr: 0, data: 0, masked: true };

    fn dword(&self, index: usize) -> u32 {
        match index {
            0 => self.addr as u32,
            1 => (self.addr >> 32) as u32,
            2 => self.data,
            _ => u32::from(self.masked),
        }
    }

    fn set_dword(&mut self, index: usize, value: u32) {
        match index {
            // Address bits 1:0 must be written as zero; keep them zero.
            0 => self.addr = (self.addr & !0xffff_ffff) | u64::from(value & !0b11),
            1 => self.addr = (self.addr & 0xffff_ffff) | (u64::from(value) << 32),
            2 => self.data = value,
            // Only the mask bit is defined in Vector Control.
            _ => self.masked = value & 1 != 0,
        }
    }
}

/// A function's MSI-X table and PBA.
#[derive(Clone, Debug)]
pub struct MsixTable {
    entries: Vec<MsixEntry>,
    pba: Vec<u64>,
}

impl MsixTable {
    /// A table of `vectors` entries in the reset state (all masked, none pending).
    pub fn new(vectors: u16) -> Self {
        let vectors = usize::from(vectors);
        MsixTable { entries: vec![MsixEntry::RESET; vectors], pba: vec![0; vectors.div_ceil(64)] }
    }

    /// Table entries.
    pub fn vectors(&self) -> u16 {
        self.entries.len() as u16
    }

    /// Entry `vector`.
    pub fn entry(&self, vector: u16) -> Option<MsixEntry> {
        self.entries.get(usize::from(vector)).copied()
    }

    /// Whether `vector`'s mask bit is set (true for a vector that does not exist).
    pub fn is_masked(&self, vector: u16) -> bool {
        self.entries.get(usize::from(vector)).is_none_or(|e| e.masked)
    }

    /// Sets or clears `vector`'s mask bit; ignored for a vector that does not exist.
    pub fn set_masked(&mut self, vector: u16, masked: bool) {
        if let Some(e) = self.entries.get_mut(usize::from(vector)) {
            e.masked = masked;
        }
    }

    /// Whether `vector`'s pending bit is set.
    pub fn is_pending(&self, vector: u16) -> bool {
        usize::from(vector) < self.entries.len()
            && self.pba[usize::from(vector / 64)] & (1 << (vector % 64)) != 0
    }

    /// Sets or clears `vector`'s pending bit; ignored for a vector that does not exist.
    pub fn set_pending(&mut self, vector: u16, pending: bool) {
        if usize::from(vector) < self.entries.len() {
            let (word, bit) = (usize::from(vector / 64), 1u64 << (vector % 64));
            if pending {
                self.pba[word] |= bit;
            } else {
                self.pba[word] &= !bit;
            }
        }
    }

    /// Clears every pending bit.
    pub fn clear_pending(&mut self) {
        self.pba.fill(0);
    }

    /// Back to the reset state.
    pub fn reset(&mut self) {
        self.entries.fill(MsixEntry::RESET);
        self.pba.fill(0);
    }

    /// Reads table bytes at `offset` (from the table's start); any size within the table.
    pub fn read_table(&self, offset: u64, data: &mut [u8]) -> Result<(), MsixError> {
        let start = self.check("table", offset, data.len(), self.entries.len() * ENTRY_SIZE)?;
        for (i, byte) in data.iter_mut().enumerate() {
            let at = start + i;
            let dword = self.entries[at / 16].dword((at % 16) / 4);
            *byte = dword.to_le_bytes()[at % 4];
        }
        Ok(())
    }

    /// Writes table bytes at `offset`: an aligned dword or qword, as the spec requires.
    pub fn write_table(&mut self, offset: u64, data: &[u8]) -> Result<(), MsixError> {
        let len = data.len();
        let start = self.check("table", offset, len, self.entries.len() * ENTRY_SIZE)?;
        if !matches!(len, 4 | 8) || start % len != 0 {
            return Err(MsixError::BadAccess { what: "table", offset, len });
        }
        for (i, chunk) in data.chunks_exact(4).enumerate() {
            let at = start + 4 * i;
            let value = u32::from_le_bytes([chunk[0], chunk[1], chunk[2], chunk[3]]);
            self.entries[at / 16].set_dword((at % 16) / 4, value);
        }
        Ok(())
    }

    /// Reads PBA bytes at `offset` (from the PBA's start); any size within the PBA.
    pub fn read_pba(&self, offset: u64, data: &mut [u8]) -> Result<(), MsixError> {
        let start = self.check("PBA", offset, data.len(), self.pba.len() * 8)?;
        for (i, byte) in data.iter_mut().enumerate() {
            let at = start + i;
            *byte = self.pba[at / 8].to_le_bytes()[at % 8];
        }
        Ok(())
    }

    fn check(&self, what: &'static str, offset: u64, len: usize, size: usize) -> Result<usize, MsixError> {
        let bad = || MsixError::BadAccess { what, offset, len };
        let start = usize::try_from(offset).map_err(|_| bad())?;
        start.checked_add(len).filter(|&end| end <= size).ok_or_else(bad)?;
        Ok(start)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entries_reset_masked() {
        let table = MsixTable::new(3);
        let mut b = [0; 16];
        table.read_table(16, &mut b).unwrap();
        assert_eq!(b, [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0]);
        assert!((0..3).all(|v| table.is_masked(v)));
        assert!(table.is_masked(3), "a missing vector counts as masked");
    }

    #[test]
    fn dword_and_qword_writes() {
        let mut table = MsixTable::new(2);
        table.write_table(16, &0x0000_0001_fee0_0003u64.to_le_bytes()).unwrap();
        table.write_table(24, &0x4021u32.to_le_bytes()).unwrap();
        table.write_table(28, &0xffff_fffeu32.to_le_bytes()).unwrap();
        assert_eq!(table.entry(1), Some(MsixEntry { addr: 0x1_fee0_0000, data: 0x4021, masked: false }));
        let mut b = [0; 4];
        table.read_table(28, &mut b).unwrap();
        assert_eq!(u32::from_le_bytes(b), 0, "reserved vector-control bits read 0");
        // Data + vector control in one qword.
        table.write_table(8, &((1u64 << 32) | 0x55).to_le_bytes()).unwrap();
        assert_eq!(table.entry(0), Some(MsixEntry { addr: 0, data: 0x55, masked: true }));
    }

    #[test]
    fn bad_table_accesses_are_refused() {
        let mut table = MsixTable::new(2);
        assert!(table.write_table(2, &[0; 4]).is_err(), "misaligned");
        assert!(table.write_table(4, &[0; 8]).is_err(), "qword not qword-aligned");
        assert!(table.write_table(0, &[0; 2]).is_err(), "word write");
        assert!(table.write_table(32, &[0; 4]).is_err(), "past the end");
        assert!(table.read_table(30, &mut [0; 4]).is_err());
        assert!(table.read_table(u64::MAX, &mut [0; 1]).is_err());
    }

    #[test]
    fn pending_bits_show_in_the_pba() {
        let mut table = MsixTable::new(70);
        table.set_pending(0, true);
        table.set_pending(65, true);
        table.set_pending(70, true); // no such vector: ignored
        let mut b = [0; 16];
        table.read_pba(0, &mut b).unwrap();
        assert_eq!(u64::from_le_bytes(b[..8].try_into().unwrap()), 1);
        assert_eq!(u64::from_le_bytes(b[8..].try_into().unwrap()), 2);
        assert!(table.read_pba(16, &mut [0; 1]).is_err());
        table.set_pending(65, false);
        assert!(!table.is_pending(65) && table.is_pending(0));
        table.reset();
        assert!(!table.is_pending(0));
    }
}
