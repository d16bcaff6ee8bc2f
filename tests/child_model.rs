//! Model test of child allocators: random alloc / free / realloc sequences through a child
//! of the `SystemAllocator` and a grandchild, with budgets set and removed on both between
//! calls and the `SystemAllocator`'s sampling turned on and off (which moves the children
//! between their thread-cache lanes, sampling or not, and their general path),
//! checked against a shadow model. No two live blocks overlap, every pointer is aligned,
//! contents survive until freed or resized, and the statistics of both allocators (live
//! figures and the counts of allocations, frees and resizes) equal what the model says after
//! every step (the parent's include the grandchild's).
//!
//! The same model runs a second pair whose grandchild is declared with
//! `requested_bytes: false`: every figure but the requested bytes must still match, and the
//! requested bytes must be reported as unknown by the grandchild and by its parent.

mod common;

use core::alloc::Layout;
use core::ptr::NonNull;
use proptest::prelude::*;
use std::collections::BTreeMap;
use tagalloc::{AllocatorStats, BlockAllocator, BudgetMode, RecordMode, SystemAllocator};

tagalloc::allocator!(ModelParent: child of SystemAllocator, "model parent");
tagalloc::allocator!(ModelKid: child of ModelParent, "model grandchild");
tagalloc::allocator!(LeanParent: child of SystemAllocator, "model parent of a lean child");
tagalloc::allocator!(
    LeanKid: child of LeanParent { requested_bytes: false },
    "model grandchild without requested bytes"
);

#[derive(Clone, Debug)]
enum Op {
    Alloc {
        kid: bool,
        size: usize,
        align_log: u32,
    },
    Free {
        pick: usize,
    },
    Realloc {
        pick: usize,
        size: usize,
    },
    /// A warn-only budget (never refuses) on the parent or the grandchild, or none.
    Budget {
        kid: bool,
        on: bool,
    },
    /// The `SystemAllocator` samples (the lanes then sample for it) or not.
    SystemSample {
        on: bool,
    },
}

fn size_strategy() -> impl Strategy<Value = usize> {
    prop_oneof![6 => 1usize..=512, 3 => 513usize..=4096, 1 => 4097usize..=70_000]
}

fn op_strategy() -> impl Strategy<Value = Op> {
    prop_oneof![
        8 => (any::<bool>(), size_strategy(), prop_oneof![4 => 0u32..=3, 1 => 4u32..=6])
            .prop_map(|(kid, size, align_log)| Op::Alloc { kid, size, align_log }),
        5 => any::<usize>().prop_map(|pick| Op::Free { pick }),
        2 => (any::<usize>(), size_strategy()).prop_map(|(pick, size)| Op::Realloc { pick, size }),
        1 => (any::<bool>(), any::<bool>()).prop_map(|(kid, on)| Op::Budget { kid, on }),
        1 => any::<bool>().prop_map(|on| Op::SystemSample { on }),
    ]
}

struct Live {
    kid: bool,
    layout: Layout,
    granted: usize,
    seed: u8,
}

/// The figures the model expects of one allocator: live blocks, granted and requested bytes,
/// and the calls since the start.
#[derive(Default, Debug, PartialEq, Eq, Clone, Copy)]
struct Expect {
    blocks: usize,
    granted: usize,
    /// `None` where the allocator does not report requested bytes.
    requested: Option<usize>,
    allocations: u64,
    frees: u64,
    reallocations: u64,
}

/// The calls made through one allocator since the start.
#[derive(Default, Clone, Copy)]
struct Calls {
    allocations: u64,
    frees: u64,
    reallocations: u64,
}

fn figures(st: &AllocatorStats, start: &AllocatorStats) -> Expect {
    Expect {
        blocks: st.live_blocks - start.live_blocks,
        granted: st.live_granted_bytes - start.live_granted_bytes,
        requested: st
            .live_requested_bytes
            .map(|now| now - start.live_requested_bytes.unwrap()),
        allocations: st.allocations - start.allocations,
        frees: st.frees - start.frees,
        reallocations: st.reallocations - start.reallocations,
    }
}

fn fill(ptr: NonNull<u8>, len: usize, seed: u8) {
    // SAFETY: the block holds at least `len` bytes.
    unsafe {
        for i in 0..len {
            ptr.as_ptr().add(i).write(seed.wrapping_add(i as u8));
        }
    }
}

fn check(ptr: NonNull<u8>, len: usize, seed: u8) {
    // SAFETY: the block holds at least `len` bytes, written by `fill`.
    unsafe {
        for i in 0..len {
            assert_eq!(*ptr.as_ptr().add(i), seed.wrapping_add(i as u8), "byte {i}");
        }
    }
}

fn allocate<P: BlockAllocator, K: BlockAllocator>(
    kid: bool,
    layout: Layout,
) -> tagalloc::schema::Allocation {
    let block = if kid {
        K::INSTANCE.allocate_block(layout)
    } else {
        P::INSTANCE.allocate_block(layout)
    };
    block.expect("out of memory")
}

/// Frees a block; returns the granted size the allocator reports.
///
/// # Safety
/// `ptr` is a live block of the chosen allocator with `layout`.
unsafe fn free<P: BlockAllocator, K: BlockAllocator>(
    kid: bool,
    ptr: NonNull<u8>,
    layout: Layout,
) -> usize {
    // SAFETY: forwarded from the caller.
    unsafe {
        if kid {
            K::INSTANCE.deallocate_block(ptr, layout)
        } else {
            P::INSTANCE.deallocate_block(ptr, layout)
        }
    }
}

/// The model through parent `P` and its child `K`; `requested`: whether `K` keeps
/// requested bytes (if not, neither figure reports them).
fn run<P: BlockAllocator, K: BlockAllocator>(ops: Vec<Op>, requested: bool) {
    // One model at a time: both turn the `SystemAllocator`'s sampling on and off, and the
    // check for stale records at the end looks at the whole process.
    static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _serial = SERIAL
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    // One small allocation through each asks for its lane (which the budgets then switch).
    let layout = Layout::from_size_align(32, 8).unwrap();
    for kid in [false, true] {
        let block = allocate::<P, K>(kid, layout);
        // SAFETY: just allocated with `layout`.
        unsafe { free::<P, K>(kid, block.ptr, layout) };
    }
    assert!(P::registration().has_thread_cache_lane());
    assert!(K::registration().has_thread_cache_lane());
    assert_eq!(K::registration().keeps_requested_bytes(), requested);
    let parent_start = P::registration().stats();
    let kid_start = K::registration().stats();
    let mut live: BTreeMap<usize, (NonNull<u8>, Live)> = BTreeMap::new();
    let mut seed = 0u8;
    // Calls through the parent itself (index 0) and through the grandchild (index 1).
    let mut calls = [Calls::default(); 2];
    for (step, op) in ops.into_iter().enumerate() {
        match op {
            Op::Alloc {
                kid,
                size,
                align_log,
            } => {
                let layout = Layout::from_size_align(size, 1 << align_log).unwrap();
                let block = allocate::<P, K>(kid, layout);
                calls[usize::from(kid)].allocations += 1;
                let addr = block.ptr.as_ptr() as usize;
                assert_eq!(addr % layout.align(), 0, "step {step}: alignment");
                assert!(block.size >= size);
                if let Some((&before, (_, b))) = live.range(..=addr).next_back() {
                    assert!(
                        before + b.granted <= addr,
                        "step {step}: overlaps {before:#x}"
                    );
                }
                if let Some((&after, _)) = live.range(addr..).next() {
                    assert!(
                        addr + block.size <= after,
                        "step {step}: overlaps {after:#x}"
                    );
                }
                seed = seed.wrapping_add(31);
                fill(block.ptr, size, seed);
                let granted = block.size;
                live.insert(
                    addr,
                    (
                        block.ptr,
                        Live {
                            kid,
                            layout,
                            granted,
                            seed,
                        },
                    ),
                );
            }
            Op::Free { pick } if !live.is_empty() => {
                let addr = *live.keys().nth(pick % live.len()).unwrap();
                let (ptr, b) = live.remove(&addr).unwrap();
                check(ptr, b.layout.size(), b.seed);
                // SAFETY: a live block of that allocator with that layout.
                let granted = unsafe { free::<P, K>(b.kid, ptr, b.layout) };
                calls[usize::from(b.kid)].frees += 1;
                assert_eq!(granted, b.granted, "step {step}: granted size at free");
            }
            Op::Realloc { pick, size } if !live.is_empty() => {
                let addr = *live.keys().nth(pick % live.len()).unwrap();
                let (ptr, mut b) = live.remove(&addr).unwrap();
                check(ptr, b.layout.size(), b.seed);
                // SAFETY: a live block of that allocator with that layout.
                let (block, old) = unsafe {
                    if b.kid {
                        K::INSTANCE.reallocate_block(ptr, b.layout, size)
                    } else {
                        P::INSTANCE.reallocate_block(ptr, b.layout, size)
                    }
                }
                .expect("out of memory");
                calls[usize::from(b.kid)].reallocations += 1;
                assert_eq!(old, b.granted, "step {step}: old granted size");
                assert_eq!(block.ptr.as_ptr() as usize % b.layout.align(), 0);
                check(block.ptr, b.layout.size().min(size), b.seed);
                b.layout = Layout::from_size_align(size, b.layout.align()).unwrap();
                b.granted = block.size;
                fill(block.ptr, size, b.seed);
                live.insert(block.ptr.as_ptr() as usize, (block.ptr, b));
            }
            Op::Budget { kid, on } => {
                let limit = on.then_some(usize::MAX / 4);
                if kid {
                    K::registration().set_budget(limit, BudgetMode::Warn);
                } else {
                    P::registration().set_budget(limit, BudgetMode::Warn);
                }
            }
            Op::SystemSample { on } => {
                let mode = if on {
                    RecordMode::Sample {
                        interval: 4096,
                        frames: 0,
                    }
                } else {
                    RecordMode::Off
                };
                SystemAllocator::new().set_records(mode);
            }
            Op::Free { .. } | Op::Realloc { .. } => {}
        }
        let known = requested.then_some(0);
        let mut kid = Expect {
            requested: known,
            ..Expect::default()
        };
        let mut all = kid;
        for (_, b) in live.values() {
            let e = if b.kid { &mut kid } else { &mut all };
            e.blocks += 1;
            e.granted += b.granted;
            e.requested = e.requested.map(|r| r + b.layout.size());
        }
        all.blocks += kid.blocks;
        all.granted += kid.granted;
        all.requested = all.requested.zip(kid.requested).map(|(a, k)| a + k);
        let [own, kids] = calls;
        kid.allocations = kids.allocations;
        kid.frees = kids.frees;
        kid.reallocations = kids.reallocations;
        all.allocations = kids.allocations + own.allocations;
        all.frees = kids.frees + own.frees;
        all.reallocations = kids.reallocations + own.reallocations;
        let (k, p) = (K::registration().stats(), P::registration().stats());
        assert_eq!(
            figures(&k, &kid_start),
            kid,
            "step {step}: grandchild figures"
        );
        assert_eq!(
            figures(&p, &parent_start),
            all,
            "step {step}: parent figures"
        );
        assert!(p.peak_granted_bytes.unwrap() >= p.live_granted_bytes);
        assert_eq!(
            k.over_budget, 0,
            "a warn budget of a quarter of the address space"
        );
    }
    for (_, (ptr, b)) in live {
        check(ptr, b.layout.size(), b.seed);
        // SAFETY: a live block of that allocator with that layout.
        unsafe { free::<P, K>(b.kid, ptr, b.layout) };
    }
    K::registration().set_budget(None, BudgetMode::Warn);
    P::registration().set_budget(None, BudgetMode::Warn);
    let (k, p) = (K::registration().stats(), P::registration().stats());
    let (k, p) = (figures(&k, &kid_start), figures(&p, &parent_start));
    let zero = requested.then_some(0);
    assert_eq!((k.blocks, k.granted, k.requested), (0, 0, zero));
    assert_eq!((p.blocks, p.granted, p.requested), (0, 0, zero));
    assert_eq!(k.allocations, k.frees);
    assert_eq!(p.allocations, p.frees);
    // Every block is freed: no sampled record of the `SystemAllocator` may remain (the
    // children's blocks are the only ones it serves in this binary).
    let snapshot = tagalloc::records::snapshot();
    assert_eq!(
        snapshot.records_of("SystemAllocator").count(),
        0,
        "stale records"
    );
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(common::model_cases(64)))]

    #[test]
    fn children_match_the_model_across_lane_switches(
        ops in prop::collection::vec(op_strategy(), 1..400)
    ) {
        run::<ModelParent, ModelKid>(ops, true);
    }

    #[test]
    fn a_child_without_requested_bytes_matches_the_model_in_every_other_figure(
        ops in prop::collection::vec(op_strategy(), 1..400)
    ) {
        run::<LeanParent, LeanKid>(ops, false);
    }
}
