//! The byte format of fuzzer inputs: every byte string decodes to a valid program.

use super::op::*;
use crate::PinMode;

/// The page a byte names: the low window, the high window or a page without an address.
pub fn page_of(b: u8) -> u64 {
    match b {
        0..=0xbf => u64::from(b) % (LOW_PAGES + 4),
        0xc0..=0xef => HIGH_BASE + u64::from(b - 0xc0) % HIGH_PAGES,
        _ => SPECIAL_PFNS[usize::from(b - 0xf0) % SPECIAL_PFNS.len()],
    }
}

/// The byte [`page_of`] maps to `page`; pages outside the windows come out as page 0.
pub fn byte_of(page: u64) -> u8 {
    if page < LOW_PAGES + 4 {
        page as u8
    } else if (HIGH_BASE..HIGH_BASE + HIGH_PAGES).contains(&page) {
        0xc0 + (page - HIGH_BASE) as u8
    } else {
        SPECIAL_PFNS.iter().position(|&s| s == page).map_or(0, |i| 0xf0 + i as u8)
    }
}

/// Maps `page` (a mapping's first page) into the windows.
fn map_page_of(b: u8) -> u64 {
    let page = page_of(b);
    if page >= HIGH_BASE + HIGH_PAGES {
        HIGH_BASE
    } else {
        page
    }
}

struct Bytes<'a> {
    data: &'a [u8],
}

impl Bytes<'_> {
    fn byte(&mut self) -> Option<u8> {
        let (&b, rest) = self.data.split_first()?;
        self.data = rest;
        Some(b)
    }

    fn u16(&mut self) -> Option<u16> {
        Some(u16::from_le_bytes([self.byte()?, self.byte()?]))
    }

    fn pages(&mut self) -> Option<Vec<u64>> {
        let n = self.byte()? & 0x3f;
        (0..n).map(|_| self.byte().map(page_of)).collect()
    }
}

/// The access a pin asks for, from its write bit and its other bit: read (neither), write,
/// both, or (the other bit alone) none, which is refused. Inputs written before pins could
/// ask for none or both set only the write bit.
fn pin_prot(write: bool, other: bool) -> u32 {
    match (write, other) {
        (false, false) => 1,
        (true, false) => 2,
        (true, true) => 3,
        (false, true) => 0,
    }
}

/// The write bit and the other bit of [`pin_prot`]'s `prot` (bits above 3 dropped).
fn pin_bits(prot: u32) -> (bool, bool) {
    match prot & 3 {
        1 => (false, false),
        2 => (true, false),
        3 => (true, true),
        _ => (false, true),
    }
}

/// Decodes bytes into a pin mode and ops; every byte string decodes (a truncated op is
/// dropped).
///
/// Byte 0: bit 1 selects [`PinMode::Kernel`], else bit 0 [`PinMode::Lock`]. Then ops, each an opcode byte (modulo 12) and
/// its arguments: pages are one byte each ([`page_of`]), arrays a length byte (low 6 bits,
/// so up to 63 entries; for pins bit 7 = write, bit 6 = the other access bit) then the pages.
/// A pin's access is read, write (the write bit), both (both bits) or none (the other bit
/// alone).
///
/// | opcode | op | arguments |
/// |---|---|---|
/// | 0 | Map | page, pages (mod 17), flags: prot = bits 0-1, message-only = bit 2, offset = bits 3-4 |
/// | 1 | Unmap | page, pages (mod 25) |
/// | 2 | UnmapAll | |
/// | 3 | Pin | length/access byte, pages |
/// | 4 | Pin (IDAW style) | byte: runs = 1 + bits 0-1, write = bit 7, other access bit = bit 6; per run: page, length (mod 8) |
/// | 5 | PinRange | page, pages (mod 41), access: write = bit 0, other = bit 1 |
/// | 6, 7, 8 | Drop, Forget, UnpinKept | which |
/// | 9 | UnpinAny | length byte, pages |
/// | 10 | UnpinAnyRange | page, pages (mod 41) |
/// | 11 | Access | which, offset (u16), length (u16 mod 12289), write (bit 0) |
pub fn decode(data: &[u8]) -> (PinMode, Vec<Op>) {
    let mut b = Bytes { data };
    let mode = match b.byte() {
        Some(m) if m & 2 != 0 => PinMode::Kernel,
        Some(m) if m & 1 != 0 => PinMode::Lock,
        _ => PinMode::Track,
    };
    let mut ops = Vec::new();
    while ops.len() < MAX_OPS {
        let Some(op) = decode_op(&mut b) else { break };
        ops.push(op);
    }
    (mode, ops)
}

fn decode_op(b: &mut Bytes<'_>) -> Option<Op> {
    Some(match b.byte()? % 12 {
        0 => {
            let (page, pages, flags) = (map_page_of(b.byte()?), u64::from(b.byte()? % 17), b.byte()?);
            Op::Map {
                page,
                pages,
                prot: u32::from(flags & 3),
                message_only: flags & 4 != 0,
                offset_pages: u64::from((flags >> 3) & 3),
            }
        }
        1 => Op::Unmap { page: map_page_of(b.byte()?), pages: u64::from(b.byte()? % 25) },
        2 => Op::UnmapAll,
        3 => {
            let head = *b.data.first()?;
            Op::Pin { pfns: b.pages()?, prot: pin_prot(head & 0x80 != 0, head & 0x40 != 0) }
        }
        4 => {
            let head = b.byte()?;
            let mut pfns = Vec::new();
            for _ in 0..1 + (head & 3) {
                let (start, len) = (page_of(b.byte()?), b.byte()? % 8);
                pfns.extend((0..u64::from(len)).map(|k| start.wrapping_add(k)));
            }
            Op::Pin { pfns, prot: pin_prot(head & 0x80 != 0, head & 0x40 != 0) }
        }
        5 => {
            let (page, pages, access) = (map_page_of(b.byte()?), u64::from(b.byte()? % 41), b.byte()?);
            Op::PinRange { page, pages, prot: pin_prot(access & 1 != 0, access & 2 != 0) }
        }
        6 => Op::Drop { which: usize::from(b.byte()?) },
        7 => Op::Forget { which: usize::from(b.byte()?) },
        8 => Op::UnpinKept { which: usize::from(b.byte()?), part: 0 },
        9 => Op::UnpinAny { pfns: b.pages()? },
        10 => Op::UnpinAnyRange { page: map_page_of(b.byte()?), pages: u64::from(b.byte()? % 41) },
        _ => Op::Access {
            which: usize::from(b.byte()?),
            offset: u64::from(b.u16()?),
            len: u64::from(b.u16()? % 12289),
            write: b.byte()? & 1 != 0,
        },
    })
}

/// Encodes ops so that [`decode`] gives them back (for seeds). Values outside what the
/// format can say are clamped: pages outside the windows become page 0, arrays are cut to
/// 63 entries, counts are taken modulo the format's range, `which` modulo 256.
pub fn encode(mode: PinMode, ops: &[Op]) -> Vec<u8> {
    let mut out = vec![match mode {
        PinMode::Track => 0,
        PinMode::Lock => 1,
        PinMode::Kernel => 2,
    }];
    let array = |out: &mut Vec<u8>, pfns: &[u64], (write, other): (bool, bool)| {
        let n = pfns.len().min(63);
        out.push(n as u8 | if write { 0x80 } else { 0 } | if other { 0x40 } else { 0 });
        out.extend(pfns[..n].iter().map(|&p| byte_of(p)));
    };
    for op in ops {
        match op {
            Op::Map { page, pages, prot, message_only, offset_pages } => {
                let flags =
                    (*prot as u8 & 3) | if *message_only { 4 } else { 0 } | ((*offset_pages as u8 & 3) << 3);
                out.extend([0, byte_of(*page), *pages as u8, flags]);
            }
            Op::Unmap { page, pages } => out.extend([1, byte_of(*page), *pages as u8]),
            Op::UnmapAll => out.push(2),
            Op::Pin { pfns, prot } => {
                out.push(3);
                array(&mut out, pfns, pin_bits(*prot));
            }
            Op::PinRange { page, pages, prot } => {
                let (write, other) = pin_bits(*prot);
                out.extend([5, byte_of(*page), *pages as u8, u8::from(write) | (u8::from(other) << 1)])
            }
            Op::Drop { which } => out.extend([6, *which as u8]),
            Op::Forget { which } => out.extend([7, *which as u8]),
            Op::UnpinKept { which, .. } => out.extend([8, *which as u8]),
            Op::UnpinAny { pfns } => {
                out.push(9);
                array(&mut out, pfns, (false, false));
            }
            Op::UnpinAnyRange { page, pages } => out.extend([10, byte_of(*page), *pages as u8]),
            Op::Access { which, offset, len, write } => {
                out.extend([11, *which as u8]);
                out.extend_from_slice(&(*offset as u16).to_le_bytes());
                out.extend_from_slice(&(*len as u16).to_le_bytes());
                out.push(u8::from(*write));
            }
        }
    }
    out
}
