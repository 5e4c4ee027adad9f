//! A hostile host against the nvme controller over a real socket (rust-written driver over
//! umdev's raw vfio-user client): queue sizes of 0 and above MQES, doorbells past the queue
//! size or for queues that do not exist, odd-width doorbells, garbage submission entries
//! with bogus PRPs and LBAs, CC.EN toggled under load, queues deleted with commands in
//! flight, memory unmapped under load, the client gone mid-I/O. Never a crash or a hang, the
//! connection and the controller go on, and memory the client mapped read-only (or did not
//! map) is never written.

mod common;

use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;
use std::time::{Duration, Instant};

use common::Harness;
use umdev_devices::nvme::spec::{admin_op, nvm_op, reg, Sqe, Status};
use umdev_mdev::types::InstanceOptions;
use umdev_server::wire::Command;
use umdev_testkit::client::{dma_map_payload, dma_unmap_payload};
use umdev_testkit::nvme_driver::{Driver, Transport};
use umdev_testkit::nvme_guest::NvmeGuest;

const RAM: u64 = 160 << 20;
/// A read-only canary mapped right after RAM.
const CANARY: u64 = RAM;
const CANARY_SIZE: u64 = 1 << 20;
const DATA: u64 = Driver::<NvmeGuest>::DATA;

fn harness(opts: &[(&str, &str)]) -> Harness {
    let mut options = InstanceOptions::default();
    options.params.insert("ns1".into(), "ram:64M".into());
    for (k, v) in opts {
        options.params.insert(k.to_string(), v.to_string());
    }
    Harness::with("nvme", options, |_| {})
}

/// A connected driver with the canary mapped read-only, the controller enabled.
fn driver(h: &Harness) -> (Driver<NvmeGuest>, std::fs::File) {
    let mut g = NvmeGuest::connect(&h.socket, RAM, 5).unwrap();
    let canary = common::memfd(CANARY_SIZE);
    canary.write_all_at(&vec![0xc5; CANARY_SIZE as usize], 0).unwrap();
    let map = dma_map_payload(1, 0, CANARY, CANARY_SIZE); // read-only
    let r = g.client.request(Command::DmaMap as u16, &map, &[canary.as_raw_fd()]).unwrap();
    assert_eq!(r.errno(), 0);
    let mut d = g.driver();
    d.enable().unwrap();
    (d, canary)
}

fn canary_intact(canary: &std::fs::File) -> bool {
    let mut b = vec![0u8; CANARY_SIZE as usize];
    canary.read_exact_at(&mut b, 0).unwrap();
    b.iter().all(|&x| x == 0xc5)
}

/// The controller still answers and moves data correctly.
fn works(d: &mut Driver<NvmeGuest>, qid: u16) {
    let data: Vec<u8> = (0..4096u32).map(|i| (i * 13) as u8).collect();
    d.t.put(DATA + 0x7000, &data).unwrap();
    assert_eq!(d.rw(qid, false, 1, 77, 8, 512, &[DATA + 0x7000], 0).unwrap(), Status::SUCCESS);
    assert_eq!(d.rw(qid, true, 1, 77, 8, 512, &[DATA + 0x8000], 0).unwrap(), Status::SUCCESS);
    let mut back = vec![0u8; 4096];
    d.t.get(DATA + 0x8000, &mut back).unwrap();
    assert!(back == data, "the data read back differs");
    assert!(d.t.client.alive(), "the connection is in sync");
}

#[test]
fn bad_queue_sizes_and_doorbells_are_refused_and_change_nothing() {
    let h = harness(&[]);
    let (mut d, canary) = driver(&h);
    // Create with QSIZE 0 (1 entry) and 0xffff (65536 entries, above MQES).
    for qsize in [0u32, 0xffff, 1024] {
        let mut cq = Sqe::new(admin_op::CREATE_CQ, 0);
        cq.prp1 = DATA.into();
        cq.set_dw(10, 1 | qsize << 16);
        cq.set_dw(11, 1);
        assert_eq!(d.admin_command(cq).unwrap().status(), Status::INVALID_QUEUE_SIZE.dnr(), "QSIZE {qsize}");
    }
    d.create_io_queues(2, 16, false).unwrap();
    // Doorbells past the queue size, of queues that do not exist, past the last queue,
    // at odd offsets and widths.
    for (offset, value) in [
        (reg::DOORBELLS + 8, 16),
        (reg::DOORBELLS + 8, u32::MAX),
        (reg::DOORBELLS + 12, 5000),
        (reg::DOORBELLS + 8 * 3, 1),
        (reg::DOORBELLS + 8 * 4 + 4, 1),
        (reg::DOORBELLS + 8 * 63, 1),
        (reg::DOORBELLS + 0xffc, 1),
    ] {
        d.t.doorbell(offset, value).unwrap(); // posted: no reply expected
    }
    for (offset, len) in [(reg::DOORBELLS + 2, 4usize), (reg::DOORBELLS + 8, 2), (reg::DOORBELLS + 8, 8)] {
        let r = d.t.client.region_write(0, offset, &vec![0; len]).unwrap();
        assert_eq!(r.errno(), libc::EINVAL, "a {len}-byte doorbell write at {offset:#x}");
    }
    // A write to CC while enabled that changes the page size is not a reset.
    assert!(d.t.client.alive());
    works(&mut d, 1);
    works(&mut d, 2);
    // Admin queues of one entry (AQA holds no more than 4096, which MQES does not bound):
    // the controller reports fatal status, not a crash.
    d.t.write32(reg::CC, 0).unwrap();
    for aqa in [0u32, 0x0fff_0000, 0x0000_0fff] {
        d.t.write32(reg::AQA, aqa).unwrap();
        d.t.write32(reg::CC, 6 << 16 | 4 << 20 | 1).unwrap();
        let csts = d.t.read32(reg::CSTS).unwrap();
        assert_eq!(csts & (reg::CSTS_CFS | reg::CSTS_RDY), reg::CSTS_CFS, "AQA {aqa:#x}: CSTS {csts:#x}");
        d.t.write32(reg::CC, 0).unwrap();
        assert_eq!(d.t.read32(reg::CSTS).unwrap() & reg::CSTS_CFS, 0, "a disable clears CFS");
    }
    d.enable().unwrap();
    d.create_io_queues(1, 16, false).unwrap();
    works(&mut d, 1);
    assert!(canary_intact(&canary));
}

#[test]
fn garbage_submission_entries_get_answers_and_touch_nothing_they_may_not() {
    let h = harness(&[]);
    let (mut d, canary) = driver(&h);
    d.create_io_queues(1, 64, false).unwrap();
    let mut seed = 0x9e37_79b9_7f4a_7c15u64;
    let mut rand = move || {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed
    };
    // Addresses a hostile PRP names: unmapped, wrapping, unaligned, the read-only canary, a
    // list pointer into the canary, RAM.
    let addrs = [
        0u64,
        1 << 40,
        u64::MAX - 0xfff,
        CANARY,
        CANARY + 0x1008,
        DATA,
        DATA + 4,
        RAM - 8,
        RAM + CANARY_SIZE,
    ];
    // A PRP list in RAM whose entries are hostile too.
    let list: Vec<u8> = addrs.iter().cycle().take(512).flat_map(|a| a.to_le_bytes()).collect();
    d.t.put(DATA + 0x10_0000, &list).unwrap();
    let mut statuses = std::collections::BTreeMap::new();
    for i in 0..3000u32 {
        let r = rand();
        let opcode = [nvm_op::READ, nvm_op::WRITE, nvm_op::FLUSH, nvm_op::WRITE_ZEROES, nvm_op::DSM, 0x7f]
            [(r % 6) as usize];
        let mut sqe = Sqe::new(opcode, 0);
        // Now and then fused and PSDT bits too.
        let odd = if r % 8 == 0 { r as u32 & 0xc300 } else { 0 };
        sqe.cdw0 = (u32::from(opcode) | odd).into();
        sqe.nsid = [1u32, 0, 2, u32::MAX][(r >> 8) as usize % 4].into();
        sqe.prp1 = addrs[(r >> 12) as usize % addrs.len()].into();
        sqe.prp2 = [DATA + 0x10_0000, DATA + 0x10_0ff8, CANARY, 1 << 40][(r >> 16) as usize % 4].into();
        let slba = [0u64, 1000, (64 << 20) / 512 - 1, u64::MAX, 1 << 40][(r >> 20) as usize % 5];
        sqe.set_dw(10, slba as u32);
        sqe.set_dw(11, (slba >> 32) as u32);
        // Mostly up to 64 blocks, now and then up to 64 Ki; random flags (FUA, ...).
        let nlb = if r % 16 == 0 { rand() as u32 & 0xffff } else { rand() as u32 & 0x3f };
        sqe.set_dw(12, (rand() as u32 & 0xffff_0000) | nlb);
        sqe.set_dw(13, rand() as u32);
        let cqe = d.io_command(1, sqe).unwrap_or_else(|e| panic!("command {i}: {e}"));
        *statuses.entry(cqe.status().0).or_insert(0u32) += 1;
    }
    eprintln!("statuses: {statuses:x?}");
    assert!(statuses.len() >= 5, "a variety of answers: {statuses:?}");
    assert!(canary_intact(&canary), "read-only memory was written");
    works(&mut d, 1);
}

#[test]
fn cc_en_toggled_and_queues_deleted_under_load_leave_a_working_controller() {
    let h = harness(&[]);
    let (mut d, canary) = driver(&h);
    for round in 0..20 {
        d.create_io_queues(2, 64, false).unwrap();
        // 48 reads of 64 KiB in flight on each queue.
        for q in 1..=2u16 {
            for slot in 0..48u32 {
                let pages: Vec<u64> = (0..16)
                    .map(|p| DATA + (u64::from(q) * 64 + u64::from(slot)) * 0x1_0000 + p * 0x1000)
                    .collect();
                let (prp1, prp2) = d.prps(q, slot, &pages, 0, 64 << 10).unwrap();
                d.push(q, &Driver::<NvmeGuest>::rw_command(true, 1, u64::from(slot) * 128, 128, prp1, prp2))
                    .unwrap();
            }
            d.ring(q).unwrap();
        }
        let started = Instant::now();
        if round % 2 == 0 {
            // Disable with everything in flight: RDY must drop promptly.
            d.t.write32(reg::CC, 0).unwrap();
            assert_eq!(d.t.read32(reg::CSTS).unwrap() & reg::CSTS_RDY, 0);
            d.enable().unwrap();
        } else {
            // Delete the SQs then the CQs with commands in flight.
            for q in 1..=2u16 {
                let mut del = Sqe::new(admin_op::DELETE_SQ, 0);
                del.set_dw(10, u32::from(q));
                assert_eq!(d.admin_command(del).unwrap().status(), Status::SUCCESS);
            }
            for q in 1..=2u16 {
                let mut del = Sqe::new(admin_op::DELETE_CQ, 0);
                del.set_dw(10, u32::from(q));
                assert_eq!(d.admin_command(del).unwrap().status(), Status::SUCCESS);
            }
            d.io.clear();
        }
        assert!(started.elapsed() < Duration::from_secs(5), "round {round}: {:?}", started.elapsed());
    }
    d.create_io_queues(1, 64, false).unwrap();
    works(&mut d, 1);
    assert!(canary_intact(&canary));
    // Nothing is left pinned but the rings of the live queues.
    let pins = h.info().dma.pinned_pages;
    assert!(pins <= 64, "pins after the rounds: {pins}");
}

#[test]
fn memory_unmapped_under_load_ends_commands_with_a_data_transfer_error_promptly() {
    let h = harness(&[]);
    let mut g = NvmeGuest::connect(&h.socket, RAM, 3).unwrap();
    // A second region for data, to be unmapped and mapped again under load.
    let data = common::memfd(16 << 20);
    let base = 1u64 << 32;
    let map = dma_map_payload(3, 0, base, 16 << 20);
    assert_eq!(g.client.request(Command::DmaMap as u16, &map, &[data.as_raw_fd()]).unwrap().errno(), 0);
    let mut d = g.driver();
    d.enable().unwrap();
    d.create_io_queues(1, 64, false).unwrap();
    let mut statuses = std::collections::BTreeMap::new();
    let mut worst = Duration::ZERO;
    for round in 0..30 {
        for slot in 0..32u32 {
            let pages: Vec<u64> =
                (0..32).map(|p| base + (u64::from(slot) * 32 + p) * 0x1000 % (16 << 20)).collect();
            let (prp1, prp2) = d.prps(1, slot, &pages, 0, 128 << 10).unwrap();
            d.push(
                1,
                &Driver::<NvmeGuest>::rw_command(round % 2 == 0, 1, u64::from(slot) * 256, 256, prp1, prp2),
            )
            .unwrap();
        }
        d.ring(1).unwrap();
        let t = Instant::now();
        let unmap = dma_unmap_payload(32, 0, base, 16 << 20);
        let r = d.t.client.request(Command::DmaUnmap as u16, &unmap, &[]).unwrap();
        assert_eq!(r.errno(), 0, "round {round}: the unmap");
        worst = worst.max(t.elapsed());
        for _ in 0..32 {
            let cqe = d.wait(1, Duration::from_secs(60)).unwrap();
            *statuses.entry(cqe.status().0).or_insert(0u32) += 1;
            assert!(
                cqe.status() == Status::SUCCESS || cqe.status() == Status::DATA_TRANSFER_ERROR,
                "round {round}: {:#x}",
                cqe.status().0
            );
        }
        let map = dma_map_payload(3, 0, base, 16 << 20);
        assert_eq!(d.t.client.request(Command::DmaMap as u16, &map, &[data.as_raw_fd()]).unwrap().errno(), 0);
    }
    // How prompt is measured: each unmap succeeded (it did not outwait its bound) and
    // commands lost their memory rather than being waited for.
    eprintln!("MEASURED statuses {statuses:x?}, worst unmap {worst:?}");
    assert!(
        statuses.contains_key(&Status::DATA_TRANSFER_ERROR.0),
        "some commands lost their memory: {statuses:?}"
    );
    works(&mut d, 1);
}

#[test]
fn a_client_gone_mid_io_leaves_the_controller_to_the_next() {
    let h = harness(&[]);
    for round in 0..10 {
        let (mut d, _canary) = driver(&h);
        d.create_io_queues(2, 64, false).unwrap();
        for q in 1..=2u16 {
            for slot in 0..32u32 {
                let (prp1, prp2) =
                    d.prps(q, slot, &[DATA + u64::from(slot) * 0x1000, DATA + 0x10_0000], 0, 8192).unwrap();
                d.push(q, &Driver::<NvmeGuest>::rw_command(round % 2 == 1, 1, 0, 16, prp1, prp2)).unwrap();
            }
            d.ring(q).unwrap();
        }
        drop(d); // gone, commands in flight
    }
    h.wait_idle();
    let (mut d, _canary) = driver(&h);
    d.create_io_queues(1, 64, false).unwrap();
    works(&mut d, 1);
    drop(d);
    h.wait_idle();
    assert_eq!(h.info().dma.pinned_pages, 0, "nothing pinned with no client");
}
