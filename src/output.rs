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

/// A file the user asked for, to be written once the work whose result it holds is done
/// (`pinbench --svg`). [`PendingFile::open`] checks now that it can be written, so a path
/// that cannot fails before the work, and truncates nothing: a regular file (or a path with
/// none yet) gets a temporary file beside it, renamed over it by [`PendingFile::finish`], so
/// that a failed or interrupted run leaves what was there whole (on a signal the cleanup
/// module removes the temporary file, as drop does otherwise). A device or a pipe
/// (`/dev/stdout`) is written to directly, its mode left alone.
#[cfg(feature = "bench")]
pub struct PendingFile {
    /// The path the user gave (for messages).
    path: std::path::PathBuf,
    /// The temporary file and the file it replaces, until it has.
    replace: Option<(std::path::PathBuf, std::path::PathBuf)>,
    /// What is written to: the temporary file, or the device or pipe.
    file: std::fs::File,
}

#[cfg(feature = "bench")]
impl PendingFile {
    /// Checks that `path` can be written, without changing it.
    pub fn open(path: &Path) -> Result<PendingFile, String> {
        use std::os::unix::fs::OpenOptionsExt;
        let opening = |e: std::io::Error| format!("opening {}: {e}", path.display());
        let target = match std::fs::metadata(path) {
            Ok(meta) if meta.is_dir() => return Err(format!("{}: a directory, not a file", path.display())),
            Ok(meta) if !meta.is_file() => {
                let file = std::fs::OpenOptions::new().write(true).open(path).map_err(opening)?;
                return Ok(PendingFile { path: path.to_path_buf(), replace: None, file });
            }
            // Its user's leave to write it is asked now (opened without truncating); what
            // replaces it is the file a symbolic link names, not the link.
            Ok(_) => {
                std::fs::OpenOptions::new().write(true).open(path).map_err(opening)?;
                std::fs::canonicalize(path).map_err(opening)?
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => path.to_path_buf(),
            Err(e) => return Err(format!("{}: {e}", path.display())),
        };
        let dir = target.parent().filter(|d| !d.as_os_str().is_empty()).unwrap_or(Path::new("."));
        let name = target.file_name().ok_or_else(|| format!("{}: names no file", path.display()))?;
        let name = name.to_string_lossy();
        // What a run killed with SIGKILL left beside the same file goes first.
        crate::cleanup::say_removed("file(s)", &crate::cleanup::remove_stale_pending(dir, &name));
        let temp = dir.join(crate::cleanup::pending_name(&name, std::process::id()));
        // Never one that is there: it could be another user's link.
        // Registered as it is made: a signal in between would leave it behind.
        let file = crate::cleanup::create_file(&temp, || {
            std::fs::OpenOptions::new().write(true).create_new(true).mode(0o644).open(&temp)
        })
        .map_err(|e| match e.kind() {
            std::io::ErrorKind::AlreadyExists => format!("creating {}: {e}", temp.display()),
            _ => format!("creating {}: {e}", path.display()),
        })?;
        let pending = PendingFile { path: path.to_path_buf(), replace: Some((temp, target)), file };
        // Made through the process's umask (077); a file the user asked for is for everyone.
        pending
            .file
            .set_permissions(std::fs::Permissions::from_mode(0o644))
            .map_err(|e| format!("chmod {}: {e}", path.display()))?;
        Ok(pending)
    }

    /// The path the user gave.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Writes `data`, the whole file, and puts it in place.
    pub fn finish(mut self, data: &[u8]) -> Out {
        let writing = |e: std::io::Error| format!("writing {}: {e}", self.path.display());
        (&self.file).write_all(data).map_err(writing)?;
        let Some((temp, target)) = &self.replace else { return Ok(()) };
        // On disk before the rename: a crash never leaves an empty file in the old one's place.
        self.file.sync_all().map_err(writing)?;
        std::fs::rename(temp, target)
            .map_err(|e| format!("renaming {} to {}: {e}", temp.display(), target.display()))?;
        crate::cleanup::forget_file(temp);
        self.replace = None;
        Ok(())
    }
}

#[cfg(feature = "bench")]
impl Drop for PendingFile {
    fn drop(&mut self) {
        if let Some((temp, _)) = self.replace.take() {
            let _ = std::fs::remove_file(&temp);
            crate::cleanup::forget_file(&temp);
        }
    }
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
