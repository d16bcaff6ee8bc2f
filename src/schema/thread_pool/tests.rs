//! Unit tests of the thread-pool schema on `std::alloc::System` pages, small enough for Miri
//! (thread-local destructors included).

use super::*;
use std::alloc::System;
use std::sync::mpsc;

fn layout(size: usize, align: usize) -> Layout {
    Layout::from_size_align(size, align).unwrap()
}

/// A block handed to another thread in a test.
#[derive(Clone, Copy)]
struct SendBlock(NonNull<u8>, Layout, u8);
// SAFETY: the tests hand each block to exactly one other thread.
unsafe impl Send for SendBlock {}

fn fill(b: SendBlock) {
    for i in 0..b.1.size() {
        // SAFETY: a live block of at least `b.1.size()` bytes.
        unsafe { b.0.as_ptr().add(i).write(b.2.wrapping_add(i as u8)) };
    }
}

fn check(b: SendBlock) {
    for i in 0..b.1.size() {
        // SAFETY: as above.
        let v = unsafe { *b.0.as_ptr().add(i) };
        assert_eq!(v, b.2.wrapping_add(i as u8));
    }
}

fn alloc(pool: &ThreadPoolSchema<System>, l: Layout, seed: u8) -> SendBlock {
    let a = pool.allocate(l).unwrap();
    assert_eq!(a.ptr.as_ptr().addr() % l.align(), 0);
    let b = SendBlock(a.ptr, l, seed);
    fill(b);
    b
}

fn free(pool: &ThreadPoolSchema<System>, b: SendBlock) {
    check(b);
    // SAFETY: every test frees each block it allocated exactly once, with its layout.
    unsafe { pool.deallocate(b.0, b.1) };
}

fn assert_all_freed(pool: &mut ThreadPoolSchema<System>, allocations: u64) {
    let st = pool.stats();
    assert_eq!(
        (st.live_blocks, st.granted_bytes, st.requested_bytes),
        (0, 0, 0),
        "{st:?}"
    );
    assert_eq!((st.allocations, st.frees), (allocations, allocations));
    pool.validate().unwrap();
}

#[test]
fn miri_thread_pool_round_trip_on_one_thread() {
    let mut pool = ThreadPoolSchema::new(System);
    assert_eq!(pool.stats(), PoolStats::default());
    let n = if cfg!(miri) { 60 } else { 2000 };
    let blocks: Vec<_> = (0..n)
        .map(|i| alloc(&pool, layout(1 + (i * 13) % 512, 1 << (i % 5)), i as u8))
        .collect();
    let st = pool.stats();
    assert_eq!(st.live_blocks, n);
    assert_eq!(
        st.requested_bytes,
        blocks.iter().map(|b| b.1.size()).sum::<usize>()
    );
    assert_eq!(
        st.thread_heaps, 2,
        "this thread's heap and the fallback heap"
    );
    assert!(st.bookkeeping_bytes > 0);
    assert_eq!(st.reserved_bytes, st.pages * 4096 + st.bookkeeping_bytes);
    pool.validate().unwrap();
    for b in blocks {
        free(&pool, b);
    }
    assert_all_freed(&mut pool, n as u64);
    pool.garbage_collect();
    let st = pool.stats();
    assert_eq!((st.pages, st.free_pages), (0, 0));
    assert!(st.peak_granted_bytes > 0);
    pool.validate().unwrap();
}

#[test]
fn miri_out_of_range_requests_get_none() {
    let config = PoolConfig::new(1024, 64, 256).unwrap();
    let pool = ThreadPoolSchema::with_config(System, config.with_name("thread-refusals"));
    crate::messages::capture::start();
    assert!(pool.allocate(layout(257, 8)).is_none());
    assert!(pool.allocate(layout(8, 512)).is_none());
    #[cfg(not(miri))]
    assert!(crate::messages::capture::captured(
        "tagalloc: pool 'thread-refusals': request of 257 bytes aligned to 8 refused: this \
         pool serves 64..=256 bytes"
    ));
    // Refusals create nothing.
    assert_eq!(pool.stats(), PoolStats::default());
    let a = pool.allocate(layout(1, 1)).unwrap();
    assert_eq!(a.size, 64);
    // SAFETY: allocated above.
    unsafe { pool.deallocate(a.ptr, layout(1, 1)) };
}

#[test]
fn miri_cross_thread_frees_keep_counters_exact() {
    let mut pool = ThreadPoolSchema::new(System);
    let n = if cfg!(miri) { 40 } else { 3000 };
    let (tx, rx) = mpsc::channel::<SendBlock>();
    std::thread::scope(|s| {
        let pool = &pool;
        let producer = s.spawn(move || {
            for i in 0..n {
                tx.send(alloc(pool, layout(8 + i % 200, 8), i as u8))
                    .unwrap();
            }
        });
        let consumer = s.spawn(move || {
            for b in rx {
                free(pool, b);
            }
        });
        producer.join().unwrap();
        consumer.join().unwrap();
    });
    assert_all_freed(&mut pool, n as u64);
    // The producer's heap was abandoned at its exit and holds only empty pages or
    // remote frees; a collection gives everything back.
    pool.garbage_collect();
    assert_eq!(pool.stats().pages, 0);
    pool.validate().unwrap();
}

#[test]
fn miri_owner_takes_back_remote_frees_when_it_runs_out() {
    let mut pool = ThreadPoolSchema::new(System);
    let l = layout(256, 8);
    let blocks: Vec<_> = (0..30).map(|i| alloc(&pool, l, i)).collect();
    let pages = pool.stats().pages;
    std::thread::scope(|s| {
        let pool = &pool;
        s.spawn(move || blocks.into_iter().for_each(|b| free(pool, b)))
            .join()
            .unwrap();
    });
    // Those 30 slots wait on this thread's remote stack; allocating 30 again reuses them
    // (the first refill drains the stack) instead of growing.
    let again: Vec<_> = (0..30).map(|i| alloc(&pool, l, i)).collect();
    assert_eq!(pool.stats().pages, pages);
    for b in again {
        free(&pool, b);
    }
    assert_all_freed(&mut pool, 60);
}

#[test]
fn miri_exited_threads_heaps_are_adopted_not_leaked() {
    let mut pool = ThreadPoolSchema::new(System);
    let threads = if cfg!(miri) { 6 } else { 200 };
    let mut left: Vec<SendBlock> = Vec::new();
    for t in 0..threads {
        let pool = &pool;
        let from_last = std::mem::take(&mut left);
        left = std::thread::scope(|s| {
            s.spawn(move || {
                // Free what the previous thread left, allocate some, leave half.
                from_last.into_iter().for_each(|b| free(pool, b));
                let mut mine: Vec<_> = (0..8)
                    .map(|i| alloc(pool, layout(24, 8), t as u8 ^ i))
                    .collect();
                let keep = mine.split_off(4);
                mine.into_iter().for_each(|b| free(pool, b));
                keep
            })
            .join()
            .unwrap()
        });
    }
    let st = pool.stats();
    // One heap for the threads (each adopted the previous one's) and the fallback heap.
    assert_eq!(st.thread_heaps, 2, "{st:?}");
    assert!(st.pages <= 2, "{st:?}");
    left.into_iter().for_each(|b| free(&pool, b));
    assert_all_freed(&mut pool, threads as u64 * 8);
    pool.garbage_collect();
    assert_eq!(pool.stats().pages, 0);
}

#[test]
fn miri_fallback_heap_serves_threads_without_storage() {
    let mut pool = ThreadPoolSchema::new(System);
    let core = pool.core().unwrap() as *const Core;
    // SAFETY: the core lives as long as the pool, which outlives this test's uses.
    let core = unsafe { &*core };
    let l = layout(40, 8);
    // Allocate on the fallback heap, free on a thread with a heap (a remote free into the
    // fallback heap), and the other way round.
    let a = pool
        .allocate_fallback(core, pool.config.class_of(l).unwrap(), l)
        .unwrap();
    let b = pool.allocate(l).unwrap();
    // SAFETY: allocated above with `l`, freed once each.
    unsafe {
        pool.deallocate(a.ptr, l);
        let page = page_of(b.ptr.as_ptr(), 4096);
        pool.deallocate_fallback(core, page, b.ptr.as_ptr(), 40, l);
    }
    assert_all_freed(&mut pool, 2);
    // The fallback heap takes its remote free back on its next allocation.
    let c = pool.allocate_fallback(core, 4, l).unwrap();
    assert_eq!(c.ptr, a.ptr);
    // SAFETY: as above.
    unsafe { pool.deallocate_fallback(core, page_of(c.ptr.as_ptr(), 4096), c.ptr.as_ptr(), 40, l) };
    assert_all_freed(&mut pool, 3);
    pool.garbage_collect();
    assert_eq!(pool.stats().pages, 0);
}

#[test]
fn miri_thread_local_destructors_may_use_the_pool_after_its_table_is_gone() {
    use std::cell::Cell;
    static POOL: ThreadPoolSchema<System> = ThreadPoolSchema::new(System);
    static USED_FALLBACK: core::sync::atomic::AtomicBool =
        core::sync::atomic::AtomicBool::new(false);

    struct Late(Cell<u8>);
    impl Drop for Late {
        fn drop(&mut self) {
            let core = POOL.core().unwrap();
            if matches!(registry::lookup(core.slot, core.uid), Lookup::Gone) {
                USED_FALLBACK.store(true, Relaxed);
            }
            let l = layout(16, 8);
            let a = POOL.allocate(l).unwrap();
            // SAFETY: allocated just above.
            unsafe { POOL.deallocate(a.ptr, l) };
        }
    }
    thread_local!(static LATE: Late = const { Late(Cell::new(0)) });

    std::thread::spawn(|| {
        // Registered before the pool's table, so destroyed after it (destructors run in
        // reverse order of registration).
        LATE.with(|l| l.0.set(1));
        let l = layout(16, 8);
        let a = POOL.allocate(l).unwrap();
        // SAFETY: allocated just above.
        unsafe { POOL.deallocate(a.ptr, l) };
    })
    .join()
    .unwrap();
    let st = POOL.stats();
    assert_eq!((st.allocations, st.frees, st.live_blocks), (2, 2, 0));
    assert!(
        USED_FALLBACK.load(Relaxed),
        "the late destructor ran with the table gone"
    );
}

#[test]
fn miri_schemas_alive_together_have_separate_heaps() {
    let mut a = ThreadPoolSchema::new(System);
    let mut b = ThreadPoolSchema::with_config(System, PoolConfig::new(2048, 16, 256).unwrap());
    let l = layout(48, 16);
    let xs: Vec<_> = (0..10).map(|i| alloc(&a, l, i)).collect();
    let ys: Vec<_> = (0..10).map(|i| alloc(&b, l, i)).collect();
    std::thread::scope(|s| {
        let (ra, rb) = (&a, &b);
        s.spawn(move || {
            xs.into_iter().for_each(|x| free(ra, x));
            ys.into_iter().for_each(|y| free(rb, y));
        })
        .join()
        .unwrap();
    });
    assert_all_freed(&mut a, 10);
    assert_all_freed(&mut b, 10);
    assert_ne!(a.core().unwrap().slot, b.core().unwrap().slot);
}

#[test]
fn miri_garbage_collect_while_other_threads_allocate() {
    let mut pool = ThreadPoolSchema::new(System);
    let rounds = if cfg!(miri) { 10 } else { 2000 };
    std::thread::scope(|s| {
        let pool = &pool;
        let workers: Vec<_> = (0..2)
            .map(|t| {
                s.spawn(move || {
                    for r in 0..rounds {
                        let bs: Vec<_> = (0..6)
                            .map(|i| alloc(pool, layout(8 + 64 * ((r + i) % 8), 8), (t + i) as u8))
                            .collect();
                        bs.into_iter().for_each(|b| free(pool, b));
                    }
                })
            })
            .collect();
        for _ in 0..rounds / 2 {
            pool.garbage_collect();
            std::thread::yield_now();
        }
        workers.into_iter().for_each(|w| w.join().unwrap());
    });
    assert_all_freed(&mut pool, 2 * 6 * rounds as u64);
    pool.garbage_collect();
    assert_eq!(pool.stats().pages, 0);
    pool.validate().unwrap();
}

#[test]
fn miri_empty_pages_of_one_thread_serve_another() {
    let mut pool = ThreadPoolSchema::with_config(System, PoolConfig::new(1024, 64, 256).unwrap());
    let l = layout(256, 8);
    // Three 256-byte blocks per 1 KiB page: 192 blocks fill 64 pages.
    let blocks: Vec<_> = (0..192).map(|i| alloc(&pool, l, i as u8)).collect();
    let pages = pool.stats().pages;
    assert_eq!(pages, 64);
    blocks.into_iter().for_each(|b| free(&pool, b));
    // The heap's bin keeps at most 64 freed blocks (16 KiB) and gives the older half back
    // each time it overflows, so at least 128 blocks went back to their pages. The heap
    // keeps its class's last page and a couple of empty ones; the rest are shared.
    let st = pool.stats();
    assert!(st.free_pages >= 128 / 3 - 3, "{st:?}");
    std::thread::scope(|s| {
        let pool = &pool;
        s.spawn(move || {
            let mine: Vec<_> = (0..12).map(|i| alloc(pool, layout(64, 8), i)).collect();
            mine.into_iter().for_each(|b| free(pool, b));
        })
        .join()
        .unwrap();
    });
    // The other thread used shared pages instead of asking the parent.
    assert_eq!(pool.stats().pages, pages);
    assert_all_freed(&mut pool, 192 + 12);
}
