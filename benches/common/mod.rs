//! The pool benchmarks' common ground: one trait over every allocator they compare, so each
//! is called through the same generic code (no dynamic dispatch). Shared by
//! `benches/pool.rs` and `compare/src/bin/pool_pairs.rs`.

use std::alloc::{GlobalAlloc, Layout};
use std::ptr::NonNull;
use tagalloc::SystemAllocator;
use tagalloc::schema::{PoolSchema, ThreadPoolSchema};

/// One allocator under test.
pub trait Alloc {
    fn alloc(&self, layout: Layout) -> NonNull<u8>;
    /// # Safety
    /// `ptr` must come from `alloc` with `layout`, and is freed once.
    unsafe fn free(&self, ptr: NonNull<u8>, layout: Layout);
}

/// A `GlobalAlloc` called directly (not installed as the global allocator).
pub struct Global<A: GlobalAlloc>(pub A);

impl<A: GlobalAlloc> Alloc for Global<A> {
    #[inline]
    fn alloc(&self, layout: Layout) -> NonNull<u8> {
        // SAFETY: the benches use non-zero layouts.
        NonNull::new(unsafe { self.0.alloc(layout) }).expect("out of memory")
    }
    #[inline]
    unsafe fn free(&self, ptr: NonNull<u8>, layout: Layout) {
        // SAFETY: forwarded from the caller.
        unsafe { self.0.dealloc(ptr.as_ptr(), layout) }
    }
}

/// The pool schemas, whose `allocate` / `deallocate` have the same shape.
macro_rules! schema_alloc {
    ($($schema:ty),*) => {$(
        impl Alloc for $schema {
            #[inline]
            fn alloc(&self, layout: Layout) -> NonNull<u8> {
                self.allocate(layout).expect("out of memory").ptr
            }
            #[inline]
            unsafe fn free(&self, ptr: NonNull<u8>, layout: Layout) {
                // SAFETY: forwarded from the caller.
                unsafe { self.deallocate(ptr, layout) }
            }
        }
    )*};
}
schema_alloc!(
    PoolSchema<SystemAllocator>,
    ThreadPoolSchema<SystemAllocator>
);
