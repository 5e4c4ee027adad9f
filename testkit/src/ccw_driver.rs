//! The guest side: laying out channel programs in guest memory, for drivers, tests and
//! benchmarks written in Rust.
//!
//! A program is a list of [`Op`]s; [`layout`] chains them (chain-command on every CCW but the
//! last), encodes CCWs and IDAW lists, and returns the bytes to write at which guest
//! addresses. Writing them and ringing the doorbell is the caller's business.

use umdev_devices::ccw::program::{flags, Bus, BusError, Ccw, Direction, Partial, Piece, CCW_SIZE};

/// Where a CCW's data lives.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Data {
    /// Contiguous at this guest address.
    Direct(u64),
    /// Scattered: IDAWs (guest addresses of 4 KiB blocks, the first possibly unaligned).
    Idaws(Vec<u64>),
    /// Scattered over 2 KiB blocks.
    Idaws2k(Vec<u64>),
}

/// One CCW of a program.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Op {
    /// Command code ([`umdev_devices::ccw::program::cmd`]).
    pub cmd: u8,
    /// Extra flags (SLI); chaining and IDA are set by [`layout`].
    pub flags: u8,
    /// Byte count.
    pub count: u32,
    /// The data.
    pub data: Data,
}

impl Op {
    /// A CCW moving `count` bytes with `data`.
    pub fn new(cmd: u8, count: u32, data: Data) -> Op {
        Op { cmd, flags: 0, count, data }
    }
}

/// Encodes `ops` as a program at `cpa`, with IDAW lists placed from `idal_area` on (8-byte
/// aligned). Returns `(guest address, bytes)` pairs to write.
pub fn layout(cpa: u64, idal_area: u64, ops: &[Op]) -> Vec<(u64, Vec<u8>)> {
    let mut ccws = Vec::with_capacity(ops.len() * CCW_SIZE as usize);
    let mut writes = Vec::new();
    let mut idal_at = (idal_area + 7) & !7;
    for (i, op) in ops.iter().enumerate() {
        let mut f = op.flags;
        if i + 1 < ops.len() {
            f |= flags::CC;
        }
        let addr = match &op.data {
            Data::Direct(addr) => *addr,
            Data::Idaws(list) | Data::Idaws2k(list) => {
                f |= flags::IDA;
                if matches!(op.data, Data::Idaws2k(_)) {
                    f |= flags::IDA_2K;
                }
                let bytes: Vec<u8> = list.iter().flat_map(|a| a.to_le_bytes()).collect();
                let at = idal_at;
                idal_at += bytes.len() as u64;
                writes.push((at, bytes));
                at
            }
        };
        ccws.extend_from_slice(&Ccw { cmd: op.cmd, flags: f, reserved: 0, count: op.count, addr }.encode());
    }
    writes.insert(0, (cpa, ccws));
    writes
}

/// The IDAWs for `count` bytes spread over `blocks` (4 KiB block addresses), the first
/// starting `first_offset` bytes into its block.
pub fn idaws(blocks: &[u64], first_offset: u64, count: u32) -> Vec<u64> {
    let mut out = Vec::new();
    let mut left = u64::from(count);
    for (i, &b) in blocks.iter().enumerate() {
        if left == 0 {
            break;
        }
        let start = if i == 0 { b + first_offset } else { b };
        let len = (4096 - (start % 4096)).min(left);
        out.push(start);
        left -= len;
    }
    out
}

/// Guest memory as a byte vector starting at address 0, plus a store: the model the
/// interpreter is checked against.
pub struct VecBus {
    /// Guest memory from address 0.
    pub mem: Vec<u8>,
    /// Addresses a transfer to the guest may not write.
    pub read_only: std::ops::Range<u64>,
    /// The store.
    pub store: Vec<u8>,
}

impl VecBus {
    /// `mem` bytes of zeroed memory and `store` bytes of zeroed store.
    pub fn new(mem: usize, store: usize) -> Self {
        VecBus { mem: vec![0; mem], read_only: 0..0, store: vec![0; store] }
    }

    fn range(&self, addr: u64, len: usize) -> Result<std::ops::Range<usize>, BusError> {
        let end = addr.checked_add(len as u64).ok_or(BusError::Unmapped)?;
        if end > self.mem.len() as u64 {
            return Err(BusError::Unmapped);
        }
        Ok(addr as usize..end as usize)
    }

    /// Writes `bytes` at `addr`.
    pub fn put(&mut self, addr: u64, bytes: &[u8]) {
        self.mem[addr as usize..addr as usize + bytes.len()].copy_from_slice(bytes);
    }

    /// Writes one CCW at `at`.
    pub fn ccw(&mut self, at: u64, cmd: u8, flags: u8, count: u32, addr: u64) {
        self.put(at, &Ccw { cmd, flags, reserved: 0, count, addr }.encode());
    }
}

impl Bus for VecBus {
    fn fetch(&mut self, addr: u64, buf: &mut [u8]) -> Result<(), BusError> {
        let r = self.range(addr, buf.len())?;
        buf.copy_from_slice(&self.mem[r]);
        Ok(())
    }
    fn transfer(&mut self, dir: Direction, pieces: &[Piece], store_pos: u64) -> Result<(), Partial> {
        let mut pos = store_pos as usize;
        for p in pieces {
            let moved = (pos - store_pos as usize) as u64;
            let r = self.range(p.addr, p.len as usize).map_err(|error| Partial { error, moved })?;
            let overlaps_ro = p.addr < self.read_only.end && self.read_only.start < p.addr + u64::from(p.len);
            if dir == Direction::ToGuest && overlaps_ro {
                return Err(Partial { error: BusError::ReadOnly, moved });
            }
            let n = p.len as usize;
            match dir {
                Direction::ToGuest => self.mem[r].copy_from_slice(&self.store[pos..pos + n]),
                Direction::FromGuest => self.store[pos..pos + n].copy_from_slice(&self.mem[r]),
            }
            pos += n;
        }
        Ok(())
    }
    fn deliver(&mut self, pieces: &[Piece], data: &[u8]) -> Result<(), Partial> {
        let mut done = 0;
        for p in pieces {
            let n = (p.len as usize).min(data.len() - done);
            let r = self.range(p.addr, n).map_err(|error| Partial { error, moved: done as u64 })?;
            self.mem[r].copy_from_slice(&data[done..done + n]);
            done += n;
        }
        Ok(())
    }
    fn store_size(&self) -> u64 {
        self.store.len() as u64
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use umdev_devices::ccw::program::{cmd, run};

    #[test]
    fn a_laid_out_program_runs() {
        let mut bus = VecBus::new(1 << 20, 1 << 20);
        bus.mem[0x20000..0x23000].fill(0x5a);
        let blocks = [0x21000u64, 0x20000, 0x22000];
        let ops = [
            Op::new(cmd::WRITE, 3 * 4096 - 100, Data::Idaws(idaws(&blocks, 100, 3 * 4096 - 100))),
            Op::new(cmd::NOP, 1, Data::Direct(0)),
        ];
        for (addr, bytes) in layout(0x1000, 0x2000, &ops) {
            bus.put(addr, &bytes);
        }
        let status = run(&mut bus, 0x1000);
        assert!(status.ok(), "{status:?}");
        assert_eq!(status.bytes, 3 * 4096 - 100);
        assert!(bus.store[..3 * 4096 - 100].iter().all(|&b| b == 0x5a));
    }
}
