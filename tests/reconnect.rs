//! Handover: whatever the previous client did on its way out, the next client is served as
//! soon as that client's cleanup is done. Against a real `umdev run` process, for every
//! device type `umdev types` lists: 100 rounds of each way of leaving, each followed at once
//! by a client that must get VERSION and DEVICE_GET_INFO answered; afterwards the process
//! holds as many fds and memory mappings as it did idle. A second client while a live one is
//! connected is still closed at once. QEMU stopped with SIGTERM is in `qemu_reconnect`.

mod common;

use std::io::{BufRead, BufReader, Write};
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::process::{fd_count, run, umdev, ChildGuard};
use common::raw::*;
use umdev_server::wire::{flags, Command as Cmd, HEADER_SIZE};

const ROUNDS: usize = 100;
/// The child that is killed mid-session runs this test binary again, in this test.
const CHILD_ENV: &str = "UMDEV_RECONNECT_CHILD_SOCKET";

/// Every type the binary serves.
fn device_types() -> Vec<String> {
    // A run directory with no daemon: one at the machine's default would be asked instead.
    let dir = tempfile::tempdir().unwrap();
    let out =
        umdev().args(["types", "--json"]).env("UMDEV_RUN_DIR", dir.path().join("run")).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let types: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    types.as_array().unwrap().iter().map(|t| t["name"].as_str().unwrap().to_string()).collect()
}

/// Memory mappings of process `pid`: all of them, and those of memfds (guest memory).
fn map_count(pid: u32) -> (usize, usize) {
    let maps = std::fs::read_to_string(format!("/proc/{pid}/maps")).unwrap();
    (maps.lines().count(), maps.lines().filter(|l| l.contains("/memfd:")).count())
}

/// Mappings beyond the idle count that are not a leak: glibc keeps the stacks of exited
/// threads mapped for reuse (a stack and its guard page each, up to 40 MiB of them: 20 of
/// Rust's 2 MiB thread stacks), and connection, handover and device threads come and go. A
/// leak per round would show hundreds.
const THREAD_STACK_CACHE: usize = 48;

/// The tests here run one at a time: a test that forks (spawning QEMU or umdev) while another
/// has just closed a client socket gives the child a copy of that socket until it execs, and
/// the server rightly sees the client as still connected. Real clients do not fork under
/// their own connections; the tests must not either.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|p| p.into_inner())
}

/// The VERSION message QEMU sends.
fn version_message(id: u16) -> Vec<u8> {
    let mut p = vec![0, 0, 0, 0];
    p.extend_from_slice(QEMU_CAPS.as_bytes());
    p.push(0);
    message(id, Cmd::Version as u16, flags::TYPE_COMMAND, &p)
}

/// A new client must be served at once: VERSION, then DEVICE_GET_INFO.
fn served(socket: &Path, what: &str) {
    served_client(socket, what);
}

/// As [`served`], and the client stays connected: the server has finished the previous
/// client's cleanup before serving it (the handover), so figures sampled now are the idle
/// ones plus this client's connection, the same every time.
fn served_client(socket: &Path, what: &str) -> RawClient {
    let mut c = RawClient::connect(socket).unwrap_or_else(|e| panic!("after {what}: connect: {e}"));
    c.negotiate().unwrap_or_else(|e| panic!("after {what}: VERSION not answered: {e}"));
    let mut info = le32(16).to_vec();
    info.extend_from_slice(&[0; 12]);
    let r = c
        .request(Cmd::DeviceGetInfo as u16, &info, &[])
        .unwrap_or_else(|e| panic!("after {what}: DEVICE_GET_INFO not answered: {e}"));
    assert_eq!(r.errno(), 0, "after {what}: DEVICE_GET_INFO failed");
    assert!(r.payload.len() >= 16, "after {what}: short DEVICE_GET_INFO reply");
    c
}

/// The ways a client leaves, each done once on a fresh connection.
fn leave(socket: &Path, pattern: &str, ram: &std::fs::File) {
    if pattern == "mapped memory, then gone" {
        let mut c = RawClient::connect(socket).unwrap();
        c.negotiate().unwrap();
        let map = dma_map_payload(3, 0, 0, 1 << 20);
        // Sent, and gone before the server may even have handled it.
        c.send(Cmd::DmaMap as u16, flags::TYPE_COMMAND, &map, &[ram.as_raw_fd()]).unwrap();
        return;
    }
    let mut s = UnixStream::connect(socket).unwrap();
    match pattern {
        "before a byte" => {}
        "mid-header" => s.write_all(&version_message(1)[..HEADER_SIZE / 2]).unwrap(),
        "mid-payload" => s.write_all(&version_message(1)[..HEADER_SIZE + 20]).unwrap(),
        "reply never read" => s.write_all(&version_message(1)).unwrap(),
        "shut down writing" => {
            s.write_all(&version_message(1)).unwrap();
            s.shutdown(std::net::Shutdown::Write).unwrap();
        }
        other => unreachable!("{other}"),
    }
    drop(s);
}

/// A client in another process that connects, negotiates, maps memory and is SIGKILLed.
fn killed_child(socket: &Path) {
    let mut child = ChildGuard(
        Command::new(std::env::current_exe().unwrap())
            .args(["--exact", "reconnect_child", "--nocapture", "--test-threads=1"])
            .env(CHILD_ENV, socket)
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    let stdout = child.stdout.take().unwrap();
    let ready = BufReader::new(stdout).lines().any(|l| l.is_ok_and(|l| l.contains("child-ready")));
    assert!(ready, "the child client never got going");
    child.kill().unwrap();
    child.wait().unwrap();
}

/// Not a test of its own: the body of the child process `killed_child` starts.
#[test]
fn reconnect_child() {
    let Some(socket) = std::env::var_os(CHILD_ENV) else { return };
    let mut c = RawClient::connect(Path::new(&socket)).unwrap();
    c.negotiate().unwrap();
    let ram = common::memfd(2 << 20);
    let r = c.request(Cmd::DmaMap as u16, &dma_map_payload(3, 0, 0, 2 << 20), &[ram.as_raw_fd()]).unwrap();
    assert_eq!(r.errno(), 0);
    println!("child-ready");
    std::io::stdout().flush().unwrap();
    std::thread::sleep(Duration::from_secs(60));
}

/// Waits until `pid` is back to `fds` fds, no more guest-memory mappings than idle and no
/// growth in mappings beyond the thread-stack cache.
fn back_to_idle(pid: u32, fds: usize, (maps, memfd_maps): (usize, usize), ty: &str) {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let (f, (m, g)) = (fd_count(pid), map_count(pid));
        if f == fds && g == memfd_maps && m <= maps + THREAD_STACK_CACHE {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{ty}: {f} fds, {m} mappings ({g} of guest memory) left; {fds}, {maps} ({memfd_maps}) idle"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

#[test]
fn every_leave_pattern_is_followed_by_a_served_client() {
    let _serial = serial();
    let patterns = [
        "before a byte",
        "mid-header",
        "mid-payload",
        "reply never read",
        "shut down writing",
        "mapped memory, then gone",
    ];
    let ram = common::memfd(1 << 20);
    for ty in device_types() {
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("dev.sock");
        let child = run(&socket, &["--type", &ty]);
        let pid = child.id();
        served(&socket, "start");
        // Idle figures once one client has come and gone (threads and buffers exist by then),
        // taken, as the last ones are, with one served client connected.
        let sampler = served_client(&socket, "start");
        let (fds, maps) = (fd_count(pid), map_count(pid));
        drop(sampler);
        for pattern in patterns {
            for round in 0..ROUNDS {
                leave(&socket, pattern, &ram);
                served(&socket, &format!("{ty}: {pattern} (round {round})"));
            }
        }
        for round in 0..ROUNDS {
            killed_child(&socket);
            served(&socket, &format!("{ty}: a killed client (round {round})"));
        }
        let sampler = served_client(&socket, "the last pattern");
        back_to_idle(pid, fds, maps, &ty);
        drop(sampler);
        drop(child);
    }
}

#[test]
fn a_second_client_while_one_is_live_is_closed_at_once() {
    let _serial = serial();
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("dev.sock");
    let _child = run(&socket, &["--type", "testdev"]);
    let mut live = RawClient::connect(&socket).unwrap();
    live.negotiate().unwrap();
    let started = Instant::now();
    let mut second = RawClient::connect(&socket).unwrap();
    assert!(second.is_closed(), "the second client must be turned away");
    // At once, not after a handover's wait (seconds): the bound only tells the two apart.
    assert!(started.elapsed() < Duration::from_secs(2), "turned away at once, not after a wait");
    assert!(live.alive(), "the live client is unaffected");
    drop(live);
    served(&socket, "the live client left");
}

/// QEMU stopped with SIGTERM, then at once a client (a raw one, then a restarted QEMU): both
/// are served. Three times per device type. Skips only when QEMU cannot be fetched.
#[test]
fn qemu_stopped_with_sigterm_then_a_client_at_once() {
    let _serial = serial();
    let Some(qemu) = common::qemu::qemu_binary() else { return };
    for ty in device_types() {
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("dev.sock");
        let child = run(&socket, &["--type", &ty]);
        let pid = child.id();
        served(&socket, "start");
        let sampler = served_client(&socket, "start");
        let idle = (fd_count(pid), map_count(pid));
        drop(sampler);
        let mut q = common::qemu::Qtest::start(&qemu, &socket, 64, dir.path()).unwrap();
        for round in 0..3 {
            let vendor = q.cfg_read32(0) & 0xffff;
            assert!(
                vendor != 0xffff && vendor != 0,
                "{ty}: QEMU did not realize the device (round {round})\n{}",
                q.stderr()
            );
            q.terminate();
            served(&socket, &format!("{ty}: QEMU got SIGTERM (round {round})"));
            // A management stack restarting QEMU at once.
            q = common::qemu::Qtest::start(&qemu, &socket, 64, dir.path()).unwrap();
        }
        let vendor = q.cfg_read32(0) & 0xffff;
        assert!(vendor != 0xffff && vendor != 0, "{ty}: the restarted QEMU has no device\n{}", q.stderr());
        q.terminate();
        drop(q);
        let sampler = served_client(&socket, &format!("{ty}: the last QEMU"));
        back_to_idle(pid, idle.0, idle.1, &ty);
        drop(sampler);
        drop(child);
    }
}
