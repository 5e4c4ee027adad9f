//! Random sequences of map / unmap / pin / unpin / guard accesses checked against a simple
//! per-page model: translation of every entry, per-page counts, run splitting, lock
//! accounting, the space's limits, and the exact error (and unwind) of every failing call.
//!
//! The model and its checks live in `umdev_pinning::fuzzing` (feature `fuzzing`), shared
//! with the fuzzer (`fuzz/fuzz_targets/pinning.rs`); this test draws structured sequences
//! for it.

use proptest::prelude::*;
use umdev_pinning::fuzzing::{page_of, run, run_alone, Op};
use umdev_pinning::PinMode;

/// A page in the model's windows (mostly the first 24 pages, so that arrays often hit
/// mappings), or one without a byte address.
fn page() -> impl Strategy<Value = u64> {
    prop_oneof![
        40 => (0u8..24).prop_map(page_of),
        2 => (0u8..0xc0).prop_map(page_of),
        2 => (0xc0u8..0xf0).prop_map(page_of),
        1 => (0xf0u8..=0xff).prop_map(page_of),
    ]
}

/// A page a mapping or range may start at (one with a byte address).
fn map_page() -> impl Strategy<Value = u64> {
    prop_oneof![
        20 => (0u8..24).prop_map(page_of),
        2 => (0u8..0xc0).prop_map(page_of),
        2 => (0xc0u8..0xf0).prop_map(page_of),
    ]
}

/// An array of pages: mostly short, sometimes past `max_pages_per_call`.
fn pages() -> impl Strategy<Value = Vec<u64>> {
    prop_oneof![8 => prop::collection::vec(page(), 0..8), 1 => prop::collection::vec(page(), 8..40)]
}

/// The access a pin asks for: read, write or both, and now and then none (refused).
fn pin_prot() -> impl Strategy<Value = u32> {
    prop_oneof![1 => Just(0u32), 8 => 1..=3u32]
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (map_page(), 0..17u64, prop_oneof![1 => Just(0u32), 8 => 1..=3u32], prop::bool::weighted(0.15), 0..4u64).prop_map(
            |(page, pages, prot, message_only, offset_pages)| Op::Map { page, pages, prot, message_only, offset_pages }
        ),
        1 => (map_page(), 0..25u64).prop_map(|(page, pages)| Op::Unmap { page, pages }),
        1 => Just(Op::UnmapAll),
        4 => (pages(), pin_prot()).prop_map(|(pfns, prot)| Op::Pin { pfns, prot }),
        // Arrays made of short ascending runs, IDAW style.
        6 => (prop::collection::vec((page(), 1..9u64), 1..5), pin_prot()).prop_map(|(runs, prot)| {
            Op::Pin { pfns: runs.into_iter().flat_map(|(s, n)| (0..n).map(move |k| s.wrapping_add(k))).collect(), prot }
        }),
        2 => (map_page(), 0..41u64, pin_prot()).prop_map(|(page, pages, prot)| Op::PinRange { page, pages, prot }),
        3 => any::<usize>().prop_map(|which| Op::Drop { which }),
        1 => any::<usize>().prop_map(|which| Op::Forget { which }),
        1 => (any::<usize>(), prop_oneof![1 => Just(0u8), 2 => any::<u8>()]).prop_map(|(which, part)| Op::UnpinKept { which, part }),
        1 => prop::collection::vec(page(), 0..6).prop_map(|pfns| Op::UnpinAny { pfns }),
        1 => (map_page(), 0..41u64).prop_map(|(page, pages)| Op::UnpinAnyRange { page, pages }),
        2 => (any::<usize>(), 0..70_000u64, 0..12_289u64, any::<bool>())
            .prop_map(|(which, offset, len, write)| Op::Access { which, offset, len, write }),
    ]
}

/// Sequences that start with some of three neighbouring mappings over the dense pages
/// (read-write, read-only and message-only), so that pins often succeed.
fn ops() -> impl Strategy<Value = Vec<Op>> {
    let setup = [
        Op::Map { page: 0, pages: 10, prot: 3, message_only: false, offset_pages: 1 },
        Op::Map { page: 10, pages: 8, prot: 1, message_only: false, offset_pages: 0 },
        Op::Map { page: 18, pages: 4, prot: 3, message_only: true, offset_pages: 0 },
    ];
    (prop::sample::subsequence(setup.to_vec(), 0..=3), prop::collection::vec(op(), 1..60)).prop_map(
        |(mut first, rest)| {
            first.extend(rest);
            first
        },
    )
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn track_mode_matches_the_model(ops in ops()) {
        run(&ops, PinMode::Track);
    }

    #[test]
    fn lock_mode_matches_the_model(ops in ops()) {
        run(&ops, PinMode::Lock);
    }

    /// Kernel mode, with the process's VmPin checked against the engine's kernel pins after
    /// every step and back to its start after every sequence (unpins, unmaps, and the
    /// disconnect at the end): nothing else in this test binary takes kernel pins.
    #[test]
    fn kernel_mode_matches_the_model(ops in ops()) {
        run_alone(&ops, PinMode::Kernel);
    }
}
