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

/// Whether the kernel itself refuses a plain anonymous mapping of `len` bytes (it does for
/// sizes beyond memory and swap, unless `vm.overcommit_memory` is 1).
fn kernel_refuses(len: usize) -> bool {
    // SAFETY: an anonymous private mapping with no address hint; unmapped at once.
    unsafe {
        let p = libc::mmap(
            core::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        );
        if p == libc::MAP_FAILED {
            return true;
        }
        libc::munmap(p, len);
        false
    }
}

#[test]
fn sizes_beyond_the_machine_give_null_where_the_kernel_refuses_them() {
    let huge = 1usize << 46; // 64 TiB
    if !kernel_refuses(huge) {
        eprintln!("the kernel maps 64 TiB here (vm.overcommit_memory = 1?); nothing to check");
        return;
    }
    for (size, align) in [(huge, 8), (huge, 1 << 20), (1 << 40, 1 << 40)] {
        let layout = Layout::from_size_align(size, align).unwrap();
        // SAFETY: a non-zero layout.
        assert!(unsafe { ALLOC.alloc(layout) }.is_null(), "{layout:?}");
        // SAFETY: as above.
        assert!(
            unsafe { ALLOC.alloc_zeroed(layout) }.is_null(),
            "{layout:?}"
        );
    }
    // Growth into the impossible keeps the block (a big block, so the heap would remap it).
    let layout = Layout::from_size_align(32 << 20, 8).unwrap();
    // SAFETY: non-zero layout; the block is used and freed with its layout.
    unsafe {
        let p = ALLOC.alloc(layout);
        assert!(!p.is_null());
        p.write_bytes(7, layout.size());
        assert!(ALLOC.realloc(p, layout, huge).is_null());
        assert_eq!(*p.add(layout.size() - 1), 7, "the old block is intact");
        ALLOC.dealloc(p, layout);
    }
    tagalloc::allocator!(Huge: child of SystemAllocator, "edge cases: huge");
    let mut v = allocator_api2::vec::Vec::<u8, _>::new_in(Huge);
    assert!(v.try_reserve(huge).is_err(), "try_reserve of 64 TiB");
    v.push(1);
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
