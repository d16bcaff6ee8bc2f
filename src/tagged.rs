//! One interface to every allocator's figures and settings: [`TaggedAllocator`].
//!
//! Every handle declared with [`allocator!`](crate::allocator) and the
//! [`SystemAllocator`] implement it, so code written once works for all of them:
//!
//! ```
//! use tagalloc::{AllocatorStats, BudgetMode, SystemAllocator, TaggedAllocator};
//!
//! tagalloc::allocator!(Meshes: child of SystemAllocator, "Mesh data");
//! tagalloc::allocator!(Events: pool of SystemAllocator, "UI events");
//!
//! fn describe(allocator: &dyn TaggedAllocator) -> String {
//!     let s: AllocatorStats = allocator.stats();
//!     format!("{}: {} bytes in {} blocks", allocator.name(), s.live_granted_bytes, s.live_blocks)
//! }
//!
//! let mesh = allocator_api2::boxed::Box::new_in([0u8; 100], Meshes);
//! assert!(describe(&Meshes).starts_with("Meshes: 104 bytes in 1 blocks"));
//! assert!(describe(&Events).starts_with("Events: 0 bytes"));
//! assert!(describe(&SystemAllocator::new()).starts_with("SystemAllocator: "));
//! // The SystemAllocator's heap figures come as an extra.
//! assert!(SystemAllocator::new().stats().heap.is_some());
//! assert!(Meshes.stats().heap.is_none());
//!
//! fn count_over_budget(_: &tagalloc::BudgetEvent) { /* an atomic counter, a fixed message */ }
//! Meshes.set_budget(Some(64 << 10), BudgetMode::Warn);
//! Meshes.set_budget_hook(count_over_budget);
//! assert_eq!(Meshes.budget().limit(), Some(64 << 10));
//! # drop(mesh);
//! ```

use crate::budget::{Budget, BudgetHook, BudgetMode};
use crate::records::RecordMode;
use crate::registry::{Registration, SYSTEM};
use crate::stats::AllocatorStats;
use crate::system::SystemAllocator;
use core::num::NonZeroU32;

/// What every allocator offers besides allocating: its name, its statistics in one shape,
/// its budget and the budget's hook, its records, guarded sampling, and giving free memory
/// back.
///
/// Implemented by every [`allocator!`](crate::allocator) handle and by the
/// [`SystemAllocator`]; object-safe, so `&dyn TaggedAllocator` can hold any of them.
/// Handles also have inherent methods of the same names (`stats()`, `set_budget()`, ...),
/// which do the same.
pub trait TaggedAllocator {
    /// This allocator's registry entry (name, parent, counters, budget, records).
    fn registry_entry(&self) -> &'static Registration;

    /// Returns free memory to the parent or the OS: a pool's empty pages, the
    /// `SystemAllocator`'s cached blocks and empty pages. A child holds nothing beyond its
    /// live blocks, so for a child this does nothing.
    fn garbage_collect(&self);

    /// The allocator's name (for declared allocators, the handle type's name).
    fn name(&self) -> &'static str {
        self.registry_entry().name()
    }

    /// What the allocator is for (its declaration's description).
    fn description(&self) -> &'static str {
        self.registry_entry().description()
    }

    /// A snapshot of the allocator's figures. For the `SystemAllocator`, `heap` holds the
    /// heap's own figures too.
    fn stats(&self) -> AllocatorStats {
        self.registry_entry().stats()
    }

    /// The budget settings (limit, mode).
    fn budget(&self) -> &'static Budget {
        self.registry_entry().budget()
    }

    /// Sets (`Some(bytes)`) or removes (`None`) a budget on live granted bytes; see
    /// [`Registration::set_budget`]. The `SystemAllocator` and the OS layer enforce none.
    fn set_budget(&self, bytes: Option<usize>, mode: BudgetMode) {
        self.registry_entry().set_budget(bytes, mode);
    }

    /// Replaces the function called when an allocation finds this allocator over budget
    /// (see [`Budget::set_hook`]).
    fn set_budget_hook(&self, hook: BudgetHook) {
        self.registry_entry().budget().set_hook(hook);
    }

    /// Sets what this allocator records from now on (see [`records`](crate::records));
    /// overrides `TAGALLOC_RECORDS`.
    fn set_records(&self, mode: RecordMode) {
        self.registry_entry().set_records(mode);
    }

    /// What this allocator records (registering it first, so that a `TAGALLOC_RECORDS`
    /// entry for it applies).
    fn record_mode(&self) -> RecordMode {
        let entry = self.registry_entry();
        entry.register();
        entry.record_mode()
    }

    /// Guards one allocation in `every` (`None`: none) against an inaccessible page (see
    /// [`guarded`](crate::guarded)); overrides `TAGALLOC_GUARDED`. `false`, changing
    /// nothing, for allocators that cannot guard (pools and their children).
    fn set_guarded(&self, every: Option<NonZeroU32>) -> bool {
        self.registry_entry().set_guarded(every)
    }

    /// One allocation in how many this allocator guards, if it does.
    fn guarded(&self) -> Option<NonZeroU32> {
        self.registry_entry().guarded()
    }
}

impl SystemAllocator {
    /// A snapshot of the allocator's figures, in the shape every allocator shares
    /// ([`TaggedAllocator::stats`]): live granted bytes and blocks, calls, bytes held from
    /// the OS (`reserved_bytes`), and the heap's own figures in `heap` (those of
    /// [`heap_stats`](Self::heap_stats)). Per-thread counts are summed on read, so the
    /// figures are exact whenever no thread is allocating meanwhile.
    ///
    /// `peak_granted_bytes` is the highest live figure any reading has seen (this one
    /// included): the thread caches keep no shared running total, so peaks between two
    /// readings are not seen. [`report::mark_frame`](crate::report::mark_frame) reads it
    /// once per frame.
    pub fn stats(&self) -> AllocatorStats {
        SYSTEM.stats()
    }
}

impl TaggedAllocator for SystemAllocator {
    fn registry_entry(&self) -> &'static Registration {
        &SYSTEM
    }

    fn garbage_collect(&self) {
        SystemAllocator::garbage_collect(self);
    }
}
