//! What a command handler sees: [`CommandCx`], the controller, the queue it came from and the
//! guest memory its request may reach. Never the worker running it.
//!
//! Handlers are `fn(&CommandCx, command) -> Outcome` ([`super::admin`], [`super::io`]).
//! Guest memory is reached through the command's framework permit: pins taken with
//! [`CommandCx::with_pins`] are the request's, so a DMA_UNMAP of them cancels the command.

use std::cell::{Ref, RefCell};
use std::sync::Arc;

use umdev_pinning::{PinnedPages, Prot};

use super::cmds::DataPtr;
use super::completion::{Command, Outcome, Transfer};
use super::ctrl::Ctrl;
use super::prp::DataPages;
use super::queue::Sq;
use super::spec::Status;
use umdev_mdev::guest::GuestError;
use umdev_mdev::request::Permit;
use umdev_mdev::DeviceContext;

/// A command's context: its controller, queue, and request.
pub struct CommandCx<'a> {
    ctrl: &'a Arc<Ctrl>,
    sq: &'a Arc<Sq>,
    generation: u64,
    /// Borrowed, not owned: the worker completes the permit where it put it before the
    /// command ran, not a copy moved out after the command's data copy (see
    /// [`Permit::complete`] for what reading such a copy back can cost).
    permit: RefCell<&'a mut Permit<Command>>,
    /// What the handler handed to the queue's io_uring ([`CommandCx::start`]).
    transfer: RefCell<Option<Transfer>>,
    /// The queue has an io_uring: a file namespace's transfer may be started there.
    aio: bool,
}

/// A transfer's memory as [`CommandCx::pin_for_transfer`] pinned it.
#[derive(Debug)]
pub struct PinnedTransfer {
    /// (host address, bytes) per contiguous piece, in order.
    pub segments: crate::store::Segments,
    /// Runs the engine pinned.
    pub runs: u64,
    /// Kernel pin mode: the index, in the DMA space's io_uring, of the registered buffer
    /// holding all of the memory (one piece only).
    pub fixed: Option<u32>,
}

impl<'a> CommandCx<'a> {
    /// The context of the command `permit` holds, fetched from `sq`.
    pub fn new(
        ctrl: &'a Arc<Ctrl>,
        sq: &'a Arc<Sq>,
        generation: u64,
        permit: &'a mut Permit<Command>,
    ) -> Self {
        CommandCx {
            ctrl,
            sq,
            generation,
            permit: RefCell::new(permit),
            transfer: RefCell::new(None),
            aio: false,
        }
    }

    /// The queue's worker has an io_uring ([`CommandCx::start`] may be used).
    pub fn with_aio(mut self, aio: bool) -> Self {
        self.aio = aio;
        self
    }

    /// Whether the queue's worker has an io_uring for file transfers.
    pub fn aio(&self) -> bool {
        self.aio
    }

    /// Pins `pfns` for `prot` as the request's, kept until the command completes, and gives
    /// the host pieces of `len` bytes from `offset` in them ((address, bytes) per contiguous
    /// run), the number of runs, and, in kernel pin mode, the registered buffer that holds
    /// all the bytes if one does (one run). The pins keep the pieces (and the buffer) valid
    /// while the permit lives.
    pub fn pin_for_transfer(
        &self,
        pfns: &[u64],
        prot: Prot,
        offset: u64,
        len: usize,
    ) -> Result<PinnedTransfer, Status> {
        let mut permit = self.permit.borrow_mut();
        let pins = permit.pin_pages(pfns, prot).map_err(|e| {
            self.ctrl.warn(format_args!(
                "nvme: queue {}: a transfer of {} pages: {e}: Data Transfer Error",
                self.sq().id,
                pfns.len()
            ));
            Status::DATA_TRANSFER_ERROR
        })?;
        let runs = pins.runs().len() as u64;
        let slices = pins.io_slices(offset, len, prot).map_err(|_| Status::DATA_TRANSFER_ERROR)?;
        let segments = crate::store::segments(&slices);
        let fixed = match segments.as_slice() {
            [(addr, bytes)] => pins
                .registered_buffer(offset)
                .filter(|b| b.addr == *addr && b.len >= *bytes as u64)
                .map(|b| b.index),
            _ => None,
        };
        Ok(PinnedTransfer { segments, runs, fixed })
    }

    /// Hands `transfer` to the queue's io_uring: the handler returns what this returns.
    pub fn start(&self, transfer: Transfer) -> Outcome {
        *self.transfer.borrow_mut() = Some(transfer);
        Outcome::Started
    }

    /// The transfer the handler started, if any.
    pub fn into_transfer(self) -> Option<Transfer> {
        self.transfer.into_inner()
    }

    /// The controller.
    pub fn ctrl(&self) -> &'a Arc<Ctrl> {
        self.ctrl
    }

    /// The submission queue the command came from.
    pub fn sq(&self) -> &'a Arc<Sq> {
        self.sq
    }

    /// The controller generation the queue belongs to.
    pub fn generation(&self) -> u64 {
        self.generation
    }

    /// The command's identifier.
    pub fn cid(&self) -> u16 {
        self.permit.borrow().get().sqe().cid()
    }

    /// Whether the queue's work still counts (no disable since it started).
    pub fn current(&self) -> bool {
        self.ctrl.generation() == self.generation
    }

    /// The client's context (guest memory). Borrowed from the request: do not hold it
    /// across [`CommandCx::with_pins`].
    pub fn ctx(&self) -> Ref<'_, DeviceContext> {
        Ref::map(self.permit.borrow(), |p| p.ctx())
    }

    /// Whether the command should stop at its next block: the framework cancelled it (an
    /// unmap, a reset) or the controller was disabled since it started.
    pub fn cancelled(&self) -> bool {
        self.permit.borrow().cancelled().is_some() || !self.current()
    }

    /// Pins `pfns` for `prot` as the request's (one call to the engine), runs `f` on the pins,
    /// then lets go of them. `Ok((r, unmapped))`: `unmapped` if a DMA_UNMAP hit the pins
    /// meanwhile (what `f` moved must not count).
    pub fn with_pins<R>(
        &self,
        pfns: &[u64],
        prot: Prot,
        f: impl FnOnce(&PinnedPages) -> R,
    ) -> Result<(R, bool), GuestError> {
        let mut permit = self.permit.borrow_mut();
        let r = f(permit.pin_pages(pfns, prot)?);
        let unmapped = permit.release_pins();
        Ok((r, unmapped))
    }

    /// Copies `data` to the command's data buffer (its PRPs, §4.3), `data.len()` bytes.
    pub fn write_host(&self, ptr: DataPtr, data: &[u8]) -> Status {
        self.write_host_padded(ptr, data, data.len())
    }

    /// Copies `data` to the command's data buffer of `len` bytes, zeros after it (a log
    /// page shorter than what the host asked for), without a buffer of `len` bytes.
    pub fn write_host_padded(&self, ptr: DataPtr, data: &[u8], len: usize) -> Status {
        static ZEROS: [u8; 4096] = [0; 4096];
        let mut pages = DataPages::default();
        if let Err(s) = pages.resolve(&self.ctx(), ptr.prp1(), ptr.prp2(), len) {
            return s;
        }
        let (offset, data) = (pages.offset as u64, &data[..data.len().min(len)]);
        let written = self.with_pins(&pages.pfns, Prot::WRITE, |pins| {
            pins.write(offset, data)?;
            let mut at = data.len();
            while at < len {
                let n = (len - at).min(ZEROS.len());
                pins.write(offset + at as u64, &ZEROS[..n])?;
                at += n;
            }
            Ok::<_, umdev_mdev::AccessError>(())
        });
        match written {
            Ok((Ok(()), false)) => Status::SUCCESS,
            _ => Status::DATA_TRANSFER_ERROR,
        }
    }

    /// Copies the command's data buffer into `data`.
    pub fn read_host(&self, ptr: DataPtr, data: &mut [u8]) -> Status {
        let mut pages = DataPages::default();
        if let Err(s) = pages.resolve(&self.ctx(), ptr.prp1(), ptr.prp2(), data.len()) {
            return s;
        }
        self.read_pages(&pages.pfns, pages.offset as u64, data)
    }

    /// Copies guest memory through the pages `pfns` (the first `offset` bytes in) into `data`.
    pub fn read_pages(&self, pfns: &[u64], offset: u64, data: &mut [u8]) -> Status {
        match self.with_pins(pfns, Prot::READ, |pins| pins.read(offset, data)) {
            Ok((Ok(()), false)) => Status::SUCCESS,
            _ => Status::DATA_TRANSFER_ERROR,
        }
    }
}
