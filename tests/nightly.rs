//! With feature `nightly` (nightly toolchain): handles in std's own `Vec` and `Box` through
//! `core::alloc::Allocator`. Without the feature this file compiles to nothing.
//!
//! `cargo +nightly test --features nightly --test nightly` (`.ci/run` does it when a nightly
//! toolchain is installed).
#![cfg_attr(feature = "nightly", feature(allocator_api))]
#![cfg(feature = "nightly")]

use tagalloc::SystemAllocator;

tagalloc::allocator!(StdContainers: child of SystemAllocator, "std containers");
// The grandchild's parent is not `StdContainers`: tests run in parallel, and its blocks would
// count in the other test's figures.
tagalloc::allocator!(StdOuter: child of SystemAllocator, "std containers, outer");
tagalloc::allocator!(StdNested: child of StdOuter, "std containers, nested");

#[test]
fn std_vec_and_box_in_a_child() {
    let mut v: Vec<u32, StdContainers> = Vec::new_in(StdContainers);
    for i in 0..1000 {
        v.push(i);
    }
    let b: Box<[u64; 64], StdContainers> = Box::new_in([9; 64], StdContainers);
    let s = StdContainers.stats();
    assert_eq!(s.live_blocks, 2);
    assert!(s.live_requested_bytes.unwrap() >= 4000 + 512);
    assert!(s.reallocations > 0);
    assert_eq!(v.iter().map(|&x| x as u64).sum::<u64>(), 999 * 1000 / 2);
    assert_eq!(b[63], 9);
    drop((v, b));
    let s = StdContainers.stats();
    assert_eq!(
        (s.live_blocks, s.live_granted_bytes, s.live_requested_bytes),
        (0, 0, Some(0))
    );
}

#[test]
fn std_containers_in_a_grandchild_count_in_both() {
    let v: Vec<u8, StdNested> = Vec::with_capacity_in(10_000, StdNested);
    let b = Box::new_in(5u8, StdNested);
    assert!(StdNested.stats().live_granted_bytes >= 10_001);
    assert!(
        StdNested::registration()
            .parent()
            .unwrap()
            .stats()
            .live_granted_bytes
            >= StdNested.stats().live_granted_bytes
    );
    drop((v, b));
    assert_eq!(StdNested.stats().live_blocks, 0);
}

tagalloc::allocator!(StdPool: pool of SystemAllocator, "std containers, pool");
tagalloc::allocator!(StdThreadPool: thread_pool of SystemAllocator, "std containers, thread pool");

#[test]
fn std_vec_and_box_in_pools() {
    let v: Vec<u16, StdPool> = Vec::with_capacity_in(100, StdPool);
    let b = Box::new_in(7u64, StdThreadPool);
    let moved = std::thread::spawn(move || Box::new_in([1u8; 48], StdThreadPool))
        .join()
        .unwrap();
    assert_eq!(StdPool.stats().live_granted_bytes, 200);
    assert_eq!(StdThreadPool.stats().live_blocks, 2);
    drop((v, b, moved));
    assert_eq!(StdPool.stats().live_blocks, 0);
    assert_eq!(StdThreadPool.stats().live_blocks, 0);
}
