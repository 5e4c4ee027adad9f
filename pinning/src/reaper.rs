//! Closed spaces that still had track-mode records when their last handle went.
//!
//! A guard of a small record lets go of it without its slot's lock when the space is not
//! closing (see `slots::SmallRecord`); a guard that sees the space closed retires its record
//! under the lock and lets go of the space if it was the last. One that looked just before
//! the space closed and let go just after leaves its slot holding the space with nothing
//! left to retire it. The reaper catches that: a closed space that kept records is looked
//! at every [`REAP_EVERY`] until its slots hold nothing, and then let go.
//!
//! One thread for the process, started with the first such space and ended with the last.

use std::sync::{Mutex, Weak};
use std::time::Duration;

use crate::space::SpaceInner;

/// How often the reaper looks at the spaces it watches.
pub(crate) const REAP_EVERY: Duration = Duration::from_millis(50);

/// The spaces watched, and whether the thread runs.
static WATCHED: Mutex<Watched> = Mutex::new(Watched { spaces: Vec::new(), running: false });

struct Watched {
    spaces: Vec<Weak<SpaceInner>>,
    running: bool,
}

/// Watches a closed space whose slots still hold it.
pub(crate) fn watch(space: Weak<SpaceInner>) {
    let mut watched = crate::sync::lock(&WATCHED);
    watched.spaces.push(space);
    if watched.running {
        return;
    }
    let started = std::thread::Builder::new().name("umdev-pin-reaper".into()).spawn(run);
    match started {
        Ok(_) => watched.running = true,
        // Without the thread, such a space's memory stays mapped until the process ends.
        Err(e) => log::error!("cannot start the pin reaper thread: {e}"),
    }
}

fn run() {
    loop {
        std::thread::sleep(REAP_EVERY);
        let spaces = std::mem::take(&mut crate::sync::lock(&WATCHED).spaces);
        let mut kept = Vec::new();
        for weak in spaces {
            // Gone already: its last record retired under its slot's lock.
            let Some(space) = weak.upgrade() else { continue };
            if space.release_idle_slots() {
                kept.push(weak);
            }
            // May be the last reference: the space goes here.
            drop(space);
        }
        let mut watched = crate::sync::lock(&WATCHED);
        watched.spaces.extend(kept);
        if watched.spaces.is_empty() {
            watched.running = false;
            return;
        }
    }
}
