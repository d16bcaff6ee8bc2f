//! The thread pool's per-thread heaps and the state they share (the core).
//!
//! A [`ThreadHeap`] is one thread's pool: the page lists of `pool/page.rs`, used by its owner
//! without locks or atomic read-modify-writes, plus a lock-free stack of *remote* frees that
//! other threads push onto and the owner drains. Its counters are written only by the thread
//! using the heap (loads and stores, no RMW) and read by anyone, so the sum over heaps is
//! exact: a block freed on another thread is counted as freed by *that* thread's heap, which
//! may make one heap's figures "negative" (wrapping) but never the sum (O3DE issue #13263).
//!
//! Heaps are never freed while the schema lives. When a thread exits its heap is
//! *abandoned*: remote frees are drained, empty pages go to the core's shared list (for any
//! thread to reuse, and for `garbage_collect` to return), and the heap — with the pages that
//! still hold live blocks — waits in the core's abandoned list until a new thread adopts it
//! whole. Frees of blocks in an abandoned heap's pages keep going to its remote stack, which
//! the adopter (or a collection) drains. So the number of heaps is bounded by the number of
//! threads using the pool *at once*, and no page is ever leaked (O3DE leaks them).
//!
//! The core's lock guards the shared page list, the abandoned list, the state of abandoned
//! heaps, and the fallback heap (used, under the lock, by threads whose thread-local storage
//! is gone).
//!
//! Nothing here calls the parent allocator; the generic schema does, outside any lock.

use super::remote::{Link, RemoteStack};
use crate::schema::pool::PoolConfig;
use crate::schema::pool::bins::Bins;
use crate::schema::pool::page::{EmptyList, FreeSlot, Pages, marker_key};
use crate::sync::{SpinGuard, SpinLock};
use core::cell::UnsafeCell;
use core::ptr::null_mut;
use core::sync::atomic::{
    AtomicIsize, AtomicPtr, AtomicU64, AtomicUsize,
    Ordering::{Acquire, Relaxed, Release},
};

/// Empty pages a heap keeps for itself before handing more to the shared list.
pub(crate) const LOCAL_EMPTY_PAGES: usize = 2;

/// Counters written by one thread at a time (the heap's user) and read by any.
#[derive(Default)]
pub(crate) struct Counters {
    pub(crate) allocations: AtomicU64,
    pub(crate) frees: AtomicU64,
    /// Granted bytes allocated minus freed through this heap (wrapping).
    pub(crate) granted: AtomicUsize,
    /// Requested bytes allocated minus freed through this heap (wrapping).
    pub(crate) requested: AtomicUsize,
}

/// Adds to a single-writer counter without a read-modify-write instruction.
#[inline]
fn bump(counter: &AtomicUsize, delta: usize) {
    counter.store(counter.load(Relaxed).wrapping_add(delta), Relaxed);
}

impl Counters {
    /// Records an allocation. Only the heap's current user may call this.
    #[inline]
    pub(crate) fn note_alloc(&self, granted: usize, requested: usize) {
        self.allocations
            .store(self.allocations.load(Relaxed) + 1, Relaxed);
        bump(&self.granted, granted);
        bump(&self.requested, requested);
    }

    /// Records a free. Only the heap's current user may call this.
    #[inline]
    pub(crate) fn note_free(&self, granted: usize, requested: usize) {
        self.frees.store(self.frees.load(Relaxed) + 1, Relaxed);
        bump(&self.granted, granted.wrapping_neg());
        bump(&self.requested, requested.wrapping_neg());
    }
}

/// The part of a heap only its user touches.
pub(crate) struct HeapLocal {
    /// Blocks this thread freed into its own pages, waiting for reuse (see `pool/bins.rs`).
    pub(crate) bins: Bins,
    pub(crate) pages: Pages,
    /// Granted bytes not yet added to the core's published total (for the peak).
    pub(crate) unpublished: isize,
    /// The collection epoch this heap last honoured.
    pub(crate) seen_epoch: usize,
}

/// An atomic on a cache line of its own, so remote frees do not slow down the owner.
#[repr(align(128))]
pub(crate) struct Padded<T>(pub(crate) T);

/// One thread's pool (or the shared fallback heap).
#[repr(C, align(128))]
pub(crate) struct ThreadHeap {
    /// Used only by the heap's user: its owning thread, or whoever holds the core lock
    /// while the heap is abandoned or is the fallback heap.
    local: UnsafeCell<HeapLocal>,
    pub(crate) counters: Counters,
    pub(crate) core: *const Core,
    /// Next heap in the core's list of all heaps; written once before the heap is published.
    next: *mut ThreadHeap,
    /// Next heap in the core's abandoned list (core lock).
    abandoned_next: UnsafeCell<*mut ThreadHeap>,
    /// Blocks of this heap's pages freed by other threads (a lock-free stack).
    remote: Padded<RemoteStack<FreeSlot>>,
}

/// The state all heaps of one schema share, on memory from the parent so that the schema
/// value itself may move.
pub(crate) struct Core {
    pub(crate) config: PoolConfig,
    /// Unique id of the schema (page markers, thread-local table entries).
    pub(crate) uid: usize,
    /// The page-marker key made from `uid`.
    pub(crate) key: usize,
    /// Index in the thread-local tables, or `registry::NO_SLOT`.
    pub(crate) slot: usize,
    pub(crate) lock: SpinLock<Shared>,
    /// Every heap ever created (push-only until the schema drops), newest first.
    pub(crate) heaps: AtomicPtr<ThreadHeap>,
    pub(crate) heap_count: AtomicUsize,
    /// The heap used under the lock by threads without thread-local storage.
    pub(crate) fallback: *mut ThreadHeap,
    /// Pages held from the parent.
    pub(crate) pages: AtomicUsize,
    /// Of those, pages serving no class (heap caches and the shared list).
    pub(crate) free_pages: AtomicUsize,
    /// Bytes of bookkeeping (the core and the heaps) held from the parent.
    pub(crate) bookkeeping: AtomicUsize,
    /// Granted bytes published by the heaps, and the most ever published.
    pub(crate) published: AtomicIsize,
    pub(crate) peak: AtomicUsize,
    /// Bumped by `garbage_collect`; a heap seeing a new value returns its empty pages.
    pub(crate) gc_epoch: AtomicUsize,
}

/// What the core lock guards.
pub(crate) struct Shared {
    /// Empty pages any heap may take.
    pub(crate) free: EmptyList,
    /// Heaps whose thread exited, waiting for adoption.
    abandoned: *mut ThreadHeap,
}

// SAFETY: the pointers refer to pages and heaps owned by the core; access is serialised by
// the lock that wraps this value.
unsafe impl Send for Shared {}

impl Shared {
    pub(crate) const fn new() -> Self {
        Self {
            free: EmptyList::new(),
            abandoned: null_mut(),
        }
    }

    /// Takes an abandoned heap for adoption.
    pub(crate) fn pop_abandoned(&mut self) -> Option<*mut ThreadHeap> {
        let heap = self.abandoned;
        if heap.is_null() {
            return None;
        }
        // SAFETY: abandoned heaps are valid; their link is guarded by the lock we hold.
        self.abandoned = unsafe { *(*heap).abandoned_next.get() };
        Some(heap)
    }

    /// Puts a heap nobody uses in the abandoned list.
    ///
    /// # Safety
    /// `heap` must be a heap of this core that no thread uses any more and that is in no
    /// abandoned list.
    pub(crate) unsafe fn push_abandoned(&mut self, heap: *mut ThreadHeap) {
        // SAFETY: the heap is valid; its link is guarded by the lock we hold.
        unsafe { *(*heap).abandoned_next.get() = self.abandoned };
        self.abandoned = heap;
    }

    /// The abandoned heaps, for a collection under the lock.
    pub(crate) fn abandoned(&self) -> AbandonedIter {
        AbandonedIter {
            next: self.abandoned,
        }
    }
}

/// Walks the abandoned list (the core lock must be held throughout).
pub(crate) struct AbandonedIter {
    next: *mut ThreadHeap,
}

impl Iterator for AbandonedIter {
    type Item = *mut ThreadHeap;
    fn next(&mut self) -> Option<*mut ThreadHeap> {
        let heap = self.next;
        if heap.is_null() {
            return None;
        }
        // SAFETY: abandoned heaps are valid and their links stable under the lock.
        self.next = unsafe { *(*heap).abandoned_next.get() };
        Some(heap)
    }
}

impl Core {
    pub(crate) const fn new(config: PoolConfig, uid: usize, slot: usize) -> Self {
        Self {
            config,
            uid,
            key: marker_key(uid),
            slot,
            lock: SpinLock::new(Shared::new()),
            heaps: AtomicPtr::new(null_mut()),
            heap_count: AtomicUsize::new(0),
            fallback: null_mut(),
            pages: AtomicUsize::new(0),
            free_pages: AtomicUsize::new(0),
            bookkeeping: AtomicUsize::new(0),
            published: AtomicIsize::new(0),
            peak: AtomicUsize::new(0),
            gc_epoch: AtomicUsize::new(0),
        }
    }

    /// Adds a new heap to the list of all heaps. The caller holds the core lock (so two
    /// pushes never race); readers walk the list without it.
    ///
    /// # Safety
    /// `heap` must be a fully initialised heap of this core, in no list.
    pub(crate) unsafe fn link_heap(&self, heap: *mut ThreadHeap, _held: &SpinGuard<'_, Shared>) {
        // SAFETY: the heap is not published yet, so nobody else reads `next`.
        unsafe { (*heap).next = self.heaps.load(Relaxed) };
        self.heaps.store(heap, Release);
        self.heap_count.fetch_add(1, Relaxed);
    }

    /// Every heap of the core, newest first.
    pub(crate) fn heaps(&self) -> HeapIter {
        HeapIter {
            next: self.heaps.load(Acquire),
        }
    }

    /// Adds a heap's unpublished granted bytes to the published total and raises the peak.
    #[inline]
    pub(crate) fn publish(&self, local: &mut HeapLocal) {
        let now = self.published.fetch_add(local.unpublished, Relaxed) + local.unpublished;
        local.unpublished = 0;
        if now > 0 {
            self.peak.fetch_max(now as usize, Relaxed);
        }
    }
}

impl Link for FreeSlot {
    #[inline(always)]
    unsafe fn set_next(node: *mut Self, next: *mut Self) {
        // SAFETY: forwarded from the caller: the block is the caller's.
        unsafe { (*node).next = next };
    }

    #[inline(always)]
    unsafe fn next(node: *mut Self) -> *mut Self {
        // SAFETY: forwarded from the caller.
        unsafe { (*node).next }
    }
}

/// Walks the list of all heaps.
pub(crate) struct HeapIter {
    next: *mut ThreadHeap,
}

impl Iterator for HeapIter {
    type Item = *mut ThreadHeap;
    fn next(&mut self) -> Option<*mut ThreadHeap> {
        let heap = self.next;
        if heap.is_null() {
            return None;
        }
        // SAFETY: heaps live as long as the core; `next` is immutable once published.
        self.next = unsafe { (*heap).next };
        Some(heap)
    }
}

impl ThreadHeap {
    pub(crate) const fn new(core: *const Core, config: &PoolConfig) -> Self {
        Self {
            local: UnsafeCell::new(HeapLocal {
                bins: Bins::new(config),
                pages: Pages::new(),
                unpublished: 0,
                seen_epoch: 0,
            }),
            counters: Counters {
                allocations: AtomicU64::new(0),
                frees: AtomicU64::new(0),
                granted: AtomicUsize::new(0),
                requested: AtomicUsize::new(0),
            },
            core,
            next: null_mut(),
            abandoned_next: UnsafeCell::new(null_mut()),
            remote: Padded(RemoteStack {
                head: AtomicPtr::new(null_mut()),
            }),
        }
    }

    /// The user's state.
    ///
    /// # Safety
    /// The caller must be the heap's user (its owning thread, or the holder of the core
    /// lock for an abandoned or fallback heap), and must not hold another reference from
    /// this method while using the result.
    #[inline]
    #[allow(clippy::mut_from_ref)]
    pub(crate) unsafe fn local(&self) -> &mut HeapLocal {
        // SAFETY: forwarded from the caller: one user at a time, one borrow at a time.
        unsafe { &mut *self.local.get() }
    }

    /// Pushes a block freed by another thread onto this heap's remote stack (see
    /// `remote.rs`).
    ///
    /// # Safety
    /// `slot` must be a live block of one of this heap's pages, given up by the caller.
    #[inline]
    pub(crate) unsafe fn push_remote(&self, slot: *mut u8) {
        // SAFETY: forwarded from the caller: the block is valid, ours, and stays valid (its
        // page belongs to this heap, which lives as long as the core).
        unsafe { self.remote.0.push(slot.cast()) }
    }

    /// Takes every remotely freed block back into the heap's pages. Pages that become empty
    /// are kept in the heap's empty list (and counted in `free_pages`).
    ///
    /// # Safety
    /// The caller must be the heap's user, with no borrow of its local state live.
    pub(crate) unsafe fn drain_remote(&self, core: &Core) {
        let s = self.remote.0.take_all();
        if s.is_null() {
            return;
        }
        // Every block on the stack is a live block of this heap's pages, pushed after its
        // owner check; the Acquire swap makes the pushers' link writes visible.
        // SAFETY: the caller is the heap's user; the blocks are this heap's (above).
        let emptied = unsafe { self.local().pages.free_list(s, &core.config, false) };
        if emptied > 0 {
            core.free_pages.fetch_add(emptied, Relaxed);
        }
    }

    /// Gives the blocks waiting in the heap's bins back to their pages; pages that become
    /// empty join the heap's empty list (and are counted in `free_pages`). Returns how many.
    ///
    /// # Safety
    /// The caller must be the heap's user, with no borrow of its local state live.
    pub(crate) unsafe fn flush_bins(&self, core: &Core) -> usize {
        // SAFETY: the caller is the heap's user; the bins hold blocks of this heap's pages.
        let emptied = unsafe {
            let local = self.local();
            local.bins.flush(&mut local.pages, &core.config)
        };
        if emptied > 0 {
            core.free_pages.fetch_add(emptied, Relaxed);
        }
        emptied
    }

    /// Moves the heap's empty pages beyond `keep` to the shared list (whose lock the caller
    /// holds).
    ///
    /// # Safety
    /// The caller must be the heap's user and hold the core lock (`shared`).
    pub(crate) unsafe fn spill_empty(&self, shared: &mut Shared, keep: usize) {
        // SAFETY: the caller is the heap's user.
        let local = unsafe { self.local() };
        while local.pages.empty_count() > keep {
            let page = local.pages.pop_empty().expect("count says non-empty");
            // SAFETY: an empty page owned by this core, in no list now.
            unsafe { shared.free.push(page) };
        }
    }

    /// Called at thread exit for each heap the thread used: drains remote frees, publishes
    /// the heap's figures, gives its empty pages to the shared list and parks the heap in the
    /// abandoned list for the next thread to adopt.
    ///
    /// # Safety
    /// `heap` must be a heap of a live core, used by the calling thread, which will not use
    /// it again.
    pub(crate) unsafe fn abandon(heap: *mut ThreadHeap) {
        // SAFETY: the heap and its core are live (checked by the registry under its lock).
        unsafe {
            let h = &*heap;
            let core = &*h.core;
            let mut shared = core.lock.lock();
            h.drain_remote(core);
            h.flush_bins(core);
            let local = h.local();
            core.publish(local);
            let emptied = local.pages.collect_empty_partials();
            core.free_pages.fetch_add(emptied, Relaxed);
            h.spill_empty(&mut shared, 0);
            shared.push_abandoned(heap);
        }
    }

    /// Counts the blocks waiting on the remote stack (for validation; the heap must be
    /// quiescent).
    pub(crate) fn remote_len(&self) -> usize {
        self.remote.0.len_quiescent()
    }
}
