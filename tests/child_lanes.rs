//! Child allocators served from their own lanes of the thread caches (`src/allocator/lanes.rs`):
//! exact figures on one thread and across threads, through thread exit, and across every
//! switch between the lane and the general path (a budget set and removed, records turned on
//! and off, a budget on the parent of a child with a lane).
//!
//! This binary declares exactly as many children as there are lanes, so each one gets a lane
//! whatever order the tests run in (the first children to allocate get them).

mod common;

use allocator_api2::alloc::Allocator;
use std::alloc::Layout;
use std::ptr::NonNull;
use std::sync::{Barrier, mpsc};
use tagalloc::{BlockAllocator, BudgetMode, RecordMode, SystemAllocator};

tagalloc::allocator!(Exact: child of SystemAllocator, "exact on one thread");
tagalloc::allocator!(Crossing: child of SystemAllocator, "cross-thread frees");
tagalloc::allocator!(Budgeted: child of SystemAllocator, "budget set after use");
tagalloc::allocator!(Recorded: child of SystemAllocator, "records turned on after use");
tagalloc::allocator!(Parent: child of SystemAllocator, "parent with a budget");
tagalloc::allocator!(Kid: child of Parent, "grandchild with a lane");
tagalloc::allocator!(Leaver: child of SystemAllocator, "threads that exit");

/// A block in flight between threads.
struct Block(NonNull<u8>, Layout);
// SAFETY: the block is owned by whoever holds this value; the allocator is thread-safe.
unsafe impl Send for Block {}

/// The granted size of a small request (what a probe allocation reports).
fn granted(layout: Layout) -> usize {
    let block = SystemAllocator::new().allocate_block(layout).unwrap();
    // SAFETY: just allocated with `layout`, freed once.
    unsafe { SystemAllocator::new().deallocate_block(block.ptr, layout) }
}

/// Allocates `layout` through `alloc`, writes a pattern and checks the block.
fn take<A: BlockAllocator>(alloc: A, layout: Layout) -> NonNull<u8> {
    let block = alloc.allocate_block(layout).expect("out of memory");
    assert!(block.size >= layout.size());
    assert_eq!(block.ptr.as_ptr() as usize % layout.align(), 0);
    // SAFETY: the block holds at least `layout.size()` bytes.
    unsafe { block.ptr.as_ptr().write_bytes(0xA5, layout.size()) };
    block.ptr
}

/// Frees a block from [`take`], checking its pattern first.
fn give<A: BlockAllocator>(alloc: A, ptr: NonNull<u8>, layout: Layout) -> usize {
    // SAFETY: `ptr` is a live block of `alloc` with `layout`, written by `take`.
    unsafe {
        assert!(
            std::slice::from_raw_parts(ptr.as_ptr(), layout.size())
                .iter()
                .all(|&b| b == 0xA5)
        );
        alloc.deallocate_block(ptr, layout)
    }
}

fn small(i: usize) -> Layout {
    Layout::from_size_align(1 + (i * 37) % 1024, 1 << (i % 7)).unwrap()
}

#[test]
fn a_lane_counts_exactly_on_one_thread() {
    let start = Exact.stats();
    let mut live = Vec::new();
    let (mut granted_sum, mut requested_sum) = (0, 0);
    for i in 0..5_000 {
        let layout = small(i);
        live.push((take(Exact, layout), layout));
        granted_sum += granted(layout);
        requested_sum += layout.size();
    }
    assert!(
        Exact::registration().has_thread_cache_lane(),
        "the child took a lane"
    );
    // The reports say which children are on their lane.
    let json: serde_json::Value = serde_json::from_str(&tagalloc::report::json()).unwrap();
    let entry = json["allocators"]
        .as_array()
        .unwrap()
        .iter()
        .find(|a| a["name"] == "Exact")
        .unwrap();
    assert_eq!(entry["thread_cache_lane"], true);
    let tree = tagalloc::report::tree();
    let line = tree.lines().find(|l| l.contains("Exact ")).unwrap();
    // The lane is an internal matter: the JSON says it, the tree for people does not.
    assert!(!line.contains("lane"), "{line}");
    let st = Exact.stats();
    assert_eq!(st.live_blocks, start.live_blocks + 5_000);
    assert_eq!(
        st.live_granted_bytes,
        start.live_granted_bytes + granted_sum
    );
    assert_eq!(
        st.live_requested_bytes,
        Some(start.live_requested_bytes.unwrap() + requested_sum)
    );
    assert_eq!(st.allocations, start.allocations + 5_000);
    assert!(st.peak_granted_bytes.unwrap() >= st.live_granted_bytes);
    let all = std::mem::take(&mut live);
    for (i, (ptr, layout)) in all.into_iter().enumerate() {
        if i % 2 == 0 {
            give(Exact, ptr, layout);
        } else {
            live.push((ptr, layout));
        }
    }
    let half = Exact.stats();
    assert_eq!(half.live_blocks, start.live_blocks + live.len());
    for (ptr, layout) in live.drain(..) {
        give(Exact, ptr, layout);
    }
    let end = Exact.stats();
    assert_eq!(end.live_blocks, start.live_blocks);
    assert_eq!(end.live_granted_bytes, start.live_granted_bytes);
    assert_eq!(end.live_requested_bytes, start.live_requested_bytes);
    assert_eq!(end.frees, start.frees + 5_000);
}

#[test]
fn lane_blocks_freed_on_other_threads_leave_every_counter_exact() {
    const THREADS: usize = 4;
    const PER_THREAD: usize = 3_000;
    let start = Crossing.stats();
    let held = Barrier::new(THREADS + 1);
    let checked = Barrier::new(THREADS + 1);
    let (senders, receivers): (Vec<_>, Vec<_>) =
        (0..THREADS).map(|_| mpsc::channel::<Block>()).unzip();
    let (mut granted_sum, mut requested_sum) = (0, 0);
    for t in 0..THREADS {
        for i in 0..PER_THREAD {
            granted_sum += granted(small(t * PER_THREAD + i));
            requested_sum += small(t * PER_THREAD + i).size();
        }
    }
    let while_held = std::thread::scope(|s| {
        for (t, rx) in receivers.into_iter().enumerate() {
            let to_next = senders[(t + 1) % THREADS].clone();
            let (held, checked) = (&held, &checked);
            s.spawn(move || {
                let mut mine = Vec::new();
                for i in 0..PER_THREAD {
                    let layout = small(t * PER_THREAD + i);
                    mine.push(Block(take(Crossing, layout), layout));
                }
                held.wait();
                checked.wait();
                for block in mine {
                    to_next.send(block).unwrap();
                }
                drop(to_next);
                for Block(ptr, layout) in rx {
                    give(Crossing, ptr, layout);
                }
            });
        }
        drop(senders);
        held.wait();
        let st = Crossing.stats();
        checked.wait();
        st
    });
    assert!(Crossing::registration().has_thread_cache_lane());
    let total = THREADS * PER_THREAD;
    assert_eq!(while_held.live_blocks, start.live_blocks + total);
    assert_eq!(
        while_held.live_granted_bytes,
        start.live_granted_bytes + granted_sum
    );
    assert_eq!(
        while_held.live_requested_bytes,
        Some(start.live_requested_bytes.unwrap() + requested_sum)
    );
    assert!(while_held.peak_granted_bytes.unwrap() >= while_held.live_granted_bytes);
    let end = Crossing.stats();
    assert_eq!(end.live_blocks, start.live_blocks);
    assert_eq!(end.live_granted_bytes, start.live_granted_bytes);
    assert_eq!(end.live_requested_bytes, start.live_requested_bytes);
    assert_eq!(end.allocations, start.allocations + total as u64);
    assert_eq!(end.frees, start.frees + total as u64);
    assert!(end.peak_granted_bytes.unwrap() >= start.live_granted_bytes + granted_sum);
}

#[test]
fn a_budget_set_after_lane_use_starts_from_the_exact_live_figure() {
    let layout = Layout::from_size_align(64, 8).unwrap();
    // Blocks allocated through the lane on this thread and on another thread that stays
    // alive (its lane's bytes must reach the budget's figure too).
    let mine: Vec<_> = (0..100).map(|_| take(Budgeted, layout)).collect();
    assert!(Budgeted::registration().has_thread_cache_lane());
    let (to_worker, from_main) = mpsc::channel::<()>();
    let (to_main, from_worker) = mpsc::channel::<Vec<Block>>();
    std::thread::scope(|s| {
        // Owned here, so a failed check below drops it and lets the worker finish (the
        // scope waits for it).
        let to_worker = to_worker;
        s.spawn(move || {
            let theirs: Vec<_> = (0..100)
                .map(|_| Block(take(Budgeted, layout), layout))
                .collect();
            to_main.send(theirs).unwrap();
            from_main.recv().unwrap(); // stay alive until the budget was checked
        });
        let theirs = from_worker.recv().unwrap();
        let live = Budgeted.stats().live_granted_bytes;
        assert_eq!(live, 200 * granted(layout));
        // Room for exactly two more blocks.
        common::messages::capture();
        Budgeted.set_budget(Some(live + 2 * granted(layout)), BudgetMode::Fail);
        let a = take(Budgeted, layout);
        let b = take(Budgeted, layout);
        assert!(
            Budgeted.allocate(layout).is_err(),
            "the third block goes over the budget: the figure includes both threads' lanes"
        );
        let st = Budgeted.stats();
        assert_eq!(st.budget_failures, 1);
        assert!(common::messages::captured(&format!(
            "tagalloc: allocator \"Budgeted\" over its budget of {} bytes",
            live + 2 * granted(layout)
        )));
        assert_eq!(st.live_blocks, 202);
        assert_eq!(st.peak_granted_bytes, Some(live + 2 * granted(layout)));
        // Frees of lane blocks while the budget is set are counted exactly too.
        give(Budgeted, a, layout);
        let c = take(Budgeted, layout);
        assert!(Budgeted.allocate(layout).is_err());
        for Block(ptr, layout) in theirs {
            give(Budgeted, ptr, layout);
        }
        to_worker.send(()).unwrap();
        // Back on the lane.
        Budgeted.set_budget(None, BudgetMode::Warn);
        let more: Vec<_> = (0..50).map(|_| take(Budgeted, layout)).collect();
        let st = Budgeted.stats();
        assert_eq!(st.live_blocks, 100 + 2 + 50);
        assert_eq!(st.live_granted_bytes, 152 * granted(layout));
        for ptr in more.into_iter().chain([b, c]).chain(mine) {
            give(Budgeted, ptr, layout);
        }
    });
    let end = Budgeted.stats();
    assert_eq!((end.live_blocks, end.live_granted_bytes), (0, 0));
    assert_eq!(end.live_requested_bytes, Some(0));
    assert_eq!(end.allocations, end.frees);
}

#[test]
fn records_turned_on_after_lane_use_see_new_blocks_and_counts_stay_exact() {
    let layout = Layout::from_size_align(48, 8).unwrap();
    let before: Vec<_> = (0..64).map(|_| take(Recorded, layout)).collect();
    assert!(Recorded::registration().has_thread_cache_lane());
    Recorded.set_records(RecordMode::Basic);
    let recorded: Vec<_> = (0..10).map(|_| take(Recorded, layout)).collect();
    let mut dump = Vec::new();
    tagalloc::report::dump_records(&mut dump).unwrap();
    let dump = String::from_utf8(dump).unwrap();
    for ptr in &recorded {
        let address = format!("{:#x}", ptr.as_ptr() as usize);
        assert!(dump.contains(&address), "{address} recorded");
    }
    // Blocks from before (no record) and after go back the same way.
    for ptr in before.into_iter().chain(recorded) {
        give(Recorded, ptr, layout);
    }
    Recorded.set_records(RecordMode::Off);
    let after: Vec<_> = (0..64).map(|_| take(Recorded, layout)).collect();
    let st = Recorded.stats();
    assert_eq!(st.live_blocks, 64);
    assert_eq!(st.live_granted_bytes, 64 * granted(layout));
    for ptr in after {
        give(Recorded, ptr, layout);
    }
    let end = Recorded.stats();
    assert_eq!((end.live_blocks, end.live_granted_bytes), (0, 0));
    assert_eq!(end.allocations, 138);
}

#[test]
fn a_grandchild_lane_counts_in_its_parent_and_obeys_its_parents_budget() {
    let layout = Layout::from_size_align(128, 8).unwrap();
    let mine: Vec<_> = (0..40).map(|_| take(Kid, layout)).collect();
    assert!(Kid::registration().has_thread_cache_lane());
    let g = granted(layout);
    assert_eq!(Kid.stats().live_granted_bytes, 40 * g);
    assert_eq!(
        Parent.stats().live_granted_bytes,
        40 * g,
        "the parent sees its child's lane"
    );
    assert_eq!(Parent.stats().live_blocks, 40);
    common::messages::capture();
    Parent.set_budget(Some(41 * g), BudgetMode::Fail);
    let one = take(Kid, layout);
    assert!(
        Kid.allocate(layout).is_err(),
        "the parent's budget stops the grandchild"
    );
    assert_eq!(Parent.stats().budget_failures, 1);
    assert_eq!(
        Kid.stats().budget_failures,
        1,
        "counted where the request came in"
    );
    assert!(common::messages::captured(&format!(
        "tagalloc: allocator \"Parent\" over its budget of {} bytes",
        41 * g
    )));
    Parent.set_budget(None, BudgetMode::Warn);
    let two = take(Kid, layout);
    assert_eq!(Parent.stats().live_blocks, 42);
    for ptr in mine.into_iter().chain([one, two]) {
        give(Kid, ptr, layout);
    }
    let (kid, parent) = (Kid.stats(), Parent.stats());
    assert_eq!((kid.live_blocks, kid.live_granted_bytes), (0, 0));
    assert_eq!((parent.live_blocks, parent.live_granted_bytes), (0, 0));
    assert_eq!(parent.live_requested_bytes, Some(0));
    assert_eq!(parent.allocations, 42);
    assert_eq!(parent.frees, 42);
}

#[test]
fn a_thread_that_exits_hands_its_lane_counts_on() {
    let start = Leaver.stats();
    let layout = Layout::from_size_align(200, 8).unwrap();
    // Resized on the thread: five in place (the class stays), five into another class.
    let (same, other) = (196, 600);
    let kept: Vec<Block> = (0..8)
        .flat_map(|_| {
            std::thread::spawn(move || {
                let mine: Vec<_> = (0..50).map(|_| take(Leaver, layout)).collect();
                // Free some on the thread itself, keep the rest past its exit.
                let (gone, kept) = mine.split_at(20);
                for &ptr in gone {
                    give(Leaver, ptr, layout);
                }
                let mut kept: Vec<Block> = kept.iter().map(|&p| Block(p, layout)).collect();
                for (i, Block(ptr, layout)) in kept.iter_mut().take(10).enumerate() {
                    let size = if i < 5 { same } else { other };
                    // SAFETY: a live block of `Leaver` with `layout`.
                    let (block, _) = unsafe { Leaver.reallocate_block(*ptr, *layout, size) }
                        .expect("out of memory");
                    *layout = Layout::from_size_align(size, 8).unwrap();
                    *ptr = block.ptr;
                    // SAFETY: the block holds `size` bytes; `give` checks this pattern.
                    unsafe { ptr.as_ptr().write_bytes(0xA5, size) };
                }
                kept
            })
            .join()
            .unwrap()
        })
        .collect();
    assert!(Leaver::registration().has_thread_cache_lane());
    let st = Leaver.stats();
    let at = |size| Layout::from_size_align(size, 8).unwrap();
    let kept_granted = 20 * granted(layout) + 5 * granted(at(same)) + 5 * granted(at(other));
    assert_eq!(st.live_blocks, start.live_blocks + 8 * 30);
    assert_eq!(
        st.live_granted_bytes,
        start.live_granted_bytes + 8 * kept_granted
    );
    assert_eq!(
        st.live_requested_bytes.unwrap(),
        start.live_requested_bytes.unwrap() + 8 * (20 * 200 + 5 * same + 5 * other)
    );
    assert_eq!(st.allocations, start.allocations + 8 * 50);
    assert_eq!(st.frees, start.frees + 8 * 20);
    assert_eq!(st.reallocations, start.reallocations + 8 * 10);
    assert!(st.peak_granted_bytes.unwrap() >= st.live_granted_bytes);
    for Block(ptr, layout) in kept {
        give(Leaver, ptr, layout);
    }
    let end = Leaver.stats();
    assert_eq!(end.live_blocks, start.live_blocks);
    assert_eq!(end.live_granted_bytes, start.live_granted_bytes);
    assert_eq!(end.live_requested_bytes, start.live_requested_bytes);
    assert_eq!(end.frees, start.frees + 8 * 50);
}
