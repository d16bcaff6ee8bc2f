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

macro_rules! tags {
    ($($name:ident)*) => {
        $(tagalloc::allocator!($name: child of SystemAllocator, "bench tag");)*
        /// Entering each of the 64 tags.
        const ENTER: &[fn() -> tagalloc::TagGuard] = &[$(|| $name.enter()),*];
    };
}

tags!(T00 T01 T02 T03 T04 T05 T06 T07 T08 T09 T10 T11 T12 T13 T14 T15 T16 T17 T18 T19 T20 T21
    T22 T23 T24 T25 T26 T27 T28 T29 T30 T31 T32 T33 T34 T35 T36 T37 T38 T39 T40 T41 T42 T43 T44
    T45 T46 T47 T48 T49 T50 T51 T52 T53 T54 T55 T56 T57 T58 T59 T60 T61 T62 T63);

/// Sizes of the 10 classes each tag holds a block of.
const SIZES: [usize; 10] = [32, 48, 64, 96, 128, 256, 512, 1024, 2048, 4096];

fn resident() -> usize {
    OsAllocator::process_resident_bytes().unwrap_or(0)
}

/// Resident memory added by 64 tags each holding one block of each of 10 classes.
fn memory_of_tags() {
    // Warm the untagged side first, so that only the tags' share is measured.
    let warm: Vec<Vec<u8>> = SIZES.iter().map(|&s| Vec::with_capacity(s)).collect();
    let before = resident();
    let held: Vec<Vec<Vec<u8>>> = ENTER
        .iter()
        .map(|enter| {
            let _tag = enter();
            SIZES
                .iter()
                .map(|&s| {
                    let mut v = Vec::with_capacity(s);
                    v.push(1u8);
                    v
                })
                .collect()
        })
        .collect();
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
