#![doc = include_str!("../README.md")]
#![deny(unsafe_op_in_unsafe_fn)]
#![warn(missing_docs, clippy::undocumented_unsafe_blocks)]
#![cfg_attr(feature = "nightly", feature(allocator_api))]

pub mod os;
pub mod virtual_block;
