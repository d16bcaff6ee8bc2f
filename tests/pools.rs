//! Pool and thread-pool handles: containers in them, their figures (Reserved = pages held),
//! requests they cannot serve (an error, never UB), budgets, children of pools, and a
//! thread pool freed across threads.

mod common;

use allocator_api2::alloc::Allocator;
use allocator_api2::boxed::Box;
use allocator_api2::vec::Vec;
use hashbrown::{DefaultHashBuilder, HashMap};
use std::alloc::Layout;
use tagalloc::{AllocatorKind, BlockAllocator, BudgetMode, SystemAllocator};

tagalloc::allocator!(Nodes: pool of SystemAllocator, "default geometry");
tagalloc::allocator!(
    Particles: thread_pool of SystemAllocator { page_size: 16384, min_size: 16, max_size: 1024 },
    "particles"
);
tagalloc::allocator!(PoolParent: child of SystemAllocator, "a child under a pool");
tagalloc::allocator!(Small: pool of PoolParent { page_size: 4096, min_size: 8, max_size: 256 });
tagalloc::allocator!(InPool: child of Particles, "a child of a thread pool");

#[test]
fn containers_in_a_pool() {
    let mut v: Vec<u32, Nodes> = Vec::with_capacity_in(64, Nodes);
    v.extend(0..64);
    let b: Box<[u8; 200], Nodes> = Box::new_in([1; 200], Nodes);
    let s = Nodes.stats();
    assert_eq!(s.live_blocks, 2);
    assert_eq!(s.live_granted_bytes, 256 + 200);
    assert_eq!(s.live_requested_bytes, Some(456));
    assert_eq!(s.reserved_bytes % 4096, 0);
    assert!(s.reserved_bytes >= 4096);
    assert_eq!(Nodes::registration().kind(), AllocatorKind::Pool);
    // A hashbrown table small enough for the pool (it refuses larger ones: see below).
    let mut m: HashMap<u16, u16, DefaultHashBuilder, Nodes> =
        HashMap::with_capacity_and_hasher_in(8, DefaultHashBuilder::default(), Nodes);
    m.insert(1, 2);
    assert_eq!(m[&1], 2);
    drop((v, b, m));
    let s = Nodes.stats();
    assert_eq!(
        (s.live_blocks, s.live_granted_bytes, s.live_requested_bytes),
        (0, 0, Some(0))
    );
    Nodes.garbage_collect();
    assert_eq!(Nodes.stats().reserved_bytes, 0);
}

#[test]
fn a_pool_refuses_what_it_cannot_serve() {
    common::messages::capture();
    assert!(
        Small
            .allocate(Layout::from_size_align(257, 8).unwrap())
            .is_err()
    );
    // Noted once, in every build, with the pool's name and range.
    assert!(common::messages::captured(
        "tagalloc: pool 'Small': request of 257 bytes aligned to 8 refused: this pool serves \
         8..=256 bytes with alignment up to 256 (further refusals are not noted)"
    ));
    assert!(
        Small
            .allocate(Layout::from_size_align(8, 512).unwrap())
            .is_err()
    );
    let mut v: Vec<u8, Small> = Vec::new_in(Small);
    assert!(v.try_reserve(200).is_ok());
    assert!(
        v.try_reserve(1000).is_err(),
        "growth past the pool's largest class fails cleanly"
    );
    assert_eq!(Small.stats().live_blocks, 1);
    // Its pages are blocks of its parent, a child of the SystemAllocator.
    let parent = PoolParent.stats();
    assert_eq!(parent.live_granted_bytes, Small.stats().reserved_bytes);
    drop(v);
}

#[test]
fn containers_in_a_thread_pool_freed_on_other_threads() {
    let start = Particles.stats();
    let boxes: std::vec::Vec<Box<[f32; 16], Particles>> = std::thread::scope(|s| {
        (0..4)
            .map(|t| {
                s.spawn(move || {
                    (0..500)
                        .map(|i| Box::new_in([(t * i) as f32; 16], Particles))
                        .collect::<std::vec::Vec<_>>()
                })
            })
            .collect::<std::vec::Vec<_>>()
            .into_iter()
            .flat_map(|h| h.join().unwrap())
            .collect()
    });
    let mid = Particles.stats();
    assert_eq!(mid.live_blocks - start.live_blocks, 2000);
    assert_eq!(mid.live_granted_bytes - start.live_granted_bytes, 2000 * 64);
    let mut m: HashMap<u32, u32, DefaultHashBuilder, Particles> =
        HashMap::with_hasher_in(DefaultHashBuilder::default(), Particles);
    m.extend((0..40).map(|i| (i, i)));
    let mut v: Vec<u64, Particles> = Vec::new_in(Particles);
    v.extend(0..100);
    // Freed on other threads than the ones that allocated them.
    std::thread::scope(|s| {
        s.spawn(move || drop(boxes));
        s.spawn(move || drop((m, v)));
    });
    let end = Particles.stats();
    assert_eq!(end.live_blocks, start.live_blocks);
    assert_eq!(end.live_granted_bytes, start.live_granted_bytes);
    assert_eq!(end.live_requested_bytes, start.live_requested_bytes);
    assert_eq!(Particles::registration().kind(), AllocatorKind::ThreadPool);
    assert_eq!(Particles.config().max_size(), 1024);
}

#[test]
fn a_child_of_a_thread_pool_counts_in_both() {
    let b = Box::new_in([0u8; 100], InPool);
    assert_eq!(InPool.stats().live_granted_bytes, 112);
    assert!(Particles.stats().live_granted_bytes >= 112);
    assert_eq!(
        <InPool as BlockAllocator>::registration()
            .parent()
            .unwrap()
            .name(),
        "Particles"
    );
    drop(b);
    assert_eq!(InPool.stats().live_blocks, 0);
}

tagalloc::allocator!(Budgeted: pool of SystemAllocator);
tagalloc::allocator!(BudgetedThreads: thread_pool of SystemAllocator);

/// With a 1000-byte budget in Fail mode, a second 512-byte block is refused; the first
/// stays counted, the refused one leaves no trace but the failure count.
fn check_budget<A: BlockAllocator + Allocator>(alloc: A) {
    fn quiet(_: &tagalloc::BudgetEvent) {}
    let reg = A::registration();
    reg.budget().set_hook(quiet);
    reg.set_budget(Some(1000), BudgetMode::Fail);
    let layout = Layout::from_size_align(512, 8).unwrap();
    let a = alloc.allocate(layout).expect("512 of 1000");
    assert!(alloc.allocate(layout).is_err(), "1024 > 1000");
    let s = reg.stats();
    assert_eq!(
        (s.live_blocks, s.live_granted_bytes, s.budget_failures),
        (1, 512, 1)
    );
    // SAFETY: allocated above with `layout`.
    unsafe { alloc.deallocate(a.cast(), layout) };
    assert_eq!(reg.stats().live_blocks, 0);
}

#[test]
fn pool_budgets_refuse_in_fail_mode() {
    check_budget(Budgeted);
}

#[test]
fn thread_pool_budgets_refuse_in_fail_mode() {
    check_budget(BudgetedThreads);
}

tagalloc::allocator!(Holder: child of SystemAllocator, "pools test: holds a thread pool");
tagalloc::allocator!(HeldPool: thread_pool of Holder
    { page_size: 65536, min_size: 16, max_size: 256 }, "pools test: thread pool in a child");

/// A thread pool of a child holds nothing but its pages and bookkeeping from the child, and
/// reports them as the child counts them: its reserved bytes are the child's live bytes,
/// with heaps for several threads.
#[test]
fn a_thread_pool_reserves_what_its_parent_counts() {
    std::thread::scope(|scope| {
        for _ in 0..3 {
            scope.spawn(|| {
                let b = Box::new_in([1u8; 40], HeldPool);
                assert_eq!(b[39], 1);
            });
        }
    });
    let _kept = Box::new_in([2u8; 200], HeldPool);
    let pool = HeldPool.stats();
    let child = Holder.stats();
    assert!(pool.reserved_bytes > 65536, "pages and heaps: {pool:?}");
    assert_eq!(
        pool.reserved_bytes, child.live_granted_bytes,
        "{pool:?} / {child:?}"
    );
}
