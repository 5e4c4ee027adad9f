//! Backing stores for block devices: bytes addressed by position, on a RAM disk (sparse
//! memory of the process, or a hugetlb memfd) or on a host file or block device, moved with
//! vectors of guest memory.
//!
//! A device pins the guest pages of a transfer and hands the store their host slices (one
//! per contiguous run): a file or block device is read and written with one
//! `preadv2`/`pwritev2` per call, straight between the page cache and guest memory, with no
//! bounce buffer; a RAM disk is mapped and each slice is one copy (writes with streaming
//! stores that bypass the cache, written blocks being rarely read back soon, except the
//! first writes to memory the kernel has just zeroed: [`RamPages`]). The ccw and nvme
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
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::Arc;

use umdev_mdev::sync::AtomicUpdate;
use vm_memory::mmap::MmapRegion;
use vm_memory::{FileOffset, VolatileMemory, VolatileSlice};

use crate::populate::{Budget, Populater};

/// Bytes of a huge page ([`Store::ram_huge`]).
pub const HUGE_PAGE: u64 = 2 << 20;

/// Slices per `preadv2`/`pwritev2` (the kernel's `UIO_MAXIOV`).
const MAX_IOV: usize = 1024;

/// What holds a store's bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StoreKind {
    /// Memory of the process (anonymous or a memfd), mapped: gone when the store is.
    Ram,
    /// A regular host file, read and written in place.
    File,
    /// A host block device.
    BlockDevice,
}

/// What pages a RAM disk is made of ([`Store::ram_with`]).
///
/// On sparse pages (transparent and small), the kernel zeroes a page at its first write, with
/// cached stores; the first 2 MiB of writes to each 2 MiB of the disk are then copied plainly,
/// over lines likely still in the cache, and later writes with streaming stores. A sparse
/// disk's memory may also be taken ahead of its writes ([`Store::populate`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum RamPages {
    /// Anonymous memory on transparent huge pages where the host gives them
    /// (`/sys/kernel/mm/transparent_hugepage/enabled` is `always` or `madvise`), 4 KiB pages
    /// elsewhere: taken as written, 2 MiB at a time, each zeroed by the kernel at its first
    /// write; the TLB holds the disk in up to 512 times fewer entries than with 4 KiB pages.
    #[default]
    Transparent,
    /// A sparse memfd of 4 KiB pages: taken as written, 4 KiB at a time (a disk written
    /// sparsely in small pieces takes no more than it holds), one page fault per 4 KiB.
    Small,
    /// 2 MiB pages from the host's hugetlb pool, all reserved and zeroed when the disk is
    /// made (see [`Store::ram_huge`]).
    Huge,
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

/// A RAM disk's memory.
#[derive(Debug)]
struct Ram {
    region: MmapRegion,
    /// On huge pages, the pages were reserved from the pool when it was mapped and are never
    /// given back while it lives (a hole punched in it would give them back, and a write
    /// there could then find the pool empty: a SIGBUS, not an error).
    pages: RamPages,
    /// A sparse disk's first writes ([`Ram::first_writes`]): per 2 MiB of it, the bytes
    /// written since it was last empty, counted up to 2 MiB (empty on huge pages).
    filling: Arc<[AtomicU32]>,
    /// The pass taking a sparse disk's memory ahead of its writes, if one was started
    /// ([`Store::populate`]).
    populater: Option<Populater>,
}

impl Drop for Ram {
    fn drop(&mut self) {
        // Before `region` is unmapped: the pass's thread faults pages of it in.
        self.populater.take();
    }
}

impl Ram {
    /// Whether `[pos, pos + len)` of a sparse disk starts in a 2 MiB piece that has taken
    /// less than 2 MiB of writes since it was last empty, counting these bytes in each piece
    /// they fall in (a copy is plain or streamed whole, as its first piece says). Such a
    /// piece's pages were (or are about to be) zeroed by the kernel at their first write,
    /// with cached stores, so their lines are likely in the cache, where a plain copy
    /// overwrites them and streaming stores would first have to push them out (a first fill
    /// of 1 GiB on transparent huge pages: 7.3 GB/s plainly, 4.5 streamed;
    /// docs/benchmarks.md). Once a piece is full, its writes stream. The count is a hint,
    /// updated without ordering: a race costs speed, never bytes.
    fn first_writes(&self, pos: u64, len: u64) -> bool {
        const FULL: u32 = HUGE_PAGE as u32;
        let mut first = None;
        let (mut at, end) = (pos, pos.saturating_add(len));
        while let Some(count) = self.filling.get((at / HUGE_PAGE) as usize) {
            // At most 2 MiB per piece (n <= HUGE_PAGE), so a count cannot wrap.
            let n = ((at / HUGE_PAGE + 1) * HUGE_PAGE).min(end).saturating_sub(at);
            let filling = count.load(Ordering::Relaxed) < FULL;
            if filling {
                let _ = count.update_with(Ordering::Relaxed, Ordering::Relaxed, |c| {
                    (c < FULL).then(|| c.saturating_add(n as u32).min(FULL))
                });
            }
            first.get_or_insert(filling);
            at += n;
            if n == 0 || at >= end {
                break;
            }
        }
        first.unwrap_or(false)
    }

    /// `[first, last)` of a sparse disk of `size` bytes was given back: its whole 2 MiB pieces
    /// are empty again, and their next writes first writes ([`Ram::first_writes`]).
    fn emptied(&self, first: u64, last: u64, size: u64) {
        // A piece counts if all of it that is in the disk was given back (the last may be
        // short).
        let mut piece = first.div_ceil(HUGE_PAGE);
        loop {
            let start = piece.saturating_mul(HUGE_PAGE);
            if start >= last || start.saturating_add(HUGE_PAGE).min(size) > last {
                return;
            }
            if let Some(count) = self.filling.get(piece as usize) {
                count.store(0, Ordering::Relaxed);
            }
            piece += 1;
        }
    }
}

/// Bytes of a store, addressed by position.
#[derive(Debug)]
pub struct Store {
    /// Through the page cache (every file store has it: a transfer O_DIRECT cannot take
    /// goes here, and `flush` syncs the file through it); a memfd RAM disk's memfd; `None`
    /// for an anonymous RAM disk.
    file: Option<File>,
    /// `cache=none`: O_DIRECT.
    direct: Option<Direct>,
    kind: StoreKind,
    size: u64,
    /// The unit the host zeroes in: a block device's logical block (1 for anything else).
    sector: u64,
    /// A RAM disk's memory.
    ram: Option<Ram>,
    /// A file store's hold on its file ([`Store::open_with`]): an open file of its own that
    /// no io_uring is given, so that dropping the store lets go of the file at once (a
    /// ring's files are let go by the kernel later, after the ring is closed). A block
    /// device is zeroed through it ([`Store::write_zeroes`]).
    hold: Option<File>,
    /// A write-back of the file failed ([`Store::lose_durability`]): the host reports such a
    /// failure once, to the first sync that looks, and cannot tell which cached writes it
    /// lost, so no write through the cache can be promised durable again (QEMU's answer too).
    durability_lost: AtomicBool,
}

impl Store {
    /// A zero-filled RAM disk of `size` bytes on transparent huge pages where the host gives
    /// them ([`RamPages::Transparent`]; sparse: memory is taken as it is written).
    pub fn ram(size: u64) -> io::Result<Store> {
        Self::ram_with(size, RamPages::Transparent)
    }

    /// As [`Store::ram`], on 2 MiB huge pages from the host's hugetlb pool (`size` a multiple
    /// of 2 MiB): a first write costs one page fault per 2 MiB instead of one per 4 KiB, and
    /// the TLB holds the disk in 512 times fewer entries. The pages are reserved from the pool
    /// when the disk is mapped (a shared hugetlb mapping reserves them), so this fails with
    /// ENOMEM when the pool is too small rather than a write faulting later.
    pub fn ram_huge(size: u64) -> io::Result<Store> {
        Self::ram_with(size, RamPages::Huge)
    }

    /// A zero-filled RAM disk of `size` bytes on `pages`.
    pub fn ram_with(size: u64, pages: RamPages) -> io::Result<Store> {
        let len = usize::try_from(size).map_err(|_| invalid("store too large"))?;
        if len == 0 {
            return Err(invalid("a store of 0 bytes"));
        }
        let (file, region) = match pages {
            RamPages::Transparent => (None, Self::map_anonymous(len)?),
            RamPages::Small => {
                let file = Self::memfd(size, false)?;
                // Sparse: the memfd takes no memory until a page is written.
                let flags = libc::MAP_SHARED | libc::MAP_NORESERVE;
                let region = Self::map_memfd(&file, len, flags)?;
                (Some(file), region)
            }
            RamPages::Huge => {
                if !size.is_multiple_of(HUGE_PAGE) {
                    return Err(invalid("a huge-page RAM disk must be a multiple of 2 MiB"));
                }
                let file = Self::memfd(size, true)?;
                // Mapped without MAP_NORESERVE (which `MmapRegion::from_file` sets): the
                // mapping then reserves the pages from the pool, or fails with ENOMEM, where an
                // unreserved one would raise SIGBUS at the first write the pool cannot serve.
                // Its pages are all the disk's from the start, so they are faulted in (and
                // zeroed) here, once, rather than by the first command to touch each: no
                // command waits for a 2 MiB page to be zeroed.
                let region = Self::map_memfd(&file, len, libc::MAP_SHARED | libc::MAP_POPULATE)?;
                (Some(file), region)
            }
        };
        let filling: Arc<[AtomicU32]> = match pages {
            RamPages::Huge => Arc::new([]),
            RamPages::Transparent | RamPages::Small => {
                (0..size.div_ceil(HUGE_PAGE)).map(|_| AtomicU32::new(0)).collect()
            }
        };
        Ok(Store {
            file,
            direct: None,
            kind: StoreKind::Ram,
            size,
            sector: 1,
            ram: Some(Ram { region, pages, filling, populater: None }),
            hold: None,
            durability_lost: Default::default(),
        })
    }

    fn memfd(size: u64, huge: bool) -> io::Result<File> {
        use nix::sys::memfd::MFdFlags;
        let flags = if huge {
            MFdFlags::MFD_CLOEXEC | MFdFlags::MFD_HUGETLB | MFdFlags::MFD_HUGE_2MB
        } else {
            MFdFlags::MFD_CLOEXEC
        };
        let file = File::from(nix::sys::memfd::memfd_create(c"umdev-store", flags)?);
        file.set_len(size)?;
        Ok(file)
    }

    fn map_memfd(file: &File, len: usize, flags: libc::c_int) -> io::Result<MmapRegion> {
        let offset = FileOffset::new(file.try_clone()?, 0);
        MmapRegion::build(Some(offset), len, libc::PROT_READ | libc::PROT_WRITE, flags).map_err(mmap_error)
    }

    /// Private anonymous memory, not reserved (`MAP_NORESERVE`: a disk may be larger than
    /// the host's memory, as a sparse file may), asked for on huge pages and kept out of any
    /// child the process forks (which would otherwise share it copy-on-write until it
    /// execs, and make the disk's next writes copy their pages). The mapping is a whole
    /// number of 2 MiB, which Linux (6.7 and later) places on a 2 MiB boundary: each 2 MiB of
    /// the disk is then one huge page, not parts of two. Its tail past `len` is never used.
    fn map_anonymous(len: usize) -> io::Result<MmapRegion> {
        let len =
            len.checked_next_multiple_of(HUGE_PAGE as usize).ok_or_else(|| invalid("store too large"))?;
        let flags = libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE;
        let region =
            MmapRegion::build(None, len, libc::PROT_READ | libc::PROT_WRITE, flags).map_err(mmap_error)?;
        // Both are hints: a kernel without transparent huge pages refuses MADV_HUGEPAGE
        // (EINVAL) and the disk is on 4 KiB pages; MADV_DONTFORK cannot fail on a private
        // anonymous mapping.
        for advice in [libc::MADV_HUGEPAGE, libc::MADV_DONTFORK] {
            // SAFETY: advice on the whole of a mapping this region owns; neither changes what
            // it holds nor unmaps any of it.
            let _ = unsafe { libc::madvise(region.as_ptr().cast(), len, advice) };
        }
        Ok(region)
    }

    /// Starts taking a sparse RAM disk's memory ahead of its writes, on a thread of its own
    /// ([`crate::populate`]), so that its first writes find their pages there (and stream,
    /// as later writes do). False where there is nothing to take: a file store, a disk on
    /// huge pages (taken whole when it was made), or one already started.
    pub fn populate(&mut self) -> io::Result<bool> {
        let Some(ram) = self.ram.as_mut() else { return Ok(false) };
        if ram.pages == RamPages::Huge || ram.populater.is_some() {
            return Ok(false);
        }
        let filling = ram.filling.clone();
        let taken = move |piece: usize| {
            if let Some(count) = filling.get(piece) {
                count.store(HUGE_PAGE as u32, Ordering::Relaxed);
            }
        };
        let len = usize::try_from(self.size).map_err(|_| invalid("store too large"))?;
        // SAFETY: `[as_ptr, as_ptr + size)` is this disk's mapping (private anonymous or a
        // shared memfd), which stays mapped until the `Populater` is dropped: `Ram`'s drop
        // drops it first.
        let populater =
            unsafe { Populater::start(ram.region.as_ptr() as usize, len, taken, Budget::process())? };
        ram.populater = Some(populater);
        Ok(true)
    }

    /// The pass taking a sparse RAM disk's memory, if one was started ([`Store::populate`]).
    pub fn populater(&self) -> Option<&Populater> {
        self.ram.as_ref()?.populater.as_ref()
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
        Ok(Store {
            file: Some(file),
            direct,
            kind,
            size,
            sector,
            ram: None,
            hold: Some(hold),
            durability_lost: Default::default(),
        })
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
        self.file.as_ref().filter(|_| self.ram.is_none()).map(|f| f.as_fd())
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

    /// A RAM disk's pages (`None` for a file store).
    pub fn ram_pages(&self) -> Option<RamPages> {
        self.ram.as_ref().map(|ram| ram.pages)
    }

    /// A file store's file (through the page cache).
    fn file(&self) -> io::Result<&File> {
        self.file.as_ref().ok_or_else(|| invalid("not a file store"))
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
        if let Some(ram) = &self.ram {
            let mut at = pos;
            for buf in bufs {
                prefetched_copy(&Self::ram_slice(&ram.region, at, buf.len())?, buf);
                at += buf.len() as u64;
            }
            return Ok(());
        }
        self.file_vectored(pos, bufs, Direction::Read, 0)
    }

    /// Asks the CPU to start loading the first page (at most) of `[pos, pos + len)` of a RAM
    /// store into its second-level cache: a hint for a read that runs after the caller's
    /// current work, so that its copy finds the lines there.
    /// Nothing is read or kept; a range past the store's end, or a store that is not RAM,
    /// gets nothing.
    pub fn prefetch(&self, pos: u64, len: usize) {
        if let Some(ram) = &self.ram {
            let len = len.min(PREFETCH_HEAD);
            if self.check(pos, len as u64).is_ok() {
                if let Ok(slice) = Self::ram_slice(&ram.region, pos, len) {
                    prefetch_head(&slice, len, Near::L2);
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
        if let Some(ram) = &self.ram {
            // Before the copy: a slice that fails half-way leaves streamed bytes too.
            UNFENCED.set(true);
            let mut at = pos;
            for buf in bufs {
                let to = Self::ram_slice(&ram.region, at, buf.len())?;
                if ram.first_writes(at, buf.len() as u64) {
                    buf.copy_to_volatile_slice(to);
                } else {
                    stream_copy(&to, buf);
                }
                at += buf.len() as u64;
            }
            return Ok(());
        }
        let flags = match durability {
            Durability::Cached => 0,
            Durability::Sync => {
                self.durable()?;
                libc::RWF_DSYNC
            }
        };
        let written = self.file_vectored(pos, bufs, Direction::Write, flags);
        if let (Err(e), Durability::Sync) = (&written, durability) {
            self.lose_durability(e);
        }
        written
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
        vectored(self.file()?, pos, bufs, dir, flags)
    }

    /// Reads `buf.len()` bytes at `pos` into a private buffer.
    pub fn read(&self, pos: u64, buf: &mut [u8]) -> io::Result<()> {
        self.check(pos, buf.len() as u64)?;
        match &self.ram {
            Some(ram) => {
                Self::ram_slice(&ram.region, pos, buf.len())?.copy_to(buf);
                Ok(())
            }
            None => self.file()?.read_exact_at(buf, pos),
        }
    }

    /// Writes `data` at `pos` from a private buffer.
    pub fn write(&self, pos: u64, data: &[u8]) -> io::Result<()> {
        self.check(pos, data.len() as u64)?;
        match &self.ram {
            Some(ram) => {
                Self::ram_slice(&ram.region, pos, data.len())?.copy_from(data);
                Ok(())
            }
            None => self.file()?.write_all_at(data, pos),
        }
    }

    /// Makes every completed write durable (`fdatasync`; nothing to do for RAM). Fails for
    /// good once a write-back failed ([`Store::durability_lost`]).
    pub fn flush(&self) -> io::Result<()> {
        match self.kind {
            StoreKind::Ram => Ok(()),
            StoreKind::File | StoreKind::BlockDevice => {
                self.durable()?;
                let synced = self.file()?.sync_data();
                if let Err(e) = &synced {
                    self.lose_durability(e);
                }
                synced
            }
        }
    }

    /// Whether a write-back of this file failed: from then on every flush and durable write
    /// fails (cached writes may have been lost, and which cannot be told), until the store
    /// is opened again.
    pub fn durability_lost(&self) -> bool {
        self.durability_lost.load(Ordering::Acquire)
    }

    /// `Err` once durability is lost ([`Store::durability_lost`]): for a flush or a durable
    /// write about to start.
    pub fn durable(&self) -> io::Result<()> {
        match self.durability_lost() {
            false => Ok(()),
            true => Err(io::Error::other(
                "an earlier write-back of the file failed: cached writes may have been lost",
            )),
        }
    }

    /// A sync of the file (`fdatasync`, or a write's `RWF_DSYNC`) failed with `e`: if it may
    /// have been a write-back failure (an I/O error; not the write's own refusal, such as no
    /// space for it), durability is lost for good ([`Store::durability_lost`]).
    pub fn lose_durability(&self, e: &io::Error) {
        let own = matches!(e.raw_os_error(), Some(libc::ENOSPC | libc::EDQUOT | libc::EFAULT | libc::EINVAL));
        if self.kind == StoreKind::Ram || own {
            return;
        }
        if !self.durability_lost.swap(true, Ordering::AcqRel) {
            log::error!(
                "a sync of a backing file failed ({e}): cached writes may have been lost; every later \
                 flush and durable write fails until the device is started again"
            );
        }
    }

    /// Zeroes `[pos, pos + len)`, giving the space back where the host can (a hole in a
    /// file or the memfd, whole 4 KiB pages of anonymous memory; on a block device a
    /// zero-out, which may unmap); reads return zeros after. Where the host cannot (no hole
    /// punching, huge pages, or a block device's range not whole logical blocks of it), the
    /// zeros are written.
    pub fn write_zeroes(&self, pos: u64, len: u64) -> io::Result<()> {
        self.write_zeroes_until(pos, len, &|| false).map(drop)
    }

    /// [`Store::write_zeroes`], asking `stop` before each [`DISCARD_PIECE`] given back and
    /// each [`ZERO_PIECE`] of zeros written: `Ok(false)` if it said stop (what came before is
    /// zeroed, the rest untouched). Where the zeros are written, a whole namespace is minutes
    /// of a disk's time; a caller that may be cancelled (a reset) stops within one piece.
    pub fn write_zeroes_until(&self, pos: u64, len: u64, stop: &dyn Fn() -> bool) -> io::Result<bool> {
        self.check(pos, len)?;
        let end = pos + len;
        let mut at = pos;
        while at < end {
            if stop() {
                return Ok(false);
            }
            // Pieces end on multiples of the piece size, so that only the range's own ends
            // can be unaligned to a page or a logical block.
            let next = ((at / DISCARD_PIECE).saturating_add(1)).saturating_mul(DISCARD_PIECE).min(end);
            if !self.zero_piece(at, next - at, stop)? {
                return Ok(false);
            }
            at = next;
        }
        Ok(true)
    }

    /// One piece of [`Store::write_zeroes_until`]; `[pos, pos + len)` checked by the caller.
    fn zero_piece(&self, pos: u64, len: u64, stop: &dyn Fn() -> bool) -> io::Result<bool> {
        if len == 0 {
            return Ok(true);
        }
        match &self.ram {
            Some(ram) if ram.pages == RamPages::Huge => return self.write_zeros_slowly(pos, len, stop),
            Some(ram) if ram.pages == RamPages::Transparent => {
                return self.discard_anonymous(ram, pos, len, stop)
            }
            _ => {}
        }
        // A block device zeroes whole logical blocks of its own only (a 4 KiB-sector disk
        // under 512-byte namespace blocks): the rest, at either end, is written.
        let end = pos + len;
        let (first, last) = (pos.next_multiple_of(self.sector), end / self.sector * self.sector);
        if first >= last {
            return self.write_zeros_slowly(pos, len, stop);
        }
        let mode = libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE;
        // On a block device through the open file that claims it: the kernel drops the range
        // from the device's page cache only for the claimant, and for anyone else (with
        // dirty pages there) refuses with EBUSY.
        let fd = match self.hold.as_ref().filter(|_| self.kind == StoreKind::BlockDevice) {
            Some(hold) => hold,
            None => self.file()?,
        };
        // SAFETY: fallocate on an fd this store owns, with an in-range offset and length;
        // it touches no memory of ours.
        let rc = unsafe {
            libc::fallocate(fd.as_raw_fd(), mode, first as libc::off_t, (last - first) as libc::off_t)
        };
        if rc != 0 {
            let err = io::Error::last_os_error();
            return match err.raw_os_error() {
                // The filesystem cannot punch holes: write the zeros.
                Some(libc::EOPNOTSUPP) | Some(libc::ENOSYS) => self.write_zeros_slowly(pos, len, stop),
                _ => Err(err),
            };
        }
        if let Some(ram) = &self.ram {
            ram.emptied(first, last, self.size);
        }
        // The ends, less than a page or a logical block each.
        self.write_zeros_slowly(pos, first - pos, &|| false)?;
        self.write_zeros_slowly(last, end - last, &|| false)
    }

    /// An anonymous RAM disk's [`Store::write_zeroes`]: its whole 4 KiB pages in the range
    /// are given back (`MADV_DONTNEED`: a private anonymous page reads as zeros after), the
    /// rest at either end is written.
    fn discard_anonymous(&self, ram: &Ram, pos: u64, len: u64, stop: &dyn Fn() -> bool) -> io::Result<bool> {
        // SAFETY: sysconf has no preconditions.
        let page = match unsafe { libc::sysconf(libc::_SC_PAGESIZE) } {
            n if n > 0 => n as u64,
            _ => return self.write_zeros_slowly(pos, len, stop),
        };
        let end = pos + len;
        let (first, last) = (pos.next_multiple_of(page), end / page * page);
        if first >= last {
            return self.write_zeros_slowly(pos, len, stop);
        }
        let base = ram.region.as_ptr() as u64;
        if !base.is_multiple_of(page) {
            return self.write_zeros_slowly(pos, len, stop);
        }
        // SAFETY: `[first, last)` is inside the store (checked by the caller), so inside the
        // mapping this region owns, and page-aligned (the mapping starts on a page).
        // MADV_DONTNEED on private anonymous memory only replaces those pages with zero
        // pages: every pointer into the mapping stays valid, and a copy racing with it reads
        // or writes either the old page or a fresh zeroed one.
        let rc = unsafe {
            libc::madvise((base + first) as *mut libc::c_void, (last - first) as usize, libc::MADV_DONTNEED)
        };
        if rc != 0 {
            return Err(io::Error::last_os_error());
        }
        ram.emptied(first, last, self.size);
        // The ends, less than a page or a logical block each.
        self.write_zeros_slowly(pos, first - pos, &|| false)?;
        self.write_zeros_slowly(last, end - last, &|| false)
    }

    /// [`Ram::first_writes`] of a RAM store (false for a file store).
    #[cfg(test)]
    fn first_writes(&self, pos: u64, len: u64) -> bool {
        self.ram.as_ref().is_some_and(|ram| ram.first_writes(pos, len))
    }

    /// Counts every piece full, as after a first fill: writes stream from now on.
    #[cfg(test)]
    fn mark_full(&self) {
        for count in self.ram.iter().flat_map(|ram| ram.filling.iter()) {
            count.store(HUGE_PAGE as u32, Ordering::Relaxed);
        }
    }

    /// Writes zeros over `[pos, pos + len)`, asking `stop` before each [`ZERO_PIECE`] after
    /// the first: `Ok(false)` if it said stop.
    fn write_zeros_slowly(&self, pos: u64, len: u64, stop: &dyn Fn() -> bool) -> io::Result<bool> {
        static ZEROS: [u8; 64 << 10] = [0; 64 << 10];
        let mut done = 0;
        while done < len {
            if done > 0 && done.is_multiple_of(ZERO_PIECE) && stop() {
                return Ok(false);
            }
            let n = (len - done).min(ZEROS.len() as u64) as usize;
            self.write(pos + done, &ZEROS[..n])?;
            done += n as u64;
        }
        Ok(true)
    }
}

/// The most zeros [`Store::write_zeroes_until`] writes between two looks at its `stop`: 16
/// MiB, a fraction of a second at a slow disk's speed.
pub const ZERO_PIECE: u64 = 16 << 20;

/// The most [`Store::write_zeroes_until`] gives back (a hole punched, a zero-out, pages
/// dropped) in one call, between two looks at its `stop`: 1 GiB, a thousand calls for a
/// namespace of a TiB.
pub const DISCARD_PIECE: u64 = 1 << 30;

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

fn mmap_error(e: vm_memory::mmap::MmapRegionError) -> io::Error {
    match e {
        vm_memory::mmap::MmapRegionError::Mmap(e) => e,
        e => io::Error::other(e),
    }
}

fn invalid(what: &str) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidInput, what.to_string())
}

/// How much of a read's source [`prefetched_copy`] asks for before it copies: a page.
const PREFETCH_HEAD: usize = 4096;

/// The longest copy [`prefetched_copy`] prefetches the head of.
const PREFETCH_MAX_COPY: usize = 4 * PREFETCH_HEAD;

/// Copies `src`, a RAM store's bytes, into `dst`, a short copy's first page's lines asked for
/// first. A read lands at a position of the store nobody touched lately: in L2 at best, where
/// the worker's look-ahead asked for it ([`Store::prefetch`]), else in memory. A short copy
/// alone has only as many of its lines in flight as the CPU's prefetcher guesses, while 64
/// prefetches at once bring them all from the first line (4 KiB random reads by SPDK's
/// initiator at QD32: 1.18x the plain copy on one machine, 1.06x on another; with the
/// look-ahead into L2, 1.22x the build before against 1.17x with no head prefetch and 1.20x
/// with one into L2, over 6 rounds). A long copy is one `memmove`, which streams at the
/// machine's own best: on an AVX-512 machine whose memory copies at 25 GB/s, 128 KiB reads
/// went 1.15x as fast as when copied page by page with a prefetch two pages on (which an
/// older machine had level with a single copy), and a single copy with its head prefetched
/// only 1.06-1.08x (docs/benchmarks.md).
fn prefetched_copy(src: &VolatileSlice<'_>, dst: &VolatileSlice<'_>) {
    if src.len() <= PREFETCH_MAX_COPY {
        prefetch_head(src, PREFETCH_HEAD, Near::L1);
    }
    src.copy_to_volatile_slice(*dst);
}

/// Where [`prefetch_head`] asks for the lines to go.
#[derive(Clone, Copy)]
enum Near {
    /// The first-level cache: for a copy that starts now.
    L1,
    /// The second-level cache: for a copy that starts after other work. 64 prefetches into
    /// L1 at once (a page) held the worker on the first of each eight for a quarter of its
    /// time (4 KiB random reads at QD32, an AMD EPYC guest): as we understand it, each holds
    /// one of L1's few slots for lines on their way until its line arrives. Into L2 the worker
    /// still waits there about as long by the profile, but serves 1.22x the reads, and a line
    /// comes from L2 to L1 in a few nanoseconds when the copy asks for it.
    L2,
}

/// Asks for the cache lines of the first `len` bytes of `slice` (all of it if shorter), to
/// `near`: a hint, nothing is read or faulted.
#[inline]
fn prefetch_head(slice: &VolatileSlice<'_>, len: usize, near: Near) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0, _MM_HINT_T1};
        let base = slice.ptr_guard();
        let len = len.min(slice.len());
        for off in (0..len).step_by(64) {
            let line = base.as_ptr().wrapping_add(off).cast::<i8>();
            // SAFETY: a prefetch is a hint that reads nothing and cannot fault, whatever the
            // address (here inside the slice's mapping: `off < len <= slice.len()`).
            unsafe {
                match near {
                    Near::L1 => _mm_prefetch::<_MM_HINT_T0>(line),
                    Near::L2 => _mm_prefetch::<_MM_HINT_T1>(line),
                }
            };
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (slice, len, near);
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
    use crate::populate::PassState;

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
    /// The sum of `fields` (`Rss:`, ...) in /proc/self/smaps for the mapping holding `addr`.
    fn smaps_at(addr: usize, fields: &[&str]) -> u64 {
        let smaps = std::fs::read_to_string("/proc/self/smaps").unwrap();
        let mut inside = false;
        let mut sum = 0;
        for line in smaps.lines() {
            let first = line.split_whitespace().next().unwrap_or("");
            if let Some((lo, hi)) = first.split_once('-').filter(|_| !first.ends_with(':')) {
                let range = usize::from_str_radix(lo, 16).ok().zip(usize::from_str_radix(hi, 16).ok());
                inside = range.is_some_and(|(lo, hi)| (lo..hi).contains(&addr));
            } else if inside && fields.contains(&first) {
                sum += line.split_whitespace().nth(1).and_then(|v| v.parse::<u64>().ok()).unwrap_or(0);
            }
        }
        sum
    }

    /// 4 KiB pages of `[addr, addr + len)` in memory (`mincore`): exactly the range, where
    /// smaps counts the whole mapping, which the kernel may have merged with a neighbour.
    fn resident_pages(addr: usize, len: usize) -> usize {
        let mut vec = vec![0u8; len.div_ceil(4096)];
        // SAFETY: `[addr, addr + len)` is mapped (a live store's), page-aligned at `addr`, and
        // `vec` has a byte per page of it for the kernel to write.
        let rc = unsafe { libc::mincore(addr as *mut libc::c_void, len, vec.as_mut_ptr()) };
        assert_eq!(rc, 0, "mincore: {}", std::io::Error::last_os_error());
        vec.iter().filter(|&&b| b & 1 != 0).count()
    }

    fn hugetlb_kib_at(addr: usize) -> u64 {
        smaps_at(addr, &["Shared_Hugetlb:", "Private_Hugetlb:"])
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
        // plainly. Every split of head, body and tail, from either side's alignment, on a
        // disk full (its writes stream) and on a new one (its first writes are plain copies).
        for full in [true, false] {
            let store = Store::ram(64 << 10).unwrap();
            if full {
                store.mark_full();
                assert!(!store.first_writes(0, 1), "a full disk's writes stream");
            }
            writes_land_exactly(&store);
        }
    }

    fn writes_land_exactly(store: &Store) {
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
        for pages in [RamPages::Transparent, RamPages::Small] {
            let store = Store::ram_with(1 << 20, pages).unwrap();
            assert_eq!((store.kind(), store.ram_pages()), (StoreKind::Ram, Some(pages)));
            roundtrip(&store);
        }
        assert_eq!(Store::ram(4096).unwrap().ram_pages(), Some(RamPages::Transparent), "the default");
        assert!(Store::ram(0).is_err());
    }

    #[test]
    fn a_sparse_ram_store_copies_plainly_until_each_2m_piece_has_taken_2m_of_writes() {
        const M: u64 = 1 << 20;
        for pages in [RamPages::Transparent, RamPages::Small] {
            let store = Store::ram_with(5 * M, pages).unwrap();
            assert!(store.first_writes(0, M) && store.first_writes(M, M - 4096), "{pages:?}");
            // The piece's last 4 KiB, with 4 KiB of the next: both counted.
            assert!(store.first_writes(2 * M - 4096, 8192));
            assert!(!store.first_writes(0, 512), "piece 0 has taken 2 MiB");
            assert!(store.first_writes(2 * M + 4096, 2 * M - 8192), "piece 1 has 4 KiB short of 2 MiB");
            assert!(store.first_writes(4 * M - 4096, 4096));
            assert!(!store.first_writes(2 * M, 1));
            // The last piece is a short one (1 MiB): it counts as any.
            assert!(
                store.first_writes(4 * M, M)
                    && store.first_writes(4 * M, M)
                    && !store.first_writes(5 * M - 1, 1)
            );
            // Given back whole: empty again; a piece only partly given back stays counted.
            store.write_zeroes(100, 4 * M).unwrap();
            assert!(
                !store.first_writes(0, 1) && store.first_writes(2 * M, 1) && !store.first_writes(M * 4, 1)
            );
            // The short last piece given back whole, to the disk's end: empty again.
            store.write_zeroes(4 * M, M).unwrap();
            assert!(store.first_writes(4 * M, 1));
            // A write from a full piece into the next streams, and still counts in the next.
            let two = Store::ram_with(4 * M, pages).unwrap();
            assert!(two.first_writes(0, 2 * M));
            assert!(!two.first_writes(2 * M - 4096, 2 * M + 4096));
            assert!(!two.first_writes(2 * M, 1), "piece 1 took its 2 MiB from the write across");
            // Bytes land either way.
            store.write(2 * M - 3, &[1, 2, 3, 4, 5, 6]).unwrap();
            let mut back = [0u8; 6];
            store.read(2 * M - 3, &mut back).unwrap();
            assert_eq!(back, [1, 2, 3, 4, 5, 6]);
        }
        if let Ok(store) = Store::ram_huge(HUGE_PAGE) {
            assert!(!store.first_writes(0, 4096), "huge pages are zeroed at creation: writes stream");
        }
    }

    #[test]
    fn a_transparent_ram_store_asks_for_huge_pages_and_gives_zeroed_pages_back() {
        // Not a whole number of 2 MiB: the mapping is, and starts on a 2 MiB boundary.
        let store = Store::ram_with(8 * HUGE_PAGE - 4096, RamPages::Transparent).unwrap();
        let at = store.ram.as_ref().unwrap().region.as_ptr() as usize;
        let thp = std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/enabled").unwrap_or_default();
        if thp.contains("[always]") || thp.contains("[madvise]") {
            // The mapping may take huge pages (whether a fault gets one depends on the host's
            // free memory at the time, so only the eligibility is certain).
            assert_eq!(smaps_at(at, &["THPeligible:"]), 1, "THP: {thp}");
        }
        let release = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
        let mut version = release.trim().split(['.', '-']).map(|p| p.parse::<u32>().unwrap_or(0));
        if (version.next().unwrap_or(0), version.next().unwrap_or(0)) >= (6, 7) {
            assert_eq!(at % HUGE_PAGE as usize, 0, "Linux {release} places it on 2 MiB");
        }
        let data = vec![0x5au8; 4 * HUGE_PAGE as usize];
        store.write(0, &data).unwrap();
        let (whole, pages) = (4 * HUGE_PAGE as usize, 4 * HUGE_PAGE as usize / 4096);
        assert_eq!(resident_pages(at, whole), pages, "written pages are in");
        // Zeroing all but 100 bytes at either end gives the whole pages between back.
        store.write_zeroes(100, 4 * HUGE_PAGE - 200).unwrap();
        assert_eq!(resident_pages(at, whole), 2, "only the two edge pages stay");
        let mut back = vec![1u8; data.len()];
        store.read(0, &mut back).unwrap();
        assert!(
            back[..100].iter().all(|&b| b == 0x5a) && back[back.len() - 100..].iter().all(|&b| b == 0x5a)
        );
        assert!(back[100..back.len() - 100].iter().all(|&b| b == 0));
    }

    #[test]
    fn a_long_read_copies_exactly_page_by_page_at_any_alignment() {
        let store = Store::ram(1 << 20).unwrap();
        let data: Vec<u8> = (0..1u32 << 20).map(|i| (i * 31 + i / 4099) as u8).collect();
        store.write(0, &data).unwrap();
        for pos in [0usize, 1, 4095, 4096, 5000, 12288 + 64] {
            for len in [PREFETCH_MAX_COPY + 1, 64 * 1024 - 3, 128 * 1024, 200 * 1024 + 7] {
                // One slice, and two whose cut falls inside a page.
                for cuts in [&[len][..], &[len / 3, len - len / 3][..]] {
                    let mut back = vec![0u8; len];
                    store.read_vectored(pos as u64, &slices(&mut back, cuts)).unwrap();
                    assert!(back == data[pos..pos + len], "pos {pos} len {len} cuts {cuts:?}");
                }
            }
        }
    }

    #[test]
    fn a_populated_ram_store_has_its_pages_in_and_keeps_what_was_written_before() {
        for pages in [RamPages::Transparent, RamPages::Small] {
            // Not a whole number of 2 MiB: the short last piece is taken too.
            let size = 8 * HUGE_PAGE - 4096;
            let mut store = Store::ram_with(size, pages).unwrap();
            let at = store.ram.as_ref().unwrap().region.as_ptr() as usize;
            let data = vec![0xa5u8; 3 * 4096];
            store.write(HUGE_PAGE + 4096, &data).unwrap();
            assert!(store.populate().unwrap(), "{pages:?}");
            assert!(!store.populate().unwrap(), "one pass at a time");
            // Counts events, not time.
            let state = loop {
                match store.populater().unwrap().state() {
                    PassState::Taking => std::thread::sleep(std::time::Duration::from_millis(1)),
                    ended => break ended,
                }
            };
            if state == PassState::Unaffordable
                || (state == PassState::Stopped && !crate::populate::populating_faults())
            {
                eprintln!("SKIPPED {pages:?}: the pass ended {state:?} (the host's memory, or its kernel)");
                continue;
            }
            assert_eq!(state, PassState::Done, "{pages:?}");
            assert_eq!(store.populater().unwrap().done(), size, "{pages:?}");
            assert_eq!(resident_pages(at, size as usize), size as usize / 4096, "{pages:?}: all in");
            let mut back = vec![0u8; size as usize];
            store.read(0, &mut back).unwrap();
            let written = (HUGE_PAGE + 4096) as usize..(HUGE_PAGE + 4096) as usize + data.len();
            assert!(back[written.clone()].iter().all(|&b| b == 0xa5), "{pages:?}: the write kept");
            assert!(back[..written.start].iter().chain(&back[written.end..]).all(|&b| b == 0));
            // Every piece counted full: its writes stream.
            assert!((0..8).all(|p| !store.first_writes(p * HUGE_PAGE, 4096)), "{pages:?}");
        }
    }

    fn byte_at(store: &Store, at: u64) -> u8 {
        let mut b = [0u8];
        store.read(at, &mut b).unwrap();
        b[0]
    }

    /// A `stop` for the zeroing calls that counts its looks in `looks` and says stop from
    /// look `at` on (never if `None`).
    fn stop_at(looks: &std::cell::Cell<u32>, at: Option<u32>) -> impl Fn() -> bool + '_ {
        move || {
            looks.set(looks.get() + 1);
            at.is_some_and(|at| looks.get() >= at)
        }
    }

    #[test]
    fn zeros_written_look_at_their_stop_every_piece() {
        let store = Store::ram(3 * ZERO_PIECE).unwrap();
        let marks = [0, ZERO_PIECE - 1, ZERO_PIECE, 2 * ZERO_PIECE + 7, 3 * ZERO_PIECE - 1];
        for at in marks {
            store.write(at, &[0xa5]).unwrap();
        }
        // Told to stop at its first look, after the first piece: nothing after it.
        let looks = std::cell::Cell::new(0);
        assert!(!store.write_zeros_slowly(0, 3 * ZERO_PIECE, &stop_at(&looks, Some(1))).unwrap());
        assert_eq!(looks.get(), 1);
        assert_eq!(marks.map(|at| byte_at(&store, at)), [0, 0, 0xa5, 0xa5, 0xa5]);
        // Not told: to the end, a look before each piece after the first.
        looks.set(0);
        assert!(store.write_zeros_slowly(ZERO_PIECE - 1, 2 * ZERO_PIECE, &stop_at(&looks, None)).unwrap());
        assert_eq!(looks.get(), 1);
        assert_eq!(marks.map(|at| byte_at(&store, at)), [0, 0, 0, 0, 0xa5]);
    }

    #[test]
    fn giving_back_looks_at_its_stop_before_each_piece() {
        // Sparse and never written: dropping its pages costs nothing.
        let store = Store::ram(3 * DISCARD_PIECE).unwrap();
        store.write(DISCARD_PIECE - 1, &[0xa5]).unwrap();
        store.write(DISCARD_PIECE, &[0xa5]).unwrap();
        let looks = std::cell::Cell::new(0);
        assert!(!store.write_zeroes_until(0, 3 * DISCARD_PIECE, &stop_at(&looks, Some(2))).unwrap());
        assert_eq!(looks.get(), 2);
        assert_eq!([byte_at(&store, DISCARD_PIECE - 1), byte_at(&store, DISCARD_PIECE)], [0, 0xa5]);
        // Pieces end on multiples of the piece: an unaligned start makes one more.
        looks.set(0);
        let never = stop_at(&looks, None);
        assert!(store.write_zeroes_until(DISCARD_PIECE - 1, 2 * DISCARD_PIECE, &never).unwrap());
        assert_eq!(looks.get(), 3);
        assert_eq!(byte_at(&store, DISCARD_PIECE), 0);
        assert!(store.write_zeroes_until(3 * DISCARD_PIECE, 1, &never).is_err(), "past the end");
    }

    #[test]
    fn a_huge_page_or_file_store_has_nothing_to_populate() {
        if let Ok(mut huge) = Store::ram_huge(HUGE_PAGE) {
            assert!(!huge.populate().unwrap(), "taken whole when made");
        }
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("disk.img");
        File::create(&path).unwrap().set_len(1 << 20).unwrap();
        assert!(!Store::open(&path).unwrap().populate().unwrap());
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
                let at = store.ram.as_ref().unwrap().region.as_ptr() as usize;
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
