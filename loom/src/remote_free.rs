//! The cross-thread free path: threads that do not own a heap push the blocks they free onto
//! its remote stack while the owner takes the stack back whole. Every block pushed reaches
//! the owner exactly once, and what a freeing thread wrote to a block (its link, the
//! program's last writes) is ordered before the owner's reuse of it: the block's words are
//! loom cells, which report an access not ordered after the previous one.

use crate::model;
use crate::remote::{Link, RemoteStack};
use loom::cell::UnsafeCell;
use loom::sync::Arc;
use loom::sync::atomic::AtomicPtr;
use loom::thread;
use std::ptr::null_mut;

/// A block of the owner's pages.
struct Block {
    /// The first word, the stack's link (as a pool block's free-slot link).
    next: UnsafeCell<*mut Block>,
    /// The program's data.
    data: UnsafeCell<usize>,
    id: usize,
}

impl Link for Block {
    unsafe fn set_next(node: *mut Self, next: *mut Self) {
        // SAFETY: the caller owns the block (loom checks it).
        unsafe { (*node).next.with_mut(|p| *p = next) };
    }

    unsafe fn next(node: *mut Self) -> *mut Self {
        // SAFETY: as above.
        unsafe { (*node).next.with(|p| *p) }
    }
}

/// The owner's heap: the blocks it handed out (by address, to send them to other threads) and
/// its remote stack.
struct Heap {
    blocks: Vec<usize>,
    remote: RemoteStack<Block>,
}

// SAFETY: the model reaches the blocks only as the protocol allows, which is what
// loom's cells check.
unsafe impl Send for Heap {}
// SAFETY: as above.
unsafe impl Sync for Heap {}

impl Heap {
    fn new(n: usize) -> Arc<Self> {
        let blocks = (0..n)
            .map(|id| {
                Box::into_raw(Box::new(Block {
                    next: UnsafeCell::new(null_mut()),
                    data: UnsafeCell::new(0),
                    id,
                }))
                .addr()
            })
            .collect();
        Arc::new(Self {
            blocks,
            remote: RemoteStack {
                head: AtomicPtr::new(null_mut()),
            },
        })
    }

    fn block(&self, id: usize) -> *mut Block {
        std::ptr::with_exposed_provenance_mut(self.blocks[id])
    }

    /// Another thread's free of block `id`: its last write, then the push.
    fn free_remote(&self, id: usize) {
        let b = self.block(id);
        // SAFETY: the block is this thread's until pushed; loom checks the accesses.
        unsafe {
            (*b).data.with_mut(|d| *d = 100 + id);
            self.remote.push(b);
        }
    }

    /// The owner takes the stack back and reuses each block (reads the freer's write, then
    /// writes its own); returns the blocks' ids.
    fn drain(&self, seen: &mut Vec<usize>) {
        let mut b = self.remote.take_all();
        while !b.is_null() {
            // SAFETY: taken blocks are the owner's again; loom checks the accesses.
            unsafe {
                let id = (*b).id;
                assert_eq!(
                    (*b).data.with(|d| *d),
                    100 + id,
                    "the freer's write is visible"
                );
                (*b).data.with_mut(|d| *d = 0);
                seen.push(id);
                b = Block::next(b);
            }
        }
    }
}

impl Drop for Heap {
    fn drop(&mut self) {
        for &addr in &self.blocks {
            // SAFETY: made by `Box::into_raw` in `new`; nobody uses them any more.
            drop(unsafe { Box::from_raw(std::ptr::with_exposed_provenance_mut::<Block>(addr)) });
        }
    }
}

/// Two threads free three of the owner's blocks while it drains once; after they are done,
/// the stack holds exactly what the owner has not taken yet, and one more drain gives back
/// every block, each once.
#[test]
fn remote_frees_reach_the_owner_exactly_once() {
    model(|| {
        let heap = Heap::new(3);
        let freers: Vec<_> = [&[0, 1][..], &[2][..]]
            .into_iter()
            .map(|ids| {
                let heap = Arc::clone(&heap);
                let ids = ids.to_vec();
                thread::spawn(move || ids.into_iter().for_each(|id| heap.free_remote(id)))
            })
            .collect();
        let mut seen = Vec::new();
        heap.drain(&mut seen);
        for t in freers {
            t.join().unwrap();
        }
        assert_eq!(heap.remote.len_quiescent(), 3 - seen.len());
        heap.drain(&mut seen);
        seen.sort_unstable();
        assert_eq!(seen, [0, 1, 2], "every block once");
        assert!(heap.remote.take_all().is_null());
    });
}

/// A freer pushes while the owner drains twice: a block pushed between the two drains is in
/// the second, never in both, and the stack is empty after the freer is done and drained.
#[test]
fn remote_frees_between_drains_are_not_lost() {
    model(|| {
        let heap = Heap::new(2);
        let freer = {
            let heap = Arc::clone(&heap);
            thread::spawn(move || {
                heap.free_remote(0);
                heap.free_remote(1);
            })
        };
        let mut seen = Vec::new();
        heap.drain(&mut seen);
        heap.drain(&mut seen);
        freer.join().unwrap();
        heap.drain(&mut seen);
        seen.sort_unstable();
        assert_eq!(seen, [0, 1]);
    });
}
