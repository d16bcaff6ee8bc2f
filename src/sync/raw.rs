//! The two raw locks behind [`Lock`](super::Lock): a test-and-set flag and tickets.
//!
//! This file is also compiled by `tests/loom.rs` with loom's atomics (its own
//! `crate::sync::atomic`), so the models check this code, not a copy: it names no static and
//! builds no value in a `const` (loom's atomics cannot), and every wait goes through
//! `atomic::spin_loop`/`atomic::yield_now`, which loom turns into its scheduler's yields.

use crate::sync::atomic::{self, AtomicBool, AtomicU32, Ordering};

/// Spins this many times before yielding the CPU to other threads.
const SPINS_BEFORE_YIELD: u32 = 64;

/// Waits until `done` says so: spins with a CPU hint, then (once `spins`, kept by the
/// caller across waits, reaches [`SPINS_BEFORE_YIELD`]) yields the time slice.
#[inline]
fn wait_until(spins: &mut u32, mut done: impl FnMut() -> bool) {
    while !done() {
        if *spins < SPINS_BEFORE_YIELD {
            *spins += 1;
            atomic::spin_loop();
        } else {
            atomic::yield_now();
        }
    }
}

/// A test-and-set flag: cheapest when free, but not fair (see [`Tickets`]).
pub(crate) struct TestAndSet(pub(crate) AtomicBool);

impl TestAndSet {
    /// Waits until the caller holds the flag (Acquire).
    #[inline]
    pub(crate) fn lock(&self) {
        if !self.try_take() {
            self.lock_contended();
        }
    }

    /// Releases the flag (its holder only), publishing the holder's writes.
    #[inline]
    pub(crate) fn unlock(&self) {
        self.0.store(false, Ordering::Release);
    }

    /// Takes the flag if it is free. A strong compare-and-swap: a weak one may fail while the
    /// flag is free, which a caller asking once would read as "held".
    #[cfg_attr(not(test), allow(dead_code))]
    #[inline]
    pub(crate) fn try_lock(&self) -> bool {
        self.0
            .compare_exchange(false, true, Ordering::Acquire, Ordering::Relaxed)
            .is_ok()
    }

    #[inline]
    fn try_take(&self) -> bool {
        self.0
            .compare_exchange_weak(false, true, Ordering::Acquire, Ordering::Relaxed)
            .is_ok()
    }

    #[cold]
    fn lock_contended(&self) {
        let mut spins = 0;
        loop {
            wait_until(&mut spins, || !self.0.load(Ordering::Relaxed));
            if self.try_take() {
                return;
            }
        }
    }
}

/// Tickets: first come, first served.
///
/// With a [`TestAndSet`] flag, a thread that releases and takes the lock again in a loop can
/// keep it from waiters that only get the CPU now and then (more threads than cores, or
/// valgrind, which runs one thread at a time): they mostly find it held and yield again. A
/// stress run under valgrind stalled for over 20 minutes that way on the thread registry,
/// with one thread setting budgets in a loop. Here each caller takes a ticket and the lock
/// goes to the tickets in order, so a thread that wants it again queues behind the waiters.
pub(crate) struct Tickets {
    /// The next ticket to hand out.
    pub(crate) next: AtomicU32,
    /// The ticket whose holder may enter; only the holder advances it.
    pub(crate) serving: AtomicU32,
}

impl Tickets {
    /// Takes a ticket and waits until it is served (Acquire).
    #[inline]
    pub(crate) fn lock(&self) {
        let ticket = self.next.fetch_add(1, Ordering::Relaxed);
        if self.serving.load(Ordering::Acquire) != ticket {
            self.wait_for(ticket);
        }
    }

    /// Serves the next ticket (the holder only), publishing the holder's writes.
    #[inline]
    pub(crate) fn unlock(&self) {
        let now = self.serving.load(Ordering::Relaxed);
        self.serving.store(now.wrapping_add(1), Ordering::Release);
    }

    /// Marks every ticket handed out as served: the lock is free, and tickets taken by
    /// threads that no longer exist (a forked child's lost waiters) are dropped.
    pub(crate) fn serve_all(&self) {
        self.serving
            .store(self.next.load(Ordering::Relaxed), Ordering::Release);
    }

    #[cold]
    fn wait_for(&self, ticket: u32) {
        wait_until(&mut 0, || self.serving.load(Ordering::Acquire) == ticket);
    }
}
