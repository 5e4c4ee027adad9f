//! What a service build links. `cargo install --path . --no-default-features` (README, "Running
//! as a service"; contrib/systemd) leaves out `demo` and the benchmarks, and with them every
//! crate that exists for tests: umdev-testkit, rust-vmm's vfio_user client, plotters, the
//! progress bars, and the framework's fuzzing and contract features.

use std::process::Command;

/// `cargo tree` of the `umdev` package's normal dependencies and their features.
fn tree(extra: &[&str]) -> String {
    let cargo = option_env!("CARGO").unwrap_or("cargo");
    let manifest = concat!(env!("CARGO_MANIFEST_DIR"), "/Cargo.toml");
    let out = Command::new(cargo)
        .args(["tree", "--offline", "-e", "normal,features", "--prefix", "none", "-p", "umdev"])
        .args(["--manifest-path", manifest])
        .args(extra)
        .output()
        .expect("running cargo tree");
    assert!(out.status.success(), "cargo tree failed: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout).unwrap()
}

const TEST_ONLY: [&str; 6] =
    ["umdev-testkit", "vfio_user", "plotters", "indicatif", "feature \"fuzzing\"", "feature \"contract\""];

#[test]
fn a_service_build_links_no_test_only_crate() {
    let service = tree(&["--no-default-features"]);
    assert!(service.contains("umdev-server") && service.contains("umdev-devices"), "{service}");
    for name in TEST_ONLY {
        assert!(!service.contains(name), "a --no-default-features build links {name}:\n{service}");
    }
    // The default build (`cargo run --release -- demo` from a checkout) has the benchmarks: the
    // check above looks where they would show.
    let default = tree(&[]);
    for name in ["umdev-testkit", "vfio_user", "plotters", "indicatif"] {
        assert!(default.contains(name), "the default build lacks {name}");
    }
}
