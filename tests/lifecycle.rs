//! The mdevctl-style lifecycle through the CLI, against a real `umdev daemon` process:
//! start/stop/list/define/undefine/stats/types, every error a user can hit, and
//! persistence across a daemon restart.

mod common;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use common::process::{umdev, ChildGuard, Dirs};
use common::raw::RawClient;

/// The directories, and a daemon on them.
struct Env(Dirs);

impl std::ops::Deref for Env {
    type Target = Dirs;
    fn deref(&self) -> &Dirs {
        &self.0
    }
}

impl Env {
    fn new() -> Env {
        Env(Dirs::new())
    }

    /// The daemon, logging at info level (as under the journal) into [`Dirs::log`].
    fn daemon(&self) -> Daemon {
        let child = ChildGuard(
            umdev()
                .arg("--run-dir")
                .arg(&self.run)
                .arg("--state-dir")
                .arg(&self.state)
                .arg("daemon")
                .env("RUST_LOG", "info")
                .stderr(std::fs::OpenOptions::new().create(true).append(true).open(self.log()).unwrap())
                .spawn()
                .unwrap(),
        );
        let control = self.run.join("control.sock");
        let deadline = Instant::now() + Duration::from_secs(60);
        while std::os::unix::net::UnixStream::connect(&control).is_err() {
            assert!(Instant::now() < deadline, "the daemon never came up");
            std::thread::sleep(Duration::from_millis(5));
        }
        Daemon { child }
    }

    fn list(&self) -> Vec<serde_json::Value> {
        serde_json::from_str::<serde_json::Value>(&self.ok(&["list", "--json"]))
            .unwrap()
            .as_array()
            .unwrap()
            .clone()
    }

    fn available(&self, ty: &str) -> u64 {
        let types: serde_json::Value = serde_json::from_str(&self.ok(&["types", "--json"])).unwrap();
        types.as_array().unwrap().iter().find(|t| t["name"] == ty).unwrap()["available_instances"]
            .as_u64()
            .unwrap()
    }
}

struct Daemon {
    child: ChildGuard,
}

impl Daemon {
    fn stop(mut self) {
        nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(self.child.id() as i32),
            nix::sys::signal::Signal::SIGTERM,
        )
        .unwrap();
        let status = self.child.wait().unwrap();
        assert!(status.success(), "daemon exit {status}");
    }
}

fn socket_of(line: &str) -> PathBuf {
    PathBuf::from(line.split_whitespace().nth(1).expect("uuid socket"))
}

const UUID: &str = "5a1e4c36-0f8e-4a5e-9d2f-000000000001";

#[test]
fn lifecycle_commands_and_their_errors() {
    let env = Env::new();
    // No daemon yet.
    assert!(env.fails(&["list"]).contains("daemon is not running"));
    assert!(env.fails(&["start", "--type", "testdev"]).contains("daemon is not running"));
    let daemon = env.daemon();

    let before = env.available("testdev");
    let started = env.ok(&["start", "--type", "testdev", "--uuid", UUID]);
    assert!(started.starts_with(UUID));
    let socket = socket_of(&started);
    assert_eq!(socket, env.run.join(format!("{UUID}.sock")));
    assert_eq!(env.available("testdev"), before - 1, "capacity follows creation");
    let generated = env.ok(&["start", "--type", "testdev", "--pin-mode", "lock"]);
    let generated_uuid = generated.split_whitespace().next().unwrap().to_string();
    assert!(uuid::Uuid::parse_str(&generated_uuid).is_ok(), "a UUID is generated");
    assert_eq!(env.list().len(), 2);

    // Errors: duplicate UUID, bad UUID, unknown type, bad option, unknown UUID.
    assert!(env.fails(&["start", "--type", "testdev", "--uuid", UUID]).contains("already running"));
    assert!(env.fails(&["start", "--type", "testdev", "--uuid", "not-a-uuid"]).contains("not a UUID"));
    assert!(env.fails(&["start", "--type", "nope"]).contains("unknown device type"));
    assert!(env.fails(&["start", "--type", "testdev", "--opt", "size=1"]).contains("unknown option"));
    assert!(env
        .fails(&["start", "--type", "testdev", "--pin-mode", "pinned"])
        .contains("possible values: track, lock, kernel"));
    assert!(env
        .fails(&["stop", "--uuid", "5a1e4c36-0f8e-4a5e-9d2f-00000000ffff"])
        .contains("no running instance"));
    assert!(env.fails(&["start"]).contains("give a type"));

    // Stop: refused while a client is connected, unless forced (which disconnects it).
    let mut client = RawClient::connect(&socket).unwrap();
    client.negotiate().unwrap();
    let listed = env.list();
    let entry = listed.iter().find(|i| i["uuid"] == UUID).unwrap();
    assert_eq!(entry["connected"], true);
    assert!(env.fails(&["stop", "--uuid", UUID]).contains("--force"));
    assert!(client.alive(), "the refused stop left the client alone");
    env.ok(&["stop", "--uuid", UUID, "--force"]);
    assert!(client.is_closed());
    // The log says the client was cut (a polling client does not notice), and keeps the
    // instance's last counters.
    let log = std::fs::read_to_string(env.log()).unwrap();
    assert!(log.contains(&format!("instance {UUID}: stopped with its client connected")), "{log}");
    let last =
        log.lines().find_map(|l| l.split_once(&format!("instance {UUID} stopped: "))).expect("counters");
    let last: serde_json::Value = serde_json::from_str(last.1).unwrap();
    assert_eq!(last["protocol"]["connections"], 1, "{last}");
    assert!(!socket.exists(), "the socket is freed");
    assert_eq!(env.available("testdev"), before - 1, "capacity freed (one instance left)");

    // Stats of the remaining instance: JSON with the documented counters, the instance named
    // as `list --json` names it.
    let stats: serde_json::Value =
        serde_json::from_str(&env.ok(&["stats", "--uuid", &generated_uuid])).unwrap();
    assert_eq!(stats["uuid"], generated_uuid, "{stats}");
    assert!(stats.get("id").is_none(), "one name for the UUID: {stats}");
    let listed = env.list();
    let entry = listed.iter().find(|i| i["uuid"] == generated_uuid).unwrap();
    assert_eq!((&stats["socket"], &stats["connected"]), (&entry["socket"], &entry["connected"]));
    for key in ["pin_calls", "runs", "pages", "locked_bytes", "unmap_waits"] {
        assert!(stats["dma"].get(key).is_some(), "stats lack dma.{key}: {stats}");
    }
    assert!(stats["protocol"].get("messages").is_some() && stats["protocol"].get("errors").is_some());
    env.ok(&["stop", "-u", &generated_uuid]);
    assert_eq!(env.available("testdev"), before);
    daemon.stop();
    assert!(!env.run.join("control.sock").exists(), "the control socket is removed on exit");
}

#[test]
fn definitions_persist_and_auto_ones_start_with_the_daemon() {
    let env = Env::new();
    let auto = "5a1e4c36-0f8e-4a5e-9d2f-00000000aaaa";
    let manual = "5a1e4c36-0f8e-4a5e-9d2f-00000000bbbb";
    // Defining needs no daemon, as with mdevctl.
    env.ok(&["define", "--type", "testdev", "--uuid", auto, "--auto"]);
    env.ok(&["define", "--type", "testdev", "--uuid", manual, "--pin-mode", "lock"]);
    assert!(env.fails(&["define", "--type", "testdev", "--uuid", auto]).contains("already defined"));
    assert!(env.fails(&["define", "--type", "nope"]).contains("unknown device type"));
    let defined: serde_json::Value = serde_json::from_str(&env.ok(&["list", "--defined", "--json"])).unwrap();
    assert_eq!(defined.as_array().unwrap().len(), 2);
    assert!(env.ok(&["list", "--defined"]).contains(&format!("{auto} testdev auto")));

    for round in 0..2 {
        // Each daemon start (a restart, the second time) brings up the auto definition only.
        let daemon = env.daemon();
        let running: Vec<String> =
            env.list().iter().map(|i| i["uuid"].as_str().unwrap().to_string()).collect();
        assert_eq!(running, vec![auto.to_string()], "round {round}");
        // The manual one starts by UUID, with the options it was defined with.
        env.ok(&["start", "--uuid", manual]);
        let listed = env.list();
        let m = listed.iter().find(|i| i["uuid"] == manual).unwrap();
        assert_eq!(m["options"]["pin_mode"], "lock");
        assert!(Path::new(m["socket"].as_str().unwrap()).exists());
        daemon.stop();
    }

    assert!(env.fails(&["undefine", "--uuid", "5a1e4c36-0f8e-4a5e-9d2f-00000000cccc"]).contains("no device"));
    env.ok(&["undefine", "--uuid", auto]);
    let daemon = env.daemon();
    assert!(env.list().is_empty(), "an undefined device no longer starts");
    assert!(env.fails(&["start", "--uuid", auto]).contains("no device"));
    daemon.stop();
}

#[test]
fn mtty_types_share_one_pool_of_ports_until_exhausted() {
    let env = Env::new();
    let daemon = env.daemon();
    assert_eq!((env.available("mtty-1"), env.available("mtty-2")), (24, 12));
    let dual = env.ok(&["start", "--type", "mtty-2"]);
    let dual_uuid = dual.split_whitespace().next().unwrap().to_string();
    assert_eq!((env.available("mtty-1"), env.available("mtty-2")), (22, 11), "both types follow the pool");
    // Take the rest: 11 more dual-port instances.
    for _ in 0..11 {
        env.ok(&["start", "--type", "mtty-2"]);
    }
    assert_eq!((env.available("mtty-1"), env.available("mtty-2")), (0, 0));
    let err = env.fails(&["start", "--type", "mtty-1"]);
    assert!(err.contains("no available instances"), "{err}");
    assert!(env.fails(&["start", "--type", "mtty-2"]).contains("no available instances"));
    // Removing one frees its two ports, and its socket.
    env.ok(&["stop", "--uuid", &dual_uuid]);
    assert_eq!((env.available("mtty-1"), env.available("mtty-2")), (2, 1));
    assert!(!env.run.join(format!("{dual_uuid}.sock")).exists());
    env.ok(&["start", "--type", "mtty-1"]);
    env.ok(&["start", "--type", "mtty-1"]);
    assert!(env.fails(&["start", "--type", "mtty-1"]).contains("no available instances"));
    daemon.stop();
}

#[test]
fn mtty_port_backends_through_start_and_definitions() {
    let env = Env::new();
    let tty_socket = env.run.parent().unwrap().join("tty1.sock");
    let port1 = format!("port1=socket:{}", tty_socket.display());
    let defined = "5a1e4c36-0f8e-4a5e-9d2f-00000000dddd";
    env.ok(&[
        "define",
        "--type",
        "mtty-2",
        "--uuid",
        defined,
        "--auto",
        "--opt",
        "port0=pty",
        "--opt",
        &port1,
    ]);
    let daemon = env.daemon();
    // The auto definition came up with its backends: a pty for port 0, the socket for port 1.
    let listed = env.list();
    let inst = listed.iter().find(|i| i["uuid"] == defined).expect("auto-started");
    let ports = inst["device"]["ports"].as_array().unwrap();
    assert_eq!(ports[0]["backend"], "pty");
    assert!(ports[0]["path"].as_str().unwrap().starts_with("/dev/pts/"), "{inst}");
    assert_eq!(ports[1]["backend"], format!("socket:{}", tty_socket.display()));
    assert_eq!(ports[1]["host_connected"], false);
    assert!(tty_socket.exists());
    // `umdev list` prints one line per instance, as mdevctl's (scripts read it a line at a
    // time); -v adds its options and endpoints on indented lines under it.
    let list = env.ok(&["list"]);
    assert_eq!(list.lines().count(), listed.len(), "{list}");
    assert!(list.lines().all(|l| !l.starts_with(' ') && !l.contains("/dev/pts/")), "{list}");
    let verbose = env.ok(&["list", "-v", "-u", defined]);
    let lines: Vec<&str> = verbose.lines().collect();
    assert!(lines[0].starts_with(defined) && !lines[0].contains("port"), "{verbose}");
    assert_eq!(lines[1], format!("  options: port0=pty port1=socket:{}", tty_socket.display()));
    assert!(lines[2].starts_with("  port 0: pty /dev/pts/"), "{verbose}");
    assert_eq!(lines[3], format!("  port 1: socket {}", tty_socket.display()), "{verbose}");
    assert_eq!(lines.len(), 4, "{verbose}");
    let both = env.fails(&["list", "-v", "--json"]);
    assert!(both.contains("cannot be used with"), "{both}");
    let defined_verbose = env.ok(&["list", "-d", "-v"]);
    assert_eq!(
        defined_verbose.lines().nth(1),
        Some(format!("  options: port0=pty port1=socket:{}", tty_socket.display()).as_str()),
        "{defined_verbose}"
    );
    // `umdev start` prints a new instance's endpoints under its line.
    let started = env.ok(&["start", "--type", "mtty-1", "--opt", "backend=pty"]);
    assert!(
        started.lines().nth(1).is_some_and(|l| l.trim().starts_with("port 0: pty /dev/pts/")),
        "{started}"
    );
    assert!(env.fails(&["start", "--type", "mtty-1", "--opt", "backend=serial"]).contains("unknown backend"));
    // The same socket path twice: the second instance is refused, the first keeps it.
    assert!(env
        .fails(&["start", "--type", "mtty-1", "--opt", &port1.replace("port1", "port0")])
        .contains("in use"));
    env.ok(&["stop", "--uuid", defined]);
    assert!(!tty_socket.exists(), "the port's socket goes with the instance");
    daemon.stop();
}

/// A request over the control socket's connection limit gets an answer saying the daemon is
/// busy, not a cut-short one.
#[test]
fn a_control_connection_over_the_limit_is_told_the_daemon_is_busy() {
    let env = Env::new();
    let daemon = env.daemon();
    let control = env.run.join("control.sock");
    // 16 connections held open, each waiting for its request line. One the daemon refused
    // (while the probes of `env.daemon()` still counted) was answered and closed: replaced.
    let alive = |s: &std::os::unix::net::UnixStream| {
        use nix::sys::socket::{recv, MsgFlags};
        use std::os::fd::AsRawFd;
        let flags = MsgFlags::MSG_PEEK | MsgFlags::MSG_DONTWAIT;
        recv(s.as_raw_fd(), &mut [0u8; 1], flags) == Err(nix::errno::Errno::EAGAIN)
    };
    let mut held = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(60);
    let busy = loop {
        held.retain(|s| alive(s));
        while held.len() < 16 {
            held.push(std::os::unix::net::UnixStream::connect(&control).unwrap());
        }
        let out = env.umdev(&["list"]);
        if !out.status.success() {
            break String::from_utf8_lossy(&out.stderr).to_string();
        }
        assert!(Instant::now() < deadline, "never refused with 16 connections held");
        std::thread::sleep(Duration::from_millis(10));
    };
    assert!(busy.contains("the daemon is busy"), "{busy}");
    drop(held);
    // Free again once those are gone.
    let deadline = Instant::now() + Duration::from_secs(60);
    while !env.umdev(&["list"]).status.success() {
        assert!(Instant::now() < deadline, "still refused after the connections closed");
        std::thread::sleep(Duration::from_millis(10));
    }
    daemon.stop();
}
