//! What an open file is, told without asking its file system: a file on FUSE answers an
//! `fstat`, a `fstatfs` and its last close's FLUSH only when its server does, and the server
//! may be the client that sent the fd. Used before mapping a client's file
//! (`DmaSpace::map_from`) and by the server before closing one.

use std::os::fd::{AsRawFd, BorrowedFd};
use std::os::unix::ffi::OsStrExt;

/// What [`file_kind`] tells of an open file.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FileKind {
    /// A memfd, or a tmpfs or hugetlbfs file: it answers `F_GET_SEALS`, which only the
    /// kernel's shmem and hugetlbfs code serve.
    Memory,
    /// A pipe.
    Pipe,
    /// A socket.
    Socket,
    /// An eventfd.
    Eventfd,
    /// Another anonymous inode (an epoll fd, a userfaultfd, ...).
    AnonInode,
    /// Anything else: a file on some file system, a device; or one procfs could not name.
    Other,
}

/// What `fd` is. Asks the kernel only: `F_GET_SEALS`, then the name procfs gives the file
/// from the kernel's own record of it (`/proc/self/fd/N`), never the file's file system.
pub fn file_kind(fd: BorrowedFd<'_>) -> FileKind {
    if nix::fcntl::fcntl(fd, nix::fcntl::FcntlArg::F_GET_SEALS).is_ok() {
        return FileKind::Memory;
    }
    let Ok(link) = std::fs::read_link(format!("/proc/self/fd/{}", fd.as_raw_fd())) else {
        return FileKind::Other;
    };
    let link = link.as_os_str().as_bytes();
    match link {
        b"anon_inode:[eventfd]" => FileKind::Eventfd,
        _ if link.starts_with(b"pipe:") => FileKind::Pipe,
        _ if link.starts_with(b"socket:") => FileKind::Socket,
        _ if link.starts_with(b"anon_inode:") => FileKind::AnonInode,
        _ => FileKind::Other,
    }
}
