//! The allocator comparison harness for tagalloc.
//!
//! The same workloads run with tagalloc, `std::alloc::System`, mimalloc and jemalloc, each as
//! the `#[global_allocator]` of its own process. The global allocator is chosen at compile time
//! by exactly one `alloc-*` cargo feature ([`allocator`]); the `compare` binary builds the
//! `workload` and `pairs` binaries once per feature and runs them interleaved. See
//! `compare/README.md` for the command and how to read its tables.
//!
//! This crate is a workspace member but not a default member, so building or testing tagalloc
//! at the workspace root never compiles mimalloc's or jemalloc's C sources.

#![deny(unsafe_op_in_unsafe_fn)]
#![warn(missing_docs, clippy::undocumented_unsafe_blocks)]

pub mod allocator;
pub mod rng;
pub mod rss;
pub mod workloads;
