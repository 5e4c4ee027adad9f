//! Server-to-client DMA (DMA_READ/DMA_WRITE) for memory the client mapped without an fd,
//! with the client sending its own requests while the server's request is outstanding, as
//! QEMU does: the server must keep serving them.

mod common;

use std::time::{Duration, Instant};

use common::raw::*;
use common::testdev::*;
use common::Harness;
use umdev_server::wire::{flags, Command, Header, HEADER_SIZE};

const MSG_IOVA: u64 = 0xc_0000;

fn write_reg(c: &mut RawClient, reg: u64, v: u32) {
    let r = c.region_write(0, reg, &v.to_le_bytes()).unwrap();
    assert_eq!(r.errno(), 0);
}

fn read_reg(c: &mut RawClient, reg: u64) -> u32 {
    let r = c.region_read(0, reg, 4).unwrap();
    assert_eq!(r.errno(), 0);
    u32::from_le_bytes(r.payload[16..20].try_into().unwrap())
}

/// Rings DMA_CMD; returns the server's first DMA request, which may arrive before or after
/// the reply to the ringing write (server requests interleave with replies).
fn ring(c: &mut RawClient, cmd: u32) -> umdev_testkit::client::Reply {
    let id = c
        .send(
            Command::RegionWrite as u16,
            flags::TYPE_COMMAND,
            &region_write_payload(0, DMA_CMD, &cmd.to_le_bytes()),
            &[],
        )
        .unwrap();
    let (mut request, mut replied) = (None, false);
    while request.is_none() || !replied {
        let m = c.recv().unwrap();
        if m.header.message_type() == flags::TYPE_REPLY {
            assert_eq!((m.header.id, m.errno()), (id, 0));
            replied = true;
        } else {
            assert!(request.is_none(), "one request at a time");
            request = Some(m);
        }
    }
    request.unwrap()
}

fn reply(c: &mut RawClient, to: &Header, payload: &[u8]) {
    let h = Header {
        id: to.id,
        command: to.command,
        size: (HEADER_SIZE + payload.len()) as u32,
        flags: flags::TYPE_REPLY,
        error: 0,
    };
    c.send_bytes(&[&h.encode()[..], payload].concat(), &[]).unwrap();
}

/// A client with bus mastering on and 128 KiB at [`MSG_IOVA`] mapped without an fd (the
/// device reaches it only through the client), whose device is checksumming `len` bytes of
/// it; and the server's first DMA request for them.
fn checksumming(h: &Harness, len: u32) -> (RawClient, umdev_testkit::client::Reply) {
    let mut c = RawClient::connect(&h.socket).unwrap();
    c.negotiate().unwrap();
    c.enable_bus_master().unwrap();
    let r = c.request(Command::DmaMap as u16, &dma_map_payload(3, 0, MSG_IOVA, 0x20000), &[]).unwrap();
    assert_eq!(r.errno(), 0);
    write_reg(&mut c, DMA_ADDR_LO, MSG_IOVA as u32);
    write_reg(&mut c, DMA_ADDR_HI, 0);
    write_reg(&mut c, DMA_LEN, len);
    let first = ring(&mut c, CMD_CHECKSUM);
    (c, first)
}

#[test]
fn the_server_keeps_serving_while_its_dma_request_is_pending() {
    let h = Harness::new("testdev");
    // Checksum 100 KiB: more than one 64 KiB DMA_READ.
    let (mut c, first) = checksumming(&h, 100_000);
    let mut first = Some(first);

    let mut served_meanwhile = 0;
    let mut expected_sum = 0u32;
    let mut offset = 0u64;
    while offset < 100_000 {
        let req = match first.take() {
            Some(r) => r,
            None => c.recv().unwrap(),
        };
        assert_eq!(req.header.command, Command::DmaRead as u16, "a DMA_READ from the server");
        assert_eq!(req.header.message_type(), flags::TYPE_COMMAND);
        let addr = u64::from_le_bytes(req.payload[0..8].try_into().unwrap());
        let count = u64::from_le_bytes(req.payload[8..16].try_into().unwrap());
        assert_eq!(addr, MSG_IOVA + offset);
        assert!(count <= 64 * 1024, "chunks stay within what QEMU handles");
        // Before answering, the client asks things of its own: they must be served.
        assert_eq!(read_reg(&mut c, DMA_STATUS), STATUS_BUSY);
        assert_eq!(read_reg(&mut c, ID), ID_VALUE);
        served_meanwhile += 2;
        let data: Vec<u8> = (0..count).map(|i| ((offset + i) % 251) as u8).collect();
        expected_sum = data.iter().fold(expected_sum, |s, &b| s.wrapping_add(u32::from(b)));
        reply(&mut c, &req.header, &[&le64(addr)[..], &le64(count), &data].concat());
        offset += count;
    }
    let deadline = Instant::now() + Duration::from_secs(5);
    while read_reg(&mut c, DMA_STATUS) == STATUS_BUSY {
        assert!(Instant::now() < deadline);
        std::thread::sleep(Duration::from_millis(1));
    }
    assert_eq!(read_reg(&mut c, DMA_STATUS), STATUS_DONE);
    assert_eq!(read_reg(&mut c, DMA_RESULT), expected_sum);
    assert!(served_meanwhile >= 4);

    // DMA_WRITE: a fill goes out as DMA_WRITE messages carrying the data.
    write_reg(&mut c, DMA_LEN, 300);
    write_reg(&mut c, DMA_PATTERN, 0x3c);
    let req = ring(&mut c, CMD_FILL);
    assert_eq!(req.header.command, Command::DmaWrite as u16);
    assert_eq!(u64::from_le_bytes(req.payload[8..16].try_into().unwrap()), 300);
    assert!(req.payload[16..].iter().all(|&b| b == 0x3c) && req.payload.len() == 316);
    // An error reply from the client fails the transfer, and the device says so.
    let err = Header {
        id: req.header.id,
        command: req.header.command,
        size: 16,
        flags: flags::TYPE_REPLY | flags::ERROR,
        error: libc::EPERM as u32,
    };
    c.send_bytes(&err.encode(), &[]).unwrap();
    while read_reg(&mut c, DMA_STATUS) == STATUS_BUSY {
        std::thread::sleep(Duration::from_millis(1));
    }
    assert_eq!(read_reg(&mut c, DMA_STATUS), STATUS_ERROR);
    assert_eq!(read_reg(&mut c, DMA_RESULT), libc::EPERM as u32);
    assert_eq!(h.info().protocol.stray_replies, 0);
}

#[test]
fn a_client_that_never_answers_does_not_wedge_the_device() {
    let h = Harness::new("testdev");
    let mut c = RawClient::connect(&h.socket).unwrap();
    c.negotiate().unwrap();
    c.enable_bus_master().unwrap();
    c.request(Command::DmaMap as u16, &dma_map_payload(3, 0, MSG_IOVA, 0x1000), &[]).unwrap();
    write_reg(&mut c, DMA_ADDR_LO, MSG_IOVA as u32);
    write_reg(&mut c, DMA_LEN, 16);
    let req = ring(&mut c, CMD_CHECKSUM);
    assert_eq!(req.header.command, Command::DmaRead as u16);
    // The client vanishes instead of answering: the device's transfer fails promptly and the
    // instance is ready for the next client.
    drop(c);
    h.wait_idle();
    let mut next = RawClient::connect(&h.socket).unwrap();
    next.negotiate().unwrap();
    assert_eq!(read_reg(&mut next, DMA_STATUS), STATUS_IDLE, "the next client finds a reset device");
}

/// A client that stays connected but never answers: the server waits out its timeout for the
/// chunk (`CLIENT_DMA_TIMEOUT`, 5 s), the device's transfer then fails, and the connection goes
/// on serving the client's requests; the answer that comes after all is counted as a stray
/// reply and dropped.
#[test]
fn a_client_that_stays_but_never_answers_fails_the_transfer_after_the_timeout() {
    let h = Harness::new("testdev");
    let start = Instant::now();
    let (mut c, req) = checksumming(&h, 16);
    assert_eq!(req.header.command, Command::DmaRead as u16);
    let status = loop {
        let status = read_reg(&mut c, DMA_STATUS);
        if status != STATUS_BUSY {
            break status;
        }
        assert!(start.elapsed() < Duration::from_secs(120), "the transfer never ended");
        std::thread::sleep(Duration::from_millis(10));
    };
    assert_eq!(status, STATUS_ERROR);
    // Not before the server's wait for the chunk ran out (it began after `start`).
    assert!(start.elapsed() >= umdev_server::CLIENT_DMA_TIMEOUT, "{:?}", start.elapsed());
    reply(&mut c, &req.header, &[&le64(MSG_IOVA)[..], &le64(16), &[0; 16]].concat());
    assert_eq!(read_reg(&mut c, DMA_STATUS), STATUS_ERROR, "the late answer changed nothing");
    assert_eq!(h.info().protocol.stray_replies, 1);
}

/// A DMA_UNMAP of memory the client mapped without an fd, while the device's transfer from it
/// waits for the client's answer: no pin is held there (the device reaches it through the
/// client), and the unmap still cancels the transfer (its claim), which ends with ECANCELED at
/// its next chunk rather than going on to read memory that is gone.
#[test]
fn an_unmap_cancels_a_transfer_that_holds_no_pins() {
    let h = Harness::new("testdev");
    // Two chunks (64 KiB each): the first is answered after the unmap.
    let (mut c, first) = checksumming(&h, 0x10000 + 16);
    assert_eq!(first.header.command, Command::DmaRead as u16);
    let r = c.request(Command::DmaUnmap as u16, &dma_unmap_payload(24, 0, MSG_IOVA, 0x20000), &[]).unwrap();
    assert_eq!(r.errno(), 0, "nothing is pinned there: the unmap returns at once");
    let count = u64::from_le_bytes(first.payload[8..16].try_into().unwrap());
    reply(&mut c, &first.header, &[&le64(MSG_IOVA)[..], &le64(count), &vec![1; count as usize]].concat());
    let status = loop {
        let status = read_reg(&mut c, DMA_STATUS);
        if status != STATUS_BUSY {
            break status;
        }
        std::thread::sleep(Duration::from_millis(1));
    };
    assert_eq!((status, read_reg(&mut c, DMA_RESULT)), (STATUS_ERROR, libc::ECANCELED as u32));
}

/// A DMA_UNMAP that is refused (its range cuts the mapping) unmaps nothing and cancels
/// nothing: the transfer from that memory goes on to the end.
#[test]
fn an_unmap_that_fails_cancels_nothing() {
    let h = Harness::new("testdev");
    let (mut c, first) = checksumming(&h, 0x10000 + 16);
    let r = c.request(Command::DmaUnmap as u16, &dma_unmap_payload(24, 0, MSG_IOVA, 0x1000), &[]).unwrap();
    assert_eq!(r.errno(), libc::EINVAL, "the range cuts the mapping");
    let mut next = first;
    for chunk in 0..2 {
        assert_eq!(next.header.command, Command::DmaRead as u16, "chunk {chunk}");
        let addr = u64::from_le_bytes(next.payload[0..8].try_into().unwrap());
        let count = u64::from_le_bytes(next.payload[8..16].try_into().unwrap());
        reply(&mut c, &next.header, &[&le64(addr)[..], &le64(count), &vec![1; count as usize]].concat());
        if chunk == 0 {
            next = c.recv().unwrap();
        }
    }
    let status = loop {
        let status = read_reg(&mut c, DMA_STATUS);
        if status != STATUS_BUSY {
            break status;
        }
        std::thread::sleep(Duration::from_millis(1));
    };
    assert_eq!((status, read_reg(&mut c, DMA_RESULT)), (STATUS_DONE, 0x10000 + 16));
}

#[test]
fn dma_reads_come_in_chunks_whose_replies_fit_what_the_server_accepts() {
    // A server that takes 4 KiB per transfer: its DMA_READs ask no more of a client that
    // takes 1 MiB, so each reply (with its data) is a message the server accepts.
    let h = Harness::with("testdev", Default::default(), |c| c.limits.max_data_xfer_size = 4096);
    let (mut c, first) = checksumming(&h, 10_000);
    let mut first = Some(first);
    let (mut offset, mut expected_sum) = (0u64, 0u32);
    while offset < 10_000 {
        let req = first.take().unwrap_or_else(|| c.recv().unwrap());
        assert_eq!(req.header.command, Command::DmaRead as u16);
        let count = u64::from_le_bytes(req.payload[8..16].try_into().unwrap());
        assert!(count <= 4096, "a chunk of {count} bytes");
        let data: Vec<u8> = (0..count).map(|i| ((offset + i) % 251) as u8).collect();
        expected_sum = data.iter().fold(expected_sum, |s, &b| s.wrapping_add(u32::from(b)));
        reply(&mut c, &req.header, &[&le64(MSG_IOVA + offset)[..], &le64(count), &data].concat());
        offset += count;
    }
    let deadline = Instant::now() + Duration::from_secs(60);
    while read_reg(&mut c, DMA_STATUS) == STATUS_BUSY {
        assert!(Instant::now() < deadline);
        std::thread::sleep(Duration::from_millis(1));
    }
    assert_eq!((read_reg(&mut c, DMA_STATUS), read_reg(&mut c, DMA_RESULT)), (STATUS_DONE, expected_sum));
    assert!(c.alive(), "the connection stayed up");
}

/// DMA_STATUS once the transfer has ended, every message on the way a reply: a DMA request of
/// the server's here is one sent after the client took the guest's memory (or its bus
/// mastering) away, and fails the test.
fn status_once_ended(c: &mut RawClient) -> (u32, u32) {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        // REGION_READ of BAR0's DMA_STATUS: offset, region, count.
        let access = [&le64(DMA_STATUS)[..], &0u32.to_le_bytes(), &4u32.to_le_bytes()].concat();
        let id = c.send(Command::RegionRead as u16, flags::TYPE_COMMAND, &access, &[]);
        let m = c.recv().unwrap();
        assert_eq!(
            m.header.message_type(),
            flags::TYPE_REPLY,
            "a request after the withdrawal: {:?}",
            m.header
        );
        assert_eq!((m.header.id, m.errno()), (id.unwrap(), 0));
        let status = u32::from_le_bytes(m.payload[16..20].try_into().unwrap());
        if status != STATUS_BUSY {
            return (status, read_reg(c, DMA_RESULT));
        }
        assert!(Instant::now() < deadline, "the transfer never ended");
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// A transfer through the client goes in pieces of the client's `max_data_xfer_size`. Once a
/// DMA_UNMAP of the memory has been answered, no piece of it follows: the client may already
/// have put something else at that address. The piece outstanding at the unmap is the last.
#[test]
fn no_piece_of_a_transfer_follows_the_reply_to_its_unmap() {
    let h = Harness::with("testdev", Default::default(), |c| c.limits.max_data_xfer_size = 4096);
    // 10,000 bytes: one chunk of testdev's, three pieces of 4 KiB at most.
    let (mut c, first) = checksumming(&h, 10_000);
    let r = c.request(Command::DmaUnmap as u16, &dma_unmap_payload(24, 0, MSG_IOVA, 0x20000), &[]).unwrap();
    assert_eq!(r.errno(), 0);
    let count = u64::from_le_bytes(first.payload[8..16].try_into().unwrap());
    assert_eq!(count, 4096, "the first of three pieces");
    reply(&mut c, &first.header, &[&le64(MSG_IOVA)[..], &le64(count), &vec![1; count as usize]].concat());
    let (status, result) = status_once_ended(&mut c);
    assert_eq!(status, STATUS_ERROR);
    assert!([libc::ECANCELED, libc::EFAULT].contains(&(result as i32)), "errno {result}");
    assert!(c.alive());
}

/// The same for bus mastering: once the config write that clears it has been answered, no
/// piece of a transfer follows, and the transfer ends with bus mastering's error.
#[test]
fn no_piece_of_a_transfer_follows_the_reply_that_turns_bus_mastering_off() {
    let h = Harness::with("testdev", Default::default(), |c| c.limits.max_data_xfer_size = 4096);
    let (mut c, first) = checksumming(&h, 10_000);
    let r = c.region_write(7, 4, &0x0003u16.to_le_bytes()).unwrap();
    assert_eq!(r.errno(), 0, "COMMAND: memory and I/O space on, bus mastering off");
    let count = u64::from_le_bytes(first.payload[8..16].try_into().unwrap());
    reply(&mut c, &first.header, &[&le64(MSG_IOVA)[..], &le64(count), &vec![1; count as usize]].concat());
    let (status, result) = status_once_ended(&mut c);
    assert_eq!((status, result as i32), (STATUS_ERROR, libc::EACCES));
    assert!(c.alive());
}
