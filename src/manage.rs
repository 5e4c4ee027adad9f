//! The mdevctl-style lifecycle commands: `umdev daemon`, `start`, `stop`, `list`, `define`,
//! `undefine`, `stats`, and a daemon-aware `types`.

use std::path::PathBuf;
use std::sync::Arc;

use signal_hook::consts::{SIGINT, SIGTERM};
use signal_hook::iterator::Signals;
use umdev_mdev::types::InstanceOptions;
use umdev_server::control::{request, ControlError, ControlRequest, ControlResponse, ControlServer};
use umdev_server::lifecycle::{Definition, Definitions, InstanceSummary, Manager, StartPolicy, TypeSummary};
use umdev_server::InstanceConfig;
use uuid::Uuid;

/// Where the daemon keeps its sockets and definitions.
#[derive(Clone, Debug)]
pub struct Dirs {
    /// Control socket and instance sockets.
    pub run: PathBuf,
    /// Persistent definitions.
    pub state: PathBuf,
}

impl Dirs {
    /// Explicit directories, else `$UMDEV_RUN_DIR`/`$UMDEV_STATE_DIR`, else for root
    /// `/run/umdev` and `/etc/umdev.d`, for others `$XDG_RUNTIME_DIR/umdev` and
    /// `$XDG_CONFIG_HOME/umdev` (or `/tmp/umdev-$UID`, `~/.config/umdev`).
    pub fn resolve(run: Option<PathBuf>, state: Option<PathBuf>) -> Dirs {
        let env = |k: &str| std::env::var_os(k).filter(|v| !v.is_empty()).map(PathBuf::from);
        let root = nix::unistd::geteuid().is_root();
        let run = run.or_else(|| env("UMDEV_RUN_DIR")).unwrap_or_else(|| {
            if root {
                PathBuf::from("/run/umdev")
            } else {
                env("XDG_RUNTIME_DIR")
                    .map(|d| d.join("umdev"))
                    .unwrap_or_else(|| PathBuf::from(format!("/tmp/umdev-{}", nix::unistd::geteuid())))
            }
        });
        let state = state.or_else(|| env("UMDEV_STATE_DIR")).unwrap_or_else(|| {
            if root {
                PathBuf::from("/etc/umdev.d")
            } else {
                env("XDG_CONFIG_HOME")
                    .or_else(|| env("HOME").map(|h| h.join(".config")))
                    .map(|d| d.join("umdev"))
                    .unwrap_or_else(|| PathBuf::from("/tmp/umdev-state"))
            }
        });
        Dirs { run, state }
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

/// `umdev daemon`: serves the control socket and instances until SIGINT/SIGTERM. `template`
/// carries the limits every instance gets.
pub fn daemon(dirs: &Dirs, template: InstanceConfig, max_instances: usize) -> Result<(), String> {
    std::fs::create_dir_all(&dirs.run).map_err(|e| format!("creating {}: {e}", dirs.run.display()))?;
    let mut signals =
        Signals::new([SIGINT, SIGTERM]).map_err(|e| format!("installing signal handlers: {e}"))?;
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
    for (uuid, e) in manager.autostart() {
        eprintln!("umdev: could not start defined device {uuid}: {e}");
    }
    eprintln!(
        "umdev: daemon running (control {}, definitions {}); {} instance(s) started",
        dirs.control().display(),
        dirs.state.display(),
        manager.list().len()
    );
    if let Some(signal) = signals.forever().next() {
        eprintln!("umdev: signal {signal}, shutting down");
    }
    drop(control);
    manager.shutdown();
    Ok(())
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

/// `umdev list [--defined]`.
pub fn list(dirs: &Dirs, defined: bool, json: bool) -> Result<(), String> {
    if defined {
        let defs = Definitions::new(&dirs.state).list();
        if json {
            println!("{}", serde_json::to_string_pretty(&defs).map_err(|e| e.to_string())?);
        } else {
            for d in defs {
                let start = match d.start {
                    StartPolicy::Auto => "auto",
                    StartPolicy::Manual => "manual",
                };
                println!("{} {} {start}", d.uuid, d.mdev_type);
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
