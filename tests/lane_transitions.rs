//! Lanes of the thread caches under budget and record changes: threads allocate, resize,
//! free and pass around blocks of a child of the `SystemAllocator` and of its own child
//! while another thread keeps setting and clearing budgets and records on both, so that the
//! children's lanes close and reopen under traffic (see `lane_transitions/harness.rs`).
//! Every block keeps its contents, and whenever no call is under way both children's
//! figures match what the test holds; at the end nothing is live, and each lane is open
//! again unless records (which keep a lane closed for good) were ever on for it.
//!
//! Each test has its own pair of allocators, so the tests may run in parallel. The traffic
//! lasts a few seconds; `LANE_TRANSITIONS_SECS=60` runs longer, `LANE_TRANSITIONS_SEED`
//! changes the controller's choices.

#[path = "lane_transitions/harness.rs"]
mod harness;

use harness::Config;
use tagalloc::SystemAllocator;

tagalloc::allocator!(Steady: child of SystemAllocator, "lane transitions: parent, no refusals");
tagalloc::allocator!(SteadyKid: child of Steady, "lane transitions: child, no refusals");
tagalloc::allocator!(Tight: child of SystemAllocator, "lane transitions: parent, refusals");
tagalloc::allocator!(TightKid: child of Tight, "lane transitions: child, refusals");

#[test]
fn budgets_that_are_never_reached_refuse_nothing() {
    harness::run(
        Steady,
        SteadyKid,
        Config {
            secs: 4,
            large_percent: 3,
            calls_per_worker: 3000,
            tight_fail_budgets: false,
            toggle_records: true,
            check_every: 5,
        },
    );
}

#[test]
fn fail_budgets_at_the_live_bytes_refuse_without_losing_count() {
    harness::run(
        Tight,
        TightKid,
        Config {
            secs: 4,
            large_percent: 3,
            calls_per_worker: 3000,
            tight_fail_budgets: true,
            toggle_records: true,
            check_every: 5,
        },
    );
}
