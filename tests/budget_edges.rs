//! Budgets at their edges, for every kind of handle: a refused allocation leaves no trace
//! but the failure counts; the mode is read once per decision (a block is refused or handed
//! out, never both); shrinking, or growing within the granted size, is never refused; a
//! pool's resizes count as reallocations, as a child's do.
//!
//! Each test has allocators of its own, so the tests may run in parallel.

use allocator_api2::alloc::Allocator;
use core::alloc::Layout;
use core::ptr::NonNull;
use std::collections::HashSet;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering::SeqCst};
use tagalloc::{BlockAllocator, BudgetEvent, BudgetMode, ClassAllocator, SystemAllocator};

// Every pool here: 16-byte classes from 16 to 256 bytes on 64 KiB pages.
tagalloc::allocator!(EdgePool: pool of SystemAllocator
    { page_size: 65536, min_size: 16, max_size: 256 }, "edges: pool");
tagalloc::allocator!(EdgeThreadPool: thread_pool of SystemAllocator
    { page_size: 65536, min_size: 16, max_size: 256 }, "edges: thread pool");
tagalloc::allocator!(EdgeChild: child of SystemAllocator, "edges: child");

fn quiet(_: &BudgetEvent) {}

fn layout(size: usize) -> Layout {
    Layout::from_size_align(size, 8).unwrap()
}

/// Fills `alloc` exactly to a budget of `sizes`' sum (each size its own granted size),
/// then checks that refused requests change nothing but `over_budget` and
/// `budget_failures`, and that the hook hears of each as refused.
fn refusals_leave_no_trace<A: BlockAllocator + Allocator>(alloc: A, sizes: &[usize]) {
    // The names of the allocators the hook heard of (the tests run in parallel).
    static REFUSED: Mutex<Vec<&'static str>> = Mutex::new(Vec::new());
    fn count(event: &BudgetEvent) {
        assert!(event.refused, "{event:?}");
        assert!(event.live_bytes > event.budget, "{event:?}");
        REFUSED.lock().unwrap().push(event.allocator);
    }
    let refusals = |name| {
        REFUSED
            .lock()
            .unwrap()
            .iter()
            .filter(|&&n| n == name)
            .count()
    };
    let registration = A::registration();
    registration.budget().set_hook(count);
    let budget: usize = sizes.iter().sum();
    registration.set_budget(Some(budget), BudgetMode::Fail);
    let blocks: Vec<_> = sizes
        .iter()
        .map(|&size| {
            let block = alloc.allocate(layout(size)).expect("within the budget");
            assert_eq!(
                block.len(),
                size,
                "a class-sized request is granted exactly"
            );
            (block.cast::<u8>(), layout(size))
        })
        .collect();
    let before = registration.stats();
    assert_eq!(before.live_granted_bytes, budget);
    assert!(alloc.allocate(layout(16)).is_err());
    assert!(alloc.allocate_zeroed(layout(16)).is_err());
    assert_eq!(refusals(registration.name()), 2, "the hook hears of both");
    let after = registration.stats();
    assert_eq!(
        after,
        tagalloc::AllocatorStats {
            over_budget: before.over_budget + 2,
            budget_failures: before.budget_failures + 2,
            ..before
        },
        "{}: only the failure counts change",
        registration.name()
    );
    assert!(after.peak_granted_bytes <= Some(budget));
    registration.set_budget(None, BudgetMode::Warn);
    for (ptr, layout) in blocks {
        // SAFETY: allocated above with `layout`, freed once.
        unsafe { alloc.deallocate(ptr, layout) };
    }
}

#[test]
fn a_refused_pool_allocation_leaves_no_trace() {
    refusals_leave_no_trace(EdgePool, &[256, 256, 256, 224]);
}

#[test]
fn a_refused_thread_pool_allocation_leaves_no_trace() {
    refusals_leave_no_trace(EdgeThreadPool, &[256, 256, 256, 224]);
}

#[test]
fn a_refused_child_allocation_leaves_no_trace() {
    refusals_leave_no_trace(EdgeChild, &[512, 512, 256]);
}

tagalloc::allocator!(RacedPool: pool of SystemAllocator
    { page_size: 65536, min_size: 16, max_size: 256 }, "edges: pool, mode flipping");
tagalloc::allocator!(RacedThreadPool: thread_pool of SystemAllocator
    { page_size: 65536, min_size: 16, max_size: 256 }, "edges: thread pool, mode flipping");
tagalloc::allocator!(RacedChild: child of SystemAllocator, "edges: child, mode flipping");

/// What [`allocate_while_budget_cycles`] saw.
struct CycleOutcome {
    /// Allocations handed out.
    handed_out: usize,
    /// Allocations refused.
    refused: usize,
    /// Allocations that returned a block already live (handed out and not yet freed).
    handed_out_twice: usize,
}

/// Makes `calls` 32-byte allocations through `alloc`, freeing the live ones every 17,
/// while another thread sets the budget to each of `settings` in turn, round and round;
/// then frees what is left and removes the budget. Nothing is asserted while the other
/// thread runs (a panic then would leave it running and hang the test).
fn allocate_while_budget_cycles<A: BlockAllocator + Allocator>(
    alloc: A,
    settings: &[(Option<usize>, BudgetMode)],
    calls: usize,
) -> CycleOutcome {
    let registration = A::registration();
    registration.budget().set_hook(quiet);
    let stop = AtomicBool::new(false);
    let mut outcome = CycleOutcome {
        handed_out: 0,
        refused: 0,
        handed_out_twice: 0,
    };
    std::thread::scope(|scope| {
        scope.spawn(|| {
            for &(bytes, mode) in settings.iter().cycle() {
                if stop.load(SeqCst) {
                    break;
                }
                registration.set_budget(bytes, mode);
            }
        });
        let block_layout = layout(32);
        let mut live: HashSet<NonNull<u8>> = HashSet::new();
        for _ in 0..calls {
            let Ok(block) = alloc.allocate(block_layout) else {
                outcome.refused += 1;
                continue;
            };
            outcome.handed_out += 1;
            if !live.insert(block.cast()) {
                outcome.handed_out_twice += 1;
            }
            if live.len() > 16 {
                for ptr in live.drain() {
                    // SAFETY: each handed out once with `block_layout`, freed once.
                    unsafe { alloc.deallocate(ptr, block_layout) };
                }
            }
        }
        stop.store(true, SeqCst);
        for ptr in live.drain() {
            // SAFETY: as above.
            unsafe { alloc.deallocate(ptr, block_layout) };
        }
    });
    registration.set_budget(None, BudgetMode::Warn);
    outcome
}

/// Allocates over a budget whose mode another thread keeps flipping between Warn and Fail:
/// every block handed out is a distinct live block (a refusal never frees a block that is
/// then handed out), and after the frees nothing is live (nor leaked by a refusal).
fn mode_flips_never_hand_out_a_freed_block<A: BlockAllocator + Allocator>(alloc: A) {
    let registration = A::registration();
    registration.set_budget(Some(64), BudgetMode::Warn);
    let flips = [(Some(64), BudgetMode::Fail), (Some(64), BudgetMode::Warn)];
    let outcome = allocate_while_budget_cycles(alloc, &flips, 50_000);
    assert_eq!(
        outcome.handed_out_twice,
        0,
        "{}: a block handed out twice",
        registration.name()
    );
    assert!(outcome.handed_out > 0);
    let stats = registration.stats();
    assert_eq!(
        (stats.live_blocks, stats.live_granted_bytes),
        (0, 0),
        "{stats:?}"
    );
}

#[test]
fn a_pool_never_hands_out_a_block_it_refused() {
    mode_flips_never_hand_out_a_freed_block(RacedPool);
}

#[test]
fn a_thread_pool_never_hands_out_a_block_it_refused() {
    mode_flips_never_hand_out_a_freed_block(RacedThreadPool);
}

#[test]
fn a_child_never_hands_out_a_block_it_refused() {
    mode_flips_never_hand_out_a_freed_block(RacedChild);
}

tagalloc::allocator!(SwappedPool: pool of SystemAllocator
    { page_size: 65536, min_size: 16, max_size: 256 }, "edges: pool, settings swapped");
tagalloc::allocator!(SwappedThreadPool: thread_pool of SystemAllocator
    { page_size: 65536, min_size: 16, max_size: 256 }, "edges: thread pool, settings swapped");
tagalloc::allocator!(SwappedChild: child of SystemAllocator, "edges: child, settings swapped");

/// Allocates while another thread keeps swapping the budget between settings none of which
/// refuses the calls (a small Warn budget, none at all in Fail mode, a Fail budget far above
/// the live bytes): no call is refused. A call reads the limit and the mode together, so it
/// never pairs the small limit with the Fail mode (the stress test `lane_transitions_global`
/// once saw that refuse an allocation while no budget was set).
fn swapped_settings_refuse_nothing<A: BlockAllocator + Allocator>(alloc: A) {
    let registration = A::registration();
    let settings = [
        (Some(64), BudgetMode::Warn),
        (None, BudgetMode::Fail),
        (Some(64), BudgetMode::Warn),
        (Some(1 << 40), BudgetMode::Fail),
    ];
    let outcome = allocate_while_budget_cycles(alloc, &settings, 100_000);
    let stats = registration.stats();
    assert_eq!(
        outcome.refused,
        0,
        "{}: calls refused; {stats:?}",
        registration.name()
    );
    assert_eq!(stats.budget_failures, 0, "{stats:?}");
    assert_eq!(stats.live_blocks, 0, "{stats:?}");
}

#[test]
fn a_pool_is_never_refused_by_a_budget_being_swapped() {
    swapped_settings_refuse_nothing(SwappedPool);
}

#[test]
fn a_thread_pool_is_never_refused_by_a_budget_being_swapped() {
    swapped_settings_refuse_nothing(SwappedThreadPool);
}

#[test]
fn a_child_is_never_refused_by_a_budget_being_swapped() {
    swapped_settings_refuse_nothing(SwappedChild);
}

tagalloc::allocator!(ContestedChild: child of SystemAllocator, "edges: child, two setters");

/// Two threads set the budget at once, one a Fail budget of nothing, the other none: once
/// both are done, calls obey whichever setting came last (the route's budget flag, which
/// sends calls to the budget check, is never left clear under a budget).
#[test]
fn the_last_of_two_racing_budget_settings_is_obeyed() {
    let registration = ContestedChild::registration();
    registration.budget().set_hook(quiet);
    // Past the small classes, so the call takes the general path that the flag guards.
    let big = layout(64 * 1024);
    for round in 0..300 {
        std::thread::scope(|scope| {
            scope.spawn(|| {
                for _ in 0..50 {
                    registration.set_budget(Some(0), BudgetMode::Fail);
                }
            });
            scope.spawn(|| {
                for _ in 0..50 {
                    registration.set_budget(None, BudgetMode::Warn);
                }
            });
        });
        let budget = registration.budget().limit();
        match ContestedChild.allocate(big) {
            Ok(block) => {
                assert_eq!(
                    budget, None,
                    "round {round}: allocated under a Fail budget of 0"
                );
                // SAFETY: just allocated with `big`.
                unsafe { ContestedChild.deallocate(block.cast(), big) };
            }
            Err(_) => assert_eq!(budget, Some(0), "round {round}: refused with no budget"),
        }
    }
    registration.set_budget(None, BudgetMode::Warn);
    assert_eq!(registration.stats().live_blocks, 0);
}

tagalloc::allocator!(ShrunkPool: pool of SystemAllocator
    { page_size: 65536, min_size: 16, max_size: 256 }, "edges: pool shrink");
tagalloc::allocator!(ShrunkThreadPool: thread_pool of SystemAllocator
    { page_size: 65536, min_size: 16, max_size: 256 }, "edges: thread pool shrink");
tagalloc::allocator!(ShrunkChild: child of SystemAllocator, "edges: child shrink");

/// At a Fail budget's limit, a block shrinks (contents kept), and a resize within its size
/// class succeeds, without the hook hearing of either; in Warn mode neither calls the hook.
fn shrinking_is_never_refused<A: BlockAllocator + Allocator>(alloc: A) {
    // The names of the allocators the hook heard of (the tests run in parallel).
    static HEARD: Mutex<Vec<&'static str>> = Mutex::new(Vec::new());
    fn note(event: &BudgetEvent) {
        HEARD.lock().unwrap().push(event.allocator);
    }
    let registration = A::registration();
    registration.budget().set_hook(note);
    for mode in [BudgetMode::Fail, BudgetMode::Warn] {
        registration.set_budget(Some(256), mode);
        let block = alloc.allocate(layout(256)).unwrap().cast::<u8>();
        // SAFETY: 256 bytes, ours.
        unsafe { block.as_ptr().write_bytes(0xA5, 256) };
        // SAFETY: allocated with 256 bytes; each resize gets the block's current layout.
        let block = unsafe { alloc.shrink(block, layout(256), layout(250)) }
            .unwrap_or_else(|_| panic!("{}: 256 -> 250 refused ({mode:?})", registration.name()));
        // SAFETY: as above.
        let block = unsafe { alloc.shrink(block.cast(), layout(250), layout(16)) }
            .unwrap_or_else(|_| panic!("{}: 250 -> 16 refused ({mode:?})", registration.name()));
        // SAFETY: the block holds at least 16 bytes.
        let kept = unsafe { core::slice::from_raw_parts(block.cast::<u8>().as_ptr(), 16) };
        assert!(kept.iter().all(|&b| b == 0xA5), "contents kept");
        let heard = HEARD.lock().unwrap().contains(&registration.name());
        assert!(!heard, "the hook hears of no shrink ({mode:?})");
        // SAFETY: last resized to 16 bytes.
        unsafe { alloc.deallocate(block.cast(), layout(16)) };
        registration.set_budget(None, BudgetMode::Warn);
    }
}

#[test]
fn a_pool_shrinks_at_its_budget() {
    shrinking_is_never_refused(ShrunkPool);
}

#[test]
fn a_thread_pool_shrinks_at_its_budget() {
    shrinking_is_never_refused(ShrunkThreadPool);
}

#[test]
fn a_child_shrinks_at_its_budget() {
    shrinking_is_never_refused(ShrunkChild);
}

tagalloc::allocator!(GrownChild: child of SystemAllocator, "edges: child growth");
tagalloc::allocator!(GrownPool: pool of SystemAllocator
    { page_size: 65536, min_size: 16, max_size: 256 }, "edges: pool growth");

/// Under a Fail budget, growth within the block's granted size needs no new bytes and is
/// allowed; growth past it needs old and new block together and is refused past the
/// budget, leaving the old block as it was.
fn growth_within_the_granted_size_is_allowed<A: BlockAllocator + Allocator>(alloc: A) {
    let registration = A::registration();
    registration.budget().set_hook(quiet);
    let block = alloc.allocate(layout(100)).unwrap();
    let granted = block.len();
    assert!(granted > 100, "100 bytes get a bigger class");
    let block = block.cast::<u8>();
    // SAFETY: at least 100 bytes, ours.
    unsafe { block.as_ptr().write_bytes(0x3C, 100) };
    registration.set_budget(Some(granted + 8), BudgetMode::Fail);
    // SAFETY: allocated with 100 bytes; `granted` is within the block.
    let grown = unsafe { alloc.grow(block, layout(100), layout(granted)) }.unwrap_or_else(|_| {
        panic!(
            "{}: 100 -> {granted} (its granted size) refused",
            registration.name()
        )
    });
    let before = registration.stats();
    // SAFETY: now `granted` bytes; the next class needs more than the budget allows.
    let refused = unsafe { alloc.grow(grown.cast(), layout(granted), layout(granted + 1)) };
    assert!(
        refused.is_err(),
        "{}: growth past the budget",
        registration.name()
    );
    // SAFETY: the refused growth left the block as it was.
    let kept = unsafe { core::slice::from_raw_parts(grown.cast::<u8>().as_ptr(), 100) };
    assert!(kept.iter().all(|&b| b == 0x3C), "contents kept");
    let after = registration.stats();
    assert_eq!(after.live_granted_bytes, before.live_granted_bytes);
    assert_eq!(after.budget_failures, before.budget_failures + 1);
    registration.set_budget(None, BudgetMode::Warn);
    // SAFETY: last resized to `granted` bytes.
    unsafe { alloc.deallocate(grown.cast(), layout(granted)) };
}

#[test]
fn a_child_grows_within_its_granted_size_at_its_budget() {
    growth_within_the_granted_size_is_allowed(GrownChild);
}

#[test]
fn a_pool_grows_within_its_class_at_its_budget() {
    growth_within_the_granted_size_is_allowed(GrownPool);
}

tagalloc::allocator!(ResizedPool: pool of SystemAllocator
    { page_size: 65536, min_size: 16, max_size: 256 }, "edges: pool resizes");
tagalloc::allocator!(ResizedThreadPool: thread_pool of SystemAllocator
    { page_size: 65536, min_size: 16, max_size: 256 }, "edges: thread pool resizes");

/// A pool resizes by moving, but reports a resize as a reallocation (as a child does), not
/// as an allocation and a free; its requested bytes never drift below zero.
fn resizes_count_as_reallocations<A: BlockAllocator + Allocator>(alloc: A) {
    let registration = A::registration();
    let start = registration.stats();
    let block = alloc.allocate(layout(20)).unwrap().cast::<u8>();
    // SAFETY: each resize gets the block's current layout; freed once at the end.
    unsafe {
        let block = alloc
            .grow(block, layout(20), layout(100))
            .unwrap()
            .cast::<u8>();
        let block = alloc
            .shrink(block, layout(100), layout(40))
            .unwrap()
            .cast::<u8>();
        let block = alloc
            .grow(block, layout(40), layout(40))
            .unwrap()
            .cast::<u8>();
        let stats = registration.stats();
        assert_eq!(stats.allocations - start.allocations, 1, "{stats:?}");
        assert_eq!(stats.frees - start.frees, 0, "{stats:?}");
        assert_eq!(stats.reallocations - start.reallocations, 3, "{stats:?}");
        assert_eq!(stats.live_requested_bytes, Some(40));
        // A free may name the class size instead of the requested one.
        alloc.deallocate(block, layout(48));
    }
    let end = registration.stats();
    assert_eq!(end.live_blocks, 0);
    assert_eq!(end.frees - start.frees, 1);
    assert_eq!(
        end.live_requested_bytes,
        Some(0),
        "clamped, not wrapped: {end:?}"
    );
}

#[test]
fn pool_resizes_count_as_reallocations() {
    resizes_count_as_reallocations(ResizedPool);
}

#[test]
fn thread_pool_resizes_count_as_reallocations() {
    resizes_count_as_reallocations(ResizedThreadPool);
}

tagalloc::allocator!(BoxedChild: child of SystemAllocator, "edges: boxed");

struct Body([u64; 8]);
impl ClassAllocator for Body {
    type Allocator = BoxedChild;
}

#[test]
fn try_new_boxed_returns_the_refusal() {
    BoxedChild::registration().budget().set_hook(quiet);
    BoxedChild.set_budget(Some(32), BudgetMode::Fail);
    assert!(
        Body::try_new_boxed(Body([1; 8])).is_err(),
        "64 bytes over a 32-byte budget"
    );
    BoxedChild.set_budget(None, BudgetMode::Warn);
    let body = Body::try_new_boxed(Body([2; 8])).expect("no budget");
    assert_eq!(body.0[7], 2);
    assert_eq!(BoxedChild.stats().live_blocks, 1);
    drop(body);
    assert_eq!(BoxedChild.stats().live_blocks, 0);
}

tagalloc::allocator!(Above: child of SystemAllocator, "edges: parent of a budgeted child");
tagalloc::allocator!(Below: child of Above, "edges: budgeted child");

/// A child's refusal leaves no trace in its parent either: a request whose size alone is
/// over the budget never reaches the parent, small or large, plain, zeroed or a growth.
#[test]
fn a_refusal_leaves_no_trace_in_the_parent() {
    Below::registration().budget().set_hook(quiet);
    let kept = Below.allocate(layout(200)).unwrap();
    Below.set_budget(Some(1024), BudgetMode::Fail);
    let parent_before = Above.stats();
    for size in [1000, 4096, 1 << 20] {
        assert!(Below.allocate(layout(size)).is_err(), "{size}");
        assert!(Below.allocate_zeroed(layout(size)).is_err(), "{size}");
    }
    // SAFETY: `kept` was allocated with 200 bytes; a refused growth leaves it as it was.
    assert!(unsafe { Below.grow(kept.cast(), layout(200), layout(1 << 20)) }.is_err());
    assert_eq!(Above.stats(), parent_before, "the parent saw none of it");
    assert_eq!(Below.stats().budget_failures, 7);
    Below.set_budget(None, BudgetMode::Warn);
    // SAFETY: allocated above with 200 bytes.
    unsafe { Below.deallocate(kept.cast(), layout(200)) };
}
