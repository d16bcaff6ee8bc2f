//! Tens of thousands of short threads: each allocates, frees some blocks of others and leaves
//! some of its own to be freed elsewhere, then exits. The heap must not grow, caches of exited
//! threads must be handed back, and the live counters must come back exactly.

use std::sync::{Arc, Mutex};
use std::thread;
use tagalloc::SystemAllocator;

#[global_allocator]
static GLOBAL: SystemAllocator = SystemAllocator::new();

fn round(threads: usize, shared: &Arc<Mutex<Vec<Box<[u8]>>>>) {
    let handles: Vec<_> = (0..threads)
        .map(|t| {
            let shared = Arc::clone(shared);
            thread::spawn(move || {
                let mut mine: Vec<Box<[u8]>> = (0..40)
                    .map(|i| vec![t as u8; 8 + (i * 97 + t) % 3000].into_boxed_slice())
                    .collect();
                // Free what other threads left behind, leave some of ours.
                let mut pool = shared.lock().unwrap();
                let theirs: Vec<_> = pool.drain(..).collect();
                pool.extend(mine.drain(..10));
                drop(pool);
                for b in theirs {
                    assert!(b.iter().all(|&x| x == b[0]));
                }
                mine.len()
            })
        })
        .collect();
    for h in handles {
        assert_eq!(h.join().unwrap(), 30);
    }
}

fn main() {
    let shared: Arc<Mutex<Vec<Box<[u8]>>>> = Arc::new(Mutex::new(Vec::new()));
    thread::spawn(|| println!("thread_churn: warm-up"))
        .join()
        .unwrap();
    round(8, &shared);
    shared.lock().unwrap().clear();
    let threads_before = GLOBAL.cached_threads();
    let before = GLOBAL.heap_stats();

    let total = 20_000;
    let batch = 16;
    let mut held_after_first_tenth = 0;
    for i in 0..total / batch {
        round(batch, &shared);
        if i == total / batch / 10 {
            held_after_first_tenth = GLOBAL.heap_stats().held_bytes;
        }
    }
    shared.lock().unwrap().clear();

    let after = GLOBAL.heap_stats();
    assert_eq!(
        GLOBAL.cached_threads(),
        threads_before,
        "exited threads left their caches registered"
    );
    assert_eq!(
        (after.live_blocks, after.granted_bytes),
        (before.live_blocks, before.granted_bytes),
        "live counters must return exactly"
    );
    assert!(
        after.held_bytes <= held_after_first_tenth + (8 << 20),
        "heap grew with thread count: {} -> {} bytes",
        held_after_first_tenth,
        after.held_bytes
    );
    GLOBAL.validate().unwrap();
    println!(
        "thread_churn: ok ({total} threads; held {} KiB after a tenth, {} KiB at the end)",
        held_after_first_tenth / 1024,
        after.held_bytes / 1024
    );
}
