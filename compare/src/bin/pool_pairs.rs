//! Pool allocators against the general-purpose ones, side by side in one process: alloc+free
//! pairs and batches of 64 of small blocks on one thread, through tagalloc's `PoolSchema`
//! and `ThreadPoolSchema` (pages from the `SystemAllocator`), the `SystemAllocator` itself,
//! glibc (`System`), mimalloc, and a bump arena (bumpalo, reset every 4096 allocations: the
//! floor for an allocator that really frees).
//!
//! ```sh
//! cargo run --release -p compare --features pool-bench --bin pool_pairs [ROUNDS]
//! ```
//!
//! None of them is the global allocator here (each is called directly, through the same
//! generic code). Rounds are interleaved (every allocator, then again), so load on the shared
//! machine hits all alike; the table shows the median nanoseconds per pair (or per pair of a
//! batch) over the rounds and the ratio to mimalloc.

#[path = "../../../benches/common/mod.rs"]
mod common;

use common::{Alloc, Global};
use std::alloc::{Layout, System};
use std::hint::black_box;
use std::ptr::NonNull;
use std::time::Instant;
use tagalloc::SystemAllocator;
use tagalloc::schema::{PoolSchema, ThreadPoolSchema};

static THREAD_POOL: ThreadPoolSchema<SystemAllocator> =
    ThreadPoolSchema::new(SystemAllocator::new());

const PAIRS: u64 = 2_000_000;
const BATCHES: u64 = PAIRS / 64;

/// Nanoseconds per alloc+free pair, `PAIRS` pairs touching each block.
#[inline(never)]
fn time_pairs<A: Alloc>(a: &A, layout: Layout) -> f64 {
    let start = Instant::now();
    for _ in 0..PAIRS {
        let p = a.alloc(black_box(layout));
        // SAFETY: a live block of at least one byte, freed once with its layout.
        unsafe {
            p.as_ptr().write(1);
            a.free(black_box(p), layout);
        }
    }
    start.elapsed().as_nanos() as f64 / PAIRS as f64
}

/// Nanoseconds per pair in batches of 64 (all allocated, then all freed).
#[inline(never)]
fn time_batches<A: Alloc>(a: &A, layout: Layout) -> f64 {
    let mut ptrs = [NonNull::<u8>::dangling(); 64];
    let start = Instant::now();
    for _ in 0..BATCHES {
        for p in ptrs.iter_mut() {
            *p = a.alloc(black_box(layout));
            // SAFETY: a live block of at least one byte.
            unsafe { p.as_ptr().write(1) };
        }
        for &p in ptrs.iter() {
            // SAFETY: allocated above with this layout, freed once.
            unsafe { a.free(black_box(p), layout) };
        }
    }
    start.elapsed().as_nanos() as f64 / (BATCHES * 64) as f64
}

/// Nanoseconds per bump allocation (the arena reset every 4096), for both columns.
#[inline(never)]
fn time_bump(layout: Layout) -> f64 {
    let mut arena = bumpalo::Bump::with_capacity(4096 * 512);
    let start = Instant::now();
    for i in 0..PAIRS {
        let p = arena.alloc_layout(black_box(layout));
        // SAFETY: a live block of at least one byte.
        unsafe { p.as_ptr().write(1) };
        black_box(p);
        if i % 4096 == 4095 {
            arena.reset();
        }
    }
    start.elapsed().as_nanos() as f64 / PAIRS as f64
}

const NAMES: [&str; 6] = [
    "PoolSchema",
    "ThreadPoolSchema",
    "SystemAllocator",
    "System (glibc)",
    "mimalloc",
    "bump arena (bumpalo)",
];

/// (pair, batch) nanoseconds of allocator `which` at `layout`.
fn measure(which: usize, layout: Layout, pool: &PoolSchema<SystemAllocator>) -> (f64, f64) {
    match which {
        0 => (time_pairs(pool, layout), time_batches(pool, layout)),
        1 => (
            time_pairs(&THREAD_POOL, layout),
            time_batches(&THREAD_POOL, layout),
        ),
        2 => {
            let a = Global(SystemAllocator::new());
            (time_pairs(&a, layout), time_batches(&a, layout))
        }
        3 => (
            time_pairs(&Global(System), layout),
            time_batches(&Global(System), layout),
        ),
        4 => {
            let a = Global(mimalloc::MiMalloc);
            (time_pairs(&a, layout), time_batches(&a, layout))
        }
        _ => {
            let t = time_bump(layout);
            (t, t)
        }
    }
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() {
    let rounds: usize = std::env::args()
        .nth(1)
        .map_or(7, |s| s.parse().expect("usage: pool_pairs [ROUNDS]"));
    let pool = PoolSchema::new(SystemAllocator::new());
    let sizes = [32usize, 256];
    // times[size][allocator] = (pairs, batches) per round.
    let mut times = vec![vec![(Vec::new(), Vec::new()); NAMES.len()]; sizes.len()];
    for round in 0..rounds {
        for (s, &size) in sizes.iter().enumerate() {
            let layout = Layout::from_size_align(size, 8).unwrap();
            // Rotate the order each round, as the workload harness does.
            for k in 0..NAMES.len() {
                let which = (k + round) % NAMES.len();
                let (pair, batch) = measure(which, layout, &pool);
                times[s][which].0.push(pair);
                times[s][which].1.push(batch);
            }
        }
    }
    println!(
        "ns per alloc+free pair, median of {rounds} interleaved rounds ({PAIRS} pairs each); \
         batch = 64 allocations then 64 frees; ratio to mimalloc in brackets\n"
    );
    println!("| allocator | 32 B pair | 32 B batch | 256 B pair | 256 B batch |");
    println!("|---|---:|---:|---:|---:|");
    let medians: Vec<Vec<(f64, f64)>> = times
        .iter_mut()
        .map(|per| {
            per.iter_mut()
                .map(|(p, b)| (median(p), median(b)))
                .collect()
        })
        .collect();
    for (which, name) in NAMES.iter().enumerate() {
        let mut row = format!("| {name} |");
        for per in &medians {
            let (mp, mb) = per[4];
            let (p, b) = per[which];
            row += &format!(" {p:.2} ({:.2}) | {b:.2} ({:.2}) |", p / mp, b / mb);
        }
        println!("{row}");
    }
}
