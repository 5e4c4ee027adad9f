//! PRPs: a command's data pointer turned into the array of guest pages it names.
//!
//! PRP1 names the first page (with a dword-aligned offset); PRP2 the second page when the
//! data ends there, or else a PRP list: qword-aligned entries to the end of its page, the
//! last entry of a full page pointing at the next list page. Every entry after the first
//! must be page aligned. The list pages are read through the pinning engine. The result is
//! one page-number array for ONE pin call.

use smallvec::SmallVec;

use super::spec::{Status, PAGE};
use umdev_mdev::DeviceContext;

/// The most data one command moves (Identify's MDTS: 2^8 pages of 4 KiB).
pub const MAX_TRANSFER: usize = 1 << 20;
/// Pages of the largest transfer, one more for an unaligned start.
pub const MAX_PAGES: usize = MAX_TRANSFER / PAGE as usize + 1;

/// The guest pages of one command's data.
#[derive(Debug, Default)]
pub struct DataPages {
    /// IOVA page numbers, in data order.
    pub pfns: SmallVec<[u64; MAX_PAGES]>,
    /// Offset of the data in the first page.
    pub offset: usize,
    /// Bytes.
    pub len: usize,
    /// PRP list pages read.
    pub list_pages: u32,
}

fn page_offset(addr: u64) -> u64 {
    addr & (PAGE - 1)
}

/// Entries read from a list page at a time: a 512-byte buffer serves a 256 KiB transfer's
/// list in one read. The buffer is zeroed for each command with a list, so it stays small:
/// the largest transfer's 2 KiB, zeroed for a 128 KiB read's 248-byte list, showed in
/// profiles.
const LIST_CHUNK: usize = 64;

impl DataPages {
    /// Resolves PRP1/PRP2 of a `len`-byte transfer (1 to [`MAX_TRANSFER`] bytes; more is
    /// Invalid Field) into `self`
    /// (filled in place: the page array is 2 KiB, not worth moving).
    pub fn resolve(&mut self, ctx: &DeviceContext, prp1: u64, prp2: u64, len: usize) -> Result<(), Status> {
        // Over MDTS: its callers refuse such commands first; checked here too, because the
        // list buffer below holds one transfer's entries and no more.
        if len > MAX_TRANSFER {
            return Err(Status::INVALID_FIELD.dnr());
        }
        if prp1 & 3 != 0 {
            return Err(Status::PRP_OFFSET_INVALID);
        }
        let offset = page_offset(prp1) as usize;
        self.pfns.clear();
        self.offset = offset;
        self.len = len;
        self.list_pages = 0;
        self.pfns.push(prp1 / PAGE);
        let first = PAGE as usize - offset;
        if len <= first {
            return Ok(());
        }
        let mut wanted = (len - first).div_ceil(PAGE as usize);
        if wanted == 1 {
            if page_offset(prp2) != 0 {
                return Err(Status::PRP_OFFSET_INVALID);
            }
            self.pfns.push(prp2 / PAGE);
            return Ok(());
        }
        // PRP2 is a list pointer.
        let mut list = prp2;
        let mut buf = [0u8; LIST_CHUNK * 8];
        while wanted > 0 {
            if list & 7 != 0 {
                return Err(Status::PRP_OFFSET_INVALID);
            }
            let room = ((PAGE - page_offset(list)) / 8) as usize;
            // A list that does not end in this page continues at its last entry.
            let (data, chained) = if wanted > room { (room - 1, true) } else { (wanted, false) };
            // A list starting in its page's last entry holds only the pointer to the next one
            // (legal): such lists could chain forever, so a transfer follows at most MAX_PAGES.
            if self.list_pages as usize >= MAX_PAGES {
                return Err(Status::PRP_OFFSET_INVALID);
            }
            // The page's entries to read: its data entries and, chained, the pointer after them.
            let n = if chained { room } else { data };
            let mut next = None;
            let mut offsets = 0;
            let mut at = 0;
            while at < n {
                let k = (n - at).min(LIST_CHUNK);
                let bytes = &mut buf[..k * 8];
                // `at < n <= room`: inside the list's page, so the add cannot wrap.
                ctx.read_pinned(list + 8 * at as u64, bytes).map_err(|_| Status::DATA_TRANSFER_ERROR)?;
                // `at < n`, and `n <= data + 1`: at most the chunk's last entry is the pointer.
                let entries = (data - at).min(k);
                // One reservation and one offset check per chunk, not per entry.
                self.pfns.extend(bytes[..entries * 8].chunks_exact(8).map(|entry| {
                    let addr = u64::from_le_bytes(entry.try_into().expect("8-byte chunks"));
                    offsets |= page_offset(addr);
                    addr / PAGE
                }));
                if entries < k {
                    next = Some(u64::from_le_bytes(bytes[entries * 8..].try_into().expect("one entry")));
                }
                at += k;
            }
            self.list_pages += 1;
            if offsets != 0 {
                return Err(Status::PRP_OFFSET_INVALID);
            }
            wanted -= data;
            if let Some(next) = next {
                list = next;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use std::fs::File;
    use std::os::fd::AsFd;
    use std::os::unix::fs::FileExt;
    use std::sync::Arc;

    use umdev_pinning::{DmaSpace, Prot};

    use super::*;
    use crate::testutil::NoClient;

    fn resolve(ctx: &DeviceContext, prp1: u64, prp2: u64, len: usize) -> Result<DataPages, Status> {
        let mut pages = DataPages::default();
        pages.resolve(ctx, prp1, prp2, len).map(|()| pages)
    }

    /// 1 MiB of guest RAM at IOVA 0.
    fn guest() -> (DeviceContext, File) {
        let ram = File::from(
            nix::sys::memfd::memfd_create(c"prp-test", nix::sys::memfd::MFdFlags::MFD_CLOEXEC).unwrap(),
        );
        ram.set_len(1 << 20).unwrap();
        let dma = DmaSpace::default();
        dma.map(0, 1 << 20, ram.as_fd(), 0, Prot::READ_WRITE).unwrap();
        (DeviceContext::new(dma, Arc::new(NoClient)), ram)
    }

    fn put_list(ram: &File, at: u64, entries: &[u64]) {
        let bytes: Vec<u8> = entries.iter().flat_map(|e| e.to_le_bytes()).collect();
        ram.write_all_at(&bytes, at).unwrap();
    }

    #[test]
    fn one_and_two_pages_need_no_list() {
        let (ctx, _ram) = guest();
        let p = resolve(&ctx, 0x5200, 0xdead_0000, 512).unwrap();
        assert_eq!((p.pfns.as_slice(), p.offset, p.list_pages), (&[5][..], 0x200, 0));
        let p = resolve(&ctx, 0x5e00, 0x9000, 4096).unwrap();
        assert_eq!(p.pfns.as_slice(), &[5, 9]);
        assert_eq!(resolve(&ctx, 0x5e00, 0x9008, 4096).unwrap_err(), Status::PRP_OFFSET_INVALID);
        assert_eq!(resolve(&ctx, 0x5e02, 0x9000, 512).unwrap_err(), Status::PRP_OFFSET_INVALID);
    }

    #[test]
    fn a_list_is_read_and_checked() {
        let (ctx, ram) = guest();
        put_list(&ram, 0x3000, &[0x7000, 0x6000, 0x20000]);
        let p = resolve(&ctx, 0x1000, 0x3000, 4 * 4096).unwrap();
        assert_eq!((p.pfns.as_slice(), p.list_pages), (&[1, 7, 6, 0x20][..], 1));
        // An unaligned entry, an unaligned list pointer.
        put_list(&ram, 0x3000, &[0x7000, 0x6010, 0x20000]);
        assert_eq!(resolve(&ctx, 0x1000, 0x3000, 4 * 4096).unwrap_err(), Status::PRP_OFFSET_INVALID);
        assert_eq!(resolve(&ctx, 0x1000, 0x3004, 4 * 4096).unwrap_err(), Status::PRP_OFFSET_INVALID);
        // A list outside guest memory.
        assert_eq!(resolve(&ctx, 0x1000, 0x1000_0000, 4 * 4096).unwrap_err(), Status::DATA_TRANSFER_ERROR);
    }

    #[test]
    fn a_list_chains_at_the_last_entry_of_its_page() {
        let (ctx, ram) = guest();
        // The list starts 16 bytes before the end of its page: one data entry, then the
        // pointer to the next list page.
        put_list(&ram, 0x3ff0, &[0x8000, 0x4000]);
        put_list(&ram, 0x4000, &[0x9000, 0xa000]);
        let p = resolve(&ctx, 0x1000, 0x3ff0, 4 * 4096).unwrap();
        assert_eq!((p.pfns.as_slice(), p.list_pages), (&[1, 8, 9, 10][..], 2));
        // The largest transfer, unaligned: 257 pages; the list starts 255 entries before
        // its page ends, so 254 data entries, then the next list page with the last two.
        let mut first: Vec<u64> = (0..254).map(|i| 0x8_0000 + i * 0x1000).collect();
        first.push(0x5000);
        put_list(&ram, 0x6808, &first);
        put_list(&ram, 0x5000, &[0xb000, 0xc000]);
        let p = resolve(&ctx, 0x1200, 0x6808, MAX_TRANSFER).unwrap();
        assert_eq!(p.pfns.len(), MAX_PAGES);
        assert_eq!((p.pfns[1], p.pfns[254], p.pfns[255], p.pfns[256]), (0x80, 0x80 + 253, 0xb, 0xc));
        assert_eq!(p.list_pages, 2);
    }

    #[test]
    fn a_page_is_read_in_chunks_whose_edges_change_nothing() {
        let (ctx, ram) = guest();
        // 65 entries before the page ends: 64 data entries fill the first chunk exactly, and
        // the pointer to the next list page is alone in the second.
        let mut first: Vec<u64> = (0..64).map(|i| 0x8_0000 + i * 0x1000).collect();
        first.push(0x5000);
        put_list(&ram, 0x6df8, &first);
        put_list(&ram, 0x5000, &[0xb000, 0xc000]);
        let p = resolve(&ctx, 0x1000, 0x6df8, 67 * 4096).unwrap();
        assert_eq!(p.pfns.len(), 67);
        assert_eq!((p.pfns[1], p.pfns[64], p.pfns[65], p.pfns[66]), (0x80, 0x80 + 63, 0xb, 0xc));
        assert_eq!(p.list_pages, 2);
        // 200 entries in one page: an unaligned entry in the fourth chunk is found, as in
        // the first.
        let mut long: Vec<u64> = (0..200).map(|i| 0x8_0000 + i * 0x1000).collect();
        put_list(&ram, 0x3000, &long);
        assert_eq!(resolve(&ctx, 0x1000, 0x3000, 201 * 4096).unwrap().pfns[200], 0x80 + 199);
        long[199] += 8;
        put_list(&ram, 0x3000, &long);
        assert_eq!(resolve(&ctx, 0x1000, 0x3000, 201 * 4096).unwrap_err(), Status::PRP_OFFSET_INVALID);
    }

    #[test]
    fn a_transfer_over_mdts_is_refused_not_read_past_the_list_buffer() {
        let (ctx, ram) = guest();
        let list: Vec<u64> = (0..511).map(|i| 0x8_0000 + i * 0x1000).collect();
        put_list(&ram, 0x3000, &list);
        assert_eq!(
            resolve(&ctx, 0x1000, 0x3000, MAX_TRANSFER + 4096).unwrap_err(),
            Status::INVALID_FIELD.dnr()
        );
    }

    #[test]
    fn a_chain_of_pointers_that_loops_is_refused_not_followed_forever() {
        let (ctx, ram) = guest();
        // A list in its page's last entry holds only the pointer to the next list: here to
        // itself.
        put_list(&ram, 0x3ff8, &[0x3ff8]);
        assert_eq!(resolve(&ctx, 0x1000, 0x3ff8, 4 * 4096).unwrap_err(), Status::PRP_OFFSET_INVALID);
        // Also when such a list comes after a good one.
        put_list(&ram, 0x2ff0, &[0x8000, 0x3ff8]);
        assert_eq!(resolve(&ctx, 0x1000, 0x2ff0, 4 * 4096).unwrap_err(), Status::PRP_OFFSET_INVALID);
    }
}
