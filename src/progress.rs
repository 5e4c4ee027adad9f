//! A benchmark's progress on stderr while it runs: a bar (indicatif) where stderr is a
//! terminal, else one line per step, so a log shows how far it got. Results go to stdout.

use std::io::IsTerminal;

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

/// Steps of one benchmark.
pub struct Progress {
    what: &'static str,
    total: u64,
    done: u64,
    bar: Option<ProgressBar>,
}

impl Progress {
    /// `total` steps of the benchmark `what` (`nvmebench`).
    pub fn new(what: &'static str, total: usize) -> Progress {
        let total = total as u64;
        let bar = std::io::stderr().is_terminal().then(|| {
            let bar = ProgressBar::with_draw_target(Some(total), ProgressDrawTarget::stderr());
            if let Ok(style) =
                ProgressStyle::with_template("{prefix} [{bar:30}] {pos}/{len} {elapsed} {wide_msg}")
            {
                bar.set_style(style.progress_chars("=> "));
            }
            bar.set_prefix(what);
            bar
        });
        Progress { what, total, done: 0, bar }
    }

    /// The next step begins.
    pub fn step(&mut self, step: impl std::fmt::Display) {
        self.done += 1;
        match &self.bar {
            Some(bar) => {
                bar.set_position(self.done - 1);
                bar.set_message(step.to_string());
            }
            None => eprintln!("umdev {}: [{}/{}] {step}", self.what, self.done, self.total),
        }
    }
}

impl Drop for Progress {
    fn drop(&mut self) {
        if let Some(bar) = &self.bar {
            bar.finish_and_clear();
        }
    }
}
