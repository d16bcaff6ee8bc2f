//! Child lanes while the `SystemAllocator` samples (`TAGALLOC_RECORDS=SystemAllocator=sample`,
//! the mode for production): a child's lane stays open and samples its allocations for the
//! `SystemAllocator` with the same per-class countdowns as the `SystemAllocator`'s own lane,
//! so the weighted samples estimate the child's blocks too; a sampled block's record leaves
//! when it is freed; the child's figures stay exact. After sampling is turned off the lane
//! stays open, its frees asking the sample filter. The records mode is process-wide: this
//! binary has one test.

mod common;

use std::alloc::Layout;
use std::ptr::NonNull;
use tagalloc::records::RecordMode;
use tagalloc::{BlockAllocator, SystemAllocator};

tagalloc::allocator!(Sampled: child of SystemAllocator, "a lane while the SystemAllocator samples");

/// A requested size nothing else in this binary uses.
const SIZE: usize = 232;
const BLOCKS: usize = 16_000;

/// The `SystemAllocator`'s sampled records of `SIZE`-byte requests: (count, estimated blocks).
fn sampled_of_size() -> (usize, f64) {
    common::sampled_records_of_size(SIZE)
}

fn allocate(layout: Layout) -> NonNull<u8> {
    let block = Sampled.allocate_block(layout).expect("out of memory");
    // SAFETY: the block holds at least `layout.size()` bytes.
    unsafe { block.ptr.as_ptr().write_bytes(7, layout.size()) };
    block.ptr
}

fn free_all(blocks: Vec<NonNull<u8>>, layout: Layout) {
    for ptr in blocks {
        // SAFETY: each block was allocated through `Sampled` with `layout`, freed once.
        unsafe { Sampled.deallocate_block(ptr, layout) };
    }
}

#[test]
fn a_childs_lane_samples_for_the_system_allocator() {
    let layout = Layout::from_size_align(SIZE, 8).unwrap();
    // The first small allocation asks for the lane.
    free_all(vec![allocate(layout)], layout);
    assert!(Sampled::registration().has_thread_cache_lane());

    SystemAllocator::new().set_records(RecordMode::Sample {
        interval: 8192,
        frames: 0,
    });
    assert!(Sampled::registration().thread_cache_lane_open());
    let blocks: Vec<_> = (0..BLOCKS).map(|_| allocate(layout)).collect();
    let st = Sampled.stats();
    assert_eq!(st.live_blocks, BLOCKS);
    assert_eq!(st.live_requested_bytes, Some(BLOCKS * SIZE));
    // p(232 B at 8 KiB) = 2.8 %: about 450 samples of 16,000 blocks, weighted to estimate
    // them all.
    let (count, estimate) = sampled_of_size();
    assert!(count > 200, "{count} samples");
    let error = (estimate - BLOCKS as f64).abs() / BLOCKS as f64;
    assert!(error < 0.3, "estimate {estimate:.0} of {BLOCKS} blocks");

    // Every sampled block's record leaves with it.
    free_all(blocks, layout);
    assert_eq!(sampled_of_size().0, 0, "records of freed blocks");
    let st = Sampled.stats();
    assert_eq!((st.live_blocks, st.live_granted_bytes), (0, 0));
    assert_eq!(st.live_requested_bytes, Some(0));

    // Sampling off, with sampled blocks still live: the lane stays open and a free of a
    // sampled block still takes its record out.
    SystemAllocator::new().set_records(RecordMode::Sample {
        interval: 8192,
        frames: 0,
    });
    let blocks: Vec<_> = (0..BLOCKS).map(|_| allocate(layout)).collect();
    let (count, _) = sampled_of_size();
    assert!(count > 200);
    SystemAllocator::new().set_records(RecordMode::Off);
    assert!(Sampled::registration().thread_cache_lane_open());
    let more: Vec<_> = (0..1000).map(|_| allocate(layout)).collect();
    assert_eq!(sampled_of_size().0, count, "nothing sampled while off");
    free_all(blocks, layout);
    free_all(more, layout);
    assert_eq!(sampled_of_size().0, 0, "records of freed blocks");
    let st = Sampled.stats();
    assert_eq!((st.live_blocks, st.live_granted_bytes), (0, 0));
    assert_eq!(st.allocations, st.frees);
}
