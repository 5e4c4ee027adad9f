//! SPDK's own NVMe initiator (`spdk_nvme_perf`, transport VFIOUSER) against `umdev run --type
//! nvme` in its default configuration: it attaches (it needs the mappable doorbell page that
//! `doorbells=auto` offers it), reads and writes with data checked by nothing but SPDK's own
//! status, detaches (Delete queues, shutdown notification with CC.EN still 1, DMA_UNMAP with
//! the mapping's fd attached), and attaches again. The server's log shows no refused message
//! and no worker that did not stop.
//!
//! And SPDK's block layer (`spdk_dd` over a `bdev_nvme` controller on the same transport)
//! writes 32 MiB at queue depth 32 and reads it back, in 128 KiB and in 4 KiB blocks: what it
//! reads is what it wrote.
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

/// A server of a 64 MiB RAM namespace on `dir/cntrl`, its log piped, once it listens.
fn serve(dir: &Path) -> ChildGuard {
    let socket = dir.join("cntrl");
    let server = ChildGuard(
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
    server
}

/// Stops `server` with SIGTERM; its log, after checking it exited cleanly and logged no
/// refusal, warning or error.
fn stop(mut server: ChildGuard) -> String {
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(server.id() as i32), nix::sys::signal::SIGTERM)
        .unwrap();
    let mut log = String::new();
    server.stderr.take().unwrap().read_to_string(&mut log).unwrap();
    assert!(server.wait().unwrap().success(), "umdev run: {log}");
    for bad in ["refused", "did not stop", "WARN", "ERROR"] {
        assert!(!log.contains(bad), "{bad:?} in the server's log: {log}");
    }
    log
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
    let server = serve(dir.path());
    for workload in [
        &["-q", "1", "-o", "4096", "-w", "randwrite"][..],
        &["-q", "32", "-o", "4096", "-w", "randread"],
        &["-q", "8", "-o", "131072", "-w", "read"],
    ] {
        let out = perf(&perf_bin, dir.path(), workload);
        assert!(total_iops(&out) > 0.0, "{out}");
    }
    let log = stop(server);
    assert_eq!(log.matches("client connected").count(), 4, "the probe and three attaches: {log}");
    assert!(log.contains("doorbells=auto: the client announced no VERSION capabilities"), "{log}");
}

#[test]
fn spdks_block_layer_reads_back_what_it_wrote_at_queue_depth_32() {
    let Some(perf_bin) = spdk_perf() else { return };
    let dd_bin = perf_bin.with_file_name("spdk_dd");
    assert!(dd_bin.is_file(), "no spdk_dd beside {}", perf_bin.display());
    let dir = tempfile::tempdir().unwrap();
    let server = serve(dir.path());
    let config = dir.path().join("bdev.json");
    let attach = serde_json::json!({"subsystems": [{"subsystem": "bdev", "config": [{
        "method": "bdev_nvme_attach_controller",
        "params": {"name": "Nvme0", "trtype": "VFIOUSER", "traddr": dir.path(),
                   "subnqn": "nqn.2019-07.io.spdk:cnode0"}}]}]});
    std::fs::write(&config, attach.to_string()).unwrap();
    let dd = |args: &[&str]| {
        let out = Command::new(&dd_bin)
            .args(["--no-huge", "-s", "512", "--json"])
            .arg(&config)
            .args(args)
            .current_dir(dir.path())
            .output()
            .expect("run spdk_dd");
        let text =
            format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        assert!(out.status.success(), "spdk_dd {args:?} failed: {text}");
    };
    // 32 MiB no two blocks of which are alike (xorshift).
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    let data: Vec<u8> = (0..(32 << 20) / 8)
        .flat_map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x.to_le_bytes()
        })
        .collect();
    std::fs::write(dir.path().join("in.bin"), &data).unwrap();
    dd(&["--if", "in.bin", "--ob", "Nvme0n1", "--bs", "4096", "--qd", "32"]);
    dd(&["--ib", "Nvme0n1", "--of", "big.bin", "--bs", "131072", "--qd", "8", "--count", "256"]);
    dd(&["--ib", "Nvme0n1", "--of", "small.bin", "--bs", "4096", "--qd", "32", "--count", "8192"]);
    for name in ["big.bin", "small.bin"] {
        let back = std::fs::read(dir.path().join(name)).unwrap();
        assert!(back == data, "{name}: what SPDK read back differs from what it wrote");
    }
    stop(server);
}
