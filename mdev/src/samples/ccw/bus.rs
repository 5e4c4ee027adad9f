//! The ccw device's [`Bus`]: guest memory through the pinning engine, one pin call per CCW.

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::Mutex;

use smallvec::SmallVec;
use umdev_pinning::{PinError, Prot, PAGE_SIZE};

use super::program::{Bus, BusError, Direction, Piece, Reason};
use super::store::Store;
use crate::device::DeviceContext;
use crate::guest::GuestError;

/// The IOVA ranges a subchannel holds pins in, so an unmap can tell whether it is affected.
#[derive(Debug, Default)]
pub(crate) struct PinnedRanges {
    ranges: Mutex<SmallVec<[(u64, u64); 4]>>,
}

impl PinnedRanges {
    fn set(&self, ranges: SmallVec<[(u64, u64); 4]>) {
        *self.ranges.lock().unwrap_or_else(|p| p.into_inner()) = ranges;
    }

    /// True if any held range overlaps `[iova, iova + len)`.
    pub(crate) fn overlaps(&self, iova: u64, len: u64) -> bool {
        let end = iova.saturating_add(len);
        self.ranges.lock().unwrap_or_else(|p| p.into_inner()).iter().any(|&(s, e)| s < end && iova < e)
    }
}

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

impl PinningBus<'_> {
    /// Why the program must stop now, if it must.
    fn stop_reason(&self) -> Option<Reason> {
        self.stop.get().or_else(|| {
            (self.generation.load(Ordering::Acquire) != self.started_in).then_some(Reason::Halted)
        })
    }

    /// Moves the pieces through the client (memory mapped without an fd).
    fn through_client(&mut self, dir: Direction, pieces: &[Piece], mut pos: u64) -> Result<(), BusError> {
        self.counters.client_transfers.fetch_add(1, Ordering::Relaxed);
        let mut buf = Vec::new();
        for p in pieces {
            if let Some(reason) = self.stop_reason() {
                return Err(BusError::Stopped(reason));
            }
            let store = self.store.slice(pos, p.len as usize).ok_or(BusError::EndOfStore)?;
            buf.resize(p.len as usize, 0);
            match dir {
                Direction::ToGuest => {
                    store.copy_to(&mut buf[..]);
                    self.ctx.write_guest(p.addr, &buf).map_err(|e| guest_error(&e))?;
                }
                Direction::FromGuest => {
                    self.ctx.read_guest(p.addr, &mut buf).map_err(|e| guest_error(&e))?;
                    store.copy_from(&buf[..]);
                }
            }
            pos += u64::from(p.len);
        }
        Ok(())
    }
}

impl Bus for PinningBus<'_> {
    fn fetch(&mut self, addr: u64, buf: &mut [u8]) -> Result<(), BusError> {
        self.ctx.read_guest(addr, buf).map_err(|e| guest_error(&e))
    }

    fn transfer(&mut self, dir: Direction, pieces: &[Piece], store_pos: u64) -> Result<(), BusError> {
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
        self.counters.pin_calls.fetch_add(1, Ordering::Relaxed);
        let pins = match self.ctx.dma.pin_pages(&pfns, prot) {
            Ok(pins) => pins,
            Err(PinError::NoHostMemory { .. }) => return self.through_client(dir, pieces, store_pos),
            Err(e) => return Err(pin_error(&e)),
        };
        self.pinned.set(pins.runs().iter().map(|r| (r.iova(), r.iova() + r.len())).collect());
        let mut pos = store_pos;
        let mut result = Ok(());
        for (p, &page) in pieces.iter().zip(&first_page) {
            if let Some(reason) = self.stop_reason() {
                result = Err(BusError::Stopped(reason));
                break;
            }
            let Some(store) = self.store.slice(pos, p.len as usize) else {
                result = Err(BusError::EndOfStore);
                break;
            };
            let at = page as u64 * PAGE_SIZE + p.addr % PAGE_SIZE;
            let copied = match dir {
                Direction::ToGuest => pins.write_volatile(at, &store),
                Direction::FromGuest => pins.read_volatile(at, &store),
            };
            if copied.is_err() {
                result = Err(BusError::Device);
                break;
            }
            pos += u64::from(p.len);
        }
        drop(pins);
        self.pinned.set(SmallVec::new());
        result
    }

    fn deliver(&mut self, pieces: &[Piece], data: &[u8]) -> Result<(), BusError> {
        let mut done = 0;
        for p in pieces {
            let n = (p.len as usize).min(data.len() - done);
            self.ctx.write_guest(p.addr, &data[done..done + n]).map_err(|e| guest_error(&e))?;
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
