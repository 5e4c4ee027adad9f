//! # umdev-pinning
//!
//! The external page-pinning engine of umdev: a client's DMA space, and pins on it that
//! emulated devices take the way Linux mdev drivers call `vfio_pin_pages()`.
//!
//! A VMM maps guest memory into a [`DmaSpace`] ([`DmaSpace::map`]: an fd, mmapped
//! `MAP_SHARED`). A device then pins an arbitrary array of IOVA page numbers — a channel
//! program's IDAW list, say `[1, 5, 6, 7, 9]` — with [`DmaSpace::pin_pages`]. The engine cuts
//! the array into maximal contiguous runs (`[1] [5,6,7] [9]`), pins each run with one step
//! (one translation, one accounting step, one mlock in [`PinMode::Lock`]), refcounts every
//! page, and returns a [`PinnedPages`] guard with the host address of every page and the
//! scatter-gather list. A call is all-or-nothing. Unmapping a range that holds pins asks
//! the device to let go (its [`UnmapNotifier`]) and waits, so memory is never unmapped
//! under a pin.
//!
//! What it is not: it knows nothing of vfio-user or of devices; the server crate feeds it
//! DMA_MAP/DMA_UNMAP and devices call it. It does not program an IOMMU: "pinning" here means
//! refcounted translation, and in lock mode residency via mlock, in kernel mode the kernel's
//! own long-term pin of each run (`FOLL_LONGTERM`, through io_uring buffer registration).
//!
//! Words used with one meaning throughout (the lifetime protocol is in `DESIGN.md`):
//!
//! - **space**: a client's IOVA mappings and the pins on them ([`DmaSpace`]); it *closes*
//!   when its last handle drops, and lives on while guards hold records in it.
//! - **mapping**: one mapped range: IOVA pages, host memory, state (live, unmapping,
//!   removed). The **mapping table**: a space's mappings by first page.
//! - **shard**: one of a space's 16 per-thread parts (each thread has one, round robin): a
//!   lock biased to the first thread that pins through it, the records of calls made from it, a stock of pins, counts, a lookup hint.
//!   The **shard table**: the mapping table behind the shard locks, and the shards.
//! - **run** ([`PinnedRun`]): consecutive entries of a call naming consecutive pages of one
//!   mapping, pinned as one step. Its **mapping index**: which of its call's mappings.
//! - **record**: a track-mode call as its shard keeps it (runs, mappings); a **small record**
//!   (at most 8 runs in one mapping) sits in the shard's fixed array, a **boxed record** in a
//!   reused box. A **plan**: a call cut into runs holding its mappings (lock mode, unpins).
//! - **guard** ([`PinnedPages`]): pins held until it drops; its **hold** is one word.
//! - **page counts**: per-page pin counts of a mapping (lock mode, and pins kept with
//!   [`PinnedPages::forget`]).
//! - **stock**: pins a shard or a mapping reserved from the space's `max_pins`.
//! - **lock account** ([`LockAccount`]): the budget of bytes lock mode mlocks; **spin lock**:
//!   the lock of a mapping's pin state; **biased lock**: a shard's lock, taken by its owning
//!   thread with plain stores (DESIGN.md I19); **lock mode** ([`PinMode::Lock`]).
//! - **counts**: calls, runs, pages and syscalls, summed into [`DmaStats`].
//! - **orphan**: a mapping `abandon_all` took while records still name it.
//! - **kernel mode** ([`PinMode::Kernel`]): track mode's records, and the kernel's long-term
//!   pin of each run. The **kernel table**: a space's io_uring and its sparse table of
//!   registered **buffers** (a run, or a GiB of a longer one); a **slot**: one entry of that
//!   table. A **kept buffer**: a forgotten guard's buffer, cleared with its last unpinned page.
//!
//! ```
//! use std::os::fd::AsFd;
//! use umdev_pinning::{DmaSpace, Prot, PAGE_SIZE};
//! // (the memfd comes from `nix`, a dev-dependency here; any memfd or shared file does)
//!
//! let memfd = std::fs::File::from(nix::sys::memfd::memfd_create(
//!     c"guest-ram", nix::sys::memfd::MFdFlags::empty()).unwrap());
//! memfd.set_len(16 * PAGE_SIZE).unwrap();
//! let space = DmaSpace::default();
//! space.map(0x10000, 16 * PAGE_SIZE, memfd.as_fd(), 0, Prot::READ_WRITE).unwrap();
//!
//! let base = 0x10000 / PAGE_SIZE;
//! let pins = space.pin_pages(&[base + 1, base + 5, base + 6, base + 7, base + 9], Prot::WRITE).unwrap();
//! assert_eq!(pins.runs().len(), 3);
//! pins.write(0, b"hello").unwrap(); // lands in page base + 1
//! assert_eq!(space.pin_count(0x15000), 1);
//! drop(pins);
//! assert_eq!(space.pin_count(0x15000), 0);
//! ```

#![deny(unsafe_op_in_unsafe_fn)]
#![deny(missing_docs)]

mod account;
mod biased;
mod budget;
mod counters;
mod file_kind;
#[cfg(feature = "fuzzing")]
pub mod fuzzing;
mod kernel;
mod mapping;
mod mmap;
pub mod page;
mod page_counts;
mod pin;
mod reaper;
mod record;
mod run;
mod run_scan;
mod shard;
mod shard_table;
mod sigbus;
mod space;
mod spin;
pub mod sync;

pub use account::{has_cap_ipc_lock, process_lock_limit, LockAccount, OverLimit, PinMode};
pub use file_kind::{file_kind, FileKind};
pub use kernel::{kernel_pins_available, KernelPinsUnavailable, KERNEL_BUFFER_BYTES, MAX_KERNEL_BUFFERS};
pub use mmap::{
    process_mapped_bytes, process_mapped_bytes_limit, process_mapping_limit, process_mappings,
    set_process_mapped_bytes_limit, set_process_mapping_limit, Backing, MmapError,
};
pub use page::{Prot, PAGE_SHIFT, PAGE_SIZE};
pub use page_counts::{CHUNK_BYTES, CHUNK_PAGES, MAX_PIN_COUNT};
pub use pin::{AccessError, PinError, PinnedPages, RegisteredBuffer, UnpinError};
pub use run::{PinnedRun, Segment};
pub use sigbus::recovered_faults;
/// The types of [`PinnedPages::read_obj`], [`PinnedPages::slice`] and
/// [`PinnedPages::io_slices`], so that a user needs no version of their crates of its own.
pub use smallvec::SmallVec;
pub use space::{
    DmaSpace, DmaSpaceConfig, DmaStats, MapError, MappingInfo, UnmapError, UnmapNotifier, Unmapped,
    DEFAULT_MAX_MAPPED_BYTES,
};
pub use vm_memory::{ByteValued, VolatileSlice};

#[cfg(test)]
pub(crate) mod testutil {
    use std::fs::File;

    use crate::PAGE_SIZE;

    /// A memfd of `pages` pages, sparse (under Miri, which maps no file, a temporary file
    /// that only sizes the mapping: see `HostMemory::map`).
    pub(crate) fn memfd(pages: u64) -> File {
        if cfg!(miri) {
            let file = tempfile_for_miri();
            file.set_len(pages * PAGE_SIZE).expect("ftruncate");
            return file;
        }
        let fd = nix::sys::memfd::memfd_create(c"umdev-test", nix::sys::memfd::MFdFlags::empty())
            .expect("memfd_create");
        let file = File::from(fd);
        file.set_len(pages * PAGE_SIZE).expect("ftruncate");
        file
    }

    fn tempfile_for_miri() -> File {
        use std::sync::atomic::{AtomicU64, Ordering};
        static NEXT: AtomicU64 = AtomicU64::new(0);
        let path = std::env::temp_dir().join(format!("umdev-miri-{}", NEXT.fetch_add(1, Ordering::Relaxed)));
        let file = std::fs::OpenOptions::new().read(true).write(true).create(true).truncate(true).open(&path);
        let _ = std::fs::remove_file(&path);
        file.expect("a temporary file (Miri needs -Zmiri-disable-isolation)")
    }

    /// Bytes the kernel reports locked in VMAs inside `[start, start + len)`.
    pub(crate) fn locked_bytes_in(start: usize, len: usize) -> u64 {
        let smaps = std::fs::read_to_string("/proc/self/smaps").expect("smaps");
        let mut inside = false;
        let mut total = 0;
        for line in smaps.lines() {
            if let Some((range, _)) = line.split_once(' ').filter(|(r, _)| r.contains('-')) {
                if let Some((a, b)) = range.split_once('-') {
                    if let (Ok(a), Ok(b)) = (usize::from_str_radix(a, 16), usize::from_str_radix(b, 16)) {
                        inside = a >= start && b <= start + len;
                        continue;
                    }
                }
            }
            if inside {
                if let Some(kb) = line.strip_prefix("Locked:") {
                    total += kb.trim().trim_end_matches("kB").trim().parse::<u64>().unwrap_or(0) * 1024;
                }
            }
        }
        total
    }
}
