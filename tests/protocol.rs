//! Protocol paths a VMM relies on beyond the basic ones: posted writes and REGION_WRITE_MULTI
//! applied in order, and several instances served by one daemon at once.

mod common;

use std::sync::Arc;

use common::raw::*;
use common::testdev::*;
use umdev_mdev::types::InstanceOptions;
use umdev_server::wire::{flags, Command};
use umdev_server::{Daemon, InstanceConfig};

fn multi_entry(region: u32, offset: u64, data: &[u8]) -> Vec<u8> {
    let mut e = [&le64(offset)[..], &le32(region), &le32(data.len() as u32)].concat();
    let mut d = [0u8; 8];
    d[..data.len()].copy_from_slice(data);
    e.extend_from_slice(&d);
    e
}

#[test]
fn posted_writes_and_write_multi_apply_in_order() {
    let h = common::Harness::new("testdev");
    let mut c = RawClient::connect(&h.socket).unwrap();
    let version = c.negotiate().unwrap();
    let caps = String::from_utf8_lossy(&version.payload[4..version.payload.len() - 1]).to_string();
    assert!(caps.contains("\"write_multiple\":true"), "offered to a client that asked: {caps}");

    // 100 posted writes to SCRATCH, no replies; the read after them sees the last.
    for i in 0..100u32 {
        c.send(
            Command::RegionWrite as u16,
            flags::NO_REPLY,
            &region_write_payload(0, SCRATCH, &i.to_le_bytes()),
            &[],
        )
        .unwrap();
    }
    let r = c.region_read(0, SCRATCH, 4).unwrap();
    assert_eq!(r.payload[16..20], 99u32.to_le_bytes(), "a read vouches for every posted write before it");

    // WRITE_MULTI: entries in order, mixed sizes, posted like QEMU sends them.
    let mut p = le64(4).to_vec();
    p.extend(multi_entry(0, SCRATCH, &0x1111_1111u32.to_le_bytes()));
    p.extend(multi_entry(0, DMA_PATTERN, &[0x5a]));
    p.extend(multi_entry(0, SCRATCH, &[0x22, 0x22]));
    p.extend(multi_entry(0, DMA_LEN, &0x10u32.to_le_bytes()));
    c.send(Command::RegionWriteMulti as u16, flags::NO_REPLY, &p, &[]).unwrap();
    let read = |c: &mut RawClient, reg| {
        u32::from_le_bytes(c.region_read(0, reg, 4).unwrap().payload[16..20].try_into().unwrap())
    };
    assert_eq!(read(&mut c, SCRATCH), 0x1111_2222);
    assert_eq!(read(&mut c, DMA_PATTERN), 0x5a);
    assert_eq!(read(&mut c, DMA_LEN), 0x10);
    // With a reply requested, it reports the count written.
    let mut p = le64(1).to_vec();
    p.extend(multi_entry(0, SCRATCH, &[7]));
    let r = c.request(Command::RegionWriteMulti as u16, &p, &[]).unwrap();
    assert_eq!((r.errno(), r.payload.clone()), (0, le64(1).to_vec()));
    assert_eq!(h.info().protocol.errors, 0);
}

#[test]
fn one_daemon_serves_many_instances_at_once() {
    let dir = tempfile::tempdir().unwrap();
    let daemon = Arc::new(Daemon::new());
    let sockets: Vec<_> = (0..8)
        .map(|i| {
            let device = umdev::builtin_registry()
                .find("testdev")
                .unwrap()
                .create(&InstanceOptions::default())
                .unwrap();
            let socket = dir.path().join(format!("{i}.sock"));
            daemon.start(device, InstanceConfig::new(format!("dev{i}"), &socket)).unwrap();
            socket
        })
        .collect();
    let threads: Vec<_> = sockets
        .into_iter()
        .enumerate()
        .map(|(i, socket)| {
            std::thread::spawn(move || {
                let mut c = RawClient::connect(&socket).unwrap();
                c.negotiate().unwrap();
                for n in 0..200u32 {
                    let v = (i as u32) << 16 | n;
                    assert_eq!(c.region_write(0, SCRATCH, &v.to_le_bytes()).unwrap().errno(), 0);
                    let r = c.region_read(0, SCRATCH, 4).unwrap();
                    assert_eq!(r.payload[16..20], v.to_le_bytes(), "instances do not share state");
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    assert_eq!(daemon.list().len(), 8);
    assert!(daemon.list().iter().all(|i| i.protocol.messages["region_read"] == 200));
    assert!(matches!(daemon.stop("nope", false), Err(umdev_server::DaemonError::NotFound(_))));
    // The clients have closed their sockets; each connection thread notices in its own time,
    // and until then an unforced stop is refused (Busy), as it should be.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    while daemon.list().iter().any(|i| i.connected) {
        assert!(std::time::Instant::now() < deadline, "a client still connected 60 s after closing");
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
    daemon.stop("dev3", false).unwrap();
    assert_eq!(daemon.list().len(), 7);
}

#[test]
fn the_bar_memory_fd_a_client_receives_cannot_be_resized() {
    let h = common::Harness::new("testdev");
    let mut c = RawClient::connect(&h.socket).unwrap();
    c.negotiate().unwrap();
    // DEVICE_GET_REGION_INFO for BAR1, room for the sparse-mmap capability: the fd comes along.
    let mut p = le32(64).to_vec();
    p.extend_from_slice(&[0; 4]);
    p.extend_from_slice(&le32(1));
    p.extend_from_slice(&[0; 20]);
    let r = c.request(Command::DeviceGetRegionInfo as u16, &p, &[]).unwrap();
    assert_eq!(r.errno(), 0);
    assert_eq!(r.fds.len(), 1, "BAR1's fd");
    let bar = std::fs::File::from(r.fds.into_iter().next().unwrap());
    // A hostile client would shrink it under the device or grow it without bound: sealed.
    for size in [0, 1 << 30] {
        let err = bar.set_len(size).unwrap_err();
        assert_eq!(err.raw_os_error(), Some(libc::EPERM), "resizing to {size}");
    }
    assert_eq!(bar.metadata().unwrap().len(), umdev_devices::testdev::BAR1_SIZE);
    assert!(c.alive());
}

/// A stop's cleanup outlives its listener, and once that is closed its socket file looks
/// stale: an instance started on the same path meanwhile takes the path over. The stop must
/// then leave the new instance's file alone.
#[test]
fn a_stop_leaves_the_socket_of_an_instance_started_on_its_path_meanwhile() {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("x.sock");
    let daemon = Arc::new(Daemon::new());
    let testdev =
        || umdev::builtin_registry().find("testdev").unwrap().create(&InstanceOptions::default()).unwrap();
    for round in 0..20 {
        daemon.start(testdev(), InstanceConfig::new("old", &socket)).unwrap();
        // A client connected: the stop resets the device and waits for its connection.
        let mut c = RawClient::connect(&socket).unwrap();
        c.negotiate().unwrap();
        let stopper = {
            let daemon = daemon.clone();
            std::thread::spawn(move || daemon.stop("old", true).unwrap())
        };
        // The new instance starts as soon as the old listener is gone (refused while it lives).
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
        while let Err(e) = daemon.start(testdev(), InstanceConfig::new("new", &socket)) {
            assert!(matches!(e, umdev_server::DaemonError::Bind(_)), "round {round}: {e}");
            assert!(std::time::Instant::now() < deadline, "round {round}: the old listener never went");
            std::thread::yield_now();
        }
        stopper.join().unwrap();
        assert!(socket.exists(), "round {round}: the new instance's socket file was removed");
        RawClient::connect(&socket).unwrap().negotiate().unwrap();
        daemon.stop("new", true).unwrap();
        drop(c);
    }
}
