//! The engine's SIGBUS handler recovers only faults in guest memory: any other SIGBUS still
//! kills the process, as it would without the engine. Checked in a child process.

use std::num::NonZeroUsize;
use std::os::fd::AsFd;
use std::os::unix::process::ExitStatusExt;
use std::process::Command;

use nix::sys::mman::{mmap, MapFlags, ProtFlags};
use umdev_pinning::{DmaSpace, Prot, PAGE_SIZE};

fn memfd(size: u64) -> std::fs::File {
    let fd = nix::sys::memfd::memfd_create(c"sigbus-test", nix::sys::memfd::MFdFlags::empty()).unwrap();
    let file = std::fs::File::from(fd);
    file.set_len(size).unwrap();
    file
}

const CHILD: &str = "UMDEV_SIGBUS_CHILD";

#[test]
fn a_sigbus_outside_guest_memory_still_kills_the_process() {
    if std::env::var_os(CHILD).is_some() {
        // The child: install the engine's handler by mapping guest memory, then fault on a
        // truncated mapping of our own.
        let space = DmaSpace::default();
        let guest = memfd(PAGE_SIZE);
        space.map(0, PAGE_SIZE, guest.as_fd(), 0, Prot::READ_WRITE).unwrap();
        let own = memfd(PAGE_SIZE);
        // SAFETY: a fresh shared mapping of our own memfd.
        let addr = unsafe {
            mmap(
                None,
                NonZeroUsize::new(PAGE_SIZE as usize).unwrap(),
                ProtFlags::PROT_READ,
                MapFlags::MAP_SHARED,
                own.as_fd(),
                0,
            )
        }
        .unwrap();
        own.set_len(0).unwrap();
        // SAFETY: deliberately touching a page past the end of the file: SIGBUS.
        let byte = unsafe { std::ptr::read_volatile(addr.as_ptr() as *const u8) };
        println!("survived reading {byte}");
        std::process::exit(0);
    }
    let out = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "a_sigbus_outside_guest_memory_still_kills_the_process", "--nocapture"])
        .env(CHILD, "1")
        .output()
        .unwrap();
    assert_eq!(out.status.signal(), Some(libc::SIGBUS), "{out:?}");
}
