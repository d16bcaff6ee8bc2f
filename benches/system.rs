//! SystemAllocator against `std::alloc::System`: alloc+free pairs of small and large sizes.
//!
//! Run with `cargo bench --bench system`. Both allocators are called through `GlobalAlloc`
//! in the same process, side by side, so their ratio is what to read.

use criterion::{BenchmarkId, Criterion, black_box, criterion_group, criterion_main};
use std::alloc::{GlobalAlloc, Layout, System};
use tagalloc::SystemAllocator;

static TAGALLOC: SystemAllocator = SystemAllocator::new();

/// One alloc+free pair, touching the block so it is really used.
fn pair(a: &dyn GlobalAlloc, layout: Layout) {
    // SAFETY: non-zero layout; the block is freed with the same layout.
    unsafe {
        let p = a.alloc(layout);
        p.write(1);
        a.dealloc(black_box(p), layout);
    }
}

/// A batch: allocate 64 blocks, then free them, so the pair is not always the same slot.
fn batch(a: &dyn GlobalAlloc, layout: Layout) {
    let mut ptrs = [std::ptr::null_mut::<u8>(); 64];
    // SAFETY: non-zero layout; each block is freed once with the same layout.
    unsafe {
        for p in ptrs.iter_mut() {
            *p = a.alloc(layout);
            p.write(1);
        }
        for &p in ptrs.iter() {
            a.dealloc(black_box(p), layout);
        }
    }
}

fn bench_sizes(c: &mut Criterion, group_name: &str, sizes: &[usize]) {
    let allocators: [(&str, &dyn GlobalAlloc); 2] = [("tagalloc", &TAGALLOC), ("System", &System)];
    let mut group = c.benchmark_group(group_name);
    for &size in sizes {
        let layout = Layout::from_size_align(size, 8).unwrap();
        for (name, a) in allocators {
            group.bench_with_input(
                BenchmarkId::new(format!("{name}/pair"), size),
                &layout,
                |b, &l| b.iter(|| pair(a, l)),
            );
            group.bench_with_input(
                BenchmarkId::new(format!("{name}/batch64"), size),
                &layout,
                |b, &l| b.iter(|| batch(a, l)),
            );
        }
    }
    group.finish();
}

fn small(c: &mut Criterion) {
    bench_sizes(c, "small", &[8, 32, 128, 512]);
}

fn large(c: &mut Criterion) {
    bench_sizes(c, "large", &[4096, 65_536, 1 << 20, 4 << 20]);
}

criterion_group! {
    name = benches;
    config = Criterion::default()
        .warm_up_time(std::time::Duration::from_millis(300))
        .measurement_time(std::time::Duration::from_secs(1))
        .sample_size(30);
    targets = small, large
}
criterion_main!(benches);
