//! Where the records live: a private HPHA heap on the OS layer, never the global allocator.
//!
//! The record table, the call-stack table and the snapshots copied under their locks all
//! allocate from [`RECORDS_HEAP`] through the zero-sized [`Internal`] allocator, so recording
//! an allocation never calls back into the allocator being recorded, and a report can copy
//! the table while holding its locks without allocating through the global allocator.
//!
//! The heap appears in the registry as `AllocationRecords` (a child of the OS layer), so the
//! allocator table shows what records cost in memory.

use crate::registry::{self, AllocatorKind, Registration};
use crate::schema::HphaSchema;
use crate::{AllocatorStats, os::OsAllocator};
use allocator_api2::alloc::{AllocError, Allocator};
use core::alloc::Layout;
use core::ptr::NonNull;

/// The records' own heap.
pub(crate) static RECORDS_HEAP: HphaSchema<OsAllocator> = HphaSchema::new(OsAllocator);

/// The registry entry of [`RECORDS_HEAP`].
pub(crate) static REGISTRATION: Registration = Registration::new(
    "AllocationRecords",
    "Allocation records, call stacks and their tables (tagalloc's own OS-backed heap)",
    AllocatorKind::Internal,
    Some(os_registration),
    read,
);

fn os_registration() -> &'static Registration {
    &registry::OS
}

fn read(_: &'static Registration) -> AllocatorStats {
    let s = RECORDS_HEAP.stats();
    AllocatorStats {
        live_granted_bytes: s.granted_bytes,
        live_requested_bytes: None,
        live_blocks: s.live_blocks,
        allocations: s.allocations,
        frees: s.frees,
        reallocations: 0,
        peak_granted_bytes: None,
        reserved_bytes: s.held_bytes,
        over_budget: 0,
        budget_failures: 0,
        heap: Some(s),
    }
}

/// Allocates from [`RECORDS_HEAP`]; for the tables' `hashbrown` maps and `Vec`s.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Internal;

// SAFETY: every block comes from the HPHA heap, which returns valid, aligned, unaliased
// blocks of at least the requested size (a zero-size request gets a real block), and takes
// them back with the same layout.
unsafe impl Allocator for Internal {
    #[inline]
    fn allocate(&self, layout: Layout) -> Result<NonNull<[u8]>, AllocError> {
        let block = RECORDS_HEAP.allocate(layout).ok_or(AllocError)?;
        Ok(NonNull::slice_from_raw_parts(block.ptr, layout.size()))
    }

    #[inline]
    unsafe fn deallocate(&self, ptr: NonNull<u8>, layout: Layout) {
        // SAFETY: the caller passes a block from `allocate` with its layout.
        unsafe { RECORDS_HEAP.deallocate(ptr, layout) }
    }
}
