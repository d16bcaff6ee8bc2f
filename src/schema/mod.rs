//! Schemas: the allocation algorithms, free of global state (but for the thread pool's
//! per-thread tables, which map each thread to its heap of each pool).
//!
//! HPHA draws memory from a [`PageSource`](crate::os::PageSource) (the OS, or plain memory
//! in tests); the pools carve pages obtained from a [`PageParent`] (another allocator). Each
//! schema can be used on its own; the allocators above add statistics, records and
//! registration.

pub(crate) mod guarded;
pub mod hpha;
mod parent;
pub mod pool;
pub mod thread_pool;

pub use hpha::{HphaSchema, HphaStats};
pub use parent::PageParent;
pub use pool::{PoolConfig, PoolConfigError, PoolSchema, PoolStats};
pub use thread_pool::ThreadPoolSchema;

use core::ptr::NonNull;

/// A block handed out by a schema: where it is and how many bytes it really has.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Allocation {
    /// Start of the block, aligned as requested.
    pub ptr: NonNull<u8>,
    /// Usable bytes: at least the requested size.
    pub size: usize,
}
