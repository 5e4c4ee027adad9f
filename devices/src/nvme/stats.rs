//! What the controller did, per queue: commands, bytes, and what run splitting made of the
//! guest's PRP lists (pages, runs and pin calls per command, as histograms).
//!
//! Each queue's counters have one writer (its worker) and a cache line of their own, so
//! counting costs plain stores; readers sum the queues.

use std::sync::atomic::{AtomicU64, Ordering};

use serde_json::{json, Value};

/// Histogram buckets: 1, 2, 3-4, 5-8, ..., 129-256, 257 and more.
pub const BUCKETS: usize = 10;

/// The bucket of `n` (at least 1).
fn bucket(n: u64) -> usize {
    let n = n.max(1);
    ((64 - (n - 1).leading_zeros()) as usize).min(BUCKETS - 1)
}

fn bucket_name(i: usize) -> String {
    match i {
        0 => "1".into(),
        1 => "2".into(),
        i if i == BUCKETS - 1 => format!("{}+", (1u64 << (i - 1)) + 1),
        i => format!("{}-{}", (1u64 << (i - 1)) + 1, 1u64 << i),
    }
}

/// One queue's counters.
#[repr(align(64))]
#[derive(Debug, Default)]
pub struct QueueStats {
    commands: AtomicU64,
    reads: AtomicU64,
    writes: AtomicU64,
    errors: AtomicU64,
    bytes_read: AtomicU64,
    bytes_written: AtomicU64,
    compares: AtomicU64,
    bytes_compared: AtomicU64,
    pages: AtomicU64,
    runs: AtomicU64,
    list_pages: AtomicU64,
    fixed_transfers: AtomicU64,
    pages_per_command: [AtomicU64; BUCKETS],
    runs_per_command: [AtomicU64; BUCKETS],
}

/// Adds `n` to a counter only its queue's worker writes.
fn add(counter: &AtomicU64, n: u64) {
    counter.store(counter.load(Ordering::Relaxed).wrapping_add(n), Ordering::Relaxed);
}

/// One data transfer, as the engine pinned it.
#[derive(Clone, Copy, Debug)]
pub struct Transfer {
    /// Pages in the command's array.
    pub pages: u64,
    /// Runs the engine cut it into.
    pub runs: u64,
    /// PRP list pages read.
    pub list_pages: u64,
    /// Bytes.
    pub bytes: u64,
    /// A read (device to guest) or a write.
    pub read: bool,
    /// The host moved it through a fixed buffer (kernel pin mode: no page pins of its own).
    pub fixed: bool,
}

impl QueueStats {
    /// A command completed (any kind), with an error status or not.
    pub fn command(&self, error: bool) {
        add(&self.commands, 1);
        if error {
            add(&self.errors, 1);
        }
    }

    /// A Compare read its blocks and the host's data (whether they matched or not).
    pub fn compare(&self, bytes: u64) {
        add(&self.compares, 1);
        add(&self.bytes_compared, bytes);
    }

    /// A read or write moved its data with one pin call.
    pub fn transfer(&self, t: Transfer) {
        add(if t.read { &self.reads } else { &self.writes }, 1);
        add(if t.read { &self.bytes_read } else { &self.bytes_written }, t.bytes);
        add(&self.pages, t.pages);
        add(&self.runs, t.runs);
        add(&self.list_pages, t.list_pages);
        if t.fixed {
            add(&self.fixed_transfers, 1);
        }
        add(&self.pages_per_command[bucket(t.pages)], 1);
        add(&self.runs_per_command[bucket(t.runs)], 1);
    }
}

/// The sum of some queues' counters.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Totals {
    /// Commands completed.
    pub commands: u64,
    /// Reads that moved data.
    pub reads: u64,
    /// Writes that moved data.
    pub writes: u64,
    /// Commands that completed with an error status.
    pub errors: u64,
    /// Bytes read (device to guest).
    pub bytes_read: u64,
    /// Bytes written (guest to device).
    pub bytes_written: u64,
    /// Compares that read their blocks and the host's data.
    pub compares: u64,
    /// Bytes those compared.
    pub bytes_compared: u64,
    /// Guest pages named by the commands' PRPs.
    pub pages: u64,
    /// Contiguous runs the engine pinned them in.
    pub runs: u64,
    /// Pin calls: one per read or write (derived, not counted).
    pub pin_calls: u64,
    /// PRP list pages read.
    pub list_pages: u64,
    /// Reads and writes the host moved through fixed buffers (kernel pin mode).
    pub fixed_transfers: u64,
    /// Commands by pages moved.
    pub pages_per_command: [u64; BUCKETS],
    /// Commands by runs pinned.
    pub runs_per_command: [u64; BUCKETS],
}

impl Totals {
    /// The sum over `queues`.
    pub fn of<'a>(queues: impl IntoIterator<Item = &'a QueueStats>) -> Totals {
        let mut t = Totals::default();
        let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
        for q in queues {
            t.commands += get(&q.commands);
            t.reads += get(&q.reads);
            t.writes += get(&q.writes);
            t.errors += get(&q.errors);
            t.bytes_read += get(&q.bytes_read);
            t.bytes_written += get(&q.bytes_written);
            t.compares += get(&q.compares);
            t.bytes_compared += get(&q.bytes_compared);
            t.pages += get(&q.pages);
            t.runs += get(&q.runs);
            t.list_pages += get(&q.list_pages);
            t.fixed_transfers += get(&q.fixed_transfers);
            for i in 0..BUCKETS {
                t.pages_per_command[i] += get(&q.pages_per_command[i]);
                t.runs_per_command[i] += get(&q.runs_per_command[i]);
            }
        }
        // Every read and write moves its data with one pin call.
        t.pin_calls = t.reads + t.writes;
        t
    }

    /// As `umdev stats` shows it.
    pub fn to_json(&self) -> Value {
        let hist = |h: &[u64; BUCKETS]| {
            Value::Object((0..BUCKETS).filter(|&i| h[i] > 0).map(|i| (bucket_name(i), json!(h[i]))).collect())
        };
        let per_command = |n: u64| if self.pin_calls == 0 { 0.0 } else { n as f64 / self.pin_calls as f64 };
        json!({
            "commands": self.commands,
            "reads": self.reads,
            "writes": self.writes,
            "errors": self.errors,
            "bytes_read": self.bytes_read,
            "bytes_written": self.bytes_written,
            "compares": self.compares,
            "bytes_compared": self.bytes_compared,
            "pages": self.pages,
            "runs": self.runs,
            "pin_calls": self.pin_calls,
            "prp_list_pages": self.list_pages,
            "fixed_transfers": self.fixed_transfers,
            "pages_per_command": hist(&self.pages_per_command),
            "runs_per_command": hist(&self.runs_per_command),
            "mean_pages_per_command": per_command(self.pages),
            "mean_runs_per_command": per_command(self.runs),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_are_powers_of_two() {
        let got: Vec<usize> = [1, 2, 3, 4, 5, 8, 9, 256, 257, 1 << 20].iter().map(|&n| bucket(n)).collect();
        assert_eq!(got, [0, 1, 2, 2, 3, 3, 4, 8, 9, 9]);
        let names: Vec<String> = (0..BUCKETS).map(bucket_name).collect();
        assert_eq!(names, ["1", "2", "3-4", "5-8", "9-16", "17-32", "33-64", "65-128", "129-256", "257+"]);
    }

    #[test]
    fn totals_sum_queues() {
        let (a, b) = (QueueStats::default(), QueueStats::default());
        a.transfer(Transfer { pages: 5, runs: 3, list_pages: 1, bytes: 20_000, read: true, fixed: true });
        a.command(false);
        b.transfer(Transfer { pages: 1, runs: 1, list_pages: 0, bytes: 512, read: false, fixed: false });
        b.command(false);
        b.command(true);
        let t = Totals::of([&a, &b]);
        assert_eq!((t.commands, t.errors, t.reads, t.writes, t.pages, t.runs), (3, 1, 1, 1, 6, 4));
        assert_eq!(t.fixed_transfers, 1);
        assert_eq!((t.pages_per_command[3], t.runs_per_command[2], t.pages_per_command[0]), (1, 1, 1));
        let j = t.to_json();
        assert_eq!(j["pages_per_command"]["5-8"], 1);
        assert_eq!(j["mean_pages_per_command"], 3.0);
    }
}
