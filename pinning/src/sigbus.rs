//! Surviving a client that truncates the file behind its guest memory.
//!
//! Touching a page of a `MAP_SHARED` file mapping that lies past the file's end raises
//! SIGBUS. A client can shrink its memfd after DMA_MAP (unless it sealed it against
//! shrinking, as QEMU's memfd backend does), and the next device access would kill the whole
//! server, every other client's device with it. So every guest mapping is registered here,
//! and a SIGBUS handler catches faults inside one: it replaces that mapping's whole range
//! with anonymous zero pages (one `MAP_FIXED` mmap, so a client cannot split VMAs fault by
//! fault), marks the mapping poisoned, and lets the faulting access retry. Reads then see
//! zeros and writes go nowhere; the engine refuses new pins on the mapping and the copy
//! helpers of [`crate::PinnedPages`] report the access failed. Faults anywhere else go to
//! the handler that was there before (Rust's stack-overflow guard) or kill the process as
//! they always did.
//!
//! The handler takes the registry's read lock, and only for the kernel's own fault on an
//! access (`BUS_ADRERR`). That is sound because such a SIGBUS is synchronous: the faulting
//! thread is in the middle of a guest-memory copy, never inside this module holding the lock;
//! another thread holding it finishes without waiting on the faulting one. A SIGBUS sent by a
//! process is not looked up (it names no address) and goes where it would without us.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock, RwLock};

use nix::sys::signal::{sigaction, SaFlags, SigAction, SigHandler, SigSet, Signal};

use crate::page::Prot;

/// A registered guest mapping.
struct Guarded {
    len: usize,
    prot: libc::c_int,
    poisoned: Arc<AtomicBool>,
}

static GUARDED: RwLock<BTreeMap<usize, Guarded>> = RwLock::new(BTreeMap::new());
/// The SIGBUS disposition before ours, for faults that are not ours.
static PREVIOUS: OnceLock<SigHandler> = OnceLock::new();
static RECOVERED: AtomicU64 = AtomicU64::new(0);
/// Raised, for good, before the first guest mapping of the process is poisoned: until then a
/// check after a copy need not walk to each mapping's own flag.
static EVER_POISONED: AtomicBool = AtomicBool::new(false);

/// False while no guest mapping of this process has ever been poisoned (see `recover`:
/// raised before the zero pages go in, so a copy that read them finds it raised).
#[inline]
pub(crate) fn ever_poisoned() -> bool {
    EVER_POISONED.load(Ordering::Acquire)
}

/// Faults in guest memory survived since the process started.
pub fn recovered_faults() -> u64 {
    RECOVERED.load(Ordering::Relaxed)
}

/// Registers `[start, start + len)` as guest memory; returns its poisoned flag.
pub(crate) fn register(start: usize, len: usize, prot: Prot) -> Arc<AtomicBool> {
    install();
    let poisoned = Arc::new(AtomicBool::new(false));
    let guarded = Guarded { len, prot: prot.mmap_flags().bits(), poisoned: poisoned.clone() };
    crate::sync::write(&GUARDED).insert(start, guarded);
    poisoned
}

/// Forgets the mapping at `start`; called before it is unmapped.
pub(crate) fn unregister(start: usize) {
    crate::sync::write(&GUARDED).remove(&start);
}

fn install() {
    // Miri cannot install signal handlers; its unit tests truncate no file.
    if cfg!(miri) {
        return;
    }
    PREVIOUS.get_or_init(|| {
        // SAFETY: (I14) the handler changes only registered guest mappings, in place (see the
        // module docs for why its lock is sound), and chains to the old handler otherwise.
        match unsafe { sigaction(Signal::SIGBUS, &ours()) } {
            Ok(old) => old.handler(),
            Err(e) => {
                log::error!("cannot install the SIGBUS handler ({e}): a client truncating its memory can crash the server");
                SigHandler::SigDfl
            }
        }
    });
}

/// The engine's disposition: on the alternate stack if the thread has one; no SA_RESETHAND,
/// it stays.
fn ours() -> SigAction {
    SigAction::new(
        SigHandler::SigAction(on_sigbus),
        SaFlags::SA_SIGINFO | SaFlags::SA_ONSTACK,
        SigSet::empty(),
    )
}

extern "C" fn on_sigbus(signal: libc::c_int, info: *mut libc::siginfo_t, context: *mut libc::c_void) {
    // SAFETY: (local) the kernel passes a valid siginfo to an SA_SIGINFO handler.
    let (code, addr) = unsafe { ((*info).si_code, (*info).si_addr() as usize) };
    // Only the kernel's fault on an access past a file's end is recovered. A SIGBUS another
    // process (or this one) sent carries no fault address (its `si_addr` bytes are a pid and
    // a uid), and may come while this thread holds the registry's lock.
    if code == libc::BUS_ADRERR && recover(addr) {
        return; // the access retries against zero pages
    }
    let sent = code <= 0;
    match PREVIOUS.get() {
        Some(SigHandler::SigAction(previous)) => previous(signal, info, context),
        Some(SigHandler::Handler(previous)) => previous(signal),
        Some(SigHandler::SigIgn) if sent => return,
        _ => {
            // Default disposition: restore it. A fault returns and faults again; a sent
            // signal is sent again, pending until this handler returns. Either way the
            // process dies of SIGBUS as it would have without us.
            let default = SigAction::new(SigHandler::SigDfl, SaFlags::empty(), SigSet::empty());
            // SAFETY: (local) restoring the default disposition is always sound.
            let _ = unsafe { sigaction(Signal::SIGBUS, &default) };
            if sent {
                // SAFETY: (local) raise(3) is async-signal-safe and takes no pointer.
                unsafe { libc::raise(libc::SIGBUS) };
            }
            return;
        }
    }
    if sent {
        // The previous handler let a sent signal be. Rust's stack-overflow guard does so
        // after restoring the default disposition (it expects a fault, which comes again):
        // the engine's handler goes back in, or the next truncation would kill the process.
        // (Not after a fault: it must come again to the disposition the previous handler
        // chose.)
        // SAFETY: (I14) as at installation; sigaction(2) is async-signal-safe.
        let _ = unsafe { sigaction(Signal::SIGBUS, &ours()) };
    }
}

/// Replaces the guest mapping holding `addr` with zero pages; false if none holds it.
fn recover(addr: usize) -> bool {
    let guarded = crate::sync::read(&GUARDED);
    let Some((&start, g)) = guarded.range(..=addr).next_back() else { return false };
    if addr - start >= g.len {
        return false;
    }
    // Marked before the zero pages go in: another thread whose copy raced this fault and
    // read the zeros finds the mark when it checks after its copy. (If the mmap fails the
    // mark stays on memory that did not change; the process dies of this SIGBUS anyway.)
    EVER_POISONED.store(true, Ordering::Release);
    g.poisoned.store(true, Ordering::Release);
    let flags = libc::MAP_FIXED | libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE;
    // SAFETY: (I13, I14) [start, start + len) is a live guest mapping the engine owns (registered until
    // just before its munmap); replacing it in place keeps the range valid for everyone
    // holding its addresses, who now see zeros instead of faulting.
    let replaced = unsafe { libc::mmap(start as *mut libc::c_void, g.len, g.prot, flags, -1, 0) };
    if replaced == libc::MAP_FAILED {
        return false;
    }
    RECOVERED.fetch_add(1, Ordering::Relaxed);
    true
}

#[cfg(test)]
mod tests {
    use std::os::fd::AsFd;

    use crate::testutil::memfd;
    use crate::{AccessError, DmaSpace, DmaSpaceConfig, PinError, PinMode, Prot, PAGE_SIZE};

    fn truncated_under_pins(mode: PinMode) {
        let space = DmaSpace::try_new(DmaSpaceConfig { mode, ..Default::default() }).unwrap();
        let file = memfd(4);
        space.map(0, 4 * PAGE_SIZE, file.as_fd(), 0, Prot::READ_WRITE).unwrap();
        let pins = space.pin_range(0, 4, Prot::READ_WRITE).unwrap();
        pins.write(0, &[7; 64]).unwrap();
        let before = super::recovered_faults();

        // The client shrinks its memfd while the pages are pinned.
        file.set_len(PAGE_SIZE).unwrap();
        let mut buf = [0xffu8; 64];
        assert_eq!(pins.read(2 * PAGE_SIZE, &mut buf), Err(AccessError::Poisoned));
        assert_eq!(buf, [0; 64], "the read saw zero pages");
        assert_eq!(pins.write(0, &[1; 8]), Err(AccessError::Poisoned));
        assert!(pins.poisoned());
        assert!(super::recovered_faults() > before);
        assert_eq!(space.stats().poisoned_mappings, 1);
        // No new pins; the old ones still unpin, and the mapping unmaps.
        assert!(matches!(space.pin_range(0, 1, Prot::READ), Err(PinError::Poisoned { index: 0, pfn: 0 })));
        drop(pins);
        assert_eq!(space.stats().kernel_pages_held, 0);
        space.unmap(0, 4 * PAGE_SIZE).unwrap();

        // A new mapping of the same fd works as usual.
        file.set_len(4 * PAGE_SIZE).unwrap();
        space.map(0, 4 * PAGE_SIZE, file.as_fd(), 0, Prot::READ_WRITE).unwrap();
        let pins = space.pin_range(0, 4, Prot::READ_WRITE).unwrap();
        pins.write(3 * PAGE_SIZE, &[9; 8]).unwrap();
        assert!(!pins.poisoned());
        assert_eq!(space.stats().poisoned_mappings, 0);
    }

    #[test]
    #[cfg_attr(miri, ignore = "Miri: no SIGBUS")]
    fn a_file_truncated_under_pins_poisons_its_mapping_instead_of_killing_the_process() {
        truncated_under_pins(PinMode::Track);
    }

    #[test]
    #[cfg_attr(miri, ignore = "Miri: no SIGBUS")]
    fn locked_pages_truncated_under_pins_poison_too() {
        truncated_under_pins(PinMode::Lock);
    }

    /// The kernel keeps its pins of the truncated pages (it holds them, the file no longer
    /// does) until the guard drops; the mapping poisons as in the other modes.
    #[test]
    #[cfg_attr(miri, ignore = "Miri: no SIGBUS, no io_uring")]
    fn kernel_pinned_pages_truncated_under_pins_poison_too() {
        truncated_under_pins(PinMode::Kernel);
    }
}
