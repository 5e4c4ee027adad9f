//! `umdev run`: serve one instance in the foreground, the command a QEMU user runs beside
//! QEMU's `-device '{"driver":"vfio-user-pci","socket":{"type":"unix","path":...}}'`.

use signal_hook::consts::{SIGHUP, SIGINT, SIGTERM};
use signal_hook::iterator::Signals;
use umdev_mdev::types::{InstanceOptions, Registry};
use umdev_server::{Daemon, InstanceConfig};

use crate::logging::STATUS;

/// Serves one instance of `type_name` with `config` until SIGINT, SIGTERM or SIGHUP (its
/// terminal closed: the server stops as cleanly, its socket removed).
pub fn run(
    registry: &Registry,
    type_name: &str,
    options: &InstanceOptions,
    config: InstanceConfig,
) -> Result<(), String> {
    let ty = registry.find(type_name).map_err(|e| e.to_string())?;
    let device = ty.create(options).map_err(|e| e.to_string())?;
    let mut signals =
        Signals::new([SIGINT, SIGTERM, SIGHUP]).map_err(|e| format!("installing signal handlers: {e}"))?;
    let daemon = Daemon::new();
    // QEMU may run from another directory: it is told the absolute path.
    let socket = std::path::absolute(&config.socket).unwrap_or_else(|_| config.socket.clone());
    let endpoints = crate::manage::host_endpoints(&device.describe());
    daemon.start(device.clone(), config).map_err(|e| e.to_string())?;
    // Every line through the status log: under the journal each carries its priority.
    let mut started = format!(
        "serving a {type_name} device on {} (Ctrl-C to stop)\n  qemu-system-x86_64 ... -device '{{\"driver\":\"vfio-user-pci\",\"socket\":{{\"type\":\"unix\",\"path\":\"{}\"}}}}'",
        socket.display(),
        socket.display()
    );
    for line in endpoints {
        started.push_str(&format!("\n  {line}"));
    }
    log::info!(target: STATUS, "{started}");
    if let Some(signal) = signals.forever().next() {
        log::info!(target: STATUS, "signal {signal}, shutting down");
    }
    daemon.shutdown();
    // What the device did, for the log (`umdev stats` shows the same while it runs).
    let state = device.describe();
    if !state.is_null() {
        log::info!(target: STATUS, "{type_name} on exit: {state}");
    }
    Ok(())
}
