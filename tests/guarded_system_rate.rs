//! The `SystemAllocator` guarded at one allocation in ten, on threads that register after
//! the rate was set (their first countdowns are drawn as they register): about a tenth of
//! their allocations are guarded, and every block, guarded or not, is freed through the
//! global allocator's ordinary free path, which tells the two apart by address (ordinary
//! blocks lie above the guarded area). A process of its own: the rate is process-wide.

use std::num::NonZeroU32;
use tagalloc::SystemAllocator;

#[global_allocator]
static GLOBAL: SystemAllocator = SystemAllocator::new();

const THREADS: usize = 4;
const BLOCKS: usize = 2000;

#[test]
fn a_tenth_of_new_threads_blocks_are_guarded_and_all_come_back() {
    // Whatever std makes once, on this thread's first spawn, and keeps for good (about one
    // time in eight a block of it was drawn for guarding and stayed live): made before the
    // rate is set, so the live count below is the workers' blocks alone.
    std::thread::spawn(|| ()).join().expect("warm-up thread");
    GLOBAL.set_guarded(NonZeroU32::new(10));
    let before = tagalloc::guarded::stats();
    // Handles and results in arrays: a block this thread allocated now could be guarded
    // and still live when the figures are read.
    let workers: [std::thread::JoinHandle<usize>; THREADS] = std::array::from_fn(|t| {
        std::thread::spawn(move || {
            let fill = |i: usize| (i + t) as u8;
            let held: Vec<Box<[u8; 40]>> = (0..BLOCKS).map(|i| Box::new([fill(i); 40])).collect();
            let ours = held
                .iter()
                .filter(|b| tagalloc::guarded::is_guarded(b.as_ptr()))
                .count();
            let intact = held
                .iter()
                .enumerate()
                .all(|(i, b)| b.iter().all(|&x| x == fill(i)));
            assert!(intact, "a block's contents changed");
            drop(held);
            ours
        })
    });
    let guarded = workers.map(|h| h.join().expect("worker panicked"));
    let after = tagalloc::guarded::stats();
    for &ours in &guarded {
        // Mean 200 (one in ten); the bounds leave room for the draws' spread.
        assert!(
            (100..=350).contains(&ours),
            "{ours} of {BLOCKS} guarded: {guarded:?}"
        );
    }
    let total: usize = guarded.iter().sum();
    assert!(after.allocations - before.allocations >= total);
    // Every guarded block went back to the area (none was kept in a thread cache's bin).
    assert_eq!(
        after.live_blocks, before.live_blocks,
        "{before:?} -> {after:?}"
    );
    assert!(after.frees - before.frees >= total);
    GLOBAL.set_guarded(None);
}
