//! The host side of a mapping: an fd mmapped `MAP_SHARED`, and the lock syscalls on it.
//!
//! This is the only module that calls mmap, munmap, mlock and munlock; everything else sees
//! a [`HostMemory`] that owns its mapping and unmaps it on drop.

use std::io;
use std::num::NonZeroUsize;
use std::os::fd::BorrowedFd;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use nix::sys::mman::{self, MapFlags};
#[cfg(not(miri))]
use nix::sys::stat::{fstat, SFlag};
#[cfg(not(miri))]
use nix::sys::statfs::{fstatfs, HUGETLBFS_MAGIC};
use thiserror::Error;

#[cfg(not(miri))]
use crate::file_kind::{file_kind, FileKind};
use crate::page::{Prot, PAGE_SIZE};
use crate::sigbus;
use crate::sync::AtomicUpdate;

/// Why an fd could not become host memory for a mapping.
#[derive(Debug, Error)]
pub enum MmapError {
    /// `fstat` or `fstatfs` on the fd failed: it is not an open file.
    #[error("cannot inspect the fd: {0}")]
    Inspect(#[source] io::Error),
    /// Only regular files (memfd, tmpfs, hugetlbfs, ...) are mapped: other fds have no
    /// meaningful size and may have side effects when mapped.
    #[error("the fd is not a regular file (mode {mode:#o})")]
    NotRegularFile {
        /// The `st_mode` file type bits.
        mode: u32,
    },
    /// The file is shorter than `offset + size`.
    #[error("offset {offset:#x} + size {size:#x} is past the end of the file ({file_size:#x} bytes)")]
    PastEndOfFile {
        /// Requested file offset.
        offset: u64,
        /// Requested length.
        size: u64,
        /// The file's size.
        file_size: u64,
    },
    /// hugetlbfs files can only be mapped at offsets and sizes aligned to their page size.
    #[error(
        "offset {offset:#x} and size {size:#x} must be multiples of the backing page size {page_size:#x}"
    )]
    BackingUnaligned {
        /// Requested file offset.
        offset: u64,
        /// Requested length.
        size: u64,
        /// The file system's page size.
        page_size: u64,
    },
    /// The length does not fit in this process's address space.
    #[error("size {0:#x} does not fit in the address space")]
    TooLarge(u64),
    /// The file is on a file system whose pages may come at someone else's pace: FUSE (a
    /// user-space server, the client itself perhaps), a network file system, or one that may
    /// stack on those (overlayfs). A thread of this process touching such a page would wait
    /// as long as that server chose, with engine locks held (a lock-mode mlock) or on the
    /// connection's own thread. Memory comes from memfds, tmpfs, hugetlbfs, ramfs or a local
    /// disk file system (ext2/3/4, XFS, Btrfs, F2FS).
    #[error("the file is on a file system with magic {magic:#x}, whose pages may come at another server's pace (FUSE, a network or stacked file system); map memory from a memfd, tmpfs, hugetlbfs, ramfs or a local disk file system (ext4, XFS, Btrfs, F2FS)")]
    Filesystem {
        /// `statfs`'s `f_type`.
        magic: u32,
    },
    /// The file is on a mount this process's mount table (`/proc/self/mountinfo`) names
    /// with a file system other than those above, or does not list at all (another mount
    /// namespace's). Learned without asking the file system: an `fstat` or `fstatfs` of a
    /// file on FUSE asks its server, which may never answer.
    #[error("the file is on a mount of {fstype}, whose pages may come at another server's pace (FUSE, a network or stacked file system); map memory from a memfd, tmpfs, hugetlbfs, ramfs or a local disk file system (ext4, XFS, Btrfs, F2FS)")]
    Mount {
        /// The mount's file system type, as the mount table names it.
        fstype: String,
    },
    /// The process already holds its budget of guest mappings (see
    /// [`process_mapping_limit`]): every mapping is a VMA, and VMAs are a per-process kernel
    /// resource the whole server shares.
    #[error("the process holds {limit} guest mappings, its limit")]
    ProcessLimit {
        /// The limit.
        limit: u64,
    },
    /// The mapping would take the process's guest mappings past their address-space budget
    /// (see [`process_mapped_bytes_limit`]).
    #[error("{bytes:#x} more bytes of guest mappings would pass the process's budget of {limit:#x}")]
    ProcessBytes {
        /// The mapping's size.
        bytes: u64,
        /// The budget.
        limit: u64,
    },
    /// mmap refused the fd (its open mode, the file system, address space exhaustion, ...).
    #[error("mmap failed: {0}")]
    Mmap(#[source] io::Error),
}

/// File systems guest memory may be on (`statfs`'s `f_type`, linux/magic.h): memory, and
/// local disks, whose page faults wait for nobody but the kernel and the disk.
const MEMORY_FILESYSTEMS: [u32; 8] = [
    0x0102_1994, // tmpfs (memfds, /dev/shm)
    0x9584_58f6, // hugetlbfs
    0x8584_58f6, // ramfs
    0xef53,      // ext2, ext3, ext4
    0x5846_5342, // XFS
    0x9123_683e, // Btrfs
    0xf2f5_2010, // F2FS
    0xca45_1a4e, // bcachefs
];

/// The same file systems by the names `/proc/self/mountinfo` gives them.
#[cfg(not(miri))]
const MEMORY_FILESYSTEM_NAMES: [&str; 10] =
    ["tmpfs", "hugetlbfs", "ramfs", "ext2", "ext3", "ext4", "xfs", "btrfs", "f2fs", "bcachefs"];

/// Refuses `fd` unless its file is on a file system of [`MEMORY_FILESYSTEM_NAMES`], learned
/// without asking that file system: an `fstat` or `fstatfs` of a file on FUSE waits for its
/// server (perhaps the client, which need never answer), and so would the thread mapping it.
/// A memory file passes at once, and a pipe, a socket or an anonymous inode (on kernel-internal
/// mounts no table lists) goes on to the `fstat` that refuses it, which asks nobody
/// ([`file_kind`]). For any other file the mount comes from the mount id `/proc/self/fdinfo`
/// shows (procfs prints it from the open file) and its type from `/proc/self/mountinfo` (the
/// kernel's record of the mount): neither asks the file system.
///
/// A mount of another mount namespace (the client's, where this process runs in one of its
/// own, as under systemd's `ProtectSystem=`) is not in this process's table. Mount ids are
/// unique across namespaces, so it is looked up in the table of `client` (the process that
/// sent the fd, if known), and last by the file's device in this process's table (where a
/// file system shows its superblock's: not Btrfs, whose files show their subvolume's).
#[cfg(not(miri))]
fn check_local(fd: BorrowedFd<'_>, client: Option<i32>) -> Result<(), MmapError> {
    use std::os::fd::AsRawFd;
    if file_kind(fd) != FileKind::Other {
        return Ok(());
    }
    let fdinfo = std::fs::read_to_string(format!("/proc/self/fdinfo/{}", fd.as_raw_fd()))
        .map_err(MmapError::Inspect)?;
    let mount = fdinfo
        .lines()
        .find_map(|line| line.strip_prefix("mnt_id:"))
        .and_then(|id| id.trim().parse::<u64>().ok())
        .ok_or_else(|| MmapError::Inspect(io::Error::other("no mnt_id in /proc/self/fdinfo")))?;
    let table = std::fs::read_to_string("/proc/self/mountinfo").map_err(MmapError::Inspect)?;
    // The client's table is read only for a mount this process's does not list.
    let theirs = || client.and_then(|pid| std::fs::read_to_string(format!("/proc/{pid}/mountinfo")).ok());
    let fstype = mount_fstype(&table, mount)
        .map(str::to_string)
        .or_else(|| theirs().and_then(|theirs| mount_fstype(&theirs, mount).map(str::to_string)))
        .or_else(|| {
            let (major, minor) = device_of(fd).ok()?;
            device_fstype(&table, major, minor).map(str::to_string)
        });
    match fstype {
        Some(fstype) if MEMORY_FILESYSTEM_NAMES.contains(&fstype.as_str()) => Ok(()),
        Some(fstype) => Err(MmapError::Mount { fstype }),
        None => Err(MmapError::Mount { fstype: "a mount outside this process's mount table".into() }),
    }
}

/// The device (`st_dev`) of `fd`'s file, asked with `AT_STATX_DONT_SYNC` and nothing in
/// the mask: FUSE then answers from what it holds, without asking its server (9p and CIFS
/// may still ask theirs, but a client cannot mount those without privilege).
#[cfg(not(miri))]
fn device_of(fd: BorrowedFd<'_>) -> io::Result<(u32, u32)> {
    use std::os::fd::AsRawFd;
    // SAFETY: an all-zero statx is a valid value of the plain-data struct.
    let mut stx: libc::statx = unsafe { std::mem::zeroed() };
    // SAFETY: an empty NUL-terminated path with AT_EMPTY_PATH names the open fd; the kernel
    // writes at most one statx into the live local.
    let r = unsafe {
        libc::statx(fd.as_raw_fd(), c"".as_ptr(), libc::AT_EMPTY_PATH | libc::AT_STATX_DONT_SYNC, 0, &mut stx)
    };
    if r != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok((stx.stx_dev_major, stx.stx_dev_minor))
}

/// The mounts of a `/proc/PID/mountinfo` text as (id, `MAJ:MIN`, file system type): each
/// line is `ID PARENT MAJ:MIN ROOT POINT OPTIONS [OPTIONAL...] - FSTYPE SOURCE SUPER_OPTIONS`.
#[cfg(not(miri))]
fn mounts(table: &str) -> impl Iterator<Item = (&str, &str, &str)> {
    table.lines().filter_map(|line| {
        let mut fields = line.split(' ');
        let (id, dev) = (fields.next()?, fields.nth(1)?);
        // The optional fields end at a lone "-"; the type follows it.
        fields.by_ref().find(|&f| f == "-")?;
        Some((id, dev, fields.next()?))
    })
}

/// The file system type of mount `id` in a `/proc/PID/mountinfo` text.
#[cfg(not(miri))]
fn mount_fstype(table: &str, id: u64) -> Option<&str> {
    mounts(table).find(|&(m, _, _)| m.parse() == Ok(id)).map(|(_, _, fstype)| fstype)
}

/// The file system type of a mount of device `major:minor` in a `/proc/PID/mountinfo` text.
#[cfg(not(miri))]
fn device_fstype(table: &str, major: u32, minor: u32) -> Option<&str> {
    let dev = format!("{major}:{minor}");
    mounts(table).find(|&(_, d, _)| d == dev).map(|(_, _, fstype)| fstype)
}

/// Guest mappings alive in this process.
static LIVE_MAPPINGS: AtomicU64 = AtomicU64::new(0);
/// Their limit; 0 until set or first read.
static MAPPING_LIMIT: AtomicU64 = AtomicU64::new(0);

/// Guest mappings (VMAs) all DMA spaces of this process may hold together. Default: half of
/// `vm.max_map_count` (65530 unless raised: 32765), leaving the rest to the allocator, thread
/// stacks, the binary and lock-mode VMA splits, so that clients filling their mapping quota
/// cannot starve the process of VMAs.
pub fn process_mapping_limit() -> u64 {
    match MAPPING_LIMIT.load(Ordering::Relaxed) {
        0 => {
            let max_map_count = std::fs::read_to_string("/proc/sys/vm/max_map_count")
                .ok()
                .and_then(|s| s.trim().parse::<u64>().ok())
                .unwrap_or(65530);
            let limit = (max_map_count / 2).max(1);
            // A concurrent set wins.
            let _ = MAPPING_LIMIT.compare_exchange(0, limit, Ordering::Relaxed, Ordering::Relaxed);
            MAPPING_LIMIT.load(Ordering::Relaxed)
        }
        limit => limit,
    }
}

/// Sets [`process_mapping_limit`] (at least 1). Mappings already held are kept.
pub fn set_process_mapping_limit(limit: u64) {
    MAPPING_LIMIT.store(limit.max(1), Ordering::Relaxed);
}

/// Guest mappings alive in this process now.
pub fn process_mappings() -> u64 {
    LIVE_MAPPINGS.load(Ordering::Relaxed)
}

/// Bytes of guest mappings alive in this process.
static LIVE_BYTES: AtomicU64 = AtomicU64::new(0);
/// Their limit.
static BYTES_LIMIT: AtomicU64 = AtomicU64::new(DEFAULT_BYTES_LIMIT);
/// Half of x86-64's 128 TiB of user address space.
const DEFAULT_BYTES_LIMIT: u64 = 64 << 40;

/// Address space all DMA spaces of this process may map together. Default 64 TiB, half of
/// what a 4-level x86-64 process has: a mapping of a sparse file costs no memory, only
/// addresses, and clients mapping a few huge ones could otherwise leave the process none for
/// a thread's stack or the allocator (one client starving every other instance's).
pub fn process_mapped_bytes_limit() -> u64 {
    BYTES_LIMIT.load(Ordering::Relaxed)
}

/// Sets [`process_mapped_bytes_limit`]. Mappings already held are kept.
pub fn set_process_mapped_bytes_limit(limit: u64) {
    BYTES_LIMIT.store(limit, Ordering::Relaxed);
}

/// Bytes of guest mappings alive in this process now.
pub fn process_mapped_bytes() -> u64 {
    LIVE_BYTES.load(Ordering::Relaxed)
}

/// A reserved place in the process's mapping budget, returned on drop.
#[derive(Debug)]
struct BudgetReservation {
    /// Its bytes.
    bytes: u64,
}

impl BudgetReservation {
    /// One mapping of `bytes`, or why the process has no room for it.
    fn reserve(bytes: u64) -> Result<BudgetReservation, MmapError> {
        let limit = process_mapping_limit();
        LIVE_MAPPINGS
            .update_with(Ordering::AcqRel, Ordering::Acquire, |live| (live < limit).then_some(live + 1))
            .map_err(|_| MmapError::ProcessLimit { limit })?;
        let byte_limit = process_mapped_bytes_limit();
        let fits = |live: u64| live.checked_add(bytes).filter(|&total| total <= byte_limit);
        if LIVE_BYTES.update_with(Ordering::AcqRel, Ordering::Acquire, fits).is_err() {
            LIVE_MAPPINGS.fetch_sub(1, Ordering::AcqRel);
            return Err(MmapError::ProcessBytes { bytes, limit: byte_limit });
        }
        Ok(BudgetReservation { bytes })
    }
}

impl Drop for BudgetReservation {
    fn drop(&mut self) {
        LIVE_MAPPINGS.fetch_sub(1, Ordering::AcqRel);
        LIVE_BYTES.fetch_sub(self.bytes, Ordering::AcqRel);
    }
}

/// What backs a mapping, as far as pinning cares.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Backing {
    /// Size of the pages backing the file: `PAGE_SIZE`, or the huge page size for hugetlbfs.
    pub page_size: u64,
    /// Backed by hugetlbfs: pages are never swapped, so locking them needs no syscall.
    pub hugetlb: bool,
}

/// An fd's contents mapped `MAP_SHARED` into this process, unmapped on drop.
#[derive(Debug)]
pub(crate) struct HostMemory {
    addr: NonNull<u8>,
    len: usize,
    backing: Backing,
    /// Set by the SIGBUS handler when the file shrank under the mapping (see `sigbus`).
    poisoned: Arc<AtomicBool>,
    /// Released after the munmap in `drop`.
    _reservation: BudgetReservation,
    /// Its space's share, released after the munmap too ([`HostMemory::charged`]).
    _charge: Option<SpaceCharge>,
}

/// Bytes a mapping's memory holds of its space's limit (`DmaSpaceConfig::max_mapped_bytes`),
/// from before its mmap until after its munmap: an abandoned mapping that pins keep mapped
/// still counts.
#[derive(Debug)]
pub(crate) struct SpaceCharge {
    held: Arc<AtomicU64>,
    bytes: u64,
}

impl SpaceCharge {
    /// Takes `bytes` of `held`, if that leaves it at most `max`; else the bytes held now.
    pub(crate) fn take(held: &Arc<AtomicU64>, bytes: u64, max: u64) -> Result<SpaceCharge, u64> {
        held.update_with(Ordering::AcqRel, Ordering::Acquire, |now| {
            now.checked_add(bytes).filter(|&total| total <= max)
        })?;
        Ok(SpaceCharge { held: held.clone(), bytes })
    }
}

impl Drop for SpaceCharge {
    fn drop(&mut self) {
        self.held.fetch_sub(self.bytes, Ordering::AcqRel);
    }
}

// SAFETY: (local) HostMemory is a plain address range in this process's address space; the engine
// hands out access to it only through pins, and mlock/munlock/munmap are thread-safe.
unsafe impl Send for HostMemory {}
// SAFETY: (local) as above, no interior state is mutated through &HostMemory.
unsafe impl Sync for HostMemory {}

impl HostMemory {
    /// Maps `size` bytes of `fd` from `offset` with access `prot`.
    ///
    /// Costs O(1) whatever the size: no MAP_POPULATE, nothing touched.
    #[cfg(test)]
    pub(crate) fn map(fd: BorrowedFd<'_>, offset: u64, size: u64, prot: Prot) -> Result<Self, MmapError> {
        Self::map_from(fd, offset, size, prot, None)
    }

    /// As [`HostMemory::map`], for an fd process `client` sent, if known: a mount of its
    /// mount namespace is looked up in its mount table too ([`check_local`]).
    pub(crate) fn map_from(
        fd: BorrowedFd<'_>,
        offset: u64,
        size: u64,
        prot: Prot,
        client: Option<i32>,
    ) -> Result<Self, MmapError> {
        #[cfg(miri)]
        {
            // Miri cannot map a file: the unit tests it runs get private memory of the size.
            let _ = (fd, offset, prot, client);
            return Self::anonymous(size);
        }
        #[cfg(not(miri))]
        Self::map_file(fd, offset, size, prot, client)
    }

    #[cfg(not(miri))]
    fn map_file(
        fd: BorrowedFd<'_>,
        offset: u64,
        size: u64,
        prot: Prot,
        client: Option<i32>,
    ) -> Result<Self, MmapError> {
        // Before anything that asks the file's file system.
        check_local(fd, client)?;
        let stat = fstat(fd).map_err(|e| MmapError::Inspect(e.into()))?;
        let kind = SFlag::from_bits_truncate(stat.st_mode) & SFlag::S_IFMT;
        if kind != SFlag::S_IFREG {
            return Err(MmapError::NotRegularFile { mode: stat.st_mode & libc::S_IFMT });
        }
        let file_size = u64::try_from(stat.st_size).unwrap_or(0);
        let end = offset.checked_add(size);
        if end.is_none_or(|end| end > file_size) {
            return Err(MmapError::PastEndOfFile { offset, size, file_size });
        }
        let backing = Self::backing_of(fd)?;
        if !offset.is_multiple_of(backing.page_size) || !size.is_multiple_of(backing.page_size) {
            return Err(MmapError::BackingUnaligned { offset, size, page_size: backing.page_size });
        }
        let len = usize::try_from(size).map_err(|_| MmapError::TooLarge(size))?;
        let length = NonZeroUsize::new(len).ok_or(MmapError::TooLarge(size))?;
        let file_offset = libc::off_t::try_from(offset).map_err(|_| MmapError::TooLarge(offset))?;
        let reservation = BudgetReservation::reserve(size)?;
        // SAFETY: (local) a fresh mapping chosen by the kernel (no MAP_FIXED), so no existing memory is
        // replaced; the fd is a regular file checked above to cover [offset, offset + size).
        let addr =
            unsafe { mman::mmap(None, length, prot.mmap_flags(), MapFlags::MAP_SHARED, fd, file_offset) }
                .map_err(|e| MmapError::Mmap(e.into()))?;
        let poisoned = sigbus::register(addr.as_ptr() as usize, len, prot);
        Ok(HostMemory { addr: addr.cast(), len, backing, poisoned, _reservation: reservation, _charge: None })
    }

    /// `size` bytes of private anonymous memory, read-write (Miri's stand-in for a file).
    #[cfg(miri)]
    fn anonymous(size: u64) -> Result<Self, MmapError> {
        let len = usize::try_from(size).map_err(|_| MmapError::TooLarge(size))?;
        let length = NonZeroUsize::new(len).ok_or(MmapError::TooLarge(size))?;
        let reservation = BudgetReservation::reserve(size)?;
        let rw = nix::sys::mman::ProtFlags::PROT_READ | nix::sys::mman::ProtFlags::PROT_WRITE;
        // SAFETY: (local) a fresh private mapping chosen by the kernel replaces no memory.
        let addr = unsafe { mman::mmap_anonymous(None, length, rw, MapFlags::MAP_PRIVATE) }
            .map_err(|e| MmapError::Mmap(e.into()))?;
        let poisoned = sigbus::register(addr.as_ptr() as usize, len, Prot::READ_WRITE);
        let backing = Backing { page_size: PAGE_SIZE, hugetlb: false };
        Ok(HostMemory { addr: addr.cast(), len, backing, poisoned, _reservation: reservation, _charge: None })
    }

    #[cfg(not(miri))]
    fn backing_of(fd: BorrowedFd<'_>) -> Result<Backing, MmapError> {
        let fs = fstatfs(fd).map_err(|e| MmapError::Inspect(e.into()))?;
        // The kernel's f_type is a 32-bit magic, whatever the width libc gives it.
        let magic = fs.filesystem_type().0 as u64 as u32;
        if !MEMORY_FILESYSTEMS.contains(&magic) {
            return Err(MmapError::Filesystem { magic });
        }
        if fs.filesystem_type() == HUGETLBFS_MAGIC {
            // hugetlbfs reports its huge page size as the block size.
            let page_size = u64::try_from(fs.block_size()).unwrap_or(PAGE_SIZE).max(PAGE_SIZE);
            Ok(Backing { page_size, hugetlb: true })
        } else {
            Ok(Backing { page_size: PAGE_SIZE, hugetlb: false })
        }
    }

    /// The memory, holding `charge` until it is unmapped.
    pub(crate) fn charged(mut self, charge: SpaceCharge) -> Self {
        self._charge = Some(charge);
        self
    }

    #[inline]
    pub(crate) fn backing(&self) -> Backing {
        self.backing
    }

    /// True once an access faulted past the end of the file: the client shrank it, and the
    /// mapping now holds zero pages.
    #[inline]
    pub(crate) fn poisoned(&self) -> bool {
        // The process-wide flag first: it spares the load of this mapping's own, which sits
        // in an allocation of its own.
        crate::sigbus::ever_poisoned() && self.poisoned.load(Ordering::Acquire)
    }

    /// Host address of byte `offset` of the mapping.
    #[inline]
    pub(crate) fn addr_at(&self, offset: u64) -> usize {
        debug_assert!(offset <= self.len as u64);
        self.addr.as_ptr() as usize + offset as usize
    }

    /// mlock's `[offset, offset + len)` of the mapping: faults the pages in and keeps them
    /// resident until [`HostMemory::munlock`].
    pub(crate) fn mlock(&self, offset: u64, len: u64) -> io::Result<()> {
        let (addr, len) = self.subrange(offset, len);
        // SAFETY: (I13) the range lies inside this live mapping (checked by subrange); mlock only
        // changes residency, never contents or validity.
        unsafe { mman::mlock(addr, len) }.map_err(io::Error::from)
    }

    /// Undoes [`HostMemory::mlock`] on `[offset, offset + len)`.
    pub(crate) fn munlock(&self, offset: u64, len: u64) -> io::Result<()> {
        let (addr, len) = self.subrange(offset, len);
        // SAFETY: (I13) as for mlock: the range is inside this live mapping.
        unsafe { mman::munlock(addr, len) }.map_err(io::Error::from)
    }

    fn subrange(&self, offset: u64, len: u64) -> (NonNull<libc::c_void>, usize) {
        assert!(
            offset.checked_add(len).is_some_and(|end| end <= self.len as u64),
            "lock range {offset:#x}+{len:#x} outside a mapping of {:#x} bytes",
            self.len
        );
        // SAFETY: (local) the assert above keeps offset <= len of a mapping that starts at a
        // non-null address, so the sum is non-null and inside the mapping or one past its end.
        let addr = unsafe { NonNull::new_unchecked(self.addr.as_ptr().add(offset as usize)) };
        (addr.cast(), len as usize)
    }
}

impl Drop for HostMemory {
    fn drop(&mut self) {
        sigbus::unregister(self.addr.as_ptr() as usize);
        // SAFETY: (I13) we own this mapping; the engine drops HostMemory only when no pin can reach
        // it (guards hold the mapping alive; leaked pins keep it alive forever).
        if let Err(e) = unsafe { mman::munmap(self.addr.cast(), self.len) } {
            log::error!("munmap of {:#x} bytes at {:p} failed: {e}", self.len, self.addr);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testutil::memfd;
    use std::os::fd::{AsFd, AsRawFd};

    #[test]
    #[cfg_attr(miri, ignore = "Miri: maps no file")]
    fn maps_and_shares_memory() {
        let file = memfd(2);
        let mem = HostMemory::map(file.as_fd(), PAGE_SIZE, PAGE_SIZE, Prot::READ_WRITE).unwrap();
        assert!(!mem.backing().hugetlb);
        // SAFETY: (I13) the address is inside the live, writable mapping.
        unsafe { *(mem.addr_at(8) as *mut u8) = 0xab };
        let mut buf = [0u8; 1];
        std::os::unix::fs::FileExt::read_exact_at(&file, &mut buf, PAGE_SIZE + 8).unwrap();
        assert_eq!(buf[0], 0xab);
        mem.mlock(0, PAGE_SIZE).unwrap();
        mem.munlock(0, PAGE_SIZE).unwrap();
    }

    #[test]
    #[cfg_attr(miri, ignore = "Miri: maps no file")]
    fn rejects_past_eof_and_non_files() {
        let file = memfd(1);
        let err = HostMemory::map(file.as_fd(), PAGE_SIZE, PAGE_SIZE, Prot::READ).unwrap_err();
        assert!(matches!(err, MmapError::PastEndOfFile { .. }), "{err}");
        let err = HostMemory::map(file.as_fd(), u64::MAX - 4095, PAGE_SIZE, Prot::READ).unwrap_err();
        assert!(matches!(err, MmapError::PastEndOfFile { .. }), "{err}");
        let (r, _w) = nix::unistd::pipe().unwrap();
        let err = HostMemory::map(r.as_fd(), 0, PAGE_SIZE, Prot::READ).unwrap_err();
        assert!(matches!(err, MmapError::NotRegularFile { .. }), "{err}");
    }

    /// A file on a file system outside the list is refused from the mount table, before any
    /// `fstat` or `fstatfs` could ask that file system (procfs stands in for FUSE here: a
    /// test cannot count on mounting FUSE).
    #[test]
    #[cfg(not(miri))]
    fn a_file_on_another_file_system_is_refused_by_its_mount() {
        let file = std::fs::File::open("/proc/self/status").unwrap();
        let err = HostMemory::map(file.as_fd(), 0, PAGE_SIZE, Prot::READ).unwrap_err();
        assert!(matches!(&err, MmapError::Mount { fstype } if fstype == "proc"), "{err}");
        // A device node: on devtmpfs, refused by its mount; where /dev is a tmpfs (a
        // container's), for not being a regular file.
        let null = std::fs::File::open("/dev/null").unwrap();
        let err = HostMemory::map(null.as_fd(), 0, PAGE_SIZE, Prot::READ).unwrap_err();
        assert!(
            matches!(&err, MmapError::Mount { fstype } if fstype == "devtmpfs")
                || matches!(err, MmapError::NotRegularFile { .. }),
            "{err}"
        );
        // A file on a disk file system (the temporary directory's, if it is one) is mapped.
        let path = std::env::temp_dir().join(format!("umdev-mmap-local-{}", std::process::id()));
        std::fs::write(&path, vec![0u8; PAGE_SIZE as usize]).unwrap();
        let file = std::fs::File::open(&path).unwrap();
        std::fs::remove_file(&path).unwrap();
        match HostMemory::map(file.as_fd(), 0, PAGE_SIZE, Prot::READ) {
            Ok(_) => {}
            Err(MmapError::Mount { fstype }) => {
                assert!(!MEMORY_FILESYSTEM_NAMES.contains(&fstype.as_str()), "{fstype} is listed")
            }
            Err(e) => panic!("{e}"),
        }
    }

    /// A file opened through another mount namespace's mount (the client's, where the server
    /// runs in one of its own) is not in this process's table by its mount id: it is known by
    /// the client's table, and else by its device's file system in this one. Needs root and
    /// util-linux's `unshare`; says so otherwise.
    #[test]
    #[cfg(not(miri))]
    fn a_file_of_another_mount_namespace_is_known_by_the_clients_table_or_its_device() {
        // The workspace's build directory: on the disk, where a temporary directory may be a
        // tmpfs (a memory file, known without any table).
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../target");
        let path = dir.join(format!("umdev-mmap-ns-{}", std::process::id()));
        if let Err(e) =
            std::fs::create_dir_all(&dir).and_then(|()| std::fs::write(&path, vec![0u8; PAGE_SIZE as usize]))
        {
            return eprintln!("skipped: cannot write {}: {e}", path.display());
        }
        let child = std::process::Command::new("unshare")
            .args([
                "--mount",
                "--propagation",
                "private",
                "sh",
                "-c",
                "exec 3<\"$0\"; echo ready; exec sleep 60",
            ])
            .arg(&path)
            .stdout(std::process::Stdio::piped())
            .spawn();
        let Ok(mut child) = child else {
            std::fs::remove_file(&path).unwrap();
            return eprintln!("skipped: no unshare");
        };
        let mut line = String::new();
        let ready = std::io::BufRead::read_line(
            &mut std::io::BufReader::new(child.stdout.take().unwrap()),
            &mut line,
        );
        let file = std::fs::File::open(format!("/proc/{}/fd/3", child.id()));
        let ours = std::fs::File::open(&path).unwrap();
        let (Ok(_), true, Ok(file)) = (ready, line.trim() == "ready", file) else {
            let _ = child.kill();
            let _ = child.wait();
            std::fs::remove_file(&path).unwrap();
            return eprintln!("skipped: no mount namespace (needs root)");
        };
        let table = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
        let mount_of = |f: &std::fs::File| -> u64 {
            let fdinfo = std::fs::read_to_string(format!("/proc/self/fdinfo/{}", f.as_raw_fd())).unwrap();
            fdinfo.lines().find_map(|l| l.strip_prefix("mnt_id:")).unwrap().trim().parse().unwrap()
        };
        assert_eq!(
            mount_fstype(&table, mount_of(&file)),
            None,
            "the other namespace's mount is not in this table"
        );
        // What the same file is on through this namespace's mount.
        let want = mount_fstype(&table, mount_of(&ours)).unwrap().to_string();
        let listed = MEMORY_FILESYSTEM_NAMES.contains(&want.as_str());
        // By the client's table.
        let pid = i32::try_from(child.id()).unwrap();
        let by_table = HostMemory::map_from(file.as_fd(), 0, PAGE_SIZE, Prot::READ, Some(pid));
        // By the device, without the client's table.
        let by_device = HostMemory::map(file.as_fd(), 0, PAGE_SIZE, Prot::READ);
        let _ = child.kill();
        let _ = child.wait();
        std::fs::remove_file(&path).unwrap();
        match by_table {
            Ok(_) => assert!(listed, "mapped from {want}"),
            Err(MmapError::Mount { fstype }) => assert_eq!(fstype, want, "known by the client's table"),
            Err(e) => panic!("{e}"),
        }
        match by_device {
            Ok(_) => assert!(listed, "mapped from {want}"),
            // Btrfs shows its files' subvolume device, not its superblock's.
            Err(MmapError::Mount { fstype }) if want == "btrfs" => {
                assert_eq!(fstype, "a mount outside this process's mount table")
            }
            Err(MmapError::Mount { fstype }) => assert_eq!(fstype, want, "known by its device"),
            Err(e) => panic!("{e}"),
        }
    }

    #[test]
    #[cfg(not(miri))]
    fn the_mount_table_gives_each_mount_its_type() {
        let table = "22 1 0:21 / /proc rw,nosuid shared:5 - proc proc rw\n\
                     1 0 252:0 / / rw,relatime shared:1 master:2 - ext4 /dev/vda rw\n\
                     90 22 0:50 / /mnt/f rw - fuse.sshfs host:/ rw,user_id=0\n";
        assert_eq!(mount_fstype(table, 22), Some("proc"));
        assert_eq!(mount_fstype(table, 1), Some("ext4"));
        assert_eq!(mount_fstype(table, 90), Some("fuse.sshfs"));
        assert_eq!(mount_fstype(table, 2), None);
        assert_eq!(mount_fstype("3 1 0:1 / / rw\n", 3), None, "a line without its separator");
        // By device, for a mount of another namespace.
        assert_eq!(device_fstype(table, 252, 0), Some("ext4"));
        assert_eq!(device_fstype(table, 0, 50), Some("fuse.sshfs"));
        assert_eq!(device_fstype(table, 0, 5), None);
    }

    #[test]
    #[cfg_attr(miri, ignore = "Miri: maps no file")]
    fn write_only_fd_cannot_be_mapped_shared_writable() {
        let path = std::env::temp_dir().join(format!("umdev-mmap-wo-{}", std::process::id()));
        std::fs::write(&path, vec![0u8; PAGE_SIZE as usize]).unwrap();
        let file = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
        std::fs::remove_file(&path).unwrap();
        let err = HostMemory::map(file.as_fd(), 0, PAGE_SIZE, Prot::READ_WRITE).unwrap_err();
        assert!(matches!(err, MmapError::Mmap(_)), "{err}");
    }
}
