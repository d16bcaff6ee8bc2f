//! Small blocks: size-class pages carved from 2 MiB segments.
//!
//! A page is 64 KiB, aligned to 64 KiB. Slots are carved from the page's end (see
//! `size_class`), handed out first from a LIFO free list threaded through freed slots, then
//! from a bump pointer over never-used slots so untouched memory stays untouched.
//!
//! Pages come from 2 MiB segments mapped from the page source. The first page of a segment
//! holds no slots: it holds the [`PageHeader`]s of the segment's pages side by side (the
//! first one doubling as the segment's bookkeeping), so the header of any small block is
//! found from its address with a shift and two masks ([`page_of`]). Headers inside their
//! pages would all sit at 64 KiB-aligned addresses, which share a handful of sets in every
//! cache level: with a few hundred pages in use, freeing into random pages missed the L2
//! on nearly every header (mimalloc v3 keeps its page metadata apart for the same reason).
//! Side by side, a segment's headers fill consecutive lines, and the array starts at one of
//! 8 offsets in the first page ([`SEGMENT_COLOURS`]), chosen by the segment's address, so
//! the arrays of different segments fall into different sets too.
//!
//! **Tags.** Every segment belongs to one *tag* (an owner id; 0 is the heap's own), written
//! in the segment's first word, below its header array: [`segment_tag`] reads it from any
//! block's address with a mask and one load. A [`SmallHeap`] serves one tag and maps its own
//! segments, so a block's tag is fixed by where it lies and comes back on free without a
//! per-block header or side table (the global allocator's scoped tags rely on it).
//!
//! A page that becomes empty goes back to a shared pool (unless it is its class's last
//! page) and can serve any class next. `garbage_collect` unmaps whole free segments and purges the bodies of the other free
//! pages.
//!
//! Locking: one lock per class, padded to its own cache line, so different classes never
//! contend; the pool has its own lock, always taken after a class lock.

use super::purge::Cutoff;
use super::size_class::{CLASS_COUNT, class_size};
use crate::fatal::fatal;
use crate::os::PageSource;
use crate::sync::SpinLock;
use core::ptr::null_mut;
use core::sync::atomic::{AtomicPtr, AtomicU8, AtomicU64, Ordering::*};

/// Bytes per small-block page; also the alignment used to find a page header.
pub const PAGE_SIZE: usize = 64 * 1024;
/// Bytes per segment, the unit mapped from the page source.
pub const SEGMENT_SIZE: usize = 2 * 1024 * 1024;
const PAGES_PER_SEGMENT: usize = SEGMENT_SIZE / PAGE_SIZE;
/// Bytes reserved for each page's header in its segment's header array.
const HEADER_STRIDE: usize = 128;
/// Bytes of one segment's header array.
const HEADER_ARRAY: usize = PAGES_PER_SEGMENT * HEADER_STRIDE;
/// Offsets at which a segment's header array may start in its first page: slots of
/// [`HEADER_ARRAY`] bytes past the first, which holds the segment's tag. The first page
/// has room for 15, but a power of two makes the colour a mask of address bits ([`page_of`]
/// is a shift, two masks and two adds; `% 15` took a multiply and several instructions more:
/// 0.6% of the instructions of the `collections` and `shortlived` comparison workloads),
/// and 8 colours still spread the arrays of 8 × (cache ways) segments over distinct sets.
const SEGMENT_COLOURS: usize = 8;
/// What a block's address is divided by so that its page index (address bits of
/// `PAGE_SIZE..SEGMENT_SIZE`) lands at its header's offset in the array, and its
/// segment's colour (the bits above) at its array's offset in the first page: the two
/// ratios are the same, since a page's header is to the array what the page is to the
/// segment.
const HEADER_SHIFT_DIVISOR: usize = PAGE_SIZE / HEADER_STRIDE;
/// The bits of `address / HEADER_SHIFT_DIVISOR` that hold the page index and the colour.
const HEADER_OFFSET_MASK: usize = (SEGMENT_COLOURS * HEADER_ARRAY - 1) & !(HEADER_STRIDE - 1);
const _: () = assert!(core::mem::size_of::<PageHeader>() <= HEADER_STRIDE);
const _: () = assert!(HEADER_STRIDE.is_power_of_two() && HEADER_ARRAY.is_power_of_two());
const _: () = assert!(SEGMENT_COLOURS.is_power_of_two());
const _: () = assert!((SEGMENT_COLOURS + 1) * HEADER_ARRAY <= PAGE_SIZE);
const _: () = assert!(SEGMENT_SIZE / HEADER_ARRAY == HEADER_SHIFT_DIVISOR);

/// Whether double frees and foreign frees of small blocks are checked with a bitmap.
pub(crate) const CHECKED: bool = cfg!(any(debug_assertions, feature = "checked"));
/// Whether builds without [`CHECKED`] compare a small free's layout class with the block's
/// class on the thread caches' fast path (feature `class-check`). Off by default: it adds
/// 16 instructions to an 84-instruction alloc+free pair and 6-7% CPU time to the `small`
/// comparison workload (docs/misuse.md), above the 1% the default build may spend on it.
/// Frees that reach the heap itself (bin flushes, `HphaSchema::deallocate`) always check.
pub(crate) const CLASS_CHECK: bool = cfg!(feature = "class-check");
/// Words of the per-page "slot is live" bitmap (one bit per slot of the smallest class).
/// Words a bitmap with one bit per slot of the smallest class needs.
const FULL_BITMAP_WORDS: usize = PAGE_SIZE / 8 / 64;
/// Checked builds keep two bitmaps at each page's start: "slot is live", then "slot was
/// freed and filled with [`FREED_FILL`]" (verified when the slot is handed out again).
const BITMAP_WORDS: usize = if CHECKED { 2 * FULL_BITMAP_WORDS } else { 0 };
/// Where the "freed and filled" bitmap starts, in words from the page's start.
const FILLED_WORDS_AT: usize = FULL_BITMAP_WORDS;
/// What checked builds fill a freed small block with, past its first word (the free-list
/// link): a write after free shows as a byte that differs when the slot is handed out again.
pub(crate) const FREED_FILL: u8 = 0xdd;

/// Where a segment keeps its class line, in its first (tag) line: a marker word at
/// [`SEG_MARKER_AT`] (`SEG_MAGIC ^ segment address` once mapped) and one byte per page at
/// [`SEG_CLASSES_AT`] (the page's class + 1 while it serves one, else 0). Every free reads
/// the two to check that the layout's class is the block's class: one cache line per 2 MiB
/// segment, which the tag test of scoped frees reads anyway, and a handful of instructions
/// (a page header is a line per page, and finding it takes a multiply).
const SEG_MARKER_AT: usize = 8;
const SEG_CLASSES_AT: usize = 32;
const SEG_MAGIC: usize = 0x5e6d_c1a5_5c1a_55e5;
const _: () = assert!(SEG_CLASSES_AT + PAGES_PER_SEGMENT <= 64 && SEG_MARKER_AT >= 2);

/// The class byte of the page holding `ptr`, in its segment's class line.
#[inline(always)]
fn class_byte<'a>(ptr: *mut u8) -> &'a AtomicU8 {
    let seg = ptr.map_addr(|a| a & !(SEGMENT_SIZE - 1));
    let index = (ptr.addr() % SEGMENT_SIZE) / PAGE_SIZE;
    // SAFETY: callers pass pointers into live small-block segments (or, in `check_free`,
    // into some mapped 2 MiB region); the byte lies in the segment's first line.
    unsafe { &*seg.add(SEG_CLASSES_AT + index).cast::<AtomicU8>() }
}

/// `page.class` of a page that belongs to no class (in the pool).
const NO_CLASS: u16 = u16::MAX;
/// Mixed with a page's address to form its marker, which tells a live class page from
/// anything else at a 64 KiB boundary.
const PAGE_MAGIC: usize = 0x7a67_a110_c5a9_e5e1;

/// A free slot's link in its page's free list.
pub(crate) struct FreeSlot {
    pub(crate) next: *mut FreeSlot,
}

/// The header of a small-block page, in its segment's header array (see the module docs).
/// The fields a refill and a free touch come first, in one cache line.
#[repr(C, align(64))]
pub(crate) struct PageHeader {
    /// `PAGE_MAGIC ^ address` while the page serves a class; 0 otherwise.
    marker: usize,
    /// LIFO list of freed slots.
    free: *mut FreeSlot,
    /// Next never-used slot; slots from here to the page end were never handed out.
    bump: *mut u8,
    /// Links in the class's partial list, or in the pool's free list.
    next: *mut PageHeader,
    prev: *mut PageHeader,
    /// Slots in `free`.
    free_count: u32,
    /// Slots handed out and not yet freed.
    used: u32,
    /// Slots in the page for its class.
    capacity: u32,
    /// Element size of the class, cached.
    elem: u32,
    /// Size class, or `NO_CLASS`.
    class: u16,
    /// Whether the page is linked in its class's partial list.
    in_partial: bool,
    /// Whether the page body was purged since it last served a class.
    purged: bool,
    /// Purge epoch at which the page last became empty.
    idle_since: u64,
    // Segment bookkeeping: meaningful only in the first header of a segment.
    seg_next: *mut PageHeader,
    seg_prev: *mut PageHeader,
    /// Pages of this segment handed to classes.
    seg_used: u32,
    /// Pages of this segment carved so far, the header page included (the rest were never
    /// touched).
    seg_carved: u32,
    /// Purge epoch at which the last page of this segment went back to the pool.
    seg_idle_since: u64,
}

/// Bytes at the start of each page that hold no slots: the bitmaps of checked builds.
const LIVE_SPACE: usize = BITMAP_WORDS * 8;
const _: () = assert!((PAGE_SIZE - LIVE_SPACE) / 8 <= FULL_BITMAP_WORDS * 64);

#[inline]
fn page_marker(page: *mut PageHeader) -> usize {
    PAGE_MAGIC ^ page.addr()
}

/// Where the header array of the segment at `seg` (a segment-aligned address) starts: past
/// the first [`HEADER_ARRAY`] bytes, which hold the segment's tag. The plain definition,
/// which [`page_of`] computes with one shift; the tests hold the two together.
#[cfg(test)]
const fn header_array(seg: usize) -> usize {
    seg + (1 + (seg / SEGMENT_SIZE) % SEGMENT_COLOURS) * HEADER_ARRAY
}

/// An owner id of small-block segments (see the module docs); 0 is the heap's own.
pub type Tag = u16;

/// The tag of the segment holding the small block `ptr`: the first word of its segment.
///
/// # Safety
/// `ptr` must point into a live small block of some [`SmallHeap`] (its segment is mapped
/// and its tag word was written before the block was handed out, and never changes while
/// the block lives).
#[inline(always)]
pub(crate) unsafe fn segment_tag(ptr: *const u8) -> Tag {
    // SAFETY: forwarded from the caller: the segment's first word is mapped and stable.
    unsafe { *ptr.map_addr(|a| a & !(SEGMENT_SIZE - 1)).cast::<Tag>() }
}

/// The header of the page holding a small block (or of the page at any address inside a
/// segment).
#[inline]
pub(crate) fn page_of(ptr: *mut u8) -> *mut PageHeader {
    // `header_array(seg) + index * HEADER_STRIDE` with the colour's and the index's bits
    // moved into place by one shift (the unit test checks the two agree).
    ptr.map_addr(|a| {
        (a & !(SEGMENT_SIZE - 1)) + HEADER_ARRAY + ((a / HEADER_SHIFT_DIVISOR) & HEADER_OFFSET_MASK)
    })
    .cast()
}

/// The memory of the page whose header is `page`.
#[inline]
fn page_base(page: *mut PageHeader) -> *mut u8 {
    page.map_addr(|a| {
        let index = (a % HEADER_ARRAY) / HEADER_STRIDE;
        (a & !(SEGMENT_SIZE - 1)) + index * PAGE_SIZE
    })
    .cast()
}

/// The first header of the segment of `page`, which holds the segment's bookkeeping.
#[inline]
fn segment_of(page: *mut PageHeader) -> *mut PageHeader {
    page.map_addr(|a| a & !(HEADER_ARRAY - 1))
}

/// Word `w` of the "slot is live" bitmap of `page` (checked builds), at the page's start.
///
/// # Safety
/// `page` must be the header of a page serving a class; `w < BITMAP_WORDS`.
#[inline]
unsafe fn live_word<'a>(page: *mut PageHeader, w: usize) -> &'a AtomicU64 {
    // SAFETY: the first `LIVE_SPACE` bytes of a class page hold the bitmap, never slots;
    // the page is mapped while it serves a class.
    unsafe { &*page_base(page).cast::<AtomicU64>().add(w) }
}

/// Slots per depot batch (see [`Depot`]): the first refill of a bin of a class served by
/// the depot takes 4, the next 8, so a refill rarely takes more than it asked for.
const DEPOT_BATCH: usize = 8;
/// Batches a class's depot holds at most.
const DEPOT_BATCHES: usize = 32;
/// Bytes a class's depot holds at most: what it keeps from the pages (and so from other
/// classes and from purging) is bounded like one more thread cache's bin.
const DEPOT_BYTES: usize = 32 * 1024;
/// Classes whose blocks are at most this big have a depot: bigger classes have bins of a
/// few blocks, which a depot batch would overfill.
const DEPOT_MAX_BLOCK: usize = 512;

/// Classes with a depot: the first ones, up to blocks of [`DEPOT_MAX_BLOCK`] bytes.
const DEPOT_CLASSES: usize = {
    let mut n = 0;
    while n < CLASS_COUNT && class_size(n) <= DEPOT_MAX_BLOCK {
        n += 1;
    }
    n
};

/// How many batches the depot of `class` may hold (0: no depot).
const fn depot_capacity(class: usize) -> usize {
    let size = class_size(class);
    if size > DEPOT_MAX_BLOCK {
        return 0;
    }
    let n = DEPOT_BYTES / (size * DEPOT_BATCH);
    if n > DEPOT_BATCHES { DEPOT_BATCHES } else { n }
}

/// A batch of [`DEPOT_BATCH`] free slots, linked through their first word (the last one's
/// link is null), with its last slot so that batches join without walking them.
#[derive(Clone, Copy)]
struct Batch {
    head: *mut FreeSlot,
    tail: *mut FreeSlot,
    /// Purge epoch at which the batch came in: a purge gives back batches idle since
    /// before its cut, as it does pages.
    since: u64,
}

/// A class's *transfer depot*: batches of slots that thread caches gave back, kept linked
/// as they came instead of being threaded back into their pages one by one, for the next
/// refill of the class to take whole. A refill from pages walks each page's free list, one
/// dependent load per slot, and those slots were usually freed on another core (a thread
/// handing its survivors to another, a short-lived thread's blocks): each load a cache
/// miss, in a row, under the class lock. A batch is taken with a few stores and its slots
/// are touched later, by the program using them. tcmalloc's transfer cache and snmalloc's
/// remote batches do the same between thread caches and the central lists.
///
/// Slots in the depot are free for the class's counts (`live_blocks`) but still in use for
/// their pages (`PageHeader::used`), so a page with a slot in the depot never goes back to
/// the pool; the depot is small ([`DEPOT_BYTES`]) and a purge empties what has rested past
/// its cut (`garbage_collect` all of it). Every slot is checked against its page before it
/// enters (the check the page's own free list does), so a block freed with a wrong layout
/// is still caught where a bin gives it back.
///
/// A depot's batches are counted by its class state's `depot_len`, and kept apart from
/// the class states, in a mapping of their own made at a heap's first refill
/// ([`SmallHeap::depots`]): a depot is 768 bytes and a class state one line, so a heap
/// whose classes hold a few blocks (a scoped tag's) stays a few lines, packed with other
/// tags' heaps, and only the depots in use become resident.
type Depot = [Batch; DEPOT_BATCHES];

/// The depots of a heap's classes that have one.
type Depots = [Depot; DEPOT_CLASSES];

/// Per-class state, guarded by the class lock.
pub(crate) struct ClassState {
    /// Pages with at least one free slot (doubly linked through `next`/`prev`).
    partial: *mut PageHeader,
    partial_count: usize,
    /// Pages serving this class (partial or full).
    pages: usize,
    live_blocks: usize,
    allocations: u64,
    frees: u64,
    /// Batches in the class's depot (see [`Depot`]).
    depot_len: usize,
}

impl ClassState {
    const fn new() -> Self {
        Self {
            partial: null_mut(),
            partial_count: 0,
            pages: 0,
            live_blocks: 0,
            allocations: 0,
            frees: 0,
            depot_len: 0,
        }
    }

    /// # Safety
    /// `page` must be a valid page header of this class, not in the list.
    unsafe fn push_partial(&mut self, page: *mut PageHeader) {
        // SAFETY: `page` and the current head are valid headers (class lock held).
        unsafe {
            (*page).prev = null_mut();
            (*page).next = self.partial;
            if !self.partial.is_null() {
                (*self.partial).prev = page;
            }
            (*page).in_partial = true;
        }
        self.partial = page;
        self.partial_count += 1;
    }

    /// # Safety
    /// `page` must be a valid page header in this class's partial list.
    unsafe fn unlink_partial(&mut self, page: *mut PageHeader) {
        // SAFETY: `page` and its neighbours are valid headers (class lock held).
        unsafe {
            let (prev, next) = ((*page).prev, (*page).next);
            if prev.is_null() {
                self.partial = next;
            } else {
                (*prev).next = next;
            }
            if !next.is_null() {
                (*next).prev = prev;
            }
            (*page).in_partial = false;
        }
        self.partial_count -= 1;
    }
}

// SAFETY: the raw pointers refer to pages owned by the heap; access is serialised by the
// class lock that wraps this state.
unsafe impl Send for ClassState {}

/// The pool of pages that serve no class, and the list of segments.
struct PagePool {
    /// Free pages (doubly linked through `next`/`prev`).
    free: *mut PageHeader,
    free_count: usize,
    /// Segment whose pages are still being carved, and how many it has left.
    cursor: *mut PageHeader,
    /// All segments (linked through `seg_next`/`seg_prev` of their first page).
    segments: *mut PageHeader,
    segment_count: usize,
    /// The tag written into every segment this pool maps.
    tag: Tag,
}

// SAFETY: as for `ClassState`: pointers into heap-owned segments, guarded by the pool lock.
unsafe impl Send for PagePool {}

impl PagePool {
    const fn new(tag: Tag) -> Self {
        Self {
            free: null_mut(),
            free_count: 0,
            cursor: null_mut(),
            segments: null_mut(),
            segment_count: 0,
            tag,
        }
    }

    unsafe fn push_free(&mut self, page: *mut PageHeader) {
        // SAFETY: valid headers, pool lock held.
        unsafe {
            (*page).prev = null_mut();
            (*page).next = self.free;
            if !self.free.is_null() {
                (*self.free).prev = page;
            }
        }
        self.free = page;
        self.free_count += 1;
    }

    unsafe fn unlink_free(&mut self, page: *mut PageHeader) {
        // SAFETY: valid headers in the free list, pool lock held.
        unsafe {
            let (prev, next) = ((*page).prev, (*page).next);
            if prev.is_null() {
                self.free = next;
            } else {
                (*prev).next = next;
            }
            if !next.is_null() {
                (*next).prev = prev;
            }
        }
        self.free_count -= 1;
    }

    /// A page for a class: a pooled one, a fresh one from the current segment, or one from a
    /// newly mapped segment. Null when the source is out of memory.
    fn take_page(&mut self, source: &impl PageSource) -> *mut PageHeader {
        // SAFETY: every header reached is in a live segment owned by this pool.
        unsafe {
            if !self.free.is_null() {
                let page = self.free;
                self.unlink_free(page);
                (*segment_of(page)).seg_used += 1;
                return page;
            }
            if self.cursor.is_null() {
                let base = source.map(SEGMENT_SIZE, SEGMENT_SIZE, 0);
                if base.is_null() {
                    return null_mut();
                }
                super::addr_map::note_segment(base);
                source.hint_huge_pages(base, SEGMENT_SIZE, self.segment_count * SEGMENT_SIZE);
                // Before any block of the segment exists (fresh mappings read as zero, the
                // heap's own tag).
                if self.tag != 0 {
                    base.cast::<Tag>().write(self.tag);
                }
                base.add(SEG_MARKER_AT)
                    .cast::<usize>()
                    .write(SEG_MAGIC ^ base.addr());
                let seg = page_of(base);
                // Fresh mappings read as zero, so only the non-zero fields need writing. The
                // first page holds the headers.
                (*seg).seg_carved = 1;
                (*seg).seg_next = self.segments;
                if !self.segments.is_null() {
                    (*self.segments).seg_prev = seg;
                }
                self.segments = seg;
                self.segment_count += 1;
                self.cursor = seg;
            }
            let seg = self.cursor;
            let page: *mut PageHeader = seg.byte_add((*seg).seg_carved as usize * HEADER_STRIDE);
            (*seg).seg_carved += 1;
            (*seg).seg_used += 1;
            if (*seg).seg_carved as usize == PAGES_PER_SEGMENT {
                self.cursor = null_mut();
            }
            (*page).class = NO_CLASS;
            page
        }
    }

    /// Takes back an empty page, stamped with the purge epoch `stamp`.
    unsafe fn return_page(&mut self, page: *mut PageHeader, stamp: u64) {
        // SAFETY: `page` is a valid empty header of a live segment; pool lock held.
        unsafe {
            (*page).marker = 0;
            (*page).class = NO_CLASS;
            class_byte(page_base(page)).store(0, Relaxed);
            (*page).idle_since = stamp;
            let seg = segment_of(page);
            (*seg).seg_used -= 1;
            if (*seg).seg_used == 0 {
                (*seg).seg_idle_since = stamp;
            }
            self.push_free(page);
        }
    }

    /// Unmaps segments with no page in use and purges the bodies of other free pages, if
    /// they have been idle since before `cut`.
    fn collect(&mut self, cut: Cutoff, source: &impl PageSource) {
        let granule = source.granularity();
        // SAFETY: all headers reached are in live segments owned by this pool; a segment is
        // unmapped only after all its pages have been unlinked from the free list.
        unsafe {
            let mut seg = self.segments;
            while !seg.is_null() {
                let next_seg = (*seg).seg_next;
                if (*seg).seg_used == 0 && cut.covers((*seg).seg_idle_since) {
                    for i in 1..(*seg).seg_carved as usize {
                        self.unlink_free(seg.byte_add(i * HEADER_STRIDE));
                    }
                    if self.cursor == seg {
                        self.cursor = null_mut();
                    }
                    let (prev, next) = ((*seg).seg_prev, (*seg).seg_next);
                    if prev.is_null() {
                        self.segments = next;
                    } else {
                        (*prev).seg_next = next;
                    }
                    if !next.is_null() {
                        (*next).seg_prev = prev;
                    }
                    self.segment_count -= 1;
                    super::addr_map::note_segment_gone(page_base(seg));
                    source.unmap(page_base(seg), SEGMENT_SIZE);
                }
                seg = next_seg;
            }
            // Purge the remaining free pages (their headers live apart; a page's bitmap is
            // cleared when it next serves a class).
            let whole = PAGE_SIZE % granule == 0;
            let mut page = self.free;
            while !page.is_null() {
                if !(*page).purged && whole && cut.covers((*page).idle_since) {
                    (*page).purged = source.purge(page_base(page), PAGE_SIZE);
                }
                page = (*page).next;
            }
        }
    }

    /// Unmaps every segment (the heap is being dropped).
    fn release_all(&mut self, source: &impl PageSource) {
        // SAFETY: each segment is a live mapping of SEGMENT_SIZE from `source`.
        unsafe {
            let mut seg = self.segments;
            while !seg.is_null() {
                let next = (*seg).seg_next;
                super::addr_map::note_segment_gone(page_base(seg));
                source.unmap(page_base(seg), SEGMENT_SIZE);
                seg = next;
            }
        }
        *self = Self::new(self.tag);
    }
}

/// A class lock on its own cache line, so classes do not false-share.
#[repr(align(64))]
struct PaddedClass(SpinLock<ClassState>);

/// Counters of the small-block side, summed over classes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct SmallStats {
    pub granted_bytes: usize,
    pub live_blocks: usize,
    pub allocations: u64,
    pub frees: u64,
    pub class_pages: usize,
    pub free_pages: usize,
    pub segments: usize,
}

impl SmallStats {
    /// Adds another heap's counters (for a total over tags).
    pub(crate) fn add(&mut self, other: &SmallStats) {
        self.granted_bytes += other.granted_bytes;
        self.live_blocks += other.live_blocks;
        self.allocations += other.allocations;
        self.frees += other.frees;
        self.class_pages += other.class_pages;
        self.free_pages += other.free_pages;
        self.segments += other.segments;
    }
}

/// The small-block heap of one tag: per-class page lists and the page pool, on segments
/// of its own.
pub(crate) struct SmallHeap {
    classes: [PaddedClass; CLASS_COUNT],
    pool: SpinLock<PagePool>,
    /// The tag of this heap's segments (checked builds ask every returned slot for it).
    tag: Tag,
    /// The depots of the classes that have one (each guarded by its class's lock): null
    /// until the heap's first refill of such a class maps them (zeroed: every depot empty).
    depots: AtomicPtr<Depots>,
}

impl SmallHeap {
    /// The heap of tag 0.
    pub(crate) const fn new() -> Self {
        Self::with_tag(0)
    }

    /// Makes a heap of `tag` in zeroed memory by writing only its fields that are not zero
    /// (the tags). Writing a whole [`with_tag`](Self::with_tag) value there would make every
    /// page of the heap resident, used or not: its class states hold their depots
    /// (about 45 KiB per heap), where a tag that uses a few classes touches a few lines.
    ///
    /// # Safety
    /// `heap` is valid for writes of a `SmallHeap`, aligned, zeroed, and not shared yet.
    pub(crate) unsafe fn init_zeroed(heap: *mut SmallHeap, tag: Tag) {
        // SAFETY: all zeros is a valid `SmallHeap` (null pointers, zero counts, unlocked
        // test-and-set flags, tag 0: what `with_tag(0)` holds, checked by
        // `a_zeroed_heap_made_for_a_tag_is_the_heap_with_that_tag`); the caller owns it.
        unsafe {
            let heap = &mut *heap;
            heap.tag = tag;
            heap.pool.get_mut().tag = tag;
        }
    }

    /// The depot of `class`; `None` for a class without one, or while the heap has not
    /// mapped its depots.
    ///
    /// # Safety
    /// The caller holds the class's lock, and no other reference to the depot is live.
    #[allow(clippy::mut_from_ref)]
    unsafe fn depot(&self, class: usize) -> Option<&mut Depot> {
        let depots = self.depots.load(Acquire);
        // SAFETY: a published mapping of `Depots`, live as long as the heap; the class lock
        // gives one thread at a time each class's depot (caller's contract).
        unsafe { depots.as_mut()?.get_mut(class) }
    }

    /// Maps the heap's depots if they are not yet (out of line: once per heap). Without
    /// them (out of memory) bins give their blocks back to the pages.
    #[cold]
    #[inline(never)]
    fn map_depots(&self, source: &impl PageSource) {
        // A fresh mapping reads as zero: null batches, every depot empty.
        let Some(fresh) = super::tagged::map_zeroed::<Depots>(source) else {
            return;
        };
        if self
            .depots
            .compare_exchange(null_mut(), fresh, Release, Relaxed)
            .is_err()
        {
            // SAFETY: the mapping was just made here and nothing else refers to it.
            unsafe { Self::unmap_depots(fresh, source) };
        }
    }

    /// Gives back a mapping of depots made by [`map_depots`](Self::map_depots).
    ///
    /// # Safety
    /// Nothing refers to `depots` any more.
    unsafe fn unmap_depots(depots: *mut Depots, source: &impl PageSource) {
        let len = super::tagged::mapping_len::<Depots>(source);
        // SAFETY: mapped by `map_zeroed::<Depots>` with this length; unused (the caller's
        // contract).
        unsafe { source.unmap(depots.cast(), len) };
    }

    /// A heap whose segments carry `tag`.
    pub(crate) const fn with_tag(tag: Tag) -> Self {
        Self {
            classes: [const { PaddedClass(SpinLock::new(ClassState::new())) }; CLASS_COUNT],
            pool: SpinLock::new(PagePool::new(tag)),
            tag,
            depots: AtomicPtr::new(null_mut()),
        }
    }

    /// Prepares a pool page to serve `class`.
    ///
    /// # Safety
    /// `page` must be a page taken from the pool, owned by the caller.
    unsafe fn format_page(page: *mut PageHeader, class: usize) {
        let elem = class_size(class);
        let capacity = (PAGE_SIZE - LIVE_SPACE) / elem;
        // SAFETY: the page is ours and mapped for PAGE_SIZE bytes.
        unsafe {
            (*page).marker = page_marker(page);
            class_byte(page_base(page)).store(class as u8 + 1, Relaxed);
            (*page).free = null_mut();
            (*page).free_count = 0;
            (*page).bump = page_base(page).add(PAGE_SIZE - capacity * elem);
            (*page).class = class as u16;
            (*page).in_partial = false;
            (*page).purged = false;
            (*page).used = 0;
            (*page).capacity = capacity as u32;
            (*page).elem = elem as u32;
            for w in 0..BITMAP_WORDS {
                live_word(page, w).store(0, Relaxed);
            }
        }
    }

    /// Takes a page from the pool into `class`'s partial list; false when out of memory.
    #[cold]
    fn add_page(&self, st: &mut ClassState, class: usize, source: &impl PageSource) -> bool {
        let page = self.pool.lock().take_page(source);
        if page.is_null() {
            return false;
        }
        // SAFETY: the page was just taken from the pool and is ours; class lock held.
        unsafe {
            Self::format_page(page, class);
            st.push_partial(page);
        }
        st.pages += 1;
        true
    }

    /// Hands out slots of `class`, linked through their first word: up to `max` fresh or
    /// freed slots, or (when `max > 1`) a page's whole free list of up to `splice` slots
    /// (`splice` ≥ what is still wanted), handed over without walking it. Returns the list
    /// head and how many slots it holds (0 when the source is out of memory).
    pub(crate) fn take_slots(
        &self,
        class: usize,
        max: usize,
        splice: usize,
        source: &impl PageSource,
    ) -> (*mut FreeSlot, usize) {
        let mut st = self.classes[class].0.lock();
        // Slots are linked in the order taken (ascending addresses for fresh slots), so the
        // program receives neighbouring blocks one after another.
        let mut head: *mut FreeSlot = null_mut();
        let mut tail: *mut FreeSlot = null_mut();
        let mut got = 0;
        if max > 1 && splice != usize::MAX && st.depot_len > 0 {
            // Whole batches from the depot, newest first, joined through their last slots;
            // the last batch may take the chain up to a batch past `max`. Only for bins
            // still ramping up (a bounded `splice`): a bin in steady use takes a page's
            // whole free list instead, without walking it either, and leaves the depot to
            // the ramping ones (a producer refilling from the depot the blocks its consumer
            // had just freed ran 11% slower: `prodcons`, medians of 15 paired runs).
            // SAFETY: the class lock is held (`st`); a class with batches has a depot.
            let batches = unsafe { self.depot(class) }.expect("a depot with batches is mapped");
            while got < max && st.depot_len > 0 {
                st.depot_len -= 1;
                let batch = batches[st.depot_len];
                if tail.is_null() {
                    head = batch.head;
                } else {
                    // SAFETY: `tail` is the last slot of a batch taken above, free and ours.
                    unsafe { (*tail).next = batch.head };
                }
                tail = batch.tail;
                got += DEPOT_BATCH;
            }
            st.live_blocks += got;
            st.allocations += got as u64;
            return (head, got);
        }
        // SAFETY: partial pages are valid headers of this class and the class lock is held;
        // a slot is taken only while its page has room.
        unsafe {
            while got < max {
                if st.partial.is_null() && !self.add_page(&mut st, class, source) {
                    break;
                }
                let page = st.partial;
                let elem = (*page).elem as usize;
                let free_count = (*page).free_count as usize;
                if max > 1 && free_count > 0 && free_count <= splice.saturating_sub(got) {
                    // Take the page's whole free list as the chain's last segment, without
                    // touching its slots: they are cold (often freed on another core), and
                    // the program will touch each one when it uses it anyway.
                    if tail.is_null() {
                        head = (*page).free;
                    } else {
                        (*tail).next = (*page).free;
                    }
                    tail = null_mut();
                    (*page).free = null_mut();
                    (*page).free_count = 0;
                    (*page).used += free_count as u32;
                    got += free_count;
                    if (*page).used == (*page).capacity {
                        st.unlink_partial(page);
                    }
                    break;
                }
                while got < max && (*page).used < (*page).capacity {
                    let slot: *mut FreeSlot = if !(*page).free.is_null() {
                        let s = (*page).free;
                        (*page).free = (*s).next;
                        (*page).free_count -= 1;
                        s
                    } else {
                        let s = (*page).bump;
                        (*page).bump = s.add(elem);
                        s.cast()
                    };
                    if tail.is_null() {
                        head = slot;
                    } else {
                        (*tail).next = slot;
                    }
                    tail = slot;
                    got += 1;
                    (*page).used += 1;
                }
                if (*page).used == (*page).capacity {
                    st.unlink_partial(page);
                }
            }
            if !tail.is_null() {
                (*tail).next = null_mut();
            }
        }
        st.live_blocks += got;
        st.allocations += got as u64;
        drop(st);
        if got > 0 && class < DEPOT_CLASSES && self.depots.load(Relaxed).is_null() {
            // The depots, once per heap, for the slots now handed out to come back into:
            // after the refill, so that a source out of memory refuses the refill itself.
            self.map_depots(source);
        }
        (head, got)
    }

    /// Gives back the first `count` slots of `class` of the chain at `head` (linked through
    /// their first word); pages that become empty are stamped with the purge epoch `stamp`.
    /// Returns what followed the last slot given back in the chain (so a thread cache that
    /// gives back the front of a bin learns the bin's new head without walking it first).
    ///
    /// # Safety
    /// Each of the `count` slots must have come from [`SmallHeap::take_slots`] of this heap
    /// and class and be free (nobody uses it); the chain must hold at least `count` slots. A
    /// slot whose page does not match aborts with a message.
    pub(crate) unsafe fn return_slots(
        &self,
        class: usize,
        head: *mut FreeSlot,
        count: usize,
        stamp: u64,
    ) -> *mut FreeSlot {
        let mut st = self.classes[class].0.lock();
        let mut slot = head;
        let mut left = count;
        // Whole batches into the depot while it has room (each slot checked as
        // `return_one` would), the rest into their pages.
        // SAFETY: the class lock is held (`st`), and the depot is used only in this call.
        let batches: &mut [Batch] = match unsafe { self.depot(class) } {
            Some(depot) => depot,
            None => &mut [],
        };
        let room = depot_capacity(class).min(batches.len());
        while left >= DEPOT_BATCH && st.depot_len < room {
            let first = slot;
            let mut last = slot;
            // SAFETY: the slots are free and ours (caller's contract); each is checked
            // against its page before the batch is kept.
            unsafe {
                self.check_returned(last, class);
                for _ in 1..DEPOT_BATCH {
                    last = (*last).next;
                    self.check_returned(last, class);
                }
                slot = (*last).next;
                (*last).next = null_mut();
            }
            batches[st.depot_len] = Batch {
                head: first,
                tail: last,
                since: stamp,
            };
            st.depot_len += 1;
            left -= DEPOT_BATCH;
        }
        for _ in 0..left {
            // SAFETY: the slot is free and ours to relink (caller's contract).
            unsafe {
                let next = (*slot).next;
                self.return_one(&mut st, slot, class, stamp);
                slot = next;
            }
        }
        st.live_blocks -= count;
        st.frees += count as u64;
        slot
    }

    /// The check [`return_one`](Self::return_one) makes of a slot given back: its page
    /// serves `class` (else the free had a wrong layout, or was a double free or a foreign
    /// pointer: aborts naming it), and in checked builds the segment is of this heap's tag.
    ///
    /// # Safety
    /// `slot` was handed out by a small heap (as the caller of `return_slots` promises).
    #[inline(always)]
    unsafe fn check_returned(&self, slot: *mut FreeSlot, class: usize) {
        let page = page_of(slot.cast());
        // SAFETY: for a valid slot the page header is mapped (caller's contract); a bad one
        // is judged by `report_bad_free` from the address map.
        unsafe {
            if (*page).marker != page_marker(page) || (*page).class as usize != class {
                report_bad_free(slot.cast(), class);
            }
            if CHECKED && segment_tag(slot.cast()) != self.tag {
                fatal!(
                    "block {:p} of tag {} given back to the small heap of tag {}",
                    slot,
                    segment_tag(slot.cast()),
                    self.tag
                );
            }
        }
    }

    /// Threads the depot's batches idle since before `cut` back into their pages. Class
    /// lock held by the caller.
    fn drain_depot(&self, st: &mut ClassState, class: usize, cut: Cutoff, stamp: u64) {
        if st.depot_len == 0 {
            return;
        }
        // SAFETY: the class lock is held (`st`); a class with batches has a depot.
        let batches = unsafe { self.depot(class) }.expect("a depot with batches is mapped");
        let mut kept = 0;
        for i in 0..st.depot_len {
            let batch = batches[i];
            if !cut.covers(batch.since) {
                batches[kept] = batch;
                kept += 1;
                continue;
            }
            let mut slot = batch.head;
            while !slot.is_null() {
                // SAFETY: depot slots are free slots of this class, checked when they came
                // in; each is relinked once. Counted free already, so only pages change.
                unsafe {
                    let next = (*slot).next;
                    self.return_one(st, slot, class, stamp);
                    slot = next;
                }
            }
        }
        st.depot_len = kept;
    }

    /// Puts one slot back into its page. Class lock held by the caller.
    #[inline]
    unsafe fn return_one(
        &self,
        st: &mut ClassState,
        slot: *mut FreeSlot,
        class: usize,
        stamp: u64,
    ) {
        let page = page_of(slot.cast());
        // SAFETY: for a valid slot the page is a live class page; the class lock is held.
        unsafe {
            self.check_returned(slot, class);
            (*slot).next = (*page).free;
            (*page).free = slot;
            (*page).free_count += 1;
            if !(*page).in_partial {
                st.push_partial(page);
            }
            (*page).used -= 1;
            if (*page).used == 0 {
                (*page).idle_since = stamp;
                if st.partial_count > 1 {
                    st.unlink_partial(page);
                    st.pages -= 1;
                    self.pool.lock().return_page(page, stamp);
                }
            }
        }
    }

    /// Allocates one slot of `class`; null if the source is out of memory.
    pub(crate) fn allocate(&self, class: usize, source: &impl PageSource) -> *mut u8 {
        let (slot, got) = self.take_slots(class, 1, 1, source);
        if got == 0 {
            return null_mut();
        }
        // SAFETY: the slot was just handed out by this heap.
        unsafe { mark_allocated(slot.cast()) };
        slot.cast()
    }

    /// Frees a slot of `class`.
    ///
    /// # Safety
    /// `ptr` must have come from [`SmallHeap::allocate`] with the same `class` and not have
    /// been freed since. Misuse that can be seen cheaply (wrong class, not a small block, and
    /// in checked builds a double free or an interior pointer) aborts with a message.
    pub(crate) unsafe fn free(&self, ptr: *mut u8, class: usize, stamp: u64) {
        // SAFETY: forwarded from the caller; after the check the slot is free and ours.
        unsafe {
            check_free(ptr, class);
            self.return_slots(class, ptr.cast(), 1, stamp);
        }
    }

    /// Returns empty class pages idle since before `cut` to the pool, then unmaps or purges
    /// pooled memory idle since before `cut`.
    pub(crate) fn purge(&self, cut: Cutoff, stamp: u64, source: &impl PageSource) {
        for (c, class) in self.classes.iter().enumerate() {
            let mut st = class.0.lock();
            self.drain_depot(&mut st, c, cut, stamp);
            let mut page = st.partial;
            // SAFETY: partial pages are valid headers of this class (lock held).
            unsafe {
                while !page.is_null() {
                    let next = (*page).next;
                    if (*page).used == 0 && cut.covers((*page).idle_since) {
                        st.unlink_partial(page);
                        st.pages -= 1;
                        let idle = (*page).idle_since.min(stamp);
                        self.pool.lock().return_page(page, idle);
                    }
                    page = next;
                }
            }
        }
        self.pool.lock().collect(cut, source);
        if cut.is_all() {
            self.unmap_empty_depots(source);
        }
    }

    /// Gives the depots' mapping back if every depot is empty (after `garbage_collect`
    /// drained them), so that a collected heap holds no mapping at all; the next refill maps
    /// them again. Takes every class lock, in order, as `lock_all` does: no class may be
    /// using its depot meanwhile.
    fn unmap_empty_depots(&self, source: &impl PageSource) {
        if self.depots.load(Relaxed).is_null() {
            return;
        }
        let held: [_; CLASS_COUNT] = core::array::from_fn(|c| self.classes[c].0.lock());
        let depots = if held.iter().all(|st| st.depot_len == 0) {
            self.depots.swap(null_mut(), Relaxed)
        } else {
            null_mut()
        };
        drop(held);
        if !depots.is_null() {
            // SAFETY: unpublished above while every class lock was held and every depot
            // empty: nothing refers to it, and a class finds no depot from now on until one
            // is mapped again.
            unsafe { Self::unmap_depots(depots, source) };
        }
    }

    /// Takes every lock of the small heap (before `fork()`).
    ///
    /// # Safety
    /// Must be paired with [`SmallHeap::unlock_all`] on the same thread, with no guard of
    /// these locks alive in between.
    pub(crate) unsafe fn lock_all(&self) {
        for class in &self.classes {
            // SAFETY: forwarded; released by `unlock_all`.
            unsafe { class.0.lock_raw() };
        }
        // SAFETY: as above.
        unsafe { self.pool.lock_raw() };
    }

    /// Releases the locks taken by [`SmallHeap::lock_all`].
    ///
    /// # Safety
    /// Only after `lock_all`, with no guards alive.
    pub(crate) unsafe fn unlock_all(&self) {
        // SAFETY: forwarded from the caller.
        unsafe {
            self.pool.force_unlock();
            for class in &self.classes {
                class.0.force_unlock();
            }
        }
    }

    pub(crate) fn stats(&self) -> SmallStats {
        let mut s = SmallStats::default();
        for (c, class) in self.classes.iter().enumerate() {
            let st = class.0.lock();
            s.granted_bytes += st.live_blocks * class_size(c);
            s.live_blocks += st.live_blocks;
            s.allocations += st.allocations;
            s.frees += st.frees;
            s.class_pages += st.pages;
        }
        let pool = self.pool.lock();
        s.free_pages = pool.free_count;
        s.segments = pool.segment_count;
        s
    }

    /// Unmaps all memory; the heap must not be used afterwards without new pages.
    pub(crate) fn release_all(&mut self, source: &impl PageSource) {
        for class in &mut self.classes {
            *class.0.get_mut() = ClassState::new();
        }
        self.pool.get_mut().release_all(source);
        let depots = core::mem::replace(self.depots.get_mut(), null_mut());
        if !depots.is_null() {
            // SAFETY: every class state was reset, so nothing refers to a batch.
            unsafe { Self::unmap_depots(depots, source) };
        }
    }

    /// Checks the page lists of every class.
    pub(crate) fn validate(&self) -> Result<(), &'static str> {
        for (c, class) in self.classes.iter().enumerate() {
            let st = class.0.lock();
            let mut page = st.partial;
            let mut n = 0;
            // SAFETY: partial pages are valid (lock held).
            unsafe {
                while !page.is_null() {
                    if (*page).class as usize != c || !(*page).in_partial {
                        return Err("page in the wrong partial list");
                    }
                    if (*page).used >= (*page).capacity {
                        return Err("full page in a partial list");
                    }
                    let mut listed = 0;
                    let mut slot = (*page).free;
                    while !slot.is_null() {
                        listed += 1;
                        slot = (*slot).next;
                    }
                    if listed != (*page).free_count {
                        return Err("page free count differs from its free list");
                    }
                    n += 1;
                    page = (*page).next;
                }
            }
            if n != st.partial_count {
                return Err("partial count is wrong");
            }
        }
        Ok(())
    }
}

/// The bitmap word and bit of `slot` in `page`.
///
/// # Safety
/// `page` must be a valid class page and `slot` a pointer into it.
#[inline]
unsafe fn slot_bit(page: *mut PageHeader, slot: *mut u8) -> (usize, u64) {
    // SAFETY: forwarded; the header is valid.
    let elem = unsafe { (*page).elem } as usize;
    let from_end = page_base(page).addr() + PAGE_SIZE - slot.addr();
    let index = from_end / elem;
    (index / 64, 1 << (index % 64))
}

/// In checked builds, records that the small block `ptr` now belongs to a user.
///
/// # Safety
/// `ptr` must be a slot just handed out by a [`SmallHeap`].
#[inline]
pub(crate) unsafe fn mark_allocated(ptr: *mut u8) {
    if CHECKED {
        let page = page_of(ptr);
        // SAFETY: the slot is live, so its page header is valid; the bitmaps are atomic.
        unsafe {
            let (w, bit) = slot_bit(page, ptr);
            live_word(page, w).fetch_or(bit, Relaxed);
            if live_word(page, FILLED_WORDS_AT + w).fetch_and(!bit, Relaxed) & bit != 0 {
                verify_fill(ptr, (*page).elem as usize);
            }
        }
    }
}

/// Checks that a slot freed and filled by a checked free still holds [`FREED_FILL`] past
/// its first word; aborts naming the block, its class and the first byte written otherwise.
///
/// # Safety
/// `ptr` is a slot of `elem` bytes just handed out again.
#[inline(never)]
unsafe fn verify_fill(ptr: *mut u8, elem: usize) {
    let word = core::mem::size_of::<FreeSlot>();
    // SAFETY: the slot is `elem` bytes long and ours (just handed out).
    let body = unsafe { core::slice::from_raw_parts(ptr.add(word), elem.saturating_sub(word)) };
    if let Some(at) = body.iter().position(|&b| b != FREED_FILL) {
        fatal!(
            "written after free: the {}-byte block at {:#x} (size class {} B, allocator '{}') \
             was written at offset {} after it was freed (byte {:#04x} where the freed fill \
             {:#04x} was); found when the block was handed out again",
            elem,
            ptr.addr(),
            elem,
            // SAFETY: the slot is live, so its segment's tag word is mapped.
            crate::fatal::tag_name(unsafe { segment_tag(ptr) }),
            at + word,
            body[at],
            FREED_FILL
        );
    }
}

/// Validates a user's free of `ptr` as a block of `class`.
///
/// With feature `class-check` (and in checked builds, by the fuller check below) this
/// compares the class of the block's page with the class of the layout passed to free (the
/// segment's marker word and the page's class byte, in the segment's first line): a block
/// freed with another class's layout, or a large block freed with a small layout, aborts
/// with a message instead of entering a free list of the wrong class. The default build
/// skips it here (see [`CLASS_CHECK`] and `docs/misuse.md` for what it costs). Debug builds and feature `checked` also ask the address map first (a
/// pointer tagalloc never mapped is named so without reading memory near it), and catch
/// interior pointers and double frees with the page's bitmap.
///
/// # Safety
/// In unchecked builds, `ptr` must lie in memory whose 2 MiB-aligned region is mapped
/// (any pointer a user obtained from a [`SmallHeap`] or the large heap does); checked
/// builds accept any pointer.
#[inline(always)]
pub(crate) unsafe fn check_free(ptr: *mut u8, class: usize) {
    if CHECKED {
        // SAFETY: checked builds judge any pointer from the address map first.
        return unsafe { check_free_fully(ptr, class) };
    }
    if !CLASS_CHECK {
        return;
    }
    let seg = ptr.map_addr(|a| a & !(SEGMENT_SIZE - 1));
    // SAFETY: forwarded from the caller: the first line of `ptr`'s 2 MiB region is mapped.
    let marker = unsafe { seg.add(SEG_MARKER_AT).cast::<usize>().read() };
    if marker != SEG_MAGIC ^ seg.addr() || class_byte(ptr).load(Relaxed) != class as u8 + 1 {
        report_bad_free(ptr, class);
    }
}

/// Checked builds: reports a pointer that lies in no small-block segment before anything
/// reads its segment's first word (the scoped free's tag test does); the full check
/// ([`check_free`]) follows when the block is pushed. Nothing in other builds.
#[inline(always)]
pub(crate) fn check_segment_before_reading(ptr: *mut u8, class: usize) {
    if CHECKED && super::addr_map::kind_of(ptr.addr()) != super::addr_map::SMALL {
        report_bad_free(ptr, class);
    }
}

/// [`check_free`] of checked builds: the address map, the page, the slot's position and
/// its bit in the page's bitmap.
///
/// # Safety
/// None beyond the free's own contract: a pointer that is not in a live small-block segment
/// is reported without being read.
#[inline]
unsafe fn check_free_fully(ptr: *mut u8, class: usize) {
    check_segment_before_reading(ptr, class);
    let page = page_of(ptr);
    // SAFETY: the segment is live (the address map says so), so its header page is mapped;
    // the bitmap of a page serving a class is at the page's start.
    unsafe {
        if (*page).marker != page_marker(page) || (*page).class as usize != class {
            report_bad_free(ptr, class);
        }
        let elem = (*page).elem as usize;
        let end = page_base(page).addr() + PAGE_SIZE;
        let first = end - (*page).capacity as usize * elem;
        if ptr.addr() < first || (end - ptr.addr()) % elem != 0 {
            let start = ptr.addr() - (ptr.addr().saturating_sub(first)) % elem;
            fatal!(
                "free of {:#x}, which is inside the {}-byte block at {:#x}, not at its start \
                 (allocator '{}')",
                ptr.addr(),
                elem,
                start,
                crate::fatal::tag_name(segment_tag(ptr))
            );
        }
        let (w, bit) = slot_bit(page, ptr);
        if live_word(page, w).fetch_and(!bit, Relaxed) & bit == 0 {
            fatal!(
                "double free of {:#x} (a {}-byte small block of allocator '{}', already free)",
                ptr.addr(),
                elem,
                crate::fatal::tag_name(segment_tag(ptr))
            );
        }
        // The slot is free now and nobody else's: fill it past its link word, and say so.
        let word = core::mem::size_of::<FreeSlot>();
        if elem > word {
            ptr.add(word).write_bytes(FREED_FILL, elem - word);
            live_word(page, FILLED_WORDS_AT + w).fetch_or(bit, Relaxed);
        }
    }
}

/// Reports a free of `ptr` with a layout of `class` that its page does not confirm, with
/// the diagnosis the address map and the page header allow. Reads the header only where
/// the map says the segment is live.
#[cold]
#[inline(never)]
pub(crate) fn report_bad_free(ptr: *mut u8, class: usize) -> ! {
    use super::addr_map::{self, kind_of};
    let size = class_size(class);
    match kind_of(ptr.addr()) {
        addr_map::SMALL => {}
        addr_map::CHUNK_START | addr_map::CHUNK_CONT => fatal!(
            "wrong layout: free of {:#x} with a layout of the {}-byte small class, but it lies in the large-block heap (a large block freed with a small layout, or a pointer inside one)",
            ptr.addr(),
            size
        ),
        addr_map::RETIRED_SMALL | addr_map::RETIRED_CHUNK => fatal!(
            "double free of {:#x} (as a {}-byte small block): the memory it lay in was already returned to the OS",
            ptr.addr(),
            size
        ),
        _ => fatal!(
            "not a block of this heap: free of {:#x} as a {}-byte small block, but tagalloc never mapped that address (a stack address, or memory of another allocator)",
            ptr.addr(),
            size
        ),
    }
    let page = page_of(ptr);
    // SAFETY: the segment is live (the address map says so), so its header page is mapped.
    let (marker_ok, page_class) = unsafe { ((*page).marker == page_marker(page), (*page).class) };
    if !marker_ok {
        fatal!(
            "double free of {:#x} (as a {}-byte small block): its page holds no live block (the page was emptied and returned to the heap's pool)",
            ptr.addr(),
            size
        );
    }
    fatal!(
        "wrong layout: free of {:#x} with a layout of the {}-byte class, but the block is in the {}-byte class (the layout passed to dealloc differs from the one allocated; allocator '{}')",
        ptr.addr(),
        size,
        class_size(page_class as usize),
        // SAFETY: the segment is live (the address map says so): its tag word is mapped.
        crate::fatal::tag_name(unsafe { segment_tag(ptr) })
    )
}

impl Default for SmallHeap {
    fn default() -> Self {
        Self::new()
    }
}

#[cfg(test)]
mod layout_tests {
    use super::*;
    use core::ptr::without_provenance_mut;

    /// Every block address maps to its page's header in the first page of its segment,
    /// and back; headers of different pages, and the arrays' colours, do not overlap.
    #[test]
    fn headers_sit_in_the_first_page_and_map_back() {
        let high = (1 << 47) / SEGMENT_SIZE - 2 * SEGMENT_COLOURS;
        for s in (1..=(2 * SEGMENT_COLOURS)).chain(high..high + 2 * SEGMENT_COLOURS) {
            let seg = s * SEGMENT_SIZE;
            let array = header_array(seg);
            // Past the segment's tag word, inside the first page.
            assert!(array >= seg + HEADER_ARRAY && array + HEADER_ARRAY <= seg + PAGE_SIZE);
            assert_eq!(array % HEADER_ARRAY, 0);
            let first: *mut PageHeader = page_of(without_provenance_mut(seg));
            assert_eq!(first.addr(), array);
            for index in 1..PAGES_PER_SEGMENT {
                let base = seg + index * PAGE_SIZE;
                let header = page_of(without_provenance_mut(base));
                assert_eq!(header.addr(), array + index * HEADER_STRIDE);
                for offset in [0, 8, PAGE_SIZE / 2, PAGE_SIZE - 8] {
                    let in_page = page_of(without_provenance_mut(base + offset));
                    assert_eq!(in_page, header);
                }
                assert_eq!(page_base(header).addr(), base);
                assert_eq!(segment_of(header), first);
            }
        }
        // Consecutive segments start their arrays at different colours.
        let colours: Vec<usize> = (0..SEGMENT_COLOURS)
            .map(|s| header_array(s * SEGMENT_SIZE) - s * SEGMENT_SIZE)
            .collect();
        for (i, a) in colours.iter().enumerate() {
            assert!(!colours[i + 1..].contains(a));
        }
    }
}

#[cfg(test)]
mod depot_tests {
    use super::*;
    use crate::os::heap_source::HeapPages;
    use std::collections::HashSet;

    /// Links `slots` through their first word (the last one's link null).
    fn chain(slots: &[*mut FreeSlot]) -> *mut FreeSlot {
        for pair in slots.windows(2) {
            // SAFETY: the slots are free slots handed out by the heap under test.
            unsafe { (*pair[0]).next = pair[1] };
        }
        // SAFETY: as above.
        unsafe { (*slots[slots.len() - 1]).next = null_mut() };
        slots[0]
    }

    /// The slots of a chain of `len` (checking that it ends there).
    fn walk(head: *mut FreeSlot, len: usize) -> Vec<*mut FreeSlot> {
        let mut out = Vec::new();
        let mut slot = head;
        for _ in 0..len {
            out.push(slot);
            // SAFETY: the chain has `len` free slots.
            slot = unsafe { (*slot).next };
        }
        assert!(slot.is_null(), "the chain is longer than it says");
        out
    }

    fn class_of_64() -> usize {
        (0..CLASS_COUNT).find(|&c| class_size(c) == 64).unwrap()
    }

    /// The classes with room in a depot are exactly those with a depot in the heap.
    #[test]
    fn depot_classes_are_the_classes_with_room() {
        for class in 0..CLASS_COUNT {
            assert_eq!(
                depot_capacity(class) > 0,
                class < DEPOT_CLASSES,
                "class {class}"
            );
        }
    }

    /// `init_zeroed` in zeroed memory makes what `with_tag` makes: every field the same, and
    /// a heap that serves blocks on segments of its tag.
    #[test]
    fn a_zeroed_heap_made_for_a_tag_is_the_heap_with_that_tag() {
        let layout = std::alloc::Layout::new::<SmallHeap>();
        // SAFETY: a non-zero-sized layout.
        let zeroed = unsafe { std::alloc::alloc_zeroed(layout) }.cast::<SmallHeap>();
        assert!(!zeroed.is_null());
        // SAFETY: zeroed, aligned and unshared memory for one heap.
        unsafe { SmallHeap::init_zeroed(zeroed, 5) };
        // SAFETY: initialised just above; freed at the end of the test only.
        let made = unsafe { &mut *zeroed };
        let mut expected = SmallHeap::with_tag(5);
        assert_eq!(made.tag, expected.tag);
        let (a, b) = (made.pool.get_mut(), expected.pool.get_mut());
        assert_eq!(
            (
                a.free,
                a.free_count,
                a.cursor,
                a.segments,
                a.segment_count,
                a.tag
            ),
            (
                b.free,
                b.free_count,
                b.cursor,
                b.segments,
                b.segment_count,
                b.tag
            )
        );
        for (a, b) in made.classes.iter_mut().zip(expected.classes.iter_mut()) {
            assert!(a.0.try_lock().is_some(), "a class lock starts held");
            let (a, b) = (a.0.get_mut(), b.0.get_mut());
            assert_eq!(
                (a.partial, a.partial_count, a.pages, a.live_blocks),
                (b.partial, b.partial_count, b.pages, b.live_blocks)
            );
            assert_eq!((a.allocations, a.frees), (b.allocations, b.frees));
            assert_eq!(a.depot_len, b.depot_len);
        }
        assert!(made.depots.get_mut().is_null() && expected.depots.get_mut().is_null());
        let source = HeapPages::default();
        let class = class_of_64();
        let block = made.allocate(class, &source);
        assert!(!block.is_null());
        // SAFETY: a live small block of `made`.
        assert_eq!(unsafe { segment_tag(block) }, 5);
        // SAFETY: freed once, with its class.
        unsafe { made.free(block, class, 0) };
        made.validate().unwrap();
        made.release_all(&source);
        // SAFETY: allocated above with `layout`; the heap holds nothing now.
        unsafe { std::alloc::dealloc(zeroed.cast(), layout) };
    }

    /// Whole batches given back wait in the depot, counted free, and the next refill takes
    /// them whole (the same slots, newest batch first); the odd rest goes into its pages.
    #[test]
    fn returned_batches_wait_in_the_depot_for_the_next_refill() {
        let source = HeapPages::default();
        let heap = SmallHeap::new();
        let class = class_of_64();
        let n = 2 * DEPOT_BATCH + 3;
        let (head, got) = heap.take_slots(class, n, 0, &source);
        assert_eq!(got, n);
        let slots = walk(head, n);
        assert_eq!(heap.stats().live_blocks, n);
        // SAFETY: the slots were just handed out and are free again (nobody uses them).
        unsafe { heap.return_slots(class, chain(&slots), n, 0) };
        let st = heap.stats();
        assert_eq!((st.live_blocks, st.frees), (0, n as u64));
        assert_eq!(heap.classes[class].0.lock().depot_len, 2);
        heap.validate().unwrap();

        // A refill of one batch takes the newest: the second batch given back.
        let (head, got) = heap.take_slots(class, DEPOT_BATCH, 0, &source);
        assert_eq!(got, DEPOT_BATCH);
        assert_eq!(walk(head, got), slots[DEPOT_BATCH..2 * DEPOT_BATCH]);
        // One slot more than a batch: both batches come, joined.
        // SAFETY: as above.
        unsafe { heap.return_slots(class, head, got, 0) };
        let (head, got) = heap.take_slots(class, DEPOT_BATCH + 1, 0, &source);
        assert_eq!(got, 2 * DEPOT_BATCH);
        let taken: HashSet<_> = walk(head, got).into_iter().collect();
        assert_eq!(taken, slots[..2 * DEPOT_BATCH].iter().copied().collect());
        assert_eq!(heap.stats().live_blocks, 2 * DEPOT_BATCH);
        assert_eq!(heap.classes[class].0.lock().depot_len, 0);
        // SAFETY: as above.
        unsafe { heap.return_slots(class, head, got, 0) };
    }

    /// The depot holds at most its capacity; the rest goes into the pages, and a purge that
    /// covers the batches threads them back so that empty pages leave the class.
    #[test]
    fn the_depot_is_bounded_and_a_purge_empties_it() {
        let source = HeapPages::default();
        let heap = SmallHeap::new();
        let class = class_of_64();
        let room = depot_capacity(class);
        assert!(room > 0 && room <= DEPOT_BATCHES);
        let n = (room + 3) * DEPOT_BATCH;
        let (head, got) = heap.take_slots(class, n, 0, &source);
        assert_eq!(got, n);
        // SAFETY: just handed out, free again.
        unsafe { heap.return_slots(class, head, got, 5) };
        assert_eq!(heap.classes[class].0.lock().depot_len, room);
        assert!(room * DEPOT_BATCH * class_size(class) <= DEPOT_BYTES);
        assert_eq!(heap.stats().live_blocks, 0);
        heap.validate().unwrap();
        // A purge whose cut does not cover the batches keeps them.
        heap.purge(Cutoff { before: 5 }, 6, &source);
        assert_eq!(heap.classes[class].0.lock().depot_len, room);
        heap.purge(Cutoff::ALL, 6, &source);
        assert_eq!(heap.classes[class].0.lock().depot_len, 0);
        heap.validate().unwrap();
        let st = heap.stats();
        assert_eq!((st.live_blocks, st.class_pages, st.segments), (0, 0, 0));
    }

    /// Classes of big blocks have no depot: their slots go straight back to their pages.
    #[test]
    fn big_classes_have_no_depot() {
        let source = HeapPages::default();
        let heap = SmallHeap::new();
        let class = (0..CLASS_COUNT)
            .find(|&c| class_size(c) > DEPOT_MAX_BLOCK)
            .unwrap();
        assert_eq!(depot_capacity(class), 0);
        let (head, got) = heap.take_slots(class, DEPOT_BATCH, 0, &source);
        assert_eq!(got, DEPOT_BATCH);
        // SAFETY: just handed out, free again.
        unsafe { heap.return_slots(class, head, got, 0) };
        assert_eq!(heap.classes[class].0.lock().depot_len, 0);
        heap.validate().unwrap();
    }
}
