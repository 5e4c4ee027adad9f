//! The nvme controller's queue workers sleep while they may not fetch: with bus mastering off
//! and commands queued, a worker waits for the next doorbell or a wake-up instead of looping
//! on the queued entries. A test binary of its own, so the process's CPU time is the
//! controller's alone.

mod common;

use std::time::{Duration, Instant};

use common::Harness;
use umdev_devices::nvme::spec::Status;
use umdev_mdev::types::InstanceOptions;
use umdev_testkit::nvme_driver::Driver;
use umdev_testkit::nvme_guest::NvmeGuest;

const RAM: u64 = 160 << 20;
const DATA: u64 = Driver::<NvmeGuest>::DATA;

/// User + system CPU time of this process so far (`/proc/self/stat`, in clock ticks).
fn process_cpu() -> Duration {
    let stat = std::fs::read_to_string("/proc/self/stat").expect("/proc/self/stat");
    let rest = stat.rsplit_once(')').map(|(_, r)| r).expect("stat format");
    // After the name: state, ppid, ..., utime (the 12th), stime (the 13th).
    let f: Vec<&str> = rest.split_whitespace().collect();
    let field = |i: usize| f[i].parse::<u64>().expect("a tick count");
    let ticks = field(11) + field(12);
    let hz = nix::unistd::sysconf(nix::unistd::SysconfVar::CLK_TCK).ok().flatten().unwrap_or(100) as u64;
    Duration::from_nanos(ticks * 1_000_000_000 / hz)
}

#[test]
fn with_bus_mastering_off_a_worker_with_queued_commands_sleeps() {
    let mut options = InstanceOptions::default();
    options.params.insert("ns1".into(), "ram:16M".into());
    let h = Harness::with("nvme", options, |_| {});
    let g = NvmeGuest::connect(&h.socket, RAM, 3).unwrap();
    let mut d = g.driver();
    d.enable().unwrap();
    d.create_io_queues(1, 64, false).unwrap();
    // Memory space on, bus mastering off.
    let r = d.t.client.region_write(7, 4, &0x0002u16.to_le_bytes()).unwrap();
    assert_eq!(r.errno(), 0);
    for slot in 0..8u64 {
        let sqe = Driver::<NvmeGuest>::rw_command(false, 1, slot * 8, 8, DATA + slot * 0x1000, 0);
        d.push(1, &sqe).unwrap();
    }
    d.ring(1).unwrap();

    let (cpu, start) = (process_cpu(), Instant::now());
    std::thread::sleep(Duration::from_millis(500));
    let used = process_cpu().saturating_sub(cpu);
    let wall = start.elapsed();
    assert!(d.poll_one(1).unwrap().is_none(), "nothing completes while bus mastering is off");
    assert!(used < wall / 4, "the controller used {used:?} of CPU in {wall:?} with nothing it may do");

    // Bus mastering back on: the queued commands run.
    d.t.client.enable_bus_master().unwrap();
    for _ in 0..8 {
        assert_eq!(d.wait(1, Duration::from_secs(5)).unwrap().status(), Status::SUCCESS);
    }
}
