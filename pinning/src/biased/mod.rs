//! A lock biased to one thread: its owner takes and gives it back with plain loads and
//! stores, no locked instruction; any other thread pays for both sides, with a
//! `membarrier(2)` that fences every thread of the process. For state that one worker
//! thread takes several times per request and others look at rarely (a device's request
//! lane: only an unmap, a reset or a count looks at it from elsewhere).
//!
//! What it buys: a locked instruction waits for every store before it, so on a worker that
//! has just copied a 4 KiB transfer each one costs the time to drain that copy (measured in
//! docs/benchmarks.md, "What taking every locked instruction off the path buys"). What it costs: a take from another
//! thread is a system call that interrupts every CPU running the process (microseconds).
//! So a lock whose other threads take it often loses its bias: after [`REVOKE_TAKES`]
//! foreign takes within [`REVOKE_WINDOW`] it becomes a plain spin lock for good.
//!
//! A lock has no owner until a thread takes it with [`BiasedLock::lock_claiming`]; plain
//! [`BiasedLock::lock`] never claims. Where `membarrier`'s private expedited command is not
//! available (an old kernel, a seccomp filter) no lock gets an owner, and every lock is a
//! spin lock. The protocol, and why its two sides exclude each other, is I19 in DESIGN.md;
//! its text (`raw.rs`) is shared with the shuttle model in tests/biased_model.rs.

use std::cell::{Cell, UnsafeCell};
use std::marker::PhantomData;
use std::ops::{Deref, DerefMut};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicU8, Ordering};
use std::time::{Duration, Instant};

include!("raw.rs");

/// One side of a store-then-load handshake that runs all the time (a worker publishing its
/// queue head, then looking for a rare request): with [`asymmetric_heavy_fence`] on the
/// other side, between its store and its load, the two are ordered as if both had fenced
/// (Dekker's pattern, as in a biased lock: I19). A compiler fence where the process has
/// private expedited membarriers, a full fence where it has not.
#[inline]
pub fn asymmetric_light_fence() {
    if asymmetric() {
        light_fence();
    } else {
        std::sync::atomic::fence(Ordering::SeqCst);
    }
}

/// The rare side of [`asymmetric_light_fence`]'s handshake: a full fence on every thread of
/// the process where membarriers are available (microseconds), else one here.
pub fn asymmetric_heavy_fence() {
    if asymmetric() {
        heavy_fence();
    } else {
        std::sync::atomic::fence(Ordering::SeqCst);
    }
}

/// Foreign takes within [`REVOKE_WINDOW`] that end a lock's bias.
pub const REVOKE_TAKES: u32 = 64;
/// See [`REVOKE_TAKES`]: more than 1000 foreign takes a second.
pub const REVOKE_WINDOW: Duration = Duration::from_millis(64);

/// The owner's half of the fence pair. Under Miri (which has no `membarrier`) both halves
/// are full fences, the same protocol as a plain Dekker lock.
#[inline(always)]
fn light_fence() {
    if cfg!(miri) {
        std::sync::atomic::fence(Ordering::SeqCst);
    } else {
        std::sync::atomic::compiler_fence(Ordering::SeqCst);
    }
}

/// A full fence on every running thread of the process: each has executed one between the
/// call's start and its return (membarrier(2), MEMBARRIER_CMD_PRIVATE_EXPEDITED).
fn heavy_fence() {
    if cfg!(miri) {
        std::sync::atomic::fence(Ordering::SeqCst);
        return;
    }
    // SAFETY: (local) membarrier takes no pointer; the process registered for the command in
    // `asymmetric`, which said yes before any lock got an owner (the only way here).
    let r = unsafe { libc::syscall(libc::SYS_membarrier, MEMBARRIER_CMD_PRIVATE_EXPEDITED, 0, 0) };
    if r != 0 {
        // An owner may be inside with nothing to order its stores: no way on is sound.
        log::error!("membarrier failed after registering ({}): aborting", std::io::Error::last_os_error());
        std::process::abort();
    }
}

const MEMBARRIER_CMD_PRIVATE_EXPEDITED: libc::c_long = 1 << 3;
const MEMBARRIER_CMD_REGISTER_PRIVATE_EXPEDITED: libc::c_long = 1 << 4;

/// Whether locks may have owners: the process registered for private expedited membarriers
/// (tried once).
fn asymmetric() -> bool {
    if cfg!(miri) {
        return true;
    }
    static STATE: AtomicU8 = AtomicU8::new(0); // 0: not tried, 1: yes, 2: no
    match STATE.load(Ordering::Acquire) {
        1 => true,
        2 => false,
        _ => {
            // SAFETY: (local) as in `heavy_fence`; registering twice is harmless.
            let r = unsafe {
                libc::syscall(libc::SYS_membarrier, MEMBARRIER_CMD_REGISTER_PRIVATE_EXPEDITED, 0, 0)
            };
            if r != 0 {
                log::debug!(
                    "no private expedited membarrier ({}): biased locks stay spin locks",
                    std::io::Error::last_os_error()
                );
            }
            STATE.store(if r == 0 { 1 } else { 2 }, Ordering::Release);
            r == 0
        }
    }
}

/// No step of the protocol is left out here (the model's faults, in tests/biased_model.rs).
#[inline(always)]
fn broken(_: Break) -> bool {
    false
}

/// Spins 64 times, yields 64 times, then naps 20 us between looks (as `SpinLock`'s waiters).
#[cold]
fn backoff(tries: &mut u32) {
    if *tries < 64 {
        std::hint::spin_loop();
    } else if *tries < 128 {
        std::thread::yield_now();
    } else {
        std::thread::sleep(Duration::from_micros(20));
    }
    *tries = tries.saturating_add(1);
}

thread_local! {
    /// This thread's token, 0 until first asked.
    static TOKEN: Cell<u64> = const { Cell::new(0) };
    /// Gives the token back as the thread ends (see [`TokenBack`]).
    static TOKEN_BACK: TokenBack = const { TokenBack };
}

/// Tokens of threads that ended, for threads that start: the last one back goes first.
static FREE_TOKENS: std::sync::Mutex<Vec<u64>> = std::sync::Mutex::new(Vec::new());

/// The pool, whatever a panic left it in (a `Vec`'s push and pop leave it whole).
fn free_tokens() -> std::sync::MutexGuard<'static, Vec<u64>> {
    FREE_TOKENS.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// A number no other live thread of the process has (from 1; never [`UNOWNED`] or
/// [`REVOKED`]): the thread's identity for the protocol, and its shard's
/// (`shard::this_shard`).
#[inline]
pub(crate) fn token() -> u64 {
    TOKEN.with(|t| {
        let mine = t.get();
        if mine != 0 {
            return mine;
        }
        let mine = take_token();
        t.set(mine);
        mine
    })
}

/// A token for a thread that has none: one an ended thread gave back if there is one, and
/// the thread gives it back in turn when it ends; past its end (a lock taken by a
/// thread-local's destructor after [`TokenBack`]'s ran) a new one, never given back.
#[cold]
fn take_token() -> u64 {
    static NEXT: AtomicU64 = AtomicU64::new(1);
    // Registers the thread's TokenBack; fails once the thread's thread-locals are going.
    if TOKEN_BACK.try_with(|_| ()).is_ok() {
        if let Some(token) = free_tokens().pop() {
            return token;
        }
    }
    let token = NEXT.fetch_add(1, Ordering::Relaxed);
    // Tokens fit in 32 bits (`RawBiased::gate_holder`). A new one is taken only while no ended
    // thread's is free, so this means 4 billion threads alive at once, or taking locks in
    // thread-local destructors: no way on keeps tokens distinct.
    if token >= u64::from(u32::MAX) {
        log::error!("more than 2^32 thread tokens: aborting");
        std::process::abort();
    }
    token
}

/// A thread's token goes back to [`FREE_TOKENS`] as the thread ends, so that the next thread
/// to start takes it, and with it the bias of every lock the ended thread owned: a queue
/// worker that a controller reset replaced still finds its shard's lock biased to it, where
/// a new token would find it owned by a thread that is gone, pay the gate and `membarrier`
/// on every take, and soon revoke the bias for good. Sound because no two live threads ever
/// hold one token: this thread's `TOKEN` is cleared before the token goes back, and a take
/// after that gets a new one (`take_token`). The pool's mutex orders the ended thread's last
/// hold (its release of `held`) before the next owner's first (I19).
struct TokenBack;

impl Drop for TokenBack {
    fn drop(&mut self) {
        let mine = TOKEN.with(|t| t.replace(0));
        if mine != 0 {
            free_tokens().push(mine);
        }
    }
}

/// A lock around a `T`, as described in the module documentation.
pub struct BiasedLock<T> {
    raw: RawBiased,
    /// Foreign takes in the current window: under the gate only.
    window: UnsafeCell<Window>,
    value: UnsafeCell<T>,
}

/// Small: a shard's lock and its state share two cache lines.
#[derive(Default)]
struct Window {
    takes: u32,
    /// When the window's first take was, in milliseconds of [`clock_ms`].
    start_ms: u32,
}

/// Milliseconds since the first call in the process (wrapping after 49 days: a window that
/// straddles the wrap looks long, and keeps its bias one window longer).
fn clock_ms() -> u32 {
    static EPOCH: std::sync::OnceLock<Instant> = std::sync::OnceLock::new();
    EPOCH.get_or_init(Instant::now).elapsed().as_millis() as u32
}

// SAFETY: (I19) the value and the window are reached only through a guard, and the protocol
// hands out one guard at a time; the window only through a gate hold.
unsafe impl<T: Send> Sync for BiasedLock<T> {}

impl<T: Default> Default for BiasedLock<T> {
    fn default() -> Self {
        BiasedLock::new(T::default())
    }
}

/// Exclusive access to a [`BiasedLock`]'s value until dropped.
#[must_use = "the lock is given back when the guard drops"]
pub struct BiasedGuard<'a, T> {
    lock: &'a BiasedLock<T>,
    hold: Hold,
    /// Held on the thread that took it: an owner's hold is its thread's.
    _not_send: PhantomData<*mut ()>,
}

impl<T> BiasedLock<T> {
    /// An unlocked, unowned lock around `value`.
    pub fn new(value: T) -> Self {
        BiasedLock {
            raw: RawBiased::new(),
            window: UnsafeCell::new(Window::default()),
            value: UnsafeCell::new(value),
        }
    }

    /// Takes the lock, waiting for its holder if it has one; the owner's take is a few plain
    /// loads and stores.
    #[inline]
    pub fn lock(&self) -> BiasedGuard<'_, T> {
        self.take(false)
    }

    /// As [`BiasedLock::lock`], and an unowned lock becomes this thread's (the worker's call).
    #[inline]
    pub fn lock_claiming(&self) -> BiasedGuard<'_, T> {
        self.take(true)
    }

    #[inline]
    fn take(&self, claim: bool) -> BiasedGuard<'_, T> {
        let hold = self.raw.lock(token(), claim);
        if hold == Hold::Fenced {
            self.count_foreign();
        }
        BiasedGuard { lock: self, hold, _not_send: PhantomData }
    }

    /// Takes the lock if nobody holds it (never claiming it).
    pub fn try_lock(&self) -> Option<BiasedGuard<'_, T>> {
        let hold = self.raw.try_lock(token())?;
        if hold == Hold::Fenced {
            self.count_foreign();
        }
        Some(BiasedGuard { lock: self, hold, _not_send: PhantomData })
    }

    /// Whether the lock is biased to the calling thread now.
    pub fn owned_here(&self) -> bool {
        self.raw.owned_by(token())
    }

    /// Whether the lock has lost its bias for good.
    pub fn revoked(&self) -> bool {
        self.raw.owner.load(Ordering::Relaxed) == REVOKED
    }

    /// Ends the bias now (a lock whose other threads will take it often).
    pub fn revoke(&self) {
        // Through the gate even on the owner's thread: the change must exclude gate holders.
        let hold = self.raw.lock_gate(token(), false);
        self.raw.revoke();
        self.raw.unlock(hold);
    }

    /// The value, through exclusive access to the lock itself.
    pub fn get_mut(&mut self) -> &mut T {
        self.value.get_mut()
    }

    /// A foreign take just fenced: counts it, and revokes the bias if such takes come often.
    fn count_foreign(&self) {
        // SAFETY: (I19) a fenced hold holds the gate, which every access of the window takes.
        let w = unsafe { &mut *self.window.get() };
        let now = clock_ms();
        if w.takes == 0 {
            w.start_ms = now;
        }
        w.takes += 1;
        if w.takes < REVOKE_TAKES {
            return;
        }
        if too_often(w.takes, Duration::from_millis(u64::from(now.wrapping_sub(w.start_ms)))) {
            log::debug!("a biased lock is taken often from other threads: it becomes a spin lock");
            self.raw.revoke();
        }
        *w = Window::default();
    }
}

/// The revocation policy: `takes` foreign takes in `elapsed`.
fn too_often(takes: u32, elapsed: Duration) -> bool {
    takes >= REVOKE_TAKES && elapsed < REVOKE_WINDOW
}

impl<T> std::fmt::Debug for BiasedLock<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BiasedLock").field("revoked", &self.revoked()).finish_non_exhaustive()
    }
}

impl<T> Deref for BiasedGuard<'_, T> {
    type Target = T;
    #[inline]
    fn deref(&self) -> &T {
        // SAFETY: (I19) this guard holds the lock: no other reference to the value exists.
        unsafe { &*self.lock.value.get() }
    }
}

impl<T> DerefMut for BiasedGuard<'_, T> {
    #[inline]
    fn deref_mut(&mut self) -> &mut T {
        // SAFETY: (I19) as in `deref`, and `&mut self` makes this the only borrow of the guard.
        unsafe { &mut *self.lock.value.get() }
    }
}

impl<T> Drop for BiasedGuard<'_, T> {
    #[inline]
    fn drop(&mut self) {
        self.lock.raw.unlock(self.hold);
    }
}

#[cfg(test)]
mod tests;
