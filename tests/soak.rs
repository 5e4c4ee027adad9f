//! Soak: 10,000 client lifetimes against one `umdev run` process serving a ccw device. Each
//! connects with rust-vmm's `vfio_user::Client`, maps guest RAM, enables MSI-X with
//! eventfds, runs a scattered channel program each way (pins, I/O, interrupt), checks the
//! data, unmaps and disconnects; every tenth disconnects with its programs still running and
//! its memory still mapped. The daemon's fd count and RSS are sampled all along and must not
//! grow beyond noise.

mod common;

use std::path::Path;
use std::time::{Duration, Instant};

use common::ccw::*;
use common::process::{fd_count, run, status_kib};
use umdev_devices::ccw::program::cmd;
use umdev_testkit::ccw_driver::{idaws, Data, Op};

const CYCLES: usize = 10_000;
const SAMPLE_EVERY: usize = 500;

fn maps_count(pid: u32) -> usize {
    std::fs::read_to_string(format!("/proc/{pid}/maps")).unwrap().lines().count()
}

fn connect(socket: &Path) -> CcwGuest {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        match CcwGuest::connect(socket) {
            Ok(g) => return g,
            Err(e) => assert!(Instant::now() < deadline, "cannot connect: {e}"),
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[test]
fn ten_thousand_client_lifetimes_leave_the_daemon_as_it_was() {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("soak.sock");
    let daemon = run(&socket, &["--type", "ccw", "--opt", "subchannels=2"]);
    let pid = daemon.0.id();
    let data: Vec<u8> = (0..65536u32).map(|i| (i * 7 + i / 4096) as u8).collect();
    // 16 blocks in reverse order: 16 runs of one page each.
    let blocks: Vec<u64> = (0..16u64).rev().map(|b| DATA_BASE + b * 8192).collect();
    let back: Vec<u64> = (0..16u64).map(|b| DATA_BASE + (1 << 20) + b * 8192).collect();
    let write = [Op::new(cmd::WRITE, 65536, Data::Idaws(idaws(&blocks, 0, 65536)))];
    let read = [
        Op::new(cmd::SEEK, 8, Data::Direct(SCRATCH)),
        Op::new(cmd::READ, 65536, Data::Idaws(idaws(&back, 0, 65536))),
    ];

    let started = Instant::now();
    let mut samples: Vec<(usize, usize, usize, u64)> = Vec::new();
    for cycle in 0..CYCLES {
        let mut g = connect(&socket);
        if cycle % SAMPLE_EVERY == 0 {
            // Sampled in the same state every time: one client connected and set up.
            samples.push((cycle, fd_count(pid), maps_count(pid), status_kib(pid, "VmRSS:")));
        }
        for (i, chunk) in data.chunks(4096).enumerate() {
            g.put(blocks[i], chunk).unwrap();
        }
        g.put(SCRATCH, &0u64.to_le_bytes()).unwrap();
        if cycle % 10 == 9 {
            // Vanish mid-program, everything still mapped.
            g.start(0, &write).unwrap();
            g.start(1, &write).unwrap();
            continue;
        }
        let s = g.run(0, &write).unwrap();
        assert!(s.ok(), "cycle {cycle}: {s:?}");
        let s = g.run(1, &read).unwrap();
        assert!(s.ok(), "cycle {cycle}: {s:?}");
        for (i, chunk) in data.chunks(4096).enumerate() {
            assert!(g.get(back[i], 4096).unwrap() == chunk, "cycle {cycle}: data");
        }
        g.client.dma_unmap(0, RAM_SIZE).unwrap();
    }
    let elapsed = started.elapsed();
    let g = connect(&socket);
    samples.push((CYCLES, fd_count(pid), maps_count(pid), status_kib(pid, "VmRSS:")));
    drop(g);
    let hwm = status_kib(pid, "VmHWM:");

    eprintln!(
        "MEASURED soak: {CYCLES} cycles in {elapsed:.2?} ({:.0} us/cycle)",
        elapsed.as_micros() as f64 / CYCLES as f64
    );
    for (cycle, fds, maps, rss) in &samples {
        eprintln!("MEASURED   cycle {cycle:>5}: fds {fds}, maps {maps}, RSS {rss} KiB");
    }
    eprintln!("MEASURED   peak RSS {hwm} KiB");
    // fds: exactly the same at every sample.
    let fds0 = samples[0].1;
    assert!(samples.iter().all(|s| s.1 == fds0), "fd count changed: {samples:?}");
    // Mappings: the same but for allocator arenas and cached thread stacks (anonymous).
    let maps0 = samples[0].2;
    assert!(samples.iter().all(|s| s.2 <= maps0 + 64), "mappings grew: {samples:?}");
    // RSS: after the first sample's warm-up, within 4 MiB of it (allocator noise), and in
    // particular not growing with the number of cycles.
    let rss1 = samples[1].3;
    let last = samples.last().unwrap().3;
    assert!(samples[1..].iter().all(|s| s.3 <= rss1 + 4096), "RSS grew: {samples:?}");
    assert!(last <= rss1 + 2048, "RSS grew from {rss1} to {last} KiB");
}
