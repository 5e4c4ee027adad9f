//! SPDK's own NVMe initiator (`spdk_nvme_perf`, transport VFIOUSER) against `umdev run --type
//! nvme` in its default configuration: it attaches (it needs the mappable doorbell page that
//! `doorbells=auto` offers it), reads and writes with data checked by nothing but SPDK's own
//! status, detaches (Delete queues, shutdown notification with CC.EN still 1, DMA_UNMAP with
//! the mapping's fd attached), and attaches again. The server's log shows no refused message
//! and no worker that did not stop.
//!
//! Needs an SPDK build with vfio-user, which `scripts/build-spdk` provides: `UMDEV_SPDK_DIR`
//! if it names one, a build the script made before, or a new one from git (see the script;
//! about 5 minutes). When SPDK cannot be obtained or built (no sources reachable, say), the
//! test prints the script's reason and passes: CI need not build SPDK.

mod common;

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::process::{umdev, ChildGuard};
use umdev_testkit::client::RawClient;

/// `spdk_nvme_perf` of the SPDK build `scripts/build-spdk` finds or makes, if it can.
fn spdk_perf() -> Option<PathBuf> {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/build-spdk");
    let out = Command::new(&script).stderr(Stdio::inherit()).output().expect("run scripts/build-spdk");
    match out.status.code() {
        Some(0) => {}
        Some(77) => {
            eprintln!("skipped: SPDK cannot be obtained or built here (scripts/build-spdk said why above)");
            return None;
        }
        _ => panic!("scripts/build-spdk failed: {}", out.status),
    }
    let dir = String::from_utf8_lossy(&out.stdout).trim().to_string();
    let perf = Path::new(&dir).join("build/bin/spdk_nvme_perf");
    assert!(perf.is_file(), "scripts/build-spdk printed {dir}, which holds no build/bin/spdk_nvme_perf");
    Some(perf)
}

/// One `spdk_nvme_perf` run (DPDK without hugepages: its memory is one memfd) against the
/// controller in `dir`; its output.
fn perf(perf: &Path, dir: &Path, workload: &[&str]) -> String {
    let trid = format!("trtype:VFIOUSER traddr:{} subnqn:nqn.2019-07.io.spdk:cnode0", dir.display());
    let out = Command::new(perf)
        .args(["--no-huge", "-s", "256", "-c", "0x1", "-t", "2"])
        .args(workload)
        .arg("-r")
        .arg(&trid)
        .output()
        .expect("run spdk_nvme_perf");
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "spdk_nvme_perf {workload:?} failed: {text}");
    text
}

/// IOPS of the `Total` line.
fn total_iops(out: &str) -> f64 {
    let line = out.lines().find(|l| l.starts_with("Total")).unwrap_or_else(|| panic!("no Total line: {out}"));
    line.split(':').nth(1).and_then(|r| r.split_whitespace().next()).and_then(|v| v.parse().ok()).unwrap()
}

#[test]
fn spdks_initiator_attaches_to_the_default_configuration_does_io_and_detaches_cleanly() {
    let Some(perf_bin) = spdk_perf() else { return };
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("cntrl");
    let mut server = ChildGuard(
        umdev()
            .env("RUST_LOG", "info")
            .args(["run", "--type", "nvme", "--opt", "ns1=ram:64M", "--socket"])
            .arg(&socket)
            .stderr(Stdio::piped())
            .spawn()
            .unwrap(),
    );
    let deadline = Instant::now() + Duration::from_secs(60);
    while RawClient::connect(&socket).is_err() {
        assert!(Instant::now() < deadline, "umdev run never listened");
        std::thread::sleep(Duration::from_millis(5));
    }
    for workload in [
        &["-q", "1", "-o", "4096", "-w", "randwrite"][..],
        &["-q", "32", "-o", "4096", "-w", "randread"],
        &["-q", "8", "-o", "131072", "-w", "read"],
    ] {
        let out = perf(&perf_bin, dir.path(), workload);
        assert!(total_iops(&out) > 0.0, "{out}");
    }
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(server.id() as i32), nix::sys::signal::SIGTERM)
        .unwrap();
    let mut log = String::new();
    server.stderr.take().unwrap().read_to_string(&mut log).unwrap();
    assert!(server.wait().unwrap().success(), "umdev run: {log}");
    assert_eq!(log.matches("client connected").count(), 4, "the probe and three attaches: {log}");
    assert!(log.contains("doorbells=auto: the client announced no VERSION capabilities"), "{log}");
    for bad in ["refused", "did not stop", "WARN", "ERROR"] {
        assert!(!log.contains(bad), "{bad:?} in the server's log: {log}");
    }
}
