//! The docs as a contract, from the outside: clients written from the documentation alone
//! (Python's standard library, none of umdev's code read) drive `umdev run` (and the daemon)
//! and check what the docs state, each check citing its doc section. A doc sentence that the
//! server stops honouring, or a behaviour a change gives the server that contradicts the doc,
//! fails here. Nothing in them depends on machine speed (each script's docstring says how).
//!
//! - `tests/outside/testdev_contract.py`: docs/vfio-user.md and docs/testdev.md, about 620
//!   checks of the server, the daemon and testdev.
//! - `tests/outside/nvme_contract.py`: docs/nvme.md, an NVMe driver over vfio-user, about 870
//!   checks.
//! - `tests/outside/mtty_contract.py`: docs/mtty.md, a 16550A driver and host-side peers
//!   (sockets, ptys), about 890 checks.
//! - `tests/outside/ccw_contract.py`: docs/ccw.md, a channel-program driver (CCW chains,
//!   scattered IDAW lists, halts, unmaps and truncation in every pin mode), about 580 checks.
//!
//! Skipped, saying so, where `python3` is not installed.

use std::path::Path;
use std::process::Command;

fn passes(script: &str) {
    if Command::new("python3").arg("--version").output().is_err() {
        return eprintln!("skipped: no python3");
    }
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/outside").join(script);
    let dir = tempfile::tempdir().expect("a temporary directory");
    let out = Command::new("python3")
        .arg(&script)
        .args(["--bin", env!("CARGO_BIN_EXE_umdev"), "-q", "--socket-dir"])
        .arg(dir.path())
        .output()
        .expect("python3 runs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "the docs-only client failed ({}):\n{stdout}\n{stderr}", out.status);
    assert!(stdout.contains("FAIL 0"), "no summary:\n{stdout}\n{stderr}");
}

#[test]
fn a_client_written_from_the_docs_alone_passes_every_check() {
    passes("testdev_contract.py");
}

#[test]
fn an_nvme_driver_written_from_the_docs_alone_passes_every_check() {
    passes("nvme_contract.py");
}

#[test]
fn an_mtty_driver_written_from_the_docs_alone_passes_every_check() {
    passes("mtty_contract.py");
}

#[test]
fn a_ccw_driver_written_from_the_docs_alone_passes_every_check() {
    passes("ccw_contract.py");
}
