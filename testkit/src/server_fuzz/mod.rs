//! Harnesses for fuzzers and their corpus replay: arbitrary bytes in, the real server code
//! driven, a panic on any broken invariant. Compiled only with the `fuzzing` feature; not API.
//!
//! - [`dispatch()`] (fuzz target `dispatch`): the framer and a real `Session`, no socket; the
//!   harness plays the client one message at a time, so a run is deterministic.
//! - [`session::run`] (fuzz target `session`): the real connection code (`serve`) on its own
//!   thread over a socket pair, fds sent as SCM_RIGHTS, a client that sends the whole input
//!   without waiting and a second client thread that reads everything the server sends.
//!
//! Both read the same input format ([`decode`]): a config byte, then chunks, each what one
//! socket read delivers (`dispatch`) or one `sendmsg` sends (`session`): bytes, and fds of a
//! few kinds ([`FdKind`]). Config bits 2-4 mean the same to both ([`CONFIG_VERSION`],
//! [`CONFIG_LOCK`], [`CONFIG_SMALL_LIMITS`]); bits 0-1 are each harness's own. They share the
//! message builders, the checks on replies (`Replies`) and on fds (`Tracker`, [`open_fds`]),
//! and the builder their seeds are written with.

use std::collections::{BTreeMap, VecDeque};
use std::fs::File;
use std::io;
use std::os::fd::{AsFd, AsRawFd, OwnedFd, RawFd};
use std::os::linux::fs::MetadataExt;
use std::sync::Arc;
use std::time::{Duration, Instant};

use umdev_devices::testdev;
use umdev_mdev::VFIO_PCI_BAR0_REGION_INDEX;
use umdev_pinning::{DmaSpace, DmaSpaceConfig, LockAccount, PinMode, PAGE_SIZE};

use umdev_server::wire::{flags, Command, Header, Limits, HEADER_SIZE};

mod dispatch;
pub mod session;

pub use dispatch::{
    dispatch, seeds, CLIENT_DMA_ERROR, CLIENT_DMA_ODD, CLIENT_DMA_OK, CLIENT_DMA_SHORT, CONFIG_CLIENT_DMA,
    MAX_FRAMES,
};

/// Config bit: a QEMU 11 VERSION request precedes the input's chunks.
pub const CONFIG_VERSION: u8 = 1 << 2;
/// Config bit: the DMA space pins in lock mode (64 KiB lock limit).
pub const CONFIG_LOCK: u8 = 1 << 3;
/// Config bit: small protocol limits ([`small_limits`]).
pub const CONFIG_SMALL_LIMITS: u8 = 1 << 4;

/// Most fds one input creates.
pub const MAX_FDS: usize = 64;
/// Most fds one chunk carries (more than the default `max_msg_fds` of 16).
pub const MAX_CHUNK_FDS: usize = 20;

/// QEMU 11.1's VERSION request payload (major, minor, JSON, NUL).
pub const QEMU_VERSION_JSON: &str = umdev_server::wire::version::QEMU_11_CAPABILITIES;

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

/// The limits a config byte selects.
fn limits(config: u8) -> Limits {
    if config & CONFIG_SMALL_LIMITS != 0 {
        small_limits()
    } else {
        Limits::default()
    }
}

/// The DMA space a config byte selects: as many mappings as the limits allow, track or lock
/// mode, a 16-page lock limit.
fn dma_space(config: u8, limits: &Limits, unmap_timeout: Duration) -> DmaSpace {
    DmaSpace::new(DmaSpaceConfig {
        max_mappings: limits.max_dma_maps as usize,
        mode: if config & CONFIG_LOCK != 0 { PinMode::Lock } else { PinMode::Track },
        account: Arc::new(LockAccount::with_limit(16 * PAGE_SIZE)),
        unmap_timeout,
        ..DmaSpaceConfig::default()
    })
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

/// What one socket read delivers (or one `sendmsg` sends): bytes and the fds that come with
/// them.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Chunk {
    /// The bytes (at most 65535).
    pub bytes: Vec<u8>,
    /// The fds (at most [`MAX_CHUNK_FDS`]).
    pub fds: Vec<FdKind>,
    /// Three bits for the harness (`dispatch` ignores them; `session`: `session::FLAG_*`).
    pub flags: u8,
}

/// Decodes an input: a config byte, then chunks, each `len u16 LE, nfds u8 (low 5 bits,
/// at most 20; bits 5-7 the chunk's flags), nfds kind bytes, len bytes` (a short last chunk
/// takes what is there).
pub fn decode(data: &[u8]) -> (u8, Vec<Chunk>) {
    let Some((&config, mut rest)) = data.split_first() else {
        return (0, Vec::new());
    };
    let mut chunks = Vec::new();
    while rest.len() >= 3 {
        let len = usize::from(u16::from_le_bytes([rest[0], rest[1]]));
        let nfds = usize::from(rest[2] & 0x1f).min(MAX_CHUNK_FDS);
        let flags = rest[2] >> 5;
        rest = &rest[3..];
        let nfds = nfds.min(rest.len());
        let fds = rest[..nfds].iter().map(|&b| FdKind::from_byte(b)).collect();
        rest = &rest[nfds..];
        let len = len.min(rest.len());
        chunks.push(Chunk { bytes: rest[..len].to_vec(), fds, flags });
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
        out.push(nfds as u8 | (c.flags & 7) << 5);
        out.extend(c.fds[..nfds].iter().map(|k| k.to_byte()));
        out.extend_from_slice(&c.bytes[..len]);
    }
    out
}

/// A whole message: header (size computed) and payload.
pub fn message(id: u16, command: u16, flags: u32, payload: &[u8]) -> Vec<u8> {
    let header = Header { id, command, size: (HEADER_SIZE + payload.len()) as u32, flags, error: 0 };
    [&header.encode()[..], payload].concat()
}

/// The QEMU VERSION request ([`QEMU_VERSION_JSON`]) as message `id`.
pub fn qemu_version(id: u16) -> Vec<u8> {
    let mut payload = vec![0, 0, 0, 0];
    payload.extend_from_slice(QEMU_VERSION_JSON.as_bytes());
    payload.push(0);
    message(id, Command::Version as u16, flags::TYPE_COMMAND, &payload)
}

/// A DMA_MAP request's payload.
fn dma_map_payload(iova: u64, size: u64, prot: u32) -> Vec<u8> {
    use vm_memory::{ByteValued, Le32, Le64};
    let map = umdev_server::wire::structs::DmaMap {
        argsz: Le32::from(size_of::<umdev_server::wire::structs::DmaMap>() as u32),
        flags: Le32::from(prot),
        offset: Le64::from(0),
        addr: Le64::from(iova),
        size: Le64::from(size),
    };
    map.as_slice().to_vec()
}

/// fds open in this process now (for a leak check around a harness run; not meaningful
/// while other threads open or close fds).
pub fn open_fds() -> usize {
    std::fs::read_dir("/proc/self/fd").map_or(0, |d| d.count())
}

/// This process's fds that last, by number, with what each is: leaving out an fd closed
/// while it is listed (its link no longer reads) and those on `/proc` or `/sys`, which the
/// process's threads open and close at once: a queue worker reads its scheduler counts from
/// `/proc/thread-self/schedstat` as it starts and after waits, the DMA space reads
/// `/proc/sys/vm/max_map_count` once. A count taken just as a new device's workers start
/// saw one of those (CI, twice: one fd fewer after the session than with the device alone).
pub(crate) fn lasting_fds() -> BTreeMap<RawFd, String> {
    let Ok(dir) = std::fs::read_dir("/proc/self/fd") else { return BTreeMap::new() };
    dir.flatten()
        .filter_map(|e| {
            let fd = e.file_name().to_str()?.parse::<RawFd>().ok()?;
            let target = std::fs::read_link(e.path()).ok()?.display().to_string();
            (!target.starts_with("/proc/") && !target.starts_with("/sys/")).then_some((fd, target))
        })
        .collect()
}

/// A listing of `fds` for a panic message.
pub(crate) fn fd_listing(fds: &BTreeMap<RawFd, String>) -> String {
    fds.iter().map(|(fd, target)| format!("{fd} -> {target}")).collect::<Vec<_>>().join(", ")
}

/// A reply the server owes.
struct Owed {
    header: Header,
    /// `argsz` of a region-info request.
    argsz: Option<u32>,
    /// Payload bytes a successful reply carries, where the request fixes them.
    reply_len: Option<usize>,
}

/// Whether the server has negotiated, as far as the client can tell.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Negotiation {
    /// No VERSION can have succeeded.
    No,
    /// A posted VERSION (NO_REPLY: the server answers nothing, even on error) may have.
    Maybe,
    /// A VERSION succeeded.
    Yes,
}

/// The replies a client is owed, in order, and the checks on each reply.
struct Replies {
    owed: VecDeque<Owed>,
    /// Largest message the server may send.
    max_size: u32,
    negotiation: Negotiation,
}

impl Replies {
    fn new(limits: &Limits) -> Replies {
        Replies { owed: VecDeque::new(), max_size: limits.max_message_size(), negotiation: Negotiation::No }
    }

    /// Notes a message the server has framed: it owes a reply unless the message is a reply
    /// or a command that asks for none.
    fn request(&mut self, header: Header, payload: &[u8]) {
        let command = header.message_type() == flags::TYPE_COMMAND;
        if command && header.no_reply() && header.command == Command::Version as u16 {
            // The server may have negotiated without a word; its next success will tell.
            if self.negotiation == Negotiation::No {
                self.negotiation = Negotiation::Maybe;
            }
        }
        if header.message_type() == flags::TYPE_REPLY || header.no_reply() {
            return;
        }
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

    /// The first request still owed a reply.
    fn first_owed(&self) -> Option<Header> {
        self.owed.front().map(|o| o.header)
    }

    /// Checks the server's next reply, of `payload_len` bytes after the header and with
    /// `nfds` fds; true if it shows the server negotiated just now or, after a posted
    /// VERSION, earlier (the message size limit rises).
    fn reply(&mut self, reply: &Header, payload_len: usize, nfds: usize) -> bool {
        let Some(owed) = self.owed.pop_front() else {
            panic!("a reply nobody asked for: {reply:?}");
        };
        let request = owed.header;
        assert_eq!((reply.id, reply.command), (request.id, request.command), "reply out of order");
        assert!(reply.size <= self.max_size, "a reply of {} bytes: {reply:?}", reply.size);
        if reply.is_error() {
            assert!(
                reply.size as usize == HEADER_SIZE
                    && reply.flags == flags::TYPE_REPLY | flags::ERROR
                    && reply.error != 0
                    && reply.error < 4096
                    && nfds == 0,
                "malformed error reply {reply:?} ({nfds} fds) to {request:?}"
            );
            return false;
        }
        assert!(
            reply.flags == flags::TYPE_REPLY && reply.error == 0,
            "malformed reply {reply:?} to {request:?}"
        );
        // Only a region's info carries an fd: the region's, for the client to mmap.
        let region_info = request.command == Command::DeviceGetRegionInfo as u16;
        assert!(nfds <= usize::from(region_info), "{nfds} fds with the reply to {request:?}");
        if let Some(len) = owed.reply_len {
            assert_eq!(payload_len, len, "reply payload to {request:?}");
        }
        if let Some(argsz) = owed.argsz {
            assert!(payload_len <= argsz as usize, "region info of {payload_len} bytes for argsz {argsz}");
        }
        let before = self.negotiation;
        if request.command == Command::Version as u16 {
            assert!(before != Negotiation::Yes, "VERSION accepted twice: {request:?}");
            assert!(
                reply.size <= request.size,
                "VERSION reply of {} bytes to a {}-byte request",
                reply.size,
                request.size
            );
        } else {
            assert!(before != Negotiation::No, "{request:?} succeeded before VERSION");
        }
        self.negotiation = Negotiation::Yes;
        before != Negotiation::Yes
    }

    /// Whether a posted VERSION may have negotiated, unknown to the client.
    fn maybe_negotiated(&self) -> bool {
        self.negotiation == Negotiation::Maybe
    }

    /// The server's behaviour shows that a posted VERSION negotiated.
    fn negotiated(&mut self) {
        self.negotiation = Negotiation::Yes;
    }
}

/// Checks a DMA_READ/DMA_WRITE the server sent the client; returns whether it reads, the
/// address and the count.
fn check_dma_request(request: &Header, payload: &[u8]) -> (bool, u64, u64) {
    let is_read = request.command == Command::DmaRead as u16;
    assert!(
        is_read || request.command == Command::DmaWrite as u16,
        "the server sent command {} ({request:?})",
        request.command
    );
    assert!(request.flags == flags::TYPE_COMMAND && request.error == 0, "malformed request {request:?}");
    assert!(payload.len() >= 16, "a DMA request of {} bytes", payload.len());
    let addr = u64::from_le_bytes(payload[0..8].try_into().unwrap_or_default());
    let count = u64::from_le_bytes(payload[8..16].try_into().unwrap_or_default());
    assert!(count as usize <= umdev_server::CLIENT_DMA_CHUNK, "a DMA request of {count} bytes");
    if is_read {
        assert_eq!(payload.len(), 16, "a DMA_READ with data");
    } else {
        assert_eq!(payload.len() as u64, 16 + count, "a DMA_WRITE whose count and data differ");
    }
    (is_read, addr, count)
}

/// A memfd of `size` bytes.
fn memfd(size: u64) -> io::Result<File> {
    let fd = nix::sys::memfd::memfd_create(c"umdev-fuzz", nix::sys::memfd::MFdFlags::MFD_CLOEXEC)?;
    let file = File::from(fd);
    file.set_len(size)?;
    Ok(file)
}

/// The fds an input created: a duplicate of each, kept to recognise the open file (the
/// kernel's `struct file`) behind any fd the server still holds.
#[derive(Default)]
struct Tracker {
    /// `(device, inode)` of the file and the duplicate.
    dups: Vec<((u64, u64), OwnedFd)>,
}

impl Tracker {
    /// Creates an fd of `kind`, tracked.
    fn make(&mut self, kind: FdKind) -> OwnedFd {
        let made = match kind {
            FdKind::Memfd(pages) => memfd(u64::from(pages) * PAGE_SIZE).map(OwnedFd::from),
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
        self.track(&fd);
        fd
    }

    /// Tracks the open file behind `fd`.
    fn track(&mut self, fd: &impl AsFd) {
        let dup = fd.as_fd().try_clone_to_owned().unwrap_or_else(|e| panic!("dup: {e}"));
        let id = file_id(dup.as_raw_fd()).unwrap_or_else(|| panic!("fstat of fd {} failed", dup.as_raw_fd()));
        self.dups.push((id, dup));
    }

    /// fds the tracker holds.
    fn len(&self) -> usize {
        self.dups.len()
    }

    /// Panics if any fd other than the duplicates refers to a file the input brought; then
    /// closes the duplicates.
    fn check_closed(&mut self, when: &str) {
        if self.dups.is_empty() {
            return;
        }
        // Fds whose close could wait on someone (`/dev/null` here) are closed on the server's
        // closer threads: done within moments, as nothing here waits.
        assert!(
            umdev_server::client_fd::wait_closed(Duration::from_secs(60)),
            "the server's closers did not close the input's fds {when}"
        );
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

/// Waits up to `grace` for the process's lasting fds ([`lasting_fds`]) to be exactly `want`
/// in number: more is a leak; fewer is an fd of the device's or the harness's closed by
/// someone else (a double close). Panics with `what()` and the listing if neither settles.
fn settle_fds(want: usize, grace: Duration, what: impl Fn() -> String) {
    let start = Instant::now();
    loop {
        let now = lasting_fds();
        if now.len() == want {
            return;
        }
        assert!(
            start.elapsed() < grace,
            "{}: {} fds open, {want} expected: {}",
            what(),
            now.len(),
            fd_listing(&now)
        );
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// Builds seeds: a message stream, one chunk per message unless told otherwise.
#[derive(Default)]
struct Stream {
    id: u16,
    chunks: Vec<Chunk>,
}

/// Concatenates little-endian fields.
fn le(parts: &[&[u8]]) -> Vec<u8> {
    parts.concat()
}

impl Stream {
    /// Ids continue from `id`.
    fn from_id(id: u16) -> Stream {
        Stream { id, chunks: Vec::new() }
    }
    fn push(&mut self, command: Command, flags: u32, payload: &[u8], fds: Vec<FdKind>) -> &mut Self {
        self.id = self.id.wrapping_add(1);
        self.chunks.push(Chunk { bytes: message(self.id, command as u16, flags, payload), fds, flags: 0 });
        self
    }
    fn cmd(&mut self, command: Command, payload: &[u8]) -> &mut Self {
        self.push(command, flags::TYPE_COMMAND, payload, Vec::new())
    }
    /// The last chunk gets chunk flags `flags`.
    fn flagged(&mut self, flags: u8) -> &mut Self {
        if let Some(last) = self.chunks.last_mut() {
            last.flags = flags;
        }
        self
    }
    fn version(&mut self) -> &mut Self {
        self.id = self.id.wrapping_add(1);
        self.chunks.push(Chunk { bytes: qemu_version(self.id), ..Chunk::default() });
        self
    }
    fn map(&mut self, iova: u64, size: u64, prot: u32, fd: Option<FdKind>) -> &mut Self {
        self.push(
            Command::DmaMap,
            flags::TYPE_COMMAND,
            &dma_map_payload(iova, size, prot),
            fd.into_iter().collect(),
        )
    }
    fn unmap(&mut self, iova: u64, size: u64, flags: u32) -> &mut Self {
        let p = le(&[&24u32.to_le_bytes(), &flags.to_le_bytes(), &iova.to_le_bytes(), &size.to_le_bytes()]);
        self.cmd(Command::DmaUnmap, &p)
    }
    fn read(&mut self, region: u32, offset: u64, count: u32) -> &mut Self {
        let p = le(&[&offset.to_le_bytes(), &region.to_le_bytes(), &count.to_le_bytes()]);
        self.cmd(Command::RegionRead, &p)
    }
    fn write(&mut self, region: u32, offset: u64, data: &[u8], posted: bool) -> &mut Self {
        let p = le(&[&offset.to_le_bytes(), &region.to_le_bytes(), &(data.len() as u32).to_le_bytes(), data]);
        let f = flags::TYPE_COMMAND | if posted { flags::NO_REPLY } else { 0 };
        self.push(Command::RegionWrite, f, &p, Vec::new())
    }
    /// A 32-bit write to BAR0.
    fn reg(&mut self, offset: u64, value: u32) -> &mut Self {
        self.write(VFIO_PCI_BAR0_REGION_INDEX, offset, &value.to_le_bytes(), false)
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
        self.push(Command::DeviceSetIrqs, umdev_server::wire::flags::TYPE_COMMAND, &p, fds)
    }
    /// What QEMU does at realize: VERSION, device and region info, IRQ info, config space.
    fn realize(&mut self) -> &mut Self {
        const CONFIG: u32 = umdev_mdev::VFIO_PCI_CONFIG_REGION_INDEX;
        self.version();
        self.cmd(Command::DeviceGetInfo, &le(&[&16u32.to_le_bytes(), &[0; 12]]));
        for index in 0..9u32 {
            let p = le(&[&32u32.to_le_bytes(), &0u32.to_le_bytes(), &index.to_le_bytes(), &[0; 20]]);
            self.cmd(Command::DeviceGetRegionInfo, &p);
        }
        // BAR1 again with room for its sparse-mmap capability (the reply carries the fd).
        self.cmd(
            Command::DeviceGetRegionInfo,
            &le(&[&64u32.to_le_bytes(), &0u32.to_le_bytes(), &1u32.to_le_bytes(), &[0; 20]]),
        );
        for index in 0..5u32 {
            self.cmd(
                Command::DeviceGetIrqInfo,
                &le(&[&16u32.to_le_bytes(), &0u32.to_le_bytes(), &index.to_le_bytes(), &0u32.to_le_bytes()]),
            );
        }
        self.cmd(
            Command::DeviceGetRegionIoFds,
            &le(&[&16u32.to_le_bytes(), &0u32.to_le_bytes(), &1u32.to_le_bytes(), &0u32.to_le_bytes()]),
        );
        self.read(CONFIG, 0, 64).read(CONFIG, 0x40, 192);
        // BAR sizing, then addresses, then memory, I/O and bus master on.
        for bar in 0..3u64 {
            self.write(CONFIG, 0x10 + 4 * bar, &u32::MAX.to_le_bytes(), false).read(
                CONFIG,
                0x10 + 4 * bar,
                4,
            );
        }
        self.write(CONFIG, 0x10, &0xfe00_0000u32.to_le_bytes(), false);
        self.write(CONFIG, 0x04, &7u16.to_le_bytes(), false)
    }
    /// A testdev DMA command on `[addr, addr + len)`, then its status and result read back.
    fn dma(&mut self, cmd: u32, addr: u64, len: u32) -> &mut Self {
        use testdev::regs::*;
        self.reg(DMA_ADDR_LO, addr as u32)
            .reg(DMA_ADDR_HI, (addr >> 32) as u32)
            .reg(DMA_LEN, len)
            .reg(DMA_PATTERN, 0x5a)
            .reg(DMA_CMD, cmd)
            .read(VFIO_PCI_BAR0_REGION_INDEX, DMA_STATUS, 4)
            .read(VFIO_PCI_BAR0_REGION_INDEX, DMA_RESULT, 4)
    }
    /// All the chunks' bytes and fds as one chunk (one read, one `sendmsg`).
    fn glued(&self) -> Chunk {
        Chunk {
            bytes: self.chunks.iter().flat_map(|c| c.bytes.clone()).collect(),
            fds: self.chunks.iter().flat_map(|c| c.fds.clone()).collect(),
            flags: 0,
        }
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
                out.push(Chunk { bytes: piece.to_vec(), fds, flags: 0 });
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

/// Offset of the capability `id` in testdev's config space.
fn testdev_capability(id: u8) -> u64 {
    let Ok(dev) = testdev::create() else { return 0 };
    let mut config = [0u8; 256];
    if umdev_mdev::VfioDevice::region_read(&dev, umdev_mdev::VFIO_PCI_CONFIG_REGION_INDEX, 0, &mut config)
        .is_err()
    {
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn inputs_round_trip() {
        let chunks = vec![
            Chunk { bytes: qemu_version(1), ..Chunk::default() },
            Chunk {
                bytes: vec![1, 2, 3],
                fds: vec![FdKind::Memfd(5), FdKind::Eventfd, FdKind::Pipe(true), FdKind::DevNull],
                flags: 5,
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
}
