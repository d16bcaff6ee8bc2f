//! Layer 3, the allocators: the general-purpose `SystemAllocator` with its thread caches,
//! and the tagged family built on top of the schemas — counters and budgets, the registry
//! every allocator joins, and the child and pool cores behind the `allocator!` handles.

pub(crate) mod budget;
pub mod child;
pub(crate) mod fork;
pub mod guarded;
pub(crate) mod lanes;
pub mod pools;
pub mod registry;
pub(crate) mod stats;
pub(crate) mod system;
pub(crate) mod thread_cache;
pub(crate) mod thread_pointer;
