//! The thread-pool schema under real threads: cross-thread frees with exact counters and
//! peak, thousands of short-lived threads (pages of exited threads must be reused, not
//! leaked), and collections while other threads allocate.

use core::alloc::Layout;
use core::ptr::NonNull;
use std::alloc::System;
use std::sync::{Arc, Barrier, Mutex};
use tagalloc::schema::{PoolConfig, ThreadPoolSchema};

#[derive(Clone, Copy)]
struct Block(NonNull<u8>, Layout);
// SAFETY: each block is owned by one thread at a time.
unsafe impl Send for Block {}

fn alloc(pool: &ThreadPoolSchema<System>, layout: Layout, tag: u8) -> Block {
    let a = pool.allocate(layout).expect("out of memory");
    // SAFETY: a live block of `a.size` bytes.
    unsafe { a.ptr.as_ptr().write_bytes(tag, layout.size()) };
    Block(a.ptr, layout)
}

fn free(pool: &ThreadPoolSchema<System>, b: Block, tag: u8) {
    // SAFETY: the block is live and at least `b.1.size()` bytes long.
    let bytes = unsafe { core::slice::from_raw_parts(b.0.as_ptr(), b.1.size()) };
    assert!(bytes.iter().all(|&x| x == tag), "contents changed");
    // SAFETY: allocated by this pool with this layout, freed once.
    unsafe { pool.deallocate(b.0, b.1) };
}

#[test]
fn cross_thread_frees_return_every_counter_to_its_start_and_peak_is_right() {
    const THREADS: usize = 4;
    const PER_THREAD: usize = 2000;
    let pool = ThreadPoolSchema::new(System);
    let layout = Layout::from_size_align(48, 16).unwrap();
    let granted = pool.config().block_size(layout).unwrap();
    let everyone_allocated = Barrier::new(THREADS + 1);
    let checked = Barrier::new(THREADS + 1);
    let handoff: Vec<Mutex<Vec<Block>>> = (0..THREADS).map(|_| Mutex::new(Vec::new())).collect();
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..THREADS)
            .map(|t| {
                let (pool, handoff) = (&pool, &handoff);
                let (everyone_allocated, checked) = (&everyone_allocated, &checked);
                s.spawn(move || {
                    let mine: Vec<_> = (0..PER_THREAD).map(|_| alloc(pool, layout, 7)).collect();
                    *handoff[t].lock().unwrap() = mine;
                    everyone_allocated.wait();
                    checked.wait();
                    // Free the next thread's blocks: every free is a cross-thread free.
                    let theirs = std::mem::take(&mut *handoff[(t + 1) % THREADS].lock().unwrap());
                    theirs.into_iter().for_each(|b| free(pool, b, 7));
                })
            })
            .collect();
        everyone_allocated.wait();
        let st = pool.stats();
        let all = THREADS * PER_THREAD;
        assert_eq!(st.live_blocks, all);
        assert_eq!(st.granted_bytes, all * granted);
        assert_eq!(st.requested_bytes, all * layout.size());
        assert_eq!(st.peak_granted_bytes, all * granted, "{st:?}");
        checked.wait();
        handles.into_iter().for_each(|h| h.join().unwrap());
    });
    let st = pool.stats();
    let all = (THREADS * PER_THREAD) as u64;
    assert_eq!((st.allocations, st.frees), (all, all));
    assert_eq!(
        (st.live_blocks, st.granted_bytes, st.requested_bytes),
        (0, 0, 0)
    );
    // Never more than was live at once, give or take a page per heap.
    assert!(st.peak_granted_bytes <= all as usize * granted + st.thread_heaps * 4096);
    let mut pool = pool;
    pool.validate().unwrap();
    pool.garbage_collect();
    let st = pool.stats();
    assert_eq!((st.pages, st.free_pages), (0, 0), "{st:?}");
}

#[test]
fn two_thousand_short_threads_reuse_the_pages_of_exited_ones() {
    const THREADS: usize = 2000;
    const AT_ONCE: usize = 4;
    let pool = Arc::new(ThreadPoolSchema::with_config(
        System,
        PoolConfig::DEFAULT.with_name("short threads"),
    ));
    // Blocks each thread leaves behind for a later thread to free.
    let left: Arc<Mutex<Vec<Block>>> = Arc::default();
    let mut max_pages = 0;
    let mut max_heaps = 0;
    for batch in 0..THREADS / AT_ONCE {
        let handles: Vec<_> = (0..AT_ONCE)
            .map(|i| {
                let (pool, left) = (Arc::clone(&pool), Arc::clone(&left));
                std::thread::spawn(move || {
                    let tag = 3u8;
                    let size = 8 + 8 * ((batch * AT_ONCE + i) % 64);
                    let layout = Layout::from_size_align(size, 8).unwrap();
                    let mut mine: Vec<_> = (0..16).map(|_| alloc(&pool, layout, tag)).collect();
                    let leave = mine.split_off(8);
                    mine.into_iter().for_each(|b| free(&pool, b, tag));
                    // Free what earlier threads left (often blocks of exited threads'
                    // pages), and leave ours.
                    let theirs = std::mem::replace(&mut *left.lock().unwrap(), leave);
                    theirs.into_iter().for_each(|b| free(&pool, b, tag));
                })
            })
            .collect();
        // `join` returns after the thread's thread-locals are destroyed.
        handles.into_iter().for_each(|h| h.join().unwrap());
        let st = pool.stats();
        max_pages = max_pages.max(st.pages);
        max_heaps = max_heaps.max(st.thread_heaps);
    }
    // Heaps are adopted by new threads: bounded by the threads alive at once (+ fallback).
    assert!(max_heaps <= AT_ONCE + 1, "{max_heaps} heaps");
    // Memory does not grow with the number of threads: a handful of pages per heap and
    // class in use, nowhere near one per thread.
    assert!(max_pages <= 64, "{max_pages} pages held at most");
    let last = std::mem::take(&mut *left.lock().unwrap());
    last.into_iter().for_each(|b| free(&pool, b, 3));
    let mut pool = Arc::into_inner(pool).unwrap();
    let st = pool.stats();
    assert_eq!((st.live_blocks, st.granted_bytes), (0, 0));
    assert_eq!(st.allocations, THREADS as u64 * 16);
    pool.validate().unwrap();
    pool.garbage_collect();
    assert_eq!(pool.stats().pages, 0);
}

#[test]
fn garbage_collect_is_safe_while_other_threads_allocate_and_free_across() {
    const WORKERS: usize = 3;
    const ROUNDS: usize = 3000;
    let pool = ThreadPoolSchema::with_config(System, PoolConfig::new(1024, 8, 256).unwrap());
    let shared: Mutex<Vec<Block>> = Mutex::new(Vec::new());
    let stop = std::sync::atomic::AtomicBool::new(false);
    // Collections done so far. Workers halfway through wait for the first, so that at
    // least one runs while they hold blocks (on 2 cores the collector thread could
    // otherwise start only after the workers finished: a stress loop saw it once).
    let collections = std::sync::atomic::AtomicUsize::new(0);
    std::thread::scope(|s| {
        let workers: Vec<_> = (0..WORKERS)
            .map(|t| {
                let (pool, shared, collections) = (&pool, &shared, &collections);
                s.spawn(move || {
                    for r in 0..ROUNDS {
                        if r == ROUNDS / 2 {
                            while collections.load(std::sync::atomic::Ordering::Relaxed) == 0 {
                                std::thread::yield_now();
                            }
                        }
                        let layout = Layout::from_size_align(8 * (1 + (r + t) % 32), 8).unwrap();
                        let batch: Vec<_> = (0..8).map(|_| alloc(pool, layout, 9)).collect();
                        // Swap half with whatever another thread left: cross-thread frees.
                        let mut batch = batch;
                        let give = batch.split_off(4);
                        let take = std::mem::replace(&mut *shared.lock().unwrap(), give);
                        batch.into_iter().chain(take).for_each(|b| free(pool, b, 9));
                    }
                })
            })
            .collect();
        let collector = s.spawn(|| {
            let mut n = 0;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                pool.garbage_collect();
                let _ = pool.stats();
                n += 1;
                collections.store(n, std::sync::atomic::Ordering::Relaxed);
                std::thread::yield_now();
            }
            n
        });
        workers.into_iter().for_each(|w| w.join().unwrap());
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        assert!(collector.join().unwrap() > 0);
    });
    let last = std::mem::take(&mut *shared.lock().unwrap());
    last.into_iter().for_each(|b| free(&pool, b, 9));
    let mut pool = pool;
    let st = pool.stats();
    let all = (WORKERS * ROUNDS * 8) as u64;
    assert_eq!((st.allocations, st.frees), (all, all));
    assert_eq!(
        (st.live_blocks, st.granted_bytes, st.requested_bytes),
        (0, 0, 0)
    );
    pool.validate().unwrap();
    pool.garbage_collect();
    assert_eq!(pool.stats().pages, 0);
    pool.validate().unwrap();
}
