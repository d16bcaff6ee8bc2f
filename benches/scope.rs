//! What scoped tags cost, with tagalloc as the global allocator (as programs use them).
//!
//! Run with `cargo bench --bench scope`. It prints, before criterion's timings:
//! - the resident memory 64 tags add when each holds one block in each of 10 size classes
//!   (a partly used page per class and tag, plus their lanes: the price of page segregation);
//!
//! and times:
//! - entering and leaving a scope (`enter` and the guard's drop), for a tag with a lane built
//!   into the thread caches and for one past them (a lane made on demand);
//! - a small alloc+free pair (a 32-byte `Vec`) outside any scope, inside a scope of each of
//!   those tags, and outside any scope once tags are in use (every free then asks the block
//!   for its tag).
//!
//! The measured numbers are in `docs/performance.md`.

use criterion::{Criterion, black_box};
use std::time::Duration;
use tagalloc::SystemAllocator;
use tagalloc::os::OsAllocator;

#[global_allocator]
static GLOBAL: SystemAllocator = SystemAllocator::new();

#[path = "../tests/common/tags64.rs"]
mod tags64;
use tags64::ENTER;

fn resident() -> usize {
    OsAllocator::process_resident_bytes().unwrap_or(0)
}

/// Resident memory added by 64 tags each holding one block of each of 10 classes.
fn memory_of_tags() {
    // Warm the untagged side first, so that only the tags' share is measured.
    let warm = tags64::untagged_blocks();
    let before = resident();
    let held = tags64::one_block_of_each_class_in_each_tag();
    let after = resident();
    println!(
        "memory: 64 tags x 10 size classes, one block each: +{:.2} MiB resident ({} KiB)",
        (after.saturating_sub(before)) as f64 / (1 << 20) as f64,
        after.saturating_sub(before) / 1024
    );
    drop((held, warm));
}

fn pair() -> usize {
    let mut v: Vec<u8> = Vec::with_capacity(black_box(32));
    v.push(1);
    black_box(v).len()
}

fn main() {
    memory_of_tags();
    // T00..T06 took the lanes built into the caches (the first tags claimed); T63 has one
    // made on demand.
    let (near, far) = (ENTER[0], ENTER[63]);
    let mut c = Criterion::default()
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(3))
        .configure_from_args();
    let mut group = c.benchmark_group("scope");
    group.bench_function("enter+leave, built-in lane", |b| {
        b.iter(|| drop(black_box(near())))
    });
    group.bench_function("enter+leave, lane made on demand", |b| {
        b.iter(|| drop(black_box(far())))
    });
    group.bench_function("pair, untagged", |b| b.iter(pair));
    group.bench_function("pair, in a scope (built-in lane)", |b| {
        let _tag = near();
        b.iter(pair)
    });
    group.bench_function("pair, in a scope (lane made on demand)", |b| {
        let _tag = far();
        b.iter(pair)
    });
    group.finish();
    c.final_summary();
}
