//! HPHA: Dimitar Lazarov's High Performance Heap Allocator, as O3DE's AzCore uses it.
//!
//! Two heaps behind one interface, chosen by the layout of each request:
//! - `small`: requests up to 4 KiB (after rounding up to their alignment) come from
//!   size-class pages whose header is found from the address (in the first page of the
//!   page's 2 MiB segment);
//! - `large`: everything else comes from chunks managed with a red-black tree of free
//!   blocks (`tree`), best fit with splitting and immediate coalescing, or from a mapping of
//!   its own when very large or very aligned.
//!
//! Rust hands the layout back on free, so the class of a small block is computed, not read
//! from the block; the page header only confirms it.

pub(crate) mod addr_map;
pub(crate) mod large;
mod purge;
pub(crate) mod size_class;
pub(crate) mod small;
mod tagged;
mod tree;

use crate::os::{OsAllocator, PageSource};
use crate::schema::Allocation;
use core::alloc::Layout;
use core::ptr::NonNull;
use large::LargeHeap;
use purge::{Cutoff, PurgeClock};
use size_class::{class_for, class_size};
use small::SmallHeap;
use tagged::TaggedHeaps;

pub use large::{CHUNK_SIZE, DIRECT_THRESHOLD, GROW_DIRECT_MIN, MAX_TREE_ALIGN};
pub use size_class::MAX_SMALL;
pub use small::{PAGE_SIZE as SMALL_PAGE_SIZE, SEGMENT_SIZE, Tag};
pub use tagged::MAX_TAGS;

/// A thread-safe HPHA heap drawing pages from `S`.
///
/// ```
/// use core::alloc::Layout;
/// use tagalloc::os::OsAllocator;
/// use tagalloc::schema::HphaSchema;
///
/// let heap = HphaSchema::new(OsAllocator);
/// let layout = Layout::from_size_align(100, 16).unwrap();
/// let block = heap.allocate(layout).expect("out of memory");
/// assert!(block.size >= 100 && block.ptr.as_ptr() as usize % 16 == 0);
/// // SAFETY: the block came from this heap with this layout.
/// unsafe { heap.deallocate(block.ptr, layout) };
/// assert_eq!(heap.stats().live_blocks, 0);
/// ```
pub struct HphaSchema<S: PageSource = OsAllocator> {
    /// Small blocks of tag 0.
    small: SmallHeap,
    /// Small blocks of the other tags, each on segments of its own.
    tagged: TaggedHeaps,
    large: LargeHeap,
    /// When idle memory goes back to the source.
    clock: PurgeClock,
    source: S,
}

/// What an [`HphaSchema`] holds, read with [`HphaSchema::stats`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct HphaStats {
    /// Bytes granted to live blocks: the class size or block size, which is at least what
    /// was requested.
    pub granted_bytes: usize,
    /// Live blocks.
    pub live_blocks: usize,
    /// Blocks handed out since the heap was created (a realloc that moves the block to a
    /// new one counts one; a block with a mapping of its own that `mremap` moves counts
    /// none, being the same block at a new address).
    pub allocations: u64,
    /// Blocks freed since the heap was created (counted as `allocations` is for reallocs).
    pub frees: u64,
    /// Bytes held from the page source: segments, chunks and dedicated mappings.
    pub held_bytes: usize,
    /// Of `granted_bytes`, those in small blocks.
    pub small_granted_bytes: usize,
    /// Of `granted_bytes`, those in large blocks (including dedicated mappings).
    pub large_granted_bytes: usize,
    /// Small-block pages serving a size class.
    pub small_pages: usize,
    /// Small-block pages free in the pool.
    pub free_small_pages: usize,
    /// Segments (2 MiB each) mapped for small-block pages.
    pub segments: usize,
    /// Chunks mapped for the large-block tree.
    pub chunks: usize,
    /// Free blocks in the large-block tree.
    pub free_large_blocks: usize,
    /// Bytes in free large blocks.
    pub free_large_bytes: usize,
    /// The largest free large block.
    pub largest_free_large_block: usize,
    /// Live blocks with a mapping of their own.
    pub direct_blocks: usize,
    /// Bytes of small blocks sitting in thread caches: free for the program, still held
    /// by the heap. Always 0 for a heap used directly (only `SystemAllocator` has caches).
    pub thread_cached_bytes: usize,
}

impl<S: PageSource> HphaSchema<S> {
    /// A heap that maps nothing until its first allocation.
    pub const fn new(source: S) -> Self {
        Self {
            small: SmallHeap::new(),
            tagged: TaggedHeaps::new(),
            large: LargeHeap::new(),
            clock: PurgeClock::new(purge::NEVER),
            source,
        }
    }

    /// The small-block side of tag 0, for the thread caches in front of the global heap.
    pub(crate) fn small_heap(&self) -> &SmallHeap {
        &self.small
    }

    /// The small-block side of `tag`, made on first use; `None` when the page source is out
    /// of memory or `tag` is not below [`MAX_TAGS`].
    #[inline]
    pub(crate) fn small_heap_of(&self, tag: Tag) -> Option<&SmallHeap> {
        if tag == 0 {
            return Some(&self.small);
        }
        self.tagged.get_or_make(tag, &self.source)
    }

    /// The small-block side holding the small block `ptr` (its segment's tag says which).
    ///
    /// # Safety
    /// `ptr` must be a live small block of this heap.
    #[inline]
    unsafe fn small_heap_holding(&self, ptr: *mut u8, class: usize) -> &SmallHeap {
        // A pointer outside the live small-block segments is reported before its segment's
        // tag word is read (the map costs two loads; this is not the thread caches' path).
        if addr_map::kind_of(ptr.addr()) != addr_map::SMALL {
            small::report_bad_free(ptr, class);
        }
        // SAFETY: the segment is live (the map says so), so its first word is mapped.
        let tag = unsafe { small::segment_tag(ptr) };
        if tag == 0 {
            return &self.small;
        }
        match self.tagged.get(tag) {
            Some(heap) => heap,
            None => crate::fatal::fatal!(
                "not a block of this heap: free of {:#x}: its segment says tag {}, which has no \
                 heap",
                ptr.addr(),
                tag
            ),
        }
    }

    /// Takes every lock of the small-block sides, every tag's (before `fork()`): no heap
    /// is made while they are held.
    ///
    /// # Safety
    /// Must be paired with [`unlock_small_heaps`](Self::unlock_small_heaps) on the same
    /// thread (or in the child it forks), with no guard of these locks alive in between.
    pub(crate) unsafe fn lock_small_heaps(&self) {
        // SAFETY: forwarded; each lock is released by `unlock_small_heaps`. The heaps to lock
        // cannot change once `making` is held.
        unsafe {
            self.tagged.lock_making();
            self.for_each_small_heap(|heap| heap.lock_all());
        }
    }

    /// Releases what [`lock_small_heaps`](Self::lock_small_heaps) took.
    ///
    /// # Safety
    /// Only after `lock_small_heaps`, with no guards alive.
    pub(crate) unsafe fn unlock_small_heaps(&self) {
        // SAFETY: forwarded from the caller.
        unsafe {
            self.for_each_small_heap(|heap| heap.unlock_all());
            self.tagged.unlock_making();
        }
    }

    /// Calls `f` with the small-block side of every tag in use (tag 0 first).
    pub(crate) fn for_each_small_heap(&self, mut f: impl FnMut(&SmallHeap)) {
        f(&self.small);
        self.tagged.for_each(f);
    }

    /// The large-block side, for the global allocator's own realloc path.
    pub(crate) fn large_heap(&self) -> &LargeHeap {
        &self.large
    }

    /// The page source this heap draws from.
    pub fn source(&self) -> &S {
        &self.source
    }

    /// Allocates a block for `layout`; `None` when the page source is out of memory or the
    /// request cannot be represented. A zero-size request gets a real, unique block.
    #[inline]
    pub fn allocate(&self, layout: Layout) -> Option<Allocation> {
        self.allocate_tagged(layout, 0)
    }

    /// Allocates a block for `layout` that carries `tag` (below [`MAX_TAGS`]): a small one
    /// from segments of that tag, a large one with the tag in its header. [`tag_of`]
    /// reads it back from the block. `None` when out of memory or `tag` is out of range.
    ///
    /// [`tag_of`]: Self::tag_of
    pub fn allocate_tagged(&self, layout: Layout, tag: Tag) -> Option<Allocation> {
        if let Some(class) = class_for(layout.size(), layout.align()) {
            let small = self.small_heap_of(tag)?;
            let ptr = NonNull::new(small.allocate(class, &self.source))?;
            return Some(Allocation {
                ptr,
                size: class_size(class),
            });
        }
        if usize::from(tag) >= MAX_TAGS {
            return None;
        }
        let grant = self.large.allocate(
            layout.size(),
            layout.align(),
            tag,
            &self.source,
            self.stamp(),
        )?;
        self.after_slow_path();
        Some(Allocation {
            // SAFETY: a grant's pointer is never null.
            ptr: unsafe { NonNull::new_unchecked(grant.ptr) },
            size: grant.size,
        })
    }

    /// Like [`allocate`](Self::allocate), with the whole block zeroed. Memory known to be
    /// fresh from the page source is not written again.
    pub fn allocate_zeroed(&self, layout: Layout) -> Option<Allocation> {
        if let Some(class) = class_for(layout.size(), layout.align()) {
            let ptr = NonNull::new(self.small.allocate(class, &self.source))?;
            let size = class_size(class);
            // SAFETY: the slot is ours and `size` bytes long.
            unsafe { ptr.as_ptr().write_bytes(0, size) };
            return Some(Allocation { ptr, size });
        }
        let grant =
            self.large
                .allocate(layout.size(), layout.align(), 0, &self.source, self.stamp())?;
        self.after_slow_path();
        // SAFETY: the block is ours; past `dirty_prefix` it already reads as zero.
        unsafe { grant.ptr.write_bytes(0, grant.dirty_prefix) };
        Some(Allocation {
            // SAFETY: a grant's pointer is never null.
            ptr: unsafe { NonNull::new_unchecked(grant.ptr) },
            size: grant.size,
        })
    }

    /// Frees a block.
    ///
    /// # Safety
    /// `ptr` must have been returned by this heap for a layout with the same alignment as
    /// `layout`, and a size between the one requested and the one granted, and must not
    /// have been freed since. Wrong and double frees that can be detected cheaply abort the
    /// process with a message (more of them in debug builds or with feature `checked`).
    #[inline]
    pub unsafe fn deallocate(&self, ptr: NonNull<u8>, layout: Layout) {
        if let Some(class) = class_for(layout.size(), layout.align()) {
            // SAFETY: forwarded from the caller: a live small block, whose segment says
            // which tag's heap it belongs to.
            unsafe {
                self.small_heap_holding(ptr.as_ptr(), class)
                    .free(ptr.as_ptr(), class, self.stamp())
            };
        } else {
            // SAFETY: forwarded from the caller.
            unsafe {
                self.large.free(
                    ptr.as_ptr(),
                    &self.source,
                    self.stamp(),
                    self.retain_empty(),
                )
            };
        }
    }

    /// Resizes a block to `new_size` bytes, keeping its alignment and contents (up to the
    /// smaller size). In place when possible; otherwise a new block is allocated, the
    /// contents copied, and the old block freed. `None` leaves the old block untouched.
    ///
    /// # Safety
    /// As for [`deallocate`](Self::deallocate); `new_size` rounded up to the alignment must
    /// not exceed `isize::MAX`.
    pub unsafe fn reallocate(
        &self,
        ptr: NonNull<u8>,
        layout: Layout,
        new_size: usize,
    ) -> Option<Allocation> {
        let align = layout.align();
        let old_class = class_for(layout.size(), align);
        let new_class = class_for(new_size, align);
        match (old_class, new_class) {
            (Some(a), Some(b)) if a == b => {
                return Some(Allocation {
                    ptr,
                    size: class_size(a),
                });
            }
            (None, None) => {
                // SAFETY: `ptr` is a live large block with this alignment.
                if let Some((p, size)) = unsafe {
                    self.large
                        .resize(ptr.as_ptr(), new_size, align, &self.source, self.stamp())
                } {
                    return Some(Allocation {
                        // SAFETY: resize never returns null.
                        ptr: unsafe { NonNull::new_unchecked(p) },
                        size,
                    });
                }
            }
            _ => {}
        }
        let new_layout = Layout::from_size_align(new_size, align).ok()?;
        // SAFETY: forwarded from the caller: a live block of this heap.
        let new = self.allocate_tagged(new_layout, unsafe { self.tag_of(ptr, layout) })?;
        // SAFETY: both blocks are live and distinct; the old one holds at least
        // `layout.size()` bytes and the new one at least `new_size`.
        unsafe {
            core::ptr::copy_nonoverlapping(
                ptr.as_ptr(),
                new.ptr.as_ptr(),
                layout.size().min(new_size),
            );
            self.deallocate(ptr, layout);
        }
        Some(new)
    }

    /// The tag a live block was allocated with (see [`allocate_tagged`]); a reallocation
    /// keeps it.
    ///
    /// [`allocate_tagged`]: Self::allocate_tagged
    ///
    /// # Safety
    /// `ptr` must be a live block of this heap allocated with `layout` (or a size between
    /// the one requested and the one granted, at the same alignment).
    #[inline]
    pub unsafe fn tag_of(&self, ptr: NonNull<u8>, layout: Layout) -> Tag {
        // SAFETY: forwarded from the caller; the layout says which side the block is on.
        unsafe {
            match class_for(layout.size(), layout.align()) {
                Some(_) => small::segment_tag(ptr.as_ptr()),
                None => LargeHeap::tag_of(ptr.as_ptr()),
            }
        }
    }

    /// The bytes usable in a live block (its class or block size).
    ///
    /// # Safety
    /// `ptr` must be a live block of this heap allocated with `layout`.
    pub unsafe fn usable_size(&self, ptr: NonNull<u8>, layout: Layout) -> usize {
        match class_for(layout.size(), layout.align()) {
            Some(class) => class_size(class),
            // SAFETY: forwarded from the caller.
            None => unsafe { LargeHeap::usable_size(ptr.as_ptr()) },
        }
    }

    /// Sets how long free memory stays mapped before it goes back to the page source:
    /// `Some(d)` returns memory idle for at least `d` (checked on the allocator's slow paths,
    /// so an idle program keeps what it has until its next call or `garbage_collect`);
    /// `Some(Duration::ZERO)` returns it as soon as possible; `None` only on
    /// `garbage_collect`. A new heap starts with `None`.
    pub fn set_purge_delay(&self, delay: Option<core::time::Duration>) {
        let ms = delay.map_or(purge::NEVER, |d| {
            u64::try_from(d.as_millis()).unwrap_or(purge::NEVER - 1)
        });
        self.clock.set_delay_ms(ms);
    }

    /// Chooses when the heaps' new mappings ask for transparent huge pages (for every heap in
    /// the process: the setting is global; see [`OsAllocator::set_huge_pages`]).
    pub fn set_huge_pages(mode: crate::config::HugePages) {
        crate::os::OsAllocator::set_huge_pages(mode);
    }

    /// The delay set with [`set_purge_delay`](Self::set_purge_delay).
    pub fn purge_delay(&self) -> Option<core::time::Duration> {
        let ms = self.clock.delay_ms();
        (ms != purge::NEVER).then(|| core::time::Duration::from_millis(ms))
    }

    /// Returns what can be returned to the page source: empty small pages and segments,
    /// empty chunks, and the pages inside large free blocks. Safe to call at any time from
    /// any thread; other threads keep allocating meanwhile.
    pub fn garbage_collect(&self) {
        self.purge(Cutoff::ALL);
    }

    /// Returns memory idle since before `cut` on both sides.
    fn purge(&self, cut: Cutoff) {
        let stamp = self.clock.stamp();
        self.for_each_small_heap(|small| small.purge(cut, stamp, &self.source));
        self.large.purge(cut, &self.source);
    }

    /// The purge epoch to stamp memory that becomes free now.
    #[inline]
    pub(crate) fn stamp(&self) -> u64 {
        self.clock.stamp()
    }

    /// Whether an empty chunk may be kept for reuse (not when the delay is zero).
    #[inline]
    pub(crate) fn retain_empty(&self) -> bool {
        self.clock.delay_ms() != 0
    }

    /// Counts a slow-path event (a refill, a flush, a large block) and runs a purge pass
    /// when the purge delay says one is due.
    #[inline]
    pub(crate) fn after_slow_path(&self) {
        if let Some(cut) = self.clock.event() {
            self.purge(cut);
        }
    }

    /// A snapshot of the heap's counters. Each side is read under its own locks, so the
    /// figures are exact when no other thread is allocating.
    pub fn stats(&self) -> HphaStats {
        let mut small = self.small.stats();
        self.tagged.for_each(|heap| small.add(&heap.stats()));
        let large = self.large.stats();
        HphaStats {
            granted_bytes: small.granted_bytes + large.granted_bytes,
            live_blocks: small.live_blocks + large.live_blocks,
            allocations: small.allocations + large.allocations,
            frees: small.frees + large.frees,
            held_bytes: small.segments * SEGMENT_SIZE
                + large.chunk_bytes
                + large.direct_mapped_bytes
                + large.direct_cached_bytes,
            small_granted_bytes: small.granted_bytes,
            large_granted_bytes: large.granted_bytes,
            small_pages: small.class_pages,
            free_small_pages: small.free_pages,
            segments: small.segments,
            chunks: large.chunks,
            free_large_blocks: large.free_blocks,
            free_large_bytes: large.free_bytes,
            largest_free_large_block: large.largest_free,
            direct_blocks: large.direct_blocks,
            thread_cached_bytes: 0,
        }
    }

    /// Checks the heap's invariants: the red-black tree (colours, black heights, order),
    /// every chunk's block list (links, no two adjacent free blocks), and the counters.
    /// Takes every lock; meant for tests and debugging.
    pub fn validate(&self) -> Result<(), &'static str> {
        let mut small = Ok(());
        self.for_each_small_heap(|heap| small = small.and(heap.validate()));
        small?;
        self.large.validate()
    }
}

/// Dropping a heap gives every segment and chunk back to its page source, whatever blocks
/// are still live in them (they become dangling, as with any arena). Blocks that had a
/// mapping of their own (16 MiB and up, or aligned beyond what chunks serve) and are still
/// live stay mapped: the heap keeps no list of them, and they are the owner's leak.
impl<S: PageSource> Drop for HphaSchema<S> {
    fn drop(&mut self) {
        self.small.release_all(&self.source);
        self.tagged.release_all(&self.source);
        self.large.release_all(&self.source);
    }
}

#[cfg(test)]
mod tests;
