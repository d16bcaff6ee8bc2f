#![doc = include_str!("../README.md")]
#![deny(unsafe_op_in_unsafe_fn)]
#![warn(missing_docs, clippy::undocumented_unsafe_blocks)]
#![cfg_attr(feature = "nightly", feature(allocator_api))]

// The hierarchy, bottom to top: the OS layer, the schemas (algorithms), the allocators.
pub mod config;
mod fatal;
pub mod os;
pub mod schema;
mod sync;
mod system;
mod thread_cache;
pub mod virtual_block;

pub use system::SystemAllocator;
