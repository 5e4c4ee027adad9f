//! Short scheduler slices, asked for, for the threads that wait for a client: the framework's
//! workers and the server's connection threads.
//!
//! These threads sleep most of the time and run briefly when woken (a doorbell, a finished
//! transfer, a message), and the client waits on them while they run. On a host whose CPUs
//! are busy (a VMM's vCPU threads beside them, 2 CPUs for 2 vCPUs), the kernel's fair
//! scheduler (EEVDF, Linux 6.6 and later) lets a woken thread run at once only if its virtual
//! deadline is earlier than the running thread's; with the default slice (0.7-3 ms, by
//! CPUs) a woken worker often waits for the running vCPU thread's slice to end. Linux 6.12
//! and later take a slice per thread (`sched_setattr`'s `sched_runtime` for SCHED_OTHER):
//! with a short one a woken worker's deadline comes first and it preempts at once. Its share
//! of the CPU is unchanged (that is its weight, its nice value, which stays).
//!
//! It is not the default, because it cuts both ways (docs/benchmarks.md): two fio jobs at
//! QD1 in a TCG guest, one per vCPU, went from 0.77-0.83x QEMU's own nvme to 0.94-0.97x with
//! a 100 µs slice, but a client that sleeps on its interrupt between commands beside the
//! server on the same CPUs (`umdev nvmebench`) lost a fifth of its QD1 rate: there the woken
//! worker preempts the thread that has just rung it, which the scheduler cannot tell from
//! any other. `UMDEV_SLICE_US=N` asks for N microseconds (the kernel takes 100 to 100000);
//! unset or `0`, the kernel's default. Older kernels accept the call and ignore the slice;
//! where the call is refused (a seccomp filter), the threads keep the default, said once at
//! debug.

use std::sync::OnceLock;
use std::time::Duration;

/// `struct sched_attr` (include/uapi/linux/sched/types.h), its first version's fields
/// (`SCHED_ATTR_SIZE_VER0`, 48 bytes): the kernel reads `size` bytes.
#[repr(C)]
#[derive(Default)]
struct SchedAttr {
    size: u32,
    policy: u32,
    flags: u64,
    nice: i32,
    priority: u32,
    runtime: u64,
    deadline: u64,
    period: u64,
}

/// The slice threads ask for, `UMDEV_SLICE_US`'s; `None` for the kernel's.
pub fn wanted() -> Option<Duration> {
    static WANTED: OnceLock<Option<Duration>> = OnceLock::new();
    *WANTED.get_or_init(|| from_env(std::env::var("UMDEV_SLICE_US").ok().as_deref()))
}

fn from_env(value: Option<&str>) -> Option<Duration> {
    match value?.trim().parse::<u64>() {
        Ok(0) => None,
        Ok(us) => Some(Duration::from_micros(us)),
        Err(_) => {
            log::warn!("UMDEV_SLICE_US={value:?} is not a number of microseconds: the kernel's slice kept");
            None
        }
    }
}

/// Gives the calling thread the wanted slice ([`wanted`]), if any (see `ask`).
/// The framework's workers call it as they start; a thread of a device's own that waits for
/// the client may call it too.
pub fn short_slice() {
    let Some(slice) = wanted() else { return };
    if let Err(e) = ask(slice) {
        static SAID: OnceLock<()> = OnceLock::new();
        SAID.get_or_init(|| log::debug!("the kernel's default scheduler slice kept: sched_setattr: {e}"));
    }
}

/// Asks the kernel for `slice` for the calling thread, if its policy is a fair one
/// (SCHED_OTHER or SCHED_BATCH: a slice means nothing to the others, and a thread the
/// administrator made real-time or idle stays so), its policy, nice value and
/// reset-on-fork flag kept.
fn ask(slice: Duration) -> std::io::Result<()> {
    const SCHED_FLAG_RESET_ON_FORK: u64 = 0x01;
    let size = std::mem::size_of::<SchedAttr>() as u32;
    let mut attr = SchedAttr::default();
    // SAFETY: sched_getattr(0, &mut attr, size, 0) writes at most `size` bytes (the struct's
    // own size) into a live local, about the calling thread.
    let rc = unsafe { libc::syscall(libc::SYS_sched_getattr, 0, &mut attr as *mut SchedAttr, size, 0) };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    if attr.policy != libc::SCHED_OTHER as u32 && attr.policy != libc::SCHED_BATCH as u32 {
        return Ok(());
    }
    attr.size = size;
    attr.flags &= SCHED_FLAG_RESET_ON_FORK;
    attr.runtime = u64::try_from(slice.as_nanos()).unwrap_or(u64::MAX);
    // SAFETY: sched_setattr(0, &mut attr, 0) reads `attr.size` bytes of a live local of that
    // size (and, were the size refused with E2BIG, writes the kernel's size into it, which
    // is why it is passed mutable) and changes only the calling thread's scheduling.
    let rc = unsafe { libc::syscall(libc::SYS_sched_setattr, 0, &mut attr as *mut SchedAttr, 0) };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_environment_picks_the_slice() {
        assert_eq!(from_env(None), None);
        assert_eq!(from_env(Some("0")), None);
        assert_eq!(from_env(Some("250")), Some(Duration::from_micros(250)));
        assert_eq!(from_env(Some(" 100 ")), Some(Duration::from_micros(100)));
        assert_eq!(from_env(Some("soon")), None);
    }

    /// The slice the kernel holds for thread `tid` of this process, if it says (Linux 6.6
    /// and later show `se.slice` in /proc/self/task/TID/sched when built with scheduler
    /// debugging, as distribution kernels are).
    fn slice_of_this_thread() -> Option<u64> {
        // SAFETY: gettid has no preconditions.
        let tid = unsafe { libc::gettid() };
        let sched = std::fs::read_to_string(format!("/proc/self/task/{tid}/sched")).ok()?;
        let line = sched.lines().find(|l| l.trim_start().starts_with("se.slice"))?;
        line.split(':').nth(1)?.trim().parse().ok()
    }

    /// Linux 6.12 or later: `sched_runtime` sets a SCHED_OTHER thread's slice.
    fn takes_slices() -> bool {
        let release = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
        let mut parts = release.trim().split(['.', '-']).map(|p| p.parse::<u32>().unwrap_or(0));
        (parts.next().unwrap_or(0), parts.next().unwrap_or(0)) >= (6, 12)
    }

    #[test]
    fn a_thread_of_another_policy_keeps_it() {
        for policy in [libc::SCHED_BATCH, libc::SCHED_IDLE] {
            std::thread::spawn(move || {
                let param = libc::sched_param { sched_priority: 0 };
                // SAFETY: sets the calling thread's policy (both are open to any thread).
                assert_eq!(unsafe { libc::sched_setscheduler(0, policy, &param) }, 0);
                ask(Duration::from_micros(300)).unwrap();
                // SAFETY: reads the calling thread's policy.
                assert_eq!(unsafe { libc::sched_getscheduler(0) }, policy);
                let after = slice_of_this_thread();
                if policy == libc::SCHED_BATCH && takes_slices() && after.is_some() {
                    assert_eq!(after, Some(300_000), "a batch thread is a fair one: it takes the slice");
                }
            })
            .join()
            .unwrap();
        }
    }

    #[test]
    fn a_thread_gets_the_slice_and_keeps_its_nice_value() {
        std::thread::spawn(|| {
            // SAFETY: setpriority/getpriority on the calling thread only.
            let nice = unsafe {
                libc::setpriority(libc::PRIO_PROCESS, 0, 3);
                libc::getpriority(libc::PRIO_PROCESS, 0)
            };
            let before = slice_of_this_thread();
            ask(Duration::from_micros(300)).unwrap();
            // SAFETY: as above.
            assert_eq!(unsafe { libc::getpriority(libc::PRIO_PROCESS, 0) }, nice, "nice kept");
            // SAFETY: sched_getscheduler on the calling thread only.
            assert_eq!(unsafe { libc::sched_getscheduler(0) }, libc::SCHED_OTHER, "policy kept");
            let after = slice_of_this_thread();
            if takes_slices() && after.is_some() {
                assert_eq!(after, Some(300_000), "from {before:?}");
            } else {
                eprintln!("this kernel takes no slices or does not show them ({before:?} -> {after:?})");
            }
        })
        .join()
        .unwrap();
    }
}
