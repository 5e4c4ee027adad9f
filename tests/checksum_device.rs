//! The checksum_device example driven in-process as a guest and its VMM would: guest RAM
//! mapped, bus mastering and MSI-X on, jobs run and their CRC-32 checked against zlib's; the
//! unmap of a paused job's buffer ends it UNMAPPED (and an unmap elsewhere does not); a reset
//! ends a paused job with no status, and the next doorbell starts a new worker.

use std::fs::File;
use std::os::fd::AsFd;
use std::os::unix::fs::FileExt;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use umdev_mdev::pci::regs::{
    CAPABILITY_LIST, CAP_ID_MSIX, COMMAND, COMMAND_MASTER, COMMAND_MEMORY, MSIX_CTRL_ENABLE,
};
use umdev_mdev::pci::PciDevice;
use umdev_mdev::{DeviceContext, DmaSpace, DmaSpaceConfig, IrqAction, IrqData, Prot, SetIrqs, VfioDevice};
use umdev_mdev::{VFIO_PCI_CONFIG_REGION_INDEX as CONFIG, VFIO_PCI_MSIX_IRQ_INDEX};
use umdev_testkit::NoClient;
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

#[path = "../examples/checksum_device.rs"]
#[allow(dead_code)]
mod checksum_device;

use checksum_device::regs::*;
use checksum_device::{crc32, status};

/// Guest RAM at IOVA 0.
const RAM_SIZE: u64 = 32 << 20;
/// More guest memory, a mapping of its own after RAM.
const OTHER: u64 = RAM_SIZE;

/// The device as the server holds it, its guest memory and the MSI-X vector's eventfd.
struct Guest {
    dev: Arc<PciDevice<Mutex<checksum_device::Checksum>>>,
    ram: File,
    dma: DmaSpace,
    irq: EventFd,
}

fn memfd(name: &std::ffi::CStr, size: u64) -> File {
    let file =
        File::from(nix::sys::memfd::memfd_create(name, nix::sys::memfd::MFdFlags::MFD_CLOEXEC).unwrap());
    file.set_len(size).unwrap();
    file
}

impl Guest {
    /// The device with RAM and another mapping, a client attached, bus mastering and MSI-X on.
    fn new() -> Guest {
        let dev = Arc::new(checksum_device::device().unwrap());
        // An unmap waits for the job to let go of its pins as long as it takes: what is
        // tested is that it ends, not how fast.
        let dma =
            DmaSpace::new(DmaSpaceConfig { unmap_timeout: Duration::from_secs(60), ..Default::default() });
        let ram = memfd(c"checksum-test-ram", RAM_SIZE);
        dma.map(0, RAM_SIZE, ram.as_fd(), 0, Prot::READ_WRITE).unwrap();
        let other = memfd(c"checksum-test-other", 1 << 20);
        dma.map(OTHER, 1 << 20, other.as_fd(), 0, Prot::READ_WRITE).unwrap();
        // As the server does: an unmap of memory the device holds pins in tells the device.
        let weak = Arc::downgrade(&dev);
        dma.set_unmap_notifier(Some(Arc::new(move |iova, len| {
            if let Some(dev) = weak.upgrade() {
                dev.dma_unmap(iova, len);
            }
        })));
        dev.attach(DeviceContext::new(dma.clone(), Arc::new(NoClient)));
        let guest = Guest { dev, ram, dma, irq: EventFd::new(EFD_NONBLOCK).unwrap() };
        guest.enable();
        guest
    }

    /// What the guest's driver does at probe (and again after a reset): memory decode, bus
    /// mastering, MSI-X with vector 0 on the eventfd.
    fn enable(&self) {
        let command = COMMAND_MEMORY | COMMAND_MASTER;
        self.dev.region_write(CONFIG, COMMAND as u64, &command.to_le_bytes()).unwrap();
        let mut at = self.config8(CAPABILITY_LIST as u64);
        while self.config8(at) != u64::from(CAP_ID_MSIX) {
            at = self.config8(at + 1);
            assert_ne!(at, 0, "no MSI-X capability");
        }
        self.dev.region_write(CONFIG, at + 2, &MSIX_CTRL_ENABLE.to_le_bytes()).unwrap();
        let data = IrqData::Eventfds(vec![self.irq.try_clone().unwrap()]);
        let wire =
            SetIrqs { index: VFIO_PCI_MSIX_IRQ_INDEX, start: 0, count: 1, action: IrqAction::Trigger, data };
        self.dev.set_irqs(wire).unwrap();
    }

    fn config8(&self, at: u64) -> u64 {
        let mut b = [0u8];
        self.dev.region_read(CONFIG, at, &mut b).unwrap();
        u64::from(b[0])
    }

    fn read(&self, reg: u64) -> u32 {
        let mut b = [0u8; 4];
        self.dev.region_read(0, reg, &mut b).unwrap();
        u32::from_le_bytes(b)
    }

    fn write(&self, reg: u64, value: u32) {
        self.dev.region_write(0, reg, &value.to_le_bytes()).unwrap();
    }

    /// Rings the doorbell for the buffer `[addr, addr + len)`.
    fn start(&self, addr: u64, len: u32) {
        self.write(ADDR_LO, addr as u32);
        self.write(ADDR_HI, (addr >> 32) as u32);
        self.write(LEN, len);
        self.write(DOORBELL, 1);
    }

    /// Waits for STATUS to leave `from`s; what it became. The bound only keeps a hung device
    /// from hanging the test.
    fn wait_status(&self, from: &[u32]) -> u32 {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let now = self.read(STATUS);
            if !from.contains(&now) {
                return now;
            }
            assert!(Instant::now() < deadline, "STATUS stayed {now:#x}");
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    /// Interrupts since the last call (the eventfd's count).
    fn interrupts(&self) -> u64 {
        self.irq.read().unwrap_or(0)
    }

    /// Fills `[addr, addr + len)` with bytes of its own; returns them.
    fn fill(&self, addr: u64, len: usize, seed: u8) -> Vec<u8> {
        let bytes: Vec<u8> = (0..len).map(|i| (i as u8).wrapping_mul(31) ^ seed).collect();
        self.ram.write_all_at(&bytes, addr).unwrap();
        bytes
    }
}

#[test]
fn the_crc_is_zlibs() {
    assert_eq!(crc32(b"123456789"), 0xcbf4_3926);
    assert_eq!(crc32(b""), 0);
}

#[test]
fn a_job_checksums_guest_memory_and_interrupts_once() {
    let g = Guest::new();
    assert_eq!((g.read(ID), g.read(STATUS)), (ID_VALUE, status::IDLE));
    // Unaligned, over several pages and blocks.
    let (addr, len) = (0x1_2345, (3 << 20) + 7);
    let bytes = g.fill(addr, len, 0x5a);
    g.start(addr, len as u32);
    assert_eq!(g.wait_status(&[status::BUSY]), status::DONE);
    assert_eq!(g.read(RESULT), crc32(&bytes));
    assert_eq!(g.interrupts(), 1);
    // Permit::complete reports DONE before the permit's drop lets go of the pins: they go
    // soon after, not necessarily by the time STATUS says so.
    let deadline = Instant::now() + Duration::from_secs(60);
    while g.dma.stats().pins_held != 0 {
        assert!(Instant::now() < deadline, "the buffer's pins stayed after the job: {:?}", g.dma.stats());
        std::thread::sleep(Duration::from_millis(1));
    }

    // A refused length ends at once, with an interrupt, and leaves RESULT alone.
    g.start(addr, 0);
    assert_eq!((g.read(STATUS), g.read(RESULT), g.interrupts()), (status::BAD_LEN, crc32(&bytes), 1));
    g.start(addr, MAX_LEN + 1);
    assert_eq!((g.read(STATUS), g.interrupts()), (status::BAD_LEN, 1));
    // Memory no one mapped, and a buffer that runs past the other mapping's end.
    g.start(OTHER + (1 << 20), 4096);
    assert_eq!((g.wait_status(&[status::BUSY]), g.interrupts()), (status::DMA_ERROR, 1));
    g.start(OTHER + (1 << 20) - 8, 16);
    assert_eq!((g.wait_status(&[status::BUSY]), g.interrupts()), (status::DMA_ERROR, 1));
    // A buffer that crosses from RAM into the other mapping is whole.
    let tail = g.fill(RAM_SIZE - 100, 100, 1);
    g.start(RAM_SIZE - 100, 200);
    assert_eq!(g.wait_status(&[status::BUSY]), status::DONE);
    let mut all = tail;
    all.extend([0u8; 100]); // the other mapping's memfd is zeros
    assert_eq!((g.read(RESULT), g.interrupts()), (crc32(&all), 1));
}

#[test]
fn an_unmap_of_a_paused_jobs_buffer_ends_it_unmapped() {
    let g = Guest::new();
    let (addr, len) = (0x10_0000, 8 << 20);
    let bytes = g.fill(addr, len, 7);
    // Paused before its first block: the job holds its buffer's pins and waits.
    g.write(CONTROL, PAUSE);
    g.start(addr, len as u32);
    assert_eq!(g.wait_status(&[status::BUSY]), status::PAUSED);
    assert!(g.dma.stats().pins_held > 0);
    // An unmap elsewhere is not the job's business...
    g.dma.unmap(OTHER, 1 << 20).unwrap();
    g.dev.dma_unmapped(OTHER, 1 << 20);
    assert_eq!(g.read(STATUS), status::PAUSED);
    // ...and a resume then finishes it.
    g.write(CONTROL, 0);
    assert_eq!(g.wait_status(&[status::PAUSED, status::BUSY]), status::DONE);
    assert_eq!((g.read(RESULT), g.interrupts()), (crc32(&bytes), 1));

    // Paused again, the guest unmaps the buffer: the unmap cancels the job, whose worker the
    // lane's wake rings; it ends UNMAPPED and lets go, and only then does the unmap return.
    g.write(CONTROL, PAUSE);
    g.start(addr, len as u32);
    assert_eq!(g.wait_status(&[status::BUSY]), status::PAUSED);
    g.dma.unmap(0, RAM_SIZE).unwrap();
    g.dev.dma_unmapped(0, RAM_SIZE);
    assert_eq!((g.read(STATUS), g.interrupts()), (status::UNMAPPED, 1));
    assert_eq!(g.dma.stats().pins_held, 0);
    assert_eq!(g.read(CONTROL), PAUSE, "the guest's pause stays until it clears it");

    // The engine goes on once memory is back.
    g.dma.map(0, RAM_SIZE, g.ram.as_fd(), 0, Prot::READ_WRITE).unwrap();
    g.write(CONTROL, 0);
    g.start(addr, 4096);
    assert_eq!(g.wait_status(&[status::BUSY]), status::DONE);
    assert_eq!((g.read(RESULT), g.interrupts()), (crc32(&bytes[..4096]), 1));
}

#[test]
fn a_reset_ends_a_paused_job_with_no_status_and_the_next_doorbell_starts_a_worker() {
    let g = Guest::new();
    let (addr, len) = (0x4000, 1 << 20);
    let bytes = g.fill(addr, len, 3);
    g.write(CONTROL, PAUSE);
    g.start(addr, len as u32);
    assert_eq!(g.wait_status(&[status::BUSY]), status::PAUSED);
    // The reset (under the device's lock) joins the worker, which never waits for that lock:
    // once it returns the job has ended, its pins are gone, and it reported nothing.
    g.dev.reset().unwrap();
    assert_eq!((g.read(STATUS), g.read(RESULT), g.read(CONTROL), g.read(LEN)), (status::IDLE, 0, 0, 0));
    assert_eq!(g.dma.stats().pins_held, 0);
    assert_eq!(g.interrupts(), 0);

    // The guest's driver sets the device up again; a new worker takes the next job.
    g.enable();
    g.start(addr, len as u32);
    assert_eq!(g.wait_status(&[status::BUSY]), status::DONE);
    assert_eq!((g.read(RESULT), g.interrupts()), (crc32(&bytes), 1));

    // A detach (the client left) ends a paused job the same way.
    g.write(CONTROL, PAUSE);
    g.start(addr, len as u32);
    assert_eq!(g.wait_status(&[status::BUSY]), status::PAUSED);
    g.dev.detach();
    assert_eq!((g.read(STATUS), g.dma.stats().pins_held), (status::IDLE, 0));
}
