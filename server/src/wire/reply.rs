//! Encoding the server's messages: replies to client requests, and the server's own
//! DMA_READ/DMA_WRITE requests.
//!
//! Every reply is no larger than the client's buffer for it (QEMU receives replies into
//! fixed buffers and drops the connection otherwise): region info sends its capability chain
//! only when `argsz` leaves room for it, and reports the size it needs.

use umdev_mdev::{IrqInfo, RegionFlags, RegionInfo};

use super::{flags, Command, Header, HEADER_SIZE};

/// `VFIO_REGION_INFO_FLAG_CAPS`.
pub const REGION_FLAG_CAPS: u32 = 1 << 3;
/// `VFIO_REGION_INFO_CAP_SPARSE_MMAP`.
pub const CAP_SPARSE_MMAP: u16 = 1;
/// Bytes of `vfio_region_info`.
pub const REGION_INFO_SIZE: usize = 32;

/// The header of a successful reply to `request` carrying `payload_len` bytes.
pub fn ok_header(request: &Header, payload_len: usize) -> Header {
    Header {
        id: request.id,
        command: request.command,
        size: (HEADER_SIZE + payload_len) as u32,
        flags: flags::TYPE_REPLY,
        error: 0,
    }
}

/// The header (and whole message) of an error reply to `request`.
pub fn error_header(request: &Header, errno: i32) -> Header {
    Header {
        id: request.id,
        command: request.command,
        size: HEADER_SIZE as u32,
        flags: flags::TYPE_REPLY | flags::ERROR,
        error: errno.unsigned_abs(),
    }
}

/// The header of a server-to-client request.
pub fn request_header(id: u16, command: Command, payload_len: usize) -> Header {
    Header {
        id,
        command: command as u16,
        size: (HEADER_SIZE + payload_len) as u32,
        flags: flags::TYPE_COMMAND,
        error: 0,
    }
}

/// Little-endian field writer.
#[derive(Default)]
pub struct Out {
    /// The bytes so far.
    pub bytes: Vec<u8>,
}

impl Out {
    /// Appends a u16.
    pub fn u16(&mut self, v: u16) -> &mut Self {
        self.bytes.extend_from_slice(&v.to_le_bytes());
        self
    }
    /// Appends a u32.
    pub fn u32(&mut self, v: u32) -> &mut Self {
        self.bytes.extend_from_slice(&v.to_le_bytes());
        self
    }
    /// Appends a u64.
    pub fn u64(&mut self, v: u64) -> &mut Self {
        self.bytes.extend_from_slice(&v.to_le_bytes());
        self
    }
}

/// DEVICE_GET_INFO reply payload.
pub fn device_info(info: &umdev_mdev::DeviceInfo) -> Vec<u8> {
    let mut o = Out::default();
    o.u32(16).u32(info.flags.bits()).u32(info.num_regions).u32(info.num_irqs);
    o.bytes
}

/// DEVICE_GET_REGION_INFO reply payload, and whether the region's fd goes with it (only
/// with a complete answer).
pub fn region_info(index: u32, info: &RegionInfo, argsz: u32) -> (Vec<u8>, bool) {
    let areas = info.mmap.as_ref().map_or(&[][..], |m| &m.areas[..]);
    let caps_len = if areas.is_empty() { 0 } else { 16 + 16 * areas.len() };
    let full = REGION_INFO_SIZE + caps_len;
    let fits = argsz as usize >= full;
    let mut flags = info.flags.bits();
    // CAPS only with the chain itself: QEMU rejects CAPS with a cap_offset below 32. A client
    // with too small a buffer learns the size it needs from argsz and asks again.
    if caps_len > 0 && fits {
        flags |= REGION_FLAG_CAPS;
    }
    let cap_offset = if caps_len > 0 && fits { REGION_INFO_SIZE as u32 } else { 0 };
    let file_offset = info.mmap.as_ref().map_or(0, |m| m.offset);
    let mut o = Out::default();
    o.u32(full as u32).u32(flags).u32(index).u32(cap_offset).u64(info.size).u64(file_offset);
    if caps_len > 0 && fits {
        o.u16(CAP_SPARSE_MMAP).u16(1).u32(0).u32(areas.len() as u32).u32(0);
        for a in areas {
            o.u64(a.offset).u64(a.size);
        }
    }
    let send_fd = fits && info.flags.contains(RegionFlags::MMAP) && info.mmap.is_some();
    (o.bytes, send_fd)
}

/// DEVICE_GET_REGION_IO_FDS reply payload: this server offers no ioeventfds.
pub fn region_io_fds(index: u32) -> Vec<u8> {
    let mut o = Out::default();
    o.u32(16).u32(0).u32(index).u32(0);
    o.bytes
}

/// DEVICE_GET_IRQ_INFO reply payload.
pub fn irq_info(index: u32, info: &IrqInfo) -> Vec<u8> {
    let mut o = Out::default();
    o.u32(16).u32(info.flags.bits()).u32(index).u32(info.count);
    o.bytes
}

/// DMA_UNMAP reply payload: the request's fields echoed.
pub fn dma_unmap(argsz: u32, flags: u32, iova: u64, size: u64) -> Vec<u8> {
    let mut o = Out::default();
    o.u32(argsz.min(24)).u32(flags).u64(iova).u64(size);
    o.bytes
}

/// The fixed part of a REGION_READ / REGION_WRITE reply.
pub fn region_access(offset: u64, region: u32, count: u32) -> [u8; 16] {
    let mut b = [0u8; 16];
    b[0..8].copy_from_slice(&offset.to_le_bytes());
    b[8..12].copy_from_slice(&region.to_le_bytes());
    b[12..16].copy_from_slice(&count.to_le_bytes());
    b
}

/// The fixed part of a DMA_READ / DMA_WRITE request: address and count.
pub fn dma_transfer(iova: u64, count: u64) -> [u8; 16] {
    let mut b = [0u8; 16];
    b[0..8].copy_from_slice(&iova.to_le_bytes());
    b[8..16].copy_from_slice(&count.to_le_bytes());
    b
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use umdev_mdev::{RegionMmap, SparseArea};

    fn sparse_region() -> RegionInfo {
        let fd = Arc::new(std::os::fd::OwnedFd::from(std::fs::File::open("/dev/null").unwrap()));
        RegionInfo {
            size: 8192,
            flags: RegionFlags::READ | RegionFlags::WRITE | RegionFlags::MMAP,
            mmap: Some(RegionMmap { fd, offset: 0x1000, areas: vec![SparseArea { offset: 0, size: 4096 }] }),
        }
    }

    #[test]
    fn region_info_sends_caps_only_when_they_fit() {
        let (short, fd) = region_info(1, &sparse_region(), 32);
        assert_eq!(short.len(), 32);
        assert!(!fd);
        assert_eq!(u32::from_le_bytes(short[0..4].try_into().unwrap()), 64, "argsz names the size needed");
        assert_eq!(u32::from_le_bytes(short[12..16].try_into().unwrap()), 0, "no cap_offset");
        assert_eq!(u32::from_le_bytes(short[4..8].try_into().unwrap()) & REGION_FLAG_CAPS, 0, "no CAPS flag");
        let (full, fd) = region_info(1, &sparse_region(), 64);
        assert_eq!(full.len(), 64);
        assert!(fd);
        assert_eq!(u32::from_le_bytes(full[4..8].try_into().unwrap()) & REGION_FLAG_CAPS, REGION_FLAG_CAPS);
        assert_eq!(u32::from_le_bytes(full[12..16].try_into().unwrap()), 32);
        assert_eq!(u64::from_le_bytes(full[24..32].try_into().unwrap()), 0x1000, "file offset");
        assert_eq!(u16::from_le_bytes(full[32..34].try_into().unwrap()), CAP_SPARSE_MMAP);
        assert_eq!(u32::from_le_bytes(full[36..40].try_into().unwrap()), 0, "last capability");
        assert_eq!(u32::from_le_bytes(full[40..44].try_into().unwrap()), 1, "one area");
        assert_eq!(u64::from_le_bytes(full[56..64].try_into().unwrap()), 4096, "area size");
    }

    #[test]
    fn a_plain_region_needs_32_bytes() {
        let (b, fd) = region_info(0, &RegionInfo::read_write(4096), 32);
        assert_eq!((b.len(), fd), (32, false));
        assert_eq!(u32::from_le_bytes(b[0..4].try_into().unwrap()), 32);
    }

    #[test]
    fn error_replies_are_bare_headers() {
        let req = Header { id: 7, command: 9, size: 32, flags: 0, error: 0 };
        let h = error_header(&req, libc::EINVAL);
        assert_eq!((h.id, h.command, h.size, h.flags, h.error), (7, 9, 16, 0x21, 22));
    }
}
