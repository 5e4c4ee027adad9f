//! The INTx unmask-eventfd watcher: a thread that turns signals on the client's unmask
//! eventfd (QEMU's KVM resample fd) into UNMASKs.
//!
//! One thread per registered fd, blocked in `poll(2)` on that fd and a private stop
//! eventfd; it lives until replaced, de-registered, INTx is disabled, or the interrupts are
//! reset or dropped. Stopping joins the thread, so once [`UnmaskWatcher::stop`] returns no
//! unmask from the old fd can land — replacing the fd has no window where both act.
//!
//! A read must never block the thread where it cannot see the stop signal. The fd's
//! `O_NONBLOCK` does not ensure it: the flag is the open file's, which the client shares and
//! may clear, and the client may read the fd itself between the watcher's poll and its read.
//! So each read asks for no wait itself ([`read_nowait`]: `RWF_NOWAIT`, which eventfds honour
//! since Linux 5.11), and `O_NONBLOCK` is set as well for older kernels.

use std::fs::File;
use std::io::{self, ErrorKind};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, IntoRawFd};
use std::sync::Arc;
use std::thread::JoinHandle;

use nix::errno::Errno;
use nix::fcntl::{fcntl, FcntlArg, OFlag};
use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
use nix::sys::eventfd::{EfdFlags, EventFd as StopFd};
use vmm_sys_util::eventfd::EventFd;

/// A running watcher thread.
#[derive(Debug)]
pub(super) struct UnmaskWatcher {
    stop: Arc<StopFd>,
    thread: Option<JoinHandle<()>>,
}

impl UnmaskWatcher {
    /// Starts watching `fd`; `on_signal` runs on the watcher thread for each signal.
    pub(super) fn spawn(fd: EventFd, on_signal: impl Fn() + Send + 'static) -> io::Result<Self> {
        // SAFETY: `into_raw_fd` hands over the eventfd's descriptor, which nothing else
        // owns from here on; the File takes sole ownership and closes it.
        let fd = unsafe { File::from_raw_fd(fd.into_raw_fd()) };
        let flags = OFlag::from_bits_retain(fcntl(&fd, FcntlArg::F_GETFL)?);
        fcntl(&fd, FcntlArg::F_SETFL(flags | OFlag::O_NONBLOCK))?;
        let stop = Arc::new(StopFd::from_flags(EfdFlags::EFD_NONBLOCK | EfdFlags::EFD_CLOEXEC)?);
        let stop_rx = stop.clone();
        let thread = std::thread::Builder::new()
            .name("umdev-intx-unmask".into())
            .spawn(move || watch(&fd, &stop_rx, on_signal))?;
        Ok(UnmaskWatcher { stop, thread: Some(thread) })
    }

    /// Stops the thread and waits for it; no `on_signal` runs after this returns. Must
    /// not be called while holding a lock `on_signal` takes.
    pub(super) fn stop(mut self) {
        self.shut_down();
    }

    fn shut_down(&mut self) {
        let Some(thread) = self.thread.take() else { return };
        if let Err(e) = self.stop.write(1) {
            // Cannot happen short of a counter overflow; the thread would keep running.
            log::error!("cannot stop the INTx unmask watcher: {e}");
            return;
        }
        if thread.thread().id() == std::thread::current().id() {
            return; // dropped from its own callback: it exits when the callback returns
        }
        if thread.join().is_err() {
            log::error!("the INTx unmask watcher panicked");
        }
    }
}

impl Drop for UnmaskWatcher {
    fn drop(&mut self) {
        self.shut_down();
    }
}

/// Reads eventfd `fd`'s counter without waiting, whatever its `O_NONBLOCK` says (a flag the
/// client shares): `WouldBlock` if it is 0. Where the kernel cannot (`RWF_NOWAIT`
/// unsupported), a plain read.
pub(super) fn read_nowait(fd: BorrowedFd<'_>) -> io::Result<usize> {
    let mut counter = [0u8; 8];
    let iov = libc::iovec { iov_base: counter.as_mut_ptr().cast(), iov_len: counter.len() };
    // SAFETY: one iovec over a live local buffer of its stated length; offset -1 is the
    // file's own position (an eventfd has none).
    let n = unsafe { libc::preadv2(fd.as_raw_fd(), &iov, 1, -1, libc::RWF_NOWAIT) };
    if n >= 0 {
        return Ok(n as usize);
    }
    match io::Error::last_os_error() {
        e if e.raw_os_error() == Some(libc::EOPNOTSUPP) => {
            // SAFETY: read(2) writes at most `counter.len()` bytes into the live local.
            let n = unsafe { libc::read(fd.as_raw_fd(), counter.as_mut_ptr().cast(), counter.len()) };
            if n < 0 {
                Err(io::Error::last_os_error())
            } else {
                Ok(n as usize)
            }
        }
        e => Err(e),
    }
}

fn watch(fd: &File, stop: &StopFd, on_signal: impl Fn()) {
    loop {
        let mut fds =
            [PollFd::new(stop.as_fd(), PollFlags::POLLIN), PollFd::new(fd.as_fd(), PollFlags::POLLIN)];
        match poll(&mut fds, PollTimeout::NONE) {
            Ok(_) => {}
            Err(Errno::EINTR) => continue,
            Err(e) => {
                log::error!("INTx unmask watcher: poll failed: {e}");
                return;
            }
        }
        let stopping = fds[0].revents().unwrap_or(PollFlags::empty());
        let events = fds[1].revents().unwrap_or(PollFlags::empty());
        if !stopping.is_empty() {
            return;
        }
        if events.intersects(PollFlags::POLLERR | PollFlags::POLLHUP | PollFlags::POLLNVAL) {
            log::error!("INTx unmask watcher: the unmask eventfd failed ({events:?}); no longer watching it");
            return;
        }
        if events.contains(PollFlags::POLLIN) {
            match read_nowait(fd.as_fd()) {
                Ok(_) => on_signal(),
                Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::Interrupted) => {}
                Err(e) => {
                    log::error!("INTx unmask watcher: reading the unmask eventfd failed: {e}");
                    return;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::io::Write;

    use super::*;

    #[test]
    fn a_read_does_not_wait_even_when_the_client_cleared_o_nonblock() {
        let efd = EventFd::new(libc::EFD_NONBLOCK).unwrap();
        // SAFETY: the descriptor is the EventFd's, handed over whole.
        let fd = unsafe { File::from_raw_fd(efd.into_raw_fd()) };
        // The client's copy shares the open file: clearing the flag there clears it here.
        fcntl(&fd, FcntlArg::F_SETFL(OFlag::empty())).unwrap();
        // On another thread, so that a read that waits fails the test instead of hanging it.
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let empty = read_nowait(fd.as_fd()).map_err(|e| e.kind());
            (&fd).write_all(&1u64.to_ne_bytes()).unwrap();
            let one = read_nowait(fd.as_fd()).map_err(|e| e.kind());
            tx.send((empty, one)).unwrap();
        });
        let (empty, one) = rx.recv_timeout(std::time::Duration::from_secs(30)).expect("a read waited");
        assert_eq!(empty, Err(ErrorKind::WouldBlock));
        assert_eq!(one, Ok(8));
    }
}
