//! The ccw device over a real DMA space, driven by the testkit's channel-program layout.

use std::fs::File;
use std::os::fd::AsFd;
use std::os::unix::fs::FileExt;
use std::sync::Arc;
use std::time::Duration;

use umdev_devices::ccw::program::cmd;
use umdev_devices::ccw::{create, regs, Ccw, CcwConfig, Store};
use umdev_mdev::pci::regs::{COMMAND, COMMAND_MASTER, COMMAND_MEMORY};
use umdev_mdev::pci::PciDevice;
use umdev_mdev::{DeviceContext, VfioDevice, VFIO_PCI_CONFIG_REGION_INDEX};
use umdev_pinning::{DmaSpace, Prot};
use umdev_testkit::ccw_driver::{idaws, layout, Data, Op};
use umdev_testkit::NoClient;

/// A ccw device with one subchannel, attached to 1 MiB of guest RAM at IOVA 0, bus
/// mastering on.
struct Rig {
    device: PciDevice<Ccw>,
    ram: File,
}

impl Rig {
    fn new(store: Store) -> Rig {
        let device = create(CcwConfig { subchannels: 1, store }).unwrap();
        let ram = File::from(
            nix::sys::memfd::memfd_create(c"ccw-test-ram", nix::sys::memfd::MFdFlags::MFD_CLOEXEC).unwrap(),
        );
        ram.set_len(1 << 20).unwrap();
        let dma = DmaSpace::new(Default::default());
        dma.map(0, 1 << 20, ram.as_fd(), 0, Prot::READ_WRITE).unwrap();
        let command = (COMMAND_MEMORY | COMMAND_MASTER).to_le_bytes();
        device.region_write(VFIO_PCI_CONFIG_REGION_INDEX, COMMAND as u64, &command).unwrap();
        device.attach(DeviceContext::new(dma, Arc::new(NoClient)));
        Rig { device, ram }
    }

    fn read(&self, offset: u64) -> u32 {
        let mut v = [0u8; 4];
        self.device.region_read(0, regs::SUBCHANNEL_BASE + offset, &mut v).unwrap();
        u32::from_le_bytes(v)
    }

    fn write(&self, offset: u64, value: u32) {
        self.device.region_write(0, regs::SUBCHANNEL_BASE + offset, &value.to_le_bytes()).unwrap();
    }

    /// Lays out `ops` at 0x2000 (IDAW lists at 0x4000), runs them, waits, ACKs; the
    /// registers' (REASON, CCWS, BYTES).
    fn run(&self, ops: &[Op]) -> (u32, u32, u32) {
        for (addr, bytes) in layout(0x2000, 0x4000, ops) {
            self.ram.write_all_at(&bytes, addr).unwrap();
        }
        self.write(regs::CPA_LO, 0x2000);
        self.write(regs::STATUS_LO, 0x3000);
        self.write(regs::DOORBELL, regs::DOORBELL_START);
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        while self.read(regs::STATE) != regs::STATE_PENDING {
            assert!(std::time::Instant::now() < deadline, "the program never ended");
            std::thread::sleep(Duration::from_millis(1));
        }
        let out = (self.read(regs::REASON), self.read(regs::CCWS), self.read(regs::BYTES_LO));
        self.write(regs::ACK, 1);
        out
    }
}

/// A file store is read and written in place (straight between the file and the pinned
/// pages), scattered IDAWs included, and keeps the data after the device is gone.
#[test]
fn a_file_store_holds_what_programs_wrote() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("store.img");
    File::create(&path).unwrap().set_len(256 << 10).unwrap();
    let rig = Rig::new(Store::open(&path).unwrap());
    let data: Vec<u8> = (0..3 * 4096u32).map(|i| (i % 251) as u8).collect();
    let blocks = [0x21000u64, 0x10000, 0x33000];
    for (i, b) in blocks.iter().enumerate() {
        rig.ram.write_all_at(&data[i * 4096..(i + 1) * 4096], *b).unwrap();
    }
    let len = 3 * 4096 - 100;
    let seek = |pos: u64| {
        rig.ram.write_all_at(&pos.to_le_bytes(), 0x8000).unwrap();
        Op::new(cmd::SEEK, 8, Data::Direct(0x8000))
    };
    let write = Op::new(cmd::WRITE, len, Data::Idaws(idaws(&blocks, 0, len)));
    assert_eq!(rig.run(&[seek(8192), write]), (0, 2, len));
    let on_disk = std::fs::read(&path).unwrap();
    assert_eq!(on_disk[8192..8192 + len as usize], data[..len as usize]);
    assert!(on_disk[..8192].iter().all(|&b| b == 0));

    let back = [0x50000u64, 0x60000, 0x52000];
    let read = Op::new(cmd::READ, len, Data::Idaws(idaws(&back, 0, len)));
    assert_eq!(rig.run(&[seek(8192), read]), (0, 2, len));
    let mut got = vec![0u8; len as usize];
    for (i, b) in back.iter().enumerate() {
        let n = (len as usize - i * 4096).min(4096);
        rig.ram.read_exact_at(&mut got[i * 4096..i * 4096 + n], *b).unwrap();
    }
    assert_eq!(got, data[..len as usize]);
    rig.device.detach();
    drop(rig);
    assert_eq!(std::fs::read(&path).unwrap()[8192..8192 + len as usize], data[..len as usize]);
}
