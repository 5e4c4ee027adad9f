//! The process-wide budget of guest mappings: every mapping is a VMA, a per-process kernel
//! resource, so all DMA spaces of a process share one limit. (Its own test binary: the
//! budget is process state.)

use std::os::fd::AsFd;

use umdev_pinning::{
    process_mappings, set_process_mapping_limit, DmaSpace, MapError, MmapError, Prot, PAGE_SIZE,
};

#[test]
fn all_spaces_share_one_budget_of_mappings() {
    let fd = nix::sys::memfd::memfd_create(c"budget", nix::sys::memfd::MFdFlags::empty()).unwrap();
    let file = std::fs::File::from(fd);
    file.set_len(PAGE_SIZE).unwrap();
    set_process_mapping_limit(3);
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
