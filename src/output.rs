//! What commands print, and the files a user asks them to write.
//!
//! Standard output may be a pipe whose reader stops early (`umdev list | head -1`): a write
//! that finds it closed fails with [`CLOSED`], the command unwinds as from any error (so
//! whatever it made is cleaned up) and `main` ends quietly with status 0, as `head`'s writer
//! expects. `println!` would panic there instead.
//!
//! Files and directories a user names (`umdev man --dir`, `pinbench --svg`) are made readable
//! by everyone, 0644 and 0755, whatever the umask: the process's umask is 077 for the
//! daemon's sockets and definitions.

use std::io::Write;
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};

/// The error of a write to a closed standard output.
pub const CLOSED: &str = "standard output closed";

static STDOUT_CLOSED: AtomicBool = AtomicBool::new(false);

/// A command's result, as `Result<(), String>` elsewhere.
pub type Out = Result<(), String>;

/// Writes one line to standard output; [`CLOSED`] once its reader has gone.
pub fn line(args: std::fmt::Arguments<'_>) -> Out {
    write(|stdout| stdout.write_fmt(args).and_then(|()| stdout.write_all(b"\n")))
}

/// Writes bytes as they are to standard output (a man page, a completion script).
pub fn bytes(data: &[u8]) -> Out {
    write(|stdout| stdout.write_all(data))
}

fn write(f: impl FnOnce(&mut std::io::StdoutLock<'static>) -> std::io::Result<()>) -> Out {
    if STDOUT_CLOSED.load(Ordering::Relaxed) {
        return Err(CLOSED.into());
    }
    let mut stdout = std::io::stdout().lock();
    match f(&mut stdout).and_then(|()| stdout.flush()) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => {
            STDOUT_CLOSED.store(true, Ordering::Relaxed);
            Err(CLOSED.into())
        }
        Err(e) => Err(format!("writing to standard output: {e}")),
    }
}

/// True once a write found standard output closed: the command's error is then no error.
pub fn closed() -> bool {
    STDOUT_CLOSED.load(Ordering::Relaxed)
}

/// `println!`, returning [`Out`].
macro_rules! out {
    ($($arg:tt)*) => {
        $crate::output::line(format_args!($($arg)*))
    };
}
pub(crate) use out;

/// Writes a file the user asked for, mode 0644.
pub fn write_file(path: &Path, data: &[u8]) -> Out {
    std::fs::write(path, data).map_err(|e| format!("writing {}: {e}", path.display()))?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o644))
        .map_err(|e| format!("chmod {}: {e}", path.display()))
}

/// Opens a file the user asked for, to be written later: a path that cannot be written
/// fails before the work whose result it is to hold. A regular file is emptied, and made
/// mode 0644; something else (`/dev/stdout`, a pipe) is left as it is. Also says whether the
/// file is new.
#[cfg(feature = "bench")]
pub fn create_file(path: &Path) -> Result<(std::fs::File, bool), String> {
    let new = std::fs::symlink_metadata(path).is_err();
    let file = std::fs::File::create(path).map_err(|e| format!("creating {}: {e}", path.display()))?;
    let regular = file.metadata().map_err(|e| format!("{}: {e}", path.display()))?.is_file();
    if regular {
        file.set_permissions(std::fs::Permissions::from_mode(0o644))
            .map_err(|e| format!("chmod {}: {e}", path.display()))?;
    }
    Ok((file, new && regular))
}

/// Creates a directory the user asked for, mode 0755; its parent must exist (a mistyped
/// path is an error, not a tree of directories). One that exists is left as it is.
pub fn create_dir(path: &Path) -> Out {
    if path.is_dir() {
        return Ok(());
    }
    match std::fs::create_dir(path) {
        Ok(()) => std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o755))
            .map_err(|e| format!("chmod {}: {e}", path.display())),
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists && path.is_dir() => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            let parent = path.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
            Err(format!(
                "creating {}: its parent {} does not exist (only the last directory is made)",
                path.display(),
                parent.display()
            ))
        }
        Err(e) => Err(format!("creating {}: {e}", path.display())),
    }
}
