//! Fds a client sent, closed without waiting on the client.
//!
//! A close may wait on whoever serves the file: the last close of a file on FUSE asks its
//! server (FLUSH), which may be the client itself and need never answer; NFS writes back
//! what the file holds. Closed on the connection thread, such an fd would stall the
//! connection and keep the next client of the instance out. So each fd that arrives is a
//! [`ClientFd`], and dropping one whose close could wait hands it to a closer thread.
//!
//! What closes at once, on the thread that drops it: memory files (memfds, tmpfs and
//! hugetlbfs files, told by `F_GET_SEALS`, which only the kernel's shmem and hugetlbfs code
//! serve), pipes, sockets (made non-lingering as they arrive) and eventfds.
//! Everything else goes to the closers: up to [`MAX_CLOSERS`] threads, started as needed and
//! ending after [`CLOSER_IDLE`] without work, which take queued fds in order. If
//! [`MAX_QUEUED`] fds already wait (the closers are all stuck on a server that does not
//! answer), the fd is closed where it is dropped: the queue is bounded, as every resource a
//! client can grow. So is it when no closer runs and none can be started.
//!
//! Fds arriving and waiting to close count against the process's open-file limit, shared by
//! every client: [`raise_fd_limit`] gives a server the room its hard limit allows.

use std::collections::VecDeque;
use std::mem::ManuallyDrop;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd, RawFd};
use std::sync::{Condvar, Mutex, MutexGuard};
use std::time::Duration;

use umdev_pinning::{file_kind, sync, FileKind};

/// Closer threads at most.
pub const MAX_CLOSERS: usize = 4;
/// Fds waiting for a closer at most; beyond, an fd is closed where it is dropped.
pub const MAX_QUEUED: usize = 1024;
/// How long a closer waits for work before it ends.
pub const CLOSER_IDLE: Duration = Duration::from_secs(10);

/// Raises this process's soft limit on open files (RLIMIT_NOFILE) to its hard limit, and
/// returns the limit now in force. The soft limit is 1024 by default (systemd's too) for the
/// sake of programs using `select(2)`; this server does not. At 1024, one client sending the
/// most fds a message may carry (253, closed on arrival or queued for the closers) could fill
/// the table, and other clients' fds would then be lost on the way in (their messages fail
/// with EMFILE) and devices could make no new per-client memory.
pub fn raise_fd_limit() -> std::io::Result<u64> {
    use nix::sys::resource::{getrlimit, setrlimit, Resource};
    let (soft, hard) = getrlimit(Resource::RLIMIT_NOFILE)?;
    if soft < hard {
        setrlimit(Resource::RLIMIT_NOFILE, hard, hard)?;
    }
    Ok(hard.max(soft))
}

/// An fd a client sent: closed when dropped, on a closer thread if its close could wait on
/// someone (see the module's documentation).
pub struct ClientFd(ManuallyDrop<OwnedFd>);

impl ClientFd {
    /// The fd, to be closed like any other from now on: for one known to close at once (a
    /// vetted eventfd).
    pub fn into_owned(self) -> OwnedFd {
        let mut this = ManuallyDrop::new(self);
        // SAFETY: `this` is never dropped, so the fd is taken out exactly once.
        unsafe { ManuallyDrop::take(&mut this.0) }
    }
}

impl From<OwnedFd> for ClientFd {
    fn from(fd: OwnedFd) -> ClientFd {
        ClientFd(ManuallyDrop::new(fd))
    }
}

impl AsFd for ClientFd {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.0.as_fd()
    }
}

impl AsRawFd for ClientFd {
    fn as_raw_fd(&self) -> RawFd {
        self.0.as_raw_fd()
    }
}

impl std::fmt::Debug for ClientFd {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("ClientFd").field(&self.0.as_raw_fd()).finish()
    }
}

impl Drop for ClientFd {
    fn drop(&mut self) {
        // SAFETY: taken once, here, and `self.0` is not used again.
        let fd = unsafe { ManuallyDrop::take(&mut self.0) };
        if closes_at_once(fd.as_fd()) {
            drop(fd);
        } else {
            close_elsewhere(fd);
        }
    }
}

/// Whether closing `fd` asks no one but the kernel (see the module's documentation). Asks
/// nothing of the file's own file system either ([`file_kind`]).
fn closes_at_once(fd: BorrowedFd<'_>) -> bool {
    // Of anonymous inodes only eventfds: the release of others may wait on their owner (a
    // userfaultfd's takes the client's mmap lock).
    matches!(file_kind(fd), FileKind::Memory | FileKind::Pipe | FileKind::Socket | FileKind::Eventfd)
}

struct Closers {
    queue: VecDeque<OwnedFd>,
    /// Fds a closer took from the queue and is closing.
    closing: usize,
    /// Closer threads alive, and how many of them wait for work.
    threads: usize,
    idle: usize,
}

static CLOSERS: Mutex<Closers> =
    Mutex::new(Closers { queue: VecDeque::new(), closing: 0, threads: 0, idle: 0 });
static WORK: Condvar = Condvar::new();
/// Notified when the last fd handed to the closers is closed.
static CLOSED: Condvar = Condvar::new();

fn closers() -> MutexGuard<'static, Closers> {
    // The state is a queue and counts, consistent at every unlock.
    sync::lock(&CLOSERS)
}

fn close_elsewhere(fd: OwnedFd) {
    let mut c = closers();
    if c.queue.len() >= MAX_QUEUED {
        drop(c);
        log::warn!("{MAX_QUEUED} client fds wait for a closer; closing one on this thread");
        return drop(fd);
    }
    c.queue.push_back(fd);
    // A closer counted idle may have been woken for an fd queued before this one and not yet
    // taken it: one thread more for each fd beyond the idle ones.
    if c.queue.len() > c.idle && c.threads < MAX_CLOSERS {
        let spawned = std::thread::Builder::new().name("umdev-closer".into()).spawn(closer);
        match spawned {
            Ok(_) => c.threads += 1,
            Err(e) if c.threads == 0 => {
                // No closer at all to take it: closed here after all.
                log::warn!("cannot start a closer thread ({e}); closing a client fd on this thread");
                let fd = c.queue.pop_back();
                drop(c);
                return drop(fd);
            }
            // The running closers take it in turn.
            Err(e) => log::warn!("cannot start another closer thread: {e}"),
        }
    }
    drop(c);
    WORK.notify_one();
}

fn closer() {
    let mut c = closers();
    loop {
        if let Some(fd) = c.queue.pop_front() {
            c.closing += 1;
            drop(c);
            drop(fd);
            c = closers();
            c.closing -= 1;
            if c.queue.is_empty() && c.closing == 0 {
                CLOSED.notify_all();
            }
            continue;
        }
        c.idle += 1;
        let (guard, timeout) = sync::wait_timeout(&WORK, c, CLOSER_IDLE);
        c = guard;
        c.idle -= 1;
        if timeout.timed_out() && c.queue.is_empty() {
            c.threads -= 1;
            return;
        }
    }
}

/// Fds handed to the closers and not yet closed.
pub fn closes_pending() -> usize {
    let c = closers();
    c.queue.len() + c.closing
}

/// Waits up to `bound` until every fd handed to the closers is closed; false if some are
/// not (a close waits on its file's server). For checks that count fds.
pub fn wait_closed(bound: Duration) -> bool {
    let c = closers();
    let (c, _) = sync::wait_timeout_while(&CLOSED, c, bound, |c| !c.queue.is_empty() || c.closing > 0);
    c.queue.is_empty() && c.closing == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn memory_files_pipes_and_eventfds_close_at_once_other_files_elsewhere() {
        let memfd = nix::sys::memfd::memfd_create(c"t", nix::sys::memfd::MFdFlags::empty()).unwrap();
        let (r, w) = nix::unistd::pipe().unwrap();
        let efd = OwnedFd::from(
            nix::sys::eventfd::EventFd::from_flags(nix::sys::eventfd::EfdFlags::empty()).unwrap(),
        );
        let (s1, _s2) = std::os::unix::net::UnixStream::pair().unwrap();
        for fd in [memfd.as_fd(), r.as_fd(), w.as_fd(), efd.as_fd(), s1.as_fd()] {
            assert!(closes_at_once(fd));
        }
        // Of anonymous inodes, eventfds only.
        let epoll = nix::sys::epoll::Epoll::new(nix::sys::epoll::EpollCreateFlags::empty()).unwrap();
        assert!(!closes_at_once(epoll.0.as_fd()));
        let proc = std::fs::File::open("/proc/self/status").unwrap();
        let null = std::fs::File::open("/dev/null").unwrap();
        assert!(!closes_at_once(proc.as_fd()) && !closes_at_once(null.as_fd()));
        drop(ClientFd::from(OwnedFd::from(proc)));
        drop(ClientFd::from(OwnedFd::from(null)));
        // A closer closed them (`tests/client_fds.rs` shows one whose close waits).
        assert!(wait_closed(Duration::from_secs(60)), "the closers never closed them");
        // into_owned hands the fd over open.
        let (r, _w) = nix::unistd::pipe().unwrap();
        let raw = r.as_raw_fd();
        let owned = ClientFd::from(r).into_owned();
        // SAFETY: F_GETFD reads the fd table entry only.
        assert!(unsafe { libc::fcntl(raw, libc::F_GETFD) } >= 0);
        drop(owned);
    }
}
