//! The mtty card under arbitrary register traffic, host traffic, interrupt wiring and
//! resets: the harness of the `mtty` fuzz target (`fuzz/fuzz_targets/mtty.rs`) and of its
//! corpus replay.
//!
//! For fuzzers and their corpus replay; not API.
//!
//! [`run`] creates an `mtty-2` card in-process whose two ports' backends the input chooses
//! (loopback, null, or [`Backend::Queue`], whose host side the harness plays through
//! [`HostPort`]), applies the input's operations, and panics unless (docs/mtty.md):
//!
//! - a BAR access of 1 to 8 bytes inside a port's 8 bytes succeeds, and any other (0 bytes,
//!   more than 8, past the end, a BAR the card lacks) fails;
//! - every IIR read is a documented value: an identifier of the priority table in bits 3:0,
//!   bits 5:4 clear, bits 7:6 set exactly while the FIFOs are on;
//! - on a host-line port that was never in MCR loopback, what the guest reads from RBR
//!   while LSR says data is ready is what the host sent, in order: exactly the next byte
//!   while the port has lost none (its `dropped` count is 0) and the harness saw every RBR
//!   pop, so FIFO and device resets must give unread bytes back; after a loss, a
//!   subsequence (a byte may be lost by overrun, never invented, repeated or reordered);
//! - what the host receives is a subsequence of what the guest wrote to THR (with DLAB
//!   clear), each byte masked to the word length LCR held when it was written;
//! - after a device reset every port reads its documented reset values.
//!
//! None of the checks depends on time: the card's own timers (character timeout, the
//! ignored receiver) may fire or not during a run.
//!
//! Input layout: `config u8` (bits 1:0 port 0's backend, bits 3:2 port 1's: 0 loopback,
//! 1 null, 2 and 3 a host queue), then up to [`MAX_OPS`] operations of [`OP`] bytes `[kind,
//! a, b, c]` (see [`Op`]).

use umdev_devices::mtty::regs::{FCR_ENABLE, IIR, LCR, LCR_DLAB, LSR, LSR_DR, MCR, MCR_LOOP, MSR};
use umdev_devices::mtty::{create_with, Backend, HostPort, MttyDevice};
use umdev_mdev::VFIO_PCI_MSI_IRQ_INDEX as MSI;
use umdev_mdev::{IrqAction, IrqData, SetIrqs, VfioDevice};
use umdev_mdev::{VFIO_PCI_CONFIG_REGION_INDEX as CONFIG, VFIO_PCI_INTX_IRQ_INDEX as INTX};
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

/// Bytes of one operation.
pub const OP: usize = 4;
/// Operations an input applies at most.
pub const MAX_OPS: usize = 512;
/// A port's BAR size.
const PORT_BYTES: u64 = 8;

/// One operation, decoded from `[kind, a, b, c]`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[allow(missing_docs)] // each variant's documentation says what its fields hold
pub enum Op {
    /// A BAR write: region `a % 3` (2 is a BAR the card lacks), offset `(a >> 2) % 10`,
    /// `b % 10` bytes, byte `i` being `c + 59 i`.
    Write { region: u32, offset: u64, len: usize, c: u8 },
    /// A BAR read, as the write.
    Read { region: u32, offset: u64, len: usize },
    /// The guest drains port `a & 1` as a driver does: LCR's DLAB cleared first if set, then
    /// up to `b % 32 + 1` times LSR, and RBR while LSR says data is ready.
    Drain { port: usize, max: usize },
    /// The host sends `b % 64 + 1` bytes on port `a & 1` (the next values of a counter).
    Send { port: usize, len: usize },
    /// The host takes what port `a & 1` transmitted.
    Recv { port: usize },
    /// A config-space write of `[1, 2, 4][b % 3]` bytes of `c` at offset `a`.
    Config { offset: u64, len: usize, c: u8 },
    /// DEVICE_RESET, then the reset values checked.
    Reset,
    /// SET_IRQS: `a % 4` picks wiring an INTx eventfd, wiring an MSI eventfd, unmasking
    /// INTx, or unwiring INTx.
    Irqs { which: u8 },
}

impl Op {
    /// Decodes one operation.
    pub fn decode(bytes: [u8; OP]) -> Op {
        let [kind, a, b, c] = bytes;
        let region = u32::from(a % 3);
        let offset = u64::from(a >> 2) % 10;
        let len = usize::from(b % 10);
        let port = usize::from(a & 1);
        match kind % 8 {
            0 => Op::Write { region, offset, len, c },
            1 => Op::Read { region, offset, len },
            2 => Op::Drain { port, max: usize::from(b % 32) + 1 },
            3 => Op::Send { port, len: usize::from(b % 64) + 1 },
            4 => Op::Recv { port },
            5 => Op::Config { offset: u64::from(a), len: [1, 2, 4][usize::from(b % 3)], c },
            6 => Op::Reset,
            _ => Op::Irqs { which: a % 4 },
        }
    }

    /// Its bytes (the inverse of [`Op::decode`] for the values it produces).
    pub fn encode(self) -> [u8; OP] {
        let (kind, a, b, c) = match self {
            Op::Write { region, offset, len, c } => (0, region as u8 | (offset as u8) << 2, len as u8, c),
            Op::Read { region, offset, len } => (1, region as u8 | (offset as u8) << 2, len as u8, 0),
            Op::Drain { port, max } => (2, port as u8, (max - 1) as u8, 0),
            Op::Send { port, len } => (3, port as u8, (len - 1) as u8, 0),
            Op::Recv { port } => (4, port as u8, 0, 0),
            Op::Config { offset, len, c } => (5, offset as u8, [0, 0, 1, 1, 2][len], c),
            Op::Reset => (6, 0, 0, 0),
            Op::Irqs { which } => (7, which, 0, 0),
        };
        [kind, a, b, c]
    }
}

/// What the harness knows of a port from what the guest wrote.
#[derive(Debug, Default)]
struct Port {
    host: Option<HostPort>,
    /// LCR as last written.
    lcr: u8,
    /// FIFOs on, as last written to FCR.
    fifo: bool,
    /// MCR loopback was ever on: the receiver may hold the port's own bytes.
    internal: bool,
    /// A read popped RBR without the harness looking (a wide read over offset 0).
    unobserved: bool,
    /// Bytes the host sent (and the queue took), in order.
    sent: Vec<u8>,
    /// How far into `sent` the guest's reads have matched.
    read_upto: usize,
    /// Bytes written to THR with DLAB clear, masked to the word length.
    transmitted: Vec<u8>,
    /// How far into `transmitted` the host's receptions have matched.
    received_upto: usize,
}

/// Advances `upto` past the first match of `byte` in `from[*upto..]`; panics if none.
fn subsequence(from: &[u8], upto: &mut usize, byte: u8, what: &str) {
    match from[*upto..].iter().position(|&b| b == byte) {
        Some(i) => *upto += i + 1,
        None => panic!("{what}: byte {byte:#04x} was never sent at or after position {upto}", upto = *upto),
    }
}

struct Harness {
    dev: MttyDevice,
    ports: [Port; 2],
    counter: u8,
    /// Eventfds wired, kept open while wired.
    fds: Vec<EventFd>,
}

impl Harness {
    fn new(config: u8) -> Harness {
        let backend = |bits: u8| match bits & 3 {
            0 => Backend::Loopback,
            1 => Backend::Null,
            _ => Backend::Queue,
        };
        let dev = create_with(&[backend(config), backend(config >> 2)]).expect("an mtty-2 card");
        let ports = [0, 1].map(|p| Port { host: HostPort::of(&dev, p), ..Port::default() });
        Harness { dev, ports, counter: 0, fds: Vec::new() }
    }

    /// The effect of a guest byte write of `value` at register `reg` of `port`, as the
    /// harness tracks it.
    fn wrote(&mut self, port: usize, reg: u64, value: u8) {
        let p = &mut self.ports[port];
        match reg {
            0 if p.lcr & LCR_DLAB == 0 => p.transmitted.push(value & (0xff >> (3 - (p.lcr & 3)))),
            2 => p.fifo = value & FCR_ENABLE != 0,
            3 => p.lcr = value,
            4 if value & MCR_LOOP != 0 => p.internal = true,
            _ => {}
        }
    }

    /// Checks a byte read at register `reg` of `port`.
    fn read(&mut self, port: usize, reg: u64, value: u8) {
        if reg == 0 && self.ports[port].lcr & LCR_DLAB == 0 {
            self.ports[port].unobserved = true;
        }
        if reg == IIR {
            let id = value & 0x0f;
            assert!([0x01, 0x06, 0x04, 0x0c, 0x02, 0x00].contains(&id), "port {port}: IIR {value:#04x}");
            assert_eq!(value & 0x30, 0, "port {port}: IIR {value:#04x}");
            let fifo = if self.ports[port].fifo { 0xc0 } else { 0 };
            assert_eq!(value & 0xc0, fifo, "port {port}: IIR {value:#04x} with FIFOs on: {}", fifo != 0);
        }
    }

    /// A 1-byte read of a register other than RBR (see [`Harness::rbr`]).
    fn inb(&mut self, port: usize, reg: u64) -> u8 {
        let mut b = [0u8];
        self.dev.region_read(port as u32, reg, &mut b).expect("a 1-byte read inside the BAR");
        self.read(port, reg, b[0]);
        b[0]
    }

    /// A 1-byte read of RBR (DLAB clear), which the harness looks at.
    fn rbr(&self, port: usize) -> u8 {
        let mut b = [0u8];
        self.dev.region_read(port as u32, 0, &mut b).expect("a 1-byte read inside the BAR");
        b[0]
    }

    /// Bytes the port's receiver lost (overruns), from the card's counters.
    fn dropped(&self, port: usize) -> u64 {
        self.dev.function().lock().stats(port).map_or(0, |s| s.dropped)
    }

    fn outb(&mut self, port: usize, reg: u64, value: u8) {
        self.dev.region_write(port as u32, reg, &[value]).expect("a 1-byte write inside the BAR");
        self.wrote(port, reg, value);
    }

    fn apply(&mut self, op: Op) {
        match op {
            Op::Write { region, offset, len, c } => {
                let data: Vec<u8> = (0..len).map(|i| c.wrapping_add(59u8.wrapping_mul(i as u8))).collect();
                if accepted(op, region, offset, len, self.dev.region_write(region, offset, &data)) {
                    for (i, &v) in data.iter().enumerate() {
                        self.wrote(region as usize, offset + i as u64, v);
                    }
                }
            }
            Op::Read { region, offset, len } => {
                let mut data = vec![0u8; len];
                if accepted(op, region, offset, len, self.dev.region_read(region, offset, &mut data)) {
                    for (i, &v) in data.iter().enumerate() {
                        self.read(region as usize, offset + i as u64, v);
                    }
                }
            }
            Op::Drain { port, max } => {
                let lcr = self.ports[port].lcr;
                if lcr & LCR_DLAB != 0 {
                    self.outb(port, LCR, lcr & !LCR_DLAB);
                }
                for _ in 0..max {
                    if self.inb(port, LSR) & LSR_DR == 0 {
                        break;
                    }
                    let byte = self.rbr(port);
                    let exact = self.dropped(port) == 0;
                    let p = &mut self.ports[port];
                    if p.host.is_some() && !p.internal {
                        if exact && !p.unobserved {
                            let next = p.sent.get(p.read_upto).copied();
                            assert_eq!(
                                Some(byte),
                                next,
                                "port {port}: the guest read byte {} of what the host sent, nothing lost",
                                p.read_upto
                            );
                            p.read_upto += 1;
                        } else {
                            subsequence(
                                &p.sent,
                                &mut p.read_upto,
                                byte,
                                &format!("port {port}: the guest read"),
                            );
                        }
                    }
                }
            }
            Op::Send { port, len } => {
                let Some(host) = self.ports[port].host.clone() else { return };
                let bytes: Vec<u8> = (0..len).map(|i| self.counter.wrapping_add(i as u8)).collect();
                let taken = host.send(&bytes);
                assert!(taken <= bytes.len());
                self.counter = self.counter.wrapping_add(taken as u8);
                self.ports[port].sent.extend_from_slice(&bytes[..taken]);
            }
            Op::Recv { port } => {
                let Some(host) = self.ports[port].host.clone() else { return };
                let p = &mut self.ports[port];
                for byte in host.recv() {
                    subsequence(
                        &p.transmitted,
                        &mut p.received_upto,
                        byte,
                        &format!("port {port}: the host got"),
                    );
                }
            }
            Op::Config { offset, len, c } => {
                // Whatever config space does with it, it answers.
                let _ = self.dev.region_write(CONFIG, offset, &vec![c; len]);
            }
            Op::Reset => {
                self.dev.reset().expect("a reset");
                for port in 0..2 {
                    let p = &mut self.ports[port];
                    (p.lcr, p.fifo) = (0, false);
                    for (reg, value) in [(1, 0), (IIR, 0x01), (LCR, 0), (MCR, 0), (7, 0)] {
                        assert_eq!(self.inb(port, reg), value, "port {port}: register {reg} after reset");
                    }
                    // Host bytes may be waiting in the receiver already (DR).
                    assert_eq!(self.inb(port, LSR) & !LSR_DR, 0x60, "port {port}: LSR after reset");
                    assert_eq!(self.inb(port, MSR), 0xb3, "port {port}: MSR's first read after reset");
                }
            }
            Op::Irqs { which } => {
                let (index, action, wire) = match which {
                    0 => (INTX, IrqAction::Trigger, true),
                    1 => (MSI, IrqAction::Trigger, true),
                    2 => (INTX, IrqAction::Unmask, false),
                    _ => (INTX, IrqAction::Trigger, false),
                };
                let data = if wire {
                    let fd = EventFd::new(EFD_NONBLOCK).expect("an eventfd");
                    let data = IrqData::Eventfds(vec![fd.try_clone().expect("a dup")]);
                    self.fds.push(fd);
                    data
                } else if action == IrqAction::Unmask {
                    IrqData::None
                } else {
                    IrqData::Eventfds(Vec::new())
                };
                let _ = self.dev.set_irqs(SetIrqs { index, start: 0, count: 1, action, data });
                // Drain what fired, so no counter fills.
                for fd in &self.fds {
                    let _ = fd.read();
                }
            }
        }
    }
}

/// Whether a BAR access of `len` bytes at `offset` of `region` is one the doc accepts.
fn valid(region: u32, offset: u64, len: usize) -> bool {
    region < 2 && (1..=8).contains(&len) && offset + len as u64 <= PORT_BYTES
}

/// Checks the outcome of `op`, an access of `len` bytes at `offset` of `region`: done if the
/// doc accepts it (then true), refused otherwise (then false).
fn accepted<E: std::fmt::Display>(
    op: Op,
    region: u32,
    offset: u64,
    len: usize,
    result: Result<(), E>,
) -> bool {
    if valid(region, offset, len) {
        result.unwrap_or_else(|e| panic!("{op:?} refused: {e}"));
        true
    } else {
        assert!(result.is_err(), "{op:?} accepted");
        false
    }
}

/// Runs one input (see the module documentation).
pub fn run(data: &[u8]) {
    let Some((&config, ops)) = data.split_first() else { return };
    let mut harness = Harness::new(config);
    for chunk in ops.chunks_exact(OP).take(MAX_OPS) {
        harness.apply(Op::decode(chunk.try_into().expect("OP bytes")));
    }
}

/// Hand-made inputs: a driver's setup and traffic both ways on a host line, with FIFO
/// resets and a device reset between; loopback with a break; odd accesses.
pub fn seeds() -> Vec<(&'static str, Vec<u8>)> {
    let input = |config: u8, ops: &[Op]| {
        let mut bytes = vec![config];
        bytes.extend(ops.iter().flat_map(|op| op.encode()));
        bytes
    };
    let w = |offset: u64, c: u8| Op::Write { region: 0, offset, len: 1, c };
    let setup = [w(3, 0x83), w(0, 1), w(1, 0), w(3, 0x03), w(2, 0x07), w(4, 0x0b), w(1, 0x0f)];
    let mut host = setup.to_vec();
    host.extend([
        Op::Send { port: 0, len: 40 },
        Op::Drain { port: 0, max: 5 },
        w(2, 0x01),
        w(2, 0x07),
        w(2, 0x00),
        w(2, 0xc1),
        Op::Drain { port: 0, max: 32 },
        Op::Send { port: 0, len: 20 },
        Op::Reset,
        w(3, 0x03),
        Op::Drain { port: 0, max: 32 },
        w(0, b'h'),
        w(0, b'i'),
        Op::Recv { port: 0 },
        Op::Irqs { which: 0 },
        Op::Config { offset: 4, len: 2, c: 0x05 },
        Op::Read { region: 0, offset: 0, len: 8 },
    ]);
    let mut looped = setup.to_vec();
    looped.extend([
        w(4, MCR_LOOP),
        w(0, b'x'),
        w(3, 0x43),
        w(3, 0x03),
        Op::Drain { port: 0, max: 4 },
        Op::Irqs { which: 1 },
        Op::Config { offset: 0x42, len: 2, c: 0x01 },
        Op::Write { region: 0, offset: 0, len: 8, c: 0x41 },
    ]);
    let odd = [
        Op::Write { region: 0, offset: 7, len: 2, c: 1 },
        Op::Read { region: 1, offset: 0, len: 0 },
        Op::Read { region: 2, offset: 0, len: 1 },
        Op::Read { region: 1, offset: 9, len: 9 },
    ];
    vec![
        ("host-line", input(0b1010, &host)),
        ("loopback", input(0b0100, &looped)),
        ("odd-accesses", input(0b0001, &odd)),
    ]
}
