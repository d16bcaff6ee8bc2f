//! The OS refusing memory becomes a null pointer / `None`, never a crash. Its own binary,
//! because injected failures are process-wide.

use core::alloc::Layout;
use tagalloc::os::{OsAllocator, PageSource};
use tagalloc::schema::HphaSchema;

#[test]
fn every_path_turns_a_refused_map_into_none_and_recovers() {
    let heap = HphaSchema::new(OsAllocator);
    let cases = [
        Layout::from_size_align(64, 8).unwrap(), // first small page: a segment
        Layout::from_size_align(100_000, 16).unwrap(), // first large block: a chunk
        Layout::from_size_align(32 << 20, 8).unwrap(), // a dedicated mapping
        Layout::from_size_align(64, 1 << 20).unwrap(), // an aligned dedicated mapping
    ];
    for layout in cases {
        let failed_before = OsAllocator::stats().failed_maps;
        OsAllocator::inject_map_failures(1);
        assert!(heap.allocate(layout).is_none(), "{layout:?}");
        assert!(OsAllocator::stats().failed_maps > failed_before);
        // Once the OS gives memory again, the same request succeeds.
        let a = heap.allocate(layout).expect("recovers after the failure");
        // SAFETY: allocated just above with `layout`.
        unsafe { heap.deallocate(a.ptr, layout) };
    }
    heap.validate().unwrap();
    // Zeroed allocation takes the same path.
    OsAllocator::inject_map_failures(1);
    let big = Layout::from_size_align(48 << 20, 8).unwrap();
    assert!(heap.allocate_zeroed(big).is_none());
    // The OS layer itself returns null, and maps again afterwards.
    OsAllocator::inject_map_failures(1);
    assert!(OsAllocator.map(4096, 4096, 0).is_null());
    let p = OsAllocator.map(1 << 20, 1 << 20, 0);
    assert!(!p.is_null() && p as usize % (1 << 20) == 0);
    // SAFETY: `p` is the mapping just made, of that length.
    unsafe { OsAllocator.unmap(p, 1 << 20) };
}
