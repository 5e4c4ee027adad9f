//! The run scan: how far an array of page numbers goes on page by page.

/// How many entries from `pfns[0]` go on page by page (at most `limit`, the pages left in
/// its mapping): the length of the run starting there. Inline for the usual answer (the
/// next entry does not continue: 1), out of line for longer runs.
#[inline(always)]
pub(crate) fn run_length(pfns: &[u64], limit: u64) -> u64 {
    // Scattered arrays end their runs at once.
    match pfns {
        [first, second, ..] if limit >= 2 && *second == first.wrapping_add(1) => {
            continued_run_length(pfns, limit)
        }
        _ => 1,
    }
}

/// [`run_length`] of a run known to go on past its first entry, compiled for the widest
/// vectors the CPU has. What that buys: a 512-entry run is scanned about twice as fast as by
/// the plain loop (a 512-page contiguous pin 58 against 125 ns; 64 pages 34 against 40 ns;
/// docs/benchmarks.md).
#[inline(never)]
fn continued_run_length(pfns: &[u64], limit: u64) -> u64 {
    let max = usize::try_from(limit).unwrap_or(usize::MAX).min(pfns.len());
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx512f") {
            // SAFETY: (I16) the CPU has AVX-512F, checked just now.
            return unsafe { run_length_avx512(&pfns[..max]) };
        }
        if std::arch::is_x86_feature_detected!("avx2") {
            // SAFETY: (I16) the CPU has AVX2, checked just now.
            return unsafe { run_length_avx2(&pfns[..max]) };
        }
    }
    long_run_length(&pfns[..max])
}

/// [`long_run_length`] compiled for AVX-512: a cache line of entries per compare, so a
/// 512-page run reads its array at about the speed of a plain pass over it.
///
/// # Safety
/// The CPU has AVX-512F (I16).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
pub(crate) unsafe fn run_length_avx512(pfns: &[u64]) -> u64 {
    long_run_length(pfns)
}

/// [`long_run_length`] compiled for AVX2: four entries per compare.
///
/// # Safety
/// The CPU has AVX2 (I16).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
pub(crate) unsafe fn run_length_avx2(pfns: &[u64]) -> u64 {
    long_run_length(pfns)
}

/// The run length of the whole of `pfns` (entry 0 starts it), in blocks whose entries are
/// compared all at once: 8 at a time over the first 32 entries (the runs of IDAW and PRP
/// lists end there), then 32 at a time from a cache-line boundary (loads that split lines
/// cost twice), then 8 at a time, the last block overlapping the one before. Only in the
/// 8-entry block where the run ends, or in an array shorter than 8, are entries compared one
/// at a time (at most 7). Entry `k` of a run is `start + k`, so `p - k` is the same for all.
///
/// The steps taken depend on the run's length, hardly on where the allocator put the array
/// (one block more or less). A loop that went entry by entry to the line boundary and after
/// the last 32-entry block took up to 38 more steps on some alignments, which moved
/// pinbench's contiguous rows by up to 40% between builds (docs/benchmarks.md).
#[inline(always)]
pub(crate) fn long_run_length(pfns: &[u64]) -> u64 {
    const LINE_ENTRIES: usize = 64 / std::mem::size_of::<u64>();
    let len = pfns.len();
    let start = pfns[0];
    // The run's end at or after entry `at`, entry by entry.
    let one_by_one = |mut at: usize| -> u64 {
        while at < len && pfns[at] == start.wrapping_add(at as u64) {
            at += 1;
        }
        at as u64
    };
    if len < 8 {
        return one_by_one(1);
    }
    let mut n = 0;
    while n + 8 <= len.min(32) {
        if !continues::<8>(pfns, n, start) {
            return one_by_one(n);
        }
        n += 8;
    }
    if len > 32 {
        // Entries [0, 32) continue: go on from the last cache-line boundary before entry 32.
        let misaligned = (pfns.as_ptr() as usize / std::mem::size_of::<u64>()) % LINE_ENTRIES;
        n = 32 - misaligned;
        while n + 32 <= len {
            if !continues::<32>(pfns, n, start) {
                while n + 8 <= len && continues::<8>(pfns, n, start) {
                    n += 8;
                }
                return one_by_one(n);
            }
            n += 32;
        }
        while n + 8 <= len {
            if !continues::<8>(pfns, n, start) {
                return one_by_one(n);
            }
            n += 8;
        }
    }
    if n < len && !continues::<8>(pfns, len - 8, start) {
        return one_by_one(n);
    }
    len as u64
}

/// True if entries `[at, at + W)` of `pfns` (all there) continue the run from `start`: a
/// vector compare of each `p - k` against it.
#[inline(always)]
fn continues<const W: usize>(pfns: &[u64], at: usize, start: u64) -> bool {
    let block: &[u64; W] = pfns[at..at + W].try_into().expect("W entries");
    let want = start.wrapping_add(at as u64);
    block.iter().enumerate().fold(0, |acc, (k, &p)| acc | (p.wrapping_sub(k as u64) ^ want)) == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The run length by its definition, one entry at a time.
    fn model_run_length(pfns: &[u64], limit: u64) -> u64 {
        let n = pfns.iter().enumerate().take_while(|&(k, &p)| p == pfns[0].wrapping_add(k as u64)).count();
        (n as u64).min(limit).max(1)
    }

    #[test]
    fn run_length_agrees_with_its_definition_at_every_alignment_and_break() {
        // A buffer whose start is a cache line, so `offset` sets the array's alignment.
        let mut buf = vec![0u64; 200 + 16];
        let line = (8 - (buf.as_ptr() as usize / 8) % 8) % 8;
        // Miri runs a sample: the scan's reads at three alignments are what it checks.
        let offsets: &[usize] = if cfg!(miri) { &[0, 3, 7] } else { &[0, 1, 2, 3, 4, 5, 6, 7] };
        for &offset in offsets {
            for len in [2usize, 7, 8, 9, 31, 32, 33, 40, 64, 100, 129, 200] {
                // Miri runs a sample of the breaks: the scan's reads are what it checks.
                let step = if cfg!(miri) { 1 + len / 4 } else { 1 + len / 40 };
                for brk in (1..=len).step_by(step) {
                    let pfns = &mut buf[line + offset..line + offset + len];
                    for (k, p) in pfns.iter_mut().enumerate() {
                        *p = (u64::MAX - 50).wrapping_add(k as u64); // wraps past u64::MAX in the run
                    }
                    if brk < len {
                        pfns[brk] ^= 1 << 40;
                    }
                    for limit in [2, brk as u64, len as u64, u64::MAX] {
                        assert_eq!(
                            run_length(pfns, limit),
                            model_run_length(pfns, limit),
                            "offset {offset} len {len} break {brk} limit {limit}"
                        );
                    }
                    // Every variant this CPU can run, whichever the dispatch picks.
                    let whole = model_run_length(pfns, u64::MAX);
                    assert_eq!(long_run_length(pfns), whole);
                    #[cfg(target_arch = "x86_64")]
                    {
                        if std::arch::is_x86_feature_detected!("avx2") {
                            // SAFETY: (I16) the CPU has AVX2, checked just now.
                            assert_eq!(unsafe { run_length_avx2(pfns) }, whole);
                        }
                        if std::arch::is_x86_feature_detected!("avx512f") {
                            // SAFETY: (I16) the CPU has AVX-512F, checked just now.
                            assert_eq!(unsafe { run_length_avx512(pfns) }, whole);
                        }
                    }
                }
            }
        }
    }
}
