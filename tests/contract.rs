//! Every built-in device and the author's examples pass the device contract
//! (`umdev_mdev::contract`): bounds and widths, reset to power-on values with interrupts off,
//! no guest access with bus mastering off, DMA unmap while busy, nothing left after detach.
//! One test, the devices one after another: the contract counts the process's fds and threads.

use std::os::unix::fs::FileExt;
use std::sync::Arc;

use umdev_devices::ccw::program::cmd;
use umdev_devices::ccw::{self, regs as ccw_regs};
use umdev_devices::nvme::spec::{admin_op, reg, Sqe};
use umdev_devices::{mtty, nvme, testdev};
use umdev_mdev::contract::{check, Contract, Probe};
use umdev_mdev::types::InstanceOptions;
use umdev_testkit::ccw_driver::{layout, Data, Op};
use umdev_testkit::nvme_driver::{Driver, Transport};

#[path = "../examples/custom_device.rs"]
#[allow(dead_code)]
mod custom_device;

#[path = "../examples/checksum_device.rs"]
#[allow(dead_code)]
mod checksum_device;

const ANY: &[usize] = &[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16];

fn ccw_sc(sc: u64, reg: u64) -> u64 {
    ccw_regs::SUBCHANNEL_BASE + sc * ccw_regs::SUBCHANNEL_STRIDE + reg
}

/// Runs `ops` on subchannel 0 of a ccw device and waits for its status.
fn ccw_run(p: &Probe<'_>, ops: &[Op], wait: bool) {
    for (addr, bytes) in layout(0x1000, 0x8000, ops) {
        p.ram.write_all_at(&bytes, addr).unwrap();
    }
    p.write32(0, ccw_sc(0, ccw_regs::CPA_LO), 0x1000);
    p.write32(0, ccw_sc(0, ccw_regs::STATUS_LO), 0x3000);
    p.write32(0, ccw_sc(0, ccw_regs::DOORBELL), ccw_regs::DOORBELL_START);
    if wait {
        p.wait("the ccw program", || p.read32(0, ccw_sc(0, ccw_regs::STATE)) == ccw_regs::STATE_PENDING);
        p.write32(0, ccw_sc(0, ccw_regs::ACK), 1);
    }
}

/// The nvme driver over the contract's probe (no interrupts: it polls).
struct ProbeBus<'a>(&'a Probe<'a>);

impl Transport for ProbeBus<'_> {
    fn read32(&mut self, offset: u64) -> Result<u32, String> {
        Ok(self.0.read32(0, offset))
    }
    fn write32(&mut self, offset: u64, value: u32) -> Result<(), String> {
        self.0.write32(0, offset, value);
        Ok(())
    }
    fn put(&mut self, addr: u64, bytes: &[u8]) -> Result<(), String> {
        self.0.ram.write_all_at(bytes, addr).map_err(|e| e.to_string())
    }
    fn get(&mut self, addr: u64, buf: &mut [u8]) -> Result<(), String> {
        self.0.ram.read_exact_at(buf, addr).map_err(|e| e.to_string())
    }
    fn wait_interrupt(&mut self, _vector: u16, _timeout: std::time::Duration) -> Option<bool> {
        None
    }
}

/// nvme: enables the controller on an admin queue at 64/128 KiB and rings an Identify
/// (the same bytes every time, so guest RAM is unchanged when the device may not touch it).
fn nvme_identify(p: &Probe<'_>) {
    p.write32(0, reg::CC, 0);
    p.wait("nvme disabled", || p.read32(0, reg::CSTS) & reg::CSTS_RDY == 0);
    p.write32(0, reg::AQA, 31 | 31 << 16);
    p.write32(0, reg::ASQ, 0x1_0000);
    p.write32(0, reg::ASQ + 4, 0);
    p.write32(0, reg::ACQ, 0x2_0000);
    p.write32(0, reg::ACQ + 4, 0);
    p.write32(0, reg::CC, 6 << 16 | 4 << 20 | reg::CC_EN);
    p.wait("nvme ready", || p.read32(0, reg::CSTS) & reg::CSTS_RDY != 0);
    let mut sqe = Sqe::new(admin_op::IDENTIFY, 1);
    sqe.prp1 = 0x3_0000.into();
    sqe.set_dw(10, 1);
    p.ram.write_all_at(vm_memory::ByteValued::as_slice(&sqe), 0x1_0000).unwrap();
    p.write32(0, reg::DOORBELLS, 1);
}

#[test]
fn every_device_keeps_the_contract() {
    let _ = env_logger::builder().is_test(true).try_init();

    // testdev: DMA fills through pins.
    let t = Arc::new(testdev::create().unwrap());
    check(
        t,
        &Contract {
            widths: vec![(0, &[1, 2, 4, 8]), (1, ANY), (2, &[1, 2, 4])],
            volatile: vec![(0, testdev::regs::ISR, 4)],
            touch_guest: Some(Box::new(|p: &Probe<'_>| {
                use testdev::regs::*;
                p.write32(0, DMA_ADDR_LO, 0x1000);
                p.write32(0, DMA_ADDR_HI, 0);
                p.write32(0, DMA_LEN, 4096);
                p.write32(0, DMA_PATTERN, 0x77);
                p.write32(0, DMA_CMD, CMD_FILL);
                p.wait("the testdev fill", || p.read32(0, DMA_STATUS) != STATUS_BUSY);
            })),
            make_busy: None,
        },
    );

    // ccw: a program that writes guest RAM; a 16 MiB READ to be busy with.
    let options = InstanceOptions::default();
    let config = ccw::CcwType::config(&options).unwrap();
    let c: Arc<dyn umdev_mdev::VfioDevice> = Arc::new(ccw::create(config).unwrap());
    check(
        c,
        &Contract {
            widths: vec![(0, &[4])],
            volatile: vec![],
            touch_guest: Some(Box::new(|p: &Probe<'_>| {
                ccw_run(p, &[Op::new(cmd::READ, 8192, Data::Direct(0x10_0000))], true);
            })),
            make_busy: Some(Box::new(|p: &Probe<'_>| {
                ccw_run(p, &[Op::new(cmd::READ, 16 << 20, Data::Direct(0x20_0000))], false);
                p.wait("pins held", || {
                    p.dma.stats().pins_held > 0
                        || p.read32(0, ccw_sc(0, ccw_regs::STATE)) != ccw_regs::STATE_BUSY
                });
            })),
        },
    );

    // mtty-2: no DMA; RBR, IIR, LSR and MSR have read side effects.
    let m = Arc::new(mtty::create(2).unwrap());
    let volatile = [0u64, 2, 5, 6].iter().flat_map(|&r| [(0, r, 1), (1, r, 1)]).collect();
    check(
        m,
        &Contract {
            widths: vec![(0, &[1, 2, 3, 4, 5, 6, 7, 8]), (1, &[1, 2, 3, 4, 5, 6, 7, 8])],
            volatile,
            touch_guest: None,
            make_busy: None,
        },
    );

    // nvme: an Identify writes guest RAM; I/O queues keep their rings pinned.
    let config = nvme::NvmeConfig {
        namespaces: vec![Some(nvme::namespace::Backing::Ram(1 << 20))],
        ..Default::default()
    };
    let n = Arc::new(nvme::create(config).unwrap());
    check(
        n,
        &Contract {
            widths: vec![(0, &[4, 8])],
            volatile: vec![],
            touch_guest: Some(Box::new(nvme_identify)),
            make_busy: Some(Box::new(|p: &Probe<'_>| {
                let mut d = Driver::new(ProbeBus(p));
                d.enable().unwrap();
                d.create_io_queues(2, 64, true).unwrap(); // INTx: one vector
                assert!(p.dma.stats().pins_held > 0, "nvme: the rings are pinned");
            })),
        },
    );

    // The author's examples: registers and MSI; a DMA engine with a worker, busy while paused
    // holding its buffer.
    let e = Arc::new(custom_device::device().unwrap());
    check(e, &Contract { widths: vec![(0, &[4])], volatile: vec![], touch_guest: None, make_busy: None });
    let d = Arc::new(checksum_device::device().unwrap());
    check(
        d,
        &Contract {
            widths: vec![(0, &[4])],
            volatile: vec![],
            touch_guest: Some(Box::new(|p: &Probe<'_>| checksum_job(p, 0x1000, 8192, false))),
            make_busy: Some(Box::new(|p: &Probe<'_>| checksum_job(p, 0x20_0000, 16 << 20, true))),
        },
    );
}

/// checksum_device: a job over `[addr, addr + len)`, waited for; `paused`, it stops before its
/// first block, holding the buffer's pins.
fn checksum_job(p: &Probe<'_>, addr: u32, len: u32, paused: bool) {
    use checksum_device::regs::*;
    use checksum_device::status;
    p.write32(0, CONTROL, if paused { PAUSE } else { 0 });
    p.write32(0, ADDR_LO, addr);
    p.write32(0, ADDR_HI, 0);
    p.write32(0, LEN, len);
    p.write32(0, DOORBELL, 1);
    let state = || p.read32(0, STATUS);
    if paused {
        p.wait("the checksum job paused holding its buffer", || state() == status::PAUSED);
    } else {
        p.wait("the checksum job", || !matches!(state(), status::BUSY | status::PAUSED));
    }
}
