//! The channel-program interpreter: fetches and checks CCWs and IDAW lists, and hands each
//! data transfer to a [`Bus`] as a list of guest pieces.
//!
//! It knows nothing of pinning or of the backing store: the device's bus pins and copies, a
//! test or fuzz bus can model guest memory with a `Vec`. Every way a program can be wrong ends
//! in a [`Status`] with a documented [`Reason`]; nothing panics and nothing loops forever
//! (at most [`MAX_CCWS`] CCWs execute, and revisiting a CCW is a loop).

use vm_memory::{ByteValued, Le16, Le32, Le64};

/// Bytes of one CCW.
pub const CCW_SIZE: u64 = 16;
/// Most CCWs one program may execute (TICs included), as vfio-ccw's chain limit.
pub const MAX_CCWS: usize = 256;
/// Most bytes one CCW may move (16 MiB: 4096 4K IDAWs).
pub const MAX_CCW_COUNT: u32 = 16 << 20;

/// Command codes.
pub mod cmd {
    /// Guest memory to the store.
    pub const WRITE: u8 = 0x01;
    /// The store to guest memory.
    pub const READ: u8 = 0x02;
    /// No data transfer.
    pub const NOP: u8 = 0x03;
    /// 32 bytes of sense data to guest memory.
    pub const SENSE: u8 = 0x04;
    /// Set the store position from an 8-byte little-endian value in guest memory.
    pub const SEEK: u8 = 0x07;
    /// Transfer in channel: continue at the data address.
    pub const TIC: u8 = 0x08;
}

/// CCW flag bits.
pub mod flags {
    /// Chain data: not supported (program check).
    pub const CD: u8 = 0x80;
    /// Chain command: another CCW follows.
    pub const CC: u8 = 0x40;
    /// Suppress incorrect-length indication.
    pub const SLI: u8 = 0x20;
    /// The data address points at an IDAW list.
    pub const IDA: u8 = 0x04;
    /// IDAWs address 2 KiB blocks instead of 4 KiB.
    pub const IDA_2K: u8 = 0x02;
    /// Bits a CCW may set.
    pub const KNOWN: u8 = CD | CC | SLI | IDA | IDA_2K;
}

/// Device status bits of a [`Status`].
pub mod dstat {
    /// Channel end.
    pub const CE: u8 = 0x08;
    /// Device end.
    pub const DE: u8 = 0x04;
    /// Unit check: the device refused (see the reason).
    pub const UC: u8 = 0x02;
    /// Unit exception: the program was stopped from outside (halt, unmap, reset).
    pub const UE: u8 = 0x01;
}

/// Subchannel status bits of a [`Status`].
pub mod cstat {
    /// The CCW count differed from what the device moves (SENSE without SLI).
    pub const INCORRECT_LENGTH: u8 = 0x40;
    /// A malformed program, CCW or IDAW, or an address outside guest memory.
    pub const PROGRAM_CHECK: u8 = 0x20;
    /// The guest memory does not permit the access (a READ into read-only memory).
    pub const PROTECTION_CHECK: u8 = 0x10;
    /// The channel could not reach guest memory at all: bus mastering is off.
    pub const CHANNEL_CONTROL_CHECK: u8 = 0x04;
}

/// Why a program ended the way it did (the status block's reason field).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u32)]
pub enum Reason {
    /// Normal completion.
    Ok = 0,
    /// A CCW address not 8-byte aligned.
    CcwMisaligned = 1,
    /// A CCW lies outside guest memory.
    CcwUnmapped = 2,
    /// Reserved bits set, or chain data asked for.
    BadCcw = 3,
    /// An unknown command code.
    BadCommand = 4,
    /// Count 0 or above [`MAX_CCW_COUNT`].
    BadCount = 5,
    /// More than [`MAX_CCWS`] CCWs.
    ChainTooLong = 6,
    /// A TIC to a TIC.
    TicToTic = 7,
    /// A CCW executed twice: the program loops.
    TicLoop = 8,
    /// The IDAW list is not 8-byte aligned.
    IdalMisaligned = 9,
    /// The IDAW list runs into memory outside guest memory.
    IdalUnmapped = 10,
    /// An IDAW after the first is not block aligned.
    IdawMisaligned = 11,
    /// The data lies outside guest memory.
    DataUnmapped = 12,
    /// The data is read-only and the command writes it.
    DataReadOnly = 13,
    /// The transfer runs past the end of the store.
    EndOfStore = 14,
    /// A SEEK beyond the end of the store.
    SeekOutOfRange = 15,
    /// Stopped: the guest memory it used was unmapped.
    Unmapped = 16,
    /// Stopped by a halt or a reset.
    Halted = 17,
    /// The device could not pin or copy for a reason of its own (lock limit, ...).
    DeviceError = 18,
    /// Bus mastering is off (PCI COMMAND.BME clear): the device may not touch guest memory.
    BusMasterOff = 19,
}

impl Reason {
    /// Every reason, by code.
    pub const ALL: [Reason; 20] = [
        Reason::Ok,
        Reason::CcwMisaligned,
        Reason::CcwUnmapped,
        Reason::BadCcw,
        Reason::BadCommand,
        Reason::BadCount,
        Reason::ChainTooLong,
        Reason::TicToTic,
        Reason::TicLoop,
        Reason::IdalMisaligned,
        Reason::IdalUnmapped,
        Reason::IdawMisaligned,
        Reason::DataUnmapped,
        Reason::DataReadOnly,
        Reason::EndOfStore,
        Reason::SeekOutOfRange,
        Reason::Unmapped,
        Reason::Halted,
        Reason::DeviceError,
        Reason::BusMasterOff,
    ];

    /// The reason with this code.
    pub fn from_code(code: u32) -> Option<Reason> {
        Self::ALL.get(code as usize).copied()
    }

    /// The status bits a program ending for this reason reports: CE|DE for Ok, unit check
    /// for the device's refusals, unit exception when stopped from outside, a protection
    /// check for read-only memory, a channel-control check with bus mastering off, and a
    /// program check for everything wrong with the program itself.
    pub fn status_bits(self) -> (u8, u8) {
        match self {
            Reason::Ok => (dstat::CE | dstat::DE, 0),
            Reason::BadCommand | Reason::EndOfStore | Reason::SeekOutOfRange | Reason::DeviceError => {
                (dstat::UC, 0)
            }
            Reason::DataReadOnly => (0, cstat::PROTECTION_CHECK),
            Reason::Unmapped | Reason::Halted => (dstat::UE, 0),
            Reason::BusMasterOff => (0, cstat::CHANNEL_CONTROL_CHECK),
            _ => (0, cstat::PROGRAM_CHECK),
        }
    }
}

/// How a program ended: written to the guest's status block and mirrored in registers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Status {
    /// Device status bits ([`dstat`]).
    pub dstat: u8,
    /// Subchannel status bits ([`cstat`]).
    pub cstat: u8,
    /// Bytes of the last CCW's count not transferred.
    pub residual: u32,
    /// Address of the CCW after the last one fetched (the SCSW's CPA convention).
    pub cpa: u64,
    /// Why.
    pub reason: Reason,
    /// CCWs executed (TICs included).
    pub ccws: u32,
    /// Data bytes moved by the whole program.
    pub bytes: u64,
}

/// Bytes of the status block in guest memory.
pub const STATUS_SIZE: usize = 32;

/// The status block as it sits in guest memory (docs/ccw.md, "Status block").
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StatusBlock {
    /// Device status.
    pub dstat: u8,
    /// Subchannel status.
    pub cstat: u8,
    /// Reserved (0).
    pub reserved: Le16,
    /// Residual count of the last CCW executed.
    pub residual: Le32,
    /// CPA out.
    pub cpa: Le64,
    /// Reason code.
    pub reason: Le32,
    /// CCWs executed.
    pub ccws: Le32,
    /// Data bytes moved.
    pub bytes: Le64,
}

// SAFETY: plain little-endian integers in a `repr(C)` struct whose fields sit at their
// natural alignment with no padding (the size is checked below); every bit pattern is a
// valid value.
unsafe impl ByteValued for StatusBlock {}
const _: () = assert!(size_of::<StatusBlock>() == STATUS_SIZE);

impl Status {
    /// The status block for guest memory.
    pub fn block(&self) -> StatusBlock {
        StatusBlock {
            dstat: self.dstat,
            cstat: self.cstat,
            reserved: Le16::from(0),
            residual: self.residual.into(),
            cpa: self.cpa.into(),
            reason: (self.reason as u32).into(),
            ccws: self.ccws.into(),
            bytes: self.bytes.into(),
        }
    }

    /// The 32 bytes of the status block.
    pub fn encode(&self) -> [u8; STATUS_SIZE] {
        let mut b = [0u8; STATUS_SIZE];
        b.copy_from_slice(self.block().as_slice());
        b
    }

    /// A status read back from a status block; `None` for an unknown reason.
    pub fn from_block(block: &StatusBlock) -> Option<Status> {
        Some(Status {
            dstat: block.dstat,
            cstat: block.cstat,
            residual: block.residual.into(),
            cpa: block.cpa.into(),
            reason: Reason::from_code(block.reason.into())?,
            ccws: block.ccws.into(),
            bytes: block.bytes.into(),
        })
    }

    /// Decodes the 32 bytes of a status block; `None` for an unknown reason.
    pub fn decode(b: &[u8; STATUS_SIZE]) -> Option<Status> {
        let mut block = StatusBlock::default();
        block.as_mut_slice().copy_from_slice(b);
        Self::from_block(&block)
    }

    /// True for a clean completion.
    pub fn ok(&self) -> bool {
        self.reason == Reason::Ok
    }
}

/// Which way data moves.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Direction {
    /// The store (or sense data) to guest memory: the guest pages are written.
    ToGuest,
    /// Guest memory to the store: the guest pages are read.
    FromGuest,
}

/// A contiguous piece of guest memory one IDAW (or a direct address) covers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Piece {
    /// Guest address.
    pub addr: u64,
    /// Bytes.
    pub len: u32,
}

/// Lists the interpreter builds for each CCW (its data's pieces) and program (the CCWs it
/// ran), kept by a subchannel from one program to the next so that a program allocates
/// nothing: they grow to the longest seen, up to [`Scratch::KEPT`] entries, and longer ones
/// are let go after their program.
#[derive(Debug, Default)]
pub struct Scratch {
    pieces: Vec<Piece>,
    visited: Vec<u64>,
}

impl Scratch {
    /// Entries a list keeps between programs: a 4 MiB CCW's pieces in 4 KiB IDAWs.
    pub const KEPT: usize = 1024;

    /// Entries its lists have room for now, together.
    pub fn capacity(&self) -> usize {
        self.pieces.capacity() + self.visited.capacity()
    }

    fn trim(&mut self) {
        self.pieces.clear();
        self.pieces.shrink_to(Self::KEPT);
        self.visited.clear();
        self.visited.shrink_to(Self::KEPT);
    }
}

/// A transfer that stopped partway: why, and how many bytes reached the store or the guest
/// before it stopped (the residual is the count minus these).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Partial {
    /// Why it stopped.
    pub error: BusError,
    /// Bytes moved, in IDAW order, before it stopped.
    pub moved: u64,
}

impl From<BusError> for Partial {
    /// A transfer that moved nothing.
    fn from(error: BusError) -> Partial {
        Partial { error, moved: 0 }
    }
}

/// Why a bus operation failed; the interpreter turns it into a status.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BusError {
    /// Outside guest memory.
    Unmapped,
    /// The memory does not permit this access.
    ReadOnly,
    /// Past the end of the store.
    EndOfStore,
    /// Stopped from outside (unmap, halt, reset).
    Stopped(Reason),
    /// Anything else the device hit.
    Device,
}

/// What the interpreter needs from the device.
pub trait Bus {
    /// Reads guest memory (CCWs, IDAW lists, SEEK arguments).
    fn fetch(&mut self, addr: u64, buf: &mut [u8]) -> Result<(), BusError>;
    /// Moves `pieces` between guest memory and the store at `store_pos`. A transfer that
    /// stops partway (a halt, an unmap, memory that fails mid-way) reports the bytes that
    /// moved before it stopped.
    fn transfer(&mut self, dir: Direction, pieces: &[Piece], store_pos: u64) -> Result<(), Partial>;
    /// Copies `data` (sense bytes) into the guest `pieces`; on failure, how many landed.
    fn deliver(&mut self, pieces: &[Piece], data: &[u8]) -> Result<(), Partial>;
    /// Bytes in the store.
    fn store_size(&self) -> u64;
    /// Checked before each CCW (and by the bus before each data block): `Some` stops the
    /// program with that reason.
    fn stopped(&self) -> Option<Reason> {
        None
    }
}

/// A decoded CCW.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Ccw {
    /// Command code.
    pub cmd: u8,
    /// Flag bits.
    pub flags: u8,
    /// Reserved (must be 0).
    pub reserved: u16,
    /// Byte count.
    pub count: u32,
    /// Data address, or IDAW list address with IDA.
    pub addr: u64,
}

/// A CCW as it sits in guest memory (docs/ccw.md, "CCW").
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RawCcw {
    /// Command code.
    pub cmd: u8,
    /// Flags.
    pub flags: u8,
    /// Reserved (0).
    pub reserved: Le16,
    /// Byte count.
    pub count: Le32,
    /// Data or IDAW list address.
    pub addr: Le64,
}

// SAFETY: plain little-endian integers in a `repr(C)` struct whose fields sit at their
// natural alignment with no padding (the size is checked below); every bit pattern is a
// valid value.
unsafe impl ByteValued for RawCcw {}
const _: () = assert!(size_of::<RawCcw>() == CCW_SIZE as usize);

/// An IDAW: the guest address of one data block.
pub type Idaw = Le64;

/// IDAWs read with one fetch.
const IDAW_SLICE: usize = 512;

/// A slice of an IDAW list, as read from guest memory.
#[derive(Clone, Copy)]
#[repr(C)]
struct IdawSlice([Idaw; IDAW_SLICE]);

// SAFETY: an array of plain little-endian integers; every bit pattern is valid.
unsafe impl ByteValued for IdawSlice {}

impl From<RawCcw> for Ccw {
    fn from(raw: RawCcw) -> Ccw {
        Ccw {
            cmd: raw.cmd,
            flags: raw.flags,
            reserved: raw.reserved.into(),
            count: raw.count.into(),
            addr: raw.addr.into(),
        }
    }
}

impl From<Ccw> for RawCcw {
    fn from(c: Ccw) -> RawCcw {
        RawCcw {
            cmd: c.cmd,
            flags: c.flags,
            reserved: c.reserved.into(),
            count: c.count.into(),
            addr: c.addr.into(),
        }
    }
}

impl Ccw {
    /// Decodes 16 little-endian bytes.
    pub fn decode(b: &[u8; CCW_SIZE as usize]) -> Ccw {
        let mut raw = RawCcw::default();
        raw.as_mut_slice().copy_from_slice(b);
        raw.into()
    }

    /// Encodes to 16 little-endian bytes.
    pub fn encode(&self) -> [u8; CCW_SIZE as usize] {
        let mut b = [0u8; CCW_SIZE as usize];
        b.copy_from_slice(RawCcw::from(*self).as_slice());
        b
    }
}

/// Bytes of the sense data SENSE delivers.
pub const SENSE_SIZE: usize = 32;

/// The reason for a failed read of program structures (a CCW, an IDAW list): `unmapped` when
/// the memory is not there; a stop (halt, unmap, bus mastering off) or a device failure as
/// for data.
fn fetch_error(e: BusError, unmapped: Reason) -> Reason {
    match e {
        BusError::Unmapped | BusError::ReadOnly | BusError::EndOfStore => unmapped,
        BusError::Stopped(reason) => reason,
        BusError::Device => Reason::DeviceError,
    }
}

/// Puts in `pieces` the piece of `count` bytes at `addr` (direct addressing), or fails if it
/// wraps.
fn direct_pieces(addr: u64, count: u32, pieces: &mut Vec<Piece>) -> Result<(), Reason> {
    addr.checked_add(u64::from(count) - 1).ok_or(Reason::DataUnmapped)?;
    pieces.clear();
    pieces.push(Piece { addr, len: count });
    Ok(())
}

/// Reads and checks the IDAW list at `idal` for `count` bytes in blocks of `block` bytes.
///
/// Reads exactly the IDAWs the count needs (never past the list's end), in slices of up to
/// 512: one bus call for the list of a 2 MiB transfer after the first IDAW.
fn idaw_pieces(
    bus: &mut dyn Bus,
    idal: u64,
    count: u32,
    block: u64,
    pieces: &mut Vec<Piece>,
) -> Result<(), Reason> {
    if !idal.is_multiple_of(8) {
        return Err(Reason::IdalMisaligned);
    }
    let mut first = Idaw::default();
    bus.fetch(idal, first.as_mut_slice()).map_err(|e| fetch_error(e, Reason::IdalUnmapped))?;
    let idaw0 = u64::from(first);
    let len0 = (block - idaw0 % block).min(u64::from(count));
    idaw0.checked_add(len0 - 1).ok_or(Reason::DataUnmapped)?;
    pieces.clear();
    pieces.push(Piece { addr: idaw0, len: len0 as u32 });
    let mut left = u64::from(count) - len0;
    // The next IDAW's address; none past the top of the address space (a list may end there).
    let mut at = idal.checked_add(8);
    let mut list = IdawSlice::zeroed();
    while left > 0 {
        let n = left.div_ceil(block).min(IDAW_SLICE as u64) as usize;
        let bytes = n * size_of::<Idaw>();
        let base = at.ok_or(Reason::IdalUnmapped)?;
        base.checked_add(bytes as u64 - 1).ok_or(Reason::IdalUnmapped)?;
        let fetched = bus.fetch(base, &mut list.as_mut_slice()[..bytes]);
        fetched.map_err(|e| fetch_error(e, Reason::IdalUnmapped))?;
        at = base.checked_add(bytes as u64);
        for &idaw in &list.0[..n] {
            let idaw = u64::from(idaw);
            if idaw % block != 0 {
                return Err(Reason::IdawMisaligned);
            }
            let len = block.min(left);
            idaw.checked_add(len - 1).ok_or(Reason::DataUnmapped)?;
            pieces.push(Piece { addr: idaw, len: len as u32 });
            left -= len;
        }
    }
    Ok(())
}

/// Runs the channel program at `cpa` to completion.
pub fn run(bus: &mut dyn Bus, cpa: u64) -> Status {
    run_with(bus, cpa, &mut Scratch::default())
}

/// [`run`] with the lists of `scratch`, a subchannel's from one program to the next.
pub fn run_with(bus: &mut dyn Bus, cpa: u64, scratch: &mut Scratch) -> Status {
    let status = interpret(bus, cpa, scratch);
    scratch.trim();
    status
}

fn interpret(bus: &mut dyn Bus, cpa: u64, scratch: &mut Scratch) -> Status {
    let mut status = Status { dstat: 0, cstat: 0, residual: 0, cpa, reason: Reason::Ok, ccws: 0, bytes: 0 };
    let Scratch { pieces, visited } = scratch;
    visited.clear();
    let mut pos = 0u64;
    let mut ccw_addr = cpa;
    let mut after_tic = false;
    let program_check = |status: &mut Status, reason| end(status, reason);
    loop {
        status.cpa = ccw_addr.wrapping_add(CCW_SIZE);
        if let Some(reason) = bus.stopped() {
            end(&mut status, reason);
            return status;
        }
        if visited.len() >= MAX_CCWS {
            program_check(&mut status, Reason::ChainTooLong);
            return status;
        }
        if !ccw_addr.is_multiple_of(8) {
            program_check(&mut status, Reason::CcwMisaligned);
            return status;
        }
        let mut raw = RawCcw::default();
        // A CCW may end at the top of the address space, not past it.
        if ccw_addr.checked_add(CCW_SIZE - 1).is_none() {
            program_check(&mut status, Reason::CcwUnmapped);
            return status;
        }
        if let Err(e) = bus.fetch(ccw_addr, raw.as_mut_slice()) {
            end(&mut status, fetch_error(e, Reason::CcwUnmapped));
            return status;
        }
        // The interpreter runs at most MAX_CCWS CCWs, so a linear search is cheap.
        if visited.contains(&ccw_addr) {
            program_check(&mut status, Reason::TicLoop);
            return status;
        }
        visited.push(ccw_addr);
        status.ccws += 1;
        let ccw = Ccw::from(raw);
        // The residual describes the last CCW executed: its whole count until it has moved
        // data (a CCW that fails moved nothing), 0 for a TIC and a NOP.
        status.residual = if matches!(ccw.cmd, cmd::TIC | cmd::NOP) { 0 } else { ccw.count };
        // A TIC carries only its target: flags, count and reserved bytes must be zero, as a
        // format-1 TIC must on the architecture (QEMU's channel subsystem checks the same).
        let tic_malformed = ccw.cmd == cmd::TIC && (ccw.flags != 0 || ccw.count != 0);
        if tic_malformed || ccw.reserved != 0 || ccw.flags & !flags::KNOWN != 0 || ccw.flags & flags::CD != 0
        {
            program_check(&mut status, Reason::BadCcw);
            return status;
        }
        if ccw.cmd == cmd::TIC {
            if after_tic {
                program_check(&mut status, Reason::TicToTic);
                return status;
            }
            after_tic = true;
            ccw_addr = ccw.addr;
            continue;
        }
        after_tic = false;
        if let Err(reason) = execute(bus, &ccw, &mut pos, &mut status, pieces) {
            end(&mut status, reason);
            return status;
        }
        if ccw.flags & flags::CC == 0 || status.cstat & cstat::INCORRECT_LENGTH != 0 {
            status.dstat |= dstat::CE | dstat::DE;
            return status;
        }
        // A chain running off the top of the address space: the next CCW is nowhere.
        let Some(next) = ccw_addr.checked_add(CCW_SIZE) else {
            program_check(&mut status, Reason::CcwUnmapped);
            return status;
        };
        ccw_addr = next;
    }
}

/// Ends the program for `reason`, with its status bits.
fn end(status: &mut Status, reason: Reason) {
    let (dstat, cstat) = reason.status_bits();
    status.dstat |= dstat;
    status.cstat |= cstat;
    status.reason = reason;
}

/// Executes one non-TIC CCW; `status.residual` holds its count (0 for a NOP).
fn execute(
    bus: &mut dyn Bus,
    ccw: &Ccw,
    pos: &mut u64,
    status: &mut Status,
    pieces: &mut Vec<Piece>,
) -> Result<(), Reason> {
    match ccw.cmd {
        cmd::NOP => return Ok(()),
        cmd::READ | cmd::WRITE | cmd::SENSE | cmd::SEEK => {}
        _ => return Err(Reason::BadCommand),
    }
    if ccw.count == 0 || ccw.count > MAX_CCW_COUNT {
        return Err(Reason::BadCount);
    }
    if ccw.flags & flags::IDA != 0 {
        let block = if ccw.flags & flags::IDA_2K != 0 { 2048 } else { 4096 };
        idaw_pieces(bus, ccw.addr, ccw.count, block, pieces)?;
    } else {
        direct_pieces(ccw.addr, ccw.count, pieces)?;
    }
    let pieces = &pieces[..];
    let map_err = |e: BusError| match e {
        BusError::Unmapped => Reason::DataUnmapped,
        BusError::ReadOnly => Reason::DataReadOnly,
        BusError::EndOfStore => Reason::EndOfStore,
        BusError::Stopped(reason) => reason,
        BusError::Device => Reason::DeviceError,
    };
    match ccw.cmd {
        cmd::READ | cmd::WRITE => {
            let end = pos.checked_add(u64::from(ccw.count)).ok_or(Reason::EndOfStore)?;
            if end > bus.store_size() {
                return Err(Reason::EndOfStore);
            }
            let dir = if ccw.cmd == cmd::READ { Direction::ToGuest } else { Direction::FromGuest };
            if let Err(partial) = bus.transfer(dir, pieces, *pos) {
                // Byte-accurate: what reached the store or the guest counts, the rest is
                // the residual.
                let moved = partial.moved.min(u64::from(ccw.count));
                status.residual = ccw.count - moved as u32;
                status.bytes += moved;
                return Err(map_err(partial.error));
            }
            *pos = end;
            status.residual = 0;
            status.bytes += u64::from(ccw.count);
        }
        cmd::SEEK => {
            // The device takes the first 8 bytes of the operand. A shorter operand cannot name
            // a position: it is read but does not move it. Either way BYTES counts no operand.
            let mut arg = [0u8; 8];
            let n = (ccw.count as usize).min(8);
            gather(bus, pieces, &mut arg[..n]).map_err(map_err)?;
            if n == 8 {
                let target = u64::from_le_bytes(arg);
                if target > bus.store_size() {
                    return Err(Reason::SeekOutOfRange);
                }
                *pos = target;
            }
            status.residual = ccw.count - n as u32;
            if ccw.count != 8 && ccw.flags & flags::SLI == 0 {
                status.cstat |= cstat::INCORRECT_LENGTH;
            }
        }
        _ => {
            // SENSE: this device keeps no sense state; it delivers zeros.
            let n = (ccw.count as usize).min(SENSE_SIZE);
            if let Err(partial) = bus.deliver(pieces, &[0u8; SENSE_SIZE][..n]) {
                let moved = partial.moved.min(n as u64);
                status.residual = ccw.count - moved as u32;
                status.bytes += moved;
                return Err(map_err(partial.error));
            }
            status.residual = ccw.count - n as u32;
            status.bytes += n as u64;
            if ccw.count as usize != SENSE_SIZE && ccw.flags & flags::SLI == 0 {
                status.cstat |= cstat::INCORRECT_LENGTH;
            }
        }
    }
    Ok(())
}

/// Reads the first `out.len()` bytes of the guest pieces.
fn gather(bus: &mut dyn Bus, pieces: &[Piece], out: &mut [u8]) -> Result<(), BusError> {
    let mut done = 0;
    for p in pieces {
        if done == out.len() {
            break;
        }
        let n = (p.len as usize).min(out.len() - done);
        bus.fetch(p.addr, &mut out[done..done + n])?;
        done += n;
    }
    Ok(())
}
