//! The guest side: laying out channel programs in guest memory, for drivers, tests and
//! benchmarks written in Rust.
//!
//! A program is a list of [`Op`]s; [`layout`] chains them (chain-command on every CCW but the
//! last), encodes CCWs and IDAW lists, and returns the bytes to write at which guest
//! addresses. Writing them and ringing the doorbell is the caller's business.

use super::program::{flags, Ccw, CCW_SIZE};

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
    /// Command code ([`super::program::cmd`]).
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

#[cfg(test)]
mod tests {
    use super::super::program::tests::VecBus;
    use super::super::program::{cmd, run};
    use super::*;

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
