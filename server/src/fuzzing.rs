//! The message decoder and dispatcher fed arbitrary byte streams, with fds, against a real
//! `testdev` and a real DMA space: the harness of the `dispatch` fuzz target
//! (`fuzz/fuzz_targets/dispatch.rs`) and of its corpus replay.
//!
//! For fuzzers and their corpus replay; not API. Compiled only with the `fuzzing` feature.
//!
//! [`dispatch`] cuts its input into chunks, each as one socket read would deliver it: bytes,
//! and fds of a few kinds ([`FdKind`]). Each chunk goes into a [`Framer`]; every whole
//! message is dispatched through a real `Session` exactly as the connection thread does,
//! until the input ends or the framer reports a fatal error (as the real connection, which
//! then disconnects). The harness then tears down as a disconnect does.
//!
//! The harness plays the client: it reads everything the server sends on the other end of a
//! socket pair and answers the device's DMA_READ/DMA_WRITE requests (correctly, with an
//! error, or malformed, as the input's first byte says). After each message it waits for the
//! device's DMA worker to go idle, so a run is deterministic. It panics unless:
//!
//! - every request that wants a reply gets exactly one, in order, with its id and command;
//!   error replies are bare headers with the error flag and an errno; a VERSION reply is no
//!   longer than the request; a region-info reply fits the request's `argsz`; replies whose
//!   length the request fixes (REGION_READ, DMA_UNMAP, ...) have that length;
//! - everything the server sends frames cleanly, and it sends no command but DMA_READ and
//!   DMA_WRITE;
//! - the device goes idle within a bound, and has dropped its pins when detached (the
//!   teardown's unmap succeeds);
//! - no fd the input brought is still open after the teardown: the harness keeps a duplicate
//!   of each and looks for any other fd on the same open file (`kcmp`). The fuzz target also
//!   checks the process's fd count around each run ([`open_fds`]).

use std::collections::VecDeque;
use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::linux::fs::MetadataExt;
use std::os::unix::net::UnixStream;
use std::sync::Arc;
use std::time::{Duration, Instant};

use umdev_mdev::samples::testdev;
use umdev_mdev::{DeviceContext, VfioDevice, VFIO_PCI_BAR0_REGION_INDEX};
use umdev_pinning::{DmaSpace, DmaSpaceConfig, LockAccount, PinMode, PAGE_SIZE};

use crate::link::{ClientDmaPort, Link};
use crate::session::{Session, SessionEnd};
use crate::socket::Receiver;
use crate::stats::ServerStats;
use crate::wire::framing::Framer;
use crate::wire::{flags, Command, Header, Limits, HEADER_SIZE};

/// Config bits 0-1: how the harness answers the device's DMA_READ/DMA_WRITE requests.
pub const CONFIG_CLIENT_DMA: u8 = 3;
/// Client DMA answers: correct (data for reads, address and count echoed for writes).
pub const CLIENT_DMA_OK: u8 = 0;
/// Client DMA answers: an error reply (EFAULT).
pub const CLIENT_DMA_ERROR: u8 = 1;
/// Client DMA answers: a reply of the wrong length.
pub const CLIENT_DMA_SHORT: u8 = 2;
/// Client DMA answers: reads answered for the wrong address, writes with a bare header.
pub const CLIENT_DMA_ODD: u8 = 3;
/// Config bit: a QEMU 11 VERSION request precedes the input's chunks.
pub const CONFIG_VERSION: u8 = 1 << 2;
/// Config bit: the DMA space pins in lock mode (64 KiB lock limit).
pub const CONFIG_LOCK: u8 = 1 << 3;
/// Config bit: small protocol limits ([`small_limits`]).
pub const CONFIG_SMALL_LIMITS: u8 = 1 << 4;

/// Most messages one input dispatches.
pub const MAX_FRAMES: usize = 256;
/// Most fds one input creates.
pub const MAX_FDS: usize = 64;
/// Most fds one chunk carries (more than the default `max_msg_fds` of 16).
pub const MAX_CHUNK_FDS: usize = 20;
/// How long the device may take to go idle after a message.
const SETTLE_LIMIT: Duration = Duration::from_secs(10);

/// QEMU 11.1's VERSION request payload (major, minor, JSON, NUL).
pub const QEMU_VERSION_JSON: &str = r#"{"capabilities": {"pgsizes": 4096, "max_msg_fds": 16, "max_dma_maps": 65535, "max_data_xfer_size": 1048576, "migration": {"max_bitmap_size": 268435456, "pgsize": 4096}, "write_multiple": true}}"#;

/// The limits [`CONFIG_SMALL_LIMITS`] selects.
pub fn small_limits() -> Limits {
    Limits {
        max_data_xfer_size: 4096,
        max_msg_fds: 4,
        max_dma_maps: 8,
        max_version_size: 1024,
        max_write_multi: 8,
    }
}

/// An fd a chunk carries. One byte each: kind in bits 0-1, argument in bits 2-7.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FdKind {
    /// A memfd of this many pages (0-63).
    Memfd(u8),
    /// An eventfd.
    Eventfd,
    /// One end of a pipe (the read end if true); the other end is closed.
    Pipe(bool),
    /// `/dev/null`.
    DevNull,
}

impl FdKind {
    /// The kind a byte names.
    pub fn from_byte(b: u8) -> FdKind {
        match b & 3 {
            0 => FdKind::Memfd(b >> 2),
            1 => FdKind::Eventfd,
            2 => FdKind::Pipe(b & 4 != 0),
            _ => FdKind::DevNull,
        }
    }

    /// The byte naming this kind.
    pub fn to_byte(self) -> u8 {
        match self {
            FdKind::Memfd(pages) => (pages & 63) << 2,
            FdKind::Eventfd => 1,
            FdKind::Pipe(read) => 2 | if read { 4 } else { 0 },
            FdKind::DevNull => 3,
        }
    }
}

/// What one socket read delivers: bytes and the fds that came with them.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Chunk {
    /// The bytes (at most 65535).
    pub bytes: Vec<u8>,
    /// The fds (at most [`MAX_CHUNK_FDS`]).
    pub fds: Vec<FdKind>,
}

/// Decodes an input: a config byte, then chunks, each `len u16 LE, nfds u8 (low 5 bits,
/// at most 20), nfds kind bytes, len bytes` (a short last chunk takes what is there).
pub fn decode(data: &[u8]) -> (u8, Vec<Chunk>) {
    let Some((&config, mut rest)) = data.split_first() else {
        return (0, Vec::new());
    };
    let mut chunks = Vec::new();
    while rest.len() >= 3 {
        let len = usize::from(u16::from_le_bytes([rest[0], rest[1]]));
        let nfds = usize::from(rest[2] & 0x1f).min(MAX_CHUNK_FDS);
        rest = &rest[3..];
        let nfds = nfds.min(rest.len());
        let fds = rest[..nfds].iter().map(|&b| FdKind::from_byte(b)).collect();
        rest = &rest[nfds..];
        let len = len.min(rest.len());
        chunks.push(Chunk { bytes: rest[..len].to_vec(), fds });
        rest = &rest[len..];
    }
    (config, chunks)
}

/// Encodes an input so that [`decode`] gives it back (chunks longer than 65535 bytes or
/// with more than [`MAX_CHUNK_FDS`] fds are cut).
pub fn encode(config: u8, chunks: &[Chunk]) -> Vec<u8> {
    let mut out = vec![config];
    for c in chunks {
        let len = c.bytes.len().min(u16::MAX as usize);
        let nfds = c.fds.len().min(MAX_CHUNK_FDS);
        out.extend_from_slice(&(len as u16).to_le_bytes());
        out.push(nfds as u8);
        out.extend(c.fds[..nfds].iter().map(|k| k.to_byte()));
        out.extend_from_slice(&c.bytes[..len]);
    }
    out
}

/// A whole message: header (size computed) and payload.
pub fn message(id: u16, command: u16, flags: u32, payload: &[u8]) -> Vec<u8> {
    let size = (HEADER_SIZE + payload.len()) as u32;
    let mut m = Header { id, command, size, flags, error: 0 }.encode().to_vec();
    m.extend_from_slice(payload);
    m
}

/// The QEMU VERSION request ([`QEMU_VERSION_JSON`]) as message `id`.
pub fn qemu_version(id: u16) -> Vec<u8> {
    let mut payload = vec![0, 0, 0, 0];
    payload.extend_from_slice(QEMU_VERSION_JSON.as_bytes());
    payload.push(0);
    message(id, Command::Version as u16, flags::TYPE_COMMAND, &payload)
}

/// fds open in this process now (for a fuzz target's leak check around [`dispatch`]; not
/// meaningful while other threads open or close fds).
pub fn open_fds() -> usize {
    std::fs::read_dir("/proc/self/fd").map_or(0, |d| d.count())
}

/// Runs one input through a session (see the module documentation). Panics on any
/// violation.
pub fn dispatch(data: &[u8]) {
    let (config, chunks) = decode(data);
    let mut harness = Harness::new(config);
    let mut frames = 0;
    let mut fds_made = 0;
    let mut chunks: VecDeque<Chunk> = chunks.into();
    if config & CONFIG_VERSION != 0 {
        chunks.push_front(Chunk { bytes: qemu_version(0), fds: Vec::new() });
    }
    'input: for chunk in chunks {
        let kinds = &chunk.fds[..chunk.fds.len().min(MAX_FDS - fds_made)];
        fds_made += kinds.len();
        if chunk.bytes.is_empty() {
            // A read never delivers fds without bytes (0 bytes is end of stream).
            continue;
        }
        let fds = kinds.iter().map(|&k| harness.tracker.make(k)).collect();
        harness.framer.push(&chunk.bytes, fds);
        loop {
            if frames == MAX_FRAMES {
                break 'input;
            }
            match harness.framer.next_frame() {
                Err(_) => break 'input,
                Ok(None) => break,
                Ok(Some(frame)) => {
                    frames += 1;
                    harness.handle(frame);
                }
            }
        }
    }
    harness.finish();
}

/// A reply the session owes.
struct Owed {
    header: Header,
    /// `argsz` of a region-info request.
    argsz: Option<u32>,
    /// Payload bytes a successful reply carries, where the request fixes them.
    reply_len: Option<usize>,
}

struct Harness {
    framer: Framer,
    session: Session,
    device: Arc<dyn VfioDevice>,
    dma: DmaSpace,
    link: Arc<Link>,
    /// The client's end of the socket pair.
    peer: UnixStream,
    peer_framer: Framer,
    receiver: Receiver,
    /// Synthesizes the client's replies to DMA requests.
    reply_framer: Framer,
    owed: VecDeque<Owed>,
    client_dma: u8,
    tracker: Tracker,
}

impl Harness {
    fn new(config: u8) -> Harness {
        let limits = if config & CONFIG_SMALL_LIMITS != 0 { small_limits() } else { Limits::default() };
        let mode = if config & CONFIG_LOCK != 0 { PinMode::Lock } else { PinMode::Track };
        let dma = DmaSpace::new(DmaSpaceConfig {
            max_mappings: limits.max_dma_maps as usize,
            mode,
            account: Arc::new(LockAccount::with_limit(16 * PAGE_SIZE)),
            unmap_timeout: Duration::from_millis(500),
            ..DmaSpaceConfig::default()
        });
        let device: Arc<dyn VfioDevice> = match testdev::create() {
            Ok(d) => Arc::new(d),
            Err(e) => panic!("creating a testdev: {e}"),
        };
        let (server, peer) = match UnixStream::pair() {
            Ok(pair) => pair,
            Err(e) => panic!("socketpair: {e}"),
        };
        // A reply that cannot be sent (the harness failed to drain) fails instead of hanging.
        if let Err(e) = server.set_write_timeout(Some(Duration::from_secs(5))) {
            panic!("socket timeout: {e}");
        }
        let stats = Arc::new(ServerStats::default());
        // As connection::serve: the link, the unmap notifier, the device attached.
        let link = Arc::new(Link::new(server, std::thread::current().id(), stats.clone()));
        let weak = Arc::downgrade(&device);
        dma.set_unmap_notifier(Some(Arc::new(move |iova, len| {
            if let Some(device) = weak.upgrade() {
                device.dma_unmap(iova, len);
            }
        })));
        device.attach(DeviceContext {
            dma: dma.clone(),
            client_dma: Arc::new(ClientDmaPort { link: link.clone() }),
        });
        let session = Session::new(device.clone(), dma.clone(), limits.clone(), link.clone(), stats);
        Harness {
            framer: Framer::new(limits.max_version_size, limits.max_msg_fds as usize),
            session,
            device,
            dma,
            link,
            peer,
            peer_framer: Framer::new(4 << 20, 16),
            receiver: Receiver::new(),
            reply_framer: Framer::new(4 << 20, 16),
            owed: VecDeque::new(),
            client_dma: config & CONFIG_CLIENT_DMA,
            tracker: Tracker::default(),
        }
    }

    /// Dispatches one message of the input, then waits for the device and checks the
    /// replies.
    fn handle(&mut self, frame: crate::wire::framing::Frame) {
        let header = frame.header;
        if header.message_type() != flags::TYPE_REPLY && !header.no_reply() {
            let payload = self.framer.payload(&frame);
            let u32_at =
                |at: usize| payload.get(at..at + 4).map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]));
            let argsz = (header.command == Command::DeviceGetRegionInfo as u16).then(|| u32_at(0)).flatten();
            let reply_len = match Command::from_u16(header.command) {
                Some(Command::RegionRead) => u32_at(12).map(|count| 16 + count as usize),
                Some(Command::RegionWrite) => Some(16),
                Some(Command::DmaUnmap) => Some(24),
                Some(Command::DeviceGetInfo | Command::DeviceGetIrqInfo | Command::DeviceGetRegionIoFds) => {
                    Some(16)
                }
                Some(Command::DmaMap | Command::DeviceSetIrqs | Command::DeviceReset) => Some(0),
                Some(Command::RegionWriteMulti) => Some(8),
                _ => None,
            };
            self.owed.push_back(Owed { header, argsz, reply_len });
        }
        let payload = self.framer.payload(&frame);
        if let Err(SessionEnd::Send(e)) = self.session.handle(frame, payload) {
            panic!("a reply could not be sent to a client that reads everything: {e}");
        }
        if let Some(max) = self.session.take_new_max_size() {
            self.framer.set_max_size(max);
        }
        self.settle();
        assert!(self.owed.is_empty(), "no reply to message {:?}", self.owed.front().map(|o| o.header));
    }

    /// Waits until the device's DMA worker is idle, serving its client DMA meanwhile.
    fn settle(&mut self) {
        let deadline = Instant::now() + SETTLE_LIMIT;
        loop {
            self.drain_peer();
            if !self.device_busy() {
                self.drain_peer();
                return;
            }
            assert!(Instant::now() < deadline, "the device did not go idle within {SETTLE_LIMIT:?}");
            std::thread::sleep(Duration::from_micros(20));
        }
    }

    fn device_busy(&self) -> bool {
        let mut status = [0u8; 4];
        match self.device.region_read(VFIO_PCI_BAR0_REGION_INDEX, testdev::regs::DMA_STATUS, &mut status) {
            Ok(()) => u32::from_le_bytes(status) == testdev::regs::STATUS_BUSY,
            Err(e) => panic!("reading DMA_STATUS: {e}"),
        }
    }

    /// Reads everything the server sent: checks replies, answers DMA requests.
    fn drain_peer(&mut self) {
        loop {
            match self.receiver.recv(&self.peer, &mut self.peer_framer, false) {
                Ok(0) => break,
                Ok(_) => {}
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) => panic!("reading the server's messages: {e}"),
            }
        }
        loop {
            let frame = match self.peer_framer.next_frame() {
                Ok(Some(frame)) => frame,
                Ok(None) => break,
                Err(e) => panic!("the server sent an unframeable message: {e}"),
            };
            let header = frame.header;
            let payload = self.peer_framer.payload(&frame).to_vec();
            match header.message_type() {
                flags::TYPE_REPLY => self.check_reply(&header, &payload),
                flags::TYPE_COMMAND => self.answer_dma(&header, &payload),
                other => panic!("the server sent a message of type {other}: {header:?}"),
            }
            // The frame's fds (a region fd) close here.
        }
    }

    fn check_reply(&mut self, reply: &Header, payload: &[u8]) {
        let Some(owed) = self.owed.pop_front() else {
            panic!("a reply nobody asked for: {reply:?}");
        };
        let request = owed.header;
        assert_eq!((reply.id, reply.command), (request.id, request.command), "reply out of order");
        if reply.is_error() {
            assert!(
                reply.size as usize == HEADER_SIZE
                    && reply.flags == flags::TYPE_REPLY | flags::ERROR
                    && reply.error != 0
                    && reply.error < 4096,
                "malformed error reply {reply:?} to {request:?}"
            );
            return;
        }
        assert!(
            reply.flags == flags::TYPE_REPLY && reply.error == 0,
            "malformed reply {reply:?} to {request:?}"
        );
        if request.command == Command::Version as u16 {
            assert!(
                reply.size <= request.size,
                "VERSION reply of {} bytes to a {}-byte request",
                reply.size,
                request.size
            );
        }
        if let Some(len) = owed.reply_len {
            assert_eq!(payload.len(), len, "reply payload to {request:?}");
        }
        if let Some(argsz) = owed.argsz {
            assert!(
                payload.len() <= argsz as usize,
                "region info of {} bytes for argsz {argsz}",
                payload.len()
            );
        }
    }

    /// Answers the device's DMA_READ/DMA_WRITE as the input's config says.
    fn answer_dma(&mut self, request: &Header, payload: &[u8]) {
        let is_read = request.command == Command::DmaRead as u16;
        assert!(
            is_read || request.command == Command::DmaWrite as u16,
            "the server sent command {} ({request:?})",
            request.command
        );
        assert!(payload.len() >= 16, "a DMA request of {} bytes", payload.len());
        let addr = u64::from_le_bytes(payload[0..8].try_into().unwrap_or_default());
        let count = u64::from_le_bytes(payload[8..16].try_into().unwrap_or_default());
        assert!(count as usize <= crate::link::CLIENT_DMA_CHUNK, "a DMA request of {count} bytes");
        if !is_read {
            assert_eq!(payload.len() as u64, 16 + count, "a DMA_WRITE whose count and data differ");
        }
        let mut reply =
            Header { id: request.id, command: request.command, size: 0, flags: flags::TYPE_REPLY, error: 0 };
        let mut body = Vec::new();
        let echo = |body: &mut Vec<u8>, addr: u64| {
            body.extend_from_slice(&addr.to_le_bytes());
            body.extend_from_slice(&count.to_le_bytes());
        };
        match (self.client_dma, is_read) {
            (CLIENT_DMA_ERROR, _) => {
                reply.flags |= flags::ERROR;
                reply.error = libc::EFAULT as u32;
            }
            (CLIENT_DMA_SHORT, _) => body.extend_from_slice(&payload[..8]),
            (CLIENT_DMA_ODD, false) => {}
            (mode, true) => {
                echo(&mut body, if mode == CLIENT_DMA_ODD { addr ^ 1 } else { addr });
                body.extend((0..count).map(|i| (addr.wrapping_add(i) as u8) ^ 0xa5));
            }
            (_, false) => echo(&mut body, addr),
        }
        reply.size = (HEADER_SIZE + body.len()) as u32;
        let mut bytes = reply.encode().to_vec();
        bytes.extend_from_slice(&body);
        self.reply_framer.push(&bytes, Vec::new());
        match self.reply_framer.next_frame() {
            Ok(Some(frame)) => {
                let payload = self.reply_framer.payload(&frame);
                if let Err(SessionEnd::Send(e)) = self.session.handle(frame, payload) {
                    panic!("handling the client's DMA reply: {e}");
                }
            }
            other => panic!("framing the client's DMA reply: {other:?}"),
        }
    }

    /// Tears down as a disconnect does, then checks that every fd the input brought is
    /// closed.
    fn finish(self) {
        let Harness { framer, session, device, dma, link, peer, mut tracker, .. } = self;
        // fds of a message the input left incomplete.
        drop(framer);
        link.close();
        device.detach();
        dma.set_unmap_notifier(None);
        if let Err(e) = dma.unmap_all() {
            dma.abandon_all();
            panic!("the device kept pins after detach: {e}");
        }
        drop(session);
        tracker.check_closed("after detach and unmap");
        drop(device);
        drop(link);
        drop(peer);
    }
}

/// The fds an input created: a duplicate of each, kept to recognise the open file (the
/// kernel's `struct file`) behind any fd the server still holds.
#[derive(Default)]
struct Tracker {
    /// `(device, inode)` of the file and the duplicate.
    dups: Vec<((u64, u64), OwnedFd)>,
}

impl Tracker {
    fn make(&mut self, kind: FdKind) -> OwnedFd {
        let made = match kind {
            FdKind::Memfd(pages) => {
                nix::sys::memfd::memfd_create(c"umdev-fuzz", nix::sys::memfd::MFdFlags::MFD_CLOEXEC)
                    .map_err(io::Error::from)
                    .and_then(|fd| {
                        let file = File::from(fd);
                        file.set_len(u64::from(pages) * PAGE_SIZE)?;
                        Ok(OwnedFd::from(file))
                    })
            }
            FdKind::Eventfd => nix::sys::eventfd::EventFd::from_flags(
                nix::sys::eventfd::EfdFlags::EFD_NONBLOCK | nix::sys::eventfd::EfdFlags::EFD_CLOEXEC,
            )
            .map(OwnedFd::from)
            .map_err(io::Error::from),
            FdKind::Pipe(read) => nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC)
                .map(|(r, w)| if read { r } else { w })
                .map_err(io::Error::from),
            FdKind::DevNull => File::open("/dev/null").map(OwnedFd::from),
        };
        let fd = made.unwrap_or_else(|e| panic!("creating {kind:?}: {e}"));
        let dup = fd.try_clone().unwrap_or_else(|e| panic!("dup: {e}"));
        let id = file_id(dup.as_raw_fd()).unwrap_or_else(|| panic!("fstat of {kind:?} failed"));
        self.dups.push((id, dup));
        fd
    }

    /// Panics if any fd other than the duplicates refers to a file the input brought.
    fn check_closed(&mut self, when: &str) {
        if self.dups.is_empty() {
            return;
        }
        let ours: Vec<i32> = self.dups.iter().map(|(_, d)| d.as_raw_fd()).collect();
        let Ok(dir) = std::fs::read_dir("/proc/self/fd") else { return };
        for entry in dir.flatten() {
            let Some(fd) = entry.file_name().to_str().and_then(|s| s.parse::<i32>().ok()) else { continue };
            if ours.contains(&fd) {
                continue;
            }
            let Some(id) = file_id(fd) else { continue };
            for (dup_id, dup) in &self.dups {
                if *dup_id == id && same_file(fd, dup.as_raw_fd()) {
                    panic!(
                        "fd {fd} ({:?}) from the input is still open {when}",
                        std::fs::read_link(entry.path())
                    );
                }
            }
        }
        self.dups.clear();
    }
}

/// `(device, inode)` of the file behind `fd`, if it is open.
fn file_id(fd: i32) -> Option<(u64, u64)> {
    let m = std::fs::metadata(format!("/proc/self/fd/{fd}")).ok()?;
    Some((m.st_dev(), m.st_ino()))
}

/// Whether two fds of this process refer to the same open file (`kcmp(KCMP_FILE)`); false
/// if the kernel cannot tell.
fn same_file(a: i32, b: i32) -> bool {
    const KCMP_FILE: libc::c_long = 0;
    let pid = libc::c_long::from(std::process::id() as i32);
    // SAFETY: kcmp only compares kernel objects of the given process; it reads no memory of
    // ours and changes nothing.
    let r = unsafe {
        libc::syscall(libc::SYS_kcmp, pid, pid, KCMP_FILE, libc::c_long::from(a), libc::c_long::from(b))
    };
    r == 0
}

/// Hand-made seeds: realistic sessions and known hostile shapes, as `(name, input)`. The
/// corpus replay runs them besides the corpus files; `tests/fuzz_corpus.rs` can write them
/// into `fuzz/corpus/dispatch/`.
pub fn seeds() -> Vec<(&'static str, Vec<u8>)> {
    seeds::all()
}

mod seeds {
    use super::*;
    use crate::wire::request::UNMAP_FLAG_ALL;
    use umdev_mdev::{VFIO_PCI_CONFIG_REGION_INDEX, VFIO_PCI_MSIX_IRQ_INDEX};

    const BAR0: u32 = VFIO_PCI_BAR0_REGION_INDEX;
    const CONFIG: u32 = VFIO_PCI_CONFIG_REGION_INDEX;
    const RAM: u64 = 0x10_0000;
    const MSG_RAM: u64 = 0x20_0000;

    /// Builds a message stream, one chunk per message unless told otherwise.
    #[derive(Default)]
    struct Stream {
        id: u16,
        chunks: Vec<Chunk>,
    }

    fn le(parts: &[&[u8]]) -> Vec<u8> {
        parts.concat()
    }

    impl Stream {
        fn push(&mut self, command: Command, flags: u32, payload: &[u8], fds: Vec<FdKind>) -> &mut Self {
            self.id = self.id.wrapping_add(1);
            self.chunks.push(Chunk { bytes: message(self.id, command as u16, flags, payload), fds });
            self
        }
        fn cmd(&mut self, command: Command, payload: &[u8]) -> &mut Self {
            self.push(command, flags::TYPE_COMMAND, payload, Vec::new())
        }
        fn version(&mut self) -> &mut Self {
            self.id = self.id.wrapping_add(1);
            self.chunks.push(Chunk { bytes: qemu_version(self.id), fds: Vec::new() });
            self
        }
        fn map(&mut self, iova: u64, size: u64, prot: u32, fd: Option<FdKind>) -> &mut Self {
            let p = le(&[
                &32u32.to_le_bytes(),
                &prot.to_le_bytes(),
                &0u64.to_le_bytes(),
                &iova.to_le_bytes(),
                &size.to_le_bytes(),
            ]);
            self.push(Command::DmaMap, flags::TYPE_COMMAND, &p, fd.into_iter().collect())
        }
        fn unmap(&mut self, iova: u64, size: u64, flags: u32) -> &mut Self {
            let p =
                le(&[&24u32.to_le_bytes(), &flags.to_le_bytes(), &iova.to_le_bytes(), &size.to_le_bytes()]);
            self.cmd(Command::DmaUnmap, &p)
        }
        fn read(&mut self, region: u32, offset: u64, count: u32) -> &mut Self {
            let p = le(&[&offset.to_le_bytes(), &region.to_le_bytes(), &count.to_le_bytes()]);
            self.cmd(Command::RegionRead, &p)
        }
        fn write(&mut self, region: u32, offset: u64, data: &[u8], posted: bool) -> &mut Self {
            let p =
                le(&[&offset.to_le_bytes(), &region.to_le_bytes(), &(data.len() as u32).to_le_bytes(), data]);
            let f = flags::TYPE_COMMAND | if posted { flags::NO_REPLY } else { 0 };
            self.push(Command::RegionWrite, f, &p, Vec::new())
        }
        fn reg(&mut self, offset: u64, value: u32) -> &mut Self {
            self.write(BAR0, offset, &value.to_le_bytes(), false)
        }
        fn set_irqs(
            &mut self,
            index: u32,
            flags: u32,
            start: u32,
            count: u32,
            data: &[u8],
            fds: Vec<FdKind>,
        ) -> &mut Self {
            let p = le(&[
                &(20 + data.len() as u32).to_le_bytes(),
                &flags.to_le_bytes(),
                &index.to_le_bytes(),
                &start.to_le_bytes(),
                &count.to_le_bytes(),
                data,
            ]);
            self.push(Command::DeviceSetIrqs, crate::wire::flags::TYPE_COMMAND, &p, fds)
        }
        /// A testdev DMA command on `[addr, addr + len)`.
        fn dma(&mut self, cmd: u32, addr: u64, len: u32) -> &mut Self {
            use testdev::regs::*;
            self.reg(DMA_ADDR_LO, addr as u32)
                .reg(DMA_ADDR_HI, (addr >> 32) as u32)
                .reg(DMA_LEN, len)
                .reg(DMA_PATTERN, 0x5a)
                .reg(DMA_CMD, cmd)
                .read(BAR0, DMA_STATUS, 4)
                .read(BAR0, DMA_RESULT, 4)
        }
        fn bytes(&self, config: u8) -> Vec<u8> {
            encode(config, &self.chunks)
        }
        /// The whole stream cut into reads of at most `n` bytes. A read also ends with each
        /// message that carries fds, which come with it: the kernel ends a read after the
        /// first segment with fds.
        fn resplit(&self, config: u8, n: usize) -> Vec<u8> {
            let mut out = Vec::new();
            for c in &self.chunks {
                let pieces: Vec<&[u8]> = c.bytes.chunks(n).collect();
                for (i, piece) in pieces.iter().enumerate() {
                    let fds = if i + 1 == pieces.len() { c.fds.clone() } else { Vec::new() };
                    out.push(Chunk { bytes: piece.to_vec(), fds });
                }
            }
            // Glue fd-less pieces together up to `n` bytes, as a read would.
            let mut glued: Vec<Chunk> = Vec::new();
            for c in out {
                match glued.last_mut() {
                    Some(last) if last.fds.is_empty() && last.bytes.len() + c.bytes.len() <= n => {
                        last.bytes.extend_from_slice(&c.bytes);
                        last.fds = c.fds;
                    }
                    _ => glued.push(c),
                }
            }
            encode(config, &glued)
        }
    }

    /// What QEMU does at realize: VERSION, device and region info, IRQ info, config space.
    fn realize(s: &mut Stream) {
        s.version();
        s.cmd(Command::DeviceGetInfo, &le(&[&16u32.to_le_bytes(), &[0; 12]]));
        for index in 0..9u32 {
            let p = le(&[&32u32.to_le_bytes(), &0u32.to_le_bytes(), &index.to_le_bytes(), &[0; 20]]);
            s.cmd(Command::DeviceGetRegionInfo, &p);
        }
        // BAR1 again with room for its sparse-mmap capability (the reply carries the fd).
        s.cmd(
            Command::DeviceGetRegionInfo,
            &le(&[&64u32.to_le_bytes(), &0u32.to_le_bytes(), &1u32.to_le_bytes(), &[0; 20]]),
        );
        for index in 0..5u32 {
            s.cmd(
                Command::DeviceGetIrqInfo,
                &le(&[&16u32.to_le_bytes(), &0u32.to_le_bytes(), &index.to_le_bytes(), &0u32.to_le_bytes()]),
            );
        }
        s.cmd(
            Command::DeviceGetRegionIoFds,
            &le(&[&16u32.to_le_bytes(), &0u32.to_le_bytes(), &1u32.to_le_bytes(), &0u32.to_le_bytes()]),
        );
        s.read(CONFIG, 0, 64).read(CONFIG, 0x40, 192);
        // BAR sizing, then addresses, then memory, I/O and bus master on.
        for bar in 0..3u64 {
            s.write(CONFIG, 0x10 + 4 * bar, &u32::MAX.to_le_bytes(), false).read(CONFIG, 0x10 + 4 * bar, 4);
        }
        s.write(CONFIG, 0x10, &0xfe00_0000u32.to_le_bytes(), false);
        s.write(CONFIG, 0x04, &7u16.to_le_bytes(), false);
    }

    /// Offset of the capability `id` in testdev's config space.
    fn capability(id: u8) -> u64 {
        let Ok(dev) = testdev::create() else { return 0 };
        let mut config = [0u8; 256];
        if dev.region_read(CONFIG, 0, &mut config).is_err() {
            return 0;
        }
        let mut at = usize::from(config[0x34]);
        for _ in 0..48 {
            if at == 0 || at + 1 >= config.len() {
                break;
            }
            if config[at] == id {
                return at as u64;
            }
            at = usize::from(config[at + 1]);
        }
        0
    }

    pub(super) fn all() -> Vec<(&'static str, Vec<u8>)> {
        use testdev::regs::*;
        let mut seeds = Vec::new();

        // A QEMU-like session: realize, guest RAM as a memfd and a message-only region, MSI-X
        // on eventfds, DMA both ways through pins and through the client, posted writes,
        // WRITE_MULTI, unmap, reset.
        let msix = capability(0x11);
        let mut s = Stream::default();
        realize(&mut s);
        s.map(RAM, 16 * PAGE_SIZE, 3, Some(FdKind::Memfd(16)));
        s.map(MSG_RAM, 16 * PAGE_SIZE, 3, None);
        s.set_irqs(VFIO_PCI_MSIX_IRQ_INDEX, 0x24, 0, 2, &[], vec![FdKind::Eventfd, FdKind::Eventfd]);
        s.write(CONFIG, msix + 2, &0x8000u16.to_le_bytes(), false);
        s.write(BAR0, 0x800, &0xfee0_0000u64.to_le_bytes(), false);
        s.write(BAR0, 0x808, &le(&[&0x4021u32.to_le_bytes(), &0u32.to_le_bytes()]), false);
        s.reg(SCRATCH, 0x1234_5678).read(BAR0, SCRATCH, 4).read(BAR0, ID, 8);
        s.dma(CMD_FILL, RAM + 0x800, 3 * 4096).dma(CMD_CHECKSUM, RAM, 16 * 4096);
        s.dma(CMD_FILL, MSG_RAM + 100, 70_000).dma(CMD_CHECKSUM, MSG_RAM, 8192);
        s.write(BAR0, IRQ_RAISE, &1u32.to_le_bytes(), true).read(BAR0, IRQ_COUNT, 4).read(BAR0, ISR, 4);
        let multi: Vec<u8> = [(SCRATCH, 1u32), (DMA_LEN, 16), (DMA_PATTERN, 3)]
            .iter()
            .flat_map(|&(off, v)| {
                le(&[&off.to_le_bytes(), &BAR0.to_le_bytes(), &4u32.to_le_bytes(), &v.to_le_bytes(), &[0; 4]])
            })
            .collect();
        s.cmd(Command::RegionWriteMulti, &le(&[&3u64.to_le_bytes(), &multi]));
        s.write(1, 4096, b"bar1 second page", false)
            .read(1, 4090, 32)
            .write(2, 0, &9u32.to_le_bytes(), false)
            .read(2, 0, 4);
        s.unmap(MSG_RAM, 16 * PAGE_SIZE, 0).unmap(RAM, 16 * PAGE_SIZE, 0);
        s.cmd(Command::DeviceReset, &[]);
        s.map(RAM, 4 * PAGE_SIZE, 1, Some(FdKind::Memfd(4))).dma(CMD_FILL, RAM, 100).dma(
            CMD_CHECKSUM,
            RAM,
            100,
        );
        s.unmap(0, 0, UNMAP_FLAG_ALL);
        seeds.push(("qemu-session", s.bytes(CLIENT_DMA_OK)));
        seeds.push(("qemu-session-split-7", s.resplit(CLIENT_DMA_OK, 7)));
        seeds.push(("qemu-session-client-dma-errors", s.bytes(CLIENT_DMA_ERROR)));
        seeds.push((
            "qemu-session-small-limits-lock",
            s.bytes(CLIENT_DMA_ODD | CONFIG_SMALL_LIMITS | CONFIG_LOCK),
        ));

        // QEMU's reset burst: an fd-less DMA_UNMAP and a DMA_MAP with its fd in one read.
        let mut s = Stream::default();
        s.version().map(RAM, 4 * PAGE_SIZE, 3, Some(FdKind::Memfd(4)));
        let mut burst = Stream { id: s.id, ..Default::default() };
        burst.unmap(RAM, 4 * PAGE_SIZE, 0).map(RAM, 8 * PAGE_SIZE, 3, Some(FdKind::Memfd(8)));
        s.id = burst.id;
        s.chunks.push(Chunk {
            bytes: burst.chunks.iter().flat_map(|c| c.bytes.clone()).collect(),
            fds: burst.chunks.iter().flat_map(|c| c.fds.clone()).collect(),
        });
        s.dma(CMD_FILL, RAM + 4 * 4096, 4096);
        seeds.push(("reset-burst", s.bytes(CLIENT_DMA_OK)));

        // Hostile shapes: fds where none belong, too many fds, fds that are not what they
        // should be, a mapping past the memfd's end, bad types and commands, a stray reply,
        // commands before VERSION and VERSION twice, then a header that ends the stream.
        let mut s = Stream::default();
        s.read(BAR0, 0, 4);
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
        s.map(RAM, 8 * PAGE_SIZE, 3, Some(FdKind::Memfd(2)));
        s.map(RAM, PAGE_SIZE, 3, Some(FdKind::DevNull));
        s.map(RAM, PAGE_SIZE, 3, Some(FdKind::Eventfd));
        s.push(Command::DmaMap, flags::TYPE_COMMAND, &[0; 32], vec![FdKind::Memfd(1), FdKind::Memfd(1)]);
        s.push(Command::DeviceGetInfo, 7, &[0; 16], Vec::new());
        s.push(Command::DmaRead, flags::TYPE_COMMAND, &[0; 16], Vec::new());
        s.push(Command::DmaWrite, flags::TYPE_REPLY, &[0; 16], Vec::new());
        s.cmd(Command::DeviceFeature, &[0; 8]).cmd(Command::MigDataRead, &[0; 8]);
        s.chunks.push(Chunk {
            bytes: message(99, 99, flags::TYPE_COMMAND, &[1, 2, 3]),
            fds: vec![FdKind::Memfd(1)],
        });
        let mut fatal = message(100, Command::RegionWrite as u16, 0, &[]);
        fatal[4..8].copy_from_slice(&u32::MAX.to_le_bytes());
        s.chunks.push(Chunk { bytes: fatal, fds: vec![FdKind::Eventfd] });
        seeds.push(("hostile", s.bytes(CLIENT_DMA_SHORT)));

        // INTx and MSI: eventfds, mask/unmask, raise, read ISR, de-assign.
        let msi = capability(0x05);
        let mut s = Stream::default();
        s.version();
        s.set_irqs(0, 0x24, 0, 1, &[], vec![FdKind::Eventfd]);
        s.set_irqs(0, 0x08 | 0x01, 0, 1, &[], Vec::new()).set_irqs(0, 0x10 | 0x01, 0, 1, &[], Vec::new());
        s.reg(IRQ_RAISE, 1).read(BAR0, ISR, 4).set_irqs(0, 0x22, 0, 1, &[1], Vec::new());
        s.set_irqs(1, 0x24, 0, 1, &[], vec![FdKind::Eventfd]).write(
            CONFIG,
            msi + 2,
            &1u16.to_le_bytes(),
            false,
        );
        s.reg(IRQ_RAISE, 1).set_irqs(1, 0x24, 0, 0, &[], Vec::new()).set_irqs(0, 0x21, 0, 0, &[], Vec::new());
        s.cmd(Command::DeviceReset, &[]);
        seeds.push(("irqs", s.bytes(CLIENT_DMA_OK)));

        seeds
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn inputs_round_trip() {
        let chunks = vec![
            Chunk { bytes: qemu_version(1), fds: vec![] },
            Chunk {
                bytes: vec![1, 2, 3],
                fds: vec![FdKind::Memfd(5), FdKind::Eventfd, FdKind::Pipe(true), FdKind::DevNull],
            },
        ];
        assert_eq!(decode(&encode(7, &chunks)), (7, chunks));
    }

    #[test]
    fn the_fd_check_finds_a_kept_fd_of_each_kind() {
        for kind in
            [FdKind::Memfd(1), FdKind::Eventfd, FdKind::Pipe(true), FdKind::Pipe(false), FdKind::DevNull]
        {
            let mut tracker = Tracker::default();
            let kept = tracker.make(kind);
            let dropped = tracker.make(kind);
            drop(dropped);
            let found =
                std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| tracker.check_closed("now")));
            assert!(found.is_err(), "{kind:?} kept open but not found");
            drop(kept);
            let mut tracker = Tracker::default();
            drop(tracker.make(kind));
            tracker.check_closed("after closing");
        }
    }

    #[test]
    fn seeds_dispatch() {
        for (name, seed) in seeds() {
            eprintln!("seed {name}");
            dispatch(&seed);
        }
    }

    #[test]
    fn any_bytes_dispatch() {
        for len in 0..100 {
            let data: Vec<u8> = (0..len).map(|i| (i * 77 + len) as u8).collect();
            dispatch(&data);
        }
    }
}
