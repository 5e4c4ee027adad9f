//! Encoding the server's messages: replies to client requests, and the server's own
//! DMA_READ/DMA_WRITE requests.
//!
//! Every reply is no larger than the client's buffer for it (QEMU receives replies into
//! fixed buffers and drops the connection otherwise): region info sends its capability chain
//! only when `argsz` leaves room for it, and reports the size it needs.

use umdev_mdev::{IrqInfo, RegionFlags, RegionInfo};
use vm_memory::{ByteValued, Le16, Le32, Le64};

use super::structs::{self, CapHeader, DmaTransfer, RegionAccess, SparseMmapArea, SparseMmapCap, WriteMulti};
use super::{flags, Command, Header, HEADER_SIZE};

/// `VFIO_REGION_INFO_FLAG_CAPS`.
pub const REGION_FLAG_CAPS: u32 = 1 << 3;
/// `VFIO_REGION_INFO_CAP_SPARSE_MMAP`.
pub const CAP_SPARSE_MMAP: u16 = 1;
/// Version of the sparse-mmap capability.
pub const CAP_SPARSE_MMAP_VERSION: u16 = 1;
/// Bytes of `vfio_region_info`.
pub const REGION_INFO_SIZE: usize = size_of::<structs::RegionInfo>();

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

/// DEVICE_GET_INFO reply payload.
pub fn device_info(info: &umdev_mdev::DeviceInfo) -> Vec<u8> {
    structs::DeviceInfo {
        argsz: Le32::from(size_of::<structs::DeviceInfo>() as u32),
        flags: Le32::from(info.flags.bits()),
        num_regions: Le32::from(info.num_regions),
        num_irqs: Le32::from(info.num_irqs),
    }
    .as_slice()
    .to_vec()
}

/// DEVICE_GET_REGION_INFO reply payload, and whether the region's fd goes with it (only
/// with a complete answer).
pub fn region_info(index: u32, info: &RegionInfo, argsz: u32) -> (Vec<u8>, bool) {
    let areas = info.mmap.as_ref().map_or(&[][..], |m| &m.areas[..]);
    let caps_len = if areas.is_empty() {
        0
    } else {
        size_of::<SparseMmapCap>() + size_of::<SparseMmapArea>() * areas.len()
    };
    let full = REGION_INFO_SIZE + caps_len;
    let fits = argsz as usize >= full;
    let with_caps = caps_len > 0 && fits;
    let mut flags = info.flags.bits();
    // CAPS only with the chain itself: QEMU rejects CAPS with a cap_offset below 32. A client
    // with too small a buffer learns the size it needs from argsz and asks again.
    if with_caps {
        flags |= REGION_FLAG_CAPS;
    }
    let fixed = structs::RegionInfo {
        argsz: Le32::from(full as u32),
        flags: Le32::from(flags),
        index: Le32::from(index),
        cap_offset: Le32::from(if with_caps { REGION_INFO_SIZE as u32 } else { 0 }),
        size: Le64::from(info.size),
        offset: Le64::from(info.mmap.as_ref().map_or(0, |m| m.offset)),
    };
    let mut bytes = Vec::with_capacity(if with_caps { full } else { REGION_INFO_SIZE });
    bytes.extend_from_slice(fixed.as_slice());
    if with_caps {
        let cap = SparseMmapCap {
            header: CapHeader {
                id: Le16::from(CAP_SPARSE_MMAP),
                version: Le16::from(CAP_SPARSE_MMAP_VERSION),
                // The only capability: the chain ends here.
                next: Le32::from(0),
            },
            nr_areas: Le32::from(areas.len() as u32),
            reserved: Le32::from(0),
        };
        bytes.extend_from_slice(cap.as_slice());
        for a in areas {
            let area = SparseMmapArea { offset: Le64::from(a.offset), size: Le64::from(a.size) };
            bytes.extend_from_slice(area.as_slice());
        }
    }
    let send_fd = fits && info.flags.contains(RegionFlags::MMAP) && info.mmap.is_some();
    (bytes, send_fd)
}

/// DEVICE_GET_REGION_IO_FDS reply payload: this server offers no ioeventfds.
pub fn region_io_fds(index: u32) -> Vec<u8> {
    structs::RegionIoFds {
        argsz: Le32::from(size_of::<structs::RegionIoFds>() as u32),
        flags: Le32::from(0),
        index: Le32::from(index),
        count: Le32::from(0),
    }
    .as_slice()
    .to_vec()
}

/// DEVICE_GET_IRQ_INFO reply payload.
pub fn irq_info(index: u32, info: &IrqInfo) -> Vec<u8> {
    structs::IrqInfo {
        argsz: Le32::from(size_of::<structs::IrqInfo>() as u32),
        flags: Le32::from(info.flags.bits()),
        index: Le32::from(index),
        count: Le32::from(info.count),
    }
    .as_slice()
    .to_vec()
}

/// DMA_UNMAP reply payload: the request's fields echoed.
pub fn dma_unmap(argsz: u32, flags: u32, iova: u64, size: u64) -> Vec<u8> {
    structs::DmaUnmap {
        argsz: Le32::from(argsz.min(size_of::<structs::DmaUnmap>() as u32)),
        flags: Le32::from(flags),
        addr: Le64::from(iova),
        size: Le64::from(size),
    }
    .as_slice()
    .to_vec()
}

/// The fixed part of a REGION_READ / REGION_WRITE reply.
pub fn region_access(offset: u64, region: u32, count: u32) -> [u8; 16] {
    let access =
        RegionAccess { offset: Le64::from(offset), region: Le32::from(region), count: Le32::from(count) };
    let mut b = [0u8; size_of::<RegionAccess>()];
    b.copy_from_slice(access.as_slice());
    b
}

/// REGION_WRITE_MULTI reply payload: the number of writes done.
pub fn region_write_multi(done: u64) -> [u8; 8] {
    let mut b = [0u8; 8];
    b.copy_from_slice(WriteMulti { count: Le64::from(done) }.as_slice());
    b
}

/// The fixed part of a DMA_READ / DMA_WRITE request: address and count.
pub fn dma_transfer(iova: u64, count: u64) -> [u8; 16] {
    let transfer = DmaTransfer { addr: Le64::from(iova), count: Le64::from(count) };
    let mut b = [0u8; size_of::<DmaTransfer>()];
    b.copy_from_slice(transfer.as_slice());
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
    fn fixed_replies_byte_for_byte() {
        let info = umdev_mdev::DeviceInfo {
            flags: umdev_mdev::DeviceFlags::from_bits_retain(3),
            num_regions: 9,
            num_irqs: 5,
        };
        assert_eq!(device_info(&info), [16, 0, 0, 0, 3, 0, 0, 0, 9, 0, 0, 0, 5, 0, 0, 0]);
        assert_eq!(region_io_fds(2), [16, 0, 0, 0, 0, 0, 0, 0, 2, 0, 0, 0, 0, 0, 0, 0]);
        let irq = IrqInfo { flags: umdev_mdev::IrqFlags::from_bits_retain(7), count: 4 };
        assert_eq!(irq_info(1, &irq), [16, 0, 0, 0, 7, 0, 0, 0, 1, 0, 0, 0, 4, 0, 0, 0]);
        let unmap =
            [&24u32.to_le_bytes()[..], &2u32.to_le_bytes(), &0x5000u64.to_le_bytes(), &8u64.to_le_bytes()];
        assert_eq!(dma_unmap(40, 2, 0x5000, 8), unmap.concat(), "argsz capped at 24");
        assert_eq!(dma_unmap(8, 2, 0x5000, 8)[0..4], 8u32.to_le_bytes());
        assert_eq!(
            region_access(0x0807_0605_0403_0201, 7, 4),
            [1, 2, 3, 4, 5, 6, 7, 8, 7, 0, 0, 0, 4, 0, 0, 0]
        );
        assert_eq!(region_write_multi(3), 3u64.to_le_bytes());
        assert_eq!(
            dma_transfer(0x1000, 0x20),
            [&0x1000u64.to_le_bytes()[..], &0x20u64.to_le_bytes()].concat()[..]
        );
    }

    #[test]
    fn full_region_info_byte_for_byte() {
        let (full, _) = region_info(1, &sparse_region(), 4096);
        let flags = (RegionFlags::READ | RegionFlags::WRITE | RegionFlags::MMAP).bits() | REGION_FLAG_CAPS;
        let expected = [
            &64u32.to_le_bytes()[..],
            &flags.to_le_bytes(),
            &1u32.to_le_bytes(),
            &32u32.to_le_bytes(),
            &8192u64.to_le_bytes(),
            &0x1000u64.to_le_bytes(),
            &1u16.to_le_bytes(),
            &1u16.to_le_bytes(),
            &0u32.to_le_bytes(),
            &1u32.to_le_bytes(),
            &0u32.to_le_bytes(),
            &0u64.to_le_bytes(),
            &4096u64.to_le_bytes(),
        ]
        .concat();
        assert_eq!(full, expected);
    }

    #[test]
    fn error_replies_are_bare_headers() {
        let req = Header { id: 7, command: 9, size: 32, flags: 0, error: 0 };
        let h = error_header(&req, libc::EINVAL);
        assert_eq!((h.id, h.command, h.size, h.flags, h.error), (7, 9, 16, 0x21, 22));
    }
}
