//! Tagged statistics: the counters every declared allocator keeps, and their snapshot.
//!
//! [`Counters`] lives in the allocator's `static`. A child allocator counts each call in the
//! calling thread's *shard* of its counters (see [`shard`]): relaxed loads and stores that
//! only that thread writes, with no atomic read-modify-write, so tagging costs a few
//! instructions instead of six locked operations per alloc+free pair. Readers add up every
//! live thread's shard and the shared atomics, under the thread registry's lock; exited
//! threads move their counts into the shared atomics first. Figures are exact in a
//! snapshot taken while no thread allocates or frees through the allocator, including when
//! blocks are freed on other threads than the ones that allocated them (a shard's byte
//! figures may then be negative; the sums are right).
//!
//! A child with a *lane* of the thread caches (see `crate::allocator::lanes`) counts its
//! small blocks there instead: its figures then also add, over every live thread, the
//! per-class counts of its lane and of the lanes of the children below it
//! ([`Counters`]'s `lanes_below`), and each lane publishes its granted bytes into the shared
//! live figure on its slow paths, as a shard does past its threshold.
//!
//! A call counts in its shard when the allocator's *route* word holds a shard slot (as the
//! shard's byte offset in a thread's set, so the fast path needs no arithmetic) and no
//! budget is set. The route also carries a flag for a budget and one for records (set by the
//! registration when either changes), so a child's general path learns all of it with one
//! load and one compare (see [`Counters::plain_slot`]).
//!
//! The shared atomics (one read-modify-write per figure) are used instead:
//! - while the allocator has a budget ([`Budget`]): the budget check needs the exact live
//!   figure at every allocation. The first allocation or resize that sees a new budget
//!   publishes every thread's pending bytes (see below) before it checks, so the budget is
//!   as exact as before for every call that starts after the budget is set (frees do not
//!   look at the budget: until that first allocation they count in shards, which it
//!   publishes; after it the route sends them to the atomics too). A call running on another
//!   thread at that very moment may reach the shared figure only at that thread's next
//!   call through the allocator (snapshots count it at once);
//! - by allocators beyond the first [`SLOTS`](shard::SLOTS) that count (no slot left);
//! - by threads without a usable thread cache (registration failed, or the thread is past
//!   its thread-exit hook), and by [`Counters`] outside a `static` (the exact-path API).
//!
//! **The peak** needs a global view, which per-thread counts do not give. Each shard keeps a
//! running total of granted bytes and *publishes* the part not yet in the shared live figure
//! (one `fetch_add`, then a `fetch_max` on the peak if it rose) once that part goes above
//! +[`PUBLISH_BYTES`](shard::PUBLISH_BYTES) (64 KiB) or below
//! −[`HOLD_FREE_BYTES`](shard::HOLD_FREE_BYTES) (1 MiB). At any instant the shared figure
//! is below the true live total by less than 64 KiB per thread that has used the allocator
//! and not exited (its unpublished allocations), and above it by at most 1 MiB per such
//! thread (its frees held back). A shard that publishes an allocation while it holds frees
//! publishes them with it, so the recorded peak is below the true peak by less than 64 KiB
//! per thread, and above it only while threads hold frees back when another publication
//! (another thread's, or a child lane's) raises it: by at most 1 MiB per such thread.
//! A snapshot raises the peak to the exact live total it reads, so the peak is never below a
//! live figure a snapshot reported (a snapshot taken under concurrent traffic reads a blend
//! of nearby instants, and so may carry that blend into the peak).
//! The bounds are uneven because the costs are: holding frees back lets the next
//! allocation cancel them, so a thread that frees and allocates blocks of up to 1 MiB in turn
//! (a frame's scratch buffer) makes no locked operation. A block larger than 64 KiB that is
//! not cancelled so goes to the shared figure by itself (one `fetch_add`, the shard's running
//! total untouched). Every call while a budget is set moves the live figure and the peak
//! exactly.
//!
//! **Big frees.** A thread that frees a single block bigger than 1 MiB holds that free back
//! too (its shard's hold grows to 1 MiB plus the block), so that staging buffers of several
//! MiB freed and allocated in turn make no locked operation either. Such a thread counts
//! itself once among the allocator's *big holders*. While there are any, a publication that
//! would raise the peak *settles* first: under the thread registry's lock it publishes the
//! shards holding more than 1 MiB of frees, then raises the peak to the shared figure. So a
//! freed big block never reaches the peak, and the bounds above stay as they are. The cost
//! falls on peak raises only, while a big holder lives (a registry lock and a walk over the
//! threads' shards of this allocator), and on the holder, whose next allocation after a
//! settle publishes again.
//!
//! [`AllocatorStats`] is the plain snapshot the reports read.

mod shard;

use shard::{SHARD_BYTES, SLOTS, Shard};
pub(crate) use shard::{ShardSet, ShardSum};

use crate::budget::Budget;
use crate::lanes;
use crate::schema::hpha::Tag;
use crate::thread_cache;
use core::sync::atomic::{
    AtomicBool, AtomicU16, AtomicU32, AtomicU64, AtomicUsize,
    Ordering::{AcqRel, Acquire, Relaxed, Release, SeqCst},
};

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
    /// The highest `live_granted_bytes` ever reached (`None` where not tracked). For a
    /// child allocator without a budget it is kept from per-thread counts and may be below
    /// the truth by up to [`Counters::PEAK_TOLERANCE_PER_THREAD`], and above it by up to
    /// [`Counters::PEAK_OVERSHOOT_PER_THREAD`], per thread that used the allocator (see
    /// [`Counters`]); it is never below a live figure a snapshot reported.
    pub peak_granted_bytes: Option<usize>,
    /// Bytes held from the parent or the OS: live blocks plus whatever the allocator keeps
    /// for reuse (free slots in pool pages, free heap pages). A child holds nothing beyond
    /// its live blocks, so for a child this equals `live_granted_bytes`.
    pub reserved_bytes: usize,
    /// Allocations that found the allocator over its budget (see [`Budget`](crate::Budget)).
    pub over_budget: u64,
    /// Allocations refused because of a budget: this allocator's own, or (for a request
    /// that came in here and was passed up) the budget of an allocator above it, which
    /// counts the refusal too. [`BudgetEvent::allocator`](crate::BudgetEvent::allocator)
    /// names whose budget refused.
    pub budget_failures: u64,
    /// The heap's own figures, for the [`SystemAllocator`](crate::SystemAllocator) (and
    /// tagalloc's internal heaps): pages, segments, chunks, bytes in thread caches; `None`
    /// for every other allocator.
    pub heap: Option<crate::schema::HphaStats>,
}

/// The live counters of one tagged allocator; `const`-constructible, allocation-free.
///
/// A child allocator counts each call in the calling thread's own copy ("shard") of its
/// counters, with plain loads and stores instead of atomic read-modify-writes, and a
/// snapshot adds up every live thread's shard and the shared atomics (where exited
/// threads' counts go). Allocators with a budget, allocators past the first 128, and
/// threads that are exiting count with the shared atomics directly.
///
/// Every figure is exact in a snapshot taken while no other thread allocates or frees
/// through the allocator, also when blocks are freed on other threads than the ones that
/// allocated them; under concurrent traffic a snapshot is a blend of nearby instants.
///
/// The peak is the exception: threads publish their granted bytes to a shared live figure
/// only when they have changed by more than
/// [`PEAK_TOLERANCE_PER_THREAD`](Self::PEAK_TOLERANCE_PER_THREAD) up, or
/// [`PEAK_OVERSHOOT_PER_THREAD`](Self::PEAK_OVERSHOOT_PER_THREAD) down. So the recorded
/// peak is below the true peak by less than the first per thread (that used the allocator
/// and has not exited), and above it by at most the second per thread holding frees back
/// while another publishes. A snapshot raises the peak to the live total it reads. While the
/// allocator has a budget, the live figure and the peak are exact at every call.
#[derive(Debug)]
pub struct Counters {
    /// Live granted bytes counted here: by the shared (exact) path and published by shards.
    live_granted: AtomicUsize,
    live_requested: AtomicUsize,
    peak_granted: AtomicUsize,
    /// The highest live figure since [`take_frame_peak`](Self::take_frame_peak) last reset
    /// it: the peak between two frame marks (`report::mark_frame`), raised with the peak.
    frame_peak: AtomicUsize,
    allocations: AtomicU64,
    frees: AtomicU64,
    reallocations: AtomicU64,
    over_budget: AtomicU64,
    budget_failures: AtomicU64,
    /// How calls are counted: in the low bits, where the allocator's shard sits in a
    /// thread's [`ShardSet`] (its slot times [`SHARD_BYTES`], so the fast path adds it to
    /// the set's address with no multiply; [`UNSET`] before a slot is chosen, [`NO_SLOT`]
    /// when none is left), and [`EXACT`] while a budget routes calls to the atomics.
    route: AtomicU32,
    /// Where the allocator's lane of the thread caches sits, as an offset from the thread
    /// pointer (the same in every thread; see `lanes`), for a child of the `SystemAllocator`
    /// whose lane is one of the few built into every cache; 0 otherwise.
    lane: AtomicUsize,
    /// The allocator's tag (see `lanes`): [`TAG_UNCLAIMED`] before it asked for one,
    /// [`TAG_NONE`] if none was left, else the tag, which names its lane in every thread
    /// cache and the heap segments its small blocks come from.
    tag: AtomicU32,
    /// The tag a scope of this allocator enters (its own, or its nearest ancestor's when it
    /// has none), once a scope of it was first entered, which also marked tags as in use;
    /// 0 before (see `crate::scope`).
    scope_tag: AtomicU16,
    /// Whether some lane's blocks are in this allocator's figures: its own, or those of a
    /// child below it (`lanes::tags_below` says which).
    lanes_below: AtomicBool,
    /// While the allocator has a budget: whether the lanes below it are closed because the
    /// budget is near its limit (see `lanes`, "Budgets on open lanes").
    lanes_closed_for_budget: AtomicBool,
    /// Live threads whose shard may hold back a free of a block bigger than
    /// [`HOLD_FREE_BYTES`](shard::HOLD_FREE_BYTES) (see [`Registry`] and the module docs).
    /// While this is not zero, a publication that would raise the peak first settles those
    /// holds, so that the peak does not count a big freed block as live.
    big_holders: AtomicU32,
    /// Set from the start for a child that does not count requested bytes, and once such a
    /// child below is registered: the requested figure is then incomplete and not reported.
    requested_unknown: AtomicBool,
}

/// Whether a publication's caller holds the thread registry's lock, which a publication
/// needs to *settle* the peak: while some thread holds back the free of a big block (see
/// [`Counters::big_holders`]), the shared live figure counts that block still, so a
/// publication that would raise the peak first publishes such holds, under the lock.
#[derive(Clone, Copy)]
pub(crate) enum Registry<'a> {
    /// The caller does not hold the lock (a thread counting its own calls): settling takes it.
    Unlocked,
    /// The caller holds the lock, which gave it this list.
    Locked(&'a thread_cache::ThreadList),
    /// The caller is settling the peak itself and raises it once done.
    Settling,
}

/// [`Counters::tag`]: no tag asked for yet.
const TAG_UNCLAIMED: u32 = 0;
/// [`Counters::tag`]: none was left; the allocator counts in shards, its blocks are its
/// parent's.
const TAG_NONE: u32 = u32::MAX;

/// The slot bits of [`Counters::route`].
const SLOT_MASK: u32 = 0xFFFF;
/// Slot bits before the allocator's first counted call has chosen a slot.
const UNSET: u32 = 0xFFFE;
/// Slot bits of an allocator that found no free slot.
const NO_SLOT: u32 = 0xFFFF;
/// Slot bits below this are a slot's shard offset: a route below it is the fast path.
const SLOT_BITS_END: u32 = (SLOTS * SHARD_BYTES) as u32;
const _: () = assert!(SLOTS * SHARD_BYTES < UNSET as usize);
/// Set once a budget has moved the allocator to the shared atomics (and its shards'
/// pending bytes were published); cleared when calls go back to the shards.
const EXACT: u32 = 1 << 16;
/// Set while the allocator has a budget (by `Registration::set_budget`), so that a child's
/// general path learns it from the route alone (see [`Counters::plain_slot`]).
const BUDGETED: u32 = 1 << 17;
/// Set while the allocator's records word is not zero (by `Registration::records_changed`),
/// for the same reason.
const RECORDED: u32 = 1 << 18;

/// A slot's shard offset (slot below [`SLOTS`] times [`SHARD_BYTES`]), as
/// [`Counters::fast_slot`] found it in the route.
#[derive(Clone, Copy)]
pub(crate) struct Slot(usize);

impl Slot {
    /// This slot's shard in `set`.
    #[inline(always)]
    fn of(self, set: &ShardSet) -> &Shard {
        // SAFETY: a `Slot` is only made from route bits below `SLOT_BITS_END`, which are
        // only ever set to `slot_bits` of a slot below `SLOTS`.
        unsafe { set.at_offset(self.0) }
    }
}

/// The route bits of `slot` (below [`SLOTS`]).
#[inline]
fn slot_bits(slot: usize) -> u32 {
    (slot * SHARD_BYTES) as u32
}

/// A wrapping byte total read as a count: a negative one (a blend of instants, or a free
/// counted before its allocation was published) reads as zero.
#[inline]
pub(crate) fn non_negative(bytes: usize) -> usize {
    if (bytes as isize) < 0 { 0 } else { bytes }
}

/// The shard slot in `route`, or a number `>= SLOTS` when there is none to use.
#[inline(always)]
fn slot_of(route: u32) -> usize {
    if route < SLOT_BITS_END {
        route as usize / SHARD_BYTES
    } else {
        usize::MAX
    }
}

impl Counters {
    /// How far *below* the true peak the recorded peak of an allocator that counts in
    /// per-thread shards may be, per thread that has used the allocator and not exited: a
    /// thread publishes its granted bytes into the shared live figure once they grow by more
    /// than this (see the module docs). Allocators with a budget keep an exact peak.
    ///
    /// A child with a lane of the thread caches (see
    /// [`Registration::has_thread_cache_lane`](crate::Registration::has_thread_cache_lane))
    /// publishes on the lane's slow paths (a bin refilled or full) once its unpublished
    /// bytes over all classes reach the same amount; between two slow paths of a size class
    /// a thread moves at most one refill or one bin's worth of its blocks, so its peak may
    /// be off by up to [`PEAK_TOLERANCE_PER_THREAD_AND_CLASS`](Self::PEAK_TOLERANCE_PER_THREAD_AND_CLASS)
    /// more per size class the thread uses.
    pub const PEAK_TOLERANCE_PER_THREAD: usize = shard::PUBLISH_BYTES;

    /// How far *above* the true peak the recorded peak of an allocator that counts in
    /// per-thread shards may be, per thread that has used the allocator and not exited: a
    /// thread holds back frees (so that its next allocation can cancel them) until they
    /// reach this, and while it does, another thread's publication counts them as live
    /// still (a shard's own published allocation takes its held frees with it; a child
    /// lane's publication on the same thread does not). A thread may hold back more after
    /// freeing a block bigger than this, but a publication that would raise the peak then
    /// publishes such holds first (see the module docs), so the bound stays. Allocators
    /// with a budget keep an exact peak.
    pub const PEAK_OVERSHOOT_PER_THREAD: usize = shard::HOLD_FREE_BYTES;

    /// For a child with a lane of the thread caches: how much further than
    /// [`PEAK_TOLERANCE_PER_THREAD`](Self::PEAK_TOLERANCE_PER_THREAD) its recorded peak may
    /// be from the true one, per thread and per size class that thread uses (what one
    /// refill can hand a bin: four times a bin's 16 KiB).
    pub const PEAK_TOLERANCE_PER_THREAD_AND_CLASS: usize = 64 * 1024;

    /// All counters at zero.
    pub const fn new() -> Self {
        Self {
            live_granted: AtomicUsize::new(0),
            live_requested: AtomicUsize::new(0),
            peak_granted: AtomicUsize::new(0),
            frame_peak: AtomicUsize::new(0),
            allocations: AtomicU64::new(0),
            frees: AtomicU64::new(0),
            reallocations: AtomicU64::new(0),
            over_budget: AtomicU64::new(0),
            budget_failures: AtomicU64::new(0),
            route: AtomicU32::new(UNSET),
            lane: AtomicUsize::new(0),
            tag: AtomicU32::new(TAG_UNCLAIMED),
            scope_tag: AtomicU16::new(0),
            lanes_below: AtomicBool::new(false),
            lanes_closed_for_budget: AtomicBool::new(false),
            big_holders: AtomicU32::new(0),
            requested_unknown: AtomicBool::new(false),
        }
    }

    /// These counters, for a child that does not count requested bytes: they never report
    /// them.
    pub(crate) const fn without_requested(self) -> Self {
        Self {
            requested_unknown: AtomicBool::new(true),
            ..self
        }
    }

    /// From now on the requested bytes are not reported: a child below that does not count
    /// them is in use.
    pub(crate) fn forget_requested(&self) {
        self.requested_unknown.store(true, Relaxed);
    }

    // ---- Lanes (children of the `SystemAllocator`; see `lanes`) ----

    /// The offset of the allocator's lane from the thread pointer; 0 while it has none.
    #[inline(always)]
    pub(crate) fn lane_offset(&self) -> usize {
        self.lane.load(Relaxed)
    }

    /// Whether the allocator has not asked for a tag yet.
    #[inline]
    pub(crate) fn tag_unclaimed(&self) -> bool {
        self.tag.load(Acquire) == TAG_UNCLAIMED
    }

    /// The allocator's tag, once it has one.
    #[inline]
    pub(crate) fn tag(&self) -> Option<Tag> {
        match self.tag.load(Acquire) {
            TAG_UNCLAIMED | TAG_NONE => None,
            tag => Some(tag as Tag),
        }
    }

    /// Records the outcome of asking for a tag (under the thread registry's lock): the tag,
    /// and the offset of its lane from the thread pointer if it is built into every cache.
    pub(crate) fn set_tag(&self, tag: Option<Tag>, lane_offset: Option<usize>) {
        if let Some(offset) = lane_offset {
            self.lane.store(offset, Relaxed);
        }
        self.tag.store(tag.map_or(TAG_NONE, u32::from), Release);
    }

    /// The tag a scope of this allocator enters; 0 until one was first entered.
    #[inline(always)]
    pub(crate) fn scope_tag(&self) -> Tag {
        self.scope_tag.load(Acquire)
    }

    /// Records the tag a scope of this allocator enters, once tags are marked in use.
    pub(crate) fn set_scope_tag(&self, tag: Tag) {
        self.scope_tag.store(tag, Release);
    }

    /// Includes a lane in this allocator's figures from now on (its own, or a child's).
    pub(crate) fn add_lane_below(&self) {
        self.lanes_below.store(true, Relaxed);
    }

    /// The tags of the lanes in this allocator's figures, if any.
    pub(crate) fn lanes_below(&self) -> Option<lanes::TagSet> {
        self.lanes_below
            .load(Relaxed)
            .then(|| lanes::tags_below(self))
    }

    /// Whether the lanes below this budgeted allocator are closed for being near its limit.
    #[inline]
    pub(crate) fn lanes_closed_for_budget(&self) -> bool {
        self.lanes_closed_for_budget.load(Relaxed)
    }

    /// Records whether the lanes below are closed for being near the budget's limit (set
    /// by `lanes::refresh` under the thread registry's lock, and by a checkpoint about to
    /// refresh).
    pub(crate) fn set_lanes_closed_for_budget(&self, closed: bool) {
        self.lanes_closed_for_budget.store(closed, Relaxed);
    }

    /// The live granted bytes in the shared figure, as published (the lanes' and shards'
    /// unpublished bytes aside).
    #[inline]
    pub(crate) fn published_live(&self) -> usize {
        non_negative(self.live_granted.load(Relaxed))
    }

    /// Makes the shared figure hold every shard's bytes from now on (a budget's exact
    /// route; see [`exact_live_granted`](Self::exact_live_granted)). Takes the thread
    /// registry's lock the first time: not to be called with it held.
    pub(crate) fn make_exact(&'static self) {
        self.prepare_exact();
    }

    // ---- The sharded path (children, in the common case) ----

    /// The shard slot to count in, or `None` to count with the shared atomics (the
    /// allocator has a budget, or has no slot).
    #[inline]
    fn shard_slot(&'static self, budget: &Budget) -> Option<usize> {
        if budget.is_set() {
            self.prepare_exact();
            return None;
        }
        // Acquire: the slot's owner record (see `claim_slot`) happens before our counts.
        let slot = slot_of(self.route.load(Acquire));
        if slot < SLOTS {
            Some(slot)
        } else {
            self.shard_slot_slow()
        }
    }

    /// [`shard_slot`](Self::shard_slot) when the route is not a plain slot: claims a slot
    /// on first use, or leaves the exact mode a removed budget left behind.
    #[cold]
    #[inline(never)]
    fn shard_slot_slow(&'static self) -> Option<usize> {
        loop {
            let route = self.route.load(Acquire);
            let bits = route & SLOT_MASK;
            if bits == NO_SLOT {
                return None;
            }
            if route & EXACT != 0 {
                // The budget is gone: back to the shards (nothing is pending in them).
                self.route.fetch_and(!EXACT, Relaxed);
                continue;
            }
            if bits != UNSET {
                return Some(slot_of(bits));
            }
            let claimed = shard::claim_slot(self);
            let bits = claimed.map_or(NO_SLOT, slot_bits);
            if self
                .route
                .compare_exchange(route, (route & !SLOT_MASK) | bits, Release, Relaxed)
                .is_err()
            {
                // Another thread chose first (or the mode changed): look again.
                if let Some(slot) = claimed {
                    shard::release_slot(slot);
                }
            }
        }
    }

    /// The shard slot a call counts in on the fast path: the allocator has a slot and no
    /// budget. `None`: take the slow path ([`count_allocation`](Self::count_allocation) and
    /// friends). Two loads and two compares; a child claims its slot only once registered,
    /// so a slot here also means the child is in the registry.
    #[inline(always)]
    pub(crate) fn fast_slot(&self, budget: &Budget) -> Option<Slot> {
        // Acquire: the slot's owner record (see `claim_slot`) happens before our counts.
        let bits = self.route.load(Acquire);
        (bits < SLOT_BITS_END && !budget.is_set()).then_some(Slot(bits as usize))
    }

    /// The shard slot of a child's general path: the route alone says the allocator has a
    /// slot, no budget and no records (one load and one compare, before the parent's call).
    /// `None`: see [`recorded_slot`](Self::recorded_slot), else the slow paths.
    #[inline(always)]
    pub(crate) fn plain_slot(&self) -> Option<Slot> {
        // Acquire: as in `fast_slot`.
        let bits = self.route.load(Acquire);
        (bits < SLOT_BITS_END).then_some(Slot(bits as usize))
    }

    /// The shard slot when records are the only thing that kept the call off
    /// [`plain_slot`](Self::plain_slot): the call counts in its shard and records.
    #[inline]
    pub(crate) fn recorded_slot(&self) -> Option<Slot> {
        // Acquire: as in `fast_slot`.
        let bits = self.route.load(Acquire) & !RECORDED;
        (bits < SLOT_BITS_END).then_some(Slot(bits as usize))
    }

    /// Marks in the route whether the allocator has a budget (see [`plain_slot`](Self::plain_slot)).
    pub(crate) fn set_budgeted(&self, on: bool) {
        self.set_route_flag(BUDGETED, on);
    }

    /// Marks in the route whether the allocator's records word is not zero.
    pub(crate) fn set_recorded(&self, on: bool) {
        self.set_route_flag(RECORDED, on);
    }

    fn set_route_flag(&self, flag: u32, on: bool) {
        // Read-modify-writes, so slot claims and the exact switch (also on this word) stay.
        // AcqRel: a setter's flag write happens after every earlier one's settings store
        // (see `Registration::sync_route_flags`).
        if on {
            self.route.fetch_or(flag, AcqRel);
        } else {
            self.route.fetch_and(!flag, AcqRel);
        }
    }

    /// The shard slot a free counts in on the fast path: the route alone, no budget check.
    ///
    /// Frees need no budget check of their own: the first allocation that sees a new
    /// budget publishes every thread's shard before its own check (see `enter_exact`), so
    /// frees counted in shards until then are in the figure it checks; from then on the
    /// route says exact and frees take the slow path too, until the budget is removed.
    #[inline(always)]
    pub(crate) fn free_slot(&self) -> Option<Slot> {
        // Acquire: as in `fast_slot`.
        let bits = self.route.load(Acquire);
        (bits < SLOT_BITS_END).then_some(Slot(bits as usize))
    }

    /// Counts an allocation in the calling thread's shard of `slot`. `false`: the thread's
    /// cache is not registered yet or already retired; nothing was counted.
    #[inline(always)]
    pub(crate) fn shard_allocate(
        &'static self,
        slot: Slot,
        granted: usize,
        requested: usize,
    ) -> bool {
        thread_cache::with_active_shards(|set| slot.of(set).allocate(self, granted, requested))
            .is_some()
    }

    /// Counts a free in the calling thread's shard of `slot`, as
    /// [`shard_allocate`](Self::shard_allocate).
    #[inline(always)]
    pub(crate) fn shard_free(&'static self, slot: Slot, granted: usize, requested: usize) -> bool {
        thread_cache::with_active_shards(|set| slot.of(set).free(self, granted, requested))
            .is_some()
    }

    /// Counts an allocation in the calling thread's shard of `slot`, the thread's cache
    /// known to be live ([`thread_cache::shards_active`] said so earlier in this call).
    #[inline(always)]
    pub(crate) fn live_shard_allocate(&'static self, slot: Slot, granted: usize, requested: usize) {
        thread_cache::with_live_shards(|set| slot.of(set).allocate(self, granted, requested));
    }

    /// Counts a free in the calling thread's shard of `slot`, as
    /// [`live_shard_allocate`](Self::live_shard_allocate).
    #[inline(always)]
    pub(crate) fn live_shard_free(&'static self, slot: Slot, granted: usize, requested: usize) {
        thread_cache::with_live_shards(|set| slot.of(set).free(self, granted, requested));
    }

    /// [`live_shard_free`](Self::live_shard_free) unless the free must publish: then
    /// `false`, and the caller finishes with
    /// [`live_shard_free_crossing`](Self::live_shard_free_crossing) (see
    /// `Shard::free_within`).
    #[inline(always)]
    pub(crate) fn live_shard_free_within(
        &self,
        slot: Slot,
        granted: usize,
        requested: usize,
    ) -> bool {
        thread_cache::with_live_shards(|set| slot.of(set).free_within(granted, requested))
    }

    /// Finishes a free that [`live_shard_free_within`](Self::live_shard_free_within) left
    /// (inlined into its caller's cold path).
    #[inline(always)]
    pub(crate) fn live_shard_free_crossing(&'static self, slot: Slot, granted: usize) {
        thread_cache::with_live_shards(|set| slot.of(set).free_crossing(self, granted));
    }

    /// Runs `op` on the calling thread's shard in the common case: no budget, a slot, and a
    /// registered, live thread cache. `false`: not counted; try
    /// [`count_in_shard_slow`](Self::count_in_shard_slow).
    #[inline(always)]
    fn count_in_shard(&'static self, budget: &Budget, op: impl FnOnce(&Shard)) -> bool {
        let Some(slot) = self.fast_slot(budget) else {
            return false;
        };
        thread_cache::with_active_shards(|set| op(slot.of(set))).is_some()
    }

    /// [`count_in_shard`](Self::count_in_shard) for everything else: a budget (switch to
    /// the shared atomics and return `false`), the first call (claim a slot), a removed
    /// budget (back to the shards), a thread's first call (register its cache), no slot or
    /// no usable cache (`false`).
    #[cold]
    #[inline(never)]
    fn count_in_shard_slow(&'static self, budget: &Budget, op: impl FnOnce(&Shard)) -> bool {
        let Some(slot) = self.shard_slot(budget) else {
            return false;
        };
        thread_cache::with_shards(|set| {
            // SAFETY: `shard_slot` only returns slots below `SLOTS`.
            op(unsafe { set.get_unchecked(slot) })
        })
        .is_some()
    }

    /// Counts an allocation in the calling thread's shard. `false`: not counted; the caller
    /// counts it with [`add_granted`](Self::add_granted) and
    /// [`commit_allocation`](Self::commit_allocation) (and checks the budget).
    #[inline(always)]
    pub(crate) fn count_allocation(
        &'static self,
        budget: &Budget,
        granted: usize,
        requested: usize,
    ) -> bool {
        let op = move |shard: &Shard| shard.allocate(self, granted, requested);
        self.count_in_shard(budget, op) || self.count_in_shard_slow(budget, op)
    }

    /// Counts a freed block: in the calling thread's shard, or with the shared atomics.
    #[inline(always)]
    pub(crate) fn count_free(&'static self, budget: &Budget, granted: usize, requested: usize) {
        if !self.count_in_shard(budget, |shard| shard.free(self, granted, requested)) {
            self.count_free_slow(budget, granted, requested);
        }
    }

    /// [`count_free`](Self::count_free) off the common path.
    #[cold]
    #[inline(never)]
    fn count_free_slow(&'static self, budget: &Budget, granted: usize, requested: usize) {
        if !self.count_in_shard_slow(budget, |shard| shard.free(self, granted, requested)) {
            self.record_free(granted, requested);
        }
    }

    /// Counts a resize in the calling thread's shard. `false`: not counted; the caller uses
    /// [`record_resize`](Self::record_resize) (and checks the budget).
    #[inline(always)]
    pub(crate) fn count_resize(
        &'static self,
        budget: &Budget,
        old: usize,
        new: usize,
        old_requested: usize,
        new_requested: usize,
    ) -> bool {
        let op = move |shard: &Shard| shard.resize(self, old, new, old_requested, new_requested);
        self.count_in_shard(budget, op) || self.count_in_shard_slow(budget, op)
    }

    /// The live granted bytes, exact, for a budget check made before the parent is asked
    /// for a block (see `Child::refused_up_front`): switches to the shared atomics first if
    /// a budget was just set, as the counted call after it would.
    #[cold]
    pub(crate) fn exact_live_granted(&'static self) -> usize {
        self.prepare_exact();
        non_negative(self.live_granted.load(Relaxed))
    }

    /// Before a call counted with the shared atomics because of a budget: makes sure the
    /// shared live figure holds every thread's bytes, so the budget check is exact.
    #[cold]
    #[inline(never)]
    fn prepare_exact(&'static self) {
        let route = self.route.load(Acquire);
        if route & EXACT == 0 {
            self.enter_exact();
            return;
        }
        let slot = slot_of(route & SLOT_MASK);
        if slot < SLOTS {
            // A call of this thread that raced with the switch may have left bytes behind.
            thread_cache::with_shards(|set| {
                // SAFETY: `slot < SLOTS`.
                let shard = unsafe { set.get_unchecked(slot) };
                if shard.has_unpublished() {
                    shard.publish(self, Registry::Unlocked);
                }
            });
        }
    }

    /// Switches to the shared atomics: publishes the pending bytes of every thread's shard.
    /// Under the thread registry's lock, so two threads switching at once publish once and
    /// no thread retires meanwhile.
    #[cold]
    #[inline(never)]
    fn enter_exact(&'static self) {
        let threads = thread_cache::lock_threads();
        let route = self.route.fetch_or(EXACT, Acquire);
        if route & EXACT == 0 {
            // The lanes below are closed while the budget is set (see `lanes::refresh`):
            // what they hold moves into the shared figure once.
            if self.lanes_below.load(Relaxed) {
                lanes::publish_all(&threads, &lanes::tags_below(self));
            }
        }
        let slot = slot_of(route & SLOT_MASK);
        if route & EXACT == 0 && slot < SLOTS {
            threads.for_each_shards(|set| {
                // SAFETY: `slot < SLOTS`.
                let shard = unsafe { set.get_unchecked(slot) };
                if shard.has_unpublished() {
                    shard.publish(self, Registry::Settling);
                }
            });
            // Everything is published: the shared figure is the exact live total.
            self.raise_peak(self.live_granted.load(Acquire));
        }
    }

    /// Adds `delta` (a wrapping signed number) published by a shard or a lane to the shared
    /// live figure, and raises the peak if it grew. While a thread may hold back the free of
    /// a big block, a raise settles such holds first (see [`Registry`]).
    pub(crate) fn publish_granted(&self, delta: usize, registry: Registry<'_>) {
        let live = self.publish_granted_unpeaked(delta);
        if (delta as isize) > 0 {
            self.peak_after_publication(live, registry);
        }
    }

    /// The first half of [`publish_granted`](Self::publish_granted): adds `delta` to the
    /// shared live figure and returns the new figure, the peak untouched (a budget's
    /// checkpoint decides first whether the block it published stays).
    #[inline]
    pub(crate) fn publish_granted_unpeaked(&self, delta: usize) -> usize {
        // Release: a reader that sees the new total also sees the shard's `taken` advanced.
        // SeqCst, with the load of `big_holders` in `peak_after_publication`: a thread that
        // starts holding big frees counts itself there (SeqCst) before its hold starts, so
        // either that load sees it, or the hold started after this publication.
        self.live_granted
            .fetch_add(delta, SeqCst)
            .wrapping_add(delta)
    }

    /// The second half of [`publish_granted`](Self::publish_granted), after a publication
    /// that raised the shared figure to `live`: raises the peak (settling held frees first
    /// if some thread holds big ones).
    pub(crate) fn peak_after_publication(&self, live: usize, registry: Registry<'_>) {
        if self.big_holders.load(SeqCst) == 0 {
            self.raise_peak(live);
        } else if (live as isize) > 0 && live > self.frame_peak.load(Relaxed) {
            // (The frame peak is at most the peak: this also covers a new peak.)
            self.settle_peak(registry);
        }
    }

    /// A publication would raise the peak while a thread may hold back a big free: publishes
    /// the shards that hold more than [`HOLD_FREE_BYTES`](shard::HOLD_FREE_BYTES) of frees,
    /// then raises the peak to the shared figure. Out of line; takes the registry's lock
    /// unless the caller holds it, and does nothing for a caller that is settling already
    /// (it raises the peak once done).
    #[cold]
    #[inline(never)]
    fn settle_peak(&self, registry: Registry<'_>) {
        match registry {
            Registry::Unlocked => self.settle_peak_in(&thread_cache::lock_threads()),
            Registry::Locked(threads) => self.settle_peak_in(threads),
            Registry::Settling => {}
        }
    }

    /// [`settle_peak`](Self::settle_peak) with the registry locked.
    fn settle_peak_in(&self, threads: &thread_cache::ThreadList) {
        let slot = slot_of(self.route.load(Acquire) & SLOT_MASK);
        if slot < SLOTS {
            threads.for_each_shards(|set| {
                // SAFETY: `slot < SLOTS`.
                let shard = unsafe { set.get_unchecked(slot) };
                shard.release_big_hold(self);
            });
        }
        self.raise_peak(self.live_granted.load(Acquire));
    }

    /// A thread's shard starts holding back frees of big blocks (see `Shard::hold_big`).
    /// SeqCst: see [`publish_granted`](Self::publish_granted).
    pub(crate) fn add_big_holder(&self) {
        self.big_holders.fetch_add(1, SeqCst);
    }

    /// A big holder's shard retired (its holds published), under the registry's lock.
    pub(crate) fn remove_big_holder(&self) {
        self.big_holders.fetch_sub(1, SeqCst);
    }

    /// Adds the counts of a retiring thread's shard or lane (already published) to the shared
    /// ones.
    pub(crate) fn absorb(&self, sum: &ShardSum) {
        self.live_requested.fetch_add(sum.requested, Relaxed);
        self.allocations.fetch_add(sum.allocations, Relaxed);
        self.frees.fetch_add(sum.frees, Relaxed);
        self.reallocations.fetch_add(sum.reallocations, Relaxed);
    }

    // ---- The shared (exact) path ----

    /// Adds `granted` live bytes and returns the new live total (before the peak is
    /// updated; call [`commit_allocation`](Self::commit_allocation) or
    /// [`undo_granted`](Self::undo_granted) next).
    #[inline]
    pub(crate) fn add_granted(&self, granted: usize) -> usize {
        non_negative(
            self.live_granted
                .fetch_add(granted, Relaxed)
                .wrapping_add(granted),
        )
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
            non_negative(
                self.live_granted
                    .fetch_sub(old - new, Relaxed)
                    .wrapping_sub(old - new),
            )
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

    /// Raises the peak to `live` if it is higher. A plain load first: in steady state the
    /// peak is not exceeded and no write (no cache-line transfer) happens. A negative
    /// (wrapped) total never becomes the peak.
    #[inline]
    fn raise_peak(&self, live: usize) {
        if (live as isize) > 0 && live > self.frame_peak.load(Relaxed) {
            // The frame peak is reset to 0 at each frame mark, and is at most the peak: a
            // figure below it is below both, and takes no further load.
            self.frame_peak.fetch_max(live, Relaxed);
            if live > self.peak_granted.load(Relaxed) {
                self.peak_granted.fetch_max(live, Relaxed);
            }
        }
    }

    /// The highest live figure since the last call (or since start), and starts the next
    /// interval at zero; for `report::mark_frame`, which also counts the live figures it
    /// reads at both ends. Within the peak's tolerance (see [`Counters`]).
    pub(crate) fn take_frame_peak(&self) -> usize {
        self.frame_peak.swap(0, Relaxed)
    }

    // ---- Readers ----

    /// The live granted bytes right now (shards included: takes the thread registry's lock
    /// if the allocator counts in shards).
    pub fn live_granted_bytes(&self) -> usize {
        self.snapshot().live_granted_bytes
    }

    /// A snapshot; `reserved_bytes` is set to the live granted bytes (what a child holds).
    /// Also raises the recorded peak to the live total it reads.
    pub fn snapshot(&self) -> AllocatorStats {
        let slot = slot_of(self.route.load(Acquire) & SLOT_MASK);
        let lanes_below = self.lanes_below.load(Acquire);
        // The shared figures are read under the same lock as the shards and lanes, so no
        // exiting thread moves its counts from one to the other between the reads.
        let threads = (slot < SLOTS || lanes_below).then(thread_cache::lock_threads);
        // Frees are read before allocations, so a block allocated and freed between the two
        // reads never makes `live_blocks` negative (within one thread's counts).
        let frees = self.frees.load(Relaxed);
        let allocations = self.allocations.load(Relaxed);
        // The shared live figure before the shards (see `Shard::publish`): a publication
        // running meanwhile is then missed, never counted twice.
        let granted = self.live_granted.load(Acquire);
        let requested = self.live_requested.load(Relaxed);
        let reallocations = self.reallocations.load(Relaxed);
        let mut sum = ShardSum::default();
        if let Some(threads) = &threads {
            if slot < SLOTS {
                threads.for_each_shards(|set| set.add_slot_to(slot, &mut sum));
            }
            if lanes_below {
                lanes::add_to(threads, &lanes::tags_below(self), &mut sum);
            }
        }
        drop(threads);
        let frees = frees + sum.frees;
        let allocations = allocations + sum.allocations;
        let live_granted_bytes = non_negative(granted.wrapping_add(sum.unpublished));
        self.raise_peak(live_granted_bytes);
        AllocatorStats {
            live_granted_bytes,
            live_requested_bytes: (!self.requested_unknown.load(Relaxed))
                .then(|| non_negative(requested.wrapping_add(sum.requested))),
            live_blocks: allocations.saturating_sub(frees) as usize,
            allocations,
            frees,
            reallocations: reallocations + sum.reallocations,
            peak_granted_bytes: Some(self.peak_granted.load(Relaxed)),
            reserved_bytes: live_granted_bytes,
            over_budget: self.over_budget.load(Relaxed),
            budget_failures: self.budget_failures.load(Relaxed),
            heap: None,
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
    use super::shard::{HOLD_FREE_BYTES, PUBLISH_BYTES, SLOTS};
    use super::{Counters, EXACT, NO_SLOT, SLOT_BITS_END, UNSET, slot_bits, slot_of};
    use crate::budget::{Budget, BudgetMode};
    use core::sync::atomic::{AtomicBool, Ordering::Relaxed};
    use std::sync::{Barrier, mpsc};

    /// No budget: the sharded path.
    static NO_BUDGET: Budget = Budget::new();

    /// Counts an allocation the way a child does (shard, else the exact path).
    fn alloc(c: &'static Counters, budget: &Budget, granted: usize, requested: usize) -> bool {
        if c.count_allocation(budget, granted, requested) {
            return true;
        }
        let live = c.add_granted(granted);
        c.commit_allocation(requested, live);
        false
    }

    /// The shared (non-shard) figures: granted, requested, allocations, frees.
    fn shared(c: &Counters) -> (usize, usize, u64, u64) {
        (
            c.live_granted.load(Relaxed),
            c.live_requested.load(Relaxed),
            c.allocations.load(Relaxed),
            c.frees.load(Relaxed),
        )
    }

    fn has_slot(c: &Counters) -> bool {
        slot_of(c.route.load(Relaxed) & super::SLOT_MASK) < SLOTS
    }

    static SUMMED: Counters = Counters::new();

    #[test]
    fn shards_are_summed_across_threads_and_stay_exact_under_cross_thread_frees() {
        const THREADS: usize = 4;
        const BLOCKS: usize = 100;
        let c = &SUMMED;
        let allocated = Barrier::new(THREADS + 1);
        let checked = Barrier::new(THREADS + 1);
        let freed = Barrier::new(THREADS + 1);
        let (senders, receivers): (Vec<_>, Vec<_>) = (0..THREADS)
            .map(|_| mpsc::channel::<(usize, usize)>())
            .unzip();
        // Sizes stay below the publication threshold per thread, so nothing is published.
        let size = |t: usize, i: usize| 16 + (t * 31 + i * 7) % 400;
        let (mut granted, mut requested) = (0, 0);
        for t in 0..THREADS {
            for i in 0..BLOCKS {
                granted += size(t, i);
                requested += size(t, i) - 3;
            }
        }
        assert!(granted / THREADS < PUBLISH_BYTES);
        let ((shared_while_live, st), after) = std::thread::scope(|s| {
            let mut threads = Vec::new();
            for (t, rx) in receivers.into_iter().enumerate() {
                let to_next = senders[(t + 1) % THREADS].clone();
                let (allocated, checked, freed) = (&allocated, &checked, &freed);
                threads.push(s.spawn(move || {
                    for i in 0..BLOCKS {
                        let g = size(t, i);
                        assert!(alloc(c, &NO_BUDGET, g, g - 3), "counted in the shard");
                        to_next.send((g, g - 3)).unwrap();
                    }
                    drop(to_next);
                    allocated.wait();
                    checked.wait();
                    // Free the previous thread's blocks: this shard goes negative.
                    for (g, r) in rx.iter() {
                        c.count_free(&NO_BUDGET, g, r);
                    }
                    freed.wait();
                    freed.wait();
                }));
            }
            drop(senders);
            allocated.wait();
            // (Checked after the scope: a failed assertion here would leave the threads
            // waiting at the barriers.)
            let while_live = (shared(c), c.snapshot());
            checked.wait();
            freed.wait();
            let after_frees = c.snapshot();
            freed.wait();
            // `join` waits for the thread's exit hooks too (the scope's end does not).
            for t in threads {
                t.join().unwrap();
            }
            (while_live, after_frees)
        });
        // Every block was live, all counted in shards: the shared atomics held nothing.
        assert_eq!(shared_while_live, (0, 0, 0, 0));
        assert_eq!(st.live_granted_bytes, granted);
        assert_eq!(st.live_requested_bytes, Some(requested));
        assert_eq!(st.live_blocks, THREADS * BLOCKS);
        assert_eq!((st.allocations, st.frees), ((THREADS * BLOCKS) as u64, 0));
        // The snapshot raised the peak to the exact live total it read.
        assert_eq!(st.peak_granted_bytes, Some(granted));
        // After the cross-thread frees, with every thread still alive.
        assert_eq!(after.live_granted_bytes, 0);
        assert_eq!(after.live_requested_bytes, Some(0));
        assert_eq!(after.live_blocks, 0);
        assert_eq!(after.frees, (THREADS * BLOCKS) as u64);
        // The threads have exited: their counts moved into the shared atomics.
        assert_eq!(shared(c), (0, 0, 400, 400));
        let st = c.snapshot();
        assert_eq!((st.live_granted_bytes, st.live_blocks), (0, 0));
        assert_eq!(st.peak_granted_bytes, Some(granted));
    }

    static EXITING: Counters = Counters::new();

    /// Whether the thread's shards were usable in its Rust TLS destructor, and unusable
    /// (retired) in the later pthread key destructor.
    static SHARDS_IN_TLS_DTOR: AtomicBool = AtomicBool::new(false);
    static RETIRED_IN_KEY_DTOR: AtomicBool = AtomicBool::new(false);

    struct FreeOnDrop(usize);
    impl Drop for FreeOnDrop {
        fn drop(&mut self) {
            let live = crate::thread_cache::with_shards(|_| ()).is_some();
            SHARDS_IN_TLS_DTOR.store(live, Relaxed);
            EXITING.count_free(&NO_BUDGET, self.0, self.0);
        }
    }
    std::thread_local! {
        static HELD: core::cell::Cell<Option<FreeOnDrop>> = const { core::cell::Cell::new(None) };
    }

    /// A pthread key destructor that runs after the thread cache's (its key is newer).
    unsafe extern "C" fn free_after_retire(value: *mut libc::c_void) {
        let retired = crate::thread_cache::with_shards(|_| ()).is_none();
        RETIRED_IN_KEY_DTOR.store(retired, Relaxed);
        EXITING.count_free(&NO_BUDGET, value as usize, value as usize);
    }

    #[test]
    fn thread_exit_moves_shard_counts_into_the_shared_counters() {
        let c = &EXITING;
        // The thread cache's exit key exists before ours, so ours runs after it.
        assert!(alloc(c, &NO_BUDGET, 8, 8));
        c.count_free(&NO_BUDGET, 8, 8);
        let mut key: libc::pthread_key_t = 0;
        // SAFETY: `key` is writable; the destructor has the signature pthread wants.
        let created = unsafe { libc::pthread_key_create(&mut key, Some(free_after_retire)) };
        assert_eq!(created, 0);
        let before = c.snapshot();
        let counted = Barrier::new(2);
        let while_live = std::thread::scope(|s| {
            let thread = s.spawn(|| {
                for g in [100, 200, 300, 400] {
                    assert!(alloc(c, &NO_BUDGET, g, g));
                }
                c.count_free(&NO_BUDGET, 100, 100);
                // Freed by a Rust TLS destructor (the shard is still live then)...
                HELD.with(|h| h.set(Some(FreeOnDrop(200))));
                // ...and by a pthread key destructor after the cache retired (shared path).
                // SAFETY: the key exists; the value is a plain number, never dereferenced.
                let set = unsafe { libc::pthread_setspecific(key, 300 as *const _) };
                assert_eq!(set, 0);
                counted.wait();
                counted.wait();
            });
            counted.wait();
            let while_live = (shared(c), c.snapshot());
            counted.wait();
            // `join` waits for the thread's exit hooks too (the scope's end does not).
            thread.join().unwrap();
            while_live
        });
        let ((g, _, a, _), st) = while_live;
        assert_eq!((g, a), (0, 0), "every count is in a live thread's shard");
        assert_eq!(st.live_granted_bytes, 900);
        assert_eq!(st.allocations - before.allocations, 4);
        // SAFETY: the key is ours and no thread uses it any more.
        unsafe { libc::pthread_key_delete(key) };
        // The exited thread's shard (4 allocations, 2 frees) moved into the shared
        // counters, and its last free, after that, went there directly.
        assert_eq!(shared(c), (400, 400, 4, 3));
        assert!(SHARDS_IN_TLS_DTOR.load(Relaxed) && RETIRED_IN_KEY_DTOR.load(Relaxed));
        let st = c.snapshot();
        assert_eq!(st.live_granted_bytes, 400);
        assert_eq!(st.live_requested_bytes, Some(400));
        assert_eq!((st.allocations, st.frees, st.live_blocks), (5, 4, 1));
        c.count_free(&NO_BUDGET, 400, 400);
        assert_eq!(c.snapshot().live_granted_bytes, 0);
    }

    static SOLO: Counters = Counters::new();

    #[test]
    fn peak_lags_by_less_than_the_threshold_on_one_thread() {
        let c = &SOLO;
        const BLOCK: usize = 1024;
        // Below the threshold nothing is published: the recorded peak does not move...
        let n = PUBLISH_BYTES / BLOCK - 4;
        for _ in 0..n {
            assert!(alloc(c, &NO_BUDGET, BLOCK, BLOCK));
        }
        assert_eq!(c.peak_granted.load(Relaxed), 0);
        // ...until a snapshot reads the exact live total.
        assert_eq!(c.snapshot().peak_granted_bytes, Some(n * BLOCK));
        for _ in 0..n {
            c.count_free(&NO_BUDGET, BLOCK, BLOCK);
        }
        // Past the threshold the shard publishes; the peak misses at most the threshold.
        let n = 100;
        for _ in 0..n {
            assert!(alloc(c, &NO_BUDGET, BLOCK, BLOCK));
        }
        for _ in 0..n {
            c.count_free(&NO_BUDGET, BLOCK, BLOCK);
        }
        let st = c.snapshot();
        let (peak, truth) = (st.peak_granted_bytes.unwrap(), n * BLOCK);
        assert!(
            peak <= truth && peak + PUBLISH_BYTES >= truth,
            "{peak} vs {truth}"
        );
        assert!(peak > PUBLISH_BYTES, "published once");
        // A block above the threshold is published at once: the peak is exact for it.
        assert!(alloc(c, &NO_BUDGET, 4 * PUBLISH_BYTES, 1));
        c.count_free(&NO_BUDGET, 4 * PUBLISH_BYTES, 1);
        assert_eq!(c.snapshot().peak_granted_bytes, Some(4 * PUBLISH_BYTES));
        assert_eq!(c.snapshot().live_granted_bytes, 0);
        // The free above is held back in the shard. Each big allocation after it cancels the
        // held free and publishes the rest once that is more than the threshold (with the
        // held free: the shared figure is then exact), so the peak is never above the truth
        // on one thread and lags it by at most the threshold.
        assert!(alloc(c, &NO_BUDGET, BLOCK, BLOCK));
        let mut truth = 4 * PUBLISH_BYTES;
        for round in 1..=3 {
            let big = (4 + round) * PUBLISH_BYTES;
            assert!(alloc(c, &NO_BUDGET, big, big));
            truth = truth.max(big + BLOCK);
            let published = c.live_granted.load(Relaxed);
            assert!(
                published <= big + BLOCK && published + PUBLISH_BYTES >= big + BLOCK,
                "{published}"
            );
            let peak = c.peak_granted.load(Relaxed);
            assert!(peak <= truth && peak + PUBLISH_BYTES >= truth, "{peak}");
            c.count_free(&NO_BUDGET, big, big);
            assert_eq!(c.live_granted.load(Relaxed), published, "the free is held");
        }
        let st = c.snapshot();
        assert_eq!(st.live_granted_bytes, BLOCK);
        let peak = st.peak_granted_bytes.unwrap();
        assert!(
            (6 * PUBLISH_BYTES..=7 * PUBLISH_BYTES + BLOCK).contains(&peak),
            "{peak}"
        );
        c.count_free(&NO_BUDGET, BLOCK, BLOCK);
        assert_eq!(c.snapshot().live_granted_bytes, 0);
    }

    static ALTERNATING: Counters = Counters::new();

    #[test]
    fn held_frees_cancel_alternating_big_blocks() {
        let c = &ALTERNATING;
        const BIG: usize = 256 * 1024;
        // The first allocation publishes; after it, the block's free is held and the next
        // allocation cancels it: the shared figure never moves again.
        assert!(alloc(c, &NO_BUDGET, BIG, BIG));
        let first = shared(c).0;
        assert_eq!(first, BIG);
        for _ in 0..1000 {
            c.count_free(&NO_BUDGET, BIG, BIG);
            assert!(alloc(c, &NO_BUDGET, BIG, BIG));
        }
        assert_eq!(shared(c).0, first, "no publication while the frees cancel");
        let st = c.snapshot();
        assert_eq!((st.live_granted_bytes, st.live_blocks), (BIG, 1));
        assert_eq!(st.peak_granted_bytes, Some(BIG));
        assert_eq!((st.allocations, st.frees), (1001, 1000));
        c.count_free(&NO_BUDGET, BIG, BIG);
        // Blocks of the threshold's size are published with the shard's total, both ways:
        // at every step the shared figure is below the truth by at most the threshold and
        // above it by at most the held frees.
        let within = |truth: usize| {
            let (published, truth) = (shared(c).0 as isize, truth as isize);
            assert!(
                published <= truth + HOLD_FREE_BYTES as isize,
                "{published} {truth}"
            );
            assert!(
                published + PUBLISH_BYTES as isize >= truth,
                "{published} {truth}"
            );
        };
        const N: usize = 20;
        for i in 1..=N {
            assert!(alloc(c, &NO_BUDGET, PUBLISH_BYTES, 1));
            within(i * PUBLISH_BYTES);
        }
        let mut publications = 0;
        for i in (0..N).rev() {
            let before = shared(c).0;
            c.count_free(&NO_BUDGET, PUBLISH_BYTES, 1);
            within(i * PUBLISH_BYTES);
            publications += usize::from(shared(c).0 != before);
        }
        // 20 frees of 64 KiB pass the 1 MiB hold once.
        assert_eq!(publications, 1);
        // An allocation past the threshold publishes the held frees with it: exact.
        assert!(alloc(c, &NO_BUDGET, 4 * HOLD_FREE_BYTES, 1));
        assert_eq!(shared(c).0, 4 * HOLD_FREE_BYTES);
        assert_eq!(c.big_holders.load(Relaxed), 0);
        // A free larger than the hold is held too (the thread becomes a big holder), and
        // the next allocation of such a block cancels it: no publication either way.
        c.count_free(&NO_BUDGET, 4 * HOLD_FREE_BYTES, 1);
        assert_eq!(shared(c).0, 4 * HOLD_FREE_BYTES, "the big free is held");
        assert_eq!(c.big_holders.load(Relaxed), 1);
        for _ in 0..100 {
            assert!(alloc(c, &NO_BUDGET, 4 * HOLD_FREE_BYTES, 1));
            c.count_free(&NO_BUDGET, 4 * HOLD_FREE_BYTES, 1);
        }
        assert_eq!(
            shared(c).0,
            4 * HOLD_FREE_BYTES,
            "no publication while they cancel"
        );
        let st = c.snapshot();
        assert_eq!((st.live_granted_bytes, st.live_blocks), (0, 0));
        assert_eq!(st.peak_granted_bytes, Some(4 * HOLD_FREE_BYTES));
        // A raise of the peak settles the hold first: an allocation bigger than the block
        // held takes the shared figure past the peak only with the freed block in it.
        assert!(alloc(c, &NO_BUDGET, 5 * HOLD_FREE_BYTES, 1));
        assert_eq!(
            shared(c).0,
            5 * HOLD_FREE_BYTES,
            "the hold was cancelled, then published"
        );
        assert_eq!(c.peak_granted.load(Relaxed), 5 * HOLD_FREE_BYTES);
        c.count_free(&NO_BUDGET, 5 * HOLD_FREE_BYTES, 1);
        assert_eq!(c.snapshot().live_granted_bytes, 0);
    }

    static BIG_HOLDER: Counters = Counters::new();

    #[test]
    fn a_peak_raise_settles_another_threads_big_hold() {
        let c = &BIG_HOLDER;
        const HELD: usize = 3 * HOLD_FREE_BYTES;
        const OTHER: usize = 2 * HOLD_FREE_BYTES;
        let step = &Barrier::new(2);
        let (peak, shared_after, holders_meanwhile) = std::thread::scope(|s| {
            let holder = s.spawn(move || {
                // B: a big block, freed and held back; B stays alive (its shard too) until A
                // has published.
                assert!(alloc(c, &NO_BUDGET, HELD, HELD));
                c.count_free(&NO_BUDGET, HELD, HELD);
                step.wait();
                step.wait();
            });
            step.wait();
            let holders = c.big_holders.load(Relaxed);
            // A: the shared figure still counts B's freed block, so A's publication would
            // raise the peak to HELD + OTHER; it settles B's hold first.
            assert!(alloc(c, &NO_BUDGET, OTHER, OTHER));
            let peak = c.peak_granted.load(Relaxed);
            let shared_after = shared(c).0;
            step.wait();
            // `join` (unlike the end of the scope) waits for B's exit hooks: its shard is
            // retired.
            holder.join().unwrap();
            (peak, shared_after, holders)
        });
        assert_eq!(holders_meanwhile, 1);
        assert_eq!(peak, HELD, "the true peak, not HELD + OTHER");
        assert_eq!(shared_after, OTHER, "B's hold was published");
        // B exited: no big holder is left.
        assert_eq!(c.big_holders.load(Relaxed), 0);
        let st = c.snapshot();
        assert_eq!((st.live_granted_bytes, st.live_blocks), (OTHER, 1));
        assert_eq!(st.peak_granted_bytes, Some(HELD));
        c.count_free(&NO_BUDGET, OTHER, OTHER);
        assert_eq!(c.snapshot().live_granted_bytes, 0);
    }

    static SPREAD: Counters = Counters::new();

    #[test]
    fn peak_bound_holds_in_both_directions_across_threads() {
        let c = &SPREAD;
        const BLOCK: usize = 1024;
        let step = Barrier::new(2);
        let step = &step;
        let (to_b, from_a) = mpsc::channel::<usize>();
        std::thread::scope(|s| {
            // A allocates 200 blocks and hands B 60 of them; B frees them, staying just
            // below the threshold (pending frees); then A allocates 60 more.
            s.spawn(move || {
                for i in 0..200 {
                    assert!(alloc(c, &NO_BUDGET, BLOCK, BLOCK));
                    if i < 60 {
                        to_b.send(BLOCK).unwrap();
                    }
                }
                step.wait();
                step.wait();
                for _ in 0..60 {
                    assert!(alloc(c, &NO_BUDGET, BLOCK, BLOCK));
                }
                for _ in 0..200 {
                    c.count_free(&NO_BUDGET, BLOCK, BLOCK);
                }
                step.wait();
            });
            s.spawn(move || {
                step.wait();
                for g in from_a.iter().take(60) {
                    c.count_free(&NO_BUDGET, g, g);
                }
                step.wait();
                step.wait();
            });
        });
        // The true live total never passed 200 blocks; B's 60 pending frees let A's
        // publication overshoot it, by less than the threshold of the one other thread.
        let truth = 200 * BLOCK;
        let st = c.snapshot();
        let peak = st.peak_granted_bytes.unwrap();
        assert!(peak > truth, "pending frees overshoot: {peak}");
        assert!(peak <= truth + PUBLISH_BYTES, "{peak} vs {truth}");
        assert_eq!((st.live_granted_bytes, st.live_blocks), (0, 0));
    }

    static HANDED_OVER: Counters = Counters::new();

    #[test]
    fn held_frees_of_another_thread_overshoot_by_at_most_the_hold() {
        let c = &HANDED_OVER;
        const BIG: usize = 768 * 1024;
        // A allocates a big block, B frees it (held back: below the hold), then A
        // allocates another: the true live total never passed BIG, but A's publication
        // still counts B's held free.
        assert!(alloc(c, &NO_BUDGET, BIG, BIG));
        std::thread::scope(|s| {
            // `join` (unlike the end of the scope) waits for B's exit hooks.
            s.spawn(|| c.count_free(&NO_BUDGET, BIG, BIG))
                .join()
                .unwrap();
        });
        // (B has exited: its shard was retired, so its free is published.)
        assert_eq!(c.snapshot().peak_granted_bytes, Some(BIG));
        let step = &Barrier::new(2);
        assert!(alloc(c, &NO_BUDGET, BIG, BIG));
        let peak = std::thread::scope(|s| {
            s.spawn(move || {
                c.count_free(&NO_BUDGET, BIG, BIG);
                step.wait(); // B holds the free...
                step.wait(); // ...until A has read the peak.
            });
            step.wait();
            // ...while A allocates again (A holds no free to cancel: it publishes the block).
            assert!(alloc(c, &NO_BUDGET, BIG, BIG));
            let peak = c.peak_granted.load(Relaxed);
            step.wait();
            c.count_free(&NO_BUDGET, BIG, BIG);
            peak
        });
        assert!(peak > BIG, "the held free overshoots: {peak}");
        assert!(peak <= BIG + Counters::PEAK_OVERSHOOT_PER_THREAD, "{peak}");
        let st = c.snapshot();
        assert_eq!((st.live_granted_bytes, st.live_blocks), (0, 0));
    }

    static BUDGETED: Counters = Counters::new();
    static BUDGET: Budget = Budget::new();

    #[test]
    fn a_budget_publishes_every_shard_and_counts_exactly() {
        let c = &BUDGETED;
        let step = Barrier::new(2);
        // (Checked after the scope: a failed assertion inside would leave the other thread
        // waiting at the barrier.)
        let (pending, counted_in_shard, live_seen, after_switch, peak) = std::thread::scope(|s| {
            let other = s.spawn(|| {
                let in_shard = alloc(c, &BUDGET, 10_000, 10_000);
                step.wait();
                step.wait();
                // With the budget set, this thread counts exactly too.
                let exact = !alloc(c, &BUDGET, 1_000, 1_000);
                c.count_free(&BUDGET, 10_000, 10_000);
                (in_shard, exact)
            });
            step.wait();
            let pending = shared(c).0;
            BUDGET.set(Some(15_000), BudgetMode::Fail);
            // The first call that sees the budget publishes the other thread's bytes, so
            // the live figure the budget checks is exact.
            let counted_in_shard = c.count_allocation(&BUDGET, 8_000, 8_000);
            let live_seen = c.add_granted(8_000);
            c.undo_granted(8_000);
            let after_switch = shared(c).0;
            let peak = c.snapshot().peak_granted_bytes;
            step.wait();
            let (in_shard, exact) = other.join().unwrap();
            assert!(in_shard && exact);
            (pending, counted_in_shard, live_seen, after_switch, peak)
        });
        assert_eq!(pending, 0, "pending in the other thread's shard");
        assert!(
            !counted_in_shard,
            "a budget routes calls to the shared atomics"
        );
        assert_eq!(live_seen, 18_000);
        assert_eq!(after_switch, 10_000);
        assert_eq!(peak, Some(10_000));
        assert_eq!(shared(c).0, 1_000);
        assert_eq!(c.snapshot().peak_granted_bytes, Some(11_000));
        // Budget removed: back to the shards, still exact.
        BUDGET.set(None, BudgetMode::Warn);
        assert!(alloc(c, &BUDGET, 500, 500));
        assert_eq!(shared(c).0, 1_000);
        c.count_free(&BUDGET, 1_000, 1_000);
        c.count_free(&BUDGET, 500, 500);
        let st = c.snapshot();
        assert_eq!((st.live_granted_bytes, st.live_blocks), (0, 0));
        assert_eq!((st.allocations, st.frees), (3, 3));
        assert!(has_slot(c));
    }

    #[test]
    fn miri_route_bits_name_a_slot_only_for_a_claimed_slot() {
        for slot in 0..SLOTS {
            let bits = slot_bits(slot);
            assert!(bits < SLOT_BITS_END);
            assert_eq!(slot_of(bits), slot);
            assert!(slot_of(bits | EXACT) >= SLOTS);
        }
        for bits in [UNSET, NO_SLOT, EXACT | UNSET, EXACT | NO_SLOT] {
            assert!(bits >= SLOT_BITS_END && slot_of(bits) >= SLOTS);
        }
        // A new allocator's calls take the slow path (which claims a slot).
        let c = Counters::new();
        assert!(c.fast_slot(&NO_BUDGET).is_none() && c.free_slot().is_none());
    }

    static FLAGGED: Counters = Counters::new();

    #[test]
    fn budget_and_records_flags_take_calls_off_the_plain_slot_and_keep_it() {
        let c = &FLAGGED;
        assert!(alloc(c, &NO_BUDGET, 64, 60), "claims a slot");
        let slot = c.plain_slot().expect("a plain slot").0;
        c.set_recorded(true);
        assert!(c.plain_slot().is_none() && c.free_slot().is_none());
        assert_eq!(c.recorded_slot().map(|s| s.0), Some(slot), "records alone");
        c.set_budgeted(true);
        assert!(c.plain_slot().is_none() && c.recorded_slot().is_none());
        c.set_recorded(false);
        assert!(c.plain_slot().is_none() && c.recorded_slot().is_none());
        c.set_budgeted(false);
        assert_eq!(c.plain_slot().map(|s| s.0), Some(slot));
        c.count_free(&NO_BUDGET, 64, 60);
        assert_eq!(c.snapshot().live_blocks, 0);
    }

    static ROUTED: Counters = Counters::new();
    static ROUTED_BUDGET: Budget = Budget::new();

    #[test]
    fn a_budget_stops_fast_allocations_and_frees_follow_the_route() {
        let c = &ROUTED;
        assert!(
            alloc(c, &ROUTED_BUDGET, 64, 60),
            "claims a slot, counts in the shard"
        );
        assert!(c.fast_slot(&ROUTED_BUDGET).is_some() && c.free_slot().is_some());
        ROUTED_BUDGET.set(Some(1 << 20), BudgetMode::Warn);
        // Allocations see the budget at once; frees only once an allocation switched the
        // route (publishing every shard).
        assert!(c.fast_slot(&ROUTED_BUDGET).is_none());
        assert!(c.free_slot().is_some());
        assert!(!alloc(c, &ROUTED_BUDGET, 64, 60), "counted exactly");
        assert!(c.free_slot().is_none());
        assert_eq!(shared(c).0, 128, "the shard's bytes were published");
        c.count_free(&ROUTED_BUDGET, 64, 60);
        ROUTED_BUDGET.set(None, BudgetMode::Warn);
        c.count_free(&ROUTED_BUDGET, 64, 60);
        assert!(c.fast_slot(&ROUTED_BUDGET).is_some() && c.free_slot().is_some());
        let st = c.snapshot();
        assert_eq!((st.live_granted_bytes, st.live_blocks), (0, 0));
        assert_eq!(st.live_requested_bytes, Some(0));
        assert_eq!((st.allocations, st.frees), (2, 2));
    }

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
