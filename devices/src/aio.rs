//! Asynchronous file I/O for a device's worker thread, through io_uring: transfers between a
//! store's files and pinned guest memory handed to the kernel, many at once, their ends
//! reaped in the order the host finishes them.
//!
//! A [`Ring`] belongs to one worker thread. The worker starts a transfer with a payload (what
//! must live as long as the kernel may use the memory: the request holding its pins) and gets
//! the payload back with the transfer's result from [`Ring::reap`]. Short transfers are
//! continued here, and one the kernel refuses as misaligned (EINVAL from an O_DIRECT file) is
//! retried on the buffered file the caller named ([`Request::fallback`]).
//!
//! **Bounds.** At most the ring's capacity of transfers in flight, one submission entry each,
//! on a ring with room for all of them and twice as many completions (none is ever dropped);
//! the kernel's worker pool for I/O that blocks is capped per worker thread ([`IO_WORKERS`]);
//! a vectored transfer keeps its iovecs in its slot, allocated once and reused.
//!
//! **Sleeping.** The ring is where its worker sleeps ([`KernelSleep`]): a poll of the worker
//! bell's eventfd stays armed on it, so one wait ends on a doorbell, a stop or a completion.
//! A transfer that ends while its worker runs does not interrupt the worker (an IPI in a VM is
//! an exit on both sides): the kernel flags it (`COOP_TASKRUN`, `TASKRUN_FLAG`), the worker's
//! next look sees the flag ([`KernelSleep::pending`]), and its next reap ([`Ring::reap`]) or
//! sleep has the kernel post it.
//!
//! **Fixed buffers.** A transfer whose memory is one buffer registered in another ring (the
//! DMA space's table of kernel pins: `--pin-mode kernel`) moves as `READ_FIXED`/`WRITE_FIXED`
//! through a clone of that buffer in this ring's own table ([`Request::fixed`]), so the host
//! takes no page pins of its own per transfer. The clone goes in the lowest free entry of the
//! table (`IORING_REGISTER_CLONE_BUFFERS`, with `DST_REPLACE` once the table exists: Linux
//! 6.13 or later; each clone rebuilds the table, which is why it stays as short as the fixed
//! transfers in flight) and is cleared before the payload comes back: the kernel's pin then
//! lasts exactly as long as the payload's own, which its owner releases. Where the kernel
//! cannot clone (older kernels), the first refusal turns fixed buffers off for the ring,
//! logged, and transfers move as plain reads and writes. The clone and the clear are two
//! `io_uring_register` calls per transfer: worth it only where they cost less than the page
//! pins they spare (the caller decides).
//!
//! What it is not: shared between threads, or a scheduler. It never drops a payload while the
//! kernel may still use its memory: [`Ring::quiesce`] cancels and waits (boundedly), and a
//! ring dropped (or detached) with transfers left hands them to the process's one draining thread,
//! which waits for the kernel.

use std::io;
use std::os::fd::{AsRawFd, BorrowedFd, OwnedFd, RawFd};
use std::time::{Duration, Instant};

use io_uring::{opcode, squeue, types, IoUring};
use umdev_mdev::worker::KernelSleep;

/// The kernel's workers for I/O that cannot complete without blocking (buffered writes,
/// allocating O_DIRECT writes), per worker thread: beyond this, such I/O waits its turn.
pub const IO_WORKERS: u32 = 16;
/// How often a transfer the kernel asks to retry (EAGAIN, EINTR) is submitted again before it
/// fails.
const RETRIES: u8 = 16;
/// How long a ring dropped with transfers in flight waits for them before a thread takes
/// them over.
const DROP_WAIT: Duration = Duration::from_secs(1);
/// The user data of the bell's eventfd poll, and of a cancellation.
const KICK: u64 = u64::MAX;
const CANCEL: u64 = u64::MAX - 1;

/// What a transfer does.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Op {
    /// File to memory.
    Read,
    /// Memory to file.
    Write,
    /// `fdatasync` of the file (no memory).
    Sync,
}

/// One transfer to start.
#[derive(Clone, Copy, Debug)]
pub struct Request<'a> {
    /// What it does.
    pub op: Op,
    /// The file: its index among the ring's files.
    pub file: u32,
    /// If the kernel refuses the transfer on `file` with EINVAL (misaligned for O_DIRECT), it
    /// is started again on this file (the same file, buffered).
    pub fallback: Option<u32>,
    /// Where in the file.
    pub pos: u64,
    /// The memory, in order: (host address, bytes) per piece. Empty for [`Op::Sync`].
    pub segments: &'a [(usize, usize)],
    /// A write is durable before it completes (`RWF_DSYNC`: forced unit access).
    pub dsync: bool,
    /// The memory is all in this registered buffer of another ring (one segment only): the
    /// transfer may move through a clone of it ([`Request::fixed`] is a hint: without a
    /// clone it moves as a plain read or write).
    pub fixed: Option<FixedBuffer>,
}

/// A buffer registered in another io_uring's table.
#[derive(Clone, Copy, Debug)]
pub struct FixedBuffer {
    /// The ring whose table holds it: open at least until [`Ring::start`] returns (the
    /// payload keeps it so, as it keeps the buffer registered).
    pub ring: RawFd,
    /// Its index there.
    pub index: u32,
}

/// A ring's table of clones of other rings' buffers. A clone with `DST_REPLACE` rebuilds the
/// whole table, so it is kept as short as the fixed transfers in flight: each takes the
/// lowest free entry.
#[derive(Debug, Default)]
struct FixedTable {
    /// The kernel refused a clone: plain transfers only.
    unavailable: bool,
    /// Entries of the kernel's table (it grows with the highest entry cloned into; none
    /// until the first clone, which makes it).
    len: u32,
    /// Entries holding a clone, a bit each.
    used: Vec<u64>,
}

impl FixedTable {
    /// The lowest entry holding no clone.
    fn lowest_free(&self) -> u32 {
        let word = self.used.iter().position(|w| *w != u64::MAX).unwrap_or(self.used.len());
        let bit = self.used.get(word).map_or(0, |w| w.trailing_ones());
        word as u32 * 64 + bit
    }

    fn mark(&mut self, entry: u32, used: bool) {
        let (word, bit) = ((entry / 64) as usize, entry % 64);
        if self.used.len() <= word {
            self.used.resize(word + 1, 0);
        }
        if used {
            self.used[word] |= 1 << bit;
        } else {
            self.used[word] &= !(1 << bit);
        }
    }
}

/// A transfer in flight, in its slot.
struct Slot<T> {
    payload: Option<T>,
    op: Op,
    file: u32,
    fallback: Option<u32>,
    pos: u64,
    flags: i32,
    /// The memory; `iov[first..]` is what is left to move (the first possibly part-done).
    iov: Vec<libc::iovec>,
    first: usize,
    done: u64,
    total: u64,
    retries: u8,
    /// The entry of the ring's table that holds a clone of the registered buffer holding the
    /// memory (cleared when the transfer ends)...
    cloned: Option<u16>,
    /// ...and the transfer moves through it.
    fixed: bool,
}

impl<T> Slot<T> {
    fn empty() -> Slot<T> {
        Slot {
            payload: None,
            op: Op::Sync,
            file: 0,
            fallback: None,
            pos: 0,
            flags: 0,
            iov: Vec::new(),
            first: 0,
            done: 0,
            total: 0,
            retries: 0,
            cloned: None,
            fixed: false,
        }
    }

    /// Steps over `n` bytes moved.
    fn advance(&mut self, mut n: u64) {
        self.done += n;
        while n > 0 && self.first < self.iov.len() {
            let v = &mut self.iov[self.first];
            if n >= v.iov_len as u64 {
                n -= v.iov_len as u64;
                self.first += 1;
            } else {
                // SAFETY: (local) stays inside the piece: n < iov_len.
                v.iov_base = unsafe { v.iov_base.cast::<u8>().add(n as usize) }.cast();
                v.iov_len -= n as usize;
                n = 0;
            }
        }
    }
}

/// One worker's io_uring: its files, its transfers in flight, and where it sleeps.
pub struct Ring<T: Send + 'static> {
    /// `None` only once a dropped ring handed it to a draining thread.
    uring: Option<IoUring>,
    slots: Box<[Slot<T>]>,
    free: Vec<u32>,
    in_flight: usize,
    /// The worker bell's eventfd, polled (multishot) while `kick_armed`.
    kick: Option<OwnedFd>,
    kick_armed: bool,
    /// A cancellation's completion is still to come.
    cancelling: bool,
    /// [`Ring::quiesce`] cancels first (off only in tests: a held transfer stays held).
    cancel_on_quiesce: bool,
    /// Left to the draining thread ([`Ring::detach`]): a submission that ends ends its
    /// transfer, whatever is left of it. Its command was ended by a reset, a deletion or a
    /// disconnect: continuing it (the rest of a short write, a retry, the buffered fallback)
    /// would put data on the disk that the host no longer expects, after newer writes.
    left: bool,
    /// Clones of other rings' buffers, an entry per fixed transfer in flight.
    fixed: FixedTable,
}

// SAFETY: the raw pointers in the slots' iovecs address memory their payloads keep valid
// (the caller's contract of `Ring::start`), wherever the ring is; a ring is used by one
// thread at a time (`&mut self` everywhere), and handed to another thread only whole.
unsafe impl<T: Send + 'static> Send for Ring<T> {}

impl<T: Send + 'static> Ring<T> {
    /// A ring for `capacity` transfers in flight on `files` (their indexes are the
    /// [`Request::file`]s), sleeping on `kick` too (a worker bell's eventfd) if given.
    pub fn new(capacity: u32, files: &[BorrowedFd<'_>], kick: Option<BorrowedFd<'_>>) -> io::Result<Ring<T>> {
        let capacity = capacity.max(1);
        // Room for every transfer, the eventfd poll and a cancellation.
        let entries = (capacity + 2).next_power_of_two();
        // Completions the kernel finishes while the worker runs wait for its next look
        // (the TASKRUN flag, [`Ring::run_task_work`]) instead of interrupting it with an IPI
        // each; kernels before 5.19 refuse the flags, and interrupt.
        let uring = IoUring::builder()
            .setup_cqsize(2 * entries)
            .setup_coop_taskrun()
            .setup_taskrun_flag()
            .build(entries)
            .or_else(|_| IoUring::builder().setup_cqsize(2 * entries).build(entries))?;
        if !files.is_empty() {
            let fds: Vec<RawFd> = files.iter().map(|f| f.as_raw_fd()).collect();
            uring.submitter().register_files(&fds)?;
        }
        let mut max = [IO_WORKERS, IO_WORKERS];
        // Older kernels lack the cap: the kernel's own bound (by CPUs and RLIMIT_NPROC) holds.
        let _ = uring.submitter().register_iowq_max_workers(&mut max);
        let kick = kick.map(|k| k.try_clone_to_owned()).transpose()?;
        Ok(Ring {
            uring: Some(uring),
            slots: (0..capacity).map(|_| Slot::empty()).collect(),
            free: (0..capacity).rev().collect(),
            in_flight: 0,
            kick,
            kick_armed: false,
            cancelling: false,
            cancel_on_quiesce: true,
            left: false,
            fixed: FixedTable::default(),
        })
    }

    fn uring(&mut self) -> &mut IoUring {
        self.uring.as_mut().expect("the ring is taken only when dropped")
    }

    /// Transfers in flight at most.
    pub fn capacity(&self) -> usize {
        self.slots.len()
    }

    /// Transfers in flight now.
    pub fn in_flight(&self) -> usize {
        self.in_flight
    }

    /// Whether another transfer can start.
    pub fn has_room(&self) -> bool {
        !self.free.is_empty()
    }

    /// Starts `request`, whose end [`Ring::reap`] reports with `payload`. The submission may
    /// wait in the ring until the next [`Ring::submit`] (or sleep, or reap). `Err` gives the
    /// payload back, untouched by the kernel: no room, a request of more pieces than a
    /// vectored call takes, or the ring refused.
    ///
    /// # Safety
    /// Every segment must stay valid for the kernel to read (a write) or write (a read) until
    /// `payload` comes back, or for good if it never does: the payload must keep it so (it
    /// holds the memory's pins).
    pub unsafe fn start(&mut self, payload: T, request: &Request<'_>) -> Result<(), (T, io::Error)> {
        if request.segments.len() > libc::UIO_MAXIOV as usize {
            return Err((payload, io::Error::from_raw_os_error(libc::EINVAL)));
        }
        let Some(index) = self.free.pop() else {
            return Err((payload, io::Error::from_raw_os_error(libc::EBUSY)));
        };
        let slot = &mut self.slots[index as usize];
        slot.op = request.op;
        slot.file = request.file;
        slot.fallback = request.fallback;
        slot.pos = request.pos;
        slot.flags = if request.dsync && request.op == Op::Write { libc::RWF_DSYNC } else { 0 };
        slot.iov.clear();
        slot.iov.extend(
            request
                .segments
                .iter()
                .map(|&(addr, len)| libc::iovec { iov_base: addr as *mut _, iov_len: len }),
        );
        slot.first = 0;
        slot.done = 0;
        slot.total = request.segments.iter().map(|s| s.1 as u64).sum();
        slot.retries = 0;
        slot.cloned = None;
        slot.fixed = false;
        slot.payload = Some(payload);
        self.in_flight += 1;
        if let (Some(buffer), [_], Op::Read | Op::Write) = (request.fixed, request.segments, request.op) {
            let cloned = self.clone_buffer(buffer);
            let slot = &mut self.slots[index as usize];
            (slot.cloned, slot.fixed) = (cloned, cloned.is_some());
        }
        if let Err(e) = self.push_slot(index) {
            let (payload, _) = self.finish(index).expect("just put there");
            return Err((payload, e));
        }
        Ok(())
    }

    /// The submission entry of slot `index`'s transfer (what is left of it), queued.
    fn push_slot(&mut self, index: u32) -> io::Result<()> {
        let s = &self.slots[index as usize];
        let fd = types::Fixed(s.file);
        let at = s.pos + s.done;
        let iov = &s.iov[s.first..];
        // The table entry whose clone holds the memory (`start`), if the transfer uses it.
        let fixed = s.cloned.filter(|_| s.fixed);
        let entry = match (s.op, iov, fixed) {
            (Op::Sync, _, _) => opcode::Fsync::new(fd).flags(types::FsyncFlags::DATASYNC).build(),
            (Op::Read, [one], Some(buf)) => {
                opcode::ReadFixed::new(fd, one.iov_base.cast(), one.iov_len as u32, buf).offset(at).build()
            }
            (Op::Write, [one], Some(buf)) => {
                opcode::WriteFixed::new(fd, one.iov_base.cast(), one.iov_len as u32, buf)
                    .offset(at)
                    .rw_flags(s.flags)
                    .build()
            }
            (Op::Read, [one], _) => {
                opcode::Read::new(fd, one.iov_base.cast(), one.iov_len as u32).offset(at).build()
            }
            (Op::Write, [one], _) => opcode::Write::new(fd, one.iov_base.cast(), one.iov_len as u32)
                .offset(at)
                .rw_flags(s.flags)
                .build(),
            (Op::Read, _, _) => opcode::Readv::new(fd, iov.as_ptr(), iov.len() as u32).offset(at).build(),
            (Op::Write, _, _) => {
                opcode::Writev::new(fd, iov.as_ptr(), iov.len() as u32).offset(at).rw_flags(s.flags).build()
            }
        };
        self.push(entry.user_data(u64::from(index)))
    }

    /// Queues `entry`, submitting what waits first if the queue is full (it has room for
    /// every transfer, so only unsubmitted entries can fill it).
    fn push(&mut self, entry: squeue::Entry) -> io::Result<()> {
        for _ in 0..2 {
            // SAFETY: the entry's memory (iovecs in a slot, the slot's segments, which the
            // payload keeps valid) lives until its completion is reaped (see `start`).
            if unsafe { self.uring().submission().push(&entry) }.is_ok() {
                return Ok(());
            }
            self.submit()?;
        }
        Err(io::Error::from_raw_os_error(libc::EAGAIN))
    }

    /// Submissions queued and not yet handed to the kernel.
    pub fn queued(&mut self) -> usize {
        self.uring().submission().len()
    }

    /// Hands the queued submissions to the kernel.
    pub fn submit(&mut self) -> io::Result<()> {
        let uring = self.uring();
        if uring.submission().is_empty() {
            return Ok(());
        }
        match uring.submit() {
            Ok(_) => Ok(()),
            // Busy (completions to reap first), out of request memory, or a signal: the
            // entries stay queued for the next call.
            Err(e) if matches!(e.raw_os_error(), Some(libc::EBUSY | libc::EAGAIN | libc::EINTR)) => Ok(()),
            Err(e) => Err(e),
        }
    }

    /// Ends slot `index`: its clone of a registered buffer cleared (so the kernel's pin of
    /// the memory is the payload's alone again), its payload back with whether the transfer
    /// moved through the clone, the slot free.
    fn finish(&mut self, index: u32) -> Option<(T, bool)> {
        let slot = &mut self.slots[index as usize];
        let payload = slot.payload.take()?;
        let fixed = std::mem::take(&mut slot.fixed);
        if let Some(entry) = slot.cloned.take() {
            self.clear_buffer(entry);
        }
        self.in_flight -= 1;
        self.free.push(index);
        Some((payload, fixed))
    }

    /// Clones `buffer` into the lowest free entry of this ring's table: the entry, or `None`
    /// if it cannot be had (the transfer then moves as a plain read or write).
    fn clone_buffer(&mut self, buffer: FixedBuffer) -> Option<u16> {
        if self.fixed.unavailable {
            return None;
        }
        // At most one entry per transfer in flight: the capacity, which fits a u16 (`new`).
        let entry = self.fixed.lowest_free();
        let entry16 = u16::try_from(entry).ok()?;
        // The first clone makes the table; later ones replace an entry in it.
        let flags = if self.fixed.len == 0 {
            types::CloneBuffersFlags::empty()
        } else {
            types::CloneBuffersFlags::DST_REPLACE
        };
        let cloned = self.uring().submitter().register_buffers_clone_offset(
            buffer.ring,
            buffer.index,
            entry,
            1,
            flags,
        );
        match cloned {
            Ok(()) => {
                self.fixed.mark(entry, true);
                self.fixed.len = self.fixed.len.max(entry + 1);
                Some(entry16)
            }
            // The kernel has no clones into a table that has slots (before 6.13), or none at
            // all (before 6.12): it never will.
            Err(e) if matches!(e.raw_os_error(), Some(libc::EINVAL | libc::EOPNOTSUPP | libc::EBUSY)) => {
                log::info!("aio: registered buffers cannot be cloned here ({e}): plain transfers");
                self.fixed.unavailable = true;
                None
            }
            Err(e) => {
                log::debug!("aio: cloning registered buffer {}: {e}", buffer.index);
                None
            }
        }
    }

    /// Clears `entry` of the table, a transfer's clone of a registered buffer.
    fn clear_buffer(&mut self, entry: u16) {
        let none = [libc::iovec { iov_base: std::ptr::null_mut(), iov_len: 0 }];
        // SAFETY: an empty entry registers no memory; it only drops the clone, which no
        // transfer uses any more (its completion was reaped; a request the kernel still had
        // would hold its own reference to the buffer).
        let cleared = unsafe { self.uring().submitter().register_buffers_update(entry.into(), &none, None) };
        match cleared {
            Ok(()) => self.fixed.mark(entry.into(), false),
            Err(e) => {
                // The clone keeps the memory pinned until the ring goes: no more clones.
                log::warn!("aio: clearing fixed buffer {entry}: {e}; plain transfers from now on");
                self.fixed.unavailable = true;
            }
        }
    }

    /// Reports every transfer the kernel has finished since the last call, in the order it
    /// finished them: `done(payload, Ok(bytes) or the error, whether it moved through a fixed
    /// buffer)`. A part-done transfer is continued, a refused O_DIRECT one retried buffered,
    /// neither reported yet. Returns how many were reported.
    pub fn reap(&mut self, mut done: impl FnMut(T, io::Result<u64>, bool)) -> usize {
        self.run_task_work();
        let mut reported = 0;
        loop {
            let Some(cqe) = self.uring().completion().next() else { break };
            let (tag, res, flags) = (cqe.user_data(), cqe.result(), cqe.flags());
            match tag {
                KICK => self.kick_armed = io_uring::cqueue::more(flags),
                CANCEL => self.cancelling = false,
                _ => {
                    if let Some((payload, result, fixed)) = self.complete(tag as u32, res) {
                        done(payload, result, fixed);
                        reported += 1;
                    }
                }
            }
        }
        reported
    }

    /// Slot `index`'s submission ended with `res`: the payload and its result if the
    /// transfer is over, `None` if it goes on.
    fn complete(&mut self, index: u32, res: i32) -> Option<(T, io::Result<u64>, bool)> {
        let s = self.slots.get_mut(index as usize)?;
        s.payload.as_ref()?;
        let outcome = if self.left {
            Some(Err(io::Error::from_raw_os_error(libc::ECANCELED)))
        } else if res < 0 {
            match -res {
                libc::EAGAIN | libc::EINTR if s.retries < RETRIES => {
                    s.retries += 1;
                    None
                }
                // The clone was not there when the kernel looked it up (a kernel whose
                // DST_REPLACE clone drops the entries above the one it replaces: 6.13 to
                // 6.18 before their stable fix): the rest moves plain, the payload still
                // holding the memory.
                libc::EFAULT if s.fixed => {
                    log::debug!("aio: fixed buffer {index} not found: a plain transfer instead");
                    s.fixed = false;
                    None
                }
                libc::EINVAL if s.fallback.is_some() && s.op != Op::Sync => {
                    log::debug!(
                        "aio: O_DIRECT refused a transfer of {} bytes at {}: buffered",
                        s.total,
                        s.pos
                    );
                    s.file = s.fallback.take().expect("checked");
                    None
                }
                errno => Some(Err(io::Error::from_raw_os_error(errno))),
            }
        } else if s.op == Op::Sync {
            Some(Ok(0))
        } else if res == 0 && s.done < s.total {
            Some(Err(match s.op {
                Op::Read => io::Error::new(io::ErrorKind::UnexpectedEof, "the backing file ended early"),
                _ => io::Error::new(io::ErrorKind::WriteZero, "the backing file took no bytes"),
            }))
        } else {
            s.advance(res as u64);
            (s.done >= s.total).then_some(Ok(s.done))
        };
        let end =
            |ring: &mut Self, result| ring.finish(index).map(|(payload, fixed)| (payload, result, fixed));
        match outcome {
            Some(result) => end(self, result),
            None => match self.push_slot(index) {
                Ok(()) => None,
                Err(e) => end(self, Err(e)),
            },
        }
    }

    /// Asks the kernel to cancel every transfer in flight (those it can still stop end with
    /// ECANCELED; the rest finish as they would have).
    pub fn cancel_all(&mut self) {
        if self.in_flight == 0 || self.cancelling {
            return;
        }
        let entry = opcode::AsyncCancel2::new(types::CancelBuilder::any()).build().user_data(CANCEL);
        if self.push(entry).is_ok() {
            self.cancelling = true;
        }
        let _ = self.submit();
    }

    /// Waits until at least one completion is there, or `timeout` passes.
    fn wait(&mut self, timeout: Option<Duration>) {
        let uring = self.uring();
        let r = match timeout {
            Some(t) => {
                let ts = types::Timespec::from(t);
                let args = types::SubmitArgs::new().timespec(&ts);
                uring.submitter().submit_with_args(1, &args)
            }
            None => uring.submit_and_wait(1),
        };
        if let Err(e) = r {
            if !matches!(e.raw_os_error(), Some(libc::ETIME | libc::EINTR | libc::EBUSY | libc::EAGAIN)) {
                log::warn!("aio: waiting for completions: {e}");
                // Not a spin: the caller goes on, and sleeps in the thread's own way next.
                std::thread::sleep(timeout.unwrap_or(Duration::from_millis(1)).min(Duration::from_millis(1)));
            }
        }
    }

    /// Has the kernel post the completions it finished while this thread ran (their work
    /// waits for the thread's next entry into the kernel, which this is, where the flag says
    /// there is some).
    fn run_task_work(&mut self) {
        let uring = self.uring();
        if uring.submission().taskrun() {
            // Whatever is queued goes too (the call submits it); a refusal leaves it queued.
            let _ = uring.submit_and_wait(0);
        }
    }

    /// Cancels what is in flight and waits for the kernel to finish it, at most `bound`,
    /// reporting each as [`Ring::reap`] does. Returns how many are still in the kernel.
    pub fn quiesce(&mut self, bound: Duration, mut done: impl FnMut(T, io::Result<u64>, bool)) -> usize {
        let deadline = Instant::now() + bound;
        if self.cancel_on_quiesce {
            self.cancel_all();
        }
        loop {
            self.reap(&mut done);
            let left = deadline.saturating_duration_since(Instant::now());
            if self.in_flight == 0 || left.is_zero() {
                return self.in_flight;
            }
            self.wait(Some(left));
        }
    }
}

impl<T: Send + 'static> KernelSleep for Ring<T> {
    fn pending(&mut self) -> bool {
        // What was started goes to the kernel at the first look.
        let _ = self.submit();
        let uring = self.uring();
        !uring.completion().is_empty() || uring.submission().taskrun()
    }

    fn block(&mut self, timeout: Option<Duration>) {
        if !self.kick_armed {
            if let Some(kick) = self.kick.as_ref().map(|k| k.as_raw_fd()) {
                let entry = opcode::PollAdd::new(types::Fd(kick), libc::POLLIN as u32)
                    .multi(true)
                    .build()
                    .user_data(KICK);
                self.kick_armed = self.push(entry).is_ok();
            }
        }
        self.wait(timeout);
    }
}

impl<T: Send + 'static> Drop for Ring<T> {
    fn drop(&mut self) {
        if self.in_flight == 0 || self.uring.is_none() {
            return;
        }
        // The kernel may still be using memory the payloads keep valid: they go only after it
        // is done.
        if self.quiesce(DROP_WAIT, |_, _, _| {}) == 0 {
            return;
        }
        let left = self.take_left();
        drainer::hand_over(Box::new(Left { ring: left, done: Box::new(drop) }));
    }
}

impl<T: Send + 'static> Ring<T> {
    /// The payloads of the transfers in flight.
    pub fn in_flight_payloads(&self) -> impl Iterator<Item = &T> {
        self.slots.iter().filter_map(|s| s.payload.as_ref())
    }

    /// Lets go of the ring at once: what is still in flight (once [`Ring::quiesce`] gave up,
    /// say) is left to the process's draining thread, which hands each payload to `done` as
    /// the kernel finishes its transfer (and drops it there).
    pub fn detach(mut self, done: impl FnMut(T) + Send + 'static) {
        if self.in_flight == 0 || self.uring.is_none() {
            return;
        }
        let left = self.take_left();
        drainer::hand_over(Box::new(Left { ring: left, done: Box::new(done) }));
    }

    /// Moves what is in flight, with the kernel's ring, into a ring of its own for the
    /// draining thread; `self` is left empty.
    fn take_left(&mut self) -> Ring<T> {
        log::warn!(
            "aio: {} transfer(s) still in the kernel; the draining thread waits for them",
            self.in_flight
        );
        // Nothing is to wake the draining thread but the kernel's completions: the poll of the
        // worker's bell (which its next worker rings) goes.
        if self.kick_armed {
            let _ = self.push(opcode::PollRemove::new(KICK).build().user_data(CANCEL));
            let _ = self.submit();
        }
        let left = Ring {
            uring: self.uring.take(),
            slots: std::mem::take(&mut self.slots),
            free: Vec::new(),
            in_flight: self.in_flight,
            kick: None,
            kick_armed: false,
            cancelling: false,
            cancel_on_quiesce: false,
            left: true,
            fixed: std::mem::take(&mut self.fixed),
        };
        self.in_flight = 0;
        left
    }
}

/// A ring left to the draining thread, and what it does with each payload that comes back.
struct Left<T: Send + 'static> {
    ring: Ring<T>,
    done: Box<dyn FnMut(T) + Send>,
}

impl<T: Send + 'static> drainer::Draining for Left<T> {
    fn step(&mut self) -> usize {
        // Into the kernel once, without waiting: completions this thread's own submissions
        // (what `reap` continued) owe it are posted; those of the thread that ended are
        // posted by the kernel's fallback work.
        self.ring.wait(Some(Duration::ZERO));
        let done = &mut self.done;
        self.ring.reap(|payload, _, _| done(payload));
        let _ = self.ring.submit();
        self.ring.in_flight
    }

    fn fd(&self) -> RawFd {
        self.ring.uring.as_ref().map_or(-1, |u| u.as_raw_fd())
    }
}

/// The process's one thread that waits for what rings left in the kernel: however many
/// rings a hung backing holds, they cost one thread, and it ends when the last is done.
mod drainer {
    use std::io;
    use std::os::fd::{AsRawFd, RawFd};
    use std::sync::{Mutex, OnceLock};

    use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

    /// A ring with transfers left in the kernel.
    pub(super) trait Draining: Send {
        /// Reaps what the kernel finished: the transfers still in flight.
        fn step(&mut self) -> usize;
        /// The ring's file descriptor (readable when completions wait).
        fn fd(&self) -> RawFd;
    }

    struct Drainer {
        arrived: Mutex<Arrived>,
        /// Written when a ring arrives while the thread runs.
        wake: EventFd,
    }

    #[derive(Default)]
    struct Arrived {
        rings: Vec<Box<dyn Draining>>,
        running: bool,
    }

    /// How long the thread waits in `poll` before it looks at every ring again anyway: a
    /// completion whose notice it missed costs at most this.
    const LOOK_AGAIN_MS: i32 = 1000;

    /// The drainer, made at the first hand-over that can make it (a failure to, say for want
    /// of an fd, is tried again at the next).
    fn drainer() -> Option<&'static Drainer> {
        static DRAINER: OnceLock<Drainer> = OnceLock::new();
        if let Some(d) = DRAINER.get() {
            return Some(d);
        }
        match EventFd::new(EFD_NONBLOCK) {
            Ok(wake) => Some(DRAINER.get_or_init(|| Drainer { arrived: Mutex::default(), wake })),
            Err(e) => {
                log::error!("aio: no eventfd for the draining thread ({e})");
                None
            }
        }
    }

    /// Gives `ring` to the draining thread (started if none runs). If there can be none, the
    /// ring and its payloads are kept for good rather than dropped under the kernel.
    pub(super) fn hand_over(ring: Box<dyn Draining>) {
        let Some(d) = drainer() else {
            log::error!("aio: the transfers' memory stays pinned for good");
            std::mem::forget(ring);
            return;
        };
        let mut arrived = d.arrived.lock().unwrap_or_else(|p| p.into_inner());
        arrived.rings.push(ring);
        if arrived.running {
            let _ = d.wake.write(1);
            return;
        }
        match std::thread::Builder::new().name("umdev-aio-drain".into()).spawn(move || run(d)) {
            Ok(_) => arrived.running = true,
            Err(e) => {
                log::error!("aio: no thread to wait for the kernel ({e}); the transfers' memory stays pinned for good");
                std::mem::forget(std::mem::take(&mut arrived.rings));
            }
        }
    }

    fn run(d: &'static Drainer) {
        let mut rings: Vec<Box<dyn Draining>> = Vec::new();
        let mut fds: Vec<libc::pollfd> = Vec::new();
        loop {
            // Before the look at what arrived: a ring handed over after it writes the eventfd
            // again, and the poll below sees it.
            let _ = d.wake.read();
            {
                let mut arrived = d.arrived.lock().unwrap_or_else(|p| p.into_inner());
                rings.append(&mut arrived.rings);
                if rings.is_empty() {
                    arrived.running = false;
                    return;
                }
            }
            // A panic in a payload's end (a device's bug) must not stop the draining for
            // every ring after: that ring is kept for good instead (its memory stays pinned).
            let (mut i, mut done) = (0, 0);
            while i < rings.len() {
                match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| rings[i].step())) {
                    Ok(0) => {
                        rings.swap_remove(i);
                        done += 1;
                    }
                    Ok(_) => i += 1,
                    Err(_) => {
                        log::error!(
                            "aio: ending a transfer left in the kernel panicked; its ring is kept for good"
                        );
                        std::mem::forget(rings.swap_remove(i));
                    }
                }
            }
            if done > 0 {
                log::info!("aio: {done} ring(s) left in the kernel are done");
            }
            if rings.is_empty() {
                continue;
            }
            fds.clear();
            fds.extend(rings.iter().map(|r| libc::pollfd { fd: r.fd(), events: libc::POLLIN, revents: 0 }));
            fds.push(libc::pollfd { fd: d.wake.as_raw_fd(), events: libc::POLLIN, revents: 0 });
            // SAFETY: `fds` is a valid array of `fds.len()` pollfds for the call's duration.
            let polled = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, LOOK_AGAIN_MS) };
            if polled < 0 && io::Error::last_os_error().raw_os_error() != Some(libc::EINTR) {
                // Not a spin when poll cannot be had (too many fds for the limit, no memory):
                // the rings are looked at once per LOOK_AGAIN_MS instead.
                std::thread::sleep(std::time::Duration::from_millis(LOOK_AGAIN_MS as u64));
            }
        }
    }
}

/// Whether io_uring can be used here (a kernel with it, not disabled by
/// `kernel.io_uring_disabled` or a seccomp filter): `Err` says why not.
///
/// The probe's ring is set up on a thread of its own, which then ends: the kernel ties a ring
/// to the thread that set it up, and closing it makes the wait that thread is in soon after,
/// or its next, fail with EINTR, no signal sent, if it is one a signal ends rather than
/// restarts (a socket read with `SO_RCVTIMEO`, `epoll_wait`). The caller (whoever creates a
/// device) may be serving a socket next.
pub fn available() -> io::Result<()> {
    let probe = || IoUring::new(2).map(drop);
    std::thread::scope(|s| {
        match std::thread::Builder::new().name("umdev-uring-probe".into()).spawn_scoped(s, probe) {
            Ok(thread) => thread
                .join()
                .unwrap_or_else(|_| Err(io::Error::other("the io_uring probe's thread panicked"))),
            // No thread to be had (a process or cgroup limit): probed here after all, rather than
            // mistaken for a host without io_uring.
            Err(_) => probe(),
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsFd;
    use std::os::unix::fs::FileExt;

    #[test]
    fn the_probe_leaves_the_callers_timed_waits_alone() {
        // Closing a ring makes the thread that set it up fail its next timed socket read with
        // EINTR (see `available`).
        use std::io::Read;
        if let Err(e) = available() {
            return eprintln!("SKIPPED: no io_uring here: {e}");
        }
        let (mut a, _b) = std::os::unix::net::UnixStream::pair().unwrap();
        a.set_read_timeout(Some(std::time::Duration::from_millis(200))).unwrap();
        let err = a.read(&mut [0u8; 1]).unwrap_err();
        assert_ne!(err.kind(), io::ErrorKind::Interrupted, "the read timed out as asked");
    }

    #[test]
    fn a_transfer_that_ends_while_its_thread_runs_is_reported_by_the_next_look_and_reap() {
        if let Err(e) = available() {
            return eprintln!("SKIPPED: no io_uring here: {e}");
        }
        // A pipe's read waits for a writer: another thread ends it while this one runs
        // without entering the kernel, as a worker does between its looks.
        let (rx, tx) = nix::unistd::pipe().unwrap();
        let mut ring: Ring<()> = Ring::new(2, &[rx.as_fd()], None).unwrap();
        let mut buf = [0u8; 5];
        let segs = [(buf.as_mut_ptr() as usize, 5)];
        let r = pipe_read(&segs);
        // SAFETY: `buf` outlives the transfer: it is reaped below, before `buf` is read (and a
        // ring dropped with it in flight waits for it).
        unsafe { ring.start((), &r) }.unwrap();
        ring.submit().unwrap();
        let writer = std::thread::spawn(move || nix::unistd::write(&tx, b"hello").unwrap());
        // With nothing queued, a look makes no system call.
        let deadline = Instant::now() + Duration::from_secs(60); // a hang guard only
        while !ring.pending() {
            assert!(Instant::now() < deadline, "the ended read was never seen");
            std::hint::spin_loop();
        }
        // Where the kernel only flagged the ended read for this thread (it is not interrupted
        // for it), the reap is what has the kernel post it: one reap reports it.
        let mut read = 0;
        assert_eq!(ring.reap(|(), res, _| read = res.unwrap()), 1);
        assert_eq!(read, 5);
        writer.join().unwrap();
        assert_eq!(&buf, b"hello");
    }

    /// A read of the ring's file 0 (a pipe's read end, in these tests) into `segs`.
    fn pipe_read(segs: &[(usize, usize)]) -> Request<'_> {
        Request { op: Op::Read, file: 0, fallback: None, pos: 0, segments: segs, dsync: false, fixed: None }
    }

    fn file(len: u64) -> (tempfile::TempDir, std::fs::File) {
        let dir = tempfile::tempdir().unwrap();
        let f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(dir.path().join("f"))
            .unwrap();
        f.set_len(len).unwrap();
        (dir, f)
    }

    fn reap_all<T: Send + 'static>(ring: &mut Ring<T>, n: usize) -> Vec<(T, io::Result<u64>)> {
        let mut out = Vec::new();
        while out.len() < n {
            ring.reap(|p, r, _| out.push((p, r)));
            if out.len() < n {
                ring.block(Some(Duration::from_secs(10)));
            }
        }
        out
    }

    #[test]
    fn vectored_reads_and_writes_move_every_byte_and_report_once() {
        let (_d, f) = file(1 << 20);
        let mut ring: Ring<u32> = Ring::new(8, &[f.as_fd()], None).unwrap();
        let data: Vec<u8> = (0..20_000u32).map(|i| (i * 7 + 3) as u8).collect();
        let segs = [(data.as_ptr() as usize, 100), (data.as_ptr() as usize + 100, 19_900)];
        let w = Request {
            op: Op::Write,
            file: 0,
            fallback: None,
            pos: 3000,
            segments: &segs,
            dsync: true,
            fixed: None,
        };
        // SAFETY: `data` outlives the transfer (reaped below).
        unsafe { ring.start(1, &w) }.unwrap();
        let got = reap_all(&mut ring, 1);
        assert_eq!((got[0].0, got[0].1.as_ref().unwrap()), (1, &20_000));
        let mut back = vec![0u8; 20_000];
        let p = back.as_mut_ptr() as usize;
        let segs = [(p, 7), (p + 7, 4089), (p + 4096, 20_000 - 4096)];
        let r = Request {
            op: Op::Read,
            file: 0,
            fallback: None,
            pos: 3000,
            segments: &segs,
            dsync: false,
            fixed: None,
        };
        // SAFETY: `back` outlives the transfer.
        unsafe { ring.start(2, &r) }.unwrap();
        let s = Request {
            op: Op::Sync,
            file: 0,
            fallback: None,
            pos: 0,
            segments: &[],
            dsync: false,
            fixed: None,
        };
        // SAFETY: no memory.
        unsafe { ring.start(3, &s) }.unwrap();
        let mut got = reap_all(&mut ring, 2);
        got.sort_by_key(|g| g.0);
        assert!(got[0].1.is_ok() && got[1].1.is_ok());
        assert_eq!(back, data);
        assert_eq!(ring.in_flight(), 0);
        let mut on_disk = vec![0u8; 4];
        f.read_exact_at(&mut on_disk, 2998).unwrap();
        assert_eq!(on_disk, [0, 0, data[0], data[1]]);
    }

    #[test]
    fn a_read_past_the_end_fails_and_the_ring_is_bounded() {
        let (_d, f) = file(8192);
        let mut ring: Ring<u32> = Ring::new(2, &[f.as_fd()], None).unwrap();
        let mut buf = vec![0u8; 8192];
        let segs = [(buf.as_mut_ptr() as usize, 8192)];
        let r = Request {
            op: Op::Read,
            file: 0,
            fallback: None,
            pos: 4096,
            segments: &segs,
            dsync: false,
            fixed: None,
        };
        // SAFETY: `buf` outlives the transfers.
        unsafe {
            ring.start(1, &r).unwrap();
            ring.start(2, &r).unwrap();
            let (back, e) = ring.start(3, &r).unwrap_err();
            assert_eq!((back, e.raw_os_error()), (3, Some(libc::EBUSY)), "two at most");
        }
        // Half of each read is there: the rest ends early.
        for (_, r) in reap_all(&mut ring, 2) {
            assert_eq!(r.unwrap_err().kind(), io::ErrorKind::UnexpectedEof);
        }
    }

    #[test]
    fn a_read_held_by_the_kernel_is_reported_when_it_ends_and_a_ring_dropped_meanwhile_waits() {
        // A pipe's read waits for a writer: a transfer the test holds in the kernel.
        let (rx, tx) = nix::unistd::pipe().unwrap();
        let (_d, f) = file(4096);
        let bell = vmm_sys_util::eventfd::EventFd::new(vmm_sys_util::eventfd::EFD_NONBLOCK).unwrap();
        // SAFETY: the eventfd outlives the borrow (the ring keeps a duplicate).
        let kick = unsafe { BorrowedFd::borrow_raw(bell.as_raw_fd()) };
        let mut ring: Ring<std::sync::Arc<()>> = Ring::new(4, &[rx.as_fd(), f.as_fd()], Some(kick)).unwrap();
        // A pipe read is one the kernel could cancel: this ring must wait for it instead,
        // as for a disk read, which no cancellation stops.
        ring.cancel_on_quiesce = false;
        let buf = std::sync::Arc::new(std::sync::Mutex::new(vec![0u8; 5]));
        let segs = [(buf.lock().unwrap().as_mut_ptr() as usize, 5)];
        let held = std::sync::Arc::new(());
        let r = pipe_read(&segs);
        // SAFETY: `buf` outlives the transfer: the test waits for the payload's drop before
        // it reads or frees `buf`.
        unsafe { ring.start(held.clone(), &r) }.unwrap();
        let quick = Request {
            op: Op::Sync,
            file: 1,
            fallback: None,
            pos: 0,
            segments: &[],
            dsync: false,
            fixed: None,
        };
        // SAFETY: no memory.
        unsafe { ring.start(std::sync::Arc::new(()), &quick) }.unwrap();
        // The sync, started second, ends first; the read is still in the kernel.
        assert_eq!(reap_all(&mut ring, 1).len(), 1);
        assert_eq!(ring.in_flight(), 1);
        // A write of the bell's eventfd wakes its sleeper, with nothing finished.
        bell.write(1).unwrap();
        ring.block(None);
        assert!(ring.pending());
        assert_eq!(ring.reap(|_, _, _| panic!("nothing finished")), 0);
        // Dropped with the read held: the drop waits its bound, then a thread keeps the
        // payload until the kernel is done.
        drop(ring);
        assert_eq!(std::sync::Arc::strong_count(&held), 2, "kept while the read is in the kernel");
        nix::unistd::write(&tx, b"hello").unwrap();
        let deadline = Instant::now() + Duration::from_secs(60); // a hang guard only
        while std::sync::Arc::strong_count(&held) > 1 {
            assert!(Instant::now() < deadline, "the draining thread never let go");
            std::thread::yield_now();
        }
        assert_eq!(&*buf.lock().unwrap(), b"hello");
    }

    #[test]
    fn the_fixed_table_hands_out_its_lowest_free_entry() {
        let mut t = FixedTable::default();
        assert_eq!(t.lowest_free(), 0);
        for e in 0..70 {
            t.mark(e, true);
        }
        assert_eq!(t.lowest_free(), 70);
        t.mark(3, false);
        t.mark(65, false);
        assert_eq!(t.lowest_free(), 3);
        t.mark(3, true);
        assert_eq!(t.lowest_free(), 65);
    }

    #[test]
    fn quiesce_cancels_what_the_kernel_can_stop() {
        let (rx, _tx) = nix::unistd::pipe().unwrap();
        let mut ring: Ring<u32> = Ring::new(4, &[rx.as_fd()], None).unwrap();
        let mut buf = [0u8; 5];
        let segs = [(buf.as_mut_ptr() as usize, 5)];
        let r = pipe_read(&segs);
        // SAFETY: `buf` outlives the transfer (quiesced below).
        unsafe { ring.start(7, &r) }.unwrap();
        let mut got = Vec::new();
        assert_eq!(ring.quiesce(Duration::from_secs(60), |p, r, _| got.push((p, r))), 0);
        assert_eq!(got.len(), 1);
        assert_eq!(got[0].0, 7);
        assert_eq!(got[0].1.as_ref().unwrap_err().raw_os_error(), Some(libc::ECANCELED));
    }
}
