//! Pinning threads against a map/unmap thread, for a fixed number of events.
//!
//! Checks what a device author relies on: no pin count is lost or duplicated under
//! concurrency, unmaps complete because devices let go when notified, and no page is
//! written after its mapping was unmapped (the backing memfd is snapshotted at unmap and
//! compared at the end). Nothing is timed: the unmap thread runs `CYCLES` cycles and waits
//! for `PINS_PER_CYCLE` new pins between them, so a busy machine makes the test slower,
//! never red.

use std::fs::File;
use std::os::fd::AsFd;
use std::os::unix::fs::FileExt;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::Duration;

use umdev_pinning::{DmaSpace, DmaSpaceConfig, LockAccount, PinError, PinMode, Prot, PAGE_SIZE};

const P: u64 = PAGE_SIZE;
const MAPPINGS: u64 = 6;
const PAGES_PER_MAPPING: u64 = 32;
const PINNERS: usize = 3;
/// Unmap/map cycles of the protocol thread.
const CYCLES: u64 = 30;
/// Pins the pinners take between two cycles.
const PINS_PER_CYCLE: u64 = 40;

fn memfd(pages: u64) -> File {
    let fd = nix::sys::memfd::memfd_create(c"stress", nix::sys::memfd::MFdFlags::empty()).unwrap();
    let file = File::from(fd);
    file.set_len(pages * P).unwrap();
    file
}

/// A small xorshift, so the test needs no RNG crate and is reproducible per thread.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// A pin kept by the unmap thread: the space to unpin it in, and its pages.
type KeptPin = (DmaSpace, Vec<u64>);

fn stress(mode: PinMode) {
    let account = Arc::new(LockAccount::unlimited());
    let space = DmaSpace::try_new(DmaSpaceConfig {
        mode,
        account: account.clone(),
        // Long enough that only a pinner that never lets go could fail an unmap.
        unmap_timeout: Duration::from_secs(120),
        ..Default::default()
    })
    .unwrap();
    let total_pages = MAPPINGS * PAGES_PER_MAPPING;
    let files: Vec<Mutex<File>> = (0..MAPPINGS).map(|_| Mutex::new(memfd(PAGES_PER_MAPPING))).collect();
    for (i, f) in files.iter().enumerate() {
        let iova = i as u64 * PAGES_PER_MAPPING * P;
        space.map(iova, PAGES_PER_MAPPING * P, f.lock().unwrap().as_fd(), 0, Prot::READ_WRITE).unwrap();
    }

    // The device's side of the unmap protocol: pinners drop pins they keep when told to,
    // and so does this thread for the pin it keeps in the first cycle's mapping.
    let release_kept = Arc::new(AtomicU64::new(0));
    let own_kept: Arc<Mutex<Option<KeptPin>>> = Arc::default();
    {
        let (release_kept, own_kept) = (release_kept.clone(), own_kept.clone());
        space.set_unmap_notifier(Some(Arc::new(move |_iova, _len| {
            release_kept.fetch_add(1, Ordering::SeqCst);
            if let Some((space, pfns)) = own_kept.lock().unwrap().take() {
                space.unpin_pages(&pfns).expect("our kept pin is ours to drop");
            }
        })));
    }

    let stop = Arc::new(AtomicBool::new(false));
    let pins_taken = Arc::new(AtomicU64::new(0));
    let mut pinners = Vec::new();
    for t in 0..PINNERS {
        let (space, stop, pins_taken, release_kept) =
            (space.clone(), stop.clone(), pins_taken.clone(), release_kept.clone());
        pinners.push(thread::spawn(move || {
            let mut rng = Rng(0x9e3779b97f4a7c15 ^ (t as u64 + 1));
            let mut kept: Vec<Vec<u64>> = Vec::new();
            let mut seen_release = 0;
            let mut seq = 0u64;
            while !stop.load(Ordering::Relaxed) {
                // An IDAW-like array: a few short runs anywhere in the space.
                let mut pfns = Vec::new();
                for _ in 0..1 + rng.below(4) {
                    let start = rng.below(total_pages);
                    let len = 1 + rng.below(6);
                    pfns.extend(start..(start + len).min(total_pages));
                }
                match space.pin_pages(&pfns, Prot::READ_WRITE) {
                    Ok(pins) => {
                        pins_taken.fetch_add(1, Ordering::Relaxed);
                        seq += 1;
                        // Write a tag into every page and read it back through the pins.
                        let tag = (t as u64) << 56 | seq;
                        for i in 0..pins.len() as u64 {
                            pins.write(i * P + 8 * t as u64, &tag.to_le_bytes()).unwrap();
                        }
                        for i in 0..pins.len() as u64 {
                            let mut b = [0u8; 8];
                            pins.read(i * P + 8 * t as u64, &mut b).unwrap();
                            assert_eq!(u64::from_le_bytes(b), tag);
                        }
                        if rng.below(8) == 0 {
                            pins.forget();
                            kept.push(pfns);
                        }
                    }
                    Err(PinError::NotMapped { .. } | PinError::Unmapping { .. }) => {}
                    Err(e) => panic!("unexpected pin error: {e}"),
                }
                // Kept pins go back when the device is told of an unmap, or when too many.
                let release = release_kept.load(Ordering::SeqCst);
                if release != seen_release || kept.len() > 4 {
                    seen_release = release;
                    for pfns in kept.drain(..) {
                        space.unpin_pages(&pfns).expect("kept pins are ours to drop");
                    }
                }
            }
            for pfns in kept.drain(..) {
                space.unpin_pages(&pfns).unwrap();
            }
        }));
    }

    // The protocol thread: unmap a mapping, snapshot its memory, map a fresh memfd there.
    let mut rng = Rng(42);
    let mut retired: Vec<(File, Vec<u8>)> = Vec::new();
    let mut cycles = 0;
    while cycles < CYCLES {
        // Let the pinners take their share of pins first (counted, not timed).
        let target = (cycles + 1) * PINS_PER_CYCLE;
        while pins_taken.load(Ordering::Relaxed) < target {
            thread::yield_now();
        }
        let i = rng.below(MAPPINGS);
        let iova = i * PAGES_PER_MAPPING * P;
        if cycles == 0 {
            // A pin kept in the mapping about to go: this unmap must wait for it.
            let pfns = vec![iova / P + 1];
            space.pin_pages(&pfns, Prot::READ).expect("a mapped page").forget();
            pins_taken.fetch_add(1, Ordering::Relaxed);
            *own_kept.lock().unwrap() = Some((space.clone(), pfns));
        }
        space.unmap(iova, PAGES_PER_MAPPING * P).expect("pinners let go when notified");
        let old = std::mem::replace(&mut *files[i as usize].lock().unwrap(), memfd(PAGES_PER_MAPPING));
        let mut snapshot = vec![0u8; (PAGES_PER_MAPPING * P) as usize];
        old.read_exact_at(&mut snapshot, 0).unwrap();
        retired.push((old, snapshot));
        space
            .map(iova, PAGES_PER_MAPPING * P, files[i as usize].lock().unwrap().as_fd(), 0, Prot::READ_WRITE)
            .unwrap();
        cycles += 1;
    }
    stop.store(true, Ordering::Relaxed);
    for p in pinners {
        p.join().expect("pinner panicked");
    }

    // Nothing was written to a mapping's memory after its unmap returned.
    for (file, snapshot) in &retired {
        let mut now = vec![0u8; snapshot.len()];
        file.read_exact_at(&mut now, 0).unwrap();
        assert!(now == *snapshot, "memory written after unmap");
    }
    // No count lost or left over.
    for pfn in 0..total_pages {
        assert_eq!(space.pin_count(pfn * P), 0, "page {pfn} still pinned");
    }
    let stats = space.stats();
    assert_eq!(stats.pins_held, 0);
    assert_eq!(stats.pin_calls, pins_taken.load(Ordering::Relaxed));
    assert_eq!(account.locked(), 0);
    assert!(pins_taken.load(Ordering::Relaxed) >= CYCLES * PINS_PER_CYCLE);
    assert!(stats.unmap_waits > 0, "no unmap ever met a pin: the test proves nothing");
    // Kernel mode: a registration per call, and none left.
    if mode == PinMode::Kernel {
        assert_eq!(stats.kernel_pin_calls, stats.pin_calls);
        assert_eq!((stats.kernel_buffers_held, stats.kernel_pages_held), (0, 0));
    }
    space.set_unmap_notifier(None);
    space.unmap_all().unwrap();
}

#[test]
fn concurrent_pins_and_unmaps_track_mode() {
    stress(PinMode::Track);
}

#[test]
fn concurrent_pins_and_unmaps_lock_mode() {
    stress(PinMode::Lock);
}

#[test]
fn concurrent_pins_and_unmaps_kernel_mode() {
    stress(PinMode::Kernel);
}
