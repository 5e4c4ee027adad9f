//! mtty-2 against rust-vmm's `vfio_user::Client` over a real socket: the UART programmed as
//! a driver would (divisor, 8N1, FIFOs, IER), loopback data and modem lines, LSR/IIR, INTx
//! through an eventfd with VFIO's automask and UNMASK, two independent ports, reset; and the
//! output buffer for bytes sent outside loopback.

mod common;

use std::os::fd::AsRawFd;
use std::sync::Arc;
use std::time::Duration;

use common::{read32, wait_eventfd, Harness};
use umdev_devices::mtty::{self, regs::*, Backend};
use vfio_user::Client;
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

const CONFIG: u32 = 7;
/// `VFIO_IRQ_SET_*` flags.
const DATA_NONE: u32 = 1 << 0;
const DATA_EVENTFD: u32 = 1 << 2;
const ACTION_UNMASK: u32 = 1 << 4;
const ACTION_TRIGGER: u32 = 1 << 5;
const INTX: u32 = 0;

fn inb(c: &mut Client, port: u32, reg: u64) -> u8 {
    let mut b = [0u8];
    c.region_read(port, reg, &mut b).expect("region_read");
    b[0]
}

fn outb(c: &mut Client, port: u32, reg: u64, v: u8) {
    c.region_write(port, reg, &[v]).expect("region_write");
}

/// Nothing signalled (give a stray signal a moment to show up).
fn quiet(e: &EventFd) -> bool {
    std::thread::sleep(Duration::from_millis(20));
    e.read().is_err()
}

fn unmask_intx(c: &mut Client) {
    c.set_irqs(INTX, DATA_NONE | ACTION_UNMASK, 0, 1, &[]).expect("unmask INTx");
}

/// Programs `port` as a driver does: divisor through DLAB, 8N1, FIFOs enabled and
/// cleared with `trigger`, loopback, then IER.
fn program(c: &mut Client, port: u32, divisor: u16, trigger: u8, ier: u8) {
    outb(c, port, LCR, LCR_DLAB | LCR_WLEN8);
    outb(c, port, DLL, divisor as u8);
    outb(c, port, DLM, (divisor >> 8) as u8);
    assert_eq!((inb(c, port, DLL), inb(c, port, DLM)), (divisor as u8, (divisor >> 8) as u8));
    outb(c, port, LCR, LCR_WLEN8);
    outb(c, port, FCR, FCR_ENABLE | FCR_CLEAR_RX | FCR_CLEAR_TX | trigger);
    outb(c, port, MCR, MCR_LOOP | MCR_DTR | MCR_RTS | MCR_OUT2);
    inb(c, port, MSR); // the modem inputs changed with loopback: clear the deltas
    outb(c, port, IER, ier);
}

#[test]
fn rust_vmm_client_loops_bytes_through_both_ports() {
    let h = Harness::new(mtty::TYPE_2);
    let mut c = Client::new(&h.socket).expect("connect and negotiate");

    // Two 8-byte I/O BARs, a 256-byte config space, the kernel sample's identity.
    assert_eq!(c.region(0).expect("BAR0").size, 8);
    assert_eq!(c.region(1).expect("BAR1").size, 8);
    assert_eq!(c.region(2).expect("BAR2").size, 0);
    assert_eq!(c.region(CONFIG).expect("config").size, 256);
    assert_eq!(read32(&mut c, CONFIG, 0), 0x3253_4348);
    assert_eq!(read32(&mut c, CONFIG, 8), 0x0700_0210);
    assert_eq!(read32(&mut c, CONFIG, 0x10), 1, "BAR0: I/O");
    let intx_info = c.get_irq_info(INTX).expect("INTx info");
    assert_eq!(intx_info.count, 1);

    let intx = EventFd::new(EFD_NONBLOCK).unwrap();
    c.set_irqs(INTX, DATA_EVENTFD | ACTION_TRIGGER, 0, 1, &[intx.as_raw_fd()]).expect("INTx eventfd");

    // Port 0: 9600 baud, trigger at 4 bytes. Port 1: 1200 baud, trigger at 1.
    program(&mut c, 0, 0x000c, FCR_TRIGGER_4, IER_RDI);
    program(&mut c, 1, 0x0060, FCR_TRIGGER_1, IER_RDI | IER_RLSI);
    assert_eq!(inb(&mut c, 0, LSR), LSR_THRE | LSR_TEMT);
    assert_eq!(inb(&mut c, 0, IIR), IIR_FIFO_ENABLED | IIR_NO_INT);
    assert!(quiet(&intx), "nothing pending yet");

    // Port 0: four bytes reach the trigger level; INTx fires.
    for &b in b"umdv" {
        outb(&mut c, 0, THR, b);
    }
    assert_eq!(wait_eventfd(&intx), 1);
    assert_eq!(inb(&mut c, 0, LSR), LSR_DR | LSR_THRE | LSR_TEMT);
    assert_eq!(inb(&mut c, 0, IIR), IIR_FIFO_ENABLED | IIR_RDI);
    assert_eq!(inb(&mut c, 1, LSR), LSR_THRE | LSR_TEMT, "port 1 received nothing");
    let got: Vec<u8> = (0..4).map(|_| inb(&mut c, 0, RBR)).collect();
    assert_eq!(got, b"umdv", "in order");
    assert_eq!(inb(&mut c, 0, LSR), LSR_THRE | LSR_TEMT);
    assert_eq!(inb(&mut c, 0, IIR), IIR_FIFO_ENABLED | IIR_NO_INT);
    // The line dropped with the data: unmasking fires nothing.
    unmask_intx(&mut c);
    assert!(quiet(&intx));

    // Port 1, independently: one byte is enough at trigger 1.
    outb(&mut c, 1, THR, b'X');
    assert_eq!(wait_eventfd(&intx), 1);
    assert_eq!(inb(&mut c, 1, IIR), IIR_FIFO_ENABLED | IIR_RDI);
    assert_eq!(inb(&mut c, 0, IIR), IIR_FIFO_ENABLED | IIR_NO_INT, "port 0 is quiet");
    // Automasked: more data keeps the line asserted but signals nothing until UNMASK.
    for i in 0..16u8 {
        outb(&mut c, 1, THR, 0x30 + i); // 17 bytes in all: the last one overruns
    }
    assert!(quiet(&intx), "automasked");
    unmask_intx(&mut c);
    assert_eq!(wait_eventfd(&intx), 1, "still asserted at UNMASK: fires again");
    assert_eq!(inb(&mut c, 1, IIR), IIR_FIFO_ENABLED | IIR_RLSI, "line status first");
    assert_eq!(inb(&mut c, 1, LSR), LSR_DR | LSR_OE | LSR_THRE | LSR_TEMT);
    assert_eq!(inb(&mut c, 1, IIR), IIR_FIFO_ENABLED | IIR_RDI, "reading LSR cleared OE");
    let got: Vec<u8> = (0..16).map(|_| inb(&mut c, 1, RBR)).collect();
    let mut want = vec![b'X'];
    want.extend(0x30..0x3f);
    assert_eq!(got, want, "the 17th byte was lost to the overrun");
    assert_eq!(inb(&mut c, 1, IIR), IIR_FIFO_ENABLED | IIR_NO_INT);

    // Modem lines loop back: DTR|RTS|OUT2 read as DSR|CTS|DCD; dropping RTS is a delta.
    assert_eq!(inb(&mut c, 0, MSR), MSR_DSR | MSR_CTS | MSR_DCD);
    outb(&mut c, 0, MCR, MCR_LOOP | MCR_DTR | MCR_OUT2);
    assert_eq!(inb(&mut c, 0, MSR), MSR_DSR | MSR_DCD | MSR_DCTS);
    assert_eq!(inb(&mut c, 0, MSR), MSR_DSR | MSR_DCD, "reading MSR cleared the delta");

    // Outside MCR loopback the default line is a loopback plug, as in the kernel sample:
    // the byte comes back all the same.
    outb(&mut c, 0, MCR, MCR_DTR | MCR_RTS | MCR_OUT2);
    outb(&mut c, 0, THR, b'!');
    assert_eq!(inb(&mut c, 0, LSR), LSR_DR | LSR_THRE | LSR_TEMT);
    assert_eq!(inb(&mut c, 0, RBR), b'!');

    // Reset: power-on registers on both ports.
    c.reset().expect("reset");
    for port in 0..2 {
        assert_eq!(inb(&mut c, port, IER), 0);
        assert_eq!(inb(&mut c, port, LCR), 0);
        assert_eq!(inb(&mut c, port, MCR), 0);
        assert_eq!(inb(&mut c, port, IIR), IIR_NO_INT);
    }
    assert_eq!(h.info().protocol.errors, 0, "{:?}", h.info().protocol);
}

#[test]
fn a_host_line_sees_what_the_guest_sends_and_keeps_it_across_a_disconnect() {
    let device = Arc::new(mtty::create_with(&[Backend::Loopback, Backend::Queue]).expect("create"));
    let host = mtty::HostPort::of(&device, 1).expect("port 1 is a queue");
    let h = Harness::with_device(device, |_| {});
    let mut c = Client::new(&h.socket).expect("connect");
    outb(&mut c, 1, LCR, LCR_WLEN8);
    for &b in b"hello, console" {
        outb(&mut c, 1, THR, b);
    }
    assert_eq!(inb(&mut c, 1, LSR), LSR_THRE | LSR_TEMT, "nothing loops back on a host line");
    assert_eq!(host.recv(), b"hello, console");
    // A client disconnect resets the UART but keeps what was sent and not yet taken.
    outb(&mut c, 1, THR, b'.');
    drop(c);
    h.wait_idle();
    assert_eq!(host.recv(), b".");
}
