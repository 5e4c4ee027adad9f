//! Shared test support: a daemon with one instance on a temporary socket, memfds, fd counts,
//! helpers for rust-vmm's client; real `umdev` processes in `process`.
#![allow(dead_code)]

pub mod ccw;
pub mod docs;
pub mod guest;
pub mod process;
pub mod qemu;
pub mod raw;

use std::fs::File;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use umdev_mdev::types::InstanceOptions;
use umdev_mdev::VfioDevice;
use umdev_server::{Daemon, InstanceConfig, InstanceInfo};
use vfio_user::Client;
use vmm_sys_util::eventfd::EventFd;

/// A daemon serving one instance of a built-in type on a socket in a temporary directory.
pub struct Harness {
    pub dir: tempfile::TempDir,
    pub daemon: Daemon,
    pub socket: PathBuf,
    pub id: String,
}

impl Harness {
    pub fn new(type_name: &str) -> Harness {
        Self::with(type_name, InstanceOptions::default(), |_| {})
    }

    pub fn with(
        type_name: &str,
        options: InstanceOptions,
        tune: impl FnOnce(&mut InstanceConfig),
    ) -> Harness {
        let device =
            umdev::builtin_registry().find(type_name).expect("type").create(&options).expect("create");
        Self::with_device(device, tune)
    }

    pub fn with_device(device: Arc<dyn VfioDevice>, tune: impl FnOnce(&mut InstanceConfig)) -> Harness {
        let dir = tempfile::tempdir().expect("tempdir");
        let socket = dir.path().join("dev.sock");
        let id = "test".to_string();
        let mut config = InstanceConfig::new(id.clone(), &socket);
        tune(&mut config);
        let daemon = Daemon::new();
        daemon.start(device, config).expect("start instance");
        Harness { dir, daemon, socket, id }
    }

    pub fn info(&self) -> InstanceInfo {
        self.daemon.info(&self.id).expect("instance")
    }

    /// Waits until no client is connected (the server finished cleaning up).
    pub fn wait_idle(&self) {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
        while self.info().connected {
            assert!(std::time::Instant::now() < deadline, "the instance never became idle");
            std::thread::sleep(std::time::Duration::from_millis(2));
        }
    }
}

/// A memfd of `size` bytes.
pub fn memfd(size: u64) -> File {
    let fd =
        nix::sys::memfd::memfd_create(c"umdev-test-ram", nix::sys::memfd::MFdFlags::empty()).expect("memfd");
    let file = File::from(fd);
    file.set_len(size).expect("ftruncate");
    file
}

/// fds open in this process.
pub fn open_fds() -> usize {
    std::fs::read_dir("/proc/self/fd").map(|d| d.count()).unwrap_or(0)
}

/// A 32-bit little-endian read of `region` through rust-vmm's client.
pub fn read32(c: &mut Client, region: u32, offset: u64) -> u32 {
    let mut b = [0u8; 4];
    c.region_read(region, offset, &mut b).expect("region_read");
    u32::from_le_bytes(b)
}

/// Waits for the eventfd counter to be non-zero; returns it.
pub fn wait_eventfd(e: &EventFd) -> u64 {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        if let Ok(n) = e.read() {
            return n;
        }
        assert!(Instant::now() < deadline, "no interrupt signalled");
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// testdev's BAR0 registers (docs/testdev.md).
pub mod testdev {
    #[allow(unused_imports)]
    pub use umdev_devices::testdev::regs::*;
}
