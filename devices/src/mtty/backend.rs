//! What each port's serial line is connected to on the host: a loopback plug (the kernel
//! sample's behaviour, the default), nothing, a pseudo-terminal, or a UNIX socket.
//!
//! A host peer is served by one thread per port that moves bytes between the peer's fd and
//! the port's two bounded queues ([`super::HOST_QUEUE`] bytes each way). The queues belong to
//! the port, not to the peer: a peer that goes and comes back loses nothing queued. The
//! thread reads from the peer only while the queue toward the guest has room, so the guest
//! paces the host; it writes to the peer only what the peer takes, so a peer that never
//! reads stalls that port's transmitter and nothing else.

use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
use nix::sys::eventfd::{EfdFlags, EventFd};

use super::{Mtty, MttyError};
use umdev_mdev::pci::SharedRef;

/// Where a port's line goes, as given in `--opt backend=...` or `--opt portN=...`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Backend {
    /// Every transmitted byte arrives on the same port's receiver (the kernel sample's
    /// loopback; the default).
    Loopback,
    /// Transmitted bytes vanish; nothing arrives.
    Null,
    /// A host pseudo-terminal; its path is in the device's description.
    Pty,
    /// A UNIX listening socket (mode 0600) at this path: one host client at a time sees the
    /// port's bytes both ways.
    Socket(PathBuf),
    /// The host side stays in this process, reached through [`super::HostPort`] (for
    /// embedding and tests; not offered on the command line).
    Queue,
}

impl Backend {
    /// Parses `loopback`, `null`, `pty` or `socket:PATH`.
    /// The words in any case, as every option's words; a socket's path as given.
    pub fn parse(spec: &str) -> Result<Backend, String> {
        let (word, rest) = spec.split_once(':').map_or((spec, None), |(w, r)| (w, Some(r)));
        match (word.to_ascii_lowercase().as_str(), rest) {
            ("loopback", None) => Ok(Backend::Loopback),
            ("null", None) => Ok(Backend::Null),
            ("pty", None) => Ok(Backend::Pty),
            _ => match rest.filter(|_| word.eq_ignore_ascii_case("socket")) {
                Some("") => Err("socket: needs a path (socket:PATH)".into()),
                Some(path) if !path.starts_with('/') => Err(format!(
                    "socket:{path}: the path must be absolute (the daemon's directory is not yours)"
                )),
                Some(path) => Ok(Backend::Socket(PathBuf::from(path))),
                None => Err(format!("unknown backend {spec:?} (loopback, null, pty or socket:PATH)")),
            },
        }
    }

    /// Its name, as parsed.
    pub fn name(&self) -> String {
        match self {
            Backend::Loopback => "loopback".into(),
            Backend::Null => "null".into(),
            Backend::Pty => "pty".into(),
            Backend::Socket(path) => format!("socket:{}", path.display()),
            Backend::Queue => "queue".into(),
        }
    }
}

/// An opened host endpoint, before its thread starts.
pub(super) enum Endpoint {
    /// The pty's master side, and umdev's own hold on the slave side.
    Pty { master: OwnedFd, slave: SlaveHold },
    /// The listening socket.
    Socket { listener: UnixListener, path: PathBuf },
}

impl Drop for Endpoint {
    fn drop(&mut self) {
        // A socket goes with its endpoint: a device that failed to start (another port's
        // backend refused, say) leaves no socket file behind. A running port's socket is
        // removed when its thread, which owns the endpoint, ends.
        if let Endpoint::Socket { path, .. } = self {
            let _ = std::fs::remove_file(path);
        }
    }
}

impl Endpoint {
    /// Opens what `backend` needs on the host (nothing for in-process lines).
    pub(super) fn open(backend: &Backend) -> Result<Option<Endpoint>, MttyError> {
        match backend {
            Backend::Pty => open_pty().map(Some).map_err(MttyError::Backend),
            Backend::Socket(path) => {
                let listener = umdev_mdev::unix_socket::bind_private(path)
                    .map_err(|e| MttyError::Backend(format!("socket backend: {e}")))?;
                Ok(Some(Endpoint::Socket { listener, path: path.clone() }))
            }
            _ => Ok(None),
        }
    }

    /// The host path a user attaches to.
    pub(super) fn path(&self) -> &Path {
        match self {
            Endpoint::Pty { slave, .. } => &slave.path,
            Endpoint::Socket { path, .. } => path,
        }
    }
}

fn open_pty() -> Result<Endpoint, String> {
    use nix::sys::termios::tcgetattr;
    let pty = nix::pty::openpty(None, None).map_err(|e| format!("openpty: {e}"))?;
    let defaults = tcgetattr(&pty.slave).map_err(|e| format!("pty modes: {e}"))?;
    make_raw(&pty.slave, &defaults).map_err(|e| format!("pty modes: {e}"))?;
    let path = nix::unistd::ttyname(&pty.slave).map_err(|e| format!("pty name: {e}"))?;
    set_nonblocking(pty.master.as_fd()).map_err(|e| format!("pty: {e}"))?;
    Ok(Endpoint::Pty {
        master: pty.master,
        slave: SlaveHold { fd: pty.slave, path, defaults, retry_at: None },
    })
}

/// Raw, so bytes cross unchanged until a program (screen, minicom) sets its own modes.
fn make_raw(slave: &OwnedFd, modes: &nix::sys::termios::Termios) -> nix::Result<()> {
    use nix::sys::termios::{cfmakeraw, tcsetattr, SetArg};
    let mut raw = modes.clone();
    cfmakeraw(&mut raw);
    tcsetattr(slave, SetArg::TCSANOW, &raw)
}

/// umdev's own open of a pty's slave side. While it is open the master never sees a hang-up
/// when no host program has the terminal open. A hang-up (`vhangup`, or the exit of a
/// session leader whose controlling terminal it was) kills this open too and resets the
/// terminal's modes to the kernel's cooked defaults (echo, CR/LF mapping); the port's thread
/// then opens the slave again and, if the modes are still those defaults (no program has set
/// its own since), makes it raw again.
pub(super) struct SlaveHold {
    fd: OwnedFd,
    path: PathBuf,
    /// The modes a new pty has (what a hang-up resets it to).
    defaults: nix::sys::termios::Termios,
    /// A renewal that failed is tried again from then.
    retry_at: Option<std::time::Instant>,
}

impl SlaveHold {
    /// After a hang-up: holds a fresh open of the slave, raw again unless a program has set
    /// its own modes.
    fn renew(&mut self, port: usize) {
        use nix::fcntl::{open, OFlag};
        use nix::sys::termios::tcgetattr;
        let flags = OFlag::O_RDWR | OFlag::O_NOCTTY | OFlag::O_CLOEXEC | OFlag::O_NONBLOCK;
        let renewed = open(&self.path, flags, nix::sys::stat::Mode::empty()).and_then(|fd| {
            let modes = tcgetattr(&fd)?;
            let flags = |m: &nix::sys::termios::Termios| {
                (m.input_flags, m.output_flags, m.control_flags, m.local_flags)
            };
            if flags(&modes) == flags(&self.defaults) {
                make_raw(&fd, &modes)?;
            }
            Ok(fd)
        });
        match renewed {
            Ok(fd) => {
                log::info!("mtty port {port}: pty {} was hung up; held again", self.path.display());
                self.fd = fd;
                self.retry_at = None;
            }
            Err(e) => {
                log::debug!("mtty port {port}: pty {} hung up, reopening: {e}", self.path.display());
                self.retry_at = Some(std::time::Instant::now() + TICK);
            }
        }
    }
}

fn set_nonblocking(fd: BorrowedFd<'_>) -> io::Result<()> {
    use nix::fcntl::{fcntl, FcntlArg, OFlag};
    let flags = fcntl(fd, FcntlArg::F_GETFL)?;
    fcntl(fd, FcntlArg::F_SETFL(OFlag::from_bits_retain(flags) | OFlag::O_NONBLOCK))?;
    Ok(())
}

/// A running host endpoint: its thread, and how to wake it.
#[derive(Debug)]
pub(super) struct HostThread {
    wake: Arc<EventFd>,
    thread: Option<JoinHandle<()>>,
    /// Whether a host peer is attached now (sockets).
    connected: Arc<AtomicBool>,
}

impl HostThread {
    /// The eventfd the port signals when its queues change.
    pub(super) fn wake_fd() -> Result<Arc<EventFd>, MttyError> {
        EventFd::from_flags(EfdFlags::EFD_NONBLOCK | EfdFlags::EFD_CLOEXEC)
            .map(Arc::new)
            .map_err(|e| MttyError::Backend(format!("eventfd: {e}")))
    }

    /// Starts serving `endpoint` for `port` of the card.
    pub(super) fn start(
        mtty: SharedRef<Mtty>,
        port: usize,
        endpoint: Endpoint,
        wake: Arc<EventFd>,
    ) -> Result<HostThread, MttyError> {
        let connected = Arc::new(AtomicBool::new(false));
        let worker = Worker { mtty, port, wake: wake.clone(), connected: connected.clone() };
        let thread = std::thread::Builder::new()
            .name(format!("umdev-mtty-host{port}"))
            .spawn(move || worker.run(endpoint))
            .map_err(|e| MttyError::Backend(format!("host thread: {e}")))?;
        Ok(HostThread { wake, thread: Some(thread), connected })
    }

    /// Wakes the thread (it then sees that the device is going, or a queue changed).
    pub(super) fn wake(&self) {
        let _ = self.wake.write(1);
    }

    /// Whether a host peer is attached.
    pub(super) fn connected(&self) -> bool {
        self.connected.load(Ordering::Acquire)
    }
}

impl Drop for HostThread {
    fn drop(&mut self) {
        self.wake();
        if let Some(thread) = self.thread.take().filter(|t| t.thread().id() != std::thread::current().id()) {
            // The thread owns the endpoint: its socket file goes when the thread ends.
            let _ = thread.join();
        }
    }
}

/// While host bytes wait for the receiver, the port is re-checked this often (a receiver the
/// guest ignores starts to overrun).
const TICK: Duration = Duration::from_millis(100);

struct Worker {
    mtty: SharedRef<Mtty>,
    port: usize,
    wake: Arc<EventFd>,
    connected: Arc<AtomicBool>,
}

/// The connected peer: the pty master, or the socket's current client. Its two directions
/// close independently: a client that shuts down its writing side still gets the guest's
/// output, and one that stops reading still has what it sent delivered.
struct Peer {
    fd: OwnedFd,
    /// A socket client (sent to with MSG_NOSIGNAL) rather than the pty master.
    socket: bool,
    /// End of file seen: nothing more will come from the peer.
    read_closed: bool,
    /// Writing failed (the peer closed): bytes for the host stay queued for the next one.
    write_closed: bool,
    /// The peer hung up while the queue toward the guest was full: not polled (poll would
    /// report the hang-up again at once) until the guest makes room.
    parked: bool,
    /// A pty that reported an error is left alone until then (it is never dropped).
    backoff_until: Option<std::time::Instant>,
}

impl Peer {
    fn new(fd: OwnedFd, socket: bool) -> Peer {
        Peer { fd, socket, read_closed: false, write_closed: false, parked: false, backoff_until: None }
    }

    /// A socket client that can neither send nor receive any more is gone.
    fn gone(&self) -> bool {
        self.socket && self.read_closed && self.write_closed
    }
}

impl Worker {
    fn run(self, endpoint: Endpoint) {
        // The endpoint (pty slave held open, socket file) lives until the thread ends.
        let mut endpoint = endpoint;
        match &mut endpoint {
            Endpoint::Pty { master, slave } => match master.try_clone() {
                Ok(master) => self.serve(None, Some(slave), Some(Peer::new(master, false))),
                Err(e) => log::error!("mtty port {}: pty: {e}", self.port),
            },
            Endpoint::Socket { listener, .. } => self.serve(Some(listener), None, None),
        }
    }

    fn serve(
        &self,
        listener: Option<&UnixListener>,
        mut slave: Option<&mut SlaveHold>,
        mut peer: Option<Peer>,
    ) {
        let mut out = [0u8; super::HOST_QUEUE];
        let mut input = [0u8; super::HOST_QUEUE];
        while !self.mtty.closed() {
            let state = self.mtty.lock().host_state(self.port);
            let now = std::time::Instant::now();
            let mut fds = Vec::with_capacity(3);
            fds.push(PollFd::new(self.wake.as_fd(), PollFlags::POLLIN));
            let listen_at = listener.as_ref().map(|l| {
                fds.push(PollFd::new(l.as_fd(), PollFlags::POLLIN));
                fds.len() - 1
            });
            let mut timeout = if state.waiting { Some(TICK) } else { None };
            // With no events, poll reports the held slave's hang-up (POLLHUP).
            let slave_at = match slave.as_deref() {
                Some(hold) => match hold.retry_at.filter(|&at| at > now) {
                    Some(at) => {
                        timeout = Some(timeout.map_or(at - now, |t| t.min(at - now)));
                        None
                    }
                    None => {
                        fds.push(PollFd::new(hold.fd.as_fd(), PollFlags::empty()));
                        Some(fds.len() - 1)
                    }
                },
                None => None,
            };
            let peer_at = match peer.as_mut() {
                Some(p) => {
                    if p.parked && state.room > 0 {
                        p.parked = false;
                    }
                    if let Some(until) = p.backoff_until.filter(|&u| u > now) {
                        timeout = Some(timeout.map_or(until - now, |t| t.min(until - now)));
                        None
                    } else if p.parked {
                        None
                    } else {
                        p.backoff_until = None;
                        let mut events = PollFlags::empty();
                        if state.room > 0 && !p.read_closed {
                            events |= PollFlags::POLLIN;
                        }
                        if state.to_host > 0 && !p.write_closed {
                            events |= PollFlags::POLLOUT;
                        }
                        // With no events, poll still reports a hang-up or an error.
                        fds.push(PollFd::new(p.fd.as_fd(), events));
                        Some(fds.len() - 1)
                    }
                }
                None => None,
            };
            let timeout = timeout.map_or(PollTimeout::NONE, |t| {
                PollTimeout::try_from(t.max(Duration::from_millis(1))).unwrap_or(PollTimeout::MAX)
            });
            match poll(&mut fds, timeout) {
                Ok(_) | Err(nix::errno::Errno::EINTR) => {}
                Err(e) => {
                    log::error!("mtty port {}: poll: {e}", self.port);
                    std::thread::sleep(TICK);
                    continue;
                }
            }
            let ready = |i: Option<usize>| i.and_then(|i| fds[i].revents()).unwrap_or(PollFlags::empty());
            let (wake, listen, peer_events) = (ready(Some(0)), ready(listen_at), ready(peer_at));
            let slave_hung_up = !ready(slave_at).is_empty();
            drop(fds);
            if let Some(hold) = slave.as_deref_mut().filter(|_| slave_hung_up) {
                hold.renew(self.port);
            }
            if wake.contains(PollFlags::POLLIN) {
                let _ = self.wake.read();
            }
            if listen.contains(PollFlags::POLLIN) {
                if let Some(l) = listener {
                    self.accept(l, &mut peer);
                }
            }
            if let Some(p) = peer.as_mut().filter(|_| !peer_events.is_empty()) {
                self.exchange(p, peer_events, &mut input, &mut out);
                if p.gone() {
                    peer = None;
                    self.connected.store(false, Ordering::Release);
                    log::info!("mtty port {}: host client gone", self.port);
                }
            }
            if state.waiting {
                self.mtty.lock().host_tick(self.port);
            }
        }
    }

    /// One host client at a time: a second one is closed at once.
    fn accept(&self, listener: &UnixListener, peer: &mut Option<Peer>) {
        match listener.accept() {
            Ok((stream, _)) if peer.is_none() => match stream.set_nonblocking(true) {
                Ok(()) => {
                    log::info!("mtty port {}: host client connected", self.port);
                    *peer = Some(Peer::new(OwnedFd::from(stream), true));
                    self.connected.store(true, Ordering::Release);
                }
                Err(e) => log::warn!("mtty port {}: host client: {e}", self.port),
            },
            Ok((stream, _)) => {
                log::warn!("mtty port {}: a host client is already attached; closing the new one", self.port);
                drop::<UnixStream>(stream);
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
            Err(e) => {
                log::warn!("mtty port {}: accept: {e}", self.port);
                std::thread::sleep(TICK);
            }
        }
    }

    /// Moves bytes between the peer and the port.
    fn exchange(&self, peer: &mut Peer, events: PollFlags, input: &mut [u8], out: &mut [u8]) {
        let hung_up = events.intersects(PollFlags::POLLHUP | PollFlags::POLLERR);
        if !peer.read_closed && (events.contains(PollFlags::POLLIN) || hung_up) {
            let room = self.mtty.lock().host_state(self.port).room.min(input.len());
            if room == 0 {
                // Keep what it sent until the guest makes room.
                peer.parked = true;
            } else {
                match nix::unistd::read(&peer.fd, &mut input[..room]) {
                    Ok(0) => peer.read_closed = true,
                    Ok(n) => {
                        self.mtty.lock().host_send(self.port, &input[..n]);
                    }
                    Err(nix::errno::Errno::EAGAIN | nix::errno::Errno::EINTR) => {}
                    Err(e) => self.failed(peer, "read", e),
                }
            }
        }
        if hung_up && peer.read_closed {
            // Both ways shut: nothing more can be written either.
            peer.write_closed = true;
        }
        if events.contains(PollFlags::POLLOUT) && !peer.write_closed {
            let n = self.mtty.lock().host_peek(self.port, out);
            if n > 0 {
                let written = if peer.socket {
                    nix::sys::socket::send(
                        peer.fd.as_raw_fd(),
                        &out[..n],
                        nix::sys::socket::MsgFlags::MSG_NOSIGNAL,
                    )
                } else {
                    nix::unistd::write(&peer.fd, &out[..n])
                };
                match written {
                    Ok(written) => self.mtty.lock().host_consumed(self.port, written),
                    Err(nix::errno::Errno::EAGAIN | nix::errno::Errno::EINTR) => {}
                    Err(e) => self.failed(peer, "write", e),
                }
            }
        }
        if !peer.socket && (peer.read_closed || peer.write_closed) {
            // A pty is never dropped: the terminal stays where it was printed. Its master can
            // report end of file or EIO when a host program hangs it up; try again later.
            peer.read_closed = false;
            peer.write_closed = false;
            peer.backoff_until = Some(std::time::Instant::now() + TICK);
        }
    }

    fn failed(&self, peer: &mut Peer, what: &str, e: nix::errno::Errno) {
        log::debug!("mtty port {}: host {what}: {e}", self.port);
        match what {
            "read" => peer.read_closed = true,
            _ => peer.write_closed = true,
        }
    }
}
