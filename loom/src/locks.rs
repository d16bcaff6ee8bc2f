//! The raw locks: mutual exclusion (a count kept in a loom cell, which reports two holders
//! at once or an unlock that does not publish the holder's writes), exact counts, and the
//! fair lock's rule: a waiter that goes first gets the lock before the holder retakes it.

use crate::model;
use crate::raw::{TestAndSet, WaitersFirst};
use loom::cell::UnsafeCell;
use loom::sync::Arc;
use loom::sync::atomic::Ordering::Relaxed;
use loom::sync::atomic::{AtomicBool, AtomicU32};
use loom::thread;

/// A count guarded by a raw lock.
struct Guarded<L> {
    lock: L,
    count: UnsafeCell<u32>,
}

/// What a lock needs here.
trait Raw: Send + Sync + 'static {
    fn lock(&self);
    fn unlock(&self);
}

impl Raw for WaitersFirst {
    fn lock(&self) {
        WaitersFirst::lock(self);
    }
    fn unlock(&self) {
        WaitersFirst::unlock(self);
    }
}

impl Raw for TestAndSet {
    fn lock(&self) {
        TestAndSet::lock(self);
    }
    fn unlock(&self) {
        TestAndSet::unlock(self);
    }
}

impl<L: Raw> Guarded<L> {
    fn new(lock: L) -> Arc<Self> {
        Arc::new(Self {
            lock,
            count: UnsafeCell::new(0),
        })
    }

    /// Adds one under the lock.
    fn add_one(&self) {
        self.lock.lock();
        // SAFETY: the lock is held (loom checks that no other access is concurrent).
        self.count.with_mut(|c| unsafe { *c += 1 });
        self.lock.unlock();
    }

    /// The count, under the lock.
    fn count(&self) -> u32 {
        self.lock.lock();
        // SAFETY: as in `add_one`.
        let n = self.count.with(|c| unsafe { *c });
        self.lock.unlock();
        n
    }
}

fn fair() -> WaitersFirst {
    WaitersFirst {
        state: AtomicU32::new(0),
    }
}

/// Runs `per_thread[i]` additions on thread `i` (thread 0 is the model's own) and checks
/// the total.
fn counts_exactly<L: Raw>(lock: L, per_thread: &[u32]) {
    let g = Guarded::new(lock);
    let others: Vec<_> = per_thread[1..]
        .iter()
        .map(|&n| {
            let g = Arc::clone(&g);
            thread::spawn(move || (0..n).for_each(|_| g.add_one()))
        })
        .collect();
    (0..per_thread[0]).for_each(|_| g.add_one());
    for t in others {
        t.join().unwrap();
    }
    assert_eq!(g.count(), per_thread.iter().sum::<u32>());
}

#[test]
fn fair_lock_excludes_and_counts_exactly() {
    model(|| counts_exactly(fair(), &[1, 1]));
}

/// A thread takes the lock again while another waits: mutual exclusion and exact counts.
#[test]
fn fair_lock_retaken_while_another_waits() {
    model(|| counts_exactly(fair(), &[2, 1]));
}

/// A waiter that goes first (counted in the lock word) against a thread taking the lock
/// twice: mutual exclusion, exact counts, and the word ends free with no waiter counted.
#[test]
fn fair_lock_with_a_waiter_going_first() {
    model(|| {
        let g = Guarded::new(fair());
        let first = {
            let g = Arc::clone(&g);
            thread::spawn(move || {
                g.lock.lock_first();
                // SAFETY: `lock_first` took the lock.
                g.count.with_mut(|c| unsafe { *c += 1 });
                g.lock.unlock();
            })
        };
        g.add_one();
        g.add_one();
        first.join().unwrap();
        assert_eq!(g.count(), 3);
        assert_eq!(g.lock.state.load(Relaxed), 0);
    });
}

/// A forked child's reset: waiters counted in the word do not exist there, and the lock is
/// free.
#[test]
fn fair_lock_reset_frees_it() {
    model(|| {
        let g = Guarded::new(fair());
        g.lock.lock();
        g.lock.state.fetch_add(4, Relaxed);
        g.lock.reset();
        g.add_one();
        assert_eq!(g.count(), 1);
    });
}

#[test]
fn test_and_set_excludes_and_counts_exactly() {
    model(|| counts_exactly(TestAndSet(AtomicBool::new(false)), &[2, 1]));
}

/// `try_lock` against a thread taking the lock: on success the count is the caller's (loom
/// checks it), on failure nothing changed; on a free lock it never fails (strong CAS).
#[test]
fn test_and_set_try_lock_enters_only_a_free_lock() {
    model(|| {
        let g = Guarded::new(TestAndSet(AtomicBool::new(false)));
        let locker = {
            let g = Arc::clone(&g);
            thread::spawn(move || g.add_one())
        };
        let took = g.lock.try_lock();
        if took {
            // SAFETY: `try_lock` succeeded.
            g.count.with_mut(|c| unsafe { *c += 1 });
            g.lock.unlock();
        }
        locker.join().unwrap();
        assert_eq!(g.count(), 1 + u32::from(took));
        assert!(g.lock.try_lock(), "a free lock");
        assert!(!g.lock.try_lock(), "a held lock");
        g.lock.unlock();
    });
}
