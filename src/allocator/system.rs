//! [`SystemAllocator`]: the general-purpose allocator and the `GlobalAlloc` impl.
//!
//! All instances share one process-wide HPHA heap on the OS layer. The heap is a `static`
//! built in a `const` context, so it works from the first allocation before `main` to the
//! last one during exit, from any thread, with no lazy initialisation.

use crate::guarded;
use crate::lanes;
use crate::records;
use crate::registry::SYSTEM;
use crate::schema::Allocation;
use crate::schema::HphaStats;
use crate::schema::hpha::Tag;
use crate::schema::hpha::large::{LargeGrant, LargeHeap};
use crate::schema::hpha::size_class::{class_for, class_size, fast_class, fast_class_size};
use crate::thread_cache::{
    self, CacheRef, ClassKey, HEAP, HOOK_ALLOC, HOOK_FREE, SampleCharge, fast_key,
};
use core::alloc::{GlobalAlloc, Layout};
use core::ptr::{self, NonNull};

/// The general-purpose allocator: install it as the global allocator.
///
/// ```
/// #[global_allocator]
/// static GLOBAL: tagalloc::SystemAllocator = tagalloc::SystemAllocator::new();
///
/// let v: Vec<u64> = (0..1000).collect();
/// assert!(GLOBAL.stats().live_blocks >= 1);
/// # drop(v);
/// ```
#[derive(Clone, Copy, Debug, Default)]
pub struct SystemAllocator {
    _private: (),
}

impl SystemAllocator {
    /// A handle to the process-wide heap; usable in a `static`.
    pub const fn new() -> Self {
        Self { _private: () }
    }

    /// The heap's own figures: what the program holds (granted bytes and blocks), calls,
    /// what sits in thread caches, pages, segments and chunks, and bytes held from the OS.
    /// Per-thread counts are summed on read, so the figures are exact whenever no thread is
    /// allocating meanwhile. [`stats`](Self::stats) gives the same in the shape every
    /// allocator shares, with these as its `heap` extra.
    pub fn heap_stats(&self) -> HphaStats {
        let heap = HEAP.stats();
        let large = HEAP.large_heap().stats();
        let front = thread_cache::front_totals();
        let (small_blocks, small_bytes) = front.live_blocks_and_bytes();
        // Guarded blocks (any tag's) are small blocks outside the heap's pages.
        let guard = guarded::stats();
        HphaStats {
            granted_bytes: small_bytes + guard.live_bytes + large.granted_bytes,
            live_blocks: small_blocks + guard.live_blocks + large.live_blocks,
            allocations: front.allocations + guard.allocations as u64 + large.allocations,
            frees: front.frees + guard.frees as u64 + large.frees,
            held_bytes: heap.held_bytes + guard.committed_bytes,
            small_granted_bytes: small_bytes + guard.live_bytes,
            thread_cached_bytes: heap.small_granted_bytes.saturating_sub(small_bytes),
            ..heap
        }
    }

    /// Sets how long free memory stays mapped before it goes back to the OS: `Some(d)`
    /// returns memory idle for at least `d` (checked on the allocator's slow paths),
    /// `Some(Duration::ZERO)` as soon as possible, `None` only on
    /// [`garbage_collect`](Self::garbage_collect). Overrides `TAGALLOC_PURGE_DELAY_MS`;
    /// the default is [`DEFAULT_PURGE_DELAY_MS`](crate::config::DEFAULT_PURGE_DELAY_MS).
    pub fn set_purge_delay(&self, delay: Option<core::time::Duration>) {
        thread_cache::set_purge_delay(delay);
    }

    /// The purge delay in force (after the environment has been read).
    pub fn purge_delay(&self) -> Option<core::time::Duration> {
        thread_cache::apply_environment_once();
        HEAP.purge_delay()
    }

    /// Threads that currently have a cache (threads that allocated and have not exited).
    pub fn cached_threads(&self) -> usize {
        thread_cache::registered_threads()
    }

    /// Gives the calling thread's cached blocks back to the heap. Other threads' caches are
    /// untouched; they give theirs back when full or when the thread exits.
    pub fn flush_thread_cache(&self) {
        thread_cache::flush_current_thread();
    }

    /// Returns free memory to the OS: the calling thread's cached blocks and those exited
    /// threads left for the next ones, then empty pages, segments and chunks, and the pages
    /// inside large free blocks.
    pub fn garbage_collect(&self) {
        thread_cache::flush_current_thread();
        thread_cache::flush_parked();
        HEAP.garbage_collect();
        guarded::AREA.trim();
    }

    /// The bytes usable in a block this allocator returned for `layout` (its class or block
    /// size, at least `layout.size()`).
    ///
    /// # Safety
    /// `ptr` must be a live block allocated by this allocator with `layout`.
    pub unsafe fn usable_size(&self, ptr: NonNull<u8>, layout: Layout) -> usize {
        if let Some(usable) = guarded::usable(ptr.as_ptr()) {
            return usable;
        }
        // SAFETY: forwarded from the caller.
        unsafe { HEAP.usable_size(ptr, layout) }
    }

    /// Guards one allocation in `every` of the `SystemAllocator` (all of them, its
    /// children's too: the shortest rate on a block's way down wins), `None` for none: the
    /// block ends against an inaccessible page, so an overflow faults at once and the
    /// fault handler names the allocator (see [`guarded`](crate::guarded)). Overrides
    /// `TAGALLOC_GUARDED`.
    ///
    /// ```
    /// use core::num::NonZeroU32;
    /// use tagalloc::SystemAllocator;
    ///
    /// SystemAllocator::new().set_guarded(NonZeroU32::new(1000));
    /// assert_eq!(SystemAllocator::new().guarded(), NonZeroU32::new(1000));
    /// SystemAllocator::new().set_guarded(None);
    /// ```
    pub fn set_guarded(&self, every: Option<core::num::NonZeroU32>) {
        let applied = crate::registry::SYSTEM.set_guarded(every);
        debug_assert!(applied);
    }

    /// The `SystemAllocator`'s guarded rate (one allocation in `N`), if any.
    pub fn guarded(&self) -> Option<core::num::NonZeroU32> {
        crate::registry::SYSTEM.guarded()
    }

    /// `GlobalAlloc::alloc` that also says how big the block is (its class's size for a
    /// small block: no second lookup), for [`BlockAllocator`](crate::BlockAllocator).
    #[inline(always)]
    pub(crate) fn allocate_granted(&self, layout: Layout) -> Option<Allocation> {
        if let Some(class) = fast_class(layout) {
            // Unguarded: the caller may use the whole class size it is told.
            let ptr = thread_cache::allocate_gated::<false>(
                ClassKey::of(class),
                layout,
                alloc_small_missed_unguarded,
            );
            let size = fast_class_size(class);
            return NonNull::new(ptr).map(|ptr| Allocation { ptr, size });
        }
        allocate_granted_slow(layout)
    }

    /// [`allocate_granted`](Self::allocate_granted) with the whole granted block zeroed
    /// (what [`BlockAllocator::allocate_block_zeroed`](crate::BlockAllocator) promises).
    /// Large blocks are written only where they may be dirty: pages fresh from the OS are
    /// not touched, so a big zeroed block costs no memory until it is used.
    #[inline]
    pub(crate) fn allocate_granted_zeroed(&self, layout: Layout) -> Option<Allocation> {
        if fast_class(layout).is_some() {
            let block = self.allocate_granted(layout)?;
            // SAFETY: the block is ours and `size` bytes long.
            unsafe { block.ptr.as_ptr().write_bytes(0, block.size) };
            return Some(block);
        }
        allocate_granted_zeroed_slow(layout)
    }

    /// `GlobalAlloc::dealloc` that returns the block's granted size, as
    /// [`allocate_granted`](Self::allocate_granted) reported it.
    ///
    /// # Safety
    /// `ptr` is a live block of this allocator, allocated with `layout`'s alignment and a
    /// size from `layout.size()` up to the granted one.
    #[inline(always)]
    pub(crate) unsafe fn deallocate_granted(&self, ptr: NonNull<u8>, layout: Layout) -> usize {
        // SAFETY: forwarded from the caller (the layout selects the side the block came
        // from, as in `dealloc`).
        unsafe {
            if let Some(class) = fast_class(layout) {
                thread_cache::free_gated(
                    ptr.as_ptr(),
                    ClassKey::of(class),
                    layout,
                    dealloc_small_missed,
                );
                return fast_class_size(class);
            }
            deallocate_granted_slow(ptr, layout)
        }
    }

    /// Sets what the `SystemAllocator` records from now on (see [`records`](crate::records));
    /// overrides `TAGALLOC_RECORDS`.
    ///
    /// ```
    /// use tagalloc::{RecordMode, SystemAllocator};
    ///
    /// SystemAllocator::new().set_records(RecordMode::sample());
    /// assert_eq!(SystemAllocator::new().record_mode(), RecordMode::sample());
    /// SystemAllocator::new().set_records(RecordMode::Off);
    /// ```
    pub fn set_records(&self, mode: records::RecordMode) {
        crate::registry::SYSTEM.set_records(mode);
    }

    /// What the `SystemAllocator` records (after the environment has been read).
    pub fn record_mode(&self) -> records::RecordMode {
        records::env::ensure_read();
        crate::registry::SYSTEM.record_mode()
    }

    /// Checks the heap's internal invariants (slow: takes every lock).
    pub fn validate(&self) -> Result<(), &'static str> {
        HEAP.validate()
    }
}

// SAFETY: small blocks come from the thread caches, large ones from the heap; both return
// unaliased blocks of at least `layout.size()` bytes aligned to `layout.align()`, or null;
// each free goes back the way its block came (the layout decides, as on allocation);
// `realloc` keeps contents and alignment. Nothing here unwinds: misuse aborts with a message.
// With records on (the thread cache's mirror of the records word tells the small paths, one
// relaxed load of the word the others), each call records around the same plain operation.
// Inside a scoped tag, allocations are the tag's child's (its lane, or its own paths), and a
// block of a tag (its segment, or its header, says which) goes back through that child.
unsafe impl GlobalAlloc for SystemAllocator {
    #[inline]
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // Small requests: the thread cache's own mirror of the records settings says whether
        // to step aside, so records off cost one test of a TLS byte and no static.
        if let Some(key) = fast_key(layout) {
            return thread_cache::allocate_gated::<true>(key, layout, alloc_small_scoped);
        }
        alloc_large_scoped(layout)
    }

    #[inline]
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        let tag = thread_cache::current_tag();
        if tag != 0 {
            return scoped_general(layout, tag, true);
        }
        alloc_zeroed_unscoped(layout)
    }

    #[inline]
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: GlobalAlloc's contract: `ptr` is a live block from this allocator with
        // this layout, so it came from the same side the layout selects now.
        unsafe {
            if let Some(key) = fast_key(layout) {
                return thread_cache::free_gated(ptr, key, layout, dealloc_small_missed);
            }
            dealloc_large_scoped(ptr, layout)
        }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: GlobalAlloc's contract, forwarded.
        unsafe {
            if guarded::AREA.contains(ptr.addr()) {
                return realloc_guarded(ptr, layout, new_size);
            }
            if thread_cache::tags_in_use() {
                return realloc_tags_in_use(ptr, layout, new_size);
            }
            realloc_untagged(ptr, layout, new_size)
        }
    }
}

/// `GlobalAlloc::realloc` once a tag was entered somewhere: a block of a tag goes to its
/// child. Out of line, so that the usual case (no tag ever entered) is a few tests and a
/// tail call, with no registers to save (looking up the block's tag inline made every
/// `realloc` save five, about 15 instructions of 27 in the wrapper).
///
/// # Safety
/// `GlobalAlloc::realloc`'s contract, for a block outside the guarded area.
#[inline(never)]
unsafe fn realloc_tags_in_use(ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
    // SAFETY: forwarded from the caller: `ptr` is a live block allocated with `layout`.
    unsafe {
        let tag = HEAP.tag_of(NonNull::new_unchecked(ptr), layout);
        if tag != 0 {
            return scoped_realloc(ptr, layout, new_size, tag);
        }
        realloc_untagged(ptr, layout, new_size)
    }
}

/// `GlobalAlloc::realloc` of a block of no tag, outside the guarded area.
///
/// # Safety
/// `GlobalAlloc::realloc`'s contract, for such a block.
#[inline(always)]
unsafe fn realloc_untagged(ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
    // SAFETY: forwarded from the caller.
    unsafe {
        if records::global::free_hooked() {
            return records::global::realloc(ptr, layout, new_size, realloc_plain);
        }
        realloc_plain(ptr, layout, new_size)
    }
}

// ---- Scoped tags: the global allocator's calls while a tag is entered (see `scope`). ----

/// `GlobalAlloc::alloc_zeroed` without a scoped tag (also the `BlockAllocator`'s, whose
/// blocks are never a scope's).
#[inline]
fn alloc_zeroed_unscoped(layout: Layout) -> *mut u8 {
    if records::global::alloc_hooked() {
        // SAFETY: a valid layout with a non-zero size (GlobalAlloc's and BlockAllocator's
        // contracts).
        return unsafe { records::global::alloc(layout, alloc_zeroed_plain) };
    }
    alloc_zeroed_plain(layout)
}

/// The child that owns `tag`, whose paths serve a scoped call.
fn scoped_owner(tag: Tag) -> &'static crate::child::ChildOps {
    match lanes::owner(tag).and_then(|r| r.child_ops()) {
        Some(ops) => ops,
        None => crate::fatal::fatal!("tagalloc: tag {} has no child allocator", tag),
    }
}

/// A scoped allocation the tag's lane cannot serve (a large block, a lane closed for a
/// budget or records, a cache not live): the child's general path, counted, budgeted and
/// recorded as a call through its handle that its lane refused. Entered there directly, so
/// that a recorded call stack holds as few allocator frames as the handle's.
#[inline(never)]
fn scoped_general(layout: Layout, tag: Tag, zeroed: bool) -> *mut u8 {
    (scoped_owner(tag).allocate)(layout, tag, zeroed).map_or(ptr::null_mut(), |b| b.ptr.as_ptr())
}

/// A free of a block of `tag` through the tag's child.
///
/// # Safety
/// `ptr` is a live block of `tag` allocated with `layout`.
#[inline(never)]
unsafe fn scoped_free(ptr: *mut u8, layout: Layout, tag: Tag) {
    // SAFETY: forwarded from the caller: the child's block (a scoped allocation of it).
    unsafe { (scoped_owner(tag).deallocate)(NonNull::new_unchecked(ptr), layout, 0) };
}

/// A `realloc` of a block of `tag` through the tag's child: the block keeps its tag.
///
/// # Safety
/// `GlobalAlloc::realloc`'s contract, for a block of `tag`.
#[inline(never)]
unsafe fn scoped_realloc(ptr: *mut u8, layout: Layout, new_size: usize, tag: Tag) -> *mut u8 {
    // SAFETY: forwarded from the caller.
    unsafe {
        (scoped_owner(tag).reallocate)(NonNull::new_unchecked(ptr), layout, new_size, 0)
            .map_or(ptr::null_mut(), |(b, _)| b.ptr.as_ptr())
    }
}

/// The global allocator's small miss path: the scoped tag's, if one is entered, else the
/// `SystemAllocator`'s ([`alloc_small_missed`]). No calls but tail calls.
#[inline(never)]
fn alloc_small_scoped(size: usize, align: usize, class: usize) -> *mut u8 {
    let tc = thread_cache::missed_cache();
    let tag = if tc.is_null() {
        thread_cache::current_tag()
    } else {
        // SAFETY: the fast path passes this thread's cache.
        unsafe { thread_cache::current_tag_of(tc) }
    };
    if tag != 0 {
        return alloc_small_in_scope(size, align, class, tag);
    }
    alloc_small_missed(size, align, class, tc)
}

/// A scoped small allocation the fast path missed: the tag's lane (refilled, set up, or
/// sampling), else the tag's child.
#[inline(never)]
fn alloc_small_in_scope(size: usize, align: usize, class: usize, tag: Tag) -> *mut u8 {
    // SAFETY: the fast path had a valid layout with this size and alignment.
    let layout = unsafe { Layout::from_size_align_unchecked(size, align) };
    // SAFETY: `class` is the layout's.
    let lane =
        thread_cache::with_cache(|tc| unsafe { thread_cache::scoped_allocate(tc, class, layout) });
    match lane {
        Some(p) => p,
        None => scoped_general(layout, tag, false),
    }
}

/// The global allocator's large allocation: the scoped tag's child's, if one is entered.
#[inline(never)]
fn alloc_large_scoped(layout: Layout) -> *mut u8 {
    let tag = thread_cache::current_tag();
    if tag != 0 {
        return scoped_general(layout, tag, false);
    }
    alloc_slow(layout)
}

/// The global allocator's free of a large block: through its tag's child if it has one.
///
/// # Safety
/// `ptr` is a live large block of this allocator with `layout`.
#[inline(never)]
unsafe fn dealloc_large_scoped(ptr: *mut u8, layout: Layout) {
    // SAFETY: forwarded from the caller: a live large block has a header.
    unsafe {
        if thread_cache::tags_in_use() {
            let tag = LargeHeap::tag_of(ptr);
            if tag != 0 {
                return scoped_free(ptr, layout, tag);
            }
        }
        dealloc_slow(ptr, layout)
    }
}

/// A free of a small block that may be a tag's (tags are in use): its lane on this thread,
/// else its child's paths; `false` for a block of tag 0.
///
/// # Safety
/// `ptr` is a live small block of `class` allocated with a size of `size` (or up to the
/// granted one) and alignment `align`; `tc` is this thread's cache.
#[inline(always)]
unsafe fn free_if_tagged(
    ptr: *mut u8,
    size: usize,
    align: usize,
    class: usize,
    tc: &thread_cache::ThreadCache,
) -> bool {
    // SAFETY: forwarded from the caller.
    unsafe {
        let tag = thread_cache::small_block_tag(ptr);
        if tag == 0 {
            return false;
        }
        if !thread_cache::tag_free(tc, tag, ptr, class, size) {
            scoped_free(ptr, Layout::from_size_align_unchecked(size, align), tag);
        }
        true
    }
}

/// A small allocation the thread cache's fast path did not serve: its bin was empty, or
/// its class's allocation count reached the mark where records want a look (a sampled
/// allocation, records of every allocation, a settings change). The fast path hands over
/// the size class and its cache (null: not reachable through the thread pointer). No calls
/// but tail calls, so no stack frame.
#[inline(never)]
fn alloc_small_missed(size: usize, align: usize, class: usize, tc: CacheRef) -> *mut u8 {
    alloc_small_missed_as::<true>(size, align, class, tc)
}

/// [`alloc_small_missed`] for a caller told the block's class size (the `SystemAllocator`
/// as a [`BlockAllocator`](crate::BlockAllocator)): never a guarded block, whose usable
/// size is less.
#[inline(never)]
fn alloc_small_missed_unguarded(size: usize, align: usize, class: usize) -> *mut u8 {
    alloc_small_missed_as::<false>(size, align, class, thread_cache::missed_cache())
}

/// [`alloc_small_missed`], a guarded sample taken (`GUARD`) or passed over.
#[inline(always)]
fn alloc_small_missed_as<const GUARD: bool>(
    size: usize,
    align: usize,
    class: usize,
    tc: CacheRef,
) -> *mut u8 {
    if tc.is_null() {
        return alloc_small_tls::<GUARD>(size, align, class);
    }
    // SAFETY: the fast path passes this thread's cache and the request's class.
    unsafe {
        if thread_cache::hooks_of(tc) & HOOK_ALLOC != 0 {
            // Records of every allocation: take the block from the cache all the same and
            // record it here, without the general path's layers.
            let p = thread_cache::pop_any(tc, class);
            if let Some(ptr) = NonNull::new(p) {
                let layout = Layout::from_size_align_unchecked(size, align);
                return records::global::recorded(ptr, layout, class_size(class));
            }
            return alloc_slow(Layout::from_size_align_unchecked(size, align));
        }
        match thread_cache::charge(tc, class) {
            SampleCharge::Skip => thread_cache::allocate_in(tc, class),
            SampleCharge::Sampled(interval) => alloc_small_sampled(size, align, interval),
            SampleCharge::Due if GUARD => alloc_small_due(size, align, class, tc),
            SampleCharge::Due => alloc_small_due_unguarded(size, align, class, tc),
            SampleCharge::Guarded if GUARD => alloc_small_guarded(size, align, class, tc),
            SampleCharge::Guarded => thread_cache::allocate_in(tc, class),
            SampleCharge::General => alloc_slow(Layout::from_size_align_unchecked(size, align)),
        }
    }
}

/// [`alloc_small_missed`] when the class's sample countdown ran out (or was never drawn).
#[inline(never)]
fn alloc_small_due(size: usize, align: usize, class: usize, tc: CacheRef) -> *mut u8 {
    alloc_small_due_as::<true>(size, align, class, tc)
}

/// [`alloc_small_due`] for [`alloc_small_missed_unguarded`].
#[inline(never)]
fn alloc_small_due_unguarded(size: usize, align: usize, class: usize, tc: CacheRef) -> *mut u8 {
    alloc_small_due_as::<false>(size, align, class, tc)
}

#[inline(always)]
fn alloc_small_due_as<const GUARD: bool>(
    size: usize,
    align: usize,
    class: usize,
    tc: CacheRef,
) -> *mut u8 {
    // SAFETY: `alloc_small_missed` passes this thread's cache and the request's class.
    unsafe {
        match thread_cache::charge_due(tc, class) {
            SampleCharge::Sampled(interval) => alloc_small_sampled(size, align, interval),
            SampleCharge::Guarded if GUARD => alloc_small_guarded(size, align, class, tc),
            SampleCharge::Skip | SampleCharge::Due | SampleCharge::Guarded => {
                thread_cache::allocate_in(tc, class)
            }
            SampleCharge::General => alloc_slow(Layout::from_size_align_unchecked(size, align)),
        }
    }
}

/// A small allocation of the `SystemAllocator`'s own lane that guarded sampling chose: a
/// guarded block, or the lane's block when the guarded area has none to give.
#[cold]
#[inline(never)]
fn alloc_small_guarded(size: usize, align: usize, class: usize, tc: CacheRef) -> *mut u8 {
    // SAFETY: the fast path had a valid layout with this size and alignment.
    let layout = unsafe { Layout::from_size_align_unchecked(size, align) };
    if let Some(p) = guarded::allocate(layout, 0) {
        return p.as_ptr();
    }
    if tc.is_null() {
        return thread_cache::allocate(class);
    }
    // SAFETY: the fast path passes this thread's cache and the request's class.
    unsafe { thread_cache::allocate_in(tc, class) }
}

/// `GlobalAlloc::realloc` of a guarded block: moved to a block of the same allocator (its
/// child's through the child, the `SystemAllocator`'s as an untagged allocation), the
/// guarded one freed (and checked).
///
/// # Safety
/// `GlobalAlloc::realloc`'s contract, `ptr` in the guarded area.
#[cold]
#[inline(never)]
unsafe fn realloc_guarded(ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
    let Some(tag) = guarded::live_tag(ptr) else {
        guarded::not_live(ptr, layout)
    };
    if tag != 0 {
        // SAFETY: forwarded from the caller: a live block of `tag`.
        return unsafe { scoped_realloc(ptr, layout, new_size, tag) };
    }
    // SAFETY: GlobalAlloc's contract makes `new_size` at this alignment a valid layout.
    let new_layout = unsafe { Layout::from_size_align_unchecked(new_size, layout.align()) };
    let new = alloc_slow(new_layout);
    if !new.is_null() {
        // SAFETY: both blocks are live and distinct, each at least as long as copied; the
        // old one is freed once.
        unsafe {
            ptr::copy_nonoverlapping(ptr, new, layout.size().min(new_size));
            dealloc_guarded_untagged(ptr, layout);
        }
    }
    new
}

/// A free through the global allocator of a block in the guarded area: through its
/// child if it is a tag's, else checked and freed here.
///
/// # Safety
/// `GlobalAlloc::dealloc`'s contract (misuse is diagnosed); `ptr` in the guarded area.
#[cold]
#[inline(never)]
unsafe fn dealloc_guarded(ptr: *mut u8, size: usize, align: usize) {
    // SAFETY: the caller's layout was valid.
    let layout = unsafe { Layout::from_size_align_unchecked(size, align) };
    // SAFETY: forwarded from the caller.
    unsafe {
        match guarded::live_tag(ptr) {
            Some(0) | None => dealloc_guarded_untagged(ptr, layout),
            Some(tag) => scoped_free(ptr, layout, tag),
        }
    }
}

/// Frees a guarded block of the `SystemAllocator` itself (its records first).
///
/// # Safety
/// As for [`dealloc_guarded`].
unsafe fn dealloc_guarded_untagged(ptr: *mut u8, layout: Layout) {
    if records::global::free_hooked() {
        if let Some(p) = NonNull::new(ptr) {
            records::before_free(&SYSTEM, p);
        }
    }
    // SAFETY: forwarded from the caller.
    unsafe { guarded::free(ptr, layout) };
}

/// The fast path where the thread pointer cannot reach the cache: the same, through
/// `thread_local!`.
#[inline(never)]
fn alloc_small_tls<const GUARD: bool>(size: usize, align: usize, class: usize) -> *mut u8 {
    match thread_cache::charge_tls(class) {
        SampleCharge::Skip => thread_cache::allocate(class),
        SampleCharge::Guarded if GUARD => alloc_small_guarded(size, align, class, ptr::null()),
        SampleCharge::Guarded => thread_cache::allocate(class),
        SampleCharge::Sampled(interval) => alloc_small_sampled(size, align, interval),
        SampleCharge::General | SampleCharge::Due => {
            // SAFETY: the fast path had a valid layout with this size and alignment.
            let layout = unsafe { Layout::from_size_align_unchecked(size, align) };
            alloc_slow(layout)
        }
    }
}

/// A small allocation the thread cache's countdown chose: allocated and recorded as a
/// sample drawn at mean `interval`.
#[inline(never)]
fn alloc_small_sampled(size: usize, align: usize, interval: u64) -> *mut u8 {
    // SAFETY: the fast path had a valid layout with this size and alignment.
    let layout = unsafe { Layout::from_size_align_unchecked(size, align) };
    records::global::alloc_sampled(layout, interval, alloc_plain)
}

/// The granted size of a live heap block of `layout`: one table load for the common small
/// requests and a header load for large ones, so a call through
/// [`BlockAllocator`](crate::BlockAllocator) (and a child's free, which counts before it
/// frees) needs no out-of-line `usable_size`.
///
/// # Safety
/// `ptr` must be a live block of the `SystemAllocator` allocated with `layout` (or a size
/// between the one requested and the one granted, at the same alignment).
#[inline(always)]
pub(crate) unsafe fn heap_granted(ptr: NonNull<u8>, layout: Layout) -> usize {
    if let Some(class) = fast_class(layout) {
        if guarded::AREA.contains(ptr.as_ptr().addr()) {
            return guarded_usable(ptr, layout);
        }
        fast_class_size(class)
    } else {
        // A non-zero size that `fast_class` leaves out is past the small classes, so the
        // block is the large heap's (`fast_class` agrees with the heap's `class_for`).
        // SAFETY: forwarded from the caller.
        unsafe { LargeHeap::usable_size(ptr.as_ptr()) }
    }
}

/// The usable size of a guarded block, for [`heap_granted`].
#[cold]
#[inline(never)]
fn guarded_usable(ptr: NonNull<u8>, layout: Layout) -> usize {
    match guarded::usable(ptr.as_ptr()) {
        Some(usable) => usable,
        None => guarded::not_live(ptr.as_ptr(), layout),
    }
}

/// [`SystemAllocator::allocate_granted`] off the fast path; out of line, so the fast path
/// needs no stack frame.
#[inline(never)]
fn allocate_granted_slow(layout: Layout) -> Option<Allocation> {
    let ptr = NonNull::new(alloc_slow(layout))?;
    // SAFETY: `ptr` was just allocated with `layout`.
    let size = unsafe { HEAP.usable_size(ptr, layout) };
    Some(Allocation { ptr, size })
}

/// [`SystemAllocator::allocate_granted_zeroed`] off the fast path, a request past the small
/// classes: `alloc_zeroed`, which clears a large block wherever it may be dirty, its slack
/// included.
#[inline(never)]
fn allocate_granted_zeroed_slow(layout: Layout) -> Option<Allocation> {
    // A non-zero size that `fast_class` leaves out has no small class either.
    debug_assert!(class_for(layout.size(), layout.align()).is_none());
    let ptr = NonNull::new(alloc_zeroed_unscoped(layout))?;
    // SAFETY: `ptr` was just allocated with `layout`.
    let size = unsafe { HEAP.usable_size(ptr, layout) };
    Some(Allocation { ptr, size })
}

/// [`SystemAllocator::deallocate_granted`] off the fast path, as
/// [`allocate_granted_slow`].
///
/// # Safety
/// As for [`SystemAllocator::deallocate_granted`].
#[inline(never)]
unsafe fn deallocate_granted_slow(ptr: NonNull<u8>, layout: Layout) -> usize {
    // SAFETY: forwarded from the caller.
    unsafe {
        let granted = HEAP.usable_size(ptr, layout);
        dealloc_slow(ptr.as_ptr(), layout);
        granted
    }
}

/// Allocation off the fast path: not a small request, or records on.
#[inline(never)]
fn alloc_slow(layout: Layout) -> *mut u8 {
    if records::global::alloc_hooked() {
        return alloc_with_records(layout);
    }
    alloc_any(layout)
}

/// Allocation with records on. A small request that sampling skips still takes the thread
/// cache from here.
#[inline(never)]
fn alloc_with_records(layout: Layout) -> *mut u8 {
    if let Some(class) = fast_class(layout) {
        if records::global::alloc_fast(layout.size()) {
            return thread_cache::allocate(class);
        }
    }
    // SAFETY: `alloc_plain` is this allocation without records.
    unsafe { records::global::alloc(layout, alloc_plain) }
}

/// A small free the thread cache's fast path did not take: its bin was full, or records
/// may hold the block. With records that only sample, the sample filter is asked here and
/// the block still goes to the cache. No calls but tail calls, so no stack frame.
///
/// # Safety
/// As for [`dealloc_plain`], with the layout given as size and alignment; `class` and
/// `tc` as the fast path found them.
#[inline(never)]
unsafe fn dealloc_small_missed(
    ptr: *mut u8,
    size: usize,
    align: usize,
    class: usize,
    tc: CacheRef,
) {
    // SAFETY: the fast path passes this thread's cache (or null) and the block's class;
    // the rest is forwarded from the caller.
    unsafe {
        if tc.is_null() {
            return dealloc_small_tls(ptr, size, align, class);
        }
        if guarded::AREA.contains(ptr.addr()) {
            return dealloc_guarded(ptr, size, align);
        }
        // The process-wide flag, not lane 0's `HOOK_TAGS`: a cache that is not registered yet,
        // or already retired (a thread's last frees in its TLS destructors), has hooks that
        // send every free here without that bit, and a tag's block must still go back to
        // its tag.
        if thread_cache::tags_in_use() && free_if_tagged(ptr, size, align, class, &*tc) {
            return;
        }
        let hooks = thread_cache::hooks_of(tc);
        // Records of any block first: `free_filtered` would refuse the block for them too.
        if hooks & HOOK_FREE != 0 {
            // Records of any block may exist: remove this one's (before the block can be
            // reused), then free it to the cache all the same. A record in this thread's
            // buffer leaves without a call; the rest goes out of line, as a tail call.
            let forgotten = records::global::forget_own(ptr);
            if forgotten && thread_cache::push_any(tc, ptr, class) {
                return;
            }
            return dealloc_small_recorded(ptr, class, tc, forgotten);
        }
        if thread_cache::free_untagged(tc, ptr, class) {
            return;
        }
        dealloc_slow(ptr, Layout::from_size_align_unchecked(size, align))
    }
}

/// [`dealloc_small_missed`] with records, when the record was not in this thread's buffer
/// (`forgotten` false) or the bin is full.
///
/// # Safety
/// As for [`dealloc_small_missed`], with `tc` not null.
#[inline(never)]
unsafe fn dealloc_small_recorded(ptr: *mut u8, class: usize, tc: CacheRef, forgotten: bool) {
    if let Some(p) = NonNull::new(ptr).filter(|_| !forgotten) {
        records::before_free(&SYSTEM, p);
    }
    // SAFETY: forwarded from the caller.
    unsafe {
        if !thread_cache::push_any(tc, ptr, class) {
            thread_cache::free(ptr, class);
        }
    }
}

/// The fast path where the thread pointer cannot reach the cache: the same, through
/// `thread_local!`.
///
/// # Safety
/// As for [`dealloc_small_missed`].
#[inline(never)]
unsafe fn dealloc_small_tls(ptr: *mut u8, size: usize, align: usize, class: usize) {
    // SAFETY: as in `dealloc_small_missed`.
    unsafe {
        if guarded::AREA.contains(ptr.addr()) {
            return dealloc_guarded(ptr, size, align);
        }
        if thread_cache::tags_in_use()
            && thread_cache::with_cache(|tc| free_if_tagged(ptr, size, align, class, tc))
        {
            return;
        }
        if thread_cache::free_filtered_tls(ptr, class) {
            return;
        }
        dealloc_slow(ptr, Layout::from_size_align_unchecked(size, align))
    }
}

/// Free off the fast path: not a small block, or records on.
///
/// # Safety
/// As for [`dealloc_plain`].
#[inline(never)]
unsafe fn dealloc_slow(ptr: *mut u8, layout: Layout) {
    // SAFETY: forwarded from the caller.
    unsafe {
        if records::global::free_hooked() {
            return dealloc_with_records(ptr, layout);
        }
        dealloc_any(ptr, layout)
    }
}

/// Free with records on. A small block that is certainly not sampled still goes to the
/// thread cache from here.
///
/// # Safety
/// As for [`dealloc_plain`].
#[inline(never)]
unsafe fn dealloc_with_records(ptr: *mut u8, layout: Layout) {
    // SAFETY: forwarded from the caller.
    unsafe {
        if let Some(class) = fast_class(layout) {
            if records::global::free_fast(ptr) {
                return thread_cache::free(ptr, class);
            }
        }
        records::global::dealloc(ptr, layout, dealloc_plain)
    }
}

/// `GlobalAlloc::alloc` without records.
#[inline(always)]
fn alloc_plain(layout: Layout) -> *mut u8 {
    if let Some(class) = fast_class(layout) {
        return thread_cache::allocate(class);
    }
    alloc_any(layout)
}

/// `GlobalAlloc::alloc_zeroed` without records.
#[inline(always)]
fn alloc_zeroed_plain(layout: Layout) -> *mut u8 {
    match class_for(layout.size(), layout.align()) {
        Some(class) => {
            let p = thread_cache::allocate(class);
            if !p.is_null() {
                // SAFETY: the block has at least `layout.size()` bytes.
                unsafe { p.write_bytes(0, layout.size()) };
            }
            p
        }
        None => {
            thread_cache::apply_environment_once();
            // The whole block is cleared, not just the requested bytes, for
            // `allocate_granted_zeroed`; the difference is a few bytes of slack.
            match allocate_large(layout) {
                // SAFETY: past `dirty_prefix` (at most the block's size) it reads as zero.
                Some(g) => unsafe {
                    g.ptr.write_bytes(0, g.dirty_prefix);
                    g.ptr
                },
                None => ptr::null_mut(),
            }
        }
    }
}

/// `GlobalAlloc::dealloc` without records.
///
/// # Safety
/// GlobalAlloc's contract: `ptr` is a live block from this allocator with this layout, so
/// it came from the same side the layout selects now.
#[inline(always)]
unsafe fn dealloc_plain(ptr: *mut u8, layout: Layout) {
    // SAFETY: forwarded from the caller.
    unsafe {
        if let Some(class) = fast_class(layout) {
            return thread_cache::free(ptr, class);
        }
        dealloc_any(ptr, layout)
    }
}

/// `GlobalAlloc::realloc` without records.
///
/// # Safety
/// GlobalAlloc's contract for `realloc`.
unsafe fn realloc_plain(ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
    let align = layout.align();
    match (class_for(layout.size(), align), class_for(new_size, align)) {
        (Some(a), Some(b)) if a == b => return ptr,
        (Some(a), Some(b)) => {
            // Small to small (a string or vector outgrowing its class): both classes known.
            // SAFETY: `ptr` is a live block of class `a` (GlobalAlloc's contract).
            return unsafe {
                moved(
                    ptr,
                    thread_cache::allocate(b),
                    layout.size().min(new_size),
                    || thread_cache::free(ptr, a),
                )
            };
        }
        (None, None) => {
            // SAFETY: `ptr` is a live large block allocated with `align`.
            let resized = unsafe {
                HEAP.large_heap()
                    .resize(ptr, new_size, align, HEAP.source(), HEAP.stamp())
            };
            HEAP.after_slow_path();
            if let Some((p, _)) = resized {
                return p;
            }
        }
        _ => {}
    }
    // SAFETY: GlobalAlloc's contract makes `new_size` at `align` a valid layout.
    let new_layout = unsafe { Layout::from_size_align_unchecked(new_size, align) };
    // SAFETY: `ptr` is a live block allocated with `layout` (GlobalAlloc's contract).
    unsafe {
        moved(
            ptr,
            alloc_plain(new_layout),
            layout.size().min(new_size),
            || dealloc_plain(ptr, layout),
        )
    }
}

/// The move of a `realloc`: unless the new block is null, copies `copied` bytes into it and
/// frees the old one with `free`. Returns the new block.
///
/// # Safety
/// `ptr` and `new` (if not null) are live, distinct blocks of at least `copied` bytes, and
/// `free` frees `ptr`.
#[inline(always)]
unsafe fn moved(ptr: *mut u8, new: *mut u8, copied: usize, free: impl FnOnce()) -> *mut u8 {
    if !new.is_null() {
        // SAFETY: the caller's contract.
        unsafe { ptr::copy_nonoverlapping(ptr, new, copied) };
        free();
    }
    new
}

/// Allocation for any layout; kept out of line so the fast path needs no stack frame.
#[inline(never)]
fn alloc_any(layout: Layout) -> *mut u8 {
    thread_cache::apply_environment_once();
    match class_for(layout.size(), layout.align()) {
        Some(class) => thread_cache::allocate(class),
        None => allocate_large(layout).map_or(ptr::null_mut(), |g| g.ptr),
    }
}

/// A block from the large heap (then a purge pass if one is due).
fn allocate_large(layout: Layout) -> Option<LargeGrant> {
    let grant = HEAP.large_heap().allocate(
        layout.size(),
        layout.align(),
        0,
        HEAP.source(),
        HEAP.stamp(),
    );
    HEAP.after_slow_path();
    grant
}

/// Free for any layout; see [`alloc_any`].
///
/// # Safety
/// `ptr` is a live block of this allocator with `layout`.
#[inline(never)]
unsafe fn dealloc_any(ptr: *mut u8, layout: Layout) {
    // SAFETY: forwarded from the caller.
    unsafe {
        match class_for(layout.size(), layout.align()) {
            Some(class) => thread_cache::free(ptr, class),
            None => {
                HEAP.large_heap()
                    .free(ptr, HEAP.source(), HEAP.stamp(), HEAP.retain_empty());
                HEAP.after_slow_path();
            }
        }
    }
}

// ---- The bottom of a tagged child's general path: blocks of a tag, without a lane. ----

/// A block of `tag` (not 0) for `layout`, zeroed or not, counted in the `SystemAllocator`'s
/// figures and recorded if it records: the bottom of a child's general path (a child whose
/// lane is closed, or a large block). Small blocks come from the tag's lane on this thread,
/// uncounted there (or from the tag's heap when the thread has no lane), large ones carry
/// the tag in their header, so a free through the global allocator finds the child.
pub(crate) fn allocate_for_tag(layout: Layout, tag: Tag, zeroed: bool) -> Option<Allocation> {
    let block = allocate_for_tag_unrecorded(layout, tag, zeroed)?;
    records::after_alloc(&SYSTEM, block.ptr, layout, block.size);
    Some(block)
}

/// [`allocate_for_tag`] without records.
fn allocate_for_tag_unrecorded(layout: Layout, tag: Tag, zeroed: bool) -> Option<Allocation> {
    thread_cache::apply_environment_once();
    match class_for(layout.size(), layout.align()) {
        Some(class) => {
            if guarded::wanted(tag, layout) {
                if let Some(ptr) = guarded::allocate(layout, tag) {
                    // Counted in the guarded area's figures (see `SystemAllocator::stats`).
                    let size = guarded::usable(ptr.as_ptr()).unwrap_or(layout.size());
                    if zeroed {
                        // SAFETY: the block is ours and `size` bytes long.
                        unsafe { ptr.as_ptr().write_bytes(0, size) };
                    }
                    return Some(Allocation { ptr, size });
                }
            }
            let p = match thread_cache::allocate_uncounted(tag, class) {
                Some(p) => p,
                None => {
                    let p = HEAP.small_heap_of(tag)?.allocate(class, HEAP.source());
                    HEAP.after_slow_path();
                    p
                }
            };
            let ptr = NonNull::new(p)?;
            thread_cache::count_unlaned(class, true);
            let size = class_size(class);
            if zeroed {
                // SAFETY: the block is ours and `size` bytes long.
                unsafe { ptr.as_ptr().write_bytes(0, size) };
            }
            Some(Allocation { ptr, size })
        }
        None => {
            let grant = HEAP.large_heap().allocate(
                layout.size(),
                layout.align(),
                tag,
                HEAP.source(),
                HEAP.stamp(),
            );
            HEAP.after_slow_path();
            let grant = grant?;
            if zeroed {
                // SAFETY: past `dirty_prefix` (at most the block's size) it reads as zero.
                unsafe { grant.ptr.write_bytes(0, grant.dirty_prefix) };
            }
            Some(Allocation {
                // SAFETY: a grant's pointer is never null.
                ptr: unsafe { NonNull::new_unchecked(grant.ptr) },
                size: grant.size,
            })
        }
    }
}

/// Frees a block that [`allocate_for_tag`] (or the lane of `tag`) handed out; returns its
/// granted size.
///
/// # Safety
/// `ptr` is a live block of `tag` allocated with `layout` (or a size up to the granted one,
/// at the same alignment).
pub(crate) unsafe fn deallocate_for_tag(ptr: NonNull<u8>, layout: Layout, tag: Tag) -> usize {
    records::before_free(&SYSTEM, ptr);
    // SAFETY: forwarded from the caller.
    unsafe { deallocate_for_tag_unrecorded(ptr, layout, tag) }
}

/// [`deallocate_for_tag`] without records.
///
/// # Safety
/// As for [`deallocate_for_tag`].
unsafe fn deallocate_for_tag_unrecorded(ptr: NonNull<u8>, layout: Layout, tag: Tag) -> usize {
    // SAFETY: forwarded from the caller: a live block of `tag`, whose heap exists.
    unsafe {
        match class_for(layout.size(), layout.align()) {
            // The size it was counted at when allocated (`guarded::usable`: the requested
            // size, not the one padded to the alignment), so the child's figures balance.
            Some(_) if guarded::AREA.contains(ptr.as_ptr().addr()) => {
                guarded::free(ptr.as_ptr(), layout).size
            }
            Some(class) => {
                if !thread_cache::free_uncounted(tag, ptr.as_ptr(), class) {
                    let Some(small) = HEAP.small_heap_of(tag) else {
                        crate::fatal::fatal!("free of {:p}: tag {} has no heap", ptr.as_ptr(), tag)
                    };
                    small.free(ptr.as_ptr(), class, HEAP.stamp());
                    HEAP.after_slow_path();
                }
                thread_cache::count_unlaned(class, false);
                class_size(class)
            }
            None => {
                let granted = LargeHeap::usable_size(ptr.as_ptr());
                HEAP.large_heap().free(
                    ptr.as_ptr(),
                    HEAP.source(),
                    HEAP.stamp(),
                    HEAP.retain_empty(),
                );
                HEAP.after_slow_path();
                granted
            }
        }
    }
}

/// Resizes a block of `tag` (see [`allocate_for_tag`]): in place when its class stays or
/// its large block can, else moved to a new block of the same tag. Returns the block and
/// the old one's granted size; `None` leaves the old block untouched.
///
/// # Safety
/// As for [`deallocate_for_tag`]; `new_size` at the block's alignment is a valid layout.
pub(crate) unsafe fn reallocate_for_tag(
    ptr: NonNull<u8>,
    layout: Layout,
    new_size: usize,
    tag: Tag,
) -> Option<(Allocation, usize)> {
    let taken = records::before_realloc(&SYSTEM, ptr);
    // SAFETY: forwarded from the caller.
    let result = unsafe { reallocate_for_tag_unrecorded(ptr, layout, new_size, tag) };
    records::after_realloc(taken, result.map(|(b, _)| (b.ptr, b.size)), new_size);
    result
}

/// [`reallocate_for_tag`] without records.
///
/// # Safety
/// As for [`reallocate_for_tag`].
unsafe fn reallocate_for_tag_unrecorded(
    ptr: NonNull<u8>,
    layout: Layout,
    new_size: usize,
    tag: Tag,
) -> Option<(Allocation, usize)> {
    let align = layout.align();
    // SAFETY: forwarded from the caller.
    let old = unsafe { heap_granted(ptr, layout) };
    let guarded = guarded::AREA.contains(ptr.as_ptr().addr());
    match (class_for(layout.size(), align), class_for(new_size, align)) {
        _ if guarded => {} // moved (a guarded block has no room to grow or shrink in)
        (Some(a), Some(b)) if a == b => {
            return Some((
                Allocation {
                    ptr,
                    size: class_size(a),
                },
                old,
            ));
        }
        (None, None) => {
            // SAFETY: a live large block with this alignment; a resize keeps its tag.
            let resized = unsafe {
                HEAP.large_heap()
                    .resize(ptr.as_ptr(), new_size, align, HEAP.source(), HEAP.stamp())
            };
            HEAP.after_slow_path();
            if let Some((p, size)) = resized {
                // SAFETY: a resize never returns null.
                let ptr = unsafe { NonNull::new_unchecked(p) };
                return Some((Allocation { ptr, size }, old));
            }
        }
        _ => {}
    }
    let new_layout = Layout::from_size_align(new_size, align).ok()?;
    let new = allocate_for_tag_unrecorded(new_layout, tag, false)?;
    // SAFETY: both blocks are live and distinct, each at least as long as what is copied;
    // the old one is then freed once.
    unsafe {
        ptr.as_ptr()
            .copy_to_nonoverlapping(new.ptr.as_ptr(), layout.size().min(new_size));
        deallocate_for_tag_unrecorded(ptr, layout, tag);
    }
    Some((new, old))
}
