//! An O3DE-style allocator over a base pointer: `BestFitExternalMapSchema` done right.
//!
//! O3DE's schema hands out pointers into a block it never touches (e.g. uncached memory) and
//! keeps its maps elsewhere. Its free list is looked up by *exact* size and merged only on
//! garbage collection, so it can fail while plenty of memory is free. This facade keeps the
//! O3DE surface (allocate / deallocate by pointer, allocation size, capacity, largest
//! allocation possible) on top of a TLSF [`VirtualBlock`], which coalesces eagerly and has no
//! false out-of-memory.
//!
//! The facade only computes addresses (`base + offset`, `pointer - base`); it never reads or
//! writes through them, so it needs no `unsafe`. Whoever dereferences the returned pointers
//! answers for their validity.

use crate::registry::Registration;
use std::collections::HashMap;
use std::ptr::NonNull;

use super::{Alloc, Error, Request, VirtualBlock};

/// The facade's own counters, O(1) to read.
///
/// This is the shape a registry of allocators wants from each member (name, live and peak
/// bytes, counts); see [`ExternalMapAllocator::statistics`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FacadeStatistics {
    /// Bytes in live allocations (as requested).
    pub live_bytes: u64,
    /// Live allocations.
    pub live_count: u64,
    /// Highest `live_bytes` seen.
    pub peak_bytes: u64,
    /// Successful allocations so far.
    pub total_allocations: u64,
    /// Deallocations so far.
    pub total_deallocations: u64,
    /// Allocations refused (out of space or bad input).
    pub failed_allocations: u64,
    /// Size of the managed range.
    pub capacity: u64,
}

/// Pointers into a memory range the allocator never touches, with its bookkeeping outside it.
///
/// ```
/// use tagalloc::virtual_block::ExternalMapAllocator;
/// let mut buffer = vec![0u8; 4096];
/// let base = std::ptr::NonNull::new(buffer.as_mut_ptr()).unwrap();
/// let mut a = ExternalMapAllocator::new("staging", base, 4096)?;
/// let p = a.allocate(100, 16)?;
/// assert_eq!(p.as_ptr() as usize % 16, 0);
/// assert_eq!(a.allocation_size(p.as_ptr()), Some(100));
/// a.deallocate(p.as_ptr())?;
/// assert!(a.deallocate(p.as_ptr()).is_err()); // double free: a typed error
/// assert_eq!(a.max_allocation_size(), 4096);
/// # Ok::<(), tagalloc::virtual_block::Error>(())
/// ```
#[derive(Debug)]
pub struct ExternalMapAllocator {
    name: &'static str,
    base: NonNull<u8>,
    block: VirtualBlock<()>,
    /// Live allocations by offset, for deallocation by pointer.
    by_offset: HashMap<u64, Alloc>,
    stats: FacadeStatistics,
    /// The registry entry its figures are also counted in, once registered.
    registration: Option<&'static Registration>,
}

// SAFETY: the facade never dereferences `base`; it is only an address to add offsets to. No
// shared state is reached through it, so moving the facade to another thread is sound.
unsafe impl Send for ExternalMapAllocator {}

impl ExternalMapAllocator {
    /// Manages `[base, base + size)` bytes. The memory is never accessed.
    ///
    /// Fails with [`Error::AddressOverflow`] when the range wraps the address space.
    pub fn new(name: &'static str, base: NonNull<u8>, size: u64) -> Result<Self, Error> {
        let size_usize = usize::try_from(size).map_err(|_| Error::AddressOverflow)?;
        base.as_ptr()
            .addr()
            .checked_add(size_usize)
            .ok_or(Error::AddressOverflow)?;
        let mut block = VirtualBlock::new(size);
        block.set_name(name);
        Ok(ExternalMapAllocator {
            name,
            base,
            block,
            by_offset: HashMap::new(),
            stats: FacadeStatistics {
                capacity: size,
                ..Default::default()
            },
            registration: None,
        })
    }

    /// Registers the facade as an allocator: `entry` (a `static`, built with
    /// `Registration::new(name, description, AllocatorKind::External, None,
    /// Registration::read_counters)`) joins the registry, and from now on every allocation
    /// and free is counted in it as well, so the allocator table, the tree and the JSON
    /// snapshot show this range's live bytes, blocks, totals and peak. Blocks already live
    /// are counted at once. An entry serves one facade at a time.
    ///
    /// ```
    /// use core::ptr::NonNull;
    /// use tagalloc::registry::Registration;
    /// use tagalloc::virtual_block::ExternalMapAllocator;
    /// use tagalloc::AllocatorKind;
    ///
    /// static GPU_HEAP: Registration = Registration::new(
    ///     "GpuHeap",
    ///     "Device-local heap",
    ///     AllocatorKind::External,
    ///     None,
    ///     Registration::read_counters,
    /// );
    /// let mut heap = ExternalMapAllocator::new("GpuHeap", NonNull::<u8>::dangling(), 1 << 20)?;
    /// heap.register(&GPU_HEAP);
    /// let p = heap.allocate(4096, 256)?;
    /// assert_eq!(GPU_HEAP.stats().live_granted_bytes, 4096);
    /// heap.deallocate(p.as_ptr())?;
    /// assert_eq!(GPU_HEAP.stats().live_blocks, 0);
    /// # Ok::<(), tagalloc::virtual_block::Error>(())
    /// ```
    pub fn register(&mut self, entry: &'static Registration) {
        entry.register();
        for a in self.by_offset.values() {
            if let Ok(info) = self.block.info(*a) {
                let size = info.size as usize;
                let live = entry.counters().add_granted(size);
                entry.counters().commit_allocation(size, live);
            }
        }
        self.registration = Some(entry);
    }

    /// The allocator's name.
    pub fn name(&self) -> &'static str {
        self.name
    }

    /// Allocates `size` bytes aligned to `align` (a power of two) inside the range.
    pub fn allocate(&mut self, size: u64, align: u64) -> Result<NonNull<u8>, Error> {
        let a = match self.block.allocate(&Request::new(size).align(align), ()) {
            Ok(a) => a,
            Err(e) => {
                self.stats.failed_allocations += 1;
                return Err(e);
            }
        };
        self.by_offset.insert(a.offset(), a);
        let s = &mut self.stats;
        s.live_bytes += size;
        s.live_count += 1;
        s.total_allocations += 1;
        s.peak_bytes = s.peak_bytes.max(s.live_bytes);
        if let Some(entry) = self.registration {
            let live = entry.counters().add_granted(size as usize);
            entry.counters().commit_allocation(size as usize, live);
        }
        // `new` checked that base + capacity does not wrap, so this is in range and non-null.
        NonNull::new(self.base.as_ptr().wrapping_add(a.offset() as usize))
            .ok_or(Error::AddressOverflow)
    }

    /// The offset of `ptr` in the range, if it lies inside.
    fn offset_of(&self, ptr: *const u8) -> Option<u64> {
        let off = ptr.addr().checked_sub(self.base.as_ptr().addr())? as u64;
        (off < self.block.capacity()).then_some(off)
    }

    /// Frees the allocation starting at `ptr`. A pointer that is not the start of a live
    /// allocation gives [`Error::UnknownAddress`] and changes nothing.
    pub fn deallocate(&mut self, ptr: *mut u8) -> Result<(), Error> {
        let off = self.offset_of(ptr).ok_or(Error::UnknownAddress)?;
        let a = self.by_offset.remove(&off).ok_or(Error::UnknownAddress)?;
        let size = self.block.info(a)?.size;
        self.block.free(a)?;
        self.stats.live_bytes -= size;
        self.stats.live_count -= 1;
        self.stats.total_deallocations += 1;
        if let Some(entry) = self.registration {
            entry.counters().record_free(size as usize, size as usize);
        }
        Ok(())
    }

    /// The size of the live allocation starting at `ptr`.
    pub fn allocation_size(&self, ptr: *const u8) -> Option<u64> {
        let a = self.by_offset.get(&self.offset_of(ptr)?)?;
        self.block.info(*a).ok().map(|i| i.size)
    }

    /// Size of the managed range.
    pub fn capacity(&self) -> u64 {
        self.block.capacity()
    }

    /// Bytes in live allocations.
    pub fn num_allocated_bytes(&self) -> u64 {
        self.stats.live_bytes
    }

    /// The largest allocation (alignment 1) that would succeed now: the largest free range,
    /// exactly.
    pub fn max_allocation_size(&self) -> u64 {
        self.block.largest_free()
    }

    /// O3DE's `GarbageCollect`: nothing to do, since free ranges are merged as they are freed.
    pub fn garbage_collect(&mut self) {}

    /// The facade's counters.
    pub fn statistics(&self) -> FacadeStatistics {
        self.stats
    }

    /// The block underneath, for its statistics, JSON and SVG.
    pub fn block(&self) -> &VirtualBlock<()> {
        &self.block
    }
}
