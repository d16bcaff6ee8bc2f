//! Byte budgets: an optional ceiling on an allocator's live granted bytes.
//!
//! Going over the budget calls a hook (by default a one-line message on stderr, written
//! without allocating and rate-limited) and, in [`BudgetMode::Fail`], refuses the
//! allocation: the container sees `AllocError` (or `GlobalAlloc` returns null).
//!
//! The check costs one relaxed load on the allocation path while the allocator is under
//! budget. In Fail mode a request whose size alone is over the budget is refused before
//! anything is allocated, so it leaves no trace but the failure counts (not in a parent's
//! figures either). Otherwise the live figure is raised by the granted block before the
//! exact check and lowered again when an allocation is refused, so two threads racing at
//! the ceiling may both see it exceeded (the budget is never silently overrun, it can be
//! enforced a little early); such a block, and one refused only for its rounding, went
//! through the parent and back.

use crate::fatal::{StackText, write_stderr};
use core::fmt::Write;
use core::sync::atomic::{AtomicBool, AtomicPtr, AtomicUsize, Ordering::Relaxed};

/// What happens when an allocation takes an allocator over its budget.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BudgetMode {
    /// Call the hook and let the allocation through.
    Warn,
    /// Call the hook and refuse the allocation.
    Fail,
}

/// What the budget hook is told.
#[derive(Clone, Copy, Debug)]
pub struct BudgetEvent {
    /// The allocator's name.
    pub allocator: &'static str,
    /// The budget in bytes.
    pub budget: usize,
    /// Live granted bytes including this allocation (it is taken back if `refused`).
    pub live_bytes: usize,
    /// Granted bytes of the allocation that crossed the line.
    pub request_bytes: usize,
    /// How many allocations found this allocator over budget so far, this one included.
    pub count: u64,
    /// Whether the allocation is refused ([`BudgetMode::Fail`]).
    pub refused: bool,
}

/// A function called each time an allocation finds its allocator over budget.
///
/// It runs on the allocation path of the allocator concerned, with no lock held. It may
/// allocate through other allocators, but if the allocator concerned (or one of its
/// descendants) is the `#[global_allocator]`, it must not allocate at all: that would
/// recurse. Counting into an atomic or writing a fixed message is always safe.
pub type BudgetHook = fn(&BudgetEvent);

/// The default hook: prints the event on stderr without allocating, for the 1st, 2nd, 4th,
/// 8th… event of each allocator, so a program living over budget is not flooded.
pub fn log_budget_event(event: &BudgetEvent) {
    if !event.count.is_power_of_two() {
        return;
    }
    let mut text = StackText::<256>::new();
    let _ = writeln!(
        text,
        "tagalloc: allocator \"{}\" over its budget of {} bytes: {} live after a {}-byte \
         block ({}; over-budget allocation #{})",
        event.allocator,
        event.budget,
        event.live_bytes,
        event.request_bytes,
        if event.refused { "refused" } else { "allowed" },
        event.count,
    );
    write_stderr(text.as_bytes());
}

/// One allocator's budget settings: limit, mode and hook; `const`-constructible.
#[derive(Debug)]
pub struct Budget {
    /// The ceiling in bytes; `usize::MAX` means no budget.
    limit: AtomicUsize,
    fail: AtomicBool,
    /// A `BudgetHook` stored as a pointer; null means [`log_budget_event`].
    hook: AtomicPtr<()>,
}

impl Budget {
    /// No budget.
    pub const fn new() -> Self {
        Self {
            limit: AtomicUsize::new(usize::MAX),
            fail: AtomicBool::new(false),
            hook: AtomicPtr::new(core::ptr::null_mut()),
        }
    }

    /// Sets (`Some(bytes)`) or removes (`None`) the budget, and what going over does.
    /// Through [`Registration::set_budget`](crate::Registration::set_budget), which also
    /// tells the allocator's counters.
    pub(crate) fn set(&self, bytes: Option<usize>, mode: BudgetMode) {
        self.fail.store(mode == BudgetMode::Fail, Relaxed);
        self.limit.store(bytes.unwrap_or(usize::MAX), Relaxed);
        // A child with a budget (or below one) leaves its thread-cache lane for the path
        // that checks the budget at every call.
        crate::lanes::refresh();
    }

    /// Replaces the hook called when the budget is exceeded (the default is
    /// [`log_budget_event`]).
    ///
    /// The hook runs inside the allocation that went over, on the allocating thread. When
    /// the allocator is the parent of a pool, that pool's lock is held meanwhile: a hook
    /// that allocates from a *pool* (other than through the global allocator) can then
    /// deadlock a concurrent `fork()`, whose handlers take the pools' locks in tree order.
    pub fn set_hook(&self, hook: BudgetHook) {
        self.hook.store(hook as *mut (), Relaxed);
    }

    /// The budget in bytes, if one is set.
    pub fn limit(&self) -> Option<usize> {
        match self.limit.load(Relaxed) {
            usize::MAX => None,
            n => Some(n),
        }
    }

    /// The current mode.
    pub fn mode(&self) -> BudgetMode {
        if self.fail.load(Relaxed) {
            BudgetMode::Fail
        } else {
            BudgetMode::Warn
        }
    }

    /// Whether a budget is set (allocators with one count with exact shared atomics).
    #[inline]
    pub(crate) fn is_set(&self) -> bool {
        self.limit.load(Relaxed) != usize::MAX
    }

    /// Whether `live` bytes exceed the budget (the allocation-path check).
    #[inline]
    pub(crate) fn exceeded_by(&self, live: usize) -> bool {
        live > self.limit.load(Relaxed)
    }

    /// Whether the budget refuses allocations that exceed it and is set at all (callers
    /// then take the exact, slower path for in-place growth).
    #[inline]
    pub(crate) fn enforced(&self) -> bool {
        self.limit.load(Relaxed) != usize::MAX && self.fail.load(Relaxed)
    }

    /// Calls the hook for `event`.
    #[cold]
    pub(crate) fn notify(&self, event: &BudgetEvent) {
        let hook = self.hook.load(Relaxed);
        if hook.is_null() {
            log_budget_event(event);
        } else {
            // SAFETY: the only non-null values stored are `BudgetHook` function pointers
            // (`set_hook`), and function pointers round-trip through `*mut ()`.
            let hook: BudgetHook = unsafe { core::mem::transmute::<*mut (), BudgetHook>(hook) };
            hook(event);
        }
    }
}

impl Default for Budget {
    fn default() -> Self {
        Self::new()
    }
}
