//! Tagged statistics: the counters every declared allocator keeps, and their snapshot.
//!
//! [`Counters`] is a handful of atomics in the allocator's `static`, updated on every
//! allocation and free from whichever thread makes the call, so figures stay exact when a
//! block is freed on another thread than the one that allocated it. An allocation does three
//! read-modify-writes (live granted bytes, live requested bytes, allocation count) and one
//! plain load (the peak); the `fetch_add` result on the live granted bytes feeds the peak
//! and the budget check, so the peak is the exact maximum the live figure reached. A free
//! does three read-modify-writes. Live blocks are derived (allocations − frees).
//!
//! [`AllocatorStats`] is the plain snapshot the reports read.

use core::sync::atomic::{AtomicU64, AtomicUsize, Ordering::Relaxed};

/// A consistent-enough copy of one allocator's figures, as plain numbers.
///
/// "Granted" bytes are what the allocator below really set aside for each block (its size
/// class or block size), "requested" bytes what callers asked for in their layouts. A
/// child's blocks are also blocks of its parent, so a parent's figures include its
/// children's.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct AllocatorStats {
    /// Bytes in live blocks, counted at their granted size.
    pub live_granted_bytes: usize,
    /// Bytes callers asked for in live blocks (`None` where the allocator does not know:
    /// the OS layer and the `SystemAllocator` behind `GlobalAlloc` count granted sizes only).
    pub live_requested_bytes: Option<usize>,
    /// Blocks allocated and not yet freed.
    pub live_blocks: usize,
    /// Allocations since start (zero-size requests get no memory and are not counted).
    pub allocations: u64,
    /// Frees since start.
    pub frees: u64,
    /// Resizes that kept the block alive (realloc, grow, shrink).
    pub reallocations: u64,
    /// The highest `live_granted_bytes` ever reached (`None` where not tracked).
    pub peak_granted_bytes: Option<usize>,
    /// Bytes held from the parent or the OS: live blocks plus whatever the allocator keeps
    /// for reuse (free slots in pool pages, free heap pages). A child holds nothing beyond
    /// its live blocks, so for a child this equals `live_granted_bytes`.
    pub reserved_bytes: usize,
    /// Allocations that found the allocator over its budget (see [`Budget`](crate::Budget)).
    pub over_budget: u64,
    /// Allocations refused because of the budget.
    pub budget_failures: u64,
}

/// The live counters of one tagged allocator; `const`-constructible, allocation-free.
///
/// Updates use relaxed atomics: each counter is exact on its own (every update is a single
/// read-modify-write), and a snapshot taken while no other thread allocates adds up
/// exactly. Under concurrent traffic a snapshot is a blend of nearby instants.
#[derive(Debug)]
pub struct Counters {
    live_granted: AtomicUsize,
    live_requested: AtomicUsize,
    peak_granted: AtomicUsize,
    allocations: AtomicU64,
    frees: AtomicU64,
    reallocations: AtomicU64,
    over_budget: AtomicU64,
    budget_failures: AtomicU64,
}

impl Counters {
    /// All counters at zero.
    pub const fn new() -> Self {
        Self {
            live_granted: AtomicUsize::new(0),
            live_requested: AtomicUsize::new(0),
            peak_granted: AtomicUsize::new(0),
            allocations: AtomicU64::new(0),
            frees: AtomicU64::new(0),
            reallocations: AtomicU64::new(0),
            over_budget: AtomicU64::new(0),
            budget_failures: AtomicU64::new(0),
        }
    }

    /// Adds `granted` live bytes and returns the new live total (before the peak is
    /// updated; call [`commit_allocation`](Self::commit_allocation) or
    /// [`undo_granted`](Self::undo_granted) next).
    #[inline]
    pub(crate) fn add_granted(&self, granted: usize) -> usize {
        self.live_granted
            .fetch_add(granted, Relaxed)
            .wrapping_add(granted)
    }

    /// Takes back bytes added by [`add_granted`](Self::add_granted) for an allocation that
    /// was refused.
    #[inline]
    pub(crate) fn undo_granted(&self, granted: usize) {
        self.live_granted.fetch_sub(granted, Relaxed);
    }

    /// Records a new block once its granted bytes are in: requested bytes, the count, and
    /// the peak (`live` is what [`add_granted`](Self::add_granted) returned).
    #[inline]
    pub(crate) fn commit_allocation(&self, requested: usize, live: usize) {
        self.live_requested.fetch_add(requested, Relaxed);
        self.allocations.fetch_add(1, Relaxed);
        self.raise_peak(live);
    }

    /// Records a freed block.
    #[inline]
    pub(crate) fn record_free(&self, granted: usize, requested: usize) {
        self.live_granted.fetch_sub(granted, Relaxed);
        self.live_requested.fetch_sub(requested, Relaxed);
        self.frees.fetch_add(1, Relaxed);
    }

    /// Records a block resized in place or moved: from `old` to `new` granted bytes and
    /// from `old_requested` to `new_requested` requested bytes. Returns the live granted
    /// bytes after the change.
    #[inline]
    pub(crate) fn record_resize(
        &self,
        old: usize,
        new: usize,
        old_requested: usize,
        new_requested: usize,
    ) -> usize {
        let live = if new >= old {
            let live = self.add_granted(new - old);
            self.raise_peak(live);
            live
        } else {
            self.live_granted
                .fetch_sub(old - new, Relaxed)
                .wrapping_sub(old - new)
        };
        if new_requested >= old_requested {
            self.live_requested
                .fetch_add(new_requested - old_requested, Relaxed);
        } else {
            self.live_requested
                .fetch_sub(old_requested - new_requested, Relaxed);
        }
        self.reallocations.fetch_add(1, Relaxed);
        live
    }

    /// Counts an allocation that found the allocator over budget.
    pub(crate) fn record_over_budget(&self) -> u64 {
        self.over_budget.fetch_add(1, Relaxed) + 1
    }

    /// Counts an allocation refused by the budget.
    pub(crate) fn record_budget_failure(&self) {
        self.budget_failures.fetch_add(1, Relaxed);
    }

    /// The live granted bytes right now.
    #[inline]
    pub fn live_granted_bytes(&self) -> usize {
        self.live_granted.load(Relaxed)
    }

    /// Raises the peak to `live` if it is higher. A plain load first: in steady state the
    /// peak is not exceeded and no write (no cache-line transfer) happens.
    #[inline]
    fn raise_peak(&self, live: usize) {
        if live > self.peak_granted.load(Relaxed) {
            self.peak_granted.fetch_max(live, Relaxed);
        }
    }

    /// A snapshot; `reserved_bytes` is set to the live granted bytes (what a child holds).
    pub fn snapshot(&self) -> AllocatorStats {
        // Frees are read before allocations, so a block allocated and freed between the two
        // reads never makes `live_blocks` negative.
        let frees = self.frees.load(Relaxed);
        let allocations = self.allocations.load(Relaxed);
        let live_granted_bytes = self.live_granted.load(Relaxed);
        AllocatorStats {
            live_granted_bytes,
            live_requested_bytes: Some(self.live_requested.load(Relaxed)),
            live_blocks: allocations.saturating_sub(frees) as usize,
            allocations,
            frees,
            reallocations: self.reallocations.load(Relaxed),
            peak_granted_bytes: Some(self.peak_granted.load(Relaxed)),
            reserved_bytes: live_granted_bytes,
            over_budget: self.over_budget.load(Relaxed),
            budget_failures: self.budget_failures.load(Relaxed),
        }
    }
}

impl Default for Counters {
    fn default() -> Self {
        Self::new()
    }
}

#[cfg(test)]
mod tests {
    use super::Counters;

    #[test]
    fn miri_counters_add_up_and_keep_the_peak() {
        let c = Counters::new();
        let live = c.add_granted(32);
        c.commit_allocation(20, live);
        let live = c.add_granted(64);
        c.commit_allocation(64, live);
        c.record_free(32, 20);
        c.record_resize(64, 128, 64, 100);
        let s = c.snapshot();
        assert_eq!(s.live_granted_bytes, 128);
        assert_eq!(s.live_requested_bytes, Some(100));
        assert_eq!(s.live_blocks, 1);
        assert_eq!((s.allocations, s.frees, s.reallocations), (2, 1, 1));
        assert_eq!(s.peak_granted_bytes, Some(128));
        c.record_resize(128, 16, 100, 10);
        c.record_free(16, 10);
        let s = c.snapshot();
        assert_eq!(s.live_granted_bytes, 0);
        assert_eq!(s.live_requested_bytes, Some(0));
        assert_eq!(s.peak_granted_bytes, Some(128));
    }
}
