//! `umdev demo`: the main job a newcomer runs first.
//!
//! Today it shows the pinning engine on its own: guest RAM in a memfd, IDAW-style page
//! arrays pinned one call per contiguous run, every byte written through the pins and
//! checked in the memfd. (The full vfio-user + ccw device demo replaces this once the
//! server and the ccw device exist.)

use std::fs::File;
use std::os::fd::AsFd;
use std::os::unix::fs::FileExt;
use std::time::Instant;

use nix::sys::memfd::{memfd_create, MFdFlags};
use umdev_pinning::{DmaSpace, Prot, PAGE_SIZE};

use crate::pinbench::Rng;

const RAM: u64 = 64 << 20;
const RAM_IOVA: u64 = 0x1_0000_0000;

/// Builds one program's array of page numbers (offsets into guest RAM).
type PageArrayMaker = Box<dyn Fn(&mut Rng) -> Vec<u64>>;

pub fn run() -> Result<(), String> {
    let ram = File::from(memfd_create(c"umdev-demo-ram", MFdFlags::empty()).map_err(|e| e.to_string())?);
    ram.set_len(RAM).map_err(|e| e.to_string())?;
    let space = DmaSpace::default();
    space.map(RAM_IOVA, RAM, ram.as_fd(), 0, Prot::READ_WRITE).map_err(|e| e.to_string())?;
    println!("guest RAM: {} MiB memfd mapped at IOVA {RAM_IOVA:#x}", RAM >> 20);

    let mut rng = Rng::new(7);
    let base = RAM_IOVA / PAGE_SIZE;
    const RAM_PAGES: u64 = RAM / PAGE_SIZE;
    let workloads: [(&str, PageArrayMaker); 3] = [
        (
            "contiguous 512-page buffers",
            Box::new(|r: &mut Rng| {
                let start = r.below(RAM_PAGES - 512);
                (start..start + 512).collect()
            }),
        ),
        (
            "scattered 4K blocks (no two adjacent)",
            Box::new(|r: &mut Rng| {
                let start = r.below(RAM_PAGES - 1024);
                let mut v: Vec<u64> = (0..256).map(|k| start + 2 * k).collect();
                r.shuffle(&mut v);
                v
            }),
        ),
        (
            "IDAW-mixed lists (runs of 1-16 blocks)",
            Box::new(|r: &mut Rng| {
                let mut v = Vec::new();
                while v.len() < 256 {
                    let start = r.below(RAM_PAGES - 16);
                    v.extend(start..start + 1 + r.below(16));
                }
                v
            }),
        ),
    ];
    let started = Instant::now();
    let mut total_bytes = 0u64;
    for (name, make) in &workloads {
        let before = space.stats();
        let mut pages = 0u64;
        for program in 0..64u64 {
            let pfns: Vec<u64> = make(&mut rng).into_iter().map(|p| base + p).collect();
            let pins = space.pin_pages(&pfns, Prot::READ_WRITE).map_err(|e| e.to_string())?;
            // Fill the scattered buffer, then check every page landed where its IOVA says.
            let data: Vec<u8> = (0..pins.size()).map(|i| (i ^ program) as u8).collect();
            pins.write(0, &data).map_err(|e| e.to_string())?;
            let mut page = vec![0u8; PAGE_SIZE as usize];
            for (i, &pfn) in pfns.iter().enumerate() {
                ram.read_exact_at(&mut page, (pfn - base) * PAGE_SIZE).map_err(|e| e.to_string())?;
                let want = &data[i * PAGE_SIZE as usize..(i + 1) * PAGE_SIZE as usize];
                // A page repeated in the array holds the data of its last occurrence.
                if pfns[i + 1..].contains(&pfn) {
                    continue;
                }
                if page != want {
                    return Err(format!(
                        "{name}: page {i} (IOVA {:#x}) holds the wrong bytes",
                        pfn * PAGE_SIZE
                    ));
                }
            }
            pages += pfns.len() as u64;
            total_bytes += pins.size();
        }
        let after = space.stats();
        let (calls, runs) = (after.pin_calls - before.pin_calls, after.runs - before.runs);
        println!(
            "{name:<40} {calls:>3} pin calls, {pages:>6} pages in {runs:>5} runs \
             ({:.1} pages/run; per-page pinning would make {pages} calls)",
            pages as f64 / runs as f64
        );
    }
    let stats = space.stats();
    let secs = started.elapsed().as_secs_f64();
    println!(
        "verified {} MiB written through pins in {:.3} s ({:.2} GB/s incl. verification); pins held now: {}",
        total_bytes >> 20,
        secs,
        total_bytes as f64 / secs / 1e9,
        stats.pins_held
    );
    if stats.pins_held != 0 {
        return Err("pins leaked".into());
    }
    println!("(the ccw device demo over vfio-user arrives with the server and device issues)");
    Ok(())
}
