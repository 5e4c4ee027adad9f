//! The mdevctl-style lifecycle commands: `umdev daemon` (also as a systemd service,
//! contrib/systemd/umdev.service), `start`, `stop`, `list`, `define`, `modify`,
//! `undefine`, `stats`, and a daemon-aware `types`.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use sd_notify::NotifyState;
use signal_hook::consts::{SIGHUP, SIGINT, SIGTERM};
use signal_hook::iterator::Signals;
use umdev::control::{request, ControlError, ControlRequest, ControlResponse, ControlServer};
use umdev::lifecycle::{
    check_definition, check_private_dir, overlay, sync_status, DaemonStatus, Definition, DefinitionEntry,
    Definitions, InstanceSummary, LifecycleError, Manager, ReloadReport, StartPolicy, TypeSummary,
};
use umdev::mdevctl::{self, DeviceConfig, PARENT};
use umdev_mdev::types::{InstanceOptions, PinModeName};
use umdev_server::InstanceConfig;
use uuid::Uuid;

use crate::logging::STATUS;
use crate::output::{out, Out};

/// Where the daemon keeps its sockets and definitions.
#[derive(Clone, Debug)]
pub struct Dirs {
    /// Control socket and instance sockets.
    pub run: PathBuf,
    /// Persistent definitions.
    pub state: PathBuf,
    /// Whether `state` was named (`--state-dir`, `$UMDEV_STATE_DIR`) rather than a default.
    pub state_named: bool,
}

/// Root's run directory: the service's `RuntimeDirectory=umdev`.
const ROOT_RUN_DIR: &str = "/run/umdev";
/// Root's definitions: the service's `ConfigurationDirectory=umdev.d` (as mdevctl's /etc/mdevctl.d).
const ROOT_STATE_DIR: &str = "/etc/umdev.d";

impl Dirs {
    /// Explicit directories, else `$UMDEV_RUN_DIR`/`$UMDEV_STATE_DIR`, else for root
    /// `/run/umdev` and `/etc/umdev.d`, for others `$XDG_RUNTIME_DIR/umdev` and
    /// `$XDG_CONFIG_HOME/umdev` (or `/tmp/umdev-$UID`, `~/.config/umdev`, `/tmp/umdev-state-$UID`
    /// without `$HOME`). Each must be the user's own, not writable by others
    /// ([`umdev::lifecycle::private_dir`]).
    pub fn resolve(run: Option<PathBuf>, state: Option<PathBuf>) -> Dirs {
        let env = |k: &str| std::env::var_os(k).filter(|v| !v.is_empty()).map(PathBuf::from);
        let root = nix::unistd::geteuid().is_root();
        let run = run.or_else(|| env("UMDEV_RUN_DIR")).unwrap_or_else(|| {
            if root {
                PathBuf::from(ROOT_RUN_DIR)
            } else {
                env("XDG_RUNTIME_DIR")
                    .map(|d| d.join("umdev"))
                    .unwrap_or_else(|| PathBuf::from(format!("/tmp/umdev-{}", nix::unistd::geteuid())))
            }
        });
        let state = state.or_else(|| env("UMDEV_STATE_DIR"));
        let state_named = state.is_some();
        let state = state.unwrap_or_else(|| {
            if root {
                PathBuf::from(ROOT_STATE_DIR)
            } else {
                env("XDG_CONFIG_HOME")
                    .or_else(|| env("HOME").map(|h| h.join(".config")))
                    .map(|d| d.join("umdev"))
                    .unwrap_or_else(|| PathBuf::from(format!("/tmp/umdev-state-{}", nix::unistd::geteuid())))
            }
        });
        // Paths the daemon reports back (sockets) must mean the same from any directory.
        let absolute = |p: PathBuf| std::path::absolute(&p).unwrap_or(p);
        Dirs { run: absolute(run), state: absolute(state), state_named }
    }

    /// As [`Dirs::resolve`], but the directories systemd made for the service come before the
    /// defaults: `$RUNTIME_DIRECTORY` and `$CONFIGURATION_DIRECTORY` (`RuntimeDirectory=umdev`,
    /// `ConfigurationDirectory=umdev.d` in contrib/systemd/umdev.service: /run/umdev and
    /// /etc/umdev.d, the defaults the CLI uses as root). Only the daemon reads them: a client
    /// run from another unit would find that unit's directories there.
    pub fn for_daemon(run: Option<PathBuf>, state: Option<PathBuf>) -> Dirs {
        // systemd joins several directories with ':'; the unit names one, the first is ours.
        let systemd = |k: &str| {
            let v = std::env::var(k).ok()?;
            v.split(':').next().filter(|d| !d.is_empty()).map(PathBuf::from)
        };
        let ours = |k: &str| std::env::var_os(k).filter(|v| !v.is_empty()).map(PathBuf::from);
        let run = run.or_else(|| ours("UMDEV_RUN_DIR")).or_else(|| systemd("RUNTIME_DIRECTORY"));
        let state = state.or_else(|| ours("UMDEV_STATE_DIR")).or_else(|| systemd("CONFIGURATION_DIRECTORY"));
        Dirs::resolve(run, state)
    }

    fn control(&self) -> PathBuf {
        self.run.join("control.sock")
    }

    /// Refuses a command whose definitions directory is not the one the daemon `status`
    /// came from reads: it would show or start definitions the daemon does not have.
    fn check_daemon_definitions(&self, status: &DaemonStatus) -> Result<(), String> {
        let Some(theirs) = &status.definitions else { return Ok(()) };
        if same_directory(theirs, &self.state) {
            return Ok(());
        }
        let ours = if self.state_named { "named here" } else { "this command's default" };
        Err(format!(
            "the daemon on {} reads the definitions in {}, not {} ({ours}): give --state-dir {} (or \
             $UMDEV_STATE_DIR), or run a daemon of their own on another --run-dir",
            self.run.display(),
            theirs.display(),
            self.state.display(),
            theirs.display()
        ))
    }
}

/// Whether `a` and `b` are one directory: by device and inode where both exist (a bind
/// mount, as a service's read-only /etc, shows it at the same path under another mount, and
/// a symbolic link or `..` at another path), else by their canonical paths.
fn same_directory(a: &Path, b: &Path) -> bool {
    use std::os::unix::fs::MetadataExt;
    match (std::fs::metadata(a), std::fs::metadata(b)) {
        (Ok(a), Ok(b)) => (a.dev(), a.ino()) == (b.dev(), b.ino()),
        _ => {
            let canonical = |p: &Path| std::fs::canonicalize(p).unwrap_or_else(|_| p.to_path_buf());
            canonical(a) == canonical(b)
        }
    }
}

fn ask(dirs: &Dirs, req: ControlRequest) -> Result<serde_json::Value, String> {
    result_of(request(&dirs.control(), &req).map_err(|e| e.to_string())?)
}

/// As [`ask`], for a request that changes what the daemon runs: one the daemon took but did
/// not answer in time may still be carried out, and the message says so (`pending`, as
/// "the device UUID may still start").
fn ask_to_change(dirs: &Dirs, req: ControlRequest, pending: &str) -> Result<serde_json::Value, String> {
    match request(&dirs.control(), &req) {
        Err(e @ ControlError::NoAnswer(..)) => Err(format!("{e}; {pending}: see `umdev list`")),
        answer => result_of(answer.map_err(|e| e.to_string())?),
    }
}

fn result_of(answer: ControlResponse) -> Result<serde_json::Value, String> {
    tell_warnings(&answer);
    if answer.ok {
        Ok(answer.result.unwrap_or(serde_json::Value::Null))
    } else {
        Err(answer.error.unwrap_or_else(|| "the daemon refused the request".into()))
    }
}

/// What the daemon answers to `req`, or `None` when no daemon runs.
fn ask_if_running<T: serde::de::DeserializeOwned>(
    dirs: &Dirs,
    req: &ControlRequest,
) -> Result<Option<T>, String> {
    match request(&dirs.control(), req).inspect(tell_warnings) {
        Ok(answer) if answer.ok => {
            serde_json::from_value(answer.result.unwrap_or_default()).map(Some).map_err(|e| e.to_string())
        }
        Ok(answer) => Err(answer.error.unwrap_or_else(|| "the daemon refused the request".into())),
        Err(e) if e.not_running() => Ok(None),
        Err(e) => Err(e.to_string()),
    }
}

/// Prints what the daemon warned of while it served the request (a device that started with
/// a warning): on stderr, as the command's own warnings, before its result.
fn tell_warnings(answer: &ControlResponse) {
    for warning in &answer.warnings {
        log::warn!(target: STATUS, "{warning}");
    }
}

fn parse_uuid(s: &str) -> Result<Uuid, String> {
    Uuid::parse_str(s).map_err(|_| format!("{s:?} is not a UUID"))
}

/// `-p PARENT`: umdev's types have one parent, [`PARENT`].
pub fn check_parent(parent: Option<&str>) -> Result<(), String> {
    match parent {
        None | Some(PARENT) => Ok(()),
        Some(other) => {
            Err(format!("no parent device {other:?}: umdev's types all hang off one parent, {PARENT:?}"))
        }
    }
}

/// A device config from `--jsonfile FILE` (`-` for standard input).
pub fn read_jsonfile(path: &Path) -> Result<DeviceConfig, String> {
    let text = if path == Path::new("-") {
        std::io::read_to_string(std::io::stdin()).map_err(|e| format!("reading standard input: {e}"))?
    } else {
        std::fs::read_to_string(path).map_err(|e| format!("reading {}: {e}", path.display()))?
    };
    DeviceConfig::parse(&text).map_err(|e| format!("{}: {e}", path.display()))
}

/// The daemon's and its definitions' directories, held for one daemon: a lock on each
/// directory itself (a second daemon on either is refused), which goes when the daemon exits,
/// however it exits. Locking the directory, not a file in it, leaves nothing behind and works
/// where the definitions are read-only to the daemon (systemd's ConfigurationDirectory=).
struct DirLocks {
    _locks: Vec<nix::fcntl::Flock<std::fs::File>>,
    /// The daemon's pid file, removed with the locks: on any way out, a failed start too.
    pid_file: PathBuf,
}

impl Drop for DirLocks {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.pid_file);
    }
}

impl DirLocks {
    fn take(dirs: &Dirs) -> Result<DirLocks, String> {
        use nix::fcntl::{Flock, FlockArg};
        umdev::lifecycle::private_dir(&dirs.state).map_err(|e| e.to_string())?;
        let mut locks = Vec::new();
        let mut held: Vec<PathBuf> = Vec::new();
        for (dir, what) in [(&dirs.run, "the run directory"), (&dirs.state, "the definitions in")] {
            let canonical = std::fs::canonicalize(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
            if held.contains(&canonical) {
                continue;
            }
            let file = std::fs::File::open(dir).map_err(|e| format!("opening {}: {e}", dir.display()))?;
            let lock = Flock::lock(file, FlockArg::LockExclusiveNonblock).map_err(|(file, e)| {
                if e != nix::errno::Errno::EWOULDBLOCK {
                    return format!("locking {}: {e}", dir.display());
                }
                let holder = match lock_holder(&file) {
                    Some(pid) => format!(" (pid {pid})"),
                    None => String::new(),
                };
                format!("another umdev daemon{holder} already uses {what} {}", dir.display())
            })?;
            locks.push(lock);
            held.push(canonical);
        }
        let pid_file = dirs.run.join(PID_FILE);
        let _ = std::fs::write(&pid_file, format!("{}\n", std::process::id()));
        Ok(DirLocks { _locks: locks, pid_file })
    }
}

/// The daemon's pid, in its run directory while it runs.
const PID_FILE: &str = "daemon.pid";

/// The process holding a `flock` on `file`, from `/proc/locks` (the daemon holding a directory
/// a second one wants; its pid file is in its own run directory, which may not be this one's).
/// `None` where the kernel does not say (no such lock, or a holder in no pid namespace of ours).
fn lock_holder(file: &std::fs::File) -> Option<u32> {
    use std::os::unix::fs::MetadataExt;
    let meta = file.metadata().ok()?;
    let (dev, ino) = (meta.dev(), meta.ino());
    let id = format!("{:02x}:{:02x}:{ino}", libc::major(dev), libc::minor(dev));
    let locks = std::fs::read_to_string("/proc/locks").ok()?;
    // "1: FLOCK  ADVISORY  WRITE 1234 fd:01:5678 0 EOF"; a waiter's line has "->" after the
    // number, and ours is never held, so the one FLOCK line on this file is the holder's.
    locks.lines().find_map(|line| {
        let fields: Vec<&str> = line.split_whitespace().collect();
        match fields.as_slice() {
            [_, "FLOCK", _, _, pid, file_id, ..] if *file_id == id => pid.parse().ok().filter(|&p| p > 0),
            _ => None,
        }
    })
}

/// Removes the sockets a daemon that died left in `run` (the control socket and `<uuid>.sock`
/// files nothing listens on). Called with the run directory's lock held: no daemon of ours is
/// there, and a socket someone else still serves is left alone.
fn remove_stale_sockets(run: &Path) -> Vec<PathBuf> {
    use std::os::unix::fs::FileTypeExt;
    let Ok(entries) = std::fs::read_dir(run) else { return Vec::new() };
    let mut removed = Vec::new();
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().to_string();
        let ours =
            name == "control.sock" || name.strip_suffix(".sock").is_some_and(|u| Uuid::parse_str(u).is_ok());
        let is_socket = entry.file_type().is_ok_and(|t| t.is_socket());
        let path = entry.path();
        if ours
            && is_socket
            && std::os::unix::net::UnixStream::connect(&path).is_err()
            && std::fs::remove_file(&path).is_ok()
        {
            removed.push(path);
        }
    }
    removed
}

/// `umdev daemon`: serves the control socket and instances until SIGINT/SIGTERM; SIGHUP
/// re-reads the definitions. `template` carries the limits every instance gets.
///
/// The control socket listens once every `auto` definition has been started. Under systemd
/// (`Type=notify`, $NOTIFY_SOCKET) it then reports READY=1, RELOADING=1/READY=1 around a SIGHUP,
/// STATUS= whenever the instances or their clients change, and STOPPING=1 before it stops
/// its instances.
pub fn daemon(dirs: &Dirs, template: InstanceConfig, max_instances: usize) -> Result<(), String> {
    let mut made = MadeDirs::before(&[&dirs.run, &dirs.state]);
    umdev::lifecycle::private_dir(&dirs.run).map_err(|e| e.to_string())?;
    let locks = DirLocks::take(dirs)?;
    let stale = remove_stale_sockets(&dirs.run);
    if !stale.is_empty() {
        log::warn!(
            target: STATUS,
            "removed {} stale socket(s) a daemon that died left in {}",
            stale.len(),
            dirs.run.display()
        );
    }
    // Before anything starts: a SIGHUP while the auto definitions start waits its turn.
    let mut signals =
        Signals::new([SIGINT, SIGTERM, SIGHUP]).map_err(|e| format!("installing signal handlers: {e}"))?;
    let budget = umdev_pinning::process_mapping_limit();
    let worst = (max_instances as u64).saturating_mul(u64::from(template.limits.max_dma_maps));
    if worst > budget {
        log::info!(
            "{max_instances} instances x {} mappings each exceed the process's {budget} guest mappings: once \
             they are used, DMA_MAP fails with ENOMEM for every client (raise vm.max_map_count and \
             --max-process-mappings to allow more)",
            template.limits.max_dma_maps
        );
    }
    let manager = Arc::new(
        Manager::new(umdev::builtin_registry(), &dirs.run, Definitions::new(&dirs.state), template)
            .with_max_instances(max_instances),
    );
    // The auto definitions start before the control socket listens: a client that finds the
    // socket (a script, a test: without systemd there is no READY=1 to wait for) finds them
    // running.
    report(&manager.reload());
    let control = ControlServer::start(manager.clone(), &dirs.control()).map_err(|e| e.to_string())?;
    log::info!(
        target: STATUS,
        "daemon running (control {}, definitions {}); {} instance(s) started",
        dirs.control().display(),
        dirs.state.display(),
        manager.list().len()
    );
    made.keep();
    let status = StatusReporter::start(manager.clone());
    for signal in signals.forever() {
        if signal != SIGHUP {
            log::info!(target: STATUS, "signal {signal}, shutting down");
            break;
        }
        log::info!(target: STATUS, "SIGHUP: re-reading the definitions in {}", dirs.state.display());
        // sd_notify(3) asks for MONOTONIC_USEC= with RELOADING=1 since systemd 253; older ones ignore it.
        let mut reloading = vec![NotifyState::Reloading];
        reloading.extend(NotifyState::monotonic_usec_now().ok());
        notify(&reloading);
        report(&manager.reload());
        status.ready();
    }
    drop(status);
    notify(&[NotifyState::Stopping, NotifyState::Status("stopping every instance")]);
    drop(control);
    manager.shutdown();
    drop(locks);
    Ok(())
}

/// The directories a daemon is about to make, removed again (those still empty) if it does not
/// get as far as serving: a refused second daemon leaves no directory behind.
struct MadeDirs {
    /// Each missing directory and its topmost missing ancestor, which goes last.
    missing: Vec<(PathBuf, PathBuf)>,
}

impl MadeDirs {
    fn before(dirs: &[&Path]) -> MadeDirs {
        let missing = dirs
            .iter()
            .filter_map(|dir| {
                let top = dir.ancestors().take_while(|a| !a.as_os_str().is_empty() && !a.exists()).last()?;
                Some((dir.to_path_buf(), top.to_path_buf()))
            })
            .collect();
        MadeDirs { missing }
    }

    /// The daemon serves: its directories stay.
    fn keep(&mut self) {
        self.missing.clear();
    }
}

impl Drop for MadeDirs {
    fn drop(&mut self) {
        for (dir, top) in &self.missing {
            // From the directory up to the first that was there; `remove_dir` leaves one that
            // is not empty (another process's files) alone, and so everything above it.
            for a in dir.ancestors() {
                if std::fs::remove_dir(a).is_err() || a == top.as_path() {
                    break;
                }
            }
        }
    }
}

/// READY=1, then STATUS= whenever what the daemon serves changes: at once for a start or a
/// stop, within a second for a client that comes or goes (the server keeps no hook for that).
struct StatusReporter {
    manager: Arc<Manager>,
    /// The STATUS= last sent. Each sender computes and sends under this lock, so that what
    /// changed after a READY=1 (a client that connected before the thread first looked) is
    /// compared with what READY=1 said, not with a later look, and never goes unsent.
    last: Arc<Mutex<String>>,
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl StatusReporter {
    fn start(manager: Arc<Manager>) -> StatusReporter {
        let stop = Arc::new(AtomicBool::new(false));
        let last = Arc::new(Mutex::new(String::new()));
        let mut reporter =
            StatusReporter { manager: manager.clone(), last: last.clone(), stop: stop.clone(), thread: None };
        reporter.ready();
        // Only a service manager listens; without one there is nothing to follow.
        if std::env::var_os("NOTIFY_SOCKET").is_none() {
            return reporter;
        }
        reporter.thread = std::thread::Builder::new()
            .name("umdev-status".into())
            .spawn(move || {
                let mut seen = 0;
                while !stop.load(Ordering::Acquire) {
                    seen = manager.wait_change(seen, Duration::from_secs(1));
                    let mut last = umdev_pinning::sync::lock(&last);
                    let now = serving(&manager);
                    if now != *last && !stop.load(Ordering::Acquire) {
                        notify(&[NotifyState::Status(&now)]);
                        *last = now;
                    }
                }
            })
            .ok();
        reporter
    }

    fn ready(&self) {
        let mut last = umdev_pinning::sync::lock(&self.last);
        *last = serving(&self.manager);
        notify(&[NotifyState::Ready, NotifyState::Status(&last)]);
    }
}

impl Drop for StatusReporter {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Tells the service manager about the daemon, if one started it with $NOTIFY_SOCKET (a no-op
/// otherwise). A failure is worth a warning, not the service: systemd times the start out.
fn notify(states: &[NotifyState]) {
    if let Err(e) = sd_notify::notify(states) {
        log::warn!(target: STATUS, "cannot notify the service manager: {e}");
    }
}

/// `systemctl status`'s line: what the daemon serves now.
fn serving(manager: &Manager) -> String {
    let instances = manager.list();
    let connected = instances.iter().filter(|i| i.connected).count();
    format!("serving {} instance(s), {connected} with a client", instances.len())
}

/// Logs what a (re)load of the definitions did and found.
fn report(r: &ReloadReport) {
    for uuid in &r.started {
        log::info!(target: STATUS, "started defined device {uuid}");
    }
    for (uuid, e) in &r.failed {
        log::error!(target: STATUS, "could not start defined device {uuid}: {e}");
    }
    for uuid in &r.held_back {
        log::info!(
            target: STATUS,
            "defined device {uuid} was stopped with `umdev stop`; it stays stopped (`umdev start -u {uuid}`)"
        );
    }
    for uuid in &r.undefined {
        log::warn!(
            target: STATUS,
            "instance {uuid} keeps running, but it is no longer defined (`umdev stop -u {uuid}` stops it)"
        );
    }
    for uuid in &r.changed {
        log::warn!(
            target: STATUS,
            "instance {uuid} keeps running as it started; its definition has changed since (stop and start \
             it to apply)"
        );
    }
}

/// What `umdev types` shows.
pub struct TypesView {
    /// One JSON array of types (umdev's shape, with their options).
    pub json: bool,
    /// mdevctl's `types --dumpjson` shape.
    pub dumpjson: bool,
    /// Each type's options too.
    pub verbose: bool,
    /// Only this type (its options shown).
    pub only: Option<String>,
}

/// `umdev types`: the running daemon's view (live capacity), else what a daemon started now
/// would offer, said on stderr.
pub fn types(dirs: &Dirs, view: &TypesView) -> Out {
    let types: Vec<TypeSummary> = match ask_if_running(dirs, &ControlRequest::Types)? {
        Some(types) => types,
        None => {
            log::info!(
                target: STATUS,
                "no daemon runs on {}: the capacity a daemon started now would have",
                dirs.run.display()
            );
            let manager = Manager::new(
                umdev::builtin_registry(),
                "/nonexistent",
                Definitions::new("/nonexistent"),
                InstanceConfig::new("", ""),
            );
            manager.types()
        }
    };
    let types: Vec<TypeSummary> = match &view.only {
        None => types,
        Some(name) => {
            let one: Vec<TypeSummary> = types.into_iter().filter(|t| t.name == *name).collect();
            if one.is_empty() {
                return Err(format!("unknown device type {name:?} (see `umdev types`)"));
            }
            one
        }
    };
    if view.dumpjson {
        let entries: Vec<serde_json::Value> = types
            .iter()
            .map(|t| {
                serde_json::json!({ t.name.clone(): {
                    "available_instances": t.available_instances,
                    "device_api": t.device_api,
                    "name": t.name,
                    "description": t.description,
                }})
            })
            .collect();
        return out!(
            "{}",
            serde_json::to_string_pretty(&serde_json::json!([{ PARENT: entries }]))
                .map_err(|e| e.to_string())?
        );
    }
    if view.json {
        return out!("{}", serde_json::to_string_pretty(&types).map_err(|e| e.to_string())?);
    }
    let verbose = view.verbose || view.only.is_some();
    for t in &types {
        out!(
            "{}\n  Available instances: {}\n  Device API: {}\n  Description: {}",
            t.name,
            t.available_instances,
            t.device_api,
            t.description
        )?;
        if verbose {
            for line in option_lines(t) {
                out!("{line}")?;
            }
        }
    }
    if !verbose {
        out!("(`umdev types -v` or `umdev types TYPE` lists each type's --opt options)")?;
    }
    Ok(())
}

/// A type's options as help and man pages show them.
pub fn option_lines(t: &TypeSummary) -> Vec<String> {
    let mut lines =
        vec!["  Options (--opt KEY=VALUE, each key once; and --pin-mode track|lock|kernel):".to_string()];
    if t.options.is_empty() {
        lines.push("    none".into());
    }
    for o in &t.options {
        let default = o.default.as_deref().map(|d| format!(" (default {d})")).unwrap_or_default();
        lines.push(format!("    {}={}{default}", o.key, o.syntax));
        lines.push(format!("        {}", o.help));
    }
    lines
}

/// What `umdev start` starts.
pub struct StartArgs {
    /// `-t`.
    pub mdev_type: Option<String>,
    /// `-u`.
    pub uuid: Option<String>,
    /// `--opt` and `--pin-mode`.
    pub options: InstanceOptions,
    /// `--jsonfile`.
    pub jsonfile: Option<PathBuf>,
    /// `--override`.
    pub override_definition: bool,
}

/// `umdev start`.
pub fn start(dirs: &Dirs, args: StartArgs) -> Out {
    let uuid = args.uuid.as_deref().map(parse_uuid).transpose()?;
    let (mdev_type, options) = match &args.jsonfile {
        Some(path) => {
            let config = read_jsonfile(path)?;
            let options = config.options()?;
            (Some(config.mdev_type), options)
        }
        None => (args.mdev_type, args.options),
    };
    // A definition named here (-u) that the daemon does not read would go unused (asked
    // before one is read there); a start of a type without -u reads no definition.
    if dirs.state_named && uuid.is_some() {
        if let Some(status) = ask_if_running::<DaemonStatus>(dirs, &ControlRequest::Status)? {
            dirs.check_daemon_definitions(&status)?;
        }
    }
    // Checked here too, for the same message as `define` without a round trip.
    if let Some(t) = &mdev_type {
        let registry = umdev::builtin_registry();
        // A directory that cannot be read is refused here, as the daemon refuses it.
        let defined = match uuid.map(|u| Definitions::new(&dirs.state).get(&u)) {
            None | Some(Err(LifecycleError::NotDefined(_))) => false,
            Some(Ok(_)) => true,
            Some(Err(e)) => return Err(e.to_string()),
        };
        if !defined {
            let ty =
                registry.find(t).map_err(|_| format!("unknown device type {t:?} (see `umdev types`)"))?;
            ty.check(&options).map_err(|e| e.to_string())?;
        }
    }
    // A new instance's UUID is chosen here, not by the daemon: a start that outlives the
    // wait for its answer can still be named. (An --override start needs a definition's.)
    let generated = uuid.is_none() && mdev_type.is_some() && !args.override_definition;
    let uuid = if generated { Some(Uuid::new_v4()) } else { uuid };
    let pending = match uuid {
        Some(uuid) => format!("the device {uuid} may still start"),
        None => "the device may still start".into(),
    };
    let result = ask_to_change(
        dirs,
        ControlRequest::Start {
            mdev_type,
            uuid,
            options,
            override_definition: args.override_definition,
            generated,
        },
        &pending,
    )?;
    let started: InstanceSummary = serde_json::from_value(result).map_err(|e| e.to_string())?;
    out!("{} {}", started.uuid, started.socket.display())?;
    if started.overrides != InstanceOptions::default() {
        out!("  over its definition: {}", describe_options(&started.overrides))?;
    }
    for line in host_endpoints(&started.device) {
        out!("  {line}")?;
    }
    Ok(())
}

/// Options as `--pin-mode` and `--opt` would give them: `pin_mode=lock ns1=ram:1G`.
pub fn describe_options(o: &InstanceOptions) -> String {
    let mut parts: Vec<String> =
        o.pin_mode.iter().map(|m| format!("pin_mode={}", pin_mode_name(*m))).collect();
    parts.extend(o.params.iter().map(|(k, v)| format!("{k}={v}")));
    if parts.is_empty() {
        "(no options)".into()
    } else {
        parts.join(" ")
    }
}

fn pin_mode_name(m: PinModeName) -> &'static str {
    match m {
        PinModeName::Track => "track",
        PinModeName::Lock => "lock",
        PinModeName::Kernel => "kernel",
    }
}

/// `umdev stop`.
pub fn stop(dirs: &Dirs, uuid: &str, force: bool) -> Out {
    let uuid = parse_uuid(uuid)?;
    ask_to_change(dirs, ControlRequest::Stop { uuid, force }, &format!("{uuid} may still stop")).map(drop)
}

/// `umdev stats`.
pub fn stats(dirs: &Dirs, uuid: &str) -> Out {
    let result = ask(dirs, ControlRequest::Stats { uuid: parse_uuid(uuid)? })?;
    out!("{}", serde_json::to_string_pretty(&result).map_err(|e| e.to_string())?)
}

/// What `umdev list` shows.
pub struct ListView {
    /// The definitions instead of the instances.
    pub defined: bool,
    /// Lines of detail under each device's (`-v`): its options, its host endpoints.
    pub verbose: bool,
    /// umdev's JSON.
    pub json: bool,
    /// mdevctl's JSON: a listing, or one device's config when `-u` names one.
    pub dumpjson: bool,
    /// Only this UUID.
    pub uuid: Option<String>,
    /// Only this type.
    pub mdev_type: Option<String>,
}

/// `umdev list [--defined]`. With `--defined`, how each definition stands against the running
/// daemon: running, stopped, or out of sync (auto but not running, changed since it started,
/// running but no longer defined, invalid).
pub fn list(dirs: &Dirs, view: &ListView) -> Out {
    let uuid = view.uuid.as_deref().map(parse_uuid).transpose()?;
    let registry = umdev::builtin_registry();
    if let Some(t) = view.mdev_type.as_deref() {
        registry.find(t).map_err(|e| e.to_string())?;
    }
    let wanted = |u: &Uuid, t: Option<&str>| {
        uuid.is_none_or(|w| w == *u) && view.mdev_type.as_deref().is_none_or(|w| Some(w) == t)
    };
    if view.defined {
        // Definitions need no daemon; without one their state is unknown. With one, they must
        // be its own (checked before any is read).
        let daemon: Option<DaemonStatus> = ask_if_running(dirs, &ControlRequest::Status)?;
        if let Some(status) = &daemon {
            dirs.check_daemon_definitions(status)?;
        }
        let entries =
            DefinitionEntry::all(&Definitions::new(&dirs.state), &registry).map_err(|e| e.to_string())?;
        let rows: Vec<_> = sync_status(&entries, daemon.as_ref())
            .into_iter()
            .filter(|r| wanted(&r.uuid, r.mdev_type.as_deref()))
            .collect();
        if view.dumpjson {
            let configs: Vec<(Uuid, DeviceConfig)> = rows
                .iter()
                .filter_map(|r| Some((r.uuid, DeviceConfig::of(r.mdev_type.as_ref()?, r.start?, &r.options))))
                .collect();
            return dump(&configs, uuid, true);
        }
        if view.json {
            return out!("{}", serde_json::to_string_pretty(&rows).map_err(|e| e.to_string())?);
        }
        for r in rows {
            let start = match r.start {
                Some(StartPolicy::Auto) => "auto",
                Some(StartPolicy::Manual) => "manual",
                None => "-",
            };
            let why = match (r.state.why(), &r.error) {
                (Some(w), Some(e)) => format!("  (out of sync: {w}: {e})"),
                (Some(w), None) => format!("  (out of sync: {w})"),
                (None, Some(e)) => format!("  (last start failed: {e})"),
                (None, None) => String::new(),
            };
            let overrides = if r.overrides == InstanceOptions::default() {
                String::new()
            } else {
                format!("  (started with {} over its definition)", describe_options(&r.overrides))
            };
            let mdev_type = r.mdev_type.as_deref().unwrap_or("-");
            out!("{} {mdev_type} {start} {}{why}{overrides}", r.uuid, r.state.name())?;
            if view.verbose && r.mdev_type.is_some() {
                out!("  options: {}", describe_options(&r.options))?;
            }
        }
        return Ok(());
    }
    let list: Vec<InstanceSummary> = if view.dumpjson {
        // Its start policies come from the definitions: they must be the daemon's.
        let status: DaemonStatus =
            serde_json::from_value(ask(dirs, ControlRequest::Status)?).map_err(|e| e.to_string())?;
        dirs.check_daemon_definitions(&status)?;
        status.instances
    } else {
        serde_json::from_value(ask(dirs, ControlRequest::List)?).map_err(|e| e.to_string())?
    };
    let list: Vec<InstanceSummary> =
        list.into_iter().filter(|i| wanted(&i.uuid, Some(i.mdev_type.as_str()))).collect();
    if view.dumpjson {
        // An instance of a definition starts as it does (a config re-defined from this keeps
        // its `auto`); any other was started by hand.
        // A directory that may hold others' files fails the listing (its definitions cannot be
        // told from planted ones); one file that cannot be used only costs its instance its
        // policy: mdevctl's users (libvirt) list every device this way, and one bad file must
        // not hide the others.
        let definitions = Definitions::new(&dirs.state);
        if dirs.state.exists() {
            check_private_dir(&dirs.state).map_err(|e| e.to_string())?;
        }
        let start = |i: &InstanceSummary| match i.from_definition {
            true => match definitions.get(&i.uuid) {
                Ok(d) => d.start,
                Err(LifecycleError::NotDefined(_)) => StartPolicy::Manual,
                Err(e) => {
                    log::warn!(target: STATUS, "{}: its start policy is shown as manual: {e}", i.uuid);
                    StartPolicy::Manual
                }
            },
            false => StartPolicy::Manual,
        };
        let configs: Vec<(Uuid, DeviceConfig)> =
            list.iter().map(|i| (i.uuid, DeviceConfig::of(&i.mdev_type, start(i), &i.options))).collect();
        return dump(&configs, uuid, false);
    }
    if view.json {
        return out!("{}", serde_json::to_string_pretty(&list).map_err(|e| e.to_string())?);
    }
    // One line per device, as mdevctl's `list`, which scripts read a line at a time; the
    // details (a port's pty can be several) only on the indented lines of --verbose.
    for i in list {
        let connected = if i.connected { " (connected)" } else { "" };
        out!("{} {} {}{connected}", i.uuid, i.mdev_type, i.socket.display())?;
        if view.verbose {
            out!("  options: {}", describe_options(&i.options))?;
            for line in host_endpoints(&i.device) {
                out!("  {line}")?;
            }
        }
    }
    Ok(())
}

/// `--dumpjson`: one device's config when a UUID was asked for (as mdevctl, whose output then
/// is a config file), else the listing.
fn dump(configs: &[(Uuid, DeviceConfig)], one: Option<Uuid>, defined: bool) -> Out {
    let value = match (configs, one) {
        ([(_, config)], Some(_)) => serde_json::to_value(config).map_err(|e| e.to_string())?,
        ([], Some(uuid)) if defined => return Err(LifecycleError::NotDefined(uuid).to_string()),
        ([], Some(uuid)) => return Err(LifecycleError::UnknownUuid(uuid).to_string()),
        _ => mdevctl::listing(configs),
    };
    out!("{}", serde_json::to_string_pretty(&value).map_err(|e| e.to_string())?)
}

/// What `umdev define` defines.
pub struct DefineArgs {
    /// `-t`.
    pub mdev_type: Option<String>,
    /// `-u`.
    pub uuid: Option<String>,
    /// `--auto`.
    pub auto: bool,
    /// `--opt` and `--pin-mode`.
    pub options: InstanceOptions,
    /// `--jsonfile`.
    pub jsonfile: Option<PathBuf>,
}

/// `umdev define`: checked as starting it would be, so a bad definition is refused now with
/// the message `start` would give. Without a type, `-u` names a running instance, defined
/// with its type and options (as mdevctl defines a running mdev).
pub fn define(dirs: &Dirs, args: DefineArgs) -> Out {
    let from_running = args.mdev_type.is_none() && args.jsonfile.is_none();
    let options_given = args.options != InstanceOptions::default();
    let uuid = match &args.uuid {
        Some(u) => parse_uuid(u)?,
        None => Uuid::new_v4(),
    };
    let def = match &args.jsonfile {
        Some(path) => {
            let config = read_jsonfile(path)?;
            Definition { uuid, options: config.options()?, mdev_type: config.mdev_type, start: config.start }
        }
        None => {
            let start = if args.auto { StartPolicy::Auto } else { StartPolicy::Manual };
            match args.mdev_type {
                Some(mdev_type) => Definition { uuid, mdev_type, start, options: args.options },
                None => {
                    if args.uuid.is_none() {
                        return Err("give a type (-t TYPE), --jsonfile, or the UUID of a running instance \
                                    (-u UUID) to define it as it runs"
                            .into());
                    }
                    // A UUID already defined would be refused once asked for: say so now,
                    // not that nothing runs under it (and that -t is wanted, which define
                    // would refuse all the same).
                    Definitions::new(&dirs.state).check_undefined(&uuid).map_err(|e| e.to_string())?;
                    let running = running_instance(dirs, uuid)?;
                    // As mdevctl defines a running mdev: its type and what it runs with; options
                    // given here go over them.
                    let options = overlay(&running.options, &args.options);
                    Definition { uuid, mdev_type: running.mdev_type, start, options }
                }
            }
        }
    };
    check(&def)?;
    Definitions::new(&dirs.state).define(&def).map_err(|e| e.to_string())?;
    if from_running {
        // "As it runs" only where nothing was put over it: else the definition differs from
        // what runs, and `list --defined` says so until it is restarted.
        let how = if !options_given {
            "as it runs"
        } else {
            "from how it runs, with the options given over it (restart it to run so)"
        };
        log::info!(target: STATUS, "defined {uuid} {how}: {} {}", def.mdev_type, describe_options(&def.options));
    }
    out!("{uuid}")
}

/// The running instance `uuid`, for `define -u UUID` without a type; an error that says to
/// give one when no daemon runs it.
fn running_instance(dirs: &Dirs, uuid: Uuid) -> Result<InstanceSummary, String> {
    let no_type = "no type given (-t TYPE)";
    let running: Vec<InstanceSummary> = match request(&dirs.control(), &ControlRequest::List) {
        Ok(answer) => serde_json::from_value(result_of(answer)?).map_err(|e| e.to_string())?,
        Err(e) => {
            return Err(format!(
                "{no_type}, and {uuid} cannot be defined from a running instance: {e}; give its type with -t"
            ))
        }
    };
    running.into_iter().find(|i| i.uuid == uuid).ok_or_else(|| {
        format!(
            "{no_type}, and no instance with UUID {uuid} runs on {} to define it from: give its type with -t \
             (`umdev list` shows the running instances)",
            dirs.run.display()
        )
    })
}

fn check(def: &Definition) -> Out {
    match check_definition(&umdev::builtin_registry(), def) {
        Err(LifecycleError::UnknownType(t)) => Err(format!("unknown device type {t:?} (see `umdev types`)")),
        other => other.map_err(|e| e.to_string()),
    }
}

/// What `umdev modify` changes.
pub struct ModifyArgs {
    /// `-u`.
    pub uuid: String,
    /// `-t`.
    pub mdev_type: Option<String>,
    /// `--auto` (`Some(Auto)`) or `--manual`.
    pub start: Option<StartPolicy>,
    /// `--opt`: set (or replace) these.
    pub set: InstanceOptions,
    /// `--delopt`: remove these keys.
    pub remove: Vec<String>,
    /// `--jsonfile`: the whole config instead.
    pub jsonfile: Option<PathBuf>,
}

/// `umdev modify`: changes a definition, checked as `define` checks one. A running instance
/// keeps what it started with until it is stopped and started (as with mdevctl).
pub fn modify(dirs: &Dirs, args: ModifyArgs) -> Out {
    let uuid = parse_uuid(&args.uuid)?;
    conflicting_changes(&args)?;
    let config = args.jsonfile.as_deref().map(read_jsonfile).transpose()?;
    // Whether what an instance runs as changed (its type or options; not its start policy,
    // which only the daemon's next start reads).
    let instance_changed = std::cell::Cell::new(false);
    // Why a definition made --auto here cannot start as it stands, to warn of once written.
    let cannot_start = std::cell::RefCell::new(None);
    // Read, changed and written under the definitions' lock: two modifies take turns.
    let change = |mut def: Definition| -> Result<Definition, String> {
        let before = (def.mdev_type.clone(), def.options.clone());
        if let Some(config) = config {
            def = Definition {
                uuid,
                options: config.options()?,
                mdev_type: config.mdev_type,
                start: config.start,
            };
        }
        if let Some(t) = args.mdev_type {
            def.mdev_type = t;
        }
        if let Some(start) = args.start {
            def.start = start;
        }
        if args.set.pin_mode.is_some() {
            def.options.pin_mode = args.set.pin_mode;
        }
        for key in &args.remove {
            let had = if key == "pin_mode" {
                def.options.pin_mode.take().is_some()
            } else {
                def.options.params.remove(key).is_some()
            };
            if !had {
                return Err(format!("{uuid} has no option {key:?} to remove"));
            }
        }
        def.options.params.extend(args.set.params);
        let changed = before != (def.mdev_type.clone(), def.options.clone());
        // Only the start policy changed: the type and options were checked when they were
        // set, and a backing file gone since must not keep a definition from being switched
        // to --manual (a broken --auto one, say).
        if changed {
            check(&def)?;
        } else if args.start == Some(StartPolicy::Auto) {
            // Made --auto as it is: the daemon will try it, and fail, at its next start.
            *cannot_start.borrow_mut() = check(&def).err();
        }
        instance_changed.set(changed);
        Ok(def)
    };
    Definitions::new(&dirs.state)
        .update(&uuid, |def| change(def).map_err(LifecycleError::Failed))
        .map_err(|e| e.to_string())?;
    if let Some(why) = cannot_start.take() {
        log::warn!(
            target: STATUS,
            "{uuid} is --auto now, but it cannot start as defined: {why}; the daemon will fail to start it \
             (`umdev list --defined` shows it invalid) until its options are fixed with `umdev modify`"
        );
    }
    if !instance_changed.get() {
        return Ok(());
    }
    // The change is made; whether it waits for a restart is only told, so a daemon that
    // cannot be asked (or a bad UMDEV_CONTROL_TIMEOUT_MS) is a warning, not a failure.
    let running: Option<Vec<InstanceSummary>> =
        ask_if_running(dirs, &ControlRequest::List).unwrap_or_else(|e| {
            log::warn!(target: STATUS, "the change is made, but whether {uuid} runs could not be asked: {e}");
            None
        });
    if running.is_some_and(|r| r.iter().any(|i| i.uuid == uuid)) {
        log::info!(target: STATUS, "{uuid} runs as it started; stop and start it to apply the change");
    }
    Ok(())
}

/// A key removed twice, or both set and removed: which was meant?
fn conflicting_changes(args: &ModifyArgs) -> Result<(), String> {
    for (i, key) in args.remove.iter().enumerate() {
        if args.remove[..i].contains(key) {
            return Err(format!("--delopt {key} given twice"));
        }
        if let Some(value) = args.set.params.get(key) {
            return Err(format!("--opt {key}={value} and --delopt {key} conflict: give one"));
        }
        if key == "pin_mode" && args.set.pin_mode.is_some() {
            return Err("--pin-mode and --delopt pin_mode conflict: give one".into());
        }
    }
    Ok(())
}

/// `umdev undefine`.
pub fn undefine(dirs: &Dirs, uuid: &str) -> Out {
    Definitions::new(&dirs.state).undefine(&parse_uuid(uuid)?).map_err(|e| e.to_string())
}

/// One line per host endpoint a device describes (a serial port's pty or socket):
/// `port N: BACKEND PATH`.
pub fn host_endpoints(device: &serde_json::Value) -> Vec<String> {
    let Some(ports) = device["ports"].as_array() else { return Vec::new() };
    ports
        .iter()
        .filter_map(|p| {
            let path = p["path"].as_str()?;
            let backend = p["backend"].as_str().unwrap_or("?");
            let kind = backend.split(':').next().unwrap_or(backend);
            Some(format!("port {}: {kind} {path}", p["port"]))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The value of `key=` in the shipped unit.
    fn unit_setting(key: &str) -> String {
        let unit = include_str!("../contrib/systemd/umdev.service");
        let prefix = format!("{key}=");
        let values: Vec<&str> = unit.lines().filter_map(|l| l.trim().strip_prefix(prefix.as_str())).collect();
        assert_eq!(values.len(), 1, "umdev.service sets {key} once");
        values[0].to_string()
    }

    #[test]
    fn the_service_uses_the_directories_root_clients_look_in() {
        // Clients (`umdev list`, `define`, ... as root) find the service's sockets and write
        // the definitions it reads without being told where.
        assert_eq!(format!("/run/{}", unit_setting("RuntimeDirectory")), ROOT_RUN_DIR);
        assert_eq!(format!("/etc/{}", unit_setting("ConfigurationDirectory")), ROOT_STATE_DIR);
        assert_eq!(unit_setting("Type"), "notify");
        assert_eq!(unit_setting("ExecReload"), "/bin/kill -HUP $MAINPID");
        assert_eq!(unit_setting("Restart"), "on-failure");
        assert_eq!(unit_setting("LimitMEMLOCK"), "infinity");
    }
}
