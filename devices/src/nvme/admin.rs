//! The admin command set (NVMe 1.3 §5): Identify, features, queues, log pages, asynchronous
//! events, Abort. Each handler is `fn(&CommandCx, command) -> Outcome`.

use std::sync::Arc;

use vm_memory::ByteValued;

use super::cmds::{self, AdminCmd, Feature};
use super::completion::Outcome;
use super::ctrl::{Ctrl, Stop};
use super::cx::CommandCx;
use super::namespace::Namespace;
use super::prp;
use super::queue::{Coalescing, Cq, Sq};
use super::spec::*;
use super::state::{AdminState, CCTEMP, ERROR_LOG_ENTRIES, MAX_AERS, TEMPERATURE, WCTEMP};
use umdev_mdev::irq::IrqMode;

/// Runs an admin command.
pub fn execute(cx: &CommandCx, cmd: AdminCmd) -> Outcome {
    match cmd {
        AdminCmd::Identify(c) => identify(cx, c),
        AdminCmd::GetFeatures(c) => get_features(cx, c),
        AdminCmd::SetFeatures(c) => set_features(cx, c),
        AdminCmd::CreateCq(c) => create_cq(cx, c),
        AdminCmd::CreateSq(c) => create_sq(cx, c),
        AdminCmd::DeleteSq(qid) => delete_sq(cx, qid),
        AdminCmd::DeleteCq(qid) => delete_cq(cx, qid),
        AdminCmd::GetLogPage(c) => get_log_page(cx, c),
        AdminCmd::AsyncEventRequest => async_event(cx),
        AdminCmd::Abort(c) => abort(cx, c),
        AdminCmd::DoorbellBufferConfig(c) => doorbell_buffer_config(cx, c),
    }
}

/// Identify (§5.15): the data structure CNS names.
fn identify(cx: &CommandCx, c: cmds::Identify) -> Outcome {
    let ctrl = cx.ctrl();
    let nsid = c.nsid;
    let nn = ctrl.config().namespaces.len() as u32;
    let valid_nsid = nsid >= 1 && nsid <= nn;
    let page: Box<[u8; 4096]> = match c.cns {
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
            let ids = ctrl.namespaces().map(|ns| ns.id()).filter(|&id| id > nsid);
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
    cx.write_host(c.data, &page[..]).into()
}

fn copy_bytes<T: ByteValued>(value: &T) -> [u8; 4096] {
    let mut page = [0u8; 4096];
    let bytes = value.as_slice();
    page[..bytes.len()].copy_from_slice(bytes);
    page
}

/// The Identify Controller data structure (§5.15).
pub fn identify_controller(ctrl: &Ctrl) -> IdentifyController {
    let config = ctrl.config();
    let mut id = IdentifyController::zeroed();
    id.vid = VENDOR_ID.into();
    id.ssvid = VENDOR_ID.into();
    id.sn = ascii(&config.serial);
    id.mn = ascii("umdev NVMe controller");
    id.fr = ascii(env!("CARGO_PKG_VERSION"));
    id.rab = 6;
    id.mdts = 8; // 2^8 pages: 1 MiB
    id.cntlid = 1.into();
    id.ver = reg::VERSION_1_3.into();
    id.oacs = (1 << 8).into(); // Doorbell Buffer Config
    id.acl = 3;
    id.aerl = (MAX_AERS - 1) as u8;
    id.frmw = 0x03; // one slot, read-only
                    // Commands Supported and Effects log; extended data (NUMDU, offsets) for Get Log Page.
    id.lpa = 0x02 | 0x04;
    id.elpe = (ERROR_LOG_ENTRIES - 1) as u8;
    id.npss = 0;
    id.avscc = 1;
    id.wctemp = WCTEMP.into();
    id.cctemp = CCTEMP.into();
    id.sqes = 0x66;
    id.cqes = 0x44;
    id.nn = (config.namespaces.len() as u32).into();
    id.oncs = (1 << 0 | 1 << 2 | 1 << 3).into(); // Compare, Dataset Management, Write Zeroes
    id.vwc = 1;
    id.nvscc = 1;
    let nqn = format!("nqn.2026-12.dev.umdev:nvme:{}", config.serial);
    id.subnqn[..nqn.len().min(255)].copy_from_slice(&nqn.as_bytes()[..nqn.len().min(255)]);
    id.psd[0].mp = 2500.into(); // 25 W
    id
}

/// The Identify Namespace data structure of `ns` (§5.15).
pub fn identify_namespace(ns: &Namespace) -> IdentifyNamespace {
    let mut id = IdentifyNamespace::zeroed();
    id.nsze = ns.blocks().into();
    id.ncap = ns.blocks().into();
    id.nuse = ns.blocks().into();
    // Deallocated blocks read as zeroes; Write Zeroes may deallocate.
    id.dlfeat = 0x09;
    id.nguid = ns.nguid();
    id.lbaf[0] = (ns.lba_shift() << 16).into();
    id
}

/// The Namespace Identification Descriptor list of `ns` (§5.15).
fn ns_descriptors(ns: &Namespace) -> [u8; 4096] {
    let mut page = [0u8; 4096];
    let mut at = 0;
    for (nidt, id) in [(2u8, ns.nguid()), (3u8, uuid_of(ns.nguid()))] {
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

/// Get Features (§5.13): current, default or saved (= default) values.
fn get_features(cx: &CommandCx, c: cmds::GetFeatures) -> Outcome {
    if c.select > 2 {
        return Status::INVALID_FIELD.dnr().into(); // no Save/Select support (ONCS bit 4)
    }
    let ctrl = cx.ctrl();
    // Nothing is saved: the saved values are the defaults.
    let default = c.select != 0;
    let defaults = AdminState::new(ctrl.io_queues());
    let admin = ctrl.admin();
    let st = if default { &defaults } else { &*admin };
    let dw11 = c.dw11;
    let dw0 = match c.fid {
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
        feature::VOLATILE_WRITE_CACHE => u32::from(default || ctrl.write_cache()),
        feature::NUMBER_OF_QUEUES => u32::from(st.queues_granted.0) | u32::from(st.queues_granted.1) << 16,
        feature::INTERRUPT_COALESCING => {
            u32::from(st.coalescing.threshold) | u32::from(st.coalescing.time) << 8
        }
        feature::INTERRUPT_VECTOR_CONFIG => {
            let iv = dw11 & 0xffff;
            let Some(&cd) = st.coalescing_disabled.get(iv as usize) else {
                return Status::INVALID_FIELD.dnr().into();
            };
            iv | u32::from(cd) << 16
        }
        feature::WRITE_ATOMICITY => st.write_atomicity,
        feature::ASYNC_EVENT_CONFIG => st.async_config,
        _ => return Status::INVALID_FIELD.dnr().into(),
    };
    Outcome::ok(dw0)
}

/// Set Features (§5.21).
fn set_features(cx: &CommandCx, c: cmds::SetFeatures) -> Outcome {
    if c.save {
        return Status::FEATURE_NOT_SAVEABLE.dnr().into();
    }
    let ctrl = cx.ctrl();
    let mut admin = ctrl.admin();
    let mut dw0 = 0;
    match c.feature {
        Feature::Arbitration(v) => admin.arbitration = v,
        Feature::PowerManagement { ps, raw } => {
            if ps != 0 {
                return Status::INVALID_FIELD.dnr().into(); // one power state (NPSS 0)
            }
            admin.power_state = u32::from(raw);
        }
        Feature::TemperatureThreshold { kelvins, sensor, kind } => {
            if sensor != 0 || kind > 1 {
                return Status::INVALID_FIELD.dnr().into();
            }
            admin.thresholds[usize::from(kind)] = kelvins;
            if admin.update_temperature_warning() {
                admin.add_event(event::TYPE_SMART, event::TEMPERATURE_THRESHOLD, log_page::SMART);
                ctrl.deliver_events(&mut admin, &cx.ctx());
            }
        }
        Feature::ErrorRecovery { tler, dulbe } => {
            if dulbe {
                return Status::INVALID_FIELD.dnr().into(); // no DULBE
            }
            admin.error_recovery = u32::from(tler);
        }
        Feature::VolatileWriteCache(on) => ctrl.set_write_cache(on),
        Feature::NumberOfQueues { nsqr, ncqr } => {
            if nsqr == 0xffff || ncqr == 0xffff {
                return Status::INVALID_FIELD.dnr().into();
            }
            let queues = ctrl.queues();
            if queues.sqs.iter().skip(1).any(Option::is_some)
                || queues.cqs.iter().skip(1).any(Option::is_some)
            {
                return Status::COMMAND_SEQUENCE_ERROR.dnr().into();
            }
            let max = ctrl.io_queues() - 1;
            admin.queues_granted = (nsqr.min(max), ncqr.min(max));
            dw0 = u32::from(admin.queues_granted.0) | u32::from(admin.queues_granted.1) << 16;
        }
        Feature::InterruptCoalescing { threshold, time } => {
            admin.coalescing = Coalescing { threshold, time };
            apply_coalescing(ctrl, &admin);
        }
        Feature::InterruptVectorConfig { vector, disabled } => {
            let Some(cd) = admin.coalescing_disabled.get_mut(usize::from(vector)) else {
                return Status::INVALID_FIELD.dnr().into();
            };
            // Vector 0 stays uncoalesced (AdminState::coalescing_disabled).
            *cd = disabled || vector == 0;
            apply_coalescing(ctrl, &admin);
        }
        Feature::WriteAtomicity(dn) => admin.write_atomicity = u32::from(dn),
        Feature::AsyncEventConfig(v) => {
            admin.async_config = v & 0xff; // SMART critical warnings only (OAES 0)
            if admin.update_temperature_warning() {
                admin.add_event(event::TYPE_SMART, event::TEMPERATURE_THRESHOLD, log_page::SMART);
                ctrl.deliver_events(&mut admin, &cx.ctx());
            }
        }
        Feature::Other(_) => return Status::INVALID_FIELD.dnr().into(),
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

/// The checks Create I/O CQ and SQ share (§5.3, §5.4), in the order the statuses are given.
fn check_new_queue(
    ctrl: &Ctrl,
    qid: u16,
    entries: u32,
    contiguous: bool,
    base: u64,
    granted: u16,
    exists: bool,
) -> Result<(), Status> {
    if qid == 0 || qid > granted + 1 || exists {
        return Err(Status::INVALID_QUEUE_ID.dnr());
    }
    if entries < 2 || entries > ctrl.config().max_entries {
        return Err(Status::INVALID_QUEUE_SIZE.dnr());
    }
    if !contiguous {
        return Err(Status::INVALID_FIELD.dnr()); // CAP.CQR: queues must be contiguous
    }
    if base & (PAGE - 1) != 0 {
        return Err(Status::PRP_OFFSET_INVALID.dnr());
    }
    Ok(())
}

/// Create I/O Completion Queue (§5.3).
fn create_cq(cx: &CommandCx, c: cmds::CreateCq) -> Outcome {
    let ctrl = cx.ctrl();
    // Lock order: the admin state before the queue table.
    let (granted, coalescing, disabled) = {
        let admin = ctrl.admin();
        (admin.queues_granted.1, admin.coalescing, admin.coalescing_disabled.clone())
    };
    let mut queues = ctrl.queues();
    let exists = queues.cqs.get(usize::from(c.qid)).is_some_and(Option::is_some);
    if let Err(s) = check_new_queue(ctrl, c.qid, c.entries, c.contiguous, c.base, granted, exists) {
        return s.into();
    }
    if (ctrl.cc() >> 20) & 0xf != 4 {
        return Status::INVALID_FIELD.dnr().into(); // CC.IOCQES must be 16 bytes
    }
    let vectors = match ctrl.irq().mode() {
        IrqMode::Msix => ctrl.io_queues() + 1,
        _ => 1,
    };
    if c.interrupts && c.vector >= vectors {
        return Status::INVALID_VECTOR.dnr().into();
    }
    let cq = Arc::new(Cq::new(c.qid, c.base, c.entries, c.vector, c.interrupts));
    if !disabled.get(usize::from(c.vector)).copied().unwrap_or(true) {
        cq.set_coalescing(coalescing);
    }
    if !cx.current() {
        return Status::COMMAND_SEQUENCE_ERROR.into();
    }
    ctrl.open_cq_doorbell(c.qid, c.entries);
    queues.cqs[usize::from(c.qid)] = Some(cq);
    Outcome::ok(0)
}

/// Create I/O Submission Queue (§5.4): the queue and its worker.
fn create_sq(cx: &CommandCx, c: cmds::CreateSq) -> Outcome {
    let ctrl = cx.ctrl();
    let granted = ctrl.admin().queues_granted.0;
    let mut queues = ctrl.queues();
    let exists = queues.sqs.get(usize::from(c.qid)).is_some_and(Option::is_some);
    if let Err(s) = check_new_queue(ctrl, c.qid, c.entries, c.contiguous, c.base, granted, exists) {
        return s.into();
    }
    let cq = (c.cqid != 0).then(|| queues.cqs.get(usize::from(c.cqid)).cloned().flatten()).flatten();
    let Some(cq) = cq else {
        return Status::CQ_INVALID.dnr().into();
    };
    if (ctrl.cc() >> 16) & 0xf != 6 {
        return Status::INVALID_FIELD.dnr().into(); // CC.IOSQES must be 64 bytes
    }
    if !cx.current() {
        return Status::COMMAND_SEQUENCE_ERROR.into();
    }
    let sq = Arc::new(Sq::new(c.qid, c.base, c.entries, cq));
    ctrl.open_sq_doorbell(c.qid, c.entries);
    match ctrl.start_queue(&mut queues, sq, cx.generation()) {
        Ok(()) => Outcome::ok(0),
        Err(why) => {
            ctrl.warn(format_args!("nvme: starting the worker of SQ {}: {why}", c.qid));
            ctrl.open_sq_doorbell(c.qid, 0);
            Status::INTERNAL_ERROR.into()
        }
    }
}

/// Delete I/O Submission Queue (§5.6): its worker completes what is still queued as aborted,
/// then stops, before this completes.
fn delete_sq(cx: &CommandCx, qid: u16) -> Outcome {
    let ctrl = cx.ctrl();
    let entry = {
        let mut queues = ctrl.queues();
        match (qid, queues.sqs.get_mut(usize::from(qid))) {
            (1.., Some(slot @ Some(_))) => {
                // Stopped before it leaves the table: once the queue is gone from it, its
                // worker fetches nothing more.
                if let Some(e) = slot.as_ref() {
                    e.stop(Stop::Delete);
                }
                slot.take()
            }
            _ => return Status::INVALID_QUEUE_ID.dnr().into(),
        }
    };
    if let Some(entry) = entry {
        let sq = entry.sq.clone();
        // A worker still blocked (in a backing that does not answer) posts nothing when it
        // wakes: the queue is gone, and what it would abort is no longer its ring's.
        if !ctrl.stop_queue(entry, Stop::Delete) {
            sq.retire();
        }
    }
    ctrl.open_sq_doorbell(qid, 0);
    Outcome::ok(0)
}

/// Delete I/O Completion Queue (§5.5).
fn delete_cq(cx: &CommandCx, qid: u16) -> Outcome {
    let ctrl = cx.ctrl();
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

/// Get Log Page (§5.14): NUMD + 1 dwords of the page from the offset.
fn get_log_page(cx: &CommandCx, c: cmds::GetLogPage) -> Outcome {
    let ctrl = cx.ctrl();
    if c.offset & 3 != 0 {
        return Status::INVALID_FIELD.dnr().into();
    }
    let page: Vec<u8> = match c.lid {
        log_page::ERROR => {
            let admin = ctrl.admin();
            let mut page = vec![0u8; ERROR_LOG_ENTRIES * 64];
            for (slot, e) in page.chunks_exact_mut(64).zip(admin.errors()) {
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
        log_page::COMMAND_EFFECTS => command_effects().to_vec(),
        _ => return Status::INVALID_LOG_PAGE.dnr().into(),
    };
    if c.offset >= page.len() as u64 {
        return Status::INVALID_FIELD.dnr().into();
    }
    let want = usize::try_from(c.dwords * 4).unwrap_or(usize::MAX).min(prp::MAX_TRANSFER);
    let status = cx.write_host_padded(c.data, &page[c.offset as usize..], want);
    if status.ok() && !c.rae {
        // Reading the page acknowledges its event type: more may be reported.
        let kind = match c.lid {
            log_page::ERROR => Some(event::TYPE_ERROR),
            log_page::SMART => Some(event::TYPE_SMART),
            _ => None,
        };
        if let Some(kind) = kind {
            let mut admin = ctrl.admin();
            admin.acknowledge(kind);
            ctrl.deliver_events(&mut admin, &cx.ctx());
        }
    }
    status.into()
}

/// The Commands Supported and Effects log page (§5.14.1.5): a dword per admin opcode (bytes
/// 0-1023), then per I/O opcode (1024-2047), for the commands the controller runs.
pub fn command_effects() -> [u8; 4096] {
    use effects::{CSUPP, LBCC};
    let mut page = [0u8; 4096];
    let admin = [
        admin_op::DELETE_SQ,
        admin_op::CREATE_SQ,
        admin_op::GET_LOG_PAGE,
        admin_op::DELETE_CQ,
        admin_op::CREATE_CQ,
        admin_op::IDENTIFY,
        admin_op::ABORT,
        admin_op::SET_FEATURES,
        admin_op::GET_FEATURES,
        admin_op::ASYNC_EVENT,
        admin_op::DOORBELL_BUFFER_CONFIG,
    ];
    let io = [
        (nvm_op::FLUSH, CSUPP | LBCC),
        (nvm_op::WRITE, CSUPP | LBCC),
        (nvm_op::READ, CSUPP),
        (nvm_op::COMPARE, CSUPP),
        (nvm_op::WRITE_ZEROES, CSUPP | LBCC),
        (nvm_op::DSM, CSUPP | LBCC),
    ];
    let entries = admin.iter().map(|&op| (usize::from(op), CSUPP));
    for (at, bits) in entries.chain(io.iter().map(|&(op, bits)| (256 + usize::from(op), bits))) {
        page[at * 4..at * 4 + 4].copy_from_slice(&bits.to_le_bytes());
    }
    page
}

/// The SMART / Health Information log page as of now (§5.14.1.2).
pub fn smart_log(ctrl: &Ctrl) -> SmartLog {
    let totals = super::stats::Totals::of(ctrl.all_stats());
    let admin = ctrl.admin();
    let mut log = SmartLog::zeroed();
    log.critical_warning = admin.critical_warning;
    log.temperature = TEMPERATURE.to_le_bytes();
    log.available_spare = 100;
    log.available_spare_threshold = 10;
    // Data units are thousands of 512-byte units, rounded up. Compares count as reads, their
    // blocks as data read (§5.14.1.2).
    let bytes_read = totals.bytes_read + totals.bytes_compared;
    log.data_units_read = u128_le((bytes_read / 512).div_ceil(1000));
    log.data_units_written = u128_le((totals.bytes_written / 512).div_ceil(1000));
    log.host_reads = u128_le(totals.reads + totals.compares);
    log.host_writes = u128_le(totals.writes);
    log.power_cycles = u128_le(1);
    log.power_on_hours = u128_le(ctrl.born().elapsed().as_secs() / 3600);
    log.unsafe_shutdowns = u128_le(ctrl.unsafe_shutdowns());
    log.error_log_entries = u128_le(admin.error_count());
    log
}

/// Asynchronous Event Request (§5.2): held until an event.
fn async_event(cx: &CommandCx) -> Outcome {
    let ctrl = cx.ctrl();
    let mut admin = ctrl.admin();
    let cid = cx.cid();
    if !admin.add_request(cid) {
        return Status::AER_LIMIT.into();
    }
    ctrl.deliver_events(&mut admin, &cx.ctx());
    Outcome::Held
}

/// Doorbell Buffer Config (§5.10): I/O queues' doorbells are read from the shadow page from
/// now on, and the host writes a doorbell register only when an event index asks for it.
fn doorbell_buffer_config(cx: &CommandCx, c: cmds::DoorbellBufferConfig) -> Outcome {
    match cx.ctrl().set_shadow_doorbells(&cx.ctx(), c.shadow, c.eventidx) {
        Ok(()) => Outcome::ok(0),
        Err(status) => status.into(),
    }
}

/// Abort (§5.1): a command still waiting in its SQ completes with Command Abort Requested
/// when fetched (DW0 bit 0 = 0); anything else is not aborted (bit 0 = 1).
fn abort(cx: &CommandCx, c: cmds::Abort) -> Outcome {
    let ctrl = cx.ctrl();
    let sq = ctrl.queues().sqs.get(usize::from(c.sqid)).and_then(|e| e.as_ref()).map(|e| e.sq.clone());
    let Some(sq) = sq else { return Outcome::ok(1) };
    if c.sqid == 0 {
        return Outcome::ok(1); // admin commands run as fetched
    }
    match sq.abort(&cx.ctx(), c.cid, ctrl.sq_tail(c.sqid)) {
        Ok(true) => Outcome::ok(0),
        Ok(false) => Outcome::ok(1),
        Err(s) => s.into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_effects_log_names_exactly_the_opcodes_that_parse() {
        let page = command_effects();
        let dword = |at: usize| u32::from_le_bytes(page[at * 4..at * 4 + 4].try_into().unwrap());
        for op in 0..=255u8 {
            let sqe = Sqe::new(op, 0);
            let admin_runs = cmds::AdminCmd::parse(&sqe).is_ok();
            let io_runs = cmds::NvmCmd::parse(&sqe).is_ok();
            assert_eq!(dword(usize::from(op)) & effects::CSUPP != 0, admin_runs, "admin opcode {op:#x}");
            assert_eq!(dword(256 + usize::from(op)) & effects::CSUPP != 0, io_runs, "I/O opcode {op:#x}");
        }
        assert_eq!(dword(256 + usize::from(nvm_op::WRITE)), effects::CSUPP | effects::LBCC);
        assert_eq!(dword(256 + usize::from(nvm_op::READ)), effects::CSUPP);
    }
}
