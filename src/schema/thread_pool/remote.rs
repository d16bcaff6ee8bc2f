//! The cross-thread free path of the thread pool: a lock-free stack of blocks freed by
//! threads other than the heap's user, which that user takes back whole.
//!
//! This file is also compiled by `tests/loom.rs` with loom's atomics (its own
//! `crate::sync::atomic`), so the model checks this code, not a copy: it names no static and
//! builds no value in a `const` (loom's atomics cannot).

use crate::sync::atomic::{AtomicPtr, Ordering::*};

/// A block that can be linked into a [`RemoteStack`] through its first word.
pub(crate) trait Link {
    /// Links `node` to `next`.
    ///
    /// # Safety
    /// `node` is a block the caller owns.
    unsafe fn set_next(node: *mut Self, next: *mut Self);
    /// The block `node` is linked to.
    ///
    /// # Safety
    /// `node` is a block the caller owns, linked by [`set_next`](Self::set_next).
    unsafe fn next(node: *mut Self) -> *mut Self;
}

/// Blocks freed by other threads: many push, only the heap's user takes (the whole stack at
/// once), so there is no ABA problem.
pub(crate) struct RemoteStack<T> {
    /// The last block pushed (null: none). Built by the owner of the value as
    /// `AtomicPtr::new(null_mut())`.
    pub(crate) head: AtomicPtr<T>,
}

impl<T: Link> RemoteStack<T> {
    /// Pushes `node`, a block the caller gives up. Release: the block's link (and anything
    /// the caller wrote to it before) is visible to whoever takes it.
    ///
    /// # Safety
    /// `node` is a valid block that no other thread uses, and stays valid until taken.
    #[inline]
    pub(crate) unsafe fn push(&self, node: *mut T) {
        let mut cur = self.head.load(Relaxed);
        loop {
            // SAFETY: the block is ours to write until it is published by the CAS.
            unsafe { T::set_next(node, cur) };
            match self.head.compare_exchange_weak(cur, node, Release, Relaxed) {
                Ok(_) => return,
                Err(now) => cur = now,
            }
        }
    }

    /// Takes every block pushed so far, as a list linked by [`Link`] (null: none). Acquire:
    /// the pushers' links are visible.
    ///
    /// Only one thread at a time (the heap's user) may take.
    #[inline]
    pub(crate) fn take_all(&self) -> *mut T {
        self.head.swap(core::ptr::null_mut(), Acquire)
    }

    /// Counts the blocks waiting (for validation: nobody may push or take meanwhile).
    pub(crate) fn len_quiescent(&self) -> usize {
        let mut n = 0;
        let mut s = self.head.load(Acquire);
        while !s.is_null() {
            n += 1;
            // SAFETY: quiescent: the stack's blocks are valid and not being pushed.
            s = unsafe { T::next(s) };
        }
        n
    }
}
