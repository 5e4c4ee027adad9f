//! A guest driving a ccw device over vfio-user: guest RAM in a memfd at IOVA 0, programs laid
//! out with `umdev_mdev::samples::ccw::driver`, one MSI-X eventfd per subchannel.

use std::fs::File;
use std::os::fd::{AsFd, AsRawFd};
use std::os::unix::fs::FileExt;
use std::time::Duration;

use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
use umdev_mdev::samples::ccw::driver::{layout, Op};
use umdev_mdev::samples::ccw::program::{Status, STATUS_SIZE};
use umdev_mdev::samples::ccw::regs;
use vfio_user::Client;
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

pub const RAM_SIZE: u64 = 64 << 20;
/// Guest RAM from here on is free for data buffers.
pub const DATA_BASE: u64 = 4 << 20;

pub struct CcwGuest {
    pub client: Client,
    pub ram: File,
    pub irqs: Vec<EventFd>,
    pub subchannels: u32,
}

pub fn program_area(sc: u32) -> u64 {
    0x1000 + 0x1000 * u64::from(sc)
}
pub fn idal_area(sc: u32) -> u64 {
    0x2_0000 + 0x2_0000 * u64::from(sc)
}
pub fn status_area(sc: u32) -> u64 {
    0x30_0000 + 0x100 * u64::from(sc)
}

fn reg(sc: u32, r: u64) -> u64 {
    regs::SUBCHANNEL_BASE + u64::from(sc) * regs::SUBCHANNEL_STRIDE + r
}

impl CcwGuest {
    /// Connects, maps RAM, enables MSI-X with one eventfd per subchannel.
    pub fn connect(socket: &std::path::Path) -> CcwGuest {
        let mut client = Client::new(socket).expect("connect");
        let ram = super::memfd(RAM_SIZE);
        client.dma_map(0, 0, RAM_SIZE, ram.as_raw_fd()).expect("map RAM");
        let mut g = CcwGuest { client, ram, irqs: Vec::new(), subchannels: 0 };
        g.subchannels = g.read(regs::SUBCHANNELS);
        // Enable MSI-X: find the capability, set the enable bit.
        let mut ptr = u64::from(g.config32(0x34) as u8);
        while ptr != 0 && g.config32(ptr) as u8 != 0x11 {
            ptr = u64::from((g.config32(ptr) >> 8) as u8);
        }
        assert_ne!(ptr, 0, "MSI-X capability");
        let control = (g.config32(ptr) >> 16) as u16;
        g.client.region_write(7, ptr + 2, &(control | 0x8000).to_le_bytes()).unwrap();
        g.irqs = (0..g.subchannels).map(|_| EventFd::new(EFD_NONBLOCK).unwrap()).collect();
        let fds: Vec<i32> = g.irqs.iter().map(|e| e.as_raw_fd()).collect();
        g.client.set_irqs(2, 0x20 | 0x04, 0, g.subchannels, &fds).expect("MSI-X eventfds");
        g
    }

    fn config32(&mut self, off: u64) -> u32 {
        let mut b = [0u8; 4];
        self.client.region_read(7, off, &mut b).unwrap();
        u32::from_le_bytes(b)
    }

    pub fn read(&mut self, r: u64) -> u32 {
        let mut b = [0u8; 4];
        self.client.region_read(0, r, &mut b).unwrap();
        u32::from_le_bytes(b)
    }

    pub fn write(&mut self, r: u64, v: u32) {
        self.client.region_write(0, r, &v.to_le_bytes()).unwrap();
    }

    pub fn sc_read(&mut self, sc: u32, r: u64) -> u32 {
        self.read(reg(sc, r))
    }

    pub fn put(&self, addr: u64, bytes: &[u8]) {
        self.ram.write_all_at(bytes, addr).unwrap();
    }

    pub fn get(&self, addr: u64, len: usize) -> Vec<u8> {
        let mut b = vec![0u8; len];
        self.ram.read_exact_at(&mut b, addr).unwrap();
        b
    }

    /// Lays out `ops` for subchannel `sc` and starts it (no wait).
    pub fn start(&mut self, sc: u32, ops: &[Op]) {
        for (addr, bytes) in layout(program_area(sc), idal_area(sc), ops) {
            self.put(addr, &bytes);
        }
        self.start_at(sc, program_area(sc));
    }

    /// Starts the program already at `cpa`.
    pub fn start_at(&mut self, sc: u32, cpa: u64) {
        self.put(status_area(sc), &[0xee; STATUS_SIZE]);
        self.write(reg(sc, regs::CPA_LO), cpa as u32);
        self.write(reg(sc, regs::CPA_HI), (cpa >> 32) as u32);
        self.write(reg(sc, regs::STATUS_LO), status_area(sc) as u32);
        self.write(reg(sc, regs::STATUS_HI), 0);
        self.write(reg(sc, regs::DOORBELL), regs::DOORBELL_START);
    }

    /// Waits for subchannel `sc`'s interrupt, acknowledges, returns its status block.
    pub fn wait(&mut self, sc: u32) -> Status {
        let efd = &self.irqs[sc as usize];
        // SAFETY: the eventfd outlives the borrow; 10 s is far beyond any program here.
        let fd = unsafe { std::os::fd::BorrowedFd::borrow_raw(efd.as_raw_fd()) };
        let mut fds = [PollFd::new(fd.as_fd(), PollFlags::POLLIN)];
        let n = poll(&mut fds, PollTimeout::from(10_000u16)).unwrap();
        assert_eq!(n, 1, "no interrupt from subchannel {sc}");
        efd.read().unwrap();
        assert_eq!(self.sc_read(sc, regs::STATE), regs::STATE_PENDING);
        self.write(reg(sc, regs::ACK), 1);
        let raw: [u8; STATUS_SIZE] = self.get(status_area(sc), STATUS_SIZE).try_into().unwrap();
        let status = Status::decode(&raw).expect("a status block was written");
        assert_eq!(self.sc_read(sc, regs::REASON), status.reason as u32, "registers mirror the block");
        status
    }

    /// Runs a program to completion on subchannel `sc`.
    pub fn run(&mut self, sc: u32, ops: &[Op]) -> Status {
        self.start(sc, ops);
        self.wait(sc)
    }
}

/// Waits for an interrupt with a timeout, without consuming it: for racing tests.
pub fn interrupted(efd: &EventFd, timeout: Duration) -> bool {
    // SAFETY: the eventfd outlives this call.
    let fd = unsafe { std::os::fd::BorrowedFd::borrow_raw(efd.as_raw_fd()) };
    let mut fds = [PollFd::new(fd.as_fd(), PollFlags::POLLIN)];
    poll(&mut fds, PollTimeout::try_from(timeout).unwrap_or(PollTimeout::MAX)).unwrap_or(0) == 1
}
