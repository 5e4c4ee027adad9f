//! `scripts/get-qemu`, the QEMU fetcher a bare clone's tests use: one fetch at a time (two
//! test binaries fetching at once once corrupted each other's apt lists), and exit 77 with a
//! reason where QEMU cannot be had, so the tests skip instead of failing. No download here:
//! the fetch itself is exercised by every QEMU test.

mod common;

use std::fs::File;
use std::io::Read;
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::process::ChildGuard;

/// get-qemu with no QEMU of the caller's or on $PATH: it must use DIR.
fn get_qemu(dir: &Path, path: &str) -> Command {
    let mut cmd = Command::new(common::qemu::get_qemu());
    cmd.arg(dir).env_remove("UMDEV_QEMU").env_remove("UMDEV_QEMU_DIR").env("PATH", path);
    cmd
}

/// A $PATH in `dir` with the shell tools the script uses, and no apt-get, dpkg or QEMU.
fn tools(dir: &Path) -> String {
    let bin = dir.join("bin");
    std::fs::create_dir(&bin).unwrap();
    for tool in
        ["sh", "bash", "mkdir", "mktemp", "flock", "grep", "sed", "head", "tail", "cat", "rm", "dirname"]
    {
        let real = ["/usr/bin", "/bin"].iter().map(|d| Path::new(d).join(tool)).find(|p| p.exists());
        std::os::unix::fs::symlink(real.unwrap_or_else(|| panic!("no {tool}")), bin.join(tool)).unwrap();
    }
    bin.to_str().unwrap().to_string()
}

/// A stand-in for a fetched QEMU: says it has vfio-user-pci.
fn fake_qemu(path: &Path) {
    std::fs::write(path, "#!/bin/sh\necho 'name \"vfio-user-pci\", bus PCI'\n").unwrap();
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o755)).unwrap();
}

/// The pids of `pid`'s children.
fn children(pid: u32) -> Vec<u32> {
    std::fs::read_to_string(format!("/proc/{pid}/task/{pid}/children"))
        .unwrap_or_default()
        .split_whitespace()
        .filter_map(|p| p.parse().ok())
        .collect()
}

fn comm(pid: u32) -> String {
    std::fs::read_to_string(format!("/proc/{pid}/comm")).unwrap_or_default().trim().to_string()
}

#[test]
fn a_second_fetch_waits_for_the_first_and_uses_its_copy() {
    let dir = tempfile::tempdir().unwrap();
    // A fetch under way holds the lock.
    let lock = nix::fcntl::Flock::lock(
        File::create(dir.path().join(".lock")).unwrap(),
        nix::fcntl::FlockArg::LockExclusiveNonblock,
    )
    .unwrap();
    let bin = tools(dir.path());
    let mut second =
        ChildGuard(get_qemu(dir.path(), &bin).stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().unwrap());
    // It waits in flock(1) for the lock ...
    let deadline = Instant::now() + Duration::from_secs(30);
    while !children(second.id()).iter().any(|&c| comm(c) == "flock") {
        assert!(second.try_wait().unwrap().is_none(), "get-qemu did not wait for the lock");
        assert!(Instant::now() < deadline, "get-qemu never waited in flock");
        std::thread::sleep(Duration::from_millis(10));
    }
    // ... while the first finishes its copy and lets go.
    fake_qemu(&dir.path().join("qemu-system-x86_64"));
    drop(lock);
    let (mut stdout, mut stderr) = (String::new(), String::new());
    second.stdout.take().unwrap().read_to_string(&mut stdout).unwrap();
    second.stderr.take().unwrap().read_to_string(&mut stderr).unwrap();
    assert!(second.wait().unwrap().success(), "{stderr}");
    assert_eq!(stdout.trim(), dir.path().join("qemu-system-x86_64").to_str().unwrap());
    assert!(!dir.path().join("apt").exists(), "the second fetcher downloaded too");
}

#[test]
fn without_apt_it_says_why_and_exits_77() {
    let dir = tempfile::tempdir().unwrap();
    let bin = tools(dir.path());
    let out = get_qemu(&dir.path().join("qemu"), &bin).output().unwrap();
    assert_eq!(out.status.code(), Some(77), "{}", String::from_utf8_lossy(&out.stderr));
    let why = String::from_utf8_lossy(&out.stderr);
    assert!(why.contains("no apt-get") && why.contains("UMDEV_QEMU"), "{why}");
    assert!(out.stdout.is_empty());
}

#[test]
fn umdev_qemu_is_used_as_given() {
    let out = Command::new(common::qemu::get_qemu()).env("UMDEV_QEMU", "/opt/my/qemu").output().unwrap();
    assert!(out.status.success());
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "/opt/my/qemu");
}

#[test]
fn the_guest_harness_says_why_it_cannot_run_without_qemu() {
    let dir = tempfile::tempdir().unwrap();
    let bin = tools(dir.path());
    let out = Command::new(common::guest::harness())
        .arg("prepare")
        .env_remove("UMDEV_QEMU")
        .env("UMDEV_QEMU_DIR", dir.path().join("qemu"))
        .env("PATH", &bin)
        .output()
        .unwrap();
    // 77: the guest tests skip (tests/common/guest.rs), saying this.
    assert_eq!(out.status.code(), Some(77), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(String::from_utf8_lossy(&out.stderr).contains("no QEMU: get-qemu: no apt-get"));
}
