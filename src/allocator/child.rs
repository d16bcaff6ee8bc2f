//! Child allocators: a pass-through to a parent that counts its own blocks.
//!
//! This is how a subsystem tags its memory (O3DE's `ChildAllocatorSchema`). A child asks
//! its parent for every block and counts, in its own [`Counters`], the size the parent
//! *granted* (the parent's size class or block size) and the size the caller requested.
//! The parent counts the same block too, so a parent's figures include its children's.
//!
//! Parents are [`BlockAllocator`]s: the [`SystemAllocator`] and every declared allocator
//! (so a child can have a child). Each call reports the granted size to the caller, and a
//! free returns the granted size it released: the bottom of the chain asks the heap once
//! (a table load for small requests, `usable_size` otherwise), and every child on the way
//! up subtracts exactly what it once added, whatever size between requested and granted
//! the caller passes back.
//!
//! **Lanes.** A child whose chain of parents ends at the `SystemAllocator` (see
//! [`BlockAllocator::THREAD_CACHE_LANES`]) gets, if it is among the first to allocate, a
//! lane of its own in the thread caches (see `crate::allocator::lanes`): its small requests
//! (≤ 4 KiB once rounded up to their alignment) are then the `SystemAllocator`'s own pop
//! and push in another lane, plus one add of the requested size, and its figures come from
//! the lane's counts.
//! That is as many instructions per alloc+free pair as the `SystemAllocator`'s (one fewer
//! with a layout computed per call; `examples/child_pairs.rs`), two of them read-modify-writes
//! of memory for the requested bytes; a child declared `{ requested_bytes: false }` leaves
//! those out (the `REQUESTED` parameter of [`Child`]).
//!
//! **The general path**, for everything else (large requests, children without a lane,
//! and every call while the child or a child above it has a budget or records): before the
//! parent's call, one compare of the route word says the allocator has a shard slot
//! (claimed only once it is registered) and neither a budget nor records, and one more that
//! the thread's cache is live; the block is then counted in the thread's shard with
//! owner-only loads and stores (see [`Counters`]): after the parent's call for an
//! allocation, before it for a free of a heap block (whose granted size the block's header
//! says), so that the free's call to the parent is a jump and keeps no frame. Every other
//! case (first call, budget, records, no slot, a thread's first or last calls) leaves that
//! path for code kept out of line. Each handle has its own copy of these paths, which know
//! its registry entry as a constant.

use crate::budget::{BudgetEvent, BudgetSettings};
use crate::lanes;
use crate::records;
use crate::registry::{Registration, SYSTEM};
use crate::schema::Allocation;
use crate::schema::hpha::Tag;
use crate::schema::hpha::size_class::{class_size, fast_class, fast_class_size};
use crate::stats::{Counters, Slot};
use crate::system::{SystemAllocator, heap_granted};
use crate::thread_cache;
use core::alloc::{GlobalAlloc, Layout};
use core::marker::PhantomData;
use core::ptr::NonNull;

/// An allocator that hands out blocks and says how big they really are: what a child
/// forwards to, and what the handles' `Allocator` impls are built on.
///
/// All sizes are non-zero (the handles serve zero-size requests without calling here).
///
/// # Safety
/// Implementations must return blocks that are valid for reads and writes of the
/// reported `size` bytes (at least `layout.size()`), aligned to `layout.align()`, and not
/// aliased by any other live block, until freed. The granted size reported for a block
/// must be the same at allocation, at any resize that keeps it, and at its free.
pub unsafe trait BlockAllocator: Copy + Default + Send + Sync + 'static {
    /// A value of the handle, for `const` contexts (handles are zero-sized).
    const INSTANCE: Self;

    /// Whether this allocator's small blocks are the `SystemAllocator`'s thread-cache
    /// blocks, so that a child of it may serve them from a lane of its own in the thread
    /// caches instead of calling it (see the module docs). True for the `SystemAllocator`
    /// and for children whose parents all lead to it; must stay false for anything else
    /// (a child would then bypass it).
    const THREAD_CACHE_LANES: bool = false;

    /// This allocator's registry entry.
    fn registration() -> &'static Registration;

    /// Allocates a block for `layout` (non-zero size); `None` when out of memory or refused.
    fn allocate_block(self, layout: Layout) -> Option<Allocation>;

    /// Like [`allocate_block`](Self::allocate_block), with the whole granted block zeroed.
    fn allocate_block_zeroed(self, layout: Layout) -> Option<Allocation>;

    /// Frees a block and returns its granted size.
    ///
    /// # Safety
    /// `ptr` must be a live block from this allocator, allocated (or last resized) with a
    /// layout of the same alignment as `layout` and a size from the one requested up to the
    /// one granted.
    unsafe fn deallocate_block(self, ptr: NonNull<u8>, layout: Layout) -> usize;

    /// Resizes a block to `new_size` bytes (non-zero), keeping its alignment and contents
    /// up to the smaller size; returns the block (maybe moved) and the granted size the
    /// old block had. `None` leaves the old block untouched.
    ///
    /// # Safety
    /// As for [`deallocate_block`](Self::deallocate_block); `new_size` rounded up to the
    /// alignment must not exceed `isize::MAX`.
    unsafe fn reallocate_block(
        self,
        ptr: NonNull<u8>,
        layout: Layout,
        new_size: usize,
    ) -> Option<(Allocation, usize)>;

    /// The granted size of a live block: what [`deallocate_block`](Self::deallocate_block)
    /// would return for it. (A child under a budget in
    /// [`BudgetMode::Fail`](crate::BudgetMode::Fail) asks, to grow a block within it in
    /// place.)
    ///
    /// # Safety
    /// As for [`deallocate_block`](Self::deallocate_block).
    unsafe fn granted_size(self, ptr: NonNull<u8>, layout: Layout) -> usize;

    /// [`allocate_block`](Self::allocate_block) (or its zeroed form) for a child below
    /// whose blocks carry `tag` (see `crate::allocator::lanes`): counted in this allocator's
    /// figures, the block taken from that tag's heap at the bottom of the chain. Tag 0 is
    /// a plain allocation. Only allocators with
    /// [`THREAD_CACHE_LANES`](Self::THREAD_CACHE_LANES) are ever asked for a tag other than
    /// 0; the default ignores it.
    #[doc(hidden)]
    fn allocate_block_tagged(self, layout: Layout, tag: Tag, zeroed: bool) -> Option<Allocation> {
        let _ = tag;
        if zeroed {
            self.allocate_block_zeroed(layout)
        } else {
            self.allocate_block(layout)
        }
    }

    /// [`deallocate_block`](Self::deallocate_block) of a block allocated with
    /// [`allocate_block_tagged`](Self::allocate_block_tagged) and `tag`.
    ///
    /// # Safety
    /// As for [`deallocate_block`](Self::deallocate_block).
    #[doc(hidden)]
    unsafe fn deallocate_block_tagged(self, ptr: NonNull<u8>, layout: Layout, tag: Tag) -> usize {
        let _ = tag;
        // SAFETY: forwarded from the caller.
        unsafe { self.deallocate_block(ptr, layout) }
    }

    /// [`reallocate_block`](Self::reallocate_block) of a block allocated with
    /// [`allocate_block_tagged`](Self::allocate_block_tagged) and `tag`; a moved block
    /// keeps the tag.
    ///
    /// # Safety
    /// As for [`reallocate_block`](Self::reallocate_block).
    #[doc(hidden)]
    unsafe fn reallocate_block_tagged(
        self,
        ptr: NonNull<u8>,
        layout: Layout,
        new_size: usize,
        tag: Tag,
    ) -> Option<(Allocation, usize)> {
        let _ = tag;
        // SAFETY: forwarded from the caller.
        unsafe { self.reallocate_block(ptr, layout, new_size) }
    }
}

// SAFETY: the heap's blocks are valid, aligned and unaliased (GlobalAlloc's contract,
// which SystemAllocator upholds); granted sizes come from `heap_granted`, which depends only
// on the block (and on the layout's size within the requested..=granted range).
unsafe impl BlockAllocator for SystemAllocator {
    const INSTANCE: Self = SystemAllocator::new();
    const THREAD_CACHE_LANES: bool = true;

    fn registration() -> &'static Registration {
        &SYSTEM
    }

    #[inline(always)]
    fn allocate_block(self, layout: Layout) -> Option<Allocation> {
        self.allocate_granted(layout)
    }

    #[inline]
    fn allocate_block_zeroed(self, layout: Layout) -> Option<Allocation> {
        self.allocate_granted_zeroed(layout)
    }

    #[inline(always)]
    unsafe fn deallocate_block(self, ptr: NonNull<u8>, layout: Layout) -> usize {
        // SAFETY: forwarded from the caller: a live block of this heap with a fitting layout.
        unsafe { self.deallocate_granted(ptr, layout) }
    }

    #[inline]
    unsafe fn reallocate_block(
        self,
        ptr: NonNull<u8>,
        layout: Layout,
        new_size: usize,
    ) -> Option<(Allocation, usize)> {
        // SAFETY: forwarded from the caller; on success the new block is live with
        // `new_layout` (same alignment, `new_size` bytes).
        unsafe {
            let old = heap_granted(ptr, layout);
            let new_ptr = NonNull::new(self.realloc(ptr.as_ptr(), layout, new_size))?;
            let new_layout = Layout::from_size_align_unchecked(new_size, layout.align());
            let size = heap_granted(new_ptr, new_layout);
            Some((Allocation { ptr: new_ptr, size }, old))
        }
    }

    #[inline]
    unsafe fn granted_size(self, ptr: NonNull<u8>, layout: Layout) -> usize {
        // SAFETY: forwarded from the caller: a live block of this heap with a fitting layout.
        unsafe { heap_granted(ptr, layout) }
    }

    #[inline]
    fn allocate_block_tagged(self, layout: Layout, tag: Tag, zeroed: bool) -> Option<Allocation> {
        match (tag, zeroed) {
            (0, false) => self.allocate_granted(layout),
            (0, true) => self.allocate_granted_zeroed(layout),
            _ => crate::system::allocate_for_tag(layout, tag, zeroed),
        }
    }

    #[inline]
    unsafe fn deallocate_block_tagged(self, ptr: NonNull<u8>, layout: Layout, tag: Tag) -> usize {
        // SAFETY: forwarded from the caller.
        unsafe {
            if tag == 0 {
                return self.deallocate_granted(ptr, layout);
            }
            crate::system::deallocate_for_tag(ptr, layout, tag)
        }
    }

    #[inline]
    unsafe fn reallocate_block_tagged(
        self,
        ptr: NonNull<u8>,
        layout: Layout,
        new_size: usize,
        tag: Tag,
    ) -> Option<(Allocation, usize)> {
        // SAFETY: forwarded from the caller.
        unsafe {
            if tag == 0 {
                return self.reallocate_block(ptr, layout, new_size);
            }
            crate::system::reallocate_for_tag(ptr, layout, new_size, tag)
        }
    }
}

/// A child allocator's calls, reachable from its registry entry: what the global
/// allocator calls for a scoped tag (see [`crate::scope`]), whose handle type it cannot
/// name. Built by [`allocator!`](crate::allocator) for every child.
#[doc(hidden)]
pub struct ChildOps {
    /// [`BlockAllocator::allocate_block_tagged`].
    pub allocate: fn(Layout, Tag, bool) -> Option<Allocation>,
    /// [`BlockAllocator::deallocate_block_tagged`].
    pub deallocate: unsafe fn(NonNull<u8>, Layout, Tag) -> usize,
    /// [`BlockAllocator::reallocate_block_tagged`].
    pub reallocate: ReallocateTagged,
}

/// The type of [`ChildOps::reallocate`].
#[doc(hidden)]
pub type ReallocateTagged =
    unsafe fn(NonNull<u8>, Layout, usize, Tag) -> Option<(Allocation, usize)>;

impl ChildOps {
    /// The calls of allocator `B`.
    pub const fn of<B: BlockAllocator>() -> Self {
        fn allocate<B: BlockAllocator>(
            layout: Layout,
            tag: Tag,
            zeroed: bool,
        ) -> Option<Allocation> {
            B::INSTANCE.allocate_block_tagged(layout, tag, zeroed)
        }
        /// # Safety
        /// As for [`BlockAllocator::deallocate_block_tagged`].
        unsafe fn deallocate<B: BlockAllocator>(
            ptr: NonNull<u8>,
            layout: Layout,
            tag: Tag,
        ) -> usize {
            // SAFETY: forwarded from the caller.
            unsafe { B::INSTANCE.deallocate_block_tagged(ptr, layout, tag) }
        }
        /// # Safety
        /// As for [`BlockAllocator::reallocate_block_tagged`].
        unsafe fn reallocate<B: BlockAllocator>(
            ptr: NonNull<u8>,
            layout: Layout,
            new_size: usize,
            tag: Tag,
        ) -> Option<(Allocation, usize)> {
            // SAFETY: forwarded from the caller.
            unsafe { B::INSTANCE.reallocate_block_tagged(ptr, layout, new_size, tag) }
        }
        Self {
            allocate: allocate::<B>,
            deallocate: deallocate::<B>,
            reallocate: reallocate::<B>,
        }
    }
}

/// The child logic of handle `H`, whose parent is `P`. Handles declared with
/// [`allocator!`](crate::allocator) (`child of …`) delegate to it.
///
/// The handle is a type parameter, not a field, so that each handle's out-of-line paths
/// know its registry entry as a constant: no register holds it across the parent's call.
///
/// `REQUESTED`: whether the child counts the bytes callers request. `false` (declared with
/// `requested_bytes: false`, whose registry entry must then be
/// [`with_requested_bytes(false)`](Registration::with_requested_bytes)) drops the two
/// memory writes that figure costs a small alloc+free pair served from the child's lane;
/// big blocks still count it, unreported.
#[derive(Clone, Copy, Debug)]
pub struct Child<P: BlockAllocator, H: BlockAllocator, const REQUESTED: bool = true> {
    parent: P,
    handle: PhantomData<H>,
}

impl<P: BlockAllocator, H: BlockAllocator, const REQUESTED: bool> Default
    for Child<P, H, REQUESTED>
{
    fn default() -> Self {
        Self::new()
    }
}

impl<P: BlockAllocator, H: BlockAllocator, const REQUESTED: bool> Child<P, H, REQUESTED> {
    /// The child logic of `H` (whose registry entry must name `P` as its parent).
    #[inline(always)]
    pub const fn new() -> Self {
        Self {
            parent: P::INSTANCE,
            handle: PhantomData,
        }
    }

    /// The handle's registry entry (a constant once inlined).
    #[inline(always)]
    fn registration(&self) -> &'static Registration {
        H::registration()
    }

    #[inline]
    fn counters(&self) -> &'static Counters {
        self.registration().counters()
    }

    /// The tag this child's blocks carry at the bottom of the chain (0: its parent's blocks,
    /// for a child of an allocator without lanes, or one that found no tag left). A child of
    /// the `SystemAllocator`'s chain claims its tag here, on its first block: every block it
    /// hands out comes from its tag's heap, so a lane of the tag never holds another's.
    #[inline(always)]
    fn bottom_tag(&self) -> Tag {
        if !P::THREAD_CACHE_LANES {
            return 0;
        }
        match self.counters().tag() {
            Some(tag) => tag,
            None => self.claim_tag(),
        }
    }

    /// [`bottom_tag`](Self::bottom_tag) before the child has one.
    #[cold]
    #[inline(never)]
    fn claim_tag(self) -> Tag {
        lanes::claim(self.registration());
        self.counters().tag().unwrap_or(0)
    }

    /// The tag of this child's blocks once it has one (frees and resizes: no claim).
    #[inline(always)]
    fn own_tag(&self) -> Tag {
        if !P::THREAD_CACHE_LANES {
            return 0;
        }
        self.counters().tag().unwrap_or(0)
    }

    /// Counts a block the parent just granted; refuses it (and gives it back) if that
    /// breaks an enforced budget.
    #[inline]
    fn account(&self, block: Allocation, layout: Layout, tag: Tag) -> Option<Allocation> {
        let counters = self.counters();
        if counters.count_allocation(self.registration().budget(), block.size, layout.size()) {
            return Some(block);
        }
        self.account_exact(block, layout, tag)
    }

    /// [`account`](Self::account) with the shared atomics (a budget is set, or no shard);
    /// out of line, so the common path carries none of its code or register pressure.
    #[cold]
    #[inline(never)]
    fn account_exact(&self, block: Allocation, layout: Layout, tag: Tag) -> Option<Allocation> {
        let counters = self.counters();
        let mut live = counters.add_granted(block.size);
        let settings = self.registration().budget().settings();
        if lanes::at_ceiling(counters, settings, live) {
            // A lane below may still hold a block it took as its gate closed: counted first.
            lanes::settle(counters);
            live = counters.published_live();
        }
        if settings.exceeded_by(live) && !self.over_budget(settings, live, block.size, true) {
            crate::budget::note_refusal(self.registration(), layout.size());
            counters.undo_granted(block.size);
            // SAFETY: the parent just gave us this block of `tag` for `layout`.
            unsafe { self.parent.deallocate_block_tagged(block.ptr, layout, tag) };
            return None;
        }
        counters.commit_allocation(layout.size(), live);
        if counters.lanes_closed_for_budget() {
            lanes::maybe_reopen(self.registration());
        }
        Some(block)
    }

    /// Tells the budget hook about a call that takes the child to `live` bytes, over the
    /// budget in `settings` (the reading the caller compared `live` with); returns whether
    /// it may go ahead. `refusable`: whether the call can still be refused (not a resize
    /// already done by the parent); if so, it is refused in Fail mode.
    #[cold]
    #[inline(never)]
    fn over_budget(
        &self,
        settings: BudgetSettings,
        live: usize,
        request: usize,
        refusable: bool,
    ) -> bool {
        let budget = self.registration().budget();
        let counters = self.counters();
        let refused = refusable && settings.enforced();
        let event = BudgetEvent {
            allocator: self.registration().name(),
            budget: settings.reported_limit(),
            live_bytes: live,
            request_bytes: request,
            count: counters.record_over_budget(),
            refused,
        };
        budget.notify(&event);
        if refused {
            counters.record_budget_failure();
        }
        !refused
    }

    /// Allocates through the parent (or the child's lane of the thread cache), counts the
    /// block and records it; see [`BlockAllocator::allocate_block`].
    ///
    /// A small request to a child of the `SystemAllocator` with an open lane is a pop from
    /// the lane's bin in the thread cache (see the module docs). Everything else takes the
    /// general path: the parent's call, counted in the child's own counters.
    #[inline(always)]
    pub fn allocate(&self, layout: Layout) -> Option<Allocation> {
        if !P::THREAD_CACHE_LANES {
            return self.allocate_general(layout);
        }
        if let Some(class) = fast_class(layout) {
            // SAFETY: the lane word is 0 or a lane's offset from the thread pointer (set
            // once by `lanes::claim`); the class comes from the class table.
            let p = unsafe {
                thread_cache::lane_allocate(
                    self.counters().lane_offset(),
                    class,
                    layout.size(),
                    REQUESTED,
                )
            };
            if let Some(ptr) = NonNull::new(p) {
                return Some(Allocation {
                    ptr,
                    size: fast_class_size(class),
                });
            }
        }
        self.allocate_missed(layout)
    }

    /// Everything but a pop from an open lane: a jump to one of two out-of-line paths, the
    /// lane's refill or the general path for big requests. Out of line and reached from one
    /// call site, so that the small path stays short and needs no stack frame where it is
    /// inlined (as the global allocator, a frame and the general path inline cost the small
    /// path 89 instructions per pair instead of 63; a second call site cost a batch of small
    /// pairs three instructions per pair). It keeps no frame of its own: a frame shared with
    /// the refill would cost a big request more than the repeated class test does.
    #[inline(never)]
    fn allocate_missed(self, layout: Layout) -> Option<Allocation> {
        match fast_class(layout) {
            Some(_) => self.allocate_small_missed(layout),
            // SAFETY: `fast_class` said `None`.
            None => unsafe { self.allocate_big(layout) },
        }
    }

    /// A request past the lanes (larger than 4 KiB once rounded up to its alignment): the
    /// general path, out of line and reached straight from [`allocate`](Self::allocate), so
    /// that it neither looks the class up again nor shares a frame with the lanes' refill.
    ///
    /// # Safety
    /// `fast_class(layout)` is `None`.
    #[inline(never)]
    unsafe fn allocate_big(self, layout: Layout) -> Option<Allocation> {
        // SAFETY: forwarded from the caller. Told to the optimiser, so that the parent's
        // own test for a small request (inlined below) folds away.
        unsafe { core::hint::assert_unchecked(fast_class(layout).is_none()) };
        self.allocate_general(layout)
    }

    /// A small request its lane's pop did not serve, jumped to from
    /// [`allocate_missed`](Self::allocate_missed). The class is looked up again rather than
    /// passed: keeping it live across the lane's pop cost the small path two instructions.
    #[inline(never)]
    fn allocate_small_missed(self, layout: Layout) -> Option<Allocation> {
        match fast_class(layout) {
            Some(class) => self.allocate_lane_missed(layout, class),
            // SAFETY: `fast_class` said `None`.
            None => unsafe { self.allocate_big(layout) },
        }
    }

    /// A small allocation its lane did not serve: a refill (or a sampled allocation) if the
    /// lane is open, else the general path (and, the first time, a lane asked for). Inlined
    /// into [`allocate_small_missed`](Self::allocate_small_missed): a frame more between the program and
    /// the records' capture would push the program's own frames past the ones a capture
    /// takes beyond those it shows (`records::stack::PLUMBING`).
    #[inline(always)]
    fn allocate_lane_missed(self, layout: Layout, class: usize) -> Option<Allocation> {
        let Some(tag) = self.counters().tag() else {
            return self.allocate_lane_refused(layout);
        };
        // SAFETY: the class is the layout's.
        match unsafe { thread_cache::lane_allocate_missed(tag, class, layout, REQUESTED) } {
            Some(p) => NonNull::new(p).map(|ptr| Allocation {
                ptr,
                size: class_size(class),
            }),
            None => self.allocate_lane_refused(layout),
        }
    }

    /// A small allocation its lane refused (no tag yet, or a closed lane): the general path
    /// (whose first call claims the tag). Out of line: the lane's refill above stays a
    /// straight line, and a refused call (records on, a budget) pays one call more.
    #[inline(never)]
    fn allocate_lane_refused(self, layout: Layout) -> Option<Allocation> {
        self.allocate_general(layout)
    }

    /// Allocates through the parent, counts the block and records it.
    ///
    /// The common case is one check before the parent's call (the route word says the
    /// allocator has a shard slot, which it claims only once registered, no budget and no
    /// records) and one after it (the thread's cache is live): the block is then counted in
    /// this thread's shard. Anything else (the first call, a budget, records, a thread's
    /// first or last calls) takes a path kept out of line.
    #[inline(always)]
    fn allocate_general(&self, layout: Layout) -> Option<Allocation> {
        self.allocate_counted(layout, false, self.bottom_tag())
    }

    /// Zeroed allocation; see [`BlockAllocator::allocate_block_zeroed`]. A small request
    /// takes the lane like [`allocate`](Self::allocate) and clears its slot here; anything
    /// else asks the parent for a zeroed block, so that memory the parent knows to be zero
    /// (pages fresh from the OS) is not written, and not made resident, again.
    #[inline(always)]
    pub fn allocate_zeroed(&self, layout: Layout) -> Option<Allocation> {
        if P::THREAD_CACHE_LANES && fast_class(layout).is_some() {
            let block = self.allocate(layout)?;
            // SAFETY: the block is ours and `size` bytes long.
            unsafe { block.ptr.as_ptr().write_bytes(0, block.size) };
            return Some(block);
        }
        self.allocate_zeroed_general(layout)
    }

    /// [`allocate_zeroed`](Self::allocate_zeroed) through the parent: out of line, as
    /// [`allocate_missed`](Self::allocate_missed) is for plain allocations, so that a
    /// recorded call stack holds as many allocator frames either way.
    #[inline(never)]
    fn allocate_zeroed_general(self, layout: Layout) -> Option<Allocation> {
        self.allocate_counted(layout, true, self.bottom_tag())
    }

    /// [`allocate_general`](Self::allocate_general), zeroed or not (a constant at every
    /// call, so each caller keeps only its own branch), for a block of `tag` (this child's
    /// own, or a child's below it).
    #[inline(always)]
    fn allocate_counted(&self, layout: Layout, zeroed: bool, tag: Tag) -> Option<Allocation> {
        let counters = self.counters();
        let Some(slot) = counters.plain_slot() else {
            return match counters.recorded_slot() {
                Some(slot) => self.allocate_recorded(layout, slot, zeroed, tag),
                None => self.allocate_slow(layout, zeroed, tag),
            };
        };
        if !thread_cache::shards_active() {
            return self.allocate_unsharded(layout, zeroed, tag);
        }
        // Checked before the parent's call, so that nothing but the requested size and the
        // slot has to outlive it: the cache cannot retire during the call.
        let block = self.parent_allocate(layout, zeroed, tag)?;
        counters.live_shard_allocate(slot, block.size, layout.size());
        Some(block)
    }

    /// [`allocate_counted`](Self::allocate_counted) on a thread whose cache is not live (its
    /// first call, or its last ones while it exits): counted with
    /// [`account`](Self::account), which registers the cache or uses the shared atomics.
    #[cold]
    #[inline(never)]
    fn allocate_unsharded(self, layout: Layout, zeroed: bool, tag: Tag) -> Option<Allocation> {
        let block = self.parent_allocate(layout, zeroed, tag)?;
        self.account_recorded(block, layout, tag)
    }

    /// The parent's allocation, zeroed or not, of a block of `tag`.
    #[inline(always)]
    fn parent_allocate(&self, layout: Layout, zeroed: bool, tag: Tag) -> Option<Allocation> {
        let block = self.parent.allocate_block_tagged(layout, tag, zeroed);
        if block.is_none() {
            self.parent_refused(layout.size());
        }
        block
    }

    /// The parent refused a request of `size` bytes: if a budget above refused it, counts
    /// the failure here too (see [`BudgetEvent`]).
    #[cold]
    #[inline(never)]
    fn parent_refused(&self, size: usize) {
        if crate::budget::refused_above(self.registration(), size) {
            self.counters().record_budget_failure();
        }
    }

    /// [`BlockAllocator::allocate_block_tagged`] for this child: a block of `tag` counted
    /// here (tag 0: a plain allocation, which may take this child's own lane).
    #[inline]
    pub fn allocate_tagged(&self, layout: Layout, tag: Tag, zeroed: bool) -> Option<Allocation> {
        match (tag, zeroed) {
            (0, false) => self.allocate(layout),
            (0, true) => self.allocate_zeroed(layout),
            _ => self.allocate_counted(layout, zeroed, tag),
        }
    }

    /// [`allocate_general`](Self::allocate_general) when records are the only reason the
    /// route is not a plain slot: the block is counted in the shard as usual, then
    /// recorded. Out of line, so the common path keeps none of its code; called straight
    /// from the general path, so a recorded call stack holds the same allocator frames on
    /// this path and on the slow one.
    #[inline(never)]
    fn allocate_recorded(
        self,
        layout: Layout,
        slot: Slot,
        zeroed: bool,
        tag: Tag,
    ) -> Option<Allocation> {
        let block = self.parent_allocate(layout, zeroed, tag)?;
        if !self
            .counters()
            .shard_allocate(slot, block.size, layout.size())
        {
            return self.account_recorded(block, layout, tag);
        }
        records::after_alloc(self.registration(), block.ptr, layout, block.size);
        Some(block)
    }

    /// [`allocate`](Self::allocate) off the fast path: registers the allocator (first),
    /// then counts with [`account`](Self::account), which claims a slot or uses the shared
    /// atomics.
    #[cold]
    #[inline(never)]
    fn allocate_slow(self, layout: Layout, zeroed: bool, tag: Tag) -> Option<Allocation> {
        self.registration().register();
        if self.refused_up_front(layout) {
            return None;
        }
        let block = self.parent_allocate(layout, zeroed, tag)?;
        self.account_recorded(block, layout, tag)
    }

    /// Before the parent is asked for a block while a budget in
    /// [`BudgetMode::Fail`](crate::BudgetMode::Fail) is set: refuses a request whose size
    /// alone takes the live figure over the budget (the parent grants at least that
    /// much), so the refusal leaves no trace in the parent's figures, records or budget.
    /// What passes is checked again, exactly, once the parent has said how big the block
    /// is ([`account`](Self::account)): only a request refused for its rounding, or by a
    /// thread racing at the ceiling, is then given back to the parent. `true`: refused
    /// (and the hook told).
    #[cold]
    fn refused_up_front(self, layout: Layout) -> bool {
        let settings = self.registration().budget().settings();
        if !settings.enforced() {
            return false;
        }
        let counters = self.counters();
        let mut live = counters.exact_live_granted().saturating_add(layout.size());
        if settings.exceeded_by(live) && counters.lanes_below().is_some() {
            // Lanes below may hold frees not yet published: counted before refusing.
            lanes::settle(counters);
            live = counters.published_live().saturating_add(layout.size());
        }
        let refused =
            settings.exceeded_by(live) && !self.over_budget(settings, live, layout.size(), true);
        if refused {
            crate::budget::note_refusal(self.registration(), layout.size());
        }
        refused
    }

    /// Counts (see [`account`](Self::account)) and records a block the parent just granted.
    #[cold]
    #[inline(never)]
    fn account_recorded(self, block: Allocation, layout: Layout, tag: Tag) -> Option<Allocation> {
        let block = self.account(block, layout, tag)?;
        records::after_alloc(self.registration(), block.ptr, layout, block.size);
        Some(block)
    }

    #[inline]
    fn allocate_unrecorded(&self, layout: Layout, tag: Tag) -> Option<Allocation> {
        self.registration().register();
        if self.refused_up_front(layout) {
            return None;
        }
        let block = self.parent_allocate(layout, false, tag)?;
        self.account(block, layout, tag)
    }

    /// Frees through the parent (or into the child's lane) and uncounts the block;
    /// returns its granted size.
    ///
    /// # Safety
    /// As for [`BlockAllocator::deallocate_block`].
    #[inline(always)]
    pub unsafe fn deallocate(&self, ptr: NonNull<u8>, layout: Layout) -> usize {
        if !P::THREAD_CACHE_LANES {
            // SAFETY: forwarded from the caller.
            return unsafe { self.deallocate_general(ptr, layout) };
        }
        if let Some(class) = fast_class(layout) {
            // The layout picks the block's class whatever path served it: every path gives
            // a small layout this class's slots (`fast_class` agrees with `class_for`).
            // SAFETY: as in `allocate`; the block is a live small block of this class.
            let freed = unsafe {
                thread_cache::lane_free(
                    self.counters().lane_offset(),
                    ptr.as_ptr(),
                    class,
                    layout.size(),
                    REQUESTED,
                )
            };
            if freed {
                return fast_class_size(class);
            }
        }
        // SAFETY: forwarded from the caller.
        unsafe { self.deallocate_missed(ptr, layout) }
    }

    /// Everything but a push into an open lane, as [`allocate_missed`](Self::allocate_missed).
    ///
    /// # Safety
    /// As for [`BlockAllocator::deallocate_block`].
    #[inline(never)]
    unsafe fn deallocate_missed(self, ptr: NonNull<u8>, layout: Layout) -> usize {
        // SAFETY: forwarded from the caller; for `deallocate_big`, `fast_class` said `None`.
        unsafe {
            match fast_class(layout) {
                Some(_) => self.deallocate_small_missed(ptr, layout),
                None => self.deallocate_big(ptr, layout),
            }
        }
    }

    /// A block past the lanes: the general path, out of line for the reasons given at
    /// [`allocate_big`](Self::allocate_big).
    ///
    /// # Safety
    /// As for [`BlockAllocator::deallocate_block`]; `fast_class(layout)` is `None`.
    #[inline(never)]
    unsafe fn deallocate_big(self, ptr: NonNull<u8>, layout: Layout) -> usize {
        // SAFETY: forwarded from the caller (the hint as in `allocate_big`).
        unsafe {
            core::hint::assert_unchecked(fast_class(layout).is_none());
            self.deallocate_general(ptr, layout)
        }
    }

    /// A small free its lane's push did not take, jumped to from
    /// [`deallocate_missed`](Self::deallocate_missed).
    ///
    /// # Safety
    /// As for [`BlockAllocator::deallocate_block`].
    #[inline(never)]
    unsafe fn deallocate_small_missed(self, ptr: NonNull<u8>, layout: Layout) -> usize {
        // SAFETY: forwarded from the caller; for `deallocate_big`, `fast_class` said `None`.
        unsafe {
            match fast_class(layout) {
                Some(class) => self.deallocate_lane_missed(ptr, layout, class),
                None => self.deallocate_big(ptr, layout),
            }
        }
    }

    /// A small free its lane did not take: into a full bin if the lane is open, else the
    /// general path.
    ///
    /// # Safety
    /// As for [`BlockAllocator::deallocate_block`]; `class` is the block's.
    #[inline(always)]
    unsafe fn deallocate_lane_missed(
        self,
        ptr: NonNull<u8>,
        layout: Layout,
        class: usize,
    ) -> usize {
        // SAFETY: forwarded from the caller.
        unsafe {
            if let Some(tag) = self.counters().tag()
                && thread_cache::lane_free_missed(
                    tag,
                    ptr.as_ptr(),
                    class,
                    layout.size(),
                    REQUESTED,
                )
            {
                return class_size(class);
            }
            self.deallocate_lane_refused(ptr, layout)
        }
    }

    /// A small free its lane refused (no tag, or a closed lane): the general path, out of
    /// line as [`allocate_lane_refused`](Self::allocate_lane_refused).
    ///
    /// # Safety
    /// As for [`BlockAllocator::deallocate_block`].
    #[inline(never)]
    unsafe fn deallocate_lane_refused(self, ptr: NonNull<u8>, layout: Layout) -> usize {
        // SAFETY: forwarded from the caller.
        unsafe { self.deallocate_general(ptr, layout) }
    }

    /// [`BlockAllocator::deallocate_block_tagged`] for this child: a block of `tag` freed
    /// and uncounted here (tag 0: a plain free).
    ///
    /// # Safety
    /// As for [`BlockAllocator::deallocate_block`], the block allocated with `tag`.
    #[inline]
    pub unsafe fn deallocate_tagged(&self, ptr: NonNull<u8>, layout: Layout, tag: Tag) -> usize {
        // SAFETY: forwarded from the caller.
        unsafe {
            if tag == 0 {
                return self.deallocate(ptr, layout);
            }
            self.deallocate_counted(ptr, layout, tag)
        }
    }

    /// Frees through the parent, uncounts the block and drops its record.
    ///
    /// As for allocations, the route word alone says whether this is the common case (a
    /// slot, no budget, no records); the free is then counted in the thread's shard.
    ///
    /// # Safety
    /// As for [`BlockAllocator::deallocate_block`].
    #[inline(always)]
    unsafe fn deallocate_general(&self, ptr: NonNull<u8>, layout: Layout) -> usize {
        // SAFETY: forwarded from the caller; the block is of this child's own tag.
        unsafe { self.deallocate_counted(ptr, layout, self.own_tag()) }
    }

    /// [`deallocate_general`](Self::deallocate_general) of a block of `tag` (this child's
    /// own, or a child's below it).
    ///
    /// # Safety
    /// As for [`BlockAllocator::deallocate_block`], the block allocated with `tag`.
    #[inline(always)]
    unsafe fn deallocate_counted(&self, ptr: NonNull<u8>, layout: Layout, tag: Tag) -> usize {
        let counters = self.counters();
        let Some(slot) = counters.plain_slot() else {
            // SAFETY: forwarded from the caller.
            return unsafe { self.deallocate_flagged(ptr, layout, tag) };
        };
        if !thread_cache::shards_active() {
            // SAFETY: forwarded from the caller.
            return unsafe { self.deallocate_unsharded(ptr, layout, tag) };
        }
        if P::THREAD_CACHE_LANES {
            // The block is the heap's, its granted size the heap's whatever the chain of
            // children above: count the free first, and the parent's call is the last thing
            // here (a jump, no frame kept across it).
            // SAFETY: forwarded from the caller: a live heap block of this layout.
            let granted = unsafe { heap_granted(ptr, layout) };
            if !counters.live_shard_free_within(slot, granted, layout.size()) {
                // SAFETY: forwarded from the caller.
                return unsafe { self.deallocate_crossing(ptr, layout, slot, granted, tag) };
            }
            // SAFETY: forwarded from the caller.
            return unsafe { self.parent.deallocate_block_tagged(ptr, layout, tag) };
        }
        // SAFETY: forwarded from the caller.
        let granted = unsafe { self.parent.deallocate_block_tagged(ptr, layout, tag) };
        counters.live_shard_free(slot, granted, layout.size());
        granted
    }

    /// The end of [`deallocate_general`](Self::deallocate_general) when the free publishes
    /// the thread's granted bytes: out of line, so that the common case keeps no frame.
    ///
    /// # Safety
    /// As for [`BlockAllocator::deallocate_block`]; the free is counted in the live shard of
    /// `slot` but for its `granted` bytes.
    #[cold]
    #[inline(never)]
    unsafe fn deallocate_crossing(
        self,
        ptr: NonNull<u8>,
        layout: Layout,
        slot: Slot,
        granted: usize,
        tag: Tag,
    ) -> usize {
        // SAFETY: forwarded from the caller.
        let freed = unsafe { self.parent.deallocate_block_tagged(ptr, layout, tag) };
        self.counters().live_shard_free_crossing(slot, granted);
        freed
    }

    /// [`deallocate_general`](Self::deallocate_general) on a thread whose cache is not
    /// live, as [`allocate_unsharded`](Self::allocate_unsharded).
    ///
    /// # Safety
    /// As for [`BlockAllocator::deallocate_block`].
    #[cold]
    #[inline(never)]
    unsafe fn deallocate_unsharded(self, ptr: NonNull<u8>, layout: Layout, tag: Tag) -> usize {
        // SAFETY: forwarded from the caller.
        unsafe { self.deallocate_unrecorded(ptr, layout, tag) }
    }

    /// [`deallocate_general`](Self::deallocate_general) when the route is not a plain
    /// slot: drops the block's record (before the block goes, so no other thread can have
    /// reused the address and recorded it yet), then frees and counts it. Out of line.
    ///
    /// # Safety
    /// As for [`BlockAllocator::deallocate_block`].
    #[inline(never)]
    unsafe fn deallocate_flagged(self, ptr: NonNull<u8>, layout: Layout, tag: Tag) -> usize {
        records::before_free(self.registration(), ptr);
        // SAFETY: forwarded from the caller.
        unsafe { self.deallocate_unrecorded(ptr, layout, tag) }
    }

    /// # Safety
    /// As for [`BlockAllocator::deallocate_block`], the block allocated with `tag`.
    #[inline(always)]
    unsafe fn deallocate_unrecorded(&self, ptr: NonNull<u8>, layout: Layout, tag: Tag) -> usize {
        // SAFETY: forwarded from the caller.
        let granted = unsafe { self.parent.deallocate_block_tagged(ptr, layout, tag) };
        // The contract keeps `layout.size()` within the granted size.
        let requested = layout.size();
        let counters = self.counters();
        match counters.free_slot() {
            Some(slot) if counters.shard_free(slot, granted, requested) => {}
            _ => self.count_free_slow(granted, requested),
        }
        granted
    }

    /// Counts a free off the fast path (a budget, no slot, no live thread cache).
    #[cold]
    #[inline(never)]
    fn count_free_slow(self, granted: usize, requested: usize) {
        // Normally registered by its allocation already; cheap if so.
        self.registration().register();
        let counters = self.counters();
        counters.count_free(self.registration().budget(), granted, requested);
        if counters.lanes_closed_for_budget() {
            lanes::maybe_reopen(self.registration());
        }
    }

    /// Resizes through the parent, recounts the block and moves its record. A small block
    /// resized to a small size while the child's lane is open stays in the lane instead
    /// (`reallocate_in_lane`).
    ///
    /// While a budget in [`BudgetMode::Fail`](crate::BudgetMode::Fail) is set, growth past
    /// the block's granted size allocates a new block (which the budget may refuse, leaving
    /// the old one untouched), copies and frees the old one, so the budget is exact: old and
    /// new block must fit in it together, as they are both live during the copy. Such a
    /// move is counted as an allocation and a free. Growth within the granted size needs
    /// no new bytes and is never refused.
    ///
    /// # Safety
    /// As for [`BlockAllocator::reallocate_block`].
    #[inline]
    pub unsafe fn reallocate(
        &self,
        ptr: NonNull<u8>,
        layout: Layout,
        new_size: usize,
    ) -> Option<(Allocation, usize)> {
        if P::THREAD_CACHE_LANES {
            // SAFETY: forwarded from the caller.
            if let Some(done) = unsafe { self.reallocate_in_lane(ptr, layout, new_size) } {
                return done;
            }
        }
        // SAFETY: forwarded from the caller; the block is of this child's own tag.
        unsafe { self.reallocate_counted(ptr, layout, new_size, self.own_tag()) }
    }

    /// [`BlockAllocator::reallocate_block_tagged`] for this child: a block of `tag` resized
    /// and recounted here (tag 0: a plain resize).
    ///
    /// # Safety
    /// As for [`BlockAllocator::reallocate_block`], the block allocated with `tag`.
    #[inline]
    pub unsafe fn reallocate_tagged(
        &self,
        ptr: NonNull<u8>,
        layout: Layout,
        new_size: usize,
        tag: Tag,
    ) -> Option<(Allocation, usize)> {
        // SAFETY: forwarded from the caller.
        unsafe {
            if tag == 0 {
                return self.reallocate(ptr, layout, new_size);
            }
            self.reallocate_counted(ptr, layout, new_size, tag)
        }
    }

    /// The general path of [`reallocate`](Self::reallocate) for a block of `tag`.
    ///
    /// # Safety
    /// As for [`BlockAllocator::reallocate_block`], the block allocated with `tag`.
    unsafe fn reallocate_counted(
        &self,
        ptr: NonNull<u8>,
        layout: Layout,
        new_size: usize,
        tag: Tag,
    ) -> Option<(Allocation, usize)> {
        // Already registered by the block's allocation; kept so that a slot is only ever
        // claimed by a registered child (what the fast path relies on).
        self.registration().register();
        let taken = records::before_realloc(self.registration(), ptr);
        // SAFETY: forwarded from the caller.
        let result = unsafe { self.reallocate_unrecorded(ptr, layout, new_size, tag) };
        records::after_realloc(taken, result.map(|(b, _)| (b.ptr, b.size)), new_size);
        result
    }

    /// A small block resized to a small size while the child's lane is open, kept in the
    /// lane: in place if the size class stays, else an allocation from the lane, a copy and
    /// a free into it. Through the parent, the move would take the new block from and give
    /// the old one back to the parent's own lane, so the child's bins would keep emptying
    /// and overflowing (a `String`-heavy program through a child spent twice as long giving
    /// blocks back to the heap). Counted as one resize, as on the general path. `None`: not
    /// small, or the lane not open here; the caller takes the general path.
    ///
    /// # Safety
    /// As for [`BlockAllocator::reallocate_block`].
    #[inline(always)]
    unsafe fn reallocate_in_lane(
        &self,
        ptr: NonNull<u8>,
        layout: Layout,
        new_size: usize,
    ) -> Option<Option<(Allocation, usize)>> {
        let old_class = fast_class(layout)?;
        let new_layout = Layout::from_size_align(new_size, layout.align()).ok()?;
        let new_class = fast_class(new_layout)?;
        let lane = thread_cache::lane_for_resize(self.counters().tag()?, ptr.as_ptr())?;
        let old = fast_class_size(old_class);
        if old_class == new_class {
            lane.count_resize(layout.size(), new_size, false);
            return Some(Some((Allocation { ptr, size: old }, old)));
        }
        // Out of memory leaves the old block as it was.
        let Some(new) = self.allocate(new_layout) else {
            return Some(None);
        };
        // Should the lane have been closed meanwhile, the allocation above or the free
        // below took the general path and counted itself in the child's shard: the
        // totals, summed over shards and lanes, still balance.
        // SAFETY: both blocks are live and distinct, each at least as long as what is
        // copied; the old one is then freed once, with its layout.
        unsafe {
            ptr.as_ptr()
                .copy_to_nonoverlapping(new.ptr.as_ptr(), layout.size().min(new_size));
            self.deallocate(ptr, layout);
        }
        lane.count_resize(layout.size(), new_size, true);
        Some(Some((new, old)))
    }

    /// # Safety
    /// As for [`BlockAllocator::reallocate_block`].
    #[inline]
    unsafe fn reallocate_unrecorded(
        &self,
        ptr: NonNull<u8>,
        layout: Layout,
        new_size: usize,
        tag: Tag,
    ) -> Option<(Allocation, usize)> {
        if new_size > layout.size()
            && self.registration().budget().settings().enforced()
            // SAFETY: forwarded from the caller.
            && new_size > unsafe { self.parent.granted_size(ptr, layout) }
        {
            let new_layout = Layout::from_size_align(new_size, layout.align()).ok()?;
            let new = self.allocate_unrecorded(new_layout, tag)?;
            // SAFETY: both blocks are live and distinct; the old one holds at least
            // `layout.size()` bytes, the new one more; the old one is then freed once.
            unsafe {
                ptr.as_ptr()
                    .copy_to_nonoverlapping(new.ptr.as_ptr(), layout.size());
                let old = self.deallocate_unrecorded(ptr, layout, tag);
                return Some((new, old));
            }
        }
        // SAFETY: forwarded from the caller.
        let Some((new, old)) = (unsafe {
            self.parent
                .reallocate_block_tagged(ptr, layout, new_size, tag)
        }) else {
            self.parent_refused(new_size);
            return None;
        };
        let counters = self.counters();
        let budget = self.registration().budget();
        if counters.count_resize(budget, old, new.size, layout.size().min(old), new_size) {
            return Some((new, old));
        }
        let live = counters.record_resize(old, new.size, layout.size().min(old), new_size);
        let settings = budget.settings();
        if new.size > old && settings.exceeded_by(live) {
            // Warn mode (Fail mode took the branch above for anything past the granted
            // size, and a resize within it keeps the block): the hook is told, the block
            // kept, whatever the mode is by now.
            self.over_budget(settings, live, new.size - old, false);
        }
        Some((new, old))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::schema::hpha::size_class::MAX_SMALL;

    #[test]
    fn the_granted_sizes_agree_with_the_heap() {
        let heap = SystemAllocator::new();
        for align in [1, 2, 4, 8, 16, 64, 4096, 8192] {
            for size in (1..=MAX_SMALL + 64).chain([20_000, 100_000]) {
                let layout = Layout::from_size_align(size, align).unwrap();
                let block = heap.allocate_block(layout).unwrap();
                // SAFETY: the block was just allocated with `layout` and is freed once.
                unsafe {
                    assert_eq!(
                        block.size,
                        heap.usable_size(block.ptr, layout),
                        "{layout:?}"
                    );
                    // What a child's free counts before it frees.
                    assert_eq!(block.size, heap_granted(block.ptr, layout), "{layout:?}");
                    assert_eq!(heap.deallocate_block(block.ptr, layout), block.size);
                }
            }
        }
    }
}
