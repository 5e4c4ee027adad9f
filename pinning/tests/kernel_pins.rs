//! Kernel mode against the kernel's own accounting: the process's `VmPin` (pages the kernel
//! holds pinned for it) follows every pin and goes back after every unpin, unmap and
//! disconnect; runs longer than a registered buffer may be are cut; `RLIMIT_MEMLOCK` as
//! the kernel charges it refuses a call whole; and where io_uring is refused the mode says
//! so and the other modes work. The in-process tests hold `ALONE` (nothing else in this
//! binary pins meanwhile); the limits are tried in child processes.

use std::os::fd::AsFd;
use std::process::Command;
use std::sync::Mutex;
use std::time::Duration;

use umdev_pinning::fuzzing::{deny_io_uring_setup, vm_pin_pages};
use umdev_pinning::{
    kernel_pins_available, DmaSpace, DmaSpaceConfig, PinError, PinMode, Prot, KERNEL_BUFFER_BYTES, PAGE_SIZE,
};

const P: u64 = PAGE_SIZE;

/// Held by every test that reads `VmPin` in this process.
static ALONE: Mutex<()> = Mutex::new(());

fn memfd(bytes: u64) -> std::fs::File {
    let fd = nix::sys::memfd::memfd_create(c"kernel-pins", nix::sys::memfd::MFdFlags::empty()).unwrap();
    let file = std::fs::File::from(fd);
    file.set_len(bytes).unwrap();
    file
}

fn kernel_space() -> DmaSpace {
    DmaSpace::try_new(DmaSpaceConfig {
        mode: PinMode::Kernel,
        unmap_timeout: Duration::from_millis(20),
        ..Default::default()
    })
    .expect("kernel mode starts here")
}

#[test]
fn vm_pin_follows_every_pin_and_goes_back_after_every_unpin_unmap_and_disconnect() {
    let _alone = ALONE.lock().unwrap_or_else(|p| p.into_inner());
    let start = vm_pin_pages();
    let pinned = || vm_pin_pages() - start;
    let space = kernel_space();
    let file = memfd(64 * P);
    space.map(0, 32 * P, file.as_fd(), 0, Prot::READ_WRITE).unwrap();
    space.map(32 * P, 32 * P, file.as_fd(), 32 * P, Prot::READ_WRITE).unwrap();

    // A guard: its pages, each once per buffer holding it.
    let pins = space.pin_pages(&[1, 5, 6, 7, 9, 5], Prot::READ).unwrap();
    assert_eq!(pinned(), 6);
    drop(pins);
    assert_eq!(pinned(), 0, "after the guard's drop");

    // Kept pins: the buffer stays whole until its last page is unpinned.
    space.pin_range(2 * P, 4, Prot::READ).unwrap().forget();
    space.unpin_pages(&[2, 3, 4]).unwrap();
    assert_eq!(pinned(), 4);
    space.unpin_pages(&[5]).unwrap();
    assert_eq!(pinned(), 0, "after unpin_pages");

    // An unmap waits for pins, fails busy while they stay, and succeeds once they are gone.
    let pins = space.pin_range(30 * P, 4, Prot::READ).unwrap();
    assert_eq!(pins.runs().len(), 2, "a run per mapping");
    assert!(space.unmap(0, 32 * P).is_err());
    assert_eq!(pinned(), 4);
    drop(pins);
    space.unmap(0, 32 * P).unwrap();
    assert_eq!(pinned(), 0, "after the unmap");

    // A disconnect: the mappings go at once, the space's handle too; the device's guards
    // let go later.
    let pins = space.pin_pages(&[40, 41, 50], Prot::READ_WRITE).unwrap();
    space.abandon_all();
    drop(space);
    pins.write(0, b"the device finishes its DMA").unwrap();
    assert_eq!(pinned(), 3);
    drop(pins);
    assert_eq!(pinned(), 0, "after the disconnect and the device's last guard");
}

#[test]
fn a_run_longer_than_a_buffer_is_cut_into_buffers_of_a_gib() {
    let _alone = ALONE.lock().unwrap_or_else(|p| p.into_inner());
    let start = vm_pin_pages();
    // Calls of more than 1 GiB (the default max_pages_per_call keeps runs within a buffer).
    let space = DmaSpace::try_new(DmaSpaceConfig {
        mode: PinMode::Kernel,
        max_pages_per_call: 1 << 20,
        ..Default::default()
    })
    .unwrap();
    // 1 GiB and 2 pages of a sparse memfd: the kernel allocates what it pins (1 GiB of
    // memory, for the moment the test holds it).
    let bytes = KERNEL_BUFFER_BYTES + 2 * P;
    let file = memfd(bytes);
    space.map(0, bytes, file.as_fd(), 0, Prot::READ_WRITE).unwrap();
    let pins = space.pin_range(0, bytes / P, Prot::READ).unwrap();
    assert_eq!(pins.runs().len(), 1);
    let s = space.stats();
    assert_eq!((s.kernel_pin_calls, s.kernel_buffers, s.kernel_cut_runs), (1, 2, 1));
    assert_eq!(vm_pin_pages() - start, bytes / P);
    let first = pins.registered_buffer(0).unwrap();
    assert_eq!(first.len, KERNEL_BUFFER_BYTES);
    let tail = pins.registered_buffer(KERNEL_BUFFER_BYTES + 10).unwrap();
    assert_eq!((tail.index, tail.offset, tail.len), (first.index + 1, 10, 2 * P - 10));
    drop(pins);
    assert_eq!(vm_pin_pages(), start);
}

/// Runs test `name` of this binary in a child process with `env` set; its output.
fn child(name: &str, env: &str) -> std::process::Output {
    Command::new(std::env::current_exe().unwrap())
        .args(["--exact", name, "--nocapture", "--test-threads=1"])
        .env(env, "1")
        .output()
        .unwrap()
}

const LIMITED: &str = "UMDEV_KERNEL_PINS_LIMITED";

/// Drops `CAP_IPC_LOCK` from this process's effective and permitted sets.
fn drop_cap_ipc_lock() {
    #[repr(C)]
    struct Header {
        version: u32,
        pid: i32,
    }
    #[repr(C)]
    #[derive(Clone, Copy, Default)]
    struct Data {
        effective: u32,
        permitted: u32,
        inheritable: u32,
    }
    const VERSION_3: u32 = 0x2008_0522;
    const CAP_IPC_LOCK: u32 = 14;
    let mut header = Header { version: VERSION_3, pid: 0 };
    let mut data = [Data::default(); 2];
    // SAFETY: capget and capset with a version-3 header and its two data words.
    unsafe {
        assert_eq!(libc::syscall(libc::SYS_capget, &mut header as *mut Header, data.as_mut_ptr()), 0);
        data[0].effective &= !(1 << CAP_IPC_LOCK);
        data[0].permitted &= !(1 << CAP_IPC_LOCK);
        assert_eq!(libc::syscall(libc::SYS_capset, &mut header as *mut Header, data.as_ptr()), 0);
    }
}

#[test]
fn over_rlimit_memlock_the_kernel_refuses_a_call_whole() {
    if std::env::var_os(LIMITED).is_none() {
        let out = child("over_rlimit_memlock_the_kernel_refuses_a_call_whole", LIMITED);
        assert!(
            out.status.success(),
            "{}\n{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        return;
    }
    // The child: without CAP_IPC_LOCK, 256 KiB of RLIMIT_MEMLOCK (64 pages), charged by the
    // kernel to the user as io_uring does.
    drop_cap_ipc_lock();
    nix::sys::resource::setrlimit(nix::sys::resource::Resource::RLIMIT_MEMLOCK, 64 * P, 64 * P).unwrap();
    let start = vm_pin_pages();
    let space = kernel_space();
    let file = memfd(1024 * P);
    space.map(0, 1024 * P, file.as_fd(), 0, Prot::READ_WRITE).unwrap();
    let small = space.pin_range(0, 8, Prot::READ).unwrap();
    // Two runs: the first fits, the second does not; the first is cleared again.
    match space.pin_pages(&(100..102).chain(200..712).collect::<Vec<u64>>(), Prot::READ) {
        Err(e @ PinError::Kernel { .. }) => {
            let PinError::Kernel { index, pfn, ref source } = e else { unreachable!() };
            assert_eq!((index, pfn, source.raw_os_error()), (2, 200, Some(libc::ENOMEM)), "{e}");
            assert_eq!(e.errno(), libc::ENOMEM);
        }
        other => panic!("{other:?}"),
    }
    let s = space.stats();
    assert_eq!((s.kernel_buffers_held, s.kernel_pages_held, s.pin_failures), (1, 8, 1));
    assert_eq!(vm_pin_pages() - start, 8, "nothing of the refused call stays pinned");
    assert_eq!(space.pin_count(100 * P), 0);
    drop(small);
    assert_eq!(vm_pin_pages(), start);
}

const DENIED: &str = "UMDEV_KERNEL_PINS_DENIED";

#[test]
fn where_io_uring_is_refused_kernel_mode_says_why_and_the_other_modes_work() {
    if std::env::var_os(DENIED).is_none() {
        let out = child("where_io_uring_is_refused_kernel_mode_says_why_and_the_other_modes_work", DENIED);
        assert!(
            out.status.success(),
            "{}\n{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        return;
    }
    assert_eq!(kernel_pins_available(), Ok(()), "io_uring works here before the filter");
    // ENOSYS: what a kernel without io_uring, or a filter hiding it, answers.
    deny_io_uring_setup(libc::ENOSYS).expect("a seccomp filter");
    let why = kernel_pins_available().unwrap_err();
    assert_eq!((why.step, why.errno), ("io_uring_setup", libc::ENOSYS));
    assert!(why.to_string().contains("no io_uring, or a seccomp filter hides it"), "{why}");
    let config = |mode| DmaSpaceConfig { mode, ..Default::default() };
    assert_eq!(DmaSpace::try_new(config(PinMode::Kernel)).unwrap_err(), why);
    // A space made anyway refuses every pin with the reason.
    let space = DmaSpace::new(config(PinMode::Kernel));
    let file = memfd(4 * P);
    space.map(0, 4 * P, file.as_fd(), 0, Prot::READ_WRITE).unwrap();
    match space.pin_pages(&[1], Prot::READ) {
        Err(PinError::KernelUnavailable(e)) => assert_eq!(e, why),
        other => panic!("{other:?}"),
    }
    assert_eq!(space.stats().pin_failures, 1);
    assert!(space.kernel_ring_fd().is_none());
    for mode in [PinMode::Track, PinMode::Lock] {
        let space = DmaSpace::try_new(config(mode)).unwrap();
        space.map(0, 4 * P, file.as_fd(), 0, Prot::READ_WRITE).unwrap();
        let pins = space.pin_pages(&[1, 2], Prot::READ).unwrap();
        assert_eq!(pins.registered_buffer(0), None, "{mode}: no kernel buffers");
    }
}
