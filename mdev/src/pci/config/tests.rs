//! Config-space emulation as a guest and QEMU exercise it.

use super::*;

fn ids() -> PciIds {
    PciIds {
        vendor_id: 0x1234,
        device_id: 0x75d1,
        subsystem_vendor_id: 0x1af4,
        subsystem_id: 0x1100,
        revision: 7,
        class: ClassCode { base: 0xff, sub: 0x01, prog_if: 0x02 },
    }
}

/// An MSI-X layout: `vectors`, the table's (BAR, offset) and the PBA's.
fn msix(vectors: u16, (table_bar, table_offset): (u8, u32), (pba_bar, pba_offset): (u8, u32)) -> MsixCap {
    MsixCap { vectors, table_bar, table_offset, pba_bar, pba_offset }
}

fn read32(cs: &ConfigSpace, at: u64) -> u32 {
    let mut b = [0; 4];
    cs.read(at, &mut b).unwrap();
    u32::from_le_bytes(b)
}

fn read16(cs: &ConfigSpace, at: u64) -> u16 {
    let mut b = [0; 2];
    cs.read(at, &mut b).unwrap();
    u16::from_le_bytes(b)
}

fn read8(cs: &ConfigSpace, at: u64) -> u8 {
    let mut b = [0; 1];
    cs.read(at, &mut b).unwrap();
    b[0]
}

fn write32(cs: &mut ConfigSpace, at: u64, v: u32) -> ConfigChanges {
    cs.write(at, &v.to_le_bytes()).unwrap()
}

fn write16(cs: &mut ConfigSpace, at: u64, v: u16) -> ConfigChanges {
    cs.write(at, &v.to_le_bytes()).unwrap()
}

fn all_bars() -> ConfigSpace {
    ConfigSpaceBuilder::new(ids())
        .bar(0, Bar::io(16))
        .bar(1, Bar::mem32(4096))
        .bar(2, Bar::mem64(1 << 33).prefetchable())
        .bar(4, Bar::mem32(1 << 20).prefetchable())
        .build()
        .unwrap()
}

/// The full capability set, in declaration order PM, MSI, MSI-X, PCIe.
fn everything() -> ConfigSpace {
    ConfigSpaceBuilder::new(ids())
        .bar(0, Bar::mem32(4096))
        .interrupt_pin(1)
        .power_management()
        .msi(MsiCap { vectors: 4, per_vector_mask: true, addr64: true })
        .msix(msix(16, (0, 0x800), (0, 0xc00)))
        .pcie()
        .build()
        .unwrap()
}

/// Capability (id, offset) pairs in list order; panics on a loop.
fn walk(cs: &ConfigSpace) -> Vec<(u8, u8)> {
    let mut found = Vec::new();
    if read16(cs, STATUS as u64) & STATUS_CAP_LIST == 0 {
        return found;
    }
    let mut at = read8(cs, CAPABILITY_LIST as u64);
    while at != 0 {
        assert!(found.len() < 48, "capability list loops");
        assert!(at >= 0x40 && at.is_multiple_of(4), "bad capability pointer {at:#x}");
        found.push((read8(cs, u64::from(at)), at));
        at = read8(cs, u64::from(at) + 1);
    }
    found
}

#[test]
fn header_reads_back_the_ids() {
    let cs = everything();
    assert_eq!(read32(&cs, 0), 0x75d1_1234);
    assert_eq!(read32(&cs, 8), 0xff01_0207, "class ff/01/02, revision 7");
    assert_eq!(read8(&cs, HEADER_TYPE as u64), 0);
    assert_eq!(read32(&cs, SUBSYSTEM_VENDOR_ID as u64), 0x1100_1af4);
    assert_eq!(read8(&cs, INTERRUPT_PIN as u64), 1);
    assert_eq!(cs.size(), 4096, "PCIe makes the space 4 KiB");
    // The whole space in one read, as QEMU does at realize.
    let mut all = vec![0; 256];
    cs.read(0, &mut all).unwrap();
    assert_eq!(&all[0..4], &[0x34, 0x12, 0xd1, 0x75]);
    // An empty extended capability list.
    assert_eq!(read32(&cs, EXT_CAP_START as u64), 0);
}

#[test]
fn sizing_an_io_bar() {
    let mut cs = all_bars();
    assert_eq!(read32(&cs, 0x10), 0x1, "I/O type bit");
    write32(&mut cs, 0x10, 0xffff_ffff);
    assert_eq!(read32(&cs, 0x10), 0xffff_fff1, "16-byte I/O BAR");
    write32(&mut cs, 0x10, 0xc040);
    assert_eq!(read32(&cs, 0x10), 0xc041);
}

#[test]
fn sizing_a_mem32_bar() {
    let mut cs = all_bars();
    assert_eq!(read32(&cs, 0x14), 0);
    let changes = write32(&mut cs, 0x14, 0xffff_ffff);
    assert!(changes.contains(ConfigChanges::BAR));
    assert_eq!(read32(&cs, 0x14), 0xffff_f000, "4 KiB, 32-bit, non-prefetchable");
    write32(&mut cs, 0x14, 0xfebf_1234);
    assert_eq!(read32(&cs, 0x14), 0xfebf_1000, "address bits below the size are zero");
}

#[test]
fn sizing_a_mem64_bar_both_halves() {
    let mut cs = all_bars();
    assert_eq!(read32(&cs, 0x18), 0b1100, "64-bit prefetchable type bits");
    write32(&mut cs, 0x18, 0xffff_ffff);
    write32(&mut cs, 0x1c, 0xffff_ffff);
    assert_eq!(read32(&cs, 0x18), 0x0000_000c, "8 GiB: no low address bits");
    assert_eq!(read32(&cs, 0x1c), 0xffff_fffe);
    let size = !((u64::from(read32(&cs, 0x1c)) << 32) | u64::from(read32(&cs, 0x18) & !0xf)) + 1;
    assert_eq!(size, 1 << 33);
    assert_eq!(cs.bar(3), None, "the upper half is not a BAR of its own");
}

#[test]
fn sizing_a_prefetchable_mem32_bar_and_empty_slots() {
    let mut cs = all_bars();
    write32(&mut cs, 0x20, 0xffff_ffff);
    assert_eq!(read32(&cs, 0x20), 0xfff0_0008);
    write32(&mut cs, 0x24, 0xffff_ffff);
    assert_eq!(read32(&cs, 0x24), 0, "an empty slot sizes to 0");
}

#[test]
fn rom_bar_reads_zero_and_ignores_writes() {
    let mut cs = all_bars();
    write32(&mut cs, ROM_ADDRESS as u64, 0xffff_f800);
    assert_eq!(read32(&cs, ROM_ADDRESS as u64), 0);
}

#[test]
fn read_only_fields_stay() {
    let mut cs = everything();
    let mut before = vec![0; 256];
    cs.read(0, &mut before).unwrap();
    for at in [0x00u64, 0x02, 0x08, 0x0a, 0x0e, 0x2c, 0x2e, 0x34, 0x3d] {
        cs.write(at, &[0xff, 0xff]).unwrap();
    }
    let mut after = vec![0; 256];
    cs.read(0, &mut after).unwrap();
    for at in [0x00, 0x01, 0x02, 0x03, 0x08, 0x09, 0x0a, 0x0b, 0x0e, 0x2c, 0x2d, 0x2e, 0x2f, 0x34, 0x3d] {
        assert_eq!(before[at], after[at], "byte {at:#x} is read-only");
    }
    // Capability IDs and next pointers are read-only too.
    for (_, at) in walk(&cs) {
        cs.write(u64::from(at), &[0, 0]).unwrap();
    }
    assert_eq!(walk(&cs).len(), 4);
}

#[test]
fn command_and_interrupt_line_are_writable() {
    let mut cs = everything();
    let changes = write16(&mut cs, COMMAND as u64, 0xffff);
    assert_eq!(read16(&cs, COMMAND as u64), 0x0407, "IO, MEM, MASTER, INTX_DISABLE only");
    assert!(changes.contains(ConfigChanges::COMMAND | ConfigChanges::INTX_DISABLE));
    assert!(cs.irq_control().intx_disabled);
    let changes = write16(&mut cs, COMMAND as u64, COMMAND_MEMORY);
    assert!(changes.contains(ConfigChanges::INTX_DISABLE));
    assert!(!cs.irq_control().intx_disabled);

    let changes = cs.write(INTERRUPT_LINE as u64, &[0x0b]).unwrap();
    assert_eq!(changes, ConfigChanges::INTERRUPT_LINE);
    assert_eq!(read8(&cs, INTERRUPT_LINE as u64), 0x0b);
    write32(&mut cs, CACHE_LINE_SIZE as u64, 0xffff_ffff);
    assert_eq!(read32(&cs, CACHE_LINE_SIZE as u64), 0xff, "only the cache line size is writable");
}

#[test]
fn status_error_bits_are_write_one_to_clear() {
    let mut cs = everything();
    cs.set_status_errors(STATUS_REC_MASTER_ABORT | STATUS_SIG_TARGET_ABORT | STATUS_CAP_LIST);
    let sts = read16(&cs, STATUS as u64);
    assert_eq!(sts, STATUS_CAP_LIST | STATUS_REC_MASTER_ABORT | STATUS_SIG_TARGET_ABORT);
    // Writing 0s changes nothing; writing a 1 clears only that bit.
    write16(&mut cs, STATUS as u64, 0);
    assert_eq!(read16(&cs, STATUS as u64), sts);
    write16(&mut cs, STATUS as u64, STATUS_REC_MASTER_ABORT | STATUS_CAP_LIST | STATUS_INTERRUPT);
    assert_eq!(read16(&cs, STATUS as u64), STATUS_CAP_LIST | STATUS_SIG_TARGET_ABORT);
    // A dword write at COMMAND reaches STATUS's upper half too.
    write32(&mut cs, COMMAND as u64, u32::from(STATUS_SIG_TARGET_ABORT) << 16);
    assert_eq!(read16(&cs, STATUS as u64), STATUS_CAP_LIST);
}

#[test]
fn capability_walk_visits_each_capability_once() {
    let cs = everything();
    let found: Vec<u8> = walk(&cs).iter().map(|&(id, _)| id).collect();
    assert_eq!(found, [CAP_ID_PM, CAP_ID_MSI, CAP_ID_MSIX, CAP_ID_EXP]);
    let offsets: Vec<usize> = walk(&cs).iter().map(|&(_, at)| usize::from(at)).collect();
    assert_eq!(offsets[0], cs.power_management().unwrap());
    assert_eq!(offsets[1], cs.msi().unwrap().0);
    assert_eq!(offsets[2], cs.msix().unwrap().0);
    assert_eq!(offsets[3], cs.pcie().unwrap());
    // No capability overlaps the next.
    let lens = [PmCap::LEN, 0x18, MsixCap::LEN, PcieCap::LEN];
    for i in 0..3 {
        assert!(offsets[i] + lens[i] <= offsets[i + 1]);
    }
    assert!(offsets[3] + PcieCap::LEN <= 256);

    let bare = ConfigSpaceBuilder::new(ids()).build().unwrap();
    assert_eq!(read16(&bare, STATUS as u64) & STATUS_CAP_LIST, 0);
    assert_eq!(read8(&bare, CAPABILITY_LIST as u64), 0);
    assert_eq!(bare.size(), 256);
}

#[test]
fn msi_control_semantics() {
    let mut cs = everything();
    let (at, _) = cs.msi().unwrap();
    let ctrl = at as u64 + 2;
    assert_eq!(read16(&cs, ctrl), (2 << 1) | MSI_CTRL_64BIT | MSI_CTRL_PER_VECTOR_MASK);
    assert_eq!(cs.irq_control().msi_vectors, 1);

    // Enable with MME = 2 (4 vectors).
    let changes = write16(&mut cs, ctrl, MSI_CTRL_ENABLE | (2 << 4));
    assert!(changes.contains(ConfigChanges::MSI) && changes.affects_interrupts());
    let control = cs.irq_control();
    assert!(control.msi_enabled);
    assert_eq!(control.msi_vectors, 4);
    // MME beyond MMC is clamped; the capable field and flags cannot be written.
    write16(&mut cs, ctrl, 0xffff);
    assert_eq!(read16(&cs, ctrl), (2 << 4) | (2 << 1) | MSI_CTRL_ENABLE | MSI_CTRL_64BIT | (1 << 8));
    assert_eq!(cs.irq_control().msi_vectors, 4);

    // Address (dword aligned), upper address, data.
    write32(&mut cs, at as u64 + 4, 0xfee0_1003);
    write32(&mut cs, at as u64 + 8, 0x1);
    write32(&mut cs, at as u64 + 0xc, 0xffff_4041);
    assert_eq!(read32(&cs, at as u64 + 4), 0xfee0_1000);
    assert_eq!(read32(&cs, at as u64 + 8), 1);
    assert_eq!(read32(&cs, at as u64 + 0xc), 0x4041, "16-bit data, no extended data");

    // Mask and pending bits belong to the interrupt layer: config space stores none of
    // them and says where they are.
    write32(&mut cs, at as u64 + 0x10, 0xffff_ffff);
    assert_eq!(read32(&cs, at as u64 + 0x10), 0);
    let owned = cs.irq_registers();
    assert_eq!(
        (owned.msi_mask, owned.msi_pending, owned.msi_vector_bits),
        (Some(at + 0x10), Some(at + 0x14), 0xf)
    );

    let changes = write16(&mut cs, ctrl, 0);
    assert!(changes.contains(ConfigChanges::MSI));
    assert!(!cs.irq_control().msi_enabled);
}

#[test]
fn msix_control_and_function_mask() {
    let mut cs = everything();
    let (at, _) = cs.msix().unwrap();
    let ctrl = at as u64 + 2;
    assert_eq!(read16(&cs, ctrl), 15, "table size - 1");
    assert_eq!(read32(&cs, at as u64 + 4), 0x800, "table: BIR 0, offset 0x800");
    assert_eq!(read32(&cs, at as u64 + 8), 0xc00, "PBA: BIR 0, offset 0xc00");

    let changes = write16(&mut cs, ctrl, MSIX_CTRL_ENABLE | MSIX_CTRL_FUNCTION_MASK | 0x7ff);
    assert!(changes.contains(ConfigChanges::MSIX));
    assert_eq!(read16(&cs, ctrl), MSIX_CTRL_ENABLE | MSIX_CTRL_FUNCTION_MASK | 15);
    let control = cs.irq_control();
    assert!(control.msix_enabled && control.msix_function_mask);

    // Byte write to the upper control byte clears the function mask only.
    let changes = cs.write(ctrl + 1, &[0x80]).unwrap();
    assert!(changes.contains(ConfigChanges::MSIX));
    let control = cs.irq_control();
    assert!(control.msix_enabled && !control.msix_function_mask);

    write32(&mut cs, at as u64 + 4, 0xffff_ffff);
    write32(&mut cs, at as u64 + 8, 0xffff_ffff);
    assert_eq!(read32(&cs, at as u64 + 4), 0x800, "table offset/BIR are read-only");
    assert_eq!(read32(&cs, at as u64 + 8), 0xc00);
}

#[test]
fn power_state_moves_between_d0_and_d3hot_only() {
    let mut cs = everything();
    let pmcsr = cs.power_management().unwrap() as u64 + 4;
    assert_eq!(read16(&cs, pmcsr), PM_CTRL_NO_SOFT_RESET);
    let changes = write16(&mut cs, pmcsr, 3);
    assert!(changes.contains(ConfigChanges::POWER_STATE));
    assert_eq!(cs.power_state(), 3);
    assert_eq!(read16(&cs, pmcsr), 3 | PM_CTRL_NO_SOFT_RESET);
    assert_eq!(write16(&mut cs, pmcsr, 1), ConfigChanges::empty(), "D1 is unsupported: ignored");
    write16(&mut cs, pmcsr, 2);
    assert_eq!(cs.power_state(), 3);
    write16(&mut cs, pmcsr, 0);
    assert_eq!(cs.power_state(), 0);
}

#[test]
fn pcie_capability_is_a_minimal_endpoint() {
    let mut cs = everything();
    let at = cs.pcie().unwrap() as u64;
    assert_eq!(read16(&cs, at + 2) & 0xf, 2, "version 2");
    assert_eq!((read16(&cs, at + 2) >> 4) & 0xf, 0, "endpoint");
    assert_eq!(read16(&cs, at + 0x12), 0x0011, "link up at 2.5 GT/s x1");
    write16(&mut cs, at + 8, 0xffff);
    assert_eq!(read16(&cs, at + 8), 0x781f, "writable device control bits");
    // Device status error bits are write-one-to-clear.
    cs.data[at as usize + 0xa] = 0x5;
    write16(&mut cs, at + 0xa, 0x1);
    assert_eq!(read16(&cs, at + 0xa), 0x4);
}

#[test]
fn reset_restores_the_built_state() {
    let mut cs = everything();
    let mut built = vec![0; cs.size()];
    cs.read(0, &mut built).unwrap();
    write16(&mut cs, COMMAND as u64, 0x7);
    write32(&mut cs, 0x10, 0xffff_ffff);
    cs.write(INTERRUPT_LINE as u64, &[9]).unwrap();
    let (msix, pm) = (cs.msix().unwrap().0 as u64, cs.power_management().unwrap() as u64);
    write16(&mut cs, msix + 2, MSIX_CTRL_ENABLE);
    write16(&mut cs, pm + 4, 3);
    cs.reset();
    let mut after = vec![0; cs.size()];
    cs.read(0, &mut after).unwrap();
    assert_eq!(built, after);
    assert_eq!(cs.irq_control(), IrqControl { msi_vectors: 1, ..IrqControl::default() });
}

#[test]
fn out_of_range_accesses_are_rejected() {
    let mut cs = all_bars();
    let mut b = [0; 4];
    assert!(cs.read(253, &mut b).is_err());
    assert!(cs.read(256, &mut b[..1]).is_err());
    assert!(cs.read(u64::MAX, &mut b).is_err());
    assert!(cs.write(0xfe, &[0; 4]).is_err());
    assert!(cs.read(252, &mut b).is_ok());
    // Unaligned reads inside are fine.
    let mut two = [0; 2];
    cs.read(1, &mut two).unwrap();
    assert_eq!(two, [0x12, 0xd1]);
    assert!(everything().read(4095, &mut [0]).is_ok());
}

#[test]
fn declarations_are_validated() {
    let b = || ConfigSpaceBuilder::new(ids());
    assert_eq!(b().bar(6, Bar::io(4)).build().unwrap_err(), ConfigError::BarIndex { index: 6 });
    assert_eq!(
        b().bar(0, Bar::mem64(4096)).bar(1, Bar::io(4)).build().unwrap_err(),
        ConfigError::BarSlotTaken { index: 1 }
    );
    assert_eq!(b().bar(5, Bar::mem64(4096)).build().unwrap_err(), ConfigError::Mem64NoUpperSlot { index: 5 });
    assert!(matches!(b().bar(0, Bar::mem32(3000)).build(), Err(ConfigError::BarSize { .. })));
    assert_eq!(b().interrupt_pin(5).build().unwrap_err(), ConfigError::InterruptPin(5));
    assert_eq!(
        b().msi(MsiCap { vectors: 3, per_vector_mask: false, addr64: false }).build().unwrap_err(),
        ConfigError::MsiVectors(3)
    );
    assert_eq!(
        b().msi(MsiCap { vectors: 64, per_vector_mask: false, addr64: false }).build().unwrap_err(),
        ConfigError::MsiVectors(64)
    );
    assert_eq!(
        b().power_management().power_management().build().unwrap_err(),
        ConfigError::DuplicateCapability("power management")
    );

    let mem = || b().bar(0, Bar::mem32(4096)).bar(1, Bar::io(16));
    assert_eq!(mem().msix(msix(0, (0, 0), (0, 0x800))).build().unwrap_err(), ConfigError::MsixVectors(0));
    assert_eq!(
        mem().msix(msix(2049, (0, 0), (0, 0x800))).build().unwrap_err(),
        ConfigError::MsixVectors(2049)
    );
    assert_eq!(
        mem().msix(msix(2, (2, 0), (0, 0x800))).build().unwrap_err(),
        ConfigError::MsixBar { what: "table", bar: 2 }
    );
    assert_eq!(
        mem().msix(msix(2, (0, 0), (1, 0))).build().unwrap_err(),
        ConfigError::MsixBar { what: "PBA", bar: 1 },
        "an I/O BAR cannot hold the PBA"
    );
    assert_eq!(
        mem().msix(msix(2, (0, 0x804), (0, 0xc00))).build().unwrap_err(),
        ConfigError::MsixMisaligned { what: "table", offset: 0x804 }
    );
    assert!(matches!(
        mem().msix(msix(2, (0, 0xfe8), (0, 0x800))).build(),
        Err(ConfigError::MsixOutsideBar { what: "table", .. })
    ));
    assert!(matches!(
        mem().msix(msix(2, (0, 0x800), (0, 0x1000))).build(),
        Err(ConfigError::MsixOutsideBar { what: "PBA", .. })
    ));
    assert_eq!(
        mem().msix(msix(4, (0, 0x800), (0, 0x830))).build().unwrap_err(),
        ConfigError::MsixOverlap { bar: 0 }
    );
    // Table end meets PBA start exactly: fine.
    assert!(mem().msix(msix(4, (0, 0x800), (0, 0x840))).build().is_ok());
    assert!(mem().msix(msix(2048, (0, 0), (0, 0x800))).build().is_err(), "a 32 KiB table in a 4 KiB BAR");
}
