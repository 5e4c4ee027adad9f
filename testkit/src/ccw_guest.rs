//! A guest driving a ccw device over vfio-user, through rust-vmm's `vfio_user::Client`: guest
//! RAM in a memfd at IOVA 0, programs laid out with `umdev_devices::ccw::driver`, one
//! MSI-X eventfd per subchannel. Used by `umdev demo`, `umdev ccwbench` and the tests.

use std::fs::File;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd};
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::time::Duration;

use crate::ccw_driver::{layout, Op};
use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
use umdev_devices::ccw::program::{Status, STATUS_SIZE};
use umdev_devices::ccw::regs;
use vfio_user::Client;
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

/// What went wrong driving the device.
pub type Error = String;

/// Guest RAM size.
pub const RAM_SIZE: u64 = 256 << 20;
/// Guest RAM from here on is free for data buffers.
pub const DATA_BASE: u64 = 4 << 20;

/// Where subchannel `sc`'s channel programs go.
pub fn program_area(sc: u32) -> u64 {
    0x1000 + 0x1000 * u64::from(sc)
}
/// Where subchannel `sc`'s IDAW lists go (128 KiB: 16384 IDAWs).
pub fn idal_area(sc: u32) -> u64 {
    0x2_0000 + 0x2_0000 * u64::from(sc)
}
/// Where subchannel `sc`'s status block goes.
pub fn status_area(sc: u32) -> u64 {
    0x30_0000 + 0x100 * u64::from(sc)
}
/// Free guest memory for small arguments (SEEK positions).
pub const SCRATCH: u64 = 0x32_0000;

fn reg(sc: u32, r: u64) -> u64 {
    regs::SUBCHANNEL_BASE + u64::from(sc) * regs::SUBCHANNEL_STRIDE + r
}

/// The guest's side of one ccw device.
pub struct CcwGuest {
    /// The vfio-user client.
    pub client: Client,
    /// Guest RAM.
    pub ram: File,
    /// One eventfd per subchannel (MSI-X vector = subchannel).
    pub irqs: Vec<EventFd>,
    /// Subchannels of the device.
    pub subchannels: u32,
}

impl CcwGuest {
    /// Connects, maps `RAM_SIZE` of memfd RAM at IOVA 0, enables memory decode and bus
    /// mastering, and MSI-X with one eventfd per subchannel.
    pub fn connect(socket: &Path) -> Result<CcwGuest, Error> {
        let mut client = Client::new(socket).map_err(|e| format!("connect: {e}"))?;
        let fd = nix::sys::memfd::memfd_create(c"umdev-guest-ram", nix::sys::memfd::MFdFlags::empty())
            .map_err(|e| e.to_string())?;
        let ram = File::from(fd);
        ram.set_len(RAM_SIZE).map_err(|e| e.to_string())?;
        client.dma_map(0, 0, RAM_SIZE, ram.as_raw_fd()).map_err(|e| format!("map RAM: {e}"))?;
        let mut g = CcwGuest { client, ram, irqs: Vec::new(), subchannels: 0 };
        if g.read(regs::ID)? != regs::ID_VALUE {
            return Err("not a ccw device".into());
        }
        g.subchannels = g.read(regs::SUBCHANNELS)?;
        // Memory decode and bus mastering, as a PCI driver enables them before any DMA.
        g.client.region_write(7, 4, &0x0006u16.to_le_bytes()).map_err(|e| format!("COMMAND: {e}"))?;
        let mut ptr = u64::from(g.config32(0x34)? as u8);
        while ptr != 0 && g.config32(ptr)? as u8 != 0x11 {
            ptr = u64::from((g.config32(ptr)? >> 8) as u8);
        }
        if ptr == 0 {
            return Err("no MSI-X capability".into());
        }
        let control = (g.config32(ptr)? >> 16) as u16;
        g.client.region_write(7, ptr + 2, &(control | 0x8000).to_le_bytes()).map_err(|e| e.to_string())?;
        g.irqs = (0..g.subchannels)
            .map(|_| EventFd::new(EFD_NONBLOCK))
            .collect::<Result<_, _>>()
            .map_err(|e| e.to_string())?;
        let fds: Vec<i32> = g.irqs.iter().map(|e| e.as_raw_fd()).collect();
        g.client
            .set_irqs(2, 0x20 | 0x04, 0, g.subchannels, &fds)
            .map_err(|e| format!("MSI-X eventfds: {e}"))?;
        Ok(g)
    }

    fn config32(&mut self, off: u64) -> Result<u32, Error> {
        let mut b = [0u8; 4];
        self.client.region_read(7, off, &mut b).map_err(|e| e.to_string())?;
        Ok(u32::from_le_bytes(b))
    }

    /// Reads a BAR0 register.
    pub fn read(&mut self, r: u64) -> Result<u32, Error> {
        let mut b = [0u8; 4];
        self.client.region_read(0, r, &mut b).map_err(|e| e.to_string())?;
        Ok(u32::from_le_bytes(b))
    }

    /// Writes a BAR0 register.
    pub fn write(&mut self, r: u64, v: u32) -> Result<(), Error> {
        self.client.region_write(0, r, &v.to_le_bytes()).map_err(|e| e.to_string())
    }

    /// Reads subchannel `sc`'s register `r`.
    pub fn sc_read(&mut self, sc: u32, r: u64) -> Result<u32, Error> {
        self.read(reg(sc, r))
    }

    /// Writes subchannel `sc`'s register `r`.
    pub fn sc_write(&mut self, sc: u32, r: u64, v: u32) -> Result<(), Error> {
        self.write(reg(sc, r), v)
    }

    /// Writes guest memory.
    pub fn put(&self, addr: u64, bytes: &[u8]) -> Result<(), Error> {
        self.ram.write_all_at(bytes, addr).map_err(|e| e.to_string())
    }

    /// Reads guest memory.
    pub fn get(&self, addr: u64, len: usize) -> Result<Vec<u8>, Error> {
        let mut b = vec![0u8; len];
        self.ram.read_exact_at(&mut b, addr).map_err(|e| e.to_string())?;
        Ok(b)
    }

    /// Lays out `ops` for subchannel `sc` and starts the program (no wait).
    pub fn start(&mut self, sc: u32, ops: &[Op]) -> Result<(), Error> {
        for (addr, bytes) in layout(program_area(sc), idal_area(sc), ops) {
            self.put(addr, &bytes)?;
        }
        self.start_at(sc, program_area(sc))
    }

    /// Starts the program already at `cpa` on subchannel `sc`.
    pub fn start_at(&mut self, sc: u32, cpa: u64) -> Result<(), Error> {
        self.put(status_area(sc), &[0xee; STATUS_SIZE])?;
        self.sc_write(sc, regs::CPA_LO, cpa as u32)?;
        self.sc_write(sc, regs::CPA_HI, (cpa >> 32) as u32)?;
        self.sc_write(sc, regs::STATUS_LO, status_area(sc) as u32)?;
        self.sc_write(sc, regs::STATUS_HI, 0)?;
        self.sc_write(sc, regs::DOORBELL, regs::DOORBELL_START)
    }

    /// Waits for subchannel `sc`'s interrupt, acknowledges it, returns the status block.
    pub fn wait(&mut self, sc: u32) -> Result<Status, Error> {
        if !wait_eventfd(&self.irqs[sc as usize], Duration::from_secs(10)) {
            return Err(format!("no interrupt from subchannel {sc}"));
        }
        let _ = self.irqs[sc as usize].read();
        if self.sc_read(sc, regs::STATE)? != regs::STATE_PENDING {
            return Err(format!("subchannel {sc} interrupted without status"));
        }
        self.sc_write(sc, regs::ACK, 1)?;
        let raw: [u8; STATUS_SIZE] = self
            .get(status_area(sc), STATUS_SIZE)?
            .try_into()
            .map_err(|_| "short status block".to_string())?;
        let status = Status::decode(&raw).ok_or("a malformed status block")?;
        if self.sc_read(sc, regs::REASON)? != status.reason as u32 {
            return Err("registers and status block disagree".into());
        }
        Ok(status)
    }

    /// Runs a program to completion on subchannel `sc`.
    pub fn run(&mut self, sc: u32, ops: &[Op]) -> Result<Status, Error> {
        self.start(sc, ops)?;
        self.wait(sc)
    }
}

/// Waits up to `timeout` for `efd` to be signalled (without reading it).
pub fn wait_eventfd(efd: &EventFd, timeout: Duration) -> bool {
    // SAFETY: the eventfd outlives the borrow.
    let fd = unsafe { BorrowedFd::borrow_raw(efd.as_raw_fd()) };
    let mut fds = [PollFd::new(fd.as_fd(), PollFlags::POLLIN)];
    poll(&mut fds, PollTimeout::try_from(timeout).unwrap_or(PollTimeout::MAX)).unwrap_or(0) == 1
}
