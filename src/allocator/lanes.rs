//! Lanes and tags: child allocators of the `SystemAllocator` served straight from the thread
//! caches, and found again from their blocks.
//!
//! A child counts every block it hands out. Counting through its own counters costs about as
//! much as the parent's whole alloc+free pair (see `benches/child.rs`), so every child of
//! the `SystemAllocator` (or of its children) gets, before its first block, a *tag*: a
//! small number that names a *lane* of its own in every thread cache (a bin per size class
//! with the class's counts, the same as the `SystemAllocator`'s lane 0) and the heap
//! segments its small blocks come from. A small request to such a child is then the
//! `SystemAllocator`'s pop or push in another lane, plus one add of the requested size; its
//! live blocks and granted bytes are the lane's per-class counts, summed over threads when a
//! snapshot is taken, exactly as the `SystemAllocator`'s own are.
//!
//! The first [`CHILD_LANES`] tags have lanes built into every cache, at a fixed offset from
//! the thread pointer, which their handles' inlined fast paths use; the others get lanes
//! made on a thread's first use of them and found through a table (their handles' calls go
//! through one out-of-line step more). Tags run out at [`MAX_TAGS`]: a child claiming one
//! after that counts in its shards, with its parent's blocks, and cannot be entered.
//!
//! **Segregation.** A lane's bins only ever hold blocks of its tag's segments: refills come
//! from the tag's own small heap, and every path that hands a child a small block (its lane,
//! or its general path, whose block comes from the tag's heap too) takes it there. So the
//! segment a small block lies in says which child holds it, which is what lets a free
//! through the global allocator (a scoped tag's block, see `tags`) count in the right child
//! without a per-block header or a side table. Large blocks carry the tag in their header.
//!
//! A lane is *open* only while nothing needs to see the child's calls one by one: no budget
//! on the child or on a child above it, no records (now, or earlier except sampled ones) on
//! any of them, and no records of every block on the `SystemAllocator`. While the
//! `SystemAllocator` samples, an open lane samples its allocations for it (per-class
//! countdowns, as its own lane 0 does) and its frees ask the sample filter, as lane 0's do.
//! Otherwise the lane is closed (every class's mark closed, the hooks byte set) and each
//! call takes the child's general path, with its shards, budget checks and records, as
//! children without a tag always do. The gates are recomputed, and written
//! into every thread's cache under the thread registry's lock, whenever a budget or a
//! records setting changes ([`refresh`]).
//!
//! **Figures.** A child's snapshot adds, for its own lane and the lanes of every child below
//! it, each live thread's per-class counts and requested bytes. Each lane also *publishes*
//! its granted bytes into the shared live figure of its owner and every child above it, on
//! its slow paths (a refill, a full bin) once they reach [`PUBLISH_BYTES`] over all classes:
//! the peak follows from that, within that per thread and lane plus what each class's bin
//! moved since its last slow path (at most a refill or a bin's limit, up to about 64 KiB).
//! When a child gets a budget, its first counted call publishes every
//! thread's lanes below it (as it does its shards), so the budget starts from the exact live
//! figure; a thread exiting publishes and hands its counts to the owners' shared counters.

use crate::records;
use crate::registry::{Registration, SYSTEM};
use crate::schema::hpha::size_class::CLASS_COUNT;
use crate::schema::hpha::size_class::class_size;
use crate::schema::hpha::{MAX_TAGS, Tag};
use crate::stats::{Counters, Registry, ShardSum};
use crate::thread_cache::{
    self, CHILD_LANES, HOOK_ALLOC, HOOK_BUDGET, HOOK_CLOSED, HOOK_FREE, HOOK_FREE_SAMPLED,
    HOOK_GUARD, HOOK_SAMPLE, Lane, ThreadList,
};
use core::alloc::Layout;
use core::ptr::NonNull;
use core::ptr::{self, null_mut};
use core::sync::atomic::{
    AtomicBool, AtomicPtr, AtomicU8, AtomicU32, AtomicU64, AtomicUsize, Ordering::*,
};

/// The child that owns each tag (tag 0 is the `SystemAllocator`'s).
static OWNERS: [AtomicPtr<Registration>; MAX_TAGS] =
    [const { AtomicPtr::new(null_mut()) }; MAX_TAGS];
/// The next tag to hand out (from [`MAX_TAGS`]: none left). Changed under the thread
/// registry's lock.
static NEXT: AtomicUsize = AtomicUsize::new(1);
/// Each tag's gate as last computed by [`refresh`] (under the registry lock): the hooks
/// byte a thread's lane of it gets (see [`gate`]). A thread opening a lane copies it.
static GATES: [AtomicU8; MAX_TAGS] = [const { AtomicU8::new(CLOSED) }; MAX_TAGS];
/// Each tag's sampling interval as last computed by [`refresh`]: the shortest of the
/// intervals of the allocators that sample its lanes' blocks (its owner, the children above
/// it, the `SystemAllocator`); 0 while none samples.
static SAMPLE_INTERVALS: [AtomicU64; MAX_TAGS] = [const { AtomicU64::new(0) }; MAX_TAGS];
/// Each tag's guarded sampling rate as last computed by [`refresh`]: one allocation in
/// `N` guarded, `N` the smallest over the allocators whose figures hold the tag's blocks
/// (its owner, the children above it, the `SystemAllocator`); 0 while none guards.
static GUARD_INTERVALS: [AtomicU32; MAX_TAGS] = [const { AtomicU32::new(0) }; MAX_TAGS];
/// Each tag's lanes as last computed by [`refresh`]: whether a `Fail` budget is set on its
/// owner or a child above it. Such a lane counts each allocation in step with the threads
/// that decide at the limit (see `thread_cache::budget_allocate`) instead of letting runs of
/// blocks through its fast path.
static EXACT: [AtomicBool; MAX_TAGS] = [const { AtomicBool::new(false) }; MAX_TAGS];
/// The tags whose lanes ever guarded: their frees keep asking whether a block is a guarded
/// one (`HOOK_GUARD`) after the setting goes, for the guarded blocks still live.
static GUARDED_ONCE: [AtomicBool; MAX_TAGS] = [const { AtomicBool::new(false) }; MAX_TAGS];

/// A lane's hooks byte when it is closed.
const CLOSED: u8 = HOOK_FREE | HOOK_CLOSED;

/// The owner of `tag`, if handed out.
pub(crate) fn owner(tag: Tag) -> Option<&'static Registration> {
    // SAFETY: only `&'static Registration`s are stored.
    unsafe { OWNERS.get(usize::from(tag))?.load(Acquire).as_ref() }
}

/// The tags handed out so far: `1..end()`.
fn end() -> usize {
    NEXT.load(Acquire).min(MAX_TAGS)
}

/// `owner` and every child above it, up to (not including) the `SystemAllocator`: the
/// allocators whose figures include the lane's blocks.
pub(crate) fn chain(owner: &'static Registration) -> impl Iterator<Item = &'static Registration> {
    core::iter::successors(Some(owner), |r| r.parent()).take_while(|r| !ptr::eq(*r, &SYSTEM))
}

/// The gate of tag `tag`'s lanes, last computed by [`refresh`]: the lane's hooks byte, with
/// the meaning it has in lane 0. `HOOK_FREE`: closed, every call takes the child's general
/// path. Otherwise open, and while the `SystemAllocator` samples, `HOOK_SAMPLE` (its
/// allocations are sampled for the `SystemAllocator`'s records, with per-class countdowns
/// as in lane 0) and `HOOK_FREE_SAMPLED` (sampled records may exist: a free asks the sample
/// filter and takes the general path for a block that may be one).
pub(crate) fn gate(tag: Tag) -> u8 {
    GATES
        .get(usize::from(tag))
        .map_or(CLOSED, |g| g.load(Relaxed))
}

/// Whether `registration` owns a tag and its lanes are open (see [`gate`]).
pub(crate) fn is_open_for(registration: &'static Registration) -> bool {
    registration
        .counters()
        .tag()
        .is_some_and(|tag| serves(gate(tag)))
}

/// Whether a lane with hooks byte `hooks` serves calls.
#[inline(always)]
pub(crate) fn serves(hooks: u8) -> bool {
    hooks & HOOK_FREE == 0
}

/// The gate of a lane owned by `owner` (see [`gate`]), its sampling interval (0: none)
/// and its guarded sampling rate (0: none); `guarded_once` is the tag's
/// [`GUARDED_ONCE`]. Called by [`refresh`], under the thread registry's lock, once it
/// decided which budgets are far.
fn compute_gate(owner: &'static Registration, guarded_once: &AtomicBool) -> (u8, u64, u32) {
    let guard = core::iter::once(&SYSTEM)
        .chain(chain(owner))
        .filter_map(|r| r.guard_every())
        .min()
        .unwrap_or(0);
    if guard != 0 {
        guarded_once.store(true, Relaxed);
    }
    let (mut gate, interval) = compute_records_gate(owner);
    if gate == CLOSED {
        // The general path guards for itself (see `guarded`).
        return (CLOSED, 0, guard);
    }
    if guard != 0 && gate & HOOK_BUDGET != 0 {
        // A budget's checkpoints and the guard's countdown would drive the same marks:
        // the general path serves both.
        return (CLOSED, 0, guard);
    }
    if guarded_once.load(Relaxed) {
        gate |= HOOK_GUARD;
    }
    (gate, interval, guard)
}

/// [`compute_gate`] for records and budgets.
fn compute_records_gate(owner: &'static Registration) -> (u8, u64) {
    let system = records::global::thread_hooks();
    if system & (HOOK_ALLOC | HOOK_FREE) != 0 {
        // The `SystemAllocator` records every block (or may hold records of any).
        return (CLOSED, 0);
    }
    let mut gate = system & (HOOK_SAMPLE | HOOK_FREE_SAMPLED);
    let mut interval = records::global::sample_interval().unwrap_or(u64::MAX);
    for r in chain(owner) {
        if r.budget().is_set() {
            // Open under the budget while it is far (see `refresh`), and nothing samples:
            // both would drive the same marks.
            if r.counters().lanes_closed_for_budget() {
                return (CLOSED, 0);
            }
            gate |= HOOK_BUDGET;
        }
        let word = r.records().word();
        match records::global::child_lane_hooks(word) {
            Some(hooks) => gate |= hooks,
            None => return (CLOSED, 0),
        }
        if let Some(own) = records::global::sampling_interval(word) {
            interval = interval.min(own);
        }
    }
    if gate & HOOK_BUDGET != 0 && gate & HOOK_SAMPLE != 0 {
        return (CLOSED, 0);
    }
    let interval = if gate & HOOK_SAMPLE != 0 { interval } else { 0 };
    (gate, interval)
}

// ---- Budgets on open lanes ----
//
// A lane stays open under a budget of its owner or of a child above it while the budget is
// *far*: its live figure, as published, plus the most every thread's lanes can hold
// unpublished, is within the limit. Each class of such a lane lets at most
// [`BUDGET_CLASS_SLACK`] bytes of allocations through between two checkpoints (the class's
// mark), and a checkpoint publishes the class's bytes: a thread's lane holds at most that per
// class unpublished, so no allocation through an open lane can take the budget over its
// limit, and no budget decision needs more than the published figure. Near the limit the
// lanes close (publishing everything), and every call takes the general path, which checks
// the budget exactly at each call as before; a general-path call that finds the budget far
// again (by twice the margin, so that lanes do not flap) opens them again.
//
// Under a `Fail` budget ([`EXACT`]) no block goes through the fast path: each is counted on
// the miss path in step with the threads that decide at the limit, so that none read an
// open gate and lands after a decision that missed it (see `publish_all`, and
// docs/architecture.md, "Budgets on lanes"). The runs and checkpoints are the same.

/// Bytes of one class a lane under a budget allocates between two checkpoints, at most (and
/// one block at least).
const BUDGET_CLASS_SLACK: usize = 2048;
/// The most a thread's lane under a budget holds unpublished, over every class.
const BUDGET_LANE_SLACK: usize = CLASS_COUNT * BUDGET_CLASS_SLACK;

/// Whether `r`'s budget is far from its limit, with `threads` live threads: live bytes as
/// published plus each thread's slack (twice that when its lanes were closed for being
/// near, so that they reopen only with room to spare) stay within the limit.
fn budget_far(r: &'static Registration, threads: usize, reopening: bool) -> bool {
    let Some(limit) = r.budget().settings().limit() else {
        return true;
    };
    let margin = threads
        .max(1)
        .saturating_mul(BUDGET_LANE_SLACK)
        .saturating_mul(if reopening { 2 } else { 1 });
    r.counters().published_live().saturating_add(margin) <= limit
}

/// The first half of a budget's checkpoint of a lane of `tag`, for a class-`class`
/// allocation: moves the lane's unpublished bytes of `class` into the
/// shared figures above it, without the peaks (the caller's block is in these bytes, and
/// stays only if every budget is far). Returns the bytes. Called by the lane's owning
/// thread; under a `Fail` budget while its allocation is still marked in flight, so that
/// a thread deciding at the limit waits until the bytes taken from the lane's mark are in
/// the shared figure: a publisher stopped between the two hid them from every decision
/// (a whole run of blocks, found by the racing test).
pub(crate) fn checkpoint_publish(tag: Tag, lane: &Lane, class: usize) -> usize {
    let Some(owner) = owner(tag) else {
        return 0;
    };
    let bytes = lane.take_unpublished(class);
    if bytes != 0 {
        for r in chain(owner) {
            r.counters().publish_granted_unpeaked(bytes);
        }
    }
    bytes
}

/// The second half of a checkpoint, after [`checkpoint_publish`] moved `bytes`: if every
/// budget above is still far, raises the peaks and returns how many blocks of the class may
/// go through before the next checkpoint. `None`: a budget is near, the lanes close, and
/// the caller takes the general path. Called by the lane's owning thread, with nothing in
/// flight (it may wait for the lanes' allocations in flight).
pub(crate) fn checkpoint_decide(tag: Tag, class: usize, bytes: usize) -> Option<u32> {
    let owner = owner(tag)?;
    let threads = thread_cache::registered_threads_hint();
    let near = chain(owner).find(|r| r.budget().is_set() && !budget_far(r, threads, false));
    if let Some(r) = near {
        r.counters().set_lanes_closed_for_budget(true);
        refresh();
        return None;
    }
    if (bytes as isize) > 0 {
        for r in chain(owner) {
            let live = r.counters().published_live();
            r.counters()
                .peak_after_publication(live, Registry::Unlocked);
        }
    }
    Some((BUDGET_CLASS_SLACK / class_size(class)).max(1) as u32)
}

/// Bytes a thread's lane can hold unpublished once its gate closed: the block it was taking
/// as the gate changed (at most the largest small class).
const CLOSING_SLACK: usize = crate::schema::hpha::MAX_SMALL;

/// Whether a budget decision of the allocator with `counters` at `live` bytes (its shared
/// figure with the new block) is close enough to the limit in `settings` that lanes below
/// it may hold what tips it: then [`settle`] first.
#[inline]
pub(crate) fn at_ceiling(
    counters: &Counters,
    settings: crate::budget::BudgetSettings,
    live: usize,
) -> bool {
    let Some(limit) = settings.limit() else {
        return false;
    };
    let slack = thread_cache::registered_threads_hint()
        .max(1)
        .saturating_mul(CLOSING_SLACK);
    live.saturating_add(slack) > limit && counters.lanes_below().is_some()
}

/// Publishes every thread's lanes below the allocator with `counters`, under the thread
/// registry's lock: its shared figure then holds every block of theirs (a block a lane was
/// taking while its gate closed included, once taken).
#[cold]
#[inline(never)]
pub(crate) fn settle(counters: &Counters) {
    if let Some(tags) = counters.lanes_below() {
        let threads = thread_cache::lock_threads();
        publish_all(&threads, &tags);
    }
}

/// On a budgeted allocator's general path: if its lanes were closed for being near the
/// limit and it is far again (see [`budget_far`]), opens them.
#[cold]
#[inline(never)]
pub(crate) fn maybe_reopen(r: &'static Registration) {
    if r.counters().lanes_closed_for_budget()
        && budget_far(r, thread_cache::registered_threads_hint(), true)
    {
        refresh();
    }
}

/// Whether the lanes of `tag` are under a `Fail` budget (see [`EXACT`]).
#[inline]
pub(crate) fn exact(tag: Tag) -> bool {
    // Acquire: the process barrier's state, settled before `EXACT` was first set (see
    // `refresh`), is then the one the owner's fences go by.
    EXACT.get(usize::from(tag)).is_some_and(|e| e.load(Acquire))
}

/// One allocation in how many the lanes of `tag` guard (see [`GUARD_INTERVALS`]); 0: none.
pub(crate) fn guard_interval(tag: Tag) -> u32 {
    GUARD_INTERVALS
        .get(usize::from(tag))
        .map_or(0, |g| g.load(Relaxed))
}

/// The interval at which lanes of `tag` sample (see [`SAMPLE_INTERVALS`]), if they do.
pub(crate) fn sample_interval(tag: Tag) -> Option<u64> {
    let interval = SAMPLE_INTERVALS.get(usize::from(tag))?.load(Relaxed);
    (interval != 0).then_some(interval)
}

/// Records a block a lane of `tag` sampled at mean `interval`, for every allocator that
/// samples it: the lane's owner and the children above it that sample, and the
/// `SystemAllocator` if it samples. Each keeps an unbiased estimate whatever its own
/// interval: a block sampled at the shortest interval is weighed at that interval.
pub(crate) fn record_sampled(
    tag: Tag,
    ptr: NonNull<u8>,
    layout: Layout,
    granted: usize,
    interval: u64,
) {
    if let Some(owner) = owner(tag) {
        for r in chain(owner) {
            records::record_sampled(r, ptr, layout, granted, interval);
        }
    }
    records::record_sampled(&SYSTEM, ptr, layout, granted, interval);
}

/// Gives `registration` (a child whose chain of parents ends at the `SystemAllocator`) a
/// tag, if one is left and it has none; then opens its lanes where they may be. Once per
/// child, before its first block: a child that found none left counts in shards, with its
/// parent's blocks.
///
/// The tag names the child's lane in every thread cache (one of the [`CHILD_LANES`] built
/// into each cache for the first tags, so that its handle finds it from the thread pointer
/// alone; a lane made on demand for the others) and the heap segments its small blocks come
/// from, which is how a free through the global allocator finds the child again.
#[cold]
#[inline(never)]
pub(crate) fn claim(registration: &'static Registration) {
    let counters = registration.counters();
    if !counters.tag_unclaimed() {
        return;
    }
    // Counts in a lane belong to a registered allocator (its parents are registered first).
    registration.register();
    // Misuse messages of small blocks name the allocator of the block's segment.
    crate::fatal::set_tag_namer(|tag| owner(tag).map(|r| r.name()));
    // A built-in lane is found from the thread pointer, whose offset to the caches the
    // first cache to register learns.
    thread_cache::register_current();
    {
        let _threads = thread_cache::lock_threads();
        if !counters.tag_unclaimed() {
            return;
        }
        let index = NEXT.load(Relaxed);
        if index >= MAX_TAGS {
            counters.set_tag(None, None);
            return;
        }
        let tag = index as Tag;
        NEXT.store(index + 1, Release);
        OWNERS[index].store(ptr::from_ref(registration).cast_mut(), Release);
        // Every allocator that sums the lane knows of it before any block is counted there
        // (the lane opens only below, in `refresh`).
        for r in chain(registration) {
            r.counters().add_lane_below();
        }
        let offset = (index <= CHILD_LANES)
            .then(|| thread_cache::lane_thread_offset(index))
            .flatten();
        counters.set_tag(Some(tag), offset);
    }
    refresh();
}

/// Recomputes the lanes' gates and writes them into every thread's cache. Called after a
/// budget or a records setting changed, and when a tag is handed out.
pub(crate) fn refresh() {
    // Every budget's figure made exact first (its shards published, once), then, under the
    // registry lock, the lanes below it published: `compute_gate` reads the shared figures.
    let budgeted = || {
        (1..end())
            .filter_map(|tag| owner(tag as Tag))
            .flat_map(chain)
            .filter(|r| r.budget().is_set())
    };
    for r in budgeted() {
        r.counters().make_exact();
    }
    if budgeted().any(|r| r.budget().settings().enforced()) {
        // Before any lane counts under a `Fail` budget, and outside the lock: registering
        // for the barrier can take milliseconds.
        crate::sync::prepare_process_barrier();
    }
    let threads = thread_cache::lock_threads();
    for r in budgeted() {
        if let Some(lanes_below) = r.counters().lanes_below() {
            publish_all(&threads, &lanes_below);
        }
    }
    // Which budgets are far (each once, whatever number of tags it is above).
    for r in budgeted() {
        let was_closed = r.counters().lanes_closed_for_budget();
        let far = budget_far(r, threads.len(), was_closed);
        r.counters().set_lanes_closed_for_budget(!far);
    }
    for (index, gate) in GATES.iter().enumerate().take(end()).skip(1) {
        let (hooks, interval, guard) = owner(index as Tag).map_or((CLOSED, 0, 0), |owner| {
            compute_gate(owner, &GUARDED_ONCE[index])
        });
        let exact = owner(index as Tag)
            .is_some_and(|owner| chain(owner).any(|r| r.budget().settings().enforced()));
        EXACT[index].store(exact, Release);
        SAMPLE_INTERVALS[index].store(interval, Relaxed);
        GUARD_INTERVALS[index].store(guard, Relaxed);
        gate.store(hooks, Relaxed);
    }
    threads.apply_lane_gates();
    // Once more after the gates changed: what lanes took before they saw their new gate.
    for r in budgeted() {
        if let Some(lanes_below) = r.counters().lanes_below() {
            publish_all_after_gates(&threads, &lanes_below);
        }
    }
}

/// How far the unpublished granted bytes of a thread's lane, over every class, may go
/// (either way) before its owner publishes them, as far as a shard's may: the shared live
/// figure, and the peak taken from it, is then off by less than this per thread and lane,
/// plus what each class's bin moved since its last refill or overflow.
pub(crate) const PUBLISH_BYTES: usize = Counters::PEAK_TOLERANCE_PER_THREAD;

/// Publishes every class of `lane` (a lane of tag `tag` in some thread's cache) with one
/// addition to the shared live figure of the lane's owner and of each child above it
/// (their peaks follow). Any thread may call this: each class's mark advances by
/// compare-and-swap. `registry`: whether the caller holds the thread registry's lock (see
/// [`Registry`]).
pub(crate) fn publish_lane(tag: Tag, lane: &Lane, registry: Registry<'_>) {
    let mut bytes = 0usize;
    for class in 0..CLASS_COUNT {
        bytes = bytes.wrapping_add(lane.take_unpublished(class));
    }
    if bytes != 0 {
        if let Some(owner) = owner(tag) {
            for r in chain(owner) {
                r.counters().publish_granted(bytes, registry);
            }
        }
    }
}

/// A set of tags (a bit each).
pub(crate) struct TagSet([u64; MAX_TAGS / 64]);

impl TagSet {
    /// Whether `tag` is in the set.
    #[inline]
    pub(crate) fn contains(&self, tag: Tag) -> bool {
        let tag = usize::from(tag);
        tag < MAX_TAGS && self.0[tag / 64] & (1 << (tag % 64)) != 0
    }
}

/// The tags whose lanes' blocks are in the figures of the allocator whose counters are
/// `counters`: its own and those of every child below it.
pub(crate) fn tags_below(counters: &Counters) -> TagSet {
    let mut set = TagSet([0; MAX_TAGS / 64]);
    for tag in 1..end() {
        if let Some(owner) = owner(tag as Tag)
            && chain(owner).any(|r| ptr::eq(r.counters(), counters))
        {
            set.0[tag / 64] |= 1 << (tag % 64);
        }
    }
    set
}

/// Publishes the lanes of the tags in `tags` of every live thread's cache (a budget needs
/// the exact live figure). Called with the thread registry locked.
///
/// A lane open under a `Fail` budget may be counting a block as its gate closes: after a
/// process-wide barrier (which pairs with the owner's compiler barrier, see
/// `Lane::announce_budget_allocation`), each such lane's allocation in flight is waited
/// out, so that the figure holds every block a lane took while its gate was open. A lane
/// whose gate is closed needs neither: whoever closed it did both, under this lock
/// ([`publish_all_after_gates`], in [`refresh`]), so its owner has seen the closed gate
/// since.
pub(crate) fn publish_all(threads: &ThreadList, tags: &TagSet) {
    publish_waiting(threads, tags, |tag, lane| {
        exact(tag) && serves(lane.hooks())
    });
}

/// [`publish_all`] right after [`refresh`] wrote the gates: the lanes a gate closed may
/// have an allocation in flight that read it open, so every lane's is waited out.
fn publish_all_after_gates(threads: &ThreadList, tags: &TagSet) {
    publish_waiting(threads, tags, |_, _| true);
}

/// Publishes the lanes of `tags` (registry locked), first waiting out the allocation in
/// flight of each lane `wait` names, after one process-wide barrier (if any is named).
fn publish_waiting(threads: &ThreadList, tags: &TagSet, wait: impl Fn(Tag, &Lane) -> bool) {
    let mut barrier = false;
    threads.for_each_lane(
        |tag| tags.contains(tag),
        |tag, lane| {
            if wait(tag, lane) {
                if !barrier {
                    crate::sync::process_barrier();
                    barrier = true;
                }
                lane.wait_out_budget_allocation();
            }
            publish_lane(tag, lane, Registry::Locked(threads));
        },
    );
}

/// Hands the counts of an exiting thread's lane of tag `tag` to the shared counters of its
/// owner and the children above it: granted bytes published, calls and requested bytes
/// absorbed. The caller zeroes the lane's counts afterwards (under the thread registry's
/// lock, which gave it `threads`).
pub(crate) fn absorb(tag: Tag, lane: &Lane, threads: &ThreadList) {
    let Some(owner) = owner(tag) else {
        return;
    };
    let mut bytes = 0usize;
    for class in 0..CLASS_COUNT {
        bytes = bytes.wrapping_add(lane.take_unpublished_exiting(class));
    }
    if bytes != 0 {
        for r in chain(owner) {
            r.counters()
                .publish_granted(bytes, Registry::Locked(threads));
        }
    }
    let mut sum = ShardSum::default();
    lane.add_to(&mut sum);
    for r in chain(owner) {
        r.counters().absorb(&sum);
    }
}

/// Adds the lanes of the tags in `tags` of every live thread's cache to `sum`, as a
/// snapshot adds the shards. Called with the thread registry locked, after the shared live
/// figure was read: a publication running meanwhile is then missed, never counted twice.
pub(crate) fn add_to(threads: &ThreadList, tags: &TagSet, sum: &mut ShardSum) {
    threads.for_each_lane(|tag| tags.contains(tag), |_, lane| lane.add_to(sum));
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::thread_cache::{LANES, lane_offset};

    #[test]
    fn lane_offsets_stay_inside_the_cache() {
        let last = lane_offset(LANES - 1) + size_of::<Lane>();
        assert!(last <= size_of::<thread_cache::ThreadCache>());
        assert_eq!(lane_offset(1) - lane_offset(0), size_of::<Lane>());
        eprintln!(
            "lane {} B, thread cache {} B",
            size_of::<Lane>(),
            size_of::<thread_cache::ThreadCache>()
        );
    }
}
