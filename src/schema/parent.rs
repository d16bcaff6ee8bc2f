//! [`PageParent`]: where the pool schemas get their pages (and their own bookkeeping).
//!
//! A pool does not talk to the OS: like O3DE's PoolAllocator, it carves pages obtained from a
//! parent allocator, so the parent's statistics include the pool's pages and a pool can sit
//! under any allocator of the hierarchy. The trait is deliberately small (allocate, free) so
//! that child allocators can implement it by forwarding.

use crate::system::SystemAllocator;
use core::alloc::{GlobalAlloc, Layout};
use core::ptr::NonNull;
use std::alloc::System;

/// An allocator that hands out pages (and small bookkeeping blocks) to a pool schema.
///
/// The pools ask for their pages with `Layout::from_size_align(page_size, page_size)`, so the
/// page header can be found by masking an address, and for their per-thread bookkeeping with
/// that structure's layout. They never ask for a zero-size layout.
///
/// # Safety
/// Implementations promise that:
/// - a block returned by [`allocate_page`](PageParent::allocate_page) is valid for reads and
///   writes of `layout.size()` bytes, aligned to `layout.align()`, and overlaps no other live
///   block, until it is passed to [`free_page`](PageParent::free_page);
/// - neither method calls back into the schema that called it on the same thread (the pools
///   are not re-entrant: a pool whose parent allocates from that same pool would recurse).
///
/// ```
/// use core::alloc::Layout;
/// use tagalloc::schema::PageParent;
///
/// let layout = Layout::from_size_align(4096, 4096).unwrap();
/// let page = std::alloc::System.allocate_page(layout).expect("out of memory");
/// assert_eq!(page.as_ptr() as usize % 4096, 0);
/// // SAFETY: the page came from this parent with this layout.
/// unsafe { std::alloc::System.free_page(page, layout) };
/// ```
pub unsafe trait PageParent: Sync {
    /// Allocates a block for `layout`, or `None` when out of memory.
    fn allocate_page(&self, layout: Layout) -> Option<NonNull<u8>>;

    /// Frees a block.
    ///
    /// # Safety
    /// `ptr` must have been returned by [`allocate_page`](PageParent::allocate_page) of this
    /// parent with this `layout`, and not freed since.
    unsafe fn free_page(&self, ptr: NonNull<u8>, layout: Layout);

    /// The bytes the parent set aside for a block it handed out (what its own statistics
    /// count), so a pool reports the same figure for what it holds; `layout.size()` unless
    /// the parent knows better.
    ///
    /// # Safety
    /// As for [`free_page`](PageParent::free_page).
    unsafe fn granted_size(&self, ptr: NonNull<u8>, layout: Layout) -> usize {
        let _ = ptr;
        layout.size()
    }
}

// SAFETY: `System` is the platform allocator; GlobalAlloc's contract gives exactly the
// guarantees above, and it never calls into a tagalloc schema.
unsafe impl PageParent for System {
    #[inline]
    fn allocate_page(&self, layout: Layout) -> Option<NonNull<u8>> {
        if layout.size() == 0 {
            return None;
        }
        // SAFETY: the layout has a non-zero size.
        NonNull::new(unsafe { GlobalAlloc::alloc(self, layout) })
    }

    #[inline]
    unsafe fn free_page(&self, ptr: NonNull<u8>, layout: Layout) {
        // SAFETY: forwarded from the caller: `ptr` came from `alloc` with this layout.
        unsafe { GlobalAlloc::dealloc(self, ptr.as_ptr(), layout) }
    }
}

// SAFETY: the SystemAllocator's heap keeps GlobalAlloc's contract (its `BlockAllocator`
// calls are the same operations, never routed to a scoped tag); it draws memory from the OS
// layer only, never from a pool schema.
unsafe impl PageParent for SystemAllocator {
    #[inline]
    fn allocate_page(&self, layout: Layout) -> Option<NonNull<u8>> {
        if layout.size() == 0 {
            return None;
        }
        // A pool's pages are its own, whatever tag the thread that needs one has entered:
        // the `BlockAllocator` call, not the global allocator's.
        crate::BlockAllocator::allocate_block(*self, layout).map(|block| block.ptr)
    }

    #[inline]
    unsafe fn free_page(&self, ptr: NonNull<u8>, layout: Layout) {
        // SAFETY: forwarded from the caller: `ptr` came from `allocate_page` with this layout.
        unsafe { crate::BlockAllocator::deallocate_block(*self, ptr, layout) };
    }

    #[inline]
    unsafe fn granted_size(&self, ptr: NonNull<u8>, layout: Layout) -> usize {
        // SAFETY: forwarded from the caller: a live block of this heap with this layout.
        unsafe { crate::BlockAllocator::granted_size(*self, ptr, layout) }
    }
}

// SAFETY: forwards to `T`, which keeps the contract.
unsafe impl<T: PageParent + ?Sized> PageParent for &T {
    #[inline]
    fn allocate_page(&self, layout: Layout) -> Option<NonNull<u8>> {
        (**self).allocate_page(layout)
    }

    #[inline]
    unsafe fn free_page(&self, ptr: NonNull<u8>, layout: Layout) {
        // SAFETY: forwarded from the caller.
        unsafe { (**self).free_page(ptr, layout) }
    }

    #[inline]
    unsafe fn granted_size(&self, ptr: NonNull<u8>, layout: Layout) -> usize {
        // SAFETY: forwarded from the caller.
        unsafe { (**self).granted_size(ptr, layout) }
    }
}
