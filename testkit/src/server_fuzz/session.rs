//! The real connection code over a real socket: the harness of the `session` fuzz target
//! (`fuzz/fuzz_targets/session.rs`) and of its corpus replay.
//!
//! [`run`] starts a fresh `testdev` or ccw device and the real `serve()` (the connection
//! thread's whole life: attach, receive, frame, dispatch, tear down) on one end of a socket
//! pair, in its own thread. The harness is the client on the other end: one thread sends the
//! input's chunks, each in one `sendmsg` with its fds as SCM_RIGHTS, without waiting for
//! replies; another reads everything the server sends (and never answers its DMA requests).
//! Then the client shuts its side and waits for the server to finish. Unlike [`dispatch`],
//! the device runs concurrently with the client, so a run is not exactly reproducible; the
//! checks do not depend on timing.
//!
//! Input: as [`decode`] reads it. Config byte: bit 0 ([`CONFIG_MAP`]) prepends a DMA_MAP of
//! the harness's guest RAM (a memfd of [`GUEST_SIZE`] bytes at [`GUEST_IOVA`], read-write),
//! bit 1 ([`CONFIG_CCW`]) picks the ccw device (2 subchannels, a 64 KiB store) instead of
//! testdev, bits 2-4 as for every harness (VERSION first, lock mode, small limits). Chunk
//! flags: [`FLAG_GUEST_RAM`] also passes the guest RAM memfd (last); [`FLAG_MEMORY`] makes
//! the chunk a write into guest RAM instead of a send.
//!
//! It panics unless:
//!
//! - the server finishes within [`DEADLINE`] of the client closing, its thread is joined and
//!   neither server thread nor client reader panicked;
//! - everything the server sends frames cleanly as whole messages (none cut at the end), its
//!   commands are well-formed DMA_READ/DMA_WRITE, and its replies pass the checks every
//!   harness makes (each request that wants one gets exactly one reply, in order; error
//!   replies are bare headers with an errno; fixed reply lengths; an fd only with region
//!   info; nothing but VERSION succeeds before VERSION);
//! - the connection ends early only on a framing error, exactly where the client's stream
//!   has one, and the server handled every byte the client sent up to there; it never ends
//!   on an I/O error;
//! - after the connection, the DMA space has no mappings, pins or locked memory;
//! - once the client is gone, no fd the input brought is open anywhere in the process
//!   (`kcmp`, as `dispatch`) and the process's lasting fds are as many as with the device
//!   alone, no more (a leak) and no fewer (an fd closed twice); once the device is dropped,
//!   as many as before the run. Lasting: `/proc` and `/sys` files, which threads open and
//!   close at once, are left out (see `lasting_fds`).
//!
//! The fd counts are process-wide: callers must not run anything else that opens or closes
//! fds at the same time (the corpus replay serialises its tests).
//!
//! [`dispatch`]: super::dispatch()
//! [`decode`]: super::decode

use std::fs::File;
use std::io::{self, IoSlice};
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::os::unix::fs::FileExt;
use std::os::unix::net::UnixStream;
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use nix::sys::socket::{sendmsg, ControlMessage, MsgFlags};
use umdev_devices::{ccw, testdev};
use umdev_mdev::VfioDevice;

use super::{
    check_dma_request, decode, dma_map_payload, dma_space, encode, le, limits, memfd, message, qemu_version,
    settle_fds, Chunk, FdKind, Replies, Stream, Tracker, CONFIG_LOCK, CONFIG_SMALL_LIMITS, CONFIG_VERSION,
    MAX_FDS,
};
use umdev_server::internals::Receiver;
use umdev_server::internals::{serve, Disconnect, Served};
use umdev_server::wire::framing::{Framer, FramingError};
use umdev_server::wire::{flags, Command, Header, Limits};
use umdev_server::ServerStats;

/// Config bit: a DMA_MAP of the guest RAM ([`GUEST_SIZE`] bytes at [`GUEST_IOVA`]) precedes
/// the input's chunks (after VERSION if [`CONFIG_VERSION`]).
pub const CONFIG_MAP: u8 = 1;
/// Config bit: the ccw device instead of testdev.
pub const CONFIG_CCW: u8 = 2;
/// Chunk flag: the guest RAM memfd goes with the chunk, after its other fds.
pub const FLAG_GUEST_RAM: u8 = 1;
/// Chunk flag: the chunk is a write into guest RAM, not a send. Its first two bytes (LE),
/// times 4, are the offset; the rest are the bytes (cut at the end of guest RAM).
pub const FLAG_MEMORY: u8 = 4;

/// Bytes of the harness's guest RAM.
pub const GUEST_SIZE: u64 = 256 << 10;
/// Where [`CONFIG_MAP`] maps it.
pub const GUEST_IOVA: u64 = 0x10_0000;
/// How long the server may take to finish once the client has shut its side (under the
/// libFuzzer `-timeout` of the documented run command, so a hang reports as this panic).
pub const DEADLINE: Duration = Duration::from_secs(20);
/// How long a send may block before the server counts as no longer reading.
const SEND_TIMEOUT: Duration = Duration::from_secs(10);
/// How long fds the client passed may outlive the connection (device threads finishing a
/// cancelled job drop their context a moment later): a hang guard, long enough for a loaded
/// machine; a check returns as soon as they are closed.
const FD_GRACE: Duration = Duration::from_secs(30);
/// How long a DMA_UNMAP waits for pins.
const UNMAP_TIMEOUT: Duration = Duration::from_millis(100);

/// What the client read: for each message, its header, payload length and fd count.
type Received = Vec<(Header, usize, usize)>;

/// Runs one input (see the module documentation). Panics on any violation.
pub fn run(data: &[u8]) {
    let (config, chunks) = decode(data);
    let limits = limits(config);
    let mut prefix = Vec::new();
    if config & CONFIG_VERSION != 0 {
        prefix.push(Chunk { bytes: qemu_version(0xfff0), ..Chunk::default() });
    }
    if config & CONFIG_MAP != 0 {
        let map = dma_map_payload(GUEST_IOVA, GUEST_SIZE, 3);
        let bytes = message(0xfff1, Command::DmaMap as u16, flags::TYPE_COMMAND, &map);
        prefix.push(Chunk { bytes, fds: Vec::new(), flags: FLAG_GUEST_RAM });
    }

    let before = super::lasting_fds().len();
    let device = make_device(config & CONFIG_CCW != 0);
    let with_device = super::lasting_fds();
    let mut tracker = Tracker::default();
    let ram = memfd(GUEST_SIZE).unwrap_or_else(|e| panic!("guest RAM: {e}"));
    tracker.track(&ram);
    let (client, server) = UnixStream::pair().unwrap_or_else(|e| panic!("socketpair: {e}"));
    if let Err(e) = client.set_write_timeout(Some(SEND_TIMEOUT)) {
        panic!("socket timeout: {e}");
    }
    let dma = dma_space(config, &limits, UNMAP_TIMEOUT);
    let stats = Arc::new(ServerStats::default());
    let served = Served {
        device: device.clone(),
        dma: dma.clone(),
        limits: limits.clone(),
        stats: stats.clone(),
        busy_poll: Duration::ZERO,
    };
    let (done_tx, done_rx) = mpsc::channel();
    let server_thread = spawn("fuzz-server", move || {
        let end = serve(server, &served);
        let _ = done_tx.send(());
        (end, served)
    });
    let reader = client.try_clone().unwrap_or_else(|e| panic!("dup of the client socket: {e}"));
    let reader_thread = spawn("fuzz-client-reader", move || read_all(reader));

    let mut sent = Vec::new();
    let mut fds_made = 0;
    for chunk in prefix.iter().chain(&chunks) {
        if chunk.flags & FLAG_MEMORY != 0 {
            write_memory(&ram, &chunk.bytes);
            continue;
        }
        let kinds = &chunk.fds[..chunk.fds.len().min(MAX_FDS - fds_made)];
        fds_made += kinds.len();
        if chunk.bytes.is_empty() {
            // A stream socket carries no fds without bytes.
            continue;
        }
        let mut fds: Vec<OwnedFd> = kinds.iter().map(|&k| tracker.make(k)).collect();
        if chunk.flags & FLAG_GUEST_RAM != 0 {
            fds.push(ram.try_clone().map(OwnedFd::from).unwrap_or_else(|e| panic!("dup of guest RAM: {e}")));
        }
        let n = send(&client, &chunk.bytes, &fds);
        // The fds are the server's now (or were closed with an unread message).
        drop(fds);
        sent.extend_from_slice(&chunk.bytes[..n]);
        if n < chunk.bytes.len() {
            break;
        }
    }
    let _ = client.shutdown(std::net::Shutdown::Write);
    if let Err(mpsc::RecvTimeoutError::Timeout) = done_rx.recv_timeout(DEADLINE) {
        panic!("the server did not finish within {DEADLINE:?} of the client closing");
    }
    let (end, served) = server_thread.join().unwrap_or_else(|p| std::panic::resume_unwind(p));
    let received = reader_thread.join().unwrap_or_else(|p| std::panic::resume_unwind(p));

    check_replies(&sent, &received, &limits, &end, &stats);
    let space = dma.stats();
    assert!(
        space.mappings == 0 && space.pins_held == 0 && space.pinned_pages == 0 && space.locked_bytes == 0,
        "after the connection the DMA space still has {space:?}"
    );

    drop(served);
    drop(dma);
    drop(client);
    drop(ram);
    let own = tracker.len();
    settle_fds(with_device.len() + own, FD_GRACE, || {
        format!(
            "after the client left, the fds open are not those with the device alone and the \
             harness's own {own} (with the device alone: {})",
            super::fd_listing(&with_device)
        )
    });
    tracker.check_closed("after the client left");
    let start = Instant::now();
    while Arc::strong_count(&device) > 1 {
        assert!(start.elapsed() < FD_GRACE, "the device is still referenced after the connection");
        std::thread::sleep(Duration::from_millis(1));
    }
    drop(device);
    settle_fds(before, FD_GRACE, || "after the device was dropped".into());
}

fn spawn<T: Send + 'static>(
    name: &str,
    f: impl FnOnce() -> T + Send + 'static,
) -> std::thread::JoinHandle<T> {
    std::thread::Builder::new().name(name.into()).spawn(f).unwrap_or_else(|e| panic!("spawning {name}: {e}"))
}

fn make_device(ccw_device: bool) -> Arc<dyn VfioDevice> {
    if ccw_device {
        let store = ccw::Store::ram(64 << 10).unwrap_or_else(|e| panic!("ccw store: {e}"));
        match ccw::create(ccw::CcwConfig { subchannels: 2, store }) {
            Ok(d) => Arc::new(d),
            Err(e) => panic!("creating a ccw device: {e}"),
        }
    } else {
        match testdev::create() {
            Ok(d) => Arc::new(d),
            Err(e) => panic!("creating a testdev: {e}"),
        }
    }
}

/// A [`FLAG_MEMORY`] chunk: writes into guest RAM.
fn write_memory(ram: &File, bytes: &[u8]) {
    let (offset, bytes) = match bytes {
        [lo, hi, rest @ ..] => ((u64::from(u16::from_le_bytes([*lo, *hi])) * 4).min(GUEST_SIZE), rest),
        _ => return,
    };
    let n = bytes.len().min((GUEST_SIZE - offset) as usize);
    if let Err(e) = ram.write_all_at(&bytes[..n], offset) {
        panic!("writing guest RAM: {e}");
    }
}

/// Sends `bytes` with `fds` on the first byte; returns how many bytes went (fewer once the
/// server is gone).
fn send(stream: &UnixStream, bytes: &[u8], fds: &[OwnedFd]) -> usize {
    let raw: Vec<RawFd> = fds.iter().map(|f| f.as_raw_fd()).collect();
    let mut sent = 0;
    while sent < bytes.len() {
        let rights = [ControlMessage::ScmRights(&raw)];
        let cmsgs: &[ControlMessage<'_>] = if sent == 0 && !raw.is_empty() { &rights } else { &[] };
        match sendmsg::<()>(
            stream.as_raw_fd(),
            &[IoSlice::new(&bytes[sent..])],
            cmsgs,
            MsgFlags::MSG_NOSIGNAL,
            None,
        ) {
            Ok(n) => sent += n,
            Err(nix::errno::Errno::EINTR) => {}
            Err(nix::errno::Errno::EAGAIN) => panic!("the server stopped reading for {SEND_TIMEOUT:?}"),
            Err(_) => break,
        }
    }
    sent
}

/// Reads everything the server sends until it closes, as the server reads: checks that it
/// frames as whole messages and that the server's requests are well-formed DMA requests;
/// closes the fds that come; returns the messages.
fn read_all(stream: UnixStream) -> Received {
    let mut receiver = Receiver::new();
    let mut framer = Framer::new(4 << 20, 16);
    let mut received = Vec::new();
    loop {
        let n = match receiver.recv(&stream, &mut framer, true) {
            Ok(n) => n,
            // The server closed with bytes of ours unread.
            Err(e) if e.kind() == io::ErrorKind::ConnectionReset => 0,
            Err(e) => panic!("reading the server's messages: {e}"),
        };
        loop {
            let frame = match framer.next_frame() {
                Ok(Some(frame)) => frame,
                Ok(None) => break,
                Err(e) => panic!("the server sent an unframeable message: {e}"),
            };
            let header = frame.header;
            let payload = framer.payload(&frame);
            match header.message_type() {
                flags::TYPE_REPLY => {
                    received.push((header, payload.len(), frame.fds.len() + frame.excess_fds))
                }
                flags::TYPE_COMMAND => {
                    check_dma_request(&header, payload);
                    assert!(frame.fds.is_empty() && frame.excess_fds == 0, "fds with {header:?}");
                }
                other => panic!("the server sent a message of type {other}: {header:?}"),
            }
            // The frame's fds (a region's) close here.
        }
        if n == 0 {
            assert_eq!(framer.buffered(), 0, "the server's last message was cut short");
            return received;
        }
    }
}

/// Checks the replies against the requests the server must have framed from `sent`, and
/// how the connection ended.
fn check_replies(sent: &[u8], received: &Received, limits: &Limits, end: &Disconnect, stats: &ServerStats) {
    let mut replies = Replies::new(limits);
    let mut received = received.iter();
    let mut framer = Framer::new(limits.max_version_size, 0);
    framer.push(sent, Vec::new());
    let mut framed = 0u64;
    let mut fatal = false;
    let handled = stats.snapshot().bytes_in;
    loop {
        match framer.next_frame() {
            Ok(Some(frame)) => {
                framed += u64::from(frame.header.size);
                replies.request(frame.header, framer.payload(&frame));
                if let Some(request) = replies.first_owed() {
                    let Some((reply, len, nfds)) = received.next() else {
                        panic!("no reply to {request:?} (the connection ended: {end})");
                    };
                    if replies.reply(reply, *len, *nfds) {
                        framer.set_max_size(limits.max_message_size());
                    }
                }
            }
            Ok(None) => break,
            Err(FramingError::TooLarge { size, .. })
                if replies.maybe_negotiated()
                    && size <= limits.max_message_size()
                    && !(matches!(end, Disconnect::Framing(_)) && handled == framed) =>
            {
                // Too large before negotiation, not after; the server went on, so the posted
                // VERSION negotiated.
                replies.negotiated();
                framer.set_max_size(limits.max_message_size());
            }
            Err(e) => {
                assert!(matches!(end, Disconnect::Framing(_)), "framing error {e} but the end was: {end}");
                fatal = true;
                break;
            }
        }
    }
    if let Some(extra) = received.next() {
        panic!("a reply to nothing: {extra:?}");
    }
    match end {
        Disconnect::Closed => {}
        Disconnect::Framing(e) => assert!(fatal, "the server ended on {e}, which the stream does not have"),
        Disconnect::Io(e) => panic!("the connection failed: {e}"),
    }
    assert_eq!(stats.snapshot().fatal, u64::from(fatal), "fatal errors counted");
    assert_eq!(handled, framed, "bytes the server handled, of those framed");
}

/// Hand-made seeds: QEMU-like sessions on both devices and known hostile shapes, as `(name,
/// input)`. The corpus replay runs them besides the corpus files; `tests/fuzz_corpus.rs` can
/// write them into `fuzz/corpus/session/`.
pub fn seeds() -> Vec<(&'static str, Vec<u8>)> {
    use testdev::regs::*;
    use umdev_mdev::{VFIO_PCI_BAR0_REGION_INDEX as BAR0, VFIO_PCI_MSIX_IRQ_INDEX};
    use umdev_pinning::PAGE_SIZE;
    use umdev_server::wire::request::UNMAP_FLAG_ALL;

    const MSG_RAM: u64 = 0x4000_0000;
    let mut seeds = Vec::new();

    // QEMU with testdev: realize, guest RAM (the harness's memfd) and a message-only region,
    // MSI-X on eventfds, DMA through pins, posted writes, WRITE_MULTI, BAR1 and BAR2, a DMA
    // through the client (which never answers: the disconnect must end it), unmap, reset.
    let msix = super::testdev_capability(0x11);
    let mut s = Stream::default();
    s.realize();
    s.map(GUEST_IOVA, GUEST_SIZE, 3, None).flagged(FLAG_GUEST_RAM);
    s.map(MSG_RAM, 16 * PAGE_SIZE, 3, None);
    s.set_irqs(VFIO_PCI_MSIX_IRQ_INDEX, 0x24, 0, 2, &[], vec![FdKind::Eventfd, FdKind::Eventfd]);
    s.write(umdev_mdev::VFIO_PCI_CONFIG_REGION_INDEX, msix + 2, &0x8000u16.to_le_bytes(), false);
    s.reg(SCRATCH, 0x1234_5678).read(BAR0, SCRATCH, 4).read(BAR0, ID, 8);
    s.dma(CMD_FILL, GUEST_IOVA + 0x800, 3 * 4096).dma(CMD_CHECKSUM, GUEST_IOVA, 16 * 4096);
    s.write(BAR0, IRQ_RAISE, &1u32.to_le_bytes(), true).read(BAR0, IRQ_COUNT, 4);
    let multi: Vec<u8> = [(SCRATCH, 1u32), (DMA_LEN, 16)]
        .iter()
        .flat_map(|&(off, v)| {
            le(&[&off.to_le_bytes(), &BAR0.to_le_bytes(), &4u32.to_le_bytes(), &v.to_le_bytes(), &[0; 4]])
        })
        .collect();
    s.cmd(Command::RegionWriteMulti, &le(&[&2u64.to_le_bytes(), &multi]));
    s.write(1, 4096, b"bar1 second page", false).read(1, 4090, 32).write(2, 0, &9u32.to_le_bytes(), false);
    s.unmap(GUEST_IOVA, GUEST_SIZE, 0).cmd(Command::DeviceReset, &[]);
    s.map(GUEST_IOVA, 4 * PAGE_SIZE, 1, None).flagged(FLAG_GUEST_RAM).dma(CMD_CHECKSUM, GUEST_IOVA, 100);
    s.dma(CMD_FILL, MSG_RAM, 8192);
    seeds.push(("testdev-qemu", s.bytes(0)));
    seeds.push(("testdev-qemu-lock-small-limits", s.bytes(CONFIG_LOCK | CONFIG_SMALL_LIMITS)));
    seeds.push(("testdev-qemu-split-7", s.resplit(0, 7)));
    // Everything in one send, every fd on its first byte: they go to the message the
    // server's read ends in.
    seeds.push(("testdev-qemu-one-send", encode(0, &[s.glued()])));
    let mut s2 = Stream::from_id(s.id);
    s2.unmap(0, 0, UNMAP_FLAG_ALL);
    seeds.push(("testdev-qemu-unmap-all", encode(0, &[s.chunks.clone(), s2.chunks].concat())));

    // Hostile: commands before VERSION, VERSION twice, fds where none belong, more fds than
    // allowed, a pipe and /dev/null for an eventfd, a mapping past its memfd's end, a stray
    // reply, an unknown type, then a header that ends the stream followed by messages with
    // fds the server must never read.
    let mut s = Stream::default();
    s.read(BAR0, 0, 4).dma(CMD_FILL, GUEST_IOVA, 16);
    s.version().version();
    s.push(
        Command::DeviceGetInfo,
        flags::TYPE_COMMAND,
        &le(&[&16u32.to_le_bytes(), &[0; 12]]),
        vec![FdKind::Pipe(false)],
    );
    s.set_irqs(VFIO_PCI_MSIX_IRQ_INDEX, 0x24, 0, 20, &[], vec![FdKind::Eventfd; 20]);
    s.set_irqs(0, 0x24, 0, 1, &[], vec![FdKind::Pipe(true)]);
    s.set_irqs(0, 0x24, 0, 1, &[], vec![FdKind::DevNull]);
    s.map(0x20_0000, 8 * PAGE_SIZE, 3, Some(FdKind::Memfd(2)));
    s.map(0x30_0000, PAGE_SIZE, 3, Some(FdKind::Eventfd));
    s.push(Command::DmaMap, flags::TYPE_COMMAND, &[0; 32], vec![FdKind::Memfd(1), FdKind::Memfd(1)]);
    s.push(Command::DmaRead, flags::TYPE_REPLY, &[0; 16], Vec::new());
    s.push(Command::DeviceGetInfo, 7, &[0; 16], vec![FdKind::Eventfd]);
    let mut fatal = message(100, Command::RegionWrite as u16, 0, &[]);
    fatal[4..8].copy_from_slice(&u32::MAX.to_le_bytes());
    s.chunks.push(Chunk { bytes: fatal, fds: vec![FdKind::Eventfd], flags: 0 });
    s.set_irqs(0, 0x24, 0, 1, &[], vec![FdKind::Eventfd]);
    seeds.push(("testdev-hostile", s.bytes(CONFIG_SMALL_LIMITS)));

    // The client goes mid-message: half a DMA_MAP with its memfd, and half a header.
    let mut s = Stream::default();
    s.version().map(GUEST_IOVA, GUEST_SIZE, 3, None).flagged(FLAG_GUEST_RAM);
    let mut last = s.chunks.pop().unwrap_or_default();
    last.bytes.truncate(30);
    last.fds = vec![FdKind::Memfd(1), FdKind::Eventfd];
    s.chunks.push(last);
    seeds.push(("testdev-partial-message", s.bytes(0)));
    seeds.push((
        "testdev-partial-header",
        encode(CONFIG_VERSION, &[Chunk { bytes: vec![1; 9], ..Chunk::default() }]),
    ));

    // A posted VERSION (NO_REPLY) gets no reply, even on error: the client can tell only from
    // what follows whether it negotiated. Valid, then a message too large before negotiation
    // but not after; invalid, then the same message, which ends the connection.
    for (name, json) in [("posted-version", super::QEMU_VERSION_JSON), ("posted-version-invalid", "{")] {
        let mut s = Stream::default();
        let version = le(&[&[0; 4], json.as_bytes(), &[0]]);
        s.push(Command::Version, flags::TYPE_COMMAND | flags::NO_REPLY, &version, Vec::new());
        s.write(BAR0, SCRATCH, &[0; 2000], false).read(BAR0, ID, 4);
        seeds.push((name, s.bytes(CONFIG_SMALL_LIMITS)));
    }

    // ccw: a program in guest RAM, started on subchannel 0 and halted; the same started on
    // subchannel 1 and left running into an unmap and the disconnect.
    let ccw_run = {
        use crate::ccw_driver::{layout, Data, Op};
        use ccw::program::cmd;
        use ccw::regs::*;
        let base = GUEST_IOVA;
        let ops = [
            Op::new(cmd::WRITE, 512, Data::Direct(base + 0x3000)),
            Op::new(cmd::SEEK, 8, Data::Direct(base + 0x900)),
            Op::new(cmd::READ, 6000, Data::Idaws(vec![base + 0x5f00, base + 0x9000])),
            Op::new(cmd::SENSE, 32, Data::Direct(base + 0xa00)),
            Op::new(cmd::NOP, 1, Data::Direct(0)),
        ];
        let memory = |off: u64, bytes: &[u8]| Chunk {
            bytes: le(&[&((off / 4) as u16).to_le_bytes(), bytes]),
            fds: Vec::new(),
            flags: FLAG_MEMORY,
        };
        let mut s = Stream::default();
        let program = layout(base + 0x1000, base + 0x2000, &ops);
        s.chunks.extend(program.iter().map(|(a, b)| memory(a - base, b)));
        s.chunks.push(memory(0x900, &[0; 8]));
        s.read(BAR0, ID, 4);
        for sub in 0..2 {
            let sc = |reg: u64| SUBCHANNEL_BASE + sub * SUBCHANNEL_STRIDE + reg;
            s.reg(sc(CPA_LO), base as u32 + 0x1000).reg(sc(CPA_HI), 0);
            s.reg(sc(STATUS_LO), base as u32 + 0x800 + sub as u32 * 0x40).reg(sc(DOORBELL), DOORBELL_START);
            s.read(BAR0, sc(STATE), 4).read(BAR0, sc(REASON), 4);
            if sub == 0 {
                s.reg(sc(DOORBELL), DOORBELL_HALT).reg(sc(ACK), 1);
            }
        }
        s.unmap(GUEST_IOVA, GUEST_SIZE, 0);
        s
    };
    seeds.push(("ccw-program", ccw_run.bytes(CONFIG_VERSION | CONFIG_MAP | CONFIG_CCW)));
    seeds.push(("ccw-program-lock", ccw_run.bytes(CONFIG_VERSION | CONFIG_MAP | CONFIG_CCW | CONFIG_LOCK)));
    seeds.push(("empty", Vec::new()));
    seeds
}
