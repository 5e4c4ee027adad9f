//! The documents are true: every command README.md and docs/*.md show in a ```sh block is
//! run, in order, against a daemon of the test's own (`umdev daemon &` is that daemon), with
//! the paths it names moved under a temporary directory (a `file:` store there is made, 1 GiB
//! sparse). `umdev run` must come up and stop cleanly on SIGTERM; every other `umdev` command
//! must succeed. The benchmarks are only parsed (src/main.rs's unit test parses every `umdev`
//! command, prose included): they take minutes. Commands of other programs are not run; each
//! must be one this test knows why it leaves alone.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::docs::{lines, simple_commands, Simple};
use common::process::{ChildGuard, Dirs};

/// The placeholder UUID of the documents (`<uuid>`, `UUID`, `5a1e4c36-...`).
const UUID: &str = "5a1e4c36-0f8e-4a5e-9d2f-000000000d0c";

/// Programs the documents show that a test must not or cannot run, and why.
const NOT_RUN: &[(&str, &str)] = &[
    ("qemu-system-x86_64", "a VM (the QEMU tests run QEMU)"),
    ("systemctl", "changes the host's services (tests/systemd.rs runs the daemon as systemd would)"),
    ("journalctl", "reads the host's journal"),
    ("cp", "installs into /etc"),
    ("cargo", "builds, installs or fuzzes (the tests are themselves `cargo test`)"),
    ("cd", "a shell builtin"),
    ("echo", "writes to /proc as root"),
    ("mandb", "updates the host's man database"),
    ("man", "reads a page from the pipe before it"),
    ("screen", "an interactive terminal"),
    ("minicom", "an interactive terminal"),
    ("git", "checks out an older commit to benchmark against"),
    ("(cd", "builds that older commit"),
    ("for", "a loop of benchmark runs (each `umdev` benchmark is checked by parsing below)"),
    ("done", "ends that loop"),
    ("../base/target/release/umdev", "the older build of an A/B"),
    ("bench/guest-fio-compare", "boots guests for minutes (tests/guest_nvme.rs runs fio in a guest)"),
    ("bench/spdk-compare", "builds SPDK and measures for minutes (tests/spdk_nvme.rs runs SPDK's initiator)"),
    ("bench/file-compare", "measures the host's disk for minutes, overwriting the file it names"),
    ("spdk_nvme_perf", "needs SPDK built and hugepages (tests/spdk_nvme.rs runs it)"),
    ("fio", "measures the host's disk beside a benchmark"),
    (
        "target/release/umdev",
        "the build of an A/B, run in a loop (the same commands are parsed as `umdev` where shown alone)",
    ),
];

/// `umdev` commands that are checked by parsing only.
const BENCHMARKS: &[&str] = &["pinbench", "protobench", "ccwbench", "nvmebench"];

struct Run {
    env: Dirs,
    /// Where the documents' absolute paths go.
    root: PathBuf,
    _daemon: ChildGuard,
}

impl Run {
    fn new() -> Run {
        let env = Dirs::new();
        let root = env.path().join("root");
        std::fs::create_dir_all(root.join("home")).unwrap();
        let daemon = env.daemon(&[]);
        Run { env, root, _daemon: daemon }
    }

    /// A path the documents name, under the test's root (made with its parents).
    fn path(&self, path: &str) -> PathBuf {
        let moved = if let Some(home) = path.strip_prefix("~/") {
            self.root.join("home").join(home)
        } else if let Some(abs) = path.strip_prefix('/') {
            self.root.join(abs)
        } else {
            self.root.join(path)
        };
        std::fs::create_dir_all(moved.parent().unwrap()).unwrap();
        moved
    }

    /// `args` with their paths moved; `file:` stores made.
    fn args(&self, args: &[String]) -> Vec<String> {
        args.iter()
            .map(|a| {
                if a.starts_with('/') && !a.starts_with("/dev/") {
                    return self.path(a).display().to_string();
                }
                for kind in ["file:", "socket:"] {
                    if let Some((key, path)) =
                        a.split_once('=').and_then(|(k, v)| Some((k, v.strip_prefix(kind)?)))
                    {
                        let moved = self.path(path);
                        if kind == "file:" && !moved.exists() {
                            std::fs::File::create(&moved).unwrap().set_len(1 << 30).unwrap();
                        }
                        return format!("{key}={kind}{}", moved.display());
                    }
                }
                a.clone()
            })
            .collect()
    }

    fn command(&self, args: &[String]) -> Command {
        let mut cmd = self.env.command();
        cmd.args(args).current_dir(&self.root);
        cmd
    }

    /// Runs one `umdev` command as the document shows it; why it failed.
    fn umdev(&self, simple: &Simple) -> Result<(), String> {
        let args = self.args(&simple.umdev_args(UUID).unwrap());
        match args.first().map(String::as_str) {
            Some("daemon") => return Ok(()),
            Some(b) if BENCHMARKS.contains(&b) => return Ok(()),
            Some("run") => return self.run(&args),
            _ => {}
        }
        let out = self.command(&args).stdin(Stdio::null()).output().unwrap();
        if !out.status.success() {
            return Err(format!("{}: {}", out.status, String::from_utf8_lossy(&out.stderr).trim()));
        }
        if let Some(to) = &simple.stdout_to {
            std::fs::write(self.path(to), &out.stdout).unwrap();
        }
        Ok(())
    }

    /// `umdev run`: serves until SIGTERM, then exits 0.
    fn run(&self, args: &[String]) -> Result<(), String> {
        let socket = args.iter().position(|a| a == "--socket").map(|i| PathBuf::from(&args[i + 1]));
        let socket = socket.ok_or("umdev run without --socket")?;
        let mut child = ChildGuard(self.command(args).stderr(Stdio::piped()).spawn().unwrap());
        let deadline = Instant::now() + Duration::from_secs(20);
        while !socket.exists() {
            if let Some(status) = child.try_wait().unwrap() {
                let mut err = String::new();
                std::io::Read::read_to_string(&mut child.stderr.take().unwrap(), &mut err).unwrap();
                return Err(format!("exited {status}: {}", err.trim()));
            }
            if Instant::now() > deadline {
                return Err("did not listen within 20 s".into());
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(child.id() as i32),
            nix::sys::signal::Signal::SIGTERM,
        )
        .unwrap();
        let status = child.wait().unwrap();
        if !status.success() || socket.exists() {
            return Err(format!("on SIGTERM: {status}, socket left: {}", socket.exists()));
        }
        Ok(())
    }
}

#[test]
fn every_command_the_documents_show_runs() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut failures = Vec::new();
    let (mut ran, mut file) = (0, String::new());
    let mut run: Option<Run> = None;
    for line in lines(root).into_iter().filter(|l| !l.inline) {
        // Each document on a fresh daemon and directories, as a reader would start.
        if line.file != file {
            file = line.file.clone();
            run = Some(Run::new());
        }
        let run = run.as_ref().unwrap();
        for simple in simple_commands(&line.text) {
            let at = format!("{}:{}: `{}`", line.file, line.line, line.text);
            if simple.umdev_args(UUID).is_some() {
                #[cfg(not(feature = "bench"))]
                if simple.umdev_args(UUID).unwrap().first().is_some_and(|c| c == "demo") {
                    continue;
                }
                ran += 1;
                if let Err(why) = run.umdev(&simple) {
                    failures.push(format!("{at}: {why}"));
                }
                continue;
            }
            let program = simple.program().unwrap_or_default();
            if !NOT_RUN.iter().any(|(p, _)| *p == program) {
                failures.push(format!("{at}: {program} is neither run nor known to be left alone (NOT_RUN)"));
            }
        }
    }
    assert!(ran > 30, "only {ran} commands ran");
    assert!(failures.is_empty(), "commands the documents show that fail:\n{}", failures.join("\n"));
}
