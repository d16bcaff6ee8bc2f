//! A lane under a `Fail` budget takes each block off its bin uncounted and counts it once
//! it knows the gate is still open (see docs/architecture.md, "Budgets on lanes"): the
//! bin's own count must come out as for any allocation, or a thread that frees what it
//! allocated keeps every freed block in its cache instead of giving the excess back.
//! Its own binary: the figure read is process-wide.

use allocator_api2::boxed::Box as ABox;
use tagalloc::{BudgetMode, SystemAllocator};

#[global_allocator]
static GLOBAL: SystemAllocator = SystemAllocator::new();

tagalloc::allocator!(Capped: child of SystemAllocator, "a Fail budget far from its limit");

#[test]
fn a_fail_budgets_lane_gives_back_what_its_bin_cannot_hold() {
    drop(ABox::new_in(0u8, Capped));
    Capped.set_budget(Some(1 << 30), BudgetMode::Fail);
    assert!(
        Capped::registration().thread_cache_lane_open(),
        "far from the limit"
    );
    let held: Vec<ABox<[u8; 64], Capped>> = (0..20_000)
        .map(|_| ABox::new_in([7u8; 64], Capped))
        .collect();
    // Many blocks taken from the bin and given back, with no refill between: a count off
    // by one per allocation would drift by all of them.
    let mut some: Vec<ABox<[u8; 64], Capped>> = Vec::with_capacity(100);
    for _ in 0..1_000 {
        some.extend((0..100).map(|_| ABox::new_in([8u8; 64], Capped)));
        some.clear();
    }
    let cached_before = GLOBAL.heap_stats().thread_cached_bytes;
    drop(held);
    let cached = GLOBAL.heap_stats().thread_cached_bytes;
    // A bin holds at most 16 KiB of a class plus one refill; 1.25 MiB were freed.
    assert!(
        cached <= cached_before + (64 << 10),
        "{cached} bytes cached after the frees ({cached_before} before)"
    );
    assert_eq!(Capped.stats().live_blocks, 0);
    Capped.set_budget(None, BudgetMode::Fail);
}
