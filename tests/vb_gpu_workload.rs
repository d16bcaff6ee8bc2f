//! The GPU-heap workload that vb-bench times (its sequence comes from the same file), checked
//! for correctness: every failed allocation must be genuine (no free range could hold the
//! request after alignment), the block must agree with a shadow map of the live ranges, and
//! its structures must validate as it goes. Run at the bench's heap size (which the workload
//! fits in) and in a heap too tight for it, where allocations do fail.

#[allow(dead_code)]
#[path = "../vb-bench/src/gpu_workload.rs"]
mod gpu_workload;

use std::collections::BTreeMap;

use gpu_workload::{FRAMES, HEAP, Op, TEXTURES, TRANSIENTS, gpu_heap};
use tagalloc::virtual_block::{Alloc, Error, Request, Strategy, VirtualBlock};

/// Whether a gap between the live ranges can hold `size` at `align`.
fn fits_in_gaps(live: &BTreeMap<u64, u64>, capacity: u64, size: u64, align: u64) -> bool {
    let mut end = 0u64;
    let fits = |from: u64, to: u64| from.next_multiple_of(align) + size <= to;
    for (&offset, &len) in live {
        if offset > end && fits(end, offset) {
            return true;
        }
        end = offset + len;
    }
    end < capacity && fits(end, capacity)
}

/// Plays the sequence; returns the number of (genuine) failures.
fn play(capacity: u64, strategy: Strategy, frames: u32) -> u64 {
    let w = gpu_heap(frames, 0x6f70_7500_d00d);
    let mut block = VirtualBlock::<u32>::new(capacity);
    let mut handles: Vec<Option<Alloc>> = vec![None; w.slots];
    let mut live: BTreeMap<u64, u64> = BTreeMap::new();
    let mut failures = 0;
    let ops_per_frame = 2 * (TRANSIENTS + TEXTURES / 50) as usize;
    for (n, op) in w.ops.iter().enumerate() {
        match *op {
            Op::Alloc { slot, size, align } => {
                let r = Request::new(size).align(align).strategy(strategy);
                match block.allocate(&r, slot) {
                    Ok(a) => {
                        assert_eq!(a.offset() % align, 0);
                        let before = live.range(..a.offset() + size).next_back();
                        assert!(
                            before.is_none_or(|(&o, &l)| o + l <= a.offset()),
                            "allocation at {} overlaps a live range",
                            a.offset()
                        );
                        live.insert(a.offset(), size);
                        handles[slot as usize] = Some(a);
                    }
                    Err(Error::OutOfSpace { .. }) => {
                        assert!(
                            !fits_in_gaps(&live, capacity, size, align),
                            "false out-of-memory at operation {n}: {size} at {align} fits"
                        );
                        failures += 1;
                    }
                    Err(e) => panic!("operation {n}: {e}"),
                }
            }
            Op::Free { slot } => {
                if let Some(a) = handles[slot as usize].take() {
                    assert_eq!(block.free(a), Ok(slot));
                    live.remove(&a.offset());
                }
            }
        }
        // Every 50 frames: the block's own structures, and its free space against the map.
        if n % (50 * ops_per_frame) == 0 {
            block.validate().unwrap();
            let live_bytes: u64 = live.values().sum();
            assert_eq!(block.free_bytes(), capacity - live_bytes);
        }
    }
    block.validate().unwrap();
    assert!(block.is_empty());
    failures
}

#[test]
fn gpu_heap_workload_fits_the_bench_heap() {
    assert_eq!(play(HEAP, Strategy::Balanced, FRAMES), 0);
}

#[test]
fn gpu_heap_workload_in_a_tight_heap_fails_only_for_real() {
    // 720 MiB, as vb-bench's false-OOM column: hundreds of failures, none false.
    for strategy in [Strategy::Balanced, Strategy::MinTime, Strategy::MinMemory] {
        let failures = play(720 << 20, strategy, FRAMES);
        assert!(
            failures > 0,
            "{strategy:?}: the tight heap should refuse some"
        );
    }
    // MinOffset walks every free range per allocation: a shorter run.
    assert!(play(700 << 20, Strategy::MinOffset, FRAMES / 4) > 0);
}
