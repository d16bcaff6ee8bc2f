//! [`ThreadPoolSchema`]: a thread-safe pool with one pool (heap) per thread, as O3DE's
//! ThreadPoolSchema, without its three known faults.
//!
//! Each thread allocates from its own heap without locks or atomic read-modify-writes. A
//! block freed on the thread that owns its page goes straight back; a block freed on another
//! thread is pushed lock-free onto the owning heap's remote stack and taken back by the owner
//! when it next runs out of slots. What O3DE gets wrong, and this does not:
//! - **thread exit**: O3DE leaks an exited thread's pool until the schema dies. Here the
//!   thread-local table's destructor *abandons* the heap: its empty pages go to a shared list
//!   at once, and the heap itself (with the pages still holding live blocks) is adopted whole
//!   by the next thread that uses the pool;
//! - **garbage collection**: O3DE's `GarbageCollect` walks every thread's pool while those
//!   threads allocate. Here a collection touches only the calling thread's heap, abandoned
//!   heaps and the shared list (under the lock), and asks live threads, through an epoch, to
//!   return their own empty pages on their next slow path;
//! - **counters** (issue #13263): counts are kept per heap by the thread doing the work, with
//!   plain stores, and summed; a cross-thread free is counted by the freeing thread, so the
//!   sum is exact.
//!
//! Per-thread bookkeeping (the heaps, and the shared core) is memory from the parent, never
//! from the global allocator, so the schema can sit under (or inside) a global allocator.
//! A thread whose thread-local storage is already torn down (a late destructor freeing a
//! block) uses a fallback heap under a lock.

mod heap;
mod registry;
mod remote;

use super::pool::page::{EmptyList, PageHeader, check_owner, marker, owner_of, page_of};
use super::pool::{PoolConfig, PoolStats, class_for_free, next_uid, report_refused};
use super::{Allocation, PageParent};
use crate::fatal::fatal;
use crate::stats::non_negative;
use crate::system::SystemAllocator;
use core::alloc::Layout;
use core::ptr::{NonNull, null_mut};
use core::sync::atomic::{
    AtomicBool, AtomicPtr,
    Ordering::{AcqRel, Acquire, Relaxed},
};
use heap::{Core, LOCAL_EMPTY_PAGES, ThreadHeap};
use registry::Lookup;

pub use registry::SLOTS;

/// A thread-safe pool of fixed size classes: one heap per thread, pages from a parent.
///
/// Constructible in a `static` (no lazy heap: the shared state is allocated from the parent
/// on first use), and usable from any thread at any time, including from thread-local
/// destructors. Up to [`SLOTS`] thread pools can have per-thread heaps at once; pools beyond
/// that (and threads whose thread-locals are gone) are served by a shared heap under a lock.
///
/// Blocks a thread frees into its own heap wait in per-class bins, as in a [`PoolSchema`],
/// until the thread needs a page, is collected or exits.
///
/// [`PoolSchema`]: crate::schema::pool::PoolSchema
///
/// ```
/// use core::alloc::Layout;
/// use tagalloc::schema::{PoolConfig, ThreadPoolSchema};
///
/// static POOL: ThreadPoolSchema<std::alloc::System> = ThreadPoolSchema::with_config(
///     std::alloc::System,
///     PoolConfig::DEFAULT.with_name("jobs"),
/// );
///
/// let layout = Layout::new::<[u32; 10]>();
/// let block = POOL.allocate(layout).expect("out of memory");
/// let addr = block.ptr.as_ptr() as usize;
/// // Freed on another thread: pushed onto this thread's heap's remote list.
/// std::thread::spawn(move || {
///     let ptr = core::ptr::NonNull::new(addr as *mut u8).unwrap();
///     // SAFETY: the block came from POOL with this layout and is freed once.
///     unsafe { POOL.deallocate(ptr, layout) };
/// })
/// .join()
/// .unwrap();
/// assert_eq!(POOL.stats().live_blocks, 0);
/// ```
pub struct ThreadPoolSchema<P: PageParent = SystemAllocator> {
    parent: P,
    config: PoolConfig,
    /// The shared state, allocated from the parent on first use; null before.
    core: AtomicPtr<Core>,
    /// Whether a refused request was already noted on stderr.
    refusal_noted: AtomicBool,
    /// The core whose lock the fork handlers hold (see `hold_for_fork`); null otherwise.
    fork_held: AtomicPtr<Core>,
}

impl<P: PageParent> ThreadPoolSchema<P> {
    /// A thread pool with O3DE's default geometry ([`PoolConfig::DEFAULT`]); allocates
    /// nothing until its first request.
    pub const fn new(parent: P) -> Self {
        Self::with_config(parent, PoolConfig::DEFAULT)
    }

    /// A thread pool with the given geometry; allocates nothing until its first request.
    pub const fn with_config(parent: P, config: PoolConfig) -> Self {
        Self {
            parent,
            config,
            core: AtomicPtr::new(null_mut()),
            refusal_noted: AtomicBool::new(false),
            fork_held: AtomicPtr::new(null_mut()),
        }
    }

    /// The pool's geometry.
    pub fn config(&self) -> &PoolConfig {
        &self.config
    }

    /// The parent the pages come from.
    pub fn parent(&self) -> &P {
        &self.parent
    }

    /// The shared state, creating it on first use; `None` if the parent is out of memory.
    #[inline]
    fn core(&self) -> Option<&Core> {
        let core = self.core.load(Acquire);
        if core.is_null() {
            return self.create_core();
        }
        // SAFETY: a published core lives until the schema drops.
        Some(unsafe { &*core })
    }

    #[cold]
    fn create_core(&self) -> Option<&Core> {
        let core_mem = self
            .parent
            .allocate_page(Layout::new::<Core>())?
            .cast::<Core>();
        let Some(fallback_mem) = self.parent.allocate_page(Layout::new::<ThreadHeap>()) else {
            // SAFETY: allocated just above with this layout.
            unsafe {
                self.parent
                    .free_page(core_mem.cast(), Layout::new::<Core>())
            };
            return None;
        };
        let fallback = fallback_mem.as_ptr().cast::<ThreadHeap>();
        let uid = next_uid();
        let slot = registry::claim_slot(uid);
        let core = core_mem.as_ptr();
        // Counted as the parent counts them, at their granted sizes.
        // SAFETY: both are live blocks the parent just handed out with these layouts.
        let bookkeeping = unsafe {
            self.parent
                .granted_size(core_mem.cast(), Layout::new::<Core>())
                + self
                    .parent
                    .granted_size(fallback_mem, Layout::new::<ThreadHeap>())
        };
        // SAFETY: both blocks are fresh, sized and aligned for their types; nothing else
        // refers to them until the core is published by the CAS below.
        unsafe {
            core.write(Core::new(self.config, uid, slot));
            fallback.write(ThreadHeap::new(core, &self.config));
            (*core).fallback = fallback;
            (*core).bookkeeping.store(bookkeeping, Relaxed);
            let held = (*core).lock.lock();
            (*core).link_heap(fallback, &held);
        }
        // Published under the fork gate, so a fork's prepare handler either sees the core
        // (and takes its lock) or finishes before anyone can take it.
        let published = crate::fork::publish(|| {
            self.core
                .compare_exchange(null_mut(), core, AcqRel, Acquire)
        });
        match published {
            // SAFETY: published; lives until the schema drops.
            Ok(_) => Some(unsafe { &*core }),
            Err(existing) => {
                // Another thread won the race: undo ours.
                registry::release_slot(slot, uid);
                // SAFETY: ours was never published; both blocks came from the parent.
                unsafe {
                    self.parent
                        .free_page(fallback_mem, Layout::new::<ThreadHeap>());
                    self.parent
                        .free_page(core_mem.cast(), Layout::new::<Core>());
                    Some(&*existing)
                }
            }
        }
    }

    /// Takes the shared state's lock, if the state exists yet, and keeps it, for `fork()`:
    /// the lock guards the shared page list, abandoned heaps and the fallback heap, which a
    /// thread the child does not have could otherwise leave locked or half updated.
    pub(crate) fn hold_for_fork(&self) {
        let core = self.core.load(Acquire);
        if !core.is_null() {
            // SAFETY: a published core lives until the schema drops; leaving its lock held
            // is sound, and `release_after_fork` releases it.
            unsafe { (*core).lock.lock_raw() };
        }
        self.fork_held.store(core, Relaxed);
    }

    /// Releases the lock taken by [`hold_for_fork`](Self::hold_for_fork), if it took one.
    ///
    /// # Safety
    /// Once after each `hold_for_fork`, with no guard of the lock live on this thread.
    pub(crate) unsafe fn release_after_fork(&self) {
        let core = self.fork_held.swap(null_mut(), Relaxed);
        if !core.is_null() {
            // SAFETY: `hold_for_fork` took this core's lock with `lock_raw`; the caller
            // guarantees no guard of it is live.
            unsafe { (*core).lock.force_unlock() };
        }
    }

    /// The calling thread's heap: found, created or adopted; `None` when the thread has no
    /// thread-local storage (or the schema no slot), in which case the fallback heap serves.
    #[inline]
    fn thread_heap(&self, core: &Core) -> Option<&ThreadHeap> {
        match registry::lookup(core.slot, core.uid) {
            // SAFETY: heaps live as long as the core.
            Lookup::Found(heap) => Some(unsafe { &*heap }),
            Lookup::Missing => self.attach(core),
            Lookup::Gone => None,
        }
    }

    /// Gives the calling thread a heap: an abandoned one if any, else a new one.
    #[cold]
    fn attach(&self, core: &Core) -> Option<&ThreadHeap> {
        let adopted = core.lock.lock().pop_abandoned();
        let heap = match adopted {
            Some(heap) => heap,
            None => {
                let mem = self.parent.allocate_page(Layout::new::<ThreadHeap>())?;
                let heap = mem.as_ptr().cast::<ThreadHeap>();
                // SAFETY: fresh memory sized and aligned for a heap; published under the lock.
                unsafe {
                    heap.write(ThreadHeap::new(core, &self.config));
                    let held = core.lock.lock();
                    core.link_heap(heap, &held);
                }
                // SAFETY: `mem` is the live block just allocated with this layout.
                let granted = unsafe { self.parent.granted_size(mem, Layout::new::<ThreadHeap>()) };
                core.bookkeeping.fetch_add(granted, Relaxed);
                heap
            }
        };
        if registry::install(core.slot, core.uid, heap) {
            // SAFETY: heaps live as long as the core.
            Some(unsafe { &*heap })
        } else {
            // SAFETY: nobody uses the heap; park it for another thread.
            unsafe { core.lock.lock().push_abandoned(heap) };
            None
        }
    }

    /// Allocates a block for `layout`: `None` when the request is outside the pool's range
    /// or the parent is out of memory. The pool's first refused request is noted on stderr
    /// with the pool's name and range.
    #[inline]
    pub fn allocate(&self, layout: Layout) -> Option<Allocation> {
        let Some(class) = self.config.class_of(layout) else {
            let first = !self.refusal_noted.swap(true, Relaxed);
            report_refused(&self.config, layout, first);
            return None;
        };
        let core = self.core()?;
        let Some(heap) = self.thread_heap(core) else {
            return self.allocate_fallback(core, class, layout);
        };
        // SAFETY: this thread is the heap's user; the borrow ends before any other. `class`
        // is below the class count.
        let mut slot = unsafe {
            let local = heap.local();
            local.bins.allocate(&mut local.pages, class, &self.config)
        };
        if slot.is_null() {
            slot = self.refill(core, heap, class)?;
        }
        let elem = self.config.class_size(class);
        heap.counters.note_alloc(elem, layout.size());
        // SAFETY: as above.
        let local = unsafe { heap.local() };
        local.unpublished += elem as isize;
        if local.unpublished >= self.config.page_size() as isize {
            core.publish(local);
        }
        Some(Allocation {
            // SAFETY: slots are inside pages, never null.
            ptr: unsafe { NonNull::new_unchecked(slot) },
            size: elem,
        })
    }

    /// The slow path of a thread's allocation: take back remote frees, honour a collection
    /// request, then install a page (the heap's own empty one, a shared one, or a new one
    /// from the parent) and allocate from it.
    #[cold]
    fn refill(&self, core: &Core, heap: &ThreadHeap, class: usize) -> Option<*mut u8> {
        // SAFETY: this thread is the heap's user throughout; each borrow of the local state
        // ends before the next is taken and before the parent is called.
        unsafe {
            heap.drain_remote(core);
            self.page_emptied(core, heap);
            let slot = heap.local().pages.allocate(class);
            if !slot.is_null() {
                return Some(slot);
            }
            let mut empty = heap.local().pages.pop_empty();
            // Blocks waiting in the bins may be all that keeps a page from emptying: give
            // them back before taking a page from elsewhere.
            if empty.is_none() && heap.flush_bins(core) > 0 {
                empty = heap.local().pages.pop_empty();
            }
            let page = match empty {
                Some(page) => {
                    core.free_pages.fetch_sub(1, Relaxed);
                    page
                }
                None => self.take_page(core)?,
            };
            let local = heap.local();
            local.pages.install(
                page,
                class,
                &self.config,
                core.key,
                heap as *const ThreadHeap as *const u8,
            );
            Some(local.pages.allocate(class))
        }
    }

    /// After the heap may have gained empty pages (a local free emptied one, or remote frees
    /// were taken back): honour a pending collection, or share the empty pages beyond the few
    /// the heap keeps, so that other threads can use them and collections can return them.
    ///
    /// # Safety
    /// The caller must be the heap's user, with no borrow of its local state live.
    #[cold]
    unsafe fn page_emptied(&self, core: &Core, heap: &ThreadHeap) {
        // SAFETY: forwarded from the caller; each borrow ends before the next.
        unsafe {
            let epoch = core.gc_epoch.load(Relaxed);
            if heap.local().seen_epoch != epoch {
                heap.local().seen_epoch = epoch;
                self.release_heap_empties(core, heap);
            } else if heap.local().pages.empty_count() > LOCAL_EMPTY_PAGES {
                heap.spill_empty(&mut core.lock.lock(), LOCAL_EMPTY_PAGES);
            }
        }
    }

    /// A page for a heap: from the shared list, else new from the parent.
    fn take_page(&self, core: &Core) -> Option<*mut PageHeader> {
        if let Some(page) = core.lock.lock().free.pop() {
            core.free_pages.fetch_sub(1, Relaxed);
            return Some(page);
        }
        let page = self.parent.allocate_page(self.config.page_layout())?;
        core.pages.fetch_add(1, Relaxed);
        Some(page.as_ptr().cast())
    }

    /// Returns a page serving no class to the parent.
    ///
    /// # Safety
    /// `page` must be an empty page of this schema, in no list, counted in `free_pages`.
    unsafe fn release_page(&self, core: &Core, page: *mut PageHeader) {
        // SAFETY: pages come from the parent with the page layout.
        unsafe {
            self.parent.free_page(
                NonNull::new_unchecked(page.cast()),
                self.config.page_layout(),
            )
        };
        core.pages.fetch_sub(1, Relaxed);
        core.free_pages.fetch_sub(1, Relaxed);
    }

    /// Returns every empty page of the calling thread's heap to the parent.
    ///
    /// # Safety
    /// The caller must be the heap's user, with no borrow of its local state live.
    unsafe fn release_heap_empties(&self, core: &Core, heap: &ThreadHeap) {
        // SAFETY: the caller is the heap's user; the borrow ends before the parent is called.
        unsafe {
            heap.flush_bins(core);
            let moved = heap.local().pages.collect_empty_partials();
            core.free_pages.fetch_add(moved, Relaxed);
            while let Some(page) = heap.local().pages.pop_empty() {
                self.release_page(core, page);
            }
        }
    }

    /// Allocation for a thread without thread-local storage: the fallback heap, under the
    /// lock.
    #[cold]
    fn allocate_fallback(&self, core: &Core, class: usize, layout: Layout) -> Option<Allocation> {
        let fb = core.fallback;
        let elem = self.config.class_size(class);
        loop {
            {
                let mut shared = core.lock.lock();
                // SAFETY: the lock makes us the fallback heap's user.
                unsafe {
                    let h = &*fb;
                    h.drain_remote(core);
                    let mut slot = h.local().pages.allocate(class);
                    if slot.is_null() {
                        let page = match h.local().pages.pop_empty() {
                            Some(page) => Some(page),
                            None => shared.free.pop(),
                        };
                        if let Some(page) = page {
                            core.free_pages.fetch_sub(1, Relaxed);
                            let local = h.local();
                            local.pages.install(
                                page,
                                class,
                                &self.config,
                                core.key,
                                fb as *const u8,
                            );
                            slot = local.pages.allocate(class);
                        }
                    }
                    if !slot.is_null() {
                        h.counters.note_alloc(elem, layout.size());
                        let local = h.local();
                        local.unpublished += elem as isize;
                        core.publish(local);
                        return Some(Allocation {
                            ptr: NonNull::new_unchecked(slot),
                            size: elem,
                        });
                    }
                }
            }
            // No page anywhere: get one from the parent outside the lock, share it, retry.
            let page = self.parent.allocate_page(self.config.page_layout())?;
            core.pages.fetch_add(1, Relaxed);
            core.free_pages.fetch_add(1, Relaxed);
            // SAFETY: a fresh page of this schema, in no list.
            unsafe { core.lock.lock().free.push(page.as_ptr().cast()) };
        }
    }

    /// Frees a block, from any thread.
    ///
    /// # Safety
    /// `ptr` must have been returned by this schema's [`allocate`](Self::allocate) (on any
    /// thread) for a layout with the same alignment as `layout` and a size between the one
    /// requested and the one granted, and not freed since. A block of another pool and a
    /// layout of another class abort the process with a message naming the pool; in debug
    /// builds (or with feature `checked`) so do double frees and interior pointers, when the
    /// owning heap takes the block back.
    #[inline]
    pub unsafe fn deallocate(&self, ptr: NonNull<u8>, layout: Layout) {
        let class = class_for_free(&self.config, ptr, layout);
        let core = self.core.load(Acquire);
        if core.is_null() {
            fatal!(
                "pool '{}': free of {:p}, but this pool never allocated",
                self.config.name(),
                ptr
            );
        }
        // SAFETY: a published core lives until the schema drops.
        let core = unsafe { &*core };
        let slot = ptr.as_ptr();
        let page = page_of(slot, self.config.page_size());
        // SAFETY: for a block of this pool (the caller's contract) the page is a live page of
        // this pool; the check aborts on anything else it can recognise.
        unsafe { check_owner(page, slot, class, marker(page, core.key), &self.config) };
        let elem = self.config.class_size(class);
        let Some(heap) = self.thread_heap(core) else {
            // SAFETY: forwarded from the caller; the owner check passed.
            return unsafe { self.deallocate_fallback(core, page, slot, elem, layout) };
        };
        heap.counters.note_free(elem, layout.size());
        // SAFETY: the block is live, so its page's owner is stable; this thread is `heap`'s
        // user, and each borrow of its local state ends before the next.
        unsafe {
            let owner = owner_of(page);
            if owner == heap as *const ThreadHeap as *const u8 {
                let local = heap.local();
                let emptied = local
                    .bins
                    .free(&mut local.pages, page, slot, class, &self.config);
                if emptied > 0 {
                    core.free_pages.fetch_add(emptied, Relaxed);
                    self.page_emptied(core, heap);
                }
            } else {
                (*owner.cast::<ThreadHeap>()).push_remote(slot);
            }
            let local = heap.local();
            local.unpublished -= elem as isize;
            if local.unpublished <= -(self.config.page_size() as isize) {
                core.publish(local);
            }
        }
    }

    /// A free by a thread without thread-local storage, counted on the fallback heap.
    ///
    /// # Safety
    /// As for [`deallocate`](Self::deallocate), with the owner check done.
    #[cold]
    unsafe fn deallocate_fallback(
        &self,
        core: &Core,
        page: *mut PageHeader,
        slot: *mut u8,
        elem: usize,
        layout: Layout,
    ) {
        let fb = core.fallback;
        let mut shared = core.lock.lock();
        // SAFETY: the lock makes us the fallback heap's user; the block is live, so its
        // page's owner is stable.
        unsafe {
            let h = &*fb;
            h.counters.note_free(elem, layout.size());
            let local = h.local();
            local.unpublished -= elem as isize;
            core.publish(local);
            let owner = owner_of(page);
            if owner == fb as *const u8 {
                if h.local().pages.free(page, slot, &self.config) {
                    h.local().pages.push_empty(page);
                    core.free_pages.fetch_add(1, Relaxed);
                    h.spill_empty(&mut shared, 0);
                }
            } else {
                (*owner.cast::<ThreadHeap>()).push_remote(slot);
            }
        }
    }

    /// Returns empty pages to the parent: the calling thread's, those of exited threads and
    /// of the fallback heap (after taking back their remote frees), and the shared list.
    /// Other live threads are asked to return theirs on their next slow path. Safe to call
    /// from any thread while others allocate and free.
    pub fn garbage_collect(&self) {
        let core = self.core.load(Acquire);
        if core.is_null() {
            return;
        }
        // SAFETY: a published core lives until the schema drops.
        let core = unsafe { &*core };
        let epoch = core.gc_epoch.fetch_add(1, Relaxed) + 1;
        if let Lookup::Found(heap) = registry::lookup(core.slot, core.uid) {
            // SAFETY: this thread is the heap's user.
            unsafe {
                let heap = &*heap;
                heap.drain_remote(core);
                heap.local().seen_epoch = epoch;
                self.release_heap_empties(core, heap);
            }
        }
        // Take back what exited threads and the fallback heap can give, then empty the
        // shared list; the parent is called outside the lock.
        let mut taken = {
            let mut shared = core.lock.lock();
            let fallback: [*mut ThreadHeap; 1] = [core.fallback];
            for heap in shared.abandoned().chain(fallback) {
                // SAFETY: the lock makes us the user of abandoned heaps and of the fallback
                // heap.
                unsafe {
                    let h = &*heap;
                    h.drain_remote(core);
                    h.flush_bins(core);
                    let moved = h.local().pages.collect_empty_partials();
                    core.free_pages.fetch_add(moved, Relaxed);
                    h.spill_empty(&mut shared, 0);
                }
            }
            core::mem::replace(&mut shared.free, EmptyList::new())
        };
        while let Some(page) = taken.pop() {
            // SAFETY: an empty page of this schema, taken out of the shared list.
            unsafe { self.release_page(core, page) };
        }
    }

    /// Bytes granted to live blocks, summed over every thread's heap: `stats().granted_bytes`
    /// without the rest of the snapshot, and without raising the recorded peak (for a
    /// budget check before an allocation that may be refused).
    pub fn granted_bytes(&self) -> usize {
        self.published_core()
            .map_or(0, |core| HeapSums::of(core).granted)
    }

    /// The core, once the first allocation has published it.
    fn published_core(&self) -> Option<&Core> {
        // SAFETY: a published core lives until the schema drops.
        unsafe { self.core.load(Acquire).as_ref() }
    }

    /// A snapshot of the pool's counters.
    ///
    /// Each heap's counters are read one after another, so while other threads allocate
    /// the figures are a moment's approximation; when they are quiescent, every figure is
    /// exact, cross-thread frees included.
    ///
    /// `peak_granted_bytes` is kept without a shared atomic on the fast path: each heap
    /// publishes its granted bytes to a shared total when they have moved by a page since
    /// its last publication, and the peak is the most that total (or an exact sum taken by
    /// this method) has been. It can therefore differ from the true peak by less than one
    /// page per heap (`page_size × thread_heaps`).
    pub fn stats(&self) -> PoolStats {
        let Some(core) = self.published_core() else {
            return PoolStats::default();
        };
        let HeapSums {
            allocations,
            frees,
            granted,
            requested,
        } = HeapSums::of(core);
        let peak = core.peak.fetch_max(granted, Relaxed).max(granted);
        let pages = core.pages.load(Relaxed);
        let bookkeeping = core.bookkeeping.load(Relaxed);
        PoolStats {
            granted_bytes: granted,
            requested_bytes: requested,
            live_blocks: allocations.saturating_sub(frees) as usize,
            allocations,
            frees,
            peak_granted_bytes: peak,
            reserved_bytes: pages * self.config.page_size() + bookkeeping,
            pages,
            free_pages: core.free_pages.load(Relaxed),
            bookkeeping_bytes: bookkeeping,
            thread_heaps: core.heap_count.load(Relaxed),
        }
    }

    /// Checks every heap's page lists and that pages, blocks and counters add up. Takes
    /// `&mut self` so that no thread is inside the pool (exiting threads are excluded by the
    /// lock). Meant for tests.
    pub fn validate(&mut self) -> Result<(), &'static str> {
        let core = *self.core.get_mut();
        if core.is_null() {
            return Ok(());
        }
        // SAFETY: the core lives until drop; with `&mut self` no thread is using any heap,
        // and thread exits wait for the lock we hold.
        unsafe {
            let core = &*core;
            let shared = core.lock.lock();
            let (mut live_slots, mut pages, mut waiting) = (0usize, 0usize, 0usize);
            let (mut allocations, mut frees, mut empties) = (0u64, 0u64, 0usize);
            for heap in core.heaps() {
                let h = &*heap;
                let cached = h.local().bins.validate(&self.config)?;
                let (used, held) = h.local().pages.validate(&self.config)?;
                // Pages count the blocks waiting in the bins as used.
                live_slots += used
                    .checked_sub(cached)
                    .ok_or("more blocks cached than used")?;
                pages += held;
                empties += h.local().pages.empty_count();
                waiting += h.remote_len();
                allocations += h.counters.allocations.load(Relaxed);
                frees += h.counters.frees.load(Relaxed);
            }
            let shared_free = shared.free.validate()?;
            if live_slots.checked_sub(waiting) != Some(allocations.wrapping_sub(frees) as usize) {
                return Err("live slots (less remote frees) differ from the block count");
            }
            if pages + shared_free != core.pages.load(Relaxed) {
                return Err("pages in lists differ from pages held");
            }
            if empties + shared_free != core.free_pages.load(Relaxed) {
                return Err("empty pages in lists differ from the free page count");
            }
        }
        Ok(())
    }
}

impl<P: PageParent> Drop for ThreadPoolSchema<P> {
    fn drop(&mut self) {
        let core = *self.core.get_mut();
        if core.is_null() {
            return;
        }
        // SAFETY: the core is ours: once its slot is released no exiting thread touches it and
        // `&mut self` keeps others out; pages, heaps and core came from the parent as used here.
        unsafe {
            registry::release_slot((*core).slot, (*core).uid);
            let page_layout = self.config.page_layout();
            let parent = &self.parent;
            let free_page = |page: *mut PageHeader| {
                parent.free_page(NonNull::new_unchecked(page.cast()), page_layout)
            };
            let mut shared = (*core).lock.lock();
            while let Some(page) = shared.free.pop() {
                free_page(page);
            }
            drop(shared);
            // The iterator reads a heap's link before yielding it, so the heap can be freed.
            for heap in (*core).heaps() {
                (*heap).local().pages.release_all(free_page);
                parent.free_page(
                    NonNull::new_unchecked(heap.cast()),
                    Layout::new::<ThreadHeap>(),
                );
            }
            core.drop_in_place();
            parent.free_page(NonNull::new_unchecked(core.cast()), Layout::new::<Core>());
        }
    }
}

/// Every thread heap's counters of a core, added up.
struct HeapSums {
    allocations: u64,
    frees: u64,
    granted: usize,
    requested: usize,
}

impl HeapSums {
    fn of(core: &Core) -> Self {
        let mut sums = Self {
            allocations: 0,
            frees: 0,
            granted: 0,
            requested: 0,
        };
        for heap in core.heaps() {
            // SAFETY: heaps live as long as the core; counters are atomics.
            let c = unsafe { &(*heap).counters };
            sums.allocations += c.allocations.load(Relaxed);
            sums.frees += c.frees.load(Relaxed);
            sums.granted = sums.granted.wrapping_add(c.granted.load(Relaxed));
            sums.requested = sums.requested.wrapping_add(c.requested.load(Relaxed));
        }
        // Mid-flight reads can put a free before its allocation: never report less than 0.
        sums.granted = non_negative(sums.granted);
        sums.requested = non_negative(sums.requested);
        sums
    }
}

#[cfg(test)]
mod tests;
