//! The two raw locks behind [`Lock`](super::Lock): a test-and-set flag, and one that lets
//! waiters who have waited long go first.
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

/// A test-and-set flag: cheapest when free, but not fair (see [`WaitersFirst`]).
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

/// A test-and-set flag that waiters who have waited long take first.
///
/// With a plain [`TestAndSet`] flag, a thread that releases and takes the lock again in a
/// loop can keep it from waiters that only get the CPU now and then (more threads than
/// cores, or valgrind, which runs one thread at a time): they mostly find it held and yield
/// again. A stress run under valgrind stalled for over 20 minutes that way on the thread
/// registry, with one thread setting budgets in a loop. Tickets (first come, first served)
/// cured that but made a convoy of every wait: the lock went to the next ticket even when
/// its thread was off the CPU, and everyone else waited for it to be scheduled. With more
/// threads than cores (a program starting and ending threads while another process runs)
/// that cost scoped short-lived threads 4-8% of their time and tripled the yields.
///
/// Here the lock goes to whoever asks while it is free, unless a waiter has yielded
/// [`YIELDS_BEFORE_FIRST`] times: it then says so in the lock word, and from then on only
/// such waiters may take the lock. A thread retaking the lock in a loop queues behind them;
/// an ordinary wait hands the lock to whoever runs.
pub(crate) struct WaitersFirst {
    /// Bit 0 ([`HELD`]): the lock is held. Above it, in units of [`FIRST_WAITER`]: how
    /// many waiters have waited long and go first.
    pub(crate) state: AtomicU32,
}

/// The lock word's "held" bit.
const HELD: u32 = 1;
/// One waiter that has waited long, in the lock word.
const FIRST_WAITER: u32 = 2;
/// Yields after which a waiter goes first (after [`SPINS_BEFORE_YIELD`] spins).
const YIELDS_BEFORE_FIRST: u32 = 8;

impl WaitersFirst {
    /// Waits until the caller holds the lock (Acquire).
    #[inline]
    pub(crate) fn lock(&self) {
        if self
            .state
            .compare_exchange_weak(0, HELD, Ordering::Acquire, Ordering::Relaxed)
            .is_err()
        {
            self.lock_contended(false);
        }
    }

    /// Releases the lock (its holder only), publishing the holder's writes. A read-modify-
    /// write: waiters may be counting themselves in the same word.
    #[inline]
    pub(crate) fn unlock(&self) {
        self.state.fetch_sub(HELD, Ordering::Release);
    }

    /// Frees the lock and forgets every waiter (a forked child's: they do not exist there).
    pub(crate) fn reset(&self) {
        self.state.store(0, Ordering::Release);
    }

    /// [`lock`](Self::lock) as a waiter that has already waited long: it goes first (tests
    /// reach the rule through it without waiting for the yields).
    #[cfg_attr(not(test), allow(dead_code))]
    pub(crate) fn lock_first(&self) {
        self.lock_contended(true);
    }

    /// Waits for the lock: takes it when it is free and no waiter goes first, or when it is
    /// free and this waiter goes first (`first`, or after enough yields).
    #[cold]
    fn lock_contended(&self, mut first: bool) {
        if first {
            self.state.fetch_add(FIRST_WAITER, Ordering::Relaxed);
        }
        let mut spins = 0;
        let mut yields = 0;
        loop {
            let state = self.state.load(Ordering::Relaxed);
            if state & HELD == 0 && (first || state < FIRST_WAITER) {
                // A waiter going first takes itself out of the count as it takes the lock.
                let taken = if first {
                    (state - FIRST_WAITER) | HELD
                } else {
                    state | HELD
                };
                if self
                    .state
                    .compare_exchange_weak(state, taken, Ordering::Acquire, Ordering::Relaxed)
                    .is_ok()
                {
                    return;
                }
                continue;
            }
            if spins < SPINS_BEFORE_YIELD {
                spins += 1;
                atomic::spin_loop();
            } else {
                atomic::yield_now();
                if !first {
                    yields += 1;
                    if yields == YIELDS_BEFORE_FIRST {
                        self.state.fetch_add(FIRST_WAITER, Ordering::Relaxed);
                        first = true;
                    }
                }
            }
        }
    }
}
