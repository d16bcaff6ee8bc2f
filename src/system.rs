//! [`SystemAllocator`]: the general-purpose allocator and the `GlobalAlloc` impl.
//!
//! All instances share one process-wide HPHA heap on the OS layer. The heap is a `static`
//! built in a `const` context, so it works from the first allocation before `main` to the
//! last one during exit, from any thread, with no lazy initialisation.

use crate::os::OsAllocator;
use crate::schema::{HphaSchema, HphaStats};
use core::alloc::{GlobalAlloc, Layout};
use core::ptr::{self, NonNull};

/// The process-wide heap behind every [`SystemAllocator`].
static HEAP: HphaSchema<OsAllocator> = HphaSchema::new(OsAllocator);

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

    /// The heap's counters: live granted bytes and blocks, calls, bytes held from the OS.
    pub fn stats(&self) -> HphaStats {
        HEAP.stats()
    }

    /// Returns free memory to the OS: empty pages, segments and chunks, and the pages inside
    /// large free blocks.
    pub fn garbage_collect(&self) {
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

// SAFETY: the heap returns blocks that are unaliased, at least `layout.size()` bytes and
// aligned to `layout.align()`, or null; it frees only what it handed out; `realloc` keeps
// contents and alignment. Nothing here unwinds: misuse aborts with a message.
unsafe impl GlobalAlloc for SystemAllocator {
    #[inline]
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        HEAP.allocate(layout)
            .map_or(ptr::null_mut(), |a| a.ptr.as_ptr())
    }

    #[inline]
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        HEAP.allocate_zeroed(layout)
            .map_or(ptr::null_mut(), |a| a.ptr.as_ptr())
    }

    #[inline]
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: GlobalAlloc's contract: `ptr` is a live block from this allocator with
        // this layout (and so not null).
        unsafe { HEAP.deallocate(NonNull::new_unchecked(ptr), layout) }
    }

    #[inline]
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: GlobalAlloc's contract: `ptr` is live with `layout`, and `new_size`
        // rounded to the alignment fits in `isize`.
        unsafe {
            HEAP.reallocate(NonNull::new_unchecked(ptr), layout, new_size)
                .map_or(ptr::null_mut(), |a| a.ptr.as_ptr())
        }
    }
}
