//! The engine's SIGBUS handler recovers only faults in guest memory: any other SIGBUS still
//! kills the process, as it would without the engine. Checked in a child process.

use std::num::NonZeroUsize;
use std::os::fd::AsFd;
use std::os::unix::process::ExitStatusExt;
use std::process::{Command, Output};

use nix::sys::mman::{mmap, MapFlags, ProtFlags};
use umdev_pinning::{DmaSpace, Prot, PAGE_SIZE};

fn memfd(size: u64) -> std::fs::File {
    let fd = nix::sys::memfd::memfd_create(c"sigbus-test", nix::sys::memfd::MFdFlags::empty()).unwrap();
    let file = std::fs::File::from(fd);
    file.set_len(size).unwrap();
    file
}

const CHILD: &str = "UMDEV_SIGBUS_CHILD";

/// Runs test `name` of this binary in a child process, which takes the child's branch.
fn in_child(name: &str) -> Output {
    Command::new(std::env::current_exe().unwrap())
        .args(["--exact", name, "--nocapture"])
        .env(CHILD, "1")
        .output()
        .unwrap()
}

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
    let out = in_child("a_sigbus_outside_guest_memory_still_kills_the_process");
    assert_eq!(out.status.signal(), Some(libc::SIGBUS), "{out:?}");
}

/// A SIGBUS that a process sends (`si_code` SI_QUEUE here, to itself, with guest memory's
/// address where a fault's would be) is no fault: nothing is zeroed or poisoned, and it goes
/// where it would without the engine (here the test harness's own handler, Rust's
/// stack-overflow guard, which lets such a signal be; without one it would kill). The
/// engine's handler stays: a truncation after it is still recovered. Checked in a child
/// process.
#[test]
fn a_sent_sigbus_naming_guest_memory_changes_nothing() {
    if std::env::var_os(CHILD).is_some() {
        // What was there before the engine: a handler (Rust's, in a test) lets a sent signal
        // be; the default kills.
        // SAFETY: (local) a query: no new disposition, the old one written into `old`.
        let mut old: libc::sigaction = unsafe { std::mem::zeroed() };
        // SAFETY: as above.
        assert_eq!(unsafe { libc::sigaction(libc::SIGBUS, std::ptr::null(), &mut old) }, 0);
        println!("before: {}", if old.sa_sigaction == libc::SIG_DFL { "default" } else { "a handler" });
        let space = DmaSpace::default();
        let guest = memfd(PAGE_SIZE);
        std::os::unix::fs::FileExt::write_all_at(&guest, &[0xab], 0).unwrap();
        space.map(0, PAGE_SIZE, guest.as_fd(), 0, Prot::READ_WRITE).unwrap();
        let pins = space.pin_pages(&[0], Prot::READ).unwrap();
        let addr = pins.host_addr(0).unwrap();
        // SAFETY: an all-zero siginfo_t is a valid value.
        let mut info: libc::siginfo_t = unsafe { std::mem::zeroed() };
        let raw = &mut info as *mut libc::siginfo_t as *mut u8;
        // SAFETY: si_signo, si_code and the union's first word (a fault's si_addr) at their
        // Linux offsets 0, 8 and 16, inside the struct's 128 bytes and aligned.
        unsafe {
            (raw as *mut libc::c_int).write(libc::SIGBUS);
            (raw.add(8) as *mut libc::c_int).write(libc::SI_QUEUE);
            (raw.add(16) as *mut usize).write(addr);
        }
        // SAFETY: sends this thread a signal with the siginfo above (allowed to itself).
        let sent = unsafe {
            libc::syscall(
                libc::SYS_rt_tgsigqueueinfo,
                libc::getpid(),
                libc::gettid(),
                libc::SIGBUS,
                &info as *const libc::siginfo_t,
            )
        };
        assert_eq!(sent, 0, "{}", std::io::Error::last_os_error());
        // SAFETY: the page is pinned for read; a read of it is a volatile load of a byte.
        let byte = unsafe { std::ptr::read_volatile(addr as *const u8) };
        println!("survived: poisoned {} byte {byte:#x}", pins.poisoned());
        // The engine's handler is still there: a truncation is recovered, not fatal.
        guest.set_len(0).unwrap();
        // SAFETY: as above; the page now lies past the file's end, which the engine recovers.
        let byte = unsafe { std::ptr::read_volatile(addr as *const u8) };
        println!("then truncated: poisoned {} byte {byte:#x}", pins.poisoned());
        std::process::exit(0);
    }
    let out = in_child("a_sent_sigbus_naming_guest_memory_changes_nothing");
    let stdout = String::from_utf8_lossy(&out.stdout);
    if stdout.contains("before: default") {
        assert_eq!(out.status.signal(), Some(libc::SIGBUS), "{out:?}");
        assert!(!stdout.contains("survived"), "{out:?}");
    } else {
        assert!(stdout.contains("before: a handler"), "{out:?}");
        assert!(out.status.success(), "{out:?}");
        assert!(stdout.contains("survived: poisoned false byte 0xab"), "{out:?}");
        assert!(stdout.contains("then truncated: poisoned true byte 0x0"), "{out:?}");
    }
}
