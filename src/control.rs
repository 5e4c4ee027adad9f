//! The daemon's control socket: JSON lines between `umdev <command>` and `umdev daemon`.
//!
//! One request per line, one response per line. The socket is mode 0600 in the run
//! directory, so only its owner (and root) can drive the daemon. Requests are bounded
//! (64 KiB a line, 16 connections at once).

use std::io::{self, BufRead, BufReader, Read, Write};
use std::os::fd::AsFd;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
use nix::sys::eventfd::{EfdFlags, EventFd};
use serde::{Deserialize, Serialize};
use thiserror::Error;
use umdev_mdev::types::InstanceOptions;
use umdev_mdev::unix_socket::{bind_private, BindError};
use uuid::Uuid;

use crate::lifecycle::{LifecycleError, Manager};

/// Longest request line accepted.
pub const MAX_REQUEST: u64 = 64 << 10;
const MAX_CONNECTIONS: usize = 16;

/// A request to the daemon.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
#[serde(tag = "op", rename_all = "lowercase")]
pub enum ControlRequest {
    /// The types and their available instances.
    Types,
    /// Start an instance (of a type, or a definition by UUID).
    Start {
        /// Type; `None` to start the definition of `uuid`.
        mdev_type: Option<String>,
        /// UUID; generated if `None`.
        uuid: Option<Uuid>,
        /// Creation options (of a defined device: only with `override_definition`).
        #[serde(default)]
        options: InstanceOptions,
        /// Put `options` over a definition's for this start.
        #[serde(default)]
        override_definition: bool,
    },
    /// Stop an instance.
    Stop {
        /// Which.
        uuid: Uuid,
        /// Disconnect a connected client.
        #[serde(default)]
        force: bool,
    },
    /// The running instances.
    List,
    /// The running instances, the defined ones `stop` stopped, and the last start errors.
    Status,
    /// One instance's counters.
    Stats {
        /// Which.
        uuid: Uuid,
    },
}

/// The daemon's answer.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct ControlResponse {
    /// Whether the request succeeded.
    pub ok: bool,
    /// The result, on success.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub result: Option<serde_json::Value>,
    /// What went wrong, on failure.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// The errno, on failure.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub errno: Option<i32>,
}

impl ControlResponse {
    fn success(result: impl Serialize) -> Self {
        ControlResponse { ok: true, result: serde_json::to_value(result).ok(), error: None, errno: None }
    }

    fn failure(error: String, errno: i32) -> Self {
        ControlResponse { ok: false, result: None, error: Some(error), errno: Some(errno) }
    }
}

/// Why a control request could not be made.
#[derive(Debug, Error)]
pub enum ControlError {
    /// Nothing listens on the control socket.
    #[error("the umdev daemon is not running (no control socket at {0}); start it with `umdev daemon`")]
    NotRunning(PathBuf),
    /// The control socket is there, but nothing listens: its daemon died.
    #[error(
        "the umdev daemon is not running: {0} is a stale control socket (its daemon died without \
         removing it); `umdev daemon` removes it when it starts"
    )]
    Stale(PathBuf),
    /// The daemon took the request and did not answer in time.
    #[error(
        "the umdev daemon at {} did not answer within {}s (is it stopped or stuck? `umdev list` \
         and its log say more)", .0.display(), ANSWER_TIMEOUT.as_secs()
    )]
    NoAnswer(PathBuf),
    /// The exchange failed.
    #[error("talking to the daemon: {0}")]
    Io(#[from] io::Error),
    /// The daemon's answer was not understood.
    #[error("bad answer from the daemon: {0}")]
    Protocol(String),
}

impl ControlError {
    /// True when no daemon answers (the control socket is missing or stale).
    pub fn not_running(&self) -> bool {
        matches!(self, ControlError::NotRunning(_) | ControlError::Stale(_))
    }
}

fn handle(manager: &Manager, request: ControlRequest) -> ControlResponse {
    let fail = |e: LifecycleError| ControlResponse::failure(e.to_string(), e.errno());
    match request {
        ControlRequest::Types => ControlResponse::success(manager.types()),
        ControlRequest::Start { mdev_type, uuid, options, override_definition } => manager
            .start(mdev_type.as_deref(), uuid, options, override_definition)
            .map(ControlResponse::success)
            .unwrap_or_else(fail),
        ControlRequest::Stop { uuid, force } => {
            manager.stop(uuid, force).map(|()| ControlResponse::success(uuid)).unwrap_or_else(fail)
        }
        ControlRequest::List => ControlResponse::success(manager.list()),
        ControlRequest::Status => ControlResponse::success(manager.status()),
        ControlRequest::Stats { uuid } => {
            manager.stats(uuid).map(ControlResponse::success).unwrap_or_else(fail)
        }
    }
}

fn serve_connection(manager: &Manager, stream: UnixStream) -> io::Result<()> {
    stream.set_read_timeout(Some(Duration::from_secs(60)))?;
    let mut writer = stream.try_clone()?;
    let mut reader = BufReader::new(stream);
    loop {
        let mut line = String::new();
        let n = (&mut reader).take(MAX_REQUEST).read_line(&mut line)?;
        if n == 0 {
            return Ok(());
        }
        let response = if !line.ends_with('\n') {
            // Over-long or truncated: answer, then drop the connection (the rest of the line
            // cannot be told from the next request).
            let r = ControlResponse::failure(format!("request longer than {MAX_REQUEST} bytes"), libc::E2BIG);
            writeln!(writer, "{}", serde_json::to_string(&r).unwrap_or_default())?;
            return Ok(());
        } else {
            match serde_json::from_str::<ControlRequest>(&line) {
                Ok(request) => handle(manager, request),
                Err(e) => ControlResponse::failure(format!("malformed request: {e}"), libc::EINVAL),
            }
        };
        writeln!(writer, "{}", serde_json::to_string(&response).unwrap_or_default())?;
    }
}

/// The control socket's server thread; stops (and removes the socket) on drop.
pub struct ControlServer {
    path: PathBuf,
    stop: EventFd,
    thread: Option<JoinHandle<()>>,
}

impl ControlServer {
    /// Listens on `path` (mode 0600) and serves requests against `manager`.
    pub fn start(manager: Arc<Manager>, path: &Path) -> Result<Self, BindError> {
        let listener = bind_private(path)?;
        let io_err = |source: io::Error| BindError::Io { what: "starting", path: path.to_path_buf(), source };
        let stop = EventFd::from_flags(EfdFlags::EFD_NONBLOCK | EfdFlags::EFD_CLOEXEC)
            .map_err(|e| io_err(e.into()))?;
        let stop_fd = stop.as_fd().try_clone_to_owned().map_err(io_err)?;
        let thread = std::thread::Builder::new()
            .name("umdev-control".into())
            .spawn(move || accept_loop(&manager, &listener, &stop_fd))
            .map_err(io_err)?;
        Ok(ControlServer { path: path.to_path_buf(), stop, thread: Some(thread) })
    }
}

fn accept_loop(manager: &Arc<Manager>, listener: &UnixListener, stop: &std::os::fd::OwnedFd) {
    let active = Arc::new(AtomicUsize::new(0));
    loop {
        let mut fds =
            [PollFd::new(listener.as_fd(), PollFlags::POLLIN), PollFd::new(stop.as_fd(), PollFlags::POLLIN)];
        if let Err(e) = poll(&mut fds, PollTimeout::NONE) {
            if e != nix::errno::Errno::EINTR {
                log::error!("control socket: poll failed: {e}");
                return;
            }
        }
        if fds[1].any().unwrap_or(false) {
            return;
        }
        let Ok((stream, _)) = listener.accept() else { continue };
        if active.load(Ordering::Acquire) >= MAX_CONNECTIONS {
            log::warn!("control socket: too many connections; closing one");
            continue;
        }
        let _ = stream.set_nonblocking(false);
        active.fetch_add(1, Ordering::AcqRel);
        let (manager, slots) = (manager.clone(), active.clone());
        let spawned = std::thread::Builder::new().name("umdev-control-conn".into()).spawn(move || {
            if let Err(e) = serve_connection(&manager, stream) {
                log::debug!("control connection: {e}");
            }
            slots.fetch_sub(1, Ordering::AcqRel);
        });
        if spawned.is_err() {
            // The connection went with the closure; its slot must come back too.
            active.fetch_sub(1, Ordering::AcqRel);
            log::warn!("control socket: cannot spawn a connection thread");
        }
    }
}

impl Drop for ControlServer {
    fn drop(&mut self) {
        let _ = self.stop.write(1);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        let _ = std::fs::remove_file(&self.path);
    }
}

/// How long a command waits for the daemon's answer: a start may fill a huge-page pool or
/// wait for a device's previous client to let go.
const ANSWER_TIMEOUT: Duration = Duration::from_secs(60);

/// Sends one request to the daemon listening on `path` and returns its answer.
pub fn request(path: &Path, request: &ControlRequest) -> Result<ControlResponse, ControlError> {
    let mut stream = match UnixStream::connect(path) {
        Ok(s) => s,
        Err(e) if e.kind() == io::ErrorKind::NotFound => {
            return Err(ControlError::NotRunning(path.to_path_buf()))
        }
        Err(e) if e.kind() == io::ErrorKind::ConnectionRefused => {
            return Err(ControlError::Stale(path.to_path_buf()))
        }
        Err(e) => return Err(e.into()),
    };
    stream.set_read_timeout(Some(ANSWER_TIMEOUT))?;
    stream.set_write_timeout(Some(ANSWER_TIMEOUT))?;
    let timed_out = |e: io::Error| match e.kind() {
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => ControlError::NoAnswer(path.to_path_buf()),
        _ => ControlError::Io(e),
    };
    let line = serde_json::to_string(request).map_err(|e| ControlError::Protocol(e.to_string()))?;
    writeln!(stream, "{line}").map_err(timed_out)?;
    let mut answer = String::new();
    BufReader::new(stream).take(16 << 20).read_line(&mut answer).map_err(timed_out)?;
    serde_json::from_str(&answer).map_err(|e| ControlError::Protocol(e.to_string()))
}
