//! Bins of exited threads, parked for the next threads to adopt whole.
//!
//! A thread that exits holds free blocks in its bins; a thread that starts has none and
//! would refill every class it uses from the heap, one class lock and one free-list walk at
//! a time (a list freed by other threads, so a cache miss per block). Programs that start
//! and end many short threads (thread pools spawning per task, test harnesses, scoped
//! threads) spent most of their allocator time there. So an exiting thread parks each
//! lane's bins as they are (a pointer and a count per class, no walk), and a thread setting
//! up a lane of the same tag adopts a parked set whole: its first allocations are pops.
//! mimalloc and rpmalloc hand a dead thread's pages or heap to the next thread for the same
//! reason.
//!
//! Parked blocks are free and counted nowhere but as blocks the caches hold (as in a live
//! thread's bins). At most [`MAX_PARKED`] sets wait; past that an exiting thread gives its
//! blocks back to the heap as before, and `garbage_collect` gives every parked set back.
//! The sets live in the thread registry's list, changed under its lock (which the `fork()`
//! handlers hold).

use super::{HEAP, Lane, ThreadList};
use crate::os::{OsAllocator, PageSource};
use crate::schema::hpha::Tag;
use crate::schema::hpha::size_class::CLASS_COUNT;
use crate::schema::hpha::small::FreeSlot;
use core::ptr::null_mut;

/// Parked sets waiting at most (of every tag together).
pub(super) const MAX_PARKED: usize = 16;
/// Bytes mapped at once for set records.
const SLAB: usize = 64 * 1024;

/// One lane's bins, parked: each class's list and its count (see `lane::Bin::full_at`).
pub(super) struct ParkedBins {
    next: *mut ParkedBins,
    tag: Tag,
    bins: [(*mut FreeSlot, i32); CLASS_COUNT],
}

/// The parked sets, and records for more.
pub(super) struct Parked {
    head: *mut ParkedBins,
    count: usize,
    free: *mut ParkedBins,
}

impl Parked {
    pub(super) const fn new() -> Self {
        Self {
            head: null_mut(),
            count: 0,
            free: null_mut(),
        }
    }

    /// A record for a set, from the free ones or a new slab; `None` when the OS refuses.
    fn record(&mut self) -> Option<*mut ParkedBins> {
        if self.free.is_null() {
            let slab = OsAllocator.map(SLAB, OsAllocator.granularity(), 0);
            if slab.is_null() {
                return None;
            }
            for i in 0..SLAB / size_of::<ParkedBins>() {
                // SAFETY: the slab is fresh and big enough, aligned for the records.
                unsafe {
                    let record = slab.cast::<ParkedBins>().add(i);
                    (*record).next = self.free;
                    self.free = record;
                }
            }
        }
        let record = self.free;
        // SAFETY: a free record, owned by this pool.
        self.free = unsafe { (*record).next };
        Some(record)
    }
}

impl ThreadList {
    /// Parks the bins of `lane` (of tag `tag`) if there is room, emptying them; `false`
    /// otherwise (the caller flushes them).
    ///
    /// # Safety
    /// `lane` belongs to a cache whose thread is exiting (or gone, in a forked child), under
    /// the registry lock that gave `self`.
    pub(super) unsafe fn park(&mut self, tag: Tag, lane: &Lane) -> bool {
        if self.parked.count >= MAX_PARKED {
            return false;
        }
        // SAFETY: the owner is exiting; its bins are ours to move (the caller's contract).
        let empty = (0..CLASS_COUNT).all(|class| unsafe { lane.bin(class) }.head.is_null());
        if empty {
            return true;
        }
        let Some(record) = self.parked.record() else {
            return false;
        };
        // SAFETY: the record is ours; the bins are the exiting owner's, emptied here.
        unsafe {
            (*record).tag = tag;
            for class in 0..CLASS_COUNT {
                let count = lane.count(class);
                let bin = lane.bin(class);
                (*record).bins[class] = (bin.head, count);
                bin.head = null_mut();
                lane.set_count(class, 0);
            }
            (*record).next = self.parked.head;
        }
        self.parked.head = record;
        self.parked.count += 1;
        true
    }

    /// Gives `lane` (of tag `tag`, just set up by its owning thread, its bins empty) a parked
    /// set of that tag, if one waits.
    ///
    /// # Safety
    /// `lane` is the calling thread's, set up with its limits and empty bins, under the
    /// registry lock that gave `self`.
    pub(super) unsafe fn adopt(&mut self, tag: Tag, lane: &Lane) {
        let mut link: *mut *mut ParkedBins = &mut self.parked.head;
        // SAFETY: parked records are valid and owned by the list; the lane is the caller's.
        unsafe {
            while !(*link).is_null() {
                let record = *link;
                if (*record).tag == tag {
                    *link = (*record).next;
                    for (class, &(head, count)) in (*record).bins.iter().enumerate() {
                        lane.bin(class).head = head;
                        lane.set_count(class, count);
                    }
                    (*record).next = self.parked.free;
                    self.parked.free = record;
                    self.parked.count -= 1;
                    return;
                }
                link = &mut (*record).next;
            }
        }
    }

    /// Gives every parked set's blocks back to their heaps (`garbage_collect`).
    pub(super) fn flush_parked(&mut self) {
        while !self.parked.head.is_null() {
            let record = self.parked.head;
            // SAFETY: parked records are valid; their lists hold free blocks of their tag's
            // heap, each given back once.
            unsafe {
                self.parked.head = (*record).next;
                let heap = HEAP.small_heap_of((*record).tag);
                for (class, &(head, _)) in (*record).bins.iter().enumerate() {
                    let mut len = 0;
                    let mut slot = head;
                    while !slot.is_null() {
                        len += 1;
                        slot = (*slot).next;
                    }
                    if let (Some(heap), true) = (heap, len > 0) {
                        heap.return_slots(class, head, len, HEAP.stamp());
                    }
                }
                (*record).next = self.parked.free;
                self.parked.free = record;
            }
            self.parked.count -= 1;
        }
    }
}
