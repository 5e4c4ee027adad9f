//! The controller driven through [`VfioDevice`] by the testkit's NVMe `Driver`, against a real
//! [`DmaSpace`] over a memfd, with eventfds for interrupts.

use std::fs::File;
use std::time::Duration;

use umdev_devices::nvme::namespace::Backing;
use umdev_devices::nvme::spec::*;
use umdev_devices::nvme::*;
use umdev_mdev::pci::regs::{COMMAND, COMMAND_MASTER, COMMAND_MEMORY};
use umdev_mdev::VfioDevice;
use umdev_mdev::VFIO_PCI_CONFIG_REGION_INDEX as CONFIG;
use umdev_testkit::nvme_driver::{self as driver, Driver, Transport};
use umdev_testkit::nvme_rig::*;

#[test]
fn identify_describes_the_controller_and_namespace() {
    let mut d = up(Rig::new(), 0);
    let id = d.identify_controller().unwrap();
    assert_eq!((u16::from(id.vid), id.mdts, id.sqes, id.cqes, id.vwc), (VENDOR_ID, 8, 0x66, 0x44, 1));
    assert_eq!(u32::from(id.ver), reg::VERSION_1_3);
    assert_eq!((u32::from(id.nn), u16::from(id.oncs), u32::from(id.sgls)), (1, 0x0d, 0));
    assert_eq!(id.lpa, 0x06, "the effects log, extended Get Log Page data");
    assert!(id.sn.starts_with(b"UMDEV"));
    assert!(id.subnqn.starts_with(b"nqn.2026-12.dev.umdev:nvme:UMDEV"));
    let ns = d.identify_namespace(1).unwrap();
    assert_eq!((u64::from(ns.nsze), u64::from(ns.ncap)), ((64 << 20) / 512, (64 << 20) / 512));
    assert_eq!((u32::from(ns.lbaf[0]) >> 16) & 0xff, 9);
    // The active namespace list, the descriptors (NGUID and UUID, as Linux needs for 1.3).
    let list = d.identify(cns::ACTIVE_NAMESPACES, 0).unwrap();
    assert_eq!(&list[..8], &[1, 0, 0, 0, 0, 0, 0, 0]);
    let desc = d.identify(cns::NS_DESCRIPTORS, 1).unwrap();
    assert_eq!((desc[0], desc[1], desc[20], desc[21]), (2, 16, 3, 16));
    assert_eq!(&desc[4..20], &ns.nguid);
    // An unknown CNS (Linux asks for 06h), an NSID that does not exist.
    let mut sqe = Sqe::new(admin_op::IDENTIFY, 0);
    sqe.set_dw(10, 6);
    sqe.prp1 = 0x3_0000.into();
    assert_eq!(d.admin_command(sqe).unwrap().status(), Status::INVALID_FIELD.dnr());
    sqe.set_dw(10, 0);
    sqe.nsid = 9.into();
    assert_eq!(d.admin_command(sqe).unwrap().status(), Status::INVALID_NAMESPACE.dnr());
    // CAP and VS as Linux reads them: two 32-bit halves.
    let cap = u64::from(d.t.read32(reg::CAP).unwrap()) | u64::from(d.t.read32(reg::CAP + 4).unwrap()) << 32;
    assert_eq!((cap & 0xffff, (cap >> 16) & 1, (cap >> 37) & 1, (cap >> 48) & 0xf), (1023, 1, 1, 0));
    // CC reads back exactly what was written.
    assert_eq!(d.t.read32(reg::CC).unwrap(), 6 << 16 | 4 << 20 | 1);
}

#[test]
fn scattered_reads_and_writes_go_through_one_pin_each() {
    let mut d = up(Rig::new(), 2);
    // 96 KiB + 512 at an unaligned offset over 25 pages in 7 runs of consecutive pages,
    // the runs scattered: a PRP list.
    let mut pages = Vec::new();
    for (run, len) in [3u64, 1, 4, 1, 5, 9, 2].iter().enumerate() {
        let start = DATA + 0x10_0000 * (7 - run as u64);
        pages.extend((0..*len).map(|i| start + i * 0x1000));
    }
    let len = 96 * 1024 + 512;
    let data = pattern(len, 3);
    let mut at = 0usize;
    for (i, &p) in pages.iter().enumerate() {
        let start = if i == 0 { 0x200 } else { 0 };
        let n = (0x1000 - start).min(len - at);
        if n == 0 {
            break;
        }
        d.t.put(p + start as u64, &data[at..at + n]).unwrap();
        at += n;
    }
    let nlb = (len / 512) as u32;
    assert_eq!(d.rw(1, false, 1, 100, nlb, 512, &pages, 0x200).unwrap(), Status::SUCCESS);
    // Read it back on the other queue into other pages, aligned this time.
    let back: Vec<u64> = (0..26).map(|i| DATA + 0x20_0000 + i * 0x2000).collect();
    assert_eq!(d.rw(2, true, 1, 100, nlb, 512, &back, 0).unwrap(), Status::SUCCESS);
    let mut got = vec![0u8; len];
    for (i, chunk) in got.chunks_mut(0x1000).enumerate() {
        d.t.get(back[i], chunk).unwrap();
    }
    assert_eq!(got, data);
    let totals = d.t.dev.function().totals();
    assert_eq!((totals.reads, totals.writes, totals.pin_calls), (1, 1, 2));
    assert_eq!(totals.bytes_read, len as u64);
    // The write's 25 pages in the guest's 7 runs; the read's 25 pages 8 KiB apart: 25 runs.
    assert_eq!((totals.pages, totals.runs), (50, 7 + 25));
    assert_eq!(
        (totals.pages_per_command[5], totals.runs_per_command[3], totals.runs_per_command[5]),
        (2, 1, 1)
    );
    assert_eq!(totals.list_pages, 2);
}

/// Waits for one successful completion on queue 1 per identifier of `cids`, in that order.
fn expect_in_order(d: &mut Driver<Rig>, cids: &[u16]) {
    let mut seen = Vec::new();
    for _ in 0..cids.len() {
        let cqe = d.wait(1, Duration::from_secs(60)).unwrap();
        assert_eq!(cqe.status(), Status::SUCCESS, "{cqe:?}");
        seen.push(u16::from(cqe.cid));
    }
    assert_eq!(seen, cids, "each once, in the order they ran");
}

/// Reads on queue 1 behind one doorbell: each of `commands` (NSID, SLBA, blocks, PRP1, PRP2)
/// with command identifier `cid` + its index, the queue rung once, then each completion's
/// (command identifier, status) as they came.
fn reads_behind_one_doorbell(
    d: &mut Driver<Rig>,
    commands: &[(u32, u64, u32, u64, u64)],
    cid: u16,
) -> Vec<(u16, Status)> {
    for (i, &(nsid, slba, blocks, prp1, prp2)) in commands.iter().enumerate() {
        let mut sqe = Driver::<Rig>::rw_command(true, nsid, slba, blocks, prp1, prp2);
        sqe.cdw0 = (u32::from(nvm_op::READ) | u32::from(cid + i as u16) << 16).into();
        d.push(1, &sqe).unwrap();
    }
    d.ring(1).unwrap();
    commands
        .iter()
        .map(|_| {
            let cqe = d.wait(1, Duration::from_secs(60)).unwrap();
            (u16::from(cqe.cid), cqe.status())
        })
        .collect()
}

/// Nothing more is posted on queue 1 (nothing twice).
fn nothing_more(d: &mut Driver<Rig>) {
    std::thread::sleep(Duration::from_millis(20));
    assert!(d.poll_one(1).unwrap().is_none(), "nothing posted twice");
}

#[test]
fn a_burst_of_commands_completes_each_once_in_the_order_they_ran() {
    let mut d = up(Rig::new(), 1);
    // Ten reads behind one doorbell: the worker runs them in queue order, each completion is
    // posted once, and nothing more appears.
    let cids: Vec<u16> = (0..10).map(|i| 0x40 + i).collect();
    for (i, &cid) in cids.iter().enumerate() {
        let mut sqe = Driver::<Rig>::rw_command(true, 1, i as u64 * 8, 8, DATA + 0x1000 * i as u64, 0);
        sqe.cdw0 = (u32::from(nvm_op::READ) | u32::from(cid) << 16).into();
        d.push(1, &sqe).unwrap();
    }
    d.ring(1).unwrap();
    expect_in_order(&mut d, &cids);
    nothing_more(&mut d);
}

#[test]
fn a_burst_of_ram_writes_and_reads_completes_each_once_in_order_with_the_data_written() {
    let mut d = up(Rig::new(), 1);
    // Eleven 4 KiB writes then eleven reads of the same blocks behind one doorbell (more than
    // a batch of held write completions, and not a multiple of it): every entry once, in
    // queue order, and each read sees the write queued before it.
    let n = 11u64;
    let mut cids = Vec::new();
    for i in 0..n {
        d.t.put(DATA + 0x1000 * i, &pattern(4096, i as u8 + 1)).unwrap();
        let mut sqe = Driver::<Rig>::rw_command(false, 1, 64 + i * 8, 8, DATA + 0x1000 * i, 0);
        sqe.cdw0 = (u32::from(nvm_op::WRITE) | (0x100 + i as u32) << 16).into();
        d.push(1, &sqe).unwrap();
        cids.push(0x100 + i as u16);
    }
    for i in 0..n {
        let mut sqe = Driver::<Rig>::rw_command(true, 1, 64 + i * 8, 8, DATA + 0x20_0000 + 0x1000 * i, 0);
        sqe.cdw0 = (u32::from(nvm_op::READ) | (0x200 + i as u32) << 16).into();
        d.push(1, &sqe).unwrap();
        cids.push(0x200 + i as u16);
    }
    d.ring(1).unwrap();
    expect_in_order(&mut d, &cids);
    for i in 0..n {
        let mut got = vec![0u8; 4096];
        d.t.get(DATA + 0x20_0000 + 0x1000 * i, &mut got).unwrap();
        assert_eq!(got, pattern(4096, i as u8 + 1), "block {i}");
    }
    nothing_more(&mut d);
    // A lone write after the burst completes without another command behind it.
    let mut sqe = Driver::<Rig>::rw_command(false, 1, 0, 8, DATA, 0);
    sqe.cdw0 = (u32::from(nvm_op::WRITE) | 0x300 << 16).into();
    d.push(1, &sqe).unwrap();
    d.ring(1).unwrap();
    let cqe = d.wait(1, Duration::from_secs(60)).unwrap();
    assert_eq!((u16::from(cqe.cid), cqe.status()), (0x300, Status::SUCCESS));
}

#[test]
fn long_reads_behind_one_doorbell_each_end_as_their_own_entry_says_whatever_the_next_holds() {
    let mut d = up(Rig::new(), 1);
    // 64 KiB reads (a PRP list each), so the worker looks at the entry after each before it
    // runs it: that entry's list pointer unmapped, past the end of its page, its namespace
    // absent. What it finds there changes nothing: each entry ends with its own status.
    let list = |d: &mut Driver<Rig>, at: u64, first: u64| {
        for i in 1..16u64 {
            d.t.put(at + 8 * (i - 1), &(first + 0x1000 * i).to_le_bytes()).unwrap();
        }
        at
    };
    let (a, b) = (DATA + 0x40_0000, DATA + 0x50_0000);
    let data = pattern(64 << 10, 5);
    let src: Vec<u64> = (0..16).map(|i| DATA + 0x60_0000 + 0x1000 * i).collect();
    for (p, chunk) in src.iter().zip(data.chunks(4096)) {
        d.t.put(*p, chunk).unwrap();
    }
    assert_eq!(d.rw(1, false, 1, 0, 128, 512, &src, 0).unwrap(), Status::SUCCESS);
    let cases = [
        (1, a, list(&mut d, DATA + 0x30_0000, a), Status::SUCCESS),
        (1, DATA, 0x4000_0000_0000, Status::DATA_TRANSFER_ERROR),
        (1, DATA, DATA + 0x30_1ff8, Status::PRP_OFFSET_INVALID),
        (7, DATA, DATA + 0x30_0000, Status::INVALID_NAMESPACE.dnr()),
        (1, b, list(&mut d, DATA + 0x30_2000, b), Status::SUCCESS),
    ];
    d.t.put(DATA + 0x30_1ff8, &0x1234u64.to_le_bytes()).unwrap(); // not page aligned
    let commands: Vec<_> = cases.iter().map(|&(nsid, prp1, prp2, _)| (nsid, 0, 128, prp1, prp2)).collect();
    let seen = reads_behind_one_doorbell(&mut d, &commands, 0x500);
    let want: Vec<_> = cases.iter().enumerate().map(|(i, c)| (0x500 + i as u16, c.3)).collect();
    assert_eq!(seen, want);
    let (mut x, mut y) = (vec![0u8; 64 << 10], vec![0u8; 64 << 10]);
    for (i, (pa, pb)) in x.chunks_mut(4096).zip(y.chunks_mut(4096)).enumerate() {
        d.t.get(a + 0x1000 * i as u64, pa).unwrap();
        d.t.get(b + 0x1000 * i as u64, pb).unwrap();
    }
    assert!(x == data && y == data, "both reads brought blocks 0-127");
    nothing_more(&mut d);
}

#[test]
fn short_ram_reads_behind_one_doorbell_end_as_their_own_entry_says_whatever_the_next_reads() {
    let mut d = up(Rig::new(), 1);
    // 4 KiB reads of the RAM namespace (64 MiB of 512-byte blocks), so the worker looks at
    // the entry after each and asks for the start of what it reads: from one block past the
    // end, across the end, from an SLBA whose end overflows, from an absent namespace. What
    // it finds there changes nothing: each entry ends with its own status.
    let blocks = 64 << 11;
    let (a, b, src) = (DATA + 0x40_0000, DATA + 0x50_0000, DATA + 0x60_0000);
    let data = pattern(4096, 3);
    d.t.put(src, &data).unwrap();
    assert_eq!(d.rw(1, false, 1, 0, 8, 512, &[src], 0).unwrap(), Status::SUCCESS);
    let cases = [
        (1, 0, a, Status::SUCCESS),
        (1, blocks, DATA, Status::LBA_OUT_OF_RANGE.dnr()),
        (1, blocks - 2, DATA, Status::LBA_OUT_OF_RANGE.dnr()),
        (1, u64::MAX - 3, DATA, Status::LBA_OUT_OF_RANGE.dnr()),
        (7, 0, DATA, Status::INVALID_NAMESPACE.dnr()),
        (1, 0, b, Status::SUCCESS),
    ];
    let commands: Vec<_> = cases.iter().map(|&(nsid, slba, prp1, _)| (nsid, slba, 8, prp1, 0)).collect();
    let seen = reads_behind_one_doorbell(&mut d, &commands, 0x600);
    let want: Vec<_> = cases.iter().enumerate().map(|(i, c)| (0x600 + i as u16, c.3)).collect();
    assert_eq!(seen, want);
    let (mut x, mut y) = (vec![0u8; 4096], vec![0u8; 4096]);
    d.t.get(a, &mut x).unwrap();
    d.t.get(b, &mut y).unwrap();
    assert!(x == data && y == data, "both reads brought blocks 0-7");
    nothing_more(&mut d);
}

#[test]
fn chained_prp_lists_carry_the_largest_transfer() {
    let mut d = up(Rig::new(), 1);
    // 1 MiB from an unaligned start: 257 pages, 256 entries in the list.
    let pages: Vec<u64> = (0..257).rev().map(|i| DATA + i * 0x1000).collect();
    let data = pattern(1 << 20, 9);
    let mut at = 0;
    for (i, &p) in pages.iter().enumerate() {
        let start = if i == 0 { 0xe00 } else { 0 };
        let n = (0x1000 - start).min(data.len() - at);
        d.t.put(p + start as u64, &data[at..at + n]).unwrap();
        at += n;
        if at == data.len() {
            break;
        }
    }
    assert_eq!(d.rw(1, false, 1, 0, 2048, 512, &pages, 0xe00).unwrap(), Status::SUCCESS);
    // A PRP list that starts 8 bytes before the end of its page must chain at once.
    let mut sqe = Driver::<Rig>::rw_command(true, 1, 0, 16, DATA + 0x50_0000, DATA + 0x60_0ff8);
    let list = DATA + 0x60_0ff8;
    d.t.put(list, &(DATA + 0x61_0000).to_le_bytes()).unwrap(); // chain pointer
    d.t.put(DATA + 0x61_0000, &(DATA + 0x50_1000).to_le_bytes()).unwrap();
    sqe.set_dw(12, 15); // 16 blocks: 8 KiB, 2 pages... PRP2 is then a page, not a list
    let cqe = d.io_command(1, sqe).unwrap();
    assert_eq!(cqe.status(), Status::PRP_OFFSET_INVALID, "PRP2 of a 2-page transfer is a page");
    let mut sqe = Driver::<Rig>::rw_command(true, 1, 0, 24, DATA + 0x50_0000, list);
    sqe.set_dw(12, 23); // 12 KiB: PRP2 is a list: one entry here, then the chained page
    d.t.put(DATA + 0x61_0008, &(DATA + 0x50_2000).to_le_bytes()).unwrap();
    assert_eq!(d.io_command(1, sqe).unwrap().status(), Status::SUCCESS);
    let mut got = vec![0u8; 12 * 1024];
    d.t.get(DATA + 0x50_0000, &mut got).unwrap();
    assert_eq!(got, data[..12 * 1024]);
}

#[test]
fn bad_commands_get_the_specified_status() {
    let mut d = up(Rig::new(), 1);
    let blocks = (64u64 << 20) / 512;
    let ok = |d: &mut Driver<Rig>, sqe: Sqe| d.io_command(1, sqe).unwrap().status();
    let rw = Driver::<Rig>::rw_command;
    assert_eq!(ok(&mut d, rw(true, 1, blocks - 1, 2, DATA, 0)), Status::LBA_OUT_OF_RANGE.dnr());
    assert_eq!(ok(&mut d, rw(true, 1, u64::MAX, 1, DATA, 0)), Status::LBA_OUT_OF_RANGE.dnr());
    assert_eq!(ok(&mut d, rw(true, 2, 0, 1, DATA, 0)), Status::INVALID_NAMESPACE.dnr());
    assert_eq!(ok(&mut d, rw(true, 0, 0, 1, DATA, 0)), Status::INVALID_NAMESPACE.dnr());
    assert_eq!(ok(&mut d, rw(true, 1, 0, 1, DATA + 2, 0)), Status::PRP_OFFSET_INVALID);
    // Over MDTS (1 MiB).
    assert_eq!(ok(&mut d, rw(true, 1, 0, 4096, DATA, DATA + 0x1000)), Status::INVALID_FIELD.dnr());
    // Data outside every mapping, a list entry outside, a read into read-only memory.
    assert_eq!(ok(&mut d, rw(true, 1, 0, 1, 1 << 40, 0)), Status::DATA_TRANSFER_ERROR);
    d.t.put(DATA + 0x8000, &(1u64 << 40).to_le_bytes()).unwrap();
    d.t.put(DATA + 0x8008, &(DATA).to_le_bytes()).unwrap();
    assert_eq!(ok(&mut d, rw(true, 1, 0, 24, DATA, DATA + 0x8000)), Status::DATA_TRANSFER_ERROR);
    assert_eq!(ok(&mut d, rw(true, 1, 0, 1, RO, 0)), Status::DATA_TRANSFER_ERROR);
    assert_eq!(ok(&mut d, rw(false, 1, 0, 1, RO, 0)), Status::SUCCESS, "a write reads read-only memory fine");
    // Unknown opcode, SGLs, fused commands.
    assert_eq!(ok(&mut d, Sqe::new(0x7f, 0)), Status::INVALID_OPCODE.dnr());
    let mut sqe = Sqe::new(0x7f, 0);
    sqe.nsid = 1.into();
    assert_eq!(ok(&mut d, sqe), Status::INVALID_OPCODE.dnr());
    let mut sgl = rw(true, 1, 0, 1, DATA, 0);
    sgl.cdw0 = (u32::from(sgl.cdw0) | 1 << 14).into();
    assert_eq!(ok(&mut d, sgl), Status::INVALID_FIELD.dnr());
    // Nothing of guest memory outside the mappings was touched, the device goes on.
    assert_eq!(d.rw(1, true, 1, 0, 8, 512, &[DATA], 0).unwrap(), Status::SUCCESS);
    // The failures are in the error log, newest first.
    let entry = d.error_log(1).unwrap()[0];
    assert_eq!(u16::from(entry.sqid), 1);
    assert_eq!(u16::from(entry.status) >> 1, Status::INVALID_FIELD.dnr().0);
    assert!(u64::from(entry.error_count) >= 12);
}

#[test]
fn queue_management_checks_what_the_spec_checks() {
    let mut d = up(Rig::new(), 0);
    let create = |kind: u8, qid: u16, entries: u32, dw11: u32, base: u64| {
        let mut sqe = Sqe::new(kind, 0);
        sqe.prp1 = base.into();
        sqe.set_dw(10, u32::from(qid) | (entries.wrapping_sub(1)) << 16);
        sqe.set_dw(11, dw11);
        sqe
    };
    let status = |d: &mut Driver<Rig>, sqe| d.admin_command(sqe).unwrap().status();
    let cq = admin_op::CREATE_CQ;
    let sq = admin_op::CREATE_SQ;
    let base = DATA;
    assert_eq!(status(&mut d, create(cq, 0, 16, 3, base)), Status::INVALID_QUEUE_ID.dnr());
    assert_eq!(status(&mut d, create(cq, 5, 16, 3, base)), Status::INVALID_QUEUE_ID.dnr(), "only 4 granted");
    assert_eq!(status(&mut d, create(cq, 1, 1, 3, base)), Status::INVALID_QUEUE_SIZE.dnr());
    assert_eq!(status(&mut d, create(cq, 1, 1025, 3, base)), Status::INVALID_QUEUE_SIZE.dnr());
    assert_eq!(status(&mut d, create(cq, 1, 0, 3, base)), Status::INVALID_QUEUE_SIZE.dnr(), "65536 entries");
    assert_eq!(status(&mut d, create(cq, 1, 16, 2, base)), Status::INVALID_FIELD.dnr(), "not contiguous");
    assert_eq!(status(&mut d, create(cq, 1, 16, 3, base + 8)), Status::PRP_OFFSET_INVALID.dnr());
    assert_eq!(status(&mut d, create(cq, 1, 16, 3 | 9 << 16, base)), Status::INVALID_VECTOR.dnr());
    assert_eq!(status(&mut d, create(sq, 1, 16, 1 | 1 << 16, base)), Status::CQ_INVALID.dnr());
    assert_eq!(status(&mut d, create(cq, 1, 16, 3 | 1 << 16, base)), Status::SUCCESS);
    assert_eq!(status(&mut d, create(cq, 1, 16, 3 | 1 << 16, base)), Status::INVALID_QUEUE_ID.dnr());
    assert_eq!(status(&mut d, create(sq, 1, 16, 1, base + 0x1000)), Status::CQ_INVALID.dnr(), "CQ 0");
    assert_eq!(status(&mut d, create(sq, 1, 16, 1 | 1 << 16, base + 0x1000)), Status::SUCCESS);
    // Number of Queues cannot change once I/O queues exist.
    let mut nq = Sqe::new(admin_op::SET_FEATURES, 0);
    nq.set_dw(10, u32::from(feature::NUMBER_OF_QUEUES));
    assert_eq!(status(&mut d, nq), Status::COMMAND_SEQUENCE_ERROR.dnr());
    // A CQ with an SQ on it cannot go; the SQ first, then the CQ.
    let delete = |kind: u8, qid: u16| {
        let mut sqe = Sqe::new(kind, 0);
        sqe.set_dw(10, u32::from(qid));
        sqe
    };
    assert_eq!(status(&mut d, delete(admin_op::DELETE_CQ, 1)), Status::INVALID_QUEUE_DELETION.dnr());
    assert_eq!(status(&mut d, delete(admin_op::DELETE_SQ, 2)), Status::INVALID_QUEUE_ID.dnr());
    assert_eq!(status(&mut d, delete(admin_op::DELETE_SQ, 0)), Status::INVALID_QUEUE_ID.dnr());
    assert_eq!(status(&mut d, delete(admin_op::DELETE_SQ, 1)), Status::SUCCESS);
    assert_eq!(status(&mut d, delete(admin_op::DELETE_CQ, 1)), Status::SUCCESS);
    assert_eq!(status(&mut d, delete(admin_op::DELETE_CQ, 1)), Status::INVALID_QUEUE_ID.dnr());
    assert_eq!(d.t.ctrl().workers(), 1, "only the admin worker is left");
    assert_eq!(status(&mut d, nq), Status::SUCCESS);
}

#[test]
fn a_disable_drops_queues_workers_and_pins_and_the_controller_comes_back() {
    let mut d = up(Rig::new(), 4);
    assert_eq!(d.t.ctrl().workers(), 5);
    assert_eq!(d.rw(3, false, 1, 8, 8, 512, &[DATA], 0).unwrap(), Status::SUCCESS);
    assert!(d.t.dma.stats().pinned_pages > 0, "rings stay pinned while in use");
    d.t.write32(reg::CC, 0).unwrap();
    assert_eq!(d.t.read32(reg::CSTS).unwrap() & reg::CSTS_RDY, 0);
    assert_eq!(d.t.ctrl().workers(), 0);
    assert_eq!(d.t.dma.stats().pinned_pages, 0);
    // Doorbells of a disabled controller do nothing.
    d.t.write32(reg::DOORBELLS + 8, 1).unwrap();
    d.enable().unwrap();
    d.create_io_queues(2, 32, false).unwrap();
    assert_eq!(d.rw(2, true, 1, 8, 8, 512, &[DATA + 0x1000], 0).unwrap(), Status::SUCCESS);
    let mut a = vec![0u8; 4096];
    let mut b = vec![0u8; 4096];
    d.t.get(DATA, &mut a).unwrap();
    d.t.get(DATA + 0x1000, &mut b).unwrap();
    assert_eq!(a, b, "the namespace kept its data across the reset");
    // Shutdown notification.
    d.shutdown().unwrap();
    // A detach leaves nothing behind.
    d.t.dev.detach();
    assert_eq!((d.t.ctrl().workers(), d.t.dma.stats().pinned_pages), (0, 0));
}

#[test]
fn an_unmapped_ring_is_let_go_and_pinned_again() {
    let mut d = up(Rig::new(), 1);
    let pinned = d.t.dma.stats().pinned_pages;
    assert!(pinned > 0);
    // The engine's unmap calls the device back; here the device is told directly, as
    // the server's notifier does, and must drop the ring pins at once.
    d.t.dev.dma_unmap(0, RAM_SIZE);
    assert_eq!(d.t.dma.stats().pinned_pages, 0);
    // Still mapped: the next command pins the rings again and works.
    assert_eq!(d.rw(1, true, 1, 0, 8, 512, &[DATA], 0).unwrap(), Status::SUCCESS);
    assert_eq!(d.t.dma.stats().pinned_pages, pinned);
    // Really unmapped: the controller reports fatal status instead of touching anything.
    // The unmap succeeds: the rings let go of their pins when told (it did not outwait its
    // bound).
    d.t.dma.unmap(0, RAM_SIZE).unwrap();
    let _ = d.t.write32(reg::DOORBELLS + 8, 2);
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while d.t.read32(reg::CSTS).unwrap() & reg::CSTS_CFS == 0 {
        assert!(std::time::Instant::now() < deadline, "no fatal status");
        std::thread::sleep(Duration::from_millis(1));
    }
}

#[test]
fn features_round_trip_and_a_temperature_event_reaches_an_aer() {
    let mut d = up(Rig::new(), 1);
    let set = |fid: u8, dw11: u32| {
        let mut sqe = Sqe::new(admin_op::SET_FEATURES, 0);
        sqe.set_dw(10, u32::from(fid));
        sqe.set_dw(11, dw11);
        sqe
    };
    let get = |fid: u8, dw11: u32| {
        let mut sqe = Sqe::new(admin_op::GET_FEATURES, 0);
        sqe.set_dw(10, u32::from(fid));
        sqe.set_dw(11, dw11);
        sqe
    };
    assert_eq!(d.admin_ok(get(feature::VOLATILE_WRITE_CACHE, 0)).unwrap(), 1);
    d.admin_ok(set(feature::VOLATILE_WRITE_CACHE, 0)).unwrap();
    assert_eq!(d.admin_ok(get(feature::VOLATILE_WRITE_CACHE, 0)).unwrap(), 0);
    assert_eq!(d.admin_ok(get(feature::TEMPERATURE_THRESHOLD, 0)).unwrap(), 343);
    assert_eq!(d.admin_ok(get(feature::NUMBER_OF_QUEUES, 0)).unwrap(), 0, "one pair granted, 0's based");
    d.admin_ok(set(feature::INTERRUPT_COALESCING, 3 | 1 << 8)).unwrap();
    assert_eq!(d.admin_ok(get(feature::INTERRUPT_COALESCING, 0)).unwrap(), 3 | 1 << 8);
    // Saved values (SEL 2) are the defaults, whatever is current.
    let saved = |fid: u8| {
        let mut sqe = get(fid, 0);
        sqe.set_dw(10, u32::from(fid) | 2 << 8);
        sqe
    };
    assert_eq!(d.admin_ok(saved(feature::INTERRUPT_COALESCING)).unwrap(), 0);
    assert_eq!(d.admin_ok(saved(feature::VOLATILE_WRITE_CACHE)).unwrap(), 1);
    // Vector 0 is never coalesced, and says so; asking for it changes nothing.
    assert_eq!(d.admin_ok(get(feature::INTERRUPT_VECTOR_CONFIG, 0)).unwrap(), 1 << 16);
    d.admin_ok(set(feature::INTERRUPT_VECTOR_CONFIG, 0)).unwrap();
    assert_eq!(d.admin_ok(get(feature::INTERRUPT_VECTOR_CONFIG, 0)).unwrap(), 1 << 16);
    assert_eq!(d.admin_ok(get(feature::INTERRUPT_VECTOR_CONFIG, 1)).unwrap(), 1, "vector 1: coalesced");
    let mut save = set(feature::ARBITRATION, 0);
    save.set_dw(10, u32::from(feature::ARBITRATION) | 1 << 31);
    assert_eq!(d.admin_command(save).unwrap().status(), Status::FEATURE_NOT_SAVEABLE.dnr());
    assert_eq!(d.admin_command(get(0x7e, 0)).unwrap().status(), Status::INVALID_FIELD.dnr());
    assert_eq!(
        d.admin_command(set(feature::POWER_MANAGEMENT, 1)).unwrap().status(),
        Status::INVALID_FIELD.dnr()
    );

    // An AER waits; enabling the temperature warning and dropping the over threshold to the
    // composite temperature (313 K: at the threshold counts) completes it with a SMART event.
    let cid = d.cid();
    let mut aer = Sqe::new(admin_op::ASYNC_EVENT, cid);
    aer.cdw0 = (u32::from(admin_op::ASYNC_EVENT) | u32::from(cid) << 16).into();
    d.submit(0, &aer).unwrap();
    d.admin_ok(set(feature::ASYNC_EVENT_CONFIG, 0x2)).unwrap();
    // The event completes the AER while the Set Features runs: its completion comes first.
    let set_cid = d.cid();
    let mut threshold = set(feature::TEMPERATURE_THRESHOLD, 313);
    threshold.cdw0 = (u32::from(admin_op::SET_FEATURES) | u32::from(set_cid) << 16).into();
    d.submit(0, &threshold).unwrap();
    let event = d.wait(0, Duration::from_secs(5)).unwrap();
    assert_eq!(u16::from(event.cid), cid);
    assert_eq!(u32::from(event.dw0), event::TYPE_SMART | event::TEMPERATURE_THRESHOLD << 8 | 2 << 16);
    let done = d.wait(0, Duration::from_secs(5)).unwrap();
    assert_eq!((u16::from(done.cid), done.status()), (set_cid, Status::SUCCESS));
    // The SMART log shows the warning, the temperature and the I/O done.
    assert_eq!(d.rw(1, true, 1, 0, 8, 512, &[DATA], 0).unwrap(), Status::SUCCESS);
    let smart = d.smart_log().unwrap();
    assert_eq!((smart.critical_warning, u16::from_le_bytes(smart.temperature)), (2, 313));
    assert_eq!(smart.host_reads[0], 1, "host read commands");
    // More AERs than AERL + 1 (4): the fifth is refused.
    for _ in 0..5 {
        let cid = d.cid();
        d.submit(0, &Sqe::new(admin_op::ASYNC_EVENT, cid)).unwrap();
    }
    let over = d.wait(0, Duration::from_secs(5)).unwrap();
    assert_eq!(over.status(), Status::AER_LIMIT);
}

#[test]
fn invalid_doorbells_are_reported_and_change_nothing() {
    let mut d = up(Rig::new(), 1);
    let cid = d.cid();
    d.submit(0, &Sqe::new(admin_op::ASYNC_EVENT, cid)).unwrap();
    std::thread::sleep(Duration::from_millis(20));
    // SQ 1 has 64 entries: a tail of 64 is invalid; queue 3 does not exist.
    d.t.write32(reg::DOORBELLS + 8, 64).unwrap();
    let event = d.wait(0, Duration::from_secs(5)).unwrap();
    assert_eq!(u32::from(event.dw0), event::TYPE_ERROR | event::INVALID_DOORBELL_VALUE << 8 | 1 << 16);
    d.t.write32(reg::DOORBELLS + 8 * 3, 1).unwrap();
    d.t.write32(reg::DOORBELLS + 0xff8, 1).unwrap();
    // Odd widths are refused.
    assert!(d.t.dev.region_write(0, reg::DOORBELLS + 8, &[1, 0]).is_err());
    assert!(d.t.dev.region_write(0, reg::DOORBELLS + 9, &[1, 0, 0, 0]).is_err());
    assert!(d.t.dev.region_write(0, reg::CC + 1, &[1, 0, 0, 0]).is_err());
    // The queues still work.
    assert_eq!(d.rw(1, true, 1, 0, 8, 512, &[DATA], 0).unwrap(), Status::SUCCESS);
}

#[test]
fn an_abort_finds_a_queued_command_and_sq_deletion_aborts_the_rest() {
    let mut d = up(Rig::new(), 0);
    // A CQ of 2 entries holds one completion: with the head never released, the worker
    // stalls on the second and the rest wait in the SQ.
    small_cq_behind_a_larger_sq(&mut d);
    d.io.push(driver::QueuePair {
        id: 1,
        entries: 8,
        sq_base: DATA + 0x1000,
        cq_base: DATA,
        sq_tail: 0,
        cq_head: 0,
        phase: true,
        vector: Some(1),
    });
    d.io[0].entries = 8;
    for cid in [0x10u16, 0x11, 0x12, 0x13] {
        let mut sqe = Driver::<Rig>::rw_command(true, 1, 0, 1, DATA + 0x8000, 0);
        sqe.cdw0 = (u32::from(nvm_op::READ) | u32::from(cid) << 16).into();
        d.push(1, &sqe).unwrap();
    }
    // The driver's CQ view has 8 entries but the device's has 2: read by hand.
    d.ring(1).unwrap();
    // Two commands completed (0x10 posted, 0x11 waiting for room): the worker fetches
    // nothing more until the host makes room, so 0x12 and 0x13 stay in the SQ.
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while d.t.dev.function().totals().commands < 2 {
        assert!(std::time::Instant::now() < deadline, "the worker never ran two commands");
        std::thread::yield_now();
    }
    let mut abort = Sqe::new(admin_op::ABORT, 0);
    abort.set_dw(10, 1 | 0x13 << 16);
    assert_eq!(d.admin_ok(abort).unwrap() & 1, 0, "0x13 waits in the SQ: aborted");
    abort.set_dw(10, 1 | 0x10 << 16);
    assert_eq!(d.admin_ok(abort).unwrap() & 1, 1, "0x10 is done");
    // Delete the SQ: 0x12 and 0x13 never ran; they complete as aborted once the CQ has room.
    let mut del = Sqe::new(admin_op::DELETE_SQ, 0);
    del.set_dw(10, 1);
    let cid = d.cid();
    del.cdw0 = (u32::from(admin_op::DELETE_SQ) | u32::from(cid) << 16).into();
    d.submit(0, &del).unwrap();
    // The queue leaves the controller's table once its worker was told to stop: from then on
    // it fetches nothing, and making room posts 0x11 and the aborts.
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while d.t.ctrl().live_queues() > 1 {
        assert!(std::time::Instant::now() < deadline, "the deletion never started");
        std::thread::yield_now();
    }
    let mut seen = Vec::new();
    let mut head = 0u32;
    let mut phase = true;
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while seen.len() < 4 && std::time::Instant::now() < deadline {
        let mut cqe = Cqe::default();
        d.t.get(DATA + u64::from(head) * 16, vm_memory::ByteValued::as_mut_slice(&mut cqe)).unwrap();
        if cqe.phase() == phase {
            seen.push((u16::from(cqe.cid), cqe.status()));
            head = (head + 1) % 2;
            if head == 0 {
                phase = !phase;
            }
            d.t.write32(reg::DOORBELLS + 12, head).unwrap();
        } else {
            std::thread::sleep(Duration::from_millis(1));
        }
    }
    assert_eq!(
        seen,
        [
            (0x10, Status::SUCCESS),
            (0x11, Status::SUCCESS),
            (0x12, Status::ABORTED_SQ_DELETION),
            (0x13, Status::ABORTED_SQ_DELETION)
        ]
    );
    assert_eq!(d.wait(0, Duration::from_secs(5)).unwrap().status(), Status::SUCCESS, "the delete");
}

#[test]
fn intx_follows_the_completion_queue() {
    let config = NvmeConfig { namespaces: vec![Some(Backing::Ram(1 << 20))], ..NvmeConfig::default() };
    let mut d = Driver::new(Rig::with(config, false));
    d.enable().unwrap();
    d.identify_controller().unwrap();
    // The driver released the entry: the line is down. The guest's EOI unmasks.
    assert!(!d.t.dev.irq_handle().intx_asserted());
    d.t.eoi();
    // An entry the host has not consumed keeps it up.
    let cid = d.cid();
    let mut get = Sqe::new(admin_op::GET_FEATURES, cid);
    get.set_dw(10, u32::from(feature::ARBITRATION));
    d.submit(0, &get).unwrap();
    assert_eq!(d.t.wait_interrupt(0, Duration::from_secs(5)), Some(true));
    assert!(d.t.dev.irq_handle().intx_asserted());
    d.poll_one(0).unwrap().unwrap();
    d.release(0).unwrap();
    assert!(!d.t.dev.irq_handle().intx_asserted());
}

#[test]
fn a_file_namespace_keeps_its_data_and_flush_reaches_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("disk.img");
    File::create(&path).unwrap().set_len(8 << 20).unwrap();
    let config = NvmeConfig {
        namespaces: vec![
            Some(Backing::File(path.clone(), Default::default())),
            None,
            Some(Backing::Ram(1 << 20)),
        ],
        lba_shift: 12,
        ..NvmeConfig::default()
    };
    let mut d = up(Rig::with(config.clone(), true), 1);
    let list = d.identify(cns::ACTIVE_NAMESPACES, 0).unwrap();
    assert_eq!(&list[..12], &[1, 0, 0, 0, 3, 0, 0, 0, 0, 0, 0, 0]);
    assert_eq!(u64::from(d.identify_namespace(2).unwrap().nsze), 0, "ns2 inactive: zeroes");
    let data = pattern(3 * 4096, 5);
    d.t.put(DATA, &data).unwrap();
    assert_eq!(
        d.rw(1, false, 1, 10, 3, 4096, &[DATA, DATA + 0x1000, DATA + 0x2000], 0).unwrap(),
        Status::SUCCESS
    );
    let mut flush = Sqe::new(nvm_op::FLUSH, 0);
    flush.nsid = 1.into();
    assert_eq!(d.io_command(1, flush).unwrap().status(), Status::SUCCESS);
    // Write Zeroes and Deallocate read back as zeroes.
    let mut wz = Sqe::new(nvm_op::WRITE_ZEROES, 0);
    wz.nsid = 1.into();
    wz.set_dw(10, 11);
    assert_eq!(d.io_command(1, wz).unwrap().status(), Status::SUCCESS);
    let on_disk = std::fs::read(&path).unwrap();
    assert_eq!(on_disk[40960..45056], data[..4096]);
    assert!(on_disk[45056..49152].iter().all(|&b| b == 0));
    assert_eq!(on_disk[49152..53248], data[8192..]);
    let range = DsmRange { attributes: 0.into(), nlb: 1.into(), slba: 12.into() };
    d.t.put(DATA + 0x9000, vm_memory::ByteValued::as_slice(&range)).unwrap();
    let mut dsm = Sqe::new(nvm_op::DSM, 0);
    dsm.nsid = 1.into();
    dsm.prp1 = (DATA + 0x9000).into();
    dsm.set_dw(11, 1 << 2);
    assert_eq!(d.io_command(1, dsm).unwrap().status(), Status::SUCCESS);
    let range = DsmRange { attributes: 0.into(), nlb: 1.into(), slba: (1 << 40).into() };
    d.t.put(DATA + 0x9000, vm_memory::ByteValued::as_slice(&range)).unwrap();
    assert_eq!(d.io_command(1, dsm).unwrap().status(), Status::LBA_OUT_OF_RANGE.dnr());
    assert!(std::fs::read(&path).unwrap()[49152..53248].iter().all(|&b| b == 0));
    d.t.dev.detach();
    drop(d);
    // A new device on the same file: the serial (and so the NGUID) and the data are the same.
    let mut again = up(Rig::with(config, true), 1);
    assert_eq!(again.rw(1, true, 1, 10, 1, 4096, &[DATA + 0x10_0000], 0).unwrap(), Status::SUCCESS);
    let mut got = vec![0u8; 4096];
    again.t.get(DATA + 0x10_0000, &mut got).unwrap();
    assert_eq!(got, data[..4096]);
}

#[test]
fn with_bus_mastering_off_commands_wait_and_go_on_when_it_is_back() {
    let mut d = up(Rig::new(), 1);
    let off = u64::from(COMMAND_MEMORY);
    d.t.dev.region_write(CONFIG, COMMAND as u64, &off.to_le_bytes()[..2]).unwrap();
    let calls = d.t.dma.stats().pin_calls;
    d.t.put(DATA, &[0x5a; 4096]).unwrap();
    let sqe = Driver::<Rig>::rw_command(false, 1, 0, 8, DATA, 0);
    d.submit(1, &sqe).unwrap();
    std::thread::sleep(Duration::from_millis(100));
    assert!(d.poll_one(1).unwrap().is_none(), "nothing completes while bus mastering is off");
    assert_eq!(d.t.dma.stats().pin_calls, calls, "nothing pinned");
    let on = u64::from(COMMAND_MEMORY | COMMAND_MASTER);
    d.t.dev.region_write(CONFIG, COMMAND as u64, &on.to_le_bytes()[..2]).unwrap();
    let cqe = d.wait(1, Duration::from_secs(5)).unwrap();
    assert_eq!(cqe.status(), Status::SUCCESS);
    assert_eq!(d.rw(1, true, 1, 0, 8, 512, &[DATA + 0x1000], 0).unwrap(), Status::SUCCESS);
    let mut back = [0u8; 4096];
    d.t.get(DATA + 0x1000, &mut back).unwrap();
    assert_eq!(back, [0x5a; 4096]);
}

/// Doorbell Buffer Config's pages are guest memory: with bus mastering off the controller
/// writes no event index (and reads no shadow tail) even when a doorbell register wakes a
/// queue's worker; once it is back, the queue serves as before.
#[test]
fn with_bus_mastering_off_the_shadow_doorbell_pages_are_left_alone() {
    let mut d = up(Rig::new(), 1);
    d.enable_shadow_doorbells().unwrap();
    assert_eq!(d.rw(1, false, 1, 0, 8, 512, &[DATA], 0).unwrap(), Status::SUCCESS);
    let off = u64::from(COMMAND_MEMORY);
    d.t.dev.region_write(CONFIG, COMMAND as u64, &off.to_le_bytes()[..2]).unwrap();
    // A sentinel in SQ 1's event index; then the host rings SQ 1's register with its tail
    // unchanged: the worker wakes, finds nothing and sleeps again, which would set the index.
    d.t.put(driver::EVENTIDX + 8, &[0xa5; 4]).unwrap();
    let mut tail = [0u8; 4];
    d.t.get(driver::SHADOW + 8, &mut tail).unwrap();
    d.t.write32(reg::DOORBELLS + 8, u32::from_le_bytes(tail)).unwrap();
    std::thread::sleep(Duration::from_millis(100));
    let mut event = [0u8; 4];
    d.t.get(driver::EVENTIDX + 8, &mut event).unwrap();
    assert_eq!(event, [0xa5; 4], "an event index written with bus mastering off");

    let on = u64::from(COMMAND_MEMORY | COMMAND_MASTER);
    d.t.dev.region_write(CONFIG, COMMAND as u64, &on.to_le_bytes()[..2]).unwrap();
    assert_eq!(d.rw(1, true, 1, 0, 8, 512, &[DATA + 0x1000], 0).unwrap(), Status::SUCCESS);
}

#[test]
fn compare_matches_the_blocks_and_the_effects_log_is_served() {
    let mut d = up(Rig::new(), 1);
    let data = pattern(8192, 11);
    d.t.put(DATA, &data).unwrap();
    assert_eq!(d.rw(1, false, 1, 40, 16, 512, &[DATA, DATA + 0x1000], 0).unwrap(), Status::SUCCESS);
    let compare = |d: &mut Driver<Rig>, prp1: u64, prp2: u64| {
        let mut sqe = Driver::<Rig>::rw_command(true, 1, 40, 16, prp1, prp2);
        sqe.cdw0 = u32::from(nvm_op::COMPARE).into();
        d.io_command(1, sqe).unwrap().status()
    };
    assert_eq!(compare(&mut d, DATA, DATA + 0x1000), Status::SUCCESS);
    // One byte differs in the second page.
    d.t.put(DATA + 0x1000 + 77, &[data[0x1000 + 77] ^ 1]).unwrap();
    assert_eq!(compare(&mut d, DATA, DATA + 0x1000), Status::COMPARE_FAILURE);
    // The failure is in the error log with its LBA, as a Read's would be.
    let entry = d.error_log(1).unwrap()[0];
    assert_eq!((u16::from(entry.status) >> 1, u64::from(entry.lba)), (Status::COMPARE_FAILURE.0, 40));
    assert_eq!(compare(&mut d, 1 << 40, 0), Status::DATA_TRANSFER_ERROR);
    // The two that read their data count as host reads in SMART (NVMe 1.3 §5.14.1.2), as
    // compares in the statistics; the one that reached no data counts in neither.
    let totals = d.t.dev.function().totals();
    assert_eq!((totals.compares, totals.bytes_compared, totals.reads), (2, 2 * 8192, 0));
    let smart = d.smart_log().unwrap();
    let count = u128::from_le_bytes;
    assert_eq!(
        (count(smart.data_units_read), count(smart.host_reads)),
        (1, 2),
        "data units read (32 blocks, rounded up), host reads"
    );
    // Get Log Page 05h: Read is supported, Write changes logical block content.
    let mut log = Sqe::new(admin_op::GET_LOG_PAGE, 0);
    log.set_dw(10, u32::from(log_page::COMMAND_EFFECTS) | (4096 / 4 - 1) << 16);
    log.prp1 = (DATA + 0x9000).into();
    d.admin_ok(log).unwrap();
    let mut page = vec![0u8; 4096];
    d.t.get(DATA + 0x9000, &mut page).unwrap();
    let dword = |at: usize| u32::from_le_bytes(page[at * 4..at * 4 + 4].try_into().unwrap());
    assert_eq!(dword(usize::from(admin_op::IDENTIFY)), effects::CSUPP);
    assert_eq!(dword(256 + usize::from(nvm_op::READ)), effects::CSUPP);
    assert_eq!(dword(256 + usize::from(nvm_op::WRITE)), effects::CSUPP | effects::LBCC);
    assert_eq!(dword(256 + 0x7f), 0);
}

/// I/O queue pair 1: a CQ of 2 entries (one usable) at `DATA` on vector 1, behind an SQ of 8
/// at `DATA + 0x1000`.
fn small_cq_behind_a_larger_sq(d: &mut Driver<Rig>) {
    let mut cq = Sqe::new(admin_op::CREATE_CQ, 0);
    cq.prp1 = DATA.into();
    cq.set_dw(10, 1 | 1 << 16);
    cq.set_dw(11, 3 | 1 << 16);
    d.admin_ok(cq).unwrap();
    let mut sq = Sqe::new(admin_op::CREATE_SQ, 0);
    sq.prp1 = (DATA + 0x1000).into();
    sq.set_dw(10, 1 | 7 << 16);
    sq.set_dw(11, 1 | 1 << 16);
    d.admin_ok(sq).unwrap();
}

#[test]
fn a_queue_deleted_with_its_cq_full_and_never_reaped_still_stops_its_worker() {
    let mut d = up(Rig::new(), 0);
    // A CQ of 2 entries the host never releases: one completion fits, the next waits.
    small_cq_behind_a_larger_sq(&mut d);
    for slot in 0..4u64 {
        let sqe = Driver::<Rig>::rw_command(true, 1, 0, 1, DATA + 0x8000, 0);
        d.t.put(DATA + 0x1000 + slot * 64, vm_memory::ByteValued::as_slice(&sqe)).unwrap();
    }
    d.t.write32(reg::DOORBELLS + 8, 4).unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while d.t.dev.function().totals().commands < 2 {
        assert!(std::time::Instant::now() < deadline, "the worker never ran two commands");
        std::thread::yield_now();
    }
    assert_eq!(d.t.ctrl().workers(), 2);
    // The deletion completes, and when it has, the queue's worker is gone: it gave up on the
    // completions the host would not make room for rather than outlive the deletion.
    let mut del = Sqe::new(admin_op::DELETE_SQ, 0);
    del.set_dw(10, 1);
    assert_eq!(d.admin_command(del).unwrap().status(), Status::SUCCESS);
    assert_eq!(d.t.ctrl().workers(), 1, "only the admin worker is left");
    d.identify_controller().unwrap();
}

#[test]
fn a_full_cq_raises_the_interrupt_of_the_entries_it_holds() {
    let mut d = up(Rig::new(), 0);
    small_cq_behind_a_larger_sq(&mut d);
    // Three reads behind one doorbell: the first's entry is held to share an interrupt with
    // the next two, which find the CQ full. The host reaps only what an interrupt tells it of.
    for slot in 0..3u16 {
        let mut sqe = Driver::<Rig>::rw_command(true, 1, 0, 1, DATA + 0x8000, 0);
        sqe.cdw0 = ((u32::from(sqe.cdw0) & 0xffff) | u32::from(slot + 1) << 16).into();
        d.t.put(DATA + 0x1000 + u64::from(slot) * 64, vm_memory::ByteValued::as_slice(&sqe)).unwrap();
    }
    d.t.write32(reg::DOORBELLS + 8, 3).unwrap();
    let (mut head, mut phase, mut got) = (0u32, true, Vec::new());
    while got.len() < 3 {
        let fired = d.t.wait_interrupt(1, Duration::from_secs(30));
        assert_eq!(fired, Some(true), "no interrupt after completions {got:?}");
        let _ = d.t.irqs[1].read();
        loop {
            let mut cqe = Cqe::default();
            d.t.get(DATA + u64::from(head) * 16, vm_memory::ByteValued::as_mut_slice(&mut cqe)).unwrap();
            if cqe.phase() != phase {
                break;
            }
            assert_eq!(cqe.status(), Status::SUCCESS);
            got.push(u16::from(cqe.cid));
            head = (head + 1) % 2;
            phase ^= head == 0;
        }
        d.t.write32(reg::DOORBELLS + 12, head).unwrap();
    }
    assert_eq!(got, [1, 2, 3]);
}

/// The state of this process's thread named `name` (`R`, `S`, ...), if there is one.
fn thread_state(name: &str) -> Option<char> {
    std::fs::read_dir("/proc/self/task").ok()?.flatten().find_map(|task| {
        let comm = std::fs::read_to_string(task.path().join("comm")).ok()?;
        if comm.trim_end() != name {
            return None;
        }
        let stat = std::fs::read_to_string(task.path().join("stat")).ok()?;
        stat.rsplit_once(") ")?.1.chars().next()
    })
}

#[test]
fn a_shadow_sq_tail_past_the_end_aborts_nothing_and_the_worker_sleeps_until_it_changes() {
    // Six queues: no other test here has a thread of this name (`umdev-nvme-q6`).
    let config =
        NvmeConfig { namespaces: vec![Some(Backing::Ram(1 << 20))], io_queues: 6, ..NvmeConfig::default() };
    let mut d = up(Rig::with(config, true), 6);
    d.enable_shadow_doorbells().unwrap();
    // SQ 6's tail in the shadow page is past the queue's end; the register rings its worker.
    d.t.put(driver::SHADOW + 6 * 8, &u32::MAX.to_le_bytes()).unwrap();
    d.t.write32(reg::DOORBELLS + 6 * 8, 0).unwrap();
    // An Abort for that queue finds nothing queued, and completes.
    let mut abort = Sqe::new(admin_op::ABORT, 0);
    abort.set_dw(10, 6 | 0x99 << 16);
    assert_eq!(d.admin_ok(abort).unwrap() & 1, 1, "not aborted");
    // The worker sleeps rather than read the same tail as news at every look: seen asleep at
    // least once (a thread that never sleeps is never in state S).
    let asleep = (0..2000).any(|_| {
        std::thread::sleep(Duration::from_millis(1));
        thread_state("umdev-nvme-q6") == Some('S')
    });
    assert!(asleep, "the worker of SQ 6 never slept: {:?}", thread_state("umdev-nvme-q6"));
    // A valid tail again, and the queue works.
    d.t.put(driver::SHADOW + 6 * 8, &0u32.to_le_bytes()).unwrap();
    assert_eq!(d.rw(6, true, 1, 0, 8, 512, &[DATA], 0).unwrap(), Status::SUCCESS);
}

#[test]
fn shadow_doorbells_carry_the_queues_and_the_registers_ring_only_when_asked() {
    let mut d = up(Rig::new(), 2);
    assert_eq!(
        u16::from(d.identify_controller().unwrap().oacs) & 1 << 8,
        1 << 8,
        "OACS: Doorbell Buffer Config"
    );
    // One command on queue 1 through the registers first: its tail is 1.
    assert_eq!(d.rw(1, true, 1, 0, 8, 512, &[DATA], 0).unwrap(), Status::SUCCESS);
    let (shadow, eventidx) = (DATA + 0x20_0000, DATA + 0x20_1000);
    // Stale values, as a driver reusing its buffers after a reset leaves them.
    d.t.put(shadow, &[0x77; 4096]).unwrap();
    let config = |prp1: u64, prp2: u64| {
        let mut sqe = Sqe::new(admin_op::DOORBELL_BUFFER_CONFIG, 0);
        sqe.prp1 = prp1.into();
        sqe.prp2 = prp2.into();
        sqe
    };
    for (a, b) in [(shadow + 8, eventidx), (shadow, shadow), (shadow, eventidx + 0x800)] {
        assert_eq!(d.admin_command(config(a, b)).unwrap().status(), Status::INVALID_FIELD.dnr());
    }
    assert_eq!(d.admin_command(config(1 << 40, eventidx)).unwrap().status(), Status::DATA_TRANSFER_ERROR);
    assert_eq!(d.admin_command(config(shadow, eventidx)).unwrap().status(), Status::SUCCESS);
    let dword = |d: &mut Driver<Rig>, at: u64| {
        let mut b = [0u8; 4];
        d.t.get(at, &mut b).unwrap();
        u32::from_le_bytes(b)
    };
    assert_eq!((dword(&mut d, shadow + 8), dword(&mut d, shadow + 12)), (1, 1), "SQ 1 tail, CQ 1 head");
    assert_eq!((dword(&mut d, shadow + 16), dword(&mut d, shadow + 20)), (0, 0), "queue 2");
    assert_eq!(dword(&mut d, eventidx + 12), u32::MAX, "no CQ head register writes wanted");
    assert!(d.t.dev.describe()["shadow_doorbells"].as_bool().unwrap());
    // From here the driver writes the doorbells as Linux's does (drivers/nvme/host/pci.c),
    // through pages of its own (a second configuration replaces the first), polling for
    // completions.
    d.enable_shadow_doorbells().unwrap();
    d.poll = true;
    let data = pattern(4096, 3);
    d.t.put(DATA, &data).unwrap();
    // The SQ tail register writes of a ring, counted apart from the CQ head ones: a CQ head's
    // "never" still rings at a wrap of the u16 arithmetic, as on real hardware.
    let ring = |d: &mut Driver<Rig>, qid: u16| {
        let before = d.doorbells.written;
        d.ring(qid).unwrap();
        d.doorbells.written - before
    };
    // Queue depth 1: each command may need a register write (the worker sleeps between),
    // never more than one, and none is lost.
    let (mut sent, mut rings) = (0, 0);
    for i in 0..200u64 {
        let cid = d.cid();
        let mut sqe = Driver::<Rig>::rw_command(false, 1, i * 8, 8, DATA, 0);
        sqe.cdw0 = ((u32::from(sqe.cdw0) & 0xffff) | u32::from(cid) << 16).into();
        d.push(1, &sqe).unwrap();
        rings += ring(&mut d, 1);
        sent += 1;
        let cqe = d.wait(1, Duration::from_secs(60)).unwrap();
        assert_eq!((u16::from(cqe.cid), cqe.status()), (cid, Status::SUCCESS));
    }
    assert!(rings <= sent, "{rings} SQ register writes for {sent} commands");
    // A batch of 32 on queue 2: one tail update, at most one register write; the worker takes
    // them all.
    for i in 0..32u64 {
        d.push(2, &Driver::<Rig>::rw_command(false, 1, 4096 + i * 8, 8, DATA, 0)).unwrap();
    }
    assert!(ring(&mut d, 2) <= 1);
    let spared = d.doorbells.spared;
    for _ in 0..32 {
        assert_eq!(d.wait(2, Duration::from_secs(60)).unwrap().status(), Status::SUCCESS);
    }
    assert!(d.doorbells.spared > spared, "CQ head updates the controller did not ask to hear of");
    // A second configuration, after tails the registers never heard of: the controller hands
    // over the tails and heads it works from, not the registers' (from a stale tail the
    // worker would fetch old entries again), and the queues go on.
    d.enable_shadow_doorbells().unwrap();
    for q in [1u16, 2] {
        let (tail, head) = (d.io[usize::from(q) - 1].sq_tail, d.io[usize::from(q) - 1].cq_head);
        let at = driver::SHADOW + u64::from(q) * 8;
        assert_eq!(
            (dword(&mut d, at), dword(&mut d, at + 4)),
            (tail, head),
            "queue {q} after a second config"
        );
    }
    for q in [1u16, 2] {
        assert_eq!(d.rw(q, true, 1, 0, 8, 512, &[DATA], 0).unwrap(), Status::SUCCESS);
    }
    for q in [1u16, 2] {
        assert!(d.poll_one(q).unwrap().is_none(), "queue {q}: a completion of an entry run again");
    }
    let mut back = vec![0u8; 4096];
    // A disable turns it off; after it, registers alone work again.
    d.t.write32(reg::CC, 0).unwrap();
    assert!(!d.t.dev.describe()["shadow_doorbells"].as_bool().unwrap());
    d.enable().unwrap();
    d.create_io_queues(1, 64, false).unwrap();
    assert_eq!(d.rw(1, true, 1, 4096 + 31 * 8, 8, 512, &[DATA + 0x3000], 0).unwrap(), Status::SUCCESS);
    d.t.get(DATA + 0x3000, &mut back).unwrap();
    assert!(back == data, "the batch's data read back differs");
}

#[test]
fn a_backing_file_truncated_under_the_guest_fails_the_reads_past_its_end_and_nothing_else() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("disk.img");
    File::create(&path).unwrap().set_len(8 << 20).unwrap();
    let config = NvmeConfig {
        namespaces: vec![Some(Backing::File(path.clone(), Default::default()))],
        ..NvmeConfig::default()
    };
    let mut d = up(Rig::with(config, true), 1);
    d.t.put(DATA, &pattern(4096, 1)).unwrap();
    assert_eq!(d.rw(1, false, 1, 0, 8, 512, &[DATA], 0).unwrap(), Status::SUCCESS);
    // The host's administrator (or a bug) cuts the file to 4 MiB while the guest uses it.
    std::fs::OpenOptions::new().write(true).open(&path).unwrap().set_len(4 << 20).unwrap();
    let past = (6u64 << 20) / 512;
    let before = d.t.dev.function().totals().commands;
    assert_eq!(d.rw(1, true, 1, past, 8, 512, &[DATA + 0x1000], 0).unwrap(), Status::UNRECOVERED_READ_ERROR);
    // The failure is in the error log with its LBA; the blocks before the cut still read,
    // and every command got exactly one completion.
    let entry = d.error_log(1).unwrap()[0];
    assert_eq!(
        (u16::from(entry.status) >> 1, u64::from(entry.lba)),
        (Status::UNRECOVERED_READ_ERROR.0, past)
    );
    assert_eq!(d.rw(1, true, 1, 0, 8, 512, &[DATA + 0x2000], 0).unwrap(), Status::SUCCESS);
    let mut back = vec![0u8; 4096];
    d.t.get(DATA + 0x2000, &mut back).unwrap();
    assert!(back == pattern(4096, 1));
    assert_eq!(d.t.dev.function().totals().commands, before + 2);
    assert!(d.poll_one(1).unwrap().is_none(), "no completion posted twice");
}

/// A small tmpfs mounted for a test (root only), unmounted on drop.
struct SmallFs(tempfile::TempDir);

impl SmallFs {
    fn mount(bytes: u64) -> Option<SmallFs> {
        let dir = tempfile::tempdir().ok()?;
        let ok = std::process::Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={bytes}"), "umdev-test"])
            .arg(dir.path())
            .stderr(std::process::Stdio::null())
            .status()
            .is_ok_and(|s| s.success());
        ok.then_some(SmallFs(dir))
    }
}

impl Drop for SmallFs {
    fn drop(&mut self) {
        // Lazily: a queue worker of the device may still hold the file open for a moment.
        let _ = std::process::Command::new("umount").arg("--lazy").arg(self.0.path()).status();
    }
}

#[test]
fn a_sparse_file_on_a_full_filesystem_fails_writes_with_capacity_exceeded_and_nothing_else() {
    let Some(fs) = SmallFs::mount(1 << 20) else {
        eprintln!("skipped: mounting a 1 MiB tmpfs needs root");
        return;
    };
    let path = fs.0.path().join("disk.img");
    File::create(&path).unwrap().set_len(8 << 20).unwrap(); // sparse: 8 MiB on 1 MiB of room
    let config = NvmeConfig {
        namespaces: vec![Some(Backing::File(path, Default::default()))],
        ..NvmeConfig::default()
    };
    let mut d = up(Rig::with(config, true), 1);
    d.t.put(DATA, &pattern(64 << 10, 4)).unwrap();
    let pages: Vec<u64> = (0..16).map(|i| DATA + i * 0x1000).collect();
    let mut statuses = Vec::new();
    for i in 0..32u64 {
        statuses.push(d.rw(1, false, 1, i * 128, 128, 512, &pages, 0).unwrap());
    }
    let ok = statuses.iter().filter(|s| **s == Status::SUCCESS).count();
    let full = statuses.iter().filter(|s| **s == Status::CAPACITY_EXCEEDED).count();
    assert!(ok >= 1 && full >= 1 && ok + full == 32, "{statuses:?}");
    // What was written reads back; the queue goes on; the error log has the failures.
    assert_eq!(d.rw(1, true, 1, 0, 8, 512, &[DATA + 0x40_0000], 0).unwrap(), Status::SUCCESS);
    let mut back = vec![0u8; 4096];
    d.t.get(DATA + 0x40_0000, &mut back).unwrap();
    assert!(back == pattern(64 << 10, 4)[..4096]);
    let entry = d.error_log(1).unwrap()[0];
    assert_eq!(u16::from(entry.status) >> 1, Status::CAPACITY_EXCEEDED.0);
}

/// The process's kernel-pinned memory (`VmPin`, where io_uring charges registered buffers),
/// in pages. Only this test of this binary pins in kernel mode.
fn vm_pin_pages() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let kb = status.lines().find_map(|l| l.strip_prefix("VmPin:")).unwrap();
    kb.trim().trim_end_matches("kB").trim().parse::<u64>().unwrap() / 4
}

#[test]
fn in_kernel_pin_mode_o_direct_transfers_move_through_the_pinned_runs_as_fixed_buffers() {
    use umdev_pinning::{DmaSpace, DmaSpaceConfig, PinMode};
    let dma = match DmaSpace::try_new(DmaSpaceConfig { mode: PinMode::Kernel, ..Default::default() }) {
        Ok(dma) => dma,
        Err(e) => return eprintln!("SKIPPED: kernel pin mode cannot start here: {e}"),
    };
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("disk.img");
    File::create(&path).unwrap().set_len(8 << 20).unwrap();
    let config = NvmeConfig {
        namespaces: vec![Some(Backing::File(path.clone(), umdev_devices::store::Cache::None))],
        lba_shift: 12,
        // Every size: the default leaves transfers under 64 KiB plain (checked at the end).
        fixed_buffers: FixedBuffers::Always,
        ..NvmeConfig::default()
    };
    let mut d = up(Rig::with_dma(config.clone(), true, dma), 1);
    let before = d.t.dev.function().totals();
    // One page, four contiguous pages (each one run: one registered buffer), and two pages
    // apart (two runs: no single buffer holds them, so a plain transfer).
    let one = pattern(4096, 11);
    let four = pattern(4 * 4096, 12);
    let two = pattern(2 * 4096, 13);
    d.t.put(DATA, &one).unwrap();
    d.t.put(DATA + 0x10000, &four).unwrap();
    d.t.put(DATA + 0x20000, &two[..4096]).unwrap();
    d.t.put(DATA + 0x22000, &two[4096..]).unwrap();
    let contiguous: Vec<u64> = (0..4).map(|i| DATA + 0x10000 + i * 0x1000).collect();
    let apart = [DATA + 0x20000, DATA + 0x22000];
    assert_eq!(d.rw(1, false, 1, 3, 1, 4096, &[DATA], 0).unwrap(), Status::SUCCESS);
    assert_eq!(d.rw(1, false, 1, 10, 4, 4096, &contiguous, 0).unwrap(), Status::SUCCESS);
    assert_eq!(d.rw(1, false, 1, 20, 2, 4096, &apart, 0).unwrap(), Status::SUCCESS);
    let back: Vec<u64> = (0..4).map(|i| DATA + 0x40000 + i * 0x1000).collect();
    let mut got = vec![0u8; 4 * 4096];
    assert_eq!(d.rw(1, true, 1, 3, 1, 4096, &back[..1], 0).unwrap(), Status::SUCCESS);
    d.t.get(DATA + 0x40000, &mut got[..4096]).unwrap();
    assert!(got[..4096] == one[..], "one page read back");
    assert_eq!(d.rw(1, true, 1, 10, 4, 4096, &back, 0).unwrap(), Status::SUCCESS);
    d.t.get(DATA + 0x40000, &mut got).unwrap();
    assert!(got == four, "four pages read back");
    assert_eq!(d.rw(1, true, 1, 20, 2, 4096, &[DATA + 0x50000, DATA + 0x52000], 0).unwrap(), Status::SUCCESS);
    d.t.get(DATA + 0x50000, &mut got[..4096]).unwrap();
    d.t.get(DATA + 0x52000, &mut got[4096..8192]).unwrap();
    assert!(got[..8192] == two[..], "two runs read back");
    let on_disk = std::fs::read(&path).unwrap();
    assert!(on_disk[3 * 4096..4 * 4096] == one[..] && on_disk[10 * 4096..14 * 4096] == four[..]);
    assert!(on_disk[20 * 4096..22 * 4096] == two[..]);
    // The one-run transfers went as fixed buffers, the two-run ones did not.
    let after = d.t.dev.function().totals();
    assert_eq!((after.reads - before.reads, after.writes - before.writes), (3, 3));
    assert_eq!(after.fixed_transfers - before.fixed_transfers, 4);
    // The worker's clones are gone with the commands: what the kernel holds pinned is what
    // the engine holds (the queues' rings), no more.
    let held = d.t.dma.stats().kernel_pages_held;
    assert!(held > 0, "the rings are pinned");
    assert_eq!(vm_pin_pages(), held);
    d.t.write32(reg::CC, 0).unwrap();
    assert_eq!((d.t.dma.stats().kernel_pages_held, vm_pin_pages()), (0, 0));
    d.t.dev.detach();
    drop(d);

    // By default only a transfer of 64 KiB or more goes fixed.
    let dma = DmaSpace::try_new(DmaSpaceConfig { mode: PinMode::Kernel, ..Default::default() }).unwrap();
    let config = NvmeConfig { fixed_buffers: FixedBuffers::default(), ..config };
    let mut d = up(Rig::with_dma(config, true, dma), 1);
    let sixteen: Vec<u64> = (0..16).map(|i| DATA + 0x100000 + i * 0x1000).collect();
    d.t.put(DATA + 0x100000, &pattern(64 << 10, 14)).unwrap();
    assert_eq!(d.rw(1, false, 1, 100, 16, 4096, &sixteen, 0).unwrap(), Status::SUCCESS);
    assert_eq!(d.rw(1, false, 1, 3, 1, 4096, &[DATA], 0).unwrap(), Status::SUCCESS);
    assert_eq!(d.rw(1, true, 1, 100, 16, 4096, &sixteen, 0).unwrap(), Status::SUCCESS);
    let mut got = vec![0u8; 64 << 10];
    d.t.get(DATA + 0x100000, &mut got).unwrap();
    assert!(got == pattern(64 << 10, 14));
    assert_eq!(d.t.dev.function().totals().fixed_transfers, 2, "the two 64 KiB transfers, not the 4 KiB one");
}

#[test]
fn admin_queues_may_be_longer_than_the_io_queues_mqes_bounds() {
    // MQES bounds the I/O queues only (NVMe 1.3 §3.1.8): Linux and SPDK ask for 32-entry admin
    // queues whatever it is.
    let config = NvmeConfig {
        namespaces: vec![Some(Backing::Ram(1 << 20))],
        max_entries: 16,
        ..NvmeConfig::default()
    };
    let mut d = Driver::new(Rig::with(config, true));
    d.enable().unwrap();
    assert_eq!(d.admin.entries, 32);
    assert_eq!(d.t.read32(reg::CAP).unwrap() & 0xffff, 15, "MQES");
    d.identify_controller().unwrap();
    d.create_io_queues(1, 16, false).unwrap();
    assert_eq!(d.rw(1, true, 1, 0, 8, 512, &[DATA], 0).unwrap(), Status::SUCCESS);
}

#[test]
fn a_cq_head_past_the_end_in_the_shadow_page_frees_no_entry() {
    let mut d = up(Rig::new(), 0);
    d.create_io_queues(1, 4, false).unwrap();
    d.enable_shadow_doorbells().unwrap();
    d.poll = true;
    let read = |cid: u16| {
        let mut sqe = Driver::<Rig>::rw_command(true, 1, 0, 8, DATA, 0);
        sqe.cdw0 = ((u32::from(sqe.cdw0) & 0xffff) | u32::from(cid) << 16).into();
        sqe
    };
    let cq_base = d.io[0].cq_base;
    let cid_at = |d: &mut Driver<Rig>, slot: u64| {
        let mut cqe = Cqe::default();
        d.t.get(cq_base + slot * 16, vm_memory::ByteValued::as_mut_slice(&mut cqe)).unwrap();
        u16::from(cqe.cid)
    };
    // Three completions fill the 4-entry CQ (one slot stays free); none is consumed.
    for cid in 1..=3 {
        d.submit(1, &read(cid)).unwrap();
        let deadline = std::time::Instant::now() + Duration::from_secs(60);
        while cid_at(&mut d, u64::from(cid) - 1) != cid {
            assert!(std::time::Instant::now() < deadline, "completion {cid}");
            std::thread::yield_now();
        }
    }
    // The host's CQ head in the shadow page says 100: out of range, it frees nothing, and
    // two more commands wait rather than overwrite the three.
    d.t.put(driver::SHADOW + 12, &100u32.to_le_bytes()).unwrap();
    for cid in 4..=5 {
        d.submit(1, &read(cid)).unwrap();
    }
    // Once the first has run (counted as it completes, just before it is posted or waits
    // for room; the second is fetched only once it is out), nothing of theirs is in the CQ.
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while d.t.dev.describe()["io"]["commands"].as_u64() < Some(4) {
        assert!(std::time::Instant::now() < deadline, "the command never ran");
        std::thread::yield_now();
    }
    std::thread::sleep(Duration::from_millis(20)); // what was counted is posted by now, if it can be
    assert_eq!([cid_at(&mut d, 0), cid_at(&mut d, 1), cid_at(&mut d, 2), cid_at(&mut d, 3)], [1, 2, 3, 0]);
    // Consumed with a valid head, the rest complete.
    let mut got = Vec::new();
    while got.len() < 5 {
        got.push(u16::from(d.wait(1, Duration::from_secs(60)).unwrap().cid));
    }
    assert_eq!(got, [1, 2, 3, 4, 5]);
}

#[test]
fn the_statistics_show_what_applies() {
    // The defaults: doorbells=auto, a RAM namespace.
    let d = up(Rig::new(), 1);
    let stats = d.t.dev.describe();
    // RAM only: no file data moves, so no aio mode or fixed buffers apply.
    assert!(stats["aio"].is_null() && stats["fixed_buffers"].is_null(), "{stats}");
    // doorbells=auto: no mode until a client says hello.
    assert!(stats["doorbells_now"].is_null(), "{stats}");
    d.t.dev.client_version(&umdev_mdev::ClientHello { minor: 0, capabilities: true });
    assert_eq!(d.t.dev.describe()["doorbells_now"], "message");
}

/// The client cuts its memory (shrinks the memfd) under a file namespace: the host's own read
/// into the lost pages, or its write from them, fails with EFAULT, and that is the guest's
/// memory failing, not the backing: Data Transfer Error, in either aio mode and either cache
/// mode, with nothing written to the file. No signal comes of it (the kernel's own copy
/// faulted, not this process), so the engine's poisoned flag does not see it: the status
/// rests on the errno alone. Once the memory is back the controller goes on.
#[test]
fn file_transfers_with_memory_the_client_cut_end_as_data_transfer_errors() {
    use umdev_devices::store::Cache;
    for aio in [AioMode::Sync, AioMode::IoUring] {
        for cache in [Cache::Writeback, Cache::None] {
            let what = format!("aio {aio:?}, cache {cache:?}");
            let dir = tempfile::tempdir().unwrap();
            let path = dir.path().join("disk.img");
            File::create(&path).unwrap().set_len(1 << 20).unwrap();
            let config = NvmeConfig {
                namespaces: vec![Some(Backing::File(path.clone(), cache))],
                lba_shift: 12,
                aio,
                ..NvmeConfig::default()
            };
            let mut d = up(Rig::with(config, true), 1);
            d.t.put(DATA, &pattern(4096, 7)).unwrap();
            assert_eq!(d.rw(1, false, 1, 0, 1, 4096, &[DATA], 0).unwrap(), Status::SUCCESS, "{what}");
            // The rings stay below the cut; the data pages are past it.
            d.t.ram.set_len(DATA).unwrap();
            assert_eq!(
                d.rw(1, true, 1, 0, 1, 4096, &[DATA + 0x1000], 0).unwrap(),
                Status::DATA_TRANSFER_ERROR,
                "{what}: read"
            );
            assert_eq!(
                d.rw(1, false, 1, 1, 1, 4096, &[DATA + 0x1000], 0).unwrap(),
                Status::DATA_TRANSFER_ERROR,
                "{what}: write"
            );
            assert_eq!(d.t.dma.stats().poisoned_mappings, 0, "{what}: no fault of this process's own");
            assert!(std::fs::read(&path).unwrap()[4096..8192].iter().all(|&b| b == 0), "{what}");
            d.t.ram.set_len(RAM_SIZE).unwrap();
            assert_eq!(d.rw(1, true, 1, 0, 1, 4096, &[DATA + 0x2000], 0).unwrap(), Status::SUCCESS, "{what}");
            let mut back = vec![0u8; 4096];
            d.t.get(DATA + 0x2000, &mut back).unwrap();
            assert!(back == pattern(4096, 7), "{what}");
            assert!(d.poll_one(1).unwrap().is_none(), "{what}: no completion posted twice");
        }
    }
}

/// Makes io_uring_setup(2) fail with ENOSYS on this thread and the threads it starts from
/// now on, as a kernel without io_uring or a container's seccomp filter would; the rest of
/// the process keeps it (no `SECCOMP_FILTER_FLAG_TSYNC`). False where the filter cannot be
/// installed.
fn deny_io_uring_on_this_thread() -> bool {
    use libc::{sock_filter, sock_fprog, BPF_ABS, BPF_JEQ, BPF_JMP, BPF_K, BPF_LD, BPF_RET, BPF_W};
    let stmt = |code: u32, k: u32| sock_filter { code: code as u16, jt: 0, jf: 0, k };
    let filter = [
        // The syscall's number (offset 0 of struct seccomp_data); io_uring_setup is 425 on
        // every architecture.
        stmt(BPF_LD | BPF_W | BPF_ABS, 0),
        sock_filter {
            code: (BPF_JMP | BPF_JEQ | BPF_K) as u16,
            jt: 0,
            jf: 1,
            k: libc::SYS_io_uring_setup as u32,
        },
        stmt(BPF_RET | BPF_K, libc::SECCOMP_RET_ERRNO | libc::ENOSYS as u32),
        stmt(BPF_RET | BPF_K, libc::SECCOMP_RET_ALLOW),
    ];
    let prog = sock_fprog { len: filter.len() as u16, filter: filter.as_ptr().cast_mut() };
    // SAFETY: both calls take plain integers and, for the second, a pointer to `prog`, which
    // with the `filter` it points to outlives the call (the kernel copies the program); they
    // change this thread's own attributes only.
    unsafe {
        libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) == 0
            && libc::prctl(libc::PR_SET_SECCOMP, libc::SECCOMP_MODE_FILTER, &prog as *const sock_fprog) == 0
    }
}

/// Where io_uring cannot be had, a controller asked for it serves its file namespaces
/// synchronously, says so in its statistics, and moves no transfer as a fixed buffer (they
/// are io_uring's).
#[test]
fn without_io_uring_file_namespaces_are_served_synchronously_and_nothing_goes_fixed() {
    std::thread::spawn(|| {
        if !deny_io_uring_on_this_thread() {
            return eprintln!("SKIPPED: no seccomp filter can be installed here");
        }
        assert!(umdev_devices::aio::available().is_err(), "the filter holds");
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("disk.img");
        File::create(&path).unwrap().set_len(1 << 20).unwrap();
        let config = NvmeConfig {
            namespaces: vec![Some(Backing::File(path.clone(), umdev_devices::store::Cache::None))],
            lba_shift: 12,
            aio: AioMode::IoUring,
            fixed_buffers: FixedBuffers::Always,
            ..NvmeConfig::default()
        };
        let mut d = up(Rig::with(config, true), 1);
        let stats = d.t.dev.describe();
        assert_eq!(
            (stats["aio"].as_str(), stats["fixed_buffers"].as_str()),
            (Some("sync"), Some("off")),
            "{stats}"
        );
        let data = pattern(2 * 4096, 9);
        d.t.put(DATA, &data).unwrap();
        assert_eq!(d.rw(1, false, 1, 4, 2, 4096, &[DATA, DATA + 0x1000], 0).unwrap(), Status::SUCCESS);
        assert_eq!(
            d.rw(1, true, 1, 4, 2, 4096, &[DATA + 0x8000, DATA + 0x9000], 0).unwrap(),
            Status::SUCCESS
        );
        let mut back = vec![0u8; 2 * 4096];
        d.t.get(DATA + 0x8000, &mut back).unwrap();
        assert!(back == data);
        assert_eq!(std::fs::read(&path).unwrap()[4 * 4096..6 * 4096], data[..]);
        assert_eq!(d.t.dev.function().totals().fixed_transfers, 0);
    })
    .join()
    .unwrap();
}
