//! What a benchmark (or the demo) would leave behind if it were stopped: its temporary
//! directories and files and the `umdev run` servers it started. Each is registered while it
//! exists; on SIGINT, SIGTERM or SIGHUP (Ctrl-C, `kill`, `timeout`, a closed terminal unless
//! under `nohup`) a thread stops the servers, removes the directories and files and exits
//! 128 + the signal (no destructor runs). A server also gets SIGTERM from the kernel if the
//! benchmark dies any other way (`PR_SET_PDEATHSIG`).

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

/// Registers a temporary directory to remove on a signal.
pub fn dir(path: &Path) {
    leftovers().dirs.push(path.to_path_buf());
}

/// The directory is gone (or kept on purpose).
pub fn forget_dir(path: &Path) {
    leftovers().dirs.retain(|d| d != path);
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
}
