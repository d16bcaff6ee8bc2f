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
//! say how the layout reaches each call; it also prints ns per pair), at d334be7 (general
//! path rows after the review mend that follows it):
//!
//! | layout, size                     | system | child          | grandchild |
//! |----------------------------------|-------:|---------------:|-----------:|
//! | const, 16 B and 1 KiB            | 45     | 47 (+4.4 %)    | 47         |
//! | opaque, 16 B and 1 KiB           | 66     | 65 (−1.5 %)    | 65         |
//! | batch of 64, 16 B                | 70.2   | 71.2 (+1.4 %)  | 71.2       |
//! | batch of 64, 1 KiB               | 99.5   | 101.1 (+1.6 %) | 101.1      |
//! | opaque, 16 KiB (general path)    | 549    | 606 (+10 %)    | 663        |
//! | opaque, 256 KiB (general path)   | 549    | 701 (+28 %)    | 852        |
//!
//! Since d334be7 everything but the lane's pop or push is one out-of-line call, so the
//! small path needs no stack frame where it is inlined (through `__rust_alloc` a 32 B pair
//! went from 89 instructions to 63; the `SystemAllocator`'s is 58), and the general path is
//! no longer inlined into (and partly hoisted out of) the measuring loop: 583 and 628 before.
//! Whole workloads through a child: `bash compare/run.sh --allocators
//! tagalloc,tagalloc-child` (README).
//!
//! The example's "hoisted" mode (one layout for a whole loop, not in the table) lets the
//! compiler move the `SystemAllocator`'s size check and class lookup out of the loop, which
//! the child's larger code keeps inside; "const" (a layout known at compile time, as for
//! `Box<T>`) and "opaque" (computed per call, what this bench does with `black_box`) compare
//! like with like.
//!
//! Since 51327a3 (rows above measured at 5652ea8): an allocation keeps only the slot and the
//! requested size across the parent's call, and a free counts first (the granted size from
//! the block's header) and jumps to the parent without a frame; 16 KiB 631 -> 606. The 256
//! KiB free that publishes takes a cold path with a frame of its own (687 -> 701); timed,
//! 16 KiB is +4.2 % and +5.6 % in two sets of 15 interleaved runs, 256 KiB +19 %.
//!
//! The general path (16 KiB and up) costs, per call: one load and compare of the route word
//! (a shard slot, and flags for a budget and for records, set when either changes), the
//! thread cache's state, the shard's requested bytes, call count and running granted total,
//! whose distance from the published part is compared with the threshold. (Thresholds
//! cached at each publish saved 4 instructions per 16 KiB pair, 627 against 631; they were
//! dropped for the simpler comparison.) A block over 64 KiB goes to the
//! shared live figure at once (one `fetch_add` per call, so the peak stays exact): those two
//! locked operations per pair are most of the 256 KiB row's extra time (at 8b0a872, medians
//! of 7 interleaved runs: 256 KiB 34.9 / 40.4 ns, +16 %; 16 KiB 34.9 / 38.1 ns, +9 %; with
//! the publication switched off as an experiment, 256 KiB was +7 %). The instruction rows
//! were measured again at 8b0a872 and are unchanged. Before 335f3d1 the route, the budget limit and the records word were three
//! separate tests and a big block paid a compare-and-swap on top (16 KiB 597, +8.5 %).

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
