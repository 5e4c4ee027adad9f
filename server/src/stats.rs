//! Per-instance protocol counters, for `umdev stats`.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};

use serde::Serialize;
use umdev_mdev::log_budget::LogBudget;

use crate::wire::Command;

/// An instance's budget of warnings for its clients' mistakes ([`LogBudget`]).
#[derive(Debug)]
pub(crate) struct FaultLog(LogBudget);

impl Default for FaultLog {
    fn default() -> FaultLog {
        FaultLog(LogBudget::of("umdev_server::session", "this instance's further client mistakes"))
    }
}

impl FaultLog {
    pub(crate) fn warn(&self, what: std::fmt::Arguments<'_>) {
        self.0.warn(what);
    }
}

/// Counters of one instance across its connections. Updated with relaxed atomics, once per
/// message: cheap enough for the hot path.
#[derive(Debug, Default)]
pub struct ServerStats {
    /// The budget of warnings for its clients' mistakes, across connections.
    pub(crate) faults: FaultLog,
    /// Messages received per command number (index = command; 0 counts unknown commands).
    pub(crate) messages: [AtomicU64; Command::ALL.len() + 1],
    /// Requests answered with an error.
    pub(crate) errors: AtomicU64,
    /// Connections dropped because the stream could not go on.
    pub(crate) fatal: AtomicU64,
    /// Replies from the client that matched no request of ours.
    pub(crate) stray_replies: AtomicU64,
    pub(crate) bytes_in: AtomicU64,
    pub(crate) bytes_out: AtomicU64,
    /// Clients served.
    pub(crate) connections: AtomicU64,
    /// Clients turned away because another was connected.
    pub(crate) rejected: AtomicU64,
    /// DMA_READ/DMA_WRITE requests sent to clients.
    pub(crate) client_dma_requests: AtomicU64,
}

/// A snapshot of [`ServerStats`].
#[derive(Clone, Debug, Default, Serialize, PartialEq, Eq)]
pub struct StatsSnapshot {
    /// Messages per command name.
    pub messages: BTreeMap<String, u64>,
    /// Requests answered with an error.
    pub errors: u64,
    /// Connections dropped on an unrecoverable protocol error.
    pub fatal: u64,
    /// Replies matching no request.
    pub stray_replies: u64,
    /// Bytes received.
    pub bytes_in: u64,
    /// Bytes sent.
    pub bytes_out: u64,
    /// Clients served.
    pub connections: u64,
    /// Clients turned away.
    pub rejected: u64,
    /// Server-to-client DMA requests.
    pub client_dma_requests: u64,
}

impl ServerStats {
    pub(crate) fn count_message(&self, command: u16) {
        let slot = if (command as usize) < self.messages.len() { command as usize } else { 0 };
        self.messages[slot].fetch_add(1, Ordering::Relaxed);
    }

    /// The counters now.
    pub fn snapshot(&self) -> StatsSnapshot {
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let mut messages = BTreeMap::new();
        for (n, count) in self.messages.iter().enumerate() {
            let count = get(count);
            if count == 0 {
                continue;
            }
            let name = match Command::from_u16(n as u16) {
                Some(c) => c.name().to_string(),
                None => "unknown".to_string(),
            };
            messages.insert(name, count);
        }
        StatsSnapshot {
            messages,
            errors: get(&self.errors),
            fatal: get(&self.fatal),
            stray_replies: get(&self.stray_replies),
            bytes_in: get(&self.bytes_in),
            bytes_out: get(&self.bytes_out),
            connections: get(&self.connections),
            rejected: get(&self.rejected),
            client_dma_requests: get(&self.client_dma_requests),
        }
    }
}
