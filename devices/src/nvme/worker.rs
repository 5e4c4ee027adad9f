//! A submission queue's worker: fetch, execute, complete, in queue order.
//!
//! Each command runs on a [`Permit`]: completing it posts the command's completion entry;
//! dropping it unfinished (a panic in the command's handling, caught by
//! [`request::serve`]) posts Internal Error instead, so the host always gets an answer.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::ctrl::{Ctrl, DoorbellMode, Stop};
use super::queue::{completion, PostError, RingError, Signal, Sq};
use super::spec::{Cqe, Sqe, Status};
use super::{admin, io};
use umdev_mdev::guest::GuestError;
use umdev_mdev::request::{self, Completion, Lane, Permit};
use umdev_mdev::worker::{Waiter, Wake};
use umdev_mdev::DeviceContext;

/// How long an idle worker sleeps between looks (it is woken by doorbells anyway).
const IDLE: Duration = Duration::from_millis(500);
/// With mapped doorbells: how long a worker spins after its last command, then how often
/// it looks at the page.
const POLL_SPIN: Duration = Duration::from_micros(50);
const POLL_INTERVAL: Duration = Duration::from_micros(200);

/// What executing a command produced.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// Complete with this status and dword 0.
    Done(Status, u32),
    /// Held by the controller, completed later (an Asynchronous Event Request).
    Held,
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

/// One queue's worker.
pub struct QueueWorker {
    /// The controller.
    pub ctrl: Arc<Ctrl>,
    /// The queue.
    pub sq: Arc<Sq>,
    /// The client's DMA context.
    pub ctx: DeviceContext,
    /// The controller generation the queue belongs to.
    pub generation: u64,
    /// The queue's commands, tracked by the framework.
    lane: Lane,
}

/// A command in flight: how it completes.
pub struct Command {
    worker: Arc<QueueWorker>,
    sqe: Sqe,
}

impl Completion for Command {
    type Outcome = Outcome;

    fn complete(self, outcome: Outcome, _ctx: &DeviceContext) {
        if let Outcome::Done(status, dw0) = outcome {
            self.worker.finish(&self.sqe, status, dw0);
        }
    }

    /// The handling of the command failed inside the controller: Internal Error.
    fn fail(self, _ctx: &DeviceContext) {
        self.worker.finish(&self.sqe, Status::INTERNAL_ERROR, 0);
    }
}

impl QueueWorker {
    /// A worker for `sq`.
    pub fn new(
        ctrl: Arc<Ctrl>,
        sq: Arc<Sq>,
        ctx: DeviceContext,
        generation: u64,
        lane: Lane,
    ) -> Arc<QueueWorker> {
        Arc::new(QueueWorker { ctrl, sq, ctx, generation, lane })
    }

    /// The queue's statistics.
    pub fn stats(&self) -> &super::stats::QueueStats {
        &self.ctrl.stats[usize::from(self.sq.id)]
    }

    fn stopping(&self) -> bool {
        self.sq.stopping().is_some()
    }

    /// The controller is being reset or disabled (or already was since this worker began):
    /// long work stops, waits end.
    pub(super) fn cancelled(&self) -> bool {
        self.sq.stopping() == Some(Stop::Reset) || !self.current()
    }

    /// Whether this queue's work still counts (no disable since it started).
    pub fn current(&self) -> bool {
        self.ctrl.generation.load(Ordering::Acquire) == self.generation
    }

    /// Serves the queue until told to stop.
    pub fn run(self: Arc<Self>, mut waiter: Waiter<Stop>) {
        let id = self.sq.id;
        let mut head = 0u32;
        let mut last_work = Instant::now();
        // Commands fetched since the worker last found its queue empty, and whether that
        // run of work was a lone command (see `idle`).
        let mut fetched = 0u32;
        let mut lone = false;
        let mut bad_tail = None;
        while !self.stopping() {
            if self.ctrl.fatal() || !self.ctx.bus_master() {
                // Until the next doorbell or a wake-up (a reset, bus mastering back on), not
                // until one differing from `head`: queued commands must not keep it awake.
                waiter.sleep(|| false, Some(Duration::from_millis(10)));
                continue;
            }
            let tail = self.ctrl.sq_tail(id);
            if tail >= self.sq.entries {
                // Only a mapped doorbell can hold this (a written one is checked).
                if bad_tail != Some(tail) {
                    bad_tail = Some(tail);
                    self.ctrl.event(
                        super::spec::event::TYPE_ERROR,
                        super::spec::event::INVALID_DOORBELL_VALUE,
                        1,
                    );
                }
                self.idle(&mut waiter, head, last_work, false);
                continue;
            }
            if tail == head {
                if fetched > 0 {
                    lone = fetched == 1;
                    fetched = 0;
                }
                self.idle(&mut waiter, head, last_work, lone);
                continue;
            }
            let sqe = match self.sq.fetch(&self.ctx, head) {
                Ok(sqe) => sqe,
                Err(RingError::Guest(GuestError::BusMasterOff)) => continue,
                Err(RingError::Guest(e)) => {
                    self.ctrl.fail(&format!("SQ {id} entry {head} cannot be read: {e}"));
                    continue;
                }
            };
            head = (head + 1) % self.sq.entries;
            last_work = Instant::now();
            fetched = fetched.saturating_add(1);
            let aborted = self.sq.advance(head, sqe.cid());
            let permit = match self.lane.begin(Command { worker: self.clone(), sqe }) {
                Ok(permit) => permit,
                // The client left: the framework stops the queue next.
                Err(_) => continue,
            };
            if aborted {
                permit.complete(Status::ABORT_REQUESTED.into());
                continue;
            }
            self.execute(permit);
            self.raise_due(false);
        }
        if self.sq.stopping() == Some(Stop::Delete) {
            self.abort_remaining(head);
        }
    }

    fn execute(self: &Arc<Self>, mut permit: Permit<Command>) {
        let sqe = permit.get().sqe;
        let outcome = request::serve(
            format_args!("nvme command {:#04x} on queue {}", sqe.opcode(), self.sq.id),
            || {
                if self.sq.id == 0 {
                    admin::execute(self, &sqe)
                } else {
                    io::execute(self, &mut permit, &sqe)
                }
            },
        );
        match outcome {
            Some(outcome) => permit.complete(outcome),
            None => drop(permit), // Internal Error
        }
    }

    /// Nothing to fetch: held interrupts go out, then sleep until a doorbell (or until
    /// coalescing's aggregation time is up). `lone`: the work just done was a single
    /// command, the only case where a message doorbell is watched for before sleeping.
    fn idle(&self, waiter: &mut Waiter<Stop>, head: u32, last_work: Instant, lone: bool) {
        self.raise_due(true);
        let wait = match self.sq.cq.deadline() {
            Some(deadline) => deadline.saturating_duration_since(Instant::now()).min(IDLE),
            None => IDLE,
        };
        let id = self.sq.id;
        let rung = || self.ctrl.sq_tail(id) != head;
        let woke = match self.ctrl.config.doorbells {
            // Right after a lone command (queue depth 1: the wake-up is the whole latency)
            // the next doorbell is likely close: the worker polls for it (its `poll_us`) if a
            // CPU is free. After a batch the wake-up is shared by the batch's commands and
            // polling would only burn the CPU the client needs to send the next one.
            DoorbellMode::Message if lone && last_work.elapsed() < self.ctrl.config.poll => {
                waiter.wait(rung, Some(wait))
            }
            DoorbellMode::Message => waiter.sleep(rung, Some(wait)),
            DoorbellMode::Mapped if last_work.elapsed() < POLL_SPIN => {
                std::hint::spin_loop();
                Wake::Work
            }
            DoorbellMode::Mapped => waiter.sleep(rung, Some(wait.min(POLL_INTERVAL))),
        };
        // A stop is seen by the run loop's own look.
        let _ = woke;
    }

    /// Raises the CQ's vector if held completions are due (see [`super::queue::Cq::due`]).
    fn raise_due(&self, idle: bool) {
        if self.sq.cq.due(idle) {
            self.ctrl.interrupt(&self.sq.cq);
        }
    }

    /// Posts the completion of `sqe`, raising the interrupt it calls for.
    pub fn finish(&self, sqe: &Sqe, status: Status, dw0: u32) {
        self.stats().command(!status.ok());
        if !status.ok() {
            self.ctrl.admin().log_error(self.sq.id, sqe, status);
        }
        let cqe = completion(&self.sq, sqe.cid(), status, dw0);
        self.post(cqe, true);
    }

    /// Posts `cqe` on the queue's CQ; with `wait`, a full CQ is waited for until a stop.
    pub fn post(&self, cqe: Cqe, wait: bool) {
        // Commands still waiting: their completions may share this one's interrupt.
        let (tail, head) = (self.ctrl.sq_tail(self.sq.id), self.sq.head.load(Ordering::Acquire));
        let queued =
            if tail < self.sq.entries { (tail + self.sq.entries - head) % self.sq.entries } else { 0 };
        let cq = &self.sq.cq;
        let head = || self.ctrl.cq_head(cq.id);
        // Waiting for room ends with a reset, a newer generation, or the CQ's deletion (a
        // worker outlived by a Delete SQ must not write into a CQ the guest has freed).
        let stop = || self.cancelled() || !self.ctrl.cq_live(cq);
        if !self.current() {
            return;
        }
        loop {
            match cq.post(&self.ctx, cqe, &head, &stop, wait, queued) {
                Ok(Signal::Now) => self.ctrl.interrupt(cq),
                Ok(Signal::Held) | Ok(Signal::None) => {}
                Err(PostError::Full) => {
                    log::debug!("nvme: CQ {} full: completion of cid {} dropped", cq.id, u16::from(cqe.cid))
                }
                // Bus mastering is off: the completion waits for it (or for a stop).
                Err(PostError::Ring(RingError::Guest(GuestError::BusMasterOff))) if wait && !stop() => {
                    // Woken by bus_master_changed (the worker's doorbell wakes this thread).
                    std::thread::park_timeout(Duration::from_millis(10));
                    continue;
                }
                Err(PostError::Ring(RingError::Guest(GuestError::BusMasterOff))) => {}
                Err(PostError::Ring(RingError::Guest(e))) => {
                    self.ctrl.fail(&format!("CQ {} cannot be written: {e}", cq.id));
                }
            }
            return;
        }
    }

    /// Delete I/O SQ with commands still queued: each completes as aborted.
    fn abort_remaining(self: &Arc<Self>, mut head: u32) {
        let tail = self.ctrl.sq_tail(self.sq.id);
        let mut left = self.sq.entries;
        while head != tail && tail < self.sq.entries && left > 0 {
            let Ok(sqe) = self.sq.fetch(&self.ctx, head) else { break };
            head = (head + 1) % self.sq.entries;
            self.sq.advance(head, sqe.cid());
            self.finish(&sqe, Status::ABORTED_SQ_DELETION, 0);
            left -= 1;
        }
    }
}
