//! Messages over a UNIX stream socket, with fds as SCM_RIGHTS.
//!
//! The only place fds arrive: each is wrapped in an `OwnedFd` at once, so every fd a
//! client sends is closed unless something takes ownership of it.

use std::io;
use std::io::{IoSlice, IoSliceMut};
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixStream;

use nix::sys::socket::{recvmsg, sendmsg, ControlMessage, ControlMessageOwned, MsgFlags};

use crate::wire::framing::Framer;
use crate::wire::Header;

/// The most fds one `recvmsg` can return (the kernel's SCM_MAX_FD): room for all of them, so
/// the kernel never truncates silently.
const SCM_MAX_FD: usize = 253;

/// Receive state of one connection: its control-message buffer.
pub(crate) struct Receiver {
    cmsg: Vec<u8>,
}

impl Receiver {
    pub(crate) fn new() -> Self {
        Receiver { cmsg: nix::cmsg_space!([RawFd; SCM_MAX_FD]) }
    }

    /// Receives what is available into `framer`; `Ok(0)` at end of stream. With `wait`
    /// false, returns `WouldBlock` at once if nothing is there.
    pub(crate) fn recv(&mut self, stream: &UnixStream, framer: &mut Framer, wait: bool) -> io::Result<usize> {
        let flags = if wait {
            MsgFlags::MSG_CMSG_CLOEXEC
        } else {
            MsgFlags::MSG_CMSG_CLOEXEC | MsgFlags::MSG_DONTWAIT
        };
        let spare = framer.spare();
        let mut iov = [IoSliceMut::new(spare)];
        self.cmsg.fill(0);
        let (bytes, fds, truncated) = loop {
            match recvmsg::<()>(stream.as_raw_fd(), &mut iov, Some(&mut self.cmsg), flags) {
                Ok(msg) => {
                    let mut fds = Vec::new();
                    for cmsg in msg.cmsgs().map_err(io::Error::from)? {
                        if let ControlMessageOwned::ScmRights(raw) = cmsg {
                            // SAFETY: the kernel just installed these fds in our table for us;
                            // nothing else owns them.
                            fds.extend(raw.into_iter().map(|fd| unsafe { OwnedFd::from_raw_fd(fd) }));
                        }
                    }
                    break (msg.bytes, fds, msg.flags.contains(MsgFlags::MSG_CTRUNC));
                }
                Err(nix::errno::Errno::EINTR) => continue,
                Err(e) => return Err(e.into()),
            }
        };
        if truncated {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                "control message truncated: fds were lost",
            ));
        }
        framer.commit(bytes, fds);
        Ok(bytes)
    }
}

/// Sends one message: `header`, then `parts`, with `fd` attached to its first byte.
pub(crate) fn send(
    stream: &UnixStream,
    header: &Header,
    parts: &[&[u8]],
    fd: Option<BorrowedFd<'_>>,
) -> io::Result<()> {
    let head = header.encode();
    let mut slices: smallvec::SmallVec<[&[u8]; 4]> = smallvec::SmallVec::new();
    slices.push(&head[..]);
    slices.extend(parts.iter().copied().filter(|p| !p.is_empty()));
    let total: usize = slices.iter().map(|s| s.len()).sum();
    debug_assert_eq!(total, header.size as usize, "header size must match the message");
    let raw_fd = fd.map(|f| [f.as_raw_fd()]);
    let mut sent = 0usize;
    while sent < total {
        // Rebuild the iovecs past what was sent (a send timeout can cut a message short).
        let mut skip = sent;
        let iov: smallvec::SmallVec<[IoSlice<'_>; 4]> = slices
            .iter()
            .filter_map(|s| {
                if skip >= s.len() {
                    skip -= s.len();
                    None
                } else {
                    let part = &s[skip..];
                    skip = 0;
                    Some(IoSlice::new(part))
                }
            })
            .collect();
        let cmsgs: smallvec::SmallVec<[ControlMessage<'_>; 1]> = match (&raw_fd, sent) {
            (Some(fds), 0) => smallvec::smallvec![ControlMessage::ScmRights(&fds[..])],
            _ => smallvec::SmallVec::new(),
        };
        match sendmsg::<()>(stream.as_raw_fd(), &iov, &cmsgs, MsgFlags::MSG_NOSIGNAL, None) {
            Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
            Ok(n) => sent += n,
            Err(nix::errno::Errno::EINTR) => continue,
            Err(e) => return Err(e.into()),
        }
    }
    Ok(())
}
