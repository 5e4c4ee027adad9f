//! A client that sends a file on a FUSE file system it serves itself, and never answers:
//! DMA_MAP refuses the file without asking the FUSE server anything (no GETATTR, no
//! STATFS), and the file's close, which asks it (FLUSH), waits on a closer thread while the
//! connection goes on answering (docs/threat-model.md, "Fds the client sends").
//!
//! The FUSE server is a thread of this test, speaking the kernel's protocol on /dev/fuse
//! (linux/fuse.h); mounting needs root (CI runs as root). Without it the test says so and
//! passes.

mod common;

use std::ffi::CString;
use std::fs::File;
use std::io::{Read, Write};
use std::os::fd::{AsRawFd, FromRawFd};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use common::raw::*;
use common::Harness;
use umdev_server::wire::Command;

const LOOKUP: u32 = 1;
const FORGET: u32 = 2;
const GETATTR: u32 = 3;
const STATFS: u32 = 17;
const FLUSH: u32 = 25;
const INIT: u32 = 26;
const OPEN: u32 = 14;
const INTERRUPT: u32 = 36;
const BATCH_FORGET: u32 = 42;

/// How long a held request waits before the server answers it anyway (EIO), so that a
/// server that does ask (the code before this test) fails the test rather than hangs it.
const HOLD_AT_MOST: Duration = Duration::from_secs(30);

#[derive(Default)]
struct State {
    /// Requests after `hold` was set: opcode, and whether they are still unanswered.
    held: Vec<(u32, bool)>,
    hold: bool,
    /// Set to answer what is held.
    release: bool,
    /// A held request had to be answered after HOLD_AT_MOST.
    late: Vec<u32>,
}

struct Fuse {
    state: Mutex<State>,
    changed: Condvar,
}

fn attr(ino: u64, mode: u32, size: u64) -> Vec<u8> {
    let mut a = Vec::with_capacity(88);
    for v in [ino, size, size.div_ceil(512), 0, 0, 0] {
        a.extend_from_slice(&v.to_le_bytes());
    }
    // atimensec, mtimensec, ctimensec, mode, nlink, uid, gid, rdev, blksize, flags
    for v in [0u32, 0, 0, mode, 1, 0, 0, 0, 4096, 0] {
        a.extend_from_slice(&v.to_le_bytes());
    }
    a
}

fn node_attr(node: u64) -> Vec<u8> {
    if node == 1 {
        attr(1, libc::S_IFDIR | 0o755, 0)
    } else {
        attr(2, libc::S_IFREG | 0o644, 1 << 20)
    }
}

/// The answer to one request: `None` for those that get none.
fn answer(opcode: u32, node: u64, body: &[u8]) -> Option<(i32, Vec<u8>)> {
    let ok = |b: Vec<u8>| Some((0, b));
    match opcode {
        INIT => {
            let mut out = Vec::new();
            // major, minor, max_readahead, flags
            for v in [7u32, 31, 0, 0] {
                out.extend_from_slice(&v.to_le_bytes());
            }
            out.extend_from_slice(&1u16.to_le_bytes()); // max_background
            out.extend_from_slice(&1u16.to_le_bytes()); // congestion_threshold
            out.extend_from_slice(&4096u32.to_le_bytes()); // max_write
            out.extend_from_slice(&1u32.to_le_bytes()); // time_gran
            out.resize(64, 0);
            ok(out)
        }
        LOOKUP if body.starts_with(b"f\0") => {
            // nodeid, generation, entry_valid, attr_valid (0: every stat asks), their nsecs
            let mut out = Vec::new();
            for v in [2u64, 0, 0, 0] {
                out.extend_from_slice(&v.to_le_bytes());
            }
            out.extend_from_slice(&[0; 8]);
            out.extend_from_slice(&node_attr(2));
            ok(out)
        }
        LOOKUP => Some((-libc::ENOENT, Vec::new())),
        GETATTR => {
            let mut out = vec![0; 16];
            out.extend_from_slice(&node_attr(node));
            ok(out)
        }
        OPEN => ok(vec![0; 16]),
        FORGET | BATCH_FORGET | INTERRUPT => None,
        FLUSH | 18 /* RELEASE */ => ok(Vec::new()),
        _ => Some((-libc::ENOSYS, Vec::new())),
    }
}

fn reply(dev: &mut File, unique: u64, error: i32, body: &[u8]) {
    let mut msg = Vec::with_capacity(16 + body.len());
    msg.extend_from_slice(&(16 + body.len() as u32).to_le_bytes());
    msg.extend_from_slice(&error.to_le_bytes());
    msg.extend_from_slice(&unique.to_le_bytes());
    msg.extend_from_slice(body);
    // ENOENT: the request was interrupted meanwhile.
    let _ = dev.write_all(&msg);
}

/// Serves /dev/fuse until it is unmounted; holds every request from `hold` on.
fn serve(fuse: Arc<Fuse>, mut dev: File) {
    let mut buf = vec![0u8; 1 << 20];
    let mut waiting = Vec::new();
    type Waiting = Vec<(u64, u32, Instant, i32, Vec<u8>)>;
    let answer_waiting = |waiting: &mut Waiting, dev: &mut File, all: bool, fuse: &Fuse| {
        let mut st = fuse.state.lock().unwrap();
        waiting.retain(|(unique, opcode, since, error, body)| {
            let late = since.elapsed() >= HOLD_AT_MOST;
            if all || late {
                if late && !all {
                    st.late.push(*opcode);
                    reply(dev, *unique, -libc::EIO, &[]);
                } else {
                    reply(dev, *unique, *error, body);
                }
                if let Some(h) = st.held.iter_mut().find(|h| h.0 == *opcode && h.1) {
                    h.1 = false;
                }
                return false;
            }
            true
        });
        fuse.changed.notify_all();
    };
    loop {
        // Wait for a request, but look at what is held every 100 ms.
        let mut pfd = libc::pollfd { fd: dev.as_raw_fd(), events: libc::POLLIN, revents: 0 };
        // SAFETY: one pollfd, alive for the call.
        let n = unsafe { libc::poll(&mut pfd, 1, 100) };
        let release = fuse.state.lock().unwrap().release;
        answer_waiting(&mut waiting, &mut dev, release, &fuse);
        if n <= 0 {
            continue;
        }
        let len = match dev.read(&mut buf) {
            Ok(len) => len,
            Err(e) if e.raw_os_error() == Some(libc::EINTR) || e.raw_os_error() == Some(libc::ENOENT) => {
                continue
            }
            Err(_) => return, // ENODEV: unmounted
        };
        if len < 40 {
            continue;
        }
        let opcode = u32::from_le_bytes(buf[4..8].try_into().unwrap());
        let unique = u64::from_le_bytes(buf[8..16].try_into().unwrap());
        let node = u64::from_le_bytes(buf[16..24].try_into().unwrap());
        let Some((error, body)) = answer(opcode, node, &buf[40..len]) else { continue };
        let mut st = fuse.state.lock().unwrap();
        if st.hold && !st.release {
            st.held.push((opcode, true));
            fuse.changed.notify_all();
            drop(st);
            waiting.push((unique, opcode, Instant::now(), error, body));
        } else {
            drop(st);
            reply(&mut dev, unique, error, &body);
        }
    }
}

#[test]
fn a_file_on_a_fuse_file_system_that_never_answers_stalls_nothing() {
    let dev = match std::fs::OpenOptions::new().read(true).write(true).open("/dev/fuse") {
        Ok(dev) => dev,
        Err(e) => {
            eprintln!("skipped: cannot open /dev/fuse ({e}); needs root and the fuse module");
            return;
        }
    };
    let dir = tempfile::tempdir().unwrap();
    let mnt = dir.path().join("mnt");
    std::fs::create_dir(&mnt).unwrap();
    let opts = format!("fd={},rootmode=40000,user_id=0,group_id=0", dev.as_raw_fd());
    if let Err(e) = nix::mount::mount(
        Some("umdev-test"),
        &mnt,
        Some("fuse"),
        nix::mount::MsFlags::MS_NOSUID | nix::mount::MsFlags::MS_NODEV,
        Some(opts.as_str()),
    ) {
        eprintln!("skipped: cannot mount FUSE ({e}); needs root");
        return;
    }
    let fuse = Arc::new(Fuse { state: Mutex::new(State::default()), changed: Condvar::new() });
    let server = {
        let fuse = fuse.clone();
        // SAFETY: a second handle on /dev/fuse for the server thread; `dev` stays open until
        // after the unmount below.
        let copy = unsafe { File::from_raw_fd(libc::dup(dev.as_raw_fd())) };
        std::thread::spawn(move || serve(fuse, copy))
    };

    let file = File::open(mnt.join("f")).expect("open the FUSE file");
    let h = Harness::new("testdev");
    let mut c = RawClient::connect(&h.socket).unwrap();
    c.negotiate().unwrap();
    fuse.state.lock().unwrap().hold = true;

    // DMA_MAP of the FUSE file: refused by its mount, nothing asked of the FUSE server.
    let r = c.request(Command::DmaMap as u16, &dma_map_payload(3, 0, 0, 4096), &[file.as_raw_fd()]).unwrap();
    assert_eq!(r.errno(), libc::EINVAL, "DMA_MAP of a file on FUSE");
    // The server's copy of the fd is closed by a closer, whose close asks the FUSE server to
    // FLUSH: held, unanswered.
    {
        let st = fuse.state.lock().unwrap();
        let (st, _) = fuse
            .changed
            .wait_timeout_while(st, Duration::from_secs(60), |st| !st.held.iter().any(|h| h.0 == FLUSH))
            .unwrap();
        let asked: Vec<u32> = st.held.iter().map(|h| h.0).collect();
        assert!(
            !asked.contains(&GETATTR) && !asked.contains(&STATFS),
            "the DMA_MAP asked the FUSE server (opcodes {asked:?}; late answers {:?})",
            st.late
        );
        assert!(asked.contains(&FLUSH), "the server's close of its copy never reached the FUSE server");
        assert!(st.late.is_empty(), "a request was held {HOLD_AT_MOST:?}: {:?}", st.late);
    }
    // The FLUSH still held, the connection answers, and so does the next client.
    let info = c.request(Command::DeviceGetInfo as u16, &[&le32(16)[..], &[0; 12]].concat(), &[]).unwrap();
    assert_eq!(info.errno(), 0, "DEVICE_GET_INFO while the close waits");
    drop(c);
    h.wait_idle();
    let mut next = RawClient::connect(&h.socket).unwrap();
    assert_eq!(next.negotiate().unwrap().errno(), 0, "the next client is served");
    {
        let st = fuse.state.lock().unwrap();
        assert!(
            st.held.iter().any(|&(op, waiting)| op == FLUSH && waiting),
            "the FLUSH was answered too early"
        );
        assert!(st.late.is_empty(), "a request was held {HOLD_AT_MOST:?}: {:?}", st.late);
    }
    // Answered, the closer's close returns and the closers' queue empties.
    assert_eq!(umdev_server::client_fd::closes_pending(), 1, "the FLUSH's close still pending");
    fuse.state.lock().unwrap().release = true;
    assert!(umdev_server::client_fd::wait_closed(Duration::from_secs(60)), "the closers never finished");
    drop(file);
    drop(next);
    let path = CString::new(mnt.as_os_str().as_encoded_bytes()).unwrap();
    // SAFETY: a NUL-terminated path; a lazy unmount ends the server's reads with ENODEV.
    unsafe { libc::umount2(path.as_ptr(), libc::MNT_DETACH) };
    drop(dev);
    server.join().unwrap();
}
