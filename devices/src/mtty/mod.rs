//! `mtty`: a PCI serial card with one or two 16550A UARTs, after the kernel's
//! `samples/vfio-mdev/mtty.c`. Types `mtty-1` and `mtty-2` share a pool of 24 ports. The ABI
//! is in `docs/mtty.md`.
//!
//! The identity is the kernel sample's (WCH CH352, `4348:3253`), so a Linux guest's
//! `8250_pci` binds it as a 16550A the same way. Each port is an 8-byte I/O BAR holding the
//! usual register file: 16-byte FIFOs, real IIR priorities and read-to-clear rules, DLAB,
//! MCR loopback with the modem lines looped, break, and the FIFO character timeout.
//!
//! Each port's serial line goes where its [`Backend`] says: by default a loopback plug, so
//! that, as with the kernel sample, every byte the guest transmits comes back on the same
//! port; or nothing; or a host pseudo-terminal or UNIX socket, so a host program (a
//! terminal, a test) talks to the guest. The transmitter is infinitely fast while the line
//! takes its bytes; a host peer that does not read stalls it, as a real line with flow
//! control would.
//!
//! Interrupts: all ports share the function's one interrupt. After every register access
//! (and when a character timeout expires or a host peer moves bytes) the device recomputes
//! each port's enabled, pending conditions: INTx is a level asserted while any is pending;
//! with MSI enabled, every condition that became pending raises a message. The character
//! timeout runs on a small timer thread; each host peer has a thread of its own.

mod backend;
#[cfg(test)]
mod tests;
mod uart;

use std::path::PathBuf;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use thiserror::Error;

pub use backend::Backend;
use backend::{Endpoint, HostThread};
pub use uart::PortStats;
use uart::{HostLine, Line, Uart};

use umdev_mdev::irq::{IrqHandle, IrqMode};
use umdev_mdev::pci::{
    Bar, ClassCode, ConfigSpaceBuilder, MsiCap, PciDevice, PciDeviceError, PciIds, Reg, RegMap, Shared,
    SharedRef, SimpleFunction, Waker, WeakShared,
};
use umdev_mdev::types::{
    parse_options, DeviceType, InstanceOptions, OptionSpec, Pool, TypeError, ValueSyntax,
};
use umdev_mdev::{DeviceError, VfioDevice};

/// Type name of the one-port card.
pub const TYPE_1: &str = "mtty-1";
/// Type name of the two-port card.
pub const TYPE_2: &str = "mtty-2";
/// Ports shared by all mtty instances of a registry (the kernel sample's `MAX_MTTYS`).
pub const MAX_PORTS: u32 = 24;
/// PCI vendor ID (WCH).
pub const VENDOR_ID: u16 = 0x4348;
/// PCI device ID (CH352 2S).
pub const DEVICE_ID: u16 = 0x3253;
/// PCI revision ID.
pub const REVISION: u8 = 0x10;
/// Each port's I/O BAR: 8 bytes.
pub const PORT_BAR_SIZE: u64 = 8;
/// Depth of each receive and transmit FIFO.
pub const FIFO_SIZE: usize = 16;
/// Bytes queued per port and direction between the UART and a host peer.
pub const HOST_QUEUE: usize = 4096;
/// A receiver the guest neither reads nor takes interrupts from for this long is ignored:
/// host bytes then arrive as on a real line, and overrun.
pub const IGNORED_AFTER: Duration = Duration::from_secs(1);
/// The UART's input clock: 16 × 115200 Hz, the `base_baud` 8250_pci assumes for this card.
pub const UART_CLOCK_HZ: u64 = 1_843_200;

/// Register offsets in a port's BAR, and their bits (the names of Linux's `serial_reg.h`).
pub mod regs {
    /// RBR (read): the next received byte. With DLAB: DLL.
    pub const RBR: u64 = 0;
    /// THR (write): the byte to transmit. With DLAB: DLL.
    pub const THR: u64 = 0;
    /// DLL (DLAB set): divisor latch, low byte.
    pub const DLL: u64 = 0;
    /// IER: interrupt enable. With DLAB: DLM.
    pub const IER: u64 = 1;
    /// DLM (DLAB set): divisor latch, high byte.
    pub const DLM: u64 = 1;
    /// IIR (read): interrupt identification.
    pub const IIR: u64 = 2;
    /// FCR (write): FIFO control.
    pub const FCR: u64 = 2;
    /// LCR: line control.
    pub const LCR: u64 = 3;
    /// MCR: modem control.
    pub const MCR: u64 = 4;
    /// LSR (read-only): line status.
    pub const LSR: u64 = 5;
    /// MSR (read-only): modem status.
    pub const MSR: u64 = 6;
    /// SCR: scratch.
    pub const SCR: u64 = 7;

    /// IER: received data available (and character timeout).
    pub const IER_RDI: u8 = 0x01;
    /// IER: transmitter holding register empty.
    pub const IER_THRI: u8 = 0x02;
    /// IER: receiver line status.
    pub const IER_RLSI: u8 = 0x04;
    /// IER: modem status.
    pub const IER_MSI: u8 = 0x08;

    /// IIR: no interrupt pending.
    pub const IIR_NO_INT: u8 = 0x01;
    /// IIR: modem status (lowest priority).
    pub const IIR_MSI: u8 = 0x00;
    /// IIR: transmitter holding register empty.
    pub const IIR_THRI: u8 = 0x02;
    /// IIR: received data available (at the trigger level).
    pub const IIR_RDI: u8 = 0x04;
    /// IIR: receiver line status (highest priority).
    pub const IIR_RLSI: u8 = 0x06;
    /// IIR: character timeout (data below the trigger level, no activity for 4 characters).
    pub const IIR_TIMEOUT: u8 = 0x0c;
    /// IIR: the interrupt ID bits.
    pub const IIR_ID_MASK: u8 = 0x0f;
    /// IIR: both bits set while the FIFOs are enabled.
    pub const IIR_FIFO_ENABLED: u8 = 0xc0;

    /// FCR: enable the FIFOs (other bits are ignored without it).
    pub const FCR_ENABLE: u8 = 0x01;
    /// FCR: clear the receive FIFO (self-clearing).
    pub const FCR_CLEAR_RX: u8 = 0x02;
    /// FCR: clear the transmit FIFO (self-clearing).
    pub const FCR_CLEAR_TX: u8 = 0x04;
    /// FCR: DMA mode select (stored, no effect).
    pub const FCR_DMA_SELECT: u8 = 0x08;
    /// FCR: receive trigger level bits.
    pub const FCR_TRIGGER_MASK: u8 = 0xc0;
    /// FCR: trigger at 1 byte.
    pub const FCR_TRIGGER_1: u8 = 0x00;
    /// FCR: trigger at 4 bytes.
    pub const FCR_TRIGGER_4: u8 = 0x40;
    /// FCR: trigger at 8 bytes.
    pub const FCR_TRIGGER_8: u8 = 0x80;
    /// FCR: trigger at 14 bytes.
    pub const FCR_TRIGGER_14: u8 = 0xc0;

    /// LCR: word length bits (0: 5 bits ... 3: 8 bits).
    pub const LCR_WLEN_MASK: u8 = 0x03;
    /// LCR: 8-bit words.
    pub const LCR_WLEN8: u8 = 0x03;
    /// LCR: 2 stop bits (1.5 with 5-bit words).
    pub const LCR_STOP: u8 = 0x04;
    /// LCR: parity enable.
    pub const LCR_PARITY: u8 = 0x08;
    /// LCR: set break (the transmitter holds the line at space).
    pub const LCR_SBC: u8 = 0x40;
    /// LCR: divisor latch access.
    pub const LCR_DLAB: u8 = 0x80;

    /// MCR: DTR output.
    pub const MCR_DTR: u8 = 0x01;
    /// MCR: RTS output.
    pub const MCR_RTS: u8 = 0x02;
    /// MCR: OUT1 output.
    pub const MCR_OUT1: u8 = 0x04;
    /// MCR: OUT2 output.
    pub const MCR_OUT2: u8 = 0x08;
    /// MCR: loopback.
    pub const MCR_LOOP: u8 = 0x10;
    /// MCR: the bits a 16550A implements (the rest read 0).
    pub const MCR_MASK: u8 = 0x1f;

    /// LSR: data ready.
    pub const LSR_DR: u8 = 0x01;
    /// LSR: overrun error (cleared by reading LSR).
    pub const LSR_OE: u8 = 0x02;
    /// LSR: break interrupt (a break character is at the top of the receive FIFO).
    pub const LSR_BI: u8 = 0x10;
    /// LSR: transmitter holding register (TX FIFO) empty.
    pub const LSR_THRE: u8 = 0x20;
    /// LSR: transmitter empty.
    pub const LSR_TEMT: u8 = 0x40;
    /// LSR: an error (here: a break) is somewhere in the receive FIFO (FIFO mode).
    pub const LSR_FIFO_ERROR: u8 = 0x80;

    /// MSR: delta CTS.
    pub const MSR_DCTS: u8 = 0x01;
    /// MSR: delta DSR.
    pub const MSR_DDSR: u8 = 0x02;
    /// MSR: trailing edge of RI.
    pub const MSR_TERI: u8 = 0x04;
    /// MSR: delta DCD.
    pub const MSR_DDCD: u8 = 0x08;
    /// MSR: the delta bits (cleared by reading MSR).
    pub const MSR_DELTA_MASK: u8 = 0x0f;
    /// MSR: clear to send.
    pub const MSR_CTS: u8 = 0x10;
    /// MSR: data set ready.
    pub const MSR_DSR: u8 = 0x20;
    /// MSR: ring indicator.
    pub const MSR_RI: u8 = 0x40;
    /// MSR: data carrier detect.
    pub const MSR_DCD: u8 = 0x80;
}

use regs::*;

/// Why an mtty could not be created.
#[derive(Debug, Error)]
pub enum MttyError {
    /// Only 1 and 2 ports are offered.
    #[error("an mtty has 1 or 2 ports, not {0}")]
    Ports(usize),
    /// The PCI declaration was refused.
    #[error(transparent)]
    Pci(#[from] PciDeviceError),
    /// A port's host backend could not be opened.
    #[error("{0}")]
    Backend(String),
}

/// The config space of a card with `ports` ports: the kernel sample's identity, one 8-byte
/// I/O BAR per port, INTA# and a one-vector MSI capability.
pub fn config(ports: usize) -> Result<ConfigSpaceBuilder, MttyError> {
    if !(1..=2).contains(&ports) {
        return Err(MttyError::Ports(ports));
    }
    let ids = PciIds {
        vendor_id: VENDOR_ID,
        device_id: DEVICE_ID,
        subsystem_vendor_id: VENDOR_ID,
        subsystem_id: DEVICE_ID,
        revision: REVISION,
        // Simple communication controller / serial / 16550-compatible.
        class: ClassCode { base: 0x07, sub: 0x00, prog_if: 0x02 },
    };
    let mut builder = ConfigSpaceBuilder::new(ids);
    for bar in 0..ports {
        builder = builder.bar(bar, Bar::io(PORT_BAR_SIZE));
    }
    Ok(builder.interrupt_pin(1).msi(MsiCap { vectors: 1, per_vector_mask: false, addr64: true }))
}

/// An mtty card as the server serves it: the [`Mtty`] state, shared with its timer and
/// host threads.
pub type MttyDevice = PciDevice<Shared<Mtty>>;

/// A new card with `ports` (1 or 2) ports, each on a loopback line.
pub fn create(ports: usize) -> Result<MttyDevice, MttyError> {
    create_with(&vec![Backend::Loopback; ports])
}

/// A new card with one port per entry of `backends` (1 or 2).
pub fn create_with(backends: &[Backend]) -> Result<MttyDevice, MttyError> {
    let config = config(backends.len())?;
    PciDevice::try_new(config, |host| Mtty::start(host.irq, backends))
}

/// What a host peer's thread needs to know of its port before it polls.
#[derive(Clone, Copy, Debug)]
struct HostState {
    /// Bytes the queue toward the guest can take.
    room: usize,
    /// Bytes queued toward the host.
    to_host: usize,
    /// Host bytes wait for the receiver (tick the port).
    waiting: bool,
}

/// How one port is served.
#[derive(Debug)]
struct PortBackend {
    backend: Backend,
    /// The host path of a pty or socket.
    path: Option<PathBuf>,
    /// The thread serving a host peer.
    host: Option<HostThread>,
}

/// The mtty function: one or two 16550A ports. All its state is here, plain data: the
/// framework serializes the server's calls and its threads' (see [`Shared`]).
#[derive(Debug)]
pub struct Mtty {
    uarts: Vec<Uart>,
    ports: Vec<PortBackend>,
    /// Each port's 8 byte-wide registers (one map per port BAR); any access of 1 to 8 bytes
    /// is those byte accesses, lowest address first.
    maps: Vec<RegMap<u8>>,
    irq: IrqHandle,
    /// Wakes the timer thread (a nearer deadline).
    waker: Waker,
    /// The deadline the timer thread sleeps until (`None`: until woken).
    timer_sleep: Option<Instant>,
    timer: Option<JoinHandle<()>>,
}

impl Mtty {
    /// The state with its lines open, shared with its timer and host threads once those
    /// have started.
    fn start(irq: IrqHandle, backends: &[Backend]) -> Result<Shared<Mtty>, MttyError> {
        let now = Instant::now();
        let mut uarts = Vec::new();
        let mut endpoints = Vec::new();
        let mut ports = Vec::new();
        for backend in backends {
            let endpoint = Endpoint::open(backend)?;
            let (line, wake) = match backend {
                Backend::Loopback => (Line::Loopback, None),
                Backend::Null => (Line::Null, None),
                Backend::Queue => (Line::Host(HostLine::new(None)), None),
                Backend::Pty | Backend::Socket(_) => {
                    let wake = HostThread::wake_fd()?;
                    (Line::Host(HostLine::new(Some(wake.clone()))), Some(wake))
                }
            };
            uarts.push(Uart::new(line, now));
            let path = endpoint.as_ref().map(|e| e.path().to_path_buf());
            ports.push(PortBackend { backend: backend.clone(), path, host: None });
            endpoints.push((endpoint, wake));
        }
        let regs: Vec<Reg<u8>> = (0..PORT_BAR_SIZE as u8).map(|r| Reg::rw(r, u64::from(r))).collect();
        // One map per port's BAR, so a refused access names its own region.
        let maps = (0..uarts.len() as u32)
            .map(|bar| {
                RegMap::builder(bar, PORT_BAR_SIZE)
                    .unit(1)
                    .widths(&[1, 2, 3, 4, 5, 6, 7, 8])
                    .unaligned()
                    .build(&regs)
            })
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| MttyError::Backend(e.to_string()))?;
        let make = |waker| Mtty { uarts, ports, maps, irq, waker, timer_sleep: None, timer: None };
        let shared = Shared::closing(make, Mtty::close);
        for (port, (endpoint, wake)) in endpoints.into_iter().enumerate() {
            if let (Some(endpoint), Some(wake)) = (endpoint, wake) {
                let path = endpoint.path().display().to_string();
                let host = HostThread::start(shared.share(), port, endpoint, wake)?;
                let mut mtty = shared.lock();
                log::info!("mtty port {port}: {} at {path}", mtty.ports[port].backend.name());
                mtty.ports[port].host = Some(host);
            }
        }
        let timer_ref = shared.share();
        let timer = std::thread::Builder::new()
            .name("umdev-mtty-timer".into())
            .spawn(move || timer(&timer_ref))
            .map_err(|e| log::error!("mtty: cannot start the timer thread ({e}); no character timeouts"))
            .ok();
        shared.lock().timer = timer;
        Ok(shared)
    }

    /// The device is going: the host threads sleep in poll, so wake them to see it.
    fn close(&mut self) {
        for port in &self.ports {
            if let Some(host) = &port.host {
                host.wake();
            }
        }
    }

    /// Number of ports (1 or 2).
    pub fn ports(&self) -> usize {
        self.ports.len()
    }

    /// Port `port`'s backend.
    pub fn backend(&self, port: usize) -> Option<&Backend> {
        self.ports.get(port).map(|p| &p.backend)
    }

    /// The host path of port `port`'s pty or socket.
    pub fn host_path(&self, port: usize) -> Option<&std::path::Path> {
        self.ports.get(port)?.path.as_deref()
    }

    /// Port `port`'s line counters.
    pub fn stats(&self, port: usize) -> Option<PortStats> {
        self.uarts.get(port).map(|u| u.stats)
    }

    /// Recomputes the interrupt after any change: INTx follows the level; with MSI, every
    /// newly pending condition raises a message. Wakes the timer for a nearer deadline.
    fn update(&mut self) {
        let mut any = false;
        let mut new = false;
        for port in &mut self.uarts {
            let pending = port.pending();
            let mut fresh = pending & !port.last_pending;
            if port.thre_rearmed {
                fresh |= pending & IER_THRI;
            }
            new |= fresh != 0;
            any |= pending != 0;
            port.last_pending = pending;
            port.thre_rearmed = false;
        }
        // The level is kept in every mode, so INTx resumes correctly if MSI is disabled.
        if any {
            self.irq.intx_assert();
        } else {
            self.irq.intx_deassert();
        }
        if new && matches!(self.irq.mode(), IrqMode::Msi | IrqMode::Msix) {
            let delivery = self.irq.raise(0);
            log::trace!("mtty: MSI {delivery:?}");
        }
        let earliest = self.uarts.iter().filter_map(|p| p.rx_deadline).min();
        if let Some(deadline) = earliest {
            if self.timer_sleep.is_none_or(|sleep| deadline < sleep) {
                self.waker.wake();
            }
        }
    }

    /// Runs `f` on port `port`'s host line (if it has one) and recomputes the interrupt.
    fn with_host<R>(&mut self, port: usize, f: impl FnOnce(&mut Uart, Instant) -> R) -> Option<R> {
        let uart = self.uarts.get_mut(port)?;
        if !matches!(uart.line, Line::Host(_)) {
            return None;
        }
        let result = f(uart, Instant::now());
        self.update();
        Some(result)
    }

    fn host_state(&self, port: usize) -> HostState {
        match self.uarts.get(port).map(|u| (u, &u.line)) {
            Some((u, Line::Host(h))) => {
                HostState { room: u.host_room(), to_host: h.to_host.len(), waiting: u.host_waiting() }
            }
            _ => HostState { room: 0, to_host: 0, waiting: false },
        }
    }

    /// Queues what the host sent toward the guest, as much as fits; returns how much.
    fn host_send(&mut self, port: usize, bytes: &[u8]) -> usize {
        self.with_host(port, |uart, now| {
            let n = bytes.len().min(uart.host_room());
            let Line::Host(h) = &mut uart.line else { return 0 };
            h.to_guest.extend(&bytes[..n]);
            uart.feed_rx(now);
            n
        })
        .unwrap_or(0)
    }

    /// Copies the oldest bytes queued toward the host into `buf`; returns how many.
    fn host_peek(&self, port: usize, buf: &mut [u8]) -> usize {
        let Some(Line::Host(h)) = self.uarts.get(port).map(|u| &u.line) else { return 0 };
        let n = buf.len().min(h.to_host.len());
        for (dst, src) in buf.iter_mut().zip(h.to_host.iter()) {
            *dst = *src;
        }
        n
    }

    /// The host took `n` bytes: the transmitter may go on.
    fn host_consumed(&mut self, port: usize, n: usize) {
        self.with_host(port, |uart, now| {
            if let Line::Host(h) = &mut uart.line {
                h.to_host.drain(..n.min(h.to_host.len()));
            }
            uart.drain_tx(now);
        });
    }

    /// Re-checks a port whose receiver host bytes wait for.
    fn host_tick(&mut self, port: usize) {
        self.with_host(port, |uart, now| uart.feed_rx(now));
    }

    /// One access to port `bar`'s registers, then the interrupt is recomputed.
    fn access(
        &mut self,
        bar: u8,
        access: impl FnOnce(&RegMap<u8>, &mut Uart, Instant) -> Result<(), DeviceError>,
    ) -> Result<(), DeviceError> {
        let (Some(map), Some(uart)) = (self.maps.get(usize::from(bar)), self.uarts.get_mut(usize::from(bar)))
        else {
            return Err(DeviceError::NoSuchRegion(u32::from(bar)));
        };
        let result = access(map, uart, Instant::now());
        self.update();
        result
    }
}

/// The timer thread: expires character timeouts.
fn timer(shared: &SharedRef<Mtty>) {
    let mut mtty = shared.lock();
    while !shared.closed() {
        let now = Instant::now();
        let mut expired = false;
        for port in &mut mtty.uarts {
            expired |= port.expire(now);
        }
        if expired {
            mtty.update();
        }
        let next = mtty.uarts.iter().filter_map(|p| p.rx_deadline).min();
        mtty.timer_sleep = next;
        mtty = match next {
            Some(deadline) => shared.wait_timeout(mtty, deadline.saturating_duration_since(now)),
            None => shared.wait(mtty),
        };
    }
}

/// The in-process host side of a port whose backend is [`Backend::Queue`]: what a pty or
/// socket peer would do, as calls. A cheap handle; it does not keep the device alive.
#[derive(Clone, Debug)]
pub struct HostPort {
    mtty: WeakShared<Mtty>,
    port: usize,
}

impl HostPort {
    /// The host side of `port` of `device`, if its backend is [`Backend::Queue`].
    pub fn of(device: &MttyDevice, port: usize) -> Option<HostPort> {
        let function = device.function();
        matches!(function.lock().backend(port)?, Backend::Queue)
            .then(|| HostPort { mtty: function.weak(), port })
    }

    /// Sends bytes toward the guest, as many as the port takes (at most [`HOST_QUEUE`] the
    /// guest has not read, queued or in its receiver); returns how many.
    pub fn send(&self, bytes: &[u8]) -> usize {
        self.mtty.with(|m| m.host_send(self.port, bytes)).unwrap_or(0)
    }

    /// Takes every byte the guest transmitted that is queued for the host, oldest first.
    pub fn recv(&self) -> Vec<u8> {
        self.mtty
            .with(|m| {
                let mut buf = vec![0u8; HOST_QUEUE];
                let n = m.host_peek(self.port, &mut buf);
                m.host_consumed(self.port, n);
                buf.truncate(n);
                buf
            })
            .unwrap_or_default()
    }
}

impl SimpleFunction for Mtty {
    fn bar_read(&mut self, bar: u8, offset: u64, data: &mut [u8]) -> Result<(), DeviceError> {
        self.access(bar, |map, uart, now| {
            map.read(offset, data, |hit| u64::from(uart.read(u64::from(hit.key), now)))
        })
    }

    fn bar_write(&mut self, bar: u8, offset: u64, data: &[u8]) -> Result<(), DeviceError> {
        self.access(bar, |map, uart, now| {
            map.write(offset, data, |hit, value, _| uart.write(u64::from(hit.key), value as u8, now))
        })
    }

    fn reset(&mut self) {
        let now = Instant::now();
        self.uarts.iter_mut().for_each(|p| p.reset(now));
        self.update();
    }

    fn describe(&self) -> serde_json::Value {
        let ports: Vec<serde_json::Value> = self
            .ports
            .iter()
            .zip(&self.uarts)
            .enumerate()
            .map(|(i, (p, uart))| {
                let mut port =
                    serde_json::json!({ "port": i, "backend": p.backend.name(), "stats": uart.stats });
                if let Some(path) = &p.path {
                    port["path"] = path.display().to_string().into();
                }
                // Only a socket knows whether a host peer is there (umdev holds a pty open
                // itself, so a terminal program attached to it cannot be told apart).
                if let (Some(host), Backend::Socket(_)) = (&p.host, &p.backend) {
                    port["host_connected"] = host.connected().into();
                }
                port
            })
            .collect();
        serde_json::json!({ "ports": ports })
    }
}

impl Drop for Mtty {
    fn drop(&mut self) {
        // Every thread has let go of the state by now (see `Shared`): reap them.
        for port in &mut self.ports {
            port.host.take();
        }
        if let Some(timer) = self.timer.take().filter(|t| t.thread().id() != std::thread::current().id()) {
            if timer.join().is_err() {
                log::error!("mtty: the timer thread panicked");
            }
        }
    }
}

/// The `mtty-1` and `mtty-2` device types. Both draw on one [`Pool`] of ports, so each
/// shows `free ports / ports per card` available instances.
///
/// Options: `backend=SPEC` for every port, `port0=SPEC` and `port1=SPEC` for one, where
/// SPEC is `loopback` (the default), `null`, `pty` or `socket:PATH`.
#[derive(Debug)]
pub struct MttyType {
    pool: Arc<Pool>,
    ports: u32,
}

impl MttyType {
    /// The one-port type, drawing on `pool`.
    pub fn single(pool: Arc<Pool>) -> MttyType {
        MttyType { pool, ports: 1 }
    }

    /// The two-port type, drawing on `pool`.
    pub fn dual(pool: Arc<Pool>) -> MttyType {
        MttyType { pool, ports: 2 }
    }

    /// Ports per card.
    pub fn ports(&self) -> u32 {
        self.ports
    }

    /// The type's options (docs/mtty.md), as `umdev types -v` lists them.
    pub fn option_specs(&self) -> Vec<OptionSpec> {
        const BACKEND: ValueSyntax = ValueSyntax::Custom {
            syntax: "loopback|null|pty|socket:/PATH",
            check: |v| Backend::parse(v).map(drop),
        };
        let mut specs = vec![OptionSpec::new("backend", BACKEND, Some("loopback"), "every port's line")];
        specs.push(
            OptionSpec::new("port", BACKEND, None, "one port's line, over backend")
                .numbered(0, self.ports - 1),
        );
        specs
    }

    /// Each port's backend from the instance options.
    fn backends(&self, options: &InstanceOptions) -> Result<Vec<Backend>, TypeError> {
        let bad = |why: String| TypeError::BadOption { ty: self.name().into(), why };
        parse_options(&self.option_specs(), &options.params).map_err(bad)?;
        // Checked above: each value parses.
        let parse = |key: &str| {
            options.params.get(key).map(|v| Backend::parse(v).map_err(|e| bad(format!("{key}={v}: {e}"))))
        };
        let default = parse("backend").transpose()?.unwrap_or(Backend::Loopback);
        let backends: Vec<Backend> = (0..self.ports)
            .map(|p| Ok(parse(&format!("port{p}")).transpose()?.unwrap_or_else(|| default.clone())))
            .collect::<Result<_, TypeError>>()?;
        // A socket serves one port: two on one path would find it taken by the other.
        for (i, b) in backends.iter().enumerate() {
            if let Backend::Socket(path) = b {
                if let Some(j) =
                    backends[..i].iter().position(|a| matches!(a, Backend::Socket(q) if q == path))
                {
                    return Err(bad(format!(
                        "ports {j} and {i} would share the socket {}: each port needs its own (`backend` \
                         gives every port the same line; set port{j}=socket:PATH and port{i}=socket:PATH)",
                        path.display()
                    )));
                }
            }
        }
        Ok(backends)
    }
}

impl DeviceType for MttyType {
    fn name(&self) -> &str {
        if self.ports == 1 {
            TYPE_1
        } else {
            TYPE_2
        }
    }

    fn description(&self) -> &str {
        if self.ports == 1 {
            "Single port serial: a 16550A UART on an I/O BAR, INTx/MSI; loopback, pty or socket line"
        } else {
            "Dual port serial: two 16550A UARTs on I/O BARs, INTx/MSI; loopback, pty or socket lines"
        }
    }

    fn available_instances(&self) -> u32 {
        self.pool.free() / self.ports
    }

    fn options(&self) -> Vec<OptionSpec> {
        self.option_specs()
    }

    fn check(&self, options: &InstanceOptions) -> Result<(), TypeError> {
        self.backends(options).map(drop)
    }

    fn create(&self, options: &InstanceOptions) -> Result<Arc<dyn VfioDevice>, TypeError> {
        let backends = self.backends(options)?;
        self.pool.instance(self.name(), self.ports, || create_with(&backends))
    }
}
