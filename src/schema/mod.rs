//! Schemas: the allocation algorithms, free of global state.
//!
//! Each schema draws memory from a [`PageSource`](crate::os::PageSource) (the OS, or plain
//! memory in tests) and can be used on its own; the allocators above add statistics,
//! records and registration.

pub mod hpha;

pub use hpha::{HphaSchema, HphaStats};

use core::ptr::NonNull;

/// A block handed out by a schema: where it is and how many bytes it really has.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Allocation {
    /// Start of the block, aligned as requested.
    pub ptr: NonNull<u8>,
    /// Usable bytes: at least the requested size.
    pub size: usize,
}
