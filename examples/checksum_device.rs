//! A device that does DMA: a checksum engine. The guest writes a buffer's address and length
//! and rings the doorbell; the engine's worker thread pins the buffer, computes its CRC-32
//! and raises MSI-X vector 0. It uses the framework as a DMA device should: a worker started
//! at the first doorbell, a request lane, a permit per job, the buffer pinned through the
//! permit, the job ended with its status when the guest unmaps the buffer, and a reset that
//! stops and joins the worker without waiting on the device's lock.
//!
//! ```sh
//! cargo run --example checksum_device -- /tmp/checksum.sock
//! qemu-system-x86_64 ... -device '{"driver":"vfio-user-pci","socket":{"type":"unix","path":"/tmp/checksum.sock"}}'
//! ```
//!
//! The guest sees a PCI device `1234:c5c5` with one 4 KiB memory BAR: 32-bit registers
//! (aligned 32-bit accesses only; other offsets read 0 and ignore writes), the MSI-X table
//! (one vector) at 0x800 and its PBA at 0xc00.
//!
//! | offset | name     | access | meaning                                                   |
//! |--------|----------|--------|-----------------------------------------------------------|
//! | 0x00   | ID       | RO     | `0x4d555343`: the bytes "CSUM"                            |
//! | 0x04   | ADDR_LO  | RW     | the buffer's guest address, low half                      |
//! | 0x08   | ADDR_HI  | RW     | the buffer's guest address, high half                     |
//! | 0x0c   | LEN      | RW     | the buffer's length in bytes, 1 to 16 MiB                 |
//! | 0x10   | CONTROL  | RW     | bit 0, PAUSE: the engine stops before its next block      |
//! | 0x14   | DOORBELL | WO     | any write: checksum ADDR/LEN (ignored while a job runs)   |
//! | 0x18   | STATUS   | RO     | see below                                                 |
//! | 0x1c   | RESULT   | RO     | the CRC-32 (zlib's) of the last job that ended DONE       |
//!
//! STATUS: 0 IDLE (power-on), 1 BUSY, 2 PAUSED (stopped by PAUSE, holding the buffer; it goes
//! on when PAUSE is cleared), 3 DONE, and the failures 0x10 BAD_LEN (LEN out of range), 0x11
//! DMA_ERROR (the buffer is not mapped, not mapped with an fd, or bus mastering is off), 0x12
//! UNMAPPED (the guest unmapped the buffer while the job ran) and 0x13 INTERNAL. Every status
//! but BUSY and PAUSED ends a job and raises MSI-X vector 0. A reset ends a job without
//! either: the guest that reset the device expects nothing of what it asked before.

use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use signal_hook::consts::{SIGINT, SIGTERM};
use signal_hook::iterator::Signals;
use umdev_mdev::irq::IrqHandle;
use umdev_mdev::pci::{
    Bar, ClassCode, ConfigSpaceBuilder, MsixCap, PciDevice, PciIds, Reg, RegMap, SimpleFunction,
};
use umdev_mdev::request::{self, Cancel, Completion, Lane, Permit, PinnedBytes};
use umdev_mdev::worker::{Bell, Poll, Waiter, Wake, Worker};
use umdev_mdev::{sync, DeviceContext, DeviceError, Prot};
use umdev_server::{Daemon, InstanceConfig};

/// BAR0's registers (see the table above), and what they hold.
pub mod regs {
    pub const ID: u64 = 0x00;
    pub const ADDR_LO: u64 = 0x04;
    pub const ADDR_HI: u64 = 0x08;
    pub const LEN: u64 = 0x0c;
    pub const CONTROL: u64 = 0x10;
    pub const DOORBELL: u64 = 0x14;
    pub const STATUS: u64 = 0x18;
    pub const RESULT: u64 = 0x1c;

    /// ID: the bytes "CSUM".
    pub const ID_VALUE: u32 = 0x4d55_5343;
    /// LEN's largest value.
    pub const MAX_LEN: u32 = 16 << 20;
    /// CONTROL's one bit.
    pub const PAUSE: u32 = 1;
    /// Where BAR0 holds the MSI-X table and its PBA.
    pub const MSIX_TABLE: u32 = 0x800;
    pub const MSIX_PBA: u32 = 0xc00;
}

/// STATUS values (see above).
pub mod status {
    pub const IDLE: u32 = 0;
    pub const BUSY: u32 = 1;
    pub const PAUSED: u32 = 2;
    pub const DONE: u32 = 3;
    pub const BAD_LEN: u32 = 0x10;
    pub const DMA_ERROR: u32 = 0x11;
    pub const UNMAPPED: u32 = 0x12;
    pub const INTERNAL: u32 = 0x13;
}

use regs::*;

#[derive(Clone, Copy)]
enum R {
    Id,
    AddrLo,
    AddrHi,
    Len,
    Control,
    Doorbell,
    Status,
    Result,
}

/// The buffer is read in blocks this large: between two, the worker looks whether the job was
/// cancelled, paused or told to stop.
const BLOCK: usize = 64 << 10;
/// How long a reset (or the device's drop) waits for the worker to end: at most a block.
const JOIN_BOUND: Duration = Duration::from_secs(5);

/// What the worker and the registers share, apart from the device's lock. The device's reset
/// runs under that lock and joins the worker, so the worker never takes it; and this one is
/// held for a few loads and stores only, never across a wait, a block or a join.
#[derive(Default)]
struct Engine {
    /// Bumped by every reset: a job begun before reports nothing.
    generation: u64,
    /// The job the doorbell queued, for the worker to take.
    queued: Option<Job>,
    status: u32,
    result: u32,
    paused: bool,
}

#[derive(Clone, Copy)]
struct Job {
    addr: u64,
    len: u32,
    generation: u64,
}

fn lock(engine: &Mutex<Engine>) -> MutexGuard<'_, Engine> {
    // Plain values, consistent after a panic of any holder.
    sync::lock(engine)
}

/// How a job ends: its status (and result) in the registers, then MSI-X vector 0; nothing if
/// the device was reset since the job began.
struct Report {
    engine: Arc<Mutex<Engine>>,
    irq: IrqHandle,
    generation: u64,
}

impl Completion for Report {
    /// The CRC-32, or the failure's status.
    type Outcome = Result<u32, u32>;
    type Shared = ();

    fn complete(self, outcome: Result<u32, u32>, _ctx: &DeviceContext, (): &()) {
        let mut engine = lock(&self.engine);
        if engine.generation != self.generation {
            return; // a reset came first: the registers are no longer this job's
        }
        match outcome {
            Ok(crc) => (engine.status, engine.result) = (status::DONE, crc),
            Err(failed) => engine.status = failed,
        }
        // Still under the lock: a reset cannot come between the check and the interrupt.
        self.irq.raise(0);
    }

    /// The job's permit was dropped unfinished (its handling panicked).
    fn fail(self, ctx: &DeviceContext, (): &()) {
        self.complete(Err(status::INTERNAL), ctx, &());
    }
}

/// Why the worker stops: a reset, or the device going.
#[derive(Clone, Copy, Debug)]
struct Stop;

/// The checksum engine. Served as `Mutex<Checksum>`: the framework serializes the calls, and
/// the worker shares only the [`Engine`].
pub struct Checksum {
    map: RegMap<R>,
    addr: u64,
    len: u32,
    engine: Arc<Mutex<Engine>>,
    irq: IrqHandle,
    /// The worker's requests, cancelled by the framework on an unmap of their buffer, a reset
    /// or a detach; each cancellation rings `bell`.
    lane: Lane,
    /// The worker's doorbell, kept across workers: the lane rings whichever runs.
    bell: Bell,
    /// Started at the first doorbell after power-on or a reset, stopped by the reset.
    worker: Option<Worker<Stop>>,
}

impl Checksum {
    /// DOORBELL: queues a job for the worker (starting it if none runs).
    fn start(&mut self) {
        let mut engine = lock(&self.engine);
        if matches!(engine.status, status::BUSY | status::PAUSED) {
            return; // one job at a time
        }
        if self.len == 0 || self.len > MAX_LEN {
            engine.status = status::BAD_LEN;
            self.irq.raise(0);
            return;
        }
        let generation = engine.generation;
        engine.queued = Some(Job { addr: self.addr, len: self.len, generation });
        engine.status = status::BUSY;
        drop(engine);
        if self.worker.is_none() {
            let (engine, lane, irq) = (self.engine.clone(), self.lane.clone(), self.irq.clone());
            let body = move |waiter: Waiter<Stop>| work(waiter, engine, &lane, &irq);
            match Worker::spawn_on(&self.bell, "checksum-engine", Poll::NONE, body) {
                Ok(worker) => self.worker = Some(worker),
                Err(e) => {
                    log::error!("checksum: cannot start the worker: {e}");
                    let mut engine = lock(&self.engine);
                    (engine.queued, engine.status) = (None, status::INTERNAL);
                    self.irq.raise(0);
                    return;
                }
            }
        }
        self.bell.ring();
    }

    /// CONTROL: PAUSE takes effect at the worker's next look; a resume wakes it.
    fn set_control(&mut self, value: u32) {
        let pause = value & PAUSE != 0;
        lock(&self.engine).paused = pause;
        if !pause {
            self.bell.ring();
        }
    }

    fn stop_worker(&mut self) {
        if let Some(worker) = self.worker.take() {
            worker.stop(Stop);
            // It never waits for the device's lock, which the caller holds: it ends within a
            // block. One that does not in time is left to end on its own.
            if let Err(e) = worker.join(JOIN_BOUND) {
                log::error!("checksum: {e}");
            }
        }
    }
}

/// The worker: runs each queued job until told to stop.
fn work(mut waiter: Waiter<Stop>, engine: Arc<Mutex<Engine>>, lane: &Lane, irq: &IrqHandle) {
    let mut block = vec![0u8; BLOCK];
    loop {
        let queued = lock(&engine).queued.take();
        let Some(job) = queued else {
            match waiter.wait(|| false, None) {
                Wake::Stop(Stop) => return,
                Wake::Work | Wake::Timeout => continue,
            }
        };
        let report = Report { engine: engine.clone(), irq: irq.clone(), generation: job.generation };
        // No client (it left): its detach cancels everything and a reset follows, so
        // there is nothing to report.
        let Ok(mut permit) = lane.begin(report) else { continue };
        // A panic fails the job (INTERNAL) and the worker goes on.
        request::serve("a checksum job", || {
            match checksum(&mut permit, job, &engine, &mut waiter, &mut block) {
                Ok(crc) => permit.complete(Ok(crc)),
                Err(Ended::Failed(failed)) => permit.complete(Err(failed)),
                // Reported by no one ([`umdev_mdev::request`]: a request cancelled by a reset
                // reports nothing).
                Err(Ended::Reset) => {
                    permit.into_inner();
                }
            }
        });
    }
}

/// Why a job ended without a checksum.
enum Ended {
    /// With this status.
    Failed(u32),
    /// By a reset (or the device going): with no status at all.
    Reset,
}

/// The CRC-32 of the job's buffer, pinned through its permit and read block by block.
fn checksum(
    permit: &mut Permit<Report>,
    job: Job,
    engine: &Mutex<Engine>,
    waiter: &mut Waiter<Stop>,
    block: &mut [u8],
) -> Result<u32, Ended> {
    // One pin call for every page of the buffer, as this request's: an unmap of any of them
    // cancels the job.
    let buf = match permit.pin_bytes(job.addr, u64::from(job.len), Prot::READ) {
        Ok(buf) => buf,
        Err(e) => {
            log::debug!("checksum: {:#x}+{:#x}: {e}", job.addr, job.len);
            return Err(Ended::Failed(status::DMA_ERROR));
        }
    };
    let mut crc = !0;
    let mut at = 0;
    while at < buf.size() {
        look(&buf, job, engine, waiter)?;
        let n = (buf.size() - at).min(BLOCK as u64) as usize;
        // Fails only if the client truncated the memory behind the buffer.
        buf.read(at, &mut block[..n]).map_err(|_| Ended::Failed(status::DMA_ERROR))?;
        crc = crc32_update(crc, &block[..n]);
        at += n as u64;
    }
    Ok(!crc)
}

/// Before each block: whether the job must end, and whether the guest paused it (then the
/// worker sleeps here, holding its buffer, until it is resumed or cancelled).
fn look(
    buf: &PinnedBytes<'_, Report>,
    job: Job,
    engine: &Mutex<Engine>,
    waiter: &mut Waiter<Stop>,
) -> Result<(), Ended> {
    loop {
        match buf.cancelled() {
            Some(Cancel::Unmapped) => return Err(Ended::Failed(status::UNMAPPED)),
            Some(Cancel::Reset) => return Err(Ended::Reset),
            None => {}
        }
        if waiter.stopped().is_some() {
            return Err(Ended::Reset);
        }
        // Pinned pages are not gated by COMMAND.BME as copies are: the device looks itself.
        if !buf.permit().ctx().bus_master() {
            return Err(Ended::Failed(status::DMA_ERROR));
        }
        if !paused(engine, job.generation) {
            return Ok(());
        }
        // A cancellation wakes this sleep through the lane's wake (it rings the bell), as
        // a resume does; either way the loop looks again.
        if let Wake::Stop(Stop) = waiter.sleep(|| false, None) {
            return Err(Ended::Reset);
        }
    }
}

/// Whether the job must wait for a resume; STATUS says PAUSED while it does.
fn paused(engine: &Mutex<Engine>, generation: u64) -> bool {
    let mut engine = lock(engine);
    if engine.generation != generation {
        return false; // reset: the job's next look finds it cancelled
    }
    engine.status = if engine.paused { status::PAUSED } else { status::BUSY };
    engine.paused
}

/// CRC-32 as zlib computes it (IEEE 802.3, reflected), a table lookup per byte; `crc` is
/// the running value, inverted.
fn crc32_update(crc: u32, data: &[u8]) -> u32 {
    const TABLE: [u32; 256] = {
        let mut table = [0u32; 256];
        let mut i = 0;
        while i < 256 {
            let mut c = i as u32;
            let mut bit = 0;
            while bit < 8 {
                c = if c & 1 != 0 { 0xedb8_8320 ^ (c >> 1) } else { c >> 1 };
                bit += 1;
            }
            table[i] = c;
            i += 1;
        }
        table
    };
    data.iter().fold(crc, |c, &b| TABLE[((c ^ u32::from(b)) & 0xff) as usize] ^ (c >> 8))
}

/// The CRC-32 of `data`, as RESULT shows it.
pub fn crc32(data: &[u8]) -> u32 {
    !crc32_update(!0, data)
}

impl SimpleFunction for Checksum {
    /// BAR0's registers. The MSI-X table and PBA in it are the framework's and never come
    /// here; the rest of the BAR does, and the map reads 0 where it has no register.
    fn bar_read(&mut self, _bar: u8, offset: u64, data: &mut [u8]) -> Result<(), DeviceError> {
        let (addr, len) = (self.addr, self.len);
        let engine = lock(&self.engine);
        self.map.read(offset, data, |hit| match hit.key {
            R::Id => u64::from(ID_VALUE),
            R::AddrLo => addr & 0xffff_ffff,
            R::AddrHi => addr >> 32,
            R::Len => u64::from(len),
            R::Control => u64::from(if engine.paused { PAUSE } else { 0 }),
            R::Status => u64::from(engine.status),
            R::Result => u64::from(engine.result),
            R::Doorbell => 0, // write-only: the map never asks
        })
    }

    fn bar_write(&mut self, _bar: u8, offset: u64, data: &[u8]) -> Result<(), DeviceError> {
        let (mut rang, mut control) = (false, None);
        let (addr, len) = (&mut self.addr, &mut self.len);
        self.map.write(offset, data, |hit, value, _mask| match hit.key {
            R::AddrLo => *addr = (*addr & !0xffff_ffff) | value,
            R::AddrHi => *addr = (*addr & 0xffff_ffff) | (value << 32),
            R::Len => *len = value as u32,
            R::Control => control = Some(value as u32),
            R::Doorbell => rang = true,
            R::Id | R::Status | R::Result => {} // read-only: the map never passes them
        })?;
        if let Some(value) = control {
            self.set_control(value);
        }
        if rang {
            self.start();
        }
        Ok(())
    }

    /// DEVICE_RESET and every disconnect. The framework has cancelled the job in flight and
    /// holds the interrupts; this forgets the job (its report will find a new generation),
    /// stops the worker and joins it (it never waits for the device's lock, held here), and
    /// the next doorbell starts another.
    fn reset(&mut self) {
        {
            let mut engine = lock(&self.engine);
            let generation = engine.generation.wrapping_add(1);
            *engine = Engine { generation, ..Engine::default() };
        }
        self.stop_worker();
        (self.addr, self.len) = (0, 0);
    }
}

impl Drop for Checksum {
    fn drop(&mut self) {
        self.stop_worker();
    }
}

/// What the guest's PCI scan sees: IDs, BAR0, and MSI-X in BAR0.
fn config() -> ConfigSpaceBuilder {
    let id = 0xc5c5;
    let ids = PciIds {
        vendor_id: 0x1234,
        device_id: id,
        subsystem_vendor_id: 0x1234,
        subsystem_id: id,
        revision: 1,
        class: ClassCode { base: 0xff, sub: 0, prog_if: 0 }, // unclassified
    };
    let msix =
        MsixCap { vectors: 1, table_bar: 0, table_offset: MSIX_TABLE, pba_bar: 0, pba_offset: MSIX_PBA };
    ConfigSpaceBuilder::new(ids).bar(0, Bar::mem32(4096)).msix(msix)
}

/// The device, ready for `Daemon::start` (or `umdev_mdev::contract::check`).
pub fn device() -> Result<PciDevice<Mutex<Checksum>>, Box<dyn std::error::Error>> {
    let registers = [
        Reg::ro(R::Id, ID),
        Reg::rw(R::AddrLo, ADDR_LO),
        Reg::rw(R::AddrHi, ADDR_HI),
        Reg::rw(R::Len, LEN),
        Reg::rw(R::Control, CONTROL),
        Reg::wo(R::Doorbell, DOORBELL),
        Reg::ro(R::Status, STATUS),
        Reg::ro(R::Result, RESULT),
    ];
    let map = RegMap::builder(0, 4096).build(&registers)?;
    Ok(PciDevice::new(config(), |host| {
        let bell = Bell::new();
        let ring = bell.clone();
        Mutex::new(Checksum {
            map,
            addr: 0,
            len: 0,
            engine: Arc::default(),
            irq: host.irq,
            lane: host.requests.lane(move || ring.ring()),
            bell,
            worker: None,
        })
    })?)
}

/// Serve it, as `examples/custom_device.rs` does.
#[allow(dead_code)] // when a test includes this file
fn main() -> Result<(), Box<dyn std::error::Error>> {
    env_logger::init();
    let socket = std::env::args_os().nth(1).ok_or("usage: checksum_device SOCKET_PATH")?;
    let mut signals = Signals::new([SIGINT, SIGTERM])?;
    let daemon = Daemon::new();
    daemon.start(Arc::new(device()?), InstanceConfig::new("checksum", &socket))?;
    eprintln!("checksum_device: serving on {} (Ctrl-C to stop)", socket.to_string_lossy());
    signals.forever().next();
    daemon.shutdown();
    Ok(())
}
