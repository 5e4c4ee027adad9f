//! The nvme controller under QEMU 11 through qtest (no guest OS): the test plays the guest
//! with umdev's host-side driver over qtest reads and writes: enable, Identify, I/O queues,
//! a 1 MiB write with a chained PRP list from an unaligned start and its read back, and the
//! INTx interrupts QEMU delivers. Skips only when QEMU cannot be fetched, and says so.

mod common;

use std::time::Duration;

use common::qemu::{qemu_binary, Qtest};
use common::Harness;
use umdev_devices::nvme::spec::{reg, Status};
use umdev_testkit::nvme_driver::{Driver, Transport};

const BAR0: u64 = 0xc000_0000;

/// The driver over qtest: BAR accesses and guest RAM through QEMU.
struct Qt<'a>(&'a mut Qtest);

impl Transport for Qt<'_> {
    fn read32(&mut self, offset: u64) -> Result<u32, String> {
        Ok(self.0.readl(BAR0 + offset))
    }
    fn write32(&mut self, offset: u64, value: u32) -> Result<(), String> {
        self.0.writel(BAR0 + offset, value);
        Ok(())
    }
    fn put(&mut self, addr: u64, bytes: &[u8]) -> Result<(), String> {
        for (i, chunk) in bytes.chunks(64 << 10).enumerate() {
            self.0.write(addr + (i as u64) * (64 << 10), chunk);
        }
        Ok(())
    }
    fn get(&mut self, addr: u64, buf: &mut [u8]) -> Result<(), String> {
        for (i, chunk) in buf.chunks_mut(64 << 10).enumerate() {
            chunk.copy_from_slice(&self.0.read(addr + (i as u64) * (64 << 10), chunk.len()));
        }
        Ok(())
    }
    fn wait_interrupt(&mut self, _vector: u16, _timeout: Duration) -> Option<bool> {
        None // the driver polls its completion queues
    }
}

#[test]
fn qemu_guest_drives_the_nvme_controller() {
    let Some(qemu) = qemu_binary() else { return };
    let mut options = umdev_mdev::types::InstanceOptions::default();
    options.params.insert("ns1".into(), "ram:16M".into());
    let h = Harness::with("nvme", options, |_| {});
    let mut q = Qtest::start(&qemu, &h.socket, 256, h.dir.path()).expect("start QEMU");
    q.cmd("irq_intercept_in ioapic");
    assert_eq!(q.cfg_read32(0x00), 0x75e0_1234, "{}", q.stderr());
    assert_eq!(q.cfg_read32(0x08) >> 8, 0x01_0802, "class: NVM Express");
    // A 64-bit memory BAR of 16 KiB.
    assert_eq!(q.size_bar(0), 0xffff_c004);
    q.cfg_write32(0x10, BAR0 as u32);
    q.cfg_write32(0x14, 0);
    q.cfg_write16(0x04, 0x0006); // memory + bus master
    let mut d = Driver::new(Qt(&mut q));
    d.poll = true;
    d.enable().unwrap();
    assert_eq!(d.t.read32(reg::VS).unwrap(), reg::VERSION_1_3);
    let id = d.identify_controller().unwrap();
    assert_eq!((u16::from(id.vid), id.mdts, u32::from(id.nn)), (0x1234, 8, 1));
    let ns = d.identify_namespace(1).unwrap();
    assert_eq!(u64::from(ns.nsze), (16 << 20) / 512);
    // Without MSI-X enabled, every CQ shares vector 0 (INTx).
    d.create_io_queues(1, 16, true).unwrap();

    // 1 MiB from 0x600 into its first page over 257 pages in reverse order: PRP2 is a
    // list of 256 entries.
    let base = Driver::<Qt>::DATA;
    let pages: Vec<u64> = (0..257).rev().map(|i| base + i * 0x1000).collect();
    let data: Vec<u8> = (0..1u32 << 20).map(|i| (i.wrapping_mul(2654435761) >> 13) as u8).collect();
    let mut at = 0usize;
    for (i, &p) in pages.iter().enumerate() {
        let start = if i == 0 { 0x600 } else { 0 };
        let n = (0x1000 - start).min(data.len() - at);
        d.t.put(p + start as u64, &data[at..at + n]).unwrap();
        at += n;
        if at == data.len() {
            break;
        }
    }
    assert_eq!(d.rw(1, false, 1, 100, 2048, 512, &pages, 0x600).unwrap(), Status::SUCCESS);
    // Read it back into other pages 8 KiB apart, aligned: 256 pages.
    let back: Vec<u64> = (0..256).map(|i| base + 0x40_0000 + i * 0x2000).collect();
    assert_eq!(d.rw(1, true, 1, 100, 2048, 512, &back, 0).unwrap(), Status::SUCCESS);
    let mut got = vec![0u8; 1 << 20];
    for (i, chunk) in got.chunks_mut(0x1000).enumerate() {
        d.t.get(back[i], chunk).unwrap();
    }
    assert!(got == data, "1 MiB read back differs");
    // A chained list: 4 pages need 3 entries after PRP1; the list starts 2 entries before
    // the end of its page, so its second entry points at the next list page.
    let list = base + 0x80_0ff0;
    let next = base + 0x81_0000;
    d.t.put(list, &(base + 0x90_0000u64).to_le_bytes()).unwrap();
    d.t.put(list + 8, &next.to_le_bytes()).unwrap();
    d.t.put(next, &(base + 0x92_0000u64).to_le_bytes()).unwrap();
    d.t.put(next + 8, &(base + 0x93_0000u64).to_le_bytes()).unwrap();
    let sqe = Driver::<Qt>::rw_command(true, 1, 100, 32, base + 0x8f_0000, list);
    assert_eq!(d.io_command(1, sqe).unwrap().status(), Status::SUCCESS);
    let mut four = vec![0u8; 4 * 4096];
    for (i, page) in [0x8f_0000u64, 0x90_0000, 0x92_0000, 0x93_0000].iter().enumerate() {
        d.t.get(base + page, &mut four[i * 4096..(i + 1) * 4096]).unwrap();
    }
    assert!(four == data[..4 * 4096], "the chained list's pages hold the data");
    drop(d);
    // QEMU delivered the completions' interrupts on the line.
    assert!(q.wait_irq_raise(Duration::from_secs(60)).is_some(), "no INTx from QEMU: {}", q.stderr());
    let stats = h.info();
    assert!(q.running());
    drop(q);
    eprintln!("{}", stats.device);
}
