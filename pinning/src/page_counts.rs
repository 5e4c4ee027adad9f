//! Per-page pin counts of one mapping, allocated lazily in fixed chunks.
//!
//! A mapping of any size starts with an empty table (no allocation); a chunk of
//! [`CHUNK_PAGES`] 16-bit counts (1 KiB per 2 MiB of IOVA, 0.05%) is allocated when a page in
//! it is first pinned and freed when its last page is unpinned. Runs are processed chunk
//! segment by chunk segment, so pinning a contiguous run costs one lookup per 2 MiB plus a
//! tight, vectorisable loop over its counts.

use rustc_hash::FxHashMap;

/// Pages per lazily allocated chunk of counts (2 MiB of IOVA).
pub const CHUNK_PAGES: u64 = 512;

/// Most pins one page can hold at once; a further pin fails with `CountOverflow`.
pub const MAX_PIN_COUNT: u32 = u16::MAX as u32;

type Count = u16;

#[derive(Debug)]
struct Chunk {
    counts: [Count; CHUNK_PAGES as usize],
    /// Pages of this chunk with a non-zero count.
    live: u32,
}

impl Chunk {
    fn new_boxed() -> Box<Chunk> {
        Box::new(Chunk { counts: [0; CHUNK_PAGES as usize], live: 0 })
    }
}

/// Bytes of heap one allocated chunk costs (its box; the hash table's entry is counted by
/// `PageCounts::bookkeeping_bytes`).
pub const CHUNK_BYTES: usize = std::mem::size_of::<Chunk>();

/// The pin counts of one mapping, indexed by page offset within the mapping.
#[derive(Debug, Default)]
pub(crate) struct PageCounts {
    chunks: FxHashMap<u64, Box<Chunk>>,
    /// One emptied chunk kept for reuse, so a pin/unpin loop on one chunk does not
    /// allocate and free every time.
    spare: Option<Box<Chunk>>,
    /// Distinct pages with a non-zero count.
    pinned_pages: u64,
    /// Sum of all counts.
    pins: u64,
}

/// One part of a run that lies inside a single chunk.
#[derive(Clone, Copy)]
struct Segment {
    chunk: u64,
    start: usize,
    len: usize,
    /// Page offset (within the mapping) of the segment's first page.
    page: u64,
}

fn segments(first: u64, npages: u64) -> impl Iterator<Item = Segment> {
    let mut page = first;
    let end = first + npages;
    std::iter::from_fn(move || {
        if page >= end {
            return None;
        }
        let chunk = page / CHUNK_PAGES;
        let start = (page % CHUNK_PAGES) as usize;
        let len = ((CHUNK_PAGES as usize) - start).min((end - page) as usize);
        let seg = Segment { chunk, start, len, page };
        page += len as u64;
        Some(seg)
    })
}

impl PageCounts {
    /// Distinct pages with a non-zero count.
    pub(crate) fn pinned_pages(&self) -> u64 {
        self.pinned_pages
    }

    /// Sum of all counts: how many pins are held.
    pub(crate) fn pins(&self) -> u64 {
        self.pins
    }

    /// Heap bytes this table uses for counts.
    pub(crate) fn bookkeeping_bytes(&self) -> usize {
        let entry = std::mem::size_of::<(u64, Box<Chunk>)>() + 1;
        (self.chunks.len() + usize::from(self.spare.is_some())) * CHUNK_BYTES + self.chunks.capacity() * entry
    }

    /// Chunk `idx`, allocated (or the spare reused) if absent: one hash lookup on a hit.
    #[inline]
    fn chunk_mut(&mut self, idx: u64) -> &mut Chunk {
        let spare = &mut self.spare;
        self.chunks.entry(idx).or_insert_with(|| spare.take().unwrap_or_else(Chunk::new_boxed))
    }

    /// Drops chunk `idx`, whose last pinned page was just unpinned, keeping it as the spare
    /// if there is none.
    #[inline]
    fn retire(&mut self, idx: u64) {
        let empty = self.chunks.remove(&idx);
        if self.spare.is_none() {
            self.spare = empty;
        }
    }

    /// The pin count of page `page`.
    pub(crate) fn count(&self, page: u64) -> u32 {
        self.chunks
            .get(&(page / CHUNK_PAGES))
            .map_or(0, |c| u32::from(c.counts[(page % CHUNK_PAGES) as usize]))
    }

    /// First page of `[first, first + npages)` whose count cannot grow.
    pub(crate) fn find_saturated(&self, first: u64, npages: u64) -> Option<u64> {
        segments(first, npages).find_map(|seg| {
            let chunk = self.chunks.get(&seg.chunk)?;
            let counts = &chunk.counts[seg.start..seg.start + seg.len];
            // Cheap vectorised test first; the position only matters on failure.
            if counts.iter().fold(0, |acc, &c| acc | Count::from(c == Count::MAX)) == 0 {
                return None;
            }
            counts.iter().position(|&c| c == Count::MAX).map(|i| seg.page + i as u64)
        })
    }

    /// First page of `[first, first + npages)` that is not pinned.
    pub(crate) fn find_unpinned(&self, first: u64, npages: u64) -> Option<u64> {
        segments(first, npages).find_map(|seg| match self.chunks.get(&seg.chunk) {
            None => Some(seg.page),
            Some(chunk) => {
                let counts = &chunk.counts[seg.start..seg.start + seg.len];
                if counts.iter().fold(0, |acc, &c| acc | Count::from(c == 0)) == 0 {
                    return None;
                }
                counts.iter().position(|&c| c == 0).map(|i| seg.page + i as u64)
            }
        })
    }

    /// Calls `f(start, len)` for each maximal sub-run of unpinned pages in the range, in
    /// order: the pages a pin of this range would take from 0 to 1.
    pub(crate) fn for_each_unpinned(&self, first: u64, npages: u64, f: impl FnMut(u64, u64)) {
        let mut runs = RunBuilder::new(f);
        for seg in segments(first, npages) {
            match self.chunks.get(&seg.chunk) {
                // A whole absent chunk segment is unpinned.
                None => runs.add(seg.page, seg.len as u64),
                Some(chunk) => {
                    let counts = &chunk.counts[seg.start..seg.start + seg.len];
                    // Counted first (a vector pass): the usual segment is all pinned or
                    // all not, and needs no look at each page.
                    match counts.iter().map(|&c| usize::from(c == 0)).sum::<usize>() {
                        0 => {}
                        n if n == seg.len => runs.add(seg.page, seg.len as u64),
                        _ => {
                            for (i, &c) in counts.iter().enumerate() {
                                if c == 0 {
                                    runs.add(seg.page + i as u64, 1);
                                }
                            }
                        }
                    }
                }
            }
        }
    }

    /// Adds one pin to every page of the range unless one of them is saturated; then
    /// returns that page and changes nothing. One pass (one chunk lookup per segment).
    /// Returns how many pages went from 0 to 1.
    pub(crate) fn try_increment(&mut self, first: u64, npages: u64) -> Result<u64, u64> {
        let mut new_pages = 0u64;
        for seg in segments(first, npages) {
            let chunk = self.chunk_mut(seg.chunk);
            let counts = &mut chunk.counts[seg.start..seg.start + seg.len];
            if counts.iter().fold(0, |acc, &c| acc | Count::from(c == Count::MAX)) != 0 {
                let at = counts.iter().position(|&c| c == Count::MAX).unwrap_or(0);
                let failed = seg.page + at as u64;
                // Undo the segments of this run already counted.
                if seg.page > first {
                    self.pinned_pages += new_pages;
                    self.pins += seg.page - first;
                    self.decrement(first, seg.page - first, None);
                }
                return Err(failed);
            }
            let mut fresh = 0u32;
            for c in counts.iter_mut() {
                fresh += u32::from(*c == 0);
                *c += 1;
            }
            chunk.live += fresh;
            new_pages += u64::from(fresh);
        }
        self.pinned_pages += new_pages;
        self.pins += npages;
        Ok(new_pages)
    }

    /// Adds one pin to page `page`, whose count the caller has checked can grow. True if it
    /// went from 0 to 1. One chunk lookup.
    pub(crate) fn increment_one(&mut self, page: u64) -> bool {
        let chunk = self.chunk_mut(page / CHUNK_PAGES);
        let count = &mut chunk.counts[(page % CHUNK_PAGES) as usize];
        let fresh = *count == 0;
        *count += 1;
        chunk.live += u32::from(fresh);
        self.pinned_pages += u64::from(fresh);
        self.pins += 1;
        fresh
    }

    /// Removes one pin from every page of the range unless one of them is not pinned; then
    /// returns that page and changes nothing. Calls `released(start, len)` for each maximal
    /// sub-run of pages that went from 1 to 0, if given. Returns how many pages went to 0.
    /// The one checked unpin (a look, then the pass).
    pub(crate) fn try_decrement(
        &mut self,
        first: u64,
        npages: u64,
        released: Option<&mut dyn FnMut(u64, u64)>,
    ) -> Result<u64, u64> {
        if npages == 1 {
            // One page, most of lock mode's unpins: one chunk lookup.
            let freed = self.try_decrement_one(first)?;
            if let (true, Some(released)) = (freed, released) {
                released(first, 1);
            }
            return Ok(u64::from(freed));
        }
        if let Some(page) = self.find_unpinned(first, npages) {
            return Err(page);
        }
        Ok(self.decrement(first, npages, released))
    }

    /// [`PageCounts::try_decrement`] of one page: true if it went to 0.
    fn try_decrement_one(&mut self, page: u64) -> Result<bool, u64> {
        let idx = page / CHUNK_PAGES;
        let Some(chunk) = self.chunks.get_mut(&idx) else {
            return Err(page);
        };
        let count = &mut chunk.counts[(page % CHUNK_PAGES) as usize];
        if *count == 0 {
            return Err(page);
        }
        *count -= 1;
        let freed = *count == 0;
        chunk.live -= u32::from(freed);
        let empty = chunk.live == 0;
        self.pinned_pages -= u64::from(freed);
        self.pins -= 1;
        if empty {
            self.retire(idx);
        }
        Ok(freed)
    }

    /// Adds one pin to every page of the range. The caller has checked
    /// [`PageCounts::find_saturated`]. Returns how many pages went from 0 to 1.
    pub(crate) fn increment(&mut self, first: u64, npages: u64) -> u64 {
        let mut new_pages = 0u64;
        for seg in segments(first, npages) {
            let chunk = self.chunk_mut(seg.chunk);
            let mut fresh = 0u32;
            for c in &mut chunk.counts[seg.start..seg.start + seg.len] {
                fresh += u32::from(*c == 0);
                *c += 1;
            }
            chunk.live += fresh;
            new_pages += u64::from(fresh);
        }
        self.pinned_pages += new_pages;
        self.pins += npages;
        new_pages
    }

    /// Removes one pin from every page of the range. The caller has checked
    /// [`PageCounts::find_unpinned`]. Calls `released(start, len)` for each maximal sub-run of
    /// pages that went from 1 to 0, if given. Returns how many pages went to 0.
    pub(crate) fn decrement(
        &mut self,
        first: u64,
        npages: u64,
        released: Option<&mut dyn FnMut(u64, u64)>,
    ) -> u64 {
        let mut freed_pages = 0u64;
        let mut runs = released.map(RunBuilder::new);
        for seg in segments(first, npages) {
            let Some(chunk) = self.chunks.get_mut(&seg.chunk) else {
                debug_assert!(false, "decrement of an unpinned chunk");
                continue;
            };
            let counts = &mut chunk.counts[seg.start..seg.start + seg.len];
            // One vector pass; the pages that went to 0 are looked for page by page only
            // when some but not all of the segment's did.
            let mut freed = 0u32;
            for c in counts.iter_mut() {
                *c -= 1;
                freed += u32::from(*c == 0);
            }
            if let Some(runs) = runs.as_mut().filter(|_| freed != 0) {
                if freed as usize == seg.len {
                    runs.add(seg.page, seg.len as u64);
                } else {
                    for (i, &c) in counts.iter().enumerate() {
                        if c == 0 {
                            runs.add(seg.page + i as u64, 1);
                        }
                    }
                }
            }
            chunk.live -= freed;
            freed_pages += u64::from(freed);
            if chunk.live == 0 {
                self.retire(seg.chunk);
            }
        }
        drop(runs);
        self.pinned_pages -= freed_pages;
        self.pins -= npages;
        freed_pages
    }
}

/// Merges ascending `(start, len)` pieces into maximal runs, reporting each to `f` once
/// complete (the last one on drop).
struct RunBuilder<F: FnMut(u64, u64)> {
    open: Option<(u64, u64)>,
    f: F,
}

impl<F: FnMut(u64, u64)> RunBuilder<F> {
    fn new(f: F) -> Self {
        RunBuilder { open: None, f }
    }

    fn add(&mut self, start: u64, len: u64) {
        match &mut self.open {
            Some((s, l)) if *s + *l == start => *l += len,
            _ => {
                if let Some((s, l)) = self.open.replace((start, len)) {
                    (self.f)(s, l);
                }
            }
        }
    }
}

impl<F: FnMut(u64, u64)> Drop for RunBuilder<F> {
    fn drop(&mut self) {
        if let Some((s, l)) = self.open.take() {
            (self.f)(s, l);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn collect_unpinned(t: &PageCounts, first: u64, n: u64) -> Vec<(u64, u64)> {
        let mut v = Vec::new();
        t.for_each_unpinned(first, n, |s, l| v.push((s, l)));
        v
    }

    #[test]
    fn empty_table_allocates_nothing() {
        let t = PageCounts::default();
        assert_eq!(t.bookkeeping_bytes(), 0);
        assert_eq!(t.count(12345), 0);
        assert_eq!(t.find_unpinned(0, 10), Some(0));
        assert_eq!(t.find_saturated(0, 10), None);
    }

    #[test]
    fn counts_across_chunk_boundaries() {
        let mut t = PageCounts::default();
        assert_eq!(t.increment(500, 30), 30);
        assert_eq!(t.increment(510, 4), 0);
        assert_eq!(t.count(499), 0);
        assert_eq!(t.count(510), 2);
        assert_eq!(t.count(529), 1);
        assert_eq!(t.pinned_pages(), 30);
        assert_eq!(t.pins(), 34);
        assert_eq!(collect_unpinned(&t, 498, 40), vec![(498, 2), (530, 8)]);
        assert_eq!(t.find_unpinned(500, 30), None);
        assert_eq!(t.find_unpinned(500, 31), Some(530));
        let mut freed = Vec::new();
        t.decrement(500, 30, Some(&mut |s, l| freed.push((s, l))));
        assert_eq!(freed, vec![(500, 10), (514, 16)]);
        assert_eq!(t.decrement(510, 4, None), 4);
        assert_eq!(t.pins(), 0);
        assert_eq!(t.pinned_pages(), 0);
        // Both chunks emptied: one kept as spare, one freed.
        assert_eq!(t.bookkeeping_bytes() / CHUNK_BYTES, 1);
    }

    #[test]
    #[cfg_attr(miri, ignore = "Miri: 65535 increments, no unsafe code")]
    fn checked_passes_change_nothing_on_failure() {
        let mut t = PageCounts::default();
        t.increment(1000, 30);
        for _ in 1..MAX_PIN_COUNT {
            t.increment(1020, 1);
        }
        // A run across the chunk boundary (512) that hits the saturated page 1020.
        assert_eq!(t.try_increment(500, 521), Err(1020));
        assert_eq!((t.count(500), t.count(1000), t.count(1020)), (0, 1, MAX_PIN_COUNT));
        assert_eq!(t.pins(), 30 + u64::from(MAX_PIN_COUNT) - 1);
        assert_eq!(t.try_increment(1000, 10), Ok(0));
        assert_eq!(t.count(1005), 2);
        // try_decrement: page 999 is not pinned.
        assert_eq!(t.try_decrement(999, 5, None), Err(999));
        assert_eq!(t.try_decrement(1000, 40, None), Err(1030));
        assert_eq!(t.count(1000), 2);
        assert_eq!(t.try_decrement(1000, 10, None), Ok(0));
        assert_eq!(t.try_decrement(1000, 30, None), Ok(29));
        assert_eq!(t.pinned_pages(), 1);
    }

    #[test]
    fn one_page_ops_agree_with_the_range_ops() {
        let (mut one, mut range) = (PageCounts::default(), PageCounts::default());
        for page in [0u64, 511, 512, 4000, 511, 511, 0] {
            assert_eq!(one.increment_one(page), range.increment(page, 1) == 1);
        }
        for page in [511u64, 0, 7, 511, 4000, 0, 512, 511, 4000] {
            let mut freed = Vec::new();
            let checked = one.try_decrement(page, 1, Some(&mut |s, l| freed.push((s, l))));
            assert_eq!(checked.map(|n| n == 1), range.try_decrement(page, 1, None).map(|n| n == 1));
            assert_eq!(freed.len() as u64, checked.unwrap_or(0));
            assert_eq!((one.pins(), one.pinned_pages()), (range.pins(), range.pinned_pages()));
            assert_eq!(one.bookkeeping_bytes(), range.bookkeeping_bytes());
        }
        assert_eq!(one.pins(), 0);
    }

    #[test]
    #[cfg_attr(miri, ignore = "Miri: 65535 increments, no unsafe code")]
    fn saturation_is_detected() {
        let mut t = PageCounts::default();
        for _ in 0..MAX_PIN_COUNT {
            t.increment(7, 1);
        }
        assert_eq!(t.find_saturated(0, 10), Some(7));
        assert_eq!(t.count(7), MAX_PIN_COUNT);
    }

    #[test]
    fn unpinned_runs_merge_over_absent_chunks() {
        let mut t = PageCounts::default();
        t.increment(0, 1);
        t.increment(2000, 1);
        assert_eq!(collect_unpinned(&t, 0, 2001), vec![(1, 1999)]);
    }
}
