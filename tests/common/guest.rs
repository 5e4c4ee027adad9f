//! A real Linux guest (Debian 6.1 under QEMU 11, TCG) with umdev devices attached, through
//! the project's harness `tests/guest/umdev-guest`. A test skips only when the harness cannot
//! fetch the kernel, busybox or QEMU (exit 77), and says so.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus, Stdio};
use std::sync::mpsc::{channel, Receiver, RecvTimeoutError};
use std::time::{Duration, Instant};

use super::process::ChildGuard;

/// The harness script.
pub fn harness() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/guest/umdev-guest")
}

/// Fetches and caches what a guest needs; false (with the reason printed) when it cannot be
/// had, the only case a guest test skips.
pub fn available() -> bool {
    let out = Command::new(harness()).arg("prepare").output().expect("running the guest harness");
    match out.status.code() {
        Some(0) => true,
        Some(77) => {
            eprintln!(
                "SKIPPED: the guest cannot be prepared: {}",
                String::from_utf8_lossy(&out.stderr).trim()
            );
            false
        }
        _ => panic!("umdev-guest prepare failed: {}", String::from_utf8_lossy(&out.stderr)),
    }
}

/// The static fio the harness builds for the guest (`umdev-guest fio`); None (with the reason
/// printed) when it cannot be had, the only case a fio test skips.
pub fn fio() -> Option<PathBuf> {
    let out = Command::new(harness()).arg("fio").output().expect("running the guest harness");
    match out.status.code() {
        Some(0) => Some(PathBuf::from(String::from_utf8_lossy(&out.stdout).trim())),
        Some(77) => {
            eprintln!("SKIPPED: no fio for the guest: {}", String::from_utf8_lossy(&out.stderr).trim());
            None
        }
        _ => panic!("umdev-guest fio failed: {}", String::from_utf8_lossy(&out.stderr)),
    }
}

/// How to boot one guest.
pub struct GuestSpec<'a> {
    /// vfio-user sockets, attached at 00:04.0, 00:05.0, ...
    pub sockets: Vec<&'a Path>,
    /// Kernel modules the script needs.
    pub modules: Vec<&'a str>,
    /// The script the guest runs (busybox sh).
    pub script: &'a str,
    /// Guest RAM in MiB.
    pub mem_mib: u32,
    /// The whole run, boot included.
    pub timeout: Duration,
    /// Extra kernel arguments (`pci=nomsi`, say).
    pub append: &'a str,
    /// Extra QEMU arguments (`-smp 2`, say), one per element.
    pub qemu_args: Vec<&'a str>,
    /// Host files copied into the guest's `/bin` (the static fio of [`fio`], say).
    pub files: Vec<&'a Path>,
}

impl Default for GuestSpec<'_> {
    fn default() -> Self {
        GuestSpec {
            sockets: Vec::new(),
            modules: Vec::new(),
            script: "",
            mem_mib: 256,
            timeout: Duration::from_secs(300),
            append: "",
            qemu_args: Vec::new(),
            files: Vec::new(),
        }
    }
}

/// A booting or running guest: its console, line by line.
pub struct Guest {
    child: ChildGuard,
    lines: Receiver<String>,
    /// Every console line seen so far.
    pub console: Vec<String>,
    _dir: tempfile::TempDir,
}

impl Guest {
    /// Boots a guest that runs `spec.script`.
    pub fn boot(spec: &GuestSpec<'_>) -> Guest {
        let dir = tempfile::tempdir().unwrap();
        let script = dir.path().join("script.sh");
        std::fs::write(&script, spec.script).unwrap();
        let mut cmd = Command::new(harness());
        cmd.arg("run").arg("--mem").arg(spec.mem_mib.to_string());
        cmd.arg("--timeout").arg(spec.timeout.as_secs().to_string());
        for socket in &spec.sockets {
            cmd.arg("--socket").arg(socket);
        }
        for module in &spec.modules {
            cmd.arg("--module").arg(module);
        }
        if !spec.append.is_empty() {
            cmd.arg("--append").arg(spec.append);
        }
        for arg in &spec.qemu_args {
            cmd.arg("--qemu-arg").arg(arg);
        }
        for file in &spec.files {
            cmd.arg("--file").arg(file);
        }
        cmd.arg(&script).stdout(Stdio::piped()).stderr(Stdio::inherit());
        let mut child = ChildGuard(cmd.spawn().expect("starting the guest harness"));
        let stdout = child.stdout.take().unwrap();
        let (tx, lines) = channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        Guest { child, lines, console: Vec::new(), _dir: dir }
    }

    /// Waits for a console line containing `needle`; returns it.
    pub fn wait_for(&mut self, needle: &str, timeout: Duration) -> String {
        let deadline = Instant::now() + timeout;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(line) => {
                    self.console.push(line.clone());
                    if line.contains(needle) {
                        return line;
                    }
                }
                Err(RecvTimeoutError::Timeout) => {
                    panic!("no {needle:?} on the guest console in {timeout:?}:\n{}", self.console.join("\n"))
                }
                Err(RecvTimeoutError::Disconnected) => {
                    panic!("the guest ended before {needle:?}:\n{}", self.console.join("\n"))
                }
            }
        }
    }

    /// Waits for the guest to end; its exit status and whole console.
    pub fn finish(mut self) -> (ExitStatus, Vec<String>) {
        while let Ok(line) = self.lines.recv() {
            self.console.push(line);
        }
        let status = self.child.wait().unwrap();
        (status, std::mem::take(&mut self.console))
    }
}

/// Boots a guest, runs `spec.script` to its end; the console, after asserting the script
/// succeeded.
pub fn run_ok(spec: &GuestSpec<'_>) -> Vec<String> {
    let started = Instant::now();
    let (status, console) = Guest::boot(spec).finish();
    assert!(status.success(), "the guest script failed ({status}):\n{}", console.join("\n"));
    eprintln!("guest run: {:.1} s", started.elapsed().as_secs_f64());
    console
}
