//! The ccw channel-program interpreter ([`umdev_devices::ccw::program`]) over arbitrary
//! guest memory, checked against a reference interpreter: the harness of the `ccw` fuzz
//! target (`fuzz/fuzz_targets/ccw.rs`) and of its corpus replay.
//!
//! For fuzzers and their corpus replay; not API. Compiled only with the `fuzzing` feature.
//!
//! An input describes guest memory (pieces of it, the rest zero), a read-only range, a store,
//! the CPA, and faults the bus injects (a stop request from the n-th CCW on, the n-th data
//! transfer failing); see [`CcwInput`]. [`ccw`] runs the interpreter and a reference written
//! from `docs/ccw.md`, each on its own copy, and panics unless:
//!
//! - the interpreter ends (at most [`MAX_CCWS`] CCWs, a bounded number of bus calls);
//! - every bus request is well formed: no empty or wrapping piece, no more than
//!   [`MAX_CCW_COUNT`] bytes per CCW, no store access past the store's end;
//! - read-only memory and memory outside guest memory are never written (the bus refuses
//!   them; read-only bytes are compared after the run);
//! - the status is consistent: the status bits are those the reason calls for (normal end
//!   is exactly CE|DE, program checks carry only PROGRAM CHECK, ...);
//! - status, guest memory, store, every data transfer and the bytes of guest memory read
//!   are the same as the reference's.

use std::cell::Cell;
use std::collections::HashSet;
use std::ops::Range;

use umdev_devices::ccw::program::{
    self, cmd, cstat, dstat, flags, Bus, BusError, Ccw, Direction, Partial, Piece, Reason, Status, CCW_SIZE,
    MAX_CCWS, MAX_CCW_COUNT, SENSE_SIZE,
};

/// Largest guest memory an input describes.
pub const MAX_MEM: usize = 256 << 10;
/// Largest store an input describes.
pub const MAX_STORE: usize = 256 << 10;
/// Bytes of an input's fixed header.
pub const HEADER: usize = 24;

/// What one input describes. [`CcwInput::decode`] reads any bytes; [`CcwInput::encode`]
/// writes them back (for seeds).
///
/// Layout (little-endian): `cpa u64, store_size u32 (mod MAX_STORE + 1), ro_start u16
/// (x 16), ro_len u16 (x 16), mem_pages_minus_1 u8 (mod 64), stop_at u8, fail_at u8,
/// faults u8 (bit 0: stop reason Unmapped instead of Halted; bits 1-2: the injected
/// failure: Stopped(Unmapped), Stopped(Halted), Device, EndOfStore), 4 reserved bytes`,
/// then memory pieces, each `addr u32, len u16, bytes` (clipped to guest memory; a short
/// last piece loads what is there).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct CcwInput {
    /// The channel program's address.
    pub cpa: u64,
    /// Store bytes (at most [`MAX_STORE`]); its contents are a fixed pattern.
    pub store_size: u32,
    /// Guest memory the bus refuses to write (multiples of 16 bytes).
    pub read_only: Range<u64>,
    /// Guest memory pages, 1 to 64.
    pub mem_pages: u8,
    /// The bus asks the program to stop from this call of `stopped()` on (0: never).
    pub stop_at: u8,
    /// This transfer/deliver call (counted from 1) fails (0: never).
    pub fail_at: u8,
    /// Bit 0: the stop reason is Unmapped (else Halted); bits 1-2: the injected failure.
    pub faults: u8,
    /// Guest memory contents: `(address, bytes)`, the rest zero.
    pub memory: Vec<(u32, Vec<u8>)>,
}

impl CcwInput {
    /// Reads an input; any bytes are one (missing header bytes are zero).
    pub fn decode(data: &[u8]) -> CcwInput {
        let mut head = [0u8; HEADER];
        let n = data.len().min(HEADER);
        head[..n].copy_from_slice(&data[..n]);
        let u16_at = |i: usize| u64::from(u16::from_le_bytes([head[i], head[i + 1]]));
        let ro_start = u16_at(12) * 16;
        let mut input = CcwInput {
            cpa: u64::from_le_bytes(head[0..8].try_into().unwrap_or_default()),
            store_size: u32::from_le_bytes(head[8..12].try_into().unwrap_or_default())
                % (MAX_STORE as u32 + 1),
            read_only: ro_start..ro_start + u16_at(14) * 16,
            mem_pages: head[16] % 64 + 1,
            stop_at: head[17],
            fail_at: head[18],
            faults: head[19],
            memory: Vec::new(),
        };
        let mut rest = &data[n..];
        while rest.len() >= 6 {
            let addr = u32::from_le_bytes([rest[0], rest[1], rest[2], rest[3]]);
            let len = usize::from(u16::from_le_bytes([rest[4], rest[5]]));
            let bytes = &rest[6..];
            let take = len.min(bytes.len());
            input.memory.push((addr, bytes[..take].to_vec()));
            rest = &bytes[take..];
        }
        input
    }

    /// Writes the input so that [`CcwInput::decode`] reads it back (fields out of the
    /// format's range are taken modulo it; `read_only` is rounded to 16 bytes).
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::new();
        out.extend_from_slice(&self.cpa.to_le_bytes());
        out.extend_from_slice(&self.store_size.to_le_bytes());
        out.extend_from_slice(&((self.read_only.start / 16) as u16).to_le_bytes());
        let ro_len = self.read_only.end.saturating_sub(self.read_only.start);
        out.extend_from_slice(&((ro_len / 16) as u16).to_le_bytes());
        out.extend([self.mem_pages.wrapping_sub(1), self.stop_at, self.fail_at, self.faults, 0, 0, 0, 0]);
        for (addr, bytes) in &self.memory {
            for (i, part) in bytes.chunks(u16::MAX as usize).enumerate() {
                out.extend_from_slice(&(addr + (i * u16::MAX as usize) as u32).to_le_bytes());
                out.extend_from_slice(&(part.len() as u16).to_le_bytes());
                out.extend_from_slice(part);
            }
        }
        out
    }

    /// The guest memory image.
    fn memory_image(&self) -> Vec<u8> {
        let mut mem = vec![0u8; usize::from(self.mem_pages) * 4096];
        for (addr, bytes) in &self.memory {
            let at = *addr as usize;
            if at < mem.len() {
                let n = bytes.len().min(mem.len() - at);
                mem[at..at + n].copy_from_slice(&bytes[..n]);
            }
        }
        mem
    }

    fn injected_failure(&self) -> BusError {
        match (self.faults >> 1) & 3 {
            0 => BusError::Stopped(Reason::Unmapped),
            1 => BusError::Stopped(Reason::Halted),
            2 => BusError::Device,
            _ => BusError::EndOfStore,
        }
    }
}

/// One data call the bus saw.
#[derive(Clone, Debug, PartialEq, Eq)]
enum DataCall {
    Transfer { dir: Direction, pieces: Vec<Piece>, store_pos: u64 },
    Deliver { pieces: Vec<Piece>, len: usize },
}

/// Guest memory as a byte vector from address 0, a read-only range, a store, injected
/// faults, and a record of every request.
struct FuzzBus {
    mem: Vec<u8>,
    read_only: Range<u64>,
    store: Vec<u8>,
    stop_at: u32,
    stop_reason: Reason,
    /// Calls of `stopped()` so far (it takes `&self`).
    stop_calls: Cell<u32>,
    fail_at: u32,
    fail: BusError,
    data_calls: u32,
    fetches: Vec<(u64, u64)>,
    data: Vec<DataCall>,
}

impl FuzzBus {
    fn new(input: &CcwInput) -> FuzzBus {
        let store =
            (0..input.store_size as usize).map(|i| (i as u8).wrapping_mul(7) ^ (i >> 8) as u8).collect();
        FuzzBus {
            mem: input.memory_image(),
            read_only: input.read_only.clone(),
            store,
            stop_at: u32::from(input.stop_at),
            stop_reason: if input.faults & 1 != 0 { Reason::Unmapped } else { Reason::Halted },
            stop_calls: Cell::new(0),
            fail_at: u32::from(input.fail_at),
            fail: input.injected_failure(),
            data_calls: 0,
            fetches: Vec::new(),
            data: Vec::new(),
        }
    }

    fn range(&self, addr: u64, len: usize) -> Result<Range<usize>, BusError> {
        match addr.checked_add(len as u64) {
            Some(end) if end <= self.mem.len() as u64 => Ok(addr as usize..end as usize),
            _ => Err(BusError::Unmapped),
        }
    }

    fn read_only(&self, addr: u64, len: usize) -> bool {
        addr < self.read_only.end && self.read_only.start < addr + len as u64
    }

    /// Checks a data request's pieces; returns their total.
    fn check_pieces(pieces: &[Piece]) -> u64 {
        assert!(!pieces.is_empty(), "a data request without pieces");
        let mut total = 0u64;
        for p in pieces {
            assert!(p.len > 0, "an empty piece: {pieces:?}");
            assert!(p.addr.checked_add(u64::from(p.len) - 1).is_some(), "a wrapping piece: {p:?}");
            total += u64::from(p.len);
        }
        assert!(total <= u64::from(MAX_CCW_COUNT), "{total} bytes in one request");
        total
    }

    /// The injected failure, if this data call is the one.
    fn injected(&mut self) -> Result<(), BusError> {
        self.data_calls += 1;
        if self.data_calls == self.fail_at {
            return Err(self.fail);
        }
        Ok(())
    }

    /// Union of the guest bytes fetch requests covered (clipped to guest memory).
    fn fetched_bytes(&self) -> Vec<(u64, u64)> {
        let limit = self.mem.len() as u64;
        let mut spans: Vec<(u64, u64)> = self
            .fetches
            .iter()
            .map(|&(a, n)| (a.min(limit), a.saturating_add(n).min(limit)))
            .filter(|(a, b)| a < b)
            .collect();
        spans.sort_unstable();
        let mut merged: Vec<(u64, u64)> = Vec::new();
        for (a, b) in spans {
            match merged.last_mut() {
                Some(last) if a <= last.1 => last.1 = last.1.max(b),
                _ => merged.push((a, b)),
            }
        }
        merged
    }
}

impl Bus for FuzzBus {
    fn fetch(&mut self, addr: u64, buf: &mut [u8]) -> Result<(), BusError> {
        assert!(!buf.is_empty() && buf.len() <= 4096, "a fetch of {} bytes", buf.len());
        self.fetches.push((addr, buf.len() as u64));
        let r = self.range(addr, buf.len())?;
        buf.copy_from_slice(&self.mem[r]);
        Ok(())
    }

    fn transfer(&mut self, dir: Direction, pieces: &[Piece], store_pos: u64) -> Result<(), Partial> {
        let total = Self::check_pieces(pieces);
        assert!(
            store_pos.checked_add(total).is_some_and(|end| end <= self.store.len() as u64),
            "a transfer of {total} bytes at {store_pos:#x} runs past the {:#x}-byte store",
            self.store.len()
        );
        self.data.push(DataCall::Transfer { dir, pieces: pieces.to_vec(), store_pos });
        self.injected()?;
        let mut pos = store_pos as usize;
        for p in pieces {
            // A piece that cannot be reached stops the transfer; what moved before counts.
            let moved = (pos - store_pos as usize) as u64;
            let r = self.range(p.addr, p.len as usize).map_err(|error| Partial { error, moved })?;
            let n = p.len as usize;
            match dir {
                Direction::ToGuest => {
                    if self.read_only(p.addr, n) {
                        return Err(Partial { error: BusError::ReadOnly, moved });
                    }
                    self.mem[r].copy_from_slice(&self.store[pos..pos + n]);
                }
                Direction::FromGuest => self.store[pos..pos + n].copy_from_slice(&self.mem[r]),
            }
            pos += n;
        }
        Ok(())
    }

    fn deliver(&mut self, pieces: &[Piece], data: &[u8]) -> Result<(), Partial> {
        let total = Self::check_pieces(pieces);
        assert!(!data.is_empty() && data.len() <= SENSE_SIZE, "{} sense bytes", data.len());
        assert!(data.len() as u64 <= total, "{} sense bytes for {total} bytes of pieces", data.len());
        self.data.push(DataCall::Deliver { pieces: pieces.to_vec(), len: data.len() });
        self.injected()?;
        let mut done = 0;
        for p in pieces {
            // As the device's bus: only the bytes delivered are written (an empty write
            // touches nothing).
            let n = (p.len as usize).min(data.len() - done);
            if n == 0 {
                break;
            }
            let moved = done as u64;
            let r = self.range(p.addr, n).map_err(|error| Partial { error, moved })?;
            if self.read_only(p.addr, n) {
                return Err(Partial { error: BusError::ReadOnly, moved });
            }
            self.mem[r].copy_from_slice(&data[done..done + n]);
            done += n;
        }
        Ok(())
    }

    fn store_size(&self) -> u64 {
        self.store.len() as u64
    }

    fn stopped(&self) -> Option<Reason> {
        let n = self.stop_calls.get() + 1;
        self.stop_calls.set(n);
        (self.stop_at != 0 && n >= self.stop_at).then_some(self.stop_reason)
    }
}

/// Runs one input ([`CcwInput::decode`]) through the interpreter and the reference, and
/// checks the invariants listed in the module documentation. Panics on any violation.
pub fn ccw(data: &[u8]) {
    let input = CcwInput::decode(data);
    let mut actual = FuzzBus::new(&input);
    let read_only_before = read_only_bytes(&actual);
    let status = program::run(&mut actual, input.cpa);
    let mut expected = FuzzBus::new(&input);
    let want = reference(&mut expected, input.cpa);

    let ctx = format!("{input:?}\ninterpreter: {status:?}\nreference:   {want:?}");
    assert!(status.ccws as usize <= MAX_CCWS, "{ctx}\nmore than {MAX_CCWS} CCWs");
    assert!(actual.fetches.len() <= MAX_CCWS * 20, "{ctx}\n{} fetches", actual.fetches.len());
    assert!(
        actual.stop_calls.get() as usize <= MAX_CCWS + 1,
        "{ctx}\n{} stop checks",
        actual.stop_calls.get()
    );
    check_consistent(&status, &ctx);
    assert_eq!(read_only_bytes(&actual), read_only_before, "{ctx}\nread-only memory was written");
    assert_eq!(status, want, "{ctx}\nstatus differs from the reference");
    assert_eq!(actual.data, expected.data, "{ctx}\ndata transfers differ from the reference");
    assert!(actual.mem == expected.mem, "{ctx}\nguest memory differs from the reference");
    assert!(actual.store == expected.store, "{ctx}\nstore differs from the reference");
    assert_eq!(
        actual.fetched_bytes(),
        expected.fetched_bytes(),
        "{ctx}\nthe guest bytes read differ from the reference"
    );
}

fn read_only_bytes(bus: &FuzzBus) -> Vec<u8> {
    let len = bus.mem.len() as u64;
    bus.mem[bus.read_only.start.min(len) as usize..bus.read_only.end.min(len) as usize].to_vec()
}

/// The status bits match the reason, as in the reason table of `docs/ccw.md`.
fn check_consistent(s: &Status, ctx: &str) {
    let (want_dstat, want_cstat): (u8, &[u8]) = match s.reason {
        Reason::Ok => (dstat::CE | dstat::DE, &[0, cstat::INCORRECT_LENGTH]),
        Reason::BadCommand | Reason::EndOfStore | Reason::SeekOutOfRange | Reason::DeviceError => {
            (dstat::UC, &[0])
        }
        Reason::DataReadOnly => (0, &[cstat::PROTECTION_CHECK]),
        Reason::Unmapped | Reason::Halted => (dstat::UE, &[0]),
        Reason::BusMasterOff => (0, &[cstat::CHANNEL_CONTROL_CHECK]),
        _ => (0, &[cstat::PROGRAM_CHECK]),
    };
    assert!(
        s.dstat == want_dstat && want_cstat.contains(&s.cstat),
        "{ctx}\nstatus bits do not match the reason"
    );
    let normal =
        s.dstat == dstat::CE | dstat::DE && s.cstat & (cstat::PROGRAM_CHECK | cstat::PROTECTION_CHECK) == 0;
    assert_eq!(s.ok(), normal, "{ctx}\nok() disagrees with the status bits");
}

/// The reference interpreter, written from `docs/ccw.md` ("Channel programs") one check
/// at a time, for clarity rather than speed. Where the document leaves a choice open, the
/// comment says which one is taken.
fn reference(bus: &mut dyn Bus, cpa: u64) -> Status {
    let mut s = Status { dstat: 0, cstat: 0, residual: 0, cpa, reason: Reason::Ok, ccws: 0, bytes: 0 };
    let mut executed = HashSet::new();
    let mut pos = 0u64;
    let mut at = cpa;
    let mut after_tic = false;
    let end = |mut s: Status, dstat: u8, cstat: u8, reason: Reason| {
        s.dstat |= dstat;
        s.cstat |= cstat;
        s.reason = reason;
        s
    };
    let check = |s: Status, reason: Reason| end(s, 0, cstat::PROGRAM_CHECK, reason);
    loop {
        // CPA out: 16 bytes past the CCW being fetched, even if the fetch fails.
        s.cpa = at.wrapping_add(CCW_SIZE);
        if let Some(reason) = bus.stopped() {
            // docs/ccw.md: Halted and Unmapped are unit exceptions, bus mastering off a
            // channel-control check.
            return match reason {
                Reason::BusMasterOff => end(s, 0, cstat::CHANNEL_CONTROL_CHECK, reason),
                _ => end(s, dstat::UE, 0, reason),
            };
        }
        if s.ccws as usize == MAX_CCWS {
            return check(s, Reason::ChainTooLong);
        }
        if !at.is_multiple_of(8) {
            return check(s, Reason::CcwMisaligned);
        }
        let mut raw = [0u8; 16];
        if at.checked_add(16).is_none() || bus.fetch(at, &mut raw).is_err() {
            return check(s, Reason::CcwUnmapped);
        }
        if !executed.insert(at) {
            return check(s, Reason::TicLoop);
        }
        s.ccws += 1;
        let ccw = Ccw::decode(&raw);
        // docs/ccw.md: the residual is the CCW's count until it moves data; 0 for a TIC or a
        // NOP.
        s.residual = if ccw.cmd == cmd::NOP || ccw.cmd == cmd::TIC { 0 } else { ccw.count };
        if ccw.reserved != 0 || ccw.flags & (flags::CD | 0x01 | 0x08 | 0x10) != 0 {
            return check(s, Reason::BadCcw);
        }
        // docs/ccw.md: a TIC's flags and count must be zero.
        if ccw.cmd == cmd::TIC && (ccw.flags != 0 || ccw.count != 0) {
            return check(s, Reason::BadCcw);
        }
        if ccw.cmd == cmd::TIC {
            if after_tic {
                return check(s, Reason::TicToTic);
            }
            after_tic = true;
            at = ccw.addr;
            continue;
        }
        after_tic = false;
        if ccw.cmd == cmd::NOP {
            // docs/ccw.md: a NOP's count is ignored (0 included), as for control commands.
        } else {
            if ![cmd::READ, cmd::WRITE, cmd::SENSE, cmd::SEEK].contains(&ccw.cmd) {
                return end(s, dstat::UC, 0, Reason::BadCommand);
            }
            if ccw.count == 0 || ccw.count > MAX_CCW_COUNT {
                return check(s, Reason::BadCount);
            }
            let pieces = match reference_pieces(bus, &ccw) {
                Ok(pieces) => pieces,
                Err(reason) => return check(s, reason),
            };
            let failed = |s: Status, e: BusError| match e {
                BusError::Unmapped => check(s, Reason::DataUnmapped),
                BusError::ReadOnly => end(s, 0, cstat::PROTECTION_CHECK, Reason::DataReadOnly),
                BusError::EndOfStore => end(s, dstat::UC, 0, Reason::EndOfStore),
                BusError::Device => end(s, dstat::UC, 0, Reason::DeviceError),
                BusError::Stopped(Reason::BusMasterOff) => {
                    end(s, 0, cstat::CHANNEL_CONTROL_CHECK, Reason::BusMasterOff)
                }
                BusError::Stopped(reason) => end(s, dstat::UE, 0, reason),
            };
            match ccw.cmd {
                cmd::READ | cmd::WRITE => {
                    let count = u64::from(ccw.count);
                    if pos.checked_add(count).is_none_or(|e| e > bus.store_size()) {
                        return end(s, dstat::UC, 0, Reason::EndOfStore);
                    }
                    let dir = if ccw.cmd == cmd::READ { Direction::ToGuest } else { Direction::FromGuest };
                    if let Err(partial) = bus.transfer(dir, &pieces, pos) {
                        // docs/ccw.md: the bytes that moved count in BYTES; the residual is
                        // the count minus them.
                        s.residual = ccw.count - partial.moved as u32;
                        s.bytes += partial.moved;
                        return failed(s, partial.error);
                    }
                    pos += count;
                    s.residual = 0;
                    s.bytes += count;
                }
                cmd::SEEK => {
                    // The 8-byte position is read across the pieces, as far as the count goes.
                    let n = (ccw.count as usize).min(8);
                    let mut arg = [0u8; 8];
                    let mut done = 0;
                    for p in &pieces {
                        if done == n {
                            break;
                        }
                        let k = (p.len as usize).min(n - done);
                        if let Err(e) = bus.fetch(p.addr, &mut arg[done..done + k]) {
                            return failed(s, e);
                        }
                        done += k;
                    }
                    // docs/ccw.md: the residual is the count minus the 8 bytes taken (0 for a
                    // short SEEK); a count other than 8 is an incorrect length without SLI;
                    // a short SEEK never moves the position, a long one does.
                    if n == 8 {
                        let target = u64::from_le_bytes(arg);
                        if target > bus.store_size() {
                            return end(s, dstat::UC, 0, Reason::SeekOutOfRange);
                        }
                        pos = target;
                    }
                    s.residual = ccw.count - n as u32;
                    if ccw.count != 8 && ccw.flags & flags::SLI == 0 {
                        s.cstat |= cstat::INCORRECT_LENGTH;
                    }
                }
                _ => {
                    let n = (ccw.count as usize).min(SENSE_SIZE);
                    if let Err(partial) = bus.deliver(&pieces, &[0u8; SENSE_SIZE][..n]) {
                        s.residual = ccw.count - partial.moved as u32;
                        s.bytes += partial.moved;
                        return failed(s, partial.error);
                    }
                    s.residual = ccw.count - n as u32;
                    s.bytes += n as u64;
                    if ccw.count as usize != SENSE_SIZE && ccw.flags & flags::SLI == 0 {
                        s.cstat |= cstat::INCORRECT_LENGTH;
                    }
                }
            }
        }
        // The program ends after a CCW without chain command, or with incorrect length.
        if ccw.flags & flags::CC == 0 || s.cstat & cstat::INCORRECT_LENGTH != 0 {
            return end(s, dstat::CE | dstat::DE, 0, Reason::Ok);
        }
        at = at.wrapping_add(CCW_SIZE);
    }
}

/// The guest pieces of a data CCW: its direct range, or one piece per IDAW.
fn reference_pieces(bus: &mut dyn Bus, ccw: &Ccw) -> Result<Vec<Piece>, Reason> {
    let count = u64::from(ccw.count);
    if ccw.flags & flags::IDA == 0 {
        ccw.addr.checked_add(count - 1).ok_or(Reason::DataUnmapped)?;
        return Ok(vec![Piece { addr: ccw.addr, len: ccw.count }]);
    }
    let block: u64 = if ccw.flags & flags::IDA_2K != 0 { 2048 } else { 4096 };
    if !ccw.addr.is_multiple_of(8) {
        return Err(Reason::IdalMisaligned);
    }
    let mut idaw = [0u8; 8];
    bus.fetch(ccw.addr, &mut idaw).map_err(|_| Reason::IdalUnmapped)?;
    let first = u64::from_le_bytes(idaw);
    // The first IDAW moves up to the end of its block.
    let len = (block - first % block).min(count);
    first.checked_add(len - 1).ok_or(Reason::DataUnmapped)?;
    let mut pieces = vec![Piece { addr: first, len: len as u32 }];
    let mut left = count - len;
    let mut next = ccw.addr + 8;
    while left > 0 {
        // Exactly the IDAWs the count needs are read, in slices of at most 512 (the
        // interpreter's choice; a slice that runs out of guest memory is IdalUnmapped
        // before any IDAW in it is checked).
        let n = left.div_ceil(block).min(512);
        let bytes = n * 8;
        next.checked_add(bytes).ok_or(Reason::IdalUnmapped)?;
        let mut list = vec![0u8; bytes as usize];
        bus.fetch(next, &mut list).map_err(|_| Reason::IdalUnmapped)?;
        next += bytes;
        for raw in list.chunks_exact(8) {
            let addr = u64::from_le_bytes(raw.try_into().map_err(|_| Reason::IdalUnmapped)?);
            if addr % block != 0 {
                return Err(Reason::IdawMisaligned);
            }
            let len = block.min(left);
            addr.checked_add(len - 1).ok_or(Reason::DataUnmapped)?;
            pieces.push(Piece { addr, len: len as u32 });
            left -= len;
        }
    }
    Ok(pieces)
}

/// Hand-made seeds, as `(name, input)`: programs like the demo's and each documented way a
/// program can go wrong. The corpus replay runs them besides the corpus files;
/// `tests/fuzz_corpus.rs` can write them into `fuzz/corpus/ccw/`.
pub fn seeds() -> Vec<(&'static str, Vec<u8>)> {
    use crate::ccw_driver::{idaws, layout, Data, Op};

    const P: u64 = 4096;
    let program = |cpa: u64, ops: &[Op], extra: &[(u64, Vec<u8>)]| -> Vec<(u32, Vec<u8>)> {
        let mut memory: Vec<(u32, Vec<u8>)> =
            layout(cpa, 0x800, ops).into_iter().map(|(a, b)| (a as u32, b)).collect();
        memory.extend(extra.iter().map(|(a, b)| (*a as u32, b.clone())));
        memory
    };
    let base = CcwInput { cpa: 0x100, store_size: 128 << 10, mem_pages: 64, ..CcwInput::default() };
    let with = |memory: Vec<(u32, Vec<u8>)>| CcwInput { memory, ..base.clone() };
    let seek = |at: u64| Op { cmd: cmd::SEEK, flags: 0, count: 8, data: Data::Direct(at) };
    let pos = |at: u64, value: u64| (at, value.to_le_bytes().to_vec());
    let pattern: Vec<u8> = (0..3 * P as usize).map(|i| (i % 253) as u8).collect();
    let mut seeds = Vec::new();

    // As the demo: SEEK, a scattered WRITE, SEEK back, a scattered READ elsewhere.
    let count = 3 * P as u32 - 100;
    let ops = [
        seek(0x700),
        Op::new(cmd::WRITE, count, Data::Idaws(idaws(&[0x9000, 0x5000, 0xc000], 100, count))),
        seek(0x708),
        Op::new(cmd::READ, count, Data::Idaws(idaws(&[0x20000, 0x1e000, 0x30000], 0, count))),
        Op::new(cmd::NOP, 1, Data::Direct(0)),
    ];
    let extra =
        [pos(0x700, 0x4000), pos(0x708, 0x4000), (0x9000, pattern.clone()), (0x5000, pattern.clone())];
    seeds.push(("demo-idaw", with(program(0x100, &ops, &extra))));
    // Contiguous data, 2K IDAWs sharing pages, SENSE with and without SLI.
    let ops = [
        Op::new(cmd::WRITE, 5000, Data::Direct(0x8000)),
        Op::new(cmd::READ, 6144, Data::Idaws2k(vec![0x1800, 0x1000, 0x4800])),
        Op { cmd: cmd::SENSE, flags: flags::SLI, count: 64, data: Data::Direct(0x2000) },
        Op::new(cmd::SENSE, 16, Data::Direct(0x2100)),
    ];
    seeds.push(("direct-2k-sense", with(program(0x100, &ops, &[(0x8000, pattern.clone())]))));
    // A TIC forward, then a TIC to a TIC; a loop.
    let mut memory = program(
        0x100,
        &[Op::new(cmd::NOP, 1, Data::Direct(0)), Op::new(cmd::TIC, 0, Data::Direct(0x600))],
        &[],
    );
    memory.extend(program(0x600, &[Op::new(cmd::TIC, 0, Data::Direct(0x100))], &[]));
    seeds.push(("tic-to-tic", with(memory)));
    let mut memory = program(
        0x100,
        &[Op::new(cmd::NOP, 1, Data::Direct(0)), Op::new(cmd::TIC, 0, Data::Direct(0x600))],
        &[],
    );
    memory.extend(program(
        0x600,
        &[Op::new(cmd::NOP, 1, Data::Direct(0)), Op::new(cmd::TIC, 0, Data::Direct(0x100))],
        &[],
    ));
    seeds.push(("tic-loop", with(memory)));
    // 257 chained NOPs: one too many.
    let nops: Vec<Op> = (0..=MAX_CCWS).map(|_| Op::new(cmd::NOP, 1, Data::Direct(0))).collect();
    seeds.push(("chain-too-long", CcwInput { cpa: 0x1000, ..with(program(0x1000, &nops, &[])) }));
    // A READ into read-only memory; a WRITE from it is fine.
    let ops = [Op::new(cmd::WRITE, 64, Data::Direct(0x3000)), Op::new(cmd::READ, 64, Data::Direct(0x3ff8))];
    seeds.push(("read-only", CcwInput { read_only: 0x3000..0x4000, ..with(program(0x100, &ops, &[])) }));
    // 600 2K IDAWs: the list is read in two slices. A SENSE needs no store; a READ of
    // that size runs past the store's end once the list is read.
    let list: Vec<u64> = (0..600u64).map(|i| 0x10000 + (i % 64) * 2048).collect();
    let ops =
        [Op { cmd: cmd::SENSE, flags: flags::SLI, count: 600 * 2048, data: Data::Idaws2k(list.clone()) }];
    seeds.push(("long-idal-sense", with(program(0x100, &ops, &[]))));
    let ops = [Op::new(cmd::READ, 600 * 2048, Data::Idaws2k(list))];
    seeds.push(("long-idal-read", with(program(0x100, &ops, &[]))));
    // Faults: a halt at the second CCW, an unmap during the first transfer, a device error.
    let ops = [
        seek(0x700),
        Op::new(cmd::WRITE, 4096, Data::Direct(0x9000)),
        Op::new(cmd::READ, 4096, Data::Direct(0xa000)),
    ];
    let memory = program(0x100, &ops, &[pos(0x700, 0)]);
    seeds.push(("halted", CcwInput { stop_at: 2, ..with(memory.clone()) }));
    seeds.push(("unmapped", CcwInput { fail_at: 1, faults: 0, ..with(memory.clone()) }));
    seeds.push(("device-error", CcwInput { fail_at: 2, faults: 4, ..with(memory.clone()) }));
    seeds.push(("seek-out-of-range", with(program(0x100, &ops, &[pos(0x700, 1 << 40)]))));
    // Malformed CCWs: reserved bits, CD, count 0, an unknown command, a misaligned CPA,
    // data and IDAW lists outside memory or wrapping.
    let bad = [
        Ccw { cmd: cmd::READ, flags: flags::CD, reserved: 0, count: 16, addr: 0x2000 },
        Ccw { cmd: cmd::READ, flags: 0, reserved: 1, count: 16, addr: 0x2000 },
        Ccw { cmd: cmd::READ, flags: 0, reserved: 0, count: 0, addr: 0x2000 },
        Ccw { cmd: 0x05, flags: 0, reserved: 0, count: 1, addr: 0 },
        Ccw { cmd: cmd::READ, flags: 0, reserved: 0, count: 0x2000, addr: u64::MAX - 0xfff },
        Ccw { cmd: cmd::READ, flags: flags::IDA, reserved: 0, count: 0x3000, addr: 0x3fff8 },
        Ccw { cmd: cmd::WRITE, flags: flags::IDA, reserved: 0, count: 16, addr: 0x404 },
    ];
    for (i, ccw) in bad.iter().enumerate() {
        let name =
            ["chain-data", "reserved", "count-zero", "bad-command", "wraps", "idal-edge", "idal-misaligned"]
                [i];
        seeds.push((
            name,
            with(vec![(0x100, ccw.encode().to_vec()), (0x3fff8, 0x1000u64.to_le_bytes().to_vec())]),
        ));
    }
    seeds.push(("misaligned-cpa", CcwInput { cpa: 0x104, ..with(vec![]) }));
    seeds.into_iter().map(|(name, input)| (name, input.encode())).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ccw_driver::{idaws, layout, Data, Op};

    #[test]
    fn inputs_round_trip_and_a_laid_out_program_runs_clean() {
        let ops = [
            Op { cmd: cmd::SEEK, flags: 0, count: 8, data: Data::Direct(0x900) },
            Op::new(
                cmd::WRITE,
                3 * 4096 - 100,
                Data::Idaws(idaws(&[0x9000, 0x5000, 0xa000], 100, 3 * 4096 - 100)),
            ),
            Op::new(cmd::READ, 6144, Data::Idaws2k(vec![0x1800, 0x1000, 0x4800])),
            Op::new(cmd::NOP, 1, Data::Direct(0)),
        ];
        let mut memory: Vec<(u32, Vec<u8>)> =
            layout(0x100, 0x400, &ops).into_iter().map(|(a, b)| (a as u32, b)).collect();
        memory.push((0x900, 0x1000u64.to_le_bytes().to_vec()));
        let input = CcwInput {
            cpa: 0x100,
            store_size: 64 << 10,
            read_only: 0..0,
            mem_pages: 16,
            stop_at: 0,
            fail_at: 0,
            faults: 0,
            memory,
        };
        assert_eq!(CcwInput::decode(&input.encode()), input);
        let mut bus = FuzzBus::new(&input);
        let status = program::run(&mut bus, input.cpa);
        assert!(status.ok(), "{status:?}");
        assert_eq!(status.bytes, 3 * 4096 - 100 + 6144);
        ccw(&input.encode());
    }

    #[test]
    fn seeds_run() {
        for (name, seed) in seeds() {
            eprintln!("seed {name}");
            ccw(&seed);
        }
    }

    #[test]
    fn any_bytes_run() {
        for len in 0..200 {
            let data: Vec<u8> = (0..len).map(|i| (i * 131 + len) as u8).collect();
            ccw(&data);
        }
    }
}
