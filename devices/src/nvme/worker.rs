//! A submission queue's worker: fetch, parse, run, complete, in queue order (NVMe 1.3
//! §4.1, §7.2.x processing model: a command is fetched once the host moved the tail past
//! it).
//!
//! The worker runs on the framework's [`Worker`] (one thread per SQ, woken by the queue's
//! doorbell [`Bell`], stopped with a typed [`Stop`]) and takes one framework permit per
//! command from its [`Lane`]: the command's pins are the permit's, so a DMA_UNMAP of them
//! cancels it. Each entry is parsed ([`super::cmds`]) and handed to its handler with a
//! [`CommandCx`]; the worker itself is never seen by a handler.
//!
//! An I/O queue of a controller with file namespaces has an io_uring ([`crate::aio`]): a
//! handler hands a file transfer to it ([`Outcome::Started`]) with the command's permit, and
//! the worker fetches on while the host moves the data, up to [`MAX_IN_FLIGHT`] commands;
//! it completes each when the host finishes it ([`io::finish`]), in that order, and sleeps
//! in the ring, where a doorbell, a stop or a completion wakes it. A stopping worker waits
//! for the host to finish what is in flight (boundedly) before the pins go.

use std::os::fd::AsRawFd;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::cmds::{AdminCmd, NvmCmd};
use super::completion::{self, Command, Completer, Drained, Outcome, Transfer};
use super::ctrl::{Ctrl, DoorbellMode, Running, Stop};
use super::cx::CommandCx;
use super::queue::{RingError, Sq};
use super::spec::{event, log_page, Sqe, Status};
use super::{admin, io};
use crate::aio::{FixedBuffer, Request, Ring};
use smallvec::SmallVec;
use umdev_mdev::guest::GuestError;
use umdev_mdev::request::{self, Lane, Permit};
use umdev_mdev::worker::{Bell, KernelSleep, Poll, PollTurn, Waiter, Worker};
use umdev_mdev::DeviceContext;

/// With mapped doorbells: how long a worker spins after its last command (with a polling
/// turn: [`PollTurn`]), then how often it looks at the page (nothing rings it: the client
/// writes the page directly). A polling client submits again within microseconds; a spin
/// shorter than a scheduler time slice would put a worker that was preempted (a shared CPU)
/// to sleep for a whole look.
const POLL_SPIN: Duration = Duration::from_millis(1);
/// After the spin, a look comes after this fraction of the time the queue has been idle...
const LOOK_BACKOFF: u32 = 64;
/// ...and no sooner than this...
const MIN_LOOK: Duration = Duration::from_micros(10);
/// ...and no later than this: an idle queue's worker wakes 1,000 times a second, and a
/// command that comes after a pause of a second or more waits up to a millisecond.
const MAX_LOOK: Duration = Duration::from_millis(1);
/// Looks at the page per clock reading while spinning.
const SPIN_LOOKS: u32 = 256;
/// How often a worker waiting for CQ room looks at a mapped CQ head doorbell.
const POLL_INTERVAL: Duration = Duration::from_micros(200);
/// ...and how often the admin queue's worker looks: admin commands are rare once a driver is
/// up, each look of a worker takes the CPU from a busy I/O queue's worker for a while (10-20
/// µs here), and an I/O queue's worker watching the page wakes it for a new command
/// ([`Ctrl::nudge_admin`]).
const ADMIN_POLL_INTERVAL: Duration = Duration::from_millis(10);
/// Commands an I/O queue keeps in flight in its io_uring at most (fewer if the queue is
/// smaller): beyond this, fetching waits for a completion.
pub const MAX_IN_FLIGHT: u32 = 256;
/// Started transfers are handed to the kernel in batches of this many while commands keep
/// coming (all of them at once when the queue runs dry).
const SUBMIT_BATCH: usize = 8;
/// With shadow doorbells, a worker with at least this many transfers in flight in its
/// io_uring does not ask the host to ring for new submissions: the next transfer to finish
/// wakes it, and it reads the shadow tail then, so a busy queue costs no doorbell message. A
/// new command waits for the first of these transfers to finish (about 1/8 of a transfer's
/// time at most, when they finish evenly), or [`BUSY_LOOK`] if the host holds them all.
const BUSY_UNARMED: usize = 8;
/// See [`BUSY_UNARMED`].
const BUSY_LOOK: Duration = Duration::from_millis(1);
/// The shortest transfer before which the worker looks ahead in its SQ
/// ([`QueueWorker::look_ahead`]): a copy long enough to hide trips between caches. Before
/// every shorter command the look cost more than it hid (4 KiB random reads at QD32:
/// 0.94x); before a shorter Read of a RAM namespace it pays, because the next command is
/// likely one too, whose data it then asks for from memory, into L2 (1.17x when it went to
/// L1, and the L2 hint 1.22x over that: `Near::L2` in crate::store, docs/benchmarks.md).
const LOOK_AHEAD_MIN: u64 = 32 * 1024;
/// Completions of RAM writes a worker holds while more commands wait, at most: their
/// streaming stores are fenced once, before the first of their entries, rather than once
/// per entry, where each fence waits for its copy to reach memory (see [`QueueWorker::finish`]).
const FENCE_BATCH: usize = 4;
/// How long a stopping worker waits for the host to finish the transfers it has in flight
/// (their pins are held meanwhile); what is left then is waited for by another thread.
const QUIESCE: Duration = Duration::from_millis(1500);
/// How long a deleted queue's worker waits for CQ room to post what it owes (less than the
/// controller's bound on joining it, so the deletion never outlives the join).
const DELETE_DRAIN: Duration = Duration::from_secs(2);

/// Starts the worker of `sq` (the controller's [`super::ctrl::Spawn`]).
pub fn spawn(
    ctrl: &Arc<Ctrl>,
    sq: Arc<Sq>,
    bell: &Bell,
    alive: Running,
    generation: u64,
) -> std::io::Result<Worker<Stop>> {
    let id = sq.id;
    let name = if id == 0 { "umdev-nvme-admin".to_string() } else { format!("umdev-nvme-q{id}") };
    let completer = Completer::new(ctrl.clone(), sq, generation);
    // The lane keeps the completer for its commands, which carry none of their own.
    let lane = {
        let bell = bell.clone();
        ctrl.requests.lane_with(completer.clone(), move || bell.ring())
    };
    let poll = Poll(ctrl.config().poll);
    Worker::spawn_on(bell, name, poll, move |waiter| {
        let _alive = alive;
        // Made on the worker's own thread: the kernel's workers for its blocking I/O are this
        // thread's, and capped for it.
        let aio = Aio::for_queue(completer.ctrl(), completer.sq(), &waiter.bell());
        QueueWorker { completer, lane, aio, held: SmallVec::new(), turn: None }.run(waiter);
    })
}

/// Leaves what `ring` still has in the kernel to the draining thread, counted against each
/// transfer's namespace until the kernel finishes it ([`Ctrl::backing_held`]).
fn leave(ctrl: &Ctrl, ring: Ring<(Permit<Command>, Transfer)>) {
    use std::sync::atomic::Ordering;
    let held = ctrl.held().clone();
    let max = ctrl.config().max_held;
    for (_, t) in ring.in_flight_payloads() {
        if held.transfers_of(t.nsid).is_some_and(|tally| tally.fetch_add(1, Ordering::AcqRel) + 1 == max) {
            log::warn!(
                "nvme: ns{}: its backing holds {max} transfers of stopped queues (max_held): new commands \
                 to it fail with Namespace Not Ready until it answers",
                t.nsid
            );
        }
    }
    ring.detach(move |(permit, t)| {
        // Ended without a report: a queue that stopped posts nothing more (a deleted one is
        // retired only after its worker aborted what it still had queued).
        let _ = permit.into_inner();
        if let Some(tally) = held.transfers_of(t.nsid) {
            tally.fetch_sub(1, Ordering::AcqRel);
        }
    });
}

/// An I/O queue's io_uring, and where each namespace's files are in it.
struct Aio {
    /// Each transfer's payload: the command's permit (holding its pins) and the transfer.
    ring: Ring<(Permit<Command>, Transfer)>,
    /// By NSID - 1: the file through the page cache, and the O_DIRECT one.
    files: Vec<Option<(u32, Option<u32>)>>,
}

impl Aio {
    /// The ring of I/O queue `sq`, if the controller moves file data through io_uring (a
    /// ring that cannot be made is logged: the queue then moves its data synchronously).
    fn for_queue(ctrl: &Arc<Ctrl>, sq: &Sq, bell: &Bell) -> Option<Aio> {
        if sq.id == 0 || ctrl.config().aio != super::ctrl::AioMode::IoUring {
            return None;
        }
        let mut fds = Vec::new();
        let mut files = Vec::new();
        for ns in &ctrl.config().namespaces {
            let store = ns.as_ref().map(|ns| ns.store());
            files.push(store.and_then(|s| s.buffered_fd()).map(|buffered| {
                fds.push(buffered);
                let buffered = (fds.len() - 1) as u32;
                let direct = store.and_then(|s| s.direct_fd()).map(|d| {
                    fds.push(d);
                    (fds.len() - 1) as u32
                });
                (buffered, direct)
            }));
        }
        let made = bell.eventfd().and_then(|kick| Ring::new(sq.entries.min(MAX_IN_FLIGHT), &fds, Some(kick)));
        match made {
            Ok(ring) => Some(Aio { ring, files }),
            Err(e) => {
                ctrl.warn(format_args!(
                    "nvme: queue {}: no io_uring ({e}): its file transfers are synchronous",
                    sq.id
                ));
                None
            }
        }
    }

    /// Starts the transfer `t` that `permit`'s handler asked for; a refusal completes the
    /// command.
    fn start(&mut self, permit: Permit<Command>, t: Transfer) {
        let Some(&Some((buffered, direct))) = self.files.get((t.nsid as usize).wrapping_sub(1)) else {
            return completion::complete(permit, Status::INTERNAL_ERROR.into());
        };
        let direct = direct.filter(|_| t.direct);
        let segments = t.segments.clone();
        // The buffer is in the DMA space's ring, which the permit's context keeps open.
        let ring = permit.ctx().kernel_ring_fd().map(|fd| fd.as_raw_fd());
        let fixed = t.fixed.zip(ring).map(|(index, ring)| FixedBuffer { ring, index });
        let request = Request {
            op: t.op,
            file: direct.unwrap_or(buffered),
            fallback: direct.map(|_| buffered),
            pos: t.pos,
            segments: &segments,
            dsync: t.dsync,
            fixed,
        };
        // SAFETY: the segments (and the registered buffer holding them, if fixed) are in the
        // permit's pins (CommandCx::pin_for_transfer), which the permit keeps until the ring
        // gives it back when the host is done.
        if let Err(((permit, _), e)) = unsafe { self.ring.start((permit, t), &request) } {
            permit.shared().ctrl().warn(format_args!("nvme: a transfer refused by the io_uring: {e}"));
            completion::complete(permit, Status::DATA_TRANSFER_ERROR.into());
            return;
        }
        if self.ring.queued() >= SUBMIT_BATCH {
            let _ = self.ring.submit();
        }
    }

    /// Completes what the host finished, the completions found together sharing an
    /// interrupt (see [`Completer::batch`]); how many.
    fn reap(&mut self, completer: &Completer) -> usize {
        completer.batch(|| self.ring.reap(io::finish))
    }
}

/// One queue's worker state.
struct QueueWorker {
    completer: Arc<Completer>,
    /// The queue's commands, tracked by the framework.
    lane: Lane<Arc<Completer>>,
    /// The queue's io_uring, for file transfers.
    aio: Option<Aio>,
    /// Ended commands whose completions wait for [`QueueWorker::flush`], in queue order.
    held: SmallVec<[(Permit<Command>, Outcome); FENCE_BATCH]>,
    /// With mapped doorbells, the turn this worker spins on: taken when its queue runs dry,
    /// kept while the queue stays active, given back when the spin ends and before any other
    /// wait (a full CQ or io_uring, bus mastering off, a fatal status, a stop), so that a
    /// worker that waits holds no turn another could spin on.
    turn: Option<PollTurn>,
}

/// Whether a worker with mapped doorbells whose queue has been idle for `idle` spins: within
/// [`POLL_SPIN`] of its last command, on a turn it holds or takes now. Past it, or with no
/// turn free, it looks at the page from time to time instead, and gives back its turn.
fn spin_turn(turn: &mut Option<PollTurn>, idle: Duration) -> bool {
    if idle >= POLL_SPIN {
        *turn = None;
    } else if turn.is_none() {
        *turn = PollTurn::take();
    }
    turn.is_some()
}

impl QueueWorker {
    fn ctrl(&self) -> &Arc<Ctrl> {
        self.completer.ctrl()
    }

    fn sq(&self) -> &Arc<Sq> {
        self.completer.sq()
    }

    /// Serves the queue until told to stop.
    fn run(mut self, mut waiter: Waiter<Stop>) {
        // This thread begins and ends the queue's commands (the io_uring's too).
        self.lane.claim();
        let id = self.sq().id;
        let entries = self.sq().entries;
        let mut head = 0u32;
        // The tail as last read: the doorbell is read again only once the entries up to it
        // are fetched (or it was invalid).
        let mut tail = 0u32;
        let mut last_work = Instant::now();
        // Commands fetched since the worker last found its queue empty, and whether that
        // run of work was a lone command (see `idle`).
        let mut fetched = 0u32;
        let mut lone = false;
        let mut bad_tail = None;
        // The last pass ran a command and nothing else: held completions may wait for the
        // next command if one is queued (and no transfer in the io_uring could end first).
        let mut ran = false;
        let stop = loop {
            let ran_last = std::mem::take(&mut ran);
            if !self.held.is_empty() {
                let hold_on = ran_last
                    && self.held.len() < FENCE_BATCH
                    && head != tail
                    && tail < entries
                    && self.aio.as_ref().is_none_or(|a| a.ring.in_flight() == 0);
                if !hold_on {
                    self.flush_held();
                }
            }
            if let Some(stop) = waiter.stopped() {
                self.turn = None;
                break stop;
            }
            // What the host finished ends first, whatever follows: its pins go with it.
            if let Some(aio) = &mut self.aio {
                if aio.reap(&self.completer) > 0 {
                    // What the batch held goes out now, not after the fetches that follow.
                    self.raise_due(true);
                }
            }
            if self.ctrl().fatal() {
                self.flush();
                self.turn = None;
                // Until a disable stops the worker (or a ring: look again).
                waiter.sleep(|| false, None);
                continue;
            }
            if self.completer.waiting() > 0 && !self.drain(&mut waiter) {
                continue;
            }
            if head == tail || tail >= entries {
                tail = self.ctrl().sq_tail(id);
                self.sq().known_tail.store(tail, std::sync::atomic::Ordering::Relaxed);
            }
            if tail >= entries {
                // Only a mapped doorbell can hold this (a written one is checked).
                if bad_tail != Some(tail) {
                    bad_tail = Some(tail);
                    self.ctrl().event(event::TYPE_ERROR, event::INVALID_DOORBELL_VALUE, log_page::ERROR);
                }
                // Until the host writes another value: this one would read as new work at
                // every look.
                self.idle(&mut waiter, head, tail, last_work, false);
                continue;
            }
            if tail == head {
                if fetched > 0 {
                    lone = fetched == 1;
                    fetched = 0;
                    // When the queue ran dry, not at each fetch: one clock reading per run.
                    last_work = Instant::now();
                }
                self.idle(&mut waiter, head, tail, last_work, lone);
                continue;
            }
            if self.aio.as_ref().is_some_and(|a| !a.ring.has_room()) {
                self.turn = None;
            }
            if let Some(aio) = self.aio.as_mut().filter(|a| !a.ring.has_room()) {
                // As many in flight as the ring holds: the next command waits for one to end.
                waiter.wait_in(|| false, None, false, &mut aio.ring);
                continue;
            }
            let mut permit = match self.lane.begin(Command::default()) {
                Ok(permit) => permit,
                // The client left: the controller is reset next, which stops this worker.
                Err(_) => {
                    self.flush();
                    self.turn = None;
                    waiter.sleep(|| false, None);
                    continue;
                }
            };
            let sqe = match self.sq().fetch(permit.ctx(), head) {
                Ok(sqe) => sqe,
                Err(RingError::Guest(GuestError::BusMasterOff)) => {
                    permit.into_inner();
                    self.flush();
                    self.turn = None;
                    // Until bus mastering comes back (which rings every queue) or a doorbell.
                    waiter.sleep(|| false, None);
                    continue;
                }
                Err(RingError::Guest(e)) => {
                    permit.into_inner();
                    self.flush();
                    self.ctrl().fail(&format!("SQ {id} entry {head} cannot be read: {e}"));
                    continue;
                }
            };
            head = (head + 1) % entries;
            fetched = fetched.saturating_add(1);
            permit.get_mut().set_sqe(sqe);
            if self.sq().advance(head, sqe.cid()) {
                self.finish(permit, Status::ABORT_REQUESTED.into());
                continue;
            }
            if id != 0
                && head != tail
                && io::Peek::of(self.ctrl(), &sqe).is_some_and(|p| p.len() >= LOOK_AHEAD_MIN || p.reads_ram())
            {
                self.look_ahead(permit.ctx(), head, tail);
            }
            self.execute(permit, sqe);
            self.raise_due(false);
            ran = true;
        };
        self.flush();
        if let Some(mut aio) = self.aio.take() {
            // Pins go only once the host is done with the memory: what it does not finish in
            // time is waited for by another thread, which keeps the pins until then.
            let left = aio.ring.quiesce(QUIESCE, io::finish);
            if left > 0 {
                log::warn!(
                    "nvme: queue {}: {left} transfer(s) still in the host after {QUIESCE:?}",
                    self.sq().id
                );
            }
            leave(self.ctrl(), aio.ring);
        }
        if stop == Stop::Delete {
            self.abort_remaining(&mut waiter, head);
            self.completer.retire();
        }
    }

    /// Parses the command and runs its handler; a panic in it fails the command (Internal
    /// Error) and the queue goes on.
    fn execute(&mut self, mut permit: Permit<Command>, sqe: Sqe) {
        let id = self.sq().id;
        let cx = CommandCx::new(self.ctrl(), self.sq(), self.completer.generation(), &mut permit)
            .with_aio(self.aio.is_some());
        let outcome =
            request::serve(format_args!("nvme command {:#04x} on queue {id}", sqe.opcode()), || {
                if id == 0 {
                    match AdminCmd::parse(&sqe) {
                        Ok(cmd) => admin::execute(&cx, cmd),
                        Err(e) => Status::from(e).into(),
                    }
                } else {
                    match NvmCmd::parse(&sqe) {
                        Ok(cmd) => io::execute(&cx, cmd),
                        Err(e) => Status::from(e).into(),
                    }
                }
            });
        let transfer = cx.into_transfer();
        match (outcome, &mut self.aio, transfer) {
            (Some(Outcome::Started), Some(aio), Some(t)) => aio.start(permit, t),
            (Some(outcome), _, _) => self.finish(permit, outcome),
            (None, _, _) => {
                self.flush();
                drop(permit) // Internal Error
            }
        }
    }

    /// Before a long command or a Read of a RAM namespace runs: starts loading what the next
    /// queued one reads first (its entry at `next` was asked for by the look before, see
    /// below): its PRP list and the first page of a RAM read's data ([`io::Peek::prefetch`]),
    /// and the entry after it, which the host wrote in its own cache. Each is a trip between
    /// caches or to memory that the running command then hides instead of the worker waiting
    /// for it later.
    fn look_ahead(&self, ctx: &DeviceContext, next: u32, tail: u32) {
        if let Some(peek) = self.sq().fetch(ctx, next).ok().and_then(|sqe| io::Peek::of(self.ctrl(), &sqe)) {
            peek.prefetch(ctx);
        }
        let after = (next + 1) % self.sq().entries;
        if after != tail {
            self.sq().prefetch(ctx, after);
        }
    }

    /// Completes `permit` with `outcome`, or holds it for [`QueueWorker::flush`] if it left
    /// RAM writes unfenced (or others are held, which it must not overtake): the worker
    /// flushes before anything but running the next queued command, and after
    /// [`FENCE_BATCH`] of them, so a completion waits for at most that many commands' work
    /// and never for a sleep.
    fn finish(&mut self, permit: Permit<Command>, outcome: Outcome) {
        if self.held.is_empty() && !crate::store::writes_unfenced() {
            return completion::complete(permit, outcome);
        }
        self.held.push((permit, outcome));
    }

    /// Completes what [`QueueWorker::finish`] held, in order: the first entry's write fences
    /// the writes of all of them (`Cq`'s `write_cqe`).
    #[inline]
    fn flush(&mut self) {
        if !self.held.is_empty() {
            self.flush_held();
        }
    }

    #[inline(never)]
    fn flush_held(&mut self) {
        for (permit, outcome) in self.held.drain(..) {
            completion::complete(permit, outcome);
        }
    }

    /// Posts the backlog; true if it is empty now. Otherwise waits for what it waits for (CQ
    /// room: the CQ head doorbell rings; bus mastering: turning it on rings) and returns false.
    fn drain(&mut self, waiter: &mut Waiter<Stop>) -> bool {
        self.flush();
        // Transfers started but not yet handed to the host go now, not after the wait.
        if let Some(aio) = &mut self.aio {
            let _ = aio.ring.submit();
        }
        let Some(ctx) = self.lane.context() else {
            // The client left: nothing can be posted; the reset that follows stops us.
            self.turn = None;
            waiter.sleep(|| false, None);
            return false;
        };
        let drained = self.completer.drain(&ctx);
        if drained != Drained::Empty {
            // The backlog waits for the host or for bus mastering: no spinning meanwhile.
            self.turn = None;
        }
        match drained {
            Drained::Empty => true,
            Drained::BusMasterOff => {
                waiter.sleep(|| false, None);
                false
            }
            Drained::Full => {
                let cq = self.sq().cq.clone();
                let ctrl = self.ctrl();
                // The host makes room only for what it is told of: entries held for a shared
                // interrupt or by coalescing are signalled now (both are bounds on a delay).
                self.raise_held();
                ctrl.cq_doorbell(cq.id).want_room(&waiter.bell());
                ctrl.arm_cq(cq.id);
                let room = || cq.has_room(ctrl.cq_head(cq.id));
                // A mapped CQ head doorbell rings nothing: look at the page from time to time.
                let look = match ctrl.doorbell_mode() {
                    DoorbellMode::Message => None,
                    DoorbellMode::Mapped => Some(POLL_INTERVAL),
                };
                waiter.sleep(room, look);
                false
            }
        }
    }

    /// Nothing to fetch: held interrupts go out, then sleep until a doorbell (or until
    /// coalescing's aggregation time is up). `tail`: the SQ tail last read (`head` when the
    /// queue is empty, or a value past its end that a shadow or mapped doorbell held); any
    /// other value in the doorbell is news. `lone`: the work just done was a single command,
    /// the only case where a message doorbell is watched for before sleeping.
    fn idle(&mut self, waiter: &mut Waiter<Stop>, head: u32, tail: u32, last_work: Instant, lone: bool) {
        self.flush();
        self.raise_due(true);
        let QueueWorker { completer, aio, turn, .. } = self;
        let deadline = completer.sq().cq.deadline().map(|d| d.saturating_duration_since(Instant::now()));
        let (ctrl, id) = (completer.ctrl(), completer.sq().id);
        let rung = || ctrl.sq_tail(id) != tail;
        // With shadow doorbells the host writes the register (which rings) only if asked.
        let arm = || ctrl.arm_sq(id, head);
        // With an io_uring the worker sleeps there: a completion ends the wait too.
        let ring = aio.as_mut().map(|a| &mut a.ring);
        match ctrl.doorbell_mode() {
            // Right after a lone command (queue depth 1: the wake-up is the whole latency)
            // the next doorbell is likely close: the worker polls for it (its `poll_us`) if a
            // CPU is free. After a batch the wake-up is shared by the batch's commands and
            // polling would only burn the CPU the client needs to send the next one. While
            // it polls, a host with shadow doorbells is not asked to ring: it writes the
            // shadow only, which the poll sees, and spares itself the message.
            DoorbellMode::Message => {
                let poll = lone && last_work.elapsed() < ctrl.config().poll;
                match (ring, poll) {
                    (Some(ring), _) if ring.in_flight() >= BUSY_UNARMED => {
                        let look = deadline.map_or(BUSY_LOOK, |d| d.min(BUSY_LOOK));
                        let _ = waiter.wait_in(rung, Some(look), false, ring);
                    }
                    (Some(ring), poll) => {
                        let _ = waiter.wait_in_armed(rung, arm, deadline, poll, ring);
                    }
                    (None, true) => {
                        let _ = waiter.wait_armed(rung, arm, deadline);
                    }
                    (None, false) => {
                        arm();
                        let _ = waiter.sleep(rung, deadline);
                    }
                }
            }
            DoorbellMode::Mapped if spin_turn(turn, last_work.elapsed()) => {
                if id != 0 {
                    ctrl.nudge_admin();
                }
                arm();
                let mut ring = ring;
                for _ in 0..SPIN_LOOKS {
                    if rung() || ring.as_mut().is_some_and(|r| r.pending()) {
                        return;
                    }
                    std::hint::spin_loop();
                }
            }
            DoorbellMode::Mapped => {
                if id != 0 {
                    ctrl.nudge_admin();
                }
                arm();
                // The longer the queue has been idle, the longer the look: a client that paused
                // (preempted, say) and comes back finds the worker looking every few
                // microseconds at first, then less often, up to the interval.
                let interval = if id == 0 { ADMIN_POLL_INTERVAL } else { MAX_LOOK };
                let interval = (last_work.elapsed() / LOOK_BACKOFF).clamp(MIN_LOOK, interval);
                let look = deadline.map_or(interval, |d| d.min(interval));
                match ring {
                    Some(ring) => {
                        let _ = waiter.wait_in(rung, Some(look), false, ring);
                    }
                    None => {
                        let _ = waiter.sleep(rung, Some(look));
                    }
                }
            }
        }
    }

    /// Raises the CQ's vector for whatever completions it holds, due or not: the CQ is full
    /// (the host makes room only for what it is told of) or gets no more from this queue.
    fn raise_held(&self) {
        if self.sq().cq.take_held() {
            self.ctrl().interrupt(&self.sq().cq);
        }
    }

    /// Raises the CQ's vector if held completions are due (see [`super::queue::Cq::due`]).
    fn raise_due(&self, idle: bool) {
        if self.sq().cq.due(idle) {
            self.ctrl().interrupt(&self.sq().cq);
        }
    }

    /// Delete I/O SQ (§5.6) with commands still queued: each completes as aborted, after what
    /// waits in the backlog, before the deletion completes. The host makes room as it reaps
    /// them; if it does not within [`DELETE_DRAIN`] (a host deleting a queue whose
    /// completions it does not consume), or the controller is disabled meanwhile, what
    /// cannot be posted is dropped: the worker always ends.
    fn abort_remaining(&self, waiter: &mut Waiter<Stop>, mut head: u32) {
        // A deletion that gave up waiting for this worker retired the queue: its doorbell and
        // ring may be a new queue's by now.
        if !self.completer.current() {
            return;
        }
        let Some(ctx) = self.lane.context() else { return };
        let (ctrl, sq) = (self.ctrl(), self.sq());
        let tail = ctrl.sq_tail(sq.id);
        let mut left = sq.entries;
        while head != tail && tail < sq.entries && left > 0 {
            let Ok(sqe) = sq.fetch(&ctx, head) else { break };
            head = (head + 1) % sq.entries;
            sq.advance(head, sqe.cid());
            self.completer.finish(&ctx, &sqe, Status::ABORTED_SQ_DELETION, 0);
            left -= 1;
        }
        let deadline = Instant::now() + DELETE_DRAIN;
        let cq = sq.cq.clone();
        while self.completer.drain(&ctx) == Drained::Full && self.completer.current() {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                break;
            }
            self.raise_held();
            ctrl.cq_doorbell(cq.id).want_room(&waiter.bell());
            ctrl.arm_cq(cq.id);
            let look = match ctrl.doorbell_mode() {
                DoorbellMode::Message => left,
                DoorbellMode::Mapped => left.min(POLL_INTERVAL),
            };
            waiter.linger(|| cq.has_room(ctrl.cq_head(cq.id)), look);
        }
        // The queue's last entries: nothing more will come to share their interrupt.
        self.raise_held();
        let dropped = self.completer.abandon();
        if dropped > 0 {
            log::debug!("nvme: SQ {} deleted with its CQ full: {dropped} completion(s) dropped", sq.id);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_mapped_worker_spins_only_on_a_turn_of_its_own() {
        // Other tests' workers take turns too: with every free turn held here, the worker
        // finds none (unless one was given back meanwhile: try again).
        let found_none = (0..1000).any(|_| {
            let _held: Vec<PollTurn> = std::iter::from_fn(PollTurn::take).collect();
            let mut turn = None;
            !spin_turn(&mut turn, Duration::ZERO) && turn.is_none()
        });
        assert!(found_none, "spun with every turn taken");
        // A turn taken is kept while the queue stays active, and given back once the spin is
        // over.
        let Some(taken) = (0..1000).find_map(|_| PollTurn::take()) else {
            return eprintln!("skipped: no turn came free");
        };
        let mut turn = Some(taken);
        assert!(spin_turn(&mut turn, Duration::ZERO));
        assert!(spin_turn(&mut turn, POLL_SPIN / 2));
        assert!(turn.is_some());
        assert!(!spin_turn(&mut turn, POLL_SPIN));
        assert!(turn.is_none(), "given back");
    }
}
