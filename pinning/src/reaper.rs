//! Spaces with pins that nobody is left to let go of: closed spaces that still had
//! track-mode records when their last handle went, and mappings `abandon_all` took while
//! records still named them.
//!
//! A guard of a small record lets go of it without its shard's lock when the space is not
//! closing (see `shards::SmallRecord`); a guard that sees the space closed retires its record
//! under the lock and lets go of the space if it was the last. One that looked just before
//! the space closed and let go just after leaves its shard holding the space with nothing
//! left to retire it; and one that let go just as `abandon_all` looked leaves its mapping
//! (guest memory) mapped. Such a guard can tell nobody: after its release it may touch
//! nothing (DESIGN.md I5). So the reaper looks at such a space every [`REAP_EVERY`]
//! ([`Reap::reap`]) until nothing is left to wait for: that is the bound on how long it
//! outlives its last record (I8).
//!
//! One thread for the process, started with the first such space and ended with the last.

use std::sync::{Mutex, Weak};
use std::time::Duration;

/// What the reaper watches: a space with records nobody is left to retire.
pub(crate) trait Reap: Send + Sync {
    /// Lets go of what no record holds any more; true if there is more to wait for.
    fn reap(&self) -> bool;
}

/// How often the reaper looks at the spaces it watches.
pub(crate) const REAP_EVERY: Duration = Duration::from_millis(50);

/// The spaces watched, and whether the thread runs.
static WATCHED: Mutex<Watched> = Mutex::new(Watched { spaces: Vec::new(), running: false });

struct Watched {
    spaces: Vec<Weak<dyn Reap>>,
    running: bool,
}

/// Watches a space whose shards still hold it closed, or whose orphans records still name.
pub(crate) fn watch(space: Weak<dyn Reap>) {
    let mut watched = crate::sync::lock(&WATCHED);
    if !watched.spaces.iter().any(|w| w.ptr_eq(&space)) {
        watched.spaces.push(space);
    }
    if watched.running {
        return;
    }
    let started = std::thread::Builder::new().name("umdev-pin-reaper".into()).spawn(run);
    match started {
        Ok(_) => watched.running = true,
        // Without the thread, such a space's memory stays mapped until a later watch starts
        // one (or the process ends).
        Err(e) => log::error!("cannot start the pin reaper thread: {e}"),
    }
}

fn run() {
    loop {
        std::thread::sleep(REAP_EVERY);
        let spaces = std::mem::take(&mut crate::sync::lock(&WATCHED).spaces);
        let mut kept = Vec::new();
        for weak in spaces {
            // A panic while letting go of a space (its notifier's drop, say) must not stop
            // the reaper for every other space: it is logged and the space watched again.
            let reaped = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                // Gone already: its last record retired under its shard's lock.
                let Some(space) = weak.upgrade() else { return false };
                let more = space.reap();
                // May be the last reference: the space goes here.
                drop(space);
                more
            }));
            match reaped {
                Ok(false) => {}
                Ok(true) => kept.push(weak),
                Err(_) => {
                    log::error!("letting go of a pinning space panicked; watching it again");
                    kept.push(weak);
                }
            }
        }
        let mut watched = crate::sync::lock(&WATCHED);
        watched.spaces.extend(kept);
        if watched.spaces.is_empty() {
            watched.running = false;
            return;
        }
    }
}
