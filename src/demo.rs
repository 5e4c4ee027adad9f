//! `umdev demo`: the main job a newcomer runs first.
//!
//! It starts a daemon in-process with a ccw instance and connects rust-vmm's
//! `vfio_user::Client` to it as the guest's VMM, mapping a memfd as guest RAM. It then runs
//! channel programs whose data is contiguous, scattered (no two blocks adjacent) and
//! IDAW-mixed (runs of 1-16 blocks in random order), writing to the device and reading back
//! into other buffers on every subchannel at once, and verifies every byte. Exits non-zero on
//! any mismatch.

use crate::output::out;
use std::time::Instant;

use umdev_devices::ccw::program::cmd;
use umdev_mdev::types::InstanceOptions;
use umdev_server::{Daemon, InstanceConfig};
use umdev_testkit::ccw_driver::{idaws, Data, Op};
use umdev_testkit::ccw_guest::{CcwGuest, DATA_BASE, RAM_SIZE, SCRATCH};

use crate::pinbench::{Pattern, Rng};

const BLOCK: u64 = 4096;
/// Each subchannel owns a slice of guest RAM for its buffers.
const SLICE: u64 = (RAM_SIZE - DATA_BASE) / 4;

/// Guest blocks for one buffer of `n` blocks in subchannel `sc`'s slice (`half` picks the
/// out- or in-buffer region), laid out per the pattern (pinbench's layouts, block = page).
fn blocks(pattern: Pattern, rng: &mut Rng, sc: u32, half: u64, n: u64) -> Vec<u64> {
    let base = DATA_BASE + u64::from(sc) * SLICE + half * (SLICE / 2);
    pattern.offsets(n as usize, rng).into_iter().map(|k| base + k * BLOCK).collect()
}

fn data_of(blocks: &[u64], first_offset: u64, count: u32) -> Data {
    if blocks.windows(2).all(|w| w[1] == w[0] + BLOCK) {
        Data::Direct(blocks[0] + first_offset)
    } else {
        Data::Idaws(idaws(blocks, first_offset, count))
    }
}

/// Writes `bytes` into the guest at the pieces `data` describes.
fn scatter(g: &CcwGuest, data: &Data, bytes: &[u8]) -> Result<(), String> {
    match data {
        Data::Direct(addr) => g.put(*addr, bytes),
        Data::Idaws(list) | Data::Idaws2k(list) => {
            let mut at = 0;
            for &a in list {
                let n = ((BLOCK - a % BLOCK) as usize).min(bytes.len() - at);
                g.put(a, &bytes[at..at + n])?;
                at += n;
            }
            Ok(())
        }
    }
}

/// Reads the pieces `data` describes back into one buffer.
fn gather(g: &CcwGuest, data: &Data, len: usize) -> Result<Vec<u8>, String> {
    match data {
        Data::Direct(addr) => g.get(*addr, len),
        Data::Idaws(list) | Data::Idaws2k(list) => {
            let mut out = Vec::with_capacity(len);
            for &a in list {
                let n = ((BLOCK - a % BLOCK) as usize).min(len - out.len());
                out.extend(g.get(a, n)?);
            }
            Ok(out)
        }
    }
}

pub fn run() -> Result<(), String> {
    let dir = crate::cleanup::scratch_dir("demo")?;
    let socket = dir.path().join("ccw.sock");
    let mut options = InstanceOptions::default();
    options.params.insert("subchannels".into(), "4".into());
    options.params.insert("store".into(), "ram:256M".into());
    let device =
        umdev::builtin_registry().find("ccw").and_then(|t| t.create(&options)).map_err(|e| e.to_string())?;
    let daemon = Daemon::new();
    daemon.start(device, InstanceConfig::new("demo", &socket)).map_err(|e| e.to_string())?;
    let result = drive(&daemon, &socket);
    daemon.shutdown();
    result
}

fn drive(daemon: &Daemon, socket: &std::path::Path) -> Result<(), String> {
    let mut g = CcwGuest::connect(socket)?;
    out!(
        "umdev demo: a ccw device served over vfio-user; rust-vmm's vfio_user::Client maps {} MiB of memfd guest RAM",
        RAM_SIZE >> 20
    )?;
    out!(
        "{} subchannels; each program writes a buffer to the device, then reads it back elsewhere\n",
        g.subchannels
    )?;
    out!(
        "{:<11} {:>8} {:>9} {:>9} {:>7} {:>10} {:>14} {:>9}",
        "pattern",
        "programs",
        "MiB",
        "pages",
        "runs",
        "pin calls",
        "per-page calls",
        "GB/s"
    )?;
    let mut rng = Rng::new(2020);
    let started = Instant::now();
    let mut total_bytes = 0u64;
    let mut total_programs = 0u64;
    for pattern in [Pattern::Contiguous, Pattern::Scattered, Pattern::IdawMixed] {
        let name = pattern.name();
        let before = daemon.info("demo").ok_or("instance gone")?.dma;
        let t = Instant::now();
        let mut bytes = 0u64;
        let mut programs = 0u64;
        for round in 0..8u64 {
            // Every subchannel moves one buffer of 16-256 blocks, first block unaligned.
            let mut plans = Vec::new();
            for sc in 0..g.subchannels {
                let n = 16 + rng.below(241);
                let offset = rng.below(BLOCK);
                let count = (n * BLOCK - offset) as u32;
                let out = data_of(&blocks(pattern, &mut rng, sc, 0, n), offset, count);
                let back = data_of(&blocks(pattern, &mut rng, sc, 1, n), offset, count);
                let content: Vec<u8> = (0..count).map(|_| rng.next_u64() as u8).collect();
                scatter(&g, &out, &content)?;
                let pos = (u64::from(sc) * 32 + round * 2) << 20;
                g.put(SCRATCH + 8 * u64::from(sc), &pos.to_le_bytes())?;
                let seek = Op::new(cmd::SEEK, 8, Data::Direct(SCRATCH + 8 * u64::from(sc)));
                g.start(sc, &[seek.clone(), Op::new(cmd::WRITE, count, out)])?;
                plans.push((sc, seek, count, back, content));
            }
            for (sc, ..) in &plans {
                let s = g.wait(*sc)?;
                if !s.ok() {
                    return Err(format!("{name}: WRITE on subchannel {sc} ended {s:?}"));
                }
            }
            for (sc, seek, count, back, _) in &plans {
                g.start(*sc, &[seek.clone(), Op::new(cmd::READ, *count, back.clone())])?;
            }
            for (sc, _, count, back, content) in &plans {
                let s = g.wait(*sc)?;
                if !s.ok() {
                    return Err(format!("{name}: READ on subchannel {sc} ended {s:?}"));
                }
                if gather(&g, back, *count as usize)? != *content {
                    return Err(format!("{name}: subchannel {sc} read back different bytes"));
                }
                bytes += 2 * u64::from(*count);
                programs += 2;
            }
        }
        let secs = t.elapsed().as_secs_f64();
        let after = daemon.info("demo").ok_or("instance gone")?.dma;
        let (pages, runs, calls) =
            (after.pages - before.pages, after.runs - before.runs, after.pin_calls - before.pin_calls);
        out!(
            "{name:<11} {programs:>8} {:>9.1} {pages:>9} {runs:>7} {calls:>10} {pages:>14} {:>9.2}",
            bytes as f64 / f64::from(1 << 20),
            bytes as f64 / secs / 1e9
        )?;
        total_bytes += bytes;
        total_programs += programs;
    }
    let dma = daemon.info("demo").ok_or("instance gone")?.dma;
    out!(
        "\nverified {total_programs} programs, {:.1} MiB, every byte, in {:.2} s",
        total_bytes as f64 / f64::from(1 << 20),
        started.elapsed().as_secs_f64()
    )?;
    out!(
        "pinning engine: {} pin calls pinned {} pages in {} runs (per-page pinning, as Linux type1 does, would make {} calls); pins held now: {}",
        dma.pin_calls, dma.pages, dma.runs, dma.pages, dma.pins_held
    )?;
    out!("(pin calls include the short pins that fetch CCWs and IDAW lists)")?;
    if dma.pins_held != 0 {
        return Err("pins leaked".into());
    }
    Ok(())
}
