//! Budgets: the hook is called when an allocation goes over; Warn lets it through, Fail
//! refuses it (the container sees `AllocError`), growth in Fail mode is refused exactly and
//! leaves the old block intact.

use allocator_api2::alloc::Allocator;
use allocator_api2::vec::Vec;
use std::alloc::Layout;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering::SeqCst};
use tagalloc::{BudgetEvent, BudgetMode, SystemAllocator};

tagalloc::allocator!(Warned: child of SystemAllocator, "budget: warn");
tagalloc::allocator!(Refused: child of SystemAllocator, "budget: fail");
tagalloc::allocator!(Grown: child of SystemAllocator, "budget: growth");

static WARN_EVENTS: AtomicU64 = AtomicU64::new(0);
static WARN_LAST_LIVE: AtomicUsize = AtomicUsize::new(0);
fn count_warn(event: &BudgetEvent) {
    assert_eq!(event.allocator, "Warned");
    assert!(!event.refused);
    assert!(event.live_bytes > event.budget);
    WARN_EVENTS.fetch_add(1, SeqCst);
    WARN_LAST_LIVE.store(event.live_bytes, SeqCst);
}

#[test]
fn warn_mode_calls_the_hook_and_allows_the_allocation() {
    Warned.set_budget(Some(1000), BudgetMode::Warn);
    Warned::registration().budget().set_hook(count_warn);
    let layout = Layout::from_size_align(600, 8).unwrap();
    let a = Warned.allocate(layout).unwrap();
    assert_eq!(WARN_EVENTS.load(SeqCst), 0, "under budget: no call");
    let b = Warned.allocate(layout).expect("warn mode lets it through");
    assert_eq!(WARN_EVENTS.load(SeqCst), 1);
    assert_eq!(WARN_LAST_LIVE.load(SeqCst), a.len() + b.len());
    let s = Warned.stats();
    assert_eq!((s.over_budget, s.budget_failures, s.live_blocks), (1, 0, 2));
    // SAFETY: both allocated above with `layout`.
    unsafe {
        Warned.deallocate(a.cast(), layout);
        Warned.deallocate(b.cast(), layout);
    }
}

static FAIL_EVENTS: AtomicU64 = AtomicU64::new(0);
fn count_fail(event: &BudgetEvent) {
    assert!(event.refused);
    FAIL_EVENTS.fetch_add(1, SeqCst);
}

#[test]
fn fail_mode_refuses_the_allocation_and_counts_nothing_for_it() {
    Refused.set_budget(Some(4096), BudgetMode::Fail);
    Refused::registration().budget().set_hook(count_fail);
    let mut v: Vec<u8, Refused> = Vec::new_in(Refused);
    v.try_reserve_exact(4000).expect("fits the budget");
    let before = Refused.stats();
    assert!(
        v.try_reserve_exact(8000).is_err(),
        "over budget: AllocError"
    );
    assert_eq!(FAIL_EVENTS.load(SeqCst), 1);
    assert!(Refused.allocate(Layout::new::<[u8; 512]>()).is_err());
    assert_eq!(FAIL_EVENTS.load(SeqCst), 2);
    let after = Refused.stats();
    assert_eq!(after.live_granted_bytes, before.live_granted_bytes);
    assert_eq!(after.live_blocks, before.live_blocks);
    assert_eq!(after.budget_failures, 2);
    assert_eq!(after.over_budget, 2);
    // The old block is intact and still usable.
    v.extend_from_slice(&[3; 100]);
    assert_eq!(v[99], 3);
    Refused.set_budget(None, BudgetMode::Fail);
    v.try_reserve_exact(8000).expect("no budget any more");
}

static GROW_EVENTS: AtomicU64 = AtomicU64::new(0);
fn count_grow(_: &BudgetEvent) {
    GROW_EVENTS.fetch_add(1, SeqCst);
}

#[test]
fn growth_in_warn_mode_calls_the_hook_once_per_crossing_allocation() {
    Grown.set_budget(Some(10_000), BudgetMode::Warn);
    Grown::registration().budget().set_hook(count_grow);
    let mut v: Vec<u8, Grown> = Vec::with_capacity_in(5000, Grown);
    v.reserve_exact(9000);
    assert_eq!(GROW_EVENTS.load(SeqCst), 0);
    v.reserve_exact(20_000);
    assert_eq!(GROW_EVENTS.load(SeqCst), 1);
    assert!(Grown.stats().live_granted_bytes >= 20_000);
}

tagalloc::allocator!(Late: child of SystemAllocator, "budget: set while threads hold bytes");

#[test]
fn a_budget_set_later_counts_bytes_other_threads_allocated_before() {
    // Without a budget, another thread's allocation sits in that thread's counter shard;
    // the budget, set afterwards, must still see it.
    let layout = Layout::from_size_align(10_000, 8).unwrap();
    let small = Layout::from_size_align(8_000, 8).unwrap();
    let step = std::sync::Barrier::new(2);
    let (refused, allowed_after) = std::thread::scope(|s| {
        let step = &step;
        let other = s.spawn(move || {
            let block = Late.allocate(layout).unwrap();
            step.wait();
            step.wait();
            // SAFETY: allocated above with `layout`, freed once.
            unsafe { Late.deallocate(block.cast(), layout) };
        });
        step.wait();
        Late.set_budget(Some(15_000), BudgetMode::Fail);
        Late::registration().budget().set_hook(|_| {});
        // 10 000 live on the other thread + 8 000: over budget.
        let refused = Late.allocate(small).is_err();
        step.wait();
        other.join().unwrap();
        // The other thread freed its block: 8 000 fits now.
        let block = Late.allocate(small);
        let allowed_after = block.is_ok();
        if let Ok(block) = block {
            // SAFETY: allocated just above with `small`, freed once.
            unsafe { Late.deallocate(block.cast(), small) };
        }
        (refused, allowed_after)
    });
    assert!(refused, "the budget saw the other thread's bytes");
    assert!(allowed_after);
    let st = Late.stats();
    assert_eq!((st.live_granted_bytes, st.live_blocks), (0, 0));
    assert_eq!((st.allocations, st.frees, st.budget_failures), (2, 2, 1));
    // Exact peak while a budget is set: the other thread's block plus nothing else.
    assert!(st.peak_granted_bytes.unwrap() >= 10_000);
    assert!(st.peak_granted_bytes.unwrap() < 15_000);
}

tagalloc::allocator!(FreedMeanwhile: child of SystemAllocator, "budget: frees before it is seen");

/// A block allocated on one thread and handed to another.
struct Sent(std::ptr::NonNull<u8>);
// SAFETY: the block is owned by whoever holds this value; the allocator is thread-safe.
unsafe impl Send for Sent {}

#[test]
fn frees_after_a_new_budget_and_before_any_allocation_sees_it_are_in_its_check() {
    // Frees do not look at the budget: the first allocation that sees it publishes every
    // thread's shard first. Here a block allocated on this thread is freed on another
    // (live) thread after the budget is set, before any allocation: its bytes must be gone
    // from the figure that allocation checks.
    let big = Layout::from_size_align(10_000, 8).unwrap();
    let small = Layout::from_size_align(8_000, 8).unwrap();
    let step = std::sync::Barrier::new(2);
    let (to_other, from_main) = std::sync::mpsc::channel::<Sent>();
    let (first, second) = std::thread::scope(|s| {
        let step = &step;
        s.spawn(move || {
            // A small block registers this thread's cache, so the free below is counted in
            // the thread's shard (the path under test), not in the shared atomics.
            let tiny = Layout::from_size_align(16, 8).unwrap();
            let b = FreedMeanwhile.allocate(tiny).unwrap();
            // SAFETY: allocated just above with `tiny`, freed once.
            unsafe { FreedMeanwhile.deallocate(b.cast(), tiny) };
            step.wait();
            let Sent(ptr) = from_main.recv().unwrap();
            step.wait();
            // SAFETY: allocated by the main thread with `big`, freed once.
            unsafe { FreedMeanwhile.deallocate(ptr, big) };
            step.wait();
            // Still alive while the main thread allocates.
            step.wait();
        });
        step.wait();
        let block = FreedMeanwhile.allocate(big).unwrap();
        to_other.send(Sent(block.cast())).unwrap();
        FreedMeanwhile.set_budget(Some(15_000), BudgetMode::Fail);
        FreedMeanwhile::registration().budget().set_hook(|_| {});
        step.wait();
        step.wait();
        // 0 live + 8 000 fits; 8 000 + 8 000 does not.
        let first = FreedMeanwhile.allocate(small);
        let second = FreedMeanwhile.allocate(small);
        step.wait();
        (first, second)
    });
    let first = first.expect("the other thread's free was counted before the check");
    assert!(second.is_err(), "the budget still holds");
    // SAFETY: allocated above with `small`, freed once.
    unsafe { FreedMeanwhile.deallocate(first.cast(), small) };
    let st = FreedMeanwhile.stats();
    assert_eq!((st.live_granted_bytes, st.live_blocks), (0, 0));
    assert_eq!(st.live_requested_bytes, Some(0));
    assert_eq!((st.allocations, st.frees, st.budget_failures), (3, 3, 1));
}
