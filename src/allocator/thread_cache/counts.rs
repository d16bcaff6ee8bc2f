//! A size class's counts in a thread cache's lane, and how they are handed on: the owner
//! counts with plain loads and stores, any thread publishes the net allocations' bytes by
//! compare-and-swap of a mark, and an exiting thread publishes the rest and moves its counts
//! to shared counters under the registry lock.
//!
//! This file is also compiled by the loom models (`loom/`) with loom's atomics (their own
//! `crate::sync::atomic`), so they check this code, not a copy: it names no static and builds
//! no value in a `const` (loom's atomics cannot). Marks and counts are passed by reference,
//! so the lane keeps its layout.

use crate::sync::atomic::{AtomicU32, AtomicU64, Ordering::*};

/// Adds one to a count only its owner writes: a load and a store, no read-modify-write.
#[inline(always)]
pub(crate) fn owner_add(count: &AtomicU64) {
    count.store(count.load(Relaxed) + 1, Relaxed);
}

/// Frees minus allocations (wrapping).
#[inline(always)]
pub(crate) fn net_frees(allocations: &AtomicU64, frees: &AtomicU64) -> i64 {
    frees.load(Relaxed).wrapping_sub(allocations.load(Relaxed)) as i64
}

/// Allocations minus frees, low 32 bits: what a publication mark counts.
#[inline]
pub(crate) fn net_allocations(allocations: &AtomicU64, frees: &AtomicU64) -> u32 {
    net_frees(allocations, frees).wrapping_neg() as u32
}

/// The net allocations not yet published (negative when more were freed). The mark is read
/// first (Acquire): the counts read after it are at least as new as the ones it was set
/// from, so the difference never runs backwards.
#[inline]
pub(crate) fn unpublished(
    published: &AtomicU32,
    allocations: &AtomicU64,
    frees: &AtomicU64,
) -> i32 {
    let mark = published.load(Acquire);
    net_allocations(allocations, frees).wrapping_sub(mark) as i32
}

/// Moves the mark up to the net allocations and returns the blocks it passed (negative
/// when more were freed). Any thread: the mark advances by compare-and-swap, so every block
/// is published exactly once.
#[inline]
pub(crate) fn take_unpublished(
    published: &AtomicU32,
    allocations: &AtomicU64,
    frees: &AtomicU64,
) -> i32 {
    let mut mark = published.load(Acquire);
    loop {
        let net = net_allocations(allocations, frees);
        if net == mark {
            return 0;
        }
        match published.compare_exchange_weak(mark, net, AcqRel, Acquire) {
            Ok(_) => return net.wrapping_sub(mark) as i32,
            Err(now) => mark = now,
        }
    }
}

/// [`take_unpublished`] when no other thread can publish: the owner is exiting and holds
/// the registry lock, which every publisher of another thread's lane holds too. A load and a
/// store, no compare-and-swap.
#[inline]
pub(crate) fn take_unpublished_exiting(
    published: &AtomicU32,
    allocations: &AtomicU64,
    frees: &AtomicU64,
) -> i32 {
    let mark = published.load(Relaxed);
    let net = net_allocations(allocations, frees);
    if net == mark {
        return 0;
    }
    published.store(net, Relaxed);
    net.wrapping_sub(mark) as i32
}

/// Adds an exiting owner's counts to the shared ones (`to_*`, which any thread adds to) and
/// zeroes its own. Loads and stores on the owner's side: only the owner writes them, and it
/// is the one exiting, under the registry lock that readers of both hold too.
#[inline]
pub(crate) fn move_counts(
    allocations: &AtomicU64,
    frees: &AtomicU64,
    to_allocations: &AtomicU64,
    to_frees: &AtomicU64,
) {
    let (allocated, freed) = (allocations.load(Relaxed), frees.load(Relaxed));
    allocations.store(0, Relaxed);
    frees.store(0, Relaxed);
    if allocated | freed != 0 {
        to_allocations.fetch_add(allocated, Relaxed);
        to_frees.fetch_add(freed, Relaxed);
    }
}
