//! `fork()` while other threads allocate: the child must be able to allocate and free,
//! and a tagged allocator's counters (kept in per-thread shards) must stay usable and exact
//! for what the child does: the threads the child lost hand their shards over.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread;
use tagalloc::{BlockAllocator, SystemAllocator};

tagalloc::allocator!(Tagged: child of SystemAllocator, "fork test");

#[global_allocator]
static GLOBAL: SystemAllocator = SystemAllocator::new();

/// In a forked child (this thread alone): blocks allocated and freed through `Tagged`, here
/// and on a new thread, move its figures by exactly what they were.
fn tagged_counts_are_exact_in_the_child() -> bool {
    let layout = std::alloc::Layout::from_size_align(200, 8).unwrap();
    let start = Tagged.stats();
    let blocks: Vec<_> = (0..10)
        .map(|_| Tagged.allocate_block(layout).unwrap())
        .collect();
    let granted: usize = blocks.iter().map(|b| b.size).sum();
    let held = Tagged.stats();
    /// Blocks handed to another thread to free.
    struct Blocks(Vec<tagalloc::schema::Allocation>);
    // SAFETY: the blocks are owned by whoever holds this value; the allocator is thread-safe.
    unsafe impl Send for Blocks {}
    let blocks = Blocks(blocks);
    let moved = thread::spawn(move || {
        let blocks = blocks;
        for b in blocks.0 {
            // SAFETY: allocated above with `layout`, freed once.
            unsafe { Tagged.deallocate_block(b.ptr, layout) };
        }
    })
    .join()
    .is_ok();
    let end = Tagged.stats();
    // The workers the child lost held at most 65 tagged blocks each (one more if caught
    // mid-call by the fork); their shards were handed over, not lost or doubled.
    moved
        && start.live_blocks <= 3 * 66
        && held.live_blocks == start.live_blocks + 10
        && held.live_granted_bytes == start.live_granted_bytes + granted
        && held.allocations == start.allocations + 10
        && end.live_blocks == start.live_blocks
        && end.live_granted_bytes == start.live_granted_bytes
        && end.frees == start.frees + 10
}

fn main() {
    let stop = Arc::new(AtomicBool::new(false));
    let workers: Vec<_> = (0..3)
        .map(|w| {
            let stop = Arc::clone(&stop);
            thread::spawn(move || {
                let mut keep = Vec::new();
                let mut tagged = Vec::new();
                let mut n = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    keep.push(vec![w as u8; (n as usize * 131) % 70_000]);
                    let mut t =
                        allocator_api2::vec::Vec::with_capacity_in(1 + n as usize % 3000, Tagged);
                    t.push(w as u8);
                    tagged.push(t);
                    if keep.len() > 64 {
                        keep.drain(..32);
                        tagged.drain(..32);
                    }
                    n += 1;
                }
                n
            })
        })
        .collect();

    for _ in 0..200 {
        // SAFETY: fork has no preconditions; the child only allocates, frees and exits.
        let pid = unsafe { libc::fork() };
        assert!(pid >= 0, "fork failed");
        if pid == 0 {
            let mut v: Vec<String> = (0..2000).map(|i| format!("child {i}")).collect();
            v.retain(|s| s.ends_with('7'));
            let big = vec![1u8; 3 << 20];
            let ok = v.len() == 200 && big.iter().all(|&b| b == 1);
            let t = thread::spawn(|| vec![0u64; 1000].len()).join().unwrap() == 1000;
            let tagged = tagged_counts_are_exact_in_the_child();
            // SAFETY: `_exit` ends the child without running the parent's atexit handlers.
            unsafe { libc::_exit(if ok && t && tagged { 0 } else { 1 }) };
        }
        let mut status = 0;
        // SAFETY: `pid` is our child; `status` is writable.
        let waited = unsafe { libc::waitpid(pid, &mut status, 0) };
        assert_eq!(waited, pid);
        assert!(
            libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0,
            "child failed: status {status}"
        );
    }
    stop.store(true, Ordering::Relaxed);
    let iterations: u64 = workers.into_iter().map(|w| w.join().unwrap()).sum();
    GLOBAL.validate().unwrap();
    println!("fork: ok (200 children; workers did {iterations} iterations meanwhile)");
}
