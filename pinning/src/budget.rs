//! The space's pin budget and its counters.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use crate::account::{LockAccount, PinMode};
use crate::counters::{Counters, LockCounts};
use crate::mapping::MappingPins;
use crate::shard::PerShard;

/// How the mappings of one space pin, and what they count: shared by all of them.
#[derive(Debug)]
pub(crate) struct PinPolicy {
    pub(crate) mode: PinMode,
    pub(crate) account: Arc<LockAccount>,
    /// Counters, one set per thread shard, summed when read.
    pub(crate) counters: PerShard<Counters>,
    /// Pins held across the space plus the unused stock of its track-mode shards and of its
    /// mappings (lock mode), against `max_pins`.
    pub(crate) held: crossbeam::utils::CachePadded<AtomicU64>,
    pub(crate) max_pins: u64,
    /// Mappings that have left the table (moving their lock-mode counts here). `stats` sums
    /// the space's counters and its mappings' without holding the table, and sums again if
    /// this changed meanwhile.
    pub(crate) departures: AtomicU64,
}

/// Pins a shard (track mode) or a mapping (lock mode) reserves from the space's count at a time.
pub(crate) const PIN_STOCK: u64 = 4096;

impl PinPolicy {
    pub(crate) fn new(mode: PinMode, account: Arc<LockAccount>, max_pins: u64) -> Self {
        PinPolicy {
            mode,
            account,
            counters: PerShard::default(),
            held: Default::default(),
            max_pins,
            departures: AtomicU64::new(0),
        }
    }

    /// This thread's counters.
    #[inline]
    pub(crate) fn counters(&self) -> &Counters {
        self.counters.here()
    }

    /// Takes `pins` from the space's count; `Err(held)` if they do not fit.
    pub(crate) fn take(&self, pins: u64) -> Result<(), u64> {
        self.held
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |held| {
                held.checked_add(pins).filter(|&total| total <= self.max_pins)
            })
            .map(drop)
    }

    /// Adds a mapping's lock-mode counters to this thread's (rarely: as it leaves the table).
    pub(crate) fn add_counts(&self, counts: &LockCounts) {
        let c = self.counters();
        for (counter, n) in [
            (&c.pin_calls, counts.pin_calls),
            (&c.unpin_calls, counts.unpin_calls),
            (&c.runs, counts.runs),
            (&c.pages, counts.pages),
            (&c.mlock_calls, counts.mlock_calls),
            (&c.munlock_calls, counts.munlock_calls),
            (&c.munlock_failures, counts.munlock_failures),
        ] {
            if n != 0 {
                counter.fetch_add(n, Ordering::Relaxed);
            }
        }
    }

    /// Gives `pins` back to the space's count.
    pub(crate) fn give(&self, pins: u64) {
        if pins != 0 {
            self.held.fetch_sub(pins, Ordering::AcqRel);
        }
    }

    /// Reserves `pins` for a lock-mode call from the stock of its first mapping (`mapping`,
    /// locked by the caller), refilling the stock from the space's count when short;
    /// `Err(held)` if the space's count cannot give them. A mapping that has left the table
    /// keeps no stock: its calls take exactly their pins.
    ///
    /// The caller, refused, takes back every mapping's unused stock and tries once more, so
    /// a call fails only if the pins held, plus stock taken by other calls meanwhile, leave
    /// no room.
    pub(crate) fn reserve_in(&self, mapping: &mut MappingPins, pins: u64) -> Result<(), u64> {
        if let Some(left) = mapping.stock.checked_sub(pins) {
            mapping.stock = left;
            return Ok(());
        }
        // The stock goes into the call; the count gives the rest, and a new stock if it can.
        let short = pins - mapping.stock;
        let refill = if mapping.left { None } else { short.checked_add(PIN_STOCK) };
        if refill.is_some_and(|more| self.take(more).is_ok()) {
            mapping.stock = PIN_STOCK;
            return Ok(());
        }
        self.take(short)?;
        mapping.stock = 0;
        Ok(())
    }

    /// Returns pins a lock-mode call reserved with [`PinPolicy::reserve_in`] to the same
    /// mapping's stock (the surplus beyond two stocks' worth, or all of it once the mapping
    /// has left the table, back to the space).
    pub(crate) fn restock(&self, mapping: &mut MappingPins, pins: u64) {
        if mapping.left {
            self.give(pins);
            return;
        }
        mapping.stock += pins;
        if mapping.stock > 2 * PIN_STOCK {
            self.give(mapping.stock - PIN_STOCK);
            mapping.stock = PIN_STOCK;
        }
    }
}
