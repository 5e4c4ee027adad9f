// The biased lock's protocol, with no data and no policy (I19 in DESIGN.md). Not a module of
// its own: `biased/mod.rs` includes this text with std's atomics, and tests/biased_model.rs
// includes it with shuttle's, so the model checks this very code. The including scope
// provides `AtomicBool`, `AtomicU32`, `AtomicU64`, `Ordering`, and:
//
// - `light_fence()`: the owner's side of the fence pair (a compiler fence; the other side's
//   `heavy_fence` makes it a full one for as long as it matters);
// - `heavy_fence()`: a full fence on every thread of the process (`membarrier(2)`);
// - `asymmetric()`: whether `heavy_fence` is available, so that a lock may have an owner;
// - `backoff(&mut u32)`: one step of a waiter's spin, yield, nap;
// - `broken(Break) -> bool`: false, but for the model's faults (a step left out on purpose).

/// A step of the protocol the model leaves out (`broken` says yes) to show it would notice.
#[allow(dead_code)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Break {
    /// The owner goes in without looking at `owner` again after its fence.
    Recheck,
    /// A gate holder goes in without raising `foreign`.
    ForeignFlag,
    /// A gate holder goes in without waiting for the owner's `held` to drop.
    WaitForOwner,
}

/// `RawBiased::owner` before any thread claimed the lock.
const UNOWNED: u64 = 0;
/// `RawBiased::owner` once the bias is revoked: every taker goes through the gate.
const REVOKED: u64 = u64::MAX;

/// The lock word set. The owner takes the lock with plain stores and loads (`held`, then a
/// look at `foreign`); everyone else takes `gate`, a spin lock, and, while the lock has an
/// owner, raises `foreign`, fences every thread and waits for `held` to drop. A thread that
/// holds the lock and takes it again is refused (a panic; `None` from a try), whichever way
/// it holds it: `held` and `gate_holder` say so.
struct RawBiased {
    /// The owning thread's token, [`UNOWNED`] or [`REVOKED`]. Changed only by a gate holder.
    owner: AtomicU64,
    /// The owner holds, or is about to: written by the owner only.
    held: AtomicBool,
    /// A gate holder excludes the owner: written by the gate holder only.
    foreign: AtomicBool,
    gate: AtomicBool,
    /// The gate holder's token, 0 when nobody holds the gate: written by the gate holder
    /// only, read to refuse its own second take (only a thread's own store can ever show it
    /// its own token). 32 bits, so that a shard and its lock keep to two cache lines: tokens
    /// are below 2^32 (`biased::take_token`).
    gate_holder: AtomicU32,
}

/// How a hold was taken, so that it is given back the same way.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Hold {
    /// The owner's: `held` set.
    Owner,
    /// Through the gate, with no owner to exclude (none, revoked, or the taker itself).
    Gate,
    /// Through the gate, `foreign` raised and the owner seen out.
    Fenced,
}

impl RawBiased {
    fn new() -> RawBiased {
        RawBiased {
            owner: AtomicU64::new(UNOWNED),
            held: AtomicBool::new(false),
            foreign: AtomicBool::new(false),
            gate: AtomicBool::new(false),
            gate_holder: AtomicU32::new(0),
        }
    }

    /// Whether `me` holds the lock now, as its owner or through the gate. `held` is written
    /// by the owner only, so the owner reading it true holds the lock (or took it and let
    /// its guard leak, which must not let it in again either).
    #[inline]
    fn held_by(&self, me: u64) -> bool {
        (self.owner.load(Ordering::Relaxed) == me && self.held.load(Ordering::Relaxed)) || self.gate_held_by(me)
    }

    /// Whether `me` holds the gate now.
    #[inline]
    fn gate_held_by(&self, me: u64) -> bool {
        u64::from(self.gate_holder.load(Ordering::Relaxed)) == me
    }

    /// Takes the lock for thread `me` (never [`UNOWNED`] or [`REVOKED`]); with `claim`, an
    /// unowned lock becomes `me`'s.
    /// Panics if `me` holds it already: a second hold would be a second guard to one value.
    #[inline]
    fn lock(&self, me: u64, claim: bool) -> Hold {
        if self.owner.load(Ordering::Relaxed) == me {
            // The owner may hold it as the owner, or through the gate (its first, claiming
            // take, or a take after a gate holder kept it out).
            if self.held.load(Ordering::Relaxed) || self.gate_held_by(me) {
                reentered();
            }
            if self.try_owner(me) {
                return Hold::Owner;
            }
        }
        self.lock_gate(me, claim)
    }

    /// The owner's take: announce, fence, and go in only if no gate holder excludes us and we
    /// still own the lock (a revocation may have happened since our first look).
    #[inline]
    fn try_owner(&self, me: u64) -> bool {
        self.held.store(true, Ordering::Relaxed);
        light_fence();
        // Acquire: reading the `false` a gate holder stored on leaving, its writes are ours.
        if !self.foreign.load(Ordering::Acquire)
            && (broken(Break::Recheck) || self.owner.load(Ordering::Relaxed) == me)
        {
            return true;
        }
        self.held.store(false, Ordering::Release);
        false
    }

    /// The gate's take (a revocation's too); panics if `me` holds the lock already.
    #[inline(never)]
    fn lock_gate(&self, me: u64, claim: bool) -> Hold {
        if self.held_by(me) {
            reentered();
        }
        let mut tries = 0u32;
        while self.gate.swap(true, Ordering::Acquire) {
            while self.gate.load(Ordering::Relaxed) {
                backoff(&mut tries);
            }
        }
        self.gate_holder.store(me as u32, Ordering::Relaxed);
        self.exclude_owner(me, claim, true).unwrap_or(Hold::Gate)
    }

    /// With the gate held: claims an unowned lock for `me` if asked, and keeps a foreign
    /// owner out. `None` if `wait` is false and the owner holds the lock now (`foreign` is
    /// lowered again; the caller still holds the gate).
    fn exclude_owner(&self, me: u64, claim: bool, wait: bool) -> Option<Hold> {
        let owner = self.owner.load(Ordering::Relaxed);
        if owner == UNOWNED && claim && asymmetric() {
            self.owner.store(me, Ordering::Relaxed);
        }
        if owner == UNOWNED || owner == REVOKED || owner == me {
            return Some(Hold::Gate);
        }
        if !broken(Break::ForeignFlag) {
            self.foreign.store(true, Ordering::Relaxed);
        }
        heavy_fence();
        let mut tries = 0u32;
        // Acquire: pairs with the owner's release of `held`, so its hold happens before ours.
        while !broken(Break::WaitForOwner) && self.held.load(Ordering::Acquire) {
            if !wait {
                self.foreign.store(false, Ordering::Release);
                return None;
            }
            backoff(&mut tries);
        }
        Some(Hold::Fenced)
    }

    /// Takes the lock for `me` if nobody holds it, `me` included, without claiming it.
    fn try_lock(&self, me: u64) -> Option<Hold> {
        if self.held_by(me) {
            return None;
        }
        if self.owner.load(Ordering::Relaxed) == me {
            return self.try_owner(me).then_some(Hold::Owner);
        }
        if self.gate.load(Ordering::Relaxed) || self.gate.swap(true, Ordering::Acquire) {
            return None;
        }
        self.gate_holder.store(me as u32, Ordering::Relaxed);
        let hold = self.exclude_owner(me, false, false);
        if hold.is_none() {
            self.gate_holder.store(0, Ordering::Relaxed);
            self.gate.store(false, Ordering::Release);
        }
        hold
    }

    /// Gives back a hold taken as `hold`. Release: what was done under it happens before
    /// the next holder's.
    #[inline]
    fn unlock(&self, hold: Hold) {
        match hold {
            Hold::Owner => self.held.store(false, Ordering::Release),
            Hold::Gate => {
                self.gate_holder.store(0, Ordering::Relaxed);
                self.gate.store(false, Ordering::Release);
            }
            Hold::Fenced => {
                self.foreign.store(false, Ordering::Release);
                self.gate_holder.store(0, Ordering::Relaxed);
                self.gate.store(false, Ordering::Release);
            }
        }
    }

    /// Ends the bias for good; the caller holds the gate (`Gate` or `Fenced`), so no owner
    /// holds, and an owner about to sees the change at its second look.
    fn revoke(&self) {
        self.owner.store(REVOKED, Ordering::Relaxed);
    }

    /// Whether `me` owns the lock now.
    fn owned_by(&self, me: u64) -> bool {
        self.owner.load(Ordering::Relaxed) == me
    }
}

/// A thread took a lock it holds. Refused: a second guard would alias the first's `&mut`,
/// and through the gate the thread would wait for itself.
#[cold]
#[inline(never)]
fn reentered() -> ! {
    panic!("a biased lock was taken again by the thread that holds it");
}
