//! What allocation records cost: alloc+free pairs and batches through the SystemAllocator
//! and through a child allocator, with records off, basic, sampled (default 512 KiB
//! interval) and full (8 frames).
//!
//! Run with `cargo bench --bench records`. The SystemAllocator is called through
//! `GlobalAlloc` directly (the bench's own global allocator stays the system one), the
//! child through `BlockAllocator`, as the handles' `Allocator` impls do. Results are in the
//! README's records section; `compare/` measures the same modes on the `small` workload
//! (`TAGALLOC_RECORDS=SystemAllocator=basic target/compare/bin/workload-tagalloc small`).

use criterion::{BenchmarkId, Criterion, black_box, criterion_group, criterion_main};
use std::alloc::{GlobalAlloc, Layout};
use tagalloc::{BlockAllocator, RecordMode, SystemAllocator};

tagalloc::allocator!(Tagged: child of SystemAllocator, "bench child");

/// In this order: after `Basic` has been on, frees keep looking blocks up in the table
/// (so that earlier records leave exactly), which would make a later `Sample` look slower
/// than it is in a program that only samples.
const MODES: [(&str, RecordMode); 4] = [
    ("off", RecordMode::Off),
    ("sample", RecordMode::sample()),
    ("basic", RecordMode::Basic),
    ("full", RecordMode::Full { frames: 8 }),
];

/// One alloc+free pair through the global-allocator interface, touching the block.
#[inline(always)]
fn system_pair(layout: Layout) {
    let a = SystemAllocator::new();
    // SAFETY: a non-zero layout; the block is written once and freed once with it.
    unsafe {
        let p = a.alloc(layout);
        p.write(1);
        a.dealloc(black_box(p), layout);
    }
}

/// 32 allocations, then 32 frees (the `small` workload's batches).
#[inline(always)]
fn system_batch(layout: Layout) {
    let a = SystemAllocator::new();
    let mut ptrs = [std::ptr::null_mut::<u8>(); 32];
    // SAFETY: as above; each block is freed once.
    unsafe {
        for p in ptrs.iter_mut() {
            *p = a.alloc(layout);
        }
        for &p in ptrs.iter() {
            a.dealloc(black_box(p), layout);
        }
    }
}

#[inline(always)]
fn child_pair(layout: Layout) {
    let block = Tagged.allocate_block(layout).unwrap();
    // SAFETY: the block is ours, at least one byte, freed once with its layout.
    unsafe {
        block.ptr.as_ptr().write(1);
        Tagged.deallocate_block(black_box(block.ptr), layout);
    }
}

fn records(c: &mut Criterion) {
    let mut group = c.benchmark_group("records");
    for (name, mode) in MODES {
        for size in [16usize, 256] {
            let layout = Layout::from_size_align(size, 8).unwrap();
            SystemAllocator::new().set_records(mode);
            group.bench_with_input(
                BenchmarkId::new(format!("system/pair/{name}"), size),
                &layout,
                |b, &l| b.iter(|| system_pair(l)),
            );
            group.bench_with_input(
                BenchmarkId::new(format!("system/batch32/{name}"), size),
                &layout,
                |b, &l| b.iter(|| system_batch(l)),
            );
            SystemAllocator::new().set_records(RecordMode::Off);
            Tagged.set_records(mode);
            group.bench_with_input(
                BenchmarkId::new(format!("child/pair/{name}"), size),
                &layout,
                |b, &l| b.iter(|| child_pair(l)),
            );
            Tagged.set_records(RecordMode::Off);
        }
    }
    group.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default()
        .warm_up_time(std::time::Duration::from_millis(300))
        .measurement_time(std::time::Duration::from_secs(1))
        .sample_size(20);
    targets = records
}
criterion_main!(benches);
