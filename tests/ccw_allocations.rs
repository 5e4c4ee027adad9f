//! The ccw device's program path allocates nothing per program. The allocator of
//! `common/counting_alloc.rs` counts the allocations of every thread but the test's own (the
//! server's acceptor, the connection thread that takes the doorbell writes, the subchannel
//! workers); once each kind of program has run (on each request slot in use), more programs
//! add none: 4 KiB direct transfers, a chain of 40 CCWs (more than the interpreter keeps on
//! its stack for its loop check), and 2 MiB through 512 scattered 4 KiB IDAWs in one CCW,
//! both ways. A test binary of its own, so that no other test's threads allocate meanwhile.

mod common;
#[path = "common/counting_alloc.rs"]
mod counting_alloc;

use common::ccw::*;
use common::Harness;
use counting_alloc::{server_allocations_during, TEST_THREAD};
use umdev_devices::ccw::program::{cmd, dstat, Reason, Status};
use umdev_mdev::types::InstanceOptions;
use umdev_testkit::ccw_driver::{idaws, Data, Op};

fn ok(s: &Status, what: &str) {
    assert_eq!((s.dstat, s.cstat, s.reason), (dstat::CE | dstat::DE, 0, Reason::Ok), "{what}: {s:?}");
}

/// The programs of a [`round`].
const PER_ROUND: u64 = 5;

/// One program of each kind, [`PER_ROUND`] in all, on subchannel 0.
fn round(g: &mut CcwGuest) {
    let page = |i: u64| DATA_BASE + i * 4096;
    ok(&g.run(0, &[Op::new(cmd::WRITE, 4096, Data::Direct(page(0)))]).unwrap(), "4 KiB write");
    ok(&g.run(0, &[Op::new(cmd::READ, 4096, Data::Direct(page(1)))]).unwrap(), "4 KiB read");
    let chain: Vec<Op> = (0..40).map(|i| Op::new(cmd::WRITE, 4096, Data::Direct(page(2 + i)))).collect();
    ok(&g.run(0, &chain).unwrap(), "a chain of 40 CCWs");
    // Every other page of 4 MiB, backwards: 512 pieces, no two adjacent.
    let blocks: Vec<u64> = (0..512).rev().map(|i| page(64 + 2 * i)).collect();
    let scattered = |c| Op::new(c, 2 << 20, Data::Idaws(idaws(&blocks, 0, 2 << 20)));
    ok(&g.run(0, &[scattered(cmd::WRITE)]).unwrap(), "2 MiB written through 512 IDAWs");
    ok(&g.run(0, &[scattered(cmd::READ)]).unwrap(), "2 MiB read through 512 IDAWs");
}

fn main() {
    programs_allocate_nothing_once_each_kind_has_run();
    println!("test programs_allocate_nothing_once_each_kind_has_run ... ok");
}

fn programs_allocate_nothing_once_each_kind_has_run() {
    TEST_THREAD.with(|t| t.set(true));
    let h = Harness::with("ccw", InstanceOptions::default(), |_| {});
    let mut g = CcwGuest::connect(&h.socket).unwrap();
    // The first programs of each kind may set things up (a list grows to its size).
    round(&mut g);
    round(&mut g);
    // A program is begun on the connection thread, and its request's slot is let go by the
    // worker after the status is out: a client that starts the next program at once may find
    // the last one's slot still held (a busy machine: the worker was preempted in between)
    // and get another, whose lists grow once as the first one's did (two slots at most, for
    // a client that waits for each status). So what programs allocate must end, rather than
    // be nothing from the first window on: a window without an allocation, confirmed by a
    // window as long as all the programs before it (a list growing by doubling, however
    // slowly it fills, reallocates within it). A confirmation that a second slot's growth
    // spoils is tried again, a bounded number of times.
    const ROUNDS: u64 = 10;
    const TRIES: usize = 4;
    let mut done: u64 = 2; // the rounds run so far
    let mut made = Vec::new();
    for _ in 0..TRIES {
        made.push(allocations_over(&mut g, ROUNDS));
        done += ROUNDS;
        if made.last() != Some(&0) {
            continue;
        }
        made.push(allocations_over(&mut g, done));
        done *= 2;
        if made.last() == Some(&0) {
            return;
        }
    }
    panic!("the server kept allocating over {} programs (by window: {made:?})", done * PER_ROUND);
}

/// What the server allocates over `rounds` more rounds.
fn allocations_over(g: &mut CcwGuest, rounds: u64) -> u64 {
    server_allocations_during(|| {
        for _ in 0..rounds {
            round(g);
        }
    })
}
