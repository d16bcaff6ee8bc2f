//! Per-thread caches in front of the global heap's small blocks.
//!
//! The common small alloc and free touch only the calling thread's cache: a LIFO list per
//! size class, popped and pushed with no lock and no atomic read-modify-write. Blocks move
//! between a cache and the heap in batches under the class lock: a refill takes half a bin's
//! limit, a full bin gives back half. A block freed by another thread than the one that
//! allocated it simply joins the freeing thread's cache — pages belong to the heap, not to a
//! thread, so nothing is ever stranded.
//!
//! Accounting stays exact: each cache counts, per class, the blocks its thread handed to and
//! took back from the program (owner-only stores, no RMW). Readers sum every registered cache
//! plus the counts left by exited threads.
//!
//! Thread exit: a pthread key destructor (which glibc runs after Rust's TLS destructors, which
//! may still free) hands the cache back to the heap and marks it dead; a dead cache passes
//! every request straight to the heap, so the allocator stays usable while the thread's last
//! destructors run. The cache itself is a `const`-initialised `thread_local!` with no `Drop`,
//! so reaching it is a plain TLS access with no lazy initialisation.
//!
//! `fork()`: the handlers in [`fork`](super::fork) take the thread list and every heap lock
//! before the fork (after the pools' and the records' locks) and release them after, and
//! the child adopts the caches of the threads it lost.
//!
//! The cache also carries the thread's shards of the tagged allocators' counters
//! ([`ShardSet`]), so they share its registration, thread-exit and fork handling: readers
//! walk the same registry, and retiring a cache moves its shards' counts into the shared
//! counters.

mod counts;
mod dynamic;
mod lane;
mod parked;

use dynamic::{DynamicLanes, LanePool};
pub(crate) use lane::Lane;
use lane::{CLOSED, FAR, OPEN, bin_limit, freeing_limit};
pub(crate) use lane::{ClassKey, fast_key};
use parked::Parked;

use super::{guarded, lanes, thread_pointer};
use crate::config;
use crate::os::OsAllocator;
use crate::records;
use crate::schema::HphaSchema;
use crate::schema::hpha::Tag;
use crate::schema::hpha::size_class::{CLASS_COUNT, class_size};
use crate::schema::hpha::small::{
    CHECKED, FreeSlot, check_free, check_segment_before_reading, mark_allocated, segment_tag,
};
use crate::stats::{Registry, ShardSet};
use crate::sync::{FairGuard, FairLock, OnceFlag};
use core::alloc::Layout;
use core::cell::Cell;
use core::ptr::{self, NonNull, null_mut};
use core::sync::atomic::{
    AtomicBool, AtomicPtr, AtomicU32, AtomicU64, AtomicUsize, Ordering::*, fence,
};

/// Marks the branch that calls it as unlikely (`core::hint::cold_path` on newer compilers):
/// a call to an empty cold function, which inlining removes but whose weight stays.
#[cold]
#[inline(always)]
fn cold_path() {}

/// The process-wide heap behind `SystemAllocator` and the thread caches.
pub(crate) static HEAP: HphaSchema<OsAllocator> = HphaSchema::new(OsAllocator);

const STATE_NEW: u8 = 0;
const STATE_ACTIVE: u8 = 1;
const STATE_DEAD: u8 = 2;

/// [`Lane::hooks`]: allocations take the `SystemAllocator`'s general path (records of
/// every allocation, the environment not read yet, or a cache that is not registered). The
/// allocation fast path does not read the hooks: each class's
/// [`open_until`](lane::ClassSlot::open_until) mark, set from them, sends it to its miss path.
pub(crate) const HOOK_ALLOC: u8 = 1;
/// Allocations are sampled: each class's [`open_until`](lane::ClassSlot::open_until) mark is the
/// allocation count of its next sampled block, so the fast path leaves only for that one.
pub(crate) const HOOK_SAMPLE: u8 = 2;
/// Frees take the general path (records of any block may be in the table).
pub(crate) const HOOK_FREE: u8 = 4;
/// Only sampled records may be in the table: the fast path frees every block the sample
/// filter rules out, and sends the rest down the general path.
pub(crate) const HOOK_FREE_SAMPLED: u8 = 8;
/// A child's lane that is closed (see `lanes::gate`): with [`HOOK_FREE`], every call takes
/// the child's general path.
pub(crate) const HOOK_CLOSED: u8 = 16;
/// A child's lane open under a budget (see `lanes`): its allocations take the miss path
/// every few blocks of a class (the class's mark), which publishes the lane's bytes of that
/// class and checks the budget's distance before letting the next few through. Under a
/// `Fail` budget every allocation takes it (the marks stay closed), to be counted in step
/// with a thread deciding at the limit (see `budget_allocate`).
pub(crate) const HOOK_BUDGET: u8 = 64;
/// Lane 0 only: a scoped tag was entered somewhere in the process, so a small block freed
/// through the global allocator may be a tag's: the free fast path offers it to the current
/// lane, which takes it if the block's segment tag is the lane's, else the miss path asks
/// (see `crate::scope` and `Lane::plain_from`). Never cleared.
pub(crate) const HOOK_TAGS: u8 = 32;
/// Guarded sampling was turned on somewhere: in lane 0 and in the lanes of a tag that
/// guards (or once did), frees must tell guarded blocks from others (lane 0 with the
/// compare it makes anyway, `Lane::plain_from`: guarded blocks lie below the heap; child
/// lanes with one range test, out of the straight line) and the allocation marks include
/// the next guarded allocation of each class (see `ThreadCache::charge_guarded` and
/// `crate::allocator::guarded`). Never cleared from lane 0: a guarded block may be freed
/// long after the setting went.
pub(crate) const HOOK_GUARD: u8 = 128;
/// A cache that is new or dead sends everything down the general path, which checks the
/// settings word itself and registers the cache.
pub(super) const HOOKS_UNREGISTERED: u8 = HOOK_ALLOC | HOOK_FREE;

/// Per-class allocation and free counts shared by exited threads and threads running
/// without a cache (updated with read-modify-writes, from any thread).
struct Counters {
    allocations: [AtomicU64; CLASS_COUNT],
    frees: [AtomicU64; CLASS_COUNT],
}

impl Counters {
    const fn new() -> Self {
        Self {
            allocations: [const { AtomicU64::new(0) }; CLASS_COUNT],
            frees: [const { AtomicU64::new(0) }; CLASS_COUNT],
        }
    }

    fn shared_alloc(&self, class: usize) {
        self.allocations[class].fetch_add(1, Relaxed);
    }

    fn shared_free(&self, class: usize) {
        self.frees[class].fetch_add(1, Relaxed);
    }

    fn add_to(&self, totals: &mut FrontTotals) {
        for class in 0..CLASS_COUNT {
            totals.add(
                class,
                self.allocations[class].load(Relaxed),
                self.frees[class].load(Relaxed),
            );
        }
    }
}

/// What the program holds in small blocks, summed over every thread.
pub(crate) struct FrontTotals {
    /// Live blocks per class.
    pub live: [i64; CLASS_COUNT],
    pub allocations: u64,
    pub frees: u64,
}

impl FrontTotals {
    fn add(&mut self, class: usize, allocated: u64, freed: u64) {
        self.live[class] += allocated as i64 - freed as i64;
        self.allocations += allocated;
        self.frees += freed;
    }

    /// Live small blocks and their granted bytes.
    pub(crate) fn live_blocks_and_bytes(&self) -> (usize, usize) {
        let mut blocks = 0usize;
        let mut bytes = 0usize;
        for (class, &n) in self.live.iter().enumerate() {
            let n = n.max(0) as usize;
            blocks += n;
            bytes += n * class_size(class);
        }
        (blocks, bytes)
    }
}

/// Lanes per thread cache: lane 0 for the `SystemAllocator`, then [`CHILD_LANES`] for child
/// allocators.
pub(crate) const LANES: usize = CHILD_LANES + 1;
/// How many child allocators get a lane of their own (the first ones to allocate); later
/// ones count in the tagged counters' per-thread shards instead.
pub(crate) const CHILD_LANES: usize = 7;

/// One thread's cache. Lives in TLS; other threads only read its counters and, under the
/// registry lock, its links and its child lanes' gates.
#[repr(C)]
pub(crate) struct ThreadCache {
    /// Lane 0 is the `SystemAllocator`'s, lane `i` (up to [`CHILD_LANES`]) tag `i`'s; see
    /// [`Lane`] and `crate::allocator::lanes`.
    lanes: [Lane; LANES],
    /// The lane the global allocator's small fast path takes blocks from: lane 0, or the
    /// lane of the scoped tag entered on this thread once it is set up here (until then, and
    /// before the cache registers, a lane that serves nothing, so the fast path misses).
    /// Once tags are in use, lane 0's `plain_from` routes frees to the same lane (see
    /// [`set_current`](Self::set_current), the one place that changes either).
    current: Cell<*const Lane>,
    /// The scoped tag entered on this thread (0: none; see `crate::scope`).
    current_tag: Cell<Tag>,
    /// Per built-in lane, the lane while it is set up on this live cache, else null:
    /// what entering a scope of tag `i < LANES` makes [`current`](Self::current), in one
    /// load. Set with the lane's bit in [`lanes_used`](Self::lanes_used) (lane 0's when the
    /// cache registers, and kept), the others cleared when the cache retires.
    scope_lanes: [AtomicPtr<Lane>; LANES],
    /// The lanes this thread has opened (bit `i`: lane `i`; lane 0 always): a child lane is
    /// set up on the thread's first call through it, so a thread pays (at registration, exit,
    /// flushes and snapshots) only for the lanes it uses. Changed under the registry lock.
    lanes_used: AtomicU32,
    /// Lanes of the tags past the built-in ones, made on this thread's first use of each.
    dynamic: DynamicLanes,
    /// The owner's generator for sample countdowns (0 until seeded).
    sample_rng: Cell<u64>,
    /// The tag whose next general-path small allocation guarded sampling chose (0: none):
    /// set where a lane's countdown ran out, taken at the bottom of the general path.
    guard_request: Cell<Tag>,
    /// Counter shards of tagged allocators (owner writes, readers sum under `THREADS`).
    shards: ShardSet,
    state: Cell<u8>,
    next: AtomicPtr<ThreadCache>,
    prev: AtomicPtr<ThreadCache>,
}

/// The byte offset of lane `index` from the start of a [`ThreadCache`].
pub(crate) const fn lane_offset(index: usize) -> usize {
    core::mem::offset_of!(ThreadCache, lanes) + index * size_of::<Lane>()
}

impl ThreadCache {
    const fn new() -> Self {
        Self {
            lanes: [const { Lane::new(HOOKS_UNREGISTERED) }; LANES],
            current: Cell::new(ptr::addr_of!(IDLE_LANE.0)),
            current_tag: Cell::new(0),
            scope_lanes: [const { AtomicPtr::new(null_mut()) }; LANES],
            lanes_used: AtomicU32::new(1),
            dynamic: DynamicLanes::new(),
            sample_rng: Cell::new(0),
            guard_request: Cell::new(0),
            shards: ShardSet::new(),
            state: Cell::new(STATE_NEW),
            next: AtomicPtr::new(null_mut()),
            prev: AtomicPtr::new(null_mut()),
        }
    }

    /// The `SystemAllocator`'s lane.
    #[inline(always)]
    fn system(&self) -> &Lane {
        &self.lanes[0]
    }

    /// The lanes this thread uses, with their tags (lane 0 first, then the built-in child
    /// lanes, then those made on demand).
    fn used_lanes(&self) -> impl Iterator<Item = (Tag, &Lane)> {
        let used = self.lanes_used.load(Relaxed);
        let built_in = self
            .lanes
            .iter()
            .enumerate()
            .filter(move |(index, _)| used & (1 << index) != 0)
            .map(|(index, lane)| (index as Tag, lane));
        built_in.chain(self.dynamic.iter().map(|lane| (lane.tag(), lane)))
    }

    /// This thread's lane of `tag` if it is set up (lane 0 always is).
    #[inline]
    fn lane_of(&self, tag: Tag) -> Option<&Lane> {
        let index = usize::from(tag);
        if index < LANES {
            return (self.lanes_used.load(Relaxed) & (1 << index) != 0).then(|| &self.lanes[index]);
        }
        self.dynamic.get(tag)
    }

    /// Moves this cache's counts into the orphan counters and zeroes them (every lane's
    /// blocks are the `SystemAllocator`'s).
    fn move_counts_to_orphans(&self) {
        for (_, lane) in self.used_lanes() {
            for (class, slot) in lane.slots.iter().enumerate() {
                // The caller holds the registry lock, as readers of both counts do.
                counts::move_counts(
                    &slot.allocations,
                    &slot.frees,
                    &ORPHANS.allocations[class],
                    &ORPHANS.frees[class],
                );
            }
        }
    }

    /// Adds this cache's counts, every lane's, to `totals`.
    fn add_counts_to(&self, totals: &mut FrontTotals) {
        for (_, lane) in self.used_lanes() {
            for (class, slot) in lane.slots.iter().enumerate() {
                totals.add(
                    class,
                    slot.allocations.load(Relaxed),
                    slot.frees.load(Relaxed),
                );
            }
        }
    }

    /// A block of `class` from `lane`, refilling its bin from the heap when empty.
    ///
    /// # Safety
    /// Owning thread; `lane` is one of this cache's lanes; `class < CLASS_COUNT`.
    #[inline(always)]
    unsafe fn allocate(&self, lane: &Lane, class: usize) -> *mut u8 {
        // SAFETY: forwarded from the caller.
        unsafe { self.allocate_as::<true>(lane, class) }
    }

    /// [`allocate`](Self::allocate), counted in the lane (`COUNTED`) or not: a tag's
    /// general path takes blocks from its lane that it counts elsewhere (see
    /// [`allocate_uncounted`]); the bin's count stays right either way.
    ///
    /// # Safety
    /// As for [`allocate`](Self::allocate); not `COUNTED` only on a live cache.
    #[inline(always)]
    unsafe fn allocate_as<const COUNTED: bool>(&self, lane: &Lane, class: usize) -> *mut u8 {
        // SAFETY: called on the owning thread with a valid class.
        unsafe {
            let bin = lane.bin(class);
            let slot = bin.head;
            if slot.is_null() {
                return self.allocate_slow::<COUNTED>(lane, class);
            }
            if COUNTED {
                lane.pop(bin, slot, class)
            } else {
                lane.pop_uncounted(bin, slot)
            }
        }
    }

    /// Refills the bin of `class` in `lane` and takes a block. A child lane is refilled only
    /// while the cache is live (the caller checks); lane 0 also serves dead and new caches.
    #[cold]
    #[inline(never)]
    unsafe fn allocate_slow<const COUNTED: bool>(&self, lane: &Lane, class: usize) -> *mut u8 {
        let small = lane.heap();
        match self.state.get() {
            STATE_DEAD => {
                let p = small.allocate(class, HEAP.source());
                if !p.is_null() && COUNTED {
                    ORPHANS.shared_alloc(class);
                }
                return p;
            }
            STATE_NEW => self.register(0),
            _ => {}
        }
        if self.state.get() == STATE_DEAD {
            // Registration failed: this thread runs without a cache.
            // SAFETY: same thread, same lane and class.
            return unsafe { self.allocate_slow::<COUNTED>(lane, class) };
        }
        // SAFETY: owning thread, valid class.
        if unsafe { lane.sizing(class) }.limit < bin_limit(class) as i32 {
            // The thread allocates this class itself: its bin may hold a full limit now.
            // SAFETY: as above.
            unsafe { lane.set_limit(class, bin_limit(class) as i32) };
        }
        // SAFETY: owning thread, valid class.
        let (bin, sizing) = unsafe { (lane.bin(class), lane.sizing(class)) };
        let full_batch = sizing.limit as u32 / 2;
        let want = sizing.refill.min(full_batch).max(1) as usize;
        // A bin in steady use takes a page's whole free list, however long (at most one
        // page, 64 KiB), without walking it: walking a list freed in random order is one
        // dependent cache miss per block (`collections`: the refill's walk was 6.5% of the
        // run, and the workload 1.145 -> 1.088 times mimalloc's time, medians of 15 paired
        // runs). It is what a thread owning its pages (mimalloc) holds too. A bin still
        // ramping up (a short-lived thread, a class in light use) only takes a list up to
        // twice its batch, so that threads do not hold free blocks others would then carve
        // fresh memory for (`threads` workload: peak RSS 5.6 MiB with eight times everywhere,
        // 4.8 with this).
        let splice = if want as u32 >= full_batch {
            usize::MAX
        } else {
            want * 2
        };
        sizing.refill = sizing.refill.saturating_mul(2);
        let (head, got) = small.take_slots(class, want, splice, HEAP.source());
        HEAP.after_slow_path();
        if got == 0 {
            return null_mut();
        }
        // SAFETY: `head` is the first of `got` slots linked through their first word. The
        // bin is empty here, so the rest becomes the bin and the count starts again.
        unsafe {
            bin.head = (*head).next;
            if COUNTED {
                lane.owner_alloc(class);
            }
            lane.set_count(class, 0);
            mark_allocated(head.cast());
        }
        if COUNTED {
            self.after_lane_slow_path(lane, class);
        }
        head.cast()
    }

    /// After a refill or an overflow of a child lane's bin: once the lane's unpublished
    /// granted bytes, over every class, reach [`lanes::PUBLISH_BYTES`] either way, publishes
    /// them into the owners' shared figures (their peak), see `lanes`.
    #[inline(always)]
    fn after_lane_slow_path(&self, lane: &Lane, class: usize) {
        if ptr::eq(lane, self.system()) {
            return;
        }
        // SAFETY: the owner's slow path, with a valid class.
        let pending = unsafe { lane.note_unpublished(class) };
        if pending.unsigned_abs() >= lanes::PUBLISH_BYTES {
            self.publish_own_lane(lane);
        }
    }

    /// [`after_lane_slow_path`](Self::after_lane_slow_path) once the pending bytes passed the
    /// threshold: publishes every class of `lane`, a child lane of this thread's cache.
    #[cold]
    #[inline(never)]
    fn publish_own_lane(&self, lane: &Lane) {
        let tag = lane.tag();
        // Under a `Fail` budget, bytes taken from the lane's marks must not be out of every
        // figure while a thread decides at the limit: published while marked in flight if
        // the gate is open (see `lanes::checkpoint_publish`). A closed lane holds no
        // allocation unpublished (its closing published it), only frees, which can but make
        // a decision refuse early.
        let marked = lanes::exact(tag) && lane.announce_budget_allocation(HOOK_BUDGET);
        lanes::publish_lane(tag, lane, Registry::Unlocked);
        if marked {
            lane.budget_allocation_counted();
        }
        // SAFETY: called by the owner, on its slow path.
        unsafe { lane.published_all() };
    }

    /// Frees a block of `class` into `lane`.
    ///
    /// # Safety
    /// Owning thread; `lane` is one of this cache's lanes; `ptr` is a live small block of
    /// `class`.
    #[inline(always)]
    unsafe fn free(&self, lane: &Lane, ptr: *mut u8, class: usize) {
        // SAFETY: forwarded from the caller.
        unsafe { self.free_as::<true>(lane, ptr, class) }
    }

    /// [`free`](Self::free), counted in the lane (`COUNTED`) or not (see
    /// [`allocate_as`](Self::allocate_as)).
    ///
    /// # Safety
    /// As for [`free`](Self::free); not `COUNTED` only on a live cache.
    #[inline(always)]
    unsafe fn free_as<const COUNTED: bool>(&self, lane: &Lane, ptr: *mut u8, class: usize) {
        // SAFETY: `ptr` is a live small block of `class` (caller's contract); owning thread.
        unsafe {
            if COUNTED {
                if lane.push_if_room(ptr, ClassKey::of(class)) {
                    return;
                }
            } else if !lane.bin_full(class) {
                return lane.push_uncounted(lane.bin(class), ptr, class);
            }
            check_free(ptr, class);
            self.free_slow::<COUNTED>(lane, ptr, class)
        }
    }

    /// A free into a full bin (or into a cache that is new or dead): gives back part of the
    /// bin, then takes the block.
    #[cold]
    #[inline(never)]
    unsafe fn free_slow<const COUNTED: bool>(&self, lane: &Lane, ptr: *mut u8, class: usize) {
        let slot: *mut FreeSlot = ptr.cast();
        if self.state.get() == STATE_NEW {
            self.register(0);
        }
        if self.state.get() == STATE_DEAD {
            // SAFETY: the block was checked by `free` and is now free and ours.
            unsafe { lane.heap().return_slots(class, slot, 1, HEAP.stamp()) };
            HEAP.after_slow_path();
            if COUNTED {
                ORPHANS.shared_free(class);
            }
            return;
        }
        // SAFETY: owning thread, valid class; the slots handed back are free.
        unsafe {
            let count = lane.count(class);
            let (bin, sizing) = (lane.bin(class), lane.sizing(class));
            if count >= sizing.limit {
                // Give back the most recent frees: they are at the front of the list and
                // warm in this core's cache, so walking them is cheap. Blocks behind them (a
                // page's free list handed over whole by a refill) are not walked. Keep half
                // the limit, or less when the thread has rarely refilled this bin (its next
                // refill is still small): a thread that mostly frees what others allocate (a
                // consumer, a thread collecting survivors) keeps a few blocks and hands the
                // rest back in one batch (prodcons 280 ms vs 313 keeping half).
                let keep = (sizing.limit / 2).min(sizing.refill.min(i32::MAX as u32) as i32);
                // The heap walks the front of the bin once, as it gives the blocks back, and
                // says where the rest begins.
                let give = count - keep;
                let first = bin.head;
                lane.set_count(class, count - give);
                bin.head = lane
                    .heap()
                    .return_slots(class, first, give as usize, HEAP.stamp());
                HEAP.after_slow_path();
            }
            let bin = lane.bin(class);
            (*slot).next = bin.head;
            bin.head = slot;
            if COUNTED {
                lane.owner_free(class);
            } else {
                // One more block in the bin, counted nowhere here (see `Bin::full_at`).
                bin.full_at -= 1;
            }
        }
        if COUNTED {
            self.after_lane_slow_path(lane, class);
        }
    }

    /// Gives every cached block, in every lane, back to the heap.
    ///
    /// # Safety
    /// Only the owning thread (or a forked child adopting the cache) may call this.
    unsafe fn flush_all(&self) {
        for (_, lane) in self.used_lanes() {
            // SAFETY: forwarded from the caller.
            unsafe { lane.flush() };
        }
    }

    /// Registers the cache: thread-exit hook, registry entry, bin limits, lane gates. On
    /// failure the cache is marked dead and the thread runs without one.
    /// `also`: a tag (0: none) whose lane is set up in the same hold of the registry lock,
    /// beside the tag entered now: a thread whose first call frees a tag's block (a block
    /// its spawner allocated inside a scope) will most likely use that tag's lane.
    #[cold]
    fn register(&self, also: Tag) {
        apply_environment_once();
        let Some(key) = process_hooks() else {
            self.state.set(STATE_DEAD);
            return;
        };
        let me = ptr::from_ref(self).cast_mut();
        // SAFETY: the key exists; the value is this thread's cache, valid until the key's
        // destructor runs on this thread.
        if unsafe { libc::pthread_setspecific(key, me.cast()) } != 0 {
            self.state.set(STATE_DEAD);
            return;
        }
        // A thread whose first allocation is inside a scope (a closure from `bind`, a thread
        // spawned inside `scope`) needs its tag's lane at once: set up in the same hold of
        // the registry lock, so that a short-lived thread takes the lock twice in its life
        // (here and at exit), not three times.
        let entered = self.current_tag.get();
        let heap_of = |tag: Tag| {
            if tag == 0 {
                None
            } else {
                HEAP.small_heap_of(tag)
            }
        };
        let entered_heap = heap_of(entered);
        let also_heap = if also == entered { None } else { heap_of(also) };
        set_limits(self.system());
        if entered_heap.is_some() {
            self.set_built_in_limits(entered);
        }
        if also_heap.is_some() {
            self.set_built_in_limits(also);
        }
        let mut list = THREADS.lock();
        // SAFETY: this thread's lane 0, its limits set and its bins empty; the lock is held.
        unsafe { list.adopt(0, self.system()) };
        self.scope_lanes[0].store(ptr::from_ref(self.system()).cast_mut(), Relaxed);
        self.prev.store(null_mut(), Relaxed);
        self.next.store(list.head, Relaxed);
        if !list.head.is_null() {
            // SAFETY: registered caches stay valid until they unregister (under this lock).
            unsafe { (*list.head).prev.store(me, Relaxed) };
        }
        list.head = me;
        list.count += 1;
        REGISTERED.store(list.count, Relaxed);
        // Read under the registry lock: a change of the word made before this is seen here,
        // one made after it is propagated to this cache by `system_records_changed` (and
        // `enable_tags`).
        let hooks = lane0_hooks();
        self.system().set_hooks(hooks);
        self.set_first_marks(hooks);
        // Child lanes stay closed until the thread's first call through each (see
        // `set_up_lane`), but for the tags above.
        self.state.set(STATE_ACTIVE);
        if let Some(heap) = entered_heap {
            self.set_up_lane_locked(entered, heap, &mut list);
        }
        if let Some(heap) = also_heap {
            self.set_up_lane_locked(also, heap, &mut list);
        }
        self.set_current(self.lane_for_scope(self.current_tag.get()));
        drop(list);
        super::thread_pointer::learn(me.addr());
    }

    /// Flushes the cache, hands its counts to the orphan counters (and each child lane's to
    /// its owners' shared counters) and leaves the registry.
    ///
    /// # Safety
    /// The owning thread is exiting (or gone, in a forked child); `list` is the locked
    /// registry containing this cache.
    ///
    /// Returns the built-in lanes (a bit each) whose counts and limits the caller clears
    /// with [`shut_built_in`](Self::shut_built_in), after releasing the lock: once the
    /// cache left the list nothing else reaches them, so that work need not hold up the
    /// threads waiting for the lock.
    #[must_use]
    unsafe fn retire(&self, list: &mut ThreadList) -> u32 {
        // Each lane's bins are parked whole for the next thread of that tag, or, with no room
        // left, given back to the heap.
        for (tag, lane) in self.used_lanes() {
            // SAFETY: forwarded from the caller: the owner is exiting, the lock is held.
            unsafe {
                if !list.park(tag, lane) {
                    lane.flush();
                }
            }
        }
        self.state.set(STATE_DEAD);
        for (tag, lane) in self.used_lanes().skip(1) {
            lanes::absorb(tag, lane, list);
        }
        self.move_counts_to_orphans();
        for (_, lane) in self.used_lanes() {
            lane.set_hooks(HOOKS_UNREGISTERED);
        }
        for lane in self.dynamic.iter() {
            lane.reset_counts();
            // SAFETY: as above. The counts are zero now and the bins empty.
            unsafe { lane.shut() };
        }
        let built_in = self.lanes_used.load(Relaxed);
        // Lanes made on demand go back to the pool for other threads; from now on a scoped
        // call of this thread takes its tag's general path (see `lane_for_scope`).
        self.set_current(&self.lanes[0]);
        self.lanes_used.store(1, Relaxed);
        for lane in &self.scope_lanes[1..] {
            lane.store(null_mut(), Relaxed);
        }
        // SAFETY: under the registry lock; the lanes are flushed, absorbed and shut.
        unsafe { self.dynamic.release_all(list) };
        self.shards.retire(list);
        let (prev, next) = (self.prev.load(Relaxed), self.next.load(Relaxed));
        // SAFETY: neighbours are registered caches, valid under the registry lock.
        unsafe {
            if prev.is_null() {
                list.head = next;
            } else {
                (*prev).next.store(next, Relaxed);
            }
            if !next.is_null() {
                (*next).prev.store(prev, Relaxed);
            }
        }
        list.count -= 1;
        REGISTERED.store(list.count, Relaxed);
        built_in
    }

    /// Clears the counts and closes the limits of the built-in lanes `retire` returned (a
    /// bit each). The cache is off the registry's list, so no lock is needed.
    ///
    /// # Safety
    /// After [`retire`](Self::retire) of this cache, by the thread that called it, before
    /// anything else uses the cache (its thread is exiting or gone).
    unsafe fn shut_built_in(&self, lanes: u32) {
        for (index, lane) in self.lanes.iter().enumerate() {
            if lanes & (1 << index) != 0 {
                lane.reset_counts();
                // SAFETY: forwarded from the caller; the lane's bins are empty (parked or
                // flushed by `retire`) and its counts handed on.
                unsafe { lane.shut() };
            }
        }
    }
}

impl ThreadCache {
    /// This thread's lane of `tag` (1 or more), set up on the thread's first call through
    /// it: its bins' limits, its tag's heap, and its gate (see `lanes::refresh`, which from
    /// then on keeps the gate here up to date). `None` when the cache is not live, the tag
    /// has no heap (out of memory), or no lane can be made (out of memory).
    #[inline]
    fn lane_set_up(&self, tag: Tag) -> Option<&Lane> {
        if let Some(lane) = self.lane_of(tag) {
            return Some(lane);
        }
        self.set_up_lane(tag)
    }

    /// [`lane_set_up`](Self::lane_set_up) the first time.
    #[cold]
    #[inline(never)]
    fn set_up_lane(&self, tag: Tag) -> Option<&Lane> {
        if self.state.get() != STATE_ACTIVE || tag == 0 {
            return None;
        }
        let heap = HEAP.small_heap_of(tag)?;
        self.set_built_in_limits(tag);
        let mut list = THREADS.lock();
        self.set_up_lane_locked(tag, heap, &mut list)
    }

    /// Sets the bin limits of `tag`'s built-in lane (none for a tag past them), before
    /// [`set_up_lane_locked`](Self::set_up_lane_locked) lists it: the lane is unused and
    /// unlisted, so this needs no lock, and the registry lock is held shorter.
    fn set_built_in_limits(&self, tag: Tag) {
        if let Some(lane) = self.lanes.get(usize::from(tag)) {
            set_limits(lane);
        }
    }

    /// [`set_up_lane`](Self::set_up_lane) with the registry lock held (`list`): under it,
    /// as `refresh` writes gates, so that once the lane is listed every later change reaches
    /// it. Lanes made on demand come from the list's pool. The cache is active.
    fn set_up_lane_locked(
        &self,
        tag: Tag,
        heap: &'static crate::schema::hpha::small::SmallHeap,
        list: &mut ThreadList,
    ) -> Option<&Lane> {
        let index = usize::from(tag);
        let lane = if index < LANES {
            // Its limits were set before the lock was taken (see `set_built_in_limits`).
            &self.lanes[index]
        } else {
            let lane = self.dynamic.make(tag, list)?;
            set_limits(lane);
            lane
        };
        lane.set_tag(tag, heap);
        // SAFETY: this thread's lane, set up with its limits and empty bins; the lock is held.
        unsafe { list.adopt(tag, lane) };
        if index < LANES {
            self.lanes_used.fetch_or(1 << index, Relaxed);
            self.scope_lanes[index].store(ptr::from_ref(lane).cast_mut(), Relaxed);
        } else {
            // SAFETY: the lane was made for this thread and is set up; the lock is held.
            unsafe { self.dynamic.link(lane) };
        }
        set_lane_gate(lane, lanes::gate(tag));
        if self.current_tag.get() == tag {
            self.set_current(lane);
        }
        Some(lane)
    }

    /// What [`current`](Self::current) should be while `tag` is entered: lane 0 for no tag,
    /// else the tag's lane if it is set up on a live cache, else a lane that serves nothing
    /// (the fast path then misses, and the miss path sets the lane up or takes the tag's
    /// general path).
    ///
    /// Inline for a built-in lane that is set up: [`scope_lanes`](Self::scope_lanes)
    /// holds it then (set only on an active cache, in `set_up_lane_locked`, and cleared
    /// when it retires), so entering and leaving such a scope call nothing.
    #[inline(always)]
    fn lane_for_scope(&self, tag: Tag) -> *const Lane {
        let index = usize::from(tag);
        if index < LANES {
            let lane = self.scope_lanes[index].load(Relaxed);
            if !lane.is_null() {
                // Lane 0's stays set after the cache retires (as lane 0 stays current then).
                debug_assert!(index == 0 || self.state.get() == STATE_ACTIVE);
                return lane;
            }
        }
        self.lane_for_scope_slowly(tag)
    }

    /// [`lane_for_scope`](Self::lane_for_scope) for a lane made on demand, or one not set up
    /// (lane 0 too, before the cache registers).
    #[inline(never)]
    fn lane_for_scope_slowly(&self, tag: Tag) -> *const Lane {
        if tag == 0 {
            return &self.lanes[0];
        }
        match self.lane_of(tag) {
            Some(lane) if self.state.get() == STATE_ACTIVE => lane,
            _ => ptr::addr_of!(IDLE_LANE.0),
        }
    }

    /// Enters `previous` again as a scope closes (0: none). As [`enter`](Self::enter), but
    /// no tag, the usual case, is tested first: its lane is always lane 0 (whose bit in
    /// `lanes_used` is never cleared), so the bits need no look.
    #[inline(always)]
    fn leave(&self, previous: Tag) {
        self.current_tag.set(previous);
        let lane = if previous == 0 {
            &self.lanes[0]
        } else {
            self.lane_for_scope(previous)
        };
        self.set_current(lane);
    }

    /// Enters `tag` on this thread (0: none); returns the tag it replaces.
    #[inline(always)]
    fn enter(&self, tag: Tag) -> Tag {
        let previous = self.current_tag.replace(tag);
        self.set_current(self.lane_for_scope(tag));
        previous
    }

    /// Makes `lane` [`current`](Self::current), and the lane lane 0 routes small frees to
    /// once tags are in use (see `Lane::plain_from`).
    #[inline(always)]
    fn set_current(&self, lane: *const Lane) {
        self.current.set(lane);
        // SAFETY: `lane` is one of this cache's lanes or the idle lane (every caller's).
        self.system().route_frees_to(unsafe { &*lane });
    }
}

/// A lane that serves nothing: its bins are empty and its marks closed, so the allocation
/// fast path misses on it. What [`ThreadCache::current`] points to before the cache
/// registers and while a scoped tag's lane is not set up on the thread.
struct IdleLane(Lane);

// SAFETY: nothing writes to the idle lane: the fast path only reads it (its bins are empty,
// so it never pops), a free routed to it never passes the tag test (its tag is no segment's,
// see `free_in_routed_lane`), and no walk reaches it (it is in no thread's list).
unsafe impl Sync for IdleLane {}

static IDLE_LANE: IdleLane = IdleLane(Lane::idle());

/// Sets every bin limit of a lane of the calling thread that is not in use yet (its bins
/// empty).
fn set_limits(lane: &Lane) {
    for class in 0..CLASS_COUNT {
        // SAFETY: the caller's lane, unused, so its bins are empty; `class < CLASS_COUNT`.
        unsafe { lane.set_limit(class, freeing_limit(class) as i32) };
    }
}

/// Writes a child lane's gate (see `lanes::gate`): its hooks byte, then every class's mark,
/// closed unless the lane serves allocations without sampling (a sampling lane's owner
/// draws its countdowns at its next allocation of each class). Called under the registry
/// lock, so no two threads change gates at once; the fence orders the marks after the
/// hooks for an owner setting a mark meanwhile (see `ThreadCache::set_open_until`).
fn set_lane_gate(lane: &Lane, hooks: u8) {
    lane.set_hooks(hooks);
    fence(SeqCst);
    set_lane_marks(lane, hooks);
}

/// The second half of [`set_lane_gate`]: every class's mark for `hooks`, after the hooks.
fn set_lane_marks(lane: &Lane, hooks: u8) {
    let until = if lanes::serves(hooks) {
        ThreadCache::initial_open_until(hooks)
    } else {
        CLOSED
    };
    for slot in &lane.slots {
        slot.open_until.store(until, Relaxed);
    }
}

thread_local! {
    static CACHE: ThreadCache = const { ThreadCache::new() };
}

/// The registered caches of live threads (reached through [`LockedThreads`], or by a
/// retiring cache that holds the lock).
pub(crate) struct ThreadList {
    head: *mut ThreadCache,
    count: usize,
    /// Lanes made on demand that no thread uses now (see `dynamic`).
    pool: LanePool,
    /// Bins of exited threads, for the next threads (see `parked`).
    parked: Parked,
}
// SAFETY: the list only links TLS caches that unregister (under its lock) before their
// thread's TLS goes away.
unsafe impl Send for ThreadList {}

static THREADS: FairLock<ThreadList> = FairLock::new(ThreadList {
    head: null_mut(),
    count: 0,
    pool: LanePool::new(),
    parked: Parked::new(),
});

/// Counts of exited threads and of threads running without a cache.
static ORPHANS: Counters = Counters::new();

/// Allocates a small block of `class` for the program, from lane 0 (no records, no
/// sampling: the callers have decided). Reaches the cache from the thread pointer where it
/// can, as the fast paths do (a new cache's bins are empty, so its first call registers it).
#[inline(always)]
pub(crate) fn allocate(class: usize) -> *mut u8 {
    // SAFETY: the cache is this thread's own; `class` comes from `class_for`.
    with_cache(|tc| unsafe { tc.allocate(tc.system(), class) })
}

/// Frees a small block of `class`.
///
/// # Safety
/// `ptr` must be a live small block of `class` handed out by [`allocate`].
#[inline(always)]
pub(crate) unsafe fn free(ptr: *mut u8, class: usize) {
    // SAFETY: forwarded from the caller; the cache is this thread's own (a new cache's
    // limits make its first free a miss, which registers it).
    with_cache(|tc| unsafe { tc.free(tc.system(), ptr, class) })
}

/// The calling thread's cache as a fast path found it through the thread pointer; null
/// where the thread pointer cannot reach it (then only `thread_local!` can).
pub(crate) type CacheRef = *const ThreadCache;

/// The small-allocation fast path of `SystemAllocator::alloc`: pops a block of `key`'s class
/// (a [`ClassKey`]: no multiply to find the class's slot).
/// Everything else — an empty bin, the class's allocation count at its
/// [`open_until`](lane::ClassSlot::open_until) mark (records want a look: a sampled allocation, or
/// records of every allocation), or a cache only reachable through `thread_local!` — goes to
/// `miss(size, align, class)`, a single way out that keeps the caller's own arguments in
/// their own registers (so the fast path needs no stack frame and no moves). The miss finds
/// the cache again itself ([`missed_cache`]): passing it cost the fast path an instruction
/// on every hit, where the compiler computed the cache's address for the exits that need it.
///
/// `SCOPED`: the global allocator's own entry, which allocates from the lane of the scoped
/// tag entered on the thread (see [`ThreadCache::current`]) and counts the request there;
/// otherwise lane 0 (the `SystemAllocator` as a parent, or as a pool's page source, whose
/// blocks are never a scope's).
#[inline(always)]
pub(crate) fn allocate_gated<const SCOPED: bool>(
    key: ClassKey,
    layout: Layout,
    miss: fn(usize, usize, usize) -> *mut u8,
) -> *mut u8 {
    if let Some(addr) = thread_pointer::cache_address() {
        let tc = addr as CacheRef;
        // SAFETY: `tc` is this thread's cache (see `thread_pointer`), which lives as long as
        // the thread, and `current` one of its lanes (or the idle lane); `key` comes from
        // the class table.
        unsafe {
            let lane = if SCOPED {
                &*(*tc).current.get()
            } else {
                (*tc).system()
            };
            let p = lane.allocate_open(key);
            if !p.is_null() {
                if SCOPED {
                    // Counted in lane 0 too, where nobody reads it: cheaper than a branch.
                    lane.add_requested_fast(layout.size());
                }
                return p;
            }
        }
    }
    miss(layout.size(), layout.align(), key.class())
}

/// The calling thread's cache as [`allocate_gated`]'s fast path found it, for its miss:
/// null where the thread pointer cannot reach it.
#[inline(always)]
pub(crate) fn missed_cache() -> CacheRef {
    thread_pointer::cache_address().map_or(ptr::null(), |addr| addr as CacheRef)
}

/// Where [`allocate_gated`] missed with a cache in hand: what the records settings say
/// about this allocation of `class` (see [`SampleCharge`]; [`SampleCharge::Due`] is settled
/// by [`charge_due`]). Also reopens the fast path of a class that a settings change closed.
///
/// # Safety
/// `tc` is the calling thread's cache as [`allocate_gated`] passed it (not null);
/// `class < CLASS_COUNT`.
#[inline(always)]
pub(crate) unsafe fn charge(tc: CacheRef, class: usize) -> SampleCharge {
    // SAFETY: forwarded from the caller.
    unsafe { (*tc).charge((*tc).system(), class) }
}

/// Settles a [`SampleCharge::Due`] from [`charge`].
///
/// # Safety
/// As for [`charge`].
pub(crate) unsafe fn charge_due(tc: CacheRef, class: usize) -> SampleCharge {
    // SAFETY: forwarded from the caller.
    unsafe { (*tc).charge_due((*tc).system(), class) }
}

/// A block of `class` from the cache a fast path found, refilling its bin from the heap
/// when empty (what [`allocate`] does through `thread_local!`); null when out of memory.
///
/// # Safety
/// As for [`charge`].
#[inline(always)]
pub(crate) unsafe fn allocate_in(tc: CacheRef, class: usize) -> *mut u8 {
    // SAFETY: forwarded from the caller.
    unsafe { (*tc).allocate((*tc).system(), class) }
}

/// The records hooks of a cache a fast path found (see [`Lane::hooks`]).
///
/// # Safety
/// `tc` is the calling thread's cache as a fast path passed it (not null).
#[inline(always)]
pub(crate) unsafe fn hooks_of(tc: CacheRef) -> u8 {
    // SAFETY: forwarded from the caller.
    unsafe { (*tc).system().hooks.load(Relaxed) }
}

/// Pops a block of `class` whatever the hooks say (the caller records it); null when the
/// bin is empty (always so for a cache that is not registered).
///
/// # Safety
/// As for [`charge`].
#[inline(always)]
pub(crate) unsafe fn pop_any(tc: CacheRef, class: usize) -> *mut u8 {
    // SAFETY: forwarded from the caller.
    unsafe {
        let lane = (*tc).system();
        let bin = lane.bin(class);
        let slot = bin.head;
        if slot.is_null() {
            return null_mut();
        }
        lane.pop(bin, slot, class)
    }
}

/// Pushes a block of `class` whatever the hooks say (the caller removed its record);
/// `false` when the bin is full (always so for a cache that is not registered).
///
/// # Safety
/// As for [`free_untagged`].
#[inline(always)]
pub(crate) unsafe fn push_any(tc: CacheRef, ptr: *mut u8, class: usize) -> bool {
    // SAFETY: forwarded from the caller.
    unsafe { (*tc).system().push_if_room(ptr, ClassKey::of(class)) }
}

/// [`charge`] through `thread_local!`: [`SampleCharge::General`] for a cache that is not
/// registered.
#[inline(always)]
pub(crate) fn charge_tls(class: usize) -> SampleCharge {
    // SAFETY: the cache is this thread's own; `class` comes from the class table.
    CACHE.with(|tc| unsafe { tc.charge_settled(tc.system(), class) })
}

/// The small-free fast path of `SystemAllocator::dealloc`: pushes the block onto its bin.
/// A full bin, records that may hold the block, or a cache only reachable through
/// `thread_local!`, send it to `miss(ptr, size, align, class, cache)` (see
/// [`allocate_gated`]); once tags are in use (see [`HOOK_TAGS`]), a block of the thread's
/// current tag goes into the current lane ([`free_in_routed_lane`]) and any other to `miss`.
///
/// # Safety
/// `ptr` must be a live small block of `key`'s class allocated with `layout`; `miss` must be
/// safe to call with them (and the class).
#[inline(always)]
pub(crate) unsafe fn free_gated(
    ptr: *mut u8,
    key: ClassKey,
    layout: Layout,
    miss: unsafe fn(*mut u8, usize, usize, usize, CacheRef),
) {
    // SAFETY: `tc` is this thread's cache (see `thread_pointer`); the rest is forwarded
    // from the caller.
    unsafe {
        let Some(addr) = thread_pointer::cache_address() else {
            return miss(ptr, layout.size(), layout.align(), key.class(), ptr::null());
        };
        let tc = addr as CacheRef;
        let lane = (*tc).system();
        // One compare for the hooks of a free: none, or only guarded sampling and a block
        // above the guarded area, go straight to the bin (see `Lane::plain_from`).
        let plain_from = lane.plain_from();
        if ptr.addr() < plain_from.addr() {
            // Out of line, tags included: the untagged push then falls straight through. Laid
            // out the other way (as the compiler chose), both the untagged and the scoped
            // pair ran slower, by 5% and 1.5% (`scope_pairs`, 21 paired rounds): placement.
            cold_path();
            // Tags first: a scoped program frees every block here, so its test comes before
            // the hooks', and before the word's kind is known: the block's segment tag equals
            // the word's low 16 bits only for a route to the lane that takes the block.
            if CHECKED && !guarded::AREA.contains(ptr.addr()) {
                check_segment_before_reading(ptr, key.class());
            }
            if let Some(routed) = lane::routed_lane_above_a_block(plain_from, segment_tag(ptr)) {
                if free_in_routed_lane(routed, ptr, key, layout.size()) {
                    return;
                }
                return miss(ptr, layout.size(), layout.align(), key.class(), tc);
            }
            if lane::is_route(plain_from) {
                // A block of another tag (a guarded block's tag is no lane's), or a lane
                // that asks the hooks.
                return miss(ptr, layout.size(), layout.align(), key.class(), tc);
            }
            let hooks = lane.hooks.load(Relaxed);
            if hooks & (HOOK_FREE | HOOK_FREE_SAMPLED | HOOK_GUARD) == HOOK_FREE_SAMPLED {
                // The `SystemAllocator` samples, and nothing else: one look at the sample
                // filter, then the straight line.
                if records::global::maybe_sampled(ptr) {
                    return miss(ptr, layout.size(), layout.align(), key.class(), tc);
                }
                if !lane.push_if_room(ptr, key) {
                    miss(ptr, layout.size(), layout.align(), key.class(), tc);
                }
                return;
            }
            if hooks & (HOOK_FREE | HOOK_FREE_SAMPLED) == 0 {
                // Guarded sampling without records of frees, and a block below the guarded
                // area's end: a guarded one, or one of a segment the kernel placed below
                // the area.
                if guarded::AREA.contains(ptr.addr()) || !lane.push_if_room(ptr, key) {
                    miss(ptr, layout.size(), layout.align(), key.class(), tc);
                }
                return;
            }
            // Out of the straight line: records off and no tags is the case to keep short.
            cold_path();
            if hooks & HOOK_FREE != 0
                || (hooks & HOOK_GUARD != 0 && guarded::AREA.contains(ptr.addr()))
                || (hooks & HOOK_FREE_SAMPLED != 0 && records::global::maybe_sampled(ptr))
            {
                return miss(ptr, layout.size(), layout.align(), key.class(), tc);
            }
        }
        if !lane.push_if_room(ptr, key) {
            miss(ptr, layout.size(), layout.align(), key.class(), tc);
        }
    }
}

/// Where tags are in use, [`free_gated`]'s way for the common scoped free: a block of the tag
/// the thread is in (or of tag 0 outside any scope) goes into the lane lane 0 routes frees
/// to (the current one), once its segment's tag matched the route's; `false` when the bin
/// is full.
///
/// # Safety
/// `lane` is the lane of the calling thread's lane-0 route (one of its lanes: the idle
/// lane's field matches no segment), and the block's segment tag matched the route's field;
/// `ptr` is a live small block of `key`'s class allocated for `size` bytes (or a size up to
/// the granted one).
#[inline(always)]
pub(crate) unsafe fn free_in_routed_lane(
    lane: *const Lane,
    ptr: *mut u8,
    key: ClassKey,
    size: usize,
) -> bool {
    // SAFETY: forwarded from the caller: the route is one of this thread's lanes (only the
    // owner routes to a lane, its current one, which lives while the route does: `retire`
    // takes the route away before it releases lanes), and the block lies in a segment of the
    // lane's tag (the route's field, the lane's `free_tag`, equals the lane's tag only while
    // the lane takes frees without looking at records).
    unsafe {
        let lane = &*lane;
        if !lane.push_if_room(ptr, key) {
            return false;
        }
        lane.sub_requested_fast(size);
    }
    true
}

/// Lane 0's [`Lane::free_filtered`] through `thread_local!`, for a block whose tag the
/// caller asked (0).
///
/// # Safety
/// `ptr` is a live small block of `class`.
#[inline(always)]
pub(crate) unsafe fn free_filtered_tls(ptr: *mut u8, class: usize) -> bool {
    // SAFETY: forwarded from the caller (the caller asked the block for its tag); the cache
    // is this thread's own.
    CACHE.with(|tc| unsafe { tc.system().free_filtered(ptr, class) })
}

// ---- Child lanes: the paths of children with a tag (see `lanes`). ----

/// A lane's offset from the thread pointer, the same in every thread (static TLS): what a
/// child's lane word holds, so that its fast path finds the lane with one add. `None` while
/// the thread pointer cannot reach the caches.
pub(crate) fn lane_thread_offset(index: usize) -> Option<usize> {
    debug_assert!(index < LANES);
    Some(thread_pointer::cache_offset()?.wrapping_add(lane_offset(index)))
}

/// The calling thread's lane at `lane` bytes from the thread pointer (see
/// [`lane_thread_offset`]); `None` for 0, a child without a built-in lane.
///
/// # Safety
/// `lane` is 0 or [`lane_thread_offset`] of an index below [`LANES`].
#[inline(always)]
unsafe fn lane_of_thread(lane: usize) -> Option<&'static Lane> {
    let addr = thread_pointer::address_at(lane)?;
    // `'static` stands for "this thread's lifetime": the reference never leaves the call.
    // SAFETY: the offset of one of the lanes of this thread's cache (the caller's contract).
    Some(unsafe { &*(addr as *const Lane) })
}

/// Runs `f` on the calling thread's cache: found from the thread pointer where it can be
/// (one load), else through `thread_local!`.
#[inline(always)]
pub(crate) fn with_cache<R>(f: impl FnOnce(&ThreadCache) -> R) -> R {
    match thread_pointer::cache_address() {
        // SAFETY: the address is this thread's cache (see `thread_pointer`), which lives as
        // long as the thread.
        Some(addr) => f(unsafe { &*(addr as CacheRef) }),
        None => CACHE.with(|tc| f(tc)),
    }
}

/// Whether `lane` of this thread's cache `tc` is on the straight line of the miss paths
/// and of a child's resize: open without hooks (no sampling either) on a live cache.
#[inline(always)]
fn lane_plain(tc: &ThreadCache, lane: &Lane) -> bool {
    lane.hooks.load(Relaxed) == 0 && tc.state.get() == STATE_ACTIVE
}

/// This thread's lane of `tag` if a miss path may use it: the cache is live, the lane set
/// up (now, on the thread's first call of the tag) and open. `None`: the child takes its
/// general path.
fn lane_usable(tc: &ThreadCache, tag: Tag) -> Option<&Lane> {
    if tc.state.get() == STATE_NEW {
        // The thread's first call: register with this tag's lane, in one hold of the lock.
        tc.register(tag);
    }
    if tc.state.get() != STATE_ACTIVE {
        return None;
    }
    tc.lane_set_up(tag)
        .filter(|lane| lanes::serves(lane.hooks.load(Relaxed)))
}

/// This thread's lane of `tag` when a child's small resize may stay in it: the lane is open
/// without hooks (no sampling either) and the cache is live, so the lane's own paths serve
/// the resize and its counts are this thread's to write. `None`: the child takes its
/// general path.
#[inline(always)]
pub(crate) fn lane_for_resize(tag: Tag, ptr: *mut u8) -> Option<&'static Lane> {
    with_cache(|tc| {
        let lane = tc.lane_of(tag)?;
        let hooks = lane.hooks.load(Relaxed);
        // Guarded sampling alone leaves the lane plain for blocks that are not guarded.
        let plain = hooks == 0 || (hooks == HOOK_GUARD && !guarded::AREA.contains(ptr.addr()));
        // `'static` stands for "this thread's lifetime": the caller uses it in this call.
        // SAFETY: a lane of this thread's cache, valid until the thread exits.
        (plain && tc.state.get() == STATE_ACTIVE).then(|| unsafe { &*ptr::from_ref(lane) })
    })
}

/// A child's small allocation from its built-in lane (`lane`: see [`lane_thread_offset`]):
/// pops a block of `class` and counts `size` requested bytes (if the child keeps them:
/// `requested`, a constant at every call site). Null when the child has no built-in lane,
/// the bin is empty or the lane is closed: then [`lane_allocate_missed`].
///
/// # Safety
/// `lane` is 0 or [`lane_thread_offset`] of an index below [`LANES`]; `class < CLASS_COUNT`.
#[inline(always)]
pub(crate) unsafe fn lane_allocate(
    lane: usize,
    class: usize,
    size: usize,
    requested: bool,
) -> *mut u8 {
    // SAFETY: forwarded from the caller.
    unsafe {
        let Some(lane) = lane_of_thread(lane) else {
            return null_mut();
        };
        let p = lane.allocate_open(ClassKey::of(class));
        if requested && !p.is_null() {
            lane.add_requested(size);
        }
        p
    }
}

/// [`lane_allocate`] missed, for the child of tag `tag`: refills the bin if the lane is open
/// and the cache live, and while the `SystemAllocator` samples, draws the class's countdown
/// and records a sampled block for it. `None`: no usable lane, so the child takes its
/// general path; `Some(null)`: out of memory.
///
/// The common case, an open lane without sampling (hooks byte 0) on a live cache whose bin
/// is empty, is a straight line to the refill; everything else is out of line in
/// [`lane_allocate_hooked`].
///
/// # Safety
/// `class` is the class of `layout` (see `fast_class`).
#[inline(always)]
pub(crate) unsafe fn lane_allocate_missed(
    tag: Tag,
    class: usize,
    layout: Layout,
    requested: bool,
) -> Option<*mut u8> {
    // SAFETY: forwarded from the caller.
    with_cache(|tc| unsafe { allocate_in_lane(tc, tag, class, layout, requested) })
}

/// [`lane_allocate_missed`] on the calling thread's cache `tc`.
///
/// # Safety
/// As for [`lane_allocate_missed`]; `tc` is the calling thread's cache.
#[inline(always)]
unsafe fn allocate_in_lane(
    tc: &ThreadCache,
    tag: Tag,
    class: usize,
    layout: Layout,
    requested: bool,
) -> Option<*mut u8> {
    // SAFETY: the cache is this thread's and live, and the lane open, so its bins and
    // marks are this thread's to refill.
    unsafe {
        if let Some(lane) = tc.lane_of(tag)
            && tc.state.get() == STATE_ACTIVE
        {
            let hooks = lane.hooks.load(Relaxed);
            if hooks == 0 && lane.slots.get_unchecked(class).open_until.load(Relaxed) == OPEN {
                let p = tc.allocate(lane, class);
                if requested && !p.is_null() {
                    lane.add_requested(layout.size());
                }
                return Some(p);
            }
            if hooks == HOOK_BUDGET {
                // Straight to it: a lane under a `Fail` budget comes here on every call.
                return budget_allocate(tc, lane, tag, class, hooks, layout.size(), requested);
            }
        }
        lane_allocate_hooked(tc, tag, class, layout, requested)
    }
}

/// [`lane_allocate_missed`] off its straight line: a lane not set up on this thread yet,
/// closed, sampling, or a class's mark closed by a gate change; or a cache not live.
///
/// # Safety
/// As for [`allocate_in_lane`].
#[cold]
#[inline(never)]
unsafe fn lane_allocate_hooked(
    tc: &ThreadCache,
    tag: Tag,
    class: usize,
    layout: Layout,
    requested: bool,
) -> Option<*mut u8> {
    let lane = lane_usable(tc, tag)?;
    // SAFETY: the cache is this thread's, live, and the lane open, so its bins and marks
    // are this thread's to refill and draw; the rest is forwarded from the caller.
    unsafe {
        let hooks = lane.hooks.load(Relaxed);
        if hooks & HOOK_BUDGET != 0 {
            return budget_allocate(tc, lane, tag, class, hooks, layout.size(), requested);
        }
        let sampled = match tc.charge_settled(lane, class) {
            SampleCharge::Sampled(interval) => Some(interval),
            SampleCharge::General => return None,
            SampleCharge::Guarded => {
                // The child's general path serves it, and its bottom places the block in
                // the guarded area (see `take_guard_request`).
                tc.guard_request.set(tag);
                return None;
            }
            SampleCharge::Skip | SampleCharge::Due => None,
        };
        let p = tc.allocate(lane, class);
        if let Some(ptr) = NonNull::new(p) {
            if requested {
                lane.add_requested(layout.size());
            }
            if let Some(interval) = sampled {
                lanes::record_sampled(tag, ptr, layout, class_size(class), interval);
            }
        }
        Some(p)
    }
}

/// A small allocation through a lane open under a budget (`hooks` has `HOOK_BUDGET`) that
/// missed its fast path: a budget's checkpoint, or (under a `Fail` budget) any allocation.
///
/// Under `Warn` budgets only, the lane serves runs of blocks on its fast path: the block is
/// taken and counted here, then the checkpoint publishes the class's bytes and, if every
/// budget above is still far, opens the class's mark for the next run.
///
/// Under a `Fail` budget the marks stay closed, so that every allocation can be counted in
/// step with a thread deciding at the limit (a block counted after a decision that missed
/// it would take the budget over). The block is taken without being counted first, so that
/// a refill, which may take the heap's locks and the thread registry's, comes before the
/// allocation is marked in flight (a thread waiting for it may hold the registry's lock);
/// then it is marked, the gate looked at again (see [`Lane::announce_budget_allocation`]),
/// and counted. Every run of blocks of the class ends in the same checkpoint.
///
/// In both, if a budget is near, the lanes close and this block goes back: `None`, the
/// general path serves.
///
/// # Safety
/// As for [`allocate_in_lane`]; `lane` is this thread's live lane of `tag`, and `size` the
/// request's size.
#[cold]
#[inline(never)]
unsafe fn budget_allocate(
    tc: &ThreadCache,
    lane: &Lane,
    tag: Tag,
    class: usize,
    hooks: u8,
    size: usize,
    requested: bool,
) -> Option<*mut u8> {
    // SAFETY: the owning thread, a live cache and a lane of it, a valid class (forwarded
    // from the caller): its bins, marks and sizings are this thread's.
    unsafe {
        let exact = lanes::exact(tag);
        let (p, bytes) = if exact {
            let p = tc.allocate_as::<false>(lane, class);
            if p.is_null() {
                return Some(p);
            }
            if !lane.announce_budget_allocation(hooks) {
                // The gate changed since the caller read it: the block goes back uncounted
                // (the bin had it a moment ago, so it has room) and the general path serves.
                lane.push_uncounted(lane.bin(class), p, class);
                return None;
            }
            lane.count_uncounted_pop(class);
            let left = lane.sizing(class).budget_left;
            if left != 0 {
                lane.budget_allocation_counted();
                lane.sizing(class).budget_left = left - 1;
                if requested {
                    lane.add_requested(size);
                }
                return Some(p);
            }
            // The class's bytes go into the shared figure while the allocation is still
            // marked in flight (see `lanes::checkpoint_publish`), the decision after.
            let bytes = lanes::checkpoint_publish(tag, lane, class);
            lane.budget_allocation_counted();
            (p, bytes)
        } else {
            let p = tc.allocate(lane, class);
            if p.is_null() {
                return Some(p);
            }
            (p, lanes::checkpoint_publish(tag, lane, class))
        };
        let Some(run) = lanes::checkpoint_decide(tag, class, bytes) else {
            tc.free(lane, p, class);
            lane.forget_pair(class);
            return None;
        };
        if exact {
            lane.sizing(class).budget_left = run;
        } else {
            let slot = lane.slots.get_unchecked(class);
            let count = slot.allocations.load(Relaxed);
            tc.set_open_until(lane, class, count.saturating_add(u64::from(run)), hooks);
            // A `Fail` budget set meanwhile keeps the hooks byte as it was: `refresh` sets
            // `EXACT` before it closes the marks, and the fence in `set_open_until` orders
            // this look after the mark's store, so either the look sees it or the close
            // comes after the store.
            if lanes::exact(tag) {
                slot.open_until.store(CLOSED, Relaxed);
            }
        }
        if requested {
            lane.add_requested(size);
        }
        Some(p)
    }
}

/// A child's small free into its built-in lane: pushes the block if the child has one, the
/// lane is open and its bin has room, uncounting `size` requested bytes (if the child keeps
/// them: `requested`); `false` otherwise (then [`lane_free_missed`]).
///
/// # Safety
/// As for [`lane_allocate`]; `ptr` is a live small block of `class` allocated through the
/// same child with a request of `size` bytes (or one between that and the granted size).
#[inline(always)]
pub(crate) unsafe fn lane_free(
    lane: usize,
    ptr: *mut u8,
    class: usize,
    size: usize,
    requested: bool,
) -> bool {
    // SAFETY: as in `lane_allocate`; the block is forwarded from the caller.
    unsafe {
        let Some(lane) = lane_of_thread(lane) else {
            return false;
        };
        if lane.free_filtered(ptr, class) {
            if requested {
                lane.sub_requested(size);
            }
            return true;
        }
        false
    }
}

/// [`lane_free`] missed, for the child of tag `tag`: frees into a full bin (giving part of
/// it back) if the lane is open and the cache live. `false`: the child takes its general
/// path.
///
/// The common case, an open lane without sampling (hooks byte 0) on a live cache whose bin
/// is full, is a straight line to the overflow; everything else is out of line in
/// [`lane_free_hooked`].
///
/// # Safety
/// As for [`lane_free`], with `ptr` a block of the child of tag `tag`.
#[inline(always)]
pub(crate) unsafe fn lane_free_missed(
    tag: Tag,
    ptr: *mut u8,
    class: usize,
    size: usize,
    requested: bool,
) -> bool {
    // SAFETY: forwarded from the caller.
    with_cache(|tc| unsafe {
        if let Some(lane) = tc.lane_of(tag)
            && lane_plain(tc, lane)
        {
            tc.free(lane, ptr, class);
            if requested {
                lane.sub_requested(size);
            }
            return true;
        }
        lane_free_hooked(tc, tag, ptr, class, size, requested)
    })
}

/// [`lane_free_missed`] off its straight line: a lane not set up on this thread yet,
/// closed, or sampling; or a cache not live.
///
/// # Safety
/// As for [`lane_free_missed`]; `tc` is this thread's cache.
#[cold]
#[inline(never)]
unsafe fn lane_free_hooked(
    tc: &ThreadCache,
    tag: Tag,
    ptr: *mut u8,
    class: usize,
    size: usize,
    requested: bool,
) -> bool {
    let Some(lane) = lane_usable(tc, tag) else {
        return false;
    };
    let hooks = lane.hooks.load(Relaxed);
    if hooks & HOOK_FREE_SAMPLED != 0 && records::global::maybe_sampled(ptr) {
        return false; // the general path removes its record
    }
    if hooks & HOOK_GUARD != 0 && guarded::AREA.contains(ptr.addr()) {
        return false; // the general path gives a guarded block back to the area
    }
    // SAFETY: the cache is this thread's and live, the lane open; the block is forwarded
    // from the caller.
    unsafe { tc.free(lane, ptr, class) };
    if requested {
        lane.sub_requested(size);
    }
    true
}

// ---- Scoped tags: the global allocator's paths for the tag entered on a thread. ----

/// Process-wide, never cleared: some thread entered a scoped tag, so a block freed through
/// the global allocator may be a tag's (see [`HOOK_TAGS`]).
static TAGS_IN_USE: AtomicBool = AtomicBool::new(false);

/// Whether a scoped tag was ever entered in this process (then blocks freed through the
/// global allocator must be asked for their tag).
#[inline(always)]
pub(crate) fn tags_in_use() -> bool {
    TAGS_IN_USE.load(Relaxed)
}

/// What lane 0's hooks byte holds: the `SystemAllocator`'s records hooks, and
/// [`HOOK_TAGS`] once tags are in use.
fn lane0_hooks() -> u8 {
    records::global::thread_hooks()
        | if tags_in_use() { HOOK_TAGS } else { 0 }
        | if guarded::ever() { HOOK_GUARD } else { 0 }
}

/// Marks tags as in use, before the first scoped allocation: from now on every cache's free
/// fast path leaves lane 0 for the miss path, which asks each block for its tag.
#[cold]
#[inline(never)]
pub(crate) fn enable_tags() {
    if TAGS_IN_USE.load(Acquire) {
        return;
    }
    // Before any route exists: an owner storing a route then needs only a compiler fence
    // where `membarrier` works (see `Lane::route_frees_to`). Probing can take milliseconds,
    // once, here at the first scope rather than under the lock.
    crate::sync::prepare_process_barrier();
    let list = THREADS.lock();
    if TAGS_IN_USE.load(Relaxed) {
        // Another thread enabled them while this one waited for the lock: doing it again
        // would route the frees of threads already in scopes back to lane 0.
        return;
    }
    let mut tc = list.head;
    while !tc.is_null() {
        // SAFETY: registered caches are valid while the registry lock is held. No thread is
        // in a scope yet (each first comes here, or sees the flag set below), so each
        // cache's current lane is lane 0, where `add_hooks` routes its frees.
        unsafe {
            (*tc).system().add_hooks(HOOK_TAGS);
            tc = (*tc).next.load(Relaxed);
        }
    }
    // Last, and released: a thread that sees the flag and enters a scope routes its frees
    // after the route set here, never before it. A cache registering later reads the flag
    // under the same lock (`lane0_hooks`).
    TAGS_IN_USE.store(true, Release);
}

/// Whether a lane's countdown chose the calling thread's next general-path allocation of
/// `tag` to be guarded (then the request is taken).
pub(crate) fn take_guard_request(tag: Tag) -> bool {
    with_cache(|tc| {
        let wanted = tc.guard_request.get() == tag;
        if wanted {
            tc.guard_request.set(0);
        }
        wanted
    })
}

/// Enters `tag` on the calling thread for a scope being opened (0: none). Tags are marked
/// in use already (`crate::scope` does it at an allocator's first scope). Returns the tag
/// replaced and the cache, for [`leave_scope`].
#[inline(always)]
pub(crate) fn enter_scope(tag: Tag) -> (Tag, CacheRef) {
    with_cache(|tc| (tc.enter(tag), ptr::from_ref(tc)))
}

/// Closes a scope: enters `previous` again on the cache [`enter_scope`] returned, without
/// finding the cache a second time.
///
/// # Safety
/// `tc` is what `enter_scope` returned on the calling thread (a thread's cache lives as long
/// as the thread).
#[inline(always)]
pub(crate) unsafe fn leave_scope(tc: CacheRef, previous: Tag) {
    // SAFETY: the calling thread's own cache (caller's contract).
    unsafe { (*tc).leave(previous) };
}

/// Whether the calling thread's small frees are routed to its current lane (see
/// `Lane::plain_from`): `None` before tags are in use, while the cache is not live, and
/// where a route cannot name the thread's lanes (they lie too low: valgrind without
/// `--aspace-minaddr`, the main thread of a static non-PIE binary).
pub(crate) fn frees_routed_to_current() -> Option<bool> {
    with_cache(|tc| {
        let plain_from = tc.system().plain_from();
        (tags_in_use() && tc.state.get() == STATE_ACTIVE && !lane::routes_nowhere(plain_from)).then(
            || lane::routed_lane(plain_from).is_some_and(|(lane, _)| lane == tc.current.get()),
        )
    })
}

/// The tag entered on the calling thread (0: none).
#[inline(always)]
pub(crate) fn current_tag() -> Tag {
    with_cache(|tc| tc.current_tag.get())
}

/// The tag entered on the thread whose cache a fast path found.
///
/// # Safety
/// `tc` is the calling thread's cache as a fast path passed it (not null).
#[inline(always)]
pub(crate) unsafe fn current_tag_of(tc: CacheRef) -> Tag {
    // SAFETY: forwarded from the caller.
    unsafe { (*tc).current_tag.get() }
}

/// A scoped small allocation that missed the fast path (the entered tag's lane was empty,
/// closed, sampling, or not set up on this thread): from the tag's lane if it may serve.
/// `None`: the tag's general path must serve it.
///
/// # Safety
/// `tc` is the calling thread's cache; `class` is the class of `layout`.
pub(crate) unsafe fn scoped_allocate(
    tc: &ThreadCache,
    class: usize,
    layout: Layout,
) -> Option<*mut u8> {
    if tc.state.get() == STATE_NEW {
        tc.register(0);
    }
    let tag = tc.current_tag.get();
    // SAFETY: forwarded from the caller. Scoped blocks count their requested bytes in the
    // lane (a child that does not report them ignores the figure).
    unsafe { allocate_in_lane(tc, tag, class, layout, true) }
}

/// Frees a small block of tag `tag` (not 0) through its lane on this thread, uncounting
/// `size` requested bytes; `false`: the tag's general path must free it (a lane closed or
/// sampling the block, or a cache not live).
///
/// # Safety
/// `tc` is the calling thread's cache; `ptr` is a live small block of `class` in a segment
/// of `tag`, allocated for `size` bytes (or a size up to the granted one).
#[inline(always)]
pub(crate) unsafe fn tag_free(
    tc: &ThreadCache,
    tag: Tag,
    ptr: *mut u8,
    class: usize,
    size: usize,
) -> bool {
    // SAFETY: forwarded from the caller: the block is of the lane's tag.
    unsafe {
        if let Some(lane) = tc.lane_of(tag) {
            if lane.free_filtered(ptr, class) {
                lane.sub_requested(size);
                return true;
            }
            if lane_plain(tc, lane) {
                tc.free(lane, ptr, class);
                lane.sub_requested(size);
                return true;
            }
        }
        lane_free_hooked(tc, tag, ptr, class, size, true)
    }
}

/// Frees an untagged small block into lane 0 of the cache a fast path found, whatever
/// [`HOOK_TAGS`] says (the caller read the block's tag): `false` when the bin is full or
/// records may hold the block (the block is untouched then).
///
/// # Safety
/// `tc` is the calling thread's cache as [`free_gated`] passed it (not null); `ptr` is a
/// live small block of `class` in a segment of tag 0.
#[inline(always)]
pub(crate) unsafe fn free_untagged(tc: CacheRef, ptr: *mut u8, class: usize) -> bool {
    // SAFETY: forwarded from the caller.
    unsafe { (*tc).system().free_filtered(ptr, class) }
}

/// The tag of the segment of a live small block (0: the `SystemAllocator`'s own).
///
/// # Safety
/// `ptr` is a live small block of the global heap.
#[inline(always)]
pub(crate) unsafe fn small_block_tag(ptr: *mut u8) -> Tag {
    // SAFETY: forwarded from the caller.
    unsafe { segment_tag(ptr) }
}

/// A small block of `class` for the general path of the child of `tag` (its lane is closed,
/// for records of every block or a budget): taken from this thread's lane of the tag (its
/// bins hold the tag's blocks) but not counted there, since the general path counts it in
/// the child's shards. `None` when this thread has no usable lane (a cache not live, no
/// memory for a lane); `Some(null)` when out of memory. The `SystemAllocator`'s share is
/// the caller's to count ([`count_unlaned`]).
///
/// The lane's counts do not move: a block counted twice, or published by the lane and
/// counted by the general path, would be a budget's error.
#[inline]
pub(crate) fn allocate_uncounted(tag: Tag, class: usize) -> Option<*mut u8> {
    with_cache(|tc| {
        if tc.state.get() != STATE_ACTIVE {
            return None;
        }
        let lane = tc.lane_set_up(tag)?;
        // SAFETY: the owning thread, a live cache, a lane of it, a valid class.
        Some(unsafe { tc.allocate_as::<false>(lane, class) })
    })
}

/// Frees a small block of `tag` for the child's general path into this thread's lane of the
/// tag without counting it there (see [`allocate_uncounted`]); `false` when this thread has
/// no usable lane.
///
/// # Safety
/// `ptr` is a live small block of `class` in a segment of `tag`, which becomes free.
#[inline]
pub(crate) unsafe fn free_uncounted(tag: Tag, ptr: *mut u8, class: usize) -> bool {
    with_cache(|tc| {
        if tc.state.get() != STATE_ACTIVE {
            return false;
        }
        let Some(lane) = tc.lane_set_up(tag) else {
            return false;
        };
        // SAFETY: forwarded from the caller; a live cache, a lane of it.
        unsafe { tc.free_as::<false>(lane, ptr, class) };
        true
    })
}

/// Counts a small block of `class` taken from (`allocated`) or given back to a tag's heap
/// without a lane, in the `SystemAllocator`'s figures (see `SystemAllocator`'s tagged
/// paths): the counts every lane's blocks go to when their thread exits.
pub(crate) fn count_unlaned(class: usize, allocated: bool) {
    if allocated {
        ORPHANS.shared_alloc(class);
    } else {
        ORPHANS.shared_free(class);
    }
}

impl ThreadCache {
    /// The owner's decision on an allocation of `class` that missed the fast path (see
    /// [`SampleCharge`]).
    ///
    /// Sampling draws, per class, how many blocks until the next sampled one: each byte is
    /// sampled with probability `1/N` (the countdown of [`records::sample`] is memoryless),
    /// so a block of the class's size `g` is sampled with probability `1 − e^(−g/N)`, and
    /// the blocks to the next sample follow the geometric law `⌈E/g⌉` with `E` exponential of
    /// mean `N`. Classes count apart, which changes nothing in law (the byte streams of the
    /// classes are independent Poisson processes of the same rate) and leaves the fast path
    /// one compare of the count it already loads.
    ///
    /// # Safety
    /// Owning thread; `class < CLASS_COUNT`.
    #[inline(always)]
    unsafe fn charge(&self, lane: &Lane, class: usize) -> SampleCharge {
        let hooks = lane.hooks.load(Relaxed);
        if hooks & HOOK_CLOSED != 0 {
            return SampleCharge::General; // a child's lane, closed meanwhile
        }
        // SAFETY: forwarded from the caller.
        let slot = unsafe { lane.slots.get_unchecked(class) };
        let until = slot.open_until.load(Relaxed);
        if hooks & HOOK_GUARD != 0 {
            if slot.allocations.load(Relaxed) < until {
                return SampleCharge::Skip; // an empty bin, nothing due (`CLOSED` is 0)
            }
            return SampleCharge::Due; // settled by `charge_guarded`
        }
        if hooks & (HOOK_ALLOC | HOOK_SAMPLE) == 0 {
            if until != OPEN {
                self.set_open_until(lane, class, OPEN, hooks);
            }
            return SampleCharge::Skip;
        }
        if hooks & (HOOK_ALLOC | HOOK_SAMPLE) != HOOK_SAMPLE {
            return SampleCharge::General;
        }
        let count = slot.allocations.load(Relaxed);
        if count < until {
            return SampleCharge::Skip; // an empty bin, not a sample
        }
        SampleCharge::Due
    }

    /// [`charge`](Self::charge), with a [`SampleCharge::Due`] settled by
    /// [`charge_due`](Self::charge_due): never `Due`.
    ///
    /// # Safety
    /// As for [`charge`](Self::charge).
    unsafe fn charge_settled(&self, lane: &Lane, class: usize) -> SampleCharge {
        // SAFETY: forwarded from the caller.
        match unsafe { self.charge(lane, class) } {
            SampleCharge::Due => self.charge_due(lane, class),
            charge => charge,
        }
    }

    /// Settles a [`SampleCharge::Due`]: draws the class's next countdown and says whether
    /// this allocation is sampled. Out of line, so the miss path that returns `Due` keeps no
    /// stack frame for it.
    #[cold]
    #[inline(never)]
    fn charge_due(&self, lane: &Lane, class: usize) -> SampleCharge {
        let hooks = lane.hooks.load(Relaxed);
        if hooks & HOOK_GUARD != 0 {
            return self.charge_guarded(lane, class, hooks);
        }
        if hooks & (HOOK_ALLOC | HOOK_SAMPLE | HOOK_CLOSED) != HOOK_SAMPLE {
            return SampleCharge::General;
        }
        let slot = &lane.slots[class];
        let (count, until) = (
            slot.allocations.load(Relaxed),
            slot.open_until.load(Relaxed),
        );
        if count < until {
            return SampleCharge::Skip;
        }
        self.charge_sampled(lane, class, hooks, count, until)
    }

    /// [`charge`](Self::charge) when the class's countdown ran out or was never drawn.
    #[cold]
    #[inline(never)]
    fn charge_sampled(
        &self,
        lane: &Lane,
        class: usize,
        hooks: u8,
        count: u64,
        until: u64,
    ) -> SampleCharge {
        let Some((charge, mark)) = self.sample_step(lane, class, count, until) else {
            return SampleCharge::General; // the mode is changing: the hooks follow
        };
        self.set_open_until(lane, class, mark, hooks);
        charge
    }

    /// The records' countdown of `class` at the lane's allocation number `count`, the
    /// countdown's mark being `until` ([`CLOSED`]: none drawn): whether this allocation is
    /// sampled (or skipped), and the allocation number of the next sampled one. `None` while
    /// the records mode is changing.
    fn sample_step(
        &self,
        lane: &Lane,
        class: usize,
        count: u64,
        until: u64,
    ) -> Option<(SampleCharge, u64)> {
        let interval = match lane.tag() {
            0 => records::global::sample_interval(),
            tag => lanes::sample_interval(tag),
        }?;
        let mut rng = self.rng_state();
        let size = class_size(class) as u64;
        let mut blocks = || {
            let bytes = records::global::draw_countdown(&mut rng, interval) as u64; // ≥ 1
            bytes.div_ceil(size)
        };
        // `until == count` (and not CLOSED): the countdown drawn at the last sample ends at
        // this block. Otherwise none is drawn (or plain-path allocations, which sampling
        // sees elsewhere, ran past it): draw afresh, this block being its first.
        let charge = if until != CLOSED && count == until {
            SampleCharge::Sampled(interval)
        } else {
            let first = blocks();
            if first > 1 {
                self.sample_rng.set(rng);
                // This block is the first of `first`: the fast path serves the next
                // `first - 2` and the one after misses here.
                return Some((SampleCharge::Skip, count.saturating_add(first - 1)));
            }
            SampleCharge::Sampled(interval)
        };
        // This block is sampled; the next sampled one is `blocks()` blocks after it.
        let next = blocks();
        self.sample_rng.set(rng);
        Some((charge, count.saturating_add(next)))
    }

    /// The state of the owner's sampling generator, seeded on first use.
    fn rng_state(&self) -> u64 {
        let state = self.sample_rng.get();
        if state != 0 {
            return state;
        }
        records::global::sample_seed(ptr::from_ref(self).addr())
    }

    /// [`charge_due`](Self::charge_due) in a lane with guarded sampling (`HOOK_GUARD`). The
    /// class's mark is the nearer of two countdowns: the records' sample (drawn as in
    /// [`charge_sampled`](Self::charge_sampled)) and the guard's, a uniform count of lane
    /// allocations between two guarded ones (mean `N - 1`, so one allocation in `N` is
    /// guarded); the class's sizing keeps both as distances past the mark. A guarded
    /// allocation is not the lane's (its block comes from the guarded area), so the
    /// lane's count stays: a sample due at the same allocation falls on the next one.
    #[cold]
    #[inline(never)]
    fn charge_guarded(&self, lane: &Lane, class: usize, hooks: u8) -> SampleCharge {
        if hooks & (HOOK_ALLOC | HOOK_CLOSED) != 0 {
            return SampleCharge::General;
        }
        let slot = &lane.slots[class];
        let count = slot.allocations.load(Relaxed);
        let until = slot.open_until.load(Relaxed);
        if until != CLOSED && count < until {
            return SampleCharge::Skip; // an empty bin, nothing due
        }
        // SAFETY: the owning thread (every caller's contract); `class` indexes `slots`.
        let sizing = unsafe { lane.sizing(class) };
        let at = |off: u32| {
            if until == CLOSED || off == FAR {
                CLOSED
            } else {
                until.saturating_add(u64::from(off))
            }
        };
        let mut sample_at = at(sizing.sample_off);
        let mut guard_at = at(sizing.guard_off);
        let mut charge = SampleCharge::Skip;
        let every = match lane.tag() {
            0 => guarded::system_interval(),
            tag => lanes::guard_interval(tag),
        };
        if every == 0 {
            guard_at = OPEN;
        } else {
            if guard_at == CLOSED {
                guard_at = count.saturating_add(self.guard_draw(every));
            }
            if guard_at <= count {
                charge = SampleCharge::Guarded;
                guard_at = count.saturating_add(self.guard_draw(every));
            }
        }
        if hooks & HOOK_SAMPLE == 0 {
            sample_at = OPEN;
        } else if !matches!(charge, SampleCharge::Guarded)
            && (sample_at == CLOSED || sample_at <= count)
        {
            let Some((sampled, mark)) = self.sample_step(lane, class, count, sample_at) else {
                return SampleCharge::General;
            };
            charge = sampled;
            sample_at = mark;
        }
        let mark = sample_at.min(guard_at);
        let off = |at: u64| u32::try_from(at - mark).unwrap_or(FAR);
        sizing.sample_off = off(sample_at);
        sizing.guard_off = off(guard_at);
        self.set_open_until(lane, class, mark, hooks);
        charge
    }

    /// Lane allocations until the next guarded one, at one guarded allocation in `every`:
    /// uniform on 0 ..= 2 (every - 1), so of mean `every - 1`. Guarding needs the rate, not
    /// the memoryless law records' sampling keeps for unbiased estimates, and a thread
    /// draws once for each class it touches: a short-lived thread making a few hundred
    /// allocations paid more for two logarithms per draw than for its guarded blocks.
    fn guard_draw(&self, every: u32) -> u64 {
        if every <= 1 {
            return 0;
        }
        let mut rng = crate::records::sample::Rng::new(self.rng_state());
        let x = rng.next_u64();
        self.sample_rng.set(rng.state());
        let span = 2 * u64::from(every - 1) + 1;
        // The high half of the product: `x` scaled to `0..span`.
        ((u128::from(x) * u128::from(span)) >> 64) as u64
    }

    /// Sets the class's [`open_until`](lane::ClassSlot::open_until) mark as the owner, the records
    /// settings being `hooks`. If another thread changed the settings meanwhile, the mark
    /// ends closed: it stores the hooks, fences, then closes every mark; the owner stores
    /// the mark, fences, then reads the hooks. Sequentially consistent fences order the
    /// two: either the owner sees the new hooks (and closes the mark itself) or its store
    /// comes first in the mark's modification order (and the other thread's close wins).
    fn set_open_until(&self, lane: &Lane, class: usize, until: u64, hooks: u8) {
        let slot = &lane.slots[class];
        slot.open_until.store(until, Relaxed);
        fence(SeqCst);
        if lane.hooks.load(Relaxed) != hooks {
            slot.open_until.store(CLOSED, Relaxed);
        }
    }

    /// Lane 0's marks as the cache registers (under the registry lock, so no settings
    /// change meanwhile), the records settings being `hooks`. When guarded sampling is the
    /// only hook of allocations, each class's first guard countdown is drawn here, one
    /// cheap draw per class, rather than on the class's first allocation through the slow
    /// path (`charge_guarded`): a thread that lives for a few hundred allocations touches
    /// dozens of classes, and that slow path cost it more than its guarded blocks did.
    fn set_first_marks(&self, hooks: u8) {
        let lane = self.system();
        if hooks & (HOOK_ALLOC | HOOK_SAMPLE | HOOK_BUDGET | HOOK_CLOSED | HOOK_GUARD) != HOOK_GUARD
        {
            for slot in &lane.slots {
                slot.open_until
                    .store(Self::initial_open_until(hooks), Relaxed);
            }
            return;
        }
        let every = guarded::system_interval();
        for (class, slot) in lane.slots.iter().enumerate() {
            let count = slot.allocations.load(Relaxed);
            let mark = match every {
                0 => OPEN,
                every => count.saturating_add(self.guard_draw(every)),
            };
            // SAFETY: the owning thread, registering; `class` indexes `slots`.
            let sizing = unsafe { lane.sizing(class) };
            // The mark is the guard's countdown itself; no sample is drawn (as
            // `charge_guarded` leaves them without `HOOK_SAMPLE`).
            sizing.guard_off = 0;
            sizing.sample_off = FAR;
            slot.open_until.store(mark, Relaxed);
        }
    }

    /// The [`open_until`](lane::ClassSlot::open_until) mark every class starts from when the
    /// records settings are `hooks`.
    fn initial_open_until(hooks: u8) -> u64 {
        if hooks & (HOOK_ALLOC | HOOK_SAMPLE | HOOK_BUDGET | HOOK_GUARD) == 0 {
            OPEN
        } else {
            CLOSED
        }
    }
}

/// What the records settings say about a small allocation that missed the fast path.
pub(crate) enum SampleCharge {
    /// Nothing to record: take a block from the cache (the bin was empty, or the fast path
    /// was closed and is open again).
    Skip,
    /// Guarded sampling chose this allocation: its block comes from the guarded area (see
    /// `crate::allocator::guarded`), not from the lane.
    Guarded,
    /// Sampled at this mean interval (the class's countdown ran out): record it.
    Sampled(u64),
    /// The class's countdown ran out or was never drawn: [`charge_due`] says which of the
    /// others it is.
    Due,
    /// Not a sampling matter (records of every allocation, a cache not registered, the
    /// environment not read): take the general path.
    General,
}

/// Tells every registered cache that the `SystemAllocator`'s record settings changed: each
/// one's [`hooks`](Lane::hooks) mirror is rewritten from the word. Called after the
/// word changed; under the registry lock, so no cache registers in between.
pub(crate) fn system_records_changed() {
    let list = THREADS.lock();
    let hooks = lane0_hooks();
    let mut free_tags_changed = false;
    let mut tc = list.head;
    while !tc.is_null() {
        // SAFETY: registered caches are valid while the registry lock is held.
        unsafe {
            free_tags_changed |= (*tc).system().set_hooks(hooks);
            tc = (*tc).next.load(Relaxed);
        }
    }
    if free_tags_changed {
        refresh_routes(&list);
    }
    // Then close every class's fast path, so that each owner looks at its hooks at its next
    // allocation (see `ThreadCache::set_open_until` for why the fence).
    fence(SeqCst);
    let mut tc = list.head;
    while !tc.is_null() {
        // SAFETY: as above.
        unsafe {
            for slot in &(*tc).system().slots {
                slot.open_until.store(CLOSED, Relaxed);
            }
            tc = (*tc).next.load(Relaxed);
        }
    }
    drop(list);
    // Records on the `SystemAllocator` see every block, the children's too: their lanes
    // close while it has any.
    lanes::refresh();
}

/// After lanes' free tags changed (under the registry lock `list`, by a thread that may not
/// own them): every thread's free route takes its lane's new tag (see
/// `Lane::route_frees_to`), before the changer opens records to allocations, so that no free
/// of a recorded block is routed past the records. Nothing to do before tags are in use.
fn refresh_routes(list: &ThreadList) {
    if !TAGS_IN_USE.load(Relaxed) {
        return;
    }
    // Prepared by `enable_tags`: this only reads the state.
    crate::sync::prepare_process_barrier();
    crate::sync::process_barrier();
    let mut tc = list.head;
    while !tc.is_null() {
        // SAFETY: registered caches are valid while the registry lock is held.
        unsafe {
            (*tc).system().refresh_route();
            tc = (*tc).next.load(Relaxed);
        }
    }
}

/// Live small blocks per class and call totals over all threads. Exact when no thread is
/// allocating at the same moment.
pub(crate) fn front_totals() -> FrontTotals {
    let mut totals = FrontTotals {
        live: [0; CLASS_COUNT],
        allocations: 0,
        frees: 0,
    };
    let list = THREADS.lock();
    let mut tc = list.head;
    while !tc.is_null() {
        // SAFETY: registered caches are valid while the registry lock is held.
        unsafe {
            (*tc).add_counts_to(&mut totals);
            tc = (*tc).next.load(Relaxed);
        }
    }
    ORPHANS.add_to(&mut totals);
    totals
}

/// Runs `f` on the calling thread's counter shards, registering its cache first if this is
/// the thread's first call. `None` when the thread has no usable cache (registration failed,
/// or the thread is exiting and its cache is retired): count in the shared atomics instead.
#[inline(always)]
pub(crate) fn with_shards<R>(f: impl FnOnce(&ShardSet) -> R) -> Option<R> {
    CACHE.with(|tc| {
        if tc.state.get() != STATE_ACTIVE && !tc.activate() {
            return None;
        }
        Some(f(&tc.shards))
    })
}

/// Whether the calling thread's cache is registered and live, so that its counter shards
/// take counts. Once true on a thread it stays true until the thread exits: a general-path
/// call checks it before the parent's call and counts with [`with_live_shards`] after.
#[inline(always)]
pub(crate) fn shards_active() -> bool {
    CACHE.with(|tc| tc.state.get() == STATE_ACTIVE)
}

/// Runs `f` on the calling thread's counter shards, which [`shards_active`] said earlier in
/// the same call are live (a cache retires only when its thread exits, so they still are).
#[inline(always)]
pub(crate) fn with_live_shards<R>(f: impl FnOnce(&ShardSet) -> R) -> R {
    CACHE.with(|tc| {
        debug_assert_eq!(
            tc.state.get(),
            STATE_ACTIVE,
            "shards counted after retirement"
        );
        f(&tc.shards)
    })
}

/// Runs `f` on the calling thread's counter shards if its cache is registered and live;
/// `None` otherwise (then [`with_shards`] registers it). The common case: one TLS access
/// and one compare.
#[inline(always)]
pub(crate) fn with_active_shards<R>(f: impl FnOnce(&ShardSet) -> R) -> Option<R> {
    CACHE.with(|tc| {
        if tc.state.get() != STATE_ACTIVE {
            return None;
        }
        Some(f(&tc.shards))
    })
}

impl ThreadCache {
    /// Registers a new cache; returns whether the cache is usable.
    #[cold]
    #[inline(never)]
    fn activate(&self) -> bool {
        if self.state.get() == STATE_NEW {
            self.register(0);
        }
        self.state.get() == STATE_ACTIVE
    }
}

/// Registers the calling thread's cache if it is new (so that the thread pointer's offset
/// to the caches is known once any cache registered).
pub(crate) fn register_current() {
    CACHE.with(|tc| {
        tc.activate();
    });
}

/// The registry of live threads, locked: while it is held no cache registers or retires.
pub(crate) struct LockedThreads(FairGuard<'static, ThreadList>);

impl core::ops::Deref for LockedThreads {
    type Target = ThreadList;

    fn deref(&self) -> &ThreadList {
        &self.0
    }
}

impl ThreadList {
    /// Calls `f` with the counter shards of every registered thread.
    pub(crate) fn for_each_shards(&self, mut f: impl FnMut(&ShardSet)) {
        let mut tc = self.head;
        while !tc.is_null() {
            // SAFETY: registered caches are valid while the registry lock is held (a
            // `&ThreadList` is only reachable under it).
            unsafe {
                f(&(*tc).shards);
                tc = (*tc).next.load(Relaxed);
            }
        }
    }

    /// Calls `f` with each child lane (not lane 0) of every registered thread whose tag
    /// `wanted` accepts.
    pub(crate) fn for_each_lane(
        &self,
        wanted: impl Fn(Tag) -> bool,
        mut f: impl FnMut(Tag, &Lane),
    ) {
        let mut tc = self.head;
        while !tc.is_null() {
            // SAFETY: as in `for_each_shards`.
            unsafe {
                for (tag, lane) in (*tc).used_lanes().skip(1) {
                    if wanted(tag) {
                        f(tag, lane);
                    }
                }
                tc = (*tc).next.load(Relaxed);
            }
        }
    }
}

impl LockedThreads {
    /// Writes the child lanes' gates, as `lanes` last computed them, into every registered
    /// thread's cache.
    pub(crate) fn apply_lane_gates(&self) {
        // The hooks (and free tags) of every lane first, then the routes, then the marks
        // that let allocations in (see `set_lane_gate`).
        let mut free_tags_changed = false;
        let mut tc = self.0.head;
        while !tc.is_null() {
            // SAFETY: registered caches are valid while the registry lock is held.
            unsafe {
                for (tag, lane) in (*tc).used_lanes().skip(1) {
                    free_tags_changed |= lane.set_hooks(lanes::gate(tag));
                }
                tc = (*tc).next.load(Relaxed);
            }
        }
        if free_tags_changed {
            refresh_routes(&self.0);
        }
        fence(SeqCst);
        let mut tc = self.0.head;
        while !tc.is_null() {
            // SAFETY: as above.
            unsafe {
                for (tag, lane) in (*tc).used_lanes().skip(1) {
                    set_lane_marks(lane, lanes::gate(tag));
                }
                tc = (*tc).next.load(Relaxed);
            }
        }
    }
}

/// Locks the registry of live threads (for summing or publishing counter shards).
pub(crate) fn lock_threads() -> LockedThreads {
    LockedThreads(THREADS.lock())
}

/// Number of threads with a registered cache.
pub(crate) fn registered_threads() -> usize {
    THREADS.lock().count
}

/// [`registered_threads`] without the lock: the count as last changed (under it).
pub(crate) fn registered_threads_hint() -> usize {
    REGISTERED.load(Relaxed)
}

/// A copy of the registry's count, for readers that must not take its lock.
static REGISTERED: AtomicUsize = AtomicUsize::new(0);

impl ThreadList {
    /// Registered threads.
    pub(crate) fn len(&self) -> usize {
        self.count
    }
}

/// Gives the blocks exited threads parked for the next ones back to the heap (see
/// `parked`), before a `garbage_collect`.
pub(crate) fn flush_parked() {
    THREADS.lock().flush_parked();
}

/// Gives the calling thread's cached blocks back to the heap (e.g. before a measurement or
/// a `garbage_collect`). The cache stays usable.
pub(crate) fn flush_current_thread() {
    // SAFETY: the cache is this thread's own.
    CACHE.with(|tc| unsafe { tc.flush_all() });
}

/// Applies the environment's settings to the global heap the first time it is called.
#[inline]
pub(crate) fn apply_environment_once() {
    if !ENV_APPLIED.load(Relaxed) && !ENV_APPLIED.swap(true, Relaxed) {
        HEAP.set_purge_delay(config::purge_delay_from_env());
        HphaSchema::<OsAllocator>::set_huge_pages(config::huge_pages_from_env());
    }
}
static ENV_APPLIED: AtomicBool = AtomicBool::new(false);

/// Sets the global heap's purge delay from code; overrides the environment.
pub(crate) fn set_purge_delay(delay: config::PurgeDelay) {
    ENV_APPLIED.store(true, Relaxed);
    HEAP.set_purge_delay(delay);
}

// ---- Process hooks: the thread-exit key and fork handlers, set up once. ----

static HOOKS: OnceFlag = OnceFlag::new();
static EXIT_KEY: AtomicU64 = AtomicU64::new(0);

/// Creates the thread-exit key and registers the fork handlers, once per process. Returns
/// the key, or `None` if the system refused.
fn process_hooks() -> Option<libc::pthread_key_t> {
    let ready = HOOKS.call(|| {
        let mut key: libc::pthread_key_t = 0;
        // SAFETY: `key` is writable; the destructor has the signature pthread wants.
        let ok = unsafe { libc::pthread_key_create(&mut key, Some(on_thread_exit)) } == 0
            && super::fork::install();
        EXIT_KEY.store(key as u64, Relaxed);
        ok
    });
    ready.then(|| EXIT_KEY.load(Relaxed) as libc::pthread_key_t)
}

/// The pthread key destructor: runs on an exiting thread after its Rust TLS destructors.
unsafe extern "C" fn on_thread_exit(cache: *mut libc::c_void) {
    let tc: *const ThreadCache = cache.cast();
    let mut list = THREADS.lock();
    // SAFETY: the value is this thread's own registered cache, still in TLS.
    let lanes = unsafe { (*tc).retire(&mut list) };
    drop(list);
    // SAFETY: just retired by this thread, which is exiting.
    unsafe { (*tc).shut_built_in(lanes) };
}

/// Whether the thread caches are in use (their locks then matter around `fork()`).
pub(crate) fn fork_hooks_ready() -> bool {
    HOOKS.succeeded()
}

/// Takes the thread list's and the global heap's locks before `fork()` (called by the fork
/// handlers in `fork`, after every lock that can be held while these are taken).
///
/// # Safety
/// Must be followed by [`after_fork`] on the same thread (or in the child it forks).
pub(crate) unsafe fn before_fork() {
    // SAFETY: every lock is released by `after_fork`.
    unsafe {
        THREADS.lock_raw();
        HEAP.lock_small_heaps();
        HEAP.large_heap().lock_all();
        guarded::AREA.hold_for_fork();
    }
}

/// Releases what [`before_fork`] took, in the parent or (`child`) the child.
///
/// # Safety
/// Only after `before_fork`, on the thread that called it (or in the child it forked).
pub(crate) unsafe fn after_fork(child: bool) {
    // SAFETY: the locks were taken by `before_fork` (on this thread, or copied into the
    // child, which has no other thread and so no waiter for the thread list).
    unsafe {
        guarded::AREA.release_after_fork();
        HEAP.large_heap().unlock_all();
        HEAP.unlock_small_heaps();
        if child {
            THREADS.reset_in_child();
        } else {
            THREADS.force_unlock();
        }
    }
}

/// In the child after `fork()`, once every lock is free: only this thread exists, so it
/// adopts the caches of the others, whose memory was copied but whose threads are gone.
pub(crate) fn adopt_orphans_after_fork() {
    let me = CACHE.with(|tc| ptr::from_ref(tc).cast_mut());
    let mut list = THREADS.lock();
    let mut tc = list.head;
    while !tc.is_null() {
        // SAFETY: registered caches are valid copies; their threads do not exist here.
        unsafe {
            let next = (*tc).next.load(Relaxed);
            if tc != me {
                let lanes = (*tc).retire(&mut list);
                (*tc).shut_built_in(lanes);
            }
            tc = next;
        }
    }
}
