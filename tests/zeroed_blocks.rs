//! Zeroed blocks through `BlockAllocator` and the `Allocator` handles: the whole granted
//! block reads as zero, for fresh and for reused memory, and a big zeroed block costs no
//! resident memory until it is written (pages fresh from the OS are not cleared again).
//! Own binary, no harness: it reads the process's RSS.

use allocator_api2::alloc::Allocator;
use std::alloc::Layout;
use std::ptr::NonNull;
use tagalloc::os::OsAllocator;
use tagalloc::{BlockAllocator, SystemAllocator};

tagalloc::allocator!(Zeroed: child of SystemAllocator, "zeroed_blocks: child");
tagalloc::allocator!(ZeroedBelow: child of Zeroed, "zeroed_blocks: grandchild");

const SIZES: [usize; 9] = [8, 16, 100, 1000, 3000, 50_000, 300_000, 1 << 20, 17 << 20];

fn rss_mib() -> f64 {
    OsAllocator::process_resident_bytes().unwrap() as f64 / (1 << 20) as f64
}

/// Dirties a block of `layout`, frees it, then checks that a zeroed block of the same
/// layout is zero over all of its granted length.
fn zero_after_dirty<A: Allocator>(alloc: &A, name: &str) {
    for size in SIZES {
        for align in [8, 64, 4096] {
            let layout = Layout::from_size_align(size, align).unwrap();
            let dirty = alloc.allocate(layout).unwrap();
            // SAFETY: the slice is the block just granted, all of it ours.
            unsafe {
                dirty.cast::<u8>().as_ptr().write_bytes(0xEE, dirty.len());
                alloc.deallocate(dirty.cast(), layout);
            }
            let z = alloc.allocate_zeroed(layout).unwrap();
            assert!(z.len() >= size);
            assert_eq!(z.cast::<u8>().as_ptr() as usize % align, 0);
            // SAFETY: the block is live and `len` bytes long; freed once below.
            let bytes = unsafe { std::slice::from_raw_parts(z.cast::<u8>().as_ptr(), z.len()) };
            if let Some(at) = bytes.iter().position(|&b| b != 0) {
                panic!(
                    "{name}: {layout:?} granted {} has a non-zero byte at {at}",
                    z.len()
                );
            }
            // SAFETY: allocated above with `layout`.
            unsafe { alloc.deallocate(z.cast(), layout) };
        }
    }
}

/// A zeroed block of `size` bytes raises the resident set by much less than its size.
fn fresh_zeroed_block_is_not_resident(
    alloc: impl Fn(Layout) -> NonNull<u8>,
    free: impl Fn(NonNull<u8>, Layout),
    name: &str,
) {
    const SIZE: usize = 256 << 20;
    let layout = Layout::from_size_align(SIZE, 64).unwrap();
    let before = rss_mib();
    let p = alloc(layout);
    let after = rss_mib();
    assert!(
        after - before < 32.0,
        "{name}: a fresh zeroed 256 MiB block made {:.1} MiB resident",
        after - before
    );
    // SAFETY: the block is live and `SIZE` bytes long.
    unsafe {
        assert_eq!(*p.as_ptr().add(SIZE / 2), 0);
        assert_eq!(*p.as_ptr().add(SIZE - 1), 0);
    }
    free(p, layout);
}

fn main() {
    zero_after_dirty(&Zeroed, "child");
    zero_after_dirty(&ZeroedBelow, "grandchild");
    let system = SystemAllocator::new();
    for size in SIZES {
        let layout = Layout::from_size_align(size, 16).unwrap();
        let dirty = system.allocate_block(layout).unwrap();
        // SAFETY: the block is ours, `size` bytes long; freed once, then the zeroed one.
        unsafe {
            dirty.ptr.as_ptr().write_bytes(0xEE, dirty.size);
            system.deallocate_block(dirty.ptr, layout);
            let z = system.allocate_block_zeroed(layout).unwrap();
            let bytes = std::slice::from_raw_parts(z.ptr.as_ptr(), z.size);
            assert!(bytes.iter().all(|&b| b == 0), "SystemAllocator {layout:?}");
            system.deallocate_block(z.ptr, layout);
        }
    }
    println!("zeroed blocks: whole granted length zero (child, grandchild, SystemAllocator)");

    fresh_zeroed_block_is_not_resident(
        |l| system.allocate_block_zeroed(l).unwrap().ptr,
        // SAFETY: the block the closure above allocated, with its layout.
        |p, l| {
            unsafe { system.deallocate_block(p, l) };
        },
        "SystemAllocator",
    );
    fresh_zeroed_block_is_not_resident(
        |l| Zeroed.allocate_zeroed(l).unwrap().cast(),
        // SAFETY: as above.
        |p, l| unsafe { Zeroed.deallocate(p, l) },
        "child",
    );
    let s = Zeroed.stats();
    assert_eq!((s.live_blocks, s.live_granted_bytes), (0, 0));
    println!("fresh zeroed blocks: not made resident");
}
