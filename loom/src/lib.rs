//! tagalloc's concurrency models: loom runs each model under every interleaving of its
//! threads (and every reordering its atomics' orderings allow) up to a preemption bound, and
//! fails on a broken assertion, a deadlock, or an access to a `loom::cell::UnsafeCell` that
//! is not ordered after the previous one (a data race).
//!
//! The models compile tagalloc's own source files (the `#[path]` modules below), whose
//! atomics come from `crate::sync::atomic`: tagalloc maps that to `core`'s, this crate to
//! loom's. So what is checked is the code that ships, not a copy of it. Only loom is built,
//! not tagalloc and its dev-dependencies:
//!
//! ```sh
//! cargo test -p tagalloc-loom --release
//! ```
//!
//! `LOOM_MAX_PREEMPTIONS` bounds the search (5 unless set; `stress/run.sh loom` runs 10).
#![cfg(test)]
#![deny(unsafe_op_in_unsafe_fn)]
#![warn(clippy::undocumented_unsafe_blocks)]

/// What the shared files import as `crate::sync::atomic`.
mod sync {
    pub(crate) mod atomic {
        pub(crate) use loom::hint::spin_loop;
        pub(crate) use loom::sync::atomic::{
            AtomicBool, AtomicPtr, AtomicU32, AtomicU64, Ordering,
        };
        pub(crate) use loom::thread::yield_now;
    }
}

/// The raw locks of `tagalloc::sync`: the fair lock (the thread registry's) and the
/// test-and-set flag (the heaps', the pools' and the records' locks).
#[allow(dead_code)]
#[path = "../../src/sync/raw.rs"]
mod raw;

/// The thread pool's remote stack: the cross-thread free path.
#[path = "../../src/schema/thread_pool/remote.rs"]
mod remote;

/// A thread cache's per-class counts and their hand-off at thread exit.
#[allow(dead_code)]
#[path = "../../src/allocator/thread_cache/counts.rs"]
mod counts;

mod exit_handoff;
mod locks;
mod remote_free;

/// Runs `f` under loom with a preemption bound of 5 unless `LOOM_MAX_PREEMPTIONS` sets one.
fn model(f: impl Fn() + Sync + Send + 'static) {
    let mut builder = loom::model::Builder::new();
    if builder.preemption_bound.is_none() {
        builder.preemption_bound = Some(5);
    }
    builder.check(f);
}
