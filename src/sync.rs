//! Locks that never allocate, and a once-per-process flag.
//!
//! Locks on the allocation path must not allocate or park through a structure that
//! allocates (parking_lot's parking table does; dhat deadlocked on it). These locks spin
//! with a CPU hint, then yield the time slice with `sched_yield`, which allocates nothing.
//! [`Lock`] holds the value and hands out guards; how it is taken is its [`RawLock`]: a
//! test-and-set flag ([`SpinLock`]) for the hot locks, and one where a waiter that has
//! waited long goes first ([`FairLock`]) where a thread retaking the lock in a loop must not
//! keep the others out.

use core::cell::UnsafeCell;
use core::ops::{Deref, DerefMut};
use core::sync::atomic::{AtomicBool, AtomicU8, AtomicU32, Ordering};

mod barrier;
mod raw;
pub(crate) use barrier::{prepare_process_barrier, process_barrier, process_barrier_ready};
pub(crate) use raw::{TestAndSet, WaitersFirst};

/// The atomics and waits of the code that `tests/loom.rs` also compiles with loom's (which
/// provides a module of the same name): `raw` here, the thread pool's remote stack and the
/// thread caches' counts.
pub(crate) mod atomic {
    pub(crate) use core::hint::spin_loop;
    pub(crate) use core::sync::atomic::{AtomicBool, AtomicPtr, AtomicU32, AtomicU64, Ordering};
    pub(crate) use std::thread::yield_now;
}

/// How a [`Lock`] is taken and released, apart from the value it guards.
///
/// # Safety
/// Between a return from `lock` and the matching `unlock`, no other call to `lock` on the
/// same value may return; `unlock` makes the holder's writes visible to the next holder
/// (Release, matched by an Acquire in `lock`).
pub unsafe trait RawLock {
    /// The lock, free.
    const UNLOCKED: Self;
    /// Waits until the caller holds the lock.
    fn lock(&self);
    /// Releases the lock (its holder only).
    fn unlock(&self);
}

// SAFETY: `lock` returns only after its compare-and-swap turned the flag from false to true
// (Acquire), and only `unlock` (Release) turns it back (see `raw.rs`, and its loom model).
unsafe impl RawLock for TestAndSet {
    const UNLOCKED: Self = Self(AtomicBool::new(false));

    #[inline]
    fn lock(&self) {
        TestAndSet::lock(self);
    }

    #[inline]
    fn unlock(&self) {
        TestAndSet::unlock(self);
    }
}

// SAFETY: `lock` returns only after a compare-and-swap set the held bit where it was clear
// (Acquire), and only `unlock` (Release) clears it; the waiters' counts share the word but
// never touch the bit (see `raw.rs`, and its loom model).
unsafe impl RawLock for WaitersFirst {
    const UNLOCKED: Self = Self {
        state: AtomicU32::new(0),
    };

    #[inline]
    fn lock(&self) {
        WaitersFirst::lock(self);
    }

    #[inline]
    fn unlock(&self) {
        WaitersFirst::unlock(self);
    }
}

/// A mutual-exclusion lock around a value; `const`-constructible and allocation-free.
pub struct Lock<R: RawLock, T> {
    raw: R,
    value: UnsafeCell<T>,
}

/// The hot locks (heap, pools, records): a test-and-set flag.
pub type SpinLock<T> = Lock<TestAndSet, T>;
/// A lock that a waiter which has waited long takes first (the thread registry).
pub type FairLock<T> = Lock<WaitersFirst, T>;

// SAFETY: the raw lock gives one thread at a time access to `value`, so sharing the lock
// between threads is sound whenever the value itself may be sent between them.
unsafe impl<R: RawLock + Sync, T: Send> Sync for Lock<R, T> {}
// SAFETY: moving the lock moves the value; sound when the value is `Send`.
unsafe impl<R: RawLock + Send, T: Send> Send for Lock<R, T> {}

impl<R: RawLock, T> Lock<R, T> {
    /// A new unlocked lock holding `value`.
    pub const fn new(value: T) -> Self {
        Self {
            raw: R::UNLOCKED,
            value: UnsafeCell::new(value),
        }
    }

    /// Takes the lock, spinning (then yielding) while another thread holds it.
    #[inline]
    pub fn lock(&self) -> Guard<'_, R, T> {
        self.raw.lock();
        Guard { lock: self }
    }

    /// Takes the lock and leaves it held with no guard; used around `fork()`.
    ///
    /// # Safety
    /// The caller must later release it exactly once, with
    /// [`force_unlock`](Self::force_unlock) (or, for a [`FairLock`] in a forked child,
    /// [`reset_in_child`](Lock::reset_in_child)), where no guard of this lock exists.
    pub(crate) unsafe fn lock_raw(&self) {
        core::mem::forget(self.lock());
    }

    /// Releases a lock taken with [`lock_raw`](Self::lock_raw).
    ///
    /// # Safety
    /// The lock must be held through `lock_raw`, and no guard of it may exist.
    pub(crate) unsafe fn force_unlock(&self) {
        self.raw.unlock();
    }

    /// Direct access through a unique reference (no locking needed).
    pub fn get_mut(&mut self) -> &mut T {
        self.value.get_mut()
    }
}

impl<T> SpinLock<T> {
    /// Takes the lock if it is free.
    #[cfg(test)]
    pub fn try_lock(&self) -> Option<SpinGuard<'_, T>> {
        self.raw.try_lock().then_some(Guard { lock: self })
    }
}

impl<T> FairLock<T> {
    /// In a child forked while this thread held the lock through
    /// [`lock_raw`](Self::lock_raw): frees it. Waiters that counted themselves in the lock
    /// word are gone with their threads (they do not exist in the child), so the count goes
    /// too: otherwise no new thread could ever take the lock.
    ///
    /// # Safety
    /// Only in a forked child (one thread), with the lock held through `lock_raw` and no
    /// guard of it.
    pub(crate) unsafe fn reset_in_child(&self) {
        self.raw.reset();
    }
}

/// Holds a [`Lock`] until dropped.
pub struct Guard<'a, R: RawLock, T> {
    lock: &'a Lock<R, T>,
}

/// A held [`SpinLock`].
pub type SpinGuard<'a, T> = Guard<'a, TestAndSet, T>;
/// A held [`FairLock`].
pub type FairGuard<'a, T> = Guard<'a, WaitersFirst, T>;

impl<R: RawLock, T> Deref for Guard<'_, R, T> {
    type Target = T;
    #[inline]
    fn deref(&self) -> &T {
        // SAFETY: the guard exists only while this thread holds the lock, so no other
        // reference to the value is live.
        unsafe { &*self.lock.value.get() }
    }
}

impl<R: RawLock, T> DerefMut for Guard<'_, R, T> {
    #[inline]
    fn deref_mut(&mut self) -> &mut T {
        // SAFETY: as in `deref`; the guard is borrowed mutably, so this is the only reference.
        unsafe { &mut *self.lock.value.get() }
    }
}

impl<R: RawLock, T> Drop for Guard<'_, R, T> {
    #[inline]
    fn drop(&mut self) {
        self.lock.raw.unlock();
    }
}

/// A once-per-process initialisation that can fail, allocation-free (unlike `std`'s, which
/// the allocator cannot rely on from inside an allocation): the first caller runs it, later
/// ones wait for it to finish and get its answer.
pub struct OnceFlag {
    state: AtomicU8,
}

const ONCE_UNSET: u8 = 0;
const ONCE_BUSY: u8 = 1;
const ONCE_DONE: u8 = 2;
const ONCE_FAILED: u8 = 3;

impl OnceFlag {
    /// Not yet run.
    pub const fn new() -> Self {
        Self {
            state: AtomicU8::new(ONCE_UNSET),
        }
    }

    /// Runs `init` if no caller has yet, and returns what it returned (whether it succeeded).
    pub fn call(&self, init: impl FnOnce() -> bool) -> bool {
        loop {
            match self.state.load(Ordering::Acquire) {
                ONCE_DONE => return true,
                ONCE_FAILED => return false,
                ONCE_UNSET => {
                    if self
                        .state
                        .compare_exchange(
                            ONCE_UNSET,
                            ONCE_BUSY,
                            Ordering::Acquire,
                            Ordering::Relaxed,
                        )
                        .is_ok()
                    {
                        let ok = init();
                        let state = if ok { ONCE_DONE } else { ONCE_FAILED };
                        self.state.store(state, Ordering::Release);
                        return ok;
                    }
                }
                _ => core::hint::spin_loop(),
            }
        }
    }

    /// Whether the initialisation has run and succeeded.
    pub fn succeeded(&self) -> bool {
        self.state.load(Ordering::Acquire) == ONCE_DONE
    }
}

#[cfg(test)]
mod tests {
    use super::{FairLock, SpinLock};
    use core::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;

    #[test]
    fn miri_spin_lock_counts_exactly_under_contention() {
        let lock = Arc::new(SpinLock::new(0u64));
        let per_thread = if cfg!(miri) { 50 } else { 20_000 };
        let threads: Vec<_> = (0..4)
            .map(|_| {
                let lock = Arc::clone(&lock);
                std::thread::spawn(move || {
                    for _ in 0..per_thread {
                        *lock.lock() += 1;
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        assert_eq!(*lock.lock(), 4 * per_thread);
        let guard = lock.lock();
        assert!(lock.try_lock().is_none());
        drop(guard);
        assert!(lock.try_lock().is_some());
    }

    #[test]
    fn miri_once_flag_runs_its_initialisation_once_and_keeps_the_answer() {
        use super::OnceFlag;
        use std::sync::atomic::{AtomicU32, Ordering::Relaxed};
        static RUNS: AtomicU32 = AtomicU32::new(0);
        static FLAG: OnceFlag = OnceFlag::new();
        assert!(!FLAG.succeeded());
        std::thread::scope(|s| {
            for _ in 0..4 {
                s.spawn(|| {
                    assert!(FLAG.call(|| {
                        RUNS.fetch_add(1, Relaxed);
                        true
                    }))
                });
            }
        });
        assert_eq!(RUNS.load(Relaxed), 1);
        assert!(FLAG.succeeded());
        let failed = OnceFlag::new();
        assert!(!failed.call(|| false));
        assert!(
            !failed.call(|| true),
            "a failed initialisation is not retried"
        );
        assert!(!failed.succeeded());
    }

    #[test]
    fn miri_fair_lock_counts_exactly_under_contention() {
        let lock = FairLock::new(0u64);
        let per_thread = if cfg!(miri) { 50 } else { 20_000 };
        std::thread::scope(|s| {
            for _ in 0..4 {
                s.spawn(|| {
                    for _ in 0..per_thread {
                        *lock.lock() += 1;
                    }
                });
            }
        });
        assert_eq!(*lock.lock(), 4 * per_thread);
    }

    /// The case the fair lock exists for: one thread takes and releases the lock in a loop,
    /// and another still gets it as often as it asks (with a plain test-and-set flag, on one
    /// core or under Miri's and valgrind's one-at-a-time scheduling, the second thread mostly
    /// finds it held).
    #[test]
    fn miri_fair_lock_serves_a_waiter_while_another_thread_retakes_it() {
        let lock = FairLock::new((0u64, 0u64));
        let done = AtomicBool::new(false);
        let wanted = if cfg!(miri) { 20 } else { 10_000 };
        std::thread::scope(|s| {
            s.spawn(|| {
                while !done.load(Ordering::Relaxed) {
                    lock.lock().0 += 1;
                }
            });
            s.spawn(|| {
                for _ in 0..wanted {
                    lock.lock().1 += 1;
                }
                done.store(true, Ordering::Relaxed);
            });
        });
        assert_eq!(lock.lock().1, wanted);
    }

    /// The rule itself, deterministically: once a waiter has counted itself as going first,
    /// the holder cannot take the lock again before that waiter had it.
    #[test]
    fn miri_fair_lock_gives_a_long_waiter_the_lock_before_the_holder_retakes_it() {
        let lock = FairLock::new(Vec::new());
        let guard = lock.lock();
        std::thread::scope(|s| {
            let shared = &lock;
            s.spawn(move || {
                shared.raw.lock_first();
                // SAFETY: `lock_first` took the lock; nothing else holds a guard.
                unsafe { (*shared.value.get()).push("waiter") };
                shared.raw.unlock();
            });
            // Wait until the waiter has counted itself, then release and retake at once.
            while lock.raw.state.load(Ordering::Relaxed) < 2 {
                std::thread::yield_now();
            }
            drop(guard);
            lock.lock().push("holder again");
        });
        assert_eq!(*lock.lock(), ["waiter", "holder again"]);
    }

    #[test]
    fn miri_fair_lock_reset_in_child_forgets_lost_waiters() {
        let lock = FairLock::new(7u32);
        // SAFETY: released below by `reset_in_child`, with no guard alive.
        unsafe { lock.lock_raw() };
        // Two threads waited long, counted themselves, then vanished (as in a forked child).
        lock.raw.state.fetch_add(4, Ordering::Relaxed);
        // SAFETY: held through `lock_raw`; no guard exists.
        unsafe { lock.reset_in_child() };
        assert_eq!(
            *lock.lock(),
            7,
            "the lock is free again, and not kept for the lost"
        );
        // And in the parent, `force_unlock` frees it.
        // SAFETY: as above.
        unsafe {
            lock.lock_raw();
            lock.force_unlock();
        }
        *lock.lock() += 1;
        assert_eq!(*lock.lock(), 8);
    }
}
