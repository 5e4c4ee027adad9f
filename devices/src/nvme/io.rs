//! The NVM command set: Read, Write, Flush, Write Zeroes, Dataset Management.
//!
//! A Read or Write turns its PRPs into one page array ([`prp::resolve`]), pins it with ONE
//! call, and moves the data between the namespace's store and the pinned runs with one
//! vectored call (`preadv2`/`pwritev2` for a file, a copy per run for RAM). An unmap of the
//! pinned memory meanwhile ends the command with a data transfer error.

use std::sync::atomic::Ordering;

use umdev_pinning::Prot;
use vm_memory::ByteValued;

use super::namespace::Namespace;
use super::prp;
use super::spec::{nvm_op, DsmRange, DsmRanges, Sqe, Status};
use super::stats::Transfer;
use super::worker::{Command, Outcome, QueueWorker};
use crate::store::Durability;
use umdev_mdev::request::Permit;

/// Executes an I/O command, taking its pins through its `permit`.
pub fn execute(w: &QueueWorker, permit: &mut Permit<Command>, sqe: &Sqe) -> Outcome {
    if sqe.fuse() != 0 || sqe.psdt() != 0 {
        return Status::INVALID_FIELD.dnr().into(); // no fused commands, no SGLs
    }
    let nsid = u32::from(sqe.nsid);
    let ctrl = &w.ctrl;
    if sqe.opcode() == nvm_op::FLUSH && nsid == 0xffff_ffff {
        return flush(ctrl.config.namespaces.iter().flatten());
    }
    let Some(ns) = ctrl.namespace(nsid) else {
        return match sqe.opcode() {
            nvm_op::FLUSH | nvm_op::WRITE | nvm_op::READ | nvm_op::WRITE_ZEROES | nvm_op::DSM => {
                Status::INVALID_NAMESPACE.dnr().into()
            }
            _ => Status::INVALID_OPCODE.dnr().into(),
        };
    };
    match sqe.opcode() {
        nvm_op::READ => read_write(w, permit, ns, sqe, true),
        nvm_op::WRITE => read_write(w, permit, ns, sqe, false),
        nvm_op::FLUSH => flush(std::iter::once(ns)),
        nvm_op::WRITE_ZEROES => write_zeroes(ns, sqe),
        nvm_op::DSM => dataset_management(w, ns, sqe),
        _ => Status::INVALID_OPCODE.dnr().into(),
    }
}

/// Starting LBA (dwords 10-11) and block count (dword 12, 0's based) of a command.
fn lba_range(sqe: &Sqe) -> (u64, u64) {
    (u64::from(sqe.dw(10)) | u64::from(sqe.dw(11)) << 32, u64::from(sqe.dw(12) & 0xffff) + 1)
}

fn read_write(
    w: &QueueWorker,
    permit: &mut Permit<Command>,
    ns: &Namespace,
    sqe: &Sqe,
    read: bool,
) -> Outcome {
    let (slba, nlb) = lba_range(sqe);
    if !ns.in_range(slba, nlb) {
        return Status::LBA_OUT_OF_RANGE.dnr().into();
    }
    let len = (nlb << ns.lba_shift) as usize;
    if len > prp::MAX_TRANSFER {
        return Status::INVALID_FIELD.dnr().into(); // over MDTS
    }
    let pages = match prp::resolve(&w.ctx, sqe.prp1.into(), sqe.prp2.into(), len) {
        Ok(p) => p,
        Err(s) => return s.into(),
    };
    // A read writes guest memory.
    let prot = if read { Prot::WRITE } else { Prot::READ };
    let pins = match permit.pin_pages(&pages.pfns, prot) {
        Ok(pins) => pins,
        Err(e) => {
            log::debug!(
                "nvme: pinning {} pages for {}: {e}",
                pages.pfns.len(),
                if read { "a read" } else { "a write" }
            );
            return Status::DATA_TRANSFER_ERROR.into();
        }
    };
    let runs = pins.runs().len() as u64;
    let pos = slba << ns.lba_shift;
    let moved = match pins.io_slices(pages.offset as u64, len, prot) {
        Err(_) => Err(Status::DATA_TRANSFER_ERROR),
        Ok(slices) if read => ns.store.read_vectored(pos, &slices).map_err(|e| {
            log::warn!("nvme: ns{}: read of {len} bytes at {pos}: {e}", ns.id);
            Status::UNRECOVERED_READ_ERROR
        }),
        Ok(slices) => {
            let fua = sqe.dw(12) & 1 << 30 != 0;
            let durability = if fua || !w.ctrl.write_cache.load(Ordering::Relaxed) {
                Durability::Sync
            } else {
                Durability::Cached
            };
            ns.store.write_vectored(pos, &slices, durability).map_err(|e| {
                log::warn!("nvme: ns{}: write of {len} bytes at {pos}: {e}", ns.id);
                Status::WRITE_FAULT
            })
        }
    };
    let poisoned = pins.poisoned();
    let unmapped = permit.release_pins();
    if let Err(status) = moved {
        return status.into();
    }
    // The client truncated the memory, or unmapped it while we held it.
    if poisoned || unmapped {
        return Status::DATA_TRANSFER_ERROR.into();
    }
    w.stats().transfer(Transfer {
        pages: pages.pfns.len() as u64,
        runs,
        list_pages: u64::from(pages.list_pages),
        bytes: len as u64,
        read,
    });
    Outcome::ok(0)
}

fn flush<'a>(namespaces: impl Iterator<Item = &'a Namespace>) -> Outcome {
    for ns in namespaces {
        if let Err(e) = ns.store.flush() {
            log::warn!("nvme: ns{}: flush: {e}", ns.id);
            return Status::WRITE_FAULT.into();
        }
    }
    Outcome::ok(0)
}

fn write_zeroes(ns: &Namespace, sqe: &Sqe) -> Outcome {
    let (slba, nlb) = lba_range(sqe);
    if !ns.in_range(slba, nlb) {
        return Status::LBA_OUT_OF_RANGE.dnr().into();
    }
    match ns.store.write_zeroes(slba << ns.lba_shift, nlb << ns.lba_shift) {
        Ok(()) => Outcome::ok(0),
        Err(e) => {
            log::warn!("nvme: ns{}: write zeroes: {e}", ns.id);
            Status::WRITE_FAULT.into()
        }
    }
}

fn dataset_management(w: &QueueWorker, ns: &Namespace, sqe: &Sqe) -> Outcome {
    let count = (sqe.dw(10) & 0xff) as usize + 1;
    let deallocate = sqe.dw(11) & 1 << 2 != 0;
    let mut list = DsmRanges::zeroed();
    let bytes = &mut list.as_mut_slice()[..count * std::mem::size_of::<DsmRange>()];
    let status = super::admin::from_host(w, sqe, bytes);
    if !status.ok() {
        return status.into();
    }
    let ranges = &list.ranges[..count];
    if !deallocate {
        return Outcome::ok(0); // only hints (IDR, IDW): nothing to do
    }
    // Every range is checked before any is deallocated.
    let blocks = |r: &DsmRange| (u64::from(r.slba), u64::from(u32::from(r.nlb)));
    if ranges.iter().any(|r| !ns.in_range(blocks(r).0, blocks(r).1)) {
        return Status::LBA_OUT_OF_RANGE.dnr().into();
    }
    for r in ranges {
        // A store that cannot punch holes writes the zeros: up to 256 whole-namespace ranges.
        // A reset does not wait for them.
        if w.cancelled() {
            return Status::ABORT_REQUESTED.into();
        }
        let (slba, nlb) = blocks(r);
        if let Err(e) = ns.store.write_zeroes(slba << ns.lba_shift, nlb << ns.lba_shift) {
            log::warn!("nvme: ns{}: deallocate: {e}", ns.id);
            return Status::WRITE_FAULT.into();
        }
    }
    Outcome::ok(0)
}
