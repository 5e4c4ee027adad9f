//! `doorbells=auto`, the default: the doorbell page is offered per connection. A client that
//! announces no VERSION capabilities is driven here exactly as SPDK's `nvme_vfio_user`
//! initiator drives a controller (a 4-byte VERSION 0.1, GET_REGION_INFO with a 4064-byte
//! argsz, every doorbell, the admin queue's included, a store into the mapped page, no
//! interrupts, a DMA_UNMAP with the mapping's fd attached); a client that announces them (as
//! QEMU does) is offered no mapping and rings with messages.

mod common;

use std::fs::File;
use std::os::fd::AsRawFd;
use std::time::Duration;

use common::Harness;
use umdev_devices::nvme::spec::Status;
use umdev_mdev::types::InstanceOptions;
use umdev_server::wire::Command;
use umdev_testkit::client::{dma_map_payload, dma_unmap_payload, RawClient};
use umdev_testkit::nvme_driver::{Driver, Transport};
use vm_memory::mmap::MmapRegion;
use vm_memory::{FileOffset, VolatileMemory};

const RAM: u64 = 96 << 20;
const DATA: u64 = Driver::<Polling>::DATA;
const MMAP: u32 = 1 << 2;
const CAPS: u32 = 1 << 3;

/// An nvme instance with a 16 MiB RAM namespace and `doorbells` (`None`: the default, auto).
fn harness(doorbells: Option<&str>) -> Harness {
    let mut options = InstanceOptions::default();
    options.params.insert("ns1".into(), "ram:16M".into());
    if let Some(mode) = doorbells {
        options.params.insert("doorbells".into(), mode.into());
    }
    Harness::with("nvme", options, |_| {})
}

/// GET_REGION_INFO of BAR0 as SPDK asks it (a 4096-byte buffer): flags, and the fd if any.
fn bar0_info(c: &mut RawClient) -> (u32, u64, Option<File>) {
    let mut req = vec![0u8; 4064];
    req[0..4].copy_from_slice(&4064u32.to_le_bytes());
    let mut r = c.request(Command::DeviceGetRegionInfo as u16, &req, &[]).unwrap();
    assert_eq!(r.errno(), 0);
    let flags = u32::from_le_bytes(r.payload[4..8].try_into().unwrap());
    let offset = u64::from_le_bytes(r.payload[24..32].try_into().unwrap());
    (flags, offset, r.fds.pop().map(File::from))
}

/// The driver's side as a polling user-space driver: registers by message, doorbells as
/// stores into the mapped page, guest memory mapped here, no interrupts.
struct Polling {
    client: RawClient,
    ram: MmapRegion,
    doorbells: MmapRegion,
}

impl Transport for Polling {
    fn read32(&mut self, offset: u64) -> Result<u32, String> {
        let r = self.client.region_read(0, offset, 4).map_err(|e| e.to_string())?;
        let bytes = r.payload.get(16..20).ok_or("short REGION_READ reply")?;
        Ok(u32::from_le_bytes(bytes.try_into().unwrap()))
    }
    fn write32(&mut self, offset: u64, value: u32) -> Result<(), String> {
        let r = self.client.region_write(0, offset, &value.to_le_bytes()).map_err(|e| e.to_string())?;
        if r.errno() != 0 {
            return Err(format!("REGION_WRITE {offset:#x}: errno {}", r.errno()));
        }
        Ok(())
    }
    fn doorbell(&mut self, offset: u64, value: u32) -> Result<(), String> {
        let at = (offset - 0x1000) as usize;
        self.doorbells.get_slice(at, 4).map_err(|e| e.to_string())?.copy_from(&value.to_le_bytes());
        Ok(())
    }
    fn put(&mut self, addr: u64, bytes: &[u8]) -> Result<(), String> {
        self.ram.get_slice(addr as usize, bytes.len()).map_err(|e| e.to_string())?.copy_from(bytes);
        Ok(())
    }
    fn get(&mut self, addr: u64, buf: &mut [u8]) -> Result<(), String> {
        self.ram.get_slice(addr as usize, buf.len()).map_err(|e| e.to_string())?.copy_to(buf);
        Ok(())
    }
    fn wait_interrupt(&mut self, _vector: u16, _timeout: Duration) -> Option<bool> {
        None
    }
}

#[test]
fn a_client_without_capabilities_maps_the_doorbell_page_and_rings_only_there() {
    let h = harness(None);
    // Twice: the second client maps a page of its own (the first one's is no longer read).
    for _client in 0..2 {
        let mut c = RawClient::connect(&h.socket).unwrap();
        // SPDK's VERSION: major 0, minor 1, nothing else.
        assert_eq!(c.request(Command::Version as u16, &[0, 0, 1, 0], &[]).unwrap().errno(), 0);
        let (flags, offset, fd) = bar0_info(&mut c);
        assert_eq!(flags & (MMAP | CAPS), MMAP | CAPS, "BAR0 mappable, with its sparse area: {flags:#x}");
        let fd = fd.expect("the doorbell page's fd");
        let doorbells = MmapRegion::from_file(FileOffset::new(fd, offset + 0x1000), 4096).unwrap();
        let ram_file = common::memfd(RAM);
        let map = dma_map_payload(3, 0, 0, RAM);
        assert_eq!(c.request(Command::DmaMap as u16, &map, &[ram_file.as_raw_fd()]).unwrap().errno(), 0);
        c.enable_bus_master().unwrap();
        let ram =
            MmapRegion::from_file(FileOffset::new(ram_file.try_clone().unwrap(), 0), RAM as usize).unwrap();
        let mut d = Driver::new(Polling { client: c, ram, doorbells });
        d.poll = true;
        d.enable().unwrap();
        d.identify_controller().unwrap();
        d.create_io_queues(2, 64, true).unwrap();
        let data: Vec<u8> = (0..8192u32).map(|i| (i * 7) as u8).collect();
        d.t.put(DATA, &data).unwrap();
        assert_eq!(d.rw(1, false, 1, 8, 16, 512, &[DATA, DATA + 0x1000], 0).unwrap(), Status::SUCCESS);
        assert_eq!(
            d.rw(2, true, 1, 8, 16, 512, &[DATA + 0x10000, DATA + 0x11000], 0).unwrap(),
            Status::SUCCESS
        );
        let mut back = vec![0u8; 8192];
        d.t.get(DATA + 0x10000, &mut back).unwrap();
        assert!(back == data, "the data read back differs");
        let device = h.info().device;
        assert_eq!(
            (device["doorbells"].as_str(), device["doorbells_now"].as_str()),
            (Some("auto"), Some("mmap"))
        );
        assert_eq!(device["doorbell_messages"], 0, "every doorbell went through the page: {device}");
        // An admin command while the I/O queues' workers watch the page: one of them sees the
        // admin tail move and wakes the admin queue's worker (the admin worker's own look is rare).
        let nudges = device["admin_nudges"].as_u64().unwrap();
        d.identify_controller().unwrap();
        let deadline = std::time::Instant::now() + Duration::from_secs(60);
        while h.info().device["admin_nudges"].as_u64().unwrap() == nudges {
            assert!(std::time::Instant::now() < deadline, "no I/O queue's worker woke the admin worker");
            std::thread::sleep(Duration::from_millis(1));
        }
        // Detach as SPDK does: shutdown notification with CC.EN left at 1, then DMA_UNMAP with
        // the mapping's fd attached, served (and the fd closed), then close.
        d.shutdown().unwrap();
        let unmap = dma_unmap_payload(24, 0, 0, RAM);
        let r = d.t.client.request(Command::DmaUnmap as u16, &unmap, &[ram_file.as_raw_fd()]).unwrap();
        assert_eq!(r.errno(), 0, "DMA_UNMAP with an fd attached");
        drop(d);
        h.wait_idle();
        assert_eq!(h.info().dma.pinned_pages, 0);
    }
}

#[test]
fn a_client_with_capabilities_gets_message_doorbells_and_the_next_one_chooses_again() {
    let h = harness(None);
    for round in 0..2 {
        let mut c = RawClient::connect(&h.socket).unwrap();
        c.negotiate().unwrap(); // QEMU's capabilities
        let (flags, _, fd) = bar0_info(&mut c);
        assert_eq!(flags & MMAP, 0, "round {round}: no mapping for a VMM: {flags:#x}");
        assert!(fd.is_none());
        drop(c);
        h.wait_idle();
        // A polling client next: offered the page.
        let mut c = RawClient::connect(&h.socket).unwrap();
        assert_eq!(c.request(Command::Version as u16, &[0, 0, 1, 0], &[]).unwrap().errno(), 0);
        let (flags, _, fd) = bar0_info(&mut c);
        assert_eq!(flags & MMAP, MMAP, "round {round}: {flags:#x}");
        assert!(fd.is_some());
        drop(c);
        h.wait_idle();
    }
}

#[test]
fn with_doorbells_message_a_client_without_capabilities_finds_no_page() {
    let h = harness(Some("message"));
    let mut c = RawClient::connect(&h.socket).unwrap();
    assert_eq!(c.request(Command::Version as u16, &[0, 0, 1, 0], &[]).unwrap().errno(), 0);
    let (flags, _, fd) = bar0_info(&mut c);
    assert_eq!((flags & MMAP, fd.is_none()), (0, true));
}

#[test]
fn a_client_that_takes_no_fds_is_offered_no_mapping() {
    let h = harness(Some("mmap"));
    let mut c = RawClient::connect(&h.socket).unwrap();
    assert_eq!(c.negotiate_with(r#"{"capabilities":{"max_msg_fds":0}}"#).unwrap().errno(), 0);
    let (flags, _, fd) = bar0_info(&mut c);
    assert_eq!(flags & (MMAP | CAPS), 0, "no fd can come, so no area is mappable: {flags:#x}");
    assert!(fd.is_none());
    // One that takes fds is offered the page.
    drop(c);
    h.wait_idle();
    let mut c = RawClient::connect(&h.socket).unwrap();
    c.negotiate().unwrap();
    let (flags, _, fd) = bar0_info(&mut c);
    assert_eq!(flags & MMAP, MMAP, "{flags:#x}");
    assert!(fd.is_some());
}
