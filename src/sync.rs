//! A spin lock that never allocates.
//!
//! Locks on the allocation path must not allocate or park through a structure that
//! allocates (parking_lot's parking table does; dhat deadlocked on it). This lock spins with
//! a CPU hint, then yields the time slice with `sched_yield`, which allocates nothing.

use core::cell::UnsafeCell;
use core::ops::{Deref, DerefMut};
use core::sync::atomic::{AtomicBool, AtomicU8, Ordering};

/// Spins this many times before yielding the CPU to other threads.
const SPINS_BEFORE_YIELD: u32 = 64;

/// A mutual-exclusion lock built on one atomic flag; `const`-constructible and allocation-free.
pub struct SpinLock<T> {
    locked: AtomicBool,
    value: UnsafeCell<T>,
}

// SAFETY: the flag gives one thread at a time access to `value`, so sharing the lock between
// threads is sound whenever the value itself may be sent between them.
unsafe impl<T: Send> Sync for SpinLock<T> {}
// SAFETY: moving the lock moves the value; sound when the value is `Send`.
unsafe impl<T: Send> Send for SpinLock<T> {}

impl<T> SpinLock<T> {
    /// A new unlocked lock holding `value`.
    pub const fn new(value: T) -> Self {
        Self {
            locked: AtomicBool::new(false),
            value: UnsafeCell::new(value),
        }
    }

    /// Takes the lock, spinning (then yielding) while another thread holds it.
    #[inline]
    pub fn lock(&self) -> SpinGuard<'_, T> {
        if self
            .locked
            .compare_exchange_weak(false, true, Ordering::Acquire, Ordering::Relaxed)
            .is_err()
        {
            self.lock_contended();
        }
        SpinGuard { lock: self }
    }

    #[cold]
    fn lock_contended(&self) {
        let mut spins = 0u32;
        loop {
            while self.locked.load(Ordering::Relaxed) {
                if spins < SPINS_BEFORE_YIELD {
                    spins += 1;
                    core::hint::spin_loop();
                } else {
                    std::thread::yield_now();
                }
            }
            if self
                .locked
                .compare_exchange_weak(false, true, Ordering::Acquire, Ordering::Relaxed)
                .is_ok()
            {
                return;
            }
        }
    }

    /// Takes the lock if it is free.
    #[cfg(test)]
    pub fn try_lock(&self) -> Option<SpinGuard<'_, T>> {
        self.locked
            .compare_exchange(false, true, Ordering::Acquire, Ordering::Relaxed)
            .ok()
            .map(|_| SpinGuard { lock: self })
    }

    /// Takes the lock and leaves it held with no guard; used around `fork()`.
    ///
    /// # Safety
    /// The caller must later call [`SpinLock::force_unlock`] exactly once, from a context
    /// where no guard of this lock exists.
    pub(crate) unsafe fn lock_raw(&self) {
        core::mem::forget(self.lock());
    }

    /// Releases a lock taken with [`SpinLock::lock_raw`].
    ///
    /// # Safety
    /// The lock must be held through `lock_raw`, and no guard of it may exist.
    pub(crate) unsafe fn force_unlock(&self) {
        self.locked.store(false, Ordering::Release);
    }

    /// Direct access through a unique reference (no locking needed).
    pub fn get_mut(&mut self) -> &mut T {
        self.value.get_mut()
    }
}

/// Holds a [`SpinLock`] until dropped.
pub struct SpinGuard<'a, T> {
    lock: &'a SpinLock<T>,
}

impl<T> Deref for SpinGuard<'_, T> {
    type Target = T;
    #[inline]
    fn deref(&self) -> &T {
        // SAFETY: the guard exists only while this thread holds the lock, so no other
        // reference to the value is live.
        unsafe { &*self.lock.value.get() }
    }
}

impl<T> DerefMut for SpinGuard<'_, T> {
    #[inline]
    fn deref_mut(&mut self) -> &mut T {
        // SAFETY: as in `deref`; the guard is borrowed mutably, so this is the only reference.
        unsafe { &mut *self.lock.value.get() }
    }
}

impl<T> Drop for SpinGuard<'_, T> {
    #[inline]
    fn drop(&mut self) {
        self.lock.locked.store(false, Ordering::Release);
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
    use super::SpinLock;
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
}
