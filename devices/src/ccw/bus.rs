//! The ccw device's [`Bus`]: guest memory through the pinning engine, one pin call per CCW.

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};

use umdev_pinning::{PinError, Prot, PAGE_SIZE};

use umdev_mdev::guest::GuestError;
use umdev_mdev::request::{Cancel, Permit};

use super::program::{Bus, BusError, Direction, Partial, Piece, Reason};
use super::Job;
use crate::store::{Durability, Store};

/// A HALT for a running program (the subchannel's doorbell), seen at its next block.
#[derive(Debug, Default)]
pub(crate) struct StopFlag(AtomicBool);

impl StopFlag {
    pub(crate) fn request(&self) {
        self.0.store(true, Ordering::Release);
    }

    pub(crate) fn clear(&self) {
        self.0.store(false, Ordering::Release);
    }

    pub(crate) fn requested(&self) -> bool {
        self.0.load(Ordering::Acquire)
    }
}

/// Counters of data movement, for statistics and the demo.
#[derive(Debug, Default)]
pub(crate) struct BusCounters {
    pub(crate) pin_calls: AtomicU32,
    pub(crate) client_transfers: AtomicU32,
}

/// One program's view of guest memory and the store: its request's permit, through which
/// it reaches guest memory and takes its pins.
pub(crate) struct PinningBus<'a> {
    pub(crate) permit: &'a mut Permit<Job>,
    pub(crate) store: &'a Store,
    pub(crate) stop: &'a StopFlag,
    /// The device's generation, and the one this program started in: a reset bumps it, and
    /// a program of an older generation stops even if a new start cleared the stop flag.
    pub(crate) generation: &'a AtomicU64,
    pub(crate) started_in: u64,
    pub(crate) counters: &'a BusCounters,
    /// The subchannel's lists for a CCW's pin call, kept from one program to the next.
    pub(crate) lists: &'a mut PinLists,
}

/// The lists a CCW's pin call is built in: the page of every piece, in order, and where each
/// piece's first page sits among them. A subchannel keeps them from one CCW and program to
/// the next, so that moving data allocates nothing; they grow to the longest CCW seen, up to
/// [`PinLists::KEPT`] entries, and longer ones are let go after their program.
#[derive(Debug, Default)]
pub(crate) struct PinLists {
    pfns: Vec<u64>,
    first_page: Vec<usize>,
}

impl PinLists {
    /// Entries a list keeps: a 4 MiB CCW's pages.
    pub(crate) const KEPT: usize = 1024;

    /// Lets go of what a program's longest CCW grew past [`PinLists::KEPT`].
    pub(crate) fn trim(&mut self) {
        self.pfns.clear();
        self.pfns.shrink_to(Self::KEPT);
        self.first_page.clear();
        self.first_page.shrink_to(Self::KEPT);
    }
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
        if !self.permit.ctx().bus_master() {
            return Some(Reason::BusMasterOff);
        }
        match self.permit.cancelled() {
            Some(Cancel::Unmapped) => return Some(Reason::Unmapped),
            Some(Cancel::Reset) => return Some(Reason::Halted),
            None => {}
        }
        let halted = self.stop.requested() || self.generation.load(Ordering::Acquire) != self.started_in;
        halted.then_some(Reason::Halted)
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
                        self.permit.ctx().write_either(addr, buf).map_err(|e| fail(guest_error(&e)))?;
                    }
                    Direction::FromGuest => {
                        self.permit.ctx().read_either(addr, buf).map_err(|e| fail(guest_error(&e)))?;
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
    // Counted by what is left, not by an end address: a piece may end exactly at 2^64.
    let mut at = p.addr;
    let mut left = u64::from(p.len);
    std::iter::from_fn(move || {
        if left == 0 {
            return None;
        }
        let len = (DATA_BLOCK as u64 - at % DATA_BLOCK as u64).min(left);
        let block = (at, len as usize);
        at = at.wrapping_add(len);
        left -= len;
        Some(block)
    })
}

impl Bus for PinningBus<'_> {
    fn fetch(&mut self, addr: u64, buf: &mut [u8]) -> Result<(), BusError> {
        self.permit.ctx().read_either(addr, buf).map_err(|e| guest_error(&e))
    }

    fn transfer(&mut self, dir: Direction, pieces: &[Piece], store_pos: u64) -> Result<(), Partial> {
        // The page of every piece, in order: ONE pin call for the whole CCW; the engine cuts
        // it into contiguous runs.
        let PinLists { pfns, first_page } = &mut *self.lists;
        pfns.clear();
        first_page.clear();
        for p in pieces {
            first_page.push(pfns.len());
            let first = p.addr / PAGE_SIZE;
            // The last byte, not the end: a piece may end exactly at 2^64.
            let last = (p.addr + u64::from(p.len).saturating_sub(1)) / PAGE_SIZE;
            pfns.extend(first..=last);
        }
        let prot = match dir {
            Direction::ToGuest => Prot::WRITE,
            Direction::FromGuest => Prot::READ,
        };
        if let Some(reason) = self.stop_reason() {
            return Err(BusError::Stopped(reason).into());
        }
        // Taken through the program's permit: an unmap arriving while the engine pins (a long
        // lock-mode call) or while the data moves cancels the program.
        self.counters.pin_calls.fetch_add(1, Ordering::Relaxed);
        match self.permit.pin_pages(&self.lists.pfns, prot) {
            Ok(_) => {}
            Err(GuestError::Pin(PinError::NoHostMemory { .. })) => {
                return self.through_client(dir, pieces, store_pos);
            }
            Err(e) => return Err(guest_error(&e).into()),
        }
        let pins = self.permit.pins().last().expect("pinned above");
        let mut moved = 0u64;
        let mut result = Ok(());
        'copy: for (p, &page) in pieces.iter().zip(&self.lists.first_page) {
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
        // An unmap that found these pins after the last block was checked cancelled the
        // program; its pins are gone now, so the cancellation is withdrawn and a program that
        // moved everything goes on (a halt stays).
        self.permit.release_pins();
        result.map_err(|error| Partial { error, moved })
    }

    fn deliver(&mut self, pieces: &[Piece], data: &[u8]) -> Result<(), Partial> {
        let mut done = 0;
        for p in pieces {
            let n = (p.len as usize).min(data.len() - done);
            if n == 0 {
                break;
            }
            self.permit
                .ctx()
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_piece_that_ends_at_the_top_of_the_address_space_is_cut_whole() {
        let top = u64::MAX - (DATA_BLOCK as u64 - 1);
        assert_eq!(
            blocks(&Piece { addr: top, len: DATA_BLOCK as u32 }).collect::<Vec<_>>(),
            [(top, DATA_BLOCK)]
        );
        let got: Vec<_> = blocks(&Piece { addr: top - 100, len: DATA_BLOCK as u32 + 100 }).collect();
        assert_eq!(got, [(top - 100, 100), (top, DATA_BLOCK)]);
    }
}
