//! Where log lines and the daemon's status lines go, and how they look.
//!
//! In a terminal: `log` records through env_logger as before (RUST_LOG, warnings and errors by
//! default), status lines as `umdev: ...`. Under systemd's journal: every line starts with its
//! sd-daemon(3) syslog priority (`<3>` error, `<4>` warning, `<6>` info, `<7>` debug), so
//! `journalctl -p` can tell them apart; info and up by default, since the journal keeps and
//! filters them.

use std::io::Write;

use log::{Level, LevelFilter, Log, Metadata, Record};

/// The target of status lines: what `umdev` tells its user (the daemon's state, a command's
/// error). They are shown whatever RUST_LOG says, as the plain `eprintln!` they replace were.
pub const STATUS: &str = umdev::STATUS;

/// `--log-format`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum LogFormat {
    /// `journal` when stderr is systemd's journal stream ($JOURNAL_STREAM), else `terminal`.
    Auto,
    /// env_logger's lines; status lines as `umdev: ...`.
    Terminal,
    /// One `<N>`-prefixed line per line of text, N the syslog priority.
    Journal,
}

/// Installs the logger for `format`.
pub fn init(format: LogFormat) {
    let journal = match format {
        LogFormat::Auto => stderr_is_journal(),
        LogFormat::Terminal => false,
        LogFormat::Journal => true,
    };
    let default = if journal { "info" } else { "warn" };
    let mut builder = env_logger::Builder::from_env(env_logger::Env::default().default_filter_or(default));
    if journal {
        builder.format(|buf, record| buf.write_all(journal_lines(record).as_bytes()));
    }
    let inner = builder.build();
    // Status lines are info or above, whatever the filter lets through of the rest.
    let max = inner.filter().max(LevelFilter::Info);
    // Warnings the daemon logs while it serves a control request also go back to the command
    // that made it (umdev::warnings); the maximum level below lets them all through.
    let logger = umdev::warnings::Capturing(Logger { inner, journal });
    if log::set_boxed_logger(Box::new(logger)).is_ok() {
        log::set_max_level(max);
    }
}

struct Logger {
    inner: env_logger::Logger,
    journal: bool,
}

impl Log for Logger {
    fn enabled(&self, metadata: &Metadata) -> bool {
        metadata.target() == STATUS || self.inner.enabled(metadata)
    }

    fn log(&self, record: &Record) {
        if record.target() != STATUS {
            return self.inner.log(record);
        }
        let text = if self.journal { journal_lines(record) } else { format!("umdev: {}\n", record.args()) };
        // Nowhere left to report a failing stderr.
        let _ = std::io::stderr().lock().write_all(text.as_bytes());
    }

    fn flush(&self) {
        self.inner.flush();
    }
}

/// The syslog priority of `level`, as sd-daemon(3) prefixes it.
pub fn priority(level: Level) -> u8 {
    match level {
        Level::Error => 3,
        Level::Warn => 4,
        Level::Info => 6,
        Level::Debug | Level::Trace => 7,
    }
}

/// `record` as journal lines: each line prefixed, since journald reads a priority per line.
/// Debug lines name their module (the journal names only the unit).
fn journal_lines(record: &Record) -> String {
    let prio = priority(record.level());
    let text = match record.level() {
        Level::Debug | Level::Trace if record.target() != STATUS => {
            format!("{}: {}", record.target(), record.args())
        }
        _ => record.args().to_string(),
    };
    text.lines().map(|line| format!("<{prio}>{line}\n")).collect()
}

/// True if stderr is the stream systemd connected to the journal. `$JOURNAL_STREAM` holds its
/// `device:inode`; comparing with stderr's own tells a service's stderr from that of a program
/// that merely inherited the variable (systemd.exec(5)).
fn stderr_is_journal() -> bool {
    let Some(stream) = std::env::var_os("JOURNAL_STREAM") else { return false };
    let Some((dev, ino)) = stream.to_str().and_then(|s| s.split_once(':')) else { return false };
    let Ok(stat) = nix::sys::stat::fstat(std::io::stderr()) else { return false };
    dev.parse::<u64>().ok() == Some(stat.st_dev) && ino.parse::<u64>().ok() == Some(stat.st_ino)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lines(level: Level, target: &str, text: &str) -> String {
        journal_lines(&Record::builder().level(level).target(target).args(format_args!("{text}")).build())
    }

    #[test]
    fn journal_lines_carry_a_priority_on_every_line() {
        assert_eq!(lines(Level::Error, STATUS, "bad"), "<3>bad\n");
        assert_eq!(lines(Level::Warn, "umdev::lifecycle", "a\nb"), "<4>a\n<4>b\n");
        assert_eq!(lines(Level::Info, "x", "up"), "<6>up\n");
        assert_eq!(lines(Level::Debug, "umdev::control", "hi"), "<7>umdev::control: hi\n");
        assert_eq!(lines(Level::Trace, "t", "deep"), "<7>t: deep\n");
    }
}
