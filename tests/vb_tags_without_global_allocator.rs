//! Tags with run-time names never allocate through the global allocator: interning a name uses
//! pages from tagalloc's OS layer, and a tagged allocation in a block that has seen the tag
//! finds it without allocating. So both may be used from allocator code.
//!
//! The global allocator here counts the calls made by the current thread (a const-initialised
//! thread-local without destructor, safe inside an allocator), so the test harness's own
//! threads do not disturb the count.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;

use tagalloc::virtual_block::{Request, Tag, VirtualBlock};

struct Counting;

thread_local! {
    static CALLS: Cell<u64> = const { Cell::new(0) };
}

// SAFETY: every call is forwarded to `System` unchanged; counting has no effect on memory.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        CALLS.with(|c| c.set(c.get() + 1));
        // SAFETY: forwarded with the caller's layout.
        unsafe { System.alloc(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        CALLS.with(|c| c.set(c.get() + 1));
        // SAFETY: `ptr` came from `alloc` above with this layout.
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        CALLS.with(|c| c.set(c.get() + 1));
        // SAFETY: forwarded with the caller's arguments.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

fn calls() -> u64 {
    CALLS.with(Cell::get)
}

#[test]
fn interning_and_tagged_allocations_do_not_allocate_globally() {
    // Names built on the stack, as allocator code would.
    let mut text = *b"subsystem 00";
    let mut block = VirtualBlock::<()>::new(1 << 20);
    let first = Tag::intern("subsystem warm-up");
    let mut live = [None; 64];
    let mut churn = |block: &mut VirtualBlock<()>| {
        for _ in 0..10 {
            for (k, slot) in live.iter_mut().enumerate() {
                if let Some(a) = slot.take() {
                    block.free(a).unwrap();
                }
                let r = Request::new(64 + k as u64).align(16).tag(first);
                *slot = Some(block.allocate(&r, ()).unwrap());
            }
        }
    };
    // The block's own tables grow the first time it sees a tag or reaches a new high of
    // ranges (documented, like any Vec): the same churn once warms them up.
    churn(&mut block);
    let before = calls();
    let mut tags = [first; 100];
    for (i, tag) in tags.iter_mut().enumerate() {
        text[10] = b'0' + (i / 10) as u8;
        text[11] = b'0' + (i % 10) as u8;
        *tag = Tag::intern(std::str::from_utf8(&text).unwrap());
    }
    churn(&mut block);
    assert_eq!(calls(), before, "no call reached the global allocator");
    assert_eq!(tags[42].name(), "subsystem 42");
    assert_eq!(tags[42], Tag::intern("subsystem 42"));
}
