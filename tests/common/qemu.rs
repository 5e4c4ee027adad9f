//! QEMU 11's vfio-user-pci client driven through qtest: no guest OS, the test plays the
//! guest by writing config space, MMIO, I/O ports and RAM over QEMU's qtest line protocol.

use std::io::{self, BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc::{channel, Receiver, RecvTimeoutError};
use std::time::{Duration, Instant};

/// The repository's QEMU fetcher (`scripts/get-qemu`).
pub fn get_qemu() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/get-qemu")
}

/// The QEMU binary, from `scripts/get-qemu` (`$UMDEV_QEMU`, a system QEMU with vfio-user-pci, or
/// Debian's, fetched once and cached). `None`, with the reason printed, when QEMU cannot be
/// obtained (exit 77): the only case a QEMU test skips. Any other failure fails the test.
pub fn qemu_binary() -> Option<PathBuf> {
    let out = Command::new(get_qemu()).output().expect("running scripts/get-qemu");
    match out.status.code() {
        Some(0) => Some(PathBuf::from(String::from_utf8_lossy(&out.stdout).trim())),
        Some(77) => {
            eprintln!("SKIPPED: QEMU cannot be obtained: {}", String::from_utf8_lossy(&out.stderr).trim());
            None
        }
        _ => panic!("scripts/get-qemu failed ({}): {}", out.status, String::from_utf8_lossy(&out.stderr)),
    }
}

/// A running QEMU with one vfio-user-pci device at 00:04.0.
pub struct Qtest {
    child: Child,
    stdin: ChildStdin,
    lines: Receiver<String>,
    /// Asynchronous `IRQ raise/lower N` lines seen so far.
    pub irq_events: Vec<String>,
    pub stderr_path: PathBuf,
}

/// Config space address of 00:04.0 for the 0xcf8/0xcfc mechanism.
pub const DEV: u32 = 0x8000_2000;

impl Qtest {
    /// Starts QEMU (q35, `mem` MiB of memfd RAM shared with the device) connected to `socket`.
    pub fn start(qemu: &Path, socket: &Path, mem_mib: u32, workdir: &Path) -> io::Result<Qtest> {
        let stderr_path = workdir.join("qemu.stderr");
        // QEMU fails a message whose reply takes over `x-msg-timeout` (5 s by default), and
        // the guest then reads all-ones: on a busy machine that is a slow test, not a broken
        // server, so the bound is a hang guard's.
        let dev = format!(
            r#"{{"driver":"vfio-user-pci","addr":"04.0","x-msg-timeout":120000,"socket":{{"type":"unix","path":"{}"}}}}"#,
            socket.display()
        );
        let mut child = Command::new(qemu)
            .args(["-machine", "q35", "-accel", "qtest", "-nodefaults", "-display", "none"])
            .args(["-m", &format!("{mem_mib}M")])
            .args(["-object", &format!("memory-backend-memfd,id=mem,size={mem_mib}M,share=on")])
            .args(["-machine", "memory-backend=mem", "-qtest", "stdio", "-device", &dev])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(std::fs::File::create(&stderr_path)?)
            .spawn()?;
        let stdin = child.stdin.take().expect("piped");
        let stdout = child.stdout.take().expect("piped");
        let (tx, lines) = channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        Ok(Qtest { child, stdin, lines, irq_events: Vec::new(), stderr_path })
    }

    /// Kills QEMU outright (SIGKILL), as a crashing VMM would go, and reaps it.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Stops QEMU with SIGTERM, as a management stack does, and reaps it.
    pub fn terminate(&mut self) -> std::process::ExitStatus {
        let pid = nix::unistd::Pid::from_raw(self.child.id() as i32);
        let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM);
        self.child.wait().expect("reaping QEMU")
    }

    /// QEMU's stderr so far (for assertion messages).
    pub fn stderr(&self) -> String {
        std::fs::read_to_string(&self.stderr_path).unwrap_or_default()
    }

    /// Sends one qtest command and returns its response line ("OK ...").
    pub fn cmd(&mut self, c: &str) -> String {
        writeln!(self.stdin, "{c}").expect("QEMU stdin");
        self.stdin.flush().expect("QEMU stdin");
        // A hang guard: the first command also waits for QEMU's start and its connection.
        let deadline = Instant::now() + Duration::from_secs(120);
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(line) if line.starts_with("IRQ") => self.irq_events.push(line),
                Ok(line) => {
                    assert!(line.starts_with("OK"), "qtest `{c}` failed: {line}\n{}", self.stderr());
                    return line;
                }
                Err(RecvTimeoutError::Timeout) => panic!("qtest `{c}` timed out\n{}", self.stderr()),
                Err(RecvTimeoutError::Disconnected) => panic!("QEMU exited during `{c}`\n{}", self.stderr()),
            }
        }
    }

    fn value(&mut self, c: &str) -> u64 {
        let line = self.cmd(c);
        let v = line.split_whitespace().nth(1).unwrap_or("0");
        u64::from_str_radix(v.trim_start_matches("0x"), 16).unwrap_or_else(|_| panic!("bad reply {line}"))
    }

    pub fn readl(&mut self, addr: u64) -> u32 {
        self.value(&format!("readl {addr:#x}")) as u32
    }
    pub fn writel(&mut self, addr: u64, v: u32) {
        self.cmd(&format!("writel {addr:#x} {v:#x}"));
    }
    pub fn inl(&mut self, port: u16) -> u32 {
        self.value(&format!("inl {port:#x}")) as u32
    }
    pub fn outl(&mut self, port: u16, v: u32) {
        self.cmd(&format!("outl {port:#x} {v:#x}"));
    }
    pub fn inw(&mut self, port: u16) -> u16 {
        self.value(&format!("inw {port:#x}")) as u16
    }
    pub fn outw(&mut self, port: u16, v: u16) {
        self.cmd(&format!("outw {port:#x} {v:#x}"));
    }
    pub fn inb(&mut self, port: u16) -> u8 {
        self.value(&format!("inb {port:#x}")) as u8
    }
    pub fn outb(&mut self, port: u16, v: u8) {
        self.cmd(&format!("outb {port:#x} {v:#x}"));
    }

    /// Reads guest RAM.
    pub fn read(&mut self, addr: u64, len: usize) -> Vec<u8> {
        let line = self.cmd(&format!("read {addr:#x} {len:#x}"));
        let hex = line.split_whitespace().nth(1).unwrap_or("0x").trim_start_matches("0x").to_string();
        (0..hex.len() / 2).map(|i| u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).expect("hex")).collect()
    }

    /// Writes guest RAM.
    pub fn write(&mut self, addr: u64, data: &[u8]) {
        let hex: String = data.iter().map(|b| format!("{b:02x}")).collect();
        self.cmd(&format!("write {addr:#x} {:#x} 0x{hex}", data.len()));
    }

    /// Config space of 00:04.0.
    pub fn cfg_read32(&mut self, off: u32) -> u32 {
        self.outl(0xcf8, DEV | (off & 0xfc));
        self.inl(0xcfc)
    }
    pub fn cfg_read16(&mut self, off: u32) -> u16 {
        self.outl(0xcf8, DEV | (off & 0xfc));
        self.inw(0xcfc + (off & 2) as u16)
    }
    pub fn cfg_read8(&mut self, off: u32) -> u8 {
        self.outl(0xcf8, DEV | (off & 0xfc));
        self.inb(0xcfc + (off & 3) as u16)
    }
    pub fn cfg_write32(&mut self, off: u32, v: u32) {
        self.outl(0xcf8, DEV | (off & 0xfc));
        self.outl(0xcfc, v);
    }
    pub fn cfg_write16(&mut self, off: u32, v: u16) {
        self.outl(0xcf8, DEV | (off & 0xfc));
        self.outw(0xcfc + (off & 2) as u16, v);
    }

    /// The IDs on 00:04.0's capability list, in list order (at most 16, should it loop).
    pub fn cap_ids(&mut self) -> Vec<u8> {
        let mut caps = Vec::new();
        let mut ptr = self.cfg_read8(0x34);
        while ptr != 0 && caps.len() < 16 {
            caps.push(self.cfg_read8(u32::from(ptr)));
            ptr = self.cfg_read8(u32::from(ptr) + 1);
        }
        caps
    }

    /// Sizes BAR `i` the way a guest does: returns the size mask it reads back.
    pub fn size_bar(&mut self, i: u32) -> u32 {
        let off = 0x10 + 4 * i;
        let old = self.cfg_read32(off);
        self.cfg_write32(off, 0xffff_ffff);
        let mask = self.cfg_read32(off);
        self.cfg_write32(off, old);
        mask
    }

    /// Waits for an `IRQ raise` line; returns the line.
    pub fn wait_irq_raise(&mut self, timeout: Duration) -> Option<String> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(i) = self.irq_events.iter().position(|l| l.starts_with("IRQ raise")) {
                return Some(self.irq_events.remove(i));
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return None;
            }
            match self.lines.recv_timeout(left.min(Duration::from_millis(50))) {
                Ok(line) if line.starts_with("IRQ") => self.irq_events.push(line),
                Ok(line) => panic!("unexpected qtest output {line}"),
                Err(RecvTimeoutError::Timeout) => {}
                Err(RecvTimeoutError::Disconnected) => return None,
            }
        }
    }

    /// True while QEMU runs.
    pub fn running(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }
}

impl Drop for Qtest {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
