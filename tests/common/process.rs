//! Real `umdev` processes: the command, a guard that never leaves one running, and what
//! /proc says about them.

use std::ops::{Deref, DerefMut};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use umdev_server::client::RawClient;

/// A child process that is killed and reaped when dropped, so that a failing assertion
/// leaves nothing running.
pub struct ChildGuard(pub Child);

impl Deref for ChildGuard {
    type Target = Child;
    fn deref(&self) -> &Child {
        &self.0
    }
}

impl DerefMut for ChildGuard {
    fn deref_mut(&mut self) -> &mut Child {
        &mut self.0
    }
}

impl Drop for ChildGuard {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// The `umdev` binary under test.
pub fn umdev() -> Command {
    Command::new(env!("CARGO_BIN_EXE_umdev"))
}

/// Starts `umdev run --socket <socket> <args>` (stderr discarded) and waits until the socket
/// accepts a connection.
pub fn run(socket: &Path, args: &[&str]) -> ChildGuard {
    let child = ChildGuard(
        umdev().arg("run").arg("--socket").arg(socket).args(args).stderr(Stdio::null()).spawn().unwrap(),
    );
    let deadline = Instant::now() + Duration::from_secs(10);
    while RawClient::connect(socket).is_err() {
        assert!(Instant::now() < deadline, "umdev run never listened");
        std::thread::sleep(Duration::from_millis(5));
    }
    // The probe connection above was turned away or served and closed; let it finish.
    std::thread::sleep(Duration::from_millis(20));
    child
}

/// A `kB` field of `/proc/<pid>/status` (`field` with its colon, as `"VmRSS:"`).
pub fn status_kib(pid: u32, field: &str) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap()
        .lines()
        .find_map(|l| l.strip_prefix(field).map(|v| v.trim().trim_end_matches("kB").trim().parse().unwrap()))
        .unwrap()
}

/// fds open in process `pid`.
pub fn fd_count(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd")).unwrap().count()
}
