//! Concurrency: channel programs on all 16 subchannels of a ccw device at once, while the
//! client maps and unmaps other regions and unmaps regions the programs are using, in both
//! pin modes. Every program must complete, or fail cleanly when its memory went away; pin
//! counts return to zero after every round; memory is never touched after its unmap
//! returned; the whole suite runs in bounded time.

mod common;

use std::fs::File;
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;
use std::time::{Duration, Instant};

use common::ccw::*;
use common::Harness;
use umdev_devices::ccw::program::{cmd, Reason, Status};
use umdev_mdev::types::InstanceOptions;
use umdev_pinning::PinMode;
use umdev_testkit::ccw_driver::{idaws, Data, Op};

const SUBCHANNELS: u32 = 16;
const ROUNDS: u32 = 40;
/// Each subchannel's slice of the store.
const STORE_SLICE: u64 = 2 << 20;
/// Victim regions: one per subchannel, unmapped while a program writes into it.
const VICTIM_BASE: u64 = 1 << 32;
const VICTIM_SIZE: u64 = 2 << 20;
/// Churn regions: mapped and unmapped while everything runs, used by nobody.
const CHURN_BASE: u64 = 1 << 36;

/// What a subchannel does in a round.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Role {
    /// Guest RAM to the store and back, scattered; the data must round-trip.
    RoundTrip,
    /// The store into its victim region, which is unmapped meanwhile.
    Victim,
    /// 1 MiB of guest RAM to the store, contiguous; must complete.
    Stream,
}

fn role(sc: u32, round: u32) -> Role {
    match (sc + round) % 3 {
        0 => Role::RoundTrip,
        1 => Role::Victim,
        _ => Role::Stream,
    }
}

fn src_area(sc: u32) -> u64 {
    DATA_BASE + u64::from(sc) * (4 << 20)
}

fn dst_area(sc: u32) -> u64 {
    src_area(sc) + (2 << 20)
}

fn seek_arg(sc: u32) -> u64 {
    SCRATCH + 8 * u64::from(sc)
}

fn pattern(seed: u32, n: usize) -> Vec<u8> {
    (0..n).map(|i| (i as u32).wrapping_mul(2654435761).wrapping_add(seed).to_le_bytes()[1]).collect()
}

/// 64 pages of `area` in a scattered order (no two adjacent), as IDAWs for 256 KiB.
fn scattered(area: u64) -> Data {
    let blocks: Vec<u64> = (0..64u64).map(|i| area + ((i * 29) % 64) * 4096).collect();
    Data::Idaws(idaws(&blocks, 0, 64 * 4096))
}

fn program(g: &CcwGuest, sc: u32, role: Role, round: u32) -> Vec<Op> {
    g.put(seek_arg(sc), &(u64::from(sc) * STORE_SLICE).to_le_bytes()).unwrap();
    let seek = Op::new(cmd::SEEK, 8, Data::Direct(seek_arg(sc)));
    match role {
        Role::RoundTrip => {
            g.put(src_area(sc), &pattern(round * 64 + sc, 64 * 4096)).unwrap();
            vec![
                seek.clone(),
                Op::new(cmd::WRITE, 64 * 4096, scattered(src_area(sc))),
                seek,
                Op::new(cmd::READ, 64 * 4096, scattered(dst_area(sc))),
            ]
        }
        Role::Victim => {
            let iova = VICTIM_BASE + u64::from(sc) * VICTIM_SIZE * 2;
            let mut ops = vec![seek];
            ops.extend((0..32u64).map(|i| Op::new(cmd::READ, 65536, Data::Direct(iova + i * 65536))));
            ops
        }
        Role::Stream => vec![seek, Op::new(cmd::WRITE, 1 << 20, Data::Direct(src_area(sc)))],
    }
}

fn check(g: &CcwGuest, sc: u32, role: Role, round: u32, s: &Status) -> bool {
    let what = format!("round {round} subchannel {sc} ({role:?})");
    match role {
        Role::RoundTrip | Role::Stream => {
            assert!(s.ok(), "{what}: {s:?}");
            if role == Role::RoundTrip {
                let got = g.get(dst_area(sc), 64 * 4096).unwrap();
                // The read scattered the pages the same way the write gathered them.
                assert!(got == pattern(round * 64 + sc, 64 * 4096), "{what}: data");
            }
            false
        }
        Role::Victim => match s.reason {
            Reason::Ok => false,
            // Stopped by the unmap, or its pages were already gone when it pinned them.
            Reason::Unmapped | Reason::DataUnmapped => true,
            other => panic!("{what}: {other:?} {s:?}"),
        },
    }
}

fn suite(mode: PinMode) {
    let mut options = InstanceOptions::default();
    options.params.insert("subchannels".into(), SUBCHANNELS.to_string());
    options.params.insert("size".into(), "32M".into());
    let h = Harness::with("ccw", options, |c| c.dma.mode = mode);
    let mut g = CcwGuest::connect(&h.socket).unwrap();
    assert_eq!(g.subchannels, SUBCHANNELS);
    let victims: Vec<File> = (0..SUBCHANNELS).map(|_| common::memfd(VICTIM_SIZE)).collect();
    let churn = common::memfd(1 << 20);

    let started = Instant::now();
    let (mut halted, mut completed, mut refused, mut churned) = (0, 0, 0, 0u64);
    let mut slowest_unmap = Duration::ZERO;
    for round in 0..ROUNDS {
        // The first victim of each round finds its region already gone: it must fail
        // cleanly, whatever the machine's speed. The others race their unmaps, which catch
        // them in flight or not, as the timing falls.
        let gone = (0..SUBCHANNELS).find(|&sc| role(sc, round) == Role::Victim);
        for sc in 0..SUBCHANNELS {
            if role(sc, round) == Role::Victim && Some(sc) != gone {
                let v = &victims[sc as usize];
                v.write_all_at(&vec![0xa5; VICTIM_SIZE as usize], 0).unwrap();
                let iova = VICTIM_BASE + u64::from(sc) * VICTIM_SIZE * 2;
                g.client.dma_map(0, iova, VICTIM_SIZE, v.as_raw_fd()).unwrap();
            }
        }
        for sc in 0..SUBCHANNELS {
            let ops = program(&g, sc, role(sc, round), round);
            g.start(sc, &ops).unwrap();
        }
        // While they run: unmap every victim region (in use) and churn other regions.
        let mut snapshots = Vec::new();
        for sc in 0..SUBCHANNELS {
            let iova = CHURN_BASE + u64::from(round % 4) * (1 << 30) + u64::from(sc) * (1 << 20);
            g.client.dma_map(0, iova, 1 << 20, churn.as_raw_fd()).unwrap();
            if role(sc, round) == Role::Victim && Some(sc) != gone {
                let iova = VICTIM_BASE + u64::from(sc) * VICTIM_SIZE * 2;
                let t = Instant::now();
                g.client.dma_unmap(iova, VICTIM_SIZE).expect("unmap of a region in use");
                slowest_unmap = slowest_unmap.max(t.elapsed());
                // From here on the device must not write it.
                let mut snap = vec![0u8; VICTIM_SIZE as usize];
                victims[sc as usize].read_exact_at(&mut snap, 0).unwrap();
                snapshots.push((sc, snap));
            }
            g.client.dma_unmap(iova, 1 << 20).unwrap();
            churned += 1;
        }
        for sc in 0..SUBCHANNELS {
            let s = g.wait(sc).unwrap();
            if Some(sc) == gone {
                assert!(
                    check(&g, sc, Role::Victim, round, &s),
                    "round {round}: {sc} ran on unmapped memory: {s:?}"
                );
                refused += 1;
            } else if check(&g, sc, role(sc, round), round, &s) {
                halted += 1;
            } else {
                completed += 1;
            }
        }
        for (sc, snap) in snapshots {
            let mut now = vec![0u8; VICTIM_SIZE as usize];
            victims[sc as usize].read_exact_at(&mut now, 0).unwrap();
            assert!(now == snap, "round {round}: subchannel {sc} wrote its region after the unmap returned");
        }
        let dma = h.info().dma;
        assert_eq!((dma.pins_held, dma.pinned_pages, dma.locked_bytes), (0, 0, 0), "round {round}: {dma:?}");
        assert_eq!(dma.mappings, 1, "round {round}: only guest RAM is left mapped");
    }
    let elapsed = started.elapsed();
    let dma = h.info().dma;
    eprintln!(
        "MEASURED {mode:?}: {ROUNDS} rounds x {SUBCHANNELS} subchannels in {elapsed:.2?}: {completed} completed, \
         {halted} stopped by an unmap, {refused} refused on memory already unmapped, {churned} churn map+unmap \
         pairs, slowest unmap in use {slowest_unmap:.2?}, {} pin calls, {} unmaps waited",
        dma.pin_calls, dma.unmap_waits
    );
    assert_eq!(dma.unmap_busy, 0, "no unmap failed busy");
    // How many unmaps caught a program in flight is the machine's timing (reported above);
    // every program on memory already gone failed cleanly.
    assert_eq!(refused, ROUNDS);
    // The device still works.
    g.put(DATA_BASE, &[1; 4096]).unwrap();
    assert!(g.run(0, &[Op::new(cmd::WRITE, 4096, Data::Direct(DATA_BASE))]).unwrap().ok());
}

#[test]
fn every_subchannel_busy_while_regions_come_and_go_track() {
    suite(PinMode::Track);
}

#[test]
fn every_subchannel_busy_while_regions_come_and_go_lock() {
    suite(PinMode::Lock);
}
