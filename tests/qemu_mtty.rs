//! QEMU 11's vfio-user-pci client against an mtty-2, through qtest (no guest OS): the test
//! plays the guest's 8250 driver with `outb`/`inb` on the I/O ports QEMU decodes for the
//! two BARs. Skips only when QEMU cannot be fetched, and says so.

mod common;

use std::time::Duration;

use common::qemu::{qemu_binary, Qtest};
use common::Harness;
use umdev_devices::mtty::{self, regs::*};

/// Where the test puts the two ports in I/O space.
const PORT0: u16 = 0xc100;
const PORT1: u16 = 0xc108;

fn reg(base: u16, reg: u64) -> u16 {
    base + reg as u16
}

/// Programs a port as a driver does: divisor through DLAB, 8N1, FIFOs (trigger 1),
/// loopback, then IER.
fn program(q: &mut Qtest, base: u16, ier: u8) {
    q.outb(reg(base, LCR), LCR_DLAB | LCR_WLEN8);
    q.outb(reg(base, DLL), 0x0c); // 9600 baud
    q.outb(reg(base, DLM), 0x00);
    assert_eq!(q.inb(reg(base, DLL)), 0x0c);
    q.outb(reg(base, LCR), LCR_WLEN8);
    q.outb(reg(base, FCR), FCR_ENABLE | FCR_CLEAR_RX | FCR_CLEAR_TX | FCR_TRIGGER_1);
    q.outb(reg(base, MCR), MCR_LOOP | MCR_RTS | MCR_OUT2);
    q.inb(reg(base, MSR));
    q.outb(reg(base, IER), ier);
}

#[test]
fn qemu_realizes_mtty_and_loops_bytes_back() {
    let Some(qemu) = qemu_binary() else { return };
    let h = Harness::new(mtty::TYPE_2);
    let mut q = Qtest::start(&qemu, &h.socket, 128, h.dir.path()).expect("start QEMU");
    q.cmd("irq_intercept_in ioapic");

    // The identity 8250_pci binds on.
    assert_eq!(q.cfg_read32(0x00), 0x3253_4348, "{}", q.stderr());
    assert_eq!(q.cfg_read32(0x08), 0x0700_0210, "class 07/00/02, revision 0x10");
    assert_eq!(q.cfg_read32(0x2c), 0x3253_4348, "subsystem");
    assert_eq!(q.cfg_read8(0x3d), 1, "INTA#");
    // The capability list: MSI, then the end.
    assert_ne!(q.cfg_read16(0x06) & 0x10, 0, "capability list bit");
    assert_eq!(q.cap_ids(), vec![0x05]);

    // Two 8-byte I/O BARs.
    assert_eq!(q.size_bar(0), 0xffff_fff9);
    assert_eq!(q.size_bar(1), 0xffff_fff9);
    assert_eq!(q.size_bar(2), 0);
    q.cfg_write32(0x10, u32::from(PORT0));
    q.cfg_write32(0x14, u32::from(PORT1));
    q.cfg_write16(0x04, 0x0001); // I/O decode
    assert_eq!(q.cfg_read32(0x10), u32::from(PORT0) | 1);

    // Power-on registers, as the 8250 driver's probe sees them.
    assert_eq!(q.inb(reg(PORT0, LSR)), LSR_THRE | LSR_TEMT);
    assert_eq!(q.inb(reg(PORT0, IIR)), IIR_NO_INT);
    q.outb(reg(PORT0, SCR), 0xa5);
    assert_eq!(q.inb(reg(PORT0, SCR)), 0xa5);

    // Port 0 in loopback: the bytes come back in order, and INTx reaches the IOAPIC.
    program(&mut q, PORT0, IER_RDI);
    q.irq_events.clear();
    for &b in b"QEMU" {
        q.outb(reg(PORT0, THR), b);
    }
    let irq = q.wait_irq_raise(Duration::from_secs(60));
    assert!(irq.is_some(), "no INTx seen; QEMU said:\n{}", q.stderr());
    assert_eq!(q.inb(reg(PORT0, LSR)), LSR_DR | LSR_THRE | LSR_TEMT);
    assert_eq!(q.inb(reg(PORT0, IIR)), IIR_FIFO_ENABLED | IIR_RDI);
    let got: Vec<u8> = (0..4).map(|_| q.inb(reg(PORT0, RBR))).collect();
    assert_eq!(got, b"QEMU");
    assert_eq!(q.inb(reg(PORT0, LSR)), LSR_THRE | LSR_TEMT);
    assert_eq!(q.inb(reg(PORT0, IIR)), IIR_FIFO_ENABLED | IIR_NO_INT);
    // Loopback modem lines: RTS -> CTS, OUT2 -> DCD (Linux's loopback probe).
    assert_eq!(q.inb(reg(PORT0, MSR)) & 0xf0, MSR_CTS | MSR_DCD);

    // Port 1 on its own: its byte does not show on port 0, and it raises INTx again (QEMU
    // unmasked INTx on its own after the guest's accesses above).
    program(&mut q, PORT1, IER_RDI);
    q.irq_events.clear();
    q.outb(reg(PORT1, THR), b'z');
    let irq = q.wait_irq_raise(Duration::from_secs(60));
    assert!(irq.is_some(), "no second INTx; QEMU said:\n{}", q.stderr());
    assert_eq!(q.inb(reg(PORT0, LSR)) & LSR_DR, 0, "port 0 received nothing");
    assert_eq!(q.inb(reg(PORT1, IIR)), IIR_FIFO_ENABLED | IIR_RDI);
    assert_eq!(q.inb(reg(PORT1, RBR)), b'z');
    assert_eq!(q.inb(reg(PORT1, IIR)), IIR_FIFO_ENABLED | IIR_NO_INT);
    assert!(q.running(), "{}", q.stderr());

    let protocol = h.info().protocol;
    assert_eq!(protocol.fatal, 0);
    assert_eq!(protocol.errors, 0, "{protocol:?}");
}
