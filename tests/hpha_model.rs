//! Model tests of the HPHA schema: random alloc / free / realloc sequences checked against a
//! shadow model. No two live blocks overlap, every pointer is aligned, contents survive
//! realloc, and the statistics equal what the model says.

mod common;

use core::alloc::Layout;
use proptest::prelude::*;
use std::collections::BTreeMap;
use tagalloc::os::OsAllocator;
use tagalloc::schema::{Allocation, HphaSchema};

#[derive(Clone, Debug)]
enum Op {
    Alloc {
        size: usize,
        align_log: u32,
        zeroed: bool,
    },
    Free {
        pick: usize,
    },
    Realloc {
        pick: usize,
        size: usize,
    },
    Collect,
}

fn size_strategy() -> impl Strategy<Value = usize> {
    prop_oneof![
        4 => 0usize..=600,
        3 => 0usize..=8192,
        2 => 0usize..=200_000,
        1 => 0usize..=(1 << 20),
    ]
}

fn op_strategy() -> impl Strategy<Value = Op> {
    prop_oneof![
        5 => (size_strategy(), 0u32..=16, any::<bool>())
            .prop_map(|(size, align_log, zeroed)| Op::Alloc { size, align_log, zeroed }),
        3 => any::<usize>().prop_map(|pick| Op::Free { pick }),
        2 => (any::<usize>(), size_strategy()).prop_map(|(pick, size)| Op::Realloc { pick, size }),
        1 => Just(Op::Collect),
    ]
}

struct Live {
    block: Allocation,
    layout: Layout,
    seed: u8,
}

/// The bytes of a block that the model checks: its first and last 256 requested bytes.
fn pattern_ranges(len: usize) -> impl Iterator<Item = usize> {
    (0..len.min(256)).chain(len.saturating_sub(256).max(256.min(len))..len)
}

fn write_pattern(block: Allocation, len: usize, seed: u8) {
    for i in pattern_ranges(len) {
        // SAFETY: `i < len <= block.size`.
        unsafe { block.ptr.as_ptr().add(i).write(seed ^ (i as u8)) };
    }
}

fn check_pattern(block: Allocation, len: usize, seed: u8) -> Result<(), TestCaseError> {
    for i in pattern_ranges(len) {
        // SAFETY: `i < len <= block.size`.
        let b = unsafe { *block.ptr.as_ptr().add(i) };
        prop_assert_eq!(b, seed ^ (i as u8), "byte {} of a {}-byte block", i, len);
    }
    Ok(())
}

fn check_model(heap: &HphaSchema, live: &BTreeMap<usize, Live>) -> Result<(), TestCaseError> {
    let mut end = 0usize;
    for (&start, l) in live {
        prop_assert!(start >= end, "blocks overlap at {:#x}", start);
        prop_assert_eq!(start % l.layout.align(), 0);
        prop_assert!(l.block.size >= l.layout.size());
        end = start + l.block.size;
    }
    let stats = heap.stats();
    prop_assert_eq!(stats.live_blocks, live.len());
    prop_assert_eq!(
        stats.granted_bytes,
        live.values().map(|l| l.block.size).sum::<usize>()
    );
    prop_assert_eq!(heap.validate(), Ok(()));
    Ok(())
}

fn run(ops: &[Op]) -> Result<(), TestCaseError> {
    let heap = HphaSchema::new(OsAllocator);
    let mut live: BTreeMap<usize, Live> = BTreeMap::new();
    for (step, op) in ops.iter().enumerate() {
        let seed = step as u8;
        match *op {
            Op::Alloc {
                size,
                align_log,
                zeroed,
            } => {
                let layout = Layout::from_size_align(size, 1 << align_log).unwrap();
                let block = if zeroed {
                    heap.allocate_zeroed(layout)
                } else {
                    heap.allocate(layout)
                }
                .expect("allocation failed");
                if zeroed {
                    // SAFETY: the block has `block.size` bytes.
                    let bytes =
                        unsafe { std::slice::from_raw_parts(block.ptr.as_ptr(), block.size) };
                    prop_assert!(bytes.iter().all(|&b| b == 0), "zeroed block is not zero");
                }
                write_pattern(block, size, seed);
                live.insert(
                    block.ptr.as_ptr() as usize,
                    Live {
                        block,
                        layout,
                        seed,
                    },
                );
            }
            Op::Free { pick } if !live.is_empty() => {
                let key = *live.keys().nth(pick % live.len()).unwrap();
                let l = live.remove(&key).unwrap();
                check_pattern(l.block, l.layout.size(), l.seed)?;
                // SAFETY: the block is live with this layout.
                unsafe { heap.deallocate(l.block.ptr, l.layout) };
            }
            Op::Realloc { pick, size } if !live.is_empty() => {
                let key = *live.keys().nth(pick % live.len()).unwrap();
                let l = live.remove(&key).unwrap();
                check_pattern(l.block, l.layout.size(), l.seed)?;
                // SAFETY: the block is live with this layout.
                let block = unsafe { heap.reallocate(l.block.ptr, l.layout, size) }
                    .expect("realloc failed");
                let kept = l.layout.size().min(size);
                // The prefix that both sizes share must be intact.
                for i in 0..kept.min(256) {
                    // SAFETY: `i < kept <= block.size`.
                    let b = unsafe { *block.ptr.as_ptr().add(i) };
                    prop_assert_eq!(b, l.seed ^ (i as u8));
                }
                let layout = Layout::from_size_align(size, l.layout.align()).unwrap();
                write_pattern(block, size, seed);
                live.insert(
                    block.ptr.as_ptr() as usize,
                    Live {
                        block,
                        layout,
                        seed,
                    },
                );
            }
            Op::Collect => heap.garbage_collect(),
            _ => {}
        }
        check_model(&heap, &live)?;
    }
    for (_, l) in std::mem::take(&mut live) {
        check_pattern(l.block, l.layout.size(), l.seed)?;
        // SAFETY: the block is live with this layout.
        unsafe { heap.deallocate(l.block.ptr, l.layout) };
    }
    check_model(&heap, &live)?;
    heap.garbage_collect();
    let stats = heap.stats();
    prop_assert_eq!(stats.chunks, 0);
    prop_assert_eq!(stats.segments, 0);
    prop_assert_eq!(stats.held_bytes, 0);
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(common::model_cases(96)))]

    #[test]
    fn random_sequences_match_the_model(ops in prop::collection::vec(op_strategy(), 1..200)) {
        run(&ops)?;
    }
}

/// One long deterministic run of many thousands of operations.
#[test]
fn a_long_run_of_twenty_thousand_operations() {
    use proptest::strategy::ValueTree;
    let mut runner = proptest::test_runner::TestRunner::deterministic();
    let ops = prop::collection::vec(op_strategy(), 20_000)
        .new_tree(&mut runner)
        .unwrap()
        .current();
    run(&ops).unwrap();
}
