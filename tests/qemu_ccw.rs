//! The ccw device under QEMU 11 through qtest (no guest OS): the test plays the guest,
//! writing a channel program and its data into guest RAM with qtest writes, ringing the
//! doorbell, waiting for the interrupt, checking the status block and the data. Skips only
//! when QEMU cannot be fetched, and says so.

mod common;

use std::time::Duration;

use common::qemu::{qemu_binary, Qtest};
use common::Harness;
use umdev_devices::ccw::program::{cmd, cstat, dstat, Reason, Status, STATUS_SIZE};
use umdev_devices::ccw::regs;
use umdev_testkit::ccw_driver::{idaws, layout, Data, Op};

const BAR0: u64 = 0xc000_0000;
const PROGRAM: u64 = 0x20_0000;
const IDAL: u64 = 0x21_0000;
const STATUS: u64 = 0x22_0000;
const SEEK_ARG: u64 = 0x23_0000;

fn sc(reg: u64) -> u64 {
    BAR0 + regs::SUBCHANNEL_BASE + reg
}

fn run(q: &mut Qtest, ops: &[Op]) -> Status {
    for (addr, bytes) in layout(PROGRAM, IDAL, ops) {
        q.write(addr, &bytes);
    }
    q.write(STATUS, &[0xee; STATUS_SIZE]);
    q.writel(sc(regs::CPA_LO), PROGRAM as u32);
    q.writel(sc(regs::CPA_HI), 0);
    q.writel(sc(regs::STATUS_LO), STATUS as u32);
    q.writel(sc(regs::STATUS_HI), 0);
    q.irq_events.clear();
    q.writel(sc(regs::DOORBELL), regs::DOORBELL_START);
    assert!(q.wait_irq_raise(Duration::from_secs(60)).is_some(), "no interrupt; QEMU said:\n{}", q.stderr());
    assert_eq!(q.readl(sc(regs::STATE)), regs::STATE_PENDING);
    assert_eq!(q.readl(BAR0 + regs::IRQ_STATUS), 1);
    q.writel(sc(regs::ACK), 1);
    assert_eq!(q.readl(BAR0 + regs::IRQ_STATUS), 0);
    let raw: [u8; STATUS_SIZE] = q.read(STATUS, STATUS_SIZE).try_into().unwrap();
    Status::decode(&raw).expect("a status block in guest RAM")
}

#[test]
fn qemu_guest_runs_channel_programs() {
    let Some(qemu) = qemu_binary() else { return };
    let mut options = umdev_mdev::types::InstanceOptions::default();
    options.params.insert("subchannels".into(), "1".into());
    options.params.insert("size".into(), "1M".into());
    let h = Harness::with("ccw", options, |_| {});
    let mut q = Qtest::start(&qemu, &h.socket, 256, h.dir.path()).expect("start QEMU");
    q.cmd("irq_intercept_in ioapic");
    assert_eq!(q.cfg_read32(0x00), 0x75cc_1234, "{}", q.stderr());
    assert_eq!(q.size_bar(0), 0xffff_f000);
    q.cfg_write32(0x10, BAR0 as u32);
    q.cfg_write16(0x04, 0x0006); // memory + bus master
    assert_eq!(q.readl(BAR0 + regs::ID), regs::ID_VALUE);

    // Data scattered over three blocks, the first unaligned, written by the guest.
    let data: Vec<u8> = (0..10_000u32).map(|i| (i * 7 % 253) as u8).collect();
    let blocks = [0x40_3000u64, 0x40_1000, 0x40_8000];
    let list = idaws(&blocks, 0x180, data.len() as u32);
    let mut at = 0;
    for (i, &a) in list.iter().enumerate() {
        let n = if i == 0 { 4096 - 0x180 } else { (data.len() - at).min(4096) };
        q.write(a, &data[at..at + n]);
        at += n;
    }
    q.write(SEEK_ARG, &4096u64.to_le_bytes());
    let s = run(
        &mut q,
        &[Op::new(cmd::SEEK, 8, Data::Direct(SEEK_ARG)), Op::new(cmd::WRITE, 10_000, Data::Idaws(list))],
    );
    assert_eq!(
        (s.dstat, s.cstat, s.reason, s.ccws, s.bytes),
        (dstat::CE | dstat::DE, 0, Reason::Ok, 2, 10_000)
    );
    assert_eq!(s.cpa, PROGRAM + 32);

    // Read it back to other, scattered blocks: the guest finds its bytes there.
    let back = [0x50_0000u64, 0x50_2000, 0x50_4000];
    let list = idaws(&back, 0, 10_000);
    let s = run(
        &mut q,
        &[Op::new(cmd::SEEK, 8, Data::Direct(SEEK_ARG)), Op::new(cmd::READ, 10_000, Data::Idaws(list))],
    );
    assert!(s.ok(), "{s:?}");
    let mut got = Vec::new();
    for (i, &b) in back.iter().enumerate() {
        got.extend(q.read(b, if i < 2 { 4096 } else { 10_000 - 8192 }));
    }
    assert!(got == data, "the READ delivered the guest's bytes");

    // A bad program: a TIC loop ends in a program check, nothing else touched.
    q.write(PROGRAM, &[cmd::TIC, 0, 0, 0, 0, 0, 0, 0]);
    q.write(PROGRAM + 8, &PROGRAM.to_le_bytes());
    q.writel(sc(regs::CPA_LO), PROGRAM as u32);
    q.irq_events.clear();
    q.writel(sc(regs::DOORBELL), regs::DOORBELL_START);
    assert!(q.wait_irq_raise(Duration::from_secs(60)).is_some());
    assert_eq!(q.readl(sc(regs::REASON)), Reason::TicLoop as u32);
    assert_eq!(q.readl(sc(regs::DSTAT_CSTAT)) >> 8, u32::from(cstat::PROGRAM_CHECK));
    q.writel(sc(regs::ACK), 1);
    assert!(q.running(), "{}", q.stderr());
    let dma = h.info().dma;
    assert!(dma.pin_calls > 0 && dma.pins_held == 0, "{dma:?}");
}

#[test]
fn a_qemu_killed_mid_program_leaves_the_device_to_the_next_one() {
    let Some(qemu) = qemu_binary() else { return };
    let h = Harness::with("ccw", Default::default(), |_| {});
    let setup = |q: &mut Qtest| {
        q.cmd("irq_intercept_in ioapic");
        q.cfg_write32(0x10, BAR0 as u32);
        q.cfg_write16(0x04, 0x0006);
        assert_eq!(q.readl(BAR0 + regs::ID), regs::ID_VALUE, "{}", q.stderr());
    };
    let mut q = Qtest::start(&qemu, &h.socket, 256, h.dir.path()).expect("start QEMU");
    setup(&mut q);
    // 48 MiB in 1 MiB CCWs: still running when QEMU dies.
    let ops: Vec<Op> =
        (0..48u64).map(|i| Op::new(cmd::WRITE, 1 << 20, Data::Direct(0x100_0000 + (i << 20)))).collect();
    for (addr, bytes) in layout(PROGRAM, IDAL, &ops) {
        q.write(addr, &bytes);
    }
    q.writel(sc(regs::CPA_LO), PROGRAM as u32);
    q.writel(sc(regs::STATUS_LO), STATUS as u32);
    q.writel(sc(regs::DOORBELL), regs::DOORBELL_START);
    assert_eq!(q.readl(sc(regs::STATE)), regs::STATE_BUSY, "the program is running");
    q.kill();

    h.wait_idle();
    let dma = h.info().dma;
    assert_eq!((dma.pins_held, dma.mappings), (0, 0), "{dma:?}");

    // The next QEMU finds an idle, reset device and runs a program.
    let mut q = Qtest::start(&qemu, &h.socket, 256, h.dir.path()).expect("start QEMU again");
    setup(&mut q);
    assert_eq!(q.readl(sc(regs::STATE)), regs::STATE_IDLE);
    assert_eq!(q.readl(sc(regs::PROGRAMS)), 0);
    q.write(0x40_0000, &[7; 4096]);
    let s = run(&mut q, &[Op::new(cmd::WRITE, 4096, Data::Direct(0x40_0000))]);
    assert!(s.ok(), "{s:?}");
}
