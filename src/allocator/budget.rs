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

use crate::fatal::StackText;
use crate::messages::warn;
use crate::registry::Registration;
use core::cell::Cell;
use core::fmt::Write;
use core::sync::atomic::{AtomicPtr, AtomicUsize, Ordering::Relaxed};

/// What happens when an allocation takes an allocator over its budget.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BudgetMode {
    /// Call the hook and let the allocation through.
    Warn,
    /// Call the hook and refuse the allocation.
    Fail,
}

/// What the budget hook is told.
///
/// The event is about the allocator whose budget was exceeded, and goes to that
/// allocator's hook. A request may have come in through a child below it (a child passes
/// its requests up): when such a request is refused, the refusal counts in the
/// `budget_failures` of the allocator whose budget refused *and* of every child the request
/// passed through, so that each shows it failed; `allocator` says whose budget it was.
#[derive(Clone, Copy, Debug)]
pub struct BudgetEvent {
    /// The name of the allocator whose budget was exceeded (and, if `refused`, refused).
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

thread_local! {
    /// The last refusal by a budget on this thread: the allocator whose budget refused and
    /// the requested size, so that the children a refused request passed through can count
    /// it too (see [`note_refusal`]). A const-initialised pair of plain words with no
    /// destructor: readable at any time, also while the thread exits, and never allocates.
    static REFUSED: (Cell<*const Registration>, Cell<usize>) =
        const { (Cell::new(core::ptr::null()), Cell::new(0)) };
}

/// Notes that `by`'s budget refused a request of `size` bytes on this thread (called by the
/// allocator that refused, after its hook was told).
#[cold]
pub(crate) fn note_refusal(by: &'static Registration, size: usize) {
    let _ = REFUSED.try_with(|(who, bytes)| {
        who.set(by);
        bytes.set(size);
    });
}

/// Whether a request of `size` bytes that `requester` passed to its parent, and that came
/// back refused, was refused by the budget of an allocator above `requester` (the last
/// refusal noted on this thread, for that size, by an ancestor). The caller counts it as
/// one of its own budget failures.
#[cold]
pub(crate) fn refused_above(requester: &'static Registration, size: usize) -> bool {
    let Ok((by, bytes)) = REFUSED.try_with(|(who, bytes)| (who.get(), bytes.get())) else {
        return false;
    };
    if by.is_null() || bytes != size {
        return false;
    }
    let mut above = requester.parent();
    while let Some(entry) = above {
        if core::ptr::eq(entry, by) {
            return true;
        }
        above = entry.parent();
    }
    false
}

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
    warn(text.as_bytes());
}

/// One allocator's budget settings: limit, mode and hook; `const`-constructible.
///
/// The limit and the mode share one atomic word, so that a call reads both at once: read
/// apart, a call racing [`Registration::set_budget`](crate::Registration::set_budget) could
/// pair the old limit with the new mode, and be refused by a budget that no longer exists.
#[derive(Debug)]
pub struct Budget {
    /// The limit in the low bits ([`NO_LIMIT`] when none is set) and [`FAIL`] for the mode.
    settings: AtomicUsize,
    /// A `BudgetHook` stored as a pointer; null means [`log_budget_event`].
    hook: AtomicPtr<()>,
}

/// The mode bit of [`Budget::settings`]: set for [`BudgetMode::Fail`].
const FAIL: usize = 1 << (usize::BITS - 1);
/// The limit bits of [`Budget::settings`], and their value when no budget is set. A limit
/// can be at most one less: no process holds that many bytes.
const NO_LIMIT: usize = !FAIL;

/// One reading of an allocator's budget limit and mode, taken together, so that a decision
/// (is the call over? is it refused? what does the hook hear?) rests on one setting even
/// while another thread changes it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct BudgetSettings(usize);

impl BudgetSettings {
    /// The budget in bytes, if one is set.
    pub(crate) fn limit(self) -> Option<usize> {
        match self.0 & NO_LIMIT {
            NO_LIMIT => None,
            n => Some(n),
        }
    }

    /// The limit as the hook is told it (`usize::MAX` for none).
    pub(crate) fn reported_limit(self) -> usize {
        self.limit().unwrap_or(usize::MAX)
    }

    /// The mode.
    pub(crate) fn mode(self) -> BudgetMode {
        if self.0 & FAIL != 0 {
            BudgetMode::Fail
        } else {
            BudgetMode::Warn
        }
    }

    /// Whether a budget is set.
    #[inline]
    pub(crate) fn is_set(self) -> bool {
        self.0 & NO_LIMIT != NO_LIMIT
    }

    /// Whether `live` bytes exceed the budget (never when none is set).
    #[inline]
    pub(crate) fn exceeded_by(self, live: usize) -> bool {
        self.is_set() && live > self.0 & NO_LIMIT
    }

    /// Whether a budget is set and refuses the allocations that exceed it.
    #[inline]
    pub(crate) fn enforced(self) -> bool {
        self.is_set() && self.0 & FAIL != 0
    }
}

impl Budget {
    /// No budget.
    pub const fn new() -> Self {
        Self {
            settings: AtomicUsize::new(NO_LIMIT),
            hook: AtomicPtr::new(core::ptr::null_mut()),
        }
    }

    /// Sets (`Some(bytes)`) or removes (`None`) the budget, and what going over does; limit
    /// and mode change together. A limit of `isize::MAX` bytes or more is kept as
    /// `isize::MAX - 1` (no process can hold more). Through
    /// [`Registration::set_budget`](crate::Registration::set_budget), which also tells the
    /// allocator's counters.
    pub(crate) fn set(&self, bytes: Option<usize>, mode: BudgetMode) {
        let limit = bytes.map_or(NO_LIMIT, |b| b.min(NO_LIMIT - 1));
        let fail = if mode == BudgetMode::Fail { FAIL } else { 0 };
        self.settings.store(limit | fail, Relaxed);
        // A child with a budget (or below one) leaves its thread-cache lane for the path
        // that checks the budget at every call.
        crate::lanes::refresh();
    }

    /// The limit and mode as they are now, read together.
    #[inline]
    pub(crate) fn settings(&self) -> BudgetSettings {
        BudgetSettings(self.settings.load(Relaxed))
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
        self.settings().limit()
    }

    /// The current mode.
    pub fn mode(&self) -> BudgetMode {
        self.settings().mode()
    }

    /// Whether a budget is set (allocators with one count with exact shared atomics).
    #[inline]
    pub(crate) fn is_set(&self) -> bool {
        self.settings().is_set()
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_reading_keeps_the_limit_and_mode_it_was_taken_with() {
        let budget = Budget::new();
        assert_eq!((budget.limit(), budget.mode()), (None, BudgetMode::Warn));
        assert!(!budget.settings().exceeded_by(usize::MAX));
        budget.set(Some(64), BudgetMode::Warn);
        let warn = budget.settings();
        budget.set(None, BudgetMode::Fail);
        let none = budget.settings();
        // The first reading is over at 65 bytes but refuses nothing; the second has no limit.
        assert!(warn.exceeded_by(65) && !warn.exceeded_by(64) && !warn.enforced());
        assert_eq!((warn.limit(), warn.mode()), (Some(64), BudgetMode::Warn));
        assert!(!none.exceeded_by(usize::MAX) && !none.enforced() && !none.is_set());
        assert_eq!((none.limit(), none.mode()), (None, BudgetMode::Fail));
        assert_eq!(none.reported_limit(), usize::MAX);
        budget.set(Some(0), BudgetMode::Fail);
        let zero = budget.settings();
        assert!(zero.is_set() && zero.enforced() && zero.exceeded_by(1) && !zero.exceeded_by(0));
    }

    #[test]
    fn limits_past_isize_max_are_kept_just_below_it() {
        let budget = Budget::new();
        for bytes in [isize::MAX as usize - 1, isize::MAX as usize, usize::MAX] {
            budget.set(Some(bytes), BudgetMode::Fail);
            assert_eq!(budget.limit(), Some(isize::MAX as usize - 1), "{bytes}");
            assert_eq!(budget.mode(), BudgetMode::Fail);
            assert!(budget.settings().enforced());
        }
        budget.set(Some(isize::MAX as usize - 2), BudgetMode::Warn);
        assert_eq!(budget.limit(), Some(isize::MAX as usize - 2));
    }
}
