//! The daemon: many device instances in one process, each on its own UNIX socket.
//!
//! Each instance has an acceptor thread and, while a client is connected, a connection
//! thread; instances share nothing but the process, so a client flooding one instance slows
//! only that one. One client per instance at a time: a second client while a live one is
//! connected is accepted and closed at once (it sees end-of-file before any reply; QEMU
//! reports the connection closed rather than waiting out its 5 s reply timeout); a client
//! after one that left, however it left (its process exited included), is served once the
//! cleanup is done.
//! Sockets are created mode 0600.

use std::collections::BTreeMap;
use std::io;
use std::os::fd::{AsFd, AsRawFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::Duration;

use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
use nix::sys::eventfd::{EfdFlags, EventFd};
use serde::Serialize;
use thiserror::Error;
use umdev_mdev::unix_socket::{bind_private, BindError};
use umdev_mdev::VfioDevice;
use umdev_pinning::sync::{lock, wait_timeout};
use umdev_pinning::{DmaSpace, DmaSpaceConfig, DmaStats};

use crate::connection::{serve, Served};
use crate::stats::{ServerStats, StatsSnapshot};
use crate::wire::Limits;

/// Why the daemon refused an operation.
#[derive(Debug, Error)]
pub enum DaemonError {
    /// An instance with this id already runs.
    #[error("instance {0} already exists")]
    Exists(String),
    /// No instance has this id.
    #[error("no instance {0}")]
    NotFound(String),
    /// A client is connected and the stop was not forced.
    #[error("instance {0} has a client connected (force to disconnect it)")]
    Busy(String),
    /// The instance's socket could not be bound.
    #[error(transparent)]
    Bind(#[from] BindError),
    /// The instance's thread could not be started.
    #[error("starting the server thread for {path}: {source}")]
    Thread {
        /// The socket path.
        path: PathBuf,
        /// The error.
        source: io::Error,
    },
}

/// How to run one instance.
#[derive(Clone, Debug)]
pub struct InstanceConfig {
    /// Its id (an mdev UUID, or any name).
    pub id: String,
    /// The UNIX socket clients connect to.
    pub socket: PathBuf,
    /// The client's DMA space (pin mode, lock account, limits).
    pub dma: DmaSpaceConfig,
    /// Protocol limits.
    pub limits: Limits,
    /// A client that does not read its replies for this long is disconnected.
    pub send_timeout: Duration,
    /// Opt-in adaptive busy-polling after each reply, up to this long (zero: off). Trades
    /// CPU for latency when client and server run on different CPUs.
    pub busy_poll: Duration,
}

impl InstanceConfig {
    /// An instance with default limits.
    pub fn new(id: impl Into<String>, socket: impl Into<PathBuf>) -> Self {
        InstanceConfig {
            id: id.into(),
            socket: socket.into(),
            dma: DmaSpaceConfig::default(),
            limits: Limits::default(),
            send_timeout: Duration::from_secs(10),
            busy_poll: Duration::ZERO,
        }
    }
}

/// What the daemon knows of an instance, by its id (`umdev stats` shows it under the
/// instance's `uuid`, as `umdev list` names it).
#[derive(Clone, Debug, Serialize)]
pub struct InstanceInfo {
    /// Its id.
    pub id: String,
    /// Its socket.
    pub socket: PathBuf,
    /// A client is connected now.
    pub connected: bool,
    /// Protocol counters.
    pub protocol: StatsSnapshot,
    /// Pinning-engine counters of its DMA space.
    pub dma: DmaStats,
    /// What the device shows of itself ([`VfioDevice::describe`]): a serial port's pty
    /// path, say.
    #[serde(skip_serializing_if = "serde_json::Value::is_null")]
    pub device: serde_json::Value,
}

struct Instance {
    config: InstanceConfig,
    served: Arc<Served>,
    /// The connected client: a handle on its socket (to cut it on stop) and its process.
    active: Mutex<Option<Active>>,
    /// Clients waiting for a handover now, each by its thread's token: only those still
    /// connected count against [`MAX_HANDOVERS`].
    handovers: Mutex<Vec<(u64, UnixStream)>>,
    /// The next handover's token.
    next_handover: std::sync::atomic::AtomicU64,
    /// Signalled when the connected client's cleanup is done.
    idle: Condvar,
    stop: EventFd,
    /// Connection and handover threads (finished ones are pruned as new ones start).
    threads: Mutex<Vec<JoinHandle<()>>>,
    acceptor: Mutex<Option<JoinHandle<()>>>,
    /// Set under `active`'s lock when the instance is being stopped: no client is admitted
    /// after that.
    stopping: AtomicBool,
}

/// The connected client.
struct Active {
    stream: UnixStream,
    /// Its process (SO_PEERCRED), when known in this pid namespace.
    pid: Option<i32>,
}

impl Active {
    /// False once the client's process has exited (or is a zombie): its socket is about to
    /// close even if it has not yet. Unknown processes count as gone, so that a client whose
    /// predecessor lingers is given the grace rather than turned away.
    fn process_alive(&self) -> bool {
        let Some(pid) = self.pid else { return false };
        match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
            // The state follows the parenthesised command name.
            Ok(stat) => stat.rsplit_once(") ").is_some_and(|(_, rest)| !rest.starts_with(['Z', 'X'])),
            Err(_) => false,
        }
    }
}

/// What the connected-client slot holds, as a new client sees it.
enum Slot {
    /// No client: serve the new one.
    Free,
    /// A client that is still there: the new one is turned away at once.
    Live,
    /// A client that hung up; its cleanup is under way.
    Leaving,
    /// A client whose process has exited but whose socket has not closed yet.
    ProcessGone,
}

impl Slot {
    fn of(active: &Option<Active>) -> Slot {
        match active {
            None => Slot::Free,
            Some(a) if hangs_up_within(&a.stream, Duration::ZERO) => Slot::Leaving,
            Some(a) if !a.process_alive() => Slot::ProcessGone,
            Some(_) => Slot::Live,
        }
    }
}

/// The client process at the other end of `stream`.
pub(crate) fn peer_pid(stream: &UnixStream) -> Option<i32> {
    let creds = nix::sys::socket::getsockopt(stream, nix::sys::socket::sockopt::PeerCredentials).ok()?;
    (creds.pid() > 0).then_some(creds.pid())
}

/// At most this many clients wait for a handover at once; more are turned away. Clients that
/// hung up while they waited do not count.
const MAX_HANDOVERS: usize = 4;
/// Handover threads at most, counting those whose clients hung up and that have not
/// noticed yet (each looks every [`HANDOVER_LOOK`]).
const MAX_HANDOVER_THREADS: usize = 4 * MAX_HANDOVERS;
/// How often a client waiting for a handover is looked at: one that hung up meanwhile stops
/// counting at once and its thread ends by then.
const HANDOVER_LOOK: Duration = Duration::from_millis(10);

impl Instance {
    fn info(&self) -> InstanceInfo {
        InstanceInfo {
            id: self.config.id.clone(),
            socket: self.config.socket.clone(),
            connected: lock(&self.active).is_some(),
            protocol: self.served.stats.snapshot(),
            dma: self.served.dma.stats(),
            device: self.served.device.describe(),
        }
    }

    fn accept_loop(self: Arc<Self>, listener: UnixListener) {
        loop {
            let mut fds = [
                PollFd::new(listener.as_fd(), PollFlags::POLLIN),
                PollFd::new(self.stop.as_fd(), PollFlags::POLLIN),
            ];
            match poll(&mut fds, PollTimeout::NONE) {
                Ok(_) | Err(nix::errno::Errno::EINTR) => {}
                Err(e) => {
                    log::error!("instance {}: poll failed: {e}", self.config.id);
                    return;
                }
            }
            if fds[1].any().unwrap_or(false) {
                return;
            }
            match listener.accept() {
                Ok((stream, _)) => self.clone().admit(stream),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock || e.kind() == io::ErrorKind::Interrupted => {
                }
                Err(e) => {
                    // Out of fds, say: back off rather than spin.
                    log::warn!("instance {}: accept failed: {e}", self.config.id);
                    std::thread::sleep(Duration::from_millis(50));
                }
            }
        }
    }

    /// Decides at once what to do with a new client: serve it (no one connected), turn it
    /// away (a live client is connected), or, if the connected client has gone or its
    /// process has exited, hand over once the old connection's cleanup is done. Handovers
    /// wait on a thread of their own, so the acceptor never blocks.
    fn admit(self: Arc<Self>, stream: UnixStream) {
        let id = &self.config.id;
        let setup = stream
            .set_nonblocking(false)
            .and_then(|()| stream.set_write_timeout(Some(self.config.send_timeout)));
        if let Err(e) = setup {
            return log::warn!("instance {id}: cannot set up a client socket: {e}");
        }
        {
            let mut active = lock(&self.active);
            match Slot::of(&active) {
                Slot::Free => return self.clone().connect(&mut active, stream),
                Slot::Live => {
                    drop(active);
                    return self.turn_away("a client is already connected");
                }
                Slot::Leaving | Slot::ProcessGone => {}
            }
        }
        // A client that connected and closed at once (a probe, a client that gave up) waits
        // for nothing.
        if hangs_up_within(&stream, Duration::ZERO) {
            return log::debug!("instance {id}: a new connection closed before it was served");
        }
        let token = self.next_handover.fetch_add(1, Ordering::Relaxed);
        {
            let mut waiting = lock(&self.handovers);
            let threads = waiting.len();
            let live = waiting.iter().filter(|(_, s)| !hangs_up_within(s, Duration::ZERO)).count();
            if live >= MAX_HANDOVERS || threads >= MAX_HANDOVER_THREADS {
                drop(waiting);
                return self.turn_away("too many clients waiting for a handover");
            }
            match stream.try_clone() {
                Ok(handle) => waiting.push((token, handle)),
                Err(e) => return log::warn!("instance {id}: cannot set up a client socket: {e}"),
            }
        }
        let me = self.clone();
        let done = move |me: &Instance| lock(&me.handovers).retain(|(t, _)| *t != token);
        let spawned = std::thread::Builder::new().name(format!("umdev-handover-{id}")).spawn(move || {
            me.hand_over(stream);
            done(&me);
        });
        match spawned {
            Ok(thread) => self.keep(thread),
            Err(e) => {
                lock(&self.handovers).retain(|(t, _)| *t != token);
                log::error!("instance {id}: cannot spawn a handover thread: {e}");
            }
        }
    }

    /// Waits until the client before `stream` has gone and its cleanup (reset, unpin,
    /// unmap) is done, then serves `stream`; as long as the connected client is on its way
    /// out, a client that arrived earlier but went away itself does not keep this one out.
    fn hand_over(self: &Arc<Self>, stream: UnixStream) {
        let budget = HANGUP_GRACE + self.config.dma.unmap_timeout + HANDOVER_SLACK;
        let deadline = std::time::Instant::now() + budget;
        // When the predecessor's process was first seen gone with its socket still open.
        let mut lingering: Option<std::time::Instant> = None;
        loop {
            if hangs_up_within(&stream, Duration::ZERO) {
                return log::debug!("instance {}: a client waiting for a handover left", self.config.id);
            }
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            let mut active = lock(&self.active);
            if self.stopping.load(Ordering::Acquire) {
                return log::info!("instance {}: stopping; closing a new connection", self.config.id);
            }
            match Slot::of(&active) {
                Slot::Free => return self.clone().connect(&mut active, stream),
                Slot::Live => {
                    drop(active);
                    return self.turn_away("a client is already connected");
                }
                _ if left.is_zero() => {
                    drop(active);
                    return self.turn_away("the previous client's cleanup did not finish in time");
                }
                Slot::Leaving => {
                    // Its cleanup is under way: wait for it (or for the next change), looking
                    // at whether this client is still there meanwhile.
                    let _ = wait_timeout(&self.idle, active, left.min(HANDOVER_LOOK));
                }
                Slot::ProcessGone => {
                    // Its process exited; its socket lingers (QEMU's io_uring holds the file
                    // for milliseconds). Wait for it to close, up to HANGUP_GRACE, looking at
                    // whether this client is still there meanwhile.
                    let since = *lingering.get_or_insert_with(std::time::Instant::now);
                    let grace = HANGUP_GRACE.saturating_sub(since.elapsed());
                    if grace.is_zero() {
                        drop(active);
                        return self
                            .turn_away("the previous client's process exited but its connection lingers");
                    }
                    let Some(predecessor) = active.as_ref().and_then(|a| a.stream.try_clone().ok()) else {
                        continue;
                    };
                    drop(active);
                    let _ =
                        hangs_up_within_or_stop(&predecessor, &self.stop, left.min(grace).min(HANDOVER_LOOK));
                }
            }
        }
    }

    fn turn_away(&self, why: &str) {
        let id = &self.config.id;
        if self.stopping.load(Ordering::Acquire) {
            return log::info!("instance {id}: stopping; closing a new connection");
        }
        let rejected = self.served.stats.rejected.fetch_add(1, Ordering::Relaxed) + 1;
        // A storm of connections must not flood the log: the first few, then every 1000th
        // (the statistics count them all).
        if rejected <= 8 || rejected.is_multiple_of(1000) {
            log::warn!("instance {id}: {why}; closing the new connection ({rejected} turned away so far)");
        } else {
            log::debug!("instance {id}: {why}; closing the new connection");
        }
    }

    /// Makes `stream` the connected client (the slot, held by the caller's lock, is free)
    /// and serves it on a new connection thread.
    fn connect(self: Arc<Self>, active: &mut MutexGuard<'_, Option<Active>>, stream: UnixStream) {
        let id = &self.config.id;
        if self.stopping.load(Ordering::Acquire) {
            return log::info!("instance {id}: stopping; closing a new connection");
        }
        let handle = match stream.try_clone() {
            Ok(handle) => handle,
            Err(e) => return log::warn!("instance {id}: cannot set up a client socket: {e}"),
        };
        **active = Some(Active { pid: peer_pid(&handle), stream: handle });
        let me = self.clone();
        let spawned = std::thread::Builder::new().name(format!("umdev-conn-{id}")).spawn(move || {
            log::info!("instance {}: client connected", me.config.id);
            let end = serve(stream, &me.served);
            log::info!("instance {}: client gone ({end})", me.config.id);
            *lock(&me.active) = None;
            me.idle.notify_all();
        });
        match spawned {
            Ok(thread) => self.keep(thread),
            Err(e) => {
                log::error!("instance {id}: cannot spawn a connection thread: {e}");
                **active = None;
                self.idle.notify_all();
            }
        }
    }

    /// Keeps `thread` for the join at shutdown, pruning finished ones.
    fn keep(&self, thread: JoinHandle<()>) {
        let mut threads = lock(&self.threads);
        threads.retain(|t| !t.is_finished());
        threads.push(thread);
    }

    /// Stops accepting, cuts the client, waits for the threads, removes the socket.
    fn shut_down(&self) {
        {
            let _active = lock(&self.active);
            self.stopping.store(true, Ordering::Release);
        }
        self.idle.notify_all();
        let _ = self.stop.write(1);
        // The acceptor first: once it is gone, no connection can start behind our back.
        if let Some(acceptor) = lock(&self.acceptor).take() {
            let _ = acceptor.join();
        }
        if let Some(active) = lock(&self.active).as_ref() {
            let _ = active.stream.shutdown(std::net::Shutdown::Both);
        }
        let threads = std::mem::take(&mut *lock(&self.threads));
        for t in threads {
            let _ = t.join();
        }
    }

    /// Removes its socket file, unless `instances` (the daemon's, locked by the caller) has
    /// another instance on the same path: one started while this one's cleanup ran, which
    /// took the path over (the file looked stale once this one's listener closed) and
    /// whose file it is now. Starts bind under the same lock, so none slips in between.
    fn remove_socket(&self, instances: &BTreeMap<String, Arc<Instance>>) {
        if instances.values().any(|other| other.config.socket == self.config.socket) {
            return;
        }
        if let Err(e) = std::fs::remove_file(&self.config.socket) {
            if e.kind() != io::ErrorKind::NotFound {
                log::warn!("removing {}: {e}", self.config.socket.display());
            }
        }
    }
}

/// How much longer than the unmap timeout a reconnecting client waits for its predecessor's
/// cleanup.
const HANDOVER_SLACK: Duration = Duration::from_secs(1);

/// How long a client whose predecessor's process has exited waits for the predecessor's
/// socket to close. A process's sockets can outlive it by milliseconds: QEMU polls its fds
/// through io_uring, and the kernel drops a ring's file references in a worker after the
/// process has exited. A QEMU restarted at once (a management stack, after SIGTERM) would
/// otherwise find its predecessor apparently still connected and be turned away.
const HANGUP_GRACE: Duration = Duration::from_secs(2);

/// True if the client at the other end of `stream` has closed or shut down its side, or
/// does so within `grace`.
///
/// Reads the raw `revents`: nix's `PollFd::revents()` returns `None` as soon as the kernel
/// reports a bit nix has no name for, and POLLRDHUP is such a bit, so a check through it
/// never saw a hang-up (and a reconnecting client was turned away).
fn hangs_up_within(stream: &UnixStream, grace: Duration) -> bool {
    poll_hangup(stream, None, grace)
}

/// As [`hangs_up_within`], but gives up (false) as soon as `stop` is signalled.
fn hangs_up_within_or_stop(stream: &UnixStream, stop: &EventFd, grace: Duration) -> bool {
    poll_hangup(stream, Some(stop), grace)
}

fn poll_hangup(stream: &UnixStream, stop: Option<&EventFd>, grace: Duration) -> bool {
    let deadline = std::time::Instant::now() + grace;
    loop {
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        let mut fds = [
            libc::pollfd { fd: stream.as_raw_fd(), events: libc::POLLRDHUP, revents: 0 },
            libc::pollfd { fd: stop.map_or(-1, |s| s.as_fd().as_raw_fd()), events: libc::POLLIN, revents: 0 },
        ];
        // SAFETY: two valid pollfds (a negative fd is ignored by poll) for fds we hold for the
        // duration of the call.
        let ready = unsafe { libc::poll(fds.as_mut_ptr(), 2, left.as_millis().min(i32::MAX as u128) as i32) };
        if ready > 0 {
            if fds[1].revents != 0 {
                return false;
            }
            return fds[0].revents & (libc::POLLRDHUP | libc::POLLHUP | libc::POLLERR) != 0;
        }
        let interrupted = ready < 0 && io::Error::last_os_error().kind() == io::ErrorKind::Interrupted;
        if !interrupted || left.is_zero() {
            return false;
        }
    }
}

/// Device instances served by this process.
#[derive(Default)]
pub struct Daemon {
    instances: Mutex<BTreeMap<String, Arc<Instance>>>,
}

impl Daemon {
    /// A daemon with no instances.
    pub fn new() -> Self {
        Self::default()
    }

    /// Starts serving `device` on `config.socket`.
    pub fn start(&self, device: Arc<dyn VfioDevice>, config: InstanceConfig) -> Result<(), DaemonError> {
        let mut instances = lock(&self.instances);
        if instances.contains_key(&config.id) {
            return Err(DaemonError::Exists(config.id));
        }
        let listener = bind_private(&config.socket)?;
        // A start that fails from here on leaves no socket file behind.
        let io_err = |source| {
            let _ = std::fs::remove_file(&config.socket);
            DaemonError::Thread { path: config.socket.clone(), source }
        };
        let stop = EventFd::from_flags(EfdFlags::EFD_NONBLOCK | EfdFlags::EFD_CLOEXEC)
            .map_err(|e| io_err(e.into()))?;
        let mut dma_config = config.dma.clone();
        dma_config.max_mappings = dma_config.max_mappings.min(config.limits.max_dma_maps as usize);
        let served = Served {
            device,
            dma: DmaSpace::new(dma_config),
            limits: config.limits.clone(),
            stats: Arc::new(ServerStats::default()),
            busy_poll: config.busy_poll,
        };
        let instance = Arc::new(Instance {
            config: config.clone(),
            served: Arc::new(served),
            active: Mutex::new(None),
            handovers: Mutex::new(Vec::new()),
            next_handover: std::sync::atomic::AtomicU64::new(0),
            idle: Condvar::new(),
            stop,
            threads: Mutex::new(Vec::new()),
            acceptor: Mutex::new(None),
            stopping: AtomicBool::new(false),
        });
        let acceptor = instance.clone();
        let thread = std::thread::Builder::new()
            .name(format!("umdev-accept-{}", config.id))
            .spawn(move || acceptor.accept_loop(listener))
            .map_err(io_err)?;
        *lock(&instance.acceptor) = Some(thread);
        log::info!("instance {} listening on {}", config.id, config.socket.display());
        instances.insert(config.id, instance);
        Ok(())
    }

    /// Stops an instance; refused while a client is connected unless `force`, which
    /// disconnects it (and so resets the device).
    pub fn stop(&self, id: &str, force: bool) -> Result<(), DaemonError> {
        let instance = {
            let mut instances = lock(&self.instances);
            let instance = instances.get(id).ok_or_else(|| DaemonError::NotFound(id.to_string()))?;
            let active = lock(&instance.active);
            if !force && active.is_some() {
                return Err(DaemonError::Busy(id.to_string()));
            }
            if active.is_some() {
                // A client that polls (SPDK's initiator) does not notice: say so where the
                // operator looks.
                log::info!("instance {id}: stopped with its client connected: the client is disconnected");
            }
            // Under the same lock as the check: no client slips in between.
            instance.stopping.store(true, Ordering::Release);
            drop(active);
            instances.remove(id).expect("present: checked under the same lock")
        };
        instance.shut_down();
        instance.remove_socket(&lock(&self.instances));
        // Its counters are gone with it: the last of them for the log, as `umdev run` prints
        // its device's when it stops.
        if let Ok(info) = serde_json::to_string(&instance.info()) {
            log::info!("instance {id} stopped: {info}");
        }
        Ok(())
    }

    /// One instance's state and counters.
    pub fn info(&self, id: &str) -> Option<InstanceInfo> {
        lock(&self.instances).get(id).map(|i| i.info())
    }

    /// Every instance, by id.
    pub fn list(&self) -> Vec<InstanceInfo> {
        lock(&self.instances).values().map(|i| i.info()).collect()
    }

    /// Stops every instance and removes their sockets.
    pub fn shutdown(&self) {
        let instances = std::mem::take(&mut *lock(&self.instances));
        for instance in instances.values() {
            instance.shut_down();
            instance.remove_socket(&lock(&self.instances));
        }
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        self.shutdown();
    }
}
