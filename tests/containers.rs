//! Handles in containers (`allocator_api2::vec::Vec`, `allocator_api2::boxed::Box`,
//! `hashbrown::HashMap`) and the `Allocator` contract edge cases: zero-size requests,
//! freeing with any size up to the granted one, grow/shrink, alignment changes, and a child
//! handle as a `GlobalAlloc`.

use allocator_api2::alloc::Allocator;
use allocator_api2::boxed::Box;
use allocator_api2::vec::Vec;
use hashbrown::{DefaultHashBuilder, HashMap};
use std::alloc::{GlobalAlloc, Layout};
use tagalloc::{AllocatorStats, SystemAllocator};

/// Fills a Vec, a Box and a HashMap in `alloc`, checks the counters moved, drops them and
/// checks every live counter is back to `start`.
fn exercise<A: Allocator + Copy>(alloc: A, stats: impl Fn() -> AllocatorStats) {
    let start = stats();
    let mut v: Vec<u64, A> = Vec::new_in(alloc);
    for i in 0..1000u64 {
        v.push(i); // grows by doubling: resizes in place or moves
    }
    let b: Box<[u8; 300], A> = Box::new_in([7; 300], alloc);
    let mut m: HashMap<u32, String, DefaultHashBuilder, A> =
        HashMap::with_hasher_in(DefaultHashBuilder::default(), alloc);
    for i in 0..500 {
        m.insert(i, i.to_string());
    }
    let mid = stats();
    assert_eq!(mid.live_blocks - start.live_blocks, 3);
    assert!(mid.live_granted_bytes - start.live_granted_bytes >= 8000 + 300);
    assert!(mid.live_requested_bytes.unwrap() >= 8000 + 300);
    assert!(mid.live_granted_bytes >= mid.live_requested_bytes.unwrap());
    assert!(
        mid.reallocations > start.reallocations,
        "Vec growth resizes in place or moves"
    );
    assert_eq!(v.iter().sum::<u64>(), 999 * 1000 / 2);
    assert_eq!(b[299], 7);
    assert_eq!(m[&321], "321");
    drop((v, b, m));
    let end = stats();
    assert_eq!(end.live_blocks, start.live_blocks);
    assert_eq!(end.live_granted_bytes, start.live_granted_bytes);
    assert_eq!(end.live_requested_bytes, start.live_requested_bytes);
    assert_eq!(end.allocations - end.frees, start.allocations - start.frees);
}

tagalloc::allocator!(ContainerChild: child of SystemAllocator, "containers: child");
// The grandchild test has a parent of its own: tests run in parallel, and another test's
// blocks in the parent would change the figures it checks.
tagalloc::allocator!(ContainerParent: child of SystemAllocator, "containers: parent");
tagalloc::allocator!(ContainerGrandchild: child of ContainerParent, "containers: grandchild");

#[test]
fn containers_in_a_child() {
    exercise(ContainerChild, || ContainerChild.stats());
}

#[test]
fn containers_in_a_child_of_a_child_are_counted_in_both() {
    let parent_before = ContainerGrandchild::registration()
        .parent()
        .unwrap()
        .stats();
    exercise(ContainerGrandchild, || ContainerGrandchild.stats());
    let mut v: Vec<u8, ContainerGrandchild> = Vec::with_capacity_in(10_000, ContainerGrandchild);
    v.push(1);
    let child = ContainerGrandchild.stats();
    let parent = ContainerParent.stats();
    assert!(child.live_granted_bytes >= 10_000);
    assert!(
        parent.live_granted_bytes >= parent_before.live_granted_bytes + child.live_granted_bytes
    );
}

tagalloc::allocator!(ZeroSize: child of SystemAllocator);

#[test]
fn zero_size_requests_are_dangling_aligned_and_uncounted() {
    for align in [1, 8, 64, 4096] {
        let layout = Layout::from_size_align(0, align).unwrap();
        let p = ZeroSize.allocate(layout).unwrap();
        assert_eq!(p.len(), 0);
        assert_eq!(p.cast::<u8>().as_ptr() as usize % align, 0);
        // SAFETY: "allocated" above with this layout.
        unsafe { ZeroSize.deallocate(p.cast(), layout) };
    }
    let v: Vec<(), ZeroSize> = Vec::with_capacity_in(100, ZeroSize);
    drop(v);
    let s = ZeroSize.stats();
    assert_eq!((s.allocations, s.frees, s.live_granted_bytes), (0, 0, 0));
}

tagalloc::allocator!(FitAny: child of SystemAllocator);

#[test]
fn deallocate_accepts_any_size_up_to_the_granted_one() {
    // Sizes that land inside a small class, at a class boundary, and in large blocks.
    for size in [1usize, 20, 500, 3000, 4097, 10_000, 300_000] {
        for align in [1usize, 16, 256] {
            let layout = Layout::from_size_align(size, align).unwrap();
            for freed_size in [size, usize::MAX] {
                let block = FitAny.allocate(layout).unwrap();
                let granted = block.len();
                assert!(granted >= size);
                assert_eq!(FitAny.stats().live_granted_bytes, granted);
                let freed_size = freed_size.min(granted);
                let free_layout = Layout::from_size_align(freed_size, align).unwrap();
                // SAFETY: the layout fits the block: same alignment, size within
                // requested..=granted.
                unsafe { FitAny.deallocate(block.cast(), free_layout) };
                let s = FitAny.stats();
                assert_eq!(
                    s.live_granted_bytes, 0,
                    "size {size} align {align} freed as {freed_size}"
                );
                assert_eq!(s.live_blocks, 0);
            }
        }
    }
}

tagalloc::allocator!(Resize: child of SystemAllocator);

#[test]
fn grow_shrink_and_alignment_changes_keep_contents_and_counts() {
    let small = Layout::from_size_align(24, 8).unwrap();
    let p = Resize.allocate(small).unwrap().cast::<u8>();
    // SAFETY: 24 bytes are ours.
    unsafe { p.as_ptr().write_bytes(0xAB, 24) };
    let mut layout = small;
    let mut ptr = p;
    for (size, align) in [
        (100, 8),
        (5000, 8),
        (70_000, 64),
        (40, 64),
        (40, 8),
        (6000, 4096),
        (8, 1),
    ] {
        let new = Layout::from_size_align(size, align).unwrap();
        // SAFETY: `ptr` is live with `layout`; the new layout is non-zero.
        let block = unsafe {
            if size >= layout.size() {
                Resize.grow_zeroed(ptr, layout, new)
            } else {
                Resize.shrink(ptr, layout, new)
            }
        }
        .unwrap();
        let keep = layout.size().min(size).min(24);
        // SAFETY: the block holds at least `size` bytes.
        let bytes = unsafe { std::slice::from_raw_parts(block.cast::<u8>().as_ptr(), size) };
        assert!(
            bytes[..keep].iter().all(|&b| b == 0xAB),
            "contents kept at {size}/{align}"
        );
        if size > layout.size() {
            assert!(
                bytes[layout.size()..].iter().all(|&b| b == 0),
                "grown part zeroed"
            );
        }
        assert_eq!(block.cast::<u8>().as_ptr() as usize % align, 0);
        let s = Resize.stats();
        assert_eq!(s.live_granted_bytes, block.len());
        assert_eq!(s.live_requested_bytes, Some(size));
        assert_eq!(s.live_blocks, 1);
        ptr = block.cast();
        layout = new;
    }
    // SAFETY: live with `layout`.
    unsafe { Resize.deallocate(ptr, layout) };
    let s = Resize.stats();
    assert_eq!((s.live_granted_bytes, s.live_blocks), (0, 0));
    assert!(s.peak_granted_bytes.unwrap() >= 70_000);
}

tagalloc::allocator!(AsGlobal: child of SystemAllocator);

#[test]
fn a_child_handle_is_a_global_alloc() {
    let layout = Layout::from_size_align(1000, 32).unwrap();
    // SAFETY: non-zero layout; freed below with the layout of the last realloc.
    unsafe {
        let p = AsGlobal.alloc_zeroed(layout);
        assert!(!p.is_null());
        assert_eq!(*p.add(999), 0);
        p.write(42);
        let q = AsGlobal.realloc(p, layout, 100_000);
        assert_eq!(q.read(), 42);
        assert_eq!(q as usize % 32, 0);
        assert!(AsGlobal.stats().live_granted_bytes >= 100_000);
        AsGlobal.dealloc(q, Layout::from_size_align(100_000, 32).unwrap());
    }
    let s = AsGlobal.stats();
    assert_eq!(
        (s.live_granted_bytes, s.live_blocks, s.reallocations),
        (0, 0, 1)
    );
}

tagalloc::allocator!(TypedAlloc: child of SystemAllocator);

/// Holds a reference: dropping the value (or not) shows in the count.
struct Counted(#[allow(dead_code)] std::sync::Arc<()>);
impl tagalloc::ClassAllocator for Counted {
    type Allocator = TypedAlloc;
}

#[test]
fn class_allocator_create_destroy_and_box_drop_their_values() {
    use tagalloc::ClassAllocator;
    let token = std::sync::Arc::new(());
    let boxed = Counted::new_boxed(Counted(token.clone()));
    let raw = Counted::create(Counted(token.clone())).unwrap();
    assert_eq!(std::sync::Arc::strong_count(&token), 3);
    assert_eq!(TypedAlloc.stats().live_blocks, 2);
    // SAFETY: from `create`, destroyed once.
    unsafe { Counted::destroy(raw) };
    drop(boxed);
    assert_eq!(std::sync::Arc::strong_count(&token), 1);
    assert_eq!(TypedAlloc.stats().live_blocks, 0);
    assert!(
        tagalloc::typed::malloc(TypedAlloc, 8, 3).is_none(),
        "bad alignment"
    );
}
