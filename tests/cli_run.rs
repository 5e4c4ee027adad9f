//! `umdev types` and `umdev run` as a user runs them: a real process, a real socket, signals.

mod common;

use std::os::unix::fs::{FileTypeExt, PermissionsExt};
use std::time::{Duration, Instant};

use common::process::{run, umdev};
use common::raw::RawClient;

#[test]
fn types_lists_the_test_device() {
    // A run directory with no daemon: one at the machine's default would be asked instead.
    let dir = tempfile::tempdir().unwrap();
    let out =
        umdev().args(["types", "--json"]).env("UMDEV_RUN_DIR", dir.path().join("run")).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let types: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let testdev = types.as_array().unwrap().iter().find(|t| t["name"] == "testdev").expect("testdev listed");
    assert_eq!(testdev["device_api"], "vfio-pci");
    assert!(testdev["available_instances"].as_u64().unwrap() > 0);
}

#[test]
fn run_serves_until_sigterm_then_removes_its_socket() {
    // SIGHUP: the terminal it ran in was closed.
    for signal in [libc::SIGTERM, libc::SIGINT, libc::SIGHUP] {
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("dev.sock");
        let mut child = run(&socket, &["--type", "testdev"]);
        let meta = std::fs::metadata(&socket).unwrap();
        assert!(meta.file_type().is_socket());
        assert_eq!(meta.permissions().mode() & 0o777, 0o600, "socket mode");
        let mut c = RawClient::connect(&socket).unwrap();
        c.negotiate().unwrap();
        assert!(c.alive());
        // A signal with a client still connected: a clean exit all the same.
        nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(child.id() as i32),
            nix::sys::signal::Signal::try_from(signal).unwrap(),
        )
        .unwrap();
        let deadline = Instant::now() + Duration::from_secs(60);
        let status = loop {
            if let Some(s) = child.try_wait().unwrap() {
                break s;
            }
            assert!(Instant::now() < deadline, "umdev run did not exit on signal {signal}");
            std::thread::sleep(Duration::from_millis(5));
        };
        assert!(status.success(), "exit status {status}");
        assert!(!socket.exists(), "socket removed on exit");
        assert!(c.is_closed());
    }
}

/// Whether /proc says `pid` ignores `signal` (its SigIgn mask).
fn ignores(pid: u32, signal: libc::c_int) -> bool {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let mask = status.lines().find_map(|l| l.strip_prefix("SigIgn:")).expect("a SigIgn line").trim();
    u64::from_str_radix(mask, 16).unwrap() & (1 << (signal - 1)) != 0
}

/// `nohup umdev run ... &`: started with SIGHUP ignored, it leaves it ignored (a closed
/// terminal stops nothing), serves on through one, and still stops on SIGTERM.
#[test]
fn run_started_with_sighup_ignored_serves_through_one() {
    use std::os::unix::process::CommandExt;
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("dev.sock");
    let mut command = umdev();
    command
        .arg("run")
        .arg("--socket")
        .arg(&socket)
        .args(["--type", "testdev"])
        .stderr(std::process::Stdio::null());
    // SAFETY: signal(2) is async-signal-safe and touches no memory of the parent, as a
    // pre_exec closure must; SIG_IGN is kept across exec, as nohup relies on.
    unsafe {
        command.pre_exec(|| {
            nix::sys::signal::signal(nix::sys::signal::Signal::SIGHUP, nix::sys::signal::SigHandler::SigIgn)
                .map(drop)
                .map_err(std::io::Error::from)
        });
    }
    let mut child = common::process::ChildGuard(command.spawn().unwrap());
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut c = loop {
        if let Ok(c) = RawClient::connect(&socket) {
            break c;
        }
        assert!(Instant::now() < deadline, "umdev run never listened");
        std::thread::sleep(Duration::from_millis(5));
    };
    c.negotiate().unwrap();
    // Its handlers are in place once it listens: SIGHUP is still ignored, so the kernel
    // drops one sent now.
    assert!(ignores(child.id(), libc::SIGHUP), "umdev run handles SIGHUP over nohup's SIG_IGN");
    assert!(!ignores(child.id(), libc::SIGTERM));
    let pid = nix::unistd::Pid::from_raw(child.id() as i32);
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGHUP).unwrap();
    assert!(c.alive(), "it stopped serving on SIGHUP");
    assert!(child.try_wait().unwrap().is_none());
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM).unwrap();
    assert!(child.wait().unwrap().success());
    assert!(!socket.exists(), "socket removed on exit");
}

/// The QEMU argument `umdev run` prints names its socket by an absolute path, however
/// `--socket` gave it (QEMU runs from another directory), and is one shell word of JSON
/// whatever the path holds (`'`, `"`, `\`): a shell reads it back as the path.
#[test]
fn run_prints_the_qemu_argument_with_the_absolute_socket_path() {
    use std::io::BufRead;
    let dir = tempfile::tempdir().unwrap();
    let odd = r#"it's "q" \d"#;
    std::fs::create_dir(dir.path().join(odd)).unwrap();
    let mut child = common::process::ChildGuard(
        umdev()
            .current_dir(dir.path())
            .args(["run", "--type", "testdev", "--socket", &format!("{odd}/dev.sock")])
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap(),
    );
    let mut lines = std::io::BufReader::new(child.stderr.take().unwrap()).lines();
    let device = lines
        .by_ref()
        .map_while(Result::ok)
        .find(|l| l.contains("vfio-user-pci"))
        .expect("the QEMU argument");
    let absolute = dir.path().join(odd).join("dev.sock");
    let word = device.split_once("-device ").expect("-device ARG").1;
    let read = std::process::Command::new("sh").arg("-c").arg(format!("printf %s {word}")).output().unwrap();
    assert!(read.status.success(), "{device}");
    let json: serde_json::Value = serde_json::from_slice(&read.stdout).unwrap();
    assert_eq!(
        json,
        serde_json::json!({"driver": "vfio-user-pci", "socket": {"type": "unix", "path": absolute.to_str().unwrap()}}),
        "{device}"
    );
    // In the order the documents show it.
    assert!(String::from_utf8_lossy(&read.stdout)
        .starts_with(r#"{"driver":"vfio-user-pci","socket":{"type":"unix","path":"/"#));
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(child.id() as i32), nix::sys::signal::Signal::SIGTERM)
        .unwrap();
    assert!(child.wait().unwrap().success());
    assert!(!absolute.exists());
}

#[test]
fn run_refuses_a_live_socket_and_replaces_a_stale_one() {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("dev.sock");
    // A stale socket file (its server died): replaced.
    drop(std::os::unix::net::UnixListener::bind(&socket).unwrap());
    let mut first = run(&socket, &["--type", "testdev"]);
    // A second server on the same live socket is refused, with a clear error.
    let second = umdev().args(["run", "--type", "testdev", "--socket"]).arg(&socket).output().unwrap();
    assert!(!second.status.success());
    assert!(
        String::from_utf8_lossy(&second.stderr).contains("in use"),
        "{}",
        String::from_utf8_lossy(&second.stderr)
    );
    // And an unknown type is an error too.
    let bad = umdev().args(["run", "--type", "nope", "--socket", "/tmp/x.sock"]).output().unwrap();
    assert!(!bad.status.success());
    assert!(String::from_utf8_lossy(&bad.stderr).contains("unknown device type \"nope\" (see `umdev types`)"));
    first.kill().unwrap();
    first.wait().unwrap();
}

/// An nvme device on a socket named `cntrl` also gets SPDK's transport ID in the banner (its
/// directory, the controller's NQN), one shell word; on another name, none.
#[test]
fn run_prints_spdks_address_for_a_socket_named_cntrl() {
    use std::io::Read;
    let dir = tempfile::tempdir().unwrap();
    for name in ["cntrl", "nvme.sock"] {
        let socket = dir.path().join(name);
        let args = ["--type", "nvme", "--opt", "ns1=ram:16M", "--opt", "serial=BANNER1"];
        let mut child = common::process::run_with_stderr(&socket, &args, std::process::Stdio::piped());
        nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(child.id() as i32),
            nix::sys::signal::Signal::SIGTERM,
        )
        .unwrap();
        let mut log = String::new();
        child.stderr.take().unwrap().read_to_string(&mut log).unwrap();
        let line = log.lines().find(|l| l.contains("spdk_nvme_perf"));
        if name != "cntrl" {
            assert!(line.is_none(), "{log}");
            continue;
        }
        let word = line.and_then(|l| l.split_once(" -r ")).expect("SPDK's -r").1;
        let read =
            std::process::Command::new("sh").arg("-c").arg(format!("printf %s {word}")).output().unwrap();
        let expected = format!(
            "trtype:VFIOUSER traddr:{} subnqn:nqn.2026-12.dev.umdev:nvme:BANNER1",
            dir.path().display()
        );
        assert_eq!(String::from_utf8_lossy(&read.stdout), expected, "{log}");
    }
}

/// Runs `umdev run ARGS`, `flood`s it over its socket, stops it, and checks that its log has
/// a few warnings with `line` in them (8, one more per 10 s taken: umdev_mdev::log_budget),
/// the last saying that `whose` go to debug level.
fn flood_logs_a_few(args: &[&str], flood: impl FnOnce(&std::path::Path), line: &str, whose: &str) {
    use std::io::Read;
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("dev.sock");
    let mut child = common::process::run_with_stderr(&socket, args, std::process::Stdio::piped());
    let start = std::time::Instant::now();
    flood(&socket);
    let earned = start.elapsed().as_secs() as usize / 10;
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(child.id() as i32), nix::sys::signal::Signal::SIGTERM)
        .unwrap();
    let mut log = String::new();
    child.stderr.take().unwrap().read_to_string(&mut log).unwrap();
    let warned = log.lines().filter(|l| l.contains(line)).count();
    assert!((1..=8 + earned).contains(&warned), "{warned} warnings:\n{log}");
    assert!(log.contains(&format!("{whose} are logged at debug level")), "{log}");
}

/// A guest repeating a mistake cannot flood the log either: nvme's refused enables (one a
/// register write apart, as fast as the guest writes) are warnings for the first few, then
/// at debug level.
#[test]
fn a_guest_repeating_a_refused_enable_does_not_flood_the_log() {
    use umdev_testkit::nvme_driver::Transport;
    use umdev_testkit::nvme_guest::NvmeGuest;
    let flood = |socket: &std::path::Path| {
        let mut guest = NvmeGuest::connect(socket, 16 << 20, 1).unwrap();
        // AQA never set: every enable is refused (and sets CSTS.CFS, which a disable clears).
        for _ in 0..200 {
            guest.write32(0x14, 0).unwrap();
            guest.write32(0x14, 6 << 16 | 4 << 20 | 1).unwrap();
        }
    };
    let args = ["--type", "nvme", "--opt", "ns1=ram:16M"];
    flood_logs_a_few(&args, flood, "enable refused", "this device's further warnings");
}

/// A transfer into memory the client never mapped (SPDK's initiator past its 16 regions, say)
/// is visible at the default level, a few times, however many the guest sends.
#[test]
fn transfers_into_unmapped_memory_are_logged_a_few_times() {
    use umdev_devices::nvme::spec::Status;
    use umdev_testkit::nvme_guest::NvmeGuest;
    let flood = |socket: &std::path::Path| {
        let mut d = NvmeGuest::connect(socket, 96 << 20, 2).unwrap().driver();
        d.enable().unwrap();
        d.create_io_queues(1, 64, true).unwrap();
        // Past the 96 MiB the client mapped.
        let unmapped = 1u64 << 40;
        for _ in 0..40 {
            let status = d.rw(1, true, 1, 0, 8, 512, &[unmapped], 0).unwrap();
            assert_eq!(status, Status::DATA_TRANSFER_ERROR);
        }
    };
    let args = ["--type", "nvme", "--opt", "ns1=ram:16M"];
    flood_logs_a_few(&args, flood, "is not mapped: Data Transfer Error", "this device's further warnings");
}

/// A client repeating a mistake cannot flood the log at its default level, nor by
/// reconnecting: a few warnings, then debug only (the statistics count every one).
#[test]
fn a_client_repeating_a_mistake_does_not_flood_the_log() {
    let flood = |socket: &std::path::Path| {
        // The budget is the instance's: a client that reconnects does not get a new one.
        for _ in 0..2 {
            let mut c = RawClient::connect(socket).unwrap();
            c.negotiate().unwrap();
            for id in 0..200u16 {
                let stray = common::raw::message(1000 + id, 1, 1, &[]);
                c.send_bytes(&stray, &[]).unwrap();
            }
            assert!(c.alive(), "the connection goes on");
        }
    };
    let whose = "this instance's further client mistakes";
    flood_logs_a_few(&["--type", "testdev"], flood, "matches no request", whose);
}
