//! Hostile and malformed messages from a raw-bytes client. Every case is named; after each
//! the connection must answer a correct request (or, for an impossible header, be closed in
//! an orderly way and the instance accept the next client). fds sent with refused requests
//! must be closed: the process's fd count is the same after the suite as before.
//!
//! One test in this binary, so nothing else opens fds while it counts them.

mod common;

use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::time::Duration;

use common::raw::*;
use common::{memfd, open_fds, Harness};
use umdev_server::wire::{flags, Command, Header};

#[derive(Debug, Clone, Copy, PartialEq)]
enum Expect {
    /// An error reply with this errno, then the connection works.
    Errno(i32),
    /// No reply at all, then the connection works.
    Silent,
    /// The server closes the connection; the instance serves the next client.
    Closed,
}

struct Case {
    name: &'static str,
    /// Negotiate VERSION first.
    negotiate: bool,
    expect: Expect,
    send: fn(&mut RawClient, &mut Fixtures),
}

/// Things cases need: a memfd guest RAM, fds to attach.
struct Fixtures {
    ram: std::fs::File,
    extra: Vec<OwnedFd>,
}

impl Fixtures {
    fn fd(&mut self) -> RawFd {
        let f = OwnedFd::from(memfd(4096));
        let raw = f.as_raw_fd();
        self.extra.push(f);
        raw
    }
    fn eventfd(&mut self) -> RawFd {
        let f = OwnedFd::from(
            nix::sys::eventfd::EventFd::from_flags(nix::sys::eventfd::EfdFlags::EFD_NONBLOCK).unwrap(),
        );
        let raw = f.as_raw_fd();
        self.extra.push(f);
        raw
    }
    fn pipe(&mut self) -> RawFd {
        let (r, w) = nix::unistd::pipe().unwrap();
        let raw = r.as_raw_fd();
        self.extra.push(r);
        self.extra.push(w);
        raw
    }
}

const C: fn(Command) -> u16 = |c| c as u16;

fn cmd(c: &mut RawClient, command: u16, payload: &[u8], fds: &[RawFd]) {
    c.send(command, flags::TYPE_COMMAND, payload, fds).unwrap();
}

fn header_only(c: &mut RawClient, command: u16, size: u32, msg_flags: u32) {
    let h = Header { id: 0x7777, command, size, flags: msg_flags, error: 0 };
    c.send_bytes(&h.encode(), &[]).unwrap();
}

fn version_payload(major: u16, json: &[u8]) -> Vec<u8> {
    [&major.to_le_bytes()[..], &[0, 0], json].concat()
}

fn map_ram(c: &mut RawClient, f: &mut Fixtures, iova: u64, size: u64) {
    let r = c.request(C(Command::DmaMap), &dma_map_payload(3, 0, iova, size), &[f.ram.as_raw_fd()]).unwrap();
    assert_eq!(r.errno(), 0, "setup mapping");
}

fn cases() -> Vec<Case> {
    use libc::*;
    use Expect::*;
    vec![
        // --- headers and framing ---
        Case {
            name: "size below the header",
            negotiate: true,
            expect: Closed,
            send: |c, _| header_only(c, 4, 15, 0),
        },
        Case { name: "size of zero", negotiate: true, expect: Closed, send: |c, _| header_only(c, 4, 0, 0) },
        Case {
            name: "huge size",
            negotiate: true,
            expect: Closed,
            send: |c, _| header_only(c, 10, u32::MAX, 0),
        },
        Case {
            name: "size just above the negotiated maximum",
            negotiate: true,
            expect: Closed,
            send: |c, _| header_only(c, 10, 16 + 16 + (1 << 20) + 1, 0),
        },
        Case {
            name: "large message before VERSION",
            negotiate: false,
            expect: Closed,
            send: |c, _| header_only(c, 1, 1 << 20, 0),
        },
        Case {
            name: "reply sent as a command (matches nothing)",
            negotiate: true,
            expect: Silent,
            send: |c, _| c.send(4, flags::TYPE_REPLY, &[0; 16], &[]).map(drop).unwrap(),
        },
        Case {
            name: "unknown message type",
            negotiate: true,
            expect: Errno(EINVAL),
            send: |c, _| c.send(4, 7, &[0; 16], &[]).map(drop).unwrap(),
        },
        Case {
            name: "unknown command with payload",
            negotiate: true,
            expect: Errno(ENOSYS),
            send: |c, _| cmd(c, 99, &[0xee; 300], &[]),
        },
        Case {
            name: "command zero",
            negotiate: true,
            expect: Errno(ENOSYS),
            send: |c, _| cmd(c, 0, &[], &[]),
        },
        Case {
            name: "server-to-client DMA_READ sent to the server",
            negotiate: true,
            expect: Errno(EINVAL),
            send: |c, _| cmd(c, C(Command::DmaRead), &[0; 16], &[]),
        },
        Case {
            name: "removed DIRTY_PAGES command",
            negotiate: true,
            expect: Errno(ENOTSUP),
            send: |c, _| cmd(c, C(Command::DirtyPages), &[0; 16], &[]),
        },
        Case {
            name: "DEVICE_FEATURE",
            negotiate: true,
            expect: Errno(ENOTTY),
            send: |c, _| cmd(c, C(Command::DeviceFeature), &[0; 8], &[]),
        },
        Case {
            name: "MIG_DATA_READ",
            negotiate: true,
            expect: Errno(ENOTSUP),
            send: |c, _| cmd(c, C(Command::MigDataRead), &[0; 8], &[]),
        },
        Case {
            name: "command before VERSION",
            negotiate: false,
            expect: Errno(EINVAL),
            send: |c, _| {
                cmd(c, C(Command::DeviceGetInfo), &[16, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0], &[])
            },
        },
        Case {
            name: "too many fds on one message",
            negotiate: true,
            expect: Errno(EINVAL),
            send: |c, f| {
                let fds: Vec<RawFd> = (0..24).map(|_| f.eventfd()).collect();
                cmd(c, C(Command::DeviceSetIrqs), &set_irqs_payload(0x24, 2, 0, 24, &[]), &fds)
            },
        },
        // --- VERSION ---
        Case {
            name: "VERSION without NUL",
            negotiate: false,
            expect: Errno(EINVAL),
            send: |c, _| cmd(c, 1, &version_payload(0, b"{}"), &[]),
        },
        Case {
            name: "VERSION with bad JSON",
            negotiate: false,
            expect: Errno(EINVAL),
            send: |c, _| cmd(c, 1, &version_payload(0, b"{\"capabilities\":\0"), &[]),
        },
        Case {
            name: "VERSION with a non-object capabilities",
            negotiate: false,
            expect: Errno(EINVAL),
            send: |c, _| cmd(c, 1, &version_payload(0, b"{\"capabilities\":\"23\"}\0"), &[]),
        },
        Case {
            name: "VERSION with max_data_xfer_size 0",
            negotiate: false,
            expect: Errno(EINVAL),
            send: |c, _| {
                cmd(c, 1, &version_payload(0, b"{\"capabilities\":{\"max_data_xfer_size\":0}}\0"), &[])
            },
        },
        Case {
            name: "VERSION with the wrong major",
            negotiate: false,
            expect: Errno(ENOTSUP),
            send: |c, _| cmd(c, 1, &version_payload(1, b"{}\0"), &[]),
        },
        Case {
            name: "VERSION with fds attached",
            negotiate: false,
            expect: Errno(EINVAL),
            send: |c, f| {
                let fd = f.fd();
                cmd(c, 1, &version_payload(0, b"{}\0"), &[fd])
            },
        },
        Case {
            name: "VERSION too short",
            negotiate: false,
            expect: Errno(EINVAL),
            send: |c, _| cmd(c, 1, &[0, 0], &[]),
        },
        Case {
            name: "VERSION twice",
            negotiate: true,
            expect: Errno(EINVAL),
            send: |c, _| cmd(c, 1, &version_payload(0, b"{}\0"), &[]),
        },
        // --- DMA_MAP / DMA_UNMAP ---
        Case {
            name: "DMA_MAP overlapping a mapping",
            negotiate: true,
            expect: Errno(EEXIST),
            send: |c, f| {
                map_ram(c, f, 0x10_0000, 0x10000);
                cmd(c, 2, &dma_map_payload(3, 0, 0x10_8000, 0x10000), &[f.ram.as_raw_fd()])
            },
        },
        Case {
            name: "DMA_MAP whose iova + size wraps",
            negotiate: true,
            expect: Errno(EINVAL),
            send: |c, f| cmd(c, 2, &dma_map_payload(3, 0, u64::MAX - 0xfff, 0x2000), &[f.ram.as_raw_fd()]),
        },
        Case {
            name: "DMA_MAP whose offset + size wraps",
            negotiate: true,
            expect: Errno(EINVAL),
            send: |c, f| {
                cmd(c, 2, &dma_map_payload(3, u64::MAX - 0xfff, 0x1000, 0x2000), &[f.ram.as_raw_fd()])
            },
        },
        Case {
            name: "DMA_MAP of size zero",
            negotiate: true,
            expect: Errno(EINVAL),
            send: |c, f| cmd(c, 2, &dma_map_payload(3, 0, 0x1000, 0), &[f.ram.as_raw_fd()]),
        },
        Case {
            name: "DMA_MAP unaligned",
            negotiate: true,
            expect: Errno(EINVAL),
            send: |c, f| cmd(c, 2, &dma_map_payload(3, 0, 0x1001, 0x1000), &[f.ram.as_raw_fd()]),
        },
        Case {
            name: "DMA_MAP past the end of the file",
            negotiate: true,
            expect: Errno(EINVAL),
            send: |c, f| cmd(c, 2, &dma_map_payload(3, 0x10_0000, 0x1000, 0x1000), &[f.ram.as_raw_fd()]),
        },
        Case {
            name: "DMA_MAP with two fds",
            negotiate: true,
            expect: Errno(EINVAL),
            send: |c, f| {
                let b = f.fd();
                cmd(c, 2, &dma_map_payload(3, 0, 0x1000, 0x1000), &[f.ram.as_raw_fd(), b])
            },
        },
        Case {
            name: "DMA_MAP of a pipe",
            negotiate: true,
            expect: Errno(EINVAL),
            send: |c, f| {
                let p = f.pipe();
                cmd(c, 2, &dma_map_payload(3, 0, 0x1000, 0x1000), &[p])
            },
        },
        Case {
            name: "DMA_MAP with unknown flags",
            negotiate: true,
            expect: Errno(EINVAL),
            send: |c, f| cmd(c, 2, &dma_map_payload(0x7, 0, 0x1000, 0x1000), &[f.ram.as_raw_fd()]),
        },
        Case {
            name: "DMA_MAP with no access",
            negotiate: true,
            expect: Errno(EINVAL),
            send: |c, f| cmd(c, 2, &dma_map_payload(0, 0, 0x1000, 0x1000), &[f.ram.as_raw_fd()]),
        },
        Case {
            name: "DMA_MAP too short",
            negotiate: true,
            expect: Errno(EINVAL),
            send: |c, f| cmd(c, 2, &dma_map_payload(3, 0, 0x1000, 0x1000)[..24], &[f.ram.as_raw_fd()]),
        },
        Case {
            name: "DMA_MAP beyond the mapping limit",
            negotiate: true,
            expect: Errno(ENOSPC),
            send: |c, f| {
                for i in 0..8 {
                    map_ram(c, f, 0x100_0000 + i * 0x1000, 0x1000);
                }
                cmd(c, 2, &dma_map_payload(3, 0, 0x200_0000, 0x1000), &[f.ram.as_raw_fd()])
            },
        },
        Case {
            name: "DMA_UNMAP of nothing",
            negotiate: true,
            expect: Errno(ENOENT),
            send: |c, _| cmd(c, 3, &dma_unmap_payload(24, 0, 0x4000_0000, 0x1000), &[]),
        },
        Case {
            name: "DMA_UNMAP splitting a mapping",
            negotiate: true,
            expect: Errno(EINVAL),
            send: |c, f| {
                map_ram(c, f, 0x20_0000, 0x4000);
                cmd(c, 3, &dma_unmap_payload(24, 0, 0x20_1000, 0x1000), &[])
            },
        },
        Case {
            name: "DMA_UNMAP asking for a dirty bitmap",
            negotiate: true,
            expect: Errno(ENOTSUP),
            send: |c, _| cmd(c, 3, &dma_unmap_payload(24, 1, 0, 0x1000), &[]),
        },
        Case {
            name: "DMA_UNMAP ALL with an address",
            negotiate: true,
            expect: Errno(EINVAL),
            send: |c, _| cmd(c, 3, &dma_unmap_payload(24, 2, 0x1000, 0), &[]),
        },
        Case {
            name: "DMA_UNMAP with a small argsz",
            negotiate: true,
            expect: Errno(EINVAL),
            send: |c, _| cmd(c, 3, &dma_unmap_payload(8, 0, 0x1000, 0x1000), &[]),
        },
        Case {
            // Served as libvfio-user serves it (SPDK attaches the mapping's fd): the fd is
            // closed (the fd count at the end says so), the unmap finds nothing mapped.
            name: "DMA_UNMAP with an fd",
            negotiate: true,
            expect: Errno(ENOENT),
            send: |c, f| {
                let fd = f.fd();
                cmd(c, 3, &dma_unmap_payload(24, 0, 0x1000, 0x1000), &[fd])
            },
        },
        // --- regions ---
        Case {
            name: "region info of a bad index",
            negotiate: true,
            expect: Errno(EINVAL),
            send: |c, _| {
                let p = [&le32(32)[..], &[0; 4], &le32(9), &[0; 20]].concat();
                cmd(c, 5, &p, &[])
            },
        },
        Case {
            name: "region info with a small argsz",
            negotiate: true,
            expect: Errno(EINVAL),
            send: |c, _| cmd(c, 5, &[&le32(16)[..], &[0; 28]].concat(), &[]),
        },
        Case {
            name: "region IO fds with flags",
            negotiate: true,
            expect: Errno(EINVAL),
            send: |c, _| cmd(c, 6, &[&le32(16)[..], &le32(1), &le32(0), &le32(0)].concat(), &[]),
        },
        Case {
            name: "region read out of bounds",
            negotiate: true,
            expect: Errno(EINVAL),
            send: |c, _| cmd(c, 9, &[&le64(4094)[..], &le32(0), &le32(4)].concat(), &[]),
        },
        Case {
            name: "region read whose offset wraps",
            negotiate: true,
            expect: Errno(EINVAL),
            send: |c, _| {
                let p = [&le64(u64::MAX - 1)[..], &le32(0), &le32(4)].concat();
                cmd(c, 9, &p, &[])
            },
        },
        Case {
            name: "region read over max_data_xfer_size",
            negotiate: true,
            expect: Errno(E2BIG),
            send: |c, _| {
                let p = [&le64(0)[..], &le32(1), &le32((1 << 20) + 1)].concat();
                cmd(c, 9, &p, &[])
            },
        },
        Case {
            name: "region read of an absent region",
            negotiate: true,
            expect: Errno(EPERM),
            send: |c, _| cmd(c, 9, &[&le64(0)[..], &le32(6), &le32(4)].concat(), &[]),
        },
        Case {
            name: "region write with count and data disagreeing",
            negotiate: true,
            expect: Errno(EINVAL),
            send: |c, _| {
                let mut p = region_write_payload(0, 4, &[1, 2, 3, 4]);
                p[12..16].copy_from_slice(&le32(8));
                cmd(c, 10, &p, &[])
            },
        },
        Case {
            name: "region write of an unsupported size",
            negotiate: true,
            expect: Errno(EINVAL),
            send: |c, _| cmd(c, 10, &region_write_payload(0, 4, &[1, 2, 3]), &[]),
        },
        Case {
            name: "posted write out of bounds is silent",
            negotiate: true,
            expect: Silent,
            send: |c, _| {
                c.send(10, flags::NO_REPLY, &region_write_payload(0, 8192, &[1, 2, 3, 4]), &[])
                    .map(drop)
                    .unwrap()
            },
        },
        Case {
            name: "WRITE_MULTI without write_multiple",
            negotiate: false,
            expect: Errno(EINVAL),
            send: |c, _| {
                c.negotiate_with(r#"{"capabilities":{"max_msg_fds":8}}"#).unwrap();
                let mut p = le64(1).to_vec();
                p.extend_from_slice(&[&le64(4)[..], &le32(0), &le32(4), &[0; 8]].concat());
                cmd(c, 15, &p, &[])
            },
        },
        Case {
            name: "WRITE_MULTI with a huge count",
            negotiate: true,
            expect: Errno(E2BIG),
            send: |c, _| cmd(c, 15, &le64(u64::MAX), &[]),
        },
        Case {
            name: "WRITE_MULTI entry over 8 bytes",
            negotiate: true,
            expect: Errno(EINVAL),
            send: |c, _| {
                let mut p = le64(1).to_vec();
                p.extend_from_slice(&[&le64(4)[..], &le32(0), &le32(9), &[0; 8]].concat());
                cmd(c, 15, &p, &[])
            },
        },
        // --- interrupts ---
        Case {
            name: "IRQ info of a bad index",
            negotiate: true,
            expect: Errno(EINVAL),
            send: |c, _| cmd(c, 7, &[&le32(16)[..], &le32(0), &le32(5), &le32(0)].concat(), &[]),
        },
        Case {
            name: "SET_IRQS with two actions",
            negotiate: true,
            expect: Errno(EINVAL),
            send: |c, _| cmd(c, 8, &set_irqs_payload(0x21 | 0x08, 0, 0, 0, &[]), &[]),
        },
        Case {
            name: "SET_IRQS with two data types",
            negotiate: true,
            expect: Errno(EINVAL),
            send: |c, _| cmd(c, 8, &set_irqs_payload(0x23, 0, 0, 0, &[]), &[]),
        },
        Case {
            name: "SET_IRQS bools not matching count",
            negotiate: true,
            expect: Errno(EINVAL),
            send: |c, _| cmd(c, 8, &set_irqs_payload(0x22, 2, 0, 2, &[1]), &[]),
        },
        Case {
            name: "SET_IRQS fds not matching count",
            negotiate: true,
            expect: Errno(EINVAL),
            send: |c, f| {
                let e = f.eventfd();
                cmd(c, 8, &set_irqs_payload(0x24, 2, 0, 2, &[]), &[e])
            },
        },
        Case {
            name: "SET_IRQS start + count wrapping",
            negotiate: true,
            expect: Errno(EINVAL),
            send: |c, _| cmd(c, 8, &set_irqs_payload(0x21, 2, u32::MAX, 2, &[]), &[]),
        },
        Case {
            name: "SET_IRQS beyond the vectors",
            negotiate: true,
            expect: Errno(EINVAL),
            send: |c, f| {
                let e = f.eventfd();
                cmd(c, 8, &set_irqs_payload(0x24, 2, 2, 1, &[]), &[e])
            },
        },
        Case {
            name: "SET_IRQS with a pipe as eventfd",
            negotiate: true,
            expect: Errno(EINVAL),
            send: |c, f| {
                let p = f.pipe();
                cmd(c, 8, &set_irqs_payload(0x24, 0, 0, 1, &[]), &[p])
            },
        },
        Case {
            name: "SET_IRQS masking the ERR index",
            negotiate: true,
            expect: Errno(EINVAL),
            send: |c, _| cmd(c, 8, &set_irqs_payload(0x09, 3, 0, 1, &[]), &[]),
        },
        Case {
            name: "SET_IRQS fds with DATA_NONE",
            negotiate: true,
            expect: Errno(EINVAL),
            send: |c, f| {
                let e = f.eventfd();
                cmd(c, 8, &set_irqs_payload(0x21, 0, 0, 1, &[]), &[e])
            },
        },
        Case {
            name: "SET_IRQS of an absent index",
            negotiate: true,
            expect: Errno(EINVAL),
            send: |c, _| cmd(c, 8, &set_irqs_payload(0x21, 9, 0, 0, &[]), &[]),
        },
        // --- reset ---
        Case {
            name: "DEVICE_RESET with a payload",
            negotiate: true,
            expect: Errno(EINVAL),
            send: |c, _| cmd(c, 13, &[1, 2, 3], &[]),
        },
    ]
}

fn run_case(h: &Harness, case: &Case) {
    let mut c = RawClient::connect(&h.socket).unwrap();
    if case.negotiate {
        c.negotiate().unwrap();
    }
    let mut fixtures = Fixtures { ram: memfd(1 << 20), extra: Vec::new() };
    (case.send)(&mut c, &mut fixtures);
    match case.expect {
        Expect::Errno(errno) => {
            let r = c.recv().unwrap_or_else(|e| panic!("{}: no reply ({e})", case.name));
            assert_eq!(r.header.message_type(), flags::TYPE_REPLY, "{}", case.name);
            assert_eq!(r.errno(), errno, "{}: wrong errno", case.name);
            assert_eq!(r.header.size, 16, "{}: an error reply is a bare header", case.name);
            assert!(r.fds.is_empty(), "{}", case.name);
            if !case.negotiate && !h_negotiated(case) {
                c.negotiate().unwrap();
            }
            assert!(c.alive(), "{}: the connection must go on", case.name);
        }
        Expect::Silent => {
            c.stream.set_read_timeout(Some(Duration::from_millis(100))).unwrap();
            assert!(c.recv().is_err(), "{}: expected no reply", case.name);
            c.stream.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
            assert!(c.alive(), "{}: the connection must go on", case.name);
        }
        Expect::Closed => {
            assert!(c.is_closed(), "{}: expected the server to close", case.name);
            h.wait_idle();
            let mut next = RawClient::connect(&h.socket).unwrap();
            next.negotiate().unwrap();
            assert!(next.alive(), "{}: the instance must serve the next client", case.name);
        }
    }
    drop(c);
    drop(fixtures);
    h.wait_idle();
    let dma = h.info().dma;
    assert_eq!((dma.mappings, dma.pins_held), (0, 0), "{}: disconnect leaves nothing mapped", case.name);
}

/// Cases that negotiate inside `send`.
fn h_negotiated(case: &Case) -> bool {
    case.name == "WRITE_MULTI without write_multiple"
}

#[test]
fn hostile_messages_are_refused_and_the_server_survives() {
    let h = Harness::with("testdev", Default::default(), |config| config.dma.max_mappings = 8);
    // Warm up: the first connection allocates what the server keeps (thread-locals, buffers).
    run_case(&h, &cases()[5]);
    let fds_before = open_fds();
    let all = cases();
    assert!(all.len() >= 30, "at least 30 named cases");
    for case in &all {
        run_case(&h, case);
    }
    let protocol = h.info().protocol;
    assert!(protocol.errors as usize >= all.len() - 10, "{protocol:?}");
    assert!(protocol.fatal >= 5);
    // Every fd that came with a refused request was closed.
    assert_eq!(open_fds(), fds_before, "fds leaked");
}
