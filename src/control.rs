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
use std::sync::{Arc, OnceLock};
use std::thread::JoinHandle;
use std::time::Duration;

use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
use nix::sys::eventfd::{EfdFlags, EventFd};
use serde::{Deserialize, Serialize};
use thiserror::Error;
use umdev_mdev::types::InstanceOptions;
use umdev_mdev::unix_socket::{bind_private, BindError};
use uuid::Uuid;

use crate::lifecycle::{check_private_dir, LifecycleError, Manager};

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
        /// `uuid` is new, chosen by the client for an instance of `mdev_type` (so that a start
        /// the daemon does not answer in time can be named): no definition is looked up for
        /// it. A daemon that does not know the field looks one up, as for any UUID.
        #[serde(default)]
        generated: bool,
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
    /// What the daemon warned of while it served the request (a device that starts, but with
    /// a warning), also in its log: the command prints them ([`crate::warnings`]).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub warnings: Vec<String>,
}

impl ControlResponse {
    fn success(result: impl Serialize) -> Self {
        ControlResponse {
            ok: true,
            result: serde_json::to_value(result).ok(),
            error: None,
            errno: None,
            warnings: Vec::new(),
        }
    }

    fn failure(error: String, errno: i32) -> Self {
        ControlResponse {
            ok: false,
            result: None,
            error: Some(error),
            errno: Some(errno),
            warnings: Vec::new(),
        }
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
    /// The daemon took the request and did not answer within the timeout (the path, the
    /// timeout).
    #[error(
        "the umdev daemon at {} did not answer within {} (is it stopped or stuck? `umdev list` \
         and its log say more; {TIMEOUT_ENV} sets how long to wait)", .0.display(), duration_text(.1)
    )]
    NoAnswer(PathBuf, Duration),
    /// Something else than a socket is where the control socket would be (the path, what it
    /// is): no daemon can listen there until it is removed.
    #[error(
        "the umdev daemon is not running: {path} is {kind}, not a socket; remove it (`umdev daemon` does \
         not, and cannot listen there while it is there)", path = .0.display(), kind = .1
    )]
    NotASocket(PathBuf, String),
    /// The run directory is not the user's alone (another user's, shared, or writable by
    /// its group or others): a control socket there may not be its daemon's.
    #[error("not asking a daemon through {}: {source}", path.display())]
    RunDir {
        /// The control socket.
        path: PathBuf,
        /// What is wrong with its directory.
        source: LifecycleError,
    },
    /// The control socket, or the process listening on it, is another user's: it could read
    /// the requests (a start's options) and forge the answers (an instance socket of its own,
    /// to which QEMU would hand the guest's memory).
    #[error(
        "not asking a daemon through {}: {why}, not {me} (this user's); only a daemon of the user's own \
         is asked: remove it, or give another --run-dir", path.display()
    )]
    Foreign {
        /// The control socket.
        path: PathBuf,
        /// Whose it is.
        why: String,
        /// This process's effective user.
        me: u32,
    },
    /// [`TIMEOUT_ENV`] does not hold a timeout.
    #[error("{0}")]
    BadTimeout(String),
    /// The exchange failed (the control socket's path, the error).
    #[error("talking to the umdev daemon at {path}: {error}", path = .0.display(), error = .1)]
    Io(PathBuf, io::Error),
    /// The daemon's answer was not understood.
    #[error("bad answer from the daemon: {0}")]
    Protocol(String),
}

impl ControlError {
    /// True when no daemon answers (the control socket is missing or stale).
    pub fn not_running(&self) -> bool {
        matches!(self, ControlError::NotRunning(_) | ControlError::Stale(_) | ControlError::NotASocket(..))
    }
}

fn handle(manager: &Manager, request: ControlRequest) -> ControlResponse {
    let fail = |e: LifecycleError| ControlResponse::failure(e.to_string(), e.errno());
    match request {
        ControlRequest::Types => ControlResponse::success(manager.types()),
        ControlRequest::Start {
            mdev_type: Some(mdev_type),
            uuid: Some(uuid),
            options,
            override_definition: false,
            generated: true,
        } => manager.start_new(&mdev_type, uuid, options).map(ControlResponse::success).unwrap_or_else(fail),
        ControlRequest::Start { mdev_type, uuid, options, override_definition, .. } => manager
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
                Ok(request) => {
                    // What the daemon warns of while it serves the request (a device made with a
                    // warning) is the requester's to hear, not only the log's.
                    let (mut response, warnings) = crate::warnings::collect(|| handle(manager, request));
                    response.warnings = warnings;
                    response
                }
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
        let stream = match listener.accept() {
            Ok((stream, _)) => stream,
            // Out of fds, say: the listener stays readable, so wait before the next try
            // rather than spin (as the instances' acceptor does).
            Err(e)
                if e.kind() != std::io::ErrorKind::WouldBlock
                    && e.kind() != std::io::ErrorKind::Interrupted =>
            {
                log::warn!("control socket: accept failed: {e}");
                std::thread::sleep(std::time::Duration::from_millis(50));
                continue;
            }
            Err(_) => continue,
        };
        if active.load(Ordering::Acquire) >= MAX_CONNECTIONS {
            log::warn!("control socket: too many connections; closing one");
            // Told why, so that its command says so rather than that the answer was cut
            // short. Without waiting: a peer that does not read is closed all the same.
            let busy = ControlResponse::failure(
                format!("the daemon is busy: {MAX_CONNECTIONS} control connections are open; try again"),
                libc::EBUSY,
            );
            let _ = stream.set_nonblocking(true);
            let _ = writeln!(&stream, "{}", serde_json::to_string(&busy).unwrap_or_default());
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

/// The environment variable that sets how long a command waits for the daemon's answer, in
/// milliseconds: [`MIN_TIMEOUT_MS`] to [`MAX_TIMEOUT_MS`]; [`DEFAULT_TIMEOUT`] when unset or
/// empty. Read once, at a process's first request.
pub const TIMEOUT_ENV: &str = "UMDEV_CONTROL_TIMEOUT_MS";
/// The shortest wait [`TIMEOUT_ENV`] may set, in milliseconds.
pub const MIN_TIMEOUT_MS: u64 = 1;
/// The longest wait [`TIMEOUT_ENV`] may set, in milliseconds (an hour).
pub const MAX_TIMEOUT_MS: u64 = 3_600_000;
/// How long a command waits for the daemon's answer unless [`TIMEOUT_ENV`] says otherwise: a
/// start may fill a huge-page pool or wait for a device's previous client to let go.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(60);

/// The wait a [`TIMEOUT_ENV`] value sets (`None`: unset), or why it sets none.
pub fn parse_timeout(value: Option<&std::ffi::OsStr>) -> Result<Duration, String> {
    let Some(value) = value.filter(|v| !v.is_empty()) else { return Ok(DEFAULT_TIMEOUT) };
    value
        .to_str()
        .and_then(|v| v.trim().parse::<u64>().ok())
        .filter(|ms| (MIN_TIMEOUT_MS..=MAX_TIMEOUT_MS).contains(ms))
        .map(Duration::from_millis)
        .ok_or_else(|| {
            format!(
                "{TIMEOUT_ENV}={value:?}: not a number of milliseconds from {MIN_TIMEOUT_MS} to \
                 {MAX_TIMEOUT_MS} (how long a command waits for the daemon's answer; {} when unset)",
                DEFAULT_TIMEOUT.as_millis()
            )
        })
}

/// The wait [`TIMEOUT_ENV`] sets, read once per process.
fn answer_timeout() -> Result<Duration, ControlError> {
    static TIMEOUT: OnceLock<Result<Duration, String>> = OnceLock::new();
    TIMEOUT
        .get_or_init(|| parse_timeout(std::env::var_os(TIMEOUT_ENV).as_deref()))
        .clone()
        .map_err(ControlError::BadTimeout)
}

/// `60s`, `250ms`: a timeout as the messages say it.
fn duration_text(d: &Duration) -> String {
    match d.as_millis() {
        ms if ms % 1000 == 0 => format!("{}s", ms / 1000),
        ms => format!("{ms}ms"),
    }
}

/// What is at `path`, if it is there and not a socket: "a directory", "a regular file", "a
/// symbolic link to a stale socket" (which the daemon, binding there, does not replace as
/// it replaces a stale socket), ...
fn not_a_socket(path: &Path) -> Option<String> {
    use std::os::unix::fs::FileTypeExt;
    let link = std::fs::symlink_metadata(path).ok()?.file_type().is_symlink();
    let Ok(target) = std::fs::metadata(path) else { return Some("a symbolic link to nothing".into()) };
    let kind = match target.file_type() {
        k if k.is_socket() && !link => return None,
        k if k.is_socket() => "a stale socket",
        k if k.is_dir() => "a directory",
        k if k.is_file() => "a regular file",
        k if k.is_fifo() => "a FIFO",
        _ => "a device",
    };
    Some(if link { format!("a symbolic link to {kind}") } else { kind.to_string() })
}

/// Refuses a control socket that may not be this user's daemon's, before anything is sent
/// to it: its directory, if there is one, must be private as the daemon makes it
/// ([`check_private_dir`]: a /tmp/umdev-$UID another user made first is not), and the socket
/// (followed, if a link) this user's own (root's only when the user is root).
fn check_control_socket(path: &Path) -> Result<(), ControlError> {
    use std::os::unix::fs::{FileTypeExt, MetadataExt};
    let dir = path.parent().filter(|d| !d.as_os_str().is_empty()).unwrap_or(Path::new("."));
    if std::fs::symlink_metadata(dir).is_ok() {
        check_private_dir(dir).map_err(|source| ControlError::RunDir { path: path.to_path_buf(), source })?;
    }
    let me = nix::unistd::geteuid().as_raw();
    // What is missing, or no socket, is for connect(2) and its message.
    match std::fs::metadata(path) {
        Ok(meta) if meta.file_type().is_socket() && meta.uid() != me => Err(ControlError::Foreign {
            path: path.to_path_buf(),
            why: format!("the socket belongs to uid {}", meta.uid()),
            me,
        }),
        _ => Ok(()),
    }
}

/// Refuses a connection whose listener runs as another user than `me`: the path was
/// checked before connecting, but what it named may have been swapped since.
fn check_peer(stream: &UnixStream, path: &Path, me: u32) -> Result<(), ControlError> {
    let peer = nix::sys::socket::getsockopt(stream, nix::sys::socket::sockopt::PeerCredentials)
        .map_err(|e| ControlError::Io(path.to_path_buf(), e.into()))?;
    if peer.uid() == me {
        return Ok(());
    }
    Err(ControlError::Foreign {
        path: path.to_path_buf(),
        why: format!("the process listening on it (pid {}) runs as uid {}", peer.pid(), peer.uid()),
        me,
    })
}

/// Sends one request to the daemon listening on `path` and returns its answer, waiting for
/// it as long as [`TIMEOUT_ENV`] says ([`DEFAULT_TIMEOUT`] by default). A socket that may
/// be another user's is refused first ([`ControlError::RunDir`], [`ControlError::Foreign`]):
/// nothing is sent to it.
pub fn request(path: &Path, request: &ControlRequest) -> Result<ControlResponse, ControlError> {
    let timeout = answer_timeout()?;
    check_control_socket(path)?;
    let mut stream = match UnixStream::connect(path) {
        Ok(s) => s,
        // Missing, or a symbolic link to nothing: the daemon would not bind over the link, so
        // it is named rather than taken for a daemon not started.
        Err(e) if e.kind() == io::ErrorKind::NotFound => {
            return Err(match not_a_socket(path) {
                Some(kind) => ControlError::NotASocket(path.to_path_buf(), kind),
                None => ControlError::NotRunning(path.to_path_buf()),
            })
        }
        // Refused: a socket nothing listens on, or no socket at all (connect(2) says the same).
        Err(e) if e.kind() == io::ErrorKind::ConnectionRefused => {
            return Err(match not_a_socket(path) {
                Some(kind) => ControlError::NotASocket(path.to_path_buf(), kind),
                None => ControlError::Stale(path.to_path_buf()),
            })
        }
        Err(e) => return Err(ControlError::Io(path.to_path_buf(), e)),
    };
    check_peer(&stream, path, nix::unistd::geteuid().as_raw())?;
    let io = |e| ControlError::Io(path.to_path_buf(), e);
    stream.set_read_timeout(Some(timeout)).map_err(io)?;
    stream.set_write_timeout(Some(timeout)).map_err(io)?;
    let timed_out = |e: io::Error| match e.kind() {
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => {
            ControlError::NoAnswer(path.to_path_buf(), timeout)
        }
        _ => ControlError::Io(path.to_path_buf(), e),
    };
    let line = serde_json::to_string(request).map_err(|e| ControlError::Protocol(e.to_string()))?;
    let sent = writeln!(stream, "{line}");
    // A daemon with too many connections answers "busy" and closes without reading: the
    // request's write may then fail (EPIPE) with that answer waiting to be read.
    let mut answer = String::new();
    let read = BufReader::new(&stream).take(16 << 20).read_line(&mut answer);
    if answer.is_empty() {
        sent.map_err(timed_out)?;
        read.map_err(timed_out)?;
    }
    serde_json::from_str(&answer).map_err(|e| ControlError::Protocol(e.to_string()))
}

#[cfg(test)]
mod tests {
    use std::ffi::OsStr;
    use std::time::Duration;

    use super::*;

    #[test]
    fn the_answer_timeout_is_the_environments_within_its_range() {
        assert_eq!(parse_timeout(None), Ok(DEFAULT_TIMEOUT));
        assert_eq!(parse_timeout(Some(OsStr::new(""))), Ok(DEFAULT_TIMEOUT));
        assert_eq!(parse_timeout(Some(OsStr::new("250"))), Ok(Duration::from_millis(250)));
        assert_eq!(parse_timeout(Some(OsStr::new("1"))), Ok(Duration::from_millis(1)));
        assert_eq!(parse_timeout(Some(OsStr::new("3600000"))), Ok(Duration::from_secs(3600)));
        for bad in ["0", "3600001", "-5", "1.5", "soon", "18446744073709551616"] {
            let e = parse_timeout(Some(OsStr::new(bad))).unwrap_err();
            assert!(e.contains(TIMEOUT_ENV) && e.contains("from 1 to 3600000"), "{bad}: {e}");
        }
    }

    /// A control socket that may be another user's is refused before anything is sent: in a
    /// run directory its group or others may write to, or a shared one, or (as root, who can
    /// make them) one of another user's, or whose listener runs as another user.
    #[test]
    fn a_control_socket_that_may_be_another_users_is_not_asked() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let run = dir.path().join("run");
        // 0700 whatever the umask (002 would make it 0775, which a client refuses).
        crate::lifecycle::private_dir(&run).unwrap();
        let path = run.join("control.sock");
        let listener = UnixListener::bind(&path).unwrap();
        listener.set_nonblocking(true).unwrap();
        let nothing_sent = |listener: &UnixListener| {
            let accepted = listener.accept();
            assert!(
                matches!(&accepted, Err(e) if e.kind() == io::ErrorKind::WouldBlock),
                "a connection was made: {accepted:?}"
            );
        };
        for (mode, want) in [(0o770, "chmod go-w"), (0o1777, "a shared directory")] {
            std::fs::set_permissions(&run, std::fs::Permissions::from_mode(mode)).unwrap();
            let err = request(&path, &ControlRequest::List).unwrap_err();
            assert!(matches!(err, ControlError::RunDir { .. }), "{err}");
            assert!(!err.not_running(), "{err}");
            let text = err.to_string();
            assert!(text.contains(&format!("not asking a daemon through {}", path.display())), "{text}");
            assert!(text.contains(want), "{text}");
            nothing_sent(&listener);
        }
        std::fs::set_permissions(&run, std::fs::Permissions::from_mode(0o700)).unwrap();
        // The listener's user is checked once connected (the path may have been swapped).
        let (ours, _theirs) = UnixStream::pair().unwrap();
        let me = nix::unistd::geteuid().as_raw();
        assert!(check_peer(&ours, &path, me).is_ok());
        let err = check_peer(&ours, &path, me + 1).unwrap_err().to_string();
        assert!(err.contains(&format!("runs as uid {me}, not {}", me + 1)), "{err}");
        if !nix::unistd::geteuid().is_root() {
            return eprintln!("SKIPPED the rest: another user's socket or directory needs root to make");
        }
        let theirs = nix::unistd::Uid::from_raw(65534);
        nix::unistd::chown(&path, Some(theirs), None).unwrap();
        let err = request(&path, &ControlRequest::List).unwrap_err();
        assert!(matches!(err, ControlError::Foreign { .. }), "{err}");
        assert!(err.to_string().contains("the socket belongs to uid 65534, not 0"), "{err}");
        nothing_sent(&listener);
        nix::unistd::chown(&path, Some(nix::unistd::Uid::from_raw(0)), None).unwrap();
        nix::unistd::chown(&run, Some(theirs), None).unwrap();
        let err = request(&path, &ControlRequest::List).unwrap_err();
        assert!(err.to_string().contains("owned by uid 65534, not 0"), "{err}");
        nothing_sent(&listener);
    }

    /// A start under a UUID the client chose for a new instance looks up no definition: a
    /// definitions directory that cannot be read (here a file) keeps it from nothing. Any
    /// other UUID is looked up, as an older client's request (no `generated`) is.
    #[test]
    fn a_start_under_a_uuid_the_client_chose_looks_up_no_definition() {
        use umdev_mdev::types::Registry;
        use umdev_server::InstanceConfig;
        let dir = tempfile::tempdir().unwrap();
        let (run, state) = (dir.path().join("run"), dir.path().join("state"));
        // 0700 whatever the umask (002 would make it 0775, which a client refuses).
        crate::lifecycle::private_dir(&run).unwrap();
        std::fs::write(&state, "").unwrap();
        let registry = Registry::with_types(vec![Arc::new(umdev_devices::testdev::TestDevType::new(8))]);
        let manager = Manager::new(
            registry,
            &run,
            crate::lifecycle::Definitions::new(&state),
            InstanceConfig::new("", ""),
        );
        let start = |uuid: u128, generated| {
            handle(
                &manager,
                ControlRequest::Start {
                    mdev_type: Some("testdev".into()),
                    uuid: Some(Uuid::from_u128(uuid)),
                    options: InstanceOptions::default(),
                    override_definition: false,
                    generated,
                },
            )
        };
        let refused = start(1, false);
        assert!(!refused.ok && refused.error.as_deref().is_some_and(|e| e.contains("not a directory")));
        let started = start(2, true);
        assert!(started.ok, "{:?}", started.error);
        assert_eq!(manager.list().len(), 1);
        let older: ControlRequest = serde_json::from_str(
            r#"{"op":"start","mdev_type":"testdev","uuid":"00000000-0000-0000-0000-000000000003"}"#,
        )
        .unwrap();
        assert!(matches!(older, ControlRequest::Start { generated: false, .. }));
        assert!(!handle(&manager, older).ok);
        manager.shutdown();
    }

    /// A control socket nothing listens on is stale; a symbolic link there is named as one,
    /// with what it leads to, nothing included (the daemon does not replace a link as it does a stale socket).
    #[test]
    fn what_is_where_the_control_socket_goes_is_named() {
        let dir = tempfile::tempdir().unwrap();
        let run = dir.path().join("run");
        // 0700 whatever the umask (002 would make it 0775, which a client refuses).
        crate::lifecycle::private_dir(&run).unwrap();
        let stale = dir.path().join("stale.sock");
        drop(UnixListener::bind(&stale).unwrap());
        let path = run.join("control.sock");
        let ask = || request(&path, &ControlRequest::List).unwrap_err();
        std::os::unix::fs::symlink(&stale, &path).unwrap();
        let err = ask();
        assert!(
            matches!(&err, ControlError::NotASocket(_, kind) if kind == "a symbolic link to a stale socket")
        );
        assert!(
            err.to_string().contains("is a symbolic link to a stale socket, not a socket; remove it"),
            "{err}"
        );
        std::fs::remove_file(&path).unwrap();
        std::fs::rename(&stale, &path).unwrap();
        assert!(matches!(ask(), ControlError::Stale(_)), "{}", ask());
        std::fs::remove_file(&path).unwrap();
        std::os::unix::fs::symlink(dir.path(), &path).unwrap();
        assert!(ask().to_string().contains("is a symbolic link to a directory, not a socket"), "{}", ask());
        std::fs::remove_file(&path).unwrap();
        std::os::unix::fs::symlink(dir.path().join("missing"), &path).unwrap();
        let err = ask();
        assert!(
            matches!(&err, ControlError::NotASocket(_, kind) if kind == "a symbolic link to nothing"),
            "{err}"
        );
        assert!(err.to_string().contains("is a symbolic link to nothing, not a socket; remove it"), "{err}");
        assert!(!err.to_string().contains("start it with"), "{err}");
        std::fs::remove_file(&path).unwrap();
        std::fs::create_dir(&path).unwrap();
        assert!(ask().to_string().contains("is a directory, not a socket"), "{}", ask());
        assert!(ask().not_running());
    }

    #[test]
    fn a_timeout_reads_as_seconds_or_milliseconds() {
        assert_eq!(duration_text(&DEFAULT_TIMEOUT), "60s");
        assert_eq!(duration_text(&Duration::from_millis(250)), "250ms");
        assert_eq!(duration_text(&Duration::from_millis(1500)), "1500ms");
    }
}
