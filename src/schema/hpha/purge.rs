//! When free memory goes back to the page source: a delay, counted in epochs.
//!
//! Memory that becomes free (an empty page, an empty chunk, a large free block) is stamped
//! with the current epoch. The epoch advances at most once per `delay`; a purge pass then
//! returns everything stamped before the previous epoch, so memory is given back once it has
//! been idle for at least one delay, and memory that is reused quickly is never purged.
//!
//! The clock is read only on slow paths (refills, flushes, large blocks), and only every
//! [`EVENTS_PER_CLOCK_READ`]th time, so the policy costs nothing on the fast path. A program
//! that goes idle stops triggering passes; `garbage_collect` purges everything at once.

use crate::os::monotonic_ms;
use core::sync::atomic::{AtomicU32, AtomicU64, Ordering::Relaxed};

/// `delay_ms` value meaning "only on `garbage_collect`".
pub(crate) const NEVER: u64 = u64::MAX;
/// Slow-path events between two clock reads.
const EVENTS_PER_CLOCK_READ: u32 = 32;

/// The purge policy's state: delay, epoch and when the next epoch starts.
pub(crate) struct PurgeClock {
    delay_ms: AtomicU64,
    next_tick_ms: AtomicU64,
    epoch: AtomicU64,
    events: AtomicU32,
}

/// Which stamps a purge pass returns: those strictly before `before`.
#[derive(Clone, Copy)]
pub(crate) struct Cutoff {
    pub before: u64,
}

impl Cutoff {
    /// Everything, whatever its stamp.
    pub(crate) const ALL: Cutoff = Cutoff { before: u64::MAX };

    /// Whether this is [`ALL`](Self::ALL) (what `garbage_collect` gives back).
    pub(crate) fn is_all(self) -> bool {
        self.before == u64::MAX
    }

    #[inline]
    pub(crate) fn covers(self, stamp: u64) -> bool {
        stamp < self.before
    }
}

impl PurgeClock {
    pub(crate) const fn new(delay_ms: u64) -> Self {
        Self {
            delay_ms: AtomicU64::new(delay_ms),
            next_tick_ms: AtomicU64::new(0),
            epoch: AtomicU64::new(1),
            events: AtomicU32::new(0),
        }
    }

    pub(crate) fn set_delay_ms(&self, delay_ms: u64) {
        self.delay_ms.store(delay_ms, Relaxed);
        self.next_tick_ms.store(0, Relaxed);
    }

    pub(crate) fn delay_ms(&self) -> u64 {
        self.delay_ms.load(Relaxed)
    }

    /// The stamp for memory becoming free now.
    #[inline]
    pub(crate) fn stamp(&self) -> u64 {
        self.epoch.load(Relaxed)
    }

    /// Counts a slow-path event. Returns the cutoff of a purge pass when one is due.
    #[inline]
    pub(crate) fn event(&self) -> Option<Cutoff> {
        let delay = self.delay_ms.load(Relaxed);
        if delay == NEVER {
            return None;
        }
        if delay != 0 && self.events.fetch_add(1, Relaxed) % EVENTS_PER_CLOCK_READ != 0 {
            return None;
        }
        self.tick(delay)
    }

    #[cold]
    fn tick(&self, delay: u64) -> Option<Cutoff> {
        let now = monotonic_ms();
        let next = self.next_tick_ms.load(Relaxed);
        if now < next {
            return None;
        }
        self.next_tick_ms
            // Saturating: a delay of centuries (up to `NEVER - 1`) means "not in this run",
            // not an overflow (a panic in a debug build, a tick in the past in release).
            .compare_exchange(next, now.saturating_add(delay.max(1)), Relaxed, Relaxed)
            .ok()?;
        let epoch = self.epoch.fetch_add(1, Relaxed) + 1;
        Some(if delay == 0 {
            Cutoff::ALL
        } else {
            // Stamped before the previous tick: idle for at least one delay.
            Cutoff { before: epoch - 1 }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Events until the clock is read (the first event reads it).
    fn events_until_a_read(clock: &PurgeClock) -> Vec<Option<Cutoff>> {
        (0..=EVENTS_PER_CLOCK_READ).map(|_| clock.event()).collect()
    }

    #[test]
    fn a_delay_of_centuries_starts_one_epoch_and_then_waits() {
        let clock = PurgeClock::new(NEVER - 1);
        let cutoffs = events_until_a_read(&clock);
        // The first read starts the first epoch (nothing is stamped before it); the next
        // tick is then as far away as the clock can say, not wrapped into the past.
        assert!(cutoffs[0].is_some_and(|c| !c.covers(1)));
        assert!(cutoffs[1..].iter().all(Option::is_none));
        assert_eq!(clock.next_tick_ms.load(Relaxed), u64::MAX);
        assert!(events_until_a_read(&clock).iter().all(Option::is_none));
    }

    #[test]
    fn never_purges_only_on_demand() {
        let clock = PurgeClock::new(NEVER);
        assert!(events_until_a_read(&clock).iter().all(Option::is_none));
    }
}
