//! Child allocator overhead over its parent: alloc+free pairs through a child of the
//! SystemAllocator against the same pairs through the SystemAllocator itself.
//!
//! Run with `cargo bench --bench child`. Both go through the same `BlockAllocator` calls
//! (the ones the handles' `Allocator` impls make), and the child is also measured through
//! `allocator_api2::alloc::Allocator`, so the difference is what tagging costs: counting
//! the granted and requested bytes, the peak and the budget check. The target is ≤ 5 %.
//! Children without a budget count in per-thread shards (see `src/allocator/stats.rs`).
//!
//! Measured (2-core shared Xeon, SystemAllocator with thread caches; ns per pair, median of
//! three runs alternating the two builds; "before" is the atomic counters, "after" the
//! per-thread shards):
//!
//! | size   | system | child before | child after | grandchild before | grandchild after |
//! |--------|-------:|-------------:|------------:|------------------:|-----------------:|
//! | 16 B   | 2.8    | 32.0         | 8.4         | 55.3              | 11.2             |
//! | 128 B  | 2.8    | 30.6         | 7.9         | 60.3              | 10.2             |
//! | 1 KiB  | 11.2   | 35.0         | 14.9        | 60.7              | 17.9             |
//! | 16 KiB | 44.8   | 72.8         | 50.0        | 102.2             | 50.3             |
//!
//! (batch64, 64 allocations then 64 frees: 16 B 260 system, child 1934 → 399 ns; 16 KiB 2828
//! system, child 4583 → 3490 ns.) The atomic counters cost six uncontended locked
//! read-modify-writes per pair (~25 ns); the shards use none: a child now adds 3–6 ns per
//! pair and each further level 2–3 ns. The 5 % target is still missed: +11 % at 16 KiB,
//! +33 % at 1 KiB, about +190 % at 16 B, where the parent's pair is ~3 ns and the remaining
//! cost (the shard update, a TLS access, the budget and route checks, and the calls around
//! the parent's path) is of the same size.
//!
//! Instructions per pair (callgrind, deterministic; `examples/child_pairs.rs`): system 55
//! (16 B) / 238 (1 KiB); child 106 → 160 and 279 → 325; grandchild 132 → 216 and 303 → 381.
//! The shards execute more instructions than the atomics (owner-only loads and stores, the
//! TLS and route checks, the publication threshold) but no locked ones, which callgrind
//! counts as one instruction each although each costs ~20 cycles.

use allocator_api2::alloc::Allocator;
use criterion::{BenchmarkId, Criterion, black_box, criterion_group, criterion_main};
use std::alloc::Layout;
use tagalloc::{BlockAllocator, SystemAllocator};

tagalloc::allocator!(Tagged: child of SystemAllocator, "bench child");
tagalloc::allocator!(Nested: child of Tagged, "bench grandchild");

/// One alloc+free pair through a `BlockAllocator`, touching the block.
#[inline(always)]
fn pair<B: BlockAllocator>(alloc: B, layout: Layout) {
    let block = alloc.allocate_block(layout).unwrap();
    // SAFETY: the block is ours, at least one byte, freed once with its layout.
    unsafe {
        block.ptr.as_ptr().write(1);
        alloc.deallocate_block(black_box(block.ptr), layout);
    }
}

/// The same pair through the `Allocator` trait (what containers call).
#[inline(always)]
fn pair_api<A: Allocator>(alloc: &A, layout: Layout) {
    let block = alloc.allocate(layout).unwrap().cast::<u8>();
    // SAFETY: as above.
    unsafe {
        block.as_ptr().write(1);
        alloc.deallocate(black_box(block), layout);
    }
}

/// 64 allocations then 64 frees, so pairs do not always reuse one slot.
#[inline(always)]
fn batch<B: BlockAllocator>(alloc: B, layout: Layout) {
    let mut ptrs = [std::ptr::NonNull::<u8>::dangling(); 64];
    for p in ptrs.iter_mut() {
        *p = alloc.allocate_block(layout).unwrap().ptr;
    }
    for &p in ptrs.iter() {
        // SAFETY: each block was allocated above with `layout`, freed once.
        unsafe { alloc.deallocate_block(black_box(p), layout) };
    }
}

fn pairs(c: &mut Criterion) {
    let mut group = c.benchmark_group("child_vs_parent");
    for size in [16usize, 128, 1024, 16_384] {
        let layout = Layout::from_size_align(size, 8).unwrap();
        group.bench_with_input(BenchmarkId::new("system/pair", size), &layout, |b, &l| {
            b.iter(|| pair(SystemAllocator::new(), l))
        });
        group.bench_with_input(BenchmarkId::new("child/pair", size), &layout, |b, &l| {
            b.iter(|| pair(Tagged, l))
        });
        group.bench_with_input(
            BenchmarkId::new("child/pair_api", size),
            &layout,
            |b, &l| b.iter(|| pair_api(&Tagged, l)),
        );
        group.bench_with_input(
            BenchmarkId::new("grandchild/pair", size),
            &layout,
            |b, &l| b.iter(|| pair(Nested, l)),
        );
        group.bench_with_input(
            BenchmarkId::new("system/batch64", size),
            &layout,
            |b, &l| b.iter(|| batch(SystemAllocator::new(), l)),
        );
        group.bench_with_input(BenchmarkId::new("child/batch64", size), &layout, |b, &l| {
            b.iter(|| batch(Tagged, l))
        });
    }
    group.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default()
        .warm_up_time(std::time::Duration::from_millis(300))
        .measurement_time(std::time::Duration::from_secs(1))
        .sample_size(30);
    targets = pairs
}
criterion_main!(benches);
