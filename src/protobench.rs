//! `umdev protobench`: the server's protocol costs against their floors, measured in one run.
//!
//! 1. A 4-byte REGION_READ round trip against a bare UNIX-socket ping-pong of the same message
//!    sizes (32-byte request, 36-byte reply), with client and server on one CPU and on two
//!    (and on two with the opt-in busy-poll). Blocks alternate; p50 and p99 are reported.
//! 2. DMA_MAP + DMA_UNMAP over the socket of a sparse 1 GiB and a sparse 64 GiB memfd.
//! 3. 64 instances with a client each: a probe's REGION_READ latency across instances 1-63,
//!    without and with a client flooding instance 0 with posted writes (the flood and its
//!    instance on one CPU, the probe and the others on the other).

use crate::output::out;
use std::io::{Read, Write};
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde::Serialize;
use umdev_mdev::types::InstanceOptions;
use umdev_server::wire::{flags, Command};
use umdev_server::{Daemon, InstanceConfig};
use umdev_testkit::client::{
    dma_map_payload, dma_unmap_payload, le32, le64, message, region_write_payload, RawClient,
};

use crate::affinity::{pin_to, unpin};

fn percentile(sorted: &[f64], p: f64) -> f64 {
    sorted[((sorted.len() - 1) as f64 * p).round() as usize]
}

/// Latencies in microseconds: (p50, p99).
fn summarize(mut v: Vec<f64>) -> (f64, f64) {
    v.sort_by(|a, b| a.total_cmp(b));
    (percentile(&v, 0.5), percentile(&v, 0.99))
}

/// A testdev instance in its own daemon, its threads on `server_cpu`.
fn start_testdev(
    dir: &Path,
    name: &str,
    server_cpu: usize,
    busy_poll: Duration,
) -> Result<(Daemon, std::path::PathBuf), String> {
    pin_to(server_cpu)?;
    let device = umdev::builtin_registry()
        .find("testdev")
        .and_then(|t| t.create(&InstanceOptions::default()))
        .map_err(|e| e.to_string())?;
    let socket = dir.join(format!("{name}.sock"));
    let mut config = InstanceConfig::new(name, &socket);
    config.busy_poll = busy_poll;
    let daemon = Daemon::new();
    let started = daemon.start(device, config).map_err(|e| e.to_string());
    unpin()?;
    started.map(|()| (daemon, socket))
}

fn region_read_request(id: u16) -> Vec<u8> {
    // BAR0 offset 0: the ID register.
    let payload = [&le64(0)[..], &le32(0), &le32(4)].concat();
    message(id, Command::RegionRead as u16, flags::TYPE_COMMAND, &payload)
}

/// `n` round trips of `request` answered by `reply.len()` bytes; microseconds each.
fn round_trips(
    stream: &mut UnixStream,
    request: &[u8],
    reply: &mut [u8],
    n: usize,
) -> Result<Vec<f64>, String> {
    let mut out = Vec::with_capacity(n);
    for _ in 0..n {
        let t = Instant::now();
        stream.write_all(request).map_err(|e| e.to_string())?;
        stream.read_exact(reply).map_err(|e| e.to_string())?;
        out.push(t.elapsed().as_nanos() as f64 / 1000.0);
    }
    Ok(out)
}

/// `n` 4-byte REGION_READ round trips of testdev's ID register; microseconds each.
fn region_reads(stream: &mut UnixStream, n: usize) -> Result<Vec<f64>, String> {
    let mut reply = [0u8; 36];
    let out = round_trips(stream, &region_read_request(1), &mut reply, n)?;
    if u32::from_le_bytes([reply[32], reply[33], reply[34], reply[35]]) != 0x7564_6576 {
        return Err("REGION_READ returned the wrong value".into());
    }
    Ok(out)
}

/// The floor: a bare ping-pong of the same sizes, its server thread on `server_cpu`.
fn floor_pair(server_cpu: usize) -> Result<(UnixStream, std::thread::JoinHandle<()>), String> {
    let (client, mut server) = UnixStream::pair().map_err(|e| e.to_string())?;
    let thread = std::thread::spawn(move || {
        let _ = pin_to(server_cpu);
        let mut req = [0u8; 32];
        let reply = [7u8; 36];
        while server.read_exact(&mut req).is_ok() {
            if server.write_all(&reply).is_err() {
                break;
            }
        }
    });
    Ok((client, thread))
}

/// `n` round trips of the floor's messages, the sizes of a 4-byte REGION_READ.
fn floor_round_trips(stream: &mut UnixStream, n: usize) -> Result<Vec<f64>, String> {
    round_trips(stream, &[0u8; 32], &mut [0u8; 36], n)
}

/// One latency row.
#[derive(Debug, Serialize)]
pub struct LatencyRow {
    pub placement: String,
    pub floor_p50_us: f64,
    pub floor_p99_us: f64,
    pub umdev_p50_us: f64,
    pub umdev_p99_us: f64,
    pub ratio_p50: f64,
}

fn latency(
    dir: &Path,
    cpus: (usize, usize),
    busy_poll: Duration,
    blocks: usize,
    per_block: usize,
) -> Result<LatencyRow, String> {
    let (client_cpu, server_cpu) = cpus;
    let name = format!("lat-{client_cpu}-{server_cpu}-{}", busy_poll.as_micros());
    let (daemon, socket) = start_testdev(dir, &name, server_cpu, busy_poll)?;
    let (mut floor, floor_thread) = floor_pair(server_cpu)?;
    pin_to(client_cpu)?;
    let mut client = RawClient::connect(&socket).map_err(|e| e.to_string())?;
    client.negotiate().map_err(|e| e.to_string())?;
    let mut stream = client.stream.try_clone().map_err(|e| e.to_string())?;
    // Warm up both paths, then alternate blocks.
    floor_round_trips(&mut floor, per_block)?;
    region_reads(&mut stream, per_block)?;
    let (mut f, mut u) = (Vec::new(), Vec::new());
    for _ in 0..blocks {
        f.extend(floor_round_trips(&mut floor, per_block)?);
        u.extend(region_reads(&mut stream, per_block)?);
    }
    unpin()?;
    drop(floor);
    let _ = floor_thread.join();
    drop((client, stream));
    daemon.shutdown();
    let ((f50, f99), (u50, u99)) = (summarize(f), summarize(u));
    let placement = match (client_cpu == server_cpu, busy_poll.is_zero()) {
        (true, _) => "one CPU".to_string(),
        (false, true) => "two CPUs".to_string(),
        (false, false) => format!("two CPUs, busy-poll {} us", busy_poll.as_micros()),
    };
    Ok(LatencyRow {
        placement,
        floor_p50_us: f50,
        floor_p99_us: f99,
        umdev_p50_us: u50,
        umdev_p99_us: u99,
        ratio_p50: u50 / f50,
    })
}

/// DMA_MAP and DMA_UNMAP cost by size, in one placement.
#[derive(Debug, Serialize)]
pub struct MapRow {
    pub placement: String,
    pub size_gib: u64,
    /// One DMA_MAP (with its fd) round trip.
    pub map_p50_us: f64,
    /// One DMA_UNMAP round trip.
    pub unmap_p50_us: f64,
    pub map_p99_us: f64,
    pub unmap_p99_us: f64,
}

fn map_costs(
    dir: &Path,
    rounds: usize,
    (client_cpu, server_cpu): (usize, usize),
) -> Result<Vec<MapRow>, String> {
    let name = format!("map-{client_cpu}-{server_cpu}");
    let (daemon, socket) = start_testdev(dir, &name, server_cpu, Duration::ZERO)?;
    pin_to(client_cpu)?;
    let result = (|| {
        let mut c = RawClient::connect(&socket).map_err(|e| e.to_string())?;
        c.negotiate().map_err(|e| e.to_string())?;
        let sizes = [1u64, 64];
        let files: Vec<std::fs::File> = sizes
            .iter()
            .map(|gib| {
                let fd =
                    nix::sys::memfd::memfd_create(c"umdev-protobench", nix::sys::memfd::MFdFlags::empty())
                        .map_err(|e| e.to_string())?;
                let f = std::fs::File::from(fd);
                f.set_len(gib << 30).map_err(|e| e.to_string())?;
                Ok(f)
            })
            .collect::<Result<_, String>>()?;
        let mut maps = vec![Vec::new(); sizes.len()];
        let mut unmaps = vec![Vec::new(); sizes.len()];
        for round in 0..rounds + 10 {
            for (i, (&gib, file)) in sizes.iter().zip(&files).enumerate() {
                let size = gib << 30;
                let t = Instant::now();
                let r = c
                    .request(
                        Command::DmaMap as u16,
                        &dma_map_payload(3, 0, 1 << 40, size),
                        &[file.as_raw_fd()],
                    )
                    .map_err(|e| e.to_string())?;
                let mapped = t.elapsed();
                let t = Instant::now();
                let u = c
                    .request(Command::DmaUnmap as u16, &dma_unmap_payload(24, 0, 1 << 40, size), &[])
                    .map_err(|e| e.to_string())?;
                let unmapped = t.elapsed();
                if r.errno() != 0 || u.errno() != 0 {
                    return Err(format!("map/unmap of {gib} GiB failed: {} {}", r.errno(), u.errno()));
                }
                if round >= 10 {
                    maps[i].push(mapped.as_nanos() as f64 / 1000.0);
                    unmaps[i].push(unmapped.as_nanos() as f64 / 1000.0);
                }
            }
        }
        let placement = if client_cpu == server_cpu { "one CPU" } else { "two CPUs" };
        Ok(sizes
            .iter()
            .zip(maps.into_iter().zip(unmaps))
            .map(|(&gib, (m, u))| {
                let ((m50, m99), (u50, u99)) = (summarize(m), summarize(u));
                MapRow {
                    placement: placement.to_string(),
                    size_gib: gib,
                    map_p50_us: m50,
                    unmap_p50_us: u50,
                    map_p99_us: m99,
                    unmap_p99_us: u99,
                }
            })
            .collect())
    })();
    unpin()?;
    daemon.shutdown();
    result
}

/// The many-instances isolation experiment.
#[derive(Debug, Serialize)]
pub struct FloodReport {
    pub instances: usize,
    pub probe_p50_us_quiet: f64,
    pub probe_p99_us_quiet: f64,
    pub probe_p50_us_flooded: f64,
    pub probe_p99_us_flooded: f64,
    pub flood_messages_per_sec: f64,
    pub flooded_instance_read_p50_us: f64,
}

fn flood(dir: &Path, instances: usize, window: Duration) -> Result<FloodReport, String> {
    let daemon = Daemon::new();
    let registry = umdev::builtin_registry();
    let mut sockets = Vec::new();
    for i in 0..instances {
        // Instance 0 (the flooded one) lives on CPU 1, the rest on CPU 0.
        pin_to(if i == 0 { 1 } else { 0 })?;
        let device = registry
            .find("testdev")
            .and_then(|t| t.create(&InstanceOptions::default()))
            .map_err(|e| e.to_string())?;
        let socket = dir.join(format!("flood-{i}.sock"));
        daemon
            .start(device, InstanceConfig::new(format!("flood-{i}"), &socket))
            .map_err(|e| e.to_string())?;
        sockets.push(socket);
    }
    unpin()?;
    let mut streams = Vec::new();
    for s in &sockets {
        let mut c = RawClient::connect(s).map_err(|e| e.to_string())?;
        c.negotiate().map_err(|e| e.to_string())?;
        streams.push(c.stream);
    }
    let probe = |streams: &mut [UnixStream]| -> Result<Vec<f64>, String> {
        let start = Instant::now();
        let mut v = Vec::new();
        let mut i = 1;
        while start.elapsed() < window {
            v.extend(region_reads(&mut streams[i], 1)?);
            i = if i + 1 == streams.len() { 1 } else { i + 1 };
        }
        Ok(v)
    };
    pin_to(0)?;
    let (q50, q99) = summarize(probe(&mut streams)?);
    // The flood: posted writes to instance 0's scratch register, as fast as the socket takes them.
    let stop = Arc::new(AtomicBool::new(false));
    let sent = Arc::new(AtomicU64::new(0));
    let mut flood_stream = streams[0].try_clone().map_err(|e| e.to_string())?;
    let flooder = {
        let (stop, sent) = (stop.clone(), sent.clone());
        std::thread::spawn(move || {
            let _ = pin_to(1);
            let mut batch = Vec::new();
            for id in 0..64u16 {
                let payload = region_write_payload(0, 4, &u32::from(id).to_le_bytes());
                batch.extend(message(id, Command::RegionWrite as u16, flags::NO_REPLY, &payload));
            }
            while !stop.load(Ordering::Relaxed) {
                if flood_stream.write_all(&batch).is_err() {
                    break;
                }
                sent.fetch_add(64, Ordering::Relaxed);
            }
        })
    };
    std::thread::sleep(Duration::from_millis(100));
    let before = sent.load(Ordering::Relaxed);
    let t = Instant::now();
    let (f50, f99) = summarize(probe(&mut streams)?);
    let rate = (sent.load(Ordering::Relaxed) - before) as f64 / t.elapsed().as_secs_f64();
    stop.store(true, Ordering::Relaxed);
    let _ = flooder.join();
    // The flooded instance itself: a read waits behind every posted write queued before it.
    let (own50, _) = summarize(region_reads(&mut streams[0], 20)?);
    unpin()?;
    drop(streams);
    daemon.shutdown();
    Ok(FloodReport {
        instances,
        probe_p50_us_quiet: q50,
        probe_p99_us_quiet: q99,
        probe_p50_us_flooded: f50,
        probe_p99_us_flooded: f99,
        flood_messages_per_sec: rate,
        flooded_instance_read_p50_us: own50,
    })
}

/// Everything `umdev protobench` measures.
#[derive(Debug, Serialize)]
pub struct Report {
    pub latency: Vec<LatencyRow>,
    pub map: Vec<MapRow>,
    pub flood: FloodReport,
}

pub fn run(quick: bool) -> Result<Report, String> {
    let dir = crate::cleanup::scratch_dir("protobench")?;
    let cpus = crate::affinity::cpus();
    let mut progress = crate::progress::Progress::new("protobench", if cpus >= 2 { 6 } else { 3 });
    let (blocks, per_block) = if quick { (4, 500) } else { (10, 2000) };
    progress.step("REGION_READ round trips, one CPU");
    let mut latency_rows = vec![latency(dir.path(), (0, 0), Duration::ZERO, blocks, per_block)?];
    if cpus >= 2 {
        progress.step("REGION_READ round trips, two CPUs");
        latency_rows.push(latency(dir.path(), (0, 1), Duration::ZERO, blocks, per_block)?);
        progress.step("REGION_READ round trips, two CPUs, busy-polling");
        latency_rows.push(latency(dir.path(), (0, 1), Duration::from_micros(50), blocks, per_block)?);
    }
    let map_rounds = if quick { 21 } else { 201 };
    progress.step("DMA_MAP and DMA_UNMAP, one CPU");
    let mut map = map_costs(dir.path(), map_rounds, (0, 0))?;
    if cpus >= 2 {
        progress.step("DMA_MAP and DMA_UNMAP, two CPUs");
        map.extend(map_costs(dir.path(), map_rounds, (0, 1))?);
    }
    progress.step("64 instances, one flooded");
    let flood = flood(dir.path(), 64, Duration::from_millis(if quick { 300 } else { 1500 }))?;
    Ok(Report { latency: latency_rows, map, flood })
}

pub fn print(r: &Report) -> crate::output::Out {
    out!("REGION_READ of 4 bytes, round trip (us), against a bare UNIX-socket ping-pong of the same sizes:")?;
    out!(
        "{:<30} {:>10} {:>10} {:>10} {:>10} {:>8}",
        "placement",
        "floor p50",
        "floor p99",
        "umdev p50",
        "umdev p99",
        "p50 x"
    )?;
    for l in &r.latency {
        out!(
            "{:<30} {:>10.2} {:>10.2} {:>10.2} {:>10.2} {:>8.2}",
            l.placement,
            l.floor_p50_us,
            l.floor_p99_us,
            l.umdev_p50_us,
            l.umdev_p99_us,
            l.ratio_p50
        )?;
    }
    out!("")?;
    out!("DMA_MAP and DMA_UNMAP of a sparse memfd over the socket, each a round trip (us):")?;
    out!(
        "{:<10} {:>6} {:>9} {:>9} {:>11} {:>11}",
        "placement",
        "size",
        "map p50",
        "map p99",
        "unmap p50",
        "unmap p99"
    )?;
    for m in &r.map {
        out!(
            "{:<10} {:>4} G {:>9.1} {:>9.1} {:>11.1} {:>11.1}",
            m.placement,
            m.size_gib,
            m.map_p50_us,
            m.map_p99_us,
            m.unmap_p50_us,
            m.unmap_p99_us
        )?;
    }
    out!("")?;
    let f = &r.flood;
    out!("{} instances, probe REGION_READ across instances 1-{} (us):", f.instances, f.instances - 1)?;
    out!("  quiet:   p50 {:.2}, p99 {:.2}", f.probe_p50_us_quiet, f.probe_p99_us_quiet)?;
    out!(
        "  flooded: p50 {:.2}, p99 {:.2}   (instance 0 flooded with {:.0} posted writes/s; its own read p50 {:.0} us)",
        f.probe_p50_us_flooded, f.probe_p99_us_flooded, f.flood_messages_per_sec, f.flooded_instance_read_p50_us
    )?;
    Ok(())
}
