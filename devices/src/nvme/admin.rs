//! The admin command set: Identify, features, queues, log pages, asynchronous events, Abort.

use std::collections::VecDeque;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use smallvec::SmallVec;
use umdev_pinning::{PinnedPages, Prot};
use vm_memory::ByteValued;

use super::ctrl::{ControllerConfig, Ctrl, Stop};
use super::namespace::Namespace;
use super::prp;
use super::queue::{completion, Coalescing, Cq, Sq};
use super::spec::*;
use super::worker::{Outcome, QueueWorker};
use umdev_mdev::irq::IrqMode;
use umdev_mdev::DeviceContext;

/// Outstanding Asynchronous Event Requests at most (AERL + 1).
pub const MAX_AERS: usize = 4;
/// Events kept waiting for a request at most.
const MAX_EVENTS: usize = 16;
/// Error log entries kept (ELPE + 1).
pub const ERROR_LOG_ENTRIES: usize = 16;
/// The composite temperature the controller reports, kelvins (40 °C).
pub const TEMPERATURE: u16 = 313;
/// Warning and critical composite temperature thresholds (WCTEMP, CCTEMP).
pub const WCTEMP: u16 = 343;
/// See [`WCTEMP`].
pub const CCTEMP: u16 = 358;

/// Features, events and the error log.
#[derive(Debug)]
pub struct AdminState {
    arbitration: u32,
    power_state: u32,
    /// Temperature thresholds of the composite sensor: over, under.
    thresholds: [u16; 2],
    error_recovery: u32,
    /// Number of Queues as granted (0's based NSQA, NCQA).
    pub queues_granted: (u16, u16),
    coalescing: Coalescing,
    /// Interrupt vectors with coalescing disabled.
    coalescing_disabled: Vec<bool>,
    write_atomicity: u32,
    async_config: u32,
    /// Outstanding Asynchronous Event Requests (their command identifiers).
    aers: SmallVec<[u16; MAX_AERS]>,
    /// Events waiting for a request: dword 0 of its completion.
    events: VecDeque<u32>,
    /// Event types reported and not yet acknowledged by reading their log page.
    masked_types: u32,
    /// SMART critical warnings now.
    critical_warning: u8,
    errors: VecDeque<ErrorLogEntry>,
    error_count: u64,
    /// A shutdown notification since the last enable.
    pub shutdown_seen: bool,
}

impl AdminState {
    /// Power-on state.
    pub fn new(config: &ControllerConfig) -> AdminState {
        let n = config.io_queues - 1;
        AdminState {
            arbitration: 7, // no burst limit
            power_state: 0,
            thresholds: [WCTEMP, 0],
            error_recovery: 0,
            queues_granted: (n, n),
            coalescing: Coalescing::default(),
            coalescing_disabled: vec![false; usize::from(config.io_queues) + 1],
            write_atomicity: 0,
            async_config: 0,
            aers: SmallVec::new(),
            events: VecDeque::new(),
            masked_types: 0,
            critical_warning: 0,
            errors: VecDeque::new(),
            error_count: 0,
            shutdown_seen: false,
        }
    }

    /// A controller reset: features back to defaults, requests and events gone; the error
    /// log stays.
    pub fn reset(&mut self, config: &ControllerConfig) {
        let errors = std::mem::take(&mut self.errors);
        let error_count = self.error_count;
        *self = AdminState::new(config);
        self.errors = errors;
        self.error_count = error_count;
    }

    /// Records a failed command in the error log.
    pub fn log_error(&mut self, sqid: u16, sqe: &Sqe, status: Status) {
        self.error_count += 1;
        let lba = match sqe.opcode() {
            nvm_op::READ | nvm_op::WRITE | nvm_op::WRITE_ZEROES if sqid != 0 => {
                u64::from(sqe.dw(10)) | u64::from(sqe.dw(11)) << 32
            }
            _ => 0,
        };
        if self.errors.len() == ERROR_LOG_ENTRIES {
            self.errors.pop_back();
        }
        self.errors.push_front(ErrorLogEntry {
            error_count: self.error_count.into(),
            sqid: sqid.into(),
            cid: sqe.cid().into(),
            status: (status.0 << 1).into(),
            parameter_location: 0xffff.into(),
            lba: lba.into(),
            nsid: sqe.nsid,
            ..ErrorLogEntry::default()
        });
    }

    /// Queues an event (dropped if as many are waiting already, or the same one is).
    pub fn add_event(&mut self, kind: u32, info: u32, log: u8) {
        let dw0 = kind | info << 8 | u32::from(log) << 16;
        if self.events.len() < MAX_EVENTS && !self.events.contains(&dw0) {
            self.events.push_back(dw0);
        }
    }

    /// Completes requests with waiting events whose type is not masked. Never waits for
    /// room in the admin CQ (the caller holds the admin state): a full queue leaves the
    /// event waiting for the next request, event or log read.
    pub fn deliver_events(&mut self, ctrl: &Ctrl, ctx: &DeviceContext, sq: &Sq) {
        while !self.aers.is_empty() {
            let Some(at) = self.events.iter().position(|e| self.masked_types & (1 << (e & 7)) == 0) else {
                return;
            };
            let dw0 = self.events[at];
            let cid = self.aers[0];
            let cqe = completion(sq, cid, Status::SUCCESS, dw0);
            let head = || ctrl.cq_head(0);
            let never = || false;
            match sq.cq.post(ctx, cqe, &head, &never, false, 0) {
                Ok(_) => {
                    ctrl.interrupt(&sq.cq);
                    self.aers.remove(0);
                    self.events.remove(at);
                    self.masked_types |= 1 << (dw0 & 7);
                }
                Err(_) => return, // the admin CQ is full: the event waits
            }
        }
    }

    fn update_temperature_warning(&mut self) -> bool {
        let [over, under] = self.thresholds;
        let was = self.critical_warning & 2 != 0;
        let is = TEMPERATURE > over || TEMPERATURE < under;
        if is {
            self.critical_warning |= 2;
        } else {
            self.critical_warning &= !2;
        }
        is && !was && self.async_config & 2 != 0
    }
}

/// Executes an admin command.
pub fn execute(w: &Arc<QueueWorker>, sqe: &Sqe) -> Outcome {
    if sqe.fuse() != 0 || sqe.psdt() != 0 {
        return Status::INVALID_FIELD.dnr().into();
    }
    match sqe.opcode() {
        admin_op::IDENTIFY => identify(w, sqe),
        admin_op::GET_FEATURES => get_features(w, sqe),
        admin_op::SET_FEATURES => set_features(w, sqe),
        admin_op::CREATE_CQ => create_cq(w, sqe),
        admin_op::CREATE_SQ => create_sq(w, sqe),
        admin_op::DELETE_SQ => delete_sq(w, sqe),
        admin_op::DELETE_CQ => delete_cq(w, sqe),
        admin_op::GET_LOG_PAGE => get_log_page(w, sqe),
        admin_op::ASYNC_EVENT => async_event(w, sqe),
        admin_op::ABORT => abort(w, sqe),
        _ => Status::INVALID_OPCODE.dnr().into(),
    }
}

/// The command's data buffer (its PRPs) of `len` bytes, pinned for `prot`, and the offset of
/// its first byte in the first page.
fn data_buffer(w: &QueueWorker, sqe: &Sqe, len: usize, prot: Prot) -> Result<(PinnedPages, u64), Status> {
    let pages = prp::resolve(&w.ctx, sqe.prp1.into(), sqe.prp2.into(), len)?;
    let pins = w.ctx.pin_pages(&pages.pfns, prot).map_err(|_| Status::DATA_TRANSFER_ERROR)?;
    Ok((pins, pages.offset as u64))
}

/// Copies `data` to the command's data buffer (its PRPs), `data.len()` bytes.
pub fn to_host(w: &QueueWorker, sqe: &Sqe, data: &[u8]) -> Status {
    match data_buffer(w, sqe, data.len(), Prot::WRITE) {
        Ok((pins, offset)) => {
            pins.write(offset, data).map_or(Status::DATA_TRANSFER_ERROR, |()| Status::SUCCESS)
        }
        Err(s) => s,
    }
}

/// Copies the command's data buffer into `data`.
pub fn from_host(w: &QueueWorker, sqe: &Sqe, data: &mut [u8]) -> Status {
    match data_buffer(w, sqe, data.len(), Prot::READ) {
        Ok((pins, offset)) => {
            pins.read(offset, data).map_or(Status::DATA_TRANSFER_ERROR, |()| Status::SUCCESS)
        }
        Err(s) => s,
    }
}

fn identify(w: &QueueWorker, sqe: &Sqe) -> Outcome {
    let ctrl = &w.ctrl;
    let nsid = u32::from(sqe.nsid);
    let nn = ctrl.config.namespaces.len() as u32;
    let valid_nsid = nsid >= 1 && nsid <= nn;
    let page: Box<[u8; 4096]> = match sqe.dw(10) as u8 {
        cns::CONTROLLER => Box::new(copy_bytes(&identify_controller(ctrl))),
        cns::NAMESPACE => match ctrl.namespace(nsid) {
            Some(ns) => Box::new(copy_bytes(&identify_namespace(ns))),
            None if valid_nsid => Box::new([0; 4096]), // inactive: zeroes
            None => return Status::INVALID_NAMESPACE.dnr().into(),
        },
        cns::ACTIVE_NAMESPACES => {
            if nsid >= 0xffff_fffe {
                return Status::INVALID_NAMESPACE.dnr().into();
            }
            let mut page = Box::new([0u8; 4096]);
            let ids = ctrl.config.namespaces.iter().flatten().map(|ns| ns.id).filter(|&id| id > nsid);
            for (slot, id) in page.chunks_exact_mut(4).zip(ids) {
                slot.copy_from_slice(&id.to_le_bytes());
            }
            page
        }
        cns::NS_DESCRIPTORS => match ctrl.namespace(nsid) {
            Some(ns) => Box::new(ns_descriptors(ns)),
            None => return Status::INVALID_NAMESPACE.dnr().into(),
        },
        _ => return Status::INVALID_FIELD.dnr().into(),
    };
    to_host(w, sqe, &page[..]).into()
}

fn copy_bytes<T: ByteValued>(value: &T) -> [u8; 4096] {
    let mut page = [0u8; 4096];
    let bytes = value.as_slice();
    page[..bytes.len()].copy_from_slice(bytes);
    page
}

/// The Identify Controller page.
pub fn identify_controller(ctrl: &Ctrl) -> IdentifyController {
    let mut id = IdentifyController::zeroed();
    id.vid = super::VENDOR_ID.into();
    id.ssvid = super::VENDOR_ID.into();
    id.sn = ascii(&ctrl.config.serial);
    id.mn = ascii("umdev NVMe controller");
    id.fr = ascii(env!("CARGO_PKG_VERSION"));
    id.rab = 6;
    id.mdts = 8; // 2^8 pages: 1 MiB
    id.cntlid = 1.into();
    id.ver = reg::VERSION_1_3.into();
    id.acl = 3;
    id.aerl = (MAX_AERS - 1) as u8;
    id.frmw = 0x03; // one slot, read-only
    id.lpa = 0x04; // extended data (NUMDU, offsets) for Get Log Page
    id.elpe = (ERROR_LOG_ENTRIES - 1) as u8;
    id.npss = 0;
    id.avscc = 1;
    id.wctemp = WCTEMP.into();
    id.cctemp = CCTEMP.into();
    id.sqes = 0x66;
    id.cqes = 0x44;
    id.nn = (ctrl.config.namespaces.len() as u32).into();
    id.oncs = (1 << 2 | 1 << 3).into(); // Dataset Management, Write Zeroes
    id.vwc = 1;
    id.nvscc = 1;
    let nqn = format!("nqn.2026-12.dev.umdev:nvme:{}", ctrl.config.serial);
    id.subnqn[..nqn.len().min(255)].copy_from_slice(&nqn.as_bytes()[..nqn.len().min(255)]);
    id.psd[0].mp = 2500.into(); // 25 W
    id
}

/// The Identify Namespace page of `ns`.
pub fn identify_namespace(ns: &Namespace) -> IdentifyNamespace {
    let mut id = IdentifyNamespace::zeroed();
    id.nsze = ns.blocks.into();
    id.ncap = ns.blocks.into();
    id.nuse = ns.blocks.into();
    // Deallocated blocks read as zeroes; Write Zeroes may deallocate.
    id.dlfeat = 0x09;
    id.nguid = ns.nguid;
    id.lbaf[0] = (ns.lba_shift << 16).into();
    id
}

fn ns_descriptors(ns: &Namespace) -> [u8; 4096] {
    let mut page = [0u8; 4096];
    let mut at = 0;
    for (nidt, id) in [(2u8, ns.nguid), (3u8, uuid_of(ns.nguid))] {
        let header = NsDescriptorHeader { nidt, nidl: 16, rsvd: 0.into() };
        page[at..at + 4].copy_from_slice(header.as_slice());
        page[at + 4..at + 20].copy_from_slice(&id);
        at += 20;
    }
    page
}

/// A version 4 (random) UUID made from `bytes`.
fn uuid_of(mut bytes: [u8; 16]) -> [u8; 16] {
    bytes[6] = (bytes[6] & 0x0f) | 0x40;
    bytes[8] = (bytes[8] & 0x3f) | 0x80;
    bytes
}

fn get_features(w: &QueueWorker, sqe: &Sqe) -> Outcome {
    let fid = sqe.dw(10) as u8;
    let sel = (sqe.dw(10) >> 8) & 7;
    if sel > 2 {
        return Status::INVALID_FIELD.dnr().into(); // no Save/Select support (ONCS bit 4)
    }
    let ctrl = &w.ctrl;
    let default = sel == 1;
    let defaults = AdminState::new(&ctrl.config);
    let admin = ctrl.admin();
    let st = if default { &defaults } else { &*admin };
    let dw11 = sqe.dw(11);
    let dw0 = match fid {
        feature::ARBITRATION => st.arbitration,
        feature::POWER_MANAGEMENT => st.power_state,
        feature::TEMPERATURE_THRESHOLD => {
            let (sel, which) = ((dw11 >> 16) & 0xf, (dw11 >> 20) & 3);
            if sel != 0 || which > 1 {
                return Status::INVALID_FIELD.dnr().into();
            }
            u32::from(st.thresholds[which as usize]) | which << 20
        }
        feature::ERROR_RECOVERY => st.error_recovery,
        feature::VOLATILE_WRITE_CACHE => u32::from(default || ctrl.write_cache.load(Ordering::Acquire)),
        feature::NUMBER_OF_QUEUES => u32::from(st.queues_granted.0) | u32::from(st.queues_granted.1) << 16,
        feature::INTERRUPT_COALESCING => {
            u32::from(st.coalescing.threshold) | u32::from(st.coalescing.time) << 8
        }
        feature::INTERRUPT_VECTOR_CONFIG => {
            let iv = dw11 & 0xffff;
            let Some(&cd) = st.coalescing_disabled.get(iv as usize) else {
                return Status::INVALID_FIELD.dnr().into();
            };
            // The admin queue's vector is never coalesced.
            iv | u32::from(cd || iv == 0) << 16
        }
        feature::WRITE_ATOMICITY => st.write_atomicity,
        feature::ASYNC_EVENT_CONFIG => st.async_config,
        _ => return Status::INVALID_FIELD.dnr().into(),
    };
    Outcome::ok(dw0)
}

fn set_features(w: &QueueWorker, sqe: &Sqe) -> Outcome {
    let fid = sqe.dw(10) as u8;
    if sqe.dw(10) & 1 << 31 != 0 {
        return Status::FEATURE_NOT_SAVEABLE.dnr().into();
    }
    let ctrl = &w.ctrl;
    let dw11 = sqe.dw(11);
    let mut admin = ctrl.admin();
    let mut dw0 = 0;
    match fid {
        feature::ARBITRATION => admin.arbitration = dw11,
        feature::POWER_MANAGEMENT => {
            if dw11 & 0x1f != 0 {
                return Status::INVALID_FIELD.dnr().into(); // one power state (NPSS 0)
            }
            admin.power_state = dw11 & 0xff;
        }
        feature::TEMPERATURE_THRESHOLD => {
            let (sel, which) = ((dw11 >> 16) & 0xf, (dw11 >> 20) & 3);
            if sel != 0 || which > 1 {
                return Status::INVALID_FIELD.dnr().into();
            }
            admin.thresholds[which as usize] = dw11 as u16;
            if admin.update_temperature_warning() {
                admin.add_event(event::TYPE_SMART, event::TEMPERATURE_THRESHOLD, log_page::SMART);
                let sq = w.sq.clone();
                admin.deliver_events(ctrl, &w.ctx, &sq);
            }
        }
        feature::ERROR_RECOVERY => {
            if dw11 & 1 << 16 != 0 {
                return Status::INVALID_FIELD.dnr().into(); // no DULBE
            }
            admin.error_recovery = dw11 & 0xffff;
        }
        feature::VOLATILE_WRITE_CACHE => ctrl.write_cache.store(dw11 & 1 != 0, Ordering::Release),
        feature::NUMBER_OF_QUEUES => {
            let (nsqr, ncqr) = (dw11 as u16, (dw11 >> 16) as u16);
            if nsqr == 0xffff || ncqr == 0xffff {
                return Status::INVALID_FIELD.dnr().into();
            }
            let queues = ctrl.queues();
            if queues.sqs.iter().skip(1).any(Option::is_some)
                || queues.cqs.iter().skip(1).any(Option::is_some)
            {
                return Status::COMMAND_SEQUENCE_ERROR.dnr().into();
            }
            let max = ctrl.config.io_queues - 1;
            admin.queues_granted = (nsqr.min(max), ncqr.min(max));
            dw0 = u32::from(admin.queues_granted.0) | u32::from(admin.queues_granted.1) << 16;
        }
        feature::INTERRUPT_COALESCING => {
            admin.coalescing = Coalescing { threshold: dw11 as u8, time: (dw11 >> 8) as u8 };
            apply_coalescing(ctrl, &admin);
        }
        feature::INTERRUPT_VECTOR_CONFIG => {
            let iv = (dw11 & 0xffff) as usize;
            let Some(cd) = admin.coalescing_disabled.get_mut(iv) else {
                return Status::INVALID_FIELD.dnr().into();
            };
            *cd = dw11 & 1 << 16 != 0;
            apply_coalescing(ctrl, &admin);
        }
        feature::WRITE_ATOMICITY => admin.write_atomicity = dw11 & 1,
        feature::ASYNC_EVENT_CONFIG => {
            admin.async_config = dw11 & 0xff; // SMART critical warnings only (OAES 0)
            if admin.update_temperature_warning() {
                admin.add_event(event::TYPE_SMART, event::TEMPERATURE_THRESHOLD, log_page::SMART);
                let sq = w.sq.clone();
                admin.deliver_events(ctrl, &w.ctx, &sq);
            }
        }
        _ => return Status::INVALID_FIELD.dnr().into(),
    }
    Outcome::ok(dw0)
}

/// Interrupt coalescing as configured, on every live I/O completion queue.
fn apply_coalescing(ctrl: &Ctrl, admin: &AdminState) {
    for cq in ctrl.queues().cqs.iter().flatten().filter(|cq| cq.id != 0) {
        let off = admin.coalescing_disabled.get(usize::from(cq.vector)).copied().unwrap_or(true);
        cq.set_coalescing(if off { Coalescing::default() } else { admin.coalescing });
    }
}

/// Queue identifier and size (not 0's based) of a Create command.
fn queue_params(sqe: &Sqe) -> (u16, u32) {
    (sqe.dw(10) as u16, (sqe.dw(10) >> 16) + 1)
}

fn check_new_queue(ctrl: &Ctrl, sqe: &Sqe, granted: u16, exists: bool) -> Result<(u16, u32, u64), Status> {
    let (qid, entries) = queue_params(sqe);
    if qid == 0 || qid > granted + 1 || exists {
        return Err(Status::INVALID_QUEUE_ID.dnr());
    }
    if entries < 2 || entries > ctrl.config.max_entries {
        return Err(Status::INVALID_QUEUE_SIZE.dnr());
    }
    if sqe.dw(11) & 1 == 0 {
        return Err(Status::INVALID_FIELD.dnr()); // CAP.CQR: queues must be contiguous
    }
    let base = u64::from(sqe.prp1);
    if base & (PAGE - 1) != 0 {
        return Err(Status::PRP_OFFSET_INVALID.dnr());
    }
    Ok((qid, entries, base))
}

fn create_cq(w: &QueueWorker, sqe: &Sqe) -> Outcome {
    let ctrl = &w.ctrl;
    // Lock order: the admin state before the queue table.
    let (granted, coalescing, disabled) = {
        let admin = ctrl.admin();
        (admin.queues_granted.1, admin.coalescing, admin.coalescing_disabled.clone())
    };
    let mut queues = ctrl.queues();
    let qid = queue_params(sqe).0;
    let exists = queues.cqs.get(usize::from(qid)).is_some_and(Option::is_some);
    let (qid, entries, base) = match check_new_queue(ctrl, sqe, granted, exists) {
        Ok(p) => p,
        Err(s) => return s.into(),
    };
    if (ctrl.cc.load(Ordering::Acquire) >> 20) & 0xf != 4 {
        return Status::INVALID_FIELD.dnr().into(); // CC.IOCQES must be 16 bytes
    }
    let dw11 = sqe.dw(11);
    let interrupts = dw11 & 2 != 0;
    let vector = (dw11 >> 16) as u16;
    let vectors = match ctrl.irq.mode() {
        IrqMode::Msix => ctrl.config.io_queues + 1,
        _ => 1,
    };
    if interrupts && vector >= vectors {
        return Status::INVALID_VECTOR.dnr().into();
    }
    let cq = Arc::new(Cq::new(qid, base, entries, vector, interrupts));
    if !disabled.get(usize::from(vector)).copied().unwrap_or(true) {
        cq.set_coalescing(coalescing);
    }
    if !w.current() {
        return Status::COMMAND_SEQUENCE_ERROR.into();
    }
    ctrl.open_cq_doorbell(qid, entries);
    queues.cqs[usize::from(qid)] = Some(cq);
    Outcome::ok(0)
}

fn create_sq(w: &QueueWorker, sqe: &Sqe) -> Outcome {
    let ctrl = &w.ctrl;
    let granted = ctrl.admin().queues_granted.0;
    let mut queues = ctrl.queues();
    let qid = queue_params(sqe).0;
    let exists = queues.sqs.get(usize::from(qid)).is_some_and(Option::is_some);
    let (qid, entries, base) = match check_new_queue(ctrl, sqe, granted, exists) {
        Ok(p) => p,
        Err(s) => return s.into(),
    };
    let cqid = (sqe.dw(11) >> 16) as u16;
    let Some(cq) = (cqid != 0).then(|| queues.cqs.get(usize::from(cqid)).cloned().flatten()).flatten() else {
        return Status::CQ_INVALID.dnr().into();
    };
    if (ctrl.cc.load(Ordering::Acquire) >> 16) & 0xf != 6 {
        return Status::INVALID_FIELD.dnr().into(); // CC.IOSQES must be 64 bytes
    }
    if !w.current() {
        return Status::COMMAND_SEQUENCE_ERROR.into();
    }
    let sq = Arc::new(Sq::new(qid, base, entries, cq));
    ctrl.open_sq_doorbell(qid, entries);
    match ctrl.start_queue(&mut queues, sq, w.ctx.clone(), w.generation) {
        Ok(()) => Outcome::ok(0),
        Err(why) => {
            log::warn!("nvme: {why}");
            ctrl.open_sq_doorbell(qid, 0);
            Status::INTERNAL_ERROR.into()
        }
    }
}

fn delete_sq(w: &QueueWorker, sqe: &Sqe) -> Outcome {
    let ctrl = &w.ctrl;
    let qid = sqe.dw(10) as u16;
    let entry = {
        let mut queues = ctrl.queues();
        match (qid, queues.sqs.get_mut(usize::from(qid))) {
            (1.., Some(slot @ Some(_))) => slot.take(),
            _ => return Status::INVALID_QUEUE_ID.dnr().into(),
        }
    };
    if let Some(entry) = entry {
        // Its worker completes what is still queued as aborted, then stops.
        ctrl.stop_queue(entry, Stop::Delete);
    }
    ctrl.open_sq_doorbell(qid, 0);
    Outcome::ok(0)
}

fn delete_cq(w: &QueueWorker, sqe: &Sqe) -> Outcome {
    let ctrl = &w.ctrl;
    let qid = sqe.dw(10) as u16;
    let mut queues = ctrl.queues();
    if qid == 0 || !queues.cqs.get(usize::from(qid)).is_some_and(Option::is_some) {
        return Status::INVALID_QUEUE_ID.dnr().into();
    }
    if queues.sqs.iter().flatten().any(|e| e.sq.cq.id == qid) {
        return Status::INVALID_QUEUE_DELETION.dnr().into();
    }
    queues.cqs[usize::from(qid)] = None;
    ctrl.open_cq_doorbell(qid, 0);
    Outcome::ok(0)
}

fn get_log_page(w: &QueueWorker, sqe: &Sqe) -> Outcome {
    let ctrl = &w.ctrl;
    let dw10 = sqe.dw(10);
    let lid = dw10 as u8;
    let rae = dw10 & 1 << 15 != 0;
    let dwords = (u64::from(sqe.dw(11) & 0xffff) << 16 | u64::from(dw10 >> 16)) + 1;
    let offset = u64::from(sqe.dw(12)) | u64::from(sqe.dw(13)) << 32;
    if offset & 3 != 0 {
        return Status::INVALID_FIELD.dnr().into();
    }
    let page: Vec<u8> = match lid {
        log_page::ERROR => {
            let admin = ctrl.admin();
            let mut page = vec![0u8; ERROR_LOG_ENTRIES * 64];
            for (slot, e) in page.chunks_exact_mut(64).zip(admin.errors.iter()) {
                slot.copy_from_slice(e.as_slice());
            }
            page
        }
        log_page::SMART => smart_log(ctrl).as_slice().to_vec(),
        log_page::FIRMWARE_SLOT => {
            let mut log = FirmwareSlotLog::zeroed();
            log.afi = 1;
            log.frs[0] = ascii(env!("CARGO_PKG_VERSION"));
            log.as_slice().to_vec()
        }
        _ => return Status::INVALID_LOG_PAGE.dnr().into(),
    };
    if offset >= page.len() as u64 {
        return Status::INVALID_FIELD.dnr().into();
    }
    let want = usize::try_from(dwords * 4).unwrap_or(usize::MAX).min(prp::MAX_TRANSFER);
    let mut data = vec![0u8; want];
    let avail = &page[offset as usize..];
    let n = avail.len().min(want);
    data[..n].copy_from_slice(&avail[..n]);
    let status = to_host(w, sqe, &data);
    if status.ok() && !rae {
        // Reading the page acknowledges its event type: more may be reported.
        let kind = match lid {
            log_page::ERROR => Some(event::TYPE_ERROR),
            log_page::SMART => Some(event::TYPE_SMART),
            _ => None,
        };
        if let Some(kind) = kind {
            let mut admin = ctrl.admin();
            admin.masked_types &= !(1 << kind);
            let sq = w.sq.clone();
            admin.deliver_events(ctrl, &w.ctx, &sq);
        }
    }
    status.into()
}

/// The SMART / Health log as of now.
pub fn smart_log(ctrl: &Ctrl) -> SmartLog {
    let totals = super::stats::Totals::of(ctrl.stats.iter());
    let admin = ctrl.admin();
    let mut log = SmartLog::zeroed();
    log.critical_warning = admin.critical_warning;
    log.temperature = TEMPERATURE.to_le_bytes();
    log.available_spare = 100;
    log.available_spare_threshold = 10;
    // Data units are thousands of 512-byte units, rounded up.
    log.data_units_read = u128_le((totals.bytes_read / 512).div_ceil(1000));
    log.data_units_written = u128_le((totals.bytes_written / 512).div_ceil(1000));
    log.host_reads = u128_le(totals.reads);
    log.host_writes = u128_le(totals.writes);
    log.power_cycles = u128_le(1);
    log.power_on_hours = u128_le(ctrl.born.elapsed().as_secs() / 3600);
    log.unsafe_shutdowns = u128_le(ctrl.unsafe_shutdowns.load(Ordering::Relaxed));
    log.error_log_entries = u128_le(admin.error_count);
    log
}

fn async_event(w: &QueueWorker, sqe: &Sqe) -> Outcome {
    let ctrl = &w.ctrl;
    let mut admin = ctrl.admin();
    if admin.aers.len() >= MAX_AERS {
        return Status::AER_LIMIT.into();
    }
    admin.aers.push(sqe.cid());
    let sq = w.sq.clone();
    admin.deliver_events(ctrl, &w.ctx, &sq);
    Outcome::Held
}

fn abort(w: &QueueWorker, sqe: &Sqe) -> Outcome {
    let ctrl = &w.ctrl;
    let (sqid, cid) = (sqe.dw(10) as u16, (sqe.dw(10) >> 16) as u16);
    let sq = ctrl.queues().sqs.get(usize::from(sqid)).and_then(|e| e.as_ref()).map(|e| e.sq.clone());
    // Bit 0 of dword 0 set: not aborted (already done, or not found).
    let Some(sq) = sq else { return Outcome::ok(1) };
    if sqid == 0 {
        return Outcome::ok(1); // admin commands run as fetched
    }
    match sq.abort(&w.ctx, cid, ctrl.sq_tail(sqid)) {
        Ok(true) => Outcome::ok(0),
        Ok(false) => Outcome::ok(1),
        Err(s) => s.into(),
    }
}
