//! Child counters under cross-thread frees: blocks allocated on some threads through a
//! child of a child are freed on others, and every counter of both children comes back to
//! exactly its start value; the peak is the live total reached, within the documented
//! per-thread tolerance of the sharded counters (and, for children with a lane of the thread
//! caches, the tolerance per size class).

use allocator_api2::alloc::Allocator;
use std::alloc::Layout;
use std::ptr::NonNull;
use std::sync::{Barrier, mpsc};
use tagalloc::{BlockAllocator, Counters, SystemAllocator};

tagalloc::allocator!(Outer: child of SystemAllocator, "outer");
tagalloc::allocator!(Inner: child of Outer, "inner");
// Each test has its own allocators: tests in one binary run in parallel.
tagalloc::allocator!(Probe: child of SystemAllocator, "granted-size probe");
tagalloc::allocator!(Racer: child of SystemAllocator, "first calls race");
tagalloc::allocator!(RacerChild: child of Racer, "first calls race, grandchild");
tagalloc::allocator!(Bulky: child of SystemAllocator, "large-only threads");
tagalloc::allocator!(BulkyChild: child of Bulky, "large-only threads, grandchild");
tagalloc::allocator!(Staging: child of SystemAllocator, "big staging blocks");
tagalloc::allocator!(StagingChild: child of Staging, "big staging blocks, grandchild");

const THREADS: usize = 4;
const PER_THREAD: usize = 2_000;

/// A block in flight between threads.
struct Block(NonNull<u8>, Layout);
// SAFETY: the block is owned by whoever holds this value; the allocator is thread-safe.
unsafe impl Send for Block {}

fn layout_for(thread: usize, i: usize) -> Layout {
    // Small classes, class boundaries and large blocks, several alignments.
    let sizes = [1, 8, 24, 100, 512, 513, 4000, 5000, 70_000];
    let size = sizes[(thread * 7 + i) % sizes.len()] + i % 3;
    Layout::from_size_align(size, 1 << (i % 6)).unwrap()
}

#[test]
fn cross_thread_frees_return_every_counter_to_its_start() {
    let inner_start = Inner.stats();
    let outer_start = Outer.stats();
    assert_eq!(inner_start.live_blocks, 0);

    let barrier = Barrier::new(THREADS);
    let (senders, receivers): (Vec<_>, Vec<_>) =
        (0..THREADS).map(|_| mpsc::channel::<Block>()).unzip();
    let granted_per_thread: Vec<usize> = std::thread::scope(|s| {
        let handles: Vec<_> = receivers
            .into_iter()
            .enumerate()
            .map(|(t, rx)| {
                let to_next = senders[(t + 1) % THREADS].clone();
                let barrier = &barrier;
                s.spawn(move || {
                    let mut granted = 0;
                    let mut mine = Vec::with_capacity(PER_THREAD);
                    for i in 0..PER_THREAD {
                        let layout = layout_for(t, i);
                        let block = Inner.allocate(layout).unwrap();
                        assert!(block.len() >= layout.size());
                        // SAFETY: the block holds at least `layout.size()` bytes.
                        unsafe {
                            block
                                .cast::<u8>()
                                .as_ptr()
                                .write_bytes(t as u8, layout.size())
                        };
                        granted += block.len();
                        mine.push(Block(block.cast(), layout));
                    }
                    // Nothing is freed before every thread has allocated everything.
                    barrier.wait();
                    for b in mine {
                        to_next.send(b).unwrap();
                    }
                    drop(to_next);
                    barrier.wait();
                    // Free what the previous thread allocated.
                    for Block(ptr, layout) in rx.iter().take(PER_THREAD) {
                        // SAFETY: allocated by `Inner` with `layout`, freed once.
                        unsafe { Inner.deallocate(ptr, layout) };
                    }
                    granted
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    drop(senders);
    let total_granted: usize = granted_per_thread.iter().sum();
    let total_blocks = (THREADS * PER_THREAD) as u64;

    // Children with a lane of the thread caches have a tolerance per small size class too:
    // at most one per distinct small request at alignment ≤ 8.
    let lane_classes = if Inner::registration().has_thread_cache_lane() {
        let mut small: Vec<usize> = (0..THREADS)
            .flat_map(|t| (0..PER_THREAD).map(move |i| layout_for(t, i)))
            .filter(|l| l.size() <= 4096 && l.align() <= 8)
            .map(|l| l.size())
            .collect();
        small.sort_unstable();
        small.dedup();
        small.len()
    } else {
        0
    };
    for (now, start) in [(Inner.stats(), inner_start), (Outer.stats(), outer_start)] {
        assert_eq!(now.live_granted_bytes, start.live_granted_bytes);
        assert_eq!(now.live_requested_bytes, start.live_requested_bytes);
        assert_eq!(now.live_blocks, start.live_blocks);
        assert_eq!(now.allocations - start.allocations, total_blocks);
        assert_eq!(now.frees - start.frees, total_blocks);
        // Every block was live at the barrier and none before it was freed: the true peak
        // is the sum of granted sizes. Each allocating thread may have held up to the
        // tolerance unpublished at that moment, and no thread held pending frees before it
        // (which is what could push the recorded peak above the true one).
        let peak = now.peak_granted_bytes.unwrap();
        let tolerance = THREADS
            * (Counters::PEAK_TOLERANCE_PER_THREAD
                + lane_classes * Counters::PEAK_TOLERANCE_PER_THREAD_AND_CLASS);
        assert!(
            peak <= total_granted && peak >= total_granted - tolerance,
            "peak {peak}, true peak {total_granted}, tolerance {tolerance}"
        );
        assert_eq!(now.reserved_bytes, now.live_granted_bytes);
    }
}

#[test]
fn granted_size_is_the_parents_usable_size() {
    // SystemAllocator's size class for 20 bytes is larger than 20.
    let layout = Layout::from_size_align(20, 8).unwrap();
    let start = Probe::registration().counters().live_granted_bytes();
    let block = <Probe as BlockAllocator>::allocate_block(Probe, layout).unwrap();
    // SAFETY: the block is live with `layout`.
    let usable = unsafe { SystemAllocator::new().usable_size(block.ptr, layout) };
    assert_eq!(block.size, usable);
    assert!(block.size >= 20);
    assert_eq!(
        Probe::registration().counters().live_granted_bytes() - start,
        usable
    );
    // SAFETY: allocated above with `layout`.
    unsafe { Probe.deallocate_block(block.ptr, layout) };
}

/// The figures that must come back exactly: everything but the peak.
fn exact(s: tagalloc::AllocatorStats) -> (usize, Option<usize>, usize) {
    (s.live_granted_bytes, s.live_requested_bytes, s.live_blocks)
}

#[test]
fn first_calls_racing_on_many_threads_register_the_child_before_counting() {
    // The fast path needs the child's shard slot, which is only claimed once the child
    // (and its parent) are in the registry: racing first calls all end up counted, and the
    // registry has parent before child.
    assert!(!RacerChild::registration().is_registered());
    let barrier = Barrier::new(THREADS);
    let layout = Layout::from_size_align(24, 8).unwrap();
    let (to_main, blocks) = mpsc::channel::<(Block, bool)>();
    std::thread::scope(|s| {
        for t in 0..THREADS {
            let (barrier, to_main) = (&barrier, to_main.clone());
            s.spawn(move || {
                barrier.wait();
                for i in 0..100 {
                    let in_child = (t + i) % 2 == 0;
                    let b = if in_child {
                        RacerChild.allocate(layout)
                    } else {
                        Racer.allocate(layout)
                    };
                    to_main
                        .send((Block(b.unwrap().cast(), layout), in_child))
                        .unwrap();
                }
            });
        }
    });
    drop(to_main);
    let (parent, child) = (Racer::registration(), RacerChild::registration());
    assert!(parent.is_registered() && child.is_registered());
    assert!(parent.index().unwrap() < child.index().unwrap());
    let (c, p) = (RacerChild.stats(), Racer.stats());
    let n = THREADS * 100;
    assert_eq!((c.allocations, c.live_blocks), (n as u64 / 2, n / 2));
    assert_eq!((p.allocations, p.live_blocks), (n as u64, n));
    assert_eq!(p.live_requested_bytes, Some(n * 24));
    // Freed here, on a thread that allocated none of them.
    for (Block(ptr, layout), in_child) in blocks.iter() {
        // SAFETY: each block is live with `layout`, from the allocator `in_child` names.
        unsafe {
            if in_child {
                RacerChild.deallocate(ptr, layout);
            } else {
                Racer.deallocate(ptr, layout);
            }
        }
    }
    for s in [RacerChild.stats(), Racer.stats()] {
        assert_eq!(exact(s), (0, Some(0), 0));
    }
}

#[test]
fn threads_that_only_allocate_large_blocks_count_exactly() {
    // A thread whose calls are all large never fills a thread-cache bin, so its cache is
    // registered by the child's counting itself (the slow path), on the thread's first call.
    // Blocks outlive their threads and are freed on the main thread.
    let (outer_start, inner_start) = (exact(Bulky.stats()), exact(BulkyChild.stats()));
    let calls_start = (BulkyChild.stats().allocations, Bulky.stats().allocations);
    let blocks: Vec<Block> = std::thread::scope(|s| {
        let threads: Vec<_> = (0..THREADS)
            .map(|t| {
                s.spawn(move || {
                    (0..20)
                        .map(|i| {
                            let layout = Layout::from_size_align(8192 + t * 100 + i, 16).unwrap();
                            let b = if i % 2 == 0 {
                                BulkyChild.allocate(layout)
                            } else {
                                Bulky.allocate(layout)
                            };
                            Block(b.unwrap().cast(), layout)
                        })
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        // `join` waits for the threads' exit hooks: their shards are retired.
        threads
            .into_iter()
            .flat_map(|h| h.join().unwrap())
            .collect()
    });
    let (inner, outer) = (BulkyChild.stats(), Bulky.stats());
    assert_eq!(inner.allocations - calls_start.0, (THREADS * 10) as u64);
    assert_eq!(outer.allocations - calls_start.1, (THREADS * 20) as u64);
    assert_eq!(inner.live_blocks - inner_start.2, THREADS * 10);
    assert_eq!(outer.live_blocks - outer_start.2, THREADS * 20);
    let requested: usize = blocks.iter().map(|b| b.1.size()).sum();
    assert_eq!(
        outer.live_requested_bytes.unwrap() - outer_start.1.unwrap(),
        requested
    );
    for (i, Block(ptr, layout)) in blocks.into_iter().enumerate() {
        // SAFETY: allocated above with `layout`, by the allocator chosen the same way.
        unsafe {
            if i % 2 == 0 {
                BulkyChild.deallocate(ptr, layout);
            } else {
                Bulky.deallocate(ptr, layout);
            }
        }
    }
    assert_eq!(exact(BulkyChild.stats()), inner_start);
    assert_eq!(exact(Bulky.stats()), outer_start);
}

#[test]
fn held_frees_of_big_blocks_neither_inflate_the_peak_nor_lose_a_count() {
    // A thread frees a big block (more than `PEAK_OVERSHOOT_PER_THREAD`) and holds the
    // free back, so that its next allocation of such a block cancels it. Meanwhile another
    // thread's allocation takes the shared live figure, which still counts the freed block,
    // past the peak: the peak must be settled first, not raised by the freed block.
    const HELD: usize = 3 << 20;
    const OTHER: usize = 2 << 20;
    const { assert!(HELD > Counters::PEAK_OVERSHOOT_PER_THREAD) };
    let (staging_start, child_start) = (exact(Staging.stats()), exact(StagingChild.stats()));
    assert_eq!((staging_start.0, child_start.0), (0, 0));
    let step = &Barrier::new(2);
    let layout = |size| Layout::from_size_align(size, 64).unwrap();
    let (held_granted, peak_meanwhile) = std::thread::scope(|s| {
        let holder = s.spawn(move || {
            // Ping-pong first (each free held, each allocation cancelling it), then hold.
            let mut granted = 0;
            for _ in 0..50 {
                let b = StagingChild.allocate(layout(HELD)).unwrap();
                granted = b.len();
                // SAFETY: just allocated with this layout; freed once.
                unsafe { StagingChild.deallocate(b.cast(), layout(HELD)) };
            }
            step.wait();
            step.wait();
            granted
        });
        step.wait();
        let other = StagingChild.allocate(layout(OTHER)).unwrap();
        let peak = (
            Staging.stats().peak_granted_bytes.unwrap(),
            StagingChild.stats().peak_granted_bytes.unwrap(),
        );
        // SAFETY: just allocated with this layout; freed once.
        unsafe { StagingChild.deallocate(other.cast(), layout(OTHER)) };
        step.wait();
        (holder.join().unwrap(), peak)
    });
    // The true live total never passed one held block (the other block is smaller, and was
    // allocated after the held one was freed): without settling, the peak would read both.
    assert!(held_granted >= HELD);
    assert_eq!(peak_meanwhile, (held_granted, held_granted));
    for (st, start) in [
        (Staging.stats(), staging_start),
        (StagingChild.stats(), child_start),
    ] {
        assert_eq!(exact(st), start);
        assert_eq!(st.allocations, 51);
        assert_eq!(st.frees, 51);
        assert_eq!(st.peak_granted_bytes, Some(held_granted));
    }
}
