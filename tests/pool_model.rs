//! Model test of the pool schema: random alloc / free / collect sequences on random valid
//! geometries, checked against a shadow model. No two live blocks overlap, every pointer is
//! aligned, contents survive until freed, refusals are exactly the out-of-range requests,
//! and the statistics (and the parent's page count) equal what the model says. Sequences run
//! long enough for the pool's per-class caches of freed blocks to fill and trim.

mod common;

use core::alloc::Layout;
use core::ptr::NonNull;
use core::sync::atomic::{AtomicUsize, Ordering::Relaxed};
use proptest::prelude::*;
use std::alloc::System;
use std::collections::BTreeMap;
use tagalloc::schema::pool::{PoolConfig, PoolSchema};
use tagalloc::schema::{PageParent, PoolStats};

/// Counts the pages the pool holds, to check `stats().pages` against the parent's view.
#[derive(Default)]
struct CountingParent {
    live: AtomicUsize,
}

// SAFETY: forwards to `System`.
unsafe impl PageParent for CountingParent {
    fn allocate_page(&self, layout: Layout) -> Option<NonNull<u8>> {
        let p = System.allocate_page(layout)?;
        self.live.fetch_add(1, Relaxed);
        Some(p)
    }
    unsafe fn free_page(&self, ptr: NonNull<u8>, layout: Layout) {
        self.live.fetch_sub(1, Relaxed);
        // SAFETY: forwarded.
        unsafe { System.free_page(ptr, layout) }
    }
}

#[derive(Clone, Debug)]
enum Op {
    Alloc { size: usize, align_log: u32 },
    Free { pick: usize },
    Collect,
}

fn op_strategy() -> impl Strategy<Value = Op> {
    prop_oneof![
        6 => (prop_oneof![3 => 0usize..=96, 2 => 0usize..=600], 0u32..=10)
            .prop_map(|(size, align_log)| Op::Alloc { size, align_log }),
        4 => any::<usize>().prop_map(|pick| Op::Free { pick }),
        1 => Just(Op::Collect),
    ]
}

fn config_strategy() -> impl Strategy<Value = PoolConfig> {
    prop_oneof![
        Just(PoolConfig::DEFAULT),
        Just(PoolConfig::new(1024, 64, 256).unwrap()),
        Just(PoolConfig::new(1024, 8, 64).unwrap()),
        Just(PoolConfig::new(8192, 16, 1024).unwrap()),
        Just(PoolConfig::new(2048, 32, 32).unwrap()),
    ]
}

struct Live {
    size: usize,
    granted: usize,
    layout: Layout,
    seed: u8,
}

fn run(cfg: PoolConfig, ops: Vec<Op>) {
    let parent = CountingParent::default();
    let pool = PoolSchema::with_config(&parent, cfg.with_name("model"));
    common::messages::capture();
    let mut refusal_noted = false;
    // Live blocks by address.
    let mut live: BTreeMap<usize, (NonNull<u8>, Live)> = BTreeMap::new();
    let mut expect = PoolStats::default();
    for (step, op) in ops.into_iter().enumerate() {
        match op {
            Op::Alloc { size, align_log } => {
                let layout = Layout::from_size_align(size, 1 << align_log).unwrap();
                let Some(a) = pool.allocate(layout) else {
                    assert_eq!(cfg.block_size(layout), None, "refused {layout:?}");
                    if !refusal_noted {
                        // The pool's first refusal is noted (captured, not printed).
                        refusal_noted = true;
                        let line = format!(
                            "tagalloc: pool 'model': request of {} bytes aligned to {} refused",
                            layout.size(),
                            layout.align()
                        );
                        assert!(common::messages::captured(&line), "{line}");
                    }
                    continue;
                };
                assert_eq!(Some(a.size), cfg.block_size(layout));
                let addr = a.ptr.as_ptr() as usize;
                assert_eq!(addr % layout.align(), 0, "misaligned {layout:?}");
                // No overlap with the neighbours on either side.
                if let Some((&prev, (_, l))) = live.range(..addr).next_back() {
                    assert!(prev + l.granted <= addr, "overlaps the block before");
                }
                if let Some((&next, _)) = live.range(addr..).next() {
                    assert!(addr + a.size <= next, "overlaps the block after");
                }
                let seed = step as u8;
                // SAFETY: a live block of `a.size` bytes.
                unsafe { a.ptr.as_ptr().write_bytes(seed, a.size) };
                live.insert(
                    addr,
                    (
                        a.ptr,
                        Live {
                            size,
                            granted: a.size,
                            layout,
                            seed,
                        },
                    ),
                );
                expect.allocations += 1;
                expect.granted_bytes += a.size;
                expect.requested_bytes += size;
                expect.peak_granted_bytes = expect.peak_granted_bytes.max(expect.granted_bytes);
            }
            Op::Free { pick } => {
                if live.is_empty() {
                    continue;
                }
                let addr = *live.keys().nth(pick % live.len()).unwrap();
                let (ptr, l) = live.remove(&addr).unwrap();
                // SAFETY: the block is live and `granted` bytes long.
                let bytes = unsafe { core::slice::from_raw_parts(ptr.as_ptr(), l.granted) };
                assert!(bytes.iter().all(|&b| b == l.seed), "contents changed");
                // SAFETY: allocated by this pool with `l.layout`, freed once.
                unsafe { pool.deallocate(ptr, l.layout) };
                expect.frees += 1;
                expect.granted_bytes -= l.granted;
                expect.requested_bytes -= l.size;
            }
            Op::Collect => pool.garbage_collect(),
        }
        // The figures are read at some steps only: reading them gives the freed blocks the
        // pool caches back to their pages, and the cache must get to fill and trim too.
        pool.validate().unwrap();
        if step % 8 != 7 {
            continue;
        }
        let st = pool.stats();
        assert_eq!(st.allocations, expect.allocations);
        assert_eq!(st.frees, expect.frees);
        assert_eq!(st.live_blocks, live.len());
        assert_eq!(st.granted_bytes, expect.granted_bytes);
        assert_eq!(st.requested_bytes, expect.requested_bytes);
        assert_eq!(st.peak_granted_bytes, expect.peak_granted_bytes);
        assert_eq!(st.pages, parent.live.load(Relaxed));
        assert_eq!(st.reserved_bytes, st.pages * cfg.page_size());
    }
    for (_, (ptr, l)) in std::mem::take(&mut live) {
        // SAFETY: as above.
        unsafe { pool.deallocate(ptr, l.layout) };
    }
    pool.garbage_collect();
    let st = pool.stats();
    assert_eq!((st.live_blocks, st.granted_bytes, st.pages), (0, 0, 0));
    assert_eq!(parent.live.load(Relaxed), 0);
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(common::model_cases(96)))]

    #[test]
    fn pool_matches_its_model(cfg in config_strategy(), ops in prop::collection::vec(op_strategy(), 1..600)) {
        run(cfg, ops);
    }
}
