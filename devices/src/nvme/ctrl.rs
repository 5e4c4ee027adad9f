//! The controller (NVMe 1.3 §3.1, §7.6): registers, enable and disable, doorbells,
//! interrupts, the queue table, asynchronous event delivery, and what a DMA unmap does to
//! the rings.
//!
//! Threads: the connection thread writes registers and doorbells; one worker per
//! submission queue (the admin queue's included) fetches, executes and completes its
//! commands. Enable starts the admin worker; Create I/O SQ starts the others; Delete, a
//! disable (CC.EN 1 -> 0), a reset and a detach stop and join them. The controller does not
//! know what a worker runs: it starts them through the [`Spawn`] function it was made with
//! (the module graph in [`super`] says why).

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicU8, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use thiserror::Error;

use super::namespace::Namespace;
use super::queue::{Cq, Doorbell, DoorbellPage, PostError, ShadowDoorbells, Sq, EVENT_NEVER};
use super::spec::{event, log_page, reg, Cqe, Status};
use super::state::AdminState;
use super::stats::QueueStats;
use umdev_mdev::irq::{IrqHandle, IrqMode};
use umdev_mdev::log_budget::LogBudget;
use umdev_mdev::pci::Host;
use umdev_mdev::request::Requests;
use umdev_mdev::worker::{Bell, Worker};
use umdev_mdev::DeviceContext;

/// How long a disable waits for workers to finish the command they are on.
const STOP_WAIT: Duration = Duration::from_secs(5);

/// How the guest's doorbell writes reach the workers, for the connected client.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DoorbellMode {
    /// As REGION_WRITE messages (posted by QEMU): a write wakes the worker.
    Message,
    /// Through a page the client maps (into a guest, or its own process): workers poll it.
    Mapped,
}

/// The `doorbells` option: a [`DoorbellMode`] for every client, or one chosen per client.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Doorbells {
    /// Per connection, from the client's VERSION: a client that announces capabilities (a
    /// VMM: QEMU, rust-vmm's client) gets messages; one that announces none (a user-space
    /// driver that polls, such as SPDK's initiator) gets the mapped page.
    Auto,
    /// Messages for every client.
    Message,
    /// The mapped page for every client.
    Mapped,
}

impl Doorbells {
    /// The option's spelling.
    pub fn name(self) -> &'static str {
        match self {
            Doorbells::Auto => "auto",
            Doorbells::Message => "message",
            Doorbells::Mapped => "mmap",
        }
    }
}

/// How a controller moves file namespaces' data (the `aio` option).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum AioMode {
    /// Through an io_uring per I/O queue: many commands in flight per queue, completed as the
    /// host finishes them (where io_uring cannot be had, as [`AioMode::Sync`], logged).
    #[default]
    IoUring,
    /// One synchronous `preadv2`/`pwritev2` per command on the queue's worker, in order.
    Sync,
}

impl AioMode {
    /// The option's spelling.
    pub fn name(self) -> &'static str {
        match self {
            AioMode::IoUring => "io_uring",
            AioMode::Sync => "sync",
        }
    }
}

/// Which O_DIRECT transfers move through the kernel's pins as fixed buffers in kernel pin
/// mode (the `fixed_buffers` option).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum FixedBuffers {
    /// None.
    Off,
    /// Those of at least [`FixedBuffers::MIN_BYTES`]: below, the buffer's clone into the
    /// queue's ring (two `io_uring_register` calls) costs more than the page pins it saves.
    #[default]
    On,
    /// Every one whose memory is one run (for measuring the trade-off).
    Always,
}

impl FixedBuffers {
    /// `on`'s smallest transfer. nvmebench `--fixed-buffers` (docs/benchmarks.md): with
    /// every transfer fixed, a 4 KiB one costs the server 1.1-2.5 us more CPU per I/O (the
    /// clone and clear against one page pin); from 64 KiB the two are even within this
    /// machine's noise.
    pub const MIN_BYTES: usize = 64 << 10;

    /// The option's spelling.
    pub fn name(self) -> &'static str {
        match self {
            FixedBuffers::Off => "off",
            FixedBuffers::On => "on",
            FixedBuffers::Always => "always",
        }
    }

    /// Whether a transfer of `bytes` moves through a fixed buffer (when it can).
    pub fn wants(self, bytes: usize) -> bool {
        match self {
            FixedBuffers::Off => false,
            FixedBuffers::On => bytes >= Self::MIN_BYTES,
            FixedBuffers::Always => true,
        }
    }
}

/// What a controller is built with.
#[derive(Debug)]
pub struct ControllerConfig {
    /// Namespaces by NSID - 1 (`None`: inactive).
    pub namespaces: Vec<Option<Namespace>>,
    /// I/O queue pairs offered (Number of Queues).
    pub io_queues: u16,
    /// Entries per queue at most (CAP.MQES + 1).
    pub max_entries: u32,
    /// How doorbells arrive.
    pub doorbells: Doorbells,
    /// The serial number (Identify SN).
    pub serial: String,
    /// How long a worker watches its message doorbell after a lone command before it
    /// sleeps (0: it sleeps at once).
    pub poll: Duration,
    /// How file namespaces' data moves ([`AioMode::IoUring`] only if the host has io_uring
    /// and a namespace is a file).
    pub aio: AioMode,
    /// In kernel pin mode, which O_DIRECT transfers move through the pinned runs as fixed
    /// buffers.
    pub fixed_buffers: FixedBuffers,
    /// How much a backing that does not answer may hold before the namespace's new commands
    /// fail at once (Namespace Not Ready): transfers its stopped queues left in the kernel,
    /// per namespace, and queue workers left blocked in a synchronous call to it, per
    /// controller.
    pub max_held: usize,
}

/// Why a queue's worker stops: the one reason, given to its [`Worker`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Stop {
    /// Delete I/O SQ (§5.6): commands left in the queue complete as aborted.
    Delete,
    /// A disable, a reset or a detach: nothing more is posted.
    Reset,
}

/// Why CC.EN 0 -> 1 was refused (the controller then reports CSTS.CFS).
#[derive(Debug, Error)]
pub enum EnableError {
    /// CC names a command set, page size or arbitration the controller does not have.
    #[error("CC.CSS {css}, MPS {mps}, AMS {ams}: only NVM, 4 KiB pages, round robin")]
    Config {
        /// CC.CSS.
        css: u32,
        /// CC.MPS.
        mps: u32,
        /// CC.AMS.
        ams: u32,
    },
    /// AQA sizes an admin queue of fewer than 2 entries (its 12-bit fields allow 4096 at
    /// most; MQES bounds the I/O queues only, NVMe 1.3 §3.1.8).
    #[error("AQA {aqa:#x}: admin queues of 2 to 4096 entries")]
    AdminQueues {
        /// AQA as written.
        aqa: u32,
    },
    /// No client is attached: there is no guest memory to serve.
    #[error("no client attached")]
    NoClient,
    /// The admin queue's worker could not start.
    #[error("starting a queue worker: {0}")]
    Spawn(#[from] std::io::Error),
}

/// Starts a queue's worker: `(controller, queue, its lane, its bell, the running count
/// guard, the generation)`. The controller is made with one ([`Ctrl::new`]).
pub type Spawn = fn(&Arc<Ctrl>, Arc<Sq>, &Bell, Running, u64) -> std::io::Result<Worker<Stop>>;

/// The controller registers the guest writes.
#[derive(Debug, Default)]
struct Registers {
    csts: u32,
    aqa: u32,
    asq: u64,
    acq: u64,
}

/// A live submission queue and its worker.
#[derive(Debug)]
pub(crate) struct SqEntry {
    pub(crate) sq: Arc<Sq>,
    worker: Worker<Stop>,
    /// Shared with the worker's [`Running`].
    life: Arc<AtomicU8>,
}

impl SqEntry {
    /// Tells the queue's worker to stop for `why` (the first reason given stays).
    pub(crate) fn stop(&self, why: Stop) {
        self.worker.stop(why);
    }

    /// Waits for the worker to end, at most `bound`; one that does not is counted as left
    /// behind until it ends. Whether it ended.
    fn join(self, bound: Duration, held: &Held, max_held: usize, after: &str) -> bool {
        let joined = self.worker.join(bound);
        if let Err(e) = joined {
            log::warn!("nvme: {e}{after}");
            if self.life.compare_exchange(ALIVE, LEFT, Ordering::AcqRel, Ordering::Acquire).is_ok() {
                let now = held.workers.fetch_add(1, Ordering::AcqRel) + 1;
                if now >= max_held {
                    log::warn!(
                        "nvme: {now} queue worker(s) left blocked in a backing (max_held {max_held}): new \
                         commands to file namespaces fail with Namespace Not Ready until it answers"
                    );
                }
            }
            return false;
        }
        true
    }
}

/// A queue worker's life, as its [`SqEntry`] and its [`Running`] see it.
const ALIVE: u8 = 0;
/// Not joined in time: counted in [`Held::workers`] until it ends.
const LEFT: u8 = 1;
const ENDED: u8 = 2;

/// What a backing that does not answer holds ([`ControllerConfig::max_held`]).
#[derive(Debug)]
pub(crate) struct Held {
    /// Per namespace (NSID - 1): transfers of stopped queues still in the kernel.
    transfers: Box<[AtomicUsize]>,
    /// Queue workers that did not end when stopped (blocked in a synchronous transfer).
    workers: AtomicUsize,
}

impl Held {
    /// Namespace `nsid`'s count of transfers, if it has one.
    pub(crate) fn transfers_of(&self, nsid: u32) -> Option<&AtomicUsize> {
        self.transfers.get(nsid.wrapping_sub(1) as usize)
    }
}

/// The live queues, by identifier.
#[derive(Debug)]
pub(crate) struct Queues {
    pub(crate) sqs: Vec<Option<SqEntry>>,
    pub(crate) cqs: Vec<Option<Arc<Cq>>>,
}

/// The controller.
#[derive(Debug)]
pub struct Ctrl {
    irq: IrqHandle,
    config: ControllerConfig,
    /// What a guest's register writes get wrong, logged within a budget.
    log: LogBudget,
    regs: Mutex<Registers>,
    /// CC as last written (read back exactly).
    cc: AtomicU32,
    /// INTMS (interrupt vectors masked, INTx and MSI only).
    intms: AtomicU32,
    /// Doorbells, by queue identifier.
    sq_doorbells: Box<[Doorbell]>,
    /// CQ head doorbells, by queue identifier.
    cq_doorbells: Box<[Doorbell]>,
    /// The mappable doorbell page (`doorbells=mmap` and `auto`).
    page: Option<DoorbellPage>,
    /// The connected client maps the page ([`DoorbellMode::Mapped`]); chosen at its VERSION,
    /// while the controller is disabled.
    mapped: AtomicBool,
    /// A client has said hello (and so, with `doorbells=auto`, had its mode chosen).
    greeted: AtomicBool,
    /// Doorbell Buffer Config's pages while it is on (I/O queues only: the admin queue always
    /// uses its registers).
    shadow: arc_swap::ArcSwapOption<ShadowDoorbells>,
    /// Set while `shadow` holds pages: the doorbell reads of a controller without them (most
    /// clients) cost one load, not an `ArcSwap` guard each.
    shadowing: AtomicBool,
    /// Doorbell Buffer Config commands that succeeded.
    shadow_configs: AtomicU64,
    queues: Mutex<Queues>,
    /// Features, asynchronous events, the error log. Lock order: before `queues`.
    admin: Mutex<AdminState>,
    /// Per-queue statistics, by queue identifier (kept across resets).
    stats: Box<[QueueStats]>,
    /// Bumped by every disable: work of an older generation posts nothing.
    generation: AtomicU64,
    /// CSTS.CFS: the controller stopped processing until a reset.
    fatal: AtomicBool,
    /// Volatile write cache enabled (Set Features 06h), read on every write.
    write_cache: AtomicBool,
    /// The framework's tracker of the commands, which holds the client's context.
    pub(crate) requests: Requests,
    spawn: Spawn,
    /// Queue workers alive.
    running: Arc<AtomicUsize>,
    /// What backings that do not answer hold.
    held: Arc<Held>,
    /// When the controller was made (SMART power-on hours).
    born: Instant,
    /// Resets without a shutdown notification (SMART).
    unsafe_shutdowns: AtomicU64,
    /// Doorbell writes that arrived as REGION_WRITE messages (with the doorbell page mapped
    /// into the guest, there should be none).
    doorbell_messages: AtomicU64,
    /// The admin SQ tail in the mapped page that an I/O queue's worker last woke the admin
    /// queue's worker for ([`Ctrl::nudge_admin`]), and how many times it did.
    admin_nudged: AtomicU32,
    admin_nudges: AtomicU64,
}

impl Ctrl {
    /// A disabled controller whose queue workers `spawn` starts.
    pub fn new(host: Host, config: ControllerConfig, page: Option<DoorbellPage>, spawn: Spawn) -> Ctrl {
        let slots = usize::from(config.io_queues) + 1;
        Ctrl {
            irq: host.irq,
            log: LogBudget::new(module_path!()),
            regs: Mutex::new(Registers::default()),
            cc: AtomicU32::new(0),
            intms: AtomicU32::new(0),
            sq_doorbells: (0..slots).map(|_| Doorbell::default()).collect(),
            cq_doorbells: (0..slots).map(|_| Doorbell::default()).collect(),
            mapped: AtomicBool::new(config.doorbells == Doorbells::Mapped),
            greeted: AtomicBool::new(false),
            shadow: arc_swap::ArcSwapOption::empty(),
            shadowing: AtomicBool::new(false),
            shadow_configs: AtomicU64::new(0),
            page,
            queues: Mutex::new(Queues {
                sqs: (0..slots).map(|_| None).collect(),
                cqs: (0..slots).map(|_| None).collect(),
            }),
            admin: Mutex::new(AdminState::new(config.io_queues)),
            stats: (0..slots).map(|_| QueueStats::default()).collect(),
            generation: AtomicU64::new(0),
            fatal: AtomicBool::new(false),
            write_cache: AtomicBool::new(true),
            requests: host.requests,
            spawn,
            running: Arc::new(AtomicUsize::new(0)),
            held: Arc::new(Held {
                transfers: config.namespaces.iter().map(|_| AtomicUsize::new(0)).collect(),
                workers: AtomicUsize::new(0),
            }),
            born: Instant::now(),
            unsafe_shutdowns: AtomicU64::new(0),
            doorbell_messages: AtomicU64::new(0),
            admin_nudged: AtomicU32::new(0),
            admin_nudges: AtomicU64::new(0),
            config,
        }
    }

    fn regs(&self) -> MutexGuard<'_, Registers> {
        umdev_mdev::sync::lock(&self.regs)
    }

    /// The live queues.
    pub(crate) fn queues(&self) -> MutexGuard<'_, Queues> {
        umdev_mdev::sync::lock(&self.queues)
    }

    /// Features and events (lock order: before [`Ctrl::queues`]).
    pub(crate) fn admin(&self) -> MutexGuard<'_, AdminState> {
        umdev_mdev::sync::lock(&self.admin)
    }

    /// How the controller was built.
    pub fn config(&self) -> &ControllerConfig {
        &self.config
    }

    /// I/O queue pairs offered.
    pub fn io_queues(&self) -> u16 {
        self.config.io_queues
    }

    /// Interrupts.
    pub(crate) fn irq(&self) -> &IrqHandle {
        &self.irq
    }

    /// Queue `qid`'s statistics (the admin queue is 0).
    pub(crate) fn stats(&self, qid: u16) -> &QueueStats {
        &self.stats[usize::from(qid)]
    }

    /// Every queue's statistics, by queue identifier.
    pub(crate) fn all_stats(&self) -> &[QueueStats] {
        &self.stats
    }

    /// CC as last written.
    pub(crate) fn cc(&self) -> u32 {
        self.cc.load(Ordering::Acquire)
    }

    /// The current generation (bumped by every disable).
    pub(crate) fn generation(&self) -> u64 {
        self.generation.load(Ordering::Acquire)
    }

    /// Whether the volatile write cache is enabled.
    pub(crate) fn write_cache(&self) -> bool {
        self.write_cache.load(Ordering::Acquire)
    }

    /// Sets the volatile write cache (Set Features 06h). Turned off, what it held is made
    /// durable first: a host that turns it off sends no more Flushes for the writes before.
    /// A flush that fails is logged, and the store fails every later durable write.
    pub(crate) fn set_write_cache(&self, on: bool) {
        if !self.write_cache.swap(on, Ordering::AcqRel) || on {
            return;
        }
        for ns in self.namespaces() {
            if let Err(e) = ns.store().flush() {
                ns.warn(format_args!("nvme: ns{}: flush as the write cache was turned off: {e}", ns.id()));
            }
        }
    }

    /// When the controller was made.
    pub(crate) fn born(&self) -> Instant {
        self.born
    }

    /// Resets without a shutdown notification.
    pub(crate) fn unsafe_shutdowns(&self) -> u64 {
        self.unsafe_shutdowns.load(Ordering::Relaxed)
    }

    /// Doorbell writes that arrived as messages.
    pub fn doorbell_messages(&self) -> u64 {
        self.doorbell_messages.load(Ordering::Relaxed)
    }

    /// With the doorbell page mapped, nothing rings the admin queue's worker: the client stores
    /// the admin SQ tail into the page. An I/O queue's worker watching the page calls this at
    /// each look: it wakes the admin worker once per new admin tail, so a command reaches an
    /// admin queue that is idle when the I/O queues are without waiting for the admin worker's
    /// own look, which can then be rare (each look of its own takes the CPU from a busy I/O
    /// queue's worker, and that showed in the I/O tail latency).
    pub(crate) fn nudge_admin(&self) {
        let Some(page) = self.mapped_page() else { return };
        let tail = page.load(0);
        if tail != self.admin_nudged.load(Ordering::Relaxed)
            && self.admin_nudged.swap(tail, Ordering::Relaxed) != tail
        {
            self.admin_nudges.fetch_add(1, Ordering::Relaxed);
            self.sq_doorbells[0].wake();
        }
    }

    /// Times an I/O queue's worker woke the admin queue's worker ([`Ctrl::nudge_admin`]).
    pub fn admin_nudges(&self) -> u64 {
        self.admin_nudges.load(Ordering::Relaxed)
    }

    /// How doorbells reach the workers for the connected (or last) client; `None` while no
    /// client has said which with `doorbells=auto`.
    pub fn chosen_doorbell_mode(&self) -> Option<DoorbellMode> {
        let chosen = self.config.doorbells != Doorbells::Auto || self.greeted.load(Ordering::Acquire);
        chosen.then(|| self.doorbell_mode())
    }

    /// How doorbells reach the workers for the connected client.
    pub fn doorbell_mode(&self) -> DoorbellMode {
        if self.mapped.load(Ordering::Acquire) {
            DoorbellMode::Mapped
        } else {
            DoorbellMode::Message
        }
    }

    /// A client connected and said `hello`: with `doorbells=auto`, its doorbell mode is
    /// chosen (and logged); with `doorbells=message`, a client that looks like a polling
    /// driver is told, in the log, why it will find no doorbell page.
    pub fn client_version(&self, hello: &umdev_mdev::ClientHello) {
        let mode = match (self.config.doorbells, hello.capabilities) {
            (Doorbells::Auto, true) => {
                log::info!(
                    "nvme: doorbells=auto: the client announced VERSION capabilities (a VMM): doorbells as \
                     messages (--opt doorbells=mmap maps the doorbell page for every client)"
                );
                DoorbellMode::Message
            }
            (Doorbells::Auto, false) => {
                log::info!(
                    "nvme: doorbells=auto: the client announced no VERSION capabilities (a polling driver such \
                     as SPDK's nvme_vfio_user): the doorbell page at BAR0 0x1000 is mappable \
                     (--opt doorbells=message refuses it to every client)"
                );
                DoorbellMode::Mapped
            }
            (Doorbells::Message, false) => {
                log::warn!(
                    "nvme: the client announced no VERSION capabilities, as SPDK's nvme_vfio_user does: such a \
                     driver needs a mappable doorbell page, which doorbells=message does not offer; use --opt \
                     doorbells=auto (the default) or doorbells=mmap"
                );
                DoorbellMode::Message
            }
            (Doorbells::Message, true) => DoorbellMode::Message,
            (Doorbells::Mapped, _) => DoorbellMode::Mapped,
        };
        self.mapped.store(mode == DoorbellMode::Mapped, Ordering::Release);
        self.greeted.store(true, Ordering::Release);
    }

    /// CAP (§3.1.1).
    pub fn cap(&self) -> u64 {
        let mqes = u64::from(self.config.max_entries - 1);
        let cqr = 1 << 16;
        let to = 10 << 24; // 5 s: a disable waits up to STOP_WAIT for a worker
        let css_nvm = 1 << 37;
        mqes | cqr | to | css_nvm
    }

    /// A register read (the 32-bit register at `offset`; 64-bit ones as two halves; §3.1).
    pub fn read_register(&self, offset: u64) -> u32 {
        let regs = self.regs();
        match offset {
            reg::CAP => self.cap() as u32,
            o if o == reg::CAP + 4 => (self.cap() >> 32) as u32,
            reg::VS => reg::VERSION_1_3,
            reg::INTMS | reg::INTMC => self.intms.load(Ordering::Acquire),
            reg::CC => self.cc.load(Ordering::Acquire),
            reg::CSTS => regs.csts | if self.fatal.load(Ordering::Acquire) { reg::CSTS_CFS } else { 0 },
            reg::AQA => regs.aqa,
            reg::ASQ => regs.asq as u32,
            o if o == reg::ASQ + 4 => (regs.asq >> 32) as u32,
            reg::ACQ => regs.acq as u32,
            o if o == reg::ACQ + 4 => (regs.acq >> 32) as u32,
            _ => 0,
        }
    }

    /// A register write (§3.1).
    pub fn write_register(self: &Arc<Self>, offset: u64, value: u32) {
        match offset {
            reg::INTMS => self.mask_vectors(value, true),
            reg::INTMC => self.mask_vectors(value, false),
            reg::CC => self.write_cc(value),
            reg::AQA => self.regs().aqa = value & 0x0fff_0fff,
            reg::ASQ => set_low(&mut self.regs().asq, value & !0xfff),
            o if o == reg::ASQ + 4 => set_high(&mut self.regs().asq, value),
            reg::ACQ => set_low(&mut self.regs().acq, value & !0xfff),
            o if o == reg::ACQ + 4 => set_high(&mut self.regs().acq, value),
            _ => log::debug!("nvme: write {value:#x} to register {offset:#x} ignored"),
        }
    }

    /// CC (§3.1.5): EN edges enable or disable (§7.6.1), SHN notifies a shutdown (§7.6.2).
    fn write_cc(self: &Arc<Self>, value: u32) {
        let old = self.cc.swap(value, Ordering::AcqRel);
        let (was, is) = (old & reg::CC_EN != 0, value & reg::CC_EN != 0);
        if was && !is {
            self.disable();
        }
        let shn = (value >> reg::CC_SHN_SHIFT) & 3;
        let old_shn = (old >> reg::CC_SHN_SHIFT) & 3;
        if shn != 0 && old_shn == 0 {
            self.shutdown();
        }
        if !was && is {
            if let Err(why) = self.enable() {
                self.warn(format_args!("nvme: enable refused: {why}"));
                self.fatal.store(true, Ordering::Release);
            }
        }
    }

    /// CC.SHN: the host is about to go away; make every write durable.
    /// A flush that fails sets CSTS.CFS as well: the shutdown is done, but the host's data
    /// is not safe, and the host must not take it for a clean one.
    fn shutdown(&self) {
        for ns in self.config.namespaces.iter().flatten() {
            if let Err(e) = ns.store().flush() {
                ns.warn(format_args!("nvme: ns{}: flush at shutdown: {e}", ns.id()));
                self.fail("a flush at shutdown failed");
            }
        }
        self.admin().shutdown_seen = true;
        self.regs().csts |= reg::CSTS_SHST_COMPLETE;
    }

    /// CC.EN 0 -> 1 (§7.6.1): the admin queue from AQA/ASQ/ACQ, its worker, CSTS.RDY.
    fn enable(self: &Arc<Self>) -> Result<(), EnableError> {
        let cc = self.cc.load(Ordering::Acquire);
        let (css, mps, ams) = ((cc >> 4) & 7, (cc >> 7) & 0xf, (cc >> 11) & 7);
        if css != 0 || mps != 0 || ams != 0 {
            return Err(EnableError::Config { css, mps, ams });
        }
        let (aqa, asq, acq) = {
            let r = self.regs();
            (r.aqa, r.asq, r.acq)
        };
        let (sq_entries, cq_entries) = ((aqa & 0xfff) + 1, ((aqa >> 16) & 0xfff) + 1);
        if sq_entries < 2 || cq_entries < 2 {
            return Err(EnableError::AdminQueues { aqa });
        }
        if self.requests.context().is_none() {
            return Err(EnableError::NoClient);
        }
        let generation = self.generation();
        let cq = Arc::new(Cq::new(0, acq, cq_entries, 0, true));
        let sq = Arc::new(Sq::new(0, asq, sq_entries, cq.clone()));
        self.open_cq_doorbell(0, cq_entries);
        self.open_sq_doorbell(0, sq_entries);
        let mut queues = self.queues();
        queues.cqs[0] = Some(cq);
        if let Err(e) = self.start_queue(&mut queues, sq, generation) {
            // Doorbells are open exactly while their queue serves (the doorbell path relies on
            // it instead of asking CSTS.RDY).
            self.open_cq_doorbell(0, 0);
            self.open_sq_doorbell(0, 0);
            return Err(e.into());
        }
        drop(queues);
        self.regs().csts = reg::CSTS_RDY;
        Ok(())
    }

    /// Starts `sq`'s worker and enters it in the table.
    pub(crate) fn start_queue(
        self: &Arc<Self>,
        queues: &mut Queues,
        sq: Arc<Sq>,
        generation: u64,
    ) -> std::io::Result<()> {
        let id = usize::from(sq.id);
        let bell = self.sq_doorbells[id].bell().clone();
        self.running.fetch_add(1, Ordering::AcqRel);
        let life = Arc::new(AtomicU8::new(ALIVE));
        let alive = Running { running: self.running.clone(), held: self.held.clone(), life: life.clone() };
        let worker = (self.spawn)(self, sq.clone(), &bell, alive, generation)?;
        queues.sqs[id] = Some(SqEntry { sq, worker, life });
        Ok(())
    }

    /// Stops one queue's worker for `why` and waits for it, boundedly: whether it ended.
    pub(crate) fn stop_queue(&self, entry: SqEntry, why: Stop) -> bool {
        entry.worker.stop(why);
        entry.join(STOP_WAIT, &self.held, self.config.max_held, "")
    }

    /// Whether namespace `nsid`'s backing holds as much as it may ([`ControllerConfig::max_held`]):
    /// its new commands then fail at once.
    pub fn backing_held(&self, nsid: u32) -> bool {
        let max = self.config.max_held;
        self.held.transfers_of(nsid).is_some_and(|t| t.load(Ordering::Relaxed) >= max)
            || self.held.workers.load(Ordering::Relaxed) >= max
    }

    /// Transfers of namespace `nsid` that stopped queues left in the kernel, and queue
    /// workers left blocked (the controller's).
    pub fn held_by_backing(&self, nsid: u32) -> (usize, usize) {
        let transfers = self.held.transfers_of(nsid).map_or(0, |t| t.load(Ordering::Acquire));
        (transfers, self.held.workers.load(Ordering::Acquire))
    }

    /// The count a stopped queue's transfers left in the kernel go into.
    pub(crate) fn held(&self) -> &Arc<Held> {
        &self.held
    }

    /// CC.EN 1 -> 0 (and reset, detach; §7.6.1): stops every worker, drops the queues and
    /// their pins, clears CSTS.RDY (and CFS, SHST), resets features.
    pub fn disable(&self) {
        let entries: Vec<SqEntry> = {
            let mut queues = self.queues();
            self.generation.fetch_add(1, Ordering::AcqRel);
            let entries: Vec<SqEntry> = queues.sqs.iter_mut().filter_map(Option::take).collect();
            for e in &entries {
                e.worker.stop(Stop::Reset);
            }
            queues.cqs.iter_mut().for_each(|c| *c = None);
            entries
        };
        // Commands in flight stop at their next block.
        self.requests.cancel_all();
        let deadline = Instant::now() + STOP_WAIT;
        for e in entries {
            let left = deadline.saturating_duration_since(Instant::now());
            let _ = e.join(left, &self.held, self.config.max_held, " after a disable");
        }
        self.shadowing.store(false, Ordering::Release);
        self.shadow.store(None);
        for db in self.sq_doorbells.iter().chain(self.cq_doorbells.iter()) {
            db.open(0);
        }
        if let Some(page) = &self.page {
            page.clear();
        }
        let shutdown_seen = {
            let mut admin = self.admin();
            let seen = std::mem::take(&mut admin.shutdown_seen);
            admin.reset(self.config.io_queues);
            seen
        };
        if !shutdown_seen && self.regs().csts & reg::CSTS_RDY != 0 {
            self.unsafe_shutdowns.fetch_add(1, Ordering::Relaxed);
        }
        self.write_cache.store(true, Ordering::Release);
        self.fatal.store(false, Ordering::Release);
        self.regs().csts = 0;
        self.irq.intx_deassert();
    }

    /// Maps `file`'s doorbell page where the old one was (the controller is disabled: no
    /// worker reads it meanwhile).
    pub(crate) fn replace_doorbell_page(&self, file: &std::fs::File) -> std::io::Result<()> {
        match &self.page {
            Some(page) => page.replace(file),
            None => Ok(()),
        }
    }

    /// The doorbell page becomes the process's own, no client's ([`DoorbellPage::isolate`]).
    pub(crate) fn isolate_doorbell_page(&self) -> std::io::Result<()> {
        match &self.page {
            Some(page) => page.isolate(),
            None => Ok(()),
        }
    }

    /// DEVICE_RESET and detach: disabled, registers back to power-on values.
    pub fn reset(&self) {
        self.disable();
        self.cc.store(0, Ordering::Release);
        self.intms.store(0, Ordering::Release);
        *self.regs() = Registers::default();
    }

    /// Logs something a guest's use of the controller met (a refused enable, a queue's
    /// worker or ring that could not be made) within the controller's budget: at warning
    /// level for the first few, at debug level when a guest repeats it.
    pub(crate) fn warn(&self, what: std::fmt::Arguments<'_>) {
        self.log.warn(what);
    }

    /// Something the controller cannot go on from (a ring it cannot reach): CSTS.CFS.
    pub(crate) fn fail(&self, why: &str) {
        if !self.fatal.swap(true, Ordering::AcqRel) {
            self.warn(format_args!("nvme: controller fatal status: {why}"));
        }
    }

    /// Whether CSTS.CFS is set.
    pub fn fatal(&self) -> bool {
        self.fatal.load(Ordering::Acquire)
    }

    /// Whether the controller is enabled and ready.
    pub fn ready(&self) -> bool {
        self.regs().csts & reg::CSTS_RDY != 0
    }

    /// A doorbell write (§3.1, SQyTDBL/CQyHDBL): `index` counts 4-byte doorbells from 0x1000.
    pub fn doorbell(&self, index: u64, value: u32) {
        // One writer (the connection thread): a plain increment.
        let n = &self.doorbell_messages;
        n.store(n.load(Ordering::Relaxed) + 1, Ordering::Relaxed);
        let qid = (index / 2) as usize;
        let is_cq = index % 2 == 1;
        let dbs = if is_cq { &self.cq_doorbells } else { &self.sq_doorbells };
        let Some(db) = dbs.get(qid) else {
            return self.bad_doorbell(event::INVALID_DOORBELL_REGISTER, index, value);
        };
        // A disabled controller has every doorbell closed (size 0): no need to lock the
        // registers for CSTS.RDY on every doorbell.
        let size = db.size();
        if size == 0 {
            return self.bad_doorbell(event::INVALID_DOORBELL_REGISTER, index, value);
        }
        if value >= size {
            return self.bad_doorbell(event::INVALID_DOORBELL_VALUE, index, value);
        }
        if let Some(page) = &self.page {
            page.store(index as usize, value);
        }
        db.ring(value);
        if is_cq {
            self.cq_head_moved();
        }
    }

    fn bad_doorbell(&self, info: u32, index: u64, value: u32) {
        log::debug!("nvme: doorbell {index} written with {value}: invalid (event info {info})");
        if self.ready() {
            self.event(event::TYPE_ERROR, info, log_page::ERROR);
        }
    }

    /// Reports an asynchronous event (§5.2; queued until an Asynchronous Event Request takes
    /// it).
    pub(crate) fn event(&self, kind: u32, info: u32, log: u8) {
        let mut admin = self.admin();
        admin.add_event(kind, info, log);
        if let Some(ctx) = self.requests.context() {
            self.deliver_events(&mut admin, &ctx);
        }
    }

    /// Completes outstanding Asynchronous Event Requests with waiting events whose type is
    /// not masked. Never waits for room in the admin CQ: a full queue leaves the event
    /// waiting for the next request, event or log read.
    pub(crate) fn deliver_events(&self, admin: &mut AdminState, ctx: &DeviceContext) {
        let Some(sq) = self.queues().sqs[0].as_ref().map(|e| e.sq.clone()) else { return };
        while let Some((cid, dw0)) = admin.next_delivery() {
            let cqe = super::queue::completion(&sq, cid, Status::SUCCESS, dw0);
            match sq.cq.post(ctx, &sq, cqe, || self.cq_head(0), 0) {
                Ok(_) => {
                    self.interrupt(&sq.cq);
                    admin.delivered(cid, dw0);
                }
                Err(_) => return, // the admin CQ is full: the event waits
            }
        }
    }

    /// Posts `cqe` on `sq`'s CQ for its worker, which has `queued` more commands waiting,
    /// raising the interrupt it calls for.
    pub(crate) fn post(&self, ctx: &DeviceContext, sq: &Sq, cqe: Cqe, queued: u32) -> Result<(), PostError> {
        let cq = &sq.cq;
        let signal = cq.post(ctx, sq, cqe, || self.cq_head(cq.id), queued)?;
        // A level-triggered line (INTx) drops when the host consumed every entry: with shadow
        // doorbells it must write the CQ head register when it passes the last one posted.
        // Armed before the line is raised (whose handler consumes the entries), and the
        // level then computed from the shadow head read after it: a head the host wrote
        // before seeing this event index is seen there.
        // The shadow first: the interrupt mode is behind the interrupts' lock, which every
        // queue's completions would otherwise take.
        if cq.id != 0 && cq.interrupts {
            self.with_shadow(|shadow| {
                if self.irq.mode() == IrqMode::Intx {
                    let last = (cq.tail_seen.load(Ordering::Acquire) + cq.entries - 1) % cq.entries;
                    shadow.arm(usize::from(cq.id) * 2 + 1, last);
                }
            });
        }
        match signal {
            super::queue::Signal::Now => self.interrupt(cq),
            super::queue::Signal::Held | super::queue::Signal::None => {}
        }
        Ok(())
    }

    /// Doorbell Buffer Config (§5.10): the shadow doorbells at `shadow` and the event indexes
    /// at `eventidx` (page aligned, different) replace the I/O queues' doorbell registers as
    /// where their values are read. Each live queue's shadow entries are set to the values the
    /// controller holds (a host may hand over buffers of before a reset, uncleared); SQ event
    /// indexes ask to hear of the next submission, CQ ones of nothing.
    pub(crate) fn set_shadow_doorbells(
        &self,
        ctx: &DeviceContext,
        shadow: u64,
        eventidx: u64,
    ) -> Result<(), Status> {
        if shadow & (super::spec::PAGE - 1) != 0
            || eventidx & (super::spec::PAGE - 1) != 0
            || shadow == eventidx
        {
            return Err(Status::INVALID_FIELD.dnr());
        }
        let pages = ShadowDoorbells::new(ctx, shadow, eventidx, self.sq_doorbells.len()).map_err(|e| {
            log::debug!("nvme: doorbell buffers at {shadow:#x} and {eventidx:#x}: {e}");
            Status::DATA_TRANSFER_ERROR
        })?;
        let queues = self.queues();
        // Where the workers read them now (the pages before, the mapped page, or the
        // registers): a register lags while another source is in use, and a tail behind a
        // worker's head would have it fetch old entries again.
        let n = self.sq_doorbells.len();
        let seeded: Vec<(u32, u32)> =
            (0..n).map(|q| (self.sq_tail(q as u16), self.cq_head(q as u16))).collect();
        let before = self.shadowed().then(|| self.shadow.load_full()).flatten();
        for (qid, &(tail, head)) in seeded.iter().enumerate().skip(1) {
            pages.store(qid * 2, tail);
            pages.arm(qid * 2, tail);
            pages.store(qid * 2 + 1, head);
            pages.arm(qid * 2 + 1, EVENT_NEVER);
        }
        let pages = Arc::new(pages);
        self.shadow.store(Some(pages.clone()));
        self.shadowing.store(true, Ordering::Release);
        // A doorbell the host wrote to the old place meanwhile (until this completes it may
        // not use the new one) is carried over. One written after this look is not: a host
        // rings its I/O queues through the new page once the command has completed.
        for (qid, &(tail, head)) in seeded.iter().enumerate().skip(1) {
            let (q, i) = (qid as u16, qid * 2);
            let now = match &before {
                Some(old) => (old.load(i), old.load(i + 1)),
                None => self.unshadowed(q),
            };
            if now.0 != tail {
                pages.store(i, now.0);
            }
            if now.1 != head {
                pages.store(i + 1, now.1);
            }
        }
        self.shadow_configs.fetch_add(1, Ordering::Relaxed);
        drop(queues);
        // Workers asleep on the old registers look again.
        self.wake_all();
        Ok(())
    }

    /// Whether Doorbell Buffer Config is on.
    pub fn shadowed(&self) -> bool {
        self.with_shadow(|_| ()).is_some()
    }

    /// `f` on Doorbell Buffer Config's pages, if it is on.
    fn with_shadow<R>(&self, f: impl FnOnce(&ShadowDoorbells) -> R) -> Option<R> {
        if !self.shadowing.load(Ordering::Acquire) {
            return None;
        }
        self.shadow.load().as_deref().map(f)
    }

    /// Doorbell Buffer Config commands that succeeded, ever.
    pub fn shadow_configs(&self) -> u64 {
        self.shadow_configs.load(Ordering::Relaxed)
    }

    /// Before queue `qid`'s worker sleeps with its SQ empty at `head`: with shadow doorbells,
    /// the host is asked to write the doorbell register at its next submission (the worker
    /// looks at the shadow once more after this, so one made meanwhile is not missed).
    pub(crate) fn arm_sq(&self, qid: u16, head: u32) {
        if qid != 0 {
            self.with_shadow(|shadow| shadow.arm(usize::from(qid) * 2, head));
        }
    }

    /// A worker waits for room in CQ `qid`: with shadow doorbells, the host is asked to write
    /// the CQ head register at its next update.
    pub(crate) fn arm_cq(&self, qid: u16) {
        if qid != 0 {
            let index = usize::from(qid) * 2 + 1;
            self.with_shadow(|shadow| shadow.arm(index, shadow.load(index)));
        }
    }

    /// Records a failed command in the error log.
    pub(crate) fn log_error(&self, sqid: u16, sqe: &super::spec::Sqe, status: Status) {
        self.admin().log_error(sqid, sqe, status);
    }

    /// The host consumed completions (a CQ head doorbell): the INTx level may drop. Workers
    /// waiting for room were rung by the doorbell itself.
    fn cq_head_moved(&self) {
        if self.irq.mode() == IrqMode::Intx {
            self.update_intx();
        }
    }

    /// The SQ tail the worker of `qid` should see.
    pub(crate) fn sq_tail(&self, qid: u16) -> u32 {
        if qid != 0 {
            if let Some(tail) = self.with_shadow(|shadow| shadow.load(usize::from(qid) * 2)) {
                return tail;
            }
        }
        match self.mapped_page() {
            Some(page) => page.load(usize::from(qid) * 2),
            None => self.sq_doorbells[usize::from(qid)].value(),
        }
    }

    /// Queue `qid`'s SQ tail and CQ head where they are when Doorbell Buffer Config is off:
    /// the mapped page, or the registers.
    fn unshadowed(&self, qid: u16) -> (u32, u32) {
        let i = usize::from(qid) * 2;
        match self.mapped_page() {
            Some(page) => (page.load(i), page.load(i + 1)),
            None => {
                (self.sq_doorbells[usize::from(qid)].value(), self.cq_doorbells[usize::from(qid)].value())
            }
        }
    }

    /// The doorbell page, if the connected client maps it.
    fn mapped_page(&self) -> Option<&DoorbellPage> {
        self.page.as_ref().filter(|_| self.mapped.load(Ordering::Relaxed))
    }

    /// The CQ head the host last wrote for `qid`.
    pub(crate) fn cq_head(&self, qid: u16) -> u32 {
        if qid != 0 {
            if let Some(head) = self.with_shadow(|shadow| shadow.load(usize::from(qid) * 2 + 1)) {
                return head;
            }
        }
        match self.mapped_page() {
            Some(page) => page.load(usize::from(qid) * 2 + 1),
            None => self.cq_doorbells[usize::from(qid)].value(),
        }
    }

    /// Queue `qid`'s CQ head doorbell (a worker waits there for room).
    pub(crate) fn cq_doorbell(&self, qid: u16) -> &Doorbell {
        &self.cq_doorbells[usize::from(qid)]
    }

    /// Queue `qid`'s SQ tail doorbell now belongs to a queue of `entries` (0: none), its value
    /// back to 0 in the message and the mapped page alike.
    pub(crate) fn open_sq_doorbell(&self, qid: u16, entries: u32) {
        self.open_doorbell(qid, false, entries);
    }

    /// As [`Ctrl::open_sq_doorbell`], for the CQ head doorbell.
    pub(crate) fn open_cq_doorbell(&self, qid: u16, entries: u32) {
        self.open_doorbell(qid, true, entries);
    }

    fn open_doorbell(&self, qid: u16, cq: bool, entries: u32) {
        let dbs = if cq { &self.cq_doorbells } else { &self.sq_doorbells };
        if let Some(db) = dbs.get(usize::from(qid)) {
            db.open(entries);
        }
        if let Some(shadow) = (qid != 0).then(|| self.shadow.load_full()).flatten() {
            // A new queue starts at 0; its SQ asks to hear of the first submission.
            let index = usize::from(qid) * 2 + usize::from(cq);
            shadow.store(index, 0);
            shadow.arm(index, if cq { EVENT_NEVER } else { 0 });
        }
        if let Some(page) = &self.page {
            page.store(usize::from(qid) * 2 + usize::from(cq), 0);
        }
    }

    /// Active namespace `nsid` (1-based), if any.
    pub fn namespace(&self, nsid: u32) -> Option<&Namespace> {
        self.config.namespaces.get(usize::try_from(nsid).ok()?.checked_sub(1)?)?.as_ref()
    }

    /// The active namespaces.
    pub fn namespaces(&self) -> impl Iterator<Item = &Namespace> {
        self.config.namespaces.iter().flatten()
    }

    /// Raises `cq`'s interrupt on whatever the guest enabled (§7.5).
    pub(crate) fn interrupt(&self, cq: &Cq) {
        match self.irq.mode() {
            IrqMode::Msix => {
                self.irq.raise(cq.vector);
            }
            IrqMode::Msi => {
                if self.intms.load(Ordering::Acquire) & 1 == 0 {
                    self.irq.raise(0);
                }
            }
            IrqMode::Intx => self.update_intx(),
            IrqMode::None => {}
        }
    }

    /// INTx follows the completion queues: asserted while one with interrupts enabled holds
    /// entries the host has not consumed, unless INTMS masks it.
    fn update_intx(&self) {
        let pending = self.intms.load(Ordering::Acquire) & 1 == 0
            && self
                .queues()
                .cqs
                .iter()
                .flatten()
                .any(|cq| cq.interrupts && cq.tail_seen.load(Ordering::Acquire) != self.cq_head(cq.id));
        if pending {
            self.irq.intx_assert();
        } else {
            self.irq.intx_deassert();
        }
    }

    /// INTMS/INTMC (§3.1.3-4).
    fn mask_vectors(&self, bits: u32, set: bool) {
        if self.irq.mode() == IrqMode::Msix {
            return; // INTMS and INTMC are for INTx and MSI only
        }
        let old = if set {
            self.intms.fetch_or(bits, Ordering::AcqRel)
        } else {
            self.intms.fetch_and(!bits, Ordering::AcqRel)
        };
        match self.irq.mode() {
            IrqMode::Intx => self.update_intx(),
            // Unmasking MSI with completions waiting sends the message now.
            IrqMode::Msi if !set && old & bits & 1 != 0 => {
                let waiting =
                    self.queues().cqs.iter().flatten().any(|cq| {
                        cq.interrupts && cq.tail_seen.load(Ordering::Acquire) != self.cq_head(cq.id)
                    });
                if waiting {
                    self.irq.raise(0);
                }
            }
            _ => {}
        }
    }

    /// `[iova, iova + len)` is being unmapped: rings let go of their pins (pinned again on
    /// next use). A command holding pins there was cancelled by the framework; it ends with
    /// a data transfer error.
    pub fn dma_unmap(&self, iova: u64, len: u64) {
        let queues = self.queues();
        for sq in queues.sqs.iter().flatten() {
            sq.sq.unmapping(iova, len);
        }
        for cq in queues.cqs.iter().flatten() {
            cq.unmapping(iova, len);
        }
        // The shadow doorbell pages going away turn Doorbell Buffer Config off: their last
        // values become the registers' (as SPDK's target does).
        let shadow = self.shadow.load_full();
        if let Some(shadow) = shadow.filter(|s| s.overlaps(iova, len)) {
            for qid in 1..self.sq_doorbells.len() {
                self.sq_doorbells[qid].set(shadow.load(qid * 2));
                self.cq_doorbells[qid].set(shadow.load(qid * 2 + 1));
            }
            self.shadowing.store(false, Ordering::Release);
            self.shadow.store(None);
            drop(queues);
            log::debug!("nvme: the shadow doorbell pages were unmapped: Doorbell Buffer Config is off");
            self.wake_all();
        }
    }

    /// Bus mastering came back: workers waiting for it go on.
    pub fn wake_all(&self) {
        for db in self.sq_doorbells.iter() {
            db.wake();
        }
    }

    /// Workers running now.
    pub fn workers(&self) -> usize {
        self.running.load(Ordering::Acquire)
    }

    /// Queue pairs live now (the admin queue included).
    pub fn live_queues(&self) -> usize {
        self.queues().sqs.iter().flatten().count()
    }
}

fn set_low(r: &mut u64, v: u32) {
    *r = (*r & !0xffff_ffff) | u64::from(v);
}

fn set_high(r: &mut u64, v: u32) {
    *r = (*r & 0xffff_ffff) | u64::from(v) << 32;
}

/// Counts a queue worker down as it ends (and out of [`Held::workers`] if it was left
/// behind): the worker's body holds it.
#[derive(Debug)]
pub struct Running {
    running: Arc<AtomicUsize>,
    held: Arc<Held>,
    life: Arc<AtomicU8>,
}

impl Drop for Running {
    fn drop(&mut self) {
        if self.life.swap(ENDED, Ordering::AcqRel) == LEFT {
            self.held.workers.fetch_sub(1, Ordering::AcqRel);
            log::info!("nvme: a queue worker left blocked in its backing has ended");
        }
        self.running.fetch_sub(1, Ordering::AcqRel);
    }
}
