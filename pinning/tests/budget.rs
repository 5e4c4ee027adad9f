//! The process-wide budget of guest mappings: every mapping is a VMA, a per-process kernel
//! resource, so all DMA spaces of a process share one limit. (Its own test binary: the
//! budget is process state.)

use std::os::fd::AsFd;

use umdev_pinning::{
    process_mapped_bytes, process_mappings, set_process_mapped_bytes_limit, set_process_mapping_limit,
    DmaSpace, MapError, MmapError, Prot, PAGE_SIZE,
};

/// The tests share the process's budgets: one at a time.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

#[test]
fn all_spaces_share_one_budget_of_address_space() {
    // Mappings of a sparse file cost only addresses; clients mapping a few huge ones must not
    // leave the process none (a thread's stack, the allocator, every other instance).
    let _one = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let fd = nix::sys::memfd::memfd_create(c"budget", nix::sys::memfd::MFdFlags::empty()).unwrap();
    let file = std::fs::File::from(fd);
    let huge = 1u64 << 40;
    file.set_len(huge).unwrap();
    set_process_mapped_bytes_limit(3 * huge);
    set_process_mapping_limit(1000);
    let (a, b) = (DmaSpace::default(), DmaSpace::default());
    a.map(0, huge, file.as_fd(), 0, Prot::READ).unwrap();
    a.map(huge, huge, file.as_fd(), 0, Prot::READ).unwrap();
    b.map(0, huge, file.as_fd(), 0, Prot::READ).unwrap();
    assert_eq!(process_mapped_bytes(), 3 * huge);
    let err = b.map(huge, PAGE_SIZE, file.as_fd(), 0, Prot::READ).unwrap_err();
    assert!(matches!(err, MapError::Backing(MmapError::ProcessBytes { .. })), "{err}");
    assert_eq!(err.errno(), libc::ENOMEM);
    assert_eq!(process_mappings(), 3, "the refused map took no place");
    a.unmap(0, huge).unwrap();
    b.map(huge, huge, file.as_fd(), 0, Prot::READ).unwrap();
    drop((a, b));
    assert_eq!((process_mappings(), process_mapped_bytes()), (0, 0));
    set_process_mapped_bytes_limit(64 << 40);
}

#[test]
fn all_spaces_share_one_budget_of_mappings() {
    let _one = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let fd = nix::sys::memfd::memfd_create(c"budget", nix::sys::memfd::MFdFlags::empty()).unwrap();
    let file = std::fs::File::from(fd);
    file.set_len(PAGE_SIZE).unwrap();
    set_process_mapping_limit(3);
    set_process_mapped_bytes_limit(64 << 40);
    let (a, b) = (DmaSpace::default(), DmaSpace::default());
    a.map(0, PAGE_SIZE, file.as_fd(), 0, Prot::READ).unwrap();
    a.map(PAGE_SIZE, PAGE_SIZE, file.as_fd(), 0, Prot::READ).unwrap();
    b.map(0, PAGE_SIZE, file.as_fd(), 0, Prot::READ).unwrap();
    assert_eq!(process_mappings(), 3);
    let err = b.map(PAGE_SIZE, PAGE_SIZE, file.as_fd(), 0, Prot::READ).unwrap_err();
    assert!(matches!(err, MapError::Backing(MmapError::ProcessLimit { limit: 3 })), "{err}");
    assert_eq!(err.errno(), libc::ENOMEM);
    // Message-only regions take no VMA and no budget.
    b.map_message_only(1 << 30, PAGE_SIZE, Prot::READ).unwrap();
    // An unmap returns its place.
    a.unmap(0, PAGE_SIZE).unwrap();
    b.map(PAGE_SIZE, PAGE_SIZE, file.as_fd(), 0, Prot::READ).unwrap();
    drop(a);
    drop(b);
    assert_eq!(process_mappings(), 0);
}
