//! Child counters under cross-thread frees: blocks allocated on some threads through a
//! child of a child are freed on others, and every counter of both children comes back to
//! exactly its start value; the peak is the live total reached, within the documented
//! per-thread tolerance of the sharded counters.

use allocator_api2::alloc::Allocator;
use std::alloc::Layout;
use std::ptr::NonNull;
use std::sync::{Barrier, mpsc};
use tagalloc::{BlockAllocator, Counters, SystemAllocator};

tagalloc::allocator!(Outer: child of SystemAllocator, "outer");
tagalloc::allocator!(Inner: child of Outer, "inner");
// Each test has its own allocators: tests in one binary run in parallel.
tagalloc::allocator!(Probe: child of SystemAllocator, "granted-size probe");

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
        let tolerance = THREADS * Counters::PEAK_TOLERANCE_PER_THREAD;
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
