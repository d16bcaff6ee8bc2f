#![doc = include_str!("../README.md")]
#![deny(unsafe_op_in_unsafe_fn)]
#![warn(missing_docs, clippy::undocumented_unsafe_blocks)]
#![cfg_attr(
    feature = "nightly",
    feature(allow_internal_unstable),
    allow(internal_features)
)]

// The hierarchy, bottom to top: the OS layer, the schemas (algorithms), the allocators.
pub mod config;
mod fatal;
pub mod os;
pub mod schema;
mod sync;
mod system;
mod thread_cache;
pub mod virtual_block;
// The allocator family, above the heap: statistics and budgets, the registry, child
// allocators, the per-type handles, typed allocation, and the reports.
mod budget;
pub mod child;
pub mod handle;
pub mod pools;
pub mod records;
pub mod registry;
pub mod report;
mod stats;
pub mod typed;

pub use allocator_api2;
pub use budget::{Budget, BudgetEvent, BudgetHook, BudgetMode, log_budget_event};
pub use child::BlockAllocator;
pub use records::RecordMode;
pub use registry::{AllocatorKind, Registration};
pub use report::dump_allocators;
pub use stats::{AllocatorStats, Counters};
pub use system::SystemAllocator;
pub use typed::ClassAllocator;
