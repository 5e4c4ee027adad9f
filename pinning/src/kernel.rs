//! Kernel pins: long-term pins the kernel takes and keeps itself, through io_uring's
//! registered buffers.
//!
//! Registering a buffer with an io_uring pins every page of it the way `vfio_pin_pages`
//! does, with `pin_user_pages(FOLL_WRITE | FOLL_LONGTERM)` (the pages cannot be migrated or
//! reclaimed while pinned), charges them to the user's `RLIMIT_MEMLOCK` unless the process
//! has `CAP_IPC_LOCK`, shows them in the process's `VmPin`, and keeps them until the buffer
//! is unregistered. A [`KernelTable`] is one ring per space and its sparse table of
//! registered buffers: a pin call's runs get consecutive slots of the table, and one update
//! registers them all (a buffer per run, or per GiB of a longer run: the kernel's limit for
//! one buffer); letting go is one update that clears them.
//!
//! The kernel's accounting, as it does it (io_uring/rsrc.c): a 4 KiB page is charged once
//! per buffer that holds it (a page pinned by two calls is charged twice); a huge page
//! (hugetlb or THP) once per ring however many buffers hold it, for its whole size; and a
//! run of pages of one large folio is pinned as one piece (folio batching).
//!
//! What it is not: it submits no I/O. The ring exists for its buffer table; a caller that
//! wants the pinned pages as fixed buffers of its own ring clones slots of the table
//! (`IORING_REGISTER_CLONE_BUFFERS`, through [`KernelTable::ring_fd`]).

use std::io;
use std::os::fd::{AsRawFd, BorrowedFd};

use smallvec::SmallVec;
use thiserror::Error;

use crate::page::PAGE_SIZE;
use crate::spin::SpinLock;

/// Most bytes one registered buffer may hold (the kernel refuses longer ones): runs are cut
/// into buffers of at most this.
pub const KERNEL_BUFFER_BYTES: u64 = 1 << 30;

/// Pages in one full registered buffer.
pub(crate) const KERNEL_BUFFER_PAGES: u64 = KERNEL_BUFFER_BYTES / PAGE_SIZE;

/// Most buffers one io_uring table may hold (the kernel's `IORING_MAX_REG_BUFFERS`), the
/// default size of a space's table.
pub const MAX_KERNEL_BUFFERS: u32 = 1 << 14;

/// `IORING_REGISTER_BUFFERS_UPDATE` (io_uring's stable ABI, since Linux 5.13).
const IORING_REGISTER_BUFFERS_UPDATE: libc::c_uint = 16;

/// `struct io_uring_rsrc_update2`, the argument of [`IORING_REGISTER_BUFFERS_UPDATE`].
#[repr(C)]
#[derive(Default)]
struct RsrcUpdate2 {
    offset: u32,
    resv: u32,
    data: u64,
    tags: u64,
    nr: u32,
    resv2: u32,
}

/// Why kernel pins cannot be had here: io_uring (or its buffer registration) is missing,
/// disabled, or refused to this process.
#[derive(Clone, Debug, Error, PartialEq, Eq)]
#[error("kernel pins need io_uring buffer registration, and {step} failed: {reason}")]
pub struct KernelPinsUnavailable {
    /// What failed: `io_uring_setup`, or registering the buffer table.
    pub step: &'static str,
    /// The errno (EIO for a failure that had none: the ring's setup thread panicked, say).
    pub errno: i32,
    /// What the errno means here.
    pub reason: String,
}

impl KernelPinsUnavailable {
    fn new(step: &'static str, error: &io::Error) -> Self {
        // The sysctl only tells an EPERM's cause; it is read as the failure happens.
        let disabled = std::fs::read_to_string("/proc/sys/kernel/io_uring_disabled").unwrap_or_default();
        Self::explained(step, error, disabled.trim())
    }

    /// `error` of `step` explained, `disabled` the value of `kernel.io_uring_disabled` (empty
    /// where there is none): the cause, and what to do about it, for an operator.
    fn explained(step: &'static str, error: &io::Error, disabled: &str) -> Self {
        // A failure that is not the kernel's (the setup thread's panic) has no errno; it is
        // reported as one all the same (an answer with errno 0 would read as success).
        let errno = error.raw_os_error().unwrap_or(libc::EIO);
        let why = match errno {
            libc::ENOSYS => {
                "this kernel has no io_uring, or a seccomp filter hides it (a kernel built with \
                 CONFIG_IO_URING, or a filter that allows io_uring_setup and io_uring_register, gives it)"
            }
            libc::EPERM | libc::EACCES if disabled == "2" => {
                "io_uring is disabled (sysctl kernel.io_uring_disabled = 2); `sysctl -w \
                 kernel.io_uring_disabled=0` enables it"
            }
            libc::EPERM | libc::EACCES if disabled == "1" => {
                "io_uring is limited to CAP_SYS_ADMIN and the io_uring group (sysctl \
                 kernel.io_uring_disabled = 1); run as a member of the group kernel.io_uring_group \
                 names, or set kernel.io_uring_disabled = 0"
            }
            libc::EPERM | libc::EACCES => {
                "refused to this process (a seccomp filter or an LSM policy); allow io_uring_setup and \
                 io_uring_register to it"
            }
            libc::EINVAL => "the kernel is too old for sparse buffer tables (Linux 5.13 or later)",
            libc::ENOMEM => "out of memory, or over RLIMIT_MEMLOCK for the ring (raise the limit)",
            _ => "unexpected",
        };
        KernelPinsUnavailable { step, errno, reason: format!("{error}: {why}") }
    }
}

/// Checks that this process can take kernel pins: sets up a ring with a one-slot buffer
/// table, as a kernel-mode space does. `Err` says why not, in words for an operator.
pub fn kernel_pins_available() -> Result<(), KernelPinsUnavailable> {
    KernelTable::new(1).map(drop)
}

/// A one-entry ring, set up on a thread that then ends. The kernel ties a ring to the thread
/// that set it up: when the ring is closed, whoever closes it, its teardown queues work for
/// that thread (`task_work_add(TWA_SIGNAL)`, from a kernel worker soon after), and the wait
/// that thread is in then, or its next, fails with EINTR, no signal sent, if it is one a signal
/// ends rather than restarts (a read from a socket with `SO_RCVTIMEO`, `epoll_wait`). A space is made on its caller's thread (the one serving
/// an application's control socket, say), which must not get that.
fn ring_of_its_own_thread() -> io::Result<io_uring::IoUring> {
    let setup = || io_uring::IoUring::new(1);
    std::thread::scope(|s| {
        match std::thread::Builder::new().name("umdev-ring-setup".into()).spawn_scoped(s, setup) {
            Ok(thread) => thread
                .join()
                .unwrap_or_else(|_| Err(io::Error::other("the thread setting up the ring panicked"))),
            // No thread to be had (a process or cgroup limit): set up here after all, rather than
            // reported as kernel pins being unavailable.
            Err(_) => setup(),
        }
    })
}

/// A space's ring and its table of registered buffers (see the module documentation).
pub(crate) struct KernelTable {
    ring: io_uring::IoUring,
    /// Slots in the table.
    size: u32,
    state: SpinLock<TableState>,
}

impl std::fmt::Debug for KernelTable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KernelTable").field("size", &self.size).finish_non_exhaustive()
    }
}

/// The table's slots in use, and what it counts (under its lock, a leaf).
#[derive(Debug, Default)]
struct TableState {
    /// Bit `i`: slot `i` is reserved (registered, or about to be).
    used: Vec<u64>,
    free: u32,
    counts: KernelCounts,
}

/// What a kernel table counted (kernel calls, buffers, pages, cut runs) and holds now, for
/// `DmaSpace::stats`.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct KernelCounts {
    /// Registrations (one per pin call) and clears (one per guard or kept buffer).
    pub(crate) pin_calls: u64,
    pub(crate) unpin_calls: u64,
    /// Buffers and pages registered, and runs cut into more than one buffer.
    pub(crate) buffers: u64,
    pub(crate) pages: u64,
    pub(crate) cut_runs: u64,
    /// Buffers and pages registered now.
    pub(crate) held_buffers: u64,
    pub(crate) held_pages: u64,
}

impl TableState {
    fn new(size: u32) -> Self {
        let words = (size as usize).div_ceil(64);
        let mut used = vec![0u64; words];
        // Bits past the table's end are taken for good.
        if !size.is_multiple_of(64) {
            used[words - 1] = !0u64 << (size % 64);
        }
        TableState { used, free: size, ..TableState::default() }
    }

    fn is_used(&self, slot: u32) -> bool {
        self.used[slot as usize / 64] & (1 << (slot % 64)) != 0
    }

    fn mark(&mut self, first: u32, n: u32, used: bool) {
        for slot in first..first + n {
            let (word, bit) = (slot as usize / 64, slot % 64);
            debug_assert_eq!(self.used[word] & (1 << bit) != 0, !used, "slot {slot} marked twice");
            if used {
                self.used[word] |= 1 << bit;
            } else {
                self.used[word] &= !(1 << bit);
            }
        }
        if used {
            self.free -= n;
        } else {
            self.free += n;
        }
    }

    /// The first of the lowest `n` consecutive free slots, reserved; `None` if there are
    /// none. The lowest: the kernel registering a buffer of huge pages looks through the
    /// table's slots from the first for one holding the same huge page (io_uring's
    /// `headpage_already_acct`), so buffers kept low are found soonest.
    fn reserve(&mut self, n: u32, size: u32) -> Option<u32> {
        if n == 0 || n > self.free {
            return None;
        }
        if n == 1 {
            // The usual call: one run, the lowest free slot.
            let (word, bits) = self.used.iter().enumerate().find(|(_, &w)| w != !0)?;
            let at = word as u32 * 64 + bits.trailing_ones();
            self.mark(at, 1, true);
            return Some(at);
        }
        let mut at = 0;
        while at + n <= size {
            if at % 64 == 0 && self.used[at as usize / 64] == !0 {
                // A whole word in use.
                at += 64;
                continue;
            }
            match (at..at + n).find(|&s| self.is_used(s)) {
                None => {
                    self.mark(at, n, true);
                    return Some(at);
                }
                Some(taken) => at = taken + 1,
            }
        }
        None
    }
}

/// The buffers of a pin call's runs: `(host address, bytes)` of each, runs longer than
/// [`KERNEL_BUFFER_BYTES`] cut into several.
pub(crate) type Buffers = SmallVec<[libc::iovec; 8]>;

/// Buffers a run of `npages` pages takes.
#[inline]
pub(crate) fn buffers_of(npages: u64) -> u64 {
    npages.div_ceil(KERNEL_BUFFER_PAGES)
}

/// Appends the buffers of a run of `npages` pages at `host` to `out`; true if the run was
/// cut (longer than one buffer).
pub(crate) fn push_buffers(out: &mut Buffers, host: usize, npages: u64) -> bool {
    let mut done = 0;
    while done < npages {
        let n = (npages - done).min(KERNEL_BUFFER_PAGES);
        out.push(libc::iovec {
            iov_base: (host + (done * PAGE_SIZE) as usize) as *mut libc::c_void,
            iov_len: (n * PAGE_SIZE) as usize,
        });
        done += n;
    }
    npages > KERNEL_BUFFER_PAGES
}

/// Null buffers: an update with them clears slots.
static NULLS: Nulls = Nulls([libc::iovec { iov_base: std::ptr::null_mut(), iov_len: 0 }; 64]);

/// Null `iovec`s, which may sit in a static: they point nowhere.
struct Nulls([libc::iovec; 64]);

// SAFETY: (local) null pointers and zero lengths: nothing is reached through them.
unsafe impl Sync for Nulls {}

/// A kernel registration that failed: which buffer (of the call's), and why.
#[derive(Debug)]
pub(crate) struct RegisterFailure {
    pub(crate) buffer: usize,
    pub(crate) error: io::Error,
}

impl KernelTable {
    /// A ring with a sparse table of `size` slots (at most [`MAX_KERNEL_BUFFERS`]).
    pub(crate) fn new(size: u32) -> Result<Self, KernelPinsUnavailable> {
        let size = size.clamp(1, MAX_KERNEL_BUFFERS);
        let ring = ring_of_its_own_thread().map_err(|e| KernelPinsUnavailable::new("io_uring_setup", &e))?;
        ring.submitter()
            .register_buffers_sparse(size)
            .map_err(|e| KernelPinsUnavailable::new("registering a sparse buffer table", &e))?;
        Ok(KernelTable { ring, size, state: SpinLock::new(TableState::new(size)) })
    }

    /// Slots in the table.
    pub(crate) fn size(&self) -> u32 {
        self.size
    }

    /// The ring whose table holds the buffers.
    pub(crate) fn ring_fd(&self) -> BorrowedFd<'_> {
        // SAFETY: (local) the ring owns the fd and lives as long as the borrow of `self`.
        unsafe { BorrowedFd::borrow_raw(self.ring.as_raw_fd()) }
    }

    /// Reserves `n` consecutive slots; the first, or the slots free now if there is no such
    /// range.
    pub(crate) fn reserve(&self, n: u32) -> Result<u32, u32> {
        let mut state = self.state.lock();
        let free = state.free;
        state.reserve(n, self.size).ok_or(free)
    }

    /// Gives back slots reserved with [`KernelTable::reserve`] and never registered (or
    /// cleared already).
    pub(crate) fn unreserve(&self, first: u32, n: u32) {
        self.state.lock().mark(first, n, false);
    }

    /// `IORING_REGISTER_BUFFERS_UPDATE` of `bufs` into slots from `first`: how many the
    /// kernel took before one failed, or its error if it took none. The `io-uring` crate's
    /// own update drops that count, which a call that fails part-way needs.
    fn update(&self, first: u32, bufs: &[libc::iovec]) -> io::Result<usize> {
        let arg = RsrcUpdate2 {
            offset: first,
            data: bufs.as_ptr() as u64,
            nr: u32::try_from(bufs.len()).map_err(|_| io::Error::from_raw_os_error(libc::E2BIG))?,
            ..RsrcUpdate2::default()
        };
        // SAFETY: (local) the argument is a valid `io_uring_rsrc_update2` naming `bufs.len()`
        // iovecs that live across the call; the kernel reads them and, for a null base, clears
        // the slot. What a buffer's pages are is the caller's contract (`register`).
        let ret = unsafe {
            libc::syscall(
                libc::SYS_io_uring_register,
                self.ring.as_raw_fd(),
                IORING_REGISTER_BUFFERS_UPDATE,
                &arg as *const RsrcUpdate2,
                std::mem::size_of::<RsrcUpdate2>() as libc::c_uint,
            )
        };
        if ret < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(ret as usize)
    }

    /// Registers `bufs` into the slots reserved from `first` (one kernel call), all or none:
    /// on failure what was registered is cleared, the slots are given back, and the failing
    /// buffer and its error are returned. `runs` and `cut` are the call's runs and runs cut
    /// into more than one buffer, for the counts.
    ///
    /// # Safety
    /// Every buffer lies in memory mapped in this process, and stays mapped until the slots
    /// are cleared ([`KernelTable::release`]).
    pub(crate) unsafe fn register(
        &self,
        first: u32,
        bufs: &[libc::iovec],
        pages: u64,
        cut: u64,
    ) -> Result<(), RegisterFailure> {
        let mut done = 0;
        while done < bufs.len() {
            match self.update(first + done as u32, &bufs[done..]) {
                Ok(0) => {
                    let error = io::Error::other("the kernel registered no buffer");
                    return Err(self.undo(first, bufs.len(), done, error));
                }
                Ok(n) => done += n,
                Err(error) if error.kind() == io::ErrorKind::Interrupted => {}
                Err(error) => return Err(self.undo(first, bufs.len(), done, error)),
            }
        }
        let counts = &mut self.state.lock().counts;
        counts.pin_calls += 1;
        counts.buffers += bufs.len() as u64;
        counts.pages += pages;
        counts.cut_runs += cut;
        counts.held_buffers += bufs.len() as u64;
        counts.held_pages += pages;
        Ok(())
    }

    /// Clears the first `done` of `n` slots from `first` (registered by a call that then
    /// failed) and gives all `n` back.
    #[cold]
    fn undo(&self, first: u32, n: usize, done: usize, error: io::Error) -> RegisterFailure {
        if done > 0 && self.clear(first, done).is_err() {
            // Kept reserved: a slot still holding a buffer must not be handed out again.
            self.unreserve(first + done as u32, (n - done) as u32);
            return RegisterFailure { buffer: done, error };
        }
        self.unreserve(first, n as u32);
        RegisterFailure { buffer: done, error }
    }

    /// Clears `n` slots from `first`: the kernel lets go of their pins (at once, unless an
    /// I/O still uses a buffer, which keeps its pages until it completes).
    fn clear(&self, first: u32, n: usize) -> io::Result<()> {
        let mut done = 0;
        while done < n {
            let k = (n - done).min(NULLS.0.len());
            match self.update(first + done as u32, &NULLS.0[..k]) {
                Ok(0) => return Err(io::Error::other("the kernel cleared no slot")),
                Ok(k) => done += k,
                Err(error) if error.kind() == io::ErrorKind::Interrupted => {}
                Err(error) => return Err(error),
            }
        }
        Ok(())
    }

    /// Lets go of `n` buffers (`pages` pages) registered from `first`: clears their slots
    /// (one kernel call) and frees them. A slot the kernel would not clear (it never
    /// refuses a clear of a registered slot) stays reserved, its buffer pinned until the
    /// space's ring closes, and is logged.
    pub(crate) fn release(&self, first: u32, n: u32, pages: u64) {
        let cleared = self.clear(first, n as usize);
        let mut state = self.state.lock();
        state.counts.unpin_calls += 1;
        state.counts.held_buffers -= u64::from(n);
        state.counts.held_pages -= pages;
        match cleared {
            Ok(()) => state.mark(first, n, false),
            Err(e) => {
                drop(state);
                log::error!(
                    "clearing {n} registered buffers from slot {first} failed ({e}); they stay pinned"
                );
            }
        }
    }

    /// What the table counted, and holds now.
    pub(crate) fn counts(&self) -> KernelCounts {
        self.state.lock().counts
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Why kernel pins are refused, and what to do, by errno and `kernel.io_uring_disabled`:
    /// the failure injected, no sysctl changed (tests run side by side).
    #[test]
    fn a_refusal_says_why_and_what_to_do() {
        let refused = |errno: i32, disabled: &str| {
            KernelPinsUnavailable::explained("io_uring_setup", &io::Error::from_raw_os_error(errno), disabled)
        };
        let off = refused(libc::EPERM, "2");
        assert_eq!((off.step, off.errno), ("io_uring_setup", libc::EPERM));
        let text = off.to_string();
        assert!(
            text.starts_with("kernel pins need io_uring buffer registration, and io_uring_setup failed: "),
            "{text}"
        );
        assert!(text.contains("io_uring is disabled (sysctl kernel.io_uring_disabled = 2)"), "{text}");
        assert!(text.contains("`sysctl -w kernel.io_uring_disabled=0` enables it"), "{text}");
        let group = refused(libc::EPERM, "1").to_string();
        assert!(group.contains("limited to CAP_SYS_ADMIN and the io_uring group"), "{group}");
        assert!(group.contains("kernel.io_uring_group"), "{group}");
        // EPERM with the sysctl at 0 (or none): not the sysctl's doing.
        for disabled in ["0", ""] {
            let filter = refused(libc::EPERM, disabled).to_string();
            assert!(
                filter.contains("a seccomp filter or an LSM policy") && filter.contains("allow"),
                "{filter}"
            );
            assert!(!filter.contains("io_uring_disabled"), "{filter}");
        }
        assert!(refused(libc::ENOSYS, "0").to_string().contains("CONFIG_IO_URING"));
        assert!(refused(libc::ENOMEM, "0").to_string().contains("RLIMIT_MEMLOCK"));
    }

    /// A failure with no errno (the ring's setup thread panicked) is reported as EIO, never
    /// as errno 0.
    #[test]
    fn a_failure_without_an_errno_is_eio() {
        let panicked = io::Error::other("the thread setting up the ring panicked");
        let refused = KernelPinsUnavailable::explained("io_uring_setup", &panicked, "0");
        assert_eq!(refused.errno, libc::EIO);
        assert!(refused.to_string().contains("the thread setting up the ring panicked"), "{refused}");
    }

    #[test]
    fn slots_are_reserved_in_consecutive_ranges_and_given_back() {
        let mut state = TableState::new(100);
        assert_eq!(state.reserve(60, 100), Some(0));
        assert_eq!(state.reserve(50, 100), None, "only 40 left");
        assert_eq!(state.reserve(40, 100), Some(60));
        assert_eq!(state.free, 0);
        state.mark(10, 5, false);
        state.mark(70, 3, false);
        assert_eq!(state.reserve(4, 100), Some(10), "the lowest range that fits");
        assert_eq!(state.reserve(3, 100), Some(70), "the next one that fits");
        assert_eq!(state.reserve(1, 100), Some(14));
        assert_eq!(state.reserve(1, 100), None);
        assert_eq!(state.free, 0);
    }

    #[test]
    fn a_table_skips_whole_words_in_use_and_never_hands_out_slots_past_its_end() {
        let mut state = TableState::new(130);
        assert_eq!(state.reserve(128, 130), Some(0));
        assert_eq!(state.reserve(3, 130), None);
        assert_eq!(state.reserve(2, 130), Some(128));
        state.mark(0, 128, false);
        assert_eq!(state.reserve(64, 130), Some(0));
        assert_eq!(state.reserve(64, 130), Some(64));
        assert_eq!(state.reserve(1, 130), None);
    }

    #[test]
    fn runs_longer_than_a_buffer_are_cut() {
        let mut out = Buffers::new();
        assert!(!push_buffers(&mut out, 0x1000, 3));
        assert!(push_buffers(&mut out, 0x10_0000, 2 * KERNEL_BUFFER_PAGES + 1));
        let lens: Vec<usize> = out.iter().map(|b| b.iov_len).collect();
        assert_eq!(lens, [3 * 4096, 1 << 30, 1 << 30, 4096]);
        assert_eq!(out[3].iov_base as usize, 0x10_0000 + (2 << 30));
        assert_eq!(buffers_of(2 * KERNEL_BUFFER_PAGES + 1), 3);
    }
}
