//! Child allocator overhead over its parent: alloc+free pairs through a child of the
//! SystemAllocator against the same pairs through the SystemAllocator itself.
//!
//! Run with `cargo bench --bench child`. Both go through the same `BlockAllocator` calls
//! (the ones the handles' `Allocator` impls make), and the child is also measured through
//! `allocator_api2::alloc::Allocator`, so the difference is what tagging costs. The target
//! is ≤ 5 %. Small blocks of a child with a lane of the thread caches (see
//! `src/allocator/lanes.rs`) are the `SystemAllocator`'s own pop and push in that lane plus
//! one add of the requested size; larger ones take the child's general path (per-thread
//! shards, see `src/allocator/stats.rs`).
//!
//! Instructions per pair (callgrind, deterministic; `examples/child_pairs.rs`, whose modes
//! say how the layout reaches each call), before lanes (78d1b78) → with lanes:
//!
//! | layout, size                     | system    | child                | grandchild |
//! |----------------------------------|----------:|---------------------:|-----------:|
//! | const, 16 B and 1 KiB            | 47 → 45   | 89 → 47 (+4.4 %)     | 130 → 47   |
//! | opaque, 16 B and 1 KiB           | 71 → 69   | 117 → 69 (+0 %)      | 156 → 72   |
//! | hoisted, 16 B and 1 KiB          | 47 → 45   | 97 → 57 (+27 %)      | 139 → 57   |
//! | batch of 64, 16 B                | 81 → 79   | 127 → 80 (+1.3 %)    | 168 → 82   |
//! | batch of 64, 1 KiB               | 114 → 109 | 160 → 110 (+1.3 %)   | 201 → 112  |
//! | opaque, 16 KiB (general path)    | 550 → 550 | 594 → 597 (+8.5 %)   | 633 → 630  |
//!
//! "hoisted" is one layout for a whole loop: the compiler moves the `SystemAllocator`'s size
//! check and class lookup out of it, which the child's larger code keeps inside; "const" (a
//! layout known at compile time, as for `Box<T>`) and "opaque" (computed per call, what this
//! bench does with `black_box`) compare like with like. A child's lane publishes its bytes
//! into the child's shared figure (for the peak) once 64 KiB are pending, so its refills and
//! overflows cost the batch a few plain instructions, not locked ones. The batch of 64 at
//! 1 KiB measured +13 % (123.5 vs 109.1; timed +18-25 %) after the small-page headers moved
//! (9be08af) for a reason of the measurement's own: the child's warm-up pair went through
//! the general path (its lane is claimed after it), leaving a few blocks of the class cached
//! in the `SystemAllocator`'s lane, and with exactly 64 slots of 1 KiB per page since then,
//! every batch straddled two pages that emptied and came back from the pool about every
//! third batch (the `SystemAllocator` with the same few blocks held: 120 per pair).
//! `child_pairs` now flushes the thread cache after the warm-up (child 113.6, +4.1 %), and
//! the lanes' miss paths were straightened (a refill or an overflow of an open lane without
//! sampling goes straight to the thread cache's slow path): system 108.7, child 110.1
//! (+1.3 %), grandchild 112.1 instructions per pair; timed (32 M pairs, medians of 9
//! interleaved runs) 243 vs 251 ms (+3.3 %), against 242 vs 302 ms before.
//!
//! The 16 KiB general path's 47 extra instructions per pair are the child's own counting,
//! around the same parent call: the route and budget checks (6 + 3), the thread cache's state
//! (2 + 2), the shard's granted, requested and call counts and its publish threshold (9 + 9),
//! the records word (3 + 3), and the registers kept across the parent's calls. Folding the
//! budget and records tests into the route word would save about 9 of them (to about
//! +7 %); below that, the counts themselves would have to go.

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
            b.iter(|| pair(SystemAllocator::new(), black_box(l)))
        });
        group.bench_with_input(BenchmarkId::new("child/pair", size), &layout, |b, &l| {
            b.iter(|| pair(Tagged, black_box(l)))
        });
        group.bench_with_input(
            BenchmarkId::new("child/pair_api", size),
            &layout,
            |b, &l| b.iter(|| pair_api(&Tagged, black_box(l))),
        );
        group.bench_with_input(
            BenchmarkId::new("grandchild/pair", size),
            &layout,
            |b, &l| b.iter(|| pair(Nested, black_box(l))),
        );
        group.bench_with_input(
            BenchmarkId::new("system/batch64", size),
            &layout,
            |b, &l| b.iter(|| batch(SystemAllocator::new(), black_box(l))),
        );
        group.bench_with_input(BenchmarkId::new("child/batch64", size), &layout, |b, &l| {
            b.iter(|| batch(Tagged, black_box(l)))
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
