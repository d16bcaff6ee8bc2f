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
//! `child` or `grandchild`; the request size in bytes; the number of pairs.

use std::alloc::Layout;
use std::hint::black_box;
use tagalloc::{BlockAllocator, SystemAllocator};

tagalloc::allocator!(Tagged: child of SystemAllocator, "child_pairs child");
tagalloc::allocator!(Nested: child of Tagged, "child_pairs grandchild");

/// `pairs` alloc+free pairs of `layout` through `alloc`, touching each block.
#[inline(never)]
fn run<B: BlockAllocator>(alloc: B, layout: Layout, pairs: u64) {
    for _ in 0..pairs {
        let block = alloc.allocate_block(layout).expect("out of memory");
        // SAFETY: the block is ours, at least one byte, freed once with its layout.
        unsafe {
            block.ptr.as_ptr().write(1);
            alloc.deallocate_block(black_box(block.ptr), layout);
        }
    }
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let usage = "usage: child_pairs system|child|grandchild SIZE PAIRS";
    let (which, size, pairs) = match &args[..] {
        [_, which, size, pairs] => (
            which.as_str(),
            size.parse::<usize>().expect(usage),
            pairs.parse::<u64>().expect(usage),
        ),
        _ => panic!("{usage}"),
    };
    let layout = Layout::from_size_align(size, 8).expect("bad size");
    // One pair first, so first-use work (registration, thread cache, slot) is in both the
    // 0-pair and the N-pair runs and cancels out.
    match which {
        "system" => {
            run(SystemAllocator::new(), layout, 1);
            run(SystemAllocator::new(), layout, pairs);
        }
        "child" => {
            run(Tagged, layout, 1);
            run(Tagged, layout, pairs);
        }
        "grandchild" => {
            run(Nested, layout, 1);
            run(Nested, layout, pairs);
        }
        _ => panic!("{usage}"),
    }
    let stats = Tagged.stats();
    assert_eq!(stats.live_blocks, 0);
    println!("{which} {size} B x {pairs}: child stats {stats:?}");
}
