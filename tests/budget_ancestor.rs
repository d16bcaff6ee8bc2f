//! A refusal by an ancestor's budget counts as a failure where the request came in, on
//! every child it passed through, and on the allocator whose budget refused; the hook hears
//! whose budget it was.

mod common;

use allocator_api2::boxed::Box;
use allocator_api2::vec::Vec;
use std::sync::Mutex;
use tagalloc::{BudgetEvent, BudgetMode, SystemAllocator, TaggedAllocator};

tagalloc::allocator!(Level: child of SystemAllocator, "a subsystem with a Fail budget");
tagalloc::allocator!(Zone: child of Level, "a child of it, no budget");
tagalloc::allocator!(Props: child of Zone, "a grandchild, no budget");
tagalloc::allocator!(Sprites: pool of SystemAllocator, "a pool with a Fail budget");
tagalloc::allocator!(Frames: child of Sprites, "a child of the pool");

static HEARD: Mutex<Vec<(&'static str, bool)>> = Mutex::new(Vec::new());

fn listen(event: &BudgetEvent) {
    HEARD.lock().unwrap().push((event.allocator, event.refused));
}

#[test]
fn a_grandchild_refused_by_its_grandparents_budget_counts_the_failure() {
    Level.set_budget(Some(4096), BudgetMode::Fail);
    Level.set_budget_hook(listen);
    let kept = Box::new_in([0u8; 3000], Props);
    let before = [Level.stats(), Zone.stats(), Props.stats()];
    assert!(
        Box::try_new_in([0u8; 2000], Props).is_err(),
        "over Level's 4 KiB"
    );
    // A grow of the grandchild's vector past the budget is refused too.
    let mut grown: Vec<u8, Props> = Vec::with_capacity_in(512, Props);
    assert!(grown.try_reserve_exact(4096).is_err());
    let after = [Level.stats(), Zone.stats(), Props.stats()];
    for (name, (b, a)) in ["Level", "Zone", "Props"]
        .iter()
        .zip(before.iter().zip(&after))
    {
        assert_eq!(a.budget_failures, b.budget_failures + 2, "{name}");
    }
    // Over budget is the refuser's alone: its children have no budget to be over.
    assert_eq!(after[0].over_budget, before[0].over_budget + 2);
    assert_eq!(after[1].over_budget, 0);
    assert_eq!(after[2].over_budget, 0);
    let heard = HEARD.lock().unwrap().clone();
    assert_eq!(
        heard,
        [("Level", true), ("Level", true)],
        "the event names whose budget"
    );
    drop((kept, grown));
    Level.set_budget(None, BudgetMode::Warn);

    // A failure that is not a budget's (an impossible size) counts nowhere.
    let huge = core::alloc::Layout::from_size_align(isize::MAX as usize - 4096, 8).unwrap();
    assert!(allocator_api2::alloc::Allocator::allocate(&Props, huge).is_err());
    assert_eq!(Props.stats().budget_failures, after[2].budget_failures);
    assert_eq!(Level.stats().budget_failures, after[0].budget_failures);
}

#[test]
fn a_child_refused_by_its_pools_budget_counts_the_failure() {
    common::messages::capture();
    Sprites.set_budget(Some(256), BudgetMode::Fail);
    let blocks: std::vec::Vec<_> = (0..4).map(|_| Box::new_in([0u8; 64], Frames)).collect();
    assert!(Box::try_new_in([0u8; 64], Frames).is_err());
    assert_eq!(Sprites.stats().budget_failures, 1);
    assert_eq!(Frames.stats().budget_failures, 1);
    assert!(common::messages::captured(
        "tagalloc: allocator \"Sprites\" over its budget of 256 bytes: 320 live after a \
         64-byte block (refused"
    ));
    drop(blocks);
    Sprites.set_budget(None, BudgetMode::Warn);
}
