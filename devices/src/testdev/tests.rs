//! testdev driven through [`VfioDevice`], as the server drives it, against a real
//! [`DmaSpace`] over a memfd and a fake client for message-only memory.

use std::fs::File;
use std::os::fd::AsFd;
use std::os::unix::fs::FileExt;
use std::time::{Duration, Instant};

use umdev_pinning::{DmaSpace, Prot, PAGE_SIZE};
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

use super::*;
use umdev_mdev::pci::regs::{CAPABILITY_LIST, COMMAND, COMMAND_INTX_DISABLE, COMMAND_MASTER, COMMAND_MEMORY};
use umdev_mdev::pci::regs::{CAP_ID_MSI, CAP_ID_MSIX, CAP_ID_PM, MSIX_CTRL_ENABLE, MSI_CTRL_ENABLE};
use umdev_mdev::{ClientDma, DeviceContext, IrqAction, IrqData, RegionFlags, SetIrqs, VfioDevice};
use umdev_mdev::{VFIO_PCI_CONFIG_REGION_INDEX as CONFIG, VFIO_PCI_INTX_IRQ_INDEX, VFIO_PCI_MSIX_IRQ_INDEX};
use umdev_mdev::{VFIO_PCI_MSI_IRQ_INDEX, VFIO_PCI_ROM_REGION_INDEX, VFIO_PCI_VGA_REGION_INDEX};

/// Guest RAM: 2 MiB at 1 MiB, fd-backed.
const RAM: u64 = 0x10_0000;
const RAM_PAGES: u64 = 512;
/// Message-only memory served by [`FakeClient`].
const MSG: u64 = 0x4000_0000;
const MSG_SIZE: u64 = 0x2_0000;

/// A client serving DMA_READ/DMA_WRITE on [`MSG`] from a buffer.
struct FakeClient {
    mem: Mutex<Vec<u8>>,
}

impl FakeClient {
    fn range(&self, iova: u64, len: usize) -> Result<std::ops::Range<usize>, ClientDmaError> {
        let start = iova.checked_sub(MSG).ok_or(ClientDmaError::Refused(libc::ENODEV))? as usize;
        let end = start + len;
        if end as u64 > MSG_SIZE {
            return Err(ClientDmaError::Refused(libc::ENODEV));
        }
        Ok(start..end)
    }
}

impl ClientDma for FakeClient {
    fn read(&self, iova: u64, buf: &mut [u8], _may_send: &dyn Fn(u64) -> bool) -> Result<(), ClientDmaError> {
        let range = self.range(iova, buf.len())?;
        buf.copy_from_slice(&self.mem.lock().unwrap()[range]);
        Ok(())
    }

    fn write(&self, iova: u64, data: &[u8], _may_send: &dyn Fn(u64) -> bool) -> Result<(), ClientDmaError> {
        let range = self.range(iova, data.len())?;
        self.mem.lock().unwrap()[range].copy_from_slice(data);
        Ok(())
    }
}

struct Rig {
    dev: PciDevice<TestDev>,
    space: DmaSpace,
    ram: File,
    client: Arc<FakeClient>,
}

fn rig() -> Rig {
    let dev = create().unwrap();
    let ram = File::from(
        nix::sys::memfd::memfd_create(c"testdev-ram", nix::sys::memfd::MFdFlags::empty()).unwrap(),
    );
    ram.set_len(RAM_PAGES * PAGE_SIZE).unwrap();
    let space = DmaSpace::default();
    space.map(RAM, RAM_PAGES * PAGE_SIZE, ram.as_fd(), 0, Prot::READ_WRITE).unwrap();
    space.map_message_only(MSG, MSG_SIZE, Prot::READ_WRITE).unwrap();
    let client = Arc::new(FakeClient { mem: Mutex::new(vec![0; MSG_SIZE as usize]) });
    dev.attach(DeviceContext::new(space.clone(), client.clone()));
    let rig = Rig { dev, space, ram, client };
    // As a driver does before any DMA (and MSI): memory decode and bus mastering.
    rig.write(CONFIG, COMMAND as u64, 2, u64::from(COMMAND_MEMORY | COMMAND_MASTER));
    rig
}

impl Rig {
    fn read(&self, region: u32, offset: u64, len: usize) -> u64 {
        let mut b = [0u8; 8];
        self.dev.region_read(region, offset, &mut b[..len]).unwrap();
        u64::from_le_bytes(b)
    }

    fn write(&self, region: u32, offset: u64, len: usize, value: u64) {
        self.dev.region_write(region, offset, &value.to_le_bytes()[..len]).unwrap();
    }

    fn reg(&self, offset: u64) -> u32 {
        self.read(0, offset, 4) as u32
    }

    fn set_reg(&self, offset: u64, value: u32) {
        self.write(0, offset, 4, u64::from(value));
    }

    fn dma(&self, cmd: u32, addr: u64, len: u32, pattern: u8) -> (u32, u32) {
        self.write(0, regs::DMA_ADDR_LO, 8, addr);
        self.set_reg(regs::DMA_LEN, len);
        self.set_reg(regs::DMA_PATTERN, u32::from(pattern));
        self.set_reg(regs::DMA_CMD, cmd);
        self.wait_idle()
    }

    /// Waits for DMA_STATUS to leave BUSY; (status, result).
    fn wait_idle(&self) -> (u32, u32) {
        let deadline = Instant::now() + Duration::from_secs(5);
        while self.reg(regs::DMA_STATUS) == regs::STATUS_BUSY {
            assert!(Instant::now() < deadline, "DMA still busy after 5 s");
            std::thread::sleep(Duration::from_millis(1));
        }
        (self.reg(regs::DMA_STATUS), self.reg(regs::DMA_RESULT))
    }

    fn eventfd(&self, index: u32, vector: u32) -> EventFd {
        let fd = EventFd::new(EFD_NONBLOCK).unwrap();
        let data = IrqData::Eventfds(vec![fd.try_clone().unwrap()]);
        let req = SetIrqs { index, start: vector, count: 1, action: IrqAction::Trigger, data };
        self.dev.set_irqs(req).unwrap();
        fd
    }

    /// Finds capability `id` by walking the list from 0x34.
    fn cap(&self, id: u8) -> u64 {
        let mut at = self.read(CONFIG, CAPABILITY_LIST as u64, 1);
        while at != 0 {
            if self.read(CONFIG, at, 1) == u64::from(id) {
                return at;
            }
            at = self.read(CONFIG, at + 1, 1);
        }
        panic!("no capability {id:#x}");
    }
}

fn take(fd: &EventFd) -> u64 {
    fd.read().unwrap_or(0)
}

fn ram_bytes(rig: &Rig, iova: u64, len: usize) -> Vec<u8> {
    let mut buf = vec![0; len];
    rig.ram.read_exact_at(&mut buf, iova - RAM).unwrap();
    buf
}

#[test]
fn config_space_is_what_qemu_needs() {
    let rig = rig();
    assert_eq!(rig.read(CONFIG, 0, 4), 0x75d1_1234);
    assert_eq!(rig.read(CONFIG, 8, 4), 0xff00_0001, "class ff/00/00, revision 1");
    assert_eq!(rig.read(CONFIG, 0x3d, 1), 1, "INTA#");
    // BAR sizing through config writes, as a guest would.
    for (bar, expect) in [(0, 0xffff_f000u64), (1, 0xffff_e000), (2, 0xffff_fff1), (3, 0)] {
        rig.write(CONFIG, 0x10 + 4 * bar, 4, 0xffff_ffff);
        assert_eq!(rig.read(CONFIG, 0x10 + 4 * bar, 4), expect, "BAR{bar}");
    }
    // COMMAND and INTERRUPT_LINE are read-write.
    rig.write(CONFIG, COMMAND as u64, 2, u64::from(COMMAND_MEMORY | COMMAND_MASTER));
    assert_eq!(rig.read(CONFIG, COMMAND as u64, 2), u64::from(COMMAND_MEMORY | COMMAND_MASTER));
    rig.write(CONFIG, 0x3c, 1, 11);
    assert_eq!(rig.read(CONFIG, 0x3c, 1), 11);
    // The whole space in one read (QEMU's realize).
    let mut all = [0u8; 256];
    rig.dev.region_read(CONFIG, 0, &mut all).unwrap();
    assert_eq!(all[0x3c], 11);
    // Capabilities.
    let msix = rig.cap(CAP_ID_MSIX);
    assert_eq!(rig.read(CONFIG, msix + 2, 2), 1, "2 vectors");
    assert_eq!(rig.read(CONFIG, msix + 4, 4), 0x800);
    assert_eq!(rig.read(CONFIG, msix + 8, 4), 0xc00);
    rig.cap(CAP_ID_MSI);
    rig.cap(CAP_ID_PM);
}

#[test]
fn regions_and_irqs_are_described() {
    let rig = rig();
    let info = rig.dev.device_info();
    assert_eq!((info.num_regions, info.num_irqs), (9, 5));
    let r0 = rig.dev.region_info(0).unwrap();
    assert_eq!((r0.size, r0.flags), (4096, RegionFlags::READ | RegionFlags::WRITE));
    let r1 = rig.dev.region_info(1).unwrap();
    assert_eq!(r1.size, 8192);
    assert!(r1.flags.contains(RegionFlags::MMAP));
    let mmap = r1.mmap.unwrap();
    assert_eq!(mmap.areas, [SparseArea { offset: 0, size: 4096 }]);
    assert_eq!(rig.dev.region_info(2).unwrap().size, 16);
    for absent in [3, 4, 5, VFIO_PCI_ROM_REGION_INDEX, VFIO_PCI_VGA_REGION_INDEX] {
        assert_eq!(rig.dev.region_info(absent).unwrap().size, 0);
    }
    assert_eq!(rig.dev.region_info(CONFIG).unwrap().size, 256);
    assert!(rig.dev.region_info(9).is_none());
    assert_eq!(rig.dev.irq_info(VFIO_PCI_INTX_IRQ_INDEX).unwrap().count, 1);
    assert_eq!(rig.dev.irq_info(VFIO_PCI_MSI_IRQ_INDEX).unwrap().count, 1);
    assert_eq!(rig.dev.irq_info(VFIO_PCI_MSIX_IRQ_INDEX).unwrap().count, 2);
}

#[test]
fn registers_and_access_sizes() {
    let rig = rig();
    assert_eq!(rig.reg(regs::ID), regs::ID_VALUE);
    rig.set_reg(regs::ID, 0);
    assert_eq!(rig.reg(regs::ID), regs::ID_VALUE, "read-only");
    rig.set_reg(regs::SCRATCH, 0xdead_beef);
    assert_eq!(rig.reg(regs::SCRATCH), 0xdead_beef);
    rig.write(0, regs::SCRATCH + 1, 1, 0x11);
    rig.write(0, regs::SCRATCH + 2, 2, 0x2233);
    assert_eq!(rig.reg(regs::SCRATCH), 0x2233_11ef);
    assert_eq!(rig.read(0, regs::SCRATCH + 3, 1), 0x22);
    // One 8-byte access covers two registers.
    rig.write(0, regs::DMA_ADDR_LO, 8, 0x1_2345_6000);
    assert_eq!((rig.reg(regs::DMA_ADDR_LO), rig.reg(regs::DMA_ADDR_HI)), (0x2345_6000, 1));
    assert_eq!(rig.read(0, regs::ID, 8), (0x2233_11ef << 32) | u64::from(regs::ID_VALUE));
    // 3-byte accesses are refused; reserved space reads 0.
    assert!(rig.dev.region_read(0, 0, &mut [0; 3]).is_err());
    assert_eq!(rig.reg(0x400), 0);
    // Out of the BAR.
    assert!(rig.dev.region_read(0, 4092, &mut [0; 8]).is_err());
}

#[test]
fn fill_dma_writes_guest_memory_and_interrupts() {
    let rig = rig();
    let intx = rig.eventfd(VFIO_PCI_INTX_IRQ_INDEX, 0);
    let addr = RAM + 3 * PAGE_SIZE + 100; // crosses pages
    assert_eq!(rig.dma(regs::CMD_FILL, addr, 10_000, 0xa5), (regs::STATUS_DONE, 0));
    assert!(ram_bytes(&rig, addr, 10_000).iter().all(|&b| b == 0xa5));
    assert_eq!(ram_bytes(&rig, addr - 1, 1), [0]);
    assert_eq!(ram_bytes(&rig, addr + 10_000, 1), [0]);
    // INTx fired once and the status bit shows it; ISR read clears and deasserts.
    assert_eq!(take(&intx), 1);
    assert_ne!(rig.read(CONFIG, 6, 2) & 0x8, 0);
    assert_eq!(rig.reg(regs::IRQ_COUNT), 1);
    assert_eq!(rig.reg(regs::ISR), 1);
    assert_eq!(rig.reg(regs::ISR), 0);
    assert_eq!(rig.read(CONFIG, 6, 2) & 0x8, 0);
}

#[test]
fn checksum_dma_reads_guest_memory() {
    let rig = rig();
    let data: Vec<u8> = (0..300_000u32).map(|i| (i * 7 + i / 256) as u8).collect();
    rig.ram.write_all_at(&data, 0x5000).unwrap();
    let expect = data.iter().fold(0u32, |s, &b| s.wrapping_add(u32::from(b)));
    assert_eq!(rig.dma(regs::CMD_CHECKSUM, RAM + 0x5000, 300_000, 0), (regs::STATUS_DONE, expect));
}

#[test]
fn dma_through_the_client_for_memory_without_an_fd() {
    let rig = rig();
    assert_eq!(rig.dma(regs::CMD_FILL, MSG + 0x100, 0x1_8000, 0x3c), (regs::STATUS_DONE, 0));
    let mem = rig.client.mem.lock().unwrap().clone();
    assert!(mem[0x100..0x1_8100].iter().all(|&b| b == 0x3c));
    assert_eq!((mem[0xff], mem[0x1_8100]), (0, 0));
    assert_eq!(rig.dma(regs::CMD_CHECKSUM, MSG + 0x100, 0x100, 0), (regs::STATUS_DONE, 0x3c * 0x100));
}

#[test]
fn dma_errors_report_the_errno() {
    let rig = rig();
    let intx = rig.eventfd(VFIO_PCI_INTX_IRQ_INDEX, 0);
    let unmapped = RAM + RAM_PAGES * PAGE_SIZE;
    assert_eq!(rig.dma(regs::CMD_FILL, unmapped, 16, 1), (regs::STATUS_ERROR, libc::EFAULT as u32));
    assert_eq!(take(&intx), 1, "an error completes with an interrupt too");
    // Running off the end of RAM: the mapped part is written, then EFAULT.
    assert_eq!(rig.dma(regs::CMD_FILL, unmapped - 8, 16, 1).0, regs::STATUS_ERROR);
    assert_eq!(rig.dma(regs::CMD_FILL, RAM, MAX_DMA_LEN + 1, 1), (regs::STATUS_ERROR, libc::EINVAL as u32));
    assert_eq!(rig.dma(7, RAM, 16, 1), (regs::STATUS_ERROR, libc::EINVAL as u32));
    assert_eq!(rig.dma(regs::CMD_FILL, u64::MAX - 4, 16, 1).0, regs::STATUS_ERROR, "wraps");
    // The client refuses what it does not back; its errno is reported.
    rig.space.map_message_only(MSG + MSG_SIZE, PAGE_SIZE, Prot::READ_WRITE).unwrap();
    assert_eq!(rig.dma(regs::CMD_FILL, MSG + MSG_SIZE - 4, 8, 1), (regs::STATUS_ERROR, libc::ENODEV as u32));
    rig.space.unmap(RAM, RAM_PAGES * PAGE_SIZE).unwrap();
    assert_eq!(rig.dma(regs::CMD_CHECKSUM, RAM, 16, 0), (regs::STATUS_ERROR, libc::EFAULT as u32));
    // A zero-length command completes.
    assert_eq!(rig.dma(regs::CMD_CHECKSUM, 0, 0, 0), (regs::STATUS_DONE, 0));
    // Detached: no client to DMA with.
    rig.dev.detach();
    assert_eq!(rig.dma(regs::CMD_FILL, RAM, 16, 1), (regs::STATUS_ERROR, libc::ENODEV as u32));
}

/// docs/testdev.md: a command whose handling failed inside the device (its permit
/// dropped unfinished, as after a panic) ends with status 3, EIO and an interrupt, and
/// the next command runs.
#[test]
fn a_command_the_device_drops_ends_with_eio() {
    let rig = rig();
    let intx = rig.eventfd(VFIO_PCI_INTX_IRQ_INDEX, 0);
    let dev = rig.dev.function();
    let generation = dev.inner.generation.load(Ordering::Acquire);
    dev.inner.regs().status = regs::STATUS_BUSY;
    let job =
        Job { inner: dev.inner.clone(), cmd: regs::CMD_FILL, addr: RAM, len: 16, pattern: 1, generation };
    drop(dev.lane.begin(job).unwrap());
    assert_eq!(dev.lane.in_flight(), 0);
    assert_eq!(
        (rig.reg(regs::DMA_STATUS), rig.reg(regs::DMA_RESULT)),
        (regs::STATUS_ERROR, libc::EIO as u32)
    );
    assert_eq!(take(&intx), 1);
    assert_eq!(rig.dma(regs::CMD_FILL, RAM, 16, 0x77), (regs::STATUS_DONE, 0));
    assert_eq!(ram_bytes(&rig, RAM, 16), [0x77; 16]);
}

#[test]
fn msix_and_msi_deliver_the_completion() {
    let rig = rig();
    let intx = rig.eventfd(VFIO_PCI_INTX_IRQ_INDEX, 0);
    let msix = rig.cap(CAP_ID_MSIX);
    rig.write(CONFIG, msix + 2, 2, u64::from(MSIX_CTRL_ENABLE));
    let v0 = rig.eventfd(VFIO_PCI_MSIX_IRQ_INDEX, 0);
    assert_eq!(rig.dma(regs::CMD_FILL, RAM, 64, 9).0, regs::STATUS_DONE);
    assert_eq!((take(&v0), take(&intx)), (1, 0));

    // The guest masks vector 0 in the table (BAR0 + 0x800): pending in the PBA (0xc00).
    rig.set_reg(u64::from(MSIX_TABLE_OFFSET) + 12, 1);
    rig.set_reg(regs::IRQ_RAISE, 1);
    assert_eq!(take(&v0), 0);
    assert_eq!(rig.read(0, u64::from(MSIX_PBA_OFFSET), 8), 1);
    rig.set_reg(u64::from(MSIX_TABLE_OFFSET) + 12, 0);
    assert_eq!(take(&v0), 1);
    assert_eq!(rig.read(0, u64::from(MSIX_PBA_OFFSET), 8), 0);
    // PBA writes are ignored; accesses straddling the table are refused.
    rig.write(0, u64::from(MSIX_PBA_OFFSET), 8, u64::MAX);
    assert_eq!(rig.read(0, u64::from(MSIX_PBA_OFFSET), 8), 0);
    assert!(rig.dev.region_read(0, u64::from(MSIX_TABLE_OFFSET) - 4, &mut [0; 8]).is_err());

    // MSI-X off, MSI on.
    rig.write(CONFIG, msix + 2, 2, 0);
    let msi_cap = rig.cap(CAP_ID_MSI);
    rig.write(CONFIG, msi_cap + 2, 2, u64::from(MSI_CTRL_ENABLE));
    let msi = rig.eventfd(VFIO_PCI_MSI_IRQ_INDEX, 0);
    rig.set_reg(regs::IRQ_RAISE, 0);
    assert_eq!((take(&msi), take(&v0), take(&intx)), (1, 0, 0));

    // Back to INTx, but disabled in COMMAND: held until enabled.
    rig.write(CONFIG, msi_cap + 2, 2, 0);
    rig.write(CONFIG, COMMAND as u64, 2, u64::from(COMMAND_INTX_DISABLE));
    rig.set_reg(regs::IRQ_RAISE, 0);
    assert_eq!(take(&intx), 0);
    rig.write(CONFIG, COMMAND as u64, 2, 0);
    assert_eq!(take(&intx), 1);
    assert_eq!(rig.reg(regs::IRQ_COUNT), 4);
}

#[test]
fn unmap_during_dma_lets_the_unmap_complete() {
    let rig = rig();
    let ram2 = File::from(
        nix::sys::memfd::memfd_create(c"testdev-ram2", nix::sys::memfd::MFdFlags::empty()).unwrap(),
    );
    let big = u64::from(MAX_DMA_LEN);
    ram2.set_len(big).unwrap();
    let base = 0x1000_0000;
    for round in 0..20u8 {
        rig.space.map(base, big, ram2.as_fd(), 0, Prot::READ_WRITE).unwrap();
        rig.write(0, regs::DMA_ADDR_LO, 8, base);
        rig.set_reg(regs::DMA_LEN, MAX_DMA_LEN);
        rig.set_reg(regs::DMA_PATTERN, u32::from(round + 1));
        rig.set_reg(regs::DMA_CMD, regs::CMD_FILL);
        if round % 2 == 1 {
            // Let the transfer get going, so the unmap meets pins held mid-chunk.
            let mut first = [0u8];
            let deadline = Instant::now() + Duration::from_secs(1);
            while first[0] != round + 1 && Instant::now() < deadline {
                ram2.read_exact_at(&mut first, 0).unwrap();
            }
        }
        // What the server does on DMA_UNMAP: tell the device, then unmap (which waits
        // for pins, boundedly).
        rig.dev.dma_unmap(base, big);
        let started = Instant::now();
        rig.space.unmap(base, big).unwrap();
        eprintln!("MEASURED unmap during DMA: {:?}", started.elapsed());
        let (status, result) = rig.wait_idle();
        assert!(
            status == regs::STATUS_DONE
                || (status == regs::STATUS_ERROR
                    && [libc::ECANCELED, libc::EFAULT, libc::EBUSY].contains(&(result as i32))),
            "status {status}, result {result}"
        );
    }
    // An unmap elsewhere leaves the DMA alone.
    rig.set_reg(regs::DMA_LEN, 4096);
    rig.write(0, regs::DMA_ADDR_LO, 8, RAM);
    rig.set_reg(regs::DMA_CMD, regs::CMD_FILL);
    rig.dev.dma_unmap(base, big);
    assert_eq!(rig.wait_idle(), (regs::STATUS_DONE, 0));
}

#[test]
fn bar1_is_one_memfd_mapped_and_trapped() {
    let rig = rig();
    let fd = rig.dev.region_info(1).unwrap().mmap.unwrap().fd;
    let file = File::from(fd.try_clone().unwrap());
    // The trapped page, through messages, lands in the memfd at +4096.
    rig.write(1, 4096 + 8, 8, 0x0102_0304_0506_0708);
    let mut b = [0; 8];
    file.read_exact_at(&mut b, 4096 + 8).unwrap();
    assert_eq!(u64::from_le_bytes(b), 0x0102_0304_0506_0708);
    // What the client writes through its mmap of page 0 reads back by message.
    file.write_all_at(b"mapped", 16).unwrap();
    let mut got = [0; 6];
    rig.dev.region_read(1, 16, &mut got).unwrap();
    assert_eq!(&got, b"mapped");
    // Large accesses are fine here.
    rig.dev.region_write(1, 0, &[7; 8192]).unwrap();
    assert!(rig.dev.region_write(1, 8190, &[0; 4]).is_err());
}

thread_local! {
    /// Makes this thread's BAR1 memfds fail as with the fd table full.
    pub(super) static NO_FDS: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// A detach that cannot make new BAR1 memory (no fd to spare) never leaves the next client
/// the old one's: BAR1 offers no mmap and fails until new memory can be made.
#[test]
fn bar1_is_never_the_last_clients_when_no_new_memory_can_be_made() {
    let rig = rig();
    let old = rig.dev.region_info(1).unwrap().mmap.unwrap().fd;
    rig.dev.region_write(1, 16, b"secret").unwrap();
    NO_FDS.set(true);
    rig.dev.detach();
    let info = rig.dev.region_info(1).unwrap();
    assert!(info.mmap.is_none() && !info.flags.contains(RegionFlags::MMAP), "{info:?}");
    assert!(rig.dev.region_read(1, 16, &mut [0; 6]).is_err());
    NO_FDS.set(false);
    let fresh = rig.dev.region_info(1).unwrap().mmap.unwrap().fd;
    assert!(!Arc::ptr_eq(&old, &fresh), "a new file");
    let mut got = [0xff; 6];
    rig.dev.region_read(1, 16, &mut got).unwrap();
    assert_eq!(got, [0; 6], "new memory, zeroed");
}

#[test]
fn bar2_io_registers() {
    let rig = rig();
    assert_eq!(rig.read(2, regs::IO_ID, 4), u64::from(regs::ID_VALUE));
    rig.write(2, regs::IO_SCRATCH, 4, 0x1234_5678);
    rig.write(2, regs::IO_SCRATCH + 3, 1, 0xab);
    assert_eq!(rig.read(2, regs::IO_SCRATCH, 4), 0xab34_5678);
    rig.write(2, regs::IO_ID, 4, 0);
    assert_eq!(rig.read(2, regs::IO_ID, 2), 0x6576);
    assert_eq!(rig.read(2, 12, 4), 0);
    assert!(rig.dev.region_read(2, 8, &mut [0; 8]).is_err(), "no 8-byte I/O");
    assert!(rig.dev.region_read(2, 14, &mut [0; 4]).is_err());
}

#[test]
fn reset_clears_registers_memory_and_interrupts() {
    let rig = rig();
    let intx = rig.eventfd(VFIO_PCI_INTX_IRQ_INDEX, 0);
    rig.set_reg(regs::SCRATCH, 5);
    rig.write(2, regs::IO_SCRATCH, 4, 6);
    rig.write(1, 4096, 4, 7);
    assert_eq!(rig.dma(regs::CMD_FILL, RAM, 32, 1).0, regs::STATUS_DONE);
    assert_eq!(take(&intx), 1);
    rig.write(CONFIG, COMMAND as u64, 2, u64::from(COMMAND_MEMORY));
    let msix = rig.cap(CAP_ID_MSIX);
    rig.write(CONFIG, msix + 2, 2, u64::from(MSIX_CTRL_ENABLE));

    rig.dev.reset().unwrap();
    for reg in [regs::SCRATCH, regs::DMA_ADDR_LO, regs::DMA_LEN, regs::DMA_STATUS, regs::IRQ_COUNT, regs::ISR]
    {
        assert_eq!(rig.reg(reg), 0, "register {reg:#x}");
    }
    assert_eq!(rig.read(2, regs::IO_SCRATCH, 4), 0);
    assert_eq!(rig.read(1, 4096, 4), 0);
    assert_eq!(rig.read(CONFIG, COMMAND as u64, 2), 0);
    assert_eq!(rig.read(CONFIG, msix + 2, 2), 1, "MSI-X disabled again");
    assert_eq!(rig.read(CONFIG, 6, 2) & 0x8, 0, "INTx deasserted");
    // The eventfds were dropped: an interrupt goes nowhere.
    rig.set_reg(regs::IRQ_RAISE, 0);
    assert_eq!(take(&intx), 0);
    // Still attached, but the reset cleared bus mastering: DMA is refused (EACCES) and
    // touches nothing until the driver turns it back on.
    let before = ram_bytes(&rig, RAM, 32);
    assert_eq!(rig.dma(regs::CMD_FILL, RAM, 32, 2), (regs::STATUS_ERROR, libc::EACCES as u32));
    assert_eq!(ram_bytes(&rig, RAM, 32), before, "no DMA with bus mastering off");
    rig.write(CONFIG, COMMAND as u64, 2, u64::from(COMMAND_MEMORY | COMMAND_MASTER));
    assert_eq!(rig.dma(regs::CMD_FILL, RAM, 32, 2).0, regs::STATUS_DONE);
    assert_eq!(ram_bytes(&rig, RAM, 32), vec![2; 32]);
}

#[test]
fn reset_during_dma_discards_the_job() {
    let rig = rig();
    rig.write(0, regs::DMA_ADDR_LO, 8, RAM);
    rig.set_reg(regs::DMA_LEN, MAX_DMA_LEN.min((RAM_PAGES * PAGE_SIZE) as u32));
    rig.set_reg(regs::DMA_CMD, regs::CMD_FILL);
    rig.dev.reset().unwrap();
    // Whatever the worker was doing, the registers stay reset.
    std::thread::sleep(Duration::from_millis(50));
    assert_eq!((rig.reg(regs::DMA_STATUS), rig.reg(regs::IRQ_COUNT)), (regs::STATUS_IDLE, 0));
}
