//! A file namespace whose backing fails or holds I/O: the testkit's FUSE file answers each
//! read and write of the host kernel as the test says. Needs root (mounting FUSE); skipped
//! with the reason elsewhere.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use umdev_devices::nvme::namespace::Backing;
use umdev_devices::nvme::spec::*;
use umdev_devices::nvme::*;
use umdev_devices::store::Cache;
use umdev_mdev::VfioDevice;
use umdev_testkit::fuse::{Action, FuseFile, Io};
use umdev_testkit::nvme_driver::{Driver, Transport};
use umdev_testkit::nvme_rig::*;

const BLOCK: u64 = 4096;
/// A hang guard only: what the test waits for happens as soon as the host gets to it.
const GUARD: Duration = Duration::from_secs(60);

fn mounted(bytes: u64) -> Option<FuseFile> {
    match FuseFile::mount(bytes) {
        Ok(f) => Some(f),
        Err(why) => {
            eprintln!("SKIPPED: {why}");
            None
        }
    }
}

fn on(fuse: &FuseFile) -> Driver<Rig> {
    on_with(fuse, NvmeConfig::default())
}

/// A Read or Write of one block at `lba` into or from the guest page `page`, with `cid`.
fn rw(read: bool, lba: u64, page: u64, cid: u16) -> Sqe {
    let mut sqe = Driver::<Rig>::rw_command(read, 1, lba, 1, page, 0);
    sqe.cdw0 = ((u32::from(sqe.cdw0) & 0xffff) | u32::from(cid) << 16).into();
    sqe
}

/// The guest page the held read of block 8 lands in.
const HELD_PAGE: u64 = DATA + 0x5000;

/// Writes `data` to block 8, then submits a read of it (cid 7, into [`HELD_PAGE`]) that the
/// backing holds; returns what the host holds, once it does.
fn hold_a_read(fuse: &FuseFile, d: &mut Driver<Rig>, data: &[u8]) -> Vec<umdev_testkit::fuse::Held> {
    d.t.put(DATA, data).unwrap();
    assert_eq!(d.rw(1, false, 1, 8, 1, BLOCK, &[DATA], 0).unwrap(), Status::SUCCESS);
    fuse.set_policy(|io| match io {
        Io::Read { offset, .. } if *offset == 8 * BLOCK => Action::Hold,
        _ => Action::Serve,
    });
    d.submit(1, &rw(true, 8, HELD_PAGE, 7)).unwrap();
    fuse.wait_held(1, GUARD)
}

/// The host finishes the read [`hold_a_read`] left `held`: every pin goes (up to the hang
/// guard), and the data, `data`, is in [`HELD_PAGE`].
fn answer_and_see_it_land(
    fuse: &FuseFile,
    d: &mut Driver<Rig>,
    held: &[umdev_testkit::fuse::Held],
    data: &[u8],
) {
    fuse.answer(held[0].unique, None);
    until_let_go(|| d.t.dma.stats().pins_held > 0);
    let mut back = vec![0u8; BLOCK as usize];
    d.t.get(HELD_PAGE, &mut back).unwrap();
    assert!(back == data, "the host's read landed in the guest page");
}

/// Waits (up to the hang guard) until `pinned` says nothing is pinned any more.
fn until_let_go(pinned: impl Fn() -> bool) {
    until_not(pinned, "the held read's pins were never let go");
}

/// Waits (up to the hang guard) until `busy` is false; `never` says what did not happen.
fn until_not(busy: impl Fn() -> bool, never: &str) {
    let deadline = Instant::now() + GUARD;
    while busy() {
        assert!(Instant::now() < deadline, "{never}");
        std::thread::sleep(Duration::from_millis(1));
    }
}

#[test]
fn a_backing_that_fails_completes_its_commands_with_the_spec_status_and_the_rest_go_on() {
    let Some(fuse) = mounted(1 << 20) else { return };
    let mut d = on(&fuse);
    d.t.put(DATA, &pattern(BLOCK as usize, 1)).unwrap();
    assert_eq!(d.rw(1, false, 1, 0, 1, BLOCK, &[DATA], 0).unwrap(), Status::SUCCESS);
    // The disk fails a read of block 16 and a write of block 32; everything else is served.
    fuse.set_policy(|io| match io {
        Io::Read { offset, .. } if *offset == 16 * BLOCK => Action::Fail(libc::EIO),
        Io::Write { offset, .. } if *offset == 32 * BLOCK => Action::Fail(libc::EIO),
        _ => Action::Serve,
    });
    d.t.put(DATA + 0x3000, &pattern(BLOCK as usize, 3)).unwrap();
    d.t.put(DATA + 0x4000, &pattern(BLOCK as usize, 4)).unwrap();
    let before = d.t.dev.function().totals().commands;
    // All four in flight together, on one queue.
    let batch = [
        (rw(true, 0, DATA + 0x1000, 101), Status::SUCCESS),
        (rw(true, 16, DATA + 0x2000, 102), Status::UNRECOVERED_READ_ERROR),
        (rw(false, 32, DATA + 0x3000, 103), Status::WRITE_FAULT),
        (rw(false, 48, DATA + 0x4000, 104), Status::SUCCESS),
    ];
    for (sqe, _) in &batch {
        d.push(1, sqe).unwrap();
    }
    d.ring(1).unwrap();
    let mut got = HashMap::new();
    for _ in 0..batch.len() {
        let cqe = d.wait(1, GUARD).unwrap();
        assert!(got.insert(u16::from(cqe.cid), cqe.status()).is_none(), "cid {} twice", u16::from(cqe.cid));
    }
    for (sqe, status) in &batch {
        let cid = (u32::from(sqe.cdw0) >> 16) as u16;
        assert_eq!(got.get(&cid), Some(status), "cid {cid}: {got:?}");
    }
    // The successful transfers moved their data.
    let mut back = vec![0u8; BLOCK as usize];
    d.t.get(DATA + 0x1000, &mut back).unwrap();
    assert!(back == pattern(BLOCK as usize, 1), "the good read's data");
    assert!(fuse.bytes()[48 * BLOCK as usize..49 * BLOCK as usize] == pattern(BLOCK as usize, 4)[..]);
    // The queue goes on; the next completion is the next command's: nothing was posted twice.
    let mut flush = Sqe::new(nvm_op::FLUSH, 0);
    flush.nsid = 1.into();
    assert_eq!(d.io_command(1, flush).unwrap().status(), Status::SUCCESS);
    assert!(d.poll_one(1).unwrap().is_none(), "no completion posted twice");
    assert_eq!(d.t.dev.function().totals().commands, before + 5);
    // Both failures are in the error log, with their queue, command and LBA.
    let mut logged: Vec<_> = d
        .error_log(2)
        .unwrap()
        .iter()
        .map(|e| (u16::from(e.sqid), u16::from(e.cid), u16::from(e.status) >> 1, u64::from(e.lba)))
        .collect();
    logged.sort();
    assert_eq!(logged, [(1, 102, Status::UNRECOVERED_READ_ERROR.0, 16), (1, 103, Status::WRITE_FAULT.0, 32)]);
}

#[test]
fn a_reset_with_a_read_held_by_the_backing_keeps_its_pins_until_the_host_lets_go() {
    let Some(fuse) = mounted(1 << 20) else { return };
    let mut d = on(&fuse);
    let data = pattern(BLOCK as usize, 8);
    let held = hold_a_read(&fuse, &mut d, &data);
    let page = HELD_PAGE;
    assert_eq!(d.t.dma.pin_count(page), 1, "the held read's page is pinned");

    // The guest resets the controller while the host still has the read: the reset stops
    // the queue's worker, which waits for the read (boundedly) and then leaves it, with its
    // pins, to a thread that waits for the host.
    let cc = d.t.read32(reg::CC).unwrap();
    d.t.write32(reg::CC, cc & !1).unwrap();
    assert_eq!(d.t.ctrl().workers(), 0, "the worker stopped");
    // Left pinned: the held read's page, and its queue's two ring pages (a command keeps
    // its queue, whose completion it would have posted).
    assert_eq!((d.t.dma.pin_count(page), d.t.dma.stats().pins_held), (1, 3));

    // The host finishes the read: the data lands in the still-pinned page, then the pin goes;
    // nothing is posted for a command of before the reset.
    answer_and_see_it_land(&fuse, &mut d, &held, &data);
    assert!(d.poll_one(1).unwrap().is_none(), "no completion after the reset");

    // The controller comes back and reads the block, served at once this time.
    fuse.set_policy(|_| Action::Serve);
    d.enable().unwrap();
    d.create_io_queues(1, 64, false).unwrap();
    assert_eq!(d.rw(1, true, 1, 8, 1, BLOCK, &[DATA + 0x6000], 0).unwrap(), Status::SUCCESS);
    let mut back = vec![0u8; BLOCK as usize];
    d.t.get(DATA + 0x6000, &mut back).unwrap();
    assert!(back == data);
}

/// A write the host still has when the controller is reset is ended by the reset: if the host
/// then fails it in a way a live queue would retry (EINTR), it is not retried: the guest, told
/// nothing, may have written those blocks anew since.
#[test]
fn a_write_left_by_a_reset_is_not_retried() {
    let Some(fuse) = mounted(1 << 20) else { return };
    let mut d = on(&fuse);
    d.t.put(DATA, &pattern(2 * BLOCK as usize, 5)).unwrap();
    fuse.set_policy(|io| match io {
        Io::Write { offset, .. } if *offset == 8 * BLOCK => Action::Hold,
        _ => Action::Serve,
    });
    let write = Driver::<Rig>::rw_command(false, 1, 8, 2, DATA, DATA + BLOCK);
    d.submit(1, &write).unwrap();
    let held = fuse.wait_held(1, GUARD);
    let cc = d.t.read32(reg::CC).unwrap();
    d.t.write32(reg::CC, cc & !1).unwrap();
    assert_eq!(d.t.ctrl().workers(), 0, "the worker stopped, the write left to the host");
    fuse.set_policy(|_| Action::Serve);
    let served = fuse.served();
    fuse.answer(held[0].unique, Some(libc::EINTR));
    until_let_go(|| d.t.dma.stats().pins_held > 0);
    assert_eq!(fuse.served(), served + 1, "nothing asked of the disk after the answer");
    assert!(fuse.bytes()[8 * BLOCK as usize..10 * BLOCK as usize].iter().all(|&b| b == 0), "nothing written");
}

#[test]
fn a_read_held_through_its_queues_deletion_posts_nothing_when_the_host_lets_go() {
    let Some(fuse) = mounted(1 << 20) else { return };
    let mut d = on(&fuse);
    let held = hold_a_read(&fuse, &mut d, &pattern(BLOCK as usize, 10));
    let page = HELD_PAGE;

    // The guest deletes the SQ while the host has the read: the deletion completes once the
    // worker has waited for it (boundedly) and left it, with its pins, to another thread.
    let mut delete = Sqe::new(admin_op::DELETE_SQ, 0);
    delete.set_dw(10, 1);
    assert_eq!(d.admin_command(delete).unwrap().status(), Status::SUCCESS);
    assert_eq!(d.t.dma.pin_count(page), 1, "the held read keeps its page pinned");

    // The host finishes the read after the deletion: its pins go, and nothing reaches the
    // CQ, which outlives the SQ and could serve a new one with the same command identifiers.
    fuse.answer(held[0].unique, None);
    until_let_go(|| d.t.dma.pin_count(page) > 0);
    assert!(d.poll_one(1).unwrap().is_none(), "no completion for a command of a deleted SQ");
}

#[test]
fn a_disconnect_with_a_read_held_by_the_backing_keeps_its_pins_until_the_host_lets_go() {
    let Some(fuse) = mounted(1 << 20) else { return };
    let mut d = on(&fuse);
    let data = pattern(BLOCK as usize, 9);
    let held = hold_a_read(&fuse, &mut d, &data);
    let page = HELD_PAGE;

    // The client goes away while the host has the read: the detach stops the queue's
    // worker, which leaves the read, with its pins, to a thread that waits for the host.
    d.t.dev.detach();
    assert_eq!(d.t.ctrl().workers(), 0, "the worker stopped");
    assert_eq!(d.t.dma.pin_count(page), 1, "the held read keeps its page pinned");

    // The host finishes the read: the data lands in the still-pinned page, then every pin
    // goes; nothing is posted (no client is there to post to).
    answer_and_see_it_land(&fuse, &mut d, &held, &data);
    assert!(d.poll_one(1).unwrap().is_none(), "no completion after the disconnect");
}

/// With shadow doorbells, a worker with 8 or more transfers in flight does not ask the host to
/// ring for new submissions: a command submitted through the shadow alone while the backing
/// holds 8 reads is still seen (the worker's bounded look), before any of the 8 ends.
#[test]
fn a_busy_queue_with_shadow_doorbells_takes_a_command_the_host_did_not_ring_for() {
    let Some(fuse) = mounted(64 << 20) else { return };
    let mut d = on(&fuse);
    d.enable_shadow_doorbells().unwrap();
    d.poll = true;
    const HELD_END: u64 = 16 << 20;
    fuse.set_policy(|io| match io {
        Io::Read { offset, .. } if *offset < HELD_END => Action::Hold,
        _ => Action::Serve,
    });
    // Eight reads 2 MiB apart (no readahead of one covers another), held by the backing.
    for i in 0..8u16 {
        let lba = u64::from(i) * (2 << 20) / BLOCK;
        d.push(1, &rw(true, lba, DATA + u64::from(i) * BLOCK, i)).unwrap();
    }
    d.ring(1).unwrap();
    let held = fuse.wait_held(8, GUARD);
    // The ninth goes to the shadow page only: the event index did not ask to hear of it.
    d.push(1, &rw(true, (40 << 20) / BLOCK, DATA + 0x10000, 99)).unwrap();
    let written = d.doorbells.written;
    d.ring(1).unwrap();
    assert_eq!(d.doorbells.written, written, "no register write for the ninth");
    let cqe = d.wait(1, GUARD).unwrap();
    assert_eq!((u16::from(cqe.cid), cqe.status()), (99, Status::SUCCESS), "the ninth ends first");
    for h in &held {
        fuse.answer(h.unique, None);
    }
    let mut cids: Vec<u16> = (0..8).map(|_| u16::from(d.wait(1, GUARD).unwrap().cid)).collect();
    cids.sort();
    assert_eq!(cids, (0..8).collect::<Vec<_>>());
}

#[test]
fn zeroes_with_fua_or_the_write_cache_off_are_made_durable_before_the_command_completes() {
    let Some(fuse) = mounted(1 << 20) else { return };
    let mut d = on(&fuse);
    // Every fsync fails: a command that makes its change durable says so.
    fuse.set_policy(|io| match io {
        Io::Fsync => Action::Fail(libc::EIO),
        _ => Action::Serve,
    });
    let zeroes = |fua: bool| {
        let mut sqe = Sqe::new(nvm_op::WRITE_ZEROES, 0);
        sqe.nsid = 1.into();
        sqe.set_dw(10, 4);
        sqe.set_dw(12, 1 | u32::from(fua) << 30);
        sqe
    };
    let deallocate = |d: &mut Driver<Rig>| {
        let mut range = [0u8; 16];
        range[4..8].copy_from_slice(&2u32.to_le_bytes()); // NLB
        range[8..16].copy_from_slice(&8u64.to_le_bytes()); // SLBA
        d.t.put(DATA + 0x7000, &range).unwrap();
        let mut sqe = Sqe::new(nvm_op::DSM, 0);
        sqe.nsid = 1.into();
        sqe.set_dw(11, 1 << 2);
        sqe.prp1 = (DATA + 0x7000).into();
        d.io_command(1, sqe).unwrap().status()
    };
    assert_eq!(d.io_command(1, zeroes(false)).unwrap().status(), Status::SUCCESS, "cached: no flush");
    assert_eq!(deallocate(&mut d), Status::SUCCESS, "cached: no flush");
    assert_eq!(d.io_command(1, zeroes(true)).unwrap().status(), Status::WRITE_FAULT, "FUA flushes");
    // With the volatile write cache off, every change is durable before it completes.
    let mut vwc = Sqe::new(admin_op::SET_FEATURES, 0);
    vwc.set_dw(10, u32::from(feature::VOLATILE_WRITE_CACHE));
    d.admin_ok(vwc).unwrap();
    assert_eq!(d.io_command(1, zeroes(false)).unwrap().status(), Status::WRITE_FAULT);
    assert_eq!(deallocate(&mut d), Status::WRITE_FAULT);
    // A disk whose syncs work again cannot say what the failed ones lost: every change
    // that must be durable still fails (`a_failed_sync_fails_every_later_flush_and_durable_write`).
    fuse.set_policy(|_| Action::Serve);
    assert_eq!(d.io_command(1, zeroes(false)).unwrap().status(), Status::WRITE_FAULT);
    assert_eq!(deallocate(&mut d), Status::WRITE_FAULT);
}

fn flush_cmd() -> Sqe {
    let mut flush = Sqe::new(nvm_op::FLUSH, 0);
    flush.nsid = 1.into();
    flush
}

/// A Read or Write of block `lba` with FUA, from or into [`DATA`].
fn fua(read: bool, lba: u64) -> Sqe {
    let mut sqe = Driver::<Rig>::rw_command(read, 1, lba, 1, DATA, 0);
    sqe.set_dw(12, 1 << 30);
    sqe
}

/// The host reports a failed write-back once, to the first sync that looks; after that a
/// sync succeeds though cached writes were lost. So once a sync fails, no later Flush or
/// durable write may succeed (QEMU's answer too): the guest would take lost data for safe.
/// Cached writes and reads go on. In the asynchronous (io_uring) path and the synchronous one.
#[test]
fn a_failed_sync_fails_every_later_flush_and_durable_write() {
    for aio in [AioMode::IoUring, AioMode::Sync] {
        let Some(fuse) = mounted(1 << 20) else { return };
        let config = NvmeConfig { aio, ..NvmeConfig::default() };
        let mut d = on_with(&fuse, config);
        d.t.put(DATA, &pattern(BLOCK as usize, 1)).unwrap();
        assert_eq!(d.rw(1, false, 1, 0, 1, BLOCK, &[DATA], 0).unwrap(), Status::SUCCESS);
        assert_eq!(d.io_command(1, fua(false, 1)).unwrap().status(), Status::SUCCESS, "{aio:?}");
        assert_eq!(d.io_command(1, flush_cmd()).unwrap().status(), Status::SUCCESS);
        fuse.set_policy(|io| match io {
            Io::Fsync => Action::Fail(libc::EIO),
            _ => Action::Serve,
        });
        assert_eq!(d.io_command(1, flush_cmd()).unwrap().status(), Status::WRITE_FAULT, "{aio:?}");
        fuse.set_policy(|_| Action::Serve);
        let served = fuse.served();
        assert_eq!(d.io_command(1, flush_cmd()).unwrap().status(), Status::WRITE_FAULT, "{aio:?}");
        assert_eq!(d.io_command(1, fua(false, 2)).unwrap().status(), Status::WRITE_FAULT, "{aio:?}");
        assert_eq!(fuse.served(), served, "refused without asking the disk");
        // Cached writes and reads are served as before.
        assert_eq!(d.rw(1, false, 1, 3, 1, BLOCK, &[DATA], 0).unwrap(), Status::SUCCESS);
        assert_eq!(d.rw(1, true, 1, 3, 1, BLOCK, &[DATA], 0).unwrap(), Status::SUCCESS);
        // A shutdown still completes, but with the controller's fatal status: the data is
        // not known to be safe.
        d.shutdown().unwrap();
        assert_ne!(d.t.read32(reg::CSTS).unwrap() & reg::CSTS_CFS, 0, "{aio:?}");
    }
}

/// Serves everything from now on, counting the syncs asked of the disk: the count, read.
fn counting_syncs(fuse: &FuseFile) -> impl Fn() -> usize {
    use std::sync::atomic::{AtomicUsize, Ordering};
    let syncs = std::sync::Arc::new(AtomicUsize::new(0));
    let seen = syncs.clone();
    fuse.set_policy(move |io| {
        if matches!(io, Io::Fsync) {
            seen.fetch_add(1, Ordering::SeqCst);
        }
        Action::Serve
    });
    move || syncs.load(Ordering::SeqCst)
}

/// FUA on a Read makes what the host caches of the file durable first (NVMe §6.9): the read
/// asks the disk for a sync, and fails as a flush would if the sync does.
#[test]
fn a_read_with_fua_syncs_first() {
    let Some(fuse) = mounted(1 << 20) else { return };
    let mut d = on(&fuse);
    let syncs = counting_syncs(&fuse);
    assert_eq!(d.io_command(1, fua(true, 0)).unwrap().status(), Status::SUCCESS);
    assert_eq!(syncs(), 1, "one sync for the read");
    assert_eq!(d.rw(1, true, 1, 0, 1, BLOCK, &[DATA], 0).unwrap(), Status::SUCCESS);
    assert_eq!(syncs(), 1, "none without FUA");
    fuse.set_policy(|io| match io {
        Io::Fsync => Action::Fail(libc::EIO),
        _ => Action::Serve,
    });
    assert_eq!(d.io_command(1, fua(true, 0)).unwrap().status(), Status::WRITE_FAULT);
}

/// Turning the volatile write cache off makes what it holds durable: the host sends no more
/// Flushes for the writes before.
#[test]
fn turning_the_write_cache_off_syncs() {
    let Some(fuse) = mounted(1 << 20) else { return };
    let mut d = on(&fuse);
    let syncs = counting_syncs(&fuse);
    assert_eq!(d.rw(1, false, 1, 0, 1, BLOCK, &[DATA], 0).unwrap(), Status::SUCCESS);
    assert_eq!(syncs(), 0);
    let mut vwc = Sqe::new(admin_op::SET_FEATURES, 0);
    vwc.set_dw(10, u32::from(feature::VOLATILE_WRITE_CACHE));
    d.admin_ok(vwc).unwrap();
    assert_eq!(syncs(), 1, "synced as the cache went off");
    d.admin_ok(vwc).unwrap();
    assert_eq!(syncs(), 1, "off again: nothing to sync");
}

/// A file namespace of `config` on `fuse`, its I/O queue up.
fn on_with(fuse: &FuseFile, config: NvmeConfig) -> Driver<Rig> {
    let config = NvmeConfig {
        namespaces: vec![Some(Backing::File(fuse.path().to_path_buf(), Cache::Writeback))],
        lba_shift: 12,
        ..config
    };
    up(Rig::with(config, true), 1)
}

/// Disables the controller (a guest's reset) and brings it back with one I/O queue.
fn reset_and_back(d: &mut Driver<Rig>) {
    let cc = d.t.read32(reg::CC).unwrap();
    d.t.write32(reg::CC, cc & !1).unwrap();
    d.enable().unwrap();
    d.create_io_queues(1, 64, false).unwrap();
}

/// Threads of this process with `name`.
fn threads_named(name: &str) -> usize {
    std::fs::read_dir("/proc/self/task")
        .unwrap()
        .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("comm")).ok())
        .filter(|comm| comm.trim_end() == name)
        .count()
}

/// A backing that stops answering holds what stopped queues left in the kernel, up to
/// `max_held` transfers: past that, the namespace's commands fail at once (Namespace Not
/// Ready, which a host may retry) instead of piling up with their pins, and one thread waits
/// for everything left. Once the backing answers, what it held lands, every pin goes and the
/// namespace serves again.
#[test]
fn a_backing_that_stops_answering_holds_up_to_max_held_then_its_commands_fail_at_once() {
    let Some(fuse) = mounted(1 << 20) else { return };
    let mut d = on_with(&fuse, NvmeConfig { max_held: 2, ..NvmeConfig::default() });
    let data = pattern(BLOCK as usize, 11);
    d.t.put(DATA, &data).unwrap();
    for lba in [8, 9, 10] {
        assert_eq!(d.rw(1, false, 1, lba, 1, BLOCK, &[DATA], 0).unwrap(), Status::SUCCESS);
    }
    fuse.set_policy(|io| match io {
        Io::Read { .. } => Action::Hold,
        _ => Action::Serve,
    });

    // Two lifetimes, each leaving one read in the backing at its reset.
    for (n, (lba, page)) in [(8, HELD_PAGE), (9, HELD_PAGE + 0x1000)].into_iter().enumerate() {
        d.submit(1, &rw(true, lba, page, 7)).unwrap();
        fuse.wait_held(n + 1, GUARD);
        reset_and_back(&mut d);
        assert_eq!(d.t.ctrl().held_by_backing(1), (n + 1, 0), "left in the backing after reset {n}");
    }
    assert_eq!(threads_named("umdev-aio-drain"), 1, "one thread waits for every ring left");

    // At max_held: a read fails at once, reaching neither the backing nor the pins.
    assert_eq!(d.rw(1, true, 1, 10, 1, BLOCK, &[DATA + 0x8000], 0).unwrap(), Status::NAMESPACE_NOT_READY);
    assert_eq!(fuse.wait_held(2, GUARD).len(), 2, "the refused read reached the backing");
    assert_eq!(d.t.dma.pin_count(DATA + 0x8000), 0, "the refused read holds no pin");
    let described = d.t.dev.describe();
    assert_eq!(described["namespaces"][0]["held_by_backing"], 2, "{described}");

    // The backing answers: both reads land, their pins go, the namespace serves again.
    for h in fuse.wait_held(2, GUARD) {
        fuse.answer(h.unique, None);
    }
    until_not(|| d.t.ctrl().held_by_backing(1).0 > 0, "the held reads were never counted done");
    for page in [HELD_PAGE, HELD_PAGE + 0x1000] {
        let mut back = vec![0u8; BLOCK as usize];
        d.t.get(page, &mut back).unwrap();
        assert!(back == data, "a read left in the backing landed in its still-pinned page");
    }
    fuse.set_policy(|_| Action::Serve);
    assert_eq!(d.rw(1, true, 1, 10, 1, BLOCK, &[DATA + 0x8000], 0).unwrap(), Status::SUCCESS);
}

/// With `aio=sync`, a worker blocked in a backing that stops answering does not stop at a
/// reset; such workers count against `max_held` until they end, so a reset loop cannot pile
/// up threads and pins without bound.
#[test]
fn workers_left_blocked_in_a_synchronous_backing_count_against_max_held() {
    let Some(fuse) = mounted(1 << 20) else { return };
    let mut d = on_with(&fuse, NvmeConfig { max_held: 1, aio: AioMode::Sync, ..NvmeConfig::default() });
    let data = pattern(BLOCK as usize, 12);
    d.t.put(DATA, &data).unwrap();
    assert_eq!(d.rw(1, false, 1, 8, 1, BLOCK, &[DATA], 0).unwrap(), Status::SUCCESS);
    fuse.set_policy(|io| match io {
        Io::Read { .. } => Action::Hold,
        _ => Action::Serve,
    });
    d.submit(1, &rw(true, 8, HELD_PAGE, 7)).unwrap();
    let held = fuse.wait_held(1, GUARD);

    // The reset gives up on the blocked worker after its bound and counts it.
    reset_and_back(&mut d);
    assert_eq!(d.t.ctrl().held_by_backing(1), (0, 1));
    assert_eq!(d.rw(1, true, 1, 8, 1, BLOCK, &[DATA + 0x8000], 0).unwrap(), Status::NAMESPACE_NOT_READY);
    assert_eq!(fuse.wait_held(1, GUARD).len(), 1, "the refused read reached the backing");

    // The backing answers: the worker ends, uncounted, and the namespace serves again.
    fuse.answer(held[0].unique, None);
    until_not(|| d.t.ctrl().held_by_backing(1).1 > 0, "the blocked worker was never counted done");
    fuse.set_policy(|_| Action::Serve);
    assert_eq!(d.rw(1, true, 1, 8, 1, BLOCK, &[DATA + 0x8000], 0).unwrap(), Status::SUCCESS);
    let mut back = vec![0u8; BLOCK as usize];
    d.t.get(DATA + 0x8000, &mut back).unwrap();
    assert!(back == data);
}

/// With `aio=sync`, a Delete I/O SQ whose worker is blocked in a backing that does not answer
/// completes after its bound, and the worker, when the backing finally answers, posts
/// nothing: neither its command's completion nor aborts for a ring that is no longer its.
#[test]
fn a_queue_deleted_while_its_worker_is_blocked_in_the_backing_posts_nothing_afterwards() {
    let Some(fuse) = mounted(1 << 20) else { return };
    let mut d = on_with(&fuse, NvmeConfig { aio: AioMode::Sync, ..NvmeConfig::default() });
    let held = hold_a_read(&fuse, &mut d, &pattern(BLOCK as usize, 13));

    let mut delete = Sqe::new(admin_op::DELETE_SQ, 0);
    delete.set_dw(10, 1);
    assert_eq!(d.admin_command(delete).unwrap().status(), Status::SUCCESS);
    assert_eq!(d.t.ctrl().held_by_backing(1), (0, 1), "the blocked worker is counted");

    // The backing answers: the worker ends (uncounted) and nothing reaches the CQ.
    fuse.answer(held[0].unique, None);
    until_not(|| d.t.ctrl().held_by_backing(1).1 > 0, "the blocked worker never ended");
    until_let_go(|| d.t.dma.pin_count(HELD_PAGE) > 0);
    assert!(d.poll_one(1).unwrap().is_none(), "no completion for a command of a deleted SQ");
}
