//! The small heaps of tags other than 0, made on first use.
//!
//! Each tag's small blocks live on segments of their own (see `small`), so each tag has a
//! [`SmallHeap`] of its own: its class lists and its page pool. Heaps are made on demand,
//! side by side in slabs mapped from the heap's page source (a tag that uses a few classes
//! touches a few lines of its heap, so packed heaps share the pages they touch), and live as
//! long as the [`HphaSchema`](super::HphaSchema) that made them (a process-wide heap: the
//! process). A two-level table keeps the unused tags' share small: 16 pointers, and a block
//! of 256 for each range of tags in use.

use super::small::{SmallHeap, Tag};
use crate::os::PageSource;
use crate::sync::SpinLock;
use core::ptr::{self, null_mut};
use core::sync::atomic::{AtomicPtr, Ordering::*};

/// How many tags a heap serves: tags `0..MAX_TAGS`.
pub const MAX_TAGS: usize = BLOCKS * PER_BLOCK;
const PER_BLOCK: usize = 256;
const BLOCKS: usize = 16;

type Block = [AtomicPtr<SmallHeap>; PER_BLOCK];

/// Bytes of a slab of heaps.
const SLAB: usize = 64 * 1024;

/// Where the next heap is carved from: the current slab and the bytes used in it. A slab's
/// first bytes link it to the previous one, so they can all be unmapped.
struct Slabs {
    current: *mut u8,
    used: usize,
}

/// The heaps of tags `1..MAX_TAGS` (tag 0's is the schema's own).
pub(crate) struct TaggedHeaps {
    blocks: [AtomicPtr<Block>; BLOCKS],
    /// Serialises the making of heaps and blocks (never taken on a lookup), and guards the
    /// slabs they are carved from.
    making: SpinLock<Slabs>,
}

// SAFETY: the slab pointers are only used under the `making` lock.
unsafe impl Send for Slabs {}

/// Where a heap starts in a slab: past the slab's link, aligned for a heap.
const HEAP_STRIDE: usize = size_of::<SmallHeap>().next_multiple_of(align_of::<SmallHeap>());
/// A slab's link, rounded up so that the heaps after it are aligned.
const SLAB_HEADER: usize = size_of::<usize>().next_multiple_of(align_of::<SmallHeap>());
const _: () = assert!(SLAB_HEADER + HEAP_STRIDE <= SLAB);

impl TaggedHeaps {
    pub(crate) const fn new() -> Self {
        Self {
            blocks: [const { AtomicPtr::new(null_mut()) }; BLOCKS],
            making: SpinLock::new(Slabs {
                current: null_mut(),
                used: SLAB,
            }),
        }
    }

    /// The heap of `tag` (1 or more) if it was made.
    #[inline]
    pub(crate) fn get(&self, tag: Tag) -> Option<&SmallHeap> {
        let tag = usize::from(tag);
        let block = self.blocks.get(tag / PER_BLOCK)?.load(Acquire);
        if block.is_null() {
            return None;
        }
        // SAFETY: published blocks are valid for the table's life; so are published heaps.
        unsafe { (*block)[tag % PER_BLOCK].load(Acquire).as_ref() }
    }

    /// The heap of `tag` (1 or more), made now if needed; `None` when the source is out of
    /// memory or the tag is out of range.
    pub(crate) fn get_or_make(&self, tag: Tag, source: &impl PageSource) -> Option<&SmallHeap> {
        if let Some(heap) = self.get(tag) {
            return Some(heap);
        }
        self.make(tag, source)
    }

    #[cold]
    fn make(&self, tag: Tag, source: &impl PageSource) -> Option<&SmallHeap> {
        debug_assert!(tag != 0, "tag 0's heap is the schema's own");
        let index = usize::from(tag);
        if index >= MAX_TAGS {
            return None;
        }
        let mut slabs = self.making.lock();
        let slot = &self.blocks[index / PER_BLOCK];
        let mut block = slot.load(Acquire);
        if block.is_null() {
            block = map_zeroed::<Block>(source)?;
            // An all-zero block is all null pointers.
            slot.store(block, Release);
        }
        // SAFETY: the block is published and valid.
        let entry = unsafe { &(*block)[index % PER_BLOCK] };
        // SAFETY: only valid heaps are published; they live as long as the table.
        if let Some(heap) = unsafe { entry.load(Acquire).as_ref() } {
            return Some(heap);
        }
        let heap = slabs.carve(source)?;
        // SAFETY: fresh zeroed memory big and aligned enough for a `SmallHeap`, not shared.
        unsafe { SmallHeap::init_zeroed(heap, tag) };
        entry.store(heap, Release);
        // SAFETY: just written and published; never freed before the table.
        Some(unsafe { &*heap })
    }

    /// Calls `f` with every heap made so far, in tag order.
    pub(crate) fn for_each(&self, mut f: impl FnMut(&SmallHeap)) {
        for slot in &self.blocks {
            let block = slot.load(Acquire);
            if block.is_null() {
                continue;
            }
            // SAFETY: published blocks and heaps are valid for the table's life.
            unsafe {
                for entry in &*block {
                    if let Some(heap) = entry.load(Acquire).as_ref() {
                        f(heap);
                    }
                }
            }
        }
    }

    /// Takes the lock that making a heap holds (before `fork()`).
    ///
    /// # Safety
    /// Must be paired with [`unlock_making`](Self::unlock_making) on the same thread (or in
    /// the child it forks).
    pub(crate) unsafe fn lock_making(&self) {
        // SAFETY: forwarded; released by `unlock_making`.
        unsafe { self.making.lock_raw() };
    }

    /// Releases what [`lock_making`](Self::lock_making) took.
    ///
    /// # Safety
    /// Only after `lock_making`.
    pub(crate) unsafe fn unlock_making(&self) {
        // SAFETY: forwarded from the caller.
        unsafe { self.making.force_unlock() };
    }

    /// Unmaps every heap's memory and the table's own (the schema is being dropped).
    pub(crate) fn release_all(&mut self, source: &impl PageSource) {
        for slot in &mut self.blocks {
            let block = *slot.get_mut();
            if block.is_null() {
                continue;
            }
            // SAFETY: the schema is being dropped, so nothing else uses the heaps; the
            // block was mapped by `map_zeroed` with its type's mapping length.
            unsafe {
                for entry in &mut *block {
                    let heap = *entry.get_mut();
                    if !heap.is_null() {
                        (*heap).release_all(source);
                        ptr::drop_in_place(heap);
                    }
                }
                source.unmap(block.cast(), mapping_len::<Block>(source));
            }
            *slot.get_mut() = null_mut();
        }
        let slabs = self.making.get_mut();
        let mut slab = slabs.current;
        while !slab.is_null() {
            // SAFETY: each slab was mapped with `SLAB` bytes and links the previous one in
            // its first word; the heaps in it are dropped above.
            unsafe {
                let previous = slab.cast::<*mut u8>().read();
                source.unmap(slab, SLAB);
                slab = previous;
            }
        }
        *slabs = Slabs {
            current: null_mut(),
            used: SLAB,
        };
    }
}

impl Slabs {
    /// Room for one heap: in the current slab, or in a new one; `None` when the source is
    /// out of memory.
    fn carve(&mut self, source: &impl PageSource) -> Option<*mut SmallHeap> {
        if self.used + HEAP_STRIDE > SLAB {
            let slab = source.map(SLAB, source.granularity(), 0);
            if slab.is_null() {
                return None;
            }
            // SAFETY: a fresh mapping of `SLAB` bytes; its first word links the previous slab.
            unsafe { slab.cast::<*mut u8>().write(self.current) };
            self.current = slab;
            self.used = SLAB_HEADER;
        }
        // SAFETY: `used + HEAP_STRIDE <= SLAB`, inside the current slab.
        let heap = unsafe { self.current.add(self.used) }.cast::<SmallHeap>();
        self.used += HEAP_STRIDE;
        Some(heap)
    }
}

/// The bytes mapped for one `T`.
pub(super) fn mapping_len<T>(source: &impl PageSource) -> usize {
    size_of::<T>().next_multiple_of(source.granularity())
}

/// A fresh zeroed mapping for one `T`; `None` when the source is out of memory.
pub(super) fn map_zeroed<T>(source: &impl PageSource) -> Option<*mut T> {
    const { assert!(align_of::<T>() <= 4096) };
    let p = source.map(mapping_len::<T>(source), align_of::<T>().max(16), 0);
    (!p.is_null()).then(|| p.cast())
}
