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
use crate::schema::hpha::{MAX_TAGS, Tag};
use crate::stats::{Counters, Registry, ShardSum};
use crate::thread_cache::{
    self, CHILD_LANES, HOOK_ALLOC, HOOK_CLOSED, HOOK_FREE, HOOK_FREE_SAMPLED, HOOK_SAMPLE, Lane,
    ThreadList,
};
use core::alloc::Layout;
use core::ptr::NonNull;
use core::ptr::{self, null_mut};
use core::sync::atomic::{AtomicPtr, AtomicU8, AtomicU64, AtomicUsize, Ordering::*};

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

/// The gate of a lane owned by `owner` (see [`gate`]) and its sampling interval (0: none).
fn compute_gate(owner: &'static Registration) -> (u8, u64) {
    let system = records::global::thread_hooks();
    if system & (HOOK_ALLOC | HOOK_FREE) != 0 {
        // The `SystemAllocator` records every block (or may hold records of any).
        return (CLOSED, 0);
    }
    let mut gate = system & (HOOK_SAMPLE | HOOK_FREE_SAMPLED);
    let mut interval = records::global::sample_interval().unwrap_or(u64::MAX);
    for r in chain(owner) {
        if r.budget().is_set() {
            return (CLOSED, 0);
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
    let interval = if gate & HOOK_SAMPLE != 0 { interval } else { 0 };
    (gate, interval)
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
    let threads = thread_cache::lock_threads();
    for (index, gate) in GATES.iter().enumerate().take(end()).skip(1) {
        let (hooks, interval) = owner(index as Tag).map_or((CLOSED, 0), compute_gate);
        SAMPLE_INTERVALS[index].store(interval, Relaxed);
        gate.store(hooks, Relaxed);
    }
    threads.apply_lane_gates();
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
pub(crate) fn publish_all(threads: &ThreadList, tags: &TagSet) {
    threads.for_each_lane(
        |tag| tags.contains(tag),
        |tag, lane| publish_lane(tag, lane, Registry::Locked(threads)),
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
    publish_lane(tag, lane, Registry::Locked(threads));
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
