//! Locked-memory accounting: the budget lock-mode pins draw on; and the pin modes.
//!
//! Like the kernel's `vfio_lock_acct`, a page is charged once when its pin count goes from
//! 0 to 1 and refunded at 1 to 0, and a run is checked against the limit before it is
//! locked. One [`LockAccount`] is usually shared by every DMA space of a process, since the
//! limit it models (`RLIMIT_MEMLOCK`) is per process.

use std::sync::atomic::{AtomicU64, Ordering};

use serde::Serialize;

use crate::sync::AtomicUpdate;

/// How pins hold their pages.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum PinMode {
    /// Reference counts and translation only: the pages stay as the kernel manages them.
    #[default]
    Track,
    /// Pinned pages are made resident and mlock'ed (hugetlb pages are accounted but need no
    /// syscall), and charged to a [`LockAccount`].
    Lock,
    /// Each run of a call gets the kernel's own long-term pin (`FOLL_LONGTERM`, what
    /// `vfio_pin_pages` takes), one kernel call per pin call through io_uring buffer
    /// registration, charged by the kernel to `RLIMIT_MEMLOCK` (see `kernel_pins_available`).
    Kernel,
}

impl std::str::FromStr for PinMode {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        // In any case, as the devices' option words are taken.
        match s.to_ascii_lowercase().as_str() {
            "track" => Ok(PinMode::Track),
            "lock" => Ok(PinMode::Lock),
            "kernel" => Ok(PinMode::Kernel),
            other => Err(format!("unknown pin mode {other:?} (expected track, lock or kernel)")),
        }
    }
}

impl std::fmt::Display for PinMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            PinMode::Track => "track",
            PinMode::Lock => "lock",
            PinMode::Kernel => "kernel",
        })
    }
}

/// A charge that did not fit under the limit.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct OverLimit {
    /// Bytes asked for.
    pub requested: u64,
    /// Bytes already charged.
    pub locked: u64,
    /// The limit.
    pub limit: u64,
}

/// A locked-memory budget in bytes.
#[derive(Debug)]
pub struct LockAccount {
    limit: u64,
    locked: AtomicU64,
}

impl LockAccount {
    /// A budget of `limit` bytes.
    pub fn with_limit(limit: u64) -> Self {
        LockAccount { limit, locked: AtomicU64::new(0) }
    }

    /// No limit.
    pub fn unlimited() -> Self {
        Self::with_limit(u64::MAX)
    }

    /// The process's own budget: unlimited with `CAP_IPC_LOCK`, else `RLIMIT_MEMLOCK`'s soft
    /// limit (unlimited if that is `RLIM_INFINITY`).
    pub fn for_this_process() -> Self {
        Self::with_limit(process_lock_limit())
    }

    /// The limit in bytes (`u64::MAX` for none).
    pub fn limit(&self) -> u64 {
        self.limit
    }

    /// Bytes currently charged.
    pub fn locked(&self) -> u64 {
        self.locked.load(Ordering::Relaxed)
    }

    /// Charges `bytes` if they fit under the limit.
    pub(crate) fn charge(&self, bytes: u64) -> Result<(), OverLimit> {
        self.locked
            .update_with(Ordering::AcqRel, Ordering::Acquire, |locked| {
                locked.checked_add(bytes).filter(|&total| total <= self.limit)
            })
            .map(drop)
            .map_err(|locked| OverLimit { requested: bytes, locked, limit: self.limit })
    }

    /// Returns `bytes` charged earlier.
    pub(crate) fn refund(&self, bytes: u64) {
        let before = self.locked.fetch_sub(bytes, Ordering::AcqRel);
        debug_assert!(before >= bytes, "refund of {bytes} with only {before} charged");
    }
}

/// The lock limit this process runs under, in bytes.
pub fn process_lock_limit() -> u64 {
    // Miri cannot ask the kernel; its unit tests lock nothing.
    if cfg!(miri) || has_cap_ipc_lock() {
        return u64::MAX;
    }
    match nix::sys::resource::getrlimit(nix::sys::resource::Resource::RLIMIT_MEMLOCK) {
        Ok((soft, _)) if soft != libc::RLIM_INFINITY => soft,
        Ok(_) => u64::MAX,
        Err(e) => {
            log::warn!("getrlimit(RLIMIT_MEMLOCK) failed ({e}); assuming 64 KiB");
            64 << 10
        }
    }
}

/// True if the effective capability set holds `CAP_IPC_LOCK`.
pub fn has_cap_ipc_lock() -> bool {
    const CAP_IPC_LOCK: u32 = 14;
    let Ok(status) = std::fs::read_to_string("/proc/self/status") else {
        return false;
    };
    status
        .lines()
        .find_map(|line| line.strip_prefix("CapEff:"))
        .and_then(|hex| u64::from_str_radix(hex.trim(), 16).ok())
        .is_some_and(|caps| caps & (1 << CAP_IPC_LOCK) != 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn charges_up_to_the_limit() {
        let account = LockAccount::with_limit(8192);
        account.charge(4096).unwrap();
        account.charge(4096).unwrap();
        let err = account.charge(1).unwrap_err();
        assert_eq!(err, OverLimit { requested: 1, locked: 8192, limit: 8192 });
        account.refund(4096);
        assert_eq!(account.locked(), 4096);
        assert!(LockAccount::unlimited().charge(u64::MAX).is_ok());
    }

    #[test]
    fn process_limit_is_sane() {
        let limit = process_lock_limit();
        if has_cap_ipc_lock() {
            assert_eq!(limit, u64::MAX);
        } else {
            assert!(limit > 0);
        }
    }

    #[test]
    fn pin_mode_parses() {
        assert_eq!("lock".parse::<PinMode>().unwrap(), PinMode::Lock);
        assert!("mlock".parse::<PinMode>().is_err());
        assert_eq!(PinMode::Track.to_string(), "track");
        assert_eq!("kernel".parse::<PinMode>().unwrap().to_string(), "kernel");
    }
}
