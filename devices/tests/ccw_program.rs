//! The channel-program interpreter against a byte-vector model of guest memory and the store.

use umdev_devices::ccw::program::*;
use umdev_testkit::ccw_driver::VecBus;

const P: u64 = 0x1000;

fn normal(s: &Status) {
    assert_eq!((s.dstat, s.cstat, s.reason), (dstat::CE | dstat::DE, 0, Reason::Ok), "{s:?}");
}

fn pattern(n: usize) -> Vec<u8> {
    (0..n).map(|i| (i % 251) as u8).collect()
}

#[test]
fn write_then_read_direct() {
    let mut bus = VecBus::new(64 * P as usize, 1 << 20);
    bus.put(0x8000, &pattern(5000));
    bus.put(0x900, &0u64.to_le_bytes());
    bus.ccw(0x100, cmd::WRITE, flags::CC, 5000, 0x8000);
    bus.ccw(0x110, cmd::SEEK, flags::CC, 8, 0x900);
    bus.ccw(0x120, cmd::NOP, flags::CC, 1, 0);
    bus.ccw(0x130, cmd::READ, 0, 5000, 0x20000);
    let s = run(&mut bus, 0x100);
    normal(&s);
    assert_eq!((s.cpa, s.ccws, s.bytes, s.residual), (0x140, 4, 10000, 0));
    assert!(bus.store[..5000] == pattern(5000)[..], "the WRITE reached the store");
    assert!(bus.mem[0x20000..0x20000 + 5000] == pattern(5000)[..], "the READ brought it back");
}

#[test]
fn idaws_scatter_with_an_unaligned_first_block() {
    let mut bus = VecBus::new(64 * P as usize, 1 << 20);
    bus.store[..10000].copy_from_slice(&pattern(10000));
    // 10000 bytes: 0x5f00 (256 bytes to the block end), then 0x9000, 0x2000 (4K each), 0x30000...
    let idaws = [0x5f00u64, 0x9000, 0x2000, 0x30000];
    for (i, a) in idaws.iter().enumerate() {
        bus.put(0x400 + 8 * i as u64, &a.to_le_bytes());
    }
    bus.ccw(0x100, cmd::READ, flags::IDA, 10000, 0x400);
    let s = run(&mut bus, 0x100);
    normal(&s);
    let p = pattern(10000);
    assert_eq!(&bus.mem[0x5f00..0x6000], &p[..256]);
    assert_eq!(&bus.mem[0x9000..0xa000], &p[256..4352]);
    assert_eq!(&bus.mem[0x2000..0x3000], &p[4352..8448]);
    assert_eq!(&bus.mem[0x30000..0x30000 + 1552], &p[8448..]);
    assert_eq!(bus.mem[0x30000 + 1552], 0, "no byte past the count");
}

#[test]
fn two_k_idaws_may_share_a_page() {
    let mut bus = VecBus::new(64 * P as usize, 1 << 20);
    bus.put(0x8000, &pattern(6144));
    for (i, a) in [0x1800u64, 0x1000, 0x4800].iter().enumerate() {
        bus.put(0x400 + 8 * i as u64, &a.to_le_bytes());
    }
    bus.ccw(0x100, cmd::WRITE, flags::IDA | flags::IDA_2K, 6144, 0x400);
    // The data comes from those 2K blocks in IDAW order.
    let mut expect = Vec::new();
    for a in [0x1800usize, 0x1000, 0x4800] {
        bus.mem[a..a + 2048].copy_from_slice(&pattern(2048));
        expect.extend_from_slice(&pattern(2048));
    }
    let s = run(&mut bus, 0x100);
    normal(&s);
    assert_eq!(&bus.store[..6144], &expect[..]);
}

#[test]
fn seek_positions_the_store() {
    let mut bus = VecBus::new(64 * P as usize, 1 << 20);
    bus.store[0x7000..0x7010].copy_from_slice(&[9; 16]);
    bus.put(0x900, &0x7000u64.to_le_bytes());
    bus.ccw(0x100, cmd::SEEK, flags::CC, 8, 0x900);
    bus.ccw(0x110, cmd::READ, 0, 16, 0xa00);
    normal(&run(&mut bus, 0x100));
    assert_eq!(&bus.mem[0xa00..0xa10], &[9; 16]);
    // A seek past the end is a unit check.
    bus.put(0x900, &(2u64 << 20).to_le_bytes());
    let s = run(&mut bus, 0x100);
    assert_eq!((s.dstat, s.reason), (dstat::UC, Reason::SeekOutOfRange));
    // A 16-byte SEEK without SLI seeks, then flags incorrect length and stops chaining;
    // with SLI it chains on.
    bus.put(0x900, &0x7000u64.to_le_bytes());
    bus.ccw(0x100, cmd::SEEK, flags::CC, 16, 0x900);
    let s = run(&mut bus, 0x100);
    assert_eq!((s.cstat, s.residual, s.ccws, s.reason), (cstat::INCORRECT_LENGTH, 8, 1, Reason::Ok));
    bus.ccw(0x100, cmd::SEEK, flags::CC | flags::SLI, 16, 0x900);
    normal(&run(&mut bus, 0x100));
    // A NOP's count is ignored, 0 included.
    bus.ccw(0x100, cmd::NOP, 0, 0, 0);
    normal(&run(&mut bus, 0x100));
}

#[test]
fn tic_continues_elsewhere_but_never_to_a_tic_or_in_a_loop() {
    let mut bus = VecBus::new(64 * P as usize, 1 << 20);
    bus.ccw(0x100, cmd::NOP, flags::CC, 1, 0);
    bus.ccw(0x110, cmd::TIC, 0, 0, 0x800);
    bus.ccw(0x800, cmd::NOP, 0, 1, 0);
    let s = run(&mut bus, 0x100);
    normal(&s);
    assert_eq!((s.cpa, s.ccws), (0x810, 3));
    // TIC to a TIC.
    bus.ccw(0x800, cmd::TIC, 0, 0, 0x900);
    let s = run(&mut bus, 0x100);
    assert_eq!((s.cstat, s.reason, s.cpa), (cstat::PROGRAM_CHECK, Reason::TicToTic, 0x810));
    // A backward TIC: the program would loop forever.
    bus.ccw(0x800, cmd::NOP, flags::CC, 1, 0);
    bus.ccw(0x810, cmd::TIC, 0, 0, 0x100);
    let s = run(&mut bus, 0x100);
    assert_eq!((s.cstat, s.reason), (cstat::PROGRAM_CHECK, Reason::TicLoop));
    // A TIC to itself.
    bus.ccw(0x100, cmd::TIC, 0, 0, 0x100);
    assert_eq!(run(&mut bus, 0x100).reason, Reason::TicLoop);
}

#[test]
fn an_idaw_list_ending_at_the_edge_of_memory_is_read_exactly() {
    let mut bus = VecBus::new(64 * P as usize, 1 << 20);
    // Two IDAWs, the second the last 8 bytes of guest memory: nothing past them is read.
    let end = 64 * P;
    bus.put(end - 16, &(0x1800u64).to_le_bytes());
    bus.put(end - 8, &(0x3000u64).to_le_bytes());
    bus.ccw(0x100, cmd::READ, flags::IDA, 2048 + 100, end - 16);
    normal(&run(&mut bus, 0x100));
}

#[test]
fn chains_are_bounded() {
    let mut bus = VecBus::new(64 * P as usize, 1 << 20);
    for i in 0..MAX_CCWS as u64 {
        bus.ccw(0x1000 + 16 * i, cmd::NOP, flags::CC, 1, 0);
    }
    bus.ccw(0x1000 + 16 * MAX_CCWS as u64, cmd::NOP, 0, 1, 0);
    let s = run(&mut bus, 0x1000);
    assert_eq!((s.cstat, s.reason, s.ccws), (cstat::PROGRAM_CHECK, Reason::ChainTooLong, MAX_CCWS as u32));
    // Exactly MAX_CCWS is fine.
    bus.ccw(0x1000 + 16 * (MAX_CCWS as u64 - 1), cmd::NOP, 0, 1, 0);
    normal(&run(&mut bus, 0x1000));
}

#[test]
fn malformed_ccws_and_idaws_are_program_checks() {
    type Setup = Box<dyn Fn(&mut VecBus) -> u64>;
    let cases: Vec<(&str, Setup, Reason)> = vec![
        ("misaligned CCW", Box::new(|_: &mut VecBus| 0x104), Reason::CcwMisaligned),
        ("CCW outside memory", Box::new(|_: &mut VecBus| 0x100_0000), Reason::CcwUnmapped),
        ("CCW address wraps", Box::new(|_: &mut VecBus| u64::MAX - 7), Reason::CcwUnmapped),
        (
            "reserved bits",
            Box::new(|b: &mut VecBus| {
                b.put(0x100, &[cmd::NOP, 0, 1, 0, 1, 0, 0, 0]);
                0x100
            }),
            Reason::BadCcw,
        ),
        (
            "unknown flag",
            Box::new(|b: &mut VecBus| {
                b.ccw(0x100, cmd::NOP, 0x01, 1, 0);
                0x100
            }),
            Reason::BadCcw,
        ),
        (
            "chain data",
            Box::new(|b: &mut VecBus| {
                b.ccw(0x100, cmd::READ, flags::CD, 1, 0x1000);
                0x100
            }),
            Reason::BadCcw,
        ),
        (
            "zero count",
            Box::new(|b: &mut VecBus| {
                b.ccw(0x100, cmd::READ, 0, 0, 0x1000);
                0x100
            }),
            Reason::BadCount,
        ),
        (
            "count too large",
            Box::new(|b: &mut VecBus| {
                b.ccw(0x100, cmd::READ, 0, MAX_CCW_COUNT + 1, 0x1000);
                0x100
            }),
            Reason::BadCount,
        ),
        (
            "data outside memory",
            Box::new(|b: &mut VecBus| {
                b.ccw(0x100, cmd::READ, 0, 0x2000, 0x3f000);
                0x100
            }),
            Reason::DataUnmapped,
        ),
        (
            "data address wraps",
            Box::new(|b: &mut VecBus| {
                b.ccw(0x100, cmd::READ, 0, 0x2000, u64::MAX - 0xfff);
                0x100
            }),
            Reason::DataUnmapped,
        ),
        (
            "misaligned IDAL",
            Box::new(|b: &mut VecBus| {
                b.ccw(0x100, cmd::READ, flags::IDA, 16, 0x404);
                0x100
            }),
            Reason::IdalMisaligned,
        ),
        (
            "IDAL runs out of memory",
            Box::new(|b: &mut VecBus| {
                b.ccw(0x100, cmd::READ, flags::IDA, 0x3000, 0x3fff8);
                b.put(0x3fff8, &0x1000u64.to_le_bytes());
                0x100
            }),
            Reason::IdalUnmapped,
        ),
        (
            "second IDAW misaligned",
            Box::new(|b: &mut VecBus| {
                b.put(0x400, &0x1800u64.to_le_bytes());
                b.put(0x408, &0x2010u64.to_le_bytes());
                b.ccw(0x100, cmd::READ, flags::IDA, 4096, 0x400);
                0x100
            }),
            Reason::IdawMisaligned,
        ),
        (
            "IDAW outside memory",
            Box::new(|b: &mut VecBus| {
                b.put(0x400, &0x80_0000u64.to_le_bytes());
                b.ccw(0x100, cmd::READ, flags::IDA, 16, 0x400);
                0x100
            }),
            Reason::DataUnmapped,
        ),
    ];
    for (what, setup, reason) in cases {
        let mut bus = VecBus::new(64 * P as usize, 1 << 20);
        let cpa = setup(&mut bus);
        let s = run(&mut bus, cpa);
        assert_eq!((s.cstat, s.reason), (cstat::PROGRAM_CHECK, reason), "{what}: {s:?}");
        assert_eq!(s.dstat & (dstat::CE | dstat::DE), 0, "{what}: no normal ending");
    }
}

#[test]
fn device_refusals_are_unit_checks_and_read_only_is_a_protection_check() {
    let mut bus = VecBus::new(64 * P as usize, 0x1000);
    bus.ccw(0x100, 0x05, 0, 1, 0x1000);
    let s = run(&mut bus, 0x100);
    assert_eq!((s.dstat, s.reason), (dstat::UC, Reason::BadCommand));
    bus.ccw(0x100, cmd::READ, 0, 0x1001, 0x2000);
    assert_eq!(run(&mut bus, 0x100).reason, Reason::EndOfStore);
    bus.read_only = 0x2000..0x3000;
    bus.ccw(0x100, cmd::READ, 0, 16, 0x2ff8);
    let s = run(&mut bus, 0x100);
    assert_eq!((s.cstat, s.reason), (cstat::PROTECTION_CHECK, Reason::DataReadOnly));
    // Writing the store from read-only memory is fine.
    bus.ccw(0x100, cmd::WRITE, 0, 16, 0x2ff8);
    normal(&run(&mut bus, 0x100));
}

#[test]
fn sense_length_and_sli() {
    let mut bus = VecBus::new(64 * P as usize, 0x1000);
    bus.mem[0x2000..0x2040].fill(0xff);
    bus.ccw(0x100, cmd::SENSE, 0, 32, 0x2000);
    normal(&run(&mut bus, 0x100));
    assert_eq!(&bus.mem[0x2000..0x2020], &[0; 32]);
    // A short SENSE without SLI: incorrect length, and the chain stops there.
    bus.ccw(0x100, cmd::SENSE, flags::CC, 16, 0x2000);
    bus.ccw(0x110, cmd::NOP, 0, 1, 0);
    let s = run(&mut bus, 0x100);
    assert_eq!(
        (s.cstat, s.dstat, s.residual, s.ccws),
        (cstat::INCORRECT_LENGTH, dstat::CE | dstat::DE, 0, 1)
    );
    bus.ccw(0x100, cmd::SENSE, flags::CC | flags::SLI, 64, 0x2000);
    let s = run(&mut bus, 0x100);
    normal(&s);
    assert_eq!((s.ccws, s.residual), (2, 0));
}

/// A [`VecBus`] whose fetches see its memory through `at` (an address map), and which says
/// `stop` whenever asked whether to stop.
struct Shaped {
    bus: VecBus,
    at: fn(u64) -> u64,
    stop: Option<Reason>,
}

impl Bus for Shaped {
    fn fetch(&mut self, a: u64, b: &mut [u8]) -> Result<(), BusError> {
        self.bus.fetch((self.at)(a), b)
    }
    fn transfer(&mut self, d: Direction, p: &[Piece], s: u64) -> Result<(), Partial> {
        self.bus.transfer(d, p, s)
    }
    fn deliver(&mut self, p: &[Piece], d: &[u8]) -> Result<(), Partial> {
        self.bus.deliver(p, d)
    }
    fn store_size(&self) -> u64 {
        self.bus.store_size()
    }
    fn stopped(&self) -> Option<Reason> {
        self.stop
    }
}

#[test]
fn a_stop_request_ends_the_program_with_unit_exception() {
    let mut bus = Shaped { bus: VecBus::new(64 * P as usize, 0x1000), at: |a| a, stop: Some(Reason::Halted) };
    bus.bus.ccw(0x100, cmd::NOP, 0, 1, 0);
    let s = run(&mut bus, 0x100);
    assert_eq!((s.dstat, s.reason, s.ccws), (dstat::UE, Reason::Halted, 0));
}

#[test]
fn the_status_block_encodes_little_endian() {
    let s = Status {
        dstat: 0x0c,
        cstat: 0x20,
        residual: 7,
        cpa: 0x1122,
        reason: Reason::TicLoop,
        ccws: 3,
        bytes: 9,
    };
    let b = s.encode();
    assert_eq!(Status::decode(&b), Some(s));
    for (code, r) in Reason::ALL.iter().enumerate() {
        assert_eq!(*r as usize, code);
    }
    assert_eq!((b[0], b[1]), (0x0c, 0x20));
    assert_eq!(u32::from_le_bytes(b[4..8].try_into().unwrap()), 7);
    assert_eq!(u64::from_le_bytes(b[8..16].try_into().unwrap()), 0x1122);
    assert_eq!(u32::from_le_bytes(b[16..20].try_into().unwrap()), 8);
}

#[test]
fn a_ccw_and_an_idaw_list_may_end_at_the_top_of_the_address_space() {
    // The last 64 KiB below 2^64 are the VecBus's first 64 KiB (the data stays low).
    const TOP: u64 = u64::MAX - 0xffff;
    let at = |a: u64| if a >= TOP { a - TOP } else { a + 0x10000 };
    let mut bus = Shaped { bus: VecBus::new(64 * P as usize, 0x4000), at, stop: None };
    // A lone NOP in the last 16 bytes.
    bus.bus.ccw(0xfff0, cmd::NOP, 0, 0, 0);
    let s = run(&mut bus, u64::MAX - 15);
    assert_eq!(s.reason, Reason::Ok, "{s:?}");
    // Chained from there, the next CCW would be past the top: nowhere, not at 0.
    bus.bus.ccw(0xfff0, cmd::NOP, flags::CC, 0, 0);
    let s = run(&mut bus, u64::MAX - 15);
    assert_eq!((s.reason, s.ccws), (Reason::CcwUnmapped, 1), "{s:?}");
    bus.bus.ccw(0xfff0, cmd::NOP, 0, 0, 0);
    // A READ of two 4 KiB blocks whose two IDAWs are the last 16 bytes, its CCW below them.
    bus.bus.ccw(0xffe0, cmd::READ, flags::IDA, 0x2000, u64::MAX - 15);
    bus.bus.put(0xfff0, &[0x00, 0x30, 0, 0, 0, 0, 0, 0]);
    bus.bus.put(0xfff8, &[0x00, 0x50, 0, 0, 0, 0, 0, 0]);
    let s = run(&mut bus, u64::MAX - 31);
    assert_eq!((s.reason, s.bytes), (Reason::Ok, 0x2000), "{s:?}");
}

/// A subchannel's [`Scratch`], reused from one program to the next, gives every program the
/// result a fresh one would, and keeps at most [`Scratch::KEPT`] entries of a long program's
/// lists after it.
#[test]
fn a_scratch_reused_across_programs_changes_nothing_and_keeps_what_it_may() {
    // A long IDA CCW, then a shorter one chained to it, whose pieces must not include any of
    // the first's: 8 MiB in 2 KiB IDAWs, each block in a 4 KiB slot, backwards (4096
    // pieces), then 10000 bytes in three 4 KiB IDAWs.
    let blocks = 4096u64;
    let program = || {
        let mut bus = VecBus::new(24 << 20, 9 << 20);
        bus.store.copy_from_slice(&pattern(9 << 20));
        for i in 0..blocks {
            bus.put(0x10_0000 + 8 * i, &(0x40_0000 + (blocks - 1 - i) * 4096).to_le_bytes());
        }
        for (i, a) in [0x9000u64, 0x2000, 0x3_0000].iter().enumerate() {
            bus.put(0x20_0000 + 8 * i as u64, &a.to_le_bytes());
        }
        bus.ccw(0x100, cmd::READ, flags::IDA | flags::IDA_2K | flags::CC, 8 << 20, 0x10_0000);
        bus.ccw(0x110, cmd::READ, flags::IDA, 10000, 0x20_0000);
        bus
    };
    let mut scratch = Scratch::default();
    for round in 0..2 {
        let (mut reused, mut fresh) = (program(), program());
        let status = run_with(&mut reused, 0x100, &mut scratch);
        normal(&status);
        assert_eq!(status, run(&mut fresh, 0x100), "round {round}");
        assert!(reused.mem == fresh.mem, "round {round}: guest memory differs");
        let p = pattern(9 << 20);
        for i in (0..blocks as usize).step_by(97) {
            let at = 0x40_0000 + (blocks as usize - 1 - i) * 4096;
            assert!(reused.mem[at..at + 2048] == p[i * 2048..(i + 1) * 2048], "block {i}");
        }
        assert!(reused.mem[0x9000..0xa000] == p[8 << 20..(8 << 20) + 4096], "the second CCW's data");
        assert!(scratch.capacity() <= 2 * Scratch::KEPT, "{} entries kept", scratch.capacity());
    }
}
