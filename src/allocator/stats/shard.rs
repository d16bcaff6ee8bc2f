//! Per-thread shards of the tagged allocators' [`Counters`].
//!
//! Each thread's cache (see `thread_cache`) carries a [`ShardSet`]: one [`Shard`] per slot,
//! and a slot belongs to one [`Counters`] (handed out on its first counted call, for the
//! first [`SLOTS`] allocators that ask). Only the owning thread writes a shard's counts, with
//! a relaxed load and store: no lock prefix, no cache line shared with other threads on the
//! hot path. Readers sum the shards of every registered thread under the thread registry's
//! lock, plus the allocator's shared atomics (where exited threads' counts, counts of
//! threads without a cache, and counts of allocators with a budget go).
//!
//! A shard's granted bytes are two running totals: `granted`, written by the owner on every
//! call, and `taken`, how much of it has been *published* into the allocator's shared live
//! figure. The owner publishes (one `fetch_add` on the shared figure, one compare-and-swap on
//! `taken`) when the unpublished part goes above +[`PUBLISH_BYTES`] or below
//! −[`HOLD_FREE_BYTES`]. The bounds are uneven on purpose: unpublished allocations make the
//! peak taken from the shared figure lag, so they are kept small; unpublished frees can only
//! make a publication of other bytes (another thread's, or a child lane's) overshoot, and
//! holding up to a MiB of them lets the next allocation cancel a freed big block, so a loop
//! that frees and allocates blocks of up to that size makes no locked operation at all.
//! A thread that frees one block bigger than that holds it back as well, with a hold grown
//! to fit it, and counts itself among the allocator's big holders, whose holds a peak raise
//! publishes first (see `Counters::publish_granted`).
//! Another thread may also publish
//! a shard (when an allocator gets a budget and needs its exact live figure); both sides
//! advance `taken` with a compare-and-swap, so every byte is published exactly once, and the
//! owner's `granted` keeps a single writer.

use super::{Counters, Registry};
use crate::thread_cache::ThreadList;
use core::ptr::null_mut;
use core::sync::atomic::{
    AtomicPtr, AtomicU64, AtomicUsize,
    Ordering::{AcqRel, Acquire, Relaxed, Release},
};

/// How many allocators get per-thread shards; later ones count with shared atomics.
pub(crate) const SLOTS: usize = 128;

/// A shard publishes its granted bytes into the shared live figure when the unpublished part
/// goes above this: the most the recorded peak lags per thread. 64 KiB keeps batches of
/// small blocks entirely thread-local.
pub(crate) const PUBLISH_BYTES: usize = 64 * 1024;

/// A shard publishes when the unpublished part goes below the negative of this: the frees a
/// thread may hold back, and so the most another publication can overshoot the true live
/// total per thread. 1 MiB lets an alternating free and allocation of blocks up to that
/// size cancel in the shard (a frame's scratch buffer, a reallocated staging block).
pub(crate) const HOLD_FREE_BYTES: usize = 1024 * 1024;

/// The allocator that owns each slot, for moving counts out of an exiting thread's shards.
static OWNERS: [AtomicPtr<Counters>; SLOTS] = [const { AtomicPtr::new(null_mut()) }; SLOTS];
/// The next slot to hand out (may pass `SLOTS`: then there are none left).
static NEXT_SLOT: AtomicUsize = AtomicUsize::new(0);

/// Claims a slot for `owner`; `None` once all are taken. A claimed slot is recorded as
/// owned by `owner` before the caller publishes it, so a thread that counts into the slot
/// always finds its owner when it exits.
pub(crate) fn claim_slot(owner: &'static Counters) -> Option<usize> {
    let mut next = NEXT_SLOT.load(Relaxed);
    loop {
        if next >= SLOTS {
            return None;
        }
        match NEXT_SLOT.compare_exchange_weak(next, next + 1, Relaxed, Relaxed) {
            Ok(_) => break,
            Err(now) => next = now,
        }
    }
    OWNERS[next].store(core::ptr::from_ref(owner).cast_mut(), Release);
    Some(next)
}

/// Gives back a slot claimed by [`claim_slot`] and never published (another thread assigned
/// the allocator a slot first). Only the most recent claim can be given back; otherwise the
/// slot stays unused.
pub(crate) fn release_slot(slot: usize) {
    let _ = NEXT_SLOT.compare_exchange(slot + 1, slot, Relaxed, Relaxed);
}

/// Slots handed out so far.
fn slots_in_use() -> usize {
    NEXT_SLOT.load(Acquire).min(SLOTS)
}

/// Adds `v` to an owner-only counter: a relaxed load and store, no read-modify-write.
#[inline(always)]
fn bump(cell: &AtomicUsize, v: usize) -> usize {
    let n = cell.load(Relaxed).wrapping_add(v);
    cell.store(n, Relaxed);
    n
}

/// Subtracts `v` from an owner-only counter, as [`bump`].
#[inline(always)]
fn drop_by(cell: &AtomicUsize, v: usize) -> usize {
    let n = cell.load(Relaxed).wrapping_sub(v);
    cell.store(n, Relaxed);
    n
}

/// Adds one to an owner-only event count, as [`bump`].
#[inline(always)]
fn tick(cell: &AtomicU64) {
    cell.store(cell.load(Relaxed) + 1, Relaxed);
}

/// The size of a [`Shard`]: slot `i`'s shard starts `i * SHARD_BYTES` into a [`ShardSet`].
pub(crate) const SHARD_BYTES: usize = size_of::<Shard>();

/// One thread's counts for one allocator. Byte figures are wrapping sums of signed changes
/// (a thread that frees blocks another allocated goes "negative"); event counts only grow.
/// A cache line each, so a call's counts never straddle two lines.
#[repr(align(64))]
pub(crate) struct Shard {
    /// Granted bytes added minus removed by this thread (owner-written).
    granted: AtomicUsize,
    /// How much of `granted` is already in the shared live figure (compare-and-swap only).
    taken: AtomicUsize,
    requested: AtomicUsize,
    allocations: AtomicU64,
    frees: AtomicU64,
    reallocations: AtomicU64,
    /// How far below zero the unpublished part may go before the owner publishes it:
    /// [`HOLD_FREE_BYTES`], raised by [`hold_big`](Self::hold_big) once the thread frees a
    /// block bigger than that (owner-written; reset when the thread retires).
    hold: AtomicUsize,
}

/// What a reader adds up over the shards of one slot (and over an allocator's lanes).
#[derive(Default)]
pub(crate) struct ShardSum {
    /// Granted bytes not yet published into the shared live figure (wrapping).
    pub unpublished: usize,
    /// Requested bytes (wrapping).
    pub requested: usize,
    pub allocations: u64,
    pub frees: u64,
    pub reallocations: u64,
}

impl Shard {
    const fn new() -> Self {
        Self {
            granted: AtomicUsize::new(0),
            taken: AtomicUsize::new(0),
            requested: AtomicUsize::new(0),
            allocations: AtomicU64::new(0),
            frees: AtomicU64::new(0),
            reallocations: AtomicU64::new(0),
            hold: AtomicUsize::new(HOLD_FREE_BYTES),
        }
    }

    /// Whether the unpublished part `unpublished` is below what the shard may hold back.
    #[inline(always)]
    fn below_hold(&self, unpublished: isize) -> bool {
        unpublished < -(self.hold.load(Relaxed) as isize)
    }

    /// The unpublished granted bytes, as a signed number.
    #[inline(always)]
    fn unpublished_after(&self, granted: usize) -> isize {
        granted.wrapping_sub(self.taken.load(Relaxed)) as isize
    }

    /// Counts an allocation (owner only).
    #[inline(always)]
    pub(crate) fn allocate(&self, owner: &Counters, granted: usize, requested: usize) {
        bump(&self.requested, requested);
        tick(&self.allocations);
        let g = self.granted.load(Relaxed).wrapping_add(granted);
        if self.unpublished_after(g) > PUBLISH_BYTES as isize {
            return self.publish_crossing(owner, g, granted as isize);
        }
        self.granted.store(g, Relaxed);
    }

    /// Counts a free (owner only).
    #[inline(always)]
    pub(crate) fn free(&self, owner: &Counters, granted: usize, requested: usize) {
        if !self.free_within(granted, requested) {
            self.free_crossing(owner, granted);
        }
    }

    /// Counts a free (owner only) unless its granted bytes take the unpublished part below
    /// −[`HOLD_FREE_BYTES`]: then only the requested bytes and the event are counted, and
    /// `false` says the caller must finish with [`free_crossing`](Self::free_crossing). Calls
    /// nothing, so a caller that frees next can jump to the free instead of calling it.
    #[inline(always)]
    pub(crate) fn free_within(&self, granted: usize, requested: usize) -> bool {
        drop_by(&self.requested, requested);
        tick(&self.frees);
        let g = self.granted.load(Relaxed).wrapping_sub(granted);
        if self.below_hold(self.unpublished_after(g)) {
            return false;
        }
        self.granted.store(g, Relaxed);
        true
    }

    /// The granted part of a free that [`free_within`](Self::free_within) left undone,
    /// published (owner only; the publication itself is out of line).
    #[inline(always)]
    pub(crate) fn free_crossing(&self, owner: &Counters, granted: usize) {
        let g = self.granted.load(Relaxed).wrapping_sub(granted);
        self.publish_crossing(owner, g, -(granted as isize));
    }

    /// A call whose `change` of granted bytes takes the unpublished part out of its bounds
    /// (`g`: the running total with the change). A big block goes to the shared figure by
    /// itself, with one `fetch_add` and the running total left as it was (within bounds), not
    /// a compare-and-swap on `taken` as well: a free bigger than [`PUBLISH_BYTES`], or an
    /// allocation that big while the shard holds no frees back. (Held frees are in the
    /// shared figure still, so an allocation published beside them would raise the peak above
    /// the truth on this very thread.) Otherwise the total is stored and published as a
    /// whole. Owner only; out of line.
    ///
    /// A free of one block bigger than [`HOLD_FREE_BYTES`] is held back too, with a hold
    /// raised to fit it (see [`hold_big`](Self::hold_big)), so that a thread that frees and
    /// allocates such blocks in turn makes no locked operation either.
    #[cold]
    #[inline(never)]
    fn publish_crossing(&self, owner: &Counters, g: usize, change: isize) {
        if change < -(HOLD_FREE_BYTES as isize) {
            self.hold_big(owner, change.unsigned_abs());
            if !self.below_hold(self.unpublished_after(g)) {
                self.granted.store(g, Relaxed);
                return;
            }
        }
        let before = self.unpublished_after(g.wrapping_sub(change as usize));
        let big = change.unsigned_abs() > PUBLISH_BYTES;
        if big && (change < 0 || before >= 0) {
            owner.publish_granted(change as usize, Registry::Unlocked);
            return;
        }
        self.granted.store(g, Relaxed);
        self.publish(owner, Registry::Unlocked);
    }

    /// Lets the shard hold back, besides the usual [`HOLD_FREE_BYTES`], the free of a block
    /// of `size` bytes (bigger than that). The first time, the thread counts itself among
    /// `owner`'s big holders (before the hold starts), so that a publication that would
    /// raise the peak meanwhile settles the hold first instead of counting the freed block
    /// as live (see `Counters::publish_granted`). Owner only.
    fn hold_big(&self, owner: &Counters, size: usize) {
        let hold = self.hold.load(Relaxed);
        let wanted = HOLD_FREE_BYTES
            .saturating_add(size)
            .min(isize::MAX as usize);
        if wanted <= hold {
            return;
        }
        if hold == HOLD_FREE_BYTES {
            owner.add_big_holder();
        }
        self.hold.store(wanted, Relaxed);
    }

    /// Publishes the shard if it holds back more than [`HOLD_FREE_BYTES`] of frees (any
    /// thread, under the registry's lock: `owner` is settling its peak).
    pub(crate) fn release_big_hold(&self, owner: &Counters) {
        let unpublished = self.unpublished_after(self.granted.load(Relaxed));
        if unpublished < -(HOLD_FREE_BYTES as isize) {
            self.publish(owner, Registry::Settling);
        }
    }

    /// Counts a resize from `old` to `new` granted and `old_requested` to `new_requested`
    /// requested bytes (owner only).
    #[inline(always)]
    pub(crate) fn resize(
        &self,
        owner: &Counters,
        old: usize,
        new: usize,
        old_requested: usize,
        new_requested: usize,
    ) {
        let g = bump(&self.granted, new.wrapping_sub(old));
        bump(&self.requested, new_requested.wrapping_sub(old_requested));
        tick(&self.reallocations);
        let unpublished = self.unpublished_after(g);
        if unpublished > PUBLISH_BYTES as isize || self.below_hold(unpublished) {
            self.publish(owner, Registry::Unlocked);
        }
    }

    /// Whether this shard holds granted bytes not yet in the shared figure.
    #[inline]
    pub(crate) fn has_unpublished(&self) -> bool {
        self.granted.load(Relaxed) != self.taken.load(Relaxed)
    }

    /// Moves the unpublished granted bytes into `owner`'s shared live figure (and its peak).
    /// Safe from any thread: `taken` advances by compare-and-swap, so each byte is published
    /// once even if the owner and another thread publish at the same time. `registry`:
    /// whether the caller holds the thread registry's lock.
    #[cold]
    #[inline(never)]
    pub(crate) fn publish(&self, owner: &Counters, registry: Registry<'_>) {
        let mut taken = self.taken.load(Acquire);
        loop {
            // Acquire on `taken` makes `granted` at least as new as the value `taken` was
            // set to, so the difference never runs backwards.
            let granted = self.granted.load(Relaxed);
            match self
                .taken
                .compare_exchange_weak(taken, granted, AcqRel, Acquire)
            {
                Ok(_) => {
                    owner.publish_granted(granted.wrapping_sub(taken), registry);
                    return;
                }
                Err(now) => taken = now,
            }
        }
    }

    /// Adds this shard to `sum` (any thread). `taken` is read before `granted` (see
    /// [`publish`](Self::publish)).
    fn add_to(&self, sum: &mut ShardSum) {
        let taken = self.taken.load(Acquire);
        let granted = self.granted.load(Relaxed);
        sum.unpublished = sum.unpublished.wrapping_add(granted.wrapping_sub(taken));
        sum.requested = sum.requested.wrapping_add(self.requested.load(Relaxed));
        sum.frees += self.frees.load(Relaxed);
        sum.allocations += self.allocations.load(Relaxed);
        sum.reallocations += self.reallocations.load(Relaxed);
    }

    /// Whether every count is zero.
    fn is_empty(&self) -> bool {
        self.granted.load(Relaxed) == 0
            && self.taken.load(Relaxed) == 0
            && self.requested.load(Relaxed) == 0
            && self.allocations.load(Relaxed) == 0
            && self.frees.load(Relaxed) == 0
            && self.reallocations.load(Relaxed) == 0
            && self.hold.load(Relaxed) == HOLD_FREE_BYTES
    }
}

/// One thread's shards, one per slot; lives in the thread's cache (TLS, `const`-initialised).
pub(crate) struct ShardSet {
    shards: [Shard; SLOTS],
}

impl ShardSet {
    /// All shards at zero.
    pub(crate) const fn new() -> Self {
        Self {
            shards: [const { Shard::new() }; SLOTS],
        }
    }

    /// The shard of `slot`.
    ///
    /// # Safety
    /// `slot < SLOTS`.
    #[inline(always)]
    pub(crate) unsafe fn get_unchecked(&self, slot: usize) -> &Shard {
        // SAFETY: forwarded from the caller.
        unsafe { self.shards.get_unchecked(slot) }
    }

    /// The shard `offset` bytes into the set.
    ///
    /// # Safety
    /// `offset` is `slot * SHARD_BYTES` for a `slot < SLOTS`.
    #[inline(always)]
    pub(crate) unsafe fn at_offset(&self, offset: usize) -> &Shard {
        // SAFETY: forwarded from the caller: the offset of a shard inside the array.
        unsafe { &*self.shards.as_ptr().byte_add(offset) }
    }

    /// Adds the shard of `slot` to `sum`.
    pub(crate) fn add_slot_to(&self, slot: usize, sum: &mut ShardSum) {
        self.shards[slot].add_to(sum);
    }

    /// Moves every count into its allocator's shared counters and zeroes the shards: the
    /// thread is exiting (or gone, in a forked child).
    ///
    /// Must be called under the thread registry's lock, by the owning thread after its last
    /// counted call or on behalf of a thread that no longer exists, so nothing writes the
    /// shards meanwhile and no reader sees the counts twice or not at all.
    /// `threads`: the locked registry.
    pub(crate) fn retire(&self, threads: &ThreadList) {
        for (slot, shard) in self.shards.iter().enumerate().take(slots_in_use()) {
            if shard.is_empty() {
                continue;
            }
            let owner = OWNERS[slot].load(Acquire);
            // SAFETY: a slot is recorded with its owner (a `&'static Counters`) before any
            // thread can count into it, and shards of unclaimed slots stay empty.
            let owner = unsafe { &*owner };
            shard.publish(owner, Registry::Locked(threads));
            if shard.hold.load(Relaxed) != HOLD_FREE_BYTES {
                owner.remove_big_holder();
                shard.hold.store(HOLD_FREE_BYTES, Relaxed);
            }
            let mut sum = ShardSum::default();
            shard.add_to(&mut sum);
            owner.absorb(&sum);
            shard.granted.store(0, Relaxed);
            shard.taken.store(0, Relaxed);
            shard.requested.store(0, Relaxed);
            shard.allocations.store(0, Relaxed);
            shard.frees.store(0, Relaxed);
            shard.reallocations.store(0, Relaxed);
        }
    }
}
