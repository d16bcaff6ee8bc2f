//! Finding the calling thread's heap of a given thread-pool schema, and abandoning it when
//! the thread exits.
//!
//! Several thread-pool schemas can exist at once, so per-thread state is keyed by schema:
//! each live schema holds a *slot* (an index below [`SLOTS`]), and each thread has a small
//! table, in a `thread_local!`, mapping a slot to `(schema uid, heap)`. A lookup is an index
//! and a compare. The uid (never reused) tells a current entry from a stale one left by a
//! dropped schema whose slot was since given to another.
//!
//! The table is const-initialised (no lazy heap) and has a destructor, registered by the
//! standard library on first use, that abandons the thread's heaps. (On glibc the standard
//! library registers it with `__cxa_thread_atexit_impl`, which uses the C heap, not the Rust
//! global allocator, so first use from inside a global allocator does not recurse. On targets
//! without that call std keeps its own list of destructors in a `Vec`.) It runs with the slot
//! lock held and only for schemas still alive, so a schema being dropped on another thread
//! (which releases its slot under the same lock first) is never touched. After the table is
//! destroyed, lookups answer [`Lookup::Gone`] and the schema falls back to its locked heap.
//!
//! With more than [`SLOTS`] thread-pool schemas alive, the extra ones get no slot and use
//! the locked fallback heap for every request: correct, only slower.

use super::heap::ThreadHeap;
use crate::sync::SpinLock;
use core::cell::Cell;
use core::ptr::null_mut;

/// Thread-pool schemas that can have per-thread heaps at the same time.
pub const SLOTS: usize = 32;
/// The slot of a schema that did not get one.
pub(crate) const NO_SLOT: usize = usize::MAX;

/// The uid of the live schema holding each slot (0: free).
static SLOT_UIDS: SpinLock<[usize; SLOTS]> = SpinLock::new([0; SLOTS]);

/// Gives a slot to the schema with this uid, or [`NO_SLOT`] when all are taken.
pub(crate) fn claim_slot(uid: usize) -> usize {
    let mut slots = SLOT_UIDS.lock();
    match slots.iter().position(|&u| u == 0) {
        Some(i) => {
            slots[i] = uid;
            i
        }
        None => NO_SLOT,
    }
}

/// Releases a schema's slot. After this returns, no exiting thread touches the schema.
pub(crate) fn release_slot(slot: usize, uid: usize) {
    if slot < SLOTS {
        let mut slots = SLOT_UIDS.lock();
        debug_assert_eq!(slots[slot], uid);
        slots[slot] = 0;
    }
}

#[derive(Clone, Copy)]
struct Entry {
    uid: usize,
    heap: *mut ThreadHeap,
}

/// One thread's map from slot to heap.
struct ThreadTable {
    entries: [Cell<Entry>; SLOTS],
}

impl Drop for ThreadTable {
    fn drop(&mut self) {
        for (slot, entry) in self.entries.iter().enumerate() {
            let e = entry.get();
            if e.uid == 0 {
                continue;
            }
            entry.set(Entry {
                uid: 0,
                heap: null_mut(),
            });
            let slots = SLOT_UIDS.lock();
            if slots[slot] == e.uid {
                // SAFETY: the slot still belongs to the heap's schema, alive (and undroppable while
                // we hold the slot lock); this thread was the heap's user and is exiting.
                unsafe { ThreadHeap::abandon(e.heap) };
            }
            drop(slots);
        }
    }
}

thread_local! {
    static TABLE: ThreadTable = const {
        ThreadTable {
            entries: [const { Cell::new(Entry { uid: 0, heap: null_mut() }) }; SLOTS],
        }
    };
}

/// What the calling thread has for a schema.
#[derive(Clone, Copy)]
pub(crate) enum Lookup {
    /// The thread's heap for the schema.
    Found(*mut ThreadHeap),
    /// No heap yet: the thread may create or adopt one.
    Missing,
    /// No thread-local storage (being torn down, or the schema has no slot): use the
    /// fallback heap.
    Gone,
}

/// The calling thread's heap of the schema holding `slot` with `uid`.
#[inline]
pub(crate) fn lookup(slot: usize, uid: usize) -> Lookup {
    if slot >= SLOTS {
        return Lookup::Gone;
    }
    TABLE
        .try_with(|t| {
            let e = t.entries[slot].get();
            if e.uid == uid {
                Lookup::Found(e.heap)
            } else {
                Lookup::Missing
            }
        })
        .unwrap_or(Lookup::Gone)
}

/// Records `heap` as the calling thread's heap of the schema; `false` if the thread's
/// storage is gone (the caller keeps the heap).
pub(crate) fn install(slot: usize, uid: usize, heap: *mut ThreadHeap) -> bool {
    slot < SLOTS
        && TABLE
            .try_with(|t| t.entries[slot].set(Entry { uid, heap }))
            .is_ok()
}
