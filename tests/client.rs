//! umdev against rust-vmm's `vfio_user::Client` (what cloud-hypervisor uses), over a real
//! socket: negotiation, region discovery with the sparse-mmap fd, guest memory mapped from a
//! memfd and written by the device, eventfd interrupts, reset, unmap, reconnect.

mod common;

use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;
use std::time::{Duration, Instant};

use common::raw::RawClient;
use common::testdev::*;
use common::{memfd, read32, wait_eventfd, Harness};
use vfio_user::Client;
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

const BAR0: u32 = 0;
const CONFIG: u32 = 7;
const RAM_IOVA: u64 = 0x1000_0000;
const RAM_SIZE: u64 = 1 << 20;

fn write32(c: &mut Client, region: u32, offset: u64, v: u32) {
    c.region_write(region, offset, &v.to_le_bytes()).expect("region_write");
}

fn wait_dma(c: &mut Client) -> u32 {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let s = read32(c, BAR0, DMA_STATUS);
        if s != STATUS_BUSY {
            return s;
        }
        assert!(Instant::now() < deadline, "DMA never completed");
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// Offset of capability `id` in config space.
fn find_cap(c: &mut Client, id: u8) -> u64 {
    let mut ptr = u64::from(read32(c, CONFIG, 0x34) as u8);
    while ptr != 0 {
        let head = read32(c, CONFIG, ptr);
        if head as u8 == id {
            return ptr;
        }
        ptr = u64::from((head >> 8) as u8);
    }
    panic!("capability {id:#x} not found");
}

#[test]
fn rust_vmm_client_drives_testdev() {
    let h = Harness::new("testdev");
    let mut c = Client::new(&h.socket).expect("connect and negotiate");

    // Region discovery: BAR1 is mmap-able through a sparse area, with its fd.
    let bar1 = c.region(1).expect("BAR1");
    assert_eq!(bar1.size, umdev_devices::testdev::BAR1_SIZE);
    assert!(bar1.file_offset.is_some(), "the region fd came with the info");
    assert_eq!(bar1.sparse_areas.len(), 1);
    assert_eq!((bar1.sparse_areas[0].offset, bar1.sparse_areas[0].size), (0, 4096));
    assert_eq!(c.region(7).expect("config").size, 256);
    assert_eq!(c.region(6).expect("ROM").size, 0);

    assert_eq!(read32(&mut c, BAR0, ID), ID_VALUE);
    write32(&mut c, BAR0, SCRATCH, 0xfeed_f00d);
    assert_eq!(read32(&mut c, BAR0, SCRATCH), 0xfeed_f00d);
    assert_eq!(read32(&mut c, CONFIG, 0), 0x75d1_1234);

    // Guest RAM from a memfd; the device fills it through pinned pages once the driver has
    // turned bus mastering on.
    c.region_write(CONFIG, 4, &0x0006u16.to_le_bytes()).expect("COMMAND: memory + bus master");
    let ram = memfd(RAM_SIZE);
    c.dma_map(0, RAM_IOVA, RAM_SIZE, ram.as_raw_fd()).expect("dma_map");
    write32(&mut c, BAR0, DMA_ADDR_LO, (RAM_IOVA + 0x1234) as u32);
    write32(&mut c, BAR0, DMA_ADDR_HI, (RAM_IOVA >> 32) as u32);
    write32(&mut c, BAR0, DMA_LEN, 0x5000);
    write32(&mut c, BAR0, DMA_PATTERN, 0x5a);
    write32(&mut c, BAR0, DMA_CMD, CMD_FILL);
    assert_eq!(wait_dma(&mut c), STATUS_DONE);
    let mut buf = vec![0u8; 0x5002];
    ram.read_exact_at(&mut buf, 0x1233).unwrap();
    assert_eq!(buf[0], 0);
    assert!(buf[1..0x5001].iter().all(|&b| b == 0x5a));
    assert_eq!(buf[0x5001], 0);
    assert!(h.info().dma.pin_calls > 0);

    // INTx: an eventfd the device signals, automasked until unmasked.
    let intx = EventFd::new(EFD_NONBLOCK).unwrap();
    let trigger_eventfd = 0x20 | 0x4;
    c.set_irqs(0, trigger_eventfd, 0, 1, &[intx.as_raw_fd()]).expect("set_irqs INTx");
    write32(&mut c, BAR0, IRQ_RAISE, 1);
    assert_eq!(wait_eventfd(&intx), 1);

    // MSI-X: enable it in config space, give vector 0 an eventfd; DMA completion fires it.
    let msix = find_cap(&mut c, 0x11);
    let control = read32(&mut c, CONFIG, msix) >> 16;
    c.region_write(CONFIG, msix + 2, &((control as u16) | 0x8000).to_le_bytes()).unwrap();
    let vector0 = EventFd::new(EFD_NONBLOCK).unwrap();
    c.set_irqs(2, trigger_eventfd, 0, 1, &[vector0.as_raw_fd()]).expect("set_irqs MSI-X");
    write32(&mut c, BAR0, DMA_CMD, CMD_CHECKSUM);
    assert_eq!(wait_dma(&mut c), STATUS_DONE);
    assert_eq!(read32(&mut c, BAR0, DMA_RESULT), 0x5000 * 0x5a);
    assert!(wait_eventfd(&vector0) >= 1);
    assert!(intx.read().is_err(), "INTx stays quiet while MSI-X is on");

    // Reset: registers back to power-on values.
    c.reset().expect("reset");
    assert_eq!(read32(&mut c, BAR0, SCRATCH), 0);
    assert_eq!(read32(&mut c, BAR0, DMA_STATUS), STATUS_IDLE);

    c.dma_unmap(RAM_IOVA, RAM_SIZE).expect("dma_unmap");
    assert_eq!(h.info().dma.mappings, 0);
    assert_eq!(h.info().protocol.errors, 0, "{:?}", h.info().protocol);
}

#[test]
fn one_client_at_a_time_and_the_next_after_a_disconnect() {
    let h = Harness::new("testdev");
    let mut first = Client::new(&h.socket).expect("first client");
    let ram = memfd(RAM_SIZE);
    first.dma_map(0, RAM_IOVA, RAM_SIZE, ram.as_raw_fd()).unwrap();
    write32(&mut first, BAR0, SCRATCH, 7);

    // A second client is accepted and closed at once: it sees end-of-file.
    let mut second = RawClient::connect(&h.socket).unwrap();
    assert!(second.is_closed(), "a second client must be turned away");
    assert_eq!(h.info().protocol.rejected, 1);

    // The first client vanishes mid-session (mapping held): everything is released...
    drop(first);
    h.wait_idle();
    let info = h.info();
    assert_eq!((info.dma.mappings, info.dma.pins_held), (0, 0));

    // ...and the next client finds a reset device.
    let mut third = Client::new(&h.socket).expect("next client");
    assert_eq!(read32(&mut third, BAR0, SCRATCH), 0, "the device was reset on disconnect");
    assert_eq!(h.info().protocol.connections, 2);
}

/// A region's fd a client maps is sealed against resizing (a shrunk doorbell page would fault
/// in the server at its next reset), and each client gets a file of its own: what the last
/// one still holds reaches nothing of the next one's.
#[test]
fn mapped_region_files_are_sealed_and_each_clients_own() {
    for (ty, region, offset) in [("testdev", 1u32, 0u64), ("nvme", 0, 0x1000)] {
        let mut options = umdev_mdev::types::InstanceOptions::default();
        if ty == "nvme" {
            options.params.insert("doorbells".into(), "mmap".into());
        }
        let h = Harness::with(ty, options, |_| {});
        let file_of = |c: &Client| {
            let info = c.region(region).unwrap();
            info.file_offset.as_ref().expect("a mappable region").file().try_clone().unwrap()
        };
        let first = Client::new(&h.socket).expect("connect");
        let old = file_of(&first);
        let err = old.set_len(0).unwrap_err();
        assert_eq!(err.raw_os_error(), Some(libc::EPERM), "{ty}: {err}");
        assert!(old.set_len(1 << 30).is_err(), "{ty}: grown");
        drop(first);
        h.wait_idle();
        let mut second = Client::new(&h.socket).expect("reconnect");
        let new = file_of(&second);
        // The departed client writes where it mapped; the new client's file does not change.
        old.write_all_at(&[0xa5; 64], offset).unwrap();
        let mut seen = [0u8; 64];
        new.read_exact_at(&mut seen, offset).unwrap();
        assert_eq!(seen, [0; 64], "{ty}: the old file is not the new one");
        if ty == "testdev" {
            let mut b = [0u8; 4];
            second.region_read(region, offset, &mut b).unwrap();
            assert_eq!(b, [0; 4], "the device reads the new file");
            second.region_write(region, offset, &[1, 2, 3, 4]).unwrap();
            new.read_exact_at(&mut b, offset).unwrap();
            assert_eq!(b, [1, 2, 3, 4], "and writes it");
        }
    }
}

/// Connections that close as soon as they connect (probes, clients that gave up) neither
/// wait for a handover nor count against the clients that may wait: the client right after
/// a burst of them is served.
#[test]
fn connections_that_close_at_once_do_not_keep_the_next_client_out() {
    let h = Harness::new("testdev");
    for round in 0..5 {
        for _ in 0..16 {
            drop(std::os::unix::net::UnixStream::connect(&h.socket).unwrap());
        }
        let mut c = RawClient::connect(&h.socket).unwrap();
        c.negotiate().unwrap_or_else(|e| panic!("round {round}: not served: {e}"));
        drop(c);
        h.wait_idle();
    }
}

/// Guest memory on FUSE is refused at DMA_MAP: a user-space server (the client, perhaps)
/// provides its pages, and a server thread touching one would wait as long as it chose.
#[test]
fn guest_memory_on_fuse_is_refused() {
    let fuse = match umdev_testkit::fuse::FuseFile::mount(1 << 20) {
        Ok(f) => f,
        Err(why) => return eprintln!("SKIPPED: {why}"),
    };
    use umdev_server::wire::Command as Cmd;
    let h = Harness::new("testdev");
    let mut c = RawClient::connect(&h.socket).unwrap();
    c.negotiate().unwrap();
    let file = std::fs::OpenOptions::new().read(true).write(true).open(fuse.path()).unwrap();
    let map = common::raw::dma_map_payload(3, 0, RAM_IOVA, 1 << 20);
    let r = c.request(Cmd::DmaMap as u16, &map, &[file.as_raw_fd()]).unwrap();
    assert_eq!(r.errno(), libc::EINVAL, "FUSE memory refused");
    assert_eq!(h.info().dma.mappings, 0);
    // The connection goes on: memory from a memfd maps.
    let ram = memfd(RAM_SIZE);
    let map = common::raw::dma_map_payload(3, 0, RAM_IOVA, RAM_SIZE);
    assert_eq!(c.request(Cmd::DmaMap as u16, &map, &[ram.as_raw_fd()]).unwrap().errno(), 0);
    assert_eq!(h.info().dma.mappings, 1);
}
