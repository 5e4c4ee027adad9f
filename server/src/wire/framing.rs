//! Cutting a byte stream (with the fds that arrived on it) into whole messages.
//!
//! The framer is fed what the socket delivers and yields one message at a time. It checks
//! each header before anything sized by it is read: a size below the header or above the
//! current maximum is fatal for the connection (the stream cannot be resynced), anything
//! else is the request parser's business.
//!
//! The fds a `recvmsg` returned belong to the message holding the **last** byte of that
//! read: the kernel (`unix_stream_read_generic`) glues fd-less segments together but stops
//! right after the first segment that carries fds, so those fds came with the data at the
//! end of the read. Excess fds are closed on arrival, so a client cannot make the server hold
//! more than `max_fds` of them per message.

use std::collections::VecDeque;
use std::ops::Range;
use std::os::fd::OwnedFd;

use crate::client_fd::ClientFd;

use thiserror::Error;

use super::{Header, HEADER_SIZE};

/// Why the stream cannot go on.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum FramingError {
    /// The header's size is smaller than a header.
    #[error("message {id} declares {size} bytes, less than a header")]
    TooSmall {
        /// The message id.
        id: u16,
        /// The declared size.
        size: u32,
    },
    /// The header's size exceeds what the connection accepts.
    #[error("message {id} declares {size} bytes, more than the {max} allowed")]
    TooLarge {
        /// The message id.
        id: u16,
        /// The declared size.
        size: u32,
        /// The limit.
        max: u32,
    },
}

/// A whole message in the framer's buffer.
#[derive(Debug)]
pub struct Frame {
    /// Its header.
    pub header: Header,
    /// Where its payload lies in the buffer ([`Framer::payload`]).
    payload: Range<usize>,
    /// The fds that came with it (at most `max_fds`).
    pub fds: Vec<ClientFd>,
    /// How many further fds came with it and were closed on arrival.
    pub excess_fds: usize,
    /// Fds that came with it were lost on the way in: the kernel could not install them all
    /// (the server's fd table full) and flagged the read (MSG_CTRUNC).
    pub fds_lost: bool,
}

/// Accumulates received bytes and fds; yields whole messages.
#[derive(Debug)]
pub struct Framer {
    /// Zero-initialised storage; data lies in `buf[start..filled]`.
    buf: Vec<u8>,
    /// Start of unconsumed data in `buf`.
    start: usize,
    /// End of received data in `buf`.
    filled: usize,
    /// Stream position of `buf[0]`.
    base: u64,
    /// fds by the stream position of the last byte of the read that brought them.
    fds: VecDeque<(u64, Vec<ClientFd>)>,
    /// fds closed on arrival, by stream position of their read.
    excess: VecDeque<(u64, usize)>,
    /// Reads whose fds were lost, by stream position (as `fds`).
    lost: VecDeque<u64>,
    max_size: u32,
    max_fds: usize,
}

/// Bytes read from the socket at a time when no larger message is pending.
pub const READ_CHUNK: usize = 64 << 10;

impl Framer {
    /// A framer accepting messages of up to `max_size` bytes with up to `max_fds` fds.
    pub fn new(max_size: u32, max_fds: usize) -> Self {
        Framer {
            buf: Vec::new(),
            start: 0,
            filled: 0,
            base: 0,
            fds: VecDeque::new(),
            excess: VecDeque::new(),
            lost: VecDeque::new(),
            max_size,
            max_fds,
        }
    }

    /// Changes the largest message accepted (after VERSION is negotiated).
    pub fn set_max_size(&mut self, max_size: u32) {
        self.max_size = max_size;
    }

    /// Bytes buffered and not yet consumed.
    pub fn buffered(&self) -> usize {
        self.filled - self.start
    }

    /// Free space to receive into: enough for the rest of the pending message, at least
    /// [`READ_CHUNK`]. The buffer never grows beyond the largest message plus one chunk.
    pub fn spare(&mut self) -> &mut [u8] {
        if self.start > 0 {
            self.compact();
        }
        let want = self.pending_need().unwrap_or(0).max(READ_CHUNK);
        if self.buf.len() - self.filled < want {
            self.buf.resize(self.filled + want, 0);
        }
        &mut self.buf[self.filled..]
    }

    /// Records that `n` bytes were received into [`Framer::spare`], with `fds`.
    pub fn commit(&mut self, n: usize, fds: Vec<ClientFd>) {
        self.commit_read(n, fds, false);
    }

    /// As [`Framer::commit`], for a read that lost some of its fds (MSG_CTRUNC): the message
    /// they came with is refused ([`Frame::fds_lost`]), and the stream goes on.
    pub fn commit_lossy(&mut self, n: usize, fds: Vec<ClientFd>) {
        self.commit_read(n, fds, true);
    }

    fn commit_read(&mut self, n: usize, fds: Vec<ClientFd>, lost: bool) {
        let n = n.min(self.buf.len() - self.filled);
        let last = self.base + (self.filled + n.max(1) - 1) as u64;
        self.filled += n;
        self.add_fds(last, fds);
        if lost {
            self.lost.push_back(last);
        }
    }

    /// Appends bytes and fds as if received in one read (for tests and fuzzing).
    pub fn push(&mut self, bytes: &[u8], fds: Vec<OwnedFd>) {
        let mut done = 0;
        while bytes.len() - done > self.spare().len() {
            let spare = self.spare();
            let n = spare.len();
            spare.copy_from_slice(&bytes[done..done + n]);
            self.commit(n, Vec::new());
            done += n;
        }
        let spare = self.spare();
        let n = bytes.len() - done;
        spare[..n].copy_from_slice(&bytes[done..]);
        self.commit(n, fds.into_iter().map(ClientFd::from).collect());
    }

    fn add_fds(&mut self, pos: u64, mut fds: Vec<ClientFd>) {
        if fds.is_empty() {
            return;
        }
        // Count fds already held for the message this read belongs to (not those of earlier
        // messages still buffered); close the excess now.
        let message = self.message_start(pos);
        let held: usize = self.fds.iter().filter(|(at, _)| *at >= message).map(|(_, f)| f.len()).sum();
        let room = self.max_fds.saturating_sub(held);
        if fds.len() > room {
            let closed = fds.len() - room;
            fds.truncate(room);
            self.excess.push_back((pos, closed));
        }
        if !fds.is_empty() {
            self.fds.push_back((pos, fds));
        }
    }

    /// The stream position of the first byte of the message that holds byte `pos` (a byte
    /// already received): found by walking the headers from the front. Where a header is
    /// incomplete or impossible (the framer will refuse it), the walk stops there, which at
    /// worst counts fds of earlier messages too: never fewer than the message's own.
    fn message_start(&self, pos: u64) -> u64 {
        let mut at = self.start;
        while at + HEADER_SIZE <= self.filled {
            let Ok(bytes) = <&[u8; HEADER_SIZE]>::try_from(&self.buf[at..at + HEADER_SIZE]) else { break };
            let size = Header::decode(bytes).size as usize;
            if size < HEADER_SIZE || size > self.max_size as usize || self.base + (at + size) as u64 > pos {
                break;
            }
            at += size;
        }
        self.base + at as u64
    }

    /// Bytes still needed to complete the message at the front, if its header is here.
    fn pending_need(&self) -> Option<usize> {
        let avail = self.buffered();
        if avail < HEADER_SIZE {
            return Some(HEADER_SIZE - avail);
        }
        let header = self.peek_header()?;
        let size = header.size as usize;
        (size <= self.max_size as usize).then(|| size.saturating_sub(avail))
    }

    fn peek_header(&self) -> Option<Header> {
        if self.buffered() < HEADER_SIZE {
            return None;
        }
        let bytes: &[u8; HEADER_SIZE] = self.buf[self.start..self.start + HEADER_SIZE].try_into().ok()?;
        Some(Header::decode(bytes))
    }

    /// The next whole message, `None` if more bytes are needed.
    pub fn next_frame(&mut self) -> Result<Option<Frame>, FramingError> {
        let Some(header) = self.peek_header() else {
            return Ok(None);
        };
        if (header.size as usize) < HEADER_SIZE {
            return Err(FramingError::TooSmall { id: header.id, size: header.size });
        }
        if header.size > self.max_size {
            return Err(FramingError::TooLarge { id: header.id, size: header.size, max: self.max_size });
        }
        let size = header.size as usize;
        if self.buffered() < size {
            return Ok(None);
        }
        let msg_pos = self.base + self.start as u64;
        let end_pos = msg_pos + size as u64;
        let mut fds = Vec::new();
        while let Some((pos, _)) = self.fds.front() {
            if *pos >= end_pos {
                break;
            }
            if let Some((_, batch)) = self.fds.pop_front() {
                fds.extend(batch);
            }
        }
        let mut excess_fds = 0;
        while let Some(&(pos, n)) = self.excess.front() {
            if pos >= end_pos {
                break;
            }
            excess_fds += n;
            self.excess.pop_front();
        }
        let mut fds_lost = false;
        while self.lost.front().is_some_and(|&pos| pos < end_pos) {
            fds_lost = true;
            self.lost.pop_front();
        }
        let payload = self.start + HEADER_SIZE..self.start + size;
        self.start += size;
        Ok(Some(Frame { header, payload, fds, excess_fds, fds_lost }))
    }

    /// The payload of a frame returned by the last [`Framer::next_frame`] call.
    pub fn payload(&self, frame: &Frame) -> &[u8] {
        &self.buf[frame.payload.clone()]
    }

    /// Moves unconsumed bytes to the front of the buffer.
    fn compact(&mut self) {
        self.buf.copy_within(self.start..self.filled, 0);
        self.base += self.start as u64;
        self.filled -= self.start;
        self.start = 0;
    }
}

impl PartialEq for Frame {
    fn eq(&self, other: &Self) -> bool {
        self.header == other.header && self.payload == other.payload
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::flags;

    fn msg(id: u16, command: u16, payload: &[u8]) -> Vec<u8> {
        let size = (HEADER_SIZE + payload.len()) as u32;
        let mut v = Header { id, command, size, flags: flags::TYPE_COMMAND, error: 0 }.encode().to_vec();
        v.extend_from_slice(payload);
        v
    }

    fn fds(n: usize) -> Vec<OwnedFd> {
        (0..n).map(|_| OwnedFd::from(std::fs::File::open("/dev/null").unwrap())).collect()
    }

    #[test]
    fn yields_whole_messages_from_any_split() {
        let stream: Vec<u8> = [msg(1, 9, &[1, 2, 3]), msg(2, 10, &[]), msg(3, 4, &[9; 100])].concat();
        for split in 1..stream.len() {
            let mut f = Framer::new(4096, 16);
            let mut got = Vec::new();
            for chunk in stream.chunks(split) {
                f.push(chunk, Vec::new());
                while let Some(frame) = f.next_frame().unwrap() {
                    got.push((frame.header.id, f.payload(&frame).to_vec()));
                }
            }
            assert_eq!(got, vec![(1, vec![1, 2, 3]), (2, vec![]), (3, vec![9; 100])], "split {split}");
            assert_eq!(f.buffered(), 0);
        }
    }

    #[test]
    fn fds_belong_to_the_message_their_read_ended_in() {
        let mut f = Framer::new(4096, 16);
        let (a, b, c) = (msg(1, 3, &[0; 24]), msg(2, 2, &[0; 32]), msg(3, 2, &[0; 32]));
        // QEMU's reset burst: an fd-less DMA_UNMAP and a DMA_MAP with its fd arrive in one
        // read (the kernel glues them and stops after the fd's segment): the fd is the MAP's.
        f.push(&[&a[..], &b[..]].concat(), fds(1));
        let fa = f.next_frame().unwrap().unwrap();
        assert_eq!((fa.header.id, fa.fds.len()), (1, 0));
        let fb = f.next_frame().unwrap().unwrap();
        assert_eq!((fb.header.id, fb.fds.len()), (2, 1));
        // A read that stops inside a message (buffer full) still gives it its fds.
        f.push(&c[..20], fds(2));
        f.push(&c[20..], Vec::new());
        let fc = f.next_frame().unwrap().unwrap();
        assert_eq!((fc.header.id, fc.fds.len()), (3, 2));
    }

    #[test]
    fn excess_fds_are_closed_on_arrival_and_reported() {
        let mut f = Framer::new(4096, 4);
        let m = msg(7, 8, &[0; 20]);
        f.push(&m[..8], fds(3));
        f.push(&m[8..], fds(3));
        let frame = f.next_frame().unwrap().unwrap();
        assert_eq!((frame.fds.len(), frame.excess_fds), (4, 2));
    }

    #[test]
    fn a_message_gets_its_whole_fd_allowance_while_an_earlier_ones_fds_wait() {
        let mut f = Framer::new(4096, 16);
        let (x, y) = (msg(1, 2, &[0; 32]), msg(2, 8, &[0; 64]));
        // X's first read ends inside it (the buffer filled), with X's fd; the next read ends
        // X and carries Y, with Y's 16 eventfds: all 16 are Y's.
        f.push(&x[..20], fds(1));
        f.push(&[&x[20..], &y[..]].concat(), fds(16));
        let fx = f.next_frame().unwrap().unwrap();
        assert_eq!((fx.header.id, fx.fds.len(), fx.excess_fds), (1, 1, 0));
        let fy = f.next_frame().unwrap().unwrap();
        assert_eq!((fy.header.id, fy.fds.len(), fy.excess_fds), (2, 16, 0));
    }

    #[test]
    fn impossible_sizes_are_fatal() {
        let mut f = Framer::new(1024, 16);
        let mut bad = msg(5, 9, &[]);
        bad[4..8].copy_from_slice(&15u32.to_le_bytes());
        f.push(&bad, Vec::new());
        assert_eq!(f.next_frame(), Err(FramingError::TooSmall { id: 5, size: 15 }));
        let mut f = Framer::new(1024, 16);
        let mut big = msg(6, 10, &[]);
        big[4..8].copy_from_slice(&u32::MAX.to_le_bytes());
        f.push(&big, Vec::new());
        assert_eq!(f.next_frame(), Err(FramingError::TooLarge { id: 6, size: u32::MAX, max: 1024 }));
        // The buffer never grew for the claimed size.
        assert!(f.spare().len() <= READ_CHUNK);
    }

    #[test]
    fn spare_covers_a_large_pending_message_and_no_more() {
        let mut f = Framer::new(1 << 20, 16);
        let mut m = msg(1, 10, &[]);
        m[4..8].copy_from_slice(&(300_000u32).to_le_bytes());
        f.push(&m, Vec::new());
        let n = f.spare().len();
        assert!((300_000 - 16..=300_000 + READ_CHUNK).contains(&n), "{n}");
    }
}
