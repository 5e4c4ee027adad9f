//! Page arithmetic and access permissions shared by the whole engine.

use bitflags::bitflags;

/// log2 of [`PAGE_SIZE`].
pub const PAGE_SHIFT: u32 = 12;
/// The engine's page: the unit of IOVA translation, pin counts and lock accounting.
///
/// It is the host's base page size (4 KiB); hugetlb-backed mappings are still pinned in
/// units of this size, only their backing is larger.
pub const PAGE_SIZE: u64 = 1 << PAGE_SHIFT;

/// True if `value` is a multiple of [`PAGE_SIZE`].
#[inline]
pub fn is_page_aligned(value: u64) -> bool {
    value & (PAGE_SIZE - 1) == 0
}

/// The IOVA page number holding byte address `iova`.
#[inline]
pub fn pfn_of(iova: u64) -> u64 {
    iova >> PAGE_SHIFT
}

/// The byte address of IOVA page number `pfn`.
///
/// Page numbers come from `pfn_of` or from callers; a page number above `u64::MAX >> 12`
/// has no byte address, so callers validate with [`iova_of_checked`] first.
#[inline]
pub fn iova_of(pfn: u64) -> u64 {
    pfn << PAGE_SHIFT
}

/// The byte address of `pfn`, or `None` if it does not fit in 64 bits.
#[inline]
pub fn iova_of_checked(pfn: u64) -> Option<u64> {
    pfn.checked_mul(PAGE_SIZE)
}

bitflags! {
    /// Access rights of a mapping, and the access a pin asks for. Neither may be empty: a
    /// mapping that grants nothing is refused (`MapError::NoAccess`), and so is a pin that
    /// asks for nothing (`PinError::NoAccess`), both `EINVAL`.
    ///
    /// The bit values are those of `VFIO_DMA_MAP_FLAG_READ`/`_WRITE`, so vfio-user's DMA_MAP
    /// flags convert directly.
    #[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
    pub struct Prot: u32 {
        /// The device may read the memory.
        const READ = 1 << 0;
        /// The device may write the memory.
        const WRITE = 1 << 1;
    }
}

impl Prot {
    /// Read and write access.
    pub const READ_WRITE: Prot = Prot::READ.union(Prot::WRITE);

    /// The `PROT_*` bits for mmap.
    pub(crate) fn mmap_flags(self) -> nix::sys::mman::ProtFlags {
        use nix::sys::mman::ProtFlags;
        let mut flags = ProtFlags::PROT_NONE;
        if self.contains(Prot::READ) {
            flags |= ProtFlags::PROT_READ;
        }
        if self.contains(Prot::WRITE) {
            // x86 cannot map write-only; asking for write implies read, as in the kernel.
            flags |= ProtFlags::PROT_READ | ProtFlags::PROT_WRITE;
        }
        flags
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn page_helpers() {
        assert!(is_page_aligned(0));
        assert!(is_page_aligned(8192));
        assert!(!is_page_aligned(4097));
        assert_eq!(pfn_of(0x5fff), 5);
        assert_eq!(iova_of(5), 0x5000);
        assert_eq!(iova_of_checked(u64::MAX >> 12), Some(!0xfff));
        assert_eq!(iova_of_checked((u64::MAX >> 12) + 1), None);
    }

    #[test]
    fn prot_matches_vfio_flag_bits() {
        assert_eq!(Prot::READ.bits(), 1);
        assert_eq!(Prot::WRITE.bits(), 2);
        assert!(Prot::READ_WRITE.contains(Prot::WRITE));
    }
}
