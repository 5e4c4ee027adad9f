//! The connection's outgoing side, shared by the connection thread (replies) and device
//! threads (server-to-client DMA_READ/DMA_WRITE), and the table of DMA requests awaiting the
//! client's reply.
//!
//! Only the connection thread reads the socket. A device thread sends its request and waits;
//! the connection thread, reading on as usual, hands the reply over by message id. The
//! connection thread itself never waits for a client reply: QEMU answers server requests only
//! on its main loop, which may itself be waiting for this connection (a vCPU blocked on a
//! region access), so such a wait could only end in a timeout.

use std::collections::HashMap;
use std::io;
use std::os::fd::BorrowedFd;
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicU16, AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::ThreadId;
use std::time::{Duration, Instant};

use crossbeam::channel::{bounded, Sender};
use umdev_mdev::{ClientDma, ClientDmaError};

use crate::stats::ServerStats;
use crate::wire::reply::{dma_transfer, request_header};
use crate::wire::structs::{read_struct, DmaTransfer};
use crate::wire::{Command, Header};

/// Bytes per server-to-client DMA message. QEMU 11 cuts larger replies short (it treats a
/// partial socket write as complete), so transfers go in pieces of at most this size.
pub const CLIENT_DMA_CHUNK: usize = 64 << 10;

/// How long a device thread waits for the client to answer a DMA request, and how long a
/// transfer may take per [`CLIENT_DMA_CHUNK`] of it in all, whatever size of piece the client
/// asked for ([`transfer_deadline`]).
pub const CLIENT_DMA_TIMEOUT: Duration = Duration::from_secs(5);

/// When a transfer of `len` bytes starting now must be done by: [`CLIENT_DMA_TIMEOUT`] per
/// [`CLIENT_DMA_CHUNK`]. A client that asks for small pieces (`max_data_xfer_size` of 1 byte:
/// a million requests for 1 MiB, each answered just in time) gets no more time than one that
/// takes 64 KiB ones.
fn transfer_deadline(now: Instant, len: usize) -> Instant {
    let chunks = u32::try_from(len.div_ceil(CLIENT_DMA_CHUNK).max(1)).unwrap_or(u32::MAX);
    now + CLIENT_DMA_TIMEOUT.saturating_mul(chunks)
}

/// A reply from the client to one of the server's requests.
#[derive(Debug)]
pub struct ClientReply {
    pub header: Header,
    pub payload: Vec<u8>,
}

struct Pending {
    open: bool,
    waiters: HashMap<u16, Sender<ClientReply>>,
}

/// The writing half of a connection.
pub struct Link {
    stream: UnixStream,
    write: Mutex<()>,
    pending: Mutex<Pending>,
    next_id: AtomicU16,
    /// The thread that reads the socket; it must not wait for client replies.
    reader: ThreadId,
    /// The client's `max_data_xfer_size`, once negotiated.
    max_dma_chunk: AtomicU32,
    stats: Arc<ServerStats>,
}

impl Link {
    /// The link over `stream`, read by the thread `reader`.
    pub fn new(stream: UnixStream, reader: ThreadId, stats: Arc<ServerStats>) -> Self {
        Link {
            stream,
            write: Mutex::new(()),
            pending: Mutex::new(Pending { open: true, waiters: HashMap::new() }),
            next_id: AtomicU16::new(0),
            reader,
            max_dma_chunk: AtomicU32::new(1 << 20),
            stats,
        }
    }

    /// Sends one message, whole, whoever else is sending.
    pub fn send(&self, header: &Header, parts: &[&[u8]], fd: Option<BorrowedFd<'_>>) -> io::Result<()> {
        self.send_if(header, parts, fd, || true).map(|_| ())
    }

    /// Sends one message, whole, if `may_send` (asked with no other message going out
    /// meanwhile) says so; `Ok(false)` when it did not.
    fn send_if(
        &self,
        header: &Header,
        parts: &[&[u8]],
        fd: Option<BorrowedFd<'_>>,
        may_send: impl FnOnce() -> bool,
    ) -> io::Result<bool> {
        let _guard = umdev_pinning::sync::lock(&self.write);
        if !may_send() {
            return Ok(false);
        }
        if let Err(e) = crate::socket::send(&self.stream, header, parts, fd) {
            // Part of the message may be out (a client that stopped reading for the send
            // timeout): nothing can follow it in the stream. The connection ends.
            let _ = self.stream.shutdown(std::net::Shutdown::Both);
            return Err(e);
        }
        self.stats.bytes_out.fetch_add(u64::from(header.size), Ordering::Relaxed);
        Ok(true)
    }

    /// The most data one DMA request or its reply carries: the smaller of the client's
    /// negotiated `max_data_xfer_size` and this server's (a reply above the server's own
    /// message limit would end the connection).
    pub fn set_max_dma_chunk(&self, bytes: u32) {
        self.max_dma_chunk.store(bytes.max(1), Ordering::Relaxed);
    }

    /// Hands a client reply to the device thread waiting for it; false if none is. The
    /// payload is copied only for a waiter.
    pub fn deliver(&self, header: Header, payload: &[u8]) -> bool {
        let waiter = self.lock_pending().waiters.remove(&header.id);
        match waiter {
            Some(tx) => tx.send(ClientReply { header, payload: payload.to_vec() }).is_ok(),
            None => false,
        }
    }

    /// Fails every waiting request and refuses new ones: the client is gone.
    pub fn close(&self) {
        let mut pending = self.lock_pending();
        pending.open = false;
        pending.waiters.clear();
    }

    fn lock_pending(&self) -> std::sync::MutexGuard<'_, Pending> {
        umdev_pinning::sync::lock(&self.pending)
    }

    /// Sends a request to the client, if `may_send` says so as it goes out
    /// ([`ClientDma`]), and waits for its reply, for [`CLIENT_DMA_TIMEOUT`] at most and not
    /// past `deadline` (past it, nothing is sent).
    fn request(
        &self,
        command: Command,
        parts: &[&[u8]],
        deadline: Instant,
        may_send: impl FnOnce() -> bool,
    ) -> Result<ClientReply, ClientDmaError> {
        if std::thread::current().id() == self.reader {
            return Err(ClientDmaError::WouldDeadlock);
        }
        let wait = deadline.saturating_duration_since(Instant::now()).min(CLIENT_DMA_TIMEOUT);
        if wait.is_zero() {
            return Err(ClientDmaError::Disconnected("the client took too long over the transfer"));
        }
        let (tx, rx) = bounded(1);
        let id = {
            let mut pending = self.lock_pending();
            if !pending.open {
                return Err(ClientDmaError::Disconnected("the client has disconnected"));
            }
            // Ids cycle through 65536 values; skip any still awaiting a reply.
            let mut id = self.next_id.fetch_add(1, Ordering::Relaxed);
            while pending.waiters.contains_key(&id) {
                id = self.next_id.fetch_add(1, Ordering::Relaxed);
            }
            pending.waiters.insert(id, tx);
            id
        };
        let len = parts.iter().map(|p| p.len()).sum();
        self.stats.client_dma_requests.fetch_add(1, Ordering::Relaxed);
        match self.send_if(&request_header(id, command, len), parts, None, may_send) {
            Ok(true) => {}
            sent => {
                self.lock_pending().waiters.remove(&id);
                return Err(match sent {
                    Ok(_) => ClientDmaError::Withdrawn,
                    Err(_) => ClientDmaError::Disconnected("the request could not be sent"),
                });
            }
        }
        let reply = rx.recv_timeout(wait);
        self.lock_pending().waiters.remove(&id);
        reply.map_err(|_| ClientDmaError::Disconnected("no reply from the client"))
    }

    fn chunk(&self) -> usize {
        CLIENT_DMA_CHUNK.min(self.max_dma_chunk.load(Ordering::Relaxed) as usize)
    }
}

/// [`ClientDma`] over a connection's link.
pub struct ClientDmaPort {
    /// The connection's link.
    pub link: Arc<Link>,
}

fn check(reply: &ClientReply, iova: u64, count: usize, data: bool) -> Result<(), ClientDmaError> {
    if reply.header.is_error() {
        // An error with no errno is still an error: EIO, not "0".
        let errno = i32::try_from(reply.header.error).ok().filter(|&e| e > 0).unwrap_or(libc::EIO);
        return Err(ClientDmaError::Refused(errno));
    }
    let p = &reply.payload;
    // A DMA_WRITE reply may be a bare header (QEMU 10.1) or echo address and count.
    if !data && p.is_empty() {
        return Ok(());
    }
    let fixed = size_of::<DmaTransfer>();
    let (addr, n) = match p.len() {
        // The specification's DMA_WRITE reply: address and a 4-byte count.
        12 if !data => {
            let addr = p[..8].try_into().map(u64::from_le_bytes).map_err(|_| ClientDmaError::BadReply)?;
            let n = p[8..].try_into().map(u32::from_le_bytes).map_err(|_| ClientDmaError::BadReply)?;
            (addr, n)
        }
        len if len == if data { fixed + count } else { fixed } => {
            let t: DmaTransfer = read_struct(p).ok_or(ClientDmaError::BadReply)?;
            // QEMU puts a u32 count and 4 bytes of padding where the specification has a
            // u64: only the low 32 bits are the count.
            (t.addr.to_native(), t.count.to_native() as u32)
        }
        _ => return Err(ClientDmaError::BadReply),
    };
    if addr != iova || n as usize != count {
        return Err(ClientDmaError::BadReply);
    }
    Ok(())
}

impl ClientDma for ClientDmaPort {
    fn read(&self, iova: u64, buf: &mut [u8], may_send: &dyn Fn(u64) -> bool) -> Result<(), ClientDmaError> {
        let chunk = self.link.chunk();
        let deadline = transfer_deadline(Instant::now(), buf.len());
        for (i, piece) in buf.chunks_mut(chunk).enumerate() {
            let at = iova.checked_add((i * chunk) as u64).ok_or(ClientDmaError::Refused(libc::EINVAL))?;
            let request = dma_transfer(at, piece.len() as u64);
            let reply = self.link.request(Command::DmaRead, &[&request], deadline, || may_send(at))?;
            check(&reply, at, piece.len(), true)?;
            piece.copy_from_slice(&reply.payload[size_of::<DmaTransfer>()..]);
        }
        Ok(())
    }

    fn write(&self, iova: u64, data: &[u8], may_send: &dyn Fn(u64) -> bool) -> Result<(), ClientDmaError> {
        let chunk = self.link.chunk();
        let deadline = transfer_deadline(Instant::now(), data.len());
        for (i, piece) in data.chunks(chunk).enumerate() {
            let at = iova.checked_add((i * chunk) as u64).ok_or(ClientDmaError::Refused(libc::EINVAL))?;
            let parts = [&dma_transfer(at, piece.len() as u64)[..], piece];
            let reply = self.link.request(Command::DmaWrite, &parts, deadline, || may_send(at))?;
            check(&reply, at, piece.len(), false)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::flags;

    #[test]
    fn a_transfer_gets_its_time_by_64_kib_whatever_the_pieces() {
        let now = Instant::now();
        assert_eq!(transfer_deadline(now, 0), now + CLIENT_DMA_TIMEOUT);
        assert_eq!(transfer_deadline(now, 1), now + CLIENT_DMA_TIMEOUT);
        assert_eq!(transfer_deadline(now, CLIENT_DMA_CHUNK), now + CLIENT_DMA_TIMEOUT);
        assert_eq!(transfer_deadline(now, CLIENT_DMA_CHUNK + 1), now + 2 * CLIENT_DMA_TIMEOUT);
        assert_eq!(transfer_deadline(now, 1 << 20), now + 16 * CLIENT_DMA_TIMEOUT);
    }

    #[test]
    fn a_request_past_its_transfers_deadline_is_not_sent() {
        let (ours, theirs) = UnixStream::pair().unwrap();
        theirs.set_nonblocking(true).unwrap();
        // Read by another thread: this one may wait for replies.
        let reader = std::thread::spawn(|| ()).thread().id();
        let link = Link::new(ours, reader, Arc::default());
        let past = Instant::now() - Duration::from_millis(1);
        let r = link.request(Command::DmaRead, &[&dma_transfer(0, 8)], past, || true);
        assert!(matches!(r, Err(ClientDmaError::Disconnected(_))), "{r:?}");
        let mut buf = [0u8; 64];
        let unsent = std::io::Read::read(&mut &theirs, &mut buf).unwrap_err();
        assert_eq!(unsent.kind(), io::ErrorKind::WouldBlock, "nothing reached the client");
    }

    #[test]
    fn an_error_reply_without_an_errno_is_eio() {
        let reply = |error| ClientReply {
            header: Header { id: 1, command: 11, size: 16, flags: flags::TYPE_REPLY | flags::ERROR, error },
            payload: Vec::new(),
        };
        assert!(matches!(check(&reply(0), 0, 8, true), Err(ClientDmaError::Refused(libc::EIO))));
        assert!(matches!(check(&reply(14), 0, 8, true), Err(ClientDmaError::Refused(libc::EFAULT))));
        assert!(matches!(check(&reply(u32::MAX), 0, 8, true), Err(ClientDmaError::Refused(libc::EIO))));
    }

    /// A DMA_WRITE reply may be a bare header, the specification's address and 4-byte count
    /// (12 bytes), or QEMU's and libvfio-user's 16 bytes; a DMA_READ reply has the 16 bytes
    /// and the data. Any other size, address or count fails the transfer.
    #[test]
    fn dma_reply_forms() {
        let reply = |payload: Vec<u8>| ClientReply {
            header: Header {
                id: 1,
                command: 12,
                size: 16 + payload.len() as u32,
                flags: flags::TYPE_REPLY,
                error: 0,
            },
            payload,
        };
        let spec = |addr: u64, n: u32| [addr.to_le_bytes().as_slice(), &n.to_le_bytes()].concat();
        let padded = |addr: u64, n: u64| [addr.to_le_bytes(), n.to_le_bytes()].concat();
        let ok = |r: Result<(), ClientDmaError>| r.is_ok();
        assert!(ok(check(&reply(Vec::new()), 0x1000, 8, false)));
        assert!(ok(check(&reply(spec(0x1000, 8)), 0x1000, 8, false)));
        assert!(ok(check(&reply(padded(0x1000, 8)), 0x1000, 8, false)));
        for bad in [spec(0x2000, 8), spec(0x1000, 4), [spec(0x1000, 8), vec![0]].concat(), vec![0; 8]] {
            assert!(matches!(check(&reply(bad), 0x1000, 8, false), Err(ClientDmaError::BadReply)));
        }
        let read = [padded(0x1000, 4), vec![7; 4]].concat();
        assert!(ok(check(&reply(read), 0x1000, 4, true)));
        let short = [spec(0x1000, 4), vec![7; 4]].concat();
        assert!(matches!(check(&reply(short), 0x1000, 4, true), Err(ClientDmaError::BadReply)));
        assert!(matches!(check(&reply(spec(0x1000, 0)), 0x1000, 0, true), Err(ClientDmaError::BadReply)));
    }
}
