//! `umdev ccwbench`: end-to-end ccw throughput and latency, measured in one run against
//! their floors: memcpy bandwidth for 2 MiB programs with 512 scattered 4 KiB IDAWs (a SEEK
//! and one data CCW each, kept in flight on four subchannels), and a 4-byte REGION_READ
//! round trip for the doorbell-to-interrupt latency of 4 KiB programs.

use crate::output::out;
use std::hint::black_box;
use std::time::{Duration, Instant};

use std::os::fd::{AsFd, AsRawFd};
use std::path::Path;

use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
use serde::Serialize;
use umdev_devices::ccw::program::{cmd, Status, STATUS_SIZE};
use umdev_devices::ccw::regs;
use umdev_mdev::types::InstanceOptions;
use umdev_pinning::PinMode;
use umdev_server::wire::{flags, Command};
use umdev_server::{Daemon, InstanceConfig};
use umdev_testkit::ccw_driver::{layout, Data, Op};
use umdev_testkit::ccw_guest::{
    idal_area, program_area, status_area, wait_eventfd, DATA_BASE, RAM_SIZE, SCRATCH,
};
use umdev_testkit::client::{dma_map_payload, message, region_write_payload, set_irqs_payload, RawClient};
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

use crate::affinity::{pin_to, unpin};
use crate::pinbench::{median, Pattern, Rng};

/// One mode's results.
#[derive(Debug, Serialize)]
pub struct ModeReport {
    pub mode: String,
    /// 2 MiB programs, 512 scattered IDAWs, store to guest (READ).
    pub big_read_programs_per_sec: f64,
    pub big_read_gb_per_sec: f64,
    /// The same, guest to store (WRITE).
    pub big_write_programs_per_sec: f64,
    pub big_write_gb_per_sec: f64,
    /// Median over rounds of (device GB/s / 2 MiB memcpy GB/s) measured in the same round.
    pub big_read_vs_memcpy: f64,
    pub big_write_vs_memcpy: f64,
    /// Median over rounds of (device GB/s / plain memcpy of the same scattered blocks).
    pub big_read_vs_same_copy: f64,
    pub big_write_vs_same_copy: f64,
    /// 4 KiB programs on one subchannel, per CPU placement.
    pub small: Vec<LatencyRow>,
}

/// 4 KiB program latency in one CPU placement.
#[derive(Debug, Serialize)]
pub struct LatencyRow {
    pub placement: String,
    pub programs_per_sec: f64,
    pub doorbell_to_irq_p50_us: f64,
    pub doorbell_to_irq_p99_us: f64,
    /// A 4-byte REGION_READ round trip on the same connection, alternating with the programs.
    pub region_read_p50_us: f64,
    /// doorbell_to_irq_p50_us / region_read_p50_us.
    pub ratio: f64,
}

/// The whole run.
#[derive(Debug, Serialize)]
pub struct Report {
    /// Median 2 MiB memcpy bandwidth over the rounds (the floor).
    pub memcpy_gb_per_sec: f64,
    /// Median bandwidth of plain memcpy doing the programs' own data movement: the same
    /// scattered 4 KiB blocks and store regions, one thread, no protocol or pinning.
    pub same_copy_gb_per_sec: f64,
    pub modes: Vec<ModeReport>,
}

fn p99(v: &mut [f64]) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[(v.len() - 1) * 99 / 100]
}

/// memcpy bandwidth of 2 MiB copies between two warm buffers, in GB/s.
fn memcpy_floor(src: &[u8], dst: &mut [u8]) -> f64 {
    let t = Instant::now();
    for _ in 0..16 {
        dst.copy_from_slice(black_box(src));
        black_box(&mut *dst);
    }
    16.0 * src.len() as f64 / t.elapsed().as_secs_f64() / 1e9
}

/// The programs' data movement done by plain memcpy in one thread: for each of the big
/// subchannels in turn, 512 scattered 4 KiB blocks to or from its 2 MiB of store.
struct SameCopy {
    store: Vec<u8>,
    guest: Vec<u8>,
    blocks: Vec<Vec<usize>>,
}

impl SameCopy {
    fn new(big: u32) -> SameCopy {
        let blocks = (0..big)
            .map(|sc| scattered_blocks(sc).into_iter().map(|a| (a - DATA_BASE) as usize).collect())
            .collect();
        SameCopy {
            store: vec![1u8; big as usize * (2 << 20)],
            guest: vec![2u8; big as usize * (8 << 20)],
            blocks,
        }
    }

    /// GB/s for `programs` programs in direction `dir`.
    fn run(&mut self, dir: u8, programs: usize) -> f64 {
        let t = Instant::now();
        for p in 0..programs {
            let sc = p % self.blocks.len();
            let store = &mut self.store[sc * (2 << 20)..(sc + 1) * (2 << 20)];
            for (k, &b) in self.blocks[sc].iter().enumerate() {
                let s = &mut store[k * 4096..(k + 1) * 4096];
                if dir == cmd::READ {
                    self.guest[b..b + 4096].copy_from_slice(black_box(s));
                } else {
                    s.copy_from_slice(black_box(&self.guest[b..b + 4096]));
                }
            }
            black_box(&mut self.guest);
        }
        programs as f64 * (2 << 20) as f64 / t.elapsed().as_secs_f64() / 1e9
    }
}

/// The 512 scattered 4 KiB blocks (no two adjacent, random order) of big subchannel `sc`.
fn scattered_blocks(sc: u32) -> Vec<u64> {
    let base = DATA_BASE + u64::from(sc) * (8 << 20);
    Pattern::Scattered
        .offsets(512, &mut Rng::new(512 + u64::from(sc)))
        .into_iter()
        .map(|o| base + o * 4096)
        .collect()
}

/// A lean guest for the hot loops: rust-vmm's client waits for a reply to every register
/// write, but a real VMM posts BAR writes (QEMU sends memory-BAR writes with NO_REPLY), so
/// the benchmark drives the device through the raw client with posted doorbells and ACKs.
struct Lean {
    c: RawClient,
    ram: std::fs::File,
    irqs: Vec<EventFd>,
}

fn sc_reg(sc: u32, r: u64) -> u64 {
    regs::SUBCHANNEL_BASE + u64::from(sc) * regs::SUBCHANNEL_STRIDE + r
}

impl Lean {
    fn connect(socket: &Path, subchannels: u32) -> Result<Lean, String> {
        let e = |e: std::io::Error| e.to_string();
        let mut c = RawClient::connect(socket).map_err(e)?;
        c.negotiate().map_err(e)?;
        let fd = nix::sys::memfd::memfd_create(c"umdev-bench-ram", nix::sys::memfd::MFdFlags::empty())
            .map_err(|e| e.to_string())?;
        let ram = std::fs::File::from(fd);
        ram.set_len(RAM_SIZE).map_err(e)?;
        let r = c
            .request(Command::DmaMap as u16, &dma_map_payload(3, 0, 0, RAM_SIZE), &[ram.as_raw_fd()])
            .map_err(e)?;
        if r.errno() != 0 {
            return Err(format!("DMA_MAP failed: errno {}", r.errno()));
        }
        // Memory decode and bus mastering, as a driver enables them before any DMA.
        c.enable_bus_master().map_err(e)?;
        let mut lean = Lean { c, ram, irqs: Vec::new() };
        // MSI-X on, one eventfd per subchannel.
        let mut ptr = u64::from(lean.config32(0x34)? as u8);
        while ptr != 0 && lean.config32(ptr)? as u8 != 0x11 {
            ptr = u64::from((lean.config32(ptr)? >> 8) as u8);
        }
        if ptr == 0 {
            return Err("no MSI-X capability".into());
        }
        let control = (lean.config32(ptr)? >> 16) as u16 | 0x8000;
        lean.c.region_write(7, ptr + 2, &control.to_le_bytes()).map_err(e)?;
        lean.irqs =
            (0..subchannels).map(|_| EventFd::new(EFD_NONBLOCK)).collect::<Result<_, _>>().map_err(e)?;
        let fds: Vec<i32> = lean.irqs.iter().map(|f| f.as_raw_fd()).collect();
        let r = lean
            .c
            .request(Command::DeviceSetIrqs as u16, &set_irqs_payload(0x24, 2, 0, subchannels, &[]), &fds)
            .map_err(e)?;
        if r.errno() != 0 {
            return Err(format!("SET_IRQS failed: errno {}", r.errno()));
        }
        Ok(lean)
    }

    fn config32(&mut self, off: u64) -> Result<u32, String> {
        let r = self.c.region_read(7, off, 4).map_err(|e| e.to_string())?;
        r.payload
            .get(16..20)
            .and_then(|b| b.try_into().ok())
            .map(u32::from_le_bytes)
            .ok_or("short read".into())
    }

    fn read(&mut self, off: u64) -> Result<u32, String> {
        let r = self.c.region_read(0, off, 4).map_err(|e| e.to_string())?;
        r.payload
            .get(16..20)
            .and_then(|b| b.try_into().ok())
            .map(u32::from_le_bytes)
            .ok_or("short read".into())
    }

    /// A register write that waits for its reply.
    fn write(&mut self, off: u64, v: u32) -> Result<(), String> {
        let r = self.c.region_write(0, off, &v.to_le_bytes()).map_err(|e| e.to_string())?;
        if r.errno() != 0 {
            return Err(format!("register write failed: errno {}", r.errno()));
        }
        Ok(())
    }

    /// A posted register write (NO_REPLY), as QEMU sends BAR writes.
    fn post(&mut self, off: u64, v: u32) -> Result<(), String> {
        let payload = region_write_payload(0, off, &v.to_le_bytes());
        self.c
            .send(Command::RegionWrite as u16, flags::NO_REPLY, &payload, &[])
            .map(drop)
            .map_err(|e| e.to_string())
    }

    fn put(&self, addr: u64, bytes: &[u8]) -> Result<(), String> {
        std::os::unix::fs::FileExt::write_all_at(&self.ram, bytes, addr).map_err(|e| e.to_string())
    }

    /// Posted writes in one socket write (a VMM batches posted writes the same way).
    fn post_all(&mut self, writes: &[(u64, u32)]) -> Result<(), String> {
        let mut bytes = Vec::new();
        for &(off, v) in writes {
            let payload = region_write_payload(0, off, &v.to_le_bytes());
            bytes.extend(message(0, Command::RegionWrite as u16, flags::NO_REPLY, &payload));
        }
        self.c.send_bytes(&bytes, &[]).map_err(|e| e.to_string())
    }

    /// Lays out a program for `sc` and points its registers at it.
    fn prepare(&mut self, sc: u32, ops: &[Op]) -> Result<(), String> {
        for (addr, bytes) in layout(program_area(sc), idal_area(sc), ops) {
            self.put(addr, &bytes)?;
        }
        self.write(sc_reg(sc, regs::CPA_LO), program_area(sc) as u32)?;
        self.write(sc_reg(sc, regs::CPA_HI), 0)?;
        self.write(sc_reg(sc, regs::STATUS_LO), status_area(sc) as u32)?;
        self.write(sc_reg(sc, regs::STATUS_HI), 0)
    }

    /// The status of `sc`'s last program, from its status block.
    fn status(&self, sc: u32) -> Result<Status, String> {
        let mut b = [0u8; STATUS_SIZE];
        std::os::unix::fs::FileExt::read_exact_at(&self.ram, &mut b, status_area(sc))
            .map_err(|e| e.to_string())?;
        Status::decode(&b).ok_or("malformed status block".into())
    }

    /// Waits for `sc`'s interrupt and consumes it.
    fn wait(&self, sc: u32) -> Result<(), String> {
        if !wait_eventfd(&self.irqs[sc as usize], Duration::from_secs(5)) {
            return Err(format!("no interrupt from subchannel {sc}"));
        }
        let _ = self.irqs[sc as usize].read();
        Ok(())
    }
}

/// A daemon serving one ccw instance in `mode`; its threads (acceptor, connection, device
/// workers) run on `cpu` if given.
fn start_instance(
    dir: &Path,
    name: &str,
    mode: PinMode,
    cpu: Option<usize>,
) -> Result<(Daemon, std::path::PathBuf), String> {
    if let Some(cpu) = cpu {
        pin_to(cpu)?;
    }
    let socket = dir.join(format!("{name}.sock"));
    let started = (|| {
        let mut options = InstanceOptions::default();
        options.params.insert("subchannels".into(), SUBCHANNELS.to_string());
        options.params.insert("store".into(), "ram:64M".into());
        let device = umdev::builtin_registry()
            .find("ccw")
            .and_then(|t| t.create(&options))
            .map_err(|e| e.to_string())?;
        let daemon = Daemon::new();
        let mut config = InstanceConfig::new(name, &socket);
        config.dma.mode = mode;
        config.dma.account = std::sync::Arc::new(umdev_pinning::LockAccount::unlimited());
        daemon.start(device, config).map_err(|e| e.to_string())?;
        Ok(daemon)
    })();
    unpin()?;
    started.map(|d| (d, socket))
}

fn bench_mode(
    mode: PinMode,
    rounds: usize,
    progress: &mut crate::progress::Progress,
) -> Result<(ModeReport, f64, f64), String> {
    let dir = crate::cleanup::scratch_dir(&format!("ccwbench-{mode}"))?;
    let dir = dir.path();
    let result = (|| {
        progress.step(format_args!("{mode}: 2 MiB scattered programs"));
        let (daemon, socket) = start_instance(dir, "big", mode, None)?;
        let big = run_big(&socket, rounds);
        daemon.shutdown();
        let big = big?;
        let mut placements = vec![("one CPU", 0, 0)];
        if crate::affinity::cpus() >= 2 {
            placements.push(("two CPUs", 0, 1));
        }
        let mut small = Vec::new();
        for (name, client_cpu, server_cpu) in placements {
            progress.step(format_args!("{mode}: 4 KiB program latency, {name}"));
            let (daemon, socket) = start_instance(dir, "small", mode, Some(server_cpu))?;
            pin_to(client_cpu)?;
            let row = run_small(&socket, rounds, name);
            unpin()?;
            daemon.shutdown();
            small.push(row?);
        }
        Ok((
            ModeReport {
                mode: mode.to_string(),
                big_read_programs_per_sec: big.read_pps,
                big_read_gb_per_sec: big.read_pps * (2 << 20) as f64 / 1e9,
                big_write_programs_per_sec: big.write_pps,
                big_write_gb_per_sec: big.write_pps * (2 << 20) as f64 / 1e9,
                big_read_vs_memcpy: big.read_vs_memcpy,
                big_write_vs_memcpy: big.write_vs_memcpy,
                big_read_vs_same_copy: big.read_vs_same,
                big_write_vs_same_copy: big.write_vs_same,
                small,
            },
            big.memcpy,
            big.same,
        ))
    })();
    result
}

/// Subchannels the big programs are spread over; one more runs the 4 KiB programs.
const SUBCHANNELS: u32 = 5;
const SMALL_SC: u32 = SUBCHANNELS - 1;

/// `n` 2 MiB programs in direction `dir`, kept in flight on the big subchannels; programs/s.
fn big_programs(g: &mut Lean, dir: u8, n: usize) -> Result<f64, String> {
    let big = SUBCHANNELS - 1;
    for sc in 0..big {
        let blocks = scattered_blocks(sc);
        // Each subchannel works on its own 2 MiB of the store, as I/O to different blocks does.
        let arg = SCRATCH + 8 * u64::from(sc);
        g.put(arg, &(u64::from(sc) << 21).to_le_bytes())?;
        let seek = Op::new(cmd::SEEK, 8, Data::Direct(arg));
        g.prepare(sc, &[seek, Op::new(dir, 2 << 20, Data::Idaws(blocks))])?;
    }
    let t = Instant::now();
    let (mut started, mut done) = (0usize, 0usize);
    for sc in 0..big {
        g.post(sc_reg(sc, regs::DOORBELL), regs::DOORBELL_START)?;
        started += 1;
    }
    while done < n {
        for sc in 0..big {
            if !wait_eventfd(&g.irqs[sc as usize], Duration::ZERO) {
                continue;
            }
            g.wait(sc)?;
            let s = g.status(sc)?;
            if !s.ok() {
                return Err(format!("a 2 MiB program ended {s:?}"));
            }
            done += 1;
            if started < n {
                g.post_all(&[
                    (sc_reg(sc, regs::ACK), 1),
                    (sc_reg(sc, regs::DOORBELL), regs::DOORBELL_START),
                ])?;
                started += 1;
            } else {
                g.post(sc_reg(sc, regs::ACK), 1)?;
            }
        }
        if done < n {
            // Sleep until some subchannel interrupts.
            let any: Vec<_> = g.irqs[..big as usize].iter().collect();
            if !wait_any(&any, Duration::from_secs(5)) {
                return Err(format!("no interrupt in 5 s with {} of {n} programs done", done));
            }
        }
    }
    Ok(n as f64 / t.elapsed().as_secs_f64())
}

/// Waits until one of `efds` is signalled; false after `timeout`.
fn wait_any(efds: &[&EventFd], timeout: Duration) -> bool {
    let borrowed: Vec<_> = efds
        .iter()
        // SAFETY: the eventfds outlive the borrows.
        .map(|e| unsafe { std::os::fd::BorrowedFd::borrow_raw(e.as_raw_fd()) })
        .collect();
    let mut fds: Vec<PollFd> = borrowed.iter().map(|b| PollFd::new(b.as_fd(), PollFlags::POLLIN)).collect();
    poll(&mut fds, PollTimeout::try_from(timeout).unwrap_or(PollTimeout::MAX)).unwrap_or(0) > 0
}

/// Big-program throughput: per round, the device's rate alternating with both floors.
struct BigResult {
    read_pps: f64,
    write_pps: f64,
    read_vs_memcpy: f64,
    write_vs_memcpy: f64,
    read_vs_same: f64,
    write_vs_same: f64,
    memcpy: f64,
    same: f64,
}

/// 2 MiB programs in flight on four subchannels, READ then WRITE, each round paired with a
/// 2 MiB memcpy and with plain memcpy of the same blocks.
fn run_big(socket: &Path, rounds: usize) -> Result<BigResult, String> {
    let mut g = Lean::connect(socket, SUBCHANNELS)?;
    // Fault guest memory in once, as a running guest's would be.
    g.put(DATA_BASE, &vec![1u8; 32 << 20])?;
    // 32 programs (64 MiB) a round: enough to amortise the cache refill after the floors.
    let per_round = 32;
    let (src, mut dst) = (vec![7u8; 2 << 20], vec![0u8; 2 << 20]);
    let mut same = SameCopy::new(SUBCHANNELS - 1);
    let mut rounds_of = |dir| -> Result<(f64, f64, f64, f64, f64), String> {
        big_programs(&mut g, dir, per_round)?; // warm-up
        same.run(dir, per_round);
        let (mut pps, mut vs_memcpy, mut vs_same, mut memcpy, mut same_gbs) =
            (Vec::new(), Vec::new(), Vec::new(), Vec::new(), Vec::new());
        for _ in 0..rounds {
            let floor = memcpy_floor(&src, &mut dst);
            let copy = same.run(dir, per_round);
            let rate = big_programs(&mut g, dir, per_round)?;
            let gbs = rate * (2 << 20) as f64 / 1e9;
            pps.push(rate);
            vs_memcpy.push(gbs / floor);
            vs_same.push(gbs / copy);
            memcpy.push(floor);
            same_gbs.push(copy);
        }
        Ok((
            median(&mut pps),
            median(&mut vs_memcpy),
            median(&mut vs_same),
            median(&mut memcpy),
            median(&mut same_gbs),
        ))
    };
    let (read_pps, read_vs_memcpy, read_vs_same, memcpy_r, same_r) = rounds_of(cmd::READ)?;
    let (write_pps, write_vs_memcpy, write_vs_same, memcpy_w, same_w) = rounds_of(cmd::WRITE)?;
    Ok(BigResult {
        read_pps,
        write_pps,
        read_vs_memcpy,
        write_vs_memcpy,
        read_vs_same,
        write_vs_same,
        memcpy: (memcpy_r + memcpy_w) / 2.0,
        same: (same_r + same_w) / 2.0,
    })
}

/// 4 KiB programs on one subchannel: posted doorbell to interrupt (the ACK posted after),
/// alternating with 4-byte REGION_READs on the same connection.
fn run_small(socket: &Path, rounds: usize, placement: &str) -> Result<LatencyRow, String> {
    let mut g = Lean::connect(socket, SUBCHANNELS)?;
    g.put(DATA_BASE, &vec![1u8; 1 << 20])?;
    g.prepare(SMALL_SC, &[Op::new(cmd::READ, 4096, Data::Direct(DATA_BASE))])?;
    let (mut lat, mut rr) = (Vec::new(), Vec::new());
    let n = rounds * 100;
    let t_all = Instant::now();
    for _ in 0..n {
        let t = Instant::now();
        g.post(sc_reg(SMALL_SC, regs::DOORBELL), regs::DOORBELL_START)?;
        g.wait(SMALL_SC)?;
        lat.push(t.elapsed().as_nanos() as f64 / 1000.0);
        g.post(sc_reg(SMALL_SC, regs::ACK), 1)?;
        let t = Instant::now();
        g.read(regs::ID)?;
        rr.push(t.elapsed().as_nanos() as f64 / 1000.0);
    }
    let programs_per_sec = n as f64 / t_all.elapsed().as_secs_f64();
    if !g.status(SMALL_SC)?.ok() {
        return Err("a 4 KiB program failed".into());
    }
    let (p50, p99v) = (median(&mut lat.clone()), p99(&mut lat));
    let rr50 = median(&mut rr);
    Ok(LatencyRow {
        placement: placement.to_string(),
        programs_per_sec,
        doorbell_to_irq_p50_us: p50,
        doorbell_to_irq_p99_us: p99v,
        region_read_p50_us: rr50,
        ratio: p50 / rr50,
    })
}

pub fn run(quick: bool, only: Option<PinMode>) -> Result<Report, String> {
    let rounds = if quick { 5 } else { 41 };
    let modes: Vec<PinMode> =
        [PinMode::Track, PinMode::Lock].into_iter().filter(|m| only.is_none_or(|o| o == *m)).collect();
    let steps = if crate::affinity::cpus() >= 2 { 3 } else { 2 };
    let mut progress = crate::progress::Progress::new("ccwbench", modes.len() * steps);
    let results =
        modes.into_iter().map(|m| bench_mode(m, rounds, &mut progress)).collect::<Result<Vec<_>, _>>()?;
    let first = results.first().ok_or("no mode measured")?;
    let (memcpy, same) = (first.1, first.2);
    Ok(Report {
        memcpy_gb_per_sec: memcpy,
        same_copy_gb_per_sec: same,
        modes: results.into_iter().map(|r| r.0).collect(),
    })
}

pub fn print(r: &Report) -> crate::output::Out {
    out!(
        "2 MiB programs: a SEEK and one CCW with 512 scattered 4 KiB IDAWs, in flight on {} subchannels.",
        SUBCHANNELS - 1
    )?;
    out!("Floors, measured in every round beside the device (medians):")?;
    out!("  memcpy of 2 MiB (warm buffers):                        {:.2} GB/s", r.memcpy_gb_per_sec)?;
    out!("  memcpy of the programs' own blocks (one thread, no I/O): {:.2} GB/s\n", r.same_copy_gb_per_sec)?;
    out!(
        "{:<6} {:<6} {:>10} {:>10} {:>14} {:>16}",
        "mode",
        "dir",
        "prog/s",
        "GB/s",
        "vs 2MiB memcpy",
        "vs same blocks"
    )?;
    for m in &r.modes {
        for (dir, pps, gbs, vm, vs) in [
            (
                "READ",
                m.big_read_programs_per_sec,
                m.big_read_gb_per_sec,
                m.big_read_vs_memcpy,
                m.big_read_vs_same_copy,
            ),
            (
                "WRITE",
                m.big_write_programs_per_sec,
                m.big_write_gb_per_sec,
                m.big_write_vs_memcpy,
                m.big_write_vs_same_copy,
            ),
        ] {
            out!(
                "{:<6} {:<6} {:>10.0} {:>10.2} {:>13.0}% {:>15.0}%",
                m.mode,
                dir,
                pps,
                gbs,
                100.0 * vm,
                100.0 * vs
            )?;
        }
    }
    out!("\n4 KiB programs on one subchannel (us):")?;
    out!(
        "{:<6} {:<10} {:>10} {:>16} {:>16} {:>16} {:>7}",
        "mode",
        "placement",
        "prog/s",
        "doorbell->irq p50",
        "doorbell->irq p99",
        "REGION_READ p50",
        "ratio"
    )?;
    for m in &r.modes {
        for l in &m.small {
            out!(
                "{:<6} {:<10} {:>10.0} {:>16.1} {:>16.1} {:>16.1} {:>7.2}",
                m.mode,
                l.placement,
                l.programs_per_sec,
                l.doorbell_to_irq_p50_us,
                l.doorbell_to_irq_p99_us,
                l.region_read_p50_us,
                l.ratio
            )?;
        }
    }
    Ok(())
}
