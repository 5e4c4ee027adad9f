//! Messages over a UNIX stream socket, with fds as SCM_RIGHTS.
//!
//! The only place fds arrive: each is wrapped in a [`ClientFd`] at once, so every fd a
//! client sends is closed (without waiting on the client) unless something takes ownership
//! of it.

use std::io;
use std::io::IoSlice;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixStream;

use nix::sys::socket::{sendmsg, ControlMessage, MsgFlags};

use crate::client_fd::ClientFd;
use crate::wire::framing::Framer;
use crate::wire::Header;

/// The most fds one `recvmsg` can return (the kernel's SCM_MAX_FD): room for all of them, so
/// the kernel never truncates silently.
const SCM_MAX_FD: usize = 253;

/// Receive state of one connection: its control-message buffer.
pub struct Receiver {
    cmsg: Vec<u8>,
}

impl Default for Receiver {
    fn default() -> Self {
        Self::new()
    }
}

impl Receiver {
    /// Room for the most fds a message may carry.
    pub fn new() -> Self {
        Receiver { cmsg: nix::cmsg_space!([RawFd; SCM_MAX_FD]) }
    }

    /// Receives what is available into `framer`; `Ok(0)` at end of stream. With `wait`
    /// false, returns `WouldBlock` at once if nothing is there.
    pub fn recv(&mut self, stream: &UnixStream, framer: &mut Framer, wait: bool) -> io::Result<usize> {
        let flags = if wait { libc::MSG_CMSG_CLOEXEC } else { libc::MSG_CMSG_CLOEXEC | libc::MSG_DONTWAIT };
        let spare = framer.spare();
        let mut iov = libc::iovec { iov_base: spare.as_mut_ptr().cast(), iov_len: spare.len() };
        // SAFETY: an all-zero msghdr is a valid empty header; the fields are set below.
        let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
        msg.msg_iov = &mut iov;
        msg.msg_iovlen = 1;
        msg.msg_control = self.cmsg.as_mut_ptr().cast();
        msg.msg_controllen = self.cmsg.len() as _;
        let bytes = loop {
            // SAFETY: msg points at a live iovec over the framer's spare buffer and at our
            // control buffer, both valid for the lengths given and not otherwise borrowed.
            match unsafe { libc::recvmsg(stream.as_raw_fd(), &mut msg, flags) } {
                n if n >= 0 => break n as usize,
                _ => match io::Error::last_os_error() {
                    e if e.kind() == io::ErrorKind::Interrupted => continue,
                    e => return Err(e),
                },
            }
        };
        // Take ownership of every fd the kernel installed before looking at anything else:
        // with the fd table full it installs some, truncates the rest (MSG_CTRUNC), and the
        // ones it did install must still be closed.
        let fds = installed_fds(&msg);
        fds.iter().for_each(no_linger);
        if msg.msg_flags & libc::MSG_CTRUNC != 0 {
            // The bytes are whole; the message the fds came with is refused (EMFILE) and the
            // stream goes on. The room here is the most one sendmsg carries, so the kernel
            // truncates only when it could not install them all: the fd table full.
            framer.commit_lossy(bytes, fds);
        } else {
            framer.commit(bytes, fds);
        }
        Ok(bytes)
    }
}

/// If `fd` is a socket, makes its last close return at once: a client may send a TCP socket
/// with a full send buffer and SO_LINGER set for hours, whose close (ours, as the last holder)
/// would otherwise block the connection thread that long. Not a socket: the call fails with
/// ENOTSOCK without touching the file (no file system is asked, as an `fstat` would ask a FUSE
/// server). vfio-user carries no sockets; what this one was sending goes on in the background.
fn no_linger(fd: &ClientFd) {
    let off = libc::linger { l_onoff: 0, l_linger: 0 };
    // SAFETY: setsockopt reads `size_of::<linger>()` bytes from a live local of that type;
    // the fd is open (owned here).
    unsafe {
        libc::setsockopt(
            fd.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_LINGER,
            (&raw const off).cast(),
            size_of::<libc::linger>() as libc::socklen_t,
        )
    };
}

/// The SCM_RIGHTS fds in `msg`'s control data, owned (and closed as any client fd is, also
/// when a truncated message's are dropped).
fn installed_fds(msg: &libc::msghdr) -> Vec<ClientFd> {
    let mut fds = Vec::new();
    // SAFETY: msg's control pointer and length describe the buffer recvmsg just filled; the
    // CMSG macros stay within msg_controllen, and each SCM_RIGHTS payload holds
    // (cmsg_len - CMSG_LEN(0)) / 4 fds the kernel installed in our table for us alone.
    unsafe {
        let mut cmsg = libc::CMSG_FIRSTHDR(msg);
        while !cmsg.is_null() {
            let header = cmsg.read_unaligned();
            if header.cmsg_level == libc::SOL_SOCKET && header.cmsg_type == libc::SCM_RIGHTS {
                let data = libc::CMSG_DATA(cmsg);
                let n = (header.cmsg_len as usize).saturating_sub(libc::CMSG_LEN(0) as usize)
                    / size_of::<RawFd>();
                for i in 0..n {
                    let fd = data.add(i * size_of::<RawFd>()).cast::<RawFd>().read_unaligned();
                    fds.push(ClientFd::from(OwnedFd::from_raw_fd(fd)));
                }
            }
            cmsg = libc::CMSG_NXTHDR(msg, cmsg);
        }
    }
    fds
}

/// Sends one message: `header`, then `parts`, with `fd` attached to its first byte.
pub fn send(
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

#[cfg(test)]
mod tests {
    use std::os::fd::AsFd;

    use super::*;

    /// Open fds of this process whose target names `name`.
    fn open_named(name: &str) -> usize {
        std::fs::read_dir("/proc/self/fd")
            .map(|d| {
                d.filter_map(|e| std::fs::read_link(e.ok()?.path()).ok())
                    .filter(|t| t.to_string_lossy().contains(name))
                    .count()
            })
            .unwrap_or(0)
    }

    #[test]
    fn fds_arrive_owned_and_a_truncated_control_message_leaks_none() {
        let name = "umdev-socket-ctrunc-test";
        let memfd = nix::sys::memfd::memfd_create(
            std::ffi::CString::new(name).unwrap().as_c_str(),
            nix::sys::memfd::MFdFlags::empty(),
        )
        .unwrap();
        let (client, server) = UnixStream::pair().unwrap();
        let send_with = |n: usize| {
            let fds = vec![memfd.as_fd().as_raw_fd(); n];
            sendmsg::<()>(
                client.as_raw_fd(),
                &[IoSlice::new(b"x")],
                &[ControlMessage::ScmRights(&fds)],
                MsgFlags::empty(),
                None,
            )
            .unwrap();
        };

        // Room for all: three fds arrive, owned by the framer.
        let mut framer = Framer::new(1 << 16, 16);
        send_with(3);
        assert_eq!(Receiver::new().recv(&server, &mut framer, true).unwrap(), 1);
        assert_eq!(open_named(name), 4);
        drop(framer);
        assert_eq!(open_named(name), 1);

        // Room for fewer than sent (as with the fd table full): the kernel installs what fits,
        // drops the rest and flags MSG_CTRUNC. The bytes are kept and the stream goes on; the message they
        // start says its fds were lost, and the one installed closes with it.
        let mut small = Receiver { cmsg: nix::cmsg_space!([RawFd; 1]) };
        let mut framer = Framer::new(1 << 16, 16);
        let header = Header { id: 7, command: 4, size: 16, flags: 0, error: 0 };
        let fds = vec![memfd.as_fd().as_raw_fd(); 3];
        let bytes = header.encode();
        let rights = [ControlMessage::ScmRights(&fds)];
        sendmsg::<()>(client.as_raw_fd(), &[IoSlice::new(&bytes)], &rights, MsgFlags::empty(), None).unwrap();
        assert_eq!(small.recv(&server, &mut framer, true).unwrap(), 16);
        let frame = framer.next_frame().unwrap().unwrap();
        // (The room for one is rounded up to 8 bytes: two come.)
        assert_eq!((frame.header.id, frame.fds.len(), frame.fds_lost), (7, 2, true));
        drop(frame);
        assert_eq!(open_named(name), 1, "no fd of the truncated message stays open");
        // The next message is not marked.
        let next = Header { id: 8, ..header };
        std::io::Write::write_all(&mut &client, &next.encode()).unwrap();
        small.recv(&server, &mut framer, true).unwrap();
        let frame = framer.next_frame().unwrap().unwrap();
        assert_eq!((frame.header.id, frame.fds.len(), frame.fds_lost), (8, 0, false));
    }

    fn linger_of(fd: RawFd) -> (i32, i32) {
        let mut l = libc::linger { l_onoff: 0, l_linger: 0 };
        let mut len = size_of::<libc::linger>() as libc::socklen_t;
        // SAFETY: getsockopt writes at most `len` bytes into a live local of that size.
        let r =
            unsafe { libc::getsockopt(fd, libc::SOL_SOCKET, libc::SO_LINGER, (&raw mut l).cast(), &mut len) };
        assert_eq!(r, 0, "getsockopt: {}", io::Error::last_os_error());
        (l.l_onoff, l.l_linger)
    }

    #[test]
    fn a_socket_that_arrives_lingers_no_more_and_other_fds_are_left_alone() {
        // A TCP socket set to linger an hour on close: were it closed by us last with unsent
        // data, the close would wait that long.
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let tcp = std::net::TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let on = libc::linger { l_onoff: 1, l_linger: 3600 };
        // SAFETY: setsockopt reads a live local of the size given.
        let r = unsafe {
            libc::setsockopt(
                tcp.as_raw_fd(),
                libc::SOL_SOCKET,
                libc::SO_LINGER,
                (&raw const on).cast(),
                size_of::<libc::linger>() as libc::socklen_t,
            )
        };
        assert_eq!(r, 0);
        assert_eq!(linger_of(tcp.as_raw_fd()), (1, 3600));
        let memfd =
            nix::sys::memfd::memfd_create(c"umdev-socket-linger-test", nix::sys::memfd::MFdFlags::empty())
                .unwrap();
        let (client, server) = UnixStream::pair().unwrap();
        sendmsg::<()>(
            client.as_raw_fd(),
            &[IoSlice::new(b"x")],
            &[ControlMessage::ScmRights(&[tcp.as_raw_fd(), memfd.as_raw_fd()])],
            MsgFlags::empty(),
            None,
        )
        .unwrap();
        let mut framer = Framer::new(1 << 16, 16);
        assert_eq!(Receiver::new().recv(&server, &mut framer, true).unwrap(), 1);
        // The same socket, seen through the client's own fd.
        assert_eq!(linger_of(tcp.as_raw_fd()).0, 0, "the socket no longer lingers");
        // The memfd is untouched and still held by the framer.
        assert_eq!(open_named("umdev-socket-linger-test"), 2);
    }
}
