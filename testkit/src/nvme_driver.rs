//! The host side: a small NVMe driver for tests, benchmarks and tools written in Rust.
//!
//! It brings a controller up (admin queue, Identify, Number of Queues, I/O queue pairs),
//! builds PRPs (PRP2 as a page or a PRP list, chained across list pages as Linux does) and
//! submits commands, over any [`Transport`]: the device in process, or vfio-user. With
//! [`Driver::enable_shadow_doorbells`] it writes I/O queue doorbells as Linux's driver does
//! when the controller has Doorbell Buffer Config: into the shadow page, and to the register
//! only when the event index asks for it.

use std::time::Duration;

use vm_memory::ByteValued;

use umdev_devices::nvme::spec::*;

/// What went wrong driving the controller.
pub type Error = String;

/// How the driver reaches the controller and guest memory.
pub trait Transport {
    /// Reads a 32-bit BAR0 register.
    fn read32(&mut self, offset: u64) -> Result<u32, Error>;
    /// Writes a 32-bit BAR0 register (and waits for it to be done).
    fn write32(&mut self, offset: u64, value: u32) -> Result<(), Error>;
    /// Writes a doorbell (may be posted: no wait).
    fn doorbell(&mut self, offset: u64, value: u32) -> Result<(), Error> {
        self.write32(offset, value)
    }
    /// Writes guest memory.
    fn put(&mut self, addr: u64, bytes: &[u8]) -> Result<(), Error>;
    /// Reads guest memory.
    fn get(&mut self, addr: u64, buf: &mut [u8]) -> Result<(), Error>;
    /// Waits up to `timeout` for interrupt `vector` (true if it came); `None`: the transport
    /// has no interrupts and the driver polls.
    fn wait_interrupt(&mut self, vector: u16, timeout: Duration) -> Option<bool>;
}

/// One queue pair as the driver keeps it.
#[derive(Clone, Debug)]
pub struct QueuePair {
    /// Queue identifier.
    pub id: u16,
    /// Entries.
    pub entries: u32,
    /// Guest address of the SQ ring.
    pub sq_base: u64,
    /// Guest address of the CQ ring.
    pub cq_base: u64,
    /// The next SQ slot.
    pub sq_tail: u32,
    /// The next CQ slot to look at.
    pub cq_head: u32,
    /// The phase a new CQ entry carries.
    pub phase: bool,
    /// Interrupt vector; `None` for a CQ without interrupts, which the driver polls.
    pub vector: Option<u16>,
}

impl QueuePair {
    fn new(id: u16, entries: u32, sq_base: u64, cq_base: u64, vector: Option<u16>) -> QueuePair {
        QueuePair { id, entries, sq_base, cq_base, sq_tail: 0, cq_head: 0, phase: true, vector }
    }
}

/// Guest memory layout the driver uses (all below [`Driver::DATA`]).
const ADMIN_SQ: u64 = 0x1_0000;
const ADMIN_CQ: u64 = 0x2_0000;
const IDENTIFY_BUF: u64 = 0x3_0000;
/// Where the driver puts Doorbell Buffer Config's shadow doorbell page...
pub const SHADOW: u64 = 0x4_0000;
/// ...and its event index page.
pub const EVENTIDX: u64 = 0x5_0000;
const QUEUES: u64 = 0x10_0000;
/// Per I/O queue pair: the SQ (up to 1024 entries: 64 KiB), the CQ at +192 KiB.
const QUEUE_SPAN: u64 = 0x4_0000;
/// The most entries per I/O queue the layout holds.
pub const MAX_DRIVER_ENTRIES: u32 = 1024;
const PRP_LISTS: u64 = 0x200_0000;
/// PRP list space per command slot (two pages: 1 MiB of data); 64 slots per queue, so
/// at most 64 commands in flight per queue.
const PRP_LIST_SPAN: u64 = 0x2000;
const PRP_LIST_SLOTS: u64 = 64;

/// Which interrupt vectors I/O CQs raise.
#[derive(Clone, Copy)]
enum Vectors {
    /// Queue y's on vector y.
    PerQueue,
    /// All on vector 0.
    One,
    /// None: the driver polls.
    None,
}

/// A driver of one controller.
pub struct Driver<T: Transport> {
    /// The transport.
    pub t: T,
    /// The admin queue.
    pub admin: QueuePair,
    /// The I/O queues, by queue identifier - 1.
    pub io: Vec<QueuePair>,
    next_cid: u16,
    /// Poll instead of waiting for interrupts.
    pub poll: bool,
    /// Doorbell Buffer Config is on: I/O queue doorbells go to the shadow page.
    shadow: bool,
    /// Doorbell updates so far, by where they went.
    pub doorbells: DoorbellCounts,
}

/// Doorbell updates: written to the register (a message over vfio-user), or, with shadow
/// doorbells, to the shadow page only.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DoorbellCounts {
    /// Written to the register.
    pub written: u64,
    /// Written to the shadow page only (the event index did not ask for them).
    pub spared: u64,
}

/// Whether a doorbell moving from `old` to `new` passes event index `event` (the host must
/// write the register): NVMe 1.3 §5.10, the same test as virtio's `vring_need_event`.
pub fn need_event(event: u16, new: u16, old: u16) -> bool {
    new.wrapping_sub(event).wrapping_sub(1) < new.wrapping_sub(old)
}

impl<T: Transport> Driver<T> {
    /// Guest memory from here on is the caller's (data buffers).
    pub const DATA: u64 = 0x400_0000;

    /// A driver over `t`; nothing is touched yet.
    pub fn new(t: T) -> Driver<T> {
        Driver {
            t,
            admin: QueuePair::new(0, 32, ADMIN_SQ, ADMIN_CQ, Some(0)),
            io: Vec::new(),
            next_cid: 0,
            poll: false,
            shadow: false,
            doorbells: DoorbellCounts::default(),
        }
    }

    fn wait_csts(&mut self, want_ready: bool) -> Result<u32, Error> {
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        loop {
            let csts = self.t.read32(reg::CSTS)?;
            if csts & reg::CSTS_CFS != 0 {
                return Err(format!("controller fatal status (CSTS {csts:#x})"));
            }
            if (csts & reg::CSTS_RDY != 0) == want_ready {
                return Ok(csts);
            }
            if std::time::Instant::now() > deadline {
                return Err(format!("CSTS.RDY never became {want_ready}"));
            }
            std::thread::sleep(Duration::from_micros(200));
        }
    }

    /// Disables, sets up the admin queue and enables the controller, as Linux does.
    pub fn enable(&mut self) -> Result<(), Error> {
        self.t.write32(reg::CC, 0)?;
        self.wait_csts(false)?;
        let entries = self.admin.entries;
        self.t.put(ADMIN_CQ, &vec![0u8; (entries as u64 * CQE_SIZE) as usize])?;
        self.t.write32(reg::AQA, (entries - 1) | (entries - 1) << 16)?;
        self.t.write32(reg::ASQ, ADMIN_SQ as u32)?;
        self.t.write32(reg::ASQ + 4, (ADMIN_SQ >> 32) as u32)?;
        self.t.write32(reg::ACQ, ADMIN_CQ as u32)?;
        self.t.write32(reg::ACQ + 4, (ADMIN_CQ >> 32) as u32)?;
        let cc = 6 << 16 | 4 << 20; // IOSQES 64 B, IOCQES 16 B, NVM, 4 KiB pages
        self.t.write32(reg::CC, cc)?;
        self.t.write32(reg::CC, cc | reg::CC_EN)?;
        self.admin = QueuePair::new(0, entries, ADMIN_SQ, ADMIN_CQ, Some(0));
        self.io.clear();
        self.shadow = false;
        self.wait_csts(true).map(|_| ())
    }

    /// A fresh command identifier.
    pub fn cid(&mut self) -> u16 {
        self.next_cid = self.next_cid.wrapping_add(1);
        self.next_cid
    }

    fn queue(&mut self, qid: u16) -> &mut QueuePair {
        if qid == 0 {
            &mut self.admin
        } else {
            &mut self.io[usize::from(qid) - 1]
        }
    }

    /// Writes `sqe` into queue `qid`'s next slot without ringing the doorbell.
    pub fn push(&mut self, qid: u16, sqe: &Sqe) -> Result<(), Error> {
        let q = self.queue(qid).clone();
        self.t.put(q.sq_base + u64::from(q.sq_tail) * SQE_SIZE, sqe.as_slice())?;
        self.queue(qid).sq_tail = (q.sq_tail + 1) % q.entries;
        Ok(())
    }

    /// Rings queue `qid`'s SQ tail doorbell.
    pub fn ring(&mut self, qid: u16) -> Result<(), Error> {
        let tail = self.queue(qid).sq_tail;
        self.doorbell(u64::from(qid) * 2, tail)
    }

    /// Writes doorbell `index` (2y: SQ y's tail, 2y + 1: CQ y's head): with shadow doorbells
    /// (I/O queues only), into the shadow page, and to the register only if the value passes
    /// the event index the controller set.
    fn doorbell(&mut self, index: u64, value: u32) -> Result<(), Error> {
        if self.shadow && index >= 2 {
            let mut old = [0u8; 4];
            self.t.get(SHADOW + 4 * index, &mut old)?;
            self.t.put(SHADOW + 4 * index, &value.to_le_bytes())?;
            // The shadow is visible before the event index is read (Linux: mb()), so a
            // controller that sets the index after reading the shadow is never missed.
            std::sync::atomic::fence(std::sync::atomic::Ordering::SeqCst);
            let mut event = [0u8; 4];
            self.t.get(EVENTIDX + 4 * index, &mut event)?;
            let (event, old) = (u32::from_le_bytes(event), u32::from_le_bytes(old));
            if !need_event(event as u16, value as u16, old as u16) {
                self.doorbells.spared += 1;
                return Ok(());
            }
        }
        self.doorbells.written += 1;
        self.t.doorbell(reg::DOORBELLS + 4 * index, value)
    }

    /// Doorbell Buffer Config (NVMe 1.3 §5.10), as Linux's driver sends it when the controller
    /// has it (OACS bit 8): from here until the next [`Driver::enable`], I/O queue doorbells
    /// are written as [`Driver::ring`] describes. The shadow page starts with every queue's
    /// current values.
    pub fn enable_shadow_doorbells(&mut self) -> Result<(), Error> {
        let mut page = vec![0u8; PAGE as usize];
        for q in &self.io {
            let at = usize::from(q.id) * 8;
            page[at..at + 4].copy_from_slice(&q.sq_tail.to_le_bytes());
            page[at + 4..at + 8].copy_from_slice(&q.cq_head.to_le_bytes());
        }
        self.t.put(SHADOW, &page)?;
        self.t.put(EVENTIDX, &vec![0u8; PAGE as usize])?;
        let mut sqe = Sqe::new(admin_op::DOORBELL_BUFFER_CONFIG, 0);
        sqe.prp1 = SHADOW.into();
        sqe.prp2 = EVENTIDX.into();
        self.admin_ok(sqe)?;
        self.shadow = true;
        Ok(())
    }

    /// Submits `sqe` on queue `qid` (and rings).
    pub fn submit(&mut self, qid: u16, sqe: &Sqe) -> Result<(), Error> {
        self.push(qid, sqe)?;
        self.ring(qid)
    }

    /// The next completion of queue `qid` if one is there (the CQ head doorbell is not
    /// written: see [`Driver::release`]).
    pub fn poll_one(&mut self, qid: u16) -> Result<Option<Cqe>, Error> {
        let q = self.queue(qid).clone();
        let mut cqe = Cqe::default();
        self.t.get(q.cq_base + u64::from(q.cq_head) * CQE_SIZE, cqe.as_mut_slice())?;
        if cqe.phase() != q.phase {
            return Ok(None);
        }
        let q = self.queue(qid);
        q.cq_head = (q.cq_head + 1) % q.entries;
        if q.cq_head == 0 {
            q.phase = !q.phase;
        }
        Ok(Some(cqe))
    }

    /// Tells the controller the completions read so far are consumed (CQ head doorbell).
    pub fn release(&mut self, qid: u16) -> Result<(), Error> {
        let head = self.queue(qid).cq_head;
        self.doorbell(u64::from(qid) * 2 + 1, head)
    }

    /// Waits for the next completion of queue `qid` and releases it.
    pub fn wait(&mut self, qid: u16, timeout: Duration) -> Result<Cqe, Error> {
        let deadline = std::time::Instant::now() + timeout;
        loop {
            if let Some(cqe) = self.poll_one(qid)? {
                self.release(qid)?;
                return Ok(cqe);
            }
            let now = std::time::Instant::now();
            if now > deadline {
                return Err(format!("no completion on queue {qid} within {timeout:?}"));
            }
            let vector = self.queue(qid).vector.filter(|_| !self.poll);
            if vector.is_none_or(|v| {
                self.t.wait_interrupt(v, (deadline - now).min(Duration::from_millis(50))).is_none()
            }) {
                std::thread::yield_now();
            }
        }
    }

    /// Runs an admin command and returns its completion.
    pub fn admin_command(&mut self, mut sqe: Sqe) -> Result<Cqe, Error> {
        let cid = self.cid();
        sqe.cdw0 = ((u32::from(sqe.cdw0) & 0xffff) | u32::from(cid) << 16).into();
        self.submit(0, &sqe)?;
        let cqe = self.wait(0, Duration::from_secs(10))?;
        if u16::from(cqe.cid) != cid {
            return Err(format!("completion for cid {} while waiting for {cid}", u16::from(cqe.cid)));
        }
        Ok(cqe)
    }

    /// Runs an admin command that must succeed; its dword 0.
    pub fn admin_ok(&mut self, sqe: Sqe) -> Result<u32, Error> {
        let cqe = self.admin_command(sqe)?;
        if !cqe.status().ok() {
            return Err(format!("admin opcode {:#x} failed: status {:#x}", sqe.opcode(), cqe.status().0));
        }
        Ok(cqe.dw0.into())
    }

    /// Identify with `cns` for `nsid`: the 4 KiB page.
    pub fn identify(&mut self, cns: u8, nsid: u32) -> Result<Box<[u8; 4096]>, Error> {
        let mut sqe = Sqe::new(admin_op::IDENTIFY, 0);
        sqe.nsid = nsid.into();
        sqe.prp1 = IDENTIFY_BUF.into();
        sqe.set_dw(10, u32::from(cns));
        self.admin_ok(sqe)?;
        let mut page = Box::new([0u8; 4096]);
        self.t.get(IDENTIFY_BUF, &mut page[..])?;
        Ok(page)
    }

    /// The SMART / Health Information log page.
    pub fn smart_log(&mut self) -> Result<SmartLog, Error> {
        let mut sqe = Sqe::new(admin_op::GET_LOG_PAGE, 0);
        sqe.set_dw(10, u32::from(log_page::SMART) | ((size_of::<SmartLog>() / 4 - 1) as u32) << 16);
        sqe.prp1 = IDENTIFY_BUF.into();
        self.admin_ok(sqe)?;
        let mut log = SmartLog::zeroed();
        self.t.get(IDENTIFY_BUF, log.as_mut_slice())?;
        Ok(log)
    }

    /// The newest `n` entries of the Error Information log (at most 64), newest first.
    pub fn error_log(&mut self, n: usize) -> Result<Vec<ErrorLogEntry>, Error> {
        let n = n.clamp(1, 64);
        let mut sqe = Sqe::new(admin_op::GET_LOG_PAGE, 0);
        sqe.set_dw(10, u32::from(log_page::ERROR) | ((n * 64 / 4 - 1) as u32) << 16);
        sqe.prp1 = IDENTIFY_BUF.into();
        self.admin_ok(sqe)?;
        let mut entries = vec![ErrorLogEntry::default(); n];
        for (i, entry) in entries.iter_mut().enumerate() {
            self.t.get(IDENTIFY_BUF + 64 * i as u64, entry.as_mut_slice())?;
        }
        Ok(entries)
    }

    /// Identify Controller.
    pub fn identify_controller(&mut self) -> Result<IdentifyController, Error> {
        let page = self.identify(cns::CONTROLLER, 0)?;
        Ok(*IdentifyController::from_slice(&page[..]).ok_or("short page")?)
    }

    /// Identify Namespace `nsid`.
    pub fn identify_namespace(&mut self, nsid: u32) -> Result<IdentifyNamespace, Error> {
        let page = self.identify(cns::NAMESPACE, nsid)?;
        Ok(*IdentifyNamespace::from_slice(&page[..]).ok_or("short page")?)
    }

    /// Number of Queues, then `n` I/O queue pairs of `entries` entries; queue y's CQ
    /// interrupts on vector y (or 0 with `one_vector`).
    pub fn create_io_queues(&mut self, n: u16, entries: u32, one_vector: bool) -> Result<(), Error> {
        self.create_queues(n, entries, if one_vector { Vectors::One } else { Vectors::PerQueue })
    }

    /// As [`Driver::create_io_queues`], with CQs that raise no interrupt (Interrupts Enabled
    /// clear): queues the driver polls, as Linux's poll queues and SPDK's initiator do.
    pub fn create_polled_io_queues(&mut self, n: u16, entries: u32) -> Result<(), Error> {
        self.create_queues(n, entries, Vectors::None)
    }

    fn create_queues(&mut self, n: u16, entries: u32, vectors: Vectors) -> Result<(), Error> {
        if entries > MAX_DRIVER_ENTRIES || n > 32 {
            return Err(format!("the driver's layout holds 32 queues of {MAX_DRIVER_ENTRIES} entries"));
        }
        let mut sqe = Sqe::new(admin_op::SET_FEATURES, 0);
        sqe.set_dw(10, u32::from(feature::NUMBER_OF_QUEUES));
        sqe.set_dw(11, u32::from(n - 1) | u32::from(n - 1) << 16);
        let granted = self.admin_ok(sqe)?;
        let granted = (granted as u16).min((granted >> 16) as u16) + 1;
        if granted < n {
            return Err(format!("{n} queue pairs asked for, {granted} granted"));
        }
        for qid in 1..=n {
            let sq_base = QUEUES + u64::from(qid - 1) * QUEUE_SPAN;
            let cq_base = sq_base + 0x3_0000;
            self.t.put(cq_base, &vec![0u8; (u64::from(entries) * CQE_SIZE) as usize])?;
            // A polled queue names its own vector all the same (the controller ignores it
            // with interrupts off): an interrupt raised regardless shows there.
            let (vector, interrupts) = match vectors {
                Vectors::PerQueue => (qid, true),
                Vectors::One => (0, true),
                Vectors::None => (qid, false),
            };
            let mut cq = Sqe::new(admin_op::CREATE_CQ, 0);
            cq.prp1 = cq_base.into();
            cq.set_dw(10, u32::from(qid) | (entries - 1) << 16);
            // PC, IEN, IV.
            cq.set_dw(11, 1 | u32::from(interrupts) << 1 | u32::from(vector) << 16);
            self.admin_ok(cq)?;
            let mut sq = Sqe::new(admin_op::CREATE_SQ, 0);
            sq.prp1 = sq_base.into();
            sq.set_dw(10, u32::from(qid) | (entries - 1) << 16);
            sq.set_dw(11, 1 | u32::from(qid) << 16);
            self.admin_ok(sq)?;
            self.io.push(QueuePair::new(qid, entries, sq_base, cq_base, interrupts.then_some(vector)));
        }
        Ok(())
    }

    /// PRP1 and PRP2 for `len` bytes in the guest `pages` (page addresses, the first with
    /// `offset` into it), writing a PRP list for queue `qid`'s slot `slot` if one is
    /// needed, chained over list pages as Linux chains them.
    pub fn prps(
        &mut self,
        qid: u16,
        slot: u32,
        pages: &[u64],
        offset: u64,
        len: usize,
    ) -> Result<(u64, u64), Error> {
        let prp1 = pages[0] + offset;
        let first = (PAGE - offset) as usize;
        if len <= first {
            return Ok((prp1, 0));
        }
        let rest = &pages[1..(len - first).div_ceil(PAGE as usize) + 1];
        if rest.len() == 1 {
            return Ok((prp1, rest[0]));
        }
        let lists = PRP_LISTS
            + ((u64::from(qid) % 32) * PRP_LIST_SLOTS + u64::from(slot) % PRP_LIST_SLOTS) * PRP_LIST_SPAN;
        let mut entries: Vec<u64> = Vec::with_capacity(rest.len() + rest.len() / 511);
        let mut page = 0u64;
        for (i, &p) in rest.iter().enumerate() {
            // A full list page: its last entry points at the next list page.
            if entries.len() % 512 == 511 && i + 1 < rest.len() {
                page += 1;
                entries.push(lists + page * PAGE);
            }
            entries.push(p);
        }
        let bytes: Vec<u8> = entries.iter().flat_map(|e| e.to_le_bytes()).collect();
        self.t.put(lists, &bytes)?;
        Ok((prp1, lists))
    }

    /// A Read or Write of `nlb` blocks at `slba` of `nsid` with the given PRPs.
    pub fn rw_command(read: bool, nsid: u32, slba: u64, nlb: u32, prp1: u64, prp2: u64) -> Sqe {
        let mut sqe = Sqe::new(if read { nvm_op::READ } else { nvm_op::WRITE }, 0);
        sqe.nsid = nsid.into();
        sqe.prp1 = prp1.into();
        sqe.prp2 = prp2.into();
        sqe.set_dw(10, slba as u32);
        sqe.set_dw(11, (slba >> 32) as u32);
        sqe.set_dw(12, nlb - 1);
        sqe
    }

    /// Runs one command on I/O queue `qid` and returns its completion.
    pub fn io_command(&mut self, qid: u16, mut sqe: Sqe) -> Result<Cqe, Error> {
        let cid = self.cid();
        sqe.cdw0 = ((u32::from(sqe.cdw0) & 0xffff) | u32::from(cid) << 16).into();
        self.submit(qid, &sqe)?;
        let cqe = self.wait(qid, Duration::from_secs(10))?;
        if u16::from(cqe.cid) != cid {
            return Err(format!("completion for cid {} while waiting for {cid}", u16::from(cqe.cid)));
        }
        Ok(cqe)
    }

    /// Reads or writes `nlb` blocks at `slba` of `nsid` from or into the guest `pages`
    /// (starting `offset` into the first), waiting for the completion; its status.
    #[allow(clippy::too_many_arguments)]
    pub fn rw(
        &mut self,
        qid: u16,
        read: bool,
        nsid: u32,
        slba: u64,
        nlb: u32,
        lba_size: u64,
        pages: &[u64],
        offset: u64,
    ) -> Result<Status, Error> {
        let len = (u64::from(nlb) * lba_size) as usize;
        let slot = self.queue(qid).sq_tail;
        let (prp1, prp2) = self.prps(qid, slot, pages, offset, len)?;
        let cqe = self.io_command(qid, Self::rw_command(read, nsid, slba, nlb, prp1, prp2))?;
        Ok(cqe.status())
    }

    /// Shutdown notification, as a guest's poweroff does: SHN normal, wait for SHST.
    pub fn shutdown(&mut self) -> Result<(), Error> {
        let cc = self.t.read32(reg::CC)?;
        self.t.write32(reg::CC, cc | 1 << reg::CC_SHN_SHIFT)?;
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while self.t.read32(reg::CSTS)? & (3 << reg::CSTS_SHST_SHIFT) != reg::CSTS_SHST_COMPLETE {
            if std::time::Instant::now() > deadline {
                return Err("shutdown never completed".into());
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::need_event;

    #[test]
    fn need_event_is_true_exactly_when_the_update_passes_the_event_index() {
        // The index asked for the next submission after 5: moving 5 -> 6 passes it, and so
        // does 5 -> 9; 6 -> 9 does not (the controller was told at 6).
        assert!(need_event(5, 6, 5));
        assert!(need_event(5, 9, 5));
        assert!(!need_event(5, 9, 6));
        assert!(!need_event(5, 5, 5));
        // Across the u16 wrap.
        assert!(need_event(0xffff, 2, 0xfffe));
        assert!(!need_event(0xfffd, 2, 0xfffe));
        // "Never" (the index a controller sets for CQ heads it does not want to hear of).
        assert!(!need_event(0xffff, 8, 7));
    }
}
