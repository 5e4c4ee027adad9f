//! The engine's hot path in a tight loop: pin+drop of a K-entry array (entries two pages
//! apart, or `stride` apart: 1 makes it one run) against `translate_pages` of the same
//! array, alternating, medians of 21 rounds; track mode, or lock mode as a fourth argument.
//! Small enough to run under `valgrind --tool=callgrind` for instruction counts.
//!
//! ```sh
//! cargo run --release -p umdev-pinning --example hotpath            # 1 page
//! cargo run --release -p umdev-pinning --example hotpath -- 8 200000 # 8 entries, calls per round
//! cargo run --release -p umdev-pinning --example hotpath -- 512 20000 1 # one 512-page run
//! cargo run --release -p umdev-pinning --example hotpath -- 1 20000 2 lock # lock mode (mlock)
//! ```

use std::hint::black_box;
use std::os::fd::AsFd;
use std::time::Instant;

use umdev_pinning::{DmaSpace, DmaSpaceConfig, PinMode, Prot, PAGE_SIZE};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let entries: u64 = args.next().map_or(Ok(1), |a| a.parse())?;
    let calls: u64 = args.next().map_or(Ok(2_000_000 / entries.max(1)), |a| a.parse())?;
    let stride: u64 = args.next().map_or(Ok(2), |a| a.parse())?;
    let mode: PinMode = args.next().map_or(Ok(PinMode::Track), |a| a.parse())?;
    let pages = 64 + stride * entries;
    let memfd = nix::sys::memfd::memfd_create(c"hotpath", nix::sys::memfd::MFdFlags::empty())?;
    let file = std::fs::File::from(memfd);
    file.set_len(pages * PAGE_SIZE)?;
    let space = DmaSpace::new(DmaSpaceConfig { mode, ..DmaSpaceConfig::default() });
    space.map(0, pages * PAGE_SIZE, file.as_fd(), 0, Prot::READ_WRITE)?;
    // 32 arrays at different offsets, so that no call is the same as the last.
    let arrays: Vec<Vec<u64>> = (0..32).map(|o| (0..entries).map(|k| o + stride * k).collect()).collect();

    let time = |pin: bool| -> Result<f64, Box<dyn std::error::Error>> {
        let start = Instant::now();
        for i in 0..calls {
            let pfns = black_box(&arrays[(i % 32) as usize][..]);
            if pin {
                drop(black_box(space.pin_pages(pfns, Prot::READ)?));
            } else {
                let mut last = 0usize;
                space.translate_pages(pfns, Prot::READ, |_, host, _| last = host)?;
                black_box(last);
            }
        }
        Ok(start.elapsed().as_nanos() as f64 / calls as f64)
    };
    let mut rounds = Vec::new();
    for _ in 0..21 {
        let translate = time(false)?;
        let pin = time(true)?;
        rounds.push((pin / translate, translate, pin));
    }
    let median = |f: fn(&(f64, f64, f64)) -> f64| {
        let mut v: Vec<f64> = rounds.iter().map(f).collect();
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    println!(
        "{entries} entries {stride} apart: pin+drop {:.1} ns, translate {:.1} ns, ratio {:.2} (medians of 21 rounds)",
        median(|r| r.2),
        median(|r| r.1),
        median(|r| r.0)
    );
    Ok(())
}
