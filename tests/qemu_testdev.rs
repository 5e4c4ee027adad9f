//! QEMU 11's vfio-user-pci client against umdev, through qtest (no guest OS): the test
//! plays the guest. Skips only when QEMU cannot be fetched, and says so.

mod common;

use std::time::{Duration, Instant};

use common::qemu::{qemu_binary, Qtest};
use common::testdev::*;
use common::Harness;

const BAR0: u64 = 0xc000_0000;
const BAR1: u64 = 0xc000_2000;
const BAR2: u16 = 0xc000;
const RAM: u64 = 0x10_0000;

/// Programs the BARs and enables I/O, memory and bus mastering, as firmware would.
fn enable(q: &mut Qtest) {
    q.cfg_write32(0x10, BAR0 as u32);
    q.cfg_write32(0x14, BAR1 as u32);
    q.cfg_write32(0x18, u32::from(BAR2));
    q.cfg_write16(0x04, 0x0007);
}

fn wait_dma(q: &mut Qtest) -> u32 {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let status = q.readl(BAR0 + DMA_STATUS);
        if status != STATUS_BUSY {
            return status;
        }
        assert!(Instant::now() < deadline, "DMA never completed");
        std::thread::sleep(Duration::from_millis(2));
    }
}

fn dma(q: &mut Qtest, cmd: u32, addr: u64, len: u32, pattern: u8) -> u32 {
    q.writel(BAR0 + DMA_ADDR_LO, addr as u32);
    q.writel(BAR0 + DMA_ADDR_HI, (addr >> 32) as u32);
    q.writel(BAR0 + DMA_LEN, len);
    q.writel(BAR0 + DMA_PATTERN, u32::from(pattern));
    q.writel(BAR0 + DMA_CMD, cmd);
    wait_dma(q)
}

#[test]
fn qemu_realizes_testdev_and_drives_it() {
    let Some(qemu) = qemu_binary() else { return };
    let h = Harness::new("testdev");
    let mut q = Qtest::start(&qemu, &h.socket, 256, h.dir.path()).expect("start QEMU");
    q.cmd("irq_intercept_in ioapic");

    // Identity and class, as a guest's PCI scan reads them.
    assert_eq!(q.cfg_read32(0x00), 0x75d1_1234, "{}", q.stderr());
    assert_eq!(q.cfg_read32(0x08) >> 8, 0xff_0000, "class");
    assert_eq!(q.cfg_read8(0x3d), 1, "INTA");
    // The capability list: PM, MSI, MSI-X, each once, then the end.
    assert_ne!(q.cfg_read16(0x06) & 0x10, 0, "capability list bit");
    assert_eq!(q.cap_ids(), vec![0x01, 0x05, 0x11]);

    // BAR sizing, every kind: 4 KiB and 8 KiB memory, 16-byte I/O.
    assert_eq!(q.size_bar(0), 0xffff_f000);
    assert_eq!(q.size_bar(1), 0xffff_e000);
    assert_eq!(q.size_bar(2), 0xffff_fff1);
    assert_eq!(q.size_bar(3), 0);

    enable(&mut q);
    assert_eq!(q.readl(BAR0 + ID), ID_VALUE);
    q.writel(BAR0 + SCRATCH, 0x1234_5678);
    assert_eq!(q.readl(BAR0 + SCRATCH), 0x1234_5678);
    q.outl(BAR2, 0x55aa_1234);
    assert_eq!(q.inl(BAR2), 0x55aa_1234);
    assert_eq!(q.inl(BAR2 + 4), ID_VALUE);
    // BAR1: the first page is QEMU's mmap of our memfd, the second goes by message.
    q.writel(BAR1, 0xdead_beef);
    q.writel(BAR1 + 0x1000, 0xcafe_f00d);
    assert_eq!(q.readl(BAR1), 0xdead_beef);
    assert_eq!(q.readl(BAR1 + 0x1000), 0xcafe_f00d);

    // The device writes guest RAM through the memfd QEMU mapped (pins, no messages).
    assert_eq!(dma(&mut q, CMD_FILL, RAM + 0x100, 0x3000, 0xab), STATUS_DONE);
    assert_eq!(q.read(RAM + 0xf8, 8), vec![0; 8], "before the buffer");
    assert_eq!(q.read(RAM + 0x100, 16), vec![0xab; 16]);
    assert_eq!(q.read(RAM + 0x30f8, 8), vec![0xab; 8], "last bytes");
    assert_eq!(q.read(RAM + 0x3100, 8), vec![0; 8], "after the buffer");
    // And reads what the guest wrote.
    q.write(RAM + 0x8000, &[1, 2, 3, 4, 5]);
    assert_eq!(dma(&mut q, CMD_CHECKSUM, RAM + 0x8000, 5, 0), STATUS_DONE);
    assert_eq!(q.readl(BAR0 + DMA_RESULT), 15);
    let dma_stats = h.info().dma;
    assert!(dma_stats.pin_calls >= 2 && dma_stats.pins_held == 0, "{dma_stats:?}");

    // Memory QEMU mapped without an fd (0xc0000, read-only) is read through DMA_READ.
    let client_dma = h.info().protocol.client_dma_requests;
    assert_eq!(dma(&mut q, CMD_CHECKSUM, 0xc_0000, 0x100, 0), STATUS_DONE);
    assert!(h.info().protocol.client_dma_requests > client_dma, "DMA_READ went to QEMU");
    // Writing it is refused by QEMU (read-only ROM): the device reports an error status.
    assert_eq!(dma(&mut q, CMD_FILL, 0xc_0000, 0x10, 0xee), STATUS_ERROR);

    // An interrupt raised by the device reaches the guest as INTx through the IOAPIC.
    q.irq_events.clear();
    q.writel(BAR0 + IRQ_RAISE, 1);
    let irq = q.wait_irq_raise(Duration::from_secs(60));
    assert!(irq.is_some(), "no INTx seen; QEMU said:\n{}", q.stderr());
    assert_eq!(q.readl(BAR0 + ISR), 1, "ISR shows the interrupt and clears it");
    assert_eq!(q.readl(BAR0 + ISR), 0);
    assert!(q.running(), "{}", q.stderr());

    // The server saw no protocol errors in all that.
    let protocol = h.info().protocol;
    assert_eq!(protocol.fatal, 0);
    assert!(protocol.messages.contains_key("region_read") && protocol.messages.contains_key("dma_map"));
    drop(q);
    h.wait_idle();
    let dma = h.info().dma;
    assert_eq!((dma.mappings, dma.pins_held), (0, 0), "QEMU gone: nothing left mapped or pinned");
}
