//! The pool schemas against the general-purpose allocators and a bump arena: alloc+free
//! pairs and batches of small blocks on one thread.
//!
//! Run with `cargo bench --bench pool`. Every allocator is called through the same generic
//! function (no dynamic dispatch), side by side in one process, so ratios are what to read.
//! The bump arena never frees: its "pair" is one allocation, with the arena reset every
//! 4096 allocations; it is the floor any allocator that really frees can be held to.

mod common;

use common::{Alloc, Global};
use criterion::{BenchmarkId, Criterion, black_box, criterion_group, criterion_main};
use std::alloc::{Layout, System};
use std::ptr::NonNull;
use std::time::Duration;
use tagalloc::SystemAllocator;
use tagalloc::schema::{PoolSchema, ThreadPoolSchema};

/// One alloc+free pair, touching the block so it is really used.
#[inline]
fn pair<A: Alloc>(a: &A, layout: Layout) {
    let p = a.alloc(layout);
    // SAFETY: a live block of at least one byte, freed once with its layout.
    unsafe {
        p.as_ptr().write(1);
        a.free(black_box(p), layout);
    }
}

/// Allocate 64 blocks, then free them, so the pair is not always the same slot.
#[inline]
fn batch<A: Alloc>(a: &A, layout: Layout) {
    let mut ptrs = [NonNull::<u8>::dangling(); 64];
    for p in ptrs.iter_mut() {
        *p = a.alloc(layout);
        // SAFETY: a live block of at least one byte.
        unsafe { p.as_ptr().write(1) };
    }
    for &p in ptrs.iter() {
        // SAFETY: allocated above with this layout, freed once.
        unsafe { a.free(black_box(p), layout) };
    }
}

static POOL_THREADS: ThreadPoolSchema<SystemAllocator> =
    ThreadPoolSchema::new(SystemAllocator::new());

fn run<A: Alloc>(
    c: &mut criterion::BenchmarkGroup<'_, criterion::measurement::WallTime>,
    name: &str,
    a: &A,
    sizes: &[usize],
) {
    for &size in sizes {
        let layout = Layout::from_size_align(size, 8).unwrap();
        c.bench_with_input(
            BenchmarkId::new(format!("{name}/pair"), size),
            &layout,
            |b, &l| b.iter(|| pair(a, l)),
        );
        c.bench_with_input(
            BenchmarkId::new(format!("{name}/batch64"), size),
            &layout,
            |b, &l| b.iter(|| batch(a, l)),
        );
    }
}

fn pools(c: &mut Criterion) {
    let sizes = [32, 256];
    let mut group = c.benchmark_group("pool");
    group
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(2))
        .sample_size(40);
    let pool = PoolSchema::new(SystemAllocator::new());
    run(&mut group, "PoolSchema", &pool, &sizes);
    run(&mut group, "ThreadPoolSchema", &POOL_THREADS, &sizes);
    run(
        &mut group,
        "SystemAllocator",
        &Global(SystemAllocator::new()),
        &sizes,
    );
    run(&mut group, "System", &Global(System), &sizes);
    for &size in &sizes {
        let layout = Layout::from_size_align(size, 8).unwrap();
        let mut arena = bumpalo::Bump::with_capacity(4096 * 512);
        let mut n = 0;
        group.bench_with_input(BenchmarkId::new("bumpalo/pair", size), &layout, |b, &l| {
            b.iter(|| {
                let p = arena.alloc_layout(l);
                // SAFETY: a live block of at least one byte.
                unsafe { p.as_ptr().write(1) };
                black_box(p);
                n += 1;
                if n == 4096 {
                    arena.reset();
                    n = 0;
                }
            })
        });
    }
    group.finish();
}

criterion_group!(benches, pools);
criterion_main!(benches);
