//! A one-file FUSE filesystem whose I/O the test controls: a backing file for a device under
//! test that answers each read, write and fsync the way the test says: at once from its
//! bytes in memory, with an error, or not until the test releases it. So a test can hold a
//! transfer in the host kernel for as long as it likes (a reset with I/O in flight), finish
//! transfers in an order of its choosing, or make the disk fail (EIO).
//!
//! It speaks the kernel's FUSE protocol over `/dev/fuse` from a thread of the test process and
//! mounts with mount(2), so it needs root (CAP_SYS_ADMIN) and FUSE: [`FuseFile::mount`] says
//! why not, and the test skips. The file is opened with FOPEN_DIRECT_IO: every read and write
//! reaches the server as the device asked for it (no page cache, no readahead).
//!
//! What it is not: a filesystem anyone else would use (one regular file, fixed size, no
//! directories, no attributes beyond what the kernel needs to open it).

use std::collections::VecDeque;
use std::fs::File;
use std::io::{Read, Write};
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

const ROOT: u64 = 1;
const FILE: u64 = 2;
const NAME: &str = "disk.img";

// Opcodes (include/uapi/linux/fuse.h).
const LOOKUP: u32 = 1;
const FORGET: u32 = 2;
const GETATTR: u32 = 3;
const OPEN: u32 = 14;
const READ: u32 = 15;
const WRITE: u32 = 16;
const STATFS: u32 = 17;
const RELEASE: u32 = 18;
const FSYNC: u32 = 20;
const FLUSH: u32 = 25;
const INIT: u32 = 26;
const INTERRUPT: u32 = 36;
const BATCH_FORGET: u32 = 42;

const FOPEN_DIRECT_IO: u32 = 1;
const FUSE_ASYNC_DIO: u32 = 1 << 15;
const FUSE_MAX_PAGES: u32 = 1 << 22;
const IN_HEADER: usize = 40;

/// One I/O the kernel sent.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Io {
    /// Read `size` bytes at `offset`.
    Read {
        /// Byte position.
        offset: u64,
        /// Bytes.
        size: u32,
    },
    /// Write `data` at `offset`.
    Write {
        /// Byte position.
        offset: u64,
        /// The bytes.
        data: Vec<u8>,
    },
    /// fsync (or fdatasync).
    Fsync,
}

/// What the server does with an I/O.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Action {
    /// Serve it from (or into) the file's bytes, at once.
    Serve,
    /// Fail it with this errno, at once.
    Fail(i32),
    /// Keep it until the test answers it ([`FuseFile::answer`]).
    Hold,
}

/// An I/O held for the test.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Held {
    /// The kernel's request number (what an interrupt names).
    pub unique: u64,
    /// The I/O.
    pub io: Io,
}

type Policy = Box<dyn Fn(&Io) -> Action + Send>;

struct State {
    bytes: Vec<u8>,
    policy: Policy,
    held: VecDeque<Held>,
    /// Request numbers the kernel asked to interrupt (a cancelled transfer, a signal).
    interrupts: Vec<u64>,
    /// Reads and writes served or failed so far.
    served: usize,
    /// The server thread ended (unmounted, or the device's fd broke).
    ended: bool,
}

struct Shared {
    state: Mutex<State>,
    changed: Condvar,
    dev: File,
}

/// A mounted one-file FUSE filesystem; unmounted on drop.
pub struct FuseFile {
    dir: tempfile::TempDir,
    path: PathBuf,
    shared: Arc<Shared>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl FuseFile {
    /// Mounts a filesystem holding one file of `size` zero bytes, every I/O served at once;
    /// `Err` says why it cannot be had here (not root, no FUSE).
    pub fn mount(size: u64) -> Result<FuseFile, String> {
        if !nix::unistd::geteuid().is_root() {
            return Err("mounting FUSE needs root".into());
        }
        let dev = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open("/dev/fuse")
            .map_err(|e| format!("/dev/fuse: {e}"))?;
        let dir = tempfile::tempdir().map_err(|e| e.to_string())?;
        let options = format!("fd={},rootmode=40000,user_id=0,group_id=0,allow_other", dev.as_raw_fd());
        nix::mount::mount(
            Some("umdev-test"),
            dir.path(),
            Some("fuse"),
            nix::mount::MsFlags::MS_NOSUID | nix::mount::MsFlags::MS_NODEV,
            Some(options.as_str()),
        )
        .map_err(|e| format!("mounting FUSE at {}: {e}", dir.path().display()))?;
        let shared = Arc::new(Shared {
            state: Mutex::new(State {
                bytes: vec![0; size as usize],
                policy: Box::new(|_| Action::Serve),
                held: VecDeque::new(),
                interrupts: Vec::new(),
                served: 0,
                ended: false,
            }),
            changed: Condvar::new(),
            dev,
        });
        let server = shared.clone();
        let thread = std::thread::Builder::new()
            .name("umdev-test-fuse".into())
            .spawn(move || serve(&server))
            .map_err(|e| e.to_string())?;
        let path = dir.path().join(NAME);
        Ok(FuseFile { dir, path, shared, thread: Some(thread) })
    }

    /// The file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// From now on, `policy` says what to do with each read, write and fsync.
    pub fn set_policy(&self, policy: impl Fn(&Io) -> Action + Send + 'static) {
        self.state().policy = Box::new(policy);
    }

    /// A copy of the file's bytes.
    pub fn bytes(&self) -> Vec<u8> {
        self.state().bytes.clone()
    }

    /// Reads and writes served or failed so far (held ones once answered).
    pub fn served(&self) -> usize {
        self.state().served
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.shared.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Waits until `n` I/Os are held and gives them, oldest first; panics after `guard` (a
    /// hang guard: the kernel sends them as soon as the device starts them).
    pub fn wait_held(&self, n: usize, guard: Duration) -> Vec<Held> {
        self.wait_for(guard, |st| (st.held.len() >= n).then(|| st.held.iter().cloned().collect()))
            .unwrap_or_else(|| panic!("{n} I/O(s) were never held: {:?}", self.state().held))
    }

    /// Waits until the kernel asked to interrupt request `unique`; false after `guard`.
    pub fn wait_interrupt(&self, unique: u64, guard: Duration) -> bool {
        self.wait_for(guard, |st| st.interrupts.contains(&unique).then_some(())).is_some()
    }

    fn wait_for<R>(&self, guard: Duration, mut f: impl FnMut(&State) -> Option<R>) -> Option<R> {
        let deadline = Instant::now() + guard;
        let mut st = self.state();
        loop {
            if let Some(r) = f(&st) {
                return Some(r);
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() || st.ended {
                return None;
            }
            st = self.shared.changed.wait_timeout(st, left).unwrap_or_else(|e| e.into_inner()).0;
        }
    }

    /// Answers held request `unique` now: served as [`Action::Serve`] would, or failed with
    /// `errno`.
    pub fn answer(&self, unique: u64, errno: Option<i32>) {
        let mut st = self.state();
        let Some(at) = st.held.iter().position(|h| h.unique == unique) else {
            panic!("request {unique} is not held");
        };
        let held = st.held.remove(at).expect("found");
        let action = errno.map_or(Action::Serve, Action::Fail);
        let reply = perform(&mut st, &held.io, action);
        drop(st);
        send(&self.shared.dev, unique, reply);
    }
}

impl Drop for FuseFile {
    fn drop(&mut self) {
        // Held requests first: a kernel thread waiting for one would keep the mount busy.
        let held: Vec<u64> = self.state().held.iter().map(|h| h.unique).collect();
        for unique in held {
            self.answer(unique, Some(libc::EIO));
        }
        let _ = nix::mount::umount2(self.dir.path(), nix::mount::MntFlags::MNT_DETACH);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// A reply: the error (0 for success) and its payload.
type Reply = (i32, Vec<u8>);

/// Does `io` as `action` says on the file's bytes.
fn perform(st: &mut State, io: &Io, action: Action) -> Reply {
    st.served += 1;
    if let Action::Fail(errno) = action {
        return (errno, Vec::new());
    }
    match io {
        Io::Read { offset, size } => {
            let len = st.bytes.len() as u64;
            let (start, end) = ((*offset).min(len), (offset + u64::from(*size)).min(len));
            (0, st.bytes[start as usize..end as usize].to_vec())
        }
        Io::Write { offset, data } => {
            let end = (*offset as usize + data.len()).min(st.bytes.len());
            let n = end.saturating_sub(*offset as usize);
            st.bytes[*offset as usize..end].copy_from_slice(&data[..n]);
            let mut out = (n as u32).to_le_bytes().to_vec();
            out.extend([0; 4]);
            (0, out)
        }
        Io::Fsync => (0, Vec::new()),
    }
}

fn send(mut dev: &File, unique: u64, (error, payload): Reply) {
    let mut msg = Vec::with_capacity(16 + payload.len());
    msg.extend(((16 + payload.len()) as u32).to_le_bytes());
    msg.extend((-error).to_le_bytes());
    msg.extend(unique.to_le_bytes());
    msg.extend(payload);
    // ENOENT: the request was interrupted and is gone; anything else ends with the mount.
    let _ = dev.write(&msg);
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    b.get(at..at + 4).map_or(0, |s| u32::from_le_bytes(s.try_into().expect("4 bytes")))
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    b.get(at..at + 8).map_or(0, |s| u64::from_le_bytes(s.try_into().expect("8 bytes")))
}

/// `struct fuse_attr` of the root directory or the file.
fn attr(node: u64, size: u64) -> Vec<u8> {
    let mut a = Vec::with_capacity(88);
    a.extend(node.to_le_bytes()); // ino
    a.extend(size.to_le_bytes());
    a.extend(size.div_ceil(512).to_le_bytes()); // blocks
    a.extend([0u8; 24]); // atime, mtime, ctime
    a.extend([0u8; 12]); // their nanoseconds
    let mode = if node == ROOT { libc::S_IFDIR | 0o755 } else { libc::S_IFREG | 0o644 };
    a.extend(mode.to_le_bytes());
    a.extend(1u32.to_le_bytes()); // nlink
    a.extend([0u8; 12]); // uid, gid, rdev
    a.extend(4096u32.to_le_bytes()); // blksize
    a.extend([0u8; 4]); // flags
    a
}

/// The server thread: reads requests until the mount goes away.
fn serve(shared: &Shared) {
    let mut buf = vec![0u8; (1 << 20) + 4096];
    loop {
        let n = match (&shared.dev).read(&mut buf) {
            Ok(n) => n,
            Err(e) if e.raw_os_error() == Some(libc::EINTR) || e.raw_os_error() == Some(libc::ENOENT) => {
                continue
            }
            Err(_) => break, // ENODEV: unmounted
        };
        let req = &buf[..n];
        if n < IN_HEADER {
            continue;
        }
        let (opcode, unique, node) = (u32_at(req, 4), u64_at(req, 8), u64_at(req, 16));
        let body = &req[IN_HEADER..];
        let size = shared.state.lock().unwrap_or_else(|e| e.into_inner()).bytes.len() as u64;
        let reply: Option<Reply> = match opcode {
            INIT => {
                let mut out = Vec::with_capacity(64);
                out.extend(7u32.to_le_bytes());
                out.extend(31u32.to_le_bytes());
                out.extend((128u32 << 10).to_le_bytes()); // max_readahead
                                                          // Asynchronous direct I/O: an io_uring transfer is then in flight while the
                                                          // test holds it, as on a disk; without it the kernel serves it synchronously
                                                          // in the thread that submitted it (the device's worker, which then cannot stop).
                out.extend((FUSE_MAX_PAGES | FUSE_ASYNC_DIO).to_le_bytes()); // flags
                out.extend(16u16.to_le_bytes()); // max_background
                out.extend(12u16.to_le_bytes()); // congestion_threshold
                out.extend((1u32 << 20).to_le_bytes()); // max_write
                out.extend(1u32.to_le_bytes()); // time_gran
                out.extend(256u16.to_le_bytes()); // max_pages
                out.resize(64, 0);
                Some((0, out))
            }
            LOOKUP => {
                let name = body.split(|&b| b == 0).next().unwrap_or(&[]);
                if node == ROOT && name == NAME.as_bytes() {
                    let mut out = Vec::with_capacity(128);
                    out.extend(FILE.to_le_bytes());
                    out.extend(0u64.to_le_bytes()); // generation
                    out.extend(3600u64.to_le_bytes()); // entry_valid
                    out.extend(3600u64.to_le_bytes()); // attr_valid
                    out.extend([0u8; 8]);
                    out.extend(attr(FILE, size));
                    Some((0, out))
                } else {
                    Some((libc::ENOENT, Vec::new()))
                }
            }
            GETATTR => {
                let mut out = Vec::with_capacity(104);
                out.extend(3600u64.to_le_bytes());
                out.extend([0u8; 8]);
                out.extend(attr(node, if node == ROOT { 0 } else { size }));
                Some((0, out))
            }
            OPEN => {
                let mut out = Vec::with_capacity(16);
                out.extend(1u64.to_le_bytes()); // fh
                out.extend(FOPEN_DIRECT_IO.to_le_bytes());
                out.extend([0u8; 4]);
                Some((0, out))
            }
            READ | WRITE | FSYNC => {
                let io = match opcode {
                    READ => Io::Read { offset: u64_at(body, 8), size: u32_at(body, 16) },
                    WRITE => {
                        let len = u32_at(body, 16) as usize;
                        Io::Write {
                            offset: u64_at(body, 8),
                            data: body.get(40..40 + len).unwrap_or(&[]).to_vec(),
                        }
                    }
                    _ => Io::Fsync,
                };
                let mut st = shared.state.lock().unwrap_or_else(|e| e.into_inner());
                let action = (st.policy)(&io);
                let reply = match action {
                    Action::Hold => {
                        st.held.push_back(Held { unique, io });
                        None
                    }
                    action => Some(perform(&mut st, &io, action)),
                };
                drop(st);
                shared.changed.notify_all();
                reply
            }
            STATFS => {
                let mut out = vec![0u8; 80];
                out[40..44].copy_from_slice(&4096u32.to_le_bytes()); // bsize
                out[44..48].copy_from_slice(&255u32.to_le_bytes()); // namelen
                Some((0, out))
            }
            FLUSH | RELEASE => Some((0, Vec::new())),
            INTERRUPT => {
                let target = u64_at(body, 0);
                shared.state.lock().unwrap_or_else(|e| e.into_inner()).interrupts.push(target);
                shared.changed.notify_all();
                // The held request is answered when the test says: the kernel waits for it.
                None
            }
            FORGET | BATCH_FORGET => None,
            _ => Some((libc::ENOSYS, Vec::new())),
        };
        if let Some(reply) = reply {
            send(&shared.dev, unique, reply);
        }
    }
    shared.state.lock().unwrap_or_else(|e| e.into_inner()).ended = true;
    shared.changed.notify_all();
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::FileExt;

    #[test]
    fn reads_and_writes_reach_the_test_and_a_held_read_waits_for_it() {
        let fuse = match FuseFile::mount(64 << 10) {
            Ok(f) => f,
            Err(why) => return eprintln!("SKIPPED: {why}"),
        };
        let file = std::fs::OpenOptions::new().read(true).write(true).open(fuse.path()).unwrap();
        assert_eq!(file.metadata().unwrap().len(), 64 << 10);
        file.write_all_at(b"hello", 4096).unwrap();
        assert_eq!(&fuse.bytes()[4096..4101], b"hello");
        fuse.set_policy(|io| match io {
            Io::Read { offset: 0, .. } => Action::Fail(libc::EIO),
            Io::Read { offset: 8192, .. } => Action::Hold,
            _ => Action::Serve,
        });
        let mut b = [0u8; 5];
        assert_eq!(file.read_exact_at(&mut b, 0).unwrap_err().raw_os_error(), Some(libc::EIO));
        let reader = std::thread::spawn(move || {
            let mut b = [0u8; 4];
            file.read_exact_at(&mut b, 8192).map(|()| b)
        });
        let held = fuse.wait_held(1, Duration::from_secs(60));
        assert_eq!(held[0].io, Io::Read { offset: 8192, size: 4 });
        fuse.answer(held[0].unique, None);
        assert_eq!(reader.join().unwrap().unwrap(), [0; 4]);
    }
}
