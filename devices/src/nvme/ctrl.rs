//! The controller: registers, enable and disable, doorbells, interrupts, the queue table,
//! and what a DMA unmap does to queues and commands.
//!
//! Threads: the connection thread writes registers and doorbells; one worker per
//! submission queue (the admin queue's included) fetches, executes and completes its
//! commands. Enable starts the admin worker; Create I/O SQ starts the others; Delete, a
//! disable (CC.EN 1 -> 0), a reset and a detach stop and join them.

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use super::admin::AdminState;
use super::namespace::Namespace;
use super::queue::{Cq, Doorbell, DoorbellPage, Sq};
use super::spec::{event, reg};
use super::stats::QueueStats;
use super::worker::QueueWorker;
use umdev_mdev::irq::{IrqHandle, IrqMode};
use umdev_mdev::pci::Host;
use umdev_mdev::request::Requests;
use umdev_mdev::worker::{Poll, Worker};
use umdev_mdev::DeviceContext;

/// How long a disable waits for workers to finish the command they are on.
const STOP_WAIT: Duration = Duration::from_secs(5);

/// How the guest's doorbell writes reach the workers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DoorbellMode {
    /// As REGION_WRITE messages (posted by QEMU): a write wakes the worker.
    Message,
    /// Through a page the client maps into the guest: workers poll it.
    Mapped,
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
    pub doorbells: DoorbellMode,
    /// The serial number (Identify SN).
    pub serial: String,
    /// How long a worker watches its message doorbell after a lone command before it
    /// sleeps (0: it sleeps at once).
    pub poll: Duration,
}

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
pub struct SqEntry {
    /// The queue.
    pub sq: Arc<Sq>,
    worker: Worker<Stop>,
}

/// The live queues, by identifier.
#[derive(Debug, Default)]
pub struct Queues {
    /// Submission queues.
    pub sqs: Vec<Option<SqEntry>>,
    /// Completion queues.
    pub cqs: Vec<Option<Arc<Cq>>>,
}

/// Why a queue's worker stops.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Stop {
    /// Delete I/O SQ: commands left in the queue complete as aborted.
    Delete = 1,
    /// A disable or reset: nothing more is posted.
    Reset = 2,
}

/// The controller.
#[derive(Debug)]
pub struct Ctrl {
    /// Interrupts.
    pub irq: IrqHandle,
    /// How it was built.
    pub config: ControllerConfig,
    regs: Mutex<Registers>,
    /// CC as last written (read back exactly).
    pub cc: AtomicU32,
    /// INTMS (interrupt vectors masked, INTx and MSI only).
    intms: AtomicU32,
    /// The client's context while one is attached.
    ctx: Mutex<Option<DeviceContext>>,
    /// Doorbells, by queue identifier.
    pub sq_doorbells: Box<[Doorbell]>,
    /// CQ head doorbells, by queue identifier.
    pub cq_doorbells: Box<[Doorbell]>,
    /// The mappable doorbell page (`doorbells=mmap`).
    pub page: Option<DoorbellPage>,
    /// The live queues.
    pub queues: Mutex<Queues>,
    /// Features, asynchronous events, the error log.
    pub admin: Mutex<AdminState>,
    /// Per-queue statistics, by queue identifier (kept across resets).
    pub stats: Box<[QueueStats]>,
    /// Bumped by every disable: work of an older generation posts nothing.
    pub generation: AtomicU64,
    /// CSTS.CFS: the controller stopped processing until a reset.
    fatal: AtomicBool,
    /// Volatile write cache enabled (Set Features 06h), read on every write.
    pub write_cache: AtomicBool,
    /// The framework's tracker of the commands (and the client's context).
    requests: Requests,
    /// Queue workers alive (including any left to finish on their own).
    running: Arc<AtomicUsize>,
    /// When the controller was made (SMART power-on hours).
    pub born: Instant,
    /// Shutdown notifications seen, and resets without one (SMART).
    pub unsafe_shutdowns: AtomicU64,
    /// Doorbell writes that arrived as REGION_WRITE messages (with the doorbell page mapped
    /// into the guest, there should be none).
    pub doorbell_messages: AtomicU64,
}

impl Ctrl {
    /// A disabled controller.
    pub fn new(host: Host, config: ControllerConfig, page: Option<DoorbellPage>) -> Ctrl {
        let slots = usize::from(config.io_queues) + 1;
        let admin = AdminState::new(&config);
        Ctrl {
            irq: host.irq,
            regs: Mutex::new(Registers::default()),
            cc: AtomicU32::new(0),
            intms: AtomicU32::new(0),
            ctx: Mutex::new(None),
            sq_doorbells: (0..slots).map(|_| Doorbell::default()).collect(),
            cq_doorbells: (0..slots).map(|_| Doorbell::default()).collect(),
            page,
            queues: Mutex::new(Queues {
                sqs: (0..slots).map(|_| None).collect(),
                cqs: (0..slots).map(|_| None).collect(),
            }),
            admin: Mutex::new(admin),
            stats: (0..slots).map(|_| QueueStats::default()).collect(),
            generation: AtomicU64::new(0),
            fatal: AtomicBool::new(false),
            write_cache: AtomicBool::new(true),
            requests: host.requests,
            running: Arc::new(AtomicUsize::new(0)),
            born: Instant::now(),
            unsafe_shutdowns: AtomicU64::new(0),
            doorbell_messages: AtomicU64::new(0),
            config,
        }
    }

    fn regs(&self) -> MutexGuard<'_, Registers> {
        umdev_mdev::sync::lock(&self.regs)
    }

    /// The live queues.
    pub fn queues(&self) -> MutexGuard<'_, Queues> {
        umdev_mdev::sync::lock(&self.queues)
    }

    /// Features and events.
    pub fn admin(&self) -> MutexGuard<'_, AdminState> {
        umdev_mdev::sync::lock(&self.admin)
    }

    /// CAP.
    pub fn cap(&self) -> u64 {
        let mqes = u64::from(self.config.max_entries - 1);
        let cqr = 1 << 16;
        let to = 10 << 24; // 5 s: a disable waits up to STOP_WAIT for a worker
        let css_nvm = 1 << 37;
        mqes | cqr | to | css_nvm
    }

    /// A register read (the 32-bit register at `offset`; 64-bit ones as two halves).
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

    /// A register write.
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
                log::warn!("nvme: enable refused: {why}");
                self.fatal.store(true, Ordering::Release);
            }
        }
    }

    /// CC.SHN: the host is about to go away; make every write durable.
    fn shutdown(&self) {
        for ns in self.config.namespaces.iter().flatten() {
            if let Err(e) = ns.store.flush() {
                log::warn!("nvme: ns{}: flush at shutdown: {e}", ns.id);
            }
        }
        self.admin().shutdown_seen = true;
        self.regs().csts |= reg::CSTS_SHST_COMPLETE;
    }

    /// CC.EN 0 -> 1: the admin queue from AQA/ASQ/ACQ, its worker, CSTS.RDY.
    fn enable(self: &Arc<Self>) -> Result<(), String> {
        let cc = self.cc.load(Ordering::Acquire);
        let css = (cc >> 4) & 7;
        let mps = (cc >> 7) & 0xf;
        let ams = (cc >> 11) & 7;
        if css != 0 || mps != 0 || ams != 0 {
            return Err(format!("CC.CSS {css}, MPS {mps}, AMS {ams}: only NVM, 4 KiB pages, round robin"));
        }
        let (aqa, asq, acq) = {
            let r = self.regs();
            (r.aqa, r.asq, r.acq)
        };
        let (sq_entries, cq_entries) = ((aqa & 0xfff) + 1, ((aqa >> 16) & 0xfff) + 1);
        let max = self.config.max_entries;
        if sq_entries < 2 || cq_entries < 2 || sq_entries > max || cq_entries > max {
            return Err(format!("AQA {aqa:#x}: admin queues of 2 to {max} entries"));
        }
        let ctx = umdev_mdev::sync::lock(&self.ctx).clone().ok_or("no client attached")?;
        let generation = self.generation.load(Ordering::Acquire);
        let cq = Arc::new(Cq::new(0, acq, cq_entries, 0, true));
        let sq = Arc::new(Sq::new(0, asq, sq_entries, cq.clone()));
        self.open_cq_doorbell(0, cq_entries);
        self.open_sq_doorbell(0, sq_entries);
        let mut queues = self.queues();
        queues.cqs[0] = Some(cq);
        if let Err(e) = self.start_queue(&mut queues, sq, ctx, generation) {
            // Doorbells are open exactly while their queue serves (the doorbell path relies on
            // it instead of asking CSTS.RDY).
            self.open_cq_doorbell(0, 0);
            self.open_sq_doorbell(0, 0);
            return Err(e);
        }
        drop(queues);
        let mut regs = self.regs();
        regs.csts = reg::CSTS_RDY;
        Ok(())
    }

    /// The controller's DMA context, if a client is attached.
    pub fn ctx(&self) -> Option<DeviceContext> {
        umdev_mdev::sync::lock(&self.ctx).clone()
    }

    /// Starts `sq`'s worker and enters it in the table.
    pub fn start_queue(
        self: &Arc<Self>,
        queues: &mut Queues,
        sq: Arc<Sq>,
        ctx: DeviceContext,
        generation: u64,
    ) -> Result<(), String> {
        let id = usize::from(sq.id);
        let bell = self.sq_doorbells[id].bell().clone();
        let lane = {
            let bell = bell.clone();
            self.requests.lane(move || bell.ring())
        };
        let w = QueueWorker::new(self.clone(), sq.clone(), ctx, generation, lane);
        let name = if id == 0 { "umdev-nvme-admin".to_string() } else { format!("umdev-nvme-q{id}") };
        let running = self.running.clone();
        running.fetch_add(1, Ordering::AcqRel);
        let alive = Running(running.clone());
        let worker = Worker::spawn_on(&bell, name, Poll(self.config.poll), move |waiter| {
            let _alive = alive;
            w.run(waiter);
        })
        .map_err(|e| {
            running.fetch_sub(1, Ordering::AcqRel);
            format!("starting a queue worker: {e}")
        })?;
        queues.sqs[id] = Some(SqEntry { sq, worker });
        Ok(())
    }

    /// Stops one queue's worker and waits for it, boundedly.
    pub fn stop_queue(&self, entry: SqEntry, why: Stop) {
        entry.sq.stop(why);
        entry.worker.stop(why);
        if let Err(e) = entry.worker.join(STOP_WAIT) {
            log::warn!("nvme: {e}");
        }
    }

    /// CC.EN 1 -> 0 (and reset, detach): stops every worker, drops the queues and their
    /// pins, clears CSTS.RDY (and CFS, SHST), resets features.
    pub fn disable(&self) {
        let entries: Vec<SqEntry> = {
            let mut queues = self.queues();
            self.generation.fetch_add(1, Ordering::AcqRel);
            let entries: Vec<SqEntry> = queues.sqs.iter_mut().filter_map(Option::take).collect();
            for e in &entries {
                e.sq.stop(Stop::Reset);
                e.worker.stop(Stop::Reset);
            }
            queues.cqs.iter_mut().for_each(|c| *c = None);
            entries
        };
        let deadline = Instant::now() + STOP_WAIT;
        for e in entries {
            if let Err(e) = e.worker.join(deadline.saturating_duration_since(Instant::now())) {
                log::warn!("nvme: {e} after a disable");
            }
        }
        for db in self.sq_doorbells.iter().chain(self.cq_doorbells.iter()) {
            db.open(0);
        }
        if let Some(page) = &self.page {
            page.clear();
        }
        let shutdown_seen = {
            let mut admin = self.admin();
            let seen = std::mem::take(&mut admin.shutdown_seen);
            admin.reset(&self.config);
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

    /// DEVICE_RESET and detach: disabled, registers back to power-on values.
    pub fn reset(&self) {
        self.disable();
        self.cc.store(0, Ordering::Release);
        self.intms.store(0, Ordering::Release);
        *self.regs() = Registers::default();
    }

    /// A client connected.
    pub fn attach(&self, ctx: &DeviceContext) {
        *umdev_mdev::sync::lock(&self.ctx) = Some(ctx.clone());
    }

    /// The client left.
    pub fn detach(&self) {
        self.reset();
        umdev_mdev::sync::lock(&self.ctx).take();
    }

    /// Something the controller cannot go on from (a ring it cannot reach): CSTS.CFS.
    pub fn fail(&self, why: &str) {
        if !self.fatal.swap(true, Ordering::AcqRel) {
            log::warn!("nvme: controller fatal status: {why}");
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

    /// A doorbell write: `index` counts 4-byte doorbells from 0x1000.
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
            self.event(event::TYPE_ERROR, info, super::spec::log_page::ERROR);
        }
    }

    /// Reports an asynchronous event (queued until an Asynchronous Event Request takes it).
    pub fn event(&self, kind: u32, info: u32, log: u8) {
        let ctx = self.ctx();
        let admin_sq = self.queues().sqs[0].as_ref().map(|e| e.sq.clone());
        let mut admin = self.admin();
        admin.add_event(kind, info, log);
        if let (Some(ctx), Some(sq)) = (ctx, admin_sq) {
            admin.deliver_events(self, &ctx, &sq);
        }
    }

    /// The host consumed completions (a CQ head doorbell): the INTx level may drop. Posters
    /// poll a full queue; nothing else waits on the head.
    fn cq_head_moved(&self) {
        if self.irq.mode() == IrqMode::Intx {
            self.update_intx();
        }
    }

    /// The SQ tail the worker of `qid` should see.
    pub fn sq_tail(&self, qid: u16) -> u32 {
        match &self.page {
            Some(page) => page.load(usize::from(qid) * 2),
            None => self.sq_doorbells[usize::from(qid)].value(),
        }
    }

    /// Queue `qid`'s SQ tail doorbell now belongs to a queue of `entries` (0: none), its value
    /// back to 0 in the message and the mapped page alike.
    pub fn open_sq_doorbell(&self, qid: u16, entries: u32) {
        self.open_doorbell(qid, false, entries);
    }

    /// As [`Ctrl::open_sq_doorbell`], for the CQ head doorbell.
    pub fn open_cq_doorbell(&self, qid: u16, entries: u32) {
        self.open_doorbell(qid, true, entries);
    }

    fn open_doorbell(&self, qid: u16, cq: bool, entries: u32) {
        let dbs = if cq { &self.cq_doorbells } else { &self.sq_doorbells };
        if let Some(db) = dbs.get(usize::from(qid)) {
            db.open(entries);
        }
        if let Some(page) = &self.page {
            page.store(usize::from(qid) * 2 + usize::from(cq), 0);
        }
    }

    /// Active namespace `nsid` (1-based), if any.
    pub fn namespace(&self, nsid: u32) -> Option<&Namespace> {
        self.config.namespaces.get(usize::try_from(nsid).ok()?.checked_sub(1)?)?.as_ref()
    }

    /// Whether `cq` is still the controller's CQ of its id (not deleted, not replaced).
    pub fn cq_live(&self, cq: &Arc<Cq>) -> bool {
        self.queues().cqs.get(usize::from(cq.id)).and_then(Option::as_ref).is_some_and(|c| Arc::ptr_eq(c, cq))
    }

    /// The CQ head the host last wrote for `qid`.
    pub fn cq_head(&self, qid: u16) -> u32 {
        match &self.page {
            Some(page) => page.load(usize::from(qid) * 2 + 1),
            None => self.cq_doorbells[usize::from(qid)].value(),
        }
    }

    /// Raises `cq`'s interrupt on whatever the guest enabled.
    pub fn interrupt(&self, cq: &Cq) {
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

/// Counts a queue worker down as it ends.
struct Running(Arc<AtomicUsize>);

impl Drop for Running {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}
