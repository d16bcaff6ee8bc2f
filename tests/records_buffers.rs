//! Basic records wait in per-thread buffers: these tests check that the buffers never lose,
//! duplicate or keep a record when blocks cross threads, when threads exit, and while
//! reports read the records concurrently.

use allocator_api2::vec::Vec as AVec;
use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering::*};
use std::sync::{Arc, mpsc};
use std::thread;
use tagalloc::records::{self, RecordTotals};
use tagalloc::{RecordMode, SystemAllocator};

tagalloc::allocator!(Buffered: child of SystemAllocator, "records buffers test");
tagalloc::allocator!(ShortLived: child of SystemAllocator, "records buffers short-lived threads");

fn totals_match(name: &str, stats: tagalloc::AllocatorStats, totals: RecordTotals) {
    assert_eq!(
        (totals.records, totals.bytes),
        (stats.live_blocks, stats.live_granted_bytes),
        "{name}: records {totals:?} against statistics {stats:?}"
    );
}

/// Producers allocate small blocks (addresses are reused at once), keep some, free some
/// themselves and send the rest to a consumer that frees them; a reporter snapshots all the
/// while. Every snapshot has each block at most once, and at the end the records are
/// exactly the blocks still held.
#[test]
fn cross_thread_frees_and_concurrent_reports_stay_exact() {
    Buffered.set_records(RecordMode::Basic);
    let stop = Arc::new(AtomicBool::new(false));
    // Snapshots taken so far: producers halfway through wait for the first, so that at
    // least one is taken under traffic however the threads are scheduled.
    let taken = Arc::new(AtomicUsize::new(0));
    let reporter = {
        let (stop, taken) = (Arc::clone(&stop), Arc::clone(&taken));
        thread::spawn(move || {
            let mut snapshots = 0;
            while !stop.load(Relaxed) {
                let snap = records::snapshot();
                let mine: Vec<usize> = snap.records_of("Buffered").map(|r| r.address).collect();
                let distinct: HashSet<usize> = mine.iter().copied().collect();
                assert_eq!(distinct.len(), mine.len(), "a block recorded twice");
                let _ = records::live_totals(Buffered::registration());
                snapshots += 1;
                taken.store(snapshots, Relaxed);
            }
            snapshots
        })
    };
    let (tx, rx) = mpsc::channel::<AVec<u8, Buffered>>();
    let consumer = thread::spawn(move || {
        let mut n = 0usize;
        for v in rx {
            drop(v);
            n += 1;
        }
        n
    });
    let producers: Vec<_> = (0..3)
        .map(|t| {
            let (tx, taken) = (tx.clone(), Arc::clone(&taken));
            thread::spawn(move || {
                let mut kept = Vec::new();
                let mut x = 0x9E37_79B9u64 + t;
                for i in 0..60_000usize {
                    if i == 30_000 {
                        while taken.load(Relaxed) == 0 {
                            thread::yield_now();
                        }
                    }
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    let mut v = AVec::with_capacity_in(8 + (x % 200) as usize, Buffered);
                    v.push(i as u8);
                    match x % 8 {
                        0 => kept.push(v),
                        1..=3 => tx.send(v).unwrap(),
                        4 if !kept.is_empty() => {
                            let k = (x >> 8) as usize % kept.len();
                            tx.send(kept.swap_remove(k)).unwrap();
                        }
                        _ => drop(v),
                    }
                    if kept.len() > 300 {
                        kept.truncate(100);
                    }
                }
                kept
            })
        })
        .collect();
    drop(tx);
    let held: Vec<AVec<u8, Buffered>> = producers
        .into_iter()
        .flat_map(|p| p.join().unwrap())
        .collect();
    consumer.join().unwrap();
    stop.store(true, Relaxed);
    assert!(reporter.join().unwrap() > 0);

    totals_match(
        "Buffered",
        Buffered.stats(),
        records::live_totals(Buffered::registration()),
    );
    let snap = records::snapshot();
    let mut recorded: Vec<usize> = snap.records_of("Buffered").map(|r| r.address).collect();
    let mut expected: Vec<usize> = held.iter().map(|v| v.as_ptr() as usize).collect();
    recorded.sort_unstable();
    expected.sort_unstable();
    assert_eq!(recorded, expected);
    drop(held);
    assert_eq!(records::live_totals(Buffered::registration()).records, 0);
}

/// Blocks allocated by threads that have exited keep their records (the exit flushes the
/// buffer), and the next threads reuse the buffers.
#[test]
fn records_outlive_their_threads_and_buffers_are_reused() {
    ShortLived.set_records(RecordMode::Basic);
    let mut held = Vec::new();
    for round in 0..200usize {
        let v = thread::spawn(move || {
            let mut keep = Vec::new();
            for i in 0..(round % 7) + 1 {
                let mut v: AVec<u8, ShortLived> = AVec::with_capacity_in(16 + i * 8, ShortLived);
                v.push(1);
                keep.push(v);
                drop(AVec::<u8, ShortLived>::with_capacity_in(32, ShortLived));
            }
            keep
        })
        .join()
        .unwrap();
        held.extend(v);
        if round % 3 == 0 {
            held.swap_remove(round % held.len());
        }
    }
    totals_match(
        "ShortLived",
        ShortLived.stats(),
        records::live_totals(ShortLived::registration()),
    );
    let snap = records::snapshot();
    assert_eq!(snap.records_of("ShortLived").count(), held.len());
    let site = snap
        .sites
        .iter()
        .find(|s| s.allocator == "ShortLived")
        .expect("a site for the short-lived threads");
    let allocated: usize = (0..200usize).map(|r| 2 * ((r % 7) + 1)).sum();
    assert_eq!(site.total_blocks, allocated as f64);
    assert_eq!(site.live_blocks, held.len() as f64);
    drop(held);
    assert_eq!(records::live_totals(ShortLived::registration()).records, 0);
}
