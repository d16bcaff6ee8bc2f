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
//! never undefined behaviour), and, in every build, the pool's first refusal is noted on
//! stderr with the allocator's name. Their figures come from the schema's own exact
//! counters; Reserved is the pages (and per-thread bookkeeping) held from the parent.
//!
//! A budget on a pool is checked against the schema's live granted bytes. For a thread
//! pool that sum walks every thread's heap, so it is only computed while a budget is set.

use crate::budget::{BudgetEvent, BudgetSettings};
use crate::records;
use crate::registry::Registration;
use crate::schema::{Allocation, PageParent, PoolConfig, PoolSchema, PoolStats, ThreadPoolSchema};
use crate::stats::{AllocatorStats, non_negative};
use crate::sync::SpinLock;
use core::alloc::Layout;
use core::ptr::NonNull;
use core::sync::atomic::{AtomicU64, Ordering::Relaxed};

/// A pool's figures as [`AllocatorStats`]. `resizes`: the pool's successful resizes;
/// `moves`: those that moved the block, which the schema counted as an allocation and a
/// free (pools resize by moving), and which are reported as reallocations instead, as a
/// child's are.
fn to_stats(pool: PoolStats, resizes: &Resizes) -> AllocatorStats {
    // Read after the schema's counts; a move finishing between the two reads is subtracted
    // without its allocation and free having been seen, hence the saturation.
    let moves = resizes.moves.load(Relaxed);
    AllocatorStats {
        live_granted_bytes: pool.granted_bytes,
        // Frees may name any size from the requested one to the class size, so the
        // requested figure can drift below zero; reported as 0, as a child's is.
        live_requested_bytes: Some(non_negative(pool.requested_bytes)),
        live_blocks: pool.live_blocks,
        allocations: pool.allocations.saturating_sub(moves),
        frees: pool.frees.saturating_sub(moves),
        reallocations: resizes.all.load(Relaxed),
        peak_granted_bytes: Some(pool.peak_granted_bytes),
        reserved_bytes: pool.reserved_bytes,
        over_budget: 0,
        budget_failures: 0,
        heap: None,
    }
}

/// A pool core's count of resizes (see [`to_stats`]).
struct Resizes {
    all: AtomicU64,
    moves: AtomicU64,
}

impl Resizes {
    const fn new() -> Self {
        Self {
            all: AtomicU64::new(0),
            moves: AtomicU64::new(0),
        }
    }

    /// Counts a finished resize of a block from `old_size` to `new_size` requested bytes.
    fn count(&self, result: Option<&(Allocation, usize)>, old_size: usize, new_size: usize) {
        if result.is_some() {
            self.all.fetch_add(1, Relaxed);
            if new_size != old_size {
                self.moves.fetch_add(1, Relaxed);
            }
        }
    }
}

/// Tells the budget hook about an allocation that takes the pool to `live` bytes, over the
/// budget in `settings` (the reading `live` was compared with), which the caller has already
/// decided to refuse or not (`refused`: from the same reading, and acted on). Called with no
/// lock held.
#[cold]
#[inline(never)]
fn notify_over_budget(
    registration: &'static Registration,
    settings: BudgetSettings,
    live: usize,
    request: usize,
    refused: bool,
    requested: usize,
) {
    let budget = registration.budget();
    let counters = registration.counters();
    let event = BudgetEvent {
        allocator: registration.name(),
        budget: settings.reported_limit(),
        live_bytes: live,
        request_bytes: request,
        count: counters.record_over_budget(),
        refused,
    };
    if refused {
        counters.record_budget_failure();
    }
    budget.notify(&event);
    if refused {
        crate::budget::note_refusal(registration, requested);
    }
}

/// Zeroes a whole block.
fn zero(block: Allocation) -> Allocation {
    // SAFETY: the block is live, ours, and `size` bytes long.
    unsafe { block.ptr.as_ptr().write_bytes(0, block.size) };
    block
}

/// A [`PoolSchema`] behind a spin lock: the `static` behind a `pool of …` handle.
///
/// `fork()`: the handle's registration carries a [`ForkLock`](crate::registry::ForkLock)
/// ([`hold_for_fork`](Self::hold_for_fork)), so the fork handlers take this lock before a
/// fork. The lock is therefore only ever taken once the pool is registered (the prepare
/// handler knows only registered pools): a pool never used reads as empty without it.
pub struct PoolCore<P: PageParent + Send> {
    schema: SpinLock<PoolSchema<P>>,
    /// The schema's geometry, readable without the lock.
    config: PoolConfig,
    resizes: Resizes,
}

impl<P: PageParent + Send> PoolCore<P> {
    /// A pool drawing pages from `parent`, with geometry `config`; allocates nothing yet.
    pub const fn new(parent: P, config: PoolConfig) -> Self {
        Self {
            schema: SpinLock::new(PoolSchema::with_config(parent, config)),
            config,
            resizes: Resizes::new(),
        }
    }

    /// The pool's geometry.
    pub fn config(&self) -> PoolConfig {
        self.config
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
        let block = self.allocate_unrecorded(registration, layout, zeroed, true)?;
        records::after_alloc(registration, block.ptr, layout, block.size);
        Some(block)
    }

    /// Allocates a block without recording it. `check_budget`: whether the budget applies
    /// (not to a resize that needs no more granted bytes).
    ///
    /// The budget is checked under the pool's lock *before* the schema allocates, with the
    /// block's class size added to the live figure: a refused request leaves no trace in
    /// the pool's figures (no allocation and free counted, no peak raised), and the mode is
    /// read once, so the block is refused or handed out, never both.
    #[inline]
    fn allocate_unrecorded(
        &self,
        registration: &'static Registration,
        layout: Layout,
        zeroed: bool,
        check_budget: bool,
    ) -> Option<Allocation> {
        registration.register();
        let schema = self.schema.lock();
        // `None` from `block_size`: out of the pool's range, which the schema refuses below.
        if check_budget
            && let settings = registration.budget().settings()
            && settings.is_set()
            && let Some(granted) = schema.config().block_size(layout)
            && let live = schema.granted_bytes() + granted
            && settings.exceeded_by(live)
        {
            let refused = settings.enforced();
            let block = if refused {
                None
            } else {
                Some(schema.allocate(layout)?)
            };
            drop(schema);
            notify_over_budget(
                registration,
                settings,
                live,
                granted,
                refused,
                layout.size(),
            );
            return block.map(|block| if zeroed { zero(block) } else { block });
        }
        let block = schema.allocate(layout)?;
        drop(schema);
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
        let result = unsafe {
            reallocate_recorded(
                self.config(),
                registration,
                ptr,
                layout,
                new_size,
                |l, grows| self.allocate_unrecorded(registration, l, false, grows),
                |p, l| self.deallocate_unrecorded(p, l),
            )
        };
        self.resizes.count(result.as_ref(), layout.size(), new_size);
        result
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

    /// Returns the pool's empty pages to its parent. Does nothing before `registration`
    /// (the pool's own) is registered: the pool has then never allocated.
    pub fn garbage_collect(&self, registration: &Registration) {
        if registration.is_registered() {
            self.schema.lock().garbage_collect();
        }
    }

    /// The pool's figures (all zero before `registration`, the pool's own, is registered:
    /// the pool has then never allocated).
    pub fn stats(&self, registration: &Registration) -> AllocatorStats {
        if !registration.is_registered() {
            return to_stats(PoolStats::default(), &self.resizes);
        }
        to_stats(self.schema.lock().stats(), &self.resizes)
    }

    /// Takes the pool's lock and keeps it: the `hold` of the pool's
    /// [`ForkLock`](crate::registry::ForkLock). Waits for any thread inside the pool.
    #[doc(hidden)]
    pub fn hold_for_fork(&self) {
        // SAFETY: leaving the lock held is sound; the fork handlers release it with
        // `release_after_fork` once the fork is over.
        unsafe { self.schema.lock_raw() };
    }

    /// Releases the lock taken by [`hold_for_fork`](Self::hold_for_fork).
    ///
    /// # Safety
    /// Once after each `hold_for_fork`, with no guard of the lock live on this thread.
    #[doc(hidden)]
    pub unsafe fn release_after_fork(&self) {
        // SAFETY: held through `lock_raw` by `hold_for_fork`, as the caller guarantees.
        unsafe { self.schema.force_unlock() };
    }
}

/// A [`ThreadPoolSchema`]: the `static` behind a `thread_pool of …` handle.
pub struct ThreadPoolCore<P: PageParent> {
    schema: ThreadPoolSchema<P>,
    resizes: Resizes,
}

impl<P: PageParent> ThreadPoolCore<P> {
    /// A thread pool drawing pages from `parent`, with geometry `config`.
    pub const fn new(parent: P, config: PoolConfig) -> Self {
        Self {
            schema: ThreadPoolSchema::with_config(parent, config),
            resizes: Resizes::new(),
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
        let block = self.allocate_unrecorded(registration, layout, zeroed, true)?;
        records::after_alloc(registration, block.ptr, layout, block.size);
        Some(block)
    }

    /// Allocates a block without recording it. `check_budget`: whether the budget applies
    /// (not to a resize that needs no more granted bytes).
    #[inline]
    fn allocate_unrecorded(
        &self,
        registration: &'static Registration,
        layout: Layout,
        zeroed: bool,
        check_budget: bool,
    ) -> Option<Allocation> {
        registration.register();
        if check_budget && registration.budget().is_set() {
            return self.allocate_budgeted(registration, layout, zeroed);
        }
        let block = self.schema.allocate(layout)?;
        Some(if zeroed { zero(block) } else { block })
    }

    /// [`allocate_unrecorded`](Self::allocate_unrecorded) while a budget is set.
    ///
    /// The live figure (a walk over every thread's heap) is checked with the block's class
    /// size added *before* the schema allocates, so a request over the budget leaves no
    /// trace in the pool's figures. Threads racing at the ceiling could all pass that
    /// check, so an allocation that passed it is checked again with every block counted,
    /// its own included; one found over then is given back (the only refusal that shows in
    /// the allocation and free counts). The budget is never overrun, and at the ceiling
    /// may be enforced a little early. The mode is read once per decision.
    #[cold]
    #[inline(never)]
    fn allocate_budgeted(
        &self,
        registration: &'static Registration,
        layout: Layout,
        zeroed: bool,
    ) -> Option<Allocation> {
        let settings = registration.budget().settings();
        // `None`: out of the pool's range, which the schema refuses (with its message).
        let Some(granted) = self.schema.config().block_size(layout) else {
            return self.schema.allocate(layout);
        };
        let live = self.schema.granted_bytes() + granted;
        let over = settings.exceeded_by(live);
        if over && settings.enforced() {
            notify_over_budget(registration, settings, live, granted, true, layout.size());
            return None;
        }
        let block = self.schema.allocate(layout)?;
        if over {
            notify_over_budget(registration, settings, live, granted, false, layout.size());
        } else {
            let live = self.schema.granted_bytes();
            if settings.exceeded_by(live) {
                let refused = settings.enforced();
                notify_over_budget(
                    registration,
                    settings,
                    live,
                    granted,
                    refused,
                    layout.size(),
                );
                if refused {
                    // SAFETY: just allocated with `layout`, handed to no one.
                    unsafe { self.schema.deallocate(block.ptr, layout) };
                    return None;
                }
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
        let result = unsafe {
            reallocate_recorded(
                self.config(),
                registration,
                ptr,
                layout,
                new_size,
                |l, grows| self.allocate_unrecorded(registration, l, false, grows),
                |p, l| self.deallocate_unrecorded(p, l),
            )
        };
        self.resizes.count(result.as_ref(), layout.size(), new_size);
        result
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
    /// Does nothing before `registration` (the pool's own) is registered, as for a
    /// [`PoolCore`].
    pub fn garbage_collect(&self, registration: &Registration) {
        if registration.is_registered() {
            self.schema.garbage_collect();
        }
    }

    /// The pool's figures, summed over every thread's heap (all zero before
    /// `registration`, the pool's own, is registered).
    pub fn stats(&self, registration: &Registration) -> AllocatorStats {
        if !registration.is_registered() {
            return to_stats(PoolStats::default(), &self.resizes);
        }
        to_stats(self.schema.stats(), &self.resizes)
    }

    /// Takes the lock of the pool's shared state, if it exists yet, and keeps it: the
    /// `hold` of the pool's [`ForkLock`](crate::registry::ForkLock).
    #[doc(hidden)]
    pub fn hold_for_fork(&self) {
        self.schema.hold_for_fork();
    }

    /// Releases what [`hold_for_fork`](Self::hold_for_fork) took.
    ///
    /// # Safety
    /// Once after each `hold_for_fork`, with no guard of the lock live on this thread.
    #[doc(hidden)]
    pub unsafe fn release_after_fork(&self) {
        // SAFETY: forwarded from the caller.
        unsafe { self.schema.release_after_fork() };
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
    allocate: impl FnOnce(Layout, bool) -> Option<Allocation>,
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
/// `deallocate` are the pool's; `allocate` is told whether the new block is bigger than
/// the old one, as only then may a budget refuse it (a shrink, or a move within the
/// class, ends with no more bytes live than before).
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
    allocate: impl FnOnce(Layout, bool) -> Option<Allocation>,
    deallocate: impl FnOnce(NonNull<u8>, Layout) -> usize,
) -> Option<(Allocation, usize)> {
    let old = config.block_size(layout)?;
    if new_size == layout.size() {
        return Some((Allocation { ptr, size: old }, old));
    }
    let new_layout = Layout::from_size_align(new_size, layout.align()).ok()?;
    let grows = config.block_size(new_layout).is_none_or(|new| new > old);
    let block = allocate(new_layout, grows)?;
    // SAFETY: distinct live blocks; the old one holds `layout.size()` bytes and is freed
    // once after the copy.
    unsafe {
        ptr.as_ptr()
            .copy_to_nonoverlapping(block.ptr.as_ptr(), layout.size().min(new_size));
    }
    deallocate(ptr, layout);
    Some((block, old))
}
