//! docs/vfio-user.md and docs/testdev.md as a contract: `tests/outside/testdev_contract.py`,
//! a vfio-user client written from the documentation alone (Python's standard library, none
//! of umdev's code read), drives `umdev run --type testdev` (and the daemon) and checks
//! about 620 behaviours the docs state, each citing its doc section. A doc sentence that the
//! server stops honouring, or a behaviour a change gives the server that contradicts the
//! doc, fails here. Nothing in it depends on machine speed (its docstring says how).
//!
//! Skipped, saying so, where `python3` is not installed.

use std::path::Path;
use std::process::Command;

#[test]
fn a_client_written_from_the_docs_alone_passes_every_check() {
    if Command::new("python3").arg("--version").output().is_err() {
        return eprintln!("skipped: no python3");
    }
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/outside/testdev_contract.py");
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
