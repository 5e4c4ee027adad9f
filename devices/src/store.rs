//! Backing stores for block devices: bytes addressed by position, on a RAM disk (a sparse
//! memfd) or on a host file or block device, moved with vectors of guest memory.
//!
//! A device pins the guest pages of a transfer and hands the store their host slices (one
//! per contiguous run): a file or block device is read and written with one
//! `preadv2`/`pwritev2` per call, straight between the page cache and guest memory, with no
//! bounce buffer; a RAM disk is mmapped and each slice is one copy (writes with streaming
//! stores that bypass the cache: written blocks are rarely read back soon). The ccw and nvme
//! devices use it.
//!
//! A file store has a cache mode ([`Cache`]): through the host's page cache, or O_DIRECT
//! (straight between the device and guest memory), where a transfer not aligned as the host
//! needs goes through the page cache instead ([`Store::direct_fits`]).
//!
//! What it is not: a cache or an I/O scheduler. Calls are synchronous on the caller's
//! thread ([`crate::aio`] moves a file store's data asynchronously); durability is the host's
//! (`flush` is `fdatasync`).

use std::fs::File;
use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd};
use std::os::unix::fs::{FileExt, FileTypeExt, MetadataExt, OpenOptionsExt};
use std::path::Path;

use vm_memory::mmap::MmapRegion;
use vm_memory::{FileOffset, VolatileMemory, VolatileSlice};

/// Bytes of a huge page ([`Store::ram_huge`]).
pub const HUGE_PAGE: u64 = 2 << 20;

/// Slices per `preadv2`/`pwritev2` (the kernel's `UIO_MAXIOV`).
const MAX_IOV: usize = 1024;

/// What holds a store's bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StoreKind {
    /// A sparse memfd, mmapped: gone when the store is.
    Ram,
    /// A regular host file, read and written in place.
    File,
    /// A host block device.
    BlockDevice,
}

/// How a write reaches the store.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Durability {
    /// Into the host's page cache (a volatile write cache: `flush` makes it durable).
    Cached,
    /// Durable before the call returns (`RWF_DSYNC`): forced unit access.
    Sync,
}

/// How a file store uses the host's page cache.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Cache {
    /// Through the page cache: reads may hit it, writes land in it and are durable after a
    /// flush (or at once when asked: [`Durability::Sync`]).
    #[default]
    Writeback,
    /// O_DIRECT: straight between the device and the memory, bypassing the page cache (a
    /// write is still in the device's own volatile cache until a flush). A transfer whose
    /// position, lengths or memory are not aligned as the host needs
    /// ([`Store::direct_fits`]) goes through the page cache instead.
    None,
}

impl Cache {
    /// The option's spelling (`writeback`, `none`), as QEMU's `cache=` spells the same modes.
    pub fn name(self) -> &'static str {
        match self {
            Cache::Writeback => "writeback",
            Cache::None => "none",
        }
    }
}

/// A file store's O_DIRECT side: its own descriptor of the file, and what the host needs of
/// a transfer on it.
#[derive(Debug)]
struct Direct {
    file: File,
    /// Memory addresses are multiples of this.
    mem_align: u64,
    /// Positions and lengths (of the whole and of each piece) are multiples of this.
    offset_align: u64,
}

/// Bytes of a store, addressed by position.
#[derive(Debug)]
pub struct Store {
    /// Through the page cache (every file store has it: a transfer O_DIRECT cannot take
    /// goes here, and `flush` syncs the file through it).
    file: File,
    /// `cache=none`: O_DIRECT.
    direct: Option<Direct>,
    kind: StoreKind,
    size: u64,
    /// The unit the host zeroes in: a block device's logical block (1 for anything else).
    sector: u64,
    /// The RAM disk's mapping.
    ram: Option<MmapRegion>,
    /// A RAM disk on huge pages: its pages were reserved from the pool when it was mapped and
    /// are never given back while it lives (a hole punched in it would give them back, and a
    /// write there could then find the pool empty: a SIGBUS, not an error).
    huge: bool,
    /// A file store's hold on its file ([`Store::open_with`]): an open file of its own that
    /// no io_uring is given, so that dropping the store lets go of the file at once (a
    /// ring's files are let go by the kernel later, after the ring is closed). A block
    /// device is zeroed through it ([`Store::write_zeroes`]).
    hold: Option<File>,
}

impl Store {
    /// A zero-filled RAM disk of `size` bytes (sparse: memory is used as it is written).
    pub fn ram(size: u64) -> io::Result<Store> {
        Self::ram_in(size, false)
    }

    /// As [`Store::ram`], on 2 MiB huge pages from the host's hugetlb pool (`size` a multiple
    /// of 2 MiB): a first write costs one page fault per 2 MiB instead of one per 4 KiB, and
    /// the TLB holds the disk in 512 times fewer entries. The pages are reserved from the pool
    /// when the disk is mapped (a shared hugetlb mapping reserves them), so this fails with
    /// ENOMEM when the pool is too small rather than a write faulting later.
    pub fn ram_huge(size: u64) -> io::Result<Store> {
        if !size.is_multiple_of(HUGE_PAGE) {
            return Err(invalid("a huge-page RAM disk must be a multiple of 2 MiB"));
        }
        Self::ram_in(size, true)
    }

    fn ram_in(size: u64, huge: bool) -> io::Result<Store> {
        use nix::sys::memfd::MFdFlags;
        let flags = if huge {
            MFdFlags::MFD_CLOEXEC | MFdFlags::MFD_HUGETLB | MFdFlags::MFD_HUGE_2MB
        } else {
            MFdFlags::MFD_CLOEXEC
        };
        let fd = nix::sys::memfd::memfd_create(c"umdev-store", flags)?;
        let file = File::from(fd);
        file.set_len(size)?;
        let len = usize::try_from(size).map_err(|_| invalid("store too large"))?;
        if len == 0 {
            return Err(invalid("a store of 0 bytes"));
        }
        // A huge-page disk is mapped without MAP_NORESERVE (which `MmapRegion::from_file`
        // sets): the mapping then reserves the pages from the pool, or fails with ENOMEM, where
        // an unreserved one would raise SIGBUS at the first write the pool cannot serve. Its
        // pages are all the disk's from the start, so they are faulted in (and zeroed) here,
        // once, rather than by the first command to touch each: no command waits for a 2 MiB
        // page to be zeroed.
        let flags =
            if huge { libc::MAP_SHARED | libc::MAP_POPULATE } else { libc::MAP_SHARED | libc::MAP_NORESERVE };
        let offset = FileOffset::new(file.try_clone()?, 0);
        let region = MmapRegion::build(Some(offset), len, libc::PROT_READ | libc::PROT_WRITE, flags)
            .map_err(|e| match e {
                vm_memory::mmap::MmapRegionError::Mmap(e) => e,
                e => io::Error::other(e),
            })?;
        Ok(Store {
            file,
            direct: None,
            kind: StoreKind::Ram,
            size,
            sector: 1,
            ram: Some(region),
            huge,
            hold: None,
        })
    }

    /// The regular file or block device at `path`, read and written in place through the
    /// page cache; its size is the store's. The store has it to itself while it lives (see
    /// [`Store::open_with`]).
    pub fn open(path: &Path) -> io::Result<Store> {
        Self::open_with(path, Cache::Writeback)
    }

    /// As [`Store::open`], in cache mode `cache`. With [`Cache::None`] the file is also
    /// opened O_DIRECT, which fails if the host's filesystem cannot do it.
    ///
    /// The store takes the file for its own, so that no two writers (two stores, another
    /// umdev, QEMU) corrupt it: a block device is claimed exclusively (`O_EXCL`: refused
    /// while it is mounted or another program claims it), a regular file with an
    /// open-file-description write lock on all of it (refused while another program holds
    /// any lock on it, as QEMU does on its images). A filesystem without such locks is
    /// used unlocked, with a warning. A read-only block device is refused.
    pub fn open_with(path: &Path, cache: Cache) -> io::Result<Store> {
        let hold = hold(path)?;
        let file = std::fs::OpenOptions::new().read(true).write(true).open(path)?;
        let held = hold.metadata()?;
        // Each later open of `path` must find the file held, not one put there since.
        let same = |opened: &File| -> io::Result<std::fs::Metadata> {
            let meta = opened.metadata()?;
            if (meta.dev(), meta.ino()) == (held.dev(), held.ino()) {
                Ok(meta)
            } else {
                Err(invalid("replaced while it was opened"))
            }
        };
        let meta = same(&file)?;
        let (kind, size, sector) = if meta.file_type().is_block_device() {
            let dev = umdev_mdev::backing::block_device(&file)?;
            if dev.read_only {
                return Err(io::Error::new(io::ErrorKind::PermissionDenied, "a read-only block device"));
            }
            (StoreKind::BlockDevice, dev.size, dev.logical_block)
        } else {
            (StoreKind::File, meta.len(), 1)
        };
        if size == 0 {
            return Err(invalid("the backing file is empty"));
        }
        let direct = match cache {
            Cache::Writeback => None,
            Cache::None => {
                let direct = Direct::open(path, kind, sector)?;
                same(&direct.file)?;
                Some(direct)
            }
        };
        Ok(Store { file, direct, kind, size, sector, ram: None, huge: false, hold: Some(hold) })
    }

    /// The cache mode (RAM stores: [`Cache::Writeback`], which they behave like).
    pub fn cache(&self) -> Cache {
        if self.direct.is_some() {
            Cache::None
        } else {
            Cache::Writeback
        }
    }

    /// With [`Cache::None`]: the alignment O_DIRECT needs of memory addresses and of positions
    /// and lengths, in bytes.
    pub fn direct_alignment(&self) -> Option<(u64, u64)> {
        self.direct.as_ref().map(|d| (d.mem_align, d.offset_align))
    }

    /// Whether a transfer at `pos` of `segments` ((host address, bytes) each) can go O_DIRECT:
    /// the store has it, and the position, every piece's address and length are aligned as
    /// the host needs. Otherwise it goes through the page cache.
    pub fn direct_fits(&self, pos: u64, segments: &[(usize, usize)]) -> bool {
        let Some(d) = &self.direct else { return false };
        pos.is_multiple_of(d.offset_align)
            && segments.iter().all(|&(addr, len)| {
                (addr as u64).is_multiple_of(d.mem_align) && (len as u64).is_multiple_of(d.offset_align)
            })
    }

    /// A file store's descriptor through the page cache (`None` for RAM).
    pub fn buffered_fd(&self) -> Option<BorrowedFd<'_>> {
        self.ram.is_none().then(|| self.file.as_fd())
    }

    /// A file store's O_DIRECT descriptor, with [`Cache::None`].
    pub fn direct_fd(&self) -> Option<BorrowedFd<'_>> {
        self.direct.as_ref().map(|d| d.file.as_fd())
    }

    /// Bytes in the store.
    pub fn size(&self) -> u64 {
        self.size
    }

    /// What holds the bytes.
    pub fn kind(&self) -> StoreKind {
        self.kind
    }

    fn check(&self, pos: u64, len: u64) -> io::Result<()> {
        match pos.checked_add(len) {
            Some(end) if end <= self.size => Ok(()),
            _ => Err(invalid("beyond the end of the store")),
        }
    }

    fn ram_slice(region: &MmapRegion, pos: u64, len: usize) -> io::Result<VolatileSlice<'_>> {
        region.get_slice(pos as usize, len).map_err(|_| invalid("beyond the end of the store"))
    }

    /// Reads the store from `pos` into `bufs`, in order, whole. A file that ends early
    /// (truncated under us) fails with `UnexpectedEof`.
    pub fn read_vectored(&self, pos: u64, bufs: &[VolatileSlice<'_>]) -> io::Result<()> {
        let total: u64 = bufs.iter().map(|b| b.len() as u64).sum();
        self.check(pos, total)?;
        if let Some(region) = &self.ram {
            let mut at = pos;
            for buf in bufs {
                prefetched_copy(&Self::ram_slice(region, at, buf.len())?, buf);
                at += buf.len() as u64;
            }
            return Ok(());
        }
        self.file_vectored(pos, bufs, Direction::Read, 0)
    }

    /// Asks the CPU to start loading the first page (at most) of `[pos, pos + len)` of a RAM
    /// store: a hint for a read that runs soon, so that its copy finds the lines on their way.
    /// Nothing is read or kept; a range past the store's end, or a store that is not RAM,
    /// gets nothing.
    pub fn prefetch(&self, pos: u64, len: usize) {
        if let Some(region) = &self.ram {
            let len = len.min(PREFETCH_HEAD);
            if self.check(pos, len as u64).is_ok() {
                if let Ok(slice) = Self::ram_slice(region, pos, len) {
                    prefetch_head(&slice, len);
                }
            }
        }
    }

    /// Writes `bufs`, in order, to the store from `pos`, whole; visible to other threads in
    /// order with what the caller does next.
    pub fn write_vectored(
        &self,
        pos: u64,
        bufs: &[VolatileSlice<'_>],
        durability: Durability,
    ) -> io::Result<()> {
        let written = self.write_vectored_unfenced(pos, bufs, durability);
        fence_writes();
        written
    }

    /// [`Store::write_vectored`] without its store fence: a RAM store's bytes may reach
    /// other threads after the caller's later stores, until the caller runs [`fence_writes`],
    /// which it must before it publishes the write. A fence right after the copy makes the
    /// thread's next store-to-load forward that fails (a load wider than the store it reads,
    /// a common pattern in moved values) wait for the whole copy to reach memory; a fence
    /// just before the publication leaves the copy that time to drain.
    pub fn write_vectored_unfenced(
        &self,
        pos: u64,
        bufs: &[VolatileSlice<'_>],
        durability: Durability,
    ) -> io::Result<()> {
        let total: u64 = bufs.iter().map(|b| b.len() as u64).sum();
        self.check(pos, total)?;
        if let Some(region) = &self.ram {
            // Before the copy: a slice that fails half-way leaves streamed bytes too.
            UNFENCED.set(true);
            let mut at = pos;
            for buf in bufs {
                stream_copy(&Self::ram_slice(region, at, buf.len())?, buf);
                at += buf.len() as u64;
            }
            return Ok(());
        }
        let flags = match durability {
            Durability::Cached => 0,
            Durability::Sync => libc::RWF_DSYNC,
        };
        self.file_vectored(pos, bufs, Direction::Write, flags)
    }

    /// A file's transfer: O_DIRECT if it fits ([`Store::direct_fits`]) and the kernel takes
    /// it, else through the page cache.
    fn file_vectored(
        &self,
        pos: u64,
        bufs: &[VolatileSlice<'_>],
        dir: Direction,
        flags: libc::c_int,
    ) -> io::Result<()> {
        if let Some(direct) = &self.direct {
            if self.direct_fits(pos, &segments(bufs)) {
                match vectored(&direct.file, pos, bufs, dir, flags) {
                    // Refused as misaligned after all (the host's alignment was guessed).
                    Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {}
                    done => return done,
                }
            }
        }
        vectored(&self.file, pos, bufs, dir, flags)
    }

    /// Reads `buf.len()` bytes at `pos` into a private buffer.
    pub fn read(&self, pos: u64, buf: &mut [u8]) -> io::Result<()> {
        self.check(pos, buf.len() as u64)?;
        match &self.ram {
            Some(region) => {
                Self::ram_slice(region, pos, buf.len())?.copy_to(buf);
                Ok(())
            }
            None => self.file.read_exact_at(buf, pos),
        }
    }

    /// Writes `data` at `pos` from a private buffer.
    pub fn write(&self, pos: u64, data: &[u8]) -> io::Result<()> {
        self.check(pos, data.len() as u64)?;
        match &self.ram {
            Some(region) => {
                Self::ram_slice(region, pos, data.len())?.copy_from(data);
                Ok(())
            }
            None => self.file.write_all_at(data, pos),
        }
    }

    /// Makes every completed write durable (`fdatasync`; nothing to do for RAM).
    pub fn flush(&self) -> io::Result<()> {
        match self.kind {
            StoreKind::Ram => Ok(()),
            StoreKind::File | StoreKind::BlockDevice => self.file.sync_data(),
        }
    }

    /// Zeroes `[pos, pos + len)`, giving the space back where the host can (a hole in a
    /// file or the memfd; on a block device a zero-out, which may unmap); reads return zeros
    /// after. Where the host cannot (no hole punching, or a block device's range not
    /// whole logical blocks of it), the zeros are written.
    pub fn write_zeroes(&self, pos: u64, len: u64) -> io::Result<()> {
        self.check(pos, len)?;
        if len == 0 {
            return Ok(());
        }
        if self.huge {
            return self.write_zeros_slowly(pos, len);
        }
        // A block device zeroes whole logical blocks of its own only (a 4 KiB-sector disk
        // under 512-byte namespace blocks): the rest, at either end, is written.
        let end = pos + len;
        let (first, last) = (pos.next_multiple_of(self.sector), end / self.sector * self.sector);
        if first >= last {
            return self.write_zeros_slowly(pos, len);
        }
        let mode = libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE;
        // On a block device through the open file that claims it: the kernel drops the range
        // from the device's page cache only for the claimant, and for anyone else (with
        // dirty pages there) refuses with EBUSY.
        let fd = self.hold.as_ref().filter(|_| self.kind == StoreKind::BlockDevice).unwrap_or(&self.file);
        // SAFETY: fallocate on an fd this store owns, with an in-range offset and length;
        // it touches no memory of ours.
        let rc = unsafe {
            libc::fallocate(fd.as_raw_fd(), mode, first as libc::off_t, (last - first) as libc::off_t)
        };
        if rc != 0 {
            let err = io::Error::last_os_error();
            return match err.raw_os_error() {
                // The filesystem cannot punch holes: write the zeros.
                Some(libc::EOPNOTSUPP) | Some(libc::ENOSYS) => self.write_zeros_slowly(pos, len),
                _ => Err(err),
            };
        }
        self.write_zeros_slowly(pos, first - pos)?;
        self.write_zeros_slowly(last, end - last)
    }

    fn write_zeros_slowly(&self, pos: u64, len: u64) -> io::Result<()> {
        static ZEROS: [u8; 64 << 10] = [0; 64 << 10];
        let mut done = 0;
        while done < len {
            let n = (len - done).min(ZEROS.len() as u64) as usize;
            self.write(pos + done, &ZEROS[..n])?;
            done += n as u64;
        }
        Ok(())
    }
}

/// A transfer's memory: (host address, bytes) per piece, in order.
pub type Segments = smallvec::SmallVec<[(usize, usize); 8]>;

/// (host address, bytes) of each slice, in order: a transfer's pieces as [`Store::direct_fits`]
/// and [`crate::aio::Request`] take them.
pub fn segments(bufs: &[VolatileSlice<'_>]) -> Segments {
    bufs.iter().filter(|b| !b.is_empty()).map(|b| (b.ptr_guard_mut().as_ptr() as usize, b.len())).collect()
}

impl Direct {
    /// `path` opened O_DIRECT, and what the host needs of a transfer on it: `statx`'s direct
    /// I/O alignment where the kernel reports it; otherwise the block device's logical block
    /// for both, or 4 KiB for both for a file (enough on every filesystem Linux has).
    fn open(path: &Path, kind: StoreKind, sector: u64) -> io::Result<Direct> {
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .custom_flags(libc::O_DIRECT)
            .open(path)
            .map_err(|e| io::Error::new(e.kind(), format!("cache=none needs O_DIRECT, which failed: {e}")))?;
        let (mem_align, offset_align) = match dio_alignment(&file)? {
            Some((0, _)) | Some((_, 0)) => {
                return Err(io::Error::new(
                    io::ErrorKind::Unsupported,
                    "cache=none: the host's filesystem does no direct I/O on this file (statx reports no alignment)",
                ))
            }
            Some(a) => a,
            None if kind == StoreKind::BlockDevice => (sector, sector),
            None => (4096, 4096),
        };
        Ok(Direct { file, mem_align, offset_align })
    }
}

/// `path` opened to be a store's for as long as the result is open ([`Store::open_with`]):
/// a block device claimed exclusively, a regular file under an open-file-description write
/// lock on all of it (which another program's lock on any byte of it refuses).
fn hold(path: &Path) -> io::Result<File> {
    let block = std::fs::metadata(path)?.file_type().is_block_device();
    let mut options = std::fs::OpenOptions::new();
    options.read(true).write(true);
    if block {
        options.custom_flags(libc::O_EXCL);
    }
    let file = options.open(path).map_err(|e| match e.raw_os_error() {
        Some(libc::EBUSY) => io::Error::new(
            e.kind(),
            "in use: mounted, or claimed by another program (a block device is had exclusively)",
        ),
        _ => e,
    })?;
    let meta = file.metadata()?;
    if meta.file_type().is_block_device() != block {
        return Err(invalid("replaced while it was opened"));
    }
    if !block && !meta.is_file() {
        return Err(invalid("not a regular file or a block device"));
    }
    if block {
        return Ok(file);
    }
    let whole = libc::flock {
        l_type: libc::F_WRLCK as libc::c_short,
        l_whence: libc::SEEK_SET as libc::c_short,
        l_start: 0,
        l_len: 0, // to the end, however far it grows
        l_pid: 0,
    };
    match nix::fcntl::fcntl(&file, nix::fcntl::FcntlArg::F_OFD_SETLK(&whole)) {
        Ok(_) => Ok(file),
        Err(nix::errno::Errno::EAGAIN | nix::errno::Errno::EACCES) => Err(io::Error::new(
            io::ErrorKind::ResourceBusy,
            "in use: a lock on it is held elsewhere (another namespace or device, another umdev, or QEMU)",
        )),
        Err(e) => {
            log::warn!(
                "a backing file cannot be locked ({e}): nothing keeps another program from writing it too"
            );
            Ok(file)
        }
    }
}

/// `statx`'s direct I/O alignment of `file` (memory, offset), if the kernel reports it.
fn dio_alignment(file: &File) -> io::Result<Option<(u64, u64)>> {
    // SAFETY: an all-zero statx is a valid value of the plain C struct.
    let mut stx: libc::statx = unsafe { std::mem::zeroed() };
    // SAFETY: statx of the fd itself (AT_EMPTY_PATH with an empty C string) writes only the
    // struct it is given.
    let rc = unsafe {
        libc::statx(file.as_raw_fd(), c"".as_ptr(), libc::AT_EMPTY_PATH, libc::STATX_DIOALIGN, &mut stx)
    };
    if rc != 0 {
        let e = io::Error::last_os_error();
        // No statx (an old kernel or a seccomp filter): fall back on the guesses.
        return if e.raw_os_error() == Some(libc::ENOSYS) { Ok(None) } else { Err(e) };
    }
    if stx.stx_mask & libc::STATX_DIOALIGN == 0 {
        return Ok(None);
    }
    Ok(Some((u64::from(stx.stx_dio_mem_align), u64::from(stx.stx_dio_offset_align))))
}

/// One vectored transfer between `file` at `pos` and `bufs`, whole (continued after short
/// calls).
fn vectored(
    file: &File,
    pos: u64,
    bufs: &[VolatileSlice<'_>],
    dir: Direction,
    flags: libc::c_int,
) -> io::Result<()> {
    let mut iov: smallvec::SmallVec<[libc::iovec; 16]> = bufs
        .iter()
        .filter(|b| !b.is_empty())
        .map(|b| libc::iovec { iov_base: b.ptr_guard_mut().as_ptr().cast(), iov_len: b.len() })
        .collect();
    let mut first = 0usize;
    let mut at = pos;
    while first < iov.len() {
        let batch = &iov[first..iov.len().min(first + MAX_IOV)];
        // SAFETY: every iovec describes a VolatileSlice the caller lends us for the call:
        // memory that stays mapped while the slices live (pinned guest pages, say), and
        // that the kernel reads (write) or writes (read) like DMA would. No Rust
        // reference to it exists.
        let n = unsafe {
            match dir {
                Direction::Read => libc::preadv2(
                    file.as_raw_fd(),
                    batch.as_ptr(),
                    batch.len() as libc::c_int,
                    at as libc::off_t,
                    flags,
                ),
                Direction::Write => libc::pwritev2(
                    file.as_raw_fd(),
                    batch.as_ptr(),
                    batch.len() as libc::c_int,
                    at as libc::off_t,
                    flags,
                ),
            }
        };
        if n < 0 {
            let err = io::Error::last_os_error();
            if err.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(err);
        }
        if n == 0 {
            return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "the backing file ended early"));
        }
        // Step over what moved: whole iovecs, then into a partly done one.
        let mut n = n as usize;
        at += n as u64;
        while n > 0 {
            let v = &mut iov[first];
            if n >= v.iov_len {
                n -= v.iov_len;
                first += 1;
            } else {
                // SAFETY: stays inside the iovec's buffer (n < iov_len).
                v.iov_base = unsafe { v.iov_base.cast::<u8>().add(n) }.cast();
                v.iov_len -= n;
                n = 0;
            }
        }
    }
    Ok(())
}

#[derive(Clone, Copy)]
enum Direction {
    Read,
    Write,
}

fn invalid(what: &str) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidInput, what.to_string())
}

/// How much of a read's source [`prefetched_copy`] asks for before it copies: a page.
const PREFETCH_HEAD: usize = 4096;

/// The longest copy [`prefetched_copy`] prefetches the head of.
const PREFETCH_MAX_COPY: usize = 4 * PREFETCH_HEAD;

/// Copies `src`, a RAM store's bytes, into `dst`, a short copy's first page's lines asked for
/// first. A read lands at a position of the store nobody touched lately, mostly not in any
/// cache: a copy alone has only as many of its lines in flight as the CPU's prefetcher
/// guesses, while 64 prefetches at once keep the memory busy from the first line (4 KiB
/// random reads by SPDK's initiator at QD32: 1.18x the plain copy). A long copy is a stream
/// that the CPU's prefetcher follows after a few lines, and often already follows from the
/// previous command's (a sequential read): there the 64 instructions only take the copy's
/// time (128 KiB sequential reads 1.03x without them, random ones level; asking a page ahead
/// all along was slower still: docs/benchmarks.md).
fn prefetched_copy(src: &VolatileSlice<'_>, dst: &VolatileSlice<'_>) {
    if src.len() <= PREFETCH_MAX_COPY {
        prefetch_head(src, PREFETCH_HEAD);
    }
    src.copy_to_volatile_slice(*dst);
}

/// Asks for the cache lines of the first `len` bytes of `slice` (all of it if shorter): a
/// hint, nothing is read or faulted.
#[inline]
fn prefetch_head(slice: &VolatileSlice<'_>, len: usize) {
    #[cfg(target_arch = "x86_64")]
    {
        let base = slice.ptr_guard();
        let len = len.min(slice.len());
        for off in (0..len).step_by(64) {
            // SAFETY: `off < len <= slice.len()`, so the pointer stays inside the slice's
            // mapping; a prefetch reads nothing and cannot fault.
            unsafe {
                std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(
                    base.as_ptr().add(off).cast::<i8>(),
                )
            };
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (slice, len);
}

thread_local! {
    /// This thread made RAM store writes ([`Store::write_vectored_unfenced`]) that no
    /// [`fence_writes`] has ordered yet.
    static UNFENCED: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Orders every RAM store write this thread made before (through
/// [`Store::write_vectored_unfenced`]) before its later stores: call it before publishing
/// those writes to another thread or to the host (an NVMe completion entry). An `sfence`
/// on x86-64, where the writes are streaming stores, which x86's ordering of stores does
/// not cover, and only if the thread made such writes since its last fence; nothing
/// elsewhere, where they are plain copies, ordered by the release that publishes them.
#[inline]
pub fn fence_writes() {
    if UNFENCED.replace(false) {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: a store fence has no preconditions.
        unsafe {
            std::arch::x86_64::_mm_sfence()
        };
    }
}

/// Whether this thread made RAM store writes that [`fence_writes`] has not ordered yet: a
/// caller that can publish several writes at once fences once for all of them.
#[inline]
pub fn writes_unfenced() -> bool {
    UNFENCED.get()
}

/// Copies `src` into `dst`, a RAM store's bytes, bypassing the cache where it can: a write
/// lands at a position nobody is likely to read soon, mostly not in cache, and streaming
/// stores spare reading each line in before overwriting it (a 4 KiB write to cold store
/// memory took ~500 ns so, ~800 ns as a cached copy, on the project's VM). The edges that
/// do not fill a 16-byte-aligned block are copied plainly.
fn stream_copy(dst: &VolatileSlice<'_>, src: &VolatileSlice<'_>) {
    let len = dst.len().min(src.len());
    #[cfg(target_arch = "x86_64")]
    {
        let (to, from) = (dst.ptr_guard_mut(), src.ptr_guard());
        let head = to.as_ptr().align_offset(16).min(len);
        let body = (len - head) / 64 * 64;
        if body > 0 {
            if let (Ok(d), Ok(s)) = (dst.subslice(0, head), src.subslice(0, head)) {
                s.copy_to_volatile_slice(d);
            }
            // SAFETY: both slices are valid for `len` bytes (vm-memory checked them when they
            // were made) and do not overlap (guest memory and the store are distinct
            // mappings); `to + head` is 16-byte aligned, as the streaming stores need, and
            // `head + body <= len`.
            unsafe { stream_blocks(to.as_ptr().add(head), from.as_ptr().add(head), body) };
            let done = head + body;
            if let (Ok(d), Ok(s)) = (dst.subslice(done, len - done), src.subslice(done, len - done)) {
                s.copy_to_volatile_slice(d);
            }
            return;
        }
    }
    src.copy_to_volatile_slice(*dst);
}

/// Copies `len` bytes (a multiple of 64) from `src` to the 16-byte-aligned `dst` with
/// non-temporal stores (SSE2, in every x86-64 CPU), not fenced: see [`fence_writes`].
///
/// # Safety
/// `src` must be readable and `dst` writable for `len` bytes, not overlapping; `dst` must be
/// 16-byte aligned.
#[cfg(target_arch = "x86_64")]
unsafe fn stream_blocks(dst: *mut u8, src: *const u8, len: usize) {
    use std::arch::x86_64::{__m128i, _mm_loadu_si128, _mm_stream_si128};
    let mut at = 0;
    while at < len {
        // SAFETY: `at + 64 <= len`, within both buffers (the caller's contract); the
        // stores are 16-byte aligned because `dst` is and `at` is a multiple of 64.
        unsafe {
            let (s, d) = (src.add(at).cast::<__m128i>(), dst.add(at).cast::<__m128i>());
            let block = [
                _mm_loadu_si128(s),
                _mm_loadu_si128(s.add(1)),
                _mm_loadu_si128(s.add(2)),
                _mm_loadu_si128(s.add(3)),
            ];
            for (k, v) in block.into_iter().enumerate() {
                _mm_stream_si128(d.add(k), v);
            }
        }
        at += 64;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn slices(buf: &mut [u8], cuts: &[usize]) -> Vec<VolatileSlice<'static>> {
        let mut out = Vec::new();
        let mut at = 0;
        for &n in cuts {
            // SAFETY: the test keeps `buf` alive (and unaliased) while the slices are used.
            out.push(unsafe { VolatileSlice::new(buf.as_mut_ptr().add(at), n) });
            at += n;
        }
        out
    }

    /// KiB of huge pages this process has faulted in for the mapping holding `addr`
    /// (/proc/self/smaps: its Shared_Hugetlb and Private_Hugetlb).
    fn hugetlb_kib_at(addr: usize) -> u64 {
        let smaps = std::fs::read_to_string("/proc/self/smaps").unwrap();
        let mut inside = false;
        let mut kib = 0;
        for line in smaps.lines() {
            let first = line.split_whitespace().next().unwrap_or("");
            if let Some((lo, hi)) = first.split_once('-').filter(|_| !first.ends_with(':')) {
                let range = usize::from_str_radix(lo, 16).ok().zip(usize::from_str_radix(hi, 16).ok());
                inside = range.is_some_and(|(lo, hi)| (lo..hi).contains(&addr));
            } else if inside && (first == "Shared_Hugetlb:" || first == "Private_Hugetlb:") {
                kib += line.split_whitespace().nth(1).and_then(|v| v.parse::<u64>().ok()).unwrap_or(0);
            }
        }
        kib
    }

    fn roundtrip(store: &Store) {
        let mut data: Vec<u8> = (0..20_000u32).map(|i| (i * 7) as u8).collect();
        let cuts = [100, 4096, 1, 8000, 20_000 - 12_197];
        store.write_vectored(3000, &slices(&mut data, &cuts), Durability::Cached).unwrap();
        let mut back = vec![0u8; 20_000];
        store.read_vectored(3000, &slices(&mut back, &[7, 19_993])).unwrap();
        assert_eq!(back, data);
        let mut one = [0u8; 4];
        store.read(2998, &mut one).unwrap();
        assert_eq!(one, [0, 0, 0, 7]);
        store.write_zeroes(4000, 5000).unwrap();
        store.read_vectored(3000, &slices(&mut back, &[20_000])).unwrap();
        assert!(back[1000..6000].iter().all(|&b| b == 0));
        assert_eq!(back[..1000], data[..1000]);
        assert_eq!(back[6000..], data[6000..]);
        store.flush().unwrap();
        // Past the end: refused, nothing moves.
        let end = store.size();
        assert!(store.read_vectored(end - 10, &slices(&mut back, &[11])).is_err());
        assert!(store.write_vectored(end, &slices(&mut data, &[1]), Durability::Sync).is_err());
        assert!(store.write_zeroes(u64::MAX, 2).is_err());
    }

    #[test]
    fn a_ram_store_write_lands_exactly_at_every_alignment_and_length() {
        // Streaming stores cover the 16-byte-aligned middle of a write; the edges are copied
        // plainly. Every split of head, body and tail, from either side's alignment.
        let store = Store::ram(64 << 10).unwrap();
        let mut src: Vec<u8> = (0..9000u32).map(|i| (i * 13 + 1) as u8).collect();
        for pos in [0u64, 1, 7, 15, 16, 17, 4095, 4096, 8191] {
            for src_off in [0usize, 1, 8, 15] {
                for len in [0usize, 1, 15, 16, 63, 64, 65, 127, 128, 200, 4096, 4099, 8000] {
                    let fill = [0xeeu8; 9000];
                    store.write(pos.saturating_sub(8), &fill[..(len + 16).min(9000)]).unwrap();
                    let piece = slices(&mut src[src_off..], &[len]);
                    store.write_vectored(pos, &piece, Durability::Cached).unwrap();
                    let around = pos.saturating_sub(8);
                    let mut back = vec![0u8; len + 16];
                    store.read(around, &mut back).unwrap();
                    let before = (pos - around) as usize;
                    assert!(back[..before].iter().all(|&b| b == 0xee), "pos {pos} off {src_off} len {len}");
                    assert_eq!(
                        back[before..before + len],
                        src[src_off..src_off + len],
                        "pos {pos} off {src_off} len {len}"
                    );
                    assert!(
                        back[before + len..].iter().all(|&b| b == 0xee),
                        "pos {pos} off {src_off} len {len}"
                    );
                }
            }
        }
    }

    #[test]
    fn unfenced_ram_writes_are_tracked_per_thread_until_a_fence() {
        let store = Store::ram(1 << 20).unwrap();
        let mut data = vec![7u8; 8192];
        fence_writes();
        assert!(!writes_unfenced());
        // A read streams nothing.
        store.read_vectored(0, &slices(&mut data, &[8192])).unwrap();
        assert!(!writes_unfenced());
        store.write_vectored_unfenced(4096, &slices(&mut data, &[4096]), Durability::Cached).unwrap();
        assert!(writes_unfenced());
        // Another thread's fence does not order this thread's writes.
        std::thread::spawn(|| {
            assert!(!writes_unfenced());
            fence_writes();
        })
        .join()
        .unwrap();
        assert!(writes_unfenced());
        fence_writes();
        assert!(!writes_unfenced());
        // The fenced form leaves nothing behind.
        store.write_vectored(0, &slices(&mut data, &[4096]), Durability::Cached).unwrap();
        assert!(!writes_unfenced());
    }

    #[test]
    fn a_ram_store_moves_vectors() {
        let store = Store::ram(1 << 20).unwrap();
        assert_eq!(store.kind(), StoreKind::Ram);
        roundtrip(&store);
    }

    #[test]
    fn a_file_store_moves_vectors_and_keeps_the_data() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("disk.img");
        File::create(&path).unwrap().set_len(1 << 20).unwrap();
        let store = Store::open(&path).unwrap();
        assert_eq!((store.kind(), store.size()), (StoreKind::File, 1 << 20));
        roundtrip(&store);
        drop(store);
        let bytes = std::fs::read(&path).unwrap();
        assert_eq!(bytes[3000], 0);
        assert_eq!(bytes[3001], 7);
        assert_eq!(bytes.len(), 1 << 20);
    }

    /// `len` bytes at a 4 KiB-aligned address (O_DIRECT's memory alignment here).
    struct Aligned(*mut u8, usize);

    impl Aligned {
        fn new(len: usize) -> Aligned {
            let layout = std::alloc::Layout::from_size_align(len, 4096).unwrap();
            // SAFETY: a non-zero size.
            Aligned(unsafe { std::alloc::alloc_zeroed(layout) }, len)
        }
        fn bytes(&mut self) -> &mut [u8] {
            // SAFETY: the allocation is `len` bytes and lives as long as `self`.
            unsafe { std::slice::from_raw_parts_mut(self.0, self.1) }
        }
    }

    impl Drop for Aligned {
        fn drop(&mut self) {
            // SAFETY: allocated in `new` with this layout.
            unsafe { std::alloc::dealloc(self.0, std::alloc::Layout::from_size_align(self.1, 4096).unwrap()) }
        }
    }

    #[test]
    fn a_direct_store_moves_aligned_transfers_straight_and_the_rest_through_the_page_cache() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("disk.img");
        File::create(&path).unwrap().set_len(1 << 20).unwrap();
        let store = match Store::open_with(&path, Cache::None) {
            Ok(s) => s,
            Err(e) => return eprintln!("SKIPPED: no O_DIRECT on {}: {e}", dir.path().display()),
        };
        assert_eq!(store.cache(), Cache::None);
        let (mem, offset) = store.direct_alignment().unwrap();
        assert!(mem.is_power_of_two() && offset.is_power_of_two() && offset <= 4096 && mem <= 4096);
        let mut buf = Aligned::new(3 * 4096);
        for (i, b) in buf.bytes().iter_mut().enumerate() {
            *b = (i * 31 + 7) as u8;
        }
        let data = buf.bytes().to_vec();
        // Aligned: straight; the odd slices: through the page cache. Both land.
        let whole = slices(buf.bytes(), &[8192, 4096]);
        assert!(store.direct_fits(8192, &segments(&whole)));
        store.write_vectored(8192, &whole, Durability::Sync).unwrap();
        let odd = slices(&mut buf.bytes()[1..], &[100]);
        assert!(!store.direct_fits(8192, &segments(&odd)));
        assert!(!store.direct_fits(8193, &segments(&whole[..1])));
        store.write_vectored(40_000, &odd, Durability::Cached).unwrap();
        let mut back = Aligned::new(3 * 4096);
        store.read_vectored(8192, &slices(back.bytes(), &[3 * 4096])).unwrap();
        assert_eq!(back.bytes(), &data[..]);
        let mut small = [0u8; 100];
        store.read(40_000, &mut small).unwrap();
        assert_eq!(small[..], data[1..101]);
        store.flush().unwrap();
        assert_eq!(std::fs::read(&path).unwrap()[8192..8192 + 3 * 4096], data[..]);
    }

    #[test]
    fn a_huge_page_ram_store_moves_vectors_or_is_refused_whole() {
        assert!(Store::ram_huge(HUGE_PAGE + 4096).is_err(), "not whole huge pages");
        // The pool may be empty on this host: then creation fails (the pages are reserved
        // when mapped), it never faults later.
        match Store::ram_huge(2 * HUGE_PAGE) {
            Ok(store) => {
                // Every page is in before the first write: no command waits for one.
                let at = store.ram.as_ref().unwrap().as_ptr() as usize;
                assert_eq!(hugetlb_kib_at(at), 2 * HUGE_PAGE / 1024, "both pages faulted in at creation");
                roundtrip(&store)
            }
            Err(e) => eprintln!("no 2 MiB page in the pool here ({e}): creation refused, as it should be"),
        }
        // One page more than the pool has free: refused at creation, whatever the pool holds.
        // A mapping that did not reserve would be made, and the write below that finds the
        // pool empty would raise SIGBUS (the test process dies: the test fails).
        let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap();
        let free: u64 = meminfo
            .lines()
            .find_map(|l| l.strip_prefix("HugePages_Free:"))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(0);
        if let Ok(store) = Store::ram_huge((free + 1) * HUGE_PAGE) {
            // Made only if pages were freed meanwhile (another process let go of some): then
            // every page of it is there.
            for page in 0..=free {
                store.write(page * HUGE_PAGE, &[1u8; 8]).unwrap();
            }
        }
    }

    #[test]
    fn an_empty_or_odd_file_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("empty");
        File::create(&path).unwrap();
        assert!(Store::open(&path).is_err());
        assert!(Store::open(dir.path()).is_err());
        assert!(Store::ram(0).is_err());
    }

    fn refused(opened: io::Result<Store>, what: &str) -> io::Error {
        match opened {
            Ok(_) => panic!("{what} was opened"),
            Err(e) => e,
        }
    }

    #[test]
    fn a_file_store_has_its_file_to_itself_until_it_is_dropped() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("disk.img");
        File::create(&path).unwrap().set_len(1 << 20).unwrap();
        let first = Store::open(&path).unwrap();
        for cache in [Cache::Writeback, Cache::None] {
            let e = refused(Store::open_with(&path, cache), "a second store on the same file");
            assert_eq!(e.kind(), io::ErrorKind::ResourceBusy, "{e}");
        }
        // Through another name of it as well.
        let link = dir.path().join("link.img");
        std::os::unix::fs::symlink(&path, &link).unwrap();
        assert!(Store::open(&link).is_err());
        drop(first);
        let again = Store::open(&link).unwrap();
        // Another program's lock (QEMU takes read locks on bytes of its images) keeps it too.
        drop(again);
        let other = File::open(&path).unwrap();
        let read = libc::flock {
            l_type: libc::F_RDLCK as libc::c_short,
            l_whence: libc::SEEK_SET as libc::c_short,
            l_start: 100,
            l_len: 1,
            l_pid: 0,
        };
        nix::fcntl::fcntl(&other, nix::fcntl::FcntlArg::F_OFD_SETLK(&read)).unwrap();
        assert_eq!(Store::open(&path).err().unwrap().kind(), io::ErrorKind::ResourceBusy);
    }

    #[test]
    fn a_block_device_store_claims_it_and_refuses_one_set_read_only() {
        use umdev_testkit::loop_device::LoopDevice;
        let Some(lo) = LoopDevice::new(1 << 20, &[]) else { return };
        let first = Store::open(lo.path()).unwrap();
        assert_eq!((first.kind(), first.size()), (StoreKind::BlockDevice, 1 << 20));
        let e = refused(Store::open(lo.path()), "a second store on the same device");
        assert!(e.to_string().contains("in use"), "{e}");
        drop(first);
        Store::open_with(lo.path(), Cache::None).unwrap();
        let Some(ro) = LoopDevice::new(1 << 20, &["--read-only"]) else { return };
        let e = refused(Store::open(ro.path()), "a read-only device");
        assert!(e.to_string().contains("read-only"), "{e}");
        let e = umdev_mdev::backing::check(ro.path(), 4096).unwrap_err();
        assert!(e.contains("read-only block device"), "{e}");
        assert_eq!(umdev_mdev::backing::check(lo.path(), 4096), Ok(()));
        let e = umdev_mdev::backing::check(lo.path(), 2 << 20).unwrap_err();
        assert!(e.ends_with("1048576 bytes; a store has at least 2097152"), "{e}");
    }

    #[test]
    fn zeroes_on_a_block_device_need_not_be_whole_blocks_of_it() {
        use umdev_testkit::loop_device::LoopDevice;
        let Some(lo) = LoopDevice::new(1 << 20, &["--sector-size", "4096"]) else { return };
        let store = Store::open(lo.path()).unwrap();
        store.write(0, &[0xa5; 16384]).unwrap();
        // 512-byte blocks of a 4 KiB-sector disk: within one sector, and across two whole
        // ones with parts of sectors at both ends.
        for (from, to) in [(1536, 3584), (5632, 14848)] {
            store.write_zeroes(from, to - from).unwrap();
        }
        let mut back = vec![0u8; 16384];
        store.read(0, &mut back).unwrap();
        let zero = |at: usize| (1536..3584).contains(&at) || (5632..14848).contains(&at);
        assert!(back.iter().enumerate().all(|(at, &b)| b == if zero(at) { 0 } else { 0xa5 }));
    }
}
