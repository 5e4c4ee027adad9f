//! The mdevctl-style lifecycle commands: `umdev daemon` (also as a systemd service,
//! contrib/systemd/umdev.service), `start`, `stop`, `list`, `define`,
//! `undefine`, `stats`, and a daemon-aware `types`.

use std::path::PathBuf;
use std::sync::Arc;

use sd_notify::NotifyState;
use signal_hook::consts::{SIGHUP, SIGINT, SIGTERM};
use signal_hook::iterator::Signals;
use umdev::control::{request, ControlError, ControlRequest, ControlResponse, ControlServer};
use umdev::lifecycle::{
    sync_status, Definition, Definitions, InstanceSummary, Manager, ReloadReport, StartPolicy, TypeSummary,
};
use umdev_mdev::types::InstanceOptions;
use umdev_server::InstanceConfig;
use uuid::Uuid;

use crate::logging::STATUS;

/// Where the daemon keeps its sockets and definitions.
#[derive(Clone, Debug)]
pub struct Dirs {
    /// Control socket and instance sockets.
    pub run: PathBuf,
    /// Persistent definitions.
    pub state: PathBuf,
}

/// Root's run directory: the service's `RuntimeDirectory=umdev`.
const ROOT_RUN_DIR: &str = "/run/umdev";
/// Root's definitions: the service's `ConfigurationDirectory=umdev.d` (as mdevctl's /etc/mdevctl.d).
const ROOT_STATE_DIR: &str = "/etc/umdev.d";

impl Dirs {
    /// Explicit directories, else `$UMDEV_RUN_DIR`/`$UMDEV_STATE_DIR`, else for root
    /// `/run/umdev` and `/etc/umdev.d`, for others `$XDG_RUNTIME_DIR/umdev` and
    /// `$XDG_CONFIG_HOME/umdev` (or `/tmp/umdev-$UID`, `~/.config/umdev`).
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
        let state = state.or_else(|| env("UMDEV_STATE_DIR")).unwrap_or_else(|| {
            if root {
                PathBuf::from(ROOT_STATE_DIR)
            } else {
                env("XDG_CONFIG_HOME")
                    .or_else(|| env("HOME").map(|h| h.join(".config")))
                    .map(|d| d.join("umdev"))
                    .unwrap_or_else(|| PathBuf::from("/tmp/umdev-state"))
            }
        });
        Dirs { run, state }
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
}

fn ask(dirs: &Dirs, req: ControlRequest) -> Result<serde_json::Value, String> {
    let answer: ControlResponse = request(&dirs.control(), &req).map_err(|e| e.to_string())?;
    if answer.ok {
        Ok(answer.result.unwrap_or(serde_json::Value::Null))
    } else {
        Err(answer.error.unwrap_or_else(|| "the daemon refused the request".into()))
    }
}

fn parse_uuid(s: &str) -> Result<Uuid, String> {
    Uuid::parse_str(s).map_err(|_| format!("{s:?} is not a UUID"))
}

/// `umdev daemon`: serves the control socket and instances until SIGINT/SIGTERM; SIGHUP
/// re-reads the definitions. `template` carries the limits every instance gets.
///
/// Under systemd (`Type=notify`, $NOTIFY_SOCKET) it reports READY=1 once the control socket
/// listens and every `auto` definition has been started, RELOADING=1/READY=1 around a SIGHUP,
/// and STOPPING=1 before it stops its instances.
pub fn daemon(dirs: &Dirs, template: InstanceConfig, max_instances: usize) -> Result<(), String> {
    std::fs::create_dir_all(&dirs.run).map_err(|e| format!("creating {}: {e}", dirs.run.display()))?;
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
    let control = ControlServer::start(manager.clone(), &dirs.control()).map_err(|e| e.to_string())?;
    report(&manager.reload());
    log::info!(
        target: STATUS,
        "daemon running (control {}, definitions {}); {} instance(s) started",
        dirs.control().display(),
        dirs.state.display(),
        manager.list().len()
    );
    notify(&[NotifyState::Ready, NotifyState::Status(&serving(&manager))]);
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
        notify(&[NotifyState::Ready, NotifyState::Status(&serving(&manager))]);
    }
    notify(&[NotifyState::Stopping, NotifyState::Status("stopping every instance")]);
    drop(control);
    manager.shutdown();
    Ok(())
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

/// `umdev types`: the running daemon's view (live capacity), else the built-in registry.
pub fn types(dirs: &Dirs, json: bool) -> Result<(), String> {
    let types: Vec<TypeSummary> = match request(&dirs.control(), &ControlRequest::Types) {
        Ok(answer) if answer.ok => {
            serde_json::from_value(answer.result.unwrap_or_default()).map_err(|e| e.to_string())?
        }
        Ok(answer) => return Err(answer.error.unwrap_or_default()),
        Err(ControlError::NotRunning(_)) => {
            let registry = umdev::builtin_registry();
            let manager = Manager::new(
                registry,
                "/nonexistent",
                Definitions::new("/nonexistent"),
                InstanceConfig::new("", ""),
            );
            manager.types()
        }
        Err(e) => return Err(e.to_string()),
    };
    if json {
        println!("{}", serde_json::to_string_pretty(&types).map_err(|e| e.to_string())?);
    } else {
        for t in types {
            println!(
                "{}\n  Available instances: {}\n  Device API: {}\n  Description: {}",
                t.name, t.available_instances, t.device_api, t.description
            );
        }
    }
    Ok(())
}

/// `umdev start`.
pub fn start(
    dirs: &Dirs,
    mdev_type: Option<String>,
    uuid: Option<&str>,
    options: InstanceOptions,
) -> Result<(), String> {
    let uuid = uuid.map(parse_uuid).transpose()?;
    let result = ask(dirs, ControlRequest::Start { mdev_type, uuid, options })?;
    let started: InstanceSummary = serde_json::from_value(result).map_err(|e| e.to_string())?;
    println!("{} {}", started.uuid, started.socket.display());
    for line in host_endpoints(&started.device) {
        println!("  {line}");
    }
    Ok(())
}

/// `umdev stop`.
pub fn stop(dirs: &Dirs, uuid: &str, force: bool) -> Result<(), String> {
    ask(dirs, ControlRequest::Stop { uuid: parse_uuid(uuid)?, force }).map(drop)
}

/// `umdev stats`.
pub fn stats(dirs: &Dirs, uuid: &str) -> Result<(), String> {
    let result = ask(dirs, ControlRequest::Stats { uuid: parse_uuid(uuid)? })?;
    println!("{}", serde_json::to_string_pretty(&result).map_err(|e| e.to_string())?);
    Ok(())
}

/// `umdev list [--defined]`. With `--defined`, how each definition stands against the running
/// daemon: running, stopped, or out of sync (auto but not running, changed since it started,
/// running but no longer defined).
pub fn list(dirs: &Dirs, defined: bool, json: bool) -> Result<(), String> {
    if defined {
        let defs = Definitions::new(&dirs.state).list();
        // Definitions need no daemon; without one their state is unknown.
        let running: Option<Vec<InstanceSummary>> = match request(&dirs.control(), &ControlRequest::List) {
            Ok(answer) if answer.ok => {
                Some(serde_json::from_value(answer.result.unwrap_or_default()).map_err(|e| e.to_string())?)
            }
            Ok(answer) => {
                return Err(answer.error.unwrap_or_else(|| "the daemon refused the request".into()))
            }
            Err(ControlError::NotRunning(_)) => None,
            Err(e) => return Err(e.to_string()),
        };
        let rows = sync_status(&defs, running.as_deref());
        if json {
            println!("{}", serde_json::to_string_pretty(&rows).map_err(|e| e.to_string())?);
        } else {
            for r in rows {
                let start = match r.start {
                    Some(StartPolicy::Auto) => "auto",
                    Some(StartPolicy::Manual) => "manual",
                    None => "-",
                };
                let why = r.state.why().map(|w| format!("  (out of sync: {w})")).unwrap_or_default();
                println!("{} {} {start} {}{why}", r.uuid, r.mdev_type, r.state.name());
            }
        }
        return Ok(());
    }
    let result = ask(dirs, ControlRequest::List)?;
    let list: Vec<InstanceSummary> = serde_json::from_value(result).map_err(|e| e.to_string())?;
    if json {
        println!("{}", serde_json::to_string_pretty(&list).map_err(|e| e.to_string())?);
    } else {
        for i in list {
            let connected = if i.connected { " (connected)" } else { "" };
            println!("{} {} {}{connected}", i.uuid, i.mdev_type, i.socket.display());
            for line in host_endpoints(&i.device) {
                println!("  {line}");
            }
        }
    }
    Ok(())
}

/// `umdev define`.
pub fn define(
    dirs: &Dirs,
    mdev_type: &str,
    uuid: Option<&str>,
    auto: bool,
    options: InstanceOptions,
) -> Result<(), String> {
    if umdev::builtin_registry().find(mdev_type).is_err() {
        return Err(format!("unknown device type {mdev_type:?} (see `umdev types`)"));
    }
    let uuid = match uuid {
        Some(u) => parse_uuid(u)?,
        None => Uuid::new_v4(),
    };
    let start = if auto { StartPolicy::Auto } else { StartPolicy::Manual };
    let def = Definition { uuid, mdev_type: mdev_type.to_string(), start, options };
    Definitions::new(&dirs.state).define(&def).map_err(|e| e.to_string())?;
    println!("{uuid}");
    Ok(())
}

/// `umdev undefine`.
pub fn undefine(dirs: &Dirs, uuid: &str) -> Result<(), String> {
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
