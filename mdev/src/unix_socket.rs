//! Listening UNIX sockets that only their owner can reach, for instance sockets and for the
//! host side of devices (a serial port's `socket:PATH` backend): created mode 0600, a stale
//! socket left by a dead process replaced, a live one or a non-socket refused.

use std::io;
use std::os::unix::fs::{FileTypeExt, PermissionsExt};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};

use thiserror::Error;

/// Why a socket could not be bound.
#[derive(Debug, Error)]
pub enum BindError {
    /// Another process is listening on the path.
    #[error("{0} is in use by a live server")]
    InUse(PathBuf),
    /// Something other than a socket is at the path.
    #[error("{0} exists and is not a socket")]
    NotASocket(PathBuf),
    /// Binding, replacing or configuring failed.
    #[error("{what} {path}: {source}")]
    Io {
        /// What was being done.
        what: &'static str,
        /// The socket path.
        path: PathBuf,
        /// The error.
        source: io::Error,
    },
}

/// Binds `path` mode 0600, non-blocking, replacing a stale socket left by a dead process.
///
/// The socket is created 0600: Linux gives the socket file the mode of the socket itself,
/// set here before `bind`, so there is no moment when anyone else could connect.
pub fn bind_private(path: &Path) -> Result<UnixListener, BindError> {
    let io_err = |what, source| BindError::Io { what, path: path.to_path_buf(), source };
    let listener = match bind_0600(path) {
        Ok(l) => l,
        Err(e) if e.kind() == io::ErrorKind::AddrInUse => {
            let meta = std::fs::symlink_metadata(path).map_err(|e| io_err("inspecting", e))?;
            if !meta.file_type().is_socket() {
                return Err(BindError::NotASocket(path.to_path_buf()));
            }
            if UnixStream::connect(path).is_ok() {
                return Err(BindError::InUse(path.to_path_buf()));
            }
            std::fs::remove_file(path).map_err(|e| io_err("removing stale socket", e))?;
            bind_0600(path).map_err(|e| io_err("binding", e))?
        }
        Err(e) => return Err(io_err("binding", e)),
    };
    // Belt and braces (the mode was set before bind).
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600)).map_err(|e| io_err("chmod", e))?;
    listener.set_nonblocking(true).map_err(|e| io_err("configuring", e))?;
    Ok(listener)
}

/// A listening socket at `path` whose file is created mode 0600.
fn bind_0600(path: &Path) -> io::Result<UnixListener> {
    use nix::sys::socket::{bind, listen, socket, AddressFamily, Backlog, SockFlag, SockType, UnixAddr};
    use std::os::fd::AsRawFd;
    let fd = socket(AddressFamily::Unix, SockType::Stream, SockFlag::SOCK_CLOEXEC, None)?;
    nix::sys::stat::fchmod(&fd, nix::sys::stat::Mode::from_bits_truncate(0o600))?;
    let addr = UnixAddr::new(path)?;
    bind(fd.as_raw_fd(), &addr)?;
    listen(&fd, Backlog::new(128).unwrap_or(Backlog::MAXCONN))?;
    Ok(UnixListener::from(fd))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn private_stale_replaced_live_and_non_sockets_refused() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("s.sock");
        drop(UnixListener::bind(&path).unwrap()); // stale
        let live = bind_private(&path).unwrap();
        assert_eq!(std::fs::metadata(&path).unwrap().permissions().mode() & 0o777, 0o600);
        assert!(matches!(bind_private(&path), Err(BindError::InUse(_))));
        drop(live);
        let file = dir.path().join("f");
        std::fs::write(&file, b"x").unwrap();
        assert!(matches!(bind_private(&file), Err(BindError::NotASocket(_))));
        let long = dir.path().join("x".repeat(200));
        assert!(matches!(bind_private(&long), Err(BindError::Io { .. })));
    }
}
