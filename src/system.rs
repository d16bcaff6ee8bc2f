//! [`SystemAllocator`]: the general-purpose allocator and the `GlobalAlloc` impl.
//!
//! All instances share one process-wide HPHA heap on the OS layer. The heap is a `static`
//! built in a `const` context, so it works from the first allocation before `main` to the
//! last one during exit, from any thread, with no lazy initialisation.

use crate::schema::HphaStats;
use crate::schema::hpha::size_class::{CLASS_BY_UNITS, MAX_SMALL, class_for};
use crate::thread_cache::{self, HEAP};
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

    /// The allocator's counters: what the program holds (live granted bytes and blocks),
    /// calls, what sits in thread caches, and bytes held from the OS. Per-thread counts are
    /// summed on read, so the figures are exact whenever no thread is allocating meanwhile.
    pub fn stats(&self) -> HphaStats {
        let heap = HEAP.stats();
        let large = HEAP.large_heap().stats();
        let front = thread_cache::front_totals();
        let (small_blocks, small_bytes) = if cfg!(feature = "uncounted") {
            // Without per-thread counts, blocks sitting in thread caches count as live.
            (
                heap.live_blocks - large.live_blocks,
                heap.small_granted_bytes,
            )
        } else {
            front.live_blocks_and_bytes()
        };
        HphaStats {
            granted_bytes: small_bytes + large.granted_bytes,
            live_blocks: small_blocks + large.live_blocks,
            allocations: front.allocations + large.allocations,
            frees: front.frees + large.frees,
            small_granted_bytes: small_bytes,
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

    /// Returns free memory to the OS: the calling thread's cached blocks, then empty pages,
    /// segments and chunks, and the pages inside large free blocks.
    pub fn garbage_collect(&self) {
        thread_cache::flush_current_thread();
        HEAP.garbage_collect();
    }

    /// The bytes usable in a block this allocator returned for `layout` (its class or block
    /// size, at least `layout.size()`).
    ///
    /// # Safety
    /// `ptr` must be a live block allocated by this allocator with `layout`.
    pub unsafe fn usable_size(&self, ptr: NonNull<u8>, layout: Layout) -> usize {
        // SAFETY: forwarded from the caller.
        unsafe { HEAP.usable_size(ptr, layout) }
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
unsafe impl GlobalAlloc for SystemAllocator {
    #[inline]
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        if let Some(class) = small_fast_class(layout) {
            return thread_cache::allocate(class);
        }
        alloc_any(layout)
    }

    #[inline]
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
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
                let grant = HEAP.large_heap().allocate(
                    layout.size(),
                    layout.align(),
                    HEAP.source(),
                    HEAP.stamp(),
                );
                HEAP.after_slow_path();
                match grant {
                    // SAFETY: past `dirty_prefix` the block already reads as zero.
                    Some(g) => unsafe {
                        g.ptr.write_bytes(0, g.dirty_prefix.min(layout.size()));
                        g.ptr
                    },
                    None => ptr::null_mut(),
                }
            }
        }
    }

    #[inline]
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: GlobalAlloc's contract: `ptr` is a live block from this allocator with
        // this layout, so it came from the same side the layout selects now.
        unsafe {
            if let Some(class) = small_fast_class(layout) {
                return thread_cache::free(ptr, class);
            }
            dealloc_any(ptr, layout)
        }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let align = layout.align();
        match (class_for(layout.size(), align), class_for(new_size, align)) {
            (Some(a), Some(b)) if a == b => return ptr,
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
        // SAFETY: a valid non-zero layout (`new_size > 0` by the realloc contract).
        let new = unsafe { self.alloc(new_layout) };
        if !new.is_null() {
            // SAFETY: both blocks are live and distinct, each at least as long as copied.
            unsafe {
                ptr::copy_nonoverlapping(ptr, new, layout.size().min(new_size));
                self.dealloc(ptr, layout);
            }
        }
        new
    }
}

/// The class of the most common requests (small blocks at alignment ≤ 8): one table load;
/// `None` sends the request down the general path.
#[inline(always)]
fn small_fast_class(layout: Layout) -> Option<usize> {
    // Every class is a multiple of 8, so alignments up to 8 need no rounding.
    (layout.size() <= MAX_SMALL && layout.align() <= 8)
        .then(|| CLASS_BY_UNITS[layout.size().div_ceil(8)] as usize)
}

/// Allocation for any layout; kept out of line so the fast path needs no stack frame.
#[inline(never)]
fn alloc_any(layout: Layout) -> *mut u8 {
    thread_cache::apply_environment_once();
    match class_for(layout.size(), layout.align()) {
        Some(class) => thread_cache::allocate(class),
        None => {
            let grant = HEAP.large_heap().allocate(
                layout.size(),
                layout.align(),
                HEAP.source(),
                HEAP.stamp(),
            );
            HEAP.after_slow_path();
            grant.map_or(ptr::null_mut(), |g| g.ptr)
        }
    }
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
