//! The warnings a control request makes the daemon log, kept for its answer.
//!
//! A device warns through `log` while it is made (nvme's RAM namespaces larger than the host's
//! memory, say), and that reached only the daemon's log: the operator who ran `umdev start`
//! never saw it. The daemon's logger is wrapped in [`Capturing`], and the control socket
//! serves each request inside [`collect`]: every warning or error logged on the serving
//! thread meanwhile goes to the log as before and is also kept, and the answer carries it
//! (`ControlResponse::warnings`) for the command to print.
//!
//! Only the serving thread's records are kept: what the threads a device starts log later
//! is about its running, not about the request.

use std::cell::RefCell;

use log::{Level, Log, Metadata, Record};

/// Most warnings one answer carries; past them, one line says how many more the log has (a
/// device that warns in a loop must not make the answer unbounded).
pub const MAX_WARNINGS: usize = 32;

/// Most bytes of one warning an answer carries (the rest is in the log).
const MAX_WARNING_BYTES: usize = 4096;

/// What the current thread keeps while in [`collect`].
#[derive(Default)]
struct Kept {
    warnings: Vec<String>,
    /// Warnings past [`MAX_WARNINGS`].
    more: usize,
}

thread_local! {
    static KEPT: RefCell<Option<Kept>> = const { RefCell::new(None) };
}

/// Puts the thread's previous collection back however `collect`'s closure ends (a panic in
/// a request must not leave the thread collecting for good).
struct Restore(Option<Kept>);

impl Drop for Restore {
    fn drop(&mut self) {
        let outer = self.0.take();
        KEPT.with(|k| *k.borrow_mut() = outer);
    }
}

/// Runs `f`, and returns what it returned with the warnings and errors logged on this thread
/// meanwhile (through a [`Capturing`] logger), at most [`MAX_WARNINGS`] of them.
pub fn collect<R>(f: impl FnOnce() -> R) -> (R, Vec<String>) {
    let _restore = Restore(KEPT.with(|k| k.replace(Some(Kept::default()))));
    let result = f();
    let kept = KEPT.with(|k| k.replace(None)).unwrap_or_default();
    let mut warnings = kept.warnings;
    if kept.more > 0 {
        warnings.push(format!("... and {} more warning(s): see the daemon's log", kept.more));
    }
    (result, warnings)
}

/// Keeps `record` if this thread is in [`collect`] and it is a warning or an error.
fn keep(record: &Record) {
    if record.level() > Level::Warn {
        return;
    }
    // A logger that logs while a warning is kept (none does) would find the cell borrowed:
    // that record is only logged. So is one logged while the thread ends, once the cell is
    // destroyed (by another thread-local's destructor): `with` would panic there, and a
    // panic in a thread-local's destructor aborts the process.
    let _ = KEPT.try_with(|k| {
        let Ok(mut kept) = k.try_borrow_mut() else { return };
        let Some(kept) = kept.as_mut() else { return };
        if kept.warnings.len() >= MAX_WARNINGS {
            kept.more += 1;
            return;
        }
        let mut text = record.args().to_string();
        if text.len() > MAX_WARNING_BYTES {
            let mut end = MAX_WARNING_BYTES;
            while !text.is_char_boundary(end) {
                end -= 1;
            }
            text.truncate(end);
            text.push_str("...");
        }
        kept.warnings.push(text);
    });
}

/// A logger that logs through `L` and keeps, for [`collect`], the warnings and errors logged
/// on a collecting thread, whatever `L`'s filter lets through (an operator's `RUST_LOG=error`
/// hides a warning from the daemon's log, not from the command it is about). The process's
/// maximum level must let warnings through for them to reach it (`log::set_max_level`).
pub struct Capturing<L>(pub L);

impl<L: Log> Log for Capturing<L> {
    fn enabled(&self, metadata: &Metadata) -> bool {
        self.0.enabled(metadata)
    }

    fn log(&self, record: &Record) {
        keep(record);
        self.0.log(record);
    }

    fn flush(&self) {
        self.0.flush();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Logs nothing: what [`Capturing`] keeps is all there is.
    struct Silent;

    impl Log for Silent {
        fn enabled(&self, _: &Metadata) -> bool {
            false
        }
        fn log(&self, _: &Record) {}
        fn flush(&self) {}
    }

    fn log(logger: &Capturing<Silent>, level: Level, text: &str) {
        logger.log(&Record::builder().level(level).args(format_args!("{text}")).build());
    }

    #[test]
    fn warnings_logged_while_collecting_on_this_thread_are_kept() {
        let logger = Capturing(Silent);
        log(&logger, Level::Warn, "before: not kept");
        let ((), kept) = collect(|| {
            log(&logger, Level::Info, "info: not kept");
            log(&logger, Level::Warn, "a warning");
            log(&logger, Level::Error, "an error");
            // Another thread's warning is not this request's.
            std::thread::scope(|s| {
                s.spawn(|| log(&logger, Level::Warn, "another thread's"));
            });
        });
        assert_eq!(kept, ["a warning", "an error"]);
        log(&logger, Level::Warn, "after: not kept");
        assert_eq!(collect(|| ()).1, Vec::<String>::new());
    }

    #[test]
    fn what_is_kept_is_bounded() {
        let logger = Capturing(Silent);
        let ((), kept) = collect(|| {
            for i in 0..MAX_WARNINGS + 3 {
                log(&logger, Level::Warn, &format!("warning {i}"));
            }
        });
        assert_eq!(kept.len(), MAX_WARNINGS + 1);
        assert_eq!(kept[MAX_WARNINGS], "... and 3 more warning(s): see the daemon's log");
        let long = "é".repeat(MAX_WARNING_BYTES);
        let ((), kept) = collect(|| log(&logger, Level::Warn, &long));
        assert!(kept[0].len() <= MAX_WARNING_BYTES + 3 && kept[0].ends_with("..."), "{}", kept[0].len());
    }

    #[test]
    fn a_panic_while_collecting_leaves_the_thread_as_it_was() {
        let logger = Capturing(Silent);
        let ((), outer) = collect(|| {
            let inner = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                collect(|| {
                    log(&logger, Level::Warn, "inner");
                    panic!("a request that panics");
                })
            }));
            assert!(inner.is_err());
            log(&logger, Level::Warn, "outer");
        });
        assert_eq!(outer, ["outer"]);
    }

    /// Set in the child process of [`a_warning_logged_as_a_thread_ends_is_only_logged`].
    const AS_THREAD_ENDS: &str = "UMDEV_TEST_WARNING_AS_THREAD_ENDS";

    /// What a thread-local's destructor logs goes through a [`Capturing`] logger.
    static LATE_LOGGER: Capturing<Silent> = Capturing(Silent);

    /// Logs a warning when dropped (as its thread ends).
    struct WarnsOnDrop;

    impl Drop for WarnsOnDrop {
        fn drop(&mut self) {
            log(&LATE_LOGGER, Level::Warn, "logged as the thread ends");
        }
    }

    thread_local! {
        static BEFORE: WarnsOnDrop = const { WarnsOnDrop };
        static AFTER: WarnsOnDrop = const { WarnsOnDrop };
    }

    /// A warning logged by a thread-local's destructor after the thread's collection cell is
    /// gone is only logged: keeping it must not panic (a panic there aborts the process). Run
    /// in a child process of this test binary, whose abort fails the test instead of ending
    /// the whole run.
    #[test]
    fn a_warning_logged_as_a_thread_ends_is_only_logged() {
        if std::env::var_os(AS_THREAD_ENDS).is_some() {
            // One destructor registered before the cell's and one after: whichever order the
            // platform runs them in, one logs once the cell is destroyed.
            std::thread::spawn(|| {
                BEFORE.with(|_| ());
                assert_eq!(collect(|| log(&LATE_LOGGER, Level::Warn, "kept")).1, ["kept"]);
                AFTER.with(|_| ());
            })
            .join()
            .unwrap();
            return;
        }
        let name = "warnings::tests::a_warning_logged_as_a_thread_ends_is_only_logged";
        let child = std::process::Command::new(std::env::current_exe().unwrap())
            .args(["--exact", name, "--test-threads=1"])
            .env(AS_THREAD_ENDS, "1")
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&child.stdout);
        assert!(
            child.status.success() && stdout.contains("1 passed"),
            "{:?}\n{stdout}\n{}",
            child.status,
            String::from_utf8_lossy(&child.stderr)
        );
    }
}
