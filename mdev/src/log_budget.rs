//! Warnings a client or its guest can cause, bounded per device: a guest that repeats a
//! mistake (an enable with a bad field, a read of a truncated backing file) many times a
//! second would otherwise write a line each time, and under journald, whose rate limit is per
//! service, hide every other instance's lines.
//!
//! A [`LogBudget`] logs its first [`BURST`] warnings at warning level and earns one more each
//! [`REFILL`]; the rest go at debug level (`RUST_LOG=debug` shows them all). The line that
//! spends the last warning says so, and the next warning logged says how many went to debug
//! level meanwhile. Warnings are rare, so the budget takes a lock; nothing on a device's
//! data path logs through it while all is well.

use std::fmt;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Warnings logged at warning level before the budget runs out.
pub const BURST: u32 = 8;

/// Time to earn one more warning once the budget has run out.
pub const REFILL: Duration = Duration::from_secs(10);

/// One device's budget of warnings (see the module's docs).
#[derive(Debug)]
pub struct LogBudget {
    state: Mutex<State>,
    /// The log target its lines go under (`RUST_LOG` filters by it): the module that logs.
    target: &'static str,
    /// What the line that spends the budget says goes to debug level.
    whose: &'static str,
}

#[derive(Debug, Default)]
struct State {
    /// Warnings spent, as of `since` (earned back one per [`REFILL`] after it).
    spent: u32,
    since: Option<Instant>,
    /// Warnings logged at debug level since the last one at warning level.
    quieted: u64,
}

/// At which level [`LogBudget::level`] has a line logged, and what it adds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Spend {
    /// At warning level; `quieted` lines went to debug level since the last such.
    Warn {
        /// Lines logged at debug level since the last warning.
        quieted: u64,
        /// This spends the last of the budget.
        last: bool,
    },
    /// At debug level.
    Debug,
}

impl LogBudget {
    /// A full budget for the warnings of a device whose lines go under `target` (its
    /// module's path, as `log`'s macros give it: `module_path!()`).
    pub fn new(target: &'static str) -> LogBudget {
        LogBudget::of(target, "this device's further warnings")
    }

    /// A full budget whose lines go under `target` and whose last warning says that `whose`
    /// ("this device's further warnings", say) are logged at debug level for a while.
    pub fn of(target: &'static str, whose: &'static str) -> LogBudget {
        LogBudget { state: Mutex::default(), target, whose }
    }

    /// Logs `what` at warning level if the budget allows, else at debug level.
    pub fn warn(&self, what: fmt::Arguments<'_>) {
        match self.level(Instant::now()) {
            Spend::Warn { quieted, last } => {
                let before = if quieted > 0 {
                    format!(" ({quieted} warnings before it at debug level)")
                } else {
                    String::new()
                };
                match last {
                    true => log::warn!(
                        target: self.target,
                        "{what}{before} ({} are logged at debug level for a while)",
                        self.whose
                    ),
                    false => log::warn!(target: self.target, "{what}{before}"),
                }
            }
            Spend::Debug => log::debug!(target: self.target, "{what}"),
        }
    }

    /// The level of a warning at `now`, and the budget spent on it.
    pub fn level(&self, now: Instant) -> Spend {
        let mut s = self.state.lock().unwrap_or_else(|p| p.into_inner());
        let since = *s.since.get_or_insert(now);
        // Earned back: one per REFILL since `since`, the remainder of the time kept.
        let periods = now.saturating_duration_since(since).as_nanos() / REFILL.as_nanos();
        let earned = u32::try_from(periods).unwrap_or(u32::MAX).min(s.spent);
        if earned > 0 {
            s.spent -= earned;
            s.since = Some(if s.spent == 0 { now } else { since + REFILL * earned });
        }
        if s.spent >= BURST {
            s.quieted = s.quieted.saturating_add(1);
            return Spend::Debug;
        }
        if s.spent == 0 {
            s.since = Some(now);
        }
        s.spent += 1;
        Spend::Warn { quieted: std::mem::take(&mut s.quieted), last: s.spent == BURST }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_burst_then_one_warning_per_refill() {
        let budget = LogBudget::new(module_path!());
        let t0 = Instant::now();
        let warn = |quieted, last| Spend::Warn { quieted, last };
        for i in 1..BURST {
            assert_eq!(budget.level(t0), warn(0, false), "warning {i}");
        }
        assert_eq!(budget.level(t0), warn(0, true));
        // A flood: all at debug level, however many.
        for _ in 0..10_000 {
            assert_eq!(budget.level(t0 + REFILL / 2), Spend::Debug);
        }
        // One earned per REFILL, which says how many were quieted.
        assert_eq!(budget.level(t0 + REFILL), warn(10_000, true));
        assert_eq!(budget.level(t0 + REFILL), Spend::Debug);
        assert_eq!(budget.level(t0 + REFILL * 2 + REFILL / 2), warn(1, true));
        // A quiet spell earns the whole burst back, and no more.
        let later = t0 + REFILL * 1000;
        for _ in 1..BURST {
            assert_eq!(budget.level(later), warn(0, false));
        }
        assert_eq!(budget.level(later), warn(0, true));
        assert_eq!(budget.level(later), Spend::Debug);
    }
}
