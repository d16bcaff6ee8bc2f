//! Sampling the `SystemAllocator` as the global allocator: small allocations are charged to
//! each thread cache's countdown on the fast path, and only the allocation that exhausts it
//! is recorded. The weighted samples must estimate the true totals, on every thread, and
//! their frees must take the records out. A mode change must reach threads that are
//! already running.
#![allow(clippy::vec_box)] // one allocation per block is the point

mod common;

use std::sync::{Mutex, mpsc};
use std::thread;
use tagalloc::SystemAllocator;
use tagalloc::records::{self, RecordMode};

#[global_allocator]
static GLOBAL: SystemAllocator = SystemAllocator::new();

/// A requested size no other allocation of the test harness is likely to use.
const SIZE: usize = 232;
const BLOCKS: usize = 8000;

/// The record mode is process-wide: the tests take turns.
static TURN: Mutex<()> = Mutex::new(());

/// Sampled records of `SIZE`-byte requests: (count, estimated blocks).
fn sampled_of_size() -> (usize, f64) {
    let snapshot = records::snapshot();
    let mut ours = snapshot
        .records_of("SystemAllocator")
        .filter(|r| r.requested == SIZE);
    assert!(
        ours.all(|r| r.size == SIZE),
        "granted sizes of {SIZE}-byte requests"
    );
    common::sampled_records_of_size(SIZE)
}

fn allocate_blocks() -> Vec<Box<[u8; SIZE]>> {
    (0..BLOCKS).map(|i| Box::new([i as u8; SIZE])).collect()
}

#[test]
fn sampling_estimates_totals_and_reaches_running_threads() {
    let _turn = TURN.lock().unwrap();
    // A thread that starts (and registers its cache) while records are off.
    let (go_tx, go_rx) = mpsc::channel::<()>();
    let (done_tx, done_rx) = mpsc::channel::<Vec<Box<[u8; SIZE]>>>();
    let worker = thread::spawn(move || {
        let warm: Vec<u8> = vec![1; 64];
        drop(warm);
        go_rx.recv().unwrap();
        done_tx.send(allocate_blocks()).unwrap();
    });

    SystemAllocator::new().set_records(RecordMode::Sample {
        interval: 8192,
        frames: 0,
    });
    let mine = allocate_blocks();
    go_tx.send(()).unwrap();
    let theirs = done_rx.recv().unwrap();
    worker.join().unwrap();

    // p(232 B at 8 KiB) = 2.8 %: about 450 samples of 16,000 blocks.
    let (count, estimate) = sampled_of_size();
    let expected = (2 * BLOCKS) as f64;
    assert!(count > 200 && count < 800, "{count} samples");
    assert!(
        (estimate - expected).abs() / expected < 0.3,
        "estimated {estimate} blocks of {expected}"
    );

    // Frees take the sampled records out (the fast path defers to the sample filter).
    drop(mine);
    drop(theirs);
    assert_eq!(sampled_of_size().0, 0);

    // Records off again: nothing new is recorded, on this thread or another.
    SystemAllocator::new().set_records(RecordMode::Off);
    let again = allocate_blocks();
    let other = thread::spawn(allocate_blocks).join().unwrap();
    assert_eq!(sampled_of_size().0, 0);
    drop((again, other));
}

/// Records of every allocation, switched on while a thread is already running: that
/// thread's very next allocations are recorded.
#[test]
fn basic_records_reach_a_running_thread() {
    const BASIC_SIZE: usize = 344;
    let _turn = TURN.lock().unwrap();
    let (go_tx, go_rx) = mpsc::channel::<()>();
    let worker = thread::spawn(move || {
        drop(vec![1u8; 64]);
        go_rx.recv().unwrap();
        (0..100)
            .map(|_| Box::new([7u8; BASIC_SIZE]))
            .collect::<Vec<_>>()
    });
    let was = SystemAllocator::new().record_mode();
    SystemAllocator::new().set_records(RecordMode::Basic);
    go_tx.send(()).unwrap();
    let blocks = worker.join().unwrap();
    SystemAllocator::new().set_records(was);
    let count = records::snapshot()
        .records_of("SystemAllocator")
        .filter(|r| r.requested == BASIC_SIZE && !r.sampled)
        .count();
    assert_eq!(count, 100);
    drop(blocks);
}
