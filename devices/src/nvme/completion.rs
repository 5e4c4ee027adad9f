//! How a command ends: its completion entry posted on its queue's CQ (NVMe 1.3 §4.6), in
//! the order the commands finish, never twice.
//!
//! Each command runs on a framework [`Permit`](umdev_mdev::request::Permit) whose
//! [`Completion`] is a [`Command`]: completing the permit posts the command's entry; dropping
//! it unfinished (a panic in the command's handling, caught by the worker) posts Internal
//! Error instead, so the host always gets an answer. A completion that cannot be posted now
//! (the CQ is full, bus mastering is off) waits in its queue's [`Completer`] backlog, in
//! order; the queue's worker posts it when the host makes room or turns bus mastering back
//! on, and fetches nothing new meanwhile (a full CQ holds its SQ, §4.1).

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use super::ctrl::Ctrl;
use super::queue::{completion, PostError, RingError, Sq};
use super::spec::{Cqe, Sqe, Status};
use super::stats;
use umdev_mdev::guest::GuestError;
use umdev_mdev::request::{Cancel, Completion, Permit};
use umdev_mdev::DeviceContext;

/// One queue's completion side: what its commands' [`Command`]s post through.
#[derive(Debug)]
pub struct Completer {
    ctrl: Arc<Ctrl>,
    sq: Arc<Sq>,
    /// The controller generation the queue belongs to: a queue of an older one posts nothing.
    generation: u64,
    /// Completions waiting for room or bus mastering, oldest first. Only the queue's worker
    /// thread touches it: the lock is never contended.
    backlog: Mutex<VecDeque<Cqe>>,
    /// How many entries `backlog` holds, stored under its lock: with none waiting (nearly
    /// always) a completion is posted without taking it.
    backlogged: AtomicUsize,
    /// Set while the worker posts a batch of completions it found together (see
    /// [`Completer::batch`]). Only the worker writes it.
    batching: AtomicBool,
}

/// What happened to the backlog when the worker tried to post it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Drained {
    /// Nothing waits.
    Empty,
    /// The CQ is full: wait for the host's CQ head doorbell.
    Full,
    /// Bus mastering is off: wait for it to come back.
    BusMasterOff,
}

impl Completer {
    /// The completion side of `sq`, for work of `generation`.
    pub fn new(ctrl: Arc<Ctrl>, sq: Arc<Sq>, generation: u64) -> Arc<Completer> {
        Arc::new(Completer {
            ctrl,
            sq,
            generation,
            backlog: Mutex::new(VecDeque::new()),
            backlogged: AtomicUsize::new(0),
            batching: AtomicBool::new(false),
        })
    }

    /// The controller.
    pub fn ctrl(&self) -> &Arc<Ctrl> {
        &self.ctrl
    }

    /// The queue.
    pub fn sq(&self) -> &Arc<Sq> {
        &self.sq
    }

    /// The generation of the queue's work.
    pub fn generation(&self) -> u64 {
        self.generation
    }

    /// Whether the queue's work still counts (no disable since it started, the queue not
    /// deleted).
    pub fn current(&self) -> bool {
        self.ctrl.generation() == self.generation && !self.sq.retired()
    }

    /// The queue is deleted: from now on nothing is posted or counted. A transfer the host
    /// finishes after the deletion (one a stopping worker left to another thread) ends
    /// silently: its CQ may serve a new SQ by then, with the same command identifiers, and
    /// the guest may have reused its buffer, so a late entry would be a false completion.
    pub fn retire(&self) {
        self.sq.retire();
    }

    /// Posts the completion of `sqe` with `status` and `dw0`: counted, logged in the error
    /// log if it failed, then posted or put in the backlog.
    pub fn finish(&self, ctx: &DeviceContext, sqe: &Sqe, status: Status, dw0: u32) {
        // Work of before a disable (ended by it, or finishing after it) neither counts nor
        // reaches the host.
        if !self.current() {
            return;
        }
        self.ctrl.stats(self.sq.id).command(!status.ok());
        if !status.ok() {
            log::debug!(
                "nvme: queue {} opcode {:#04x} cid {} nsid {} cdw10 {:#x} cdw11 {:#x} failed: {status}",
                self.sq.id,
                sqe.opcode(),
                sqe.cid(),
                u32::from(sqe.nsid),
                u32::from(sqe.cdw[0]),
                u32::from(sqe.cdw[1])
            );
            self.ctrl.log_error(self.sq.id, sqe, status);
        }
        self.post(ctx, completion(&self.sq, sqe.cid(), status, dw0));
    }

    /// Posts `cqe`, after what waits in the backlog.
    pub fn post(&self, ctx: &DeviceContext, cqe: Cqe) {
        if !self.current() {
            return;
        }
        if self.backlogged.load(Ordering::Acquire) == 0 {
            match self.try_post(ctx, cqe) {
                Ok(()) | Err(None) => return,
                Err(Some(_)) => {}
            }
        }
        let mut backlog = umdev_mdev::sync::lock(&self.backlog);
        backlog.push_back(cqe);
        self.backlogged.store(backlog.len(), Ordering::Release);
    }

    /// Runs `post_all`, which posts completions the worker found together (the transfers one
    /// look at its io_uring found finished): their interrupt is held as if more commands
    /// waited (up to the CQ's batch, see [`super::queue::Cq::post`]), and the worker raises
    /// what is held when `post_all` returns ([`super::queue::Cq::due`]), so the batch costs
    /// one interrupt rather than one per entry.
    pub fn batch<R>(&self, post_all: impl FnOnce() -> R) -> R {
        // Relaxed: only this thread reads it (in `try_post`, within `post_all`).
        self.batching.store(true, Ordering::Relaxed);
        let r = post_all();
        self.batching.store(false, Ordering::Relaxed);
        r
    }

    /// Posts what waits, in order, as far as it can.
    pub fn drain(&self, ctx: &DeviceContext) -> Drained {
        let mut backlog = umdev_mdev::sync::lock(&self.backlog);
        if !self.current() {
            backlog.clear();
        }
        let drained = loop {
            let Some(&cqe) = backlog.front() else { break Drained::Empty };
            match self.try_post(ctx, cqe) {
                Ok(()) | Err(None) => {
                    backlog.pop_front();
                }
                Err(Some(why)) => break why,
            }
        };
        self.backlogged.store(backlog.len(), Ordering::Release);
        drained
    }

    /// How many completions wait.
    pub fn waiting(&self) -> usize {
        self.backlogged.load(Ordering::Acquire)
    }

    /// Drops what waits (the queue is being deleted with its CQ full): the host deleted the
    /// queue without consuming its completions, so none of them can reach it.
    pub fn abandon(&self) -> usize {
        let mut backlog = umdev_mdev::sync::lock(&self.backlog);
        let n = backlog.len();
        backlog.clear();
        self.backlogged.store(0, Ordering::Release);
        n
    }

    /// Posts one entry: `Err(Some(why))` if it must wait, `Err(None)` if it is gone for good
    /// (the ring cannot be reached: the controller went fatal).
    fn try_post(&self, ctx: &DeviceContext, cqe: Cqe) -> Result<(), Option<Drained>> {
        // Commands still waiting: their completions may share this one's interrupt. From the
        // tail the worker last read (at most the doorbell's: at worst the interrupt comes
        // sooner), not the doorbell itself, which the host keeps writing.
        let (tail, head) = (
            self.sq.known_tail.load(std::sync::atomic::Ordering::Relaxed),
            self.sq.head.load(std::sync::atomic::Ordering::Acquire),
        );
        let entries = self.sq.entries;
        let queued = if self.batching.load(Ordering::Relaxed) {
            u32::MAX
        } else if tail < entries {
            (tail + entries - head) % entries
        } else {
            0
        };
        match self.ctrl.post(ctx, &self.sq, cqe, queued) {
            Ok(()) | Err(PostError::Retired) => Ok(()),
            Err(PostError::Full) => Err(Some(Drained::Full)),
            Err(PostError::Ring(RingError::Guest(GuestError::BusMasterOff))) => {
                Err(Some(Drained::BusMasterOff))
            }
            Err(PostError::Ring(RingError::Guest(e))) => {
                self.ctrl.fail(&format!("CQ {} cannot be written: {e}", self.sq.cq.id));
                Err(None)
            }
        }
    }
}

/// A command in flight: its entry (for the error log and the completion). Its queue's
/// completion side is its lane's ([`Completion::Shared`]). Small: a permit carrying it moves
/// through the worker by value.
#[derive(Debug, Default)]
pub struct Command {
    sqe: Sqe,
}

/// A Read, Write or Flush of a file namespace that its handler handed to the queue's io_uring
/// ([`Outcome::Started`]): what the worker starts, and what the completion counts. It travels
/// beside the command's permit, in the ring's payload.
#[derive(Debug)]
pub struct Transfer {
    /// The namespace.
    pub nsid: u32,
    /// Read, write or sync.
    pub op: crate::aio::Op,
    /// Byte position in the namespace.
    pub pos: u64,
    /// The guest memory: (host address, bytes) per piece, in the command's pins.
    pub segments: crate::store::Segments,
    /// O_DIRECT (the namespace has it and the transfer is aligned for it).
    pub direct: bool,
    /// Durable before it completes (FUA, or the volatile write cache off).
    pub dsync: bool,
    /// Kernel pin mode, `fixed_buffers` wanting it: the registered buffer (its index in the DMA
    /// space's io_uring) holding all of the memory, moved through as a fixed buffer.
    pub fixed: Option<u32>,
    /// What the statistics count of it once it succeeds (none for a sync).
    pub stats: Option<stats::Transfer>,
}

/// What running a command produced (what a handler returns).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// Complete with this status and dword 0.
    Done(Status, u32),
    /// Held by the controller and completed later by other means (an Asynchronous Event
    /// Request, §5.2): the request ends without a completion entry now.
    Held,
    /// Handed to the queue's io_uring (the [`Transfer`] given to
    /// [`CommandCx::start`](super::cx::CommandCx::start)): the worker starts it and completes
    /// the command when the host has finished it.
    Started,
}

impl Outcome {
    /// Success with dword 0 `dw0`.
    pub fn ok(dw0: u32) -> Outcome {
        Outcome::Done(Status::SUCCESS, dw0)
    }
}

impl From<Status> for Outcome {
    fn from(s: Status) -> Outcome {
        Outcome::Done(s, 0)
    }
}

impl Command {
    /// The entry as fetched.
    pub fn set_sqe(&mut self, sqe: Sqe) {
        self.sqe = sqe;
    }

    /// The entry.
    pub fn sqe(&self) -> &Sqe {
        &self.sqe
    }
}

/// Completes `permit`'s command with `outcome`, unless the framework cancelled it for a reset
/// or for the client's departure ([`Cancel::Reset`]): then its result no longer matters and
/// nothing of it is reported, not even in the error log (a command failing because the
/// client left is no device error), and the next client finds the log as it was.
pub fn complete<C: Completion>(permit: Permit<C>, outcome: C::Outcome) {
    if permit.cancelled() == Some(Cancel::Reset) {
        permit.into_inner();
        return;
    }
    permit.complete(outcome);
}

impl Completion for Command {
    type Outcome = Outcome;
    type Shared = Arc<Completer>;

    fn complete(self, outcome: Outcome, ctx: &DeviceContext, completer: &Arc<Completer>) {
        match outcome {
            Outcome::Done(status, dw0) => completer.finish(ctx, &self.sqe, status, dw0),
            Outcome::Held => {}
            // Completing a permit whose transfer was never started: the worker's own mistake,
            // and the host still gets an answer.
            Outcome::Started => completer.finish(ctx, &self.sqe, Status::INTERNAL_ERROR, 0),
        }
    }

    /// The handling of the command failed inside the controller: Internal Error.
    fn fail(self, ctx: &DeviceContext, completer: &Arc<Completer>) {
        completer.finish(ctx, &self.sqe, Status::INTERNAL_ERROR, 0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsFd;
    use umdev_mdev::request::Requests;
    use umdev_pinning::{DmaSpace, Prot};

    /// A request that says how it ended.
    struct Report(std::sync::mpsc::Sender<Result<u32, ()>>);

    impl Completion for Report {
        type Outcome = u32;
        type Shared = ();
        fn complete(self, outcome: u32, _ctx: &DeviceContext, (): &()) {
            let _ = self.0.send(Ok(outcome));
        }
        fn fail(self, _ctx: &DeviceContext, (): &()) {
            let _ = self.0.send(Err(()));
        }
    }

    /// A command the framework cancelled for a reset or a departure ends unreported, however
    /// it ended (the error it met because the client left is no device error); one cancelled
    /// for an unmap, or not at all, is reported.
    #[test]
    fn a_command_cancelled_for_a_reset_or_a_departure_ends_unreported() {
        let ram = std::fs::File::from(
            nix::sys::memfd::memfd_create(c"completion-test", nix::sys::memfd::MFdFlags::MFD_CLOEXEC)
                .unwrap(),
        );
        ram.set_len(1 << 16).unwrap();
        let dma = DmaSpace::default();
        dma.map(0, 1 << 16, ram.as_fd(), 0, Prot::READ_WRITE).unwrap();
        let requests = Requests::new();
        requests.attach(DeviceContext::new(dma, Arc::new(crate::testutil::NoClient)));
        let lane = requests.lane(|| {});
        let (tx, rx) = std::sync::mpsc::channel();

        complete(lane.begin(Report(tx.clone())).unwrap(), 1);
        assert_eq!(rx.try_recv(), Ok(Ok(1)), "not cancelled: reported");

        let mut permit = lane.begin(Report(tx.clone())).unwrap();
        permit.pin_pages(&[0], Prot::READ_WRITE).unwrap();
        requests.cancel_overlapping(0, 1 << 16);
        assert_eq!(permit.cancelled(), Some(Cancel::Unmapped));
        complete(permit, 2);
        assert_eq!(rx.try_recv(), Ok(Ok(2)), "cancelled for an unmap: reported");

        let permit = lane.begin(Report(tx.clone())).unwrap();
        requests.cancel_all();
        assert_eq!(permit.cancelled(), Some(Cancel::Reset));
        complete(permit, 3);
        let departed = lane.begin(Report(tx.clone())).unwrap();
        requests.detach();
        complete(departed, 4);
        drop(tx);
        assert_eq!(
            rx.try_recv(),
            Err(std::sync::mpsc::TryRecvError::Disconnected),
            "neither reported nor failed"
        );
    }
}
