//! `umdev run`: serve one instance in the foreground, the command a QEMU user runs beside
//! QEMU's `-device '{"driver":"vfio-user-pci","socket":{"type":"unix","path":...}}'`.

use signal_hook::consts::{SIGHUP, SIGINT, SIGTERM};
use signal_hook::iterator::Signals;
use umdev_mdev::types::{InstanceOptions, Registry, TypeError};
use umdev_server::{Daemon, InstanceConfig};

use crate::logging::STATUS;

/// Whether `signal` was ignored (SIG_IGN) when the process started: `nohup` ignores SIGHUP
/// so that a closed terminal stops nothing, and a handler installed over it would undo that.
pub fn ignored(signal: libc::c_int) -> bool {
    // SAFETY: an all-zero sigaction is a valid value of the C struct (no handler, empty
    // mask), and is only written to below.
    let mut old: libc::sigaction = unsafe { std::mem::zeroed() };
    // SAFETY: with a null new action sigaction(2) changes nothing; it only writes the current
    // disposition into `old`, which lives through the call.
    let rc = unsafe { libc::sigaction(signal, std::ptr::null(), &mut old) };
    rc == 0 && old.sa_sigaction == libc::SIG_IGN
}

/// The signals that stop a foreground command: SIGINT, SIGTERM, and SIGHUP (its terminal
/// closed) unless it was ignored, as under `nohup`.
pub fn stop_signals() -> Vec<libc::c_int> {
    let mut signals = vec![SIGINT, SIGTERM];
    if ignored(SIGHUP) {
        log::debug!("SIGHUP is ignored (nohup): a closed terminal does not stop this process");
    } else {
        signals.push(SIGHUP);
    }
    signals
}

/// Serves one instance of `type_name` with `config` until SIGINT, SIGTERM or SIGHUP (its
/// terminal closed: the server stops as cleanly, its socket removed); SIGHUP stays ignored
/// if it was (`nohup umdev run ... &`).
pub fn run(
    registry: &Registry,
    type_name: &str,
    options: &InstanceOptions,
    config: InstanceConfig,
) -> Result<(), String> {
    let ty = registry.find(type_name).map_err(|e| match e {
        TypeError::UnknownType(t) => format!("unknown device type {t:?} (see `umdev types`)"),
        e => e.to_string(),
    })?;
    let device = ty.create(options).map_err(|e| e.to_string())?;
    let mut signals = Signals::new(stop_signals()).map_err(|e| format!("installing signal handlers: {e}"))?;
    let daemon = Daemon::new();
    // QEMU may run from another directory: it is told the absolute path.
    let socket = std::path::absolute(&config.socket).unwrap_or_else(|_| config.socket.clone());
    let qemu_argument = shell_quote(&qemu_device(&socket)?);
    let described = device.describe();
    let endpoints = crate::manage::host_endpoints(&described);
    daemon.start(device.clone(), config).map_err(|e| e.to_string())?;
    // Every line through the status log: under the journal each carries its priority.
    let mut started = format!(
        "serving a {type_name} device on {} (Ctrl-C to stop)\n  qemu-system-x86_64 ... -device {}",
        socket.display(),
        qemu_argument
    );
    if let Some(trid) = spdk_address(type_name, &socket, &described) {
        started.push_str(&format!("\n  spdk_nvme_perf ... -r {}", shell_quote(&trid)));
    }
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

/// QEMU's `-device` JSON for a vfio-user-pci device on `socket`, its members in the order
/// the documents show (a struct keeps them; a JSON map would sort them), the path escaped as
/// JSON escapes it (a path with `"` or `\`). A path that is not UTF-8, which JSON cannot
/// hold, is shown with U+FFFD in place of what it cannot.
fn qemu_device(socket: &std::path::Path) -> Result<String, String> {
    #[derive(serde::Serialize)]
    struct Device<'a> {
        driver: &'static str,
        socket: Socket<'a>,
    }
    #[derive(serde::Serialize)]
    struct Socket<'a> {
        r#type: &'static str,
        path: &'a str,
    }
    let path = socket.to_string_lossy();
    let device = Device { driver: "vfio-user-pci", socket: Socket { r#type: "unix", path: &path } };
    serde_json::to_string(&device).map_err(|e| format!("writing QEMU's -device argument: {e}"))
}

/// `text` as one POSIX shell word: in single quotes, each `'` closed, escaped and reopened
/// (within single quotes nothing else is special).
fn shell_quote(text: &str) -> String {
    format!("'{}'", text.replace('\'', r"'\''"))
}

/// The transport ID by which SPDK's initiator reaches an nvme device on `socket`: its
/// directory, where SPDK looks for a socket named `cntrl` (so only for a socket of that
/// name), and the controller's own NQN, which umdev does not check.
fn spdk_address(type_name: &str, socket: &std::path::Path, describe: &serde_json::Value) -> Option<String> {
    if type_name != "nvme" || socket.file_name()? != "cntrl" {
        return None;
    }
    let dir = socket.parent()?.to_str()?;
    let serial = describe["serial"].as_str()?;
    Some(format!("trtype:VFIOUSER traddr:{dir} subnqn:nqn.2026-12.dev.umdev:nvme:{serial}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_qemu_argument_is_one_shell_word_of_json_for_any_path() {
        let path = std::path::Path::new(r#"/tmp/it's "a" \dir/dev.sock"#);
        let json = qemu_device(path).unwrap();
        assert_eq!(
            json,
            r#"{"driver":"vfio-user-pci","socket":{"type":"unix","path":"/tmp/it's \"a\" \\dir/dev.sock"}}"#
        );
        let parsed: serde_json::Value = serde_json::from_str(&json).unwrap();
        assert_eq!(parsed["socket"]["path"], path.to_str().unwrap());
        assert_eq!(shell_quote("plain"), "'plain'");
        assert_eq!(shell_quote("it's"), r"'it'\''s'");
    }
}
