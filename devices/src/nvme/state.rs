//! What the admin commands set and read besides the queues: features, outstanding
//! Asynchronous Event Requests and the events waiting for them, the error log. Plain data
//! under the controller's admin lock; delivering an event is the controller's job
//! ([`super::ctrl::Ctrl::event`]).

use std::collections::VecDeque;

use smallvec::SmallVec;

use super::queue::Coalescing;
use super::spec::{nvm_op, ErrorLogEntry, Sqe, Status};

/// Outstanding Asynchronous Event Requests at most (AERL + 1, NVMe 1.3 §5.2).
pub const MAX_AERS: usize = 4;
/// Events kept waiting for a request at most.
const MAX_EVENTS: usize = 16;
/// Error log entries kept (ELPE + 1, §5.14.1.1).
pub const ERROR_LOG_ENTRIES: usize = 16;
/// The composite temperature the controller reports, kelvins (40 °C).
pub const TEMPERATURE: u16 = 313;
/// Warning and critical composite temperature thresholds (WCTEMP, CCTEMP).
pub const WCTEMP: u16 = 343;
/// See [`WCTEMP`].
pub const CCTEMP: u16 = 358;

/// Features (§5.21.1), events (§5.2) and the error log (§5.14.1.1).
#[derive(Debug)]
pub struct AdminState {
    pub(super) arbitration: u32,
    pub(super) power_state: u32,
    /// Temperature thresholds of the composite sensor: over, under.
    pub(super) thresholds: [u16; 2],
    pub(super) error_recovery: u32,
    /// Number of Queues as granted (0's based NSQA, NCQA).
    pub(super) queues_granted: (u16, u16),
    pub(super) coalescing: Coalescing,
    /// Interrupt vectors with coalescing disabled: vector 0 always (the admin CQ's, which
    /// is never coalesced, and with INTx or MSI every CQ's).
    pub(super) coalescing_disabled: Vec<bool>,
    pub(super) write_atomicity: u32,
    pub(super) async_config: u32,
    /// Outstanding Asynchronous Event Requests (their command identifiers).
    aers: SmallVec<[u16; MAX_AERS]>,
    /// Events waiting for a request: dword 0 of its completion.
    events: VecDeque<u32>,
    /// Event types reported and not yet acknowledged by reading their log page.
    masked_types: u32,
    /// SMART critical warnings now.
    pub(super) critical_warning: u8,
    errors: VecDeque<ErrorLogEntry>,
    error_count: u64,
    /// A shutdown notification since the last enable.
    pub(super) shutdown_seen: bool,
}

impl AdminState {
    /// Power-on state of a controller with `io_queues` queue pairs.
    pub fn new(io_queues: u16) -> AdminState {
        let n = io_queues - 1;
        AdminState {
            arbitration: 7, // no burst limit
            power_state: 0,
            thresholds: [WCTEMP, 0],
            error_recovery: 0,
            queues_granted: (n, n),
            coalescing: Coalescing::default(),
            coalescing_disabled: (0..=io_queues).map(|v| v == 0).collect(),
            write_atomicity: 0,
            async_config: 0,
            aers: SmallVec::new(),
            events: VecDeque::new(),
            masked_types: 0,
            critical_warning: 0,
            errors: VecDeque::new(),
            error_count: 0,
            shutdown_seen: false,
        }
    }

    /// A controller reset: features back to defaults, requests and events gone; the error
    /// log stays.
    pub fn reset(&mut self, io_queues: u16) {
        let errors = std::mem::take(&mut self.errors);
        let error_count = self.error_count;
        *self = AdminState::new(io_queues);
        self.errors = errors;
        self.error_count = error_count;
    }

    /// Records a failed command in the error log (§5.14.1.1).
    pub fn log_error(&mut self, sqid: u16, sqe: &Sqe, status: Status) {
        self.error_count += 1;
        let lba = match sqe.opcode() {
            nvm_op::READ | nvm_op::WRITE | nvm_op::COMPARE | nvm_op::WRITE_ZEROES if sqid != 0 => {
                u64::from(sqe.dw(10)) | u64::from(sqe.dw(11)) << 32
            }
            _ => 0,
        };
        if self.errors.len() == ERROR_LOG_ENTRIES {
            self.errors.pop_back();
        }
        self.errors.push_front(ErrorLogEntry {
            error_count: self.error_count.into(),
            sqid: sqid.into(),
            cid: sqe.cid().into(),
            status: (status.0 << 1).into(),
            parameter_location: 0xffff.into(),
            lba: lba.into(),
            nsid: sqe.nsid,
            ..ErrorLogEntry::default()
        });
    }

    /// The error log, newest first.
    pub fn errors(&self) -> impl Iterator<Item = &ErrorLogEntry> {
        self.errors.iter()
    }

    /// Commands that completed with an error status, ever.
    pub fn error_count(&self) -> u64 {
        self.error_count
    }

    /// Queues an event (dropped if as many are waiting already, or the same one is).
    pub fn add_event(&mut self, kind: u32, info: u32, log: u8) {
        let dw0 = kind | info << 8 | u32::from(log) << 16;
        if self.events.len() < MAX_EVENTS && !self.events.contains(&dw0) {
            self.events.push_back(dw0);
        }
    }

    /// Takes an Asynchronous Event Request; false if AERL + 1 are outstanding already.
    pub fn add_request(&mut self, cid: u16) -> bool {
        if self.aers.len() >= MAX_AERS {
            return false;
        }
        self.aers.push(cid);
        true
    }

    /// The oldest outstanding request and the oldest event of an unmasked type, if both
    /// exist: (its command identifier, completion dword 0). Not taken: see
    /// [`AdminState::delivered`].
    pub fn next_delivery(&self) -> Option<(u16, u32)> {
        let cid = *self.aers.first()?;
        let dw0 = *self.events.iter().find(|e| self.masked_types & (1 << (*e & 7)) == 0)?;
        Some((cid, dw0))
    }

    /// The delivery [`AdminState::next_delivery`] named was posted: the request and the event
    /// go, and the event's type is masked until its log page is read.
    pub fn delivered(&mut self, cid: u16, dw0: u32) {
        if let Some(at) = self.aers.iter().position(|c| *c == cid) {
            self.aers.remove(at);
        }
        if let Some(at) = self.events.iter().position(|e| *e == dw0) {
            self.events.remove(at);
        }
        self.masked_types |= 1 << (dw0 & 7);
    }

    /// Reading the log page of event type `kind` acknowledges it: more may be reported.
    pub fn acknowledge(&mut self, kind: u32) {
        self.masked_types &= !(1 << kind);
    }

    /// Recomputes the temperature warning (critical warning bit 1); true if it just became
    /// set and the host asked to hear of it (Asynchronous Event Configuration bit 1).
    pub fn update_temperature_warning(&mut self) -> bool {
        let [over, under] = self.thresholds;
        let was = self.critical_warning & 2 != 0;
        // At a threshold counts (NVMe 1.4 §5.21.1.4: greater than or equal to the over
        // threshold, less than or equal to the under one; QEMU's nvme reads it so too).
        let is = TEMPERATURE >= over || TEMPERATURE <= under;
        if is {
            self.critical_warning |= 2;
        } else {
            self.critical_warning &= !2;
        }
        is && !was && self.async_config & 2 != 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_event_waits_for_a_request_and_masks_its_type_until_acknowledged() {
        let mut st = AdminState::new(4);
        st.add_event(1, 1, 2);
        assert_eq!(st.next_delivery(), None, "no request yet");
        assert!(st.add_request(9));
        assert_eq!(st.next_delivery(), Some((9, 1 | 1 << 8 | 2 << 16)));
        st.delivered(9, 1 | 1 << 8 | 2 << 16);
        st.add_event(1, 2, 2);
        assert!(st.add_request(10));
        assert_eq!(st.next_delivery(), None, "type 1 masked");
        st.acknowledge(1);
        assert_eq!(st.next_delivery(), Some((10, 1 | 2 << 8 | 2 << 16)));
        for cid in 0..3 {
            assert!(st.add_request(cid));
        }
        assert!(!st.add_request(99), "AERL + 1 outstanding at most");
    }
}
