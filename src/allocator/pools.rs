//! Pool and thread-pool allocators: the `static` cores behind `pool of …` and
//! `thread_pool of …` handles declared with [`allocator!`](crate::allocator).
//!
//! - [`PoolCore`] wraps a [`PoolSchema`] (not thread-safe by itself) in an allocation-free
//!   spin lock, so it can live in a `static` and be shared by `Copy` handles. Meant for a
//!   subsystem that allocates from one thread at a time: the lock is then uncontended (one
//!   compare-and-swap and one store per call).
//! - [`ThreadPoolCore`] wraps a [`ThreadPoolSchema`], which is thread-safe with one heap per
//!   thread: no lock and no atomic read-modify-write on its fast path.
//!
//! Both serve only the sizes their [`PoolConfig`] covers. Anything else (too large, or
//! aligned beyond the pool's largest block) gets `None` (an `AllocError` for containers,
//! never undefined behaviour), and in debug builds the pool's first refusal is noted on
//! stderr with the allocator's name. Their figures come from the schema's own exact
//! counters; Reserved is the pages (and per-thread bookkeeping) held from the parent.
//!
//! A budget on a pool is checked against the schema's live granted bytes. For a thread
//! pool that sum walks every thread's heap, so it is only computed while a budget is set.

use crate::budget::BudgetEvent;
use crate::records;
use crate::registry::Registration;
use crate::schema::{Allocation, PageParent, PoolConfig, PoolSchema, PoolStats, ThreadPoolSchema};
use crate::stats::AllocatorStats;
use crate::sync::SpinLock;
use core::alloc::Layout;
use core::ptr::NonNull;

fn to_stats(pool: PoolStats) -> AllocatorStats {
    AllocatorStats {
        live_granted_bytes: pool.granted_bytes,
        live_requested_bytes: Some(pool.requested_bytes),
        live_blocks: pool.live_blocks,
        allocations: pool.allocations,
        frees: pool.frees,
        reallocations: 0,
        peak_granted_bytes: Some(pool.peak_granted_bytes),
        reserved_bytes: pool.reserved_bytes,
        over_budget: 0,
        budget_failures: 0,
    }
}

/// Tells the budget hook about an allocation that took the pool to `live` bytes; returns
/// whether it may go ahead. Called with no lock held.
#[cold]
#[inline(never)]
fn over_budget(registration: &'static Registration, live: usize, request: usize) -> bool {
    let budget = registration.budget();
    let counters = registration.counters();
    let refused = budget.enforced();
    let event = BudgetEvent {
        allocator: registration.name(),
        budget: budget.limit().unwrap_or(usize::MAX),
        live_bytes: live,
        request_bytes: request,
        count: counters.record_over_budget(),
        refused,
    };
    if refused {
        counters.record_budget_failure();
    }
    budget.notify(&event);
    !refused
}

/// Zeroes a whole block.
fn zero(block: Allocation) -> Allocation {
    // SAFETY: the block is live, ours, and `size` bytes long.
    unsafe { block.ptr.as_ptr().write_bytes(0, block.size) };
    block
}

/// A [`PoolSchema`] behind a spin lock: the `static` behind a `pool of …` handle.
pub struct PoolCore<P: PageParent + Send> {
    schema: SpinLock<PoolSchema<P>>,
}

impl<P: PageParent + Send> PoolCore<P> {
    /// A pool drawing pages from `parent`, with geometry `config`; allocates nothing yet.
    pub const fn new(parent: P, config: PoolConfig) -> Self {
        Self {
            schema: SpinLock::new(PoolSchema::with_config(parent, config)),
        }
    }

    /// The pool's geometry.
    pub fn config(&self) -> PoolConfig {
        *self.schema.lock().config()
    }

    /// Allocates a block (zeroed if asked), checking the budget of `registration`, and
    /// records it if `registration` records.
    #[inline]
    pub fn allocate(
        &self,
        registration: &'static Registration,
        layout: Layout,
        zeroed: bool,
    ) -> Option<Allocation> {
        let block = self.allocate_unrecorded(registration, layout, zeroed)?;
        records::after_alloc(registration, block.ptr, layout, block.size);
        Some(block)
    }

    #[inline]
    fn allocate_unrecorded(
        &self,
        registration: &'static Registration,
        layout: Layout,
        zeroed: bool,
    ) -> Option<Allocation> {
        registration.register();
        let budget = registration.budget();
        let schema = self.schema.lock();
        let block = schema.allocate(layout)?;
        if budget.limit().is_some() {
            let live = schema.granted_bytes();
            if budget.exceeded_by(live) {
                let refuse = budget.enforced();
                if refuse {
                    // SAFETY: just allocated with `layout`.
                    unsafe { schema.deallocate(block.ptr, layout) };
                }
                drop(schema);
                if !over_budget(registration, live, block.size) {
                    return None;
                }
            }
        }
        Some(if zeroed { zero(block) } else { block })
    }

    /// Frees a block (removing its record first); returns its granted (class) size.
    ///
    /// # Safety
    /// As for [`PoolSchema::deallocate`].
    #[inline]
    pub unsafe fn deallocate(
        &self,
        registration: &'static Registration,
        ptr: NonNull<u8>,
        layout: Layout,
    ) -> usize {
        records::before_free(registration, ptr);
        // SAFETY: forwarded from the caller.
        unsafe { self.deallocate_unrecorded(ptr, layout) }
    }

    /// Resizes a block (see [`reallocate_in_pool`]), moving its record along.
    ///
    /// # Safety
    /// As for [`reallocate_in_pool`].
    #[inline]
    pub unsafe fn reallocate(
        &self,
        registration: &'static Registration,
        ptr: NonNull<u8>,
        layout: Layout,
        new_size: usize,
    ) -> Option<(Allocation, usize)> {
        // SAFETY: forwarded from the caller; the closures are this pool's own allocate and
        // free, without records (the record moves once, in the helper).
        unsafe {
            reallocate_recorded(
                self.config(),
                registration,
                ptr,
                layout,
                new_size,
                |l| self.allocate_unrecorded(registration, l, false),
                |p, l| self.deallocate_unrecorded(p, l),
            )
        }
    }

    /// # Safety
    /// As for [`PoolSchema::deallocate`].
    #[inline]
    unsafe fn deallocate_unrecorded(&self, ptr: NonNull<u8>, layout: Layout) -> usize {
        let schema = self.schema.lock();
        let granted = schema.config().block_size(layout).unwrap_or(0);
        // SAFETY: forwarded from the caller.
        unsafe { schema.deallocate(ptr, layout) };
        granted
    }

    /// Returns the pool's empty pages to its parent.
    pub fn garbage_collect(&self) {
        self.schema.lock().garbage_collect();
    }

    /// The pool's figures.
    pub fn stats(&self) -> AllocatorStats {
        to_stats(self.schema.lock().stats())
    }
}

/// A [`ThreadPoolSchema`]: the `static` behind a `thread_pool of …` handle.
pub struct ThreadPoolCore<P: PageParent> {
    schema: ThreadPoolSchema<P>,
}

impl<P: PageParent> ThreadPoolCore<P> {
    /// A thread pool drawing pages from `parent`, with geometry `config`.
    pub const fn new(parent: P, config: PoolConfig) -> Self {
        Self {
            schema: ThreadPoolSchema::with_config(parent, config),
        }
    }

    /// The pool's geometry.
    pub fn config(&self) -> PoolConfig {
        *self.schema.config()
    }

    /// Allocates a block (zeroed if asked), checking the budget of `registration`, and
    /// records it if `registration` records.
    #[inline]
    pub fn allocate(
        &self,
        registration: &'static Registration,
        layout: Layout,
        zeroed: bool,
    ) -> Option<Allocation> {
        let block = self.allocate_unrecorded(registration, layout, zeroed)?;
        records::after_alloc(registration, block.ptr, layout, block.size);
        Some(block)
    }

    #[inline]
    fn allocate_unrecorded(
        &self,
        registration: &'static Registration,
        layout: Layout,
        zeroed: bool,
    ) -> Option<Allocation> {
        registration.register();
        let block = self.schema.allocate(layout)?;
        let budget = registration.budget();
        if budget.limit().is_some() {
            let live = self.schema.stats().granted_bytes;
            if budget.exceeded_by(live) && !over_budget(registration, live, block.size) {
                // SAFETY: just allocated with `layout`.
                unsafe { self.schema.deallocate(block.ptr, layout) };
                return None;
            }
        }
        Some(if zeroed { zero(block) } else { block })
    }

    /// Frees a block, from any thread (removing its record first); returns its granted
    /// (class) size.
    ///
    /// # Safety
    /// As for [`ThreadPoolSchema::deallocate`].
    #[inline]
    pub unsafe fn deallocate(
        &self,
        registration: &'static Registration,
        ptr: NonNull<u8>,
        layout: Layout,
    ) -> usize {
        records::before_free(registration, ptr);
        // SAFETY: forwarded from the caller.
        unsafe { self.deallocate_unrecorded(ptr, layout) }
    }

    /// Resizes a block (see [`reallocate_in_pool`]), moving its record along.
    ///
    /// # Safety
    /// As for [`reallocate_in_pool`].
    #[inline]
    pub unsafe fn reallocate(
        &self,
        registration: &'static Registration,
        ptr: NonNull<u8>,
        layout: Layout,
        new_size: usize,
    ) -> Option<(Allocation, usize)> {
        // SAFETY: forwarded from the caller; the closures are this pool's own allocate and
        // free, without records (the record moves once, in the helper).
        unsafe {
            reallocate_recorded(
                self.config(),
                registration,
                ptr,
                layout,
                new_size,
                |l| self.allocate_unrecorded(registration, l, false),
                |p, l| self.deallocate_unrecorded(p, l),
            )
        }
    }

    /// # Safety
    /// As for [`ThreadPoolSchema::deallocate`].
    #[inline]
    unsafe fn deallocate_unrecorded(&self, ptr: NonNull<u8>, layout: Layout) -> usize {
        let granted = self.schema.config().block_size(layout).unwrap_or(0);
        // SAFETY: forwarded from the caller.
        unsafe { self.schema.deallocate(ptr, layout) };
        granted
    }

    /// Returns empty pages to the parent (see [`ThreadPoolSchema::garbage_collect`]).
    pub fn garbage_collect(&self) {
        self.schema.garbage_collect();
    }

    /// The pool's figures, summed over every thread's heap.
    pub fn stats(&self) -> AllocatorStats {
        to_stats(self.schema.stats())
    }
}

/// [`reallocate_in_pool`] with the block's record moved along, for both pool cores.
///
/// # Safety
/// As for [`reallocate_in_pool`]; `allocate` and `deallocate` must not record.
#[inline]
unsafe fn reallocate_recorded(
    config: PoolConfig,
    registration: &'static Registration,
    ptr: NonNull<u8>,
    layout: Layout,
    new_size: usize,
    allocate: impl FnOnce(Layout) -> Option<Allocation>,
    deallocate: impl FnOnce(NonNull<u8>, Layout) -> usize,
) -> Option<(Allocation, usize)> {
    let taken = records::before_realloc(registration, ptr);
    // SAFETY: forwarded from the caller.
    let result = unsafe { reallocate_in_pool(config, ptr, layout, new_size, allocate, deallocate) };
    records::after_realloc(taken, result.map(|(b, _)| (b.ptr, b.size)), new_size);
    result
}

/// `BlockAllocator::reallocate_block` for a pool: allocate, copy and free (pools have no
/// in-place resizing; a pool counts requested bytes from the layouts of its allocations
/// and frees, so even a resize within one size class goes through both). `allocate` and
/// `deallocate` are the pool's.
///
/// # Safety
/// `ptr` must be a live block of the pool with a layout fitting `layout`; `new_size`
/// non-zero and valid with the alignment.
#[inline]
pub unsafe fn reallocate_in_pool(
    config: PoolConfig,
    ptr: NonNull<u8>,
    layout: Layout,
    new_size: usize,
    allocate: impl FnOnce(Layout) -> Option<Allocation>,
    deallocate: impl FnOnce(NonNull<u8>, Layout) -> usize,
) -> Option<(Allocation, usize)> {
    let old = config.block_size(layout)?;
    if new_size == layout.size() {
        return Some((Allocation { ptr, size: old }, old));
    }
    let new_layout = Layout::from_size_align(new_size, layout.align()).ok()?;
    let block = allocate(new_layout)?;
    // SAFETY: distinct live blocks; the old one holds `layout.size()` bytes and is freed
    // once after the copy.
    unsafe {
        ptr.as_ptr()
            .copy_to_nonoverlapping(block.ptr.as_ptr(), layout.size().min(new_size));
    }
    deallocate(ptr, layout);
    Some((block, old))
}
