//! The lane transitions of `tests/lane_transitions.rs` with the `SystemAllocator` installed
//! as the global allocator, so that the thread caches the children's lanes live in also
//! serve every other allocation of the process (the test's own vectors, thread starts and
//! exits). A binary of its own: the global allocator is per binary.

#[path = "lane_transitions/harness.rs"]
mod harness;

use harness::Config;
use tagalloc::SystemAllocator;

#[global_allocator]
static GLOBAL: SystemAllocator = SystemAllocator::new();

tagalloc::allocator!(Budgeted: child of SystemAllocator, "global lane transitions: parent, budgets only");
tagalloc::allocator!(BudgetedKid: child of Budgeted, "global lane transitions: child, budgets only");
tagalloc::allocator!(Mixed: child of SystemAllocator, "global lane transitions: parent, refusals and records");
tagalloc::allocator!(MixedKid: child of Mixed, "global lane transitions: child, refusals and records");

#[test]
fn budget_changes_alone_refuse_nothing() {
    harness::run(
        Budgeted,
        BudgetedKid,
        Config {
            secs: 4,
            large_percent: 2,
            calls_per_worker: 1500,
            tight_fail_budgets: false,
            toggle_records: false,
            check_every: 3,
        },
    );
}

#[test]
fn refusals_and_records_keep_count() {
    harness::run(
        Mixed,
        MixedKid,
        Config {
            secs: 4,
            large_percent: 3,
            calls_per_worker: 2000,
            tight_fail_budgets: true,
            toggle_records: true,
            check_every: 4,
        },
    );
}
