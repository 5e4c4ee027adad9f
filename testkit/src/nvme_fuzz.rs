//! The nvme controller under arbitrary submission entries and arbitrary guest memory: the
//! harness of the `nvme` fuzz target (`fuzz/fuzz_targets/nvme.rs`) and of its corpus replay.
//!
//! For fuzzers and their corpus replay; not API.
//!
//! [`run`] brings a controller up in-process ([`crate::nvme_rig`]: one 1 MiB RAM namespace,
//! one I/O queue pair of [`IO_ENTRIES`]), writes the input's bytes into guest memory where
//! the commands' data and PRP lists are, submits the input's commands as they are (but for
//! the command identifier, and PRPs steered into that memory unless the input says not to),
//! and panics unless:
//!
//! - no completion carries Internal Error, which the controller posts only when a command's
//!   handling panicked or the worker lost track of it;
//! - no completion of a command the input submitted is posted twice;
//! - the controller then still works: a reset (CC.EN cleared and set) completes, no worker
//!   of before it is left running, and after it Identify and a write read back through a new
//!   I/O queue succeed;
//! - the read-only guest memory was never written.
//!
//! Commands that change the queues or how the host rings them (Create and Delete I/O
//! Queue, Doorbell Buffer Config) and Asynchronous Event Requests, which are held until an
//! event, are skipped: they would change what the harness can expect of the queues, and
//! `tests/nvme_hostile.rs` drives them. A command whose PRPs point at the driver's own
//! queues can corrupt them, as a guest can; the harness then cannot tell a lost completion
//! from a trampled one, so it does not require every command to complete, only the checks
//! above. (An input could in principle forge a completion: write a block that looks like
//! one, then read it into the driver's completion queue. A report of Internal Error or of a
//! repeat is checked against the input before it is taken for the controller's.)
//!
//! Input layout: `config u8` (bits 0-5: how many commands, at most [`MAX_COMMANDS`]; bit 7:
//! the driver turns on shadow doorbells first, as Linux does, so the I/O queue's tail is read
//! from guest memory), then that many records of
//! [`RECORD`] bytes (fewer if the input ends): `flags u8` (bit 0: the I/O queue, else the
//! admin queue; bit 1: ring the doorbell after it; bit 2: PRPs as given, else each taken
//! modulo [`WINDOW`] into the data window; bit 3: not a command but a doorbell poke, see
//! [`Submission::poke`]), then the 64-byte entry; then the rest of the
//! input, up to [`WINDOW`] bytes, written at [`crate::nvme_rig::DATA`]. All queues are rung at
//! the end.

use std::collections::HashSet;
use std::os::unix::fs::FileExt;
use std::time::{Duration, Instant};

use umdev_devices::nvme::namespace::Backing;
use umdev_devices::nvme::spec::{self, admin_op, nvm_op, Cqe, Sqe, Status};
use umdev_devices::nvme::NvmeConfig;
use vm_memory::ByteValued;

use crate::nvme_driver::{Driver, Transport};
use crate::nvme_rig::{Rig, DATA, RO};

/// Bytes of guest memory the input fills and steered PRPs point into.
pub const WINDOW: u64 = 64 << 10;
/// Bytes of one command record.
pub const RECORD: usize = 1 + 64;
/// Commands an input submits at most.
pub const MAX_COMMANDS: usize = 48;
/// Entries of the I/O queue pair.
pub const IO_ENTRIES: u32 = 16;
/// How long the harness waits for completions once nothing new arrives.
const QUIET: Duration = Duration::from_millis(30);
/// How long it waits for completions at most.
const SETTLE: Duration = Duration::from_secs(5);

/// One submission of an input: an entry, the queue it goes on, and how.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Submission {
    /// On the I/O queue (else the admin queue).
    pub io: bool,
    /// Ring the queue's doorbell after writing it.
    pub ring: bool,
    /// PRPs as given (else steered into the data window).
    pub raw_prps: bool,
    /// Not a command: the entry's dwords 0 and 1, raised to at least the I/O queue's size (a
    /// valid value the harness cannot tell from its own), are the I/O queue's SQ tail and CQ
    /// head as a guest may leave them: written into the shadow page with shadow doorbells on
    /// (then the SQ's register is rung with the driver's own tail, so the worker reads the
    /// page), else into the registers.
    pub poke: bool,
    /// The submission entry.
    pub sqe: Sqe,
}

/// What one input describes.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Input {
    /// Shadow doorbells on (Doorbell Buffer Config) before the commands.
    pub shadow: bool,
    /// The commands.
    pub commands: Vec<Submission>,
    /// The bytes for the data window.
    pub mem: Vec<u8>,
}

/// Decodes an input.
pub fn decode(data: &[u8]) -> Input {
    let Some((&config, rest)) = data.split_first() else { return Input::default() };
    let n = usize::from(config & 0x3f).min(MAX_COMMANDS);
    let records = rest.len().min(n * RECORD) / RECORD;
    let commands = rest[..records * RECORD]
        .chunks_exact(RECORD)
        .map(|r| {
            let mut sqe = Sqe::default();
            sqe.as_mut_slice().copy_from_slice(&r[1..]);
            Submission {
                io: r[0] & 1 != 0,
                ring: r[0] & 2 != 0,
                raw_prps: r[0] & 4 != 0,
                poke: r[0] & 8 != 0,
                sqe,
            }
        })
        .collect();
    let mem = &rest[records * RECORD..];
    Input { shadow: config & 0x80 != 0, commands, mem: mem[..mem.len().min(WINDOW as usize)].to_vec() }
}

/// Encodes an input (for seeds).
pub fn encode(input: &Input) -> Vec<u8> {
    let Input { shadow, commands, mem } = input;
    let mut out = vec![commands.len().min(MAX_COMMANDS) as u8 | u8::from(*shadow) << 7];
    for c in commands {
        out.push(u8::from(c.io) | u8::from(c.ring) << 1 | u8::from(c.raw_prps) << 2 | u8::from(c.poke) << 3);
        out.extend_from_slice(c.sqe.as_slice());
    }
    out.extend_from_slice(mem);
    out
}

/// Whether the harness submits a command with this opcode on the admin queue (see the
/// module's documentation for those it skips).
fn admin_allowed(opcode: u8) -> bool {
    !matches!(
        opcode,
        admin_op::DELETE_SQ
            | admin_op::CREATE_SQ
            | admin_op::DELETE_CQ
            | admin_op::CREATE_CQ
            | admin_op::ASYNC_EVENT
            | admin_op::DOORBELL_BUFFER_CONFIG
    )
}

/// Runs one input (see the module's documentation).
pub fn run(data: &[u8]) {
    let Input { shadow, commands, mem } = decode(data);
    // No background pass over the disk: a thread per input that races the commands would
    // make runs differ (which copies are plain) and slow each input down.
    let config = NvmeConfig {
        namespaces: vec![Some(Backing::Ram(1 << 20))],
        ram_populate: Some(false),
        ..NvmeConfig::default()
    };
    let mut d = Driver::new(Rig::with(config, true));
    d.enable().unwrap_or_else(|e| panic!("enable: {e}"));
    d.create_io_queues(1, IO_ENTRIES, false).unwrap_or_else(|e| panic!("I/O queues: {e}"));
    if shadow {
        d.enable_shadow_doorbells().unwrap_or_else(|e| panic!("shadow doorbells: {e}"));
    }
    d.t.put(DATA, &mem).unwrap_or_else(|e| panic!("guest memory: {e}"));

    // Command identifiers from 0x8000 up, one per command.
    let mut submitted: [HashSet<u16>; 2] = [HashSet::new(), HashSet::new()];
    let mut seen: [HashSet<u16>; 2] = [HashSet::new(), HashSet::new()];
    let mut pending = [0u32; 2];
    for (i, c) in commands.iter().enumerate() {
        if c.poke {
            poke(&mut d, shadow, &c.sqe);
            continue;
        }
        let q = usize::from(c.io);
        if !c.io && !admin_allowed(c.sqe.opcode()) {
            continue;
        }
        // Room for it: a full queue's commands are rung and waited for first.
        let entries = if c.io { IO_ENTRIES } else { d.admin.entries };
        if pending[q] + 1 >= entries {
            d.ring(q as u16).unwrap_or_else(|e| panic!("doorbell: {e}"));
            settle(&mut d, &submitted, &mut seen);
            pending[q] = 0;
        }
        let mut sqe = c.sqe;
        let cid = 0x8000 | i as u16;
        sqe.cdw0 = ((u32::from(sqe.cdw0) & 0xffff) | u32::from(cid) << 16).into();
        if !c.raw_prps {
            sqe.prp1 = (DATA + u64::from(sqe.prp1) % WINDOW).into();
            sqe.prp2 = (DATA + u64::from(sqe.prp2) % WINDOW).into();
        }
        submitted[q].insert(cid);
        d.push(q as u16, &sqe).unwrap_or_else(|e| panic!("submit: {e}"));
        pending[q] += 1;
        if c.ring {
            d.ring(q as u16).unwrap_or_else(|e| panic!("doorbell: {e}"));
        }
    }
    for q in 0..2 {
        d.ring(q).unwrap_or_else(|e| panic!("doorbell: {e}"));
    }
    settle(&mut d, &submitted, &mut seen);
    still_works(&mut d);
    let mut ro = vec![0u8; 1 << 20];
    d.t.ro.read_exact_at(&mut ro, 0).unwrap_or_else(|e| panic!("read-only memory: {e}"));
    assert!(ro.iter().all(|&b| b == 0), "the device wrote read-only guest memory");
}

/// A [`Submission::poke`] of `sqe`'s values.
fn poke(d: &mut Driver<Rig>, shadow: bool, sqe: &Sqe) {
    let words = sqe.as_slice();
    let value = |at: usize| u32::from_le_bytes([words[at], words[at + 1], words[at + 2], words[at + 3]]);
    let (tail, head) = (value(0).max(IO_ENTRIES), value(4).max(IO_ENTRIES));
    let put = if shadow {
        let mut slot = [0u8; 8];
        slot[..4].copy_from_slice(&tail.to_le_bytes());
        slot[4..].copy_from_slice(&head.to_le_bytes());
        d.t.put(crate::nvme_driver::SHADOW + 8, &slot)
            .and_then(|()| d.t.write32(spec::reg::DOORBELLS + 8, d.io[0].sq_tail))
    } else {
        d.t.write32(spec::reg::DOORBELLS + 8, tail)
            .and_then(|()| d.t.write32(spec::reg::DOORBELLS + 12, head))
    };
    // A register write of an invalid value is the device's to refuse; nothing else may fail.
    if let Err(e) = put {
        assert!(!shadow, "shadow page or doorbell: {e}");
    }
}

/// Takes the completions of both queues until none comes for [`QUIET`] (at most [`SETTLE`]),
/// checking each (see the module's documentation).
fn settle(d: &mut Driver<Rig>, submitted: &[HashSet<u16>; 2], seen: &mut [HashSet<u16>; 2]) {
    let start = Instant::now();
    let mut last = Instant::now();
    while last.elapsed() < QUIET && start.elapsed() < SETTLE {
        let mut any = false;
        for q in 0..2u16 {
            while let Some(cqe) = d.poll_one(q).unwrap_or_else(|e| panic!("poll: {e}")) {
                d.release(q).unwrap_or_else(|e| panic!("CQ doorbell: {e}"));
                check(q, &cqe, &submitted[usize::from(q)], &mut seen[usize::from(q)]);
                any = true;
            }
        }
        if any {
            last = Instant::now();
        } else {
            std::thread::sleep(Duration::from_micros(200));
        }
    }
}

fn check(q: u16, cqe: &Cqe, submitted: &HashSet<u16>, seen: &mut HashSet<u16>) {
    let cid = u16::from(cqe.cid);
    assert_ne!(cqe.status(), Status::INTERNAL_ERROR, "queue {q}: cid {cid:#x} ended with Internal Error");
    // A trampled queue's entries are the guest's doing (see the module's documentation):
    // only completions of commands this run submitted are checked for repeats.
    if submitted.contains(&cid) {
        assert!(seen.insert(cid), "queue {q}: cid {cid:#x} completed twice");
    }
}

/// A reset, then Identify and a write read back on a fresh I/O queue.
fn still_works(d: &mut Driver<Rig>) {
    d.enable().unwrap_or_else(|e| panic!("the controller does not come back from a reset: {e}"));
    d.identify_controller().unwrap_or_else(|e| panic!("Identify after the run: {e}"));
    d.create_io_queues(1, IO_ENTRIES, false).unwrap_or_else(|e| panic!("I/O queues after the run: {e}"));
    // The admin queue's and the new I/O queue's: a worker the reset could not stop (one that
    // never looks up from a command) would still be counted.
    assert_eq!(d.t.ctrl().workers(), 2, "workers running after the reset");
    let ns = d.identify_namespace(1).unwrap_or_else(|e| panic!("Identify Namespace after the run: {e}"));
    let format = u32::from(ns.lbaf[usize::from(ns.flbas & 0xf)]);
    let block = 1usize << ((format >> 16) & 0xff).min(12);
    let data: Vec<u8> = (0..block).map(|i| (i * 7 + 1) as u8).collect();
    let at = DATA + WINDOW;
    d.t.put(at, &data).unwrap_or_else(|e| panic!("guest memory: {e}"));
    let write = Driver::<Rig>::rw_command(false, 1, 0, 1, at, 0);
    let cqe = d.io_command(1, write).unwrap_or_else(|e| panic!("a write after the run: {e}"));
    assert_eq!(cqe.status(), Status::SUCCESS, "a write after the run");
    d.t.put(at, &vec![0u8; data.len()]).unwrap_or_else(|e| panic!("guest memory: {e}"));
    let read = Driver::<Rig>::rw_command(true, 1, 0, 1, at, 0);
    let cqe = d.io_command(1, read).unwrap_or_else(|e| panic!("a read after the run: {e}"));
    assert_eq!(cqe.status(), Status::SUCCESS, "a read after the run");
    let mut back = vec![0u8; data.len()];
    d.t.get(at, &mut back).unwrap_or_else(|e| panic!("guest memory: {e}"));
    assert_eq!(back, data, "the block written after the run reads back");
}

/// Hand-made seeds: reads and writes through PRP1, PRP2 and a PRP list, Identify, a log
/// page, Dataset Management, Compare, reads with PRPs as given (read-only memory, no memory at
/// all), and a write and read with shadow doorbells.
pub fn seeds() -> Vec<(&'static str, Vec<u8>)> {
    let rw = |read: bool, slba: u64, nlb: u32, prp1: u64, prp2: u64| {
        Driver::<Rig>::rw_command(read, 1, slba, nlb, prp1, prp2)
    };
    let io = |sqe: Sqe| Submission { io: true, ring: true, raw_prps: false, poke: false, sqe };
    let admin = |sqe: Sqe| Submission { io: false, ring: true, raw_prps: false, poke: false, sqe };
    // An SQ tail and CQ head of u32::MAX, and an Abort of a command not queued on SQ 1.
    let mut values = Sqe::default();
    values.as_mut_slice()[..8].fill(0xff);
    let poke = Submission { io: true, ring: false, raw_prps: false, poke: true, sqe: values };
    let mut abort = Sqe::new(admin_op::ABORT, 0);
    abort.cdw[0] = (1 | 0x1234 << 16).into();
    // A PRP list at window offset 0x3000 naming the pages at 0x4000 and 0x5000.
    let mut mem = vec![0u8; 0x6000];
    mem[0x3000..0x3008].copy_from_slice(&(DATA + 0x4000).to_le_bytes());
    mem[0x3008..0x3010].copy_from_slice(&(DATA + 0x5000).to_le_bytes());
    let mut identify = Sqe::new(admin_op::IDENTIFY, 0);
    identify.cdw[0] = 1.into();
    let mut log = Sqe::new(admin_op::GET_LOG_PAGE, 0);
    log.cdw[0] = (2 | 127 << 16).into();
    let mut dsm = Sqe::new(nvm_op::DSM, 0);
    dsm.nsid = 1.into();
    dsm.cdw[1] = 4.into(); // AD
    let mut compare = rw(true, 0, 7, 0x1000, 0);
    compare.cdw0 = u32::from(nvm_op::COMPARE).into();
    let raw = |sqe: Sqe| Submission { raw_prps: true, ..io(sqe) };
    let input =
        |shadow: bool, commands: Vec<Submission>| encode(&Input { shadow, commands, mem: mem.clone() });
    vec![
        ("rw", input(false, vec![io(rw(false, 0, 7, 0x1000, 0)), io(rw(true, 0, 7, 0x2000, 0))])),
        (
            "prp2",
            input(false, vec![io(rw(false, 8, 15, 0x1200, 0x2000)), io(rw(true, 8, 15, 0x1200, 0x2000))]),
        ),
        (
            "prp-list",
            input(false, vec![io(rw(false, 16, 23, 0x1000, 0x3000)), io(rw(true, 16, 23, 0x1000, 0x3000))]),
        ),
        ("admin", input(false, vec![admin(identify), admin(log)])),
        ("dsm-compare", input(false, vec![io(dsm), io(compare)])),
        ("raw", input(false, vec![raw(rw(true, 0, 0, RO, 0)), raw(rw(true, 0, 0, 1 << 40, 0))])),
        ("shadow-rw", input(true, vec![io(rw(false, 0, 7, 0x1000, 0)), io(rw(true, 0, 7, 0x2000, 0))])),
        ("shadow-poke-abort", input(true, vec![poke, admin(abort), io(rw(true, 0, 7, 0x2000, 0))])),
        ("poke-abort", input(false, vec![poke, admin(abort), io(rw(true, 0, 7, 0x2000, 0))])),
    ]
}
