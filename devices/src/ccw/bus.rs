//! The ccw device's [`Bus`]: guest memory through the pinning engine, one pin call per CCW.

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

use smallvec::SmallVec;
use umdev_pinning::{PinError, Prot, PAGE_SIZE};

use super::program::{Bus, BusError, Direction, Partial, Piece, Reason};
use crate::store::{Durability, Store};
use umdev_mdev::guest::{GuestError, PinnedRanges};
use umdev_mdev::DeviceContext;

/// A stop request for a running program: 0 none, else a [`Reason`] code.
#[derive(Debug, Default)]
pub(crate) struct StopFlag(AtomicU32);

impl StopFlag {
    pub(crate) fn request(&self, reason: Reason) {
        // The first reason wins.
        let _ = self.0.compare_exchange(0, reason as u32, Ordering::AcqRel, Ordering::Acquire);
    }

    pub(crate) fn clear(&self) {
        self.0.store(0, Ordering::Release);
    }

    /// Withdraws a request for `reason`, if it is the one pending.
    pub(crate) fn withdraw(&self, reason: Reason) {
        let _ = self.0.compare_exchange(reason as u32, 0, Ordering::AcqRel, Ordering::Acquire);
    }

    pub(crate) fn get(&self) -> Option<Reason> {
        match self.0.load(Ordering::Acquire) {
            0 => None,
            x if x == Reason::Unmapped as u32 => Some(Reason::Unmapped),
            _ => Some(Reason::Halted),
        }
    }
}

/// Counters of data movement, for statistics and the demo.
#[derive(Debug, Default)]
pub(crate) struct BusCounters {
    pub(crate) pin_calls: AtomicU32,
    pub(crate) client_transfers: AtomicU32,
}

/// One program's view of guest memory and the store.
pub(crate) struct PinningBus<'a> {
    pub(crate) ctx: &'a DeviceContext,
    pub(crate) store: &'a Store,
    pub(crate) stop: &'a StopFlag,
    /// The device's generation, and the one this program started in: a reset bumps it, and
    /// a program of an older generation stops even if a new start cleared the stop flag.
    pub(crate) generation: &'a AtomicU64,
    pub(crate) started_in: u64,
    pub(crate) pinned: &'a PinnedRanges,
    pub(crate) counters: &'a BusCounters,
}

fn guest_error(e: &GuestError) -> BusError {
    match e {
        GuestError::Pin(p) => pin_error(p),
        GuestError::NotMapped { .. } => BusError::Unmapped,
        GuestError::Permission { .. } => BusError::ReadOnly,
        GuestError::NoHostMemory { .. } => BusError::Unmapped,
        GuestError::BusMasterOff => BusError::Stopped(Reason::BusMasterOff),
        GuestError::Client(_) | GuestError::Truncated { .. } => BusError::Device,
    }
}

fn pin_error(e: &PinError) -> BusError {
    match e {
        PinError::NotMapped { .. } | PinError::Empty => BusError::Unmapped,
        PinError::Permission { .. } => BusError::ReadOnly,
        PinError::Unmapping { .. } => BusError::Stopped(Reason::Unmapped),
        _ => BusError::Device,
    }
}

/// Data moves in blocks of at most this many bytes (an IDAW block is smaller or equal): a
/// halt, an unmap or bus mastering turned off is honoured before the next one, and the
/// residual of a CCW that stops counts every block that moved.
pub(crate) const DATA_BLOCK: usize = 4096;

impl PinningBus<'_> {
    /// Why the program must stop now, if it must.
    fn stop_reason(&self) -> Option<Reason> {
        if !self.ctx.bus_master() {
            return Some(Reason::BusMasterOff);
        }
        self.stop.get().or_else(|| {
            (self.generation.load(Ordering::Acquire) != self.started_in).then_some(Reason::Halted)
        })
    }

    /// True if `len` bytes at `pos` lie inside the store.
    fn in_store(&self, pos: u64, len: usize) -> bool {
        pos.checked_add(len as u64).is_some_and(|end| end <= self.store.size())
    }

    /// Moves the pieces through the client (memory mapped without an fd), block by block.
    fn through_client(&mut self, dir: Direction, pieces: &[Piece], pos: u64) -> Result<(), Partial> {
        self.counters.client_transfers.fetch_add(1, Ordering::Relaxed);
        let mut buf = [0u8; DATA_BLOCK];
        let mut moved = 0u64;
        for p in pieces {
            for (addr, len) in blocks(p) {
                if let Some(reason) = self.stop_reason() {
                    return Err(Partial { error: BusError::Stopped(reason), moved });
                }
                let fail = |error| Partial { error, moved };
                if !self.in_store(pos + moved, len) {
                    return Err(fail(BusError::EndOfStore));
                }
                let buf = &mut buf[..len];
                match dir {
                    Direction::ToGuest => {
                        self.store.read(pos + moved, buf).map_err(|_| fail(BusError::Device))?;
                        self.ctx.write_either(addr, buf).map_err(|e| fail(guest_error(&e)))?;
                    }
                    Direction::FromGuest => {
                        self.ctx.read_either(addr, buf).map_err(|e| fail(guest_error(&e)))?;
                        self.store.write(pos + moved, buf).map_err(|_| fail(BusError::Device))?;
                    }
                }
                moved += len as u64;
            }
        }
        Ok(())
    }
}

/// The blocks of a piece: at most [`DATA_BLOCK`] bytes each, never across a page boundary.
fn blocks(p: &Piece) -> impl Iterator<Item = (u64, usize)> {
    let end = p.addr + u64::from(p.len);
    let mut at = p.addr;
    std::iter::from_fn(move || {
        if at >= end {
            return None;
        }
        let len = (DATA_BLOCK as u64 - at % DATA_BLOCK as u64).min(end - at);
        let block = (at, len as usize);
        at += len;
        Some(block)
    })
}

impl Bus for PinningBus<'_> {
    fn fetch(&mut self, addr: u64, buf: &mut [u8]) -> Result<(), BusError> {
        self.ctx.read_either(addr, buf).map_err(|e| guest_error(&e))
    }

    fn transfer(&mut self, dir: Direction, pieces: &[Piece], store_pos: u64) -> Result<(), Partial> {
        // The page of every piece, in order: ONE pin call for the whole CCW; the engine cuts
        // it into contiguous runs.
        let mut pfns: SmallVec<[u64; 64]> = SmallVec::new();
        let mut first_page: SmallVec<[usize; 64]> = SmallVec::new();
        for p in pieces {
            first_page.push(pfns.len());
            let first = p.addr / PAGE_SIZE;
            let last = (p.addr + u64::from(p.len) - 1) / PAGE_SIZE;
            pfns.extend(first..=last);
        }
        let prot = match dir {
            Direction::ToGuest => Prot::WRITE,
            Direction::FromGuest => Prot::READ,
        };
        if let Some(reason) = self.stop_reason() {
            return Err(BusError::Stopped(reason).into());
        }
        // Announced before the pin call: an unmap arriving while the engine pins (a long
        // lock-mode call) or right after it returns finds these pages and stops the program.
        self.pinned.hold(&pfns);
        self.counters.pin_calls.fetch_add(1, Ordering::Relaxed);
        let pins = match self.ctx.pin_pages(&pfns, prot) {
            Ok(pins) => pins,
            Err(GuestError::Pin(PinError::NoHostMemory { .. })) => {
                self.pinned.clear();
                return self.through_client(dir, pieces, store_pos);
            }
            Err(e) => {
                self.pinned.clear();
                return Err(guest_error(&e).into());
            }
        };
        let mut moved = 0u64;
        let mut result = Ok(());
        'copy: for (p, &page) in pieces.iter().zip(&first_page) {
            // The piece's pages sit consecutively in the guard from index `page`.
            let piece_page = (p.addr / PAGE_SIZE) * PAGE_SIZE;
            for (addr, len) in blocks(p) {
                if let Some(reason) = self.stop_reason() {
                    result = Err(BusError::Stopped(reason));
                    break 'copy;
                }
                if !self.in_store(store_pos + moved, len) {
                    result = Err(BusError::EndOfStore);
                    break 'copy;
                }
                // The block straight between the store and the pinned pages.
                let at = page as u64 * PAGE_SIZE + (addr - piece_page);
                let pos = store_pos + moved;
                let copied = match dir {
                    Direction::ToGuest => pins
                        .io_slices(at, len, Prot::WRITE)
                        .map_err(|_| ())
                        .and_then(|s| self.store.read_vectored(pos, &s).map_err(|_| ())),
                    Direction::FromGuest => pins
                        .io_slices(at, len, Prot::READ)
                        .map_err(|_| ())
                        .and_then(|s| self.store.write_vectored(pos, &s, Durability::Cached).map_err(|_| ())),
                };
                if copied.is_err() || pins.poisoned() {
                    result = Err(BusError::Device);
                    break 'copy;
                }
                moved += len as u64;
            }
        }
        drop(pins);
        self.pinned.clear();
        if result.is_ok() {
            // An unmap that found these pins after the last block was checked asked this
            // program to stop; its pins are gone now, so it has nothing left to stop (a halt
            // request stays).
            self.stop.withdraw(Reason::Unmapped);
        }
        result.map_err(|error| Partial { error, moved })
    }

    fn deliver(&mut self, pieces: &[Piece], data: &[u8]) -> Result<(), Partial> {
        let mut done = 0;
        for p in pieces {
            let n = (p.len as usize).min(data.len() - done);
            if n == 0 {
                break;
            }
            self.ctx
                .write_either(p.addr, &data[done..done + n])
                .map_err(|e| Partial { error: guest_error(&e), moved: done as u64 })?;
            done += n;
        }
        Ok(())
    }

    fn store_size(&self) -> u64 {
        self.store.size()
    }

    fn stopped(&self) -> Option<Reason> {
        self.stop_reason()
    }
}
