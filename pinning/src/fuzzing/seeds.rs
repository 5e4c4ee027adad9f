//! Hand-made seeds for the fuzzer and its corpus replay.

use super::codec::encode;
use super::op::*;
use crate::PinMode;

/// Hand-made seeds, as `(name, input)`: the README's IDAW example, guards and forgotten pins,
/// each limit, busy and splitting unmaps, kernel pins (a read-only mapping refused, a kept
/// buffer let go in parts), the top of the IOVA space. The corpus replay runs
/// them besides the corpus files; `tests/fuzz_corpus.rs` can write them into
/// `fuzz/corpus/pinning/`.
pub fn seeds() -> Vec<(&'static str, Vec<u8>)> {
    let map = |page, pages, prot| Op::Map { page, pages, prot, message_only: false, offset_pages: 0 };
    let idaw = Op::Pin { pfns: vec![1, 5, 6, 7, 9], prot: 2 };
    let top = HIGH_BASE + HIGH_PAGES;
    let sets: Vec<(&'static str, PinMode, Vec<Op>)> = vec![
        (
            "idaw-runs",
            PinMode::Track,
            vec![
                map(0, 16, 3),
                idaw.clone(),
                Op::Access { which: 0, offset: 4000, len: 9000, write: true },
                Op::PinRange { page: 4, pages: 8, prot: 1 },
                Op::Access { which: 1, offset: 20000, len: 12288, write: false },
                Op::Drop { which: 0 },
                Op::Unmap { page: 0, pages: 16 },
                Op::Drop { which: 0 },
                Op::Unmap { page: 0, pages: 16 },
            ],
        ),
        (
            "forget-and-unpin",
            PinMode::Track,
            vec![
                map(0, 8, 3),
                Op::Map { page: 8, pages: 8, prot: 1, message_only: false, offset_pages: 3 },
                Op::Pin { pfns: vec![6, 7, 8, 9, 7], prot: 1 },
                Op::Forget { which: 0 },
                Op::UnpinAny { pfns: vec![7, 7, 7] },
                Op::UnpinAnyRange { page: 6, pages: 5 },
                Op::UnmapAll,
                Op::UnpinKept { which: 0, part: 0 },
                Op::UnmapAll,
            ],
        ),
        (
            "lock-limit",
            PinMode::Lock,
            vec![
                map(0, 16, 3),
                Op::PinRange { page: 0, pages: 10, prot: 2 },
                Op::Pin { pfns: vec![0, 1, 10, 11, 12], prot: 1 },
                Op::Pin { pfns: vec![0, 1, 10, 11, 12, 13], prot: 1 },
                Op::Drop { which: 0 },
                Op::PinRange { page: 5, pages: 11, prot: 2 },
            ],
        ),
        (
            "pin-and-call-limits",
            PinMode::Track,
            vec![
                map(0, 16, 3),
                Op::PinRange { page: 0, pages: MAX_PAGES_PER_CALL, prot: 1 },
                Op::PinRange { page: 0, pages: MAX_PAGES_PER_CALL + 1, prot: 1 },
                Op::PinRange { page: 0, pages: 16, prot: 1 },
                Op::Pin { pfns: vec![], prot: 1 },
            ],
        ),
        (
            "mixed-mappings",
            PinMode::Track,
            vec![
                map(2, 4, 3),
                Op::Map { page: 6, pages: 4, prot: 1, message_only: false, offset_pages: 1 },
                Op::Map { page: 10, pages: 4, prot: 3, message_only: true, offset_pages: 0 },
                Op::Map { page: 14, pages: 4, prot: 0, message_only: false, offset_pages: 0 },
                map(0, 0, 3),
                map(4, 4, 3),
                Op::PinRange { page: 2, pages: 8, prot: 1 },
                Op::PinRange { page: 2, pages: 8, prot: 2 },
                Op::Pin { pfns: vec![9, 10], prot: 1 },
                Op::Unmap { page: 3, pages: 4 },
                Op::Unmap { page: 2, pages: 8 },
                Op::Unmap { page: 20, pages: 2 },
                Op::Drop { which: 0 },
                Op::Unmap { page: 2, pages: 12 },
                map(20, 1, 3),
                map(30, 1, 3),
                map(40, 1, 3),
                map(50, 1, 3),
                map(60, 1, 3),
            ],
        ),
        (
            "kernel-pins",
            PinMode::Kernel,
            vec![
                map(0, 16, 3),
                Op::Map { page: 16, pages: 4, prot: 1, message_only: false, offset_pages: 0 },
                idaw.clone(),
                Op::Pin { pfns: vec![15, 16], prot: 1 },
                Op::PinRange { page: 2, pages: 12, prot: 1 },
                Op::Access { which: 1, offset: 100, len: 9000, write: false },
                Op::Forget { which: 1 },
                Op::UnpinKept { which: 0, part: 5 },
                Op::Unmap { page: 0, pages: 16 },
                Op::Drop { which: 0 },
                Op::UnpinKept { which: 0, part: 0 },
                Op::Unmap { page: 0, pages: 16 },
            ],
        ),
        (
            "top-of-iova-space",
            PinMode::Lock,
            vec![
                Op::Map { page: top - 4, pages: 4, prot: 3, message_only: false, offset_pages: 2 },
                Op::Map { page: top - 8, pages: 8, prot: 3, message_only: false, offset_pages: 0 },
                Op::Map { page: top - 8, pages: 4, prot: 3, message_only: false, offset_pages: 0 },
                Op::PinRange { page: top - 6, pages: 6, prot: 2 },
                Op::PinRange { page: top - 6, pages: 7, prot: 2 },
                Op::Pin { pfns: vec![top - 1, top, u64::MAX, top - 2], prot: 1 },
                Op::Pin { pfns: vec![top - 2, top - 1], prot: 1 },
                Op::Access { which: 1, offset: 4090, len: 12, write: true },
                Op::UnpinAnyRange { page: top - 2, pages: 3 },
                Op::Unmap { page: top - 4, pages: 5 },
                Op::UnmapAll,
            ],
        ),
    ];
    sets.into_iter().map(|(name, mode, ops)| (name, encode(mode, &ops))).collect()
}
