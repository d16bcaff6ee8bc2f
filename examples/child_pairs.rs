//! Alloc+free pairs through the SystemAllocator, a child of it and a grandchild, for
//! counting instructions per pair under `valgrind --tool=callgrind` (deterministic, unlike
//! timings on a shared machine):
//!
//! ```text
//! cargo build --release --example child_pairs
//! valgrind --tool=callgrind --callgrind-out-file=/dev/null \
//!     target/release/examples/child_pairs child 16 1000000
//! ```
//!
//! Instructions per pair = (Ir with N pairs − Ir with 0 pairs) / N. Arguments: `system`,
//! `child`, `grandchild` or `lean` (a child declared with `requested_bytes: false`, which
//! keeps every figure of a child but the requested bytes); the request size in bytes; the number of pairs; optionally how
//! the layout reaches each call: `hoisted` (the default: one runtime value for the whole
//! loop, which lets the compiler move the size check and class lookup of the simplest
//! path, the `SystemAllocator`'s, out of the loop), `opaque` (hidden from the optimiser at
//! every call, as a layout computed per call is), `const` (a compile-time constant, as
//! for `Box<T>`; sizes 16, 20 and 1024 only), `batch` (64 allocations, then their 64 frees:
//! the bins refill and overflow, so the slow paths count too; PAIRS should be a multiple of
//! 64) or `random` (each pair a size drawn from SIZE/2 to SIZE, in a fixed pseudo-random
//! order, so that a branch on the size cannot be predicted; run with
//! `valgrind --tool=callgrind --branch-sim=yes` to count mispredictions).

use std::alloc::Layout;
use std::hint::black_box;
use tagalloc::{BlockAllocator, SystemAllocator};

tagalloc::allocator!(Tagged: child of SystemAllocator, "child_pairs child");
tagalloc::allocator!(Nested: child of Tagged, "child_pairs grandchild");
tagalloc::allocator!(
    Lean: child of SystemAllocator { requested_bytes: false },
    "child_pairs child without requested bytes"
);

/// `pairs` alloc+free pairs of `layout` through `alloc`, touching each block.
#[inline(never)]
fn run<B: BlockAllocator>(alloc: B, layout: Layout, pairs: u64) {
    for _ in 0..pairs {
        pair(alloc, layout);
    }
}

/// As [`run`], the layout hidden from the optimiser at every call.
#[inline(never)]
fn run_opaque<B: BlockAllocator>(alloc: B, layout: Layout, pairs: u64) {
    for _ in 0..pairs {
        pair(alloc, black_box(layout));
    }
}

/// As [`run`], with a layout known at compile time.
#[inline(never)]
fn run_const<B: BlockAllocator, const SIZE: usize>(alloc: B, pairs: u64) {
    let layout = Layout::from_size_align(SIZE, 8).unwrap();
    for _ in 0..pairs {
        pair(alloc, layout);
    }
}

/// `pairs` allocations and frees in batches of 64 (all allocated, then all freed).
#[inline(never)]
fn run_batches<B: BlockAllocator>(alloc: B, layout: Layout, pairs: u64) {
    let mut ptrs = [std::ptr::NonNull::<u8>::dangling(); 64];
    for _ in 0..pairs / 64 {
        for p in ptrs.iter_mut() {
            let block = alloc
                .allocate_block(black_box(layout))
                .expect("out of memory");
            *p = block.ptr;
        }
        for &p in ptrs.iter() {
            // SAFETY: each block was allocated above with `layout`, freed once.
            unsafe { alloc.deallocate_block(black_box(p), black_box(layout)) };
        }
    }
}

/// `pairs` pairs of sizes drawn at random from `layout.size() / 2 ..= layout.size()` (a
/// fixed pseudo-random sequence), so that branches on the size do not predict.
#[inline(never)]
fn run_random<B: BlockAllocator>(alloc: B, layout: Layout, pairs: u64) {
    let top = layout.size();
    let mut seed = 0x2545_f491_4f6c_dd1du64;
    let layouts: Vec<Layout> = (0..4096)
        .map(|_| {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            let size = top / 2 + (seed as usize) % (top - top / 2 + 1);
            Layout::from_size_align(size, layout.align()).unwrap()
        })
        .collect();
    for i in 0..pairs {
        pair(alloc, layouts[i as usize & 4095]);
    }
}

/// `pairs` pairs the way the command line asks (see the module docs).
fn run_mode<B: BlockAllocator>(alloc: B, layout: Layout, pairs: u64, mode: &str) {
    match (mode, layout.size()) {
        ("hoisted", _) => run(alloc, layout, pairs),
        ("opaque", _) => run_opaque(alloc, layout, pairs),
        ("batch", _) => run_batches(alloc, layout, pairs),
        ("random", _) => run_random(alloc, layout, pairs),
        ("const", 16) => run_const::<B, 16>(alloc, pairs),
        ("const", 20) => run_const::<B, 20>(alloc, pairs),
        ("const", 1024) => run_const::<B, 1024>(alloc, pairs),
        _ => panic!("mode: hoisted, opaque, batch, random, or const with size 16, 20 or 1024"),
    }
}

/// One alloc+free pair, touching the block.
#[inline(always)]
fn pair<B: BlockAllocator>(alloc: B, layout: Layout) {
    let block = alloc.allocate_block(layout).expect("out of memory");
    // SAFETY: the block is ours, at least one byte, freed once with its layout.
    unsafe {
        block.ptr.as_ptr().write(1);
        alloc.deallocate_block(black_box(block.ptr), layout);
    }
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let usage = "usage: child_pairs system|child|grandchild|lean SIZE PAIRS [hoisted|opaque|const|batch|random]";
    let (which, size, pairs, mode) = match &args[..] {
        [_, which, size, pairs, rest @ ..] if rest.len() <= 1 => (
            which.as_str(),
            size.as_str(),
            pairs.parse::<u64>().expect(usage),
            rest.first().map_or("hoisted", String::as_str),
        ),
        _ => panic!("{usage}"),
    };
    // SIZE or SIZE@ALIGN (alignment 8 unless given).
    let (size, align) = match size.split_once('@') {
        Some((s, a)) => (s.parse::<usize>().expect(usage), a.parse().expect(usage)),
        None => (size.parse::<usize>().expect(usage), 8),
    };
    let layout = Layout::from_size_align(size, align).expect("bad size or alignment");
    // One pair first, so first-use work (registration, thread cache, slot, lane) is in both
    // the 0-pair and the N-pair runs and cancels out. Then the thread cache goes back to the
    // heap, so that every run starts from the same heap: a child's first pair takes the
    // general path (its lane is claimed after it), which left that refill's other blocks in
    // the `SystemAllocator`'s lane, and with 64 slots of 1 KiB per page those few blocks put
    // every batch of 64 across two pages (pages then empty and return to the pool about every
    // third batch: 1 KiB batches cost 120 instructions per pair instead of 109, system or
    // child alike).
    let warm_up = |run_one: &dyn Fn()| {
        run_one();
        SystemAllocator::new().flush_thread_cache();
    };
    let start = std::time::Instant::now();
    match which {
        "system" => {
            warm_up(&|| run(SystemAllocator::new(), layout, 1));
            run_mode(SystemAllocator::new(), layout, pairs, mode);
        }
        "child" => {
            warm_up(&|| run(Tagged, layout, 1));
            run_mode(Tagged, layout, pairs, mode);
        }
        "grandchild" => {
            warm_up(&|| run(Nested, layout, 1));
            run_mode(Nested, layout, pairs, mode);
        }
        "lean" => {
            warm_up(&|| run(Lean, layout, 1));
            run_mode(Lean, layout, pairs, mode);
        }
        _ => panic!("{usage}"),
    }
    let elapsed = start.elapsed();
    let stats = Tagged.stats();
    assert_eq!(stats.live_blocks, 0);
    println!(
        "{which} {size} B x {pairs}: {:.2} ns per pair; child stats {stats:?}",
        elapsed.as_nanos() as f64 / pairs.max(1) as f64
    );
}
