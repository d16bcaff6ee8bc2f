//! SystemAllocator as the global allocator of this whole test binary, under a multi-threaded
//! workload in which threads free each other's blocks. Has its own binary (and no harness)
//! so nothing else allocates while the counters are compared.

use std::collections::{BTreeMap, HashMap};
use std::sync::mpsc;
use std::thread;
use tagalloc::SystemAllocator;

#[global_allocator]
static GLOBAL: SystemAllocator = SystemAllocator::new();

/// Threads in a ring: each allocates blocks of many sizes and sends them to the next
/// thread, which checks their contents and frees them.
fn ring_workload(threads: usize, rounds: usize) -> u64 {
    let (senders, receivers): (Vec<_>, Vec<_>) =
        (0..threads).map(|_| mpsc::channel::<Vec<u8>>()).unzip();
    let mut handles = Vec::new();
    for (i, rx) in receivers.into_iter().enumerate() {
        let tx = senders[(i + 1) % threads].clone();
        handles.push(thread::spawn(move || {
            let mut checksum = 0u64;
            for r in 0..rounds {
                let size = [1, 24, 100, 513, 4000, 9000, 70_000, 1 << 20][(r + i) % 8];
                let fill = (r ^ i) as u8;
                tx.send(vec![fill; size]).unwrap();
                let got = rx.recv().unwrap();
                let first = got[0];
                assert!(
                    got.iter().all(|&b| b == first),
                    "contents changed in transit"
                );
                checksum += got.len() as u64;
            }
            drop(tx);
            // Drain what is still in flight.
            while let Ok(v) = rx.recv_timeout(std::time::Duration::from_millis(50)) {
                checksum += v.len() as u64;
            }
            checksum
        }));
    }
    drop(senders);
    handles.into_iter().map(|h| h.join().unwrap()).sum()
}

/// Collections and strings churned by several threads at once.
fn collections_workload(threads: usize) -> usize {
    let handles: Vec<_> = (0..threads)
        .map(|t| {
            thread::spawn(move || {
                let mut map = HashMap::new();
                let mut tree = BTreeMap::new();
                for i in 0..20_000usize {
                    map.insert(format!("key-{t}-{i}"), i);
                    tree.insert(i, vec![i as u8; i % 300]);
                    if i % 3 == 0 {
                        map.remove(&format!("key-{t}-{}", i / 2));
                        tree.remove(&(i / 2));
                    }
                }
                let mut s = String::new();
                for (k, _) in map.iter().take(1000) {
                    s.push_str(k);
                }
                map.len() + tree.len() + s.len()
            })
        })
        .collect();
    handles.into_iter().map(|h| h.join().unwrap()).sum()
}

fn main() {
    // Warm up what std initialises lazily (thread bookkeeping, stdout), then take the
    // baseline.
    thread::spawn(|| println!("global_threads: warm-up"))
        .join()
        .unwrap();
    let before = GLOBAL.heap_stats();

    let moved = ring_workload(4, 400);
    assert!(moved > 0);
    let churned = collections_workload(3);
    assert!(churned > 0);

    let after = GLOBAL.heap_stats();
    assert_eq!(
        (after.live_blocks, after.granted_bytes),
        (before.live_blocks, before.granted_bytes),
        "live counters must return to their starting values"
    );
    assert!(after.allocations > before.allocations + 100_000);
    assert_eq!(
        after.allocations - before.allocations,
        after.frees - before.frees
    );
    GLOBAL.validate().unwrap();
    GLOBAL.garbage_collect();
    let collected = GLOBAL.heap_stats();
    assert!(collected.held_bytes <= after.held_bytes);
    assert_eq!(collected.live_blocks, before.live_blocks);
    println!(
        "global_threads: ok ({} allocations, {} KiB held after garbage_collect)",
        after.allocations - before.allocations,
        collected.held_bytes / 1024
    );
}
