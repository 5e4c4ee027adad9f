//! A loop device over a sparse file, for tests of block-device backings: made with `losetup`
//! (root), detached on drop. Where none can be had, the constructor says why (`SKIPPED: ...`)
//! and the test returns.

use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::Command;

/// A loop device over a file of its own; detached on drop.
pub struct LoopDevice {
    dev: PathBuf,
    _dir: tempfile::TempDir,
}

impl LoopDevice {
    /// A loop device over a new file of `bytes`, with `losetup`'s `args` (`--read-only`,
    /// `--sector-size 4096`); `None`, said why, where there is none to be had.
    pub fn new(bytes: u64, args: &[&str]) -> Option<LoopDevice> {
        let dir = tempfile::tempdir().ok()?;
        let file = dir.path().join("backing.img");
        File::create(&file).and_then(|f| f.set_len(bytes)).ok()?;
        let out = Command::new("losetup").args(["--find", "--show"]).args(args).arg(&file).output();
        match out {
            Ok(out) if out.status.success() => {
                let dev = String::from_utf8_lossy(&out.stdout).trim().into();
                Some(LoopDevice { dev, _dir: dir })
            }
            Ok(out) => {
                eprintln!("SKIPPED: no loop device: {}", String::from_utf8_lossy(&out.stderr).trim());
                None
            }
            Err(e) => {
                eprintln!("SKIPPED: no losetup: {e}");
                None
            }
        }
    }

    /// The device node (`/dev/loopN`).
    pub fn path(&self) -> &Path {
        &self.dev
    }
}

impl Drop for LoopDevice {
    fn drop(&mut self) {
        let _ = Command::new("losetup").arg("-d").arg(&self.dev).status();
    }
}
