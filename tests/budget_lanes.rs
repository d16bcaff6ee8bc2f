//! A child with a budget keeps its thread-cache lane open while the budget is far from its
//! limit (`src/allocator/lanes.rs`, "Budgets on open lanes"): small blocks then cost about
//! what they do without a budget. Near the limit the lanes close and every call is checked
//! exactly, so a `Fail` budget refuses exactly where it would with the lanes closed all along
//! and the live figure (and the peak) never passes the limit, with threads racing to it;
//! once blocks are freed the lanes open again. Budgets are process-wide state: one binary.

use allocator_api2::boxed::Box as ABox;
use std::sync::Barrier;
use tagalloc::{BudgetMode, SystemAllocator};

#[global_allocator]
static GLOBAL: SystemAllocator = SystemAllocator::new();

tagalloc::allocator!(Capped: child of SystemAllocator, "a Fail budget");
tagalloc::allocator!(Watched: child of SystemAllocator, "a Warn budget");
tagalloc::allocator!(Racing: child of SystemAllocator, "threads racing to a Fail budget");

fn quiet(_: &tagalloc::BudgetEvent) {}

const LIMIT: usize = 32 << 20;

#[test]
fn a_fail_budget_keeps_the_lane_open_until_near_then_refuses_exactly() {
    Capped::registration().budget().set_hook(quiet);
    drop(ABox::new_in(0u8, Capped));
    Capped.set_budget(Some(LIMIT), BudgetMode::Fail);
    assert!(
        Capped::registration().thread_cache_lane_open(),
        "far from the limit"
    );
    // 64-byte blocks (granted 64) until the first refusal, through the handle and, every
    // other block, through the scoped tag (a std vector's buffer).
    let mut held: Vec<ABox<[u8; 64], Capped>> = Vec::new();
    let mut scoped: Vec<Vec<[u8; 64]>> = Vec::new();
    for i in 0.. {
        if i % 2 == 0 {
            match ABox::try_new_in([1u8; 64], Capped) {
                Ok(b) => held.push(b),
                Err(_) => break,
            }
        } else {
            let mut v: Vec<[u8; 64]> = Vec::new();
            if Capped.scope(|| v.try_reserve_exact(1)).is_err() {
                break;
            }
            scoped.push(v);
        }
    }
    let st = Capped.stats();
    assert_eq!(st.budget_failures, 1);
    assert!(
        st.live_granted_bytes <= LIMIT,
        "{} over {LIMIT}",
        st.live_granted_bytes
    );
    assert!(
        st.live_granted_bytes + 64 > LIMIT,
        "refused {} bytes before the limit",
        LIMIT - st.live_granted_bytes
    );
    assert!(st.peak_granted_bytes.unwrap() <= LIMIT);
    assert!(
        !Capped::registration().thread_cache_lane_open(),
        "near the limit"
    );
    // Freed back to far below: the next calls open the lanes again.
    held.truncate(1000);
    scoped.clear();
    drop(ABox::new_in(0u8, Capped));
    assert!(Capped::registration().thread_cache_lane_open(), "far again");
    drop(held);
    Capped.set_budget(None, BudgetMode::Fail);
    assert_eq!(Capped.stats().live_blocks, 0);
}

#[test]
fn threads_racing_to_a_fail_budget_never_take_it_over_its_limit() {
    const LIMIT: usize = 8 << 20;
    const THREADS: usize = 4;
    Racing::registration().budget().set_hook(quiet);
    Racing.set_budget(Some(LIMIT), BudgetMode::Fail);
    let barrier = Barrier::new(THREADS);
    let held: Vec<Vec<ABox<[u8; 48], Racing>>> = std::thread::scope(|s| {
        let workers: Vec<_> = (0..THREADS)
            .map(|_| {
                s.spawn(|| {
                    barrier.wait();
                    let mut mine = Vec::new();
                    let mut refused = 0;
                    // Past the first refusal, keep trying a little: others may free nothing,
                    // so every later try must be refused too.
                    while refused < 100 {
                        match ABox::try_new_in([3u8; 48], Racing) {
                            Ok(b) => mine.push(b),
                            Err(_) => refused += 1,
                        }
                    }
                    mine
                })
            })
            .collect();
        workers.into_iter().map(|w| w.join().unwrap()).collect()
    });
    let st = Racing.stats();
    let blocks: usize = held.iter().map(Vec::len).sum();
    assert_eq!(st.live_blocks, blocks);
    assert_eq!(st.live_granted_bytes, blocks * 48);
    assert!(
        st.live_granted_bytes <= LIMIT,
        "{} bytes over",
        st.live_granted_bytes - LIMIT
    );
    assert!(
        st.live_granted_bytes + 48 > LIMIT,
        "{} short",
        LIMIT - st.live_granted_bytes
    );
    assert!(
        st.peak_granted_bytes.unwrap() <= LIMIT,
        "peak {:?}",
        st.peak_granted_bytes
    );
    assert_eq!(st.budget_failures, (THREADS * 100) as u64);
    drop(held);
    Racing.set_budget(None, BudgetMode::Fail);
}

#[test]
fn a_warn_budget_keeps_the_lane_open_and_tells_its_hook_once_over() {
    use std::sync::atomic::{AtomicUsize, Ordering};
    static TOLD: AtomicUsize = AtomicUsize::new(0);
    fn hook(event: &tagalloc::BudgetEvent) {
        assert!(!event.refused);
        TOLD.fetch_add(1, Ordering::Relaxed);
    }
    const LIMIT: usize = 4 << 20;
    Watched::registration().budget().set_hook(hook);
    drop(ABox::new_in(0u8, Watched));
    Watched.set_budget(Some(LIMIT), BudgetMode::Warn);
    let mut held = Vec::new();
    // Up to half the limit: far, the lane open, the hook silent.
    while Watched.stats().live_granted_bytes < LIMIT / 2 {
        held.push(Watched.scope(|| Box::new([0u8; 128])));
    }
    assert!(Watched::registration().thread_cache_lane_open());
    assert_eq!(TOLD.load(Ordering::Relaxed), 0);
    // Over the limit: the hook hears of every allocation past it, none refused.
    while Watched.stats().live_granted_bytes < LIMIT + 64 * 1024 {
        held.push(Watched.scope(|| Box::new([0u8; 128])));
    }
    let over = (Watched.stats().live_granted_bytes - LIMIT) / 128;
    let told = TOLD.load(Ordering::Relaxed);
    assert!(
        told >= over && told <= over + 1,
        "told {told}, {over} allocations over"
    );
    assert_eq!(Watched.stats().budget_failures, 0);
    drop(held);
    Watched.set_budget(None, BudgetMode::Warn);
}
