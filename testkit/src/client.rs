//! A minimal raw vfio-user client: builds any message, well-formed or not, and reads replies.
//!
//! For tests (which must send what a polite client never would), benchmarks and tools. It is
//! not a VMM: it answers no server requests and keeps no state beyond the next message id.

use std::io::{self, IoSlice, IoSliceMut, Read};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::Duration;

use nix::sys::socket::{recvmsg, sendmsg, ControlMessage, ControlMessageOwned, MsgFlags};
use umdev_server::wire::structs::{DeviceInfo, DmaMap, DmaUnmap, IrqSet, RegionAccess, Version};
use umdev_server::wire::{flags, Command, Header, HEADER_SIZE};
use vm_memory::{ByteValued, Le16, Le32, Le64};

/// QEMU 11.1.3's VERSION JSON, byte for byte.
pub const QEMU_CAPS: &str = umdev_server::wire::version::QEMU_11_CAPABILITIES;

/// A reply as received.
#[derive(Debug)]
pub struct Reply {
    /// Its header.
    pub header: Header,
    /// Its payload.
    pub payload: Vec<u8>,
    /// fds that came with it.
    pub fds: Vec<OwnedFd>,
}

impl Reply {
    /// The errno of an error reply, or 0.
    pub fn errno(&self) -> i32 {
        if self.header.is_error() {
            self.header.error as i32
        } else {
            0
        }
    }
}

/// A connection to a vfio-user server.
pub struct RawClient {
    /// The socket.
    pub stream: UnixStream,
    next_id: u16,
}

/// Little-endian bytes of a u32.
pub fn le32(v: u32) -> [u8; 4] {
    v.to_le_bytes()
}
/// Little-endian bytes of a u64.
pub fn le64(v: u64) -> [u8; 8] {
    v.to_le_bytes()
}

impl RawClient {
    /// Connects to `path`.
    pub fn connect(path: &Path) -> io::Result<Self> {
        let stream = UnixStream::connect(path)?;
        stream.set_read_timeout(Some(Duration::from_secs(10)))?;
        Ok(RawClient { stream, next_id: 0x100 })
    }

    /// Sends raw bytes with fds.
    pub fn send_bytes(&mut self, bytes: &[u8], fds: &[RawFd]) -> io::Result<()> {
        let cmsg = [ControlMessage::ScmRights(fds)];
        let cmsgs: &[ControlMessage<'_>] = if fds.is_empty() { &[] } else { &cmsg };
        let mut sent = 0;
        while sent < bytes.len() {
            let c = if sent == 0 { cmsgs } else { &[] };
            sent += match sendmsg::<()>(
                self.stream.as_raw_fd(),
                &[IoSlice::new(&bytes[sent..])],
                c,
                MsgFlags::MSG_NOSIGNAL,
                None,
            ) {
                // Nothing was sent: again, fds and all.
                Err(nix::errno::Errno::EINTR) => continue,
                sent => sent?,
            };
        }
        Ok(())
    }

    /// Builds and sends a message; returns its id.
    pub fn send(&mut self, command: u16, msg_flags: u32, payload: &[u8], fds: &[RawFd]) -> io::Result<u16> {
        let id = self.next_id;
        self.next_id = self.next_id.wrapping_add(1);
        self.send_bytes(&message(id, command, msg_flags, payload), fds)?;
        Ok(id)
    }

    /// Reads one whole message.
    pub fn recv(&mut self) -> io::Result<Reply> {
        let mut head = [0u8; HEADER_SIZE];
        let mut cmsg = nix::cmsg_space!([RawFd; 16]);
        let (n, mut fds) = {
            let mut iov = [IoSliceMut::new(&mut head)];
            let msg = loop {
                // A socket with a read timeout is not restarted after a signal's handler (or
                // io_uring's task work) interrupted the wait: nothing was read, so again.
                match recvmsg::<()>(
                    self.stream.as_raw_fd(),
                    &mut iov,
                    Some(&mut cmsg),
                    MsgFlags::MSG_CMSG_CLOEXEC,
                ) {
                    Err(nix::errno::Errno::EINTR) => continue,
                    msg => break msg?,
                }
            };
            let mut fds = Vec::new();
            for c in msg.cmsgs()? {
                if let ControlMessageOwned::ScmRights(raw) = c {
                    // SAFETY: fresh fds from the kernel, owned by nobody else.
                    fds.extend(raw.into_iter().map(|fd| unsafe { OwnedFd::from_raw_fd(fd) }));
                }
            }
            (msg.bytes, fds)
        };
        if n == 0 {
            return Err(io::ErrorKind::UnexpectedEof.into());
        }
        self.stream.read_exact(&mut head[n..])?;
        let header = Header::decode(&head);
        let mut payload = vec![0u8; header.payload_len()];
        self.stream.read_exact(&mut payload)?;
        fds.shrink_to_fit();
        Ok(Reply { header, payload, fds })
    }

    /// Sends a command and reads its reply, which must be the next message.
    pub fn request(&mut self, command: u16, payload: &[u8], fds: &[RawFd]) -> io::Result<Reply> {
        let id = self.send(command, flags::TYPE_COMMAND, payload, fds)?;
        let reply = self.recv()?;
        let h = &reply.header;
        if h.id != id || h.message_type() != flags::TYPE_REPLY || h.command != command {
            let what = format!("expected the reply to {id} (command {command}), got {h:?}");
            return Err(io::Error::new(io::ErrorKind::InvalidData, what));
        }
        Ok(reply)
    }

    /// VERSION with `json` as capabilities.
    pub fn negotiate_with(&mut self, json: &str) -> io::Result<Reply> {
        let mut p = Version { major: Le16::from(0), minor: Le16::from(0) }.as_slice().to_vec();
        p.extend_from_slice(json.as_bytes());
        p.push(0);
        let r = self.request(Command::Version as u16, &p, &[])?;
        if r.errno() != 0 {
            return Err(io::Error::from_raw_os_error(r.errno()));
        }
        Ok(r)
    }

    /// VERSION with QEMU's capabilities.
    pub fn negotiate(&mut self) -> io::Result<Reply> {
        self.negotiate_with(QEMU_CAPS)
    }

    /// True once the server has closed the connection.
    pub fn is_closed(&mut self) -> bool {
        let mut b = [0u8; 1];
        matches!(self.stream.read(&mut b), Ok(0))
            || matches!(self.stream.read(&mut b), Err(ref e) if e.kind() == io::ErrorKind::ConnectionReset)
    }

    /// Sets COMMAND to memory + I/O decode and bus mastering, as a PCI driver does before
    /// any DMA (a device reaches guest memory only with bus mastering on).
    pub fn enable_bus_master(&mut self) -> io::Result<()> {
        let r = self.region_write(7, 4, &0x0007u16.to_le_bytes())?;
        match r.errno() {
            0 => Ok(()),
            e => Err(io::Error::from_raw_os_error(e)),
        }
    }

    /// DEVICE_GET_INFO, which must succeed: proof the connection is alive and in sync.
    pub fn alive(&mut self) -> bool {
        let info = DeviceInfo { argsz: Le32::from(size_of::<DeviceInfo>() as u32), ..Default::default() };
        match self.request(Command::DeviceGetInfo as u16, info.as_slice(), &[]) {
            Ok(r) => r.errno() == 0 && r.payload.len() == 16,
            Err(_) => false,
        }
    }

    /// REGION_READ.
    pub fn region_read(&mut self, region: u32, offset: u64, count: u32) -> io::Result<Reply> {
        let access =
            RegionAccess { offset: Le64::from(offset), region: Le32::from(region), count: Le32::from(count) };
        self.request(Command::RegionRead as u16, access.as_slice(), &[])
    }

    /// REGION_WRITE.
    pub fn region_write(&mut self, region: u32, offset: u64, data: &[u8]) -> io::Result<Reply> {
        self.request(Command::RegionWrite as u16, &region_write_payload(region, offset, data), &[])
    }
}

/// The bytes of a whole message: header (sized for `payload`) and payload.
pub fn message(id: u16, command: u16, msg_flags: u32, payload: &[u8]) -> Vec<u8> {
    let header =
        Header { id, command, size: (HEADER_SIZE + payload.len()) as u32, flags: msg_flags, error: 0 };
    let mut bytes = header.encode().to_vec();
    bytes.extend_from_slice(payload);
    bytes
}

/// A REGION_WRITE payload.
pub fn region_write_payload(region: u32, offset: u64, data: &[u8]) -> Vec<u8> {
    let access = RegionAccess {
        offset: Le64::from(offset),
        region: Le32::from(region),
        count: Le32::from(data.len() as u32),
    };
    [access.as_slice(), data].concat()
}

/// A DMA_MAP payload.
pub fn dma_map_payload(flags: u32, offset: u64, iova: u64, size: u64) -> Vec<u8> {
    DmaMap {
        argsz: Le32::from(size_of::<DmaMap>() as u32),
        flags: Le32::from(flags),
        offset: Le64::from(offset),
        addr: Le64::from(iova),
        size: Le64::from(size),
    }
    .as_slice()
    .to_vec()
}

/// A DMA_UNMAP payload.
pub fn dma_unmap_payload(argsz: u32, flags: u32, iova: u64, size: u64) -> Vec<u8> {
    DmaUnmap {
        argsz: Le32::from(argsz),
        flags: Le32::from(flags),
        addr: Le64::from(iova),
        size: Le64::from(size),
    }
    .as_slice()
    .to_vec()
}

/// A SET_IRQS payload (argsz covers `data`).
pub fn set_irqs_payload(flags: u32, index: u32, start: u32, count: u32, data: &[u8]) -> Vec<u8> {
    let set = IrqSet {
        argsz: Le32::from((size_of::<IrqSet>() + data.len()) as u32),
        flags: Le32::from(flags),
        index: Le32::from(index),
        start: Le32::from(start),
        count: Le32::from(count),
    };
    [set.as_slice(), data].concat()
}
