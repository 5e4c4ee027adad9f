//! The fixed parts of vfio-user messages as `#[repr(C)]` structures of little-endian fields.
//!
//! Each structure is laid out exactly as on the wire (the vfio-user specification, which takes
//! most of them from `<linux/vfio.h>`): fields in order, no padding, every field
//! little-endian. A size assertion next to each pins the layout; since every size equals the
//! sum of the field sizes, no structure has padding.
//!
//! Message buffers carry no alignment guarantee, so structures are copied out with
//! [`read_struct`] and written with [`ByteValued::as_slice`]; never borrowed in place with
//! `ByteValued::from_slice`, which needs the buffer aligned for the structure.

use vm_memory::{ByteValued, Le16, Le32, Le64};

/// Copies a `T` out of the first `size_of::<T>()` bytes of `bytes` (which may be longer and
/// need not be aligned); `None` if `bytes` is shorter.
pub fn read_struct<T: ByteValued + Default>(bytes: &[u8]) -> Option<T> {
    let mut value = T::default();
    let dst = value.as_mut_slice();
    dst.copy_from_slice(bytes.get(..dst.len())?);
    Some(value)
}

/// The 16-byte header every message starts with.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct WireHeader {
    /// Message id.
    pub id: Le16,
    /// Command number.
    pub command: Le16,
    /// Whole message size, header included.
    pub size: Le32,
    /// Type and flag bits.
    pub flags: Le32,
    /// errno of an error reply.
    pub error: Le32,
}
const _: () = assert!(size_of::<WireHeader>() == 16);
// SAFETY: plain old data: only little-endian integer fields, no padding (the size is the sum
// of the field sizes), and every bit pattern is a valid value.
unsafe impl ByteValued for WireHeader {}

/// The fixed part of a VERSION payload; the capability JSON follows.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Version {
    /// Major version.
    pub major: Le16,
    /// Minor version.
    pub minor: Le16,
}
const _: () = assert!(size_of::<Version>() == 4);
// SAFETY: plain old data: only little-endian integer fields, no padding (the size is the sum
// of the field sizes), and every bit pattern is a valid value.
unsafe impl ByteValued for Version {}

/// DMA_MAP request.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DmaMap {
    /// Size of this structure.
    pub argsz: Le32,
    /// Access flags (`VFIO_DMA_MAP_FLAG_READ`/`WRITE`).
    pub flags: Le32,
    /// Offset into the fd.
    pub offset: Le64,
    /// IOVA.
    pub addr: Le64,
    /// Bytes.
    pub size: Le64,
}
const _: () = assert!(size_of::<DmaMap>() == 32);
// SAFETY: plain old data: only little-endian integer fields, no padding (the size is the sum
// of the field sizes), and every bit pattern is a valid value.
unsafe impl ByteValued for DmaMap {}

/// DMA_UNMAP request and reply.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DmaUnmap {
    /// Size of the client's buffer.
    pub argsz: Le32,
    /// Flags (`VFIO_DMA_UNMAP_FLAG_*`).
    pub flags: Le32,
    /// IOVA.
    pub addr: Le64,
    /// Bytes.
    pub size: Le64,
}
const _: () = assert!(size_of::<DmaUnmap>() == 24);
// SAFETY: plain old data: only little-endian integer fields, no padding (the size is the sum
// of the field sizes), and every bit pattern is a valid value.
unsafe impl ByteValued for DmaUnmap {}

/// DEVICE_GET_INFO request and reply (`vfio_device_info`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DeviceInfo {
    /// Size of the client's buffer (request) or of the answer (reply).
    pub argsz: Le32,
    /// `VFIO_DEVICE_FLAGS_*`.
    pub flags: Le32,
    /// Regions.
    pub num_regions: Le32,
    /// IRQ indexes.
    pub num_irqs: Le32,
}
const _: () = assert!(size_of::<DeviceInfo>() == 16);
// SAFETY: plain old data: only little-endian integer fields, no padding (the size is the sum
// of the field sizes), and every bit pattern is a valid value.
unsafe impl ByteValued for DeviceInfo {}

/// DEVICE_GET_REGION_INFO request and reply, fixed part (`vfio_region_info`); a reply's
/// capability chain follows it.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RegionInfo {
    /// Size of the client's buffer (request) or of the whole answer (reply).
    pub argsz: Le32,
    /// `VFIO_REGION_INFO_FLAG_*`.
    pub flags: Le32,
    /// Region index.
    pub index: Le32,
    /// Offset of the first capability from the start of this structure, or 0.
    pub cap_offset: Le32,
    /// Region size.
    pub size: Le64,
    /// Offset of the region in the fd sent with the reply.
    pub offset: Le64,
}
const _: () = assert!(size_of::<RegionInfo>() == 32);
// SAFETY: plain old data: only little-endian integer fields, no padding (the size is the sum
// of the field sizes), and every bit pattern is a valid value.
unsafe impl ByteValued for RegionInfo {}

/// The header of one capability in a chain (`vfio_info_cap_header`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CapHeader {
    /// Capability id.
    pub id: Le16,
    /// Capability version.
    pub version: Le16,
    /// Offset of the next capability from the start of the info structure, or 0 for the last.
    pub next: Le32,
}
const _: () = assert!(size_of::<CapHeader>() == 8);
// SAFETY: plain old data: only little-endian integer fields, no padding (the size is the sum
// of the field sizes), and every bit pattern is a valid value.
unsafe impl ByteValued for CapHeader {}

/// The sparse-mmap capability, fixed part (`vfio_region_info_cap_sparse_mmap`); its
/// `nr_areas` [`SparseMmapArea`]s follow it.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SparseMmapCap {
    /// Capability header.
    pub header: CapHeader,
    /// Areas that follow.
    pub nr_areas: Le32,
    /// Reserved, 0.
    pub reserved: Le32,
}
const _: () = assert!(size_of::<SparseMmapCap>() == 16);
// SAFETY: plain old data: a `CapHeader` (itself plain old data) and little-endian integer
// fields, no padding (the size is the sum of the field sizes), and every bit pattern is a
// valid value.
unsafe impl ByteValued for SparseMmapCap {}

/// One mmap-able area of a region (`vfio_region_sparse_mmap_area`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SparseMmapArea {
    /// Offset within the region.
    pub offset: Le64,
    /// Bytes.
    pub size: Le64,
}
const _: () = assert!(size_of::<SparseMmapArea>() == 16);
// SAFETY: plain old data: only little-endian integer fields, no padding (the size is the sum
// of the field sizes), and every bit pattern is a valid value.
unsafe impl ByteValued for SparseMmapArea {}

/// DEVICE_GET_REGION_IO_FDS request and reply, fixed part.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RegionIoFds {
    /// Size of the client's buffer (request) or of the answer (reply).
    pub argsz: Le32,
    /// Flags, 0.
    pub flags: Le32,
    /// Region index.
    pub index: Le32,
    /// ioeventfds/ioregionfds that follow.
    pub count: Le32,
}
const _: () = assert!(size_of::<RegionIoFds>() == 16);
// SAFETY: plain old data: only little-endian integer fields, no padding (the size is the sum
// of the field sizes), and every bit pattern is a valid value.
unsafe impl ByteValued for RegionIoFds {}

/// DEVICE_GET_IRQ_INFO request and reply (`vfio_irq_info`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct IrqInfo {
    /// Size of the client's buffer (request) or of the answer (reply).
    pub argsz: Le32,
    /// `VFIO_IRQ_INFO_*`.
    pub flags: Le32,
    /// IRQ index.
    pub index: Le32,
    /// Vectors.
    pub count: Le32,
}
const _: () = assert!(size_of::<IrqInfo>() == 16);
// SAFETY: plain old data: only little-endian integer fields, no padding (the size is the sum
// of the field sizes), and every bit pattern is a valid value.
unsafe impl ByteValued for IrqInfo {}

/// DEVICE_SET_IRQS request, fixed part (`vfio_irq_set`); DATA_BOOL data follows it. 20 bytes,
/// so only 32-bit fields (a 64-bit one would make it 8-aligned and padded to 24).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct IrqSet {
    /// Size of the client's buffer.
    pub argsz: Le32,
    /// `VFIO_IRQ_SET_DATA_*` and `VFIO_IRQ_SET_ACTION_*`.
    pub flags: Le32,
    /// IRQ index.
    pub index: Le32,
    /// First vector.
    pub start: Le32,
    /// Vectors.
    pub count: Le32,
}
const _: () = assert!(size_of::<IrqSet>() == 20);
// SAFETY: plain old data: only little-endian integer fields, no padding (the size is the sum
// of the field sizes), and every bit pattern is a valid value.
unsafe impl ByteValued for IrqSet {}

/// REGION_READ / REGION_WRITE request and reply, fixed part; data follows it in a read's reply
/// and a write's request.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RegionAccess {
    /// Offset within the region.
    pub offset: Le64,
    /// Region index.
    pub region: Le32,
    /// Bytes.
    pub count: Le32,
}
const _: () = assert!(size_of::<RegionAccess>() == 16);
// SAFETY: plain old data: only little-endian integer fields, no padding (the size is the sum
// of the field sizes), and every bit pattern is a valid value.
unsafe impl ByteValued for RegionAccess {}

/// The fixed part of REGION_WRITE_MULTI and its reply: the number of entries (requested,
/// or done); a request's [`WriteMultiEntry`]s follow it.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct WriteMulti {
    /// Entries.
    pub count: Le64,
}
const _: () = assert!(size_of::<WriteMulti>() == 8);
// SAFETY: plain old data: one little-endian integer field, no padding, and every bit pattern
// is a valid value.
unsafe impl ByteValued for WriteMulti {}

/// One entry of REGION_WRITE_MULTI.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct WriteMultiEntry {
    /// Offset within the region.
    pub offset: Le64,
    /// Region index.
    pub region: Le32,
    /// Bytes of `data` used.
    pub count: Le32,
    /// The bytes, the first `count` of them written.
    pub data: [u8; MULTI_DATA_MAX],
}
/// Data bytes per REGION_WRITE_MULTI entry.
pub const MULTI_DATA_MAX: usize = 8;
const _: () = assert!(size_of::<WriteMultiEntry>() == 24);
// SAFETY: plain old data: little-endian integer fields and a byte array, no padding (the size
// is the sum of the field sizes), and every bit pattern is a valid value.
unsafe impl ByteValued for WriteMultiEntry {}

/// DMA_READ / DMA_WRITE request and reply, fixed part; data follows it in a read's reply and a
/// write's request.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DmaTransfer {
    /// IOVA.
    pub addr: Le64,
    /// Bytes. QEMU replies with a 32-bit count in the low half and 4 bytes of padding.
    pub count: Le64,
}
const _: () = assert!(size_of::<DmaTransfer>() == 16);
// SAFETY: plain old data: only little-endian integer fields, no padding (the size is the sum
// of the field sizes), and every bit pattern is a valid value.
unsafe impl ByteValued for DmaTransfer {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn read_struct_needs_the_fixed_part_and_ignores_the_rest() {
        assert_eq!(read_struct::<DeviceInfo>(&[0; 15]), None);
        // Unaligned on purpose: one byte into the buffer.
        let bytes = [0xff, 16, 0, 0, 0, 3, 0, 0, 0, 9, 0, 0, 0, 5, 0, 0, 0, 0xaa];
        let info = read_struct::<DeviceInfo>(&bytes[1..]).unwrap();
        assert_eq!(
            info,
            DeviceInfo {
                argsz: Le32::from(16),
                flags: Le32::from(3),
                num_regions: Le32::from(9),
                num_irqs: Le32::from(5)
            }
        );
        let map = read_struct::<DmaMap>(&[&[0u8][..], &[1; 32]].concat()[1..]).unwrap();
        assert_eq!(map.size.to_native(), 0x0101_0101_0101_0101);
    }

    #[test]
    fn header_layout() {
        let h = WireHeader {
            id: Le16::from(0x0201),
            command: Le16::from(0x0403),
            size: Le32::from(0x0807_0605),
            flags: Le32::from(0x0c0b_0a09),
            error: Le32::from(0x100f_0e0d),
        };
        assert_eq!(h.as_slice(), [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16]);
        assert_eq!(read_struct::<WireHeader>(h.as_slice()), Some(h));
    }

    #[test]
    fn version_layout() {
        let v = Version { major: Le16::from(0x0201), minor: Le16::from(0x0403) };
        assert_eq!(v.as_slice(), [1, 2, 3, 4]);
    }

    #[test]
    fn dma_map_layout() {
        let m = DmaMap {
            argsz: Le32::from(32),
            flags: Le32::from(3),
            offset: Le64::from(0x1122_3344_5566_7788),
            addr: Le64::from(0x0010_0000),
            size: Le64::from(0x2000),
        };
        let expected = [
            &32u32.to_le_bytes()[..],
            &3u32.to_le_bytes(),
            &0x1122_3344_5566_7788u64.to_le_bytes(),
            &0x0010_0000u64.to_le_bytes(),
            &0x2000u64.to_le_bytes(),
        ]
        .concat();
        assert_eq!(m.as_slice(), expected);
        assert_eq!(read_struct::<DmaMap>(&expected), Some(m));
    }

    #[test]
    fn dma_unmap_layout() {
        let u = DmaUnmap {
            argsz: Le32::from(24),
            flags: Le32::from(2),
            addr: Le64::from(0xdead_0000),
            size: Le64::from(0x1000),
        };
        let expected = [
            &24u32.to_le_bytes()[..],
            &2u32.to_le_bytes(),
            &0xdead_0000u64.to_le_bytes(),
            &0x1000u64.to_le_bytes(),
        ]
        .concat();
        assert_eq!(u.as_slice(), expected);
    }

    #[test]
    fn device_info_layout() {
        let d = DeviceInfo {
            argsz: Le32::from(16),
            flags: Le32::from(3),
            num_regions: Le32::from(9),
            num_irqs: Le32::from(5),
        };
        assert_eq!(d.as_slice(), [16, 0, 0, 0, 3, 0, 0, 0, 9, 0, 0, 0, 5, 0, 0, 0]);
    }

    #[test]
    fn region_info_layout() {
        let r = RegionInfo {
            argsz: Le32::from(64),
            flags: Le32::from(0xf),
            index: Le32::from(1),
            cap_offset: Le32::from(32),
            size: Le64::from(0x2000),
            offset: Le64::from(0x1000),
        };
        let expected = [
            &64u32.to_le_bytes()[..],
            &0xfu32.to_le_bytes(),
            &1u32.to_le_bytes(),
            &32u32.to_le_bytes(),
            &0x2000u64.to_le_bytes(),
            &0x1000u64.to_le_bytes(),
        ]
        .concat();
        assert_eq!(r.as_slice(), expected);
    }

    #[test]
    fn sparse_mmap_layout() {
        let cap = SparseMmapCap {
            header: CapHeader { id: Le16::from(1), version: Le16::from(1), next: Le32::from(0) },
            nr_areas: Le32::from(2),
            reserved: Le32::from(0),
        };
        assert_eq!(cap.as_slice(), [1, 0, 1, 0, 0, 0, 0, 0, 2, 0, 0, 0, 0, 0, 0, 0]);
        assert_eq!(cap.header.as_slice(), &cap.as_slice()[..size_of::<CapHeader>()]);
        let area = SparseMmapArea { offset: Le64::from(0x1000), size: Le64::from(0x3000) };
        assert_eq!(area.as_slice(), [&0x1000u64.to_le_bytes()[..], &0x3000u64.to_le_bytes()].concat());
    }

    #[test]
    fn region_io_fds_layout() {
        let r = RegionIoFds {
            argsz: Le32::from(16),
            flags: Le32::from(0),
            index: Le32::from(2),
            count: Le32::from(0),
        };
        assert_eq!(r.as_slice(), [16, 0, 0, 0, 0, 0, 0, 0, 2, 0, 0, 0, 0, 0, 0, 0]);
    }

    #[test]
    fn irq_info_layout() {
        let i = IrqInfo {
            argsz: Le32::from(16),
            flags: Le32::from(7),
            index: Le32::from(2),
            count: Le32::from(4),
        };
        assert_eq!(i.as_slice(), [16, 0, 0, 0, 7, 0, 0, 0, 2, 0, 0, 0, 4, 0, 0, 0]);
    }

    #[test]
    fn irq_set_layout() {
        let s = IrqSet {
            argsz: Le32::from(22),
            flags: Le32::from(0x22),
            index: Le32::from(1),
            start: Le32::from(3),
            count: Le32::from(2),
        };
        assert_eq!(s.as_slice(), [22, 0, 0, 0, 0x22, 0, 0, 0, 1, 0, 0, 0, 3, 0, 0, 0, 2, 0, 0, 0]);
        assert_eq!(align_of::<IrqSet>(), 4);
    }

    #[test]
    fn region_access_layout() {
        let a = RegionAccess {
            offset: Le64::from(0x0807_0605_0403_0201),
            region: Le32::from(7),
            count: Le32::from(4),
        };
        assert_eq!(a.as_slice(), [1, 2, 3, 4, 5, 6, 7, 8, 7, 0, 0, 0, 4, 0, 0, 0]);
    }

    #[test]
    fn write_multi_layout() {
        assert_eq!(WriteMulti { count: Le64::from(3) }.as_slice(), 3u64.to_le_bytes());
        let e = WriteMultiEntry {
            offset: Le64::from(0x40),
            region: Le32::from(0),
            count: Le32::from(4),
            data: [0xaa, 0xbb, 0xcc, 0xdd, 0, 0, 0, 0],
        };
        let expected = [
            &0x40u64.to_le_bytes()[..],
            &0u32.to_le_bytes(),
            &4u32.to_le_bytes(),
            &[0xaa, 0xbb, 0xcc, 0xdd, 0, 0, 0, 0],
        ]
        .concat();
        assert_eq!(e.as_slice(), expected);
        assert_eq!(std::mem::offset_of!(WriteMultiEntry, data), 16);
    }

    #[test]
    fn dma_transfer_layout() {
        let t = DmaTransfer { addr: Le64::from(0x1_0000_2000), count: Le64::from(4096) };
        assert_eq!(t.as_slice(), [&0x1_0000_2000u64.to_le_bytes()[..], &4096u64.to_le_bytes()].concat());
    }
}
