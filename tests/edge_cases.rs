//! Edge cases of the layout contract, through `GlobalAlloc` and the schema API.

use core::alloc::{GlobalAlloc, Layout};
use tagalloc::SystemAllocator;
use tagalloc::os::OsAllocator;
use tagalloc::schema::HphaSchema;

static ALLOC: SystemAllocator = SystemAllocator::new();

#[test]
fn sizes_near_isize_max_give_null() {
    for (size, align) in [
        (isize::MAX as usize - 4095, 4096),
        (isize::MAX as usize, 1),
        (isize::MAX as usize / 2 + 1, 8),
        (1 << 62, 1 << 20),
    ] {
        let layout = Layout::from_size_align(size, align).unwrap();
        // SAFETY: a non-zero layout.
        let p = unsafe { ALLOC.alloc(layout) };
        assert!(p.is_null(), "size {size:#x} align {align}");
        // SAFETY: as above.
        assert!(unsafe { ALLOC.alloc_zeroed(layout) }.is_null());
    }
}

#[test]
fn realloc_to_an_impossible_size_gives_null_and_keeps_the_block() {
    let layout = Layout::from_size_align(100, 8).unwrap();
    // SAFETY: non-zero layout; the block is used and freed with its layout.
    unsafe {
        let p = ALLOC.alloc(layout);
        p.write_bytes(7, 100);
        let q = ALLOC.realloc(p, layout, isize::MAX as usize - 8);
        assert!(q.is_null());
        assert_eq!(*p.add(99), 7, "the old block is untouched");
        ALLOC.dealloc(p, layout);
    }
}

#[test]
fn alignment_overflow_is_rejected_before_it_reaches_the_allocator() {
    // Layout refuses a size that overflows when rounded up to its alignment, and
    // the schema's own rounding is checked too.
    assert!(Layout::from_size_align(usize::MAX - 10, 64).is_err());
    let heap = HphaSchema::new(OsAllocator);
    let l = Layout::from_size_align(isize::MAX as usize - (1 << 30) + 1, 1 << 30).unwrap();
    assert!(heap.allocate(l).is_none());
}

#[test]
fn alignments_up_to_one_gib_work() {
    let mut align = 1usize;
    while align <= 1 << 30 {
        for size in [1, 4096, 100_000] {
            let layout = Layout::from_size_align(size, align).unwrap();
            // SAFETY: non-zero layout; freed with the same layout.
            unsafe {
                let p = ALLOC.alloc(layout);
                assert!(!p.is_null(), "size {size} align {align}");
                assert_eq!(p as usize % align, 0, "size {size} align {align}");
                p.write_bytes(0x5A, size);
                assert_eq!(*p.add(size - 1), 0x5A);
                ALLOC.dealloc(p, layout);
            }
        }
        align <<= 1;
    }
}

#[test]
fn realloc_keeps_alignment_and_contents_across_every_path() {
    let sizes = [
        1,
        8,
        100,
        512,
        600,
        4096,
        5000,
        70_000,
        2 << 20,
        20 << 20,
        3,
        40 << 20,
        9,
    ];
    for align in [1, 16, 64, 4096, 1 << 16, 1 << 21] {
        let mut layout = Layout::from_size_align(sizes[0], align).unwrap();
        // SAFETY: every step uses the block's current layout.
        unsafe {
            let mut p = ALLOC.alloc(layout);
            *p = 0xC3;
            for &size in &sizes[1..] {
                p = ALLOC.realloc(p, layout, size);
                assert!(!p.is_null());
                assert_eq!(p as usize % align, 0, "align {align} size {size}");
                assert_eq!(
                    *p, 0xC3,
                    "first byte preserved (align {align}, size {size})"
                );
                p.add(size - 1).write(1);
                layout = Layout::from_size_align(size, align).unwrap();
            }
            ALLOC.dealloc(p, layout);
        }
    }
}

#[test]
fn zero_size_requests_through_the_schema_api_get_unique_blocks() {
    let heap = HphaSchema::new(OsAllocator);
    for align in [1, 8, 64, 4096, 1 << 17] {
        let l = Layout::from_size_align(0, align).unwrap();
        let a = heap.allocate(l).unwrap();
        let b = heap.allocate(l).unwrap();
        assert_ne!(a.ptr, b.ptr);
        assert_eq!(a.ptr.as_ptr() as usize % align, 0);
        // SAFETY: allocated above with `l`; freeing with the granted size is allowed too.
        unsafe {
            heap.deallocate(a.ptr, l);
            heap.deallocate(b.ptr, Layout::from_size_align(b.size, align).unwrap());
        }
    }
    assert_eq!(heap.stats().live_blocks, 0);
}

#[test]
fn zeroed_memory_is_zero_for_fresh_and_reused_blocks() {
    for size in [16, 3000, 50_000, 1 << 20, 17 << 20] {
        let layout = Layout::from_size_align(size, 16).unwrap();
        // SAFETY: non-zero layouts, freed with the same layout.
        unsafe {
            let dirty = ALLOC.alloc(layout);
            dirty.write_bytes(0xEE, size);
            ALLOC.dealloc(dirty, layout);
            let z = ALLOC.alloc_zeroed(layout);
            assert!(std::slice::from_raw_parts(z, size).iter().all(|&b| b == 0));
            ALLOC.dealloc(z, layout);
        }
    }
}
