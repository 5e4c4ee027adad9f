//! mtty driven through [`VfioDevice`], as the server drives it.

use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

use super::*;
use umdev_mdev::pci::regs::{CAPABILITY_LIST, CAP_ID_MSI, COMMAND, COMMAND_INTX_DISABLE, COMMAND_IO};
use umdev_mdev::pci::regs::{MSI_CTRL_ENABLE, STATUS, STATUS_CAP_LIST, STATUS_INTERRUPT};
use umdev_mdev::types::Registry;
use umdev_mdev::{IrqAction, IrqData, RegionFlags, SetIrqs};
use umdev_mdev::{VFIO_PCI_CONFIG_REGION_INDEX as CONFIG, VFIO_PCI_INTX_IRQ_INDEX as INTX};
use umdev_mdev::{VFIO_PCI_MSIX_IRQ_INDEX as MSIX, VFIO_PCI_MSI_IRQ_INDEX as MSI};

/// A divisor so slow (≈1.8 baud) the character timeout never fires during a test.
const SLOW: u16 = 0xffff;
/// 115200 baud: the character timeout fires after ≈0.35 ms.
const FAST: u16 = 1;
/// 8 data bits, no parity, 1 stop bit.
const LCR_8N1: u8 = LCR_WLEN8;

struct Rig {
    dev: MttyDevice,
}

fn rig(ports: usize) -> Rig {
    Rig { dev: create(ports).unwrap() }
}

/// A card whose ports have these backends.
fn rig_with(backends: &[Backend]) -> Rig {
    Rig { dev: create_with(backends).unwrap() }
}

impl Rig {
    fn inb(&self, port: u32, reg: u64) -> u8 {
        let mut b = [0u8];
        self.dev.region_read(port, reg, &mut b).unwrap();
        b[0]
    }

    fn outb(&self, port: u32, reg: u64, value: u8) {
        self.dev.region_write(port, reg, &[value]).unwrap();
    }

    fn cfg(&self, offset: u64, len: usize) -> u64 {
        let mut b = [0u8; 8];
        self.dev.region_read(CONFIG, offset, &mut b[..len]).unwrap();
        u64::from_le_bytes(b)
    }

    fn set_cfg(&self, offset: u64, len: usize, value: u64) {
        self.dev.region_write(CONFIG, offset, &value.to_le_bytes()[..len]).unwrap();
    }

    fn eventfd(&self, index: u32) -> EventFd {
        let fd = EventFd::new(EFD_NONBLOCK).unwrap();
        let data = IrqData::Eventfds(vec![fd.try_clone().unwrap()]);
        self.dev.set_irqs(SetIrqs { index, start: 0, count: 1, action: IrqAction::Trigger, data }).unwrap();
        fd
    }

    fn unmask_intx(&self) {
        let req = SetIrqs { index: INTX, start: 0, count: 1, action: IrqAction::Unmask, data: IrqData::None };
        self.dev.set_irqs(req).unwrap();
    }

    fn intx_status(&self) -> bool {
        self.cfg(STATUS as u64, 2) as u16 & STATUS_INTERRUPT != 0
    }

    /// Programs `port` as a driver would: divisor, 8N1, FCR, loopback, then IER.
    fn setup(&self, port: u32, divisor: u16, fcr: u8, ier: u8) {
        self.outb(port, LCR, LCR_DLAB | LCR_8N1);
        self.outb(port, DLL, divisor as u8);
        self.outb(port, DLM, (divisor >> 8) as u8);
        self.outb(port, LCR, LCR_8N1);
        self.outb(port, FCR, fcr);
        self.outb(port, MCR, MCR_LOOP);
        self.inb(port, MSR); // entering loopback changed the modem inputs
        self.outb(port, IER, ier);
    }

    /// The in-process host side of a [`Backend::Queue`] port.
    fn host(&self, port: usize) -> HostPort {
        HostPort::of(&self.dev, port).unwrap()
    }

    fn stats(&self, port: usize) -> PortStats {
        self.dev.function().lock().stats(port).unwrap()
    }
}

fn take(fd: &EventFd) -> u64 {
    fd.read().unwrap_or(0)
}

#[test]
fn identity_and_config_space_are_the_kernel_samples() {
    let rig = rig(2);
    assert_eq!(rig.cfg(0, 4), 0x3253_4348, "vendor 4348, device 3253");
    assert_eq!(rig.cfg(8, 4), 0x0700_0210, "class 07/00/02, revision 0x10");
    assert_eq!(rig.cfg(0x2c, 4), 0x3253_4348, "subsystem");
    assert_eq!(rig.cfg(0x0e, 1), 0, "header type 0");
    assert_eq!(rig.cfg(0x3d, 1), 1, "INTA#");
    // Both ports are 8-byte I/O BARs; the rest are absent.
    for (bar, expect) in [(0u64, 0xffff_fff9u64), (1, 0xffff_fff9), (2, 0), (5, 0)] {
        rig.set_cfg(0x10 + 4 * bar, 4, 0xffff_ffff);
        assert_eq!(rig.cfg(0x10 + 4 * bar, 4), expect, "BAR{bar}");
    }
    rig.set_cfg(0x10, 4, 0xc150);
    assert_eq!(rig.cfg(0x10, 4), 0xc151);
    // COMMAND is writable (mtty's is read-only); ROM absent.
    rig.set_cfg(COMMAND as u64, 2, u64::from(COMMAND_IO | COMMAND_INTX_DISABLE));
    assert_eq!(rig.cfg(COMMAND as u64, 2), u64::from(COMMAND_IO | COMMAND_INTX_DISABLE));
    assert_eq!(rig.cfg(0x30, 4), 0);
    // One capability: MSI, one vector, 64-bit.
    assert_ne!(rig.cfg(STATUS as u64, 2) as u16 & STATUS_CAP_LIST, 0);
    let msi = rig.cfg(CAPABILITY_LIST as u64, 1);
    assert_eq!(rig.cfg(msi, 1), u64::from(CAP_ID_MSI));
    assert_eq!(rig.cfg(msi + 1, 1), 0, "last capability");
    assert_eq!(rig.cfg(msi + 2, 2) & 0x8e, 0x80, "64-bit, 1 vector capable");

    let info = rig.dev.device_info();
    assert_eq!((info.num_regions, info.num_irqs), (9, 5));
    for bar in 0..2 {
        let region = rig.dev.region_info(bar).unwrap();
        assert_eq!((region.size, region.flags), (8, RegionFlags::READ | RegionFlags::WRITE));
    }
    assert_eq!(rig.dev.region_info(2).unwrap().size, 0);
    assert_eq!(rig.dev.region_info(CONFIG).unwrap().size, 256);
    assert_eq!(rig.dev.irq_info(INTX).unwrap().count, 1);
    assert_eq!(rig.dev.irq_info(MSI).unwrap().count, 1);
    assert_eq!(rig.dev.irq_info(MSIX).unwrap().count, 0);

    let one = self::rig(1);
    assert_eq!(one.dev.region_info(1).unwrap().size, 0);
    one.set_cfg(0x14, 4, 0xffff_ffff);
    assert_eq!(one.cfg(0x14, 4), 0, "a one-port card has no BAR1");
    assert_eq!(one.dev.function().lock().ports(), 1);
    assert!(one.dev.function().lock().backend(1).is_none());
    assert!(matches!(create(0), Err(MttyError::Ports(0))));
    assert!(matches!(create(3), Err(MttyError::Ports(3))));
}

#[test]
fn power_on_registers() {
    let rig = rig(1);
    assert_eq!(rig.inb(0, IER), 0);
    assert_eq!(rig.inb(0, IIR), IIR_NO_INT, "FIFOs off: bits 7:6 clear");
    assert_eq!(rig.inb(0, LCR), 0);
    assert_eq!(rig.inb(0, MCR), 0);
    assert_eq!(rig.inb(0, LSR), LSR_THRE | LSR_TEMT);
    assert_eq!(
        rig.inb(0, MSR),
        0xb3,
        "a ready peer whose CTS and DSR just came up: the kernel sample's value"
    );
    assert_eq!(rig.inb(0, MSR), MSR_CTS | MSR_DSR | MSR_DCD, "reading cleared the deltas");
    assert_eq!(rig.inb(0, SCR), 0);
}

#[test]
fn divisor_latch_replaces_bytes_and_dlab_switches_registers() {
    let rig = rig_with(&[Backend::Queue]);
    rig.outb(0, LCR, LCR_DLAB);
    rig.outb(0, DLL, 0x0c);
    rig.outb(0, DLM, 0x00);
    assert_eq!((rig.inb(0, DLL), rig.inb(0, DLM)), (0x0c, 0));
    rig.outb(0, DLL, 0x03); // replaces (mtty ORs: it would read 0x0f)
    rig.outb(0, DLM, 0x01);
    assert_eq!((rig.inb(0, DLL), rig.inb(0, DLM)), (0x03, 0x01));
    assert_eq!(rig.inb(0, LCR), LCR_DLAB);
    assert!(rig.host(0).recv().is_empty(), "DLL writes transmit nothing");
    // DLAB off: offsets 0 and 1 are THR/RBR and IER again.
    rig.outb(0, LCR, LCR_8N1);
    rig.outb(0, IER, 0xff);
    assert_eq!(rig.inb(0, IER), 0x0f, "IER has 4 bits");
    rig.outb(0, IER, 0);
    rig.outb(0, THR, b'x');
    assert_eq!(rig.host(0).recv(), b"x");
    // Setting DLAB again shows the divisor unchanged (mtty clears it).
    rig.outb(0, LCR, LCR_DLAB | LCR_8N1);
    assert_eq!((rig.inb(0, DLL), rig.inb(0, DLM)), (0x03, 0x01));
    rig.outb(0, SCR, 0x5a);
    assert_eq!(rig.inb(0, SCR), 0x5a);
    rig.outb(0, MCR, 0xff);
    assert_eq!(rig.inb(0, MCR), MCR_MASK);
}

#[test]
fn rx_fifo_trigger_levels() {
    for (trigger, level) in [(FCR_TRIGGER_1, 1), (FCR_TRIGGER_4, 4), (FCR_TRIGGER_8, 8), (FCR_TRIGGER_14, 14)]
    {
        let rig = rig(1);
        rig.setup(0, SLOW, FCR_ENABLE | trigger, IER_RDI);
        assert_eq!(rig.inb(0, IIR), IIR_FIFO_ENABLED | IIR_NO_INT);
        for i in 0..level - 1 {
            rig.outb(0, THR, i);
            assert_eq!(rig.inb(0, IIR), IIR_FIFO_ENABLED | IIR_NO_INT, "below trigger {level}");
        }
        rig.outb(0, THR, 0xee);
        assert_eq!(rig.inb(0, IIR), IIR_FIFO_ENABLED | IIR_RDI, "at trigger {level}");
        assert_eq!(rig.inb(0, RBR), if level == 1 { 0xee } else { 0 });
        assert_eq!(rig.inb(0, IIR), IIR_FIFO_ENABLED | IIR_NO_INT, "below trigger {level} again");
    }
    // 16450 mode (FIFOs off): any byte is "data available"; IIR bits 7:6 stay clear.
    let rig = rig(1);
    rig.setup(0, SLOW, FCR_TRIGGER_14, IER_RDI);
    rig.outb(0, THR, 1);
    assert_eq!(rig.inb(0, IIR), IIR_RDI);
}

#[test]
fn loopback_returns_bytes_in_order_then_overruns() {
    let rig = rig(1);
    rig.setup(0, SLOW, FCR_ENABLE | FCR_TRIGGER_14, 0);
    for i in 0..17u8 {
        rig.outb(0, THR, 0x40 + i);
    }
    assert_eq!(rig.inb(0, LSR), LSR_DR | LSR_OE | LSR_THRE | LSR_TEMT);
    assert_eq!(rig.inb(0, LSR), LSR_DR | LSR_THRE | LSR_TEMT, "reading LSR clears OE");
    let got: Vec<u8> = (0..16).map(|_| rig.inb(0, RBR)).collect();
    assert_eq!(got, (0x40..0x50).collect::<Vec<u8>>(), "the 17th byte was lost");
    assert_eq!(rig.inb(0, LSR), LSR_THRE | LSR_TEMT);
    assert_eq!(rig.inb(0, RBR), 0x4f, "an empty RBR repeats the last byte");
    assert_eq!(rig.stats(0).dropped, 1);

    // Clearing the RX FIFO; leaving FIFO mode also empties it.
    rig.outb(0, THR, 1);
    rig.outb(0, FCR, FCR_ENABLE | FCR_CLEAR_RX);
    assert_eq!(rig.inb(0, LSR) & LSR_DR, 0);
    rig.outb(0, THR, 2);
    rig.outb(0, FCR, 0);
    assert_eq!(rig.inb(0, LSR) & LSR_DR, 0);

    // 16450 mode: one holding register; a second byte overwrites the first.
    rig.outb(0, THR, b'a');
    rig.outb(0, THR, b'b');
    assert_eq!(rig.inb(0, LSR), LSR_DR | LSR_OE | LSR_THRE | LSR_TEMT);
    assert_eq!(rig.inb(0, RBR), b'b');
}

#[test]
fn iir_priority_and_read_to_clear() {
    let rig = rig(1);
    rig.setup(0, SLOW, FCR_ENABLE | FCR_TRIGGER_4, IER_RDI | IER_THRI | IER_RLSI | IER_MSI);
    assert_eq!(rig.inb(0, IIR), IIR_FIFO_ENABLED | IIR_THRI, "enabling THRI on an empty THR");
    assert_eq!(rig.inb(0, IIR), IIR_FIFO_ENABLED | IIR_NO_INT, "the IIR read cleared THRE");
    rig.outb(0, MCR, MCR_LOOP | MCR_RTS); // CTS rises: a modem status change
    for i in 0..17 {
        rig.outb(0, THR, i); // the 17th overruns
    }
    // Line status > data available > THR empty > modem status.
    assert_eq!(rig.inb(0, IIR), IIR_FIFO_ENABLED | IIR_RLSI);
    assert_eq!(rig.inb(0, IIR), IIR_FIFO_ENABLED | IIR_RLSI, "IIR reads do not clear RLS");
    assert_ne!(rig.inb(0, LSR) & LSR_OE, 0);
    assert_eq!(rig.inb(0, IIR), IIR_FIFO_ENABLED | IIR_RDI);
    for _ in 0..13 {
        rig.inb(0, RBR);
    }
    assert_eq!(rig.inb(0, IIR), IIR_FIFO_ENABLED | IIR_THRI, "3 bytes, below the trigger");
    assert_eq!(rig.inb(0, IIR), IIR_FIFO_ENABLED | IIR_MSI, "the IIR read cleared THRE");
    assert_eq!(rig.inb(0, MSR), MSR_CTS | MSR_DCTS);
    assert_eq!(rig.inb(0, IIR), IIR_FIFO_ENABLED | IIR_NO_INT, "the MSR read cleared the deltas");
    // A THR write clears THRE and the transmitter sets it again.
    rig.outb(0, FCR, FCR_ENABLE | FCR_TRIGGER_4 | FCR_CLEAR_RX);
    rig.outb(0, IER, IER_THRI);
    rig.outb(0, THR, 0);
    assert_eq!(rig.inb(0, IIR), IIR_FIFO_ENABLED | IIR_THRI);
    // Disabling THRI drops it.
    rig.outb(0, THR, 0);
    rig.outb(0, IER, 0);
    rig.outb(0, IER, IER_RDI);
    assert_eq!(rig.inb(0, IIR), IIR_FIFO_ENABLED | IIR_NO_INT, "1 byte is below the trigger");
}

#[test]
fn modem_lines_loop_back_with_deltas() {
    let rig = rig(1);
    rig.outb(0, MCR, MCR_LOOP);
    assert_eq!(rig.inb(0, MSR), MSR_DCTS | MSR_DDSR | MSR_DDCD, "the idle peer's lines dropped");
    assert_eq!(rig.inb(0, MSR), 0, "reading MSR clears the deltas");
    rig.outb(0, MCR, MCR_LOOP | MCR_RTS);
    assert_eq!(rig.inb(0, MSR), MSR_CTS | MSR_DCTS, "RTS -> CTS");
    rig.outb(0, MCR, MCR_LOOP | MCR_DTR);
    assert_eq!(rig.inb(0, MSR), MSR_DSR | MSR_DDSR | MSR_DCTS, "DTR -> DSR");
    rig.outb(0, MCR, MCR_LOOP | MCR_OUT1);
    assert_eq!(rig.inb(0, MSR), MSR_RI | MSR_DDSR, "OUT1 -> RI; a rising RI is no delta");
    rig.outb(0, MCR, MCR_LOOP | MCR_OUT2);
    assert_eq!(rig.inb(0, MSR), MSR_DCD | MSR_DDCD | MSR_TERI, "OUT2 -> DCD; RI's trailing edge");
    rig.outb(0, MCR, MCR_LOOP | MCR_DTR | MCR_RTS | MCR_OUT1 | MCR_OUT2);
    assert_eq!(rig.inb(0, MSR), 0xf0 | MSR_DCTS | MSR_DDSR);
    // Leaving loopback: back to the idle peer (RI falls).
    rig.outb(0, MCR, MCR_DTR | MCR_RTS | MCR_OUT1 | MCR_OUT2);
    assert_eq!(rig.inb(0, MSR), MSR_CTS | MSR_DSR | MSR_DCD | MSR_TERI);
    // Linux's autoconfig loopback check: LOOP|OUT2|RTS reads DCD|CTS.
    rig.outb(0, MCR, MCR_LOOP | MCR_OUT2 | MCR_RTS);
    assert_eq!(rig.inb(0, MSR) & 0xf0, MSR_DCD | MSR_CTS);
    // The modem status interrupt.
    rig.outb(0, IER, IER_MSI);
    assert_eq!(rig.inb(0, IIR), IIR_NO_INT);
    rig.outb(0, MCR, MCR_LOOP);
    assert_eq!(rig.inb(0, IIR), IIR_MSI);
    rig.inb(0, MSR);
    assert_eq!(rig.inb(0, IIR), IIR_NO_INT);
}

#[test]
fn a_host_line_carries_bytes_both_ways_at_the_guests_pace() {
    let rig = rig_with(&[Backend::Loopback, Backend::Queue]);
    let host = rig.host(1);
    rig.outb(1, LCR, LCR_8N1);
    for &b in b"hello" {
        rig.outb(1, THR, b);
    }
    assert_eq!(rig.inb(1, LSR), LSR_THRE | LSR_TEMT, "nothing loops back on a host line");
    assert_eq!(host.recv(), b"hello");
    assert_eq!(rig.stats(0), PortStats::default(), "port 0 is separate");
    // Word length: 5 and 7 bits.
    rig.outb(1, LCR, 0);
    rig.outb(1, THR, 0xff);
    rig.outb(1, LCR, 0x02);
    rig.outb(1, THR, 0xff);
    assert_eq!(host.recv(), [0x1f, 0x7f]);

    // A host that does not read: its queue fills, then the transmitter stalls (THRE and
    // TEMT clear, no THRE interrupt) and the byte written into a full FIFO is lost.
    rig.outb(1, LCR, LCR_8N1);
    rig.outb(1, FCR, FCR_ENABLE);
    for i in 0..HOST_QUEUE + FIFO_SIZE + 1 {
        rig.outb(1, THR, i as u8);
    }
    assert_eq!(rig.inb(1, LSR) & (LSR_THRE | LSR_TEMT), 0, "stalled");
    rig.outb(1, IER, IER_THRI);
    assert_eq!(rig.inb(1, IIR), IIR_FIFO_ENABLED | IIR_NO_INT, "no THRE while stalled");
    let first = host.recv();
    assert_eq!(first.len(), HOST_QUEUE);
    assert!(first.iter().enumerate().all(|(i, &b)| b == i as u8), "in order");
    assert_eq!(rig.inb(1, IIR), IIR_FIFO_ENABLED | IIR_THRI, "the host read: the FIFO drained");
    let rest = host.recv();
    assert_eq!(rest, (HOST_QUEUE..HOST_QUEUE + FIFO_SIZE).map(|i| i as u8).collect::<Vec<u8>>());
    assert_eq!(rig.inb(0, LSR), LSR_THRE | LSR_TEMT, "the other port never stalled");

    // Host to guest: the receiver takes 16, the rest waits in the queue, nothing is lost
    // while the guest reads.
    rig.outb(1, IER, IER_RDI);
    let data: Vec<u8> = (0..100u8).collect();
    assert_eq!(host.send(&data), 100);
    let mut got = Vec::new();
    while rig.inb(1, LSR) & LSR_DR != 0 {
        got.push(rig.inb(1, RBR));
    }
    assert_eq!(got, data, "paced by the guest, whole and in order");
    assert_eq!(rig.inb(1, LSR) & LSR_OE, 0);
    // The queue is bounded, the bytes in the receiver counted (an RX clear gives them back):
    // a flood is taken only as far as it fits, and what the guest reads makes room.
    assert_eq!(host.send(&vec![7u8; 2 * HOST_QUEUE]), HOST_QUEUE);
    assert_eq!(host.send(&vec![7u8; HOST_QUEUE]), 0, "the receiver's bytes count until read");
    for _ in 0..FIFO_SIZE {
        rig.inb(1, RBR);
    }
    assert_eq!(host.send(&vec![7u8; HOST_QUEUE]), FIFO_SIZE, "what the guest read made room");
    assert_eq!(host.send(&[7]), 0, "full");
    rig.outb(1, FCR, FCR_ENABLE | FCR_CLEAR_RX);
    assert_eq!(host.send(&[7]), 0, "an RX clear gives back, within the bound");
    assert_eq!(rig.stats(1).dropped, 0);
}

/// What a host peer's `send` does to a port's UART, at the instant `now`.
fn host_send(uart: &mut Uart, bytes: &[u8], now: Instant) {
    let Line::Host(host) = &mut uart.line else { panic!("not a host line") };
    host.to_guest.extend(bytes);
    uart.feed_rx(now);
}

#[test]
fn an_ignored_receiver_overruns_like_a_real_line() {
    // The UART on its own, at instants the test chooses: the rule is about time.
    let reset = Instant::now();
    let at = |us: u64| reset + Duration::from_micros(us);
    let mut uart = Uart::new(Line::Host(HostLine::new(None)), reset);
    // Untouched since reset (a guest still booting): host bytes wait, however long.
    host_send(&mut uart, &[9u8; 20], reset);
    host_send(&mut uart, &[], at(10_000_000));
    assert_eq!(uart.stats.dropped, 0, "nothing is lost before the guest has seen the port");
    // The guest finds the port 10 s after the reset: 115200 baud 8N1, a character every
    // 86.8 µs, receive interrupts off.
    let found = 10_000_000;
    uart.write(LCR, LCR_DLAB | LCR_8N1, at(found));
    uart.write(DLL, 1, at(found));
    uart.write(LCR, LCR_8N1, at(found));
    uart.write(FCR, FCR_ENABLE | FCR_CLEAR_RX, at(found));
    let grace = IGNORED_AFTER.as_micros() as u64;
    host_send(&mut uart, &[1u8; 40], at(found + grace - 1));
    assert_eq!(uart.read(LSR, at(found + grace - 1)) & LSR_OE, 0, "held while the guest may still read");
    // Later, the next feed (any host activity) finds the receiver ignored: the bytes the line
    // could have carried since then (all that waited) overrun.
    let late = found + grace + 50_000;
    host_send(&mut uart, &[2], at(late));
    assert_eq!(uart.read(LSR, at(late)) & (LSR_OE | LSR_DR), LSR_OE | LSR_DR, "OE once");
    assert_eq!(uart.read(LSR, at(late)) & LSR_OE, 0, "cleared by reading LSR");
    let s = uart.stats;
    // One byte entered the 1-byte receiver before the FIFO was enabled and cleared, which
    // gave it back to the queue; 16 entered after; the other 4 and the 40 and 1 overran.
    assert_eq!((s.rx, s.dropped, s.overruns), (16, 4 + 40 + 1, 1), "{s:?}");
    // From then on the line carries one character per character time, and no more is lost.
    host_send(&mut uart, &[3u8; 10], at(late + 3 * 87));
    assert_eq!((uart.stats.dropped, uart.stats.overruns), (45 + 3, 2), "three character times");
    // A read ends the neglect: the receiver takes a byte again and the rest waits.
    assert_eq!(uart.read(RBR, at(late + 300)), 9, "the oldest byte the FIFO kept");
    assert_eq!(uart.stats.rx, 16 + 1);
    host_send(&mut uart, &[], at(late + 300 + grace - 1));
    assert_eq!(uart.stats.dropped, 48, "{:?}", uart.stats);
}

/// A backlog waiting when the receiver becomes ignored is paced from that moment, one byte
/// lost per character time, not lost at once for the time before it.
#[test]
fn an_ignored_receivers_backlog_is_paced_from_when_it_is_ignored() {
    let reset = Instant::now();
    let at = |us: u64| reset + Duration::from_micros(us);
    let mut uart = Uart::new(Line::Host(HostLine::new(None)), reset);
    // 115200 baud 8N1 (a character every 86.8 µs), FIFO on, receive interrupts off.
    uart.write(LCR, LCR_DLAB | LCR_8N1, at(0));
    uart.write(DLL, 1, at(0));
    uart.write(LCR, LCR_8N1, at(0));
    uart.write(FCR, FCR_ENABLE, at(0));
    let grace = IGNORED_AFTER.as_micros() as u64;
    // The host's last feed came 90 ms before the receiver became ignored; 116 bytes wait
    // (16 enter the FIFO).
    host_send(&mut uart, &[5u8; 116], at(grace - 90_000));
    assert_eq!(uart.stats.dropped, 0);
    // Ten character times after it became ignored: ten lost, not the backlog.
    host_send(&mut uart, &[], at(grace + 10 * 87));
    assert_eq!(uart.stats.dropped, 10, "{:?}", uart.stats);
}

/// Linux clears both FIFOs at every open of a port (FCR 0x01, 0x07, then 0, then its own
/// setting), after the host may have sent bytes that the receiver took: they go back to the
/// queue and the guest reads every one, in order. A device reset gives them back as well.
#[test]
fn fifo_resets_give_host_bytes_back_to_the_queue() {
    let now = Instant::now();
    let mut uart = Uart::new(Line::Host(HostLine::new(None)), now);
    let sent: Vec<u8> = (0..40).collect();
    host_send(&mut uart, &sent, now);
    assert_eq!(uart.read(LSR, now) & LSR_DR, LSR_DR, "the 1-byte receiver took the first");
    for fcr in [FCR_ENABLE, FCR_ENABLE | FCR_CLEAR_RX | FCR_CLEAR_TX, 0, FCR_ENABLE | FCR_TRIGGER_8] {
        uart.write(FCR, fcr, now);
    }
    // A device reset (a guest rebooting) gives them back too.
    assert_eq!(uart.read(LSR, now) & LSR_DR, LSR_DR);
    uart.reset(now);
    host_send(&mut uart, &[], now);
    uart.write(FCR, FCR_ENABLE, now);
    uart.write(LCR, LCR_8N1, now);
    let mut got = Vec::new();
    while uart.read(LSR, now) & LSR_DR != 0 {
        got.push(uart.read(RBR, now));
    }
    assert_eq!(got, sent);
    assert_eq!((uart.stats.rx, uart.stats.dropped), (40, 0), "{:?}", uart.stats);
    // Loopback's characters are the UART's own: a clear discards them.
    uart.write(MCR, MCR_LOOP, now);
    uart.write(THR, b'x', now);
    uart.write(FCR, FCR_ENABLE | FCR_CLEAR_RX, now);
    uart.write(MCR, 0, now);
    assert_eq!(uart.read(LSR, now) & LSR_DR, 0);
}

/// A transmitter stalled by a host that does not read: a TX FIFO clear empties it and
/// raises THRE with its interrupt (a 16550A's), and entering loopback sends what it held to
/// the receiver.
#[test]
fn a_stalled_transmitter_is_emptied_by_a_clear_and_by_loopback() {
    let now = Instant::now();
    let mut uart = Uart::new(Line::Host(HostLine::new(None)), now);
    let stall = |uart: &mut Uart| {
        let Line::Host(host) = &mut uart.line else { unreachable!() };
        host.to_host.extend(std::iter::repeat_n(0u8, HOST_QUEUE - host.to_host.len()));
    };
    uart.write(LCR, LCR_8N1, now);
    uart.write(FCR, FCR_ENABLE, now);
    uart.write(IER, IER_THRI, now);
    assert_eq!(uart.read(IIR, now) & IIR_ID_MASK, IIR_THRI, "empty at first");
    stall(&mut uart);
    uart.write(THR, b'a', now);
    uart.write(THR, b'b', now);
    assert_eq!(uart.read(LSR, now) & LSR_THRE, 0, "stalled");
    assert_eq!(uart.read(IIR, now) & IIR_ID_MASK, IIR_NO_INT);
    uart.write(FCR, FCR_ENABLE | FCR_CLEAR_TX, now);
    assert_eq!(uart.read(LSR, now) & LSR_THRE, LSR_THRE);
    assert_eq!(uart.read(IIR, now) & IIR_ID_MASK, IIR_THRI, "the clear's THR-empty interrupt");
    uart.write(THR, b'c', now);
    uart.write(THR, b'd', now);
    assert_eq!(uart.read(LSR, now) & LSR_THRE, 0, "stalled again");
    uart.write(MCR, MCR_LOOP, now);
    assert_eq!(uart.read(LSR, now) & (LSR_THRE | LSR_DR), LSR_THRE | LSR_DR);
    assert_eq!([uart.read(RBR, now), uart.read(RBR, now)], *b"cd");
}

#[test]
fn loopback_is_the_default_line_as_in_the_kernel_sample() {
    let rig = rig(2);
    // No MCR loopback: a driver's ordinary setup, 8 byte trigger, then a burst of 16.
    rig.outb(0, LCR, LCR_8N1);
    rig.outb(0, FCR, FCR_ENABLE | FCR_TRIGGER_8);
    rig.outb(0, MCR, MCR_DTR | MCR_RTS | MCR_OUT2);
    rig.outb(0, IER, IER_RDI);
    for &b in b"0123456789abcdef" {
        rig.outb(0, THR, b);
    }
    assert_eq!(rig.inb(0, IIR), IIR_FIFO_ENABLED | IIR_RDI);
    assert_eq!(rig.inb(0, MSR) & 0xf0, MSR_CTS | MSR_DSR | MSR_DCD, "the peer stays ready");
    let got: Vec<u8> = (0..16).map(|_| rig.inb(0, RBR)).collect();
    assert_eq!(got, b"0123456789abcdef");
    assert_eq!(rig.inb(1, LSR) & LSR_DR, 0, "each port loops to itself");
    // Not read: the 17th byte overruns, reported once, and later bytes are dropped too.
    for i in 0..20u8 {
        rig.outb(0, THR, i);
    }
    assert_eq!(rig.inb(0, LSR), LSR_DR | LSR_OE | LSR_THRE | LSR_TEMT);
    assert_eq!(rig.inb(0, LSR), LSR_DR | LSR_THRE | LSR_TEMT);
    let s = rig.stats(0);
    assert_eq!((s.tx, s.rx, s.dropped, s.overruns), (36, 32, 4, 1));
}

#[test]
fn break_sends_a_zero_character_with_bi() {
    let rig = rig(1);
    rig.outb(0, LCR, LCR_8N1);
    rig.outb(0, FCR, FCR_ENABLE);
    rig.outb(0, IER, IER_RLSI | IER_RDI);
    rig.outb(0, THR, b'a');
    rig.outb(0, LCR, LCR_8N1 | LCR_SBC);
    rig.outb(0, LCR, LCR_8N1 | LCR_SBC); // held: still one break
    rig.outb(0, LCR, LCR_8N1);
    rig.outb(0, THR, b'b');
    assert_eq!(
        rig.inb(0, LSR),
        LSR_DR | LSR_FIFO_ERROR | LSR_THRE | LSR_TEMT,
        "the break is queued behind 'a'"
    );
    assert_eq!(rig.inb(0, RBR), b'a');
    assert_eq!(rig.inb(0, IIR), IIR_FIFO_ENABLED | IIR_RLSI, "a break at the top of the FIFO");
    assert_eq!(rig.inb(0, LSR), LSR_DR | LSR_BI | LSR_FIFO_ERROR | LSR_THRE | LSR_TEMT);
    assert_eq!(rig.inb(0, LSR) & LSR_BI, 0, "reported once");
    assert_eq!(rig.inb(0, RBR), 0, "the break character");
    assert_eq!(rig.inb(0, RBR), b'b');
    assert_eq!(rig.stats(0).breaks, 1);
    // A host line carries no break.
    let host = rig_with(&[Backend::Queue]);
    host.outb(0, LCR, LCR_8N1 | LCR_SBC);
    assert_eq!(host.inb(0, LSR) & LSR_DR, 0);
    assert!(host.host(0).recv().is_empty());
}

#[test]
fn wide_accesses_are_byte_accesses_in_order() {
    let rig = rig(1);
    rig.dev.region_write(0, LCR, &[LCR_8N1, MCR_RTS, 0xaa, 0xbb, 0x77]).unwrap();
    assert_eq!(rig.inb(0, SCR), 0x77, "LSR and MSR ignore writes");
    let mut b = [0u8; 4];
    rig.dev.region_read(0, MCR, &mut b).unwrap();
    assert_eq!(b, [MCR_RTS, LSR_THRE | LSR_TEMT, 0xb3, 0x77]);
    let mut b = [0u8; 8];
    rig.dev.region_read(0, 0, &mut b).unwrap();
    assert_eq!(b[3..], [LCR_8N1, MCR_RTS, 0x60, 0xb0, 0x77]);
    // Outside the BAR, or a port the card lacks: refused whole (EINVAL), no byte of it done.
    rig.outb(0, SCR, 0x5a);
    let err = rig.dev.region_write(0, 7, &[0x11, 0x22]).unwrap_err();
    assert_eq!(err.errno(), libc::EINVAL);
    assert_eq!(rig.inb(0, SCR), 0x5a, "a refused write reaches no register");
    assert!(rig.dev.region_read(0, 0, &mut [0; 9]).is_err(), "9 bytes");
    assert!(rig.dev.region_read(0, 0, &mut []).is_err(), "0 bytes");
    assert!(rig.dev.region_read(0, 7, &mut [0; 2]).is_err());
    use umdev_mdev::pci::PciFunction;
    let f = rig.dev.function();
    assert!(matches!(f.bar_read(0, 8, &mut [0]), Err(DeviceError::BadAccess { .. })));
    assert!(matches!(f.bar_read(0, u64::MAX, &mut [0; 2]), Err(DeviceError::BadAccess { .. })));
    assert!(matches!(f.bar_write(1, 0, &[0]), Err(DeviceError::NoSuchRegion(1))));
}

#[test]
fn intx_is_a_level_over_both_ports() {
    let rig = rig(2);
    let intx = rig.eventfd(INTX);
    rig.setup(0, SLOW, FCR_ENABLE, IER_RDI);
    rig.setup(1, SLOW, FCR_ENABLE, IER_RDI);
    assert_eq!(take(&intx), 0);
    assert!(!rig.intx_status());

    rig.outb(0, THR, 1);
    assert_eq!(take(&intx), 1, "port 0 data available");
    assert!(rig.intx_status());
    rig.outb(1, THR, 2);
    assert_eq!(take(&intx), 0, "already asserted, and automasked");
    rig.unmask_intx();
    assert_eq!(take(&intx), 1, "still asserted at unmask: fires again");
    assert_eq!(rig.inb(0, RBR), 1);
    assert!(rig.intx_status(), "port 1 still holds the line");
    assert_eq!(rig.inb(1, RBR), 2);
    assert!(!rig.intx_status(), "no condition left: deasserted");
    rig.unmask_intx();
    assert_eq!(take(&intx), 0);
    rig.outb(1, THR, 3);
    assert_eq!(take(&intx), 1);
    // A condition that is not enabled does not assert.
    rig.inb(1, RBR);
    rig.unmask_intx();
    rig.outb(1, IER, 0);
    rig.outb(1, THR, 4);
    assert!(!rig.intx_status());
    assert_eq!(take(&intx), 0);
    // Enabling it does.
    rig.outb(1, IER, IER_RDI);
    assert_eq!(take(&intx), 1);
    // INTx disable in COMMAND holds the signal back.
    rig.inb(1, RBR);
    rig.unmask_intx();
    rig.set_cfg(COMMAND as u64, 2, u64::from(COMMAND_INTX_DISABLE));
    rig.outb(0, THR, 5);
    assert_eq!(take(&intx), 0);
    rig.set_cfg(COMMAND as u64, 2, 0);
    assert_eq!(take(&intx), 1);
}

#[test]
fn msi_raises_for_each_new_condition() {
    let rig = rig(2);
    rig.set_cfg(COMMAND as u64, 2, u64::from(COMMAND_IO | umdev_mdev::pci::regs::COMMAND_MASTER));
    let intx = rig.eventfd(INTX);
    let msi_cap = rig.cfg(CAPABILITY_LIST as u64, 1);
    let control = rig.cfg(msi_cap + 2, 2);
    rig.set_cfg(msi_cap + 2, 2, control | u64::from(MSI_CTRL_ENABLE));
    let msi = rig.eventfd(MSI);
    rig.setup(0, SLOW, FCR_ENABLE, IER_RDI);
    rig.setup(1, SLOW, FCR_ENABLE, IER_RDI);
    assert_eq!(take(&msi), 0);

    rig.outb(0, THR, 1);
    assert_eq!(take(&msi), 1, "data available");
    rig.outb(0, THR, 2);
    assert_eq!(take(&msi), 0, "still pending: not a new condition");
    rig.outb(1, THR, 3);
    assert_eq!(take(&msi), 1, "port 1's data is new");
    rig.inb(0, RBR);
    rig.inb(0, RBR);
    rig.outb(0, THR, 4);
    assert_eq!(take(&msi), 1, "cleared, then pending again");
    rig.outb(0, IER, IER_RDI | IER_THRI);
    assert_eq!(take(&msi), 1, "THR empty");
    rig.outb(0, THR, 5);
    assert_eq!(take(&msi), 1, "each THR write empties the transmitter anew");
    assert_eq!(take(&intx), 0, "INTx is silent while MSI is on");
    assert_eq!(rig.dev.irq_handle().stats().msi, 5);
}

#[test]
fn character_timeout_delivers_bytes_below_the_trigger() {
    let rig = rig(1);
    let intx = rig.eventfd(INTX);
    rig.setup(0, FAST, FCR_ENABLE | FCR_TRIGGER_8, IER_RDI);
    for &b in b"abc" {
        rig.outb(0, THR, b);
    }
    let deadline = Instant::now() + ARRIVES;
    while take(&intx) == 0 {
        assert!(Instant::now() < deadline, "no character timeout interrupt");
        std::thread::sleep(Duration::from_millis(1));
    }
    assert_eq!(rig.inb(0, IIR), IIR_FIFO_ENABLED | IIR_TIMEOUT);
    let got: Vec<u8> = (0..3).map(|_| rig.inb(0, RBR)).collect();
    assert_eq!(got, b"abc");
    assert_eq!(rig.inb(0, IIR), IIR_FIFO_ENABLED | IIR_NO_INT);
    assert!(!rig.intx_status());
    // At the trigger level it is "data available", whatever the timer did.
    rig.unmask_intx();
    for b in 0..8 {
        rig.outb(0, THR, b);
    }
    std::thread::sleep(Duration::from_millis(5));
    assert_eq!(rig.inb(0, IIR), IIR_FIFO_ENABLED | IIR_RDI);
    assert_eq!(take(&intx), 1);
    // The timeout scales with the baud rate: at SLOW it does not fire here.
    let slow = self::rig(1);
    slow.setup(0, SLOW, FCR_ENABLE | FCR_TRIGGER_8, IER_RDI);
    slow.outb(0, THR, 1);
    std::thread::sleep(Duration::from_millis(20));
    assert_eq!(slow.inb(0, IIR), IIR_FIFO_ENABLED | IIR_NO_INT);
}

#[test]
fn char_timeout_follows_the_frame_format() {
    let mut uart = Uart::new(Line::Null, Instant::now());
    uart.divisor = 1;
    uart.lcr = LCR_8N1;
    // 10 bits at 115200 baud, four characters: 347.2 µs.
    assert_eq!(uart.char_timeout(), Duration::from_nanos(347_222));
    uart.lcr = LCR_8N1 | LCR_PARITY | LCR_STOP;
    assert_eq!(uart.char_timeout(), Duration::from_nanos(416_666));
    uart.divisor = 0;
    assert!(uart.char_timeout() > Duration::from_secs(20), "divisor 0 divides by 65536");
}

#[test]
fn reset_restores_the_uart_and_keeps_the_lines() {
    let rig = rig_with(&[Backend::Loopback, Backend::Queue]);
    let intx = rig.eventfd(INTX);
    rig.outb(1, THR, b'!');
    rig.outb(1, LCR, LCR_8N1);
    rig.outb(1, THR, b'!');
    rig.setup(0, 12, FCR_ENABLE | FCR_TRIGGER_4, IER_RDI | IER_THRI);
    rig.outb(0, SCR, 0x55);
    for b in 0..6 {
        rig.outb(0, THR, b);
    }
    assert_eq!(take(&intx), 1);
    rig.dev.reset().unwrap();
    assert!(!rig.dev.irq_handle().intx_asserted());
    for port in 0..2 {
        assert_eq!(rig.inb(port, IER), 0);
        assert_eq!(rig.inb(port, IIR), IIR_NO_INT);
        assert_eq!(rig.inb(port, LCR), 0);
        assert_eq!(rig.inb(port, MCR), 0);
        assert_eq!(rig.inb(port, LSR), LSR_THRE | LSR_TEMT);
        assert_eq!(rig.inb(port, MSR), 0xb3);
        assert_eq!(rig.inb(port, SCR), 0);
        rig.outb(port, LCR, LCR_DLAB);
        assert_eq!((rig.inb(port, DLL), rig.inb(port, DLM)), (0, 0));
    }
    // Power-on LCR selects 5-bit words: the first '!' (0x21) left as 0x01.
    assert_eq!(rig.host(1).recv(), [0x01, b'!'], "what left the port stays readable");
    assert_eq!(rig.stats(0).tx, 6, "counters survive the reset");
}

#[test]
fn ports_come_from_one_pool_across_both_types() {
    // As a binary lists them: both types on one pool.
    let ports = Pool::new(MAX_PORTS);
    let registry = Registry::with_types(vec![
        Arc::new(MttyType::single(ports.clone())),
        Arc::new(MttyType::dual(ports)),
    ]);
    let one = registry.find(TYPE_1).unwrap();
    let two = registry.find(TYPE_2).unwrap();
    let avail = || (one.available_instances(), two.available_instances());
    assert_eq!(avail(), (24, 12));
    assert_eq!(one.device_api(), "vfio-pci");

    let first = two.create(&InstanceOptions::default()).unwrap();
    assert_eq!(avail(), (22, 11));
    assert_eq!(first.region_info(1).unwrap().size, 8, "mtty-2 has two ports");
    let mut held: Vec<_> = (0..11).map(|_| two.create(&InstanceOptions::default()).unwrap()).collect();
    assert_eq!(avail(), (0, 0));
    let err = two.create(&InstanceOptions::default()).err().unwrap();
    assert!(matches!(err, TypeError::Exhausted(_)));
    assert_eq!(err.errno(), libc::EUSERS);
    assert!(matches!(one.create(&InstanceOptions::default()), Err(TypeError::Exhausted(_))));

    drop(held.pop());
    assert_eq!(avail(), (2, 1));
    let single = one.create(&InstanceOptions::default()).unwrap();
    assert_eq!(single.region_info(1).unwrap().size, 0, "mtty-1 has one port");
    assert_eq!(avail(), (1, 0));
    assert!(matches!(two.create(&InstanceOptions::default()), Err(TypeError::Exhausted(_))));

    drop((first, held, single));
    assert_eq!(avail(), (24, 12));
    let mut bad = InstanceOptions::default();
    bad.params.insert("ports".into(), "3".into());
    assert!(matches!(one.create(&bad), Err(TypeError::BadOption { .. })));
    let mut bad = InstanceOptions::default();
    bad.params.insert("port1".into(), "pty".into());
    assert!(matches!(one.create(&bad), Err(TypeError::BadOption { .. })), "mtty-1 has no port1");
    bad.params.insert("port1".into(), "serial".into());
    assert!(matches!(two.create(&bad), Err(TypeError::BadOption { .. })), "unknown backend");
    // A socket serves one port: one path for both is refused by the options' check (define
    // refuses it as start would), with what to do instead.
    let mut shared = InstanceOptions::default();
    shared.params.insert("backend".into(), "socket:/nonexistent-umdev/one.sock".into());
    let why = two.check(&shared).unwrap_err().to_string();
    assert!(
        why.contains("ports 0 and 1 would share the socket") && why.contains("port1=socket:PATH"),
        "{why}"
    );
    shared.params.insert("port1".into(), "socket:/nonexistent-umdev/one.sock".into());
    assert!(matches!(two.create(&shared), Err(TypeError::BadOption { .. })), "the same path twice");
    shared.params.insert("port1".into(), "pty".into());
    two.check(&shared).expect("a socket and a pty");
    assert!(one.check(&shared.clone()).is_err(), "mtty-1 has no port1");
    shared.params.remove("port1");
    one.check(&shared).expect("one port, one socket");
    assert_eq!(avail(), (24, 12), "a refused create reserves nothing");
}

/// A hang guard for bytes that are on their way: a busy machine makes them late, not lost.
const ARRIVES: Duration = Duration::from_secs(60);

/// Reads from `r` until `n` bytes came or `within` passed.
fn read_n(r: &mut impl std::io::Read, n: usize, within: Duration) -> Vec<u8> {
    let deadline = Instant::now() + within;
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    while got.len() < n && Instant::now() < deadline {
        match r.read(&mut buf[..(n - got.len()).min(4096)]) {
            Ok(0) => break,
            Ok(k) => got.extend_from_slice(&buf[..k]),
            Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => {}
            Err(e) => panic!("read: {e}"),
        }
    }
    got
}

/// Reads what the guest receives on `port` until `n` bytes came or `within` passed.
fn guest_read_n(rig: &Rig, port: u32, n: usize, within: Duration) -> Vec<u8> {
    let deadline = Instant::now() + within;
    let mut got = Vec::new();
    while got.len() < n && Instant::now() < deadline {
        if rig.inb(port, LSR) & LSR_DR != 0 {
            got.push(rig.inb(port, RBR));
        } else {
            std::thread::sleep(Duration::from_millis(1));
        }
    }
    got
}

/// A guest setup on `port`: 8N1, FIFOs, receive interrupts on.
fn open_port(rig: &Rig, port: u32) {
    rig.outb(port, LCR, LCR_8N1);
    rig.outb(port, FCR, FCR_ENABLE | FCR_TRIGGER_8);
    rig.outb(port, MCR, MCR_DTR | MCR_RTS | MCR_OUT2);
    rig.outb(port, IER, IER_RDI);
}

#[test]
fn a_socket_backend_serves_one_host_client_and_keeps_what_is_queued() {
    use std::io::Write;
    use std::os::unix::fs::PermissionsExt;
    use std::os::unix::net::UnixStream;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("tty1.sock");
    let rig = rig_with(&[Backend::Loopback, Backend::Socket(path.clone())]);
    assert_eq!(std::fs::metadata(&path).unwrap().permissions().mode() & 0o777, 0o600);
    assert_eq!(rig.dev.function().lock().host_path(1), Some(path.as_path()));
    open_port(&rig, 1);
    // The guest talks before any host client: queued for the first one.
    for &b in b"early" {
        rig.outb(1, THR, b);
    }
    let mut host = UnixStream::connect(&path).unwrap();
    host.set_read_timeout(Some(Duration::from_millis(100))).unwrap();
    assert_eq!(read_n(&mut host, 5, ARRIVES), b"early");
    // One host client at a time.
    let mut second = UnixStream::connect(&path).unwrap();
    second.set_read_timeout(Some(ARRIVES)).unwrap();
    assert_eq!(std::io::Read::read(&mut second, &mut [0u8; 1]).unwrap(), 0, "a second client is closed");
    // Host to guest, then the host leaves with bytes still queued: the guest gets them all.
    let data: Vec<u8> = (0..=255u8).cycle().take(3000).collect();
    host.write_all(&data).unwrap();
    drop(host);
    assert_eq!(guest_read_n(&rig, 1, data.len(), ARRIVES), data, "nothing lost when the host went");
    assert_eq!(rig.stats(1).dropped, 0);
    // A new client is served; what the guest sends reaches it.
    let deadline = Instant::now() + ARRIVES;
    let mut host = loop {
        let mut c = UnixStream::connect(&path).unwrap();
        c.set_read_timeout(Some(Duration::from_millis(100))).unwrap();
        rig.outb(1, THR, b'!');
        if read_n(&mut c, 1, Duration::from_secs(1)) == b"!" {
            break c;
        }
        assert!(Instant::now() < deadline, "the host client after a departed one is not served");
    };
    let described = rig.dev.describe();
    assert_eq!(described["ports"][1]["backend"], format!("socket:{}", path.display()));
    assert_eq!(described["ports"][1]["host_connected"], true);
    assert_eq!(described["ports"][0]["backend"], "loopback");
    for &b in b"bye" {
        rig.outb(1, THR, b);
    }
    // Probes sent while no client was served yet waited in the queue and may arrive first
    // (the line is in order): only probes come before "bye".
    let mut got = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(60);
    while !got.ends_with(b"bye") {
        assert!(Instant::now() < deadline, "no \"bye\" after {got:?}");
        got.extend(read_n(&mut host, 1, ARRIVES));
    }
    assert!(got[..got.len() - 3].iter().all(|&b| b == b'!'), "only earlier probes are queued: {got:?}");
    drop(rig);
    assert!(!path.exists(), "the socket goes with the device");
}

#[test]
fn a_pty_backend_is_a_host_terminal() {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let rig = rig_with(&[Backend::Pty]);
    let path = rig.dev.function().lock().host_path(0).unwrap().to_path_buf();
    assert!(path.starts_with("/dev/pts"), "{}", path.display());
    open_port(&rig, 0);
    let mut tty = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags(libc::O_NOCTTY | libc::O_NONBLOCK)
        .open(&path)
        .unwrap();
    for &b in b"ping\n" {
        rig.outb(0, THR, b);
    }
    assert_eq!(read_n(&mut tty, 5, ARRIVES), b"ping\n", "raw: bytes cross unchanged");
    tty.write_all(b"pong\r\n").unwrap();
    assert_eq!(guest_read_n(&rig, 0, 6, ARRIVES), b"pong\r\n");
    // 64 KiB host to guest through the terminal, paced by the guest (the guest-to-host
    // direction in volume is covered by tests/guest_mtty.rs).
    let data: Vec<u8> = (0..65536u32).map(|i| (i * 7 + i / 256) as u8).collect();
    let writer = {
        let mut tty = tty.try_clone().unwrap();
        let data = data.clone();
        std::thread::spawn(move || {
            let mut sent = 0;
            while sent < data.len() {
                match tty.write(&data[sent..]) {
                    Ok(n) => sent += n,
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                        std::thread::sleep(Duration::from_millis(1))
                    }
                    Err(e) => panic!("pty write: {e}"),
                }
            }
        })
    };
    let mut got = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(120);
    while got.len() < data.len() && Instant::now() < deadline {
        got.extend(guest_read_n(&rig, 0, data.len() - got.len(), ARRIVES));
    }
    writer.join().unwrap();
    assert!(got == data, "host to guest: {} of {} bytes intact", got.len(), data.len());
    assert_eq!(rig.stats(0).dropped, 0);
}

#[test]
fn a_hung_up_pty_is_held_again_and_raw_again() {
    use nix::sys::termios::{tcgetattr, LocalFlags};
    use std::io::Write;
    use std::os::fd::AsRawFd;
    use std::os::unix::fs::OpenOptionsExt;
    let rig = rig_with(&[Backend::Pty]);
    let path = rig.dev.function().lock().host_path(0).unwrap().to_path_buf();
    open_port(&rig, 0);
    let open = || {
        std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .custom_flags(libc::O_NOCTTY | libc::O_NONBLOCK)
            .open(&path)
            .unwrap()
    };
    // A program hangs the terminal up (as agetty does, or a session leader's exit): the
    // kernel resets its modes to cooked ones (ICANON, ECHO) and kills every open of it,
    // umdev's own too.
    let tty = open();
    // SAFETY: TIOCVHANGUP takes no argument; `tty` is an open terminal.
    assert_eq!(unsafe { libc::ioctl(tty.as_raw_fd(), libc::TIOCVHANGUP) }, 0);
    drop(tty);
    // umdev opens it again and makes it raw: a wait for that event (bounded), not a timing.
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut tty = loop {
        let tty = open();
        let modes = tcgetattr(&tty).unwrap();
        if !modes.local_flags.intersects(LocalFlags::ICANON | LocalFlags::ECHO) {
            break tty;
        }
        assert!(Instant::now() < deadline, "still cooked after a hang-up: {:?}", modes.local_flags);
        std::thread::sleep(Duration::from_millis(10));
    };
    for &b in b"a\n" {
        rig.outb(0, THR, b);
    }
    assert_eq!(read_n(&mut tty, 2, ARRIVES), b"a\n", "raw again: no CR added");
    tty.write_all(b"b\n").unwrap();
    assert_eq!(
        guest_read_n(&rig, 0, 2, ARRIVES),
        b"b\n",
        "and no echo: the guest gets only the host's bytes"
    );
    drop(tty);
    // Nothing sent while no program has it open is lost: umdev holds it again.
    rig.outb(0, THR, b'c');
    assert_eq!(read_n(&mut open(), 1, ARRIVES), b"c");
}

#[test]
fn a_flooding_host_peer_changes_only_its_port() {
    use std::io::Write;
    use std::os::unix::net::UnixStream;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("flood.sock");
    let rig = rig_with(&[Backend::Loopback, Backend::Socket(path.clone())]);
    open_port(&rig, 0);
    open_port(&rig, 1);
    let mut peer = UnixStream::connect(&path).unwrap();
    peer.set_nonblocking(true).unwrap();
    let chunk = [0x55u8; 65536];
    let mut sent = 0usize;
    let deadline = Instant::now() + Duration::from_secs(2);
    while Instant::now() < deadline && sent < 16 << 20 {
        match peer.write(&chunk) {
            Ok(n) => sent += n,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                std::thread::sleep(Duration::from_millis(10))
            }
            Err(e) => panic!("{e}"),
        }
    }
    assert!(
        sent < 4 << 20,
        "the port stopped reading: only socket buffers and its queue took bytes ({sent})"
    );
    // The other port is unaffected: not held up by the flooded one (a hang guard, not a
    // timing).
    let started = Instant::now();
    for i in 0..100u8 {
        rig.outb(0, THR, i);
        assert_eq!(rig.inb(0, RBR), i);
    }
    assert!(started.elapsed() < Duration::from_secs(30));
    // The flooded port delivers, paced by the guest, and nothing was dropped.
    assert_eq!(guest_read_n(&rig, 1, 1000, ARRIVES), vec![0x55; 1000]);
    assert_eq!(rig.stats(1).dropped, 0);
    // The peer closes in the middle of it all: everything it managed to send still reaches
    // the guest, whole; then the port serves the next peer.
    drop(peer);
    let mut received = 1000usize;
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        // Short: an empty read (with the peer gone) is how the drain is seen to end.
        let got = guest_read_n(&rig, 1, 4096, Duration::from_secs(5));
        assert!(got.iter().all(|&b| b == 0x55));
        received += got.len();
        if got.is_empty() && rig.dev.describe()["ports"][1]["host_connected"] == false {
            break;
        }
        assert!(Instant::now() < deadline, "the departed peer's bytes never drained");
    }
    assert_eq!(received, sent, "every byte the peer sent before it closed reached the guest");
    assert_eq!(rig.stats(1).dropped, 0);
    let mut next = UnixStream::connect(&path).unwrap();
    next.set_read_timeout(Some(Duration::from_millis(100))).unwrap();
    rig.outb(1, THR, b'?');
    assert_eq!(read_n(&mut next, 1, ARRIVES), b"?");
}

#[test]
fn a_host_peer_that_half_closes_gets_its_answer_and_loses_nothing() {
    use std::io::{Read, Write};
    use std::os::unix::net::UnixStream;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("half.sock");
    let rig = rig_with(&[Backend::Socket(path.clone())]);
    open_port(&rig, 0);
    let mut peer = UnixStream::connect(&path).unwrap();
    let request: Vec<u8> = (0..10_000u32).map(|i| (i % 251) as u8).collect();
    peer.write_all(&request).unwrap();
    // As `nc -N` or `socat` do at the end of their input: shut down writing, keep reading.
    peer.shutdown(std::net::Shutdown::Write).unwrap();
    assert!(guest_read_n(&rig, 0, request.len(), ARRIVES) == request, "the whole request");
    for &b in b"answer" {
        rig.outb(0, THR, b);
    }
    peer.set_read_timeout(Some(ARRIVES)).unwrap();
    let mut answer = [0u8; 6];
    peer.read_exact(&mut answer).unwrap();
    assert_eq!(&answer, b"answer", "a half-closed peer still gets the guest's output");
    // A peer that stops reading and closes with output queued: the output waits for the next.
    for &b in b"later" {
        rig.outb(0, THR, b);
    }
    drop(peer);
    std::thread::sleep(Duration::from_millis(100));
    let mut next = UnixStream::connect(&path).unwrap();
    next.set_read_timeout(Some(Duration::from_millis(200))).unwrap();
    // Short: nothing at all is an accepted outcome.
    let got = read_n(&mut next, 5, Duration::from_secs(5));
    assert!(got == b"later" || got.is_empty() || b"later".ends_with(&got), "{got:?}");
}

#[test]
fn a_relative_socket_path_is_refused_and_a_failed_create_leaves_no_socket() {
    assert!(Backend::parse("socket:tty.sock").unwrap_err().contains("absolute"));
    // Words in any case; a path as given.
    assert!(matches!(Backend::parse("PTY"), Ok(Backend::Pty)));
    assert!(
        matches!(Backend::parse("Socket:/A.sock"), Ok(Backend::Socket(p)) if p == std::path::Path::new("/A.sock"))
    );
    assert!(Backend::parse("pty:x").is_err() && Backend::parse("socket").is_err());
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("dup.sock");
    let same = Backend::Socket(path.clone());
    assert!(create_with(&[same.clone(), same]).is_err(), "two ports cannot share a socket");
    assert!(!path.exists(), "the first port's socket went with the failed device");
}
