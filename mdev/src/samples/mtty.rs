//! `mtty`: a PCI serial card with one or two 16550A UARTs, after the kernel's
//! `samples/vfio-mdev/mtty.c`, but a real 16550A where that sample has quirks. Types
//! `mtty-1` and `mtty-2` share a pool of 24 ports. The ABI is in `docs/mtty.md`.
//!
//! The identity is the kernel sample's (WCH CH352, `4348:3253`), so a Linux guest's
//! `8250_pci` binds it as a 16550A the same way. Each port is an 8-byte I/O BAR holding the
//! usual register file: 16-byte FIFOs, real IIR priorities and read-to-clear rules, DLAB,
//! loopback with the modem lines looped, and the FIFO character timeout.
//!
//! Two modelling choices keep the device deterministic:
//! - the transmitter is infinitely fast: a byte written to THR leaves the port (or, in
//!   loopback, arrives on the receiver) before the write completes, so THRE and TEMT read 1
//!   after every access;
//! - outside loopback nothing arrives on the receiver; transmitted bytes go to a bounded
//!   per-port [`PortOutput`] buffer that tests and a console backend read.
//!
//! Interrupts: all ports share the function's one interrupt. After every register access
//! (and when a character timeout expires) the device recomputes each port's enabled,
//! pending conditions: INTx is a level asserted while any is pending; with MSI enabled,
//! every condition that became pending raises a message. The character timeout runs on a
//! small timer thread, the only thing that changes state outside an access.

use std::collections::VecDeque;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use thiserror::Error;

use crate::device::{DeviceError, VfioDevice};
use crate::irq::{IrqHandle, IrqMode};
use crate::pci::{Bar, ClassCode, ConfigSpaceBuilder, PciDevice, PciDeviceError, PciFunction, PciIds};
use crate::types::{DeviceType, InstanceOptions, Pool, Reserved, TypeError};

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
/// Bytes kept per port in the [`PortOutput`] buffer; older bytes are dropped.
pub const OUTPUT_CAPACITY: usize = 4096;
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
    /// LSR: transmitter holding register (TX FIFO) empty.
    pub const LSR_THRE: u8 = 0x20;
    /// LSR: transmitter empty.
    pub const LSR_TEMT: u8 = 0x40;

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

/// The modem inputs outside loopback: an always-ready peer (CTS, DSR and DCD, no RI).
const IDLE_MODEM_INPUTS: u8 = MSR_CTS | MSR_DSR | MSR_DCD;

/// Why an mtty could not be created.
#[derive(Debug, Error)]
pub enum MttyError {
    /// Only 1 and 2 ports are offered.
    #[error("an mtty has 1 or 2 ports, not {0}")]
    Ports(usize),
    /// The PCI declaration was refused.
    #[error(transparent)]
    Pci(#[from] PciDeviceError),
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
    Ok(builder.interrupt_pin(1).msi(1, false, true))
}

/// A new card with `ports` (1 or 2) ports, ready to attach.
pub fn create(ports: usize) -> Result<PciDevice<Mtty>, MttyError> {
    let config = config(ports)?;
    Ok(PciDevice::new(config, |irq| Mtty::new(irq, ports))?)
}

/// Counters of a port's output.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct OutputStats {
    /// Bytes that left the port since the device was created.
    pub transmitted: u64,
    /// Bytes dropped from the buffer, unread, to make room for newer ones.
    pub dropped: u64,
    /// Bytes in the buffer now.
    pub buffered: usize,
}

#[derive(Debug, Default)]
struct OutputBuf {
    bytes: VecDeque<u8>,
    transmitted: u64,
    dropped: u64,
}

/// The bytes a port transmitted outside loopback: the last [`OUTPUT_CAPACITY`] of them,
/// oldest dropped first. A cheap handle; clones share the buffer. Device reset keeps it
/// (the bytes already left the UART).
#[derive(Clone, Debug, Default)]
pub struct PortOutput {
    inner: Arc<Mutex<OutputBuf>>,
}

impl PortOutput {
    fn lock(&self) -> MutexGuard<'_, OutputBuf> {
        // A byte queue and two counters: consistent after any panic of a holder.
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn push(&self, byte: u8) {
        let mut out = self.lock();
        if out.bytes.len() >= OUTPUT_CAPACITY {
            out.bytes.pop_front();
            out.dropped += 1;
        }
        out.bytes.push_back(byte);
        out.transmitted += 1;
    }

    /// Takes the buffered bytes, oldest first, leaving the buffer empty.
    pub fn take(&self) -> Vec<u8> {
        self.lock().bytes.drain(..).collect()
    }

    /// The counters.
    pub fn stats(&self) -> OutputStats {
        let out = self.lock();
        OutputStats { transmitted: out.transmitted, dropped: out.dropped, buffered: out.bytes.len() }
    }
}

/// One 16550A.
#[derive(Debug)]
struct Uart {
    rx: VecDeque<u8>,
    tx: VecDeque<u8>,
    /// What RBR returns once the receiver is empty: the last byte read.
    rbr: u8,
    ier: u8,
    lcr: u8,
    mcr: u8,
    /// FIFO enable, DMA select and trigger bits as last programmed.
    fcr: u8,
    scr: u8,
    divisor: u16,
    overrun: bool,
    /// The THRE interrupt source: set when the transmitter empties (or THRI is enabled
    /// while it is empty); cleared by writing THR or by an IIR read that reports it.
    thre: bool,
    /// Modem inputs (MSR bits 4-7) and their deltas (bits 0-3).
    msr: u8,
    msr_delta: u8,
    /// The character timeout: its deadline while armed, and whether it expired.
    rx_deadline: Option<Instant>,
    rx_timeout: bool,
    /// Enabled conditions pending after the last recompute (IER bits), for MSI edges.
    last_pending: u8,
    /// THRE was cleared and set again within this access (a THR write).
    thre_rearmed: bool,
    output: PortOutput,
}

impl Uart {
    /// The power-on state, writing to `output`.
    fn new(output: PortOutput) -> Uart {
        Uart {
            rx: VecDeque::with_capacity(FIFO_SIZE),
            tx: VecDeque::with_capacity(FIFO_SIZE),
            rbr: 0,
            ier: 0,
            lcr: 0,
            mcr: 0,
            fcr: 0,
            scr: 0,
            divisor: 0,
            overrun: false,
            thre: false,
            msr: IDLE_MODEM_INPUTS,
            msr_delta: 0,
            rx_deadline: None,
            rx_timeout: false,
            last_pending: 0,
            thre_rearmed: false,
            output,
        }
    }

    fn fifo_enabled(&self) -> bool {
        self.fcr & FCR_ENABLE != 0
    }

    fn dlab(&self) -> bool {
        self.lcr & LCR_DLAB != 0
    }

    fn loopback(&self) -> bool {
        self.mcr & MCR_LOOP != 0
    }

    /// Bytes each FIFO holds: 16, or the holding register alone in 16450 mode.
    fn fifo_depth(&self) -> usize {
        if self.fifo_enabled() {
            FIFO_SIZE
        } else {
            1
        }
    }

    /// The receive trigger level.
    fn trigger(&self) -> usize {
        match self.fcr & FCR_TRIGGER_MASK {
            FCR_TRIGGER_1 => 1,
            FCR_TRIGGER_4 => 4,
            FCR_TRIGGER_8 => 8,
            _ => 14,
        }
    }

    /// Received data available: at the trigger level (FIFO mode) or any byte (16450 mode).
    fn rx_ready(&self) -> bool {
        if self.fifo_enabled() {
            self.rx.len() >= self.trigger()
        } else {
            !self.rx.is_empty()
        }
    }

    /// The interrupt conditions pending, enabled or not, as IER bits.
    fn conditions(&self) -> u8 {
        let mut conditions = 0;
        if self.rx_ready() || self.rx_timeout {
            conditions |= IER_RDI;
        }
        if self.thre {
            conditions |= IER_THRI;
        }
        if self.overrun {
            conditions |= IER_RLSI;
        }
        if self.msr_delta != 0 {
            conditions |= IER_MSI;
        }
        conditions
    }

    /// The enabled conditions pending: the port requests an interrupt if any.
    fn pending(&self) -> u8 {
        self.conditions() & self.ier
    }

    fn iir(&self) -> u8 {
        let pending = self.pending();
        let id = if pending & IER_RLSI != 0 {
            IIR_RLSI
        } else if pending & IER_RDI != 0 {
            if self.rx_ready() {
                IIR_RDI
            } else {
                IIR_TIMEOUT
            }
        } else if pending & IER_THRI != 0 {
            IIR_THRI
        } else if pending & IER_MSI != 0 {
            IIR_MSI
        } else {
            IIR_NO_INT
        };
        if self.fifo_enabled() {
            id | IIR_FIFO_ENABLED
        } else {
            id
        }
    }

    fn lsr(&self) -> u8 {
        let mut lsr = 0;
        if !self.rx.is_empty() {
            lsr |= LSR_DR;
        }
        if self.overrun {
            lsr |= LSR_OE;
        }
        if self.tx.is_empty() {
            // The shift register empties with the FIFO: the transmitter is instantaneous.
            lsr |= LSR_THRE | LSR_TEMT;
        }
        lsr
    }

    /// Reads register `reg` (0-7) with its side effects.
    fn read(&mut self, reg: u64, now: Instant) -> u8 {
        match reg {
            RBR if self.dlab() => self.divisor as u8,
            RBR => {
                if let Some(byte) = self.rx.pop_front() {
                    self.rbr = byte;
                }
                self.rx_activity(now);
                self.rbr
            }
            IER if self.dlab() => (self.divisor >> 8) as u8,
            IER => self.ier,
            IIR => {
                let iir = self.iir();
                if iir & IIR_ID_MASK == IIR_THRI {
                    self.thre = false;
                }
                iir
            }
            LCR => self.lcr,
            MCR => self.mcr,
            LSR => {
                let lsr = self.lsr();
                self.overrun = false;
                lsr
            }
            MSR => self.msr | std::mem::take(&mut self.msr_delta),
            _ => self.scr,
        }
    }

    /// Writes register `reg` (0-7).
    fn write(&mut self, reg: u64, value: u8, now: Instant) {
        match reg {
            THR if self.dlab() => self.divisor = (self.divisor & 0xff00) | u16::from(value),
            THR => self.transmit(value, now),
            IER if self.dlab() => self.divisor = (self.divisor & 0x00ff) | (u16::from(value) << 8),
            IER => {
                let enabled = value & !self.ier;
                self.ier = value & 0x0f;
                // A 16550A raises THRE when THRI is enabled while the transmitter is empty
                // (Linux's startup THRE test relies on it).
                if enabled & IER_THRI != 0 && self.tx.is_empty() {
                    self.thre = true;
                }
                if self.ier & IER_THRI == 0 {
                    self.thre = false;
                }
            }
            FCR => self.write_fcr(value, now),
            LCR => self.lcr = value,
            MCR => {
                self.mcr = value & MCR_MASK;
                self.update_modem_inputs();
            }
            LSR | MSR => log::debug!("mtty: write of {value:#04x} to read-only register {reg} ignored"),
            _ => self.scr = value,
        }
    }

    fn write_fcr(&mut self, value: u8, now: Instant) {
        let was_enabled = self.fifo_enabled();
        if value & FCR_ENABLE == 0 {
            // Leaving FIFO mode empties both FIFOs; the other bits are not programmed.
            if was_enabled {
                self.rx.clear();
                self.tx.clear();
            }
            self.fcr = 0;
        } else {
            if !was_enabled || value & FCR_CLEAR_RX != 0 {
                self.rx.clear();
            }
            if !was_enabled || value & FCR_CLEAR_TX != 0 {
                self.tx.clear();
            }
            self.fcr = value & (FCR_ENABLE | FCR_DMA_SELECT | FCR_TRIGGER_MASK);
        }
        self.rx_activity(now);
    }

    /// A THR write: the byte enters the TX FIFO and the (instantaneous) transmitter sends
    /// it to the receiver in loopback, out of the port otherwise.
    fn transmit(&mut self, value: u8, now: Instant) {
        let byte = value & self.word_mask();
        self.thre = false;
        if self.tx.len() < self.fifo_depth() {
            self.tx.push_back(byte);
        }
        while let Some(byte) = self.tx.pop_front() {
            if self.loopback() {
                self.receive(byte, now);
            } else {
                self.output.push(byte);
            }
        }
        self.thre = true;
        self.thre_rearmed = true;
    }

    /// A byte arrives at the receiver.
    fn receive(&mut self, byte: u8, now: Instant) {
        if self.rx.len() < self.fifo_depth() {
            self.rx.push_back(byte);
        } else {
            self.overrun = true;
            if !self.fifo_enabled() {
                // 16450 mode: the new byte overwrites the unread one. In FIFO mode it is
                // the new byte that is lost.
                self.rx.clear();
                self.rx.push_back(byte);
            }
        }
        self.rx_activity(now);
    }

    /// The receiver FIFO was filled, read or cleared: restart the character timeout.
    fn rx_activity(&mut self, now: Instant) {
        self.rx_timeout = false;
        self.rx_deadline = (self.fifo_enabled() && !self.rx.is_empty()).then(|| now + self.char_timeout());
    }

    /// The timer's check: the character timeout expires at its deadline if data is still
    /// waiting. Returns whether it expired now.
    fn expire(&mut self, now: Instant) -> bool {
        match self.rx_deadline {
            Some(deadline) if deadline <= now => {
                self.rx_deadline = None;
                self.rx_timeout = !self.rx.is_empty();
                true
            }
            _ => false,
        }
    }

    /// Four character times at the programmed divisor and frame format.
    fn char_timeout(&self) -> Duration {
        // A divisor of 0 divides by 65536, as on real 8250s.
        let divisor = if self.divisor == 0 { 65536 } else { u64::from(self.divisor) };
        let data_bits = 5 + u64::from(self.lcr & LCR_WLEN_MASK);
        let parity = u64::from(self.lcr & LCR_PARITY != 0);
        let stop_half_bits = match (self.lcr & LCR_STOP != 0, data_bits) {
            (false, _) => 2,
            (true, 5) => 3,
            (true, _) => 4,
        };
        let half_bits = 2 * (1 + data_bits + parity) + stop_half_bits;
        // At most 4 * 24 * 65536 * 16e9: well within u64.
        let nanos = 4 * half_bits * divisor * 16 * 1_000_000_000 / (2 * UART_CLOCK_HZ);
        Duration::from_nanos(nanos)
    }

    fn word_mask(&self) -> u8 {
        0xff >> (3 - (self.lcr & LCR_WLEN_MASK))
    }

    /// Recomputes the modem inputs after MCR changed: in loopback they are the MCR
    /// outputs (RTS→CTS, DTR→DSR, OUT1→RI, OUT2→DCD), else the idle peer's.
    fn update_modem_inputs(&mut self) {
        let inputs = if self.loopback() {
            let mcr = self.mcr;
            let mut inputs = 0;
            for (output, input) in
                [(MCR_RTS, MSR_CTS), (MCR_DTR, MSR_DSR), (MCR_OUT1, MSR_RI), (MCR_OUT2, MSR_DCD)]
            {
                if mcr & output != 0 {
                    inputs |= input;
                }
            }
            inputs
        } else {
            IDLE_MODEM_INPUTS
        };
        let changed = inputs ^ self.msr;
        let mut delta = 0;
        for (input, delta_bit) in [(MSR_CTS, MSR_DCTS), (MSR_DSR, MSR_DDSR), (MSR_DCD, MSR_DDCD)] {
            if changed & input != 0 {
                delta |= delta_bit;
            }
        }
        if changed & MSR_RI != 0 && inputs & MSR_RI == 0 {
            delta |= MSR_TERI; // RI reports its trailing edge only
        }
        self.msr = inputs;
        self.msr_delta |= delta;
    }

    /// Back to the power-on state (the output buffer is kept).
    fn reset(&mut self) {
        *self = Uart::new(self.output.clone());
    }
}

/// All ports, under one lock: the interrupt is their OR.
#[derive(Debug)]
struct State {
    ports: Vec<Uart>,
    /// The deadline the timer thread sleeps until (`None`: until woken).
    timer_sleep: Option<Instant>,
    stop: bool,
}

#[derive(Debug)]
struct Shared {
    state: Mutex<State>,
    /// Wakes the timer thread: a nearer deadline, or stop.
    wake: Condvar,
    irq: IrqHandle,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        // Register values only: consistent after a panic of a holder.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Recomputes the interrupt after any change: INTx follows the level; with MSI, every
    /// newly pending condition raises a message. Wakes the timer for a nearer deadline.
    fn update(&self, st: &mut State) {
        let mut any = false;
        let mut new = false;
        for port in &mut st.ports {
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
        let earliest = st.ports.iter().filter_map(|p| p.rx_deadline).min();
        if let Some(deadline) = earliest {
            if st.timer_sleep.is_none_or(|sleep| deadline < sleep) {
                self.wake.notify_one();
            }
        }
    }
}

/// The timer thread: expires character timeouts.
fn timer(shared: &Shared) {
    let mut st = shared.lock();
    loop {
        if st.stop {
            return;
        }
        let now = Instant::now();
        let mut expired = false;
        for port in &mut st.ports {
            expired |= port.expire(now);
        }
        if expired {
            shared.update(&mut st);
        }
        let next = st.ports.iter().filter_map(|p| p.rx_deadline).min();
        st.timer_sleep = next;
        st = match next {
            Some(deadline) => {
                let wait = deadline.saturating_duration_since(now);
                match shared.wake.wait_timeout(st, wait) {
                    Ok((guard, _)) => guard,
                    Err(p) => p.into_inner().0,
                }
            }
            None => shared.wake.wait(st).unwrap_or_else(|p| p.into_inner()),
        };
    }
}

/// The mtty function: one or two 16550A ports (serve it through [`PciDevice`]; see
/// [`create`]).
#[derive(Debug)]
pub struct Mtty {
    shared: Arc<Shared>,
    outputs: Vec<PortOutput>,
    timer: Option<JoinHandle<()>>,
}

impl Mtty {
    fn new(irq: IrqHandle, ports: usize) -> Mtty {
        let outputs: Vec<PortOutput> = (0..ports).map(|_| PortOutput::default()).collect();
        let state = State {
            ports: outputs.iter().map(|o| Uart::new(o.clone())).collect(),
            timer_sleep: None,
            stop: false,
        };
        let shared = Arc::new(Shared { state: Mutex::new(state), wake: Condvar::new(), irq });
        let timer_shared = shared.clone();
        let timer = std::thread::Builder::new()
            .name("umdev-mtty-timer".into())
            .spawn(move || timer(&timer_shared))
            .map_err(|e| log::error!("mtty: cannot start the timer thread ({e}); no character timeouts"))
            .ok();
        Mtty { shared, outputs, timer }
    }

    /// Number of ports (1 or 2).
    pub fn ports(&self) -> usize {
        self.outputs.len()
    }

    /// Port `port`'s output: the bytes it transmitted outside loopback.
    pub fn output(&self, port: usize) -> Option<PortOutput> {
        self.outputs.get(port).cloned()
    }

    /// Runs `access` on port `bar` for each byte of `[offset, offset + len)`, then
    /// recomputes the interrupt.
    fn access(
        &self,
        bar: u8,
        offset: u64,
        len: usize,
        mut access: impl FnMut(&mut Uart, u64, usize, Instant),
    ) -> Result<(), DeviceError> {
        let bad = || DeviceError::BadAccess { region: u32::from(bar), offset, len: len as u64 };
        let end = offset.checked_add(len as u64).ok_or_else(bad)?;
        if end > PORT_BAR_SIZE {
            return Err(bad());
        }
        let mut st = self.shared.lock();
        let port = st.ports.get_mut(usize::from(bar)).ok_or(DeviceError::NoSuchRegion(u32::from(bar)))?;
        let now = Instant::now();
        // A wide access is the byte accesses it spans, lowest address first.
        for (i, reg) in (offset..end).enumerate() {
            access(port, reg, i, now);
        }
        self.shared.update(&mut st);
        Ok(())
    }
}

impl PciFunction for Mtty {
    fn bar_read(&self, bar: u8, offset: u64, data: &mut [u8]) -> Result<(), DeviceError> {
        self.access(bar, offset, data.len(), |port, reg, i, now| data[i] = port.read(reg, now))
    }

    fn bar_write(&self, bar: u8, offset: u64, data: &[u8]) -> Result<(), DeviceError> {
        self.access(bar, offset, data.len(), |port, reg, i, now| port.write(reg, data[i], now))
    }

    fn reset(&self) {
        let mut st = self.shared.lock();
        st.ports.iter_mut().for_each(Uart::reset);
        self.shared.update(&mut st);
    }
}

impl Drop for Mtty {
    fn drop(&mut self) {
        self.shared.lock().stop = true;
        self.shared.wake.notify_all();
        if let Some(timer) = self.timer.take() {
            if timer.join().is_err() {
                log::error!("mtty: the timer thread panicked");
            }
        }
    }
}

/// The `mtty-1` and `mtty-2` device types. Both draw on one [`Pool`] of ports, so each
/// shows `free ports / ports per card` available instances.
#[derive(Debug)]
pub struct MttyType {
    ports: u32,
    pool: Arc<Pool>,
}

impl MttyType {
    /// `mtty-1`, drawing on `pool` (share it with the `mtty-2` type).
    pub fn single(pool: Arc<Pool>) -> MttyType {
        MttyType { ports: 1, pool }
    }

    /// `mtty-2`, drawing on `pool` (share it with the `mtty-1` type).
    pub fn dual(pool: Arc<Pool>) -> MttyType {
        MttyType { ports: 2, pool }
    }

    /// Ports per card.
    pub fn ports(&self) -> u32 {
        self.ports
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
            "Single port serial: a 16550A UART on an I/O BAR, INTx/MSI (docs/mtty.md)"
        } else {
            "Dual port serial: two 16550A UARTs on I/O BARs, INTx/MSI (docs/mtty.md)"
        }
    }

    fn available_instances(&self) -> u32 {
        self.pool.free() / self.ports
    }

    fn create(&self, options: &InstanceOptions) -> Result<Arc<dyn VfioDevice>, TypeError> {
        options.only(self.name(), &[])?;
        let reservation =
            self.pool.reserve(self.ports).ok_or_else(|| TypeError::Exhausted(self.name().into()))?;
        let device = create(self.ports as usize)
            .map_err(|e| TypeError::Create { ty: self.name().into(), why: e.to_string() })?;
        Ok(Arc::new(Reserved::new(device, reservation)))
    }
}

#[cfg(test)]
mod tests {
    //! mtty driven through [`VfioDevice`], as the server drives it.

    use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

    use super::*;
    use crate::device::{IrqAction, IrqData, RegionFlags, SetIrqs};
    use crate::pci::regs::{CAPABILITY_LIST, CAP_ID_MSI, COMMAND, COMMAND_INTX_DISABLE, COMMAND_IO};
    use crate::pci::regs::{MSI_CTRL_ENABLE, STATUS, STATUS_CAP_LIST, STATUS_INTERRUPT};
    use crate::types::Registry;
    use crate::{VFIO_PCI_CONFIG_REGION_INDEX as CONFIG, VFIO_PCI_INTX_IRQ_INDEX as INTX};
    use crate::{VFIO_PCI_MSIX_IRQ_INDEX as MSIX, VFIO_PCI_MSI_IRQ_INDEX as MSI};

    /// A divisor so slow (≈1.8 baud) the character timeout never fires during a test.
    const SLOW: u16 = 0xffff;
    /// 115200 baud: the character timeout fires after ≈0.35 ms.
    const FAST: u16 = 1;
    /// 8 data bits, no parity, 1 stop bit.
    const LCR_8N1: u8 = LCR_WLEN8;

    struct Rig {
        dev: PciDevice<Mtty>,
    }

    fn rig(ports: usize) -> Rig {
        Rig { dev: create(ports).unwrap() }
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
            self.dev
                .set_irqs(SetIrqs { index, start: 0, count: 1, action: IrqAction::Trigger, data })
                .unwrap();
            fd
        }

        fn unmask_intx(&self) {
            let req =
                SetIrqs { index: INTX, start: 0, count: 1, action: IrqAction::Unmask, data: IrqData::None };
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

        fn output(&self, port: usize) -> PortOutput {
            self.dev.function().output(port).unwrap()
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
        assert_eq!(one.dev.function().ports(), 1);
        assert!(one.dev.function().output(1).is_none());
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
        assert_eq!(rig.inb(0, MSR), MSR_CTS | MSR_DSR | MSR_DCD, "an idle, ready peer; no deltas");
        assert_eq!(rig.inb(0, SCR), 0);
    }

    #[test]
    fn divisor_latch_replaces_bytes_and_dlab_switches_registers() {
        let rig = rig(1);
        rig.outb(0, LCR, LCR_DLAB);
        rig.outb(0, DLL, 0x0c);
        rig.outb(0, DLM, 0x00);
        assert_eq!((rig.inb(0, DLL), rig.inb(0, DLM)), (0x0c, 0));
        rig.outb(0, DLL, 0x03); // replaces (mtty ORs: it would read 0x0f)
        rig.outb(0, DLM, 0x01);
        assert_eq!((rig.inb(0, DLL), rig.inb(0, DLM)), (0x03, 0x01));
        assert_eq!(rig.inb(0, LCR), LCR_DLAB);
        assert!(rig.output(0).take().is_empty(), "DLL writes transmit nothing");
        // DLAB off: offsets 0 and 1 are THR/RBR and IER again.
        rig.outb(0, LCR, LCR_8N1);
        rig.outb(0, IER, 0xff);
        assert_eq!(rig.inb(0, IER), 0x0f, "IER has 4 bits");
        rig.outb(0, IER, 0);
        rig.outb(0, THR, b'x');
        assert_eq!(rig.output(0).take(), b"x");
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
        for (trigger, level) in
            [(FCR_TRIGGER_1, 1), (FCR_TRIGGER_4, 4), (FCR_TRIGGER_8, 8), (FCR_TRIGGER_14, 14)]
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
        assert_eq!(rig.output(0).stats(), OutputStats::default(), "nothing left the port");

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
    fn outside_loopback_bytes_leave_the_port() {
        let rig = rig(2);
        let out = rig.output(1);
        rig.outb(1, LCR, LCR_8N1);
        for &b in b"hello" {
            rig.outb(1, THR, b);
        }
        assert_eq!(rig.inb(1, LSR), LSR_THRE | LSR_TEMT, "nothing arrives on RX");
        assert_eq!(out.stats(), OutputStats { transmitted: 5, dropped: 0, buffered: 5 });
        assert_eq!(out.take(), b"hello");
        assert!(rig.output(0).take().is_empty(), "port 0 is separate");
        // Word length: 5 and 7 bits.
        rig.outb(1, LCR, 0);
        rig.outb(1, THR, 0xff);
        rig.outb(1, LCR, 0x02);
        rig.outb(1, THR, 0xff);
        assert_eq!(out.take(), [0x1f, 0x7f]);
        // Bounded: the oldest bytes go.
        rig.outb(1, LCR, LCR_8N1);
        for i in 0..OUTPUT_CAPACITY + 10 {
            rig.outb(1, THR, i as u8);
        }
        let stats = out.stats();
        assert_eq!((stats.dropped, stats.buffered), (10, OUTPUT_CAPACITY));
        assert_eq!(stats.transmitted, 7 + OUTPUT_CAPACITY as u64 + 10);
        let bytes = out.take();
        assert_eq!((bytes[0], bytes.len()), (10, OUTPUT_CAPACITY));
    }

    #[test]
    fn wide_accesses_are_byte_accesses_in_order() {
        let rig = rig(1);
        rig.dev.region_write(0, LCR, &[LCR_8N1, MCR_RTS, 0xaa, 0xbb, 0x77]).unwrap();
        assert_eq!(rig.inb(0, SCR), 0x77, "LSR and MSR ignore writes");
        let mut b = [0u8; 4];
        rig.dev.region_read(0, MCR, &mut b).unwrap();
        assert_eq!(b, [MCR_RTS, LSR_THRE | LSR_TEMT, MSR_CTS | MSR_DSR | MSR_DCD, 0x77]);
        let mut b = [0u8; 8];
        rig.dev.region_read(0, 0, &mut b).unwrap();
        assert_eq!(b[3..], [LCR_8N1, MCR_RTS, 0x60, 0xb0, 0x77]);
        // Outside the BAR, or a port the card lacks.
        assert!(rig.dev.region_read(0, 7, &mut [0; 2]).is_err());
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
        let deadline = Instant::now() + Duration::from_secs(5);
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
        let mut uart = Uart::new(PortOutput::default());
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
    fn reset_restores_the_uart_and_keeps_the_output() {
        let rig = rig(2);
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
            assert_eq!(rig.inb(port, MSR), MSR_CTS | MSR_DSR | MSR_DCD);
            assert_eq!(rig.inb(port, SCR), 0);
            rig.outb(port, LCR, LCR_DLAB);
            assert_eq!((rig.inb(port, DLL), rig.inb(port, DLM)), (0, 0));
        }
        // Power-on LCR selects 5-bit words: the first '!' (0x21) left as 0x01.
        assert_eq!(rig.output(1).take(), [0x01, b'!'], "what left the port stays readable");
    }

    #[test]
    fn ports_come_from_one_pool_across_both_types() {
        let registry = Registry::builtin();
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
        assert_eq!(avail(), (24, 12), "a refused create reserves nothing");
    }
}
