//! An allocator's first scope marks tags as in use, also when the allocator already had its
//! tag from calls through its handle, and for threads whose caches were registered before:
//! in a fresh process (its own binary, harness = false), a child used through its handle
//! first, then entered; a block allocated in the scope and freed by a thread that was
//! already running counts back in the child.

use allocator_api2::vec::Vec as ApiVec;
use std::hint::black_box;
use std::sync::mpsc;
use tagalloc::SystemAllocator;

#[global_allocator]
static GLOBAL: SystemAllocator = SystemAllocator::new();

tagalloc::allocator!(Assets: child of SystemAllocator, "used through its handle, then entered");

fn main() {
    // Claims the child's tag through its handle; no scope entered yet.
    let mut through_handle = ApiVec::new_in(Assets);
    through_handle.extend_from_slice(&[1u8; 48]);
    assert_eq!(Assets.stats().live_blocks, 1);

    // A thread whose cache registers (it allocates) before any scope is entered.
    let (to_worker, blocks) = mpsc::channel::<Vec<u8>>();
    let (ready, registered) = mpsc::channel::<()>();
    let worker = std::thread::spawn(move || {
        black_box(vec![0u8; 40]);
        ready.send(()).unwrap();
        for block in blocks {
            drop(black_box(block));
        }
    });
    registered.recv().unwrap();

    let scoped = {
        let _tag = Assets.enter();
        let mut v = Vec::with_capacity(black_box(40));
        v.push(7u8);
        v
    };
    assert_eq!(
        Assets.stats().live_blocks,
        2,
        "the scoped block counts in the child"
    );
    to_worker.send(scoped).unwrap();
    drop(to_worker);
    worker.join().unwrap();
    assert_eq!(
        Assets.stats().live_blocks,
        1,
        "freed on the worker, the block went back to the child"
    );
    drop(through_handle);
    let st = Assets.stats();
    assert_eq!((st.live_blocks, st.live_granted_bytes), (0, 0));
    println!("scope_first_enter: ok");
}
