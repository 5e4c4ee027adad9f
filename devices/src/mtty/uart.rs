//! One 16550A: the register file, FIFOs and interrupt conditions, and the line the
//! transmitter and receiver are wired to. Pure state; the device wraps it in a lock and
//! recomputes the interrupt after every change.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::{Duration, Instant};

use nix::sys::eventfd::EventFd;

use super::regs::*;
use super::{FIFO_SIZE, HOST_QUEUE, IGNORED_AFTER, UART_CLOCK_HZ};

/// The modem inputs of a ready peer, for every line: CTS, DSR and DCD asserted, RI not.
pub(super) const READY_PEER: u8 = MSR_CTS | MSR_DSR | MSR_DCD;

/// What the port's serial line is wired to.
#[derive(Debug)]
pub(super) enum Line {
    /// A loopback plug, as the kernel sample: every transmitted byte arrives on the same
    /// port's receiver.
    Loopback,
    /// Nothing: transmitted bytes vanish, nothing arrives.
    Null,
    /// A host-side peer through two bounded queues.
    Host(HostLine),
}

/// The host side of a line: bytes the guest sent that the host has not taken, bytes the host
/// sent that the receiver has not taken, and the eventfd that wakes the thread serving the
/// host peer when either queue changes in a way it waits for.
#[derive(Debug)]
pub(super) struct HostLine {
    pub(super) to_host: VecDeque<u8>,
    pub(super) to_guest: VecDeque<u8>,
    pub(super) wake: Option<Arc<EventFd>>,
}

impl HostLine {
    pub(super) fn new(wake: Option<Arc<EventFd>>) -> HostLine {
        HostLine {
            to_host: VecDeque::with_capacity(HOST_QUEUE),
            to_guest: VecDeque::with_capacity(HOST_QUEUE),
            wake,
        }
    }

    fn wake(&self) {
        if let Some(wake) = &self.wake {
            // A full counter only means a wake-up is already pending.
            let _ = wake.write(1);
        }
    }
}

/// Counters of a port's line, kept across resets (those bytes crossed the wire).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct PortStats {
    /// Bytes the transmitter sent.
    pub tx: u64,
    /// Bytes that entered the receive FIFO.
    pub rx: u64,
    /// Bytes lost to overrun (the receiver was full).
    pub dropped: u64,
    /// Overrun conditions (LSR.OE set).
    pub overruns: u64,
    /// Breaks received.
    pub breaks: u64,
}

/// A received character, whether it is a break (LSR.BI while it is at the top of the
/// FIFO, until an LSR read reports it), and whether a host line sent it (see
/// [`Uart::clear_rx`]).
#[derive(Clone, Copy, Debug)]
struct RxChar {
    byte: u8,
    brk: bool,
    from_host: bool,
}

/// One 16550A.
#[derive(Debug)]
pub(super) struct Uart {
    rx: VecDeque<RxChar>,
    tx: VecDeque<u8>,
    /// What RBR returns once the receiver is empty: the last byte read.
    rbr: u8,
    pub(super) ier: u8,
    pub(super) lcr: u8,
    mcr: u8,
    /// FIFO enable, DMA select and trigger bits as last programmed.
    fcr: u8,
    scr: u8,
    pub(super) divisor: u16,
    overrun: bool,
    /// The THRE interrupt source: set when the transmitter empties (or THRI is enabled
    /// while it is empty); cleared by writing THR or by an IIR read that reports it.
    thre: bool,
    /// Modem inputs (MSR bits 4-7) and their deltas (bits 0-3).
    msr: u8,
    msr_delta: u8,
    /// The character timeout: its deadline while armed, and whether it expired.
    pub(super) rx_deadline: Option<Instant>,
    rx_timeout: bool,
    /// When the guest last read RBR, or first accessed the port since the last reset: a
    /// receiver nobody reads, with receive interrupts off, is ignored from [`IGNORED_AFTER`]
    /// later and overruns like a real line.
    last_read: Instant,
    /// The guest has accessed the port since the last reset: before that (a guest still
    /// booting, no client at all) host bytes wait rather than overrun.
    touched: bool,
    /// Host bytes arriving at an ignored receiver are lost at the line's pace, counted in
    /// character times from this instant.
    line_clock: Instant,
    /// Enabled conditions pending after the last recompute (IER bits), for MSI edges.
    pub(super) last_pending: u8,
    /// THRE was cleared and set again within this access (a THR write).
    pub(super) thre_rearmed: bool,
    pub(super) line: Line,
    pub(super) stats: PortStats,
}

impl Uart {
    /// The power-on state, on `line`.
    pub(super) fn new(line: Line, now: Instant) -> Uart {
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
            msr: READY_PEER,
            // The peer's lines came up: the first MSR read shows DCTS and DDSR, the value the
            // kernel sample always reports (0xb3); reading clears them, as on a 16550A.
            msr_delta: MSR_DCTS | MSR_DDSR,
            rx_deadline: None,
            rx_timeout: false,
            last_read: now,
            touched: false,
            line_clock: now,
            last_pending: 0,
            thre_rearmed: false,
            line,
            stats: PortStats::default(),
        }
    }

    /// Back to the power-on state; the line, its queues and the counters stay.
    pub(super) fn reset(&mut self, now: Instant) {
        // What a host line sent and the guest has not read goes back to its queue, which a
        // reset keeps.
        self.clear_rx();
        let line = std::mem::replace(&mut self.line, Line::Null);
        let stats = self.stats;
        *self = Uart::new(line, now);
        self.stats = stats;
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

    /// A line status condition: overrun, or a break at the top of the receive FIFO.
    fn line_status(&self) -> bool {
        self.overrun || self.rx.front().is_some_and(|c| c.brk)
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
        if self.line_status() {
            conditions |= IER_RLSI;
        }
        if self.msr_delta != 0 {
            conditions |= IER_MSI;
        }
        conditions
    }

    /// The enabled conditions pending: the port requests an interrupt if any.
    pub(super) fn pending(&self) -> u8 {
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
        if self.rx.front().is_some_and(|c| c.brk) {
            lsr |= LSR_BI;
        }
        if self.fifo_enabled() && self.rx.iter().any(|c| c.brk) {
            lsr |= LSR_FIFO_ERROR;
        }
        if self.tx.is_empty() {
            // The shift register empties with the FIFO: the transmitter is instantaneous.
            lsr |= LSR_THRE | LSR_TEMT;
        }
        lsr
    }

    /// A guest access. The first since the reset starts the receiver's grace: a driver that
    /// has just found the port (probing it with interrupts off) may still read.
    fn touch(&mut self, now: Instant) {
        if !self.touched {
            self.touched = true;
            self.last_read = now;
        }
    }

    /// Reads register `reg` (0-7) with its side effects.
    pub(super) fn read(&mut self, reg: u64, now: Instant) -> u8 {
        self.touch(now);
        match reg {
            RBR if self.dlab() => self.divisor as u8,
            RBR => {
                if let Some(c) = self.rx.pop_front() {
                    self.rbr = c.byte;
                }
                self.last_read = now;
                self.rx_activity(now);
                self.feed_rx(now);
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
                // Reading LSR clears the error indications it reported.
                self.overrun = false;
                if let Some(front) = self.rx.front_mut() {
                    front.brk = false;
                }
                lsr
            }
            MSR => self.msr | std::mem::take(&mut self.msr_delta),
            _ => self.scr,
        }
    }

    /// Writes register `reg` (0-7).
    pub(super) fn write(&mut self, reg: u64, value: u8, now: Instant) {
        self.touch(now);
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
                self.feed_rx(now);
            }
            FCR => self.write_fcr(value, now),
            LCR => {
                let starts_break = value & LCR_SBC != 0 && self.lcr & LCR_SBC == 0;
                self.lcr = value;
                if starts_break {
                    self.send_break(now);
                }
            }
            MCR => {
                let was_loop = self.loopback();
                self.mcr = value & MCR_MASK;
                self.update_modem_inputs();
                if was_loop && !self.loopback() {
                    self.feed_rx(now);
                }
                if !was_loop && self.loopback() {
                    // Bytes a host that did not read had stalled go to the receiver now.
                    self.drain_tx(now);
                }
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
                self.clear_rx();
                self.clear_tx();
            }
            self.fcr = 0;
        } else {
            if !was_enabled || value & FCR_CLEAR_RX != 0 {
                self.clear_rx();
            }
            if !was_enabled || value & FCR_CLEAR_TX != 0 {
                self.clear_tx();
            }
            self.fcr = value & (FCR_ENABLE | FCR_DMA_SELECT | FCR_TRIGGER_MASK);
        }
        self.rx_activity(now);
        self.feed_rx(now);
    }

    /// Empties the receiver (an FCR clear, or FIFO mode turned on or off). What a host line
    /// sent that the guest has not read goes back to the front of the line's queue, in
    /// order: the guest paces a host line (nothing is lost while it reads), and a driver
    /// resets its FIFOs when it sets a port up (Linux's does at every open), which must not
    /// throw away what the host sent before. Loopback's characters and breaks are discarded,
    /// as on a 16550A.
    fn clear_rx(&mut self) {
        if let Line::Host(host) = &mut self.line {
            for c in self.rx.iter().rev().filter(|c| c.from_host) {
                host.to_guest.push_front(c.byte);
                self.stats.rx = self.stats.rx.saturating_sub(1);
            }
        }
        self.rx.clear();
    }

    /// Empties the transmitter (an FCR clear, or FIFO mode turned on or off): its bytes are
    /// lost, and THRE rises, as on a 16550A, with its interrupt if THRI is enabled.
    fn clear_tx(&mut self) {
        if !self.tx.is_empty() {
            self.tx.clear();
            self.thre = true;
            self.thre_rearmed = true;
        }
    }

    /// A THR write: the byte enters the TX FIFO (lost if it is full, as on a 16550A) and the
    /// transmitter sends what the line takes.
    fn transmit(&mut self, value: u8, now: Instant) {
        let byte = value & self.word_mask();
        self.thre = false;
        if self.tx.len() < self.fifo_depth() {
            self.tx.push_back(byte);
        }
        self.drain_tx(now);
    }

    /// The (instantaneous) transmitter: sends TX FIFO bytes to the receiver in loopback, to
    /// the line otherwise; a host line takes them only while its queue has room, so a host
    /// that does not read stalls this transmitter (THRE stays clear) and nothing else. If the
    /// FIFO empties, THRE is raised.
    pub(super) fn drain_tx(&mut self, now: Instant) {
        if self.tx.is_empty() {
            return;
        }
        let internal = self.loopback();
        // A break holds the line at space: what the transmitter sends meanwhile is lost.
        let on_break = self.lcr & LCR_SBC != 0 && !internal;
        while let Some(&byte) = self.tx.front() {
            match &mut self.line {
                _ if internal || on_break => {}
                Line::Loopback | Line::Null => {}
                Line::Host(host) => {
                    if host.to_host.len() >= HOST_QUEUE {
                        break;
                    }
                    if host.to_host.is_empty() {
                        host.wake();
                    }
                    host.to_host.push_back(byte);
                }
            }
            self.tx.pop_front();
            self.stats.tx += 1;
            if internal || (!on_break && matches!(self.line, Line::Loopback)) {
                self.receive(RxChar { byte, brk: false, from_host: false }, now);
            }
        }
        if self.tx.is_empty() {
            self.thre = true;
            self.thre_rearmed = true;
        }
    }

    /// LCR's break bit was set: a loopback (internal or the plug) receives a break, a zero
    /// character with BI. A host line carries no break.
    fn send_break(&mut self, now: Instant) {
        if self.loopback() || matches!(self.line, Line::Loopback) {
            self.stats.breaks += 1;
            self.receive(RxChar { byte: 0, brk: true, from_host: false }, now);
        }
    }

    /// A character arrives at the receiver.
    fn receive(&mut self, c: RxChar, now: Instant) {
        if self.rx.len() < self.fifo_depth() {
            self.rx.push_back(c);
            self.stats.rx += 1;
        } else {
            self.overrun_with(c);
        }
        self.rx_activity(now);
    }

    /// A character arrived with the receiver full: overrun.
    fn overrun_with(&mut self, c: RxChar) {
        if !self.overrun {
            self.stats.overruns += 1;
        }
        self.overrun = true;
        self.stats.dropped += 1;
        if !self.fifo_enabled() {
            // 16450 mode: the new character overwrites the unread one. In FIFO mode it is
            // the new one that is lost.
            self.rx.clear();
            self.rx.push_back(c);
        }
    }

    /// Moves bytes the host sent into the receiver while it has room. The host is paced by
    /// the guest (nothing lost) unless the guest ignores the port: it has accessed the port
    /// since the last reset, has receive interrupts off and has read no byte for
    /// [`IGNORED_AFTER`] since that first access or its last read. Then bytes keep arriving
    /// at the programmed line rate, as on a real line, and overrun.
    pub(super) fn feed_rx(&mut self, now: Instant) {
        if self.loopback() {
            return; // the line input is disconnected in loopback
        }
        let ignored = self.touched
            && self.ier & IER_RDI == 0
            && now.saturating_duration_since(self.last_read) >= IGNORED_AFTER;
        // Characters the line could have carried since the clock last moved, and not before
        // the receiver became ignored (at most a queue's worth): as many an ignored receiver
        // loses now. A backlog is paced from that moment, not dropped at once.
        let char_time = (self.char_timeout() / 4).max(Duration::from_micros(1));
        let mut arrived = 0usize;
        if ignored {
            let since = self.line_clock.max(self.last_read + IGNORED_AFTER);
            let elapsed = now.saturating_duration_since(since);
            arrived = (elapsed.as_nanos() / char_time.as_nanos()).min(HOST_QUEUE as u128) as usize;
        }
        if !ignored || arrived > 0 {
            self.line_clock = now;
        }
        let depth = self.fifo_depth();
        let Line::Host(host) = &mut self.line else { return };
        let before = host.to_guest.len();
        let mut moved = false;
        while let Some(&byte) = host.to_guest.front() {
            if self.rx.len() < depth {
                self.rx.push_back(RxChar { byte, brk: false, from_host: true });
                self.stats.rx += 1;
            } else if arrived > 0 {
                arrived -= 1;
                // As `overrun_with`, inline: `host` borrows the line.
                if !self.overrun {
                    self.stats.overruns += 1;
                }
                self.overrun = true;
                self.stats.dropped += 1;
                if depth == 1 {
                    self.rx.clear();
                    self.rx.push_back(RxChar { byte, brk: false, from_host: true });
                }
            } else {
                break;
            }
            host.to_guest.pop_front();
            moved = true;
        }
        // The host thread waits for room only once the queue is full: wake it when half has
        // drained, not for every byte.
        if before > HOST_QUEUE / 2 && host.to_guest.len() <= HOST_QUEUE / 2 {
            host.wake();
        }
        if moved {
            self.rx_activity(now);
        }
    }

    /// Room for more bytes from a host line: [`HOST_QUEUE`] less those queued and those in
    /// the receiver, which an RX clear or a reset gives back to the queue. So the queue never
    /// holds more than `HOST_QUEUE`, and the room a host thread saw never shrinks before it
    /// sends (only a send takes room).
    pub(super) fn host_room(&self) -> usize {
        let Line::Host(h) = &self.line else { return 0 };
        let in_receiver = self.rx.iter().filter(|c| c.from_host).count();
        HOST_QUEUE.saturating_sub(h.to_guest.len() + in_receiver)
    }

    /// Whether host bytes wait for the receiver (the host thread then ticks the port so an
    /// ignored receiver overruns in time).
    pub(super) fn host_waiting(&self) -> bool {
        matches!(&self.line, Line::Host(h) if !h.to_guest.is_empty())
    }

    /// The receiver FIFO was filled, read or cleared: restart the character timeout.
    fn rx_activity(&mut self, now: Instant) {
        self.rx_timeout = false;
        self.rx_deadline = (self.fifo_enabled() && !self.rx.is_empty()).then(|| now + self.char_timeout());
    }

    /// The timer's check: the character timeout expires at its deadline if data is still
    /// waiting. Returns whether it expired now.
    pub(super) fn expire(&mut self, now: Instant) -> bool {
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
    pub(super) fn char_timeout(&self) -> Duration {
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
    /// outputs (RTS→CTS, DTR→DSR, OUT1→RI, OUT2→DCD), else the ready peer's.
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
            READY_PEER
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
}
