//! The NVM command set (NVMe 1.3 §6): Read, Write, Compare, Flush, Write Zeroes, Dataset
//! Management.
//!
//! A Read or Write turns its PRPs into one page array ([`DataPages::resolve`]), pins it with ONE
//! call, and moves the data between the namespace's store and the pinned runs: a copy per run
//! for RAM; for a file, one transfer handed to the queue's io_uring ([`CommandCx::start`]),
//! which the worker completes with [`finish`] when the host is done (or, without an io_uring,
//! one synchronous `preadv2`/`pwritev2`). An unmap of the pinned memory meanwhile ends the
//! command with a data transfer error.

use umdev_pinning::Prot;
use vm_memory::ByteValued;

use super::cmds::{DatasetManagement, NvmCmd, ReadWrite, WriteZeroes};
use super::completion::{Command, Outcome, Transfer as Started};
use super::ctrl::Ctrl;
use super::cx::CommandCx;
use super::namespace::Namespace;
use super::prp::{self, DataPages};
use super::spec::{DsmRange, DsmRanges, Sqe, Status, PAGE};
use super::stats::Transfer;
use crate::aio::Op;
use crate::store::Durability;
use umdev_mdev::request::Permit;
use umdev_mdev::DeviceContext;

/// Runs an NVM command: its namespace is looked up first (§6: Invalid Namespace or Format
/// for one that is not active).
pub fn execute(cx: &CommandCx, cmd: NvmCmd) -> Outcome {
    let ctrl = cx.ctrl();
    if let NvmCmd::Flush(0xffff_ffff) = cmd {
        if ctrl.namespaces().any(|ns| ns.is_file() && ctrl.backing_held(ns.id())) {
            return Status::NAMESPACE_NOT_READY.into();
        }
        return flush(ctrl.namespaces());
    }
    let Some(ns) = ctrl.namespace(cmd.nsid()) else {
        return Status::INVALID_NAMESPACE.dnr().into();
    };
    // A backing that stopped answering holds no more: the host may retry later.
    if ns.is_file() && ctrl.backing_held(ns.id()) {
        return Status::NAMESPACE_NOT_READY.into();
    }
    match cmd {
        NvmCmd::Read(c) => read_write(cx, ns, c, true),
        NvmCmd::Write(c) => read_write(cx, ns, c, false),
        NvmCmd::Compare(c) => compare(cx, ns, c),
        // Nothing the cache holds can be promised durable any more: at once, as the
        // synchronous path's flush answers.
        NvmCmd::Flush(_) if ns.store().durability_lost() => flush(std::iter::once(ns)),
        NvmCmd::Flush(_) if cx.aio() && ns.is_file() => cx.start(Started {
            nsid: ns.id(),
            op: Op::Sync,
            pos: 0,
            segments: Default::default(),
            direct: false,
            dsync: false,
            fixed: None,
            stats: None,
        }),
        NvmCmd::Flush(_) => flush(std::iter::once(ns)),
        NvmCmd::WriteZeroes(c) => write_zeroes(cx, ns, c),
        NvmCmd::DatasetManagement(c) => dataset_management(cx, ns, c),
    }
}

/// A queued Read or Write entry as it reads before any check, parsed once for the worker's
/// hints ([`super::worker`]'s look ahead), never for running it: the command is parsed and
/// checked again when its turn comes.
pub struct Peek<'a> {
    ns: &'a Namespace,
    c: ReadWrite,
    read: bool,
}

impl<'a> Peek<'a> {
    /// `sqe` if it is a Read or Write of an active namespace.
    pub fn of(ctrl: &'a Ctrl, sqe: &Sqe) -> Option<Peek<'a>> {
        let (c, read) = match NvmCmd::parse(sqe) {
            Ok(NvmCmd::Read(c)) => (c, true),
            Ok(NvmCmd::Write(c)) => (c, false),
            _ => return None,
        };
        ctrl.namespace(c.nsid).map(|ns| Peek { ns, c, read })
    }

    /// The bytes it moves.
    pub fn len(&self) -> u64 {
        u64::from(self.c.blocks) << self.ns.lba_shift()
    }

    /// Whether it reads a RAM namespace: a copy from the store, as random reads' are mostly
    /// from memory no cache holds.
    pub fn reads_ram(&self) -> bool {
        self.read && !self.ns.is_file()
    }

    /// Starts loading its PRP list, if it has one (the host wrote it in its own cache just
    /// before it rang), and, if it reads a RAM namespace, the first 4 KiB it reads there:
    /// for the worker to call with the next queued entry before it runs the one ahead of it,
    /// whose work then hides these trips. Nothing is checked or kept.
    pub fn prefetch(&self, ctx: &DeviceContext) {
        let len = self.len();
        let data = self.c.data;
        let first = PAGE - (data.prp1() & (PAGE - 1));
        // One entry per page after the first; a list only for more than two pages.
        let entries = len.saturating_sub(first).div_ceil(PAGE);
        if entries > 1 {
            ctx.prefetch(data.prp2(), (entries * 8) as usize);
        }
        if self.reads_ram() && self.ns.in_range(self.c.slba, u64::from(self.c.blocks)) {
            // In range: the position is below the namespace's size.
            self.ns.store().prefetch(self.c.slba << self.ns.lba_shift(), len as usize);
        }
    }
}

/// Read (§6.4) and Write (§6.9): one pin call, one vectored transfer.
fn read_write(cx: &CommandCx, ns: &Namespace, c: ReadWrite, read: bool) -> Outcome {
    let nlb = u64::from(c.blocks);
    if !ns.in_range(c.slba, nlb) {
        return Status::LBA_OUT_OF_RANGE.dnr().into();
    }
    let len = (nlb << ns.lba_shift()) as usize;
    if len > prp::MAX_TRANSFER {
        return Status::INVALID_FIELD.dnr().into(); // over MDTS
    }
    let mut pages = DataPages::default();
    if let Err(s) = pages.resolve(&cx.ctx(), c.data.prp1(), c.data.prp2(), len) {
        return s.into();
    }
    // A read writes guest memory.
    let prot = if read { Prot::WRITE } else { Prot::READ };
    let pos = c.slba << ns.lba_shift();
    let durability = if c.fua || !cx.ctrl().write_cache() { Durability::Sync } else { Durability::Cached };
    // FUA on a read (§6.9): what the host caches of the blocks is made durable first. The
    // store cannot sync a range alone: the whole file, as a Flush (Linux never sets it).
    if read && c.fua {
        if let Err(e) = ns.store().flush() {
            ns.warn(format_args!("nvme: ns{}: flush for a read with FUA: {e}", ns.id()));
            return Status::WRITE_FAULT.into();
        }
    }
    if !read && durability == Durability::Sync {
        if let Err(e) = ns.store().durable() {
            log::debug!("nvme: ns{}: durable write refused: {e}", ns.id());
            return Status::WRITE_FAULT.into();
        }
    }
    if cx.aio() && ns.is_file() {
        let pinned = match cx.pin_for_transfer(&pages.pfns, prot, pages.offset as u64, len) {
            Ok(p) => p,
            Err(status) => return status.into(),
        };
        let direct = ns.store().direct_fits(pos, &pinned.segments);
        let stats = Transfer {
            pages: pages.pfns.len() as u64,
            runs: pinned.runs,
            list_pages: u64::from(pages.list_pages),
            bytes: len as u64,
            read,
            fixed: false,
        };
        // A fixed buffer spares the host a pin of its own per page; O_DIRECT is what takes
        // those pins (a buffered transfer only copies), so only there is it worth its setup.
        let fixed = pinned.fixed.filter(|_| direct && cx.ctrl().config().fixed_buffers.wants(len));
        return cx.start(Started {
            nsid: ns.id(),
            op: if read { Op::Read } else { Op::Write },
            pos,
            segments: pinned.segments,
            direct,
            dsync: durability == Durability::Sync,
            fixed,
            stats: Some(stats),
        });
    }
    let moved = cx.with_pins(&pages.pfns, prot, |pins| {
        let runs = pins.runs().len() as u64;
        let moved = match pins.io_slices(pages.offset as u64, len, prot) {
            Err(_) => Err(Status::DATA_TRANSFER_ERROR),
            // The memory could not be reached (gone under the transfer): as `finish` says.
            Ok(slices) if read => {
                ns.store().read_vectored(pos, &slices).map_err(|e| match e.raw_os_error() {
                    Some(libc::EFAULT) => Status::DATA_TRANSFER_ERROR,
                    _ => {
                        ns.warn(format_args!("nvme: ns{}: read of {len} bytes at {pos}: {e}", ns.id()));
                        Status::UNRECOVERED_READ_ERROR
                    }
                })
            }
            // Unfenced: the completion entry's write fences it (`Cq`'s `write_cqe`).
            Ok(slices) => ns.store().write_vectored_unfenced(pos, &slices, durability).map_err(|e| {
                match e.raw_os_error() {
                    Some(libc::EFAULT) => Status::DATA_TRANSFER_ERROR,
                    _ => {
                        ns.warn(format_args!("nvme: ns{}: write of {len} bytes at {pos}: {e}", ns.id()));
                        write_status(&e)
                    }
                }
            }),
        };
        (moved, runs, pins.poisoned())
    });
    let ((moved, runs, poisoned), unmapped) = match moved {
        Ok(r) => r,
        Err(e) => {
            // Where the client mapped no memory for the data (SPDK's initiator maps at most
            // 16 regions, say): visible at the default level, within the budget.
            cx.ctrl().warn(format_args!(
                "nvme: queue {}: {} of {} pages: {e}: Data Transfer Error",
                cx.sq().id,
                if read { "a read" } else { "a write" },
                pages.pfns.len(),
            ));
            return Status::DATA_TRANSFER_ERROR.into();
        }
    };
    // The client truncated the memory, or unmapped it while we held it (whatever the store
    // made of the memory's loss).
    if poisoned || unmapped {
        return Status::DATA_TRANSFER_ERROR.into();
    }
    if let Err(status) = moved {
        return status.into();
    }
    cx.ctrl().stats(cx.sq().id).transfer(Transfer {
        pages: pages.pfns.len() as u64,
        runs,
        list_pages: u64::from(pages.list_pages),
        bytes: len as u64,
        read,
        fixed: false,
    });
    Outcome::ok(0)
}

/// The end of a transfer `t` the queue's io_uring ran for `permit`'s command (`fixed`: through
/// a fixed buffer): its pins let go of (after the host finished with the memory), counted,
/// and the command completed with the status `result` calls for.
pub fn finish((mut permit, t): (Permit<Command>, Started), result: std::io::Result<u64>, fixed: bool) {
    let poisoned = permit.pins().iter().any(|p| p.poisoned());
    // The client truncated the memory, or unmapped it while the host was moving it.
    let unmapped = permit.release_pins();
    let (ctrl, qid, nsid) = (permit.shared().ctrl().clone(), permit.shared().sq().id, t.nsid);
    let status = match result {
        // Whatever the host made of the memory's loss, as in the synchronous path.
        _ if poisoned || unmapped => Status::DATA_TRANSFER_ERROR,
        Ok(_) => {
            if let Some(stats) = t.stats {
                ctrl.stats(qid).transfer(Transfer { fixed, ..stats });
            }
            Status::SUCCESS
        }
        Err(e) => match e.raw_os_error() {
            // The memory could not be reached (gone under the transfer).
            Some(libc::EFAULT) => Status::DATA_TRANSFER_ERROR,
            // Cancelled as its queue stopped (a deletion; after a reset nothing is posted).
            Some(libc::ECANCELED) => Status::ABORTED_SQ_DELETION,
            _ => {
                let len: usize = t.segments.iter().map(|s| s.1).sum();
                let ns = ctrl.namespace(nsid);
                // A failed sync may have been a failed write-back: the store says whether.
                if t.op == Op::Sync || (t.op == Op::Write && t.dsync) {
                    if let Some(ns) = &ns {
                        ns.store().lose_durability(&e);
                    }
                }
                let warn = |what: std::fmt::Arguments<'_>| match &ns {
                    Some(ns) => ns.warn(what),
                    None => log::warn!("{what}"),
                };
                match t.op {
                    Op::Read => {
                        warn(format_args!("nvme: ns{nsid}: read of {len} bytes at {}: {e}", t.pos));
                        Status::UNRECOVERED_READ_ERROR
                    }
                    Op::Write => {
                        warn(format_args!("nvme: ns{nsid}: write of {len} bytes at {}: {e}", t.pos));
                        write_status(&e)
                    }
                    Op::Sync => {
                        warn(format_args!("nvme: ns{nsid}: flush: {e}"));
                        Status::WRITE_FAULT
                    }
                }
            }
        },
    };
    super::completion::complete(permit, status.into());
}

/// Bytes Compare reads from the store and from the guest at a time, into buffers on the
/// worker's stack.
const COMPARE_CHUNK: usize = 16 << 10;

/// Compare (§6.1): the blocks read from the store and the guest's data, a chunk of each at a
/// time, compared; Compare Failure at the first that differs.
fn compare(cx: &CommandCx, ns: &Namespace, c: ReadWrite) -> Outcome {
    let nlb = u64::from(c.blocks);
    if !ns.in_range(c.slba, nlb) {
        return Status::LBA_OUT_OF_RANGE.dnr().into();
    }
    let len = (nlb << ns.lba_shift()) as usize;
    if len > prp::MAX_TRANSFER {
        return Status::INVALID_FIELD.dnr().into(); // over MDTS
    }
    let mut pages = DataPages::default();
    if let Err(s) = pages.resolve(&cx.ctx(), c.data.prp1(), c.data.prp2(), len) {
        return s.into();
    }
    let pos = c.slba << ns.lba_shift();
    let compared = cx.with_pins(&pages.pfns, Prot::READ, |pins| {
        let (mut stored, mut given) = ([0u8; COMPARE_CHUNK], [0u8; COMPARE_CHUNK]);
        let mut done = 0;
        while done < len {
            let n = (len - done).min(COMPARE_CHUNK);
            if let Err(e) = ns.store().read(pos + done as u64, &mut stored[..n]) {
                ns.warn(format_args!("nvme: ns{}: read of {len} bytes for a compare: {e}", ns.id()));
                return Status::UNRECOVERED_READ_ERROR;
            }
            if pins.read((pages.offset + done) as u64, &mut given[..n]).is_err() {
                return Status::DATA_TRANSFER_ERROR;
            }
            if stored[..n] != given[..n] {
                return Status::COMPARE_FAILURE;
            }
            done += n;
        }
        Status::SUCCESS
    });
    match compared {
        Ok((status, false)) => {
            if status == Status::SUCCESS || status == Status::COMPARE_FAILURE {
                cx.ctrl().stats(cx.sq().id).compare(len as u64);
            }
            status.into()
        }
        // Unmapped under the compare, or not pinned at all.
        Ok((_, true)) | Err(_) => Status::DATA_TRANSFER_ERROR.into(),
    }
}

/// The status of a write the store failed (§4.6.1.2): Capacity Exceeded when the host is out
/// of space for it, Write Fault otherwise.
fn write_status(e: &std::io::Error) -> Status {
    match e.raw_os_error() {
        Some(libc::ENOSPC) | Some(libc::EDQUOT) => Status::CAPACITY_EXCEEDED,
        _ => Status::WRITE_FAULT,
    }
}

/// Flush (§6.3): the namespaces' stores made durable.
fn flush<'a>(namespaces: impl Iterator<Item = &'a Namespace>) -> Outcome {
    for ns in namespaces {
        if let Err(e) = ns.store().flush() {
            ns.warn(format_args!("nvme: ns{}: flush: {e}", ns.id()));
            return Status::WRITE_FAULT.into();
        }
    }
    Outcome::ok(0)
}

/// Write Zeroes (§6.11): the range deallocated, reading as zeroes; made durable before the
/// completion with FUA or the volatile write cache off, as a Write is.
fn write_zeroes(cx: &CommandCx, ns: &Namespace, c: WriteZeroes) -> Outcome {
    let nlb = u64::from(c.blocks);
    if !ns.in_range(c.slba, nlb) {
        return Status::LBA_OUT_OF_RANGE.dnr().into();
    }
    let stop = || cx.cancelled();
    let zeroed = ns.store().write_zeroes_until(c.slba << ns.lba_shift(), nlb << ns.lba_shift(), &stop);
    match zeroed.and_then(|done| if done { durable(cx, ns, c.fua).map(|()| true) } else { Ok(false) }) {
        Ok(true) => Outcome::ok(0),
        Ok(false) => Status::ABORT_REQUESTED.into(),
        Err(e) => {
            ns.warn(format_args!("nvme: ns{}: write zeroes: {e}", ns.id()));
            write_status(&e).into()
        }
    }
}

/// What a command changed in `ns`'s store made durable now if `fua` or the volatile write
/// cache is off (a flush: the store cannot make one range durable alone).
fn durable(cx: &CommandCx, ns: &Namespace, fua: bool) -> std::io::Result<()> {
    if fua || !cx.ctrl().write_cache() {
        ns.store().flush()?;
    }
    Ok(())
}

/// `(first block, blocks)` ranges sorted and merged where they overlap or touch, empty ones
/// dropped, in `out` (as many as the ranges at most): the merged ranges.
fn merge_ranges(ranges: impl Iterator<Item = (u64, u64)>, out: &mut [(u64, u64)]) -> &[(u64, u64)] {
    let mut n = 0;
    for (range, slot) in ranges.filter(|&(_, nlb)| nlb > 0).zip(out.iter_mut()) {
        *slot = range;
        n += 1;
    }
    let sorted = &mut out[..n];
    sorted.sort_unstable();
    // Ranges in range of the namespace: no sum overflows.
    let mut kept = 0usize;
    for i in 0..n {
        let (slba, nlb) = sorted[i];
        match kept.checked_sub(1) {
            Some(last) if slba <= sorted[last].0 + sorted[last].1 => {
                let (first, count) = sorted[last];
                sorted[last].1 = count.max(slba + nlb - first);
            }
            _ => {
                sorted[kept] = (slba, nlb);
                kept += 1;
            }
        }
    }
    &out[..kept]
}

/// Dataset Management (§6.2): with AD, every range checked, then deallocated.
fn dataset_management(cx: &CommandCx, ns: &Namespace, c: DatasetManagement) -> Outcome {
    let mut list = DsmRanges::zeroed();
    let bytes = &mut list.as_mut_slice()[..c.ranges * std::mem::size_of::<DsmRange>()];
    let status = cx.read_host(c.data, bytes);
    if !status.ok() {
        return status.into();
    }
    let ranges = &list.ranges[..c.ranges];
    if !c.deallocate {
        return Outcome::ok(0); // only hints (IDR, IDW): nothing to do
    }
    let blocks = |r: &DsmRange| (u64::from(r.slba), u64::from(u32::from(r.nlb)));
    if ranges.iter().any(|r| !ns.in_range(blocks(r).0, blocks(r).1)) {
        return Status::LBA_OUT_OF_RANGE.dnr().into();
    }
    // Ranges may overlap (the spec does not forbid it): merged, a command zeroes each block
    // once at most, where a store that cannot punch holes writes the zeros. Unmerged, 256
    // ranges each naming the whole namespace would write it 256 times.
    let mut merged = [(0u64, 0u64); 256];
    let merged = merge_ranges(ranges.iter().map(blocks), &mut merged);
    let stop = || cx.cancelled();
    for &(slba, nlb) in merged {
        match ns.store().write_zeroes_until(slba << ns.lba_shift(), nlb << ns.lba_shift(), &stop) {
            Ok(true) => {}
            Ok(false) => return Status::ABORT_REQUESTED.into(),
            Err(e) => {
                ns.warn(format_args!("nvme: ns{}: deallocate: {e}", ns.id()));
                return Status::WRITE_FAULT.into();
            }
        }
    }
    // With the write cache off, deallocated blocks read as zeroes after a power loss too.
    if let Err(e) = durable(cx, ns, false) {
        ns.warn(format_args!("nvme: ns{}: deallocate: {e}", ns.id()));
        return Status::WRITE_FAULT.into();
    }
    Outcome::ok(0)
}

#[cfg(test)]
mod tests {
    use super::merge_ranges;

    fn merged(ranges: &[(u64, u64)]) -> Vec<(u64, u64)> {
        let mut out = [(0, 0); 256];
        merge_ranges(ranges.iter().copied(), &mut out).to_vec()
    }

    #[test]
    fn overlapping_ranges_are_zeroed_once() {
        // 256 ranges that each name the whole namespace: one.
        assert_eq!(merged(&[(0, 1 << 20); 256]), [(0, 1 << 20)]);
        // Unsorted, nested, touching and overlapping ranges; empty ones dropped.
        let ranges = [(100, 10), (0, 8), (8, 2), (105, 2), (50, 0), (200, 5), (109, 20), (30, 1)];
        assert_eq!(merged(&ranges), [(0, 10), (30, 1), (100, 29), (200, 5)]);
        assert_eq!(merged(&[(7, 0)]), []);
        // Apart by one block: two.
        assert_eq!(merged(&[(0, 4), (5, 4)]), [(0, 4), (5, 4)]);
        // The namespace's last block.
        assert_eq!(merged(&[(u64::MAX - 3, 3), (u64::MAX - 5, 3)]), [(u64::MAX - 5, 5)]);
    }
}
