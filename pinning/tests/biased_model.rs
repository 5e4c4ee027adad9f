//! A shuttle model of the biased lock's protocol (I19 in DESIGN.md): the text of
//! `src/biased/raw.rs` itself, compiled against shuttle's atomics, taken by an owner, by
//! other threads, and by one that revokes the bias, under every schedule shuttle tries.
//!
//! Shuttle runs atomics sequentially consistently. That is what the fence pair gives the two
//! sides in the engine (the owner's compiler fence and the other side's `membarrier`, which
//! fences every running thread), so the fences are no-ops here and the model checks the
//! protocol's logic: the owner's second look, the `foreign` flag, the wait for `held`, the
//! claim and the revocation under the gate. Each `#[should_panic]` test leaves one step out
//! ([`Break`]) and the model must see two holders at once.

use shuttle::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use shuttle::sync::Arc;
use shuttle::thread;

include!("../src/biased/raw.rs");

thread_local! {
    static FAULT: std::cell::Cell<Option<Break>> = const { std::cell::Cell::new(None) };
}

fn broken(b: Break) -> bool {
    FAULT.with(|f| f.get()) == Some(b)
}

fn light_fence() {}

fn heavy_fence() {}

fn asymmetric() -> bool {
    true
}

fn backoff(_: &mut u32) {
    thread::yield_now();
}

/// The lock and what it guards: a count bumped by a load, a yield and a store (two holders
/// at once lose a bump), and a flag each holder asserts it alone has raised.
struct Model {
    raw: RawBiased,
    inside: AtomicBool,
    count: AtomicUsize,
}

impl Model {
    fn critical(&self, who: &str) {
        assert!(!self.inside.swap(true, Ordering::SeqCst), "{who} went in while another holder was inside");
        let seen = self.count.load(Ordering::SeqCst);
        thread::yield_now();
        self.count.store(seen + 1, Ordering::SeqCst);
        self.inside.store(false, Ordering::SeqCst);
    }

    fn take(&self, me: u64, claim: bool, who: &str) {
        let hold = self.raw.lock(me, claim);
        self.critical(who);
        self.raw.unlock(hold);
    }
}

const OWNER: u64 = 1;
const ROUNDS: usize = 3;

/// The owner claims the lock, then takes it; one thread takes it from outside, one tries
/// to and then revokes the bias; a last one takes it after (or during) the revocation.
fn model(fault: Option<Break>) {
    let m =
        Arc::new(Model { raw: RawBiased::new(), inside: AtomicBool::new(false), count: AtomicUsize::new(0) });
    FAULT.with(|f| f.set(fault));
    m.take(OWNER, true, "the claiming owner");
    assert!(m.raw.owned_by(OWNER));
    let spawn = |me: u64, body: fn(&Model, u64)| {
        let m = m.clone();
        thread::spawn(move || {
            FAULT.with(|f| f.set(fault));
            body(&m, me)
        })
    };
    let threads = [
        spawn(OWNER, |m, me| (0..ROUNDS).for_each(|_| m.take(me, true, "the owner"))),
        spawn(2, |m, me| (0..ROUNDS).for_each(|_| m.take(me, true, "a foreign taker"))),
        spawn(3, |m, me| {
            if let Some(hold) = m.raw.try_lock(me) {
                m.critical("a foreign try");
                m.raw.unlock(hold);
            }
            let hold = m.raw.lock_gate(me, false);
            m.raw.revoke();
            m.critical("the revoker");
            m.raw.unlock(hold);
        }),
        spawn(4, |m, me| (0..2).for_each(|_| m.take(me, false, "a taker after the revocation"))),
    ];
    for t in threads {
        t.join().expect("no panic");
    }
    // Every take bumped the count once; the try may have found the lock held.
    let takes = 1 + 2 * ROUNDS + 1 + 2;
    let counted = m.count.load(Ordering::SeqCst);
    assert!(counted == takes || counted == takes + 1, "lost a bump: {counted} after {takes} takes");
    assert_eq!(m.raw.owner.load(Ordering::SeqCst), REVOKED);
    assert!(
        !m.raw.held.load(Ordering::SeqCst)
            && !m.raw.foreign.load(Ordering::SeqCst)
            && !m.raw.gate.load(Ordering::SeqCst)
    );
}

const RANDOM: usize = 3000;
const PCT: usize = 3000;
const SEED: u64 = 0x5eed_b1a5;

fn check(fault: Option<Break>) {
    if fault.is_none() {
        shuttle::check_random(move || model(fault), RANDOM);
        shuttle::check_pct(move || model(fault), PCT, 3);
        shuttle::check_dfs(move || model(fault), Some(20_000));
    }
    shuttle::check_random_with_seed(move || model(fault), SEED, RANDOM);
    let pct = shuttle::scheduler::PctScheduler::new_from_seed(SEED, 3, PCT);
    shuttle::Runner::new(pct, Default::default()).run(move || model(fault));
}

#[test]
fn the_protocol_holds_under_every_schedule_tried() {
    check(None);
}

#[test]
#[should_panic(expected = "while another holder was inside")]
fn an_owner_that_does_not_look_again_after_its_fence_is_caught() {
    check(Some(Break::Recheck));
}

#[test]
#[should_panic(expected = "while another holder was inside")]
fn a_gate_holder_that_raises_no_flag_is_caught() {
    check(Some(Break::ForeignFlag));
}

#[test]
#[should_panic(expected = "while another holder was inside")]
fn a_gate_holder_that_does_not_wait_for_the_owner_is_caught() {
    check(Some(Break::WaitForOwner));
}
