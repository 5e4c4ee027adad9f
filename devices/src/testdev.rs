//! `testdev`: a small PCI function that exercises the device model end to end — registers,
//! DMA through the pinning engine or the client, INTx/MSI/MSI-X, a sparse-mmap BAR and an
//! I/O BAR. The register ABI is in `docs/testdev.md`.
//!
//! DMA runs on the device's worker thread: server-to-client DMA must not be issued from the
//! connection thread, and a DMA_UNMAP or reset must never wait for a transfer that may itself
//! wait for the client. A command is a request the framework tracks: it claims its range, so
//! an overlapping unmap cancels it, as a reset or a detach does. Jobs move data in 64 KiB
//! chunks and look between chunks whether they were cancelled; a cancelled job's result is
//! discarded if the registers were reset meanwhile.

use std::os::fd::{AsFd, OwnedFd};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use thiserror::Error;
use umdev_mdev::guest::GuestError;
use umdev_mdev::irq::IrqHandle;
use umdev_mdev::pci::regmap::merge;
use umdev_mdev::pci::{
    Bar, ClassCode, ConfigSpaceBuilder, Host, MsiCap, MsixCap, PciDevice, PciDeviceError, PciFunction,
    PciIds, Reg, RegMap,
};
use umdev_mdev::request::{self, Completion, Lane, Permit};
use umdev_mdev::worker::{Poll, Waiter, Wake, Worker};
use umdev_mdev::{ClientDmaError, DeviceError, RegionMmap, SparseArea};

/// The type name devices of this kind are created under.
pub const TYPE_NAME: &str = "testdev";
/// PCI vendor ID.
pub const VENDOR_ID: u16 = 0x1234;
/// PCI device ID.
pub const DEVICE_ID: u16 = 0x75d1;

/// BAR0 (registers, MSI-X table and PBA): 4 KiB, 32-bit memory.
pub const BAR0_SIZE: u64 = 4096;
/// BAR1 (memfd-backed memory, first page mmap-able): 8 KiB, 32-bit memory.
pub const BAR1_SIZE: u64 = 8192;
/// BAR2 (I/O registers): 16 bytes of I/O space.
pub const BAR2_SIZE: u64 = 16;
/// The mmap-able part of BAR1: `[0, BAR1_MMAP_SIZE)`.
pub const BAR1_MMAP_SIZE: u64 = 4096;
/// MSI-X vectors.
pub const MSIX_VECTORS: u16 = 2;
/// MSI-X table offset in BAR0.
pub const MSIX_TABLE_OFFSET: u32 = 0x800;
/// MSI-X PBA offset in BAR0.
pub const MSIX_PBA_OFFSET: u32 = 0xc00;
/// Largest DMA transfer.
pub const MAX_DMA_LEN: u32 = 1 << 20;
/// Bytes moved per guest-memory call (server-to-client DMA messages stay small).
const DMA_CHUNK: usize = 64 << 10;

/// BAR0 register offsets and values (32-bit little-endian registers).
pub mod regs {
    /// ID (RO): [`ID_VALUE`].
    pub const ID: u64 = 0x00;
    /// SCRATCH (RW).
    pub const SCRATCH: u64 = 0x04;
    /// DMA_ADDR_LO (RW): guest address, low half.
    pub const DMA_ADDR_LO: u64 = 0x08;
    /// DMA_ADDR_HI (RW): guest address, high half.
    pub const DMA_ADDR_HI: u64 = 0x0c;
    /// DMA_LEN (RW): bytes, at most [`super::MAX_DMA_LEN`].
    pub const DMA_LEN: u64 = 0x10;
    /// DMA_PATTERN (RW): the fill byte is the low byte.
    pub const DMA_PATTERN: u64 = 0x14;
    /// DMA_CMD (WO): [`CMD_FILL`] or [`CMD_CHECKSUM`].
    pub const DMA_CMD: u64 = 0x18;
    /// DMA_STATUS (RO): [`STATUS_IDLE`], [`STATUS_BUSY`], [`STATUS_DONE`], [`STATUS_ERROR`].
    pub const DMA_STATUS: u64 = 0x1c;
    /// DMA_RESULT (RO): the checksum, or the errno of a failed command.
    pub const DMA_RESULT: u64 = 0x20;
    /// IRQ_RAISE (WO): any write raises the device interrupt.
    pub const IRQ_RAISE: u64 = 0x24;
    /// IRQ_COUNT (RO): interrupts raised since reset.
    pub const IRQ_COUNT: u64 = 0x28;
    /// ISR (RO, read-to-clear): 1 if the device interrupt is asserted; reading deasserts.
    pub const ISR: u64 = 0x2c;

    /// The value of [`ID`]: "udev" in ASCII, read as a 32-bit number.
    pub const ID_VALUE: u32 = 0x7564_6576;
    /// DMA_CMD: fill `[addr, addr + len)` with the pattern byte.
    pub const CMD_FILL: u32 = 1;
    /// DMA_CMD: sum the bytes of `[addr, addr + len)` (mod 2^32) into DMA_RESULT.
    pub const CMD_CHECKSUM: u32 = 2;
    /// DMA_STATUS: no command has run since reset.
    pub const STATUS_IDLE: u32 = 0;
    /// DMA_STATUS: a command is running.
    pub const STATUS_BUSY: u32 = 1;
    /// DMA_STATUS: the last command completed.
    pub const STATUS_DONE: u32 = 2;
    /// DMA_STATUS: the last command failed; DMA_RESULT holds the errno.
    pub const STATUS_ERROR: u32 = 3;

    /// BAR2 (I/O): SCRATCH (RW).
    pub const IO_SCRATCH: u64 = 0x0;
    /// BAR2 (I/O): ID (RO), [`ID_VALUE`].
    pub const IO_ID: u64 = 0x4;
}

use regs::*;

/// Why a testdev could not be created.
#[derive(Debug, Error)]
pub enum TestDevError {
    /// BAR1's memfd could not be created or sized.
    #[error("creating BAR1's memfd: {0}")]
    Memfd(#[source] std::io::Error),
    /// The PCI declaration was refused.
    #[error(transparent)]
    Pci(#[from] PciDeviceError),
}

/// The testdev config space: IDs, BARs, interrupt pin A, PM, MSI and MSI-X.
pub fn config() -> ConfigSpaceBuilder {
    let ids = PciIds {
        vendor_id: VENDOR_ID,
        device_id: DEVICE_ID,
        subsystem_vendor_id: VENDOR_ID,
        subsystem_id: DEVICE_ID,
        revision: 1,
        class: ClassCode { base: 0xff, sub: 0, prog_if: 0 },
    };
    ConfigSpaceBuilder::new(ids)
        .bar(0, Bar::mem32(BAR0_SIZE))
        .bar(1, Bar::mem32(BAR1_SIZE))
        .bar(2, Bar::io(BAR2_SIZE))
        .interrupt_pin(1)
        .power_management()
        .msi(MsiCap { vectors: 1, per_vector_mask: false, addr64: true })
        .msix(MsixCap {
            vectors: MSIX_VECTORS,
            table_bar: 0,
            table_offset: MSIX_TABLE_OFFSET,
            pba_bar: 0,
            pba_offset: MSIX_PBA_OFFSET,
        })
}

/// A new testdev, ready to attach.
pub fn create() -> Result<PciDevice<TestDev>, TestDevError> {
    let bar1 = bar1_memfd().map_err(TestDevError::Memfd)?;
    Ok(PciDevice::new(config(), move |host| TestDev::new(host, bar1))?)
}

/// BAR1's memory, which the client maps: sealed, and a new one for each client.
fn bar1_memfd() -> std::io::Result<Arc<OwnedFd>> {
    #[cfg(test)]
    if tests::NO_FDS.get() {
        return Err(std::io::Error::from_raw_os_error(libc::EMFILE));
    }
    umdev_mdev::region_memfd(c"umdev-testdev-bar1", BAR1_SIZE).map(|f| Arc::new(OwnedFd::from(f)))
}

/// How long dropping the device waits for its worker to end.
const STOP_WAIT: Duration = Duration::from_secs(5);

/// One DMA command for the worker, and how it ends.
#[derive(Debug)]
struct Job {
    inner: Arc<Inner>,
    cmd: u32,
    addr: u64,
    len: u32,
    pattern: u8,
    generation: u64,
}

impl Completion for Job {
    type Outcome = Result<u32, i32>;
    type Shared = ();

    fn complete(self, outcome: Result<u32, i32>, _ctx: &umdev_mdev::DeviceContext, (): &()) {
        // Reset meanwhile: the registers are no longer this job's. Looked at before taking
        // their lock too: a stale job the worker never took ends when a new command replaces
        // it, under that lock.
        let stale = || self.inner.generation.load(Ordering::Acquire) != self.generation;
        if stale() {
            return;
        }
        let mut regs = self.inner.regs();
        if stale() {
            return;
        }
        if let Err(errno) = outcome {
            log::debug!(
                "testdev: DMA {} at {:#x}+{:#x} failed: errno {errno}",
                self.cmd,
                self.addr,
                self.len
            );
        }
        self.inner.complete(&mut regs, outcome);
    }

    /// The device failed internally (the command's handling panicked): EIO.
    fn fail(self, ctx: &umdev_mdev::DeviceContext, (): &()) {
        self.complete(Err(libc::EIO), ctx, &());
    }
}

/// The BAR0 and BAR2 registers.
#[derive(Debug, Default)]
struct Regs {
    scratch: u32,
    dma_addr: u64,
    dma_len: u32,
    pattern: u32,
    status: u32,
    result: u32,
    irq_count: u32,
    isr: u32,
    io_scratch: u32,
}

/// BAR0 and BAR2's register maps (docs/testdev.md): 32-bit registers; BAR0 takes accesses
/// of 1, 2, 4 or 8 bytes at any offset (an 8-byte one covers two registers, lowest first),
/// BAR2 of 1, 2 or 4; offsets with no register read 0 and ignore writes.
#[derive(Debug)]
struct Maps {
    bar0: RegMap<u64>,
    bar2: RegMap<u64>,
}

impl Maps {
    fn new() -> Maps {
        let bar0 = [
            Reg::ro(ID, ID),
            Reg::rw(SCRATCH, SCRATCH),
            Reg::rw(DMA_ADDR_LO, DMA_ADDR_LO),
            Reg::rw(DMA_ADDR_HI, DMA_ADDR_HI),
            Reg::rw(DMA_LEN, DMA_LEN),
            Reg::rw(DMA_PATTERN, DMA_PATTERN),
            Reg::wo(DMA_CMD, DMA_CMD),
            Reg::ro(DMA_STATUS, DMA_STATUS),
            Reg::ro(DMA_RESULT, DMA_RESULT),
            Reg::wo(IRQ_RAISE, IRQ_RAISE),
            Reg::ro(IRQ_COUNT, IRQ_COUNT),
            Reg::ro(ISR, ISR),
        ];
        let bar2 = [Reg::rw(IO_SCRATCH, IO_SCRATCH), Reg::ro(IO_ID, IO_ID)];
        Maps {
            // The whole BAR: accesses to the MSI-X table and PBA are the framework's and never reach here.
            bar0: RegMap::builder(0, BAR0_SIZE)
                .widths(&[1, 2, 4, 8])
                .unaligned()
                .build(&bar0)
                .expect("a valid map"),
            bar2: RegMap::builder(2, BAR2_SIZE)
                .widths(&[1, 2, 4])
                .unaligned()
                .build(&bar2)
                .expect("a valid map"),
        }
    }
}

/// State shared with the worker.
#[derive(Debug)]
struct Inner {
    regs: Mutex<Regs>,
    irq: IrqHandle,
    /// Bumped (under the regs lock) by reset, detach and drop: a job of an older generation
    /// leaves the registers alone.
    generation: AtomicU64,
    /// The command the worker is to run next.
    next: Mutex<Option<Permit<Job>>>,
}

/// Why the worker stops: the device is going.
#[derive(Clone, Copy, Debug)]
struct Close;

/// The testdev function (serve it through [`PciDevice`]; see [`create`]).
#[derive(Debug)]
pub struct TestDev {
    inner: Arc<Inner>,
    maps: Maps,
    /// BAR1's memory: replaced at each detach, so that a client that left cannot reach the
    /// next one's. `None` after a detach that could not make new memory (no fd to spare):
    /// made at the next use, and until then BAR1 is refused (EIO) and offers no mmap, never
    /// the old client's memory.
    bar1: arc_swap::ArcSwapOption<OwnedFd>,
    /// The worker's requests.
    lane: Lane,
    worker: Option<Worker<Close>>,
}

impl TestDev {
    fn new(host: Host, bar1: Arc<OwnedFd>) -> Self {
        let inner = Arc::new(Inner {
            regs: Mutex::new(Regs::default()),
            irq: host.irq,
            generation: AtomicU64::new(0),
            next: Mutex::new(None),
        });
        let worker_inner = inner.clone();
        let worker = Worker::spawn("umdev-testdev-dma", Poll::NONE, move |w| worker(&worker_inner, w))
            .map_err(|e| log::error!("testdev: cannot start the DMA worker ({e}); DMA commands will fail"))
            .ok();
        let bell = worker.as_ref().map(Worker::bell);
        let lane = host.requests.lane(move || {
            if let Some(bell) = &bell {
                bell.ring();
            }
        });
        TestDev { inner, maps: Maps::new(), bar1: arc_swap::ArcSwapOption::from(Some(bar1)), lane, worker }
    }

    /// BAR1's memory, made now if the last detach could not make it.
    fn bar1(&self) -> Result<Arc<OwnedFd>, DeviceError> {
        if let Some(fd) = self.bar1.load_full() {
            return Ok(fd);
        }
        let fresh = bar1_memfd().map_err(|e| {
            log::debug!("testdev: still no BAR1 memory: {e}");
            DeviceError::Errno(libc::EIO)
        })?;
        // Another thread may have made one meanwhile: keep the first.
        let prev = self.bar1.compare_and_swap(&None::<Arc<OwnedFd>>, Some(fresh.clone()));
        Ok(match &*prev {
            Some(theirs) => theirs.clone(),
            None => fresh,
        })
    }

    fn bar0_read(&self, offset: u64, data: &mut [u8]) -> Result<(), DeviceError> {
        let mut regs = self.inner.regs();
        self.maps.bar0.read(offset, data, |hit| {
            u64::from(match hit.key {
                ID => ID_VALUE,
                SCRATCH => regs.scratch,
                DMA_ADDR_LO => regs.dma_addr as u32,
                DMA_ADDR_HI => (regs.dma_addr >> 32) as u32,
                DMA_LEN => regs.dma_len,
                DMA_PATTERN => regs.pattern,
                DMA_STATUS => regs.status,
                DMA_RESULT => regs.result,
                IRQ_COUNT => regs.irq_count,
                ISR => {
                    let isr = std::mem::take(&mut regs.isr);
                    self.inner.irq.intx_deassert();
                    isr
                }
                _ => 0, // the map asks only for readable registers
            })
        })
    }

    fn bar0_write(&self, offset: u64, data: &[u8]) -> Result<(), DeviceError> {
        let mut regs = self.inner.regs();
        self.maps.bar0.write(offset, data, |hit, value, mask| {
            let merge = |old: u32| merge(u64::from(old), value, mask) as u32;
            match hit.key {
                SCRATCH => regs.scratch = merge(regs.scratch),
                DMA_ADDR_LO => {
                    regs.dma_addr = (regs.dma_addr & !0xffff_ffff) | u64::from(merge(regs.dma_addr as u32))
                }
                DMA_ADDR_HI => {
                    let hi = merge((regs.dma_addr >> 32) as u32);
                    regs.dma_addr = (regs.dma_addr & 0xffff_ffff) | (u64::from(hi) << 32);
                }
                DMA_LEN => regs.dma_len = merge(regs.dma_len),
                DMA_PATTERN => regs.pattern = merge(regs.pattern),
                DMA_CMD => self.start_dma(&mut regs, value as u32),
                IRQ_RAISE => self.inner.raise(&mut regs),
                _ => {} // the map passes only writable registers
            }
        })
    }

    /// DMA_CMD: validates and queues a job; a refused command completes at once with an
    /// error status and an interrupt.
    fn start_dma(&self, regs: &mut Regs, cmd: u32) {
        if regs.status == STATUS_BUSY {
            log::debug!("testdev: DMA_CMD {cmd} while busy ignored");
            return;
        }
        let worker = match cmd {
            CMD_FILL | CMD_CHECKSUM if regs.dma_len > MAX_DMA_LEN => {
                return self.inner.complete(regs, Err(libc::EINVAL));
            }
            CMD_FILL | CMD_CHECKSUM => match &self.worker {
                Some(worker) => worker,
                None => return self.inner.complete(regs, Err(libc::EIO)),
            },
            _ => return self.inner.complete(regs, Err(libc::EINVAL)),
        };
        let job = Job {
            inner: self.inner.clone(),
            cmd,
            addr: regs.dma_addr,
            len: regs.dma_len,
            pattern: regs.pattern as u8,
            generation: self.inner.generation.load(Ordering::Acquire),
        };
        let mut permit = match self.lane.begin(job) {
            Ok(permit) => permit,
            // Not reported through the job: completed here, under the registers' lock the
            // caller holds.
            Err(_detached) => return self.inner.complete(regs, Err(libc::ENODEV)),
        };
        // An unmap of the command's range cancels it.
        permit.claim(regs.dma_addr, u64::from(regs.dma_len));
        regs.status = STATUS_BUSY;
        regs.result = 0;
        *umdev_pinning::sync::lock(&self.inner.next) = Some(permit);
        worker.wake();
    }

    fn bar1_read(&self, offset: u64, data: &mut [u8]) -> Result<(), DeviceError> {
        // The adapter checked the bounds: offset + len <= 8 KiB.
        let done = nix::sys::uio::pread(self.bar1()?.as_fd(), data, offset as libc::off_t);
        bar1_result(offset, done, data.len())
    }

    fn bar1_write(&self, offset: u64, data: &[u8]) -> Result<(), DeviceError> {
        let done = nix::sys::uio::pwrite(self.bar1()?.as_fd(), data, offset as libc::off_t);
        bar1_result(offset, done, data.len())
    }

    fn bar2_read(&self, offset: u64, data: &mut [u8]) -> Result<(), DeviceError> {
        let regs = self.inner.regs();
        self.maps.bar2.read(offset, data, |hit| {
            if hit.key == IO_SCRATCH {
                u64::from(regs.io_scratch)
            } else {
                u64::from(ID_VALUE)
            }
        })
    }

    fn bar2_write(&self, offset: u64, data: &[u8]) -> Result<(), DeviceError> {
        let mut regs = self.inner.regs();
        self.maps.bar2.write(offset, data, |_, value, mask| {
            regs.io_scratch = merge(u64::from(regs.io_scratch), value, mask) as u32;
            // IO_SCRATCH, the one writable
        })
    }

    /// Forgets the job in flight (the framework cancelled it) and clears the registers (and
    /// BAR1).
    fn clear(&self) {
        let mut regs = self.inner.regs();
        self.inner.generation.fetch_add(1, Ordering::AcqRel);
        *regs = Regs::default();
        self.inner.irq.intx_deassert();
        drop(regs);
        if let Err(e) = self.bar1_write(0, &[0u8; BAR1_SIZE as usize]) {
            log::warn!("testdev: clearing BAR1: {e}");
        }
    }
}

impl Inner {
    fn regs(&self) -> MutexGuard<'_, Regs> {
        // Registers are plain values, consistent after a panic of a holder.
        umdev_pinning::sync::lock(&self.regs)
    }

    /// Raises the device interrupt: ISR and IRQ_COUNT, then MSI-X vector 0, MSI or INTx.
    fn raise(&self, regs: &mut Regs) {
        regs.isr = 1;
        regs.irq_count = regs.irq_count.wrapping_add(1);
        let delivery = self.irq.raise(0);
        log::trace!("testdev: interrupt {delivery:?}");
    }

    /// Ends the current command: status, result, and the interrupt.
    fn complete(&self, regs: &mut Regs, outcome: Result<u32, i32>) {
        (regs.status, regs.result) = match outcome {
            Ok(sum) => (STATUS_DONE, sum),
            Err(errno) => (STATUS_ERROR, errno as u32),
        };
        self.raise(regs);
    }
}

impl Drop for TestDev {
    fn drop(&mut self) {
        self.inner.generation.fetch_add(1, Ordering::AcqRel);
        // A command the worker never took holds the shared state: it ends here (and leaves
        // the registers alone: its generation is gone).
        drop(umdev_pinning::sync::lock(&self.inner.next).take());
        if let Some(worker) = self.worker.take() {
            worker.stop(Close);
            if let Err(e) = worker.join(STOP_WAIT) {
                log::error!("testdev: {e}");
            }
        }
    }
}

/// The DMA worker: runs each command put in `inner.next`, until the device goes.
fn worker(inner: &Inner, mut w: Waiter<Close>) {
    // The worker's one bounce buffer, for every job.
    let mut buf = vec![0u8; DMA_CHUNK];
    loop {
        let next = umdev_pinning::sync::lock(&inner.next).take();
        if let Some(permit) = next {
            match request::serve("a testdev DMA command", || run(&permit, &mut buf)) {
                Some(outcome) => permit.complete(outcome),
                None => drop(permit), // fails it: EIO
            }
            continue;
        }
        if let Wake::Stop(Close) = w.wait(|| false, None) {
            return;
        }
    }
}

/// Runs one job chunk by chunk through `buf` ([`DMA_CHUNK`] bytes); the checksum (0 for a
/// fill) or an errno.
fn run(permit: &Permit<Job>, buf: &mut [u8]) -> Result<u32, i32> {
    let (job, ctx) = (permit.get(), permit.ctx());
    let len = job.len as usize;
    if job.cmd == CMD_FILL {
        buf[..len.min(DMA_CHUNK)].fill(job.pattern);
    }
    let mut sum = 0u32;
    let mut done = 0usize;
    while done < len {
        if permit.cancelled().is_some() {
            return Err(libc::ECANCELED);
        }
        let n = (len - done).min(DMA_CHUNK);
        let iova = job.addr.checked_add(done as u64).ok_or(libc::EFAULT)?;
        if job.cmd == CMD_FILL {
            ctx.write_either(iova, &buf[..n]).map_err(|e| guest_errno(&e))?;
        } else {
            ctx.read_either(iova, &mut buf[..n]).map_err(|e| guest_errno(&e))?;
            sum = buf[..n].iter().fold(sum, |s, &b| s.wrapping_add(u32::from(b)));
        }
        done += n;
    }
    Ok(sum)
}

/// A memfd transfer of `want` bytes at `offset` in BAR1: complete, or EIO.
fn bar1_result(offset: u64, done: nix::Result<usize>, want: usize) -> Result<(), DeviceError> {
    match done {
        Ok(n) if n == want => Ok(()),
        Ok(n) => {
            log::warn!("testdev: BAR1 memfd access at {offset:#x}: {n} of {want} bytes");
            Err(DeviceError::Errno(libc::EIO))
        }
        Err(e) => {
            log::warn!("testdev: BAR1 memfd access at {offset:#x}: {e}");
            Err(DeviceError::Errno(libc::EIO))
        }
    }
}

fn guest_errno(e: &GuestError) -> i32 {
    match e {
        GuestError::NotMapped { .. } | GuestError::Truncated { .. } => libc::EFAULT,
        GuestError::Pin(p) => p.errno(),
        GuestError::Permission { .. } => libc::EPERM,
        GuestError::NoHostMemory { .. } => libc::EFAULT,
        GuestError::BusMasterOff => libc::EACCES,
        GuestError::Client(ClientDmaError::Refused(errno)) => *errno,
        GuestError::Client(ClientDmaError::Disconnected(_)) => libc::ENOTCONN,
        GuestError::Client(ClientDmaError::WouldDeadlock) => libc::EDEADLK,
        GuestError::Client(ClientDmaError::BadReply) => libc::EIO,
        GuestError::Client(ClientDmaError::Withdrawn) => libc::ECANCELED,
    }
}

impl PciFunction for TestDev {
    fn bar_read(&self, bar: u8, offset: u64, data: &mut [u8]) -> Result<(), DeviceError> {
        match bar {
            0 => self.bar0_read(offset, data),
            1 => self.bar1_read(offset, data),
            2 => self.bar2_read(offset, data),
            _ => Err(DeviceError::NoSuchRegion(u32::from(bar))),
        }
    }

    fn bar_write(&self, bar: u8, offset: u64, data: &[u8]) -> Result<(), DeviceError> {
        match bar {
            0 => self.bar0_write(offset, data),
            1 => self.bar1_write(offset, data),
            2 => self.bar2_write(offset, data),
            _ => Err(DeviceError::NoSuchRegion(u32::from(bar))),
        }
    }

    fn bar_mmap(&self, bar: u8) -> Option<RegionMmap> {
        let fd = self.bar1().ok().filter(|_| bar == 1)?;
        Some(RegionMmap { fd, offset: 0, areas: vec![SparseArea { offset: 0, size: BAR1_MMAP_SIZE }] })
    }

    fn reset(&self) {
        self.clear();
    }

    fn detach(&self) {
        let fresh = bar1_memfd();
        if let Err(e) = &fresh {
            log::error!(
                "testdev: no new BAR1 memory for the next client ({e}); BAR1 fails until it can be made"
            );
        }
        self.bar1.store(fresh.ok());
    }
}

#[cfg(test)]
mod tests;

/// The `testdev` device type: capacity 64 instances.
#[derive(Debug)]
pub struct TestDevType {
    pool: std::sync::Arc<umdev_mdev::types::Pool>,
}

impl TestDevType {
    /// A type allowing `capacity` instances at once.
    pub fn new(capacity: u32) -> TestDevType {
        TestDevType { pool: umdev_mdev::types::Pool::new(capacity) }
    }
}

impl umdev_mdev::types::DeviceType for TestDevType {
    fn name(&self) -> &str {
        TYPE_NAME
    }
    fn description(&self) -> &str {
        "test device: registers, DMA through pins or the client, INTx/MSI/MSI-X, sparse-mmap BAR"
    }
    fn available_instances(&self) -> u32 {
        self.pool.free()
    }
    fn create(
        &self,
        options: &umdev_mdev::types::InstanceOptions,
    ) -> Result<std::sync::Arc<dyn umdev_mdev::VfioDevice>, umdev_mdev::types::TypeError> {
        self.check(options)?;
        self.pool.instance(self.name(), 1, create)
    }
}
