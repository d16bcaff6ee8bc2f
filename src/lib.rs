#![doc = include_str!("../README.md")]
#![deny(unsafe_op_in_unsafe_fn)]
#![warn(missing_docs, clippy::undocumented_unsafe_blocks)]
#![cfg_attr(
    feature = "nightly",
    feature(allow_internal_unstable),
    allow(internal_features)
)]

// The hierarchy, bottom to top. Data flows down. Two bridges point up on purpose:
// `schema::parent` implements its page-source trait for the `SystemAllocator`, and the
// virtual block's facade can register itself in the allocator registry.
//
// Support, used everywhere: allocation-free locks, aborting with a message, start-up
// configuration read without allocating.
pub mod config;
mod fatal;
pub mod messages;
mod sync;
// 1. The OS layer: pages from mmap, counted.
pub mod os;
// 2. Schemas: the algorithms (HPHA, pools), free of global state, testable under Miri.
pub mod schema;
// 3. Allocators (src/allocator/): the global SystemAllocator with its thread caches; the
//    tagged family (counters and budgets, the registry, child and pool cores). Records
//    (src/records/) hook into both.
mod allocator;
pub mod records;
pub(crate) use allocator::{budget, fork, lanes, stats, system, thread_cache};
pub use allocator::{child, guarded, pools, registry};
// 4. What programs use: per-type handles (`allocator!`), typed allocation, reports.
pub mod handle;
pub mod report;
pub mod scope;
pub mod tagged;
pub mod typed;
// Apart from the hierarchy: offsets in memory tagalloc never touches (GPU heaps, files).
pub mod virtual_block;

pub use allocator_api2;
pub use budget::{Budget, BudgetEvent, BudgetHook, BudgetMode, log_budget_event};
pub use child::BlockAllocator;
pub use records::RecordMode;
pub use registry::{AllocatorKind, Registration};
pub use report::dump_allocators;
pub use scope::{TagGuard, untagged};
pub use stats::{AllocatorStats, Counters};
pub use system::SystemAllocator;
pub use tagged::TaggedAllocator;
pub use typed::ClassAllocator;
