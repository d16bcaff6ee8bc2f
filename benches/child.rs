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
//! say how the layout reaches each call; it also prints ns per pair), at 94ee7f8:
//!
//! | layout, size                          | system | child          | grandchild |
//! |---------------------------------------|-------:|---------------:|-----------:|
//! | const, 16 B and 1 KiB                 | 45     | 47 (+4.4 %)    | 47         |
//! | opaque, 16 B and 1 KiB                | 66     | 65 (−1.5 %)    | 65         |
//! | batch of 64, 16 B                     | 70.2   | 71.2 (+1.4 %)  | 71.2       |
//! | batch of 64, 1 KiB                    | 99.5   | 101.1 (+1.6 %) | 101.1      |
//! | opaque, 16 KiB to 1 MiB (general path) | 549   | 606 (+10 %)    | 663        |
//! | opaque, 2 MiB (general path)          | 549    | 693 (+26 %)    | 836        |
//! | opaque, 16 KiB to 4 MiB, at dd34dee   | 549    | 608 (+11 %)    | 667        |
//!
//! A child's small path is the `SystemAllocator`'s lane code plus one add of the requested
//! size per call (the one extra instruction per pair above; it is most of the small rows'
//! extra time). Everything else is one out-of-line call, so the small path needs no stack
//! frame where it is inlined. The "hoisted" mode of the example (one layout for a whole
//! loop) lets the compiler move the `SystemAllocator`'s size check and class lookup out of
//! the loop, which the child's larger code keeps inside; "const" (a layout known at compile
//! time, as for `Box<T>`) and "opaque" (computed per call, what this bench does with
//! `black_box`) compare like with like.
//!
//! The general path (past the lanes) costs, per call: a trampoline that tests the class (6
//! instructions), one load and compare of the route word (a shard slot, and flags for a
//! budget and for records), the thread cache's state, and the shard's requested bytes, call
//! count and running granted total, whose distance from the published part is compared with
//! the thresholds. An allocation keeps the slot and the requested size across the parent's
//! call (its frame is most of what is left); a free counts first, reading the granted size
//! from the block's header, then jumps to the parent without a frame. A shard publishes to
//! the shared live figure (for the peak) past +64 KiB of allocations or −1 MiB of frees, so
//! alternating blocks up to 1 MiB cancel in the shard. Until dd34dee a bigger block was
//! published by itself each call, two locked `fetch_add`s per pair (the 2 MiB row, +5 ns
//! timed); now a thread that frees one holds that free back as well (see
//! `src/allocator/stats.rs`, "Big frees"), so 2 and 4 MiB pairs cost what 16 KiB ones do.
//!
//! Timed (medians of 31 interleaved runs of the example at 94ee7f8, system / child): 16 KiB
//! +4.4 %, 256 KiB +3.4 %, 1 MiB +4.1 %, 2 MiB +15 %, batches of 64 at 16 B +5.8 %;
//! `bash compare/child_overhead.sh` reruns that comparison (at ec276d2 it also gave 16 B
//! pairs with a compile-time layout +9.3 %, layout per call −0.6 %, 4 MiB +19 %). Whole
//! workloads through a child: `bash compare/run.sh --allocators tagalloc,tagalloc-child`
//! (README; all within 1.04, geometric mean 1.00).

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
    for size in [16usize, 128, 1024, 16_384, 262_144, 2_097_152] {
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
        if size > 16_384 {
            continue; // (64 blocks of that size: a test of the heap, not of tagging)
        }
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
