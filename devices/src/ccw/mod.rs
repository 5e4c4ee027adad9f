//! `ccw`: a channel-I/O-style DMA engine on PCI, the device umdev exists for.
//!
//! A driver writes the guest address of a channel program (a chain of CCWs) to a
//! subchannel's registers and rings its doorbell. A worker thread per subchannel runs the
//! program ([`program`]): every data-transfer CCW names its guest blocks directly or through
//! an IDAW list, and all of its pages are pinned with ONE call to the pinning engine, which
//! cuts them into contiguous runs. Data moves between the pinned pages and the backing store
//! ([`Store`]); a status block goes to guest memory and the subchannel's interrupt fires
//! (MSI-X vector = subchannel, else MSI, else INTx). The register ABI is in `docs/ccw.md`.

pub mod program;

mod bus;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use thiserror::Error;
use umdev_mdev::request::{self, Completion, Lane, Permit, Requests};
use umdev_mdev::worker::{Poll, Waiter, Wake, Worker};
use umdev_pinning::PinMode;

use self::bus::{BusCounters, PinLists, PinningBus, StopFlag};
use self::program::{Reason, Status};
pub use crate::store::Store;
use umdev_mdev::guest::GuestError;
use umdev_mdev::irq::IrqHandle;
use umdev_mdev::pci::bar::Bar;
use umdev_mdev::pci::caps::{MsiCap, MsixCap};
use umdev_mdev::pci::config::{ClassCode, ConfigSpaceBuilder, PciIds};
use umdev_mdev::pci::device::{Host, PciDevice, PciFunction};
use umdev_mdev::pci::regmap::{Reg, RegMap};
use umdev_mdev::{DeviceContext, DeviceError};

/// The type name.
pub const TYPE_NAME: &str = "ccw";
/// PCI vendor ID.
pub const VENDOR_ID: u16 = 0x1234;
/// PCI device ID.
pub const DEVICE_ID: u16 = 0x75cc;
/// BAR0 size.
pub const BAR0_SIZE: u64 = 4096;
/// Most subchannels a device may have.
pub const MAX_SUBCHANNELS: u32 = 16;
/// Subchannels unless the `subchannels` option says otherwise.
pub const DEFAULT_SUBCHANNELS: u32 = 4;
/// RAM disk size unless the `store` option says otherwise (64 MiB).
pub const DEFAULT_STORE_SIZE: u64 = 64 << 20;
/// Offset of the MSI-X table in BAR0.
pub const MSIX_TABLE_OFFSET: u32 = 0x800;
/// Offset of the MSI-X PBA in BAR0.
pub const MSIX_PBA_OFFSET: u32 = 0xc00;

/// BAR0 register offsets (all 32-bit, little-endian).
pub mod regs {
    /// RO: [`ID_VALUE`].
    pub const ID: u64 = 0x000;
    /// RO: ABI version (1).
    pub const VERSION: u64 = 0x004;
    /// RO: number of subchannels.
    pub const SUBCHANNELS: u64 = 0x008;
    /// RO: pin mode of the instance (0 track, 1 lock).
    pub const PIN_MODE: u64 = 0x00c;
    /// RO: store size, low and high halves.
    pub const STORE_SIZE_LO: u64 = 0x010;
    /// RO: see [`STORE_SIZE_LO`].
    pub const STORE_SIZE_HI: u64 = 0x014;
    /// RO: bit n set while subchannel n has status pending.
    pub const IRQ_STATUS: u64 = 0x018;
    /// First subchannel block; subchannel n's is at `SUBCHANNEL_BASE + n * SUBCHANNEL_STRIDE`.
    pub const SUBCHANNEL_BASE: u64 = 0x100;
    /// Bytes per subchannel block.
    pub const SUBCHANNEL_STRIDE: u64 = 0x40;
    /// RW: channel program address, low half.
    pub const CPA_LO: u64 = 0x00;
    /// RW: channel program address, high half.
    pub const CPA_HI: u64 = 0x04;
    /// RW: status block address (0: no status block), low half.
    pub const STATUS_LO: u64 = 0x08;
    /// RW: status block address, high half.
    pub const STATUS_HI: u64 = 0x0c;
    /// WO: [`DOORBELL_START`] or [`DOORBELL_HALT`].
    pub const DOORBELL: u64 = 0x10;
    /// RO: [`STATE_IDLE`], [`STATE_BUSY`] or [`STATE_PENDING`].
    pub const STATE: u64 = 0x14;
    /// WO: any write clears status pending (back to idle).
    pub const ACK: u64 = 0x18;
    /// RO: device status | subchannel status << 8 of the last program.
    pub const DSTAT_CSTAT: u64 = 0x1c;
    /// RO: residual count of the last program's last CCW.
    pub const RESIDUAL: u64 = 0x20;
    /// RO: reason code of the last program.
    pub const REASON: u64 = 0x24;
    /// RO: CCWs the last program executed.
    pub const CCWS: u64 = 0x28;
    /// RO: programs this subchannel completed.
    pub const PROGRAMS: u64 = 0x2c;
    /// RO: bytes the last program moved, low half.
    pub const BYTES_LO: u64 = 0x30;
    /// RO: see [`BYTES_LO`].
    pub const BYTES_HI: u64 = 0x34;
    /// RO: address of the CCW after the last one fetched, low half.
    pub const CPA_OUT_LO: u64 = 0x38;
    /// RO: see [`CPA_OUT_LO`].
    pub const CPA_OUT_HI: u64 = 0x3c;

    /// The ID register's value ("ccw!" little-endian).
    pub const ID_VALUE: u32 = 0x2177_6363;
    /// Start the channel program at CPA.
    pub const DOORBELL_START: u32 = 1;
    /// Stop the running program (it ends with unit exception, reason halted).
    pub const DOORBELL_HALT: u32 = 2;
    /// No program, no status.
    pub const STATE_IDLE: u32 = 0;
    /// A program is running.
    pub const STATE_BUSY: u32 = 1;
    /// A program ended; its status waits for ACK.
    pub const STATE_PENDING: u32 = 2;
}

/// Why a ccw device could not be created.
#[derive(Debug, Error)]
pub enum CcwError {
    /// An option is out of range or malformed.
    #[error("{0}")]
    Option(String),
    /// The store could not be created or opened.
    #[error("backing store: {0}")]
    Store(std::io::Error),
    /// The PCI function could not be built.
    #[error(transparent)]
    Pci(#[from] umdev_mdev::pci::device::PciDeviceError),
    /// A worker thread could not start.
    #[error("starting a subchannel worker: {0}")]
    Thread(std::io::Error),
}

/// How to build a ccw device.
#[derive(Debug)]
pub struct CcwConfig {
    /// Subchannels (1 to [`MAX_SUBCHANNELS`]).
    pub subchannels: u32,
    /// The backing store.
    pub store: Store,
}

/// The ccw device's config space.
pub fn config(subchannels: u32) -> ConfigSpaceBuilder {
    let ids = PciIds {
        vendor_id: VENDOR_ID,
        device_id: DEVICE_ID,
        subsystem_vendor_id: VENDOR_ID,
        subsystem_id: DEVICE_ID,
        revision: 1,
        // Mass storage, other.
        class: ClassCode { base: 0x01, sub: 0x80, prog_if: 0 },
    };
    ConfigSpaceBuilder::new(ids)
        .bar(0, Bar::mem32(BAR0_SIZE))
        .interrupt_pin(1)
        .power_management()
        .msi(MsiCap { vectors: 1, per_vector_mask: false, addr64: true })
        .msix(MsixCap {
            vectors: subchannels as u16,
            table_bar: 0,
            table_offset: MSIX_TABLE_OFFSET,
            pba_bar: 0,
            pba_offset: MSIX_PBA_OFFSET,
        })
}

/// Creates a ccw device.
pub fn create(cfg: CcwConfig) -> Result<PciDevice<Ccw>, CcwError> {
    if cfg.subchannels == 0 || cfg.subchannels > MAX_SUBCHANNELS {
        return Err(CcwError::Option(format!("subchannels must be 1 to {MAX_SUBCHANNELS}")));
    }
    PciDevice::try_new(config(cfg.subchannels), |host| Ccw::new(host, cfg))
}

/// Registers of one subchannel.
#[derive(Debug, Default)]
struct SubRegs {
    cpa: u64,
    status_addr: u64,
    state: u32,
    last: Option<Status>,
    programs: u32,
}

#[derive(Debug)]
struct Subchannel {
    index: u16,
    regs: Mutex<SubRegs>,
    /// A HALT for the running program.
    stop: StopFlag,
    /// The program the worker is to run next.
    next: Mutex<Option<Permit<Job>>>,
}

impl Subchannel {
    fn regs(&self) -> MutexGuard<'_, SubRegs> {
        umdev_pinning::sync::lock(&self.regs)
    }
}

/// How long dropping the device waits for a subchannel's worker to end.
const STOP_WAIT: Duration = Duration::from_secs(5);

/// One channel program in flight: what its subchannel's worker runs, and how it ends.
#[derive(Debug)]
struct Job {
    shared: Arc<Shared>,
    index: usize,
    cpa: u64,
    status_addr: u64,
    generation: u64,
}

impl Completion for Job {
    type Outcome = Status;
    type Shared = ();

    fn complete(self, status: Status, ctx: &DeviceContext, (): &()) {
        self.shared.complete(&self, status, ctx);
    }

    /// The device failed internally (its handling of the program panicked): the program
    /// ends with unit check, reason `DeviceError`, nothing counted (docs/ccw.md).
    fn fail(self, ctx: &DeviceContext, (): &()) {
        let (dstat, cstat) = Reason::DeviceError.status_bits();
        let status = Status {
            dstat,
            cstat,
            residual: 0,
            cpa: self.cpa.wrapping_add(program::CCW_SIZE),
            reason: Reason::DeviceError,
            ccws: 0,
            bytes: 0,
        };
        self.shared.complete(&self, status, ctx);
    }
}

/// State shared by the register side and the workers.
#[derive(Debug)]
struct Shared {
    irq: IrqHandle,
    store: Store,
    subchannels: Vec<Subchannel>,
    /// Bumped by reset and detach: a program of an older generation reports nothing.
    generation: AtomicU64,
    counters: BusCounters,
    programs: AtomicU64,
    /// The programs, tracked by the framework (which also keeps the client's context).
    requests: Requests,
    /// Held while a subchannel's state changes together with the interrupt it implies
    /// (completion and raise, ACK and deassert, reset), so the INTx level always matches
    /// the pending status: taken before any subchannel's registers.
    line: Mutex<()>,
}

impl Shared {
    fn line(&self) -> MutexGuard<'_, ()> {
        umdev_pinning::sync::lock(&self.line)
    }

    fn irq_status(&self) -> u32 {
        self.subchannels
            .iter()
            .enumerate()
            .filter(|(_, sc)| sc.regs().state == regs::STATE_PENDING)
            .fold(0, |bits, (i, _)| bits | 1 << i)
    }

    /// A program ended: status block, registers, interrupt.
    ///
    /// The status block is written under the line lock, after the generation is checked
    /// there: a reset bumps the generation under the same locks, so the block of a program
    /// the reset ended never reaches memory the guest may have reused since (a copy through
    /// a pin, which waits on nobody). Memory the client mapped without an fd is written
    /// through the client instead, whose answer the connection thread reads, the thread a
    /// reset runs on: that write is made before the lock, so there a reset may still come
    /// between the check and the write.
    fn complete(&self, job: &Job, status: Status, ctx: &DeviceContext) {
        if self.generation.load(Ordering::Acquire) != job.generation {
            return; // reset meanwhile: the program's subchannel state is gone
        }
        let block = status.encode();
        let failed = |e: GuestError| {
            log::debug!("ccw: subchannel {}: status block at {:#x}: {e}", job.index, job.status_addr)
        };
        // A program ended for bus mastering off writes no status block (docs/ccw.md), even if
        // the guest turned bus mastering back on before this: the block is guest memory.
        if job.status_addr != 0 && status.reason != Reason::BusMasterOff {
            let Some((line, regs)) = self.current_locked(job) else { return };
            match ctx.write_pinned(job.status_addr, &block) {
                // Mapped without an fd: through the client, outside the locks (below).
                Err(GuestError::NoHostMemory { .. }) => {}
                written => {
                    if let Err(e) = written {
                        failed(e);
                    }
                    return self.post(job, status, line, regs);
                }
            }
            drop((line, regs));
            if let Err(e) = ctx.write_either(job.status_addr, &block) {
                failed(e);
            }
        }
        if let Some((line, regs)) = self.current_locked(job) {
            self.post(job, status, line, regs);
        }
    }

    /// The line lock and `job`'s subchannel's registers, if no reset came since `job` began:
    /// checked under the registers' lock, since a reset bumps the generation before it clears
    /// the registers, so it either sees what is done under these or this sees its bump.
    fn current_locked(&self, job: &Job) -> Option<(MutexGuard<'_, ()>, MutexGuard<'_, SubRegs>)> {
        let line = self.line();
        let regs = self.subchannels[job.index].regs();
        (self.generation.load(Ordering::Acquire) == job.generation).then_some((line, regs))
    }

    /// The registers and the interrupt of a program that ended, under the line lock and the
    /// subchannel's registers' lock (the generation checked under them).
    fn post(&self, job: &Job, status: Status, _line: MutexGuard<'_, ()>, mut r: MutexGuard<'_, SubRegs>) {
        let sc = &self.subchannels[job.index];
        r.state = regs::STATE_PENDING;
        r.last = Some(status);
        r.programs = r.programs.wrapping_add(1);
        drop(r);
        self.programs.fetch_add(1, Ordering::Relaxed);
        match self.irq.mode() {
            umdev_mdev::irq::IrqMode::Msix => {
                self.irq.raise(sc.index);
            }
            umdev_mdev::irq::IrqMode::Msi => {
                self.irq.raise(0);
            }
            _ => {}
        }
        // INTx is a level that follows IRQ_STATUS in every mode: a driver that falls back
        // from MSI to INTx with status pending gets its interrupt.
        self.irq.intx_assert();
    }
}

/// Why a subchannel's worker stops: the device is going.
#[derive(Clone, Copy, Debug)]
struct Close;

/// A subchannel's worker thread and its requests.
struct Channel {
    worker: Worker<Close>,
    lane: Lane,
}

/// The ccw PCI function (serve it through [`PciDevice`]; see [`create`]).
pub struct Ccw {
    shared: Arc<Shared>,
    channels: Vec<Channel>,
    map: RegMap<CcwReg>,
}

impl std::fmt::Debug for Ccw {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Ccw").field("subchannels", &self.shared.subchannels.len()).finish_non_exhaustive()
    }
}

/// Subchannel `index`'s worker: runs each program put in its `next`, until the device goes.
fn worker(shared: &Shared, index: usize, mut w: Waiter<Close>) {
    let sc = &shared.subchannels[index];
    // Lists a program is interpreted and pinned in, kept from one to the next.
    let (mut scratch, mut lists) = (program::Scratch::default(), PinLists::default());
    loop {
        let next = umdev_pinning::sync::lock(&sc.next).take();
        let Some(mut permit) = next else {
            if let Wake::Stop(Close) = w.wait(|| false, None) {
                return;
            }
            continue;
        };
        let (cpa, started_in) = (permit.get().cpa, permit.get().generation);
        let status = request::serve("a ccw channel program", || {
            let mut bus = PinningBus {
                permit: &mut permit,
                store: &shared.store,
                stop: &sc.stop,
                generation: &shared.generation,
                started_in,
                counters: &shared.counters,
                lists: &mut lists,
            };
            program::run_with(&mut bus, cpa, &mut scratch)
        });
        lists.trim();
        match status {
            // Stopped by a reset or a disconnect (it reads as Halted to the program): the
            // guest expects nothing of it, and the reset may not have bumped the generation
            // yet, which would let `Shared::complete` report it (docs/ccw.md, Reset).
            _ if permit.cancelled() == Some(request::Cancel::Reset) => {
                let _ = permit.into_inner();
            }
            Some(status) => permit.complete(status),
            None => drop(permit), // fails the program: DeviceError
        }
    }
}

impl Ccw {
    fn new(host: Host, cfg: CcwConfig) -> Result<Ccw, CcwError> {
        let subchannels = (0..cfg.subchannels)
            .map(|i| Subchannel {
                index: i as u16,
                regs: Mutex::new(SubRegs::default()),
                stop: StopFlag::default(),
                next: Mutex::new(None),
            })
            .collect();
        let shared = Arc::new(Shared {
            irq: host.irq,
            store: cfg.store,
            subchannels,
            generation: AtomicU64::new(0),
            counters: BusCounters::default(),
            programs: AtomicU64::new(0),
            requests: host.requests,
            line: Mutex::new(()),
        });
        let mut channels = Vec::new();
        for i in 0..cfg.subchannels as usize {
            let s = shared.clone();
            let worker = Worker::spawn(format!("umdev-ccw-sch{i}"), Poll::NONE, move |w| worker(&s, i, w))
                .map_err(CcwError::Thread)?;
            let bell = worker.bell();
            let lane = shared.requests.lane(move || bell.ring());
            channels.push(Channel { worker, lane });
        }
        Ok(Ccw { shared, channels, map: register_map(cfg.subchannels) })
    }

    /// Programs completed by all subchannels.
    pub fn programs(&self) -> u64 {
        self.shared.programs.load(Ordering::Relaxed)
    }

    /// Pin calls made for data transfers.
    pub fn pin_calls(&self) -> u32 {
        self.shared.counters.pin_calls.load(Ordering::Relaxed)
    }

    fn global_read(&self, offset: u64) -> u32 {
        match offset {
            regs::ID => regs::ID_VALUE,
            regs::VERSION => 1,
            regs::SUBCHANNELS => self.shared.subchannels.len() as u32,
            regs::PIN_MODE => match self.shared.requests.context().map(|c| c.pin_mode()) {
                None | Some(PinMode::Track) => 0,
                Some(PinMode::Lock) => 1,
                Some(PinMode::Kernel) => 2,
            },
            regs::STORE_SIZE_LO => self.shared.store.size() as u32,
            regs::STORE_SIZE_HI => (self.shared.store.size() >> 32) as u32,
            regs::IRQ_STATUS => self.shared.irq_status(),
            _ => 0,
        }
    }

    fn subchannel_read(&self, sc: &Subchannel, reg: u64) -> u32 {
        let r = sc.regs();
        let last = r.last.unwrap_or(Status {
            dstat: 0,
            cstat: 0,
            residual: 0,
            cpa: 0,
            reason: Reason::Ok,
            ccws: 0,
            bytes: 0,
        });
        match reg {
            regs::CPA_LO => r.cpa as u32,
            regs::CPA_HI => (r.cpa >> 32) as u32,
            regs::STATUS_LO => r.status_addr as u32,
            regs::STATUS_HI => (r.status_addr >> 32) as u32,
            regs::STATE => r.state,
            regs::DSTAT_CSTAT => u32::from(last.dstat) | u32::from(last.cstat) << 8,
            regs::RESIDUAL => last.residual,
            regs::REASON => last.reason as u32,
            regs::CCWS => last.ccws,
            regs::PROGRAMS => r.programs,
            regs::BYTES_LO => last.bytes as u32,
            regs::BYTES_HI => (last.bytes >> 32) as u32,
            regs::CPA_OUT_LO => last.cpa as u32,
            regs::CPA_OUT_HI => (last.cpa >> 32) as u32,
            _ => 0,
        }
    }

    fn subchannel_write(&self, index: usize, reg: u64, value: u32) {
        let sc = &self.shared.subchannels[index];
        let set_lo = |old: &mut u64| *old = (*old & !0xffff_ffff) | u64::from(value);
        let set_hi = |old: &mut u64| *old = (*old & 0xffff_ffff) | u64::from(value) << 32;
        match reg {
            regs::CPA_LO => set_lo(&mut sc.regs().cpa),
            regs::CPA_HI => set_hi(&mut sc.regs().cpa),
            regs::STATUS_LO => set_lo(&mut sc.regs().status_addr),
            regs::STATUS_HI => set_hi(&mut sc.regs().status_addr),
            regs::DOORBELL if value == regs::DOORBELL_START => self.start(index),
            regs::DOORBELL if value == regs::DOORBELL_HALT => sc.stop.request(),
            regs::ACK => {
                let _line = self.shared.line();
                {
                    let mut r = sc.regs();
                    if r.state == regs::STATE_PENDING {
                        r.state = regs::STATE_IDLE;
                    }
                }
                if self.shared.irq_status() == 0 {
                    self.shared.irq.intx_deassert();
                }
            }
            _ => log::debug!("ccw: write of {value:#x} to subchannel {index} register {reg:#x} ignored"),
        }
    }

    /// Doorbell START: queues the program if the subchannel is idle (a start while busy or
    /// with status pending is ignored, as SSCH would refuse it).
    fn start(&self, index: usize) {
        let sc = &self.shared.subchannels[index];
        let Some(channel) = self.channels.get(index) else { return };
        let mut r = sc.regs();
        if r.state != regs::STATE_IDLE {
            log::debug!("ccw: start on subchannel {index} refused: not idle");
            return;
        }
        let job = Job {
            shared: self.shared.clone(),
            index,
            cpa: r.cpa,
            status_addr: r.status_addr,
            generation: self.shared.generation.load(Ordering::Acquire),
        };
        let permit = match channel.lane.begin(job) {
            Ok(permit) => permit,
            Err(_) => {
                log::debug!("ccw: start on subchannel {index} with no client");
                return;
            }
        };
        sc.stop.clear();
        r.state = regs::STATE_BUSY;
        drop(r);
        *umdev_pinning::sync::lock(&sc.next) = Some(permit);
        channel.worker.wake();
    }

    /// Stops every running program and forgets all subchannel state.
    fn stop_all(&self) {
        let _line = self.shared.line();
        self.shared.generation.fetch_add(1, Ordering::AcqRel);
        for sc in &self.shared.subchannels {
            sc.stop.request();
            *sc.regs() = SubRegs::default();
        }
        self.shared.irq.intx_deassert();
    }
}

/// A register of BAR0: global, or one of a subchannel's block (its index is the array
/// element), by offset.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum CcwReg {
    Global(u64),
    Sub(u64),
}

/// BAR0's register map (docs/ccw.md): aligned 32-bit accesses only; offsets with no
/// register read 0 and ignore writes, as do write-only and read-only registers.
fn register_map(subchannels: u32) -> RegMap<CcwReg> {
    use regs::*;
    let sub = |r: u64, access: fn(CcwReg, u64) -> Reg<CcwReg>| {
        access(CcwReg::Sub(r), SUBCHANNEL_BASE + r).array(subchannels, SUBCHANNEL_STRIDE)
    };
    let mut map: Vec<Reg<CcwReg>> =
        [ID, VERSION, SUBCHANNELS, PIN_MODE, STORE_SIZE_LO, STORE_SIZE_HI, IRQ_STATUS]
            .into_iter()
            .map(|r| Reg::ro(CcwReg::Global(r), r))
            .collect();
    for r in [CPA_LO, CPA_HI, STATUS_LO, STATUS_HI] {
        map.push(sub(r, Reg::rw));
    }
    for r in [DOORBELL, ACK] {
        map.push(sub(r, Reg::wo));
    }
    for r in
        [STATE, DSTAT_CSTAT, RESIDUAL, REASON, CCWS, PROGRAMS, BYTES_LO, BYTES_HI, CPA_OUT_LO, CPA_OUT_HI]
    {
        map.push(sub(r, Reg::ro));
    }
    // The whole BAR: accesses to the MSI-X table and PBA are the framework's and never reach here.
    RegMap::builder(0, BAR0_SIZE).build(&map).expect("a valid register map")
}

impl PciFunction for Ccw {
    fn bar_read(&self, _bar: u8, offset: u64, data: &mut [u8]) -> Result<(), DeviceError> {
        self.map.read(offset, data, |hit| {
            u64::from(match hit.key {
                CcwReg::Global(r) => self.global_read(r),
                CcwReg::Sub(r) => self.subchannel_read(&self.shared.subchannels[hit.index as usize], r),
            })
        })
    }

    fn bar_write(&self, _bar: u8, offset: u64, data: &[u8]) -> Result<(), DeviceError> {
        self.map.write(offset, data, |hit, value, _| {
            if let CcwReg::Sub(r) = hit.key {
                self.subchannel_write(hit.index as usize, r, value as u32);
            }
        })
    }

    fn reset(&self) {
        self.stop_all();
    }
}

impl Drop for Ccw {
    fn drop(&mut self) {
        self.stop_all();
        for (sc, channel) in self.shared.subchannels.iter().zip(self.channels.drain(..)) {
            // A program its worker never took holds the shared state: it ends here (and
            // reports nothing: its generation is gone).
            drop(umdev_pinning::sync::lock(&sc.next).take());
            channel.worker.stop(Close);
            if let Err(e) = channel.worker.join(STOP_WAIT) {
                log::error!("ccw: {e}");
            }
        }
    }
}

/// The `ccw` device type; its options are [`CcwType::option_specs`].
pub struct CcwType {
    pool: Arc<umdev_mdev::types::Pool>,
}

/// The largest RAM store (64 GiB).
pub const MAX_RAM_STORE: u64 = 64 << 30;

/// What an instance's options ask for, checked, before anything is opened.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CcwPlan {
    /// Subchannels.
    pub subchannels: u32,
    /// The store.
    pub store: umdev_mdev::types::StoreSpec,
}

impl CcwType {
    /// The type, with room for `capacity` instances.
    pub fn new(capacity: u32) -> Self {
        CcwType { pool: umdev_mdev::types::Pool::new(capacity) }
    }

    /// The type's options (docs/ccw.md), as `umdev types -v` lists them.
    pub fn option_specs() -> Vec<umdev_mdev::types::OptionSpec> {
        use umdev_mdev::types::{OptionSpec, ValueSyntax};
        let store = ValueSyntax::Store { min: 4096, max_ram: MAX_RAM_STORE };
        vec![
            OptionSpec::new(
                "store",
                store,
                Some("ram:64M"),
                "the bytes programs read and write: a RAM disk, or a host file or block device used in place",
            ),
            OptionSpec::new(
                "subchannels",
                ValueSyntax::Integer { min: 1, max: MAX_SUBCHANNELS as u64 },
                Some("4"),
                "subchannels, each with its own worker thread",
            ),
            OptionSpec::new(
                "size",
                ValueSyntax::Size { min: 4096, max: MAX_RAM_STORE },
                None,
                "the older spelling of store=ram:SIZE",
            ),
            OptionSpec::new(
                "file",
                ValueSyntax::Custom { syntax: "/PATH", check: |_| Ok(()) },
                None,
                "the older spelling of store=file:/PATH",
            ),
        ]
    }

    /// What these options ask for, or why they are refused (the check `create` makes),
    /// opening nothing.
    pub fn plan(options: &umdev_mdev::types::InstanceOptions) -> Result<CcwPlan, String> {
        use umdev_mdev::types::{parse_options, StoreSpec};
        let p = parse_options(&Self::option_specs(), &options.params)?;
        let subchannels = p.number("subchannels").map_or(DEFAULT_SUBCHANNELS, |n| n as u32);
        // `size=` and `file=` are `store=` as it was first spelled; one of the three at most.
        let given: Vec<&str> = ["store", "size", "file"].into_iter().filter(|k| p.get(k).is_some()).collect();
        if given.len() > 1 {
            return Err(format!(
                "{} name the same store: give one (store=ram:SIZE or store=file:/PATH)",
                given.join(" and ")
            ));
        }
        let store = if let Some(store) = p.store("store") {
            store.clone()
        } else if let Some(bytes) = p.number("size") {
            StoreSpec::Ram(bytes)
        } else if let Some(path) = p.text("file") {
            // The same check as store=file:, the message naming what was given.
            let spec = Self::option_specs()[0];
            match spec
                .parse("file", &format!("file:{path}"))
                .map_err(|e| e.replacen("file=file:", "file=", 1))?
            {
                umdev_mdev::types::OptionValue::Store(store) => store,
                _ => unreachable!("a store option parses to a store"),
            }
        } else {
            StoreSpec::Ram(DEFAULT_STORE_SIZE)
        };
        Ok(CcwPlan { subchannels, store })
    }

    /// The configuration an instance with these options would get: [`CcwType::plan`], with
    /// the store opened or made.
    /// The device's configuration: its options checked (a bad one is [`TypeError::BadOption`]),
    /// then its store made or opened (a failure there, a busy or missing file say, is
    /// [`TypeError::Create`], naming the option, as nvme names its namespace).
    ///
    /// [`TypeError::BadOption`]: umdev_mdev::types::TypeError::BadOption
    /// [`TypeError::Create`]: umdev_mdev::types::TypeError::Create
    pub fn config(
        options: &umdev_mdev::types::InstanceOptions,
    ) -> Result<CcwConfig, umdev_mdev::types::TypeError> {
        use umdev_mdev::types::StoreSpec;
        let plan = Self::plan(options).map_err(bad_option)?;
        let store = match &plan.store {
            StoreSpec::Ram(bytes) => {
                Store::ram(*bytes).map_err(|e| format!("store: RAM disk of {bytes} bytes: {e}"))
            }
            StoreSpec::File(path) => Store::open(path).map_err(|e| format!("store: {}: {e}", path.display())),
        }
        .map_err(|why| umdev_mdev::types::TypeError::Create { ty: TYPE_NAME.into(), why })?;
        Ok(CcwConfig { subchannels: plan.subchannels, store })
    }
}

impl umdev_mdev::types::DeviceType for CcwType {
    fn name(&self) -> &str {
        TYPE_NAME
    }

    fn description(&self) -> &str {
        "channel-I/O DMA engine: CCW programs with IDAW scatter lists, pinned one call per CCW"
    }

    fn available_instances(&self) -> u32 {
        self.pool.free()
    }

    fn options(&self) -> Vec<umdev_mdev::types::OptionSpec> {
        Self::option_specs()
    }

    fn check(
        &self,
        options: &umdev_mdev::types::InstanceOptions,
    ) -> Result<(), umdev_mdev::types::TypeError> {
        Self::plan(options).map(drop).map_err(bad_option)
    }

    fn create(
        &self,
        options: &umdev_mdev::types::InstanceOptions,
    ) -> Result<Arc<dyn umdev_mdev::VfioDevice>, umdev_mdev::types::TypeError> {
        let config = Self::config(options)?;
        self.pool.instance(TYPE_NAME, 1, || create(config))
    }
}

fn bad_option(why: String) -> umdev_mdev::types::TypeError {
    umdev_mdev::types::TypeError::BadOption { ty: TYPE_NAME.into(), why }
}

#[cfg(test)]
mod tests {
    use std::fs::File;
    use std::os::fd::AsFd;
    use std::os::unix::fs::FileExt;

    use umdev_pinning::{DmaSpace, Prot};

    use super::*;
    use crate::testutil::NoClient;
    use umdev_mdev::pci::regs::{COMMAND, COMMAND_MASTER, COMMAND_MEMORY};
    use umdev_mdev::VfioDevice;
    use umdev_mdev::VFIO_PCI_CONFIG_REGION_INDEX;

    /// A ccw device with one subchannel, attached to 1 MiB of guest RAM at IOVA 0, bus
    /// mastering on.
    struct Rig {
        device: PciDevice<Ccw>,
        ram: File,
        dma: DmaSpace,
    }

    impl Rig {
        fn new(store: Store) -> Rig {
            let device = create(CcwConfig { subchannels: 1, store }).unwrap();
            let ram = File::from(
                nix::sys::memfd::memfd_create(c"ccw-test-ram", nix::sys::memfd::MFdFlags::MFD_CLOEXEC)
                    .unwrap(),
            );
            ram.set_len(1 << 20).unwrap();
            let dma = DmaSpace::new(Default::default());
            dma.map(0, 1 << 20, ram.as_fd(), 0, Prot::READ_WRITE).unwrap();
            let command = (COMMAND_MEMORY | COMMAND_MASTER).to_le_bytes();
            device.region_write(VFIO_PCI_CONFIG_REGION_INDEX, COMMAND as u64, &command).unwrap();
            device.attach(DeviceContext::new(dma.clone(), Arc::new(NoClient)));
            Rig { device, ram, dma }
        }

        fn read(&self, offset: u64) -> u32 {
            let mut v = [0u8; 4];
            self.device.region_read(0, regs::SUBCHANNEL_BASE + offset, &mut v).unwrap();
            u32::from_le_bytes(v)
        }

        fn write(&self, offset: u64, value: u32) {
            self.device.region_write(0, regs::SUBCHANNEL_BASE + offset, &value.to_le_bytes()).unwrap();
        }

        /// Runs the one-CCW program `ccw` at 0x2000, waits, ACKs; the registers' (REASON,
        /// CCWS, BYTES).
        fn run(&self, ccw: program::Ccw) -> (u32, u32, u32) {
            self.ram.write_all_at(&ccw.encode(), 0x2000).unwrap();
            self.write(regs::CPA_LO, 0x2000);
            self.write(regs::STATUS_LO, 0x3000);
            self.write(regs::DOORBELL, regs::DOORBELL_START);
            let deadline = std::time::Instant::now() + Duration::from_secs(5);
            while self.read(regs::STATE) != regs::STATE_PENDING {
                assert!(std::time::Instant::now() < deadline, "the program never ended");
                std::thread::sleep(Duration::from_millis(1));
            }
            let out = (self.read(regs::REASON), self.read(regs::CCWS), self.read(regs::BYTES_LO));
            self.write(regs::ACK, 1);
            out
        }
    }

    /// docs/ccw.md, reason 18: a program whose handling failed inside the device (its
    /// permit dropped unfinished, as after a panic) ends with DeviceError, CCWS, BYTES and
    /// the residual 0, CPA out = CPA + 16, in the status block and the registers, and the
    /// subchannel takes the next program.
    #[test]
    fn a_program_the_device_drops_ends_with_device_error() {
        let rig = Rig::new(Store::ram(1 << 20).unwrap());
        rig.ram.write_all_at(&[0xff; 32], 0x3000).unwrap();
        let ccw = rig.device.function();
        let job = |cpa| Job {
            shared: ccw.shared.clone(),
            index: 0,
            cpa,
            status_addr: 0x3000,
            generation: ccw.shared.generation.load(Ordering::Acquire),
        };
        ccw.shared.subchannels[0].regs().state = regs::STATE_BUSY;
        drop(ccw.channels[0].lane.begin(job(0x2000)).unwrap());

        assert_eq!(ccw.shared.requests.in_flight(), 0);
        let mut block = [0u8; 32];
        rig.ram.read_exact_at(&mut block, 0x3000).unwrap();
        let status = Status::decode(&block).unwrap();
        let (dstat, cstat) = Reason::DeviceError.status_bits();
        assert_eq!((status.reason, status.dstat, status.cstat), (Reason::DeviceError, dstat, cstat));
        assert_eq!((status.ccws, status.bytes, status.residual, status.cpa), (0, 0, 0, 0x2010));
        assert_eq!(rig.read(regs::STATE), regs::STATE_PENDING);
        assert_eq!(rig.read(regs::REASON), Reason::DeviceError as u32);
        assert_eq!((rig.read(regs::CPA_OUT_LO), rig.read(regs::BYTES_LO)), (0x2010, 0));

        // The subchannel goes on: ACK, then a real program (one NOP) runs to the end.
        rig.write(regs::ACK, 1);
        assert_eq!(rig.read(regs::STATE), regs::STATE_IDLE);
        let nop = program::Ccw { cmd: program::cmd::NOP, flags: 0, reserved: 0, count: 1, addr: 0 };
        assert_eq!(rig.run(nop), (0, 1, 0));
        rig.device.detach();
    }

    /// docs/ccw.md, reason 19: a program ended for bus mastering off writes no status block,
    /// though the guest turned bus mastering back on before the end was reported.
    #[test]
    fn a_program_ended_for_bus_mastering_off_writes_no_status_block() {
        let rig = Rig::new(Store::ram(1 << 20).unwrap());
        rig.ram.write_all_at(&[0xff; 32], 0x3000).unwrap();
        let ccw = rig.device.function();
        let job = Job {
            shared: ccw.shared.clone(),
            index: 0,
            cpa: 0x2000,
            status_addr: 0x3000,
            generation: ccw.shared.generation.load(Ordering::Acquire),
        };
        ccw.shared.subchannels[0].regs().state = regs::STATE_BUSY;
        let (dstat, cstat) = Reason::BusMasterOff.status_bits();
        let status = Status {
            dstat,
            cstat,
            residual: 0,
            cpa: 0x2010,
            reason: Reason::BusMasterOff,
            ccws: 1,
            bytes: 0,
        };
        // Bus mastering is on (the rig's): the block would be writable.
        let ctx = DeviceContext::new(rig.dma.clone(), Arc::new(NoClient));
        ccw.shared.complete(&job, status, &ctx);
        let mut block = [0u8; 32];
        rig.ram.read_exact_at(&mut block, 0x3000).unwrap();
        assert_eq!(block, [0xff; 32], "no status block");
        assert_eq!(rig.read(regs::STATE), regs::STATE_PENDING);
        assert_eq!(rig.read(regs::REASON), Reason::BusMasterOff as u32);
        rig.write(regs::ACK, 1);
        rig.device.detach();
    }

    /// A store file another device holds is no bad option (the same options start once it is
    /// free): the failure is the creation's, naming the option.
    #[test]
    fn a_busy_store_file_fails_the_creation_not_the_options() {
        let file = tempfile::NamedTempFile::new().unwrap();
        file.as_file().set_len(1 << 20).unwrap();
        let mut options = umdev_mdev::types::InstanceOptions::default();
        options.params.insert("store".into(), format!("file:{}", file.path().display()));
        let held = CcwType::config(&options).unwrap();
        match CcwType::config(&options) {
            Err(umdev_mdev::types::TypeError::Create { ty, why }) => {
                assert_eq!(ty, TYPE_NAME);
                assert!(why.starts_with("store: ") && why.contains("in use"), "{why}");
            }
            other => panic!("{other:?}"),
        }
        drop(held);
        assert!(CcwType::config(&options).is_ok(), "free again");
    }
}
