//! The nvme command path allocates nothing per command. A global allocator counts the
//! allocations of every thread but the test's own (that is, the server's: its acceptor, the
//! connection thread that takes the doorbell messages, the queue workers and their io_uring's
//! completions); once the queues are up and each kind of command has run once, more commands
//! of every kind add none: RAM reads and writes through PRP entries and through a PRP list, a
//! Compare, a batch behind one doorbell, and a file namespace's O_DIRECT reads, writes and Flush through
//! the queue's io_uring; nor do the server's timed looks (the admin worker's) in the pauses
//! between rounds. A test binary of its own (see `common/counting_alloc.rs`).

mod common;
#[path = "common/counting_alloc.rs"]
mod counting_alloc;

use std::time::Duration;

use common::Harness;
use counting_alloc::{server_allocations_during, TEST_THREAD};
use umdev_devices::nvme::spec::{nvm_op, Sqe, Status};
use umdev_mdev::types::InstanceOptions;
use umdev_testkit::nvme_driver::Driver;
use umdev_testkit::nvme_guest::NvmeGuest;

const RAM: u64 = 96 << 20;
const DATA: u64 = Driver::<NvmeGuest>::DATA;
/// The namespaces' logical block (the controller's default).
const LBA: u64 = 512;
const PAGE_LBAS: u32 = (4096 / LBA) as u32;

/// The commands of a [`round`].
const PER_ROUND: u64 = 17;

/// One of each kind of command the path serves, [`PER_ROUND`] commands in all.
fn round(d: &mut Driver<NvmeGuest>) {
    let ok = |s: Status, what: &str| assert_eq!(s, Status::SUCCESS, "{what}");
    // RAM, one page through PRP1, both ways; and 128 KiB through a PRP list.
    ok(d.rw(1, false, 1, 0, PAGE_LBAS, LBA, &[DATA], 0).unwrap(), "RAM write");
    ok(d.rw(1, true, 1, 0, PAGE_LBAS, LBA, &[DATA + 0x1000], 0).unwrap(), "RAM read");
    // A Compare of what was just written, in chunks on the worker's stack.
    let mut compare = Driver::<NvmeGuest>::rw_command(true, 1, 0, PAGE_LBAS, DATA, 0);
    compare.cdw0 = ((u32::from(compare.cdw0) & !0xff) | u32::from(nvm_op::COMPARE)).into();
    ok(d.io_command(1, compare).unwrap().status(), "RAM compare");
    let list: Vec<u64> = (0..32).map(|i| DATA + 0x10_0000 + i * 0x1000).collect();
    ok(d.rw(1, true, 1, 64, 32 * PAGE_LBAS, LBA, &list, 0).unwrap(), "RAM read by PRP list");
    ok(d.rw(1, false, 1, 64, 32 * PAGE_LBAS, LBA, &list, 0).unwrap(), "RAM write by PRP list");
    // Eight reads behind one doorbell.
    for i in 0..8u64 {
        let mut sqe =
            Driver::<NvmeGuest>::rw_command(true, 1, i * 8, PAGE_LBAS, DATA + 0x20_0000 + i * 0x1000, 0);
        sqe.cdw0 = (u32::from(sqe.cdw0) | (1000 + i as u32) << 16).into();
        d.push(1, &sqe).unwrap();
    }
    d.ring(1).unwrap();
    for _ in 0..8 {
        ok(d.wait(1, Duration::from_secs(60)).unwrap().status(), "batched RAM read");
    }
    // The file namespace, through the queue's io_uring.
    ok(d.rw(1, false, 2, 8, PAGE_LBAS, LBA, &[DATA], 0).unwrap(), "file write");
    ok(d.rw(1, true, 2, 8, PAGE_LBAS, LBA, &[DATA + 0x2000], 0).unwrap(), "file read");
    ok(d.rw(1, true, 2, 64, 32 * PAGE_LBAS, LBA, &list, 0).unwrap(), "file read by PRP list");
    let mut flush = Sqe::new(nvm_op::FLUSH, 0);
    flush.nsid = 2.into();
    ok(d.io_command(1, flush).unwrap().status(), "file flush");
}

fn main() {
    commands_allocate_nothing_once_the_queues_are_up();
    println!("test commands_allocate_nothing_once_the_queues_are_up ... ok");
}

fn commands_allocate_nothing_once_the_queues_are_up() {
    TEST_THREAD.with(|t| t.set(true));
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("ns2.img");
    std::fs::File::create(&path).unwrap().set_len(16 << 20).unwrap();
    let mut options = InstanceOptions::default();
    options.params.insert("ns1".into(), "ram:16M".into());
    options.params.insert("ns2".into(), format!("file:{}", path.display()));
    options.params.insert("cache2".into(), "none".into());
    // The RAM disk's pass over its memory allocates (it reads what the host has free): not
    // the command path, and it could run in the window counted here.
    options.params.insert("ram_populate".into(), "off".into());
    let h = Harness::with("nvme", options, |_| {});
    let g = NvmeGuest::connect(&h.socket, RAM, 3).unwrap();
    let mut d = g.driver();
    d.enable().unwrap();
    d.create_io_queues(1, 64, false).unwrap();
    // The first commands of each kind may set things up (a statistics bucket, say).
    round(&mut d);
    round(&mut d);
    const ROUNDS: u64 = 10;
    let made = server_allocations_during(|| {
        for _ in 0..ROUNDS {
            round(&mut d);
            // Time for the timed looks, which a slow machine only gives more of.
            std::thread::sleep(Duration::from_millis(20));
        }
    });
    assert_eq!(made, 0, "the server allocated {made} times over {} commands", ROUNDS * PER_ROUND);
    let io = &h.info().device["io"];
    assert_eq!(io["commands"].as_u64(), Some((ROUNDS + 2) * PER_ROUND), "every command ran: {io}");
}
