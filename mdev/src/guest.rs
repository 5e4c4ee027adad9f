//! The client's context ([`DeviceContext`]) and guest memory through it: pins, byte copies and
//! typed objects, each by a path the device names.
//!
//! - **Pinned** (`pin_pages`, `pin_range`, `read_pinned`, `write_pinned`): memory the client
//!   mapped with an fd, through the pinning engine. Memory mapped without an fd fails
//!   ([`GuestError::NoHostMemory`]): a device never gets the slow path by surprise.
//! - **Through the client** (`read_via_client`, `write_via_client`): vfio-user DMA_READ and
//!   DMA_WRITE, for memory mapped without an fd; only from a device thread.
//! - **Either** (`read_either`, `write_either`, and the typed `read_obj`/`write_obj`): pinned
//!   where the client gave an fd, through the client elsewhere, for devices that take
//!   whatever the VMM mapped (ccw and testdev do, as their documents say).
//!
//! Byte copies pin briefly (pin, copy, unpin); devices moving bulk data pin their pages
//! themselves and keep the guard for the transfer. Every entry point refuses while the
//! device's bus mastering is off.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use thiserror::Error;

use umdev_pinning::{AccessError, DmaSpace, PinError, PinnedPages, Prot, PAGE_SIZE};
use vm_memory::ByteValued;

use crate::device::{ClientDma, ClientDmaError};

/// Why a guest memory access failed.
#[derive(Debug, Error)]
pub enum GuestError {
    /// The address range wraps or is empty of mappings.
    #[error("guest range [{iova:#x}, +{len:#x}) is not mapped")]
    NotMapped {
        /// First byte.
        iova: u64,
        /// Length.
        len: u64,
    },
    /// The client truncated the file behind the memory during the access: a read saw
    /// zeros, a write was lost.
    #[error("guest memory at {iova:#x} was truncated by the client")]
    Truncated {
        /// The piece's first byte.
        iova: u64,
    },
    /// Pinning the fd-backed part failed.
    #[error(transparent)]
    Pin(#[from] PinError),
    /// The client refused or could not do the transfer.
    #[error(transparent)]
    Client(#[from] ClientDmaError),
    /// Bus mastering is off (PCI COMMAND.BME clear): the device may not reach guest memory.
    #[error("bus mastering is off")]
    BusMasterOff,
    /// Part of the range was mapped without an fd and the device asked for pinned memory.
    #[error("guest range [{iova:#x}, +{len:#x}) has no host memory (mapped without an fd)")]
    NoHostMemory {
        /// First byte.
        iova: u64,
        /// Length.
        len: u64,
    },
    /// The range's memory does not permit the access (a write to memory mapped read-only).
    #[error("guest range [{iova:#x}, +{len:#x}) does not permit this access")]
    Permission {
        /// First byte.
        iova: u64,
        /// Length.
        len: u64,
    },
}

/// Whether a device may master the bus: PCI's COMMAND.BME as the guest last wrote it. A
/// device never reads or writes guest memory while it is off; [`DeviceContext`] refuses
/// every pin and copy then, so a device cannot forget. Cheap to clone: clones share it.
#[derive(Clone, Debug)]
pub struct BusMaster(Arc<AtomicBool>);

impl BusMaster {
    /// A switch in state `on`.
    pub fn new(on: bool) -> BusMaster {
        BusMaster(Arc::new(AtomicBool::new(on)))
    }

    /// Whether the device may reach guest memory now.
    pub fn enabled(&self) -> bool {
        self.0.load(Ordering::Acquire)
    }

    /// Turns bus mastering on or off (the PCI layer, on COMMAND writes and resets).
    pub fn set(&self, on: bool) {
        self.0.store(on, Ordering::Release);
    }
}

/// What a device gets when a client connects: its way to guest memory.
///
/// Guest memory is reached only through these methods, which refuse while bus mastering is
/// off ([`crate::guest::GuestError::BusMasterOff`]): pin pages ([`DeviceContext::pin_pages`],
/// [`DeviceContext::pin_range`]) to move bulk data through the guard, or copy bytes
/// ([`DeviceContext::read_pinned`], [`DeviceContext::read_either`], [`DeviceContext::read_obj`], ...).
#[derive(Clone)]
pub struct DeviceContext {
    /// The client's DMA space: fd-backed guest memory is pinned here.
    pub(crate) dma: DmaSpace,
    /// DMA through the client, for memory mapped without an fd.
    pub(crate) client_dma: Arc<dyn ClientDma>,
    /// The PCI function's bus master enable (always on for devices without one).
    pub(crate) bus_master: BusMaster,
}

impl DeviceContext {
    /// A context over the client's DMA space and its DMA channel, bus mastering on. The PCI
    /// layer ([`crate::pci::PciDevice`]) ties it to the function's COMMAND.BME.
    pub fn new(dma: DmaSpace, client_dma: Arc<dyn ClientDma>) -> DeviceContext {
        DeviceContext { dma, client_dma, bus_master: BusMaster::new(true) }
    }

    /// The same context, gated by `bus_master`.
    pub fn with_bus_master(mut self, bus_master: BusMaster) -> DeviceContext {
        self.bus_master = bus_master;
        self
    }

    /// Whether the device may reach guest memory now.
    pub fn bus_master(&self) -> bool {
        self.bus_master.enabled()
    }

    /// The bus master switch itself, for a device that keeps guest memory pinned and reaches
    /// it without a call here (a doorbell page it polls): it looks at the switch before each
    /// access.
    pub fn bus_master_switch(&self) -> BusMaster {
        self.bus_master.clone()
    }

    /// How the client's DMA space pins pages.
    pub fn pin_mode(&self) -> umdev_pinning::PinMode {
        self.dma.mode()
    }

    /// Kernel pin mode: the io_uring whose registered buffers are the kernel's pins of the
    /// guest's pages ([`umdev_pinning::DmaSpace::kernel_ring_fd`], with
    /// [`PinnedPages::registered_buffer`]); `None` in the other modes.
    pub fn kernel_ring_fd(&self) -> Option<std::os::fd::BorrowedFd<'_>> {
        self.dma.kernel_ring_fd()
    }
}

impl std::fmt::Debug for DeviceContext {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceContext")
            .field("dma", &self.dma)
            .field("bus_master", &self.bus_master.enabled())
            .finish_non_exhaustive()
    }
}

impl DeviceContext {
    /// Pins the guest pages `pfns` (IOVA page numbers, any order) for `prot` access with one
    /// call to the engine, which cuts them into contiguous runs; see
    /// [`umdev_pinning::DmaSpace::pin_pages`].
    pub fn pin_pages(&self, pfns: &[u64], prot: Prot) -> Result<PinnedPages, GuestError> {
        if !self.bus_master() {
            return Err(GuestError::BusMasterOff);
        }
        Ok(self.dma.pin_pages(pfns, prot)?)
    }

    /// Pins `npages` pages from `iova`; see [`umdev_pinning::DmaSpace::pin_range`].
    pub fn pin_range(&self, iova: u64, npages: u64, prot: Prot) -> Result<PinnedPages, GuestError> {
        if !self.bus_master() {
            return Err(GuestError::BusMasterOff);
        }
        Ok(self.dma.pin_range(iova, npages, prot)?)
    }

    /// Asks the CPU to start loading guest memory the device will read soon; see
    /// [`umdev_pinning::DmaSpace::prefetch`]. Nothing with bus mastering off.
    pub fn prefetch(&self, iova: u64, len: usize) {
        if self.bus_master() {
            self.dma.prefetch(iova, len);
        }
    }

    /// Reads `buf.len()` bytes of fd-backed guest memory at `iova`, pinned for the copy.
    pub fn read_pinned(&self, iova: u64, buf: &mut [u8]) -> Result<(), GuestError> {
        self.copy_in(iova, buf, Path::Pinned)
    }

    /// Writes `data` to fd-backed guest memory at `iova`, pinned for the copy.
    pub fn write_pinned(&self, iova: u64, data: &[u8]) -> Result<(), GuestError> {
        self.copy_out(iova, data, Path::Pinned)
    }

    /// Reads guest memory at `iova` through the client (vfio-user DMA_READ), whatever the
    /// mapping; from a device thread only.
    pub fn read_via_client(&self, iova: u64, buf: &mut [u8]) -> Result<(), GuestError> {
        self.copy_in(iova, buf, Path::Client)
    }

    /// Writes guest memory at `iova` through the client (vfio-user DMA_WRITE).
    pub fn write_via_client(&self, iova: u64, data: &[u8]) -> Result<(), GuestError> {
        self.copy_out(iova, data, Path::Client)
    }

    /// Reads guest memory at `iova`: pinned where the client gave an fd, through the
    /// client elsewhere.
    pub fn read_either(&self, iova: u64, buf: &mut [u8]) -> Result<(), GuestError> {
        self.copy_in(iova, buf, Path::Either)
    }

    /// Writes guest memory at `iova`: pinned where the client gave an fd, through the
    /// client elsewhere.
    pub fn write_either(&self, iova: u64, data: &[u8]) -> Result<(), GuestError> {
        self.copy_out(iova, data, Path::Either)
    }

    /// Reads a `T` (a `#[repr(C)]` guest structure) at `iova`, as
    /// [`read_either`](Self::read_either).
    pub fn read_obj<T: ByteValued>(&self, iova: u64) -> Result<T, GuestError> {
        let mut value = T::zeroed();
        self.read_either(iova, value.as_mut_slice())?;
        Ok(value)
    }

    /// Writes a `T` at `iova`, as [`write_either`](Self::write_either): mapping and
    /// permissions are checked for all of it first, but a failure during the copy (memory
    /// the client truncated, a client refusing a later piece) can leave part of it written.
    pub fn write_obj<T: ByteValued>(&self, iova: u64, value: &T) -> Result<(), GuestError> {
        self.write_either(iova, value.as_slice())
    }

    fn copy_in(&self, iova: u64, buf: &mut [u8], path: Path) -> Result<(), GuestError> {
        self.access(iova, buf.len(), Prot::READ, path, |piece_iova, at, n, via| match via {
            Via::Pinned(pins) => pins
                .read(piece_iova % PAGE_SIZE, &mut buf[at..at + n])
                .map_err(|e| access_error(e, piece_iova)),
            Via::Client(mapping) => {
                let may_send = |iova| self.client_may_send(mapping, iova);
                let done = self.client_dma.read(piece_iova, &mut buf[at..at + n], &may_send);
                done.map_err(|e| self.client_error(e, piece_iova, n))
            }
        })
    }

    fn copy_out(&self, iova: u64, data: &[u8], path: Path) -> Result<(), GuestError> {
        self.access(iova, data.len(), Prot::WRITE, path, |piece_iova, at, n, via| match via {
            Via::Pinned(pins) => {
                pins.write(piece_iova % PAGE_SIZE, &data[at..at + n]).map_err(|e| access_error(e, piece_iova))
            }
            Via::Client(mapping) => {
                let may_send = |iova| self.client_may_send(mapping, iova);
                let done = self.client_dma.write(piece_iova, &data[at..at + n], &may_send);
                done.map_err(|e| self.client_error(e, piece_iova, n))
            }
        })
    }

    /// Whether a piece of a client transfer within the mapping `mapping` (its id) may still
    /// go out, from `iova`: bus mastering on, and the mapping there still the one the transfer
    /// was checked against (not unmapped, nor unmapped and another mapped in its place).
    fn client_may_send(&self, mapping: u64, iova: u64) -> bool {
        self.bus_master() && self.dma.lookup(iova).is_some_and(|m| m.id == mapping)
    }

    /// A client transfer's error as the guest sees it: one stopped by [`Self::client_may_send`]
    /// is bus mastering off or memory not mapped, as if the transfer had been checked then.
    fn client_error(&self, e: ClientDmaError, iova: u64, len: usize) -> GuestError {
        match e {
            ClientDmaError::Withdrawn if !self.bus_master() => GuestError::BusMasterOff,
            ClientDmaError::Withdrawn => GuestError::NotMapped { iova, len: len as u64 },
            e => GuestError::Client(e),
        }
    }

    /// Splits `[iova, iova + len)` at mapping boundaries and calls `f(iova, offset, len, via)`
    /// per piece: [`Via::Pinned`] for fd-backed pieces (pinned from the piece's page),
    /// [`Via::Client`] with the mapping's id for the others.
    /// The whole range is checked first (mapped, with the access permitted), so an access
    /// that cannot complete touches nothing: a status block that runs off the end of RAM is
    /// not half written.
    fn access(
        &self,
        iova: u64,
        len: usize,
        prot: Prot,
        path: Path,
        mut f: impl FnMut(u64, usize, usize, Via<'_>) -> Result<(), GuestError>,
    ) -> Result<(), GuestError> {
        let not_mapped = || GuestError::NotMapped { iova, len: len as u64 };
        if len == 0 {
            return Ok(());
        }
        if !self.bus_master() {
            return Err(GuestError::BusMasterOff);
        }
        let last = iova.checked_add(len as u64 - 1).ok_or_else(not_mapped)?;
        if path != Path::Client && iova / PAGE_SIZE == last / PAGE_SIZE {
            // Within one page (a PRP list's entries, a status block): the engine's fast pin
            // checks what the passes below would (mapped, the access permitted, host memory),
            // and covers the whole access, so it goes whole or not at all; two lookups in the
            // table's tree fewer per command. Where it cannot, it counts nothing, and the
            // passes below give the exact error or take the client's path.
            if let Some(pins) = self.dma.try_pin_page(iova, prot) {
                return f(iova, 0, len, Via::Pinned(&pins));
            }
        }
        let mut checked = 0usize;
        while checked < len {
            let here = iova + checked as u64;
            let mapping = self.dma.lookup(here).ok_or_else(not_mapped)?;
            if !mapping.prot.contains(prot) {
                return Err(GuestError::Permission { iova, len: len as u64 });
            }
            if path == Path::Pinned && !mapping.has_memory {
                return Err(GuestError::NoHostMemory { iova, len: len as u64 });
            }
            checked += ((mapping.iova + (mapping.size - 1) - here) as usize + 1).min(len - checked);
        }
        let mut done = 0usize;
        while done < len {
            let here = iova + done as u64;
            let mapping = self.dma.lookup(here).ok_or_else(not_mapped)?;
            let mapping_end = mapping.iova + (mapping.size - 1);
            let n = ((mapping_end - here) as usize + 1).min(len - done);
            if mapping.has_memory && path != Path::Client {
                let first = here / PAGE_SIZE;
                let last = (here + n as u64 - 1) / PAGE_SIZE;
                let pins = self.dma.pin_range(first * PAGE_SIZE, last - first + 1, prot)?;
                f(here, done, n, Via::Pinned(&pins))?;
            } else {
                f(here, done, n, Via::Client(mapping.id))?;
            }
            done += n;
        }
        Ok(())
    }
}

/// How one piece of an access reaches guest memory.
enum Via<'a> {
    /// Fd-backed, pinned from the piece's page.
    Pinned(&'a umdev_pinning::PinnedPages),
    /// Through the client, within the mapping of this id.
    Client(u64),
}

/// Which way a copy goes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Path {
    Pinned,
    Client,
    Either,
}

fn access_error(e: AccessError, iova: u64) -> GuestError {
    match e {
        AccessError::Poisoned => GuestError::Truncated { iova },
        // The pin covers exactly the pages of the piece with the access asked for, so the
        // guard accepts the copy; reaching this means an engine bug, reported rather than
        // panicking.
        AccessError::OutOfRange { .. } | AccessError::ReadOnly | AccessError::NotContiguous { .. } => {
            GuestError::NotMapped { iova: 0, len: 0 }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::fs::File;
    use std::os::fd::AsFd;

    /// A client whose DMA messages read 0xcc and take writes, counting both.
    #[derive(Default)]
    struct Messages(std::sync::atomic::AtomicUsize);

    impl ClientDma for Messages {
        fn read(
            &self,
            _iova: u64,
            buf: &mut [u8],
            _may_send: &dyn Fn(u64) -> bool,
        ) -> Result<(), ClientDmaError> {
            self.0.fetch_add(1, Ordering::Relaxed);
            buf.fill(0xcc);
            Ok(())
        }
        fn write(
            &self,
            _iova: u64,
            _data: &[u8],
            _may_send: &dyn Fn(u64) -> bool,
        ) -> Result<(), ClientDmaError> {
            self.0.fetch_add(1, Ordering::Relaxed);
            Ok(())
        }
    }

    /// Pages 0-1 RAM (read-write), page 2 RAM read-only, page 3 without an fd, from page 4 on
    /// unmapped.
    fn guest() -> (DeviceContext, Arc<Messages>, File) {
        let ram = File::from(
            nix::sys::memfd::memfd_create(c"guest-test", nix::sys::memfd::MFdFlags::MFD_CLOEXEC).unwrap(),
        );
        ram.set_len(3 * PAGE_SIZE).unwrap();
        let dma = DmaSpace::default();
        dma.map(0, 2 * PAGE_SIZE, ram.as_fd(), 0, Prot::READ_WRITE).unwrap();
        dma.map(2 * PAGE_SIZE, PAGE_SIZE, ram.as_fd(), 2 * PAGE_SIZE, Prot::READ).unwrap();
        dma.map_message_only(3 * PAGE_SIZE, PAGE_SIZE, Prot::READ_WRITE).unwrap();
        let messages = Arc::new(Messages::default());
        (DeviceContext::new(dma, messages.clone()), messages, ram)
    }

    #[test]
    fn an_access_within_a_page_and_one_across_pages_copy_the_guests_bytes() {
        use std::os::unix::fs::FileExt;
        let (ctx, _, ram) = guest();
        let data: Vec<u8> = (0..=255).collect();
        // Within page 0, and across the boundary of pages 0 and 1: written by the device,
        // read from the memfd; written to the memfd, read by the device.
        for at in [100, PAGE_SIZE - 128] {
            ctx.write_pinned(at, &data).unwrap();
            let mut back = [0u8; 256];
            ram.read_exact_at(&mut back, at).unwrap();
            assert_eq!(back[..], data[..]);
            let reversed: Vec<u8> = data.iter().rev().copied().collect();
            ram.write_all_at(&reversed, at).unwrap();
            ctx.read_pinned(at, &mut back).unwrap();
            assert_eq!(back[..], reversed[..]);
        }
        // Nothing stays pinned after a copy, and nothing failed.
        let stats = ctx.dma.stats();
        assert_eq!((stats.pinned_pages, stats.pin_failures), (0, 0));
    }

    #[test]
    fn a_refused_access_within_a_page_reports_what_the_full_check_does() {
        let (ctx, messages, _ram) = guest();
        let mut buf = [0u8; 64];
        // Unmapped, read-only for a write, no fd for a pinned path: each with its own error,
        // within a page as across pages.
        for at in [4 * PAGE_SIZE + 8, 5 * PAGE_SIZE - 32] {
            let read = ctx.read_pinned(at, &mut buf);
            assert!(matches!(read, Err(GuestError::NotMapped { iova, .. }) if iova == at), "{read:?}");
        }
        let write = ctx.write_pinned(2 * PAGE_SIZE + 8, &buf);
        assert!(matches!(write, Err(GuestError::Permission { .. })), "{write:?}");
        let read = ctx.read_pinned(3 * PAGE_SIZE + 8, &mut buf);
        assert!(matches!(read, Err(GuestError::NoHostMemory { .. })), "{read:?}");
        // The either path takes the client's way there, and the pinned one on RAM.
        ctx.read_either(3 * PAGE_SIZE + 8, &mut buf).unwrap();
        assert_eq!(buf, [0xcc; 64]);
        assert_eq!(messages.0.load(Ordering::Relaxed), 1);
        ctx.read_either(8, &mut buf).unwrap();
        assert_eq!(buf, [0; 64]);
        assert_eq!(messages.0.load(Ordering::Relaxed), 1);
        // Refused by the checks before any pin, or copied through the client: no pin was
        // attempted and failed (a failure counted here would show in `umdev stats`).
        assert_eq!(ctx.dma.stats().pin_failures, 0);
        // Bus mastering off refuses before anything is looked at.
        ctx.bus_master.set(false);
        assert!(matches!(ctx.read_pinned(8, &mut buf), Err(GuestError::BusMasterOff)));
    }

    /// A client taking writes in 8-byte pieces, asking `may_send` of each, which between the
    /// first and the second unmaps the message-only page and maps another there.
    struct Remapping {
        dma: DmaSpace,
        sent: std::sync::atomic::AtomicUsize,
    }

    impl ClientDma for Remapping {
        fn read(&self, _: u64, _: &mut [u8], _: &dyn Fn(u64) -> bool) -> Result<(), ClientDmaError> {
            unreachable!("only writes here")
        }
        fn write(
            &self,
            iova: u64,
            data: &[u8],
            may_send: &dyn Fn(u64) -> bool,
        ) -> Result<(), ClientDmaError> {
            for at in (iova..iova + data.len() as u64).step_by(8) {
                if at == iova + 8 {
                    self.dma.unmap(3 * PAGE_SIZE, PAGE_SIZE).unwrap();
                    self.dma.map_message_only(3 * PAGE_SIZE, PAGE_SIZE, Prot::READ_WRITE).unwrap();
                }
                if !may_send(at) {
                    return Err(ClientDmaError::Withdrawn);
                }
                self.sent.fetch_add(1, Ordering::Relaxed);
            }
            Ok(())
        }
    }

    /// A transfer through the client is checked against the mapping it began in before each
    /// piece: memory unmapped meanwhile, even with another mapping now at the same addresses
    /// (a client that unmapped and mapped again), gets no further piece, and the access fails
    /// as unmapped memory does.
    #[test]
    fn a_client_transfer_stops_where_its_mapping_was_replaced() {
        let (ctx, _, _ram) = guest();
        let client = Arc::new(Remapping { dma: ctx.dma.clone(), sent: Default::default() });
        let ctx = DeviceContext::new(ctx.dma.clone(), client.clone());
        let write = ctx.write_via_client(3 * PAGE_SIZE, &[1; 32]);
        assert!(matches!(write, Err(GuestError::NotMapped { .. })), "{write:?}");
        assert_eq!(client.sent.load(Ordering::Relaxed), 1, "the first piece alone went out");
        // On the new mapping, a new transfer goes whole.
        let dma = ctx.dma.clone();
        let steady = Arc::new(Messages::default());
        DeviceContext::new(dma, steady.clone()).write_via_client(3 * PAGE_SIZE, &[1; 32]).unwrap();
        assert_eq!(steady.0.load(Ordering::Relaxed), 1);
    }
}
