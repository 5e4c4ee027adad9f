//! The INTx unmask-eventfd watcher: a thread that turns signals on the client's unmask
//! eventfd (QEMU's KVM resample fd) into UNMASKs.
//!
//! One thread per registered fd, blocked in `poll(2)` on that fd and a private stop
//! eventfd; it lives until replaced, de-registered, INTx is disabled, or the interrupts are
//! reset or dropped. Stopping joins the thread, so once [`UnmaskWatcher::stop`] returns no
//! unmask from the old fd can land — replacing the fd has no window where both act.
//!
//! We are the only reader of an unmask eventfd (KVM or the client writes it), so the
//! watcher sets `O_NONBLOCK` on it: a read that finds the counter already drained returns
//! `EAGAIN` instead of blocking the thread where it cannot see the stop signal.

use std::fs::File;
use std::io::{self, ErrorKind, Read};
use std::os::fd::{AsFd, FromRawFd, IntoRawFd};
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
            let mut counter = [0u8; 8];
            match (&*fd).read(&mut counter) {
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
