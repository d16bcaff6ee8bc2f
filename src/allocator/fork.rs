//! `fork()` safety: one set of `pthread_atfork` handlers that takes every lock the
//! allocators use, in the order in which those locks nest, and releases them on both sides.
//!
//! `fork()` copies the whole address space but only the calling thread. A lock held by any
//! other thread at that instant stays held in the child for ever, and the data behind it may
//! be half updated; so the prepare handler takes each lock (waiting for its holder to
//! finish), and the child gets every structure in a consistent state with all locks free.
//! Force-unlocking in the child instead would hand it those half-updated structures.
//!
//! The prepare handler takes, in this order:
//! 1. the lock of every registered allocator that declared one ([`ForkLock`]: pools and
//!    thread pools declared with [`allocator!`](crate::allocator)), deepest in the
//!    allocator tree first, because a pool holds its lock while it asks its parent for a
//!    page (so a pool of a pool takes its own lock, then its parent's);
//! 2. the *gate*, which registrations and other late-created lockable state publish
//!    under: once it is held with nothing published since step 1 began, every lock that
//!    exists was taken in step 1 and no new one can appear until the fork is over (if
//!    something was published meanwhile, steps 1–2 are undone and repeated);
//! 3. the records' locks, if records were ever turned on;
//! 4. the thread-cache list and the global heap's locks, if the thread caches are in use.
//! 5. the registry of blocks with their own mapping (`schema::hpha::addr_map`), always.
//!
//! Only one registration with `pthread_atfork` is made ([`install`]), whichever part of the
//! crate needs it first, so the order above does not depend on which was used first.
//!
//! Limitation: a [`ThreadPoolSchema`](crate::schema::ThreadPoolSchema) or
//! [`PoolSchema`](crate::schema::PoolSchema) used directly (not through an `allocator!`
//! handle) is not registered, so its lock is not taken around a fork.

use super::{registry, thread_cache};
use crate::records;
use crate::schema::hpha::addr_map::DIRECT as DIRECT_BLOCKS;
use crate::sync::{OnceFlag, SpinLock};
use core::sync::atomic::{AtomicBool, AtomicU64, Ordering::*};

/// How to take and release one allocator's lock around `fork()`; given to
/// [`Registration::with_fork_lock`](crate::Registration::with_fork_lock).
///
/// `hold` takes the lock and keeps it with no guard; `release` gives it back. The fork
/// handlers call `hold` once before the fork and `release` once after it, in the parent and
/// in the child alike. `hold` must wait for the lock like any other caller (never skip it),
/// and the allocator must not take the lock before its registration is complete (or the
/// prepare handler cannot know about it).
#[derive(Clone, Copy, Debug)]
pub struct ForkLock {
    /// Takes the lock, leaving it held.
    pub hold: fn(),
    /// Releases the lock taken by `hold`.
    ///
    /// # Safety
    /// Called once after each `hold`, by the fork handlers, with no guard of the lock live
    /// on this thread.
    pub release: unsafe fn(),
}

/// Held around the publication of anything whose lock the prepare handler must take.
static GATE: SpinLock<()> = SpinLock::new(());
/// Bumped under the gate at each publication.
static GENERATION: AtomicU64 = AtomicU64::new(0);

/// Runs `publish` (linking a registration, publishing a thread pool's shared state) so that
/// no fork copies the process half way through it, and a fork in progress sees it or waits
/// for it to be over. `publish` must take no lock and must not allocate.
pub(crate) fn publish<R>(publish: impl FnOnce() -> R) -> R {
    let gate = GATE.lock();
    let result = publish();
    // Release: a prepare handler that reads the new generation also sees what was published.
    GENERATION.fetch_add(1, Release);
    drop(gate);
    result
}

static INSTALLED: OnceFlag = OnceFlag::new();

/// Registers the fork handlers, once per process; returns whether they are in place.
pub(crate) fn install() -> bool {
    INSTALLED.call(|| {
        // SAFETY: the handlers are plain functions that only take and release locks (and,
        // in the child, adopt what the lost threads left).
        let rc = unsafe { libc::pthread_atfork(Some(prepare), Some(in_parent), Some(in_child)) };
        if rc != 0 {
            crate::messages::warn(
                b"tagalloc: pthread_atfork failed; a fork() while other threads allocate may hang the child\n",
            );
        }
        rc == 0
    })
}

/// What the prepare handler took, for the after-fork handlers (only the forking thread runs
/// them, between its own prepare and after handlers, so plain relaxed flags suffice).
static HELD_ALLOCATORS: registry::HeldForFork = registry::HeldForFork::new();
static HELD_RECORDS: AtomicBool = AtomicBool::new(false);
static HELD_CACHES: AtomicBool = AtomicBool::new(false);

unsafe extern "C" fn prepare() {
    loop {
        let generation = GENERATION.load(Acquire);
        HELD_ALLOCATORS.hold();
        // SAFETY: released by an after-fork handler, or just below.
        unsafe { GATE.lock_raw() };
        if GENERATION.load(Relaxed) == generation {
            break;
        }
        // Something was published while the locks were being taken: its lock may be held.
        // SAFETY: both taken just above by this thread.
        unsafe {
            GATE.force_unlock();
            HELD_ALLOCATORS.release();
        }
    }
    let records = records::is_active();
    HELD_RECORDS.store(records, Relaxed);
    if records {
        // SAFETY: released by the after-fork handlers (`release_all`).
        unsafe { records::before_fork() };
    }
    let caches = thread_cache::fork_hooks_ready();
    HELD_CACHES.store(caches, Relaxed);
    if caches {
        // SAFETY: as above.
        unsafe { thread_cache::before_fork() };
    }
    // The registry of blocks with their own mapping: the innermost lock (a large allocation
    // may take it under the large heap's lock; nothing is taken under it).
    // SAFETY: released by `release_all`, first.
    unsafe { DIRECT_BLOCKS.lock_for_fork() };
}

/// Releases what [`prepare`] took, in the reverse order.
///
/// # Safety
/// Only in an after-fork handler, so after `prepare` on this thread (or the thread this
/// child was forked from).
unsafe fn release_all(child: bool) {
    // SAFETY: each was taken by `prepare`, as its flag says (the registry always).
    unsafe {
        DIRECT_BLOCKS.unlock_after_fork();
        if HELD_CACHES.load(Relaxed) {
            thread_cache::after_fork(child);
        }
        if HELD_RECORDS.load(Relaxed) {
            records::after_fork(child);
        }
        GATE.force_unlock();
        HELD_ALLOCATORS.release();
    }
}

unsafe extern "C" fn in_parent() {
    // SAFETY: registered as the parent's after-fork handler, so `prepare` ran.
    unsafe { release_all(false) };
}

unsafe extern "C" fn in_child() {
    // SAFETY: registered as the child's after-fork handler, so `prepare` ran.
    unsafe { release_all(true) };
    if HELD_CACHES.load(Relaxed) {
        // Every lock is free again: adopt what the lost threads' caches held.
        thread_cache::adopt_orphans_after_fork();
    }
}
