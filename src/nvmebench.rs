//! `umdev nvmebench`: the nvme controller end to end over vfio-user, as QEMU drives it
//! (doorbells as posted REGION_WRITEs, MSI-X eventfds), against floors measured in the same
//! run: memcpy bandwidth, and a posted REGION_WRITE that raises an eventfd interrupt (a
//! testdev register). The server runs as its own `umdev run` process, so its CPU time per
//! I/O is the process's own (utime + stime from /proc, what getrusage reports).
//!
//! Workloads on a RAM namespace, filled first: 4 KiB random reads and writes at queue depth
//! 1 and 32 on 1 and 2 queue pairs; 128 KiB sequential reads and writes at queue depth 8.
//! Each 128 KiB buffer is 32 guest pages in 8 runs of 4 at scattered addresses (a PRP list
//! per command; what a guest's block layer hands a driver looks like this).
//!
//! With `--shadow-doorbells`, the I/O queues' doorbells are written as Linux's driver writes
//! them when the controller offers Doorbell Buffer Config: into the shadow page, and as a
//! message only when the controller's event index asks for one. Each row counts the doorbell
//! messages per I/O, and the interrupts the controller raised per I/O (the eventfds' counts).
//!
//! With `--poll`, the I/O completion queues are created without interrupts and the client
//! polls them, as SPDK's initiator and Linux's poll queues do: no wake-up of the client per
//! completion, a CPU kept busy instead.
//!
//! With `--fixed-buffers`, instead: a file namespace with `cache1=none` (O_DIRECT) in kernel
//! pin mode, served by `fixed_buffers=always` and by `off` on the same file in alternation,
//! one server at a time (each has the file to itself), started afresh for each run (each
//! round runs both, back to back, in alternating order): 4 KiB
//! random reads at QD1 and QD32, random writes at QD32, 16, 32, 64 and 128 KiB random reads
//! and 128 KiB random writes at QD8, into contiguous buffers (one run each, which a fixed
//! buffer can hold). Medians over the rounds, and the median of each round's on/off ratio.

use crate::output::out;
use std::collections::BTreeMap;
use std::os::fd::{AsRawFd, BorrowedFd};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
use serde::Serialize;
use umdev_devices::nvme::spec::Sqe;
use umdev_devices::testdev;
use umdev_server::wire::{flags, Command as Cmd};
use umdev_testkit::client::{region_write_payload, set_irqs_payload, RawClient};
use umdev_testkit::nvme_driver::Driver;
use umdev_testkit::nvme_guest::{wait_eventfd, NvmeGuest};
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

use crate::pinbench::{median, Rng};

/// The namespace.
const NS_BYTES: u64 = 256 << 20;
/// Guest RAM of the benchmark's "guest".
const RAM: u64 = 160 << 20;
const BIG: usize = 128 << 10;
const QUEUE_ENTRIES: u32 = 256;

/// One workload's result.
#[derive(Debug, Serialize)]
pub struct Row {
    /// `4k-randread`, `128k-seqwrite`, ...
    pub workload: String,
    /// Commands in flight per queue.
    pub qd: usize,
    /// I/O queue pairs used.
    pub queues: u16,
    /// Completed I/Os per second.
    pub iops: f64,
    /// Data per second, GB/s.
    pub gb_per_sec: f64,
    /// Submission to completion, per I/O.
    pub latency_p50_us: f64,
    /// See [`Row::latency_p50_us`].
    pub latency_p99_us: f64,
    /// The server process's CPU time (user + system) per I/O.
    pub server_cpu_us_per_io: f64,
    /// Doorbell register writes (vfio-user messages) per I/O: with `--shadow-doorbells`, those
    /// the controller's event indexes asked for.
    pub doorbell_messages_per_io: f64,
    /// Interrupts the controller raised per I/O (the queues' eventfd counts): 0 with `--poll`.
    pub interrupts_per_io: f64,
    /// 128 KiB rows: the median over rounds of this round's GB/s over a memcpy of 128 KiB
    /// blocks streamed over the namespace's size measured right before it (the rounds
    /// alternate the two). The row's other figures are medians over the same rounds.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub vs_memcpy: Option<f64>,
}

/// Floors measured in the same run.
#[derive(Debug, Serialize)]
pub struct Floors {
    /// memcpy of 2 MiB between warm buffers.
    pub memcpy_2m_gb_per_sec: f64,
    /// memcpy of 128 KiB blocks, sequential through a region the namespace's size into
    /// rotating destination buffers: the data movement of a 128 KiB sequential read.
    pub memcpy_128k_stream_gb_per_sec: f64,
    /// A posted REGION_WRITE that raises an MSI-X interrupt, to the eventfd: p50.
    pub doorbell_irq_p50_us: f64,
    /// See [`Floors::doorbell_irq_p50_us`].
    pub doorbell_irq_p99_us: f64,
}

/// The whole report.
#[derive(Debug, Serialize)]
pub struct Report {
    /// What namespace 1 was (`ram:256M`, or the file's `--opt`s), and how much of it the
    /// workloads used when not all.
    pub namespace: String,
    /// I/O queue doorbells went through shadow doorbells (`--shadow-doorbells`).
    pub shadow_doorbells: bool,
    /// The client polled its completion queues, created without interrupts (`--poll`).
    pub poll: bool,
    /// The floors.
    pub floors: Floors,
    /// The workloads.
    pub rows: Vec<Row>,
    /// What the server's statistics say of the run (pages, runs, pin calls).
    pub server: serde_json::Value,
}

/// A `umdev run` child, killed on drop.
struct Server {
    child: Child,
    socket: PathBuf,
}

impl Server {
    /// Starts `umdev run` and waits until it listens. One that exits first fails the
    /// benchmark with what it said; one that is still starting after a minute, with that.
    fn start(dir: &Path, name: &str, args: &[&str]) -> Result<Server, String> {
        let socket = dir.join(format!("{name}.sock"));
        let exe = std::env::current_exe().map_err(|e| e.to_string())?;
        let mut command = Command::new(exe);
        command
            .arg("run")
            .arg("--socket")
            .arg(&socket)
            .args(args)
            .stdout(Stdio::null())
            .stderr(Stdio::piped());
        crate::cleanup::die_with_parent(&mut command);
        let child = command.spawn().map_err(|e| format!("starting umdev run: {e}"))?;
        crate::cleanup::child(child.id());
        let mut server = Server { child, socket };
        let deadline = Instant::now() + Duration::from_secs(60);
        while !server.socket.exists() {
            if let Ok(Some(status)) = server.child.try_wait() {
                let mut err = String::new();
                if let Some(mut e) = server.child.stderr.take() {
                    let _ = std::io::Read::read_to_string(&mut e, &mut err);
                }
                return Err(format!(
                    "the server under test (umdev run {}) exited ({status}): {}",
                    args.join(" "),
                    err.trim()
                ));
            }
            if Instant::now() > deadline {
                return Err(format!("umdev run {} did not listen within a minute", args.join(" ")));
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        std::thread::sleep(Duration::from_millis(20));
        Ok(server)
    }

    /// User + system CPU time of the process so far.
    fn cpu(&self) -> Duration {
        let stat = std::fs::read_to_string(format!("/proc/{}/stat", self.child.id())).unwrap_or_default();
        // Fields after the command name (which may hold spaces): utime is the 14th field.
        let rest = stat.rsplit_once(')').map(|(_, r)| r).unwrap_or("");
        // After the name: state, ppid, ..., utime (the 12th), stime (the 13th).
        let f: Vec<&str> = rest.split_whitespace().collect();
        let field = |i: usize| f.get(i).and_then(|v| v.parse::<u64>().ok()).unwrap_or(0);
        let ticks = field(11) + field(12);
        let hz = nix::unistd::sysconf(nix::unistd::SysconfVar::CLK_TCK).ok().flatten().unwrap_or(100) as u64;
        Duration::from_nanos(ticks * 1_000_000_000 / hz)
    }

    /// Stops the server; the device statistics it prints on exit.
    fn stop(mut self) -> serde_json::Value {
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(self.child.id() as i32),
            nix::sys::signal::SIGTERM,
        );
        let mut err = String::new();
        if let Some(mut e) = self.child.stderr.take() {
            let _ = std::io::Read::read_to_string(&mut e, &mut err);
        }
        let _ = self.child.wait();
        crate::cleanup::forget_child(self.child.id());
        err.lines()
            .find_map(|l| l.split_once(" on exit: ").map(|(_, j)| j.to_string()))
            .and_then(|j| serde_json::from_str(&j).ok())
            .unwrap_or(serde_json::Value::Null)
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        crate::cleanup::forget_child(self.child.id());
    }
}

/// Guest pages of slot `slot` of queue `q` for `len` bytes (at most 128 KiB): one page for
/// 4 KiB; one run if `contiguous`; else (128 KiB) 32 pages in runs of 4 at scattered
/// addresses.
fn buffer_pages(q: u16, slot: usize, len: usize, contiguous: bool) -> Vec<u64> {
    let base = Driver::<NvmeGuest>::DATA + (u64::from(q) * 64 + slot as u64) * (BIG as u64 * 2);
    if len <= 4096 {
        return vec![base];
    }
    if contiguous {
        return (0..len.div_ceil(4096) as u64).map(|p| base + p * 4096).collect();
    }
    // 8 runs of 4 pages, in a scrambled order over a 256 KiB window.
    let order = [5u64, 0, 7, 2, 4, 1, 6, 3];
    order.iter().flat_map(|&r| (0..4).map(move |p| base + (r * 8 + p) * 4096)).collect()
}

#[derive(Clone, Copy, PartialEq)]
enum Kind {
    RandRead,
    RandWrite,
    SeqRead,
    SeqWrite,
}

impl Kind {
    fn name(self, len: usize) -> String {
        let size = format!("{}k", len >> 10);
        let what = match self {
            Kind::RandRead => "randread",
            Kind::RandWrite => "randwrite",
            Kind::SeqRead => "seqread",
            Kind::SeqWrite => "seqwrite",
        };
        format!("{size}-{what}")
    }
    fn read(self) -> bool {
        matches!(self, Kind::RandRead | Kind::SeqRead)
    }
}

/// The transfer size of a workload: 128 KiB if `big`, else 4 KiB.
fn size(big: bool) -> usize {
    if big {
        BIG
    } else {
        4096
    }
}

/// Keeps `qd` commands in flight on each of `queues` queue pairs for `duration`, each moving
/// `len` bytes (buffers in one run each if `contiguous`).
#[allow(clippy::too_many_arguments)]
fn workload(
    d: &mut Driver<NvmeGuest>,
    server: &Server,
    kind: Kind,
    len: usize,
    contiguous: bool,
    qd: usize,
    queues: u16,
    duration: Duration,
    poll: bool,
) -> Result<Row, String> {
    let blocks = (len / 512) as u32;
    let ns_blocks = NS_BYTES / 512;
    let mut rng = Rng::new(0x5eed ^ qd as u64 ^ u64::from(queues) << 8);
    let mut seq = 0u64;
    let mut next_lba = |rng: &mut Rng| -> u64 {
        match kind {
            Kind::SeqRead | Kind::SeqWrite => {
                let lba = seq;
                seq = (seq + u64::from(blocks)) % ns_blocks;
                lba
            }
            _ => (rng.next_u64() % (ns_blocks / u64::from(blocks))) * u64::from(blocks),
        }
    };
    // PRPs per slot, written once.
    let mut prps = Vec::new();
    for q in 1..=queues {
        let mut per_queue = Vec::new();
        for slot in 0..qd {
            let pages = buffer_pages(q, slot, len, contiguous);
            per_queue.push(d.prps(q, slot as u32, &pages, 0, len)?);
        }
        prps.push(per_queue);
    }
    // What earlier workloads left in the eventfds is not this one's.
    let _ = drain_count(&d.t.irqs[1..=usize::from(queues)]);
    let mut submitted_at = vec![vec![Instant::now(); qd]; usize::from(queues)];
    let mut lat = Vec::with_capacity(1 << 16);
    let submit = |d: &mut Driver<NvmeGuest>, q: u16, slot: usize, lba: u64| -> Result<(), String> {
        let (prp1, prp2) = prps[usize::from(q - 1)][slot];
        let mut sqe: Sqe = Driver::<NvmeGuest>::rw_command(kind.read(), 1, lba, blocks, prp1, prp2);
        sqe.cdw0 = ((u32::from(sqe.cdw0) & 0xffff) | (slot as u32) << 16).into();
        d.push(q, &sqe)
    };
    for q in 1..=queues {
        for (slot, at) in submitted_at[usize::from(q - 1)].iter_mut().enumerate() {
            let lba = next_lba(&mut rng);
            submit(d, q, slot, lba)?;
            *at = Instant::now();
        }
        d.ring(q)?;
    }
    let cpu0 = server.cpu();
    let rung0 = d.doorbells.written;
    let mut interrupts = 0u64;
    let start = Instant::now();
    let mut done = 0u64;
    let mut draining = false;
    let mut in_flight = usize::from(queues) * qd;
    while in_flight > 0 {
        let mut got = false;
        for q in 1..=queues {
            let mut reaped = 0;
            while let Some(cqe) = d.poll_one(q)? {
                let now = Instant::now();
                let slot = usize::from(u16::from(cqe.cid));
                if !cqe.status().ok() {
                    return Err(format!("I/O failed: status {:#x}", cqe.status().0));
                }
                lat.push(now.duration_since(submitted_at[usize::from(q - 1)][slot]).as_secs_f64() * 1e6);
                done += 1;
                reaped += 1;
                if draining {
                    in_flight -= 1;
                } else {
                    let lba = next_lba(&mut rng);
                    submit(d, q, slot, lba)?;
                    submitted_at[usize::from(q - 1)][slot] = Instant::now();
                }
            }
            if reaped > 0 {
                got = true;
                d.release(q)?;
                if !draining {
                    d.ring(q)?;
                }
            }
        }
        if !draining && start.elapsed() >= duration {
            draining = true;
        }
        if !got {
            if poll {
                std::hint::spin_loop();
            } else {
                interrupts += wait_any(&d.t.irqs[1..=usize::from(queues)], Duration::from_millis(100));
            }
        }
    }
    let elapsed = start.elapsed();
    interrupts += drain_count(&d.t.irqs[1..=usize::from(queues)]);
    let cpu = server.cpu().saturating_sub(cpu0);
    let mut lat_sorted = lat.clone();
    lat_sorted.sort_by(|a, b| a.total_cmp(b));
    let pct = |p: f64| lat_sorted.get(((lat_sorted.len() as f64 - 1.0) * p) as usize).copied().unwrap_or(0.0);
    Ok(Row {
        workload: kind.name(len),
        qd,
        queues,
        iops: done as f64 / elapsed.as_secs_f64(),
        gb_per_sec: done as f64 * len as f64 / elapsed.as_secs_f64() / 1e9,
        latency_p50_us: pct(0.5),
        latency_p99_us: pct(0.99),
        server_cpu_us_per_io: cpu.as_secs_f64() * 1e6 / done.max(1) as f64,
        doorbell_messages_per_io: (d.doorbells.written - rung0) as f64 / done.max(1) as f64,
        interrupts_per_io: interrupts as f64 / done.max(1) as f64,
        vs_memcpy: None,
    })
}

/// A 128 KiB workload in `rounds` rounds of `duration / rounds`, each right after a memcpy of
/// 128 KiB blocks streamed over the namespace's size: on this shared machine the two then see
/// the same neighbours. Medians over the rounds.
fn big_workload(
    d: &mut Driver<NvmeGuest>,
    server: &Server,
    kind: Kind,
    queues: u16,
    duration: Duration,
    rounds: usize,
    poll: bool,
) -> Result<Row, String> {
    let src = vec![7u8; NS_BYTES as usize];
    let mut dst = vec![0u8; 16 * BIG];
    memcpy_stream(&src, &mut dst); // fault the buffers in
    let mut rows = Vec::new();
    let mut ratios = Vec::new();
    for _ in 0..rounds.max(1) {
        let floor = memcpy_stream(&src, &mut dst);
        let row = workload(d, server, kind, BIG, false, 8, queues, duration / rounds.max(1) as u32, poll)?;
        ratios.push(row.gb_per_sec / floor);
        rows.push(row);
    }
    let mid = |f: fn(&Row) -> f64| median(&mut rows.iter().map(f).collect::<Vec<_>>());
    Ok(Row {
        workload: kind.name(BIG),
        qd: 8,
        queues,
        iops: mid(|r| r.iops),
        gb_per_sec: mid(|r| r.gb_per_sec),
        latency_p50_us: mid(|r| r.latency_p50_us),
        latency_p99_us: mid(|r| r.latency_p99_us),
        server_cpu_us_per_io: mid(|r| r.server_cpu_us_per_io),
        doorbell_messages_per_io: mid(|r| r.doorbell_messages_per_io),
        interrupts_per_io: mid(|r| r.interrupts_per_io),
        vs_memcpy: Some(median(&mut ratios)),
    })
}

/// GB/s of one pass of 128 KiB block copies from `src` into rotating blocks of `dst`.
fn memcpy_stream(src: &[u8], dst: &mut [u8]) -> f64 {
    let t = Instant::now();
    for (i, block) in src.chunks_exact(BIG).enumerate() {
        let at = (i % 16) * BIG;
        dst[at..at + BIG].copy_from_slice(std::hint::black_box(block));
        std::hint::black_box(&mut *dst);
    }
    src.len() as f64 / t.elapsed().as_secs_f64() / 1e9
}

/// Writes the whole namespace once, 128 KiB at a time, 8 in flight, so reads find
/// allocated memory.
fn fill(d: &mut Driver<NvmeGuest>) -> Result<(), String> {
    let blocks = (BIG / 512) as u32;
    let prps: Vec<(u64, u64)> = (0..8)
        .map(|slot| d.prps(1, slot, &buffer_pages(1, slot as usize, BIG, false), 0, BIG))
        .collect::<Result<_, _>>()?;
    for batch in 0..(NS_BYTES / BIG as u64 / 8) {
        for (slot, &(prp1, prp2)) in prps.iter().enumerate() {
            let lba = (batch * 8 + slot as u64) * u64::from(blocks);
            d.push(1, &Driver::<NvmeGuest>::rw_command(false, 1, lba, blocks, prp1, prp2))?;
        }
        d.ring(1)?;
        for _ in 0..8 {
            let cqe = d.wait(1, Duration::from_secs(10))?;
            if !cqe.status().ok() {
                return Err(format!("filling the namespace: status {:#x}", cqe.status().0));
            }
        }
    }
    Ok(())
}

/// Waits for an interrupt on any of `efds` (at most `timeout`): how many were raised.
fn wait_any(efds: &[EventFd], timeout: Duration) -> u64 {
    // SAFETY: the eventfds outlive the borrows.
    let fds: Vec<BorrowedFd<'_>> =
        efds.iter().map(|e| unsafe { BorrowedFd::borrow_raw(e.as_raw_fd()) }).collect();
    let mut polls: Vec<PollFd<'_>> = fds.iter().map(|f| PollFd::new(*f, PollFlags::POLLIN)).collect();
    if poll(&mut polls, PollTimeout::try_from(timeout).unwrap_or(PollTimeout::MAX)).unwrap_or(0) > 0 {
        drain_count(efds)
    } else {
        0
    }
}

/// The interrupts raised on `efds` (non-blocking eventfds) since they were last read.
fn drain_count(efds: &[EventFd]) -> u64 {
    efds.iter().map(|e| e.read().unwrap_or(0)).sum()
}

/// memcpy floors: 2 MiB warm, and 128 KiB blocks streamed through a namespace-sized region.
fn memcpy_floors(rounds: usize) -> (f64, f64) {
    let src = vec![7u8; NS_BYTES as usize];
    let mut dst = vec![0u8; 16 * BIG];
    let mut warm = vec![0u8; 2 << 20];
    let mut a = Vec::new();
    let mut b = Vec::new();
    for _ in 0..rounds {
        let n = 64;
        let t = Instant::now();
        for _ in 0..n {
            warm.copy_from_slice(std::hint::black_box(&src[..2 << 20]));
            std::hint::black_box(&mut warm);
        }
        a.push((n * (2 << 20)) as f64 / t.elapsed().as_secs_f64() / 1e9);
        let t = Instant::now();
        for (i, block) in src.chunks_exact(BIG).enumerate() {
            let at = (i % 16) * BIG;
            dst[at..at + BIG].copy_from_slice(std::hint::black_box(block));
            std::hint::black_box(&mut dst);
        }
        b.push(src.len() as f64 / t.elapsed().as_secs_f64() / 1e9);
        std::hint::black_box(&dst);
    }
    (median(&mut a), median(&mut b))
}

/// A posted write to testdev's IRQ_RAISE, to its MSI-X eventfd.
fn doorbell_irq_floor(socket: &Path, n: usize) -> Result<(f64, f64), String> {
    let mut c = RawClient::connect(socket).map_err(|e| e.to_string())?;
    c.negotiate().map_err(|e| e.to_string())?;
    c.enable_bus_master().map_err(|e| e.to_string())?;
    let mut ptr = config8(&mut c, 0x34)?;
    while ptr != 0 && config8(&mut c, ptr)? != 0x11 {
        ptr = config8(&mut c, ptr + 1)?;
    }
    if ptr == 0 {
        return Err("testdev: no MSI-X".into());
    }
    c.region_write(7, u64::from(ptr) + 2, &0x8000u16.to_le_bytes()).map_err(|e| e.to_string())?;
    let efd = EventFd::new(EFD_NONBLOCK).map_err(|e| e.to_string())?;
    let set = set_irqs_payload(0x24, 2, 0, 1, &[]);
    c.request(Cmd::DeviceSetIrqs as u16, &set, &[efd.as_raw_fd()]).map_err(|e| e.to_string())?;
    let payload = region_write_payload(0, testdev::regs::IRQ_RAISE, &1u32.to_le_bytes());
    let mut v = Vec::with_capacity(n);
    for i in 0..n + 100 {
        let t = Instant::now();
        c.send(Cmd::RegionWrite as u16, flags::NO_REPLY, &payload, &[]).map_err(|e| e.to_string())?;
        if !wait_eventfd(&efd, Duration::from_secs(5)) {
            return Err("testdev: no interrupt".into());
        }
        if i >= 100 {
            v.push(t.elapsed().as_secs_f64() * 1e6);
        }
    }
    v.sort_by(|a, b| a.total_cmp(b));
    Ok((v[v.len() / 2], v[v.len() * 99 / 100]))
}

fn config8(c: &mut RawClient, off: u32) -> Result<u32, String> {
    let r = c.region_read(7, u64::from(off), 1).map_err(|e| e.to_string())?;
    Ok(u32::from(*r.payload.get(16).ok_or("short config read")?))
}

/// The workloads, in the order they run: 4 KiB random reads and writes on 1 and 2 queues at
/// QD1 and QD32, then 128 KiB sequential reads and writes on 1 and 2 queues.
fn workloads() -> Vec<(Kind, bool, u16, usize)> {
    let mut all = Vec::new();
    for kind in [Kind::RandRead, Kind::RandWrite] {
        for queues in [1u16, 2] {
            for qd in [1usize, 32] {
                all.push((kind, false, queues, qd));
            }
        }
    }
    for kind in [Kind::SeqRead, Kind::SeqWrite] {
        for queues in [1u16, 2] {
            all.push((kind, true, queues, 8));
        }
    }
    all
}

/// Refuses a backing file (or block device) smaller than the benchmark's namespace.
fn check_size(file: &Path) -> Result<(), String> {
    let len = file_bytes(file)?;
    if len < NS_BYTES {
        return Err(format!("{}: {len} bytes; the benchmark needs {NS_BYTES}", file.display()));
    }
    Ok(())
}

/// The size of a namespace as `--opt ns1=` names it (`ram:SIZE`, `file:PATH`), refused when it
/// is smaller than the [`NS_BYTES`] the workloads fill and address (they would fail mid-run);
/// `None` for a value that is neither, the server's to refuse in its words.
fn namespace_bytes(value: &str) -> Result<Option<u64>, String> {
    let bytes = match value.split_once(':') {
        Some(("ram", size)) => umdev_mdev::types::parse_size(size),
        Some(("file", path)) => {
            Some(file_bytes(Path::new(path)).map_err(|e| format!("--opt ns1={value}: {e}"))?)
        }
        _ => None,
    };
    match bytes {
        Some(bytes) if bytes < NS_BYTES => Err(format!(
            "--opt ns1={value}: {bytes} bytes; the benchmark's workloads need a namespace of {} MiB at least",
            NS_BYTES >> 20
        )),
        bytes => Ok(bytes),
    }
}

/// A file's (or block device's) size: its end's offset, where metadata says 0 for a device.
fn file_bytes(file: &Path) -> Result<u64, String> {
    std::fs::File::open(file)
        .and_then(|mut f| std::io::Seek::seek(&mut f, std::io::SeekFrom::End(0)))
        .map_err(|e| format!("{}: {e}", file.display()))
}

/// What namespace 1 is, for the report: its `ns1` (and `cache1`) options, and how much of it
/// the workloads use when that is not all of it.
fn describe_namespace(params: &BTreeMap<String, String>) -> Result<String, String> {
    let mut text = std::iter::once(params["ns1"].clone())
        .chain(params.get("cache1").map(|c| format!("cache1={c}")))
        .collect::<Vec<_>>()
        .join(" ");
    if namespace_bytes(&params["ns1"])?.is_some_and(|b| b > NS_BYTES) {
        text.push_str(&format!(" (the workloads use its first {} MiB)", NS_BYTES >> 20));
    }
    Ok(text)
}

/// `file` as the server takes it: absolute (a daemon's directory is not the caller's).
fn absolute(file: &Path) -> Result<PathBuf, String> {
    std::fs::canonicalize(file).map_err(|e| format!("{}: {e}", file.display()))
}

/// The nvme options of the server under test: the benchmark's own (two queues of
/// [`QUEUE_ENTRIES`], namespace 1 in RAM or on `file`, `cache1=none` for a file), each
/// overridden by the one of `opts` with its key. Refused: what the workloads cannot run
/// with (fewer queues or entries), and `ns1` beside `file`, which sets it.
fn server_options(opts: &[String], file: Option<&Path>) -> Result<BTreeMap<String, String>, String> {
    let given = crate::parse_params(opts)?;
    if file.is_some() && given.contains_key("ns1") {
        return Err("--opt ns1 and --file both name namespace 1: give one".into());
    }
    for (key, least) in [("queues", 2), ("entries", QUEUE_ENTRIES)] {
        // A value that is no number is the server's to refuse, in its words.
        if let Some(n) = given.get(key).and_then(|v| v.parse::<u32>().ok()).filter(|n| *n < least) {
            return Err(format!("--opt {key}={n}: the benchmark's workloads need {key}={least} at least"));
        }
    }
    let mut params = BTreeMap::from([
        ("queues".to_string(), "2".to_string()),
        ("entries".to_string(), QUEUE_ENTRIES.to_string()),
        (
            "ns1".to_string(),
            match file {
                Some(file) => {
                    check_size(file)?;
                    format!("file:{}", file.display())
                }
                None => format!("ram:{}M", NS_BYTES >> 20),
            },
        ),
    ]);
    if file.is_some() {
        params.insert("cache1".into(), "none".into());
    }
    if let Some(ns1) = given.get("ns1") {
        namespace_bytes(ns1)?;
    }
    params.extend(given);
    Ok(params)
}

/// Runs the benchmark: the workloads whose name starts with `only` (refused if none does), on
/// a RAM namespace or, with `file`, on that file (`cache1=none` unless `opts` set `cache1`).
pub fn run(
    quick: bool,
    only: Option<&str>,
    opts: &[String],
    file: Option<&Path>,
    shadow_doorbells: bool,
    poll: bool,
) -> Result<Report, String> {
    let chosen: Vec<(Kind, bool, u16, usize)> = workloads()
        .into_iter()
        .filter(|(kind, big, _, _)| only.is_none_or(|o| kind.name(size(*big)).starts_with(o)))
        .collect();
    if chosen.is_empty() {
        let mut names: Vec<String> = workloads().iter().map(|(k, big, _, _)| k.name(size(*big))).collect();
        names.dedup();
        return Err(format!(
            "--only {:?} selects no workload (they are {})",
            only.unwrap_or(""),
            names.join(", ")
        ));
    }
    let mut progress = crate::progress::Progress::new("nvmebench", chosen.len() + 4);
    let dir = crate::cleanup::scratch_dir("nvmebench")?;
    let duration = if quick { Duration::from_millis(400) } else { Duration::from_secs(2) };
    let file = file.map(absolute).transpose()?;
    let params = server_options(opts, file.as_deref())?;
    let namespace = describe_namespace(&params)?;
    let args: Vec<String> = ["--type", "nvme"]
        .into_iter()
        .map(String::from)
        .chain(params.iter().flat_map(|(k, v)| ["--opt".to_string(), format!("{k}={v}")]))
        .collect();
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    progress.step("starting the servers");
    let server = Server::start(dir.path(), "nvme", &args)?;
    let floor_server = Server::start(dir.path(), "testdev", &["--type", "testdev"])?;
    log::info!("nvmebench: server pid {}", server.child.id());

    let mut d = NvmeGuest::connect(&server.socket, RAM, 3)?.driver();
    d.enable()?;
    if poll {
        d.create_polled_io_queues(2, QUEUE_ENTRIES)?;
    } else {
        d.create_io_queues(2, QUEUE_ENTRIES, false)?;
    }
    if shadow_doorbells {
        d.enable_shadow_doorbells()?;
    }
    progress.step("filling the namespace");
    fill(&mut d)?;

    let rounds = if quick { 2 } else { 5 };
    progress.step("floors: memcpy, posted doorbell to interrupt");
    let (m2, m128) = memcpy_floors(rounds);
    let (f50, f99) = doorbell_irq_floor(&floor_server.socket, if quick { 2000 } else { 20000 })?;
    let mut rows = Vec::new();
    for (kind, big, queues, qd) in chosen {
        progress.step(format_args!("{} qd{qd} on {queues} queue(s)", kind.name(size(big))));
        rows.push(if big {
            big_workload(&mut d, &server, kind, queues, duration, if quick { 3 } else { 7 }, poll)?
        } else {
            workload(&mut d, &server, kind, 4096, false, qd, queues, duration, poll)?
        });
    }
    // The floors again, after: the median of both sittings is reported.
    progress.step("floors again");
    let (m2b, m128b) = memcpy_floors(rounds);
    let (f50b, f99b) = doorbell_irq_floor(&floor_server.socket, if quick { 2000 } else { 20000 })?;
    drop(d);
    let stats = server.stop();
    drop(floor_server);
    Ok(Report {
        namespace,
        shadow_doorbells,
        poll,
        floors: Floors {
            memcpy_2m_gb_per_sec: (m2 + m2b) / 2.0,
            memcpy_128k_stream_gb_per_sec: (m128 + m128b) / 2.0,
            doorbell_irq_p50_us: (f50 + f50b) / 2.0,
            doorbell_irq_p99_us: (f99 + f99b) / 2.0,
        },
        rows,
        server: stats.get("io").cloned().unwrap_or(serde_json::Value::Null),
    })
}

/// Prints the report as tables.
pub fn print(r: &Report) -> crate::output::Out {
    let f = &r.floors;
    out!(
        "nvme over vfio-user: namespace {}, doorbells as posted REGION_WRITEs{}, {}.",
        r.namespace,
        if r.shadow_doorbells { " where the shadow doorbells' event indexes ask for them" } else { "" },
        if r.poll { "completion queues polled (no interrupts)" } else { "MSI-X per queue" }
    )?;
    out!("Floors, measured in this run (mean of before and after):")?;
    out!("  memcpy of 2 MiB (warm buffers):                        {:6.2} GB/s", f.memcpy_2m_gb_per_sec)?;
    out!(
        "  memcpy of 128 KiB blocks streamed over 256 MiB:        {:6.2} GB/s",
        f.memcpy_128k_stream_gb_per_sec
    )?;
    out!(
        "  posted REGION_WRITE -> MSI-X eventfd (testdev):         p50 {:.1} us, p99 {:.1} us",
        f.doorbell_irq_p50_us,
        f.doorbell_irq_p99_us
    )?;
    out!("")?;
    out!(
        "workload        qd queues       IOPS    GB/s  lat p50  lat p99  server CPU/IO  msgs/IO  irqs/IO   vs floor"
    )?;
    for row in &r.rows {
        let vs = if let Some(ratio) = row.vs_memcpy {
            format!("{:.0}% of memcpy", 100.0 * ratio)
        } else if row.qd == 1 {
            format!("{:.2}x doorbell", row.latency_p50_us / f.doorbell_irq_p50_us)
        } else {
            String::new()
        };
        out!(
            "{:<14} {:>3} {:>6} {:>10.0} {:>7.2} {:>6.1}us {:>6.1}us {:>11.2}us {:>8.2} {:>8.2}   {}",
            row.workload,
            row.qd,
            row.queues,
            row.iops,
            row.gb_per_sec,
            row.latency_p50_us,
            row.latency_p99_us,
            row.server_cpu_us_per_io,
            row.doorbell_messages_per_io,
            row.interrupts_per_io,
            vs
        )?;
    }
    let io = &r.server;
    if !io.is_null() {
        out!("")?;
        out!(
            "server: {} commands, {} pages in {} runs, {} pin calls ({:.1} pages, {:.2} runs per command)",
            io["commands"],
            io["pages"],
            io["runs"],
            io["pin_calls"],
            io["mean_pages_per_command"].as_f64().unwrap_or(0.0),
            io["mean_runs_per_command"].as_f64().unwrap_or(0.0)
        )?;
    }
    Ok(())
}

/// One workload of `--fixed-buffers`: each side's medians over the rounds.
#[derive(Debug, Serialize)]
pub struct FixedRow {
    /// `4k-randread`, `128k-randwrite`, ...
    pub workload: String,
    /// Commands in flight (one queue pair).
    pub qd: usize,
    /// `fixed_buffers=always` (every one-run transfer fixed, whatever its size).
    pub on: Row,
    /// `fixed_buffers=off`.
    pub off: Row,
    /// Median over the rounds of the round's IOPS on / off.
    pub iops_on_vs_off: f64,
    /// Median over the rounds of the round's server CPU per I/O on / off.
    pub cpu_on_vs_off: f64,
}

/// What `--fixed-buffers` measured.
#[derive(Debug, Serialize)]
pub struct FixedReport {
    /// The namespace's file.
    pub file: String,
    /// Its size.
    pub file_bytes: u64,
    /// Rounds per workload; each runs both servers for `round_seconds`.
    pub rounds: usize,
    /// See [`FixedReport::rounds`].
    pub round_seconds: f64,
    /// The workloads.
    pub rows: Vec<FixedRow>,
    /// Transfers each server moved through fixed buffers (its `io.fixed_transfers`).
    pub fixed_transfers_on: u64,
    /// See [`FixedReport::fixed_transfers_on`].
    pub fixed_transfers_off: u64,
}

/// The medians of `rows`, one workload's rounds on one side.
fn medians(rows: &[Row]) -> Row {
    let mid = |f: fn(&Row) -> f64| median(&mut rows.iter().map(f).collect::<Vec<_>>());
    Row {
        workload: rows[0].workload.clone(),
        qd: rows[0].qd,
        queues: rows[0].queues,
        iops: mid(|r| r.iops),
        gb_per_sec: mid(|r| r.gb_per_sec),
        latency_p50_us: mid(|r| r.latency_p50_us),
        latency_p99_us: mid(|r| r.latency_p99_us),
        server_cpu_us_per_io: mid(|r| r.server_cpu_us_per_io),
        doorbell_messages_per_io: mid(|r| r.doorbell_messages_per_io),
        interrupts_per_io: mid(|r| r.interrupts_per_io),
        vs_memcpy: None,
    }
}

/// Where `--fixed-buffers` puts its namespace (on a filesystem or device that does O_DIRECT).
#[derive(Debug)]
pub enum Backing {
    /// A new file in the temporary directory.
    Temporary,
    /// A new file in this directory.
    In(PathBuf),
    /// This file or block device, whose first [`NS_BYTES`] are overwritten.
    Existing(PathBuf),
}

/// `--fixed-buffers`: a `cache1=none` file namespace in kernel pin mode, fixed buffers on
/// against off, alternating.
pub fn run_fixed(quick: bool, backing: Backing) -> Result<FixedReport, String> {
    let rounds = if quick { 3 } else { 7 };
    let round = if quick { Duration::from_millis(300) } else { Duration::from_secs(1) };
    let chosen = [
        (Kind::RandRead, 4096, 1usize),
        (Kind::RandRead, 4096, 32),
        (Kind::RandWrite, 4096, 32),
        (Kind::RandRead, 16 << 10, 8),
        (Kind::RandRead, 32 << 10, 8),
        (Kind::RandRead, 64 << 10, 8),
        (Kind::RandRead, BIG, 8),
        (Kind::RandWrite, BIG, 8),
    ];
    let mut progress = crate::progress::Progress::new("nvmebench --fixed-buffers", chosen.len() + 1);
    let tmp = crate::cleanup::scratch_dir("nvmebench-fixed")?;
    if let Backing::Existing(file) = &backing {
        check_size(file)?;
    }
    let place = match &backing {
        Backing::In(dir) => {
            // A directory the caller names must exist: only the benchmark's own is made.
            if !dir.is_dir() {
                return Err(format!("{}: not a directory", dir.display()));
            }
            Some(crate::cleanup::scratch_dir_in(dir, "nvmebench")?)
        }
        _ => None,
    };
    let file = match &backing {
        Backing::Existing(file) => file.clone(),
        _ => {
            let file = place.as_ref().map_or(tmp.path(), |p| p.path()).join("ns1.img");
            let made = std::fs::File::create(&file).and_then(|f| f.set_len(NS_BYTES));
            made.map_err(|e| format!("creating {}: {e}", file.display()))?;
            file
        }
    };
    let file = absolute(&file)?;
    let ns = format!("ns1=file:{}", file.display());
    let entries = format!("entries={QUEUE_ENTRIES}");
    let server = |side: &str| {
        let fixed = format!("fixed_buffers={side}");
        let args = [
            "--type",
            "nvme",
            "--pin-mode",
            "kernel",
            "--opt",
            &ns,
            "--opt",
            "cache1=none",
            "--opt",
            "queues=1",
            "--opt",
            &entries,
            "--opt",
            &fixed,
        ];
        Server::start(tmp.path(), &format!("nvme-fixed-{side}"), &args)
    };
    // One server at a time: each has the file to itself (a lock, or a block device's claim).
    // A fresh server for each run; both sides pay the same start.
    const SIDES: [&str; 2] = ["always", "off"];
    let connect = |side: usize| -> Result<(Server, Driver<NvmeGuest>), String> {
        let s = server(SIDES[side])?;
        let mut d = NvmeGuest::connect(&s.socket, RAM, 2)?.driver();
        d.enable()?;
        d.create_io_queues(1, QUEUE_ENTRIES, false)?;
        Ok((s, d))
    };
    let fixed = |v: serde_json::Value| v["io"]["fixed_transfers"].as_u64().unwrap_or(0);
    progress.step("filling the file");
    let (s, mut d) = connect(1)?;
    fill(&mut d)?;
    drop(d);
    s.stop();
    let mut transfers = [0u64; 2];
    let mut rows = Vec::new();
    for (kind, len, qd) in chosen {
        progress.step(format_args!("{} qd{qd}: on and off, {rounds} rounds", kind.name(len)));
        let mut sides: [Vec<Row>; 2] = [Vec::new(), Vec::new()];
        let (mut iops, mut cpu) = (Vec::new(), Vec::new());
        for r in 0..rounds {
            // Alternating which side goes first: a neighbour's load then falls on both.
            let order = if r % 2 == 0 { [0, 1] } else { [1, 0] };
            for side in order {
                let (s, mut d) = connect(side)?;
                let row = workload(&mut d, &s, kind, len, true, qd, 1, round, false)?;
                drop(d);
                transfers[side] += fixed(s.stop());
                sides[side].push(row);
            }
            let (on, off) = (&sides[0][r], &sides[1][r]);
            iops.push(on.iops / off.iops);
            cpu.push(on.server_cpu_us_per_io / off.server_cpu_us_per_io);
        }
        rows.push(FixedRow {
            workload: kind.name(len),
            qd,
            on: medians(&sides[0]),
            off: medians(&sides[1]),
            iops_on_vs_off: median(&mut iops),
            cpu_on_vs_off: median(&mut cpu),
        });
    }
    let [fixed_on, fixed_off] = transfers;
    if !matches!(backing, Backing::Existing(_)) {
        let _ = std::fs::remove_file(&file);
    }
    if fixed_on == 0 {
        return Err(
            "fixed_buffers=always moved no transfer through a fixed buffer (the server's log says why: \
                    a kernel without IORING_REGISTER_CLONE_BUFFERS, say)"
                .into(),
        );
    }
    Ok(FixedReport {
        file: file.display().to_string(),
        file_bytes: NS_BYTES,
        rounds,
        round_seconds: round.as_secs_f64(),
        rows,
        fixed_transfers_on: fixed_on,
        fixed_transfers_off: fixed_off,
    })
}

/// Prints the `--fixed-buffers` report as a table.
pub fn print_fixed(r: &FixedReport) -> crate::output::Out {
    out!(
        "nvme file namespace, cache1=none, --pin-mode kernel: fixed_buffers=always (on) against off, one queue pair,"
    )?;
    out!(
        "{} MiB file at {}; {} rounds of {:.1} s per side, alternating; medians (ratios: median of each round's).",
        r.file_bytes >> 20,
        r.file,
        r.rounds,
        r.round_seconds
    )?;
    out!("")?;
    out!(
        "workload        qd    IOPS on   IOPS off  on/off   CPU/IO on  CPU/IO off  on/off   p50 on  p50 off"
    )?;
    for row in &r.rows {
        out!(
            "{:<14} {:>3} {:>10.0} {:>10.0} {:>6.3} {:>9.2}us {:>9.2}us {:>7.3} {:>6.1}us {:>6.1}us",
            row.workload,
            row.qd,
            row.on.iops,
            row.off.iops,
            row.iops_on_vs_off,
            row.on.server_cpu_us_per_io,
            row.off.server_cpu_us_per_io,
            row.cpu_on_vs_off,
            row.on.latency_p50_us,
            row.off.latency_p50_us
        )?;
    }
    out!("")?;
    out!(
        "transfers through fixed buffers: {} with fixed_buffers=always, {} with off",
        r.fixed_transfers_on,
        r.fixed_transfers_off
    )?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn opts(list: &[&str]) -> Vec<String> {
        list.iter().map(|o| o.to_string()).collect()
    }

    #[test]
    fn a_users_option_overrides_the_benchmarks_own_within_what_the_workloads_need() {
        let base = server_options(&[], None).unwrap();
        assert_eq!(base["queues"], "2");
        assert_eq!(base["ns1"], "ram:256M");
        let over = server_options(&opts(&["queues=4", "poll_us=0", "ns1=ram:1G"]), None).unwrap();
        assert_eq!((over["queues"].as_str(), over["poll_us"].as_str()), ("4", "0"));
        assert_eq!((over["ns1"].as_str(), over["entries"].as_str()), ("ram:1G", "256"));
        let file = tempfile::NamedTempFile::new().unwrap();
        file.as_file().set_len(NS_BYTES).unwrap();
        let on_file = server_options(&opts(&["cache1=writeback"]), Some(file.path())).unwrap();
        assert_eq!(on_file["cache1"], "writeback");
        assert_eq!(server_options(&[], Some(file.path())).unwrap()["cache1"], "none");
        for (bad, why) in [
            (&["queues=1"][..], "need queues=2 at least"),
            (&["entries=64"], "need entries=256 at least"),
            (&["queues=4", "queues=5"], "option queues given twice"),
        ] {
            let e = server_options(&opts(bad), None).unwrap_err();
            assert!(e.contains(why), "{bad:?}: {e}");
        }
        let e = server_options(&opts(&["ns1=ram:1G"]), Some(file.path())).unwrap_err();
        assert!(e.contains("--opt ns1 and --file both name namespace 1"), "{e}");
    }

    /// An ns1 smaller than the namespace the workloads fill and address is refused before
    /// anything runs, RAM or file; a larger one is used, and the report says how much of it.
    #[test]
    fn a_namespace_smaller_than_the_workloads_need_is_refused() {
        let small = tempfile::NamedTempFile::new().unwrap();
        small.as_file().set_len(NS_BYTES - 4096).unwrap();
        let small_file = format!("ns1=file:{}", small.path().display());
        for bad in ["ns1=ram:64M", "ns1=ram:255M", small_file.as_str()] {
            let e = server_options(&opts(&[bad]), None).unwrap_err();
            assert!(
                e.contains(&format!("--opt {bad}")) && e.contains("need a namespace of 256 MiB at least"),
                "{e}"
            );
        }
        let e = server_options(&opts(&["ns1=file:/nonexistent/img"]), None).unwrap_err();
        assert!(e.contains("/nonexistent/img: No such file"), "{e}");
        // Not a size: the server refuses it, in its words.
        assert!(server_options(&opts(&["ns1=ram:lots"]), None).is_ok());
        let exact = server_options(&opts(&["ns1=ram:256M"]), None).unwrap();
        assert_eq!(describe_namespace(&exact).unwrap(), "ram:256M");
        let big = server_options(&opts(&["ns1=ram:1G"]), None).unwrap();
        assert_eq!(describe_namespace(&big).unwrap(), "ram:1G (the workloads use its first 256 MiB)");
        let file = tempfile::NamedTempFile::new().unwrap();
        file.as_file().set_len(NS_BYTES * 2).unwrap();
        let on_file = server_options(&[], Some(file.path())).unwrap();
        let want =
            format!("file:{} cache1=none (the workloads use its first 256 MiB)", file.path().display());
        assert_eq!(describe_namespace(&on_file).unwrap(), want);
    }
}
