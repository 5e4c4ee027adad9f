//! The ccw device over a real socket with rust-vmm's `vfio_user::Client`: channel programs
//! with direct and IDAW-scattered data in both directions, every error status, several
//! subchannels at once, and DMA unmaps racing running programs.

mod common;

use std::os::fd::AsRawFd;
use std::time::{Duration, Instant};

use common::ccw::*;
use common::Harness;
use umdev_devices::ccw::program::{cmd, cstat, dstat, flags, Ccw, Reason, Status, MAX_CCWS, MAX_CCW_COUNT};
use umdev_devices::ccw::regs;
use umdev_mdev::types::InstanceOptions;
use umdev_pinning::PinMode;
use umdev_testkit::ccw_driver::{idaws, layout, Data, Op};

fn harness(extra: &[(&str, &str)]) -> Harness {
    let mut options = InstanceOptions::default();
    for (k, v) in extra {
        options.params.insert(k.to_string(), v.to_string());
    }
    Harness::with("ccw", options, |_| {})
}

fn pattern(seed: u8, n: usize) -> Vec<u8> {
    (0..n).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed)).collect()
}

fn ok(s: &Status) {
    assert_eq!((s.dstat, s.cstat, s.reason), (dstat::CE | dstat::DE, 0, Reason::Ok), "{s:?}");
}

/// A seek CCW to `pos`, with its 8-byte argument at `arg`.
fn seek(g: &CcwGuest, pos: u64, arg: u64) -> Op {
    g.put(arg, &pos.to_le_bytes()).unwrap();
    Op::new(cmd::SEEK, 8, Data::Direct(arg))
}

#[test]
fn data_round_trips_direct_scattered_and_idaw_mixed() {
    let h = harness(&[("subchannels", "2")]);
    let mut g = CcwGuest::connect(&h.socket).unwrap();
    assert_eq!(g.read(regs::ID).unwrap(), regs::ID_VALUE);
    assert_eq!(g.subchannels, 2);
    assert_eq!(u64::from(g.read(regs::STORE_SIZE_LO).unwrap()), 64 << 20);

    // Contiguous: 64 KiB from an unaligned guest buffer to the store and back elsewhere.
    let a = pattern(1, 65536);
    g.put(DATA_BASE + 0x123, &a).unwrap();
    let s = g.run(0, &[Op::new(cmd::WRITE, 65536, Data::Direct(DATA_BASE + 0x123))]).unwrap();
    ok(&s);
    assert_eq!((s.bytes, s.ccws, s.cpa), (65536, 1, program_area(0) + 16));
    let s = g
        .run(0, &[seek(&g, 0, SCRATCH), Op::new(cmd::READ, 65536, Data::Direct(DATA_BASE + 0x10_0000))])
        .unwrap();
    ok(&s);
    assert!(g.get(DATA_BASE + 0x10_0000, 65536).unwrap() == a, "contiguous round trip");

    // Scattered: 256 blocks, no two adjacent, random order, first unaligned.
    let mut blocks: Vec<u64> = (0..256).map(|k| DATA_BASE + 0x20_0000 + 2 * 4096 * k).collect();
    blocks.reverse();
    blocks.swap(3, 100);
    let count = 256 * 4096 - 300;
    let b = pattern(7, count as usize);
    // Put the data where the IDAWs say, piece by piece.
    let list = idaws(&blocks, 300, count);
    let mut at = 0usize;
    for (i, &addr) in list.iter().enumerate() {
        let len = if i == 0 { 4096 - 300 } else { 4096.min(count as usize - at) };
        g.put(addr, &b[at..at + len]).unwrap();
        at += len;
    }
    let pins_before = h.info().dma.pin_calls;
    ok(&g
        .run(1, &[seek(&g, 1 << 20, SCRATCH + 8), Op::new(cmd::WRITE, count, Data::Idaws(list.clone()))])
        .unwrap());
    assert!(h.info().dma.pin_calls > pins_before, "the scattered WRITE pinned its pages");
    // Read it back contiguously: the store holds the gathered bytes in order.
    let s = g
        .run(
            1,
            &[seek(&g, 1 << 20, SCRATCH + 8), Op::new(cmd::READ, count, Data::Direct(DATA_BASE + 0x80_0000))],
        )
        .unwrap();
    ok(&s);
    assert!(g.get(DATA_BASE + 0x80_0000, count as usize).unwrap() == b, "scatter-gather round trip");

    // IDAW-mixed: runs of 1-16 adjacent blocks in shuffled order, read from the store.
    let mut runs: Vec<Vec<u64>> = Vec::new();
    let mut next = DATA_BASE + 0x200_0000;
    for len in [1u64, 5, 16, 2, 9, 1, 3] {
        runs.push((0..len).map(|k| next + 4096 * k).collect());
        next += 4096 * (len + 1);
    }
    runs.swap(0, 4);
    let mixed: Vec<u64> = runs.concat();
    let count = mixed.len() as u32 * 4096;
    let dma_before = h.info().dma;
    let s = g
        .run(0, &[seek(&g, 0, SCRATCH + 16), Op::new(cmd::READ, count, Data::Idaws(mixed.clone()))])
        .unwrap();
    ok(&s);
    let dma_after = h.info().dma;
    // One pin call for the data CCW, cut into the runs (a run may merge two IDAW runs that
    // happen to be adjacent): far fewer runs than pages.
    let data_runs = dma_after.runs - dma_before.runs;
    assert!(data_runs < mixed.len() as u64, "{data_runs} runs for {} pages", mixed.len());
    let mut expect = Vec::new();
    for &blk in &mixed {
        expect.extend_from_slice(&g.get(blk, 4096).unwrap());
    }
    // The store there holds `a` (64 KiB written at position 0), then zeros.
    let mut store = a.clone();
    store.resize(count as usize, 0);
    assert!(expect == store, "IDAW-mixed read delivered the store in IDAW order");

    // 2K IDAWs, two of them in one page.
    let two_k = [DATA_BASE + 0x300_0800, DATA_BASE + 0x300_0000, DATA_BASE + 0x300_5000];
    ok(&g
        .run(0, &[seek(&g, 0, SCRATCH + 24), Op::new(cmd::READ, 6144, Data::Idaws2k(two_k.to_vec()))])
        .unwrap());
    assert!(g.get(two_k[0], 2048).unwrap() == a[..2048]);
    assert!(g.get(two_k[1], 2048).unwrap() == a[2048..4096]);
    assert!(g.get(two_k[2], 2048).unwrap() == a[4096..6144]);

    let dma = h.info().dma;
    assert_eq!(dma.pins_held, 0, "every pin returned");
}

#[test]
fn bad_programs_end_in_documented_status() {
    let h = harness(&[("size", "1M")]);
    let mut g = CcwGuest::connect(&h.socket).unwrap();
    // A read-only mapping (QEMU maps ROM this way), for the protection check.
    let rom = common::memfd(0x10000);
    // vfio_user::Client maps read-write only: map read-only with the raw protocol instead.
    drop(rom);
    let pc = cstat::PROGRAM_CHECK;
    let cases: Vec<(&str, Vec<Op>, u8, u8, Reason)> = vec![
        (
            "unknown command",
            vec![Op::new(0x05, 1, Data::Direct(DATA_BASE))],
            dstat::UC,
            0,
            Reason::BadCommand,
        ),
        ("zero count", vec![Op::new(cmd::READ, 0, Data::Direct(DATA_BASE))], 0, pc, Reason::BadCount),
        (
            "count overflow",
            vec![Op::new(cmd::READ, MAX_CCW_COUNT + 1, Data::Direct(DATA_BASE))],
            0,
            pc,
            Reason::BadCount,
        ),
        (
            "data unmapped",
            vec![Op::new(cmd::READ, 4096, Data::Direct(RAM_SIZE + 0x1000))],
            0,
            pc,
            Reason::DataUnmapped,
        ),
        (
            "data crossing the end of RAM",
            vec![Op::new(cmd::READ, 8192, Data::Direct(RAM_SIZE - 4096))],
            0,
            pc,
            Reason::DataUnmapped,
        ),
        (
            "misaligned IDAW",
            vec![Op::new(cmd::READ, 8192, Data::Idaws(vec![DATA_BASE, DATA_BASE + 0x2010]))],
            0,
            pc,
            Reason::IdawMisaligned,
        ),
        (
            "IDAW unmapped",
            vec![Op::new(cmd::READ, 4096, Data::Idaws(vec![RAM_SIZE + 0x4000]))],
            0,
            pc,
            Reason::DataUnmapped,
        ),
        (
            "chain data flag",
            vec![Op { cmd: cmd::READ, flags: flags::CD, count: 16, data: Data::Direct(DATA_BASE) }],
            0,
            pc,
            Reason::BadCcw,
        ),
        (
            "read past the store",
            vec![Op::new(cmd::READ, (1 << 20) + 1, Data::Direct(DATA_BASE))],
            dstat::UC,
            0,
            Reason::EndOfStore,
        ),
    ];
    for (what, ops, d, c, reason) in cases {
        let s = g.run(0, &ops).unwrap();
        assert_eq!((s.dstat, s.cstat, s.reason), (d, c, reason), "{what}: {s:?}");
        assert_eq!(g.sc_read(0, regs::DSTAT_CSTAT).unwrap(), u32::from(d) | u32::from(c) << 8, "{what}");
    }

    // Hand-built programs for what the layout helper never produces.
    let cpa = program_area(0);
    let put_ccw = |g: &CcwGuest, at: u64, cmd: u8, f: u8, count: u32, addr: u64| {
        g.put(at, &Ccw { cmd, flags: f, reserved: 0, count, addr }.encode()).unwrap()
    };
    // TIC to TIC.
    put_ccw(&g, cpa, cmd::TIC, 0, 0, cpa + 0x100);
    put_ccw(&g, cpa + 0x100, cmd::TIC, 0, 0, cpa + 0x200);
    g.start_at(0, cpa).unwrap();
    let s = g.wait(0).unwrap();
    assert_eq!((s.cstat, s.reason, s.cpa), (pc, Reason::TicToTic, cpa + 0x110));
    // A TIC loop.
    put_ccw(&g, cpa, cmd::NOP, flags::CC, 1, 0);
    put_ccw(&g, cpa + 16, cmd::TIC, 0, 0, cpa);
    g.start_at(0, cpa).unwrap();
    assert_eq!(g.wait(0).unwrap().reason, Reason::TicLoop);
    // Chain too long: 257 chained NOPs.
    for i in 0..=MAX_CCWS as u64 {
        put_ccw(&g, cpa + 16 * i, cmd::NOP, flags::CC, 1, 0);
    }
    g.start_at(0, cpa).unwrap();
    let s = g.wait(0).unwrap();
    assert_eq!((s.reason, s.ccws), (Reason::ChainTooLong, MAX_CCWS as u32));
    // Misaligned channel program, unmapped channel program.
    g.start_at(0, cpa + 4).unwrap();
    assert_eq!(g.wait(0).unwrap().reason, Reason::CcwMisaligned);
    g.start_at(0, RAM_SIZE + 0x1000).unwrap();
    assert_eq!(g.wait(0).unwrap().reason, Reason::CcwUnmapped);
    // An IDAW list running off the end of guest memory, and a misaligned one.
    put_ccw(&g, cpa, cmd::READ, flags::IDA, 3 * 4096, RAM_SIZE - 8);
    g.put(RAM_SIZE - 8, &DATA_BASE.to_le_bytes()).unwrap();
    g.start_at(0, cpa).unwrap();
    assert_eq!(g.wait(0).unwrap().reason, Reason::IdalUnmapped);
    put_ccw(&g, cpa, cmd::READ, flags::IDA, 16, idal_area(0) + 4);
    g.start_at(0, cpa).unwrap();
    assert_eq!(g.wait(0).unwrap().reason, Reason::IdalMisaligned);

    // Nothing outside the mappings was touched, nothing stays pinned, and the device works.
    assert_eq!(h.info().dma.pins_held, 0);
    g.put(DATA_BASE, &[3; 64]).unwrap();
    ok(&g.run(0, &[Op::new(cmd::WRITE, 64, Data::Direct(DATA_BASE))]).unwrap());
}

#[test]
fn a_read_into_read_only_memory_is_a_protection_check() {
    use common::raw::{dma_map_payload, RawClient};
    use umdev_server::wire::Command;
    let h = harness(&[]);
    let g = CcwGuest::connect(&h.socket).unwrap();
    // A second client cannot connect, so map the ROM through the first one's socket... the
    // rust-vmm client maps read-write only; use a separate instance and a raw client.
    drop(g);
    h.wait_idle();
    let mut raw = RawClient::connect(&h.socket).unwrap();
    raw.negotiate().unwrap();
    raw.enable_bus_master().unwrap();
    let ram = common::memfd(RAM_SIZE);
    let rom = common::memfd(0x10000);
    assert_eq!(
        raw.request(Command::DmaMap as u16, &dma_map_payload(3, 0, 0, RAM_SIZE), &[ram.as_raw_fd()])
            .unwrap()
            .errno(),
        0
    );
    assert_eq!(
        raw.request(Command::DmaMap as u16, &dma_map_payload(1, 0, RAM_SIZE, 0x10000), &[rom.as_raw_fd()])
            .unwrap()
            .errno(),
        0
    );
    let reg = |sc: u64, r: u64| regs::SUBCHANNEL_BASE + sc * regs::SUBCHANNEL_STRIDE + r;
    let w = |raw: &mut RawClient, r: u64, v: u32| {
        assert_eq!(raw.region_write(0, r, &v.to_le_bytes()).unwrap().errno(), 0)
    };
    let cpa = 0x1000u64;
    std::os::unix::fs::FileExt::write_all_at(
        &ram,
        &Ccw { cmd: cmd::READ, flags: 0, reserved: 0, count: 64, addr: RAM_SIZE + 0x100 }.encode(),
        cpa,
    )
    .unwrap();
    w(&mut raw, reg(0, regs::CPA_LO), cpa as u32);
    w(&mut raw, reg(0, regs::DOORBELL), regs::DOORBELL_START);
    let deadline = Instant::now() + Duration::from_secs(5);
    let state = |raw: &mut RawClient| {
        u32::from_le_bytes(
            raw.region_read(0, reg(0, regs::STATE), 4).unwrap().payload[16..20].try_into().unwrap(),
        )
    };
    while state(&mut raw) != regs::STATE_PENDING {
        assert!(Instant::now() < deadline);
        std::thread::sleep(Duration::from_millis(1));
    }
    let reason = u32::from_le_bytes(
        raw.region_read(0, reg(0, regs::REASON), 4).unwrap().payload[16..20].try_into().unwrap(),
    );
    let dc = u32::from_le_bytes(
        raw.region_read(0, reg(0, regs::DSTAT_CSTAT), 4).unwrap().payload[16..20].try_into().unwrap(),
    );
    assert_eq!((reason, dc >> 8), (Reason::DataReadOnly as u32, u32::from(cstat::PROTECTION_CHECK)));
    // The ROM is untouched.
    let mut b = [0u8; 64];
    std::os::unix::fs::FileExt::read_exact_at(&rom, &mut b, 0x100).unwrap();
    assert_eq!(b, [0; 64]);
}

#[test]
fn subchannels_run_concurrently_and_halt_stops_a_program() {
    let h = harness(&[("subchannels", "4"), ("size", "32M")]);
    let mut g = CcwGuest::connect(&h.socket).unwrap();
    for sc in 0..4u32 {
        let data = pattern(sc as u8, 1 << 20);
        g.put(DATA_BASE + u64::from(sc) * (2 << 20), &data).unwrap();
    }
    // Start all four, then collect: each writes its own MiB of the store.
    for sc in 0..4u32 {
        let arg = SCRATCH + 0x100 + 8 * u64::from(sc);
        let s = seek(&g, u64::from(sc) << 20, arg);
        g.start(sc, &[s, Op::new(cmd::WRITE, 1 << 20, Data::Direct(DATA_BASE + u64::from(sc) * (2 << 20)))])
            .unwrap();
    }
    for sc in 0..4u32 {
        ok(&g.wait(sc).unwrap());
    }
    let s = g.run(0, &[Op::new(cmd::READ, 4 << 20, Data::Direct(DATA_BASE + (16 << 20)))]).unwrap();
    ok(&s);
    for sc in 0..4u32 {
        let got = g.get(DATA_BASE + (16 << 20) + (u64::from(sc) << 20), 1 << 20).unwrap();
        assert!(got == pattern(sc as u8, 1 << 20), "subchannel {sc}'s data");
    }
    // Halt: a long program (256 chained 1 MiB writes) stops with unit exception.
    let ops: Vec<Op> = (0..200).map(|_| Op::new(cmd::WRITE, 1 << 17, Data::Direct(DATA_BASE))).collect();
    g.start(2, &ops).unwrap();
    g.write(regs::SUBCHANNEL_BASE + 2 * regs::SUBCHANNEL_STRIDE + regs::DOORBELL, regs::DOORBELL_HALT)
        .unwrap();
    let s = g.wait(2).unwrap();
    assert!(s.ok() || (s.dstat == dstat::UE && s.reason == Reason::Halted), "{s:?}");
}

#[test]
fn unmaps_racing_running_programs_complete_promptly() {
    let h = harness(&[("subchannels", "4"), ("size", "16M")]);
    let mut g = CcwGuest::connect(&h.socket).unwrap();
    // A second RAM region the programs use, unmapped and remapped while they run.
    let extra = common::memfd(8 << 20);
    let extra_iova = 1u64 << 32;
    let mut halted = 0;
    let mut completed = 0;
    let mut slowest = Duration::ZERO;
    for round in 0..20 {
        g.client.dma_map(0, extra_iova, 8 << 20, extra.as_raw_fd()).unwrap();
        // Each subchannel: 64 CCWs of 128 KiB scattered over the extra region.
        for sc in 0..4u32 {
            let ops: Vec<Op> = (0..64u64)
                .map(|i| {
                    let blocks: Vec<u64> = (0..32)
                        .map(|k| extra_iova + ((i * 37 + k * 7 + u64::from(sc)) % 2040) * 4096)
                        .collect();
                    Op::new(cmd::WRITE, 32 * 4096, Data::Idaws(blocks))
                })
                .collect();
            g.start(sc, &ops).unwrap();
        }
        std::thread::sleep(Duration::from_micros(200 * (round % 5)));
        let t = Instant::now();
        g.client.dma_unmap(extra_iova, 8 << 20).expect("unmap while programs run");
        slowest = slowest.max(t.elapsed());
        for sc in 0..4u32 {
            let s = g.wait(sc).unwrap();
            match s.reason {
                Reason::Ok => completed += 1,
                // Stopped by the unmap, or the pages were already gone when it pinned them.
                Reason::Unmapped | Reason::DataUnmapped | Reason::IdalUnmapped => halted += 1,
                other => panic!("round {round}: unexpected {other:?} {s:?}"),
            }
        }
        assert_eq!(h.info().dma.pins_held, 0);
    }
    let dma = h.info().dma;
    // How prompt is measured, not asserted: the unmap never failed busy (it did not outwait
    // its bound) and it stopped programs rather than waiting for them.
    eprintln!("MEASURED slowest unmap while programs ran: {slowest:?}");
    assert_eq!(dma.unmap_busy, 0, "no unmap failed busy");
    assert!(halted > 0, "some programs were caught by the unmap ({completed} completed)");
    // Everything still works afterwards.
    g.put(DATA_BASE, &[1; 4096]).unwrap();
    ok(&g.run(0, &[Op::new(cmd::WRITE, 4096, Data::Direct(DATA_BASE))]).unwrap());
}

#[test]
fn a_client_truncating_its_memory_under_the_device_cannot_crash_the_server() {
    truncating_under_the_device(PinMode::Track);
}

/// As above, with the device's pins the kernel's own (io_uring buffer registrations): the
/// truncated pages stay pinned by the kernel until the engine lets go, but the device reaches
/// memory through the client's mapping, which faults past the file's new end just the same.
#[test]
fn a_client_truncating_its_memory_under_kernel_pins_cannot_crash_the_server() {
    truncating_under_the_device(PinMode::Kernel);
}

fn truncating_under_the_device(mode: PinMode) {
    let h = Harness::with("ccw", InstanceOptions::default(), |c| c.dma.mode = mode);
    let mut g = CcwGuest::connect(&h.socket).unwrap();
    let start = |g: &mut CcwGuest| {
        // Registers only: writing the status area through the file would grow it again.
        g.sc_write(0, regs::CPA_LO, program_area(0) as u32).unwrap();
        g.sc_write(0, regs::CPA_HI, 0).unwrap();
        g.sc_write(0, regs::STATUS_LO, status_area(0) as u32).unwrap();
        g.sc_write(0, regs::STATUS_HI, 0).unwrap();
        g.sc_write(0, regs::DOORBELL, regs::DOORBELL_START).unwrap();
    };
    let finish = |g: &mut CcwGuest| -> u32 {
        assert!(wait_eventfd(&g.irqs[0], Duration::from_secs(60)), "no interrupt");
        let _ = g.irqs[0].read();
        assert_eq!(g.sc_read(0, regs::STATE).unwrap(), regs::STATE_PENDING);
        let reason = g.sc_read(0, regs::REASON).unwrap();
        g.sc_write(0, regs::ACK, 1).unwrap();
        reason
    };
    let remap = |g: &mut CcwGuest| {
        g.client.dma_unmap(0, RAM_SIZE).unwrap();
        g.ram.set_len(RAM_SIZE).unwrap();
        g.client.dma_map(0, 0, RAM_SIZE, g.ram.as_raw_fd()).unwrap();
    };

    // The program is in guest RAM, then the client shrinks its memfd to nothing: the device's
    // first access faults (SIGBUS), which must poison the mapping, not kill the server.
    for (addr, bytes) in
        layout(program_area(0), idal_area(0), &[Op::new(cmd::WRITE, 4096, Data::Direct(DATA_BASE))])
    {
        g.put(addr, &bytes).unwrap();
    }
    g.ram.set_len(0).unwrap();
    start(&mut g);
    // The CCW fetch itself found the memory gone: the device could not read it.
    assert_eq!(finish(&mut g), Reason::DeviceError as u32);
    let dma = h.info().dma;
    if mode == PinMode::Kernel {
        // The kernel refused to pin pages past the file's end: nothing touched the memory.
        assert!(dma.pin_failures > 0 && dma.pins_held == 0 && dma.kernel_pages_held == 0, "{dma:?}");
    } else {
        // The fetch touched the memory: the fault poisoned the mapping.
        assert_eq!((dma.poisoned_mappings, dma.pins_held), (1, 0), "{dma:?}");
        assert!(umdev_pinning::recovered_faults() > 0);
    }

    // Truncated while a long program runs: it completes or stops with a device error.
    remap(&mut g);
    let ops: Vec<Op> =
        (0..48u64).map(|i| Op::new(cmd::WRITE, 1 << 20, Data::Direct(DATA_BASE + (i << 20)))).collect();
    for (addr, bytes) in layout(program_area(0), idal_area(0), &ops) {
        g.put(addr, &bytes).unwrap();
    }
    start(&mut g);
    g.ram.set_len(0).unwrap();
    let reason = finish(&mut g);
    let allowed = [Reason::Ok, Reason::DeviceError, Reason::CcwUnmapped].map(|r| r as u32);
    assert!(allowed.contains(&reason), "reason {reason}");

    // Mapped again whole, everything works; the poisoned mapping is gone.
    remap(&mut g);
    assert_eq!(h.info().dma.poisoned_mappings, 0);
    g.put(DATA_BASE, &[5; 4096]).unwrap();
    ok(&g.run(0, &[Op::new(cmd::WRITE, 4096, Data::Direct(DATA_BASE))]).unwrap());
    drop(g);
    h.wait_idle();
    let mut g = CcwGuest::connect(&h.socket).unwrap();
    ok(&g.run(0, &[Op::new(cmd::NOP, 1, Data::Direct(0))]).unwrap());
    if mode == PinMode::Kernel {
        let dma = h.info().dma;
        assert!(dma.kernel_pin_calls > 0, "the kernel pinned the programs' pages: {dma:?}");
        assert_eq!((dma.kernel_buffers_held, dma.kernel_pages_held), (0, 0), "{dma:?}");
    }
}
