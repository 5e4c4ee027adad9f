//! Pinning the calling thread to CPUs, for benchmarks that compare placements. Threads
//! created afterwards inherit the affinity.

use nix::sched::{sched_setaffinity, CpuSet};
use nix::unistd::Pid;

/// Pins the calling thread to `cpu`.
pub fn pin_to(cpu: usize) -> Result<(), String> {
    let mut set = CpuSet::new();
    set.set(cpu).map_err(|e| e.to_string())?;
    sched_setaffinity(Pid::from_raw(0), &set).map_err(|e| format!("sched_setaffinity({cpu}): {e}"))
}

/// Lets the calling thread run on every CPU again.
pub fn unpin() -> Result<(), String> {
    let mut set = CpuSet::new();
    for cpu in 0..cpus() {
        set.set(cpu).map_err(|e| e.to_string())?;
    }
    sched_setaffinity(Pid::from_raw(0), &set).map_err(|e| e.to_string())
}

/// CPUs online (not `available_parallelism`, which shrinks while the caller is pinned).
pub fn cpus() -> usize {
    match nix::unistd::sysconf(nix::unistd::SysconfVar::_NPROCESSORS_ONLN) {
        Ok(Some(n)) if n > 0 => n as usize,
        _ => 1,
    }
}
