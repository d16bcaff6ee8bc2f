//! A child that samples its own allocations keeps its lane of the thread caches open: its
//! lane's per-class countdowns pick the sampled blocks, recorded for the child (and for the
//! `SystemAllocator` when it samples too, each with an unbiased weight); a sampled block's
//! records leave when it is freed; the child's figures stay exact, through its handle and
//! through a scoped tag. The records mode is process-wide: one test in this binary.

use std::alloc::Layout;
use std::ptr::NonNull;
use tagalloc::records::{self, RecordMode};
use tagalloc::{BlockAllocator, SystemAllocator};

#[global_allocator]
static GLOBAL: SystemAllocator = SystemAllocator::new();

tagalloc::allocator!(Sampler: child of SystemAllocator, "samples its own blocks");

/// Requested sizes nothing else in this binary uses.
const SIZE: usize = 232;
const SCOPED_SIZE: usize = 344;
const BLOCKS: usize = 16_000;

/// The sampled records of `allocator` for requests of `size` bytes: (count, estimated blocks).
fn sampled(allocator: &str, size: usize) -> (usize, f64) {
    let snapshot = records::snapshot();
    let ours: Vec<_> = snapshot
        .records_of(allocator)
        .filter(|r| r.requested == size)
        .collect();
    assert!(ours.iter().all(|r| r.sampled));
    (ours.len(), ours.iter().map(|r| r.weight).sum())
}

fn allocate(layout: Layout) -> NonNull<u8> {
    let block = Sampler.allocate_block(layout).expect("out of memory");
    // SAFETY: the block holds at least `layout.size()` bytes.
    unsafe { block.ptr.as_ptr().write_bytes(7, layout.size()) };
    block.ptr
}

fn free_all(blocks: Vec<NonNull<u8>>, layout: Layout) {
    for ptr in blocks {
        // SAFETY: each block was allocated through `Sampler` with `layout`, freed once.
        unsafe { Sampler.deallocate_block(ptr, layout) };
    }
}

fn assert_estimate(allocator: &str, size: usize, blocks: usize) -> usize {
    // p(232 B at 8 KiB) = 2.8 %: about 450 samples of 16,000 blocks, weighted to estimate
    // them all.
    let (count, estimate) = sampled(allocator, size);
    assert!(count > 200, "{allocator}: {count} samples");
    let error = (estimate - blocks as f64).abs() / blocks as f64;
    assert!(
        error < 0.3,
        "{allocator}: estimate {estimate:.0} of {blocks} blocks"
    );
    count
}

#[test]
fn a_sampling_child_keeps_its_lane_and_its_samples_estimate_its_blocks() {
    let layout = Layout::from_size_align(SIZE, 8).unwrap();
    free_all(vec![allocate(layout)], layout);
    Sampler.set_records(RecordMode::Sample {
        interval: 8192,
        frames: 0,
    });
    assert!(Sampler::registration().has_thread_cache_lane());
    assert!(Sampler::registration().thread_cache_lane_open());

    let blocks: Vec<_> = (0..BLOCKS).map(|_| allocate(layout)).collect();
    let st = Sampler.stats();
    assert_eq!(st.live_blocks, BLOCKS);
    assert_eq!(st.live_requested_bytes, Some(BLOCKS * SIZE));
    assert_estimate("Sampler", SIZE, BLOCKS);
    assert_eq!(
        sampled("SystemAllocator", SIZE).0,
        0,
        "the SystemAllocator does not sample"
    );
    free_all(blocks, layout);
    assert_eq!(sampled("Sampler", SIZE).0, 0, "records of freed blocks");
    assert_eq!(Sampler.stats().live_blocks, 0);

    // Inside a scoped tag, std's containers are sampled the same way.
    let scoped: Vec<Vec<u8>> = Sampler.scope(|| {
        (0..BLOCKS)
            .map(|_| Vec::with_capacity(SCOPED_SIZE))
            .collect()
    });
    assert_eq!(Sampler.stats().live_blocks, BLOCKS + 1);
    assert_estimate("Sampler", SCOPED_SIZE, BLOCKS);
    drop(scoped);
    assert_eq!(sampled("Sampler", SCOPED_SIZE).0, 0);
    assert_eq!(Sampler.stats().live_blocks, 0);

    // With the SystemAllocator sampling too (at a longer interval), each records the blocks
    // it samples: both estimates hold.
    SystemAllocator::new().set_records(RecordMode::Sample {
        interval: 16384,
        frames: 0,
    });
    assert!(Sampler::registration().thread_cache_lane_open());
    let blocks: Vec<_> = (0..BLOCKS).map(|_| allocate(layout)).collect();
    assert_estimate("Sampler", SIZE, BLOCKS);
    assert_estimate("SystemAllocator", SIZE, BLOCKS);
    free_all(blocks, layout);
    assert_eq!(sampled("Sampler", SIZE).0, 0);
    assert_eq!(sampled("SystemAllocator", SIZE).0, 0);
    SystemAllocator::new().set_records(RecordMode::Off);

    // Sampling off with sampled blocks live: the lane stays open, frees still take records
    // out.
    let blocks: Vec<_> = (0..BLOCKS).map(|_| allocate(layout)).collect();
    let count = sampled("Sampler", SIZE).0;
    Sampler.set_records(RecordMode::Off);
    assert!(Sampler::registration().thread_cache_lane_open());
    free_all(blocks, layout);
    assert!(count > 200);
    assert_eq!(sampled("Sampler", SIZE).0, 0);
    let st = Sampler.stats();
    assert_eq!((st.live_blocks, st.live_granted_bytes), (0, 0));
    assert_eq!(st.allocations, st.frees);
}
