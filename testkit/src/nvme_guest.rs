//! A guest driving an nvme controller over vfio-user with umdev's raw client, as QEMU does:
//! guest RAM in a memfd at IOVA 0, doorbells as posted REGION_WRITEs (no reply), one MSI-X
//! eventfd per vector. The driver logic is `umdev_testkit::nvme_driver`. Used by
//! `umdev nvmebench` and the tests.

use std::fs::File;
use std::os::fd::AsRawFd;
use std::path::Path;
use std::time::Duration;
use vm_memory::VolatileMemory;

use crate::client::{region_write_payload, set_irqs_payload, RawClient};
use crate::nvme_driver::{Driver, Error, Transport};
use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
use umdev_server::wire::{flags, Command};
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

/// The guest's side of one nvme controller.
pub struct NvmeGuest {
    /// The vfio-user connection.
    pub client: RawClient,
    /// Guest RAM, at IOVA 0.
    pub ram: File,
    /// The same RAM mapped here: the "guest" reads and writes it directly, as a VM does.
    mem: vm_memory::mmap::MmapRegion,
    /// One eventfd per MSI-X vector.
    pub irqs: Vec<EventFd>,
    /// Doorbells as posted writes (as QEMU sends BAR writes); `false`: each waits for its
    /// reply.
    pub posted: bool,
}

fn err(e: impl std::fmt::Display) -> Error {
    e.to_string()
}

impl NvmeGuest {
    /// Connects, maps `ram_size` bytes of memfd RAM at IOVA 0, enables memory decode, bus
    /// mastering and MSI-X with `vectors` eventfds.
    pub fn connect(socket: &Path, ram_size: u64, vectors: u32) -> Result<NvmeGuest, Error> {
        let mut client = RawClient::connect(socket).map_err(err)?;
        client.negotiate().map_err(|e| format!("VERSION: {e}"))?;
        let fd = nix::sys::memfd::memfd_create(c"umdev-nvme-guest-ram", nix::sys::memfd::MFdFlags::empty())
            .map_err(err)?;
        let ram = File::from(fd);
        ram.set_len(ram_size).map_err(err)?;
        let map = crate::client::dma_map_payload(3, 0, 0, ram_size);
        let r = client.request(Command::DmaMap as u16, &map, &[ram.as_raw_fd()]).map_err(err)?;
        if r.errno() != 0 {
            return Err(format!("DMA_MAP: errno {}", r.errno()));
        }
        client.enable_bus_master().map_err(|e| format!("COMMAND: {e}"))?;
        let len = usize::try_from(ram_size).map_err(err)?;
        let mem = vm_memory::mmap::MmapRegion::from_file(
            vm_memory::FileOffset::new(ram.try_clone().map_err(err)?, 0),
            len,
        )
        .map_err(err)?;
        let mut g = NvmeGuest { client, ram, mem, irqs: Vec::new(), posted: true };
        let mut ptr = g.config(0x34, 1)?;
        while ptr != 0 && g.config(ptr, 1)? != 0x11 {
            ptr = g.config(ptr + 1, 1)?;
        }
        if ptr == 0 {
            return Err("no MSI-X capability".into());
        }
        let control = g.config(ptr + 2, 2)? as u16;
        let r =
            g.client.region_write(7, u64::from(ptr) + 2, &(control | 0x8000).to_le_bytes()).map_err(err)?;
        if r.errno() != 0 {
            return Err(format!("MSI-X enable: errno {}", r.errno()));
        }
        g.irqs = (0..vectors).map(|_| EventFd::new(EFD_NONBLOCK)).collect::<Result<_, _>>().map_err(err)?;
        let fds: Vec<i32> = g.irqs.iter().map(|e| e.as_raw_fd()).collect();
        // VFIO_IRQ_SET_DATA_EVENTFD | VFIO_IRQ_SET_ACTION_TRIGGER, index 2 (MSI-X).
        let set = set_irqs_payload(0x04 | 0x20, 2, 0, vectors, &[]);
        let r = g.client.request(Command::DeviceSetIrqs as u16, &set, &fds).map_err(err)?;
        if r.errno() != 0 {
            return Err(format!("SET_IRQS: errno {}", r.errno()));
        }
        Ok(g)
    }

    fn config(&mut self, offset: u32, len: u32) -> Result<u32, Error> {
        let r = self.client.region_read(7, u64::from(offset), len).map_err(err)?;
        let data = r.payload.get(16..16 + len as usize).ok_or("short config read")?;
        let mut b = [0u8; 4];
        b[..data.len()].copy_from_slice(data);
        Ok(u32::from_le_bytes(b))
    }

    /// A driver for this controller.
    pub fn driver(self) -> Driver<NvmeGuest> {
        Driver::new(self)
    }
}

impl Transport for NvmeGuest {
    fn read32(&mut self, offset: u64) -> Result<u32, Error> {
        let r = self.client.region_read(0, offset, 4).map_err(err)?;
        if r.errno() != 0 {
            return Err(format!("REGION_READ {offset:#x}: errno {}", r.errno()));
        }
        let data = r.payload.get(16..20).ok_or("short REGION_READ reply")?;
        Ok(u32::from_le_bytes(data.try_into().expect("4 bytes")))
    }

    fn write32(&mut self, offset: u64, value: u32) -> Result<(), Error> {
        let r = self.client.region_write(0, offset, &value.to_le_bytes()).map_err(err)?;
        match r.errno() {
            0 => Ok(()),
            e => Err(format!("REGION_WRITE {offset:#x}: errno {e}")),
        }
    }

    fn doorbell(&mut self, offset: u64, value: u32) -> Result<(), Error> {
        if !self.posted {
            return self.write32(offset, value);
        }
        let payload = region_write_payload(0, offset, &value.to_le_bytes());
        self.client.send(Command::RegionWrite as u16, flags::NO_REPLY, &payload, &[]).map(|_| ()).map_err(err)
    }

    fn put(&mut self, addr: u64, bytes: &[u8]) -> Result<(), Error> {
        let at = usize::try_from(addr).map_err(err)?;
        self.mem.get_slice(at, bytes.len()).map_err(err)?.copy_from(bytes);
        Ok(())
    }

    fn get(&mut self, addr: u64, buf: &mut [u8]) -> Result<(), Error> {
        let at = usize::try_from(addr).map_err(err)?;
        self.mem.get_slice(at, buf.len()).map_err(err)?.copy_to(buf);
        Ok(())
    }

    fn wait_interrupt(&mut self, vector: u16, timeout: Duration) -> Option<bool> {
        let efd = self.irqs.get(usize::from(vector))?;
        Some(wait_eventfd(efd, timeout))
    }
}

/// Waits up to `timeout` for `efd` and consumes its count; true if it was signalled.
pub fn wait_eventfd(efd: &EventFd, timeout: Duration) -> bool {
    // SAFETY: the eventfd outlives the borrow.
    let fd = unsafe { std::os::fd::BorrowedFd::borrow_raw(efd.as_raw_fd()) };
    let mut fds = [PollFd::new(fd, PollFlags::POLLIN)];
    let ready = poll(&mut fds, PollTimeout::try_from(timeout).unwrap_or(PollTimeout::MAX)).unwrap_or(0) == 1;
    if ready {
        let _ = efd.read();
    }
    ready
}
