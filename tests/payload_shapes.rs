//! Liberal in what it accepts where the spec allows: requests whose payload runs past their
//! fixed part, up to their argsz, are served with the extra bytes ignored. The shapes are
//! those libvfio-user's own client (samples/client.c) and QEMU 11 send; each is followed by a
//! request that proves the stream is still in sync.

mod common;

use std::os::fd::AsRawFd;

use common::raw::*;
use common::Harness;
use umdev_server::wire::Command;

/// `argsz`, then `fields`, zero-padded to `len` bytes.
fn query(argsz: u32, fields: &[u8], len: usize) -> Vec<u8> {
    let mut p = le32(argsz).to_vec();
    p.extend_from_slice(fields);
    p.resize(len, 0);
    p
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(b[at..at + 4].try_into().unwrap())
}

#[test]
fn libvfio_user_clients_region_info_with_its_whole_argsz_buffer() {
    let h = Harness::new("testdev");
    let mut c = RawClient::connect(&h.socket).unwrap();
    c.negotiate().unwrap();
    // First call: 32 bytes, argsz 32, index 1 (testdev's BAR1 has a sparse-mmap capability).
    let first =
        c.request(Command::DeviceGetRegionInfo as u16, &query(32, &[0, 0, 0, 0, 1], 32), &[]).unwrap();
    assert_eq!(first.errno(), 0);
    assert_eq!(first.payload.len(), 32, "exactly the fixed part when the caps do not fit");
    assert!(first.fds.is_empty(), "no fd without the capability (libvfio-user's client has no room for one)");
    let needed = u32_at(&first.payload, 0);
    assert!(needed > 32, "argsz reports the room the capability needs");
    // Second call, as samples/client.c makes it: the payload is the whole argsz-sized buffer,
    // zero past the fixed fields.
    let second = c
        .request(Command::DeviceGetRegionInfo as u16, &query(needed, &[0, 0, 0, 0, 1], needed as usize), &[])
        .unwrap();
    assert_eq!(second.errno(), 0, "a payload of argsz bytes is served");
    assert_eq!(second.payload.len(), needed as usize, "exactly argsz back");
    assert_eq!(u32_at(&second.payload, 0), needed);
    assert_eq!(second.fds.len(), 1, "the region fd travels with the capability");
    assert!(c.alive());
    assert_eq!(h.info().protocol.errors, 0);
}

#[test]
fn every_query_accepts_a_payload_up_to_its_argsz() {
    let h = Harness::new("testdev");
    let mut c = RawClient::connect(&h.socket).unwrap();
    c.negotiate().unwrap();

    // DEVICE_GET_INFO, 40 bytes with argsz 40: the 16-byte answer.
    let r = c.request(Command::DeviceGetInfo as u16, &query(40, &[], 40), &[]).unwrap();
    assert_eq!((r.errno(), r.payload.len()), (0, 16));
    // GET_IRQ_INFO of MSI (index 1), 24 bytes.
    let r = c.request(Command::DeviceGetIrqInfo as u16, &query(24, &[0, 0, 0, 0, 1], 24), &[]).unwrap();
    assert_eq!((r.errno(), r.payload.len()), (0, 16));
    assert_eq!(u32_at(&r.payload, 8), 1, "the index asked for");
    // GET_REGION_IO_FDS of BAR0, 64 bytes: flags and count zero, then room.
    let r = c.request(Command::DeviceGetRegionIoFds as u16, &query(64, &[], 64), &[]).unwrap();
    assert_eq!(r.errno(), 0);
    // REGION_READ has no argsz: bytes past its 16 are ignored.
    let mut read = le64(0).to_vec();
    read.extend_from_slice(&le32(7)); // config space
    read.extend_from_slice(&le32(4));
    read.extend_from_slice(&[0; 8]);
    let r = c.request(Command::RegionRead as u16, &read, &[]).unwrap();
    assert_eq!((r.errno(), r.payload.len()), (0, 20));
    // DMA_MAP and DMA_UNMAP with room past their fixed parts; UNMAP echoes its 24 bytes.
    let ram = common::memfd(1 << 20);
    let mut map = dma_map_payload(3, 0, 0x10_0000, 1 << 20);
    map[0..4].copy_from_slice(&le32(40));
    map.resize(40, 0);
    let r = c.request(Command::DmaMap as u16, &map, &[ram.as_raw_fd()]).unwrap();
    assert_eq!(r.errno(), 0, "DMA_MAP of 40 bytes");
    let mut unmap = dma_unmap_payload(32, 0, 0x10_0000, 1 << 20);
    unmap.resize(32, 0);
    let r = c.request(Command::DmaUnmap as u16, &unmap, &[]).unwrap();
    assert_eq!(r.errno(), 0, "DMA_UNMAP of 32 bytes");
    assert_eq!(r.payload.len(), 24);
    // SET_IRQS DATA_NONE | ACTION_UNMASK of INTx with its argsz-sized buffer (24 bytes).
    let r = c.request(Command::DeviceSetIrqs as u16, &set_irqs_payload(0x11, 0, 0, 1, &[0; 4]), &[]);
    let r = r.unwrap();
    assert_eq!(r.errno(), 0, "SET_IRQS with 4 bytes of room past the fixed part");
    assert!(c.alive());
    assert_eq!(h.info().protocol.errors, 0);
}

#[test]
fn a_payload_longer_than_its_argsz_is_refused_and_the_stream_stays_in_sync() {
    let h = Harness::new("testdev");
    let mut c = RawClient::connect(&h.socket).unwrap();
    c.negotiate().unwrap();
    for (command, payload) in [
        (Command::DeviceGetInfo, query(16, &[], 20)),
        (Command::DeviceGetRegionInfo, query(32, &[], 40)),
        (Command::DeviceGetIrqInfo, query(16, &[], 17)),
        (Command::DeviceGetInfo, query(8, &[], 16)),
        (Command::DeviceGetRegionInfo, query(32, &[], 31)),
    ] {
        let r = c.request(command as u16, &payload, &[]).unwrap();
        assert_eq!(r.errno(), libc::EINVAL, "{command:?} with {} bytes", payload.len());
        assert!(r.payload.is_empty(), "error replies are bare headers");
        assert!(c.alive());
    }
}
