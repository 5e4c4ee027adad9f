//! What a benchmark (or the demo) would leave behind if it were stopped: its temporary
//! directories and files and the `umdev run` servers it started. Each is registered while it
//! exists; on SIGINT, SIGTERM or SIGHUP (Ctrl-C, `kill`, `timeout`, a closed terminal unless
//! under `nohup`) a thread stops the servers, removes the directories and files and exits
//! 128 + the signal (no destructor runs). A server also gets SIGTERM from the kernel if the
//! benchmark dies any other way (`PR_SET_PDEATHSIG`).
//!
//! A process killed with SIGKILL cleans up nothing: its temporary directory stays. So each is
//! a [`ScratchDir`], named `umdev-scratch-WHAT-PID` and locked (`flock`) by its process while
//! it exists, and the next run that makes one in the same parent first removes those of runs
//! that are gone ([`remove_stale`]): the kernel lets a lock go with its process however the
//! process ends. It is made under a name of its own that the sweep leaves alone for a while
//! (`.umdev-scratch-WHAT-PID.NONCE.new`), locked there, then renamed into place: under its
//! sweepable name it is never unlocked (where its filesystem can lock at all).

use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use nix::sys::signal::{kill, Signal};
use nix::sys::wait::{waitpid, WaitPidFlag};
use nix::unistd::Pid;
use signal_hook::iterator::Signals;

#[derive(Default)]
struct Leftovers {
    dirs: Vec<PathBuf>,
    files: Vec<PathBuf>,
    children: Vec<u32>,
}

static LEFTOVERS: Mutex<Leftovers> =
    Mutex::new(Leftovers { dirs: Vec::new(), files: Vec::new(), children: Vec::new() });

/// A signal came: the cleanup thread is stopping the process.
static STOPPING: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Once a signal came, waits for the cleanup thread to end the process: what the benchmark
/// meanwhile failed at (its server gone) is no error of its own.
pub fn wait_if_stopping() {
    while STOPPING.load(std::sync::atomic::Ordering::Acquire) {
        std::thread::park();
    }
}

fn leftovers() -> std::sync::MutexGuard<'static, Leftovers> {
    LEFTOVERS.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Cleans up on SIGINT, SIGTERM and SIGHUP from now on (call once, before anything is made);
/// SIGHUP stays ignored if it was (`nohup umdev pinbench &` outlives its terminal).
pub fn install() -> Result<(), String> {
    let mut signals =
        Signals::new(crate::run::stop_signals()).map_err(|e| format!("installing signal handlers: {e}"))?;
    std::thread::Builder::new()
        .name("umdev-cleanup".into())
        .spawn(move || {
            if let Some(signal) = signals.forever().next() {
                STOPPING.store(true, std::sync::atomic::Ordering::Release);
                // Held until the process exits: nothing is registered, or made through
                // `create_file`, after what is there has been taken to remove.
                let mut held = leftovers();
                let what = std::mem::take(&mut *held);
                for &pid in &what.children {
                    stop_child(pid);
                }
                for dir in &what.dirs {
                    let _ = std::fs::remove_dir_all(dir);
                }
                for file in &what.files {
                    let _ = std::fs::remove_file(file);
                }
                eprintln!(
                    "umdev: signal {signal}: stopped {} server(s), removed {} temporary director(ies) and {} \
                     temporary file(s)",
                    what.children.len(),
                    what.dirs.len(),
                    what.files.len()
                );
                std::process::exit(128 + signal);
            }
        })
        .map_err(|e| format!("starting the cleanup thread: {e}"))?;
    Ok(())
}

/// SIGTERM (a `umdev run` removes its socket and exits), then SIGKILL after 5 s.
fn stop_child(pid: u32) {
    let pid = Pid::from_raw(pid as i32);
    let _ = kill(pid, Signal::SIGTERM);
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        match waitpid(pid, Some(WaitPidFlag::WNOHANG)) {
            Ok(nix::sys::wait::WaitStatus::StillAlive) if Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(10))
            }
            Ok(nix::sys::wait::WaitStatus::StillAlive) => {
                let _ = kill(pid, Signal::SIGKILL);
                let _ = waitpid(pid, None);
                return;
            }
            _ => return,
        }
    }
}

/// The directory is gone (or kept on purpose).
fn forget_dir(path: &Path) {
    leftovers().dirs.retain(|d| d != path);
}

/// What a scratch directory's name starts with: `umdev-scratch-WHAT-PID`. Nothing else of
/// umdev's is named so (a user's run and state directories in /tmp are `umdev-UID` and
/// `umdev-state-UID`), so [`remove_stale`] never takes one of those for a run's leftovers.
const SCRATCH_PREFIX: &str = "umdev-scratch-";

/// What a scratch directory is made as before it is locked and renamed into place:
/// `.umdev-scratch-WHAT-PID.NONCE.new`. A dot-name, so [`SCRATCH_PREFIX`] never matches it:
/// between its making and its lock a run's directory is unlocked, and a sweeper that cannot
/// see its pid (one in another pid namespace sharing the parent) would take it for a gone
/// run's.
const MAKING_PREFIX: &str = ".umdev-scratch-";
const MAKING_SUFFIX: &str = ".new";

/// How old a directory under the making name must be for [`remove_stale`] to take it for
/// the leftover of a run killed while making it. A run holds that name only from its making
/// to its rename, microseconds with no wait between; an hour keeps one of a run stopped
/// there (SIGSTOP) in another pid namespace, whose pid the sweep cannot look at.
const MAKING_LEFTOVER_AGE: Duration = Duration::from_secs(3600);

/// A benchmark's (or the demo's) private temporary directory, mode 0700, removed on drop or
/// on a signal; held locked while it exists (where its filesystem can lock), so that a later
/// run can tell it from one whose process was killed ([`remove_stale`]).
pub struct ScratchDir {
    path: PathBuf,
    /// The directory, opened and locked (`flock`, exclusive) until it is removed; `None`
    /// where its filesystem cannot lock ([`lock_scratch`]).
    _lock: Option<nix::fcntl::Flock<std::fs::File>>,
}

impl ScratchDir {
    /// The directory.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl Drop for ScratchDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.path);
        forget_dir(&self.path);
    }
}

/// A fresh scratch directory in the temporary directory (`$TMPDIR`, else /tmp) for `what`
/// (`protobench`, `ccwbench-lock`, ...), once those of earlier runs that are gone are removed.
pub fn scratch_dir(what: &str) -> Result<ScratchDir, String> {
    scratch_dir_in(&std::env::temp_dir(), what)
}

/// A fresh scratch directory `umdev-scratch-WHAT-PID` in `parent`, once the scratch
/// directories of earlier runs there that are gone are removed ([`remove_stale`]; said on
/// stderr). The directory is made, never taken over: one already at its path is refused
/// (another user may have put it there), unless it is a stale one of this user's that an
/// earlier process with this pid left.
pub fn scratch_dir_in(parent: &Path, what: &str) -> Result<ScratchDir, String> {
    say_removed("director(ies)", &remove_stale(parent));
    let me = std::process::id();
    let path = parent.join(format!("{SCRATCH_PREFIX}{what}-{me}"));
    // Made under a name the sweep leaves alone (see MAKING_PREFIX), locked, then renamed
    // into place: the lock is the inode's and goes with it. A nonce, so that what a killed
    // process with this pid left under that name is never in the way.
    let nonce = uuid::Uuid::new_v4().as_u64_pair().0;
    let making = parent.join(format!("{MAKING_PREFIX}{what}-{me}.{nonce:016x}{MAKING_SUFFIX}"));
    let creating = |e: std::io::Error| format!("creating {}: {e}", path.display());
    // Made, locked and registered under the registry's lock: a signal meanwhile finds it
    // registered or not made (nor left under its making name), and no other thread of this
    // process can see it unlocked.
    let mut registry = leftovers();
    if registry.dirs.contains(&path) {
        return Err(format!("{}: already in use by this run", path.display()));
    }
    std::fs::DirBuilder::new().mode(0o700).create(&making).map_err(creating)?;
    let placed = open_dir(&making)
        .map_err(|e| format!("opening {}: {e}", making.display()))
        .and_then(|dir| lock_scratch(dir, &path))
        .and_then(|lock| {
            let placed = match rename_into_place(&making, &path) {
                // An earlier process had this pid (pids are reused) and was killed; not this
                // one's.
                Err(e)
                    if e.kind() == std::io::ErrorKind::AlreadyExists
                        && remove_if_stale(&path, None, Duration::ZERO) =>
                {
                    rename_into_place(&making, &path)
                }
                placed => placed,
            };
            placed.map(|()| lock).map_err(creating)
        });
    let lock = placed.inspect_err(|_| {
        let _ = std::fs::remove_dir(&making);
    })?;
    registry.dirs.push(path.clone());
    Ok(ScratchDir { path, _lock: lock })
}

/// Locks a new scratch directory (`dir`, opened), to be `path`: `None` where its filesystem
/// cannot lock (NFS mounted `nolock`: ENOLCK, EOPNOTSUPP), with a warning. It is used
/// unlocked then: a later run's sweep that can see this process's pid (in this pid
/// namespace) keeps it, and one whose lock fails there too removes nothing. Held by another
/// (EWOULDBLOCK) is an error: another run has it.
fn lock_scratch(dir: std::fs::File, path: &Path) -> Result<Option<nix::fcntl::Flock<std::fs::File>>, String> {
    locked_or_not(nix::fcntl::Flock::lock(dir, nix::fcntl::FlockArg::LockExclusiveNonblock), path)
}

/// [`lock_scratch`]'s answer for what `flock` gave.
fn locked_or_not(
    locked: Result<nix::fcntl::Flock<std::fs::File>, (std::fs::File, nix::errno::Errno)>,
    path: &Path,
) -> Result<Option<nix::fcntl::Flock<std::fs::File>>, String> {
    match locked {
        Ok(lock) => Ok(Some(lock)),
        // EWOULDBLOCK is EAGAIN.
        Err((_, e @ nix::errno::Errno::EWOULDBLOCK)) => Err(format!("locking {}: {e}", path.display())),
        Err((_, e)) => {
            log::warn!(
                "cannot lock {} ({e}): using it unlocked; a later run keeps it by its pid, which one \
                 in another pid namespace cannot see",
                path.display()
            );
            Ok(None)
        }
    }
}

/// Renames the made scratch directory `from` to `to`, never over anything at `to`
/// (`RENAME_NOREPLACE`: a plain rename would replace an empty directory, a live run's of the
/// same name in another pid namespace, say). A filesystem without that flag (EINVAL: NFS)
/// gets a plain rename when nothing is at `to`, looked at first.
fn rename_into_place(from: &Path, to: &Path) -> std::io::Result<()> {
    use nix::fcntl::{renameat2, RenameFlags, AT_FDCWD};
    match renameat2(AT_FDCWD, from, AT_FDCWD, to, RenameFlags::RENAME_NOREPLACE) {
        Ok(()) => Ok(()),
        Err(nix::errno::Errno::EINVAL) => match to.symlink_metadata() {
            Ok(_) => Err(std::io::Error::from(std::io::ErrorKind::AlreadyExists)),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => std::fs::rename(from, to),
            Err(e) => Err(e),
        },
        Err(e) => Err(e.into()),
    }
}

/// Opens the directory `path` itself, never through a symbolic link.
fn open_dir(path: &Path) -> std::io::Result<std::fs::File> {
    std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECTORY | libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .open(path)
}

/// Whether process `pid` exists (another user's too: kill(2) says EPERM for it).
fn process_exists(pid: i32) -> bool {
    !matches!(kill(Pid::from_raw(pid), None), Err(nix::errno::Errno::ESRCH))
}

/// Removes the scratch directories in `parent` that runs now gone left behind (a run killed
/// with SIGKILL removes nothing); returns their paths. One is removed only if it is a
/// directory (a symbolic link is never followed) of this user's, mode 0700 as made, named
/// `umdev-scratch-WHAT-PID` with a PID no process has now, and nobody holds its lock. So is
/// one a run killed while making it left under the making name (see [`MAKING_PREFIX`]), once
/// it is [`MAKING_LEFTOVER_AGE`] old: until then it may be a live run's, not locked yet. What
/// cannot be removed is left, with a warning: this run does not need it gone.
pub fn remove_stale(parent: &Path) -> Vec<PathBuf> {
    let me = std::process::id();
    let Ok(entries) = std::fs::read_dir(parent) else { return Vec::new() };
    let mut removed = Vec::new();
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some((pid, min_age)) = name.to_str().and_then(scratch_name) else { continue };
        // This process's own are in use (or about to be made, under their name).
        if pid == me || pid == 0 || !entry.file_type().is_ok_and(|t| t.is_dir()) {
            continue;
        }
        let Ok(pid) = i32::try_from(pid) else { continue };
        let path = entry.path();
        if remove_if_stale(&path, Some(pid), min_age) {
            removed.push(path);
        }
    }
    removed
}

/// The pid a scratch directory's name holds, and how old it must be to be taken for a gone
/// run's: `umdev-scratch-WHAT-PID` at any age, `.umdev-scratch-WHAT-PID.NONCE.new` (one being
/// made) at [`MAKING_LEFTOVER_AGE`]. `None` for any other name.
fn scratch_name(name: &str) -> Option<(u32, Duration)> {
    let pid = |rest: &str| rest.rsplit_once('-').and_then(|(_, pid)| pid.parse::<u32>().ok());
    if let Some(rest) = name.strip_prefix(SCRATCH_PREFIX) {
        return Some((pid(rest)?, Duration::ZERO));
    }
    let (named, _nonce) = name.strip_prefix(MAKING_PREFIX)?.strip_suffix(MAKING_SUFFIX)?.rsplit_once('.')?;
    Some((pid(named)?, MAKING_LEFTOVER_AGE))
}

/// Whether what `meta` describes was last written `age` ago or more; a time in the future
/// (another machine's clock, over NFS) is young.
fn written_before(meta: &std::fs::Metadata, age: Duration) -> bool {
    meta.modified().is_ok_and(|t| t.elapsed().is_ok_and(|elapsed| elapsed >= age))
}

/// Removes `path` if it is a scratch directory whose run is gone (see [`remove_stale`]);
/// `pid`, the process named in it, must not exist (`None`: this process's pid, which has
/// not made it), and it must be `min_age` old at least (by its modification time: nothing
/// is written in one before it is renamed into place). Whether it was removed.
fn remove_if_stale(path: &Path, pid: Option<i32>, min_age: Duration) -> bool {
    let Ok(dir) = open_dir(path) else { return false };
    let Ok(meta) = dir.metadata() else { return false };
    let me = nix::unistd::geteuid().as_raw();
    if meta.uid() != me || meta.mode() & 0o7777 != 0o700 || pid.is_some_and(process_exists) {
        return false;
    }
    if !min_age.is_zero() && !written_before(&meta, min_age) {
        return false;
    }
    // Held by a run (a pid of another namespace, say): in use.
    let Ok(lock) = nix::fcntl::Flock::lock(dir, nix::fcntl::FlockArg::LockExclusiveNonblock) else {
        return false;
    };
    // Still the directory that was looked at, not one renamed there since.
    let same = std::fs::symlink_metadata(path)
        .is_ok_and(|now| now.is_dir() && (now.dev(), now.ino()) == (meta.dev(), meta.ino()));
    if !same {
        return false;
    }
    // remove_dir_all follows no symbolic link inside the directory either.
    let result = std::fs::remove_dir_all(path);
    drop(lock);
    match result {
        Ok(()) => true,
        Err(e) => {
            log::warn!("cannot remove {}, which a killed run left: {e}", path.display());
            false
        }
    }
}

/// Says on stderr (the status log) which `what` (`file(s)`, `director(ies)`) a sweep removed.
pub fn say_removed(what: &str, removed: &[PathBuf]) {
    if !removed.is_empty() {
        let names: Vec<String> = removed.iter().map(|p| p.display().to_string()).collect();
        log::info!(
            target: crate::logging::STATUS,
            "removed {} temporary {what} that killed runs left: {}",
            names.len(),
            names.join(", ")
        );
    }
}

/// The name of the temporary file that stands in for the file `name` until it is whole
/// (`.NAME.PID.tmp`, beside it; see [`crate::output::PendingFile`]).
#[cfg(feature = "bench")]
pub fn pending_name(name: &str, pid: u32) -> String {
    format!(".{name}.{pid}.tmp")
}

/// Removes, in `dir`, the temporary files ([`pending_name`]) that runs now gone left while
/// writing the file `name` (a run killed with SIGKILL removes nothing); returns their paths.
/// One is removed only if it is a regular file (a symbolic link is never followed) of this
/// user's, its pid names no process, and it was last written [`MAKING_LEFTOVER_AGE`] ago or
/// more: a younger one may be a live run's in another pid namespace, which cannot be seen.
#[cfg(feature = "bench")]
pub fn remove_stale_pending(dir: &Path, name: &str) -> Vec<PathBuf> {
    let me = std::process::id();
    let Ok(entries) = std::fs::read_dir(dir) else { return Vec::new() };
    let uid = nix::unistd::geteuid().as_raw();
    let mut removed = Vec::new();
    for entry in entries.flatten() {
        let file_name = entry.file_name();
        let Some(pid) = file_name
            .to_str()
            .and_then(|n| n.strip_prefix('.'))
            .and_then(|n| n.strip_prefix(name))
            .and_then(|n| n.strip_prefix('.'))
            .and_then(|n| n.strip_suffix(".tmp"))
            .and_then(|pid| pid.parse::<u32>().ok())
        else {
            continue;
        };
        let Ok(pid_raw) = i32::try_from(pid) else { continue };
        let path = entry.path();
        // Looked at without following a link; DirEntry::metadata does not follow either.
        let Ok(meta) = entry.metadata() else { continue };
        let old_enough = written_before(&meta, MAKING_LEFTOVER_AGE);
        if pid == me
            || pid == 0
            || !meta.is_file()
            || meta.uid() != uid
            || !old_enough
            || process_exists(pid_raw)
        {
            continue;
        }
        match std::fs::remove_file(&path) {
            Ok(()) => removed.push(path),
            Err(e) => log::warn!("cannot remove {}, which a killed run left: {e}", path.display()),
        }
    }
    removed
}

/// Creates a temporary file with `create` and registers it to remove on a signal, as one
/// step: the registry is held meanwhile, so a signal between the two cannot leave the file
/// behind (the cleanup thread takes the registry after it, or keeps it from then on). A file
/// `create` fails to make (one already there may be another's) is not registered.
pub fn create_file<T>(path: &Path, create: impl FnOnce() -> std::io::Result<T>) -> std::io::Result<T> {
    let mut registry = leftovers();
    let made = create()?;
    registry.files.push(path.to_path_buf());
    Ok(made)
}

/// The file is gone, or is temporary no more (renamed to what it was for).
pub fn forget_file(path: &Path) {
    leftovers().files.retain(|f| f != path);
}

/// Registers a child process to stop on a signal.
pub fn child(pid: u32) {
    leftovers().children.push(pid);
}

/// The child has been reaped.
pub fn forget_child(pid: u32) {
    leftovers().children.retain(|c| *c != pid);
}

/// Makes `command`'s process get SIGTERM when this one dies, however it dies.
pub fn die_with_parent(command: &mut Command) {
    // SAFETY: prctl(PR_SET_PDEATHSIG) is async-signal-safe and touches no memory of the
    // parent, as a pre_exec closure must.
    unsafe {
        command.pre_exec(|| nix::sys::prctl::set_pdeathsig(Signal::SIGTERM).map_err(std::io::Error::from));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A file is made and registered under the registry's lock (which the cleanup thread
    /// takes to remove what is registered); one that could not be made is not registered.
    #[test]
    fn a_temporary_file_is_registered_as_it_is_made() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("made");
        let made = create_file(&path, || {
            assert!(
                matches!(LEFTOVERS.try_lock(), Err(std::sync::TryLockError::WouldBlock)),
                "a signal could come between making the file and registering it"
            );
            std::fs::File::create_new(&path)
        });
        assert!(made.is_ok(), "{made:?}");
        assert!(leftovers().files.contains(&path));
        let again = create_file(&path, || std::fs::File::create_new(&path));
        assert!(again.is_err());
        assert_eq!(leftovers().files.iter().filter(|f| **f == path).count(), 1, "registered once, when made");
        forget_file(&path);
        assert!(!leftovers().files.contains(&path));
    }

    /// A pid no process can have: past the kernel's `pid_max`.
    fn gone() -> u32 {
        let max: u32 = std::fs::read_to_string("/proc/sys/kernel/pid_max").unwrap().trim().parse().unwrap();
        max + 1
    }

    /// Only what a run that is gone left is removed: a directory of this user's, as made
    /// (0700), named for a pid no process has, that nobody holds locked. Not a symbolic link
    /// by that name (nor what it or a link inside leads to), a file, another mode, a live
    /// process's or a locked one, nor a user's `umdev-state-UID` in /tmp.
    #[test]
    fn only_the_directories_of_runs_that_are_gone_are_removed() {
        use std::os::unix::fs::PermissionsExt;
        let parent = tempfile::tempdir().unwrap();
        let outside = tempfile::tempdir().unwrap();
        std::fs::write(outside.path().join("kept"), "").unwrap();
        let dir = |name: String, mode: u32| {
            let path = parent.path().join(name);
            std::fs::create_dir(&path).unwrap();
            std::fs::set_permissions(&path, std::fs::Permissions::from_mode(mode)).unwrap();
            path
        };
        let dead = gone();
        let stale = dir(format!("umdev-scratch-ccwbench-lock-{dead}"), 0o700);
        std::fs::write(stale.join("ccw.sock"), "").unwrap();
        std::os::unix::fs::symlink(outside.path(), stale.join("link")).unwrap();
        let kept = [
            dir(format!("umdev-scratch-demo-{}", nix::unistd::getppid()), 0o700),
            dir(format!("umdev-scratch-protobench-{dead}"), 0o755),
            dir(format!("umdev-state-{dead}"), 0o700),
            dir(format!("umdev-scratch-nvmebench-{}", dead + 1), 0o700),
        ];
        // Locked: a run in another pid namespace, say.
        let _held =
            nix::fcntl::Flock::lock(open_dir(&kept[3]).unwrap(), nix::fcntl::FlockArg::LockExclusiveNonblock)
                .unwrap();
        let file = parent.path().join(format!("umdev-scratch-pinbench-{dead}"));
        std::fs::write(&file, "").unwrap();
        let link = parent.path().join(format!("umdev-scratch-demo-{dead}"));
        std::os::unix::fs::symlink(outside.path(), &link).unwrap();
        assert_eq!(remove_stale(parent.path()), vec![stale.clone()]);
        assert!(!stale.exists());
        assert!(kept.iter().chain([&file, &link]).all(|p| p.symlink_metadata().is_ok()), "{kept:?}");
        assert!(outside.path().join("kept").exists(), "no link was followed");
        // This run's own: made 0700 and locked, so no other run takes it for stale; removed
        // on drop.
        let mine = scratch_dir_in(parent.path(), "test").unwrap();
        let name = format!("umdev-scratch-test-{}", std::process::id());
        assert_eq!(mine.path(), parent.path().join(&name));
        assert_eq!(std::fs::metadata(mine.path()).unwrap().permissions().mode() & 0o7777, 0o700);
        assert!(!remove_if_stale(mine.path(), None, Duration::ZERO), "locked while it exists");
        assert!(scratch_dir_in(parent.path(), "test").is_err(), "one per name and run");
        let path = mine.path().to_path_buf();
        drop(mine);
        assert!(!path.exists() && !leftovers().dirs.contains(&path));
        // One an earlier process with this pid left is taken over; another's name is not.
        std::fs::create_dir(&path).unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o700)).unwrap();
        std::fs::write(path.join("old"), "").unwrap();
        let again = scratch_dir_in(parent.path(), "test").unwrap();
        assert!(!again.path().join("old").exists());
        drop(again);
        std::os::unix::fs::symlink(outside.path(), &path).unwrap();
        let err = scratch_dir_in(parent.path(), "test").err().unwrap();
        assert!(err.contains(&format!("creating {}", path.display())), "{err}");
        assert!(outside.path().join("kept").exists());
        let names: Vec<_> =
            std::fs::read_dir(parent.path()).unwrap().flatten().map(|e| e.file_name()).collect();
        assert!(
            !names.iter().any(|n| n.to_string_lossy().starts_with(MAKING_PREFIX)),
            "a failed run leaves nothing under the making name: {names:?}"
        );
    }

    /// A scratch directory is made under a name the sweep does not take for a run's
    /// (unlocked there: a sweeper in another pid namespace cannot see its pid) and renamed
    /// into place; one a run killed while making it left is removed once it is old, never
    /// while it may be a live run's.
    #[test]
    fn a_directory_being_made_is_left_alone_until_it_is_old() {
        use std::os::unix::fs::PermissionsExt;
        let parent = tempfile::tempdir().unwrap();
        let dead = gone();
        let making = |nonce: &str| {
            let path = parent.path().join(format!(".umdev-scratch-ccwbench-lock-{dead}.{nonce}.new"));
            std::fs::create_dir(&path).unwrap();
            std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o700)).unwrap();
            path
        };
        let fresh = making("0123456789abcdef");
        let old = making("fedcba9876543210");
        let age = std::time::SystemTime::now() - MAKING_LEFTOVER_AGE - Duration::from_secs(60);
        open_dir(&old).unwrap().set_times(std::fs::FileTimes::new().set_modified(age)).unwrap();
        // The final name's pattern never matches the making name, whatever follows.
        assert_eq!(scratch_name(&format!("umdev-scratch-demo-{dead}")), Some((dead, Duration::ZERO)));
        assert_eq!(scratch_name(&format!(".umdev-scratch-demo-{dead}")), None);
        assert_eq!(
            scratch_name(&format!(".umdev-scratch-demo-{dead}.1.new")),
            Some((dead, MAKING_LEFTOVER_AGE))
        );
        assert_eq!(remove_stale(parent.path()), vec![old.clone()]);
        assert!(fresh.exists() && !old.exists());
        // This run's: made under the making name and renamed, locked, into place; nothing is
        // left under the making name.
        let mine = scratch_dir_in(parent.path(), "test").unwrap();
        assert_eq!(mine.path(), parent.path().join(format!("umdev-scratch-test-{}", std::process::id())));
        assert!(!remove_if_stale(mine.path(), None, Duration::ZERO), "locked under its name");
        let mut names: Vec<_> =
            std::fs::read_dir(parent.path()).unwrap().flatten().map(|e| e.path()).collect();
        names.sort();
        let mut expected = vec![fresh.clone(), mine.path().to_path_buf()];
        expected.sort();
        assert_eq!(names, expected);
    }

    /// A lock held by another fails the run; a filesystem that cannot lock (NFS `nolock`)
    /// gives an unlocked directory instead.
    #[test]
    fn only_a_lock_held_by_another_is_fatal() {
        use nix::errno::Errno;
        let dir = tempfile::tempdir().unwrap();
        let refused = |errno| locked_or_not(Err((open_dir(dir.path()).unwrap(), errno)), dir.path());
        let held = refused(Errno::EWOULDBLOCK).err().unwrap();
        assert!(held.contains(&format!("locking {}", dir.path().display())), "{held}");
        for errno in [Errno::ENOLCK, Errno::EOPNOTSUPP, Errno::ENOTSUP] {
            assert!(matches!(refused(errno), Ok(None)), "{errno}");
        }
    }

    /// What `pinbench --svg` killed with SIGKILL leaves beside its picture goes once it is old
    /// and its run is gone; nothing else does.
    #[cfg(feature = "bench")]
    #[test]
    fn a_killed_runs_temporary_file_beside_the_picture_is_removed_when_old() {
        let dir = tempfile::tempdir().unwrap();
        let old = std::time::SystemTime::now() - MAKING_LEFTOVER_AGE - Duration::from_secs(60);
        let file = |name: String, aged: bool| {
            let path = dir.path().join(name);
            let f = std::fs::File::create(&path).unwrap();
            if aged {
                f.set_times(std::fs::FileTimes::new().set_modified(old)).unwrap();
            }
            path
        };
        let dead = gone();
        let stale = file(pending_name("pins.svg", dead), true);
        // Young: may be a live run's in another pid namespace.
        let fresh_dead = file(pending_name("pins.svg", dead + 1), false);
        let live = file(pending_name("pins.svg", 1), true); // init's
        let other = file(pending_name("other.svg", dead), true);
        let link = dir.path().join(pending_name("pins.svg", dead + 2));
        std::os::unix::fs::symlink(&other, &link).unwrap();
        assert_eq!(remove_stale_pending(dir.path(), "pins.svg"), vec![stale.clone()]);
        assert!(!stale.exists());
        for kept in [&fresh_dead, &live, &other, &link] {
            assert!(kept.symlink_metadata().is_ok(), "{} was removed", kept.display());
        }
    }
}
