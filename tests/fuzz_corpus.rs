//! Replays the committed fuzz corpus (`fuzz/corpus/<target>/*`) through the harnesses the
//! cargo-fuzz targets call, without libFuzzer, and the harnesses' hand-made seeds: an input
//! the fuzzer once found interesting (or a crash it found, once fixed) that fails again fails
//! here. How to fuzz: `docs/reliability.md`, "Fuzzing".
//!
//! `cargo test --release --test fuzz_corpus -- --ignored write_seeds` writes the hand-made
//! seeds into the corpus as `seed-<name>` files (before fuzzing a fresh corpus).
//!
//! The tests run one at a time ([`SERIAL`]): the `session` harness counts the process's open
//! fds, which a concurrent test creating memfds or eventfds would disturb.

use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::Instant;

type Harness = fn(&[u8]);
type Seeds = fn() -> Vec<(&'static str, Vec<u8>)>;

/// The fuzz targets: name (as in `fuzz/Cargo.toml`), harness, seeds.
const TARGETS: [(&str, Harness, Seeds); 6] = [
    ("dispatch", umdev_testkit::server_fuzz::dispatch, umdev_testkit::server_fuzz::seeds),
    ("session", umdev_testkit::server_fuzz::session::run, umdev_testkit::server_fuzz::session::seeds),
    ("pinning", umdev_pinning::fuzzing::ops, umdev_pinning::fuzzing::seeds),
    ("ccw", umdev_testkit::ccw_fuzz::ccw, umdev_testkit::ccw_fuzz::seeds),
    ("nvme", umdev_testkit::nvme_fuzz::run, umdev_testkit::nvme_fuzz::seeds),
    ("mtty", umdev_testkit::mtty_fuzz::run, umdev_testkit::mtty_fuzz::seeds),
];

fn corpus_dir(target: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz/corpus").join(target)
}

/// Held by every test in this binary while it runs a harness.
static SERIAL: Mutex<()> = Mutex::new(());

/// Runs every corpus file and every seed of `target`.
fn replay(target: &str) {
    // A test that failed while holding the lock poisons it; the others still run.
    let _serial = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let &(_, run, seeds) = TARGETS.iter().find(|t| t.0 == target).expect("a known target");
    let dir = corpus_dir(target);
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| e.expect("a directory entry").path())
        .filter(|p| p.is_file() && !p.file_name().is_some_and(|n| n.to_string_lossy().starts_with('.')))
        .collect();
    files.sort();
    assert!(!files.is_empty(), "{}: no corpus", dir.display());
    let start = Instant::now();
    for file in &files {
        let data = std::fs::read(file).unwrap_or_else(|e| panic!("{}: {e}", file.display()));
        eprintln!("{target}: {}", file.display());
        run(&data);
    }
    let seeds = seeds();
    for (name, data) in &seeds {
        eprintln!("{target}: seed {name}");
        run(data);
    }
    eprintln!("{target}: {} corpus files and {} seeds in {:?}", files.len(), seeds.len(), start.elapsed());
}

#[test]
fn dispatch_corpus() {
    replay("dispatch");
}

#[test]
fn session_corpus() {
    replay("session");
}

#[test]
fn pinning_corpus() {
    replay("pinning");
}

#[test]
fn ccw_corpus() {
    replay("ccw");
}

#[test]
fn nvme_corpus() {
    replay("nvme");
}

#[test]
fn mtty_corpus() {
    replay("mtty");
}

/// Writes the harnesses' seeds into the corpus directories.
#[test]
#[ignore = "writes into fuzz/corpus; run by hand"]
fn write_seeds() {
    for (target, _, seeds) in TARGETS {
        let dir = corpus_dir(target);
        std::fs::create_dir_all(&dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
        for (name, data) in seeds() {
            let path = dir.join(format!("seed-{name}"));
            std::fs::write(&path, data).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        }
    }
}
