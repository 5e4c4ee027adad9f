//! `umdev daemon` as systemd runs it (contrib/systemd/umdev.service): started with
//! $NOTIFY_SOCKET, $RUNTIME_DIRECTORY, $CONFIGURATION_DIRECTORY and its stderr on a "journal"
//! stream; READY=1 only once it serves, SIGHUP re-reading the definitions, SIGTERM sending
//! STOPPING=1 and leaving no socket behind. Also the journal log format, the completions and
//! man pages, and the unit itself.

mod common;

use std::fs::File;
use std::io::{BufRead, BufReader};
use std::os::fd::OwnedFd;
use std::os::unix::net::{UnixDatagram, UnixStream};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::process::{umdev, ChildGuard, Dirs};
use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;

const AUTO: &str = "5a1e4c36-0f8e-4a5e-9d2f-0000000a0001";
const BROKEN: &str = "5a1e4c36-0f8e-4a5e-9d2f-0000000a0002";
const LATER: &str = "5a1e4c36-0f8e-4a5e-9d2f-0000000a0003";
const PENDING: &str = "5a1e4c36-0f8e-4a5e-9d2f-0000000a0004";
const TIMEOUT: Duration = Duration::from_secs(20);

/// A pipe whose write end is to be a child's stderr, with the `device:inode` systemd would put
/// in $JOURNAL_STREAM for it.
struct Journal {
    read: OwnedFd,
    write: OwnedFd,
    stream: String,
}

impl Journal {
    fn new() -> Journal {
        // Close-on-exec: only the child that gets it as fd 2 holds the write end.
        let (read, write) = nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC).unwrap();
        let stat = nix::sys::stat::fstat(&write).unwrap();
        Journal { read, write, stream: format!("{}:{}", stat.st_dev, stat.st_ino) }
    }
}

/// Lines a child writes to a pipe, collected on a thread.
#[derive(Clone)]
struct Lines(Arc<Mutex<Vec<String>>>);

impl Lines {
    fn collect(read: OwnedFd) -> Lines {
        let lines = Lines(Arc::default());
        let sink = lines.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(File::from(read)).lines().map_while(Result::ok) {
                sink.0.lock().unwrap().push(line);
            }
        });
        lines
    }

    fn all(&self) -> Vec<String> {
        self.0.lock().unwrap().clone()
    }

    /// Waits for a line containing every one of `parts`.
    fn wait_for(&self, parts: &[&str]) -> String {
        let deadline = Instant::now() + TIMEOUT;
        loop {
            if let Some(l) = self.all().into_iter().find(|l| parts.iter().all(|p| l.contains(p))) {
                return l;
            }
            assert!(Instant::now() < deadline, "no line with {parts:?} in {:#?}", self.all());
            std::thread::sleep(Duration::from_millis(5));
        }
    }
}

/// The service manager's end of $NOTIFY_SOCKET.
struct Notifications {
    socket: UnixDatagram,
    path: PathBuf,
}

impl Notifications {
    fn bind(path: PathBuf) -> Notifications {
        let socket = UnixDatagram::bind(&path).unwrap();
        socket.set_read_timeout(Some(TIMEOUT)).unwrap();
        Notifications { socket, path }
    }

    /// The next datagram's assignments (`READY=1`, `STATUS=...`).
    fn next(&self) -> Vec<String> {
        let mut buf = [0u8; 4096];
        // A signal to the test process (a child's SIGCHLD, say) may interrupt the wait.
        let n = loop {
            match self.socket.recv(&mut buf) {
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                r => break r.expect("a notification before the timeout"),
            }
        };
        String::from_utf8_lossy(&buf[..n]).lines().map(str::to_string).collect()
    }

    /// The next datagram with `assignment` (`READY=1`), passing over STATUS= updates alone;
    /// any other datagram on the way is a failure.
    fn next_with(&self, assignment: &str) -> Vec<String> {
        loop {
            let datagram = self.next();
            if has(&datagram, assignment) {
                return datagram;
            }
            assert!(datagram.iter().all(|l| l.starts_with("STATUS=")), "{datagram:?} before {assignment}");
        }
    }

    /// Waits for a STATUS= update starting with `prefix`.
    fn status(&self, prefix: &str) -> String {
        loop {
            if let Some(status) =
                self.next().into_iter().find_map(|l| l.strip_prefix("STATUS=").map(str::to_string))
            {
                if status.starts_with(prefix) {
                    return status;
                }
            }
        }
    }
}

struct Service {
    dirs: Dirs,
    notifications: Notifications,
}

impl std::ops::Deref for Service {
    type Target = Dirs;
    fn deref(&self) -> &Dirs {
        &self.dirs
    }
}

impl Service {
    /// Its clients are told the directories (as root they would find /run/umdev and
    /// /etc/umdev.d).
    fn new() -> Service {
        let dirs = Dirs::new();
        let notifications = Notifications::bind(dirs.path().join("notify.sock"));
        Service { dirs, notifications }
    }

    fn json(&self, args: &[&str]) -> Vec<serde_json::Value> {
        serde_json::from_str::<serde_json::Value>(&self.ok(args)).unwrap().as_array().unwrap().clone()
    }

    fn running(&self) -> Vec<String> {
        self.json(&["list", "--json"]).iter().map(|i| i["uuid"].as_str().unwrap().to_string()).collect()
    }

    /// `list --defined --json` as uuid -> state.
    fn defined(&self) -> Vec<(String, String)> {
        self.json(&["list", "--defined", "--json"])
            .iter()
            .map(|d| (d["uuid"].as_str().unwrap().to_string(), d["state"].as_str().unwrap().to_string()))
            .collect()
    }

    fn socket(&self, uuid: &str) -> PathBuf {
        self.run.join(format!("{uuid}.sock"))
    }

    /// `umdev daemon` with the environment systemd gives the unit, and no directory options.
    fn start(&self) -> (ChildGuard, Lines) {
        let journal = Journal::new();
        let child = {
            let mut cmd = Command::new(env!("CARGO_BIN_EXE_umdev"));
            cmd.arg("daemon")
                .env("NOTIFY_SOCKET", &self.notifications.path)
                .env("RUNTIME_DIRECTORY", &self.run)
                .env("CONFIGURATION_DIRECTORY", &self.state)
                .env("JOURNAL_STREAM", &journal.stream)
                .env_remove("UMDEV_RUN_DIR")
                .env_remove("UMDEV_STATE_DIR")
                .env_remove("RUST_LOG")
                .stdin(Stdio::null())
                .stderr(Stdio::from(journal.write));
            ChildGuard(cmd.spawn().unwrap())
        };
        (child, Lines::collect(journal.read))
    }
}

fn signal(child: &ChildGuard, signal: Signal) {
    kill(Pid::from_raw(child.id() as i32), signal).unwrap();
}

fn has(datagram: &[String], assignment: &str) -> bool {
    datagram.iter().any(|l| l == assignment)
}

#[test]
fn the_daemon_under_systemd_notifies_reloads_and_cleans_up() {
    let svc = Service::new();
    svc.ok(&["define", "--type", "testdev", "--uuid", AUTO, "--auto"]);
    // An auto definition that cannot start (written by hand: `define` refuses it): the daemon
    // is ready all the same, and says why.
    assert!(svc
        .fails(&["define", "--type", "testdev", "--uuid", BROKEN, "--auto", "--opt", "bogus=1"])
        .contains("bogus"));
    std::fs::write(
        svc.state.join(format!("{BROKEN}.json")),
        format!(r#"{{"uuid": "{BROKEN}", "mdev_type": "testdev", "start": "auto", "options": {{"params": {{"bogus": "1"}}}}}}"#),
    )
    .unwrap();
    let (mut daemon, journal) = svc.start();

    // READY=1 is the first notification, and when it comes the daemon serves: the control
    // socket answers and the auto instance's socket is there.
    let ready = svc.notifications.next_with("READY=1");
    assert!(has(&ready, "READY=1"), "{ready:?}");
    assert!(UnixStream::connect(svc.run.join("control.sock")).is_ok(), "control socket answers at READY");
    assert!(svc.socket(AUTO).exists(), "auto instance's socket exists at READY");
    assert!(ready.iter().any(|l| l.starts_with("STATUS=serving 1 instance")), "{ready:?}");
    assert_eq!(svc.running(), vec![AUTO.to_string()]);
    assert!(!svc.socket(BROKEN).exists());
    let failed = journal.wait_for(&["could not start defined device", BROKEN]);
    assert!(failed.starts_with("<3>"), "an error priority: {failed}");
    let up = journal.wait_for(&["daemon running"]);
    assert!(up.starts_with("<6>"), "an info priority: {up}");
    assert!(up.contains(&svc.state.display().to_string()), "the definitions from $CONFIGURATION_DIRECTORY");
    // STATUS= follows the instances' clients (and instances: see the reload below).
    let mut client = common::raw::RawClient::connect(&svc.socket(AUTO)).unwrap();
    client.negotiate().unwrap();
    assert_eq!(
        svc.notifications.status("serving 1 instance(s), 1"),
        "serving 1 instance(s), 1 with a client"
    );
    drop(client);
    svc.notifications.status("serving 1 instance(s), 0");

    // The library crates' records too: info and up by default under the journal.
    journal.wait_for(&["<6>instance", AUTO, "listening on"]);
    assert!(journal.all().iter().all(|l| l.len() > 3 && l.starts_with('<')), "{:#?}", journal.all());

    // While it runs: a new auto definition, and the first one removed.
    svc.ok(&["define", "--type", "testdev", "--uuid", LATER, "--auto"]);
    svc.ok(&["undefine", "--uuid", AUTO]);
    svc.ok(&["undefine", "--uuid", BROKEN]);
    assert_eq!(
        svc.defined(),
        vec![(LATER.into(), "not-started".into()), (AUTO.into(), "undefined".into())],
        "out of sync until the reload"
    );
    signal(&daemon, Signal::SIGHUP);
    svc.notifications.next_with("RELOADING=1");
    let reloaded = svc.notifications.next_with("READY=1");
    assert!(reloaded.contains(&"STATUS=serving 2 instance(s), 0 with a client".to_string()), "{reloaded:?}");
    assert!(svc.socket(LATER).exists(), "the new auto definition started before READY");
    assert_eq!(svc.running(), vec![AUTO.to_string(), LATER.to_string()], "the undefined one keeps running");
    assert!(svc.socket(AUTO).exists());
    let kept = journal.wait_for(&["keeps running", "no longer defined", AUTO]);
    assert!(kept.starts_with("<4>"), "a warning priority: {kept}");
    journal.wait_for(&["started defined device", LATER]);

    // list --defined tells what is out of sync, in text and JSON.
    svc.ok(&["define", "--type", "testdev", "--uuid", PENDING, "--auto"]);
    svc.ok(&["undefine", "--uuid", LATER]);
    svc.ok(&["define", "--type", "testdev", "--uuid", LATER, "--auto", "--pin-mode", "lock"]);
    let defined = svc.json(&["list", "--defined", "--json"]);
    let state = |uuid: &str| defined.iter().find(|d| d["uuid"] == uuid).unwrap().clone();
    assert_eq!(
        (state(LATER)["state"].clone(), state(LATER)["in_sync"].clone()),
        ("changed".into(), false.into())
    );
    assert_eq!(state(LATER)["options"]["pin_mode"], "lock");
    assert!(state(LATER)["running_options"].get("pin_mode").is_none(), "it runs with the old options");
    assert_eq!(state(PENDING)["state"], "not-started");
    assert_eq!(
        (state(AUTO)["state"].clone(), state(AUTO)["start"].clone()),
        ("undefined".into(), serde_json::Value::Null)
    );
    let text = svc.ok(&["list", "--defined"]);
    assert!(text.contains(&format!("{PENDING} testdev auto not-started  (out of sync:")), "{text}");
    assert!(
        text.contains(&format!("{AUTO} testdev - undefined  (out of sync: running, but no longer defined)"))
    );

    // SIGTERM: STOPPING=1, then every socket is gone and the exit is clean.
    signal(&daemon, Signal::SIGTERM);
    svc.notifications.next_with("STOPPING=1");
    let deadline = Instant::now() + TIMEOUT;
    let status = loop {
        if let Some(status) = daemon.try_wait().unwrap() {
            break status;
        }
        assert!(Instant::now() < deadline, "the daemon did not exit on SIGTERM");
        std::thread::sleep(Duration::from_millis(5));
    };
    assert!(status.success(), "exit {status}");
    let left: Vec<PathBuf> = std::fs::read_dir(&svc.run).unwrap().map(|e| e.unwrap().path()).collect();
    assert!(left.is_empty(), "sockets left behind: {left:?}");
    journal.wait_for(&["<6>", "shutting down"]);
}

#[test]
fn an_operators_stop_outlasts_a_reload() {
    let svc = Service::new();
    svc.ok(&["define", "--type", "testdev", "--uuid", AUTO, "--auto"]);
    let (daemon, journal) = svc.start();
    svc.notifications.next_with("READY=1");
    svc.ok(&["stop", "--uuid", AUTO]);
    signal(&daemon, Signal::SIGHUP);
    svc.notifications.next_with("RELOADING=1");
    svc.notifications.next_with("READY=1");
    assert!(svc.running().is_empty(), "not restarted by the reload");
    journal.wait_for(&["<6>", AUTO, "stays stopped"]);
    // Stopped on purpose: stopped, not out of sync.
    assert_eq!(svc.defined(), vec![(AUTO.into(), "stopped".into())]);
    svc.ok(&["start", "--uuid", AUTO]);
    assert_eq!(svc.defined(), vec![(AUTO.into(), "running".into())]);
}

/// A client that fails (no daemon) with `extra` arguments and environment; its stderr.
fn failing_client(dir: &Path, extra: &[&str], env: &[(&str, &str)]) -> String {
    let out = umdev()
        .arg("--run-dir")
        .arg(dir)
        .args(extra)
        .arg("list")
        .envs(env.iter().copied())
        .env_remove("JOURNAL_STREAM")
        .output()
        .unwrap();
    assert!(!out.status.success());
    String::from_utf8(out.stderr).unwrap()
}

#[test]
fn log_lines_carry_priorities_for_the_journal_and_stay_plain_in_a_terminal() {
    let dir = tempfile::tempdir().unwrap();
    // The terminal format is as it always was.
    let plain = failing_client(dir.path(), &[], &[]);
    assert!(plain.starts_with("umdev: the umdev daemon is not running"), "{plain}");
    // Asked for, the journal's: the error's priority first.
    let journal = failing_client(dir.path(), &["--log-format", "journal"], &[]);
    assert!(journal.starts_with("<3>the umdev daemon is not running"), "{journal}");
    // $JOURNAL_STREAM naming another stream (inherited from a service, say) changes nothing.
    let inherited = failing_client(dir.path(), &[], &[("JOURNAL_STREAM", "1:1")]);
    assert_eq!(inherited, plain);
    assert_eq!(failing_client(dir.path(), &["--log-format", "terminal"], &[]), plain);

    // $JOURNAL_STREAM naming stderr itself: journal lines, with no option.
    let stream = Journal::new();
    let status = umdev()
        .arg("--run-dir")
        .arg(dir.path())
        .arg("list")
        .env("JOURNAL_STREAM", &stream.stream)
        .stderr(Stdio::from(stream.write))
        .status()
        .unwrap();
    assert!(!status.success());
    let lines = Lines::collect(stream.read);
    lines.wait_for(&["<3>the umdev daemon is not running"]);
}

#[test]
fn completions_and_man_pages_come_from_the_cli() {
    let verbs = ["daemon", "start", "stop", "list", "define", "modify", "undefine", "stats", "types", "run"];
    for shell in ["bash", "zsh", "fish"] {
        let out = umdev().args(["completions", shell]).output().unwrap();
        assert!(out.status.success(), "{shell}");
        let script = String::from_utf8(out.stdout).unwrap();
        assert!(script.len() > 2000, "{shell}: {} bytes", script.len());
        for verb in verbs.iter().chain(&["log-format", "pin-mode", "auto", "defined"]) {
            assert!(script.contains(verb), "{shell} completion lacks {verb}");
        }
    }
    assert!(!umdev().args(["completions", "tcsh"]).output().unwrap().status.success());
    // A type argument is completed with the type names, not file names.
    let bash = String::from_utf8(umdev().args(["completions", "bash"]).output().unwrap().stdout).unwrap();
    let start = &bash[bash.find("umdev__subcmd__start)").expect("start's completions")..];
    let types = start.find("--type)").expect("--type's completion");
    let line = start[types..].lines().nth(1).unwrap_or_default();
    assert!(line.contains("compgen -W \"testdev mtty-1 mtty-2 ccw nvme\""), "{line}");

    let out = umdev().arg("man").output().unwrap();
    assert!(out.status.success());
    let page = String::from_utf8(out.stdout).unwrap();
    assert!(page.contains(".TH umdev 1"), "{page}");
    // The environment under its own heading, each variable an entry; no page is named that
    // is not written (clap's `help`).
    assert!(page.contains(".SH ENVIRONMENT\n.TP\n\\fBUMDEV_RUN_DIR, UMDEV_STATE_DIR\\fR"), "{page}");
    assert!(!page.contains(".SH EXTRA") && !page.contains("umdev\\-help(1)"), "{page}");
    for verb in verbs {
        assert!(page.contains(&format!("umdev\\-{verb}(1)")) || page.contains(verb), "umdev(1) lacks {verb}");
    }

    let dir = tempfile::tempdir().unwrap();
    let out = umdev().args(["man", "--dir"]).arg(dir.path()).output().unwrap();
    assert!(out.status.success());
    for verb in verbs {
        let path = dir.path().join(format!("umdev-{verb}.1"));
        let page = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        assert!(
            page.contains(&format!(".TH umdev-{verb} 1  \"umdev {}", env!("CARGO_PKG_VERSION"))),
            "{page}"
        );
    }
    let daemon = std::fs::read_to_string(dir.path().join("umdev-daemon.1")).unwrap();
    assert!(daemon.contains("SIGHUP") && daemon.contains("\\-\\-max\\-instances"), "{daemon}");
    assert!(dir.path().join("umdev.1").exists());
    assert!(!dir.path().join("umdev-help.1").exists(), "no page for clap's help");
    // Options' pages list the types' options under their own heading; a page lists only the
    // directory options its command takes.
    let start = std::fs::read_to_string(dir.path().join("umdev-start.1")).unwrap();
    assert!(start.contains(".SH \"DEVICE TYPES\"") && start.contains(".SS nvme"), "{start}");
    assert!(!start.contains(".SH EXTRA"), "{start}");
    // `define` asks the daemon for the instance it defines when given no type, and only
    // then takes --run-dir; its page says so.
    let define = std::fs::read_to_string(dir.path().join("umdev-define.1")).unwrap();
    assert!(define.contains("\\-\\-state\\-dir") && define.contains("\\-\\-run\\-dir"), "{define}");
    assert!(define.contains("define asks no daemon and refuses"), "{define}");
    let undefine = std::fs::read_to_string(dir.path().join("umdev-undefine.1")).unwrap();
    assert!(undefine.contains("\\-\\-state\\-dir") && !undefine.contains("\\-\\-run\\-dir"), "{undefine}");
    let stats = std::fs::read_to_string(dir.path().join("umdev-stats.1")).unwrap();
    assert!(stats.contains("\\-\\-run\\-dir") && !stats.contains("\\-\\-state\\-dir"), "{stats}");
}

#[test]
fn the_unit_file_verifies() {
    let unit = Path::new(env!("CARGO_MANIFEST_DIR")).join("contrib/systemd/umdev.service");
    let text = std::fs::read_to_string(&unit).unwrap();
    // systemd-analyze where it is installed; CI does not need it.
    let Ok(probe) = Command::new("systemd-analyze").arg("--version").output() else {
        return eprintln!("skipped: no systemd-analyze");
    };
    assert!(probe.status.success());
    // Its ExecStart= must name an executable: the one under test.
    let dir = tempfile::tempdir().unwrap();
    let copy = dir.path().join("umdev.service");
    std::fs::write(&copy, text.replace("/usr/local/bin/umdev", env!("CARGO_BIN_EXE_umdev"))).unwrap();
    // --man=no: the man pages are not installed here.
    let out = Command::new("systemd-analyze").args(["verify", "--man=no"]).arg(&copy).output().unwrap();
    assert!(
        out.status.success() && out.stderr.is_empty(),
        "systemd-analyze verify: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}
