//! Every limit has a default, a flag, and a clear error when hit; a client mapping the
//! maximum number of regions or sending maximum-size messages cannot grow the daemon beyond
//! a documented bound (the figures printed here are in docs/reliability.md).

mod common;

use std::os::fd::AsRawFd;
use std::path::Path;
use std::process::Stdio;
use std::time::{Duration, Instant};

use common::process::{run, status_kib, umdev, ChildGuard};
use common::raw::*;
use umdev_server::wire::{flags, Command as Cmd};

fn connect(socket: &Path) -> RawClient {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let mut c = RawClient::connect(socket).unwrap();
        if c.negotiate().is_ok() {
            return c;
        }
        assert!(Instant::now() < deadline, "could not negotiate");
        std::thread::sleep(Duration::from_millis(10));
    }
}

#[test]
fn each_limit_has_a_flag_and_a_clear_error() {
    let dir = tempfile::tempdir().unwrap();

    // Mappings per client.
    let socket = dir.path().join("maps.sock");
    let _s = run(&socket, &["--type", "testdev", "--max-dma-maps", "3"]);
    let mut c = connect(&socket);
    let ram = common::memfd(1 << 20);
    for i in 0..3u64 {
        let r =
            c.request(Cmd::DmaMap as u16, &dma_map_payload(3, 0, i << 20, 4096), &[ram.as_raw_fd()]).unwrap();
        assert_eq!(r.errno(), 0);
    }
    let r = c.request(Cmd::DmaMap as u16, &dma_map_payload(3, 0, 8 << 20, 4096), &[ram.as_raw_fd()]).unwrap();
    assert_eq!(r.errno(), libc::ENOSPC, "the 4th mapping");
    // The capability advertised the limit.
    drop(c);

    // Bytes of mappings per client.
    let socket = dir.path().join("bytes.sock");
    let _s = run(&socket, &["--type", "testdev", "--max-dma-bytes", "1048576"]);
    let mut c = connect(&socket);
    let r = c.request(Cmd::DmaMap as u16, &dma_map_payload(3, 0, 0, 1 << 20), &[ram.as_raw_fd()]).unwrap();
    assert_eq!(r.errno(), 0, "1 MiB, the limit");
    let r = c.request(Cmd::DmaMap as u16, &dma_map_payload(3, 0, 2 << 20, 4096), &[ram.as_raw_fd()]).unwrap();
    assert_eq!(r.errno(), libc::ENOMEM, "a page more");
    drop(c);

    // Data per access, and so the message size.
    let socket = dir.path().join("xfer.sock");
    let _s = run(&socket, &["--type", "testdev", "--max-data-xfer", "4096"]);
    let mut c = connect(&socket);
    let r = c.region_read(0, 0, 4097).unwrap();
    assert_eq!(r.errno(), libc::E2BIG, "a read over max-data-xfer");
    assert!(c.alive());
    // A message above the maximum (the larger of the data limit plus headers and the
    // 16 KiB a VERSION may take) cannot be followed: the connection is closed.
    c.send(Cmd::RegionWrite as u16, flags::TYPE_COMMAND, &region_write_payload(0, 0, &vec![0; 32768]), &[])
        .unwrap();
    assert!(c.is_closed());

    // fds per message.
    let socket = dir.path().join("fds.sock");
    let _s = run(&socket, &["--type", "testdev", "--max-msg-fds", "2"]);
    let mut c = connect(&socket);
    let efds: Vec<_> = (0..3)
        .map(|_| nix::sys::eventfd::EventFd::from_flags(nix::sys::eventfd::EfdFlags::EFD_NONBLOCK).unwrap())
        .collect();
    let raw: Vec<i32> = efds.iter().map(|e| e.as_raw_fd()).collect();
    let r = c.request(Cmd::DeviceSetIrqs as u16, &set_irqs_payload(0x24, 2, 0, 2, &[]), &raw[..2]).unwrap();
    assert_eq!(r.errno(), 0, "two fds are within the limit");
    let r = c.request(Cmd::DeviceSetIrqs as u16, &set_irqs_payload(0x24, 2, 0, 3, &[]), &raw).unwrap();
    assert_eq!(r.errno(), libc::EINVAL, "three are not");

    // Pins per device: a ccw program needing more pins than allowed ends with a device error.
    let socket = dir.path().join("pins.sock");
    let _s = run(&socket, &["--type", "ccw", "--max-pins", "64"]);
    // Let the probe connection's teardown finish before the real client.
    std::thread::sleep(Duration::from_millis(50));
    let mut g = umdev_testkit::ccw_guest::CcwGuest::connect(&socket).unwrap();
    use umdev_devices::ccw::program::{cmd, dstat, Reason};
    use umdev_testkit::ccw_driver::{Data, Op};
    let s = g
        .run(0, &[Op::new(cmd::WRITE, 64 * 4096, Data::Direct(umdev_testkit::ccw_guest::DATA_BASE))])
        .unwrap();
    assert!(s.ok(), "64 pages fit: {s:?}");
    let s = g
        .run(0, &[Op::new(cmd::WRITE, 65 * 4096, Data::Direct(umdev_testkit::ccw_guest::DATA_BASE))])
        .unwrap();
    assert_eq!((s.dstat, s.reason), (dstat::UC, Reason::DeviceError), "65 do not");
    drop(g);

    // Instances per daemon.
    let run_dir = dir.path().join("run");
    let daemon = ChildGuard(
        umdev()
            .args(["--run-dir"])
            .arg(&run_dir)
            .args(["--state-dir"])
            .arg(dir.path().join("state"))
            .args(["daemon", "--max-instances", "2"])
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    let umdev = |args: &[&str]| umdev().arg("--run-dir").arg(&run_dir).args(args).output().unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    while !umdev(&["list"]).status.success() {
        assert!(Instant::now() < deadline);
        std::thread::sleep(Duration::from_millis(10));
    }
    assert!(umdev(&["start", "--type", "testdev"]).status.success());
    assert!(umdev(&["start", "--type", "testdev"]).status.success());
    let third = umdev(&["start", "--type", "testdev"]);
    assert!(!third.status.success());
    assert!(String::from_utf8_lossy(&third.stderr).contains("maximum of 2 instances"));
    drop(daemon);
}

/// Measured on a real `umdev run` process, so the figures are the daemon's own.
#[test]
fn hostile_clients_cannot_grow_the_daemon_beyond_a_bound() {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("bound.sock");
    let served = run(&socket, &["--type", "testdev"]);
    let pid = served.0.id();
    // A client maps the maximum number of regions (4096 by default) of 1 MiB each.
    let mut c = connect(&socket);
    let ram = common::memfd(1 << 20);
    let rss0 = status_kib(pid, "VmRSS:");
    let mut mapped = 0u64;
    for i in 0..5000u64 {
        let r = c
            .request(Cmd::DmaMap as u16, &dma_map_payload(3, 0, i << 20, 1 << 20), &[ram.as_raw_fd()])
            .unwrap();
        if r.errno() != 0 {
            assert_eq!(r.errno(), libc::ENOSPC, "only the limit refuses");
            break;
        }
        mapped += 1;
    }
    assert_eq!(mapped, 4096);
    let rss1 = status_kib(pid, "VmRSS:");
    let per_mapping = (rss1.saturating_sub(rss0) * 1024) as f64 / mapped as f64;
    eprintln!(
        "MEASURED max mappings: {mapped} x 1 MiB mapped; daemon RSS +{} KiB ({per_mapping:.0} B per mapping)",
        rss1.saturating_sub(rss0)
    );
    assert!(per_mapping < 4096.0, "bookkeeping per mapping stays small: {per_mapping:.0} B");
    drop(c);

    // A client sends maximum-size messages (1 MiB region writes, refused for their region
    // but read whole) and reads: the buffers are bounded by the message limit.
    let mut c = connect(&socket);
    let rss2 = status_kib(pid, "VmRSS:");
    let big = region_write_payload(7, 0, &vec![0u8; 1 << 20]);
    for _ in 0..50 {
        let r = c.request(Cmd::RegionWrite as u16, &big, &[]).unwrap();
        assert_eq!(r.errno(), libc::EINVAL, "out of the config region's bounds");
        let r = c.region_read(7, 0, 1 << 20).unwrap();
        assert_eq!(r.errno(), libc::EINVAL);
    }
    let rss3 = status_kib(pid, "VmRSS:");
    eprintln!(
        "MEASURED max-size messages: 100 x 1 MiB; daemon RSS {} KiB -> {} KiB (+{} KiB)",
        rss2,
        rss3,
        rss3.saturating_sub(rss2)
    );
    // One receive buffer (1 MiB + 64 KiB) and one reply buffer at most.
    assert!(rss3.saturating_sub(rss2) < 3 << 10, "RSS grew {} KiB", rss3 - rss2);
    assert!(c.alive());
}

/// Sets the open-file soft limit of process `pid`, its hard limit 8192 (as it starts here).
fn set_fd_limit(pid: u32, limit: u64) {
    let new = libc::rlimit64 { rlim_cur: limit, rlim_max: 8192 };
    // SAFETY: prlimit64 reads `new` (a live local) and writes nothing (old is null).
    let r = unsafe { libc::prlimit64(pid as libc::pid_t, libc::RLIMIT_NOFILE, &new, std::ptr::null_mut()) };
    assert_eq!(r, 0, "prlimit: {}", std::io::Error::last_os_error());
}

/// The lowest fd number process `pid` has free: with its limit there, no fd can be opened
/// (the limit bounds fd numbers, and every lower one is taken).
fn lowest_free_fd(pid: u32) -> u64 {
    let open: std::collections::BTreeSet<u64> = std::fs::read_dir(format!("/proc/{pid}/fd"))
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
        .collect();
    (0..).find(|n| !open.contains(n)).unwrap()
}

/// With the server's fd table full (here its limit lowered to the fds it holds; in the field,
/// another client flooding it), a message's fds are lost on the way in: that message fails
/// with EMFILE and the connection goes on, so the client can try again once there is room.
/// And the server raises its soft limit to the hard one at start: 1024, the usual soft
/// limit, is a few messages' worth of fds.
#[test]
fn a_full_fd_table_fails_the_message_not_the_connection() {
    use std::os::unix::process::CommandExt;
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("fds.sock");
    let mut command = umdev();
    command.args(["run", "--type", "testdev", "--socket"]).arg(&socket).stdout(Stdio::null());
    // SAFETY: setrlimit is async-signal-safe and touches no memory of the parent.
    unsafe {
        command.pre_exec(|| {
            let limit = libc::rlimit { rlim_cur: 256, rlim_max: 8192 };
            if libc::setrlimit(libc::RLIMIT_NOFILE, &limit) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let server = ChildGuard(command.spawn().unwrap());
    let pid = server.id();
    let deadline = Instant::now() + Duration::from_secs(60);
    while !socket.exists() {
        assert!(Instant::now() < deadline, "umdev run never listened");
        std::thread::sleep(Duration::from_millis(5));
    }
    let mut c = connect(&socket);
    let limits = std::fs::read_to_string(format!("/proc/{pid}/limits")).unwrap();
    let line = limits.lines().find(|l| l.starts_with("Max open files")).unwrap().to_string();
    assert_eq!(line.split_whitespace().collect::<Vec<_>>()[3..5], ["8192", "8192"], "{line}");

    set_fd_limit(pid, lowest_free_fd(pid));
    let ram = common::memfd(1 << 20);
    let r = c.request(Cmd::DmaMap as u16, &dma_map_payload(3, 0, 0, 4096), &[ram.as_raw_fd()]).unwrap();
    assert_eq!(r.errno(), libc::EMFILE, "the fd could not be installed");
    assert!(c.alive(), "the connection goes on");
    set_fd_limit(pid, 8192);
    let r = c.request(Cmd::DmaMap as u16, &dma_map_payload(3, 0, 0, 4096), &[ram.as_raw_fd()]).unwrap();
    assert_eq!(r.errno(), 0, "with room again, the same request succeeds");
}
