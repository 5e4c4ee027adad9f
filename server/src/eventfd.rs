//! Turning fds a client sent with SET_IRQS into eventfds the server can signal safely.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, IntoRawFd};

use crate::client_fd::ClientFd;

use nix::fcntl::{fcntl, FcntlArg, OFlag};
use umdev_mdev::EventFd;

/// Checks that `fd` is an eventfd and makes it non-blocking.
///
/// A client could send a pipe (whose full buffer would block a write forever) or an eventfd
/// whose counter it pushed to the maximum (same effect). Non-blocking, a signal that cannot
/// be added is dropped, which loses nothing: a full eventfd is already signalled. Clients
/// create their eventfds non-blocking already (QEMU and rust-vmm do), so the flag changes
/// nothing for them.
pub(crate) fn vet(fd: ClientFd) -> io::Result<EventFd> {
    let link = std::fs::read_link(format!("/proc/self/fd/{}", fd.as_raw_fd()))?;
    if link.as_os_str() != "anon_inode:[eventfd]" {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("not an eventfd: {}", link.display()),
        ));
    }
    // An eventfd's close asks no one: from here on it is closed like any fd of ours.
    let fd = fd.into_owned();
    let flags = OFlag::from_bits_truncate(fcntl(&fd, FcntlArg::F_GETFL)?);
    fcntl(&fd, FcntlArg::F_SETFL(flags | OFlag::O_NONBLOCK))?;
    // SAFETY: `fd` is an eventfd we own; ownership moves into the EventFd.
    Ok(unsafe { EventFd::from_raw_fd(fd.into_raw_fd()) })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::OwnedFd;

    #[test]
    fn accepts_eventfds_and_refuses_other_fds() {
        let efd = OwnedFd::from(
            nix::sys::eventfd::EventFd::from_flags(nix::sys::eventfd::EfdFlags::empty()).unwrap(),
        );
        let vetted = vet(efd.into()).unwrap();
        // Push the counter to its maximum: a further write must not block.
        vetted.write(u64::MAX - 1).unwrap();
        assert!(vetted.write(1).is_err());
        let (r, _w) = nix::unistd::pipe().unwrap();
        assert!(vet(r.into()).is_err());
        assert!(vet(OwnedFd::from(std::fs::File::open("/dev/null").unwrap()).into()).is_err());
    }
}
