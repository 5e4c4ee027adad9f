//! Real `umdev` processes: the command, a guard that never leaves one running, and what
//! /proc says about them.

use std::ops::{Deref, DerefMut};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use umdev_testkit::client::RawClient;

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

/// The `umdev` binary under test, with SIGHUP at its default disposition as in a terminal:
/// a test run started under `nohup` (a CI runner may be) would otherwise hand its SIG_IGN
/// down, and `umdev run` keeps an inherited SIG_IGN.
pub fn umdev() -> Command {
    use std::os::unix::process::CommandExt;
    let mut command = Command::new(env!("CARGO_BIN_EXE_umdev"));
    // SAFETY: signal(2) is async-signal-safe and touches no memory of the parent, as a
    // pre_exec closure must.
    unsafe {
        command.pre_exec(|| {
            nix::sys::signal::signal(nix::sys::signal::Signal::SIGHUP, nix::sys::signal::SigHandler::SigDfl)
                .map(drop)
                .map_err(std::io::Error::from)
        });
    }
    command
}

/// Starts `umdev run --socket <socket> <args>` (stderr discarded) and waits until the socket
/// accepts a connection.
pub fn run(socket: &Path, args: &[&str]) -> ChildGuard {
    run_with_stderr(socket, args, Stdio::null())
}

/// As [`run`], with the child's stderr going to `stderr` (`Stdio::piped()` to read what it
/// prints).
pub fn run_with_stderr(socket: &Path, args: &[&str], stderr: Stdio) -> ChildGuard {
    let child =
        ChildGuard(umdev().arg("run").arg("--socket").arg(socket).args(args).stderr(stderr).spawn().unwrap());
    let deadline = Instant::now() + Duration::from_secs(60);
    while RawClient::connect(socket).is_err() {
        assert!(Instant::now() < deadline, "umdev run never listened");
        std::thread::sleep(Duration::from_millis(5));
    }
    // The probe connection above was turned away or served and closed; let it finish.
    std::thread::sleep(Duration::from_millis(20));
    child
}

/// A run and a state directory under a temporary one, and the CLI pointed at them.
pub struct Dirs {
    dir: tempfile::TempDir,
    /// `--run-dir`: the control socket and instance sockets.
    pub run: PathBuf,
    /// `--state-dir`: the definitions.
    pub state: PathBuf,
}

impl Dirs {
    pub fn new() -> Dirs {
        let dir = tempfile::tempdir().unwrap();
        let (run, state) = (dir.path().join("run"), dir.path().join("state"));
        Dirs { dir, run, state }
    }

    /// The temporary directory holding both.
    pub fn path(&self) -> &Path {
        self.dir.path()
    }

    /// `umdev <args>` on these directories, run to completion.
    pub fn umdev(&self, args: &[&str]) -> Output {
        self.command().args(args).output().unwrap()
    }

    /// `umdev` with `$UMDEV_RUN_DIR` and `$UMDEV_STATE_DIR` naming these directories: every
    /// command takes them (only those that use a directory take its option).
    pub fn command(&self) -> Command {
        let mut command = umdev();
        command.env("UMDEV_RUN_DIR", &self.run).env("UMDEV_STATE_DIR", &self.state);
        command
    }

    /// Where the daemons of [`Dirs::daemon`] write their stderr.
    pub fn log(&self) -> PathBuf {
        self.dir.path().join("daemon.log")
    }

    /// `umdev daemon` on these directories (with `args`), once its control socket answers;
    /// its stderr goes to [`Dirs::log`].
    pub fn daemon(&self, args: &[&str]) -> ChildGuard {
        self.daemon_from(self.daemon_command(args))
    }

    /// The command [`Dirs::daemon`] runs, for a test to change before [`Dirs::daemon_from`].
    pub fn daemon_command(&self, args: &[&str]) -> Command {
        let mut command = umdev();
        command
            .arg("--run-dir")
            .arg(&self.run)
            .arg("--state-dir")
            .arg(&self.state)
            .arg("daemon")
            .args(args)
            .stderr(std::fs::OpenOptions::new().create(true).append(true).open(self.log()).unwrap());
        command
    }

    /// Spawns a [`Dirs::daemon_command`], and waits until its control socket answers.
    pub fn daemon_from(&self, mut command: Command) -> ChildGuard {
        let child = ChildGuard(command.spawn().unwrap());
        let control = self.run.join("control.sock");
        let deadline = Instant::now() + Duration::from_secs(20);
        while std::os::unix::net::UnixStream::connect(&control).is_err() {
            assert!(Instant::now() < deadline, "the daemon never came up");
            std::thread::sleep(Duration::from_millis(5));
        }
        child
    }

    /// `umdev <args>` with `input` on its stdin, run to completion.
    pub fn with_stdin(&self, args: &[&str], input: &str) -> Output {
        use std::io::Write;
        let mut child = self
            .command()
            .args(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        child.stdin.take().unwrap().write_all(input.as_bytes()).unwrap();
        child.wait_with_output().unwrap()
    }

    /// Runs a command that must succeed; its stdout.
    pub fn ok(&self, args: &[&str]) -> String {
        let out = self.umdev(args);
        assert!(out.status.success(), "umdev {args:?} failed: {}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8(out.stdout).unwrap()
    }

    /// Runs a command that must fail; its stderr.
    pub fn fails(&self, args: &[&str]) -> String {
        let out = self.umdev(args);
        assert!(!out.status.success(), "umdev {args:?} should have failed");
        String::from_utf8(out.stderr).unwrap()
    }
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

/// Makes `io_uring_setup` fail with EPERM in `command`'s process, as a container runtime's
/// seccomp profile (or `kernel.io_uring_disabled`, which a test must not set: tests run side
/// by side) refuses it: a filter installed between fork and exec, which exec keeps.
pub fn deny_io_uring(command: &mut Command) {
    use std::os::unix::process::CommandExt;
    // SAFETY: deny_io_uring_setup allocates nothing and makes only prctl(2) and seccomp(2)
    // calls, which touch no memory of the parent, as a pre_exec closure must.
    unsafe {
        command.pre_exec(|| umdev_pinning::fuzzing::deny_io_uring_setup(libc::EPERM));
    }
}
