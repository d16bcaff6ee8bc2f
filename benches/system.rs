//! SystemAllocator against `std::alloc::System`: alloc+free pairs of small and large sizes.
//!
//! Run with `cargo bench --bench system`. Both allocators are called through `GlobalAlloc`
//! in the same process, side by side, so their ratio is what to read: alloc+free pairs per
//! size class, realloc growth, producer/consumer across threads, threads created and joined.
//! (There is no "stats off" build to compare: the per-thread counts the statistics read
//! are also what tells a thread cache's bin is full, so they cost nothing extra.)

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
    // One size per region of the class table: 8-byte steps, then four classes per doubling.
    bench_sizes(c, "small", &[8, 32, 128, 512, 1024, 4096]);
}

/// Grows a buffer from 16 bytes to `max` by doubling through `realloc`, writing its last
/// byte each time, as `Vec::push` does.
fn grow(a: &dyn GlobalAlloc, max: usize) {
    let mut layout = Layout::from_size_align(16, 8).unwrap();
    // SAFETY: each realloc uses the block's current layout; the last one is freed with it.
    unsafe {
        let mut p = a.alloc(layout);
        while layout.size() < max {
            let new = layout.size() * 2;
            p = a.realloc(p, layout, new);
            p.add(new - 1).write(1);
            layout = Layout::from_size_align(new, 8).unwrap();
        }
        a.dealloc(black_box(p), layout);
    }
}

fn realloc_growth(c: &mut Criterion) {
    let mut group = c.benchmark_group("realloc_growth");
    for max in [4096usize, 1 << 20, 16 << 20] {
        for (name, a) in [
            ("tagalloc", &TAGALLOC as &dyn GlobalAlloc),
            ("System", &System),
        ] {
            group.bench_with_input(BenchmarkId::new(name, max), &max, |b, &m| {
                b.iter(|| grow(a, m))
            });
        }
    }
    group.finish();
}

/// A producer thread allocates `n` blocks of mixed small sizes and hands them to a consumer
/// thread, which frees them: every free is a cross-thread free.
fn producer_consumer(a: &'static (dyn GlobalAlloc + Sync), n: usize) {
    let (tx, rx) = std::sync::mpsc::sync_channel::<Vec<(usize, Layout)>>(16);
    let consumer = std::thread::spawn(move || {
        for batch in rx {
            for (p, layout) in batch {
                // SAFETY: allocated by the producer with this layout, freed once here.
                unsafe { a.dealloc(p as *mut u8, layout) };
            }
        }
    });
    for chunk in 0..n / 256 {
        let batch = (0..256)
            .map(|i| {
                let layout = Layout::from_size_align(8 + (i * 37 + chunk) % 500, 8).unwrap();
                // SAFETY: a non-zero layout.
                let p = unsafe { a.alloc(layout) };
                (p as usize, layout)
            })
            .collect();
        tx.send(batch).unwrap();
    }
    drop(tx);
    consumer.join().unwrap();
}

fn cross_thread(c: &mut Criterion) {
    let mut group = c.benchmark_group("producer_consumer");
    group.sample_size(10);
    for (name, a) in [
        ("tagalloc", &TAGALLOC as &'static (dyn GlobalAlloc + Sync)),
        ("System", &System),
    ] {
        group.bench_function(name, |b| b.iter(|| producer_consumer(a, 64 * 1024)));
    }
    group.finish();
}

/// Creates and joins `n` threads, each allocating and freeing a few dozen blocks.
fn short_threads(a: &'static (dyn GlobalAlloc + Sync), n: usize) {
    for _ in 0..n {
        std::thread::spawn(move || {
            for size in [16usize, 48, 100, 256, 700, 3000] {
                let layout = Layout::from_size_align(size, 8).unwrap();
                for _ in 0..8 {
                    pair(a, layout);
                }
            }
        })
        .join()
        .unwrap();
    }
}

fn threads(c: &mut Criterion) {
    let mut group = c.benchmark_group("threads_created_and_joined");
    group.sample_size(10);
    for (name, a) in [
        ("tagalloc", &TAGALLOC as &'static (dyn GlobalAlloc + Sync)),
        ("System", &System),
    ] {
        group.bench_function(name, |b| b.iter(|| short_threads(a, 64)));
    }
    group.finish();
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
    targets = small, large, realloc_growth, cross_thread, threads
}
criterion_main!(benches);
