//! Disconnect anywhere: a realistic session with the ccw device (VERSION, guest RAM and a
//! message-only region mapped, config space set up, MSI-X eventfds, channel programs started
//! with posted doorbell writes on every subchannel, one of them moving data through
//! server-to-client DMA, an unmap of a region in use, DEVICE_RESET, unmap all) is replayed
//! and cut after every message and in the middle of every message. After each cut the
//! instance must accept a new client and present a reset device, with no pin, mapping, fd or
//! memory mapping left behind (counted in `/proc/self/fd` and `/proc/self/maps`; the server
//! runs in this process).

mod common;

use std::fs::File;
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::fs::FileExt;
use std::time::{Duration, Instant};

use common::ccw::{idal_area, program_area, status_area, DATA_BASE};
use common::raw::*;
use common::Harness;
use umdev_devices::ccw::program::cmd;
use umdev_devices::ccw::regs;
use umdev_server::wire::{flags, Command as Cmd, Header, HEADER_SIZE};
use umdev_testkit::ccw_driver::{idaws, layout, Data, Op};

const RAM: u64 = 32 << 20;
const MESSAGE_ONLY_IOVA: u64 = 1 << 30;
const SUBCHANNELS: u32 = 4;
const BAR0: u32 = 0;
const CONFIG: u32 = 7;
const MSIX: u32 = 2;

/// One message of the transcript.
struct Msg {
    bytes: Vec<u8>,
    fds: Vec<RawFd>,
    /// Its id, if a reply is expected.
    reply: Option<u16>,
    what: String,
}

struct Transcript {
    msgs: Vec<Msg>,
    next_id: u16,
}

impl Transcript {
    fn push(&mut self, what: &str, command: Cmd, payload: Vec<u8>, fds: &[RawFd], posted: bool) {
        let id = self.next_id;
        self.next_id += 1;
        let flags = if posted { flags::TYPE_COMMAND | flags::NO_REPLY } else { flags::TYPE_COMMAND };
        let header = Header {
            id,
            command: command as u16,
            size: (HEADER_SIZE + payload.len()) as u32,
            flags,
            error: 0,
        };
        let mut bytes = header.encode().to_vec();
        bytes.extend_from_slice(&payload);
        self.msgs.push(Msg { bytes, fds: fds.to_vec(), reply: (!posted).then_some(id), what: what.into() });
    }

    fn region_write(&mut self, what: &str, region: u32, offset: u64, data: &[u8], posted: bool) {
        self.push(what, Cmd::RegionWrite, region_write_payload(region, offset, data), &[], posted);
    }

    fn region_read(&mut self, what: &str, region: u32, offset: u64, count: u32) {
        let mut p = le64(offset).to_vec();
        p.extend_from_slice(&le32(region));
        p.extend_from_slice(&le32(count));
        self.push(what, Cmd::RegionRead, p, &[], false);
    }
}

fn sc_reg(sc: u32, r: u64) -> u64 {
    regs::SUBCHANNEL_BASE + u64::from(sc) * regs::SUBCHANNEL_STRIDE + r
}

/// Lays out one program per subchannel in `ram`: 0 gathers 8 MiB into the store and 1
/// scatters 2 MiB from it through IDAWs (0 runs long enough to be in flight when the client
/// asks), 2 moves 8 MiB contiguously, 3 moves 256 KiB from the message-only region
/// (server-to-client DMA_READs).
fn lay_out_programs(ram: &File) {
    let scattered = |base: u64, ccws: u64| -> Vec<Op> {
        (0..ccws)
            .map(|i| {
                // 16 blocks per CCW in reverse order: no two adjacent.
                let blocks: Vec<u64> = (0..16u64).rev().map(|b| base + (i * 16 + b) * 8192).collect();
                Op::new(
                    if base == DATA_BASE { cmd::WRITE } else { cmd::READ },
                    65536,
                    Data::Idaws(idaws(&blocks, 0, 65536)),
                )
            })
            .collect()
    };
    let programs = [
        scattered(DATA_BASE, 128),
        scattered(DATA_BASE + (8 << 20), 32),
        (0..8u64).map(|i| Op::new(cmd::WRITE, 1 << 20, Data::Direct(DATA_BASE + (i << 20)))).collect(),
        (0..4u64).map(|i| Op::new(cmd::WRITE, 65536, Data::Direct(MESSAGE_ONLY_IOVA + i * 65536))).collect(),
    ];
    for (sc, ops) in programs.iter().enumerate() {
        for (addr, bytes) in layout(program_area(sc as u32), idal_area(sc as u32), ops) {
            ram.write_all_at(&bytes, addr).unwrap();
        }
    }
}

/// Finds the MSI-X capability's offset in config space.
fn msix_cap(h: &Harness) -> u64 {
    let mut c = RawClient::connect(&h.socket).unwrap();
    c.negotiate().unwrap();
    let mut cfg = |off: u64| -> u32 {
        let r = c.region_read(CONFIG, off, 4).unwrap();
        assert_eq!(r.errno(), 0);
        u32::from_le_bytes(r.payload[16..20].try_into().unwrap())
    };
    let mut ptr = u64::from(cfg(0x34) as u8);
    while cfg(ptr) as u8 != 0x11 {
        ptr = u64::from((cfg(ptr) >> 8) as u8);
        assert_ne!(ptr, 0, "no MSI-X capability");
    }
    drop(c);
    h.wait_idle();
    ptr
}

fn transcript(ram: &File, ram2: &File, irqs: &[RawFd], msix: u64) -> Vec<Msg> {
    let mut t = Transcript { msgs: Vec::new(), next_id: 1 };
    let mut version = vec![0, 0, 0, 0];
    version.extend_from_slice(QEMU_CAPS.as_bytes());
    version.push(0);
    t.push("VERSION", Cmd::Version, version, &[], false);
    t.push("DMA_MAP RAM", Cmd::DmaMap, dma_map_payload(3, 0, 0, RAM), &[ram.as_raw_fd()], false);
    t.push(
        "DMA_MAP message-only",
        Cmd::DmaMap,
        dma_map_payload(3, 0, MESSAGE_ONLY_IOVA, 1 << 20),
        &[],
        false,
    );
    let mut info = le32(16).to_vec();
    info.extend_from_slice(&[0; 12]);
    t.push("DEVICE_GET_INFO", Cmd::DeviceGetInfo, info, &[], false);
    for region in [BAR0, CONFIG] {
        let mut p = le32(32).to_vec();
        p.extend_from_slice(&[0; 4]);
        p.extend_from_slice(&le32(region));
        p.extend_from_slice(&[0; 20]);
        t.push("DEVICE_GET_REGION_INFO", Cmd::DeviceGetRegionInfo, p, &[], false);
    }
    let mut p = le32(16).to_vec();
    p.extend_from_slice(&[0; 4]);
    p.extend_from_slice(&le32(MSIX));
    p.extend_from_slice(&[0; 4]);
    t.push("DEVICE_GET_IRQ_INFO", Cmd::DeviceGetIrqInfo, p, &[], false);
    t.region_read("config vendor", CONFIG, 0, 4);
    t.region_write("config command", CONFIG, 4, &6u16.to_le_bytes(), false);
    t.region_write("MSI-X enable", CONFIG, msix + 2, &0x8000u16.to_le_bytes(), false);
    t.push(
        "SET_IRQS MSI-X eventfds",
        Cmd::DeviceSetIrqs,
        set_irqs_payload(0x24, MSIX, 0, SUBCHANNELS, &[]),
        irqs,
        false,
    );
    for sc in 0..SUBCHANNELS {
        let cpa = program_area(sc);
        for (r, v) in [
            (regs::CPA_LO, cpa as u32),
            (regs::CPA_HI, 0),
            (regs::STATUS_LO, status_area(sc) as u32),
            (regs::STATUS_HI, 0),
            (regs::DOORBELL, regs::DOORBELL_START),
        ] {
            t.region_write(
                &format!("posted doorbell write sc{sc}"),
                BAR0,
                sc_reg(sc, r),
                &v.to_le_bytes(),
                true,
            );
        }
    }
    t.region_read("STATE sc0", BAR0, sc_reg(0, regs::STATE), 4);
    t.push(
        "DMA_UNMAP message-only (in use)",
        Cmd::DmaUnmap,
        dma_unmap_payload(24, 0, MESSAGE_ONLY_IOVA, 1 << 20),
        &[],
        false,
    );
    t.push(
        "DMA_MAP second RAM",
        Cmd::DmaMap,
        dma_map_payload(3, 0, 2 << 30, 1 << 20),
        &[ram2.as_raw_fd()],
        false,
    );
    // Restart subchannel 0 and reset the device under it.
    t.region_write("posted doorbell sc0 again", BAR0, sc_reg(0, regs::DOORBELL), &1u32.to_le_bytes(), true);
    t.push("DEVICE_RESET", Cmd::DeviceReset, Vec::new(), &[], false);
    t.push("DMA_UNMAP all", Cmd::DmaUnmap, dma_unmap_payload(24, 2, 0, 0), &[], false);
    t.msgs
}

/// Waits for the reply `id`, answering the server's DMA requests meanwhile.
fn await_reply(c: &mut RawClient, id: u16, what: &str) -> Reply {
    loop {
        let m = c.recv().unwrap_or_else(|e| panic!("{what}: {e}"));
        let h = m.header;
        if h.message_type() == flags::TYPE_COMMAND {
            answer_dma(c, &m);
            continue;
        }
        assert_eq!(h.id, id, "{what}: a reply out of order");
        assert_eq!(m.errno(), 0, "{what} failed");
        return m;
    }
}

fn answer_dma(c: &mut RawClient, m: &Reply) {
    let iova = &m.payload[0..8];
    let count = u64::from_le_bytes(m.payload[8..16].try_into().unwrap());
    let mut p = iova.to_vec();
    p.extend_from_slice(&le64(count));
    if m.header.command == Cmd::DmaRead as u16 {
        p.resize(16 + count as usize, 0x3c);
    }
    let h = Header {
        id: m.header.id,
        command: m.header.command,
        size: (HEADER_SIZE + p.len()) as u32,
        flags: flags::TYPE_REPLY,
        error: 0,
    };
    let mut bytes = h.encode().to_vec();
    bytes.extend_from_slice(&p);
    // The server may already be gone at a cut; that is fine.
    let _ = c.send_bytes(&bytes, &[]);
}

/// Lines of `/proc/self/maps`: (shared or file-backed, anonymous private). Guest memory the
/// server mapped is shared and backed by a memfd; leaking any shows in the first count.
fn maps_count() -> (usize, usize) {
    let maps = std::fs::read_to_string("/proc/self/maps").unwrap();
    let backed = maps
        .lines()
        .filter(|l| {
            let fields: Vec<&str> = l.split_whitespace().collect();
            fields[1].ends_with('s') || fields.len() > 5
        })
        .count();
    (backed, maps.lines().count() - backed)
}

/// Anonymous private mappings come and go with the allocator's per-thread arenas (up to 8
/// per CPU, two lines each) and cached thread stacks: not the server's to bound exactly.
const ALLOCATOR_SLACK: usize = 64;

/// A new client finds the device reset: every subchannel idle with zeroed counters, config
/// space back to its power-on command register, MSI-X off.
fn check_reset(h: &Harness, msix: u64, cut: &str) {
    let served = h.info().protocol.connections;
    let mut c = RawClient::connect(&h.socket).unwrap();
    c.negotiate().unwrap_or_else(|e| panic!("{cut}: the next client could not negotiate: {e}"));
    let mut read = |region: u32, off: u64, n: u32| -> u32 {
        let r = c.region_read(region, off, n).unwrap();
        assert_eq!(r.errno(), 0, "{cut}");
        let mut b = [0u8; 4];
        b[..n as usize].copy_from_slice(&r.payload[16..16 + n as usize]);
        u32::from_le_bytes(b)
    };
    for sc in 0..SUBCHANNELS {
        assert_eq!(read(BAR0, sc_reg(sc, regs::STATE), 4), regs::STATE_IDLE, "{cut}: sc{sc} state");
        assert_eq!(read(BAR0, sc_reg(sc, regs::PROGRAMS), 4), 0, "{cut}: sc{sc} programs");
    }
    assert_eq!(read(CONFIG, 4, 2), 0, "{cut}: config command");
    assert_eq!(read(CONFIG, msix + 2, 2) & 0x8000, 0, "{cut}: MSI-X enable");
    drop(c);
    wait_served(h, served);
}

/// Waits until the server has taken the connection after the first `served` and cleaned it up.
fn wait_served(h: &Harness, served: u64) {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let info = h.info();
        if info.protocol.connections > served && !info.connected {
            return;
        }
        assert!(Instant::now() < deadline, "the server never finished with the client");
        std::thread::sleep(Duration::from_millis(1));
    }
}

#[test]
fn a_client_cut_anywhere_leaves_nothing_behind() {
    let h = Harness::with("ccw", Default::default(), |_| {});
    let msix = msix_cap(&h);
    let ram = common::memfd(RAM);
    let ram2 = common::memfd(1 << 20);
    lay_out_programs(&ram);
    let irqs: Vec<_> = (0..SUBCHANNELS)
        .map(|_| nix::sys::eventfd::EventFd::from_flags(nix::sys::eventfd::EfdFlags::EFD_NONBLOCK).unwrap())
        .collect();
    let irq_fds: Vec<RawFd> = irqs.iter().map(|e| e.as_raw_fd()).collect();
    let msgs = transcript(&ram, &ram2, &irq_fds, msix);

    // Replays messages [0, upto) whole, then `partial` bytes of message `upto` (with its fds),
    // then closes.
    // Returns whether subchannel 0 said it was busy when asked (STATE sc0): the cut then came
    // with a program in flight.
    let replay = |upto: usize, partial: usize| -> bool {
        let served = h.info().protocol.connections;
        let mut c = RawClient::connect(&h.socket).unwrap();
        let mut busy = false;
        for m in &msgs[..upto] {
            c.send_bytes(&m.bytes, &m.fds).unwrap();
            if let Some(id) = m.reply {
                let r = await_reply(&mut c, id, &m.what);
                if m.what == "STATE sc0" {
                    busy = r.payload[16..20] == regs::STATE_BUSY.to_le_bytes();
                }
            }
        }
        if partial > 0 {
            let m = &msgs[upto];
            c.send_bytes(&m.bytes[..partial], &m.fds).unwrap();
        }
        drop(c);
        wait_served(&h, served);
        busy
    };

    // The whole session once, and a checking client, to warm up (thread stacks, caches) and
    // take the baseline.
    replay(msgs.len(), 0);
    check_reset(&h, msix, "warm-up");
    let (fds0, maps0) = (common::open_fds(), maps_count());

    let started = Instant::now();
    let (mut cuts, mut in_flight) = (0, 0);
    for upto in 0..=msgs.len() {
        let mut partials = vec![0];
        if let Some(m) = msgs.get(upto) {
            // One byte, the header alone, half of the message, and all of it (reply unread).
            let len = m.bytes.len();
            partials.extend([1, HEADER_SIZE, len / 2].into_iter().filter(|&p| p > 0 && p < len));
            partials.push(len);
        }
        for partial in partials {
            let cut = match msgs.get(upto) {
                Some(m) if partial == m.bytes.len() => {
                    format!("cut after sending message {upto} ({})", m.what)
                }
                Some(m) if partial > 0 => format!("cut in message {upto} ({}) after {partial} bytes", m.what),
                Some(m) => format!("cut before message {upto} ({})", m.what),
                None => "cut after the last message".to_string(),
            };
            in_flight += usize::from(replay(upto, partial));
            let dma = h.info().dma;
            assert_eq!((dma.pins_held, dma.pinned_pages, dma.mappings), (0, 0, 0), "{cut}: {dma:?}");
            assert_eq!(dma.locked_bytes, 0, "{cut}");
            check_reset(&h, msix, &cut);
            assert_eq!(common::open_fds(), fds0, "{cut}: fds leaked");
            let (backed, anonymous) = maps_count();
            assert_eq!(backed, maps0.0, "{cut}: memory mappings leaked");
            assert!(anonymous <= maps0.1 + ALLOCATOR_SLACK, "{cut}: {anonymous} anonymous mappings");
            cuts += 1;
        }
    }
    let info = h.info();
    assert_eq!(info.protocol.rejected, 0, "a reconnecting client was turned away");
    // Some cuts came with programs running, and server-to-client DMA happened.
    assert!(in_flight > 0, "no cut found a program in flight");
    assert!(info.protocol.client_dma_requests > 0);
    eprintln!(
        "MEASURED cuts with a program in flight: {in_flight}; client DMA requests: {}",
        info.protocol.client_dma_requests
    );
    eprintln!("MEASURED {cuts} cuts over {} messages in {:.2?}", msgs.len(), started.elapsed());
    assert!(cuts > 4 * msgs.len());
    assert!(started.elapsed() < Duration::from_secs(120));
}
